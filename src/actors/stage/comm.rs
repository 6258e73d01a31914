//! How a stage's executor talks to the rest of the run: the `Comm` trait, and
//! its in-process implementation over actors (`ActorComm`).
//!
//! Point-to-point messages are keyed by (phase, kind, stage, microbatch): a
//! message that arrives before it is needed waits in an inbox under its key,
//! so the work done — and every bit of its result — never depends on arrival
//! order. Collectives run over named groups of ranks in a fixed order; their
//! default bodies are built from the point-to-point calls and today's reducer
//! actor, so a wrapper such as `Recorded` sees every message, and a transport
//! with collectives of its own (NCCL) overrides them.
//!
//! `ActorComm` never computes and never decides an order of work: it files,
//! waits, sends, and records the trace's send, receive and wait marks.

use super::super::layout::Layout;
use super::super::protocol::{CoordinatorMsg, Failure, Phase, ReducerMsg, StageMsg};
use super::Links;
use crate::optim::grad_tree::Span;
use crate::replay::ActorLog;
use crate::trace::Recorder;
use crossbeam_channel::Receiver;
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;

/// Raised inside the compute thread to unwind out of a step on `Stop`.
pub struct Stopped;

/// What a waiting action needs: a point-to-point message's (phase, kind, stage, mb).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key {
    Tokens(Phase, usize),
    Targets(Phase, usize),
    Act(Phase, usize, usize),
    Grad(usize, usize),
    Tied,
    Reduced(usize),
    Scattered(usize),
    Gathered(usize),
}

impl Key {
    /// The key a data message is filed under; `None` for a control message.
    pub fn of(msg: &StageMsg) -> Option<Key> {
        Some(match *msg {
            StageMsg::Tokens { phase, mb, .. } => Key::Tokens(phase, mb),
            StageMsg::Targets { phase, mb, .. } => Key::Targets(phase, mb),
            StageMsg::Activation { phase, stage, mb, .. } => Key::Act(phase, stage, mb),
            StageMsg::Gradient { stage, mb, .. } => Key::Grad(stage, mb),
            StageMsg::TiedShare { .. } => Key::Tied,
            StageMsg::Reduced { stage, .. } => Key::Reduced(stage),
            StageMsg::Scattered { stage, .. } => Key::Scattered(stage),
            StageMsg::Gathered { stage, .. } => Key::Gathered(stage),
            _ => return None,
        })
    }

    /// What a key stands for, in a trace's words.
    pub fn describe(self) -> String {
        match self {
            Key::Tokens(..) => "tokens from the data loader".into(),
            Key::Targets(..) => "targets from the data loader".into(),
            Key::Act(_, s, _) => format!("activation from stage {}", s - 1),
            Key::Grad(s, _) => format!("gradient from stage {}", s + 1),
            Key::Tied => "the other share of the tied embedding gradient".into(),
            Key::Reduced(_) => "gradients reduced over replicas".into(),
            Key::Scattered(_) => "this replica's shards of every replica's microbatch gradient".into(),
            Key::Gathered(_) => "shards gathered from every replica".into(),
        }
    }
}

/// The groups of ranks a collective runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// The same pipeline rank in every data-parallel replica, in replica order.
    Replicas,
    /// The ranks holding a copy of the tied embedding (the first and last
    /// stage), in stage order.
    Tied,
}

/// Where a wait happens, for the trace: the step, and the stage and
/// microbatch of the action waiting (the rank's first stage and none between actions).
#[derive(Clone, Copy, Debug)]
pub struct At {
    pub step: u64,
    pub stage: usize,
    pub mb: Option<usize>,
}

pub trait Comm {
    /// The next control message from the coordinator; data messages that
    /// arrive meanwhile are filed.
    fn next_control(&mut self) -> Result<StageMsg, Stopped>;
    /// The point-to-point message under `key`, waiting for it if need be.
    fn recv(&mut self, key: Key, at: At) -> Result<StageMsg, Stopped>;
    /// Sends a point-to-point message to pipeline rank `rank` of this replica
    /// (this rank included: it skips the mailbox).
    fn send(&mut self, rank: usize, msg: StageMsg) -> Result<(), Stopped>;
    /// Hands gradients to the reducer actor (the in-process replica group).
    fn to_reducer(&mut self, msg: ReducerMsg) -> Result<(), Stopped>;
    /// A report for the coordinator.
    fn report(&mut self, msg: CoordinatorMsg);
    /// This stage failed: tell whoever supervises it.
    fn fail(&mut self, f: Failure);
    /// The replay log, when this stage keeps one.
    fn log(&mut self) -> Option<&mut ActorLog> {
        None
    }
    /// The replay log, closed or not, handed back at the end of a replay.
    fn take_log(&mut self) -> Option<ActorLog> {
        None
    }

    /// Each (stage, tree spans, gradients) of `parts` summed over `group`, in group order
    /// on every member; the sums come back in the order of `parts`.
    fn reduce_ordered(
        &mut self,
        group: Group,
        step: u64,
        replica: usize,
        parts: Vec<(usize, Vec<Span>, Vec<Vec<f32>>)>,
        at: At,
    ) -> Result<Vec<Vec<Vec<f32>>>, Stopped> {
        assert_eq!(group, Group::Replicas, "only replica gradients go through the reducer");
        let stages: Vec<usize> = parts.iter().map(|p| p.0).collect();
        for (stage, spans, grads) in parts {
            self.to_reducer(ReducerMsg::Reduce { step, stage, replica, spans, grads })?;
        }
        let mut sums = Vec::with_capacity(stages.len());
        for stage in stages {
            match self.recv(Key::Reduced(stage), at)? {
                StageMsg::Reduced { grads, .. } => sums.push(grads),
                _ => unreachable!("Key::Reduced holds Reduced"),
            }
        }
        Ok(sums)
    }

    /// As `reduce_ordered`, but each member gets back only its shard of each
    /// sum (ZeRO-1, see `optim::zero`): the reducer knows the run's setting.
    fn reduce_scatter(
        &mut self,
        group: Group,
        step: u64,
        replica: usize,
        parts: Vec<(usize, Vec<Span>, Vec<Vec<f32>>)>,
        at: At,
    ) -> Result<Vec<Vec<Vec<f32>>>, Stopped> {
        self.reduce_ordered(group, step, replica, parts, at)
    }

    /// ZeRO-1: this member's shard of each of `stage`'s tensors, gathered with
    /// every other member's in group order; every member gets the whole tensors.
    fn all_gather_shards(
        &mut self,
        group: Group,
        step: u64,
        (stage, replica): (usize, usize),
        shards: Vec<Vec<f32>>,
        at: At,
    ) -> Result<std::sync::Arc<Vec<Vec<f32>>>, Stopped> {
        assert_eq!(group, Group::Replicas, "shards are gathered over replicas");
        self.to_reducer(ReducerMsg::Gather { step, stage, replica, shards })?;
        match self.recv(Key::Gathered(stage), at)? {
            StageMsg::Gathered { tensors, .. } => Ok(tensors),
            _ => unreachable!("Key::Gathered holds Gathered"),
        }
    }

    /// Sends `mine` to the other members of `group` (pipeline ranks `peers`)
    /// and returns their contributions, in group order. `mine` is moved, not
    /// copied: the tied embedding's share is the largest gradient there is.
    fn all_gather(
        &mut self,
        group: Group,
        step: u64,
        peers: &[usize],
        mine: Vec<f32>,
        at: At,
    ) -> Result<Vec<Vec<f32>>, Stopped> {
        assert!(group == Group::Tied && peers.len() == 1, "the tied group has two members");
        self.send(peers[0], StageMsg::TiedShare { step, data: mine })?;
        match self.recv(Key::Tied, at)? {
            StageMsg::TiedShare { data, .. } => Ok(vec![data]),
            _ => unreachable!("Key::Tied holds TiedShare"),
        }
    }
}

/// The in-process `Comm`: a crossbeam channel from the stage's actor in, actor
/// references out.
pub struct ActorComm {
    rank: usize,
    /// The rank's first stage: where sends that name no stage are traced.
    first_stage: usize,
    rx: Receiver<StageMsg>,
    inbox: BTreeMap<Key, StageMsg>,
    control: VecDeque<StageMsg>,
    links: Links,
    rec: Rc<Recorder>,
}

impl ActorComm {
    pub fn new(
        layout: &Layout,
        rank: usize,
        rx: Receiver<StageMsg>,
        links: Links,
        rec: Rc<Recorder>,
    ) -> ActorComm {
        let first_stage = layout.stages_of(rank)[0];
        ActorComm { rank, first_stage, rx, inbox: BTreeMap::new(), control: VecDeque::new(), links, rec }
    }

    /// Files a data message in the inbox, or a control message in the queue.
    fn file(&mut self, msg: StageMsg) -> Result<(), Stopped> {
        let Some(key) = Key::of(&msg) else {
            if let StageMsg::Stop = msg {
                return Err(Stopped);
            }
            self.control.push_back(msg);
            return Ok(());
        };
        match msg {
            StageMsg::Activation { phase: Phase::Train, step, stage, mb, sent, .. } => {
                self.rec.recv(step, stage, stage - 1, mb, sent.0, "activation")
            }
            StageMsg::Gradient { step, stage, mb, sent, .. } => {
                self.rec.recv(step, stage, stage + 1, mb, sent.0, "gradient")
            }
            _ => {}
        }
        let prev = self.inbox.insert(key, msg);
        assert!(prev.is_none(), "rank {} received {key:?} twice", self.rank);
        Ok(())
    }

    fn take_next(&mut self) -> Result<(), Stopped> {
        match self.rx.recv() {
            Ok(m) => self.file(m),
            Err(_) => Err(Stopped),
        }
    }

    /// A send span on the sending stage, open until dropped.
    fn send_span(&self, step: u64, rank: usize, msg: SendOf) -> tracing::Span {
        let (from, to, mb, what) = msg;
        let detail = match to {
            Some(t) => format!("{what} to stage {t}"),
            None => format!("{what} to rank {rank}"),
        };
        self.rec.span(from.unwrap_or(self.first_stage), "send", step, mb, Some(&detail), to)
    }
}

/// (sending stage, receiving stage, microbatch, what) of a message between stages.
type SendOf = (Option<usize>, Option<usize>, Option<usize>, &'static str);

fn send_of(msg: &StageMsg) -> SendOf {
    match msg {
        StageMsg::Activation { stage, mb, .. } => (Some(stage - 1), Some(*stage), Some(*mb), "activation"),
        StageMsg::Gradient { stage, mb, .. } => (Some(stage + 1), Some(*stage), Some(*mb), "gradient"),
        _ => (None, None, None, "tied embedding gradient share"),
    }
}

impl Comm for ActorComm {
    fn next_control(&mut self) -> Result<StageMsg, Stopped> {
        loop {
            if let Some(m) = self.control.pop_front() {
                return Ok(m);
            }
            self.take_next()?;
        }
    }

    fn recv(&mut self, key: Key, at: At) -> Result<StageMsg, Stopped> {
        if let Some(m) = self.inbox.remove(&key) {
            return Ok(m);
        }
        let detail = self.rec.enabled().then(|| key.describe());
        let wait = self.rec.span(at.stage, "wait", at.step, at.mb, detail.as_deref(), None);
        loop {
            self.take_next()?;
            if let Some(m) = self.inbox.remove(&key) {
                drop(wait);
                return Ok(m);
            }
        }
    }

    fn send(&mut self, rank: usize, msg: StageMsg) -> Result<(), Stopped> {
        // Evaluation traffic has its "eval" spans; sends and receives are the step's.
        let eval = matches!(msg, StageMsg::Activation { phase: Phase::Eval, .. });
        let span = match self.rec.enabled() && !eval {
            true => self.send_span(msg.step().unwrap_or(0), rank, send_of(&msg)),
            false => tracing::Span::none(),
        };
        let sent = if rank == self.rank {
            self.file(msg)
        } else {
            match &self.links {
                Links::Actors { peers, .. } => {
                    let peers = peers.get().expect("peers are set before the first step");
                    peers[rank].send_message(msg).map_err(|_| Stopped)
                }
                Links::Detached { .. } => Ok(()),
            }
        };
        drop(span);
        sent
    }

    fn to_reducer(&mut self, msg: ReducerMsg) -> Result<(), Stopped> {
        match &self.links {
            Links::Actors { reducer, .. } => {
                reducer.as_ref().expect("dp > 1 has a reducer").send_message(msg).map_err(|_| Stopped)
            }
            Links::Detached { .. } => Ok(()),
        }
    }

    fn report(&mut self, msg: CoordinatorMsg) {
        if let Links::Actors { coordinator, .. } = &self.links {
            let _ = coordinator.send_message(msg);
        }
    }

    fn fail(&mut self, f: Failure) {
        self.links.fail(f);
    }
}
