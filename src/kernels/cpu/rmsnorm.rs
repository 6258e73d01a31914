//! RMSNorm over the channel dimension (Llama): out = w · x / √(mean(x²) + eps),
//! weight only, no mean subtracted, no bias. eps comes from the model's
//! config (`rms_norm_eps`: 1e-5 for Llama 3, 1e-6 for Llama 2).
//!
//! inp and out are (N, C) with N = B·T; weight is (C); rstd is (N), saved by
//! forward for backward. Hugging Face's LlamaRMSNorm computes in f32 the same
//! way: the mean of squares, rsqrt, then the product with the weight.

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
}
