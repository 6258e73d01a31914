//! Data-parallel gradient reduction: for each stage, the gradients of every
//! replica are summed in replica order (0 + 1 + 2 …) and the sum is sent back
//! to every replica, so all replicas apply the same update and stay identical.
//! Under ZeRO each replica gets only its shard of the sum (a reduce-scatter:
//! the tree is elementwise, so a shard of the root has the root's bits), and
//! the reducer also gathers the replicas' shards whole (`Gather`) and sends
//! them to every replica. A stage may gather many times in a step (ZeRO-3
//! gathers a chunk's weights for each action); a replica asks for the next
//! gather of a stage only once the last one came back, so the gathers of a
//! (step, stage) arrive round by round, and the reducer numbers the rounds.
//! Under ZeRO-2 and 3 there is no Reduce: each replica sends every
//! microbatch's gradient as it is made (`Scatter`), and once every replica's
//! gradient of that microbatch is in, each owner gets its shard of all of
//! them (`Scattered`) and folds them by the tree itself.
//!
//! As with a stage, the actor only owns the mailbox and supervision: its handler
//! forwards each message (through the chaos shim when testing) to a thread that
//! owns [`ReducerState`] — the pending gathers, the sums and the replay log. An
//! error or panic there stops the actor with the reason, which the coordinator
//! reports as it does any actor that stops during a run.

use super::protocol::{span_blob, stage_name, ReducerMsg, StageMsg};
use crate::optim::grad_tree::{self, Span};
use crate::optim::zero::Shard;
use crate::replay::{self, ActorLog, Blob, Entry};
use crate::rng::{Purpose, Rng};
use crossbeam_channel::Sender;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub struct ReducerArgs {
    pub dp: usize,
    /// Stage actors by (replica, rank).
    pub stages: Arc<OnceLock<Vec<Vec<ActorRef<StageMsg>>>>>,
    /// The schedule's placement: the rank holding each stage (chunks included), so
    /// also the number of gathers per step.
    pub stage_rank: Vec<usize>,
    pub log: Option<ActorLog>,
    /// Test transport: deliver each gradient after a random delay, so replicas'
    /// contributions reach the sum in a scrambled order.
    pub chaos_seed: Option<u64>,
    /// ZeRO: send each replica its shard of a sum, not the whole.
    pub zero: bool,
}

pub struct Reducer;

/// One stage's gradients, a vector per parameter tensor.
type Grads = Vec<Vec<f32>>;

/// A replica's tree nodes of one stage.
type Nodes = Vec<(Span, Grads)>;

pub struct ReducerState {
    args: ReducerArgs,
    /// (step, stage) → tree nodes by replica.
    pending: BTreeMap<(u64, usize), Vec<Option<Nodes>>>,
    /// Log entries waiting for their step's gathers to complete, by (step, stage, replica).
    held: BTreeMap<(u64, usize, usize), Entry>,
    /// Completed gathers of steps still open.
    done: BTreeMap<u64, usize>,
    /// ZeRO gathers: (step, stage) → shards by replica; the round each
    /// (step, stage) is at; log entries by (step, round, stage, replica) and
    /// the stages done with each (step, round), as for reductions.
    shards: BTreeMap<(u64, usize), Vec<Option<Grads>>>,
    rounds: BTreeMap<(u64, usize), u32>,
    shards_held: BTreeMap<(u64, u32, usize, usize), Entry>,
    shards_done: BTreeMap<(u64, u32), usize>,
    /// ZeRO-2/3 scatters: (step, stage, microbatch, head?) → gradients by
    /// replica, and their log entries, logged once the step is over (the
    /// first message of a later step) in key order.
    scatters: BTreeMap<ScatterKey, Vec<Option<Grads>>>,
    scatter_held: BTreeMap<(ScatterKey, usize), Entry>,
}

/// (step, stage, the replica's microbatch, head's tensors?) of a scatter.
type ScatterKey = (u64, usize, usize, bool);

/// The actor's side: where messages go, and the thread to wait for at the end.
pub struct ReducerHandle {
    tx: Option<Sender<ReducerMsg>>,
    thread: Option<std::thread::JoinHandle<()>>,
    chaos: Option<Rng>,
}

impl Actor for Reducer {
    type Msg = ReducerMsg;
    type State = ReducerHandle;
    type Arguments = ReducerArgs;

    async fn pre_start(
        &self,
        me: ActorRef<ReducerMsg>,
        args: ReducerArgs,
    ) -> Result<ReducerHandle, ActorProcessingErr> {
        let chaos = args.chaos_seed.map(|s| Rng::new(s, Purpose::Test, &[0x7ed]));
        let (tx, rx) = crossbeam_channel::unbounded::<ReducerMsg>();
        let thread = std::thread::Builder::new().name("reducer".into()).spawn(move || {
            let mut st = ReducerState::new(args);
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                rx.iter().try_for_each(|msg| st.on_message(msg))
            }));
            let failed = match result {
                Ok(r) => r.err(),
                Err(p) => Some(super::stage::panic_text(&p)),
            };
            let finished = st.close_log().err();
            if let Some(why) = failed.or(finished) {
                me.stop(Some(why));
            }
        })?;
        Ok(ReducerHandle { tx: Some(tx), thread: Some(thread), chaos })
    }

    async fn handle(
        &self,
        _me: ActorRef<ReducerMsg>,
        msg: ReducerMsg,
        st: &mut ReducerHandle,
    ) -> Result<(), ActorProcessingErr> {
        let tx = st.tx.as_ref().ok_or("reducer thread has exited")?;
        match &mut st.chaos {
            Some(rng) => {
                let delay = Duration::from_micros(rng.below(2000));
                let tx = tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = tx.send(msg);
                });
            }
            None => tx.send(msg).map_err(|_| "reducer thread has exited")?,
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<ReducerMsg>,
        st: &mut ReducerHandle,
    ) -> Result<(), ActorProcessingErr> {
        // Closing the channel ends the thread once delayed deliveries are in; it then
        // finishes the log, which the run's caller may read next.
        st.tx.take();
        if let Some(t) = st.thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        Ok(())
    }
}

/// Tensors as log blobs, `tensor.k`.
fn tensor_blobs(tensors: &Grads, keep: bool) -> Vec<Blob> {
    tensors.iter().enumerate().map(|(k, g)| Blob::f32s(&format!("tensor.{k}"), g, keep)).collect()
}

/// A Reduce's flat list of tensors cut into one set per span.
pub fn split_nodes(spans: Vec<Span>, grads: Grads) -> Result<Nodes, String> {
    if spans.is_empty() || !grads.len().is_multiple_of(spans.len()) {
        return Err(format!("reducer: {} tensors do not split into {} tree nodes", grads.len(), spans.len()));
    }
    let per = grads.len() / spans.len();
    let mut it = grads.into_iter();
    Ok(spans.into_iter().map(|s| (s, it.by_ref().take(per).collect())).collect())
}

impl ReducerState {
    pub fn new(args: ReducerArgs) -> ReducerState {
        ReducerState {
            args,
            pending: BTreeMap::new(),
            held: BTreeMap::new(),
            done: BTreeMap::new(),
            shards: BTreeMap::new(),
            rounds: BTreeMap::new(),
            shards_held: BTreeMap::new(),
            scatters: BTreeMap::new(),
            scatter_held: BTreeMap::new(),
            shards_done: BTreeMap::new(),
        }
    }

    /// The rank holding `stage`, or an error naming a stage or replica out of range.
    fn rank_of(&self, stage: usize, replica: usize) -> Result<usize, String> {
        let Some(&rank) = self.args.stage_rank.get(stage) else {
            return Err(format!("reducer: stage {stage} of {}", self.args.stage_rank.len()));
        };
        if replica >= self.args.dp {
            return Err(format!("reducer: replica {replica} of {}", self.args.dp));
        }
        Ok(rank)
    }

    /// Handles one message; with no stage actors (replaying the reducer alone)
    /// the sums are only logged.
    pub fn on_message(&mut self, msg: ReducerMsg) -> Result<(), String> {
        let step = match &msg {
            ReducerMsg::Reduce { step, .. }
            | ReducerMsg::Gather { step, .. }
            | ReducerMsg::Scatter { step, .. } => *step,
        };
        // A replica starts a step only after every scatter of the steps
        // before is complete: they can be logged.
        self.flush_scatters(step);
        let (step, stage, replica, spans, grads) = match msg {
            ReducerMsg::Reduce { step, stage, replica, spans, grads } => (step, stage, replica, spans, grads),
            ReducerMsg::Gather { step, stage, replica, shards } => {
                return self.on_gather(step, stage, replica, shards)
            }
            ReducerMsg::Scatter { step, stage, replica, mb, head, grads } => {
                return self.on_scatter((step, stage, mb, head), replica, grads)
            }
        };
        let dp = self.args.dp;
        let rank = self.rank_of(stage, replica)?;
        if let Some(log) = &self.args.log {
            let keep = log.payloads();
            let mut inputs = vec![span_blob(&spans)];
            inputs.extend(grads.iter().enumerate().map(|(k, g)| Blob::f32s(&format!("tensor.{k}"), g, keep)));
            let e = replay::entry(&stage_name(rank, replica), "Reduce", step, replica)
                .with_stage(stage)
                .with_inputs(inputs);
            self.held.insert((step, stage, replica), e);
        }
        let nodes = split_nodes(spans, grads)?;
        let slot = self.pending.entry((step, stage)).or_insert_with(|| (0..dp).map(|_| None).collect());
        if slot[replica].replace(nodes).is_some() {
            return Err(format!("reducer: replica {replica} sent stage {stage} of step {step} twice"));
        }
        if slot.iter().any(Option::is_none) {
            return Ok(());
        }
        let nodes: Nodes =
            self.pending.remove(&(step, stage)).unwrap().into_iter().flatten().flatten().collect();
        // The replicas' blocks cover the step's microbatches: the last one ends at their count.
        let total = nodes.iter().map(|(s, _)| s.hi).max().unwrap_or(0);
        let sum = grad_tree::combine(nodes, total);
        let zero = self.args.zero;
        let part_of = |r: usize| match zero {
            true => crate::optim::zero::shards_of(&sum, Shard { replica: r, dp }),
            false => sum.clone(),
        };
        if let Some(e) = self.held.get_mut(&(step, stage, dp - 1)) {
            let keep = self.args.log.as_ref().is_some_and(|l| l.payloads());
            for r in 0..dp {
                let blobs = tensor_blobs(&part_of(r), keep);
                let to = stage_name(rank, r);
                e.sent.push(replay::Sent { to, kind: "Reduced".into(), mb: None, blobs });
            }
            let n = self.done.entry(step).or_insert(0);
            *n += 1;
            if *n == self.args.stage_rank.len() {
                self.done.remove(&step);
                self.flush_log();
            }
        }
        let Some(stages) = self.args.stages.get() else { return Ok(()) };
        let failed = |e| format!("reducer: {e}");
        for (r, replica) in stages.iter().enumerate().take(dp).skip(1) {
            replica[rank]
                .send_message(StageMsg::Reduced { step, stage, grads: part_of(r) })
                .map_err(failed)?;
        }
        let grads = if zero { part_of(0) } else { sum };
        stages[0][rank].send_message(StageMsg::Reduced { step, stage, grads }).map_err(failed)
    }

    /// A replica's shards of `stage`'s tensors; once every replica's are in,
    /// each tensor is its shards in replica order, sent to every replica.
    fn on_gather(&mut self, step: u64, stage: usize, replica: usize, shards: Grads) -> Result<(), String> {
        let (dp, rank) = (self.args.dp, self.rank_of(stage, replica)?);
        // Replicas are at most a step apart: older rounds are over.
        self.rounds.retain(|&(s, _), _| s + 2 > step);
        let round = self.rounds.get(&(step, stage)).copied().unwrap_or(0);
        if let Some(log) = &self.args.log {
            let e = replay::entry(&stage_name(rank, replica), "Gather", step, replica)
                .with_stage(stage)
                .with_inputs(tensor_blobs(&shards, log.payloads()));
            self.shards_held.insert((step, round, stage, replica), e);
        }
        let slot = self.shards.entry((step, stage)).or_insert_with(|| (0..dp).map(|_| None).collect());
        if slot[replica].replace(shards).is_some() {
            return Err(format!(
                "reducer: replica {replica} sent its shards of stage {stage}, step {step} twice"
            ));
        }
        if slot.iter().any(Option::is_none) {
            return Ok(());
        }
        let by_replica: Vec<Grads> =
            self.shards.remove(&(step, stage)).unwrap().into_iter().flatten().collect();
        let whole = crate::optim::zero::concat_shards(by_replica).map_err(|e| format!("reducer: {e}"))?;
        let whole = Arc::new(whole);
        self.rounds.insert((step, stage), round + 1);
        self.log_gathered((step, round), stage, rank, &whole);
        let Some(stages) = self.args.stages.get() else { return Ok(()) };
        for replica in stages.iter().take(dp) {
            let msg = StageMsg::Gathered { step, stage, tensors: Arc::clone(&whole) };
            replica[rank].send_message(msg).map_err(|e| format!("reducer: {e}"))?;
        }
        Ok(())
    }

    /// A replica's gradient of one microbatch; once every replica's is in,
    /// each owner gets its shard of each, replicas in order (a shard of a
    /// tensor is the elements `optim::zero::Shard` gives its owner).
    fn on_scatter(&mut self, key: ScatterKey, replica: usize, grads: Grads) -> Result<(), String> {
        let (step, stage, mb, head) = key;
        let (dp, rank) = (self.args.dp, self.rank_of(stage, replica)?);
        if let Some(log) = &self.args.log {
            let mut inputs = vec![Blob::u32s(crate::replay::key::LEAF, &[mb as u32, head as u32], true)];
            inputs.extend(tensor_blobs(&grads, log.payloads()));
            let e = replay::entry(&stage_name(rank, replica), "Scatter", step, replica)
                .with_stage(stage)
                .with_inputs(inputs);
            self.scatter_held.insert((key, replica), e);
        }
        let slot = self.scatters.entry(key).or_insert_with(|| (0..dp).map(|_| None).collect());
        if slot[replica].replace(grads).is_some() {
            return Err(format!(
                "reducer: replica {replica} sent microbatch {mb} of stage {stage}, step {step} twice"
            ));
        }
        if slot.iter().any(Option::is_none) {
            return Ok(());
        }
        let by_replica: Vec<Grads> = self.scatters.remove(&key).unwrap().into_iter().flatten().collect();
        let shards_for = |owner: usize| -> Grads {
            let shard = Shard { replica: owner, dp };
            by_replica.iter().flat_map(|g| g.iter().map(|t| t[shard.range(t.len())].to_vec())).collect()
        };
        if let Some(e) = self.scatter_held.get_mut(&(key, dp - 1)) {
            let keep = self.args.log.as_ref().is_some_and(|l| l.payloads());
            for owner in 0..dp {
                let (to, blobs) = (stage_name(rank, owner), tensor_blobs(&shards_for(owner), keep));
                e.sent.push(replay::Sent { to, kind: "Scattered".into(), mb: Some(mb as u64), blobs });
            }
        }
        let Some(stages) = self.args.stages.get() else { return Ok(()) };
        for (owner, replica) in stages.iter().enumerate().take(dp) {
            let msg = StageMsg::Scattered { step, stage, mb, head, shards: shards_for(owner) };
            replica[rank].send_message(msg).map_err(|e| format!("reducer: {e}"))?;
        }
        Ok(())
    }

    /// Logs the scatters of steps before `step`, in (step, stage,
    /// microbatch, head, replica) order.
    fn flush_scatters(&mut self, step: u64) {
        let Some(log) = &mut self.args.log else { return };
        if self.scatter_held.first_key_value().is_none_or(|(k, _)| k.0 .0 >= step) {
            return;
        }
        let later = self.scatter_held.split_off(&((step, 0, 0, false), 0));
        for (_, e) in std::mem::replace(&mut self.scatter_held, later) {
            log.begin(e);
        }
        log.end();
    }

    /// Records a completed gather; once every stage's gather of the (step,
    /// round) is in, logs them in (stage, replica) order, whatever order they
    /// arrived in. Every stage gathers as often as the others in a step: each
    /// runs every microbatch's actions once.
    fn log_gathered(&mut self, (step, round): (u64, u32), stage: usize, rank: usize, whole: &Grads) {
        let Some(log) = &mut self.args.log else { return };
        let dp = self.args.dp;
        if let Some(e) = self.shards_held.get_mut(&(step, round, stage, dp - 1)) {
            let blobs = tensor_blobs(whole, log.payloads());
            for r in 0..dp {
                let to = stage_name(rank, r);
                e.sent.push(replay::Sent { to, kind: "Gathered".into(), mb: None, blobs: blobs.clone() });
            }
        }
        let n = self.shards_done.entry((step, round)).or_insert(0);
        *n += 1;
        if *n < self.args.stage_rank.len() {
            return;
        }
        self.shards_done.remove(&(step, round));
        let held = std::mem::take(&mut self.shards_held);
        for (key, e) in held {
            if (key.0, key.1) == (step, round) {
                log.begin(e);
            } else {
                self.shards_held.insert(key, e);
            }
        }
        log.end();
    }

    /// Flushes and closes the log; returns how far a replay got.
    pub fn close_log(&mut self) -> Result<usize, String> {
        self.flush_log();
        self.flush_scatters(u64::MAX);
        match &mut self.args.log {
            Some(log) => {
                log.finish()?;
                Ok(log.position())
            }
            None => Ok(0),
        }
    }

    /// Logs the held entries of completed steps in (step, stage, replica) order:
    /// the order the sums are formed in, whatever order the replicas arrived in.
    fn flush_log(&mut self) {
        let Some(log) = &mut self.args.log else { return };
        let open: Vec<u64> = self.pending.keys().map(|k| k.0).collect();
        let held = std::mem::take(&mut self.held);
        for (key, e) in held {
            if open.contains(&key.0) || self.done.contains_key(&key.0) {
                self.held.insert(key, e);
            } else {
                log.begin(e);
            }
        }
        log.end();
    }
}
