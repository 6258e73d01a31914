//! The whole-model checks of `gpu-check` (group `steps`): GPU training steps
//! against the CPU model's, bit-identical repeats, a pipeline cut against one
//! part, and tensor-parallel ranks against one rank. They drive the model, so
//! they live here beside it; the kernels' own twin checks, the group list and
//! the report format are `kernels::cuda::check`'s, re-exported so `gpu-check`
//! and the tests reach the whole list from one place.

mod tp;

use super::model::GpuModel;
use super::part::{GpuGrad, GpuInput, GpuPart};
use crate::kernels::cuda::check as kernel_checks;
use crate::kernels::cuda::check::{bits_differ, rel_err};
pub use crate::kernels::cuda::check::{line, run_all, table, Check, Group, Progress};
use crate::kernels::cuda::{Bf16, Elem, Gpu, Result};
use crate::metrics::StepStats;
use crate::model::arch::{Mlp, Positions, Role};
use crate::model::part::{Mode, PartInput};
use crate::model::recompute::Recompute;
use crate::model::{Arch, ModelPart, Param, PartSpec};
use crate::optim::{self, AdamState, Hyper};
use crate::rng::{Purpose, Rng};

/// Runs every group (or `only` one), the kernels' and the whole model's,
/// reporting each check as it finishes; on an error, the checks that
/// finished before it have been reported.
pub fn run(gpu: &Gpu, only: Option<Group>, report: &mut dyn FnMut(Progress)) -> Result<Vec<Check>> {
    kernel_checks::run(gpu, only, report, Some(&mut |out: &mut Vec<Check>| step_checks_into(gpu, out)))
}

/// The whole-model step check: a model small enough for the CPU to step in a
/// moment, with every part of GPT-2 (two blocks, a padded vocabulary, two
/// microbatches of gradient accumulation, clipping on).
fn step_cfg() -> Arch {
    Arch::gpt2(2, 2, 128, 1000, 64)
}

/// The same for a Llama: grouped-query attention (two query heads sharing one
/// key/value head, of size 64 as the f32 kernels take), a SwiGLU MLP of
/// width 192, RoPE, RMSNorms and an untied head.
fn llama_step_cfg() -> Arch {
    Arch::llama(2, 2, 1, 128, 192, 1000, 64, 10_000.0)
}
/// Settings no family presets together, so that the one block is seen to
/// follow settings rather than a family: RoPE with biases on every
/// projection (k's bias counts under RoPE; q's and k's biases come before
/// their norms), the per-head q/k norm and a sliding window of 16 of the 64
/// positions together, a GELU MLP of width 192 after an RMSNorm, an untied
/// head, and four query heads of 64 over two key/value heads with n_embd 128
/// (head_dim apart from n_embd / n_head).
pub(super) fn mixed_step_cfg() -> Arch {
    let llama = Arch::llama(2, 4, 2, 128, 192, 1000, 64, 10_000.0);
    Arch {
        head_dim: 64,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        mlp: Mlp::Gelu,
        qk_norm: true,
        window: Some(16),
        ..llama
    }
}

/// Qwen3's settings over Llama's block: an RMSNorm over each head of q and
/// of k (gains of head_dim 64, eps 1e-6) before RoPE, four query heads over
/// two key/value heads 256 wide over a 128-wide stream, θ = 1e6, a tied head.
pub(super) fn qwen3_step_cfg() -> Arch {
    let llama = Arch::llama(2, 4, 2, 128, 192, 1000, 64, 1_000_000.0);
    Arch { head_dim: 64, qk_norm: true, norm_eps: 1e-6, tied: true, ..llama }
}

/// Mistral's settings over Llama's block: each query sees the last 12 of the
/// 64 positions (itself included), two query heads sharing one key/value head.
pub(super) fn mistral_step_cfg() -> Arch {
    Arch { window: Some(12), ..llama_step_cfg() }
}

const STEP_B: usize = 2;
const STEP_MICROBATCHES: usize = 2;
const STEP_SEED: u64 = 7;
const STEP_LR: f64 = 1e-3;
const STEP_HYPER: Hyper = Hyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
const STEP_CLIP: f64 = 1.0;

/// Microbatch `mb` of step `step`: random tokens below `v`, keyed so the CPU and the GPU see the same.
fn step_batch(v: usize, step: u64, mb: usize, inputs: &mut [u32], targets: &mut [u32]) {
    let mut r = Rng::new(STEP_SEED, Purpose::Test, &[step, mb as u64]);
    let v = v as u64;
    for (i, t) in inputs.iter_mut().zip(targets.iter_mut()) {
        *i = r.below(v) as u32;
        *t = r.below(v) as u32;
    }
}

/// One step of the CPU model, as train::engine::Engine::step does it.
fn cpu_step(part: &mut ModelPart, adam: &mut AdamState, step: u64) -> StepStats {
    let n = part.b * part.cfg.block_size;
    let dloss = 1.0 / (STEP_MICROBATCHES * n) as f32;
    let (mut inputs, mut targets) = (vec![0u32; n], vec![0u32; n]);
    part.zero_grads();
    let mut loss_sum = 0.0;
    for mb in 0..STEP_MICROBATCHES {
        step_batch(part.cfg.vocab_size, step, mb, &mut inputs, &mut targets);
        let out = part.forward(PartInput::Tokens(&inputs), Some(&targets), Mode::Train { dloss });
        loss_sum += out.loss_sum.unwrap_or(f64::NAN);
        if let Some(acts) = out.acts {
            part.backward(acts, None);
        }
    }
    part.combine_tied_grads(None);
    let mut norms = vec![];
    let first = optim::zero::first_slots(&part.cfg);
    optim::grad_sum_squares(&part.params, part.spec.embedding, optim::zero::Shard::WHOLE, &first, &mut norms);
    let grad_norm = optim::global_norm(&mut norms);
    adam.step(&mut part.params, STEP_HYPER, STEP_LR, optim::clip_coefficient(grad_norm, STEP_CLIP));
    StepStats { loss: loss_sum * dloss as f64, grad_norm, lr: STEP_LR, skipped: false }
}

fn gpu_step<X: Elem>(model: &mut GpuModel<X>, step: u64) -> Result<StepStats> {
    let v = model.cfg.vocab_size;
    model.step(STEP_LR, &STEP_HYPER, STEP_CLIP, STEP_MICROBATCHES, |mb, i, t| step_batch(v, step, mb, i, t))
}

fn gpu_model<'g, X: Elem>(gpu: &'g Gpu, part: &ModelPart) -> Result<GpuModel<'g, X>> {
    let weights: Vec<&[f32]> = part.params.iter().map(|p| p.data.as_slice()).collect();
    GpuModel::new(gpu, part.cfg, part.b, &weights)
}

/// Two steps of the GPU model in storage type X from the CPU model's initial
/// weights: the losses against the CPU's (absolute difference < 1e-2), and in
/// f32 the gradient norm and every gradient of the first step (relative < 1e-3).
fn step_vs_cpu<X: Elem>(gpu: &Gpu, cfg: Arch, tag: &str, out: &mut Vec<Check>) -> Result<()> {
    let mut part = ModelPart::new(cfg, PartSpec::whole(&cfg), STEP_B, STEP_SEED, false);
    let mut adam = AdamState::new(&part.params);
    let mut model = gpu_model::<X>(gpu, &part)?;
    let abs = |a: f64, b: f64| if (a - b).is_nan() { f64::INFINITY } else { (a - b).abs() };
    for step in 1..=2u64 {
        let cpu = cpu_step(&mut part, &mut adam, step);
        let got = gpu_step(&mut model, step)?;
        out.push(Check {
            name: format!("train step {step} loss, |gpu − cpu| ({tag}, cpu {:.4})", cpu.loss),
            rel_err: abs(got.loss, cpu.loss),
            tol: 1e-2,
        });
        if step == 1 && X::IS_F32 {
            out.push(Check {
                name: format!("train step 1 gradient norm ({tag})"),
                rel_err: abs(got.grad_norm, cpu.grad_norm) / cpu.grad_norm,
                tol: 1e-3,
            });
            let label = format!("train step 1 gradients ({tag})");
            gradients_vs_cpu(&cfg, &part.params, &model.gradients()?, &label, out);
        }
    }
    Ok(())
}

/// Every tensor's gradient on the GPU (`gpu`, in the CPU part's order)
/// against the CPU's: the worst relative error (against the tensor's
/// largest value), tolerance 1e-3. Without RoPE, k's bias shifts every
/// score of a query's row alike, which softmax ignores: its gradient is zero
/// in exact arithmetic and rounding on both sides, rounded differently, so a
/// relative error between them means nothing (it was hidden inside GPT-2's
/// fused c_attn bias before q, k and v were three tensors). It is held, as
/// the CPU block's tests hold it, to being rounding beside q's bias gradient
/// in the same block.
fn gradients_vs_cpu(cfg: &Arch, cpu: &[Param], gpu: &[Vec<f32>], label: &str, out: &mut Vec<Check>) {
    let rounding_only =
        |name: &str| cfg.positions == Positions::Learned && name.ends_with(Role::KBias.name());
    let (mut worst, mut which) = (0.0f64, String::new());
    let mut k_bias: Option<(f64, String)> = None;
    let largest = |g: &[f32]| g.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs()));
    for (p, g) in cpu.iter().zip(gpu) {
        if rounding_only(&p.name) {
            let q_name = p.name.replace(Role::KBias.name(), Role::QBias.name());
            let q = cpu.iter().position(|t| t.name == q_name).map_or(0.0, |i| largest(&gpu[i]));
            let ratio = largest(g) / q.max(1e-30);
            if k_bias.as_ref().is_none_or(|(r, _)| ratio > *r) {
                k_bias = Some((ratio, p.name.clone()));
            }
            continue;
        }
        let e = rel_err(g, &p.grad);
        if e > worst || which.is_empty() {
            (worst, which) = (e, p.name.clone());
        }
    }
    let (head, tail) = label.split_once(" (").unwrap_or((label, ")"));
    out.push(Check { name: format!("{head}, worst {which} ({tail}"), rel_err: worst, tol: 1e-3 });
    if let Some((ratio, name)) = k_bias {
        out.push(Check {
            name: format!("{head}: {name} is rounding, max beside q's bias ({tail}"),
            rel_err: ratio,
            tol: 1e-4,
        });
    }
}

/// The same two GPU steps twice from the same weights: losses, norms and
/// master weights must repeat bit for bit.
fn step_repeats<X: Elem>(gpu: &Gpu, cfg: Arch, tag: &str, out: &mut Vec<Check>) -> Result<()> {
    let part = ModelPart::new(cfg, PartSpec::whole(&cfg), STEP_B, STEP_SEED, false);
    let mut runs = vec![];
    for _ in 0..2 {
        let mut model = gpu_model::<X>(gpu, &part)?;
        let mut figures = vec![];
        for step in 1..=2u64 {
            let s = gpu_step(&mut model, step)?;
            figures.extend([s.loss as f32, s.grad_norm as f32]);
        }
        figures.extend(model.master_weights()?.concat());
        runs.push(figures);
    }
    out.push(Check {
        name: format!("two train steps repeat bit for bit ({tag})"),
        rel_err: bits_differ(&runs[0], &runs[1]),
        tol: 0.5,
    });
    Ok(())
}

/// Forward and backward of the step's microbatches through `parts` (a
/// pipeline cut, run in GPipe order on one GPU, activations and gradients
/// staged through the host as stage messages carry them), the tied shares
/// combined: (loss sum, every gradient in canonical order).
fn pipeline_gradients<X: Elem>(gpu: &Gpu, parts: &mut [GpuPart<X>]) -> Result<(f64, Vec<Vec<f32>>)> {
    let cfg = parts[0].cfg;
    let n = STEP_B * cfg.block_size;
    let dloss = 1.0 / (STEP_MICROBATCHES * n) as f32;
    let (mut inputs, mut targets) = (vec![0u32; n], vec![0u32; n]);
    let last = parts.len() - 1;
    let mut loss = 0.0;
    for p in parts.iter_mut() {
        p.zero_grads(gpu)?;
    }
    for mb in 0..STEP_MICROBATCHES {
        step_batch(cfg.vocab_size, 1, mb, &mut inputs, &mut targets);
        let mut act: Option<Vec<f32>> = None;
        for (k, p) in parts.iter_mut().enumerate() {
            let input = match &act {
                None => GpuInput::Tokens(&inputs),
                Some(a) => GpuInput::Activation(a),
            };
            let t = (k == last).then_some(targets.as_slice());
            let out = p.forward(gpu, mb, input, t, Mode::Train { dloss }, None, None)?;
            loss += out.loss_sum.unwrap_or(0.0);
            act = out.output;
        }
        let mut grad: Option<Vec<f32>> = None;
        for p in parts.iter_mut().rev() {
            let dout = match &grad {
                None => GpuGrad::FromLoss,
                Some(g) => GpuGrad::Host(g),
            };
            grad = p.backward(gpu, mb, dout, None)?;
        }
    }
    if parts.len() == 1 {
        parts[0].combine_tied(gpu, None)?;
    } else {
        let (embed, head) = (parts[0].tied_share(gpu)?, parts[last].tied_share(gpu)?);
        parts[0].combine_tied(gpu, Some(&head))?;
        parts[last].combine_tied(gpu, Some(&embed))?;
    }
    let mut grads: Vec<(usize, Vec<f32>)> = vec![];
    for (k, p) in parts.iter().enumerate() {
        for (t, g) in p.tensors.iter().zip(p.gradients(gpu)?) {
            // The head's copy of a tied embedding repeats the embedding's combined gradient.
            if !(k > 0 && t.canonical == 0) {
                grads.push((t.canonical, g));
            }
        }
    }
    grads.sort_by_key(|(c, _)| *c);
    Ok((loss, grads.into_iter().map(|(_, g)| g).collect()))
}

/// The model cut into two pipeline parts on one GPU against one part holding
/// everything: the same loss and gradients, bit for bit — activations cross
/// the cut exactly (X → f32 → X), and each part accumulates in microbatch order.
/// The cut parts run under `recompute`, the whole one keeps everything: what
/// backward makes again it makes with the forward's bits.
fn pipeline_parts_match_one_part<X: Elem>(
    gpu: &Gpu,
    cfg: Arch,
    recompute: Recompute,
    tag: &str,
    out: &mut Vec<Check>,
) -> Result<()> {
    let whole = PartSpec::whole(&cfg);
    let cut = [
        PartSpec { layers: 0..1, embedding: true, head: false },
        PartSpec { layers: 1..cfg.n_layer, embedding: false, head: true },
    ];
    let build = |spec: &PartSpec, recompute| {
        let params = crate::model::part::part_params(&cfg, spec, STEP_SEED);
        GpuPart::<X>::new(gpu, cfg, spec.clone(), STEP_B, recompute, STEP_MICROBATCHES, &params)
    };
    let mut one = vec![build(&whole, Recompute::None)?];
    let mut two = cut.iter().map(|spec| build(spec, recompute)).collect::<Result<Vec<_>>>()?;
    let (l1, g1) = pipeline_gradients(gpu, &mut one)?;
    let (l2, g2) = pipeline_gradients(gpu, &mut two)?;
    let mut a = vec![l1 as f32];
    a.extend(g1.concat());
    let mut b = vec![l2 as f32];
    b.extend(g2.concat());
    out.push(Check {
        name: match recompute {
            Recompute::None => {
                format!("two pipeline parts = one part, loss and gradients bit for bit ({tag})")
            }
            r => format!(
                "two pipeline parts, {r} recompute = one part, loss and gradients bit for bit ({tag})"
            ),
        },
        rel_err: bits_differ(&a, &b),
        tol: 0.5,
    });
    Ok(())
}

/// What selective recompute frees on the device: a whole part of
/// STEP_MICROBATCHES activation slots keeps n1, n2 and act, N·(2·C + F)
/// elements a block, in none of its slots' blocks, and holds one such set
/// for every block to remake them in; every device buffer is allocated by
/// `GpuPart::new`, so its bytes are the part's peak.
fn selective_frees_device_bytes<X: Elem>(
    gpu: &Gpu,
    cfg: Arch,
    tag: &str,
    out: &mut Vec<Check>,
) -> Result<()> {
    let spec = PartSpec::whole(&cfg);
    let params = crate::model::part::part_params(&cfg, &spec, STEP_SEED);
    let bytes = |r| -> Result<usize> {
        Ok(GpuPart::<X>::new(gpu, cfg, spec.clone(), STEP_B, r, STEP_MICROBATCHES, &params)?.device_bytes())
    };
    let (none, selective) = (bytes(Recompute::None)?, bytes(Recompute::Selective)?);
    let per_set = STEP_B * cfg.block_size * (2 * cfg.n_embd + cfg.ffn()) * std::mem::size_of::<X>();
    let want = (STEP_MICROBATCHES * cfg.n_layer - 1) * per_set;
    out.push(Check {
        name: format!(
            "selective recompute frees (slots × blocks − 1) × N·(2C + F) device elements: {} of {none} bytes ({tag})",
            none as i64 - selective as i64
        ),
        rel_err: (none as f64 - selective as f64 - want as f64).abs() / want as f64,
        tol: f64::EPSILON,
    });
    Ok(())
}

/// The whole-model checks: GPU training steps against the CPU model's (f32
/// and bf16), bit-identical repeats, and a pipeline cut against one part,
/// for GPT-2, for a Llama (untied, and tied across the cut), for Qwen3's
/// and Mistral's settings (`qwen3_step_cfg`, `mistral_step_cfg`) and for a
/// mix of settings no family has (`mixed_step_cfg`).
pub fn step_checks(gpu: &Gpu) -> Result<Vec<Check>> {
    run(gpu, Some(Group::Steps), &mut |_| {})
}

fn step_checks_into(gpu: &Gpu, out: &mut Vec<Check>) -> Result<()> {
    let gpt2 = step_cfg();
    step_vs_cpu::<f32>(gpu, gpt2, "f32", out)?;
    step_vs_cpu::<Bf16>(gpu, gpt2, "bf16", out)?;
    step_repeats::<f32>(gpu, gpt2, "f32", out)?;
    step_repeats::<Bf16>(gpu, gpt2, "bf16", out)?;
    pipeline_parts_match_one_part::<f32>(gpu, gpt2, Recompute::None, "f32", out)?;
    pipeline_parts_match_one_part::<Bf16>(gpu, gpt2, Recompute::Selective, "bf16", out)?;
    selective_frees_device_bytes::<Bf16>(gpu, gpt2, "bf16", out)?;
    let llama = llama_step_cfg();
    step_vs_cpu::<f32>(gpu, llama, "llama f32", out)?;
    step_vs_cpu::<Bf16>(gpu, llama, "llama bf16", out)?;
    step_repeats::<Bf16>(gpu, llama, "llama bf16", out)?;
    pipeline_parts_match_one_part::<f32>(gpu, llama, Recompute::Selective, "llama f32", out)?;
    selective_frees_device_bytes::<Bf16>(gpu, llama, "llama bf16", out)?;
    let tied = Arch { tied: true, ..llama };
    step_vs_cpu::<f32>(gpu, tied, "llama tied f32", out)?;
    pipeline_parts_match_one_part::<f32>(gpu, tied, Recompute::None, "llama tied f32", out)?;
    pipeline_parts_match_one_part::<Bf16>(gpu, tied, Recompute::Selective, "llama tied bf16", out)?;
    let qwen3 = qwen3_step_cfg();
    step_vs_cpu::<f32>(gpu, qwen3, "qwen3-like f32", out)?;
    step_vs_cpu::<Bf16>(gpu, qwen3, "qwen3-like bf16", out)?;
    step_repeats::<Bf16>(gpu, qwen3, "qwen3-like bf16", out)?;
    pipeline_parts_match_one_part::<f32>(gpu, qwen3, Recompute::Selective, "qwen3-like f32", out)?;
    let mistral = mistral_step_cfg();
    step_vs_cpu::<f32>(gpu, mistral, "mistral-like f32", out)?;
    step_vs_cpu::<Bf16>(gpu, mistral, "mistral-like bf16", out)?;
    step_repeats::<Bf16>(gpu, mistral, "mistral-like bf16", out)?;
    pipeline_parts_match_one_part::<f32>(gpu, mistral, Recompute::None, "mistral-like f32", out)?;
    // Both families at ragged shapes: T = 33 (a multiple of no tile), an odd
    // vocabulary (padded), and for the Llama a SwiGLU of 200 (N·H not a whole
    // number of blocks).
    let gpt2_ragged = Arch::gpt2(2, 2, 128, 1001, 33);
    step_vs_cpu::<f32>(gpu, gpt2_ragged, "ragged T=33 f32", out)?;
    step_vs_cpu::<Bf16>(gpu, gpt2_ragged, "ragged T=33 bf16", out)?;
    let llama_ragged = Arch::llama(2, 2, 1, 128, 200, 1001, 33, 10_000.0);
    step_vs_cpu::<f32>(gpu, llama_ragged, "llama ragged T=33 f32", out)?;
    step_vs_cpu::<Bf16>(gpu, llama_ragged, "llama ragged T=33 bf16", out)?;
    let mixed = mixed_step_cfg();
    step_vs_cpu::<f32>(gpu, mixed, "mixed f32", out)?;
    step_vs_cpu::<Bf16>(gpu, mixed, "mixed bf16", out)?;
    pipeline_parts_match_one_part::<Bf16>(gpu, mixed, Recompute::Selective, "mixed bf16", out)?;
    tp::tp_checks(gpu, out)
}
