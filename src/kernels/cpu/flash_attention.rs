//! The CPU twin of kernels/flash_attention.cu: causal attention computed the
//! way the tensor-core kernels compute it, so their results can be checked
//! against something that follows the same steps. Not used for training
//! (kernels/cpu/attention.rs is the CPU backend's attention); plain loops in
//! f64, one query or key at a time.
//!
//! qkv is (B, T, W), out (B, T, NH·HS), lse (B, NH, T), dqkv (B, T, W), with
//! grouped-query heads laid out as in kernels/cpu/attention.rs (`Heads`).
//!
//! Forward walks keys in tiles of `KEY_TILE` with an online softmax: per query
//! a running maximum m, a running sum l of exp(s − m) and an accumulator,
//! rescaled by exp(m_old − m_new) when a tile raises the maximum; lse = m + ln l.
//! Backward recomputes P = exp(s − lse) and keeps dq apart from dk, dv: dq per
//! query over its keys, dk and dv per key over its queries (two kernels on the
//! GPU, so no gradient is summed by atomics). With `Rounding::Bf16`, P and dS
//! are rounded to bf16 before they multiply V, dO, K or Q, as the kernels feed
//! them to `mma.sync`; sums and the softmax stay in high precision.
//!
//! A sliding window (`Window`, the rule in kernels/cpu/attention.rs) keeps
//! query i to keys (i − W, i]. Forward walks a query's key tiles from the
//! tile holding its first key (tiles stay aligned to `KEY_TILE` multiples, as
//! the kernel's are); backward sums dq over the query's keys and dk, dv over
//! the queries that see the key.

use super::attention::{Heads, Window};

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

/// Views of one (batch, query head): row i's q, its key/value head's k and v,
/// and out, in the grouped-query layout of kernels/cpu/attention.rs.
struct Head<'a> {
    qkv: &'a [f32],
    b: usize,
    h: usize,
    t: usize,
    heads: Heads,
}

impl Head<'_> {
    fn at(&self, i: usize, col: usize) -> usize {
        (self.b * self.t + i) * self.heads.qkv_width() + col
    }
    fn kcol(&self) -> usize {
        (self.heads.nh + self.h / self.heads.group()) * self.heads.hs
    }
    fn vcol(&self) -> usize {
        self.kcol() + self.heads.nkv * self.heads.hs
    }
    fn q(&self, i: usize) -> &[f32] {
        &self.qkv[self.at(i, self.h * self.heads.hs)..][..self.heads.hs]
    }
    fn k(&self, j: usize) -> &[f32] {
        &self.qkv[self.at(j, self.kcol())..][..self.heads.hs]
    }
    fn v(&self, j: usize) -> &[f32] {
        &self.qkv[self.at(j, self.vcol())..][..self.heads.hs]
    }
    fn row(&self, i: usize) -> usize {
        (self.b * self.t + i) * self.heads.out_width() + self.h * self.heads.hs
    }
    fn lse_at(&self, i: usize) -> usize {
        (self.b * self.heads.nh + self.h) * self.t + i
    }
    /// The scaled score of query i against key j.
    fn score(&self, i: usize, j: usize) -> f64 {
        let dot: f64 = self.q(i).iter().zip(self.k(j)).map(|(&a, &b)| a as f64 * b as f64).sum();
        dot / (self.heads.hs as f64).sqrt()
    }
}

fn check(heads: Heads, qkv: usize, out: usize, lse: usize, b: usize, t: usize) {
    assert!(
        heads.nh > 0 && heads.nkv > 0 && heads.nh.is_multiple_of(heads.nkv),
        "{heads:?}: key/value heads must divide query heads"
    );
    assert!(qkv == b * t * heads.qkv_width() && out == b * t * heads.out_width() && lse == b * heads.nh * t);
}

/// out (B, T, NH·HS) and lse (B, NH, T) from qkv (B, T, W), overwritten.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    heads: Heads,
    window: Window,
    rounding: Rounding,
) {
    check(heads, qkv.len(), out.len(), lse.len(), b, t);
    let (hs, window) = (heads.hs, window.over(t));
    for (bi, h) in (0..b).flat_map(|bi| (0..heads.nh).map(move |h| (bi, h))) {
        let hd = Head { qkv, b: bi, h, t, heads };
        for i in 0..t {
            let (mut m, mut l) = (f64::NEG_INFINITY, 0.0f64);
            let mut acc = vec![0.0f64; hs];
            let lo = window.first_key(i);
            for k0 in (lo / KEY_TILE * KEY_TILE..=i).step_by(KEY_TILE) {
                let keys = k0.max(lo)..(k0 + KEY_TILE).min(i + 1);
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
            lse[hd.lse_at(i)] = (m + l.ln()) as f32;
        }
    }
}

/// dqkv (B, T, W) overwritten with ∂L/∂qkv, given dout (B, T, NH·HS) and
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
    heads: Heads,
    window: Window,
    rounding: Rounding,
) {
    check(heads, qkv.len(), out.len(), lse.len(), b, t);
    assert!(dqkv.len() == qkv.len() && dout.len() == out.len());
    let (hs, window) = (heads.hs, window.over(t));
    let scale = 1.0 / (hs as f64).sqrt();
    let dot = |x: &[f32], y: &[f32]| -> f64 { x.iter().zip(y).map(|(&a, &b)| a as f64 * b as f64).sum() };
    for bi in 0..b {
        let hd = |h: usize| Head { qkv, b: bi, h, t, heads };
        // delta_i = Σ_d dO·O per query head: the softmax backward's row term.
        let delta: Vec<Vec<f64>> = (0..heads.nh)
            .map(|h| (0..t).map(|i| dot(&dout[hd(h).row(i)..][..hs], &out[hd(h).row(i)..][..hs])).collect())
            .collect();
        let p = |h: usize, i: usize, j: usize| (hd(h).score(i, j) - lse[hd(h).lse_at(i)] as f64).exp();
        let ds = |h: usize, i: usize, j: usize| {
            p(h, i, j) * (dot(&dout[hd(h).row(i)..][..hs], hd(h).v(j)) - delta[h][i])
        };
        // dq: one query at a time over its keys (the dq kernel).
        for h in 0..heads.nh {
            for i in 0..t {
                let mut dq = vec![0.0f64; hs];
                for j in window.first_key(i)..=i {
                    let d = rounding.apply(ds(h, i, j));
                    for (a, &k) in dq.iter_mut().zip(hd(h).k(j)) {
                        *a += d * k as f64;
                    }
                }
                let at = hd(h).at(i, h * hs);
                for (g, a) in dqkv[at..][..hs].iter_mut().zip(&dq) {
                    *g = (a * scale) as f32;
                }
            }
        }
        // dk, dv: one key of a key/value head at a time, over the queries of
        // each head of its group that see it, heads in order (the dk/dv kernel).
        for g in 0..heads.nkv {
            let group = g * heads.group()..(g + 1) * heads.group();
            for j in 0..t {
                let (mut dk, mut dv) = (vec![0.0f64; hs], vec![0.0f64; hs]);
                for h in group.clone() {
                    for i in j..window.query_end(j, t) {
                        let (pij, dij) = (rounding.apply(p(h, i, j)), rounding.apply(ds(h, i, j)));
                        let dy = &dout[hd(h).row(i)..][..hs];
                        for ((dk, dv), (&q, &gy)) in
                            dk.iter_mut().zip(dv.iter_mut()).zip(hd(h).q(i).iter().zip(dy))
                        {
                            *dv += pij * gy as f64;
                            *dk += dij * q as f64;
                        }
                    }
                }
                let first = hd(group.start);
                let (ka, va) = (first.at(j, first.kcol()), first.at(j, first.vcol()));
                for (g, a) in dqkv[ka..][..hs].iter_mut().zip(&dk) {
                    *g = (a * scale) as f32;
                }
                for (g, a) in dqkv[va..][..hs].iter_mut().zip(&dv) {
                    *g = *a as f32;
                }
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
            flash_attention_forward(
                &mut out,
                &mut lse,
                &qkv,
                b,
                t,
                Heads::mha(c, nh),
                Window::Causal,
                Rounding::None,
            );
            assert_close(&out, &to64(&want_out), 1e-5);
            assert_close(&lse, &to64(&want_lse), 1e-6);
        }
    }

    #[test]
    fn rounding_p_to_bf16_stays_within_bf16_precision_of_the_exact_result() {
        let (b, t, c, nh) = (1, KEY_TILE + 20, 128, 2);
        let qkv = randn(b * t * 3 * c, 2);
        let (mut exact, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
        flash_attention_forward(
            &mut exact,
            &mut lse,
            &qkv,
            b,
            t,
            Heads::mha(c, nh),
            Window::Causal,
            Rounding::None,
        );
        let (mut rounded, mut lse_r) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
        flash_attention_forward(
            &mut rounded,
            &mut lse_r,
            &qkv,
            b,
            t,
            Heads::mha(c, nh),
            Window::Causal,
            Rounding::Bf16,
        );
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
        flash_attention_backward(
            &mut got,
            &dout,
            &qkv,
            &out,
            &lse,
            b,
            t,
            Heads::mha(c, nh),
            Window::Causal,
            Rounding::None,
        );
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
        flash_attention_forward(
            &mut out,
            &mut lse,
            &qkv,
            b,
            t,
            Heads::mha(c, nh),
            Window::Causal,
            Rounding::None,
        );
        let mut dqkv = vec![0.0; qkv.len()];
        flash_attention_backward(
            &mut dqkv,
            &g,
            &qkv,
            &out,
            &lse,
            b,
            t,
            Heads::mha(c, nh),
            Window::Causal,
            Rounding::None,
        );
        check_grads(&[qkv], &[dqkv], loss, 1e-4);
    }

    /// Causal attention in f64 on f64 inputs (finite differences need inputs off the f32 grid).
    fn reference(qkv: &[f64], b: usize, t: usize, c: usize, nh: usize) -> Vec<f64> {
        let hs = c / nh;
        let mut out = vec![0.0; b * t * c];
        for (bi, h) in (0..b).flat_map(|bi| (0..nh).map(move |h| (bi, h))) {
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

    #[test]
    fn sliding_window_twin_matches_the_cpu_attention_forward_and_backward() {
        // T spans three key tiles; windows inside one tile, of one tile, across tiles.
        let (b, t) = (1, 2 * KEY_TILE + 7);
        let heads = Heads { nh: 4, nkv: 2, hs: 16 };
        let qkv = randn(b * t * heads.qkv_width(), 15);
        let dout = randn(b * t * heads.out_width(), 16);
        for w in [5, KEY_TILE, KEY_TILE + 17] {
            let window = Window::Sliding(w);
            let (mut want_out, mut want_lse) = (vec![0.0; dout.len()], vec![0.0; b * heads.nh * t]);
            let mut scratch = vec![0.0; attention::scratch_len(b, heads.nh, t)];
            let mut want = vec![0.0; qkv.len()];
            with_threads(1, || {
                let (o, l) = (&mut want_out, &mut want_lse);
                attention::gqa_window_forward(o, l, &mut scratch, &qkv, b, t, heads, window);
                let (o, l) = (&want_out, &want_lse);
                attention::gqa_window_backward(
                    &mut want,
                    &mut scratch,
                    &dout,
                    &qkv,
                    o,
                    l,
                    b,
                    t,
                    heads,
                    window,
                );
            });
            let (mut out, mut lse) = (vec![0.0; dout.len()], vec![0.0; b * heads.nh * t]);
            flash_attention_forward(&mut out, &mut lse, &qkv, b, t, heads, window, Rounding::None);
            assert_close(&out, &to64(&want_out), 1e-5);
            assert_close(&lse, &to64(&want_lse), 1e-6);
            let mut got = vec![1e9; qkv.len()]; // overwritten whole
            flash_attention_backward(&mut got, &dout, &qkv, &out, &lse, b, t, heads, window, Rounding::None);
            assert_close(&got, &to64(&want), 1e-5);
        }
    }

    #[test]
    fn grouped_query_twin_matches_the_cpu_attention_forward_and_backward() {
        let (b, t) = (2, KEY_TILE + 7);
        let heads = Heads { nh: 4, nkv: 2, hs: 16 };
        let qkv = randn(b * t * heads.qkv_width(), 13);
        let dout = randn(b * t * heads.out_width(), 14);
        let (mut want_out, mut want_lse) = (vec![0.0; dout.len()], vec![0.0; b * heads.nh * t]);
        let mut scratch = vec![0.0; attention::scratch_len(b, heads.nh, t)];
        let mut want = vec![0.0; qkv.len()];
        with_threads(1, || {
            attention::gqa_forward(&mut want_out, &mut want_lse, &mut scratch, &qkv, b, t, heads);
            attention::gqa_backward(&mut want, &mut scratch, &dout, &qkv, &want_out, &want_lse, b, t, heads);
        });
        let (mut out, mut lse) = (vec![0.0; dout.len()], vec![0.0; b * heads.nh * t]);
        flash_attention_forward(&mut out, &mut lse, &qkv, b, t, heads, Window::Causal, Rounding::None);
        assert_close(&out, &to64(&want_out), 1e-5);
        assert_close(&lse, &to64(&want_lse), 1e-6);
        let mut got = vec![1e9; qkv.len()]; // overwritten whole
        flash_attention_backward(
            &mut got,
            &dout,
            &qkv,
            &out,
            &lse,
            b,
            t,
            heads,
            Window::Causal,
            Rounding::None,
        );
        assert_close(&got, &to64(&want), 1e-5);
    }
}
