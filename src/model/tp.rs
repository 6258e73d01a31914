//! Tensor parallelism inside a part: the part's blocks computed by `size`
//! ranks, each a thread of the stage with its own slice of the stage's
//! cores, joined by a [`ThreadGroup`] (Megatron's layout of TP within a node).
//!
//! The part keeps its tensors whole: the optimizer, the gradient tree over
//! microbatches, ZeRO-1, the norm and checkpoints see the tensors of an
//! unsplit run. Each rank computes with its shards, cut from the whole
//! tensors at every forward (the weights may have changed since). Around
//! each block's weight gradients the ranks take their shards of the whole
//! gradients and give them back: kernels that accumulate (a bias's column
//! sum adds row after row onto what is there) see what an unsplit part's
//! would, and the copies move bits without arithmetic, so the whole
//! gradients have the bits of one rank (see `block`).

use super::block::{
    block_backward_input, block_backward_weight, block_forward, shard, shard_into, unshard_into, BlockActs,
    BlockGrads, BlockScratch, TensorGroup, ThreadGroup, TpRank,
};
use super::params::{GptConfig, Param};
// PIPEWRIGHT_NONDET's random bias-gradient order is a per-thread switch: the
// ranks' threads take the stage thread's, so the replay demo works at any tp.
use super::part::PartSpec;
use crate::kernels::cpu::matmul::{random_order, with_random_order};

/// How a part's blocks are split: `size` ranks, sums over `slices` K-slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpShape {
    pub size: usize,
    pub slices: usize,
}

impl TpShape {
    /// Not split, plain products: every run before tensor parallelism.
    pub const WHOLE: TpShape = TpShape { size: 1, slices: 1 };

    /// The rank a part that is not split computes as.
    pub fn single(self) -> TpRank<'static> {
        TpRank { rank: 0, size: 1, slices: self.slices, group: None }
    }

    /// Rank `rank` of this split, joined by `group`.
    pub fn rank(self, rank: usize, group: Option<&dyn TensorGroup>) -> TpRank<'_> {
        TpRank { rank, size: self.size, slices: self.slices, group }
    }
}

/// One rank's state: its shards (12 per local block), workspace and threads.
struct Rank {
    params: Vec<Param>,
    scratch: BlockScratch,
    full_grads: BlockGrads,
    recompute_acts: Option<BlockActs>,
    pool: rayon::ThreadPool,
}

/// The ranks of a split part.
pub struct TpRanks {
    shape: TpShape,
    ranks: Vec<Rank>,
    /// Ranks 1..'s copies of a block's output (forward) or of the gradient
    /// flowing through it (backward): every rank holds them whole, rank 0's
    /// are the part's.
    copies: Vec<Vec<f32>>,
    group: ThreadGroup,
}

impl TpRanks {
    /// Ranks for a part of `spec` whose whole tensors are `whole`; the
    /// stage's `threads` are shared out among them.
    pub fn new(
        cfg: &GptConfig,
        spec: &PartSpec,
        b: usize,
        recompute: bool,
        shape: TpShape,
        whole: &[Param],
        threads: usize,
    ) -> Self {
        let (n, c) = (b * cfg.block_size, cfg.n_embd);
        let per = (threads / shape.size).max(1);
        let ranks = (0..shape.size)
            .map(|r| {
                let tp = shape.rank(r, None);
                let params = (0..spec.layers.len())
                    .flat_map(|l| whole[spec.block_base(l)..spec.block_base(l) + 12].iter())
                    .enumerate()
                    .map(|(j, p)| {
                        let data = shard(j % 12, &p.data, *p.shape.last().expect("a shape"), r, shape.size);
                        Param { grad: vec![0.0; data.len()], data, ..p.clone() }
                    })
                    .collect();
                Rank {
                    params,
                    scratch: BlockScratch::new(b, cfg, &tp),
                    full_grads: BlockGrads::new(n, c, shape.size),
                    recompute_acts: recompute.then(|| BlockActs::new(b, cfg, shape.size)),
                    pool: rayon::ThreadPoolBuilder::new()
                        .num_threads(per)
                        .thread_name(move |i| format!("tp{r}-{i}"))
                        .build()
                        .expect("a tensor-parallel rank's threads"),
                }
            })
            .collect();
        TpRanks {
            shape,
            ranks,
            copies: (1..shape.size).map(|_| vec![0.0; n * c]).collect(),
            group: ThreadGroup::new(shape.size),
        }
    }

    pub fn size(&self) -> usize {
        self.shape.size
    }

    /// Cuts every rank's shards again from the whole tensors.
    pub fn refresh(&mut self, whole: &[Param], spec: &PartSpec) {
        let size = self.shape.size;
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            for (j, p) in rank.params.iter_mut().enumerate() {
                let w = &whole[spec.block_base(j / 12) + j % 12];
                shard_into(&mut p.data, j % 12, &w.data, *w.shape.last().expect("a shape"), r, size);
            }
        }
    }

    /// Gives every rank its shards of local block `l`'s whole gradients
    /// (`whole`: the block's 12 tensors), so that its kernels accumulate onto
    /// what an unsplit part's would.
    pub fn load_grads(&mut self, l: usize, whole: &[Param]) {
        let size = self.shape.size;
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            for (k, w) in whole.iter().enumerate() {
                shard_into(
                    &mut rank.params[12 * l + k].grad,
                    k,
                    &w.grad,
                    *w.shape.last().expect("a shape"),
                    r,
                    size,
                );
            }
        }
    }

    /// Joins every rank's gradients of local block `l` back into the whole
    /// tensors: disjoint pieces copied (a tensor every rank holds whole has
    /// the same bits on each; rank 0's is taken).
    pub fn store_grads(&mut self, l: usize, whole: &mut [Param]) {
        for (k, w) in whole.iter_mut().enumerate() {
            let cols = *w.shape.last().expect("a shape");
            let pieces: Vec<&[f32]> =
                self.ranks.iter().map(|r| r.params[12 * l + k].grad.as_slice()).collect();
            unshard_into(&mut w.grad, k, &pieces, cols);
        }
    }

    /// Block `l`'s forward on every rank: `blocks` holds each rank's
    /// activations (None when recomputing: the ranks' own buffers).
    pub fn forward(
        &mut self,
        l: usize,
        blocks: Option<&mut [BlockActs]>,
        x: &[f32],
        out: &mut [f32],
        b: usize,
        cfg: &GptConfig,
    ) {
        let (shape, group) = (self.shape, &self.group as &dyn TensorGroup);
        let mut blocks = blocks.map(|s| s.iter_mut());
        let outs = std::iter::once(out).chain(self.copies.iter_mut().map(Vec::as_mut_slice));
        std::thread::scope(|sc| {
            for (r, (rank, o)) in self.ranks.iter_mut().zip(outs).enumerate() {
                let tp = shape.rank(r, Some(group));
                let ba = match blocks.as_mut() {
                    Some(it) => it.next().expect("an activation set per rank"),
                    None => rank.recompute_acts.as_mut().expect("recompute buffers"),
                };
                let (params, scratch, pool) =
                    (&rank.params[12 * l..12 * (l + 1)], &mut rank.scratch, &rank.pool);
                sc.spawn(move || pool.install(|| block_forward(params, ba, x, o, scratch, b, cfg, &tp)));
            }
        });
    }

    /// The input half (or, with `full`, the whole) of block `l`'s backward on
    /// every rank. `grads`: each rank's output gradients for a later W (None:
    /// the ranks' own, for a full backward).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_input(
        &mut self,
        l: usize,
        blocks: Option<&[BlockActs]>,
        grads: Option<&mut [BlockGrads]>,
        x: &[f32],
        dres: &mut [f32],
        b: usize,
        cfg: &GptConfig,
        full: bool,
    ) {
        for c in &mut self.copies {
            c.copy_from_slice(dres);
        }
        let (shape, group) = (self.shape, &self.group as &dyn TensorGroup);
        let nondet = random_order();
        let mut grads = grads.map(|s| s.iter_mut());
        let dress = std::iter::once(dres).chain(self.copies.iter_mut().map(Vec::as_mut_slice));
        std::thread::scope(|sc| {
            for (r, (rank, d)) in self.ranks.iter_mut().zip(dress).enumerate() {
                let tp = shape.rank(r, Some(group));
                let ba = match blocks {
                    Some(s) => &s[r],
                    None => rank.recompute_acts.as_ref().expect("recompute buffers"),
                };
                let g = match grads.as_mut() {
                    Some(it) => it.next().expect("a gradient set per rank"),
                    None => &mut rank.full_grads,
                };
                let (params, scratch, pool) =
                    (&mut rank.params[12 * l..12 * (l + 1)], &mut rank.scratch, &rank.pool);
                sc.spawn(move || {
                    pool.install(|| {
                        with_random_order(nondet, || {
                            block_backward_input(params, ba, x, d, g, scratch, b, cfg, &tp, full)
                        })
                    })
                });
            }
        });
    }

    /// The weight half of block `l`'s backward on every rank (no sums over
    /// ranks: each rank's weight gradients are its own).
    pub fn backward_weight(
        &mut self,
        l: usize,
        blocks: &[BlockActs],
        grads: &[BlockGrads],
        x: &[f32],
        b: usize,
        cfg: &GptConfig,
    ) {
        let (shape, nondet) = (self.shape, random_order());
        std::thread::scope(|sc| {
            for (r, rank) in self.ranks.iter_mut().enumerate() {
                let tp = shape.rank(r, None);
                let (params, pool, ba, g) =
                    (&mut rank.params[12 * l..12 * (l + 1)], &rank.pool, &blocks[r], &grads[r]);
                sc.spawn(move || {
                    pool.install(|| {
                        with_random_order(nondet, || block_backward_weight(params, ba, x, g, b, cfg, &tp))
                    })
                });
            }
        });
    }
}
