//! The monitor: appends each step's metrics to metrics.jsonl and drives the
//! progress display. Slow consumers never hold up a stage: it only hears from
//! the coordinator, once per step.

use super::protocol::MonitorMsg;
use crate::metrics::{Progress, StepMetrics};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::io::Write;

pub struct MonitorArgs {
    pub metrics: Option<std::io::BufWriter<std::fs::File>>,
    /// Where `metrics` writes, for errors.
    pub metrics_path: std::path::PathBuf,
    /// The latest step written: a step not past it runs again after a rollback.
    pub last_step: usize,
    pub progress: Progress,
}

pub struct Monitor;

impl Actor for Monitor {
    type Msg = MonitorMsg;
    type State = MonitorArgs;
    type Arguments = MonitorArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<MonitorMsg>,
        args: MonitorArgs,
    ) -> Result<MonitorArgs, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _me: ActorRef<MonitorMsg>,
        msg: MonitorMsg,
        st: &mut MonitorArgs,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            MonitorMsg::Step(mut m) => {
                m.repeated = m.step <= st.last_step;
                st.last_step = st.last_step.max(m.step);
                if let Some(w) = &mut st.metrics {
                    append_line(w.get_mut(), &m).map_err(|e| {
                        format!("{}: cannot append step {}: {e}", st.metrics_path.display(), m.step)
                    })?;
                }
                st.progress.update(&m);
            }
            MonitorMsg::Finish => st.progress.finish(),
        }
        Ok(())
    }
}

/// Appends one line whole, or nothing: a write cut short (a full disk) is
/// cut back off, so metrics.jsonl never ends in half a line.
fn append_line(f: &mut std::fs::File, m: &StepMetrics) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(m)?;
    line.push(b'\n');
    let before = f.metadata()?.len();
    f.write_all(&line).inspect_err(|_| {
        let _ = f.set_len(before);
    })
}
