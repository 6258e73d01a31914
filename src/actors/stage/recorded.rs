//! `Recorded<C>`: a `Comm` that writes every message its stage handles and
//! sends to the replay log (or checks them against a recording, when
//! replaying), then passes it on. The executor never formats a log entry:
//! how a message looks in a log is `protocol`'s business, who sent it is
//! this file's.

use super::super::layout::Layout;
use super::super::protocol::{no_grad_names, stage_name, CoordinatorMsg, Failure, ReducerMsg, StageMsg};
use super::comm::{At, Comm, Key, Stopped};
use crate::replay::{ActorLog, Entry};

pub struct Recorded<C: Comm + ?Sized> {
    inner: Box<C>,
    log: Option<ActorLog>,
    layout: Layout,
    replica: usize,
    /// Global stage ids held here, ascending.
    stages: Vec<usize>,
    /// Parameter names per local chunk, for gradient blobs.
    names: Vec<Vec<String>>,
    /// The step of the last RunStep or RunEval: messages that name no step
    /// are logged under it.
    step: u64,
}

impl<C: Comm + ?Sized> Recorded<C> {
    pub fn new(
        inner: Box<C>,
        log: ActorLog,
        layout: Layout,
        rank: usize,
        replica: usize,
        names: Vec<Vec<String>>,
    ) -> Self {
        let stages = layout.stages_of(rank);
        Recorded { inner, log: Some(log), layout, replica, stages, names, step: 0 }
    }

    fn keep(&self) -> bool {
        self.log.as_ref().is_some_and(|l| l.payloads())
    }

    fn grad_name(&self, stage: usize, k: usize) -> String {
        let i = self.stages.iter().position(|&s| s == stage).expect("stage held by this rank");
        self.names[i].get(k).cloned().unwrap_or_else(|| format!("tensor.{k}"))
    }

    /// Who sent the data message filed under `key`.
    fn sender(&self, key: Key) -> String {
        let name_of = |stage: usize| stage_name(self.layout.rank_of(stage), self.replica);
        match key {
            Key::Tokens(..) | Key::Targets(..) => format!("loader-{}", self.replica),
            Key::Act(_, s, _) => name_of(s - 1),
            Key::Grad(s, _) => name_of(s + 1),
            Key::Tied => {
                let last = self.layout.last_stage();
                name_of(if self.stages.contains(&0) { last } else { 0 })
            }
            Key::Reduced(_) | Key::Scattered(_) | Key::Gathered(_) => "reducer".to_string(),
        }
    }

    fn data_entry(&self, key: Key, msg: &StageMsg) -> Entry {
        let grad_name = |stage: usize, k: usize| self.grad_name(stage, k);
        msg.logged(self.keep(), &grad_name).entry(&self.sender(key), self.step, self.replica)
    }
}

impl<C: Comm + ?Sized> Comm for Recorded<C> {
    fn next_control(&mut self) -> Result<StageMsg, Stopped> {
        let msg = self.inner.next_control()?;
        if let StageMsg::RunStep { step, .. } | StageMsg::RunEval { step, .. } = msg {
            self.step = step;
        }
        let e = msg.logged(false, &no_grad_names).entry("coordinator", self.step, self.replica);
        if let Some(log) = &mut self.log {
            log.begin(e);
        }
        Ok(msg)
    }

    fn recv(&mut self, key: Key, at: At) -> Result<StageMsg, Stopped> {
        let msg = self.inner.recv(key, at)?;
        let e = self.data_entry(key, &msg);
        if let Some(log) = &mut self.log {
            log.begin(e);
        }
        Ok(msg)
    }

    fn send(&mut self, rank: usize, msg: StageMsg) -> Result<(), Stopped> {
        if let Some(log) = &mut self.log {
            let to = stage_name(rank, self.replica);
            msg.logged(log.payloads(), &no_grad_names).record_sent(log, &to);
        }
        self.inner.send(rank, msg)
    }

    fn to_reducer(&mut self, msg: ReducerMsg) -> Result<(), Stopped> {
        let (kind, blobs) = msg.logged(self.keep(), &|stage, k| self.grad_name(stage, k));
        if let Some(log) = &mut self.log {
            log.sent("reducer", kind, None, blobs);
        }
        self.inner.to_reducer(msg)
    }

    fn report(&mut self, msg: CoordinatorMsg) {
        if let Some(log) = &mut self.log {
            let (kind, blobs) = msg.logged(log.payloads(), true);
            log.sent("coordinator", kind, None, blobs);
            // The run's last message here: the log is complete before the
            // coordinator can end the run.
            if let CoordinatorMsg::Weights { .. } = msg {
                if let Err(e) = log.finish() {
                    panic!("{e}");
                }
            }
        }
        self.inner.report(msg)
    }

    fn fail(&mut self, f: Failure) {
        self.inner.fail(f)
    }

    fn log(&mut self) -> Option<&mut ActorLog> {
        self.log.as_mut()
    }

    fn take_log(&mut self) -> Option<ActorLog> {
        self.log.take()
    }
}
