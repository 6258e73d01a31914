//! The coordinator's actor shell: spawning the run under it (through
//! `actors::topology`), feeding its messages to [`CoordinatorState`], turning
//! a child's failure into the run's error, and stopping everything in an
//! order that lets each actor close its replay log.

use super::{CoordinatorMsg, CoordinatorState, Links, RunInputs, RunOutcome, Waiting};
use crate::actors::monitor::MonitorArgs;
use crate::actors::topology::{plain_name, Host, Spawned, Topology};
use crate::config::BackendKind;
use crate::metrics::Progress;
use crate::optim::scaler::LossScaler;
use crate::replay;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Ends the run with `why` once the messages already queued are handled: a
/// stage reports its own failure (`Failed`) before it stops, so a send it
/// refuses, or the supervision event of its stop (which ractor delivers ahead
/// of queued messages), is a symptom that would otherwise hide the cause.
fn defer_failure(me: &ActorRef<CoordinatorMsg>, st: &mut CoordinatorState, why: String) {
    if st.failing {
        return;
    }
    st.failing = true;
    if me.send_message(CoordinatorMsg::Symptom(why.clone())).is_err() {
        st.finish(Err(why));
        me.stop(None);
    }
}

/// The run's parent actor; its state is [`CoordinatorState`].
pub struct Coordinator;

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
        let scaler =
            LossScaler::for_run(&cfg.optim, resume.as_ref().and_then(|r| r.state.loss_scaler.clone()));
        let epoch = cluster.as_ref().map_or_else(Instant::now, |p| p.epoch());
        let trace = cfg.trace.enabled.then(|| crate::trace::RunTrace::start(epoch));
        // GPU runs: in one process every rank is local; across processes the
        // driver made the plan (and its NCCL ids) when it sent the roster.
        let gpu_plan = match (&cluster, cfg.backend.kind) {
            (_, kind) if kind != BackendKind::Cuda => None,
            (Some(p), _) => p.gpu_plan(),
            (None, _) => Some(Arc::new(
                crate::actors::stage::nccl::GpuPlan::make(&layout, |_, _| 0, 0)
                    .map_err(|e| format!("NCCL: {e}"))?,
            )),
        };
        let eval_set = data.first().and_then(|d| d.eval_set.clone());
        let has_val = data.first().is_some_and(|d| d.val.is_some());
        let monitor_args = MonitorArgs {
            metrics,
            metrics_path: run_dir.join("metrics.jsonl"),
            last_step: 0,
            progress: Progress::new(cfg.train.steps, progress),
        };
        let mut topology = Topology::new(cfg, layout, run_dir, init, resume)?;
        if let Some(a) = topology.origin.as_ref().and_then(|o| o.anchor.as_ref()) {
            // This run's logs start from that checkpoint: retention must keep it.
            crate::checkpoint::pin::pin(&topology.run_dir, a.step)?;
        }
        topology.chaos_seed = chaos_seed;
        topology.trace = trace.clone();
        topology.gpu_plan = gpu_plan;
        let host = Host::Run { id, processes: cluster.clone() };
        let spawned = topology.spawn_run(&host, &me, data, monitor_args).await?;
        if let Some(f) = &cluster {
            f.set_routes(crate::actors::processes::Routes {
                stages: host.local_routes(&spawned.stages),
                coordinator: Some(me.clone()),
                reducer: spawned.reducer.clone(),
            });
        }
        let Topology { cfg, layout, run_dir, origin, resume, .. } = topology;
        let origin = origin.expect("a run records from its origin");
        let log = replay::recorder(&cfg, &run_dir, "coordinator", &origin)?;
        me.send_message(CoordinatorMsg::Start)?;
        let Spawned { stages, loaders, reducer, monitor, checkpointer } = spawned;
        let links =
            Links { stages, loaders, reducer, monitor: Some(monitor), checkpointer: Some(checkpointer) };
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
        st.trace = trace;
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
        if st.failing && !matches!(msg, CoordinatorMsg::Failed(_) | CoordinatorMsg::Symptom(_)) {
            return Ok(());
        }
        // The run's own failure (nothing verifies to roll back to, a send to a
        // stage that has stopped, …) is its result: returned as an actor error
        // it would reach no one.
        if let Err(e) = st.on_message(msg) {
            defer_failure(&me, st, e.to_string());
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
                defer_failure(&me, st, format!("{name} failed at step {}: {err}", st.step));
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) if !matches!(st.waiting, Waiting::Done) => {
                let name =
                    cell.get_name().map(|n| plain_name(&n).to_string()).unwrap_or_else(|| "an actor".into());
                let why = reason.unwrap_or_else(|| "no reason given".into());
                defer_failure(&me, st, format!("{name} stopped unexpectedly at step {}: {why}", st.step));
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
                tracing::error!("{e}");
            }
        }
        st.finish(Err("the run was stopped".into()));
        Ok(())
    }
}
