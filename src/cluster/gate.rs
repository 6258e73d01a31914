//! What a peer that has not yet proved it holds the cookie may take from a
//! listening process: a bounded number of connections, from one address and
//! in all, each for a bounded time.
//!
//! Without this, a stranger who opens connections and says nothing (or a
//! byte every few seconds) holds a descriptor each, for ever: at the process's
//! descriptor limit the next checkpoint cannot open its file and the run
//! ends. A connection past a cap is closed at once; one admitted holds a
//! [`Permit`] until it authenticates, fails, or runs past its deadline.

use std::collections::HashMap;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Unauthenticated connections from one address. Several ranks can share a
/// host (one per GPU), so this is well above a node's process count.
pub const PER_ADDRESS: usize = 64;
/// Unauthenticated connections in all, on one listening port (at most: see
/// [`Gate::for_this_process`]).
pub const TOTAL: usize = 256;

pub struct Gate {
    per_address: usize,
    total: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    by_address: HashMap<IpAddr, usize>,
    open: usize,
    refused: u64,
}

/// Why a connection was closed at the door.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    pub why: String,
    /// Connections refused by this gate so far, this one included: callers
    /// log the first and then every thousandth, not a line per connection.
    pub count: u64,
}

/// One admitted, not yet authenticated connection; dropping it frees its place.
pub struct Permit {
    gate: Arc<Gate>,
    ip: IpAddr,
}

impl Gate {
    pub fn new(per_address: usize, total: usize) -> Arc<Gate> {
        Arc::new(Gate { per_address, total, state: Mutex::new(State::default()) })
    }

    /// The gate for one of this process's ports whose unauthenticated
    /// connections hold `descriptors_each` descriptors apiece (a data link's
    /// handshake holds its socket, the deadline's watcher and the reader's
    /// and writer's handles): the caps above, and never more than a quarter
    /// of the descriptors the process may open, so two ports full of
    /// strangers leave half for the run (checkpoints, data). Counting
    /// connections instead let a data port's strangers hold every descriptor.
    pub fn for_this_process(descriptors_each: usize) -> Arc<Gate> {
        let quarter = descriptor_limit().map_or(TOTAL, |n| n / 4);
        let total = TOTAL.min((quarter / descriptors_each.max(1)).max(2));
        Gate::new(PER_ADDRESS.min(total), total)
    }

    pub fn admit(self: &Arc<Gate>, ip: IpAddr) -> Result<Permit, Refusal> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let from_ip = s.by_address.get(&ip).copied().unwrap_or(0);
        let why = if from_ip >= self.per_address {
            format!(
                "{from_ip} connections from {ip} have not authenticated yet (at most {})",
                self.per_address
            )
        } else if s.open >= self.total {
            format!("{} connections have not authenticated yet (at most {})", s.open, self.total)
        } else {
            *s.by_address.entry(ip).or_insert(0) += 1;
            s.open += 1;
            return Ok(Permit { gate: self.clone(), ip });
        };
        s.refused += 1;
        Err(Refusal { why, count: s.refused })
    }

    /// Connections holding a permit now.
    pub fn open(&self) -> usize {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).open
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut s = self.gate.state.lock().unwrap_or_else(|p| p.into_inner());
        s.open -= 1;
        if let Some(n) = s.by_address.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                s.by_address.remove(&self.ip);
            }
        }
    }
}

/// A whole handshake's time limit on a blocking socket. Read timeouts alone
/// do not bound it: a peer sending a byte every few seconds resets them.
/// When the time is up first, the socket is shut down, so whatever reads it
/// returns at once.
pub struct Deadline {
    phase: Arc<(Mutex<Phase>, Condvar)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    Done,
    Expired,
}

impl Deadline {
    pub fn start(socket: &TcpStream, after: Duration) -> std::io::Result<Deadline> {
        let watched = socket.try_clone()?;
        let phase = Arc::new((Mutex::new(Phase::Running), Condvar::new()));
        let p = phase.clone();
        std::thread::Builder::new().name("handshake-deadline".into()).spawn(move || {
            let (lock, cv) = &*p;
            let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
            let (mut phase, _) = cv
                .wait_timeout_while(guard, after, |ph| *ph == Phase::Running)
                .unwrap_or_else(|e| e.into_inner());
            if *phase == Phase::Running {
                *phase = Phase::Expired;
                let _ = watched.shutdown(Shutdown::Both);
            }
        })?;
        Ok(Deadline { phase })
    }

    /// Ends the watch: true when the handshake finished in time (the socket
    /// is untouched), false when the deadline had already shut it down.
    pub fn finish(self) -> bool {
        let (lock, cv) = &*self.phase;
        let mut phase = lock.lock().unwrap_or_else(|e| e.into_inner());
        if *phase == Phase::Expired {
            return false;
        }
        *phase = Phase::Done;
        cv.notify_all();
        true
    }
}

/// Whether a refusal is one to log: the first, then every thousandth.
pub fn worth_logging(r: &Refusal) -> bool {
    r.count == 1 || r.count.is_multiple_of(1000)
}

/// The process's soft limit on open descriptors.
pub fn descriptor_limit() -> Option<usize> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0).then_some(lim.rlim_cur as usize)
}

/// Raises the soft descriptor limit to the hard one (at most 65536), as a
/// server that holds many sockets does; a failure leaves the limit as it was.
pub fn raise_descriptor_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write the struct they are given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            let want = lim.rlim_max.min(65_536);
            if want > lim.rlim_cur {
                lim.rlim_cur = want;
                let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn one_address_is_capped_and_others_still_get_in() {
        let g = Gate::new(2, 10);
        let (_a, _b) = (g.admit(ip("10.0.0.1")).unwrap(), g.admit(ip("10.0.0.1")).unwrap());
        let r = g.admit(ip("10.0.0.1")).err().expect("a third from one address");
        assert!(
            r.why.contains("2 connections from 10.0.0.1 have not authenticated yet (at most 2)"),
            "{}",
            r.why
        );
        assert_eq!(r.count, 1);
        assert!(g.admit(ip("10.0.0.2")).is_ok());
    }

    #[test]
    fn the_total_is_capped_and_a_dropped_permit_frees_its_place() {
        let g = Gate::new(10, 3);
        let mut held: Vec<Permit> =
            ["10.0.0.1", "10.0.0.2", "10.0.0.3"].iter().map(|a| g.admit(ip(a)).unwrap()).collect();
        let r = g.admit(ip("10.0.0.4")).err().expect("a fourth in all");
        assert!(r.why.contains("3 connections have not authenticated yet (at most 3)"), "{}", r.why);
        assert_eq!(g.open(), 3);
        held.pop();
        assert_eq!(g.open(), 2);
        let _fourth = g.admit(ip("10.0.0.4")).unwrap();
        assert_eq!(g.admit(ip("10.0.0.5")).err().expect("full again").count, 2);
    }

    #[test]
    fn a_deadline_shuts_a_silent_peer_down_and_leaves_a_finished_handshake_alone() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let _silent = TcpStream::connect(addr).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        let d = Deadline::start(&s, Duration::from_millis(200)).unwrap();
        let t = std::time::Instant::now();
        let mut buf = [0u8; 1];
        // Blocks until the deadline shuts the socket: then it reads end-of-stream.
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(!d.finish(), "the deadline fired first");

        let mut peer = TcpStream::connect(addr).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        let d = Deadline::start(&s, Duration::from_millis(200)).unwrap();
        assert!(d.finish(), "finished in time");
        std::thread::sleep(Duration::from_millis(400));
        std::io::Write::write_all(&mut peer, b"x").unwrap();
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"x", "the socket stays open after a finished handshake");
    }

    #[test]
    fn refusals_are_logged_first_and_then_every_thousandth() {
        let at = |count| worth_logging(&Refusal { why: String::new(), count });
        assert!(at(1) && !at(2) && !at(999) && at(1000) && at(2000));
    }

    #[test]
    fn a_process_gate_leaves_most_descriptors_to_the_run() {
        let limit = descriptor_limit().unwrap();
        for each in [1, 4] {
            let g = Gate::for_this_process(each);
            assert!(
                g.total <= TOTAL && g.total * each <= (limit / 4).max(2 * each),
                "{} of {limit}",
                g.total
            );
            assert!(g.per_address <= g.total);
        }
    }
}
