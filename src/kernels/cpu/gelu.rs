//! GELU in GPT-2's tanh form: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
//!
//! inp, out, dinp and dout are flat (N·4C) slices.

use super::math::{simd_fn, tanh};
use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const CHUNK: usize = 4096;

pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    assert_eq!(out.len(), inp.len());
    out.par_chunks_mut(CHUNK).zip(inp.par_chunks(CHUNK)).for_each(|(o, x)| forward_chunk(o, x));
}

simd_fn! {
    fn forward_chunk(out: &mut [f32], inp: &[f32]) {
        for (o, &x) in out.iter_mut().zip(inp) {
            let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
            *o = 0.5 * x * (1.0 + tanh(u));
        }
    }
}

simd_fn! {
    fn backward_chunk_overwrite(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
        for ((dx, &x), &dy) in dinp.iter_mut().zip(inp).zip(dout) {
            let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
            let th = tanh(u);
            let sech2 = 1.0 - th * th;
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
            *dx = (0.5 * (1.0 + th) + 0.5 * x * sech2 * du) * dy;
        }
    }
}

simd_fn! {
    fn backward_chunk(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
        for ((dx, &x), &dy) in dinp.iter_mut().zip(inp).zip(dout) {
            let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
            let th = tanh(u);
            let sech2 = 1.0 - th * th;
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
            *dx += (0.5 * (1.0 + th) + 0.5 * x * sech2 * du) * dy;
        }
    }
}

/// dinp += GELU'(inp) · dout.
pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    gelu_backward_into(dinp, inp, dout, true)
}

/// dinp (+)= GELU'(inp) · dout; with `accumulate` false dinp is overwritten.
pub fn gelu_backward_into(dinp: &mut [f32], inp: &[f32], dout: &[f32], accumulate: bool) {
    assert!(dinp.len() == inp.len() && dout.len() == inp.len());
    dinp.par_chunks_mut(CHUNK).zip(inp.par_chunks(CHUNK)).zip(dout.par_chunks(CHUNK)).for_each(
        |((dx, x), dy)| {
            if accumulate {
                backward_chunk(dx, x, dy)
            } else {
                backward_chunk_overwrite(dx, x, dy)
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    fn reference(x: f64) -> f64 {
        let s = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (s * (x + 0.044715 * x * x * x)).tanh())
    }

    #[test]
    fn forward_matches_reference() {
        let x: Vec<f32> = randn(10_001, 1).iter().map(|v| v * 3.0).collect();
        let mut out = vec![0.0; x.len()];
        with_threads(2, || gelu_forward(&mut out, &x));
        let want: Vec<f64> = x.iter().map(|&v| reference(v as f64)).collect();
        assert_close(&out, &want, 1e-6);
    }

    #[test]
    fn overwriting_backward_equals_accumulating_into_zeros() {
        let (x, g) = (randn(9000, 5), randn(9000, 6));
        let mut acc = vec![0.0; 9000];
        gelu_backward(&mut acc, &x, &g);
        let mut over = vec![7.0; 9000];
        gelu_backward_into(&mut over, &x, &g, false);
        assert_eq!(acc, over);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let n = 3 * CHUNK + 123;
        let (x, g) = (randn(n, 7), randn(n, 8));
        assert_thread_count_independent(|| {
            let mut out = vec![0.0; n];
            gelu_forward(&mut out, &x);
            let mut acc = randn(n, 9);
            gelu_backward(&mut acc, &x, &g);
            let mut over = vec![0.0; n];
            gelu_backward_into(&mut over, &x, &g, false);
            (bits(&out), bits(&acc), bits(&over))
        });
    }

    #[test]
    fn backward_matches_finite_differences() {
        let x = randn(257, 3);
        let g = randn(257, 4);
        let loss = |p: &[Vec<f64>]| p[0].iter().zip(&g).map(|(&x, &g)| reference(x) * g as f64).sum();
        let mut dx = vec![0.0; x.len()];
        with_threads(2, || gelu_backward(&mut dx, &x, &g));
        check_grads(&[x], &[dx], loss, 1e-4);
    }
}
