//! The residual connection: out = a + b, flat (N·C) slices.

use rayon::prelude::*;

const CHUNK: usize = 4096;

pub fn residual_forward(out: &mut [f32], a: &[f32], b: &[f32]) {
    assert!(out.len() == a.len() && out.len() == b.len());
    out.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK)).zip(b.par_chunks(CHUNK)).for_each(|((o, a), b)| {
        for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
            *o = a + b;
        }
    });
}

/// acc += dout: the backward of a residual is the identity into both branches.
pub fn accumulate(acc: &mut [f32], dout: &[f32]) {
    assert_eq!(acc.len(), dout.len());
    acc.par_chunks_mut(CHUNK).zip(dout.par_chunks(CHUNK)).for_each(|(a, d)| {
        for (a, &d) in a.iter_mut().zip(d) {
            *a += d;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    #[test]
    fn forward_adds_and_backward_passes_gradient_to_both_branches() {
        let (a, b) = (randn(5000, 1), randn(5000, 2));
        let mut out = vec![0.0; 5000];
        residual_forward(&mut out, &a, &b);
        assert!(out.iter().zip(a.iter().zip(&b)).all(|(o, (a, b))| *o == a + b));
        let g = randn(5000, 3);
        let (mut da, mut db) = (vec![0.0; 5000], vec![0.0; 5000]);
        accumulate(&mut da, &g);
        accumulate(&mut db, &g);
        let (a, b, g) = (a[..50].to_vec(), b[..50].to_vec(), g[..50].to_vec());
        let loss =
            |p: &[Vec<f64>]| p[0].iter().zip(&p[1]).zip(&g).map(|((a, b), &g)| (a + b) * g as f64).sum();
        check_grads(&[a, b], &[da[..50].to_vec(), db[..50].to_vec()], loss, 1e-4);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let n = 3 * CHUNK + 123;
        let (a, b) = (randn(n, 4), randn(n, 5));
        assert_thread_count_independent(|| {
            let mut out = vec![0.0; n];
            residual_forward(&mut out, &a, &b);
            let mut acc = randn(n, 6);
            accumulate(&mut acc, &b);
            (bits(&out), bits(&acc))
        });
    }
}
