//! The coordinator: parent of every actor in a run and owner of the step loop.
//!
//! For each optimizer step it tells the loaders to feed and the stages to walk
//! their action lists, gathers each rank's per-tensor squared gradient norms and
//! loss sums, sums them in a fixed order (canonical tensor order; replica order),
//! decides the clip factor — or skips the update if anything is non-finite —
//! and tells every stage to apply AdamW. Evaluations run between steps. A
//! failure anywhere (a stage's error or panic, an actor dying) ends the run
//! with an error naming the actor, step and microbatch; nothing waits forever.
//!
//! This file is the step state machine ([`CoordinatorState`], no I/O but its
//! sends), driven by ractor and by replay alike. Beside it: `actor` (the
//! ractor shell), `run` (a whole run's inputs, outcome and shutdown),
//! `recovery` (skip/spike verdicts and the roll-back rule, pure), `assembly`
//! (snapshots into what the checkpointer writes, pure) and `outbox` (every
//! send and its replay-log form). Spawning lives in `actors::topology`.

mod actor;
mod assembly;
mod outbox;
mod recovery;
mod run;

pub use actor::Coordinator;
pub use outbox::Links;
pub use run::{run, RunData, RunInputs, RunOutcome};

use super::layout::Layout;
use super::protocol::{Checkpoint, CheckpointerMsg, LoaderMsg, MonitorMsg, ReducerMsg};
use crate::config::{BackendKind, Config};
use crate::data::EvalSet;
use crate::metrics::StepMetrics;
use crate::model::Param;
use crate::optim::{self, scaler::LossScaler, LrSchedule};
use crate::replay::ActorLog;
use ractor::{ActorProcessingErr, ActorRef};
use recovery::{Recovery, Verdict};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

pub use super::protocol::{stage_name, CoordinatorMsg, EvalKind, Failure, StageMsg, StageReport};

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
    /// (step, tokens trained on by then): where the token count continues
    /// from, so segments resumed with another batch size add up.
    tokens_base: (u64, u64),
    norms: Vec<(usize, f64)>,
    out: RunOutcome,
    checkpointer: Option<ActorRef<CheckpointerMsg>>,
    log: Option<ActorLog>,
    /// Set when the run is over (the actor stops; a replay ends).
    stopped: bool,
    /// A symptom of a failure is on its way (`CoordinatorMsg::Symptom`): only
    /// failure reports are handled until it arrives.
    failing: bool,
    snapshots: Vec<Option<assembly::Snapshot>>,
    /// Replica 0's EMA of the weights at the end, by rank (empty when none is kept).
    ema_weights: Vec<Option<Vec<Param>>>,
    snapshot_started: Instant,
    writes_pending: usize,
    stop_requested: bool,
    recovery: Recovery,
    scaler: Option<LossScaler>,
    /// The run's trace, when tracing: the checkpointer's writes get a track.
    trace: Option<crate::trace::RunTrace>,
}

impl CoordinatorState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        run_dir: std::path::PathBuf,
        cfg: Config,
        layout: Layout,
        start_step: u64,
        scaler: Option<LossScaler>,
        eval_set: Option<Arc<EvalSet>>,
        has_val: bool,
        links: Links,
        log: Option<ActorLog>,
        reply: Option<oneshot::Sender<Result<RunOutcome, String>>>,
    ) -> CoordinatorState {
        let pp = layout.pp;
        let tokens_base = (start_step, layout.batches.tokens_before(start_step));
        CoordinatorState {
            sched: LrSchedule::from_config(&cfg),
            recovery: Recovery::new(&cfg.recovery),
            steps: cfg.train.steps as u64,
            weights: vec![None; pp],
            ema_weights: vec![None; pp],
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
            failing: false,
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
            tokens_base,
            norms: Vec::new(),
            out: RunOutcome::default(),
            snapshots: vec![None; pp],
            snapshot_started: Instant::now(),
            writes_pending: 0,
            stop_requested: false,
            scaler,
            trace: None,
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
            CoordinatorMsg::Weights {
                rank,
                replica,
                params,
                ema,
                latencies_us,
                peak_live_bytes,
                peak_state_bytes,
                trace,
            } => {
                check(matches!(st.waiting, Waiting::Weights), "unexpected Weights")?;
                // Every replica reports (its trace records); replica 0's weights stand for all.
                st.out.trace.extend(trace);
                st.out.message_latency_us.extend(latencies_us);
                // Replicas' shards differ in size: the largest per rank.
                if st.out.peak_state_bytes.len() <= rank {
                    st.out.peak_state_bytes.resize(rank + 1, 0);
                }
                st.out.peak_state_bytes[rank] = st.out.peak_state_bytes[rank].max(peak_state_bytes);
                if replica == 0 {
                    // The EMA comes as values in the order of the parameters.
                    let ema = params.iter().zip(ema).map(|(p, data)| Param {
                        name: p.name.clone(),
                        shape: p.shape.clone(),
                        data,
                        grad: vec![],
                        canonical: p.canonical,
                    });
                    st.ema_weights[rank] = Some(ema.collect());
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
                    st.out.ema_params = st.ema_weights.iter_mut().flat_map(|w| w.take().unwrap()).collect();
                    st.waiting = Waiting::Flush;
                    st.maybe_done();
                }
                Ok(())
            }
            CoordinatorMsg::Snapshot { rank, step, tensors, adam_step, ema_updates } => {
                check(matches!(st.waiting, Waiting::Snapshots) && step == st.step, "unexpected Snapshot")?;
                st.snapshots[rank] = Some((tensors, adam_step, ema_updates));
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
            CoordinatorMsg::Symptom(why) => {
                st.finish(Err(why));
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
        let Some(run) = &self.trace else { return };
        // The write was timed by the checkpointer and has just ended.
        let dur_us = ms * 1e3;
        let at_us = run.us_of(Instant::now()) - dur_us;
        let detail = path.display().to_string();
        tracing::trace!(target: crate::trace::layer::TARGET, run = run.id(), actor = "checkpointer",
            kind = "checkpoint write", step, at_us, dur_us, detail = detail.as_str());
    }

    /// Ends the run once the weights are in and every checkpoint is on disk.
    fn maybe_done(&mut self) {
        if matches!(self.waiting, Waiting::Flush) && self.writes_pending == 0 {
            self.waiting = Waiting::Done;
            self.out.steps_done = self.step;
            if let Some(run) = &self.trace {
                self.out.trace.extend(run.take(|r| r.actor.is_some()));
            }
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
        let snapshots = self.snapshots.iter_mut().map(|s| s.take().expect("snapshot"));
        let (tensors, adam_step, ema_updates) = assembly::merge(snapshots);
        self.out.checkpoint_pause_ms.push(self.snapshot_started.elapsed().as_secs_f64() * 1e3);
        let state = assembly::state_file(assembly::RunPosition {
            cfg: &self.cfg,
            sched: &self.sched,
            step: self.step,
            adam_step,
            tokens: self.tokens_seen(),
            skipped_steps: self.out.skipped,
            next_lr: self.lr_of(self.step),
            cooldown_until: self.recovery.cooldown_until(),
            dp: self.layout.dp,
            batches: &self.layout.batches,
            loss_scaler: self.scaler.clone(),
            ema_updates,
        });
        self.writes_pending += 1;
        if self.log.is_some() {
            let blobs = assembly::logged(&state);
            self.log_sent("checkpointer", "Write", || blobs);
        }
        match &self.checkpointer {
            Some(c) => c.send_message(CheckpointerMsg::Write { tensors, state })?,
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
        self.recovery.continue_cooldown(state.lr_schedule.cooldown_until);
    }

    /// Tokens trained on before the current step.
    fn tokens_seen(&self) -> u64 {
        let b = &self.layout.batches;
        self.tokens_base.1 + b.tokens_before(self.step) - b.tokens_before(self.tokens_base.0)
    }

    /// Tokens in the current step (a batch ramp changes them).
    fn step_tokens(&self) -> u64 {
        self.layout.batches.tokens(self.step)
    }

    /// The learning rate of 0-based `step`, a rollback's cooldown included.
    fn lr_of(&self, step: u64) -> f64 {
        let at = self.layout.batches.lr_position(step, self.cfg.train.steps as u64);
        self.recovery.lr(self.sched.lr_at(at), step)
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
        let loss = loss_sum / self.step_tokens() as f64;
        let Verdict { skip, overflow, alert } =
            self.recovery.judge(loss, grad_norm, self.scaler.as_ref().map(|_| scale));
        if let Some(a) = &alert {
            tracing::warn!("step {}: {a}", self.step + 1);
        }
        if let Some(sc) = &mut self.scaler {
            sc.update(overflow);
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
            source_tokens: None,
        });
        Ok(())
    }

    fn step_applied(&mut self) -> Result<(), ActorProcessingErr> {
        let dt = self.step_started.elapsed().as_secs_f64();
        self.out.train_seconds += dt;
        let done = self.step + 1;
        self.out.tokens = self.tokens_seen() + self.step_tokens();
        self.out.tokens_this_run += self.step_tokens();
        let m = self.pending.as_mut().expect("metrics of this step");
        m.ms = dt * 1e3;
        m.tokens = self.out.tokens;
        m.source_tokens = crate::data::mixture::source_tokens(&self.cfg, self.out.tokens);
        m.tokens_per_s = self.out.tokens_this_run as f64 / self.out.train_seconds;
        self.out.skipped += m.skipped as usize;
        self.out.losses.push(m.loss);
        self.out.train_curve.push((done as usize, m.loss));
        let every = self.cfg.train.eval_every as u64;
        let simulated = self.cfg.backend.kind == BackendKind::Sim;
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
        if self.cfg.parallel.zero < 3 {
            return self.send_stages(1, || StageMsg::RunEval { step, kind, batches });
        }
        // ZeRO-3: the other replicas hold shards of the weights replica 0
        // evaluates with, so they take part in its gathers, with no batches.
        for replica in 0..self.layout.dp {
            let batches = if replica == 0 { batches } else { 0 };
            for rank in 0..self.layout.pp {
                self.send_stage(replica, rank, StageMsg::RunEval { step, kind, batches })?;
            }
        }
        Ok(())
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
            tracing::warn!("warning: checkpoint {} is damaged ({e}); rolling back past it", dir.display());
            // A replay only reads the run directory.
            if self.checkpointer.is_some() {
                let kept = crate::checkpoint::set_aside(dir).map_err(|e| e.to_string())?;
                tracing::warn!("the damaged checkpoint is kept as {} (never deleted)", kept.display());
            }
        }
        let Some(loaded) = loaded else {
            return Err(format!(
                "{} consecutive steps skipped (last: step {}) and no checkpoint in {} verifies to roll back to",
                self.recovery.consecutive_skips(),
                self.step,
                root.display()
            )
            .into());
        };
        let (ck_step, dir) = (loaded.state.step, loaded.dir.clone());
        self.tokens_base = (ck_step, loaded.state.tokens);
        let loaded = Arc::new(loaded);
        tracing::warn!(
            "{} consecutive steps skipped: rolling back to {} and scaling the learning rate by {} for {} steps",
            self.recovery.consecutive_skips(),
            dir.display(),
            self.cfg.recovery.lr_factor,
            self.cfg.recovery.cooldown_steps
        );
        self.out.rollbacks += 1;
        self.recovery.rolled_back_to(ck_step);
        self.step = ck_step;
        self.waiting = Waiting::Restored;
        self.acks = 0;
        self.send_stages(self.layout.dp, || StageMsg::Restore(Checkpoint::new(loaded.clone())))
    }

    fn end_step(&mut self) -> Result<(), ActorProcessingErr> {
        if let Some(m) = self.pending.take() {
            self.send_monitor(MonitorMsg::Step(m))?;
        }
        self.step += 1;
        if self.recovery.roll_back_due() {
            return self.roll_back();
        }
        let every = self.cfg.checkpoint.every as u64;
        let due = (every > 0 && self.step.is_multiple_of(every)) || self.stop_requested;
        if due && self.cfg.backend.kind != BackendKind::Sim {
            self.waiting = Waiting::Snapshots;
            self.snapshot_started = Instant::now();
            let step = self.step;
            // Under ZeRO every replica holds a shard of the moments: all take part.
            let replicas = if self.cfg.parallel.zero >= 1 { self.layout.dp } else { 1 };
            return self.send_stages(replicas, || StageMsg::Snapshot { step });
        }
        if self.stop_requested {
            self.out.stopped_early = self.step < self.steps;
            self.steps = self.step;
        }
        self.begin_step()
    }
}
