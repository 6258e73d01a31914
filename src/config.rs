//! The run's configuration: the TOML schema, defaults, `--set` overrides and
//! validation. Owns every rule about which values are allowed; errors name the
//! field's path (`optim.lr`), the value given and what was expected.
//! Never touches files other than the config being read.

use serde::{Deserialize, Serialize};

/// The embedded default config: `pipewright train` with no arguments runs this.
pub const DEFAULT_TOML: &str = include_str!("../configs/default.toml");

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub model: ModelSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub optim: OptimSection,
    pub parallel: ParallelSection,
    pub backend: BackendSection,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Tokens the model can predict; the embedding is padded internally to a
    /// multiple of 64 but padded rows are never predicted nor exported.
    pub vocab_size: usize,
    /// Sequence length T (and rows of the position embedding).
    pub block_size: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Generated corpus used instead of files: "arithmetic", or "" for files.
    pub builtin: String,
    /// Training token file (llm.c `.bin`, or nanoGPT raw uint16).
    pub train: String,
    /// Validation token file; empty means no validation.
    pub val: String,
    /// "shuffled" (a seeded permutation of windows per epoch) or "sequential".
    pub sampler: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// Optimizer steps to run (`--steps` overrides).
    pub steps: usize,
    /// Sequences per microbatch (B).
    pub micro_batch_size: usize,
    pub seed: u64,
    /// Evaluate validation loss every N steps (0: never; always at the end if val is set).
    pub eval_every: usize,
    /// Microbatches of validation data per evaluation.
    pub eval_batches: usize,
    /// Keep only each block's input in forward and recompute the rest in backward.
    pub recompute: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OptimSection {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    /// "cosine" (warmup then cosine to min_lr), "wsd" (warmup-stable-decay) or "constant".
    pub schedule: String,
    /// For "wsd": the fraction of steps spent decaying linearly to min_lr at the end.
    pub decay_frac: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global-norm clipping threshold; 0 disables clipping.
    pub grad_clip: f64,
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
    /// Pipeline schedule: "1f1b" or "gpipe".
    pub schedule: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BackendSection {
    /// "cpu".
    pub kind: String,
    /// Compute threads; 0 means one per available core.
    pub threads: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            model: ModelSection::default(),
            data: DataSection::default(),
            train: TrainSection::default(),
            optim: OptimSection::default(),
            parallel: ParallelSection::default(),
            backend: BackendSection::default(),
        }
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection { n_layer: 12, n_head: 12, n_embd: 768, vocab_size: 50257, block_size: 1024 }
    }
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            builtin: String::new(),
            train: String::new(),
            val: String::new(),
            sampler: "shuffled".into(),
        }
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            steps: 1000,
            micro_batch_size: 4,
            seed: 1337,
            eval_every: 100,
            eval_batches: 8,
            recompute: false,
        }
    }
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            lr: 6e-4,
            min_lr: 6e-5,
            warmup_steps: 100,
            schedule: "cosine".into(),
            decay_frac: 0.2,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
        }
    }
}

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelSection { pp: 1, dp: 1, microbatches: 1, schedule: "1f1b".into() }
    }
}

impl Default for BackendSection {
    fn default() -> Self {
        BackendSection { kind: "cpu".into(), threads: 0 }
    }
}
