//! Tensor parallelism inside a part: the part's blocks computed by `size`
//! ranks, each a thread with its own slice of the stage's cores, joined by a
//! [`ThreadGroup`] (Megatron's layout of TP within a node). When a cluster
//! puts fewer ranks in a process than the split has, the part's process (the
//! owner) holds the first ranks and drives [`TpFollower`]s in the next
//! processes with [`TpCmd`]s; the group's all-reduces then trade nodes with
//! them through an [`Exchange`], and every rank still sums by the same tree.
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
    block_backward_input, block_backward_weight, block_forward, cut_of, shard, shard_into, unshard_into,
    BlockActs, BlockGrads, BlockScratch, Exchange, Recompute, TensorGroup, ThreadGroup, TpRank,
};
use super::params::{Arch, Param};
// PIPEWRIGHT_NONDET's random bias-gradient order is a per-thread switch: the
// ranks' threads take the stage thread's, so the replay demo works at any tp.
use super::part::PartSpec;
use crate::kernels::cpu::matmul::{random_order, with_random_order};

/// How a part's blocks are split: `size` ranks, sums over `slices`
/// K-slices, rows shared out between the split regions or not (`sp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpShape {
    pub size: usize,
    pub slices: usize,
    pub sp: bool,
}

impl TpShape {
    /// Not split, plain products: every run before tensor parallelism.
    pub const WHOLE: TpShape = TpShape { size: 1, slices: 1, sp: false };

    /// The split a run's config asks for (`parallel.tp`, `parallel.tp_slices`, `parallel.sp`).
    pub fn from_config(cfg: &crate::config::Config) -> TpShape {
        TpShape { size: cfg.parallel.tp, slices: cfg.parallel.tp_slices, sp: cfg.parallel.sp }
    }

    /// `size` ranks over `slices`, without sequence parallelism.
    pub fn of(size: usize, slices: usize) -> TpShape {
        TpShape { size, slices, sp: false }
    }

    /// Whether rows are shared out: sequence parallelism over more than one rank.
    pub fn sequence_parallel(self) -> bool {
        self.sp && self.size > 1
    }

    /// The rank a part that is not split computes as.
    pub fn single(self) -> TpRank<'static> {
        TpRank { rank: 0, size: 1, slices: self.slices, sp: false, group: None }
    }

    /// Rank `rank` of this split, joined by `group`.
    pub fn rank(self, rank: usize, group: Option<&dyn TensorGroup>) -> TpRank<'_> {
        TpRank { rank, size: self.size, slices: self.slices, sp: self.sp, group }
    }
}

/// What a part's owner asks of the processes holding its other ranks. Each
/// follower keeps its ranks' activations under the owner's microbatch `key`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum TpCmd {
    /// Arrays: each held rank's shards of every local block's 12 tensors,
    /// sent before a forward when they changed (once per step).
    Refresh,
    /// Block `l`'s forward, its activations kept (`keep`) or not; a
    /// `recompute` in backward (full recompute) keeps no output. Arrays: [the part's input]
    /// for block 0's first forward; later blocks' inputs are the follower's
    /// own outputs (every rank ends a block with the same bits).
    Forward { key: u64, l: u32, keep: bool, recompute: bool },
    /// Block `l`'s input half (`full`: and its weight half) of the backward,
    /// output gradients kept for a later W (`split`). Arrays: [the part's
    /// output gradient] for the top block (below it the follower's own),
    /// then with `full` each held rank's 12 gradient shards (none when all
    /// are +0.0), which come back as the answer with this block's added.
    BackwardInput { key: u64, l: u32, keep: bool, split: bool, full: bool, nondet: bool },
    /// Block `l`'s W. Arrays: each held rank's 12 gradient shards; answered like a full I.
    BackwardWeight { key: u64, l: u32, nondet: bool },
    /// The microbatch `key` is done: its buffers are free.
    Release { key: u64 },
}

/// The processes after the owner's, each holding the next `per` ranks.
pub trait Followers: Send + Sync {
    fn count(&self) -> usize;
    fn send(&self, follower: usize, cmd: TpCmd, arrays: Vec<Vec<f32>>);
    /// Follower `follower`'s answer to the oldest command awaiting one.
    fn answer(&self, follower: usize) -> Vec<Vec<f32>>;
}

/// An owner's ranks elsewhere: it holds ranks `0..per`, and its group's
/// all-reduces go through `exchange`.
pub struct Remote {
    pub per: usize,
    pub followers: Box<dyn Followers>,
    pub exchange: Box<dyn Exchange>,
}

/// Which ranks of a group this process holds, and how it meets the rest.
pub struct Members {
    local: std::ops::Range<usize>,
    group: ThreadGroup,
    followers: Option<Box<dyn Followers>>,
}

impl Members {
    /// A part's own process: every rank, or the first `remote.per` with followers.
    pub fn owner(shape: TpShape, remote: Option<Remote>) -> Members {
        match remote {
            None => Members { local: 0..shape.size, group: ThreadGroup::new(shape.size), followers: None },
            Some(r) => Members {
                local: 0..r.per,
                group: ThreadGroup::spanning(shape.size, 0..r.per, Some(r.exchange)),
                followers: Some(r.followers),
            },
        }
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

/// Where local block `l`'s shards lie in a rank's parameters.
fn block_range(cfg: &Arch, l: usize) -> std::ops::Range<usize> {
    let bl = cfg.block_len();
    bl * l..bl * (l + 1)
}

/// The ranks of a split part held in this process.
pub struct TpRanks {
    cfg: Arch,
    shape: TpShape,
    /// What a microbatch's activation sets keep (a follower's are made here).
    recompute: Recompute,
    /// The ranks held here.
    local: std::ops::Range<usize>,
    ranks: Vec<Rank>,
    /// Local ranks 1..'s copies of a block's output (forward) or of the
    /// gradient flowing through it (backward): every rank holds them whole,
    /// the first local rank's are the caller's.
    copies: Vec<Vec<f32>>,
    group: ThreadGroup,
    followers: Option<Box<dyn Followers>>,
    /// Each follower's gradient shards for the next backward (see `load_grads`).
    loads: Vec<Vec<Vec<f32>>>,
    /// The shards each follower was last sent, and this forward's cut (see `refresh`).
    sent: Vec<Vec<Vec<f32>>>,
    cut: Vec<Vec<Vec<f32>>>,
    /// The held ranks' shards were freed (ZeRO-3) and not cut again since.
    released: bool,
}

impl TpRanks {
    /// Ranks for a part of `spec` whose whole tensors are `whole`; the
    /// stage's `threads` are shared out among the ranks held here.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &Arch,
        spec: &PartSpec,
        b: usize,
        recompute: Recompute,
        shape: TpShape,
        whole: &[Param],
        threads: usize,
        members: Members,
    ) -> Self {
        let Members { local, group, followers } = members;
        let (n, c, bl) = (b * cfg.block_size, cfg.n_embd, cfg.block_len());
        let per = (threads / local.len()).max(1);
        let ranks = local
            .clone()
            .map(|r| {
                let tp = shape.rank(r, None);
                let params = (0..spec.layers.len())
                    .flat_map(|l| whole[spec.block_base(cfg, l)..spec.block_base(cfg, l) + bl].iter())
                    .enumerate()
                    .map(|(j, p)| {
                        let cut = cut_of(cfg, j % bl);
                        let data = shard(cut, &p.data, *p.shape.last().expect("a shape"), r, shape.size);
                        Param { grad: vec![0.0; data.len()], data, ..p.clone() }
                    })
                    .collect();
                Rank {
                    params,
                    scratch: BlockScratch::new(b, cfg, &tp, recompute),
                    full_grads: BlockGrads::new(n, cfg, shape.size, shape.sp),
                    recompute_acts: (recompute == Recompute::Full)
                        .then(|| BlockActs::new(b, cfg, shape.size, shape.sp, Recompute::None)),
                    pool: rayon::ThreadPoolBuilder::new()
                        .num_threads(per)
                        .thread_name(move |i| format!("tp{r}-{i}"))
                        .build()
                        .expect("a tensor-parallel rank's threads"),
                }
            })
            .collect();
        let followers_n = followers.as_ref().map_or(0, |f| f.count());
        TpRanks {
            cfg: *cfg,
            shape,
            recompute,
            copies: (1..local.len()).map(|_| vec![0.0; n * c]).collect(),
            local,
            ranks,
            group,
            followers,
            loads: vec![Vec::new(); followers_n],
            sent: vec![Vec::new(); followers_n],
            cut: vec![Vec::new(); followers_n],
            released: false,
        }
    }

    pub fn size(&self) -> usize {
        self.shape.size
    }

    /// The part's blocks.
    fn blocks(&self) -> usize {
        self.ranks[0].params.len() / self.cfg.block_len()
    }

    /// Ranks held in this process: the activation and gradient sets a
    /// microbatch keeps per block.
    pub fn held_here(&self) -> usize {
        self.local.len()
    }

    /// The ranks follower `f` holds.
    fn follower_ranks(&self, f: usize) -> std::ops::Range<usize> {
        let per = self.local.len();
        (f + 1) * per..(f + 2) * per
    }

    fn followers_count(&self) -> usize {
        self.followers.as_ref().map_or(0, |f| f.count())
    }

    fn tell(&self, f: usize, cmd: TpCmd, arrays: Vec<Vec<f32>>) {
        self.followers.as_ref().expect("followers").send(f, cmd, arrays);
    }

    /// Every follower gets `cmd` with `arrays` (and, with `loads`, its gradient shards).
    fn tell_all(&mut self, cmd: TpCmd, arrays: &[&[f32]], loads: bool) {
        for f in 0..self.followers_count() {
            let mut a: Vec<Vec<f32>> = arrays.iter().map(|x| x.to_vec()).collect();
            if loads {
                a.append(&mut self.loads[f]);
            }
            self.tell(f, cmd.clone(), a);
        }
    }

    /// ZeRO-3: frees the held ranks' weight shards (and the followers' cut
    /// beside them) with the part's whole weights; [`Self::refresh`] cuts
    /// them again. Followers keep theirs: what they were last sent stays
    /// here to compare with, so unchanged weights are not sent again.
    pub fn release_shards(&mut self) {
        for rank in &mut self.ranks {
            for p in &mut rank.params {
                p.data = Vec::new();
            }
        }
        for c in &mut self.cut {
            *c = Vec::new();
        }
        self.released = true;
    }

    pub fn released(&self) -> bool {
        self.released
    }

    /// Cuts every rank's shards again from the whole tensors (followers'
    /// are sent to them when they differ from the last sent, bit for bit).
    pub fn refresh(&mut self, whole: &[Param], spec: &PartSpec) {
        self.released = false;
        let (size, cfg, bl) = (self.shape.size, &self.cfg, self.cfg.block_len());
        for (rank, r) in self.ranks.iter_mut().zip(self.local.clone()) {
            for (j, p) in rank.params.iter_mut().enumerate() {
                let w = &whole[spec.block_base(cfg, j / bl) + j % bl];
                let cut = cut_of(cfg, j % bl);
                shard_into(&mut p.data, cut, &w.data, *w.shape.last().expect("a shape"), r, size);
            }
        }
        // Cut into buffers kept from the last forward, so that a forward
        // whose weights did not change (every one in a step but the first)
        // allocates nothing and sends nothing.
        for f in 0..self.followers_count() {
            let (ranks, cut) = (self.follower_ranks(f), &mut self.cut[f]);
            let mut i = 0;
            for r in ranks {
                for l in 0..spec.layers.len() {
                    for (k, w) in
                        whole[spec.block_base(cfg, l)..spec.block_base(cfg, l) + bl].iter().enumerate()
                    {
                        if cut.len() == i {
                            cut.push(Vec::new());
                        }
                        let how = cut_of(cfg, k);
                        shard_into(&mut cut[i], how, &w.data, *w.shape.last().expect("a shape"), r, size);
                        i += 1;
                    }
                }
            }
            let same = |a: &Vec<f32>, b: &Vec<f32>| {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            };
            let (cut, sent) = (&self.cut[f], &self.sent[f]);
            if cut.len() != sent.len() || !cut.iter().zip(sent).all(|(a, b)| same(a, b)) {
                std::mem::swap(&mut self.cut[f], &mut self.sent[f]);
                self.tell(f, TpCmd::Refresh, self.sent[f].clone());
            }
        }
    }

    /// Gives every rank its shards of local block `l`'s whole gradients
    /// (`whole`: the block's 12 tensors), so that its kernels accumulate onto
    /// what an unsplit part's would.
    pub fn load_grads(&mut self, l: usize, whole: &[Param]) {
        let (size, cfg, bl) = (self.shape.size, &self.cfg, self.cfg.block_len());
        for (rank, r) in self.ranks.iter_mut().zip(self.local.clone()) {
            for (k, w) in whole.iter().enumerate() {
                shard_into(
                    &mut rank.params[bl * l + k].grad,
                    cut_of(cfg, k),
                    &w.grad,
                    *w.shape.last().expect("a shape"),
                    r,
                    size,
                );
            }
        }
        // A step's gradient tree hands each microbatch zeroed gradients:
        // then followers are told so instead of sent zeros.
        let zero = whole.iter().all(|w| w.grad.iter().all(|&g| g.to_bits() == 0));
        for f in 0..self.followers_count() {
            let mut arrays = Vec::new();
            for r in self.follower_ranks(f).filter(|_| !zero) {
                for (k, w) in whole.iter().enumerate() {
                    arrays.push(shard(cut_of(cfg, k), &w.grad, *w.shape.last().expect("a shape"), r, size));
                }
            }
            self.loads[f] = arrays;
        }
    }

    /// Joins every rank's gradients of local block `l` back into the whole
    /// tensors: disjoint pieces copied (a tensor every rank holds whole has
    /// the same bits on each; rank 0's is taken). Followers' come back as
    /// the answer to the backward that made them.
    pub fn store_grads(&mut self, l: usize, whole: &mut [Param]) {
        let theirs: Vec<Vec<Vec<f32>>> = match &self.followers {
            Some(f) => (0..f.count()).map(|i| f.answer(i)).collect(),
            None => Vec::new(),
        };
        let (per, bl) = (self.local.len(), self.cfg.block_len());
        for (k, w) in whole.iter_mut().enumerate() {
            let cols = *w.shape.last().expect("a shape");
            let mut pieces: Vec<&[f32]> =
                self.ranks.iter().map(|r| r.params[bl * l + k].grad.as_slice()).collect();
            for a in &theirs {
                assert_eq!(a.len(), bl * per, "a follower's gradient shards of block {l}");
                pieces.extend((0..per).map(|r| a[bl * r + k].as_slice()));
            }
            unshard_into(&mut w.grad, cut_of(&self.cfg, k), &pieces, cols);
        }
    }

    /// Followers drop what they keep for microbatch `key`.
    pub fn release(&mut self, key: u64) {
        self.tell_all(TpCmd::Release { key }, &[], false);
    }

    /// Block `l`'s forward on every rank: `blocks` holds each local rank's
    /// activations (None when recomputing: the ranks' own buffers), kept by
    /// followers under `key`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        l: usize,
        key: u64,
        blocks: Option<&mut [BlockActs]>,
        recompute: bool,
        x: &[f32],
        out: &mut [f32],
        b: usize,
        cfg: &Arch,
    ) {
        let cmd = TpCmd::Forward { key, l: l as u32, keep: blocks.is_some(), recompute };
        let given: &[&[f32]] = if l == 0 && !recompute { &[x] } else { &[] };
        self.tell_all(cmd, given, false);
        let (shape, group) = (self.shape, &self.group as &dyn TensorGroup);
        let mut blocks = blocks.map(|s| s.iter_mut());
        let outs = std::iter::once(out).chain(self.copies.iter_mut().map(Vec::as_mut_slice));
        std::thread::scope(|sc| {
            for ((rank, o), r) in self.ranks.iter_mut().zip(outs).zip(self.local.clone()) {
                let tp = shape.rank(r, Some(group));
                let ba = match blocks.as_mut() {
                    Some(it) => it.next().expect("an activation set per rank"),
                    None => rank.recompute_acts.as_mut().expect("recompute buffers"),
                };
                let (params, scratch, pool) =
                    (&rank.params[block_range(cfg, l)], &mut rank.scratch, &rank.pool);
                sc.spawn(move || pool.install(|| block_forward(params, ba, x, o, scratch, b, cfg, &tp)));
            }
        });
        self.settle();
    }

    /// The owner stops (failing its stage) when the group lost a process; a
    /// follower reads [`Self::failure`] instead.
    fn settle(&self) {
        if self.followers.is_some() {
            if let Some(e) = self.group.failure() {
                // The exchange's own words stop the stage (its executor
                // reports the payload); no panic message is printed.
                std::panic::resume_unwind(Box::new(e));
            }
        }
    }

    fn failure(&self) -> Option<String> {
        self.group.failure()
    }

    /// The input half (or, with `full`, the whole) of block `l`'s backward on
    /// every rank. `grads`: each local rank's output gradients for a later W
    /// (None: the ranks' own, for a full backward).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_input(
        &mut self,
        l: usize,
        key: u64,
        blocks: Option<&mut [BlockActs]>,
        grads: Option<&mut [BlockGrads]>,
        x: &[f32],
        dres: &mut [f32],
        b: usize,
        cfg: &Arch,
        full: bool,
    ) {
        let nondet = random_order();
        let cmd = TpCmd::BackwardInput {
            key,
            l: l as u32,
            keep: blocks.is_some(),
            split: grads.is_some(),
            full,
            nondet,
        };
        let top: &[&[f32]] = if l + 1 == self.blocks() { &[dres] } else { &[] };
        self.tell_all(cmd, top, full);
        for c in &mut self.copies {
            c.copy_from_slice(dres);
        }
        let (shape, group) = (self.shape, &self.group as &dyn TensorGroup);
        let mut grads = grads.map(|s| s.iter_mut());
        let mut blocks = blocks.map(|s| s.iter_mut());
        let dress = std::iter::once(dres).chain(self.copies.iter_mut().map(Vec::as_mut_slice));
        std::thread::scope(|sc| {
            for (i, (rank, d)) in self.ranks.iter_mut().zip(dress).enumerate() {
                let tp = shape.rank(self.local.start + i, Some(group));
                let ba = match blocks.as_mut() {
                    Some(it) => it.next().expect("an activation set per rank"),
                    None => rank.recompute_acts.as_mut().expect("recompute buffers"),
                };
                let g = match grads.as_mut() {
                    Some(it) => it.next().expect("a gradient set per rank"),
                    None => &mut rank.full_grads,
                };
                let (params, scratch, pool) =
                    (&mut rank.params[block_range(cfg, l)], &mut rank.scratch, &rank.pool);
                sc.spawn(move || {
                    pool.install(|| {
                        with_random_order(nondet, || {
                            block_backward_input(params, ba, x, d, g, scratch, b, cfg, &tp, full)
                        })
                    })
                });
            }
        });
        self.settle();
    }

    /// The weight half of block `l`'s backward on every rank: each rank's
    /// weight gradients are its own but for a whole weight whose gradient
    /// sums over the ranks' heads (the per-head q/k norms).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_weight(
        &mut self,
        l: usize,
        key: u64,
        blocks: &mut [BlockActs],
        grads: &[BlockGrads],
        x: &[f32],
        b: usize,
        cfg: &Arch,
    ) {
        let nondet = random_order();
        self.tell_all(TpCmd::BackwardWeight { key, l: l as u32, nondet }, &[], true);
        // The group joins the one split sum a W holds, the per-head q/k norms' weight gradients.
        let (shape, group) = (self.shape, &self.group as &dyn TensorGroup);
        std::thread::scope(|sc| {
            for (i, (rank, ba)) in self.ranks.iter_mut().zip(blocks.iter_mut()).enumerate() {
                let tp = shape.rank(self.local.start + i, Some(group));
                let (params, scratch, pool, g) =
                    (&mut rank.params[block_range(cfg, l)], &mut rank.scratch, &rank.pool, &grads[i]);
                sc.spawn(move || {
                    pool.install(|| {
                        with_random_order(nondet, || {
                            block_backward_weight(params, ba, x, g, scratch, b, cfg, &tp)
                        })
                    })
                });
            }
        });
        self.settle();
    }

    /// Local block `l`'s gradient shards of every held rank, a block's tensors per rank.
    fn grads_of(&self, l: usize) -> Vec<Vec<f32>> {
        self.ranks
            .iter()
            .flat_map(|r| r.params[block_range(&self.cfg, l)].iter().map(|p| p.grad.clone()))
            .collect()
    }

    /// Sets local block `l`'s gradient shards of every held rank from `arrays` (a block's tensors per rank).
    fn set_grads(&mut self, l: usize, arrays: &[Vec<f32>]) -> Result<(), String> {
        let bl = self.cfg.block_len();
        if arrays.is_empty() {
            // All +0.0: what the owner's whole gradients held.
            for rank in &mut self.ranks {
                rank.params[block_range(&self.cfg, l)].iter_mut().for_each(|p| p.grad.fill(0.0));
            }
            return Ok(());
        }
        if arrays.len() != bl * self.ranks.len() {
            return Err(format!(
                "{} gradient shards for {} ranks' {bl} tensors",
                arrays.len(),
                self.ranks.len()
            ));
        }
        for (rank, a) in self.ranks.iter_mut().zip(arrays.chunks(bl)) {
            for (p, g) in rank.params[block_range(&self.cfg, l)].iter_mut().zip(a) {
                if p.grad.len() != g.len() {
                    return Err(format!("{}: a shard of {} elements, not {}", p.name, g.len(), p.grad.len()));
                }
                p.grad.copy_from_slice(g);
            }
        }
        Ok(())
    }
}

type Arrays = Vec<Vec<f32>>;

/// What a follower keeps for one microbatch until the owner releases it.
#[derive(Default)]
struct Kept {
    /// inputs[l]: the residual stream entering local block l (block 0's from
    /// the owner; the others are this follower's own outputs, which have the
    /// owner's bits: every rank ends a block with the same sum).
    inputs: Vec<Vec<f32>>,
    /// The gradient flowing down through the blocks in backward (the
    /// owner's at the top block, then this follower's own).
    dres: Vec<f32>,
    /// Per block and held rank: activations (unless recomputing), output
    /// gradients for a later W (split backward only).
    blocks: Vec<BlockActs>,
    grads: Vec<BlockGrads>,
}

/// Ranks of a part held in a process other than the part's: it runs what the
/// owner's [`TpCmd`]s say, in their order, and joins the owner's group.
pub struct TpFollower {
    cfg: Arch,
    spec: PartSpec,
    b: usize,
    ranks: TpRanks,
    kept: std::collections::HashMap<u64, Kept>,
    spare: Vec<Kept>,
    /// A recomputed block's output (not kept: the kept inputs have its bits).
    scratch_out: Vec<f32>,
}

impl TpFollower {
    /// Ranks `local` of `shape` for the part of `spec`; shards arrive with the first Refresh.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: Arch,
        spec: PartSpec,
        b: usize,
        recompute: impl Into<Recompute>,
        shape: TpShape,
        local: std::ops::Range<usize>,
        threads: usize,
        exchange: Box<dyn Exchange>,
    ) -> Self {
        let whole = super::part::part_params(&cfg, &spec, 0);
        let group = ThreadGroup::spanning(shape.size, local.clone(), Some(exchange));
        let members = Members { local, group, followers: None };
        let ranks = TpRanks::new(&cfg, &spec, b, recompute.into(), shape, &whole, threads, members);
        let n = b * cfg.block_size * cfg.n_embd;
        TpFollower {
            cfg,
            spec,
            b,
            ranks,
            kept: Default::default(),
            spare: Vec::new(),
            scratch_out: vec![0.0; n],
        }
    }

    /// Microbatch `key`'s buffers, taken out (put back with `keep_again`);
    /// `blocks`/`grads`: with room for every block's activations / gradients.
    fn take(&mut self, key: u64, blocks: bool, grads: bool) -> Kept {
        let (per, nb) = (self.ranks.held_here(), self.spec.layers.len());
        let (b, cfg, size, kept) = (self.b, self.cfg, self.ranks.size(), self.ranks.recompute);
        let sp = self.ranks.shape.sp;
        let n = b * cfg.block_size;
        let mut k = self.kept.remove(&key).unwrap_or_else(|| self.spare.pop().unwrap_or_default());
        if k.inputs.len() != nb {
            k.inputs = (0..nb).map(|_| vec![0.0; n * cfg.n_embd]).collect();
            k.dres = vec![0.0; n * cfg.n_embd];
        }
        if blocks && k.blocks.len() != nb * per {
            k.blocks = (0..nb * per).map(|_| BlockActs::new(b, &cfg, size, sp, kept)).collect();
        }
        if grads && k.grads.len() != nb * per {
            k.grads = (0..nb * per).map(|_| BlockGrads::new(n, &cfg, size, sp)).collect();
        }
        k
    }

    /// Runs one command; the answer, when it has one, goes back to the owner.
    pub fn handle(&mut self, cmd: TpCmd, arrays: Vec<Vec<f32>>) -> Result<Option<Vec<Vec<f32>>>, String> {
        let (b, cfg, per) = (self.b, self.cfg, self.ranks.held_here());
        let n = b * cfg.block_size * cfg.n_embd;
        let (nb, bl) = (self.spec.layers.len(), cfg.block_len());
        let layer = |l: u32| -> Result<usize, String> {
            match (l as usize) < nb {
                true => Ok(l as usize),
                false => Err(format!("block {l} of a part with {nb}")),
            }
        };
        let known = |this: &Self, key: u64, what: &str| match this.kept.contains_key(&key) {
            true => Ok(()),
            false => Err(format!("{what} of microbatch key {key}, which has no forward here")),
        };
        // The arrays a command carries: `whole` (N, C) tensors first, then
        // `shards` sets of a block's tensors per held rank.
        let split = |mut a: Vec<Vec<f32>>, whole: usize, shards: bool| -> Result<(Arrays, Arrays), String> {
            let want = whole + if shards { bl * per } else { 0 };
            // Gradient shards that are all zero are left out.
            if a.len() != want && !(shards && a.len() == whole) {
                return Err(format!("{} arrays, not {want}", a.len()));
            }
            let rest = a.split_off(whole);
            match a.iter().find(|v| v.len() != n) {
                Some(v) => Err(format!("an (N, C) tensor of {} elements, not {n}", v.len())),
                None => Ok((a, rest)),
            }
        };
        match cmd {
            TpCmd::Refresh => {
                if arrays.len() != bl * nb * per {
                    return Err(format!("{} shards, not {}", arrays.len(), bl * nb * per));
                }
                let mut arrays = arrays;
                for (rank, a) in self.ranks.ranks.iter_mut().zip(arrays.chunks_mut(bl * nb)) {
                    for (p, d) in rank.params.iter_mut().zip(a) {
                        if p.data.len() != d.len() {
                            return Err(format!(
                                "{}: a shard of {} elements, not {}",
                                p.name,
                                d.len(),
                                p.data.len()
                            ));
                        }
                        std::mem::swap(&mut p.data, d);
                    }
                }
                Ok(None)
            }
            TpCmd::Forward { key, l, keep, recompute } => {
                let l = layer(l)?;
                let given = l == 0 && !recompute;
                let (mut x, _) = split(arrays, usize::from(given), false)?;
                if !given {
                    known(self, key, "a forward of a later block")?;
                }
                let mut k = self.take(key, keep, false);
                if given {
                    k.inputs[0] = x.remove(0);
                }
                let mut out = match recompute || l + 1 == nb {
                    true => std::mem::take(&mut self.scratch_out),
                    false => std::mem::take(&mut k.inputs[l + 1]),
                };
                let blocks = keep.then(|| &mut k.blocks[l * per..(l + 1) * per]);
                self.ranks.forward(l, key, blocks, false, &k.inputs[l], &mut out, b, &cfg);
                match recompute || l + 1 == nb {
                    true => self.scratch_out = out,
                    false => k.inputs[l + 1] = out,
                }
                self.kept.insert(key, k);
                self.ranks.failure().map_or(Ok(None), Err)
            }
            TpCmd::BackwardInput { key, l, keep, split: later_w, full, nondet } => {
                let l = layer(l)?;
                known(self, key, "a backward")?;
                let top = l + 1 == nb;
                let (mut d, shards) = split(arrays, usize::from(top), full)?;
                if full {
                    self.ranks.set_grads(l, &shards)?;
                }
                let mut k = self.take(key, keep, later_w);
                if top {
                    k.dres = d.remove(0);
                }
                let Kept { inputs, dres, blocks, grads } = &mut k;
                let blocks = keep.then(|| &mut blocks[l * per..(l + 1) * per]);
                let grads = later_w.then(|| &mut grads[l * per..(l + 1) * per]);
                with_random_order(nondet, || {
                    self.ranks.backward_input(l, key, blocks, grads, &inputs[l], dres, b, &cfg, full)
                });
                self.kept.insert(key, k);
                if let Some(e) = self.ranks.failure() {
                    return Err(e);
                }
                Ok(full.then(|| self.ranks.grads_of(l)))
            }
            TpCmd::BackwardWeight { key, l, nondet } => {
                let l = layer(l)?;
                let (_, shards) = split(arrays, 0, true)?;
                self.ranks.set_grads(l, &shards)?;
                let k = self
                    .kept
                    .get_mut(&key)
                    .ok_or_else(|| format!("a W of microbatch key {key} before its I"))?;
                if k.grads.len() != nb * per || k.blocks.len() != nb * per {
                    return Err(format!("a W of microbatch key {key} whose I kept nothing for it"));
                }
                let (blocks, grads) =
                    (&mut k.blocks[l * per..(l + 1) * per], &k.grads[l * per..(l + 1) * per]);
                let ranks = &mut self.ranks;
                with_random_order(nondet, || {
                    ranks.backward_weight(l, key, blocks, grads, &k.inputs[l], b, &cfg)
                });
                Ok(Some(self.ranks.grads_of(l)))
            }
            TpCmd::Release { key } => {
                if let Some(k) = self.kept.remove(&key) {
                    self.spare.push(k);
                }
                Ok(None)
            }
        }
    }
}
