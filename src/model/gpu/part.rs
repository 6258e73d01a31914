//! One pipeline stage's part of the model on a GPU: the twin of
//! model/part.rs (`ModelPart`), with the same tensors in the same order, the
//! same forward and backward in the same kernel order, and the same rules —
//! backward accumulates weight gradients, the head runs its backward inside
//! forward (llm.c's fused classifier), the head's share of a tied embedding's
//! gradient is kept apart until the step ends. The one block is in
//! block.rs (its tensor-parallel split in tp/block.rs); the embedding and
//! head follow the settings (a position table when positions are learned,
//! the model's norm before the head and, untied, its own `lm_head` whose
//! gradient is an ordinary tensor's). Nothing here asks for a family.
//!
//! Shapes: B = micro_batch_size, T = block_size, C = n_embd, N = B·T,
//! V = vocab_size, Vp = V rounded up to 128 (the token embedding and an
//! untied head are stored with Vp rows, the padding zero with zero gradient,
//! so the head's products are aligned).
//!
//! Storage type X is bf16 (training) or f32 (the twin checks); master weights,
//! gradients and AdamW moments are f32. Every device buffer is allocated in
//! `new`: activations live in `slots`, one per microbatch a schedule keeps
//! alive on this stage (the schedule simulator's peak), so a step allocates
//! nothing and a layout that does not fit fails before the first step.
//!
//! A part never holds its `Gpu`: the stage thread that owns the GPU passes it
//! to every call, so one GPU serves several parts (interleaved chunks, or
//! several stages on one device) and no part outlives its context.

mod block;
mod tp;
use block::{Acts, BlockActs, Remade};
pub use tp::{GpuTp, TpDevices, TpPart};

use crate::kernels::cuda::embedding::DeviceTokens;
use crate::kernels::cuda::rope::DeviceRope;
use crate::kernels::cuda::{adamw, attention, crossentropy, ema, embedding, matmul};
use crate::kernels::cuda::{ensure, CudaError, DeviceBuffer, Elem, Gpu, Result};
use crate::model::arch::Positions;
use crate::model::block::Share;
use crate::model::part::{Mode, PartSpec};
use crate::model::recompute::Recompute;
use crate::model::{Arch, Param};
use crate::optim::Hyper;
use std::collections::BTreeMap;

/// Tensor offsets are multiples of this many elements: 256 bytes in bf16 (512
/// in the f32 master weights and gradients), the alignment cuBLASLt's default
/// heuristic assumes for A, B, C, D and the bias. 64 elements (128 bytes)
/// left every tensor after one of 64 × odd elements (n_embd = 192, 320, …)
/// misaligned for it; `matmul` also tells the heuristic each pointer's real
/// alignment, so no pointer can be handed to a kernel that assumes more.
pub const ALIGN: usize = 128;

/// Where each tensor of a part starts in the flat parameter buffer, and the
/// buffer's length: offsets in `params` order, each a multiple of `ALIGN`;
/// the tensors with a row per token (`Arch::vocab_rows`) take `vp` rows.
pub fn tensor_layout(cfg: &Arch, params: &[Param], vp: usize) -> (Vec<TensorSlot>, usize) {
    let mut tensors = Vec::with_capacity(params.len());
    let mut offset = 0;
    for p in params {
        let stored = if cfg.vocab_rows(p.canonical) { vp * cfg.n_embd } else { p.numel() };
        tensors.push(TensorSlot {
            name: p.name.clone(),
            shape: p.shape.clone(),
            canonical: p.canonical,
            offset,
            numel: p.numel(),
            stored,
            decay: p.decays(),
        });
        offset = (offset + stored).div_ceil(ALIGN) * ALIGN;
    }
    (tensors, offset.max(1))
}

/// Whether a part reports this tensor's gradient in the norm: all but the
/// head's copy of the tied embedding where another part owns the embedding
/// (as `optim::grad_sum_squares`).
fn reports_norm(t: &TensorSlot, embedding: bool) -> bool {
    t.canonical != 0 || embedding
}

/// The (offset, elements) of each tensor the gradient norm covers: the
/// tensor's own elements, not a vocabulary tensor's padded rows.
fn norm_ranges(tensors: &[TensorSlot], embedding: bool) -> Vec<(usize, usize)> {
    tensors.iter().filter(|t| reports_norm(t, embedding)).map(|t| (t.offset, t.numel)).collect()
}

/// The vocabulary rounded up to a multiple of 128 (50257 → 50304, as llm.c).
pub fn padded_vocab(v: usize) -> usize {
    v.div_ceil(128) * 128
}

/// The gradients the head's forward writes, in a part's flat buffer as one
/// (offset, length) run: the final norm's tensors and, untied, the head's
/// own weight after them, with only alignment padding between them; None
/// without the head.
pub fn head_norm_run(tensors: &[TensorSlot], spec: &PartSpec, cfg: &Arch) -> Option<(usize, usize)> {
    let run = spec.head_leaf(cfg);
    let (first, last) = (tensors.get(run.start)?, tensors.get(run.end.checked_sub(1)?)?);
    Some((first.offset, last.offset + last.stored - first.offset))
}

/// Values of each tensor of a part, in the part's order.
pub type PerTensor = Vec<Vec<f32>>;

/// Where one tensor lives in the flat buffers.
#[derive(Clone, Debug)]
pub struct TensorSlot {
    pub name: String,
    pub shape: Vec<usize>,
    /// Position in `params::all_tensors` order (the order global sums run in).
    pub canonical: usize,
    pub offset: usize,
    /// Elements of the CPU tensor.
    pub numel: usize,
    /// Elements on the device (a vocabulary tensor's padded rows included).
    pub stored: usize,
    pub decay: bool,
}

/// Everything one microbatch keeps on this part between its forward and its backward.
struct Slot<X: Elem> {
    /// stream[l]: the residual stream entering local block l; stream[nb]: the
    /// part's output (the head's input on the last part).
    stream: Vec<DeviceBuffer<X>>,
    /// Per-block intermediates (the selective set with selective
    /// recompute); empty with full recompute.
    blocks: Vec<BlockActs<X>>,
    /// First part: the token ids and who owns each id's wte gradient row.
    tokens: Option<DeviceTokens>,
    /// Last part: the gradient of the head's input, formed in forward.
    dhead: Option<DeviceBuffer<X>>,
}

impl<X: Elem> Slot<X> {
    fn bytes(&self) -> usize {
        self.stream.iter().map(DeviceBuffer::bytes).sum::<usize>()
            + self.blocks.iter().map(BlockActs::bytes).sum::<usize>()
            + self.tokens.as_ref().map_or(0, DeviceTokens::bytes)
            + self.dhead.as_ref().map_or(0, DeviceBuffer::bytes)
    }
}

/// Workspace shared by every microbatch (one runs at a time on a part).
struct Scratch<X: Elem> {
    dres: DeviceBuffer<X>,
    dln: DeviceBuffer<X>,
    datty: DeviceBuffer<X>,
    dqkv: DeviceBuffer<X>,
    /// q/k norm only (else empty): the gradient of q's and k's products,
    /// before their norms (N, W) (v's columns unused).
    dqkv_raw: DeviceBuffer<X>,
    /// q/k norm only: the row-chunk partials of the norms' gain gradients.
    head_partial: DeviceBuffer<f32>,
    /// q/k norm on a split part: this rank's per-slice partials of q's gain
    /// gradient, then of k's, (2, L, HS) f32.
    head_leaves: DeviceBuffer<f32>,
    /// q/k norm on a split part: every rank's subtree sums of both, (size,
    /// 2·HS) f32, q's then k's: this rank's at its index, the others' after
    /// the group's all-gather.
    head_gathered: DeviceBuffer<f32>,
    /// The gradient of the MLP's first products: gate's and up's (N, 2F), or up's (N, F).
    dhidden: DeviceBuffer<X>,
    /// The gradient of the activation, down's input (N, F).
    dact: DeviceBuffer<X>,
    delta: DeviceBuffer<f32>,
    ln_partial: DeviceBuffer<f32>,
    bias_partial: DeviceBuffer<f32>,
    /// The tensors whose gradients' sums of squares this part reports
    /// (`grad_sum_squares`), with the norm's scratch.
    norms: adamw::NormRanges,
    /// Every tensor's elements as the one AdamW launch updates them.
    adamw_runs: adamw::AdamwRuns,
    /// Full recompute: one block's intermediates and its (discarded) output.
    recompute: Option<(BlockActs<X>, DeviceBuffer<X>)>,
    /// Selective recompute: the n1, n2 and act every block writes in
    /// forward and makes again in backward.
    remade: Option<Remade<X>>,
    /// The rotary table (T, HS/2) of a model with rotary positions.
    rope: Option<DeviceRope>,
    /// Sliced products (tp.rs): this rank's slices of one split sum, (L, N, C) f32.
    leaves: DeviceBuffer<f32>,
    /// Every rank's subtree sum of one split sum, (size, N, C) f32: this
    /// rank's at its index, the others' after the group's all-gather.
    gathered: DeviceBuffer<f32>,
    // Head (last part only; empty elsewhere).
    lnf: DeviceBuffer<X>,
    lnf_mean: DeviceBuffer<f32>,
    lnf_rstd: DeviceBuffer<f32>,
    /// (N, Vp): logits in forward, their gradient after the fused loss.
    logits: DeviceBuffer<X>,
    losses: DeviceBuffer<f32>,
    targets: DeviceBuffer<u32>,
    argmax: DeviceBuffer<u32>,
    /// The other part's share of the tied embedding's gradient, uploaded (Vp, C).
    tied: DeviceBuffer<f32>,
    // Host staging, so a message costs a copy and no allocation but its own.
    host_x: Vec<X>,
    host_losses: Vec<f32>,
}

impl<X: Elem> Scratch<X> {
    /// Σ of the per-token losses the head's cross-entropy left in `losses`, in f64.
    fn loss_sum(&mut self, gpu: &Gpu) -> Result<f64> {
        gpu.download_into(&self.losses, &mut self.host_losses)?;
        Ok(self.host_losses.iter().map(|&l| l as f64).sum())
    }
}

pub struct GpuPart<X: Elem> {
    pub cfg: Arch,
    pub spec: PartSpec,
    /// Sequences per microbatch.
    pub b: usize,
    pub vp: usize,
    pub recompute: Recompute,
    /// Which tensor-parallel rank this part computes (tp.rs); rank 0 of 1
    /// with one slice is the plain block.
    pub tp: GpuTp,
    pub tensors: Vec<TensorSlot>,
    /// Rank 0 only (a follower keeps the storage copy it computes with):
    /// the f32 master weights and AdamW's moments.
    master: DeviceBuffer<f32>,
    params: DeviceBuffer<X>,
    grads: DeviceBuffer<f32>,
    m: DeviceBuffer<f32>,
    v: DeviceBuffer<f32>,
    /// AdamW updates applied so far.
    pub adam_t: u64,
    /// The EMA of the master weights (`optim.ema_decay`), laid out as
    /// `master`; empty when none is kept (and on followers).
    ema: DeviceBuffer<f32>,
    /// The head's share of the tied embedding's gradient (Vp, C), f32;
    /// empty untied (the head's gradient is then its own tensor's).
    head_grad: DeviceBuffer<f32>,
    slots: Vec<Slot<X>>,
    free: Vec<usize>,
    /// Slots of microbatches between forward and backward, by microbatch.
    saved: BTreeMap<usize, usize>,
    s: Scratch<X>,
    slot_bytes: usize,
    /// Bytes of activations held by microbatches awaiting backward.
    pub live_bytes: usize,
    pub peak_live_bytes: usize,
}

/// Runs a part's blocks for the microbatch in slot k (the part, its GPU, k).
pub(super) type Blocks<'a, X> = &'a mut dyn FnMut(&mut GpuPart<X>, &Gpu, usize) -> Result<()>;

/// Writes a tensor straight into a device buffer (a parcel from another
/// stage in this process, or an NCCL receive).
pub type Fill<'a, X> = &'a mut dyn FnMut(&Gpu, &DeviceBuffer<X>) -> Result<()>;

/// Takes a tensor from a device buffer, to send it on without host memory;
/// false when it cannot now (the part then hands it over in host memory).
pub type Sink<'a, X> = &'a mut dyn FnMut(&Gpu, &DeviceBuffer<X>) -> Result<bool>;

/// The input of a part's forward.
pub enum GpuInput<'a, X: Elem> {
    Tokens(&'a [u32]),
    Activation(&'a [f32]),
    Device(Fill<'a, X>),
}

/// The gradient of a part's output, for its backward.
pub enum GpuGrad<'a, X: Elem> {
    /// The last part: its loss gradient was formed in forward.
    FromLoss,
    Host(&'a [f32]),
    Device(Fill<'a, X>),
}

/// What a forward hands back.
pub struct GpuForward {
    /// The activation for the next part (None on the last part).
    pub output: Option<Vec<f32>>,
    /// Σ of per-token losses (last part only), in f64.
    pub loss_sum: Option<f64>,
}

impl<X: Elem> GpuPart<X> {
    /// The part holding `params` (a `ModelPart`'s tensors, in its order, with
    /// their initial values), for microbatches of `b` sequences, keeping at
    /// most `live` microbatches between forward and backward.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        cfg: Arch,
        spec: PartSpec,
        b: usize,
        recompute: Recompute,
        live: usize,
        params: &[Param],
    ) -> Result<Self> {
        Self::new_rank(gpu, cfg, spec, b, recompute, live, params, GpuTp::ONE)
    }

    /// The part as tensor-parallel rank `tp.rank` of `tp.size`: rank 0 holds
    /// the optimizer and runs the embedding and head; a follower holds the
    /// weights' storage copy, its gradients and its share of the blocks'
    /// activations.
    #[allow(clippy::too_many_arguments)]
    pub fn new_rank(
        gpu: &Gpu,
        cfg: Arch,
        spec: PartSpec,
        b: usize,
        recompute: Recompute,
        live: usize,
        params: &[Param],
        tp: GpuTp,
    ) -> Result<Self> {
        let (t, c, v) = (cfg.block_size, cfg.n_embd, cfg.vocab_size);
        tp.check(&cfg)?;
        let (size, owner) = (tp.size, tp.rank == 0);
        let heads = cfg.heads();
        // The rank's share of the block, as its kernel calls see it.
        let share = Share::of(&cfg, size);
        attention::kernels_for_heads::<X>(share.heads)?;
        ensure(b > 0 && t > 0 && v > 0 && live > 0, || {
            format!("a GPU part needs B, T, V and live slots > 0 (B={b}, T={t}, V={v}, live={live})")
        })?;
        let n = b * t;
        let vp = padded_vocab(v);
        // The widest row any block buffer has: the MLP's first products, q/k/v, the stream.
        let hidden = Share::of(&cfg, 1).hidden(&cfg);
        let widest = [hidden, heads.qkv_width(), c].into_iter().max().unwrap_or(c).max(1);
        ensure(n <= i32::MAX as usize / widest && n.saturating_mul(vp) < (1 << 40), || {
            format!("the CUDA kernels index with 32-bit rows: B·T = {n} is too many")
        })?;
        let (tensors, total) = tensor_layout(&cfg, params, vp);
        let nb = spec.layers.len();
        let head = spec.head;
        let new_slot = || -> Result<Slot<X>> {
            Ok(Slot {
                stream: (0..=nb).map(|_| gpu.alloc(n * c)).collect::<Result<_>>()?,
                blocks: if recompute.keeps_blocks() {
                    let whole = recompute == Recompute::None;
                    (0..nb).map(|_| BlockActs::new(gpu, &cfg, b, size, whole)).collect::<Result<_>>()?
                } else {
                    vec![]
                },
                tokens: if spec.embedding && owner { Some(DeviceTokens::new(gpu, n)?) } else { None },
                dhead: if head && owner { Some(gpu.alloc(n * c)?) } else { None },
            })
        };
        let slots = (0..live).map(|_| new_slot()).collect::<Result<Vec<_>>>()?;
        let slot_bytes = slots[0].bytes();
        let hn = if head && owner { n } else { 0 };
        let split = tp.is_split();
        // A bias gradient's column sums: the widest biased product's output (whole, not the rank's share).
        let bias_cols = [c, heads.out_width(), cfg.ffn].into_iter().max().unwrap_or(c);
        let s = Scratch {
            dres: gpu.alloc(n * c)?,
            dln: gpu.alloc(n * c)?,
            datty: gpu.alloc(n * share.heads.out_width())?,
            dqkv: gpu.alloc(n * share.heads.qkv_width())?,
            dqkv_raw: gpu.alloc(usize::from(cfg.qk_norm) * n * share.heads.qkv_width())?,
            head_partial: gpu.alloc(block::qk_partial_len(&cfg, &share, n, tp.leaves()))?,
            head_leaves: gpu.alloc(if split && cfg.qk_norm { 2 * tp.leaves() * heads.hs } else { 0 })?,
            head_gathered: gpu.alloc(if split && cfg.qk_norm { size * 2 * heads.hs } else { 0 })?,
            dhidden: gpu.alloc(n * share.hidden(&cfg))?,
            dact: gpu.alloc(n * share.f)?,
            delta: gpu.alloc(b * share.heads.nh * t)?,
            ln_partial: gpu.alloc(block::norm_partial_len(&cfg, n, c))?,
            bias_partial: gpu.alloc(matmul::bias_partial_len(n, bias_cols))?,
            norms: adamw::NormRanges::new(gpu, &norm_ranges(&tensors, spec.embedding))?,
            adamw_runs: adamw::AdamwRuns::new(
                gpu,
                &tensors.iter().map(|t| (t.offset, t.stored, t.decay)).collect::<Vec<_>>(),
            )?,
            recompute: if recompute == Recompute::Full {
                Some((BlockActs::new(gpu, &cfg, b, size, true)?, gpu.alloc(n * c)?))
            } else {
                None
            },
            remade: if recompute == Recompute::Selective {
                Some(Remade::new(gpu, &cfg, b, size)?)
            } else {
                None
            },
            rope: match cfg.positions {
                Positions::Rotary => Some(DeviceRope::upload(gpu, &crate::model::rope::rope_table(&cfg))?),
                Positions::Learned => None,
            },
            leaves: gpu.alloc(if split { tp.leaves() * n * c } else { 0 })?,
            gathered: gpu.alloc(if split { size * n * c } else { 0 })?,
            lnf: gpu.alloc(hn * c)?,
            lnf_mean: gpu.alloc(hn)?,
            lnf_rstd: gpu.alloc(hn)?,
            logits: gpu.alloc(hn * vp)?,
            losses: gpu.alloc(hn)?,
            targets: gpu.alloc(hn)?,
            argmax: gpu.alloc(hn)?,
            tied: gpu.alloc(if owner && cfg.tied() && (head || spec.embedding) { vp * c } else { 0 })?,
            host_x: vec![X::default(); n * c],
            host_losses: vec![0.0; hn],
        };
        let kept = if owner { total } else { 0 };
        let mut part = GpuPart {
            cfg,
            spec,
            b,
            vp,
            recompute,
            tp,
            tensors,
            master: gpu.alloc(kept)?,
            params: gpu.alloc(total)?,
            grads: gpu.alloc(total)?,
            m: gpu.alloc(kept)?,
            v: gpu.alloc(kept)?,
            adam_t: 0,
            ema: gpu.alloc(0)?,
            head_grad: gpu.alloc(if head && owner && cfg.tied() { vp * c } else { 0 })?,
            free: (0..live).rev().collect(),
            slots,
            saved: BTreeMap::new(),
            s,
            slot_bytes,
            live_bytes: 0,
            peak_live_bytes: 0,
        };
        let weights: Vec<&[f32]> = params.iter().map(|p| p.data.as_slice()).collect();
        if owner {
            part.load_weights(gpu, &weights)?;
        } else {
            part.load_storage(gpu, &weights)?;
        }
        gpu.synchronize()?;
        Ok(part)
    }

    /// Tokens per microbatch.
    pub fn n(&self) -> usize {
        self.b * self.cfg.block_size
    }

    fn n_blocks(&self) -> usize {
        self.spec.layers.len()
    }

    /// Device address of tensor `i`'s X copy.
    fn w(&self, i: usize) -> u64 {
        self.params.ptr_at(self.tensors[i].offset)
    }

    /// Device address of tensor `i`'s f32 gradient.
    fn g(&self, i: usize) -> u64 {
        self.grads.ptr_at(self.tensors[i].offset)
    }

    /// Device bytes the part's buffers take (weights, optimizer state, activations, scratch).
    pub fn device_bytes(&self) -> usize {
        let s = &self.s;
        self.master.bytes()
            + self.params.bytes()
            + self.grads.bytes()
            + self.m.bytes()
            + self.v.bytes()
            + self.ema.bytes()
            + self.head_grad.bytes()
            + self.slots.len() * self.slot_bytes
            + s.dres.bytes()
            + s.dln.bytes()
            + s.datty.bytes()
            + s.dqkv.bytes()
            + s.dqkv_raw.bytes()
            + s.head_partial.bytes()
            + s.head_leaves.bytes()
            + s.head_gathered.bytes()
            + s.dhidden.bytes()
            + s.dact.bytes()
            + s.logits.bytes()
            + s.lnf.bytes()
            + s.tied.bytes()
            + s.recompute.as_ref().map_or(0, |(a, o)| a.bytes() + o.bytes())
            + s.remade.as_ref().map_or(0, Remade::bytes)
            + s.leaves.bytes()
            + s.gathered.bytes()
    }

    /// Microbatches between forward and backward.
    pub fn live_count(&self) -> usize {
        self.saved.len()
    }

    /// Zero every gradient accumulator (the start of an optimizer step).
    pub fn zero_grads(&mut self, gpu: &Gpu) -> Result<()> {
        gpu.zero(&self.grads)?;
        gpu.zero(&self.head_grad)
    }

    /// Forward of microbatch `mb`. In training its activations stay on the
    /// device until `backward(mb)`; on the last part the loss gradient
    /// (`Mode::Train { dloss }`) is formed and the head's backward runs here.
    /// In evaluation on the last part, `argmax` (N) receives predictions.
    /// The output goes to the host (`output`), or to `sink` when given
    /// (`output` is then empty).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        gpu: &Gpu,
        mb: usize,
        input: GpuInput<X>,
        targets: Option<&[u32]>,
        mode: Mode,
        argmax: Option<&mut [u32]>,
        sink: Option<Sink<X>>,
    ) -> Result<GpuForward> {
        let blocks: Blocks<X> =
            &mut |part, gpu, k| (0..part.n_blocks()).try_for_each(|l| part.block_forward(gpu, k, l, false));
        self.forward_over(gpu, mb, input, targets, mode, argmax, sink, blocks)
    }

    /// `forward`, with the blocks run by `blocks` (tp.rs runs them over the
    /// tensor-parallel group) between taking the input and the head.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_over(
        &mut self,
        gpu: &Gpu,
        mb: usize,
        input: GpuInput<X>,
        targets: Option<&[u32]>,
        mode: Mode,
        argmax: Option<&mut [u32]>,
        sink: Option<Sink<X>>,
        blocks: Blocks<X>,
    ) -> Result<GpuForward> {
        let train = matches!(mode, Mode::Train { .. });
        ensure(!train || !self.saved.contains_key(&mb), || format!("microbatch {mb} ran forward twice"))?;
        let k = self.free.pop().ok_or_else(|| {
            CudaError::Shape(format!(
                "more than {} microbatches alive on this GPU part: the schedule keeps more than was planned",
                self.slots.len()
            ))
        })?;
        let result = self.forward_in(gpu, k, input, targets, mode, argmax, sink, blocks);
        if train && result.is_ok() {
            self.saved.insert(mb, k);
            self.live_bytes += self.slot_bytes;
            self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
        } else {
            self.free.push(k);
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_in(
        &mut self,
        gpu: &Gpu,
        k: usize,
        input: GpuInput<X>,
        targets: Option<&[u32]>,
        mode: Mode,
        argmax: Option<&mut [u32]>,
        sink: Option<Sink<X>>,
        blocks: Blocks<X>,
    ) -> Result<GpuForward> {
        let (t, c, v) = (self.cfg.block_size, self.cfg.n_embd, self.cfg.vocab_size);
        let n = self.n();
        match input {
            GpuInput::Tokens(tokens) => {
                ensure(self.spec.embedding && tokens.len() == n, || {
                    format!(
                        "tokens ({}) given to a part without the embedding or of the wrong size",
                        tokens.len()
                    )
                })?;
                check_ids(tokens, v, "token")?;
                // A learned position table is tensor 1, after the token embedding.
                let w0 = self.w(0);
                let w1 = (self.cfg.positions == Positions::Learned).then(|| self.w(1));
                let slot = &mut self.slots[k];
                let dev = slot.tokens.as_mut().expect("first part keeps tokens");
                dev.upload(gpu, tokens)?;
                match w1 {
                    Some(wpe) => embedding::embedding_forward(gpu, &slot.stream[0], dev, w0, wpe, n, t, c)?,
                    None => embedding::token_embedding_forward(gpu, &slot.stream[0], dev, w0, n, c)?,
                }
            }
            GpuInput::Activation(x) => {
                ensure(!self.spec.embedding && x.len() == n * c, || {
                    format!("an activation of {} values given to a part expecting {}", x.len(), n * c)
                })?;
                upload_f32(gpu, &self.slots[k].stream[0], &mut self.s.host_x, x)?;
            }
            GpuInput::Device(fill) => {
                ensure(!self.spec.embedding, || "an activation given to the first part".into())?;
                fill(gpu, &self.slots[k].stream[0])?;
            }
        }
        blocks(self, gpu, k)?;
        if !self.spec.head {
            let out = &self.slots[k].stream[self.n_blocks()];
            let y = hand_over(gpu, out, &mut self.s.host_x, sink)?;
            return Ok(GpuForward { output: Some(y), loss_sum: None });
        }
        let targets = targets.ok_or_else(|| CudaError::Shape("the last part needs targets".into()))?;
        ensure(targets.len() == n, || format!("{} targets for {n} tokens", targets.len()))?;
        check_ids(targets, v, "target")?;
        let loss_sum = self.head(gpu, k, targets, mode, argmax)?;
        Ok(GpuForward { output: None, loss_sum: Some(loss_sum) })
    }

    /// Where block l's forward for slot k writes: its intermediates and its output.
    fn forward_acts(&self, k: usize, l: usize, recomputing: bool) -> (Acts<'_, X>, &DeviceBuffer<X>) {
        let slot = &self.slots[k];
        let (kept, out) = match (&self.s.recompute, recomputing) {
            (Some((acts, scratch_out)), true) => (acts, scratch_out),
            (Some((acts, _)), false) => (acts, &slot.stream[l + 1]),
            (None, _) => (&slot.blocks[l], &slot.stream[l + 1]),
        };
        (Acts::new(kept, self.s.remade.as_ref()), out)
    }

    /// Block l's intermediates for backward of slot k (recomputed, kept, or
    /// kept selectively and made again by `remake`).
    fn backward_acts(&self, k: usize, l: usize) -> Acts<'_, X> {
        let kept = match &self.s.recompute {
            Some((acts, _)) => acts,
            None => &self.slots[k].blocks[l],
        };
        Acts::new(kept, self.s.remade.as_ref())
    }

    /// Final norm, head and loss of the microbatch in slot `k`; in training
    /// also their backward, leaving the head input's gradient in the slot.
    /// Returns Σ loss.
    fn head(
        &mut self,
        gpu: &Gpu,
        k: usize,
        targets: &[u32],
        mode: Mode,
        argmax: Option<&mut [u32]>,
    ) -> Result<f64> {
        let (c, v, vp, n) = (self.cfg.n_embd, self.cfg.vocab_size, self.vp, self.n());
        let (hb, wte) = (self.spec.head_base(&self.cfg), self.spec.head_wte(&self.cfg));
        // The final norm's gain, then its bias (a LayerNorm's).
        let bias = (self.cfg.final_norm_len() == 2).then_some(hb + 1);
        let (lnw, lnb, wte_w) = (self.w(hb), self.w_opt(bias), self.w(wte));
        let (glnw, glnb) = (self.g(hb), self.g_opt(bias));
        // Tied, the head's share of the embedding's gradient waits apart; untied it is lm_head's own.
        let head_grad = if self.cfg.tied() { self.head_grad.ptr() } else { self.g(wte) };
        let cfg = self.cfg;
        let s = &mut self.s;
        let x = &self.slots[k].stream[self.spec.layers.len()];
        gpu.copy_to(&s.targets, 0, targets)?;
        block::norm_forward(gpu, &cfg, (&s.lnf, &s.lnf_mean, &s.lnf_rstd), x, lnw, lnb, n, c)?;
        // logits (N, Vp) = lnf (N, C) · Wᵀ: the input-gradient product with W (the
        // token embedding or lm_head, both (Vp, C)) as the weight.
        matmul::matmul_backward_input(gpu, &s.logits, &s.lnf, wte_w, n, vp, c)?;
        let dloss = match mode {
            Mode::Eval => {
                let want = argmax.is_some();
                crossentropy::crossentropy_forward(
                    gpu,
                    &s.logits,
                    &s.losses,
                    want.then_some(&s.argmax),
                    &s.targets,
                    n,
                    v,
                    vp,
                )?;
                if let Some(am) = argmax {
                    ensure(am.len() == n, || format!("argmax of {} for {n} tokens", am.len()))?;
                    gpu.download_into(&s.argmax, am)?;
                }
                return s.loss_sum(gpu);
            }
            Mode::Train { dloss } => dloss,
        };
        crossentropy::crossentropy_forward_backward(gpu, &s.logits, &s.losses, &s.targets, dloss, n, v, vp)?;
        // dlnf (N, C) = dlogits (N, Vp) · W (Vp, C); dW (Vp, C) += dlogitsᵀ · lnf.
        matmul::matmul_forward(gpu, &s.dln, &s.logits, wte_w, None, n, vp, c)?;
        matmul::matmul_backward_weight(gpu, head_grad, None, &s.bias_partial, &s.lnf, &s.logits, n, vp, c)?;
        let dhead = self.slots[k].dhead.as_ref().expect("last part keeps dhead");
        gpu.zero(dhead)?;
        let stats = (&s.lnf_mean, &s.lnf_rstd);
        block::norm_backward_input(gpu, &cfg, dhead, &s.dln, x, lnw, stats, n, c)?;
        block::norm_backward_weight(gpu, &cfg, (glnw, glnb), &s.ln_partial, &s.dln, x, stats, n, c)?;
        s.loss_sum(gpu)
    }

    /// Backward of microbatch `mb` (a full B). `dout` is the gradient of the
    /// part's output. Returns the gradient of the part's input (None on the
    /// first part; empty when it went to `sink`).
    pub fn backward(
        &mut self,
        gpu: &Gpu,
        mb: usize,
        dout: GpuGrad<X>,
        sink: Option<Sink<X>>,
    ) -> Result<Option<Vec<f32>>> {
        let blocks: Blocks<X> = &mut |part, gpu, k| {
            for l in (0..part.n_blocks()).rev() {
                if part.recompute == Recompute::Full {
                    part.block_forward(gpu, k, l, true)?;
                }
                part.block_backward(gpu, k, l)?;
            }
            Ok(())
        };
        self.backward_over(gpu, mb, dout, sink, blocks)
    }

    /// `backward`, with the blocks run by `blocks` once `dres` holds the
    /// gradient of the part's output.
    pub(super) fn backward_over(
        &mut self,
        gpu: &Gpu,
        mb: usize,
        dout: GpuGrad<X>,
        sink: Option<Sink<X>>,
        blocks: Blocks<X>,
    ) -> Result<Option<Vec<f32>>> {
        let k = self
            .saved
            .remove(&mb)
            .ok_or_else(|| CudaError::Shape(format!("backward of microbatch {mb} before its forward")))?;
        self.live_bytes -= self.slot_bytes;
        let result = self.backward_in(gpu, k, dout, sink, blocks);
        self.free.push(k);
        result
    }

    fn backward_in(
        &mut self,
        gpu: &Gpu,
        k: usize,
        dout: GpuGrad<X>,
        sink: Option<Sink<X>>,
        blocks: Blocks<X>,
    ) -> Result<Option<Vec<f32>>> {
        let (t, c) = (self.cfg.block_size, self.cfg.n_embd);
        let n = self.n();
        match (self.spec.head, dout) {
            (true, GpuGrad::FromLoss) => {
                gpu.copy_device(&self.s.dres, self.slots[k].dhead.as_ref().expect("dhead"))?
            }
            (false, GpuGrad::Device(fill)) => fill(gpu, &self.s.dres)?,
            (false, GpuGrad::Host(d)) => {
                ensure(d.len() == n * c, || {
                    format!("an output gradient of {} values, expected {}", d.len(), n * c)
                })?;
                upload_f32(gpu, &self.s.dres, &mut self.s.host_x, d)?;
            }
            _ => {
                return Err(CudaError::Shape(
                    "the last part takes no output gradient; others need one".into(),
                ))
            }
        }
        blocks(self, gpu, k)?;
        if self.spec.embedding {
            let dwte = self.g(0);
            let dwpe = (self.cfg.positions == Positions::Learned).then(|| self.g(1));
            let owners = self.slots[k].tokens.as_ref().expect("first part keeps tokens");
            embedding::embedding_backward(gpu, dwte, dwpe, &self.s.dres, owners, self.b, t, c)?;
            return Ok(None);
        }
        Ok(Some(hand_over(gpu, &self.s.dres, &mut self.s.host_x, sink)?))
    }

    /// This part's share of the tied embedding's gradient, (V, C) without
    /// padding: the embedding's gradient on the first part, the head's on a
    /// head-only part; empty when the head is untied (nothing is shared).
    pub fn tied_share(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        if !self.cfg.tied() {
            return Ok(vec![]);
        }
        let vc = self.cfg.vocab_size * self.cfg.n_embd;
        let mut out = vec![0.0f32; vc];
        if self.spec.embedding {
            gpu.download_at(&self.grads, self.tensors[0].offset, &mut out)?;
        } else {
            ensure(self.spec.head, || "a part without wte has no tied share".into())?;
            gpu.download_at(&self.head_grad, 0, &mut out)?;
        }
        Ok(out)
    }

    /// Sums the tied embedding's two gradient shares into this part's wte
    /// gradient, embedding share + head share (the order every layout uses,
    /// as `ModelPart::combine_tied_grads`). `other` is the other part's share;
    /// None when this part holds both.
    pub fn combine_tied(&mut self, gpu: &Gpu, other: Option<&[f32]>) -> Result<()> {
        if !self.cfg.tied() {
            return Ok(());
        }
        let vc = self.cfg.vocab_size * self.cfg.n_embd;
        match other {
            None => {
                ensure(self.spec.embedding && self.spec.head, || {
                    "combine_tied(None) needs both ends".into()
                })?;
                let g0 = self.g(0);
                adamw::add_f32(gpu, g0, g0, self.head_grad.ptr(), self.vp * self.cfg.n_embd)
            }
            Some(share) => {
                ensure(share.len() == vc, || format!("tied share of {} values, expected {vc}", share.len()))?;
                gpu.copy_to(&self.s.tied, 0, share)?;
                if self.spec.embedding {
                    let g0 = self.g(0);
                    adamw::add_f32(gpu, g0, g0, self.s.tied.ptr(), vc)
                } else {
                    let gw = self.g(self.spec.head_wte(&self.cfg));
                    adamw::add_f32(gpu, gw, self.s.tied.ptr(), self.head_grad.ptr(), vc)
                }
            }
        }
    }

    /// Per-tensor Σg² as (norm slot, value), keyed by the tensor's first norm
    /// slot (`optim::zero::first_slots`), the key the CPU gives the tensor's
    /// first block: the coordinator orders them, and replay names them, as the
    /// CPU's. One value covers the whole tensor (the CPU reports one per
    /// 1024-element block). The head's copy of the tied embedding is left
    /// out when another part owns the embedding (as `optim::grad_sum_squares`).
    pub fn grad_sum_squares(&self, gpu: &Gpu) -> Result<Vec<(usize, f64)>> {
        let sums = adamw::sum_squares_ranges(gpu, &self.grads, &self.s.norms)?;
        let first = crate::optim::zero::first_slots(&self.cfg);
        let kept = self.tensors.iter().filter(|t| reports_norm(t, self.spec.embedding));
        Ok(kept.zip(sums).map(|(t, s)| (first[t.canonical], s as f64)).collect())
    }

    /// One AdamW update of every tensor with its (combined) gradient scaled by `clip`.
    pub fn adamw(&mut self, gpu: &Gpu, hyper: &Hyper, lr: f64, clip: f32) -> Result<()> {
        self.adam_t += 1;
        let h = hyper.adamw(lr, self.adam_t);
        let runs = &self.s.adamw_runs;
        adamw::adamw_update(gpu, &self.master, &self.params, &self.grads, &self.m, &self.v, runs, &h, clip)
    }

    /// Keeps an EMA of the master weights from now on (rank 0 only, beside
    /// them): its buffer allocated here, so a step allocates nothing.
    pub fn keep_ema(&mut self, gpu: &Gpu) -> Result<()> {
        ensure(!self.master.is_empty(), || "an EMA on a part without master weights (a follower)".into())?;
        self.ema = gpu.alloc(self.master.len())?;
        Ok(())
    }

    /// One EMA update after an applied AdamW step: the first (`first`)
    /// copies the master weights, as AveragedModel's does; later ones lerp
    /// toward them by `weight` (`kernels::cpu::ema::weight_of`). One launch
    /// over the whole flat buffer: elementwise, and the padding between
    /// tensors is zero in both buffers, so it stays zero.
    pub fn update_ema(&mut self, gpu: &Gpu, first: bool, weight: f32) -> Result<()> {
        ensure(self.ema.len() == self.master.len() && !self.ema.is_empty(), || {
            "an EMA update on a part that keeps none".into()
        })?;
        match first {
            true => gpu.copy_device(&self.ema, &self.master),
            false => ema::ema_update(gpu, &self.ema, &self.master, self.master.len(), weight),
        }
    }

    /// The EMA of the master weights, per tensor.
    pub fn ema_weights(&self, gpu: &Gpu) -> Result<Vec<Vec<f32>>> {
        self.per_tensor(gpu, &self.ema)
    }

    /// Sets the EMA, per tensor in this part's order (a resume or a rollback).
    pub fn load_ema(&mut self, gpu: &Gpu, values: &[impl AsRef<[f32]>]) -> Result<()> {
        self.upload_per_tensor(gpu, "EMA", values, |p| &p.ema)
    }

    /// Per tensor (CPU order and shapes, wte without padding) values of a flat buffer.
    fn per_tensor(&self, gpu: &Gpu, flat: &DeviceBuffer<f32>) -> Result<Vec<Vec<f32>>> {
        let all = gpu.download(flat)?;
        Ok(self.tensors.iter().map(|s| all[s.offset..s.offset + s.numel].to_vec()).collect())
    }

    /// The f32 master weights, per tensor.
    pub fn master_weights(&self, gpu: &Gpu) -> Result<Vec<Vec<f32>>> {
        self.per_tensor(gpu, &self.master)
    }

    /// The accumulated gradients, per tensor (after `combine_tied`, wte's is the sum).
    pub fn gradients(&self, gpu: &Gpu) -> Result<Vec<Vec<f32>>> {
        self.per_tensor(gpu, &self.grads)
    }

    /// AdamW's first and second moments, per tensor.
    pub fn moments(&self, gpu: &Gpu) -> Result<(PerTensor, PerTensor)> {
        Ok((self.per_tensor(gpu, &self.m)?, self.per_tensor(gpu, &self.v)?))
    }

    /// Sets master weights (and their X copy), per tensor in this part's order.
    pub fn load_weights(&mut self, gpu: &Gpu, weights: &[&[f32]]) -> Result<()> {
        self.upload_per_tensor(gpu, "weight", weights, |p| &p.master)?;
        self.load_storage(gpu, weights)
    }

    /// Sets the X copy the kernels read (all a follower keeps).
    fn load_storage(&mut self, gpu: &Gpu, weights: &[&[f32]]) -> Result<()> {
        ensure(weights.len() == self.tensors.len(), || {
            format!("{} weight tensors given, the part has {}", weights.len(), self.tensors.len())
        })?;
        for (s, w) in self.tensors.iter().zip(weights) {
            ensure(w.len() == s.numel, || {
                format!("{} weight: {} values, expected {}", s.name, w.len(), s.numel)
            })?;
            let x: Vec<X> = w.iter().map(|&f| X::from_f32(f)).collect();
            gpu.copy_to(&self.params, s.offset, &x)?;
        }
        Ok(())
    }

    /// Sets AdamW's moments and step count (a resume or a rollback).
    pub fn load_moments(&mut self, gpu: &Gpu, m: &[Vec<f32>], v: &[Vec<f32>], t: u64) -> Result<()> {
        self.upload_per_tensor(gpu, "exp_avg", m, |p| &p.m)?;
        self.upload_per_tensor(gpu, "exp_avg_sq", v, |p| &p.v)?;
        self.adam_t = t;
        Ok(())
    }

    fn upload_per_tensor(
        &self,
        gpu: &Gpu,
        what: &str,
        values: &[impl AsRef<[f32]>],
        buf: impl Fn(&Self) -> &DeviceBuffer<f32>,
    ) -> Result<()> {
        ensure(values.len() == self.tensors.len(), || {
            format!("{} {what} tensors given, the part has {}", values.len(), self.tensors.len())
        })?;
        for (s, x) in self.tensors.iter().zip(values) {
            let x = x.as_ref();
            ensure(x.len() == s.numel, || {
                format!("{} {what}: {} values, expected {}", s.name, x.len(), s.numel)
            })?;
            gpu.copy_to(buf(self), s.offset, x)?;
        }
        Ok(())
    }

    /// The final norm's gradients (and an untied head's) in `grads` as one (offset, length)
    /// run (the head's forward writes them; nothing lies between its weight
    /// and bias but zero padding). None without the head.
    fn head_norm_run(&self) -> Option<(usize, usize)> {
        head_norm_run(&self.tensors, &self.spec, &self.cfg)
    }

    /// f32 elements of one microbatch's head leaf for the microbatch tree
    /// (optim::grad_tree): the head's run (`head_norm_run`), then the head's
    /// share of a tied embedding. 0 without the head.
    pub fn head_leaf_len(&self) -> usize {
        self.head_norm_run().map_or(0, |(_, n)| n + self.head_grad.len())
    }

    /// f32 elements of one microbatch's body leaf: the whole gradient buffer
    /// (the head's run in it is zero, its values go in the head leaf).
    pub fn body_leaf_len(&self) -> usize {
        self.grads.len()
    }

    /// Moves the head's gradients of the microbatch whose forward just ran
    /// into `leaf` (`head_leaf_len`) and resets them to `zero` (the value the
    /// part's accumulators start from), so the next forward's start from it.
    pub fn take_head_leaf(&mut self, gpu: &Gpu, leaf: &DeviceBuffer<f32>, zero: f32) -> Result<()> {
        let (offset, n) = self
            .head_norm_run()
            .ok_or_else(|| CudaError::Shape("a head leaf taken from a part without the head".into()))?;
        ensure(leaf.len() == self.head_leaf_len(), || {
            format!("a head leaf of {} elements, expected {}", leaf.len(), self.head_leaf_len())
        })?;
        gpu.copy_raw(leaf.ptr(), self.grads.ptr_at(offset), n * 4)?;
        gpu.copy_raw(leaf.ptr_at(n), self.head_grad.ptr(), self.head_grad.bytes())?;
        gpu.fill_f32_at(&self.grads, offset, n, zero)?;
        gpu.zero(&self.head_grad)
    }

    /// Copies the gradient buffer into `leaf` (`body_leaf_len`): the body
    /// leaf of the microbatch whose backward just ran; the caller resets.
    pub fn copy_body_leaf(&self, gpu: &Gpu, leaf: &DeviceBuffer<f32>) -> Result<()> {
        gpu.copy_device(leaf, &self.grads)
    }

    /// Puts the tree's roots (the step's sums over every microbatch) in the
    /// gradient buffers: the body's whole, then the head's runs over it.
    pub fn set_tree_roots(
        &mut self,
        gpu: &Gpu,
        body: &DeviceBuffer<f32>,
        head: Option<&DeviceBuffer<f32>>,
    ) -> Result<()> {
        gpu.copy_device(&self.grads, body)?;
        match (self.head_norm_run(), head) {
            (Some((offset, n)), Some(h)) => {
                ensure(h.len() == self.head_leaf_len(), || {
                    format!("a head root of {} elements, expected {}", h.len(), self.head_leaf_len())
                })?;
                gpu.copy_raw(self.grads.ptr_at(offset), h.ptr(), n * 4)?;
                gpu.copy_raw(self.head_grad.ptr(), h.ptr_at(n), self.head_grad.bytes())
            }
            (None, None) => Ok(()),
            _ => Err(CudaError::Shape("a head root given to a part without the head, or none to one".into())),
        }
    }

    /// A tree node (body and, with the head, head buffers) in the exchanged
    /// "part order" of optim::grad_tree::PartTree: one vector per tensor,
    /// then the head's share of a tied embedding (empty untied); the
    /// head-only part's copy of the embedding, which only the tied
    /// combination writes, as an empty vector.
    pub fn node_gradients(
        &self,
        gpu: &Gpu,
        body: &DeviceBuffer<f32>,
        head: Option<&DeviceBuffer<f32>>,
    ) -> Result<Vec<Vec<f32>>> {
        let all = gpu.download(body)?;
        let mut out: Vec<Vec<f32>> =
            self.tensors.iter().map(|s| all[s.offset..s.offset + s.numel].to_vec()).collect();
        let Some((offset, n)) = self.head_norm_run() else {
            return Ok(out);
        };
        let h = gpu.download(head.ok_or_else(|| CudaError::Shape("a head node is missing".into()))?)?;
        let (wte, tied) = (self.spec.head_wte(&self.cfg), self.cfg.tied());
        for k in self.spec.head_leaf(&self.cfg) {
            let s = &self.tensors[k];
            out[k] = h[s.offset - offset..s.offset - offset + s.numel].to_vec();
        }
        if !self.spec.embedding && tied {
            out[wte] = Vec::new();
        }
        let share = if tied { self.cfg.vocab_size * self.cfg.n_embd } else { 0 };
        out.push(h[n..n + share].to_vec());
        Ok(out)
    }

    /// Sets the gradients from a part-order set (`node_gradients`' layout;
    /// the data-parallel sum over replicas): empty vectors leave a tensor as
    /// it is.
    pub fn set_node_gradients(&mut self, gpu: &Gpu, grads: &[Vec<f32>]) -> Result<()> {
        let n = self.tensors.len();
        let want = n + usize::from(self.spec.head);
        ensure(grads.len() == want, || {
            format!("{} gradient sets given, the part order has {want}", grads.len())
        })?;
        for (k, g) in grads.iter().enumerate() {
            if g.is_empty() {
                continue;
            }
            let (buf, offset, numel, name) = match self.tensors.get(k) {
                Some(s) => (&self.grads, s.offset, s.numel, s.name.as_str()),
                None => (&self.head_grad, 0, self.cfg.vocab_size * self.cfg.n_embd, "the head's tied share"),
            };
            ensure(g.len() == numel, || format!("{name} gradient: {} values, expected {numel}", g.len()))?;
            gpu.copy_to(buf, offset, g)?;
        }
        Ok(())
    }

    /// Overwrites one gradient element of tensor `i` (the overflow fault knob).
    pub fn poison_gradient(&mut self, gpu: &Gpu, i: usize, value: f32) -> Result<()> {
        gpu.copy_to(&self.grads, self.tensors[i].offset, &[value])
    }
}

/// f32 values from the host into `dst` as X, converted in the staging buffer
/// `host` (as long as `src`), so nothing is allocated.
fn upload_f32<X: Elem>(gpu: &Gpu, dst: &DeviceBuffer<X>, host: &mut [X], src: &[f32]) -> Result<()> {
    for (h, &f) in host.iter_mut().zip(src) {
        *h = X::from_f32(f);
    }
    gpu.copy_to(dst, 0, host)
}

/// A part's outgoing tensor: to `sink` when it takes it (then empty), else
/// brought to the host as f32 through the staging buffer `host`.
fn hand_over<X: Elem>(
    gpu: &Gpu,
    buf: &DeviceBuffer<X>,
    host: &mut [X],
    sink: Option<Sink<X>>,
) -> Result<Vec<f32>> {
    if let Some(sink) = sink {
        if sink(gpu, buf)? {
            return Ok(vec![]);
        }
    }
    gpu.download_into(buf, host)?;
    Ok(host.iter().map(|x| x.to_f32()).collect())
}

/// Ids must index the vocabulary; a bad one would read outside wte.
fn check_ids(ids: &[u32], v: usize, what: &str) -> Result<()> {
    match ids.iter().position(|&i| i as usize >= v) {
        Some(at) => {
            Err(CudaError::Shape(format!("{what} id {} at {at} is not below vocab_size {v}", ids[at])))
        }
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::params::all_tensors;

    fn params(cfg: &Arch) -> Vec<Param> {
        all_tensors(cfg)
            .into_iter()
            .enumerate()
            .map(|(canonical, (name, shape))| {
                let n = shape.iter().product();
                Param { name, shape, data: vec![0.0; n], grad: vec![], canonical }
            })
            .collect()
    }

    #[test]
    fn the_head_leaf_run_is_exactly_a_layernorm_s_weight_and_bias_and_absent_without_the_head() {
        let cfg = Arch::gpt2(3, 3, 192, 1000, 64);
        let spec = PartSpec { layers: 2..3, embedding: false, head: true };
        let all = params(&cfg);
        // A head-only part: block 2, the final norm, then the tied copy of the token embedding.
        let mut ps: Vec<Param> = all
            .iter()
            .filter(|p| p.name.starts_with("layers.2.") || p.name.starts_with("norm."))
            .cloned()
            .collect();
        ps.push(all[0].clone());
        let (tensors, _) = tensor_layout(&cfg, &ps, padded_vocab(cfg.vocab_size));
        let (offset, n) = head_norm_run(&tensors, &spec, &cfg).expect("a head part has the run");
        let inside = |t: &TensorSlot| t.offset >= offset && t.offset + t.stored <= offset + n;
        let covered: Vec<&str> = tensors.iter().filter(|t| inside(t)).map(|t| t.name.as_str()).collect();
        assert_eq!(covered, ["norm.weight", "norm.bias"]);
        let ln_b = tensors.iter().find(|t| t.name == "norm.bias").expect("norm.bias");
        assert_eq!(offset + n, ln_b.offset + ln_b.stored, "the run ends with the bias");
        let body = PartSpec { layers: 0..2, embedding: true, head: false };
        assert_eq!(head_norm_run(&tensors, &body, &cfg), None);
    }

    #[test]
    fn a_llama_head_run_is_the_norm_then_its_own_lm_head_untied_and_the_norm_alone_tied() {
        for tied in [false, true] {
            let cfg = Arch { tied, ..Arch::llama(3, 2, 1, 128, 192, 1000, 64, 1e4) };
            let spec = PartSpec { layers: 2..3, embedding: false, head: true };
            let all = params(&cfg);
            let mut ps: Vec<Param> = all
                .iter()
                .filter(|p| {
                    p.name.starts_with("layers.2.") || p.name == "norm.weight" || p.name == "lm_head.weight"
                })
                .cloned()
                .collect();
            if tied {
                ps.push(all[0].clone());
            }
            let vp = padded_vocab(cfg.vocab_size);
            let (tensors, _) = tensor_layout(&cfg, &ps, vp);
            let last = tensors.last().expect("the head's weight");
            assert_eq!(last.stored, vp * cfg.n_embd, "{} keeps the padded vocabulary rows", last.name);
            let (offset, n) = head_norm_run(&tensors, &spec, &cfg).expect("a head part has the run");
            let inside = |t: &TensorSlot| t.offset >= offset && t.offset + t.stored <= offset + n;
            let covered: Vec<&str> = tensors.iter().filter(|t| inside(t)).map(|t| t.name.as_str()).collect();
            let want: &[&str] = if tied { &["norm.weight"] } else { &["norm.weight", "lm_head.weight"] };
            assert_eq!(covered, want, "tied {tied}");
        }
    }

    #[test]
    fn every_tensor_starts_256_byte_aligned_in_bf16_even_when_n_embd_is_64_times_odd() {
        // n_embd = 192: biases of 192 and 576 elements are 64 × odd, the sizes
        // that left the next tensor 128 bytes off a 256-byte boundary.
        for c in [192, 320, 768] {
            let cfg = Arch::gpt2(2, c / 64, c, 1000, 64);
            let ps = params(&cfg);
            let (tensors, total) = tensor_layout(&cfg, &ps, padded_vocab(cfg.vocab_size));
            let mut end = 0;
            for t in &tensors {
                assert_eq!(t.offset * 2 % 256, 0, "{} at element {} (n_embd {c})", t.name, t.offset);
                assert!(t.offset >= end, "{} overlaps the tensor before it", t.name);
                end = t.offset + t.stored;
            }
            assert!(total >= end);
            if !c.is_multiple_of(ALIGN) {
                let odd = tensors.iter().any(|t| !t.numel.is_multiple_of(ALIGN));
                assert!(odd, "the case under test: a tensor whose size is not a multiple of ALIGN");
            }
        }
    }
}
