//! The other processes of a run, as the runtime reaches them: which process
//! runs each (replica, rank), where frames for this process's actors go, a
//! stand-in for a stage that lives elsewhere, and the followers of a
//! tensor-parallel group that spans processes.
//!
//! The runtime only knows this trait; `cluster` implements it over its links.
//! So a run in one process never touches the network code, and the actors
//! never import it.

use super::protocol::{CoordinatorMsg, ReducerMsg, StageMsg};
use super::stage::nccl::GpuPlan;
use crate::model::tp::Remote;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where frames for this process's actors are delivered.
#[derive(Default)]
pub struct Routes {
    /// By (replica, rank); `None` for stages that live elsewhere.
    pub stages: Vec<Vec<Option<ActorRef<StageMsg>>>>,
    pub coordinator: Option<ActorRef<CoordinatorMsg>>,
    pub reducer: Option<ActorRef<ReducerMsg>>,
}

/// A run spread over processes, from one of them.
pub trait Processes: Send + Sync {
    /// This process's rank.
    fn me(&self) -> usize;

    /// The process that runs (replica, rank).
    fn owner(&self, replica: usize, rank: usize) -> usize;

    /// The run's trace clock, shared by every process.
    fn epoch(&self) -> Instant;

    /// GPU runs: which ranks share this process and the NCCL ids of what
    /// crosses processes, once the run's driver has made them.
    fn gpu_plan(&self) -> Option<Arc<GpuPlan>>;

    /// Where incoming messages for this process's actors go (set once).
    fn set_routes(&self, routes: Routes);

    /// Hands `msg` for the stage at (replica, rank) to its process `owner`.
    /// A link that is gone has already been reported as the run's failure.
    fn send_stage(&self, owner: usize, replica: usize, rank: usize, msg: StageMsg);

    /// The followers of chunk `chunk` of the stage at (replica, rank), when
    /// its tensor-parallel ranks live in more than one process.
    fn tp_remote(
        self: Arc<Self>,
        replica: usize,
        rank: usize,
        chunk: usize,
        timeout: Duration,
    ) -> Result<Option<Remote>, String>;
}

/// Stands in for a stage another process runs: an `ActorRef<StageMsg>` like
/// any stage, so the coordinator, loaders, reducer and neighbouring stages
/// send to it unchanged, and each message goes on to the owner's process.
pub struct RemoteStage;

pub struct RemoteStageArgs {
    pub processes: Arc<dyn Processes>,
    pub replica: usize,
    pub rank: usize,
    pub owner: usize,
}

impl Actor for RemoteStage {
    type Msg = StageMsg;
    type State = RemoteStageArgs;
    type Arguments = RemoteStageArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<StageMsg>,
        args: RemoteStageArgs,
    ) -> Result<RemoteStageArgs, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _me: ActorRef<StageMsg>,
        msg: StageMsg,
        st: &mut RemoteStageArgs,
    ) -> Result<(), ActorProcessingErr> {
        st.processes.send_stage(st.owner, st.replica, st.rank, msg);
        Ok(())
    }
}
