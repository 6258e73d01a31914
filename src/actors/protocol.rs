//! The runtime's messages, declared once: what stages, loaders and the
//! coordinator say to each other, and the two ways a message leaves an actor.
//!
//! - As a frame (`cluster::wire`): a serde header (`StageKind`, `CoordKind`)
//!   carrying every scalar, plus the tensors as raw arrays, bit for bit.
//! - As a replay log entry (`replay`): the header's kind name, step, stage and
//!   microbatch as entry fields, the other scalars and the tensors as named
//!   blobs (`key::*`).
//!
//! Both go through the header, so a message kind's fields are listed here and
//! nowhere else. Decoding is fallible: a frame or entry that does not fit the
//! kind it claims is a `ProtocolError`, never a panic. This module does no I/O
//! except `Restore`'s checkpoint read.

use crate::checkpoint::TensorState;
use crate::model::Param;
use crate::replay::{Blob, Entry};
use ractor::Message;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// Whether a message belongs to training or to a forward-only evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Train,
    Eval,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvalKind {
    /// Mean loss over validation windows.
    Val,
    /// Exact-match accuracy on held-out problems.
    ExactMatch,
}

impl EvalKind {
    pub fn name(self) -> &'static str {
        match self {
            EvalKind::Val => "val",
            EvalKind::ExactMatch => "exact_match",
        }
    }

    pub fn from_name(s: &str) -> Result<EvalKind, String> {
        match s {
            "val" => Ok(EvalKind::Val),
            "exact_match" => Ok(EvalKind::ExactMatch),
            other => Err(format!("unknown evaluation `{other}`")),
        }
    }

    fn from_exact_match(exact_match: bool) -> EvalKind {
        if exact_match {
            EvalKind::ExactMatch
        } else {
            EvalKind::Val
        }
    }
}

fn phase_of(train: bool) -> Phase {
    if train {
        Phase::Train
    } else {
        Phase::Eval
    }
}

/// Names of the blobs a message's payload is logged under.
pub mod key {
    pub const TOKENS: &str = "tokens";
    pub const TARGETS: &str = "targets";
    pub const DATA: &str = "data";
    pub const LOSS_SCALE: &str = "loss_scale";
    pub const LR: &str = "lr";
    pub const CLIP: &str = "clip";
    pub const SKIP: &str = "skip";
    pub const EVAL_KIND: &str = "kind";
    pub const BATCHES: &str = "batches";
    pub const CHECKPOINT: &str = "checkpoint";
    pub const GRAD_SUMSQ_INDEX: &str = "grad_sumsq.index";
    pub const GRAD_SUMSQ: &str = "grad_sumsq";
    pub const LOSS_SUM: &str = "loss_sum";
    pub const TOKEN_COUNT: &str = "tokens";
    pub const PREDICTIONS: &str = "predictions";
    pub const ADAM_STEP: &str = "adam_step";
}

/// Actor names as the replay log uses them: stage-R (replica 0), stage-R.K.
pub fn stage_name(rank: usize, replica: usize) -> String {
    if replica == 0 {
        format!("stage-{rank}")
    } else {
        format!("stage-{rank}.{replica}")
    }
}

#[derive(Debug, Clone)]
pub struct Failure {
    pub actor: String,
    pub step: u64,
    pub action: Option<String>,
    pub error: String,
}

impl Failure {
    pub fn new(
        rank: usize,
        replica: usize,
        step: u64,
        action: Option<String>,
        error: impl Into<String>,
    ) -> Self {
        Failure { actor: stage_name(rank, replica), step, action, error: error.into() }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed at step {}", self.actor, self.step)?;
        if let Some(a) = &self.action {
            let stage = a.split(['F', 'B', 'I', 'W']).next().unwrap_or("?");
            let mb = a.rsplit(['F', 'B', 'I', 'W']).next().unwrap_or("?");
            write!(f, " during {a} (stage {stage}, microbatch {mb})")?;
        }
        write!(f, ": {}", self.error)
    }
}

pub struct StageReport {
    pub rank: usize,
    pub replica: usize,
    pub step: u64,
    /// (canonical tensor index, Σg²), replica 0 only.
    pub grad_sumsq: Vec<(usize, f64)>,
    /// Σ loss over the step's microbatches, from the rank holding the last stage.
    pub loss_sum: Option<f64>,
}

pub enum StageMsg {
    /// Walk the action list for optimizer step `step`.
    /// `loss_scale` multiplies the loss gradient (dynamic loss scaling; 1 when off).
    RunStep {
        step: u64,
        loss_scale: f32,
    },
    /// The coordinator's decision after the step's gradient norm.
    Apply {
        step: u64,
        lr: f64,
        clip: f32,
        skip: bool,
    },
    /// Forward-only pass over `batches` microbatches (replica 0 only).
    RunEval {
        step: u64,
        kind: EvalKind,
        batches: usize,
    },
    Tokens {
        phase: Phase,
        step: u64,
        mb: usize,
        tokens: Vec<u32>,
    },
    Targets {
        phase: Phase,
        step: u64,
        mb: usize,
        targets: Vec<u32>,
    },
    /// The input of F on `stage`. `sent`: when it was sent, then (restamped by
    /// the receiving stage's actor) when it arrived.
    Activation {
        phase: Phase,
        step: u64,
        stage: usize,
        mb: usize,
        data: Vec<f32>,
        sent: Instant,
    },
    /// The gradient of `stage`'s output, for its B or I (`sent` as for `Activation`).
    Gradient {
        step: u64,
        stage: usize,
        mb: usize,
        data: Vec<f32>,
        sent: Instant,
    },
    /// The other rank's share of the tied embedding's gradient.
    TiedShare {
        step: u64,
        data: Vec<f32>,
    },
    /// Gradients of `stage` summed over replicas (under ZeRO-1, this replica's
    /// shard of each tensor).
    Reduced {
        step: u64,
        stage: usize,
        grads: Vec<Vec<f32>>,
    },
    /// ZeRO-1: `stage`'s tensors gathered whole from every replica's shard
    /// (the updated parameters, or for a checkpoint the AdamW moments). Shared:
    /// in one process every replica reads the one copy the reducer made.
    Gathered {
        step: u64,
        stage: usize,
        tensors: Arc<Vec<Vec<f32>>>,
    },
    /// Send the parameters to the coordinator (end of run).
    SendWeights,
    /// Copy parameters and AdamW moments for a checkpoint of step `step`.
    Snapshot {
        step: u64,
    },
    /// Reload parameters and moments from a checkpoint (a rollback).
    Restore(Arc<crate::checkpoint::Loaded>),
    Stop,
}

impl Message for StageMsg {}

pub enum CoordinatorMsg {
    Start,
    StageDone(StageReport),
    Applied {
        rank: usize,
        replica: usize,
        step: u64,
    },
    EvalDone {
        step: u64,
        kind: EvalKind,
        loss_sum: f64,
        tokens: usize,
        predictions: Vec<u32>,
    },
    Weights {
        rank: usize,
        replica: usize,
        params: Vec<Param>,
        latencies_us: Vec<f64>,
        peak_live_bytes: usize,
        trace: Vec<crate::trace::Record>,
    },
    Failed(Failure),
    /// A stage's copy of its parameters and moments for the checkpoint of `step`.
    Snapshot {
        rank: usize,
        step: u64,
        tensors: Vec<TensorState>,
        adam_step: u64,
    },
    /// The checkpointer finished writing the checkpoint of `step`.
    Saved {
        step: u64,
        ms: f64,
        path: std::path::PathBuf,
    },
    CheckpointFailed(String),
    /// A stage reloaded the rollback checkpoint.
    Restored {
        rank: usize,
        replica: usize,
    },
    /// SIGINT or SIGTERM: checkpoint at the next step boundary and stop.
    StopRequested,
}

impl Message for CoordinatorMsg {}

/// One tensor of a message's payload.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    F32(Vec<f32>),
    U32(Vec<u32>),
}

#[derive(Debug, thiserror::Error)]
#[error("malformed {what} message: {why}")]
pub struct ProtocolError {
    pub what: &'static str,
    pub why: String,
}

fn bad(what: &'static str, why: impl Into<String>) -> ProtocolError {
    ProtocolError { what, why: why.into() }
}

/// A stage message's scalars: the header of its frame, the fields of its log entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StageKind {
    RunStep {
        step: u64,
        loss_scale: f32,
    },
    Apply {
        step: u64,
        lr: f64,
        clip: f32,
        skip: bool,
    },
    RunEval {
        step: u64,
        exact_match: bool,
        batches: u64,
    },
    Tokens {
        train: bool,
        step: u64,
        mb: u32,
    },
    Targets {
        train: bool,
        step: u64,
        mb: u32,
    },
    Activation {
        train: bool,
        step: u64,
        stage: u32,
        mb: u32,
    },
    Gradient {
        step: u64,
        stage: u32,
        mb: u32,
    },
    TiedShare {
        step: u64,
    },
    Reduced {
        step: u64,
        stage: u32,
    },
    Gathered {
        step: u64,
        stage: u32,
    },
    SendWeights,
    Snapshot {
        step: u64,
    },
    /// Reload the checkpoint in this directory (a rollback; needs a shared filesystem).
    Restore {
        dir: String,
    },
    Stop,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorMeta {
    pub name: String,
    pub shape: Vec<u64>,
    pub canonical: u64,
}

/// A coordinator message's scalars (the header of its frame).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CoordKind {
    StageDone {
        rank: u32,
        replica: u32,
        step: u64,
        grad_sumsq: Vec<(u64, f64)>,
        loss_sum: Option<f64>,
    },
    Applied {
        rank: u32,
        replica: u32,
        step: u64,
    },
    EvalDone {
        step: u64,
        exact_match: bool,
        loss_sum: f64,
        tokens: u64,
    },
    /// Arrays: each parameter's data, then its gradient.
    Weights {
        rank: u32,
        replica: u32,
        params: Vec<TensorMeta>,
        latencies_us: Vec<f64>,
        peak_live_bytes: u64,
        trace: Vec<crate::trace::Record>,
    },
    Failed {
        actor: String,
        step: u64,
        action: Option<String>,
        error: String,
    },
    /// Arrays: each tensor's data, exp_avg, exp_avg_sq.
    Snapshot {
        rank: u32,
        step: u64,
        tensors: Vec<TensorMeta>,
        adam_step: u64,
    },
    Restored {
        rank: u32,
        replica: u32,
    },
}

/// The arrays of a message, taken one at a time with their types checked.
struct Arrays {
    what: &'static str,
    it: std::vec::IntoIter<Array>,
}

impl Arrays {
    fn new(what: &'static str, arrays: Vec<Array>, expected: usize) -> Result<Arrays, ProtocolError> {
        if arrays.len() != expected {
            return Err(bad(what, format!("{} arrays, expected {expected}", arrays.len())));
        }
        Ok(Arrays { what, it: arrays.into_iter() })
    }

    fn f32(&mut self) -> Result<Vec<f32>, ProtocolError> {
        match self.it.next() {
            Some(Array::F32(v)) => Ok(v),
            _ => Err(bad(self.what, "expected an f32 array")),
        }
    }

    fn u32(&mut self) -> Result<Vec<u32>, ProtocolError> {
        match self.it.next() {
            Some(Array::U32(v)) => Ok(v),
            _ => Err(bad(self.what, "expected a u32 array")),
        }
    }
}

/// All the arrays of a `what` message, each f32 (a gradient list).
pub fn f32_arrays(what: &'static str, arrays: Vec<Array>) -> Result<Vec<Vec<f32>>, ProtocolError> {
    let n = arrays.len();
    let mut a = Arrays::new(what, arrays, n)?;
    (0..n).map(|_| a.f32()).collect()
}

impl StageKind {
    /// The kind's name in logs and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            StageKind::RunStep { .. } => "RunStep",
            StageKind::Apply { .. } => "Apply",
            StageKind::RunEval { .. } => "RunEval",
            StageKind::Tokens { .. } => "Tokens",
            StageKind::Targets { .. } => "Targets",
            StageKind::Activation { .. } => "Activation",
            StageKind::Gradient { .. } => "Gradient",
            StageKind::TiedShare { .. } => "TiedShare",
            StageKind::Reduced { .. } => "Reduced",
            StageKind::Gathered { .. } => "Gathered",
            StageKind::SendWeights => "SendWeights",
            StageKind::Snapshot { .. } => "Snapshot",
            StageKind::Restore { .. } => "Restore",
            StageKind::Stop => "Stop",
        }
    }

    /// The optimizer step the message belongs to (`None`: it names none).
    pub fn step(&self) -> Option<u64> {
        use StageKind::*;
        match self {
            RunStep { step, .. }
            | Apply { step, .. }
            | RunEval { step, .. }
            | Tokens { step, .. }
            | Targets { step, .. }
            | Activation { step, .. }
            | Gradient { step, .. }
            | TiedShare { step }
            | Reduced { step, .. }
            | Gathered { step, .. }
            | Snapshot { step } => Some(*step),
            SendWeights | Restore { .. } | Stop => None,
        }
    }

    /// (stage, microbatch, evaluation traffic) as a log entry's fields.
    fn entry_fields(&self) -> (Option<usize>, Option<usize>, bool) {
        match *self {
            StageKind::RunEval { .. } => (None, None, true),
            StageKind::Tokens { train, mb, .. } | StageKind::Targets { train, mb, .. } => {
                (None, Some(mb as usize), !train)
            }
            StageKind::Activation { train, stage, mb, .. } => {
                (Some(stage as usize), Some(mb as usize), !train)
            }
            StageKind::Gradient { stage, mb, .. } => (Some(stage as usize), Some(mb as usize), false),
            StageKind::Reduced { stage, .. } | StageKind::Gathered { stage, .. } => {
                (Some(stage as usize), None, false)
            }
            _ => (None, None, false),
        }
    }

    /// The scalars a log entry keeps as blobs (the rest are entry fields).
    fn scalar_blobs(&self) -> Vec<Blob> {
        match self {
            StageKind::RunStep { loss_scale, .. } => vec![Blob::f64(key::LOSS_SCALE, *loss_scale as f64)],
            StageKind::Apply { lr, clip, skip, .. } => vec![
                Blob::f64(key::LR, *lr),
                Blob::f64(key::CLIP, *clip as f64),
                Blob::f64(key::SKIP, *skip as u8 as f64),
            ],
            StageKind::RunEval { exact_match, batches, .. } => vec![
                Blob::str(key::EVAL_KIND, EvalKind::from_exact_match(*exact_match).name()),
                Blob::f64(key::BATCHES, *batches as f64),
            ],
            StageKind::Restore { dir } => vec![Blob::str(key::CHECKPOINT, dir)],
            _ => vec![],
        }
    }

    /// The header a log entry describes; `Restore`'s directory is taken
    /// relative to `run_dir`.
    fn of_entry(e: &Entry, run_dir: &std::path::Path) -> Result<StageKind, String> {
        let f64_of = |name: &str| e.input(name).and_then(|b| b.to_f64());
        let (step, train) = (e.step, !e.eval);
        let stage = e.stage.unwrap_or(0) as u32;
        let mb = e.mb.unwrap_or(0) as u32;
        Ok(match e.kind.as_str() {
            "RunStep" => StageKind::RunStep { step, loss_scale: f64_of(key::LOSS_SCALE)? as f32 },
            "Apply" => StageKind::Apply {
                step,
                lr: f64_of(key::LR)?,
                clip: f64_of(key::CLIP)? as f32,
                skip: f64_of(key::SKIP)? != 0.0,
            },
            "RunEval" => StageKind::RunEval {
                step,
                exact_match: EvalKind::from_name(&e.input(key::EVAL_KIND)?.to_str()?)?
                    == EvalKind::ExactMatch,
                batches: f64_of(key::BATCHES)? as u64,
            },
            "Tokens" => StageKind::Tokens { train, step, mb },
            "Targets" => StageKind::Targets { train, step, mb },
            "Activation" => StageKind::Activation { train, step, stage, mb },
            "Gradient" => StageKind::Gradient { step, stage, mb },
            "TiedShare" => StageKind::TiedShare { step },
            "Reduced" => StageKind::Reduced { step, stage },
            "Gathered" => StageKind::Gathered { step, stage },
            "SendWeights" => StageKind::SendWeights,
            "Snapshot" => StageKind::Snapshot { step },
            "Restore" => {
                let dir = std::path::PathBuf::from(e.input(key::CHECKPOINT)?.to_str()?);
                let dir = if dir.is_absolute() { dir } else { run_dir.join(dir) };
                StageKind::Restore { dir: dir.display().to_string() }
            }
            other => return Err(format!("a stage does not handle `{other}`")),
        })
    }
}

/// How a message appears in a replay log: its kind and step, the stage and
/// microbatch it names, and its scalars and tensors as blobs.
pub struct Logged {
    pub kind: &'static str,
    /// `None`: the message names no step (the handler's current one stands).
    pub step: Option<u64>,
    pub stage: Option<usize>,
    pub mb: Option<usize>,
    pub eval: bool,
    pub blobs: Vec<Blob>,
}

impl Logged {
    /// The entry of this message as handled, from `from`.
    pub fn entry(self, from: &str, step: u64, replica: usize) -> Entry {
        let mut e =
            crate::replay::entry(from, self.kind, self.step.unwrap_or(step), replica).with_eval(self.eval);
        e.stage = self.stage.map(|s| s as u64);
        e.mb = self.mb.map(|m| m as u64);
        e.with_inputs(self.blobs)
    }
}

impl Logged {
    /// Records the message as one `log`'s actor sent to `to`.
    pub fn record_sent(self, log: &mut crate::replay::ActorLog, to: &str) {
        log.sent(to, self.kind, self.mb.map(|m| m as u64), self.blobs);
    }
}

/// For messages that carry no gradient list: `logged`'s naming is never asked.
pub fn no_grad_names(_stage: usize, k: usize) -> String {
    format!("tensor.{k}")
}

impl StageMsg {
    /// The message's scalars.
    pub fn header(&self) -> StageKind {
        let train = |p: &Phase| *p == Phase::Train;
        match self {
            StageMsg::RunStep { step, loss_scale } => {
                StageKind::RunStep { step: *step, loss_scale: *loss_scale }
            }
            StageMsg::Apply { step, lr, clip, skip } => {
                StageKind::Apply { step: *step, lr: *lr, clip: *clip, skip: *skip }
            }
            StageMsg::RunEval { step, kind, batches } => StageKind::RunEval {
                step: *step,
                exact_match: *kind == EvalKind::ExactMatch,
                batches: *batches as u64,
            },
            StageMsg::Tokens { phase, step, mb, .. } => {
                StageKind::Tokens { train: train(phase), step: *step, mb: *mb as u32 }
            }
            StageMsg::Targets { phase, step, mb, .. } => {
                StageKind::Targets { train: train(phase), step: *step, mb: *mb as u32 }
            }
            StageMsg::Activation { phase, step, stage, mb, .. } => StageKind::Activation {
                train: train(phase),
                step: *step,
                stage: *stage as u32,
                mb: *mb as u32,
            },
            StageMsg::Gradient { step, stage, mb, .. } => {
                StageKind::Gradient { step: *step, stage: *stage as u32, mb: *mb as u32 }
            }
            StageMsg::TiedShare { step, .. } => StageKind::TiedShare { step: *step },
            StageMsg::Reduced { step, stage, .. } => StageKind::Reduced { step: *step, stage: *stage as u32 },
            StageMsg::Gathered { step, stage, .. } => {
                StageKind::Gathered { step: *step, stage: *stage as u32 }
            }
            StageMsg::SendWeights => StageKind::SendWeights,
            StageMsg::Snapshot { step } => StageKind::Snapshot { step: *step },
            StageMsg::Restore(c) => StageKind::Restore { dir: c.dir.display().to_string() },
            StageMsg::Stop => StageKind::Stop,
        }
    }

    /// Header and tensors, the tensors moved out (no copy).
    pub fn into_parts(self) -> (StageKind, Vec<Array>) {
        let kind = self.header();
        let arrays = match self {
            StageMsg::Tokens { tokens: v, .. } | StageMsg::Targets { targets: v, .. } => vec![Array::U32(v)],
            StageMsg::Activation { data, .. }
            | StageMsg::Gradient { data, .. }
            | StageMsg::TiedShare { data, .. } => {
                vec![Array::F32(data)]
            }
            StageMsg::Reduced { grads, .. } => grads.into_iter().map(Array::F32).collect(),
            StageMsg::Gathered { tensors, .. } => {
                let tensors = Arc::try_unwrap(tensors).unwrap_or_else(|shared| shared.to_vec());
                tensors.into_iter().map(Array::F32).collect()
            }
            _ => vec![],
        };
        (kind, arrays)
    }

    /// The message a header and its tensors make. `Restore` reads its checkpoint here.
    pub fn from_parts(kind: StageKind, arrays: Vec<Array>) -> Result<StageMsg, ProtocolError> {
        let now = Instant::now();
        let what = kind.name();
        let expect = |n: usize, arrays: Vec<Array>| Arrays::new(what, arrays, n);
        Ok(match kind {
            StageKind::RunStep { step, loss_scale } => StageMsg::RunStep { step, loss_scale },
            StageKind::Apply { step, lr, clip, skip } => StageMsg::Apply { step, lr, clip, skip },
            StageKind::RunEval { step, exact_match, batches } => StageMsg::RunEval {
                step,
                kind: EvalKind::from_exact_match(exact_match),
                batches: batches as usize,
            },
            StageKind::Tokens { train, step, mb } => StageMsg::Tokens {
                phase: phase_of(train),
                step,
                mb: mb as usize,
                tokens: expect(1, arrays)?.u32()?,
            },
            StageKind::Targets { train, step, mb } => StageMsg::Targets {
                phase: phase_of(train),
                step,
                mb: mb as usize,
                targets: expect(1, arrays)?.u32()?,
            },
            StageKind::Activation { train, step, stage, mb } => StageMsg::Activation {
                phase: phase_of(train),
                step,
                stage: stage as usize,
                mb: mb as usize,
                data: expect(1, arrays)?.f32()?,
                sent: now,
            },
            StageKind::Gradient { step, stage, mb } => StageMsg::Gradient {
                step,
                stage: stage as usize,
                mb: mb as usize,
                data: expect(1, arrays)?.f32()?,
                sent: now,
            },
            StageKind::TiedShare { step } => StageMsg::TiedShare { step, data: expect(1, arrays)?.f32()? },
            StageKind::Reduced { step, stage } => {
                StageMsg::Reduced { step, stage: stage as usize, grads: f32_arrays(what, arrays)? }
            }
            StageKind::Gathered { step, stage } => StageMsg::Gathered {
                step,
                stage: stage as usize,
                tensors: Arc::new(f32_arrays(what, arrays)?),
            },
            StageKind::SendWeights => StageMsg::SendWeights,
            StageKind::Snapshot { step } => StageMsg::Snapshot { step },
            StageKind::Restore { dir } => {
                let loaded = crate::checkpoint::load(std::path::Path::new(&dir))
                    .map_err(|e| bad("Restore", format!("{dir}: {e}")))?;
                StageMsg::Restore(Arc::new(loaded))
            }
            StageKind::Stop => StageMsg::Stop,
        })
    }

    /// The message as a log records it. Tensors are named by payload key;
    /// `Reduced`'s gradients by `grad_name(stage, k)` (the parameter's name).
    /// `keep`: store tensor bytes, not only their digests.
    pub fn logged(&self, keep: bool, grad_name: &dyn Fn(usize, usize) -> String) -> Logged {
        let kind = self.header();
        let (stage, mb, eval) = kind.entry_fields();
        let mut blobs = kind.scalar_blobs();
        match self {
            StageMsg::Tokens { tokens, .. } => blobs.push(Blob::u32s(key::TOKENS, tokens, keep)),
            StageMsg::Targets { targets, .. } => blobs.push(Blob::u32s(key::TARGETS, targets, keep)),
            StageMsg::Activation { data, .. }
            | StageMsg::Gradient { data, .. }
            | StageMsg::TiedShare { data, .. } => blobs.push(Blob::f32s(key::DATA, data, keep)),
            StageMsg::Reduced { stage, grads, .. } => blobs
                .extend(grads.iter().enumerate().map(|(k, g)| Blob::f32s(&grad_name(*stage, k), g, keep))),
            StageMsg::Gathered { tensors, .. } => blobs
                .extend(tensors.iter().enumerate().map(|(k, t)| Blob::f32s(&format!("tensor.{k}"), t, keep))),
            _ => {}
        }
        let step = match self {
            StageMsg::Restore(c) => Some(c.state.step),
            _ => kind.step(),
        };
        Logged { kind: kind.name(), step, stage, mb, eval, blobs }
    }

    /// The message a log entry recorded (its tensors must have been kept).
    pub fn from_entry(e: &Entry, run_dir: &std::path::Path) -> Result<StageMsg, String> {
        let kind = StageKind::of_entry(e, run_dir)?;
        let tensor = |name: &str| e.input(name);
        let arrays = match &kind {
            StageKind::Tokens { .. } => vec![Array::U32(tensor(key::TOKENS)?.to_u32s()?)],
            StageKind::Targets { .. } => vec![Array::U32(tensor(key::TARGETS)?.to_u32s()?)],
            StageKind::Activation { .. } | StageKind::Gradient { .. } | StageKind::TiedShare { .. } => {
                vec![Array::F32(tensor(key::DATA)?.to_f32s()?)]
            }
            StageKind::Reduced { .. } | StageKind::Gathered { .. } => {
                e.inputs.iter().map(|b| b.to_f32s().map(Array::F32)).collect::<Result<_, _>>()?
            }
            _ => vec![],
        };
        StageMsg::from_parts(kind, arrays).map_err(|x| x.to_string())
    }
}

fn meta_of(name: &str, shape: &[usize], canonical: usize) -> TensorMeta {
    TensorMeta {
        name: name.to_string(),
        shape: shape.iter().map(|&d| d as u64).collect(),
        canonical: canonical as u64,
    }
}

fn shape_of(meta: &TensorMeta) -> Vec<usize> {
    meta.shape.iter().map(|&d| d as usize).collect()
}

impl CoordinatorMsg {
    /// Header and tensors. `None`: the message only exists inside rank 0.
    pub fn into_parts(self) -> Option<(CoordKind, Vec<Array>)> {
        Some(match self {
            CoordinatorMsg::StageDone(r) => (
                CoordKind::StageDone {
                    rank: r.rank as u32,
                    replica: r.replica as u32,
                    step: r.step,
                    grad_sumsq: r.grad_sumsq.iter().map(|&(i, s)| (i as u64, s)).collect(),
                    loss_sum: r.loss_sum,
                },
                vec![],
            ),
            CoordinatorMsg::Applied { rank, replica, step } => {
                (CoordKind::Applied { rank: rank as u32, replica: replica as u32, step }, vec![])
            }
            CoordinatorMsg::EvalDone { step, kind, loss_sum, tokens, predictions } => (
                CoordKind::EvalDone {
                    step,
                    exact_match: kind == EvalKind::ExactMatch,
                    loss_sum,
                    tokens: tokens as u64,
                },
                vec![Array::U32(predictions)],
            ),
            CoordinatorMsg::Weights { rank, replica, params, latencies_us, peak_live_bytes, trace } => {
                let meta = params.iter().map(|p| meta_of(&p.name, &p.shape, p.canonical)).collect();
                let mut arrays = Vec::with_capacity(2 * params.len());
                for p in params {
                    arrays.push(Array::F32(p.data));
                    arrays.push(Array::F32(p.grad));
                }
                let kind = CoordKind::Weights {
                    rank: rank as u32,
                    replica: replica as u32,
                    params: meta,
                    latencies_us,
                    peak_live_bytes: peak_live_bytes as u64,
                    trace,
                };
                (kind, arrays)
            }
            CoordinatorMsg::Failed(f) => {
                (CoordKind::Failed { actor: f.actor, step: f.step, action: f.action, error: f.error }, vec![])
            }
            CoordinatorMsg::Snapshot { rank, step, tensors, adam_step } => {
                let meta = tensors.iter().map(|t| meta_of(&t.name, &t.shape, 0)).collect();
                let mut arrays = Vec::with_capacity(3 * tensors.len());
                for t in tensors {
                    arrays.extend([Array::F32(t.data), Array::F32(t.exp_avg), Array::F32(t.exp_avg_sq)]);
                }
                (CoordKind::Snapshot { rank: rank as u32, step, tensors: meta, adam_step }, arrays)
            }
            CoordinatorMsg::Restored { rank, replica } => {
                (CoordKind::Restored { rank: rank as u32, replica: replica as u32 }, vec![])
            }
            CoordinatorMsg::Start
            | CoordinatorMsg::Saved { .. }
            | CoordinatorMsg::CheckpointFailed(_)
            | CoordinatorMsg::StopRequested => return None,
        })
    }

    pub fn from_parts(kind: CoordKind, arrays: Vec<Array>) -> Result<CoordinatorMsg, ProtocolError> {
        Ok(match kind {
            CoordKind::StageDone { rank, replica, step, grad_sumsq, loss_sum } => {
                CoordinatorMsg::StageDone(StageReport {
                    rank: rank as usize,
                    replica: replica as usize,
                    step,
                    grad_sumsq: grad_sumsq.into_iter().map(|(i, s)| (i as usize, s)).collect(),
                    loss_sum,
                })
            }
            CoordKind::Applied { rank, replica, step } => {
                CoordinatorMsg::Applied { rank: rank as usize, replica: replica as usize, step }
            }
            CoordKind::EvalDone { step, exact_match, loss_sum, tokens } => CoordinatorMsg::EvalDone {
                step,
                kind: EvalKind::from_exact_match(exact_match),
                loss_sum,
                tokens: tokens as usize,
                predictions: Arrays::new("EvalDone", arrays, 1)?.u32()?,
            },
            CoordKind::Weights { rank, replica, params, latencies_us, peak_live_bytes, trace } => {
                let mut a = Arrays::new("Weights", arrays, 2 * params.len())?;
                let mut out = Vec::with_capacity(params.len());
                for m in &params {
                    let (data, grad) = (a.f32()?, a.f32()?);
                    let (name, shape, canonical) = (m.name.clone(), shape_of(m), m.canonical as usize);
                    out.push(Param { name, shape, data, grad, canonical });
                }
                CoordinatorMsg::Weights {
                    rank: rank as usize,
                    replica: replica as usize,
                    params: out,
                    latencies_us,
                    peak_live_bytes: peak_live_bytes as usize,
                    trace,
                }
            }
            CoordKind::Failed { actor, step, action, error } => {
                CoordinatorMsg::Failed(Failure { actor, step, action, error })
            }
            CoordKind::Snapshot { rank, step, tensors, adam_step } => {
                let mut a = Arrays::new("Snapshot", arrays, 3 * tensors.len())?;
                let mut out = Vec::with_capacity(tensors.len());
                for m in &tensors {
                    let (name, shape) = (m.name.clone(), shape_of(m));
                    let (data, exp_avg, exp_avg_sq) = (a.f32()?, a.f32()?, a.f32()?);
                    out.push(TensorState { name, shape, data, exp_avg, exp_avg_sq });
                }
                CoordinatorMsg::Snapshot { rank: rank as usize, step, tensors: out, adam_step }
            }
            CoordKind::Restored { rank, replica } => {
                CoordinatorMsg::Restored { rank: rank as usize, replica: replica as usize }
            }
        })
    }

    /// The message's kind and blobs as a log records them. `tensors`: include
    /// the weights and snapshot tensors (the sender's log does; the
    /// coordinator's, which gathers them, keeps only their scalars).
    pub fn logged(&self, keep: bool, tensors: bool) -> (&'static str, Vec<Blob>) {
        match self {
            CoordinatorMsg::Start => ("Start", vec![]),
            CoordinatorMsg::StageDone(r) => {
                let index: Vec<u32> = r.grad_sumsq.iter().map(|x| x.0 as u32).collect();
                let sumsq: Vec<f64> = r.grad_sumsq.iter().map(|x| x.1).collect();
                let mut b = vec![
                    Blob::u32s(key::GRAD_SUMSQ_INDEX, &index, true),
                    Blob::f64s(key::GRAD_SUMSQ, &sumsq, true),
                ];
                b.extend(r.loss_sum.map(|l| Blob::f64(key::LOSS_SUM, l)));
                ("StageDone", b)
            }
            CoordinatorMsg::Applied { .. } => ("Applied", vec![]),
            CoordinatorMsg::Restored { .. } => ("Restored", vec![]),
            CoordinatorMsg::EvalDone { kind, loss_sum, tokens, predictions, .. } => (
                "EvalDone",
                vec![
                    Blob::str(key::EVAL_KIND, kind.name()),
                    Blob::f64(key::LOSS_SUM, *loss_sum),
                    Blob::f64(key::TOKEN_COUNT, *tokens as f64),
                    Blob::u32s(key::PREDICTIONS, predictions, true),
                ],
            ),
            CoordinatorMsg::Weights { params, .. } => {
                let b = match tensors {
                    true => params.iter().map(|p| Blob::f32s(&p.name, &p.data, keep)).collect(),
                    false => vec![],
                };
                ("Weights", b)
            }
            CoordinatorMsg::Snapshot { tensors: ts, adam_step, .. } => {
                let mut b = vec![Blob::f64(key::ADAM_STEP, *adam_step as f64)];
                for t in ts.iter().filter(|_| tensors) {
                    b.push(Blob::f32s(&t.name, &t.data, keep));
                    b.push(Blob::f32s(&format!("{}.exp_avg", t.name), &t.exp_avg, keep));
                    b.push(Blob::f32s(&format!("{}.exp_avg_sq", t.name), &t.exp_avg_sq, keep));
                }
                ("Snapshot", b)
            }
            CoordinatorMsg::Failed(_) => ("Failed", vec![]),
            CoordinatorMsg::Saved { .. } => ("Saved", vec![]),
            CoordinatorMsg::CheckpointFailed(_) => ("CheckpointFailed", vec![]),
            CoordinatorMsg::StopRequested => ("StopRequested", vec![]),
        }
    }

    /// The message a coordinator's log entry recorded (scalars only: the
    /// coordinator logs no tensors). The sender is (entry stage = rank, replica).
    pub fn from_entry(e: &Entry) -> Result<CoordinatorMsg, String> {
        let f64_of = |name: &str| e.input(name).and_then(|b| b.to_f64());
        let rank = e.stage.unwrap_or(0) as usize;
        let replica = e.replica as usize;
        Ok(match e.kind.as_str() {
            "Start" => CoordinatorMsg::Start,
            "StageDone" => {
                let index = e.input(key::GRAD_SUMSQ_INDEX)?.to_u32s()?;
                let sumsq = e.input(key::GRAD_SUMSQ)?.to_f64s()?;
                let loss_sum = match e.input(key::LOSS_SUM) {
                    Ok(b) => Some(b.to_f64()?),
                    Err(_) => None,
                };
                let grad_sumsq = index.into_iter().map(|i| i as usize).zip(sumsq).collect();
                CoordinatorMsg::StageDone(StageReport { rank, replica, step: e.step, grad_sumsq, loss_sum })
            }
            "Applied" => CoordinatorMsg::Applied { rank, replica, step: e.step },
            "Restored" => CoordinatorMsg::Restored { rank, replica },
            "Weights" => CoordinatorMsg::Weights {
                rank,
                replica,
                params: vec![],
                latencies_us: vec![],
                peak_live_bytes: 0,
                trace: vec![],
            },
            "Snapshot" => CoordinatorMsg::Snapshot {
                rank,
                step: e.step,
                tensors: vec![],
                adam_step: f64_of(key::ADAM_STEP)? as u64,
            },
            "EvalDone" => CoordinatorMsg::EvalDone {
                step: e.step,
                kind: EvalKind::from_name(&e.input(key::EVAL_KIND)?.to_str()?)?,
                loss_sum: f64_of(key::LOSS_SUM)?,
                tokens: f64_of(key::TOKEN_COUNT)? as usize,
                predictions: e.input(key::PREDICTIONS)?.to_u32s()?,
            },
            other => return Err(format!("not a message the coordinator logs (`{other}`)")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_round_trip(msg: StageMsg) -> StageKind {
        let (kind, arrays) = msg.into_parts();
        StageMsg::from_parts(kind.clone(), arrays).expect("decodes").header()
    }

    #[test]
    fn a_stage_message_survives_frame_parts_and_a_log_entry() {
        let msgs = [
            StageMsg::Apply { step: 3, lr: 1e-3, clip: 0.5, skip: true },
            StageMsg::RunEval { step: 2, kind: EvalKind::ExactMatch, batches: 4 },
            StageMsg::Tokens { phase: Phase::Eval, step: 1, mb: 2, tokens: vec![5, 6] },
            StageMsg::Activation {
                phase: Phase::Train,
                step: 1,
                stage: 2,
                mb: 3,
                data: vec![1.5],
                sent: Instant::now(),
            },
            StageMsg::Reduced { step: 4, stage: 1, grads: vec![vec![1.0], vec![2.0, 3.0]] },
            StageMsg::Gathered { step: 5, stage: 2, tensors: Arc::new(vec![vec![], vec![4.0, 5.0]]) },
        ];
        for m in msgs {
            let want = m.header();
            let entry = m.logged(true, &|s, k| format!("s{s}.{k}")).entry("x", 0, 0);
            let back = StageMsg::from_entry(&entry, std::path::Path::new("/")).expect("entry decodes");
            assert_eq!(back.header(), want);
            assert_eq!(header_round_trip(back), want);
        }
    }

    #[test]
    fn a_frame_with_the_wrong_arrays_is_an_error_naming_the_kind() {
        let kind = StageKind::Gradient { step: 0, stage: 1, mb: 0 };
        let e = StageMsg::from_parts(kind, vec![Array::U32(vec![1])]).err().expect("rejected");
        assert!(e.to_string().contains("Gradient"), "{e}");
    }
}
