//! The whole GPT-2 model on one GPU: one optimizer step (microbatches forward
//! and backward with gradient accumulation, global norm, clipping, AdamW) in
//! the order of the CPU model (model/part.rs, train/engine.rs), so the two can
//! be compared step for step.
//!
//! Storage type X is bf16 (training) or f32 (the path the CPU comparison uses);
//! master weights, gradients and AdamW moments are f32. All tensors live in
//! flat buffers at offsets aligned for cuBLASLt, in the CPU model's parameter
//! order; wte is padded to `padded_vocab` rows (zero, with zero gradient, so
//! AdamW keeps them zero) so the head's products have aligned leading
//! dimensions. Every device buffer is allocated in `new`: a step allocates no
//! device memory, and a step that does not fit fails in `new`, not midway.

use super::embedding::{DeviceOwners, TokenOwners};
use super::{adamw, attention, crossentropy, embedding, gelu, layernorm, matmul, residual};
use super::{ensure, CudaError, DeviceBuffer, Elem, Gpu, Result};
use crate::model::params::{all_tensors, GptConfig};
use crate::optim::{self, Hyper};
use crate::train::engine::StepStats;

/// Tensor offsets are multiples of this many elements (128 bytes in bf16), so
/// every matrix handed to cuBLASLt is aligned for its fastest kernels.
const ALIGN: usize = 64;

/// The vocabulary rounded up to a multiple of 128 (50257 → 50304, as llm.c).
pub fn padded_vocab(v: usize) -> usize {
    v.div_ceil(128) * 128
}

use crate::model::params::block::*;

/// Where one tensor lives in the flat buffers.
#[derive(Clone, Debug)]
pub struct TensorSlot {
    pub name: String,
    pub offset: usize,
    /// Elements of the CPU tensor.
    pub numel: usize,
    /// Elements on the device (wte: padded rows included).
    pub stored: usize,
    pub decay: bool,
}

/// One block's activations for one microbatch, kept from forward for backward.
struct BlockActs<X: Elem> {
    ln1: DeviceBuffer<X>,
    ln1_mean: DeviceBuffer<f32>,
    ln1_rstd: DeviceBuffer<f32>,
    qkv: DeviceBuffer<X>,
    atty: DeviceBuffer<X>,
    lse: DeviceBuffer<f32>,
    res2: DeviceBuffer<X>,
    ln2: DeviceBuffer<X>,
    ln2_mean: DeviceBuffer<f32>,
    ln2_rstd: DeviceBuffer<f32>,
    fch: DeviceBuffer<X>,
    fch_gelu: DeviceBuffer<X>,
    /// The block's output: the residual stream entering the next block.
    out: DeviceBuffer<X>,
}

impl<X: Elem> BlockActs<X> {
    fn new(gpu: &Gpu, b: usize, t: usize, c: usize, nh: usize) -> Result<Self> {
        let n = b * t;
        Ok(BlockActs {
            ln1: gpu.alloc(n * c)?,
            ln1_mean: gpu.alloc(n)?,
            ln1_rstd: gpu.alloc(n)?,
            qkv: gpu.alloc(n * 3 * c)?,
            atty: gpu.alloc(n * c)?,
            lse: gpu.alloc(b * nh * t)?,
            res2: gpu.alloc(n * c)?,
            ln2: gpu.alloc(n * c)?,
            ln2_mean: gpu.alloc(n)?,
            ln2_rstd: gpu.alloc(n)?,
            fch: gpu.alloc(n * 4 * c)?,
            fch_gelu: gpu.alloc(n * 4 * c)?,
            out: gpu.alloc(n * c)?,
        })
    }
}

pub struct GpuModel<'g, X: Elem> {
    gpu: &'g Gpu,
    pub cfg: GptConfig,
    /// Sequences per microbatch.
    pub b: usize,
    pub vp: usize,
    pub tensors: Vec<TensorSlot>,
    master: DeviceBuffer<f32>,
    params: DeviceBuffer<X>,
    grads: DeviceBuffer<f32>,
    m: DeviceBuffer<f32>,
    v: DeviceBuffer<f32>,
    /// AdamW updates applied so far.
    pub adam_t: u64,
    encoded: DeviceBuffer<X>,
    blocks: Vec<BlockActs<X>>,
    lnf: DeviceBuffer<X>,
    lnf_mean: DeviceBuffer<f32>,
    lnf_rstd: DeviceBuffer<f32>,
    /// (N, Vp): logits in forward, their gradient after the fused loss.
    logits: DeviceBuffer<X>,
    losses: DeviceBuffer<f32>,
    // Backward scratch, shared by every block (one runs at a time).
    dres: DeviceBuffer<X>,
    dln: DeviceBuffer<X>,
    datty: DeviceBuffer<X>,
    dqkv: DeviceBuffer<X>,
    dfch: DeviceBuffer<X>,
    delta: DeviceBuffer<f32>,
    ln_partial: DeviceBuffer<f32>,
    bias_partial: DeviceBuffer<f32>,
    norm_partial: DeviceBuffer<f32>,
    norm_out: DeviceBuffer<f32>,
    tokens: DeviceBuffer<u32>,
    targets: DeviceBuffer<u32>,
    owners: DeviceOwners,
    host_inputs: Vec<u32>,
    host_targets: Vec<u32>,
    host_losses: Vec<f32>,
}

impl<'g, X: Elem> GpuModel<'g, X> {
    /// The model with the given weights, in `params::all_tensors` order (the
    /// order of a whole-model `ModelPart`'s params), for microbatches of `b`
    /// sequences of `cfg.block_size` tokens. Out of device memory is an error
    /// (`is_out_of_memory`), with everything allocated so far freed.
    pub fn new(gpu: &'g Gpu, cfg: GptConfig, b: usize, weights: &[&[f32]]) -> Result<Self> {
        let (t, c, nh, v) = (cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size);
        ensure(nh > 0 && c == nh * attention::HEAD_SIZE, || {
            format!("the CUDA model needs head size {}: n_embd {c} / n_head {nh}", attention::HEAD_SIZE)
        })?;
        ensure(b > 0 && t > 0 && v > 0 && cfg.n_layer > 0, || {
            format!("the CUDA model needs B, T, V and n_layer > 0 (B={b}, T={t}, V={v}, L={})", cfg.n_layer)
        })?;
        let n = b * t;
        ensure(n <= i32::MAX as usize / (4 * c) && n.saturating_mul(padded_vocab(v)) < (1 << 40), || {
            format!("the CUDA model's kernels index with 32-bit rows: B·T = {n} is too many")
        })?;
        let shapes = all_tensors(&cfg);
        ensure(weights.len() == shapes.len(), || {
            format!("{} weight tensors given, the model has {}", weights.len(), shapes.len())
        })?;
        let vp = padded_vocab(v);
        let mut tensors = Vec::with_capacity(shapes.len());
        let mut offset = 0;
        for ((name, shape), w) in shapes.iter().zip(weights) {
            let numel: usize = shape.iter().product();
            ensure(w.len() == numel, || format!("{name}: {} values given, shape {shape:?}", w.len()))?;
            let stored = if name == "wte.weight" { vp * c } else { numel };
            tensors.push(TensorSlot { name: name.clone(), offset, numel, stored, decay: shape.len() >= 2 });
            offset = (offset + stored).div_ceil(ALIGN) * ALIGN;
        }
        let total = offset;
        let mut host = vec![0.0f32; total];
        for (slot, w) in tensors.iter().zip(weights) {
            host[slot.offset..slot.offset + slot.numel].copy_from_slice(w);
        }
        let host_x: Vec<X> = host.iter().map(|&x| X::from_f32(x)).collect();
        let master = gpu.alloc::<f32>(total)?;
        gpu.copy_to(&master, 0, &host)?;
        let params = gpu.alloc::<X>(total)?;
        gpu.copy_to(&params, 0, &host_x)?;
        drop((host, host_x));
        let blocks =
            (0..cfg.n_layer).map(|_| BlockActs::new(gpu, b, t, c, nh)).collect::<Result<Vec<_>>>()?;
        let model = GpuModel {
            gpu,
            cfg,
            b,
            vp,
            grads: gpu.alloc(total)?,
            m: gpu.alloc(total)?,
            v: gpu.alloc(total)?,
            adam_t: 0,
            master,
            params,
            tensors,
            encoded: gpu.alloc(n * c)?,
            blocks,
            lnf: gpu.alloc(n * c)?,
            lnf_mean: gpu.alloc(n)?,
            lnf_rstd: gpu.alloc(n)?,
            logits: gpu.alloc(n * vp)?,
            losses: gpu.alloc(n)?,
            dres: gpu.alloc(n * c)?,
            dln: gpu.alloc(n * c)?,
            datty: gpu.alloc(n * c)?,
            dqkv: gpu.alloc(n * 3 * c)?,
            dfch: gpu.alloc(n * 4 * c)?,
            delta: gpu.alloc(b * nh * t)?,
            ln_partial: gpu.alloc(layernorm::partial_len(n, c))?,
            bias_partial: gpu.alloc(matmul::bias_partial_len(n, 4 * c))?,
            norm_partial: gpu.alloc(adamw::NORM_BLOCKS)?,
            norm_out: gpu.alloc(1)?,
            tokens: gpu.alloc(n)?,
            targets: gpu.alloc(n)?,
            owners: DeviceOwners {
                ids: gpu.alloc(n)?,
                offsets: gpu.alloc(n + 1)?,
                positions: gpu.alloc(n)?,
                count: 0,
            },
            host_inputs: vec![0; n],
            host_targets: vec![0; n],
            host_losses: vec![0.0; n],
        };
        gpu.synchronize()?;
        Ok(model)
    }

    /// Tokens per microbatch.
    pub fn n(&self) -> usize {
        self.b * self.cfg.block_size
    }

    /// Device bytes the model's buffers take (weights, optimizer state, activations, scratch).
    pub fn device_bytes(&self) -> usize {
        let blocks: usize = self
            .blocks
            .iter()
            .map(|a| {
                a.ln1.bytes()
                    + a.ln1_mean.bytes()
                    + a.ln1_rstd.bytes()
                    + a.qkv.bytes()
                    + a.atty.bytes()
                    + a.lse.bytes()
                    + a.res2.bytes()
                    + a.ln2.bytes()
                    + a.ln2_mean.bytes()
                    + a.ln2_rstd.bytes()
                    + a.fch.bytes()
                    + a.fch_gelu.bytes()
                    + a.out.bytes()
            })
            .sum();
        self.master.bytes()
            + self.params.bytes()
            + self.grads.bytes()
            + self.m.bytes()
            + self.v.bytes()
            + self.encoded.bytes()
            + blocks
            + self.lnf.bytes()
            + self.logits.bytes()
            + self.dres.bytes()
            + self.dln.bytes()
            + self.datty.bytes()
            + self.dqkv.bytes()
            + self.dfch.bytes()
            + self.ln_partial.bytes()
            + self.bias_partial.bytes()
    }

    /// Device address of tensor `i`'s X copy.
    fn w(&self, i: usize) -> u64 {
        self.params.ptr_at(self.tensors[i].offset)
    }

    /// Device address of tensor `i`'s f32 gradient.
    fn g(&self, i: usize) -> u64 {
        self.grads.ptr_at(self.tensors[i].offset)
    }

    fn block_base(l: usize) -> usize {
        2 + 12 * l
    }

    fn head_base(&self) -> usize {
        2 + 12 * self.cfg.n_layer
    }

    /// The residual stream entering block `l`.
    fn block_input(&self, l: usize) -> &DeviceBuffer<X> {
        if l == 0 {
            &self.encoded
        } else {
            &self.blocks[l - 1].out
        }
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
        let dloss = 1.0 / (microbatches * self.n()) as f32;
        self.gpu.zero(&self.grads)?;
        let mut loss_sum = 0.0f64;
        for mb in 0..microbatches {
            let (mut inputs, mut targets) =
                (std::mem::take(&mut self.host_inputs), std::mem::take(&mut self.host_targets));
            fill(mb, &mut inputs, &mut targets);
            let uploaded = self.upload_microbatch(&inputs, &targets);
            (self.host_inputs, self.host_targets) = (inputs, targets);
            uploaded?;
            self.forward(dloss)?;
            self.backward()?;
            // Waits for this microbatch; the next one's upload would wait anyway.
            let mut losses = std::mem::take(&mut self.host_losses);
            let read = self.gpu.download_into(&self.losses, &mut losses);
            loss_sum += losses.iter().map(|&l| l as f64).sum::<f64>();
            self.host_losses = losses;
            read?;
        }
        let loss = loss_sum * dloss as f64;
        let sumsq = adamw::sum_squares(self.gpu, &self.grads, &self.norm_partial, &self.norm_out)?;
        let grad_norm = (sumsq as f64).sqrt();
        let skipped = !loss.is_finite() || !grad_norm.is_finite();
        if !skipped {
            let clip = optim::clip_coefficient(grad_norm, grad_clip);
            self.adamw(lr, hyper, clip)?;
        }
        Ok(StepStats { loss, grad_norm, lr, skipped })
    }

    fn upload_microbatch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<()> {
        let v = self.cfg.vocab_size;
        ensure(inputs.len() == self.n() && targets.len() == self.n(), || {
            "microbatch of the wrong size".into()
        })?;
        let bad = inputs.iter().chain(targets).find(|&&tok| tok as usize >= v);
        ensure(bad.is_none(), || {
            format!("token id {} is not below vocab_size {v}", bad.copied().unwrap_or(0))
        })?;
        self.gpu.copy_to(&self.tokens, 0, inputs)?;
        self.gpu.copy_to(&self.targets, 0, targets)?;
        let owners = TokenOwners::new(inputs);
        self.gpu.copy_to(&self.owners.ids, 0, &owners.ids)?;
        self.gpu.copy_to(&self.owners.offsets, 0, &owners.offsets)?;
        self.gpu.copy_to(&self.owners.positions, 0, &owners.positions)?;
        self.owners.count = owners.ids.len();
        Ok(())
    }

    /// Forward of the microbatch on the device, ending in the fused loss: the
    /// logits buffer then holds dlogits (llm.c's fused classifier, as the CPU's).
    fn forward(&self, dloss: f32) -> Result<()> {
        let gpu = self.gpu;
        let GptConfig { block_size: t, n_embd: c, n_head: nh, vocab_size: v, .. } = self.cfg;
        let (b, n) = (self.b, self.n());
        embedding::embedding_forward(gpu, &self.encoded, &self.tokens, self.w(0), self.w(1), n, t, c)?;
        for (l, a) in self.blocks.iter().enumerate() {
            let w = |k: usize| self.w(Self::block_base(l) + k);
            let x = self.block_input(l);
            layernorm::layernorm_forward(gpu, &a.ln1, &a.ln1_mean, &a.ln1_rstd, x, w(LN1W), w(LN1B), n, c)?;
            matmul::matmul_forward(gpu, &a.qkv, &a.ln1, w(QKVW), Some(w(QKVB)), n, c, 3 * c)?;
            attention::attention_forward(gpu, &a.atty, &a.lse, &a.qkv, b, t, c, nh)?;
            matmul::matmul_forward(gpu, &a.res2, &a.atty, w(PROJW), Some(w(PROJB)), n, c, c)?;
            residual::residual_forward(gpu, a.res2.ptr(), a.res2.ptr(), x, n * c)?;
            layernorm::layernorm_forward(
                gpu,
                &a.ln2,
                &a.ln2_mean,
                &a.ln2_rstd,
                &a.res2,
                w(LN2W),
                w(LN2B),
                n,
                c,
            )?;
            matmul::matmul_forward(gpu, &a.fch, &a.ln2, w(FCW), Some(w(FCB)), n, c, 4 * c)?;
            gelu::gelu_forward(gpu, &a.fch_gelu, &a.fch, n * 4 * c)?;
            matmul::matmul_forward(gpu, &a.out, &a.fch_gelu, w(FCPW), Some(w(FCPB)), n, 4 * c, c)?;
            residual::residual_forward(gpu, a.out.ptr(), a.out.ptr(), &a.res2, n * c)?;
        }
        let hb = self.head_base();
        let last = self.block_input(self.cfg.n_layer);
        layernorm::layernorm_forward(
            gpu,
            &self.lnf,
            &self.lnf_mean,
            &self.lnf_rstd,
            last,
            self.w(hb),
            self.w(hb + 1),
            n,
            c,
        )?;
        // logits (N, Vp) = lnf (N, C) · wteᵀ: the input-gradient product with wte as (Vp, C).
        matmul::matmul_backward_input(gpu, &self.logits, &self.lnf, self.w(0), n, self.vp, c)?;
        crossentropy::crossentropy_forward_backward(
            gpu,
            &self.logits,
            &self.losses,
            &self.targets,
            dloss,
            n,
            v,
            self.vp,
        )
    }

    /// Backward of the microbatch whose forward just ran, accumulating every
    /// weight gradient in the CPU model's order (part.rs, a full B).
    fn backward(&self) -> Result<()> {
        let gpu = self.gpu;
        let GptConfig { block_size: t, n_embd: c, n_head: nh, .. } = self.cfg;
        let (b, n, vp) = (self.b, self.n(), self.vp);
        let hb = self.head_base();
        let last = self.block_input(self.cfg.n_layer);
        // dlnf (N, C) = dlogits (N, Vp) · wte (Vp, C); dwte += dlogitsᵀ · lnf.
        matmul::matmul_forward(gpu, &self.dln, &self.logits, self.w(0), None, n, vp, c)?;
        matmul::matmul_backward_weight(
            gpu,
            self.g(0),
            None,
            &self.bias_partial,
            &self.lnf,
            &self.logits,
            n,
            vp,
            c,
        )?;
        gpu.zero(&self.dres)?;
        layernorm::layernorm_backward_input(
            gpu,
            &self.dres,
            &self.dln,
            last,
            self.w(hb),
            &self.lnf_mean,
            &self.lnf_rstd,
            n,
            c,
        )?;
        layernorm::layernorm_backward_weight(
            gpu,
            self.g(hb),
            self.g(hb + 1),
            &self.ln_partial,
            &self.dln,
            last,
            &self.lnf_mean,
            &self.lnf_rstd,
            n,
            c,
        )?;
        for (l, a) in self.blocks.iter().enumerate().rev() {
            let base = Self::block_base(l);
            let (w, g) = (|k: usize| self.w(base + k), |k: usize| self.g(base + k));
            let x = self.block_input(l);
            let bp = &self.bias_partial;
            // dres holds ∂L/∂(block output). MLP first.
            matmul::matmul_backward_weight(
                gpu,
                g(FCPW),
                Some(g(FCPB)),
                bp,
                &self.dres,
                &a.fch_gelu,
                n,
                4 * c,
                c,
            )?;
            matmul::matmul_backward_input(gpu, &self.dfch, &self.dres, w(FCPW), n, 4 * c, c)?;
            gelu::gelu_backward(gpu, &self.dfch, &a.fch, &self.dfch, n * 4 * c)?;
            matmul::matmul_backward_input(gpu, &self.dln, &self.dfch, w(FCW), n, c, 4 * c)?;
            matmul::matmul_backward_weight(gpu, g(FCW), Some(g(FCB)), bp, &self.dfch, &a.ln2, n, c, 4 * c)?;
            layernorm::layernorm_backward_input(
                gpu,
                &self.dres,
                &self.dln,
                &a.res2,
                w(LN2W),
                &a.ln2_mean,
                &a.ln2_rstd,
                n,
                c,
            )?;
            layernorm::layernorm_backward_weight(
                gpu,
                g(LN2W),
                g(LN2B),
                &self.ln_partial,
                &self.dln,
                &a.res2,
                &a.ln2_mean,
                &a.ln2_rstd,
                n,
                c,
            )?;
            // dres is now ∂L/∂res2. Attention.
            matmul::matmul_backward_weight(gpu, g(PROJW), Some(g(PROJB)), bp, &self.dres, &a.atty, n, c, c)?;
            matmul::matmul_backward_input(gpu, &self.datty, &self.dres, w(PROJW), n, c, c)?;
            attention::attention_backward(
                gpu,
                &self.dqkv,
                &self.delta,
                &self.datty,
                &a.qkv,
                &a.atty,
                &a.lse,
                b,
                t,
                c,
                nh,
            )?;
            matmul::matmul_backward_input(gpu, &self.dln, &self.dqkv, w(QKVW), n, c, 3 * c)?;
            matmul::matmul_backward_weight(gpu, g(QKVW), Some(g(QKVB)), bp, &self.dqkv, &a.ln1, n, c, 3 * c)?;
            layernorm::layernorm_backward_input(
                gpu,
                &self.dres,
                &self.dln,
                x,
                w(LN1W),
                &a.ln1_mean,
                &a.ln1_rstd,
                n,
                c,
            )?;
            layernorm::layernorm_backward_weight(
                gpu,
                g(LN1W),
                g(LN1B),
                &self.ln_partial,
                &self.dln,
                x,
                &a.ln1_mean,
                &a.ln1_rstd,
                n,
                c,
            )?;
        }
        embedding::embedding_backward(gpu, self.g(0), self.g(1), &self.dres, &self.owners, b, t, c)
    }

    fn adamw(&mut self, lr: f64, hp: &Hyper, clip: f32) -> Result<()> {
        self.adam_t += 1;
        let h = hp.adamw(lr, self.adam_t);
        for s in &self.tensors {
            adamw::adamw_update(
                self.gpu,
                &self.master,
                &self.params,
                &self.grads,
                &self.m,
                &self.v,
                s.offset,
                s.stored,
                &h,
                s.decay,
                clip,
            )?;
        }
        Ok(())
    }

    /// Per tensor (CPU order and shapes, wte without its padding rows) values of a flat buffer.
    fn per_tensor(&self, flat: &[f32]) -> Vec<Vec<f32>> {
        self.tensors.iter().map(|s| flat[s.offset..s.offset + s.numel].to_vec()).collect()
    }

    /// The f32 master weights, per tensor.
    pub fn master_weights(&self) -> Result<Vec<Vec<f32>>> {
        Ok(self.per_tensor(&self.gpu.download(&self.master)?))
    }

    /// The gradients of the last step (before clipping), per tensor.
    pub fn gradients(&self) -> Result<Vec<Vec<f32>>> {
        Ok(self.per_tensor(&self.gpu.download(&self.grads)?))
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
