//! A pipeline rank of one data-parallel replica: an actor that owns the
//! mailbox and supervision, and a compute thread that owns the model chunks
//! and walks the rank's action list.
//!
//! The actor never computes: it forwards each message to the compute thread
//! over a crossbeam channel (optionally through a chaos shim that delays and
//! reorders them). On the compute thread the pieces are:
//!
//! - `executor`: the action loop (forward, backward, eval) over two traits,
//!   `StageCompute` (what it computes with) and `Comm` (whom it talks to).
//! - `comm`: the `Comm` trait and its in-process implementation, whose inbox
//!   keeps the result independent of arrival order.
//! - `backend`: builds the CPU, GPU or simulated compute; `sim`: the simulated one.
//! - `faults`: the environment's fault injection, wrapping the compute.
//! - `recorded`: the replay log, wrapping the comm.
//! - `nccl`: the communicators and link orders of GPU runs across processes.
//!
//! Tensors move between ranks by moving their `Vec`s: no copy in one process,
//! and a rank passing to itself skips the mailbox.

mod backend;
pub mod comm;
mod executor;
pub mod faults;
pub mod nccl;
mod recorded;
mod sim;

use super::layout::Layout;
use super::protocol::{CoordinatorMsg, Failure, ReducerMsg, Sent};
use crate::replay::ActorLog;
use crate::rng::{Purpose, Rng};
use crate::trace::Recorder;
use comm::{ActorComm, Comm};
use crossbeam_channel::{Receiver, Sender};
use executor::Executor;
use faults::{Faults, Faulty};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::rc::Rc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

pub use super::protocol::{Phase, StageMsg};

/// Where a stage's messages go.
pub enum Links {
    Actors {
        peers: Arc<OnceLock<Vec<ActorRef<StageMsg>>>>,
        coordinator: ActorRef<CoordinatorMsg>,
        reducer: Option<ActorRef<ReducerMsg>>,
    },
    /// Replaying this stage alone: what it sends to others is only logged, and
    /// a failure lands here.
    Detached { failure: Arc<Mutex<Option<Failure>>> },
}

impl Links {
    fn fail(&self, f: Failure) {
        match self {
            Links::Actors { coordinator, .. } => {
                let _ = coordinator.send_message(CoordinatorMsg::Failed(f));
            }
            Links::Detached { failure } => *failure.lock().expect("failure slot") = Some(f),
        }
    }
}

pub struct StageArgs {
    pub rank: usize,
    pub replica: usize,
    pub cfg: crate::config::Config,
    pub layout: Layout,
    pub init: Option<Arc<crate::model::io::LoadedWeights>>,
    /// A checkpoint to resume from: weights and AdamW moments by tensor name.
    pub resume: Option<Arc<crate::checkpoint::Loaded>>,
    pub links: Links,
    /// The replay log (recording, or checking a replay).
    pub log: Option<ActorLog>,
    pub chaos_seed: Option<u64>,
    /// Cores this rank's threads are pinned to (empty: not pinned).
    pub cores: Vec<core_affinity::CoreId>,
    pub latencies_us: Arc<Mutex<Vec<f64>>>,
    /// The run's trace (its id and clock); `None` when not tracing.
    pub trace: Option<crate::trace::RunTrace>,
    /// GPU runs: which ranks share this process and the NCCL ids of the rest.
    pub gpu_plan: Option<Arc<nccl::GpuPlan>>,
    /// The run's other processes, through which the stage reaches the
    /// tensor-parallel ranks they hold (`None`: every rank is here).
    pub processes: Option<Arc<dyn crate::actors::processes::Processes>>,
}

pub struct StageActor;

pub struct StageState {
    tx: Sender<StageMsg>,
    /// Send → handle times of activation and gradient messages, in µs: the
    /// runtime's own per-message cost, whatever the compute thread is doing.
    latencies_us: Arc<Mutex<Vec<f64>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    chaos: Option<Rng>,
}

impl Actor for StageActor {
    type Msg = StageMsg;
    type State = StageState;
    type Arguments = StageArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<StageMsg>,
        args: StageArgs,
    ) -> Result<StageState, ActorProcessingErr> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let latencies_us = args.latencies_us.clone();
        let chaos =
            args.chaos_seed.map(|s| Rng::new(s, Purpose::Test, &[args.rank as u64, args.replica as u64]));
        let name = format!("stage-{}.{}", args.rank, args.replica);
        let thread = std::thread::Builder::new().name(name).spawn(move || worker_main(args, rx))?;
        Ok(StageState { tx, latencies_us, thread: Some(thread), chaos })
    }

    async fn handle(
        &self,
        _me: ActorRef<StageMsg>,
        msg: StageMsg,
        st: &mut StageState,
    ) -> Result<(), ActorProcessingErr> {
        let mut msg = msg;
        if let StageMsg::Activation { sent, .. } | StageMsg::Gradient { sent, .. } = &mut msg {
            let us = sent.0.elapsed().as_secs_f64() * 1e6;
            st.latencies_us.lock().expect("latency log").push(us);
            // From here on `sent` is when the message reached this stage: the
            // trace's receive instant, however long it then waits in the inbox.
            *sent = Sent::now();
        }
        // Every message the compute thread files by key rather than handles in order.
        let data = comm::Key::of(&msg).is_some();
        match (&mut st.chaos, data) {
            (Some(rng), true) => {
                // Test transport: deliver data messages after a random delay, so
                // they reach the compute thread in a scrambled order.
                let delay = Duration::from_micros(rng.below(2000));
                let tx = st.tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = tx.send(msg);
                });
            }
            _ => st.tx.send(msg).map_err(|_| "compute thread has exited")?,
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<StageMsg>,
        st: &mut StageState,
    ) -> Result<(), ActorProcessingErr> {
        let _ = st.tx.send(StageMsg::Stop);
        if let Some(t) = st.thread.take() {
            // The thread stops at its next message; never block the runtime on it.
            std::thread::spawn(move || {
                let _ = t.join();
            });
        }
        Ok(())
    }
}

fn worker_main(mut args: StageArgs, rx: Receiver<StageMsg>) {
    let (rank, replica) = (args.rank, args.replica);
    let step = args.resume.as_ref().map_or(0, |c| c.state.step);
    let links = std::mem::replace(&mut args.links, Links::Detached { failure: Default::default() });
    // Building consumes the links; a panic there must still reach the coordinator.
    let coordinator = match &links {
        Links::Actors { coordinator, .. } => Some(coordinator.clone()),
        Links::Detached { .. } => None,
    };
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| build(args, rx, links)));
    let could_not_start =
        |e: String| Failure::new(rank, replica, step, None, format!("could not start: {e}"));
    match built {
        Ok(Ok(mut w)) => w.run(),
        Ok(Err((e, links))) => links.fail(could_not_start(e)),
        Err(p) => {
            let f = could_not_start(panic_text(&p));
            match coordinator {
                Some(c) => drop(c.send_message(CoordinatorMsg::Failed(f))),
                None => tracing::error!("{f}"),
            }
        }
    }
}

/// Replays one stage alone on this thread: `rx` carries its recorded inputs,
/// `args.log` checks what it does against the recording.
pub fn replay_stage(args: StageArgs, rx: Receiver<StageMsg>) -> Result<Option<ActorLog>, String> {
    let failure: Arc<Mutex<Option<Failure>>> = Default::default();
    let links = Links::Detached { failure: failure.clone() };
    let mut w = build(args, rx, links).map_err(|(e, _)| e)?;
    w.run();
    if let Some(f) = failure.lock().expect("failure slot").take() {
        return Err(f.to_string());
    }
    Ok(w.comm.take_log())
}

/// The rank's executor: its compute (with the environment's faults) and its
/// comm (recorded when there is a log).
fn build(mut args: StageArgs, rx: Receiver<StageMsg>, links: Links) -> Result<Executor, (String, Links)> {
    let faults = Faults::from_env();
    let compute = match backend::build(&args, &faults) {
        Ok(c) => c,
        Err(e) => return Err((e, links)),
    };
    let (rank, replica) = (args.rank, args.replica);
    let stages = args.layout.stages_of(rank);
    let rec = Rc::new(Recorder::new(args.trace.take(), replica, rank));
    let actor = ActorComm::new(&args.layout, rank, rx, links, rec.clone());
    let comm: Box<dyn Comm> = match args.log.take() {
        Some(log) => {
            let names = param_names(compute.as_ref(), stages.len());
            let layout = args.layout.clone();
            Box::new(recorded::Recorded::new(Box::new(actor), log, layout, rank, replica, names))
        }
        None => Box::new(actor),
    };
    let cfg = &args.cfg;
    let gpt = cfg.arch();
    let l = &args.layout;
    let dloss = 1.0 / (l.dp * l.microbatches * cfg.train.micro_batch_size * gpt.block_size) as f32;
    let last = l.last_stage();
    let n_chunks = stages.len();
    Ok(Executor {
        rank,
        replica,
        actions: l.schedule.actions[rank].clone(),
        microbatches: l.microbatches,
        hyper: crate::optim::Hyper::from_config(cfg),
        layout: args.layout,
        gpt,
        compute: Faulty::new(compute, faults, stages.clone(), last),
        stages,
        comm,
        step: 0,
        current: None,
        latencies_us: args.latencies_us,
        norms: Vec::new(),
        dloss,
        rec,
        action_span: tracing::Span::none(),
        zero: cfg.parallel.zero,
        reshard_after_forward: cfg.parallel.reshard_after_forward,
        gathered: vec![false; n_chunks],
    })
}

/// Every chunk's parameter names, in parameter order.
fn param_names(compute: &dyn super::compute::StageCompute, chunks: usize) -> Vec<Vec<String>> {
    (0..chunks).map(|i| (0..).map_while(|k| compute.param_name(i, k)).collect()).collect()
}

pub(super) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}
