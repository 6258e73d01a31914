//! ZeRO-1's arithmetic: which elements of a tensor a replica owns, and the
//! block-wise gradient norm that has the same bits whoever holds which blocks.
//!
//! Every tensor is cut into fixed blocks of [`BLOCK`] elements (the last one
//! shorter); replica r of dp owns a contiguous run of whole blocks. AdamW is
//! elementwise, so updating a shard is bitwise the unsharded update of those
//! elements; the norm is Σg² per (tensor, block) in f64, summed in the order
//! of the blocks' *slots* — tensors in canonical order, blocks ascending
//! within each — so it is one figure whether a replica holds whole tensors
//! (zero = 0, dp = 1) or shards of them. This module owns no buffers and does
//! no communication.

use crate::model::params::all_tensors;
use crate::model::Arch;
use rayon::prelude::*;
use std::ops::Range;

/// Elements per block: small enough that the test models' matrices split
/// between replicas, large enough that a 124M model has ~10⁵ norm partials.
pub const BLOCK: usize = 1024;

/// Blocks of a tensor of `numel` elements.
pub fn blocks(numel: usize) -> usize {
    numel.div_ceil(BLOCK)
}

/// Elements of block `b` of a tensor of `numel` elements.
pub fn block_range(numel: usize, b: usize) -> Range<usize> {
    (b * BLOCK).min(numel)..((b + 1) * BLOCK).min(numel)
}

/// The blocks replica `replica` of `dp` owns: blocks ⌊n·r/dp⌋ up to ⌊n·(r+1)/dp⌋.
pub fn owned_blocks(numel: usize, dp: usize, replica: usize) -> Range<usize> {
    let n = blocks(numel);
    n * replica / dp..n * (replica + 1) / dp
}

/// One replica's share of every tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub replica: usize,
    pub dp: usize,
}

impl Shard {
    /// The whole tensor: zero = 0, or one replica.
    pub const WHOLE: Shard = Shard { replica: 0, dp: 1 };

    /// The elements this replica owns of a tensor of `numel` elements: whole
    /// blocks, so shards of the replicas in order tile the tensor.
    pub fn range(self, numel: usize) -> Range<usize> {
        let b = owned_blocks(numel, self.dp, self.replica);
        (b.start * BLOCK).min(numel)..(b.end * BLOCK).min(numel)
    }

    pub fn blocks(self, numel: usize) -> Range<usize> {
        owned_blocks(numel, self.dp, self.replica)
    }
}

/// The first norm slot of each tensor, by canonical index: slot = first[c] + block.
pub fn first_slots(cfg: &Arch) -> Vec<usize> {
    let mut next = 0;
    all_tensors(cfg)
        .iter()
        .map(|(_, shape)| {
            let first = next;
            next += blocks(shape.iter().product());
            first
        })
        .collect()
}

/// Σg² of each owned block of `grad`, as (norm slot, value), appended to
/// `out`. Each block is one sequential f64 sum, so its bits depend on nothing
/// but its elements; blocks are summed in parallel.
pub fn block_sum_squares(grad: &[f32], first_slot: usize, shard: Shard, out: &mut Vec<(usize, f64)>) {
    shard_sum_squares(&grad[shard.range(grad.len())], grad.len(), first_slot, shard, out)
}

/// [`block_sum_squares`] of a tensor of `numel` elements of which only the
/// shard is held (ZeRO-2 and 3 keep no other gradient elements): the same
/// blocks, the same sums.
pub fn shard_sum_squares(
    held: &[f32],
    numel: usize,
    first_slot: usize,
    shard: Shard,
    out: &mut Vec<(usize, f64)>,
) {
    let (blocks, at) = (shard.blocks(numel), shard.range(numel).start);
    assert_eq!(held.len(), shard.range(numel).len(), "a shard of a tensor of {numel} elements");
    let start = out.len();
    out.resize(start + blocks.len(), (0, 0.0));
    out[start..].par_iter_mut().zip(blocks.into_par_iter()).for_each(|(o, b)| {
        let r = block_range(numel, b);
        let s = held[r.start - at..r.end - at].iter().map(|&v| v as f64 * v as f64).sum::<f64>();
        *o = (first_slot + b, s);
    });
}

/// Each tensor's shard for `shard`, copied out (a reduce-scatter's share).
pub fn shards_of(tensors: &[Vec<f32>], shard: Shard) -> Vec<Vec<f32>> {
    tensors.iter().map(|t| t[shard.range(t.len())].to_vec()).collect()
}

/// Whole tensors from every replica's shards of them, replicas in order:
/// their shards tile each tensor, so each is its shards one after the other.
pub fn concat_shards(by_replica: Vec<Vec<Vec<f32>>>) -> Result<Vec<Vec<f32>>, String> {
    let n = by_replica.first().map_or(0, Vec::len);
    if by_replica.iter().any(|s| s.len() != n) {
        return Err(format!("replicas sent shards of different tensor counts (replica 0: {n})"));
    }
    let mut whole: Vec<Vec<f32>> = vec![Vec::new(); n];
    for shards in by_replica {
        for (w, s) in whole.iter_mut().zip(shards) {
            w.extend_from_slice(&s);
        }
    }
    Ok(whole)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiles(numel: usize, dp: usize) -> Vec<Range<usize>> {
        (0..dp).map(|replica| Shard { replica, dp }.range(numel)).collect()
    }

    #[test]
    fn shards_of_the_replicas_in_order_tile_the_tensor_in_whole_blocks() {
        for numel in [1, 5, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 7 * BLOCK + 13, 100_003] {
            for dp in [1, 2, 3, 4, 8] {
                let t = tiles(numel, dp);
                assert_eq!(t[0].start, 0, "{numel} over {dp}");
                assert_eq!(t[dp - 1].end, numel, "{numel} over {dp}");
                for w in t.windows(2) {
                    assert_eq!(w[0].end, w[1].start, "{numel} over {dp}: contiguous");
                }
                for r in &t[..dp - 1] {
                    assert_eq!(r.end % BLOCK, 0, "{numel} over {dp}: a shard ends on a block edge");
                }
            }
        }
    }

    #[test]
    fn blocks_are_spread_evenly_and_a_small_tensor_has_one_owner() {
        assert_eq!(
            tiles(8 * BLOCK, 4),
            vec![0..2 * BLOCK, 2 * BLOCK..4 * BLOCK, 4 * BLOCK..6 * BLOCK, 6 * BLOCK..8 * BLOCK]
        );
        assert_eq!(tiles(3 * BLOCK + 1, 2), vec![0..2 * BLOCK, 2 * BLOCK..3 * BLOCK + 1]);
        assert_eq!(tiles(10, 2), vec![0..0, 0..10]);
        assert_eq!(Shard::WHOLE.range(12345), 0..12345);
    }

    #[test]
    fn shards_scattered_then_gathered_are_the_whole_tensors() {
        let tensors: Vec<Vec<f32>> =
            [3 * BLOCK + 5, 7, 0].iter().map(|&n| (0..n).map(|i| i as f32).collect()).collect();
        for dp in [2, 3, 4] {
            let by_replica = (0..dp).map(|replica| shards_of(&tensors, Shard { replica, dp })).collect();
            assert_eq!(concat_shards(by_replica).unwrap(), tensors, "dp = {dp}");
        }
        assert!(concat_shards(vec![vec![vec![1.0]], vec![]]).is_err());
    }

    #[test]
    fn norm_slots_follow_canonical_order_then_blocks() {
        let cfg = Arch::gpt2(1, 2, 32, 100, 16);
        let first = first_slots(&cfg);
        let sizes: Vec<usize> = all_tensors(&cfg).iter().map(|(_, s)| s.iter().product()).collect();
        assert_eq!(first[0], 0);
        for c in 1..sizes.len() {
            assert_eq!(first[c], first[c - 1] + blocks(sizes[c - 1]));
        }
    }

    /// The norm's bits do not depend on how the blocks are shared out; a
    /// naive f32 sum over the whole tensor (what a trainer that ignored the
    /// layout might do) lands elsewhere.
    #[test]
    fn the_block_wise_norm_has_the_same_bits_whole_or_sharded_and_a_naive_one_differs() {
        let mut r = crate::rng::Rng::new(9, crate::rng::Purpose::Test, &[]);
        let grads: Vec<Vec<f32>> = [5 * BLOCK + 17, 3, 2 * BLOCK]
            .iter()
            .map(|&n| (0..n).map(|_| r.normal() as f32).collect())
            .collect();
        let first = [0, blocks(grads[0].len()), blocks(grads[0].len()) + 1];
        let norm = |dp: usize| {
            let mut parts = Vec::new();
            // Replicas report in any order: the coordinator sorts by slot.
            for replica in (0..dp).rev() {
                for (g, &f) in grads.iter().zip(&first) {
                    block_sum_squares(g, f, Shard { replica, dp }, &mut parts);
                }
            }
            crate::optim::global_norm(&mut parts)
        };
        let whole = norm(1);
        for dp in [2, 3, 4, 8] {
            assert_eq!(norm(dp).to_bits(), whole.to_bits(), "dp = {dp}");
        }
        // A replica holding only its shard of each gradient (ZeRO-2, 3) sums the same blocks.
        for dp in [2, 3] {
            let mut parts = Vec::new();
            for replica in 0..dp {
                let shard = Shard { replica, dp };
                for (g, &f) in grads.iter().zip(&first) {
                    shard_sum_squares(&g[shard.range(g.len())], g.len(), f, shard, &mut parts);
                }
            }
            assert_eq!(crate::optim::global_norm(&mut parts).to_bits(), whole.to_bits(), "shards, dp = {dp}");
        }
        let naive = grads.iter().flatten().map(|&g| g * g).sum::<f32>().sqrt() as f64;
        assert!((naive - whole).abs() / whole < 1e-5, "the same figure to f32 precision");
        assert_ne!(naive.to_bits(), whole.to_bits());
    }
}
