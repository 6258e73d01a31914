//! Tensor parallelism on GPUs: a stage's tp ranks are GPUs driven by the
//! stage's one thread (each call queues work on every rank's stream, so
//! the GPUs run side by side), or ranks taking turns on one GPU.
//!
//! The split is the CPU's (model/block.rs): a rank holds the q, k, v columns
//! of its heads, a block of `c_fc`'s columns and the matching rows of the two
//! projections; LayerNorms are computed on every rank. The two row-parallel
//! products, and in backward the input gradients of the two column-parallel
//! ones, are sums over K-slices: each of a rank's `slices / size` slices is
//! a cuBLASLt product of its own into an f32 leaf, the rank's leaves are
//! summed by the pairwise tree (its subtree), the group all-gathers the
//! subtree sums and every rank joins them by the tree's upper levels
//! (kernels/tp.cu). So every `size` dividing `slices` adds the same numbers
//! in the same order. NCCL's ring all-reduce would not: its order depends on
//! the ring. Products that need no sum are cut into the same slices, so each
//! cuBLASLt call has the same shape whatever the number of ranks.
//!
//! Rank 0 (the owner) keeps the f32 master weights, AdamW's moments and the
//! embedding and head; followers keep the storage copy they compute with and
//! their gradients. Every gradient element is written by exactly one rank
//! (its slices, or the owner for what is not split) onto buffers filled with
//! -0.0, and x + (-0.0) is x for every x, so summing the ranks' gradients to
//! the owner is exact in any order. After AdamW the owner's storage copy is
//! broadcast back. The owner's memory is that of an unsplit stage less the
//! activations the followers hold: the split saves compute and activations,
//! not optimizer state.

mod llama;

use super::{Blocks, DeviceBuffer, GpuForward, GpuGrad, GpuInput, GpuPart, Sink};
use crate::kernels::cuda::matmul::{self, Out, View};
use crate::kernels::cuda::nccl::{self, Comm, NcclType};
use crate::kernels::cuda::tree::{self, MAX_NODES};
use crate::kernels::cuda::{adamw, attention, gelu, layernorm};
use crate::kernels::cuda::{ensure, CudaError, Elem, Gpu, Result};
use crate::model::params::block::*;
use crate::model::params::Family;
use crate::model::part::{Mode, PartSpec};
use crate::model::{Arch, Param};
use std::cell::Cell;

/// Which tensor-parallel rank a part computes, of how many, over how many slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuTp {
    pub rank: usize,
    pub size: usize,
    pub slices: usize,
}

impl GpuTp {
    /// The plain block: one rank, one slice.
    pub const ONE: GpuTp = GpuTp { rank: 0, size: 1, slices: 1 };

    /// Whether the block runs by slices (tp.rs) rather than as plain products.
    pub fn is_split(&self) -> bool {
        self.size > 1 || self.slices > 1
    }

    /// Slices of each split sum this rank computes.
    pub fn leaves(&self) -> usize {
        self.slices / self.size
    }

    pub(super) fn check(&self, cfg: &Arch) -> Result<()> {
        let GpuTp { rank, size, slices } = *self;
        // A Llama slice is whole key/value groups and a block of MLP rows (as llama.rs cuts it).
        ensure(
            cfg.family == Family::Gpt2
                || (cfg.kv_heads().is_multiple_of(slices) && cfg.ffn().is_multiple_of(slices)),
            || {
                format!(
                    "a Llama over {slices} tensor-parallel slices: they must divide the key/value heads \
                     ({}) and the MLP width ({})",
                    cfg.kv_heads(),
                    cfg.ffn()
                )
            },
        )?;
        ensure(
            size.is_power_of_two()
                && slices.is_power_of_two()
                && slices.is_multiple_of(size)
                && slices <= MAX_NODES
                && rank < size
                && cfg.n_head.is_multiple_of(slices),
            || {
                format!(
                    "tensor-parallel rank {rank} of {size} over {slices} slices: ranks and slices are powers \
                     of two, at most {MAX_NODES} slices, a multiple of the ranks that divides n_head = {}",
                    cfg.n_head
                )
            },
        )
    }
}

/// The address `e` elements of `T` past `ptr`.
fn at<T>(ptr: u64, e: usize) -> u64 {
    ptr + (e * std::mem::size_of::<T>()) as u64
}

/// A split product's shape on one rank: `width` columns (or rows) in all,
/// in `parts` equal blocks (q, k, v), each block cut into `slices` slices.
#[derive(Clone, Copy, Debug)]
struct Cut {
    /// One block's width over all ranks, and on this rank.
    full: usize,
    local: usize,
    /// One slice's width.
    per: usize,
    parts: usize,
    tp: GpuTp,
}

/// One product of a rank's: its slice j (0..leaves) of block q, starting at
/// column (or row) `local` of the rank's buffer and `global` of the weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    j: usize,
    q: usize,
    local: usize,
    global: usize,
}

impl Cut {
    fn new(width: usize, parts: usize, tp: GpuTp) -> Cut {
        let full = width / parts;
        Cut { full, local: full / tp.size, per: full / tp.slices, parts, tp }
    }

    /// The rank's products, slice-major: its leaves are global slices
    /// rank·leaves.., a whole subtree of the slice tree.
    fn pieces(self) -> impl Iterator<Item = Piece> {
        let first = self.tp.rank * self.tp.leaves();
        (0..self.tp.leaves()).flat_map(move |j| {
            (0..self.parts).map(move |q| Piece {
                j,
                q,
                local: q * self.local + j * self.per,
                global: q * self.full + (first + j) * self.per,
            })
        })
    }
}

impl<X: Elem> GpuPart<X> {
    fn cut(&self, width: usize, parts: usize) -> Cut {
        Cut::new(width, parts, self.tp)
    }

    /// Where this rank's subtree sum goes in the gathered buffer.
    fn gathered_at(&self, r: usize) -> u64 {
        at::<f32>(self.s.gathered.ptr(), r * self.n() * self.cfg.n_embd)
    }

    fn is_owner(&self) -> bool {
        self.tp.rank == 0
    }

    /// out (N, this rank's columns) = inp (N, C) · w[:, this rank's columns]
    /// + bias, one product per slice and block.
    fn column_slices(
        &self,
        gpu: &Gpu,
        out: &DeviceBuffer<X>,
        inp: &DeviceBuffer<X>,
        wb: (usize, usize),
        cut: Cut,
    ) -> Result<()> {
        let (n, c) = (self.n(), self.cfg.n_embd);
        let (w, bias) = (View::new(self.w(wb.0), cut.parts * cut.full), self.w(wb.1));
        let (o, x) = (View::new(out.ptr(), cut.parts * cut.local), View::new(inp.ptr(), c));
        for p in cut.pieces() {
            let (o, w, bias) = (o.at::<X>(0, p.local), w.at::<X>(0, p.global), Some(at::<X>(bias, p.global)));
            matmul::product_forward::<X>(gpu, o, Out::Storage, x, w, bias, (n, c, cut.per), false)?;
        }
        Ok(())
    }

    /// This rank's subtree sum of inp (N, K/size) · w[this rank's rows, :]
    /// (w is (K, C)), the bias joining global slice 0, into the gathered buffer.
    fn row_slices(&self, gpu: &Gpu, inp: &DeviceBuffer<X>, wb: (usize, usize), k: usize) -> Result<()> {
        let (n, c, cut) = (self.n(), self.cfg.n_embd, self.cut(k, 1));
        for p in cut.pieces() {
            let leaf = View::new(self.s.leaves.ptr(), c).at::<f32>(p.j * n, 0);
            let x = View::new(inp.ptr(), cut.local).at::<X>(0, p.local);
            let w = View::new(self.w(wb.0), c).at::<X>(p.global, 0);
            // The bias in f32 (the master copy), the leaf's type: it joins global slice 0.
            let bias = (p.global == 0).then(|| self.master.ptr_at(self.tensors[wb.1].offset));
            matmul::product_forward::<X>(gpu, leaf, Out::F32, x, w, bias, (n, cut.per, c), false)?;
        }
        self.subtree(gpu)
    }

    /// This rank's leaves summed by the slice tree into its place in the gathered buffer.
    fn subtree(&self, gpu: &Gpu) -> Result<()> {
        let (at_rank, leaves) = (self.gathered_at(self.tp.rank), self.s.leaves.ptr());
        tree::tree_sum_f32(gpu, at_rank, leaves, self.tp.leaves(), self.n() * self.cfg.n_embd)
    }

    /// The gathered subtree sums joined into `out` (+ `residual`).
    fn join(&self, gpu: &Gpu, out: &DeviceBuffer<X>, residual: Option<&DeviceBuffer<X>>) -> Result<()> {
        let nc = self.n() * self.cfg.n_embd;
        tree::tree_join::<X>(
            gpu,
            out.ptr(),
            self.s.gathered.ptr(),
            self.tp.size,
            nc,
            residual.map(|r| r.ptr()),
        )
    }

    /// Block l, up to the attention projection's subtree sum.
    fn tp_attention(&self, gpu: &Gpu, k: usize, l: usize, recomputing: bool) -> Result<()> {
        if self.cfg.family == Family::Llama {
            return self.llama_tp_attention(gpu, k, l, recomputing);
        }
        let Arch { block_size: t, n_embd: c, n_head: nh, .. } = self.cfg;
        let (n, base, size) = (self.n(), self.spec.block_base(&self.cfg, l), self.tp.size);
        let w = |i: usize| self.w(base + i);
        let x = &self.slots[k].stream[l];
        let a = self.forward_acts(k, l, recomputing).0.gpt2()?;
        layernorm::layernorm_forward(gpu, &a.ln1, &a.ln1_mean, &a.ln1_rstd, x, w(LN1W), w(LN1B), n, c)?;
        self.column_slices(gpu, &a.qkv, &a.ln1, (base + QKVW, base + QKVB), self.cut(3 * c, 3))?;
        attention::attention_forward(gpu, &a.atty, &a.lse, &a.qkv, self.b, t, c / size, nh / size)?;
        self.row_slices(gpu, &a.atty, (base + PROJW, base + PROJB), c)
    }

    /// Block l from res2 up to the MLP projection's subtree sum.
    fn tp_mlp(&self, gpu: &Gpu, k: usize, l: usize, recomputing: bool) -> Result<()> {
        if self.cfg.family == Family::Llama {
            return self.llama_tp_mlp(gpu, k, l, recomputing);
        }
        let (n, c, base) = (self.n(), self.cfg.n_embd, self.spec.block_base(&self.cfg, l));
        let w = |i: usize| self.w(base + i);
        let a = self.forward_acts(k, l, recomputing).0.gpt2()?;
        self.join(gpu, &a.res2, Some(&self.slots[k].stream[l]))?;
        layernorm::layernorm_forward(gpu, &a.ln2, &a.ln2_mean, &a.ln2_rstd, &a.res2, w(LN2W), w(LN2B), n, c)?;
        self.column_slices(gpu, &a.fch, &a.ln2, (base + FCW, base + FCB), self.cut(4 * c, 1))?;
        gelu::gelu_forward(gpu, &a.fch_gelu, &a.fch, n * 4 * c / self.tp.size)?;
        self.row_slices(gpu, &a.fch_gelu, (base + FCPW, base + FCPB), 4 * c)
    }

    /// Block l's output.
    fn tp_out(&self, gpu: &Gpu, k: usize, l: usize, recomputing: bool) -> Result<()> {
        if self.cfg.family == Family::Llama {
            return self.llama_tp_out(gpu, k, l, recomputing);
        }
        let (a, out) = self.forward_acts(k, l, recomputing);
        let a = a.gpt2()?;
        self.join(gpu, out, Some(&a.res2))
    }

    /// Gradients of this rank's rows of a row-parallel weight (K, C), from
    /// its input `inp` (N, K/size) and `dres`; the bias (not split) on rank 0.
    fn row_weight_grads(&self, gpu: &Gpu, inp: &DeviceBuffer<X>, wb: (usize, usize), k: usize) -> Result<()> {
        let (n, c, s, cut) = (self.n(), self.cfg.n_embd, &self.s, self.cut(k, 1));
        for p in cut.pieces() {
            let dw = View::new(self.g(wb.0), c).at::<f32>(p.global, 0);
            let x = View::new(inp.ptr(), cut.local).at::<X>(0, p.local);
            matmul::product_backward_weight::<X>(gpu, dw, View::new(s.dres.ptr(), c), x, (n, cut.per, c))?;
        }
        if self.is_owner() {
            matmul::bias_backward(gpu, self.g(wb.1), &s.bias_partial, &s.dres, n, c)?;
        }
        Ok(())
    }

    /// dx (N, K/size) = dres · w[this rank's rows, :]ᵀ, by slices.
    fn row_dx(&self, gpu: &Gpu, dx: &DeviceBuffer<X>, wi: usize, k: usize) -> Result<()> {
        let (n, c, cut) = (self.n(), self.cfg.n_embd, self.cut(k, 1));
        let dres = View::new(self.s.dres.ptr(), c);
        for p in cut.pieces() {
            let d = View::new(dx.ptr(), cut.local).at::<X>(0, p.local);
            let w = View::new(self.w(wi), c).at::<X>(p.global, 0);
            matmul::product_backward_input::<X>(gpu, d, Out::Storage, dres, w, (n, cut.per, c), false)?;
        }
        Ok(())
    }

    /// This rank's subtree sum of the input gradient of a column-parallel
    /// product: per slice, Σ over blocks of dy[:, slice] · w[:, slice]ᵀ.
    fn column_dx(&self, gpu: &Gpu, dy: &DeviceBuffer<X>, wi: usize, cut: Cut) -> Result<()> {
        let (n, c) = (self.n(), self.cfg.n_embd);
        let (d, w) =
            (View::new(dy.ptr(), cut.parts * cut.local), View::new(self.w(wi), cut.parts * cut.full));
        // A slice's blocks (q, k, v) add into its leaf in block order.
        for p in cut.pieces() {
            let leaf = View::new(self.s.leaves.ptr(), c).at::<f32>(p.j * n, 0);
            let (d, w) = (d.at::<X>(0, p.local), w.at::<X>(0, p.global));
            matmul::product_backward_input::<X>(gpu, leaf, Out::F32, d, w, (n, c, cut.per), p.q > 0)?;
        }
        self.subtree(gpu)
    }

    /// Gradients of this rank's columns of a column-parallel weight (C,
    /// width) and bias, from dy (N, this rank's columns) and the input (N, C).
    fn column_weight_grads(
        &self,
        gpu: &Gpu,
        dy: &DeviceBuffer<X>,
        inp: &DeviceBuffer<X>,
        wb: (usize, usize),
        cut: Cut,
    ) -> Result<()> {
        let (n, c) = (self.n(), self.cfg.n_embd);
        let dy_view = View::new(dy.ptr(), cut.parts * cut.local);
        let (dw, x) = (View::new(self.g(wb.0), cut.parts * cut.full), View::new(inp.ptr(), c));
        for p in cut.pieces() {
            let (dw, d) = (dw.at::<f32>(0, p.global), dy_view.at::<X>(0, p.local));
            matmul::product_backward_weight::<X>(gpu, dw, d, x, (n, c, cut.per))?;
        }
        for q in 0..cut.parts {
            let db = at::<f32>(self.g(wb.1), q * cut.full + self.tp.rank * cut.local);
            let d = dy_view.at::<X>(0, q * cut.local);
            matmul::bias_backward_view::<X>(gpu, db, &self.s.bias_partial, d, n, cut.local)?;
        }
        Ok(())
    }

    /// LayerNorm's backward: the input's gradient on every rank, the
    /// weights' (not split) on rank 0.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_back(
        &self,
        gpu: &Gpu,
        inp: &DeviceBuffer<X>,
        wb: (usize, usize),
        mean: &DeviceBuffer<f32>,
        rstd: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let (n, c, s) = (self.n(), self.cfg.n_embd, &self.s);
        layernorm::layernorm_backward_input(gpu, &s.dres, &s.dln, inp, self.w(wb.0), mean, rstd, n, c)?;
        if self.is_owner() {
            let (gw, gb) = (self.g(wb.0), self.g(wb.1));
            layernorm::layernorm_backward_weight(gpu, gw, gb, &s.ln_partial, &s.dln, inp, mean, rstd, n, c)?;
        }
        Ok(())
    }

    /// Backward of block l's MLP projection and GELU, up to the subtree sum
    /// of ∂L/∂ln2.
    fn tp_back_mlp(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        if self.cfg.family == Family::Llama {
            return self.llama_tp_back_mlp(gpu, k, l);
        }
        let (n, c, base, s) = (self.n(), self.cfg.n_embd, self.spec.block_base(&self.cfg, l), &self.s);
        let a = self.backward_acts(k, l).gpt2()?;
        self.row_weight_grads(gpu, &a.fch_gelu, (base + FCPW, base + FCPB), 4 * c)?;
        self.row_dx(gpu, &s.dfch, base + FCPW, 4 * c)?;
        gelu::gelu_backward(gpu, &s.dfch, &a.fch, &s.dfch, n * 4 * c / self.tp.size)?;
        self.column_dx(gpu, &s.dfch, base + FCW, self.cut(4 * c, 1))
    }

    /// From ∂L/∂ln2's sums through attention, up to the subtree sum of ∂L/∂ln1.
    fn tp_back_attention(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        if self.cfg.family == Family::Llama {
            return self.llama_tp_back_attention(gpu, k, l);
        }
        let Arch { block_size: t, n_embd: c, n_head: nh, .. } = self.cfg;
        let (base, s, size) = (self.spec.block_base(&self.cfg, l), &self.s, self.tp.size);
        let a = self.backward_acts(k, l).gpt2()?;
        self.join(gpu, &s.dln, None)?;
        self.column_weight_grads(gpu, &s.dfch, &a.ln2, (base + FCW, base + FCB), self.cut(4 * c, 1))?;
        self.layernorm_back(gpu, &a.res2, (base + LN2W, base + LN2B), &a.ln2_mean, &a.ln2_rstd)?;
        self.row_weight_grads(gpu, &a.atty, (base + PROJW, base + PROJB), c)?;
        self.row_dx(gpu, &s.datty, base + PROJW, c)?;
        attention::attention_backward(
            gpu,
            &s.dqkv,
            &s.delta,
            &s.datty,
            &a.qkv,
            &a.atty,
            &a.lse,
            self.b,
            t,
            c / size,
            nh / size,
        )?;
        self.column_dx(gpu, &s.dqkv, base + QKVW, self.cut(3 * c, 3))
    }

    /// From ∂L/∂ln1's sums to ∂L/∂(block input) in `dres`.
    fn tp_back_input(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        if self.cfg.family == Family::Llama {
            return self.llama_tp_back_input(gpu, k, l);
        }
        let (c, base, s) = (self.cfg.n_embd, self.spec.block_base(&self.cfg, l), &self.s);
        let a = self.backward_acts(k, l).gpt2()?;
        self.join(gpu, &s.dln, None)?;
        self.column_weight_grads(gpu, &s.dqkv, &a.ln1, (base + QKVW, base + QKVB), self.cut(3 * c, 3))?;
        let x = &self.slots[k].stream[l];
        self.layernorm_back(gpu, x, (base + LN1W, base + LN1B), &a.ln1_mean, &a.ln1_rstd)
    }
}

/// How a stage's tp ranks reach each other.
enum TpComm {
    /// One rank: nothing to exchange.
    Alone,
    /// Every rank on one GPU (taking turns on its stream): copies.
    OneDevice,
    /// One GPU per rank, one communicator each, all driven from this thread.
    Nccl(Vec<Comm>),
}

/// The GPUs of one stage's tensor-parallel ranks and how they exchange.
pub struct TpDevices {
    gpus: Vec<Gpu>,
    ranks: usize,
    comm: TpComm,
}

impl TpDevices {
    /// One GPU, one rank.
    pub fn single(gpu: Gpu) -> TpDevices {
        TpDevices { gpus: vec![gpu], ranks: 1, comm: TpComm::Alone }
    }

    /// `ranks` ranks taking turns on one GPU (how one GPU checks the split).
    pub fn one_device(gpu: Gpu, ranks: usize) -> TpDevices {
        let comm = if ranks > 1 { TpComm::OneDevice } else { TpComm::Alone };
        TpDevices { gpus: vec![gpu], ranks, comm }
    }

    /// The ranks' GPUs by ordinal, rank order: all one GPU (the ranks take
    /// turns on it), or all different (NCCL between them).
    pub fn open(ordinals: &[usize]) -> Result<TpDevices> {
        let first = *ordinals.first().ok_or_else(|| CudaError::Shape("a stage needs a GPU".into()))?;
        if ordinals.iter().all(|&o| o == first) {
            return Ok(TpDevices::one_device(Gpu::new(first)?, ordinals.len()));
        }
        let mut sorted = ordinals.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        ensure(sorted.len() == ordinals.len(), || {
            format!(
                "a stage's tensor-parallel ranks take one GPU each or all share one; GPUs {ordinals:?} \
                 repeat some and not all"
            )
        })?;
        let gpus = ordinals.iter().map(|&o| Gpu::new(o)).collect::<Result<Vec<_>>>()?;
        let comms = Comm::init_all(&gpus.iter().collect::<Vec<_>>())?;
        gpus[0].bind()?;
        Ok(TpDevices { ranks: gpus.len(), gpus, comm: TpComm::Nccl(comms) })
    }

    /// Rank `r`'s GPU.
    pub fn gpu(&self, r: usize) -> &Gpu {
        &self.gpus[r.min(self.gpus.len() - 1)]
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Runs `f` for every rank with its GPU's context current, then makes
    /// rank 0's current again (the owner's work goes on after).
    fn each<P>(&self, parts: &[P], mut f: impl FnMut(&P, &Gpu) -> Result<()>) -> Result<()> {
        for (r, p) in parts.iter().enumerate() {
            let gpu = self.gpu(r);
            gpu.bind()?;
            f(p, gpu)?;
        }
        self.gpu(0).bind()
    }

    /// One collective over the ranks' communicators, its calls grouped (one
    /// thread drives them all), each with its GPU current; rank 0's current
    /// after, as NCCL may leave another's.
    fn grouped(&self, comms: &[Comm], mut call: impl FnMut(&Comm, &Gpu, usize) -> Result<()>) -> Result<()> {
        nccl::group(|| {
            for (r, comm) in comms.iter().enumerate() {
                let gpu = self.gpu(r);
                gpu.bind()?;
                call(comm, gpu, r)?;
            }
            Ok(())
        })?;
        self.gpu(0).bind()
    }

    /// Every rank's `count` f32s at `bufs[r] + r·count` to every rank's
    /// `bufs[o] + r·count`.
    fn all_gather(&self, bufs: &[u64], count: usize) -> Result<()> {
        match &self.comm {
            TpComm::Alone => Ok(()),
            TpComm::OneDevice => {
                let gpu = self.gpu(0);
                for (r, &src) in bufs.iter().enumerate() {
                    for (o, &dst) in bufs.iter().enumerate() {
                        if o != r {
                            gpu.copy_raw(at::<f32>(dst, r * count), at::<f32>(src, r * count), count * 4)?;
                        }
                    }
                }
                Ok(())
            }
            TpComm::Nccl(comms) => self.grouped(comms, |comm, gpu, r| {
                comm.all_gather::<f32>(gpu, at::<f32>(bufs[r], r * count), bufs[r], count)
            }),
        }
    }

    /// Rank 0's `count` elements at `bufs[0]` to every rank's `bufs[r]`.
    fn broadcast<T: NcclType>(&self, bufs: &[u64], count: usize) -> Result<()> {
        match &self.comm {
            TpComm::Alone => Ok(()),
            TpComm::OneDevice => {
                let bytes = count * std::mem::size_of::<T>();
                bufs[1..].iter().try_for_each(|&dst| self.gpu(0).copy_raw(dst, bufs[0], bytes))
            }
            TpComm::Nccl(comms) => {
                self.grouped(comms, |comm, gpu, r| comm.broadcast::<T>(gpu, bufs[r], count, 0))
            }
        }
    }

    /// Rank 0's `count` f32s at `bufs[0]` += every other rank's (exact here:
    /// every element is -0.0 on all ranks but at most one).
    fn sum_to_first(&self, bufs: &[u64], count: usize) -> Result<()> {
        match &self.comm {
            TpComm::Alone => Ok(()),
            TpComm::OneDevice => {
                let gpu = self.gpu(0);
                bufs[1..].iter().try_for_each(|&b| adamw::add_f32(gpu, bufs[0], bufs[0], b, count))
            }
            TpComm::Nccl(comms) => {
                self.grouped(comms, |comm, gpu, r| comm.reduce_sum_f32(gpu, bufs[r], count, 0))
            }
        }
    }
}

/// One stage part over its tensor-parallel ranks (one rank: the plain part).
pub struct TpPart<X: Elem> {
    ranks: Vec<GpuPart<X>>,
    /// Each rank's buffers the group exchanges, by rank: their addresses
    /// never change, so a step gathers no lists.
    at: RankBuffers,
    /// Followers hold gradients the owner has not summed yet.
    pending: Cell<bool>,
}

/// Device addresses of one buffer on every rank, per buffer the group exchanges.
struct RankBuffers {
    gathered: Vec<u64>,
    grads: Vec<u64>,
    params: Vec<u64>,
    dres: Vec<u64>,
    /// Per activation slot: the part's input.
    inputs: Vec<Vec<u64>>,
}

impl RankBuffers {
    fn of<X: Elem>(ranks: &[GpuPart<X>]) -> RankBuffers {
        let all = |f: &dyn Fn(&GpuPart<X>) -> u64| ranks.iter().map(f).collect::<Vec<u64>>();
        RankBuffers {
            gathered: all(&|p| p.s.gathered.ptr()),
            grads: all(&|p| p.grads.ptr()),
            params: all(&|p| p.params.ptr()),
            dres: all(&|p| p.s.dres.ptr()),
            inputs: (0..ranks[0].slots.len()).map(|k| all(&|p| p.slots[k].stream[0].ptr())).collect(),
        }
    }
}

/// The part's ranks in rank order, for one block's phases.
type Ranks<'a, X> = [&'a GpuPart<X>];

fn forward_block<X: Elem>(
    dev: &TpDevices,
    ranks: &Ranks<X>,
    at: &RankBuffers,
    k: usize,
    l: usize,
    rc: bool,
) -> Result<()> {
    let gather = || dev.all_gather(&at.gathered, ranks[0].n() * ranks[0].cfg.n_embd);
    dev.each(ranks, |p, gpu| p.tp_attention(gpu, k, l, rc))?;
    gather()?;
    dev.each(ranks, |p, gpu| p.tp_mlp(gpu, k, l, rc))?;
    gather()?;
    dev.each(ranks, |p, gpu| p.tp_out(gpu, k, l, rc))
}

fn backward_block<X: Elem>(
    dev: &TpDevices,
    ranks: &Ranks<X>,
    at: &RankBuffers,
    k: usize,
    l: usize,
) -> Result<()> {
    let gather = || dev.all_gather(&at.gathered, ranks[0].n() * ranks[0].cfg.n_embd);
    dev.each(ranks, |p, gpu| p.tp_back_mlp(gpu, k, l))?;
    gather()?;
    dev.each(ranks, |p, gpu| p.tp_back_attention(gpu, k, l))?;
    gather()?;
    dev.each(ranks, |p, gpu| p.tp_back_input(gpu, k, l))
}

impl<X: Elem + NcclType> TpPart<X> {
    /// The part holding `params` over `dev`'s ranks, each sum over `slices`
    /// slices (one rank and one slice: the plain part).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: &TpDevices,
        cfg: Arch,
        spec: PartSpec,
        b: usize,
        recompute: bool,
        live: usize,
        params: &[Param],
        slices: usize,
    ) -> Result<Self> {
        let size = dev.ranks();
        let mut ranks = Vec::with_capacity(size);
        for rank in 0..size {
            let gpu = dev.gpu(rank);
            gpu.bind()?;
            let tp = GpuTp { rank, size, slices };
            ranks.push(GpuPart::new_rank(gpu, cfg, spec.clone(), b, recompute, live, params, tp)?);
        }
        dev.gpu(0).bind()?;
        Ok(TpPart { at: RankBuffers::of(&ranks), ranks, pending: Cell::new(false) })
    }

    /// Rank 0's part: the master weights, optimizer, embedding and head.
    /// Read gradients through it only after `sum_grads`.
    pub fn owner(&self) -> &GpuPart<X> {
        &self.ranks[0]
    }

    pub fn owner_mut(&mut self) -> &mut GpuPart<X> {
        &mut self.ranks[0]
    }

    /// The owner, its gradients summed over the ranks first.
    pub fn summed(&self, dev: &TpDevices) -> Result<&GpuPart<X>> {
        self.sum_grads(dev)?;
        Ok(&self.ranks[0])
    }

    /// [`Self::summed`], to change the owner's gradients.
    pub fn summed_mut(&mut self, dev: &TpDevices) -> Result<&mut GpuPart<X>> {
        self.sum_grads(dev)?;
        Ok(&mut self.ranks[0])
    }

    fn split(&self) -> bool {
        self.ranks[0].tp.is_split()
    }

    /// Device bytes over every rank.
    pub fn device_bytes(&self) -> usize {
        self.ranks.iter().map(GpuPart::device_bytes).sum()
    }

    /// Zero every gradient accumulator; a split part's with -0.0 (see the module note).
    pub fn zero_grads(&mut self, dev: &TpDevices) -> Result<()> {
        self.pending.set(false);
        if !self.split() {
            return self.ranks[0].zero_grads(dev.gpu(0));
        }
        dev.each(&self.ranks, |p, gpu| {
            gpu.fill_f32(&p.grads, -0.0)?;
            gpu.zero(&p.head_grad)
        })
    }

    /// `GpuPart::forward` over the ranks.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        dev: &TpDevices,
        mb: usize,
        input: GpuInput<X>,
        targets: Option<&[u32]>,
        mode: Mode,
        argmax: Option<&mut [u32]>,
        sink: Option<Sink<X>>,
    ) -> Result<GpuForward> {
        if !self.split() {
            return self.ranks[0].forward(dev.gpu(0), mb, input, targets, mode, argmax, sink);
        }
        let (owner, followers) = self.ranks.split_first_mut().expect("rank 0");
        let (followers, at): (&[GpuPart<X>], _) = (followers, &self.at);
        let blocks: Blocks<X> = &mut |owner, _, k| {
            let ranks: Vec<&GpuPart<X>> = std::iter::once(&*owner).chain(followers).collect();
            dev.broadcast::<X>(&at.inputs[k], owner.n() * owner.cfg.n_embd)?;
            (0..owner.n_blocks()).try_for_each(|l| forward_block(dev, &ranks, at, k, l, false))
        };
        owner.forward_over(dev.gpu(0), mb, input, targets, mode, argmax, sink, blocks)
    }

    /// `GpuPart::backward` over the ranks.
    pub fn backward(
        &mut self,
        dev: &TpDevices,
        mb: usize,
        dout: GpuGrad<X>,
        sink: Option<Sink<X>>,
    ) -> Result<Option<Vec<f32>>> {
        if !self.split() {
            return self.ranks[0].backward(dev.gpu(0), mb, dout, sink);
        }
        self.pending.set(true);
        let (owner, followers) = self.ranks.split_first_mut().expect("rank 0");
        let (followers, at): (&[GpuPart<X>], _) = (followers, &self.at);
        let blocks: Blocks<X> = &mut |owner, _, k| {
            let ranks: Vec<&GpuPart<X>> = std::iter::once(&*owner).chain(followers).collect();
            dev.broadcast::<X>(&at.dres, owner.n() * owner.cfg.n_embd)?;
            for l in (0..owner.n_blocks()).rev() {
                if owner.recompute {
                    forward_block(dev, &ranks, at, k, l, true)?;
                }
                backward_block(dev, &ranks, at, k, l)?;
            }
            Ok(())
        };
        owner.backward_over(dev.gpu(0), mb, dout, sink, blocks)
    }

    /// The value every gradient accumulator starts from (see `zero_grads`).
    fn zero_value(&self) -> f32 {
        if self.split() {
            -0.0
        } else {
            0.0
        }
    }

    /// The head's leaf of the microbatch whose forward just ran, moved into
    /// `leaf` (the head runs on the owner only).
    pub fn take_head_leaf(&mut self, dev: &TpDevices, leaf: &DeviceBuffer<f32>) -> Result<()> {
        let zero = self.zero_value();
        self.ranks[0].take_head_leaf(dev.gpu(0), leaf, zero)
    }

    /// The body leaf of the microbatch whose backward just ran, summed over
    /// the ranks, moved into `leaf`; every accumulator starts again. The
    /// head's are already reset (`take_head_leaf` runs after each forward).
    pub fn take_body_leaf(&mut self, dev: &TpDevices, leaf: &DeviceBuffer<f32>) -> Result<()> {
        self.sum_grads(dev)?;
        self.ranks[0].copy_body_leaf(dev.gpu(0), leaf)?;
        self.zero_grads(dev)
    }

    /// Sums the followers' gradients into the owner's (once per step, before
    /// anything reads them).
    fn sum_grads(&self, dev: &TpDevices) -> Result<()> {
        if !self.pending.replace(false) {
            return Ok(());
        }
        dev.sum_to_first(&self.at.grads, self.ranks[0].grads.len())
    }

    /// Gives every follower the owner's storage copy of the weights (after
    /// AdamW, a rollback or a resume).
    pub fn share_weights(&self, dev: &TpDevices) -> Result<()> {
        dev.broadcast::<X>(&self.at.params, self.ranks[0].params.len())
    }

    /// AdamW on the owner, then the new weights to the followers.
    pub fn adamw(&mut self, dev: &TpDevices, hyper: &crate::optim::Hyper, lr: f64, clip: f32) -> Result<()> {
        self.sum_grads(dev)?;
        self.ranks[0].adamw(dev.gpu(0), hyper, lr, clip)?;
        self.share_weights(dev)
    }

    /// Sets the weights on every rank.
    pub fn load_weights(&mut self, dev: &TpDevices, weights: &[&[f32]]) -> Result<()> {
        self.ranks[0].load_weights(dev.gpu(0), weights)?;
        self.share_weights(dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each element of 0..len covered by exactly one of `runs` (start, length).
    fn tiles(len: usize, runs: impl Iterator<Item = (usize, usize)>) -> bool {
        let mut hits = vec![0u8; len];
        for (start, n) in runs {
            for h in hits.get_mut(start..start + n).into_iter().flatten() {
                *h += 1;
            }
            if start + n > len {
                return false;
            }
        }
        hits.iter().all(|&h| h == 1)
    }

    #[test]
    fn every_rank_s_pieces_tile_the_weight_once_and_its_own_buffer_once() {
        for (width, parts) in [(3 * 256, 3), (4 * 256, 1), (256, 1)] {
            for slices in [1, 2, 4, 8] {
                for size in [1, 2, 4, 8].into_iter().filter(|&s| s <= slices) {
                    let cuts: Vec<Cut> =
                        (0..size).map(|rank| Cut::new(width, parts, GpuTp { rank, size, slices })).collect();
                    let all = cuts.iter().flat_map(|c| c.pieces().map(move |p| (p.global, c.per)));
                    assert!(tiles(width, all), "width {width}, {parts} parts, {slices} slices, tp {size}");
                    for cut in &cuts {
                        let own = cut.pieces().map(|p| (p.local, cut.per));
                        assert!(tiles(parts * cut.local, own), "{cut:?}");
                    }
                }
            }
        }
    }

    /// Rank r's columns of a (rows, width) weight as its GPU pieces place
    /// them, or its rows when `rows_cut` (the weight is (width, cols)).
    fn gpu_shard(w: &[f32], cols: usize, cut: Cut, rows_cut: bool) -> Vec<f32> {
        if rows_cut {
            return cut
                .pieces()
                .flat_map(|p| w[p.global * cols..(p.global + cut.per) * cols].to_vec())
                .collect();
        }
        let local_width = cut.parts * cut.local;
        let mut out = vec![0.0; w.len() / cols * local_width];
        for (row, src) in w.chunks(cols).enumerate() {
            for p in cut.pieces() {
                let dst = row * local_width + p.local;
                out[dst..dst + cut.per].copy_from_slice(&src[p.global..p.global + cut.per]);
            }
        }
        out
    }

    #[test]
    fn a_gpu_rank_holds_the_cpu_rank_s_shard_of_every_split_weight() {
        use crate::model::block::{cut_of, shard};
        let c = 16;
        let gpt2 = crate::model::Arch::gpt2(1, 4, c, 10, 4);
        for (i, width, parts, rows_cut) in [
            (QKVW, 3 * c, 3, false),
            (QKVB, 3 * c, 3, false),
            (FCW, 4 * c, 1, false),
            (PROJW, c, 1, true),
            (FCPW, 4 * c, 1, true),
        ] {
            let (rows, cols) = match (rows_cut, i) {
                (true, _) => (width, c),
                (false, QKVB) => (1, width),
                (false, _) => (c, width),
            };
            let w: Vec<f32> = (0..rows * cols).map(|e| e as f32).collect();
            for (size, slices) in [(1, 4), (2, 4), (4, 4), (2, 8)] {
                for rank in 0..size {
                    let cut = Cut::new(width, parts, GpuTp { rank, size, slices });
                    let gpu = gpu_shard(&w, cols, cut, rows_cut);
                    assert_eq!(
                        gpu,
                        shard(cut_of(&gpt2, i), &w, cols, rank, size),
                        "tensor {i}, rank {rank} of {size}, {slices} slices"
                    );
                }
            }
        }
    }

    #[test]
    fn a_rank_s_slices_are_the_same_heads_in_q_k_and_v_and_a_whole_subtree() {
        let tp = GpuTp { rank: 1, size: 2, slices: 8 };
        let cut = Cut::new(3 * 512, 3, tp);
        for p in cut.pieces() {
            // Global slice of this piece within its block: the rank's leaves are 4..8.
            let slice = (p.global - p.q * cut.full) / cut.per;
            assert_eq!(slice, 4 + p.j, "{p:?}");
            assert_eq!(p.local, p.q * cut.local + p.j * cut.per);
        }
        // Only global slice 0 (rank 0's first leaf) takes the bias.
        let zero = |rank| {
            Cut::new(256, 1, GpuTp { rank, size: 2, slices: 4 }).pieces().filter(|p| p.global == 0).count()
        };
        assert_eq!((zero(0), zero(1)), (1, 0));
    }

    #[test]
    fn ranks_and_slices_that_do_not_divide_the_heads_or_each_other_are_refused() {
        let cfg = Arch::gpt2(2, 4, 256, 100, 8);
        let ok = |rank, size, slices| GpuTp { rank, size, slices }.check(&cfg).is_ok();
        assert!(ok(0, 1, 1) && ok(1, 2, 4) && ok(3, 4, 4));
        assert!(!ok(0, 4, 2), "fewer slices than ranks");
        assert!(!ok(0, 1, 8), "a slice must be whole heads");
        assert!(!ok(2, 2, 4), "rank past the group");
        assert!(!ok(0, 3, 3), "not a power of two");
    }
}
