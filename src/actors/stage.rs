//! A pipeline rank of one data-parallel replica: an actor that owns the
//! mailbox and supervision, and a compute thread that owns the model chunks
//! and walks the rank's action list.
//!
//! The actor never computes: it forwards each message to the compute thread
//! over a crossbeam channel (optionally through a chaos shim that delays and
//! reorders them). The compute thread executes exactly its schedule; a message
//! that arrives before it is needed waits in a buffer keyed by (phase, kind,
//! stage, mb), so the work done — and every bit of its result — never depends
//! on arrival order. Tensors move between ranks by moving their `Vec`s: no copy
//! in one process, and a rank passing to itself skips the mailbox.

use super::compute::{BackwardPart, ChunkInput, CpuCompute, StageCompute};
use super::layout::Layout;
use super::protocol::{CoordinatorMsg, EvalKind, Failure, StageReport};
use super::reducer::ReducerMsg;
use crate::model::part::Mode;
use crate::model::{GptConfig, ModelPart};
use crate::optim::{AdamState, Hyper};
use crate::replay::{ActorLog, Blob, Entry};
use crate::rng::{Purpose, Rng};
use crate::schedule::{Action, ActionKind};
use crate::trace::Recorder;
use crossbeam_channel::{Receiver, Sender};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use super::protocol::{Phase, StageMsg};

/// Buffer key: what a waiting action needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Tokens(Phase, usize),
    Targets(Phase, usize),
    Act(Phase, usize, usize),
    Grad(usize, usize),
    Tied,
    Reduced(usize),
}

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
    pub latencies_us: Arc<std::sync::Mutex<Vec<f64>>>,
    /// The run's clock for trace timestamps; `None` when not tracing.
    pub trace_epoch: Option<Instant>,
    /// GPU runs: which ranks share this process and the NCCL ids of the rest.
    pub gpu_plan: Option<Arc<super::compute::GpuPlan>>,
}

pub struct StageActor;

pub struct StageState {
    tx: Sender<StageMsg>,
    /// Send → handle times of activation and gradient messages, in µs: the
    /// runtime's own per-message cost, whatever the compute thread is doing.
    latencies_us: Arc<std::sync::Mutex<Vec<f64>>>,
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
            let us = sent.elapsed().as_secs_f64() * 1e6;
            st.latencies_us.lock().expect("latency log").push(us);
            // From here on `sent` is when the message reached this stage: the
            // trace's receive instant, however long it then waits in the inbox.
            *sent = Instant::now();
        }
        // Every message the compute thread files by key rather than handles in order.
        let data = matches!(
            msg,
            StageMsg::Tokens { .. }
                | StageMsg::Targets { .. }
                | StageMsg::Activation { .. }
                | StageMsg::Gradient { .. }
                | StageMsg::TiedShare { .. }
                | StageMsg::Reduced { .. }
        );
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

/// Raised inside the compute thread to unwind out of a step on `Stop`.
struct Stopped;

struct Worker {
    rank: usize,
    replica: usize,
    layout: Layout,
    gpt: GptConfig,
    /// Global stage ids held here, ascending; chunk i of `compute` is stages[i].
    stages: Vec<usize>,
    /// The chunks and what they compute with (CPU cores or a GPU).
    compute: Box<dyn StageCompute>,
    hyper: Hyper,
    actions: Vec<Action>,
    rx: Receiver<StageMsg>,
    inbox: BTreeMap<Key, StageMsg>,
    control: VecDeque<StageMsg>,
    links: Links,
    log: Option<ActorLog>,
    step: u64,
    /// The action being executed, for failure reports.
    current: Option<Action>,
    /// Shared with the actor, which records send → handle times.
    latencies_us: Arc<std::sync::Mutex<Vec<f64>>>,
    norms: Vec<(usize, f64)>,
    fault: Option<Fault>,
    dloss: f32,
    rec: Recorder,
    /// When the current action's inputs were all in hand (trace time, µs).
    compute_start: f64,
    /// The simulated backend: actions take set times instead of computing.
    sim: Option<SimCosts>,
}

/// Action times of the simulated backend, in ms.
struct SimCosts {
    forward: f64,
    backward: f64,
    weight: f64,
    factors: Vec<f64>,
    jitter: f64,
    rng: Rng,
    /// Microbatches between F and the end of their backward, per local stage:
    /// the sim holds no activations, but the schedule's memory shape is still
    /// what the trace's counters should show.
    live: Vec<usize>,
}

/// Bytes of the stand-in payload the sim passes per microbatch (4 f32s): the
/// "bytes held" its counters report, so a sim trace reads like a real one.
const SIM_PAYLOAD_BYTES: usize = 16;

impl SimCosts {
    fn duration(&mut self, kind: ActionKind, stage: usize) -> Duration {
        let base = match kind {
            ActionKind::F => self.forward,
            ActionKind::B => self.backward,
            ActionKind::I => self.backward - self.weight,
            ActionKind::W => self.weight,
        };
        let factor = self.factors.get(stage).copied().unwrap_or(1.0);
        let u = 2.0 * self.rng.next_f64() - 1.0;
        Duration::from_secs_f64((base * factor * (1.0 + self.jitter * u)).max(0.0) / 1e3)
    }
}

/// Sleeps until `deadline`: the OS sleep for all but the last stretch, then
/// yielding, so simulated actions end on time without hogging a core.
///
/// The stretch is long because on a shared 2-vCPU VM a woken thread can wait
/// hundreds of µs for a core, and a stage that wakes late delays every stage
/// after it. Alternating runs of `bench --sim --cells 8x32,32x256` (four
/// rounds each) measured pp = 32, m = 256 at 4.6% overhead with 150 µs,
/// 3.5% with a margin learnt from each thread's recent lateness, 2.75% with
/// 600 µs; pp = 8 was the same with all three (about 2%). A yielding thread
/// gives its core to any other that is ready, so the long stretch costs idle
/// cycles, not other stages' time.
fn sleep_until(deadline: Instant) {
    const YIELD_FOR: Duration = Duration::from_micros(600);
    let now = Instant::now();
    if deadline > now + YIELD_FOR {
        std::thread::sleep(deadline - now - YIELD_FOR);
    }
    while Instant::now() < deadline {
        std::thread::yield_now();
    }
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

fn worker_main(mut args: StageArgs, rx: Receiver<StageMsg>) {
    let (rank, replica) = (args.rank, args.replica);
    let step = args.resume.as_ref().map_or(0, |c| c.state.step);
    let links = std::mem::replace(&mut args.links, Links::Detached { failure: Default::default() });
    // Worker::new consumes the links; a panic there must still reach the coordinator.
    let coordinator = match &links {
        Links::Actors { coordinator, .. } => Some(coordinator.clone()),
        Links::Detached { .. } => None,
    };
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Worker::new(args, rx, links)));
    let could_not_start =
        |e: String| Failure::new(rank, replica, step, None, format!("could not start: {e}"));
    match built {
        Ok(Ok(mut w)) => w.run(),
        Ok(Err((e, links))) => links.fail(could_not_start(e)),
        Err(p) => {
            let f = could_not_start(panic_text(&p));
            match coordinator {
                Some(c) => drop(c.send_message(CoordinatorMsg::Failed(f))),
                None => eprintln!("{f}"),
            }
        }
    }
}

/// Replays one stage alone on this thread: `rx` carries its recorded inputs,
/// `args.log` checks what it does against the recording.
pub fn replay_stage(args: StageArgs, rx: Receiver<StageMsg>) -> Result<Option<ActorLog>, String> {
    let links = Links::Detached { failure: Default::default() };
    let mut w = Worker::new(args, rx, links).map_err(|(e, _)| e)?;
    w.run();
    if let Links::Detached { failure } = &w.links {
        if let Some(f) = failure.lock().expect("failure slot").take() {
            return Err(f.to_string());
        }
    }
    Ok(w.log.take())
}

/// (sending stage, receiving stage, microbatch, what) of a message between stages.
fn send_of(msg: &StageMsg) -> (Option<usize>, Option<usize>, Option<usize>, &'static str) {
    match msg {
        StageMsg::Activation { stage, mb, .. } => (Some(stage - 1), Some(*stage), Some(*mb), "activation"),
        StageMsg::Gradient { stage, mb, .. } => (Some(stage + 1), Some(*stage), Some(*mb), "gradient"),
        _ => (None, None, None, "tied embedding gradient share"),
    }
}

pub(super) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

/// `PIPEWRIGHT_FAULT_NAN=3,4,5`: the loss of those (0-based) steps is NaN, once
/// each per process — a poisoned batch, for the recovery tests.
fn nan_fault(step: u64) -> bool {
    listed_fault("PIPEWRIGHT_FAULT_NAN", step)
}

/// `PIPEWRIGHT_FAULT_INF=2,3`: a gradient of those steps overflows to +inf
/// while the loss stays finite — what dynamic loss scaling must absorb.
fn inf_fault(step: u64) -> bool {
    listed_fault("PIPEWRIGHT_FAULT_INF", step)
}

fn listed_fault(var: &str, step: u64) -> bool {
    static FIRED: std::sync::Mutex<Vec<(String, u64)>> = std::sync::Mutex::new(Vec::new());
    let Ok(v) = std::env::var(var) else { return false };
    let listed = v.split(',').any(|s| s.trim().parse::<u64>().ok() == Some(step));
    let key = (var.to_string(), step);
    let mut fired = FIRED.lock().expect("fault log");
    if listed && !fired.contains(&key) {
        fired.push(key);
        return true;
    }
    false
}

/// With `PIPEWRIGHT_FAULT_ONCE=1` the fault fires only once per process (a
/// transient failure, for `--max-restarts`).
fn fault_fires() -> bool {
    static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    std::env::var_os("PIPEWRIGHT_FAULT_ONCE").is_none()
        || !FIRED.swap(true, std::sync::atomic::Ordering::SeqCst)
}

/// `PIPEWRIGHT_FAULT=stage=S,step=N,mb=M` makes F of (S, M) at step N panic
/// (`,kind=error`: the compute thread reports an error and ends instead): how
/// the tests check that a failing stage is reported and nothing hangs.
fn fault_from_env() -> Option<Fault> {
    let v = std::env::var("PIPEWRIGHT_FAULT").ok()?;
    let mut f = Fault { stage: usize::MAX, step: u64::MAX, mb: usize::MAX, error: false };
    for kv in v.split(',') {
        let (k, val) = kv.split_once('=')?;
        match (k.trim(), val.trim()) {
            ("stage", val) => f.stage = val.parse().ok()?,
            ("step", val) => f.step = val.parse().ok()?,
            ("mb", val) => f.mb = val.parse().ok()?,
            ("kind", "panic") => f.error = false,
            ("kind", "error") => f.error = true,
            _ => return None,
        }
    }
    Some(f)
}

/// A `PIPEWRIGHT_FAULT`: where F fails, and whether as an error or a panic.
#[derive(Clone, Copy)]
struct Fault {
    stage: usize,
    step: u64,
    mb: usize,
    error: bool,
}

impl Worker {
    /// Handles control messages until `Stop` (or a closed channel); a panic is
    /// reported as a failure naming this rank, step and action.
    fn run(&mut self) {
        while let Ok(msg) = self.next_control() {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handle_control(msg)));
            match result {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) | Ok(Err(Stopped)) => break,
                Err(p) => {
                    let action = self.current.map(|a| a.to_string());
                    let f = Failure::new(self.rank, self.replica, self.step, action, panic_text(&p));
                    self.links.fail(f);
                    return;
                }
            }
        }
        if let Some(log) = &mut self.log {
            if let Err(e) = log.finish() {
                let f = Failure::new(self.rank, self.replica, self.step, None, e);
                self.links.fail(f);
            }
        }
    }

    fn new(args: StageArgs, rx: Receiver<StageMsg>, links: Links) -> Result<Worker, (String, Links)> {
        let compute = match Worker::prepare(&args) {
            Ok(x) => x,
            Err(e) => return Err((e, links)),
        };
        let cfg = &args.cfg;
        let gpt = GptConfig::from_config(cfg);
        let stages = args.layout.stages_of(args.rank);
        let b = cfg.train.micro_batch_size;
        let simulated = cfg.backend.kind == "sim";
        let actions = args.layout.schedule.actions[args.rank].clone();
        let l = &args.layout;
        let dloss = 1.0 / (l.dp * l.microbatches * b * gpt.block_size) as f32;
        let local_stages = stages.len();
        Ok(Worker {
            rank: args.rank,
            replica: args.replica,
            layout: args.layout,
            gpt,
            stages,
            compute,
            hyper: Hyper::from_config(cfg),
            actions,
            rx,
            inbox: BTreeMap::new(),
            control: VecDeque::new(),
            links,
            log: args.log,
            step: 0,
            current: None,
            latencies_us: args.latencies_us.clone(),
            norms: Vec::new(),
            fault: fault_from_env(),
            dloss,
            rec: Recorder::new(args.trace_epoch.is_some(), args.trace_epoch.unwrap_or_else(Instant::now)),
            compute_start: 0.0,
            sim: simulated.then(|| SimCosts {
                forward: cfg.sim.forward_ms,
                backward: cfg.sim.backward_ms,
                weight: cfg.sim.weight_ms,
                factors: cfg.sim.stage_factors.clone(),
                jitter: cfg.sim.jitter,
                rng: Rng::new(cfg.train.seed, Purpose::Test, &[args.rank as u64, args.replica as u64, 0x51]),
                live: vec![0; local_stages],
            }),
        })
    }

    /// The fallible part of starting: the rank's chunks (initial, `--init` or
    /// resumed tensors) on its backend, with their optimizer state.
    fn prepare(args: &StageArgs) -> Result<Box<dyn StageCompute>, String> {
        // `PIPEWRIGHT_FAULT_START=stage-1`: that stage fails to start with an error,
        // for the test that a stage which never starts is reported and nothing hangs.
        let name = super::protocol::stage_name(args.rank, args.replica);
        if std::env::var("PIPEWRIGHT_FAULT_START").is_ok_and(|v| v.split(',').any(|a| a.trim() == name)) {
            return Err("injected fault (PIPEWRIGHT_FAULT_START)".into());
        }
        let cfg = &args.cfg;
        let gpt = GptConfig::from_config(cfg);
        let stages = args.layout.stages_of(args.rank);
        let b = cfg.train.micro_batch_size;
        let mut chunks = Vec::new();
        if cfg.backend.kind != "sim" {
            for &s in &stages {
                let spec = args.layout.stages[s].clone();
                let mut params = crate::model::part::part_params(&gpt, &spec, cfg.train.seed);
                if let Some(w) = &args.init {
                    w.assign_params(&mut params).map_err(|e| e.to_string())?;
                }
                if let Some(c) = &args.resume {
                    c.weights.assign_params(&mut params).map_err(|e| e.to_string())?;
                }
                chunks.push((spec, params));
            }
        }
        if cfg.backend.kind == "cuda" {
            return Worker::prepare_gpu(args, chunks);
        }
        let mut parts = Vec::new();
        let mut adam = Vec::new();
        for (spec, params) in chunks {
            let part = ModelPart::from_params(gpt, spec, b, cfg.train.recompute, params);
            let mut st = AdamState::new(&part);
            if let Some(c) = &args.resume {
                super::compute::load_moments(&part.params, &mut st, c)?;
            }
            parts.push(part);
            adam.push(st);
        }
        let cores = args.cores.clone();
        // The compute thread itself is the pool's first worker, so a rank with
        // one thread runs its kernels where it stands, with no hand-off.
        if let Some(&core) = cores.first() {
            core_affinity::set_for_current(core);
        }
        let (rank, replica) = (args.rank, args.replica);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(args.layout.threads_per_rank)
            .use_current_thread()
            .thread_name(move |i| format!("stage-{rank}.{replica}-compute-{i}"))
            .start_handler(move |i| {
                if !cores.is_empty() {
                    core_affinity::set_for_current(cores[i % cores.len()]);
                }
            })
            .build()
            .map_err(|e| e.to_string())?;
        let nondet = std::env::var("PIPEWRIGHT_NONDET").is_ok_and(|v| v.split(',').any(|a| a.trim() == name));
        Ok(Box::new(CpuCompute::new(parts, adam, pool, nondet, b)))
    }

    /// The rank's chunks on its GPU (`backend.devices`), with as many
    /// activation slots per chunk as the schedule keeps microbatches alive there.
    #[cfg(feature = "cuda")]
    fn prepare_gpu(
        args: &StageArgs,
        chunks: Vec<(crate::model::PartSpec, Vec<crate::model::Param>)>,
    ) -> Result<Box<dyn StageCompute>, String> {
        use super::compute::{GpuCompute, GpuPlace};
        use crate::kernels::cuda::{Bf16, Gpu};
        let cfg = &args.cfg;
        let devices = &cfg.backend.devices;
        let pp = args.layout.pp;
        let ordinal = match devices.len() {
            0 => 0,
            n if n == pp => devices[args.rank],
            _ => devices[args.replica * pp + args.rank],
        };
        let gpu = Gpu::new(ordinal).map_err(|e| format!("backend.devices: GPU {ordinal}: {e}"))?;
        let peak = args
            .layout
            .schedule
            .simulate(&crate::schedule::Costs::unit())
            .map_err(|e| e.to_string())?
            .peak_live;
        let live: Vec<usize> = args.layout.stages_of(args.rank).iter().map(|&s| peak[s]).collect();
        let (gpt, b, rc) = (GptConfig::from_config(cfg), cfg.train.micro_batch_size, cfg.train.recompute);
        let resume = args.resume.as_deref();
        let place = || GpuPlace {
            layout: &args.layout,
            rank: args.rank,
            replica: args.replica,
            plan: args.gpu_plan.clone(),
            host_only: args.log.is_some(),
        };
        Ok(if cfg.backend.dtype == "f32" {
            Box::new(GpuCompute::<f32>::new(gpu, chunks, gpt, b, rc, &live, resume, place())?)
        } else {
            Box::new(GpuCompute::<Bf16>::new(gpu, chunks, gpt, b, rc, &live, resume, place())?)
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn prepare_gpu(
        _args: &StageArgs,
        _chunks: Vec<(crate::model::PartSpec, Vec<crate::model::Param>)>,
    ) -> Result<Box<dyn StageCompute>, String> {
        Err(crate::kernels::BackendError::NotBuilt.to_string())
    }

    fn local(&self, stage: usize) -> usize {
        self.stages.iter().position(|&s| s == stage).expect("stage held by this rank")
    }

    /// Files a data message in the inbox, or a control message in the queue.
    fn file(&mut self, msg: StageMsg) -> Result<(), Stopped> {
        let key = match &msg {
            StageMsg::Tokens { phase, mb, .. } => Key::Tokens(*phase, *mb),
            StageMsg::Targets { phase, mb, .. } => Key::Targets(*phase, *mb),
            &StageMsg::Activation { phase, step, stage, mb, sent, .. } => {
                if phase == Phase::Train {
                    self.trace_recv(step, stage, stage - 1, mb, sent, "activation");
                }
                Key::Act(phase, stage, mb)
            }
            &StageMsg::Gradient { step, stage, mb, sent, .. } => {
                self.trace_recv(step, stage, stage + 1, mb, sent, "gradient");
                Key::Grad(stage, mb)
            }
            StageMsg::TiedShare { .. } => Key::Tied,
            StageMsg::Reduced { stage, .. } => Key::Reduced(*stage),
            StageMsg::Stop => return Err(Stopped),
            _ => {
                self.control.push_back(msg);
                return Ok(());
            }
        };
        let prev = self.inbox.insert(key, msg);
        assert!(prev.is_none(), "rank {} received {key:?} twice", self.rank);
        Ok(())
    }

    fn recv(&mut self) -> Result<(), Stopped> {
        match self.rx.recv() {
            Ok(m) => self.file(m),
            Err(_) => Err(Stopped),
        }
    }

    fn next_control(&mut self) -> Result<StageMsg, Stopped> {
        loop {
            if let Some(m) = self.control.pop_front() {
                return Ok(m);
            }
            self.recv()?;
        }
    }

    fn wait_for(&mut self, key: Key) -> Result<StageMsg, Stopped> {
        let p = self.wait_for_unlogged(key)?;
        if self.log.is_some() {
            let e = self.data_entry(key, &p);
            if let Some(log) = &mut self.log {
                log.begin(e);
            }
        }
        Ok(p)
    }

    /// The log entry of a data message taken from the inbox.
    fn data_entry(&self, key: Key, msg: &StageMsg) -> Entry {
        let keep = self.log.as_ref().is_some_and(|l| l.payloads());
        let name_of = |stage: usize| super::protocol::stage_name(self.layout.rank_of(stage), self.replica);
        let from = match key {
            Key::Tokens(..) | Key::Targets(..) => format!("loader-{}", self.replica),
            Key::Act(_, s, _) => name_of(s - 1),
            Key::Grad(s, _) => name_of(s + 1),
            Key::Tied => {
                let last = self.layout.last_stage();
                name_of(if self.stages.contains(&0) { last } else { 0 })
            }
            Key::Reduced(_) => "reducer".to_string(),
        };
        let grad_name = |stage: usize, k: usize| self.param_name(self.local(stage), k);
        msg.logged(keep, &grad_name).entry(&from, self.step, self.replica)
    }

    /// A stage's gradients (in parameter order) as blobs named by parameter.
    fn grad_blobs(&self, stage: usize, grads: &[Vec<f32>], keep: bool) -> Vec<Blob> {
        let i = self.local(stage);
        grads.iter().enumerate().map(|(k, g)| Blob::f32s(&self.param_name(i, k), g, keep)).collect()
    }

    fn param_name(&self, part: usize, k: usize) -> String {
        self.compute.param_name(part, k).unwrap_or_else(|| format!("tensor.{k}"))
    }

    fn wait_for_unlogged(&mut self, key: Key) -> Result<StageMsg, Stopped> {
        if let Some(p) = self.inbox.remove(&key) {
            return Ok(p);
        }
        let t0 = self.rec.now_us();
        loop {
            self.recv()?;
            if let Some(p) = self.inbox.remove(&key) {
                if self.rec.enabled {
                    let (stage, mb) = match self.current {
                        Some(a) => (a.stage, Some(a.mb)),
                        None => (self.stages[0], None),
                    };
                    let detail = Some(self.describe(key));
                    self.rec.span(self.replica, self.rank, stage, "wait", self.step, mb, t0, detail, None);
                }
                return Ok(p);
            }
        }
    }

    /// What a key stands for, in a trace's words.
    fn describe(&self, key: Key) -> String {
        match key {
            Key::Tokens(..) => "tokens from the data loader".into(),
            Key::Targets(..) => "targets from the data loader".into(),
            Key::Act(_, s, _) => format!("activation from stage {}", s - 1),
            Key::Grad(s, _) => format!("gradient from stage {}", s + 1),
            Key::Tied => "the other share of the tied embedding gradient".into(),
            Key::Reduced(_) => "gradients reduced over replicas".into(),
        }
    }

    /// Records the action just finished (from when its inputs were in hand).
    fn trace_action(&mut self, a: Action, name: &str) {
        if !self.rec.enabled {
            return;
        }
        let i = self.local(a.stage);
        let live = Some(self.compute.live(i));
        let start = self.compute_start;
        self.rec.span(self.replica, self.rank, a.stage, name, self.step, Some(a.mb), start, None, live);
    }

    /// Records a span on this rank's first stage (optimizer, reduction, …).
    fn trace_rank(&mut self, name: &str, start: f64) {
        if self.rec.enabled {
            self.rec.span(self.replica, self.rank, self.stages[0], name, self.step, None, start, None, None);
        }
    }

    /// A receive instant on `stage`: when `what` of microbatch `mb` from `from`
    /// reached this stage, whether or not anything was waiting for it yet.
    fn trace_recv(&mut self, step: u64, stage: usize, from: usize, mb: usize, arrived: Instant, what: &str) {
        if !self.rec.enabled {
            return;
        }
        let r = crate::trace::Record {
            replica: self.replica,
            stage,
            rank: self.rank,
            name: "recv".into(),
            step,
            mb: Some(mb),
            start_us: self.rec.us_of(arrived),
            detail: Some(format!("{what} from stage {from}")),
            peer: Some(from),
            ..Default::default()
        };
        self.rec.push(r);
    }

    fn wait_f32(&mut self, key: Key) -> Result<Vec<f32>, Stopped> {
        match self.wait_for(key)? {
            StageMsg::Activation { data, .. }
            | StageMsg::Gradient { data, .. }
            | StageMsg::TiedShare { data, .. } => Ok(data),
            _ => unreachable!("{key:?} carries f32"),
        }
    }

    fn wait_u32(&mut self, key: Key) -> Result<Vec<u32>, Stopped> {
        match self.wait_for(key)? {
            StageMsg::Tokens { tokens: v, .. } | StageMsg::Targets { targets: v, .. } => Ok(v),
            _ => unreachable!("{key:?} carries u32"),
        }
    }

    /// Delivers to the rank holding `stage` (directly into our own inbox when that is us).
    fn send_to_stage(&mut self, stage: usize, msg: StageMsg) -> Result<(), Stopped> {
        let rank = self.layout.rank_of(stage);
        self.send_to_rank(rank, msg)
    }

    fn send_to_rank(&mut self, rank: usize, msg: StageMsg) -> Result<(), Stopped> {
        if let Some(log) = &mut self.log {
            let to = super::protocol::stage_name(rank, self.replica);
            msg.logged(log.payloads(), &super::protocol::no_grad_names).record_sent(log, &to);
        }
        // Evaluation traffic has its "eval" spans; sends and receives are the step's.
        let eval = matches!(msg, StageMsg::Activation { phase: Phase::Eval, .. });
        let traced = (self.rec.enabled && !eval).then(|| (self.rec.now_us(), send_of(&msg)));
        let sent = if rank == self.rank {
            self.file(msg)
        } else {
            match &self.links {
                Links::Actors { peers, .. } => {
                    let peers = peers.get().expect("peers are set before the first step");
                    peers[rank].send_message(msg).map_err(|_| Stopped)
                }
                Links::Detached { .. } => Ok(()),
            }
        };
        if let Some((start, (from, to, mb, what))) = traced {
            let from = from.unwrap_or(self.stages[0]);
            let end = self.rec.now_us();
            self.rec.push(crate::trace::Record {
                replica: self.replica,
                stage: from,
                rank: self.rank,
                name: "send".into(),
                step: self.step,
                mb,
                start_us: start,
                dur_us: end - start,
                detail: Some(match to {
                    Some(t) => format!("{what} to stage {t}"),
                    None => format!("{what} to rank {rank}"),
                }),
                peer: to,
                ..Default::default()
            });
        }
        sent
    }

    /// Returns false when the worker should exit.
    fn handle_control(&mut self, msg: StageMsg) -> Result<bool, Stopped> {
        if self.log.is_some() && !matches!(msg, StageMsg::Stop) {
            let e = self.control_entry(&msg);
            if let Some(log) = &mut self.log {
                log.begin(e);
            }
        }
        match msg {
            StageMsg::RunStep { step, loss_scale } => self.run_step(step, loss_scale)?,
            StageMsg::Apply { step, lr, clip, skip } => {
                assert_eq!(step, self.step);
                let t = self.rec.now_us();
                if !skip {
                    self.compute.adamw(self.hyper, lr, clip);
                }
                self.trace_rank("optimizer", t);
                self.log_params();
                self.report(CoordinatorMsg::Applied { rank: self.rank, replica: self.replica, step });
            }
            StageMsg::RunEval { step, kind, batches } => self.run_eval(step, kind, batches)?,
            StageMsg::SendWeights => {
                // Replica 0's weights stand for all: the others only report their trace.
                let params = match self.replica {
                    0 => self.compute.params(),
                    _ => vec![],
                };
                let latencies = std::mem::take(&mut *self.latencies_us.lock().expect("latency log"));
                let peak_live_bytes = self.compute.peak_live_bytes();
                let trace = std::mem::take(&mut self.rec.records);
                let msg = CoordinatorMsg::Weights {
                    rank: self.rank,
                    replica: self.replica,
                    params,
                    latencies_us: latencies,
                    peak_live_bytes,
                    trace,
                };
                // The run's last message here: the log is complete before the
                // coordinator can end the run.
                self.log_report(&msg);
                if let Some(log) = &mut self.log {
                    if let Err(e) = log.finish() {
                        panic!("{e}");
                    }
                }
                self.send_report(msg);
            }
            StageMsg::Snapshot { step } => {
                let t = self.rec.now_us();
                let (tensors, adam_step) = self.compute.snapshot();
                self.trace_rank("checkpoint", t);
                self.report(CoordinatorMsg::Snapshot { rank: self.rank, step, tensors, adam_step });
            }
            StageMsg::Restore(c) => {
                if let Err(e) = self.compute.restore(&c) {
                    panic!("{e}");
                }
                self.log_params();
                self.report(CoordinatorMsg::Restored { rank: self.rank, replica: self.replica });
            }
            StageMsg::Stop => return Ok(false),
            _ => unreachable!("data messages are filed, not handled"),
        }
        Ok(true)
    }

    fn report(&mut self, msg: CoordinatorMsg) {
        self.log_report(&msg);
        self.send_report(msg);
    }

    fn log_report(&mut self, msg: &CoordinatorMsg) {
        if let Some(log) = &mut self.log {
            let (kind, blobs) = msg.logged(log.payloads(), true);
            log.sent("coordinator", kind, None, blobs);
        }
    }

    fn send_report(&mut self, msg: CoordinatorMsg) {
        if let Links::Actors { coordinator, .. } = &self.links {
            let _ = coordinator.send_message(msg);
        }
    }

    /// The log entry of a control message from the coordinator.
    fn control_entry(&self, msg: &StageMsg) -> Entry {
        msg.logged(false, &super::protocol::no_grad_names).entry("coordinator", self.step, self.replica)
    }

    /// Digests of the parameters after an optimizer step (or a rollback).
    fn log_params(&mut self) {
        if let Some(log) = &mut self.log {
            let keep = log.payloads();
            let mut blobs = Vec::new();
            self.compute.visit_params(&mut |_, name, data| blobs.push(Blob::f32s(name, data, keep)));
            log.state(blobs);
        }
    }

    fn run_step(&mut self, step: u64, loss_scale: f32) -> Result<(), Stopped> {
        self.step = step;
        self.compute.zero_grads();
        let last = self.layout.last_stage();
        let mut loss_sum = 0.0f64;
        let actions = std::mem::take(&mut self.actions);
        for &a in &actions {
            self.current = Some(a);
            if self.sim.is_some() {
                self.simulate_action(a)?;
                let name = match a.kind {
                    ActionKind::F => "F",
                    ActionKind::B => "B",
                    ActionKind::I => "I",
                    ActionKind::W => "W",
                };
                let i = self.local(a.stage);
                let sim = self.sim.as_mut().expect("sim backend");
                match a.kind {
                    ActionKind::F => sim.live[i] += 1,
                    ActionKind::B | ActionKind::W => sim.live[i] -= 1,
                    ActionKind::I => {}
                }
                let live = Some((sim.live[i], sim.live[i] * SIM_PAYLOAD_BYTES));
                if self.rec.enabled {
                    let start = self.compute_start;
                    self.rec.span(
                        self.replica,
                        self.rank,
                        a.stage,
                        name,
                        step,
                        Some(a.mb),
                        start,
                        None,
                        live,
                    );
                }
                continue;
            }
            match a.kind {
                ActionKind::F => {
                    if let Some(l) = self.forward(
                        Phase::Train,
                        a.stage,
                        a.mb,
                        Mode::Train { dloss: self.dloss * loss_scale },
                        None,
                    )? {
                        loss_sum += l;
                    }
                }
                ActionKind::B => self.backward(a.stage, a.mb, BackwardPart::Full)?,
                ActionKind::I => self.backward(a.stage, a.mb, BackwardPart::Input)?,
                ActionKind::W => self.backward(a.stage, a.mb, BackwardPart::Weight)?,
            }
            let name = match a.kind {
                ActionKind::F => "F",
                ActionKind::B => "B",
                ActionKind::I => "I",
                ActionKind::W => "W",
            };
            self.trace_action(a, name);
        }
        self.actions = actions;
        self.current = None;
        let t = self.rec.now_us();
        if self.sim.is_none() {
            self.combine_tied()?;
        }
        self.trace_rank("tied", t);
        if self.layout.dp > 1 && self.sim.is_none() {
            let t = self.rec.now_us();
            self.reduce_over_replicas()?;
            self.trace_rank("reduce", t);
        }
        if self.stages.contains(&last) && self.sim.is_none() && inf_fault(step) {
            let i = self.local(last);
            self.compute.poison_grad(i, f32::INFINITY);
        }
        let mut sumsq = Vec::new();
        if self.replica == 0 && self.sim.is_none() {
            for i in 0..self.stages.len() {
                self.compute.grad_sum_squares(i, &mut self.norms);
                sumsq.extend_from_slice(&self.norms);
            }
        }
        let holds_last = self.stages.contains(&last);
        if holds_last && nan_fault(step) {
            loss_sum = f64::NAN;
        }
        self.report(CoordinatorMsg::StageDone(StageReport {
            rank: self.rank,
            replica: self.replica,
            step,
            grad_sumsq: sumsq,
            loss_sum: holds_last.then_some(loss_sum),
        }));
        Ok(())
    }

    /// One action of the simulated backend: wait for the same inputs as the real
    /// action, take its set time, send a token-sized payload on.
    fn simulate_action(&mut self, a: Action) -> Result<(), Stopped> {
        let last = self.layout.last_stage();
        match a.kind {
            ActionKind::F => {
                if a.stage == 0 {
                    self.wait_u32(Key::Tokens(Phase::Train, a.mb))?;
                } else {
                    self.wait_f32(Key::Act(Phase::Train, a.stage, a.mb))?;
                }
                if a.stage == last {
                    self.wait_u32(Key::Targets(Phase::Train, a.mb))?;
                }
            }
            ActionKind::B | ActionKind::I if a.stage < last => {
                self.wait_f32(Key::Grad(a.stage, a.mb))?;
            }
            _ => {}
        }
        self.compute_start = self.rec.now_us();
        let start = Instant::now();
        let d = self.sim.as_mut().expect("sim backend").duration(a.kind, a.stage);
        sleep_until(start + d);
        let (step, mb) = (self.step, a.mb);
        match a.kind {
            ActionKind::F if a.stage < last => {
                let msg = StageMsg::Activation {
                    phase: Phase::Train,
                    step,
                    stage: a.stage + 1,
                    mb,
                    data: vec![0.0; 4],
                    sent: Instant::now(),
                };
                self.send_to_stage(a.stage + 1, msg)?;
            }
            ActionKind::B | ActionKind::I if a.stage > 0 => {
                let msg = StageMsg::Gradient {
                    step,
                    stage: a.stage - 1,
                    mb,
                    data: vec![0.0; 4],
                    sent: Instant::now(),
                };
                self.send_to_stage(a.stage - 1, msg)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// F of (stage, mb). Returns the microbatch's loss sum on the last stage.
    fn forward(
        &mut self,
        phase: Phase,
        stage: usize,
        mb: usize,
        mode: Mode,
        argmax: Option<&mut [u32]>,
    ) -> Result<Option<f64>, Stopped> {
        let here = |f: &Fault| phase == Phase::Train && (f.stage, f.step, f.mb) == (stage, self.step, mb);
        if let Some(fault) = self.fault.filter(here).filter(|_| fault_fires()) {
            if fault.error {
                let action = self.current.map(|a| a.to_string());
                let error =
                    format!("injected error (PIPEWRIGHT_FAULT) in F of stage {stage}, microbatch {mb}");
                self.links.fail(Failure::new(self.rank, self.replica, self.step, action, error));
                return Err(Stopped);
            }
            panic!("injected fault (PIPEWRIGHT_FAULT) in F of stage {stage}, microbatch {mb}");
        }
        let last = self.layout.last_stage();
        let tokens = if stage == 0 { Some(self.wait_u32(Key::Tokens(phase, mb))?) } else { None };
        let act = if stage > 0 { Some(self.wait_f32(Key::Act(phase, stage, mb))?) } else { None };
        let targets = if stage == last { Some(self.wait_u32(Key::Targets(phase, mb))?) } else { None };
        self.compute_start = self.rec.now_us();
        let i = self.local(stage);
        let input = match (&tokens, act) {
            (Some(t), _) => ChunkInput::Tokens(t),
            (None, Some(a)) => ChunkInput::Activation(a),
            _ => unreachable!("F has tokens or an activation"),
        };
        let out = self.compute.forward(i, mb, input, targets.as_deref(), mode, argmax);
        if let Some(y) = out.output {
            let msg = StageMsg::Activation {
                phase,
                step: self.step,
                stage: stage + 1,
                mb,
                data: y,
                sent: Instant::now(),
            };
            self.send_to_stage(stage + 1, msg)?;
        }
        Ok(out.loss_sum)
    }

    fn backward(&mut self, stage: usize, mb: usize, which: BackwardPart) -> Result<(), Stopped> {
        let last = self.layout.last_stage();
        let i = self.local(stage);
        self.compute_start = self.rec.now_us();
        if which == BackwardPart::Weight {
            self.compute.backward(i, mb, which, None);
            return Ok(());
        }
        let dout = if stage < last { Some(self.wait_f32(Key::Grad(stage, mb))?) } else { None };
        self.compute_start = self.rec.now_us();
        if let Some(g) = self.compute.backward(i, mb, which, dout) {
            let msg =
                StageMsg::Gradient { step: self.step, stage: stage - 1, mb, data: g, sent: Instant::now() };
            self.send_to_stage(stage - 1, msg)?;
        }
        Ok(())
    }

    /// Both shares of the tied embedding's gradient, summed in one order on both
    /// ranks that hold a copy: embedding share + head share.
    fn combine_tied(&mut self) -> Result<(), Stopped> {
        let last = self.layout.last_stage();
        let (first_here, last_here) = (self.stages.contains(&0), self.stages.contains(&last));
        if last == 0 {
            self.compute.combine_tied(0, None);
            return Ok(());
        }
        if first_here && last_here {
            let (a, b) = (self.local(0), self.local(last));
            let embed = self.compute.tied_share(a);
            let head = self.compute.tied_share(b);
            self.compute.combine_tied(a, Some(&head));
            self.compute.combine_tied(b, Some(&embed));
            return Ok(());
        }
        if first_here {
            let share = self.compute.tied_share(self.local(0));
            let to = self.layout.rank_of(last);
            self.send_to_rank(to, StageMsg::TiedShare { step: self.step, data: share })?;
            let head = self.wait_f32(Key::Tied)?;
            let i = self.local(0);
            self.compute.combine_tied(i, Some(&head));
        }
        if last_here {
            let share = self.compute.tied_share(self.local(last));
            let to = self.layout.rank_of(0);
            self.send_to_rank(to, StageMsg::TiedShare { step: self.step, data: share })?;
            let embed = self.wait_f32(Key::Tied)?;
            let i = self.local(last);
            self.compute.combine_tied(i, Some(&embed));
        }
        Ok(())
    }

    /// Sends each part's gradients to the reducer and takes back their sum over replicas.
    fn reduce_over_replicas(&mut self) -> Result<(), Stopped> {
        for i in 0..self.stages.len() {
            let stage = self.stages[i];
            let grads = self.compute.take_grads(i);
            if self.log.is_some() {
                let keep = self.log.as_ref().is_some_and(|l| l.payloads());
                let b = self.grad_blobs(stage, &grads, keep);
                if let Some(log) = &mut self.log {
                    log.sent("reducer", "Reduce", None, b);
                }
            }
            let msg = ReducerMsg::Reduce { step: self.step, stage, replica: self.replica, grads };
            match &self.links {
                Links::Actors { reducer, .. } => {
                    reducer.as_ref().expect("dp > 1 has a reducer").send_message(msg).map_err(|_| Stopped)?
                }
                Links::Detached { .. } => {}
            }
        }
        for i in 0..self.stages.len() {
            let stage = self.stages[i];
            let grads = match self.wait_for(Key::Reduced(stage))? {
                StageMsg::Reduced { grads, .. } => grads,
                _ => unreachable!(),
            };
            self.compute.set_grads(i, grads);
        }
        Ok(())
    }

    /// Forward-only microbatches through every stage, in microbatch order.
    fn run_eval(&mut self, step: u64, kind: EvalKind, batches: usize) -> Result<(), Stopped> {
        self.step = step;
        let last = self.layout.last_stage();
        let want_argmax = kind == EvalKind::ExactMatch && self.stages.contains(&last);
        let n = self.compute.micro_batch() * self.gpt.block_size;
        let mut predictions = Vec::with_capacity(if want_argmax { batches * n } else { 0 });
        let mut argmax = vec![0u32; if want_argmax { n } else { 0 }];
        let mut loss_sum = 0.0;
        let stages = self.stages.clone();
        for mb in 0..batches {
            for &s in &stages {
                let am = (want_argmax && s == last).then_some(argmax.as_mut_slice());
                let result = self.forward(Phase::Eval, s, mb, Mode::Eval, am)?;
                if self.rec.enabled {
                    let start = self.compute_start;
                    self.rec.span(self.replica, self.rank, s, "eval", step, Some(mb), start, None, None);
                }
                if let Some(l) = result {
                    loss_sum += l;
                    if want_argmax {
                        predictions.extend_from_slice(&argmax);
                    }
                }
            }
        }
        if stages.contains(&last) {
            self.report(CoordinatorMsg::EvalDone { step, kind, loss_sum, tokens: batches * n, predictions });
        }
        Ok(())
    }
}
