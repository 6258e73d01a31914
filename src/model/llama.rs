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
//! This is the family's block on one rank: the forward and the backward of
//! the layer, written out from `kernels::cpu` like GPT-2's block. Its tensor
//! split and its place in a pipeline part come with the family seam.

use super::block::{Cut, TpRank};
use super::params::{GptConfig, Param};
use crate::kernels::cpu::attention::{gqa_backward, gqa_forward, scratch_len, Heads};
use crate::kernels::cpu::matmul::{gemm_raw, pool_par, Mat};
use crate::kernels::cpu::rope::{inv_freq, rope_backward, rope_forward, RopeTable};
use crate::kernels::cpu::{residual, rmsnorm, swiglu};

/// The shape of one Llama block.
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
    pub fn of(cfg: &super::GptConfig) -> Self {
        LlamaBlockShape { c: cfg.n_embd, heads: cfg.heads(), f: cfg.ffn(), eps: cfg.norm_eps }
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

/// Intermediate values of one block for one microbatch.
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
    pub fn new(b: usize, cfg: &GptConfig, size: usize) -> Self {
        assert_eq!(size, 1, "a Llama block split over ranks (refused by the config)");
        LlamaActs::with_shape(b, cfg.block_size, &LlamaBlockShape::of(cfg))
    }

    pub fn bytes(&self) -> usize {
        let all = [&self.n1, &self.rstd1, &self.qkv, &self.atty, &self.lse, &self.h, &self.n2, &self.rstd2];
        4 * (all.iter().map(|v| v.len()).sum::<usize>() + self.gate_up.len() + self.act.len())
    }

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

/// What a block's I keeps for its W.
pub struct LlamaGrads;

impl LlamaGrads {
    pub fn new(_n: usize, _cfg: &GptConfig, _size: usize) -> Self {
        LlamaGrads
    }

    pub fn bytes(&self) -> usize {
        0
    }
}

/// One rank's workspace (one microbatch runs at a time): the rotary table
/// and backward's intermediate gradients, kept so a step allocates nothing.
pub struct LlamaScratch {
    rope: RopeTable,
    attn: Vec<f32>,
    dact: Vec<f32>,  // (N, F)
    dgu: Vec<f32>,   // (N, 2F)
    dn: Vec<f32>,    // (N, C): ∂L/∂n2, then ∂L/∂n1
    datty: Vec<f32>, // (N, NH·HS)
    dqkv: Vec<f32>,  // (N, W)
}

impl LlamaScratch {
    pub fn new(b: usize, cfg: &GptConfig, tp: &TpRank) -> Self {
        assert_eq!((tp.size, tp.slices), (1, 1), "a Llama block split over ranks (refused by the config)");
        let rope = RopeTable::new(cfg.block_size, &inv_freq(cfg.head_dim(), cfg.rope_theta));
        LlamaScratch::with_shape(b, rope, &LlamaBlockShape::of(cfg))
    }

    pub fn with_shape(b: usize, rope: RopeTable, s: &LlamaBlockShape) -> Self {
        let n = b * rope.t;
        let (c, f, heads) = (s.c, s.f, s.heads);
        LlamaScratch {
            attn: vec![0.0; scratch_len(b, heads.nh, rope.t)],
            rope,
            dact: vec![0.0; n * f],
            dgu: vec![0.0; n * 2 * f],
            dn: vec![0.0; n * c],
            datty: vec![0.0; n * heads.out_width()],
            dqkv: vec![0.0; n * heads.qkv_width()],
        }
    }
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
    cfg: &GptConfig,
    _tp: &TpRank,
) {
    llama_block_forward(p, a, x, out, s, b, &LlamaBlockShape::of(cfg));
}

/// The block's backward on one rank; only whole (B) for now.
#[allow(clippy::too_many_arguments)]
pub fn backward_input(
    p: &mut [Param],
    a: &LlamaActs,
    x: &[f32],
    dres: &mut [f32],
    _g: &mut LlamaGrads,
    s: &mut LlamaScratch,
    b: usize,
    cfg: &GptConfig,
    _tp: &TpRank,
    full: bool,
) {
    assert!(full, "a split Llama backward (refused by the config)");
    llama_block_backward(p, a, x, dres, s, b, &LlamaBlockShape::of(cfg));
}

/// The weight half of the block's backward.
pub fn backward_weight(
    _p: &mut [Param],
    _a: &LlamaActs,
    _x: &[f32],
    _g: &LlamaGrads,
    _b: usize,
    _cfg: &GptConfig,
    _tp: &TpRank,
) {
    unreachable!("a split Llama backward (refused by the config)")
}

/// A row-major (rows, cols) buffer's column block [col0, col0 + width) as a view.
fn cols(buf: &[f32], rows: usize, cols_: usize, col0: usize, width: usize) -> Mat {
    assert!(col0 + width <= cols_ && buf.len() >= rows * cols_);
    Mat { ptr: buf[col0..].as_ptr(), rs: cols_ as isize, cs: 1 }
}

/// out[:, col0..col0+o] (row stride `out_cols`) = x (N, I) · wᵀ, w (O, I): a
/// Linear layer without bias, writing its columns of a wider buffer.
#[allow(clippy::too_many_arguments)]
fn linear(out: &mut [f32], out_cols: usize, col0: usize, x: &[f32], w: &[f32], n: usize, i: usize, o: usize) {
    assert!(x.len() == n * i && w.len() == o * i && col0 + o <= out_cols && out.len() == n * out_cols);
    // SAFETY: the views stay in x (N, I), w (O, I) and out's columns [col0, col0 + O) of N rows.
    unsafe {
        gemm_raw(
            n,
            o,
            i,
            out[col0..].as_mut_ptr(),
            out_cols as isize,
            false,
            Mat::rows(x, i),
            Mat::rows_t(w, i),
            1.0,
            pool_par(),
        )
    }
}

/// dx (N, I) [+]= dy (N, O) · w, with dy the columns [col0, col0 + O) of a
/// (N, dy_cols) buffer; and dw (O, I) += dyᵀ · x.
#[allow(clippy::too_many_arguments)]
fn linear_backward(
    dx: &mut [f32],
    accumulate: bool,
    dw: &mut [f32],
    dy: &[f32],
    dy_cols: usize,
    col0: usize,
    x: &[f32],
    w: &[f32],
    n: usize,
    i: usize,
    o: usize,
) {
    assert!(dx.len() == n * i && x.len() == n * i && w.len() == o * i && dw.len() == o * i);
    let dyv = cols(dy, n, dy_cols, col0, o);
    // SAFETY: every view is bounds-checked above (dy's by `cols`); dx and dw
    // are distinct from the inputs.
    unsafe {
        gemm_raw(n, i, o, dx.as_mut_ptr(), i as isize, accumulate, dyv, Mat::rows(w, i), 1.0, pool_par());
        let dyt = Mat { ptr: dyv.ptr, rs: 1, cs: dy_cols as isize };
        gemm_raw(o, i, n, dw.as_mut_ptr(), i as isize, true, dyt, Mat::rows(x, i), 1.0, pool_par());
    }
}

/// out (N, C) = the block applied to x (N, C), keeping what backward needs.
pub fn llama_block_forward(
    p: &[Param],
    a: &mut LlamaActs,
    x: &[f32],
    out: &mut [f32],
    sc: &mut LlamaScratch,
    b: usize,
    s: &LlamaBlockShape,
) {
    let t = sc.rope.t;
    let (n, c, f, heads) = (b * t, s.c, s.f, s.heads);
    let (w, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
    rmsnorm::rmsnorm_forward(&mut a.n1, &mut a.rstd1, x, &p[IN_NORM].data, n, c, s.eps);
    linear(&mut a.qkv, w, 0, &a.n1, &p[Q].data, n, c, q);
    linear(&mut a.qkv, w, q, &a.n1, &p[K].data, n, c, kv);
    linear(&mut a.qkv, w, q + kv, &a.n1, &p[V].data, n, c, kv);
    // q's and k's heads are the first NH + NKV head-wide column blocks.
    rope_forward(&mut a.qkv, &sc.rope, n, w, 0, heads.nh + heads.nkv);
    gqa_forward(&mut a.atty, &mut a.lse, &mut sc.attn, &a.qkv, b, t, heads);
    linear(&mut a.h, c, 0, &a.atty, &p[O].data, n, q, c);
    residual::accumulate(&mut a.h, x);
    rmsnorm::rmsnorm_forward(&mut a.n2, &mut a.rstd2, &a.h, &p[POST_NORM].data, n, c, s.eps);
    linear(&mut a.gate_up, 2 * f, 0, &a.n2, &p[GATE].data, n, c, f);
    linear(&mut a.gate_up, 2 * f, f, &a.n2, &p[UP].data, n, c, f);
    swiglu::swiglu_forward(&mut a.act, &a.gate_up, n, f);
    linear(out, c, 0, &a.act, &p[DOWN].data, n, f, c);
    residual::accumulate(out, &a.h);
}

/// Backward of [`llama_block_forward`]: `dres` holds ∂L/∂out on entry and
/// ∂L/∂x on return; every weight's gradient accumulates into its `grad`.
pub fn llama_block_backward(
    p: &mut [Param],
    a: &LlamaActs,
    x: &[f32],
    dres: &mut [f32],
    sc: &mut LlamaScratch,
    b: usize,
    s: &LlamaBlockShape,
) {
    let t = sc.rope.t;
    let (n, c, f, heads) = (b * t, s.c, s.f, s.heads);
    let (w, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
    // MLP: dres is ∂L/∂out, which is also the residual's share of ∂L/∂h.
    let (wd, dwd) = split(p, DOWN);
    linear_backward(&mut sc.dact, false, dwd, dres, c, 0, &a.act, wd, n, f, c);
    // The two kernels below accumulate: their gradients start from zero.
    sc.dgu.fill(0.0);
    swiglu::swiglu_backward(&mut sc.dgu, &sc.dact, &a.gate_up, n, f);
    let (wg, dwg) = split(p, GATE);
    linear_backward(&mut sc.dn, false, dwg, &sc.dgu, 2 * f, 0, &a.n2, wg, n, c, f);
    let (wu, dwu) = split(p, UP);
    linear_backward(&mut sc.dn, true, dwu, &sc.dgu, 2 * f, f, &a.n2, wu, n, c, f);
    let (w2, dw2) = split(p, POST_NORM);
    rmsnorm::rmsnorm_backward(dres, dw2, &sc.dn, &a.h, w2, &a.rstd2, n, c);
    // Attention: dres is now ∂L/∂h, the residual's share of ∂L/∂x.
    let (wo, dwo) = split(p, O);
    linear_backward(&mut sc.datty, false, dwo, dres, c, 0, &a.atty, wo, n, q, c);
    sc.dqkv.fill(0.0);
    gqa_backward(&mut sc.dqkv, &mut sc.attn, &sc.datty, &a.qkv, &a.atty, &a.lse, b, t, heads);
    rope_backward(&mut sc.dqkv, &sc.rope, n, w, 0, heads.nh + heads.nkv);
    let (wq, dwq) = split(p, Q);
    linear_backward(&mut sc.dn, false, dwq, &sc.dqkv, w, 0, &a.n1, wq, n, c, q);
    let (wk, dwk) = split(p, K);
    linear_backward(&mut sc.dn, true, dwk, &sc.dqkv, w, q, &a.n1, wk, n, c, kv);
    let (wv, dwv) = split(p, V);
    linear_backward(&mut sc.dn, true, dwv, &sc.dqkv, w, q + kv, &a.n1, wv, n, c, kv);
    let (w1, dw1) = split(p, IN_NORM);
    rmsnorm::rmsnorm_backward(dres, dw1, &sc.dn, x, w1, &a.rstd1, n, c);
}

/// A parameter's values and its gradient, borrowed apart.
fn split(p: &mut [Param], i: usize) -> (&[f32], &mut [f32]) {
    let Param { data, grad, .. } = &mut p[i];
    (data, grad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::rope::inv_freq;
    use crate::kernels::cpu::testutil::*;

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

    fn run(p: &mut [Param], x: &[f32], dout: &[f32], b: usize, t: usize) -> (Vec<f32>, Vec<f32>) {
        let rope = RopeTable::new(t, &inv_freq(SHAPE.heads.hs, THETA));
        let mut a = LlamaActs::with_shape(b, t, &SHAPE);
        let mut sc = LlamaScratch::with_shape(b, rope, &SHAPE);
        let mut out = vec![0.0; x.len()];
        llama_block_forward(p, &mut a, x, &mut out, &mut sc, b, &SHAPE);
        let mut dres = dout.to_vec();
        llama_block_backward(p, &a, x, &mut dres, &mut sc, b, &SHAPE);
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
                let mut a = LlamaActs::with_shape(b, t, &s);
                let mut sc = LlamaScratch::with_shape(b, rope, &s);
                let mut out = vec![0.0; x.len()];
                llama_block_forward(&p, &mut a, &x, &mut out, &mut sc, b, &s);
                let mut dres = g.clone();
                llama_block_backward(&mut p, &a, &x, &mut dres, &mut sc, b, &s);
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
}
