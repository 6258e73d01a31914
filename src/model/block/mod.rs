//! The one transformer block every family runs, as Hugging Face's decoder
//! layers compute it, its kinds chosen by the model's settings ([`Arch`]):
//!
//!   h   = x + o(attention(rope(qk_norm(q(n1))), rope(qk_norm(k(n1))), v(n1))),  n1 = norm1(x)
//!   out = h + down(mlp(n2)),                                                       n2 = norm2(h)
//!
//! norm: LayerNorm (with a bias) or RMSNorm; q, k, v, o, and the MLP's
//! products with biases or not; the per-head q/k norm (Qwen3) or none; RoPE
//! on rotary models (a learned position table is added before the first
//! block instead); grouped-query attention, full or in a sliding window;
//! mlp(n2) = gelu(up(n2)) or silu(gate(n2)) · up(n2). Weights keep
//! `nn.Linear`'s (out, in) layout (see `linear.rs`); q, k and v are written
//! into one (N, (NH + 2·NKV)·HS) buffer, the layout the attention kernels read.
//!
//! The block runs on rank `rank` of `size` tensor-parallel ranks (Megatron's
//! column/row split; `split.rs` has the sums' rule): a rank holds the q rows
//! of its query heads, the k and v rows of their key/value heads (`size`
//! divides NKV, so a group never straddles ranks), a row block of gate and up
//! with their biases, and the matching input columns of o and down; the
//! norms and o's and down's biases are whole. Attention, RoPE, the q/k norm
//! and the activation are per head or per element and need no
//! communication. The sums over ranks — forward's o and down products,
//! backward's input gradients of q/k/v and of gate/up — are each the pairwise
//! tree over `slices` K-slices, slice j reading query heads [j·NH/S, …),
//! key/value heads [j·NKV/S, …) and MLP rows [j·F/S, …). With one slice every
//! product is the plain one. A part that is not split is rank 0 of 1.
//!
//! Shapes: B sequences of T tokens, N = B·T rows, C = n_embd, NH, NKV, HS
//! as in `arch.rs`, F = the MLP's width; per rank the heads and F are the
//! rank's share, W = (NH + 2·NKV)·HS.

pub mod linear;
pub mod split;
#[cfg(test)]
mod tests;

pub use split::{
    cut_of, shard, shard_into, sum_slices, unshard, unshard_into, Cut, Exchange, TensorGroup, ThreadGroup,
    TpRank,
};

use super::arch::{Arch, BlockIndex, Mlp, Norm, Positions, Role};
use super::params::Param;
pub use super::recompute::Recompute;
use crate::kernels::cpu::attention::{gqa_window_backward, gqa_window_forward, scratch_len, Heads, Window};
use crate::kernels::cpu::rmsnorm::HeadRun;
use crate::kernels::cpu::rope::{rope_backward, rope_forward, RopeTable};
use crate::kernels::cpu::{gelu, layernorm, residual, rmsnorm, swiglu};
use crate::kernels::profile::{timed, Kernel};
use linear::{
    column_parallel_dx, column_product, column_weight_grad, row_parallel, row_parallel_dx, row_weight_grad,
    ColumnPart,
};

/// One rank's share of a block's widths: the hidden size stays whole, the
/// heads and the MLP's rows are cut.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Share {
    pub c: usize,
    pub heads: Heads,
    pub f: usize,
}

impl Share {
    pub fn of(a: &Arch, size: usize) -> Share {
        let Heads { nh, nkv, hs } = a.heads();
        Share { c: a.n_embd, heads: Heads { nh: nh / size, nkv: nkv / size, hs }, f: a.ffn / size }
    }

    /// Query heads (`k` false) or key/value heads (`k` true) of the (N, W)
    /// q/k/v rows, as a run for the per-head norm (the GPU block's too).
    pub fn run(&self, n: usize, k: bool) -> HeadRun {
        let Heads { nh, nkv, hs } = self.heads;
        let w = self.heads.qkv_width();
        match k {
            false => HeadRun { n, w, first: 0, heads: nh, hs },
            true => HeadRun { n, w, first: nh, heads: nkv, hs },
        }
    }

    /// Columns of the MLP's first product: gate and up (SwiGLU) or up alone.
    pub fn hidden(&self, a: &Arch) -> usize {
        match a.mlp {
            Mlp::SwiGlu => 2 * self.f,
            Mlp::Gelu => self.f,
        }
    }
}

/// The rows of `n` a rank of `size` normalizes: its run under sequence
/// parallelism (`sp`), else all of them.
pub fn own_rows(n: usize, size: usize, sp: bool) -> usize {
    match sp && size > 1 {
        true => n / size,
        false => n,
    }
}

/// Rows of mean/variance a norm keeps: a LayerNorm's mean, none for RMSNorm.
fn mean_len(a: &Arch, n: usize) -> usize {
    if a.norm == Norm::LayerNorm {
        n
    } else {
        0
    }
}

/// One block's intermediate values for one microbatch on one rank. Kept
/// for selective recompute, `n1`, `n2` and `act` are empty: the block lends
/// them from its scratch ([`Remade`]) and computes them again when needed.
/// Under sequence parallelism the norms' outputs and statistics and the
/// residual `h` hold the rank's rows only (`TpRank::rows`).
#[derive(Default)]
pub struct BlockActs {
    n1: Vec<f32>,      // (N, C) the attention norm's output
    mean1: Vec<f32>,   // (N) LayerNorm only
    rstd1: Vec<f32>,   // (N)
    qkv: Vec<f32>,     // (N, W): q and k after their norms and RoPE, then v
    qkv_raw: Vec<f32>, // (N, W) q's and k's products before their norms (q/k norm only)
    rstd_q: Vec<f32>,  // (N, NH) q/k norm only
    rstd_k: Vec<f32>,  // (N, NKV) q/k norm only
    atty: Vec<f32>,    // (N, NH·HS) attention's output before o
    lse: Vec<f32>,     // (B, NH, T)
    h: Vec<f32>,       // (N, C) the residual after attention
    n2: Vec<f32>,      // (N, C)
    mean2: Vec<f32>,   // (N) LayerNorm only
    rstd2: Vec<f32>,   // (N)
    hidden: Vec<f32>,  // (N, 2F) gate's then up's outputs (SwiGLU) or (N, F) up's (GELU)
    act: Vec<f32>,     // (N, F) the activation, down's input
}

impl BlockActs {
    /// For a rank of `size` in a model of `cfg`'s settings, holding what
    /// `recompute` keeps (`full` keeps a whole set for the block being
    /// recomputed; a part keeps none per microbatch).
    pub fn new(b: usize, cfg: &Arch, size: usize, sp: bool, recompute: Recompute) -> Self {
        let [n1, mean1, rstd1, qkv, qkv_raw, rstd_q, rstd_k, atty, lse, h, n2, mean2, rstd2, hidden, act] =
            Self::lens(b, cfg, size, sp, recompute).map(|len| vec![0.0; len]);
        BlockActs {
            n1,
            mean1,
            rstd1,
            qkv,
            qkv_raw,
            rstd_q,
            rstd_k,
            atty,
            lse,
            h,
            n2,
            mean2,
            rstd2,
            hidden,
            act,
        }
    }

    /// The elements of each buffer, in field order: the one count the
    /// planner's memory model and the allocation share.
    fn lens(b: usize, cfg: &Arch, size: usize, sp: bool, recompute: Recompute) -> [usize; 15] {
        let (t, s) = (cfg.block_size, Share::of(cfg, size));
        let n = b * t;
        let r = own_rows(n, size, sp);
        let (c, heads) = (s.c, s.heads);
        let qk = usize::from(cfg.qk_norm);
        let kept = usize::from(recompute != Recompute::Selective);
        [
            kept * r * c,
            mean_len(cfg, r),
            r,
            n * heads.qkv_width(),
            qk * n * heads.qkv_width(),
            qk * n * heads.nh,
            qk * n * heads.nkv,
            n * heads.out_width(),
            b * heads.nh * t,
            r * c,
            kept * r * c,
            mean_len(cfg, r),
            r,
            n * s.hidden(cfg),
            kept * n * s.f,
        ]
    }

    /// Bytes a rank of `size` (sharing out rows with `sp`) keeps for one
    /// microbatch of `b` sequences under `recompute` (the set `full`
    /// recomputes into is `none`'s), computed without allocating.
    pub fn bytes_for(b: usize, cfg: &Arch, size: usize, sp: bool, recompute: Recompute) -> usize {
        4 * Self::lens(b, cfg, size, sp, recompute).iter().sum::<usize>()
    }

    /// Kept for selective recompute: the remade tensors are not here.
    fn slim(&self) -> bool {
        self.n1.is_empty()
    }

    /// A selective set borrows the remade tensors' buffers from `r` for a
    /// forward or a backward ([`Self::trade`] gives them back).
    fn lend(&mut self, r: &mut Remade) {
        assert!(!r.n1.is_empty(), "a set kept for selective recompute needs a scratch made for it");
        self.trade(r);
    }

    fn trade(&mut self, r: &mut Remade) {
        std::mem::swap(&mut self.n1, &mut r.n1);
        std::mem::swap(&mut self.n2, &mut r.n2);
        std::mem::swap(&mut self.act, &mut r.act);
    }

    pub fn bytes(&self) -> usize {
        let all = [
            &self.n1,
            &self.mean1,
            &self.rstd1,
            &self.qkv,
            &self.qkv_raw,
            &self.rstd_q,
            &self.rstd_k,
            &self.atty,
            &self.lse,
            &self.h,
            &self.n2,
            &self.mean2,
            &self.rstd2,
            &self.hidden,
            &self.act,
        ];
        4 * all.iter().map(|v| v.len()).sum::<usize>()
    }
}

/// The gradients of a block's intermediate outputs on one rank, written by
/// the input half of its backward (I) and read by the weight half (W). A
/// full backward (B) works in the four it computes anyway and leaves `dout`
/// and `dh`, which it reads from the caller's buffer, untouched.
pub struct BlockGrads {
    dout: Vec<f32>,     // (N, C) the block's output: down's output gradient
    dhidden: Vec<f32>,  // (N, 2F or F) the MLP's first products' outputs
    dn2: Vec<f32>,      // (N, C) the MLP norm's output
    dh: Vec<f32>,       // (N, C) the residual after attention: o's output gradient
    dqkv: Vec<f32>,     // (N, W) q, k, v's outputs (before RoPE for q and k; after their norms)
    dqkv_raw: Vec<f32>, // (N, W) q/k norm only: q's and k's products' outputs, before their norms
    dn1: Vec<f32>,      // (N, C) the attention norm's output
}

impl BlockGrads {
    /// For `n` rows (B·T) on a rank of `size` (the norms' output gradients
    /// its rows only under sequence parallelism, `sp`).
    pub fn new(n: usize, cfg: &Arch, size: usize, sp: bool) -> Self {
        let (s, r) = (Share::of(cfg, size), own_rows(n, size, sp));
        BlockGrads {
            dout: vec![0.0; n * s.c],
            dhidden: vec![0.0; n * s.hidden(cfg)],
            dn2: vec![0.0; r * s.c],
            dh: vec![0.0; n * s.c],
            dqkv: vec![0.0; n * s.heads.qkv_width()],
            dqkv_raw: vec![0.0; usize::from(cfg.qk_norm) * n * s.heads.qkv_width()],
            dn1: vec![0.0; r * s.c],
        }
    }

    pub fn bytes(&self) -> usize {
        let all = [&self.dout, &self.dhidden, &self.dn2, &self.dh, &self.dqkv, &self.dqkv_raw, &self.dn1];
        4 * all.iter().map(|v| v.len()).sum::<usize>()
    }
}

/// The tensors selective recompute makes again instead of keeping: both
/// norms' outputs and the MLP's activation, one block's worth per rank.
/// Empty under any other setting.
#[derive(Default)]
pub struct Remade {
    n1: Vec<f32>,  // (N, C)
    n2: Vec<f32>,  // (N, C)
    act: Vec<f32>, // (N, F)
}

impl Remade {
    fn new(b: usize, cfg: &Arch, size: usize, sp: bool, recompute: Recompute) -> Remade {
        let len = Remade::lens(b, cfg, size, sp, recompute);
        Remade { n1: vec![0.0; len[0]], n2: vec![0.0; len[1]], act: vec![0.0; len[2]] }
    }

    fn lens(b: usize, cfg: &Arch, size: usize, sp: bool, recompute: Recompute) -> [usize; 3] {
        let (n, s) = (b * cfg.block_size, Share::of(cfg, size));
        let r = own_rows(n, size, sp);
        match recompute {
            Recompute::Selective => [r * s.c, r * s.c, n * s.f],
            _ => [0; 3],
        }
    }

    /// Bytes a rank's scratch holds for them, computed without allocating.
    pub fn bytes_for(b: usize, cfg: &Arch, size: usize, sp: bool, recompute: Recompute) -> usize {
        4 * Remade::lens(b, cfg, size, sp, recompute).iter().sum::<usize>()
    }
}

/// One rank's workspace (one microbatch runs at a time): the rotary table
/// and backward's intermediate gradients, kept so a step allocates nothing.
pub struct BlockScratch {
    rope: Option<RopeTable>,
    remade: Remade,
    attn: Vec<f32>,
    dact: Vec<f32>,  // (N, F)
    datty: Vec<f32>, // (N, NH·HS)
    /// Slices 1.. of this rank's run of a split sum, (N, C) each (slice 0
    /// is summed in the output itself).
    leaves: Vec<Vec<f32>>,
    /// q/k norm only: a norm weight's gradient as a partial per slice of
    /// this rank's heads, (L, HS), the first slice's joined with the others'.
    head_partials: Vec<f32>,
    head_leaves: Vec<Vec<f32>>,
    /// Sequence parallelism only, (N, C) each: a norm's output gathered
    /// whole for the products that read it, and a split region's own
    /// subtree sum before the group reduce-scatters it.
    gathered: Vec<f32>,
    partial: Vec<f32>,
}

impl BlockScratch {
    pub fn new(b: usize, cfg: &Arch, tp: &TpRank, recompute: Recompute) -> Self {
        let Heads { nh, nkv, .. } = cfg.heads();
        // The config refuses other splits (config.rs, check_tp); a slice must be whole heads and groups.
        assert!(
            tp.slices.is_multiple_of(tp.size)
                && nkv.is_multiple_of(tp.slices)
                && nh.is_multiple_of(tp.slices)
                && cfg.ffn.is_multiple_of(tp.slices),
            "a block of {nh} query heads, {nkv} key/value heads and MLP width {} over {} slices on {} ranks: \
             the slices must divide all three and be a multiple of the ranks",
            cfg.ffn,
            tp.slices,
            tp.size
        );
        let (s, t, n) = (Share::of(cfg, tp.size), cfg.block_size, b * cfg.block_size);
        BlockScratch {
            rope: (cfg.positions == Positions::Rotary).then(|| super::rope::rope_table(cfg)),
            remade: Remade::new(b, cfg, tp.size, tp.sp, recompute),
            attn: vec![0.0; scratch_len(b, s.heads.nh, t)],
            dact: vec![0.0; n * s.f],
            datty: vec![0.0; n * s.heads.out_width()],
            leaves: (1..tp.leaves()).map(|_| vec![0.0; n * s.c]).collect(),
            head_partials: vec![0.0; usize::from(cfg.qk_norm) * tp.leaves() * s.heads.hs],
            head_leaves: (1..tp.leaves()).filter(|_| cfg.qk_norm).map(|_| vec![0.0; s.heads.hs]).collect(),
            gathered: vec![0.0; usize::from(tp.sequence_parallel()) * n * s.c],
            partial: vec![0.0; usize::from(tp.sequence_parallel()) * n * s.c],
        }
    }
}

/// The block's tensors by role, on one rank.
struct Weights<'a> {
    p: &'a [Param],
    ix: BlockIndex,
}

impl<'a> Weights<'a> {
    fn w(&self, r: Role) -> &'a [f32] {
        &self.p[self.ix.at(r)].data
    }

    fn opt(&self, r: Role) -> Option<&'a [f32]> {
        self.ix.get(r).map(|i| self.p[i].data.as_slice())
    }
}

/// A norm's forward: out = norm(x), keeping mean (LayerNorm) and rstd.
#[allow(clippy::too_many_arguments)]
fn norm_forward(
    a: &Arch,
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
) {
    match a.norm {
        Norm::LayerNorm => timed(Kernel::LayerNorm, || {
            layernorm::layernorm_forward(out, mean, rstd, x, w, bias.expect("a LayerNorm's bias"), n, c)
        }),
        Norm::RmsNorm => {
            timed(Kernel::RmsNorm, || rmsnorm::rmsnorm_forward(out, rstd, x, w, n, c, a.norm_eps))
        }
    }
}

/// dx += the norm's input gradient from its output gradient `dout`.
#[allow(clippy::too_many_arguments)]
fn norm_backward_input(
    a: &Arch,
    dx: &mut [f32],
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    match a.norm {
        Norm::LayerNorm => {
            timed(Kernel::LayerNorm, || layernorm::layernorm_backward_input(dx, dout, x, w, mean, rstd, n, c))
        }
        Norm::RmsNorm => {
            timed(Kernel::RmsNorm, || rmsnorm::rmsnorm_backward_input(dx, dout, x, w, rstd, n, c))
        }
    }
}

/// The norm's weight (and bias) gradients, p[w] and p[w + 1] for a
/// LayerNorm, over this rank's `n` rows. The kernels add row after row onto
/// what the gradient holds, so under sequence parallelism the ranks take
/// turns in rank order (= row order), each going on from the last one's sum
/// (a broadcast after each turn): the unsplit bits, where Megatron's
/// all-reduce of per-rank partial sums would give others.
#[allow(clippy::too_many_arguments)]
fn norm_grad(
    a: &Arch,
    p: &mut [Param],
    w: usize,
    dout: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
    tp: &TpRank,
) {
    if !tp.sequence_parallel() {
        return norm_grad_rows(a, p, w, dout, x, mean, rstd, n, c);
    }
    for turn in 0..tp.size {
        if turn == tp.rank {
            norm_grad_rows(a, p, w, dout, x, mean, rstd, n, c);
        }
        tp.broadcast(turn, &mut p[w].grad);
        if a.norm == Norm::LayerNorm {
            tp.broadcast(turn, &mut p[w + 1].grad);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn norm_grad_rows(
    a: &Arch,
    p: &mut [Param],
    w: usize,
    dout: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    match a.norm {
        Norm::LayerNorm => {
            let (gw, gb) = super::part::pair(p, w, w + 1);
            timed(Kernel::LayerNorm, || {
                layernorm::layernorm_backward_weight(&mut gw.grad, &mut gb.grad, dout, x, mean, rstd, n, c)
            })
        }
        Norm::RmsNorm => {
            timed(Kernel::RmsNorm, || rmsnorm::rmsnorm_backward_weight(&mut p[w].grad, dout, x, rstd, n, c))
        }
    }
}

/// The gradient of a tensor and, if the model has one, of its bias.
fn grad_and_bias<'p>(
    p: &'p mut [Param],
    ix: &BlockIndex,
    w: Role,
    b: Role,
) -> (&'p mut [f32], Option<&'p mut [f32]>) {
    match ix.get(b) {
        None => (&mut p[ix.at(w)].grad, None),
        Some(bi) => {
            let (gw, gb) = super::part::pair(p, ix.at(w), bi);
            (&mut gw.grad, Some(&mut gb.grad))
        }
    }
}

/// The input gradient of column-parallel products into `dx`: the group's
/// sum whole (all-reduced), or this rank's rows of it under sequence
/// parallelism (reduce-scattered from the rank's own subtree sum).
fn split_dx(dx: &mut [f32], sc: &mut BlockScratch, parts: &[ColumnPart], ni: (usize, usize), tp: &TpRank) {
    match tp.sequence_parallel() {
        true => column_parallel_dx(&mut sc.partial, &mut sc.leaves, parts, ni, tp, Some(dx)),
        false => column_parallel_dx(dx, &mut sc.leaves, parts, ni, tp, None),
    }
}

/// One block's forward on one rank: `p` holds the rank's shards of the
/// block's tensors (`cfg.block_len()` of them); out (N, C) = the block of x.
#[allow(clippy::too_many_arguments)]
pub fn block_forward(
    p: &[Param],
    a: &mut BlockActs,
    x: &[f32],
    out: &mut [f32],
    sc: &mut BlockScratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
) {
    let t = cfg.block_size;
    let s = Share::of(cfg, tp.size);
    let (n, c, f, heads, l) = (b * t, s.c, s.f, s.heads, tp.leaves());
    let (w, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
    let wt = Weights { p, ix: cfg.block_index() };
    let slim = a.slim();
    if slim {
        a.lend(&mut sc.remade);
    }
    let (rows, sp) = (tp.rows(n), tp.sequence_parallel());
    let (r, own) = (rows.len(), rows.start * c..rows.end * c);
    norm_forward(
        cfg,
        &mut a.n1,
        &mut a.mean1,
        &mut a.rstd1,
        &x[own.clone()],
        wt.w(Role::AttnNorm),
        wt.opt(Role::AttnNormBias),
        r,
        c,
    );
    let n1 = whole(&a.n1, &mut sc.gathered, tp);
    timed(Kernel::Matmul, || {
        // With the q/k norm, q's and k's products go where their norms read them.
        for (r, rb, col0, o) in [(Role::Q, Role::QBias, 0, q), (Role::K, Role::KBias, q, kv)] {
            let dst = if cfg.qk_norm { &mut a.qkv_raw } else { &mut a.qkv };
            column_product(dst, w, col0, n1, wt.w(r), wt.opt(rb), (n, c, o), l);
        }
        column_product(&mut a.qkv, w, q + kv, n1, wt.w(Role::V), wt.opt(Role::VBias), (n, c, kv), l);
    });
    if cfg.qk_norm {
        let (wq, wk, eps) = (wt.w(Role::QNorm), wt.w(Role::KNorm), cfg.norm_eps);
        timed(Kernel::RmsNorm, || {
            rmsnorm::head_rmsnorm_forward(&mut a.qkv, &mut a.rstd_q, &a.qkv_raw, wq, s.run(n, false), eps);
            rmsnorm::head_rmsnorm_forward(&mut a.qkv, &mut a.rstd_k, &a.qkv_raw, wk, s.run(n, true), eps);
        });
    }
    if let Some(rope) = &sc.rope {
        // q's and k's heads are the first NH + NKV head-wide column blocks.
        timed(Kernel::Rope, || rope_forward(&mut a.qkv, rope, n, w, 0, heads.nh + heads.nkv));
    }
    let window = Window::new(cfg.window);
    timed(Kernel::Attention, || {
        gqa_window_forward(&mut a.atty, &mut a.lse, &mut sc.attn, &a.qkv, b, t, heads, window)
    });
    let (o_w, o_b) = (wt.w(Role::O), wt.opt(Role::OBias));
    match sp {
        true => {
            row_parallel(&mut sc.partial, &mut sc.leaves, &a.atty, o_w, o_b, (n, q, c), tp, Some(&mut a.h))
        }
        false => row_parallel(&mut a.h, &mut sc.leaves, &a.atty, o_w, o_b, (n, q, c), tp, None),
    }
    timed(Kernel::Residual, || residual::accumulate(&mut a.h, &x[own.clone()]));
    norm_forward(
        cfg,
        &mut a.n2,
        &mut a.mean2,
        &mut a.rstd2,
        &a.h,
        wt.w(Role::MlpNorm),
        wt.opt(Role::MlpNormBias),
        r,
        c,
    );
    let n2 = whole(&a.n2, &mut sc.gathered, tp);
    let hidden = s.hidden(cfg);
    timed(Kernel::Matmul, || {
        if cfg.mlp == Mlp::SwiGlu {
            column_product(
                &mut a.hidden,
                hidden,
                0,
                n2,
                wt.w(Role::Gate),
                wt.opt(Role::GateBias),
                (n, c, f),
                l,
            );
        }
        column_product(
            &mut a.hidden,
            hidden,
            hidden - f,
            n2,
            wt.w(Role::Up),
            wt.opt(Role::UpBias),
            (n, c, f),
            l,
        );
    });
    mlp_activation(cfg, &mut a.act, &a.hidden, n, f);
    let (down_w, down_b) = (wt.w(Role::Down), wt.opt(Role::DownBias));
    match sp {
        true => {
            let mine = &mut out[own];
            row_parallel(&mut sc.partial, &mut sc.leaves, &a.act, down_w, down_b, (n, f, c), tp, Some(mine));
            timed(Kernel::Residual, || residual::accumulate(mine, &a.h));
            // The part passes whole residual streams between blocks.
            tp.gather(out);
        }
        false => {
            row_parallel(out, &mut sc.leaves, &a.act, down_w, down_b, (n, f, c), tp, None);
            timed(Kernel::Residual, || residual::accumulate(out, &a.h));
        }
    }
    if slim {
        a.trade(&mut sc.remade);
    }
}

/// A norm's output `mine` (this rank's rows) whole: gathered from the
/// ranks into `buf` under sequence parallelism, else `mine` itself.
fn whole<'a>(mine: &'a [f32], buf: &'a mut [f32], tp: &TpRank) -> &'a [f32] {
    if !tp.sequence_parallel() {
        return mine;
    }
    let at = tp.rank * mine.len();
    buf[at..at + mine.len()].copy_from_slice(mine);
    tp.gather(buf);
    buf
}

/// act (N, F) = the MLP's activation of its first products (N, 2F or F).
fn mlp_activation(cfg: &Arch, act: &mut [f32], hidden: &[f32], n: usize, f: usize) {
    match cfg.mlp {
        Mlp::SwiGlu => timed(Kernel::Swiglu, || swiglu::swiglu_forward(act, hidden, n, f)),
        Mlp::Gelu => timed(Kernel::Gelu, || gelu::gelu_forward(act, hidden)),
    }
}

/// Selective recompute: lends `a` the scratch's buffers for the tensors it
/// does not keep and makes them again, by the forward's kernels on the
/// forward's inputs, so with the forward's bits (the norms' statistics are
/// written again with the bits kept). `a.trade` gives the buffers back.
fn remake(
    p: &[Param],
    a: &mut BlockActs,
    x: &[f32],
    sc: &mut BlockScratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
) {
    let s = Share::of(cfg, tp.size);
    let (n, c, f) = (b * cfg.block_size, s.c, s.f);
    let rows = tp.rows(n);
    let (r, x) = (rows.len(), &x[rows.start * c..rows.end * c]);
    let wt = Weights { p, ix: cfg.block_index() };
    a.lend(&mut sc.remade);
    let (norm1, bias1) = (wt.w(Role::AttnNorm), wt.opt(Role::AttnNormBias));
    norm_forward(cfg, &mut a.n1, &mut a.mean1, &mut a.rstd1, x, norm1, bias1, r, c);
    let (norm2, bias2) = (wt.w(Role::MlpNorm), wt.opt(Role::MlpNormBias));
    norm_forward(cfg, &mut a.n2, &mut a.mean2, &mut a.rstd2, &a.h, norm2, bias2, r, c);
    mlp_activation(cfg, &mut a.act, &a.hidden, n, f);
}

/// The input half of one block's backward on one rank: `dres` holds ∂L/∂out
/// on entry and ∂L/∂x on return; `g` receives the intermediate output
/// gradients. With `full` (a B) every weight gradient accumulates as soon as
/// its output gradient exists, by the same kernel calls on the same inputs
/// as [`block_backward_weight`] makes, so I then W gives B's bits, and the
/// gradients that `dres` carries need no copies.
///
/// A set kept for selective recompute has its tensors made again first when
/// `full` takes weight gradients from them; the input half alone reads none.
#[allow(clippy::too_many_arguments)]
pub fn block_backward_input(
    p: &mut [Param],
    a: &mut BlockActs,
    x: &[f32],
    dres: &mut [f32],
    g: &mut BlockGrads,
    sc: &mut BlockScratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
    full: bool,
) {
    let t = cfg.block_size;
    let s = Share::of(cfg, tp.size);
    let (n, c, f, heads, l) = (b * t, s.c, s.f, s.heads, tp.leaves());
    let (w, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
    let ix = cfg.block_index();
    let hidden = s.hidden(cfg);
    let remade = full && a.slim();
    if remade {
        remake(p, a, x, sc, b, cfg, tp);
    }
    let (rows, sp) = (tp.rows(n), tp.sequence_parallel());
    let (r, own) = (rows.len(), rows.start * c..rows.end * c);
    let x = &x[own.clone()];
    // MLP: dres is ∂L/∂out, which is also the residual's share of ∂L/∂h.
    if full {
        down_grads(p, &ix, dres, a, (n, f, c), l);
    } else {
        g.dout.copy_from_slice(dres);
    }
    timed(Kernel::Matmul, || row_parallel_dx(&mut sc.dact, dres, &p[ix.at(Role::Down)].data, (n, f, c), l));
    match cfg.mlp {
        Mlp::SwiGlu => {
            // swiglu_backward accumulates: its gradient starts from zero.
            g.dhidden.fill(0.0);
            timed(Kernel::Swiglu, || swiglu::swiglu_backward(&mut g.dhidden, &sc.dact, &a.hidden, n, f));
        }
        Mlp::Gelu => {
            timed(Kernel::Gelu, || gelu::gelu_backward_into(&mut g.dhidden, &a.hidden, &sc.dact, false))
        }
    }
    {
        let wt = Weights { p, ix };
        let up = ColumnPart { dy: &g.dhidden, dy_cols: hidden, col0: hidden - f, w: wt.w(Role::Up), o: f };
        // Arrays, not a Vec: a step allocates nothing (train::engine's tests count).
        match cfg.mlp {
            Mlp::SwiGlu => {
                let gate = ColumnPart { dy: &g.dhidden, dy_cols: hidden, col0: 0, w: wt.w(Role::Gate), o: f };
                split_dx(&mut g.dn2, sc, &[gate, up], (n, c), tp)
            }
            Mlp::Gelu => split_dx(&mut g.dn2, sc, &[up], (n, c), tp),
        }
    }
    if full {
        let n2 = whole(&a.n2, &mut sc.gathered, tp);
        mlp_in_grads(cfg, p, &ix, &g.dhidden, n2, (n, c, f), l);
    }
    let (mlp_norm, attn_norm) = (ix.at(Role::MlpNorm), ix.at(Role::AttnNorm));
    let mine = &mut dres[own.clone()];
    norm_backward_input(cfg, mine, &g.dn2, &a.h, &p[mlp_norm].data, &a.mean2, &a.rstd2, r, c);
    if full {
        norm_grad(cfg, p, mlp_norm, &g.dn2, &a.h, &a.mean2, &a.rstd2, r, c, tp);
    }
    if sp {
        tp.gather(dres);
    }
    // Attention: dres is now ∂L/∂h, the residual's share of ∂L/∂x.
    if full {
        o_grads(p, &ix, dres, a, (n, q, c), l);
    } else {
        g.dh.copy_from_slice(dres);
    }
    timed(Kernel::Matmul, || row_parallel_dx(&mut sc.datty, dres, &p[ix.at(Role::O)].data, (n, q, c), l));
    // dK and dV accumulate over query tiles, so this one starts from zero.
    g.dqkv.fill(0.0);
    timed(Kernel::Attention, || {
        let window = Window::new(cfg.window);
        gqa_window_backward(
            &mut g.dqkv,
            &mut sc.attn,
            &sc.datty,
            &a.qkv,
            &a.atty,
            &a.lse,
            b,
            t,
            heads,
            window,
        )
    });
    if let Some(rope) = &sc.rope {
        timed(Kernel::Rope, || rope_backward(&mut g.dqkv, rope, n, w, 0, heads.nh + heads.nkv));
    }
    if cfg.qk_norm {
        // The products' gradients: v's as they are, q's and k's through their norms.
        g.dqkv_raw.fill(0.0);
        for (raw, post) in g.dqkv_raw.chunks_mut(w).zip(g.dqkv.chunks(w)) {
            raw[q + kv..].copy_from_slice(&post[q + kv..]);
        }
        let (wq, wk) = (&p[ix.at(Role::QNorm)].data, &p[ix.at(Role::KNorm)].data);
        timed(Kernel::RmsNorm, || {
            let (rq, rk) = (s.run(n, false), s.run(n, true));
            rmsnorm::head_rmsnorm_backward_input(&mut g.dqkv_raw, &g.dqkv, &a.qkv_raw, wq, &a.rstd_q, rq);
            rmsnorm::head_rmsnorm_backward_input(&mut g.dqkv_raw, &g.dqkv, &a.qkv_raw, wk, &a.rstd_k, rk);
        });
        if full {
            qk_norm_grads(p, &ix, &g.dqkv, a, sc, &s, n, tp);
        }
    }
    let dqkv = if cfg.qk_norm { &g.dqkv_raw } else { &g.dqkv };
    {
        let wt = Weights { p, ix };
        let parts = [
            ColumnPart { dy: dqkv, dy_cols: w, col0: 0, w: wt.w(Role::Q), o: q },
            ColumnPart { dy: dqkv, dy_cols: w, col0: q, w: wt.w(Role::K), o: kv },
            ColumnPart { dy: dqkv, dy_cols: w, col0: q + kv, w: wt.w(Role::V), o: kv },
        ];
        split_dx(&mut g.dn1, sc, &parts, (n, c), tp);
    }
    if full {
        let n1 = whole(&a.n1, &mut sc.gathered, tp);
        qkv_grads(p, &ix, dqkv, n1, (n, c, q, kv), l);
    }
    let mine = &mut dres[own];
    norm_backward_input(cfg, mine, &g.dn1, x, &p[attn_norm].data, &a.mean1, &a.rstd1, r, c);
    if full {
        norm_grad(cfg, p, attn_norm, &g.dn1, x, &a.mean1, &a.rstd1, r, c, tp);
    }
    if sp {
        tp.gather(dres);
    }
    if remade {
        a.trade(&mut sc.remade);
    }
}

/// The weight half of one block's backward (a W) on one rank: accumulates
/// every weight gradient from the activations and the output gradients its I
/// kept (a set kept for selective recompute has its tensors made again: the
/// scratch has served other microbatches since the I).
#[allow(clippy::too_many_arguments)]
pub fn block_backward_weight(
    p: &mut [Param],
    a: &mut BlockActs,
    x: &[f32],
    g: &BlockGrads,
    sc: &mut BlockScratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
) {
    let s = Share::of(cfg, tp.size);
    let (n, c, f, heads, l) = (b * cfg.block_size, s.c, s.f, s.heads, tp.leaves());
    let (q, kv) = (heads.out_width(), heads.nkv * heads.hs);
    let ix = cfg.block_index();
    let remade = a.slim();
    if remade {
        remake(p, a, x, sc, b, cfg, tp);
    }
    let rows = tp.rows(n);
    let (r, x) = (rows.len(), &x[rows.start * c..rows.end * c]);
    down_grads(p, &ix, &g.dout, a, (n, f, c), l);
    mlp_in_grads(cfg, p, &ix, &g.dhidden, whole(&a.n2, &mut sc.gathered, tp), (n, c, f), l);
    norm_grad(cfg, p, ix.at(Role::MlpNorm), &g.dn2, &a.h, &a.mean2, &a.rstd2, r, c, tp);
    o_grads(p, &ix, &g.dh, a, (n, q, c), l);
    if cfg.qk_norm {
        qk_norm_grads(p, &ix, &g.dqkv, a, sc, &s, n, tp);
    }
    let dqkv = if cfg.qk_norm { &g.dqkv_raw } else { &g.dqkv };
    qkv_grads(p, &ix, dqkv, whole(&a.n1, &mut sc.gathered, tp), (n, c, q, kv), l);
    norm_grad(cfg, p, ix.at(Role::AttnNorm), &g.dn1, x, &a.mean1, &a.rstd1, r, c, tp);
    if remade {
        a.trade(&mut sc.remade);
    }
}

/// The q and k norms' weight gradients from their outputs' gradients
/// `dqkv`. A norm's weight is whole on every rank while its heads are cut,
/// so each gradient is a split sum like the row-parallel products': a
/// partial per slice of heads (rows, then the slice's heads, in order),
/// joined by the slice tree and the group, then added to the gradient.
#[allow(clippy::too_many_arguments)]
fn qk_norm_grads(
    p: &mut [Param],
    ix: &BlockIndex,
    dqkv: &[f32],
    a: &BlockActs,
    sc: &mut BlockScratch,
    s: &Share,
    n: usize,
    tp: &TpRank,
) {
    let hs = s.heads.hs;
    for (role, rstd, k) in [(Role::QNorm, &a.rstd_q, false), (Role::KNorm, &a.rstd_k, true)] {
        sc.head_partials.fill(0.0);
        timed(Kernel::RmsNorm, || {
            rmsnorm::head_rmsnorm_backward_weight(&mut sc.head_partials, dqkv, &a.qkv_raw, rstd, s.run(n, k))
        });
        let (first, rest) = sc.head_partials.split_at_mut(hs);
        for (leaf, part) in sc.head_leaves.iter_mut().zip(rest.chunks(hs)) {
            leaf.copy_from_slice(part);
        }
        sum_slices(first, &mut sc.head_leaves, tp, None);
        for (g, d) in p[ix.at(role)].grad.iter_mut().zip(first.iter()) {
            *g += d;
        }
    }
}

/// down's weight (and bias) gradient from its output gradient.
fn down_grads(
    p: &mut [Param],
    ix: &BlockIndex,
    dout: &[f32],
    a: &BlockActs,
    nfc: (usize, usize, usize),
    l: usize,
) {
    let (dw, db) = grad_and_bias(p, ix, Role::Down, Role::DownBias);
    timed(Kernel::Matmul, || row_weight_grad(dw, db, dout, &a.act, nfc, l));
}

/// o's weight (and bias) gradient from its output gradient (∂L/∂h).
fn o_grads(
    p: &mut [Param],
    ix: &BlockIndex,
    dh: &[f32],
    a: &BlockActs,
    nqc: (usize, usize, usize),
    l: usize,
) {
    let (dw, db) = grad_and_bias(p, ix, Role::O, Role::OBias);
    timed(Kernel::Matmul, || row_weight_grad(dw, db, dh, &a.atty, nqc, l));
}

/// The MLP's first products' weight (and bias) gradients from their output
/// gradients `dhidden` (gate's then up's, or up's) and their input `n2`, whole.
fn mlp_in_grads(
    cfg: &Arch,
    p: &mut [Param],
    ix: &BlockIndex,
    dhidden: &[f32],
    n2: &[f32],
    (n, c, f): (usize, usize, usize),
    l: usize,
) {
    let cols = dhidden.len() / n;
    timed(Kernel::Matmul, || {
        if cfg.mlp == Mlp::SwiGlu {
            let (dw, db) = grad_and_bias(p, ix, Role::Gate, Role::GateBias);
            column_weight_grad(dw, db, dhidden, cols, 0, n2, (n, c, f), l);
        }
        let (dw, db) = grad_and_bias(p, ix, Role::Up, Role::UpBias);
        column_weight_grad(dw, db, dhidden, cols, cols - f, n2, (n, c, f), l);
    });
}

/// q's, k's and v's weight (and bias) gradients from theirs, `dqkv` (N, Q + 2·KV),
/// and their input `n1`, whole.
fn qkv_grads(
    p: &mut [Param],
    ix: &BlockIndex,
    dqkv: &[f32],
    n1: &[f32],
    (n, c, q, kv): (usize, usize, usize, usize),
    l: usize,
) {
    let w = q + 2 * kv;
    timed(Kernel::Matmul, || {
        for (r, rb, col0, o) in
            [(Role::Q, Role::QBias, 0, q), (Role::K, Role::KBias, q, kv), (Role::V, Role::VBias, q + kv, kv)]
        {
            let (dw, db) = grad_and_bias(p, ix, r, rb);
            column_weight_grad(dw, db, dqkv, w, col0, n1, (n, c, o), l);
        }
    });
}
