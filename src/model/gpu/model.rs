//! The whole model (any family) on one GPU: one optimizer step (microbatches forward
//! and backward with gradient accumulation, global norm, clipping, AdamW) in
//! the order of the CPU engine (train/engine.rs), so the two can be compared
//! step for step. It is one `GpuPart` holding every tensor — the same code a
//! pipeline stage on a GPU runs — driven the way one stage with every layer
//! would be: what `gpu-bench` times and `gpu-check` compares.

use super::part::{GpuGrad, GpuInput, GpuPart};
use crate::kernels::cuda::{ensure, CudaError, Elem, Gpu, Result};
use crate::metrics::StepStats;
use crate::model::params::{all_tensors, Arch, Param};
use crate::model::part::{Mode, PartSpec};
use crate::model::recompute::Recompute;
use crate::optim::{self, Hyper};

pub use super::part::{padded_vocab, TensorSlot};

pub struct GpuModel<'g, X: Elem> {
    gpu: &'g Gpu,
    part: GpuPart<X>,
    pub cfg: Arch,
    /// Sequences per microbatch.
    pub b: usize,
    host_inputs: Vec<u32>,
    host_targets: Vec<u32>,
}

impl<'g, X: Elem> GpuModel<'g, X> {
    /// The model with the given weights, in `params::all_tensors` order (the
    /// order of a whole-model `ModelPart`'s params), for microbatches of `b`
    /// sequences of `cfg.block_size` tokens. Out of device memory is an error
    /// (`is_out_of_memory`), with everything allocated so far freed.
    pub fn new(gpu: &'g Gpu, cfg: Arch, b: usize, weights: &[&[f32]]) -> Result<Self> {
        Self::with_recompute(gpu, cfg, b, Recompute::None, weights)
    }

    /// `new`, with the blocks' intermediates kept as `recompute` says.
    pub fn with_recompute(
        gpu: &'g Gpu,
        cfg: Arch,
        b: usize,
        recompute: Recompute,
        weights: &[&[f32]],
    ) -> Result<Self> {
        let shapes = all_tensors(&cfg);
        ensure(weights.len() == shapes.len(), || {
            format!("{} weight tensors given, the model has {}", weights.len(), shapes.len())
        })?;
        let params: Vec<Param> = shapes
            .into_iter()
            .zip(weights)
            .enumerate()
            .map(|(canonical, ((name, shape), w))| Param {
                name,
                shape,
                data: w.to_vec(),
                grad: vec![],
                canonical,
            })
            .collect();
        // One microbatch runs forward and backward before the next: one slot.
        let part = GpuPart::new(gpu, cfg, PartSpec::whole(&cfg), b, recompute, 1, &params)?;
        let n = part.n();
        Ok(GpuModel { gpu, part, cfg, b, host_inputs: vec![0; n], host_targets: vec![0; n] })
    }

    /// Tokens per microbatch.
    pub fn n(&self) -> usize {
        self.part.n()
    }

    /// The most likely next token at each of the microbatch's N positions, from
    /// a forward in evaluation (nothing kept): a step of greedy generation.
    pub fn predict(&mut self, tokens: &[u32], argmax: &mut [u32]) -> Result<()> {
        ensure(tokens.len() == self.n() && argmax.len() == self.n(), || {
            format!("predict takes N = {} tokens, got {} (argmax {})", self.n(), tokens.len(), argmax.len())
        })?;
        self.host_inputs.copy_from_slice(tokens);
        // The evaluation forward also forms a loss against these targets; it is not read.
        self.host_targets.fill(0);
        let input = GpuInput::Tokens(&self.host_inputs);
        let targets = Some(self.host_targets.as_slice());
        self.part.forward(self.gpu, 0, input, targets, Mode::Eval, Some(argmax), None)?;
        Ok(())
    }

    /// AdamW updates applied so far.
    pub fn adam_t(&self) -> u64 {
        self.part.adam_t
    }

    /// Device bytes the model's buffers take (weights, optimizer state, activations, scratch).
    pub fn device_bytes(&self) -> usize {
        self.part.device_bytes()
    }

    /// One optimizer step of `microbatches` microbatches, as `train::engine::Engine::step`
    /// on the CPU: `fill(mb, inputs, targets)` supplies microbatch `mb`.
    pub fn step(
        &mut self,
        lr: f64,
        hyper: &Hyper,
        grad_clip: f64,
        microbatches: usize,
        mut fill: impl FnMut(usize, &mut [u32], &mut [u32]),
    ) -> Result<StepStats> {
        ensure(microbatches > 0, || "a step needs at least one microbatch".into())?;
        let gpu = self.gpu;
        let dloss = 1.0 / (microbatches * self.n()) as f32;
        self.part.zero_grads(gpu)?;
        let mut loss_sum = 0.0f64;
        for mb in 0..microbatches {
            fill(mb, &mut self.host_inputs, &mut self.host_targets);
            let input = GpuInput::Tokens(&self.host_inputs);
            let targets = Some(self.host_targets.as_slice());
            let out = self.part.forward(gpu, mb, input, targets, Mode::Train { dloss }, None, None)?;
            loss_sum += out.loss_sum.unwrap_or(f64::NAN);
            self.part.backward(gpu, mb, GpuGrad::FromLoss, None)?;
        }
        self.part.combine_tied(gpu, None)?;
        let loss = loss_sum * dloss as f64;
        let mut norms = self.part.grad_sum_squares(gpu)?;
        let grad_norm = optim::global_norm(&mut norms);
        let skipped = !loss.is_finite() || !grad_norm.is_finite();
        if !skipped {
            let clip = optim::clip_coefficient(grad_norm, grad_clip);
            self.part.adamw(gpu, hyper, lr, clip)?;
        }
        Ok(StepStats { loss, grad_norm, lr, skipped })
    }

    /// The f32 master weights, per tensor.
    pub fn master_weights(&self) -> Result<Vec<Vec<f32>>> {
        self.part.master_weights(self.gpu)
    }

    /// The gradients of the last step (before clipping), per tensor.
    pub fn gradients(&self) -> Result<Vec<Vec<f32>>> {
        self.part.gradients(self.gpu)
    }
}

/// Whether an error is the device running out of memory (the bench then tries
/// a smaller microbatch).
pub fn is_out_of_memory(e: &CudaError) -> bool {
    use cudarc::driver::sys::CUresult;
    match e {
        CudaError::Driver(d) => d.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        CudaError::Blas(b) => b.0 == cudarc::cublaslt::sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED,
        _ => false,
    }
}
