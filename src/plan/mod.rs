//! `pipewright plan`: plan a training run before spending on it.
//!
//! From a model (a config's `[model]`, shape flags, or just `--params`), a token
//! budget and a GPU count, the planner gives:
//! - training FLOPs, 6·N·D plus the attention term ([`flops`]);
//! - the Chinchilla-optimal size for the same budget, by the 20-tokens-per-parameter
//!   rule and by Hoffmann et al.'s fitted law;
//! - time and cost at a given MFU and price ([`hardware`] holds the GPU table);
//! - memory per GPU by component ([`memory`]);
//! - a ranked search over tensor, pipeline and data parallel sizes, microbatches,
//!   schedules, recompute and ZeRO stage, with bubbles from our schedule simulator
//!   ([`search`]).
//!
//! Entry points: [`resolve`] (flags and config → [`PlanInput`]), [`plan`]
//! (→ [`Plan`]), [`Plan::text`] and `serde_json::to_value(&plan)`; [`cli`] does all
//! three for the command line.

pub mod cpu;
pub mod flops;
pub mod hardware;
pub mod memory;
pub mod search;

use crate::config::Config;
use crate::model::ModelSection;
use flops::{Chinchilla, ModelShape, TrainFlops};
use hardware::Gpu;
use memory::{Recompute, StateBytes};
use search::{SearchInput, SearchResult};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;

/// The `plan` command's options.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct PlanArgs {
    /// TOML config: [model] gives the shape; [train] and [parallel] give the global
    /// batch (dp · microbatches · micro_batch_size), tokens (× steps) and GPUs
    /// (pp · dp). Flags override it.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Override one value of the config, as `train --set` does (repeatable;
    /// with a GPU, only together with --config).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
    /// Parameters N, e.g. 7e9 (default: counted from the shape). Alone, the shape is
    /// guessed from the GPT-3/LLaMA table.
    #[arg(long)]
    pub params: Option<f64>,
    /// Transformer blocks (n_layer) [default: from the config or --params].
    #[arg(long)]
    pub layers: Option<usize>,
    /// Model width (n_embd) [default: from the config or --params].
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Attention heads (n_head) [default: from the config or --params].
    #[arg(long)]
    pub heads: Option<usize>,
    /// Sequence length T [default: 2048 without a config].
    #[arg(long)]
    pub seq: Option<usize>,
    /// Vocabulary size [default: 50257 without a config].
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Training tokens D, e.g. 2e12.
    #[arg(long)]
    pub tokens: Option<f64>,
    /// Number of GPUs G.
    #[arg(long)]
    pub gpus: Option<usize>,
    /// a100, h100 or h200; or cpu: the config (--config, else the embedded
    /// default) on this machine's CPU backend, timed at a gemm rate measured here.
    #[arg(long, default_value = "h100")]
    pub gpu: String,
    /// Model FLOPs utilisation the compute runs at.
    #[arg(long, default_value_t = 0.4)]
    pub mfu: f64,
    /// Price in $ per GPU-hour (cost is left out without it).
    #[arg(long)]
    pub price: Option<f64>,
    /// Fix the sequences per microbatch (default: the search chooses).
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// Sequences per optimizer step over all replicas [default: 1024, or the config's].
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Fraction of the data-parallel gradient all-reduce hidden behind backward
    /// (Megatron's --overlap-grad-reduce gets most of it; 0 is conservative).
    #[arg(long, default_value_t = 0.0)]
    pub dp_overlap: f64,
    /// Print the plan as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// With a CPU config: the processes `launch --nodes N` would spread it
    /// over. A stage whose tp ranks span processes shows its owner's memory
    /// and each follower's.
    #[arg(long, value_name = "N")]
    pub nodes: Option<usize>,
}

/// `--nodes`, checked against the config as `launch` checks it.
fn nodes_of(args: &PlanArgs, cfg: &Config) -> Result<usize, PlanError> {
    let nodes = args.nodes.unwrap_or(1);
    cfg.check_processes(nodes).map_err(|e| err("--nodes", e.to_string()))?;
    Ok(nodes)
}

/// The backend a planned layout would train on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Backend {
    Cpu,
    Cuda,
}

/// The config `train` would be given for a planned layout: the model's
/// shape and the layout's parallel settings over the defaults.
pub fn trainer_config(
    shape: &ModelShape,
    layout: &memory::MemLayout,
    kind: crate::schedule::ScheduleKind,
    microbatches: usize,
    backend: Backend,
) -> Config {
    let mut c = Config::default();
    // The data are no layout question: a built-in corpus stands for them.
    c.data.builtin = crate::config::Builtin::Random;
    c.model = shape.section.clone();
    c.train.micro_batch_size = layout.micro_batch;
    // The planner's selective is Megatron's (no attention scores stored),
    // which every pipewright run has: `runnable` refuses it by name.
    c.train.recompute = (layout.recompute == Recompute::Full).into();
    let p = &mut c.parallel;
    (p.pp, p.dp, p.tp, p.microbatches, p.schedule) = (layout.pp, layout.dp, layout.tp, microbatches, kind);
    p.chunks = layout.chunks;
    // The fewest slices a split of tp ranks may have.
    p.tp_slices = layout.tp;
    // The memory model divides all of a layer's activations by tp: Megatron's
    // sequence parallelism, which the CPU backend runs (the GPU split is
    // refused below for its own reasons).
    p.sp = layout.tp > 1 && backend == Backend::Cpu;
    p.zero = layout.zero;
    c.backend.kind = match backend {
        Backend::Cpu => crate::config::BackendKind::Cpu,
        Backend::Cuda => crate::config::BackendKind::Cuda,
    };
    c
}

/// Whether pipewright's trainer runs the planned layout on `backend` today;
/// Err says what it lacks. The trainer's own checks decide (the config
/// validation and the pipeline layout `train` builds before its first step),
/// so the planner never says "runs: yes" of a layout `train` refuses; then
/// what a config cannot express (selective recompute), and where the
/// planner's memory model does not describe what the trainer would do.
pub fn runnable(
    shape: &ModelShape,
    layout: &memory::MemLayout,
    kind: crate::schedule::ScheduleKind,
    microbatches: usize,
    backend: Backend,
) -> Result<(), String> {
    let cfg = trainer_config(shape, layout, kind, microbatches, backend);
    if let Err(e) = cfg.validate() {
        let problems: Vec<String> = e.problems().iter().map(ToString::to_string).collect();
        return Err(match problems.is_empty() {
            true => e.to_string(),
            false => format!("train refuses it ({})", problems.join("; ")),
        });
    }
    crate::actors::Layout::from_config(&cfg).map_err(|e| format!("train refuses it ({e})"))?;
    if layout.recompute == Recompute::Selective {
        return Err(
            "this selective recompute is Megatron's (the attention scores not stored), which pipewright's \
                    attention never stores: plan recompute none for it (train.recompute = \"selective\" also \
                    remakes the norms and the MLP's activation)"
                .into(),
        );
    }
    if layout.tp > 1 && backend != Backend::Cpu {
        // The GPU split runs (parallel.tp on cuda), but keeps the master
        // weights and AdamW's moments whole on each stage's tp rank 0, so the
        // per-GPU figure here (states divided by tp, as Megatron's) is not what
        // it would need.
        return Err(
            "GPU tensor parallelism keeps the optimizer state whole on tp rank 0, not divided by tp, and has \
             no sequence parallelism yet"
                .into()
        );
    }
    Ok(())
}

/// What `--gpu` names: a GPU of the table, or this machine's CPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    Gpu(Gpu),
    Cpu,
}

impl std::str::FromStr for Target {
    type Err = String;

    fn from_str(s: &str) -> Result<Target, String> {
        if s.eq_ignore_ascii_case("cpu") {
            return Ok(Target::Cpu);
        }
        s.parse().map(Target::Gpu).map_err(|e: String| format!("{e}, or cpu (this machine)"))
    }
}

/// A bad input; `flag` names the flag (or config field) at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{flag}: {reason}")]
pub struct PlanError {
    pub flag: String,
    pub reason: String,
}

fn err(flag: &str, reason: impl Into<String>) -> PlanError {
    PlanError { flag: flag.into(), reason: reason.into() }
}

/// `--mfu` for either planner: a fraction of peak (NaN fails every comparison).
fn check_mfu(mfu: f64) -> Result<(), PlanError> {
    if mfu > 0.0 && mfu <= 1.0 {
        Ok(())
    } else {
        Err(err("--mfu", format!("must be in (0, 1], got {mfu}")))
    }
}

/// Everything the planner runs on, resolved from flags and config.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanInput {
    pub shape: ModelShape,
    /// True when the shape was guessed from `--params` alone.
    pub shape_guessed: bool,
    pub params: f64,
    pub tokens: f64,
    pub gpus: usize,
    pub gpu: Gpu,
    pub mfu: f64,
    pub price: Option<f64>,
    pub micro_batch: Option<usize>,
    pub global_batch: usize,
    pub dp_overlap: f64,
}

/// Flags over config over defaults. Errors name the flag.
pub fn resolve(a: &PlanArgs) -> Result<PlanInput, PlanError> {
    let cfg = match &a.config {
        Some(path) => Some(Config::load(Some(path), &a.set).map_err(|e| err("--config", e.to_string()))?),
        None if !a.set.is_empty() => {
            return Err(err("--set", "needs --config: without one a GPU plan is shaped by its flags"))
        }
        None => None,
    };
    let positive = |flag: &str, x: Option<usize>| match x {
        Some(0) => Err(err(flag, "must be at least 1")),
        x => Ok(x),
    };
    let (layers, hidden, heads) =
        (positive("--layers", a.layers)?, positive("--hidden", a.hidden)?, positive("--heads", a.heads)?);
    let (seq, vocab) = (positive("--seq", a.seq)?, positive("--vocab", a.vocab)?);
    if let Some(n) = a.params {
        if !(n.is_finite() && n >= 1.0) {
            return Err(err("--params", format!("must be a positive count, got {n}")));
        }
    }
    let seq = seq.or(cfg.as_ref().map(|c| c.model.block_size)).unwrap_or(2048);
    let vocab = vocab.or(cfg.as_ref().map(|c| c.model.vocab_size)).unwrap_or(50257);
    let from_cfg = cfg.as_ref().map(|c| (c.model.n_layer, c.model.n_embd, c.model.n_head));
    let any_shape = layers.is_some() || hidden.is_some() || heads.is_some();
    // Every shape goes through the model section's rules, as `train` would check it.
    let section_of = |m: crate::model::ModelSection, flag: &str| -> Result<ModelShape, PlanError> {
        let arch = m.arch().map_err(|p| {
            let p: Vec<String> = p.iter().map(ToString::to_string).collect();
            err(flag, p.join("; "))
        })?;
        Ok(ModelShape { section: m, arch })
    };
    let (shape, guessed) = match (from_cfg, any_shape, a.params) {
        (None, false, Some(n)) => {
            let (layers, hidden, heads) = ModelShape::guess(n, seq, vocab);
            let m = ModelSection {
                n_layer: layers,
                n_embd: hidden,
                n_head: heads,
                block_size: seq,
                vocab_size: vocab,
                ..Default::default()
            };
            (section_of(m, "--params")?, true)
        }
        (None, false, None) => {
            return Err(err("--params", "give --params, or --layers/--hidden/--heads, or --config"))
        }
        _ => {
            let pick = |flag: &str, x: Option<usize>, c: Option<usize>| {
                x.or(c).ok_or_else(|| err(flag, "required with the other shape flags (or use --config)"))
            };
            // A config's model (its family and settings), the flags' shape over it.
            let mut m = cfg.as_ref().map(|c| c.model.clone()).unwrap_or_default();
            m.n_layer = pick("--layers", layers, from_cfg.map(|c| c.0))?;
            m.n_embd = pick("--hidden", hidden, from_cfg.map(|c| c.1))?;
            m.n_head = pick("--heads", heads, from_cfg.map(|c| c.2))?;
            (m.block_size, m.vocab_size) = (seq, vocab);
            if m.head_dim == 0 && !m.n_embd.is_multiple_of(m.n_head) {
                return Err(err("--heads", format!("{} heads do not divide hidden {}", m.n_head, m.n_embd)));
            }
            (section_of(m, if cfg.is_some() { "--config" } else { "--layers" })?, false)
        }
    };
    let params = a.params.unwrap_or_else(|| shape.params());
    let batch_cfg = cfg.as_ref().map(|c| c.parallel.dp * c.parallel.microbatches * c.train.micro_batch_size);
    let global_batch = positive("--global-batch", a.global_batch)?.or(batch_cfg).unwrap_or(1024);
    let tokens = match (a.tokens, &cfg) {
        (Some(d), _) => d,
        (None, Some(c)) => (c.train.steps * global_batch * seq) as f64,
        (None, None) => return Err(err("--tokens", "required: training tokens, e.g. 2e12")),
    };
    if !(tokens.is_finite() && tokens >= 1.0) {
        return Err(err("--tokens", format!("must be a positive count, got {tokens}")));
    }
    let gpus = match (positive("--gpus", a.gpus)?, &cfg) {
        (Some(g), _) => g,
        (None, Some(c)) => c.parallel.pp * c.parallel.dp,
        (None, None) => return Err(err("--gpus", "required: how many GPUs")),
    };
    let gpu: Gpu = a.gpu.parse().map_err(|e: String| err("--gpu", e))?;
    check_mfu(a.mfu)?;
    if let Some(p) = a.price {
        if !(p.is_finite() && p >= 0.0) {
            return Err(err("--price", format!("must be ≥ 0 $/GPU-hour, got {p}")));
        }
    }
    let micro_batch = positive("--micro-batch", a.micro_batch)?;
    if !(0.0..=1.0).contains(&a.dp_overlap) {
        return Err(err("--dp-overlap", format!("must be in [0, 1], got {}", a.dp_overlap)));
    }
    Ok(PlanInput {
        shape,
        shape_guessed: guessed,
        params,
        tokens,
        gpus,
        gpu,
        mfu: a.mfu,
        price: a.price,
        micro_batch,
        global_batch,
        dp_overlap: a.dp_overlap,
    })
}

/// Time and cost of the whole run at the MFU, with no parallel overheads.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct IdealTime {
    pub gpu_hours: f64,
    pub days: f64,
    pub cost_usd: Option<f64>,
}

/// The memory section: bytes per parameter, model states under each ZeRO stage
/// with plain data parallel over all GPUs, and activations per layer per microbatch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemorySummary {
    pub bytes_per_param: StateBytes,
    pub bytes_per_param_total: f64,
    /// Unsharded model states (bytes).
    pub model_states: f64,
    /// Per GPU with tp = pp = 1, dp = G, ZeRO-0..3 (bytes).
    pub zero_per_gpu: [f64; 4],
    /// The microbatch size the activation figures are for.
    pub micro_batch: usize,
    /// Per layer per microbatch, tp = 1: s·b·h·(32 + 4as/h) for GPT-3's block.
    pub activation_per_layer_none: f64,
    /// 32·s·b·h for GPT-3's block: selective recompute, or flash attention.
    pub activation_per_layer_selective: f64,
    /// 2·s·b·h: full recompute.
    pub activation_per_layer_full: f64,
    /// The top candidate's fullest GPU, if any layout fits.
    pub best: Option<memory::RankMemory>,
    pub usable_bytes: f64,
}

/// A complete plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub input: PlanInput,
    pub train_flops: TrainFlops,
    pub chinchilla: Chinchilla,
    pub ideal: IdealTime,
    pub memory: MemorySummary,
    pub candidates: Vec<search::Candidate>,
    pub layouts_tried: usize,
    pub rejected_for_memory: usize,
}

/// Runs the planner.
pub fn plan(inp: &PlanInput) -> Plan {
    let s = &inp.shape;
    let train_flops = flops::train_flops(inp.params, inp.tokens, s);
    let chinchilla = flops::chinchilla(train_flops.six_nd);
    let gpu_s = train_flops.total / (inp.gpu.peak_flops * inp.mfu);
    let ideal = IdealTime {
        gpu_hours: gpu_s / 3600.0,
        days: gpu_s / inp.gpus as f64 / 86_400.0,
        cost_usd: inp.price.map(|p| p * gpu_s / 3600.0),
    };
    let SearchResult { candidates, layouts_tried, rejected_for_memory, .. } = search::search(&SearchInput {
        shape: s.clone(),
        params: inp.params,
        tokens: inp.tokens,
        gpus: inp.gpus,
        gpu: inp.gpu,
        mfu: inp.mfu,
        global_batch: inp.global_batch,
        micro_batch: inp.micro_batch,
        price: inp.price,
        dp_overlap: inp.dp_overlap,
    });
    let b = inp.micro_batch.unwrap_or(1);
    let act = |r| memory::activation_bytes_per_layer(s, b, r, 1);
    let memory = MemorySummary {
        bytes_per_param: StateBytes::new(1.0, 1, 0),
        bytes_per_param_total: memory::bytes_per_param(),
        model_states: StateBytes::new(inp.params, 1, 0).total(),
        zero_per_gpu: [0u8, 1, 2, 3].map(|z| StateBytes::new(inp.params, inp.gpus, z).total()),
        micro_batch: b,
        activation_per_layer_none: act(Recompute::None),
        activation_per_layer_selective: act(Recompute::Selective),
        activation_per_layer_full: act(Recompute::Full),
        best: candidates.first().map(|c| c.memory),
        usable_bytes: inp.gpu.usable_bytes(),
    };
    Plan {
        input: inp.clone(),
        train_flops,
        chinchilla,
        ideal,
        memory,
        candidates,
        layouts_tried,
        rejected_for_memory,
    }
}

fn si(x: f64) -> String {
    let (v, u) = match x.abs() {
        x if x >= 1e12 => (1e-12, "T"),
        x if x >= 1e9 => (1e-9, "B"),
        x if x >= 1e6 => (1e-6, "M"),
        x if x >= 1e3 => (1e-3, "K"),
        _ => (1.0, ""),
    };
    format!("{:.2}{u}", x * v)
}

fn gb(x: f64) -> String {
    format!("{:.2} GB", x / 1e9)
}

impl Plan {
    /// The human-readable report.
    pub fn text(&self) -> String {
        let mut o = String::new();
        let i = &self.input;
        let s = &i.shape;
        let _ = writeln!(
            o,
            "model: {} params; {} {} layers, hidden {}, {} heads, seq {}, vocab {}{}{}",
            si(i.params),
            s.arch.family.title(),
            s.layers(),
            s.hidden(),
            s.heads(),
            s.seq(),
            s.vocab(),
            {
                let a = &s.arch;
                match (a.kv_heads() != a.n_head, a.ffn != 4 * a.n_embd, !a.tied) {
                    (false, false, false) => String::new(),
                    _ => format!(
                        "; {} key/value heads, head size {}, MLP width {}, head {}",
                        a.kv_heads(),
                        a.head_dim,
                        a.ffn,
                        if a.tied { "tied" } else { "untied" }
                    ),
                }
            },
            if i.shape_guessed { " (shape guessed from --params: nearest GPT-3/LLaMA size)" } else { "" }
        );
        let _ = writeln!(
            o,
            "run:   {} tokens on {} × {} ({:.0} TFLOP/s bf16 dense, {:.0} GB) at MFU {:.2}; global batch {} × {} tokens; DP overlap {:.0}%",
            si(i.tokens),
            i.gpus,
            i.gpu.name,
            i.gpu.peak_flops / 1e12,
            i.gpu.memory_bytes / 1e9,
            i.mfu,
            i.global_batch,
            s.seq(),
            100.0 * i.dp_overlap
        );
        let f = &self.train_flops;
        let _ = writeln!(
            o,
            "\nFLOPs: 6ND = {:.3e} + attention 6·L·C·T·D = {:.3e} → {:.3e} total ({:.1}% attention)",
            f.six_nd,
            f.attention,
            f.total,
            100.0 * f.attention / f.total
        );
        let c = &self.chinchilla;
        let _ = writeln!(o, "Chinchilla-optimal for C = 6ND = {:.3e}:", c.budget);
        let _ = writeln!(
            o,
            "  approaches 1–2, 20 tokens/param (N ∝ C^0.50; Chinchilla's own 70B on 1.4T): N = {}, D = {} (fitted loss {:.3})",
            si(c.rule_20x.params),
            si(c.rule_20x.tokens),
            c.rule_20x.loss
        );
        let _ = writeln!(
            o,
            "  approach 3, fitted law with the printed constants (N ∝ C^{:.2}): N = {}, D = {} (loss {:.3}); this run: {:.1} tokens/param, loss {:.3}",
            c.fitted_exponent,
            si(c.fitted.params),
            si(c.fitted.tokens),
            c.fitted.loss,
            i.tokens / i.params,
            flops::chinchilla_loss(i.params, i.tokens)
        );
        // The headline is the top layout's time, the row the user would run;
        // the overhead-free figure stays beside it as the bound it is.
        let ideal = format!(
            "{:.3e} GPU-hours = {} on {} GPUs{}",
            self.ideal.gpu_hours,
            duration(self.ideal.days),
            i.gpus,
            self.ideal.cost_usd.map(|c| format!(", ${}", si(c))).unwrap_or_default()
        );
        let _ = match self.candidates.first() {
            Some(c) => writeln!(
                o,
                "Time: {} on {} GPUs{} with layout 1 below (its bubble and communication included); at MFU {:.2} \
                 with neither: {ideal}",
                duration(c.train_days),
                i.gpus,
                c.cost_usd.map(|x| format!(", ${}", si(x))).unwrap_or_default(),
                i.mfu
            ),
            None => writeln!(o, "Time at MFU {:.2} (no layout fits, see below): {ideal}", i.mfu),
        };
        let m = &self.memory;
        let _ = writeln!(
            o,
            "\nmemory: {} B/param (bf16 weights 2, bf16 grads 2, f32 master 4, Adam m 4 + v 4) → {} of model states",
            m.bytes_per_param_total,
            gb(m.model_states)
        );
        let _ = writeln!(
            o,
            "  per GPU with dp = {} (tp = pp = 1): ZeRO-0 {}, ZeRO-1 {}, ZeRO-2 {}, ZeRO-3 {}",
            i.gpus,
            gb(m.zero_per_gpu[0]),
            gb(m.zero_per_gpu[1]),
            gb(m.zero_per_gpu[2]),
            gb(m.zero_per_gpu[3])
        );
        let _ = writeln!(
            o,
            "  activations per layer per microbatch of {} (tp = 1): {} stored, {} with flash attention or selective recompute, {} with full recompute",
            m.micro_batch,
            gb(m.activation_per_layer_none),
            gb(m.activation_per_layer_selective),
            gb(m.activation_per_layer_full)
        );
        let _ = writeln!(
            o,
            "  alive under the schedule: 1F1B p − s microbatches on stage s (p on stage 0), GPipe m; usable {} per GPU",
            gb(m.usable_bytes)
        );
        if let Some(b) = &m.best {
            let st = &b.states;
            let _ = writeln!(
                o,
                "  top candidate, fullest GPU (rank {}): weights {}, grads {}, master {}, Adam {}, activations {} ({} microbatch·chunks), workspace {} = {}",
                b.rank,
                gb(st.weights),
                gb(st.grads),
                gb(st.master),
                gb(st.adam_m + st.adam_v),
                gb(b.activations),
                b.live_microbatches,
                gb(b.workspace),
                gb(b.total)
            );
        }
        if let Some(c) = self.candidates.first() {
            let live: Vec<String> =
                c.live_microbatches.iter().enumerate().map(|(s, n)| format!("{s}:{n}")).collect();
            let _ = writeln!(
                o,
                "  top candidate, microbatches alive at the peak per stage ({}, pp {}, m {}): {}",
                c.schedule,
                c.pp,
                c.microbatches,
                live.join(" ")
            );
        }
        let _ = writeln!(
            o,
            "\nlayouts: {} tried, {} over memory; best per (tp, pp, schedule), fastest first:",
            self.layouts_tried, self.rejected_for_memory
        );
        if self.layouts_tried == 0 {
            let _ = writeln!(
                o,
                "  no layout divides evenly: tp must divide the heads, pp the layers, tp·pp the GPUs, and dp·m the global batch (--gpus, --global-batch)"
            );
        } else if self.candidates.is_empty() {
            let _ = writeln!(o, "  none fits: more GPUs, a larger GPU, or a smaller --micro-batch");
        } else {
            o += &self.layout_table();
        }
        o
    }
}

impl Plan {
    /// The top five layouts, one row each with its why below it. Every column
    /// is as wide as its widest cell (header included), numbers right-aligned,
    /// words left-aligned, so rows line up whatever the values.
    fn layout_table(&self) -> String {
        let priced = self.input.price.is_some();
        let mut head = vec![
            ("#", false),
            ("tp", false),
            ("pp", false),
            ("dp", false),
            ("m", false),
            ("b", false),
            ("schedule", true),
            ("recomp", true),
            ("ZeRO", false),
            ("mem GB", false),
            ("bubble", false),
            ("step s", false),
            ("MFU", false),
            ("time", false),
        ];
        if priced {
            head.push(("cost $", false));
        }
        head.push(("runs", true));
        let top: Vec<&search::Candidate> = self.candidates.iter().take(5).collect();
        let rows: Vec<Vec<String>> = top
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let mut r = vec![
                    (k + 1).to_string(),
                    c.tp.to_string(),
                    c.pp.to_string(),
                    c.dp.to_string(),
                    c.microbatches.to_string(),
                    c.micro_batch.to_string(),
                    c.schedule.clone(),
                    c.recompute.name().to_string(),
                    c.zero.to_string(),
                    format!("{:.1}", c.memory_bytes / 1e9),
                    format!("{:.1}%", 100.0 * c.bubble),
                    format!("{:.2}", c.step_s),
                    format!("{:.1}%", 100.0 * c.mfu),
                    duration(c.train_days),
                ];
                if priced {
                    r.push(c.cost_usd.map(si).unwrap_or_default());
                }
                r.push(if c.lacks.is_some() { "no" } else { "yes" }.to_string());
                r
            })
            .collect();
        let widths: Vec<usize> = (0..head.len())
            .map(|j| {
                rows.iter()
                    .map(|r| r[j].chars().count())
                    .chain([head[j].0.chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: Vec<&str>| {
            let padded: Vec<String> = cells
                .iter()
                .zip(&widths)
                .zip(&head)
                .map(|((c, &w), &(_, left))| if left { format!("{c:<w$}") } else { format!("{c:>w$}") })
                .collect();
            format!("  {}\n", padded.join("  ").trim_end())
        };
        let mut o = line(head.iter().map(|h| h.0).collect());
        for (r, c) in rows.iter().zip(&top) {
            o += &line(r.iter().map(String::as_str).collect());
            match &c.lacks {
                Some(what) => o += &format!("     cannot run in pipewright yet: {what}; {}\n", c.why),
                None => o += &format!("     why: {}\n", c.why),
            }
        }
        o
    }
}

/// A run's length in the unit that reads best: days from one day up, then
/// hours, minutes, seconds ("0.0 days" said nothing about a short run).
fn duration(days: f64) -> String {
    let s = days * 86_400.0;
    if !s.is_finite() {
        "-".to_string()
    } else if s >= 86_400.0 {
        format!("{days:.1} days")
    } else if s >= 3600.0 {
        format!("{:.1} hours", s / 3600.0)
    } else if s >= 60.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{s:.1} s")
    }
}

/// The `pipewright plan` command: resolve, plan, and render text or JSON.
/// With a CPU config, the plan also holds `cpu`: the config's own layout on
/// pipewright's CPU backend (memory per rank, the schedule's bubble).
pub fn cli(args: &PlanArgs) -> Result<String, PlanError> {
    if args.gpu.parse::<Target>().map_err(|e| err("--gpu", e))? == Target::Cpu {
        return cpu_cli(args);
    }
    let p = plan(&resolve(args)?);
    let cpu = match &args.config {
        Some(path) => {
            let cfg = Config::load(Some(path), &args.set).map_err(|e| err("--config", e.to_string()))?;
            match cfg.backend.kind {
                crate::config::BackendKind::Cpu => {
                    let nodes = nodes_of(args, &cfg)?;
                    Some(cpu::plan_over(&cfg, nodes).map_err(|e| err("--config", format!("{e:#}")))?)
                }
                _ => None,
            }
        }
        None => None,
    };
    if cpu.is_none() && args.nodes.is_some() {
        return Err(err(
            "--nodes",
            "places a CPU config's ranks on processes: give --config with a CPU backend, or --gpu cpu",
        ));
    }
    Ok(if args.json {
        let mut v = serde_json::to_value(&p).map_err(|e| err("--json", e.to_string()))?;
        if let (Some(c), Some(o)) = (&cpu, v.as_object_mut()) {
            o.insert("cpu".into(), serde_json::to_value(c).map_err(|e| err("--json", e.to_string()))?);
        }
        format!("{v}\n")
    } else {
        let mut t = p.text();
        if let Some(c) = &cpu {
            t += &c.text();
        }
        t
    })
}

/// `plan --gpu cpu`: the config (or the embedded default) laid out on this
/// machine's CPU backend, its step timed at `--mfu` of a gemm rate measured
/// here on the run's threads.
fn cpu_cli(args: &PlanArgs) -> Result<String, PlanError> {
    // The config is the plan here: flags that shape a GPU search would be ignored silently.
    let gpu_only = [
        ("--params", args.params.is_some()),
        ("--layers", args.layers.is_some()),
        ("--hidden", args.hidden.is_some()),
        ("--heads", args.heads.is_some()),
        ("--seq", args.seq.is_some()),
        ("--vocab", args.vocab.is_some()),
        ("--tokens", args.tokens.is_some()),
        ("--gpus", args.gpus.is_some()),
        ("--price", args.price.is_some()),
        ("--micro-batch", args.micro_batch.is_some()),
        ("--global-batch", args.global_batch.is_some()),
    ];
    if let Some((flag, _)) = gpu_only.iter().find(|f| f.1) {
        return Err(err(flag, "does not apply with --gpu cpu, which plans the config as it is (--config or the embedded default)"));
    }
    check_mfu(args.mfu)?;
    let cfg = Config::load(args.config.as_deref(), &args.set).map_err(|e| err("--config", e.to_string()))?;
    let fail = |e: anyhow::Error| err("--config", format!("{e:#}"));
    let layout = cpu::plan_over(&cfg, nodes_of(args, &cfg)?).map_err(fail)?;
    let threads = crate::host::thread_count(cfg.backend.threads);
    let gemm_gflops = crate::metrics::gemm_peak(threads);
    let step_ms = cpu::step_ms(&cfg, gemm_gflops * args.mfu, threads).map_err(fail)?;
    let run_s = step_ms * cfg.train.steps as f64 / 1e3;
    if args.json {
        let v = serde_json::json!({
            "cpu": layout,
            "gemm_gflops": gemm_gflops,
            "threads": threads,
            "mfu": args.mfu,
            "step_ms": step_ms,
            "steps": cfg.train.steps,
            "run_seconds": run_s,
        });
        return Ok(format!("{v}\n"));
    }
    let gpt = cfg.arch();
    let m = &cfg.model;
    let mut t = format!(
        "model: {} {} params; {} layers, hidden {}, {} heads, seq {}, vocab {}\n",
        m.family,
        si(gpt.num_params() as f64),
        m.n_layer,
        m.n_embd,
        m.n_head,
        m.block_size,
        m.vocab_size
    );
    t += &format!(
        "Time at {:.0}% of the gemm rate measured here ({gemm_gflops:.0} GFLOP/s on {threads} threads): \
         {step_ms:.1} ms per step, {} for {} steps (pp {}, dp {}, tp {}, {} microbatches, {})\n",
        100.0 * args.mfu,
        duration(run_s / 86_400.0),
        cfg.train.steps,
        cfg.parallel.pp,
        cfg.parallel.dp,
        cfg.parallel.tp,
        cfg.parallel.microbatches,
        cfg.parallel.schedule
    );
    Ok(t + &layout.text())
}

#[cfg(test)]
mod duration_tests {
    #[test]
    fn short_runs_read_in_hours_minutes_or_seconds() {
        use super::duration;
        assert_eq!(duration(3.3), "3.3 days");
        assert_eq!(duration(5.0 / 24.0), "5.0 hours");
        assert_eq!(duration(90.0 / 86_400.0), "1.5 min");
        assert_eq!(duration(12.0 / 86_400.0), "12.0 s");
    }
}
