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

/// Workspace floats that forward and backward need.
pub fn scratch_len(b: usize, nh: usize, t: usize) -> usize {
    b * nh * (2 * TQ * t + t)
}

/// Softmax over row[..valid] in place (scores already scaled), zeroing row[valid..];
/// returns the row's log-sum-exp.
#[inline]
fn causal_softmax_row(row: &mut [f32], valid: usize) -> f32 {
    let max = row[..valid].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    exp_shifted(&mut row[..valid], max);
    let sum: f32 = row[..valid].iter().sum();
    scale(&mut row[..valid], 1.0 / sum);
    row[valid..].fill(0.0);
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

/// Grouped-query attention forward (see the module's layout).
pub fn gqa_forward(
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    heads: Heads,
) {
    heads.check();
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
                let kend = q0 + tq;
                let s = &mut scratch[..tq * kend];
                // SAFETY: views stay inside qkv (rows < T of batch bi, columns < W),
                // and inside this task's scratch and head columns of out.
                unsafe {
                    gemm_raw(
                        tq,
                        kend,
                        hs,
                        s.as_mut_ptr(),
                        kend as isize,
                        false,
                        Mat { ptr: q.offset(q0 as isize * row3), rs: row3, cs: 1 },
                        Mat { ptr: k, rs: 1, cs: row3 },
                        scale,
                        Parallelism::None,
                    );
                }
                for i in 0..tq {
                    lse[q0 + i] = causal_softmax_row(&mut s[i * kend..(i + 1) * kend], q0 + i + 1);
                }
                unsafe {
                    gemm_raw(
                        tq,
                        hs,
                        kend,
                        out_ptr.get().add((bi * t + q0) * c + h * hs),
                        c as isize,
                        false,
                        Mat { ptr: s.as_ptr(), rs: kend as isize, cs: 1 },
                        Mat { ptr: v, rs: row3, cs: 1 },
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

/// dqkv (B, T, W) += ∂L/∂qkv given dout (B, T, NH·HS), and forward's out and lse.
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
    heads.check();
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
                let kend = q0 + tq;
                let p = &mut p_buf[..tq * kend];
                let dp = &mut dp_buf[..tq * kend];
                let dout_tile =
                    Mat { ptr: dout[(bi * t + q0) * c + h * hs..].as_ptr(), rs: c as isize, cs: 1 };
                let q_tile = Mat { ptr: unsafe { q.offset(q0 as isize * row3) }, rs: row3, cs: 1 };
                // SAFETY (all products below): views stay inside qkv, dout, this task's
                // scratch, and this key/value group's columns of dqkv for batch bi.
                unsafe {
                    gemm_raw(
                        tq,
                        kend,
                        hs,
                        p.as_mut_ptr(),
                        kend as isize,
                        false,
                        q_tile,
                        Mat { ptr: k, rs: 1, cs: row3 },
                        scale,
                        Parallelism::None,
                    );
                    gemm_raw(
                        tq,
                        kend,
                        hs,
                        dp.as_mut_ptr(),
                        kend as isize,
                        false,
                        dout_tile,
                        Mat { ptr: v, rs: 1, cs: row3 },
                        1.0,
                        Parallelism::None,
                    );
                }
                for i in 0..tq {
                    let valid = q0 + i + 1;
                    let (l, di) = (lse[q0 + i], d[q0 + i]);
                    let pr = &mut p[i * kend..(i + 1) * kend];
                    let dpr = &mut dp[i * kend..(i + 1) * kend];
                    softmax_row_backward(&mut pr[..valid], &mut dpr[..valid], l, di);
                    pr[valid..].fill(0.0);
                    dpr[valid..].fill(0.0);
                }
                unsafe {
                    // dQ_tile += scale · dS · K
                    gemm_raw(
                        tq,
                        hs,
                        kend,
                        dq.offset(q0 as isize * row3),
                        row3,
                        true,
                        Mat { ptr: dp.as_ptr(), rs: kend as isize, cs: 1 },
                        Mat { ptr: k, rs: row3, cs: 1 },
                        scale,
                        Parallelism::None,
                    );
                    // dK[..kend] += scale · dSᵀ · Q_tile
                    gemm_raw(
                        kend,
                        hs,
                        tq,
                        dk,
                        row3,
                        true,
                        Mat { ptr: dp.as_ptr(), rs: 1, cs: kend as isize },
                        q_tile,
                        scale,
                        Parallelism::None,
                    );
                    // dV[..kend] += Pᵀ · dO_tile
                    gemm_raw(
                        kend,
                        hs,
                        tq,
                        dv,
                        row3,
                        true,
                        Mat { ptr: p.as_ptr(), rs: 1, cs: kend as isize },
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
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let k = &qkv[(bi * t + j) * w + kc..][..hs];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for (j, s) in scores.iter().enumerate() {
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
