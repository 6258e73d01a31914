//! SwiGLU, Llama's MLP activation: out = silu(gate) · up, silu(x) = x·σ(x).
//!
//! gate_up is (N, 2·H): each row holds gate (columns 0..H, from gate_proj)
//! then up (columns H..2H, from up_proj), so one matrix product makes both;
//! out is (N, H). Backward writes dgate_up (N, 2H) from dout (N, H).

use super::ROWS_PER_TASK;
use rayon::prelude::*;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn swiglu_forward(out: &mut [f32], gate_up: &[f32], n: usize, h: usize) {
    assert!(out.len() == n * h && gate_up.len() == 2 * n * h);
    out.par_chunks_mut(h * ROWS_PER_TASK).enumerate().for_each(|(task, out)| {
        for (i, o) in out.chunks_mut(h).enumerate() {
            let row = &gate_up[(task * ROWS_PER_TASK + i) * 2 * h..(task * ROWS_PER_TASK + i + 1) * 2 * h];
            let (gate, up) = row.split_at(h);
            for j in 0..h {
                let g = gate[j];
                o[j] = g * sigmoid(g) * up[j];
            }
        }
    });
}

/// dgate_up (N, 2H) += ∂L/∂(gate, up) given dout (N, H).
pub fn swiglu_backward(dgate_up: &mut [f32], dout: &[f32], gate_up: &[f32], n: usize, h: usize) {
    assert!(dgate_up.len() == 2 * n * h && gate_up.len() == 2 * n * h && dout.len() == n * h);
    dgate_up.par_chunks_mut(2 * h * ROWS_PER_TASK).enumerate().for_each(|(task, rows)| {
        for (i, d) in rows.chunks_mut(2 * h).enumerate() {
            let r = task * ROWS_PER_TASK + i;
            let (gate, up) = gate_up[r * 2 * h..(r + 1) * 2 * h].split_at(h);
            let dy = &dout[r * h..(r + 1) * h];
            let (dgate, dup) = d.split_at_mut(h);
            for j in 0..h {
                let (g, s) = (gate[j], sigmoid(gate[j]));
                let silu = g * s;
                dup[j] += dy[j] * silu;
                dgate[j] += dy[j] * up[j] * (s * (1.0 + g * (1.0 - s)));
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    fn reference(gate_up: &[f64], n: usize, h: usize) -> Vec<f64> {
        let mut out = vec![0.0; n * h];
        for r in 0..n {
            for j in 0..h {
                let (g, u) = (gate_up[r * 2 * h + j], gate_up[r * 2 * h + h + j]);
                out[r * h + j] = g / (1.0 + (-g).exp()) * u;
            }
        }
        out
    }

    #[test]
    fn forward_matches_reference() {
        let (n, h) = (ROWS_PER_TASK + 5, 24);
        let gu = randn(2 * n * h, 1);
        let mut out = vec![0.0; n * h];
        with_threads(2, || swiglu_forward(&mut out, &gu, n, h));
        assert_close(&out, &reference(&to64(&gu), n, h), 1e-6);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, h) = (ROWS_PER_TASK + 3, 10);
        let g = randn(n * h, 3);
        let params = vec![randn(2 * n * h, 1)];
        let loss = |p: &[Vec<f64>]| reference(&p[0], n, h).iter().zip(&g).map(|(o, &g)| o * g as f64).sum();
        let mut d = vec![0.0; 2 * n * h];
        with_threads(2, || swiglu_backward(&mut d, &g, &params[0], n, h));
        check_grads(&params, &[d], loss, 1e-4);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (n, h) = (100, 48);
        let (gu, g) = (randn(2 * n * h, 1), randn(n * h, 2));
        assert_thread_count_independent(|| {
            let mut out = vec![0.0; n * h];
            swiglu_forward(&mut out, &gu, n, h);
            let mut d = vec![0.0; 2 * n * h];
            swiglu_backward(&mut d, &g, &gu, n, h);
            (bits(&out), bits(&d))
        });
    }
}
