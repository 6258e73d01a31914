//! A part of the model that one pipeline stage owns, with its forward and
//! backward written out by hand.
//!
//! Shapes: B = micro_batch_size, T = block_size, C = n_embd, N = B·T, V = vocab.
//! Activations crossing a part boundary are (N, C) `Vec<f32>`s whose ownership
//! moves with the message, so nothing is copied between stages in one process.
//!
//! Forward returns what backward needs (`MicroActs`); the caller keeps it keyed
//! by microbatch and hands it back, so a part has no notion of schedules. The
//! last part runs the head's backward right inside forward (llm.c's fused
//! classifier): the (N, V) logits then never outlive one microbatch.
//! Buffers are recycled through pools, so after the first step of a schedule
//! this code allocates nothing: forward, backward (whole, or split into I and
//! W), the optimizer step and evaluation reuse their buffers (tested in
//! `train::engine`). The `gemm` crate still allocates its packing buffers on
//! every product, which no API lets us hand it; glibc serves those from its
//! heap without system calls.

use super::arch::{Norm, Positions};
use super::block::{
    block_backward_input, block_backward_weight, block_forward, BlockActs, BlockGrads, BlockScratch,
    Recompute,
};
use super::params::{self, Arch, Param};
use super::tp::{Members, Remote, TpRanks, TpShape};
use crate::kernels::cpu::{crossentropy, embedding, layernorm, matmul, rmsnorm};
use crate::kernels::profile::{timed, Kernel};
use std::ops::Range;

/// Which slice of the model a part holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartSpec {
    pub layers: Range<usize>,
    pub embedding: bool,
    pub head: bool,
}

impl PartSpec {
    pub fn whole(cfg: &Arch) -> Self {
        PartSpec { layers: 0..cfg.n_layer, embedding: true, head: true }
    }

    /// Index of local block `l`'s first tensor in `part_params` order.
    pub fn block_base(&self, cfg: &Arch, l: usize) -> usize {
        (if self.embedding { cfg.embedding_len() } else { 0 }) + cfg.block_len() * l
    }

    /// Index of the final norm's first tensor (the head's first tensor).
    pub fn head_base(&self, cfg: &Arch) -> usize {
        self.block_base(cfg, self.layers.len())
    }

    /// Index of the weight the head reads: the token embedding's own when
    /// the head is tied and the part holds both, else the tensor after the
    /// final norm (the tied copy of the embedding, or the untied `lm_head`).
    pub fn head_wte(&self, cfg: &Arch) -> usize {
        if self.embedding && cfg.tied() {
            0
        } else {
            self.head_base(cfg) + cfg.final_norm_len()
        }
    }

    /// The tensors whose gradients the head's forward writes: the final
    /// norm's and, untied, `lm_head` after them (empty without the head).
    pub fn head_leaf(&self, cfg: &Arch) -> std::ops::Range<usize> {
        if !self.head {
            return 0..0;
        }
        let hb = self.head_base(cfg);
        hb..hb + cfg.final_norm_len() + usize::from(!cfg.tied())
    }
}

/// The input of a part's forward: token ids (first part) or the previous part's activation.
pub enum PartInput<'a> {
    Tokens(&'a [u32]),
    Activation(Vec<f32>),
}

/// What forward does with the loss on the last part.
#[derive(Clone, Copy, Debug)]
pub enum Mode {
    /// Keep activations for backward; the loss gradient per token is `dloss`
    /// (1 / tokens in the optimizer step, so the step's loss is a mean).
    Train { dloss: f32 },
    /// Loss (and optionally argmax predictions) only; nothing kept.
    Eval,
}

/// A microbatch between its I and its W: its activations, its blocks' output
/// gradients and (first part) the gradient of the embedding's output.
struct PendingWeight {
    acts: MicroActs,
    grads: Vec<BlockGrads>,
    dembed: Option<Vec<f32>>,
}

/// Everything one microbatch's backward needs from its forward on this part.
pub struct MicroActs {
    /// Names this microbatch to tensor-parallel ranks in other processes.
    key: u64,
    tokens: Vec<u32>,
    /// inputs[l]: the residual stream entering local block l, (N, C).
    inputs: Vec<Vec<f32>>,
    /// Per-block intermediates (the selective set with selective
    /// recompute); empty with full recompute.
    blocks: Vec<BlockActs>,
    /// Last part: gradient of the head's input, computed during forward.
    dhead: Vec<f32>,
}

impl MicroActs {
    /// Bytes this microbatch holds until its backward.
    pub fn bytes(&self) -> usize {
        self.tokens.len() * 4
            + self.inputs.iter().map(|v| v.len() * 4).sum::<usize>()
            + self.blocks.iter().map(BlockActs::bytes).sum::<usize>()
            + self.dhead.len() * 4
    }
}

/// Result of a forward.
pub struct ForwardOut {
    /// Saved for backward (None in eval mode).
    pub acts: Option<MicroActs>,
    /// The activation to send to the next part (None on the last part).
    pub output: Option<Vec<f32>>,
    /// Σ of per-token losses over the microbatch (last part only), in f64.
    pub loss_sum: Option<f64>,
}

/// Workspace shared by all microbatches (only one runs at a time on a part).
struct Scratch {
    dln: Vec<f32>, // (N, C) the head's norm output gradient
    block: BlockScratch,
    // Head (last part only).
    lnf: Vec<f32>,
    lnf_mean: Vec<f32>,
    lnf_rstd: Vec<f32>,
    logits: Vec<f32>, // (N, V)
    losses: Vec<f32>, // (N)
}

pub struct ModelPart {
    pub cfg: Arch,
    pub spec: PartSpec,
    /// Sequences per microbatch.
    pub b: usize,
    pub recompute: Recompute,
    /// This part's tensors: the embedding's if first, the blocks', the final
    /// norm's if last, then the head's weight if it is not the embedding held
    /// here (a tied copy of wte, or the untied lm_head).
    pub params: Vec<Param>,
    /// The head's share of the tied wte gradient, kept apart until the step ends
    /// so both shares are summed in the same order whatever the layout (empty
    /// when the head is untied: its gradient is its own tensor's).
    pub wte_head_grad: Vec<f32>,
    scratch: Scratch,
    /// One block's intermediates, recomputed in backward under full recompute.
    recompute_acts: Option<BlockActs>,
    /// Microbatches whose I ran and whose W has not, by microbatch.
    pending_w: std::collections::BTreeMap<usize, PendingWeight>,
    grads_pool: Vec<Vec<BlockGrads>>,
    /// One block's output gradients for a full backward (B), whose weight half
    /// follows its input half at once.
    full_grads: BlockGrads,
    nc_pool: Vec<Vec<f32>>,
    acts_pool: Vec<MicroActs>,
    /// How the blocks are split over tensor-parallel ranks.
    pub tp: TpShape,
    /// The ranks, when there is more than one.
    split: Option<TpRanks>,
    /// The key the next microbatch's activations get.
    next_key: u64,
    /// Peak bytes of activations held by microbatches awaiting backward.
    pub live_bytes: usize,
    pub peak_live_bytes: usize,
}

/// The tensors a part holds, in its order, with their initial values: the
/// embedding's if first, each block's, the final norm's if last, then the
/// head's weight unless it is the embedding held here (a copy of wte if tied,
/// lm_head if not). Every backend builds its parts from these.
pub fn part_params(cfg: &Arch, spec: &PartSpec, seed: u64) -> Vec<Param> {
    let mut params = Vec::new();
    let mut add = |list: Vec<(String, Vec<usize>)>| {
        for (name, shape) in list {
            params.push(params::new_param(cfg, name, shape, seed));
        }
    };
    if spec.embedding {
        add(params::embedding_tensors(cfg));
    }
    for l in spec.layers.clone() {
        add(params::block_tensors(cfg, l));
    }
    if spec.head {
        add(params::final_norm_tensors(cfg));
        match cfg.tied() {
            true if !spec.embedding => add(vec![params::embedding_tensors(cfg).remove(0)]),
            true => {}
            false => add(params::head_tensors(cfg)),
        }
    }
    params
}

pub(super) fn pair(p: &mut [Param], i: usize, j: usize) -> (&mut Param, &mut Param) {
    assert!(i < j);
    let (a, b) = p.split_at_mut(j);
    (&mut a[i], &mut b[0])
}

impl ModelPart {
    /// `recompute`: a [`Recompute`], or a bool for full or none.
    pub fn new(cfg: Arch, spec: PartSpec, b: usize, seed: u64, recompute: impl Into<Recompute>) -> Self {
        let params = part_params(&cfg, &spec, seed);
        ModelPart::from_params(cfg, spec, b, recompute, params)
    }

    /// The part holding `params` (`part_params`' tensors, in its order, with
    /// any values: initial, loaded or resumed).
    pub fn from_params(
        cfg: Arch,
        spec: PartSpec,
        b: usize,
        recompute: impl Into<Recompute>,
        params: Vec<Param>,
    ) -> Self {
        let recompute = recompute.into();
        let (t, c, v) = (cfg.block_size, cfg.n_embd, cfg.vocab_size);
        let n = b * t;
        let head = spec.head;
        let scratch = Scratch {
            dln: vec![0.0; n * c],
            block: BlockScratch::new(b, &cfg, &TpShape::WHOLE.single(), recompute),
            lnf: if head { vec![0.0; n * c] } else { vec![] },
            lnf_mean: if head { vec![0.0; n] } else { vec![] },
            lnf_rstd: if head { vec![0.0; n] } else { vec![] },
            logits: if head { vec![0.0; n * v] } else { vec![] },
            losses: if head { vec![0.0; n] } else { vec![] },
        };
        ModelPart {
            cfg,
            spec,
            b,
            recompute,
            params,
            wte_head_grad: if head && cfg.tied() { vec![0.0; v * c] } else { vec![] },
            scratch,
            recompute_acts: (recompute == Recompute::Full)
                .then(|| BlockActs::new(b, &cfg, 1, false, Recompute::None)),
            pending_w: std::collections::BTreeMap::new(),
            grads_pool: Vec::new(),
            full_grads: BlockGrads::new(n, &cfg, 1, false),
            nc_pool: Vec::new(),
            acts_pool: Vec::new(),
            tp: TpShape::WHOLE,
            split: None,
            next_key: 0,
            live_bytes: 0,
            peak_live_bytes: 0,
        }
    }

    /// The same part with its blocks computed as `shape` says, the ranks
    /// sharing `threads` cores. Bits depend on `shape.slices` only: every
    /// `shape.size` dividing it gives the same.
    pub fn with_tp(self, shape: TpShape, threads: usize) -> Self {
        self.with_tp_over(shape, threads, None)
    }

    /// [`Self::with_tp`], the ranks after this process's first `remote.per`
    /// held by followers in other processes.
    pub fn with_tp_over(mut self, shape: TpShape, threads: usize, remote: Option<Remote>) -> Self {
        self.tp = shape;
        // Split, the ranks' own scratch remakes a selective set.
        let remade = if shape.size > 1 { Recompute::None } else { self.recompute };
        self.scratch.block = BlockScratch::new(self.b, &self.cfg, &shape.single(), remade);
        self.acts_pool.clear();
        self.grads_pool.clear();
        self.split = (shape.size > 1).then(|| {
            let members = Members::owner(shape, remote);
            TpRanks::new(&self.cfg, &self.spec, self.b, self.recompute, shape, &self.params, threads, members)
        });
        self
    }

    fn n(&self) -> usize {
        self.b * self.cfg.block_size
    }

    fn n_blocks(&self) -> usize {
        self.spec.layers.len()
    }

    /// An (N, C) buffer from the pool; its contents are arbitrary.
    pub fn take_nc(&mut self) -> Vec<f32> {
        let len = self.n() * self.cfg.n_embd;
        self.nc_pool.pop().filter(|v| v.len() == len).unwrap_or_else(|| vec![0.0; len])
    }

    /// Returns an (N, C) buffer (for example a received gradient, once used) to the pool.
    pub fn give_nc(&mut self, v: Vec<f32>) {
        if v.len() == self.n() * self.cfg.n_embd {
            self.nc_pool.push(v);
        }
    }

    /// Tensor-parallel ranks held in this process (1 when not split).
    fn held(&self) -> usize {
        self.split.as_ref().map_or(1, TpRanks::held_here)
    }

    fn take_acts(&mut self) -> MicroActs {
        let key = self.next_key;
        self.next_key += 1;
        if let Some(mut a) = self.acts_pool.pop() {
            a.key = key;
            return a;
        }
        let (b, t) = (self.b, self.cfg.block_size);
        let keep = if self.recompute.keeps_blocks() { self.n_blocks() } else { 0 };
        MicroActs {
            key,
            tokens: if self.spec.embedding { vec![0; b * t] } else { vec![] },
            inputs: Vec::with_capacity(self.n_blocks()),
            blocks: (0..keep * self.held())
                .map(|_| BlockActs::new(b, &self.cfg, self.tp.size, self.tp.sp, self.recompute))
                .collect(),
            dhead: vec![],
        }
    }

    /// Zero all gradient accumulators (the start of an optimizer step).
    pub fn zero_grads(&mut self) {
        for p in &mut self.params {
            p.grad.fill(0.0);
        }
        self.wte_head_grad.fill(0.0);
    }

    /// The head's logits (N, V) from the last evaluation forward (training
    /// overwrites them with their gradient).
    pub fn logits(&self) -> &[f32] {
        &self.scratch.logits
    }

    pub fn forward(&mut self, input: PartInput, targets: Option<&[u32]>, mode: Mode) -> ForwardOut {
        self.forward_with(input, targets, mode, None)
    }

    /// Forward; in eval mode on the last part, `argmax` (N) receives predictions.
    pub fn forward_with(
        &mut self,
        input: PartInput,
        targets: Option<&[u32]>,
        mode: Mode,
        argmax: Option<&mut [u32]>,
    ) -> ForwardOut {
        let (t, c) = (self.cfg.block_size, self.cfg.n_embd);
        let n = self.n();
        let mut acts = self.take_acts();
        // The residual stream entering the first block.
        let x0 = match input {
            PartInput::Tokens(tokens) => {
                assert!(self.spec.embedding, "tokens given to a part without the embedding");
                assert_eq!(tokens.len(), n);
                acts.tokens.copy_from_slice(tokens);
                let mut x = self.take_nc();
                let wte = &self.params[0].data;
                timed(Kernel::Embedding, || match self.cfg.positions {
                    Positions::Learned => {
                        embedding::embedding_forward(&mut x, tokens, wte, &self.params[1].data, t, c)
                    }
                    Positions::Rotary => embedding::token_embedding_forward(&mut x, tokens, wte, c),
                });
                x
            }
            PartInput::Activation(x) => {
                assert!(!self.spec.embedding, "activation given to the first part");
                assert_eq!(x.len(), n * c);
                x
            }
        };
        acts.inputs.push(x0);
        let nb = self.n_blocks();
        if let Some(sp) = &mut self.split {
            sp.refresh(&self.params, &self.spec);
        }
        for l in 0..nb {
            let mut out = self.take_nc();
            let x = &acts.inputs[l];
            if let Some(sp) = &mut self.split {
                let t = sp.held_here();
                let blocks = self.recompute.keeps_blocks().then(|| &mut acts.blocks[l * t..(l + 1) * t]);
                sp.forward(l, acts.key, blocks, false, x, &mut out, self.b, &self.cfg);
            } else {
                let (base, bl) = (self.spec.block_base(&self.cfg, l), self.cfg.block_len());
                let ba = match self.recompute {
                    Recompute::Full => self.recompute_acts.as_mut().unwrap(),
                    _ => &mut acts.blocks[l],
                };
                let tp = self.tp.single();
                block_forward(
                    &self.params[base..base + bl],
                    ba,
                    x,
                    &mut out,
                    &mut self.scratch.block,
                    self.b,
                    &self.cfg,
                    &tp,
                );
            }
            acts.inputs.push(out);
        }
        let x_out = acts.inputs.pop().unwrap();
        let mut result = ForwardOut { acts: None, output: None, loss_sum: None };
        if self.spec.head {
            let targets = targets.expect("the last part needs targets");
            assert_eq!(targets.len(), n);
            let (loss_sum, dhead) = self.head(&x_out, targets, mode, argmax);
            self.give_nc(x_out);
            result.loss_sum = Some(loss_sum);
            if let Some(d) = dhead {
                acts.dhead = d;
            }
        } else {
            result.output = Some(x_out);
        }
        match mode {
            Mode::Train { .. } => {
                self.live_bytes += acts.bytes();
                self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
                result.acts = Some(acts);
            }
            Mode::Eval => self.recycle(acts),
        }
        result
    }

    fn recycle(&mut self, mut acts: MicroActs) {
        if let Some(sp) = &mut self.split {
            sp.release(acts.key);
        }
        for v in acts.inputs.drain(..) {
            self.give_nc(v);
        }
        let d = std::mem::take(&mut acts.dhead);
        self.give_nc(d);
        self.acts_pool.push(acts);
    }

    /// Final norm, LM head and loss; in training also their backward.
    /// Returns (Σ loss, gradient of the head's input).
    fn head(
        &mut self,
        x: &[f32],
        targets: &[u32],
        mode: Mode,
        argmax: Option<&mut [u32]>,
    ) -> (f64, Option<Vec<f32>>) {
        let (c, v) = (self.cfg.n_embd, self.cfg.vocab_size);
        let n = self.n();
        let hb = self.spec.head_base(&self.cfg);
        let wte_i = self.spec.head_wte(&self.cfg);
        let (norm, eps) = (self.cfg.norm, self.cfg.norm_eps);
        let s = &mut self.scratch;
        match norm {
            Norm::LayerNorm => {
                let (w, b) = (&self.params[hb].data, &self.params[hb + 1].data);
                timed(Kernel::LayerNorm, || {
                    layernorm::layernorm_forward(&mut s.lnf, &mut s.lnf_mean, &mut s.lnf_rstd, x, w, b, n, c)
                });
            }
            Norm::RmsNorm => {
                let w = &self.params[hb].data;
                timed(Kernel::RmsNorm, || {
                    rmsnorm::rmsnorm_forward(&mut s.lnf, &mut s.lnf_rstd, x, w, n, c, eps)
                });
            }
        }
        let wte = &self.params[wte_i].data;
        // logits (N, V) = lnf (N, C) · wteᵀ
        timed(Kernel::Matmul, || {
            matmul::gemm_checked(
                &mut s.logits,
                false,
                &s.lnf,
                (c as isize, 1),
                wte,
                (1, c as isize),
                n,
                v,
                c,
                1.0,
            )
        });
        let dloss = match mode {
            Mode::Eval => {
                timed(Kernel::CrossEntropy, || {
                    crossentropy::crossentropy_forward(&s.logits, &mut s.losses, targets, argmax, n, v)
                });
                return (s.losses.iter().map(|&l| l as f64).sum(), None);
            }
            Mode::Train { dloss } => dloss,
        };
        timed(Kernel::CrossEntropy, || {
            crossentropy::crossentropy_forward_backward(&mut s.logits, &mut s.losses, targets, dloss, n, v)
        });
        let loss_sum = s.losses.iter().map(|&l| l as f64).sum();
        // dlnf (N, C) = dlogits (N, V) · wte (V, C); dwte_head (V, C) += dlogitsᵀ · lnf
        s.dln.fill(0.0);
        // Tied, the head's share is kept apart (see `wte_head_grad`); untied,
        // it is the lm_head's own gradient.
        let (head_w, head_grad) = match self.cfg.tied() {
            true => (&self.params[wte_i].data, &mut self.wte_head_grad),
            false => {
                let Param { data, grad, .. } = &mut self.params[wte_i];
                (&*data, grad)
            }
        };
        timed(Kernel::Matmul, || {
            matmul::gemm_checked(
                &mut s.dln,
                true,
                &s.logits,
                (v as isize, 1),
                head_w,
                (c as isize, 1),
                n,
                c,
                v,
                1.0,
            );
            matmul::gemm_checked(
                head_grad,
                true,
                &s.logits,
                (1, v as isize),
                &s.lnf,
                (c as isize, 1),
                v,
                c,
                n,
                1.0,
            );
        });
        let mut dx = self.nc_pool.pop().filter(|b| b.len() == n * c).unwrap_or_else(|| vec![0.0; n * c]);
        dx.fill(0.0);
        if norm == Norm::RmsNorm {
            let Param { data, grad, .. } = &mut self.params[hb];
            timed(Kernel::RmsNorm, || {
                rmsnorm::rmsnorm_backward(&mut dx, grad, &s.dln, x, data, &s.lnf_rstd, n, c)
            });
            return (loss_sum, Some(dx));
        }
        let (pw, pb) = pair(&mut self.params, hb, hb + 1);
        timed(Kernel::LayerNorm, || {
            layernorm::layernorm_backward(
                &mut dx,
                &mut pw.grad,
                &mut pb.grad,
                &s.dln,
                x,
                &pw.data,
                &s.lnf_mean,
                &s.lnf_rstd,
                n,
                c,
            )
        });
        (loss_sum, Some(dx))
    }

    /// ZeRO-3 frees the part's weights between actions: the tensor-parallel
    /// ranks' shards of them go too, cut again from the next gathered weights.
    pub fn release_weights(&mut self) {
        for p in &mut self.params {
            p.data = Vec::new();
        }
        if let Some(sp) = &mut self.split {
            sp.release_shards();
        }
    }

    /// Before a backward: the ranks' shards cut again if the weights were
    /// released (and gathered again) since the forward cut them.
    fn ensure_shards(&mut self) {
        if let Some(sp) = &mut self.split {
            if sp.released() {
                sp.refresh(&self.params, &self.spec);
            }
        }
    }

    /// Backward of one microbatch (B). `dout` is the gradient of this part's
    /// output (None on the last part, whose loss gradient was formed in forward).
    /// Returns the gradient of the part's input (None on the first part).
    pub fn backward(&mut self, mut acts: MicroActs, dout: Option<Vec<f32>>) -> Option<Vec<f32>> {
        self.live_bytes -= acts.bytes();
        self.ensure_shards();
        let mut dres = self.output_grad(&mut acts, dout);
        for l in (0..self.n_blocks()).rev() {
            let (base, bl) = (self.spec.block_base(&self.cfg, l), self.cfg.block_len());
            let full = self.recompute == Recompute::Full;
            if full {
                self.recompute_block(&acts, l);
            }
            let x = &acts.inputs[l];
            // Weight gradients are taken as their inputs appear: per tensor the
            // same kernel calls as an I followed later by a W, so B = I + W in bits.
            if let Some(sp) = &mut self.split {
                let t = sp.held_here();
                let blocks = (!full).then(|| &mut acts.blocks[l * t..(l + 1) * t]);
                sp.load_grads(l, &self.params[base..base + bl]);
                sp.backward_input(l, acts.key, blocks, None, x, &mut dres, self.b, &self.cfg, true);
                sp.store_grads(l, &mut self.params[base..base + bl]);
                continue;
            }
            let ba = if full { self.recompute_acts.as_mut().unwrap() } else { &mut acts.blocks[l] };
            block_backward_input(
                &mut self.params[base..base + bl],
                ba,
                x,
                &mut dres,
                &mut self.full_grads,
                &mut self.scratch.block,
                self.b,
                &self.cfg,
                &self.tp.single(),
                true,
            );
        }
        let result = self.finish_input(&acts, dres, true);
        self.recycle(acts);
        result
    }

    /// Microbatches whose I ran and whose W is still to come.
    pub fn pending_weight_count(&self) -> usize {
        self.pending_w.len()
    }

    /// The input half of the backward (zero-bubble schedules' I): returns the
    /// gradient of the part's input and keeps what W needs for microbatch `mb`.
    pub fn backward_input(
        &mut self,
        mut acts: MicroActs,
        dout: Option<Vec<f32>>,
        mb: usize,
    ) -> Option<Vec<f32>> {
        assert!(self.recompute.keeps_blocks(), "split backward with full recompute is refused by the config");
        self.ensure_shards();
        let mut dres = self.output_grad(&mut acts, dout);
        let mut grads = self.grads_pool.pop().unwrap_or_default();
        let n = self.n();
        let t = self.held();
        while grads.len() < self.n_blocks() * t {
            grads.push(BlockGrads::new(n, &self.cfg, self.tp.size, self.tp.sp));
        }
        for l in (0..self.n_blocks()).rev() {
            let (base, bl) = (self.spec.block_base(&self.cfg, l), self.cfg.block_len());
            if let Some(sp) = &mut self.split {
                let (blocks, g) = (&mut acts.blocks[l * t..(l + 1) * t], &mut grads[l * t..(l + 1) * t]);
                sp.backward_input(
                    l,
                    acts.key,
                    Some(blocks),
                    Some(g),
                    &acts.inputs[l],
                    &mut dres,
                    self.b,
                    &self.cfg,
                    false,
                );
                continue;
            }
            block_backward_input(
                &mut self.params[base..base + bl],
                &mut acts.blocks[l],
                &acts.inputs[l],
                &mut dres,
                &mut grads[l],
                &mut self.scratch.block,
                self.b,
                &self.cfg,
                &self.tp.single(),
                false,
            );
        }
        let extra: usize = grads.iter().map(BlockGrads::bytes).sum();
        self.live_bytes += extra;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
        let (result, dembed) = if self.spec.embedding { (None, Some(dres)) } else { (Some(dres), None) };
        self.pending_w.insert(mb, PendingWeight { acts, grads, dembed });
        result
    }

    /// The weight half (zero-bubble schedules' W) of microbatch `mb`, whose I ran.
    pub fn backward_weight(&mut self, mb: usize) {
        let PendingWeight { mut acts, grads, dembed } = self.pending_w.remove(&mb).expect("I ran before W");
        self.ensure_shards();
        self.live_bytes -= acts.bytes() + grads.iter().map(BlockGrads::bytes).sum::<usize>();
        for l in (0..self.n_blocks()).rev() {
            let (base, bl) = (self.spec.block_base(&self.cfg, l), self.cfg.block_len());
            if let Some(sp) = &mut self.split {
                let t = sp.held_here();
                let (blocks, g) = (&mut acts.blocks[l * t..(l + 1) * t], &grads[l * t..(l + 1) * t]);
                sp.load_grads(l, &self.params[base..base + bl]);
                sp.backward_weight(l, acts.key, blocks, g, &acts.inputs[l], self.b, &self.cfg);
                sp.store_grads(l, &mut self.params[base..base + bl]);
                continue;
            }
            block_backward_weight(
                &mut self.params[base..base + bl],
                &mut acts.blocks[l],
                &acts.inputs[l],
                &grads[l],
                &mut self.scratch.block,
                self.b,
                &self.cfg,
                &self.tp.single(),
            );
        }
        if let Some(d) = dembed {
            self.finish_input(&acts, d, true);
        }
        self.grads_pool.push(grads);
        self.recycle(acts);
    }

    /// The gradient of this part's output: the head's, formed in forward, or the one received.
    fn output_grad(&mut self, acts: &mut MicroActs, dout: Option<Vec<f32>>) -> Vec<f32> {
        if self.spec.head {
            assert!(dout.is_none());
            std::mem::take(&mut acts.dhead)
        } else {
            dout.expect("a part without the head needs its output gradient")
        }
    }

    fn recompute_block(&mut self, acts: &MicroActs, l: usize) {
        let (base, bl) = (self.spec.block_base(&self.cfg, l), self.cfg.block_len());
        let mut out =
            self.nc_pool.pop().unwrap_or_else(|| vec![0.0; self.b * self.cfg.block_size * self.cfg.n_embd]);
        if let Some(sp) = &mut self.split {
            sp.forward(l, acts.key, None, true, &acts.inputs[l], &mut out, self.b, &self.cfg);
        } else {
            let ba = self.recompute_acts.as_mut().unwrap();
            let tp = self.tp.single();
            block_forward(
                &self.params[base..base + bl],
                ba,
                &acts.inputs[l],
                &mut out,
                &mut self.scratch.block,
                self.b,
                &self.cfg,
                &tp,
            );
        }
        self.nc_pool.push(out);
    }

    /// On the first part the input gradient ends in the embedding's weight
    /// gradients; elsewhere it is returned for the previous stage.
    fn finish_input(&mut self, acts: &MicroActs, dres: Vec<f32>, _weights: bool) -> Option<Vec<f32>> {
        if self.spec.embedding {
            let (t, c) = (self.cfg.block_size, self.cfg.n_embd);
            if self.cfg.positions == Positions::Rotary {
                let wte = &mut self.params[0].grad;
                timed(Kernel::Embedding, || embedding::token_embedding_backward(wte, &dres, &acts.tokens, c));
                self.give_nc(dres);
                return None;
            }
            let (wte, wpe) = pair(&mut self.params, 0, 1);
            timed(Kernel::Embedding, || {
                embedding::embedding_backward(&mut wte.grad, &mut wpe.grad, &dres, &acts.tokens, t, c)
            });
            self.give_nc(dres);
            None
        } else {
            Some(dres)
        }
    }

    /// Sum the tied embedding's two gradient shares into `wte.grad` (first
    /// part) given the other share; in one part holding both, pass None. An
    /// untied head has nothing to combine.
    pub fn combine_tied_grads(&mut self, other_share: Option<&[f32]>) {
        if !self.cfg.tied() {
            return;
        }
        let share: &[f32] = match other_share {
            Some(s) => s,
            None => {
                assert!(self.spec.embedding && self.spec.head);
                let (wte, share) = (&mut self.params[0].grad, &self.wte_head_grad);
                // embedding share + head share, the order every layout uses.
                for (g, &h) in wte.iter_mut().zip(share) {
                    *g += h;
                }
                return;
            }
        };
        let i = self.spec.head_wte(&self.cfg);
        let own_is_embedding = self.spec.embedding;
        let g = &mut self.params[i].grad;
        if own_is_embedding {
            for (g, &h) in g.iter_mut().zip(share) {
                *g += h;
            }
        } else {
            // Head-only part: result must equal embedding share + head share.
            for ((g, &e), &h) in g.iter_mut().zip(share).zip(&self.wte_head_grad) {
                *g = e + h;
            }
        }
    }
}
