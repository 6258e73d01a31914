//! One Llama decoder block on the CPU, as Hugging Face's `LlamaDecoderLayer`
//! computes it:
//!
//!   h   = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1))),  n1 = rms(x)·w1
//!   out = h + down_proj(silu(gate_proj(n2)) · up_proj(n2)),                     n2 = rms(h)·w2
//!
//! with grouped-query attention (NKV key/value heads shared by groups of the
//! NH query heads), RoPE on q and k, no biases. Weights keep Hugging Face's
//! layout and names (`nn.Linear`'s (out, in)), so a checkpoint maps onto them
//! one to one; the products read them transposed through strided views.
//!
//! The block runs on rank `rank` of `size` tensor-parallel ranks as GPT-2's
//! does (see block.rs's module comment): a rank holds the q rows of its query
//! heads, the k and v rows of their key/value heads (`size` divides NKV, so a
//! group never straddles ranks), a row block of gate and up, and the matching
//! input columns of o and down; the norms are whole. Attention, RoPE and
//! SwiGLU are per head or per element and need no communication. The sums
//! over ranks — forward's o and down products, backward's input gradients of
//! q/k/v and of gate/up — are each the pairwise tree over `slices` K-slices,
//! slice j reading query heads [j·NH/S, (j+1)·NH/S), key/value heads
//! [j·NKV/S, ..) and MLP rows [j·F/S, ..); a rank sums its aligned run of
//! S/size slices and the group joins the runs, so every size dividing S gives
//! the bits of size 1. The products that are not summed over ranks are cut
//! into the same slices, each a product of its own, so a column's bits do not
//! depend on which rank computes it. With one slice every product is the
//! plain one.

use super::block::{sum_slices, Cut, TpRank};
use super::params::{Arch, Param};
use crate::kernels::cpu::attention::{gqa_backward, gqa_forward, scratch_len, Heads};
use crate::kernels::cpu::matmul::{gemm_raw, pool_par, Mat};
use crate::kernels::cpu::rope::{inv_freq, rope_backward, rope_forward, RopeTable};
use crate::kernels::cpu::{residual, rmsnorm, swiglu};
use crate::kernels::profile::{timed, Kernel};

/// The shape of one Llama block, or of one rank's share of it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaBlockShape {
    /// Hidden size C.
    pub c: usize,
    pub heads: Heads,
    /// MLP width F (`intermediate_size`).
    pub f: usize,
    /// `rms_norm_eps`.
    pub eps: f32,
}

impl LlamaBlockShape {
    pub fn of(cfg: &super::Arch) -> Self {
        LlamaBlockShape { c: cfg.n_embd, heads: cfg.heads(), f: cfg.ffn(), eps: cfg.norm_eps }
    }

    /// One rank's share over `size` ranks: its query and key/value heads and
    /// MLP rows (the hidden size stays whole).
    pub fn share(&self, size: usize) -> Self {
        let Heads { nh, nkv, hs } = self.heads;
        LlamaBlockShape { heads: Heads { nh: nh / size, nkv: nkv / size, hs }, f: self.f / size, ..*self }
    }
}

/// Tensors per block.
pub const BLOCK_LEN: usize = 9;

/// Indices of a block's tensors, in [`block_tensors`] order.
pub const IN_NORM: usize = 0;
pub const Q: usize = 1;
pub const K: usize = 2;
pub const V: usize = 3;
pub const O: usize = 4;
pub const POST_NORM: usize = 5;
pub const GATE: usize = 6;
pub const UP: usize = 7;
pub const DOWN: usize = 8;

/// Block `i`'s tensors with Hugging Face's names (less the leading `model.`)
/// and shapes, in canonical order.
pub fn block_tensors(s: &LlamaBlockShape, i: usize) -> Vec<(String, Vec<usize>)> {
    let (c, f) = (s.c, s.f);
    let (q, kv) = (s.heads.out_width(), s.heads.nkv * s.heads.hs);
    let p = |name: &str| format!("layers.{i}.{name}");
    vec![
        (p("input_layernorm.weight"), vec![c]),
        (p("self_attn.q_proj.weight"), vec![q, c]),
        (p("self_attn.k_proj.weight"), vec![kv, c]),
        (p("self_attn.v_proj.weight"), vec![kv, c]),
        (p("self_attn.o_proj.weight"), vec![c, q]),
        (p("post_attention_layernorm.weight"), vec![c]),
        (p("mlp.gate_proj.weight"), vec![f, c]),
        (p("mlp.up_proj.weight"), vec![f, c]),
        (p("mlp.down_proj.weight"), vec![c, f]),
    ]
}

/// Intermediate values of one block for one microbatch on one rank (the
/// widths are the rank's share: W = (NH + 2·NKV)·HS, F and the heads per rank).
#[derive(Default)]
pub struct LlamaActs {
    n1: Vec<f32>,      // (N, C)
    rstd1: Vec<f32>,   // (N)
    qkv: Vec<f32>,     // (N, W): q and k after RoPE
    atty: Vec<f32>,    // (N, NH·HS)
    lse: Vec<f32>,     // (B, NH, T)
    h: Vec<f32>,       // (N, C) residual after attention
    n2: Vec<f32>,      // (N, C)
    rstd2: Vec<f32>,   // (N)
    gate_up: Vec<f32>, // (N, 2F)
    act: Vec<f32>,     // (N, F)
}

impl LlamaActs {
    pub fn new(b: usize, cfg: &Arch, size: usize) -> Self {
        LlamaActs::with_shape(b, cfg.block_size, &LlamaBlockShape::of(cfg).share(size))
    }

    pub fn bytes(&self) -> usize {
        let all = [
            &self.n1,
            &self.rstd1,
            &self.qkv,
            &self.atty,
            &self.lse,
            &self.h,
            &self.n2,
            &self.rstd2,
            &self.gate_up,
            &self.act,
        ];
        4 * all.iter().map(|v| v.len()).sum::<usize>()
    }

    /// For a block (or a rank's share) of shape `s`.
    pub fn with_shape(b: usize, t: usize, s: &LlamaBlockShape) -> Self {
        let n = b * t;
        let (c, f, heads) = (s.c, s.f, s.heads);
        LlamaActs {
            n1: vec![0.0; n * c],
            rstd1: vec![0.0; n],
            qkv: vec![0.0; n * heads.qkv_width()],
            atty: vec![0.0; n * heads.out_width()],
            lse: vec![0.0; b * heads.nh * t],
            h: vec![0.0; n * c],
            n2: vec![0.0; n * c],
            rstd2: vec![0.0; n],
            gate_up: vec![0.0; n * 2 * f],
            act: vec![0.0; n * f],
        }
    }
}

/// The gradients of a block's intermediate outputs on one rank, written by
/// the input half of its backward (I) and read by the weight half (W). A
/// full backward (B) works in the four it computes anyway and leaves `dout`
/// and `dh`, which it reads from the caller's buffer, untouched.
pub struct LlamaGrads {
    dout: Vec<f32>, // (N, C) the block's output: down's output gradient
    dgu: Vec<f32>,  // (N, 2F) gate's and up's outputs
    dn2: Vec<f32>,  // (N, C) the post-attention norm's output
    dh: Vec<f32>,   // (N, C) the residual after attention: o's output gradient
    dqkv: Vec<f32>, // (N, W) q, k, v's outputs (before RoPE for q and k)
    dn1: Vec<f32>,  // (N, C) the input norm's output
}

impl LlamaGrads {
    /// For `n` rows (B·T) on a rank of `size`.
    pub fn new(n: usize, cfg: &Arch, size: usize) -> Self {
        LlamaGrads::with_shape(n, &LlamaBlockShape::of(cfg).share(size))
    }

    pub fn with_shape(n: usize, s: &LlamaBlockShape) -> Self {
        LlamaGrads {
            dout: vec![0.0; n * s.c],
            dgu: vec![0.0; n * 2 * s.f],
            dn2: vec![0.0; n * s.c],
            dh: vec![0.0; n * s.c],
            dqkv: vec![0.0; n * s.heads.qkv_width()],
            dn1: vec![0.0; n * s.c],
        }
    }

    pub fn bytes(&self) -> usize {
        let all = [&self.dout, &self.dgu, &self.dn2, &self.dh, &self.dqkv, &self.dn1];
        4 * all.iter().map(|v| v.len()).sum::<usize>()
    }
}

/// One rank's workspace (one microbatch runs at a time): the rotary table
/// and backward's intermediate gradients, kept so a step allocates nothing.
pub struct LlamaScratch {
    rope: RopeTable,
    attn: Vec<f32>,
    dact: Vec<f32>,  // (N, F)
    datty: Vec<f32>, // (N, NH·HS)
    /// Slices 1.. of this rank's run of a split sum, (N, C) each (slice 0
    /// is summed in the output itself).
    leaves: Vec<Vec<f32>>,
}

impl LlamaScratch {
    pub fn new(b: usize, cfg: &Arch, tp: &TpRank) -> Self {
        let whole = LlamaBlockShape::of(cfg);
        let Heads { nh, nkv, .. } = whole.heads;
        // The config refuses other splits (config.rs, check_tp); a slice must be whole heads and groups.
        assert!(
            tp.slices.is_multiple_of(tp.size)
                && nkv.is_multiple_of(tp.slices)
                && nh.is_multiple_of(tp.slices)
                && whole.f.is_multiple_of(tp.slices),
            "a Llama block of {nh} query heads, {nkv} key/value heads and MLP width {} over {} slices \
             on {} ranks: the slices must divide all three and be a multiple of the ranks",
            whole.f,
            tp.slices,
            tp.size
        );
        LlamaScratch::with_shape(b, rope_table(cfg), &whole.share(tp.size), tp.slices / tp.size)
    }

    /// For a rank's share `s` that sums `leaves` slices of each split sum.
    pub fn with_shape(b: usize, rope: RopeTable, s: &LlamaBlockShape, leaves: usize) -> Self {
        let n = b * rope.t;
        let (c, f, heads) = (s.c, s.f, s.heads);
        LlamaScratch {
            attn: vec![0.0; scratch_len(b, heads.nh, rope.t)],
            rope,
            dact: vec![0.0; n * f],
            datty: vec![0.0; n * heads.out_width()],
            leaves: (1..leaves).map(|_| vec![0.0; n * c]).collect(),
        }
    }
}

/// The rotary table of a model's positions and head size (both backends use it).
pub fn rope_table(cfg: &Arch) -> RopeTable {
    RopeTable::new(cfg.block_size, &inv_freq(cfg.head_dim(), cfg.rope_theta))
}

/// How block tensor `i` is cut over tensor-parallel ranks (weights are
/// (out, in)): the norms whole, q, k, v, gate and up by output rows, o and
/// down by input columns.
pub fn cut_of(i: usize) -> Cut {
    match i {
        Q | K | V | GATE | UP => Cut::Rows,
        O | DOWN => Cut::Columns { parts: 1 },
        _ => Cut::Whole,
    }
}

/// The block's forward on one rank (see [`llama_block_forward`]).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    p: &[Param],
    a: &mut LlamaActs,
    x: &[f32],
    out: &mut [f32],
    s: &mut LlamaScratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
) {
    llama_block_forward(p, a, x, out, s, b, &LlamaBlockShape::of(cfg).share(tp.size), tp);
}

/// The input half of the block's backward on one rank, with `full` the
/// weight half too (see [`llama_block_backward_input`]).
#[allow(clippy::too_many_arguments)]
pub fn backward_input(
    p: &mut [Param],
    a: &LlamaActs,
    x: &[f32],
    dres: &mut [f32],
    g: &mut LlamaGrads,
    s: &mut LlamaScratch,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
    full: bool,
) {
    let share = LlamaBlockShape::of(cfg).share(tp.size);
    llama_block_backward_input(p, a, x, dres, g, s, b, &share, tp, full);
}

/// The weight half of the block's backward on one rank (see [`llama_block_backward_weight`]).
pub fn backward_weight(
    p: &mut [Param],
    a: &LlamaActs,
    x: &[f32],
    g: &LlamaGrads,
    b: usize,
    cfg: &Arch,
    tp: &TpRank,
) {
    let share = LlamaBlockShape::of(cfg).share(tp.size);
    llama_block_backward_weight(p, a, x, g, b * cfg.block_size, &share, tp);
}

/// A strided view of a buffer: element (i, j) at `buf[at + i·rs + j·cs]`.
#[derive(Clone, Copy)]
struct View<'a> {
    buf: &'a [f32],
    at: usize,
    rs: usize,
    cs: usize,
}

impl<'a> View<'a> {
    /// Row-major with `cols` columns, from column `col0` on.
    fn rows(buf: &'a [f32], cols: usize, col0: usize) -> Self {
        View { buf, at: col0, rs: cols, cs: 1 }
    }

    /// The transpose of row-major with `cols` columns, from `at` on.
    fn rows_t(buf: &'a [f32], cols: usize, at: usize) -> Self {
        View { buf, at, rs: 1, cs: cols }
    }

    /// Panics unless every element of an (r, c) window is in the buffer.
    fn mat(&self, r: usize, c: usize) -> Mat {
        assert!(
            r == 0 || c == 0 || self.at + (r - 1) * self.rs + (c - 1) * self.cs < self.buf.len(),
            "a ({r}, {c}) view at {} with strides ({}, {}) past a buffer of {}",
            self.at,
            self.rs,
            self.cs,
            self.buf.len()
        );
        Mat {
            ptr: self.buf[self.at.min(self.buf.len())..].as_ptr(),
            rs: self.rs as isize,
            cs: self.cs as isize,
        }
    }
}

/// dst[at..] (m, n), rows `dst_rs` apart, [+]= a (m, k) · b (k, n).
#[allow(clippy::too_many_arguments)]
fn gemm_into(
    dst: &mut [f32],
    at: usize,
    dst_rs: usize,
    accumulate: bool,
    a: View,
    b: View,
    (m, n, k): (usize, usize, usize),
) {
    assert!(m == 0 || n == 0 || at + (m - 1) * dst_rs + n <= dst.len(), "a product's rows past its output");
    let (a, b) = (a.mat(m, k), b.mat(k, n));
    // SAFETY: every element the three views address is in bounds (checked
    // above and by `mat`), and dst is a unique borrow, so it overlaps neither input.
    unsafe { gemm_raw(m, n, k, dst[at..].as_mut_ptr(), dst_rs as isize, accumulate, a, b, 1.0, pool_par()) };
}

/// Column-parallel forward: out[:, col0..col0 + O] (rows `out_cols` apart) =
/// x (N, I) · wᵀ, w (O, I) this rank's rows, one product per slice.
#[allow(clippy::too_many_arguments)]
fn column_product(
    out: &mut [f32],
    out_cols: usize,
    col0: usize,
    x: &[f32],
    w: &[f32],
    (n, i, o): (usize, usize, usize),
    leaves: usize,
) {
    assert!(x.len() == n * i && w.len() == o * i);
    let per = o / leaves;
    for j in 0..leaves {
        let (xv, wv) = (View::rows(x, i, 0), View::rows_t(w, i, j * per * i));
        gemm_into(out, col0 + j * per, out_cols, false, xv, wv, (n, per, i));
    }
}

/// The weight gradient of a column-parallel product: dw (O, I) += dyᵀ · x,
/// dy the columns [col0, col0 + O) of a (N, dy_cols) buffer; per slice.
#[allow(clippy::too_many_arguments)]
fn column_weight_grad(
    dw: &mut [f32],
    dy: &[f32],
    dy_cols: usize,
    col0: usize,
    x: &[f32],
    (n, i, o): (usize, usize, usize),
    leaves: usize,
) {
    assert!(x.len() == n * i && dw.len() == o * i);
    let per = o / leaves;
    for j in 0..leaves {
        let dyt = View::rows_t(dy, dy_cols, col0 + j * per);
        gemm_into(dw, j * per * i, i, true, dyt, View::rows(x, i, 0), (per, i, n));
    }
}

/// One of the products a column-parallel input gradient sums: `dy`'s columns
/// [col0, col0 + O) (of `dy_cols`) against w (O, I), this rank's rows.
struct ColumnPart<'a> {
    dy: &'a [f32],
    dy_cols: usize,
    col0: usize,
    w: &'a [f32],
    o: usize,
}

/// The input gradient of column-parallel products, dx (N, I) = Σ over this
/// rank's slices of Σ over `parts` of dy[:, slice] · w[slice, :], added in
/// `parts` order within a slice, by the slice tree and then the group.
fn column_parallel_dx(
    dx: &mut [f32],
    leaves: &mut [Vec<f32>],
    parts: &[ColumnPart],
    (n, i): (usize, usize),
    tp: &TpRank,
) {
    let count = leaves.len() + 1;
    let leaf = |dst: &mut [f32], j: usize| {
        for (q, part) in parts.iter().enumerate() {
            assert!(part.w.len() == part.o * i);
            let per = part.o / count;
            let dyv = View::rows(part.dy, part.dy_cols, part.col0 + j * per);
            gemm_into(dst, 0, i, q > 0, dyv, View::rows(part.w, i, j * per * i), (n, i, per));
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

/// Row-parallel forward: out (N, C) = Σ over this rank's slices of
/// x[:, slice] · w[:, slice]ᵀ, x (N, K) and w (C, K) with K this rank's
/// share of the reduction, by the slice tree and then the group.
fn row_parallel(
    out: &mut [f32],
    leaves: &mut [Vec<f32>],
    x: &[f32],
    w: &[f32],
    (n, k, c): (usize, usize, usize),
    tp: &TpRank,
) {
    assert!(x.len() == n * k && w.len() == c * k);
    let ks = k / (leaves.len() + 1);
    let leaf = |dst: &mut [f32], j: usize| {
        let (xv, wv) = (View::rows(x, k, j * ks), View::rows_t(w, k, j * ks));
        gemm_into(dst, 0, c, false, xv, wv, (n, c, ks));
    };
    timed(Kernel::Matmul, || {
        leaf(out, 0);
        for (j, l) in leaves.iter_mut().enumerate() {
            leaf(l, j + 1);
        }
    });
    sum_slices(out, leaves, tp);
}

/// The input gradient of a row-parallel product, dx (N, K) = dy (N, C) · w,
/// w (C, K) this rank's columns; per slice.
fn row_parallel_dx(dx: &mut [f32], dy: &[f32], w: &[f32], (n, k, c): (usize, usize, usize), leaves: usize) {
    assert!(dy.len() == n * c && w.len() == c * k);
    let ks = k / leaves;
    for j in 0..leaves {
        let (dyv, wv) = (View::rows(dy, c, 0), View::rows(w, k, j * ks));
        gemm_into(dx, j * ks, k, false, dyv, wv, (n, ks, c));
    }
}

/// The weight gradient of a row-parallel product, dw (C, K) += dyᵀ · x; per slice.
fn row_weight_grad(dw: &mut [f32], dy: &[f32], x: &[f32], (n, k, c): (usize, usize, usize), leaves: usize) {
    assert!(dy.len() == n * c && x.len() == n * k && dw.len() == c * k);
    let ks = k / leaves;
    for j in 0..leaves {
        let (dyt, xv) = (View::rows_t(dy, c, 0), View::rows(x, k, j * ks));
        gemm_into(dw, j * ks, k, true, dyt, xv, (c, ks, n));
    }
}

/// out (N, C) = the block applied to x (N, C) on one rank, `s` the rank's
/// share; keeps what backward needs.
#[allow(clippy::too_many_arguments)]
pub fn llama_block_forward(
    p: &[Param],
    a: &mut LlamaActs,
    x: &[f32],
    out: &mut [f32],
    sc: &mut LlamaScratch,
    b: usize,
    s: &LlamaBlockShape,
    tp: &TpRank,
) {
    let t = sc.rope.t;
    let (n, c, f, heads, l) = (b * t, s.c, s.f, s.heads, tp.leaves());
    let (w, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
    timed(Kernel::RmsNorm, || {
        rmsnorm::rmsnorm_forward(&mut a.n1, &mut a.rstd1, x, &p[IN_NORM].data, n, c, s.eps)
    });
    timed(Kernel::Matmul, || {
        column_product(&mut a.qkv, w, 0, &a.n1, &p[Q].data, (n, c, q), l);
        column_product(&mut a.qkv, w, q, &a.n1, &p[K].data, (n, c, kv), l);
        column_product(&mut a.qkv, w, q + kv, &a.n1, &p[V].data, (n, c, kv), l);
    });
    // q's and k's heads are the first NH + NKV head-wide column blocks.
    timed(Kernel::Rope, || rope_forward(&mut a.qkv, &sc.rope, n, w, 0, heads.nh + heads.nkv));
    timed(Kernel::Attention, || gqa_forward(&mut a.atty, &mut a.lse, &mut sc.attn, &a.qkv, b, t, heads));
    row_parallel(&mut a.h, &mut sc.leaves, &a.atty, &p[O].data, (n, q, c), tp);
    timed(Kernel::Residual, || residual::accumulate(&mut a.h, x));
    timed(Kernel::RmsNorm, || {
        rmsnorm::rmsnorm_forward(&mut a.n2, &mut a.rstd2, &a.h, &p[POST_NORM].data, n, c, s.eps)
    });
    timed(Kernel::Matmul, || {
        column_product(&mut a.gate_up, 2 * f, 0, &a.n2, &p[GATE].data, (n, c, f), l);
        column_product(&mut a.gate_up, 2 * f, f, &a.n2, &p[UP].data, (n, c, f), l);
    });
    timed(Kernel::Swiglu, || swiglu::swiglu_forward(&mut a.act, &a.gate_up, n, f));
    row_parallel(out, &mut sc.leaves, &a.act, &p[DOWN].data, (n, f, c), tp);
    timed(Kernel::Residual, || residual::accumulate(out, &a.h));
}

/// The input half of [`llama_block_forward`]'s backward on one rank: `dres`
/// holds ∂L/∂out on entry and ∂L/∂x on return; `g` receives the intermediate
/// output gradients. With `full` (a B) every weight gradient accumulates as
/// soon as its output gradient exists, by the same kernel calls on the same
/// inputs as [`llama_block_backward_weight`] makes, so I then W gives B's bits.
#[allow(clippy::too_many_arguments)]
pub fn llama_block_backward_input(
    p: &mut [Param],
    a: &LlamaActs,
    x: &[f32],
    dres: &mut [f32],
    g: &mut LlamaGrads,
    sc: &mut LlamaScratch,
    b: usize,
    s: &LlamaBlockShape,
    tp: &TpRank,
    full: bool,
) {
    let t = sc.rope.t;
    let (n, c, f, heads, l) = (b * t, s.c, s.f, s.heads, tp.leaves());
    let (w, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
    // MLP: dres is ∂L/∂out, which is also the residual's share of ∂L/∂h.
    if full {
        down_grad(p, dres, a, (n, f, c), l);
    } else {
        g.dout.copy_from_slice(dres);
    }
    timed(Kernel::Matmul, || row_parallel_dx(&mut sc.dact, dres, &p[DOWN].data, (n, f, c), l));
    // swiglu_backward accumulates: its gradient starts from zero.
    g.dgu.fill(0.0);
    timed(Kernel::Swiglu, || swiglu::swiglu_backward(&mut g.dgu, &sc.dact, &a.gate_up, n, f));
    let parts = [
        ColumnPart { dy: &g.dgu, dy_cols: 2 * f, col0: 0, w: &p[GATE].data, o: f },
        ColumnPart { dy: &g.dgu, dy_cols: 2 * f, col0: f, w: &p[UP].data, o: f },
    ];
    column_parallel_dx(&mut g.dn2, &mut sc.leaves, &parts, (n, c), tp);
    if full {
        gate_up_grads(p, &g.dgu, a, (n, c, f), l);
    }
    let (w2, h, rstd2) = (&p[POST_NORM].data, &a.h, &a.rstd2);
    timed(Kernel::RmsNorm, || rmsnorm::rmsnorm_backward_input(dres, &g.dn2, h, w2, rstd2, n, c));
    if full {
        norm_grad(&mut p[POST_NORM].grad, &g.dn2, &a.h, &a.rstd2, n, c);
    }
    // Attention: dres is now ∂L/∂h, the residual's share of ∂L/∂x.
    if full {
        o_grad(p, dres, a, (n, q, c), l);
    } else {
        g.dh.copy_from_slice(dres);
    }
    timed(Kernel::Matmul, || row_parallel_dx(&mut sc.datty, dres, &p[O].data, (n, q, c), l));
    // dK and dV accumulate over query tiles, so this one starts from zero.
    g.dqkv.fill(0.0);
    timed(Kernel::Attention, || {
        gqa_backward(&mut g.dqkv, &mut sc.attn, &sc.datty, &a.qkv, &a.atty, &a.lse, b, t, heads)
    });
    timed(Kernel::Rope, || rope_backward(&mut g.dqkv, &sc.rope, n, w, 0, heads.nh + heads.nkv));
    let parts = [
        ColumnPart { dy: &g.dqkv, dy_cols: w, col0: 0, w: &p[Q].data, o: q },
        ColumnPart { dy: &g.dqkv, dy_cols: w, col0: q, w: &p[K].data, o: kv },
        ColumnPart { dy: &g.dqkv, dy_cols: w, col0: q + kv, w: &p[V].data, o: kv },
    ];
    column_parallel_dx(&mut g.dn1, &mut sc.leaves, &parts, (n, c), tp);
    if full {
        qkv_grads(p, &g.dqkv, a, (n, c, q, kv), l);
    }
    let (w1, rstd1) = (&p[IN_NORM].data, &a.rstd1);
    timed(Kernel::RmsNorm, || rmsnorm::rmsnorm_backward_input(dres, &g.dn1, x, w1, rstd1, n, c));
    if full {
        norm_grad(&mut p[IN_NORM].grad, &g.dn1, x, &a.rstd1, n, c);
    }
}

/// The weight half of the block's backward (a W) on one rank, over `n`
/// rows: accumulates every weight gradient from the activations and the
/// output gradients its I kept.
pub fn llama_block_backward_weight(
    p: &mut [Param],
    a: &LlamaActs,
    x: &[f32],
    g: &LlamaGrads,
    n: usize,
    s: &LlamaBlockShape,
    tp: &TpRank,
) {
    let (c, f, heads, l) = (s.c, s.f, s.heads, tp.leaves());
    let (q, kv) = (heads.out_width(), heads.nkv * heads.hs);
    down_grad(p, &g.dout, a, (n, f, c), l);
    gate_up_grads(p, &g.dgu, a, (n, c, f), l);
    norm_grad(&mut p[POST_NORM].grad, &g.dn2, &a.h, &a.rstd2, n, c);
    o_grad(p, &g.dh, a, (n, q, c), l);
    qkv_grads(p, &g.dqkv, a, (n, c, q, kv), l);
    norm_grad(&mut p[IN_NORM].grad, &g.dn1, x, &a.rstd1, n, c);
}

/// down's weight gradient from its output gradient.
fn down_grad(p: &mut [Param], dout: &[f32], a: &LlamaActs, nfc: (usize, usize, usize), l: usize) {
    timed(Kernel::Matmul, || row_weight_grad(&mut p[DOWN].grad, dout, &a.act, nfc, l));
}

/// o's weight gradient from its output gradient (∂L/∂h).
fn o_grad(p: &mut [Param], dh: &[f32], a: &LlamaActs, nqc: (usize, usize, usize), l: usize) {
    timed(Kernel::Matmul, || row_weight_grad(&mut p[O].grad, dh, &a.atty, nqc, l));
}

/// gate's and up's weight gradients from theirs, `dgu` (N, 2F).
fn gate_up_grads(p: &mut [Param], dgu: &[f32], a: &LlamaActs, (n, c, f): (usize, usize, usize), l: usize) {
    timed(Kernel::Matmul, || {
        column_weight_grad(&mut p[GATE].grad, dgu, 2 * f, 0, &a.n2, (n, c, f), l);
        column_weight_grad(&mut p[UP].grad, dgu, 2 * f, f, &a.n2, (n, c, f), l);
    });
}

/// q's, k's and v's weight gradients from theirs, `dqkv` (N, Q + 2·KV).
fn qkv_grads(
    p: &mut [Param],
    dqkv: &[f32],
    a: &LlamaActs,
    (n, c, q, kv): (usize, usize, usize, usize),
    l: usize,
) {
    let w = q + 2 * kv;
    timed(Kernel::Matmul, || {
        column_weight_grad(&mut p[Q].grad, dqkv, w, 0, &a.n1, (n, c, q), l);
        column_weight_grad(&mut p[K].grad, dqkv, w, q, &a.n1, (n, c, kv), l);
        column_weight_grad(&mut p[V].grad, dqkv, w, q + kv, &a.n1, (n, c, kv), l);
    });
}

/// An RMSNorm's weight gradient from its output gradient.
fn norm_grad(dw: &mut [f32], dout: &[f32], inp: &[f32], rstd: &[f32], n: usize, c: usize) {
    timed(Kernel::RmsNorm, || rmsnorm::rmsnorm_backward_weight(dw, dout, inp, rstd, n, c));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::rope::inv_freq;
    use crate::kernels::cpu::testutil::*;
    use crate::model::block::{shard, unshard, TensorGroup, ThreadGroup};
    use crate::model::tp::TpShape;

    const SHAPE: LlamaBlockShape =
        LlamaBlockShape { c: 8, heads: Heads { nh: 4, nkv: 2, hs: 2 }, f: 12, eps: 1e-5 };
    const THETA: f32 = 10_000.0;

    fn params(s: &LlamaBlockShape, seed: u64) -> Vec<Param> {
        block_tensors(s, 0)
            .into_iter()
            .enumerate()
            .map(|(k, (name, shape))| {
                let numel: usize = shape.iter().product();
                // Norm weights near 1, as trained ones are; products small.
                let data: Vec<f32> = randn(numel, seed + k as u64)
                    .iter()
                    .map(|v| if shape.len() == 1 { 1.0 + 0.1 * v } else { 0.5 * v })
                    .collect();
                Param { name, shape, grad: vec![0.0; numel], data, canonical: k }
            })
            .collect()
    }

    fn rms(x: &[f64], w: &[f64], n: usize, c: usize, eps: f64) -> Vec<f64> {
        let mut out = vec![0.0; n * c];
        for r in 0..n {
            let row = &x[r * c..(r + 1) * c];
            let s = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
            for j in 0..c {
                out[r * c + j] = w[j] * row[j] * s;
            }
        }
        out
    }

    /// y (N, O) = x (N, I) · wᵀ, w (O, I).
    fn lin(x: &[f64], w: &[f64], n: usize, i: usize, o: usize) -> Vec<f64> {
        let mut y = vec![0.0; n * o];
        for r in 0..n {
            for k in 0..o {
                y[r * o + k] = (0..i).map(|j| x[r * i + j] * w[k * i + j]).sum();
            }
        }
        y
    }

    /// Hugging Face's rotate_half RoPE on one head vector at position p.
    fn rope64(v: &mut [f64], p: usize, theta: f64) {
        let (hs, half) = (v.len(), v.len() / 2);
        for j in 0..half {
            let a = p as f64 / theta.powf((2 * j) as f64 / hs as f64);
            let (x0, x1) = (v[j], v[j + half]);
            v[j] = x0 * a.cos() - x1 * a.sin();
            v[j + half] = x1 * a.cos() + x0 * a.sin();
        }
    }

    /// The block in f64, straight from the formulas (separate q, k, v; heads
    /// repeated over their group as `repeat_kv` does).
    fn reference(p: &[Vec<f64>], x: &[f64], b: usize, t: usize, s: &LlamaBlockShape) -> Vec<f64> {
        let (n, c, f) = (b * t, s.c, s.f);
        let Heads { nh, nkv, hs } = s.heads;
        let n1 = rms(x, &p[IN_NORM], n, c, s.eps as f64);
        let (mut q, mut k) = (lin(&n1, &p[Q], n, c, nh * hs), lin(&n1, &p[K], n, c, nkv * hs));
        let v = lin(&n1, &p[V], n, c, nkv * hs);
        for r in 0..n {
            for h in 0..nh {
                rope64(&mut q[(r * nh + h) * hs..][..hs], r % t, THETA as f64);
            }
            for g in 0..nkv {
                rope64(&mut k[(r * nkv + g) * hs..][..hs], r % t, THETA as f64);
            }
        }
        let mut atty = vec![0.0; n * nh * hs];
        for bi in 0..b {
            for h in 0..nh {
                let g = h / (nh / nkv);
                for i in 0..t {
                    let qi = &q[((bi * t + i) * nh + h) * hs..][..hs];
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| {
                            let kj = &k[((bi * t + j) * nkv + g) * hs..][..hs];
                            qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (hs as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                    for (j, sj) in sc.iter().enumerate() {
                        for d in 0..hs {
                            atty[((bi * t + i) * nh + h) * hs + d] +=
                                (sj - m).exp() / z * v[((bi * t + j) * nkv + g) * hs + d];
                        }
                    }
                }
            }
        }
        let o = lin(&atty, &p[O], n, nh * hs, c);
        let h: Vec<f64> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
        let n2 = rms(&h, &p[POST_NORM], n, c, s.eps as f64);
        let (gate, up) = (lin(&n2, &p[GATE], n, c, f), lin(&n2, &p[UP], n, c, f));
        let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        let down = lin(&act, &p[DOWN], n, f, c);
        h.iter().zip(&down).map(|(a, b)| a + b).collect()
    }

    /// A forward and a full backward of the whole block (one rank, one slice).
    fn run(p: &mut [Param], x: &[f32], dout: &[f32], b: usize, t: usize) -> (Vec<f32>, Vec<f32>) {
        let rope = RopeTable::new(t, &inv_freq(SHAPE.heads.hs, THETA));
        whole_block(p, x, dout, b, rope, &SHAPE)
    }

    fn whole_block(
        p: &mut [Param],
        x: &[f32],
        dout: &[f32],
        b: usize,
        rope: RopeTable,
        s: &LlamaBlockShape,
    ) -> (Vec<f32>, Vec<f32>) {
        let one = TpShape::WHOLE.single();
        let t = rope.t;
        let mut a = LlamaActs::with_shape(b, t, s);
        let mut g = LlamaGrads::with_shape(b * t, s);
        let mut sc = LlamaScratch::with_shape(b, rope, s, 1);
        let mut out = vec![0.0; x.len()];
        llama_block_forward(p, &mut a, x, &mut out, &mut sc, b, s, &one);
        let mut dres = dout.to_vec();
        llama_block_backward_input(p, &a, x, &mut dres, &mut g, &mut sc, b, s, &one, true);
        (out, dres)
    }

    #[test]
    fn forward_matches_the_f64_reference() {
        let (b, t) = (2, 7);
        let mut p = params(&SHAPE, 1);
        let x = randn(b * t * SHAPE.c, 50);
        let (out, _) = with_threads(2, || run(&mut p, &x, &vec![0.0; x.len()], b, t));
        let p64: Vec<Vec<f64>> = p.iter().map(|q| to64(&q.data)).collect();
        assert_close(&out, &reference(&p64, &to64(&x), b, t, &SHAPE), 1e-5);
    }

    #[test]
    fn backward_matches_finite_differences_for_the_input_and_every_weight() {
        let (b, t) = (2, 5);
        let mut p = params(&SHAPE, 3);
        let x = randn(b * t * SHAPE.c, 60);
        let g = randn(x.len(), 61);
        let (_, dx) = with_threads(2, || run(&mut p, &x, &g, b, t));
        let mut values: Vec<Vec<f32>> = vec![x.clone()];
        let mut grads = vec![dx];
        for q in &p {
            values.push(q.data.clone());
            grads.push(q.grad.clone());
        }
        let loss = |v: &[Vec<f64>]| {
            reference(&v[1..], &v[0], b, t, &SHAPE).iter().zip(&g).map(|(o, &g)| o * g as f64).sum::<f64>()
        };
        check_grads(&values, &grads, loss, 1e-3);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (b, t) = (2, 70);
        let s = LlamaBlockShape { c: 64, heads: Heads { nh: 8, nkv: 2, hs: 8 }, f: 96, eps: 1e-5 };
        let x = randn(b * t * s.c, 70);
        let g = randn(x.len(), 71);
        let once = |threads| {
            with_threads(threads, || {
                let mut p = params(&s, 5);
                let rope = RopeTable::new(t, &inv_freq(s.heads.hs, 500_000.0));
                let (out, dres) = whole_block(&mut p, &x, &g, b, rope, &s);
                let grads: Vec<Vec<u32>> = p.iter().map(|q| bits(&q.grad)).collect();
                (bits(&out), bits(&dres), grads)
            })
        };
        assert_eq!(once(1), once(2));
    }

    #[test]
    fn tensors_carry_hugging_face_names_and_linear_layouts() {
        let s = LlamaBlockShape { c: 4096, heads: Heads { nh: 32, nkv: 8, hs: 128 }, f: 14336, eps: 1e-5 };
        let ts = block_tensors(&s, 3);
        assert_eq!(ts[K], ("layers.3.self_attn.k_proj.weight".to_string(), vec![1024, 4096]));
        assert_eq!(ts[DOWN], ("layers.3.mlp.down_proj.weight".to_string(), vec![4096, 14336]));
        // Llama-3 8B's block: 218,112,000 parameters.
        let per_block: usize = ts.iter().map(|(_, sh)| sh.iter().product::<usize>()).sum();
        assert_eq!(per_block, 218_112_000);
    }

    // Tensor parallelism and the split backward, on a grouped-query shape
    // (NH 8, NKV 4, HS 4) whose heads, groups and MLP rows cut into 4 slices.
    const B: usize = 2;

    fn gqa_cfg() -> Arch {
        Arch::llama(1, 8, 4, 32, 48, 64, 6, THETA)
    }

    /// What one rank computes: the block's output, the input gradient and
    /// its shards' weight gradients.
    struct Ranked {
        out: Vec<f32>,
        dx: Vec<f32>,
        grads: Vec<Vec<f32>>,
    }

    /// How far one rank's backward goes.
    #[derive(Clone, Copy, PartialEq)]
    enum Backward {
        /// B: input and weight gradients together.
        Full,
        /// I, then W.
        Split,
        /// I alone.
        InputOnly,
    }

    fn run_rank(whole: &[Param], cfg: &Arch, tp: &TpRank, how: Backward) -> Ranked {
        let n = B * cfg.block_size;
        let c = cfg.n_embd;
        let mut p: Vec<Param> = whole
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let data = shard(cut_of(i), &q.data, *q.shape.last().unwrap(), tp.rank, tp.size);
                Param { grad: vec![0.0; data.len()], data, ..q.clone() }
            })
            .collect();
        let x = randn(n * c, 7);
        let mut a = LlamaActs::new(B, cfg, tp.size);
        let mut s = LlamaScratch::new(B, cfg, tp);
        let mut out = vec![0.0; n * c];
        forward(&p, &mut a, &x, &mut out, &mut s, B, cfg, tp);
        let mut dx = randn(n * c, 8);
        let mut g = LlamaGrads::new(n, cfg, tp.size);
        backward_input(&mut p, &a, &x, &mut dx, &mut g, &mut s, B, cfg, tp, how == Backward::Full);
        if how == Backward::Split {
            backward_weight(&mut p, &a, &x, &g, B, cfg, tp);
        }
        Ranked { out, dx, grads: p.into_iter().map(|q| q.grad).collect() }
    }

    /// Runs `size` ranks as threads joined by one group; the ranks' results.
    fn run_ranks(whole: &[Param], cfg: &Arch, size: usize, slices: usize, how: Backward) -> Vec<Ranked> {
        let group = ThreadGroup::new(size);
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..size)
                .map(|rank| {
                    let group: &dyn TensorGroup = &group;
                    let tp = TpShape { size, slices }.rank(rank, Some(group));
                    sc.spawn(move || run_rank(whole, cfg, &tp, how))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Panics naming the first element whose bits differ.
    fn same_bits(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!("{what}: element {i} is {} where {} was wanted", got[i], want[i]);
        }
    }

    fn same_results(got: &Ranked, want: &Ranked, what: &str) {
        same_bits(&got.out, &want.out, &format!("{what}: output"));
        same_bits(&got.dx, &want.dx, &format!("{what}: input gradient"));
        for (i, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
            same_bits(g, w, &format!("{what}: gradient of tensor {i}"));
        }
    }

    #[test]
    fn input_then_weight_gives_the_bits_of_the_full_backward() {
        let cfg = gqa_cfg();
        let whole = params(&LlamaBlockShape::of(&cfg), 11);
        for slices in [1, 2] {
            let b = run_ranks(&whole, &cfg, 1, slices, Backward::Full).pop().unwrap();
            let iw = run_ranks(&whole, &cfg, 1, slices, Backward::Split).pop().unwrap();
            same_results(&iw, &b, &format!("I then W at {slices} slices"));
            assert!(b.grads.iter().all(|g| g.iter().any(|&v| v != 0.0)), "every weight has a gradient");
            // The input half leaves every weight gradient to the weight half.
            let i = run_ranks(&whole, &cfg, 1, slices, Backward::InputOnly).pop().unwrap();
            same_bits(&i.dx, &b.dx, &format!("I alone at {slices} slices: input gradient"));
            assert!(i.grads.iter().all(|g| g.iter().all(|&v| v == 0.0)), "I alone wrote a weight gradient");
        }
    }

    #[test]
    fn every_rank_count_dividing_the_slices_gives_the_bits_of_one_rank() {
        let cfg = gqa_cfg();
        let whole = params(&LlamaBlockShape::of(&cfg), 12);
        for slices in [2, 4] {
            let one = run_ranks(&whole, &cfg, 1, slices, Backward::Full).pop().unwrap();
            for size in [1, 2, 4].into_iter().filter(|s| slices % s == 0) {
                for how in [Backward::Full, Backward::Split] {
                    let ranks = run_ranks(&whole, &cfg, size, slices, how);
                    let at = format!(
                        "{slices} slices, {size} ranks, {}",
                        if how == Backward::Full { "B" } else { "I+W" }
                    );
                    for (r, res) in ranks.iter().enumerate() {
                        same_bits(&res.out, &one.out, &format!("{at}: output of rank {r}"));
                        same_bits(&res.dx, &one.dx, &format!("{at}: input gradient of rank {r}"));
                    }
                    for (i, want) in one.grads.iter().enumerate() {
                        let pieces: Vec<&[f32]> = ranks.iter().map(|res| res.grads[i].as_slice()).collect();
                        let cols = *whole[i].shape.last().unwrap();
                        let name = &whole[i].name;
                        same_bits(&unshard(cut_of(i), &pieces, cols), want, &format!("{at}: {name}"));
                        if cut_of(i) == Cut::Whole {
                            for (r, piece) in pieces.iter().enumerate() {
                                same_bits(piece, want, &format!("{at}: {name} whole on rank {r}"));
                            }
                        }
                    }
                }
            }
        }
    }

    /// The block as it ran before the tensor split, one plain product per
    /// Linear layer (Hugging Face's (out, in) weights read transposed):
    /// the output and the input gradient, weight gradients into `p`.
    fn plain_block(p: &mut [Param], x: &[f32], dout: &[f32], cfg: &Arch) -> (Vec<f32>, Vec<f32>) {
        let s = LlamaBlockShape::of(cfg);
        let (t, heads) = (cfg.block_size, s.heads);
        let (n, c, f) = (B * t, s.c, s.f);
        let (w, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
        let rope = RopeTable::new(t, &inv_freq(heads.hs, cfg.rope_theta));
        let mut a = LlamaActs::with_shape(B, t, &s);
        let mut attn = vec![0.0; scratch_len(B, heads.nh, t)];
        // out[:, col0..col0 + o] (rows out_cols apart) = x (N, I) · w (O, I)ᵀ
        let linear = |out: &mut [f32],
                      out_cols: usize,
                      col0: usize,
                      x: &[f32],
                      w: &[f32],
                      i: usize,
                      o: usize| {
            assert!(
                x.len() == n * i && w.len() == o * i && out.len() == n * out_cols && col0 + o <= out_cols
            );
            // SAFETY: the views stay in x (N, I), w (O, I) and out's columns [col0, col0 + O) of N rows.
            unsafe {
                let (xv, wv) = (Mat::rows(x, i), Mat::rows_t(w, i));
                gemm_raw(n, o, i, out[col0..].as_mut_ptr(), out_cols as isize, false, xv, wv, 1.0, pool_par())
            }
        };
        // dx (N, I) [+]= dy[:, col0..col0 + O] · w; dw (O, I) += dyᵀ · x
        let linear_backward = |dx: &mut [f32],
                               acc: bool,
                               dw: &mut [f32],
                               dy: &[f32],
                               dy_cols: usize,
                               col0: usize,
                               x: &[f32],
                               w: &[f32],
                               i: usize,
                               o: usize| {
            assert!(dx.len() == n * i && x.len() == n * i && w.len() == o * i && dw.len() == o * i);
            assert!(dy.len() == n * dy_cols && col0 + o <= dy_cols);
            let dyv = Mat { ptr: dy[col0..].as_ptr(), rs: dy_cols as isize, cs: 1 };
            let dyt = Mat { ptr: dyv.ptr, rs: 1, cs: dy_cols as isize };
            // SAFETY: every view is bounds-checked above; dx and dw are distinct from the inputs.
            unsafe {
                gemm_raw(n, i, o, dx.as_mut_ptr(), i as isize, acc, dyv, Mat::rows(w, i), 1.0, pool_par());
                gemm_raw(o, i, n, dw.as_mut_ptr(), i as isize, true, dyt, Mat::rows(x, i), 1.0, pool_par());
            }
        };
        rmsnorm::rmsnorm_forward(&mut a.n1, &mut a.rstd1, x, &p[IN_NORM].data, n, c, s.eps);
        linear(&mut a.qkv, w, 0, &a.n1, &p[Q].data, c, q);
        linear(&mut a.qkv, w, q, &a.n1, &p[K].data, c, kv);
        linear(&mut a.qkv, w, q + kv, &a.n1, &p[V].data, c, kv);
        rope_forward(&mut a.qkv, &rope, n, w, 0, heads.nh + heads.nkv);
        gqa_forward(&mut a.atty, &mut a.lse, &mut attn, &a.qkv, B, t, heads);
        linear(&mut a.h, c, 0, &a.atty, &p[O].data, q, c);
        residual::accumulate(&mut a.h, x);
        rmsnorm::rmsnorm_forward(&mut a.n2, &mut a.rstd2, &a.h, &p[POST_NORM].data, n, c, s.eps);
        linear(&mut a.gate_up, 2 * f, 0, &a.n2, &p[GATE].data, c, f);
        linear(&mut a.gate_up, 2 * f, f, &a.n2, &p[UP].data, c, f);
        swiglu::swiglu_forward(&mut a.act, &a.gate_up, n, f);
        let mut out = vec![0.0; n * c];
        linear(&mut out, c, 0, &a.act, &p[DOWN].data, f, c);
        residual::accumulate(&mut out, &a.h);

        let mut dres = dout.to_vec();
        let (mut dact, mut dgu, mut dn) = (vec![0.0; n * f], vec![0.0; n * 2 * f], vec![0.0; n * c]);
        let (mut datty, mut dqkv) = (vec![0.0; n * q], vec![0.0; n * w]);
        let Param { data, grad, .. } = &mut p[DOWN];
        linear_backward(&mut dact, false, grad, &dres, c, 0, &a.act, data, f, c);
        swiglu::swiglu_backward(&mut dgu, &dact, &a.gate_up, n, f);
        let Param { data, grad, .. } = &mut p[GATE];
        linear_backward(&mut dn, false, grad, &dgu, 2 * f, 0, &a.n2, data, c, f);
        let Param { data, grad, .. } = &mut p[UP];
        linear_backward(&mut dn, true, grad, &dgu, 2 * f, f, &a.n2, data, c, f);
        let Param { data, grad, .. } = &mut p[POST_NORM];
        rmsnorm::rmsnorm_backward(&mut dres, grad, &dn, &a.h, data, &a.rstd2, n, c);
        let Param { data, grad, .. } = &mut p[O];
        linear_backward(&mut datty, false, grad, &dres, c, 0, &a.atty, data, q, c);
        gqa_backward(&mut dqkv, &mut attn, &datty, &a.qkv, &a.atty, &a.lse, B, t, heads);
        rope_backward(&mut dqkv, &rope, n, w, 0, heads.nh + heads.nkv);
        for (i, col0, o, acc) in [(Q, 0, q, false), (K, q, kv, true), (V, q + kv, kv, true)] {
            let Param { data, grad, .. } = &mut p[i];
            linear_backward(&mut dn, acc, grad, &dqkv, w, col0, &a.n1, data, c, o);
        }
        let Param { data, grad, .. } = &mut p[IN_NORM];
        rmsnorm::rmsnorm_backward(&mut dres, grad, &dn, x, data, &a.rstd1, n, c);
        (out, dres)
    }

    #[test]
    fn one_slice_is_the_plain_block_and_more_slices_change_only_the_rounding() {
        let cfg = gqa_cfg();
        let whole = params(&LlamaBlockShape::of(&cfg), 13);
        let n = B * cfg.block_size;
        let mut p = whole.clone();
        let (out, dx) = plain_block(&mut p, &randn(n * cfg.n_embd, 7), &randn(n * cfg.n_embd, 8), &cfg);
        let plain = Ranked { out, dx, grads: p.into_iter().map(|q| q.grad).collect() };
        let one = run_ranks(&whole, &cfg, 1, 1, Backward::Full).pop().unwrap();
        same_results(&one, &plain, "one slice against the plain block");
        // Relative to the tensor's scale: an element that cancels to near zero
        // carries the rounding of the large terms it summed.
        let close = |got: &[f32], want: &[f32], what: &str| {
            let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
            let worst = got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0, f32::max) / scale;
            assert!(
                worst < 1e-5,
                "{what}: sliced sums are the same sums, yet differ by {worst} of the largest"
            );
        };
        for slices in [2, 4] {
            let sliced = run_ranks(&whole, &cfg, 1, slices, Backward::Full).pop().unwrap();
            // Another order of the same sums: other bits, the same values to f32's rounding.
            assert_ne!((bits(&sliced.out), bits(&sliced.dx)), (bits(&one.out), bits(&one.dx)));
            close(&sliced.out, &one.out, &format!("output at {slices} slices"));
            close(&sliced.dx, &one.dx, &format!("input gradient at {slices} slices"));
            for (i, (g, w)) in sliced.grads.iter().zip(&one.grads).enumerate() {
                close(g, w, &format!("{} at {slices} slices", whole[i].name));
            }
        }
    }
}
