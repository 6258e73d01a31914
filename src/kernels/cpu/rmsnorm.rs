//! RMSNorm over the channel dimension (Llama): out = w · x / √(mean(x²) + eps),
//! weight only, no mean subtracted, no bias. eps comes from the model's
//! config (`rms_norm_eps`: 1e-5 for Llama 3, 1e-6 for Llama 2).
//!
//! inp and out are (N, C) with N = B·T; weight is (C); rstd is (N), saved by
//! forward for backward. Hugging Face's LlamaRMSNorm computes in f32 the same
//! way: the mean of squares, rsqrt, then the product with the weight.
//!
//! Per-head RMSNorm (Qwen3's `q_norm` and `k_norm`) is the same norm over
//! each head-wide block of HS columns, one weight (HS) shared by every head,
//! applied to q and k before RoPE: see [`HeadRun`] and `head_rmsnorm_*` below.

use super::{COLS_PER_TASK, ROWS_PER_TASK};
use rayon::prelude::*;

#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    eps: f32,
) {
    assert!(out.len() == n * c && inp.len() == n * c && rstd.len() == n && weight.len() == c);
    out.par_chunks_mut(c * ROWS_PER_TASK).zip(rstd.par_chunks_mut(ROWS_PER_TASK)).enumerate().for_each(
        |(task, (out, rstd))| {
            let r0 = task * ROWS_PER_TASK;
            for (i, o) in out.chunks_mut(c).enumerate() {
                let x = &inp[(r0 + i) * c..(r0 + i + 1) * c];
                let ms = x.iter().map(|&xi| xi * xi).sum::<f32>() / c as f32;
                let s = 1.0 / (ms + eps).sqrt();
                for j in 0..c {
                    // HF's order: normalise first, then scale by the weight.
                    o[j] = weight[j] * (x[j] * s);
                }
                rstd[i] = s;
            }
        },
    );
}

/// dinp (N, C) += ∂L/∂inp; dweight (C) += Σ_rows dout·x·rstd.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    rmsnorm_backward_input(dinp, dout, inp, weight, rstd, n, c);
    rmsnorm_backward_weight(dweight, dout, inp, rstd, n, c);
}

/// The input half: with x̂ = x·s and g = dout·w,
/// dx = s·(g − x̂·mean(g·x̂)).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert!(dinp.len() == n * c && dout.len() == n * c && inp.len() == n * c);
    assert!(weight.len() == c && rstd.len() == n);
    dinp.par_chunks_mut(c * ROWS_PER_TASK).enumerate().for_each(|(task, dinp)| {
        let r0 = task * ROWS_PER_TASK;
        for (i, dx) in dinp.chunks_mut(c).enumerate() {
            let r = r0 + i;
            let s = rstd[r];
            let x = &inp[r * c..(r + 1) * c];
            let dy = &dout[r * c..(r + 1) * c];
            let mut dot = 0.0f32;
            for j in 0..c {
                dot += dy[j] * weight[j] * (x[j] * s);
            }
            let mean_dot = dot / c as f32;
            for j in 0..c {
                let xhat = x[j] * s;
                dx[j] += (dy[j] * weight[j] - xhat * mean_dot) * s;
            }
        }
    });
}

/// The weight half: dweight (C) += Σ_rows dout·x·rstd, rows in order.
pub fn rmsnorm_backward_weight(
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert!(dout.len() == n * c && inp.len() == n * c && dweight.len() == c && rstd.len() == n);
    dweight.par_chunks_mut(COLS_PER_TASK).enumerate().for_each(|(task, dw)| {
        let c0 = task * COLS_PER_TASK;
        let w = dw.len();
        for r in 0..n {
            let s = rstd[r];
            let x = &inp[r * c + c0..r * c + c0 + w];
            let dy = &dout[r * c + c0..r * c + c0 + w];
            for j in 0..w {
                dw[j] += dy[j] * (x[j] * s);
            }
        }
    });
}

/// Where a per-head RMSNorm works: in each of the N rows of an (N, W)
/// row-major buffer, `heads` head-wide blocks of HS columns, the first at head
/// `first` (column first·HS). In the attention's qkv rows, W = (NH + 2·NKV)·HS
/// and q's heads come first, then k's, then v's (as RoPE addresses them), so
/// q_norm runs over `{ first: 0, heads: NH }` and k_norm over
/// `{ first: NH, heads: NKV }`, each with its own weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadRun {
    pub n: usize,
    pub w: usize,
    pub first: usize,
    pub heads: usize,
    pub hs: usize,
}

impl HeadRun {
    fn check(&self) {
        assert!(self.hs > 0 && self.heads > 0, "{self:?}: no head to normalise");
        assert!(
            (self.first + self.heads) * self.hs <= self.w,
            "{self:?}: the heads run past a row of W columns"
        );
    }

    /// The first column of head h of the run (h counted from the run's first).
    pub fn col(&self, h: usize) -> usize {
        (self.first + h) * self.hs
    }
}

/// Per-head RMSNorm forward (Qwen3's q_norm / k_norm): for every row r and
/// head h of `run`, with x the block inp[r, col(h)..col(h) + HS],
///   rstd[r, h] = 1 / √(mean(x²) + eps),  out block = weight · (x · rstd).
/// inp and out are (N, W), only the run's columns of out written; weight is
/// (HS); rstd is (N, heads), saved for backward. Hugging Face's Qwen3RMSNorm
/// in this order: `hidden_states.to(torch.float32)`, `variance =
/// hidden_states.pow(2).mean(-1)`, `hidden_states * torch.rsqrt(variance +
/// eps)`, then `weight * hidden_states.to(input_dtype)`; all in f32 here.
pub fn head_rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    run: HeadRun,
    eps: f32,
) {
    run.check();
    let HeadRun { n, w, heads, hs, .. } = run;
    assert!(out.len() == n * w && inp.len() == n * w && rstd.len() == n * heads && weight.len() == hs);
    out.par_chunks_mut(w * ROWS_PER_TASK)
        .zip(rstd.par_chunks_mut(heads * ROWS_PER_TASK))
        .enumerate()
        .for_each(|(task, (out, rstd))| {
            let r0 = task * ROWS_PER_TASK;
            for (i, (o, rs)) in out.chunks_mut(w).zip(rstd.chunks_mut(heads)).enumerate() {
                for (h, s_out) in rs.iter_mut().enumerate() {
                    let col = run.col(h);
                    let x = &inp[(r0 + i) * w + col..][..hs];
                    let ms = x.iter().map(|&xi| xi * xi).sum::<f32>() / hs as f32;
                    let s = 1.0 / (ms + eps).sqrt();
                    for (j, o) in o[col..col + hs].iter_mut().enumerate() {
                        // HF's order: normalise first, then scale by the weight.
                        *o = weight[j] * (x[j] * s);
                    }
                    *s_out = s;
                }
            }
        });
}

/// Both halves of the per-head RMSNorm backward: dinp's run columns +=
/// ∂L/∂inp and dweight += Σ dout·x·rstd (see the two halves).
#[allow(clippy::too_many_arguments)]
pub fn head_rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    run: HeadRun,
) {
    head_rmsnorm_backward_input(dinp, dout, inp, weight, rstd, run);
    head_rmsnorm_backward_weight(dweight, dout, inp, rstd, run);
}

/// The input half: per (row, head) block, with x̂ = x·s and g = dout·w,
/// dx += s·(g − x̂·mean(g·x̂)). dinp, dout and inp are (N, W); only the
/// run's columns of dinp change.
pub fn head_rmsnorm_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    run: HeadRun,
) {
    run.check();
    let HeadRun { n, w, heads, hs, .. } = run;
    assert!(dinp.len() == n * w && dout.len() == n * w && inp.len() == n * w);
    assert!(weight.len() == hs && rstd.len() == n * heads);
    dinp.par_chunks_mut(w * ROWS_PER_TASK).enumerate().for_each(|(task, dinp)| {
        let r0 = task * ROWS_PER_TASK;
        for (i, drow) in dinp.chunks_mut(w).enumerate() {
            let r = r0 + i;
            for h in 0..heads {
                let (col, s) = (run.col(h), rstd[r * heads + h]);
                let x = &inp[r * w + col..][..hs];
                let dy = &dout[r * w + col..][..hs];
                let mut dot = 0.0f32;
                for j in 0..hs {
                    dot += dy[j] * weight[j] * (x[j] * s);
                }
                let mean_dot = dot / hs as f32;
                for (j, dx) in drow[col..col + hs].iter_mut().enumerate() {
                    let xhat = x[j] * s;
                    *dx += (dy[j] * weight[j] - xhat * mean_dot) * s;
                }
            }
        }
    });
}

/// Weight-gradient columns per parallel task (HS is 64 or 128 in practice).
const HEAD_COLS_PER_TASK: usize = 16;

/// The weight half: dweight (G, HS) += Σ dout·x·rstd over the rows and the
/// run's heads, the heads in G equal consecutive groups, group g into
/// dweight[g] (G = dweight.len() / HS; G = 1 is the weight's whole
/// gradient). Each element sums rows in order and, within a row, its group's
/// heads in order, whatever the thread count. Per-group partials let a
/// tensor-parallel split, whose ranks hold different heads, join them in a
/// fixed tree that does not depend on the split.
pub fn head_rmsnorm_backward_weight(
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    rstd: &[f32],
    run: HeadRun,
) {
    run.check();
    let HeadRun { n, w, heads, hs, .. } = run;
    assert!(dout.len() == n * w && inp.len() == n * w && rstd.len() == n * heads);
    let groups = dweight.len() / hs;
    assert!(
        dweight.len() == groups * hs && groups > 0 && heads.is_multiple_of(groups),
        "{run:?}: dweight of {} is not (G, HS) for G groups dividing the {heads} heads",
        dweight.len()
    );
    let per = heads / groups;
    dweight.par_chunks_mut(HEAD_COLS_PER_TASK).enumerate().for_each(|(task, dw)| {
        let c0 = task * HEAD_COLS_PER_TASK;
        for r in 0..n {
            for (k, acc) in dw.iter_mut().enumerate() {
                let (g, j) = ((c0 + k) / hs, (c0 + k) % hs);
                for h in g * per..(g + 1) * per {
                    let at = r * w + run.col(h) + j;
                    *acc += dout[at] * (inp[at] * rstd[r * heads + h]);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    const EPS: f32 = 1e-5;

    fn reference(inp: &[f64], w: &[f64], n: usize, c: usize) -> Vec<f64> {
        let mut out = vec![0.0; n * c];
        for i in 0..n {
            let x = &inp[i * c..(i + 1) * c];
            let ms = x.iter().map(|v| v * v).sum::<f64>() / c as f64;
            let s = 1.0 / (ms + EPS as f64).sqrt();
            for j in 0..c {
                out[i * c + j] = w[j] * x[j] * s;
            }
        }
        out
    }

    #[test]
    fn forward_matches_reference() {
        let (n, c) = (19, 37);
        let (inp, w) = (randn(n * c, 1), randn(c, 2));
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        with_threads(2, || rmsnorm_forward(&mut out, &mut rstd, &inp, &w, n, c, EPS));
        assert_close(&out, &reference(&to64(&inp), &to64(&w), n, c), 1e-5);
    }

    /// Row tasks and column tasks that each end in a partial task.
    #[test]
    fn backward_matches_finite_differences() {
        let (n, c) = (2 * ROWS_PER_TASK + 3, COLS_PER_TASK + 6);
        let g = randn(n * c, 7);
        let params = vec![randn(n * c, 1), randn(c, 2)];
        let loss =
            |p: &[Vec<f64>]| reference(&p[0], &p[1], n, c).iter().zip(&g).map(|(o, &g)| o * g as f64).sum();
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        let (mut dinp, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
        with_threads(2, || {
            rmsnorm_forward(&mut out, &mut rstd, &params[0], &params[1], n, c, EPS);
            rmsnorm_backward(&mut dinp, &mut dw, &g, &params[0], &params[1], &rstd, n, c);
        });
        check_grads(&params, &[dinp, dw], loss, 1e-4);
    }

    #[test]
    fn backward_accumulates_into_its_gradients() {
        let (n, c) = (5, 8);
        let (inp, w, g) = (randn(n * c, 1), randn(c, 2), randn(n * c, 3));
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut out, &mut rstd, &inp, &w, n, c, EPS);
        let once = {
            let (mut dx, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
            rmsnorm_backward(&mut dx, &mut dw, &g, &inp, &w, &rstd, n, c);
            (dx, dw)
        };
        let (mut dx, mut dw) = (once.0.clone(), once.1.clone());
        rmsnorm_backward(&mut dx, &mut dw, &g, &inp, &w, &rstd, n, c);
        let doubled = |v: &[f32]| v.iter().map(|x| 2.0 * x).collect::<Vec<f32>>();
        // Each input gradient is one term added to what was there: exactly twice.
        assert_eq!(bits(&dx), bits(&doubled(&once.0)));
        // The weight's rows are added one by one onto the earlier sum, so only
        // close to twice (the rounding of a longer running sum).
        assert_close(&dw, &to64(&doubled(&once.1)), 1e-6);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (n, c) = (300, 200);
        let (inp, w, g) = (randn(n * c, 1), randn(c, 2), randn(n * c, 4));
        assert_thread_count_independent(|| {
            let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(&mut out, &mut rstd, &inp, &w, n, c, EPS);
            let (mut dinp, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
            rmsnorm_backward(&mut dinp, &mut dw, &g, &inp, &w, &rstd, n, c);
            (bits(&out), bits(&dinp), bits(&dw))
        });
    }

    /// Per-head RMSNorm in f64 on f64 inputs: the run's columns normalised, the rest as given.
    fn head_reference(inp: &[f64], wt: &[f64], run: HeadRun, eps: f64) -> Vec<f64> {
        let mut out = inp.to_vec();
        for r in 0..run.n {
            for h in 0..run.heads {
                let at = r * run.w + run.col(h);
                let x = &inp[at..at + run.hs];
                let ms = x.iter().map(|v| v * v).sum::<f64>() / run.hs as f64;
                let s = 1.0 / (ms + eps).sqrt();
                for j in 0..run.hs {
                    out[at + j] = wt[j] * (x[j] * s);
                }
            }
        }
        out
    }

    /// Grouped-query qkv rows: 4 query heads, 2 key/value heads of 8. The
    /// query run, the key run (Qwen3's q_norm, k_norm), and a run starting
    /// mid-row with a head size that is no multiple of the column tasks.
    fn runs(n: usize) -> [HeadRun; 3] {
        let (nh, nkv, hs) = (4, 2, 8);
        let w = (nh + 2 * nkv) * hs;
        [
            HeadRun { n, w, first: 0, heads: nh, hs },
            HeadRun { n, w, first: nh, heads: nkv, hs },
            HeadRun { n, w: 60, first: 1, heads: 2, hs: 20 },
        ]
    }

    #[test]
    fn head_forward_matches_reference_and_leaves_other_columns_alone() {
        let n = 2 * ROWS_PER_TASK + 5;
        for (k, run) in runs(n).into_iter().enumerate() {
            let (inp, wt) = (randn(n * run.w, 40 + k as u64), randn(run.hs, 50 + k as u64));
            // out starts as a copy of inp, so the reference's untouched columns are its own.
            let (mut out, mut rstd) = (inp.clone(), vec![0.0; n * run.heads]);
            with_threads(2, || head_rmsnorm_forward(&mut out, &mut rstd, &inp, &wt, run, EPS));
            let want = head_reference(&to64(&inp), &to64(&wt), run, EPS as f64);
            assert_close(&out, &want, 1e-6);
            for r in 0..n {
                for c in (0..run.w).filter(|&c| c < run.col(0) || c >= run.col(run.heads)) {
                    assert_eq!(
                        out[r * run.w + c].to_bits(),
                        inp[r * run.w + c].to_bits(),
                        "row {r} column {c}"
                    );
                }
            }
        }
    }

    #[test]
    fn head_forward_is_the_plain_rmsnorm_of_each_head_block() {
        // The same arithmetic, block by block: the same bits as rmsnorm_forward
        // over the blocks laid out as rows.
        let n = 7;
        let run = runs(n)[0];
        let (inp, wt) = (randn(n * run.w, 60), randn(run.hs, 61));
        let (mut out, mut rstd) = (vec![0.0; n * run.w], vec![0.0; n * run.heads]);
        head_rmsnorm_forward(&mut out, &mut rstd, &inp, &wt, run, EPS);
        let rows: Vec<f32> = inp.chunks(run.w).flat_map(|r| r[..run.heads * run.hs].to_vec()).collect();
        let (mut want, mut want_rstd) = (vec![0.0; rows.len()], vec![0.0; n * run.heads]);
        rmsnorm_forward(&mut want, &mut want_rstd, &rows, &wt, n * run.heads, run.hs, EPS);
        let got: Vec<f32> = out.chunks(run.w).flat_map(|r| r[..run.heads * run.hs].to_vec()).collect();
        assert_eq!(bits(&got), bits(&want));
        assert_eq!(bits(&rstd), bits(&want_rstd));
    }

    #[test]
    fn head_backward_matches_finite_differences() {
        let n = ROWS_PER_TASK + 3;
        for (k, run) in runs(n).into_iter().enumerate() {
            let g = randn(n * run.w, 70 + k as u64);
            let params = vec![randn(n * run.w, 80 + k as u64), randn(run.hs, 90 + k as u64)];
            let loss = |p: &[Vec<f64>]| {
                head_reference(&p[0], &p[1], run, EPS as f64).iter().zip(&g).map(|(o, &g)| o * g as f64).sum()
            };
            let (mut out, mut rstd) = (vec![0.0; n * run.w], vec![0.0; n * run.heads]);
            let (mut dinp, mut dw) = (vec![0.0; n * run.w], vec![0.0; run.hs]);
            with_threads(2, || {
                head_rmsnorm_forward(&mut out, &mut rstd, &params[0], &params[1], run, EPS);
                head_rmsnorm_backward(&mut dinp, &mut dw, &g, &params[0], &params[1], &rstd, run);
            });
            // Outside the run out is the input itself in the reference: gradient g there.
            for r in 0..n {
                for c in (0..run.w).filter(|&c| c < run.col(0) || c >= run.col(run.heads)) {
                    dinp[r * run.w + c] += g[r * run.w + c];
                }
            }
            check_grads(&params, &[dinp, dw], loss, 1e-4);
        }
    }

    #[test]
    fn head_weight_gradient_in_groups_sums_to_the_whole() {
        let n = 21;
        let run = runs(n)[0];
        let (inp, wt, g) = (randn(n * run.w, 1), randn(run.hs, 2), randn(n * run.w, 3));
        let (mut out, mut rstd) = (vec![0.0; n * run.w], vec![0.0; n * run.heads]);
        head_rmsnorm_forward(&mut out, &mut rstd, &inp, &wt, run, EPS);
        let mut whole = vec![0.0; run.hs];
        head_rmsnorm_backward_weight(&mut whole, &g, &inp, &rstd, run);
        for groups in [2, 4] {
            let mut parts = vec![0.0; groups * run.hs];
            head_rmsnorm_backward_weight(&mut parts, &g, &inp, &rstd, run);
            let sum: Vec<f64> =
                (0..run.hs).map(|j| (0..groups).map(|k| parts[k * run.hs + j] as f64).sum()).collect();
            assert_close(&whole, &sum, 1e-6);
            // Group k alone is the whole gradient of a run over its heads.
            let per = run.heads / groups;
            for k in 0..groups {
                let sub = HeadRun { first: run.first + k * per, heads: per, ..run };
                let sub_rstd: Vec<f32> =
                    rstd.chunks(run.heads).flat_map(|r| r[k * per..(k + 1) * per].to_vec()).collect();
                let mut one = vec![0.0; run.hs];
                head_rmsnorm_backward_weight(&mut one, &g, &inp, &sub_rstd, sub);
                assert_eq!(bits(&one), bits(&parts[k * run.hs..(k + 1) * run.hs]), "group {k} of {groups}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "is not (G, HS) for G groups dividing the 4 heads")]
    fn head_weight_gradient_groups_must_divide_the_heads() {
        let run = runs(2)[0];
        let zeros = vec![0.0; 2 * run.w];
        head_rmsnorm_backward_weight(&mut [0.0; 24], &zeros, &zeros, &[1.0; 8], run);
    }

    #[test]
    fn head_backward_accumulates_and_does_not_depend_on_thread_count() {
        let n = 3 * ROWS_PER_TASK + 1;
        let run = runs(n)[1];
        let (inp, wt, g) = (randn(n * run.w, 4), randn(run.hs, 5), randn(n * run.w, 6));
        let (dinp0, dw0) = (randn(n * run.w, 7), randn(2 * run.hs, 8));
        assert_thread_count_independent(|| {
            let (mut out, mut rstd) = (vec![0.0; n * run.w], vec![0.0; n * run.heads]);
            head_rmsnorm_forward(&mut out, &mut rstd, &inp, &wt, run, EPS);
            let (mut dinp, mut dw) = (dinp0.clone(), dw0.clone());
            head_rmsnorm_backward(&mut dinp, &mut dw, &g, &inp, &wt, &rstd, run);
            (bits(&out), bits(&rstd), bits(&dinp), bits(&dw))
        });
        // Accumulated: a second backward adds the same terms again.
        let (mut out, mut rstd) = (vec![0.0; n * run.w], vec![0.0; n * run.heads]);
        head_rmsnorm_forward(&mut out, &mut rstd, &inp, &wt, run, EPS);
        let (mut once, mut dw1) = (vec![0.0; n * run.w], vec![0.0; run.hs]);
        head_rmsnorm_backward(&mut once, &mut dw1, &g, &inp, &wt, &rstd, run);
        let (mut twice, mut dw2) = (once.clone(), dw1.clone());
        head_rmsnorm_backward(&mut twice, &mut dw2, &g, &inp, &wt, &rstd, run);
        let doubled = |v: &[f32]| v.iter().map(|x| 2.0 * x).collect::<Vec<f32>>();
        assert_eq!(bits(&twice), bits(&doubled(&once)));
        assert_close(&dw2, &to64(&doubled(&dw1)), 1e-6);
    }
}
