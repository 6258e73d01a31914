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
    block_backward_input, block_backward_weight, block_forward, shard, shard_into, unshard_into, BlockActs,
    BlockGrads, BlockScratch, Exchange, TensorGroup, ThreadGroup, TpRank,
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

/// What a part's owner asks of the processes holding its other ranks. Each
/// follower keeps its ranks' activations under the owner's microbatch `key`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum TpCmd {
    /// Arrays: each held rank's shards of every local block's 12 tensors.
    Refresh,
    /// Arrays: [block input].
    Forward { key: u64, l: u32, keep: bool },
    /// Arrays: [block input, output gradient], then with `full` each held
    /// rank's 12 gradient shards. With `full` the follower answers with its
    /// ranks' 12 gradient shards.
    BackwardInput { key: u64, l: u32, keep: bool, split: bool, full: bool, nondet: bool },
    /// Arrays: [block input], then each held rank's 12 gradient shards; answered like a full I.
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

/// One rank's state: its shards (12 per local block), workspace and threads.
struct Rank {
    params: Vec<Param>,
    scratch: BlockScratch,
    full_grads: BlockGrads,
    recompute_acts: Option<BlockActs>,
    pool: rayon::ThreadPool,
}

/// The ranks of a split part held in this process.
pub struct TpRanks {
    shape: TpShape,
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
}

impl TpRanks {
    /// Ranks for a part of `spec` whose whole tensors are `whole`; the
    /// stage's `threads` are shared out among the ranks held here.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &GptConfig,
        spec: &PartSpec,
        b: usize,
        recompute: bool,
        shape: TpShape,
        whole: &[Param],
        threads: usize,
        remote: Option<Remote>,
    ) -> Self {
        let (local, group, followers) = match remote {
            None => (0..shape.size, ThreadGroup::new(shape.size), None),
            Some(r) => {
                (0..r.per, ThreadGroup::spanning(shape.size, 0..r.per, Some(r.exchange)), Some(r.followers))
            }
        };
        TpRanks::held(cfg, spec, b, recompute, shape, whole, threads, local, group, followers)
    }

    #[allow(clippy::too_many_arguments)]
    fn held(
        cfg: &GptConfig,
        spec: &PartSpec,
        b: usize,
        recompute: bool,
        shape: TpShape,
        whole: &[Param],
        threads: usize,
        local: std::ops::Range<usize>,
        group: ThreadGroup,
        followers: Option<Box<dyn Followers>>,
    ) -> Self {
        let (n, c) = (b * cfg.block_size, cfg.n_embd);
        let per = (threads / local.len()).max(1);
        let ranks = local
            .clone()
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
        let followers_n = followers.as_ref().map_or(0, |f| f.count());
        TpRanks {
            shape,
            copies: (1..local.len()).map(|_| vec![0.0; n * c]).collect(),
            local,
            ranks,
            group,
            followers,
            loads: vec![Vec::new(); followers_n],
        }
    }

    pub fn size(&self) -> usize {
        self.shape.size
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

    /// Cuts every rank's shards again from the whole tensors (followers'
    /// are sent to them).
    pub fn refresh(&mut self, whole: &[Param], spec: &PartSpec) {
        let size = self.shape.size;
        for (rank, r) in self.ranks.iter_mut().zip(self.local.clone()) {
            for (j, p) in rank.params.iter_mut().enumerate() {
                let w = &whole[spec.block_base(j / 12) + j % 12];
                shard_into(&mut p.data, j % 12, &w.data, *w.shape.last().expect("a shape"), r, size);
            }
        }
        for f in 0..self.followers_count() {
            let mut arrays = Vec::new();
            for r in self.follower_ranks(f) {
                for l in 0..spec.layers.len() {
                    for (k, w) in whole[spec.block_base(l)..spec.block_base(l) + 12].iter().enumerate() {
                        arrays.push(shard(k, &w.data, *w.shape.last().expect("a shape"), r, size));
                    }
                }
            }
            self.tell(f, TpCmd::Refresh, arrays);
        }
    }

    /// Gives every rank its shards of local block `l`'s whole gradients
    /// (`whole`: the block's 12 tensors), so that its kernels accumulate onto
    /// what an unsplit part's would.
    pub fn load_grads(&mut self, l: usize, whole: &[Param]) {
        let size = self.shape.size;
        for (rank, r) in self.ranks.iter_mut().zip(self.local.clone()) {
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
        for f in 0..self.followers_count() {
            let mut arrays = Vec::new();
            for r in self.follower_ranks(f) {
                for (k, w) in whole.iter().enumerate() {
                    arrays.push(shard(k, &w.grad, *w.shape.last().expect("a shape"), r, size));
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
        let per = self.local.len();
        for (k, w) in whole.iter_mut().enumerate() {
            let cols = *w.shape.last().expect("a shape");
            let mut pieces: Vec<&[f32]> =
                self.ranks.iter().map(|r| r.params[12 * l + k].grad.as_slice()).collect();
            for a in &theirs {
                assert_eq!(a.len(), 12 * per, "a follower's gradient shards of block {l}");
                pieces.extend((0..per).map(|r| a[12 * r + k].as_slice()));
            }
            unshard_into(&mut w.grad, k, &pieces, cols);
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
        x: &[f32],
        out: &mut [f32],
        b: usize,
        cfg: &GptConfig,
    ) {
        self.tell_all(TpCmd::Forward { key, l: l as u32, keep: blocks.is_some() }, &[x], false);
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
                    (&rank.params[12 * l..12 * (l + 1)], &mut rank.scratch, &rank.pool);
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
                panic!("{e}");
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
        blocks: Option<&[BlockActs]>,
        grads: Option<&mut [BlockGrads]>,
        x: &[f32],
        dres: &mut [f32],
        b: usize,
        cfg: &GptConfig,
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
        self.tell_all(cmd, &[x, dres], full);
        for c in &mut self.copies {
            c.copy_from_slice(dres);
        }
        let (shape, group) = (self.shape, &self.group as &dyn TensorGroup);
        let mut grads = grads.map(|s| s.iter_mut());
        let dress = std::iter::once(dres).chain(self.copies.iter_mut().map(Vec::as_mut_slice));
        std::thread::scope(|sc| {
            for (i, (rank, d)) in self.ranks.iter_mut().zip(dress).enumerate() {
                let tp = shape.rank(self.local.start + i, Some(group));
                let ba = match blocks {
                    Some(s) => &s[i],
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
        self.settle();
    }

    /// The weight half of block `l`'s backward on every rank (no sums over
    /// ranks: each rank's weight gradients are its own).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_weight(
        &mut self,
        l: usize,
        key: u64,
        blocks: &[BlockActs],
        grads: &[BlockGrads],
        x: &[f32],
        b: usize,
        cfg: &GptConfig,
    ) {
        let nondet = random_order();
        self.tell_all(TpCmd::BackwardWeight { key, l: l as u32, nondet }, &[x], true);
        let shape = self.shape;
        std::thread::scope(|sc| {
            for (i, rank) in self.ranks.iter_mut().enumerate() {
                let tp = shape.rank(self.local.start + i, None);
                let (params, pool, ba, g) =
                    (&mut rank.params[12 * l..12 * (l + 1)], &rank.pool, &blocks[i], &grads[i]);
                sc.spawn(move || {
                    pool.install(|| {
                        with_random_order(nondet, || block_backward_weight(params, ba, x, g, b, cfg, &tp))
                    })
                });
            }
        });
    }

    /// Local block `l`'s gradient shards of every held rank, 12 per rank.
    fn grads_of(&self, l: usize) -> Vec<Vec<f32>> {
        self.ranks
            .iter()
            .flat_map(|r| r.params[12 * l..12 * (l + 1)].iter().map(|p| p.grad.clone()))
            .collect()
    }

    /// Sets local block `l`'s gradient shards of every held rank from `arrays` (12 per rank).
    fn set_grads(&mut self, l: usize, arrays: &[Vec<f32>]) -> Result<(), String> {
        if arrays.len() != 12 * self.ranks.len() {
            return Err(format!(
                "{} gradient shards for {} ranks' 12 tensors",
                arrays.len(),
                self.ranks.len()
            ));
        }
        for (rank, a) in self.ranks.iter_mut().zip(arrays.chunks(12)) {
            for (p, g) in rank.params[12 * l..12 * (l + 1)].iter_mut().zip(a) {
                if p.grad.len() != g.len() {
                    return Err(format!("{}: a shard of {} elements, not {}", p.name, g.len(), p.grad.len()));
                }
                p.grad.copy_from_slice(g);
            }
        }
        Ok(())
    }
}

/// The buffers a follower keeps for one microbatch.
#[derive(Default)]
struct Kept {
    blocks: Vec<BlockActs>,
    grads: Vec<BlockGrads>,
}

/// Ranks of a part held in a process other than the part's: it runs what the
/// owner's [`TpCmd`]s say, in their order, and joins the owner's group.
pub struct TpFollower {
    cfg: GptConfig,
    spec: PartSpec,
    b: usize,
    ranks: TpRanks,
    /// The first held rank's output or gradient buffer (the owner's is the part's).
    out: Vec<f32>,
    kept: std::collections::HashMap<u64, Kept>,
    spare: Vec<Kept>,
}

impl TpFollower {
    /// Ranks `local` of `shape` for the part of `spec`; shards arrive with the first Refresh.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: GptConfig,
        spec: PartSpec,
        b: usize,
        recompute: bool,
        shape: TpShape,
        local: std::ops::Range<usize>,
        threads: usize,
        exchange: Box<dyn Exchange>,
    ) -> Self {
        let whole = super::part::part_params(&cfg, &spec, 0);
        let group = ThreadGroup::spanning(shape.size, local.clone(), Some(exchange));
        let ranks = TpRanks::held(&cfg, &spec, b, recompute, shape, &whole, threads, local, group, None);
        let n = b * cfg.block_size * cfg.n_embd;
        TpFollower { cfg, spec, b, ranks, out: vec![0.0; n], kept: Default::default(), spare: Vec::new() }
    }

    fn kept(&mut self, key: u64, grads: bool) -> &mut Kept {
        let (per, nb) = (self.ranks.held_here(), self.spec.layers.len());
        let (b, cfg, size) = (self.b, self.cfg, self.ranks.size());
        let k = self.kept.entry(key).or_insert_with(|| self.spare.pop().unwrap_or_default());
        if k.blocks.len() < nb * per {
            k.blocks = (0..nb * per).map(|_| BlockActs::new(b, &cfg, size)).collect();
        }
        if grads && k.grads.len() < nb * per {
            k.grads = (0..nb * per).map(|_| BlockGrads::new(b * cfg.block_size, cfg.n_embd, size)).collect();
        }
        k
    }

    /// Runs one command; the answer, when it has one, goes back to the owner.
    pub fn handle(&mut self, cmd: TpCmd, mut arrays: Vec<Vec<f32>>) -> Result<Option<Vec<Vec<f32>>>, String> {
        let (b, cfg, per) = (self.b, self.cfg, self.ranks.held_here());
        let n = b * cfg.block_size * cfg.n_embd;
        let nb = self.spec.layers.len();
        let whole = |a: &[Vec<f32>], i: usize, what: &str| -> Result<(), String> {
            match a.get(i) {
                Some(v) if v.len() == n => Ok(()),
                Some(v) => Err(format!("{what}: {} elements, not {n}", v.len())),
                None => Err(format!("{what} is missing")),
            }
        };
        let layer = |l: u32| -> Result<usize, String> {
            match (l as usize) < nb {
                true => Ok(l as usize),
                false => Err(format!("block {l} of a part with {nb}")),
            }
        };
        match cmd {
            TpCmd::Refresh => {
                if arrays.len() != 12 * nb * per {
                    return Err(format!("{} shards, not {}", arrays.len(), 12 * nb * per));
                }
                for (rank, a) in self.ranks.ranks.iter_mut().zip(arrays.chunks_mut(12 * nb)) {
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
            TpCmd::Forward { key, l, keep } => {
                let l = layer(l)?;
                whole(&arrays, 0, "a block input")?;
                let x = std::mem::take(&mut arrays[0]);
                let mut out = std::mem::take(&mut self.out);
                if keep {
                    self.kept(key, false);
                    let mut k = self.kept.remove(&key).expect("kept");
                    let blocks = Some(&mut k.blocks[l * per..(l + 1) * per]);
                    self.ranks.forward(l, key, blocks, &x, &mut out, b, &cfg);
                    self.kept.insert(key, k);
                } else {
                    self.ranks.forward(l, key, None, &x, &mut out, b, &cfg);
                }
                self.out = out;
                self.ranks.failure().map_or(Ok(None), Err)
            }
            TpCmd::BackwardInput { key, l, keep, split, full, nondet } => {
                let l = layer(l)?;
                whole(&arrays, 0, "a block input")?;
                whole(&arrays, 1, "an output gradient")?;
                if full {
                    self.ranks.set_grads(l, &arrays[2..])?;
                }
                let (x, mut dres) = (std::mem::take(&mut arrays[0]), std::mem::take(&mut arrays[1]));
                if keep && !self.kept.contains_key(&key) {
                    return Err(format!("a backward of microbatch key {key} before its forward"));
                }
                let mut k = if keep || split {
                    self.kept(key, split);
                    self.kept.remove(&key).expect("kept")
                } else {
                    Kept::default()
                };
                let blocks = keep.then(|| &k.blocks[l * per..(l + 1) * per]);
                let grads = split.then(|| &mut k.grads[l * per..(l + 1) * per]);
                with_random_order(nondet, || {
                    self.ranks.backward_input(l, key, blocks, grads, &x, &mut dres, b, &cfg, full)
                });
                if keep || split {
                    self.kept.insert(key, k);
                }
                if let Some(e) = self.ranks.failure() {
                    return Err(e);
                }
                Ok(full.then(|| self.ranks.grads_of(l)))
            }
            TpCmd::BackwardWeight { key, l, nondet } => {
                let l = layer(l)?;
                whole(&arrays, 0, "a block input")?;
                self.ranks.set_grads(l, &arrays[1..])?;
                let k =
                    self.kept.get(&key).ok_or_else(|| format!("a W of microbatch key {key} before its I"))?;
                if k.grads.len() < nb * per {
                    return Err(format!("a W of microbatch key {key} whose I kept no gradients"));
                }
                let (blocks, grads) = (&k.blocks[l * per..(l + 1) * per], &k.grads[l * per..(l + 1) * per]);
                let ranks = &mut self.ranks;
                with_random_order(nondet, || {
                    ranks.backward_weight(l, key, blocks, grads, &arrays[0], b, &cfg)
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
