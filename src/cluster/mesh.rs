//! The links of one process to every other process of a run, where each
//! (replica, pipeline rank) lives, and the stand-in actors that make a remote
//! actor look local.
//!
//! The runtime's `RemoteStage` (`actors::processes`) is an `ActorRef<StageMsg>`
//! like any stage: the coordinator, loaders, reducer and neighbouring stages
//! send to it unchanged, and [`Fabric`], as the run's `Processes`, turns each
//! message into a frame for the process that owns the stage. There, the
//! link's reader turns the frame back into the same `StageMsg` for the real
//! stage actor, so stage compute — and every bit of its result — is the same
//! as in one process. `RemoteCoordinator` and `RemoteReducer` do the same for
//! what workers send to rank 0.

use super::frame::Frame;
use super::link::{Link, Sink};
use super::wire::{self, Kind};
use crate::actors::coordinator::{CoordinatorMsg, Failure};
use crate::actors::processes::{Processes, Routes};
use crate::actors::protocol::ReducerMsg;
use crate::actors::stage::StageMsg;
use crossbeam_channel::{Receiver, Sender};
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("--nodes / WORLD_SIZE: {0}: a run needs at least one process")]
    Empty(usize),
    #[error(
        "--nodes / WORLD_SIZE: {world}: parallel.pp × parallel.dp × parallel.tp = {pp} × {dp} × {tp} = {slots} ranks cannot be split evenly over {world} processes"
    )]
    Uneven { world: usize, pp: usize, dp: usize, tp: usize, slots: usize },
    #[error(
        "--nodes / WORLD_SIZE: {world}: {per} ranks per process would cut a stage's parallel.tp = {tp} ranks unevenly: each process must hold whole stages (tp divides {per}) or an equal share of one stage's ranks ({per} divides tp)"
    )]
    TpCut { world: usize, per: usize, tp: usize },
}

/// Which process runs each (replica, pipeline rank, tensor-parallel rank):
/// ranks in replica-major order with tp fastest (replica 0's stage 0's tp
/// ranks, then its stage 1's, …), cut into `world` contiguous equal shares.
/// So pp = 4 over 2 processes puts stages 0–1 on process 0 and 2–3 on
/// process 1; pp = 2 × dp = 2 over 2 processes gives each replica a process
/// of its own; and tp = 4 over 2 processes gives each process two of one
/// stage's ranks. A stage's actor lives with its tp rank 0 (its owner); the
/// processes holding its other ranks follow it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub world: usize,
    pub pp: usize,
    pub dp: usize,
    pub tp: usize,
}

impl Placement {
    pub fn new(pp: usize, dp: usize, tp: usize, world: usize) -> Result<Placement, PlacementError> {
        if world == 0 {
            return Err(PlacementError::Empty(world));
        }
        let slots = pp * dp * tp;
        if !slots.is_multiple_of(world) {
            return Err(PlacementError::Uneven { world, pp, dp, tp, slots });
        }
        let per = slots / world;
        if !per.is_multiple_of(tp) && !tp.is_multiple_of(per) {
            return Err(PlacementError::TpCut { world, per, tp });
        }
        Ok(Placement { world, pp, dp, tp })
    }

    /// Ranks per process.
    fn per(&self) -> usize {
        self.pp * self.dp * self.tp / self.world
    }

    /// The process holding (replica, rank)'s tp rank 0, which runs its actor.
    pub fn owner(&self, replica: usize, rank: usize) -> usize {
        (replica * self.pp + rank) * self.tp / self.per()
    }

    /// The processes holding (replica, rank)'s tp ranks, its owner first.
    pub fn tp_group(&self, replica: usize, rank: usize) -> std::ops::Range<usize> {
        let first = self.owner(replica, rank);
        first..first + (self.tp / self.per()).max(1)
    }

    /// A stage's tp ranks each process of its group holds.
    pub fn tp_held(&self) -> usize {
        self.tp.min(self.per())
    }

    /// (replica, rank) slots whose actor process `p` runs, in replica-major order.
    pub fn slots(&self, p: usize) -> Vec<(usize, usize)> {
        let per = self.per();
        (p * per..(p + 1) * per)
            .filter(|k| k.is_multiple_of(self.tp))
            .map(|k| (k / self.tp / self.pp, k / self.tp % self.pp))
            .collect()
    }

    /// The stage (replica, rank) process `p` holds tp ranks of without
    /// running its actor, and which ranks.
    pub fn follows(&self, p: usize) -> Option<(usize, usize, std::ops::Range<usize>)> {
        let (per, first) = (self.per(), p * self.per());
        if per >= self.tp || first.is_multiple_of(self.tp) {
            return None;
        }
        let k = first / self.tp;
        Some((k / self.pp, k % self.pp, first % self.tp..first % self.tp + per))
    }
}

/// What a process's main loop hears from its links.
#[derive(Debug)]
pub enum Event {
    Roster {
        config: String,
        config_hash: String,
        listen: Vec<String>,
        run_dir: String,
        resume: Option<String>,
        init: Option<String>,
        nccl: Vec<(crate::actors::stage::nccl::NcclKey, Vec<u8>)>,
    },
    Ready(usize),
    Abort(String),
    Shutdown,
    /// A link ended while the run was live.
    Lost {
        peer: usize,
        why: String,
    },
    /// Rank 0's answer to a clock probe, and when it arrived here.
    ClockReply {
        seq: u64,
        remote_us: f64,
        at: Instant,
    },
}

/// How a worker's trace clock was put onto rank 0's: the offset added to its
/// readings, and the round trip of the probe it came from (the offset is right
/// to within half of that).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct ClockEstimate {
    pub rank: usize,
    pub offset_us: f64,
    pub rtt_us: f64,
    pub probes: u32,
}

pub struct Fabric {
    pub me: usize,
    pub world: usize,
    links: Mutex<Vec<Option<Arc<Link>>>>,
    listen: Mutex<Vec<String>>,
    routes: OnceLock<Routes>,
    events: Sender<Event>,
    /// The run is over (or failing on purpose): links closing are expected.
    done: AtomicBool,
    /// The roster is out: from here on every link is part of the run.
    started: AtomicBool,
    /// The latest step seen in a frame, for failure reports.
    step: AtomicU64,
    /// The run's trace clock; workers offset theirs to rank 0's at the roster.
    pub epoch: Mutex<Instant>,
    pub placement: OnceLock<Placement>,
    /// GPU runs: which ranks share this process, and the NCCL ids of the links
    /// and all-reduces that cross processes (made on rank 0, sent in the roster).
    pub gpu_plan: OnceLock<Arc<crate::actors::stage::nccl::GpuPlan>>,
    /// On rank 0: each worker's clock alignment, as it reported it.
    clocks: Mutex<Vec<ClockEstimate>>,
    /// Frames for stages' tensor-parallel groups that span processes.
    pub tp_inboxes: super::tp::Inboxes,
}

impl Fabric {
    pub fn new(me: usize, world: usize) -> (Arc<Fabric>, Receiver<Event>) {
        let (events, rx) = crossbeam_channel::unbounded();
        let f = Fabric {
            me,
            world,
            links: Mutex::new(vec![None; world]),
            listen: Mutex::new(vec![String::new(); world]),
            routes: OnceLock::new(),
            events,
            done: AtomicBool::new(false),
            started: AtomicBool::new(false),
            step: AtomicU64::new(0),
            epoch: Mutex::new(Instant::now()),
            placement: OnceLock::new(),
            gpu_plan: OnceLock::new(),
            clocks: Mutex::new(Vec::new()),
            tp_inboxes: Default::default(),
        };
        (Arc::new(f), rx)
    }

    pub fn add_link(
        self: &Arc<Self>,
        peer: usize,
        stream: super::link::LinkStream,
        listen: String,
    ) -> std::io::Result<()> {
        // Held across the start so a link that dies at once (its reader
        // removing it) cannot be put back after its removal.
        let mut links = self.links.lock().expect("links");
        links[peer] = Some(Link::start(peer, stream, self.clone())?);
        drop(links);
        self.listen.lock().expect("listen")[peer] = listen;
        Ok(())
    }

    /// The process that runs (replica, rank); this one before a placement is set.
    pub fn owner(&self, replica: usize, rank: usize) -> usize {
        self.placement.get().map_or(self.me, |p| p.owner(replica, rank))
    }

    pub fn has_link(&self, peer: usize) -> bool {
        self.links.lock().expect("links")[peer].is_some()
    }

    /// Ranks (other than this one) with no link yet.
    pub fn missing(&self) -> Vec<usize> {
        let links = self.links.lock().expect("links");
        (0..self.world).filter(|&p| p != self.me && links[p].is_none()).collect()
    }

    pub fn listen_addrs(&self) -> Vec<String> {
        self.listen.lock().expect("listen").clone()
    }

    pub fn describe(&self, peer: usize) -> String {
        match self.links.lock().expect("links").get(peer).and_then(|l| l.clone()) {
            Some(l) => format!("process rank {peer} ({})", l.addr),
            None => format!("process rank {peer}"),
        }
    }

    pub fn set_routes(&self, routes: Routes) {
        let _ = self.routes.set(routes);
    }

    pub fn send(&self, peer: usize, f: Frame) -> bool {
        let link = self.links.lock().expect("links").get(peer).and_then(|l| l.clone());
        link.is_some_and(|l| l.send(f))
    }

    pub fn broadcast(&self, kind: Kind) {
        for p in 0..self.world {
            if p != self.me {
                self.send(p, Frame::new(kind.clone()));
            }
        }
    }

    /// The workers' clock alignments (rank 0), by rank.
    pub fn clock_estimates(&self) -> Vec<ClockEstimate> {
        let mut v = self.clocks.lock().expect("clocks").clone();
        v.sort_by_key(|c| c.rank);
        v
    }

    /// The latest step seen in a frame.
    pub fn step(&self) -> u64 {
        self.step.load(Ordering::Relaxed)
    }

    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }

    /// The run has begun: a link closing from now on is a lost process.
    pub fn set_started(&self) {
        self.started.store(true, Ordering::SeqCst);
    }

    /// From now on links closing are expected, not failures.
    pub fn set_done(&self) {
        self.done.store(true, Ordering::SeqCst);
    }

    /// Flushes and closes every link.
    pub fn close_all(&self) {
        self.set_done();
        let links: Vec<_> = self.links.lock().expect("links").iter().flatten().cloned().collect();
        for l in links {
            l.close();
        }
    }

    /// A peer is gone: the coordinator (on rank 0) fails the run naming it, and
    /// the main loop hears of it.
    pub fn lost(&self, peer: usize, why: &str) {
        if self.is_done() {
            return;
        }
        let who = self.describe(peer);
        if let Some(c) = self.routes.get().and_then(|r| r.coordinator.clone()) {
            let f = Failure {
                actor: who,
                step: self.step.load(Ordering::Relaxed),
                action: None,
                error: why.to_string(),
            };
            let _ = c.send_message(CoordinatorMsg::Failed(f));
        }
        let _ = self.events.send(Event::Lost { peer, why: why.to_string() });
    }

    // A well-formed message for an actor that has already stopped is dropped,
    // not held against the link: actors stop when a run ends or fails, and the
    // link must stay up to carry rank 0's Abort (closing it here made a failing
    // run's workers report rank 0 lost instead of the real cause).
    fn deliver(&self, peer: usize, f: Frame) -> Result<(), String> {
        let who = || self.describe(peer);
        match f.kind {
            Kind::Stage { replica, rank, msg } => {
                let dest = self
                    .routes
                    .get()
                    .and_then(|r| r.stages.get(replica as usize)?.get(rank as usize)?.clone())
                    .ok_or_else(|| {
                        format!(
                            "{} sent a message for stage {rank}.{replica}, which does not live here",
                            who()
                        )
                    })?;
                if let Some(step) = msg.step() {
                    self.step.fetch_max(step, Ordering::Relaxed);
                }
                let msg = wire::stage_msg(msg, f.arrays).map_err(|e| format!("{}: {e}", who()))?;
                let _ = dest.send_message(msg);
                Ok(())
            }
            Kind::Coordinator(c) => {
                let dest = self.routes.get().and_then(|r| r.coordinator.clone()).ok_or_else(|| {
                    format!("{} sent a coordinator message to a process without one", who())
                })?;
                let msg = wire::coordinator_msg(c, f.arrays).map_err(|e| format!("{}: {e}", who()))?;
                let _ = dest.send_message(msg);
                Ok(())
            }
            Kind::Reduce { step, stage, replica, spans } => {
                let dest = self
                    .routes
                    .get()
                    .and_then(|r| r.reducer.clone())
                    .ok_or_else(|| format!("{} sent gradients to a process without a reducer", who()))?;
                let msg = wire::reducer_msg(step, stage, replica, spans, f.arrays)
                    .map_err(|e| format!("{}: {e}", who()))?;
                let _ = dest.send_message(msg);
                Ok(())
            }
            Kind::Gather { step, stage, replica } => {
                let dest = self
                    .routes
                    .get()
                    .and_then(|r| r.reducer.clone())
                    .ok_or_else(|| format!("{} sent shards to a process without a reducer", who()))?;
                let msg = wire::gather_msg(step, stage, replica, f.arrays)
                    .map_err(|e| format!("{}: {e}", who()))?;
                let _ = dest.send_message(msg);
                Ok(())
            }
            Kind::Scatter { step, stage, replica, mb, head } => {
                let dest = self
                    .routes
                    .get()
                    .and_then(|r| r.reducer.clone())
                    .ok_or_else(|| format!("{} sent gradients to a process without a reducer", who()))?;
                let msg = wire::scatter_msg((step, stage, replica), mb, head, f.arrays)
                    .map_err(|e| format!("{}: {e}", who()))?;
                let _ = dest.send_message(msg);
                Ok(())
            }
            Kind::Roster { config, config_hash, listen, run_dir, resume, init, nccl } => {
                let _ = self.events.send(Event::Roster {
                    config,
                    config_hash,
                    listen,
                    run_dir,
                    resume,
                    init,
                    nccl,
                });
                Ok(())
            }
            Kind::Ready { rank } => {
                let _ = self.events.send(Event::Ready(rank as usize));
                Ok(())
            }
            Kind::Abort { reason } => {
                // The sender is stopping: its link closing next is part of the abort.
                self.set_done();
                let _ = self.events.send(Event::Abort(reason));
                Ok(())
            }
            Kind::Shutdown => {
                self.set_done();
                let _ = self.events.send(Event::Shutdown);
                Ok(())
            }
            Kind::Tp { replica, rank, chunk, msg } => {
                if !self.tp_frame_fits(peer, replica as usize, rank as usize, &msg) {
                    return Err(format!(
                        "{} sent a tensor-parallel frame for stage {rank}.{replica} that is not between \
                         its group's owner and followers",
                        who()
                    ));
                }
                self.tp_inboxes
                    .deliver(peer, (replica, rank, chunk), msg, f.arrays)
                    .map_err(|e| format!("{}: {e}", who()))
            }
            Kind::ClockProbe { seq } => {
                // Answered here on the link's reader, not queued behind the main loop:
                // the round trip is the alignment's error bound.
                let t_us = self.epoch.lock().expect("epoch").elapsed().as_secs_f64() * 1e6;
                self.send(peer, Frame::new(Kind::ClockReply { seq, t_us }));
                Ok(())
            }
            Kind::ClockReply { seq, t_us } => {
                let _ = self.events.send(Event::ClockReply { seq, remote_us: t_us, at: Instant::now() });
                Ok(())
            }
            Kind::ClockReport { rank, offset_us, rtt_us, probes } => {
                let c = ClockEstimate { rank: rank as usize, offset_us, rtt_us, probes };
                self.clocks.lock().expect("clocks").push(c);
                Ok(())
            }
            other => Err(format!("{} sent an unexpected {} frame", who(), kind_name(&other))),
        }
    }
}

impl Fabric {
    /// Only a stage's own tp group speaks about it: commands come from its
    /// owner, answers go to it, nodes pass between its processes.
    fn tp_frame_fits(&self, peer: usize, replica: usize, rank: usize, msg: &super::tp::TpFrame) -> bool {
        let Some(p) = self.placement.get() else { return false };
        if replica >= p.dp || rank >= p.pp {
            return false;
        }
        let g = p.tp_group(replica, rank);
        g.len() > 1
            && g.contains(&self.me)
            && g.contains(&peer)
            && match msg {
                super::tp::TpFrame::Cmd(_) => peer == g.start,
                super::tp::TpFrame::Answer => self.me == g.start,
                super::tp::TpFrame::Nodes { .. } => true,
            }
    }
}

fn kind_name(k: &Kind) -> &'static str {
    match k {
        Kind::Hello { .. } => "Hello",
        Kind::Challenge { .. } => "Challenge",
        Kind::Proof { .. } => "Proof",
        Kind::Welcome => "Welcome",
        Kind::Refused { .. } => "Refused",
        Kind::Ping { .. } => "Ping",
        _ => "run",
    }
}

impl Sink for Fabric {
    fn frame(&self, peer: usize, frame: Frame) -> Result<(), String> {
        self.deliver(peer, frame)
    }

    fn closed(&self, peer: usize, why: Option<String>) {
        let why = why.unwrap_or_else(|| "the connection closed".into());
        if self.me == 0 && !self.started.load(Ordering::SeqCst) && !self.is_done() {
            // Before the roster nothing depends on the link: drop it, and the
            // rank may join again (a bad peer cannot block the real one).
            tracing::warn!("dropped the data link from {}: {why}", self.describe(peer));
            self.links.lock().expect("links")[peer] = None;
            return;
        }
        if self.me != 0 && peer != 0 && !self.is_done() {
            // A worker that read rank 0's Shutdown first closes its links to the
            // others; rank 0's frame to this one may still be on its way.
            wait_until(Duration::from_millis(500), || self.is_done());
        }
        if !self.is_done() {
            tracing::error!("error: data link to {} ended: {why}", self.describe(peer));
        }
        self.lost(peer, &why);
    }
}

/// Polls `cond` until it holds or `deadline` has passed.
pub fn wait_until(deadline: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + deadline;
    while Instant::now() < until {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    cond()
}

/// How the actor runtime reaches the run's other processes: through these links.
impl Processes for Fabric {
    fn me(&self) -> usize {
        self.me
    }

    fn owner(&self, replica: usize, rank: usize) -> usize {
        Fabric::owner(self, replica, rank)
    }

    fn epoch(&self) -> Instant {
        *self.epoch.lock().expect("epoch")
    }

    fn gpu_plan(&self) -> Option<Arc<crate::actors::stage::nccl::GpuPlan>> {
        self.gpu_plan.get().cloned()
    }

    fn set_routes(&self, routes: Routes) {
        Fabric::set_routes(self, routes)
    }

    fn send_stage(&self, owner: usize, replica: usize, rank: usize, msg: StageMsg) {
        if let Some(f) = wire::stage_frame(replica, rank, msg) {
            // A closed link has already been reported as the failure.
            self.send(owner, f);
        }
    }

    fn tp_remote(
        self: Arc<Self>,
        replica: usize,
        rank: usize,
        chunk: usize,
        timeout: Duration,
    ) -> Result<Option<crate::model::tp::Remote>, String> {
        super::tp::owner_remote(&self, replica, rank, chunk, timeout)
    }
}

/// Stands in, on a worker, for rank 0's coordinator; also supervises the
/// worker's stage actors and reports their failures to rank 0.
pub struct RemoteCoordinator;

impl Actor for RemoteCoordinator {
    type Msg = CoordinatorMsg;
    type State = Arc<Fabric>;
    type Arguments = Arc<Fabric>;

    async fn pre_start(
        &self,
        _me: ActorRef<CoordinatorMsg>,
        f: Arc<Fabric>,
    ) -> Result<Arc<Fabric>, ActorProcessingErr> {
        Ok(f)
    }

    async fn handle(
        &self,
        _me: ActorRef<CoordinatorMsg>,
        msg: CoordinatorMsg,
        f: &mut Arc<Fabric>,
    ) -> Result<(), ActorProcessingErr> {
        let mut msg = msg;
        if let CoordinatorMsg::Weights { trace, .. } = &mut msg {
            // Rank 0 draws a process per (replica, node): say which node this is.
            for r in trace.iter_mut() {
                r.node = f.me;
            }
        }
        if let Some(frame) = wire::coordinator_frame(msg) {
            f.send(0, frame);
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _me: ActorRef<CoordinatorMsg>,
        evt: SupervisionEvent,
        f: &mut Arc<Fabric>,
    ) -> Result<(), ActorProcessingErr> {
        if f.is_done() {
            return Ok(());
        }
        let (cell, why) = match evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "stopped unexpectedly".into()))
            }
            _ => return Ok(()),
        };
        let actor = cell.get_name().unwrap_or_else(|| "an actor".into());
        let failure = Failure {
            actor: format!("{actor} on process rank {}", f.me),
            step: f.step.load(Ordering::Relaxed),
            action: None,
            error: why,
        };
        if let Some(frame) = wire::coordinator_frame(CoordinatorMsg::Failed(failure)) {
            f.send(0, frame);
        }
        Ok(())
    }
}

/// Stands in, on a worker, for rank 0's reducer.
pub struct RemoteReducer;

impl Actor for RemoteReducer {
    type Msg = ReducerMsg;
    type State = Arc<Fabric>;
    type Arguments = Arc<Fabric>;

    async fn pre_start(
        &self,
        _me: ActorRef<ReducerMsg>,
        f: Arc<Fabric>,
    ) -> Result<Arc<Fabric>, ActorProcessingErr> {
        Ok(f)
    }

    async fn handle(
        &self,
        _me: ActorRef<ReducerMsg>,
        msg: ReducerMsg,
        f: &mut Arc<Fabric>,
    ) -> Result<(), ActorProcessingErr> {
        f.send(0, wire::reducer_frame(msg));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pp4_over_2_processes_is_contiguous() {
        let p = Placement::new(4, 1, 1, 2).unwrap();
        assert_eq!(p.slots(0), vec![(0, 0), (0, 1)]);
        assert_eq!(p.slots(1), vec![(0, 2), (0, 3)]);
        assert_eq!(p.owner(0, 3), 1);
    }

    #[test]
    fn pp2_dp2_over_4_processes_gives_one_slot_each() {
        let p = Placement::new(2, 2, 1, 4).unwrap();
        assert_eq!(
            (0..4).map(|k| p.slots(k)).collect::<Vec<_>>(),
            vec![vec![(0, 0)], vec![(0, 1)], vec![(1, 0)], vec![(1, 1)]]
        );
        assert_eq!(p.owner(1, 0), 2);
        assert!((0..4).all(|k| p.follows(k).is_none()));
    }

    #[test]
    fn tp_within_a_process_places_stages_as_without_it() {
        let (a, b) = (Placement::new(2, 2, 4, 2).unwrap(), Placement::new(2, 2, 1, 2).unwrap());
        for k in 0..2 {
            assert_eq!(a.slots(k), b.slots(k));
            assert!(a.follows(k).is_none());
        }
        assert_eq!(a.tp_group(1, 1), 1..2);
        assert_eq!(a.tp_held(), 4);
    }

    #[test]
    fn tp_over_processes_puts_a_stage_s_ranks_side_by_side_tp_fastest() {
        // pp 2 × tp 4 over 4 processes: stage 0 on processes 0–1, stage 1 on 2–3.
        let p = Placement::new(2, 1, 4, 4).unwrap();
        assert_eq!(
            (0..4).map(|k| p.slots(k)).collect::<Vec<_>>(),
            vec![vec![(0, 0)], vec![], vec![(0, 1)], vec![]]
        );
        assert_eq!(
            (0..4).map(|k| p.follows(k)).collect::<Vec<_>>(),
            vec![None, Some((0, 0, 2..4)), None, Some((0, 1, 2..4))]
        );
        assert_eq!((p.owner(0, 1), p.tp_group(0, 1), p.tp_held()), (2, 2..4, 2));
    }

    #[test]
    fn tp_frames_are_taken_only_between_a_stage_s_owner_and_its_followers() {
        use super::super::tp::TpFrame;
        // pp 2 × tp 2 over 4: stage 0 on processes 0–1, stage 1 on 2–3; this is 1.
        let (f, _events) = Fabric::new(1, 4);
        let _ = f.placement.set(Placement::new(2, 1, 2, 4).unwrap());
        let cmd = TpFrame::Cmd(crate::model::tp::TpCmd::Release { key: 0 });
        let nodes = TpFrame::Nodes { seq: 0, first: 0 };
        assert!(f.tp_frame_fits(0, 0, 0, &cmd) && f.tp_frame_fits(0, 0, 0, &nodes));
        assert!(!f.tp_frame_fits(2, 0, 0, &cmd), "from another stage's process");
        assert!(!f.tp_frame_fits(0, 0, 1, &nodes), "for a stage this one does not follow");
        assert!(!f.tp_frame_fits(0, 1, 0, &cmd), "for a replica the run does not have");
        assert!(!f.tp_frame_fits(0, 0, 0, &TpFrame::Answer), "an answer to a follower");
    }

    #[test]
    fn uneven_split_is_refused_naming_the_fields() {
        let e = Placement::new(4, 1, 1, 3).unwrap_err().to_string();
        assert!(e.contains("parallel.pp × parallel.dp × parallel.tp") && e.contains("3 processes"), "{e}");
        // 6 ranks per process cannot hold whole tp = 4 stages nor an equal share of one.
        let e = Placement::new(3, 1, 4, 2).unwrap_err().to_string();
        assert!(e.contains("parallel.tp = 4") && e.contains("6 ranks per process"), "{e}");
    }
}
