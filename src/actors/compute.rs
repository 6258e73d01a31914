//! What a stage's compute thread computes with: its model chunks on the CPU
//! (`ModelPart`s on a rayon pool pinned to the rank's cores) or on a GPU
//! (`GpuPart`s on the device the rank owns), behind one interface, so the
//! schedule executor in stage.rs is the same for every backend.
//!
//! Chunks are addressed by their local index (position in the rank's
//! ascending list of stages). Activations and gradients cross this border as
//! host `Vec<f32>`s: that is what messages carry between ranks, processes and
//! replay logs. A GPU backend stages them through host memory.
//!
//! A backend error on the GPU is a failure of the stage: it panics with the
//! error, and the stage reports it (actor, step, action) like any other.

use crate::checkpoint::{Loaded, TensorState};
use crate::kernels::cpu::matmul::with_random_order;
use crate::model::part::{MicroActs, Mode, PartInput};
use crate::model::{ModelPart, Param};
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
    /// Replaces chunk `i`'s gradients (their sum over replicas).
    fn set_grads(&mut self, i: usize, grads: Vec<Vec<f32>>);
    /// Per-tensor Σg² of chunk `i` as (canonical index, value).
    fn grad_sum_squares(&mut self, i: usize, out: &mut Vec<(usize, f64)>);
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
    /// Parameters and AdamW moments for a checkpoint, with AdamW's step count.
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
}

impl CpuCompute {
    pub fn new(
        parts: Vec<ModelPart>,
        adam: Vec<AdamState>,
        pool: rayon::ThreadPool,
        nondet: bool,
        b: usize,
    ) -> Self {
        CpuCompute { parts, adam, saved: BTreeMap::new(), pool, nondet, b }
    }
}

/// Loads a checkpoint's moments for `params` into `st`.
pub fn load_moments(params: &[Param], st: &mut AdamState, c: &Loaded) -> Result<(), String> {
    st.t = c.state.adam_step;
    for (i, p) in params.iter().enumerate() {
        let (m, v) =
            c.moments.get(&p.name).ok_or_else(|| format!("checkpoint lacks moments of {}", p.name))?;
        st.m[i].copy_from_slice(m);
        st.v[i].copy_from_slice(v);
    }
    Ok(())
}

impl StageCompute for CpuCompute {
    fn micro_batch(&self) -> usize {
        self.b
    }

    fn zero_grads(&mut self) {
        for p in &mut self.parts {
            p.zero_grads();
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
        let part = &mut self.parts[i];
        if which == BackwardPart::Weight {
            self.pool.install(|| with_random_order(nondet, || part.backward_weight(mb)));
            return None;
        }
        let acts = self.saved.remove(&(i, mb)).expect("F ran before B");
        self.pool.install(|| {
            with_random_order(nondet, || match which {
                BackwardPart::Full => part.backward(acts, dout),
                BackwardPart::Input => part.backward_input(acts, dout, mb),
                BackwardPart::Weight => unreachable!(),
            })
        })
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

    fn set_grads(&mut self, i: usize, grads: Vec<Vec<f32>>) {
        for (p, g) in self.parts[i].params.iter_mut().zip(grads) {
            p.grad = g;
        }
    }

    fn grad_sum_squares(&mut self, i: usize, out: &mut Vec<(usize, f64)>) {
        let part = &self.parts[i];
        self.pool.install(|| optim::grad_sum_squares(part, out));
    }

    fn poison_grad(&mut self, i: usize, value: f32) {
        self.parts[i].params[0].grad[0] = value;
    }

    fn adamw(&mut self, hyper: Hyper, lr: f64, clip: f32) {
        let (parts, adam) = (&mut self.parts, &mut self.adam);
        self.pool.install(|| {
            for (part, st) in parts.iter_mut().zip(adam.iter_mut()) {
                st.step(part, hyper, lr, clip);
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
pub use gpu::GpuCompute;

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use crate::kernels::cuda::part::{GpuInput, GpuPart};
    use crate::kernels::cuda::{Elem, Gpu};

    /// Chunks on one GPU, which this rank's thread owns (its context and stream).
    pub struct GpuCompute<X: Elem> {
        gpu: Gpu,
        parts: Vec<GpuPart<X>>,
        b: usize,
    }

    /// A GPU error ends the stage: the worker reports the panic as its failure.
    fn ok<T>(r: crate::kernels::cuda::Result<T>, what: &str) -> T {
        r.unwrap_or_else(|e| panic!("GPU {what}: {e}"))
    }

    impl<X: Elem> GpuCompute<X> {
        /// Moves `cpu_parts`' tensors (initial, `--init` or resumed values)
        /// onto `gpu`, with `live[i]` activation slots for chunk i, and the
        /// AdamW state of `adam` (zero moments when starting).
        pub fn new(
            gpu: Gpu,
            chunks: Vec<(crate::model::PartSpec, Vec<Param>)>,
            cfg: crate::model::GptConfig,
            b: usize,
            recompute: bool,
            live: &[usize],
            resume: Option<&Loaded>,
        ) -> Result<Self, String> {
            let mut parts = Vec::new();
            for ((spec, params), &slots) in chunks.into_iter().zip(live) {
                let mut part = GpuPart::<X>::new(&gpu, cfg, spec, b, recompute, slots.max(1), &params)
                    .map_err(|e| format!("GPU {} ({}): {e}", gpu.name, gpu_memory_hint(&e)))?;
                if let Some(c) = resume {
                    let mut m = Vec::new();
                    let mut v = Vec::new();
                    for p in &params {
                        let (pm, pv) = c
                            .moments
                            .get(&p.name)
                            .ok_or_else(|| format!("checkpoint lacks moments of {}", p.name))?;
                        m.push(pm.clone());
                        v.push(pv.clone());
                    }
                    part.load_moments(&gpu, &m, &v, c.state.adam_step).map_err(|e| e.to_string())?;
                }
                parts.push(part);
            }
            Ok(GpuCompute { gpu, parts, b })
        }
    }

    fn gpu_memory_hint(e: &crate::kernels::cuda::CudaError) -> &'static str {
        if crate::kernels::cuda::model::is_out_of_memory(e) {
            "out of device memory: fewer microbatches alive (schedule), a smaller train.micro_batch_size, or train.recompute"
        } else {
            "could not set up the stage's part"
        }
    }

    impl<X: Elem> StageCompute for GpuCompute<X> {
        fn micro_batch(&self) -> usize {
            self.b
        }

        fn zero_grads(&mut self) {
            for p in &mut self.parts {
                ok(p.zero_grads(&self.gpu), "zero gradients");
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
            let input = match &input {
                ChunkInput::Tokens(t) => GpuInput::Tokens(t),
                ChunkInput::Activation(a) => GpuInput::Activation(a),
            };
            let out = ok(self.parts[i].forward(&self.gpu, mb, input, targets, mode, argmax), "forward");
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
            ok(self.parts[i].backward(&self.gpu, mb, dout.as_deref()), "backward")
        }

        fn live(&self, i: usize) -> (usize, usize) {
            (self.parts[i].live_count(), self.parts[i].live_bytes)
        }

        fn peak_live_bytes(&self) -> usize {
            self.parts.iter().map(|p| p.peak_live_bytes).sum()
        }

        fn tied_share(&self, i: usize) -> Vec<f32> {
            ok(self.parts[i].tied_share(&self.gpu), "tied share")
        }

        fn combine_tied(&mut self, i: usize, other: Option<&[f32]>) {
            ok(self.parts[i].combine_tied(&self.gpu, other), "tied gradient sum");
        }

        fn take_grads(&mut self, i: usize) -> Vec<Vec<f32>> {
            ok(self.parts[i].gradients(&self.gpu), "gradient download")
        }

        fn set_grads(&mut self, i: usize, grads: Vec<Vec<f32>>) {
            ok(self.parts[i].set_gradients(&self.gpu, &grads), "gradient upload");
        }

        fn grad_sum_squares(&mut self, i: usize, out: &mut Vec<(usize, f64)>) {
            *out = ok(self.parts[i].grad_sum_squares(&self.gpu), "gradient norm");
        }

        fn poison_grad(&mut self, i: usize, value: f32) {
            ok(self.parts[i].poison_gradient(&self.gpu, 0, value), "fault injection");
        }

        fn adamw(&mut self, hyper: Hyper, lr: f64, clip: f32) {
            for p in &mut self.parts {
                ok(p.adamw(&self.gpu, &hyper, lr, clip), "AdamW");
            }
        }

        fn visit_params(&self, f: &mut dyn FnMut(usize, &str, &[f32])) {
            for (i, part) in self.parts.iter().enumerate() {
                let values = ok(part.master_weights(&self.gpu), "weight download");
                for (t, v) in part.tensors.iter().zip(&values) {
                    f(i, &t.name, v);
                }
            }
        }

        fn param_name(&self, i: usize, k: usize) -> Option<String> {
            self.parts.get(i).and_then(|p| p.tensors.get(k)).map(|t| t.name.clone())
        }

        fn params(&self) -> Vec<Param> {
            let mut out = Vec::new();
            for part in &self.parts {
                let values = ok(part.master_weights(&self.gpu), "weight download");
                for (t, data) in part.tensors.iter().zip(values) {
                    let (name, shape, canonical) = (t.name.clone(), t.shape.clone(), t.canonical);
                    out.push(Param { name, shape, data, grad: vec![], canonical });
                }
            }
            out
        }

        fn snapshot(&self) -> (Vec<TensorState>, u64) {
            let mut tensors = Vec::new();
            for part in &self.parts {
                let data = ok(part.master_weights(&self.gpu), "weight download");
                let (m, v) = ok(part.moments(&self.gpu), "moment download");
                for (((t, d), m), v) in part.tensors.iter().zip(data).zip(m).zip(v) {
                    tensors.push(TensorState {
                        name: t.name.clone(),
                        shape: t.shape.clone(),
                        data: d,
                        exp_avg: m,
                        exp_avg_sq: v,
                    });
                }
            }
            (tensors, self.parts.first().map_or(0, |p| p.adam_t))
        }

        fn restore(&mut self, c: &Loaded) -> Result<(), String> {
            for part in &mut self.parts {
                let mut w = Vec::new();
                let (mut m, mut v) = (Vec::new(), Vec::new());
                for t in &part.tensors {
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
                    let (pm, pv) = c
                        .moments
                        .get(&t.name)
                        .ok_or_else(|| format!("checkpoint lacks moments of {}", t.name))?;
                    m.push(pm.clone());
                    v.push(pv.clone());
                }
                part.load_weights(&self.gpu, &w).map_err(|e| e.to_string())?;
                part.load_moments(&self.gpu, &m, &v, c.state.adam_step).map_err(|e| e.to_string())?;
            }
            Ok(())
        }
    }
}
