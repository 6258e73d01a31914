//! `pipewright gpu-bench`: training throughput of the whole GPU model (bf16)
//! on random tokens, with MFU by llm.c's count — (6·N + 6·L·(NH·HS)·T) FLOPs
//! per token — against an H100 SXM's 989 TFLOP/s bf16 dense peak and against the
//! cuBLASLt bf16 rate measured in the same call.

use super::model::{is_out_of_memory, GpuModel};
use crate::kernels::cuda::counts::Counts;
use crate::kernels::cuda::matmul::{gemm, GemmShape};
use crate::kernels::cuda::{Bf16, CudaError, Gpu, Result};
use crate::model::params::{all_tensors, init_tensor, Arch};
use crate::model::recompute::Recompute;
use crate::optim::Hyper;
use crate::rng::{Purpose, Rng};
use serde::Serialize;
use std::time::Instant;

/// H100 SXM, bf16 dense (no sparsity), in FLOP/s.
pub const H100_BF16_PEAK: f64 = 989e12;
/// Microbatch sizes tried, largest first, when none is given.
pub const MICRO_BATCHES: [usize; 7] = [64, 32, 16, 8, 4, 2, 1];
/// Distinct random batches cycled through the timed steps (made before timing).
const BATCHES: usize = 4;
const SEED: u64 = 1337;
/// AdamW's settings for every bench step (GPT-2's).
const HYPER: Hyper = Hyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };

#[derive(Clone, Debug)]
pub struct BenchArgs {
    pub cfg: Arch,
    /// Sequences per microbatch; None: the largest of MICRO_BATCHES that fits.
    pub micro_batch: Option<usize>,
    pub steps: usize,
    pub warmup: usize,
    /// Side of the square bf16 product that measures cuBLASLt's rate.
    pub matmul_size: usize,
    /// What backward computes again (`train.recompute`).
    pub recompute: Recompute,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub device: String,
    pub arch: u32,
    /// The family's name, as `model.family` gives it ("gpt2", "llama", …).
    pub family: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    /// The MLP's width.
    pub ffn: usize,
    pub tied: bool,
    pub vocab_size: usize,
    pub padded_vocab: usize,
    pub seq: usize,
    pub micro_batch: usize,
    /// `train.recompute`'s name.
    pub recompute: String,
    pub steps: usize,
    pub params: usize,
    pub flops_per_token: f64,
    pub ms_per_step: f64,
    pub tokens_per_s: f64,
    /// Model FLOP/s over H100_BF16_PEAK.
    pub mfu: f64,
    /// The bf16 matrix-product rate measured in this call, FLOP/s.
    pub matmul_flops: f64,
    pub matmul_size: usize,
    /// Model FLOP/s over matmul_flops.
    pub mfu_vs_matmul: f64,
    pub first_loss: f64,
    pub last_loss: f64,
    /// The model's device buffers, all allocated before the first step: the
    /// allocator's peak for the model.
    pub device_gib: f64,
}

/// Best FLOP/s of cuBLASLt's bf16 product D (s×s) = A·B, bf16 in and out, f32
/// accumulation: 5 timed rounds of 10 products after 3 untimed ones.
pub fn matmul_rate(gpu: &Gpu, s: usize) -> Result<f64> {
    let (a, b, d) = (gpu.alloc::<Bf16>(s * s)?, gpu.alloc::<Bf16>(s * s)?, gpu.alloc::<Bf16>(s * s)?);
    // Nonzero inputs, so the rate is not that of a product of zeros.
    let ones = vec![Bf16::from_f32(0.01); s * s];
    gpu.copy_to(&a, 0, &ones)?;
    gpu.copy_to(&b, 0, &ones)?;
    drop(ones);
    let shape = GemmShape {
        m: s,
        n: s,
        k: s,
        trans_a: false,
        trans_b: false,
        lda: s,
        ldb: s,
        ldc: s,
        ab_f32: false,
        c_f32: false,
        bias: false,
    };
    let run = |count: usize| -> Result<f64> {
        let t0 = Instant::now();
        for _ in 0..count {
            gemm(gpu, &shape, a.ptr(), b.ptr(), d.ptr(), None, 0.0)?;
        }
        gpu.synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    run(3)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        best = best.min(run(10)? / 10.0);
    }
    Ok(2.0 * (s as f64).powi(3) / best)
}

/// A model of microbatch `b` that has run one step, or the error (out of memory included).
fn try_model<'g>(
    gpu: &'g Gpu,
    (cfg, recompute): (Arch, Recompute),
    b: usize,
    weights: &[&[f32]],
    batches: &[(Vec<u32>, Vec<u32>)],
) -> Result<(GpuModel<'g, Bf16>, f64)> {
    let mut model = GpuModel::<Bf16>::with_recompute(gpu, cfg, b, recompute, weights)?;
    let loss = step(&mut model, batches, 0)?;
    Ok((model, loss))
}

fn batches_for(cfg: &Arch, b: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    let n = b * cfg.block_size;
    (0..BATCHES)
        .map(|k| {
            let mut r = Rng::new(SEED, Purpose::Data, &[b as u64, k as u64]);
            let v = cfg.vocab_size as u64;
            let inputs: Vec<u32> = (0..n).map(|_| r.below(v) as u32).collect();
            let targets: Vec<u32> = (0..n).map(|_| r.below(v) as u32).collect();
            (inputs, targets)
        })
        .collect()
}

fn step(model: &mut GpuModel<Bf16>, batches: &[(Vec<u32>, Vec<u32>)], k: usize) -> Result<f64> {
    let (inputs, targets) = &batches[k % batches.len()];
    let s = model.step(6e-4, &HYPER, 1.0, 1, |_, i, t| {
        i.copy_from_slice(inputs);
        t.copy_from_slice(targets);
    })?;
    Ok(s.loss)
}

/// Runs the bench; `log` receives progress lines.
pub fn run(gpu: &Gpu, args: &BenchArgs, mut log: impl FnMut(&str)) -> Result<BenchReport> {
    let cfg = args.cfg;
    log(&format!("measuring cuBLASLt bf16 {0}×{0}×{0}", args.matmul_size));
    let matmul_flops = matmul_rate(gpu, args.matmul_size)?;
    log(&format!("cuBLASLt bf16: {:.1} TFLOP/s", matmul_flops / 1e12));
    let host: Vec<Vec<f32>> =
        all_tensors(&cfg).iter().map(|(name, shape)| init_tensor(&cfg, name, shape, SEED)).collect();
    let weights: Vec<&[f32]> = host.iter().map(Vec::as_slice).collect();
    let sizes: Vec<usize> = match args.micro_batch {
        Some(b) => vec![b],
        None => MICRO_BATCHES.to_vec(),
    };
    let mut found = None;
    for &b in &sizes {
        let batches = batches_for(&cfg, b);
        match try_model(gpu, (cfg, args.recompute), b, &weights, &batches) {
            Ok((model, loss)) => {
                found = Some((model, loss, batches));
                break;
            }
            Err(e) if is_out_of_memory(&e) && args.micro_batch.is_none() => {
                log(&format!("micro-batch {b}: out of device memory, trying a smaller one"));
            }
            Err(e) => return Err(e),
        }
    }
    let (mut model, first_loss, batches) = found.ok_or_else(|| {
        CudaError::Shape("not even a micro-batch of 1 sequence fits in device memory".into())
    })?;
    let b = model.b;
    log(&format!(
        "micro-batch {b} × {} tokens, recompute {}, {:.1} GiB of device buffers",
        cfg.block_size,
        args.recompute,
        model.device_bytes() as f64 / (1u64 << 30) as f64
    ));
    for k in 1..args.warmup {
        step(&mut model, &batches, k)?;
    }
    gpu.synchronize()?;
    let t0 = Instant::now();
    let mut last_loss = first_loss;
    for k in 0..args.steps {
        last_loss = step(&mut model, &batches, k)?;
    }
    gpu.synchronize()?;
    let secs = t0.elapsed().as_secs_f64();
    let steps = args.steps.max(1);
    let tokens_per_s = (steps * model.n()) as f64 / secs;
    let flops_per_token = cfg.flops_per_token();
    let model_flops = tokens_per_s * flops_per_token;
    Ok(BenchReport {
        device: gpu.name.clone(),
        arch: gpu.arch,
        family: cfg.family.name().to_string(),
        n_layer: cfg.n_layer,
        n_embd: cfg.n_embd,
        n_head: cfg.n_head,
        n_kv_head: cfg.kv_heads(),
        ffn: cfg.ffn(),
        tied: cfg.tied(),
        vocab_size: cfg.vocab_size,
        padded_vocab: super::model::padded_vocab(model.cfg.vocab_size),
        seq: cfg.block_size,
        micro_batch: b,
        recompute: args.recompute.name().to_string(),
        steps,
        params: cfg.num_params(),
        flops_per_token,
        ms_per_step: 1e3 * secs / steps as f64,
        tokens_per_s,
        mfu: model_flops / H100_BF16_PEAK,
        matmul_flops,
        matmul_size: args.matmul_size,
        mfu_vs_matmul: model_flops / matmul_flops,
        first_loss,
        last_loss,
        device_gib: model.device_bytes() as f64 / (1u64 << 30) as f64,
    })
}

/// The report as lines for a terminal.
pub fn table(r: &BenchReport) -> String {
    format!(
        "{} L={} C={} NH={} NKV={} F={} V={} (padded {}{}) T={}: {:.1} M parameters, micro-batch {}, {} steps\n\
         {:.1} ms/step   {:.0} tokens/s\n\
         MFU {:.1}% of 989 TFLOP/s bf16 (H100 SXM)   {:.1}% of the measured cuBLASLt {:.1} TFLOP/s\n\
         loss {:.4} → {:.4}   recompute {}, {:.3} GiB of device buffers\n",
        crate::model::Family::named(&r.family).map_or(r.family.as_str(), |f| f.title()),
        r.n_layer,
        r.n_embd,
        r.n_head,
        r.n_kv_head,
        r.ffn,
        r.vocab_size,
        r.padded_vocab,
        if r.tied { ", tied head" } else { ", untied head" },
        r.seq,
        r.params as f64 / 1e6,
        r.micro_batch,
        r.steps,
        r.ms_per_step,
        r.tokens_per_s,
        100.0 * r.mfu,
        100.0 * r.mfu_vs_matmul,
        r.matmul_flops / 1e12,
        r.first_loss,
        r.last_loss,
        r.recompute,
        r.device_gib,
    )
}

/// What a steady training step of the whole GPU model (bf16) asks of the
/// driver (`gpu-bench --counts`): a step of one microbatch and a step of two
/// after two warm steps (kernels compiled, products planned, buffers made),
/// so the counts split into a part per microbatch (their difference) and a
/// part per step (the rest); and the same for a model one block deeper, so
/// the per-microbatch part splits again into what each block costs.
#[derive(Clone, Debug, Serialize)]
pub struct CountsReport {
    pub family: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub seq: usize,
    pub micro_batch: usize,
    pub per_step: Counts,
    pub per_microbatch: Counts,
    pub per_block_per_microbatch: Counts,
}

/// The counts of one step of `microbatches` microbatches, from a warm model.
fn step_counts(
    model: &mut GpuModel<Bf16>,
    batches: &[(Vec<u32>, Vec<u32>)],
    microbatches: usize,
) -> Result<Counts> {
    let before = Counts::now();
    // Every microbatch the same tokens: what a microbatch uploads (its token
    // owner lists) depends on its distinct tokens, and the split needs equal ones.
    model.step(6e-4, &HYPER, 1.0, microbatches, |_, i, t| {
        let (inputs, targets) = &batches[0];
        i.copy_from_slice(inputs);
        t.copy_from_slice(targets);
    })?;
    Ok(Counts::now().since(&before))
}

/// (per step, per microbatch) of `cfg` at micro-batch `b`.
fn split_counts(gpu: &Gpu, cfg: Arch, b: usize) -> Result<(Counts, Counts)> {
    let host: Vec<Vec<f32>> =
        all_tensors(&cfg).iter().map(|(name, shape)| init_tensor(&cfg, name, shape, SEED)).collect();
    let weights: Vec<&[f32]> = host.iter().map(Vec::as_slice).collect();
    let batches = batches_for(&cfg, b);
    let mut model = GpuModel::<Bf16>::new(gpu, cfg, b, &weights)?;
    for _ in 0..2 {
        step_counts(&mut model, &batches, 2)?;
    }
    let one = step_counts(&mut model, &batches, 1)?;
    let two = step_counts(&mut model, &batches, 2)?;
    let per_mb = two.minus(&one).ok_or_else(|| {
        CudaError::Shape(format!(
            "a step of two microbatches counted less than one of one: {two:?} < {one:?}"
        ))
    })?;
    let per_step = one.minus(&per_mb).ok_or_else(|| {
        CudaError::Shape(format!("a microbatch counted more than a step of one: {per_mb:?} > {one:?}"))
    })?;
    Ok((per_step, per_mb))
}

pub fn counts(gpu: &Gpu, cfg: Arch, b: usize) -> Result<CountsReport> {
    let (per_step, per_microbatch) = split_counts(gpu, cfg, b)?;
    let deeper = Arch { n_layer: cfg.n_layer + 1, ..cfg };
    let (_, deeper_mb) = split_counts(gpu, deeper, b)?;
    let per_block_per_microbatch = deeper_mb
        .minus(&per_microbatch)
        .ok_or_else(|| CudaError::Shape("a model one block deeper counted less per microbatch".into()))?;
    Ok(CountsReport {
        family: cfg.family.name().to_string(),
        n_layer: cfg.n_layer,
        n_embd: cfg.n_embd,
        seq: cfg.block_size,
        micro_batch: b,
        per_step,
        per_microbatch,
        per_block_per_microbatch,
    })
}

/// The counts as a table: one row per counter, per step, per microbatch and per block.
pub fn counts_table(r: &CountsReport) -> String {
    let mut s = format!(
        "{} L={} C={} T={} micro-batch {}: what a steady step asks of the driver\n{:<14} {:>12} {:>14} {:>16}  counts\n",
        crate::model::Family::named(&r.family).map_or(r.family.as_str(), |f| f.title()),
        r.n_layer,
        r.n_embd,
        r.seq,
        r.micro_batch,
        "counter",
        "per step",
        "per microbatch",
        "per block per mb",
    );
    let rows =
        r.per_step.rows().into_iter().zip(r.per_microbatch.rows()).zip(r.per_block_per_microbatch.rows());
    for (((name, what, step), (_, _, mb)), (_, _, block)) in rows {
        s.push_str(&format!("{name:<14} {step:>12} {mb:>14} {block:>16}  {what}\n"));
    }
    s
}
