//! What crosses a data link: the frame kinds, and the conversions between the
//! runtime's messages (`StageMsg`, `CoordinatorMsg`, `ReducerMsg`) and frames.
//!
//! Tensors leave as arrays of the frame's payload, bit for bit; everything
//! else rides in the header. A frame that does not fit the message it claims
//! to be (wrong array count or type) is a `WireError`, never a panic.

use super::frame::{Array, Frame};
use crate::actors::coordinator::{CoordinatorMsg, EvalKind, Failure, StageReport};
use crate::actors::reducer::ReducerMsg;
use crate::actors::stage::{Phase, StageMsg};
use crate::checkpoint::TensorState;
use crate::model::Param;
use crate::optim::grad_tree::Span;
use serde::{Deserialize, Serialize};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
#[error("malformed {what} frame: {why}")]
pub struct WireError {
    pub what: &'static str,
    pub why: String,
}

/// Link handshake and membership, then the run's messages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Kind {
    /// Connector → acceptor: who I am, and a nonce for the acceptor to prove
    /// it holds the cookie.
    Hello {
        rank: u32,
        world: u32,
        listen: String,
        nonce: [u8; 32],
    },
    /// Acceptor → connector: its proof over the connector's nonce, and a nonce of its own.
    Challenge {
        rank: u32,
        proof: [u8; 32],
        nonce: [u8; 32],
    },
    /// Connector → acceptor: proof over the acceptor's nonce.
    Proof {
        proof: [u8; 32],
    },
    Welcome,
    Refused {
        reason: String,
    },
    /// Rank 0 → workers: the run's resolved config and where everyone listens.
    Roster {
        config: String,
        config_hash: String,
        listen: Vec<String>,
        run_dir: String,
        resume: Option<String>,
        init: Option<String>,
        /// GPU runs: the NCCL ids of the communicators that cross processes.
        nccl: Vec<(crate::actors::compute::NcclKey, Vec<u8>)>,
    },
    /// A worker's stages are up and its links to every peer are open.
    Ready {
        rank: u32,
    },
    Stage {
        replica: u32,
        rank: u32,
        msg: StageKind,
    },
    Coordinator(CoordKind),
    /// A replica's tree nodes of one stage: (lo, hi) per node; the frame's
    /// arrays are the nodes' tensor sets one after the other.
    Reduce {
        step: u64,
        stage: u32,
        replica: u32,
        spans: Vec<(u32, u32)>,
    },
    /// The run failed elsewhere; stop with this reason.
    Abort {
        reason: String,
    },
    /// The run is over: stop cleanly.
    Shutdown,
    /// The transport bench's round trips.
    Ping {
        seq: u64,
    },
    /// Worker → rank 0: what does your trace clock read? (one of several probes)
    ClockProbe {
        seq: u64,
    },
    /// Rank 0 → worker: its trace clock, µs, when the probe arrived.
    ClockReply {
        seq: u64,
        t_us: f64,
    },
    /// Worker → rank 0: how its clock was aligned, for the trace's metadata.
    ClockReport {
        rank: u32,
        offset_us: f64,
        rtt_us: f64,
        probes: u32,
    },
}

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

fn bad(what: &'static str, why: impl Into<String>) -> WireError {
    WireError { what, why: why.into() }
}

fn phase(train: bool) -> Phase {
    if train {
        Phase::Train
    } else {
        Phase::Eval
    }
}

fn eval_kind(exact_match: bool) -> EvalKind {
    if exact_match {
        EvalKind::ExactMatch
    } else {
        EvalKind::Val
    }
}

/// The arrays of a frame, taken one at a time with their types checked.
struct Arrays {
    what: &'static str,
    it: std::vec::IntoIter<Array>,
}

impl Arrays {
    fn new(what: &'static str, arrays: Vec<Array>, expected: usize) -> Result<Arrays, WireError> {
        if arrays.len() != expected {
            return Err(bad(what, format!("{} arrays, expected {expected}", arrays.len())));
        }
        Ok(Arrays { what, it: arrays.into_iter() })
    }

    fn f32(&mut self) -> Result<Vec<f32>, WireError> {
        match self.it.next() {
            Some(Array::F32(v)) => Ok(v),
            _ => Err(bad(self.what, "expected an f32 array")),
        }
    }

    fn u32(&mut self) -> Result<Vec<u32>, WireError> {
        match self.it.next() {
            Some(Array::U32(v)) => Ok(v),
            _ => Err(bad(self.what, "expected a u32 array")),
        }
    }
}

/// A message for the stage at (replica, rank) as a frame. `None`: the message
/// has no meaning across processes.
pub fn stage_frame(replica: usize, rank: usize, msg: StageMsg) -> Option<Frame> {
    let (kind, arrays) = match msg {
        StageMsg::RunStep { step, loss_scale } => (StageKind::RunStep { step, loss_scale }, vec![]),
        StageMsg::Apply { step, lr, clip, skip } => (StageKind::Apply { step, lr, clip, skip }, vec![]),
        StageMsg::RunEval { step, kind, batches } => (
            StageKind::RunEval { step, exact_match: kind == EvalKind::ExactMatch, batches: batches as u64 },
            vec![],
        ),
        StageMsg::Tokens { phase, step, mb, tokens } => (
            StageKind::Tokens { train: phase == Phase::Train, step, mb: mb as u32 },
            vec![Array::U32(tokens)],
        ),
        StageMsg::Targets { phase, step, mb, targets } => (
            StageKind::Targets { train: phase == Phase::Train, step, mb: mb as u32 },
            vec![Array::U32(targets)],
        ),
        StageMsg::Activation { phase, step, stage, mb, data, .. } => (
            StageKind::Activation { train: phase == Phase::Train, step, stage: stage as u32, mb: mb as u32 },
            vec![Array::F32(data)],
        ),
        StageMsg::Gradient { step, stage, mb, data, .. } => {
            (StageKind::Gradient { step, stage: stage as u32, mb: mb as u32 }, vec![Array::F32(data)])
        }
        StageMsg::TiedShare { step, data } => (StageKind::TiedShare { step }, vec![Array::F32(data)]),
        StageMsg::Reduced { step, stage, grads } => {
            (StageKind::Reduced { step, stage: stage as u32 }, grads.into_iter().map(Array::F32).collect())
        }
        StageMsg::SendWeights => (StageKind::SendWeights, vec![]),
        StageMsg::Snapshot { step } => (StageKind::Snapshot { step }, vec![]),
        StageMsg::Restore(c) => (StageKind::Restore { dir: c.dir.display().to_string() }, vec![]),
        StageMsg::Stop => (StageKind::Stop, vec![]),
    };
    Some(Frame::with(Kind::Stage { replica: replica as u32, rank: rank as u32, msg: kind }, arrays))
}

/// The `StageMsg` a stage frame carries. `Restore` reads its checkpoint here.
pub fn stage_msg(kind: StageKind, arrays: Vec<Array>) -> Result<StageMsg, WireError> {
    let now = Instant::now();
    Ok(match kind {
        StageKind::RunStep { step, loss_scale } => StageMsg::RunStep { step, loss_scale },
        StageKind::Apply { step, lr, clip, skip } => StageMsg::Apply { step, lr, clip, skip },
        StageKind::RunEval { step, exact_match, batches } => {
            StageMsg::RunEval { step, kind: eval_kind(exact_match), batches: batches as usize }
        }
        StageKind::Tokens { train, step, mb } => {
            let tokens = Arrays::new("Tokens", arrays, 1)?.u32()?;
            StageMsg::Tokens { phase: phase(train), step, mb: mb as usize, tokens }
        }
        StageKind::Targets { train, step, mb } => {
            let targets = Arrays::new("Targets", arrays, 1)?.u32()?;
            StageMsg::Targets { phase: phase(train), step, mb: mb as usize, targets }
        }
        StageKind::Activation { train, step, stage, mb } => {
            let data = Arrays::new("Activation", arrays, 1)?.f32()?;
            StageMsg::Activation {
                phase: phase(train),
                step,
                stage: stage as usize,
                mb: mb as usize,
                data,
                sent: now,
            }
        }
        StageKind::Gradient { step, stage, mb } => {
            let data = Arrays::new("Gradient", arrays, 1)?.f32()?;
            StageMsg::Gradient { step, stage: stage as usize, mb: mb as usize, data, sent: now }
        }
        StageKind::TiedShare { step } => {
            StageMsg::TiedShare { step, data: Arrays::new("TiedShare", arrays, 1)?.f32()? }
        }
        StageKind::Reduced { step, stage } => {
            let n = arrays.len();
            let mut a = Arrays::new("Reduced", arrays, n)?;
            let grads = (0..n).map(|_| a.f32()).collect::<Result<_, _>>()?;
            StageMsg::Reduced { step, stage: stage as usize, grads }
        }
        StageKind::SendWeights => StageMsg::SendWeights,
        StageKind::Snapshot { step } => StageMsg::Snapshot { step },
        StageKind::Restore { dir } => {
            let loaded = crate::checkpoint::load(std::path::Path::new(&dir))
                .map_err(|e| bad("Restore", format!("{dir}: {e}")))?;
            StageMsg::Restore(std::sync::Arc::new(loaded))
        }
        StageKind::Stop => StageMsg::Stop,
    })
}

fn meta_of(name: &str, shape: &[usize], canonical: usize) -> TensorMeta {
    TensorMeta {
        name: name.to_string(),
        shape: shape.iter().map(|&d| d as u64).collect(),
        canonical: canonical as u64,
    }
}

/// A message for the coordinator as a frame. `None`: it only exists inside rank 0.
pub fn coordinator_frame(msg: CoordinatorMsg) -> Option<Frame> {
    let (kind, arrays) = match msg {
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
            (
                CoordKind::Weights {
                    rank: rank as u32,
                    replica: replica as u32,
                    params: meta,
                    latencies_us,
                    peak_live_bytes: peak_live_bytes as u64,
                    trace,
                },
                arrays,
            )
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
    };
    Some(Frame::with(Kind::Coordinator(kind), arrays))
}

fn shape(meta: &TensorMeta) -> Vec<usize> {
    meta.shape.iter().map(|&d| d as usize).collect()
}

pub fn coordinator_msg(kind: CoordKind, arrays: Vec<Array>) -> Result<CoordinatorMsg, WireError> {
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
            kind: eval_kind(exact_match),
            loss_sum,
            tokens: tokens as usize,
            predictions: Arrays::new("EvalDone", arrays, 1)?.u32()?,
        },
        CoordKind::Weights { rank, replica, params, latencies_us, peak_live_bytes, trace } => {
            let mut a = Arrays::new("Weights", arrays, 2 * params.len())?;
            let mut out = Vec::with_capacity(params.len());
            for m in &params {
                let (data, grad) = (a.f32()?, a.f32()?);
                out.push(Param {
                    name: m.name.clone(),
                    shape: shape(m),
                    data,
                    grad,
                    canonical: m.canonical as usize,
                });
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
                out.push(TensorState {
                    name: m.name.clone(),
                    shape: shape(m),
                    data: a.f32()?,
                    exp_avg: a.f32()?,
                    exp_avg_sq: a.f32()?,
                });
            }
            CoordinatorMsg::Snapshot { rank: rank as usize, step, tensors: out, adam_step }
        }
        CoordKind::Restored { rank, replica } => {
            CoordinatorMsg::Restored { rank: rank as usize, replica: replica as usize }
        }
    })
}

pub fn reducer_frame(msg: ReducerMsg) -> Frame {
    let ReducerMsg::Reduce { step, stage, replica, spans, grads } = msg;
    let spans = spans.iter().map(|s| (s.lo as u32, s.hi as u32)).collect();
    Frame::with(
        Kind::Reduce { step, stage: stage as u32, replica: replica as u32, spans },
        grads.into_iter().map(Array::F32).collect(),
    )
}

pub fn reducer_msg(
    step: u64,
    stage: u32,
    replica: u32,
    spans: Vec<(u32, u32)>,
    arrays: Vec<Array>,
) -> Result<ReducerMsg, WireError> {
    let n = arrays.len();
    let mut a = Arrays::new("Reduce", arrays, n)?;
    let grads = (0..n).map(|_| a.f32()).collect::<Result<_, _>>()?;
    let spans = spans.into_iter().map(|(lo, hi)| Span { lo: lo as usize, hi: hi as usize }).collect();
    Ok(ReducerMsg::Reduce { step, stage: stage as usize, replica: replica as usize, spans, grads })
}
