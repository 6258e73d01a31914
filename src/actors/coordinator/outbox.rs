//! The coordinator's outbox: the actors it sends to, and every message it
//! sends or handles as its replay log records it.

use super::{stage_name, CoordinatorMsg, CoordinatorState, StageMsg};
use crate::actors::protocol::{self, CheckpointerMsg, LoaderMsg, MonitorMsg, ReducerMsg};
use crate::metrics::StepMetrics;
use crate::replay::{self, Blob};
use ractor::{ActorProcessingErr, ActorRef};

/// The actors the coordinator sends to (all empty when replaying it alone).
pub struct Links {
    pub stages: Vec<Vec<ActorRef<StageMsg>>>,
    pub loaders: Vec<ActorRef<LoaderMsg>>,
    pub reducer: Option<ActorRef<ReducerMsg>>,
    pub monitor: Option<ActorRef<MonitorMsg>>,
    pub checkpointer: Option<ActorRef<CheckpointerMsg>>,
}

impl CoordinatorState {
    /// Logs a handled message: gathered messages (one per rank) are logged in
    /// (replica, rank) order when their gather completes, so the log does not
    /// depend on the order they arrived in.
    pub(super) fn log_handled(&mut self, msg: &CoordinatorMsg) {
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
            | CoordinatorMsg::Symptom(_)
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

    pub(super) fn gather_done(&mut self) {
        if let Some(log) = &mut self.log {
            log.gather_done();
        }
    }

    pub(super) fn log_sent(&mut self, to: &str, kind: &str, blobs: impl FnOnce() -> Vec<Blob>) {
        if let Some(log) = &mut self.log {
            log.sent(to, kind, None, blobs());
        }
    }

    pub(super) fn send_stage(
        &mut self,
        replica: usize,
        rank: usize,
        msg: StageMsg,
    ) -> Result<(), ActorProcessingErr> {
        if self.log.is_some() {
            let logged = msg.logged(false, &protocol::no_grad_names);
            self.log_sent(&stage_name(rank, replica), logged.kind, || logged.blobs);
        }
        if let Some(r) = self.stages.get(replica).and_then(|v| v.get(rank)) {
            r.send_message(msg)?;
        }
        Ok(())
    }

    /// Sends `msg()` to every stage of replicas `0..replicas`, in (replica, rank) order.
    pub(super) fn send_stages(
        &mut self,
        replicas: usize,
        msg: impl Fn() -> StageMsg,
    ) -> Result<(), ActorProcessingErr> {
        for replica in 0..replicas {
            for rank in 0..self.layout.pp {
                self.send_stage(replica, rank, msg())?;
            }
        }
        Ok(())
    }

    pub(super) fn send_loader(&mut self, replica: usize, msg: LoaderMsg) -> Result<(), ActorProcessingErr> {
        let (kind, blobs) = msg.logged();
        self.log_sent(&format!("loader-{replica}"), kind, || blobs);
        if let Some(l) = self.loaders.get(replica) {
            l.send_message(msg)?;
        }
        Ok(())
    }

    pub(super) fn send_monitor(&mut self, msg: MonitorMsg) -> Result<(), ActorProcessingErr> {
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
