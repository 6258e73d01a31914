//! The rendezvous and compute core: ranks that joined one region, the calls
//! they make, and the state machines that carry each call out through the
//! region. It knows nothing of the driver: buffers are host addresses (the
//! emulated device's memory is host memory) and a rank's device is an
//! identity handed in, so tests drive it with plain slices.
//!
//! Collectives run in steps shared by all ranks of the communicator: at each
//! step every rank posts one chunk of its input (and the call it is making)
//! in its member area, waits until every rank has posted that step, checks
//! that all made the same call, computes its own output chunk from all the
//! inputs, and marks the step consumed; a rank overwrites its area for the
//! next step only when every rank has consumed the last. Send/receive use a
//! channel per ordered pair: the sender posts chunks, the receiver takes
//! them. Calls are numbered when issued (collectives per communicator,
//! sends and receives per peer, from #1), so a mismatch or a deadlock names
//! each rank's call by number.
//!
//! Every operation is a state machine that never blocks; `execute` polls a
//! group's operations together (so a rank sending to and receiving from a
//! peer in one group cannot wait on itself) and sleeps on the region's
//! futex when none moved.

use super::region::{self, Region, DESC_WORDS};
use super::types::{self, code, DataType, RedOp};
use crate::error::{EmuError, Result};
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// NCCL_UNIQUE_ID_BYTES.
pub const ID_BYTES: usize = 128;
const ID_MAGIC: &[u8; 8] = b"pwemunc1";
/// Ranks a communicator may have (the wait masks are 64-bit).
pub const MAX_RANKS: usize = 64;
pub const TIMEOUT_VAR: &str = "PW_EMU_NCCL_TIMEOUT_S";
/// Bytes of chunks a region may reserve (2 ranks use 1.5 MiB at the
/// default chunk; 64 ranks get 4 KiB chunks).
const REGION_BUDGET: usize = 64 << 20;

/// An ncclUniqueId: a magic, 16 random bytes, the maker's pid and the time,
/// so ids made at once by different processes never meet.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; ID_BYTES]);

impl UniqueId {
    pub fn new() -> UniqueId {
        let mut id = [0u8; ID_BYTES];
        id[..8].copy_from_slice(ID_MAGIC);
        // SAFETY: fills 16 bytes of our buffer.
        let got = unsafe { libc::getrandom(id[8..24].as_mut_ptr() as *mut libc::c_void, 16, 0) };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        if got != 16 {
            // No entropy source: the pid and the time below still separate
            // ids of different processes; the counter keeps this one's apart.
            static MADE: AtomicU64 = AtomicU64::new(0);
            id[8..16].copy_from_slice(&MADE.fetch_add(1, Ordering::Relaxed).to_ne_bytes());
        }
        id[24..28].copy_from_slice(&std::process::id().to_ne_bytes());
        id[28..36].copy_from_slice(&nanos.to_ne_bytes());
        UniqueId(id)
    }

    /// The shared memory object its communicator meets in.
    pub fn region_name(&self) -> Result<String> {
        if &self.0[..8] != ID_MAGIC {
            return Err(EmuError::new(
                code::INVALID_ARGUMENT,
                format!(
                    "the unique id (first bytes {:02x?}) was not made by this emulator's ncclGetUniqueId \
                     (which starts it with \"pwemunc1\")",
                    &self.0[..8]
                ),
            ));
        }
        let hex: String = self.0[8..36].iter().map(|b| format!("{b:02x}")).collect();
        Ok(format!("/pw-nccl-{hex}"))
    }
}

impl Default for UniqueId {
    fn default() -> UniqueId {
        UniqueId::new()
    }
}

/// Which physical (emulated) GPU a rank runs on: its emulator session and
/// ordinal; two ranks with the same identity are on one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceId {
    pub session: String,
    pub ordinal: usize,
}

/// How a communicator moves data and how long a rank waits for its peers.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Bytes per rank per step (the region holds one chunk per rank and per
    /// ordered pair); the rank that creates the region decides.
    pub chunk_bytes: usize,
    /// How long a rank may see no progress before it reports a deadlock.
    pub timeout: Duration,
}

impl Config {
    pub const DEFAULT_CHUNK_BYTES: usize = 256 << 10;
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// The default chunk and PW_EMU_NCCL_TIMEOUT_S (seconds, default 60).
    pub fn from_env() -> Result<Config> {
        let timeout = match std::env::var(TIMEOUT_VAR) {
            Err(_) => Config::DEFAULT_TIMEOUT,
            Ok(v) => match v.trim().parse::<f64>() {
                Ok(s) if s > 0.0 && s.is_finite() => Duration::from_secs_f64(s),
                _ => {
                    return Err(EmuError::new(
                        code::INVALID_ARGUMENT,
                        format!("{TIMEOUT_VAR}={v:?}: expected a positive number of seconds"),
                    ))
                }
            },
        };
        Ok(Config { chunk_bytes: Config::DEFAULT_CHUNK_BYTES, timeout })
    }
}

/// What a call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    AllReduce = 1,
    Reduce = 2,
    Broadcast = 3,
    AllGather = 4,
    Send = 5,
    Recv = 6,
}

impl Kind {
    const ALL: [Kind; 6] =
        [Kind::AllReduce, Kind::Reduce, Kind::Broadcast, Kind::AllGather, Kind::Send, Kind::Recv];

    pub fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "ncclAllReduce",
            Kind::Reduce => "ncclReduce",
            Kind::Broadcast => "ncclBroadcast",
            Kind::AllGather => "ncclAllGather",
            Kind::Send => "ncclSend",
            Kind::Recv => "ncclRecv",
        }
    }

    pub fn is_collective(self) -> bool {
        !matches!(self, Kind::Send | Kind::Recv)
    }

    fn rooted(self) -> bool {
        matches!(self, Kind::Reduce | Kind::Broadcast)
    }
}

/// One issued call, as every rank can read it in the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub kind: Kind,
    /// Its number (from 1): among the communicator's collectives, or among
    /// this rank's sends to (receives from) the peer.
    pub seq: u64,
    /// Elements (per rank for ncclAllGather's input).
    pub count: u64,
    pub dtype: DataType,
    pub op: Option<RedOp>,
    /// The root of ncclReduce/ncclBroadcast, the peer of ncclSend/ncclRecv.
    pub peer: usize,
}

impl Call {
    fn encode(&self, chunk: u64) -> [u64; DESC_WORDS] {
        let op = self.op.map_or(0, |o| o as u64 + 1);
        [
            self.kind as u64 | (self.dtype as u64) << 8 | op << 16,
            self.seq,
            self.count,
            self.peer as u64,
            chunk,
            0,
        ]
    }

    fn decode(w: &[u64; DESC_WORDS]) -> Option<(Call, u64)> {
        let kind = *Kind::ALL.iter().find(|k| **k as u64 == w[0] & 0xff)?;
        let dtype = DataType::from_raw(((w[0] >> 8) & 0xff) as i64, "").ok()?;
        let op = match (w[0] >> 16) & 0xff {
            0 => None,
            o => Some(RedOp::from_raw(o as i64 - 1, "").ok()?),
        };
        Some((Call { kind, seq: w[1], count: w[2], dtype, op, peer: w[3] as usize }, w[4]))
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (n, t) = (self.count, self.dtype.name());
        let op = self.op.map_or("", |o| o.name());
        match self.kind {
            Kind::AllReduce => write!(f, "ncclAllReduce #{} ({n} x {t}, {op})", self.seq),
            Kind::Reduce => write!(f, "ncclReduce #{} ({n} x {t}, {op}, root {})", self.seq, self.peer),
            Kind::Broadcast => write!(f, "ncclBroadcast #{} ({n} x {t}, root {})", self.seq, self.peer),
            Kind::AllGather => write!(f, "ncclAllGather #{} ({n} x {t} from each rank)", self.seq),
            Kind::Send => write!(f, "ncclSend #{} to rank {} ({n} x {t})", self.seq, self.peer),
            Kind::Recv => write!(f, "ncclRecv #{} from rank {} ({n} x {t})", self.seq, self.peer),
        }
    }
}

fn load_desc(words: &[AtomicU64; DESC_WORDS]) -> [u64; DESC_WORDS] {
    std::array::from_fn(|i| words[i].load(Ordering::Acquire))
}

fn store_desc(words: &[AtomicU64; DESC_WORDS], desc: [u64; DESC_WORDS]) {
    for (w, v) in words.iter().zip(desc) {
        w.store(v, Ordering::Release);
    }
}

/// A call not yet issued: what it does and the buffers it reads and writes.
/// The lifetime ties it to the slices it was made from.
pub struct Op<'a> {
    kind: Kind,
    count: usize,
    dtype: DataType,
    op: Option<RedOp>,
    peer: usize,
    send: usize,
    recv: usize,
    /// The slices' lengths, checked against the call's extents when issued;
    /// None for raw addresses (the caller checked them).
    send_len: Option<usize>,
    recv_len: Option<usize>,
    /// ncclAllGather in place: send is recv's slot of this rank.
    gather_in_place: bool,
    _buffers: PhantomData<&'a mut [u8]>,
}

impl<'a> Op<'a> {
    fn new(kind: Kind, count: usize, dtype: DataType, op: Option<RedOp>, peer: usize) -> Op<'a> {
        Op {
            kind,
            count,
            dtype,
            op,
            peer,
            send: 0,
            recv: 0,
            send_len: None,
            recv_len: None,
            gather_in_place: false,
            _buffers: PhantomData,
        }
    }

    fn with_send(mut self, b: &'a [u8]) -> Op<'a> {
        self.send = b.as_ptr() as usize;
        self.send_len = Some(b.len());
        self
    }

    fn with_recv(mut self, b: &'a mut [u8]) -> Op<'a> {
        self.recv = b.as_mut_ptr() as usize;
        self.recv_len = Some(b.len());
        self
    }

    fn in_place(mut self, b: &'a mut [u8]) -> Op<'a> {
        self.send = b.as_mut_ptr() as usize;
        self.recv = self.send;
        self.send_len = Some(b.len());
        self.recv_len = Some(b.len());
        self
    }

    pub fn all_reduce(send: &'a [u8], recv: &'a mut [u8], dtype: DataType, op: RedOp) -> Op<'a> {
        Op::new(Kind::AllReduce, send.len() / dtype.size(), dtype, Some(op), 0)
            .with_send(send)
            .with_recv(recv)
    }

    pub fn all_reduce_in_place(buf: &'a mut [u8], dtype: DataType, op: RedOp) -> Op<'a> {
        Op::new(Kind::AllReduce, buf.len() / dtype.size(), dtype, Some(op), 0).in_place(buf)
    }

    /// `recv` is read on the root only (others may pass None).
    pub fn reduce(
        send: &'a [u8],
        recv: Option<&'a mut [u8]>,
        dtype: DataType,
        op: RedOp,
        root: usize,
    ) -> Op<'a> {
        let o = Op::new(Kind::Reduce, send.len() / dtype.size(), dtype, Some(op), root).with_send(send);
        match recv {
            Some(r) => o.with_recv(r),
            None => o,
        }
    }

    pub fn reduce_in_place(buf: &'a mut [u8], dtype: DataType, op: RedOp, root: usize) -> Op<'a> {
        Op::new(Kind::Reduce, buf.len() / dtype.size(), dtype, Some(op), root).in_place(buf)
    }

    /// `send` is read on the root only (others may pass None).
    pub fn broadcast(send: Option<&'a [u8]>, recv: &'a mut [u8], dtype: DataType, root: usize) -> Op<'a> {
        let o = Op::new(Kind::Broadcast, recv.len() / dtype.size(), dtype, None, root).with_recv(recv);
        match send {
            Some(s) => o.with_send(s),
            None => o,
        }
    }

    pub fn broadcast_in_place(buf: &'a mut [u8], dtype: DataType, root: usize) -> Op<'a> {
        Op::new(Kind::Broadcast, buf.len() / dtype.size(), dtype, None, root).in_place(buf)
    }

    /// recv (nranks × send's elements) = every rank's send, in rank order.
    pub fn all_gather(send: &'a [u8], recv: &'a mut [u8], dtype: DataType) -> Op<'a> {
        Op::new(Kind::AllGather, send.len() / dtype.size(), dtype, None, 0).with_send(send).with_recv(recv)
    }

    /// In place: this rank's `count` elements already sit in its slot of `buf`.
    pub fn all_gather_in_place(buf: &'a mut [u8], count: usize, dtype: DataType) -> Op<'a> {
        let mut o = Op::new(Kind::AllGather, count, dtype, None, 0);
        o.recv = buf.as_mut_ptr() as usize;
        o.recv_len = Some(buf.len());
        o.gather_in_place = true;
        o
    }

    pub fn send(buf: &'a [u8], dtype: DataType, peer: usize) -> Op<'a> {
        Op::new(Kind::Send, buf.len() / dtype.size(), dtype, None, peer).with_send(buf)
    }

    pub fn recv(buf: &'a mut [u8], dtype: DataType, peer: usize) -> Op<'a> {
        Op::new(Kind::Recv, buf.len() / dtype.size(), dtype, None, peer).with_recv(buf)
    }
}

impl Op<'static> {
    /// A call on raw addresses, as NCCL's C API takes them (ncclAllGather's
    /// `count` is per rank; `peer` is the root or peer, else 0).
    ///
    /// # Safety
    /// The addresses must stay valid for the call's extents, and untouched
    /// by anything else, until the call has run.
    pub unsafe fn from_raw(
        kind: Kind,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: Option<RedOp>,
        peer: usize,
    ) -> Op<'static> {
        let mut o = Op::new(kind, count, dtype, op, peer);
        o.send = send as usize;
        o.recv = recv as usize;
        o
    }
}

/// An issued call: numbered, its buffers resolved.
#[derive(Clone, Copy, Debug)]
pub struct Stamped {
    pub call: Call,
    send: usize,
    recv: usize,
}

/// One rank's membership of a communicator.
pub struct Member {
    region: Region,
    pub rank: usize,
    pub nranks: usize,
    pub device: DeviceId,
    pub timeout: Duration,
    /// Per lane (see `lane`): calls numbered so far, and the number of the
    /// last one finished.
    issued: Vec<AtomicU64>,
    finished: Vec<AtomicU64>,
    /// Whether every rank joined and their devices were checked.
    complete: AtomicBool,
}

fn invalid(what: String) -> EmuError {
    EmuError::new(code::INVALID_ARGUMENT, what)
}

impl Member {
    /// Claims `rank` of the communicator `id` of `nranks` ranks, on
    /// `device`; does not wait for the others (see `wait_for_all`), so one
    /// thread can join several ranks.
    pub fn join(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        device: DeviceId,
        config: Config,
    ) -> Result<Member> {
        if nranks == 0 || nranks > MAX_RANKS {
            return Err(invalid(format!("nranks {nranks}: the emulator supports 1 to {MAX_RANKS} ranks")));
        }
        if rank >= nranks {
            return Err(invalid(format!("rank {rank} is not a rank of a {nranks}-rank communicator")));
        }
        if config.chunk_bytes < 64 {
            return Err(invalid(format!("chunk of {} bytes: at least 64 are needed", config.chunk_bytes)));
        }
        // The region holds nranks × (nranks + 1) chunks, reserved up front:
        // many ranks get smaller chunks, so it stays within REGION_BUDGET.
        let chunk_bytes = config.chunk_bytes.min((REGION_BUDGET / (nranks * (nranks + 1))).max(4096));
        let name = id.region_name()?;
        let region = Region::open(&name, nranks, chunk_bytes, config.timeout)?;
        let m = region.member(rank);
        if m.claimed.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
            while m.claimed.load(Ordering::Acquire) == 1 {
                std::thread::yield_now();
            }
            let (pid, ordinal) = (m.pid.load(Ordering::Relaxed), m.ordinal.load(Ordering::Relaxed));
            return Err(EmuError::new(
                code::INVALID_USAGE,
                format!(
                    "rank {rank} of {nranks} joined twice: pid {pid} already holds it (GPU {ordinal} of session {:?}); \
                     this join (pid {}, GPU {} of session {:?}) is refused",
                    region::read_session(m),
                    std::process::id(),
                    device.ordinal,
                    device.session
                ),
            ));
        }
        m.pid.store(std::process::id(), Ordering::Relaxed);
        m.ordinal.store(device.ordinal as u64, Ordering::Relaxed);
        region::write_session(m, &device.session);
        m.claimed.store(2, Ordering::Release);
        region.header().joined.fetch_add(1, Ordering::AcqRel);
        region.bump();
        Ok(Member {
            region,
            rank,
            nranks,
            device,
            timeout: config.timeout,
            issued: (0..1 + 2 * nranks).map(|_| AtomicU64::new(0)).collect(),
            finished: (0..1 + 2 * nranks).map(|_| AtomicU64::new(0)).collect(),
            complete: AtomicBool::new(false),
        })
    }

    /// Waits until every rank joined, then refuses two ranks on one GPU
    /// (real NCCL hangs or fails there). Every rank reaches the same verdict.
    pub fn wait_for_all(&self) -> Result<()> {
        let start = Instant::now();
        loop {
            let seen = self.region.generation();
            let missing: Vec<usize> = (0..self.nranks)
                .filter(|&r| self.region.member(r).claimed.load(Ordering::Acquire) != 2)
                .collect();
            if missing.is_empty() {
                // Every rank has it mapped: the name has served its purpose,
                // and removing it now leaves nothing behind in /dev/shm even
                // if a process dies or never destroys its communicator.
                region::unlink(self.region.name());
                break;
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                region::unlink(self.region.name());
                return Err(EmuError::new(
                    code::INVALID_USAGE,
                    format!(
                        "rank {} of {}: ranks {missing:?} did not join within {:?} ({TIMEOUT_VAR})",
                        self.rank, self.nranks, self.timeout
                    ),
                ));
            }
            self.region.wait(seen, (self.timeout - waited).min(Duration::from_millis(100)));
        }
        let ids: Vec<(DeviceId, u32)> = (0..self.nranks)
            .map(|r| {
                let m = self.region.member(r);
                let id = DeviceId {
                    session: region::read_session(m),
                    ordinal: m.ordinal.load(Ordering::Relaxed) as usize,
                };
                (id, m.pid.load(Ordering::Relaxed))
            })
            .collect();
        for (j, (b, pid_b)) in ids.iter().enumerate() {
            if let Some(i) = ids[..j].iter().position(|(a, _)| a == b) {
                return Err(EmuError::new(
                    code::INVALID_USAGE,
                    format!(
                        "ranks {i} (pid {}) and {j} (pid {pid_b}) of {} are both on GPU {} of emulator session \
                         {:?}: NCCL takes one rank per GPU (two ranks on one GPU hang in real NCCL)",
                        ids[i].1, self.nranks, b.ordinal, b.session
                    ),
                ));
            }
        }
        self.complete.store(true, Ordering::Release);
        Ok(())
    }

    /// The communicator's failure, if any rank reported one.
    pub fn failure(&self) -> Option<String> {
        self.region.failure()
    }

    /// Marks the communicator failed (every rank's next wait reports it).
    pub fn fail(&self, message: &str) {
        self.region.fail(message)
    }

    /// Checks `op` against this communicator and numbers it. Nothing is
    /// numbered when the call is refused, so a refused call leaves the
    /// ranks' sequences in step.
    pub fn stamp(&self, op: &Op) -> Result<Stamped> {
        let what = format!("{} (rank {} of {})", op.kind.name(), self.rank, self.nranks);
        if !self.complete.load(Ordering::Acquire) {
            return Err(EmuError::new(
                code::INVALID_USAGE,
                format!("{what}: the communicator is not initialised (its ranks have not all joined)"),
            ));
        }
        if let Some(f) = self.failure() {
            return Err(EmuError::new(
                code::REMOTE_ERROR,
                format!("{what}: the communicator failed earlier: {f}"),
            ));
        }
        let role = match op.kind {
            Kind::Reduce | Kind::Broadcast => "root",
            _ => "peer",
        };
        if (op.kind.rooted() || !op.kind.is_collective()) && op.peer >= self.nranks {
            return Err(invalid(format!("{what}: {role} {} is not a rank (0..{})", op.peer, self.nranks)));
        }
        let (send_bytes, recv_bytes) = extents(op.kind, op.count, op.dtype, self.nranks, self.rank, op.peer)
            .ok_or_else(|| {
                invalid(format!(
                    "{what}: {} elements of {} overflow the address space",
                    op.count,
                    op.dtype.name()
                ))
            })?;
        let mut send = op.send;
        if op.gather_in_place {
            send = op.recv + self.rank * op.count * op.dtype.size();
        } else {
            check_len(&what, "sendbuff", op.send_len, send_bytes)?;
        }
        check_len(&what, "recvbuff", op.recv_len, recv_bytes)?;
        for (name, addr, need) in [("sendbuff", send, send_bytes), ("recvbuff", op.recv, recv_bytes)] {
            if addr == 0 && need.is_some_and(|b| b > 0) {
                return Err(invalid(format!("{what}: {name} is NULL")));
            }
        }
        let seq = self.issued[lane(op.kind, op.peer, self.nranks)].fetch_add(1, Ordering::AcqRel) + 1;
        let peer = if op.kind.rooted() || !op.kind.is_collective() { op.peer } else { 0 };
        let call = Call { kind: op.kind, seq, count: op.count as u64, dtype: op.dtype, op: op.op, peer };
        Ok(Stamped { call, send, recv: op.recv })
    }

    /// Joins and waits for every rank (`join` then `wait_for_all`).
    pub fn init(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        device: DeviceId,
        config: Config,
    ) -> Result<Member> {
        let m = Member::join(id, nranks, rank, device, config)?;
        m.wait_for_all()?;
        Ok(m)
    }

    /// Issues `ops` as one group and runs them to completion (what a
    /// stream's worker does with a group's calls on that stream).
    pub fn run(&self, ops: &[Op]) -> Result<()> {
        let stamped = ops.iter().map(|o| self.stamp(o)).collect::<Result<Vec<_>>>()?;
        let items: Vec<(&Member, Stamped)> = stamped.into_iter().map(|s| (self, s)).collect();
        // SAFETY: the ops borrow their slices for the whole of this call.
        unsafe { execute(&items) }
    }
}

/// The bytes a call reads at sendbuff and writes at recvbuff on `rank`
/// (None: that buffer is not used there, as on a non-root of ncclReduce);
/// None when they overflow.
pub fn extents(
    kind: Kind,
    count: usize,
    dtype: DataType,
    nranks: usize,
    rank: usize,
    root: usize,
) -> Option<(Option<usize>, Option<usize>)> {
    let bytes = count.checked_mul(dtype.size())?;
    let all = bytes.checked_mul(nranks)?;
    let is_root = root == rank;
    Some(match kind {
        Kind::AllReduce => (Some(bytes), Some(bytes)),
        Kind::Reduce => (Some(bytes), is_root.then_some(bytes)),
        Kind::Broadcast => (is_root.then_some(bytes), Some(bytes)),
        Kind::AllGather => (Some(bytes), Some(all)),
        Kind::Send => (Some(bytes), None),
        Kind::Recv => (None, Some(bytes)),
    })
}

fn check_len(what: &str, name: &str, have: Option<usize>, need: Option<usize>) -> Result<()> {
    match (have, need) {
        (Some(h), Some(n)) if h != n => {
            Err(invalid(format!("{what}: {name} holds {h} bytes, the call needs exactly {n}")))
        }
        _ => Ok(()),
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        // A complete communicator's name is gone already (wait_for_all);
        // for an incomplete one the last rank out removes it, counting the
        // ranks that joined, not nranks. A rank joining later then makes a
        // fresh region and reports the missing ranks, all it could do.
        let h = self.region.header();
        if h.left.fetch_add(1, Ordering::AcqRel) + 1 >= h.joined.load(Ordering::Acquire) {
            region::unlink(self.region.name());
        }
        self.region.bump();
    }
}

/// A rank's calls run in the order issued within each lane: its
/// collectives, its sends to each peer, its receives from each peer (the
/// orders NCCL matches calls in). Lanes run independently.
fn lane(kind: Kind, peer: usize, nranks: usize) -> usize {
    match kind {
        Kind::Send => 1 + peer,
        Kind::Recv => 1 + nranks + peer,
        _ => 0,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Collective: post this rank's chunk.
    Post,
    /// Collective: wait for every rank's chunk of step s, then compute.
    Collect(u64),
    /// Send: wait until the receiver took the last chunk.
    Drain,
    Done,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Poll {
    Moved,
    Blocked,
}

struct Pending<'m> {
    m: &'m Member,
    s: Stamped,
    chunk: u64,
    chunks: u64,
    per_chunk: u64,
    phase: Phase,
    /// Ranks it waits for while blocked.
    waiting: u64,
    /// Whether it checked that its lane's previous call finished.
    started: bool,
}

impl<'m> Pending<'m> {
    fn new(m: &'m Member, s: Stamped) -> Pending<'m> {
        let per_chunk = (m.region.chunk_bytes / s.call.dtype.size()).max(1) as u64;
        let chunks = s.call.count.div_ceil(per_chunk).max(1);
        Pending { m, s, chunk: 0, chunks, per_chunk, phase: Phase::Post, waiting: 0, started: false }
    }

    fn rank(&self) -> usize {
        self.m.rank
    }

    /// This chunk's first element and its length in bytes.
    fn extent(&self) -> (u64, usize) {
        let first = self.chunk * self.per_chunk;
        let n = self.s.call.count.saturating_sub(first).min(self.per_chunk);
        (first, n as usize * self.s.call.dtype.size())
    }

    fn advance(&mut self, last: Phase, next: Phase) {
        self.chunk += 1;
        self.phase = if self.chunk == self.chunks { last } else { next };
    }

    fn poll(&mut self) -> Result<Poll> {
        if let Some(f) = self.m.failure() {
            return Err(EmuError::new(
                code::REMOTE_ERROR,
                format!("{} on rank {}: the communicator failed: {f}", self.s.call, self.rank()),
            ));
        }
        self.waiting = 0;
        if !self.started {
            self.check_order()?;
            self.started = true;
        }
        let polled = match (self.s.call.kind, self.phase) {
            (_, Phase::Done) => Ok(Poll::Moved),
            (Kind::Send, Phase::Post) => self.send_post(),
            (Kind::Send, Phase::Drain) => self.send_drain(),
            (Kind::Recv, _) => self.recv_take(),
            (_, Phase::Post) => self.collective_post(),
            (_, Phase::Collect(step)) => self.collective_collect(step),
            (k, p) => unreachable!("{k:?} never reaches {p:?}"),
        };
        if self.phase == Phase::Done {
            self.m.finished[self.lane()].store(self.s.call.seq, Ordering::Release);
        }
        polled
    }

    fn lane(&self) -> usize {
        lane(self.s.call.kind, self.s.call.peer, self.m.nranks)
    }

    /// Refuses to start a call before its lane's previous one finished:
    /// within a group the previous one runs first, so it was issued on
    /// another stream that is not ordered before this one. On GPUs the two
    /// would run at once and NCCL would hang or mix them up.
    fn check_order(&self) -> Result<()> {
        let call = self.s.call;
        let done = self.m.finished[self.lane()].load(Ordering::Acquire);
        if done + 1 == call.seq {
            return Ok(());
        }
        let previous = match call.kind {
            Kind::Send => format!("ncclSend #{} to rank {}", call.seq - 1, call.peer),
            Kind::Recv => format!("ncclRecv #{} from rank {}", call.seq - 1, call.peer),
            _ => format!("collective #{}", call.seq - 1),
        };
        let msg = format!(
            "rank {}: {call} started before its {previous} finished: that call was issued earlier on a stream \
             not ordered before this one (NCCL runs a communicator's calls in the order issued only when their \
             streams are ordered: one stream, or an event between them)",
            self.rank()
        );
        self.m.fail(&msg);
        Err(EmuError::new(code::INVALID_USAGE, msg))
    }

    fn collective_post(&mut self) -> Result<Poll> {
        let region = &self.m.region;
        let me = region.member(self.rank());
        let step = me.posted.load(Ordering::Relaxed) + 1;
        // Every rank must have read this rank's previous chunk before it is overwritten.
        self.waiting = mask(self.m.nranks, |r| region.member(r).consumed.load(Ordering::Acquire) < step - 1);
        if self.waiting != 0 {
            return Ok(Poll::Blocked);
        }
        let call = self.s.call;
        let (first, len) = self.extent();
        let contributes = call.kind != Kind::Broadcast || call.peer == self.rank();
        if contributes && len > 0 {
            let src = self.s.send + first as usize * call.dtype.size();
            // SAFETY: the caller's buffer holds the call's extent (checked
            // when issued); the area is this rank's and nobody reads it
            // until `posted` says so.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, region.member_data(self.rank()), len) };
        }
        store_desc(&me.desc, call.encode(self.chunk));
        me.posted.store(step, Ordering::Release);
        region.bump();
        self.phase = Phase::Collect(step);
        Ok(Poll::Moved)
    }

    fn collective_collect(&mut self, step: u64) -> Result<Poll> {
        let region = &self.m.region;
        let n = self.m.nranks;
        self.waiting = mask(n, |r| region.member(r).posted.load(Ordering::Acquire) < step);
        if self.waiting != 0 {
            return Ok(Poll::Blocked);
        }
        let call = self.s.call;
        let theirs: Vec<Option<(Call, u64)>> =
            (0..n).map(|r| Call::decode(&load_desc(&region.member(r).desc))).collect();
        if theirs.iter().any(|t| *t != Some((call, self.chunk))) {
            let each: Vec<String> = theirs
                .iter()
                .enumerate()
                .map(|(r, t)| match t {
                    Some((c, _)) => format!("rank {r}: {c}"),
                    None => format!("rank {r}: an unreadable call"),
                })
                .collect();
            let msg = format!(
                "the ranks issued different collectives as collective #{} of the communicator: {}",
                call.seq,
                each.join("; ")
            );
            self.m.fail(&msg);
            return Err(EmuError::new(code::INVALID_USAGE, msg));
        }
        let (first, len) = self.extent();
        let size = call.dtype.size();
        let input = |r: usize| {
            // SAFETY: rank r posted `len` bytes for this step and writes no
            // more until this rank marks the step consumed.
            unsafe { std::slice::from_raw_parts(region.member_data(r) as *const u8, len) }
        };
        let at = |offset_elems: u64| self.s.recv + offset_elems as usize * size;
        if len > 0 {
            match call.kind {
                Kind::AllReduce | Kind::Reduce => {
                    if call.kind == Kind::AllReduce || call.peer == self.rank() {
                        let inputs: Vec<&[u8]> = (0..n).map(input).collect();
                        // SAFETY: the output chunk lies in the caller's recvbuff
                        // (checked when issued); its input was copied out at post.
                        let out = unsafe { std::slice::from_raw_parts_mut(at(first) as *mut u8, len) };
                        types::reduce(call.dtype, call.op.expect("reductions carry an op"), &inputs, out);
                    }
                }
                Kind::Broadcast => {
                    // SAFETY: as above; the source is the root's area.
                    unsafe { std::ptr::copy(region.member_data(call.peer), at(first) as *mut u8, len) };
                }
                Kind::AllGather => {
                    for r in 0..n {
                        // SAFETY: rank r's slot of recvbuff, this chunk of it.
                        unsafe {
                            std::ptr::copy(
                                region.member_data(r),
                                at(r as u64 * call.count + first) as *mut u8,
                                len,
                            )
                        };
                    }
                }
                Kind::Send | Kind::Recv => unreachable!("not collectives"),
            }
        }
        region.member(self.rank()).consumed.store(step, Ordering::Release);
        region.bump();
        self.advance(Phase::Done, Phase::Post);
        Ok(Poll::Moved)
    }

    fn send_post(&mut self) -> Result<Poll> {
        let region = &self.m.region;
        let (to, call) = (self.s.call.peer, self.s.call);
        let ch = region.channel(self.rank(), to);
        let posted = ch.posted.load(Ordering::Relaxed);
        if ch.consumed.load(Ordering::Acquire) < posted {
            self.waiting = 1 << to;
            return Ok(Poll::Blocked);
        }
        let (first, len) = self.extent();
        if len > 0 {
            let src = self.s.send + first as usize * call.dtype.size();
            // SAFETY: the caller's sendbuff extent; the channel's area is free
            // (the receiver took the last chunk).
            unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, region.channel_data(self.rank(), to), len)
            };
        }
        store_desc(&ch.send_desc, call.encode(self.chunk));
        ch.posted.store(posted + 1, Ordering::Release);
        region.bump();
        self.advance(Phase::Drain, Phase::Post);
        Ok(Poll::Moved)
    }

    fn send_drain(&mut self) -> Result<Poll> {
        let to = self.s.call.peer;
        let ch = self.m.region.channel(self.rank(), to);
        if ch.consumed.load(Ordering::Acquire) < ch.posted.load(Ordering::Relaxed) {
            self.waiting = 1 << to;
            return Ok(Poll::Blocked);
        }
        self.phase = Phase::Done;
        Ok(Poll::Moved)
    }

    fn recv_take(&mut self) -> Result<Poll> {
        let region = &self.m.region;
        let (from, call) = (self.s.call.peer, self.s.call);
        let ch = region.channel(from, self.rank());
        let taken = ch.consumed.load(Ordering::Relaxed);
        if ch.posted.load(Ordering::Acquire) <= taken {
            self.waiting = 1 << from;
            return Ok(Poll::Blocked);
        }
        let sent = Call::decode(&load_desc(&ch.send_desc));
        let expected = Call { kind: Kind::Send, peer: self.rank(), ..call };
        if sent != Some((expected, self.chunk)) {
            let theirs = sent.map_or("an unreadable call".to_string(), |(c, _)| c.to_string());
            let msg = format!(
                "send and receive do not match: rank {from}'s {theirs} meets rank {}'s {call}",
                self.rank()
            );
            self.m.fail(&msg);
            return Err(EmuError::new(code::INVALID_USAGE, msg));
        }
        let (first, len) = self.extent();
        if len > 0 {
            let dst = self.s.recv + first as usize * call.dtype.size();
            // SAFETY: the caller's recvbuff extent; the sender does not touch
            // the area until `consumed` moves.
            unsafe { std::ptr::copy(region.channel_data(from, self.rank()), dst as *mut u8, len) };
        }
        ch.consumed.store(taken + 1, Ordering::Release);
        region.bump();
        self.advance(Phase::Done, Phase::Post);
        Ok(Poll::Moved)
    }
}

fn mask(n: usize, pred: impl Fn(usize) -> bool) -> u64 {
    (0..n).filter(|&r| pred(r)).fold(0, |m, r| m | 1 << r)
}

fn ranks_of(mask: u64) -> Vec<usize> {
    (0..64).filter(|r| mask & 1 << r != 0).collect()
}

/// Whether process `pid` is gone: no such process (ESRCH; another user's
/// gives EPERM), or a zombie its parent has not reaped yet.
fn exited(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r != 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    // /proc/<pid>/stat: "pid (comm) state ...", comm may hold spaces.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next());
    matches!(state, Some('Z' | 'X'))
}

const WAITING: u32 = 1;
const FINISHED: u32 = 2;

fn record(m: &Member, state: u32, call: &Call, waiting: u64) {
    let me = m.region.member(m.rank);
    store_desc(&me.activity, call.encode(0));
    me.waiting_for.store(waiting, Ordering::Release);
    me.activity_state.store(state, Ordering::Release);
}

/// What every rank of `m`'s communicator is doing, as its ranks recorded it.
pub fn activity_report(m: &Member) -> String {
    let each: Vec<String> = (0..m.nranks)
        .map(|r| {
            let ctl = m.region.member(r);
            let state = ctl.activity_state.load(Ordering::Acquire);
            let call = Call::decode(&load_desc(&ctl.activity)).map(|(c, _)| c);
            let doing = match (state, call) {
                (WAITING, Some(c)) => {
                    let on = ranks_of(ctl.waiting_for.load(Ordering::Acquire));
                    format!("rank {r}: waiting in {c} for ranks {on:?}")
                }
                (FINISHED, Some(c)) => format!("rank {r}: last call {c}, finished"),
                _ => format!("rank {r}: no call yet"),
            };
            let pid = ctl.pid.load(Ordering::Relaxed);
            if exited(pid) {
                format!("{doing} (its process, pid {pid}, has exited)")
            } else {
                doing
            }
        })
        .collect();
    each.join("; ")
}

/// Runs issued calls (each with the member that issued it) to completion,
/// together: one stream's share of a group. Fails when a call does, or when
/// none has moved for the first member's timeout (a deadlock: the error
/// names what every rank waits for).
///
/// # Safety
/// The buffers of the calls must be live for their extents and untouched
/// by anything else until this returns.
pub unsafe fn execute(items: &[(&Member, Stamped)]) -> Result<()> {
    let Some((first, _)) = items.first() else { return Ok(()) };
    let timeout = first.timeout;
    let mut ops: Vec<Pending> = items.iter().map(|(m, s)| Pending::new(m, *s)).collect();
    let mut last_move = Instant::now();
    loop {
        let Some(lead) = ops.iter().position(|p| p.phase != Phase::Done) else {
            for (m, s) in items {
                record(m, FINISHED, &s.call, 0);
            }
            return Ok(());
        };
        let seen = ops[lead].m.region.generation();
        let mut moved = false;
        for i in 0..ops.len() {
            // A call waits for the earlier calls of its lane in the group.
            let same_lane = |p: &Pending| std::ptr::eq(p.m, ops[i].m) && p.lane() == ops[i].lane();
            let behind = ops[..i].iter().any(|p| p.phase != Phase::Done && same_lane(p));
            if ops[i].phase == Phase::Done || behind {
                continue;
            }
            match ops[i].poll() {
                Ok(Poll::Moved) => moved = true,
                Ok(Poll::Blocked) => {}
                Err(e) => {
                    abandon(&ops, i, &e);
                    return Err(e);
                }
            }
        }
        if moved {
            last_move = Instant::now();
            continue;
        }
        // The first blocked call of each member is what it waits in.
        let mut told: Vec<*const Member> = vec![];
        for p in ops.iter().filter(|p| p.phase != Phase::Done) {
            if !told.contains(&(p.m as *const Member)) {
                told.push(p.m);
                record(p.m, WAITING, &p.s.call, p.waiting);
            }
        }
        let waited = last_move.elapsed();
        if waited >= timeout {
            let p = &ops[lead];
            let msg = format!(
                "deadlock: no progress for {timeout:?} ({TIMEOUT_VAR}) on the {}-rank communicator {}: {}",
                p.m.nranks,
                p.m.region.name(),
                activity_report(p.m)
            );
            for q in &ops {
                q.m.fail(&msg);
            }
            return Err(EmuError::new(code::INVALID_USAGE, msg));
        }
        // One futex serves one region; a group spanning several checks the
        // others at least every 10 ms.
        let spans = ops.iter().any(|p| !std::ptr::eq(&p.m.region, &ops[lead].m.region));
        let cap = Duration::from_millis(if spans { 10 } else { 100 });
        ops[lead].m.region.wait(seen, cap.min(timeout - waited));
    }
}

/// A failed call takes its group down: the other communicators the group
/// used are marked failed too, so their peers stop waiting for calls this
/// rank will never finish.
fn abandon(ops: &[Pending], failed: usize, e: &EmuError) {
    let culprit = &ops[failed];
    for (i, p) in ops.iter().enumerate() {
        if i != failed && p.phase != Phase::Done && !std::ptr::eq(&p.m.region, &culprit.m.region) {
            p.m.fail(&format!(
                "rank {} abandoned {} because {} in its group failed: {}",
                p.rank(),
                p.s.call,
                culprit.s.call,
                e.message
            ));
        }
    }
}
