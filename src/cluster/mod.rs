//! Runs that span processes (CPU): a `ractor_cluster` node per process for
//! authenticated membership and failure detection, a framed TCP data link per
//! process pair for tensors and the actors' messages, and a launcher. Both
//! links may run under mutual TLS (`tls`), with the cookie proof inside it.
//!
//! Rank 0 is the run as one process knows it — coordinator, loaders, reducer,
//! checkpointer, monitor, and its share of the stages — and writes every
//! output. Other ranks (workers) host stages only: they get the resolved
//! config from rank 0's roster, so a worker needs nothing but the address and
//! the cookie. Where a stage lives is `Placement`'s rule; everything else is
//! the single-process runtime, unchanged. NCCL (GPUs) is not built here.

pub mod bench;
pub mod frame;
pub mod gate;
pub mod link;
pub mod mesh;
pub mod node;
pub mod slurm;
pub mod tls;
pub mod tp;
pub mod wire;

pub use mesh::{ClockEstimate, Fabric, Placement};

use crate::actors::coordinator::{CoordinatorMsg, Failure};
use crate::actors::processes::Routes;
use crate::actors::stage::StageMsg;
use crate::actors::topology::{Host, Topology};
use crate::actors::Layout;
use crate::config::Config;
use link::Cookie;
use mesh::{Event, RemoteCoordinator, RemoteReducer};
use node::{Node, NodeEvent};
use ractor::{Actor, ActorRef};
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use wire::Kind;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Cookie(#[from] link::CookieError),
    #[error(transparent)]
    Node(#[from] node::NodeError),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    // No #[from] (it would also make the link error the source, printed twice).
    #[error("data link {0}")]
    Link(link::LinkError),
    #[error(transparent)]
    Placement(#[from] mesh::PlacementError),
    #[error("{what}: {error}")]
    Io { what: String, error: std::io::Error },
    #[error("{0}")]
    Join(String),
    #[error("{0}")]
    Setup(String),
    #[error("{0}")]
    Lost(String),
    #[error("run aborted by rank 0: {0}")]
    Aborted(String),
}

impl From<link::LinkError> for ClusterError {
    fn from(e: link::LinkError) -> Self {
        ClusterError::Link(e)
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let what = what.into();
    move |error| ClusterError::Io { what, error }
}

/// The longest `worker --join-timeout`, in seconds: a day.
pub const MAX_JOIN_TIMEOUT_S: u64 = 86_400;

/// Where this process finds the run: rank 0's cluster node (its data link
/// listens on the next port) and this process's place in the run.
#[derive(Clone, Debug)]
pub struct JoinSpec {
    pub master: SocketAddr,
    pub rank: usize,
    pub world: usize,
    /// How long to wait for everyone to join (and rank 0's roster).
    pub timeout: Duration,
    /// Mutual TLS on both links; every process of a run has it or none does.
    pub tls: Option<tls::Tls>,
    /// What the cookie is bound to besides its text (a SLURM job), so a
    /// process of another run holding the same cookie file cannot join.
    pub cookie_scope: Option<String>,
}

impl JoinSpec {
    /// Flags first, then torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    pub fn resolve(
        join: Option<&str>,
        rank: Option<usize>,
        world: Option<usize>,
        timeout: Duration,
    ) -> Result<JoinSpec, ClusterError> {
        fn env<T: std::str::FromStr>(name: &str) -> Result<Option<T>, ClusterError> {
            match std::env::var(name) {
                Ok(v) => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| ClusterError::Setup(format!("{name}={v}: not valid"))),
                Err(_) => Ok(None),
            }
        }
        let join = match join {
            Some(j) => j.to_string(),
            None => match (std::env::var("MASTER_ADDR"), std::env::var("MASTER_PORT")) {
                (Ok(a), Ok(p)) => format!("{a}:{p}"),
                _ => {
                    return Err(ClusterError::Setup(
                        "--join HOST:PORT (or MASTER_ADDR and MASTER_PORT) is required".into(),
                    ))
                }
            },
        };
        let master = resolve_master(&join, &format!("--join {join}"))?;
        let rank = match rank {
            Some(r) => r,
            None => env("RANK")?.ok_or_else(|| ClusterError::Setup("--rank (or RANK) is required".into()))?,
        };
        let world = match world {
            Some(w) => w,
            None => env("WORLD_SIZE")?
                .ok_or_else(|| ClusterError::Setup("--world (or WORLD_SIZE) is required".into()))?,
        };
        if world == 0 || rank >= world {
            return Err(ClusterError::Setup(format!("--rank {rank}: must be below --world {world}")));
        }
        check_timeout(timeout)?;
        Ok(JoinSpec { master, rank, world, timeout, tls: None, cookie_scope: None })
    }

    /// `worker --slurm`: the place srun gave this task (`slurm`), with the
    /// flags given overriding it. Rank 0 is found on the step's first node
    /// at `port`, or at the port derived from the job id; the cookie is
    /// bound to the job id.
    pub fn from_slurm(
        join: Option<&str>,
        rank: Option<usize>,
        world: Option<usize>,
        port: Option<u16>,
        timeout: Duration,
        slurm: &slurm::SlurmTask,
    ) -> Result<JoinSpec, ClusterError> {
        let (rank, world) = (rank.unwrap_or(slurm.rank), world.unwrap_or(slurm.ntasks));
        if world == 0 || rank >= world {
            return Err(ClusterError::Setup(format!("--rank {rank}: must be below --world {world}")));
        }
        let master = match join {
            Some(j) => resolve_master(j, &format!("--join {j}"))?,
            None => {
                let host = slurm.rendezvous_host().map_err(|e| ClusterError::Setup(e.to_string()))?;
                let port = port.unwrap_or_else(|| slurm::default_port(slurm.job_id));
                let what = format!("rank 0's node {host} (the first of {}), port {port}", slurm.nodes_from);
                let master = resolve_master(&format!("{host}:{port}"), &what)?;
                // Some hosts map their own name to 127.0.1.1 (Debian's
                // /etc/hosts): rank 0 would listen where no other node reaches.
                if master.ip().is_loopback() && slurm.nodes.len() > 1 {
                    return Err(ClusterError::Setup(format!(
                        "{what}: resolves to {} here, a loopback address, but the step spans {} nodes; \
                         pass --join with an address the other nodes reach",
                        master.ip(),
                        slurm.nodes.len()
                    )));
                }
                master
            }
        };
        check_timeout(timeout)?;
        let cookie_scope = Some(format!("slurm job {}", slurm.job_id));
        Ok(JoinSpec { master, rank, world, timeout, tls: None, cookie_scope })
    }

    /// The run's cookie: the shared secret, bound to the scope if any.
    fn cookie(&self) -> Result<Cookie, ClusterError> {
        let shared = Cookie::from_env()?;
        Ok(match &self.cookie_scope {
            Some(scope) => shared.scoped(scope),
            None => shared,
        })
    }

    pub fn with_tls(self, tls: Option<tls::Tls>) -> JoinSpec {
        JoinSpec { tls, ..self }
    }

    pub fn data_addr(&self) -> SocketAddr {
        SocketAddr::new(self.master.ip(), self.master.port() + 1)
    }
}

/// HOST:PORT as rank 0's IPv4 address, with the next port free for its data link.
/// `what` names where the address came from, for the errors.
fn resolve_master(join: &str, what: &str) -> Result<SocketAddr, ClusterError> {
    let master = join
        .to_socket_addrs()
        .map_err(|e| ClusterError::Setup(format!("{what}: {e}")))?
        .find(|a| a.is_ipv4())
        .ok_or_else(|| ClusterError::Setup(format!("{what}: no IPv4 address")))?;
    if master.port() == u16::MAX {
        return Err(ClusterError::Setup(format!("{what}: the data link needs the next port free")));
    }
    Ok(master)
}

fn check_timeout(timeout: Duration) -> Result<(), ClusterError> {
    // Deadlines are `now + timeout`, which panics past the clock's range.
    if timeout.is_zero() || timeout.as_secs() > MAX_JOIN_TIMEOUT_S {
        return Err(ClusterError::Setup(format!(
            "--join-timeout {}: expected 1 to {MAX_JOIN_TIMEOUT_S} seconds",
            timeout.as_secs()
        )));
    }
    Ok(())
}

/// A runtime for the node server and the actors of a worker.
fn runtime() -> Result<tokio::runtime::Runtime, ClusterError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("cluster")
        .enable_all()
        .build()
        .map_err(io_err("cannot start the async runtime"))
}

/// Accepts data links on `listener` for as long as the process lives; peers
/// that fail the handshake are refused and logged, and the run goes on.
fn accept_links(
    listener: TcpListener,
    fabric: Arc<Fabric>,
    cookie: Cookie,
    tls: Option<tls::Tls>,
    admit_above: usize,
) {
    let world = fabric.world;
    // A listening process holds a descriptor per connection: take what the
    // system allows, as servers do, before strangers can take a share.
    gate::raise_descriptor_limit();
    std::thread::Builder::new()
        .name("link-accept".into())
        .spawn(move || {
            let gate = gate::Gate::for_this_process(link::HANDSHAKE_DESCRIPTORS);
            for s in listener.incoming() {
                let Ok(s) = s else {
                    // Out of descriptors, say: let some close before trying again.
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                let Ok(peer) = s.peer_addr() else { continue };
                let permit = match gate.admit(peer.ip()) {
                    Ok(p) => p,
                    Err(r) => {
                        if gate::worth_logging(&r) {
                            tracing::warn!(
                                "refused data link {peer}: {} ({} refused so far)",
                                r.why,
                                r.count
                            );
                        }
                        continue;
                    }
                };
                let (fabric, cookie, tls) = (fabric.clone(), cookie.clone(), tls.clone());
                // One thread per handshake: a silent peer must not hold up the next.
                let _ = std::thread::Builder::new().name("link-handshake".into()).spawn(move || {
                    let _permit = permit;
                    let Ok(deadline) = gate::Deadline::start(&s, link::HANDSHAKE_TIMEOUT) else { return };
                    let me = fabric.me;
                    let admit = |r: u32| {
                        let r = r as usize;
                        if r <= admit_above || r >= world {
                            Err(format!("rank {r} does not connect to rank {me} here"))
                        } else if fabric.has_link(r) {
                            Err(format!("rank {r} has already joined"))
                        } else {
                            Ok(())
                        }
                    };
                    let joined = link::accept(s, me as u32, world as u32, &cookie, tls.as_ref(), admit);
                    let in_time = deadline.finish();
                    match (joined, in_time) {
                        (Ok(j), true) => {
                            if let Err(e) = fabric.add_link(j.rank as usize, j.stream, j.listen) {
                                tracing::error!("error: cannot start the data link to rank {}: {e}", j.rank);
                            }
                        }
                        (_, false) => tracing::warn!(
                            "refused data link {peer}: no handshake within {:?}",
                            link::HANDSHAKE_TIMEOUT
                        ),
                        (Err(e), true) => tracing::warn!("refused data link {e}"),
                    }
                });
            }
        })
        .expect("spawn the link acceptor");
}

/// Turns node-server events into membership and failures.
fn pump_node_events(node: &Node, fabric: Arc<Fabric>, members: Arc<Mutex<node::Members>>) {
    let events = node.events.clone();
    std::thread::Builder::new()
        .name("node-events".into())
        .spawn(move || {
            while let Ok(e) = events.recv() {
                match e {
                    NodeEvent::Joined { name, addr } => {
                        let Some(r) = node::rank_of(&name) else { continue };
                        if let Err(why) = members.lock().expect("members").joined(r, &addr) {
                            tracing::warn!("refused cluster node {name} at {addr}: {why}");
                        }
                    }
                    NodeEvent::Refused { addr, why } => tracing::warn!("refused cluster node {addr}: {why}"),
                    NodeEvent::Left { name, addr } => {
                        let Some(r) = node::rank_of(&name) else { continue };
                        // A refused newcomer's session: the rank's holder is still there.
                        if !members.lock().expect("members").left(r, &addr) {
                            continue;
                        }
                        // ractor_cluster may close a rank's session when a newcomer
                        // authenticates under the same name; the process is still
                        // there. A process that is gone closes its data link too,
                        // and that link's end reports it lost.
                        if fabric.has_link(r) {
                            // At a clean end the sessions close as the processes
                            // exit: nothing to say then.
                            if mesh::wait_until(Duration::from_millis(500), || fabric.is_done()) {
                                continue;
                            }
                            tracing::warn!(
                                "cluster node {name} at {addr}: session closed; the data link to rank {r} \
                                 decides whether it is lost"
                            );
                            continue;
                        }
                        // A peer that ends the run sends Shutdown on the data link and
                        // then exits; its node session can close before that frame is
                        // read here (a separate socket). Give it a moment first.
                        mesh::wait_until(Duration::from_millis(500), || fabric.is_done());
                        fabric.lost(r, &format!("left the cluster ({name} at {addr}: node session closed)"));
                    }
                }
            }
        })
        .expect("spawn the node event pump");
}

/// Rank 0's side of a run that spans processes.
pub struct Driver {
    cookie: Cookie,
    // Kept for their lifetime: the node server runs on this runtime.
    _rt: tokio::runtime::Runtime,
    _node: Node,
    fabric: Arc<Fabric>,
    events: crossbeam_channel::Receiver<Event>,
    timeout: Duration,
}

impl Driver {
    /// Starts rank 0's node and data listener and waits until every worker has
    /// joined both.
    pub fn rendezvous(spec: &JoinSpec, placement: Placement) -> Result<Driver, ClusterError> {
        let cookie = spec.cookie()?;
        let rt = runtime()?;
        let node =
            rt.block_on(Node::start(0, &cookie, spec.master.ip(), spec.master.port(), spec.tls.as_ref()))?;
        let (fabric, events) = Fabric::new(0, spec.world);
        let _ = fabric.placement.set(placement);
        let members = Arc::new(Mutex::new(node::Members::new(spec.world, false)));
        members.lock().expect("members").set_own(0);
        pump_node_events(&node, fabric.clone(), members.clone());
        let listener = TcpListener::bind(spec.data_addr())
            .map_err(io_err(format!("cannot listen on {}", spec.data_addr())))?;
        accept_links(listener, fabric.clone(), cookie.clone(), spec.tls.clone(), 0);
        tracing::info!(
            "rank 0: waiting for {} worker(s) at {} (cluster) / {} (data){}",
            spec.world - 1,
            spec.master,
            spec.data_addr(),
            if spec.tls.is_some() { ", mutual TLS" } else { "" }
        );
        let joined = |f: &Fabric| {
            let m = members.lock().expect("members");
            f.missing().is_empty() && m.all_present()
        };
        if !mesh::wait_until(spec.timeout, || joined(&fabric)) {
            let m = members.lock().expect("members").clone();
            let missing: Vec<usize> =
                (1..spec.world).filter(|&r| !m.present(r) || !fabric.has_link(r)).collect();
            return Err(ClusterError::Join(format!(
                "ranks {missing:?} did not join within {:?} (cluster node {}, data link {})",
                spec.timeout,
                spec.master,
                spec.data_addr()
            )));
        }
        Ok(Driver { cookie, _rt: rt, _node: node, fabric, events, timeout: spec.timeout })
    }

    /// Sends every worker the resolved config and waits until their stages are up.
    pub fn start(
        &mut self,
        cfg: &Config,
        run_dir: &Path,
        resume: Option<&Path>,
        init: Option<&Path>,
    ) -> Result<Arc<Fabric>, ClusterError> {
        let _ = &self.cookie;
        *self.fabric.epoch.lock().expect("epoch") = Instant::now();
        self.fabric.set_started();
        let missing = self.fabric.missing();
        if !missing.is_empty() {
            return Err(ClusterError::Lost(format!(
                "ranks {missing:?} dropped their data links before the run started"
            )));
        }
        let mut nccl = vec![];
        if cfg.backend.kind == crate::config::BackendKind::Cuda {
            let layout = Layout::from_config(cfg).map_err(|e| ClusterError::Setup(format!("{e:#}")))?;
            let f = self.fabric.clone();
            let plan = crate::actors::stage::nccl::GpuPlan::make(&layout, |r, k| f.owner(r, k), 0)
                .map_err(|e| ClusterError::Setup(format!("NCCL: {e}")))?;
            nccl = plan.nccl.iter().map(|(k, id)| (*k, id.clone())).collect();
            let _ = self.fabric.gpu_plan.set(Arc::new(plan));
        }
        self.fabric.broadcast(Kind::Roster {
            nccl,
            config: cfg.to_toml_string(),
            config_hash: cfg.hash(),
            listen: self.fabric.listen_addrs(),
            run_dir: run_dir.display().to_string(),
            resume: resume.map(|p| p.display().to_string()),
            init: init.map(|p| p.display().to_string()),
        });
        let mut ready = vec![false; self.fabric.world];
        ready[0] = true;
        let until = Instant::now() + self.timeout;
        while !ready.iter().all(|&r| r) {
            let left = until.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(Event::Ready(r)) if r < ready.len() => ready[r] = true,
                Ok(Event::Lost { peer, why }) => {
                    return Err(ClusterError::Lost(format!(
                        "{} before the run started: {why}",
                        self.fabric.describe(peer)
                    )))
                }
                Ok(Event::Abort(r)) => return Err(ClusterError::Aborted(r)),
                Ok(_) => {}
                Err(_) => {
                    let missing: Vec<usize> = (0..ready.len()).filter(|&r| !ready[r]).collect();
                    return Err(ClusterError::Join(format!(
                        "ranks {missing:?} did not start their stages within {:?}",
                        self.timeout
                    )));
                }
            }
        }
        Ok(self.fabric.clone())
    }

    /// Tells the workers how the run ended and closes the links.
    pub fn finish(self, failure: Option<String>) {
        self.fabric.set_done();
        match failure {
            None => self.fabric.broadcast(Kind::Shutdown),
            Some(reason) => self.fabric.broadcast(Kind::Abort { reason }),
        }
        self.fabric.close_all();
    }
}

/// The address this machine uses to reach `to` (no packet is sent).
fn local_ip_towards(to: SocketAddr) -> Result<IpAddr, ClusterError> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").map_err(io_err("cannot open a UDP socket"))?;
    s.connect(to).map_err(io_err(format!("no route to {to}")))?;
    Ok(s.local_addr().map_err(io_err("local address"))?.ip())
}

/// Retries `f` until it succeeds or `timeout` passes: workers may start before rank 0.
fn retry<T, E: std::fmt::Display>(
    timeout: Duration,
    mut f: impl FnMut() -> Result<T, E>,
    refused: impl Fn(&E) -> bool,
) -> Result<T, E> {
    let until = Instant::now() + timeout;
    loop {
        match f() {
            Ok(x) => return Ok(x),
            Err(e) if !refused(&e) && Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs a worker (rank ≥ 1) until rank 0 ends the run.
pub fn run_worker(spec: &JoinSpec) -> Result<(), ClusterError> {
    let cookie = spec.cookie()?;
    let rt = runtime()?;
    // Ctrl-C reaches every process of a launch: rank 0 answers it (a
    // checkpoint, then a clean stop it passes on); a worker dying first
    // would turn that into a failure.
    rt.spawn(async {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut int) = signal(SignalKind::interrupt()) {
            while int.recv().await.is_some() {}
        }
    });
    let ip = local_ip_towards(spec.master)?;
    let node = rt.block_on(Node::start(spec.rank, &cookie, ip, 0, spec.tls.as_ref()))?;
    let connect_wait = spec.timeout.min(Duration::from_secs(60));
    // Only a connection that could not be made is tried again. Once one is
    // made, its authentication gets all the time left: a second attempt on a
    // loaded machine would meet the first one's session still holding this
    // rank, and be refused as a duplicate.
    let until = Instant::now() + connect_wait;
    retry(
        connect_wait,
        || {
            let left = until.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
            rt.block_on(node.join(spec.master, left))
        },
        |e| !matches!(e, node::NodeError::Connect { .. }),
    )?;
    let (fabric, events) = Fabric::new(spec.rank, spec.world);
    let mut members = node::Members::new(spec.world, true);
    members.set_own(spec.rank);
    let members = Arc::new(Mutex::new(members));
    pump_node_events(&node, fabric.clone(), members);
    let listener = TcpListener::bind((ip, 0)).map_err(io_err(format!("cannot listen on {ip}")))?;
    let listen = listener.local_addr().map_err(io_err("listener address"))?.to_string();
    accept_links(listener, fabric.clone(), cookie.clone(), spec.tls.clone(), spec.rank);
    let (w, rank) = (spec.world as u32, spec.rank as u32);
    let (stream, peer) = retry(
        connect_wait,
        || link::connect(spec.data_addr(), rank, w, &listen, &cookie, spec.tls.as_ref()),
        |e| matches!(e, link::LinkError::Refused { .. } | link::LinkError::Tls { .. }),
    )?;
    if peer != 0 {
        return Err(ClusterError::Setup(format!("{} answers as rank {peer}, not rank 0", spec.data_addr())));
    }
    fabric.add_link(0, stream, spec.data_addr().to_string()).map_err(io_err("data link to rank 0"))?;
    tracing::info!("rank {}: joined {} as {listen}", spec.rank, spec.master);
    let result = serve(spec, &rt, &fabric, &events, &cookie, &listen);
    if result.is_ok() {
        // Say goodbye on every link between workers before closing it: a peer
        // that has not yet read rank 0's Shutdown must see the run end here,
        // not a link to a live worker closing, which it would take for a crash.
        for p in (1..spec.world).filter(|&p| p != spec.rank) {
            fabric.send(p, frame::Frame::new(Kind::Shutdown));
        }
    }
    fabric.set_done();
    if let Err(e) = &result {
        // Rank 0 hears why, if it is still there.
        let f = Failure {
            actor: format!("process rank {}", spec.rank),
            step: fabric.step(),
            action: None,
            error: e.to_string(),
        };
        if !matches!(e, ClusterError::Aborted(_)) {
            if let Some(frame) = wire::coordinator_frame(CoordinatorMsg::Failed(f)) {
                fabric.send(0, frame);
            }
        }
    }
    fabric.close_all();
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}

fn wait_event(
    events: &crossbeam_channel::Receiver<Event>,
    fabric: &Fabric,
    timeout: Duration,
) -> Result<Event, ClusterError> {
    match events.recv_timeout(timeout) {
        Ok(Event::Lost { peer, why }) => {
            Err(ClusterError::Lost(format!("lost {}: {why}", fabric.describe(peer))))
        }
        Ok(Event::Abort(r)) => Err(ClusterError::Aborted(r)),
        Ok(e) => Ok(e),
        Err(_) => Err(ClusterError::Join(format!("nothing from rank 0 within {timeout:?}"))),
    }
}

fn serve(
    spec: &JoinSpec,
    rt: &tokio::runtime::Runtime,
    fabric: &Arc<Fabric>,
    events: &crossbeam_channel::Receiver<Event>,
    cookie: &Cookie,
    listen: &str,
) -> Result<(), ClusterError> {
    let (config, hash, addrs, run_dir, resume, init, nccl) = loop {
        match wait_event(events, fabric, spec.timeout)? {
            Event::Roster { config, config_hash, listen, run_dir, resume, init, nccl } => {
                break (config, config_hash, listen, run_dir, resume, init, nccl)
            }
            Event::Shutdown => return Ok(()),
            _ => {}
        }
    };
    let cfg =
        Config::parse(&config, "rank 0's roster", &[]).map_err(|e| ClusterError::Setup(e.to_string()))?;
    if cfg.hash() != hash {
        return Err(ClusterError::Setup(format!(
            "the config from rank 0 hashes to {} here but {hash} there (different pipewright versions?)",
            cfg.hash()
        )));
    }
    let layout = Layout::from_config(&cfg).map_err(|e| ClusterError::Setup(format!("{e:#}")))?;
    let placement = Placement::new(layout.pp, layout.dp, cfg.parallel.tp, spec.world)?;
    let _ = fabric.placement.set(placement.clone());
    if cfg.backend.kind == crate::config::BackendKind::Cuda {
        let ids = nccl.into_iter().collect();
        let plan = crate::actors::stage::nccl::GpuPlan::from_ids(
            &layout,
            |r, k| placement.owner(r, k),
            spec.rank,
            ids,
        );
        let _ = fabric.gpu_plan.set(Arc::new(plan));
    }
    fabric.set_started();
    *fabric.epoch.lock().expect("epoch") = Instant::now();
    // Links between workers: each connects to the ranks below it.
    for (q, addr) in addrs.iter().enumerate().take(spec.rank).skip(1) {
        let a: SocketAddr =
            addr.parse().map_err(|_| ClusterError::Setup(format!("rank {q}'s address {addr:?}")))?;
        let (s, r) =
            link::connect(a, spec.rank as u32, spec.world as u32, listen, cookie, spec.tls.as_ref())?;
        if r as usize != q {
            return Err(ClusterError::Setup(format!("{a} answers as rank {r}, not rank {q}")));
        }
        fabric.add_link(q, s, addr.clone()).map_err(io_err(format!("data link to rank {q}")))?;
    }
    if !mesh::wait_until(spec.timeout, || fabric.missing().is_empty()) {
        return Err(ClusterError::Join(format!(
            "ranks {:?} did not open a data link to this one",
            fabric.missing()
        )));
    }
    let clock = align_clock(spec.rank, fabric, events, CLOCK_PROBES, spec.timeout)?;
    tracing::info!(
        "rank {}: trace clock {:+.1} µs from rank 0's (best of {} probes: round trip {:.1} µs)",
        spec.rank,
        clock.offset_us,
        clock.probes,
        clock.rtt_us
    );
    let init = match init {
        Some(p) => Some(Arc::new(
            crate::model::io::load(Path::new(&p)).map_err(|e| ClusterError::Setup(format!("{e:#}")))?,
        )),
        None => None,
    };
    let resume = match resume {
        Some(p) => Some(Arc::new(
            crate::checkpoint::load(Path::new(&p)).map_err(|e| ClusterError::Setup(e.to_string()))?,
        )),
        None => None,
    };
    let run_dir = std::path::PathBuf::from(run_dir);
    let record = cfg.replay.record;
    let followers = {
        let (f, me) = (fabric.clone(), spec.rank);
        tp::spawn_followers(fabric, &cfg, &layout, move |error| {
            let failure =
                Failure { actor: format!("process rank {me}"), step: f.step(), action: None, error };
            if let Some(frame) = wire::coordinator_frame(CoordinatorMsg::Failed(failure)) {
                f.send(0, frame);
            }
        })
        .map_err(ClusterError::Setup)?
    };
    let local = StageSet { fabric: fabric.clone(), cfg, layout, run_dir: run_dir.clone(), init, resume };
    let (coordinator, stages) = rt.block_on(local.spawn()).map_err(ClusterError::Setup)?;
    fabric.send(0, frame::Frame::new(Kind::Ready { rank: spec.rank as u32 }));
    let outcome = loop {
        match events.recv() {
            Ok(Event::Shutdown) => break Ok(()),
            Ok(Event::Abort(r)) => break Err(ClusterError::Aborted(r)),
            Ok(Event::Lost { peer, why }) => {
                let lost = format!("lost {}: {why}", fabric.describe(peer));
                if peer == 0 {
                    break Err(ClusterError::Lost(lost));
                }
                // Tell rank 0, then give its abort (which names the first
                // failure, not this echo of it) a moment to arrive.
                let f = Failure {
                    actor: format!("process rank {}", spec.rank),
                    step: fabric.step(),
                    action: None,
                    error: lost.clone(),
                };
                if let Some(frame) = wire::coordinator_frame(CoordinatorMsg::Failed(f)) {
                    fabric.send(0, frame);
                }
                let until = Instant::now() + Duration::from_secs(3);
                let mut result = Err(ClusterError::Lost(lost));
                while let Ok(e) = events.recv_deadline(until) {
                    if let Event::Abort(r) = e {
                        result = Err(ClusterError::Aborted(r));
                        break;
                    }
                }
                break result;
            }
            Ok(_) => {}
            Err(_) => break Err(ClusterError::Lost("the event channel closed".into())),
        }
    };
    fabric.set_done();
    for s in stages {
        s.stop(None);
    }
    // Followers see the run end within their next wait.
    for t in followers {
        let _ = t.join();
    }
    coordinator.stop(None);
    // The stages' threads close their replay logs after this; the process must not end first.
    if record && !crate::replay::wait_closed(&run_dir, Duration::from_secs(30)) {
        tracing::warn!("rank {}: replay logs in {} still open after 30 s", spec.rank, run_dir.display());
    }
    outcome
}

/// Probes per clock alignment: the shortest round trip of these bounds the error.
const CLOCK_PROBES: u32 = 16;

/// Puts this worker's trace clock on rank 0's before any stage starts: each
/// probe reads rank 0's clock, the probe with the shortest round trip is kept
/// (queueing only ever adds delay), and rank 0's reading is taken to fall at
/// its midpoint. The epoch moves by the offset, so every record this process
/// makes is on rank 0's clock, to within half that round trip.
fn align_clock(
    rank: usize,
    fabric: &Fabric,
    events: &crossbeam_channel::Receiver<Event>,
    probes: u32,
    timeout: Duration,
) -> Result<ClockEstimate, ClusterError> {
    let epoch = *fabric.epoch.lock().expect("epoch");
    let local = |t: Instant| t.saturating_duration_since(epoch).as_secs_f64() * 1e6;
    let mut best: Option<(f64, f64)> = None;
    for seq in 0..probes as u64 {
        let sent = Instant::now();
        fabric.send(0, frame::Frame::new(Kind::ClockProbe { seq }));
        let (remote_us, at) = loop {
            match wait_event(events, fabric, timeout)? {
                Event::ClockReply { seq: s, remote_us, at } if s == seq => break (remote_us, at),
                Event::Shutdown => {
                    return Err(ClusterError::Setup("rank 0 ended the run during clock alignment".into()))
                }
                _ => {}
            }
        };
        let (t1, t2) = (local(sent), local(at));
        let (rtt, offset) = (t2 - t1, remote_us - (t1 + t2) / 2.0);
        if best.is_none_or(|(r, _)| rtt < r) {
            best = Some((rtt, offset));
        }
    }
    let (rtt_us, offset_us) = best.unwrap_or((0.0, 0.0));
    let shift = Duration::from_secs_f64(offset_us.abs() / 1e6);
    let moved = if offset_us >= 0.0 { epoch.checked_sub(shift) } else { epoch.checked_add(shift) };
    *fabric.epoch.lock().expect("epoch") = moved.unwrap_or(epoch);
    let c = ClockEstimate { rank, offset_us, rtt_us, probes };
    fabric.send(0, frame::Frame::new(Kind::ClockReport { rank: rank as u32, offset_us, rtt_us, probes }));
    Ok(c)
}

/// The stages one worker hosts, with stand-ins for everything they talk to elsewhere.
struct StageSet {
    fabric: Arc<Fabric>,
    cfg: Config,
    layout: Layout,
    run_dir: std::path::PathBuf,
    init: Option<Arc<crate::model::io::LoadedWeights>>,
    resume: Option<Arc<crate::checkpoint::Loaded>>,
}

impl StageSet {
    async fn spawn(self) -> Result<(ActorRef<CoordinatorMsg>, Vec<ActorRef<StageMsg>>), String> {
        let StageSet { fabric, cfg, layout, run_dir, init, resume } = self;
        let e = |e: ractor::SpawnErr| e.to_string();
        let (coordinator, _) = Actor::spawn(None, RemoteCoordinator, fabric.clone()).await.map_err(e)?;
        let reducer = if layout.dp > 1 {
            Some(Actor::spawn(None, RemoteReducer, fabric.clone()).await.map_err(e)?.0)
        } else {
            None
        };
        let trace =
            cfg.trace.enabled.then(|| crate::trace::RunTrace::start(*fabric.epoch.lock().expect("epoch")));
        let mut topology = Topology::new(cfg, layout, run_dir, init, resume).map_err(|e| e.to_string())?;
        topology.trace = trace;
        topology.gpu_plan = fabric.gpu_plan.get().cloned();
        let host = Host::Worker(fabric.clone());
        let stages = topology
            .spawn_stages(&host, &coordinator, reducer, coordinator.get_cell())
            .await
            .map_err(|e| e.to_string())?;
        let routes = host.local_routes(&stages);
        let local = routes.iter().flatten().flatten().cloned().collect();
        fabric.set_routes(Routes { stages: routes, coordinator: None, reducer: None });
        Ok((coordinator, local))
    }
}

/// Picks a port P on 127.0.0.1 with P + 1 also free (cluster node, data link).
fn free_port_pair() -> Result<u16, ClusterError> {
    for _ in 0..100 {
        let a = TcpListener::bind("127.0.0.1:0").map_err(io_err("cannot find a free port"))?;
        let p = a.local_addr().map_err(io_err("local address"))?.port();
        if p < u16::MAX && TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return Ok(p);
        }
    }
    Err(ClusterError::Setup("no free pair of ports on 127.0.0.1".into()))
}

/// A launch's cookie file in the temporary directory: this, its process id, `-`, its port.
const COOKIE_PREFIX: &str = "pipewright-cookie-";

/// Removes the cookie files of launches that are gone. A launch removes its
/// own when it ends, but one that is SIGKILLed cannot; without this each
/// such launch left a secret behind in the temporary directory for good.
/// Only files this user may remove and whose launch process no longer
/// exists are touched (`kill(pid, 0)` says ESRCH).
fn remove_stale_cookies(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(COOKIE_PREFIX)) else { continue };
        let Some(pid) = rest.split_once('-').and_then(|(pid, _)| pid.parse::<libc::pid_t>().ok()) else {
            continue;
        };
        if pid <= 0 || !e.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        // SAFETY: signal 0 only checks that the process exists; nothing is sent.
        let gone = unsafe { libc::kill(pid, 0) } == -1
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Starts `nodes` processes of this binary on this machine (`worker` with
/// `args`, ranks 0..nodes) under a fresh cookie, and waits for them. When one
/// fails, the others get `grace` to stop on their own before they are killed.
pub fn launch(
    nodes: usize,
    port: Option<u16>,
    args: &[std::ffi::OsString],
    grace: Duration,
) -> Result<(), ClusterError> {
    if nodes == 0 {
        return Err(ClusterError::Setup("--nodes: at least 1".into()));
    }
    let port = match port {
        Some(p) => p,
        None => free_port_pair()?,
    };
    let cookie = Cookie::generate().map_err(io_err("cannot read /dev/urandom"))?;
    remove_stale_cookies(&std::env::temp_dir());
    let path = std::env::temp_dir().join(format!("{COOKIE_PREFIX}{}-{port}", std::process::id()));
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err(format!("{}: cannot create", path.display())))?;
        f.write_all(cookie.as_bytes()).map_err(io_err(format!("{}: cannot write", path.display())))?;
    }
    let exe = std::env::current_exe().map_err(io_err("cannot find this executable"))?;
    let mut children = Vec::new();
    for rank in 0..nodes {
        let child = std::process::Command::new(&exe)
            .arg("worker")
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", nodes.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("PIPEWRIGHT_COOKIE_FILE", &path)
            .env_remove("PIPEWRIGHT_COOKIE")
            .spawn()
            .map_err(io_err(format!("cannot start rank {rank}")));
        match child {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                }
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        }
    }
    let mut status: Vec<Option<std::process::ExitStatus>> = vec![None; nodes];
    let mut deadline: Option<Instant> = None;
    while status.iter().any(|s| s.is_none()) {
        for (r, c) in children.iter_mut().enumerate() {
            if let Some(child) = c {
                if let Ok(Some(s)) = child.try_wait() {
                    status[r] = Some(s);
                    *c = None;
                    if !s.success() && deadline.is_none() {
                        deadline = Some(Instant::now() + grace);
                    }
                }
            }
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            for (r, c) in children.iter_mut().enumerate() {
                if let Some(child) = c.take() {
                    tracing::warn!("launch: rank {r} did not stop within {grace:?} of a failure; killing it");
                    let mut child = child;
                    let _ = child.kill();
                    status[r] = child.wait().ok();
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_file(&path);
    let failed: Vec<String> = status
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_some_and(|s| s.success()))
        .map(|(r, s)| match s {
            Some(s) => format!("rank {r} ({s})"),
            None => format!("rank {r} (killed)"),
        })
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(ClusterError::Lost(format!("launch: {} failed", failed.join(", "))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slurm_step(nodes: &str, tasks: &str, rank: usize) -> slurm::SlurmTask {
        let env = std::collections::BTreeMap::from([
            ("SLURM_JOB_ID", "77".to_string()),
            ("SLURM_PROCID", rank.to_string()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_LOCALID", "0".into()),
            ("SLURM_STEP_NODELIST", nodes.into()),
            ("SLURM_STEP_TASKS_PER_NODE", tasks.into()),
        ]);
        slurm::SlurmTask::read(&|v| env.get(v).cloned()).unwrap()
    }

    #[test]
    fn a_slurm_task_finds_rank_0_on_the_first_node_and_flags_override_the_variables() {
        let t = slurm_step("localhost", "2", 1);
        let second = Duration::from_secs(1);
        let spec = JoinSpec::from_slurm(None, None, None, None, second, &t).unwrap();
        assert_eq!((spec.rank, spec.world), (1, 2));
        assert_eq!(spec.master, "127.0.0.1:20154".parse().unwrap());
        assert_eq!(spec.cookie_scope.as_deref(), Some("slurm job 77"));
        let spec = JoinSpec::from_slurm(None, Some(0), Some(3), Some(4000), second, &t).unwrap();
        assert_eq!((spec.rank, spec.world, spec.master.port()), (0, 3, 4000));
        let spec = JoinSpec::from_slurm(Some("127.0.0.1:5000"), None, None, None, second, &t).unwrap();
        assert_eq!(spec.master.port(), 5000);
        let e = JoinSpec::from_slurm(None, Some(2), None, None, second, &t).unwrap_err().to_string();
        assert!(e.contains("--rank 2: must be below --world 2"), "{e}");
    }

    #[test]
    fn a_first_node_that_resolves_to_loopback_in_a_multi_node_step_is_refused() {
        let t = slurm_step("localhost,n2", "1(x2)", 1);
        let e =
            JoinSpec::from_slurm(None, None, None, None, Duration::from_secs(1), &t).unwrap_err().to_string();
        assert!(e.contains("rank 0's node localhost (the first of SLURM_STEP_NODELIST), port 20154"), "{e}");
        assert!(e.contains("a loopback address, but the step spans 2 nodes") && e.contains("--join"), "{e}");
    }

    #[test]
    fn cookie_files_of_launches_that_are_gone_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        // A process that has exited and been reaped: its pid names no process.
        let mut done = std::process::Command::new("true").spawn().unwrap();
        let dead = done.id();
        done.wait().unwrap();
        let stale = dir.path().join(format!("{COOKIE_PREFIX}{dead}-29500"));
        let live = dir.path().join(format!("{COOKIE_PREFIX}{}-29502", std::process::id()));
        let other = dir.path().join("pipewright-cookie-notes.txt");
        for p in [&stale, &live, &other] {
            std::fs::write(p, "secret").unwrap();
        }
        remove_stale_cookies(dir.path());
        assert!(!stale.exists(), "the cookie of a launch that is gone stays behind");
        assert!(live.exists() && other.exists(), "a live launch's cookie or another file was removed");
    }
}
