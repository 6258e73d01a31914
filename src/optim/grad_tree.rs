//! The one order in which a step's microbatch gradients are summed: a fixed
//! binary tree over the *global* microbatch index, so the bits of the sum do
//! not depend on how the microbatches are split over data-parallel replicas,
//! pipeline stages or processes.
//!
//! Node (l, a) covers microbatches [a·2^l, (a+1)·2^l) ∩ [0, M); its sum is
//! node(l−1, 2a) + node(l−1, 2a+1) elementwise, and a node whose right child
//! is empty is its left child unchanged. A replica owns a contiguous block
//! [s, e) of the M microbatches: a [`TreeSum`] folds its leaves (each
//! microbatch's gradient, computed into a zeroed buffer) into the maximal
//! nodes inside the block with a binary counter (O(log m) buffers), and
//! [`combine`] joins the nodes of every block into the root by the same
//! tree. One replica holding all of [0, M) runs the same adds itself.
//!
//! This module never decides *which* microbatches a replica owns: the data
//! loader does (replica r of dp holds r·m … (r+1)·m − 1).

use crate::model::{Arch, Param, PartSpec};
use std::collections::BTreeMap;
use std::ops::Range;

/// Gradients of a set of tensors, one vector per tensor.
pub type Grads = Vec<Vec<f32>>;

/// A tree node, named by the microbatches it covers ([lo, hi)). A node and
/// its promotion (the parent whose right child is empty) cover the same
/// microbatches and hold the same bits, so the span alone identifies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Span {
    pub lo: usize,
    pub hi: usize,
}

/// Most partial sums a replica's tree holds at once when its `m` leaves come
/// in ascending order: one node per binary digit of the count (the planner's
/// figure; schedules that finish microbatches out of order hold their early
/// leaves too).
pub fn held_sets(m: usize) -> usize {
    (usize::BITS - m.leading_zeros()) as usize
}

/// Most partial sums a block's tree holds after any leaf when it keeps no
/// spare buffer (ZeRO-2 and 3's shard trees): the most one-bits of a count
/// up to `m`.
pub fn scattered_sets(m: usize) -> usize {
    (usize::BITS - (m + 1).leading_zeros()) as usize - 1
}

/// `a += b`, tensor by tensor: the tree's one add.
pub fn add_into(a: &mut Grads, b: &Grads) {
    debug_assert_eq!(a.len(), b.len());
    for (x, y) in a.iter_mut().zip(b) {
        debug_assert_eq!(x.len(), y.len());
        for (p, &q) in x.iter_mut().zip(y) {
            *p += q;
        }
    }
}

/// The levels of the tree over `total` microbatches: the root is (levels, 0).
fn root_level(total: usize) -> u32 {
    total.max(1).next_power_of_two().trailing_zeros()
}

/// The microbatches node (l, a) covers, clipped to [0, total).
fn span_of(level: u32, index: usize, total: usize) -> Span {
    let lo = (index << level).min(total);
    let hi = ((index + 1) << level).min(total);
    Span { lo, hi }
}

/// Folds one block's leaves, given in any order, into the maximal tree nodes
/// inside the block. Leaves that arrive ahead of the next one in ascending
/// order wait (chunked schedules may run W out of order); in-order leaves
/// keep at most about 2·log₂ m nodes alive.
///
/// A node is host gradients ([`Grads`]) on the CPU, a device buffer on GPUs
/// (model/gpu/part.rs adds them there): the tree's shape and the order
/// of its adds live here once, whatever holds the values.
pub struct TreeSum<G = Grads> {
    block: Range<usize>,
    total: usize,
    next: usize,
    /// Nodes by (level, index), the newest last; each is a complete node.
    stack: Vec<(u32, usize, G)>,
    early: BTreeMap<usize, G>,
    /// Freed buffers, reused for the next leaf.
    spare: Vec<G>,
    /// Most gradient sets held at once (stack + early), for reports.
    pub peak_held: usize,
}

impl TreeSum<Grads> {
    /// Floats held: nodes, early leaves and spare buffers (memory reports).
    pub fn floats(&self) -> usize {
        let set = |g: &Grads| g.iter().map(Vec::len).sum::<usize>();
        self.stack.iter().map(|n| set(&n.2)).sum::<usize>()
            + self.early.values().map(set).sum::<usize>()
            + self.spare.iter().map(set).sum::<usize>()
    }

    /// Adds microbatch `g`'s leaf gradient.
    pub fn push(&mut self, g: usize, leaf: Grads) {
        self.push_with(g, leaf, &mut |a, b| add_into(a, b));
    }
}

impl<G> TreeSum<G> {
    pub fn new(block: Range<usize>, total: usize) -> TreeSum<G> {
        assert!(block.start <= block.end && block.end <= total, "block {block:?} of {total} microbatches");
        TreeSum {
            next: block.start,
            block,
            total,
            stack: Vec::new(),
            early: BTreeMap::new(),
            spare: Vec::new(),
            peak_held: 0,
        }
    }

    pub fn block(&self) -> Range<usize> {
        self.block.clone()
    }

    /// A buffer a folded node freed, to hold the next leaf (None: make one).
    pub fn spare(&mut self) -> Option<G> {
        self.spare.pop()
    }

    /// Adds microbatch `g`'s leaf; `add(a, b)` is the tree's one add, a += b.
    pub fn push_with(&mut self, g: usize, leaf: G, add: &mut dyn FnMut(&mut G, &G)) {
        assert!(self.block.contains(&g), "microbatch {g} outside the block {:?}", self.block);
        assert!(g >= self.next && !self.early.contains_key(&g), "microbatch {g}'s gradient arrived twice");
        if g != self.next {
            self.early.insert(g, leaf);
            self.peak_held = self.peak_held.max(self.stack.len() + self.early.len());
            return;
        }
        // In order: no map entry (the engine's steady state allocates nothing).
        self.fold(g, leaf, add);
        self.next += 1;
        while let Some(leaf) = self.early.remove(&self.next) {
            self.fold(self.next, leaf, add);
            self.next += 1;
        }
        self.peak_held = self.peak_held.max(self.stack.len() + self.early.len());
    }

    fn fold(&mut self, g: usize, leaf: G, add: &mut dyn FnMut(&mut G, &G)) {
        self.stack.push((0, g, leaf));
        loop {
            let n = self.stack.len();
            let (l, a, _) = self.stack[n - 1];
            if a % 2 == 0 {
                // A left child whose right sibling is empty is its parent.
                if span_of(l, a + 1, self.total).lo == self.total && l < root_level(self.total) {
                    self.stack[n - 1].0 = l + 1;
                    self.stack[n - 1].1 = a / 2;
                    continue;
                }
                break;
            }
            if n < 2 || self.stack[n - 2].0 != l || self.stack[n - 2].1 != a - 1 {
                break;
            }
            let (_, _, right) = self.stack.pop().expect("two nodes");
            let left = self.stack.last_mut().expect("two nodes");
            add(&mut left.2, &right);
            left.0 = l + 1;
            left.1 = a / 2;
            self.spare.push(right);
        }
    }

    /// Drops a step's partial sums (a step that failed and is run again).
    pub fn reset(&mut self) {
        self.next = self.block.start;
        self.spare.extend(self.stack.drain(..).map(|n| n.2));
        self.spare.extend(std::mem::take(&mut self.early).into_values());
    }

    /// Starts a step over another block of another total (a batch ramp's
    /// steps differ in size); partial sums are dropped, buffers kept.
    pub fn set_block(&mut self, block: Range<usize>, total: usize) {
        assert!(block.start <= block.end && block.end <= total, "block {block:?} of {total} microbatches");
        self.reset();
        (self.next, self.block, self.total) = (block.start, block, total);
    }

    /// Frees the buffers kept for later leaves (ZeRO-2 and 3 hold no whole
    /// gradient between steps).
    pub fn release_spares(&mut self) {
        self.spare = Vec::new();
    }

    /// Gives back a buffer (a root taken and spent) for later leaves.
    pub fn recycle(&mut self, buffer: G) {
        self.spare.push(buffer);
    }

    /// Whether every leaf of the block has been folded.
    pub fn complete(&self) -> bool {
        self.next == self.block.end
    }

    /// The block's nodes in ascending order, ready for [`combine`]; the
    /// accumulator is empty afterwards and may start the next step.
    pub fn take_nodes(&mut self) -> Vec<(Span, G)> {
        assert!(self.complete(), "block {:?} has folded microbatches up to {} only", self.block, self.next);
        self.next = self.block.start;
        let total = self.total;
        self.stack.drain(..).map(|(l, a, g)| (span_of(l, a, total), g)).collect()
    }

    /// The root, when the block is every microbatch: with empty right halves
    /// promoted as they complete, the stack then ends as that one node.
    pub fn take_root(&mut self) -> G {
        assert!(self.complete() && self.block == (0..self.total), "the root needs every microbatch");
        assert_eq!(self.stack.len(), 1, "a whole block folds into the root");
        self.next = self.block.start;
        self.stack.pop().expect("the root").2
    }
}

/// The root of the tree over `total` microbatches from nodes that cover it
/// (each block's [`TreeSum::take_nodes`], in any order). Nodes that do not
/// form a cover of tree nodes (a backend that sums its block in its own order)
/// are summed in ascending microbatch order instead.
pub fn combine(nodes: Vec<(Span, Grads)>, total: usize) -> Grads {
    let mut by_span: BTreeMap<Span, Grads> = BTreeMap::new();
    for (s, g) in nodes {
        assert!(by_span.insert(s, g).is_none(), "two gradient sets for microbatches {s:?}");
    }
    let tree_cover = covers(&by_span, root_level(total), 0, total);
    if !tree_cover {
        let mut it = by_span.into_values();
        let mut sum = it.next().expect("at least one gradient set");
        it.for_each(|g| add_into(&mut sum, &g));
        return sum;
    }
    node_sum(&mut by_span, root_level(total), 0, total).expect("a non-empty tree")
}

fn covers(have: &BTreeMap<Span, Grads>, level: u32, index: usize, total: usize) -> bool {
    let s = span_of(level, index, total);
    if s.lo == s.hi || have.contains_key(&s) {
        return true;
    }
    level > 0 && covers(have, level - 1, 2 * index, total) && covers(have, level - 1, 2 * index + 1, total)
}

fn node_sum(have: &mut BTreeMap<Span, Grads>, level: u32, index: usize, total: usize) -> Option<Grads> {
    let s = span_of(level, index, total);
    if s.lo == s.hi {
        return None;
    }
    if let Some(g) = have.remove(&s) {
        return Some(g);
    }
    let mut left = node_sum(have, level - 1, 2 * index, total).expect("a non-empty left child");
    if let Some(right) = node_sum(have, level - 1, 2 * index + 1, total) {
        add_into(&mut left, &right);
    }
    Some(left)
}

/// Which of a part's gradients an action writes: the head's (final norm and
/// the head's weight: its share of the tied wte, or the untied lm_head) in F,
/// everything else in B or W.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaf {
    Head,
    Body,
}

/// A model part's gradients summed by the tree: the head's tensors and the
/// rest each in their own [`TreeSum`], since F writes the one and B/W the other.
///
/// The tree reads and writes a part's gradient buffers: each parameter's
/// (`params`), and the head's share of the tied wte (`wte_head_grad`, empty
/// on a part without the head). The exchanged form ("part order") is one
/// vector per parameter, then the head's share of the tied wte when the
/// part has the head; the head-only part's copy of wte, whose gradient only
/// the tied combination writes, travels as an empty vector.
pub struct PartTree {
    head: TreeSum,
    body: TreeSum,
    head_idx: Vec<usize>,
    body_idx: Vec<usize>,
    has_head: bool,
    /// The part's parameter count.
    params: usize,
}

impl PartTree {
    /// The tree of the part `spec` of model `cfg`, whose `params` tensors are
    /// in the order `spec` lists them, for microbatches `block` of `total`.
    pub fn new(spec: &PartSpec, cfg: &Arch, params: usize, block: Range<usize>, total: usize) -> PartTree {
        // F writes the final norm's gradients and, untied, the lm_head's.
        let head_norm: Vec<usize> = spec.head_leaf(cfg).collect();
        let wte_copy = (spec.head && !spec.embedding && cfg.tied()).then(|| spec.head_wte(cfg));
        let body_idx = (0..params).filter(|i| !head_norm.contains(i) && Some(*i) != wte_copy).collect();
        PartTree {
            head: TreeSum::new(block.clone(), total),
            body: TreeSum::new(block, total),
            head_idx: head_norm,
            body_idx,
            has_head: spec.head,
            params,
        }
    }

    /// Moves microbatch `g`'s finished gradients of kind `which` out of the
    /// part's buffers into the tree, leaving zeroed buffers for the next
    /// microbatch.
    pub fn push(&mut self, params: &mut [Param], wte_head_grad: &mut Vec<f32>, which: Leaf, g: usize) {
        if let Some(leaf) = self.take_leaf(params, wte_head_grad, which, true) {
            // The buffers folds free come back as the next leaves' (a steady
            // step allocates nothing).
            match which {
                Leaf::Head => self.head.push(g, leaf),
                Leaf::Body => self.body.push(g, leaf),
            }
        }
    }

    /// Adds microbatch `g`'s set of kind `which` (the tensors `take_leaf`
    /// gives, all cut to one shard: the tree's adds are elementwise). Sets
    /// pushed here come from elsewhere, so the buffers a fold frees are
    /// dropped, not kept for leaves.
    pub fn push_set(&mut self, which: Leaf, g: usize, set: Grads) {
        let tree = match which {
            Leaf::Head => &mut self.head,
            Leaf::Body => &mut self.body,
        };
        tree.push(g, set);
        tree.release_spares();
    }

    /// The part's finished gradients of kind `which`, moved out; zeroed
    /// buffers are left in their place, or with `refill` false empty ones
    /// (the caller zeroes them when next needed, so a leaf on its way out
    /// and the next leaf's buffers are not held at once). None for the
    /// head's on a part without it.
    pub fn take_leaf(
        &mut self,
        params: &mut [Param],
        wte_head_grad: &mut Vec<f32>,
        which: Leaf,
        refill: bool,
    ) -> Option<Grads> {
        if which == Leaf::Head && !self.has_head {
            return None;
        }
        let (tree, idx) = match which {
            Leaf::Head => (&mut self.head, &self.head_idx),
            Leaf::Body => (&mut self.body, &self.body_idx),
        };
        let mut fresh = match tree.spare() {
            _ if !refill => vec![Vec::new(); idx.len() + usize::from(which == Leaf::Head)],
            Some(mut g) => {
                g.iter_mut().for_each(|t| t.fill(0.0));
                g
            }
            None => {
                let mut v: Grads = idx.iter().map(|&i| vec![0.0; params[i].grad.len()]).collect();
                if which == Leaf::Head {
                    v.push(vec![0.0; wte_head_grad.len()]);
                }
                v
            }
        };
        // The zeroed set goes into the part and the part's set becomes the leaf.
        for (k, &i) in idx.iter().enumerate() {
            std::mem::swap(&mut params[i].grad, &mut fresh[k]);
        }
        if which == Leaf::Head {
            std::mem::swap(wte_head_grad, &mut fresh[idx.len()]);
        }
        Some(fresh)
    }

    /// Starts a step: partial sums of a step that did not finish are dropped.
    pub fn reset(&mut self) {
        self.head.reset();
        self.body.reset();
    }

    /// Empties the tree, keeping no buffer (a tree fed by [`Self::push_set`]).
    pub fn clear(&mut self) {
        self.reset();
        self.release_spares();
    }

    /// Both trees over another block (see [`TreeSum::set_block`]).
    pub fn set_block(&mut self, block: Range<usize>, total: usize) {
        self.head.set_block(block.clone(), total);
        self.body.set_block(block, total);
    }

    /// The replica's microbatches, as global indices within the step.
    pub fn block(&self) -> Range<usize> {
        self.body.block()
    }

    /// Floats both trees hold (see [`TreeSum::floats`]).
    pub fn floats(&self) -> usize {
        self.head.floats() + self.body.floats()
    }

    /// Frees both trees' spare buffers (see [`TreeSum::release_spares`]).
    pub fn release_spares(&mut self) {
        self.head.release_spares();
        self.body.release_spares();
    }

    /// Gradient sets held (nodes and early leaves, both kinds), at most so far.
    pub fn peak_held(&self) -> usize {
        self.head.peak_held.max(self.body.peak_held)
    }

    /// The block's nodes in part order (see the type's comment).
    pub fn take_nodes(&mut self) -> Vec<(Span, Grads)> {
        let body = self.body.take_nodes();
        let head = if self.has_head { self.head.take_nodes() } else { Vec::new() };
        let n = self.params;
        let mut out = Vec::with_capacity(body.len());
        let mut head = head.into_iter();
        for (span, b) in body {
            let mut full: Grads = vec![Vec::new(); n + usize::from(self.has_head)];
            for (&i, g) in self.body_idx.iter().zip(b) {
                full[i] = g;
            }
            if self.has_head {
                let (hs, h) = head.next().expect("the head's nodes match the body's");
                assert_eq!(hs, span, "the head's and the body's nodes cover the same microbatches");
                let mut h = h.into_iter();
                for &i in &self.head_idx {
                    full[i] = h.next().expect("head tensors");
                }
                full[n] = h.next().expect("the head's wte share");
            }
            out.push((span, full));
        }
        out
    }

    /// Puts a part-order gradient set (a reduction's result) into the part's
    /// buffers; empty vectors leave the tensor alone.
    pub fn set(params: &mut [Param], wte_head_grad: &mut Vec<f32>, grads: Grads) {
        let n = params.len();
        for (k, g) in grads.into_iter().enumerate() {
            if g.is_empty() {
                continue;
            }
            if k < n {
                params[k].grad = g;
            } else {
                *wte_head_grad = g;
            }
        }
    }

    /// Sums the block's nodes into the part itself: the whole reduction when
    /// one replica holds every microbatch. The part's spent buffers join the
    /// pool, so a steady-state step allocates nothing here.
    pub fn finish_local(&mut self, params: &mut [Param], wte_head_grad: &mut Vec<f32>) {
        let mut root = self.body.take_root();
        for (k, &i) in self.body_idx.iter().enumerate() {
            std::mem::swap(&mut params[i].grad, &mut root[k]);
        }
        self.body.recycle(root);
        if self.has_head {
            let mut root = self.head.take_root();
            for (k, &i) in self.head_idx.iter().enumerate() {
                std::mem::swap(&mut params[i].grad, &mut root[k]);
            }
            std::mem::swap(wte_head_grad, &mut root[self.head_idx.len()]);
            self.head.recycle(root);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{Purpose, Rng};

    fn leaves(m: usize, len: usize) -> Vec<Grads> {
        (0..m)
            .map(|g| {
                let mut r = Rng::new(11, Purpose::Test, &[g as u64]);
                // Mixed magnitudes, so association changes the rounding.
                vec![(0..len).map(|_| (r.normal() * 10f64.powi(r.below(7) as i32 - 3)) as f32).collect()]
            })
            .collect()
    }

    fn bits(g: &Grads) -> Vec<u32> {
        g.iter().flatten().map(|x| x.to_bits()).collect()
    }

    fn block_nodes(ls: &[Grads], block: Range<usize>, order: &[usize]) -> Vec<(Span, Grads)> {
        let mut t = TreeSum::new(block, ls.len());
        for &g in order {
            t.push(g, ls[g].clone());
        }
        t.take_nodes()
    }

    #[test]
    fn a_spareless_tree_holds_as_many_sums_as_the_most_one_bits_of_a_count() {
        let most = |m: usize| (1..=m).map(|k: usize| k.count_ones() as usize).max().unwrap();
        for m in 1..200 {
            assert_eq!(scattered_sets(m), most(m), "m = {m}");
        }
    }

    #[test]
    fn every_block_split_of_1_to_12_microbatches_gives_the_whole_trees_bits() {
        for m in 1..=12 {
            let ls = leaves(m, 64);
            let whole = combine(block_nodes(&ls, 0..m, &(0..m).collect::<Vec<_>>()), m);
            for dp in (1..=m).filter(|d| m % d == 0) {
                let per = m / dp;
                let mut nodes = Vec::new();
                // Blocks handed to the combination in reverse: arrival order must not matter.
                for r in (0..dp).rev() {
                    let b = r * per..(r + 1) * per;
                    nodes.extend(block_nodes(&ls, b.clone(), &b.collect::<Vec<_>>()));
                }
                assert_eq!(bits(&combine(nodes, m)), bits(&whole), "M = {m}, dp = {dp}");
            }
        }
    }

    #[test]
    fn leaves_out_of_order_give_the_bits_of_leaves_in_order() {
        let m = 11;
        let ls = leaves(m, 32);
        let in_order = combine(block_nodes(&ls, 0..m, &(0..m).collect::<Vec<_>>()), m);
        let shuffled = [3, 0, 10, 1, 2, 7, 5, 4, 9, 6, 8];
        assert_eq!(bits(&combine(block_nodes(&ls, 0..m, &shuffled), m)), bits(&in_order));
        let reversed: Vec<usize> = (0..m).rev().collect();
        assert_eq!(bits(&combine(block_nodes(&ls, 0..m, &reversed), m)), bits(&in_order));
    }

    #[test]
    fn the_tree_is_the_dyadic_pairing_and_differs_from_a_running_sum() {
        let ls = leaves(6, 256);
        let got = combine(block_nodes(&ls, 0..6, &[0, 1, 2, 3, 4, 5]), 6);
        // ((g0+g1)+(g2+g3)) + (g4+g5)
        let pair = |a: &Grads, b: &Grads| {
            let mut s = a.clone();
            add_into(&mut s, b);
            s
        };
        let want = pair(&pair(&pair(&ls[0], &ls[1]), &pair(&ls[2], &ls[3])), &pair(&ls[4], &ls[5]));
        assert_eq!(bits(&got), bits(&want));
        let mut running = ls[0].clone();
        ls[1..].iter().for_each(|g| add_into(&mut running, g));
        assert_ne!(bits(&got), bits(&running), "the leaves should be chosen so association shows");
    }

    #[test]
    fn in_order_leaves_keep_logarithmically_many_buffers() {
        let m = 64;
        let ls = leaves(m, 1);
        let mut t = TreeSum::new(0..m, m);
        for (g, l) in ls.into_iter().enumerate() {
            t.push(g, l);
        }
        assert!(t.peak_held <= 7, "held {} gradient sets for 64 microbatches", t.peak_held);
        assert_eq!(held_sets(64), 7, "the planner's figure is the bound this test holds");
        assert_eq!(t.take_nodes().len(), 1);
    }

    /// A node that records its adds: the tree's order, whatever holds the values.
    fn traced(ls: std::ops::Range<usize>, block: Range<usize>, total: usize) -> TreeSum<String> {
        let mut t = TreeSum::new(block, total);
        for g in ls {
            t.push_with(g, g.to_string(), &mut |a: &mut String, b: &String| *a = format!("({a}+{b})"));
        }
        t
    }

    #[test]
    fn a_tree_of_any_node_type_adds_in_the_dyadic_order_and_splits_into_the_same_nodes() {
        assert_eq!(traced(0..6, 0..6, 6).take_root(), "(((0+1)+(2+3))+(4+5))");
        let (mut a, mut b) = (traced(0..3, 0..3, 6), traced(3..6, 3..6, 6));
        let spans = |t: &mut TreeSum<String>| t.take_nodes();
        assert_eq!(
            spans(&mut a),
            [(Span { lo: 0, hi: 2 }, "(0+1)".to_string()), (Span { lo: 2, hi: 3 }, "2".to_string())]
        );
        assert_eq!(
            spans(&mut b),
            [(Span { lo: 3, hi: 4 }, "3".to_string()), (Span { lo: 4, hi: 6 }, "(4+5)".to_string())]
        );
    }

    #[test]
    fn recycled_buffers_come_back_for_later_leaves_and_a_reset_frees_partial_sums() {
        let mut t: TreeSum<String> = TreeSum::new(0..4, 4);
        t.recycle("spare".into());
        assert_eq!(t.spare().as_deref(), Some("spare"));
        assert_eq!(t.spare(), None);
        let mut add = |a: &mut String, b: &String| *a = format!("({a}+{b})");
        t.push_with(0, "0".into(), &mut add);
        t.push_with(1, "1".into(), &mut add);
        t.reset();
        // The fold freed leaf 1's buffer; the reset frees the partial sum (0+1).
        let mut freed: Vec<String> = std::iter::from_fn(|| t.spare()).collect();
        freed.sort();
        assert_eq!(freed, ["(0+1)", "1"]);
        assert!(!t.complete(), "a reset step starts from its first microbatch");
    }

    #[test]
    fn blocks_that_are_not_tree_nodes_sum_in_microbatch_order() {
        let ls = leaves(6, 16);
        // Two block sums of 3 (not tree nodes): the fallback adds them in order.
        let a = Span { lo: 0, hi: 3 };
        let b = Span { lo: 3, hi: 6 };
        let got = combine(vec![(b, ls[1].clone()), (a, ls[0].clone())], 6);
        let mut want = ls[0].clone();
        add_into(&mut want, &ls[1]);
        assert_eq!(bits(&got), bits(&want));
    }
}
