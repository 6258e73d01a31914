//! A training run from a validated config: data, model, the step loop, and what
//! it leaves in the run directory (metrics.jsonl, summary.json, the family's
//! Hugging Face files — model.safetensors, or shards and their index, and
//! config.json —, the data's tokenizer.json, config.toml, loss.svg).
//!
//! Everything that can be refused (config, data files, `--init` weights, an
//! output directory holding an earlier run) is checked before the first byte is
//! written, so bad input never costs earlier results.

use super::plot::loss_svg;
use crate::actors::coordinator::RunData;
use crate::actors::{Layout, RunInputs, RunOutcome};
use crate::config::{BackendKind, Builtin, Config, Dtype};
use crate::data::{ArithmeticCorpus, EvalSet, RandomText, Sampler, TokenSource, TrainText, RANDOM_TOKENS};
use crate::host::signals::{self, StoppedBeforeStart};
use crate::metrics::{gemm_peak, StepMetrics};
use crate::model::io::{self, CONFIG_METADATA_KEY};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub struct TrainOptions {
    pub out_dir: PathBuf,
    pub init: Option<PathBuf>,
    /// Replace the outputs of an earlier run in `out_dir`.
    pub force: bool,
    /// Show a progress bar (else plain log lines).
    pub progress: bool,
    /// Continue the run in `out_dir` from its latest complete checkpoint.
    pub resume: bool,
}

#[derive(Serialize, Debug, Clone)]
pub struct Summary {
    pub steps: usize,
    pub final_loss: f64,
    pub val_loss: Option<f64>,
    /// The step at which `val_loss` was measured (the last evaluation).
    pub val_loss_step: Option<usize>,
    /// Held-out exact-match accuracy (the arithmetic corpus).
    pub exact_match: Option<f64>,
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub train_seconds: f64,
    /// CPU: model FLOP/s over the gemm rate measured on the run's threads
    /// (peak_gflops). A share of what this machine's gemm reaches, not an MFU,
    /// so it is not called one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemm_util: Option<f64>,
    /// CUDA: model FLOP/s over the GPUs' bf16 dense datasheet peak (peak_gflops).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    pub model_gflops: f64,
    pub peak_gflops: f64,
    pub peak_source: String,
    pub skipped_steps: usize,
    pub params: usize,
    pub weights_digest: String,
    /// `optim.ema_decay`: the digest of the EMA of the weights (as
    /// `weights_digest`) and its val loss, measured at the end of the run
    /// on the run's val data.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ema_weights_digest: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ema_val_loss: Option<f64>,
    pub config_hash: String,
    /// The checkpoint step this run resumed from.
    pub resumed_from: Option<u64>,
    /// Stopped by SIGINT/SIGTERM (after saving a checkpoint).
    pub stopped_early: bool,
    /// Mean time training paused while stages copied their state for a checkpoint.
    pub checkpoint_pause_ms: Option<f64>,
    /// Mean time to write a checkpoint in the background.
    pub checkpoint_write_ms: Option<f64>,
    /// The same two as medians, over `checkpoints_written` checkpoints.
    pub checkpoint_pause_ms_median: Option<f64>,
    pub checkpoint_write_ms_median: Option<f64>,
    pub checkpoints_written: usize,
    /// Rollbacks to a checkpoint after `recovery.max_skips` skipped steps in a row.
    pub rollbacks: usize,
    /// Per pipeline rank (replica 0): the most activation bytes its stages held
    /// at once for microbatches awaiting backward.
    pub peak_activation_bytes: Vec<usize>,
    /// Per pipeline rank, the most bytes of weights, gradients and AdamW
    /// state one replica held at once (CPU backend; ZeRO shares them out).
    #[serde(default)]
    pub peak_state_bytes: Vec<usize>,
    /// The process's resident-memory high-water mark (Linux's VmHWM), bytes.
    pub peak_rss_bytes: Option<u64>,
    /// Runs whose stages' tp ranks span processes: the tensor bytes rank 0's
    /// tp frames carried (commands, all-reduce nodes, gradient answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp_traffic: Option<crate::cluster::tp::TpTraffic>,
}

/// The process's resident-memory high-water mark, where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// A run that started and then failed (an actor's error or panic), as opposed
/// to input refused before anything ran: the kind `--max-restarts` retries.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RunFailed(pub String);

/// `--resume` of a run that already reached its `train.steps`: nothing was
/// run, written or changed.
#[derive(Debug, thiserror::Error)]
#[error(
    "{}: this run is finished (step {steps} of train.steps = {steps}); nothing was run or changed. \
     To train further, resume to more steps (--steps N, N > {steps}{})",
    .dir.display(),
    if *.checkpointed { "" } else { ", which needs a checkpoint: this run saved none" }
)]
pub struct AlreadyFinished {
    pub dir: PathBuf,
    pub steps: usize,
    pub checkpointed: bool,
}

/// What summary.json says of the run that wrote it: its steps, and whether
/// it ended on its own (not stopped by a signal). None: no summary (the run
/// never ended), or one that cannot be read.
fn finished_steps(dir: &Path) -> Option<(usize, bool)> {
    let path = dir.join("summary.json");
    let text = crate::fsutil::read_regular_to_string(&path, 1 << 20, "a summary may hold").ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let steps = usize::try_from(v.get("steps")?.as_u64()?).ok()?;
    let stopped = v.get("stopped_early").and_then(serde_json::Value::as_bool).unwrap_or(false);
    Some((steps, !stopped))
}

/// Before a resume touches `dir`: a run that reached `cfg.train.steps` is
/// left as it is (a resume at its last step would run nothing and rewrite
/// its summary with no timing and no held-out score), and a finished run
/// with no checkpoint is not retrained from step 0 over its outputs.
fn check_resumable(dir: &Path, cfg: &Config) -> Result<()> {
    let Some((steps, ended)) = finished_steps(dir) else { return Ok(()) };
    let root = crate::checkpoint::checkpoints_dir(dir);
    let checkpointed = crate::checkpoint::list(&root).is_ok_and(|(done, _)| !done.is_empty());
    if ended && steps >= cfg.train.steps {
        return Err(AlreadyFinished { dir: dir.to_path_buf(), steps, checkpointed }.into());
    }
    if !checkpointed {
        bail!(
            "{}: holds the outputs of a run that ended at step {steps} and no checkpoint to continue \
             from (none was written, or they were removed); --resume would retrain from step 0 over them. Pass --force \
             without --resume to replace them, or choose another --out",
            dir.display()
        );
    }
    Ok(())
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn median(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| crate::trace::summary::median(v.to_vec()))
}

/// Metrics lines of steps ≤ `upto` from an earlier run's metrics.jsonl.
fn prior_metrics(path: &Path, upto: usize) -> Result<Vec<StepMetrics>> {
    // Absent is a run that never logged; anything else unreadable is named.
    let cap = crate::fsutil::memory_cap();
    let read = crate::fsutil::read_optional_to_string(path, cap, "this machine's memory holds");
    let Some(text) =
        read.with_context(|| format!("{}: cannot read the earlier run's metrics", path.display()))?
    else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let m: StepMetrics = match serde_json::from_str(line) {
            Ok(m) => m,
            // A line cut short by a crash can only be the last one.
            Err(_) if i + 1 == text.lines().count() => break,
            Err(e) => bail!("{}: line {}: {e}", path.display(), i + 1),
        };
        if m.step <= upto {
            out.push(m);
        }
    }
    Ok(out)
}

/// Training and validation data as the config describes them.
pub struct Sources {
    pub train: Arc<TokenSource>,
    pub val: Option<Arc<TokenSource>>,
    pub eval_set: Option<Arc<EvalSet>>,
    /// `[[data.sources]]`: the weighted sources `train` is the first of.
    pub mixture: Option<Arc<crate::data::mixture::Mixture>>,
}

/// Held-out problems scored for exact match at each evaluation.
const EVAL_WINDOWS: usize = 256;

pub fn load_sources(cfg: &Config) -> Result<Sources> {
    let (t, b, seed) = (cfg.model.block_size, cfg.train.micro_batch_size, cfg.train.seed);
    let vocab = cfg.model.vocab_size;
    match cfg.data.builtin {
        Builtin::Arithmetic => {
            if vocab < crate::data::arithmetic::VOCAB_SIZE {
                bail!(
                    "model.vocab_size: {vocab}: the arithmetic corpus is bytes and needs at least {}",
                    crate::data::arithmetic::VOCAB_SIZE
                );
            }
            // Neither text depends on train.steps: training windows are
            // generated by position from a text of fixed length, and the
            // held-out text is sized by what evaluation reads, so runs of any
            // length (and a run resumed to more steps) read the same tokens.
            let val_tokens = cfg.train.eval_batches * b * t + t + 1;
            let corpus = ArithmeticCorpus::generate(seed, 0, val_tokens);
            let train = TokenSource::Arithmetic {
                name: "builtin:arithmetic/train".into(),
                text: TrainText::new(seed),
            };
            let val = TokenSource::from_vec("builtin:arithmetic/val", corpus.val, vocab)?;
            let windows = EVAL_WINDOWS.div_ceil(b) * b;
            Ok(Sources {
                train: Arc::new(train),
                val: Some(Arc::new(val)),
                eval_set: Some(Arc::new(EvalSet::new(seed, t, windows)?)),
                mixture: None,
            })
        }
        Builtin::Random => {
            // A fixed length, never train.steps: see the arithmetic text.
            let text = RandomText { seed, vocab_size: vocab, len: RANDOM_TOKENS };
            Ok(Sources {
                train: Arc::new(TokenSource::Random(text)),
                val: None,
                eval_set: None,
                mixture: None,
            })
        }
        Builtin::Files => {
            // A token file, or a prepared dataset's folder (its train or val shards).
            let open = |p: &str, split| crate::data::mixture::open_source(p, split, vocab, cfg.data.format);
            let val =
                if cfg.data.val.is_empty() { None } else { Some(Arc::new(open(&cfg.data.val, "val")?)) };
            if !cfg.data.sources.is_empty() {
                let m = crate::data::mixture::Mixture::open(&cfg.data.sources, vocab, cfg.data.format)?;
                return Ok(Sources {
                    train: m.sources[0].clone(),
                    val,
                    eval_set: None,
                    mixture: Some(Arc::new(m)),
                });
            }
            let train = open(&cfg.data.train, "train")?;
            Ok(Sources { train: Arc::new(train), val, eval_set: None, mixture: None })
        }
    }
}

impl Sources {
    /// Samplers for one data-parallel replica (each samples by global sequence number).
    pub fn replica_data(&self, cfg: &Config) -> Result<RunData> {
        let (t, b, seed) = (cfg.model.block_size, cfg.train.micro_batch_size, cfg.train.seed);
        let kind = cfg.data.sampler;
        let val = match &self.val {
            Some(v) => {
                let s = Sampler::eval(v.clone(), t, b)?;
                if (s.n_windows() as usize) < b {
                    bail!("{}: too short for one validation microbatch of {b} windows", v.name());
                }
                Some(s)
            }
            None => None,
        };
        let train = match &self.mixture {
            Some(m) => Sampler::mixture(kind, m, t, b, seed)?,
            None => Sampler::new(kind, self.train.clone(), t, b, seed)?,
        };
        Ok(RunData { train, val, eval_set: self.eval_set.clone() })
    }
}

/// Outputs of a run; an out dir holding any of them belongs to an earlier run.
const OUTPUTS: [&str; 10] = [
    "metrics.jsonl",
    "tokenizer.json",
    "tokenizer_config.json",
    "summary.json",
    "model.safetensors",
    "config.toml",
    "config.json",
    "loss.svg",
    "trace.json",
    "replay",
];

/// Sets the config field at `path` to the value the run will use, saying so
/// when it differs from the one given.
fn resolve(field: &mut usize, path: &str, value: usize, why: &str) {
    if *field != value {
        tracing::info!("{path}: {} → {value} ({why}); config.toml records {value}", *field);
        *field = value;
    }
}

/// `--force`, once every input has been accepted: removes what an earlier run
/// wrote into `dir` (and only that), so a run that fails midway never leaves its
/// partial outputs beside the earlier run's final ones.
fn remove_earlier_outputs(dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    for entry in entries {
        let entry = entry.with_context(|| format!("{}: cannot list", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let p = entry.path();
        let ours = OUTPUTS.contains(&name.as_str())
            || is_weights_file(&name)
            || p == crate::checkpoint::checkpoints_dir(dir)
            || name.starts_with("replay.before-step-");
        if !ours {
            continue;
        }
        let removed = if entry.file_type().is_ok_and(|t| t.is_dir()) {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        };
        removed
            .with_context(|| format!("{}: cannot remove an earlier run's output (--force)", p.display()))?;
    }
    Ok(())
}

/// Runs training on the actor runtime; `chaos_seed` scrambles message delivery (tests).
pub fn train(cfg: &Config, opts: &TrainOptions) -> Result<Summary> {
    train_with(cfg, opts, None).map(|(s, _)| s)
}

pub fn train_with(
    cfg: &Config,
    opts: &TrainOptions,
    chaos_seed: Option<u64>,
) -> Result<(Summary, RunOutcome)> {
    train_on(cfg, opts, chaos_seed, None)
}

/// `train_with`, on rank 0 of a run that spans processes when `cluster` is set:
/// the workers get the resolved config just before the step loop starts.
pub fn train_on(
    cfg: &Config,
    opts: &TrainOptions,
    chaos_seed: Option<u64>,
    cluster: Option<&mut crate::cluster::Driver>,
) -> Result<(Summary, RunOutcome)> {
    cfg.validate()?;
    crate::limits::check(cfg)?;
    let gpus = crate::model::gpu::check_backend(cfg.backend.kind, &cfg.backend.devices)?;
    let gpt = cfg.arch();
    let layout = Layout::from_config(cfg)?;
    let sources = load_sources(cfg)?;
    let cfg = &resolved_config(cfg, &layout, &sources);
    let data = (0..layout.dp).map(|_| sources.replica_data(cfg)).collect::<Result<Vec<_>>>()?;
    let init = load_init(opts.init.as_deref(), &gpt)?;
    // A resume sets damaged checkpoints aside: the directory is this process's from here on.
    // Before the lock, which rewrites its file: a finished run is left byte for
    // byte as it was. Only reads; a live run continuing to more steps has
    // fewer in its summary than it was asked for, and is met by the lock.
    if opts.resume {
        check_resumable(&opts.out_dir, cfg)?;
    }
    let mut run_lock = if opts.resume { Some(super::lock::lock(&opts.out_dir)?) } else { None };
    let resume = if opts.resume { super::resume::find_resume_point(&opts.out_dir, cfg)? } else { None };
    let threads = layout.threads_per_rank * layout.pp * layout.dp;
    // The machine's f32 matrix-product rate, the yardstick for gemm_util; measured
    // before and after training and the better figure kept.
    let on_cpu = cfg.backend.kind == BackendKind::Cpu;
    let peak_before = if on_cpu { gemm_peak(threads) } else { 0.0 };
    // Start-up ends here: a signal until now leaves nothing to save or undo.
    signals::end_start_up();
    if signals::requested() {
        return Err(StoppedBeforeStart(opts.out_dir.clone()).into());
    }
    // Before anything in the directory is looked at for replacing: a second
    // process must not remove what a live run is writing.
    let _run_lock = match run_lock.take() {
        Some(l) => l,
        None => super::lock::lock(&opts.out_dir)?,
    };
    prepare_run_dir(opts, resume.as_ref())?;
    let metrics_path = opts.out_dir.join("metrics.jsonl");
    let prior = Prior::keep(&metrics_path, resume.as_ref())?;
    // At the start, not the end: a run that dies before it finishes still
    // leaves the config it ran with, so `--resume DIR` needs none of its flags.
    // Every refusal is behind us, so an earlier run's copy is replaced only
    // by the config of the run that now continues it.
    let config_path = opts.out_dir.join("config.toml");
    io::write_atomic(&config_path, cfg.to_toml_string().as_bytes())
        .with_context(|| format!("{}: cannot write", config_path.display()))?;
    let metrics = std::io::BufWriter::new(
        std::fs::OpenOptions::new()
            .append(true)
            .open(&metrics_path)
            .with_context(|| format!("{}: cannot open", metrics_path.display()))?,
    );
    let trace_meta = trace_metadata(cfg, &layout, threads);
    let fabric = match cluster {
        Some(d) => Some(d.start(
            cfg,
            &opts.out_dir,
            resume.as_ref().map(|r| r.dir.as_path()),
            opts.init.as_deref(),
        )?),
        None => None,
    };
    let cluster_fabric = fabric.clone();
    let inputs = RunInputs {
        cluster: fabric.map(|f| f as Arc<dyn crate::actors::processes::Processes>),
        run_dir: opts.out_dir.clone(),
        resume: resume.map(Arc::new),
        cfg: cfg.clone(),
        layout,
        data,
        init,
        metrics: Some(metrics),
        progress: opts.progress,
        chaos_seed,
    };
    let rt = runtime()?;
    let result = rt.block_on(crate::actors::run(inputs));
    // Some actors close their replay logs after the run's result is known.
    if cfg.replay.record && !crate::replay::wait_closed(&opts.out_dir, std::time::Duration::from_secs(30)) {
        tracing::warn!(
            "warning: replay logs in {} still open after 30 s",
            crate::replay::replay_dir(&opts.out_dir).display()
        );
    }
    if result.is_err() {
        // What did not stop after a failure (the error names it, see
        // recovery.shutdown_timeout_s) must not hold the process.
        rt.shutdown_background();
    }
    let mut out = result.map_err(|e| RunFailed(format!("{e:#}")))?;
    if out.stopped_early {
        tracing::info!(
            "stopped by a signal after step {}; resume with --resume {}",
            out.steps_done,
            opts.out_dir.display()
        );
    }
    let curves = prior.curves_with(&mut out);
    let peak = flops_peak(cfg, threads, peak_before, &gpus);
    let tensors = io::gather_params(&out.params);
    let ema = (!out.ema_params.is_empty()).then(|| io::gather_params(&out.ema_params));
    let tp_traffic = cluster_fabric.as_ref().and_then(|f| f.tp_inboxes.traffic());
    let mut summary = summarize(cfg, &out, &curves, &prior, peak, &tensors, tp_traffic);
    if let Some(ema) = &ema {
        summary.ema_weights_digest = Some(io::digest_of(ema));
        // At the end, outside the actors: evaluating inside the run would
        // need every stage to swap its (sharded) EMA in and out.
        if let Some(val) = &sources.val {
            let loss = super::eval::eval_tensors(cfg, ema, val.clone())?;
            tracing::info!(
                "EMA of the weights (optim.ema_decay = {}): val loss {loss:.4}{}",
                cfg.optim.ema_decay,
                summary.val_loss.map_or(String::new(), |v| format!(" (the weights': {v:.4})"))
            );
            summary.ema_val_loss = Some(loss);
        }
    }
    write_outputs(&opts.out_dir, cfg, &tensors, ema.as_ref(), &summary, &curves)?;
    if cfg.trace.enabled {
        let mut meta = trace_meta;
        if let Some(f) = &cluster_fabric {
            meta["clock_alignment"] = serde_json::to_value(f.clock_estimates())?;
        }
        let json = crate::trace::chrome_json(&out.trace, meta);
        write_text(&opts.out_dir, "trace.json", &serde_json::to_string(&json)?)?;
    }
    Ok((summary, out))
}

/// [`train_on`], resumed from the run's latest checkpoint each time it fails
/// after starting ([`RunFailed`]), up to `max_restarts` times
/// (`--max-restarts`); a restart never starts from `--init` weights again.
/// Any other error (refused input, [`StoppedBeforeStart`],
/// [`AlreadyFinished`]) ends it at once.
pub fn train_restarting(
    cfg: &Config,
    mut opts: TrainOptions,
    chaos_seed: Option<u64>,
    mut cluster: Option<&mut crate::cluster::Driver>,
    max_restarts: usize,
) -> Result<(Summary, RunOutcome)> {
    let mut restarts = 0;
    loop {
        match train_on(cfg, &opts, chaos_seed, cluster.as_deref_mut()) {
            Err(e) if restarts < max_restarts && e.downcast_ref::<RunFailed>().is_some() => {
                restarts += 1;
                tracing::warn!("error: {e:#}");
                tracing::warn!("restarting from the latest checkpoint ({restarts} of {max_restarts})");
                opts.resume = true;
                opts.init = None;
            }
            result => return result,
        }
    }
}

/// The config as the run will use it. Values the run decides are written
/// back into it, so config.toml (and the copies in checkpoints, replay logs
/// and the weights) is the config that ran: reloaded, it gives the same
/// layout and the same run.
fn resolved_config(cfg: &Config, layout: &Layout, sources: &Sources) -> Config {
    let mut cfg = cfg.clone();
    let why = if cfg.parallel.schedule.v_shaped() {
        "ZB-V and DualPipeV run each rank's two model chunks as a V"
    } else {
        "interleaved 1F1B needs at least 2 chunks per rank"
    };
    resolve(&mut cfg.parallel.chunks, "parallel.chunks", layout.chunks, why);
    // The split that ran, even when it was the default: a reload of
    // config.toml then builds the same stages whatever the default becomes.
    cfg.parallel.layers_per_stage = layout.stages.iter().map(|s| s.layers.len()).collect();
    if cfg.backend.kind == BackendKind::Cpu {
        // The CPU backend computes in f32 whatever backend.dtype (a CUDA
        // setting) says: config.toml records what ran.
        cfg.backend.dtype = Dtype::F32;
    }
    if let Some(v) = &sources.val {
        let windows = (v.len().saturating_sub(1) / cfg.model.block_size) / cfg.train.micro_batch_size;
        let held = cfg.train.eval_batches.min(windows.max(1));
        let why = format!("all that {} holds", v.name());
        resolve(&mut cfg.train.eval_batches, "train.eval_batches", held, &why);
    }
    cfg
}

/// The `--init` weights, checked to fit the model and to be finite.
fn load_init(path: Option<&Path>, gpt: &crate::model::Arch) -> Result<Option<Arc<io::LoadedWeights>>> {
    let Some(p) = path else { return Ok(None) };
    let w = io::load_for(p, gpt)?;
    super::finite::check_finite(&w, "--init")?;
    Ok(Some(Arc::new(w)))
}

/// Makes the run directory ready for this run's outputs: an earlier run's
/// outputs refused (or, with `--force`, removed), the directory created, and
/// replay logs that are not this config's moved aside (a resume keeps the
/// logs of the run before it, under their own name) or removed.
fn prepare_run_dir(opts: &TrainOptions, resume: Option<&crate::checkpoint::Loaded>) -> Result<()> {
    if !opts.force && !opts.resume {
        // Above 5 GB a run's weights are shards and their index.
        let shards = std::fs::read_dir(&opts.out_dir).into_iter().flatten().flatten().map(|e| e.file_name());
        let shards = shards.filter(|n| is_weights_file(&n.to_string_lossy()));
        let earlier = OUTPUTS.iter().map(std::ffi::OsString::from).chain(shards);
        for f in earlier {
            let p = opts.out_dir.join(f);
            if p.exists() {
                bail!(
                    "{}: an earlier run's output is there; choose another --out or pass --force to replace it",
                    p.display()
                );
            }
        }
    }
    if opts.force && !opts.resume {
        remove_earlier_outputs(&opts.out_dir)?;
    }
    std::fs::create_dir_all(&opts.out_dir)
        .with_context(|| format!("{}: cannot create", opts.out_dir.display()))?;
    let replay_dir = crate::replay::replay_dir(&opts.out_dir);
    // Also when this part does not record: `replay/` must hold only logs of
    // the config that config.toml (rewritten below) names.
    if replay_dir.exists() {
        if let Some(r) = resume {
            // The logs of the run before this resume stay, under their own name.
            let mut kept = opts.out_dir.join(format!("replay.before-step-{}", r.state.step));
            let mut n = 1;
            while kept.exists() {
                n += 1;
                kept = opts.out_dir.join(format!("replay.before-step-{}.{n}", r.state.step));
            }
            std::fs::rename(&replay_dir, &kept).with_context(|| {
                format!("{}: cannot move aside to {}", replay_dir.display(), kept.display())
            })?;
        } else {
            std::fs::remove_dir_all(&replay_dir)
                .with_context(|| format!("{}: cannot replace (--force)", replay_dir.display()))?;
        }
    }
    Ok(())
}

/// The run's weights by name, as they are saved and digested.
type Tensors<'a> = BTreeMap<String, (&'a [usize], &'a [f32])>;

/// What a resumed run continues: the metrics of the steps up to its
/// checkpoint, the steps it skipped and the tokens it saw (none for a run
/// from step 0).
struct Prior {
    metrics: Vec<StepMetrics>,
    resumed_from: Option<u64>,
    skipped: usize,
    tokens: u64,
}

/// A run's loss curves as (step, loss), resumed or not.
struct Curves {
    train: Vec<(usize, f64)>,
    val: Vec<(usize, f64)>,
}

impl Prior {
    /// What the run resumed from `resume` continues, and metrics.jsonl
    /// at `metrics_path` rewritten to hold only that: on resume, the metrics
    /// of steps up to the checkpoint stay and later ones (from the
    /// interrupted run, past its last checkpoint) are dropped.
    fn keep(metrics_path: &Path, resume: Option<&crate::checkpoint::Loaded>) -> Result<Prior> {
        let start = resume.map_or(0, |r| r.state.step as usize);
        let metrics = if resume.is_some() { prior_metrics(metrics_path, start)? } else { Vec::new() };
        let mut kept = String::new();
        for m in &metrics {
            kept += &serde_json::to_string(m)?;
            kept.push('\n');
        }
        io::write_atomic(metrics_path, kept.as_bytes())
            .with_context(|| format!("{}: cannot write", metrics_path.display()))?;
        Ok(Prior {
            metrics,
            resumed_from: resume.map(|r| r.state.step),
            skipped: resume.map_or(0, |r| r.state.skipped_steps),
            // A resume at the last step runs no step and counts no token of its own.
            tokens: resume.map_or(0, |r| r.state.tokens),
        })
    }

    /// Curves and counts over the whole run, resumed or not: this run's
    /// outcome `out` takes the earlier run's last validation loss (when it
    /// measured none of its own) and skipped steps too.
    fn curves_with(&self, out: &mut RunOutcome) -> Curves {
        let mut train: Vec<(usize, f64)> = self.metrics.iter().map(|m| (m.step, m.loss)).collect();
        train.extend(out.train_curve.iter().copied());
        let mut val: Vec<(usize, f64)> =
            self.metrics.iter().filter_map(|m| m.val_loss.map(|v| (m.step, v))).collect();
        val.extend(out.val_curve.iter().copied());
        out.last_val = out.last_val.or(val.last().map(|v| v.1));
        out.skipped += self.skipped;
        Curves { train, val }
    }
}

/// What trace.json's metadata says of the run's layout and machine.
fn trace_metadata(cfg: &Config, layout: &Layout, threads: usize) -> serde_json::Value {
    serde_json::json!({
        "schedule": cfg.parallel.schedule,
        "pp": layout.pp,
        "dp": layout.dp,
        "chunks": layout.chunks,
        "microbatches": layout.microbatches,
        "steps": cfg.train.steps,
        "stages": layout.n_stages(),
        "backend": cfg.backend.kind,
        // Ranks outnumbering cores make every measured cost a time-shared one.
        "cores": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "compute_threads": threads,
    })
}

/// The rate the model's FLOP/s are measured against, GFLOP/s, and where it
/// comes from: on the CPU the better of the gemm rates measured before
/// (`before`) and after training on the run's threads; on GPUs their
/// datasheet peak.
fn flops_peak(cfg: &Config, threads: usize, before: f64, gpus: &[String]) -> (f64, String) {
    match cfg.backend.kind {
        BackendKind::Cpu => (
            gemm_peak(threads).max(before),
            format!("measured: best 1024x1024x1024 f32 gemm on the run's {threads} threads"),
        ),
        BackendKind::Cuda => {
            let (flops, source) = crate::plan::hardware::gpu_peak_flops(gpus);
            (flops / 1e9, source)
        }
        _ => (f64::NAN, "sim backend: nothing is computed".to_string()),
    }
}

/// summary.json's figures for the run that gave `out`.
fn summarize(
    cfg: &Config,
    out: &RunOutcome,
    curves: &Curves,
    prior: &Prior,
    (peak, peak_source): (f64, String),
    tensors: &Tensors<'_>,
    tp_traffic: Option<crate::cluster::tp::TpTraffic>,
) -> Summary {
    let gpt = cfg.arch();
    let on_cpu = cfg.backend.kind == BackendKind::Cpu;
    let simulated = cfg.backend.kind == BackendKind::Sim;
    let tokens_per_s = out.tokens_this_run as f64 / out.train_seconds.max(1e-9);
    let model_gflops = tokens_per_s * gpt.flops_per_token() / 1e9;
    Summary {
        steps: out.steps_done as usize,
        final_loss: curves.train.last().map_or(f64::NAN, |l| l.1),
        val_loss: out.last_val,
        val_loss_step: curves.val.last().map(|v| v.0),
        exact_match: out.last_exact_match,
        tokens: out.tokens.max(prior.tokens),
        tokens_per_s,
        train_seconds: out.train_seconds,
        gemm_util: on_cpu.then_some(model_gflops / peak),
        // None on a GPU without a known datasheet peak (an emulated one): an
        // MFU of NaN% said nothing.
        mfu: (!on_cpu && !simulated && peak.is_finite()).then_some(model_gflops / peak),
        model_gflops,
        peak_gflops: peak,
        peak_source,
        skipped_steps: out.skipped,
        params: gpt.num_params(),
        weights_digest: io::digest_of(tensors),
        ema_weights_digest: None,
        ema_val_loss: None,
        config_hash: cfg.hash(),
        resumed_from: prior.resumed_from,
        stopped_early: out.stopped_early,
        checkpoint_pause_ms: mean(&out.checkpoint_pause_ms),
        checkpoint_write_ms: mean(&out.checkpoint_write_ms),
        checkpoint_pause_ms_median: median(&out.checkpoint_pause_ms),
        checkpoint_write_ms_median: median(&out.checkpoint_write_ms),
        checkpoints_written: out.checkpoint_write_ms.len(),
        rollbacks: out.rollbacks,
        peak_activation_bytes: out.peak_live_bytes.clone(),
        peak_state_bytes: out.peak_state_bytes.clone(),
        peak_rss_bytes: peak_rss_bytes(),
        tp_traffic,
    }
}

/// Removes the files of an EMA of the weights from `dir`.
fn remove_ema_files(dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    for e in entries.flatten() {
        if io::is_model_file_of(io::EMA_STEM, &e.file_name().to_string_lossy()) {
            let p = e.path();
            std::fs::remove_file(&p).with_context(|| format!("{}: cannot remove", p.display()))?;
        }
    }
    Ok(())
}

/// A run's weight files: the model's and its EMA's.
fn is_weights_file(name: &str) -> bool {
    io::is_model_file(name) || io::is_model_file_of(io::EMA_STEM, name)
}

/// Writes `text` to `name` in `dir`, atomically.
fn write_text(dir: &Path, name: &str, text: &str) -> Result<()> {
    let p = dir.join(name);
    io::write_atomic(&p, text.as_bytes()).with_context(|| format!("{}: cannot write", p.display()))
}

/// The run's outputs in `dir` but its trace: the weights and their
/// config.json (not for the simulated backend, which computes none),
/// summary.json and loss.svg.
fn write_outputs(
    dir: &Path,
    cfg: &Config,
    tensors: &Tensors<'_>,
    ema: Option<&Tensors<'_>>,
    summary: &Summary,
    curves: &Curves,
) -> Result<()> {
    let simulated = cfg.backend.kind == BackendKind::Sim;
    let mut meta = HashMap::new();
    meta.insert(CONFIG_METADATA_KEY.to_string(), cfg.to_toml_string());
    meta.insert("format".to_string(), "pt".to_string());
    if !simulated {
        // The family's own files, so its transformers class opens the run as it is.
        let gpt = cfg.arch();
        io::export_hf(dir, &gpt, tensors, meta.clone(), io::StoreAs::F32, io::DEFAULT_MAX_SHARD_BYTES)?;
        // The EMA in the same names and format, beside the weights (an
        // earlier segment's EMA goes when this one keeps none).
        match ema {
            Some(ema) => {
                io::export_hf_as(
                    dir,
                    io::EMA_STEM,
                    &gpt,
                    ema,
                    meta,
                    io::StoreAs::F32,
                    io::DEFAULT_MAX_SHARD_BYTES,
                )?;
            }
            None => remove_ema_files(dir)?,
        }
        // Beside model.safetensors, so transformers' from_pretrained(run_dir) opens the run.
        write_text(dir, crate::model::hf::HF_CONFIG_FILE, &crate::model::hf::config_json(&gpt))?;
        // The data's tokenizer, so `generate` on the run and AutoTokenizer need nothing else.
        crate::data::mixture::save_run_tokenizer(&cfg.data.train, &cfg.data.sources, dir)?;
    }
    write_text(dir, "summary.json", &serde_json::to_string_pretty(summary)?)?;
    write_text(dir, "loss.svg", &loss_svg(&curves.train, &curves.val, "pipewright: loss"))
}

/// The async runtime the actors live on. Actors only route messages; the
/// heavy work runs on each stage's own threads, so two workers are plenty.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("actors")
        .enable_all()
        .build()?)
}
