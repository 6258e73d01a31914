//! Tensor parallelism on GPUs: a stage's tp ranks are GPUs driven by the
//! stage's one thread (each call queues work on every rank's stream, so
//! the GPUs run side by side), or ranks taking turns on one GPU.
//!
//! The split is the CPU's (model/block/, `Role::cut`), and the block it
//! splits is the one block (tp/block.rs, whatever the family): a rank holds
//! the q rows of its query heads, the k and v rows of their key/value heads,
//! a row block of gate and up (biases with their rows), and the matching
//! input columns of o and down; norms and o's and down's biases are whole,
//! the norms computed on every rank. The two row-parallel products, and in
//! backward the input gradients of the column-parallel ones, are sums over
//! K-slices: each of a rank's `slices / size` slices is a cuBLASLt product
//! of its own into an f32 leaf, the rank's leaves are summed by the
//! pairwise tree (its subtree), the group all-gathers the subtree sums and
//! every rank joins them by the tree's upper levels (kernels/tp.cu); the q/k
//! norms' gains, whole over cut heads, have their gradient summed so too,
//! joined on the owner (tp/block.rs). So
//! every `size` dividing `slices` adds the same numbers in the same order.
//! NCCL's ring all-reduce would not: its order depends on the ring.
//! Products that need no sum are cut into the same slices, so each
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

mod block;

use super::{Blocks, DeviceBuffer, GpuForward, GpuGrad, GpuInput, GpuPart, Sink};
use crate::kernels::cuda::adamw;
use crate::kernels::cuda::nccl::{self, Comm, NcclType};
use crate::kernels::cuda::tree::{self, MAX_NODES};
use crate::kernels::cuda::{ensure, CudaError, Elem, Gpu, Result};
use crate::model::part::{Mode, PartSpec};
use crate::model::recompute::Recompute;
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
        // A slice is whole query heads, whole key/value groups and a block of MLP rows (as tp/block.rs cuts it).
        ensure(cfg.kv_heads().is_multiple_of(slices) && cfg.ffn().is_multiple_of(slices), || {
            format!(
                "a block over {slices} tensor-parallel slices: they must divide the key/value heads ({}) \
                 and the MLP width ({})",
                cfg.kv_heads(),
                cfg.ffn()
            )
        })?;
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

impl<X: Elem> GpuPart<X> {
    /// Where this rank's subtree sum goes in the gathered buffer.
    fn gathered_at(&self, r: usize) -> u64 {
        at::<f32>(self.s.gathered.ptr(), r * self.n() * self.cfg.n_embd)
    }

    fn is_owner(&self) -> bool {
        self.tp.rank == 0
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
    /// The q/k norms' gain gradient nodes (q/k norm only).
    head_gathered: Vec<u64>,
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
            head_gathered: all(&|p| p.s.head_gathered.ptr()),
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
    let cfg = &ranks[0].cfg;
    if cfg.qk_norm {
        // Every rank's subtree sums of the q and k norms' gain gradients.
        dev.all_gather(&at.head_gathered, 2 * cfg.heads().hs)?;
    }
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
        recompute: Recompute,
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
                if owner.recompute == Recompute::Full {
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
