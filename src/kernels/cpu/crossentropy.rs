//! Fused softmax + cross-entropy over the vocabulary.
//!
//! logits is (N, V), targets is (N) ids < V, losses is (N). With gradients, the
//! logits buffer is overwritten by dlogits = (softmax − onehot(target))·dloss, so
//! the (N, V) probabilities never need a buffer of their own.

use super::math::{exp, simd_fn};
use super::ROWS_PER_TASK;
use rayon::prelude::*;

/// Returns (max, log Σ exp(x − max)) of a row.
#[inline]
fn row_lse(row: &[f32]) -> (f32, f32) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    (max, sum_exp_shifted(row, max).ln())
}

simd_fn! {
    /// Σ e^(x − shift), exponentials formed in blocks so they vectorize while
    /// the sum itself stays in index order.
    fn sum_exp_shifted(row: &[f32], shift: f32) -> f32 {
        let mut buf = [0.0f32; 64];
        let mut sum = 0.0f32;
        for chunk in row.chunks(64) {
            for (b, &x) in buf.iter_mut().zip(chunk) {
                *b = exp(x - shift);
            }
            for &b in &buf[..chunk.len()] {
                sum += b;
            }
        }
        sum
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
                let lse = max + log_sum;
                losses[i] = lse - row[target];
                softmax_times(row, lse, dloss);
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
        *loss = max + log_sum - row[targets[i] as usize];
    });
    if let Some(argmax) = argmax {
        assert_eq!(argmax.len(), n);
        argmax.par_iter_mut().enumerate().for_each(|(i, a)| {
            let row = &logits[i * v..(i + 1) * v];
            // First index of the maximum, so ties resolve the same way everywhere.
            let mut best = 0;
            for j in 1..v {
                if row[j] > row[best] {
                    best = j;
                }
            }
            *a = best as u32;
        });
    }
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
