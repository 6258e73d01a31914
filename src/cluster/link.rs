//! One data link: a TCP stream between two processes of a run, optionally
//! under mutual TLS, opened with a mutual cookie proof, then read by one
//! thread and written by another.
//!
//! The handshake proves both ends hold the cookie without sending it: each
//! side answers the other's random nonce with a keyed BLAKE3 MAC. Handshake
//! reads time out, so a silent or garbage-speaking peer costs a thread a few
//! seconds, never the run. After the handshake, a frame that fails to decode
//! closes the link and is reported with the peer's address.

use super::frame::{read_frame, write_frame, Frame, FrameError};
use super::tls::{self, Tls};
use super::wire::Kind;
use crossbeam_channel::{Receiver, Sender};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Descriptors one accepted connection holds during its handshake: the
/// socket, the deadline's watcher, and the reader's and writer's handles
/// ([`LinkStream::plain`]; under TLS, `tls::split` takes as many).
pub const HANDSHAKE_DESCRIPTORS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("{peer}: {error}")]
    Frame { peer: SocketAddr, error: FrameError },
    #[error("{peer}: refused: {reason}")]
    Refused { peer: SocketAddr, reason: String },
    #[error("{peer}: handshake: {what}")]
    Protocol { peer: SocketAddr, what: String },
    #[error("{peer}: {error}")]
    Io { peer: SocketAddr, error: std::io::Error },
    #[error("{peer}: TLS: {why}")]
    Tls { peer: SocketAddr, why: String },
}

/// The shared secret. Never printed: `Debug` shows nothing of it.
#[derive(Clone)]
pub struct Cookie {
    text: String,
    key: [u8; 32],
}

impl std::fmt::Debug for Cookie {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cookie(<hidden>)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CookieError {
    #[error("no cookie: set PIPEWRIGHT_COOKIE_FILE (a file only you can read) or PIPEWRIGHT_COOKIE")]
    Missing,
    #[error("PIPEWRIGHT_COOKIE_FILE={path}: {error}")]
    File { path: String, error: std::io::Error },
    #[error("PIPEWRIGHT_COOKIE_FILE={0}: readable by group or others (chmod 600 it)")]
    Permissions(String),
    #[error("the cookie is empty")]
    Empty,
}

impl Cookie {
    pub fn new(text: &str) -> Result<Cookie, CookieError> {
        let text = text.trim().to_string();
        if text.is_empty() {
            return Err(CookieError::Empty);
        }
        let key = blake3::derive_key("pipewright 2026 data link cookie", text.as_bytes());
        Ok(Cookie { text, key })
    }

    /// From `PIPEWRIGHT_COOKIE_FILE` (preferred: it stays out of `ps` and the
    /// environment of children) or `PIPEWRIGHT_COOKIE`.
    pub fn from_env() -> Result<Cookie, CookieError> {
        if let Some(path) = std::env::var_os("PIPEWRIGHT_COOKIE_FILE") {
            let shown = path.to_string_lossy().to_string();
            let meta = std::fs::metadata(&path)
                .map_err(crate::fsutil::named_loop)
                .map_err(|error| CookieError::File { path: shown.clone(), error })?;
            use std::os::unix::fs::PermissionsExt;
            if meta.permissions().mode() & 0o077 != 0 {
                return Err(CookieError::Permissions(shown));
            }
            let text = crate::fsutil::read_regular_to_string(
                std::path::Path::new(&path),
                crate::fsutil::MAX_SECRET_BYTES,
                "a cookie file may hold",
            )
            .map_err(|error| CookieError::File { path: shown, error })?;
            return Cookie::new(&text);
        }
        match std::env::var("PIPEWRIGHT_COOKIE") {
            Ok(t) => Cookie::new(&t),
            Err(_) => Err(CookieError::Missing),
        }
    }

    /// The cookie bound to `scope` (a SLURM job): a secret derived from
    /// both, so one cookie file can serve many jobs and a process of one
    /// job still fails the handshake of another's.
    pub fn scoped(&self, scope: &str) -> Cookie {
        let mut input = self.text.as_bytes().to_vec();
        input.push(0);
        input.extend_from_slice(scope.as_bytes());
        let derived = blake3::derive_key("pipewright 2026 cookie scope", &input);
        let text: String = derived.iter().map(|b| format!("{b:02x}")).collect();
        Cookie::new(&text).expect("64 hex digits are not empty")
    }

    /// A fresh random cookie (hex), for `launch`.
    pub fn generate() -> std::io::Result<String> {
        let bytes = random_bytes()?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// What ractor_cluster's own challenge uses.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn proof(&self, nonce: &[u8; 32], rank: u32) -> [u8; 32] {
        let mut msg = Vec::with_capacity(36);
        msg.extend_from_slice(nonce);
        msg.extend_from_slice(&rank.to_le_bytes());
        *blake3::keyed_hash(&self.key, &msg).as_bytes()
    }

    fn check(&self, nonce: &[u8; 32], rank: u32, proof: &[u8; 32]) -> bool {
        // blake3::Hash compares in constant time.
        blake3::Hash::from(self.proof(nonce, rank)) == blake3::Hash::from(*proof)
    }
}

pub fn random_bytes() -> std::io::Result<[u8; 32]> {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b)
}

fn io(peer: SocketAddr) -> impl Fn(std::io::Error) -> LinkError {
    move |error| LinkError::Io { peer, error }
}

/// A TLS failure (an alert from the peer, a record that does not decrypt)
/// says more as itself than as the frame error it surfaced through.
fn frame_error(peer: SocketAddr, source: FrameError) -> LinkError {
    match &source {
        FrameError::Io(e) if tls::tls_cause(e).is_some() => LinkError::Tls { peer, why: e.to_string() },
        // A TLS record's header (content type 20..=23, version 3.x) where a
        // frame's magic should be: a handshake, or the alert refusing ours.
        FrameError::Magic([20..=23, 3, ..]) => LinkError::Refused {
            peer,
            reason: "it speaks TLS, but this process runs without (--tls-cert, --tls-key, --tls-ca)".into(),
        },
        _ => LinkError::Frame { peer, error: source },
    }
}

fn send(stream: &mut LinkStream, peer: SocketAddr, kind: Kind) -> Result<(), LinkError> {
    write_frame(&mut stream.writer, &Frame::new(kind), &mut Vec::new())
        .and_then(|()| Ok(stream.writer.flush()?))
        .map_err(|source| frame_error(peer, source))
}

/// The most a handshake frame is read to: a Hello (rank, world, an address, a
/// nonce) and every other handshake frame is well under 1 KiB. A frame may
/// claim up to 8 GiB; from a peer that has not yet proved the cookie, no more
/// than this is read (an unauthenticated 512 MiB Hello was read whole).
const HANDSHAKE_MAX_BYTES: u64 = 64 << 10;

fn recv(stream: &mut LinkStream, peer: SocketAddr) -> Result<Kind, LinkError> {
    let mut bounded = Read::take(&mut stream.reader, HANDSHAKE_MAX_BYTES);
    let got = read_frame(&mut bounded);
    let over = bounded.limit() == 0;
    match got {
        Ok(Some(f)) if f.arrays.is_empty() => Ok(f.kind),
        Ok(Some(_)) => Err(LinkError::Protocol { peer, what: "tensors during the handshake".into() }),
        Ok(None) => Err(LinkError::Protocol { peer, what: "closed during the handshake".into() }),
        Err(_) if over => Err(LinkError::Protocol {
            peer,
            what: format!("a frame longer than the {HANDSHAKE_MAX_BYTES} bytes a handshake frame may have"),
        }),
        Err(source) => Err(frame_error(peer, source)),
    }
}

/// A connected link, plain or TLS, as its two threads use it: one reads,
/// the other writes, and the socket under both is kept for its address,
/// timeouts and shutting it down.
pub struct LinkStream {
    pub socket: TcpStream,
    pub reader: Box<dyn Read + Send>,
    pub writer: Box<dyn Write + Send>,
}

impl LinkStream {
    pub fn plain(socket: TcpStream) -> std::io::Result<LinkStream> {
        let reader = Box::new(socket.try_clone()?);
        let writer = Box::new(socket.try_clone()?);
        Ok(LinkStream { socket, reader, writer })
    }

    /// `socket` to `peer` as a link: under TLS when `tls` is given (as the
    /// connecting side when `client`), else plain.
    fn open(
        socket: TcpStream,
        peer: SocketAddr,
        tls: Option<&Tls>,
        client: bool,
    ) -> Result<LinkStream, LinkError> {
        match tls {
            Some(t) => LinkStream::over_tls(socket, t, client),
            None => LinkStream::plain(socket).map_err(io(peer)),
        }
    }

    /// Runs the TLS handshake (as the connecting side when `client`).
    pub fn over_tls(mut socket: TcpStream, tls: &Tls, client: bool) -> Result<LinkStream, LinkError> {
        let peer = socket.peer_addr().map_err(io(SocketAddr::from(([0, 0, 0, 0], 0))))?;
        let conn = if client { tls.connect(&mut socket) } else { tls.accept(&mut socket) };
        let conn = conn.map_err(|e| LinkError::Tls { peer, why: handshake_failure(&e) })?;
        let (reader, writer) = tls::split(conn, &socket).map_err(io(peer))?;
        Ok(LinkStream { socket, reader: Box::new(reader), writer: Box::new(writer) })
    }
}

fn handshake_failure(e: &std::io::Error) -> String {
    use std::io::ErrorKind::*;
    match e.kind() {
        _ if tls::tls_cause(e).is_some() => format!("handshake failed: {e}"),
        WouldBlock | TimedOut => format!("no TLS handshake within {HANDSHAKE_TIMEOUT:?}"),
        UnexpectedEof | ConnectionReset => {
            format!("the peer closed the connection during the TLS handshake (does it run without TLS?): {e}")
        }
        _ => format!("handshake failed: {e}"),
    }
}

/// Opens a link to `addr` as process `me` (under TLS when `tls` is given);
/// returns the stream and the peer's rank.
pub fn connect(
    addr: SocketAddr,
    me: u32,
    world: u32,
    listen: &str,
    cookie: &Cookie,
    tls: Option<&Tls>,
) -> Result<(LinkStream, u32), LinkError> {
    let s = TcpStream::connect_timeout(&addr, HANDSHAKE_TIMEOUT).map_err(io(addr))?;
    s.set_nodelay(true).map_err(io(addr))?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io(addr))?;
    let mut s = LinkStream::open(s, addr, tls, true)?;
    let nonce = random_bytes().map_err(io(addr))?;
    send(&mut s, addr, Kind::Hello { rank: me, world, listen: listen.to_string(), nonce })?;
    let (peer_rank, their_nonce) = match recv(&mut s, addr)? {
        Kind::Challenge { rank, proof, nonce: theirs } => {
            if !cookie.check(&nonce, rank, &proof) {
                return Err(LinkError::Refused { peer: addr, reason: "it does not hold our cookie".into() });
            }
            (rank, theirs)
        }
        Kind::Refused { reason } => return Err(LinkError::Refused { peer: addr, reason }),
        other => {
            return Err(LinkError::Protocol {
                peer: addr,
                what: format!("expected Challenge, got {other:?}"),
            })
        }
    };
    send(&mut s, addr, Kind::Proof { proof: cookie.proof(&their_nonce, me) })?;
    match recv(&mut s, addr)? {
        Kind::Welcome => {}
        Kind::Refused { reason } => return Err(LinkError::Refused { peer: addr, reason }),
        other => {
            return Err(LinkError::Protocol { peer: addr, what: format!("expected Welcome, got {other:?}") })
        }
    }
    s.socket.set_read_timeout(None).map_err(io(addr))?;
    Ok((s, peer_rank))
}

/// Who connected, once proven.
pub struct Joined {
    pub stream: LinkStream,
    pub rank: u32,
    pub listen: String,
}

/// Runs the acceptor's half of the handshake (after TLS's, when `tls` is
/// given). `admit` may refuse a proven peer (a rank out of range, or one
/// already joined) with a reason.
pub fn accept(
    s: TcpStream,
    me: u32,
    world: u32,
    cookie: &Cookie,
    tls: Option<&Tls>,
    admit: impl Fn(u32) -> Result<(), String>,
) -> Result<Joined, LinkError> {
    let peer = s.peer_addr().map_err(io(SocketAddr::from(([0, 0, 0, 0], 0))))?;
    s.set_nodelay(true).map_err(io(peer))?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io(peer))?;
    let mut s = LinkStream::open(s, peer, tls, false)?;
    let (rank, listen, nonce) = match recv(&mut s, peer)? {
        Kind::Hello { rank, world: w, listen, nonce } => {
            if w != world {
                let reason = format!("this run has {world} processes, the peer says {w}");
                let _ = send(&mut s, peer, Kind::Refused { reason: reason.clone() });
                return Err(LinkError::Refused { peer, reason });
            }
            (rank, listen, nonce)
        }
        other => return Err(LinkError::Protocol { peer, what: format!("expected Hello, got {other:?}") }),
    };
    let mine = random_bytes().map_err(io(peer))?;
    send(&mut s, peer, Kind::Challenge { rank: me, proof: cookie.proof(&nonce, me), nonce: mine })?;
    match recv(&mut s, peer)? {
        Kind::Proof { proof } if cookie.check(&mine, rank, &proof) => {}
        Kind::Proof { .. } => {
            let reason = "wrong cookie".to_string();
            let _ = send(&mut s, peer, Kind::Refused { reason: reason.clone() });
            return Err(LinkError::Refused { peer, reason });
        }
        other => return Err(LinkError::Protocol { peer, what: format!("expected Proof, got {other:?}") }),
    }
    if let Err(reason) = admit(rank) {
        let _ = send(&mut s, peer, Kind::Refused { reason: reason.clone() });
        return Err(LinkError::Refused { peer, reason });
    }
    send(&mut s, peer, Kind::Welcome)?;
    s.socket.set_read_timeout(None).map_err(io(peer))?;
    Ok(Joined { stream: s, rank, listen })
}

/// What a link's reader does with what arrives. An `Err` from `frame` closes
/// the link; `closed` hears why a link ended (`None`: the peer closed it).
pub trait Sink: Send + Sync + 'static {
    fn frame(&self, peer: usize, frame: Frame) -> Result<(), String>;
    fn closed(&self, peer: usize, why: Option<String>);
}

/// An open link: frames queued here are written by the link's writer thread,
/// so no sender (an actor, a compute thread) ever blocks on the network.
pub struct Link {
    pub peer: usize,
    pub addr: SocketAddr,
    tx: Mutex<Option<Sender<Frame>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    socket: TcpStream,
}

impl Link {
    pub fn start(peer: usize, stream: LinkStream, sink: Arc<dyn Sink>) -> std::io::Result<Arc<Link>> {
        let LinkStream { socket, reader, writer: out } = stream;
        let addr = socket.peer_addr()?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let writer =
            std::thread::Builder::new().name(format!("link-w-{peer}")).spawn(move || writer_main(out, rx))?;
        let input = socket.try_clone()?;
        std::thread::Builder::new().name(format!("link-r-{peer}")).spawn(move || {
            let mut r = BufReader::with_capacity(1 << 16, reader);
            let why = loop {
                match read_frame(&mut r) {
                    Ok(Some(f)) => {
                        if let Err(e) = sink.frame(peer, f) {
                            break Some(e);
                        }
                    }
                    Ok(None) => break None,
                    Err(e) => break Some(e.to_string()),
                }
            };
            // A bad frame leaves the stream out of step: close both directions.
            let _ = input.shutdown(std::net::Shutdown::Both);
            sink.closed(peer, why);
        })?;
        Ok(Arc::new(Link { peer, addr, tx: Mutex::new(Some(tx)), writer: Mutex::new(Some(writer)), socket }))
    }

    /// Queues a frame; false when the link is closed.
    pub fn send(&self, f: Frame) -> bool {
        match &*self.tx.lock().expect("link sender") {
            Some(tx) => tx.send(f).is_ok(),
            None => false,
        }
    }

    /// Writes what is queued, then closes the stream.
    pub fn close(&self) {
        drop(self.tx.lock().expect("link sender").take());
        if let Some(w) = self.writer.lock().expect("link writer").take() {
            let _ = w.join();
        }
        // No TLS close_notify first: the peer's reader takes a bare close
        // between frames as the end anyway (see tls::TlsReader).
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

fn writer_main(stream: Box<dyn Write + Send>, rx: Receiver<Frame>) {
    let mut w = BufWriter::with_capacity(1 << 16, stream);
    let mut scratch = Vec::new();
    while let Ok(f) = rx.recv() {
        if write_frame(&mut w, &f, &mut scratch).is_err() {
            return;
        }
        // Batch what is already queued into one flush.
        while let Ok(f) = rx.try_recv() {
            if write_frame(&mut w, &f, &mut scratch).is_err() {
                return;
            }
        }
        if w.flush().is_err() {
            return;
        }
    }
    let _ = w.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scoped_cookie_is_one_secret_per_scope_and_cookie() {
        let (a, b) = (Cookie::new("shared").unwrap(), Cookie::new("other").unwrap());
        let nonce = [7u8; 32];
        let proof = a.scoped("slurm job 1").proof(&nonce, 1);
        // Another task of the job derives the same secret from the same file.
        assert!(Cookie::new("shared").unwrap().scoped("slurm job 1").check(&nonce, 1, &proof));
        for other in [a.scoped("slurm job 2"), b.scoped("slurm job 1"), a.clone()] {
            assert!(!other.check(&nonce, 1, &proof));
        }
        assert_ne!(a.scoped("slurm job 1").text(), a.scoped("slurm job 2").text());
    }

    #[test]
    fn an_oversized_hello_is_refused_after_the_handshake_cap_not_read_whole() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(1);
        let stranger = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let hello = Kind::Hello { rank: 1, world: 2, listen: "x".into(), nonce: [0; 32] };
            // 4 MiB of tensors behind a Hello; only the first MiB is sent, and
            // the connection is held open as a slow stranger would.
            let frame = Frame::with(hello, vec![super::super::frame::Array::F32(vec![0.0; 1 << 20])]);
            let mut bytes = Vec::new();
            write_frame(&mut bytes, &frame, &mut Vec::new()).unwrap();
            let _ = s.write_all(&bytes[..1 << 20]);
            let _ = done_rx.recv_timeout(Duration::from_secs(30));
        });
        let (socket, _) = listener.accept().unwrap();
        let cookie = Cookie::new(&Cookie::generate().unwrap()).unwrap();
        let start = std::time::Instant::now();
        let e = match accept(socket, 0, 2, &cookie, None, |_| Ok(())) {
            Ok(_) => panic!("an oversized Hello was accepted"),
            Err(e) => e.to_string(),
        };
        let waited = start.elapsed();
        let _ = done_tx.send(());
        stranger.join().unwrap();
        assert!(e.contains("longer than the 65536 bytes a handshake frame may have"), "{e}");
        assert!(waited < HANDSHAKE_TIMEOUT / 2, "waited {waited:?} for bytes past the cap");
    }
}
