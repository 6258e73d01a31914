//! Chunks on the CPU: `ModelPart`s computing on a rayon pool pinned to the
//! rank's cores, each microbatch's gradients folded into `optim::grad_tree`'s
//! `PartTree`, and AdamW state in host memory (under ZeRO, this replica's
//! shard of it; ZeRO-2 also keeps only the shard of the reduced gradients,
//! ZeRO-3 also only the shard of the weights, whole only between
//! `set_params` and `release_params`).

use super::{moments_of, BackwardPart, ChunkInput, ChunkOutput, StageCompute};
use crate::checkpoint::{Loaded, TensorState};
use crate::kernels::cpu::matmul::with_random_order;
use crate::model::part::{MicroActs, Mode, PartInput};
use crate::model::{ModelPart, Param};
use crate::optim::ema::EmaState;
use crate::optim::grad_tree::{Leaf, PartTree, Span};
use crate::optim::zero::Shard;
use crate::optim::{self, AdamState, Hyper};
use std::collections::BTreeMap;

/// Chunks on the CPU: model parts computing on the rank's thread pool.
pub struct CpuCompute {
    parts: Vec<ModelPart>,
    adam: Vec<AdamState>,
    /// Activations between F and B, by (chunk, microbatch).
    saved: BTreeMap<(usize, usize), MicroActs>,
    pool: rayon::ThreadPool,
    /// `PIPEWRIGHT_NONDET` names this stage: bias gradients summed in random order.
    nondet: bool,
    b: usize,
    /// Each chunk's microbatch gradients, summed by the fixed tree.
    trees: Vec<PartTree>,
    /// The elements whose optimizer state this replica keeps (ZeRO).
    shard: Shard,
    /// The ZeRO level (`parallel.zero`).
    zero: u8,
    /// ZeRO-3: each chunk's tensors' owned elements, the weights this
    /// replica updates; a chunk's `params` hold data only while gathered.
    owned: Vec<Vec<Vec<f32>>>,
    /// Each tensor's first norm slot (`optim::zero::first_slots`).
    first_slots: Vec<usize>,
    /// Most bytes of training state held at once (see `state_bytes`).
    peak_state_bytes: usize,
    /// The EMA of each chunk's weights (`optim.ema_decay`); empty when none is kept.
    ema: Vec<EmaState>,
    /// ZeRO-2 and 3 over replicas: each microbatch's gradient leaves as it
    /// is made (`leaves`, for the executor to scatter), and this replica's
    /// shards of every replica's come back into `shard_trees`: per chunk,
    /// one tree per replica's block, joined by `grad_tree::combine`.
    scatter: bool,
    leaves: Vec<(usize, usize, Leaf, Vec<Vec<f32>>)>,
    shard_trees: Vec<Vec<PartTree>>,
}

impl CpuCompute {
    /// `block` is the replica's microbatches as global indices within the
    /// step, of `total` (dp · microbatches); `zero` the ZeRO level, whose
    /// shard the AdamW states were made for.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        parts: Vec<ModelPart>,
        adam: Vec<AdamState>,
        pool: rayon::ThreadPool,
        nondet: bool,
        b: usize,
        block: std::ops::Range<usize>,
        total: usize,
        zero: u8,
    ) -> Self {
        let tree = |p: &ModelPart| PartTree::new(&p.spec, &p.cfg, p.params.len(), block.clone(), total);
        let trees = parts.iter().map(tree).collect();
        let shard = adam.first().map_or(Shard::WHOLE, |a| a.shard);
        let first_slots = parts.first().map_or(Vec::new(), |p| optim::zero::first_slots(&p.cfg));
        let mut c = CpuCompute {
            parts,
            adam,
            saved: BTreeMap::new(),
            pool,
            nondet,
            b,
            trees,
            shard,
            first_slots,
            zero,
            owned: Vec::new(),
            peak_state_bytes: 0,
            ema: Vec::new(),
            scatter: false,
            leaves: Vec::new(),
            shard_trees: Vec::new(),
        };
        let (m, dp) = (block.len(), total / block.len().max(1));
        if zero >= 2 && dp > 1 {
            c.scatter = true;
            let trees = |p: &ModelPart| {
                let tree =
                    |r: usize| PartTree::new(&p.spec, &p.cfg, p.params.len(), r * m..(r + 1) * m, total);
                (0..dp).map(tree).collect()
            };
            c.shard_trees = c.parts.iter().map(trees).collect();
        }
        if zero == 3 {
            c.keep_owned();
        }
        c
    }

    /// ZeRO-3: keeps each tensor's owned elements and frees the whole
    /// weights (built whole from the init, `--init` or a checkpoint).
    fn keep_owned(&mut self) {
        let shard = self.shard;
        self.owned = self
            .parts
            .iter()
            .map(|part| part.params.iter().map(|p| p.data[shard.range(p.numel())].to_vec()).collect())
            .collect();
        for i in 0..self.parts.len() {
            self.release_params(i);
        }
    }

    /// Bytes of training state held now: weights (whole, or ZeRO-3's owned
    /// shards and whatever is gathered), gradients (the parts' buffers and
    /// the trees' nodes and spares) and AdamW moments. Activations are
    /// counted apart (`peak_live_bytes`); gradients in flight to the
    /// reducer and the EMA of the weights (as many bytes as AdamW's `m`)
    /// are not counted, nor by the planner.
    fn state_bytes(&self) -> usize {
        let floats = |v: &[Vec<f32>]| v.iter().map(Vec::len).sum::<usize>();
        let parts: usize = self
            .parts
            .iter()
            .map(|p| {
                p.params.iter().map(|q| q.data.len() + q.grad.len()).sum::<usize>() + p.wte_head_grad.len()
            })
            .sum();
        let trees: usize =
            self.trees.iter().chain(self.shard_trees.iter().flatten()).map(PartTree::floats).sum();
        let leaves: usize = self.leaves.iter().map(|l| floats(&l.3)).sum();
        let adam: usize = self.adam.iter().map(|a| floats(&a.m) + floats(&a.v)).sum();
        let owned: usize = self.owned.iter().map(|o| floats(o)).sum();
        4 * (parts + trees + leaves + adam + owned)
    }

    /// Microbatch `mb`'s gradients of kind `which` on chunk `i` are final:
    /// into the chunk's tree, or (scattering) out for the executor.
    fn leaf_done(&mut self, i: usize, mb: usize, which: Leaf) {
        let (g, part) = (self.global(i, mb), &mut self.parts[i]);
        if !self.scatter {
            self.trees[i].push(&mut part.params, &mut part.wte_head_grad, which, g);
            return;
        }
        if let Some(leaf) = self.trees[i].take_leaf(&mut part.params, &mut part.wte_head_grad, which, false) {
            self.leaves.push((i, mb, which, leaf));
        }
    }

    /// Zeroed whole gradient buffers for chunk `i`'s next forward or
    /// backward where a scattered leaf left none.
    fn ensure_grads(&mut self, i: usize) {
        let p = &mut self.parts[i];
        for q in p.params.iter_mut().filter(|q| q.grad.is_empty()) {
            q.grad = vec![0.0; q.numel()];
        }
        if p.wte_head_grad.is_empty() && p.spec.head && p.cfg.tied() {
            p.wte_head_grad = vec![0.0; p.cfg.vocab_size * p.cfg.n_embd];
        }
    }

    fn note_state(&mut self) {
        self.peak_state_bytes = self.peak_state_bytes.max(self.state_bytes());
    }

    /// Keeps an EMA of the weights, one state per chunk (for the same shard as AdamW's).
    pub fn with_ema(mut self, ema: Vec<EmaState>) -> Self {
        assert_eq!(ema.len(), self.parts.len(), "one EMA per chunk");
        self.ema = ema;
        self
    }

    /// Most gradient sets any chunk's tree held at once (memory reports).
    pub fn peak_tree_sets(&self) -> usize {
        self.trees.iter().map(PartTree::peak_held).max().unwrap_or(0)
    }

    /// Global microbatch index of the replica's microbatch `mb`.
    fn global(&self, i: usize, mb: usize) -> usize {
        self.trees[i].block().start + mb
    }
}

/// Loads a checkpoint's moments for `params` into `st`: the elements its
/// shard owns of the whole tensors on disk.
pub fn load_moments(params: &[Param], st: &mut AdamState, c: &Loaded) -> Result<(), String> {
    st.t = c.state.adam_step;
    for (i, p) in params.iter().enumerate() {
        let (m, v) = moments_of(c, &p.name)?;
        let r = st.shard.range(p.numel());
        st.m[i].copy_from_slice(&m[r.clone()]);
        st.v[i].copy_from_slice(&v[r]);
    }
    Ok(())
}

/// Loads a checkpoint's EMA of the weights for `params` into `e`: the
/// elements its shard owns of the whole tensors on disk.
pub fn load_ema(params: &[Param], e: &mut EmaState, c: &Loaded) -> Result<(), String> {
    let (whole, n) = super::ema_of(c, e.decay)?;
    e.load(params, whole, n).map_err(|why| format!("{}: {why}", c.dir.display()))
}

/// Puts a replica's shard of each reduced gradient (part order, the head's
/// wte share last) into the part's gradients: whole-length ones whose other
/// elements are zero and never read (ZeRO-1), or, with `held_only`, the
/// shard alone (ZeRO-2, 3: the whole buffers are freed).
fn set_grad_shards(part: &mut ModelPart, shard: Shard, grads: Vec<Vec<f32>>, held_only: bool) {
    let n = part.params.len();
    // An untied head has no share apart: its gradient is its own tensor's.
    let wte = if part.cfg.tied() { part.cfg.vocab_size * part.cfg.n_embd } else { 0 };
    for (k, g) in grads.into_iter().enumerate() {
        let (numel, target) = match k < n {
            true => (part.params[k].numel(), &mut part.params[k].grad),
            false => (wte, &mut part.wte_head_grad),
        };
        let r = shard.range(numel);
        let carried = !g.is_empty() || r.is_empty();
        if held_only {
            // A tensor the reduction does not carry (the head's copy of wte)
            // starts from zero: the tied combination writes it.
            *target = if carried { g } else { vec![0.0; r.len()] };
            continue;
        }
        target.resize(numel, 0.0);
        if !carried {
            continue;
        }
        assert_eq!(g.len(), r.len(), "tensor {k}'s shard of {numel} elements");
        target[r].copy_from_slice(&g);
    }
}

impl StageCompute for CpuCompute {
    fn micro_batch(&self) -> usize {
        self.b
    }

    fn zero_grads(&mut self) {
        for (p, t) in self.parts.iter_mut().zip(&mut self.trees) {
            // ZeRO-2 and 3 freed the whole buffers after the last reduction.
            for q in &mut p.params {
                q.grad.resize(q.numel(), 0.0);
            }
            let wte = if p.spec.head && p.cfg.tied() { p.cfg.vocab_size * p.cfg.n_embd } else { 0 };
            p.wte_head_grad.resize(wte, 0.0);
            p.zero_grads();
            t.reset();
        }
        self.shard_trees.iter_mut().flatten().for_each(PartTree::clear);
        self.leaves.clear();
    }

    fn forward(
        &mut self,
        i: usize,
        mb: usize,
        input: ChunkInput,
        targets: Option<&[u32]>,
        mode: Mode,
        argmax: Option<&mut [u32]>,
    ) -> ChunkOutput {
        self.ensure_grads(i);
        let part = &mut self.parts[i];
        let out = self.pool.install(|| {
            let input = match input {
                ChunkInput::Tokens(t) => PartInput::Tokens(t),
                ChunkInput::Activation(a) => PartInput::Activation(a),
            };
            part.forward_with(input, targets, mode, argmax)
        });
        if let Some(acts) = out.acts {
            self.saved.insert((i, mb), acts);
            self.leaf_done(i, mb, Leaf::Head);
            self.note_state();
        }
        ChunkOutput { output: out.output, loss_sum: out.loss_sum }
    }

    fn backward(
        &mut self,
        i: usize,
        mb: usize,
        which: BackwardPart,
        dout: Option<Vec<f32>>,
    ) -> Option<Vec<f32>> {
        let nondet = self.nondet;
        self.ensure_grads(i);
        let part = &mut self.parts[i];
        if which == BackwardPart::Weight {
            self.pool.install(|| with_random_order(nondet, || part.backward_weight(mb)));
            self.leaf_done(i, mb, Leaf::Body);
            self.note_state();
            return None;
        }
        let acts = self.saved.remove(&(i, mb)).expect("F ran before B");
        let dx = self.pool.install(|| {
            with_random_order(nondet, || match which {
                BackwardPart::Full => part.backward(acts, dout),
                BackwardPart::Input => part.backward_input(acts, dout, mb),
                BackwardPart::Weight => unreachable!(),
            })
        });
        if which == BackwardPart::Full {
            self.leaf_done(i, mb, Leaf::Body);
        }
        self.note_state();
        dx
    }

    fn live(&self, i: usize) -> (usize, usize) {
        let held = self.saved.range((i, 0)..(i + 1, 0)).count() + self.parts[i].pending_weight_count();
        (held, self.parts[i].live_bytes)
    }

    fn peak_live_bytes(&self) -> usize {
        self.parts.iter().map(|p| p.peak_live_bytes).sum()
    }

    fn peak_state_bytes(&self) -> usize {
        self.peak_state_bytes.max(self.state_bytes())
    }

    fn tied_share(&self, i: usize) -> Vec<f32> {
        let p = &self.parts[i];
        if p.spec.embedding {
            p.params[0].grad.clone()
        } else {
            p.wte_head_grad.clone()
        }
    }

    fn combine_tied(&mut self, i: usize, other: Option<&[f32]>) {
        self.parts[i].combine_tied_grads(other);
    }

    fn take_grads(&mut self, i: usize) -> Vec<Vec<f32>> {
        self.parts[i].params.iter_mut().map(|p| std::mem::take(&mut p.grad)).collect()
    }

    fn take_leaves(&mut self) -> Vec<(usize, usize, bool, Vec<Vec<f32>>)> {
        let leaves = std::mem::take(&mut self.leaves);
        leaves.into_iter().map(|(i, mb, which, g)| (i, mb, which == Leaf::Head, g)).collect()
    }

    fn fold_scattered(&mut self, i: usize, mb: usize, head: bool, shards: Vec<Vec<f32>>) {
        let trees = &mut self.shard_trees[i];
        let (dp, m) = (trees.len(), self.trees[i].block().len());
        assert!(shards.len().is_multiple_of(dp), "{} shards from {dp} replicas", shards.len());
        let per = shards.len() / dp;
        let which = if head { Leaf::Head } else { Leaf::Body };
        let mut it = shards.into_iter();
        for (r, tree) in trees.iter_mut().enumerate() {
            tree.push_set(which, r * m + mb, it.by_ref().take(per).collect());
        }
        self.note_state();
    }

    fn finish_scattered(&mut self, i: usize) {
        let total = self.trees[i].block().len() * self.shard_trees[i].len();
        let nodes = self.shard_trees[i].iter_mut().flat_map(PartTree::take_nodes).collect();
        self.shard_trees[i].iter_mut().for_each(PartTree::clear);
        let sum = self.pool.install(|| crate::optim::grad_tree::combine(nodes, total));
        self.set_grads(i, sum);
    }

    fn take_grad_nodes(&mut self, i: usize, _block: std::ops::Range<usize>) -> Vec<(Span, Vec<Vec<f32>>)> {
        self.trees[i].take_nodes()
    }

    fn sums_by_tree(&self) -> bool {
        true
    }

    fn set_block(&mut self, block: std::ops::Range<usize>, total: usize) {
        self.trees.iter_mut().for_each(|t| t.set_block(block.clone(), total));
        // Scattering: one shard tree per replica's block of the same size.
        let m = block.len();
        for trees in &mut self.shard_trees {
            for (r, t) in trees.iter_mut().enumerate() {
                t.set_block(r * m..(r + 1) * m, total);
            }
        }
    }

    fn finish_grad_tree(&mut self, i: usize) {
        let (tree, part) = (&mut self.trees[i], &mut self.parts[i]);
        self.pool.install(|| tree.finish_local(&mut part.params, &mut part.wte_head_grad));
    }

    fn set_grads(&mut self, i: usize, grads: Vec<Vec<f32>>) {
        match self.shard == Shard::WHOLE {
            true => {
                let part = &mut self.parts[i];
                PartTree::set(&mut part.params, &mut part.wte_head_grad, grads)
            }
            false => set_grad_shards(&mut self.parts[i], self.shard, grads, self.zero >= 2),
        }
        if self.zero >= 2 {
            self.trees[i].release_spares();
        }
        self.note_state();
    }

    fn grad_sum_squares(&mut self, i: usize, out: &mut Vec<(usize, f64)>) {
        let (part, shard, first) = (&self.parts[i], self.shard, &self.first_slots);
        self.pool.install(|| optim::grad_sum_squares(&part.params, part.spec.embedding, shard, first, out));
    }

    fn param_shards(&self, i: usize) -> Vec<Vec<f32>> {
        if self.zero == 3 {
            return self.owned[i].clone();
        }
        self.parts[i].params.iter().map(|p| p.data[self.shard.range(p.numel())].to_vec()).collect()
    }

    fn set_params(&mut self, i: usize, params: &[Vec<f32>]) {
        for (p, data) in self.parts[i].params.iter_mut().zip(params) {
            assert_eq!(data.len(), p.numel(), "{}: a gathered tensor is whole", p.name);
            // ZeRO-3 gathers into a freed tensor.
            p.data.resize(data.len(), 0.0);
            p.data.copy_from_slice(data);
        }
        self.note_state();
    }

    fn release_params(&mut self, i: usize) {
        assert_eq!(self.zero, 3, "only ZeRO-3 frees weights");
        self.parts[i].release_weights();
    }

    fn poison_grad(&mut self, i: usize, value: f32) {
        // Under ZeRO-2 and 3 a replica may hold no element of a small tensor.
        if let Some(g) = self.parts[i].params.iter_mut().find(|p| !p.grad.is_empty()) {
            g.grad[0] = value;
        }
    }

    fn adamw(&mut self, hyper: Hyper, lr: f64, clip: f32) {
        let (parts, adam, owned, shard) = (&mut self.parts, &mut self.adam, &mut self.owned, self.shard);
        if self.zero < 2 {
            self.pool.install(|| {
                for (part, st) in parts.iter_mut().zip(adam.iter_mut()) {
                    st.step(&mut part.params, hyper, lr, clip);
                }
            });
            return;
        }
        // Gradients are the shards alone; ZeRO-3's weights too.
        self.pool.install(|| {
            for (i, (part, st)) in parts.iter_mut().zip(adam.iter_mut()).enumerate() {
                let mut held = owned.get_mut(i).map(|o| o.iter_mut());
                let tensors = part.params.iter_mut().map(|p| {
                    let (r, decay) = (shard.range(p.numel()), p.decays());
                    let data = match held.as_mut() {
                        Some(o) => o.next().expect("an owned shard per tensor").as_mut_slice(),
                        None => &mut p.data[r],
                    };
                    (data, p.grad.as_slice(), decay)
                });
                st.step_tensors(tensors, hyper, lr, clip);
            }
        });
    }

    fn update_ema(&mut self) {
        let (parts, ema, owned) = (&self.parts, &mut self.ema, &self.owned);
        self.pool.install(|| {
            for (i, (e, part)) in ema.iter_mut().zip(parts).enumerate() {
                // ZeRO-3 holds the owned elements alone.
                match owned.get(i) {
                    Some(o) => e.update_owned(o.iter().map(Vec::as_slice)),
                    None => e.update(&part.params),
                }
            }
        });
    }

    fn ema_updates(&self) -> Option<u64> {
        self.ema.first().map(|e| e.updates)
    }

    fn ema_shards(&self, i: usize) -> Vec<Vec<f32>> {
        self.ema[i].shadow.clone()
    }

    fn visit_params(&self, f: &mut dyn FnMut(usize, &str, &[f32])) {
        for (i, part) in self.parts.iter().enumerate() {
            for (k, p) in part.params.iter().enumerate() {
                // ZeRO-3: the elements this replica keeps.
                let data = self.owned.get(i).map_or(&p.data, |o| &o[k]);
                f(i, &p.name, data);
            }
        }
    }

    fn param_name(&self, i: usize, k: usize) -> Option<String> {
        self.parts.get(i).and_then(|p| p.params.get(k)).map(|p| p.name.clone())
    }

    fn params(&self) -> Vec<Param> {
        let params = self.parts.iter().flat_map(|p| p.params.iter().cloned());
        params.inspect(|p| assert_eq!(p.data.len(), p.numel(), "{} is gathered whole", p.name)).collect()
    }

    fn snapshot(&self) -> (Vec<TensorState>, u64) {
        let mut tensors = Vec::new();
        for (c, (part, st)) in self.parts.iter().zip(&self.adam).enumerate() {
            for (i, p) in part.params.iter().enumerate() {
                tensors.push(TensorState {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    // ZeRO-3: the owned shard, gathered whole by the executor.
                    data: self.owned.get(c).map_or(&p.data, |o| &o[i]).clone(),
                    exp_avg: st.m[i].clone(),
                    exp_avg_sq: st.v[i].clone(),
                    ema: self.ema.get(c).map_or(Vec::new(), |e| e.shadow[i].clone()),
                });
            }
        }
        (tensors, self.adam.first().map_or(0, |a| a.t))
    }

    fn restore(&mut self, c: &Loaded) -> Result<(), String> {
        for (part, st) in self.parts.iter_mut().zip(self.adam.iter_mut()) {
            for p in &mut part.params {
                p.data.resize(p.numel(), 0.0);
            }
            c.weights.assign(part).map_err(|e| format!("rollback to {}: {e}", c.dir.display()))?;
            load_moments(&part.params, st, c)?;
        }
        for (part, e) in self.parts.iter().zip(self.ema.iter_mut()) {
            load_ema(&part.params, e, c)?;
        }
        if self.zero == 3 {
            self.keep_owned();
        }
        Ok(())
    }
}
