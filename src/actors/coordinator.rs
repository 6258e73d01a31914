//! The coordinator: parent of every actor in a run and owner of the step loop.
//!
//! For each optimizer step it tells the loaders to feed and the stages to walk
//! their action lists, gathers each rank's per-tensor squared gradient norms and
//! loss sums, sums them in a fixed order (canonical tensor order; replica order),
//! decides the clip factor — or skips the update if anything is non-finite —
//! and tells every stage to apply AdamW. Evaluations run between steps. A
//! failure anywhere (a stage's error or panic, an actor dying) ends the run
//! with an error naming the actor, step and microbatch; nothing waits forever.

use super::data_loader::{DataLoader, LoaderArgs, LoaderMsg};
use super::layout::Layout;
use super::monitor::{Monitor, MonitorArgs, MonitorMsg};
use super::reducer::{Reducer, ReducerArgs, ReducerMsg};
use super::stage::{StageActor, StageArgs};
use crate::config::Config;
use crate::data::{EvalSet, Sampler};
use crate::model::{io::LoadedWeights, Param};
use crate::optim::{self, LrSchedule};
use crate::replay::{self, ActorLog, Blob};
use crate::train::run::{Progress, StepMetrics};
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tokio::sync::oneshot;

pub use super::protocol::{stage_name, CoordinatorMsg, EvalKind, Failure, StageMsg, StageReport};

/// ractor's registry is process-wide: runs in one process (tests, the bench's
/// layouts) register their actors under their own run number, `name#run`.
fn registered(name: &str, run: u64) -> String {
    format!("{name}#{run}")
}

fn plain_name(registered: &str) -> &str {
    registered.split('#').next().unwrap_or(registered)
}

pub struct RunData {
    pub train: Sampler,
    pub val: Option<Sampler>,
    pub eval_set: Option<Arc<EvalSet>>,
}

pub struct RunInputs {
    /// Where checkpoints go (`run_dir/checkpoints/`).
    pub run_dir: std::path::PathBuf,
    /// Resume from this checkpoint (its step is the first step run).
    pub resume: Option<Arc<crate::checkpoint::Loaded>>,
    pub cfg: Config,
    pub layout: Layout,
    pub data: Vec<RunData>,
    pub init: Option<Arc<LoadedWeights>>,
    pub metrics: Option<std::io::BufWriter<std::fs::File>>,
    pub progress: bool,
    pub chaos_seed: Option<u64>,
    /// Set when the run spans processes: stages owned elsewhere are reached
    /// through it, and the trace clock is the fabric's.
    pub cluster: Option<Arc<crate::cluster::Fabric>>,
}

#[derive(Debug, Default)]
pub struct RunOutcome {
    /// Parameters of replica 0, every stage (a tied copy may appear twice).
    pub params: Vec<Param>,
    pub losses: Vec<f64>,
    pub train_curve: Vec<(usize, f64)>,
    pub val_curve: Vec<(usize, f64)>,
    pub last_val: Option<f64>,
    pub last_exact_match: Option<f64>,
    pub skipped: usize,
    pub train_seconds: f64,
    /// Tokens trained on, summed over every segment of a resumed run.
    pub tokens: u64,
    /// Tokens processed by this process (rolled-back steps count twice).
    pub tokens_this_run: u64,
    /// Send → actor handle time of every activation and gradient message, µs.
    pub message_latency_us: Vec<f64>,
    /// Peak activation bytes held per rank (replica 0).
    pub peak_live_bytes: Vec<usize>,
    /// Trace records of every replica's stages and of the checkpointer (empty unless tracing).
    pub trace: Vec<crate::trace::Record>,
    /// Training paused while stages copied their state, per checkpoint, ms.
    pub checkpoint_pause_ms: Vec<f64>,
    /// Background write time per checkpoint, ms.
    pub checkpoint_write_ms: Vec<f64>,
    pub checkpoints: Vec<std::path::PathBuf>,
    /// The run stopped at a signal before its last step.
    pub stopped_early: bool,
    /// Steps completed when the run ended (counting those before a resume).
    pub steps_done: u64,
    /// Rollbacks to a checkpoint after repeated skipped steps.
    pub rollbacks: usize,
}

/// Runs a whole training run on actors and returns what it produced.
pub async fn run(inputs: RunInputs) -> anyhow::Result<RunOutcome> {
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = oneshot::channel();
    let shutdown = std::time::Duration::from_secs_f64(inputs.cfg.recovery.shutdown_timeout_s);
    let (coord, handle) = Actor::spawn(Some(registered("coordinator", id)), Coordinator, (inputs, tx, id))
        .await
        .map_err(|e| anyhow::anyhow!("cannot start the coordinator: {e}"))?;
    let actors = coord.get_children();
    // SIGINT / SIGTERM (crate::train::signals): a checkpoint at the next step
    // boundary, then a clean exit.
    let signals = {
        let coord = coord.clone();
        tokio::spawn(async move {
            while !crate::train::signals::requested() {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            eprintln!(
                "signal: saving a checkpoint at the next step boundary, then stopping (again: exit at once)"
            );
            let _ = coord.send_message(CoordinatorMsg::StopRequested);
        })
    };
    let result = rx.await.map_err(|_| anyhow::anyhow!("the coordinator stopped without a result"))?;
    signals.abort();
    let Err(failure) = result else {
        let _ = handle.await;
        return result.map_err(|f| anyhow::anyhow!("{f}"));
    };
    // The coordinator's stop kills its children; a checkpoint write already
    // under way finishes on its own thread, and is waited for: a whole
    // checkpoint is worth it, a hung disk is not.
    let stopped = |a: &ractor::ActorCell| a.get_status() == ractor::ActorStatus::Stopped;
    let all_stopped = async {
        let _ = handle.await;
        while !actors.iter().all(stopped) || !crate::checkpoint::writes_in_flight().is_empty() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    };
    if tokio::time::timeout(shutdown, all_stopped).await.is_err() {
        let mut stuck: Vec<String> = actors
            .iter()
            .chain(std::iter::once(&coord.get_cell()))
            .filter(|a| !stopped(a))
            .map(|a| {
                a.get_name().map_or_else(|| format!("actor {}", a.get_id()), |n| plain_name(&n).to_string())
            })
            .collect();
        stuck.sort();
        for step in crate::checkpoint::writes_in_flight() {
            stuck.push(format!("checkpointer (writing the checkpoint of step {step})"));
        }
        anyhow::bail!(
            "{failure}\n{} did not stop within {} s of the failure (recovery.shutdown_timeout_s); exiting anyway",
            stuck.join(", "),
            shutdown.as_secs_f64()
        );
    }
    anyhow::bail!("{failure}")
}

pub struct Coordinator;

enum Waiting {
    StageDone,
    Applied,
    Eval(EvalKind),
    Snapshots,
    /// Stages are reloading a checkpoint (a rollback).
    Restored,
    /// A rollback waits for checkpoint writes in flight.
    RollbackAfterWrites,
    Weights,
    /// Weights are in; checkpoints still being written.
    Flush,
    Done,
}

pub struct CoordinatorState {
    run_dir: std::path::PathBuf,
    cfg: Config,
    layout: Layout,
    sched: LrSchedule,
    /// The actors this one talks to; empty when replaying the coordinator alone.
    stages: Vec<Vec<ActorRef<StageMsg>>>,
    loaders: Vec<ActorRef<LoaderMsg>>,
    reducer: Option<ActorRef<ReducerMsg>>,
    monitor: Option<ActorRef<MonitorMsg>>,
    eval_set: Option<Arc<EvalSet>>,
    has_val: bool,
    reply: Option<oneshot::Sender<Result<RunOutcome, String>>>,
    step: u64,
    steps: u64,
    waiting: Waiting,
    reports: Vec<StageReport>,
    acks: usize,
    step_started: Instant,
    lr: f64,
    pending: Option<StepMetrics>,
    weights: Vec<Option<Vec<Param>>>,
    tokens_per_step: u64,
    /// (step, tokens trained on by then): where the token count continues
    /// from, so segments resumed with another batch size add up.
    tokens_base: (u64, u64),
    norms: Vec<(usize, f64)>,
    out: RunOutcome,
    checkpointer: Option<ActorRef<super::checkpointer::CheckpointerMsg>>,
    log: Option<ActorLog>,
    /// Set when the run is over (the actor stops; a replay ends).
    stopped: bool,
    snapshots: Vec<Option<(Vec<crate::checkpoint::TensorState>, u64)>>,
    snapshot_started: Instant,
    writes_pending: usize,
    stop_requested: bool,
    /// (loss, grad norm) of recent non-skipped steps, for the spike detector.
    window: std::collections::VecDeque<(f64, f64)>,
    consecutive_skips: usize,
    /// After a rollback, the LR is scaled until this step.
    cooldown_until: u64,
    scaler: Option<crate::optim::scaler::LossScaler>,
    /// The run's trace clock, when tracing: the checkpointer's writes get a track.
    trace_epoch: Option<Instant>,
}

impl Actor for Coordinator {
    type Msg = CoordinatorMsg;
    type State = CoordinatorState;
    type Arguments = (RunInputs, oneshot::Sender<Result<RunOutcome, String>>, u64);

    async fn pre_start(
        &self,
        me: ActorRef<CoordinatorMsg>,
        (inputs, reply, id): Self::Arguments,
    ) -> Result<CoordinatorState, ActorProcessingErr> {
        let RunInputs { run_dir, resume, cfg, layout, data, init, metrics, progress, chaos_seed, cluster } =
            inputs;
        let start_step = resume.as_ref().map_or(0, |r| r.state.step);
        let origin = replay::Origin::new(&cfg, init.as_ref().map(|w| w.path.as_path()), resume.as_deref())?;
        if let Some(a) = &origin.anchor {
            // This run's logs start from that checkpoint: retention must keep it.
            replay::pin(&run_dir, a.step)?;
        }
        let scaler = match resume.as_ref().and_then(|r| r.state.loss_scaler.clone()) {
            Some(s) if cfg.optim.loss_scale == "dynamic" => Some(s),
            _ => crate::optim::scaler::LossScaler::from_config(&cfg.optim),
        };
        let ck_args = super::checkpointer::CheckpointerArgs {
            run_dir: run_dir.clone(),
            keep: cfg.checkpoint.keep,
            keep_every: cfg.checkpoint.keep_every as u64,
            coordinator: me.clone(),
            log: replay::recorder(&cfg, &run_dir, "checkpointer", &origin)?,
        };
        let (checkpointer, _) = Actor::spawn_linked(
            Some(registered("checkpointer", id)),
            super::checkpointer::Checkpointer,
            ck_args,
            me.get_cell(),
        )
        .await?;
        let (pp, dp) = (layout.pp, layout.dp);
        let epoch = cluster.as_ref().map_or_else(Instant::now, |f| *f.epoch.lock().expect("epoch"));
        let all: Arc<OnceLock<Vec<Vec<ActorRef<StageMsg>>>>> = Arc::new(OnceLock::new());
        let monitor_args = MonitorArgs {
            metrics,
            metrics_path: run_dir.join("metrics.jsonl"),
            last_step: 0,
            progress: Progress::new(cfg.train.steps, progress),
        };
        let (monitor, _) =
            Actor::spawn_linked(Some(registered("monitor", id)), Monitor, monitor_args, me.get_cell())
                .await?;
        let reducer = if dp > 1 {
            let log = replay::recorder(&cfg, &run_dir, "reducer", &origin)?;
            let stage_rank = layout.schedule.stage_rank.clone();
            let zero = cfg.parallel.zero == 1;
            let args = ReducerArgs { dp, stages: all.clone(), stage_rank, log, chaos_seed, zero };
            Some(Actor::spawn_linked(Some(registered("reducer", id)), Reducer, args, me.get_cell()).await?.0)
        } else {
            None
        };
        // Pin only when every compute thread can have a core of its own: two busy
        // ranks pinned to one core cannot borrow an idle neighbour.
        let cores = core_affinity::get_core_ids().unwrap_or_default();
        let cores = if layout.threads_per_rank * pp * dp <= cores.len() { cores } else { vec![] };
        // GPU runs: in one process every rank is local; across processes the
        // driver made the plan (and its NCCL ids) when it sent the roster.
        let gpu_plan = match (&cluster, cfg.backend.kind.as_str()) {
            (_, kind) if kind != "cuda" => None,
            (Some(f), _) => f.gpu_plan.get().cloned(),
            (None, _) => Some(Arc::new(
                super::stage::nccl::GpuPlan::make(&layout, |_, _| 0, 0).map_err(|e| format!("NCCL: {e}"))?,
            )),
        };
        let mut stages = Vec::new();
        for replica in 0..dp {
            let peers: Arc<OnceLock<Vec<ActorRef<StageMsg>>>> = Arc::new(OnceLock::new());
            let mut refs = Vec::new();
            for rank in 0..pp {
                if let Some(f) = cluster.as_ref().filter(|f| f.owner(replica, rank) != f.me) {
                    let args = crate::cluster::RemoteStageArgs {
                        fabric: f.clone(),
                        replica,
                        rank,
                        owner: f.owner(replica, rank),
                    };
                    let name = registered(&format!("remote-{}", stage_name(rank, replica)), id);
                    let (r, _) =
                        Actor::spawn_linked(Some(name), crate::cluster::RemoteStage, args, me.get_cell())
                            .await?;
                    refs.push(r);
                    continue;
                }
                let k = replica * pp + rank;
                let t = layout.threads_per_rank;
                let mine = if cores.is_empty() {
                    vec![]
                } else {
                    (0..t).map(|i| cores[(k * t + i) % cores.len()]).collect()
                };
                let args = StageArgs {
                    rank,
                    replica,
                    cfg: cfg.clone(),
                    layout: layout.clone(),
                    init: init.clone(),
                    resume: resume.clone(),
                    links: super::stage::Links::Actors {
                        peers: peers.clone(),
                        coordinator: me.clone(),
                        reducer: reducer.clone(),
                    },
                    log: replay::recorder(&cfg, &run_dir, &stage_name(rank, replica), &origin)?,
                    chaos_seed,
                    cores: mine,
                    latencies_us: Default::default(),
                    trace_epoch: cfg.trace.enabled.then_some(epoch),
                    gpu_plan: gpu_plan.clone(),
                };
                let (r, _) = Actor::spawn_linked(
                    Some(registered(&stage_name(rank, replica), id)),
                    StageActor,
                    args,
                    me.get_cell(),
                )
                .await?;
                refs.push(r);
            }
            let _ = peers.set(refs.clone());
            stages.push(refs);
        }
        let _ = all.set(stages.clone());
        let mut loaders = Vec::new();
        let mut eval_set = None;
        let mut has_val = false;
        for (replica, d) in data.into_iter().enumerate() {
            if replica == 0 {
                eval_set = d.eval_set.clone();
                has_val = d.val.is_some();
            }
            let name = format!("loader-{replica}");
            let log = replay::recorder(&cfg, &run_dir, &name, &origin)?;
            let args = LoaderArgs {
                replica,
                dp,
                microbatches: layout.microbatches,
                micro_batch_size: cfg.train.micro_batch_size,
                block_size: cfg.model.block_size,
                train: d.train,
                val: d.val,
                eval_set: d.eval_set,
                stages: all.clone(),
                first_rank: layout.rank_of(0),
                last_rank: layout.rank_of(layout.last_stage()),
                log,
            };
            loaders.push(
                Actor::spawn_linked(Some(registered(&name, id)), DataLoader, args, me.get_cell()).await?.0,
            );
        }
        if let Some(f) = &cluster {
            let local = stages
                .iter()
                .enumerate()
                .map(|(replica, refs)| {
                    refs.iter()
                        .enumerate()
                        .map(|(rank, r)| (f.owner(replica, rank) == f.me).then(|| r.clone()))
                        .collect()
                })
                .collect();
            f.set_routes(crate::cluster::Routes {
                stages: local,
                coordinator: Some(me.clone()),
                reducer: reducer.clone(),
            });
        }
        let log = replay::recorder(&cfg, &run_dir, "coordinator", &origin)?;
        me.send_message(CoordinatorMsg::Start)?;
        let links =
            Links { stages, loaders, reducer, monitor: Some(monitor), checkpointer: Some(checkpointer) };
        let trace_epoch = cfg.trace.enabled.then_some(epoch);
        let mut st = CoordinatorState::new(
            run_dir,
            cfg,
            layout,
            start_step,
            scaler,
            eval_set,
            has_val,
            links,
            log,
            Some(reply),
        );
        st.trace_epoch = trace_epoch;
        if let Some(r) = &resume {
            st.continue_from(&r.state);
        }
        Ok(st)
    }

    async fn handle(
        &self,
        me: ActorRef<CoordinatorMsg>,
        msg: CoordinatorMsg,
        st: &mut CoordinatorState,
    ) -> Result<(), ActorProcessingErr> {
        // The run's own failure (nothing verifies to roll back to, …) is its
        // result: returned as an actor error it would reach no one.
        if let Err(e) = st.on_message(msg) {
            st.finish(Err(e.to_string()));
            me.stop(None);
            return Ok(());
        }
        if st.stopped {
            me.stop(None);
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        me: ActorRef<CoordinatorMsg>,
        evt: SupervisionEvent,
        st: &mut CoordinatorState,
    ) -> Result<(), ActorProcessingErr> {
        match evt {
            SupervisionEvent::ActorFailed(cell, err) => {
                let name =
                    cell.get_name().map(|n| plain_name(&n).to_string()).unwrap_or_else(|| "an actor".into());
                st.finish(Err(format!("{name} failed at step {}: {err}", st.step)));
                me.stop(None);
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) if !matches!(st.waiting, Waiting::Done) => {
                let name =
                    cell.get_name().map(|n| plain_name(&n).to_string()).unwrap_or_else(|| "an actor".into());
                let why = reason.unwrap_or_else(|| "no reason given".into());
                st.finish(Err(format!("{name} stopped unexpectedly at step {}: {why}", st.step)));
                me.stop(None);
            }
            _ => {}
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<CoordinatorMsg>,
        st: &mut CoordinatorState,
    ) -> Result<(), ActorProcessingErr> {
        st.waiting = Waiting::Done;
        for r in st.stages.iter().flatten() {
            r.stop(None);
        }
        // Wait for them: ractor kills the children still running when this
        // actor exits, and a killed actor's post_stop (which closes its replay
        // log) never runs.
        let wait = Some(std::time::Duration::from_secs(30));
        for l in &st.loaders {
            let _ = l.stop_and_wait(None, wait).await;
        }
        if let Some(r) = &st.reducer {
            let _ = r.stop_and_wait(None, wait).await;
        }
        // Drained, not stopped: the metrics of the steps before a failure
        // (skipped ones included) are still in its mailbox.
        if let Some(m) = &st.monitor {
            let _ = m.drain_and_wait(Some(std::time::Duration::from_secs(30))).await;
        }
        // Writes already handed over finish first: a failed run keeps every
        // checkpoint it reached (a stop would drop the queued ones).
        if let Some(c) = &st.checkpointer {
            let _ = c.drain_and_wait(Some(std::time::Duration::from_secs(300))).await;
        }
        // A completed run closed this log already (`maybe_done`); any other
        // end leaves it without a trailer, so replay sees the run was cut off.
        if let Some(log) = &mut st.log {
            if let Err(e) = log.abandon() {
                eprintln!("{e}");
            }
        }
        st.finish(Err("the run was stopped".into()));
        Ok(())
    }
}

/// The actors the coordinator sends to (all empty when replaying it alone).
pub struct Links {
    pub stages: Vec<Vec<ActorRef<StageMsg>>>,
    pub loaders: Vec<ActorRef<LoaderMsg>>,
    pub reducer: Option<ActorRef<ReducerMsg>>,
    pub monitor: Option<ActorRef<MonitorMsg>>,
    pub checkpointer: Option<ActorRef<super::checkpointer::CheckpointerMsg>>,
}

impl CoordinatorState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        run_dir: std::path::PathBuf,
        cfg: Config,
        layout: Layout,
        start_step: u64,
        scaler: Option<crate::optim::scaler::LossScaler>,
        eval_set: Option<Arc<EvalSet>>,
        has_val: bool,
        links: Links,
        log: Option<ActorLog>,
        reply: Option<oneshot::Sender<Result<RunOutcome, String>>>,
    ) -> CoordinatorState {
        let (pp, dp) = (layout.pp, layout.dp);
        let tokens_per_step =
            (dp * layout.microbatches * cfg.train.micro_batch_size * cfg.model.block_size) as u64;
        CoordinatorState {
            sched: LrSchedule::from_config(&cfg),
            steps: cfg.train.steps as u64,
            weights: vec![None; pp],
            run_dir,
            cfg,
            layout,
            stages: links.stages,
            loaders: links.loaders,
            reducer: links.reducer,
            monitor: links.monitor,
            checkpointer: links.checkpointer,
            log,
            stopped: false,
            eval_set,
            has_val,
            reply,
            step: start_step,
            waiting: Waiting::StageDone,
            reports: Vec::new(),
            acks: 0,
            step_started: Instant::now(),
            lr: 0.0,
            pending: None,
            tokens_per_step,
            tokens_base: (start_step, start_step * tokens_per_step),
            norms: Vec::new(),
            out: RunOutcome::default(),
            snapshots: vec![None; pp],
            snapshot_started: Instant::now(),
            writes_pending: 0,
            stop_requested: false,
            window: Default::default(),
            consecutive_skips: 0,
            cooldown_until: 0,
            scaler,
            trace_epoch: None,
        }
    }

    /// Logs a handled message: gathered messages (one per rank) are logged in
    /// (replica, rank) order when their gather completes, so the log does not
    /// depend on the order they arrived in.
    fn log_handled(&mut self, msg: &CoordinatorMsg) {
        let last = self.layout.rank_of(self.layout.last_stage());
        let Some(log) = &mut self.log else { return };
        let sender =
            |rank: usize, replica: usize, step: u64| (stage_name(rank, replica), step, replica, Some(rank));
        let (from, step, replica, rank) = match msg {
            CoordinatorMsg::Start => ("coordinator".to_string(), self.step, 0, None),
            CoordinatorMsg::StageDone(r) => sender(r.rank, r.replica, r.step),
            CoordinatorMsg::Applied { rank, replica, step } => sender(*rank, *replica, *step),
            CoordinatorMsg::Restored { rank, replica } | CoordinatorMsg::Weights { rank, replica, .. } => {
                sender(*rank, *replica, self.step)
            }
            CoordinatorMsg::Snapshot { rank, step, .. } => sender(*rank, 0, *step),
            CoordinatorMsg::EvalDone { step, .. } => (stage_name(last, 0), *step, 0, None),
            // Their timing is the point, not their content: left out (see crate::replay).
            CoordinatorMsg::Saved { .. }
            | CoordinatorMsg::CheckpointFailed(_)
            | CoordinatorMsg::StopRequested
            | CoordinatorMsg::Failed(_) => return,
        };
        let (kind, blobs) = msg.logged(log.payloads(), false);
        let mut e = replay::entry(&from, kind, step, replica).with_inputs(blobs);
        e.stage = rank.map(|r| r as u64);
        match msg {
            CoordinatorMsg::Start => log.begin(e),
            CoordinatorMsg::EvalDone { .. } => log.begin(e.with_eval(true)),
            _ => log.gather(e),
        }
    }

    fn gather_done(&mut self) {
        if let Some(log) = &mut self.log {
            log.gather_done();
        }
    }

    /// Handles one message; sets `stopped` when the run is over.
    pub fn on_message(&mut self, msg: CoordinatorMsg) -> Result<(), ActorProcessingErr> {
        self.log_handled(&msg);
        let st = self;
        match msg {
            CoordinatorMsg::Start => st.begin_step(),
            CoordinatorMsg::StageDone(r) => {
                check(matches!(st.waiting, Waiting::StageDone) && r.step == st.step, "unexpected StageDone")?;
                st.reports.push(r);
                if st.reports.len() == st.layout.pp * st.layout.dp {
                    st.gather_done();
                    st.decide_update()?;
                }
                Ok(())
            }
            CoordinatorMsg::Applied { step, .. } => {
                check(matches!(st.waiting, Waiting::Applied) && step == st.step, "unexpected Applied")?;
                st.acks += 1;
                if st.acks == st.layout.pp * st.layout.dp {
                    st.gather_done();
                    st.step_applied()?;
                }
                Ok(())
            }
            CoordinatorMsg::EvalDone { step, kind, loss_sum, tokens, predictions } => {
                check(step == st.step, "evaluation of another step")?;
                st.eval_done(kind, loss_sum, tokens, predictions)
            }
            CoordinatorMsg::Weights { rank, replica, params, latencies_us, peak_live_bytes, trace } => {
                check(matches!(st.waiting, Waiting::Weights), "unexpected Weights")?;
                // Every replica reports (its trace records); replica 0's weights stand for all.
                st.out.trace.extend(trace);
                st.out.message_latency_us.extend(latencies_us);
                if replica == 0 {
                    st.weights[rank] = Some(params);
                    if st.out.peak_live_bytes.len() <= rank {
                        st.out.peak_live_bytes.resize(rank + 1, 0);
                    }
                    st.out.peak_live_bytes[rank] = peak_live_bytes;
                }
                st.acks += 1;
                if st.acks == st.layout.pp * st.layout.dp {
                    st.gather_done();
                    st.out.params = st.weights.iter_mut().flat_map(|w| w.take().unwrap()).collect();
                    st.waiting = Waiting::Flush;
                    st.maybe_done();
                }
                Ok(())
            }
            CoordinatorMsg::Snapshot { rank, step, tensors, adam_step } => {
                check(matches!(st.waiting, Waiting::Snapshots) && step == st.step, "unexpected Snapshot")?;
                st.snapshots[rank] = Some((tensors, adam_step));
                if st.snapshots.iter().all(Option::is_some) {
                    st.gather_done();
                    st.snapshots_done()?;
                }
                Ok(())
            }
            CoordinatorMsg::Saved { step, ms, path } => {
                st.trace_write(step, ms, &path);
                st.writes_pending -= 1;
                st.out.checkpoint_write_ms.push(ms);
                st.out.checkpoints.push(path);
                if matches!(st.waiting, Waiting::RollbackAfterWrites) && st.writes_pending == 0 {
                    return st.roll_back();
                }
                st.maybe_done();
                Ok(())
            }
            CoordinatorMsg::CheckpointFailed(e) => {
                st.finish(Err(e));
                st.stopped = true;
                Ok(())
            }
            CoordinatorMsg::Restored { .. } => {
                check(matches!(st.waiting, Waiting::Restored), "unexpected Restored")?;
                st.acks += 1;
                if st.acks == st.layout.pp * st.layout.dp {
                    st.gather_done();
                    st.begin_step()?;
                }
                Ok(())
            }
            CoordinatorMsg::StopRequested => {
                st.stop_requested = true;
                Ok(())
            }
            CoordinatorMsg::Failed(f) => {
                st.finish(Err(f.to_string()));
                st.stopped = true;
                Ok(())
            }
        }
    }

    /// Begins the first step without logging it: a replay that starts from a
    /// checkpoint skips the recorded entries before the step's first report.
    pub fn start_unlogged(&mut self) -> Result<(), ActorProcessingErr> {
        let log = self.log.take();
        let r = self.begin_step();
        self.log = log;
        r
    }

    /// The replay log, closed (during a replay it holds the checker).
    pub fn take_log(&mut self) -> Option<ActorLog> {
        self.log.take()
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    fn log_sent(&mut self, to: &str, kind: &str, blobs: impl FnOnce() -> Vec<Blob>) {
        if let Some(log) = &mut self.log {
            log.sent(to, kind, None, blobs());
        }
    }

    fn send_stage(&mut self, replica: usize, rank: usize, msg: StageMsg) -> Result<(), ActorProcessingErr> {
        if self.log.is_some() {
            let logged = msg.logged(false, &super::protocol::no_grad_names);
            self.log_sent(&stage_name(rank, replica), logged.kind, || logged.blobs);
        }
        if let Some(r) = self.stages.get(replica).and_then(|v| v.get(rank)) {
            r.send_message(msg)?;
        }
        Ok(())
    }

    /// Sends `msg()` to every stage of replicas `0..replicas`, in (replica, rank) order.
    fn send_stages(&mut self, replicas: usize, msg: impl Fn() -> StageMsg) -> Result<(), ActorProcessingErr> {
        for replica in 0..replicas {
            for rank in 0..self.layout.pp {
                self.send_stage(replica, rank, msg())?;
            }
        }
        Ok(())
    }

    fn send_loader(&mut self, replica: usize, msg: LoaderMsg) -> Result<(), ActorProcessingErr> {
        let (kind, blobs) = match &msg {
            LoaderMsg::Train { .. } => ("Train", vec![]),
            LoaderMsg::Eval { kind, batches, .. } => (
                "Eval",
                vec![
                    Blob::str(super::protocol::key::EVAL_KIND, kind.name()),
                    Blob::f64(super::protocol::key::BATCHES, *batches as f64),
                ],
            ),
        };
        self.log_sent(&format!("loader-{replica}"), kind, || blobs);
        if let Some(l) = self.loaders.get(replica) {
            l.send_message(msg)?;
        }
        Ok(())
    }

    fn send_monitor(&mut self, msg: MonitorMsg) -> Result<(), ActorProcessingErr> {
        if self.log.is_some() {
            let (kind, blobs) = match &msg {
                MonitorMsg::Step(m) => ("Step", metrics_blobs(m)),
                MonitorMsg::Finish => ("Finish", vec![]),
            };
            self.log_sent("monitor", kind, || blobs);
        }
        if let Some(m) = &self.monitor {
            m.send_message(msg)?;
        }
        Ok(())
    }
}

/// The deterministic fields of a step's metrics (no timings).
fn metrics_blobs(m: &StepMetrics) -> Vec<Blob> {
    let mut b = vec![
        Blob::f64("step", m.step as f64),
        Blob::f64("loss", m.loss),
        Blob::f64("lr", m.lr),
        Blob::f64("grad_norm", m.grad_norm),
        Blob::f64("skipped", m.skipped as u8 as f64),
    ];
    for (name, v) in [("val_loss", m.val_loss), ("exact_match", m.exact_match), ("loss_scale", m.loss_scale)]
    {
        if let Some(v) = v {
            b.push(Blob::f64(name, v));
        }
    }
    b
}

fn check(ok: bool, what: &str) -> Result<(), ActorProcessingErr> {
    if ok {
        Ok(())
    } else {
        Err(format!("coordinator: {what}").into())
    }
}

impl CoordinatorState {
    /// The checkpointer's background write of `step`, which just took `ms`, as a
    /// span on a track of its own.
    fn trace_write(&mut self, step: u64, ms: f64, path: &std::path::Path) {
        let Some(epoch) = self.trace_epoch else { return };
        let end = epoch.elapsed().as_secs_f64() * 1e6;
        self.out.trace.push(crate::trace::Record {
            name: "checkpoint write".into(),
            step,
            start_us: end - ms * 1e3,
            dur_us: ms * 1e3,
            detail: Some(path.display().to_string()),
            actor: Some("checkpointer".into()),
            ..Default::default()
        });
    }

    /// Ends the run once the weights are in and every checkpoint is on disk.
    fn maybe_done(&mut self) {
        if matches!(self.waiting, Waiting::Flush) && self.writes_pending == 0 {
            self.waiting = Waiting::Done;
            self.out.steps_done = self.step;
            let _ = self.send_monitor(MonitorMsg::Finish);
            if let Some(log) = &mut self.log {
                if let Err(e) = log.finish() {
                    self.stopped = true;
                    return self.finish(Err(e));
                }
            }
            self.finish(Ok(()));
            self.stopped = true;
        }
    }

    /// Every stage's copy is in: hand them to the checkpointer and go on.
    fn snapshots_done(&mut self) -> Result<(), ActorProcessingErr> {
        let mut tensors = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        let mut adam_step = 0;
        for s in self.snapshots.iter_mut() {
            let (ts, t) = s.take().expect("snapshot");
            adam_step = t;
            for tensor in ts {
                // The head's copy of the tied wte equals the embedding's; keep one.
                if seen.insert(tensor.name.clone()) {
                    tensors.push(tensor);
                }
            }
        }
        self.out.checkpoint_pause_ms.push(self.snapshot_started.elapsed().as_secs_f64() * 1e3);
        // Replica r of step s reads from global microbatch (s·dp + r)·m (see data_loader).
        let (dp, m) = (self.layout.dp as u64, self.layout.microbatches as u64);
        let b = self.cfg.train.micro_batch_size as u64;
        let state = crate::checkpoint::StateFile {
            format_version: crate::checkpoint::FORMAT_VERSION,
            step: self.step,
            adam_step,
            tokens: self.tokens_seen(),
            skipped_steps: self.out.skipped,
            data_cursor: self.step * dp * m * b,
            data_cursors: (0..dp).map(|r| (self.step * dp + r) * m * b).collect(),
            rng: crate::checkpoint::RngState {
                seed: self.cfg.train.seed,
                step: self.step,
                note: crate::checkpoint::RNG_NOTE.into(),
            },
            lr_schedule: self.lr_position(),
            config: self.cfg.to_toml_string(),
            config_hash: self.cfg.hash(),
            digests: Default::default(),
            loss_scaler: self.scaler.clone(),
        };
        self.writes_pending += 1;
        if self.log.is_some() {
            let blobs = vec![
                Blob::f64("step", state.step as f64),
                Blob::f64("adam_step", state.adam_step as f64),
                Blob::f64("tokens", state.tokens as f64),
                Blob::f64("data_cursor", state.data_cursor as f64),
                Blob::f64("next_lr", state.lr_schedule.next_lr),
            ];
            self.log_sent("checkpointer", "Write", || blobs);
        }
        match &self.checkpointer {
            Some(c) => c.send_message(super::checkpointer::CheckpointerMsg::Write { tensors, state })?,
            // Replaying alone: nothing is written, and the write counts as done.
            None => self.writes_pending -= 1,
        }
        if self.stop_requested {
            self.out.stopped_early = self.step < self.steps;
            self.steps = self.step;
        }
        self.begin_step()
    }

    /// Takes up a resumed run's counters where its checkpoint left them.
    pub fn continue_from(&mut self, state: &crate::checkpoint::StateFile) {
        self.tokens_base = (state.step, state.tokens);
        self.cooldown_until = state.lr_schedule.cooldown_until;
    }

    /// Tokens trained on before the current step.
    fn tokens_seen(&self) -> u64 {
        self.tokens_base.1 + (self.step - self.tokens_base.0) * self.tokens_per_step
    }

    /// The learning rate of 0-based `step`, a rollback's cooldown included.
    fn lr_of(&self, step: u64) -> f64 {
        let lr = self.sched.lr(step as usize);
        if step < self.cooldown_until {
            lr * self.cfg.recovery.lr_factor
        } else {
            lr
        }
    }

    fn lr_position(&self) -> crate::checkpoint::LrPosition {
        let (decay_start, decay_end) = self.sched.decay_bounds();
        crate::checkpoint::LrPosition {
            kind: self.cfg.optim.schedule.clone(),
            step: self.step,
            warmup_steps: self.sched.warmup_steps as u64,
            decay_start: decay_start as u64,
            decay_end: decay_end as u64,
            lr: self.sched.lr,
            min_lr: self.sched.min_lr,
            next_lr: self.lr_of(self.step),
            cooldown_until: self.cooldown_until,
            cooldown_factor: self.cfg.recovery.lr_factor,
        }
    }

    fn finish(&mut self, result: Result<(), String>) {
        if let Some(reply) = self.reply.take() {
            let out = std::mem::take(&mut self.out);
            let _ = reply.send(result.map(|_| out));
        }
    }

    fn begin_step(&mut self) -> Result<(), ActorProcessingErr> {
        if self.step == self.steps {
            self.waiting = Waiting::Weights;
            self.acks = 0;
            return self.send_stages(self.layout.dp, || StageMsg::SendWeights);
        }
        self.step_started = Instant::now();
        self.lr = self.lr_of(self.step);
        self.waiting = Waiting::StageDone;
        self.reports.clear();
        let step = self.step;
        for r in 0..self.layout.dp {
            self.send_loader(r, LoaderMsg::Train { step })?;
        }
        let loss_scale = self.scaler.as_ref().map_or(1.0, |sc| sc.scale as f32);
        self.send_stages(self.layout.dp, || StageMsg::RunStep { step, loss_scale })
    }

    /// Global norm in canonical tensor order, loss in replica order; clip or skip.
    fn decide_update(&mut self) -> Result<(), ActorProcessingErr> {
        self.reports.sort_by_key(|r| (r.replica, r.rank));
        self.norms.clear();
        for r in &self.reports {
            self.norms.extend_from_slice(&r.grad_sumsq);
        }
        // With loss scaling the gradients are `scale` times the true ones; the
        // scale is a power of two, so dividing it out is exact.
        let scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        let grad_norm = optim::global_norm(&mut self.norms) / scale;
        let loss_sum: f64 = self.reports.iter().filter_map(|r| r.loss_sum).sum();
        let loss = loss_sum / self.tokens_per_step as f64;
        let mut skip = !loss.is_finite() || !grad_norm.is_finite();
        let overflow = self.scaler.is_some() && loss.is_finite() && !grad_norm.is_finite();
        let mut alert = None;
        if overflow {
            alert =
                Some(format!("gradients overflowed at loss scale {scale}: update skipped, scale backs off"));
        } else if skip {
            alert = Some(format!("non-finite loss ({loss}) or gradient norm ({grad_norm}): update skipped"));
        } else if let Some(a) = self.spike(loss, grad_norm) {
            skip = self.cfg.recovery.spike_skip;
            alert = Some(if skip { format!("{a}; update skipped") } else { a });
        }
        if let Some(a) = &alert {
            eprintln!("step {}: {a}", self.step + 1);
        }
        if let Some(sc) = &mut self.scaler {
            sc.update(overflow);
        }
        if skip && !overflow {
            self.consecutive_skips += 1;
        } else if !skip {
            self.consecutive_skips = 0;
            self.window.push_back((loss, grad_norm));
            if self.window.len() > self.cfg.recovery.spike_window {
                self.window.pop_front();
            }
        }
        // AdamW multiplies each gradient by this: the clip factor, unscaled.
        let clip = optim::clip_coefficient(grad_norm, self.cfg.optim.grad_clip) / scale as f32;
        self.waiting = Waiting::Applied;
        self.acks = 0;
        let (step, lr) = (self.step, self.lr);
        self.send_stages(self.layout.dp, || StageMsg::Apply { step, lr, clip, skip })?;
        self.pending = Some(StepMetrics {
            step: step as usize + 1,
            loss,
            lr,
            grad_norm,
            tokens: 0,
            tokens_per_s: 0.0,
            ms: 0.0,
            skipped: skip,
            val_loss: None,
            exact_match: None,
            alert,
            loss_scale: self.scaler.is_some().then_some(scale),
            repeated: false,
        });
        Ok(())
    }

    /// A loss above spike_factor × the window's mean, or a gradient norm
    /// spike_zscore deviations above its mean, over the last non-skipped steps.
    fn spike(&self, loss: f64, grad_norm: f64) -> Option<String> {
        let r = &self.cfg.recovery;
        let n = self.window.len();
        if n < r.spike_window.min(10) || !loss.is_finite() || !grad_norm.is_finite() {
            return None;
        }
        let mean_loss = self.window.iter().map(|w| w.0).sum::<f64>() / n as f64;
        if r.spike_factor > 0.0 && loss > r.spike_factor * mean_loss {
            return Some(format!("loss spike: {loss:.4} > {} × rolling mean {mean_loss:.4}", r.spike_factor));
        }
        if r.spike_zscore > 0.0 {
            let mean = self.window.iter().map(|w| w.1).sum::<f64>() / n as f64;
            let var = self.window.iter().map(|w| (w.1 - mean).powi(2)).sum::<f64>() / n as f64;
            let z = (grad_norm - mean) / var.sqrt().max(1e-12);
            if z > r.spike_zscore {
                return Some(format!(
                    "gradient-norm spike: {grad_norm:.4} is {z:.1} σ above the rolling mean {mean:.4}"
                ));
            }
        }
        None
    }

    fn step_applied(&mut self) -> Result<(), ActorProcessingErr> {
        let dt = self.step_started.elapsed().as_secs_f64();
        self.out.train_seconds += dt;
        let done = self.step + 1;
        self.out.tokens = self.tokens_seen() + self.tokens_per_step;
        self.out.tokens_this_run += self.tokens_per_step;
        let m = self.pending.as_mut().expect("metrics of this step");
        m.ms = dt * 1e3;
        m.tokens = self.out.tokens;
        m.tokens_per_s = self.out.tokens_this_run as f64 / self.out.train_seconds;
        self.out.skipped += m.skipped as usize;
        self.out.losses.push(m.loss);
        self.out.train_curve.push((done as usize, m.loss));
        let every = self.cfg.train.eval_every as u64;
        let simulated = self.cfg.backend.kind == "sim";
        let due = !simulated && ((every > 0 && done.is_multiple_of(every)) || done == self.steps);
        if due && self.has_val {
            self.start_eval(EvalKind::Val)
        } else if due && self.eval_set.is_some() {
            self.start_eval(EvalKind::ExactMatch)
        } else {
            self.end_step()
        }
    }

    fn start_eval(&mut self, kind: EvalKind) -> Result<(), ActorProcessingErr> {
        let b = self.cfg.train.micro_batch_size;
        let n = b * self.cfg.model.block_size;
        let batches = match kind {
            EvalKind::Val => self.cfg.train.eval_batches,
            EvalKind::ExactMatch => self.eval_set.as_ref().map_or(0, |s| s.inputs().len() / n),
        };
        self.waiting = Waiting::Eval(kind);
        let step = self.step;
        self.send_loader(0, LoaderMsg::Eval { step, kind, batches })?;
        self.send_stages(1, || StageMsg::RunEval { step, kind, batches })
    }

    fn eval_done(
        &mut self,
        kind: EvalKind,
        loss_sum: f64,
        tokens: usize,
        predictions: Vec<u32>,
    ) -> Result<(), ActorProcessingErr> {
        check(matches!(self.waiting, Waiting::Eval(k) if k == kind), "unexpected EvalDone")?;
        let done = self.step as usize + 1;
        match kind {
            EvalKind::Val => {
                let v = loss_sum / tokens.max(1) as f64;
                self.pending.as_mut().expect("metrics").val_loss = Some(v);
                self.out.val_curve.push((done, v));
                self.out.last_val = Some(v);
                if self.eval_set.is_some() {
                    return self.start_eval(EvalKind::ExactMatch);
                }
            }
            EvalKind::ExactMatch => {
                let set = self.eval_set.as_ref().expect("held-out set");
                let (correct, total) = set.exact_match(&predictions);
                let em = correct as f64 / total.max(1) as f64;
                self.pending.as_mut().expect("metrics").exact_match = Some(em);
                self.out.last_exact_match = Some(em);
            }
        }
        self.end_step()
    }

    /// Too many skipped steps in a row: every stage reloads the latest
    /// checkpoint and training continues from it with a reduced learning rate.
    fn roll_back(&mut self) -> Result<(), ActorProcessingErr> {
        if self.writes_pending > 0 {
            // The newest checkpoint is still being written: roll back once it is on disk.
            self.waiting = Waiting::RollbackAfterWrites;
            return Ok(());
        }
        let root = crate::checkpoint::checkpoints_dir(&self.run_dir);
        let (loaded, damaged) = crate::checkpoint::newest_verified(&root).map_err(|e| e.to_string())?;
        for (dir, e) in &damaged {
            eprintln!("warning: checkpoint {} is damaged ({e}); rolling back past it", dir.display());
            // A replay only reads the run directory.
            if self.checkpointer.is_some() {
                let kept = crate::checkpoint::set_aside(dir).map_err(|e| e.to_string())?;
                eprintln!("the damaged checkpoint is kept as {} (never deleted)", kept.display());
            }
        }
        let Some(loaded) = loaded else {
            return Err(format!(
                "{} consecutive steps skipped (last: step {}) and no checkpoint in {} verifies to roll back to",
                self.consecutive_skips,
                self.step,
                root.display()
            )
            .into());
        };
        let (ck_step, dir) = (loaded.state.step, loaded.dir.clone());
        self.tokens_base = (ck_step, loaded.state.tokens);
        let loaded = Arc::new(loaded);
        eprintln!(
            "{} consecutive steps skipped: rolling back to {} and scaling the learning rate by {} for {} steps",
            self.consecutive_skips,
            dir.display(),
            self.cfg.recovery.lr_factor,
            self.cfg.recovery.cooldown_steps
        );
        self.out.rollbacks += 1;
        self.consecutive_skips = 0;
        self.window.clear();
        self.step = ck_step;
        self.cooldown_until = ck_step + self.cfg.recovery.cooldown_steps as u64;
        self.waiting = Waiting::Restored;
        self.acks = 0;
        self.send_stages(self.layout.dp, || StageMsg::Restore(loaded.clone()))
    }

    fn end_step(&mut self) -> Result<(), ActorProcessingErr> {
        if let Some(m) = self.pending.take() {
            self.send_monitor(MonitorMsg::Step(m))?;
        }
        self.step += 1;
        let max = self.cfg.recovery.max_skips;
        if max > 0 && self.consecutive_skips >= max {
            return self.roll_back();
        }
        let every = self.cfg.checkpoint.every as u64;
        let due = (every > 0 && self.step.is_multiple_of(every)) || self.stop_requested;
        if due && self.cfg.backend.kind != "sim" {
            self.waiting = Waiting::Snapshots;
            self.snapshot_started = Instant::now();
            let step = self.step;
            // Under ZeRO-1 every replica holds a shard of the moments: all take part.
            let replicas = if self.cfg.parallel.zero == 1 { self.layout.dp } else { 1 };
            return self.send_stages(replicas, || StageMsg::Snapshot { step });
        }
        if self.stop_requested {
            self.out.stopped_early = self.step < self.steps;
            self.steps = self.step;
        }
        self.begin_step()
    }
}
