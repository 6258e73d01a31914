//! Causal self-attention, tiled over queries, with grouped-query attention:
//! NKV key/value heads, each shared by a group of NH / NKV query heads
//! (NKV = NH is multi-head attention, GPT-2's case).
//!
//! qkv is (B, T, W) with W = (NH + 2·NKV)·HS: query head h is columns
//! [h·HS, (h+1)·HS), key head g starts at NH·HS + g·HS and value head g at
//! (NH + NKV)·HS + g·HS. Query head h reads key/value head h / (NH / NKV), as
//! Hugging Face's `repeat_kv` does. out is (B, T, NH·HS); lse is (B, NH, T),
//! the log-sum-exp of each query's scores, saved so backward can recompute
//! probabilities without storing them. scratch is `scratch_len(B, NH, T)`
//! floats of workspace.
//!
//! Forward: each (b, h) is one task. A task walks query tiles of `TQ` rows; for a tile it
//! holds only its (TQ × keys-so-far) score block, so the (B, NH, T, T) matrix is
//! never formed. Every product is a `gemm` call on strided views of qkv (no
//! transposes or copies). Each head's gradients are written by its own task
//! and summed over tiles in tile order, so results do not depend on threads.
//! Backward: each (b, key/value head) is one task, walking its group's query
//! heads in order, so the group's key and value gradients are summed in one
//! fixed order by one task.
//!
//! Sliding-window attention (Mistral): with `Window::Sliding(W)` query i sees
//! key j if and only if i − W < j ≤ i, the last W positions counting itself.
//! That is Hugging Face's rule: transformers' `masking_utils.py` builds the
//! mask as `and_masks(sliding_window_overlay(W), causal_mask_function)`, with
//! the overlay `kv_idx > q_idx - sliding_window` and the causal part
//! `kv_idx <= q_idx` (huggingface/transformers@00c4411c; its flash-attention
//! path passes `window_size = (W - 1, W - 1)` with `causal=True`: the same keys).
//! A query tile then reads only keys from its first query's window on, so
//! keys that no query of the tile sees cost nothing. `Window::Causal` (and any
//! W ≥ T) is plain causal attention, computed by the very same operations as
//! before windows existed: its bits do not change.

use super::math::{exp, simd_fn};
use super::matmul::{gemm_raw, Mat};
use super::SendPtr;
use gemm::Parallelism;
use rayon::prelude::*;

/// Query rows per tile.
pub const TQ: usize = 64;

/// The head layout of one attention: query heads, key/value heads, head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub nh: usize,
    pub nkv: usize,
    pub hs: usize,
}

impl Heads {
    /// Multi-head attention over C channels (qkv is (B, T, 3C)).
    pub fn mha(c: usize, nh: usize) -> Heads {
        assert!(nh > 0 && c.is_multiple_of(nh), "{c} channels do not split over {nh} heads");
        Heads { nh, nkv: nh, hs: c / nh }
    }

    /// Columns of a qkv row: (NH + 2·NKV)·HS.
    pub fn qkv_width(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hs
    }

    /// Columns of an out row: NH·HS.
    pub fn out_width(&self) -> usize {
        self.nh * self.hs
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.nh / self.nkv
    }

    fn check(&self) {
        assert!(
            self.nh > 0 && self.nkv > 0 && self.hs > 0 && self.nh.is_multiple_of(self.nkv),
            "{self:?}: key/value heads must divide query heads"
        );
    }

    /// Column offsets of query head h, and of its key and value heads.
    fn columns(&self, h: usize) -> (usize, usize, usize) {
        let g = h / self.group();
        (h * self.hs, (self.nh + g) * self.hs, (self.nh + self.nkv + g) * self.hs)
    }
}

/// Which earlier keys a query attends to (see the module's header for the rule).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Window {
    /// Every key up to and including the query's own position.
    #[default]
    Causal,
    /// Only the last W positions: key j for query i when i − W < j ≤ i (W ≥ 1).
    Sliding(usize),
}

impl Window {
    /// A model's setting (`sliding_window` in a Hugging Face config; None: plain causal).
    pub fn new(sliding_window: Option<usize>) -> Window {
        sliding_window.map_or(Window::Causal, Window::Sliding)
    }

    /// The window over a sequence of `t` positions: a sliding window of at
    /// least T is plain causal attention, and is computed as such.
    pub fn over(self, t: usize) -> Window {
        self.check();
        match self {
            Window::Sliding(w) if w < t => self,
            _ => Window::Causal,
        }
    }

    /// The first key query i sees.
    pub fn first_key(self, i: usize) -> usize {
        match self {
            Window::Causal => 0,
            Window::Sliding(w) => (i + 1).saturating_sub(w),
        }
    }

    /// One past the last of `t` queries that see key j.
    pub fn query_end(self, j: usize, t: usize) -> usize {
        match self {
            Window::Causal => t,
            Window::Sliding(w) => (j + w).min(t),
        }
    }

    /// Whether query i sees key j.
    pub fn sees(self, i: usize, j: usize) -> bool {
        j <= i && j >= self.first_key(i)
    }

    fn check(self) {
        assert!(self != Window::Sliding(0), "a sliding window must hold at least one key (the query's own)");
    }
}

/// Workspace floats that forward and backward need.
pub fn scratch_len(b: usize, nh: usize, t: usize) -> usize {
    b * nh * (2 * TQ * t + t)
}

/// Softmax over row[lo..hi] in place (scores already scaled), zeroing the
/// rest of the row; returns the row's log-sum-exp.
#[inline]
fn window_softmax_row(row: &mut [f32], lo: usize, hi: usize) -> f32 {
    let seen = &mut row[lo..hi];
    let max = seen.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    exp_shifted(seen, max);
    let sum: f32 = seen.iter().sum();
    scale(seen, 1.0 / sum);
    row[..lo].fill(0.0);
    row[hi..].fill(0.0);
    max + sum.ln()
}

simd_fn! {
    /// x ← e^(x − shift), elementwise.
    fn exp_shifted(x: &mut [f32], shift: f32) {
        for v in x.iter_mut() {
            *v = exp(*v - shift);
        }
    }
}

simd_fn! {
    fn scale(x: &mut [f32], s: f32) {
        for v in x.iter_mut() {
            *v *= s;
        }
    }
}

simd_fn! {
    /// p ← e^(p − lse); dp ← p·(dp − d): the softmax backward of one row.
    fn softmax_row_backward(p: &mut [f32], dp: &mut [f32], lse: f32, d: f32) {
        for (p, dp) in p.iter_mut().zip(dp.iter_mut()) {
            *p = exp(*p - lse);
            *dp = *p * (*dp - d);
        }
    }
}

/// Multi-head attention: qkv (B, T, 3C), out (B, T, C).
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    gqa_forward(out, lse, scratch, qkv, b, t, Heads::mha(c, nh));
}

/// Grouped-query attention forward (see the module's layout), plain causal.
pub fn gqa_forward(
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    heads: Heads,
) {
    gqa_window_forward(out, lse, scratch, qkv, b, t, heads, Window::Causal);
}

/// Grouped-query attention forward over `window` (see the module's header):
/// out (B, T, NH·HS) and lse (B, NH, T) from qkv (B, T, (NH + 2·NKV)·HS).
#[allow(clippy::too_many_arguments)]
pub fn gqa_window_forward(
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    heads: Heads,
    window: Window,
) {
    heads.check();
    let window = window.over(t);
    let Heads { nh, hs, .. } = heads;
    let (w, c) = (heads.qkv_width(), heads.out_width());
    assert!(out.len() == b * t * c && qkv.len() == b * t * w && lse.len() == b * nh * t);
    assert!(scratch.len() >= scratch_len(b, nh, t));
    let scale = 1.0 / (hs as f32).sqrt();
    let per_task = 2 * TQ * t + t;
    let out_ptr = SendPtr(out.as_mut_ptr());
    scratch[..b * nh * per_task].par_chunks_mut(per_task).zip(lse.par_chunks_mut(t)).enumerate().for_each(
        |(task, (scratch, lse))| {
            let (bi, h) = (task / nh, task % nh);
            let (qc, kc, vc) = heads.columns(h);
            let row = bi * t * w;
            let q = qkv[row + qc..].as_ptr();
            let k = qkv[row + kc..].as_ptr();
            let v = qkv[row + vc..].as_ptr();
            let row3 = w as isize;
            for q0 in (0..t).step_by(TQ) {
                let tq = TQ.min(t - q0);
                // The tile's keys: from its first query's first key (0 when
                // causal) to its last query; nk of them.
                let (k0, kend) = (window.first_key(q0), q0 + tq);
                let nk = kend - k0;
                let s = &mut scratch[..tq * nk];
                // SAFETY: views stay inside qkv (rows < T of batch bi, columns < W),
                // and inside this task's scratch and head columns of out.
                unsafe {
                    gemm_raw(
                        tq,
                        nk,
                        hs,
                        s.as_mut_ptr(),
                        nk as isize,
                        false,
                        Mat { ptr: q.offset(q0 as isize * row3), rs: row3, cs: 1 },
                        Mat { ptr: k.offset(k0 as isize * row3), rs: 1, cs: row3 },
                        scale,
                        Parallelism::None,
                    );
                }
                for i in 0..tq {
                    let qi = q0 + i;
                    let row = &mut s[i * nk..(i + 1) * nk];
                    lse[qi] = window_softmax_row(row, window.first_key(qi) - k0, qi + 1 - k0);
                }
                unsafe {
                    gemm_raw(
                        tq,
                        hs,
                        nk,
                        out_ptr.get().add((bi * t + q0) * c + h * hs),
                        c as isize,
                        false,
                        Mat { ptr: s.as_ptr(), rs: nk as isize, cs: 1 },
                        Mat { ptr: v.offset(k0 as isize * row3), rs: row3, cs: 1 },
                        1.0,
                        Parallelism::None,
                    );
                }
            }
        },
    );
}

/// dqkv (B, T, 3C) += ∂L/∂qkv given dout (B, T, C), and forward's out and lse.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dqkv: &mut [f32],
    scratch: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    gqa_backward(dqkv, scratch, dout, qkv, out, lse, b, t, Heads::mha(c, nh));
}

/// dqkv (B, T, W) += ∂L/∂qkv given dout (B, T, NH·HS), and forward's out and
/// lse; plain causal.
#[allow(clippy::too_many_arguments)]
pub fn gqa_backward(
    dqkv: &mut [f32],
    scratch: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    b: usize,
    t: usize,
    heads: Heads,
) {
    gqa_window_backward(dqkv, scratch, dout, qkv, out, lse, b, t, heads, Window::Causal);
}

/// dqkv (B, T, W) += ∂L/∂qkv over `window`, given dout (B, T, NH·HS) and the
/// forward's out and lse (computed over the same window).
#[allow(clippy::too_many_arguments)]
pub fn gqa_window_backward(
    dqkv: &mut [f32],
    scratch: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    b: usize,
    t: usize,
    heads: Heads,
    window: Window,
) {
    heads.check();
    let window = window.over(t);
    let Heads { nh, nkv, hs } = heads;
    let (w, c) = (heads.qkv_width(), heads.out_width());
    assert!(dqkv.len() == b * t * w && qkv.len() == b * t * w);
    assert!(dout.len() == b * t * c && out.len() == b * t * c && lse.len() == b * nh * t);
    assert!(scratch.len() >= scratch_len(b, nh, t));
    let scale = 1.0 / (hs as f32).sqrt();
    let per_task = 2 * TQ * t + t;
    let dqkv_ptr = SendPtr(dqkv.as_mut_ptr());
    scratch[..b * nkv * per_task].par_chunks_mut(per_task).enumerate().for_each(|(task, scratch)| {
        let (bi, g) = (task / nkv, task % nkv);
        for h in g * heads.group()..(g + 1) * heads.group() {
            let lse = &lse[(bi * nh + h) * t..][..t];
            let (qc, kc, vc) = heads.columns(h);
            let row = bi * t * w;
            let q = qkv[row + qc..].as_ptr();
            let k = qkv[row + kc..].as_ptr();
            let v = qkv[row + vc..].as_ptr();
            let row3 = w as isize;
            let (p_buf, rest) = scratch.split_at_mut(TQ * t);
            let (dp_buf, d) = rest.split_at_mut(TQ * t);
            // D_t = Σ_d dout·out: the softmax backward's per-row correction.
            for ti in 0..t {
                let o = &out[(bi * t + ti) * c + h * hs..][..hs];
                let go = &dout[(bi * t + ti) * c + h * hs..][..hs];
                d[ti] = o.iter().zip(go).map(|(a, b)| a * b).sum();
            }
            let dq = unsafe { dqkv_ptr.get().add(row + qc) };
            let dk = unsafe { dqkv_ptr.get().add(row + kc) };
            let dv = unsafe { dqkv_ptr.get().add(row + vc) };
            for q0 in (0..t).step_by(TQ) {
                let tq = TQ.min(t - q0);
                // The tile's keys, as in forward: [k0, kend), nk of them.
                let (k0, kend) = (window.first_key(q0), q0 + tq);
                let nk = kend - k0;
                let p = &mut p_buf[..tq * nk];
                let dp = &mut dp_buf[..tq * nk];
                let dout_tile =
                    Mat { ptr: dout[(bi * t + q0) * c + h * hs..].as_ptr(), rs: c as isize, cs: 1 };
                let q_tile = Mat { ptr: unsafe { q.offset(q0 as isize * row3) }, rs: row3, cs: 1 };
                let (k, v) = unsafe { (k.offset(k0 as isize * row3), v.offset(k0 as isize * row3)) };
                let (dk, dv) = unsafe { (dk.offset(k0 as isize * row3), dv.offset(k0 as isize * row3)) };
                // SAFETY (all products below): views stay inside qkv, dout, this task's
                // scratch, and this key/value group's columns of dqkv for batch bi.
                unsafe {
                    gemm_raw(
                        tq,
                        nk,
                        hs,
                        p.as_mut_ptr(),
                        nk as isize,
                        false,
                        q_tile,
                        Mat { ptr: k, rs: 1, cs: row3 },
                        scale,
                        Parallelism::None,
                    );
                    gemm_raw(
                        tq,
                        nk,
                        hs,
                        dp.as_mut_ptr(),
                        nk as isize,
                        false,
                        dout_tile,
                        Mat { ptr: v, rs: 1, cs: row3 },
                        1.0,
                        Parallelism::None,
                    );
                }
                for i in 0..tq {
                    let qi = q0 + i;
                    let (lo, hi) = (window.first_key(qi) - k0, qi + 1 - k0);
                    let (l, di) = (lse[qi], d[qi]);
                    let pr = &mut p[i * nk..(i + 1) * nk];
                    let dpr = &mut dp[i * nk..(i + 1) * nk];
                    softmax_row_backward(&mut pr[lo..hi], &mut dpr[lo..hi], l, di);
                    for row in [pr, dpr] {
                        row[..lo].fill(0.0);
                        row[hi..].fill(0.0);
                    }
                }
                unsafe {
                    // dQ_tile += scale · dS · K[k0..kend]
                    gemm_raw(
                        tq,
                        hs,
                        nk,
                        dq.offset(q0 as isize * row3),
                        row3,
                        true,
                        Mat { ptr: dp.as_ptr(), rs: nk as isize, cs: 1 },
                        Mat { ptr: k, rs: row3, cs: 1 },
                        scale,
                        Parallelism::None,
                    );
                    // dK[k0..kend] += scale · dSᵀ · Q_tile
                    gemm_raw(
                        nk,
                        hs,
                        tq,
                        dk,
                        row3,
                        true,
                        Mat { ptr: dp.as_ptr(), rs: 1, cs: nk as isize },
                        q_tile,
                        scale,
                        Parallelism::None,
                    );
                    // dV[k0..kend] += Pᵀ · dO_tile
                    gemm_raw(
                        nk,
                        hs,
                        tq,
                        dv,
                        row3,
                        true,
                        Mat { ptr: p.as_ptr(), rs: 1, cs: nk as isize },
                        dout_tile,
                        1.0,
                        Parallelism::None,
                    );
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    /// Plain causal attention in f64, holding the whole score matrix.
    fn reference(qkv: &[f64], b: usize, t: usize, c: usize, nh: usize) -> Vec<f64> {
        let hs = c / nh;
        let scale = 1.0 / (hs as f64).sqrt();
        let mut out = vec![0.0; b * t * c];
        for bi in 0..b {
            for h in 0..nh {
                for i in 0..t {
                    let q = &qkv[(bi * t + i) * 3 * c + h * hs..][..hs];
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let k = &qkv[(bi * t + j) * 3 * c + c + h * hs..][..hs];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for (j, s) in scores.iter().enumerate() {
                        let p = (s - m).exp() / z;
                        let v = &qkv[(bi * t + j) * 3 * c + 2 * c + h * hs..][..hs];
                        for d in 0..hs {
                            out[(bi * t + i) * c + h * hs + d] += p * v[d];
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn forward_matches_reference_across_tiles() {
        // T spans three query tiles, the last one partial.
        let (b, t, c, nh) = (2, 2 * TQ + 13, 24, 3);
        let qkv = randn(b * t * 3 * c, 1);
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        let mut scratch = vec![0.0; scratch_len(b, nh, t)];
        with_threads(2, || attention_forward(&mut out, &mut lse, &mut scratch, &qkv, b, t, c, nh));
        assert_close(&out, &reference(&to64(&qkv), b, t, c, nh), 1e-5);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (b, t, c, nh) = (2, TQ + 5, 8, 2);
        let g = randn(b * t * c, 5);
        let qkv = randn(b * t * 3 * c, 1);
        let loss =
            |p: &[Vec<f64>]| reference(&p[0], b, t, c, nh).iter().zip(&g).map(|(o, &g)| o * g as f64).sum();
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        let mut scratch = vec![0.0; scratch_len(b, nh, t)];
        let mut dqkv = vec![0.0; qkv.len()];
        with_threads(2, || {
            attention_forward(&mut out, &mut lse, &mut scratch, &qkv, b, t, c, nh);
            attention_backward(&mut dqkv, &mut scratch, &g, &qkv, &out, &lse, b, t, c, nh);
        });
        check_grads(&[qkv], &[dqkv], loss, 1e-4);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (b, t, c, nh) = (3, 150, 64, 4);
        let qkv = randn(b * t * 3 * c, 1);
        let g = randn(b * t * c, 2);
        let run = |threads| {
            with_threads(threads, || {
                let mut out = vec![0.0; b * t * c];
                let mut lse = vec![0.0; b * nh * t];
                let mut scratch = vec![0.0; scratch_len(b, nh, t)];
                let mut dqkv = vec![0.0; qkv.len()];
                attention_forward(&mut out, &mut lse, &mut scratch, &qkv, b, t, c, nh);
                attention_backward(&mut dqkv, &mut scratch, &g, &qkv, &out, &lse, b, t, c, nh);
                (out, lse, dqkv)
            })
        };
        assert_eq!(run(1), run(2));
    }

    /// Plain causal grouped-query attention in f64: query head h attends with
    /// key/value head h / (NH / NKV), the whole score matrix held.
    fn gqa_reference(qkv: &[f64], b: usize, t: usize, heads: Heads) -> Vec<f64> {
        sliding_reference(qkv, b, t, heads, None)
    }

    /// Hugging Face's mask, written as transformers writes it: the causal
    /// `kv_idx <= q_idx` and, with a sliding window, `kv_idx > q_idx - W`.
    fn hf_keeps(q_idx: usize, kv_idx: usize, sliding_window: Option<usize>) -> bool {
        let (q, kv) = (q_idx as i64, kv_idx as i64);
        kv <= q && sliding_window.is_none_or(|w| kv > q - w as i64)
    }

    /// Grouped-query attention in f64 under Hugging Face's mask, the whole
    /// score matrix held.
    fn sliding_reference(qkv: &[f64], b: usize, t: usize, heads: Heads, window: Option<usize>) -> Vec<f64> {
        let Heads { nh, nkv, hs } = heads;
        let (w, c) = ((nh + 2 * nkv) * hs, nh * hs);
        let scale = 1.0 / (hs as f64).sqrt();
        let mut out = vec![0.0; b * t * c];
        for bi in 0..b {
            for h in 0..nh {
                let g = h / (nh / nkv);
                let (kc, vc) = ((nh + g) * hs, (nh + nkv + g) * hs);
                for i in 0..t {
                    let q = &qkv[(bi * t + i) * w + h * hs..][..hs];
                    let keys: Vec<usize> = (0..t).filter(|&j| hf_keeps(i, j, window)).collect();
                    let scores: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            let k = &qkv[(bi * t + j) * w + kc..][..hs];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for (&j, s) in keys.iter().zip(&scores) {
                        let p = (s - m).exp() / z;
                        let v = &qkv[(bi * t + j) * w + vc..][..hs];
                        for d in 0..hs {
                            out[(bi * t + i) * c + h * hs + d] += p * v[d];
                        }
                    }
                }
            }
        }
        out
    }

    fn gqa_run(qkv: &[f32], g: &[f32], b: usize, t: usize, heads: Heads) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut out = vec![0.0; b * t * heads.out_width()];
        let mut lse = vec![0.0; b * heads.nh * t];
        let mut scratch = vec![0.0; scratch_len(b, heads.nh, t)];
        let mut dqkv = vec![0.0; qkv.len()];
        gqa_forward(&mut out, &mut lse, &mut scratch, qkv, b, t, heads);
        gqa_backward(&mut dqkv, &mut scratch, g, qkv, &out, &lse, b, t, heads);
        (out, lse, dqkv)
    }

    type Run = (Vec<f32>, Vec<f32>, Vec<f32>);

    fn window_run(qkv: &[f32], g: &[f32], b: usize, t: usize, heads: Heads, window: Window) -> Run {
        let mut out = vec![0.0; b * t * heads.out_width()];
        let mut lse = vec![0.0; b * heads.nh * t];
        let mut scratch = vec![0.0; scratch_len(b, heads.nh, t)];
        let mut dqkv = vec![0.0; qkv.len()];
        gqa_window_forward(&mut out, &mut lse, &mut scratch, qkv, b, t, heads, window);
        gqa_window_backward(&mut dqkv, &mut scratch, g, qkv, &out, &lse, b, t, heads, window);
        (out, lse, dqkv)
    }

    #[test]
    fn the_window_keeps_the_keys_hugging_faces_mask_keeps() {
        for w in [1, 2, 3, 7, 64] {
            for i in 0..80 {
                for j in 0..80 {
                    let window = Window::Sliding(w);
                    assert_eq!(window.sees(i, j), hf_keeps(i, j, Some(w)), "W={w} query {i} key {j}");
                    let in_range = window.first_key(i) <= j && j <= i;
                    assert_eq!(window.sees(i, j), in_range);
                    assert_eq!(window.sees(i, j), i >= j && i < window.query_end(j, 80));
                }
            }
        }
        // Query 5 under a window of 3 sees keys 3, 4 and 5: W keys, its own included.
        let seen: Vec<usize> = (0..8).filter(|&j| Window::Sliding(3).sees(5, j)).collect();
        assert_eq!(seen, [3, 4, 5]);
        assert_eq!(Window::new(None), Window::Causal);
        assert_eq!(Window::new(Some(4096)), Window::Sliding(4096));
        assert_eq!(Window::Sliding(50).over(50), Window::Causal);
        assert_eq!(Window::Sliding(49).over(50), Window::Sliding(49));
    }

    #[test]
    fn sliding_window_forward_matches_reference_across_tiles() {
        // T spans three query tiles, the last one partial; windows inside one
        // tile, of exactly one tile, across tiles, and one short of T.
        let (b, t) = (2, 2 * TQ + 13);
        for (heads, seed) in [(Heads { nh: 4, nkv: 2, hs: 8 }, 3), (Heads { nh: 3, nkv: 3, hs: 16 }, 4)] {
            let qkv = randn(b * t * heads.qkv_width(), seed);
            for w in [1, 7, TQ, TQ + 9, t - 1] {
                let mut out = vec![0.0; b * t * heads.out_width()];
                let mut lse = vec![0.0; b * heads.nh * t];
                let mut scratch = vec![0.0; scratch_len(b, heads.nh, t)];
                let window = Window::Sliding(w);
                with_threads(2, || {
                    gqa_window_forward(&mut out, &mut lse, &mut scratch, &qkv, b, t, heads, window)
                });
                let want = sliding_reference(&to64(&qkv), b, t, heads, Some(w));
                assert_close(&out, &want, 1e-5);
            }
        }
    }

    #[test]
    fn sliding_window_backward_matches_finite_differences() {
        let (b, t) = (1, TQ + 21);
        let heads = Heads { nh: 4, nkv: 2, hs: 4 };
        let g = randn(b * t * heads.out_width(), 17);
        let qkv = randn(b * t * heads.qkv_width(), 18);
        // A window inside the first query tile, and one reaching across it.
        for w in [19, TQ + 5] {
            let loss = |p: &[Vec<f64>]| {
                sliding_reference(&p[0], b, t, heads, Some(w))
                    .iter()
                    .zip(&g)
                    .map(|(o, &g)| o * g as f64)
                    .sum()
            };
            let (_, _, dqkv) = with_threads(2, || window_run(&qkv, &g, b, t, heads, Window::Sliding(w)));
            check_grads(std::slice::from_ref(&qkv), &[dqkv], loss, 1e-4);
        }
    }

    #[test]
    fn a_window_of_one_attends_to_its_own_position_alone() {
        let (b, t) = (1, TQ + 9);
        let heads = Heads { nh: 2, nkv: 1, hs: 8 };
        let qkv = randn(b * t * heads.qkv_width(), 21);
        let g = randn(b * t * heads.out_width(), 22);
        let (out, _, dqkv) = window_run(&qkv, &g, b, t, heads, Window::Sliding(1));
        let (w, hs) = (heads.qkv_width(), heads.hs);
        for i in 0..t {
            let v = &qkv[i * w + (heads.nh + heads.nkv) * hs..][..hs];
            for h in 0..heads.nh {
                assert_eq!(&out[(i * heads.nh + h) * hs..][..hs], v, "position {i} head {h}");
            }
        }
        // One key, probability 1: no gradient reaches q or k (up to the
        // rounding of dP − D, two sums of the same products in two orders).
        let part = |cols: std::ops::Range<usize>| -> f32 {
            dqkv.chunks(w).flat_map(|r| r[cols.clone()].to_vec()).fold(0.0, |m, x| m.max(x.abs()))
        };
        let qk = (heads.nh + heads.nkv) * hs;
        assert!(part(0..qk) < 1e-5 * part(qk..w), "{} vs {}", part(0..qk), part(qk..w));
    }

    #[test]
    fn a_window_of_at_least_t_is_plain_causal_attention_bit_for_bit() {
        let (b, t) = (2, TQ + 30);
        let heads = Heads { nh: 4, nkv: 2, hs: 8 };
        let qkv = randn(b * t * heads.qkv_width(), 23);
        let g = randn(b * t * heads.out_width(), 24);
        let causal = with_threads(2, || gqa_run(&qkv, &g, b, t, heads));
        for w in [t, t + 1, 10 * t] {
            assert_eq!(causal, with_threads(2, || window_run(&qkv, &g, b, t, heads, Window::Sliding(w))));
        }
        assert_ne!(causal, window_run(&qkv, &g, b, t, heads, Window::Sliding(t - 1)));
    }

    #[test]
    fn sliding_window_results_do_not_depend_on_thread_count() {
        let (b, t) = (2, 150);
        let heads = Heads { nh: 8, nkv: 2, hs: 16 };
        let qkv = randn(b * t * heads.qkv_width(), 1);
        let g = randn(b * t * heads.out_width(), 2);
        let window = Window::Sliding(40);
        assert_thread_count_independent(|| window_run(&qkv, &g, b, t, heads, window));
    }

    #[test]
    #[should_panic(expected = "a sliding window must hold at least one key")]
    fn a_window_of_no_keys_is_refused() {
        let heads = Heads { nh: 1, nkv: 1, hs: 2 };
        let _ = window_run(&[0.0; 6], &[0.0; 2], 1, 1, heads, Window::Sliding(0));
    }

    #[test]
    fn grouped_query_forward_matches_reference_across_tiles() {
        let (b, t) = (2, TQ + 21);
        for heads in
            [Heads { nh: 4, nkv: 2, hs: 8 }, Heads { nh: 6, nkv: 1, hs: 4 }, Heads { nh: 3, nkv: 3, hs: 8 }]
        {
            let qkv = randn(b * t * heads.qkv_width(), 3);
            let mut out = vec![0.0; b * t * heads.out_width()];
            let mut lse = vec![0.0; b * heads.nh * t];
            let mut scratch = vec![0.0; scratch_len(b, heads.nh, t)];
            with_threads(2, || gqa_forward(&mut out, &mut lse, &mut scratch, &qkv, b, t, heads));
            assert_close(&out, &gqa_reference(&to64(&qkv), b, t, heads), 1e-5);
        }
    }

    #[test]
    fn grouped_query_backward_matches_finite_differences() {
        let (b, t) = (2, TQ + 3);
        let heads = Heads { nh: 4, nkv: 2, hs: 4 };
        let g = randn(b * t * heads.out_width(), 7);
        let qkv = randn(b * t * heads.qkv_width(), 8);
        let loss = |p: &[Vec<f64>]| {
            gqa_reference(&p[0], b, t, heads).iter().zip(&g).map(|(o, &g)| o * g as f64).sum()
        };
        let (_, _, dqkv) = with_threads(2, || gqa_run(&qkv, &g, b, t, heads));
        check_grads(&[qkv], &[dqkv], loss, 1e-4);
    }

    #[test]
    fn grouped_query_attention_is_multi_head_attention_with_each_kv_head_repeated_over_its_group() {
        // Hugging Face's repeat_kv: copy key/value head g to the group's query
        // heads and run multi-head attention. Outputs and query gradients are
        // the same bits; a key/value head's gradient is its copies' sum.
        let (b, t) = (2, 70);
        let heads = Heads { nh: 6, nkv: 2, hs: 8 };
        let (nh, hs, grp) = (heads.nh, heads.hs, heads.group());
        let mha = Heads::mha(nh * hs, nh);
        let qkv = randn(b * t * heads.qkv_width(), 11);
        let g = randn(b * t * heads.out_width(), 12);
        let (w, wm) = (heads.qkv_width(), mha.qkv_width());
        let mut repeated = vec![0.0; b * t * wm];
        for r in 0..b * t {
            let (src, dst) = (&qkv[r * w..][..w], &mut repeated[r * wm..][..wm]);
            dst[..nh * hs].copy_from_slice(&src[..nh * hs]);
            for h in 0..nh {
                let (_, kc, vc) = heads.columns(h);
                dst[(nh + h) * hs..][..hs].copy_from_slice(&src[kc..][..hs]);
                dst[(2 * nh + h) * hs..][..hs].copy_from_slice(&src[vc..][..hs]);
            }
        }
        let (out, lse, dqkv) = with_threads(2, || gqa_run(&qkv, &g, b, t, heads));
        let (out_m, lse_m, dqkv_m) = with_threads(2, || gqa_run(&repeated, &g, b, t, mha));
        assert_eq!(bits(&out), bits(&out_m));
        assert_eq!(bits(&lse), bits(&lse_m));
        for r in 0..b * t {
            let (got, mha_row) = (&dqkv[r * w..][..w], &dqkv_m[r * wm..][..wm]);
            assert_eq!(bits(&got[..nh * hs]), bits(&mha_row[..nh * hs]), "row {r}: dq");
            for kv in 0..heads.nkv {
                for (which, base) in [("dk", nh), ("dv", 2 * nh)] {
                    let want: Vec<f64> = (0..hs)
                        .map(|d| (0..grp).map(|j| mha_row[(base + kv * grp + j) * hs + d] as f64).sum())
                        .collect();
                    let col = if which == "dk" { (nh + kv) * hs } else { (nh + heads.nkv + kv) * hs };
                    assert_close(&got[col..][..hs], &want, 1e-5);
                }
            }
        }
    }

    #[test]
    fn grouped_query_results_do_not_depend_on_thread_count() {
        let (b, t) = (2, 150);
        let heads = Heads { nh: 8, nkv: 2, hs: 16 };
        let qkv = randn(b * t * heads.qkv_width(), 1);
        let g = randn(b * t * heads.out_width(), 2);
        assert_eq!(
            with_threads(1, || gqa_run(&qkv, &g, b, t, heads)),
            with_threads(2, || gqa_run(&qkv, &g, b, t, heads))
        );
    }

    #[test]
    #[should_panic(expected = "key/value heads must divide query heads")]
    fn key_value_heads_that_do_not_divide_query_heads_are_refused() {
        let heads = Heads { nh: 6, nkv: 4, hs: 2 };
        let qkv = vec![0.0; heads.qkv_width()];
        let _ = gqa_run(&qkv, &[0.0; 12], 1, 1, heads);
    }
}
