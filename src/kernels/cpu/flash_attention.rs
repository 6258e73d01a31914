//! The CPU twin of kernels/flash_attention.cu: causal attention computed the
//! way the tensor-core kernels compute it, so their results can be checked
//! against something that follows the same steps. Not used for training
//! (kernels/cpu/attention.rs is the CPU backend's attention); plain loops in
//! f64, one query or key at a time.
//!
//! qkv is (B, T, 3C), out (B, T, C), lse (B, NH, T), dqkv (B, T, 3C); HS = C / NH.
//!
//! Forward walks keys in tiles of `KEY_TILE` with an online softmax: per query
//! a running maximum m, a running sum l of exp(s − m) and an accumulator,
//! rescaled by exp(m_old − m_new) when a tile raises the maximum; lse = m + ln l.
//! Backward recomputes P = exp(s − lse) and keeps dq apart from dk, dv: dq per
//! query over its keys, dk and dv per key over its queries (two kernels on the
//! GPU, so no gradient is summed by atomics). With `Rounding::Bf16`, P and dS
//! are rounded to bf16 before they multiply V, dO, K or Q, as the kernels feed
//! them to `mma.sync`; sums and the softmax stay in high precision.

/// Keys per tile in forward (the kernel's key tile).
pub const KEY_TILE: usize = 64;

/// How P and dS enter the products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Unrounded: the exact blocked algorithm.
    None,
    /// Rounded to bf16 (to nearest even), as the tensor-core kernels do.
    Bf16,
}

impl Rounding {
    fn apply(self, x: f64) -> f64 {
        match self {
            Rounding::None => x,
            Rounding::Bf16 => bf16_round(x as f32) as f64,
        }
    }
}

/// f32 → bf16 → f32, round to nearest even (kernels/common.cuh `f32_to_bf16`).
pub fn bf16_round(x: f32) -> f32 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return f32::from_bits((u | 0x0040_0000) & 0xffff_0000);
    }
    f32::from_bits(u.wrapping_add(0x7fff + ((u >> 16) & 1)) & 0xffff_0000)
}

/// Views of one (batch, head): row i's q, k, v and out.
struct Head<'a> {
    qkv: &'a [f32],
    b: usize,
    h: usize,
    t: usize,
    c: usize,
    hs: usize,
}

impl Head<'_> {
    fn q(&self, i: usize) -> &[f32] {
        &self.qkv[(self.b * self.t + i) * 3 * self.c + self.h * self.hs..][..self.hs]
    }
    fn k(&self, j: usize) -> &[f32] {
        &self.qkv[(self.b * self.t + j) * 3 * self.c + self.c + self.h * self.hs..][..self.hs]
    }
    fn v(&self, j: usize) -> &[f32] {
        &self.qkv[(self.b * self.t + j) * 3 * self.c + 2 * self.c + self.h * self.hs..][..self.hs]
    }
    fn row(&self, i: usize) -> usize {
        (self.b * self.t + i) * self.c + self.h * self.hs
    }
    fn lse_at(&self, i: usize, nh: usize) -> usize {
        (self.b * nh + self.h) * self.t + i
    }
    /// The scaled score of query i against key j.
    fn score(&self, i: usize, j: usize) -> f64 {
        let dot: f64 = self.q(i).iter().zip(self.k(j)).map(|(&a, &b)| a as f64 * b as f64).sum();
        dot / (self.hs as f64).sqrt()
    }
}

fn heads(b: usize, nh: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..b).flat_map(move |bi| (0..nh).map(move |h| (bi, h)))
}

/// out (B, T, C) and lse (B, NH, T) from qkv (B, T, 3C), overwritten.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    rounding: Rounding,
) {
    assert!(nh > 0 && c.is_multiple_of(nh) && qkv.len() == b * t * 3 * c);
    assert!(out.len() == b * t * c && lse.len() == b * nh * t);
    let hs = c / nh;
    for (bi, h) in heads(b, nh) {
        let hd = Head { qkv, b: bi, h, t, c, hs };
        for i in 0..t {
            let (mut m, mut l) = (f64::NEG_INFINITY, 0.0f64);
            let mut acc = vec![0.0f64; hs];
            for k0 in (0..=i).step_by(KEY_TILE) {
                let keys = k0..(k0 + KEY_TILE).min(i + 1);
                let s: Vec<f64> = keys.clone().map(|j| hd.score(i, j)).collect();
                let m_new = s.iter().fold(m, |a, &x| a.max(x));
                let corr = (m - m_new).exp();
                l *= corr;
                acc.iter_mut().for_each(|a| *a *= corr);
                for (j, sj) in keys.zip(&s) {
                    let p = (sj - m_new).exp();
                    l += p;
                    let p = rounding.apply(p);
                    for (a, &v) in acc.iter_mut().zip(hd.v(j)) {
                        *a += p * v as f64;
                    }
                }
                m = m_new;
            }
            let o = &mut out[hd.row(i)..][..hs];
            for (o, a) in o.iter_mut().zip(&acc) {
                *o = (a / l) as f32;
            }
            lse[hd.lse_at(i, nh)] = (m + l.ln()) as f32;
        }
    }
}

/// dqkv (B, T, 3C) overwritten with ∂L/∂qkv, given dout (B, T, C) and
/// forward's out and lse (the kernels write dqkv whole too).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    rounding: Rounding,
) {
    assert!(nh > 0 && c.is_multiple_of(nh) && qkv.len() == b * t * 3 * c && dqkv.len() == qkv.len());
    assert!(dout.len() == b * t * c && out.len() == b * t * c && lse.len() == b * nh * t);
    let hs = c / nh;
    let scale = 1.0 / (hs as f64).sqrt();
    for (bi, h) in heads(b, nh) {
        let hd = Head { qkv, b: bi, h, t, c, hs };
        let dot = |x: &[f32], y: &[f32]| -> f64 { x.iter().zip(y).map(|(&a, &b)| a as f64 * b as f64).sum() };
        // delta_i = Σ_d dO·O: the softmax backward's row term.
        let delta: Vec<f64> =
            (0..t).map(|i| dot(&dout[hd.row(i)..][..hs], &out[hd.row(i)..][..hs])).collect();
        let p = |i: usize, j: usize| (hd.score(i, j) - lse[hd.lse_at(i, nh)] as f64).exp();
        let ds = |i: usize, j: usize| p(i, j) * (dot(&dout[hd.row(i)..][..hs], hd.v(j)) - delta[i]);
        // dq: one query at a time over its keys (the dq kernel).
        for i in 0..t {
            let mut dq = vec![0.0f64; hs];
            for j in 0..=i {
                let d = rounding.apply(ds(i, j));
                for (a, &k) in dq.iter_mut().zip(hd.k(j)) {
                    *a += d * k as f64;
                }
            }
            let at = (bi * t + i) * 3 * c + h * hs;
            for (g, a) in dqkv[at..][..hs].iter_mut().zip(&dq) {
                *g = (a * scale) as f32;
            }
        }
        // dk, dv: one key at a time over the queries that see it (the dk/dv kernel).
        for j in 0..t {
            let (mut dk, mut dv) = (vec![0.0f64; hs], vec![0.0f64; hs]);
            for i in j..t {
                let (pij, dij) = (rounding.apply(p(i, j)), rounding.apply(ds(i, j)));
                for ((dk, dv), (&q, &g)) in
                    dk.iter_mut().zip(dv.iter_mut()).zip(hd.q(i).iter().zip(&dout[hd.row(i)..][..hs]))
                {
                    *dv += pij * g as f64;
                    *dk += dij * q as f64;
                }
            }
            let at = (bi * t + j) * 3 * c + c + h * hs;
            for (g, a) in dqkv[at..][..hs].iter_mut().zip(&dk) {
                *g = (a * scale) as f32;
            }
            for (g, a) in dqkv[at + c..][..hs].iter_mut().zip(&dv) {
                *g = *a as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::attention;
    use super::super::testutil::*;
    use super::*;

    fn cpu_attention(qkv: &[f32], b: usize, t: usize, c: usize, nh: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
        let mut scratch = vec![0.0; attention::scratch_len(b, nh, t)];
        with_threads(1, || attention::attention_forward(&mut out, &mut lse, &mut scratch, qkv, b, t, c, nh));
        (out, lse)
    }

    #[test]
    fn forward_matches_the_cpu_attention_across_key_tiles_for_head_sizes_64_and_128() {
        // T spans three key tiles, the last one partial.
        for (c, nh) in [(128, 2), (256, 2)] {
            let (b, t) = (1, 2 * KEY_TILE + 9);
            let qkv = randn(b * t * 3 * c, 1);
            let (want_out, want_lse) = cpu_attention(&qkv, b, t, c, nh);
            let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
            flash_attention_forward(&mut out, &mut lse, &qkv, b, t, c, nh, Rounding::None);
            assert_close(&out, &to64(&want_out), 1e-5);
            assert_close(&lse, &to64(&want_lse), 1e-6);
        }
    }

    #[test]
    fn rounding_p_to_bf16_stays_within_bf16_precision_of_the_exact_result() {
        let (b, t, c, nh) = (1, KEY_TILE + 20, 128, 2);
        let qkv = randn(b * t * 3 * c, 2);
        let (mut exact, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
        flash_attention_forward(&mut exact, &mut lse, &qkv, b, t, c, nh, Rounding::None);
        let (mut rounded, mut lse_r) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
        flash_attention_forward(&mut rounded, &mut lse_r, &qkv, b, t, c, nh, Rounding::Bf16);
        let e = rel_err(&rounded, &to64(&exact));
        assert!(e > 0.0 && e < 1e-2, "rounding P moved the output by {e:e}");
        // lse is formed before any rounding.
        assert_eq!(bits(&lse), bits(&lse_r));
    }

    #[test]
    fn backward_matches_the_cpu_attention_backward() {
        let (b, t, c, nh) = (2, KEY_TILE + 11, 128, 2);
        let qkv = randn(b * t * 3 * c, 3);
        let dout = randn(b * t * c, 4);
        let (out, lse) = cpu_attention(&qkv, b, t, c, nh);
        let mut want = vec![0.0; qkv.len()];
        let mut scratch = vec![0.0; attention::scratch_len(b, nh, t)];
        with_threads(1, || {
            attention::attention_backward(&mut want, &mut scratch, &dout, &qkv, &out, &lse, b, t, c, nh)
        });
        let mut got = vec![1e9; qkv.len()]; // overwritten whole
        flash_attention_backward(&mut got, &dout, &qkv, &out, &lse, b, t, c, nh, Rounding::None);
        assert_close(&got, &to64(&want), 1e-5);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (b, t, c, nh) = (1, KEY_TILE + 5, 8, 2);
        let g = randn(b * t * c, 5);
        let qkv = randn(b * t * 3 * c, 6);
        // The loss Σ out·g, out from plain attention in f64.
        let loss =
            |p: &[Vec<f64>]| reference(&p[0], b, t, c, nh).iter().zip(&g).map(|(o, &g)| o * g as f64).sum();
        let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
        flash_attention_forward(&mut out, &mut lse, &qkv, b, t, c, nh, Rounding::None);
        let mut dqkv = vec![0.0; qkv.len()];
        flash_attention_backward(&mut dqkv, &g, &qkv, &out, &lse, b, t, c, nh, Rounding::None);
        check_grads(&[qkv], &[dqkv], loss, 1e-4);
    }

    /// Causal attention in f64 on f64 inputs (finite differences need inputs off the f32 grid).
    fn reference(qkv: &[f64], b: usize, t: usize, c: usize, nh: usize) -> Vec<f64> {
        let hs = c / nh;
        let mut out = vec![0.0; b * t * c];
        for (bi, h) in heads(b, nh) {
            let at = |i: usize, part: usize| (bi * t + i) * 3 * c + part * c + h * hs;
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..hs).map(|d| qkv[at(i, 0) + d] * qkv[at(j, 1) + d]).sum::<f64>()
                            / (hs as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (j, sj) in s.iter().enumerate() {
                    for d in 0..hs {
                        out[(bi * t + i) * c + h * hs + d] += (sj - m).exp() / z * qkv[at(j, 2) + d];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn bf16_round_is_round_to_nearest_even() {
        assert_eq!(bf16_round(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(bf16_round(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert!(bf16_round(f32::NAN).is_nan());
        assert_eq!(bf16_round(f32::INFINITY), f32::INFINITY);
    }
}
