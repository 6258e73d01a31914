//! Rotary position embeddings (RoPE), Llama's "rotate half" form as Hugging
//! Face applies it: for a head vector x of size HS = 2·H and position p,
//!   out[j]     = x[j]·cos(p·f_j) − x[j+H]·sin(p·f_j)
//!   out[j + H] = x[j+H]·cos(p·f_j) + x[j]·sin(p·f_j),     j < H,
//! with f_j = 1 / theta^(2j/HS). It is a rotation of each (j, j+H) pair, so
//! backward is the rotation by −p·f_j and both run in place.
//!
//! x is (N, W) row-major with N = B·T; the rotated heads sit at columns
//! [col0, col0 + heads·HS) of each row, and a row's position is row mod T.
//! The table is cos and sin, each (T, H).

use super::ROWS_PER_TASK;
use rayon::prelude::*;

/// cos and sin of p·f_j for p < T and j < HS/2, computed in f32 in Hugging
/// Face's order (the frequency as 1/theta^(2j/HS), then p·f in f32, then
/// cos and sin), so the table matches transformers' to f32's rounding.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub t: usize,
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// Llama's default inverse frequencies: 1 / theta^(2j/HS), j < HS/2.
pub fn inv_freq(head_size: usize, theta: f32) -> Vec<f32> {
    assert!(head_size.is_multiple_of(2) && head_size > 0, "RoPE needs an even head size, got {head_size}");
    (0..head_size / 2).map(|j| 1.0 / theta.powf((2 * j) as f32 / head_size as f32)).collect()
}

impl RopeTable {
    pub fn new(t: usize, inv_freq: &[f32]) -> RopeTable {
        let half = inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(t * half), Vec::with_capacity(t * half));
        for p in 0..t {
            for &f in inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeTable { t, half, cos, sin }
    }

    /// cos and sin times `s` (YaRN's attention factor, which transformers
    /// applies to the table rather than to the scores), each rounded once.
    pub fn scaled(mut self, s: f32) -> RopeTable {
        if s != 1.0 {
            self.cos.iter_mut().chain(self.sin.iter_mut()).for_each(|x| *x *= s);
        }
        self
    }
}

/// x (N, W) ← rotated by +p·f (forward) or −p·f (`inverse`, the backward of
/// forward applied to a gradient), in place.
#[allow(clippy::too_many_arguments)]
fn rotate(x: &mut [f32], table: &RopeTable, n: usize, w: usize, col0: usize, heads: usize, inverse: bool) {
    let (half, hs) = (table.half, 2 * table.half);
    assert!(
        x.len() == n * w && col0 + heads * hs <= w,
        "RoPE: columns {col0}+{heads}×{hs} past a row of {w}"
    );
    assert!(table.t > 0 && table.cos.len() == table.t * half);
    let sign = if inverse { -1.0f32 } else { 1.0 };
    x.par_chunks_mut(w * ROWS_PER_TASK).enumerate().for_each(|(task, rows)| {
        for (i, row) in rows.chunks_mut(w).enumerate() {
            let p = (task * ROWS_PER_TASK + i) % table.t;
            let (cos, sin) = (&table.cos[p * half..(p + 1) * half], &table.sin[p * half..(p + 1) * half]);
            for h in 0..heads {
                let head = &mut row[col0 + h * hs..col0 + (h + 1) * hs];
                let (lo, hi) = head.split_at_mut(half);
                for j in 0..half {
                    let (a, b, s) = (lo[j], hi[j], sign * sin[j]);
                    lo[j] = a * cos[j] + (-b) * s;
                    hi[j] = b * cos[j] + a * s;
                }
            }
        }
    });
}

/// Applies RoPE to `heads` head vectors of each row of x (N, W), in place.
pub fn rope_forward(x: &mut [f32], table: &RopeTable, n: usize, w: usize, col0: usize, heads: usize) {
    rotate(x, table, n, w, col0, heads, false);
}

/// dx from dout, in place: the transpose of forward's rotation. Unlike the
/// other backward kernels this overwrites (the gradient flows through a
/// rotation and nothing accumulates into a parameter).
pub fn rope_backward(dx: &mut [f32], table: &RopeTable, n: usize, w: usize, col0: usize, heads: usize) {
    rotate(dx, table, n, w, col0, heads, true);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    /// Straight from the formula in f64, rotate_half style.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        x: &[f64],
        t: usize,
        hs: usize,
        theta: f64,
        n: usize,
        w: usize,
        col0: usize,
        heads: usize,
    ) -> Vec<f64> {
        let half = hs / 2;
        let mut out = x.to_vec();
        for r in 0..n {
            let p = (r % t) as f64;
            for h in 0..heads {
                let base = r * w + col0 + h * hs;
                for j in 0..half {
                    let f = 1.0 / theta.powf((2 * j) as f64 / hs as f64);
                    let (c, s) = ((p * f).cos(), (p * f).sin());
                    let (a, b) = (x[base + j], x[base + j + half]);
                    out[base + j] = a * c - b * s;
                    out[base + j + half] = b * c + a * s;
                }
            }
        }
        out
    }

    #[test]
    fn forward_matches_reference() {
        let (t, hs, heads, w, col0) = (13, 16, 3, 64, 8);
        let n = 2 * t;
        let x = randn(n * w, 1);
        let table = RopeTable::new(t, &inv_freq(hs, 10_000.0));
        let mut got = x.clone();
        with_threads(2, || rope_forward(&mut got, &table, n, w, col0, heads));
        let want = reference(&to64(&x), t, hs, 10_000.0, n, w, col0, heads);
        assert_close(&got, &want, 1e-5);
        // Columns outside the heads are left as they were.
        for r in 0..n {
            assert_eq!(bits(&got[r * w..r * w + col0]), bits(&x[r * w..r * w + col0]));
            assert_eq!(
                bits(&got[r * w + col0 + heads * hs..(r + 1) * w]),
                bits(&x[r * w + col0 + heads * hs..(r + 1) * w])
            );
        }
    }

    #[test]
    fn position_zero_is_the_identity() {
        let table = RopeTable::new(1, &inv_freq(8, 500_000.0));
        let x = randn(3 * 8, 2);
        let mut y = x.clone();
        rope_forward(&mut y, &table, 3, 8, 0, 1);
        assert_eq!(bits(&y), bits(&x));
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (t, hs, heads, w, col0) = (7, 8, 2, 20, 2);
        let n = 2 * t + 3;
        let g = randn(n * w, 9);
        let params = vec![randn(n * w, 1)];
        let loss = |p: &[Vec<f64>]| {
            reference(&p[0], t, hs, 10_000.0, n, w, col0, heads)
                .iter()
                .zip(&g)
                .map(|(o, &g)| o * g as f64)
                .sum()
        };
        let table = RopeTable::new(t, &inv_freq(hs, 10_000.0));
        let mut dx = g.clone();
        rope_backward(&mut dx, &table, n, w, col0, heads);
        check_grads(&params, &[dx], loss, 1e-4);
    }

    #[test]
    fn backward_undoes_forward_up_to_rounding() {
        let (t, hs) = (33, 64);
        let table = RopeTable::new(t, &inv_freq(hs, 10_000.0));
        let x = randn(t * hs, 4);
        let mut y = x.clone();
        rope_forward(&mut y, &table, t, hs, 0, 1);
        rope_backward(&mut y, &table, t, hs, 0, 1);
        assert_close(&y, &to64(&x), 1e-6);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (t, hs, heads) = (40, 32, 4);
        let n = 3 * t;
        let table = RopeTable::new(t, &inv_freq(hs, 10_000.0));
        let x = randn(n * heads * hs, 5);
        assert_thread_count_independent(|| {
            let mut y = x.clone();
            rope_forward(&mut y, &table, n, heads * hs, 0, heads);
            rope_backward(&mut y, &table, n, heads * hs, 0, heads);
            bits(&y)
        });
    }
}
