//! What crosses a data link: the frame kinds (link handshake, membership, and
//! the run's messages). The runtime's messages are split into header and
//! tensors by `actors::protocol`, which the replay log shares; here they only
//! get their frame kind. A frame that does not fit the message it claims to
//! be (wrong array count or type) is an error, never a panic.

use super::frame::{Array, Frame};
use crate::actors::protocol::{self, CoordinatorMsg, ReducerMsg, StageMsg};
use crate::optim::grad_tree::Span;
use serde::{Deserialize, Serialize};

pub use crate::actors::protocol::ProtocolError as WireError;

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
        nccl: Vec<(crate::actors::stage::nccl::NcclKey, Vec<u8>)>,
    },
    /// A worker's stages are up and its links to every peer are open.
    Ready {
        rank: u32,
    },
    /// `msg` is the header: the message with its tensors moved to the frame's arrays.
    Stage {
        replica: u32,
        rank: u32,
        msg: StageMsg,
    },
    /// The header of a coordinator message (its tensors in the frame's arrays).
    Coordinator(CoordinatorMsg),
    /// A replica's tree nodes of one stage: (lo, hi) per node; the frame's
    /// arrays are the nodes' tensor sets one after the other.
    Reduce {
        step: u64,
        stage: u32,
        replica: u32,
        spans: Vec<(u32, u32)>,
    },
    /// ZeRO-1: a replica's shard of each of a stage's tensors (the arrays).
    Gather {
        step: u64,
        stage: u32,
        replica: u32,
    },
    /// ZeRO-2 and 3: a replica's gradient of its microbatch `mb` of a stage
    /// (the head's tensors or the body's; the arrays).
    Scatter {
        step: u64,
        stage: u32,
        replica: u32,
        mb: u32,
        head: bool,
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
    /// Tensor-parallel ranks of chunk `chunk` of the stage at (replica,
    /// rank) in several processes: commands, answers and all-reduce nodes
    /// (the tensors in the frame's arrays).
    Tp {
        replica: u32,
        rank: u32,
        chunk: u32,
        msg: super::tp::TpFrame,
    },
    /// Worker → rank 0: how its clock was aligned, for the trace's metadata.
    ClockReport {
        rank: u32,
        offset_us: f64,
        rtt_us: f64,
        probes: u32,
    },
}

/// A message for the stage at (replica, rank) as a frame. `None`: the message
/// has no meaning across processes.
pub fn stage_frame(replica: usize, rank: usize, msg: StageMsg) -> Option<Frame> {
    let (kind, arrays) = msg.into_parts();
    Some(Frame::with(Kind::Stage { replica: replica as u32, rank: rank as u32, msg: kind }, arrays))
}

/// The `StageMsg` a stage frame carries. `Restore` reads its checkpoint here.
pub fn stage_msg(kind: StageMsg, arrays: Vec<Array>) -> Result<StageMsg, WireError> {
    StageMsg::from_parts(kind, arrays)
}

/// A message for the coordinator as a frame. `None`: it only exists inside rank 0.
pub fn coordinator_frame(msg: CoordinatorMsg) -> Option<Frame> {
    let (kind, arrays) = msg.into_parts()?;
    Some(Frame::with(Kind::Coordinator(kind), arrays))
}

pub fn coordinator_msg(kind: CoordinatorMsg, arrays: Vec<Array>) -> Result<CoordinatorMsg, WireError> {
    CoordinatorMsg::from_parts(kind, arrays)
}

pub fn reducer_frame(msg: ReducerMsg) -> Frame {
    let (stage, replica) = match &msg {
        ReducerMsg::Reduce { stage, replica, .. }
        | ReducerMsg::Gather { stage, replica, .. }
        | ReducerMsg::Scatter { stage, replica, .. } => (*stage as u32, *replica as u32),
    };
    match msg {
        ReducerMsg::Reduce { step, spans, grads, .. } => {
            let spans = spans.iter().map(|s| (s.lo as u32, s.hi as u32)).collect();
            Frame::with(
                Kind::Reduce { step, stage, replica, spans },
                grads.into_iter().map(Array::F32).collect(),
            )
        }
        ReducerMsg::Gather { step, shards, .. } => {
            Frame::with(Kind::Gather { step, stage, replica }, shards.into_iter().map(Array::F32).collect())
        }
        ReducerMsg::Scatter { step, mb, head, grads, .. } => Frame::with(
            Kind::Scatter { step, stage, replica, mb: mb as u32, head },
            grads.into_iter().map(Array::F32).collect(),
        ),
    }
}

pub fn scatter_msg(
    (step, stage, replica): (u64, u32, u32),
    mb: u32,
    head: bool,
    arrays: Vec<Array>,
) -> Result<ReducerMsg, WireError> {
    let grads = protocol::f32_arrays("Scatter", arrays)?;
    let (stage, replica, mb) = (stage as usize, replica as usize, mb as usize);
    Ok(ReducerMsg::Scatter { step, stage, replica, mb, head, grads })
}

pub fn gather_msg(step: u64, stage: u32, replica: u32, arrays: Vec<Array>) -> Result<ReducerMsg, WireError> {
    let shards = protocol::f32_arrays("Gather", arrays)?;
    Ok(ReducerMsg::Gather { step, stage: stage as usize, replica: replica as usize, shards })
}

pub fn reducer_msg(
    step: u64,
    stage: u32,
    replica: u32,
    spans: Vec<(u32, u32)>,
    arrays: Vec<Array>,
) -> Result<ReducerMsg, WireError> {
    let grads = protocol::f32_arrays("Reduce", arrays)?;
    let spans = spans.into_iter().map(|(lo, hi)| Span { lo: lo as usize, hi: hi as usize }).collect();
    Ok(ReducerMsg::Reduce { step, stage: stage as usize, replica: replica as usize, spans, grads })
}
