//! Tensor-parallel ranks of one stage in several processes: the owner's
//! commands to its followers, their answers, and the all-reduce nodes every
//! process of the group trades, all as frames on the run's data links.
//!
//! Each stage chunk's group has an inbox in the [`Fabric`], made by whichever
//! comes first (a frame or the code waiting on it), so nothing that arrives
//! early is lost. Frames on one link keep their order, so a follower runs
//! the owner's commands in the owner's order; nodes from several processes
//! interleave, and are matched by call number.

use super::frame::{Array, Frame};
use super::mesh::Fabric;
use super::wire::Kind;
use crate::model::block::Exchange;
use crate::model::tp::{Followers, Remote, TpCmd, TpFollower, TpShape};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a tp frame carries; its arrays are the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum TpFrame {
    /// Owner → follower.
    Cmd(TpCmd),
    /// A process's nodes of all-reduce number `seq`: ranks `first..`.
    Nodes { seq: u64, first: u32 },
    /// Follower → owner: the answer to the oldest command that asks for one.
    Answer,
}

/// A stage chunk's group: (replica, pipeline rank, chunk).
pub type GroupKey = (u32, u32, u32);

/// One group's inbox in this process.
pub struct Inbox {
    tx: Sender<(usize, TpFrame, Vec<Vec<f32>>)>,
    rx: Receiver<(usize, TpFrame, Vec<Vec<f32>>)>,
}

/// Tensor bytes this process's tp frames carried, by kind: the figure
/// behind "communication per layer" (summary.json's `tp_traffic`, rank 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TpTraffic {
    pub commands_sent: u64,
    pub nodes_sent: u64,
    pub answers_sent: u64,
    pub commands_received: u64,
    pub nodes_received: u64,
    pub answers_received: u64,
}

#[derive(Default)]
pub struct Inboxes {
    groups: Mutex<HashMap<GroupKey, Arc<Inbox>>>,
    traffic: Mutex<TpTraffic>,
}

fn bytes(arrays: &[Vec<f32>]) -> u64 {
    arrays.iter().map(|a| 4 * a.len() as u64).sum()
}

impl Inboxes {
    /// What this process's tp frames carried so far; None if it sent or got none.
    pub fn traffic(&self) -> Option<TpTraffic> {
        let t = *self.traffic.lock().expect("tp traffic");
        (t != TpTraffic::default()).then_some(t)
    }

    fn count(&self, msg: &TpFrame, n: u64, sent: bool) {
        let mut t = self.traffic.lock().expect("tp traffic");
        let slot = match (msg, sent) {
            (TpFrame::Cmd(_), true) => &mut t.commands_sent,
            (TpFrame::Nodes { .. }, true) => &mut t.nodes_sent,
            (TpFrame::Answer, true) => &mut t.answers_sent,
            (TpFrame::Cmd(_), false) => &mut t.commands_received,
            (TpFrame::Nodes { .. }, false) => &mut t.nodes_received,
            (TpFrame::Answer, false) => &mut t.answers_received,
        };
        *slot += n;
    }

    pub fn get(&self, key: GroupKey) -> Arc<Inbox> {
        self.groups
            .lock()
            .expect("tp inboxes")
            .entry(key)
            .or_insert_with(|| {
                let (tx, rx) = crossbeam_channel::unbounded();
                Arc::new(Inbox { tx, rx })
            })
            .clone()
    }

    /// A frame from `peer` for group `key`.
    pub fn deliver(
        &self,
        peer: usize,
        key: GroupKey,
        msg: TpFrame,
        arrays: Vec<Array>,
    ) -> Result<(), String> {
        let arrays = crate::actors::protocol::f32_arrays("Tp", arrays).map_err(|e| e.to_string())?;
        self.count(&msg, bytes(&arrays), false);
        let _ = self.get(key).tx.send((peer, msg, arrays));
        Ok(())
    }
}

/// Sends a tp frame for group `key` to process `to`, counting its bytes.
fn send(fabric: &Fabric, to: usize, key: GroupKey, msg: TpFrame, arrays: Vec<Vec<f32>>) {
    fabric.tp_inboxes.count(&msg, bytes(&arrays), true);
    let (replica, rank, chunk) = key;
    let frame =
        Frame::with(Kind::Tp { replica, rank, chunk, msg }, arrays.into_iter().map(Array::F32).collect());
    fabric.send(to, frame);
}

/// What one process of a group sees of the others: frames sorted by kind
/// as they are read, so a wait for one kind holds the rest.
struct Link {
    fabric: Arc<Fabric>,
    key: GroupKey,
    inbox: Arc<Inbox>,
    /// The group's processes in rank order (the owner first).
    procs: std::ops::Range<usize>,
    held: usize,
    sorted: Mutex<Sorted>,
    /// How long a wait on a peer's nodes or answer may last.
    timeout: Duration,
}

#[derive(Default)]
struct Sorted {
    cmds: VecDeque<(TpCmd, Vec<Vec<f32>>)>,
    /// By all-reduce number: (the process that sent it, rank, node).
    nodes: BTreeMap<u64, Vec<(usize, usize, Vec<f32>)>>,
    answers: HashMap<usize, VecDeque<Vec<Vec<f32>>>>,
}

impl Link {
    fn new(fabric: &Arc<Fabric>, key: GroupKey, timeout: Duration) -> Result<Link, String> {
        let p = fabric.placement.get().ok_or("tensor parallelism over processes before the placement")?;
        let (replica, rank) = (key.0 as usize, key.1 as usize);
        Ok(Link {
            fabric: fabric.clone(),
            key,
            inbox: fabric.tp_inboxes.get(key),
            procs: p.tp_group(replica, rank),
            held: p.tp_held(),
            sorted: Mutex::new(Sorted::default()),
            timeout,
        })
    }

    /// The tp ranks of the group.
    fn procs_ranks(&self) -> std::ops::Range<usize> {
        0..self.held * self.procs.len()
    }

    fn who(&self) -> String {
        let (r, s, c) = self.key;
        format!("stage {s}.{r} chunk {c}'s tensor-parallel group")
    }

    /// Reads frames until `done` finds what it waits for. Err: the run ended,
    /// or `limit` passed without it. `awaited` names the processes still
    /// owing it, logged while the wait lasts and in the error.
    fn wait<T>(
        &self,
        what: &str,
        limit: Option<Duration>,
        awaited: impl Fn(&Sorted) -> Vec<usize>,
        mut done: impl FnMut(&mut Sorted) -> Option<T>,
    ) -> Result<T, String> {
        let start = Instant::now();
        let mut next_note = NOTE_AFTER;
        let names = |s: &Sorted| {
            let who: Vec<String> = awaited(s).into_iter().map(|p| self.fabric.describe(p)).collect();
            match who.is_empty() {
                true => "no process in particular".to_string(),
                false => who.join(", "),
            }
        };
        loop {
            if let Some(v) = done(&mut self.sorted.lock().expect("tp frames")) {
                return Ok(v);
            }
            match self.inbox.rx.recv_timeout(Duration::from_millis(200)) {
                Ok((peer, msg, arrays)) => {
                    let mut s = self.sorted.lock().expect("tp frames");
                    match msg {
                        TpFrame::Cmd(c) => s.cmds.push_back((c, arrays)),
                        TpFrame::Nodes { seq, first } => {
                            let ranks = first as usize..;
                            let from = ranks.zip(arrays).map(|(r, n)| (peer, r, n));
                            s.nodes.entry(seq).or_default().extend(from);
                        }
                        TpFrame::Answer => s.answers.entry(peer).or_default().push_back(arrays),
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if self.fabric.is_done() {
                        return Err(format!("{}: the run ended while waiting for {what}", self.who()));
                    }
                    let waited = start.elapsed();
                    if let Some(l) = limit.filter(|&l| waited > l) {
                        let who = names(&self.sorted.lock().expect("tp frames"));
                        return Err(format!(
                            "{}: no {what} from {who} within {:.1} s (parallel.tp_timeout_s); its links \
                             are open but it sent nothing",
                            self.who(),
                            l.as_secs_f64()
                        ));
                    }
                    // A silent peer would otherwise freeze the run without a word.
                    if limit.is_some() && waited > next_note {
                        let who = names(&self.sorted.lock().expect("tp frames"));
                        tracing::warn!(
                            "{}: waited {:.0} s for {what} from {who}",
                            self.who(),
                            waited.as_secs_f64()
                        );
                        next_note = waited * 2;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(format!("{}: inbox closed", self.who())),
            }
        }
    }

    /// The processes (other than this one) with no node of all-reduce `seq` in yet.
    fn owing_nodes(&self, s: &Sorted, seq: u64) -> Vec<usize> {
        let got = s.nodes.get(&seq);
        self.procs
            .clone()
            .filter(|&p| p != self.fabric.me && !got.is_some_and(|n| n.iter().any(|(from, _, _)| *from == p)))
            .collect()
    }
}

/// A wait longer than this is logged, naming who is awaited (and again at
/// every doubling).
const NOTE_AFTER: Duration = Duration::from_secs(5);

impl Exchange for Link {
    fn swap(&self, seq: u64, first: usize, local: &[&[f32]]) -> Result<Vec<(usize, Vec<f32>)>, String> {
        let me = self.fabric.me;
        for p in self.procs.clone().filter(|&p| p != me) {
            let nodes = local.iter().map(|n| n.to_vec()).collect();
            send(&self.fabric, p, self.key, TpFrame::Nodes { seq, first: first as u32 }, nodes);
        }
        let want = self.held * (self.procs.len() - 1);
        let theirs = self.wait(
            "the other processes' all-reduce nodes",
            Some(self.timeout),
            |s| self.owing_nodes(s, seq),
            |s| (s.nodes.get(&seq).map_or(0, Vec::len) >= want).then(|| s.nodes.remove(&seq).expect("nodes")),
        )?;
        let len = local.first().map_or(0, |n| n.len());
        let mine = first..first + local.len();
        let mut seen = std::collections::BTreeSet::new();
        for (peer, r, n) in &theirs {
            let from = self.fabric.describe(*peer);
            if !self.procs_ranks().contains(r) || mine.contains(r) || !seen.insert(*r) {
                return Err(format!(
                    "{}: all-reduce {seq} got a node for rank {r} from {from}, which no other process of \
                     the group holds once",
                    self.who()
                ));
            }
            if n.len() != len {
                return Err(format!(
                    "{}: {from} sent rank {r}'s node of all-reduce {seq} with {} elements, not {len}",
                    self.who(),
                    n.len()
                ));
            }
        }
        match theirs.len() == want {
            true => Ok(theirs.into_iter().map(|(_, r, n)| (r, n)).collect()),
            false => Err(format!("{}: {} nodes for all-reduce {seq}, not {want}", self.who(), theirs.len())),
        }
    }
}

/// An owner's view of its followers.
struct Owner(Arc<Link>);

impl Followers for Owner {
    fn count(&self) -> usize {
        self.0.procs.len() - 1
    }

    fn send(&self, follower: usize, cmd: TpCmd, arrays: Vec<Vec<f32>>) {
        let l = &self.0;
        send(&l.fabric, l.procs.start + 1 + follower, l.key, TpFrame::Cmd(cmd), arrays);
    }

    fn answer(&self, follower: usize) -> Vec<Vec<f32>> {
        let peer = self.0.procs.start + 1 + follower;
        let got = self.0.wait(
            "a follower's gradient shards",
            Some(self.0.timeout),
            |_| vec![peer],
            |s| s.answers.get_mut(&peer)?.pop_front(),
        );
        // The stage stops with the wait's own words (its executor reports
        // the payload as the failure); no panic message is printed.
        got.unwrap_or_else(|e| std::panic::resume_unwind(Box::new(e)))
    }
}

/// The followers of chunk `chunk` of the stage at (replica, rank), when this
/// run puts its tp ranks in more than one process.
pub fn owner_remote(
    fabric: &Arc<Fabric>,
    replica: usize,
    rank: usize,
    chunk: usize,
    timeout: Duration,
) -> Result<Option<Remote>, String> {
    let Some(p) = fabric.placement.get() else { return Ok(None) };
    if p.tp_group(replica, rank).len() < 2 {
        return Ok(None);
    }
    let link = Arc::new(Link::new(fabric, (replica as u32, rank as u32, chunk as u32), timeout)?);
    Ok(Some(Remote { per: link.held, followers: Box::new(Owner(link.clone())), exchange: Box::new(link) }))
}

/// Runs the ranks this process holds of another process's stage, one thread
/// per chunk, until the run ends. A command that cannot be run fails the run
/// through `fail`.
pub fn spawn_followers(
    fabric: &Arc<Fabric>,
    cfg: &crate::config::Config,
    layout: &crate::actors::Layout,
    fail: impl Fn(String) + Send + Sync + 'static,
) -> Result<Vec<std::thread::JoinHandle<()>>, String> {
    let Some(p) = fabric.placement.get() else { return Ok(vec![]) };
    let Some((replica, rank, local)) = p.follows(fabric.me) else { return Ok(vec![]) };
    let gpt = cfg.arch();
    let shape = TpShape::from_config(cfg);
    tracing::info!(
        "rank {}: holds tensor-parallel ranks {}..{} of stage {rank}.{replica} (its actor runs on rank {})",
        fabric.me,
        local.start,
        local.end,
        p.owner(replica, rank)
    );
    let fail = Arc::new(fail);
    let mut threads = Vec::new();
    for (chunk, s) in layout.stages_of(rank).into_iter().enumerate() {
        let key = (replica as u32, rank as u32, chunk as u32);
        let link = Arc::new(Link::new(fabric, key, cfg.parallel.tp_timeout())?);
        let mut follower = TpFollower::new(
            gpt,
            layout.stages[s].clone(),
            cfg.train.micro_batch_size,
            cfg.train.recompute,
            shape,
            local.clone(),
            layout.threads_per_rank,
            Box::new(link.clone()),
        );
        let (fail, owner) = (fail.clone(), link.procs.start);
        let name = format!("tp-follower-{rank}.{replica}.{chunk}");
        let t = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| loop {
                    // Commands may pause for as long as the run does (evals, checkpoints).
                    let (cmd, arrays) =
                        match link.wait("the owner's next command", None, |_| vec![], |s| s.cmds.pop_front())
                        {
                            Ok(c) => c,
                            Err(_) if link.fabric.is_done() => return,
                            Err(e) => {
                                fail(format!("{name}: {e}"));
                                return;
                            }
                        };
                    match follower.handle(cmd, arrays) {
                        Ok(Some(answer)) => {
                            send(&link.fabric, owner, link.key, TpFrame::Answer, answer);
                        }
                        Ok(None) => {}
                        Err(_) if link.fabric.is_done() => return,
                        Err(e) => {
                            fail(format!("{name}: {e}"));
                            return;
                        }
                    }
                });
                if let Err(e) = std::panic::catch_unwind(run) {
                    let why = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "a panic".into());
                    if !link.fabric.is_done() {
                        fail(format!("{name}: {why}"));
                    }
                }
            })
            .map_err(|e| format!("cannot start a tensor-parallel follower thread: {e}"))?;
        threads.push(t);
    }
    Ok(threads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::mesh::Placement;

    /// This process (0) and process 1 each hold one of stage 0's two tp ranks.
    fn pair(timeout: Duration) -> (Arc<Fabric>, Link) {
        let (f, _events) = Fabric::new(0, 2);
        let _ = f.placement.set(Placement::new(1, 1, 2, 2).expect("placement"));
        let link = Link::new(&f, (0, 0, 0), timeout).expect("link");
        (f, link)
    }

    #[test]
    fn a_short_all_reduce_node_fails_the_swap_naming_the_sender_and_its_length() {
        let (f, link) = pair(Duration::from_secs(30));
        let nodes = TpFrame::Nodes { seq: 0, first: 1 };
        f.tp_inboxes.deliver(1, (0, 0, 0), nodes, vec![Array::F32(vec![1.0; 3])]).unwrap();
        let e = link.swap(0, 0, &[&[0.0; 8]]).unwrap_err();
        assert!(e.contains("process rank 1 sent rank 1's node") && e.contains("3 elements, not 8"), "{e}");
    }

    #[test]
    fn a_silent_peer_fails_the_swap_after_the_timeout_naming_it() {
        let (_f, link) = pair(Duration::from_millis(300));
        let start = Instant::now();
        let e = link.swap(0, 0, &[&[0.0; 8]]).unwrap_err();
        assert!(e.contains("from process rank 1 within 0.3 s") && e.contains("parallel.tp_timeout_s"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(20), "the wait is bounded by the timeout");
    }

    #[test]
    fn nodes_from_the_peer_complete_the_swap() {
        let (f, link) = pair(Duration::from_secs(30));
        let nodes = TpFrame::Nodes { seq: 4, first: 1 };
        f.tp_inboxes.deliver(1, (0, 0, 0), nodes, vec![Array::F32(vec![2.0; 8])]).unwrap();
        assert_eq!(link.swap(4, 0, &[&[0.0; 8]]).unwrap(), vec![(1, vec![2.0; 8])]);
    }
}
