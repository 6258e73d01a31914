//! The control plane's membership: a `ractor_cluster` node per process,
//! authenticated with the run's cookie. Rank 0 listens; workers connect.
//!
//! What the node server reports becomes `NodeEvent`s: a session that closes
//! before authenticating is a refused peer (logged with its address), and an
//! authenticated worker whose session closes has left the run.

use super::link::Cookie;
use crossbeam_channel::{Receiver, Sender};
use ractor::{Actor, ActorRef};
use ractor_cluster::node::{NodeEventSubscription, NodeServerSessionInformation};
use ractor_cluster::{NodeServer, NodeServerMessage};
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot start the cluster node on {addr}: {why}")]
    Start { addr: SocketAddr, why: String },
    #[error("cannot reach rank 0's cluster node at {addr}: {why}")]
    Connect { addr: SocketAddr, why: String },
    #[error("rank 0's cluster node at {0} refused this node: authentication failed (wrong cookie?)")]
    Refused(SocketAddr),
    #[error("rank 0's cluster node at {0} did not authenticate this node within {1:?}")]
    Timeout(SocketAddr, Duration),
}

#[derive(Debug, Clone)]
pub enum NodeEvent {
    /// A peer proved it holds the cookie.
    Joined { name: String, addr: String },
    /// A session closed before authenticating.
    Refused { addr: String },
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

struct Subscription {
    tx: Sender<NodeEvent>,
    authenticated: Mutex<HashSet<u64>>,
}

fn name_of(ses: &NodeServerSessionInformation) -> String {
    ses.peer_name.as_ref().map(|n| n.name.clone()).unwrap_or_default()
}

impl NodeEventSubscription for Subscription {
    fn node_session_opened(&self, _ses: NodeServerSessionInformation) {}

    fn node_session_authenticated(&self, ses: NodeServerSessionInformation) {
        self.authenticated.lock().expect("auth set").insert(ses.node_id);
        let _ = self.tx.send(NodeEvent::Joined { name: name_of(&ses), addr: ses.peer_addr.clone() });
    }

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        let was = self.authenticated.lock().expect("auth set").remove(&ses.node_id);
        let addr = ses.peer_addr.clone();
        let _ = self.tx.send(if was {
            NodeEvent::Left { name: name_of(&ses), addr }
        } else {
            NodeEvent::Refused { addr }
        });
    }
}

pub struct Node {
    pub server: ActorRef<NodeServerMessage>,
    pub events: Receiver<NodeEvent>,
}

impl Node {
    /// Starts this process's node, listening on `ip:port` (port 0: any).
    pub async fn start(rank: usize, cookie: &Cookie, ip: IpAddr, port: u16) -> Result<Node, NodeError> {
        let addr = SocketAddr::new(ip, port);
        let server =
            NodeServer::new(port, cookie.text().to_string(), node_name(rank), ip.to_string(), None, None)
                .with_listen_addr(ip);
        let (server, _) = Actor::spawn(None, server, ())
            .await
            .map_err(|e| NodeError::Start { addr, why: e.to_string() })?;
        let (tx, events) = crossbeam_channel::unbounded();
        let sub = Subscription { tx, authenticated: Mutex::new(HashSet::new()) };
        server
            .cast(NodeServerMessage::SubscribeToEvents {
                id: "pipewright".into(),
                subscription: Box::new(sub),
            })
            .map_err(|e| NodeError::Start { addr, why: e.to_string() })?;
        Ok(Node { server, events })
    }

    /// Connects to rank 0's node and waits until the cookie is accepted.
    pub async fn join(&self, master: SocketAddr, timeout: Duration) -> Result<(), NodeError> {
        ractor_cluster::client_connect(&self.server, master)
            .await
            .map_err(|e| NodeError::Connect { addr: master, why: e.to_string() })?;
        let events = self.events.clone();
        let wait = tokio::task::spawn_blocking(move || match events.recv_timeout(timeout) {
            Ok(NodeEvent::Joined { .. }) => Ok(()),
            Ok(NodeEvent::Refused { .. } | NodeEvent::Left { .. }) => Err(NodeError::Refused(master)),
            Err(_) => Err(NodeError::Timeout(master, timeout)),
        });
        wait.await.map_err(|e| NodeError::Connect { addr: master, why: e.to_string() })?
    }
}
