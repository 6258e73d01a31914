//! LayerNorm over the channel dimension, eps 1e-5 as GPT-2.
//!
//! inp and out are (N, C) with N = B·T; weight and bias are (C); mean and rstd
//! are (N), saved by forward for backward.

use super::{COLS_PER_TASK, ROWS_PER_TASK};
use rayon::prelude::*;

pub const EPS: f32 = 1e-5;

#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    n: usize,
    c: usize,
) {
    assert!(out.len() == n * c && inp.len() == n * c && mean.len() == n && rstd.len() == n);
    assert!(weight.len() == c && bias.len() == c);
    out.par_chunks_mut(c * ROWS_PER_TASK)
        .zip(mean.par_chunks_mut(ROWS_PER_TASK))
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .enumerate()
        .for_each(|(task, ((out, mean), rstd))| {
            let r0 = task * ROWS_PER_TASK;
            for (i, o) in out.chunks_mut(c).enumerate() {
                let x = &inp[(r0 + i) * c..(r0 + i + 1) * c];
                let m = x.iter().sum::<f32>() / c as f32;
                let v = x.iter().map(|&xi| (xi - m) * (xi - m)).sum::<f32>() / c as f32;
                let s = 1.0 / (v + EPS).sqrt();
                for j in 0..c {
                    o[j] = (x[j] - m) * s * weight[j] + bias[j];
                }
                mean[i] = m;
                rstd[i] = s;
            }
        });
}

/// dinp (N, C) += ∂L/∂inp; dweight (C) += Σ_rows dout·x̂; dbias (C) += Σ_rows dout.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    layernorm_backward_input(dinp, dout, inp, weight, mean, rstd, n, c);
    layernorm_backward_weight(dweight, dbias, dout, inp, mean, rstd, n, c);
}

/// The input half: dinp (N, C) += ∂L/∂inp.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert!(dinp.len() == n * c && dout.len() == n * c && inp.len() == n * c);
    assert!(weight.len() == c && mean.len() == n && rstd.len() == n);
    dinp.par_chunks_mut(c * ROWS_PER_TASK).enumerate().for_each(|(task, dinp)| {
        let r0 = task * ROWS_PER_TASK;
        for (i, dx) in dinp.chunks_mut(c).enumerate() {
            let r = r0 + i;
            let (m, s) = (mean[r], rstd[r]);
            let x = &inp[r * c..(r + 1) * c];
            let dy = &dout[r * c..(r + 1) * c];
            // Two row reductions of dnorm = dy·w: its mean and its mean against x̂.
            let mut sum_dnorm = 0.0f32;
            let mut sum_dnorm_xhat = 0.0f32;
            for j in 0..c {
                let dnorm = dy[j] * weight[j];
                sum_dnorm += dnorm;
                sum_dnorm_xhat += dnorm * (x[j] - m) * s;
            }
            let mean_dnorm = sum_dnorm / c as f32;
            let mean_dnorm_xhat = sum_dnorm_xhat / c as f32;
            for j in 0..c {
                let xhat = (x[j] - m) * s;
                let dnorm = dy[j] * weight[j];
                dx[j] += (dnorm - mean_dnorm - xhat * mean_dnorm_xhat) * s;
            }
        }
    });
}

/// The weight half: dweight (C) += Σ_rows dout·x̂; dbias (C) += Σ_rows dout.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_weight(
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert!(dout.len() == n * c && inp.len() == n * c);
    assert!(dweight.len() == c && dbias.len() == c && mean.len() == n && rstd.len() == n);
    dweight.par_chunks_mut(COLS_PER_TASK).zip(dbias.par_chunks_mut(COLS_PER_TASK)).enumerate().for_each(
        |(task, (dw, db))| {
            let c0 = task * COLS_PER_TASK;
            let w = dw.len();
            for r in 0..n {
                let (m, s) = (mean[r], rstd[r]);
                let x = &inp[r * c + c0..r * c + c0 + w];
                let dy = &dout[r * c + c0..r * c + c0 + w];
                for j in 0..w {
                    db[j] += dy[j];
                    dw[j] += dy[j] * (x[j] - m) * s;
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    fn reference(inp: &[f64], w: &[f64], b: &[f64], n: usize, c: usize) -> Vec<f64> {
        let mut out = vec![0.0; n * c];
        for i in 0..n {
            let x = &inp[i * c..(i + 1) * c];
            let m = x.iter().sum::<f64>() / c as f64;
            let v = x.iter().map(|xi| (xi - m) * (xi - m)).sum::<f64>() / c as f64;
            let s = 1.0 / (v + EPS as f64).sqrt();
            for j in 0..c {
                out[i * c + j] = (x[j] - m) * s * w[j] + b[j];
            }
        }
        out
    }

    #[test]
    fn forward_matches_reference() {
        let (n, c) = (19, 37);
        let (inp, w, b) = (randn(n * c, 1), randn(c, 2), randn(c, 3));
        let mut out = vec![0.0; n * c];
        let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
        with_threads(2, || layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &b, n, c));
        assert_close(&out, &reference(&to64(&inp), &to64(&w), &to64(&b), n, c), 1e-5);
    }

    /// 35 rows and 70 columns: the input half's row tasks and the weight
    /// half's column tasks both end in a partial task.
    #[test]
    fn backward_matches_finite_differences() {
        let (n, c) = (2 * ROWS_PER_TASK + 3, COLS_PER_TASK + 6);
        let g = randn(n * c, 7);
        let params = vec![randn(n * c, 1), randn(c, 2), randn(c, 3)];
        let loss = |p: &[Vec<f64>]| {
            reference(&p[0], &p[1], &p[2], n, c).iter().zip(&g).map(|(o, &g)| o * g as f64).sum()
        };
        let mut out = vec![0.0; n * c];
        let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
        let (mut dinp, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
        with_threads(2, || {
            layernorm_forward(&mut out, &mut mean, &mut rstd, &params[0], &params[1], &params[2], n, c);
            layernorm_backward(&mut dinp, &mut dw, &mut db, &g, &params[0], &params[1], &mean, &rstd, n, c);
        });
        check_grads(&params, &[dinp, dw, db], loss, 1e-4);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (n, c) = (300, 200);
        let (inp, w, b, g) = (randn(n * c, 1), randn(c, 2), randn(c, 3), randn(n * c, 4));
        let run = |t| {
            with_threads(t, || {
                let mut out = vec![0.0; n * c];
                let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
                layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &b, n, c);
                let (mut dinp, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
                layernorm_backward(&mut dinp, &mut dw, &mut db, &g, &inp, &w, &mean, &rstd, n, c);
                (out, dinp, dw, db)
            })
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }
}
