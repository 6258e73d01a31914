//! The pairwise tree sum that joins a tensor-parallel stage's partial sums
//! (model/block.rs): node[i] += node[i + step] for step 1, 2, 4, …, so the
//! ranks' subtrees join by the tree's upper levels and every rank count gives
//! the bits of one. The CPU twin of kernels/tp.cu (`cuda::tree`).

use super::residual;
use rayon::prelude::*;

/// The pairwise tree over `bufs` (each the same length), into `bufs[0]`.
pub fn tree_sum(bufs: &mut [&mut [f32]]) {
    let mut step = 1;
    while step < bufs.len() {
        let mut i = 0;
        while i + step < bufs.len() {
            let (lo, hi) = bufs.split_at_mut(i + step);
            residual::accumulate(lo[i], hi[0]);
            i += 2 * step;
        }
        step *= 2;
    }
}

/// out = the pairwise tree over `nodes` (a power-of-two count), element by
/// element: the adds of [`tree_sum`] in its order, without its buffers.
pub fn tree_sum_elementwise(out: &mut [f32], nodes: &[&[f32]]) {
    const CHUNK: usize = 4096;
    let t = nodes.len();
    debug_assert!(t.is_power_of_two());
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
        let mut v = vec![0.0f32; t];
        for (e, x) in o.iter_mut().enumerate() {
            let at = c * CHUNK + e;
            for (vj, n) in v.iter_mut().zip(nodes) {
                *vj = n[at];
            }
            let mut step = 1;
            while step < t {
                for i in (0..t).step_by(2 * step) {
                    v[i] += v[i + step];
                }
                step *= 2;
            }
            *x = v[0];
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree_over_ranks_is_the_upper_levels_of_the_tree_over_slices() {
        // A running sum would differ: a tree over 4 nodes is (a+b)+(c+d).
        let v: Vec<Vec<f32>> = [1.0e8f32, 3.0, -1.0e8, 5.0].iter().map(|&x| vec![x]).collect();
        let mut all = v.clone();
        let mut bufs: Vec<&mut [f32]> = all.iter_mut().map(|x| x.as_mut_slice()).collect();
        tree_sum(&mut bufs);
        let running = ((v[0][0] + v[1][0]) + v[2][0]) + v[3][0];
        assert_eq!(all[0][0], (v[0][0] + v[1][0]) + (v[2][0] + v[3][0]));
        assert_ne!(all[0][0], running, "the example must tell the orders apart");
    }

    #[test]
    fn the_elementwise_tree_has_the_bits_of_tree_sum_for_every_power_of_two_count() {
        // Longer than one 4096-element chunk, with magnitudes far apart so any
        // other order of the adds would round differently somewhere.
        let len = 3 * 4096 + 17;
        let mut r = crate::rng::Rng::new(11, crate::rng::Purpose::Test, &[]);
        for count in [1usize, 2, 4, 8, 16] {
            let nodes: Vec<Vec<f32>> = (0..count)
                .map(|j| (0..len).map(|_| (r.normal() * 10f64.powi(j as i32 % 4 * 3)) as f32).collect())
                .collect();
            let mut want = nodes.clone();
            let mut bufs: Vec<&mut [f32]> = want.iter_mut().map(|n| n.as_mut_slice()).collect();
            tree_sum(&mut bufs);
            let views: Vec<&[f32]> = nodes.iter().map(Vec::as_slice).collect();
            let mut got = vec![f32::NAN; len];
            tree_sum_elementwise(&mut got, &views);
            let differs = (0..len).find(|&e| got[e].to_bits() != want[0][e].to_bits());
            assert_eq!(differs, None, "{count} nodes: first element whose bits differ");
        }
    }
}
