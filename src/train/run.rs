//! A training run from a validated config: data, model, the step loop, and what
//! it leaves in the run directory (metrics.jsonl, summary.json,
//! model.safetensors, config.toml, loss.svg).
//!
//! Everything that can be refused (config, data files, `--init` weights, an
//! output directory holding an earlier run) is checked before the first byte is
//! written, so bad input never costs earlier results.

use super::engine::Engine;
use super::plot::loss_svg;
use crate::bench::gemm_peak;
use crate::config::Config;
use crate::data::{ArithmeticCorpus, EvalSet, Sampler, SamplerKind, TokenFile, TokenSource};
use crate::inspect::CONFIG_METADATA_KEY;
use crate::model::{io, GptConfig};
use crate::optim::LrSchedule;
use crate::rng::{Purpose, Rng};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

pub struct TrainOptions {
    pub out_dir: PathBuf,
    pub init: Option<PathBuf>,
    /// Replace the outputs of an earlier run in `out_dir`.
    pub force: bool,
    /// Show a progress bar (else plain log lines).
    pub progress: bool,
}

#[derive(Serialize, Debug, Clone)]
pub struct StepMetrics {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub ms: f64,
    pub skipped: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact_match: Option<f64>,
}

#[derive(Serialize, Debug, Clone)]
pub struct Summary {
    pub steps: usize,
    pub final_loss: f64,
    pub val_loss: Option<f64>,
    /// Held-out exact-match accuracy (the arithmetic corpus).
    pub exact_match: Option<f64>,
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub train_seconds: f64,
    /// Model FLOPs per second over the measured peak (see peak_gflops).
    pub mfu: f64,
    pub model_gflops: f64,
    pub peak_gflops: f64,
    pub peak_source: String,
    pub skipped_steps: usize,
    pub params: usize,
    pub weights_digest: String,
    pub config_hash: String,
}

/// Training and validation data as the config describes them.
struct Data {
    train: Sampler,
    val: Option<Sampler>,
    eval_set: Option<EvalSet>,
}

/// Held-out problems scored for exact match at each evaluation.
const EVAL_WINDOWS: usize = 256;

fn load_data(cfg: &Config) -> Result<Data> {
    let (t, b, seed) = (cfg.model.block_size, cfg.train.micro_batch_size, cfg.train.seed);
    let kind: SamplerKind = cfg.data.sampler.parse().map_err(|e| anyhow::anyhow!("data.sampler: {e}"))?;
    let vocab = cfg.model.vocab_size;
    match cfg.data.builtin.as_str() {
        "arithmetic" => {
            if vocab < crate::data::arithmetic::VOCAB_SIZE {
                bail!(
                    "model.vocab_size: {vocab}: the arithmetic corpus is bytes and needs at least {}",
                    crate::data::arithmetic::VOCAB_SIZE
                );
            }
            // Enough text that the run never repeats a window.
            let need = cfg.train.steps * cfg.parallel.microbatches * b * t + t + 1;
            let corpus = ArithmeticCorpus::generate(seed, need);
            let train = TokenSource::from_vec("builtin:arithmetic/train", corpus.train, vocab)?;
            let val = TokenSource::from_vec("builtin:arithmetic/val", corpus.val, vocab)?;
            let windows = EVAL_WINDOWS.div_ceil(b) * b;
            Ok(Data {
                train: Sampler::new(kind, train, t, b, seed)?,
                val: Some(Sampler::eval(val, t, b)?),
                eval_set: Some(EvalSet::new(seed, t, windows)?),
            })
        }
        "random" => {
            let n = (cfg.train.steps * cfg.parallel.microbatches * b * t + t + 1).min(1 << 26);
            let mut r = Rng::new(seed, Purpose::Data, &[0xb]);
            let tokens = (0..n).map(|_| r.below(vocab as u64) as u32).collect();
            let train = TokenSource::from_vec("builtin:random", tokens, vocab)?;
            Ok(Data { train: Sampler::new(kind, train, t, b, seed)?, val: None, eval_set: None })
        }
        _ => {
            let train = TokenSource::from(TokenFile::open(Path::new(&cfg.data.train), vocab)?);
            let val = if cfg.data.val.is_empty() {
                None
            } else {
                Some(Sampler::eval(
                    TokenSource::from(TokenFile::open(Path::new(&cfg.data.val), vocab)?),
                    t,
                    b,
                )?)
            };
            Ok(Data { train: Sampler::new(kind, train, t, b, seed)?, val, eval_set: None })
        }
    }
}

/// Outputs of a run; an out dir holding any of them belongs to an earlier run.
const OUTPUTS: [&str; 5] = ["metrics.jsonl", "summary.json", "model.safetensors", "config.toml", "loss.svg"];

pub fn train(cfg: &Config, opts: &TrainOptions) -> Result<Summary> {
    cfg.validate()?;
    let gpt = GptConfig::from_config(cfg);
    let mut data = load_data(cfg)?;
    let init = match &opts.init {
        Some(p) => {
            let w = io::load(p)?;
            w.check(&gpt)?;
            Some(w)
        }
        None => None,
    };
    if !opts.force {
        for f in OUTPUTS {
            let p = opts.out_dir.join(f);
            if p.exists() {
                bail!(
                    "{}: an earlier run's output is there; choose another --out or pass --force to replace it",
                    p.display()
                );
            }
        }
    }
    std::fs::create_dir_all(&opts.out_dir)
        .with_context(|| format!("{}: cannot create", opts.out_dir.display()))?;

    let mut engine = Engine::new(cfg);
    // The machine's f32 matrix-product rate, the yardstick for MFU; measured
    // before and after training and the better figure kept.
    let peak_before = gemm_peak(engine.pool.current_num_threads());
    if let Some(w) = &init {
        w.assign(&mut engine.part)?;
    }
    let sched = LrSchedule::from_config(cfg);
    let steps = cfg.train.steps;
    let (m, b) = (cfg.parallel.microbatches, cfg.train.micro_batch_size);
    let tokens_per_step = engine.tokens_per_step() as u64;

    let metrics_path = opts.out_dir.join("metrics.jsonl");
    let mut metrics = std::io::BufWriter::new(
        std::fs::File::create(&metrics_path)
            .with_context(|| format!("{}: cannot create", metrics_path.display()))?,
    );
    let bar = Progress::new(steps, opts.progress);
    let mut train_curve = Vec::with_capacity(steps);
    let mut val_curve = Vec::new();
    let (mut last_val, mut last_em) = (None, None);
    let mut skipped = 0;
    let mut train_secs = 0.0;
    let mut final_loss = f64::NAN;
    for step in 0..steps {
        let t0 = Instant::now();
        let lr = sched.lr(step);
        let sampler = &mut data.train;
        let stats = engine.step(lr, |mb, inp, tgt| {
            sampler.fill(((step * m + mb) * b) as u64, inp, tgt);
        });
        let dt = t0.elapsed().as_secs_f64();
        train_secs += dt;
        skipped += stats.skipped as usize;
        final_loss = stats.loss;
        train_curve.push((step + 1, stats.loss));
        let done = step + 1;
        let eval_now = (cfg.train.eval_every > 0 && done % cfg.train.eval_every == 0) || done == steps;
        let (mut val_loss, mut em) = (None, None);
        if eval_now {
            (val_loss, em) = evaluate(&mut engine, &mut data, cfg.train.eval_batches);
            if let Some(v) = val_loss {
                val_curve.push((done, v));
                last_val = Some(v);
            }
            last_em = em.or(last_em);
        }
        let tokens = done as u64 * tokens_per_step;
        let rec = StepMetrics {
            step: done,
            loss: stats.loss,
            lr,
            grad_norm: stats.grad_norm,
            tokens,
            tokens_per_s: tokens as f64 / train_secs,
            ms: dt * 1e3,
            skipped: stats.skipped,
            val_loss,
            exact_match: em,
        };
        serde_json::to_writer(&mut metrics, &rec)?;
        metrics.write_all(b"\n")?;
        metrics.flush()?;
        bar.update(&rec);
    }
    bar.finish();

    let tokens = steps as u64 * tokens_per_step;
    let tokens_per_s = tokens as f64 / train_secs.max(1e-9);
    let threads = engine.pool.current_num_threads();
    let peak = gemm_peak(threads).max(peak_before);
    let model_gflops = tokens_per_s * gpt.flops_per_token() / 1e9;
    let digest = io::weights_digest(&[&engine.part]);
    let summary = Summary {
        steps,
        final_loss,
        val_loss: last_val,
        exact_match: last_em,
        tokens,
        tokens_per_s,
        train_seconds: train_secs,
        mfu: model_gflops / peak,
        model_gflops,
        peak_gflops: peak,
        peak_source: format!("measured: best 1024x1024x1024 f32 gemm on the run's {threads} threads"),
        skipped_steps: skipped,
        params: gpt.num_params(),
        weights_digest: digest,
        config_hash: cfg.hash(),
    };

    let mut meta = HashMap::new();
    meta.insert(CONFIG_METADATA_KEY.to_string(), cfg.to_toml_string());
    meta.insert("format".to_string(), "pt".to_string());
    io::save(&opts.out_dir.join("model.safetensors"), &io::gather(&[&engine.part]), meta)?;
    let write = |name: &str, text: &str| -> Result<()> {
        let p = opts.out_dir.join(name);
        io::write_atomic(&p, text.as_bytes()).with_context(|| format!("{}: cannot write", p.display()))
    };
    write("config.toml", &cfg.to_toml_string())?;
    write("summary.json", &serde_json::to_string_pretty(&summary)?)?;
    write("loss.svg", &loss_svg(&train_curve, &val_curve, "pipewright: loss"))?;
    Ok(summary)
}

/// Validation loss over `batches` microbatches from the start of the val data,
/// and exact-match accuracy on the held-out problems when there are any.
fn evaluate(engine: &mut Engine, data: &mut Data, batches: usize) -> (Option<f64>, Option<f64>) {
    let val_loss = data.val.as_mut().map(|val| {
        let b = val.micro_batch_size() as u64;
        let batches = batches.min((val.n_windows() / b).max(1) as usize);
        engine.evaluate(batches, |mb, inp, tgt| val.fill(mb as u64 * b, inp, tgt), None)
    });
    let em = data.eval_set.as_ref().map(|set| {
        let n = engine.tokens_per_step() / engine.microbatches;
        let batches = set.inputs().len() / n;
        let mut preds = Vec::with_capacity(set.inputs().len());
        engine.evaluate(
            batches,
            |mb, inp, tgt| {
                inp.copy_from_slice(&set.inputs()[mb * n..(mb + 1) * n]);
                tgt.copy_from_slice(&set.targets()[mb * n..(mb + 1) * n]);
            },
            Some(&mut preds),
        );
        let (correct, total) = set.exact_match(&preds);
        correct as f64 / total.max(1) as f64
    });
    (val_loss, em)
}

/// A progress bar on a terminal, plain log lines otherwise.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    steps: usize,
    every: usize,
}

impl Progress {
    pub fn new(steps: usize, enabled: bool) -> Self {
        let bar = (enabled && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new(steps as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:30.cyan/blue} step {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
                )
                .expect("valid template"),
            );
            b
        });
        Progress { bar, steps, every: (steps / 20).max(1) }
    }

    pub fn update(&self, m: &StepMetrics) {
        let mut msg = format!("loss {:.4} | {:.0} tok/s", m.loss, m.tokens_per_s);
        if let Some(v) = m.val_loss {
            msg += &format!(" | val {v:.4}");
        }
        if let Some(e) = m.exact_match {
            msg += &format!(" | exact {:.1}%", 100.0 * e);
        }
        match &self.bar {
            Some(b) => {
                b.set_position(m.step as u64);
                b.set_message(msg);
            }
            None => {
                if m.step % self.every == 0 || m.step == self.steps || m.val_loss.is_some() {
                    let eta = (self.steps - m.step) as f64 * m.tokens as f64 / m.tokens_per_s / m.step as f64;
                    eprintln!("step {:>6}/{} {msg} | lr {:.2e} | eta {:.0}s", m.step, self.steps, m.lr, eta);
                }
            }
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}
