//! Token plus learned position embedding (GPT-2), and the token embedding
//! alone (families whose positions enter inside attention, as Llama's RoPE).
//!
//! tokens is (B, T) ids < V; wte is (V, C); wpe is (maxT, C); out is (B, T, C).

use super::{COLS_PER_TASK, ROWS_PER_TASK};
use rayon::prelude::*;

pub fn embedding_forward(out: &mut [f32], tokens: &[u32], wte: &[f32], wpe: &[f32], t: usize, c: usize) {
    assert_eq!(out.len(), tokens.len() * c);
    assert!(tokens.len().is_multiple_of(t) && wpe.len() >= t * c);
    out.par_chunks_mut(c * ROWS_PER_TASK).enumerate().for_each(|(task, rows)| {
        for (i, o) in rows.chunks_mut(c).enumerate() {
            let r = task * ROWS_PER_TASK + i;
            let tok = tokens[r] as usize;
            let pos = r % t;
            let e = &wte[tok * c..(tok + 1) * c];
            let p = &wpe[pos * c..(pos + 1) * c];
            for j in 0..c {
                o[j] = e[j] + p[j];
            }
        }
    });
}

/// dwte[token] += dout; dwpe[t] += dout, summed over (b, t) in order. Tasks own
/// column ranges, so rows sharing a token never race and the order is fixed.
pub fn embedding_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    t: usize,
    c: usize,
) {
    assert_eq!(dout.len(), tokens.len() * c);
    let v = dwte.len() / c;
    let dwte_ptr = super::SendPtr(dwte.as_mut_ptr());
    let tasks = c.div_ceil(COLS_PER_TASK);
    let dwpe_ptr = super::SendPtr(dwpe.as_mut_ptr());
    (0..tasks).into_par_iter().for_each(|task| {
        let c0 = task * COLS_PER_TASK;
        let w = COLS_PER_TASK.min(c - c0);
        for (r, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            assert!(tok < v);
            let pos = r % t;
            let d = &dout[r * c + c0..r * c + c0 + w];
            // SAFETY: this task alone touches columns c0..c0+w of dwte and dwpe.
            let (e, p) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dwte_ptr.get().add(tok * c + c0), w),
                    std::slice::from_raw_parts_mut(dwpe_ptr.get().add(pos * c + c0), w),
                )
            };
            for j in 0..w {
                e[j] += d[j];
                p[j] += d[j];
            }
        }
    });
}

/// out[r] = wte[tokens[r]]: the token embedding without positions.
pub fn token_embedding_forward(out: &mut [f32], tokens: &[u32], wte: &[f32], c: usize) {
    assert_eq!(out.len(), tokens.len() * c);
    out.par_chunks_mut(c * ROWS_PER_TASK).enumerate().for_each(|(task, rows)| {
        for (i, o) in rows.chunks_mut(c).enumerate() {
            let tok = tokens[task * ROWS_PER_TASK + i] as usize;
            o.copy_from_slice(&wte[tok * c..(tok + 1) * c]);
        }
    });
}

/// dwte[token] += dout, summed over rows in order; tasks own column ranges
/// (as in [`embedding_backward`]), so the order is fixed whatever the threads.
pub fn token_embedding_backward(dwte: &mut [f32], dout: &[f32], tokens: &[u32], c: usize) {
    assert_eq!(dout.len(), tokens.len() * c);
    let v = dwte.len() / c;
    let dwte_ptr = super::SendPtr(dwte.as_mut_ptr());
    (0..c.div_ceil(COLS_PER_TASK)).into_par_iter().for_each(|task| {
        let c0 = task * COLS_PER_TASK;
        let w = COLS_PER_TASK.min(c - c0);
        for (r, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            assert!(tok < v);
            let d = &dout[r * c + c0..r * c + c0 + w];
            // SAFETY: this task alone touches columns c0..c0+w of dwte.
            let e = unsafe { std::slice::from_raw_parts_mut(dwte_ptr.get().add(tok * c + c0), w) };
            for j in 0..w {
                e[j] += d[j];
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    #[test]
    fn forward_and_backward_match_reference() {
        let (b, t, c, v) = (3, 7, 70, 11);
        let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 7 + 3) % v) as u32).collect();
        let (wte, wpe) = (randn(v * c, 1), randn(t * c, 2));
        let mut out = vec![0.0; b * t * c];
        with_threads(2, || embedding_forward(&mut out, &tokens, &wte, &wpe, t, c));
        for r in 0..b * t {
            for j in 0..c {
                assert_eq!(out[r * c + j], wte[tokens[r] as usize * c + j] + wpe[(r % t) * c + j]);
            }
        }
        let g = randn(b * t * c, 3);
        let loss = |p: &[Vec<f64>]| {
            let mut s = 0.0;
            for r in 0..b * t {
                for j in 0..c {
                    s += (p[0][tokens[r] as usize * c + j] + p[1][(r % t) * c + j]) * g[r * c + j] as f64;
                }
            }
            s
        };
        let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
        with_threads(2, || embedding_backward(&mut dwte, &mut dwpe, &g, &tokens, t, c));
        check_grads(&[wte, wpe], &[dwte, dwpe], loss, 1e-4);
    }

    /// 39 rows (ROWS_PER_TASK splits forward) and 135 columns (COLS_PER_TASK
    /// splits backward): both cross task boundaries, with repeated tokens.
    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (b, t, v) = (3, 13, 7);
        let c = 2 * COLS_PER_TASK + 7;
        assert!(b * t > 2 * ROWS_PER_TASK);
        let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 5 + 1) % v) as u32).collect();
        let (wte, wpe, g) = (randn(v * c, 4), randn(t * c, 5), randn(b * t * c, 6));
        assert_thread_count_independent(|| {
            let mut out = vec![0.0; b * t * c];
            embedding_forward(&mut out, &tokens, &wte, &wpe, t, c);
            let (mut dwte, mut dwpe) = (randn(v * c, 7), randn(t * c, 8));
            embedding_backward(&mut dwte, &mut dwpe, &g, &tokens, t, c);
            (bits(&out), bits(&dwte), bits(&dwpe))
        });
    }

    #[test]
    fn token_embedding_matches_reference_and_thread_count() {
        let (n, v) = (41, 7);
        let c = 2 * COLS_PER_TASK + 3;
        let tokens: Vec<u32> = (0..n).map(|i| ((i * 5 + 2) % v) as u32).collect();
        let (wte, g) = (randn(v * c, 9), randn(n * c, 10));
        let mut out = vec![0.0; n * c];
        with_threads(2, || token_embedding_forward(&mut out, &tokens, &wte, c));
        for r in 0..n {
            assert_eq!(out[r * c..(r + 1) * c], wte[tokens[r] as usize * c..][..c]);
        }
        let loss = |p: &[Vec<f64>]| {
            (0..n)
                .map(|r| (0..c).map(|j| p[0][tokens[r] as usize * c + j] * g[r * c + j] as f64).sum::<f64>())
                .sum()
        };
        let mut dwte = vec![0.0; v * c];
        with_threads(2, || token_embedding_backward(&mut dwte, &g, &tokens, c));
        check_grads(std::slice::from_ref(&wte), &[dwte], loss, 1e-4);
        assert_thread_count_independent(|| {
            let mut d = randn(v * c, 11);
            token_embedding_backward(&mut d, &g, &tokens, c);
            bits(&d)
        });
    }
}
