//! One transformer block, x → x + attn(ln1(x)) → res2 + mlp(ln2(res2)), as
//! computed by rank `rank` of `size` tensor-parallel ranks (Megatron's
//! column/row split). A part that is not split is rank 0 of 1.
//!
//! A rank holds the q, k and v columns of its heads and their bias, the rows
//! of the attention projection that read those heads, a column block of
//! `c_fc` and the matching rows of the MLP projection; the LayerNorms and the
//! two projections' biases are whole on every rank ([`shard`] cuts a tensor,
//! [`unshard`] joins the ranks' pieces). Attention is per head, so it needs
//! no communication; the two row-parallel products (and, in backward, the
//! input gradients of the two column-parallel ones) are sums over ranks.
//!
//! Those sums are where tensor parallelism would change the bits. Here each
//! is defined, whatever the number of ranks, as the fixed pairwise tree over
//! `slices` K-slices of the product (slice j reads heads, or MLP columns,
//! [j·K/S, (j+1)·K/S)); the bias joins slice 0. A rank owns a contiguous,
//! aligned run of S/size slices, so it sums a whole subtree, and the group
//! joins the ranks' subtrees by the tree's upper levels: every size dividing
//! S gives the bits of size 1. With one slice the block is the plain product
//! (the cheapest form, and the one every run used before this split).
//! Products whose reduction is not split (each rank's own columns or rows)
//! are cut into the same slices too, each a product of its own: `gemm` takes
//! other paths for other shapes, so a block of a larger product need not
//! have that product's bits (at small shapes it does not; tested below).

use super::llama::{self, LlamaActs, LlamaGrads, LlamaScratch};
use super::params::block::*;
use super::params::{Arch, Family, Param};
use super::part::pair;
use crate::kernels::cpu::matmul::{gemm_checked, gemm_raw, pool_par, Mat};
use crate::kernels::cpu::tree::{tree_sum, tree_sum_elementwise};
use crate::kernels::cpu::{attention, gelu, layernorm, matmul, residual};
use crate::kernels::profile::{timed, Kernel};

/// Joins every rank's subtree sum into the root of the slice tree.
pub trait TensorGroup: Sync {
    /// Replaces `node`, rank `rank`'s subtree sum, with the sum of every
    /// rank's node by the pairwise tree over rank order: the same bits on
    /// every rank.
    fn all_reduce(&self, rank: usize, node: &mut [f32]);
}

/// Which tensor-parallel rank computes, out of how many, and how many slices
/// the split sums are defined over.
#[derive(Clone, Copy)]
pub struct TpRank<'g> {
    pub rank: usize,
    pub size: usize,
    pub slices: usize,
    pub group: Option<&'g dyn TensorGroup>,
}

impl TpRank<'_> {
    /// Slices of each split sum this rank computes.
    pub(super) fn leaves(&self) -> usize {
        self.slices / self.size
    }

    fn reduce(&self, node: &mut [f32]) {
        if self.size > 1 {
            self.group.expect("a split block needs its tensor group").all_reduce(self.rank, node);
        }
    }
}

/// One block's intermediate values for one microbatch on one rank, in its family's form.
pub enum BlockActs {
    Gpt2(Gpt2Acts),
    Llama(LlamaActs),
}

/// The gradients a block's I keeps for its W, in its family's form.
pub enum BlockGrads {
    Gpt2(Gpt2Grads),
    Llama(LlamaGrads),
}

/// One rank's block workspace, in its family's form.
pub enum BlockScratch {
    Gpt2(Gpt2Scratch),
    Llama(LlamaScratch),
}

impl BlockActs {
    pub fn new(b: usize, cfg: &Arch, size: usize) -> Self {
        match cfg.family {
            Family::Gpt2 => BlockActs::Gpt2(Gpt2Acts::new(b, cfg, size)),
            Family::Llama => BlockActs::Llama(LlamaActs::new(b, cfg, size)),
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            BlockActs::Gpt2(a) => a.bytes(),
            BlockActs::Llama(a) => a.bytes(),
        }
    }
}

impl BlockGrads {
    pub fn new(n: usize, cfg: &Arch, size: usize) -> Self {
        match cfg.family {
            Family::Gpt2 => BlockGrads::Gpt2(Gpt2Grads::new(n, cfg.n_embd, size)),
            Family::Llama => BlockGrads::Llama(LlamaGrads::new(n, cfg, size)),
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            BlockGrads::Gpt2(g) => g.bytes(),
            BlockGrads::Llama(g) => g.bytes(),
        }
    }
}

impl BlockScratch {
    pub fn new(b: usize, cfg: &Arch, tp: &TpRank) -> Self {
        match cfg.family {
            Family::Gpt2 => BlockScratch::Gpt2(Gpt2Scratch::new(b, cfg, tp)),
            Family::Llama => BlockScratch::Llama(LlamaScratch::new(b, cfg, tp)),
        }
    }
}

/// A family mismatch between a block's buffers: they are all made from one config.
fn mismatch() -> ! {
    unreachable!("a block's buffers made for another family")
}

/// One block's forward on one rank: `p` holds the rank's shards of the
/// block's tensors (`cfg.block_len()` of them).
#[allow(clippy::too_many_arguments)]
pub fn block_forward(
    p: &[Param],
    a: &mut BlockActs,
    x: &[f32],
    out: &mut [f32],
    s: &mut BlockScratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
) {
    match (a, s) {
        (BlockActs::Gpt2(a), BlockScratch::Gpt2(s)) => gpt2_forward(p, a, x, out, s, b, cfg, tp),
        (BlockActs::Llama(a), BlockScratch::Llama(s)) => llama::forward(p, a, x, out, s, b, cfg, tp),
        _ => mismatch(),
    }
}

/// The input half of one block's backward on one rank (see
/// [`gpt2_backward_input`]); with `full`, the weight half too, as it goes.
#[allow(clippy::too_many_arguments)]
pub fn block_backward_input(
    p: &mut [Param],
    a: &BlockActs,
    x: &[f32],
    dres: &mut [f32],
    g: &mut BlockGrads,
    s: &mut BlockScratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
    full: bool,
) {
    match (a, g, s) {
        (BlockActs::Gpt2(a), BlockGrads::Gpt2(g), BlockScratch::Gpt2(s)) => {
            gpt2_backward_input(p, a, x, dres, g, s, b, cfg, tp, full)
        }
        (BlockActs::Llama(a), BlockGrads::Llama(g), BlockScratch::Llama(s)) => {
            llama::backward_input(p, a, x, dres, g, s, b, cfg, tp, full)
        }
        _ => mismatch(),
    }
}

/// The weight half of one block's backward (a W) on one rank.
pub fn block_backward_weight(
    p: &mut [Param],
    a: &BlockActs,
    x: &[f32],
    g: &BlockGrads,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
) {
    match (a, g) {
        (BlockActs::Gpt2(a), BlockGrads::Gpt2(g)) => gpt2_backward_weight(p, a, x, g, b, cfg, tp),
        (BlockActs::Llama(a), BlockGrads::Llama(g)) => llama::backward_weight(p, a, x, g, b, cfg, tp),
        _ => mismatch(),
    }
}

/// GPT-2's intermediate values of one block for one microbatch, for one rank.
#[derive(Default)]
pub struct Gpt2Acts {
    ln1: Vec<f32>,      // (N, C)
    ln1_mean: Vec<f32>, // (N)
    ln1_rstd: Vec<f32>, // (N)
    qkv: Vec<f32>,      // (N, 3C/size)
    atty: Vec<f32>,     // (N, C/size) attention output before its projection
    lse: Vec<f32>,      // (B, NH/size, T)
    res2: Vec<f32>,     // (N, C) residual after attention
    ln2: Vec<f32>,      // (N, C)
    ln2_mean: Vec<f32>, // (N)
    ln2_rstd: Vec<f32>, // (N)
    fch: Vec<f32>,      // (N, 4C/size)
    fch_gelu: Vec<f32>, // (N, 4C/size)
}

impl Gpt2Acts {
    pub fn new(b: usize, cfg: &Arch, size: usize) -> Self {
        let (t, c, nh) = (cfg.block_size, cfg.n_embd, cfg.n_head);
        let (n, cl) = (b * t, c / size);
        Gpt2Acts {
            ln1: vec![0.0; n * c],
            ln1_mean: vec![0.0; n],
            ln1_rstd: vec![0.0; n],
            qkv: vec![0.0; n * 3 * cl],
            atty: vec![0.0; n * cl],
            lse: vec![0.0; b * (nh / size) * t],
            res2: vec![0.0; n * c],
            ln2: vec![0.0; n * c],
            ln2_mean: vec![0.0; n],
            ln2_rstd: vec![0.0; n],
            fch: vec![0.0; n * 4 * cl],
            fch_gelu: vec![0.0; n * 4 * cl],
        }
    }

    pub fn bytes(&self) -> usize {
        4 * (self.ln1.len()
            + self.ln1_mean.len()
            + self.ln1_rstd.len()
            + self.qkv.len()
            + self.atty.len()
            + self.lse.len()
            + self.res2.len()
            + self.ln2.len()
            + self.ln2_mean.len()
            + self.ln2_rstd.len()
            + self.fch.len()
            + self.fch_gelu.len())
    }
}

/// The gradients of a block's intermediate outputs, produced by the input half
/// of its backward (I) and consumed by the weight half (W).
pub struct Gpt2Grads {
    dout: Vec<f32>,  // (N, C) the block's output
    dfch: Vec<f32>,  // (N, 4C/size) the MLP's first product
    dln2: Vec<f32>,  // (N, C)
    dres2: Vec<f32>, // (N, C) the residual after attention
    dqkv: Vec<f32>,  // (N, 3C/size)
    dln1: Vec<f32>,  // (N, C)
}

impl Gpt2Grads {
    pub fn new(n: usize, c: usize, size: usize) -> Self {
        let cl = c / size;
        Gpt2Grads {
            dout: vec![0.0; n * c],
            dfch: vec![0.0; n * 4 * cl],
            dln2: vec![0.0; n * c],
            dres2: vec![0.0; n * c],
            dqkv: vec![0.0; n * 3 * cl],
            dln1: vec![0.0; n * c],
        }
    }

    pub fn bytes(&self) -> usize {
        4 * (self.dout.len()
            + self.dfch.len()
            + self.dln2.len()
            + self.dres2.len()
            + self.dqkv.len()
            + self.dln1.len())
    }
}

/// Workspace of one rank's blocks (one microbatch runs at a time).
pub struct Gpt2Scratch {
    datty: Vec<f32>, // (N, C/size)
    dgelu: Vec<f32>, // (N, 4C/size)
    attn: Vec<f32>,
    /// Slices 1.. of this rank's run of a split sum, (N, C) each (slice 0
    /// is summed in the output itself).
    leaves: Vec<Vec<f32>>,
}

impl Gpt2Scratch {
    pub fn new(b: usize, cfg: &Arch, tp: &TpRank) -> Self {
        let (n, cl) = (b * cfg.block_size, cfg.n_embd / tp.size);
        Gpt2Scratch {
            datty: vec![0.0; n * cl],
            dgelu: vec![0.0; n * 4 * cl],
            attn: vec![0.0; attention::scratch_len(b, cfg.n_head / tp.size, cfg.block_size)],
            leaves: (1..tp.leaves()).map(|_| vec![0.0; n * cfg.n_embd]).collect(),
        }
    }
}

/// A row-parallel product: out (N, C) = Σ over this rank's slices of
/// inp[:, slice] · w[slice, :], the bias joining slice 0 of rank 0, summed by
/// the slice tree and then over the group. `inp` is (N, K), `w` (K, C), K
/// this rank's share of the reduction.
#[allow(clippy::too_many_arguments)]
fn row_parallel(
    out: &mut [f32],
    leaves: &mut [Vec<f32>],
    inp: &[f32],
    w: &[f32],
    bias: &[f32],
    n: usize,
    k: usize,
    c: usize,
    tp: &TpRank,
) {
    let ks = k / tp.leaves();
    let with_bias = tp.rank == 0;
    if with_bias {
        matmul::fill_rows(out, bias);
    }
    timed(Kernel::Matmul, || {
        gemm_checked(out, with_bias, inp, (k as isize, 1), w, (c as isize, 1), n, c, ks, 1.0);
        for (j, leaf) in leaves.iter_mut().enumerate().map(|(j, l)| (j + 1, l)) {
            gemm_checked(
                leaf,
                false,
                &inp[j * ks..],
                (k as isize, 1),
                &w[j * ks * c..],
                (c as isize, 1),
                n,
                c,
                ks,
                1.0,
            );
        }
    });
    sum_slices(out, leaves, tp);
}

/// out (N, C) = the slice tree over `out` (slice 0) and `leaves`, then over
/// the group (both families' split sums end here).
pub(super) fn sum_slices(out: &mut [f32], leaves: &mut [Vec<f32>], tp: &TpRank) {
    if !leaves.is_empty() {
        let mut bufs: Vec<&mut [f32]> =
            std::iter::once(out as &mut [f32]).chain(leaves.iter_mut().map(|l| l.as_mut_slice())).collect();
        timed(Kernel::Residual, || tree_sum(&mut bufs));
    }
    tp.reduce(out);
}

/// The input gradient of a column-parallel product: dx (N, C) = Σ over this
/// rank's slices of dy[:, slice] · w[:, slice]ᵀ, by the slice tree and the
/// group. `dy` is (N, O) and `w` (C, O), O this rank's output columns; with
/// `parts` > 1 the columns are that many equal blocks (q, k, v) and a slice
/// takes its share of each, added in block order.
#[allow(clippy::too_many_arguments)]
fn column_parallel_dx(
    dx: &mut [f32],
    leaves: &mut [Vec<f32>],
    dy: &[f32],
    w: &[f32],
    n: usize,
    c: usize,
    o: usize,
    parts: usize,
    tp: &TpRank,
) {
    let os = o / tp.leaves();
    let leaf = |dst: &mut [f32], j: usize| {
        if tp.slices == 1 {
            // One slice: the whole product in one call, as an unsplit block always ran it.
            gemm_checked(dst, false, dy, (o as isize, 1), w, (1, o as isize), n, c, o, 1.0);
            return;
        }
        let (width, per) = (o / parts, os / parts);
        for p in 0..parts {
            let at = p * width + j * per;
            gemm_checked(dst, p > 0, &dy[at..], (o as isize, 1), &w[at..], (1, o as isize), n, c, per, 1.0);
        }
    };
    timed(Kernel::Matmul, || {
        leaf(dx, 0);
        for (j, l) in leaves.iter_mut().enumerate() {
            leaf(l, j + 1);
        }
    });
    sum_slices(dx, leaves, tp);
}

/// dst (m, n) [+]= a (m, k) · b (k, n) over views, dst's rows `dst_rs` apart:
/// a piece of a larger product, bounds-checked.
#[allow(clippy::too_many_arguments)]
fn gemm_at(
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    a: &[f32],
    a_view: (usize, usize),
    b: &[f32],
    b_view: (usize, usize),
    (m, n, k): (usize, usize, usize),
) {
    let reach = |len: usize, (rs, cs): (usize, usize), r: usize, c: usize| {
        assert!(r == 0 || c == 0 || (r - 1) * rs + (c - 1) * cs < len, "a view out of bounds");
    };
    reach(dst.len(), (dst_rs, 1), m, n);
    reach(a.len(), a_view, m, k);
    reach(b.len(), b_view, k, n);
    let view =
        |s: &[f32], (rs, cs): (usize, usize)| Mat { ptr: s.as_ptr(), rs: rs as isize, cs: cs as isize };
    // SAFETY: every element the three views address is in bounds (checked
    // above), and dst is a unique borrow, so it overlaps neither input.
    unsafe {
        gemm_raw(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_rs as isize,
            accumulate,
            view(a, a_view),
            view(b, b_view),
            1.0,
            pool_par(),
        )
    };
}

/// Where each slice of a product that is not summed over ranks lies: the
/// offset of slice j's columns (or rows) in each of `parts` blocks of a
/// rank's `width`, with the slice's length.
fn slice_runs(width: usize, parts: usize, tp: &TpRank) -> impl Iterator<Item = (usize, usize)> {
    let leaves = tp.leaves();
    let (block, per) = (width / parts, width / parts / leaves);
    (0..leaves).flat_map(move |j| (0..parts).map(move |q| (q * block + j * per, per)))
}

/// A column-parallel product, out (N, O) = inp (N, C) · w (C, O) + bias, O
/// this rank's columns. With more than one slice each slice's columns are a
/// product of their own, so a column has the same bits whichever rank, and
/// however many ranks, compute it: `gemm` takes other paths for other
/// shapes, so no block of a larger product is trusted to match the whole.
#[allow(clippy::too_many_arguments)]
fn column_product(
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    bias: &[f32],
    n: usize,
    c: usize,
    o: usize,
    parts: usize,
    tp: &TpRank,
) {
    if tp.slices == 1 {
        return matmul::matmul_forward(out, inp, w, Some(bias), n, c, o);
    }
    matmul::fill_rows(out, bias);
    for (at, per) in slice_runs(o, parts, tp) {
        gemm_at(&mut out[at..], o, true, inp, (c, 1), &w[at..], (o, 1), (n, per, c));
    }
}

/// The input gradient of a row-parallel product, dx (N, K) = dy (N, C) · wᵀ,
/// w (K, C) this rank's rows; per slice when sliced (see `column_product`).
fn row_parallel_dx(dx: &mut [f32], dy: &[f32], w: &[f32], n: usize, k: usize, c: usize, tp: &TpRank) {
    if tp.slices == 1 {
        return matmul::matmul_backward_input(dx, dy, w, n, k, c, false);
    }
    for (at, per) in slice_runs(k, 1, tp) {
        gemm_at(&mut dx[at..], k, false, dy, (c, 1), &w[at * c..], (1, c), (n, per, c));
    }
}

/// How a linear layer's weight is cut over ranks, for its gradient.
#[derive(Clone, Copy)]
enum Split {
    /// Row-parallel: this rank holds rows (its inputs).
    Rows,
    /// Column-parallel: this rank holds columns in `parts` blocks.
    Columns(usize),
}

/// One block's forward on one rank: `p` holds the rank's shards.
#[allow(clippy::too_many_arguments)]
fn gpt2_forward(
    p: &[Param],
    a: &mut Gpt2Acts,
    x: &[f32],
    out: &mut [f32],
    s: &mut Gpt2Scratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
) {
    let (t, c) = (cfg.block_size, cfg.n_embd);
    let (n, cl, nhl) = (b * t, c / tp.size, cfg.n_head / tp.size);
    timed(Kernel::LayerNorm, || {
        layernorm::layernorm_forward(
            &mut a.ln1,
            &mut a.ln1_mean,
            &mut a.ln1_rstd,
            x,
            &p[LN1W].data,
            &p[LN1B].data,
            n,
            c,
        )
    });
    timed(Kernel::Matmul, || {
        column_product(&mut a.qkv, &a.ln1, &p[QKVW].data, &p[QKVB].data, n, c, 3 * cl, 3, tp)
    });
    timed(Kernel::Attention, || {
        attention::attention_forward(&mut a.atty, &mut a.lse, &mut s.attn, &a.qkv, b, t, cl, nhl)
    });
    // res2 = x + atty · Wproj + bproj
    row_parallel(&mut a.res2, &mut s.leaves, &a.atty, &p[PROJW].data, &p[PROJB].data, n, cl, c, tp);
    timed(Kernel::Residual, || residual::accumulate(&mut a.res2, x));
    timed(Kernel::LayerNorm, || {
        layernorm::layernorm_forward(
            &mut a.ln2,
            &mut a.ln2_mean,
            &mut a.ln2_rstd,
            &a.res2,
            &p[LN2W].data,
            &p[LN2B].data,
            n,
            c,
        )
    });
    timed(Kernel::Matmul, || {
        column_product(&mut a.fch, &a.ln2, &p[FCW].data, &p[FCB].data, n, c, 4 * cl, 1, tp)
    });
    timed(Kernel::Gelu, || gelu::gelu_forward(&mut a.fch_gelu, &a.fch));
    row_parallel(out, &mut s.leaves, &a.fch_gelu, &p[FCPW].data, &p[FCPB].data, n, 4 * cl, c, tp);
    timed(Kernel::Residual, || residual::accumulate(out, &a.res2));
}

/// The input half of one block's backward on one rank. `dres` holds the
/// gradient of the block's output on entry and of its input on return; `g`
/// receives the intermediate output gradients. With `full` (a B), each weight
/// gradient is accumulated as soon as its output gradient exists — the same
/// kernel calls on the same inputs as the later W of a split backward, so the
/// same bits — and the gradients that `dres` carries need no copies.
#[allow(clippy::too_many_arguments)]
fn gpt2_backward_input(
    p: &mut [Param],
    a: &Gpt2Acts,
    x: &[f32],
    dres: &mut [f32],
    g: &mut Gpt2Grads,
    s: &mut Gpt2Scratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
    full: bool,
) {
    let (t, c) = (cfg.block_size, cfg.n_embd);
    let (n, cl, nhl) = (b * t, c / tp.size, cfg.n_head / tp.size);
    // MLP: out = res2 + gelu(ln2(res2)·Wfc)·Wfcproj
    if full {
        weight_grad(p, FCPW, FCPB, dres, &a.fch_gelu, n, 4 * cl, c, Split::Rows, tp);
    } else {
        g.dout.copy_from_slice(dres);
    }
    timed(Kernel::Matmul, || row_parallel_dx(&mut s.dgelu, dres, &p[FCPW].data, n, 4 * cl, c, tp));
    timed(Kernel::Gelu, || gelu::gelu_backward_into(&mut g.dfch, &a.fch, &s.dgelu, false));
    column_parallel_dx(&mut g.dln2, &mut s.leaves, &g.dfch, &p[FCW].data, n, c, 4 * cl, 1, tp);
    if full {
        weight_grad(p, FCW, FCB, &g.dfch, &a.ln2, n, c, 4 * cl, Split::Columns(1), tp);
    }
    timed(Kernel::LayerNorm, || {
        layernorm::layernorm_backward_input(
            dres,
            &g.dln2,
            &a.res2,
            &p[LN2W].data,
            &a.ln2_mean,
            &a.ln2_rstd,
            n,
            c,
        )
    });
    if full {
        norm_grad(p, LN2W, LN2B, &g.dln2, &a.res2, &a.ln2_mean, &a.ln2_rstd, n, c);
    }
    // dres is now ∂L/∂res2. Attention: res2 = x + attn(ln1(x))·Wproj.
    if full {
        weight_grad(p, PROJW, PROJB, dres, &a.atty, n, cl, c, Split::Rows, tp);
    } else {
        g.dres2.copy_from_slice(dres);
    }
    timed(Kernel::Matmul, || row_parallel_dx(&mut s.datty, dres, &p[PROJW].data, n, cl, c, tp));
    // dK and dV accumulate over query tiles, so this one starts from zero.
    g.dqkv.fill(0.0);
    timed(Kernel::Attention, || {
        attention::attention_backward(
            &mut g.dqkv,
            &mut s.attn,
            &s.datty,
            &a.qkv,
            &a.atty,
            &a.lse,
            b,
            t,
            cl,
            nhl,
        )
    });
    column_parallel_dx(&mut g.dln1, &mut s.leaves, &g.dqkv, &p[QKVW].data, n, c, 3 * cl, 3, tp);
    if full {
        weight_grad(p, QKVW, QKVB, &g.dqkv, &a.ln1, n, c, 3 * cl, Split::Columns(3), tp);
    }
    timed(Kernel::LayerNorm, || {
        layernorm::layernorm_backward_input(dres, &g.dln1, x, &p[LN1W].data, &a.ln1_mean, &a.ln1_rstd, n, c)
    });
    if full {
        norm_grad(p, LN1W, LN1B, &g.dln1, x, &a.ln1_mean, &a.ln1_rstd, n, c);
    }
}

/// dW += inpᵀ · dout and db += Σ dout for the linear layer whose tensors are p[w], p[bias].
#[allow(clippy::too_many_arguments)]
fn weight_grad(
    p: &mut [Param],
    w: usize,
    bias: usize,
    dout: &[f32],
    inp: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
    split: Split,
    tp: &TpRank,
) {
    let (w, bias) = pair(p, w, bias);
    timed(Kernel::Matmul, || {
        if tp.slices == 1 {
            return matmul::matmul_backward_weight(&mut w.grad, Some(&mut bias.grad), dout, inp, n, ic, oc);
        }
        // Per slice (see `column_product`): dW's rows or columns of each slice alone.
        match split {
            Split::Rows => {
                for (at, per) in slice_runs(ic, 1, tp) {
                    gemm_at(
                        &mut w.grad[at * oc..],
                        oc,
                        true,
                        &inp[at..],
                        (1, ic),
                        dout,
                        (oc, 1),
                        (per, oc, n),
                    );
                }
            }
            Split::Columns(parts) => {
                for (at, per) in slice_runs(oc, parts, tp) {
                    gemm_at(&mut w.grad[at..], oc, true, inp, (1, ic), &dout[at..], (oc, 1), (ic, per, n));
                }
            }
        }
        matmul::column_sum_accumulate(&mut bias.grad, dout, n, oc);
    });
}

/// The weight and bias gradients of the LayerNorm whose tensors are p[w], p[bias].
#[allow(clippy::too_many_arguments)]
fn norm_grad(
    p: &mut [Param],
    w: usize,
    bias: usize,
    dout: &[f32],
    inp: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    let (w, bias) = pair(p, w, bias);
    timed(Kernel::LayerNorm, || {
        layernorm::layernorm_backward_weight(&mut w.grad, &mut bias.grad, dout, inp, mean, rstd, n, c)
    });
}

/// The weight half of one block's backward (a W): accumulates every weight
/// gradient of the block from its activations and the output gradients its I kept.
fn gpt2_backward_weight(
    p: &mut [Param],
    a: &Gpt2Acts,
    x: &[f32],
    g: &Gpt2Grads,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
) {
    let c = cfg.n_embd;
    let (n, cl) = (b * cfg.block_size, c / tp.size);
    weight_grad(p, FCPW, FCPB, &g.dout, &a.fch_gelu, n, 4 * cl, c, Split::Rows, tp);
    weight_grad(p, FCW, FCB, &g.dfch, &a.ln2, n, c, 4 * cl, Split::Columns(1), tp);
    norm_grad(p, LN2W, LN2B, &g.dln2, &a.res2, &a.ln2_mean, &a.ln2_rstd, n, c);
    weight_grad(p, PROJW, PROJB, &g.dres2, &a.atty, n, cl, c, Split::Rows, tp);
    weight_grad(p, QKVW, QKVB, &g.dqkv, &a.ln1, n, c, 3 * cl, Split::Columns(3), tp);
    norm_grad(p, LN1W, LN1B, &g.dln1, x, &a.ln1_mean, &a.ln1_rstd, n, c);
}

/// How a block tensor is cut over tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Whole on every rank (LayerNorms, the row-parallel products' biases).
    Whole,
    /// Its last dimension is `parts` equal blocks (q, k, v: 3), each cut into
    /// `size` runs of columns; rank r holds run r of every block, in order.
    Columns { parts: usize },
    /// Its rows are cut into `size` runs; rank r holds run r.
    Rows,
}

/// How block tensor `i` (its index among the block's tensors) is cut.
pub fn cut_of(cfg: &Arch, i: usize) -> Cut {
    if cfg.family == Family::Llama {
        return super::llama::cut_of(i);
    }
    match i {
        QKVW | QKVB => Cut::Columns { parts: 3 },
        FCW | FCB => Cut::Columns { parts: 1 },
        PROJW | FCPW => Cut::Rows,
        _ => Cut::Whole,
    }
}

/// Rank `rank` of `size`'s piece of block tensor `i`, whose last dimension is `cols` long.
pub fn shard(cut: Cut, full: &[f32], cols: usize, rank: usize, size: usize) -> Vec<f32> {
    let mut out = Vec::new();
    shard_into(&mut out, cut, full, cols, rank, size);
    out
}

/// [`shard`] into `out`, reusing its memory (ranks cut their shards at every forward).
pub fn shard_into(out: &mut Vec<f32>, cut: Cut, full: &[f32], cols: usize, rank: usize, size: usize) {
    out.clear();
    match cut {
        Cut::Whole => out.extend_from_slice(full),
        Cut::Rows => {
            let run = full.len() / size;
            out.extend_from_slice(&full[rank * run..(rank + 1) * run]);
        }
        Cut::Columns { parts } => {
            let (width, piece) = (cols / parts, cols / parts / size);
            for row in full.chunks(cols) {
                for p in 0..parts {
                    out.extend_from_slice(&row[p * width + rank * piece..][..piece]);
                }
            }
        }
    }
}

/// Block tensor `i` joined from every rank's piece (rank order); the
/// inverse of [`shard`]. A whole tensor is rank 0's.
pub fn unshard(cut: Cut, pieces: &[&[f32]], cols: usize) -> Vec<f32> {
    let len = match cut {
        Cut::Whole => pieces[0].len(),
        _ => pieces.iter().map(|p| p.len()).sum(),
    };
    let mut full = vec![0.0; len];
    unshard_into(&mut full, cut, pieces, cols);
    full
}

/// [`unshard`] into `full`, the whole tensor's memory (gradients are joined
/// after every block's weight gradients).
pub fn unshard_into(full: &mut [f32], cut: Cut, pieces: &[&[f32]], cols: usize) {
    let size = pieces.len();
    match cut {
        Cut::Whole => full.copy_from_slice(pieces[0]),
        Cut::Rows => {
            for (dst, src) in full.chunks_mut(full.len() / size).zip(pieces) {
                dst.copy_from_slice(src);
            }
        }
        Cut::Columns { parts } => {
            let (width, piece) = (cols / parts, cols / parts / size);
            for (r, sh) in pieces.iter().enumerate() {
                for (row, src) in sh.chunks(cols / size).enumerate() {
                    for p in 0..parts {
                        let at = row * cols + p * width + r * piece;
                        full[at..at + piece].copy_from_slice(&src[p * piece..(p + 1) * piece]);
                    }
                }
            }
        }
    }
}

/// Tensor-parallel ranks that are threads of one process: each puts its
/// node in a slot, all wait, each sums every slot by the tree, all wait again
/// (so no slot is overwritten before every rank has read it).
pub struct ThreadGroup {
    /// One node per rank of the whole group; this process fills `local`'s,
    /// the exchange the others'.
    slots: Vec<std::sync::RwLock<Vec<f32>>>,
    local: std::ops::Range<usize>,
    barrier: std::sync::Barrier,
    exchange: Option<Box<dyn Exchange>>,
    /// All-reduces so far: every rank of the group makes the same calls in
    /// the same order, so the count names a call across processes.
    calls: std::sync::atomic::AtomicU64,
    /// Why an exchange failed. The ranks finish their calls on what they
    /// hold (a rank stopping alone would leave the others at a barrier) and
    /// the caller reads this after: their results are void.
    failed: std::sync::Mutex<Option<String>>,
}

/// How the ranks of one process meet the group's other processes: this
/// process's nodes for call `seq` go out, every other rank's come back.
pub trait Exchange: Send + Sync {
    /// `local`: the nodes of ranks `first..first + local.len()`. Returns
    /// (rank, node) for every rank held elsewhere, or why they never came.
    fn swap(&self, seq: u64, first: usize, local: &[&[f32]]) -> Result<Vec<(usize, Vec<f32>)>, String>;
}

/// A group's processes share one exchange between their owner and followers.
impl<T: Exchange + ?Sized> Exchange for std::sync::Arc<T> {
    fn swap(&self, seq: u64, first: usize, local: &[&[f32]]) -> Result<Vec<(usize, Vec<f32>)>, String> {
        (**self).swap(seq, first, local)
    }
}

impl ThreadGroup {
    /// Every rank in this process.
    pub fn new(size: usize) -> Self {
        ThreadGroup::spanning(size, 0..size, None)
    }

    /// Ranks `local` of `size` in this process, the rest reached by `exchange`.
    pub fn spanning(size: usize, local: std::ops::Range<usize>, exchange: Option<Box<dyn Exchange>>) -> Self {
        assert!(exchange.is_some() || local == (0..size), "ranks elsewhere need an exchange");
        ThreadGroup {
            slots: (0..size).map(|_| std::sync::RwLock::new(Vec::new())).collect(),
            barrier: std::sync::Barrier::new(local.len()),
            local,
            exchange,
            calls: std::sync::atomic::AtomicU64::new(0),
            failed: std::sync::Mutex::new(None),
        }
    }
}

impl ThreadGroup {
    /// Why an exchange with the other processes failed, if one did.
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().map(|f| f.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    fn fail(&self, why: String) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
    }
}

impl TensorGroup for ThreadGroup {
    fn all_reduce(&self, rank: usize, node: &mut [f32]) {
        {
            let mut slot = self.slots[rank].write().expect("slot");
            slot.clear();
            slot.extend_from_slice(node);
        }
        self.barrier.wait();
        if let Some(x) = &self.exchange {
            // The process's first rank trades for all of them; the others wait.
            if rank == self.local.start && self.failure().is_none() {
                let seq = self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let theirs = {
                    let held: Vec<_> =
                        self.local.clone().map(|r| self.slots[r].read().expect("slot")).collect();
                    let nodes: Vec<&[f32]> = held.iter().map(|g| g.as_slice()).collect();
                    x.swap(seq, self.local.start, &nodes)
                };
                match theirs {
                    Ok(theirs) => {
                        let len = node.len();
                        let wrong = theirs.iter().find(|(r, n)| {
                            self.local.contains(r) || *r >= self.slots.len() || n.len() != len
                        });
                        match wrong {
                            // An exchange that checks less than `Link` does must
                            // not turn a hostile node into an index out of bounds.
                            Some((r, n)) => self.fail(format!(
                                "all-reduce {seq}: the exchange returned a node of {} elements for \
                                 rank {r}; wanted {len} elements for a rank of 0..{} outside {:?}",
                                n.len(),
                                self.slots.len(),
                                self.local
                            )),
                            None => {
                                for (r, n) in theirs {
                                    *self.slots[r].write().expect("slot") = n;
                                }
                            }
                        }
                    }
                    Err(e) => self.fail(e),
                }
            }
            self.barrier.wait();
        }
        // After a failed exchange the other processes' slots hold nothing
        // (or an older call's nodes): the ranks leave their nodes as they are
        // and the caller, reading `failure`, voids the result.
        if self.failure().is_none() {
            let held: Vec<_> = self.slots.iter().map(|s| s.read().expect("slot")).collect();
            let nodes: Vec<&[f32]> = held.iter().map(|g| g.as_slice()).collect();
            tree_sum_elementwise(node, &nodes);
        }
        self.barrier.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::params::{block_tensors, Param};

    const B: usize = 2;

    fn cfg() -> Arch {
        Arch::gpt2(1, 8, 64, 16, 24)
    }

    /// Shapes small enough that `gemm` takes other paths than for `cfg`'s:
    /// a column block of a product is then not the whole product's bits.
    fn small_cfg() -> Arch {
        Arch::gpt2(1, 4, 32, 16, 8)
    }

    fn noise(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
            })
            .collect()
    }

    /// Block 0's 12 tensors with random values (LayerNorm gains near 1).
    fn block_params(cfg: &Arch) -> Vec<Param> {
        block_tensors(cfg, 0)
            .iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let len = shape.iter().product();
                let mut data = noise(len, 100 + i as u64);
                if matches!(i, LN1W | LN2W) {
                    data.iter_mut().for_each(|v| *v += 1.0);
                }
                Param { name: name.clone(), shape: shape.clone(), grad: vec![0.0; len], data, canonical: i }
            })
            .collect()
    }

    /// What one rank computes: the block's output, the input gradient and
    /// its (shard's) weight gradients, after a forward and a full backward.
    struct Result {
        out: Vec<f32>,
        dx: Vec<f32>,
        grads: Vec<Vec<f32>>,
    }

    fn run_rank(full: &[Param], cfg: &Arch, tp: &TpRank, split: bool) -> Result {
        let n = B * cfg.block_size;
        let c = cfg.n_embd;
        let mut p: Vec<Param> = full
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let cols = *q.shape.last().unwrap();
                let data = shard(cut_of(cfg, i), &q.data, cols, tp.rank, tp.size);
                Param { grad: vec![0.0; data.len()], data, ..q.clone() }
            })
            .collect();
        let x = noise(n * c, 7);
        let mut a = BlockActs::new(B, cfg, tp.size);
        let mut s = BlockScratch::new(B, cfg, tp);
        let mut out = vec![0.0; n * c];
        block_forward(&p, &mut a, &x, &mut out, &mut s, B, cfg, tp);
        let mut dx = noise(n * c, 8);
        let mut g = BlockGrads::new(n, cfg, tp.size);
        block_backward_input(&mut p, &a, &x, &mut dx, &mut g, &mut s, B, cfg, tp, !split);
        if split {
            block_backward_weight(&mut p, &a, &x, &g, B, cfg, tp);
        }
        Result { out, dx, grads: p.into_iter().map(|q| q.grad).collect() }
    }

    /// Runs `size` ranks as threads with one group; the ranks' results.
    fn run_split(full: &[Param], cfg: &Arch, size: usize, slices: usize, split: bool) -> Vec<Result> {
        let group = ThreadGroup::new(size);
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..size)
                .map(|rank| {
                    let group: &dyn TensorGroup = &group;
                    let tp = TpRank { rank, size, slices, group: Some(group) };
                    sc.spawn(move || run_rank(full, cfg, &tp, split))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Panics naming the first element whose bits differ (the vectors are long).
    fn same_bits(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!("{what}: element {i} is {} where one rank gives {}", got[i], want[i]);
        }
    }

    #[test]
    fn every_rank_count_dividing_the_slices_gives_the_bits_of_one_rank() {
        for cfg in [cfg(), small_cfg()] {
            ranks_give_one_ranks_bits(&cfg);
        }
    }

    fn ranks_give_one_ranks_bits(cfg: &Arch) {
        let cfg = *cfg;
        let full = block_params(&cfg);
        let one = run_split(&full, &cfg, 1, 4, false).pop().unwrap();
        for (size, split) in [(2, false), (4, false), (2, true), (4, true)] {
            let ranks = run_split(&full, &cfg, size, 4, split);
            for (r, res) in ranks.iter().enumerate() {
                same_bits(&res.out, &one.out, &format!("output, rank {r} of {size}"));
                same_bits(&res.dx, &one.dx, &format!("input gradient, rank {r} of {size}"));
            }
            for (i, whole) in one.grads.iter().enumerate() {
                let pieces: Vec<&[f32]> = ranks.iter().map(|res| res.grads[i].as_slice()).collect();
                let cols = *full[i].shape.last().unwrap();
                same_bits(
                    &unshard(cut_of(&cfg, i), &pieces, cols),
                    whole,
                    &format!("{} at {size} ranks", full[i].name),
                );
                if cut_of(&cfg, i) == Cut::Whole {
                    for (r, p) in pieces.iter().enumerate() {
                        same_bits(p, whole, &format!("{}: rank {r} of {size} holds it whole", full[i].name));
                    }
                }
            }
        }
    }

    #[test]
    fn one_slice_is_the_plain_product_and_more_slices_change_only_the_rounding() {
        let cfg = cfg();
        let full = block_params(&cfg);
        let plain = run_split(&full, &cfg, 1, 1, false).pop().unwrap();
        let sliced = run_split(&full, &cfg, 1, 8, false).pop().unwrap();
        // Another order of the same sums: not the same bits, the same values to f32's rounding.
        assert_ne!(bits(&plain.out), bits(&sliced.out));
        assert_ne!(bits(&plain.dx), bits(&sliced.dx));
        for (a, b) in [(&plain.out, &sliced.out), (&plain.dx, &sliced.dx)] {
            let worst =
                a.iter().zip(b.iter()).map(|(x, y)| (x - y).abs() / (1.0 + x.abs())).fold(0.0, f32::max);
            assert!(worst < 1e-5, "sliced sums are the same sums: {worst}");
        }
        // One slice is what matmul_forward computes.
        let n = B * cfg.block_size;
        let (c, x) = (cfg.n_embd, noise(n * cfg.n_embd, 3));
        let mut want = vec![0.0; n * c];
        matmul::matmul_forward(&mut want, &x, &full[PROJW].data, Some(&full[PROJB].data), n, c, c);
        let mut got = vec![0.0; n * c];
        row_parallel(
            &mut got,
            &mut [],
            &x,
            &full[PROJW].data,
            &full[PROJB].data,
            n,
            c,
            c,
            &crate::model::tp::TpShape::WHOLE.single(),
        );
        same_bits(&got, &want, "one slice against matmul_forward");
    }

    #[test]
    fn shard_and_unshard_are_inverse_and_cut_heads_whole() {
        let cfg = cfg();
        let full = block_params(&cfg);
        for size in [1, 2, 4, 8] {
            for (i, p) in full.iter().enumerate() {
                let cols = *p.shape.last().unwrap();
                let pieces: Vec<Vec<f32>> =
                    (0..size).map(|r| shard(cut_of(&cfg, i), &p.data, cols, r, size)).collect();
                let refs: Vec<&[f32]> = pieces.iter().map(Vec::as_slice).collect();
                same_bits(&unshard(cut_of(&cfg, i), &refs, cols), &p.data, &format!("{} at {size}", p.name));
            }
        }
        // Rank 1 of 2 holds heads 4..8: q columns 32..64 of row 0 come first.
        let q = shard(cut_of(&cfg, QKVW), &full[QKVW].data, 192, 1, 2);
        assert_eq!(&q[..32], &full[QKVW].data[32..64]);
        assert_eq!(&q[32..64], &full[QKVW].data[64 + 32..128]);
    }

    /// An exchange with the group's other process that answers each call
    /// with `reply`.
    struct Canned(std::result::Result<Vec<(usize, Vec<f32>)>, String>);

    impl Exchange for Canned {
        fn swap(
            &self,
            _: u64,
            _: usize,
            _: &[&[f32]],
        ) -> std::result::Result<Vec<(usize, Vec<f32>)>, String> {
            self.0.clone()
        }
    }

    /// Ranks 0 and 1 of 4 all-reduce once in this process over `x`.
    fn reduce_over(x: Canned) -> (Option<String>, Vec<Vec<f32>>) {
        let group = ThreadGroup::spanning(4, 0..2, Some(Box::new(x)));
        let mut nodes = vec![vec![1.0f32; 8], vec![2.0; 8]];
        std::thread::scope(|sc| {
            for (r, n) in nodes.iter_mut().enumerate() {
                let g = &group;
                sc.spawn(move || g.all_reduce(r, n));
            }
        });
        (group.failure(), nodes)
    }

    #[test]
    fn a_failed_exchange_is_reported_with_its_own_words_not_an_index_panic() {
        let (failed, nodes) = reduce_over(Canned(Err("process rank 1 sent 3 elements, not 8".into())));
        assert_eq!(failed.as_deref(), Some("process rank 1 sent 3 elements, not 8"));
        assert_eq!(nodes, vec![vec![1.0; 8], vec![2.0; 8]], "void results are left as they were");
    }

    #[test]
    fn an_exchange_handing_back_a_short_node_fails_the_group_naming_the_rank() {
        let (failed, _) = reduce_over(Canned(Ok(vec![(2, vec![3.0; 8]), (3, vec![4.0; 3])])));
        let e = failed.expect("a short node fails the all-reduce");
        assert!(e.contains("3 elements for rank 3") && e.contains("wanted 8"), "{e}");
        let (failed, nodes) = reduce_over(Canned(Ok(vec![(2, vec![3.0; 8]), (3, vec![4.0; 8])])));
        assert_eq!((failed, nodes), (None, vec![vec![10.0; 8]; 2]));
    }
}
