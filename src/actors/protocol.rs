//! The runtime's messages, declared once: what the stages, the coordinator,
//! the data loaders, the reducer, the checkpointer and the monitor say to
//! each other, and the two ways a message leaves an actor.
//!
//! - As a frame (`cluster::wire`): the message itself as a serde header (its
//!   tensor fields skipped) carrying every scalar, plus the tensors as raw arrays, bit for bit.
//! - As a replay log entry (`replay`): the header's kind name, step, stage and
//!   microbatch as entry fields, the other scalars and the tensors as named
//!   blobs (`replay::key`).
//!
//! Both go through the header, so a message kind's fields are listed here and
//! nowhere else. Decoding is fallible: a frame or entry that does not fit the
//! kind it claims is a `ProtocolError`, never a panic. This module does no I/O
//! except `Restore`'s checkpoint read.

use crate::checkpoint::{StateFile, TensorState};
use crate::metrics::StepMetrics;
use crate::model::Param;
use crate::optim::grad_tree::Span;
use crate::replay::{key, Blob, Entry};
use ractor::Message;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// Whether a message belongs to training or to a forward-only evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    Train,
    Eval,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
}

/// Actor names as the replay log uses them: stage-R (replica 0), stage-R.K.
pub fn stage_name(rank: usize, replica: usize) -> String {
    if replica == 0 {
        format!("stage-{rank}")
    } else {
        format!("stage-{rank}.{replica}")
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageReport {
    pub rank: usize,
    pub replica: usize,
    pub step: u64,
    /// (canonical tensor index, Σg²), replica 0 only.
    pub grad_sumsq: Vec<(usize, f64)>,
    /// Σ loss over the step's microbatches, from the rank holding the last stage.
    pub loss_sum: Option<f64>,
}

/// A stage's messages. Serde writes a message's scalars (a frame's header,
/// through `cluster::wire`); its tensors are skipped there and travel as raw
/// arrays beside it, split out and put back by [`StageMsg::into_parts`] /
/// [`StageMsg::from_parts`] from the one table of them, [`StageMsg::tensors`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
        #[serde(skip)]
        tokens: Vec<u32>,
    },
    Targets {
        phase: Phase,
        step: u64,
        mb: usize,
        #[serde(skip)]
        targets: Vec<u32>,
    },
    /// The input of F on `stage`. `sent`: when it was sent, then (restamped by
    /// the receiving stage's actor) when it arrived.
    Activation {
        phase: Phase,
        step: u64,
        stage: usize,
        mb: usize,
        #[serde(skip)]
        data: Vec<f32>,
        #[serde(skip)]
        sent: Sent,
    },
    /// The gradient of `stage`'s output, for its B or I (`sent` as for `Activation`).
    Gradient {
        step: u64,
        stage: usize,
        mb: usize,
        #[serde(skip)]
        data: Vec<f32>,
        #[serde(skip)]
        sent: Sent,
    },
    /// The other rank's share of the tied embedding's gradient.
    TiedShare {
        step: u64,
        #[serde(skip)]
        data: Vec<f32>,
    },
    /// Gradients of `stage` summed over replicas (under ZeRO-1, this replica's
    /// shard of each tensor).
    Reduced {
        step: u64,
        stage: usize,
        #[serde(skip)]
        grads: Vec<Vec<f32>>,
    },
    /// ZeRO-2 and 3: this replica's shard of every replica's gradient of
    /// microbatch `mb` (the replica's own index) of `stage` — the head's
    /// tensors or the body's — replicas in order, each a set of tensors.
    Scattered {
        step: u64,
        stage: usize,
        mb: usize,
        head: bool,
        #[serde(skip)]
        shards: Vec<Vec<f32>>,
    },
    /// ZeRO-1: `stage`'s tensors gathered whole from every replica's shard
    /// (the updated parameters, or for a checkpoint the AdamW moments). Shared:
    /// in one process every replica reads the one copy the reducer made.
    Gathered {
        step: u64,
        stage: usize,
        #[serde(skip)]
        tensors: Arc<Vec<Vec<f32>>>,
    },
    /// Send the parameters to the coordinator (end of run).
    SendWeights,
    /// Copy parameters and AdamW moments for a checkpoint of step `step`.
    Snapshot {
        step: u64,
    },
    /// Reload parameters and moments from a checkpoint (a rollback).
    Restore(Checkpoint),
    Stop,
}

/// A rollback's checkpoint. It crosses a link, and a log, as its directory
/// (processes share the run's filesystem) and is read again where it arrives.
#[derive(Clone, Serialize, Deserialize)]
pub struct Checkpoint {
    pub dir: String,
    #[serde(skip)]
    loaded: Option<Arc<crate::checkpoint::Loaded>>,
}

impl Checkpoint {
    pub fn new(loaded: Arc<crate::checkpoint::Loaded>) -> Checkpoint {
        Checkpoint { dir: loaded.dir.display().to_string(), loaded: Some(loaded) }
    }

    /// The checkpoint as read: a message a stage handles has been through
    /// [`StageMsg::from_parts`] (or was made in this process), which read it.
    pub fn loaded(&self) -> &crate::checkpoint::Loaded {
        self.loaded.as_ref().expect("a delivered Restore holds its checkpoint")
    }
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpoint({})", self.dir)
    }
}

impl PartialEq for Checkpoint {
    fn eq(&self, other: &Checkpoint) -> bool {
        self.dir == other.dir
    }
}

impl Message for StageMsg {}

/// Messages to the coordinator. As for [`StageMsg`], serde writes the scalars
/// (parameter and tensor names and shapes included) and the tensors travel
/// beside them as arrays, by the one table [`CoordinatorMsg::tensors_mut`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
        #[serde(skip)]
        predictions: Vec<u32>,
    },
    Weights {
        rank: usize,
        replica: usize,
        params: Vec<Param>,
        /// The EMA of the weights, whole, one vector per parameter in the
        /// order of `params` (empty when none is kept, and from replicas > 0).
        ema: Vec<Vec<f32>>,
        latencies_us: Vec<f64>,
        peak_live_bytes: usize,
        /// Most bytes of weights, gradients and optimizer state held.
        peak_state_bytes: usize,
        trace: Vec<crate::trace::Record>,
    },
    Failed(Failure),
    /// A stage's copy of its parameters and moments for the checkpoint of `step`.
    Snapshot {
        rank: usize,
        step: u64,
        tensors: Vec<TensorState>,
        adam_step: u64,
        /// The EMA's update count; None when no EMA is kept.
        ema_updates: Option<u64>,
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
    /// What the coordinator itself saw of a failure (a child that stopped, a
    /// send that was refused), sent to itself so that it is handled after the
    /// messages already queued: the failing stage's own `Failed`, sent before
    /// it stopped, says why and is reported instead.
    Symptom(String),
}

impl Message for CoordinatorMsg {}

/// Messages to a data loader, from the coordinator: feed a training step,
/// or an evaluation. They never leave the process (each process's loaders
/// hear from its own coordinator) and carry no tensors.
#[derive(Clone, Debug, PartialEq)]
pub enum LoaderMsg {
    Train { step: u64 },
    Eval { step: u64, kind: EvalKind, batches: usize },
}

impl Message for LoaderMsg {}

/// Messages to the gradient reducer, from the stages of every replica. They
/// cross processes as their own frame kinds (`cluster::wire`'s `Reduce` and
/// `Gather`: the scalars in the header, each tensor an f32 array).
#[derive(Clone, Debug, PartialEq)]
pub enum ReducerMsg {
    /// A replica's gradients of one stage as nodes of the step's microbatch
    /// tree: `grads` holds `spans.len()` sets of the stage's tensors, one
    /// after the other.
    Reduce { step: u64, stage: usize, replica: usize, spans: Vec<Span>, grads: Vec<Vec<f32>> },
    /// ZeRO: a replica's shard of each of `stage`'s tensors (updated
    /// parameters, or AdamW moments for a checkpoint), to be sent whole to
    /// every replica.
    Gather { step: u64, stage: usize, replica: usize, shards: Vec<Vec<f32>> },
    /// ZeRO-2 and 3: a replica's gradient of its microbatch `mb` of `stage`
    /// (the head's tensors, or the body's), whole, to be cut into shards for
    /// their owners as soon as every replica's is in.
    Scatter { step: u64, stage: usize, replica: usize, mb: usize, head: bool, grads: Vec<Vec<f32>> },
}

impl Message for ReducerMsg {}

/// Messages to the checkpointer, from the coordinator: one checkpoint's
/// tensors (parameters and moments, gathered from every stage) and state
/// file. Local to rank 0's process.
pub enum CheckpointerMsg {
    Write { tensors: Vec<TensorState>, state: StateFile },
}

impl Message for CheckpointerMsg {}

/// Messages to the monitor, from the coordinator: a step's metrics, and the
/// end of the run. Local to rank 0's process.
pub enum MonitorMsg {
    Step(StepMetrics),
    Finish,
}

impl Message for MonitorMsg {}

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

    fn has_more(&self) -> bool {
        self.it.len() > 0
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

/// When a data message was sent, then (restamped by the receiving stage's
/// actor) when it arrived. Not part of what the message says: equal whatever
/// the time, and not carried across a link (the receiver stamps its own).
#[derive(Clone, Copy, Debug)]
pub struct Sent(pub Instant);

impl Sent {
    pub fn now() -> Sent {
        Sent(Instant::now())
    }
}

impl Default for Sent {
    fn default() -> Sent {
        Sent::now()
    }
}

impl PartialEq for Sent {
    fn eq(&self, _: &Sent) -> bool {
        true
    }
}

/// One tensor field of a message: token ids logged under their key, one f32
/// tensor logged as `key::DATA`, or a gradient list (each logged under its
/// parameter's name).
enum Tensor<U, F, L> {
    U32(&'static str, U),
    F32(F),
    F32s(L),
}

type TensorRef<'a> = Tensor<&'a Vec<u32>, &'a Vec<f32>, &'a Vec<Vec<f32>>>;
type TensorMut<'a> = Tensor<&'a mut Vec<u32>, &'a mut Vec<f32>, &'a mut Vec<Vec<f32>>>;

/// The table of every message's tensor fields, written once and expanded
/// for reading (logs) and for moving tensors out and in (frames, replay).
macro_rules! tensor_table {
    ($(#[$m:meta])* fn $name:ident($self_ty:ty) -> $out:ty, shared: $shared:path) => {
        $(#[$m])*
        fn $name(self: $self_ty) -> Vec<$out> {
            match self {
                StageMsg::Tokens { tokens, .. } => vec![Tensor::U32(key::TOKENS, tokens)],
                StageMsg::Targets { targets, .. } => vec![Tensor::U32(key::TARGETS, targets)],
                StageMsg::Activation { data, .. }
                | StageMsg::Gradient { data, .. }
                | StageMsg::TiedShare { data, .. } => vec![Tensor::F32(data)],
                StageMsg::Reduced { grads, .. } => vec![Tensor::F32s(grads)],
                StageMsg::Scattered { shards, .. } => vec![Tensor::F32s(shards)],
                StageMsg::Gathered { tensors, .. } => vec![Tensor::F32s($shared(tensors))],
                _ => vec![],
            }
        }
    };
}

fn shared_ref(tensors: &Arc<Vec<Vec<f32>>>) -> &Vec<Vec<f32>> {
    tensors
}

/// Only a message leaving the process (or one being built from a log) is
/// written through this, so the copy `make_mut` makes of a shared list is
/// the copy a frame needs anyway.
fn shared_mut(tensors: &mut Arc<Vec<Vec<f32>>>) -> &mut Vec<Vec<f32>> {
    Arc::make_mut(tensors)
}

/// Moves the tensors out of a message, in table order.
fn take_arrays(slots: Vec<TensorMut<'_>>) -> Vec<Array> {
    let mut arrays = Vec::new();
    for t in slots {
        match t {
            Tensor::U32(_, v) => arrays.push(Array::U32(std::mem::take(v))),
            Tensor::F32(v) => arrays.push(Array::F32(std::mem::take(v))),
            Tensor::F32s(l) => arrays.extend(std::mem::take(l).into_iter().map(Array::F32)),
        }
    }
    arrays
}

/// Puts a frame's arrays back into a `what` message's tensors, checking
/// their number and types (a gradient list takes every array there is).
fn fill_arrays(
    what: &'static str,
    mut slots: Vec<TensorMut<'_>>,
    arrays: Vec<Array>,
) -> Result<(), ProtocolError> {
    let list = slots.iter().any(|t| matches!(t, Tensor::F32s(_)));
    let expected = if list { arrays.len() } else { slots.len() };
    let mut a = Arrays::new(what, arrays, expected)?;
    for t in slots.iter_mut() {
        match t {
            Tensor::U32(_, v) => **v = a.u32()?,
            Tensor::F32(v) => **v = a.f32()?,
            Tensor::F32s(l) => {
                **l = std::iter::from_fn(|| a.has_more().then(|| a.f32())).collect::<Result<_, _>>()?
            }
        }
    }
    Ok(())
}

impl StageMsg {
    tensor_table!(fn tensors(&Self) -> TensorRef<'_>, shared: shared_ref);
    tensor_table!(fn tensors_mut(&mut Self) -> TensorMut<'_>, shared: shared_mut);

    /// The kind's name in logs and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            StageMsg::RunStep { .. } => "RunStep",
            StageMsg::Apply { .. } => "Apply",
            StageMsg::RunEval { .. } => "RunEval",
            StageMsg::Tokens { .. } => "Tokens",
            StageMsg::Targets { .. } => "Targets",
            StageMsg::Activation { .. } => "Activation",
            StageMsg::Gradient { .. } => "Gradient",
            StageMsg::TiedShare { .. } => "TiedShare",
            StageMsg::Reduced { .. } => "Reduced",
            StageMsg::Scattered { .. } => "Scattered",
            StageMsg::Gathered { .. } => "Gathered",
            StageMsg::SendWeights => "SendWeights",
            StageMsg::Snapshot { .. } => "Snapshot",
            StageMsg::Restore(_) => "Restore",
            StageMsg::Stop => "Stop",
        }
    }

    /// The optimizer step the message belongs to (`None`: it names none).
    pub fn step(&self) -> Option<u64> {
        use StageMsg::*;
        match self {
            RunStep { step, .. }
            | Apply { step, .. }
            | RunEval { step, .. }
            | Tokens { step, .. }
            | Targets { step, .. }
            | Activation { step, .. }
            | Gradient { step, .. }
            | TiedShare { step, .. }
            | Reduced { step, .. }
            | Scattered { step, .. }
            | Gathered { step, .. }
            | Snapshot { step } => Some(*step),
            SendWeights | Restore(_) | Stop => None,
        }
    }

    /// The message with its tensors moved out (no copy): a frame's header
    /// (serde writes its scalars) and its arrays.
    pub fn into_parts(mut self) -> (StageMsg, Vec<Array>) {
        let arrays = take_arrays(self.tensors_mut());
        (self, arrays)
    }

    /// The message a header and its arrays make. `Restore` reads its checkpoint here.
    pub fn from_parts(mut head: StageMsg, arrays: Vec<Array>) -> Result<StageMsg, ProtocolError> {
        let what = head.name();
        fill_arrays(what, head.tensors_mut(), arrays)?;
        head.read_checkpoint()?;
        Ok(head)
    }

    /// A `Restore` that arrived as its directory reads the checkpoint.
    fn read_checkpoint(&mut self) -> Result<(), ProtocolError> {
        if let StageMsg::Restore(c) = self {
            if c.loaded.is_none() {
                let loaded = crate::checkpoint::load(std::path::Path::new(&c.dir))
                    .map_err(|e| bad("Restore", format!("{}: {e}", c.dir)))?;
                c.loaded = Some(Arc::new(loaded));
            }
        }
        Ok(())
    }

    /// (stage, microbatch, evaluation traffic) as a log entry's fields.
    fn entry_fields(&self) -> (Option<usize>, Option<usize>, bool) {
        let eval = |p: &Phase| *p == Phase::Eval;
        match self {
            StageMsg::RunEval { .. } => (None, None, true),
            StageMsg::Tokens { phase, mb, .. } | StageMsg::Targets { phase, mb, .. } => {
                (None, Some(*mb), eval(phase))
            }
            StageMsg::Activation { phase, stage, mb, .. } => (Some(*stage), Some(*mb), eval(phase)),
            StageMsg::Gradient { stage, mb, .. } => (Some(*stage), Some(*mb), false),
            StageMsg::Reduced { stage, .. } | StageMsg::Gathered { stage, .. } => (Some(*stage), None, false),
            StageMsg::Scattered { stage, mb, .. } => (Some(*stage), Some(*mb), false),
            _ => (None, None, false),
        }
    }

    /// The scalars a log entry keeps as blobs (the rest are entry fields).
    fn scalar_blobs(&self) -> Vec<Blob> {
        match self {
            StageMsg::RunStep { loss_scale, .. } => vec![Blob::f64(key::LOSS_SCALE, *loss_scale as f64)],
            StageMsg::Apply { lr, clip, skip, .. } => vec![
                Blob::f64(key::LR, *lr),
                Blob::f64(key::CLIP, *clip as f64),
                Blob::f64(key::SKIP, *skip as u8 as f64),
            ],
            StageMsg::RunEval { kind, batches, .. } => {
                vec![Blob::str(key::EVAL_KIND, kind.name()), Blob::f64(key::BATCHES, *batches as f64)]
            }
            StageMsg::Restore(c) => vec![Blob::str(key::CHECKPOINT, &c.dir)],
            StageMsg::Scattered { head, .. } => vec![Blob::f64(key::HEAD, *head as u8 as f64)],
            _ => vec![],
        }
    }

    /// The message a log entry describes, tensors not yet filled in;
    /// `Restore`'s directory is taken relative to `run_dir`.
    fn head_of_entry(e: &Entry, run_dir: &std::path::Path) -> Result<StageMsg, String> {
        let f64_of = |name: &str| e.input(name).and_then(|b| b.to_f64());
        let (step, phase) = (e.step, if e.eval { Phase::Eval } else { Phase::Train });
        let stage = e.stage.unwrap_or(0) as usize;
        let mb = e.mb.unwrap_or(0) as usize;
        let (data, sent) = (vec![], Sent::now());
        Ok(match e.kind.as_str() {
            "RunStep" => StageMsg::RunStep { step, loss_scale: f64_of(key::LOSS_SCALE)? as f32 },
            "Apply" => StageMsg::Apply {
                step,
                lr: f64_of(key::LR)?,
                clip: f64_of(key::CLIP)? as f32,
                skip: f64_of(key::SKIP)? != 0.0,
            },
            "RunEval" => StageMsg::RunEval {
                step,
                kind: EvalKind::from_name(&e.input(key::EVAL_KIND)?.to_str()?)?,
                batches: f64_of(key::BATCHES)? as usize,
            },
            "Tokens" => StageMsg::Tokens { phase, step, mb, tokens: vec![] },
            "Targets" => StageMsg::Targets { phase, step, mb, targets: vec![] },
            "Activation" => StageMsg::Activation { phase, step, stage, mb, data, sent },
            "Gradient" => StageMsg::Gradient { step, stage, mb, data, sent },
            "TiedShare" => StageMsg::TiedShare { step, data },
            "Reduced" => StageMsg::Reduced { step, stage, grads: vec![] },
            "Scattered" => {
                StageMsg::Scattered { step, stage, mb, head: f64_of(key::HEAD)? != 0.0, shards: vec![] }
            }
            "Gathered" => StageMsg::Gathered { step, stage, tensors: Arc::new(vec![]) },
            "SendWeights" => StageMsg::SendWeights,
            "Snapshot" => StageMsg::Snapshot { step },
            "Restore" => {
                let dir = std::path::PathBuf::from(e.input(key::CHECKPOINT)?.to_str()?);
                let dir = if dir.is_absolute() { dir } else { run_dir.join(dir) };
                StageMsg::Restore(Checkpoint { dir: dir.display().to_string(), loaded: None })
            }
            other => return Err(format!("a stage does not handle `{other}`")),
        })
    }

    /// The message as a log records it. Tensors are named by payload key;
    /// `Reduced`'s gradients by `grad_name(stage, k)` (the parameter's name).
    /// `keep`: store tensor bytes, not only their digests.
    pub fn logged(&self, keep: bool, grad_name: &dyn Fn(usize, usize) -> String) -> Logged {
        let (stage, mb, eval) = self.entry_fields();
        // Gathered tensors are parameters or moments, scattered ones shards
        // of several replicas' gradients: numbered, not named.
        let numbered = matches!(self, StageMsg::Gathered { .. } | StageMsg::Scattered { .. });
        let grad_name = if numbered { &no_grad_names } else { grad_name };
        let mut blobs = self.scalar_blobs();
        for t in self.tensors() {
            match t {
                Tensor::U32(name, v) => blobs.push(Blob::u32s(name, v, keep)),
                Tensor::F32(v) => blobs.push(Blob::f32s(key::DATA, v, keep)),
                Tensor::F32s(l) => blobs.extend(
                    l.iter().enumerate().map(|(k, g)| Blob::f32s(&grad_name(stage.unwrap_or(0), k), g, keep)),
                ),
            }
        }
        let step = match self {
            StageMsg::Restore(c) => c.loaded.as_ref().map(|l| l.state.step),
            _ => self.step(),
        };
        Logged { kind: self.name(), step, stage, mb, eval, blobs }
    }

    /// The message a log entry recorded (its tensors must have been kept).
    pub fn from_entry(e: &Entry, run_dir: &std::path::Path) -> Result<StageMsg, String> {
        let mut msg = StageMsg::head_of_entry(e, run_dir)?;
        for t in msg.tensors_mut() {
            match t {
                Tensor::U32(name, v) => *v = e.input(name)?.to_u32s()?,
                Tensor::F32(v) => *v = e.input(key::DATA)?.to_f32s()?,
                Tensor::F32s(l) => {
                    // A scattered set's head flag is a scalar blob beside its tensors.
                    let tensors = e.inputs.iter().filter(|b| b.name != key::HEAD);
                    *l = tensors.map(|b| b.to_f32s()).collect::<Result<_, _>>()?
                }
            }
        }
        msg.read_checkpoint().map_err(|x| x.to_string())?;
        Ok(msg)
    }
}

impl CoordinatorMsg {
    /// The kind's name in logs and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            CoordinatorMsg::Start => "Start",
            CoordinatorMsg::StageDone(_) => "StageDone",
            CoordinatorMsg::Applied { .. } => "Applied",
            CoordinatorMsg::EvalDone { .. } => "EvalDone",
            CoordinatorMsg::Weights { .. } => "Weights",
            CoordinatorMsg::Failed(_) => "Failed",
            CoordinatorMsg::Snapshot { .. } => "Snapshot",
            CoordinatorMsg::Saved { .. } => "Saved",
            CoordinatorMsg::CheckpointFailed(_) => "CheckpointFailed",
            CoordinatorMsg::Restored { .. } => "Restored",
            CoordinatorMsg::StopRequested => "StopRequested",
            CoordinatorMsg::Symptom(_) => "Symptom",
        }
    }

    /// The message's tensors, in frame order: each parameter's data then its
    /// gradient, then each EMA tensor; each snapshot tensor's data, exp_avg,
    /// exp_avg_sq, ema.
    fn tensors_mut(&mut self) -> Vec<TensorMut<'_>> {
        match self {
            CoordinatorMsg::EvalDone { predictions, .. } => vec![Tensor::U32(key::PREDICTIONS, predictions)],
            CoordinatorMsg::Weights { params, ema, .. } => params
                .iter_mut()
                .flat_map(|p| [Tensor::F32(&mut p.data), Tensor::F32(&mut p.grad)])
                // Last: a list takes every array left.
                .chain([Tensor::F32s(ema)])
                .collect(),
            CoordinatorMsg::Snapshot { tensors, .. } => tensors
                .iter_mut()
                .flat_map(|t| {
                    [
                        Tensor::F32(&mut t.data),
                        Tensor::F32(&mut t.exp_avg),
                        Tensor::F32(&mut t.exp_avg_sq),
                        Tensor::F32(&mut t.ema),
                    ]
                })
                .collect(),
            _ => vec![],
        }
    }

    /// Header and tensors. `None`: the message only exists inside rank 0.
    pub fn into_parts(mut self) -> Option<(CoordinatorMsg, Vec<Array>)> {
        match self {
            CoordinatorMsg::Start
            | CoordinatorMsg::Saved { .. }
            | CoordinatorMsg::CheckpointFailed(_)
            | CoordinatorMsg::StopRequested => None,
            _ => {
                let arrays = take_arrays(self.tensors_mut());
                Some((self, arrays))
            }
        }
    }

    pub fn from_parts(mut head: CoordinatorMsg, arrays: Vec<Array>) -> Result<CoordinatorMsg, ProtocolError> {
        let what = head.name();
        fill_arrays(what, head.tensors_mut(), arrays)?;
        Ok(head)
    }

    /// The message's kind and blobs as a log records them. `tensors`: include
    /// the weights and snapshot tensors (the sender's log does; the
    /// coordinator's, which gathers them, keeps only their scalars).
    pub fn logged(&self, keep: bool, tensors: bool) -> (&'static str, Vec<Blob>) {
        let blobs = match self {
            CoordinatorMsg::StageDone(r) => {
                let index: Vec<u32> = r.grad_sumsq.iter().map(|x| x.0 as u32).collect();
                let sumsq: Vec<f64> = r.grad_sumsq.iter().map(|x| x.1).collect();
                let mut b = vec![
                    Blob::u32s(key::GRAD_SUMSQ_INDEX, &index, true),
                    Blob::f64s(key::GRAD_SUMSQ, &sumsq, true),
                ];
                b.extend(r.loss_sum.map(|l| Blob::f64(key::LOSS_SUM, l)));
                b
            }
            CoordinatorMsg::EvalDone { kind, loss_sum, tokens, predictions, .. } => vec![
                Blob::str(key::EVAL_KIND, kind.name()),
                Blob::f64(key::LOSS_SUM, *loss_sum),
                Blob::f64(key::TOKEN_COUNT, *tokens as f64),
                Blob::u32s(key::PREDICTIONS, predictions, true),
            ],
            CoordinatorMsg::Weights { params, .. } if tensors => {
                params.iter().map(|p| Blob::f32s(&p.name, &p.data, keep)).collect()
            }
            CoordinatorMsg::Snapshot { tensors: ts, adam_step, ema_updates, .. } => {
                let mut b = vec![Blob::f64(key::ADAM_STEP, *adam_step as f64)];
                b.extend(ema_updates.map(|n| Blob::f64(key::EMA_UPDATES, n as f64)));
                for t in ts.iter().filter(|_| tensors) {
                    b.push(Blob::f32s(&t.name, &t.data, keep));
                    b.push(Blob::f32s(&format!("{}.exp_avg", t.name), &t.exp_avg, keep));
                    b.push(Blob::f32s(&format!("{}.exp_avg_sq", t.name), &t.exp_avg_sq, keep));
                    if ema_updates.is_some() {
                        b.push(Blob::f32s(&format!("{}.ema", t.name), &t.ema, keep));
                    }
                }
                b
            }
            // The rest log no blobs: their kind (and entry fields) say it all.
            _ => vec![],
        };
        (self.name(), blobs)
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
                ema: vec![],
                latencies_us: vec![],
                peak_live_bytes: 0,
                peak_state_bytes: 0,
                trace: vec![],
            },
            "Snapshot" => CoordinatorMsg::Snapshot {
                rank,
                step: e.step,
                tensors: vec![],
                adam_step: f64_of(key::ADAM_STEP)? as u64,
                // Logs from before the EMA have no count: they kept none.
                ema_updates: e
                    .input(key::EMA_UPDATES)
                    .ok()
                    .map(|b| b.to_f64())
                    .transpose()?
                    .map(|n| n as u64),
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

impl LoaderMsg {
    /// The message's kind and blobs as a log records them (the sender's and
    /// the loader's alike).
    pub fn logged(&self) -> (&'static str, Vec<Blob>) {
        match self {
            LoaderMsg::Train { .. } => ("Train", vec![]),
            LoaderMsg::Eval { kind, batches, .. } => (
                "Eval",
                vec![Blob::str(key::EVAL_KIND, kind.name()), Blob::f64(key::BATCHES, *batches as f64)],
            ),
        }
    }

    /// The message a loader's log entry recorded.
    pub fn from_entry(e: &Entry) -> Result<LoaderMsg, String> {
        Ok(match e.kind.as_str() {
            "Train" => LoaderMsg::Train { step: e.step },
            "Eval" => LoaderMsg::Eval {
                step: e.step,
                kind: EvalKind::from_name(&e.input(key::EVAL_KIND)?.to_str()?)?,
                batches: e.input(key::BATCHES)?.to_f64()? as usize,
            },
            other => return Err(format!("a loader does not handle `{other}`")),
        })
    }
}

/// The spans of a Reduce as a log blob: (lo, hi) pairs.
pub fn span_blob(spans: &[Span]) -> Blob {
    let flat: Vec<u32> = spans.iter().flat_map(|s| [s.lo as u32, s.hi as u32]).collect();
    Blob::u32s(key::SPANS, &flat, true)
}

impl ReducerMsg {
    /// The message's kind and blobs as its sender's log records them: a
    /// Reduce's spans, then its gradients named by `grad_name(stage, k)`
    /// (the parameter's name); a Gather's shards numbered, as for `Gathered`.
    pub fn logged(
        &self,
        keep: bool,
        grad_name: &dyn Fn(usize, usize) -> String,
    ) -> (&'static str, Vec<Blob>) {
        match self {
            ReducerMsg::Reduce { stage, spans, grads, .. } => {
                let mut blobs = vec![span_blob(spans)];
                let named = |(k, g): (usize, &Vec<f32>)| Blob::f32s(&grad_name(*stage, k), g, keep);
                blobs.extend(grads.iter().enumerate().map(named));
                ("Reduce", blobs)
            }
            ReducerMsg::Gather { shards, .. } => {
                let named = |(k, s): (usize, &Vec<f32>)| Blob::f32s(&format!("tensor.{k}"), s, keep);
                ("Gather", shards.iter().enumerate().map(named).collect())
            }
            ReducerMsg::Scatter { mb, head, grads, .. } => {
                let mut blobs = vec![Blob::u32s(key::LEAF, &[*mb as u32, *head as u32], true)];
                let named = |(k, s): (usize, &Vec<f32>)| Blob::f32s(&format!("tensor.{k}"), s, keep);
                blobs.extend(grads.iter().enumerate().map(named));
                ("Scatter", blobs)
            }
        }
    }

    /// The message a reducer's log entry recorded (its tensors must have
    /// been kept): the spans blob first, then the tensors in order.
    pub fn from_entry(e: &Entry) -> Result<ReducerMsg, String> {
        let stage = e.stage.ok_or("names no stage")? as usize;
        let (step, replica) = (e.step, e.replica as usize);
        let f32s = |blobs: &[Blob]| blobs.iter().map(|b| b.to_f32s()).collect::<Result<Vec<_>, _>>();
        match e.kind.as_str() {
            "Gather" => Ok(ReducerMsg::Gather { step, stage, replica, shards: f32s(&e.inputs)? }),
            "Scatter" => {
                let (leaf, tensors) = e.inputs.split_first().ok_or("holds no microbatch")?;
                let leaf = leaf.to_u32s()?;
                let [mb, head] = leaf[..] else {
                    return Err(format!("{}: {} values, not (microbatch, head)", key::LEAF, leaf.len()));
                };
                let (mb, head) = (mb as usize, head != 0);
                Ok(ReducerMsg::Scatter { step, stage, replica, mb, head, grads: f32s(tensors)? })
            }
            "Reduce" => {
                let (spans, tensors) = e.inputs.split_first().ok_or("holds no tree spans")?;
                let spans = spans.to_u32s()?;
                if spans.len() % 2 != 0 {
                    return Err(format!("{}: {} values, not (lo, hi) pairs", key::SPANS, spans.len()));
                }
                let spans = spans.chunks(2).map(|p| Span { lo: p[0] as usize, hi: p[1] as usize }).collect();
                Ok(ReducerMsg::Reduce { step, stage, replica, spans, grads: f32s(tensors)? })
            }
            other => Err(format!("the reducer does not handle `{other}`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                sent: Sent::now(),
            },
            StageMsg::Reduced { step: 4, stage: 1, grads: vec![vec![1.0], vec![2.0, 3.0]] },
            StageMsg::Gathered { step: 5, stage: 2, tensors: Arc::new(vec![vec![], vec![4.0, 5.0]]) },
            StageMsg::Scattered { step: 6, stage: 1, mb: 3, head: true, shards: vec![vec![1.0], vec![]] },
        ];
        for m in msgs {
            let entry = m.logged(true, &|s, k| format!("s{s}.{k}")).entry("x", 0, 0);
            let back = StageMsg::from_entry(&entry, std::path::Path::new("/")).expect("entry decodes");
            assert_eq!(back, m);
            let (head, arrays) = back.into_parts();
            assert!(head.tensors().iter().all(|t| match t {
                Tensor::U32(_, v) => v.is_empty(),
                Tensor::F32(v) => v.is_empty(),
                Tensor::F32s(l) => l.is_empty(),
            }));
            assert_eq!(StageMsg::from_parts(head, arrays).expect("decodes"), m);
        }
    }

    #[test]
    fn a_coordinator_message_survives_frame_parts() {
        let param = |name: &str, data: Vec<f32>, grad: Vec<f32>| Param {
            name: name.into(),
            shape: vec![data.len()],
            data,
            grad,
            canonical: 3,
        };
        let tensor = TensorState {
            name: "h.0.mlp.c_fc.weight".into(),
            shape: vec![1],
            data: vec![1.0],
            exp_avg: vec![2.0],
            exp_avg_sq: vec![3.0],
            ema: vec![4.0],
        };
        let msgs = [
            CoordinatorMsg::Weights {
                rank: 1,
                replica: 0,
                params: vec![
                    param("wte.weight", vec![1.0, 2.0], vec![0.5, -0.5]),
                    param("b", vec![3.0], vec![]),
                ],
                ema: vec![vec![1.5, 2.5], vec![3.5]],
                latencies_us: vec![1.5],
                peak_live_bytes: 7,
                peak_state_bytes: 9,
                trace: vec![],
            },
            CoordinatorMsg::Snapshot {
                rank: 0,
                step: 4,
                tensors: vec![tensor.clone(), tensor],
                adam_step: 3,
                ema_updates: Some(3),
            },
            CoordinatorMsg::EvalDone {
                step: 2,
                kind: EvalKind::ExactMatch,
                loss_sum: 1.25,
                tokens: 9,
                predictions: vec![4, 5],
            },
            CoordinatorMsg::StageDone(StageReport {
                rank: 1,
                replica: 1,
                step: 2,
                grad_sumsq: vec![(0, 0.5)],
                loss_sum: None,
            }),
        ];
        for m in msgs {
            let (head, arrays) = m.clone().into_parts().expect("crosses processes");
            assert_eq!(CoordinatorMsg::from_parts(head, arrays).expect("decodes"), m);
        }
        assert!(CoordinatorMsg::StopRequested.into_parts().is_none(), "rank 0's own");
    }

    #[test]
    fn loader_and_reducer_messages_survive_a_log_entry() {
        let loader =
            [LoaderMsg::Train { step: 3 }, LoaderMsg::Eval { step: 4, kind: EvalKind::Val, batches: 2 }];
        for (step, m) in [3, 4].into_iter().zip(loader) {
            let (kind, blobs) = m.logged();
            let e = crate::replay::entry("coordinator", kind, step, 0).with_inputs(blobs);
            assert_eq!(LoaderMsg::from_entry(&e).expect("entry decodes"), m);
        }
        let spans = vec![Span { lo: 0, hi: 2 }, Span { lo: 2, hi: 3 }];
        let reducer = [
            ReducerMsg::Reduce {
                step: 5,
                stage: 1,
                replica: 1,
                spans,
                grads: vec![vec![1.0], vec![2.0, 3.0]],
            },
            ReducerMsg::Gather { step: 6, stage: 2, replica: 0, shards: vec![vec![], vec![4.0]] },
            ReducerMsg::Scatter { step: 7, stage: 1, replica: 1, mb: 2, head: false, grads: vec![vec![5.0]] },
        ];
        for m in reducer {
            let (step, stage, replica) = match &m {
                ReducerMsg::Reduce { step, stage, replica, .. }
                | ReducerMsg::Gather { step, stage, replica, .. }
                | ReducerMsg::Scatter { step, stage, replica, .. } => (*step, *stage, *replica),
            };
            let (kind, blobs) = m.logged(true, &|s, k| format!("s{s}.{k}"));
            let e = crate::replay::entry("stage-0", kind, step, replica).with_stage(stage).with_inputs(blobs);
            assert_eq!(ReducerMsg::from_entry(&e).expect("entry decodes"), m);
        }
    }

    #[test]
    fn a_reduce_entry_with_half_a_span_is_an_error_not_a_panic() {
        let e = crate::replay::entry("stage-0", "Reduce", 0, 0).with_stage(0).with_inputs(vec![Blob::u32s(
            key::SPANS,
            &[0, 1, 2],
            true,
        )]);
        let why = ReducerMsg::from_entry(&e).expect_err("refused");
        assert!(why.contains("pairs"), "{why}");
    }

    #[test]
    fn a_frame_with_the_wrong_arrays_is_an_error_naming_the_kind() {
        let head = StageMsg::Gradient { step: 0, stage: 1, mb: 0, data: vec![], sent: Sent::now() };
        let e = StageMsg::from_parts(head, vec![Array::U32(vec![1])]).expect_err("rejected");
        assert!(e.to_string().contains("Gradient"), "{e}");
    }
}
