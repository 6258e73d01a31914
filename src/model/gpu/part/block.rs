//! The one block on the GPU: the twin of model/block/mod.rs's block on one
//! rank, its kinds chosen by the model's settings ([`Arch`]) and never by a
//! family's name — LayerNorm (with a bias) or RMSNorm, q/k/v/o and the MLP's
//! products with biases or not, the per-head RMSNorm of q and k (Qwen3's,
//! after their products and before RoPE), RoPE on rotary models (a learned
//! position table is added by the embedding instead), grouped-query
//! attention, causal or in a sliding window (Mistral's), and gelu(up) or
//! silu(gate)·up — in the CPU block's kernel order, read from the part's
//! flat buffers.
//!
//! Weights keep `nn.Linear`'s (out, in) layout, so a forward product reads
//! its weight transposed (`product_linear`, its bias in cuBLASLt's
//! epilogue), backward's input gradient is the plain product, and the
//! weight gradient lands in (out, in) directly; a bias's gradient is the
//! two-pass column sum of its output gradient (no atomics). q, k and v are
//! written into one (N, (NH + 2·NKV)·HS) buffer through strided views, the
//! layout the attention kernels read; with the q/k norm, q's and k's
//! products go to a second such buffer (`qkv_raw`) that their norms read,
//! and backward's products read q's and k's gradients before the norms from
//! `dqkv_raw`, v's from `dqkv` (`product_view`). The MLP's first products
//! go into one (N, 2F) buffer, gate's then up's (SwiGLU), or (N, F), up's (GELU).
//!
//! The q and k norms' gains are whole (HS) while their heads are cut over
//! ranks, so their gradient is a split sum like the row-parallel products':
//! the plain block writes it in one kernel call (the rows in chunk order,
//! each chunk's rows then heads in order); the split block (tp/block.rs)
//! writes a partial per slice and joins them by the slice tree.
//!
//! Under selective recompute (`model::recompute`) a microbatch's set keeps
//! neither norm's output nor the activation: every block writes them into
//! the part's one [`Remade`] set in forward, and `remake` writes them there
//! again, by the same kernel calls, before the block's backward reads them.
//!
//! This is the plain block (one rank, one slice); tp/block.rs runs it split
//! over tensor-parallel ranks. The norm and activation helpers here serve
//! both, and the head.
//!
//! Shapes: N = B·T rows, C = n_embd, NH, NKV, HS as in `arch.rs`, F = the
//! MLP's width; per rank the heads and F are the rank's share.

use super::{GpuPart, Result};
use crate::kernels::cuda::attention::Window;
use crate::kernels::cuda::matmul::{self, Out, View};
use crate::kernels::cuda::rmsnorm::HeadRun;
use crate::kernels::cuda::{attention, gelu, layernorm, residual, rmsnorm, rope, swiglu};
use crate::kernels::cuda::{ensure, CudaError, DeviceBuffer, Elem, Gpu};
use crate::model::arch::{Arch, BlockIndex, Mlp, Norm, Role};
use crate::model::block::Share;

/// One block's intermediates for one microbatch on one rank, kept from
/// forward for backward (the CPU's `BlockActs`, field for field). Kept for
/// selective recompute, `n1`, `n2` and `act` are empty: the block reads them
/// from the part's [`Remade`] through [`Acts`], which forward writes and
/// backward writes again.
pub(in crate::model::gpu) struct BlockActs<X: Elem> {
    /// Read through [`Acts`] (a selective set's is empty).
    n1: DeviceBuffer<X>,
    /// LayerNorm only (empty for RMSNorm).
    pub(in crate::model::gpu::part) mean1: DeviceBuffer<f32>,
    pub(in crate::model::gpu::part) rstd1: DeviceBuffer<f32>,
    /// (N, W): q and k after their norms and RoPE, then v.
    pub(in crate::model::gpu::part) qkv: DeviceBuffer<X>,
    /// (N, W) q/k norm only (else empty): q's and k's products before their
    /// norms (v's columns unused, so the norms' runs address both alike).
    pub(in crate::model::gpu::part) qkv_raw: DeviceBuffer<X>,
    /// (N, NH) and (N, NKV) q/k norm only: the norms' rstd.
    pub(in crate::model::gpu::part) rstd_q: DeviceBuffer<f32>,
    pub(in crate::model::gpu::part) rstd_k: DeviceBuffer<f32>,
    pub(in crate::model::gpu::part) atty: DeviceBuffer<X>,
    pub(in crate::model::gpu::part) lse: DeviceBuffer<f32>,
    /// The residual stream after attention.
    pub(in crate::model::gpu::part) h: DeviceBuffer<X>,
    /// Read through [`Acts`] (a selective set's is empty).
    n2: DeviceBuffer<X>,
    pub(in crate::model::gpu::part) mean2: DeviceBuffer<f32>,
    pub(in crate::model::gpu::part) rstd2: DeviceBuffer<f32>,
    /// (N, 2F) gate's then up's outputs (SwiGLU), or (N, F) up's (GELU).
    pub(in crate::model::gpu::part) hidden: DeviceBuffer<X>,
    /// (N, F) the activation, down's input; read through [`Acts`] (a
    /// selective set's is empty).
    act: DeviceBuffer<X>,
}

impl<X: Elem> BlockActs<X> {
    /// For a rank of `size` in a model of `cfg`'s settings; without `whole`,
    /// the set selective recompute keeps (no n1, n2 or act).
    pub(super) fn new(gpu: &Gpu, cfg: &Arch, b: usize, size: usize, whole: bool) -> Result<Self> {
        let (t, s) = (cfg.block_size, Share::of(cfg, size));
        let (n, c, heads) = (b * t, s.c, s.heads);
        let mean = if cfg.norm == Norm::LayerNorm { n } else { 0 };
        let qk = usize::from(cfg.qk_norm);
        let kept = usize::from(whole);
        Ok(BlockActs {
            n1: gpu.alloc(kept * n * c)?,
            mean1: gpu.alloc(mean)?,
            rstd1: gpu.alloc(n)?,
            qkv: gpu.alloc(n * heads.qkv_width())?,
            qkv_raw: gpu.alloc(qk * n * heads.qkv_width())?,
            rstd_q: gpu.alloc(qk * n * heads.nh)?,
            rstd_k: gpu.alloc(qk * n * heads.nkv)?,
            atty: gpu.alloc(n * heads.out_width())?,
            lse: gpu.alloc(b * heads.nh * t)?,
            h: gpu.alloc(n * c)?,
            n2: gpu.alloc(kept * n * c)?,
            mean2: gpu.alloc(mean)?,
            rstd2: gpu.alloc(n)?,
            hidden: gpu.alloc(n * s.hidden(cfg))?,
            act: gpu.alloc(kept * n * s.f)?,
        })
    }

    pub(super) fn bytes(&self) -> usize {
        [&self.n1, &self.qkv, &self.qkv_raw, &self.atty, &self.h, &self.n2, &self.hidden, &self.act]
            .iter()
            .map(|b| b.bytes())
            .sum::<usize>()
            + [&self.mean1, &self.rstd1, &self.rstd_q, &self.rstd_k, &self.lse, &self.mean2, &self.rstd2]
                .iter()
                .map(|b| b.bytes())
                .sum::<usize>()
    }
}

/// The tensors selective recompute makes again instead of keeping (the
/// CPU's `Remade`): both norms' outputs and the MLP's activation, one
/// block's worth per rank, shared by every block and microbatch of a part.
pub(super) struct Remade<X: Elem> {
    n1: DeviceBuffer<X>,
    n2: DeviceBuffer<X>,
    act: DeviceBuffer<X>,
}

impl<X: Elem> Remade<X> {
    pub(super) fn new(gpu: &Gpu, cfg: &Arch, b: usize, size: usize) -> Result<Self> {
        let (n, s) = (b * cfg.block_size, Share::of(cfg, size));
        Ok(Remade { n1: gpu.alloc(n * s.c)?, n2: gpu.alloc(n * s.c)?, act: gpu.alloc(n * s.f)? })
    }

    pub(super) fn bytes(&self) -> usize {
        self.n1.bytes() + self.n2.bytes() + self.act.bytes()
    }
}

/// A block's intermediates as forward writes and backward reads them: the
/// kept set, with n1, n2 and act its own or, kept for selective recompute,
/// the part's [`Remade`] ones.
pub(in crate::model::gpu) struct Acts<'a, X: Elem> {
    kept: &'a BlockActs<X>,
    /// (N, C) the attention norm's output.
    pub(in crate::model::gpu::part) n1: &'a DeviceBuffer<X>,
    /// (N, C) the MLP norm's output.
    pub(in crate::model::gpu::part) n2: &'a DeviceBuffer<X>,
    /// (N, F) the activation, down's input.
    pub(in crate::model::gpu::part) act: &'a DeviceBuffer<X>,
}

impl<'a, X: Elem> Acts<'a, X> {
    pub(super) fn new(kept: &'a BlockActs<X>, remade: Option<&'a Remade<X>>) -> Self {
        debug_assert_eq!(kept.n1.is_empty(), remade.is_some(), "a selective set reads the remade tensors");
        match remade {
            Some(r) => Acts { kept, n1: &r.n1, n2: &r.n2, act: &r.act },
            None => Acts { kept, n1: &kept.n1, n2: &kept.n2, act: &kept.act },
        }
    }
}

impl<X: Elem> std::ops::Deref for Acts<'_, X> {
    type Target = BlockActs<X>;

    fn deref(&self) -> &BlockActs<X> {
        self.kept
    }
}

/// Block l's tensors in a part's buffers, by role.
#[derive(Clone, Copy)]
pub(super) struct Tensors {
    base: usize,
    ix: BlockIndex,
}

impl Tensors {
    /// The tensor of role `r` (the block has it).
    pub(super) fn at(&self, r: Role) -> usize {
        self.base + self.ix.at(r)
    }

    /// The tensor of role `r`, if the model has one (a bias).
    pub(super) fn get(&self, r: Role) -> Option<usize> {
        self.ix.get(r).map(|i| self.base + i)
    }
}

/// q's, k's and v's (weight, bias, first column in qkv, width) for widths
/// q = NH·HS and kv = NKV·HS.
pub(super) fn qkv_parts(q: usize, kv: usize) -> [(Role, Role, usize, usize); 3] {
    [(Role::Q, Role::QBias, 0, q), (Role::K, Role::KBias, q, kv), (Role::V, Role::VBias, q + kv, kv)]
}

/// Where q's, k's or v's product (`role`) is written in forward and its
/// gradient read in backward: with the q/k norm, q's and k's in `raw`
/// (before their norms); otherwise, and v's always, in `post`.
pub(super) fn product_view(cfg: &Arch, role: Role, post: View, raw: View) -> View {
    if cfg.qk_norm && role != Role::V {
        raw
    } else {
        post
    }
}

/// The window every query's attention keeps (the model's, or causal).
pub(super) fn window(cfg: &Arch) -> Window {
    Window::new(cfg.window)
}

/// q's and k's heads in the (N, W) qkv rows of a rank's `share`, each with
/// its norm's gain role: the runs of the per-head norms.
fn qk_runs(share: &Share, n: usize) -> [(Role, HeadRun); 2] {
    [(Role::QNorm, share.run(n, false)), (Role::KNorm, share.run(n, true))]
}

/// The q and k norms' forward: qkv's q and k columns = the per-head
/// RMSNorm of qkv_raw's with gains `gain(QNorm)`, `gain(KNorm)`, keeping rstd.
pub(super) fn qk_norm_forward<X: Elem>(
    gpu: &Gpu,
    cfg: &Arch,
    a: &BlockActs<X>,
    gain: impl Fn(Role) -> u64,
    share: &Share,
    n: usize,
) -> Result<()> {
    let [(q, rq), (k, rk)] = qk_runs(share, n);
    rmsnorm::head_rmsnorm_forward(gpu, &a.qkv, &a.rstd_q, &a.qkv_raw, gain(q), rq, cfg.norm_eps)?;
    rmsnorm::head_rmsnorm_forward(gpu, &a.qkv, &a.rstd_k, &a.qkv_raw, gain(k), rk, cfg.norm_eps)
}

/// The q and k norms' input gradient: dqkv_raw's q and k columns =
/// ∂L/∂(their products) from `dqkv`'s (after the norms, before RoPE).
pub(super) fn qk_norm_backward_input<X: Elem>(
    gpu: &Gpu,
    dqkv_raw: &DeviceBuffer<X>,
    dqkv: &DeviceBuffer<X>,
    a: &BlockActs<X>,
    gain: impl Fn(Role) -> u64,
    share: &Share,
    n: usize,
) -> Result<()> {
    // The kernel accumulates: the gradient starts from zero.
    gpu.zero(dqkv_raw)?;
    for ((role, run), rstd) in qk_runs(share, n).into_iter().zip([&a.rstd_q, &a.rstd_k]) {
        rmsnorm::head_rmsnorm_backward_input(gpu, dqkv_raw, dqkv, &a.qkv_raw, gain(role), rstd, run)?;
    }
    Ok(())
}

/// The q and k norms' gain gradients from `dqkv` (their outputs'), each
/// into `groups` per-group partials (G, HS) f32 at `dst(role)`, accumulated;
/// `partial` is the kernel's scratch ([`qk_partial_len`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn qk_norm_backward_weight<X: Elem>(
    gpu: &Gpu,
    dst: impl Fn(Role) -> u64,
    groups: usize,
    partial: &DeviceBuffer<f32>,
    dqkv: &DeviceBuffer<X>,
    a: &BlockActs<X>,
    share: &Share,
    n: usize,
) -> Result<()> {
    for ((role, run), rstd) in qk_runs(share, n).into_iter().zip([&a.rstd_q, &a.rstd_k]) {
        rmsnorm::head_rmsnorm_backward_weight(gpu, dst(role), groups, partial, dqkv, &a.qkv_raw, rstd, run)?;
    }
    Ok(())
}

/// Scratch floats the q/k norms' gain gradients need on a rank of `share`
/// writing `groups` partials each (0 without the q/k norm).
pub(super) fn qk_partial_len(cfg: &Arch, share: &Share, n: usize, groups: usize) -> usize {
    match cfg.qk_norm {
        true => qk_runs(share, n)
            .iter()
            .map(|(_, run)| rmsnorm::head_partial_len(*run, groups))
            .max()
            .unwrap_or(0),
        false => 0,
    }
}

/// The MLP's first products, (weight, bias, first column in `hidden`):
/// gate at 0 and up at F (SwiGLU), or up alone at 0 (GELU).
pub(super) fn mlp_in_parts(cfg: &Arch, f: usize) -> impl Iterator<Item = (Role, Role, usize)> + Clone {
    let swiglu = cfg.mlp == Mlp::SwiGlu;
    let gate = swiglu.then_some((Role::Gate, Role::GateBias, 0));
    gate.into_iter().chain(std::iter::once((Role::Up, Role::UpBias, if swiglu { f } else { 0 })))
}

/// A norm's forward: out = norm(x) with gain `w` (and `bias`, LayerNorm's),
/// keeping mean (LayerNorm) and rstd.
#[allow(clippy::too_many_arguments)]
pub(super) fn norm_forward<X: Elem>(
    gpu: &Gpu,
    cfg: &Arch,
    (out, mean, rstd): (&DeviceBuffer<X>, &DeviceBuffer<f32>, &DeviceBuffer<f32>),
    x: &DeviceBuffer<X>,
    w: u64,
    bias: Option<u64>,
    n: usize,
    c: usize,
) -> Result<()> {
    match (cfg.norm, bias) {
        (Norm::LayerNorm, Some(b)) => layernorm::layernorm_forward(gpu, out, mean, rstd, x, w, b, n, c),
        (Norm::LayerNorm, None) => Err(CudaError::Shape("a LayerNorm without its bias".into())),
        (Norm::RmsNorm, _) => rmsnorm::rmsnorm_forward(gpu, out, rstd, x, w, n, c, cfg.norm_eps),
    }
}

/// dx (N, C) += the norm's input gradient from its output gradient `dout`.
#[allow(clippy::too_many_arguments)]
pub(super) fn norm_backward_input<X: Elem>(
    gpu: &Gpu,
    cfg: &Arch,
    dx: &DeviceBuffer<X>,
    dout: &DeviceBuffer<X>,
    x: &DeviceBuffer<X>,
    w: u64,
    (mean, rstd): (&DeviceBuffer<f32>, &DeviceBuffer<f32>),
    n: usize,
    c: usize,
) -> Result<()> {
    match cfg.norm {
        Norm::LayerNorm => layernorm::layernorm_backward_input(gpu, dx, dout, x, w, mean, rstd, n, c),
        Norm::RmsNorm => rmsnorm::rmsnorm_backward_input(gpu, dx, dout, x, w, rstd, n, c),
    }
}

/// The norm's gain gradient `gw` (and bias gradient `gb`, LayerNorm's), f32,
/// accumulated by the two-pass column sums in `partial`.
#[allow(clippy::too_many_arguments)]
pub(super) fn norm_backward_weight<X: Elem>(
    gpu: &Gpu,
    cfg: &Arch,
    (gw, gb): (u64, Option<u64>),
    partial: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<X>,
    x: &DeviceBuffer<X>,
    (mean, rstd): (&DeviceBuffer<f32>, &DeviceBuffer<f32>),
    n: usize,
    c: usize,
) -> Result<()> {
    match (cfg.norm, gb) {
        (Norm::LayerNorm, Some(gb)) => {
            layernorm::layernorm_backward_weight(gpu, gw, gb, partial, dout, x, mean, rstd, n, c)
        }
        (Norm::LayerNorm, None) => Err(CudaError::Shape("a LayerNorm without its bias".into())),
        (Norm::RmsNorm, _) => rmsnorm::rmsnorm_backward_weight(gpu, gw, partial, dout, x, rstd, n, c),
    }
}

/// Scratch floats a norm's weight gradient needs for N rows of C.
pub(super) fn norm_partial_len(cfg: &Arch, n: usize, c: usize) -> usize {
    match cfg.norm {
        Norm::LayerNorm => layernorm::partial_len(n, c),
        Norm::RmsNorm => rmsnorm::partial_len(n, c),
    }
}

/// act (N, F) = the MLP's activation of `hidden`.
pub(super) fn act_forward<X: Elem>(
    gpu: &Gpu,
    cfg: &Arch,
    act: &DeviceBuffer<X>,
    hidden: &DeviceBuffer<X>,
    n: usize,
    f: usize,
) -> Result<()> {
    match cfg.mlp {
        Mlp::SwiGlu => swiglu::swiglu_forward(gpu, act, hidden, n, f),
        Mlp::Gelu => gelu::gelu_forward(gpu, act, hidden, n * f),
    }
}

/// dhidden = the activation's input gradient from dact (overwritten).
pub(super) fn act_backward<X: Elem>(
    gpu: &Gpu,
    cfg: &Arch,
    dhidden: &DeviceBuffer<X>,
    dact: &DeviceBuffer<X>,
    hidden: &DeviceBuffer<X>,
    n: usize,
    f: usize,
) -> Result<()> {
    match cfg.mlp {
        Mlp::SwiGlu => {
            // swiglu_backward accumulates: its gradient starts from zero.
            gpu.zero(dhidden)?;
            swiglu::swiglu_backward(gpu, dhidden, dact, hidden, n, f)
        }
        Mlp::Gelu => gelu::gelu_backward(gpu, dhidden, hidden, dact, n * f),
    }
}

/// y (N, O) = x (N, I) · wᵀ (+ bias), w (O, I) as `nn.Linear` keeps it.
fn linear<X: Elem>(
    gpu: &Gpu,
    y: View,
    x: View,
    w: u64,
    bias: Option<u64>,
    (n, i, o): (usize, usize, usize),
) -> Result<()> {
    matmul::product_linear::<X>(gpu, y, Out::Storage, x, View::new(w, i), bias, (n, i, o), false)
}

/// dx (N, I) [+]= dy (N, O) · w, w (O, I): a linear layer's input gradient.
fn linear_dx<X: Elem>(
    gpu: &Gpu,
    dx: View,
    dy: View,
    w: u64,
    (n, i, o): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    matmul::product_forward::<X>(gpu, dx, Out::Storage, dy, View::new(w, i), None, (n, o, i), accumulate)
}

/// dw (O, I) f32 += dyᵀ · x: a linear layer's weight gradient.
pub(super) fn linear_dw<X: Elem>(
    gpu: &Gpu,
    dw: u64,
    dy: View,
    x: View,
    (n, i, o): (usize, usize, usize),
) -> Result<()> {
    matmul::product_backward_weight::<X>(gpu, View::new(dw, i), x, dy, (n, o, i))
}

impl<X: Elem> GpuPart<X> {
    /// Local block l's tensors.
    pub(super) fn block_tensors(&self, l: usize) -> Tensors {
        Tensors { base: self.spec.block_base(&self.cfg, l), ix: self.cfg.block_index() }
    }

    /// Device address of tensor `i`'s X copy, if there is one.
    pub(super) fn w_opt(&self, i: Option<usize>) -> Option<u64> {
        i.map(|i| self.w(i))
    }

    /// Device address of tensor `i`'s f32 gradient, if there is one.
    pub(super) fn g_opt(&self, i: Option<usize>) -> Option<u64> {
        i.map(|i| self.g(i))
    }

    /// db (O) f32 += Σ over rows of dy's O columns (N rows `dy.ld` apart),
    /// when the product has a bias.
    pub(super) fn bias_grad(&self, gpu: &Gpu, db: Option<u64>, dy: View, o: usize) -> Result<()> {
        match db {
            Some(db) => matmul::bias_backward_view::<X>(gpu, db, &self.s.bias_partial, dy, self.n(), o),
            None => Ok(()),
        }
    }

    /// Selective recompute: block l's n1, n2 and act for slot k made again
    /// into the part's `Remade`, by the forward's kernel calls on the
    /// forward's inputs and into the same buffers, so with the forward's
    /// bits (the norms' statistics are written again with the bits kept).
    /// Nothing under any other setting. The plain and the split block share
    /// it: the norms are whole on every rank, the activation the rank's F.
    pub(super) fn remake(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        if self.s.remade.is_none() {
            return Ok(());
        }
        let cfg = &self.cfg;
        let s = Share::of(cfg, self.tp.size);
        let (n, c, f) = (self.n(), s.c, s.f);
        let ts = self.block_tensors(l);
        let (w, wo) = (|r: Role| self.w(ts.at(r)), |r: Role| self.w_opt(ts.get(r)));
        let x = &self.slots[k].stream[l];
        let a = self.backward_acts(k, l);
        let norm1 = (a.n1, &a.mean1, &a.rstd1);
        norm_forward(gpu, cfg, norm1, x, w(Role::AttnNorm), wo(Role::AttnNormBias), n, c)?;
        let norm2 = (a.n2, &a.mean2, &a.rstd2);
        norm_forward(gpu, cfg, norm2, &a.h, w(Role::MlpNorm), wo(Role::MlpNormBias), n, c)?;
        act_forward(gpu, cfg, a.act, &a.hidden, n, f)
    }

    /// Block l's forward for the microbatch in slot `k`; with `recomputing`,
    /// into the shared recompute buffers (the output is discarded: the slot
    /// already holds it).
    pub(super) fn block_forward(&self, gpu: &Gpu, k: usize, l: usize, recomputing: bool) -> Result<()> {
        ensure(!self.tp.is_split(), || "a split part's blocks run through its TpPart".into())?;
        let cfg = &self.cfg;
        let s = Share::of(cfg, 1);
        let (b, t, n) = (self.b, cfg.block_size, self.n());
        let (c, f, heads, hidden) = (s.c, s.f, s.heads, s.hidden(cfg));
        let (wd, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
        let ts = self.block_tensors(l);
        let (w, wo) = (|r: Role| self.w(ts.at(r)), |r: Role| self.w_opt(ts.get(r)));
        let x = &self.slots[k].stream[l];
        let (a, out) = self.forward_acts(k, l, recomputing);
        let norm1 = (a.n1, &a.mean1, &a.rstd1);
        norm_forward(gpu, cfg, norm1, x, w(Role::AttnNorm), wo(Role::AttnNormBias), n, c)?;
        let (n1, qkv, raw) =
            (View::new(a.n1.ptr(), c), View::new(a.qkv.ptr(), wd), View::new(a.qkv_raw.ptr(), wd));
        for (r, rb, col, width) in qkv_parts(q, kv) {
            let y = product_view(cfg, r, qkv, raw).at::<X>(0, col);
            linear::<X>(gpu, y, n1, w(r), wo(rb), (n, c, width))?;
        }
        if cfg.qk_norm {
            qk_norm_forward(gpu, cfg, &a, w, &s, n)?;
        }
        if let Some(table) = &self.s.rope {
            // q's and k's heads are the first NH + NKV head-wide column blocks.
            rope::rope_forward(gpu, &a.qkv, table, n, wd, 0, heads.nh + heads.nkv)?;
        }
        attention::gqa_window_forward(gpu, &a.atty, &a.lse, &a.qkv, b, t, heads, window(cfg))?;
        let (h, atty) = (View::new(a.h.ptr(), c), View::new(a.atty.ptr(), q));
        linear::<X>(gpu, h, atty, w(Role::O), wo(Role::OBias), (n, q, c))?;
        residual::residual_forward(gpu, a.h.ptr(), a.h.ptr(), x, n * c)?;
        let norm2 = (a.n2, &a.mean2, &a.rstd2);
        norm_forward(gpu, cfg, norm2, &a.h, w(Role::MlpNorm), wo(Role::MlpNormBias), n, c)?;
        let (n2, hid) = (View::new(a.n2.ptr(), c), View::new(a.hidden.ptr(), hidden));
        for (r, rb, col) in mlp_in_parts(cfg, f) {
            linear::<X>(gpu, hid.at::<X>(0, col), n2, w(r), wo(rb), (n, c, f))?;
        }
        act_forward(gpu, cfg, a.act, &a.hidden, n, f)?;
        let (y, act) = (View::new(out.ptr(), c), View::new(a.act.ptr(), f));
        linear::<X>(gpu, y, act, w(Role::Down), wo(Role::DownBias), (n, f, c))?;
        residual::residual_forward(gpu, out.ptr(), out.ptr(), &a.h, n * c)
    }

    /// Block l's backward for slot k: `dres` holds ∂L/∂(block output) on
    /// entry and ∂L/∂(block input) on return; every weight (and bias)
    /// gradient accumulates as soon as its output gradient exists, as the
    /// CPU's full backward (`block_backward_input` with `full`).
    pub(super) fn block_backward(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        ensure(!self.tp.is_split(), || "a split part's blocks run through its TpPart".into())?;
        let cfg = &self.cfg;
        let s = Share::of(cfg, 1);
        let (b, t, n) = (self.b, cfg.block_size, self.n());
        let (c, f, heads, hidden) = (s.c, s.f, s.heads, s.hidden(cfg));
        let (wd, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
        let ts = self.block_tensors(l);
        let (w, g, go) =
            (|r: Role| self.w(ts.at(r)), |r: Role| self.g(ts.at(r)), |r: Role| self.g_opt(ts.get(r)));
        let x = &self.slots[k].stream[l];
        self.remake(gpu, k, l)?;
        let a = self.backward_acts(k, l);
        let sc = &self.s;
        let (dres, dn) = (View::new(sc.dres.ptr(), c), View::new(sc.dln.ptr(), c));
        // MLP: dres is ∂L/∂out, which is also the residual's share of ∂L/∂h.
        linear_dw::<X>(gpu, g(Role::Down), dres, View::new(a.act.ptr(), f), (n, f, c))?;
        self.bias_grad(gpu, go(Role::DownBias), dres, c)?;
        linear_dx::<X>(gpu, View::new(sc.dact.ptr(), f), dres, w(Role::Down), (n, f, c), false)?;
        act_backward(gpu, cfg, &sc.dhidden, &sc.dact, &a.hidden, n, f)?;
        let dh = View::new(sc.dhidden.ptr(), hidden);
        for (j, (r, _, col)) in mlp_in_parts(cfg, f).enumerate() {
            linear_dx::<X>(gpu, dn, dh.at::<X>(0, col), w(r), (n, c, f), j > 0)?;
        }
        let n2 = View::new(a.n2.ptr(), c);
        for (r, rb, col) in mlp_in_parts(cfg, f) {
            linear_dw::<X>(gpu, g(r), dh.at::<X>(0, col), n2, (n, c, f))?;
            self.bias_grad(gpu, go(rb), dh.at::<X>(0, col), f)?;
        }
        let stats2 = (&a.mean2, &a.rstd2);
        norm_backward_input(gpu, cfg, &sc.dres, &sc.dln, &a.h, w(Role::MlpNorm), stats2, n, c)?;
        let gn2 = (g(Role::MlpNorm), go(Role::MlpNormBias));
        norm_backward_weight(gpu, cfg, gn2, &sc.ln_partial, &sc.dln, &a.h, stats2, n, c)?;
        // Attention: dres is now ∂L/∂h, the residual's share of ∂L/∂x.
        linear_dw::<X>(gpu, g(Role::O), dres, View::new(a.atty.ptr(), q), (n, q, c))?;
        self.bias_grad(gpu, go(Role::OBias), dres, c)?;
        linear_dx::<X>(gpu, View::new(sc.datty.ptr(), q), dres, w(Role::O), (n, q, c), false)?;
        let (atty, lse, win) = (&a.atty, &a.lse, window(cfg));
        attention::gqa_window_backward(
            gpu, &sc.dqkv, &sc.delta, &sc.datty, &a.qkv, atty, lse, b, t, heads, win,
        )?;
        if let Some(table) = &sc.rope {
            rope::rope_backward(gpu, &sc.dqkv, table, n, wd, 0, heads.nh + heads.nkv)?;
        }
        if cfg.qk_norm {
            qk_norm_backward_input(gpu, &sc.dqkv_raw, &sc.dqkv, &a, w, &s, n)?;
            // One group: each gain's whole gradient, straight into it.
            qk_norm_backward_weight(gpu, g, 1, &sc.head_partial, &sc.dqkv, &a, &s, n)?;
        }
        let (post, raw) = (View::new(sc.dqkv.ptr(), wd), View::new(sc.dqkv_raw.ptr(), wd));
        let n1 = View::new(a.n1.ptr(), c);
        for (j, (r, _, col, width)) in qkv_parts(q, kv).into_iter().enumerate() {
            let dy = product_view(cfg, r, post, raw).at::<X>(0, col);
            linear_dx::<X>(gpu, dn, dy, w(r), (n, c, width), j > 0)?;
        }
        for (r, rb, col, width) in qkv_parts(q, kv) {
            let dy = product_view(cfg, r, post, raw).at::<X>(0, col);
            linear_dw::<X>(gpu, g(r), dy, n1, (n, c, width))?;
            self.bias_grad(gpu, go(rb), dy, width)?;
        }
        let stats1 = (&a.mean1, &a.rstd1);
        norm_backward_input(gpu, cfg, &sc.dres, &sc.dln, x, w(Role::AttnNorm), stats1, n, c)?;
        let gn1 = (g(Role::AttnNorm), go(Role::AttnNormBias));
        norm_backward_weight(gpu, cfg, gn1, &sc.ln_partial, &sc.dln, x, stats1, n, c)
    }
}
