//! NCCL's stand-in: communicators and collectives between emulated GPUs, in
//! one process (threads, ncclCommInitAll) and across processes (the unique
//! id names a POSIX shared memory object every rank maps), by one code path.
//!
//! This file is the C API (the entry points `src/kernels/cuda/nccl_lib.rs`
//! binds, plus the small queries around them): it checks every argument
//! against the driver's state (the communicator's device, the stream's
//! device, live allocations), numbers the call, and queues it on the
//! caller's stream. Inside ncclGroupStart/End calls only queue; the group's
//! end hands each stream its share as one piece of work, so one thread can
//! drive several GPUs without blocking on their peers. The work itself
//! (`engine::execute`) runs on the stream's worker and waits for the peers
//! there. `engine` is the rendezvous and arithmetic, `region` the shared
//! memory, `types` NCCL's enums and reductions.
//!
//! Strict: what real NCCL would hang on or silently get wrong (two ranks on
//! one GPU, ranks issuing different collectives, unmatched sends, a
//! deadlock, a buffer outside the GPU's memory, a stream of another GPU, a
//! root out of range, a destroyed communicator, an unbalanced group, calls
//! of one communicator from two threads or from unordered streams) is an
//! ncclResult_t error whose message names the ranks and their calls. An
//! error found while the work runs fails the stream (its context's sticky
//! error, CUDA_ERROR_LAUNCH_FAILED, as a failing NCCL kernel would) and the
//! communicator, so every rank hears of it.
//!
//! Not emulated: a group does not make its streams wait for one another
//! (NCCL joins the streams of one group; here each stream's share runs when
//! its stream reaches it), ncclReduceScatter and the other calls the
//! backend does not bind, fp8 types, user-defined reduction ops, and
//! ncclCommInitRankConfig's non-blocking mode.

pub mod engine;
pub mod region;
pub mod types;

use crate::error::{self, cu, EmuError, Lib, Result};
use crate::{context, memory, stream};
use engine::{Config, DeviceId, Kind, Member, Op, Stamped, UniqueId};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use types::{code, DataType, RedOp};

/// The NCCL version reported (2.23.4): the API these entry points follow.
pub const VERSION_CODE: c_int = 22304;

/// Who `device` (this process's ordinal) is across processes: the emulator
/// session and the emulated GPU behind it, so two processes of one session
/// naming the same GPU are two ranks on one device.
fn device_identity(device: usize) -> (String, usize) {
    crate::memory::device_identity(device)
}

/// ncclUniqueId, passed by value to ncclCommInitRank.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    pub internal: [c_char; engine::ID_BYTES],
}

/// A communicator handle's target: one rank, on one of this process's GPUs.
pub struct Comm {
    pub member: Arc<Member>,
    /// The GPU (this process's ordinal) its rank runs on.
    pub device: usize,
    /// Held while a thread issues a call on it (NCCL communicators are not
    /// thread-safe: two threads at once is refused, not serialised).
    issuing: Mutex<()>,
    /// The thread whose open group holds calls of this communicator.
    grouped_by: Mutex<Option<std::thread::ThreadId>>,
}

impl Comm {
    fn new(member: Member, device: usize) -> Comm {
        Comm { member: Arc::new(member), device, issuing: Mutex::new(()), grouped_by: Mutex::new(None) }
    }

    /// NCCL's thread-safety rule: one thread issues on a communicator at a
    /// time, and all of a group's calls come from the thread that opened it.
    fn check_thread(&self, what: &str) -> Result<()> {
        let me = std::thread::current().id();
        let holder = *self.grouped_by.lock().unwrap_or_else(|p| p.into_inner());
        match holder {
            Some(t) if t != me => Err(EmuError::new(
                code::INVALID_USAGE,
                format!(
                    "{what}: called on thread {me:?} while thread {t:?}'s open group holds calls of this \
                     communicator (NCCL requires one thread to issue all of a group's calls)"
                ),
            )),
            _ => Ok(()),
        }
    }

    fn describe(&self) -> String {
        format!("rank {} of {} on GPU {}", self.member.rank, self.member.nranks, self.device)
    }
}

#[derive(Default)]
struct Registry {
    live: HashMap<usize, Arc<Comm>>,
    /// Destroyed handles (never reused) and what they were.
    destroyed: HashMap<usize, String>,
    next: usize,
}

/// Handles are numbers, never reused, so a destroyed one is recognised.
const HANDLE_BASE: usize = 0xCC_0000_0000;

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::default()));

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

fn register(comm: Arc<Comm>) -> usize {
    let mut r = registry();
    r.next += 1;
    let handle = HANDLE_BASE + r.next * 0x10;
    r.live.insert(handle, comm);
    handle
}

fn lookup(handle: *mut c_void, what: &str) -> Result<Arc<Comm>> {
    let h = handle as usize;
    if h == 0 {
        return Err(EmuError::new(code::INVALID_ARGUMENT, format!("{what}: comm is NULL")));
    }
    let r = registry();
    if let Some(c) = r.live.get(&h) {
        return Ok(c.clone());
    }
    Err(match r.destroyed.get(&h) {
        Some(was) => EmuError::new(
            code::INVALID_USAGE,
            format!("{what}: communicator {h:#x} ({was}) was used after ncclCommDestroy/ncclCommAbort"),
        ),
        None => EmuError::new(
            code::INVALID_ARGUMENT,
            format!("{what}: {h:#x} is not a communicator (ncclCommInitRank and ncclCommInitAll make them)"),
        ),
    })
}

static LAST: Mutex<Option<CString>> = Mutex::new(None);

fn fail(e: EmuError) -> c_int {
    let text = CString::new(e.message.replace('\0', " ")).expect("NULs replaced");
    *LAST.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
    error::report(Lib::Nccl, &e) as c_int
}

/// Runs an entry point's body: its error as an ncclResult_t (reported), a
/// panic as ncclInternalError instead of unwinding into C.
fn entry(f: impl FnOnce() -> Result<()>) -> c_int {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => code::SUCCESS as c_int,
        Ok(Err(e)) => fail(e),
        Err(_) => {
            fail(EmuError::new(code::INTERNAL_ERROR, "the NCCL stand-in panicked (a pipewright-emu bug)"))
        }
    }
}

/// A driver-side error (a CUresult) restated as NCCL's `code`.
fn as_nccl(code: u32) -> impl Fn(EmuError) -> EmuError {
    move |e| EmuError::new(code, e.message)
}

fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: a non-NULL out-parameter is the caller's promise of a valid T.
    unsafe { p.as_mut() }.ok_or_else(|| EmuError::new(code::INVALID_ARGUMENT, format!("{what} is NULL")))
}

/// One thread's open groups and what they queued.
#[derive(Default)]
struct Group {
    depth: usize,
    calls: Vec<(Arc<Comm>, usize, Stamped)>,
    /// Ranks joined inside the group, waited for at its end.
    inits: Vec<Arc<Comm>>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// One stream's share of a group: its calls, in the order made.
type Share = Vec<(Arc<Comm>, Stamped)>;

/// Queues one stream's share of calls as one piece of work.
fn enqueue(stream_handle: usize, calls: Share) -> Result<()> {
    let label = calls
        .iter()
        .map(|(c, s)| format!("{} (rank {} of {})", s.call, c.member.rank, c.member.nranks))
        .collect::<Vec<_>>()
        .join(", ");
    let work = Box::new(move || {
        let items: Vec<(&Member, Stamped)> = calls.iter().map(|(c, s)| (&*c.member, *s)).collect();
        // SAFETY: the buffers were checked to lie in live allocations of the
        // communicator's GPU when the calls were made; the stream's order
        // is what keeps them alive and unwritten meanwhile, as on a GPU.
        unsafe { engine::execute(&items) }.map_err(|e| {
            let text = CString::new(e.message.replace('\0', " ")).expect("NULs replaced");
            *LAST.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
            EmuError::new(cu::LAUNCH_FAILED, format!("NCCL: {}", e.message))
        })
    });
    stream::enqueue(stream_handle, label, work).map_err(as_nccl(code::UNHANDLED_CUDA_ERROR))
}

/// Issues a checked, numbered call: queued in the open group, else on its stream now.
fn issue(comm: Arc<Comm>, stream_handle: usize, stamped: Stamped) -> Result<()> {
    let queued = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return None;
        }
        *comm.grouped_by.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::thread::current().id());
        g.calls.push((comm.clone(), stream_handle, stamped));
        Some(())
    });
    match queued {
        Some(()) => Ok(()),
        None => enqueue(stream_handle, vec![(comm, stamped)]),
    }
}

/// The checks and queuing every collective and send/receive share.
#[allow(clippy::too_many_arguments)]
fn call(
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    op: Option<c_int>,
    peer: Option<c_int>,
    comm: *mut c_void,
    stream_handle: *mut c_void,
) -> Result<()> {
    let comm = lookup(comm, kind.name())?;
    let m = &comm.member;
    let what = format!("{} ({})", kind.name(), comm.describe());
    let _issuing = comm.issuing.try_lock().map_err(|_| {
        EmuError::new(
            code::INVALID_USAGE,
            format!("{what}: another thread is issuing a call on this communicator at the same moment (NCCL communicators are not thread-safe)"),
        )
    })?;
    comm.check_thread(&what)?;
    let dtype = DataType::from_raw(datatype as i64, &what)?;
    let op = op.map(|o| RedOp::from_raw(o as i64, &what)).transpose()?;
    let peer = match peer {
        None => 0,
        Some(p) if p >= 0 && (p as usize) < m.nranks => p as usize,
        Some(p) => {
            let role = if kind.is_collective() { "root" } else { "peer" };
            return Err(EmuError::new(
                code::INVALID_ARGUMENT,
                format!("{what}: {role} {p} is not a rank of the communicator (0..{})", m.nranks),
            ));
        }
    };
    let stream_handle = stream_handle as usize;
    let on = stream::device_of(stream_handle).map_err(as_nccl(code::INVALID_ARGUMENT))?;
    if on != comm.device {
        return Err(EmuError::new(
            code::INVALID_USAGE,
            format!(
                "{what}: stream {stream_handle:#x} belongs to GPU {on}; a communicator's calls go on a stream of \
                 its own GPU ({})",
                comm.device
            ),
        ));
    }
    let (send_bytes, recv_bytes) =
        engine::extents(kind, count, dtype, m.nranks, m.rank, peer).ok_or_else(|| {
            EmuError::new(
                code::INVALID_ARGUMENT,
                format!("{what}: count {count} overflows the address space"),
            )
        })?;
    let (send, recv) = (send as u64, recv as u64);
    for (name, ptr, bytes) in [("sendbuff", send, send_bytes), ("recvbuff", recv, recv_bytes)] {
        if let Some(b) = bytes.filter(|&b| b > 0) {
            memory::check_range(ptr, b as u64, comm.device, &format!("{what}: {name} ({b} bytes)"))
                .map_err(as_nccl(code::INVALID_ARGUMENT))?;
        }
    }
    if let (Some(sb), Some(rb)) = (send_bytes, recv_bytes) {
        check_overlap(&what, kind, send, sb as u64, recv, rb as u64, (m.rank * sb) as u64)?;
    }
    // SAFETY: the extents were just checked to lie in live allocations of
    // the communicator's GPU; the stream's order keeps them live until the
    // work runs, as it does for a GPU's NCCL kernel.
    let op = unsafe { Op::from_raw(kind, send, recv, count, dtype, op, peer) };
    let stamped = m.stamp(&op)?;
    issue(comm.clone(), stream_handle, stamped)
}

/// Overlapping send and receive buffers are allowed only in NCCL's in-place
/// form: the same address, or for ncclAllGather sendbuff = recvbuff + rank ×
/// count (`slot`); anything else gives results that depend on the algorithm.
fn check_overlap(what: &str, kind: Kind, send: u64, sb: u64, recv: u64, rb: u64, slot: u64) -> Result<()> {
    let overlap = sb > 0 && rb > 0 && send < recv + rb && recv < send + sb;
    let in_place = match kind {
        Kind::AllGather => send == recv + slot,
        _ => send == recv,
    };
    if !overlap || in_place {
        return Ok(());
    }
    let form = match kind {
        Kind::AllGather => "sendbuff = recvbuff + rank × count × element size",
        _ => "sendbuff = recvbuff",
    };
    Err(EmuError::new(
        code::INVALID_ARGUMENT,
        format!(
            "{what}: sendbuff [{send:#x}, +{sb}) and recvbuff [{recv:#x}, +{rb}) overlap without being in place \
             ({form})"
        ),
    ))
}

// ---- the entry points ------------------------------------------------------

#[no_mangle]
pub extern "C" fn ncclGetVersion(version: *mut c_int) -> c_int {
    entry(|| {
        *out(version, "ncclGetVersion: version")? = VERSION_CODE;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclGetUniqueId(unique_id: *mut NcclUniqueId) -> c_int {
    entry(|| {
        let id = out(unique_id, "ncclGetUniqueId: uniqueId")?;
        for (d, s) in id.internal.iter_mut().zip(UniqueId::new().0) {
            *d = s as c_char;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: c_int) -> *const c_char {
    let Ok(code) = u32::try_from(result) else { return types::describe(u32::MAX).as_ptr() };
    error::latest_message(Lib::Nccl, code).unwrap_or_else(|| types::describe(code).as_ptr())
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: *mut c_void) -> *const c_char {
    match LAST.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        // Leaked on purpose: the caller may hold it after a later error.
        Some(text) => Box::leak(text.clone().into_boxed_c_str()).as_ptr(),
        None => c"".as_ptr(),
    }
}

fn join_rank(id: &UniqueId, nranks: c_int, rank: c_int, device: usize, config: Config) -> Result<Member> {
    let (session, ordinal) = device_identity(device);
    let nranks = usize::try_from(nranks).unwrap_or(0);
    let rank = usize::try_from(rank).unwrap_or(usize::MAX);
    Member::join(id, nranks, rank, DeviceId { session, ordinal }, config)
}

#[no_mangle]
pub extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    comm_id: NcclUniqueId,
    rank: c_int,
) -> c_int {
    entry(|| {
        let what = format!("ncclCommInitRank (rank {rank} of {nranks})");
        let slot = out(comm, &format!("{what}: comm"))?;
        let device = context::current_device().map_err(|e| {
            EmuError::new(
                code::INVALID_USAGE,
                format!("{what}: NCCL puts the rank on the current GPU, and there is none: {}", e.message),
            )
        })?;
        let config = Config::from_env()?;
        let id = UniqueId(comm_id.internal.map(|c| c as u8));
        let member = join_rank(&id, nranks, rank, device, config)
            .map_err(|e| EmuError::new(e.code, format!("{what}: {}", e.message)))?;
        let comm = Arc::new(Comm::new(member, device));
        let in_group = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            (g.depth > 0).then(|| g.inits.push(comm.clone())).is_some()
        });
        if !in_group {
            comm.member
                .wait_for_all()
                .map_err(|e| EmuError::new(e.code, format!("{what}: {}", e.message)))?;
        }
        *slot = register(comm) as *mut c_void;
        Ok(())
    })
}

/// # Safety
/// `comms` has room for `ndev` handles and `devlist` (unless NULL) holds
/// `ndev` ordinals, as nccl.h requires.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut *mut c_void,
    ndev: c_int,
    devlist: *const c_int,
) -> c_int {
    entry(|| {
        let n = usize::try_from(ndev).ok().filter(|&n| n > 0).ok_or_else(|| {
            EmuError::new(
                code::INVALID_ARGUMENT,
                format!("ncclCommInitAll: ndev {ndev}: at least one GPU is needed"),
            )
        })?;
        if comms.is_null() {
            return Err(EmuError::new(code::INVALID_ARGUMENT, "ncclCommInitAll: comms is NULL"));
        }
        let devices: Vec<usize> = if devlist.is_null() {
            (0..n).collect()
        } else {
            // SAFETY: the caller's list of ndev ordinals.
            let list = unsafe { std::slice::from_raw_parts(devlist, n) };
            list.iter()
                .map(|&d| {
                    usize::try_from(d).map_err(|_| {
                        EmuError::new(
                            code::INVALID_ARGUMENT,
                            format!("ncclCommInitAll: devlist {list:?}: GPU {d}"),
                        )
                    })
                })
                .collect::<Result<_>>()?
        };
        for &d in &devices {
            crate::memory::check_device(d, "ncclCommInitAll")
                .map_err(|e| EmuError::new(code::INVALID_ARGUMENT, e.message))?;
        }
        let what = format!("ncclCommInitAll over GPUs {devices:?}");
        let config = Config::from_env()?;
        let id = UniqueId::new();
        // Every rank joins before any waits: one thread stands in for all.
        let members = devices
            .iter()
            .enumerate()
            .map(|(r, &d)| join_rank(&id, ndev, r as c_int, d, config))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| EmuError::new(e.code, format!("{what}: {}", e.message)))?;
        for m in &members {
            m.wait_for_all().map_err(|e| EmuError::new(e.code, format!("{what}: {}", e.message)))?;
        }
        for (r, (m, device)) in members.into_iter().zip(devices).enumerate() {
            let handle = register(Arc::new(Comm::new(m, device)));
            // SAFETY: the caller's array of ndev handles.
            unsafe { *comms.add(r) = handle as *mut c_void };
        }
        Ok(())
    })
}

fn retire(comm: *mut c_void, what: &str, abort: bool) -> Result<()> {
    if comm.is_null() {
        // NCCL accepts destroying a NULL communicator as a no-op.
        return Ok(());
    }
    let c = lookup(comm, what)?;
    let mut r = registry();
    r.live.remove(&(comm as usize));
    r.destroyed.insert(comm as usize, c.describe());
    drop(r);
    if abort {
        c.member.fail(&format!("{} aborted the communicator (ncclCommAbort)", c.describe()));
    }
    // The rank leaves the region when its queued work, which holds the
    // member too, is done.
    Ok(())
}

#[no_mangle]
pub extern "C" fn ncclCommDestroy(comm: *mut c_void) -> c_int {
    entry(|| retire(comm, "ncclCommDestroy", false))
}

#[no_mangle]
pub extern "C" fn ncclCommAbort(comm: *mut c_void) -> c_int {
    entry(|| retire(comm, "ncclCommAbort", true))
}

#[no_mangle]
pub extern "C" fn ncclCommCount(comm: *const c_void, count: *mut c_int) -> c_int {
    entry(|| {
        let c = lookup(comm as *mut c_void, "ncclCommCount")?;
        *out(count, "ncclCommCount: count")? = c.member.nranks as c_int;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclCommCuDevice(comm: *const c_void, device: *mut c_int) -> c_int {
    entry(|| {
        let c = lookup(comm as *mut c_void, "ncclCommCuDevice")?;
        *out(device, "ncclCommCuDevice: device")? = c.device as c_int;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclCommUserRank(comm: *const c_void, rank: *mut c_int) -> c_int {
    entry(|| {
        let c = lookup(comm as *mut c_void, "ncclCommUserRank")?;
        *out(rank, "ncclCommUserRank: rank")? = c.member.rank as c_int;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    entry(|| call(Kind::AllReduce, sendbuff, recvbuff, count, datatype, Some(op), None, comm, stream))
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    entry(|| call(Kind::Reduce, sendbuff, recvbuff, count, datatype, Some(op), Some(root), comm, stream))
}

#[no_mangle]
pub extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    entry(|| call(Kind::Broadcast, sendbuff, recvbuff, count, datatype, None, Some(root), comm, stream))
}

#[no_mangle]
pub extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    entry(|| call(Kind::AllGather, sendbuff, recvbuff, sendcount, datatype, None, None, comm, stream))
}

#[no_mangle]
pub extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    entry(|| {
        call(Kind::Send, sendbuff, std::ptr::null_mut(), count, datatype, None, Some(peer), comm, stream)
    })
}

#[no_mangle]
pub extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    entry(|| call(Kind::Recv, std::ptr::null(), recvbuff, count, datatype, None, Some(peer), comm, stream))
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> c_int {
    GROUP.with(|g| g.borrow_mut().depth += 1);
    code::SUCCESS as c_int
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> c_int {
    entry(|| {
        let (calls, inits) = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Err(EmuError::new(
                    code::INVALID_USAGE,
                    "ncclGroupEnd without a matching ncclGroupStart",
                ));
            }
            g.depth -= 1;
            Ok(if g.depth == 0 {
                (std::mem::take(&mut g.calls), std::mem::take(&mut g.inits))
            } else {
                Default::default()
            })
        })?;
        let mut first_error = None;
        for c in inits {
            if let Err(e) = c.member.wait_for_all() {
                c.member.fail(&e.message);
                first_error.get_or_insert(e);
            }
        }
        for (comm, _, _) in &calls {
            *comm.grouped_by.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        // Each stream's calls, in the order made, as one piece of work.
        let mut streams: Vec<(usize, Share)> = vec![];
        for (comm, s, stamped) in calls {
            match streams.iter_mut().find(|(h, _)| *h == s) {
                Some((_, v)) => v.push((comm, stamped)),
                None => streams.push((s, vec![(comm, stamped)])),
            }
        }
        for (s, calls) in streams {
            if let Err(e) = enqueue(s, calls) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    })
}
