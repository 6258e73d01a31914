//! What a stage's compute thread computes with: its model chunks on the CPU
//! (`ModelPart`s on a rayon pool pinned to the rank's cores) or on a GPU
//! (`GpuPart`s on the device the rank owns), behind one interface, so the
//! schedule executor in stage/executor.rs is the same for every backend.
//!
//! Chunks are addressed by their local index (position in the rank's
//! ascending list of stages). Activations and gradients cross this border as
//! host `Vec<f32>`s: that is what messages carry between ranks, processes and
//! replay logs. A GPU backend stages them through host memory.
//!
//! Gradients follow one fixed tree over the global microbatch index
//! (optim::grad_tree) on every backend: each microbatch's gradient is a leaf
//! in a zeroed buffer, folded into nodes in the tree's order (on the GPU, in
//! device buffers by `add_f32`), so a run gives dp 1's bits at any dp. Over
//! data-parallel replicas, the nodes travel in host memory to the reducer
//! actor, which adds them by the same tree; there is no NCCL all-reduce of
//! gradients, whose order of adds is NCCL's own.
//!
//! A backend error on the GPU is a failure of the stage: it panics with the
//! error, and the stage reports it (actor, step, action) like any other.

use crate::checkpoint::{Loaded, TensorState};
use crate::kernels::cpu::matmul::with_random_order;
use crate::model::part::{MicroActs, Mode, PartInput};
use crate::model::{ModelPart, Param};
use crate::optim::grad_tree::{Leaf, PartTree, Span};
use crate::optim::zero::Shard;
use crate::optim::{self, AdamState, Hyper};
use std::collections::BTreeMap;

/// Which half of a backward to run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BackwardPart {
    /// B: input and weight gradients together.
    Full,
    /// I: the input gradient only (zero-bubble schedules).
    Input,
    /// W: the weight gradients of a microbatch whose I ran.
    Weight,
}

/// The input of a chunk's forward.
pub enum ChunkInput<'a> {
    Tokens(&'a [u32]),
    Activation(Vec<f32>),
}

/// What a forward hands back: the next chunk's input, or the loss sum.
pub struct ChunkOutput {
    pub output: Option<Vec<f32>>,
    pub loss_sum: Option<f64>,
}

pub trait StageCompute {
    /// Sequences per microbatch.
    fn micro_batch(&self) -> usize;
    /// Whether there are weight gradients to combine, reduce and clip (the
    /// simulated backend has none).
    fn has_gradients(&self) -> bool {
        true
    }
    /// Zero every gradient accumulator (the start of a step).
    fn zero_grads(&mut self);
    /// F of microbatch `mb` on chunk `i`; in eval mode on the last chunk
    /// `argmax` (N) receives predictions.
    fn forward(
        &mut self,
        i: usize,
        mb: usize,
        input: ChunkInput,
        targets: Option<&[u32]>,
        mode: Mode,
        argmax: Option<&mut [u32]>,
    ) -> ChunkOutput;
    /// B, I or W of microbatch `mb` on chunk `i`; `dout` is the gradient of
    /// the chunk's output (None on the last chunk, and for W). Returns the
    /// gradient of the chunk's input (None on the first chunk, and for W).
    fn backward(
        &mut self,
        i: usize,
        mb: usize,
        which: BackwardPart,
        dout: Option<Vec<f32>>,
    ) -> Option<Vec<f32>>;
    /// (microbatches awaiting backward, bytes they hold) on chunk `i`.
    fn live(&self, i: usize) -> (usize, usize);
    /// Peak activation bytes held, over all chunks.
    fn peak_live_bytes(&self) -> usize;
    /// Chunk `i`'s share of the tied wte gradient (the embedding's, or the head's).
    fn tied_share(&self, i: usize) -> Vec<f32>;
    /// Sums the tied embedding's shares into chunk `i`'s wte gradient, embedding
    /// share + head share; `other` is None when chunk `i` holds both ends.
    fn combine_tied(&mut self, i: usize, other: Option<&[f32]>);
    /// Chunk `i`'s gradients, per tensor, moved out (for the reducer).
    fn take_grads(&mut self, i: usize) -> Vec<Vec<f32>>;
    /// Chunk `i`'s gradients as the nodes of the step's microbatch tree its
    /// replica's block covers ([`crate::optim::grad_tree`]), moved out for
    /// the reducer. A backend that sums its block in its own order hands it
    /// over as one set.
    fn take_grad_nodes(&mut self, i: usize, block: std::ops::Range<usize>) -> Vec<(Span, Vec<Vec<f32>>)> {
        vec![(Span { lo: block.start, hi: block.end }, self.take_grads(i))]
    }
    /// Sums chunk `i`'s tree nodes into its gradients when one replica holds
    /// every microbatch (dp = 1).
    fn finish_grad_tree(&mut self, _i: usize) {}
    /// Whether gradients are summed by the microbatch tree, the tied
    /// embedding's two shares apart (reduced over replicas one by one, then
    /// added); otherwise the shares are added first and the sum reduced.
    fn sums_by_tree(&self) -> bool {
        false
    }
    /// Replaces chunk `i`'s gradients (their sum over replicas); under ZeRO-1,
    /// the shard of each tensor this replica owns.
    fn set_grads(&mut self, i: usize, grads: Vec<Vec<f32>>);
    /// Σg² of chunk `i`'s gradients as (norm slot, value): per owned block on
    /// the CPU (see `optim::zero`), per tensor under its first block's slot
    /// on GPUs (same order, other bits).
    fn grad_sum_squares(&mut self, i: usize, out: &mut Vec<(usize, f64)>);
    /// ZeRO-1: copies of the owned elements of chunk `i`'s parameters, one
    /// vector per tensor (what this replica updated).
    fn param_shards(&self, _i: usize) -> Vec<Vec<f32>> {
        unreachable!("ZeRO-1 runs on the CPU backend only: the config refuses the rest")
    }
    /// ZeRO-1: replaces chunk `i`'s parameters with whole tensors (their
    /// shards gathered from every replica).
    fn set_params(&mut self, _i: usize, _params: &[Vec<f32>]) {
        unreachable!("ZeRO-1 runs on the CPU backend only: the config refuses the rest")
    }
    /// Overwrites a gradient element of chunk `i` (the overflow fault knob).
    fn poison_grad(&mut self, i: usize, value: f32);
    /// One AdamW step of every chunk, gradients scaled by `clip`.
    fn adamw(&mut self, hyper: Hyper, lr: f64, clip: f32);
    /// Calls `f(chunk, name, values)` for every parameter, in chunk order.
    fn visit_params(&self, f: &mut dyn FnMut(usize, &str, &[f32]));
    /// Tensor `k`'s name in chunk `i`.
    fn param_name(&self, i: usize, k: usize) -> Option<String>;
    /// Copies of every parameter (the end of a run).
    fn params(&self) -> Vec<Param>;
    /// Parameters and AdamW moments for a checkpoint, with AdamW's step count;
    /// under ZeRO-1 the moments are this replica's shard of each tensor.
    fn snapshot(&self) -> (Vec<TensorState>, u64);
    /// Loads parameters and moments from a checkpoint (a rollback).
    fn restore(&mut self, c: &Loaded) -> Result<(), String>;
}

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
    /// The elements whose optimizer state this replica keeps (ZeRO-1).
    shard: Shard,
    /// Each tensor's first norm slot (`optim::zero::first_slots`).
    first_slots: Vec<usize>,
}

impl CpuCompute {
    /// `block` is the replica's microbatches as global indices within the
    /// step, of `total` (dp · microbatches).
    pub fn new(
        parts: Vec<ModelPart>,
        adam: Vec<AdamState>,
        pool: rayon::ThreadPool,
        nondet: bool,
        b: usize,
        block: std::ops::Range<usize>,
        total: usize,
    ) -> Self {
        let tree = |p: &ModelPart| PartTree::new(&p.spec, &p.cfg, p.params.len(), block.clone(), total);
        let trees = parts.iter().map(tree).collect();
        let shard = adam.first().map_or(Shard::WHOLE, |a| a.shard);
        let first_slots = parts.first().map_or(Vec::new(), |p| optim::zero::first_slots(&p.cfg));
        CpuCompute { parts, adam, saved: BTreeMap::new(), pool, nondet, b, trees, shard, first_slots }
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

/// A checkpoint's AdamW moments (exp_avg, exp_avg_sq) of tensor `name`.
fn moments_of<'c>(c: &'c Loaded, name: &str) -> Result<&'c (Vec<f32>, Vec<f32>), String> {
    c.moments.get(name).ok_or_else(|| format!("checkpoint lacks moments of {name}"))
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

/// Puts a replica's shard of each reduced gradient (part order, the head's
/// wte share last) into the part's whole-length gradients; the elements it
/// does not own are zero and never read.
fn set_grad_shards(part: &mut ModelPart, shard: Shard, grads: Vec<Vec<f32>>) {
    let n = part.params.len();
    // An untied head has no share apart: its gradient is its own tensor's.
    let wte = if part.cfg.tied() { part.cfg.vocab_size * part.cfg.n_embd } else { 0 };
    for (k, g) in grads.into_iter().enumerate() {
        let (numel, target) = match k < n {
            true => (part.params[k].numel(), &mut part.params[k].grad),
            false => (wte, &mut part.wte_head_grad),
        };
        target.resize(numel, 0.0);
        let r = shard.range(numel);
        if g.is_empty() && !r.is_empty() {
            // A tensor the reduction does not carry (the head's copy of wte).
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
            p.zero_grads();
            t.reset();
        }
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
            let g = self.global(i, mb);
            let part = &mut self.parts[i];
            self.trees[i].push(&mut part.params, &mut part.wte_head_grad, Leaf::Head, g);
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
        let g = self.global(i, mb);
        let part = &mut self.parts[i];
        if which == BackwardPart::Weight {
            self.pool.install(|| with_random_order(nondet, || part.backward_weight(mb)));
            self.trees[i].push(&mut part.params, &mut part.wte_head_grad, Leaf::Body, g);
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
            self.trees[i].push(&mut part.params, &mut part.wte_head_grad, Leaf::Body, g);
        }
        dx
    }

    fn live(&self, i: usize) -> (usize, usize) {
        let held = self.saved.range((i, 0)..(i + 1, 0)).count() + self.parts[i].pending_weight_count();
        (held, self.parts[i].live_bytes)
    }

    fn peak_live_bytes(&self) -> usize {
        self.parts.iter().map(|p| p.peak_live_bytes).sum()
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

    fn take_grad_nodes(&mut self, i: usize, _block: std::ops::Range<usize>) -> Vec<(Span, Vec<Vec<f32>>)> {
        self.trees[i].take_nodes()
    }

    fn sums_by_tree(&self) -> bool {
        true
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
            false => set_grad_shards(&mut self.parts[i], self.shard, grads),
        }
    }

    fn grad_sum_squares(&mut self, i: usize, out: &mut Vec<(usize, f64)>) {
        let (part, shard, first) = (&self.parts[i], self.shard, &self.first_slots);
        self.pool.install(|| optim::grad_sum_squares(&part.params, part.spec.embedding, shard, first, out));
    }

    fn param_shards(&self, i: usize) -> Vec<Vec<f32>> {
        self.parts[i].params.iter().map(|p| p.data[self.shard.range(p.numel())].to_vec()).collect()
    }

    fn set_params(&mut self, i: usize, params: &[Vec<f32>]) {
        for (p, data) in self.parts[i].params.iter_mut().zip(params) {
            assert_eq!(data.len(), p.numel(), "{}: a gathered tensor is whole", p.name);
            p.data.copy_from_slice(data);
        }
    }

    fn poison_grad(&mut self, i: usize, value: f32) {
        self.parts[i].params[0].grad[0] = value;
    }

    fn adamw(&mut self, hyper: Hyper, lr: f64, clip: f32) {
        let (parts, adam) = (&mut self.parts, &mut self.adam);
        self.pool.install(|| {
            for (part, st) in parts.iter_mut().zip(adam.iter_mut()) {
                st.step(&mut part.params, hyper, lr, clip);
            }
        });
    }

    fn visit_params(&self, f: &mut dyn FnMut(usize, &str, &[f32])) {
        for (i, part) in self.parts.iter().enumerate() {
            for p in &part.params {
                f(i, &p.name, &p.data);
            }
        }
    }

    fn param_name(&self, i: usize, k: usize) -> Option<String> {
        self.parts.get(i).and_then(|p| p.params.get(k)).map(|p| p.name.clone())
    }

    fn params(&self) -> Vec<Param> {
        self.parts.iter().flat_map(|p| p.params.iter().cloned()).collect()
    }

    fn snapshot(&self) -> (Vec<TensorState>, u64) {
        let mut tensors = Vec::new();
        for (part, st) in self.parts.iter().zip(&self.adam) {
            for (i, p) in part.params.iter().enumerate() {
                tensors.push(TensorState {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    data: p.data.clone(),
                    exp_avg: st.m[i].clone(),
                    exp_avg_sq: st.v[i].clone(),
                });
            }
        }
        (tensors, self.adam.first().map_or(0, |a| a.t))
    }

    fn restore(&mut self, c: &Loaded) -> Result<(), String> {
        for (part, st) in self.parts.iter_mut().zip(self.adam.iter_mut()) {
            c.weights.assign(part).map_err(|e| format!("rollback to {}: {e}", c.dir.display()))?;
            load_moments(&part.params, st, c)?;
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
pub use gpu::{GpuCompute, GpuPlace};

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use crate::actors::stage::nccl::{link_orders, GpuPlan, NcclKey};
    use crate::kernels::cuda::nccl::{Comm, NcclId, NcclType};
    use crate::kernels::cuda::transfer::{NcclLink, Outbox, ParcelKey};
    use crate::kernels::cuda::{adamw, CudaError, DeviceBuffer, Elem, Gpu};
    use crate::model::gpu::part::GpuPart;
    use crate::model::gpu::part::{GpuGrad, GpuInput, TpDevices, TpPart};
    use crate::optim::grad_tree::{held_sets, TreeSum};
    use std::ops::Range;
    use std::sync::Arc;

    type CudaResult<T> = crate::kernels::cuda::Result<T>;

    /// Chunks on one GPU, or on the GPUs of the stage's tensor-parallel
    /// ranks, which this rank's thread owns (their contexts and streams).
    pub struct GpuCompute<X: Elem> {
        dev: TpDevices,
        parts: Vec<TpPart<X>>,
        b: usize,
        /// Global stage of each chunk.
        stages: Vec<usize>,
        replica: usize,
        layout: super::super::Layout,
        /// Device routes (None: every tensor in host memory). A cell: the
        /// receive and the send of one action borrow it one after the other.
        routes: Option<std::cell::RefCell<Routes<X>>>,
        /// Each chunk's microbatch gradients, summed by the fixed tree.
        trees: Vec<DeviceTree>,
    }

    /// A chunk's microbatch tree on its GPU (the CPU's `PartTree`): the
    /// head's leaves (written in forward) and the rest (written in backward)
    /// in their own trees, nodes in device buffers added by `add_f32`, which
    /// rounds as the CPU's `add_into` does.
    struct DeviceTree {
        body: TreeSum<DeviceBuffer<f32>>,
        head: Option<TreeSum<DeviceBuffer<f32>>>,
        body_len: usize,
        head_len: usize,
    }

    impl DeviceTree {
        /// Buffers for the nodes `block`'s in-order leaves keep alive, plus
        /// the leaf being taken, allocated now: a step that does not fit
        /// fails at setup, and a steady step allocates nothing.
        fn new<X: Elem>(gpu: &Gpu, part: &GpuPart<X>, block: Range<usize>, total: usize) -> CudaResult<Self> {
            let (body_len, head_len) = (part.body_leaf_len(), part.head_leaf_len());
            let mut body = TreeSum::new(block.clone(), total);
            let mut head = part.spec.head.then(|| TreeSum::new(block.clone(), total));
            for _ in 0..held_sets(block.len()) + 1 {
                body.recycle(gpu.alloc(body_len)?);
                if let Some(h) = &mut head {
                    h.recycle(gpu.alloc(head_len)?);
                }
            }
            Ok(DeviceTree { body, head, body_len, head_len })
        }

        fn reset(&mut self) {
            self.body.reset();
            if let Some(h) = &mut self.head {
                h.reset();
            }
        }

        /// A zeroed-or-stale buffer for a leaf: the leaf's copy overwrites it whole.
        fn leaf(
            tree: &mut TreeSum<DeviceBuffer<f32>>,
            gpu: &Gpu,
            len: usize,
        ) -> CudaResult<DeviceBuffer<f32>> {
            match tree.spare() {
                Some(b) => Ok(b),
                None => gpu.alloc(len),
            }
        }

        /// Folds `leaf` (microbatch `g`) into `tree`, the adds on `gpu`.
        fn push(
            tree: &mut TreeSum<DeviceBuffer<f32>>,
            gpu: &Gpu,
            g: usize,
            leaf: DeviceBuffer<f32>,
        ) -> CudaResult<()> {
            let mut failed = None;
            tree.push_with(g, leaf, &mut |a, b| {
                if failed.is_none() {
                    failed = adamw::add_f32(gpu, a.ptr(), a.ptr(), b.ptr(), a.len()).err();
                }
            });
            failed.map_or(Ok(()), Err)
        }
    }

    /// Where this rank's tensors go and come from on the device.
    struct Routes<X: Elem> {
        plan: Arc<GpuPlan>,
        /// Parcels for ranks in this process; empty while recording replay
        /// logs, which must hold what messages carry.
        outbox: Outbox<X>,
        /// NCCL links by (other rank, gradient).
        sends: BTreeMap<(usize, bool), NcclLink<X>>,
        recvs: BTreeMap<(usize, bool), NcclLink<X>>,
    }

    /// A GPU error ends the stage: the worker reports the panic as its failure.
    fn ok<T>(r: CudaResult<T>, what: &str) -> T {
        r.unwrap_or_else(|e| panic!("GPU {what}: {e}"))
    }

    /// How a GPU rank is placed in its run.
    pub struct GpuPlace<'a> {
        pub layout: &'a super::super::Layout,
        pub rank: usize,
        pub replica: usize,
        pub plan: Option<Arc<GpuPlan>>,
        /// Every tensor through messages in host memory (replay recording, run-wide).
        pub host_only: bool,
        /// The slices of the stage's split sums (`parallel.tp_slices`).
        pub tp_slices: usize,
    }

    impl<X: Elem + NcclType> GpuCompute<X> {
        /// Moves the chunks' tensors (initial, `--init` or resumed values)
        /// onto `gpu`, with `live[i]` activation slots for chunk i, and the
        /// AdamW state of `resume` (zero moments when starting); joins the
        /// NCCL communicators of the plan this rank belongs to.
        #[allow(clippy::too_many_arguments)]
        pub fn new(
            dev: TpDevices,
            chunks: Vec<(crate::model::PartSpec, Vec<Param>)>,
            cfg: crate::model::Arch,
            b: usize,
            recompute: bool,
            live: &[usize],
            resume: Option<&Loaded>,
            place: GpuPlace,
        ) -> Result<Self, String> {
            let mut parts = Vec::new();
            for ((spec, params), &slots) in chunks.into_iter().zip(live) {
                let mut part =
                    TpPart::<X>::new(&dev, cfg, spec, b, recompute, slots.max(1), &params, place.tp_slices)
                        .map_err(|e| format!("GPU {} ({}): {e}", dev.gpu(0).name, gpu_memory_hint(&e)))?;
                if let Some(c) = resume {
                    let (m, v) = moment_lists(c, params.iter().map(|p| p.name.as_str()))?;
                    let t = c.state.adam_step;
                    part.owner_mut().load_moments(dev.gpu(0), &m, &v, t).map_err(|e| e.to_string())?;
                }
                parts.push(part);
            }
            let gpu = dev.gpu(0);
            let layout = place.layout.clone();
            let n = b * cfg.block_size * cfg.n_embd;
            let routes = match place.plan {
                Some(plan) => Some(std::cell::RefCell::new(Routes::new(
                    gpu,
                    plan,
                    &layout,
                    place.rank,
                    place.replica,
                    n,
                    place.host_only,
                )?)),
                None => None,
            };
            let m = layout.microbatches;
            let block = place.replica * m..(place.replica + 1) * m;
            let trees = parts
                .iter()
                .map(|p| DeviceTree::new(gpu, p.owner(), block.clone(), layout.dp * m))
                .collect::<CudaResult<Vec<_>>>()
                .map_err(|e| {
                    format!("GPU {} (the gradient tree's buffers, {}): {e}", gpu.name, gpu_memory_hint(&e))
                })?;
            Ok(GpuCompute {
                dev,
                parts,
                b,
                stages: layout.stages_of(place.rank),
                replica: place.replica,
                layout,
                routes,
                trees,
            })
        }
    }

    impl<X: Elem + NcclType> Routes<X> {
        fn new(
            gpu: &Gpu,
            plan: Arc<GpuPlan>,
            layout: &super::super::Layout,
            rank: usize,
            replica: usize,
            n: usize,
            host_only: bool,
        ) -> Result<Routes<X>, String> {
            let depth = layout.microbatches + 2;
            let outbox = Outbox::new(gpu, if host_only { 0 } else { depth }, n).map_err(|e| e.to_string())?;
            let (mut sends, mut recvs) = (BTreeMap::new(), BTreeMap::new());
            // Ascending key order on every member: no two ranks wait on each
            // other's communicators in opposite orders while joining. Link
            // keys are skipped on every rank alike when recording (host_only
            // is run-wide), so no member waits for one that never comes.
            for (key, id) in &plan.nccl {
                let id = NcclId(id.clone());
                match *key {
                    NcclKey::Link { replica: r, from, to, gradient }
                        if !host_only && r == replica && (from == rank || to == rank) =>
                    {
                        let (sent, taken) = link_orders(layout, from, to, gradient);
                        if sent != taken {
                            return Err(format!(
                                "NCCL matches a link's sends and receives by order, but this schedule sends \
                                 rank {from} → rank {to} {} in the order {sent:?} and consumes them in the order \
                                 {taken:?}: run these ranks in one process, or use gpipe or 1f1b",
                                if gradient { "gradients" } else { "activations" }
                            ));
                        }
                        let me = usize::from(to == rank);
                        let comm =
                            Comm::init(gpu, &id, 2, me).map_err(|e| format!("NCCL link {key:?}: {e}"))?;
                        if from == rank {
                            let link = NcclLink::sender(gpu, comm, depth, n).map_err(|e| e.to_string())?;
                            sends.insert((to, gradient), link);
                        } else {
                            recvs.insert((from, gradient), NcclLink::receiver(comm));
                        }
                    }
                    _ => {}
                }
            }
            Ok(Routes { plan, outbox, sends, recvs })
        }

        /// Sends the tensor for (`stage`, `mb`) held in `src` on the device:
        /// a parcel for a rank in this process, an NCCL send for one elsewhere.
        /// False when it must go in host memory instead.
        #[allow(clippy::too_many_arguments)]
        fn send(
            &mut self,
            gpu: &Gpu,
            src: &DeviceBuffer<X>,
            to: usize,
            pp: usize,
            key: ParcelKey,
        ) -> CudaResult<bool> {
            if self.plan.local[key.replica * pp + to] {
                return self.outbox.post(gpu, src, &self.plan.exchange, key);
            }
            match self.sends.get_mut(&(to, key.gradient)) {
                Some(link) => link.send(gpu, src).map(|_| true),
                None => Ok(false),
            }
        }

        /// Writes the tensor for (`stage`, `mb`), whose message arrived
        /// empty, into `dst`: from this process's exchange, or from the NCCL
        /// link of the rank `from` that made it.
        fn receive(
            &self,
            gpu: &Gpu,
            dst: &DeviceBuffer<X>,
            from: usize,
            pp: usize,
            key: ParcelKey,
        ) -> CudaResult<()> {
            if self.plan.local[key.replica * pp + from] {
                return self.plan.exchange.take(key)?.deliver(gpu, dst);
            }
            let link = self.recvs.get(&(from, key.gradient)).ok_or_else(|| {
                CudaError::Shape(format!("an empty tensor from rank {from}, with no NCCL link from it"))
            })?;
            link.recv(gpu, dst, dst.len())
        }
    }

    /// Per-tensor exp_avg and exp_avg_sq, as `GpuPart::load_moments` takes them.
    type MomentLists = (Vec<Vec<f32>>, Vec<Vec<f32>>);

    /// A checkpoint's moments of the tensors `names`.
    fn moment_lists<'n>(c: &Loaded, names: impl Iterator<Item = &'n str>) -> Result<MomentLists, String> {
        let (mut m, mut v) = (Vec::new(), Vec::new());
        for name in names {
            let (pm, pv) = moments_of(c, name)?;
            m.push(pm.clone());
            v.push(pv.clone());
        }
        Ok((m, v))
    }

    fn gpu_memory_hint(e: &CudaError) -> &'static str {
        if crate::model::gpu::model::is_out_of_memory(e) {
            "out of device memory: fewer microbatches alive (schedule), a smaller train.micro_batch_size, or train.recompute"
        } else {
            "could not set up the stage's part"
        }
    }

    impl<X: Elem + NcclType> GpuCompute<X> {
        /// The closures that take a tensor for (`stage`, `mb`) from the device
        /// (its message arrived empty) and send one on the device (false: it
        /// goes in host memory); `from`/`to` are the ranks at the other end.
        #[allow(clippy::type_complexity)]
        fn device_io<'a>(
            routes: &'a Option<std::cell::RefCell<Routes<X>>>,
            pp: usize,
            input: (usize, ParcelKey),
            output: Option<(usize, ParcelKey)>,
        ) -> (
            impl FnMut(&Gpu, &DeviceBuffer<X>) -> CudaResult<()> + 'a,
            impl FnMut(&Gpu, &DeviceBuffer<X>) -> CudaResult<bool> + 'a,
        ) {
            let fill = move |gpu: &Gpu, dst: &DeviceBuffer<X>| match routes {
                Some(r) => r.borrow().receive(gpu, dst, input.0, pp, input.1),
                None => Err(CudaError::Shape("an empty tensor, but no device routes here".into())),
            };
            let sink = move |gpu: &Gpu, src: &DeviceBuffer<X>| match (routes, output) {
                (Some(r), Some((to, key))) => r.borrow_mut().send(gpu, src, to, pp, key),
                _ => Ok(false),
            };
            (fill, sink)
        }
    }

    impl<X: Elem + NcclType> GpuCompute<X> {
        /// The stage's (rank 0's) GPU: its routes, optimizer and downloads.
        fn gpu(&self) -> &Gpu {
            self.dev.gpu(0)
        }

        /// Chunk i's owner, its gradients summed over the tensor-parallel ranks.
        fn summed(&self, i: usize) -> &crate::model::gpu::part::GpuPart<X> {
            ok(self.parts[i].summed(&self.dev), "gradient sum over tensor-parallel ranks")
        }

        /// [`Self::summed`], to change the owner's gradients.
        fn summed_mut(&mut self, i: usize) -> (&mut crate::model::gpu::part::GpuPart<X>, &Gpu) {
            let part = ok(self.parts[i].summed_mut(&self.dev), "gradient sum over tensor-parallel ranks");
            (part, self.dev.gpu(0))
        }
    }

    impl<X: Elem + NcclType> StageCompute for GpuCompute<X> {
        fn micro_batch(&self) -> usize {
            self.b
        }

        fn zero_grads(&mut self) {
            for (p, t) in self.parts.iter_mut().zip(&mut self.trees) {
                ok(p.zero_grads(&self.dev), "zero gradients");
                t.reset();
            }
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
            let (stage, replica, pp, last) =
                (self.stages[i], self.replica, self.layout.pp, self.layout.last_stage());
            let eval = matches!(mode, Mode::Eval);
            let key = |stage| ParcelKey { replica, eval, gradient: false, stage, mb };
            let from = if stage > 0 { self.layout.rank_of(stage - 1) } else { 0 };
            let to = (stage < last).then(|| (self.layout.rank_of(stage + 1), key(stage + 1)));
            let (mut fill, mut sink) = Self::device_io(&self.routes, pp, (from, key(stage)), to);
            let input = match &input {
                ChunkInput::Tokens(t) => GpuInput::Tokens(t),
                ChunkInput::Activation(a) if !a.is_empty() => GpuInput::Activation(a),
                ChunkInput::Activation(_) => GpuInput::Device(&mut fill),
            };
            let out = self.parts[i].forward(&self.dev, mb, input, targets, mode, argmax, Some(&mut sink));
            let out = ok(out, "forward");
            let global = self.replica * self.layout.microbatches + mb;
            let head_len = self.trees[i].head_len;
            if let (false, Some(tree)) = (eval, &mut self.trees[i].head) {
                let gpu = self.dev.gpu(0);
                let leaf = ok(DeviceTree::leaf(tree, gpu, head_len), "gradient tree buffer");
                ok(self.parts[i].take_head_leaf(&self.dev, &leaf), "head gradient leaf");
                ok(DeviceTree::push(tree, gpu, global, leaf), "gradient tree add");
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
            // The config refuses split-backward schedules on GPUs (not built there).
            assert_eq!(which, BackwardPart::Full, "split backward on a GPU part");
            let (stage, replica, pp, last) =
                (self.stages[i], self.replica, self.layout.pp, self.layout.last_stage());
            let key = |stage| ParcelKey { replica, eval: false, gradient: true, stage, mb };
            let from = if stage < last { self.layout.rank_of(stage + 1) } else { 0 };
            let to = (stage > 0).then(|| (self.layout.rank_of(stage - 1), key(stage - 1)));
            let (mut fill, mut sink) = Self::device_io(&self.routes, pp, (from, key(stage)), to);
            let grad = match &dout {
                None => GpuGrad::FromLoss,
                Some(g) if !g.is_empty() => GpuGrad::Host(g),
                Some(_) => GpuGrad::Device(&mut fill),
            };
            let dx = ok(self.parts[i].backward(&self.dev, mb, grad, Some(&mut sink)), "backward");
            let (gpu, tree) = (self.dev.gpu(0), &mut self.trees[i]);
            let leaf = ok(DeviceTree::leaf(&mut tree.body, gpu, tree.body_len), "gradient tree buffer");
            ok(self.parts[i].take_body_leaf(&self.dev, &leaf), "body gradient leaf");
            let global = self.replica * self.layout.microbatches + mb;
            ok(DeviceTree::push(&mut tree.body, gpu, global, leaf), "gradient tree add");
            dx
        }

        fn live(&self, i: usize) -> (usize, usize) {
            (self.parts[i].owner().live_count(), self.parts[i].owner().live_bytes)
        }

        fn peak_live_bytes(&self) -> usize {
            self.parts.iter().map(|p| p.owner().peak_live_bytes).sum()
        }

        fn tied_share(&self, i: usize) -> Vec<f32> {
            ok(self.summed(i).tied_share(self.gpu()), "tied share")
        }

        fn combine_tied(&mut self, i: usize, other: Option<&[f32]>) {
            let (owner, gpu) = self.summed_mut(i);
            ok(owner.combine_tied(gpu, other), "tied gradient sum");
        }

        fn take_grads(&mut self, i: usize) -> Vec<Vec<f32>> {
            ok(self.summed(i).gradients(self.gpu()), "gradient download")
        }

        fn take_grad_nodes(&mut self, i: usize, _block: Range<usize>) -> Vec<(Span, Vec<Vec<f32>>)> {
            let (gpu, tree) = (self.dev.gpu(0), &mut self.trees[i]);
            let body = tree.body.take_nodes();
            let mut head = tree.head.as_mut().map(|h| h.take_nodes().into_iter());
            let mut out = Vec::with_capacity(body.len());
            for (span, b) in body {
                let h = head.as_mut().map(|h| h.next().expect("the head's nodes match the body's"));
                if let Some((hs, _)) = &h {
                    assert_eq!(*hs, span, "the head's and the body's nodes cover the same microbatches");
                }
                let grads = self.parts[i].owner().node_gradients(gpu, &b, h.as_ref().map(|h| &h.1));
                out.push((span, ok(grads, "gradient node download")));
                tree.body.recycle(b);
                if let (Some(t), Some((_, hb))) = (&mut tree.head, h) {
                    t.recycle(hb);
                }
            }
            out
        }

        fn sums_by_tree(&self) -> bool {
            true
        }

        fn finish_grad_tree(&mut self, i: usize) {
            let (gpu, tree) = (self.dev.gpu(0), &mut self.trees[i]);
            let body = tree.body.take_root();
            let head = tree.head.as_mut().map(TreeSum::take_root);
            ok(self.parts[i].owner_mut().set_tree_roots(gpu, &body, head.as_ref()), "gradient tree root");
            tree.body.recycle(body);
            if let (Some(t), Some(h)) = (&mut tree.head, head) {
                t.recycle(h);
            }
        }

        fn set_grads(&mut self, i: usize, grads: Vec<Vec<f32>>) {
            let (owner, gpu) = self.summed_mut(i);
            ok(owner.set_node_gradients(gpu, &grads), "gradient upload");
        }

        fn grad_sum_squares(&mut self, i: usize, out: &mut Vec<(usize, f64)>) {
            *out = ok(self.summed(i).grad_sum_squares(self.gpu()), "gradient norm");
        }

        fn poison_grad(&mut self, i: usize, value: f32) {
            let (owner, gpu) = self.summed_mut(i);
            ok(owner.poison_gradient(gpu, 0, value), "fault injection");
        }

        fn adamw(&mut self, hyper: Hyper, lr: f64, clip: f32) {
            for p in &mut self.parts {
                ok(p.adamw(&self.dev, &hyper, lr, clip), "AdamW");
            }
        }

        fn visit_params(&self, f: &mut dyn FnMut(usize, &str, &[f32])) {
            for (i, part) in self.parts.iter().enumerate() {
                let values = ok(part.owner().master_weights(self.gpu()), "weight download");
                for (t, v) in part.owner().tensors.iter().zip(&values) {
                    f(i, &t.name, v);
                }
            }
        }

        fn param_name(&self, i: usize, k: usize) -> Option<String> {
            self.parts.get(i).and_then(|p| p.owner().tensors.get(k)).map(|t| t.name.clone())
        }

        fn params(&self) -> Vec<Param> {
            let mut out = Vec::new();
            for part in &self.parts {
                let values = ok(part.owner().master_weights(self.gpu()), "weight download");
                for (t, data) in part.owner().tensors.iter().zip(values) {
                    let (name, shape, canonical) = (t.name.clone(), t.shape.clone(), t.canonical);
                    out.push(Param { name, shape, data, grad: vec![], canonical });
                }
            }
            out
        }

        fn snapshot(&self) -> (Vec<TensorState>, u64) {
            let mut tensors = Vec::new();
            for part in &self.parts {
                let data = ok(part.owner().master_weights(self.gpu()), "weight download");
                let (m, v) = ok(part.owner().moments(self.gpu()), "moment download");
                for (((t, d), m), v) in part.owner().tensors.iter().zip(data).zip(m).zip(v) {
                    tensors.push(TensorState {
                        name: t.name.clone(),
                        shape: t.shape.clone(),
                        data: d,
                        exp_avg: m,
                        exp_avg_sq: v,
                    });
                }
            }
            (tensors, self.parts.first().map_or(0, |p| p.owner().adam_t))
        }

        fn restore(&mut self, c: &Loaded) -> Result<(), String> {
            for part in &mut self.parts {
                let mut w = Vec::new();
                for t in &part.owner().tensors {
                    let (shape, data) =
                        c.weights.tensors.get(&t.name).ok_or_else(|| {
                            format!("rollback to {}: no tensor {}", c.dir.display(), t.name)
                        })?;
                    if *shape != t.shape {
                        return Err(format!(
                            "rollback to {}: {} has shape {shape:?}, expected {:?}",
                            c.dir.display(),
                            t.name,
                            t.shape
                        ));
                    }
                    w.push(data.as_slice());
                }
                let (m, v) = moment_lists(c, part.owner().tensors.iter().map(|t| t.name.as_str()))?;
                part.load_weights(&self.dev, &w).map_err(|e| e.to_string())?;
                let t = c.state.adam_step;
                part.owner_mut().load_moments(self.dev.gpu(0), &m, &v, t).map_err(|e| e.to_string())?;
            }
            Ok(())
        }
    }
}
