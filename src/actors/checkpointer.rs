//! The checkpointer: writes checkpoints on a blocking thread while training
//! goes on, one at a time in step order, and tells the coordinator when each
//! is safely on disk (or why it is not).

use super::coordinator::CoordinatorMsg;
use crate::checkpoint::{self, StateFile, TensorState};
use ractor::{Actor, ActorProcessingErr, ActorRef, Message};
use std::path::PathBuf;
use std::time::Instant;

pub enum CheckpointerMsg {
    Write { tensors: Vec<TensorState>, state: StateFile },
}

impl Message for CheckpointerMsg {}

pub struct CheckpointerArgs {
    pub run_dir: PathBuf,
    pub keep: usize,
    pub keep_every: u64,
    pub coordinator: ActorRef<CoordinatorMsg>,
}

pub struct Checkpointer;

impl Actor for Checkpointer {
    type Msg = CheckpointerMsg;
    type State = CheckpointerArgs;
    type Arguments = CheckpointerArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<CheckpointerMsg>,
        args: CheckpointerArgs,
    ) -> Result<CheckpointerArgs, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _me: ActorRef<CheckpointerMsg>,
        msg: CheckpointerMsg,
        st: &mut CheckpointerArgs,
    ) -> Result<(), ActorProcessingErr> {
        let CheckpointerMsg::Write { tensors, state } = msg;
        let step = state.step;
        let (dir, keep, keep_every) = (st.run_dir.clone(), st.keep, st.keep_every);
        let t = Instant::now();
        // Disk work runs on tokio's blocking pool, never on the actor threads.
        let result =
            tokio::task::spawn_blocking(move || checkpoint::save(&dir, &tensors, state, keep, keep_every))
                .await?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let reply = match result {
            Ok(path) => CoordinatorMsg::Saved { step, ms, path },
            Err(e) => CoordinatorMsg::CheckpointFailed(format!("checkpoint of step {step}: {e}")),
        };
        st.coordinator.send_message(reply)?;
        Ok(())
    }
}
