//! A run's topology: the stage of every (replica, rank), the data loaders,
//! the reducer, the checkpointer and the monitor, how they are linked, and
//! the arguments each starts from. One place for the coordinator (every actor
//! of a run in one process, or rank 0 of a cluster), a cluster worker (the
//! stages it hosts, stand-ins for the rest) and replay (one actor alone,
//! its inputs read from its log). What differs between them is a [`Host`]:
//! where each stage runs and what its actor is called.
//!
//! Nothing here decides an order of work or touches a tensor.

use super::checkpointer::{Checkpointer, CheckpointerArgs};
use super::coordinator::RunData;
use super::data_loader::{DataLoader, LoaderArgs};
use super::layout::Layout;
use super::monitor::{Monitor, MonitorArgs};
use super::processes::{Processes, RemoteStage, RemoteStageArgs};
use super::protocol::{
    stage_name, CheckpointerMsg, CoordinatorMsg, LoaderMsg, MonitorMsg, ReducerMsg, StageMsg,
};
use super::reducer::{Reducer, ReducerArgs};
use super::stage::{nccl::GpuPlan, Links, StageActor, StageArgs};
use crate::config::Config;
use crate::replay::{self, ActorLog, LogError};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// Stage actors by (replica, rank); a stage another process runs is its stand-in.
pub type StageRefs = Vec<Vec<ActorRef<StageMsg>>>;

/// ractor's registry is process-wide: runs in one process (tests, the bench's
/// layouts) register their actors under their own run number, `name#run`.
pub fn registered(name: &str, run: u64) -> String {
    format!("{name}#{run}")
}

/// An actor's name without its run number.
pub fn plain_name(registered: &str) -> &str {
    registered.split('#').next().unwrap_or(registered)
}

/// Where a caller's stages run and what their actors are called.
pub enum Host {
    /// The run's own process: every actor registered as `name#run`; with
    /// other processes (rank 0 of a cluster), stages placed elsewhere get stand-ins.
    Run { id: u64, processes: Option<Arc<dyn Processes>> },
    /// A cluster worker, which hosts one run: its stages go by their plain
    /// names, the stand-ins for the others are unnamed.
    Worker(Arc<dyn Processes>),
}

impl Host {
    fn processes(&self) -> Option<&Arc<dyn Processes>> {
        match self {
            Host::Run { processes, .. } => processes.as_ref(),
            Host::Worker(f) => Some(f),
        }
    }

    /// The stand-in's arguments when another process runs (replica, rank).
    fn elsewhere(&self, replica: usize, rank: usize) -> Option<RemoteStageArgs> {
        let p = self.processes()?;
        let owner = p.owner(replica, rank);
        (owner != p.me()).then(|| RemoteStageArgs { processes: p.clone(), replica, rank, owner })
    }

    /// The name `actor` is registered under; `stand_in` for a remote stage's proxy.
    fn name(&self, actor: &str, stand_in: bool) -> Option<String> {
        match (self, stand_in) {
            (Host::Run { id, .. }, false) => Some(registered(actor, *id)),
            (Host::Run { id, .. }, true) => Some(registered(&format!("remote-{actor}"), *id)),
            (Host::Worker(_), false) => Some(actor.to_string()),
            (Host::Worker(_), true) => None,
        }
    }

    /// The stages this process runs, by (replica, rank): where the other
    /// processes' messages for stages are delivered.
    pub fn local_routes(&self, stages: &StageRefs) -> Vec<Vec<Option<ActorRef<StageMsg>>>> {
        let here = |replica, rank| self.processes().is_none_or(|p| p.owner(replica, rank) == p.me());
        let per_replica = stages.iter().enumerate();
        per_replica
            .map(|(replica, refs)| {
                refs.iter().enumerate().map(|(rank, r)| here(replica, rank).then(|| r.clone())).collect()
            })
            .collect()
    }
}

/// What every actor of a run starts from.
pub struct Topology {
    pub cfg: Config,
    pub layout: Layout,
    pub run_dir: PathBuf,
    /// Where the run's replay logs start. `None`: no log is opened here
    /// (replaying one actor hands it the log it checks against).
    pub origin: Option<replay::Origin>,
    pub init: Option<Arc<crate::model::io::LoadedWeights>>,
    pub resume: Option<Arc<crate::checkpoint::Loaded>>,
    pub chaos_seed: Option<u64>,
    /// The run's trace (its id and clock); `None` when not tracing.
    pub trace: Option<crate::trace::RunTrace>,
    /// GPU runs: which ranks share this process and the NCCL ids of the rest.
    pub gpu_plan: Option<Arc<GpuPlan>>,
}

/// The actors the coordinator spawned and links to.
pub struct Spawned {
    pub stages: StageRefs,
    pub loaders: Vec<ActorRef<LoaderMsg>>,
    pub reducer: Option<ActorRef<ReducerMsg>>,
    pub monitor: ActorRef<MonitorMsg>,
    pub checkpointer: ActorRef<CheckpointerMsg>,
}

impl Topology {
    /// The topology of a run that records from where it starts (`init`
    /// weights or the `resume` checkpoint); no chaos, trace or GPU plan yet.
    pub fn new(
        cfg: Config,
        layout: Layout,
        run_dir: PathBuf,
        init: Option<Arc<crate::model::io::LoadedWeights>>,
        resume: Option<Arc<crate::checkpoint::Loaded>>,
    ) -> Result<Topology, LogError> {
        let origin = replay::Origin::new(&cfg, init.as_ref().map(|w| w.path.as_path()), resume.as_deref())?;
        Ok(Topology {
            cfg,
            layout,
            run_dir,
            origin: Some(origin),
            init,
            resume,
            chaos_seed: None,
            trace: None,
            gpu_plan: None,
        })
    }

    /// `actor`'s replay log, when the run records.
    fn log(&self, actor: &str) -> Result<Option<ActorLog>, LogError> {
        match &self.origin {
            Some(o) => replay::recorder(&self.cfg, &self.run_dir, actor, o),
            None => Ok(None),
        }
    }

    pub fn stage_args(
        &self,
        replica: usize,
        rank: usize,
        links: Links,
        cores: Vec<core_affinity::CoreId>,
    ) -> Result<StageArgs, LogError> {
        Ok(StageArgs {
            rank,
            replica,
            cfg: self.cfg.clone(),
            layout: self.layout.clone(),
            init: self.init.clone(),
            resume: self.resume.clone(),
            links,
            log: self.log(&stage_name(rank, replica))?,
            chaos_seed: self.chaos_seed,
            cores,
            latencies_us: Default::default(),
            trace: self.trace.clone(),
            gpu_plan: self.gpu_plan.clone(),
            processes: None,
        })
    }

    pub fn loader_args(
        &self,
        replica: usize,
        data: RunData,
        stages: Arc<OnceLock<StageRefs>>,
    ) -> Result<LoaderArgs, LogError> {
        let (cfg, layout) = (&self.cfg, &self.layout);
        Ok(LoaderArgs {
            replica,
            dp: layout.dp,
            batches: layout.batches.clone(),
            micro_batch_size: cfg.train.micro_batch_size,
            block_size: cfg.model.block_size,
            train: data.train,
            val: data.val,
            eval_set: data.eval_set,
            stages,
            first_rank: layout.rank_of(0),
            last_rank: layout.rank_of(layout.last_stage()),
            log: self.log(&format!("loader-{replica}"))?,
        })
    }

    pub fn reducer_args(&self, stages: Arc<OnceLock<StageRefs>>) -> Result<ReducerArgs, LogError> {
        Ok(ReducerArgs {
            dp: self.layout.dp,
            stages,
            stage_rank: self.layout.schedule.stage_rank.clone(),
            log: self.log("reducer")?,
            chaos_seed: self.chaos_seed,
            zero: self.cfg.parallel.zero >= 1,
        })
    }

    /// The cores of stage `k`'s threads. Pinned only when every compute thread
    /// of the run can have a core of its own: two busy ranks pinned to one core
    /// cannot borrow an idle neighbour.
    fn cores_of(&self, all: &[core_affinity::CoreId], k: usize) -> Vec<core_affinity::CoreId> {
        let (t, l) = (self.layout.threads_per_rank, &self.layout);
        if all.is_empty() || t * l.pp * l.dp > all.len() {
            return vec![];
        }
        (0..t).map(|i| all[(k * t + i) % all.len()]).collect()
    }

    /// Spawns the stage of every (replica, rank), or its stand-in where
    /// another process runs it, each linked to `supervisor`.
    pub async fn spawn_stages(
        &self,
        host: &Host,
        coordinator: &ActorRef<CoordinatorMsg>,
        reducer: Option<ActorRef<ReducerMsg>>,
        supervisor: ActorCell,
    ) -> Result<StageRefs, ActorProcessingErr> {
        let (pp, dp) = (self.layout.pp, self.layout.dp);
        let cores = core_affinity::get_core_ids().unwrap_or_default();
        let mut stages = Vec::new();
        for replica in 0..dp {
            let peers: Arc<OnceLock<Vec<ActorRef<StageMsg>>>> = Arc::new(OnceLock::new());
            let mut refs = Vec::new();
            for rank in 0..pp {
                let name = stage_name(rank, replica);
                if let Some(args) = host.elsewhere(replica, rank) {
                    let (r, _) =
                        Actor::spawn_linked(host.name(&name, true), RemoteStage, args, supervisor.clone())
                            .await?;
                    refs.push(r);
                    continue;
                }
                let links = Links::Actors {
                    peers: peers.clone(),
                    coordinator: coordinator.clone(),
                    reducer: reducer.clone(),
                };
                let mut args =
                    self.stage_args(replica, rank, links, self.cores_of(&cores, replica * pp + rank))?;
                args.processes = host.processes().cloned();
                let (r, _) =
                    Actor::spawn_linked(host.name(&name, false), StageActor, args, supervisor.clone())
                        .await?;
                refs.push(r);
            }
            let _ = peers.set(refs.clone());
            stages.push(refs);
        }
        Ok(stages)
    }

    /// Spawns every actor of a run under its coordinator `me`: checkpointer,
    /// monitor, reducer (dp > 1), the stages and one loader per replica.
    pub async fn spawn_run(
        &self,
        host: &Host,
        me: &ActorRef<CoordinatorMsg>,
        data: Vec<RunData>,
        monitor: MonitorArgs,
    ) -> Result<Spawned, ActorProcessingErr> {
        let (cfg, run_dir) = (&self.cfg, &self.run_dir);
        let ck_args = CheckpointerArgs {
            run_dir: run_dir.clone(),
            keep: cfg.checkpoint.keep,
            keep_every: cfg.checkpoint.keep_every as u64,
            coordinator: me.clone(),
            log: self.log("checkpointer")?,
        };
        let name = |actor: &str| host.name(actor, false);
        let (checkpointer, _) =
            Actor::spawn_linked(name("checkpointer"), Checkpointer, ck_args, me.get_cell()).await?;
        let all: Arc<OnceLock<StageRefs>> = Arc::new(OnceLock::new());
        let (monitor, _) = Actor::spawn_linked(name("monitor"), Monitor, monitor, me.get_cell()).await?;
        let reducer = if self.layout.dp > 1 {
            let args = self.reducer_args(all.clone())?;
            Some(Actor::spawn_linked(name("reducer"), Reducer, args, me.get_cell()).await?.0)
        } else {
            None
        };
        let stages = self.spawn_stages(host, me, reducer.clone(), me.get_cell()).await?;
        let _ = all.set(stages.clone());
        let mut loaders = Vec::new();
        for (replica, d) in data.into_iter().enumerate() {
            let args = self.loader_args(replica, d, all.clone())?;
            let loader_name = name(&format!("loader-{replica}"));
            loaders.push(Actor::spawn_linked(loader_name, DataLoader, args, me.get_cell()).await?.0);
        }
        Ok(Spawned { stages, loaders, reducer, monitor, checkpointer })
    }
}
