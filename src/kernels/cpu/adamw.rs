//! AdamW with PyTorch's semantics (torch.optim.AdamW, single-tensor path), and
//! the squared norm used for global-norm clipping.
//!
//! param, grad, m and v are flat slices of one tensor, all the same length.

use rayon::prelude::*;

const CHUNK: usize = 4096;

#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// 1-based step count, for bias correction.
    pub step: u64,
}

/// One AdamW update of one tensor. `grad_scale` is the clip coefficient (1 when
/// not clipping); it multiplies the gradient first, as clip_grad_norm_ does in place.
/// `decay` is false for biases and LayerNorm parameters.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamW,
    decay: bool,
    grad_scale: f32,
) {
    assert!(grad.len() == param.len() && m.len() == param.len() && v.len() == param.len());
    assert!(hp.step >= 1);
    // Scalars as PyTorch forms them: Python floats (f64), rounded to f32 where used.
    let decay_factor = if decay { (1.0 - hp.lr * hp.weight_decay) as f32 } else { 1.0 };
    let one_minus_b1 = (1.0 - hp.beta1) as f32;
    let b2 = hp.beta2 as f32;
    let one_minus_b2 = (1.0 - hp.beta2) as f32;
    let bc1 = 1.0 - hp.beta1.powi(hp.step as i32);
    let bc2 = 1.0 - hp.beta2.powi(hp.step as i32);
    let step_size = (hp.lr / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let eps = hp.eps as f32;
    param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| {
            for i in 0..p.len() {
                let g = if grad_scale == 1.0 { g[i] } else { g[i] * grad_scale };
                p[i] *= decay_factor;
                m[i] += one_minus_b1 * (g - m[i]);
                v[i] = v[i] * b2 + one_minus_b2 * g * g;
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                p[i] -= step_size * (m[i] / denom);
            }
        });
}

/// Σ x² in f64, summed over fixed chunks in order so the thread count never
/// changes the result.
pub fn sum_squares(x: &[f32]) -> f64 {
    // Chunks are summed in parallel and their partials added in chunk order;
    // a fixed-size stack buffer of partials keeps this free of allocation.
    const GROUP: usize = 64;
    let mut total = 0.0f64;
    for group in x.chunks(CHUNK * GROUP) {
        let mut partials = [0.0f64; GROUP];
        partials.par_iter_mut().zip(group.par_chunks(CHUNK)).for_each(|(p, c)| {
            *p = c.iter().map(|&v| v as f64 * v as f64).sum::<f64>();
        });
        total += partials.iter().sum::<f64>();
    }
    total
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    /// The update written out in f64, straight from the AdamW paper with
    /// PyTorch's decoupled decay and bias correction.
    #[test]
    fn update_matches_reference_over_steps() {
        let n = 5000;
        let mut p = randn(n, 1);
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let (mut m64, mut v64) = (vec![0.0f64; n], vec![0.0f64; n]);
        for step in 1..=5u64 {
            let g = randn(n, 10 + step);
            let hp = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step };
            adamw_update(&mut p, &g, &mut m, &mut v, &hp, true, 0.5);
            for i in 0..n {
                let gi = g[i] as f64 * 0.5;
                p64[i] *= 1.0 - hp.lr * hp.weight_decay;
                m64[i] = 0.9 * m64[i] + 0.1 * gi;
                v64[i] = 0.95 * v64[i] + 0.05 * gi * gi;
                let mhat = m64[i] / (1.0 - 0.9f64.powi(step as i32));
                let vhat = v64[i] / (1.0 - 0.95f64.powi(step as i32));
                p64[i] -= hp.lr * mhat / (vhat.sqrt() + hp.eps);
            }
        }
        assert_close(&p, &p64, 1e-5);
    }

    #[test]
    fn update_does_not_depend_on_thread_count() {
        let n = 3 * CHUNK + 77;
        let (p0, g) = (randn(n, 1), randn(n, 2));
        for decay in [true, false] {
            assert_thread_count_independent(|| {
                let (mut p, mut m, mut v) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
                for step in 1..=3 {
                    let hp = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step };
                    adamw_update(&mut p, &g, &mut m, &mut v, &hp, decay, 0.7);
                }
                (bits(&p), bits(&m), bits(&v))
            });
        }
    }

    #[test]
    fn sum_squares_is_exact_enough_and_thread_independent() {
        let x = randn(100_003, 4);
        let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        let one = with_threads(1, || sum_squares(&x));
        assert_eq!(one, with_threads(2, || sum_squares(&x)));
        assert!((one - want).abs() / want < 1e-12);
    }
}
