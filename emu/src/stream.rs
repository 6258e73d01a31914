//! Streams as ordered queues on worker threads, and events (this interface
//! is what cublaslt and nccl use and must keep its signatures).
//!
//! Every stream has its own worker thread that runs its queue in order.
//! Each queued operation gets a sequence number; an event is a (stream,
//! sequence) pair set by cuEventRecord, done when the stream has completed
//! that many operations, so waiting for an event is waiting on the stream's
//! completion counter. The legacy default stream (handle 0 or
//! CU_STREAM_LEGACY) orders itself against every blocking stream of its
//! context, as the driver documents; CU_STREAM_NON_BLOCKING streams (what
//! cudarc creates) do not. CU_STREAM_PER_THREAD is one blocking stream per
//! (thread, context). A failed operation is its context's sticky error;
//! once a context has one, the rest of its queued work is skipped.

use crate::context::{self, Context};
use crate::error::{self, cu, EmuError, Lib, Result};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

/// Work queued on a stream: runs on the stream's worker thread, after
/// everything queued on it before; an Err is the stream's context's sticky
/// error, reported by the next call that synchronizes with it.
pub type Work = Box<dyn FnOnce() -> Result<()> + Send>;

pub const STREAM_TAG: usize = 0x50_0000_0000;
pub const EVENT_TAG: usize = 0xE0_0000_0000;
pub const CU_STREAM_LEGACY: usize = 1;
pub const CU_STREAM_PER_THREAD: usize = 2;
pub const CU_STREAM_NON_BLOCKING: u32 = 1;
pub const CU_EVENT_DISABLE_TIMING: u32 = 2;

enum Op {
    Work { label: String, work: Work, access: Option<Box<race::Access>> },
    Wait { on: Arc<Stream>, seq: u64 },
    Mark { event: Arc<Event>, seq: u64 },
}

struct Queue {
    ops: VecDeque<Op>,
    submitted: u64,
    completed: u64,
    shutdown: bool,
}

pub struct Stream {
    pub handle: usize,
    pub ctx: Arc<Context>,
    /// Synchronizes with the legacy default stream (not CU_STREAM_NON_BLOCKING).
    pub blocking: bool,
    pub legacy: bool,
    queue: Mutex<Queue>,
    done: Condvar,
    /// PW_EMU_CHECK=race: what this stream's completed work is ordered after.
    clock: Mutex<race::Clock>,
}

impl Stream {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `op`; returns its sequence number (1-based).
    fn push(&self, op: Op) -> u64 {
        self.push_with(|_| op)
    }

    /// Queues the op `make` builds from its own sequence number.
    fn push_with(&self, make: impl FnOnce(u64) -> Op) -> u64 {
        let mut q = self.lock();
        let seq = q.submitted + 1;
        q.ops.push_back(make(seq));
        q.submitted = seq;
        self.done.notify_all();
        seq
    }

    fn submitted(&self) -> u64 {
        self.lock().submitted
    }

    fn pending(&self) -> bool {
        let q = self.lock();
        q.completed < q.submitted
    }

    /// Blocks until the stream has completed `seq` operations.
    fn wait_for(&self, seq: u64) {
        let mut q = self.lock();
        while q.completed < seq {
            q = self.done.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn reached(&self, seq: u64) -> bool {
        self.lock().completed >= seq
    }

    fn worker(self: Arc<Stream>) {
        loop {
            let op = {
                let mut q = self.lock();
                loop {
                    if let Some(op) = q.ops.pop_front() {
                        break op;
                    }
                    if q.shutdown {
                        return;
                    }
                    q = self.done.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            match op {
                Op::Work { label, work, access } => {
                    // After a failure the context is unusable, as on hardware:
                    // later work is skipped, the sticky error stands for it.
                    let seq = self.lock().completed + 1;
                    let checked = match access {
                        Some(a) => race::check(&self, seq, &label, *a),
                        None => Ok(()),
                    };
                    if self.ctx.sticky().is_none() {
                        if let Err(e) = checked.and_then(|()| work()) {
                            let e = EmuError::new(e.code, format!("{label}: {}", e.message));
                            error::report(Lib::Driver, &e);
                            self.ctx.fail(e);
                        }
                    }
                }
                Op::Wait { on, seq } => {
                    on.wait_for(seq);
                    if race::enabled() {
                        let theirs = on.clock.lock().unwrap_or_else(|p| p.into_inner()).clone();
                        race::merge(&mut self.clock.lock().unwrap_or_else(|p| p.into_inner()), &theirs);
                    }
                }
                Op::Mark { event, seq } => {
                    let mut rec = event.lock();
                    if rec.seq == seq && rec.stream.as_ref().is_some_and(|s| Arc::ptr_eq(s, &self)) {
                        rec.time = Some(Instant::now());
                    }
                }
            }
            let mut q = self.lock();
            q.completed += 1;
            self.done.notify_all();
        }
    }
}

pub struct Event {
    pub handle: usize,
    pub timing: bool,
    rec: Mutex<Record>,
}

struct Record {
    stream: Option<Arc<Stream>>,
    seq: u64,
    time: Option<Instant>,
}

impl Event {
    fn lock(&self) -> MutexGuard<'_, Record> {
        self.rec.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Registry {
    streams: HashMap<usize, Arc<Stream>>,
    /// Context handle → its legacy default stream.
    legacy: HashMap<usize, Arc<Stream>>,
    events: HashMap<usize, Arc<Event>>,
    /// Destroyed streams whose queued work may still run (the driver lets
    /// it finish); context synchronization and frees wait for it too.
    draining: Vec<Arc<Stream>>,
    next: usize,
}

fn registry() -> MutexGuard<'static, Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| {
        Mutex::new(Registry {
            streams: HashMap::new(),
            legacy: HashMap::new(),
            events: HashMap::new(),
            draining: Vec::new(),
            next: 1,
        })
    })
    .lock()
    .unwrap_or_else(|p| p.into_inner())
}

thread_local! {
    /// (context handle, this thread's per-thread default stream of it).
    static PER_THREAD: RefCell<Vec<(usize, Arc<Stream>)>> = const { RefCell::new(Vec::new()) };
}

fn spawn(ctx: Arc<Context>, blocking: bool, legacy: bool, handle: usize) -> Result<Arc<Stream>> {
    let stream = Arc::new(Stream {
        handle,
        ctx,
        blocking,
        legacy,
        queue: Mutex::new(Queue { ops: VecDeque::new(), submitted: 0, completed: 0, shutdown: false }),
        done: Condvar::new(),
        clock: Mutex::new(race::Clock::new()),
    });
    let worker = stream.clone();
    std::thread::Builder::new()
        .name(format!("pw-emu-stream-{handle:#x}"))
        .spawn(move || worker.worker())
        .map_err(|e| EmuError::new(cu::OUT_OF_MEMORY, format!("cuStreamCreate: no worker thread: {e}")))?;
    Ok(stream)
}

/// A new stream of the current context (cuStreamCreate); `flags` as the driver's.
pub fn create(flags: u32) -> Result<usize> {
    let ctx = context::current("cuStreamCreate")?;
    if flags & !CU_STREAM_NON_BLOCKING != 0 {
        return Err(EmuError::new(cu::INVALID_VALUE, format!("cuStreamCreate: unknown flags {flags:#x}")));
    }
    let handle = {
        let mut r = registry();
        r.next += 1;
        STREAM_TAG + r.next
    };
    let stream = spawn(ctx, flags & CU_STREAM_NON_BLOCKING == 0, false, handle)?;
    registry().streams.insert(handle, stream);
    Ok(handle)
}

/// Destroys a stream: its queued work still runs, then its worker ends (cuStreamDestroy).
pub fn destroy(handle: usize) -> Result<()> {
    let removed = {
        let mut r = registry();
        r.draining.retain(|s| s.pending());
        let removed = r.streams.remove(&handle);
        if let Some(s) = &removed {
            r.draining.push(s.clone());
        }
        removed
    };
    let stream = removed.ok_or_else(|| unknown_stream(handle, "cuStreamDestroy"))?;
    let mut q = stream.lock();
    q.shutdown = true;
    stream.done.notify_all();
    Ok(())
}

fn unknown_stream(handle: usize, call: &str) -> EmuError {
    EmuError::new(
        cu::INVALID_HANDLE,
        format!("{call}: {handle:#x} is not a live stream ({})", crate::driver::what_handle(handle)),
    )
}

/// The stream a CUstream value names (0 and CU_STREAM_LEGACY: the current
/// context's legacy default stream; CU_STREAM_PER_THREAD: this thread's).
pub fn resolve(handle: usize, call: &str) -> Result<Arc<Stream>> {
    match handle {
        0 | CU_STREAM_LEGACY => {
            let ctx = context::current(call)?;
            let mut r = registry();
            if let Some(s) = r.legacy.get(&ctx.handle) {
                return Ok(s.clone());
            }
            r.next += 1;
            let handle = STREAM_TAG + r.next;
            let s = spawn(ctx.clone(), true, true, handle)?;
            r.legacy.insert(ctx.handle, s.clone());
            Ok(s)
        }
        CU_STREAM_PER_THREAD => {
            let ctx = context::current(call)?;
            if let Some(s) =
                PER_THREAD.with(|p| p.borrow().iter().find(|(c, _)| *c == ctx.handle).map(|(_, s)| s.clone()))
            {
                return Ok(s);
            }
            let handle = {
                let mut r = registry();
                r.next += 1;
                STREAM_TAG + r.next
            };
            let s = spawn(ctx.clone(), true, false, handle)?;
            registry().streams.insert(handle, s.clone());
            PER_THREAD.with(|p| p.borrow_mut().push((ctx.handle, s.clone())));
            Ok(s)
        }
        h => {
            let found = registry().streams.get(&h).cloned();
            found.ok_or_else(|| unknown_stream(h, call))
        }
    }
}

/// Queues `work` on `stream` (a CUstream's value; 0 is the legacy default
/// stream of the current context). `label` names the work in errors.
pub fn enqueue(stream: usize, label: String, work: Work) -> Result<()> {
    enqueue_tracked(stream, label, work, Vec::new())
}

/// `enqueue` for work whose memory accesses are known: (allocation base,
/// written, what touches it), checked by PW_EMU_CHECK=race against the
/// other streams' accesses.
pub fn enqueue_tracked(
    stream: usize,
    label: String,
    work: Work,
    touches: Vec<(u64, bool, String)>,
) -> Result<()> {
    let s = resolve(stream, &label)?;
    s.ctx.check(&label)?;
    order_against_legacy(&s);
    let access = (race::enabled() && !touches.is_empty()).then(|| Box::new(race::Access::from_host(touches)));
    s.push(Op::Work { label, work, access });
    Ok(())
}

/// The host has seen everything `s` completed so far (PW_EMU_CHECK=race).
pub fn host_saw(s: &Stream) {
    if race::enabled() {
        let theirs = s.clock.lock().unwrap_or_else(|p| p.into_inner()).clone();
        race::host_merge(&theirs);
    }
}

/// Blocks until `s` has completed `seq` operations, from the host.
pub fn host_wait(s: &Stream, seq: u64) {
    s.wait_for(seq);
    host_saw(s);
}

/// The legacy default stream's implicit synchronization: work on it waits
/// for every blocking stream's earlier work, and a blocking stream's work
/// waits for the legacy stream's earlier work.
fn order_against_legacy(s: &Arc<Stream>) {
    if !s.blocking {
        return;
    }
    if s.legacy {
        let others: Vec<Arc<Stream>> = registry()
            .streams
            .values()
            .filter(|o| o.blocking && Arc::ptr_eq(&o.ctx, &s.ctx) && !Arc::ptr_eq(o, s))
            .cloned()
            .collect();
        for o in others.into_iter().filter(|o| o.pending()) {
            let seq = o.submitted();
            s.push(Op::Wait { on: o, seq });
        }
    } else {
        let legacy = registry().legacy.get(&s.ctx.handle).cloned();
        if let Some(l) = legacy.filter(|l| l.pending()) {
            let seq = l.submitted();
            s.push(Op::Wait { on: l, seq });
        }
    }
}

/// The device a stream belongs to.
pub fn device_of(stream: usize) -> Result<usize> {
    Ok(resolve(stream, "stream lookup")?.ctx.device)
}

/// Blocks until everything queued on `stream` so far has run; then the
/// context's sticky error, if any (cuStreamSynchronize).
pub fn synchronize(stream: usize) -> Result<()> {
    let s = resolve(stream, "cuStreamSynchronize")?;
    let seq = s.submitted();
    host_wait(&s, seq);
    s.ctx.check("cuStreamSynchronize")
}

/// SUCCESS when the stream is idle, NOT_READY while work is queued (cuStreamQuery).
pub fn query(stream: usize) -> Result<()> {
    let s = resolve(stream, "cuStreamQuery")?;
    s.ctx.check("cuStreamQuery")?;
    if s.pending() {
        return Err(EmuError::new(cu::NOT_READY, "cuStreamQuery: work is still queued"));
    }
    Ok(())
}

/// Waits for every stream of `ctx` (cuCtxSynchronize, cuCtxDestroy).
pub fn synchronize_context(ctx: &Arc<Context>) -> Result<()> {
    let streams: Vec<Arc<Stream>> = {
        let r = registry();
        r.streams
            .values()
            .chain(r.legacy.values())
            .chain(r.draining.iter())
            .filter(|s| Arc::ptr_eq(&s.ctx, ctx))
            .cloned()
            .collect()
    };
    for s in streams {
        let seq = s.submitted();
        host_wait(&s, seq);
    }
    ctx.check("cuCtxSynchronize")
}

/// Ends the worker threads of every stream of a destroyed context (their
/// queues are empty: the caller synchronized first).
pub fn retire_context(ctx: &Arc<Context>) {
    let retired: Vec<Arc<Stream>> = {
        let mut r = registry();
        let handles: Vec<usize> =
            r.streams.iter().filter(|(_, s)| Arc::ptr_eq(&s.ctx, ctx)).map(|(&h, _)| h).collect();
        let mut retired: Vec<Arc<Stream>> = handles.iter().filter_map(|h| r.streams.remove(h)).collect();
        retired.extend(r.legacy.remove(&ctx.handle));
        retired
    };
    for s in retired {
        s.lock().shutdown = true;
        s.done.notify_all();
    }
}

/// A new event (cuEventCreate); `flags` as the driver's.
pub fn event_create(flags: u32) -> Result<usize> {
    context::current("cuEventCreate")?;
    if flags & !(1 | CU_EVENT_DISABLE_TIMING) != 0 {
        return Err(EmuError::new(
            cu::INVALID_VALUE,
            format!("cuEventCreate: flags {flags:#x} (only BLOCKING_SYNC and DISABLE_TIMING are emulated)"),
        ));
    }
    let mut r = registry();
    r.next += 1;
    let handle = EVENT_TAG + r.next;
    let event = Arc::new(Event {
        handle,
        timing: flags & CU_EVENT_DISABLE_TIMING == 0,
        rec: Mutex::new(Record { stream: None, seq: 0, time: None }),
    });
    r.events.insert(handle, event);
    Ok(handle)
}

fn event(handle: usize, call: &str) -> Result<Arc<Event>> {
    let found = registry().events.get(&handle).cloned();
    found.ok_or_else(|| {
        EmuError::new(
            cu::INVALID_HANDLE,
            format!("{call}: {handle:#x} is not a live event ({})", crate::driver::what_handle(handle)),
        )
    })
}

/// Destroys an event; waits already queued on it still hold (cuEventDestroy).
pub fn event_destroy(handle: usize) -> Result<()> {
    let removed = registry().events.remove(&handle);
    removed.map(|_| ()).ok_or_else(|| {
        EmuError::new(
            cu::INVALID_HANDLE,
            format!(
                "cuEventDestroy: {handle:#x} is not a live event ({})",
                crate::driver::what_handle(handle)
            ),
        )
    })
}

/// Records `event` at the current end of `stream`'s queue (cuEventRecord).
pub fn event_record(handle: usize, stream: usize) -> Result<()> {
    let e = event(handle, "cuEventRecord")?;
    let s = resolve(stream, "cuEventRecord")?;
    s.ctx.check("cuEventRecord")?;
    order_against_legacy(&s);
    // The record lock is held across the push so the marker cannot run
    // before the event knows its sequence.
    let mut rec = e.lock();
    let seq = s.push_with(|seq| Op::Mark { event: e.clone(), seq });
    rec.stream = Some(s.clone());
    rec.seq = seq;
    rec.time = None;
    Ok(())
}

/// Makes `stream` wait for the work `event` stands for (cuStreamWaitEvent).
/// An event never recorded is already complete, as the driver documents.
pub fn wait_event(stream: usize, handle: usize) -> Result<()> {
    let e = event(handle, "cuStreamWaitEvent")?;
    let s = resolve(stream, "cuStreamWaitEvent")?;
    s.ctx.check("cuStreamWaitEvent")?;
    let (on, seq) = {
        let rec = e.lock();
        match &rec.stream {
            Some(on) => (on.clone(), rec.seq),
            None => return Ok(()),
        }
    };
    if !Arc::ptr_eq(&on, &s) {
        s.push(Op::Wait { on, seq });
    }
    Ok(())
}

/// Blocks until the event's work has run (cuEventSynchronize).
pub fn event_synchronize(handle: usize) -> Result<()> {
    let e = event(handle, "cuEventSynchronize")?;
    let rec = e.lock();
    let Some((on, seq)) = rec.stream.clone().map(|s| (s, rec.seq)) else { return Ok(()) };
    drop(rec);
    host_wait(&on, seq);
    on.ctx.check("cuEventSynchronize")
}

/// SUCCESS when the event's work has run, NOT_READY before (cuEventQuery).
pub fn event_query(handle: usize) -> Result<()> {
    let e = event(handle, "cuEventQuery")?;
    let rec = e.lock();
    let Some((on, seq)) = rec.stream.clone().map(|s| (s, rec.seq)) else { return Ok(()) };
    drop(rec);
    on.ctx.check("cuEventQuery")?;
    if !on.reached(seq) {
        return Err(EmuError::new(cu::NOT_READY, "cuEventQuery: the recorded work has not run yet"));
    }
    Ok(())
}

/// Milliseconds between two completed events (cuEventElapsedTime).
pub fn elapsed_ms(start: usize, end: usize) -> Result<f32> {
    let (a, b) = (event(start, "cuEventElapsedTime")?, event(end, "cuEventElapsedTime")?);
    if !a.timing || !b.timing {
        return Err(EmuError::new(
            cu::INVALID_HANDLE,
            "cuEventElapsedTime: an event created with CU_EVENT_DISABLE_TIMING has no time",
        ));
    }
    let time = |e: &Event| -> Result<Instant> {
        let rec = e.lock();
        if rec.stream.is_none() {
            return Err(EmuError::new(
                cu::INVALID_HANDLE,
                format!("cuEventElapsedTime: event {:#x} was never recorded", e.handle),
            ));
        }
        rec.time.ok_or_else(|| EmuError::new(cu::NOT_READY, "cuEventElapsedTime: an event has not completed"))
    };
    let (ta, tb) = (time(&a)?, time(&b)?);
    let ms = if tb >= ta { (tb - ta).as_secs_f64() * 1e3 } else { -((ta - tb).as_secs_f64() * 1e3) };
    Ok(ms as f32)
}

/// Which kind of handle `h` is, if it is one of ours.
pub fn is_stream(h: usize) -> bool {
    registry().streams.contains_key(&h)
}

pub fn is_event(h: usize) -> bool {
    registry().events.contains_key(&h)
}

/// PW_EMU_CHECK=race: work on one stream touching an allocation that work on
/// another stream touched, with no event wait or host synchronization
/// ordering the two (at least one of them a write), is an error naming both.
///
/// Each stream keeps a vector clock: for every stream, how many of its
/// operations this stream's completed work is known to follow. Running an
/// operation sets the stream's own entry; a wait merges the awaited stream's
/// clock as it is when the wait ends (which may include later work than the
/// awaited point: the check can miss a race, never invent one); the host
/// thread keeps its own clock, merged at each synchronization and carried by
/// the work it queues. Work the emulator cannot see into (NCCL, cuBLASLt
/// stand-ins, host functions) is not tracked.
pub mod race {
    use super::Stream;
    use crate::error::{cu, EmuError, Result};
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    pub type Clock = HashMap<usize, u64>;

    pub fn enabled() -> bool {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| {
            std::env::var("PW_EMU_CHECK").is_ok_and(|v| v.split(',').any(|c| c.trim() == "race"))
        })
    }

    pub fn merge(into: &mut Clock, from: &Clock) {
        for (&s, &n) in from {
            let e = into.entry(s).or_insert(0);
            *e = (*e).max(n);
        }
    }

    thread_local! {
        static HOST: RefCell<Clock> = RefCell::new(Clock::new());
    }

    pub fn host_merge(from: &Clock) {
        HOST.with(|h| merge(&mut h.borrow_mut(), from));
    }

    /// What one queued operation touches, and what the host had seen when it queued it.
    pub struct Access {
        touches: Vec<(u64, bool, String)>,
        host: Clock,
    }

    impl Access {
        pub fn from_host(touches: Vec<(u64, bool, String)>) -> Access {
            Access { touches, host: HOST.with(|h| h.borrow().clone()) }
        }
    }

    #[derive(Clone)]
    struct Touch {
        stream: usize,
        seq: u64,
        what: String,
    }

    #[derive(Default)]
    struct History {
        write: Option<Touch>,
        /// The latest read of each stream since the last write.
        reads: Vec<Touch>,
    }

    fn histories() -> std::sync::MutexGuard<'static, HashMap<u64, History>> {
        static H: OnceLock<Mutex<HashMap<u64, History>>> = OnceLock::new();
        H.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets a freed allocation's history (its address is never reused anyway).
    pub fn forget(base: u64) {
        if enabled() {
            histories().remove(&base);
        }
    }

    /// Runs on `s`'s worker before its operation number `seq` (labelled `label`).
    pub(super) fn check(s: &Stream, seq: u64, label: &str, access: Access) -> Result<()> {
        let mut clock = s.clock.lock().unwrap_or_else(|p| p.into_inner());
        merge(&mut clock, &access.host);
        clock.insert(s.handle, seq);
        let ordered = |t: &Touch| t.stream == s.handle || clock.get(&t.stream).is_some_and(|&n| n >= t.seq);
        let mut h = histories();
        for (base, write, what) in access.touches {
            let hist = h.entry(base).or_default();
            let mut conflicts: Vec<(&Touch, &str)> = Vec::new();
            if let Some(w) = hist.write.as_ref().filter(|w| !ordered(w)) {
                conflicts.push((w, "wrote"));
            }
            if write {
                conflicts.extend(hist.reads.iter().filter(|r| !ordered(r)).map(|r| (r, "read")));
            }
            if let Some((other, verb)) = conflicts.first() {
                return Err(EmuError::new(
                    cu::LAUNCH_FAILED,
                    format!(
                        "PW_EMU_CHECK=race: missing wait between streams: on stream {:#x}, {what} {} allocation {base:#x}, \
                         which {} on stream {:#x} {verb}, and no event wait or synchronization orders the two",
                        s.handle,
                        if write { "writes" } else { "reads" },
                        other.what,
                        other.stream,
                    ),
                ));
            }
            let touch = Touch { stream: s.handle, seq, what: format!("{label}: {what}") };
            if write {
                hist.write = Some(touch);
                hist.reads.clear();
            } else {
                hist.reads.retain(|r| r.stream != s.handle);
                hist.reads.push(touch);
            }
        }
        Ok(())
    }
}
