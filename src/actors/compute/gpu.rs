//! Chunks on GPUs: `TpPart`s (a chunk over its tensor-parallel ranks; with
//! one rank, the plain `GpuPart`) on the devices this rank's thread owns. Each
//! microbatch's gradients are folded into the same fixed tree as on the CPU,
//! in device buffers (`DeviceTree`); activations and their gradients go
//! device to device where the run's plan allows (a parcel to a rank in this
//! process, an NCCL link to one in another), else in host memory, as
//! messages carry them.

use super::{moments_of, BackwardPart, ChunkInput, ChunkOutput, StageCompute};
use crate::actors::stage::nccl::{link_orders, GpuPlan, NcclKey};
use crate::actors::Layout;
use crate::checkpoint::{Loaded, TensorState};
use crate::kernels::cuda::nccl::{Comm, NcclId, NcclType};
use crate::kernels::cuda::transfer::{NcclLink, Outbox, ParcelKey};
use crate::kernels::cuda::{adamw, CudaError, DeviceBuffer, Elem, Gpu};
use crate::model::gpu::part::GpuPart;
use crate::model::gpu::part::{GpuGrad, GpuInput, TpDevices, TpPart};
use crate::model::part::Mode;
use crate::model::Param;
use crate::optim::grad_tree::{held_sets, Span, TreeSum};
use crate::optim::Hyper;
use std::collections::BTreeMap;
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
    layout: Layout,
    /// Device routes (None: every tensor in host memory). A cell: the
    /// receive and the send of one action borrow it one after the other.
    routes: Option<std::cell::RefCell<Routes<X>>>,
    /// Each chunk's microbatch gradients, summed by the fixed tree.
    trees: Vec<DeviceTree>,
    /// The EMA of the weights (`optim.ema_decay`), kept on the device
    /// beside each chunk's master weights; None when none is kept.
    ema: Option<DeviceEma>,
}

/// What the device's EMA buffers (`GpuPart::keep_ema`) are updated by.
struct DeviceEma {
    decay: f64,
    /// AveragedModel's `n_averaged` (0 → the next update copies).
    updates: u64,
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

    /// A step over another block of another total (a batch ramp's steps
    /// differ in size): the buffers stay, allocated for the full step, which
    /// holds the most (`held_sets` grows with the block).
    fn set_block(&mut self, block: Range<usize>, total: usize) {
        self.body.set_block(block.clone(), total);
        if let Some(h) = &mut self.head {
            h.set_block(block, total);
        }
    }

    /// The global index of the step's microbatch `mb` on this replica.
    fn global(&self, mb: usize) -> usize {
        self.body.block().start + mb
    }

    /// A zeroed-or-stale buffer for a leaf: the leaf's copy overwrites it whole.
    fn leaf(tree: &mut TreeSum<DeviceBuffer<f32>>, gpu: &Gpu, len: usize) -> CudaResult<DeviceBuffer<f32>> {
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
    pub layout: &'a Layout,
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
        recompute: crate::model::recompute::Recompute,
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
            ema: None,
        })
    }

    /// Keeps an EMA of every chunk's master weights on its GPU
    /// (`optim.ema_decay` = `decay`; 0 keeps none), resumed from
    /// `resume`'s when given.
    pub fn with_ema(mut self, decay: f64, resume: Option<&Loaded>) -> Result<Self, String> {
        if decay == 0.0 {
            return Ok(self);
        }
        let gpu = self.dev.gpu(0);
        for part in &mut self.parts {
            part.owner_mut().keep_ema(gpu).map_err(|e| {
                format!("GPU {} (the EMA of the weights, {}): {e}", gpu.name, gpu_memory_hint(&e))
            })?;
        }
        self.ema = Some(DeviceEma { decay, updates: 0 });
        if let Some(c) = resume {
            self.load_ema(c)?;
        }
        Ok(self)
    }

    /// Sets every chunk's EMA and the update count from a checkpoint.
    fn load_ema(&mut self, c: &Loaded) -> Result<(), String> {
        let Some(e) = &mut self.ema else { return Ok(()) };
        let (whole, n) = super::ema_of(c, e.decay)?;
        let gpu = self.dev.gpu(0);
        for part in &mut self.parts {
            let owner = part.owner_mut();
            let mut values = Vec::with_capacity(owner.tensors.len());
            for t in &owner.tensors {
                let at = c.dir.display();
                let v = whole
                    .get(&t.name)
                    .ok_or_else(|| format!("{at}: checkpoint lacks the EMA of {}", t.name))?;
                if v.len() != t.numel {
                    return Err(format!(
                        "{at}: the EMA of {} has {} elements, expected {}",
                        t.name,
                        v.len(),
                        t.numel
                    ));
                }
                values.push(v.as_slice());
            }
            owner.load_ema(gpu, &values).map_err(|e| e.to_string())?;
        }
        e.updates = n;
        Ok(())
    }
}

impl<X: Elem + NcclType> Routes<X> {
    fn new(
        gpu: &Gpu,
        plan: Arc<GpuPlan>,
        layout: &Layout,
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
                    // A batch ramp's smaller steps run schedules of their own.
                    let schedules = std::iter::once(&layout.schedule).chain(layout.ramp_schedules.values());
                    for schedule in schedules {
                        let (sent, taken) = link_orders(layout, schedule, from, to, gradient);
                        if sent != taken {
                            return Err(format!(
                                "NCCL matches a link's sends and receives by order, but this schedule \
                                 ({} microbatches) sends rank {from} → rank {to} {} in the order {sent:?} and \
                                 consumes them in the order {taken:?}: run these ranks in one process, or use \
                                 gpipe or 1f1b",
                                schedule.microbatches,
                                if gradient { "gradients" } else { "activations" }
                            ));
                        }
                    }
                    let me = usize::from(to == rank);
                    let comm = Comm::init(gpu, &id, 2, me).map_err(|e| format!("NCCL link {key:?}: {e}"))?;
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
        let global = self.trees[i].global(mb);
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
        let global = tree.global(mb);
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

    fn set_block(&mut self, block: Range<usize>, total: usize) {
        for t in &mut self.trees {
            t.set_block(block.clone(), total);
        }
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

    fn update_ema(&mut self) {
        let Some(e) = &mut self.ema else { return };
        let weight = crate::kernels::cpu::ema::weight_of(e.decay);
        // Chunk order; each chunk's update is elementwise, so the order
        // sets no bits, only which launch comes first on the stream.
        for part in &mut self.parts {
            ok(part.owner_mut().update_ema(self.dev.gpu(0), e.updates == 0, weight), "EMA update");
        }
        e.updates += 1;
    }

    fn ema_updates(&self) -> Option<u64> {
        self.ema.as_ref().map(|e| e.updates)
    }

    fn ema_shards(&self, i: usize) -> Vec<Vec<f32>> {
        ok(self.parts[i].owner().ema_weights(self.gpu()), "EMA download")
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
            let mut ema = match self.ema {
                Some(_) => ok(part.owner().ema_weights(self.gpu()), "EMA download").into_iter(),
                None => Vec::new().into_iter(),
            };
            for (((t, d), m), v) in part.owner().tensors.iter().zip(data).zip(m).zip(v) {
                tensors.push(TensorState {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    data: d,
                    exp_avg: m,
                    exp_avg_sq: v,
                    ema: ema.next().unwrap_or_default(),
                });
            }
        }
        (tensors, self.parts.first().map_or(0, |p| p.owner().adam_t))
    }

    fn restore(&mut self, c: &Loaded) -> Result<(), String> {
        for part in &mut self.parts {
            let mut w = Vec::new();
            for t in &part.owner().tensors {
                let (shape, data) = c
                    .weights
                    .tensors
                    .get(&t.name)
                    .ok_or_else(|| format!("rollback to {}: no tensor {}", c.dir.display(), t.name))?;
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
        self.load_ema(c)
    }
}
