//! The tensor-parallel split: ranks taking turns on one GPU (what a machine
//! with one GPU can check of the split) and, where the machine has the GPUs,
//! one rank per GPU with NCCL between them, against one rank summing the same
//! slices — two training steps, bit for bit — and the sliced step against the
//! CPU model.

use super::{bits_differ, cpu_step, gradients_vs_cpu, step_batch, Check};
use super::{STEP_B, STEP_CLIP, STEP_HYPER, STEP_LR, STEP_MICROBATCHES, STEP_SEED};
use crate::kernels::cuda::nccl::NcclType;
use crate::kernels::cuda::{Bf16, Elem, Gpu, Result};
use crate::model::gpu::part::{GpuGrad, GpuInput, TpDevices, TpPart};
use crate::model::part::Mode;
use crate::model::recompute::Recompute;
use crate::model::{Arch, ModelPart, PartSpec};
use crate::optim::{self, AdamState};

/// Four heads of 64, so 1, 2 and 4 ranks each take whole slices of 4.
fn tp_cfg() -> Arch {
    Arch::gpt2(2, 4, 256, 1000, 64)
}
const SLICES: usize = 4;
/// A Llama of four query heads of 64 over two key/value heads, split into
/// two slices (a slice is whole groups): 1 and 2 ranks.
fn llama_tp_cfg() -> Arch {
    Arch::llama(2, 4, 2, 256, 384, 1000, 64, 10_000.0)
}
const LLAMA_SLICES: usize = 2;
/// Qwen3's settings (`super::qwen3_step_cfg`) with eight query heads of 64
/// over four key/value heads, so four slices each hold a group of two query
/// heads (each q norm partial sums two heads): 1, 2 and 4 ranks.
fn qwen3_tp_cfg() -> Arch {
    let llama = Arch::llama(2, 8, 4, 128, 256, 1000, 64, 1_000_000.0);
    Arch { head_dim: 64, qk_norm: true, norm_eps: 1e-6, tied: true, ..llama }
}
const QWEN3_SLICES: usize = 4;
/// Mistral's settings (a window of 12 of the 64 positions) over the Llama's split.
fn mistral_tp_cfg() -> Arch {
    Arch { window: Some(12), ..llama_tp_cfg() }
}

/// What two steps leave: each step's loss and gradient norm, then the master
/// weights; and the first step's gradients.
struct Run {
    figures: Vec<f32>,
    first_grads: Vec<Vec<f32>>,
}

/// Where a run's ranks live: taking turns on one GPU, or one GPU each
/// (GPUs 0..size, NCCL between them).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ranks {
    OnOneGpu,
    OneGpuEach,
}

/// Two training steps of the whole model over `size` ranks.
#[allow(clippy::too_many_arguments)]
fn tp_run<X: Elem + NcclType>(
    gpu: &Gpu,
    cfg: Arch,
    slices: usize,
    params: &[crate::model::Param],
    size: usize,
    recompute: Recompute,
    ranks: Ranks,
) -> Result<Run> {
    let dev = match ranks {
        Ranks::OnOneGpu => TpDevices::one_device(Gpu::new(gpu.ordinal)?, size),
        Ranks::OneGpuEach => TpDevices::open(&(0..size).collect::<Vec<_>>())?,
    };
    let spec = PartSpec::whole(&cfg);
    let mut part = TpPart::<X>::new(&dev, cfg, spec, STEP_B, recompute, 1, params, slices)?;
    let n = STEP_B * cfg.block_size;
    let dloss = 1.0 / (STEP_MICROBATCHES * n) as f32;
    let (mut inputs, mut targets) = (vec![0u32; n], vec![0u32; n]);
    let mut run = Run { figures: vec![], first_grads: vec![] };
    for step in 1..=2u64 {
        part.zero_grads(&dev)?;
        let mut loss = 0.0;
        for mb in 0..STEP_MICROBATCHES {
            step_batch(cfg.vocab_size, step, mb, &mut inputs, &mut targets);
            let input = GpuInput::Tokens(&inputs);
            let out = part.forward(&dev, mb, input, Some(&targets), Mode::Train { dloss }, None, None)?;
            loss += out.loss_sum.unwrap_or(f64::NAN);
            part.backward(&dev, mb, GpuGrad::FromLoss, None)?;
        }
        part.summed_mut(&dev)?.combine_tied(dev.gpu(0), None)?;
        let mut norms = part.owner().grad_sum_squares(dev.gpu(0))?;
        let norm = optim::global_norm(&mut norms);
        if step == 1 {
            run.first_grads = part.owner().gradients(dev.gpu(0))?;
        }
        part.adamw(&dev, &STEP_HYPER, STEP_LR, optim::clip_coefficient(norm, STEP_CLIP))?;
        run.figures.extend([(loss * dloss as f64) as f32, norm as f32]);
    }
    run.figures.extend(part.owner().master_weights(dev.gpu(0))?.concat());
    Ok(run)
}

/// Every rank count dividing `slices` gives one rank's bits, 2 also with
/// full recompute and with selective (what backward makes again has the
/// forward's bits); in f32 the sliced step's gradients match the CPU model's.
fn tp_checks_in<X: Elem + NcclType>(
    gpu: &Gpu,
    (cfg, slices): (Arch, usize),
    gpus: usize,
    tag: &str,
    out: &mut Vec<Check>,
) -> Result<()> {
    let mut cpu = ModelPart::new(cfg, PartSpec::whole(&cfg), STEP_B, STEP_SEED, false);
    let one = tp_run::<X>(gpu, cfg, slices, &cpu.params, 1, Recompute::None, Ranks::OnOneGpu)?;
    // tp 2 keeping everything is the NCCL row's below (CI's emulated GPUs are four).
    let sizes = [(2, Recompute::Selective), (4, Recompute::None), (2, Recompute::Full)];
    for (size, recompute) in sizes.into_iter().filter(|&(size, _)| size <= slices) {
        let run = tp_run::<X>(gpu, cfg, slices, &cpu.params, size, recompute, Ranks::OnOneGpu)?;
        out.push(Check {
            name: format!(
                "tp {size}{} = tp 1 over {slices} slices, 2 steps bit for bit ({tag})",
                match recompute {
                    Recompute::None => String::new(),
                    r => format!(" {r} recompute"),
                }
            ),
            rel_err: bits_differ(&run.figures, &one.figures),
            tol: 0.5,
        });
    }
    // With GPUs enough, the same ranks one per GPU: NCCL moves the bytes
    // the device copies moved above, and the bits must not change.
    for size in [2, 4].into_iter().filter(|&s| s <= gpus && s <= slices) {
        let run = tp_run::<X>(gpu, cfg, slices, &cpu.params, size, Recompute::None, Ranks::OneGpuEach)?;
        out.push(Check {
            name: format!("tp {size} on {size} GPUs (NCCL) = tp 1 over {slices} slices, bit for bit ({tag})"),
            rel_err: bits_differ(&run.figures, &one.figures),
            tol: 0.5,
        });
    }
    if X::IS_F32 {
        let mut adam = AdamState::new(&cpu.params);
        cpu_step(&mut cpu, &mut adam, 1);
        let label = format!("tp over {slices} slices, step 1 gradients vs cpu ({tag})");
        gradients_vs_cpu(&cfg, &cpu.params, &one.first_grads, &label, out);
    }
    Ok(())
}

/// The split's checks in f32 and bf16.
pub(super) fn tp_checks(gpu: &Gpu, out: &mut Vec<Check>) -> Result<()> {
    let gpus = cudarc::driver::result::device::get_count()? as usize;
    tp_checks_in::<f32>(gpu, (tp_cfg(), SLICES), gpus, "f32", out)?;
    tp_checks_in::<Bf16>(gpu, (tp_cfg(), SLICES), gpus, "bf16", out)?;
    tp_checks_in::<f32>(gpu, (llama_tp_cfg(), LLAMA_SLICES), gpus, "llama f32", out)?;
    tp_checks_in::<Bf16>(gpu, (llama_tp_cfg(), LLAMA_SLICES), gpus, "llama bf16", out)?;
    // The q/k norms' gains are whole over cut heads: their gradient is a split sum.
    tp_checks_in::<f32>(gpu, (qwen3_tp_cfg(), QWEN3_SLICES), gpus, "qwen3-like f32", out)?;
    tp_checks_in::<f32>(gpu, (mistral_tp_cfg(), LLAMA_SLICES), gpus, "mistral-like f32", out)?;
    // Biases on every projection, split with their rows (o's and down's
    // whole, on rank 0), with the q/k norm and a window.
    tp_checks_in::<f32>(gpu, (super::mixed_step_cfg(), 2), gpus, "mixed f32", out)
}
