//! How a block is split over tensor-parallel ranks, and how the ranks'
//! partial sums meet: each split sum (a row-parallel product, the input
//! gradient of column-parallel ones) is defined, whatever the number of
//! ranks, as the fixed pairwise tree over `slices` K-slices; a rank sums its
//! aligned run of slices, and the group joins the runs by the tree's upper
//! levels, so every rank count dividing the slices gives the bits of one.
//! [`shard`] cuts a whole tensor into a rank's piece, [`unshard`] joins the
//! pieces back; [`ThreadGroup`] is the group of ranks that are threads of
//! one process (and, through an [`Exchange`], of several).

use crate::kernels::cpu::tree::{tree_sum, tree_sum_elementwise};
use crate::kernels::profile::{timed, Kernel};
pub use crate::model::arch::Cut;
use crate::model::params::Arch;

/// Joins every rank's subtree sum into the root of the slice tree, and
/// moves rows between ranks for sequence parallelism. Every rank of a group
/// makes the same calls in the same order.
pub trait TensorGroup: Sync {
    /// Replaces `node`, rank `rank`'s subtree sum, with the sum of every
    /// rank's node by the pairwise tree over rank order: the same bits on
    /// every rank.
    fn all_reduce(&self, rank: usize, node: &mut [f32]);
    /// `out` = rank `rank`'s run (the `rank`-th of `size` equal runs) of
    /// [`Self::all_reduce`]'s sum of every rank's `node`: the same bits as
    /// that run of the all-reduce, since the tree is element by element.
    fn reduce_scatter(&self, rank: usize, node: &[f32], out: &mut [f32]);
    /// `whole` = every rank's own run of it (the `r`-th of `size` equal
    /// runs from rank `r`), joined in rank order.
    fn all_gather(&self, rank: usize, whole: &mut [f32]);
    /// `buf` = rank `root`'s `buf` on every rank.
    fn broadcast(&self, rank: usize, root: usize, buf: &mut [f32]);
}

/// Which tensor-parallel rank computes, out of how many, how many slices
/// the split sums are defined over, and whether the ranks share out the
/// rows between the split regions (sequence parallelism).
#[derive(Clone, Copy)]
pub struct TpRank<'g> {
    pub rank: usize,
    pub size: usize,
    pub slices: usize,
    /// Megatron's sequence parallelism: the norms, the residual adds and
    /// what they keep work on this rank's run of the N rows only; a split
    /// region's input is all-gathered and its output reduce-scattered.
    pub sp: bool,
    pub group: Option<&'g dyn TensorGroup>,
}

impl TpRank<'_> {
    /// Slices of each split sum this rank computes.
    pub fn leaves(&self) -> usize {
        self.slices / self.size
    }

    fn reduce(&self, node: &mut [f32]) {
        if self.size > 1 {
            self.group().all_reduce(self.rank, node);
        }
    }

    fn group(&self) -> &dyn TensorGroup {
        self.group.expect("a split block needs its tensor group")
    }

    /// Whether rows are shared out (sequence parallelism on more than one rank).
    pub fn sequence_parallel(&self) -> bool {
        self.sp && self.size > 1
    }

    /// The rows of a microbatch's `n` this rank normalizes and adds
    /// residuals for: its run of them under sequence parallelism, else all.
    pub fn rows(&self, n: usize) -> std::ops::Range<usize> {
        match self.sequence_parallel() {
            true => {
                let run = n / self.size;
                self.rank * run..(self.rank + 1) * run
            }
            false => 0..n,
        }
    }

    /// `out` = this rank's rows of the group's sum of `node` (sequence parallelism only).
    pub fn scatter(&self, node: &[f32], out: &mut [f32]) {
        self.group().reduce_scatter(self.rank, node, out);
    }

    /// `whole`'s other rows from the ranks that hold them (sequence parallelism only).
    pub fn gather(&self, whole: &mut [f32]) {
        self.group().all_gather(self.rank, whole);
    }

    /// `buf` = rank `root`'s on every rank.
    pub fn broadcast(&self, root: usize, buf: &mut [f32]) {
        if self.size > 1 {
            self.group().broadcast(self.rank, root, buf);
        }
    }
}

/// out (N, C) = the slice tree over `out` (slice 0) and `leaves`, then over
/// the group (both families' split sums end here). With `rows`, the group's
/// sum goes there, this rank's rows of it only (a reduce-scatter), and `out`
/// keeps the rank's own subtree sum.
pub fn sum_slices(out: &mut [f32], leaves: &mut [Vec<f32>], tp: &TpRank, rows: Option<&mut [f32]>) {
    if !leaves.is_empty() {
        let mut bufs: Vec<&mut [f32]> =
            std::iter::once(out as &mut [f32]).chain(leaves.iter_mut().map(|l| l.as_mut_slice())).collect();
        timed(Kernel::Residual, || tree_sum(&mut bufs));
    }
    match rows {
        Some(dst) => tp.scatter(out, dst),
        None => tp.reduce(out),
    }
}

/// How block tensor `i` (its index among the block's tensors) is cut.
pub fn cut_of(cfg: &Arch, i: usize) -> Cut {
    cfg.role(i).cut()
}

/// Rank `rank` of `size`'s piece of block tensor `i`, whose last dimension is `cols` long.
pub fn shard(cut: Cut, full: &[f32], cols: usize, rank: usize, size: usize) -> Vec<f32> {
    let mut out = Vec::new();
    shard_into(&mut out, cut, full, cols, rank, size);
    out
}

/// [`shard`] into `out`, reusing its memory (ranks cut their shards at every forward).
pub fn shard_into(out: &mut Vec<f32>, cut: Cut, full: &[f32], cols: usize, rank: usize, size: usize) {
    out.clear();
    match cut {
        Cut::Whole => out.extend_from_slice(full),
        Cut::Rows => {
            let run = full.len() / size;
            out.extend_from_slice(&full[rank * run..(rank + 1) * run]);
        }
        Cut::Columns { parts } => {
            let (width, piece) = (cols / parts, cols / parts / size);
            for row in full.chunks(cols) {
                for p in 0..parts {
                    out.extend_from_slice(&row[p * width + rank * piece..][..piece]);
                }
            }
        }
    }
}

/// Block tensor `i` joined from every rank's piece (rank order); the
/// inverse of [`shard`]. A whole tensor is rank 0's.
pub fn unshard(cut: Cut, pieces: &[&[f32]], cols: usize) -> Vec<f32> {
    let len = match cut {
        Cut::Whole => pieces[0].len(),
        _ => pieces.iter().map(|p| p.len()).sum(),
    };
    let mut full = vec![0.0; len];
    unshard_into(&mut full, cut, pieces, cols);
    full
}

/// [`unshard`] into `full`, the whole tensor's memory (gradients are joined
/// after every block's weight gradients).
pub fn unshard_into(full: &mut [f32], cut: Cut, pieces: &[&[f32]], cols: usize) {
    let size = pieces.len();
    match cut {
        Cut::Whole => full.copy_from_slice(pieces[0]),
        Cut::Rows => {
            for (dst, src) in full.chunks_mut(full.len() / size).zip(pieces) {
                dst.copy_from_slice(src);
            }
        }
        Cut::Columns { parts } => {
            let (width, piece) = (cols / parts, cols / parts / size);
            for (r, sh) in pieces.iter().enumerate() {
                for (row, src) in sh.chunks(cols / size).enumerate() {
                    for p in 0..parts {
                        let at = row * cols + p * width + r * piece;
                        full[at..at + piece].copy_from_slice(&src[p * piece..(p + 1) * piece]);
                    }
                }
            }
        }
    }
}

/// Tensor-parallel ranks that are threads of one process: each puts its
/// node in a slot, all wait, each sums every slot by the tree, all wait again
/// (so no slot is overwritten before every rank has read it).
pub struct ThreadGroup {
    /// One node per rank of the whole group; this process fills `local`'s,
    /// the exchange the others'.
    slots: Vec<std::sync::RwLock<Vec<f32>>>,
    local: std::ops::Range<usize>,
    barrier: std::sync::Barrier,
    exchange: Option<Box<dyn Exchange>>,
    /// All-reduces so far: every rank of the group makes the same calls in
    /// the same order, so the count names a call across processes.
    calls: std::sync::atomic::AtomicU64,
    /// Why an exchange failed. The ranks finish their calls on what they
    /// hold (a rank stopping alone would leave the others at a barrier) and
    /// the caller reads this after: their results are void.
    failed: std::sync::Mutex<Option<String>>,
}

/// How the ranks of one process meet the group's other processes: this
/// process's nodes for call `seq` go out, every other rank's come back.
pub trait Exchange: Send + Sync {
    /// `local`: the nodes of ranks `first..first + local.len()`. Returns
    /// (rank, node) for every rank held elsewhere, or why they never came.
    fn swap(&self, seq: u64, first: usize, local: &[&[f32]]) -> Result<Vec<(usize, Vec<f32>)>, String>;
}

/// A group's processes share one exchange between their owner and followers.
impl<T: Exchange + ?Sized> Exchange for std::sync::Arc<T> {
    fn swap(&self, seq: u64, first: usize, local: &[&[f32]]) -> Result<Vec<(usize, Vec<f32>)>, String> {
        (**self).swap(seq, first, local)
    }
}

impl ThreadGroup {
    /// Every rank in this process.
    pub fn new(size: usize) -> Self {
        ThreadGroup::spanning(size, 0..size, None)
    }

    /// Ranks `local` of `size` in this process, the rest reached by `exchange`.
    pub fn spanning(size: usize, local: std::ops::Range<usize>, exchange: Option<Box<dyn Exchange>>) -> Self {
        assert!(exchange.is_some() || local == (0..size), "ranks elsewhere need an exchange");
        ThreadGroup {
            slots: (0..size).map(|_| std::sync::RwLock::new(Vec::new())).collect(),
            barrier: std::sync::Barrier::new(local.len()),
            local,
            exchange,
            calls: std::sync::atomic::AtomicU64::new(0),
            failed: std::sync::Mutex::new(None),
        }
    }
}

impl ThreadGroup {
    /// Why an exchange with the other processes failed, if one did.
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().map(|f| f.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    fn fail(&self, why: String) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
    }
}

impl ThreadGroup {
    /// Puts rank `rank`'s `node` in its slot and, once every local rank has,
    /// the group's other processes' nodes in theirs. False when the exchange
    /// failed: the other processes' slots then hold nothing (or an older
    /// call's nodes), the ranks leave their results as they are and the
    /// caller, reading `failure`, voids them. Each call ends with [`Self::done`].
    fn publish(&self, rank: usize, node: &[f32]) -> bool {
        {
            let mut slot = self.slots[rank].write().expect("slot");
            slot.clear();
            slot.extend_from_slice(node);
        }
        self.barrier.wait();
        if let Some(x) = &self.exchange {
            // The process's first rank trades for all of them; the others wait.
            if rank == self.local.start && self.failure().is_none() {
                let seq = self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let theirs = {
                    let held: Vec<_> =
                        self.local.clone().map(|r| self.slots[r].read().expect("slot")).collect();
                    let nodes: Vec<&[f32]> = held.iter().map(|g| g.as_slice()).collect();
                    x.swap(seq, self.local.start, &nodes)
                };
                match theirs {
                    Ok(theirs) => {
                        let len = node.len();
                        let wrong = theirs.iter().find(|(r, n)| {
                            self.local.contains(r) || *r >= self.slots.len() || n.len() != len
                        });
                        match wrong {
                            // An exchange that checks less than `Link` does must
                            // not turn a hostile node into an index out of bounds.
                            Some((r, n)) => self.fail(format!(
                                "exchange {seq}: the exchange returned a node of {} elements for \
                                 rank {r}; wanted {len} elements for a rank of 0..{} outside {:?}",
                                n.len(),
                                self.slots.len(),
                                self.local
                            )),
                            None => {
                                for (r, n) in theirs {
                                    *self.slots[r].write().expect("slot") = n;
                                }
                            }
                        }
                    }
                    Err(e) => self.fail(e),
                }
            }
            self.barrier.wait();
        }
        self.failure().is_none()
    }

    /// Every rank's node of this call, in rank order.
    fn held(&self) -> Vec<std::sync::RwLockReadGuard<'_, Vec<f32>>> {
        self.slots.iter().map(|s| s.read().expect("slot")).collect()
    }

    /// No slot is written again before every rank has read this call's.
    fn done(&self) {
        self.barrier.wait();
    }
}

impl TensorGroup for ThreadGroup {
    fn all_reduce(&self, rank: usize, node: &mut [f32]) {
        if self.publish(rank, node) {
            let held = self.held();
            let nodes: Vec<&[f32]> = held.iter().map(|g| g.as_slice()).collect();
            tree_sum_elementwise(node, &nodes);
        }
        self.done();
    }

    fn reduce_scatter(&self, rank: usize, node: &[f32], out: &mut [f32]) {
        let run = out.len();
        assert_eq!(node.len(), run * self.slots.len(), "a reduce-scatter's node is one run per rank");
        if self.publish(rank, node) {
            let held = self.held();
            let runs: Vec<&[f32]> = held.iter().map(|g| &g[rank * run..(rank + 1) * run]).collect();
            tree_sum_elementwise(out, &runs);
        }
        self.done();
    }

    fn all_gather(&self, rank: usize, whole: &mut [f32]) {
        let run = whole.len() / self.slots.len();
        assert_eq!(run * self.slots.len(), whole.len(), "an all-gather's tensor is one run per rank");
        if self.publish(rank, &whole[rank * run..(rank + 1) * run]) {
            for (r, g) in self.held().iter().enumerate().filter(|(r, _)| *r != rank) {
                whole[r * run..(r + 1) * run].copy_from_slice(g);
            }
        }
        self.done();
    }

    fn broadcast(&self, rank: usize, root: usize, buf: &mut [f32]) {
        if self.publish(rank, buf) && rank != root {
            buf.copy_from_slice(&self.held()[root]);
        }
        self.done();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exchange with the group's other process that answers each call
    /// with `reply`.
    struct Canned(std::result::Result<Vec<(usize, Vec<f32>)>, String>);

    impl Exchange for Canned {
        fn swap(
            &self,
            _: u64,
            _: usize,
            _: &[&[f32]],
        ) -> std::result::Result<Vec<(usize, Vec<f32>)>, String> {
            self.0.clone()
        }
    }

    /// Ranks 0 and 1 of 4 all-reduce once in this process over `x`.
    fn reduce_over(x: Canned) -> (Option<String>, Vec<Vec<f32>>) {
        let group = ThreadGroup::spanning(4, 0..2, Some(Box::new(x)));
        let mut nodes = vec![vec![1.0f32; 8], vec![2.0; 8]];
        std::thread::scope(|sc| {
            for (r, n) in nodes.iter_mut().enumerate() {
                let g = &group;
                sc.spawn(move || g.all_reduce(r, n));
            }
        });
        (group.failure(), nodes)
    }

    #[test]
    fn a_failed_exchange_is_reported_with_its_own_words_not_an_index_panic() {
        let (failed, nodes) = reduce_over(Canned(Err("process rank 1 sent 3 elements, not 8".into())));
        assert_eq!(failed.as_deref(), Some("process rank 1 sent 3 elements, not 8"));
        assert_eq!(nodes, vec![vec![1.0; 8], vec![2.0; 8]], "void results are left as they were");
    }

    #[test]
    fn an_exchange_handing_back_a_short_node_fails_the_group_naming_the_rank() {
        let (failed, _) = reduce_over(Canned(Ok(vec![(2, vec![3.0; 8]), (3, vec![4.0; 3])])));
        let e = failed.expect("a short node fails the all-reduce");
        assert!(e.contains("3 elements for rank 3") && e.contains("wanted 8"), "{e}");
        let (failed, nodes) = reduce_over(Canned(Ok(vec![(2, vec![3.0; 8]), (3, vec![4.0; 8])])));
        assert_eq!((failed, nodes), (None, vec![vec![10.0; 8]; 2]));
    }
}
