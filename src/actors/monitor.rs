//! The monitor: appends each step's metrics to metrics.jsonl and drives the
//! progress display. Slow consumers never hold up a stage: it only hears from
//! the coordinator, once per step.

use crate::train::run::{Progress, StepMetrics};
use ractor::{Actor, ActorProcessingErr, ActorRef, Message};
use std::io::Write;

pub enum MonitorMsg {
    Step(StepMetrics),
    Finish,
}

impl Message for MonitorMsg {}

pub struct MonitorArgs {
    pub metrics: Option<std::io::BufWriter<std::fs::File>>,
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
            MonitorMsg::Step(m) => {
                if let Some(w) = &mut st.metrics {
                    serde_json::to_writer(&mut *w, &m)?;
                    w.write_all(b"\n")?;
                    w.flush()?;
                }
                st.progress.update(&m);
            }
            MonitorMsg::Finish => st.progress.finish(),
        }
        Ok(())
    }
}
