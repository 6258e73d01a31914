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
//! nothing is allocated.

use super::params::{self, GptConfig, Param};
use crate::kernels::cpu::{attention, crossentropy, embedding, gelu, layernorm, matmul, residual};
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
    pub fn whole(cfg: &GptConfig) -> Self {
        PartSpec { layers: 0..cfg.n_layer, embedding: true, head: true }
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

/// Intermediate values of one block for one microbatch.
#[derive(Default)]
struct BlockActs {
    ln1: Vec<f32>,      // (N, C)
    ln1_mean: Vec<f32>, // (N)
    ln1_rstd: Vec<f32>, // (N)
    qkv: Vec<f32>,      // (N, 3C)
    atty: Vec<f32>,     // (N, C) attention output before its projection
    lse: Vec<f32>,      // (B, NH, T)
    res2: Vec<f32>,     // (N, C) residual after attention
    ln2: Vec<f32>,      // (N, C)
    ln2_mean: Vec<f32>, // (N)
    ln2_rstd: Vec<f32>, // (N)
    fch: Vec<f32>,      // (N, 4C)
    fch_gelu: Vec<f32>, // (N, 4C)
}

impl BlockActs {
    fn new(b: usize, t: usize, c: usize, nh: usize) -> Self {
        let n = b * t;
        BlockActs {
            ln1: vec![0.0; n * c],
            ln1_mean: vec![0.0; n],
            ln1_rstd: vec![0.0; n],
            qkv: vec![0.0; n * 3 * c],
            atty: vec![0.0; n * c],
            lse: vec![0.0; b * nh * t],
            res2: vec![0.0; n * c],
            ln2: vec![0.0; n * c],
            ln2_mean: vec![0.0; n],
            ln2_rstd: vec![0.0; n],
            fch: vec![0.0; n * 4 * c],
            fch_gelu: vec![0.0; n * 4 * c],
        }
    }

    fn bytes(&self) -> usize {
        4 * (self.ln1.len()
            + self.ln1_mean.len()
            + self.ln1_rstd.len()
            + self.qkv.len()
            + self.atty.len()
            + self.lse.len()
            + self.res2.len()
            + self.ln2.len()
            + self.ln2_mean.len()
            + self.ln2_rstd.len()
            + self.fch.len()
            + self.fch_gelu.len())
    }
}

/// Everything one microbatch's backward needs from its forward on this part.
pub struct MicroActs {
    tokens: Vec<u32>,
    /// inputs[l]: the residual stream entering local block l, (N, C).
    inputs: Vec<Vec<f32>>,
    /// Per-block intermediates; empty when recomputing.
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
    dln: Vec<f32>,   // (N, C)
    datty: Vec<f32>, // (N, C)
    dqkv: Vec<f32>,  // (N, 3C)
    dfch: Vec<f32>,  // (N, 4C)
    dgelu: Vec<f32>, // (N, 4C)
    attn: Vec<f32>,
    // Head (last part only).
    lnf: Vec<f32>,
    lnf_mean: Vec<f32>,
    lnf_rstd: Vec<f32>,
    logits: Vec<f32>, // (N, V)
    losses: Vec<f32>, // (N)
}

// Indices of a block's tensors within its 12 (see params::block_tensors).
const LN1W: usize = 0;
const LN1B: usize = 1;
const QKVW: usize = 2;
const QKVB: usize = 3;
const PROJW: usize = 4;
const PROJB: usize = 5;
const LN2W: usize = 6;
const LN2B: usize = 7;
const FCW: usize = 8;
const FCB: usize = 9;
const FCPW: usize = 10;
const FCPB: usize = 11;

pub struct ModelPart {
    pub cfg: GptConfig,
    pub spec: PartSpec,
    /// Sequences per microbatch.
    pub b: usize,
    pub recompute: bool,
    /// This part's tensors: [wte, wpe] if first, 12 per block, [ln_f.w, ln_f.b] if
    /// last, then a copy of wte if last but not first (the tied head).
    pub params: Vec<Param>,
    /// The head's share of the tied wte gradient, kept apart until the step ends
    /// so both shares are summed in the same order whatever the layout.
    pub wte_head_grad: Vec<f32>,
    scratch: Scratch,
    /// One block's intermediates, recomputed in backward when `recompute` is on.
    recompute_acts: Option<BlockActs>,
    nc_pool: Vec<Vec<f32>>,
    acts_pool: Vec<MicroActs>,
    /// Peak bytes of activations held by microbatches awaiting backward.
    pub live_bytes: usize,
    pub peak_live_bytes: usize,
}

fn pair(p: &mut [Param], i: usize, j: usize) -> (&mut Param, &mut Param) {
    assert!(i < j);
    let (a, b) = p.split_at_mut(j);
    (&mut a[i], &mut b[0])
}

impl ModelPart {
    pub fn new(cfg: GptConfig, spec: PartSpec, b: usize, seed: u64, recompute: bool) -> Self {
        let mut params = Vec::new();
        let mut add = |list: Vec<(String, Vec<usize>)>| {
            for (name, shape) in list {
                params.push(params::new_param(&cfg, name, shape, seed));
            }
        };
        if spec.embedding {
            add(params::embedding_tensors(&cfg));
        }
        for l in spec.layers.clone() {
            add(params::block_tensors(&cfg, l));
        }
        if spec.head {
            add(params::final_norm_tensors(&cfg));
            if !spec.embedding {
                add(vec![params::embedding_tensors(&cfg).remove(0)]);
            }
        }
        let (t, c, v) = (cfg.block_size, cfg.n_embd, cfg.vocab_size);
        let n = b * t;
        let head = spec.head;
        let scratch = Scratch {
            dln: vec![0.0; n * c],
            datty: vec![0.0; n * c],
            dqkv: vec![0.0; n * 3 * c],
            dfch: vec![0.0; n * 4 * c],
            dgelu: vec![0.0; n * 4 * c],
            attn: vec![0.0; attention::scratch_len(b, cfg.n_head, t)],
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
            wte_head_grad: if head { vec![0.0; v * c] } else { vec![] },
            scratch,
            recompute_acts: recompute.then(|| BlockActs::new(b, t, c, cfg.n_head)),
            nc_pool: Vec::new(),
            acts_pool: Vec::new(),
            live_bytes: 0,
            peak_live_bytes: 0,
        }
    }

    fn n(&self) -> usize {
        self.b * self.cfg.block_size
    }

    fn n_blocks(&self) -> usize {
        self.spec.layers.len()
    }

    fn block_base(&self, l: usize) -> usize {
        (if self.spec.embedding { 2 } else { 0 }) + 12 * l
    }

    fn head_base(&self) -> usize {
        self.block_base(self.n_blocks())
    }

    /// Index of the wte tensor the head reads (the embedding's own when this part has both).
    fn head_wte(&self) -> usize {
        if self.spec.embedding {
            0
        } else {
            self.head_base() + 2
        }
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

    fn take_acts(&mut self) -> MicroActs {
        if let Some(a) = self.acts_pool.pop() {
            return a;
        }
        let (b, t, c, nh) = (self.b, self.cfg.block_size, self.cfg.n_embd, self.cfg.n_head);
        let keep = if self.recompute { 0 } else { self.n_blocks() };
        MicroActs {
            tokens: if self.spec.embedding { vec![0; b * t] } else { vec![] },
            inputs: Vec::with_capacity(self.n_blocks()),
            blocks: (0..keep).map(|_| BlockActs::new(b, t, c, nh)).collect(),
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
                let (wte, wpe) = (&self.params[0].data, &self.params[1].data);
                timed(Kernel::Embedding, || embedding::embedding_forward(&mut x, tokens, wte, wpe, t, c));
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
        for l in 0..nb {
            let mut out = self.take_nc();
            let base = self.block_base(l);
            let ba = if self.recompute { self.recompute_acts.as_mut().unwrap() } else { &mut acts.blocks[l] };
            block_forward(
                &self.params[base..base + 12],
                ba,
                &acts.inputs[l],
                &mut out,
                &mut self.scratch.attn,
                self.b,
                &self.cfg,
            );
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
        for v in acts.inputs.drain(..) {
            self.give_nc(v);
        }
        let d = std::mem::take(&mut acts.dhead);
        self.give_nc(d);
        self.acts_pool.push(acts);
    }

    /// Final LayerNorm, tied LM head and loss; in training also their backward.
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
        let hb = self.head_base();
        let wte_i = self.head_wte();
        let s = &mut self.scratch;
        {
            let (w, b) = (&self.params[hb].data, &self.params[hb + 1].data);
            timed(Kernel::LayerNorm, || {
                layernorm::layernorm_forward(&mut s.lnf, &mut s.lnf_mean, &mut s.lnf_rstd, x, w, b, n, c)
            });
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
        timed(Kernel::Matmul, || {
            matmul::gemm_checked(
                &mut s.dln,
                true,
                &s.logits,
                (v as isize, 1),
                wte,
                (c as isize, 1),
                n,
                c,
                v,
                1.0,
            );
            matmul::gemm_checked(
                &mut self.wte_head_grad,
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

    /// Backward of one microbatch. `dout` is the gradient of this part's output
    /// (None on the last part, whose loss gradient was formed in forward).
    /// Returns the gradient of the part's input (None on the first part).
    pub fn backward(&mut self, mut acts: MicroActs, dout: Option<Vec<f32>>) -> Option<Vec<f32>> {
        self.live_bytes -= acts.bytes();
        let (t, c) = (self.cfg.block_size, self.cfg.n_embd);
        // The gradient of the residual stream, carried down through the blocks in place.
        let mut dres = if self.spec.head {
            assert!(dout.is_none());
            std::mem::take(&mut acts.dhead)
        } else {
            dout.expect("a part without the head needs its output gradient")
        };
        for l in (0..self.n_blocks()).rev() {
            let base = self.block_base(l);
            if self.recompute {
                let ba = self.recompute_acts.as_mut().unwrap();
                let mut out = self.nc_pool.pop().unwrap_or_else(|| vec![0.0; self.b * t * c]);
                block_forward(
                    &self.params[base..base + 12],
                    ba,
                    &acts.inputs[l],
                    &mut out,
                    &mut self.scratch.attn,
                    self.b,
                    &self.cfg,
                );
                self.nc_pool.push(out);
            }
            let ba = if self.recompute { self.recompute_acts.as_ref().unwrap() } else { &acts.blocks[l] };
            block_backward(
                &mut self.params[base..base + 12],
                ba,
                &acts.inputs[l],
                &mut dres,
                &mut self.scratch,
                self.b,
                &self.cfg,
            );
        }
        let result = if self.spec.embedding {
            let (wte, wpe) = pair(&mut self.params, 0, 1);
            timed(Kernel::Embedding, || {
                embedding::embedding_backward(&mut wte.grad, &mut wpe.grad, &dres, &acts.tokens, t, c)
            });
            self.give_nc(dres);
            None
        } else {
            Some(dres)
        };
        self.recycle(acts);
        result
    }

    /// Sum the tied embedding's two gradient shares into `wte.grad` (first
    /// part) given the other share; in one part holding both, pass None.
    pub fn combine_tied_grads(&mut self, other_share: Option<&[f32]>) {
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
        let i = self.head_wte();
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

/// One transformer block: x → x + attn(ln1(x)) → res2 + mlp(ln2(res2)).
fn block_forward(
    p: &[Param],
    a: &mut BlockActs,
    x: &[f32],
    out: &mut [f32],
    attn_scratch: &mut [f32],
    b: usize,
    cfg: &GptConfig,
) {
    let (t, c, nh) = (cfg.block_size, cfg.n_embd, cfg.n_head);
    let n = b * t;
    timed(Kernel::LayerNorm, || {
        layernorm::layernorm_forward(
            &mut a.ln1,
            &mut a.ln1_mean,
            &mut a.ln1_rstd,
            x,
            &p[LN1W].data,
            &p[LN1B].data,
            n,
            c,
        )
    });
    timed(Kernel::Matmul, || {
        matmul::matmul_forward(&mut a.qkv, &a.ln1, &p[QKVW].data, Some(&p[QKVB].data), n, c, 3 * c)
    });
    timed(Kernel::Attention, || {
        attention::attention_forward(&mut a.atty, &mut a.lse, attn_scratch, &a.qkv, b, t, c, nh)
    });
    // res2 = x + atty · Wproj + bproj
    timed(Kernel::Matmul, || {
        matmul::matmul_forward(&mut a.res2, &a.atty, &p[PROJW].data, Some(&p[PROJB].data), n, c, c)
    });
    timed(Kernel::Residual, || residual::accumulate(&mut a.res2, x));
    timed(Kernel::LayerNorm, || {
        layernorm::layernorm_forward(
            &mut a.ln2,
            &mut a.ln2_mean,
            &mut a.ln2_rstd,
            &a.res2,
            &p[LN2W].data,
            &p[LN2B].data,
            n,
            c,
        )
    });
    timed(Kernel::Matmul, || {
        matmul::matmul_forward(&mut a.fch, &a.ln2, &p[FCW].data, Some(&p[FCB].data), n, c, 4 * c)
    });
    timed(Kernel::Gelu, || gelu::gelu_forward(&mut a.fch_gelu, &a.fch));
    timed(Kernel::Matmul, || {
        matmul::matmul_forward(out, &a.fch_gelu, &p[FCPW].data, Some(&p[FCPB].data), n, 4 * c, c)
    });
    timed(Kernel::Residual, || residual::accumulate(out, &a.res2));
}

/// Backward of one block. `dres` holds the gradient of the block's output on
/// entry and of its input on return.
fn block_backward(
    p: &mut [Param],
    a: &BlockActs,
    x: &[f32],
    dres: &mut [f32],
    s: &mut Scratch,
    b: usize,
    cfg: &GptConfig,
) {
    let (t, c, nh) = (cfg.block_size, cfg.n_embd, cfg.n_head);
    let n = b * t;
    // MLP: out = res2 + gelu(ln2(res2)·Wfc)·Wfcproj
    s.dgelu.fill(0.0);
    {
        let (w, bias) = pair(p, FCPW, FCPB);
        timed(Kernel::Matmul, || {
            matmul::matmul_backward(
                Some(&mut s.dgelu),
                &mut w.grad,
                Some(&mut bias.grad),
                dres,
                &a.fch_gelu,
                &w.data,
                n,
                4 * c,
                c,
            )
        });
    }
    s.dfch.fill(0.0);
    timed(Kernel::Gelu, || gelu::gelu_backward(&mut s.dfch, &a.fch, &s.dgelu));
    s.dln.fill(0.0);
    {
        let (w, bias) = pair(p, FCW, FCB);
        timed(Kernel::Matmul, || {
            matmul::matmul_backward(
                Some(&mut s.dln),
                &mut w.grad,
                Some(&mut bias.grad),
                &s.dfch,
                &a.ln2,
                &w.data,
                n,
                c,
                4 * c,
            )
        });
    }
    {
        let (w, bias) = pair(p, LN2W, LN2B);
        timed(Kernel::LayerNorm, || {
            layernorm::layernorm_backward(
                dres,
                &mut w.grad,
                &mut bias.grad,
                &s.dln,
                &a.res2,
                &w.data,
                &a.ln2_mean,
                &a.ln2_rstd,
                n,
                c,
            )
        });
    }
    // dres is now ∂L/∂res2. Attention: res2 = x + attn(ln1(x))·Wproj.
    s.datty.fill(0.0);
    {
        let (w, bias) = pair(p, PROJW, PROJB);
        timed(Kernel::Matmul, || {
            matmul::matmul_backward(
                Some(&mut s.datty),
                &mut w.grad,
                Some(&mut bias.grad),
                dres,
                &a.atty,
                &w.data,
                n,
                c,
                c,
            )
        });
    }
    s.dqkv.fill(0.0);
    timed(Kernel::Attention, || {
        attention::attention_backward(
            &mut s.dqkv,
            &mut s.attn,
            &s.datty,
            &a.qkv,
            &a.atty,
            &a.lse,
            b,
            t,
            c,
            nh,
        )
    });
    s.dln.fill(0.0);
    {
        let (w, bias) = pair(p, QKVW, QKVB);
        timed(Kernel::Matmul, || {
            matmul::matmul_backward(
                Some(&mut s.dln),
                &mut w.grad,
                Some(&mut bias.grad),
                &s.dqkv,
                &a.ln1,
                &w.data,
                n,
                c,
                3 * c,
            )
        });
    }
    {
        let (w, bias) = pair(p, LN1W, LN1B);
        timed(Kernel::LayerNorm, || {
            layernorm::layernorm_backward(
                dres,
                &mut w.grad,
                &mut bias.grad,
                &s.dln,
                x,
                &w.data,
                &a.ln1_mean,
                &a.ln1_rstd,
                n,
                c,
            )
        });
    }
}
