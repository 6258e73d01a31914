//! Fused softmax + cross-entropy over the vocabulary.
//!
//! logits is (N, V), targets is (N) ids < V, losses is (N). With gradients, the
//! logits buffer is overwritten by dlogits = (softmax − onehot(target))·dloss, so
//! the (N, V) probabilities never need a buffer of their own.

use super::math::{exp, simd_fn};
use super::ROWS_PER_TASK;
use rayon::prelude::*;

/// Returns (max, log Σ exp(x − max)) of a row, the log in f64.
#[inline]
fn row_lse(row: &[f32]) -> (f32, f64) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    (max, sum_exp_shifted(row, max).ln())
}

/// −log softmax(row)[target] from the row's (max, log-sum), formed in f64 so the
/// loss keeps the sum's precision until the last rounding.
#[inline]
fn row_loss(max: f32, log_sum: f64, logit: f32) -> f32 {
    (max as f64 + log_sum - logit as f64) as f32
}

/// Lanes of the exponential sum: element j goes to lane j % SUM_LANES.
const SUM_LANES: usize = 8;

simd_fn! {
    /// Σ e^(x − shift) in f64. Exponentials are formed in f32 blocks so they
    /// vectorize; the sum runs in SUM_LANES f64 lanes, element j in lane
    /// j % SUM_LANES, and the lanes meet in a fixed tree, so the bits do not
    /// depend on the machine. f32 accumulation dropped GPT-2's long tail: at
    /// V = 50 257 a peaked row's running sum is ≈ 1 and each e^(x − max) ≈ 1e-8
    /// rounded away, reading the loss 6.8e-5 (relative) low.
    fn sum_exp_shifted(row: &[f32], shift: f32) -> f64 {
        let mut buf = [0.0f32; 64];
        let mut lanes = [0.0f64; SUM_LANES];
        for chunk in row.chunks(64) {
            for (b, &x) in buf.iter_mut().zip(chunk) {
                *b = exp(x - shift);
            }
            // 64 is a multiple of SUM_LANES, so lane k holds every element ≡ k.
            for group in buf[..chunk.len()].chunks(SUM_LANES) {
                for (lane, &b) in lanes.iter_mut().zip(group) {
                    *lane += b as f64;
                }
            }
        }
        let [a, b, c, d, e, f, g, h] = lanes;
        ((a + b) + (c + d)) + ((e + f) + (g + h))
    }
}

simd_fn! {
    /// x ← e^(x − lse)·dloss: softmax times the loss gradient.
    fn softmax_times(row: &mut [f32], lse: f32, dloss: f32) {
        for x in row.iter_mut() {
            *x = exp(*x - lse) * dloss;
        }
    }
}

/// losses[i] = −log softmax(logits[i])[targets[i]]; logits[i] ← its gradient times dloss.
pub fn crossentropy_forward_backward(
    logits: &mut [f32],
    losses: &mut [f32],
    targets: &[u32],
    dloss: f32,
    n: usize,
    v: usize,
) {
    assert!(logits.len() == n * v && losses.len() == n && targets.len() == n);
    logits.par_chunks_mut(v * ROWS_PER_TASK).zip(losses.par_chunks_mut(ROWS_PER_TASK)).enumerate().for_each(
        |(task, (rows, losses))| {
            for (i, row) in rows.chunks_mut(v).enumerate() {
                let target = targets[task * ROWS_PER_TASK + i] as usize;
                assert!(target < v, "target {target} out of vocabulary {v}");
                let (max, log_sum) = row_lse(row);
                losses[i] = row_loss(max, log_sum, row[target]);
                softmax_times(row, (max as f64 + log_sum) as f32, dloss);
                row[target] -= dloss;
            }
        },
    );
}

/// Loss only, and optionally the argmax prediction of each row (for exact-match metrics).
pub fn crossentropy_forward(
    logits: &[f32],
    losses: &mut [f32],
    targets: &[u32],
    argmax: Option<&mut [u32]>,
    n: usize,
    v: usize,
) {
    assert!(logits.len() == n * v && losses.len() == n && targets.len() == n);
    losses.par_iter_mut().enumerate().for_each(|(i, loss)| {
        let row = &logits[i * v..(i + 1) * v];
        let (max, log_sum) = row_lse(row);
        *loss = row_loss(max, log_sum, row[targets[i] as usize]);
    });
    if let Some(argmax) = argmax {
        assert_eq!(argmax.len(), n);
        argmax.par_iter_mut().enumerate().for_each(|(i, a)| {
            *a = first_argmax(&logits[i * v..(i + 1) * v]) as u32;
        });
    }
}

/// The first index of a row's maximum, so ties resolve the same way everywhere.
pub fn first_argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for j in 1..row.len() {
        if row[j] > row[best] {
            best = j;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    fn reference(logits: &[f64], targets: &[u32], v: usize) -> Vec<f64> {
        logits
            .chunks(v)
            .zip(targets)
            .map(|(row, &t)| {
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = row.iter().map(|x| (x - m).exp()).sum();
                m + z.ln() - row[t as usize]
            })
            .collect()
    }

    #[test]
    fn loss_and_gradient_match_reference() {
        let (n, v) = (9, 83);
        let logits: Vec<f32> = randn(n * v, 1).iter().map(|x| x * 4.0).collect();
        let targets: Vec<u32> = (0..n).map(|i| ((i * 31 + 5) % v) as u32).collect();
        let l64: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
        let want = reference(&l64, &targets, v);
        let mut losses = vec![0.0; n];
        crossentropy_forward(&logits, &mut losses, &targets, None, n, v);
        assert_close(&losses, &want, 1e-5);

        let dloss = 1.0 / n as f32;
        let mut grad = logits.clone();
        let mut losses2 = vec![0.0; n];
        with_threads(2, || crossentropy_forward_backward(&mut grad, &mut losses2, &targets, dloss, n, v));
        assert_eq!(losses, losses2);
        let loss = |p: &[Vec<f64>]| reference(&p[0], &targets, v).iter().sum::<f64>() * dloss as f64;
        check_grads(&[logits], &[grad], loss, 1e-4);
    }

    /// GPT-2's vocabulary with a peaked row: the peak's term is 1 and each of
    /// the 50 256 others ≈ 4e-8, below half an f32 ulp of 1, so a running f32
    /// sum drops the tail (≈ 2.3e-3 of the mass) wherever it follows the peak.
    #[test]
    fn peaked_loss_at_gpt2_vocabulary_matches_f64_reference() {
        let (n, v) = (6, 50_257);
        let noise = randn(n * v, 21);
        let peaks = [0, 1, v / 2, v - 1, 64, 12_345];
        let mut logits: Vec<f32> = noise.iter().map(|x| -17.0 + 0.5 * x).collect();
        for (row, &p) in peaks.iter().enumerate() {
            logits[row * v + p] = 0.0;
        }
        // Half the rows ask for the peak (loss ≈ 2e-3), half for a tail token (≈ 17).
        let targets: Vec<u32> =
            peaks.iter().enumerate().map(|(i, &p)| if i % 2 == 0 { p } else { (p + 7) % v } as u32).collect();
        let l64: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
        let want = reference(&l64, &targets, v);

        let within_f32_floor = |got: &[f32]| {
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let tol = 2e-6 * w.abs().max(1e-3);
                assert!((g as f64 - w).abs() <= tol, "row {i}: loss {g} against f64 {w}");
            }
        };
        let mut losses = vec![0.0; n];
        crossentropy_forward(&logits, &mut losses, &targets, None, n, v);
        within_f32_floor(&losses);

        let mut grad = logits.clone();
        let mut losses2 = vec![0.0; n];
        crossentropy_forward_backward(&mut grad, &mut losses2, &targets, 1.0, n, v);
        within_f32_floor(&losses2);
        // The target's gradient p − 1 is minus the tail's share: the dropped mass itself.
        for (row, &t) in targets.iter().enumerate() {
            let lse = want[row] + l64[row * v + t as usize];
            let p = (l64[row * v + t as usize] - lse).exp();
            let g = grad[row * v + t as usize] as f64;
            assert!((g - (p - 1.0)).abs() <= 5e-3 * (1.0 - p), "row {row}: dlogit {g} against {}", p - 1.0);
        }
    }

    /// 37 rows: two full tasks of ROWS_PER_TASK and part of a third.
    #[test]
    fn gradient_matches_finite_differences_across_tasks() {
        let (n, v) = (2 * ROWS_PER_TASK + 5, 83);
        let logits: Vec<f32> = randn(n * v, 11).iter().map(|x| x * 2.0).collect();
        let targets: Vec<u32> = (0..n).map(|i| ((i * 17 + 3) % v) as u32).collect();
        let dloss = 1.0 / n as f32;
        let mut grad = logits.clone();
        let mut losses = vec![0.0; n];
        with_threads(3, || crossentropy_forward_backward(&mut grad, &mut losses, &targets, dloss, n, v));
        let loss = |p: &[Vec<f64>]| reference(&p[0], &targets, v).iter().sum::<f64>() * dloss as f64;
        check_grads(&[logits], &[grad], loss, 1e-4);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (n, v) = (3 * ROWS_PER_TASK + 7, 301);
        let logits: Vec<f32> = randn(n * v, 12).iter().map(|x| x * 3.0).collect();
        let targets: Vec<u32> = (0..n).map(|i| ((i * 131 + 7) % v) as u32).collect();
        assert_thread_count_independent(|| {
            let mut grad = logits.clone();
            let mut losses = vec![0.0; n];
            crossentropy_forward_backward(&mut grad, &mut losses, &targets, 0.25, n, v);
            let mut eval_losses = vec![0.0; n];
            let mut argmax = vec![0; n];
            crossentropy_forward(&logits, &mut eval_losses, &targets, Some(&mut argmax), n, v);
            (bits(&grad), bits(&losses), bits(&eval_losses), argmax)
        });
    }

    #[test]
    fn argmax_takes_the_first_maximum() {
        let logits = vec![1.0, 3.0, 3.0, 0.0, 5.0, 5.0];
        let mut losses = vec![0.0; 2];
        let mut am = vec![0; 2];
        crossentropy_forward(&logits, &mut losses, &[0, 1], Some(&mut am), 2, 3);
        assert_eq!(am, vec![1, 1]);
    }
}
