//! The control plane's membership: a `ractor_cluster` node per process,
//! authenticated with the run's cookie. Rank 0 listens; workers connect.
//!
//! What the node server reports becomes `NodeEvent`s: a session that closes
//! before authenticating is a refused peer (logged with its address), and an
//! authenticated worker whose session closes has left the run.
//!
//! Rank 0 accepts the node's connections itself and hands each to the node
//! server (after its TLS handshake, under TLS), rather than letting
//! ractor_cluster's listener take them: that listener admits any number of
//! connections that never authenticate, holding a descriptor each for ever,
//! awaits TLS handshakes in turn with no time limit (one silent connection
//! would hold up every later join), and drops a failed one without saying
//! whose it was. Here unauthenticated connections are capped per address and
//! in all (`gate`), and every session that has not authenticated within
//! `HANDSHAKE_TIMEOUT` of opening is closed.

use super::gate::{self, Gate, Permit};
use super::link::{Cookie, HANDSHAKE_TIMEOUT};
use super::tls::Tls;
use crossbeam_channel::{Receiver, Sender};
use ractor::{Actor, ActorRef};
use ractor_cluster::node::{NodeEventSubscription, NodeServerSessionInformation};
use ractor_cluster::{
    ClientConnectErr, IncomingEncryptionMode, NetworkStream, NodeServer, NodeServerMessage,
};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot start the cluster node on {addr}: {why}")]
    Start { addr: SocketAddr, why: String },
    #[error("cannot reach rank 0's cluster node at {addr}: {why}")]
    Connect { addr: SocketAddr, why: String },
    #[error("rank 0's cluster node at {addr} refused this node: authentication failed ({hint})")]
    Refused { addr: SocketAddr, hint: &'static str },
    #[error("rank 0's cluster node at {addr}: TLS: {why}")]
    Tls { addr: SocketAddr, why: String },
    #[error("rank 0's cluster node at {0} did not authenticate this node within {1:?}")]
    Timeout(SocketAddr, Duration),
}

#[derive(Debug, Clone)]
pub enum NodeEvent {
    /// A peer proved it holds the cookie.
    Joined { name: String, addr: String },
    /// A session closed before authenticating, or a TLS handshake failed.
    Refused { addr: String, why: String },
    /// An authenticated peer's session closed.
    Left { name: String, addr: String },
}

pub fn node_name(rank: usize) -> String {
    format!("pipewright-rank-{rank}")
}

/// The rank a node name stands for (ractor_cluster reports `name@host`).
pub fn rank_of(name: &str) -> Option<usize> {
    let name = name.split('@').next()?;
    name.strip_prefix("pipewright-rank-")?.parse().ok()
}

/// Whose node session stands for one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Member {
    Absent,
    /// Present from the start (a worker's view of its peers), session not yet seen.
    Assumed,
    /// The session from this address.
    At(String),
}

/// Which session holds each rank. A second process with the right cookie
/// claiming a rank already held (a duplicate `--rank`, or one started with
/// another `--world`) is a newcomer to refuse: its session neither takes the
/// rank over nor, when it closes, ends the run of the process that has it.
#[derive(Clone, Debug)]
pub struct Members(Vec<Member>);

impl Members {
    /// `world` ranks, all present (`assumed`) or none yet.
    pub fn new(world: usize, assumed: bool) -> Members {
        Members(vec![if assumed { Member::Assumed } else { Member::Absent }; world])
    }

    /// Rank `rank` is this process's own.
    pub fn set_own(&mut self, rank: usize) {
        if let Some(m) = self.0.get_mut(rank) {
            *m = Member::At("(this process)".into());
        }
    }

    /// A session from `addr` proved it holds the cookie as `rank`; Err says
    /// why it does not count (the rank is held by another session, or is not
    /// one of this run's).
    pub fn joined(&mut self, rank: usize, addr: &str) -> Result<(), String> {
        let world = self.0.len();
        let Some(m) = self.0.get_mut(rank) else {
            return Err(format!("rank {rank} is not one of this run's {world} processes"));
        };
        match m {
            Member::At(held) if held != addr => {
                Err(format!("rank {rank} is already held by {held}; the run goes on without the newcomer"))
            }
            _ => {
                *m = Member::At(addr.to_string());
                Ok(())
            }
        }
    }

    /// A session from `addr` closed: true when it was the one holding `rank`
    /// (the rank is then lost), false for a refused newcomer's.
    pub fn left(&mut self, rank: usize, addr: &str) -> bool {
        match self.0.get_mut(rank) {
            Some(m @ Member::Assumed) => {
                *m = Member::Absent;
                true
            }
            Some(m) if *m == Member::At(addr.to_string()) => {
                *m = Member::Absent;
                true
            }
            _ => false,
        }
    }

    pub fn present(&self, rank: usize) -> bool {
        self.0.get(rank).is_some_and(|m| *m != Member::Absent)
    }

    pub fn all_present(&self) -> bool {
        (0..self.0.len()).all(|r| self.present(r))
    }
}

struct Subscription {
    tx: Sender<NodeEvent>,
    authenticated: Arc<Mutex<HashSet<u64>>>,
    /// Why a session that never authenticated most likely failed.
    refusal: &'static str,
    /// The gate's permits of connections not yet authenticated, by peer address.
    pending: Pending,
    /// Sessions closed for running past the deadline (their refusal says so).
    expired: Arc<Mutex<HashSet<u64>>>,
}

type Pending = Arc<Mutex<HashMap<String, Permit>>>;

fn release(pending: &Pending, addr: &str) {
    pending.lock().unwrap_or_else(|p| p.into_inner()).remove(addr);
}

/// Says a session joined, once: the subscription and the catch-up after it
/// may both see the same session.
fn announce_joined(set: &Mutex<HashSet<u64>>, tx: &Sender<NodeEvent>, ses: &NodeServerSessionInformation) {
    if set.lock().expect("auth set").insert(ses.node_id) {
        let _ = tx.send(NodeEvent::Joined { name: name_of(ses), addr: ses.peer_addr.clone() });
    }
}

fn name_of(ses: &NodeServerSessionInformation) -> String {
    ses.peer_name.as_ref().map(|n| n.name.clone()).unwrap_or_default()
}

impl NodeEventSubscription for Subscription {
    fn node_session_opened(&self, ses: NodeServerSessionInformation) {
        // Every session, from whichever listener: authenticate in time or go.
        let (authenticated, expired) = (self.authenticated.clone(), self.expired.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            tokio::time::sleep(HANDSHAKE_TIMEOUT).await;
            if authenticated.lock().expect("auth set").contains(&ses.node_id) {
                return;
            }
            expired.lock().expect("expired set").insert(ses.node_id);
            ses.actor.stop(Some(format!("no authentication within {HANDSHAKE_TIMEOUT:?}")));
        });
    }

    fn node_session_authenticated(&self, ses: NodeServerSessionInformation) {
        release(&self.pending, &ses.peer_addr);
        announce_joined(&self.authenticated, &self.tx, &ses);
    }

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        release(&self.pending, &ses.peer_addr);
        let was = self.authenticated.lock().expect("auth set").remove(&ses.node_id);
        let late = self.expired.lock().expect("expired set").remove(&ses.node_id);
        let addr = ses.peer_addr.clone();
        let _ = self.tx.send(if was {
            NodeEvent::Left { name: name_of(&ses), addr }
        } else if late {
            NodeEvent::Refused { addr, why: format!("no authentication within {HANDSHAKE_TIMEOUT:?}") }
        } else {
            NodeEvent::Refused { addr, why: self.refusal.into() }
        });
    }
}

pub struct Node {
    pub server: ActorRef<NodeServerMessage>,
    pub events: Receiver<NodeEvent>,
    tls: Option<Tls>,
}

impl Node {
    /// Starts this process's node, listening on `ip:port` (port 0: any), under
    /// mutual TLS when `tls` is given.
    pub async fn start(
        rank: usize,
        cookie: &Cookie,
        ip: IpAddr,
        port: u16,
        tls: Option<&Tls>,
    ) -> Result<Node, NodeError> {
        let addr = SocketAddr::new(ip, port);
        let start = |why: String| NodeError::Start { addr, why };
        let (name, host, cookie) = (node_name(rank), ip.to_string(), cookie.text().to_string());
        // ractor_cluster's own listener cannot be turned off: it gets a port
        // of its own (demanding the same mutual TLS), nobody is told of it,
        // and its sessions are held to the same deadline. Rank 0's real port
        // is served below.
        let mode = tls.map(|t| IncomingEncryptionMode::Tls(t.acceptor()));
        let server = NodeServer::new(0, cookie, name, host, mode, None).with_listen_addr(ip);
        let (server, _) = Actor::spawn(None, server, ()).await.map_err(|e| start(e.to_string()))?;
        let (tx, events) = crossbeam_channel::unbounded();
        // Under TLS a session only gets here once its certificate passed.
        let refusal = match tls {
            // ractor_cluster also ends the session of a second node under a
            // name already connected (a duplicate rank) before it authenticates.
            Some(_) => "authentication failed (wrong cookie, or a second process for a rank already held?)",
            None => {
                "authentication failed (wrong cookie, a peer that runs TLS, or a second process for a rank \
                 already held?)"
            }
        };
        let authenticated = Arc::new(Mutex::new(HashSet::new()));
        let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
        let sub = Subscription {
            tx: tx.clone(),
            authenticated: authenticated.clone(),
            refusal,
            pending: pending.clone(),
            expired: Arc::new(Mutex::new(HashSet::new())),
        };
        server
            .cast(NodeServerMessage::SubscribeToEvents {
                id: "pipewright".into(),
                subscription: Box::new(sub),
            })
            .map_err(|e| start(e.to_string()))?;
        // The node listens from its spawn on, before the subscription above
        // is in place: on a loaded machine a fast peer can authenticate in
        // between, and nobody would hear of it. The server answers this after
        // the subscription, so every session is heard of here or there.
        let sessions = ractor::call_t!(server, NodeServerMessage::GetSessions, 10_000)
            .map_err(|e| start(format!("the node's sessions: {e}")))?;
        for ses in sessions.values() {
            announce_joined(&authenticated, &tx, ses);
        }
        if port != 0 {
            let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| start(e.to_string()))?;
            // ractor_cluster splits the session's one socket without duplicating it.
            let gate = Gate::for_this_process(1);
            tokio::spawn(accept_nodes(listener, server.clone(), tls.cloned(), tx, gate, pending));
        }
        Ok(Node { server, events, tls: tls.cloned() })
    }

    /// Connects to rank 0's node and waits until the cookie is accepted.
    pub async fn join(&self, master: SocketAddr, timeout: Duration) -> Result<(), NodeError> {
        let connect_err = |e: ClientConnectErr| connect_error(master, e);
        match &self.tls {
            None => ractor_cluster::client_connect(&self.server, master).await.map_err(connect_err)?,
            Some(t) => {
                let connect = ractor_cluster::client_connect_enc(
                    &self.server,
                    master,
                    t.connector(),
                    Tls::server_name(),
                );
                tokio::time::timeout(HANDSHAKE_TIMEOUT, connect)
                    .await
                    .map_err(|_| NodeError::Tls {
                        addr: master,
                        why: format!(
                            "no TLS handshake within {HANDSHAKE_TIMEOUT:?} (does it run without TLS?)"
                        ),
                    })?
                    .map_err(connect_err)?
            }
        }
        // In TLS 1.3 the server checks this node's certificate after the
        // client's side of the handshake is done, so a refused certificate
        // shows here, as a session closed before authenticating.
        let hint = if self.tls.is_some() {
            "wrong cookie, a live process of the run already holding this rank, a certificate rank 0's CA \
             did not sign, or rank 0 runs without TLS?"
        } else {
            "wrong cookie, a live process of the run already holding this rank, or rank 0 runs with TLS?"
        };
        let events = self.events.clone();
        let wait = tokio::task::spawn_blocking(move || match events.recv_timeout(timeout) {
            Ok(NodeEvent::Joined { .. }) => Ok(()),
            Ok(NodeEvent::Refused { .. } | NodeEvent::Left { .. }) => {
                Err(NodeError::Refused { addr: master, hint })
            }
            Err(_) => Err(NodeError::Timeout(master, timeout)),
        });
        wait.await.map_err(|e| NodeError::Connect { addr: master, why: e.to_string() })?
    }
}

/// Rank 0's cluster port: each connection past the gate is refused at once;
/// under TLS its handshake runs on its own task with a time limit, and a
/// failed one is reported with the peer's address; an admitted connection
/// goes to the node server as if its own listener had accepted it, holding
/// its permit until its session authenticates or closes.
async fn accept_nodes(
    listener: tokio::net::TcpListener,
    server: ActorRef<NodeServerMessage>,
    tls: Option<Tls>,
    events: Sender<NodeEvent>,
    gate: Arc<Gate>,
    pending: Pending,
) {
    loop {
        let (stream, peer_addr) = match listener.accept().await {
            Ok(x) => x,
            Err(_) => {
                // Out of file descriptors, say: let some close before trying again.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let refused = {
            let events = events.clone();
            move |why: String| {
                let _ = events.send(NodeEvent::Refused { addr: peer_addr.to_string(), why });
            }
        };
        let permit = match gate.admit(peer_addr.ip()) {
            Ok(p) => p,
            Err(r) => {
                if gate::worth_logging(&r) {
                    refused(format!("{} ({} refused so far)", r.why, r.count));
                }
                continue;
            }
        };
        // Held until the session authenticates or closes (the subscription
        // releases it), or dropped here if no session opens.
        pending.lock().unwrap_or_else(|p| p.into_inner()).insert(peer_addr.to_string(), permit);
        let (server, tls, pending) = (server.clone(), tls.clone(), pending.clone());
        tokio::spawn(async move {
            let key = peer_addr.to_string();
            let opened = match stream.local_addr() {
                Err(_) => false,
                Ok(local_addr) => {
                    let _ = stream.set_nodelay(true);
                    let stream = match tls {
                        None => Some(NetworkStream::Raw { peer_addr, local_addr, stream }),
                        Some(tls) => {
                            match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.acceptor().accept(stream)).await
                            {
                                Ok(Ok(stream)) => {
                                    Some(NetworkStream::TlsServer { peer_addr, local_addr, stream })
                                }
                                Ok(Err(e)) => {
                                    refused(format!("TLS handshake failed: {e}"));
                                    None
                                }
                                Err(_) => {
                                    refused(format!("no TLS handshake within {HANDSHAKE_TIMEOUT:?}"));
                                    None
                                }
                            }
                        }
                    };
                    stream.is_some_and(|stream| {
                        server
                            .cast(NodeServerMessage::ConnectionOpened {
                                stream: Box::new(stream),
                                is_server: true,
                            })
                            .is_ok()
                    })
                }
            };
            if !opened {
                release(&pending, &key);
                return;
            }
            // A session that never opens, or one the deadline closed, has no
            // more use for its place.
            tokio::time::sleep(2 * HANDSHAKE_TIMEOUT).await;
            release(&pending, &key);
        });
    }
}

#[cfg(test)]
mod membership_tests {
    use super::Members;

    #[test]
    fn a_duplicate_rank_is_refused_and_its_leaving_does_not_lose_the_rank() {
        let mut m = Members::new(2, false);
        m.set_own(0);
        m.joined(1, "10.0.0.2:5000").unwrap();
        assert!(m.all_present());
        let why = m.joined(1, "10.0.0.3:6000").unwrap_err();
        assert!(why.contains("rank 1 is already held by 10.0.0.2:5000"), "{why}");
        assert!(!m.left(1, "10.0.0.3:6000"), "the newcomer leaving loses nothing");
        assert!(m.present(1));
        assert!(m.left(1, "10.0.0.2:5000"), "the real rank 1 leaving is a loss");
        assert!(!m.present(1));
    }

    #[test]
    fn a_rank_outside_the_world_is_refused_and_assumed_peers_count_until_they_leave() {
        let mut m = Members::new(2, true);
        assert!(m.joined(2, "a").unwrap_err().contains("not one of this run's 2 processes"));
        assert!(!m.left(2, "a"));
        assert!(m.left(1, "anywhere"), "a peer assumed present and never seen is lost when it leaves");
    }
}

/// A failed connection to rank 0's node, in words: ractor_cluster's own
/// Display is its Debug dump (`Socket(Os { code: 111, … })`).
fn connect_error(master: SocketAddr, e: ClientConnectErr) -> NodeError {
    match e {
        ClientConnectErr::Encryption(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => NodeError::Tls {
            addr: master,
            why: format!("the connection closed during the handshake (does rank 0 run without TLS?): {e}"),
        },
        ClientConnectErr::Encryption(e) => {
            NodeError::Tls { addr: master, why: format!("handshake failed: {e}") }
        }
        ClientConnectErr::Socket(e) => {
            let why = match e.kind() {
                std::io::ErrorKind::ConnectionRefused => format!(
                    "the connection was refused: nothing listens on that port (is rank 0 started, and is \
                     this its cluster port?) ({e})"
                ),
                std::io::ErrorKind::TimedOut => format!("no answer (a firewall, or the wrong host?) ({e})"),
                _ => e.to_string(),
            };
            NodeError::Connect { addr: master, why }
        }
        ClientConnectErr::Messaging(e) => {
            NodeError::Connect { addr: master, why: format!("this process's cluster node stopped: {e}") }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_connection_is_a_sentence_not_a_debug_dump() {
        let master: SocketAddr = "127.0.0.1:29500".parse().unwrap();
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let e = connect_error(master, ClientConnectErr::Socket(refused)).to_string();
        assert!(e.starts_with(
            "cannot reach rank 0's cluster node at 127.0.0.1:29500: the connection was refused"
        ));
        assert!(!e.contains("Socket(") && !e.contains("Os {") && !e.contains("kind:"), "{e}");
    }
}
