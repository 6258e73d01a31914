//! The run's configuration: the TOML schema, defaults, `--set` overrides and
//! validation. Owns every rule about which values are allowed; errors name the
//! field's path (`optim.lr`), the value given and what was expected.
//! Never touches files other than the config being read: whether data files
//! exist, or a backend can start, is for the layers that use them to say.

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use crate::check::Problem;
use crate::check::{quoted, Checks};
use crate::choice;
pub use crate::model::recompute::Recompute;
pub use crate::model::section::{ModelSection, RopeScalingSection};

pub use crate::data::mixture::SourceSpec;
pub use crate::data::sampler::SamplerKind;
pub use crate::data::token_file::FileFormat;
pub use crate::schedule::ScheduleKind;

/// The embedded default config: `pipewright train` with no arguments runs this.
pub const DEFAULT_TOML: &str = include_str!("../configs/default.toml");

/// The longest simulated action (`sim.forward_ms`, `sim.backward_ms`), in ms.
pub const MAX_SIM_MS: f64 = 60_000.0;
/// The largest `sim.stage_factors` entry: a stage 100 times slower than the rest.
pub const MAX_STAGE_FACTOR: f64 = 100.0;
/// The longest `recovery.shutdown_timeout_s`: an hour to finish a checkpoint.
pub const MAX_SHUTDOWN_TIMEOUT_S: f64 = 3600.0;

choice! {
    /// What the stages compute with (`backend.kind`).
    pub enum BackendKind {
        Cpu = "cpu",
        /// Stages sleep for the `[sim]` costs instead of computing.
        Sim = "sim",
        /// Stages on GPUs (a build with the `cuda` feature and a GPU at run time).
        Cuda = "cuda",
    }
}

choice! {
    /// The storage type of weights and activations on a GPU (`backend.dtype`).
    pub enum Dtype {
        Bf16 = "bf16",
        F32 = "f32",
    }
}

choice! {
    /// Loss scaling for reduced precision (`optim.loss_scale`).
    pub enum LossScaling {
        None = "none",
        Dynamic = "dynamic",
    }
}

choice! {
    /// The learning-rate curve (`optim.schedule`).
    pub enum LrShape {
        /// Warmup, then a cosine down to min_lr.
        Cosine = "cosine",
        /// Warmup-stable-decay.
        Wsd = "wsd",
        Constant = "constant",
    }
}

choice! {
    /// A corpus made in memory instead of token files (`data.builtin`).
    pub enum Builtin {
        /// No built-in corpus: read `data.train` (and `data.val`).
        Files = "",
        /// The default's addition task.
        Arithmetic = "arithmetic",
        /// Uniformly random tokens, for benchmarks: nothing to learn, nothing to read.
        Random = "random",
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub model: ModelSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub optim: OptimSection,
    pub parallel: ParallelSection,
    pub backend: BackendSection,
    pub sim: SimSection,
    pub trace: TraceSection,
    pub checkpoint: CheckpointSection,
    pub recovery: RecoverySection,
    pub replay: ReplaySection,
}

/// Replay logs (`RUN/replay/<actor>.log`): see `crate::replay`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ReplaySection {
    /// Record every actor's handled messages (digests of their tensors).
    pub record: bool,
    /// Actors whose tensor bytes are kept too, so they can be replayed alone:
    /// names such as "stage-1", "loader-0", "reducer", "coordinator", or "all".
    pub payloads: Vec<String>,
}

/// What happens when a step goes wrong: non-finite values always skip the
/// update; repeated skips roll back; loss spikes raise an alert (and can skip).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RecoverySection {
    /// Consecutive skipped steps before rolling back to the last checkpoint (0: never).
    pub max_skips: usize,
    /// After a rollback, the learning rate is scaled by this …
    pub lr_factor: f64,
    /// … for this many steps.
    pub cooldown_steps: usize,
    /// Steps in the rolling window of the spike detector.
    pub spike_window: usize,
    /// A loss above this multiple of the window's mean is a spike (0: off).
    pub spike_factor: f64,
    /// A gradient norm this many standard deviations above the window's mean is a spike (0: off).
    pub spike_zscore: f64,
    /// Skip the update of a step whose loss or gradient norm spiked.
    pub spike_skip: bool,
    /// After a failure, seconds the other actors get to stop before the
    /// process exits anyway, naming those that did not.
    pub shutdown_timeout_s: f64,
}

impl Default for RecoverySection {
    fn default() -> Self {
        RecoverySection {
            max_skips: 3,
            lr_factor: 0.5,
            cooldown_steps: 100,
            spike_window: 50,
            spike_factor: 3.0,
            spike_zscore: 0.0,
            spike_skip: false,
            shutdown_timeout_s: 10.0,
        }
    }
}

/// Checkpoints in `RUN/checkpoints/step_NNNNNNNN/`, written in the background.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Save every N optimizer steps (0: only on SIGINT/SIGTERM).
    pub every: usize,
    /// Newest checkpoints kept (at least 2, so a damaged newest one has a fallback).
    pub keep: usize,
    /// Also keep every checkpoint whose step is a multiple of this for good (0: none).
    pub keep_every: usize,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection { every: 0, keep: 2, keep_every: 0 }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct TraceSection {
    /// Write trace.json (Chrome Trace Event format) into the run directory.
    pub enabled: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Generated corpus used instead of files: "arithmetic" (the default's
    /// addition task), "random" (uniformly random tokens made in memory, for
    /// benchmarks: nothing to learn, nothing to read), or "" for files.
    pub builtin: Builtin,
    /// Training token file (llm.c `.bin`, or nanoGPT raw uint16).
    pub train: String,
    /// Validation token file; empty means no validation.
    pub val: String,
    /// "shuffled" (a seeded permutation of windows per epoch) or "sequential".
    pub sampler: SamplerKind,
    /// Token file layout: "auto" (llm.c by its magic, else raw uint16; a
    /// header with another magic is refused), "llmc" (llm.c only) or "raw".
    pub format: FileFormat,
    /// A weighted mixture of prepared datasets (`[[data.sources]]`, each
    /// `path`, `weight` and optional `name`), read instead of `data.train`.
    pub sources: Vec<SourceSpec>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// Optimizer steps to run (`--steps` overrides).
    pub steps: usize,
    /// The global batch grown from a smaller one over the first tokens
    /// (`optim::batch_ramp`); none: every step has the full batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_ramp: Option<BatchRamp>,
    /// Sequences per microbatch (B).
    pub micro_batch_size: usize,
    pub seed: u64,
    /// Evaluate validation loss every N steps (0: never; always at the end if val is set).
    pub eval_every: usize,
    /// Batches of train.micro_batch_size validation windows per evaluation
    /// (what `eval --batches` counts too).
    pub eval_batches: usize,
    /// What backward computes again instead of keeping from forward:
    /// "none", "selective" (the norms' outputs and the MLP's activation) or
    /// "full" (all but each block's input); `true`/`false` still mean
    /// "full"/"none" (`model::recompute`).
    pub recompute: Recompute,
}

/// `train.batch_ramp = { start = S, increment = I, tokens = T }`:
/// Megatron-LM's `--rampup-batch-size S I T/block_size`. Global batch sizes
/// in sequences, the length in tokens (GPT-3 counts its ramp in tokens).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BatchRamp {
    /// The first steps' global batch, sequences.
    pub start: usize,
    /// What the global batch grows by at a time, sequences.
    pub increment: usize,
    /// Tokens over which it grows to the full batch.
    pub tokens: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OptimSection {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    /// "cosine" (warmup then cosine to min_lr), "wsd" (warmup-stable-decay) or "constant".
    pub schedule: LrShape,
    /// For "wsd": the fraction of steps spent decaying linearly to min_lr at the end.
    pub decay_frac: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global-norm clipping threshold; 0 disables clipping.
    pub grad_clip: f64,
    /// "none" or "dynamic" (loss scaling for reduced precision; exact on f32).
    pub loss_scale: LossScaling,
    /// Initial scale (a power of two).
    pub loss_scale_init: f64,
    /// Clean steps before the scale doubles.
    pub loss_scale_growth_interval: usize,
    /// Overflowing steps tolerated before the scale backs off.
    pub loss_scale_hysteresis: usize,
    pub loss_scale_min: f64,
    /// The scale is multiplied by this after `loss_scale_growth_interval` clean
    /// steps (a power of two > 1, so scaling stays exact) …
    pub loss_scale_growth_factor: f64,
    /// … and by this on backing off (a power of two < 1).
    pub loss_scale_backoff_factor: f64,
    /// Decay of an EMA of the weights kept beside them (PyTorch's
    /// `AveragedModel` with `get_ema_multi_avg_fn`); 0 keeps none.
    pub ema_decay: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelSection {
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel replicas.
    pub dp: usize,
    /// Microbatches per optimizer step (per replica): the gradient-accumulation count.
    pub microbatches: usize,
    /// Pipeline schedule: "1f1b", "gpipe", "interleaved", "zb-h1", "zb-v" or "dualpipev".
    pub schedule: ScheduleKind,
    /// Model chunks per rank (interleaved 1F1B's v; 2 for the V kinds); stages = pp · chunks.
    pub chunks: usize,
    /// Blocks per stage, in stage order; empty means an even split.
    pub layers_per_stage: Vec<usize>,
    /// ZeRO stage (needs dp > 1 and the CPU backend above 0): 0, every
    /// replica keeps all training state; 1, each replica keeps the AdamW
    /// moments of its shard of every tensor (`optim::zero`); 2, also only
    /// its shard of the reduced gradients; 3, also only its shard of the
    /// weights, gathered whole for a chunk's forward and backward and freed
    /// after (fully sharded). The weights are the same bits at every level.
    pub zero: u8,
    /// ZeRO-3: free a chunk's gathered weights after each forward, and gather
    /// them again for its backward (FSDP's `reshard_after_forward`, the
    /// default: least memory); false keeps them from the step's first use
    /// to its end (one gather per chunk and step).
    pub reshard_after_forward: bool,
    /// Tensor-parallel ranks per stage (Megatron's column/row split: each
    /// holds 1/tp of every block's attention heads and MLP columns). The
    /// ranks are threads of their stage's process (tensor parallelism within
    /// a node), sharing its cores; CPU backend only.
    pub tp: usize,
    /// The sums a tensor-parallel split makes (the attention and MLP output
    /// projections, and in backward the input gradients of the qkv and MLP
    /// input projections) are defined over this many slices, whatever tp
    /// is: every tp dividing it gives the same bits. 1 means plain products
    /// (the fastest, and tp = 1); set the same value on every run whose bits
    /// should agree. A power of two dividing model.n_head.
    pub tp_slices: usize,
    /// Megatron's sequence parallelism (needs tp > 1): each tensor-parallel
    /// rank computes the norms and residual adds of its run of a
    /// microbatch's B·T rows and keeps only those rows' norm outputs,
    /// statistics and residual; the split regions' inputs are all-gathered
    /// and their outputs reduce-scattered instead of all-reduced. The same
    /// bits as without it.
    pub sp: bool,
    /// When a stage's tensor-parallel ranks span processes: seconds a rank
    /// waits for another process's all-reduce nodes or gradient shards before
    /// failing the run, naming that process (a process that is gone is
    /// reported at once, by its link; this catches one that is up but
    /// silent). Waits are logged, naming who is awaited, after 5 s.
    pub tp_timeout_s: f64,
}

/// The longest `parallel.tp_timeout_s` taken: a day.
const TP_TIMEOUT_MAX_S: f64 = 86_400.0;

impl ParallelSection {
    /// `tp_timeout_s` as a duration (validated to be in (0, a day]).
    pub fn tp_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.tp_timeout_s.clamp(0.0, TP_TIMEOUT_MAX_S))
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BackendSection {
    /// "cpu"; "sim": stages sleep for the `[sim]` costs instead of computing;
    /// "cuda": stages on GPUs (a build with the `cuda` feature and a GPU at run time).
    pub kind: BackendKind,
    /// Compute threads; 0 means one per available core.
    pub threads: usize,
    /// With kind = "cuda": the GPU ordinal of each pipeline rank, in rank
    /// order (several ranks may share one GPU, each on its own stream), or of
    /// each (replica, rank) replica-major when it has pp · dp entries; empty
    /// means all on GPU 0. With parallel.tp > 1 each rank has tp entries in
    /// a row, one per tensor-parallel rank (tp fastest, as Megatron orders
    /// ranks): all different (NCCL between them) or all the same (the ranks
    /// take turns on one GPU, for checking the split).
    pub devices: Vec<usize>,
    /// With kind = "cuda": the storage type of weights and activations,
    /// "bf16" (training) or "f32" (the path the CPU twin checks use).
    /// Master weights, gradients and AdamW moments are f32 either way.
    pub dtype: Dtype,
}

/// The simulated backend: each action takes a set time and moves a tiny
/// payload, so the runtime's own overhead and bubbles can be measured at
/// pipeline sizes no 2-core machine could compute.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SimSection {
    /// Forward (F) time per microbatch and stage.
    pub forward_ms: f64,
    /// Full backward (B) time; a split backward takes backward_ms − weight_ms (I) + weight_ms (W).
    pub backward_ms: f64,
    pub weight_ms: f64,
    /// Per-stage multipliers of every cost (empty: all 1).
    pub stage_factors: Vec<f64>,
    /// Each action's time is scaled by 1 + jitter·u, u uniform in [−1, 1], seeded.
    pub jitter: f64,
}

impl Default for SimSection {
    fn default() -> Self {
        SimSection {
            forward_ms: 2.0,
            backward_ms: 4.0,
            weight_ms: 2.0,
            stage_factors: Vec::new(),
            jitter: 0.0,
        }
    }
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            builtin: Builtin::Files,
            train: String::new(),
            val: String::new(),
            sampler: SamplerKind::Shuffled,
            format: FileFormat::Auto,
            sources: Vec::new(),
        }
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            steps: 1000,
            batch_ramp: None,
            micro_batch_size: 4,
            seed: 1337,
            eval_every: 100,
            eval_batches: 8,
            recompute: Recompute::None,
        }
    }
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            lr: 6e-4,
            min_lr: 6e-5,
            warmup_steps: 100,
            schedule: LrShape::Cosine,
            decay_frac: 0.2,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            loss_scale: LossScaling::None,
            loss_scale_init: 65536.0,
            loss_scale_growth_interval: 1000,
            loss_scale_hysteresis: 2,
            loss_scale_min: 1.0,
            loss_scale_growth_factor: 2.0,
            loss_scale_backoff_factor: 0.5,
            ema_decay: 0.0,
        }
    }
}

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelSection {
            pp: 1,
            dp: 1,
            microbatches: 1,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            layers_per_stage: Vec::new(),
            zero: 0,
            reshard_after_forward: true,
            tp: 1,
            tp_slices: 1,
            sp: false,
            // A rank waits on its peers for about one block's compute; a
            // minute is far beyond that at any size this trainer runs, and
            // ten times sooner than the fixed wait it replaces.
            tp_timeout_s: 60.0,
        }
    }
}

impl Default for BackendSection {
    fn default() -> Self {
        BackendSection { kind: BackendKind::Cpu, threads: 0, devices: vec![], dtype: Dtype::Bf16 }
    }
}

/// Where a config came from, as error messages should name it.
const DEFAULT_ORIGIN: &str = "<embedded default config>";

/// Everything that can be wrong with a config, each naming where.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{origin}: cannot read config file: {error}")]
    Read { origin: String, error: std::io::Error },
    /// Not TOML at all; `message` carries TOML's line, column and excerpt.
    #[error("{origin}: {message}")]
    Syntax { origin: String, message: String },
    /// A `--set` argument that is malformed or names no known field.
    #[error("--set {arg}: {reason}")]
    Override { arg: String, reason: String },
    /// Well-formed TOML that does not fit the schema (wrong type, unknown key).
    #[error("{origin}: {path}: {message}")]
    Schema { origin: String, path: String, message: String },
    /// Values that fit the schema but break a rule; one line per problem.
    #[error("{}", display_problems(.0))]
    Invalid(Vec<Problem>),
}

fn display_problems(problems: &[Problem]) -> String {
    let lines: Vec<String> = problems.iter().map(Problem::to_string).collect();
    lines.join("\n")
}

impl ConfigError {
    /// The broken rules, when this is a validation error (empty otherwise).
    pub fn problems(&self) -> &[Problem] {
        match self {
            ConfigError::Invalid(problems) => problems,
            _ => &[],
        }
    }
}

impl Config {
    /// Reads the config at `path` (the embedded default when `None`), applies
    /// `--set section.key=value` overrides to the TOML tree, then
    /// deserializes. Does not validate: call [`Config::validate`].
    /// A `--set optim.lr` alone scales `optim.min_lr` with it
    /// (see `floor_follows_peak`); on the embedded default a `--set data.train`
    /// turns the built-in corpus off (see `settle_data`).
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Config, ConfigError> {
        match path {
            None => Config::parse_with(DEFAULT_TOML, DEFAULT_ORIGIN, overrides, true),
            Some(path) => {
                let origin = path.display().to_string();
                let cap = "a config file may hold";
                let text = crate::fsutil::read_regular_to_string(path, crate::fsutil::MAX_CONFIG_BYTES, cap)
                    .map_err(|error| ConfigError::Read { origin: origin.clone(), error })?;
                Config::parse(&text, &origin, overrides)
            }
        }
    }

    /// [`Config::load`] for text already in memory (a checkpoint's stored
    /// config, a test); `origin` is how errors name it.
    pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<Config, ConfigError> {
        Config::parse_with(text, origin, overrides, false)
    }

    /// [`Config::parse`]; `embedded` says `text` is the embedded default, whose
    /// built-in corpus a named training file replaces (see [`settle_data`]).
    fn parse_with(
        text: &str,
        origin: &str,
        overrides: &[String],
        embedded: bool,
    ) -> Result<Config, ConfigError> {
        let mut tree: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            origin: origin.to_string(),
            message: e.to_string().trim_end().to_string(),
        })?;
        let before = lr_and_floor(&tree);
        let mut overridden = Vec::with_capacity(overrides.len());
        for arg in overrides {
            overridden.push((apply_override(&mut tree, arg)?, arg));
        }
        let given: Vec<&str> = overridden.iter().map(|(p, _)| p.as_str()).collect();
        if embedded {
            settle_data(&mut tree, &given);
        }
        floor_follows_peak(&mut tree, &given, before);
        serde_path_to_error::deserialize::<_, Config>(tree).map_err(|err| {
            // The path ends with the offending key, unknown keys included.
            let path = err.path().to_string();
            let message = err.inner().message().to_string();
            // A bad value that came from the command line is not the file's fault.
            // The last `--set` of a key is the one in force.
            let origin = match overridden.iter().rev().find(|(p, _)| *p == path) {
                Some((_, arg)) => format!("--set {arg}"),
                None => origin.to_string(),
            };
            ConfigError::Schema { origin, path, message }
        })
    }

    /// The model of a validated config.
    pub fn arch(&self) -> crate::model::Arch {
        self.model.arch().unwrap_or_else(|p| panic!("the model of a validated config: {p:?}"))
    }

    /// Checks every rule a run depends on and reports all broken ones, each as
    /// `field path: value given: what was expected`: each section's own
    /// rules (the model's live with the model, `model::section`), then the
    /// rules that tie sections together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut v = Checks::default();
        self.model.check(&mut v);
        self.check_train(&mut v);
        self.check_data(&mut v);
        self.check_optim(&mut v);
        self.check_loss_scale(&mut v);
        self.check_ema(&mut v);
        self.check_parallel(&mut v);
        self.check_zero(&mut v);
        self.check_tp(&mut v);
        self.check_backend(&mut v);
        self.check_sim(&mut v);
        self.check_recovery(&mut v);
        self.check_checkpoint(&mut v);
        self.check_replay(&mut v);
        finish(v)
    }

    /// `[train]`: counts that must be positive.
    fn check_train(&self, v: &mut Checks) {
        for (path, value) in [
            ("train.steps", self.train.steps),
            ("train.micro_batch_size", self.train.micro_batch_size),
            ("train.eval_batches", self.train.eval_batches),
        ] {
            v.check(value > 0, path, value, "must be > 0");
        }
        self.check_batch_ramp(v);
    }

    /// `train.batch_ramp`: every size it reaches splits into whole
    /// microbatches on every replica, so each step's global microbatches —
    /// and with them the gradient tree and the data — are the same at any
    /// layout with this dp.
    fn check_batch_ramp(&self, v: &mut Checks) {
        let Some(r) = &self.train.batch_ramp else { return };
        let (p, b) = (&self.parallel, self.train.micro_batch_size);
        let unit = p.dp * b;
        let full = unit * p.microbatches;
        let whole = format!(
            "must be a multiple of parallel.dp × train.micro_batch_size ({} × {b} = {unit} sequences), \
             so every replica gets whole microbatches",
            p.dp
        );
        v.check(
            r.start > 0 && r.start.is_multiple_of(unit.max(1)),
            "train.batch_ramp.start",
            r.start,
            &whole,
        );
        v.check(
            r.start < full,
            "train.batch_ramp.start",
            r.start,
            format!(
                "must be below the full global batch (parallel.dp × parallel.microbatches × \
                 train.micro_batch_size = {full} sequences)"
            ),
        );
        v.check(
            r.increment > 0 && r.increment.is_multiple_of(unit.max(1)),
            "train.batch_ramp.increment",
            r.increment,
            &whole,
        );
        v.check(
            r.increment == 0 || r.start >= full || (full - r.start).is_multiple_of(r.increment),
            "train.batch_ramp.increment",
            r.increment,
            format!("must divide the growth from start to the full batch ({full} − {} sequences)", r.start),
        );
        v.check(r.tokens > 0, "train.batch_ramp.tokens", r.tokens, "must be > 0");
    }

    /// `[data]`: a built-in corpus or token files, never both.
    fn check_data(&self, v: &mut Checks) {
        let d = &self.data;
        self.check_data_sources(v);
        if d.builtin == Builtin::Files {
            v.check(
                !d.train.is_empty() || !d.sources.is_empty(),
                "data.train",
                quoted(&d.train),
                "a token file is required when data.builtin is \"\" \
                 (or set data.builtin = \"arithmetic\" or \"random\")",
            );
        } else {
            // Which one would be used is a guess the user should not have to make.
            for (path, value) in [("data.train", &d.train), ("data.val", &d.val)] {
                v.check(
                    value.is_empty(),
                    path,
                    quoted(value),
                    format!(
                        "must be empty when data.builtin = {} (a built-in corpus reads no files); \
                         to train on token files set data.builtin = \"\" (--set data.builtin=)",
                        quoted(d.builtin.name())
                    ),
                );
            }
        }
    }

    /// `[optim]`: the learning rates, decay, betas, eps and clipping.
    fn check_optim(&self, v: &mut Checks) {
        let o = &self.optim;
        let lr_ok = o.lr > 0.0 && o.lr.is_finite();
        v.check(lr_ok, "optim.lr", o.lr, "must be finite and > 0");
        // Each check states what must hold, so NaN (every comparison false)
        // fails it. A broken lr is reported once, not again through min_lr.
        v.check(
            o.min_lr >= 0.0 && (o.min_lr <= o.lr || !lr_ok),
            "optim.min_lr",
            o.min_lr,
            format!(
                "must be >= 0 and <= optim.lr ({}); set a floor at most the peak, e.g. --set optim.min_lr={}",
                o.lr,
                o.lr / 10.0
            ),
        );
        // warmup_steps > train.steps is allowed on purpose: a short trial run
        // (`--steps 3`) of a long config simply stays in warmup.
        v.check(
            o.decay_frac > 0.0 && o.decay_frac <= 1.0,
            "optim.decay_frac",
            o.decay_frac,
            "must be in (0, 1]",
        );
        v.check(
            o.weight_decay >= 0.0 && o.weight_decay.is_finite(),
            "optim.weight_decay",
            o.weight_decay,
            "must be finite and >= 0",
        );
        for (path, value) in [("optim.beta1", o.beta1), ("optim.beta2", o.beta2)] {
            v.check((0.0..1.0).contains(&value), path, value, "must be in [0, 1)");
        }
        v.check(o.eps > 0.0 && o.eps.is_finite(), "optim.eps", o.eps, "must be finite and > 0");
        v.check(
            o.grad_clip >= 0.0 && o.grad_clip.is_finite(),
            "optim.grad_clip",
            o.grad_clip,
            "must be finite and >= 0 (0 disables clipping)",
        );
    }

    /// `[optim]`'s loss scaler: powers of two that grow and back off.
    fn check_loss_scale(&self, v: &mut Checks) {
        let o = &self.optim;
        let pow2 = |x: f64| x > 0.0 && x.is_finite() && x.log2().fract() == 0.0;
        v.check(
            pow2(o.loss_scale_init),
            "optim.loss_scale_init",
            o.loss_scale_init,
            "must be a power of two",
        );
        v.check(pow2(o.loss_scale_min), "optim.loss_scale_min", o.loss_scale_min, "must be a power of two");
        v.check(
            o.loss_scale_growth_interval >= 1,
            "optim.loss_scale_growth_interval",
            o.loss_scale_growth_interval,
            "must be >= 1",
        );
        v.check(
            o.loss_scale_hysteresis >= 1,
            "optim.loss_scale_hysteresis",
            o.loss_scale_hysteresis,
            "must be >= 1",
        );
        v.check(
            pow2(o.loss_scale_growth_factor) && o.loss_scale_growth_factor > 1.0,
            "optim.loss_scale_growth_factor",
            o.loss_scale_growth_factor,
            "must be a power of two > 1 (2, 4, …)",
        );
        v.check(
            pow2(o.loss_scale_backoff_factor) && o.loss_scale_backoff_factor < 1.0,
            "optim.loss_scale_backoff_factor",
            o.loss_scale_backoff_factor,
            "must be a power of two < 1 (0.5, 0.25, …)",
        );
    }

    /// `optim.ema_decay`: a decay in [0, 1), and an EMA only where weights
    /// are computed (the CPU and CUDA backends, not the simulated one).
    fn check_ema(&self, v: &mut Checks) {
        let d = self.optim.ema_decay;
        v.check((0.0..1.0).contains(&d), "optim.ema_decay", d, "must be in [0, 1) (0 keeps no EMA)");
        if d > 0.0 {
            let kind = self.backend.kind;
            v.check(
                kind != BackendKind::Sim,
                "optim.ema_decay",
                d,
                format!(
                    "must be 0 with backend.kind = \"{}\": the simulated backend computes no weights to average",
                    kind.name()
                ),
            );
        }
    }

    /// `[parallel]`: the pipeline's shape against the model and the schedule.
    fn check_parallel(&self, v: &mut Checks) {
        let p = &self.parallel;
        for (path, value) in
            [("parallel.pp", p.pp), ("parallel.dp", p.dp), ("parallel.microbatches", p.microbatches)]
        {
            v.check(value >= 1, path, value, "must be >= 1");
        }
        v.check(
            p.pp <= self.model.n_layer,
            "parallel.pp",
            p.pp,
            format!(
                "must be <= model.n_layer ({}): every stage needs at least one block",
                self.model.n_layer
            ),
        );
        v.check(
            p.chunks >= 1 && p.schedule.chunks_for(p.chunks).is_some(),
            "parallel.chunks",
            p.chunks,
            "must be >= 1, and more than 1 only with parallel.schedule = \"interleaved\" (or 2 with \"zb-v\" \
             or \"dualpipev\")",
        );
        let least = p.schedule.min_microbatches(p.pp);
        v.check(
            p.microbatches == 0 || p.microbatches >= least,
            "parallel.microbatches",
            p.microbatches,
            format!(
                "parallel.schedule = \"{}\" needs at least {least} (one per stage: 2 × parallel.pp = {})",
                p.schedule, p.pp
            ),
        );
        v.check(
            !(p.schedule.splits_backward() && self.train.recompute == Recompute::Full),
            "train.recompute",
            self.train.recompute,
            "the split backward of the zero-bubble schedules (zb-h1, zb-v, dualpipev) keeps activations until W; \
             \"full\" is not supported with them (\"selective\" and \"none\" are)",
        );
    }

    /// `[backend]`: GPU ordinals per rank, and what the GPU backend runs.
    fn check_backend(&self, v: &mut Checks) {
        let (p, devices) = (&self.parallel, &self.backend.devices);
        let per_rank = p.pp * p.tp;
        v.check(
            devices.is_empty()
                || (self.backend.kind == BackendKind::Cuda
                    && (devices.len() == per_rank || devices.len() == per_rank * p.dp)),
            "backend.devices",
            format!("{devices:?}"),
            format!(
                "one GPU ordinal per pipeline rank (parallel.pp = {}){} ({per_rank} entries) or per rank and \
                 replica ({} entries), and only with backend.kind = \"cuda\"",
                p.pp,
                if p.tp > 1 { format!(" and tensor-parallel rank (parallel.tp = {})", p.tp) } else { String::new() },
                per_rank * p.dp
            ),
        );
        let mixed = devices.chunks(p.tp.max(1)).find(|g| {
            let distinct: std::collections::BTreeSet<_> = g.iter().collect();
            distinct.len() != 1 && distinct.len() != g.len()
        });
        v.check(
            mixed.is_none(),
            "backend.devices",
            format!("{devices:?}"),
            format!(
                "each pipeline rank's {} tensor-parallel GPUs must be all different (NCCL between them) or all \
                 the same (the ranks take turns on it); {:?} is neither",
                p.tp,
                mixed.unwrap_or_default()
            ),
        );
        v.check(
            self.backend.kind != BackendKind::Cuda || !p.schedule.splits_backward(),
            "parallel.schedule",
            p.schedule,
            "the split backward (I and W) of zero-bubble schedules (zb-h1, zb-v, dualpipev) is built for the CPU \
             backend only; \
             with backend.kind = \"cuda\" use gpipe, 1f1b or interleaved",
        );
    }

    /// `[sim]`: the simulated costs, and a factor per stage.
    fn check_sim(&self, v: &mut Checks) {
        let sim = &self.sim;
        // The sim backend sleeps each action's time (times its stage factor
        // and jitter) as a Duration, which panics past 2^64 s; far below
        // that, an action of more than a minute is a typo, not a simulation.
        v.check(
            (0.0..=MAX_SIM_MS).contains(&sim.forward_ms),
            "sim.forward_ms",
            format!("{:?}", sim.forward_ms),
            format!("must be in [0, {MAX_SIM_MS}] ms"),
        );
        v.check(
            sim.weight_ms >= 0.0 && sim.backward_ms >= sim.weight_ms && sim.backward_ms <= MAX_SIM_MS,
            "sim.backward_ms",
            format!("{:?}", sim.backward_ms),
            format!("must be in [sim.weight_ms ({}), {MAX_SIM_MS}] ms, sim.weight_ms >= 0", sim.weight_ms),
        );
        v.check((0.0..1.0).contains(&sim.jitter), "sim.jitter", sim.jitter, "must be in [0, 1)");
        v.check(
            sim.stage_factors.iter().all(|f| *f > 0.0 && *f <= MAX_STAGE_FACTOR),
            "sim.stage_factors",
            format!("{:?}", sim.stage_factors),
            format!("every factor must be in (0, {MAX_STAGE_FACTOR}]"),
        );
        let stages = self.parallel.pp * self.parallel.chunks;
        v.check(
            sim.stage_factors.is_empty() || sim.stage_factors.len() == stages,
            "sim.stage_factors",
            format!("{:?}", sim.stage_factors),
            format!("one factor per stage: parallel.pp × parallel.chunks = {stages} (or none)"),
        );
    }

    /// `[recovery]`: the shutdown wait and the spike detector.
    fn check_recovery(&self, v: &mut Checks) {
        let r = &self.recovery;
        v.check(
            r.shutdown_timeout_s > 0.0 && r.shutdown_timeout_s <= MAX_SHUTDOWN_TIMEOUT_S,
            "recovery.shutdown_timeout_s",
            format!("{:?}", r.shutdown_timeout_s),
            format!("must be a number of seconds in (0, {MAX_SHUTDOWN_TIMEOUT_S}]"),
        );
        v.check(
            r.lr_factor > 0.0 && r.lr_factor <= 1.0,
            "recovery.lr_factor",
            r.lr_factor,
            "must be in (0, 1]",
        );
        v.check(r.spike_window >= 2, "recovery.spike_window", r.spike_window, "must be >= 2");
        v.check(r.spike_factor >= 0.0, "recovery.spike_factor", r.spike_factor, "must be >= 0 (0: off)");
        v.check(r.spike_zscore >= 0.0, "recovery.spike_zscore", r.spike_zscore, "must be >= 0 (0: off)");
    }

    /// `[checkpoint]`: a fallback behind the newest.
    fn check_checkpoint(&self, v: &mut Checks) {
        v.check(
            self.checkpoint.keep >= 2,
            "checkpoint.keep",
            self.checkpoint.keep,
            "must be >= 2, so a damaged newest checkpoint has a fallback",
        );
    }

    /// `[replay]`: the actors whose payloads are kept exist.
    fn check_replay(&self, v: &mut Checks) {
        for a in &self.replay.payloads {
            v.check(
                self.actor_exists(a),
                "replay.payloads",
                quoted(a),
                "an actor of this run (\"all\", \"coordinator\", \"reducer\", \"monitor\", \"checkpointer\", \"loader-R\", \"stage-S\" or \"stage-S.R\")",
            );
        }
    }

    /// ZeRO shares state out between replicas, so it needs more than one,
    /// and only the CPU backend implements it.
    fn check_zero(&self, v: &mut Checks) {
        let p = &self.parallel;
        v.check(p.zero <= 3, "parallel.zero", p.zero, "must be 0, 1, 2 or 3");
        if p.zero >= 1 {
            let why = format!(
                "parallel.zero = {} shares training state between replicas: needs parallel.dp >= 2",
                p.zero
            );
            v.check(p.dp >= 2, "parallel.dp", p.dp, &why);
            let kind = self.backend.kind;
            let why = format!(
                "must be \"cpu\" with parallel.zero = {} (ZeRO runs on the CPU backend only)",
                p.zero
            );
            v.check(kind == BackendKind::Cpu, "backend.kind", kind.name(), &why);
        }
        v.check(
            p.reshard_after_forward || p.zero == 3,
            "parallel.reshard_after_forward",
            p.reshard_after_forward,
            "may be false only with parallel.zero = 3 (no other level gathers weights for a forward)",
        );
    }

    /// Tensor parallelism cuts heads into whole slices and each rank takes
    /// whole slices; a GPU joins at most 64 subtree sums in one kernel.
    fn check_tp(&self, v: &mut Checks) {
        let p = &self.parallel;
        v.check(p.tp >= 1 && p.tp.is_power_of_two(), "parallel.tp", p.tp, "must be a power of two >= 1");
        v.check(
            p.tp_slices >= 1 && p.tp_slices.is_power_of_two(),
            "parallel.tp_slices",
            p.tp_slices,
            "must be a power of two >= 1",
        );
        if p.tp.is_power_of_two() && p.tp_slices.is_power_of_two() {
            v.check(
                p.tp_slices.is_multiple_of(p.tp),
                "parallel.tp_slices",
                p.tp_slices,
                format!(
                    "must be a multiple of parallel.tp = {} (each rank sums whole slices; runs with the same \
                     tp_slices give the same bits at every tp dividing it)",
                    p.tp
                ),
            );
            v.check(
                self.model.n_head.is_multiple_of(p.tp_slices),
                "parallel.tp_slices",
                p.tp_slices,
                format!("must divide model.n_head = {} (a slice is whole heads)", self.model.n_head),
            );
            // Every family's heads split the same way: a rank holds whole key/value groups.
            // (With a key/value head per query head the heads' rule above says it all.)
            let kv = self.model.kv_heads();
            let grouped = kv != self.model.n_head;
            v.check(
                !grouped || kv.is_multiple_of(p.tp),
                "parallel.tp",
                p.tp,
                format!(
                    "must divide the key/value heads = {kv} (model.n_kv_head: each rank holds whole groups)"
                ),
            );
            v.check(
                !grouped || !kv.is_multiple_of(p.tp) || kv.is_multiple_of(p.tp_slices),
                "parallel.tp_slices",
                p.tp_slices,
                format!("must divide the key/value heads = {kv} (model.n_kv_head: a slice is whole groups)"),
            );
            if let Ok(arch) = self.model.arch() {
                v.check(
                    arch.ffn.is_multiple_of(p.tp_slices),
                    "parallel.tp_slices",
                    p.tp_slices,
                    format!("must divide the MLP's width = {} (model.intermediate_size)", arch.ffn),
                );
            }
        }
        let kind = self.backend.kind;
        v.check(
            (p.tp == 1 && p.tp_slices == 1) || kind != BackendKind::Sim,
            "backend.kind",
            kind.name(),
            "must be \"cpu\" or \"cuda\" with parallel.tp or parallel.tp_slices above 1 (the simulated \
             backend does not split stages)",
        );
        v.check(
            kind != BackendKind::Cuda || p.tp_slices <= 64,
            "parallel.tp_slices",
            p.tp_slices,
            "must be at most 64 with backend.kind = \"cuda\" (one kernel joins the slices' sums)",
        );
        v.check(
            p.tp_timeout_s > 0.0 && p.tp_timeout_s <= TP_TIMEOUT_MAX_S,
            "parallel.tp_timeout_s",
            p.tp_timeout_s,
            format!("must be a number of seconds in (0, {TP_TIMEOUT_MAX_S}]"),
        );
        if p.sp {
            v.check(
                p.tp >= 2,
                "parallel.sp",
                p.sp,
                "needs parallel.tp >= 2: sequence parallelism shares rows out between tensor-parallel ranks",
            );
            let rows = self.train.micro_batch_size * self.model.block_size;
            v.check(
                p.tp < 2 || !p.tp.is_power_of_two() || rows.is_multiple_of(p.tp),
                "parallel.sp",
                p.sp,
                format!(
                    "needs parallel.tp = {} to divide a microbatch's rows, train.micro_batch_size × \
                     model.block_size = {rows} (each rank takes an equal run of them)",
                    p.tp
                ),
            );
            v.check(
                kind == BackendKind::Cpu,
                "parallel.sp",
                p.sp,
                format!(
                    "is built for the CPU backend only; with backend.kind = \"{}\" leave it false",
                    kind.name()
                ),
            );
        }
    }

    /// `[[data.sources]]`: each entry's own rules, and no `data.train` or
    /// built-in corpus beside them (which one would be read is a guess).
    fn check_data_sources(&self, v: &mut Checks) {
        let d = &self.data;
        if d.sources.is_empty() {
            return;
        }
        for (path, value, expected) in crate::data::mixture::problems(&d.sources) {
            v.check(false, &path, value, expected);
        }
        v.check(
            d.train.is_empty(),
            "data.train",
            quoted(&d.train),
            "must be empty when [[data.sources]] is given (the sources are the training data)",
        );
        v.check(
            d.builtin == Builtin::Files,
            "data.builtin",
            quoted(d.builtin.name()),
            "must be \"\" when [[data.sources]] is given (a built-in corpus reads no files)",
        );
    }

    /// Checks only what evaluating saved weights on a token file uses: the
    /// model's shape and the token file format. Pipeline, optimizer and
    /// training settings are left alone: `eval` never reads them.
    pub fn validate_for_eval(&self) -> Result<(), ConfigError> {
        let mut v = Checks::default();
        self.model.check(&mut v);
        finish(v)
    }

    /// Whether `name` is an actor of a run with this config (or "all").
    pub fn actor_exists(&self, name: &str) -> bool {
        let (pp, dp) = (self.parallel.pp, self.parallel.dp);
        let index = |s: &str, n: usize| s.parse::<usize>().is_ok_and(|i| i < n) && !s.starts_with('+');
        match name {
            "all" | "coordinator" | "monitor" | "checkpointer" => true,
            "reducer" => dp > 1,
            _ => {
                if let Some(r) = name.strip_prefix("loader-") {
                    return index(r, dp);
                }
                let Some(rest) = name.strip_prefix("stage-") else { return false };
                match rest.split_once('.') {
                    Some((s, r)) => index(s, pp) && index(r, dp) && r != "0",
                    None => index(rest, pp),
                }
            }
        }
    }

    /// The resolved config as TOML: every field, defaults filled in and
    /// overrides applied, so a result can be reproduced from it alone.
    pub fn to_toml_string(&self) -> String {
        // Only plain scalars in tables, which TOML can always express.
        toml::to_string(self).expect("a Config always serializes to TOML")
    }

    /// blake3 of [`Config::to_toml_string`], in hex: names a run's settings.
    pub fn hash(&self) -> String {
        blake3::hash(self.to_toml_string().as_bytes()).to_hex().to_string()
    }
}

/// Applies one `section.key=value` to the tree and returns `section.key`.
fn apply_override(tree: &mut toml::Table, arg: &str) -> Result<String, ConfigError> {
    let fail = |reason: String| ConfigError::Override { arg: arg.to_string(), reason };
    let (key, raw) = arg.split_once('=').ok_or_else(|| fail("expected section.key=value".into()))?;
    let key = key.trim();
    let (section, field) =
        key.split_once('.').ok_or_else(|| fail(format!("`{key}` is not of the form section.key")))?;
    let schema = schema();
    let Some(toml::Value::Table(fields)) = schema.get(section) else {
        let known: Vec<&str> = schema.keys().map(String::as_str).collect();
        return Err(fail(format!("unknown section `{section}`, expected one of {}", known.join(", "))));
    };
    // A nested table's key (`model.rope_scaling.factor`): walk the schema and the tree together.
    let mut path: Vec<&str> = field.split('.').collect();
    let last = path.pop().expect("split gives at least one piece");
    let (mut fields, mut at) = (fields, format!("[{section}]"));
    for p in &path {
        match fields.get(*p) {
            Some(toml::Value::Table(t)) => fields = t,
            _ => {
                let known: Vec<&str> = fields.keys().map(String::as_str).collect();
                return Err(fail(format!(
                    "unknown table `{p}` in {at}, expected one of {}",
                    known.join(", ")
                )));
            }
        }
        at = format!("{}.{p}]", at.trim_end_matches(']'));
    }
    let Some(default) = fields.get(last) else {
        let known: Vec<&str> = fields.keys().map(String::as_str).collect();
        return Err(fail(format!("unknown key `{last}` in {at}, expected one of {}", known.join(", "))));
    };
    // A string field takes the text as given, so `data.train=2024` stays a
    // file name instead of becoming an integer.
    let value = match (raw.parse::<toml::Value>(), default) {
        (Ok(parsed), toml::Value::String(_)) if !parsed.is_str() => toml::Value::String(raw.to_string()),
        (Ok(parsed), _) => parsed,
        (Err(_), _) => toml::Value::String(raw.to_string()),
    };
    let mut table = tree.entry(section.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
    for p in &path {
        let toml::Value::Table(t) = table else {
            return Err(fail(format!("`{section}` in the config is not a table")));
        };
        table = t.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
    }
    let toml::Value::Table(table) = table else {
        return Err(fail(format!("`{key}`'s table in the config is not a table")));
    };
    table.insert(last.to_string(), value);
    Ok(key.to_string())
}

/// The schema `--set` checks keys against, read off the defaults (which
/// serialize every field), with the model's optional keys that the defaults
/// leave unset given a value of their type.
fn schema() -> toml::Table {
    let mut schema = toml::Table::try_from(Config::default()).expect("defaults serialize");
    if let Some(toml::Value::Table(model)) = schema.get_mut("model") {
        for (k, v) in crate::model::section::OPTIONAL_KEYS {
            model.insert(k.to_string(), toml::Value::Boolean(v));
        }
    }
    // Absent from the defaults, yet `--set` may name it or its keys.
    if let Some(toml::Value::Table(train)) = schema.get_mut("train") {
        let ramp = BatchRamp { start: 0, increment: 0, tokens: 0 };
        train.insert("batch_ramp".into(), toml::Value::try_from(ramp).expect("a ramp serializes"));
    }
    schema
}

/// A user who names a training file (`--set data.train=tok.bin`) on the
/// embedded default means to train on it; the default's built-in corpus
/// (`data.builtin = "arithmetic"`) is only the default's choice, so it gives
/// way unless `data.builtin` is set too. A config file's own `builtin` is the
/// user's choice: a conflict with it is refused by [`Config::validate`], which
/// says what to set.
fn settle_data(tree: &mut toml::Table, given: &[&str]) {
    if given.contains(&"data.builtin") || !given.contains(&"data.train") {
        return;
    }
    if let Some(toml::Value::Table(data)) = tree.get_mut("data") {
        if data.get("train").and_then(toml::Value::as_str).is_some_and(|t| !t.is_empty()) {
            data.insert("builtin".into(), toml::Value::String(String::new()));
        }
    }
}

/// `optim.lr` and `optim.min_lr` as the config text gives them, the schema's
/// defaults where it does not; `None` where one is not a number (the schema
/// check names it).
fn lr_and_floor(tree: &toml::Table) -> Option<(f64, f64)> {
    let d = OptimSection::default();
    let optim = tree.get("optim").and_then(toml::Value::as_table);
    let get = |key: &str, default: f64| match optim.and_then(|o| o.get(key)) {
        None => Some(default),
        Some(toml::Value::Float(x)) => Some(*x),
        Some(toml::Value::Integer(i)) => Some(*i as f64),
        Some(_) => None,
    };
    Some((get("lr", d.lr)?, get("min_lr", d.min_lr)?))
}

/// The learning-rate floor follows the peak unless set: where `--set` changes
/// `optim.lr` and does not give `optim.min_lr`, the floor keeps the config's
/// ratio to the peak (the default's 3e-3 → 3e-4 becomes 1e-4 → 1e-5), as
/// torchtitan states its floor as a fraction of the peak. Without such a
/// `--set` nothing changes, bit for bit.
fn floor_follows_peak(tree: &mut toml::Table, given: &[&str], before: Option<(f64, f64)>) {
    if !given.contains(&"optim.lr") || given.contains(&"optim.min_lr") {
        return;
    }
    let (Some((lr0, min0)), Some((lr, _))) = (before, lr_and_floor(tree)) else { return };
    // A broken peak, old or new, is for validation to name, not to scale by.
    if !(lr0 > 0.0 && lr0.is_finite() && lr > 0.0 && lr.is_finite()) {
        return;
    }
    // A ratio that overflows (1e300 over 1e-300) scales nothing either.
    let floor = lr / lr0 * min0;
    if let (true, Some(toml::Value::Table(optim))) = (floor.is_finite(), tree.get_mut("optim")) {
        optim.insert("min_lr".into(), toml::Value::Float(floor));
    }
}
/// The config's verdict: fine, or every problem at once.
fn finish(v: Checks) -> Result<(), ConfigError> {
    if v.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid(v.problems))
    }
}

/// Settings that are valid but probably not what was meant: said before a
/// run starts, naming the field, never refused.
impl Config {
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        out.extend(self.warmup_warning());
        out.extend(self.microbatch_warning());
        out
    }

    fn warmup_warning(&self) -> Option<String> {
        let (w, steps) = (self.optim.warmup_steps, self.train.steps);
        (w > 0 && w >= steps).then(|| {
            format!(
                "optim.warmup_steps = {w} covers all of train.steps = {steps}: the learning rate never leaves \
                 warmup (at most {:.3e} of optim.lr = {}); lower optim.warmup_steps for a full run",
                steps as f64 / w as f64,
                self.optim.lr
            )
        })
    }

    fn microbatch_warning(&self) -> Option<String> {
        let (p, m) = (self.parallel.pp, self.parallel.microbatches);
        (m < p && m > 0).then(|| {
            let bubble = (p - 1) as f64 / (m + p - 1) as f64;
            format!(
                "parallel.microbatches = {m} is fewer than parallel.pp = {p}: at most {m} of {p} ranks work at \
                 once, a bubble of (p−1)/(m+p−1) = {:.0}% of each step; use at least {p} microbatches",
                100.0 * bubble
            )
        })
    }

    /// `launch --nodes N`: the run's pp × dp × tp ranks must split evenly
    /// over the processes, each holding whole stages or an equal share of
    /// one stage's tp ranks; checked before any process starts.
    pub fn check_processes(&self, nodes: usize) -> Result<(), ConfigError> {
        let (pp, dp, tp) = (self.parallel.pp, self.parallel.dp, self.parallel.tp);
        let slots = pp * dp * tp;
        let mut v = Checks::default();
        let even = nodes >= 1 && slots.is_multiple_of(nodes.max(1));
        v.check(
            even,
            "parallel.pp × parallel.dp × parallel.tp",
            slots,
            format!(
                "launch --nodes {nodes}: the {pp} × {dp} × {tp} ranks must split evenly over the processes \
                 (--nodes a divisor of {slots})"
            ),
        );
        let per = slots / nodes.max(1);
        v.check(
            !even || per.is_multiple_of(tp) || tp.is_multiple_of(per),
            "parallel.tp",
            tp,
            format!(
                "launch --nodes {nodes}: {per} ranks per process would cut a stage's {tp} tensor-parallel \
                 ranks unevenly: each process must hold whole stages ({tp} divides {per}) or an equal share \
                 of one stage's ranks ({per} divides {tp})"
            ),
        );
        v.check(
            !even || tp == 1 || self.backend.kind != BackendKind::Cuda || per.is_multiple_of(tp),
            "parallel.tp",
            tp,
            format!(
                "launch --nodes {nodes}: with backend.kind = \"cuda\" a stage's {tp} tensor-parallel GPUs are \
                 driven by the stage's process (NCCL inside a node), so each process holds whole stages: \
                 {per} ranks per process is not a multiple of {tp}"
            ),
        );
        // `launch` starts its processes on this machine, so they share its
        // GPUs: NCCL takes one rank per GPU, and two processes' ranks on one
        // GPU would be refused (or hang) at their first exchange. Found by
        // the emulated GPU (its NCCL refused dp 2 × pp 2 over [0, 1]).
        let n_devices = self.backend.devices.len();
        if even
            && self.backend.kind == BackendKind::Cuda
            && (n_devices == 0 || n_devices == pp * tp || n_devices == pp * dp * tp)
        {
            let per_process = slots / nodes.max(1);
            let mut users: std::collections::BTreeMap<usize, (usize, usize, usize)> = Default::default();
            'ranks: for replica in 0..dp {
                for rank in 0..pp {
                    let ordinals = gpu_ordinals(&self.backend.devices, pp, tp, rank, replica);
                    for (t, &gpu) in ordinals.iter().enumerate() {
                        let process = ((replica * pp + rank) * tp + t) / per_process.max(1);
                        match users.get(&gpu) {
                            Some(&(p, r0, s0)) if p != process => {
                                v.check(
                                    false,
                                    "backend.devices",
                                    format!("{:?}", self.backend.devices),
                                    format!(
                                        "launch --nodes {nodes} runs its processes on this machine, sharing its \
                                         GPUs: replica {r0} stage {s0} (process {p}) and replica {replica} stage \
                                         {rank} (process {process}) both use GPU {gpu}, and NCCL takes one rank \
                                         per GPU; give each process its own GPUs (one entry per rank and replica: \
                                         {} entries)",
                                        pp * dp * tp
                                    ),
                                );
                                break 'ranks;
                            }
                            Some(_) => {}
                            None => {
                                users.insert(gpu, (process, replica, rank));
                            }
                        }
                    }
                }
            }
        }
        finish(v)
    }
}

/// The GPU ordinals of pipeline rank `rank`'s tensor-parallel ranks in
/// replica `replica`, from `backend.devices`: `tp` entries per rank, ranks
/// in order, optionally per replica (replica-major); empty: all GPU 0.
pub fn gpu_ordinals(devices: &[usize], pp: usize, tp: usize, rank: usize, replica: usize) -> Vec<usize> {
    let first = match devices.len() {
        0 => return vec![0; tp],
        n if n == pp * tp => rank * tp,
        _ => (replica * pp + rank) * tp,
    };
    devices[first..first + tp].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, "configs/x.toml", &[])
    }

    fn with_set(overrides: &[&str]) -> Result<Config, ConfigError> {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        Config::load(None, &overrides)
    }

    #[test]
    fn a_repeated_set_of_one_key_blames_the_last_which_is_the_one_in_force() {
        let err = with_set(&["train.steps=5", "train.steps=five"]).unwrap_err().to_string();
        assert!(err.starts_with("--set train.steps=five:"), "{err}");
        assert_eq!(with_set(&["train.steps=five", "train.steps=5"]).unwrap().train.steps, 5, "the last wins");
    }

    fn valid() -> Config {
        Config::load(None, &[]).unwrap()
    }

    /// Validates `config` and returns the broken rules' paths.
    fn broken(config: &Config) -> Vec<String> {
        match config.validate() {
            Ok(()) => vec![],
            Err(e) => e.problems().iter().map(|p| p.path.clone()).collect(),
        }
    }

    /// Asserts that exactly the rule at `path` is broken.
    fn refused(config: &Config, path: &str) -> String {
        let err = config.validate().expect_err(&format!("config should be refused at {path}"));
        let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, [path], "{err}");
        err.to_string()
    }

    #[test]
    fn loss_scale_factors_and_the_shutdown_timeout_are_checked_by_name() {
        for (set, path) in [
            ("optim.loss_scale_growth_factor=3", "optim.loss_scale_growth_factor"),
            ("optim.loss_scale_growth_factor=1", "optim.loss_scale_growth_factor"),
            ("optim.loss_scale_backoff_factor=0.3", "optim.loss_scale_backoff_factor"),
            ("optim.loss_scale_backoff_factor=2", "optim.loss_scale_backoff_factor"),
            ("recovery.shutdown_timeout_s=0", "recovery.shutdown_timeout_s"),
        ] {
            let msg = refused(&with_set(&[set]).unwrap(), path);
            assert!(msg.contains(path), "{msg}");
        }
        let ok = ["optim.loss_scale_growth_factor=4", "optim.loss_scale_backoff_factor=0.25"];
        with_set(&ok).unwrap().validate().unwrap();
    }

    #[test]
    fn ema_decay_out_of_range_or_on_the_simulated_backend_is_refused_by_name() {
        for bad in ["-0.1", "1", "1.5", "nan"] {
            let msg = refused(&with_set(&[&format!("optim.ema_decay={bad}")]).unwrap(), "optim.ema_decay");
            assert!(msg.contains("[0, 1)"), "{msg}");
        }
        let mut c = with_set(&["optim.ema_decay=0.99"]).unwrap();
        c.backend.kind = BackendKind::Sim;
        let err = c.validate().expect_err("sim");
        let ema: Vec<_> = err.problems().iter().filter(|p| p.path == "optim.ema_decay").collect();
        assert_eq!(ema.len(), 1, "{err}");
        assert!(ema[0].expected.contains("computes no weights") && ema[0].expected.contains("sim"), "{err}");
        // The CUDA backend keeps it on the device beside the master weights.
        let mut c = with_set(&["optim.ema_decay=0.99", "backend.dtype=\"f32\""]).unwrap();
        c.backend.kind = BackendKind::Cuda;
        c.validate().unwrap();
        with_set(&["optim.ema_decay=0.999"]).unwrap().validate().unwrap();
        with_set(&["optim.ema_decay=0"]).unwrap().validate().unwrap();
    }

    #[test]
    fn embedded_default_loads_and_validates() {
        let config = valid();
        config.validate().unwrap();
        assert_eq!(config.data.builtin, Builtin::Arithmetic);
    }

    #[test]
    fn shipped_configs_all_load_and_validate() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let config = Config::load(Some(&path), &[]).unwrap();
                config.validate().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                seen += 1;
            }
        }
        assert!(seen >= 3, "expected default, bench-cpu and gpt2-124m in {dir:?}");
    }

    #[test]
    fn gpt2_124m_validates_without_its_data_files() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/gpt2-124m.toml");
        let config = Config::load(Some(&path), &[]).unwrap();
        assert!(!Path::new(&config.data.train).is_absolute());
        config.validate().unwrap();
        assert_eq!((config.model.n_layer, config.model.n_embd), (12, 768));
        assert_eq!(config.model.head_dim(), 64);
    }

    #[test]
    fn missing_sections_and_keys_take_defaults() {
        let config = parse("[data]\nbuiltin = \"arithmetic\"\n").unwrap();
        assert_eq!(config.model, ModelSection::default());
        assert_eq!(config.optim, OptimSection::default());
    }

    #[test]
    fn unknown_key_is_rejected_with_its_path() {
        let err = parse("[model]\nn_heads = 4\n").unwrap_err().to_string();
        assert!(err.starts_with("configs/x.toml: model.n_heads: unknown field `n_heads`"), "{err}");
        assert!(err.contains("expected one of"), "{err}");
    }

    #[test]
    fn unknown_section_is_rejected_with_its_name() {
        let err = parse("[modle]\nn_head = 4\n").unwrap_err().to_string();
        assert!(err.starts_with("configs/x.toml: modle: unknown field `modle`"), "{err}");
    }

    #[test]
    fn wrong_type_is_rejected_with_its_path() {
        let err = parse("[model]\nn_head = \"four\"\n").unwrap_err().to_string();
        assert_eq!(err, "configs/x.toml: model.n_head: invalid type: string \"four\", expected usize");
    }

    #[test]
    fn negative_size_is_rejected_with_its_path() {
        let err = parse("[train]\nsteps = -1\n").unwrap_err().to_string();
        assert!(err.starts_with("configs/x.toml: train.steps: invalid value"), "{err}");
    }

    #[test]
    fn integer_is_accepted_for_a_float_field() {
        assert_eq!(parse("[optim]\nlr = 1\n").unwrap().optim.lr, 1.0);
    }

    #[test]
    fn missing_config_file_names_the_file() {
        let err = Config::load(Some(Path::new("configs/no-such.toml")), &[]).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, ConfigError::Read { .. }));
        assert!(text.starts_with("configs/no-such.toml: cannot read config file"), "{text}");
    }

    #[test]
    fn malformed_toml_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broken.toml");
        std::fs::write(&path, "[model]\nn_layer = 4\nn_head = = 4\n").unwrap();
        let err = Config::load(Some(&path), &[]).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: ", path.display())), "{err}");
        assert!(err.contains("line 3, column"), "{err}");
    }

    #[test]
    fn set_override_replaces_value() {
        let config = with_set(&["optim.lr=3e-4", "model.n_layer=2"]).unwrap();
        assert_eq!(config.optim.lr, 3e-4);
        assert_eq!(config.model.n_layer, 2);
    }

    #[test]
    fn set_override_takes_unquoted_text_as_a_string() {
        let config = with_set(&["data.builtin=", "data.train=data/foo.bin"]).unwrap();
        assert_eq!(config.data.train, "data/foo.bin");
        assert_eq!(config.data.builtin, Builtin::Files);
        config.validate().unwrap();
    }

    #[test]
    fn set_override_of_a_string_field_keeps_numeric_text() {
        let config = with_set(&["data.val=2024"]).unwrap();
        assert_eq!(config.data.val, "2024");
    }

    #[test]
    fn set_override_adds_a_section_the_file_lacks() {
        let config = with_set(&["backend.threads=2"]).unwrap();
        assert_eq!(config.backend.threads, 2);
    }

    #[test]
    fn set_override_applies_in_order() {
        let config = with_set(&["train.steps=5", "train.steps=7"]).unwrap();
        assert_eq!(config.train.steps, 7);
    }

    #[test]
    fn set_override_of_unknown_key_is_rejected() {
        let err = with_set(&["model.n_heads=4"]).unwrap_err().to_string();
        assert!(err.starts_with("--set model.n_heads=4: unknown key `n_heads` in [model]"), "{err}");
        let err = with_set(&["modle.n_head=4"]).unwrap_err().to_string();
        assert!(err.starts_with("--set modle.n_head=4: unknown section `modle`"), "{err}");
    }

    #[test]
    fn set_override_without_equals_or_section_is_rejected() {
        let err = with_set(&["optim.lr"]).unwrap_err();
        assert!(matches!(err, ConfigError::Override { .. }), "{err}");
        let err = with_set(&["lr=1"]).unwrap_err();
        assert!(matches!(err, ConfigError::Override { .. }), "{err}");
    }

    #[test]
    fn set_override_of_wrong_type_blames_the_override() {
        let err = with_set(&["model.n_head=four"]).unwrap_err().to_string();
        assert_eq!(
            err,
            "--set model.n_head=four: model.n_head: invalid type: string \"four\", expected usize"
        );
    }

    #[test]
    fn sizes_must_be_positive() {
        let mut c = valid();
        c.model.n_layer = 0;
        c.parallel.pp = 0;
        assert_eq!(broken(&c), ["model.n_layer", "parallel.pp"]);
        for path in ["model.n_head", "model.n_embd", "model.vocab_size", "train.steps"] {
            let mut c = valid();
            match path {
                "model.n_head" => c.model.n_head = 0,
                "model.n_embd" => c.model.n_embd = 0,
                "model.vocab_size" => c.model.vocab_size = 0,
                _ => {
                    c.train.steps = 0;
                    c.optim.warmup_steps = 0;
                }
            }
            // n_embd = 0 is divisible by anything, so one rule each.
            refused(&c, path);
        }
        let mut c = valid();
        c.train.micro_batch_size = 0;
        refused(&c, "train.micro_batch_size");
    }

    #[test]
    fn heads_must_divide_width() {
        let mut c = valid();
        c.model.n_head = 3;
        let err = refused(&c, "model.n_embd");
        assert_eq!(err, "model.n_embd: 128: must be divisible by model.n_head (3) when model.head_dim is 0");
    }

    #[test]
    fn head_dim_is_width_over_heads() {
        assert_eq!(valid().model.head_dim(), 32);
    }

    #[test]
    fn vocab_must_fit_in_i32_token_ids() {
        let mut c = valid();
        c.model.vocab_size = 1 << 31;
        c.validate().unwrap();
        c.model.vocab_size = (1 << 31) + 1;
        refused(&c, "model.vocab_size");
    }

    #[test]
    fn block_size_must_be_at_least_two() {
        let mut c = valid();
        c.model.block_size = 1;
        assert_eq!(refused(&c, "model.block_size"), "model.block_size: 1: must be >= 2");
    }

    /// Asserts that `--set field=value` is refused while the config is read,
    /// naming the override, the field and every accepted name.
    fn unknown_choice(field: &str, value: &str, accepted: &[&str]) {
        let set = format!("{field}={value}");
        let err = with_set(&[&set]).expect_err("an unknown name should be refused");
        assert!(matches!(err, ConfigError::Schema { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.starts_with(&format!("--set {set}: {field}: unknown variant `{value}`")), "{msg}");
        let names: Vec<String> = accepted.iter().map(|a| format!("`{a}`")).collect();
        let listed = match names.as_slice() {
            [a, b] => format!("expected {a} or {b}"),
            _ => format!("expected one of {}", names.join(", ")),
        };
        assert!(msg.ends_with(&listed), "{msg}");
        for ok in accepted {
            let c = with_set(&[&format!("{field}={ok}")]).unwrap();
            let again = Config::parse(&c.to_toml_string(), "resolved", &[]).unwrap();
            assert_eq!(again, c, "{field} = {ok:?} round-trips");
        }
    }

    #[test]
    fn sampler_must_be_known() {
        unknown_choice("data.sampler", "random", &["sequential", "shuffled"]);
    }

    #[test]
    fn token_file_format_must_be_known() {
        assert_eq!(valid().data.format, FileFormat::Auto);
        unknown_choice("data.format", "bin", &["auto", "llmc", "raw"]);
    }

    #[test]
    fn lr_schedule_must_be_known() {
        unknown_choice("optim.schedule", "linear", &["cosine", "wsd", "constant"]);
    }

    #[test]
    fn loss_scale_must_be_known() {
        unknown_choice("optim.loss_scale", "static", &["none", "dynamic"]);
    }

    #[test]
    fn backend_kind_and_dtype_must_be_known() {
        unknown_choice("backend.kind", "tpu", &["cpu", "sim", "cuda"]);
        unknown_choice("backend.dtype", "fp8", &["bf16", "f32"]);
    }

    #[test]
    fn chunks_rule_is_the_schedules_own() {
        use ScheduleKind::*;
        assert_eq!(OneFOneB.chunks_for(1), Some(1));
        assert_eq!(OneFOneB.chunks_for(2), None);
        assert_eq!(Interleaved1F1B.chunks_for(1), Some(2));
        assert_eq!(Interleaved1F1B.chunks_for(3), Some(3));
        assert_eq!(ZbV.chunks_for(1), Some(2));
        assert_eq!(ZbV.chunks_for(3), None);
        assert_eq!(DualPipeV.chunks_for(1), Some(2));
        assert_eq!(DualPipeV.chunks_for(2), Some(2));
        assert_eq!(DualPipeV.chunks_for(4), None);
    }

    #[test]
    fn lr_must_be_positive_and_finite() {
        for bad in [0.0, -1e-3, f64::INFINITY, f64::NAN] {
            let mut c = valid();
            c.optim.lr = bad;
            c.optim.min_lr = 0.0;
            refused(&c, "optim.lr");
        }
    }

    #[test]
    fn min_lr_must_lie_between_zero_and_lr() {
        let mut c = valid();
        c.optim.min_lr = c.optim.lr * 2.0;
        refused(&c, "optim.min_lr");
        c.optim.min_lr = -1e-5;
        refused(&c, "optim.min_lr");
        c.optim.min_lr = c.optim.lr;
        c.validate().unwrap();
        c.optim.min_lr = 0.0;
        c.validate().unwrap();
    }

    #[test]
    fn betas_must_lie_in_zero_to_one() {
        let mut c = valid();
        c.optim.beta1 = 1.0;
        refused(&c, "optim.beta1");
        let mut c = valid();
        c.optim.beta2 = -0.1;
        refused(&c, "optim.beta2");
        c.optim.beta2 = 0.0;
        c.validate().unwrap();
    }

    #[test]
    fn eps_must_be_positive() {
        let mut c = valid();
        c.optim.eps = 0.0;
        refused(&c, "optim.eps");
    }

    #[test]
    fn weight_decay_must_not_be_negative() {
        let mut c = valid();
        c.optim.weight_decay = -0.1;
        refused(&c, "optim.weight_decay");
        c.optim.weight_decay = 0.0;
        c.validate().unwrap();
    }

    #[test]
    fn grad_clip_must_not_be_negative() {
        let mut c = valid();
        c.optim.grad_clip = -1.0;
        refused(&c, "optim.grad_clip");
        c.optim.grad_clip = 0.0;
        c.validate().unwrap();
    }

    #[test]
    fn decay_frac_must_lie_in_zero_exclusive_to_one() {
        let mut c = valid();
        c.optim.decay_frac = 0.0;
        refused(&c, "optim.decay_frac");
        c.optim.decay_frac = 1.5;
        refused(&c, "optim.decay_frac");
        c.optim.decay_frac = 1.0;
        c.validate().unwrap();
    }

    #[test]
    fn warmup_longer_than_the_run_is_allowed() {
        let mut c = valid();
        c.optim.warmup_steps = c.train.steps + 1;
        c.validate().unwrap();
    }

    #[test]
    fn pipeline_schedule_must_be_known() {
        unknown_choice(
            "parallel.schedule",
            "zbh1",
            &["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"],
        );
        // A schedule loaded from JSON has a kind no config can name.
        assert!(with_set(&["parallel.schedule=custom"]).is_err());
    }

    #[test]
    fn microbatches_must_be_at_least_one() {
        let mut c = valid();
        c.parallel.microbatches = 0;
        refused(&c, "parallel.microbatches");
    }

    #[test]
    fn stages_must_not_outnumber_layers() {
        let mut c = valid();
        c.parallel.pp = c.model.n_layer + 1;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("every stage needs at least one block"), "{err}");
    }

    #[test]
    fn dualpipev_needs_a_microbatch_per_stage() {
        let mut c = valid();
        c.parallel.pp = 2;
        c.parallel.schedule = ScheduleKind::DualPipeV;
        c.parallel.microbatches = 3;
        let err = refused(&c, "parallel.microbatches");
        assert!(err.contains("\"dualpipev\" needs at least 4"), "{err}");
        c.parallel.microbatches = 4;
        c.validate().unwrap();
    }

    #[test]
    fn chunks_need_the_interleaved_schedule() {
        let mut c = valid();
        c.parallel.chunks = 2;
        refused(&c, "parallel.chunks");
        c.parallel.schedule = ScheduleKind::Interleaved1F1B;
        c.validate().unwrap();
    }

    #[test]
    fn zero_is_0_to_3_and_needs_replicas_and_the_cpu_backend() {
        let mut c = valid();
        c.parallel.dp = 2;
        for zero in 1..=3 {
            c.parallel.zero = zero;
            c.validate().unwrap();
        }
        c.parallel.zero = 4;
        let err = refused(&c, "parallel.zero");
        assert!(err.contains("must be 0, 1, 2 or 3"), "{err}");
        c.parallel.zero = 2;
        c.parallel.dp = 1;
        let err = refused(&c, "parallel.dp");
        assert!(err.contains("parallel.zero = 2") && err.contains("parallel.dp >= 2"), "{err}");
        c.parallel.dp = 2;
        c.backend.kind = BackendKind::Sim;
        let err = refused(&c, "backend.kind");
        assert!(err.contains("\"cpu\"") && err.contains("parallel.zero = 2"), "{err}");
    }

    #[test]
    fn sequence_parallelism_needs_tp_rows_it_divides_and_the_cpu() {
        let mut c = valid();
        c.model.n_head = 4;
        c.parallel.sp = true;
        assert!(refused(&c, "parallel.sp").contains("needs parallel.tp >= 2"));
        (c.parallel.tp, c.parallel.tp_slices) = (4, 4);
        (c.train.micro_batch_size, c.model.block_size) = (1, 6);
        assert!(refused(&c, "parallel.sp").contains("train.micro_batch_size × model.block_size = 6"));
        c.model.block_size = 8;
        c.validate().unwrap();
        c.backend.kind = BackendKind::Cuda;
        assert!(refused(&c, "parallel.sp").contains("CPU backend only"));
    }

    #[test]
    fn zero_3_takes_tensor_parallelism_and_only_it_keeps_weights_after_forward() {
        let mut c = valid();
        c.model.n_head = 4;
        (c.parallel.dp, c.parallel.zero, c.parallel.tp, c.parallel.tp_slices) = (2, 3, 2, 2);
        c.parallel.sp = true;
        c.validate().unwrap();
        (c.parallel.tp, c.parallel.sp) = (1, false);
        c.parallel.reshard_after_forward = false;
        c.validate().unwrap();
        c.parallel.zero = 2;
        let err = refused(&c, "parallel.reshard_after_forward");
        assert!(err.contains("only with parallel.zero = 3"), "{err}");
    }

    #[test]
    fn tp_takes_whole_slices_of_whole_heads_on_cpu_and_cuda() {
        let mut c = valid();
        c.model.n_head = 4;
        c.parallel.tp = 2;
        c.parallel.tp_slices = 4;
        c.validate().unwrap();
        c.parallel.tp = 3;
        let err = refused(&c, "parallel.tp");
        assert!(err.contains("power of two"), "{err}");
        c.parallel.tp = 4;
        c.parallel.tp_slices = 2;
        let err = refused(&c, "parallel.tp_slices");
        assert!(err.contains("multiple of parallel.tp = 4"), "{err}");
        c.parallel.tp = 2;
        c.parallel.tp_slices = 8;
        let err = refused(&c, "parallel.tp_slices");
        assert!(err.contains("model.n_head = 4"), "{err}");
        c.parallel.tp_slices = 4;
        c.backend.kind = BackendKind::Sim;
        let err = refused(&c, "backend.kind");
        assert!(err.contains("\"cpu\"") && err.contains("parallel.tp"), "{err}");
        // On GPUs: tp entries of backend.devices per rank, and one kernel joins at most 64 slices.
        c.backend.kind = BackendKind::Cuda;
        c.validate().unwrap();
        let ranks = c.parallel.pp * 2;
        c.backend.devices = vec![0; ranks];
        c.validate().unwrap();
        c.backend.devices = vec![0; c.parallel.pp];
        let err = refused(&c, "backend.devices");
        assert!(
            err.contains(&format!("and tensor-parallel rank (parallel.tp = 2) ({ranks} entries)")),
            "{err}"
        );
        (c.parallel.pp, c.parallel.tp) = (2, 4);
        c.backend.devices = vec![0, 1, 2, 3, 4, 4, 5, 5];
        let err = refused(&c, "backend.devices");
        assert!(err.contains("[4, 4, 5, 5] is neither"), "{err}");
        c.backend.devices = vec![0, 1, 2, 3, 4, 4, 4, 4];
        c.validate().unwrap();
        c.parallel.tp = 2;
        c.backend.devices = vec![];
        c.model.n_head = 128;
        c.model.n_embd = 128 * 64;
        c.parallel.tp_slices = 128;
        let err = refused(&c, "parallel.tp_slices");
        assert!(err.contains("at most 64"), "{err}");
    }

    #[test]
    fn a_cuda_stage_s_tp_gpus_stay_in_its_process() {
        let mut c = valid();
        c.model.n_head = 4;
        (c.parallel.pp, c.parallel.tp, c.parallel.tp_slices) = (2, 2, 2);
        c.check_processes(2).unwrap();
        c.check_processes(4).unwrap();
        c.backend.kind = BackendKind::Cuda;
        // A GPU per tp rank: launch's processes share this machine's GPUs.
        c.backend.devices = vec![0, 1, 2, 3];
        c.check_processes(2).unwrap();
        let err = c.check_processes(4).unwrap_err().to_string();
        assert!(err.contains("parallel.tp") && err.contains("NCCL inside a node"), "{err}");
    }

    fn llama(c: &mut Config) {
        c.model.family = "llama".into();
        c.model.n_kv_head = 2;
        c.model.intermediate_size = 48;
    }

    #[test]
    fn a_valid_llama_passes_and_each_family_field_is_checked_by_name() {
        let mut c = valid();
        llama(&mut c);
        c.validate().unwrap();
        let mut bad = c.clone();
        bad.model.n_kv_head = 3;
        let err = refused(&bad, "model.n_kv_head");
        assert!(err.contains("divide model.n_head = 4"), "{err}");
        let mut bad = c.clone();
        bad.model.intermediate_size = 0;
        refused(&bad, "model.intermediate_size");
        for theta in [f64::NAN, 0.5, 1e300] {
            let mut bad = c.clone();
            bad.model.rope_theta = theta;
            refused(&bad, "model.rope_theta");
        }
        let mut bad = c.clone();
        bad.model.rms_norm_eps = -1.0;
        refused(&bad, "model.rms_norm_eps");
        // Rotary embeddings turn pairs: a head of odd width is refused.
        let mut bad = c.clone();
        (bad.model.n_head, bad.model.n_embd) = (4, 12);
        let err = refused(&bad, "model.n_embd");
        assert!(err.contains("even head width"), "{err}");
        // A Llama runs on the GPU, split over tensor-parallel ranks too.
        let mut gpu = c.clone();
        gpu.backend.kind = BackendKind::Cuda;
        gpu.backend.devices = vec![0; gpu.parallel.pp];
        gpu.validate().unwrap();
        gpu.parallel.tp = 2;
        gpu.parallel.tp_slices = 2;
        gpu.backend.devices = vec![0; gpu.parallel.pp * 2];
        gpu.validate().unwrap();
        // GPT-2 takes no grouped-query attention; another MLP width is
        // GPT2Config's `n_inner`.
        let mut gpt2 = valid();
        gpt2.model.n_kv_head = 2;
        refused(&gpt2, "model.n_kv_head");
        let mut gpt2 = valid();
        gpt2.model.intermediate_size = 100;
        gpt2.validate().unwrap();
        assert_eq!(gpt2.arch().ffn, 100);
    }

    #[test]
    fn tensor_parallel_ranks_must_divide_the_key_value_heads() {
        let mut c = valid();
        llama(&mut c);
        c.model.n_head = 8;
        c.parallel.tp = 4;
        c.parallel.tp_slices = 4;
        let err = refused(&c, "parallel.tp");
        assert!(err.contains("must divide the key/value heads = 2 (model.n_kv_head"), "{err}");
        c.parallel.tp = 2;
        let err = refused(&c, "parallel.tp_slices");
        assert!(err.contains("model.n_kv_head"), "{err}");
        c.parallel.tp_slices = 2;
        c.validate().unwrap();
    }

    #[test]
    fn zero_bubble_refuses_full_recompute_only() {
        let mut c = valid();
        c.parallel.schedule = ScheduleKind::ZbH1;
        c.train.recompute = Recompute::Full;
        refused(&c, "train.recompute");
        c.train.recompute = Recompute::Selective;
        c.validate().unwrap();
    }

    #[test]
    fn cuda_takes_every_recompute_but_not_the_zero_bubble_split_it_would_meet() {
        let mut c = valid();
        c.backend.kind = BackendKind::Cuda;
        for r in Recompute::ALL {
            c.train.recompute = r;
            c.validate().unwrap();
        }
        // The split backward is the CPU's alone, selective or not.
        c.train.recompute = Recompute::Selective;
        c.parallel.schedule = ScheduleKind::ZbH1;
        let err = refused(&c, "parallel.schedule");
        assert!(err.contains("CPU backend only"), "{err}");
    }

    #[test]
    fn recompute_reads_its_three_names_and_the_old_booleans() {
        let read = |v: &str, set: &[&str]| {
            let text = format!("[train]\nrecompute = {v}\n");
            let sets: Vec<String> = set.iter().map(|s| s.to_string()).collect();
            Config::parse(&text, "t.toml", &sets).map(|c| c.train.recompute)
        };
        for (v, want) in [
            ("\"none\"", Recompute::None),
            ("\"selective\"", Recompute::Selective),
            ("\"full\"", Recompute::Full),
            ("true", Recompute::Full),
            ("false", Recompute::None),
        ] {
            assert_eq!(read(v, &[]).unwrap(), want, "{v}");
        }
        for set in ["train.recompute=true", "train.recompute=full"] {
            assert_eq!(read("false", &[set]).unwrap(), Recompute::Full, "{set}");
        }
        assert_eq!(read("true", &["train.recompute=selective"]).unwrap(), Recompute::Selective);
        let err = read("\"some\"", &[]).unwrap_err().to_string();
        assert!(err.contains("train.recompute") && err.contains("\"selective\""), "{err}");
        let err = read("false", &["train.recompute=most"]).unwrap_err().to_string();
        assert!(err.contains("--set train.recompute=most") && err.contains("\"full\""), "{err}");
        // The resolved config names the choice.
        let c = Config::parse("[train]\nrecompute = true\n", "t.toml", &[]).unwrap();
        assert!(c.to_toml_string().contains("recompute = \"full\""));
    }

    #[test]
    fn cuda_devices_map_every_stage_and_need_the_cuda_backend() {
        let mut c = valid();
        c.backend.kind = BackendKind::Cuda;
        c.parallel.pp = 2;
        c.backend.devices = vec![0, 0];
        c.validate().unwrap();
        c.backend.devices = vec![0];
        let err = refused(&c, "backend.devices");
        assert!(
            err.starts_with("backend.devices: [0]: one GPU ordinal per pipeline rank (parallel.pp = 2)"),
            "{err}"
        );
        // Per rank and replica.
        c.parallel.dp = 2;
        c.backend.devices = vec![0, 1, 2, 3];
        c.validate().unwrap();
        c.parallel.dp = 1;
        c.backend.devices = vec![0, 0];
        c.backend.dtype = Dtype::F32;
        c.parallel.schedule = ScheduleKind::ZbH1;
        refused(&c, "parallel.schedule");
        c.parallel.schedule = ScheduleKind::DualPipeV;
        c.parallel.microbatches = 4;
        let err = refused(&c, "parallel.schedule");
        assert!(err.contains("dualpipev") && err.contains("CPU backend only"), "{err}");
        c.parallel.schedule = ScheduleKind::OneFOneB;
        c.backend.kind = BackendKind::Cpu;
        c.backend.devices = vec![0, 1];
        refused(&c, "backend.devices");
    }

    #[test]
    fn builtin_corpus_must_be_known() {
        unknown_choice("data.builtin", "shakespeare", &["", "arithmetic", "random"]);
        let mut c = valid();
        c.data.builtin = Builtin::Random;
        c.validate().unwrap();
    }

    #[test]
    fn file_corpus_needs_a_train_file() {
        let mut c = valid();
        c.data.builtin = Builtin::Files;
        let err = refused(&c, "data.train");
        assert!(err.starts_with("data.train: \"\": a token file is required"), "{err}");
        c.data.train = "data/train.bin".into();
        c.validate().unwrap();
    }

    #[test]
    fn builtin_corpus_and_files_are_not_combined() {
        let mut c = valid();
        c.data.train = "data/train.bin".into();
        refused(&c, "data.train");
        let mut c = valid();
        c.data.val = "data/val.bin".into();
        refused(&c, "data.val");
    }

    #[test]
    fn naming_a_training_file_on_the_default_trains_on_it_instead_of_the_builtin_corpus() {
        let c = with_set(&["data.train=tok.bin", "data.val=tok.bin"]).unwrap();
        assert_eq!(c.data.builtin, Builtin::Files);
        assert_eq!((c.data.train.as_str(), c.data.val.as_str()), ("tok.bin", "tok.bin"));
        c.validate().unwrap();
        // The default's own choice stands when no file is named.
        assert_eq!(with_set(&[]).unwrap().data.builtin, Builtin::Arithmetic);
        assert_eq!(with_set(&["data.train="]).unwrap().data.builtin, Builtin::Arithmetic);
    }

    #[test]
    fn a_builtin_set_beside_a_training_file_is_refused_saying_what_to_set() {
        let err = with_set(&["data.builtin=random", "data.train=tok.bin"]).unwrap().validate().unwrap_err();
        let text = err.to_string();
        assert!(text.contains("data.train") && text.contains("--set data.builtin="), "{text}");
        // A config file's builtin is the user's choice too.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mine.toml");
        std::fs::write(&path, "[data]\nbuiltin = \"arithmetic\"\n").unwrap();
        let c = Config::load(Some(&path), &["data.train=tok.bin".into()]).unwrap();
        assert_eq!(c.data.builtin, Builtin::Arithmetic);
        let text = c.validate().unwrap_err().to_string();
        assert!(text.contains("set data.builtin = \"\" (--set data.builtin=)"), "{text}");
        // A validation file alone does not say what to train on.
        let text = with_set(&["data.val=tok.bin"]).unwrap().validate().unwrap_err().to_string();
        assert!(text.contains("data.val") && text.contains("--set data.builtin="), "{text}");
    }

    #[test]
    fn the_lr_floor_follows_a_set_peak_at_the_config_s_ratio_unless_set_itself() {
        let default = with_set(&[]).unwrap();
        assert_eq!(default.optim.min_lr.to_bits(), 3e-4f64.to_bits(), "the default run is unchanged");
        let c = with_set(&["optim.lr=1e-4"]).unwrap();
        c.validate().unwrap();
        assert!((c.optim.min_lr - 1e-5).abs() < 1e-18, "{}", c.optim.min_lr);
        // Setting the peak to what it already is changes nothing, bit for bit.
        let same = with_set(&["optim.lr=3e-3"]).unwrap();
        assert_eq!(same.optim.min_lr.to_bits(), default.optim.min_lr.to_bits());
        let both = with_set(&["optim.lr=1e-4", "optim.min_lr=0"]).unwrap();
        assert_eq!(both.optim.min_lr, 0.0);
        let floor_only = with_set(&["optim.min_lr=1e-4"]).unwrap();
        assert_eq!((floor_only.optim.lr, floor_only.optim.min_lr), (3e-3, 1e-4));
        // A floor set above the peak is refused with the fix named.
        let text =
            with_set(&["optim.lr=1e-4", "optim.min_lr=3e-4"]).unwrap().validate().unwrap_err().to_string();
        assert!(text.contains("optim.min_lr") && text.contains("--set optim.min_lr="), "{text}");
        // A ratio that overflows leaves the floor as it was, for validation to judge.
        let huge = with_set(&["optim.lr=1e300", "optim.min_lr=0"]).unwrap();
        assert_eq!(huge.optim.min_lr, 0.0);
        let tiny =
            Config::parse("[optim]\nlr = 1e-300\nmin_lr = 0.0\n", "t.toml", &["optim.lr=1e300".into()]);
        assert_eq!(tiny.unwrap().optim.min_lr, 0.0);
        // A broken peak is named once by validation, not scaled into the floor.
        let text = with_set(&["optim.lr=-1"]).unwrap().validate().unwrap_err().to_string();
        assert!(text.starts_with("optim.lr:") && !text.contains("optim.min_lr"), "{text}");
    }

    #[test]
    fn all_broken_rules_are_reported_together() {
        let mut c = valid();
        c.model.n_head = 3;
        c.optim.lr = -1.0;
        c.optim.eps = 0.0;
        let err = c.validate().unwrap_err();
        assert_eq!(err.problems().len(), 3, "{err}");
        assert_eq!(err.to_string().lines().count(), 3);
    }

    #[test]
    fn resolved_toml_writes_each_choice_by_its_name() {
        let mut c = valid();
        c.backend.kind = BackendKind::Cuda;
        c.parallel.schedule = ScheduleKind::ZbV;
        let text = c.to_toml_string();
        for line in [
            "builtin = \"arithmetic\"",
            "sampler = \"shuffled\"",
            "format = \"auto\"",
            "schedule = \"cosine\"",
            "loss_scale = \"none\"",
            "schedule = \"zb-v\"",
            "kind = \"cuda\"",
            "dtype = \"bf16\"",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }

    #[test]
    fn resolved_toml_round_trips() {
        let config = with_set(&["optim.lr=3e-4", "data.sampler=sequential"]).unwrap();
        let text = config.to_toml_string();
        let again = Config::parse(&text, "resolved", &[]).unwrap();
        assert_eq!(again, config);
        assert_eq!(again.hash(), config.hash());
    }

    #[test]
    fn hash_is_blake3_hex_and_changes_with_any_field() {
        let a = valid();
        let mut b = valid();
        assert_eq!(a.hash().len(), 64);
        assert_eq!(a.hash(), b.hash());
        b.train.seed += 1;
        assert_ne!(a.hash(), b.hash());
    }

    #[test]
    fn warmup_over_the_whole_run_and_too_few_microbatches_are_warned_by_field() {
        let mut c = Config::default();
        c.train.steps = 50;
        c.optim.warmup_steps = 100;
        c.parallel.pp = 4;
        c.parallel.microbatches = 2;
        let w = c.warnings();
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].starts_with("optim.warmup_steps = 100 covers all of train.steps = 50"), "{}", w[0]);
        assert!(w[1].starts_with("parallel.microbatches = 2 is fewer than parallel.pp = 4"), "{}", w[1]);
        assert!(w[1].contains("= 60%"), "(4−1)/(2+4−1): {}", w[1]);
        c.optim.warmup_steps = 10;
        c.parallel.microbatches = 8;
        assert!(c.warnings().is_empty());
    }

    #[test]
    fn a_launch_whose_ranks_do_not_split_over_the_processes_is_refused() {
        let mut c = Config::default();
        c.parallel.pp = 2;
        c.parallel.dp = 2;
        assert!(c.check_processes(4).is_ok() && c.check_processes(2).is_ok());
        let err = c.check_processes(3).unwrap_err().to_string();
        assert!(
            err.contains("parallel.pp × parallel.dp × parallel.tp") && err.contains("--nodes 3"),
            "{err}"
        );
        // tp 4 × pp 3: 12 ranks; 2 processes hold 6 each, which would cut a
        // stage's 4 tp ranks; 6 processes hold 2 each, half a stage's ranks.
        c.parallel.dp = 1;
        c.parallel.pp = 3;
        c.parallel.tp = 4;
        assert!(
            c.check_processes(6).is_ok() && c.check_processes(3).is_ok() && c.check_processes(12).is_ok()
        );
        let err = c.check_processes(2).unwrap_err().to_string();
        assert!(err.contains("parallel.tp") && err.contains("6 ranks per process"), "{err}");
    }

    #[test]
    fn a_launch_whose_processes_would_share_a_gpu_is_refused_naming_both_ranks() {
        let mut c = Config::default();
        c.backend.kind = BackendKind::Cuda;
        c.parallel.pp = 2;
        c.parallel.dp = 2;
        // One entry per stage: each replica (a process of its own) puts stage 1 on GPU 1.
        c.backend.devices = vec![0, 1];
        let err = c.check_processes(2).unwrap_err().to_string();
        assert!(err.contains("backend.devices") && err.contains("both use GPU 0"), "{err}");
        // In one process the replicas share GPUs without NCCL between them.
        c.check_processes(1).unwrap();
        c.backend.devices = vec![];
        assert!(c.check_processes(2).unwrap_err().to_string().contains("both use GPU 0"));
        // One GPU per rank and replica: nothing shared.
        c.backend.devices = vec![0, 1, 2, 3];
        c.check_processes(2).unwrap();
        // Each process's stages on one GPU of its own.
        c.backend.devices = vec![0, 0, 1, 1];
        c.check_processes(2).unwrap();
    }
}
