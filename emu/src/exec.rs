//! The execution engine: runs a launch's grid on the CPU.
//!
//! Blocks are spread over a pool of worker threads (PW_EMU_THREADS, default
//! one per core, at most 16); the stream thread that runs the launch waits
//! for them. A worker runs one block at a time, each of the block's threads
//! ("lanes") a fiber (a corosensei coroutine on a stack from the worker's
//! pool). The scheduler runs each fiber until it waits (at a barrier, a warp
//! collective) or ends, then the next, in lane order. A collective completes
//! when its last member arrives, which computes every member's result at
//! once, so a lane released early never sees a newer value.
//!
//! What real hardware would only sometimes punish is an error naming the
//! kernel, block and threads: a barrier not reached by every thread, a warp
//! collective whose members disagree, a fault (SIGSEGV/SIGBUS) inside a
//! kernel (trapped and turned into CUDA_ERROR_ILLEGAL_ADDRESS), a write past
//! an allocation into its alignment slack (the canary), a missing barrier
//! (PW_EMU_CHECK=order runs every launch twice in two lane orders and
//! compares the bytes it wrote).

use crate::abi::{self, Dim3, Lane};
use crate::error::{cu, EmuError, Result};
use crate::memory::{self, Allocation};
use crate::module::Function;
use corosensei::stack::DefaultStack;
use corosensei::trap::CoroutineTrapHandler;
use corosensei::{Coroutine, CoroutineResult, Yielder};
use std::cell::Cell;
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void, CStr};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock};

/// The table handed to every module (pw_emu_module_init).
pub static RUNTIME: abi::Runtime = abi::Runtime {
    abi_version: abi::ABI_VERSION,
    lane: rt_lane,
    syncthreads: rt_syncthreads,
    syncwarp: rt_syncwarp,
    shfl_sync: rt_shfl_sync,
    vote_sync: rt_vote_sync,
    mma_m16n8k16_f32_bf16: rt_mma,
    dynamic_shared: rt_dynamic_shared,
    trap: rt_trap,
    misaligned: rt_misaligned,
    access: rt_access,
};

/// Bytes of each fiber's stack (mapped lazily: only touched pages cost memory).
const STACK_BYTES: usize = 256 << 10;
/// The byte shared memory (static and dynamic) is filled with at each block
/// start: every f32, bf16 and f16 made of it is a NaN, every integer -1, so
/// a read before any write shows in the results.
pub const SHARED_POISON: u8 = 0xFF;
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;
pub const MAX_BLOCK_DIM: [u32; 3] = [1024, 1024, 64];
pub const MAX_GRID_DIM: [u32; 3] = [i32::MAX as u32, 65535, 65535];

/// A pointer argument of a launch, checked at cuLaunchKernel.
#[derive(Clone, Debug)]
pub struct PointerArg {
    pub param: usize,
    pub value: u64,
    pub alloc: Allocation,
}

/// A validated launch, its arguments copied (the caller's kernelParams may
/// be gone by the time it runs).
pub struct Launch {
    pub func: Arc<Function>,
    pub grid: Dim3,
    pub block: Dim3,
    pub shared: u32,
    pub device: usize,
    pub pointers: Vec<PointerArg>,
    /// The arguments' bytes (16-byte aligned storage) and a pointer to each.
    _storage: Box<[u128]>,
    args: Vec<*mut c_void>,
}

// SAFETY: `args` points into `_storage`, owned by the launch and never
// written after construction; kernels only read through it.
unsafe impl Send for Launch {}
unsafe impl Sync for Launch {}

fn dims(d: Dim3) -> String {
    format!("({}, {}, {})", d.x, d.y, d.z)
}

impl Launch {
    /// Checks a launch as cuLaunchKernel must (every error names the kernel
    /// and the bad value) and copies its arguments.
    ///
    /// # Safety
    /// `params` must be cuLaunchKernel's kernelParams: one pointer per
    /// kernel parameter, each to a value of the parameter's size.
    pub unsafe fn new(
        func: Arc<Function>,
        grid: Dim3,
        block: Dim3,
        shared: u32,
        device: usize,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> Result<Launch> {
        let k = func.kernel();
        let label = func.label();
        let bad =
            |what: String| Err(EmuError::new(cu::INVALID_VALUE, format!("cuLaunchKernel: {label}: {what}")));
        if !extra.is_null() {
            return bad("`extra` is not null; the emulator takes arguments only through kernelParams".into());
        }
        for (d, name) in [(grid, "grid"), (block, "block")] {
            if d.x == 0 || d.y == 0 || d.z == 0 {
                return bad(format!("{name} dimension {} has a zero", dims(d)));
            }
        }
        for (i, axis) in ["x", "y", "z"].iter().enumerate() {
            let (g, b) = ([grid.x, grid.y, grid.z][i], [block.x, block.y, block.z][i]);
            if g > MAX_GRID_DIM[i] {
                return bad(format!(
                    "grid {} exceeds the device's max grid {axis} of {}",
                    dims(grid),
                    MAX_GRID_DIM[i]
                ));
            }
            if b > MAX_BLOCK_DIM[i] {
                return bad(format!(
                    "block {} exceeds the device's max block {axis} of {}",
                    dims(block),
                    MAX_BLOCK_DIM[i]
                ));
            }
        }
        let threads = block.x as u64 * block.y as u64 * block.z as u64;
        if threads > MAX_THREADS_PER_BLOCK as u64 {
            return bad(format!(
                "block {} has {threads} threads, more than the device's {MAX_THREADS_PER_BLOCK}",
                dims(block)
            ));
        }
        if k.launch_bounds != 0 && threads > k.launch_bounds as u64 {
            return bad(format!(
                "block {} has {threads} threads, more than the kernel's __launch_bounds__ of {}",
                dims(block),
                k.launch_bounds
            ));
        }
        let max_shared = func.max_dynamic_shared();
        if shared > max_shared {
            return bad(format!(
                "{shared} bytes of dynamic shared memory asked, the function allows {max_shared} \
                 (raise CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, up to {})",
                crate::module::SHARED_OPTIN_MAX
            ));
        }
        if !k.params.is_empty() && params.is_null() {
            return bad(format!("kernelParams is null but the kernel takes {} parameters", k.params.len()));
        }
        let mut offsets = Vec::with_capacity(k.params.len());
        let mut at = 0usize;
        for p in &k.params {
            at = at.div_ceil(p.align.min(16)) * p.align.min(16);
            offsets.push(at);
            at += p.size;
        }
        let mut storage = vec![0u128; at.div_ceil(16).max(1)].into_boxed_slice();
        let base = storage.as_mut_ptr() as *mut u8;
        let mut pointers = Vec::new();
        for (i, p) in k.params.iter().enumerate() {
            let src = *params.add(i);
            if src.is_null() {
                return bad(format!("kernelParams[{i}] (`{}`, {}) is null", p.name, p.type_));
            }
            std::ptr::copy_nonoverlapping(src as *const u8, base.add(offsets[i]), p.size);
            if !p.is_pointer || p.size != 8 {
                continue;
            }
            let value = std::ptr::read_unaligned(src as *const u64);
            if value == 0 {
                continue;
            }
            match memory::find(value) {
                Some(a) if a.device == device => pointers.push(PointerArg { param: i, value, alloc: a }),
                Some(a) => {
                    return Err(EmuError::new(
                        cu::INVALID_VALUE,
                        format!(
                            "cuLaunchKernel: {label}: argument `{}` ({}) = {value:#x} is GPU {}'s memory, launched on GPU {device}",
                            p.name, p.type_, a.device
                        ),
                    ))
                }
                None => {
                    return Err(EmuError::new(
                        cu::INVALID_VALUE,
                        format!(
                            "cuLaunchKernel: {label}: argument `{}` ({}) is {}, not in a live allocation of GPU {device}",
                            p.name,
                            p.type_,
                            memory::describe(value)
                        ),
                    ))
                }
            }
        }
        let args = offsets.iter().map(|&o| base.add(o) as *mut c_void).collect();
        Ok(Launch { func, grid, block, shared, device, pointers, _storage: storage, args })
    }

    fn threads(&self) -> u32 {
        self.block.x * self.block.y * self.block.z
    }

    fn blocks(&self) -> u64 {
        self.grid.x as u64 * self.grid.y as u64 * self.grid.z as u64
    }

    fn block_idx(&self, linear: u64) -> Dim3 {
        let (gx, gy) = (self.grid.x as u64, self.grid.y as u64);
        Dim3 { x: (linear % gx) as u32, y: (linear / gx % gy) as u32, z: (linear / (gx * gy)) as u32 }
    }

    /// The distinct allocations the pointer arguments reach.
    fn allocations(&self) -> Vec<(Allocation, String)> {
        let mut out: Vec<(Allocation, String)> = Vec::new();
        for p in &self.pointers {
            let name = format!("`{}`", self.func.kernel().params[p.param].name);
            match out.iter_mut().find(|(a, _)| a.base == p.alloc.base) {
                Some((_, names)) => {
                    names.push_str(", ");
                    names.push_str(&name);
                }
                None => out.push((p.alloc, name)),
            }
        }
        out
    }
}

/// PW_EMU_CHECK's comma-separated modes, read once per process.
fn check_modes() -> &'static [String] {
    static MODES: OnceLock<Vec<String>> = OnceLock::new();
    MODES.get_or_init(|| {
        std::env::var("PW_EMU_CHECK")
            .map(|v| v.split(',').map(|c| c.trim().to_string()).filter(|c| !c.is_empty()).collect())
            .unwrap_or_default()
    })
}

fn check_mode(name: &str) -> bool {
    check_modes().iter().any(|m| m == name)
}

/// PW_EMU_CHECK=order: run every launch in two lane orders and compare.
pub fn order_check_enabled() -> bool {
    check_mode("order")
}

/// The modes that watch every load and store (their kernels are built
/// instrumented): `bounds` (an access outside its allocation, the alignment
/// slack included), `blocks` (two blocks of one launch touching one byte of
/// global memory, one of them writing), `warp` (two threads of a block
/// touching one byte of shared memory, one writing, with no barrier between).
const INSTRUMENTED_MODES: [&str; 3] = ["bounds", "blocks", "warp"];

/// PW_EMU_CHECK=warp: a byte of shared memory written by one thread and read
/// or written by another with no `__syncthreads` between them, nor a
/// `__syncwarp` both took part in (same warp), is an error naming both
/// threads. The emulator runs a warp's lanes one after another, so code that
/// counts on lockstep (a warp-synchronous reduction without `__syncwarp`)
/// reads poison or stale values instead of failing by name; so does a GPU
/// since Volta, only sometimes. Shuffles, votes and mma order no memory
/// (CUDA's memory model: only the barriers do). Each byte keeps its last
/// write and last read, so a race with an earlier reader can go unseen.
pub fn warp_check_enabled() -> bool {
    check_mode("warp")
}

/// The last write and read of one byte of shared memory (PW_EMU_CHECK=warp):
/// the barrier interval it happened in, the lane, and the lane's own clock.
#[derive(Clone, Copy, Default)]
struct SharedCell {
    w_epoch: u32,
    w_lane: u32,
    w_clock: u32,
    r_epoch: u32,
    r_lane: u32,
    r_clock: u32,
}

/// Whether an access (epoch, lane, clock) happened before lane `me`'s
/// present point, or (when false) races with it.
fn ordered(b: &Block, epoch: u32, lane: usize, clock: u32, me: usize) -> bool {
    epoch < b.epoch_start // none in this block (the cell is from an earlier one)
        || epoch < b.epoch // a __syncthreads since
        || lane == me
        || (lane / 32 == me / 32 && b.clocks[me][lane % 32] >= clock)
}

/// Records lane `me`'s access to shared byte `index`; on a race, the message.
fn record_shared(b: &mut Block, me: usize, index: usize, addr: u64, store: bool) -> Option<String> {
    let c = b.shared_cells[index];
    let clock = b.clocks[me][me % 32];
    let name = |b: &Block, l: usize| tid_of(&b.lanes[l].lane);
    let clash = if c.w_epoch != 0 && !ordered(b, c.w_epoch, c.w_lane as usize, c.w_clock, me) {
        Some((c.w_lane as usize, "wrote"))
    } else if store && c.r_epoch != 0 && !ordered(b, c.r_epoch, c.r_lane as usize, c.r_clock, me) {
        Some((c.r_lane as usize, "read"))
    } else {
        None
    };
    if let Some((them, did)) = clash {
        let between = if them / 32 == me / 32 {
            format!("both in warp {}, with no __syncwarp or __syncthreads between", me / 32)
        } else {
            format!("warps {} and {}, with no __syncthreads between", them / 32, me / 32)
        };
        return Some(format!(
            "PW_EMU_CHECK=warp: thread {} {} shared memory at {addr:#x}, which thread {} {did} ({between}): \
             a race on shared memory (the lanes of a warp are not in lockstep; order them with __syncwarp)",
            name(b, me),
            if store { "writes" } else { "reads" },
            name(b, them)
        ));
    }
    let cell = &mut b.shared_cells[index];
    if store {
        (cell.w_epoch, cell.w_lane, cell.w_clock) = (b.epoch, me as u32, clock);
    } else {
        (cell.r_epoch, cell.r_lane, cell.r_clock) = (b.epoch, me as u32, clock);
    }
    None
}

/// PW_EMU_CHECK=blocks: within one launch, a byte of an argument's
/// allocation written by one block and read or written by another is an
/// error. Blocks of a launch run in no order the hardware fixes (and at
/// once), so such a pair is a lost update or a result that depends on the
/// schedule: a plain `+=` where an atomic or per-block partials are needed.
/// (The emulator has no atomics: kernels that need them do not build.)
pub fn blocks_check_enabled() -> bool {
    check_mode("blocks")
}

/// Who touched each byte of a launch's argument allocations during one grid
/// run (PW_EMU_CHECK=blocks): per byte, the low 32 bits the last writing
/// block (linear index + 1, 0 for none), the high 32 the reading block
/// (+ 1), or MANY_READERS once two blocks read it.
struct BlockShadow {
    allocs: Vec<(Allocation, String, Box<[AtomicU64]>)>,
}

const MANY_READERS: u32 = u32::MAX;

impl BlockShadow {
    fn new(launch: &Launch) -> BlockShadow {
        let allocs = launch
            .allocations()
            .into_iter()
            .map(|(a, names)| {
                // Zeroed memory comes from the allocator's zeroed pages: only
                // the bytes a kernel touches are ever committed.
                let zeros: Box<[u64]> = vec![0u64; a.size as usize].into_boxed_slice();
                // SAFETY: AtomicU64 has u64's size and alignment.
                let cells = unsafe { Box::from_raw(Box::into_raw(zeros) as *mut [AtomicU64]) };
                (a, names, cells)
            })
            .collect();
        BlockShadow { allocs }
    }

    /// Records block `me`'s access; on a conflict, the message naming it.
    fn record(&self, launch: &Launch, me: u64, addr: u64, size: u64, store: bool) -> Option<String> {
        let (a, names, cells) =
            self.allocs.iter().find(|(a, _, _)| addr >= a.base && addr < a.base + a.size)?;
        let me32 = me as u32 + 1;
        let end = (addr + size).min(a.base + a.size);
        for at in addr..end {
            let cell = &cells[(at - a.base) as usize];
            let mut old = cell.load(Ordering::Relaxed);
            loop {
                let (writer, reader) = (old as u32, (old >> 32) as u32);
                let other = |b: u32| b != 0 && b != me32;
                let clash = if other(writer) {
                    Some((writer, "wrote"))
                } else if store && other(reader) {
                    Some((reader, "read"))
                } else {
                    None
                };
                if let Some((them, did)) = clash {
                    let them = if them == MANY_READERS {
                        "other blocks".to_string()
                    } else {
                        format!("block {}", dims(launch.block_idx(them as u64 - 1)))
                    };
                    return Some(format!(
                        "PW_EMU_CHECK=blocks: it {} {at:#x} (byte {} of argument {names}, the {}-byte allocation \
                         at {:#x}), which {them} {did} in this launch with no atomic: blocks of one launch run \
                         in no fixed order, so an update is lost or the result depends on which runs first \
                         (use an atomic, or per-block partial results combined by a second launch)",
                        if store { "stores to" } else { "loads from" },
                        at - a.base,
                        a.size,
                        a.base
                    ));
                }
                let new = if store {
                    (reader as u64) << 32 | me32 as u64
                } else {
                    let r = if reader == 0 || reader == me32 { me32 } else { MANY_READERS };
                    (r as u64) << 32 | writer as u64
                };
                match cell.compare_exchange_weak(old, new, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => break,
                    Err(now) => old = now,
                }
            }
        }
        None
    }
}

/// PW_EMU_CHECK=bounds: every access of an instrumented kernel to device
/// memory must lie inside one live allocation (reads in the slack after an
/// allocation's end, which no guard page covers, included).
pub fn bounds_check_enabled() -> bool {
    check_mode("bounds")
}

/// Whether a mode that needs instrumented kernels is on (the NVRTC stand-in
/// builds with PW_EMU_INSTRUMENT, the driver refuses modules without it).
pub fn instrumented_checks() -> bool {
    INSTRUMENTED_MODES.iter().any(|m| check_mode(m))
}

/// Those modes, for messages.
pub fn instrumented_check_names() -> String {
    INSTRUMENTED_MODES.iter().filter(|m| check_mode(m)).copied().collect::<Vec<_>>().join(",")
}

/// The order fibers are scheduled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneOrder {
    Ascending,
    Descending,
}

/// Runs the launch to completion (on a stream's worker thread), then checks
/// the canaries around every allocation it could reach.
pub fn run(launch: &Arc<Launch>) -> Result<()> {
    install_fault_handler();
    if order_check_enabled() {
        run_order_checked(launch)?;
    } else {
        run_grid(launch, LaneOrder::Ascending)?;
    }
    for (a, names) in launch.allocations() {
        memory::check_canary(a.base)
            .map_err(|e| EmuError::new(e.code, format!("argument {names}: {}", e.message)))?;
    }
    Ok(())
}

fn run_order_checked(launch: &Arc<Launch>) -> Result<()> {
    let allocs = launch.allocations();
    // SAFETY: live allocations of the launch's device, not in use by any
    // other stream's work unless the program races (which this check is
    // about).
    let bytes =
        |a: &Allocation| unsafe { std::slice::from_raw_parts_mut(a.base as *mut u8, a.size as usize) };
    let before: Vec<Vec<u8>> = allocs.iter().map(|(a, _)| bytes(a).to_vec()).collect();
    run_grid(launch, LaneOrder::Ascending)?;
    let first: Vec<Vec<u8>> = allocs.iter().map(|(a, _)| bytes(a).to_vec()).collect();
    for ((a, _), b) in allocs.iter().zip(&before) {
        bytes(a).copy_from_slice(b);
    }
    run_grid(launch, LaneOrder::Descending)?;
    for ((a, names), f) in allocs.iter().zip(&first) {
        let now = bytes(a);
        if let Some(i) = now.iter().zip(f).position(|(x, y)| x != y) {
            return Err(EmuError::new(
                cu::LAUNCH_FAILED,
                format!(
                    "PW_EMU_CHECK=order: the result depends on the order threads run in (a missing barrier \
                     or a race): argument {names} (allocation {:#x}) differs at byte {i} \
                     ({:#04x} with threads run in ascending order, {:#04x} in descending order)",
                    a.base, f[i], now[i]
                ),
            ));
        }
    }
    Ok(())
}

/// One grid run shared by the workers that take its blocks.
struct Job {
    launch: Arc<Launch>,
    order: LaneOrder,
    /// PW_EMU_CHECK=blocks: this grid run's record of who touched what.
    shadow: Option<Arc<BlockShadow>>,
    total: u64,
    next: AtomicU64,
    abort: AtomicBool,
    /// Blocks finished, and the failing block with the lowest index with its error.
    state: Mutex<(u64, Option<(u64, EmuError)>)>,
    done: Condvar,
}

impl Job {
    /// Runs blocks of this job until none are left to take.
    fn work(&self) {
        loop {
            let b = self.next.fetch_add(1, Ordering::Relaxed);
            if b >= self.total {
                return;
            }
            let result = if self.abort.load(Ordering::Relaxed) {
                Ok(())
            } else {
                run_block(&self.launch, b, self.order, self.shadow.as_ref())
            };
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = result {
                self.abort.store(true, Ordering::Relaxed);
                // Of the blocks that ran and failed, the lowest is reported
                // (blocks after the first failure are skipped, so which ran
                // depends on timing; the lowest is the likeliest to repeat).
                if s.1.as_ref().is_none_or(|(first, _)| b < *first) {
                    s.1 = Some((b, e));
                }
            }
            s.0 += 1;
            if s.0 == self.total {
                self.done.notify_all();
            }
        }
    }
}

struct Pool {
    jobs: Mutex<VecDeque<Arc<Job>>>,
    ready: Condvar,
    started: usize,
}

/// The default cap on block workers: each keeps up to 1,024 fiber stacks,
/// two memory mappings apiece (stack and guard page), and the kernel's
/// vm.max_map_count (65,530 by default) must hold them all.
const DEFAULT_THREADS_MAX: usize = 16;

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::env::var("PW_EMU_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| {
                std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(DEFAULT_THREADS_MAX)
            });
        let mut started = 0;
        for i in 0..threads {
            match std::thread::Builder::new().name(format!("pw-emu-sm{i}")).spawn(pool_worker) {
                Ok(_) => started += 1,
                Err(e) => eprintln!("pipewright-emu: libcuda: could not start block worker {i}: {e}"),
            }
        }
        Pool { jobs: Mutex::new(VecDeque::new()), ready: Condvar::new(), started }
    })
}

fn pool_worker() {
    // The fault handler must run somewhere when a fiber overflows its stack:
    // on an alternate signal stack of this thread's own if it has none (a
    // host program that is not Rust may not have given its threads one).
    give_alternate_signal_stack();
    let p = pool();
    loop {
        let job = {
            let mut jobs = p.jobs.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                // Jobs with no block left to take are dropped from the queue.
                while jobs.front().is_some_and(|j| j.next.load(Ordering::Relaxed) >= j.total) {
                    jobs.pop_front();
                }
                if let Some(j) = jobs.front() {
                    break j.clone();
                }
                jobs = p.ready.wait(jobs).unwrap_or_else(|e| e.into_inner());
            }
        };
        job.work();
    }
}

fn run_grid(launch: &Arc<Launch>, order: LaneOrder) -> Result<()> {
    let job = Arc::new(Job {
        launch: launch.clone(),
        order,
        shadow: blocks_check_enabled().then(|| Arc::new(BlockShadow::new(launch))),
        total: launch.blocks(),
        next: AtomicU64::new(0),
        abort: AtomicBool::new(false),
        state: Mutex::new((0, None)),
        done: Condvar::new(),
    });
    // Only the pool's threads run blocks (never the stream's own thread), so
    // fiber stacks exist for PW_EMU_THREADS workers however many streams run.
    let p = pool();
    if p.started == 0 {
        return Err(EmuError::new(
            cu::LAUNCH_OUT_OF_RESOURCES,
            format!("{}: no block worker thread could be started", launch.func.label()),
        ));
    }
    p.jobs.lock().unwrap_or_else(|e| e.into_inner()).push_back(job.clone());
    p.ready.notify_all();
    let mut s = job.state.lock().unwrap_or_else(|p| p.into_inner());
    while s.0 < job.total {
        s = job.done.wait(s).unwrap_or_else(|p| p.into_inner());
    }
    match s.1.take() {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

// ---------------------------------------------------------------------------
// One block: fibers and the collectives between them.

/// How a lane's fiber ended.
#[derive(Clone, Copy, Debug)]
enum LaneEnd {
    Returned,
    /// A fault (signal, address) trapped inside the lane; `true` when the
    /// address is the lane's own stack guard (a stack overflow).
    Fault(c_int, u64, bool),
}

type Fiber = Coroutine<(), (), LaneEnd, &'static mut DefaultStack>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Ready,
    AtBarrier,
    /// Waiting in a warp collective (index into its warp's pending list).
    InWarp,
    Exited,
    /// Stopped by an error; never resumed.
    Stopped,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Shfl,
    Vote,
    Syncwarp,
    Mma,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Shfl => "__shfl_*_sync",
            Kind::Vote => "__all/__any/__ballot_sync",
            Kind::Syncwarp => "__syncwarp",
            Kind::Mma => "mma.sync.m16n8k16",
        }
    }
}

/// What a lane brings to a warp collective.
#[derive(Clone, Copy)]
struct Arrival {
    value: u32,
    b: i32,
    width: i32,
    mode: i32,
    d: *mut f32,
    a: [u32; 4],
    bf: [u32; 2],
    c: [f32; 4],
}

const NO_ARRIVAL: Arrival = Arrival {
    value: 0,
    b: 0,
    width: 0,
    mode: 0,
    d: std::ptr::null_mut(),
    a: [0; 4],
    bf: [0; 2],
    c: [0.0; 4],
};

/// A warp collective some members have reached.
struct Pending {
    kind: Kind,
    mask: u32,
    arrived: u32,
    /// The mode of the first arrival (shfl and vote: every member must use the same).
    mode: i32,
}

struct LaneSlot {
    lane: Lane,
    state: State,
    yielder: *const Yielder<(), ()>,
    /// A collective's result for this lane, written when the collective completes.
    result: u32,
    /// What this lane brought to the warp collective it waits in.
    arrival: Arrival,
}

/// A worker's block in flight (reused from block to block).
struct Block {
    launch: *const Launch,
    block_idx: Dim3,
    lanes: Vec<LaneSlot>,
    warps: Vec<Vec<Pending>>,
    at_barrier: u32,
    exited: u32,
    error: Option<EmuError>,
    /// The block's linear index in its grid.
    linear: u64,
    /// PW_EMU_CHECK=blocks: the grid run's record of accesses.
    shadow: Option<Arc<BlockShadow>>,
    /// PW_EMU_CHECK=warp: the barrier interval (one more at each block
    /// start and each __syncthreads, never reset, so cells of earlier blocks
    /// are told apart without clearing them), where this block's began, each
    /// lane's vector clock over its warp's lanes, the shared memory's
    /// ranges (static, dynamic) and a cell per byte of them.
    epoch: u32,
    epoch_start: u32,
    clocks: Vec<[u32; 32]>,
    shared_ranges: [(u64, u64); 2],
    shared_cells: Vec<SharedCell>,
    /// The block's dynamic shared memory, 128-byte aligned as real shared
    /// memory is (kernels cast it to float4 and wider).
    dynamic_shared: Vec<SharedChunk>,
}

#[derive(Clone, Copy)]
#[repr(C, align(128))]
struct SharedChunk([u8; 128]);

struct Worker {
    stacks: Vec<DefaultStack>,
    fibers: Vec<Option<Fiber>>,
    block: Block,
    /// Per module (by handle): the calling thread's thread_local block of it
    /// (its static shared memory), found once.
    tls: Vec<(usize, *mut u8, usize)>,
}

thread_local! {
    static WORKER: Cell<*mut Worker> = const { Cell::new(std::ptr::null_mut()) };
    static BLOCK: Cell<*mut Block> = const { Cell::new(std::ptr::null_mut()) };
    static LANE: Cell<usize> = const { Cell::new(0) };
    /// The running fiber's trap handler, for the fault handler (None outside fibers).
    static TRAP: Cell<Option<CoroutineTrapHandler<LaneEnd>>> = const { Cell::new(None) };
}

fn worker() -> *mut Worker {
    WORKER.with(|w| {
        if w.get().is_null() {
            // Leaked on purpose: a worker thread keeps its stacks for its life.
            let fresh = Box::new(Worker {
                stacks: Vec::new(),
                fibers: Vec::new(),
                block: Block {
                    launch: std::ptr::null(),
                    block_idx: Dim3::default(),
                    lanes: Vec::new(),
                    warps: Vec::new(),
                    at_barrier: 0,
                    exited: 0,
                    error: None,
                    linear: 0,
                    shadow: None,
                    epoch: 0,
                    epoch_start: 0,
                    clocks: Vec::new(),
                    shared_ranges: [(0, 0); 2],
                    shared_cells: Vec::new(),
                    dynamic_shared: Vec::new(),
                },
                tls: Vec::new(),
            });
            w.set(Box::into_raw(fresh));
        }
        w.get()
    })
}

fn tid_of(l: &Lane) -> String {
    let t = l.thread_idx;
    if l.block_dim.y == 1 && l.block_dim.z == 1 {
        format!("{}", t.x)
    } else {
        format!("({}, {}, {})", t.x, t.y, t.z)
    }
}

impl Block {
    fn launch(&self) -> &Launch {
        // SAFETY: set for the block's run, the launch outlives it.
        unsafe { &*self.launch }
    }

    /// Where in the grid (the stream's label for the launch names the kernel).
    fn at(&self) -> String {
        format!("block {}", dims(self.block_idx))
    }

    fn fail(&mut self, code: u32, msg: String) {
        if self.error.is_none() {
            self.error = Some(EmuError::new(code, format!("{}: {msg}", self.at())));
        }
    }

    /// Lists lanes as threadIdx values, compressing runs of linear indices.
    fn list(&self, mut pick: impl FnMut(usize, &LaneSlot) -> bool) -> String {
        let picked: Vec<usize> =
            self.lanes.iter().enumerate().filter(|(i, l)| pick(*i, l)).map(|(i, _)| i).collect();
        if picked.is_empty() {
            return "none".into();
        }
        let one_d = self.launch().block.y == 1 && self.launch().block.z == 1;
        let mut out = String::new();
        let mut i = 0;
        let mut shown = 0;
        while i < picked.len() {
            let mut j = i;
            while j + 1 < picked.len() && picked[j + 1] == picked[j] + 1 {
                j += 1;
            }
            if !out.is_empty() {
                out.push_str(", ");
            }
            if shown == 8 {
                let _ = write!(out, "... ({} threads in all)", picked.len());
                break;
            }
            if one_d && j > i {
                let _ = write!(out, "{}..={}", picked[i], picked[j]);
            } else if j > i {
                let _ = write!(
                    out,
                    "{}..={}",
                    tid_of(&self.lanes[picked[i]].lane),
                    tid_of(&self.lanes[picked[j]].lane)
                );
            } else {
                out.push_str(&tid_of(&self.lanes[picked[i]].lane));
            }
            shown += 1;
            i = j + 1;
        }
        out
    }

    /// Where each waiting lane is, for a barrier or collective nobody can finish.
    fn whereabouts(&self) -> String {
        let mut out = format!(
            "threads waiting at __syncthreads: {}; exited: {}",
            self.list(|_, l| l.state == State::AtBarrier),
            self.list(|_, l| l.state == State::Exited)
        );
        for (w, pending) in self.warps.iter().enumerate() {
            for p in pending {
                let _ = write!(
                    out,
                    "; warp {w}: threads waiting at {} (mask {:#010x}): {}, members not arrived: {}",
                    p.kind.name(),
                    p.mask,
                    self.list(|i, _| i / 32 == w && p.arrived >> (i % 32) & 1 == 1),
                    self.list(|i, _| i / 32 == w
                        && p.mask >> (i % 32) & 1 == 1
                        && p.arrived >> (i % 32) & 1 == 0)
                );
            }
        }
        out
    }
}

/// The running block and lane (only valid inside a fiber).
fn current() -> (&'static mut Block, usize) {
    let b = BLOCK.with(Cell::get);
    assert!(!b.is_null(), "pipewright-emu: a runtime function was called outside a kernel");
    // SAFETY: set by the worker for the block it is running; the scheduler
    // does not touch the block while a fiber runs.
    (unsafe { &mut *b }, LANE.with(Cell::get))
}

/// Suspends the running fiber until the scheduler resumes it.
fn suspend(b: &Block, lane: usize) {
    let y = b.lanes[lane].yielder;
    // SAFETY: the yielder of the running fiber, set when it started.
    unsafe { (*y).suspend(()) };
}

/// Stops the running lane with an error; the fiber is never resumed.
fn stop(code: u32, msg: String) -> ! {
    let (b, lane) = current();
    b.fail(code, msg);
    b.lanes[lane].state = State::Stopped;
    loop {
        suspend(b, lane);
    }
}

extern "C" fn rt_lane() -> *const Lane {
    let (b, lane) = current();
    &b.lanes[lane].lane
}

extern "C" fn rt_syncthreads() {
    let (b, lane) = current();
    b.lanes[lane].state = State::AtBarrier;
    b.at_barrier += 1;
    let n = b.lanes.len() as u32;
    if b.at_barrier + b.exited == n {
        if b.exited > 0 {
            let msg = format!("__syncthreads (bar.sync 0) not reached by every thread: {}", b.whereabouts());
            stop(cu::LAUNCH_FAILED, msg);
        }
        for l in b.lanes.iter_mut() {
            l.state = State::Ready;
        }
        b.at_barrier = 0;
        b.epoch += 1;
        return;
    }
    suspend(b, lane);
}

fn warp_size_of(b: &Block, warp: usize) -> u32 {
    (b.lanes.len() as u32 - warp as u32 * 32).min(32)
}

/// Joins the running lane to the warp collective `kind` over `mask`; returns
/// when the collective completes, with this lane's result.
fn collective(kind: Kind, mask: u32, arrival: Arrival) -> u32 {
    let (b, lane) = current();
    let (warp, id) = (lane / 32, (lane % 32) as u32);
    let name = kind.name();
    if mask >> id & 1 == 0 {
        stop(
            cu::LAUNCH_FAILED,
            format!(
                "thread {} runs {name} with mask {mask:#010x}, which does not include its own lane {id}",
                tid_of(&b.lanes[lane].lane)
            ),
        );
    }
    let size = warp_size_of(b, warp);
    if size < 32 && mask >> size != 0 {
        stop(
            cu::LAUNCH_FAILED,
            format!(
                "thread {} runs {name} with mask {mask:#010x}, naming lanes its warp {warp} does not have (it has {size})",
                tid_of(&b.lanes[lane].lane)
            ),
        );
    }
    let mut slot = None;
    for (i, p) in b.warps[warp].iter().enumerate() {
        if p.mask & mask == 0 {
            continue;
        }
        if p.mask != mask || p.kind != kind {
            let waiting = b.list(|i, _| i / 32 == warp && p.arrived >> (i % 32) & 1 == 1);
            let msg = format!(
                "warp {warp}: thread {} reached {name} with mask {mask:#010x} while threads {waiting} wait at {} with mask {:#010x} \
                 (every lane in a mask must reach the same collective with the same mask)",
                tid_of(&b.lanes[lane].lane),
                p.kind.name(),
                p.mask
            );
            stop(cu::LAUNCH_FAILED, msg);
        }
        slot = Some(i);
    }
    let i = match slot {
        Some(i) => i,
        None => {
            b.warps[warp].push(Pending { kind, mask, arrived: 0, mode: arrival.mode });
            b.warps[warp].len() - 1
        }
    };
    let p = &mut b.warps[warp][i];
    if (kind == Kind::Shfl || kind == Kind::Vote) && arrival.mode != p.mode {
        let msg = format!(
            "warp {warp}: thread {} runs {name} in mode {} while other members use mode {}",
            tid_of(&b.lanes[lane].lane),
            arrival.mode,
            p.mode
        );
        stop(cu::LAUNCH_FAILED, msg);
    }
    p.arrived |= 1 << id;
    b.lanes[lane].arrival = arrival;
    if p.arrived != mask {
        b.lanes[lane].state = State::InWarp;
        suspend(b, lane);
        return b.lanes[lane].result;
    }
    let p = b.warps[warp].swap_remove(i);
    if let Err(msg) = complete(b, warp, &p) {
        stop(cu::LAUNCH_FAILED, format!("warp {warp}: {msg}"));
    }
    b.lanes[lane].result
}

/// Computes every member's result of a completed collective and releases them.
fn complete(b: &mut Block, warp: usize, p: &Pending) -> std::result::Result<(), String> {
    let members = (0..32u32).filter(|l| p.mask >> l & 1 == 1);
    match p.kind {
        Kind::Shfl => {
            let mut out = [0u32; 32];
            for l in members.clone() {
                let a = &b.lanes[warp * 32 + l as usize].arrival;
                let src = shfl_source(l, a.b, a.width, a.mode)
                    .map_err(|e| format!("thread {}: {e}", tid_of(&b.lanes[warp * 32 + l as usize].lane)))?;
                if p.mask >> src & 1 == 0 {
                    return Err(format!(
                        "thread {} shuffles from lane {src}, which is not in the mask {:#010x} (its value is undefined)",
                        tid_of(&b.lanes[warp * 32 + l as usize].lane),
                        p.mask
                    ));
                }
                out[l as usize] = b.lanes[warp * 32 + src as usize].arrival.value;
            }
            for l in members {
                b.lanes[warp * 32 + l as usize].result = out[l as usize];
            }
        }
        Kind::Vote => {
            let ballot = members
                .clone()
                .filter(|&l| b.lanes[warp * 32 + l as usize].arrival.value != 0)
                .fold(0u32, |m, l| m | 1 << l);
            let r = match p.mode {
                abi::VOTE_ALL => (ballot == p.mask) as u32,
                abi::VOTE_ANY => (ballot != 0) as u32,
                abi::VOTE_BALLOT => ballot,
                m => return Err(format!("vote.sync mode {m} is not all (0), any (1) or ballot (2)")),
            };
            for l in members {
                b.lanes[warp * 32 + l as usize].result = r;
            }
        }
        Kind::Syncwarp => {
            if !b.clocks.is_empty() {
                let mut joined = [0u32; 32];
                for l in members.clone() {
                    for (j, c) in joined.iter_mut().zip(&b.clocks[warp * 32 + l as usize]) {
                        *j = (*j).max(*c);
                    }
                }
                for l in members {
                    let clock = &mut b.clocks[warp * 32 + l as usize];
                    *clock = joined;
                    clock[l as usize] += 1;
                }
            }
        }
        Kind::Mma => {
            let mut d = [[0f32; 4]; 32];
            let mut arrivals = [NO_ARRIVAL; 32];
            for (l, a) in arrivals.iter_mut().enumerate() {
                *a = b.lanes[warp * 32 + l].arrival;
            }
            mma_m16n8k16(&arrivals, &mut d);
            for l in members.clone() {
                // SAFETY: the lane's own d[4], on its suspended (or running) fiber's stack.
                unsafe { std::ptr::copy_nonoverlapping(d[l as usize].as_ptr(), arrivals[l as usize].d, 4) };
            }
        }
    }
    for l in (0..32).filter(|l| p.mask >> l & 1 == 1) {
        b.lanes[warp * 32 + l].state = State::Ready;
    }
    Ok(())
}

/// The lane a shfl.sync reads from, per the PTX ISA (shfl.sync): `b` is the
/// source lane or delta, `width` CUDA's segment width (PTX's c operand is
/// ((32 - width) << 8) | clamp, clamp 0 for .up and 31 otherwise). A source
/// outside the lane's segment reads the lane's own value.
pub fn shfl_source(lane: u32, b: i32, width: i32, mode: i32) -> std::result::Result<u32, String> {
    if !(1..=32).contains(&width) || width & (width - 1) != 0 {
        return Err(format!("shuffle width {width} is not a power of two from 1 to 32"));
    }
    let lane = lane as i32;
    let segmask = !(width - 1) & 31;
    let clamp = if mode == abi::SHFL_UP { 0 } else { 31 };
    let max_lane = (lane & segmask) | (clamp & !segmask);
    let min_lane = lane & segmask;
    let (j, in_range) = match mode {
        abi::SHFL_UP => (lane - b, lane - b >= max_lane),
        abi::SHFL_DOWN => (lane + b, lane + b <= max_lane),
        abi::SHFL_BFLY => (lane ^ b, (lane ^ b) <= max_lane),
        abi::SHFL_IDX => {
            let j = min_lane | (b & !segmask & 31);
            (j, j <= max_lane)
        }
        m => return Err(format!("shuffle mode {m} is not idx (0), up (1), down (2) or bfly (3)")),
    };
    Ok(if in_range && (0..32).contains(&j) { j as u32 } else { lane as u32 })
}

fn bf16_to_f32(bits: u32) -> f32 {
    f32::from_bits((bits & 0xFFFF) << 16)
}

/// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for a whole warp,
/// with the PTX ISA's fragment layout (groupID = lane >> 2, t = lane % 4):
/// A (16×16, row-major): a0..a7 (two bf16 per register, the lower half
///   first) at row g for a0,a1,a4,a5 and g+8 for a2,a3,a6,a7, column
///   2t + (i & 1), plus 8 for a4..a7;
/// B (16×8, column-major): b0..b3 at row (k) 2t + (i & 1), plus 8 for b2,b3, column g;
/// C, D (16×8 f32): c0..c3 at row g for c0,c1 and g+8 for c2,c3, column 2t + (i & 1).
/// Each output sums its 16 products (exact in f32: bf16 × bf16 fits) and
/// its accumulator in f64 and rounds once; hardware accumulates with its own
/// internal precision and order, so the last bit may differ from a real GPU
/// (a hardware-only numeric).
fn mma_m16n8k16(lanes: &[Arrival; 32], d: &mut [[f32; 4]; 32]) {
    let mut a = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    let mut c = [[0f32; 8]; 16];
    for (l, arr) in lanes.iter().enumerate() {
        let (g, t) = (l / 4, l % 4);
        for i in 0..8 {
            let bits = arr.a[i / 2] >> (16 * (i % 2));
            let row = g + if i % 4 >= 2 { 8 } else { 0 };
            let col = 2 * t + (i & 1) + if i >= 4 { 8 } else { 0 };
            a[row][col] = bf16_to_f32(bits);
        }
        for i in 0..4 {
            let bits = arr.bf[i / 2] >> (16 * (i % 2));
            let k = 2 * t + (i & 1) + if i >= 2 { 8 } else { 0 };
            bm[k][g] = bf16_to_f32(bits);
        }
        for i in 0..4 {
            c[g + if i >= 2 { 8 } else { 0 }][2 * t + (i & 1)] = arr.c[i];
        }
    }
    for (l, out) in d.iter_mut().enumerate() {
        let (g, t) = (l / 4, l % 4);
        for (i, o) in out.iter_mut().enumerate() {
            let (row, col) = (g + if i >= 2 { 8 } else { 0 }, 2 * t + (i & 1));
            let sum: f64 =
                (0..16).map(|k| a[row][k] as f64 * bm[k][col] as f64).sum::<f64>() + c[row][col] as f64;
            *o = sum as f32;
        }
    }
}

extern "C" fn rt_syncwarp(mask: c_uint) {
    collective(Kind::Syncwarp, mask, NO_ARRIVAL);
}

extern "C" fn rt_shfl_sync(
    mask: c_uint,
    value: c_uint,
    lane_or_delta: c_int,
    width: c_int,
    mode: c_int,
) -> c_uint {
    collective(Kind::Shfl, mask, Arrival { value, b: lane_or_delta, width, mode, ..NO_ARRIVAL })
}

extern "C" fn rt_vote_sync(mask: c_uint, predicate: c_int, mode: c_int) -> c_uint {
    collective(Kind::Vote, mask, Arrival { value: (predicate != 0) as u32, mode, ..NO_ARRIVAL })
}

extern "C" fn rt_mma(d: *mut f32, a: *const c_uint, b: *const c_uint, c: *const f32) {
    let (blk, lane) = current();
    if blk.lanes.len() < (lane / 32 + 1) * 32 {
        stop(
            cu::LAUNCH_FAILED,
            format!(
                "mma.sync.aligned needs all 32 lanes of a warp; warp {} of this block has {}",
                lane / 32,
                warp_size_of(blk, lane / 32)
            ),
        );
    }
    // SAFETY: the fragments the caller passes, as the ABI defines them (a[4], b[2], c[4]).
    let arrival = unsafe {
        Arrival {
            d,
            a: std::ptr::read_unaligned(a as *const [u32; 4]),
            bf: std::ptr::read_unaligned(b as *const [u32; 2]),
            c: std::ptr::read_unaligned(c as *const [f32; 4]),
            ..NO_ARRIVAL
        }
    };
    collective(Kind::Mma, u32::MAX, arrival);
}

extern "C" fn rt_dynamic_shared() -> *mut c_void {
    let (b, _) = current();
    if b.launch().shared == 0 {
        return std::ptr::null_mut();
    }
    b.dynamic_shared.as_mut_ptr() as *mut c_void
}

extern "C" fn rt_trap(what: *const c_char) {
    let (b, lane) = current();
    let what = if what.is_null() {
        "__trap()".to_string()
    } else {
        // SAFETY: the module passes a NUL-terminated message.
        unsafe { CStr::from_ptr(what) }.to_string_lossy().into_owned()
    };
    let t = tid_of(&b.lanes[lane].lane);
    stop(cu::LAUNCH_FAILED, format!("thread {t}: device-side trap: {what}"));
}

extern "C" fn rt_misaligned(
    addr: *const c_void,
    align: c_ulong,
    size: c_ulong,
    type_: *const c_char,
    kind: c_int,
    file: *const c_char,
    line: c_uint,
) {
    let (b, lane) = current();
    // SAFETY: the module passes UBSan's NUL-terminated type name and file.
    let text = |p: *const c_char| {
        if p.is_null() {
            "?".to_string()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    // UBSan's TypeCheckKind, as its runtime words it.
    let what = match kind {
        0 => "load of",
        1 => "store to",
        2 => "reference binding to",
        3 => "member access within",
        4 => "member call on",
        5 => "constructor call on",
        6 | 7 => "downcast of",
        8 | 9 => "upcast of",
        _ => "access to",
    };
    let addr = addr as u64;
    let sized = if size > 0 { format!("{size}-byte ") } else { String::new() };
    let msg = format!(
        "thread {}: misaligned address: {sized}{what} `{}` at {addr:#x}, which needs {align}-byte alignment \
         ({} byte(s) off), at {}:{line}; {}",
        tid_of(&b.lanes[lane].lane),
        text(type_).trim_matches('\''),
        addr % align.max(1),
        text(file),
        memory::describe(addr)
    );
    stop(cu::MISALIGNED_ADDRESS, msg);
}

/// An instrumented kernel's load or store (PW_EMU_CHECK=bounds and the
/// other modes that watch every access).
extern "C" fn rt_access(addr: *const c_void, size: c_ulong, is_store: c_int) {
    let addr = addr as u64;
    let (lo, hi) = memory::device_area();
    if addr < lo || addr >= hi {
        if warp_check_enabled() {
            if BLOCK.with(Cell::get).is_null() {
                return;
            }
            let (b, lane) = current();
            if b.clocks.is_empty() {
                return;
            }
            let [(s0, n0), (s1, n1)] = b.shared_ranges;
            for at in addr..addr + size {
                let index = if at >= s0 && at < s0 + n0 {
                    (at - s0) as usize
                } else if at >= s1 && at < s1 + n1 {
                    (n0 + at - s1) as usize
                } else {
                    continue;
                };
                if let Some(msg) = record_shared(b, lane, index, at, is_store != 0) {
                    stop(cu::LAUNCH_FAILED, msg);
                }
            }
        }
        return;
    }
    let (b, lane) = current();
    if let Some(shadow) = &b.shadow {
        if let Some(msg) = shadow.record(b.launch(), b.linear, addr, size, is_store != 0) {
            let msg = format!("thread {}: {msg}", tid_of(&b.lanes[lane].lane));
            stop(cu::LAUNCH_FAILED, msg);
        }
    }
    if !bounds_check_enabled() {
        return;
    }
    let launch = b.launch();
    let end = addr + size;
    let inside = |a: &Allocation| addr >= a.base && end <= a.base + a.size;
    if launch.pointers.iter().any(|p| inside(&p.alloc)) {
        return;
    }
    // Memory reached through a pointer kept in memory, not an argument.
    if memory::find(addr).is_some_and(|a| inside(&a)) {
        return;
    }
    let verb = if is_store != 0 { "store" } else { "load" };
    let t = tid_of(&b.lanes[lane].lane);
    let mut msg = match memory::nearest(addr) {
        Some(a) if addr >= a.base => format!(
            "thread {t}: out-of-bounds {verb}: {size} byte(s) at {addr:#x} are bytes {}..{} of GPU {}'s \
             {}-byte allocation at {:#x}, {} byte(s) past its end",
            addr - a.base,
            end - a.base,
            a.device,
            a.size,
            a.base,
            end - (a.base + a.size).max(addr)
        ),
        Some(a) => format!(
            "thread {t}: out-of-bounds {verb}: {size} byte(s) at {addr:#x}, {} byte(s) before the start of \
             GPU {}'s {}-byte allocation at {:#x}",
            a.base - addr,
            a.device,
            a.size,
            a.base
        ),
        None => format!("thread {t}: out-of-bounds {verb}: {size} byte(s) at {}", memory::describe(addr)),
    };
    if let Some(a) = memory::nearest(addr) {
        let k = launch.func.kernel();
        for p in launch.pointers.iter().filter(|p| p.alloc.base == a.base) {
            let param = &k.params[p.param];
            let _ = write!(
                msg,
                "; argument `{}` ({}) = {:#x} points into that allocation",
                param.name, param.type_, p.value
            );
        }
    }
    stop(cu::ILLEGAL_ADDRESS, msg);
}

#[repr(C)]
struct TlsIndex {
    module: usize,
    offset: usize,
}

extern "C" {
    /// The x86-64 ELF TLS ABI's entry point (exported by the dynamic loader):
    /// the calling thread's address of `offset` in module `module`'s TLS
    /// block, allocating the block on the thread's first use.
    fn __tls_get_addr(index: *const TlsIndex) -> *mut c_void;
}

/// This thread's block of the module's thread_local storage (its static
/// shared memory), `len` bytes from the returned address. The module's own
/// anchor (`touch`) must lie inside it, or the module and the loader
/// disagree about where its thread_locals are.
fn tls_block(
    modid: usize,
    len: usize,
    touch: extern "C" fn() -> *mut c_void,
) -> std::result::Result<*mut u8, String> {
    // SAFETY: `modid` is the loader's id of a module that stays loaded while
    // a launch of it runs (the launch holds an Arc of the module).
    let start = unsafe { __tls_get_addr(&TlsIndex { module: modid, offset: 0 }) } as *mut u8;
    let anchor = touch() as usize;
    if start.is_null() || !(start as usize..start as usize + len).contains(&anchor) {
        return Err(format!(
            "the module's thread_local anchor {anchor:#x} is not in this thread's block of its TLS \
             (module id {modid}, {start:?}, {len} bytes)"
        ));
    }
    Ok(start)
}

fn run_block(
    launch: &Launch,
    linear: u64,
    order: LaneOrder,
    shadow: Option<&Arc<BlockShadow>>,
) -> Result<()> {
    let w = worker();
    // SAFETY: the worker is this thread's own; fibers reach the block only
    // through BLOCK while the scheduler below waits in `resume`.
    let w = unsafe { &mut *w };
    let n = launch.threads() as usize;
    while w.stacks.len() < n {
        let stack = DefaultStack::new(STACK_BYTES).map_err(|e| {
            EmuError::new(cu::OUT_OF_MEMORY, format!("{}: no fiber stack: {e}", launch.func.label()))
        })?;
        w.stacks.push(stack);
    }
    let b = &mut w.block;
    b.launch = launch;
    b.block_idx = launch.block_idx(linear);
    b.linear = linear;
    b.shadow = shadow.cloned();
    b.at_barrier = 0;
    b.exited = 0;
    b.error = None;
    b.warps.resize_with(n.div_ceil(32), Vec::new);
    for p in b.warps.iter_mut() {
        p.clear();
    }
    b.lanes.clear();
    let (bx, by) = (launch.block.x as usize, launch.block.y as usize);
    for i in 0..n {
        b.lanes.push(LaneSlot {
            lane: Lane {
                thread_idx: Dim3 { x: (i % bx) as u32, y: (i / bx % by) as u32, z: (i / (bx * by)) as u32 },
                block_idx: b.block_idx,
                block_dim: launch.block,
                grid_dim: launch.grid,
            },
            state: State::Ready,
            yielder: std::ptr::null(),
            result: 0,
            arrival: NO_ARRIVAL,
        });
    }
    b.shared_ranges = [(0, 0); 2];
    // Poisoned shared memory: a read before a write shows (SHARED_POISON).
    if launch.shared > 0 {
        b.dynamic_shared.clear();
        b.dynamic_shared.resize((launch.shared as usize).div_ceil(128), SharedChunk([SHARED_POISON; 128]));
    }
    if let (Some(touch), Some((modid, len))) = (launch.func.module.touch_shared, launch.func.module.tls) {
        let handle = launch.func.module.handle;
        let p = match w.tls.iter().find(|(m, _, _)| *m == handle) {
            Some(&(_, p, _)) => p,
            None => {
                let p = tls_block(modid, len, touch).map_err(|why| {
                    EmuError::new(cu::LAUNCH_FAILED, format!("{}: {why}", launch.func.label()))
                })?;
                w.tls.push((handle, p, len));
                p
            }
        };
        if len + launch.shared as usize > crate::module::SHARED_OPTIN_MAX as usize {
            return Err(EmuError::new(
                cu::LAUNCH_OUT_OF_RESOURCES,
                format!(
                    "{len} bytes of static shared memory (the module's thread_locals) and {} of dynamic exceed \
                     the device's {} bytes per block",
                    launch.shared,
                    crate::module::SHARED_OPTIN_MAX
                ),
            ));
        }
        // SAFETY: this thread's thread_local block of the module, `len` bytes.
        unsafe { std::ptr::write_bytes(p, SHARED_POISON, len) };
        b.shared_ranges[0] = (p as u64, len as u64);
    }
    if launch.shared > 0 {
        b.shared_ranges[1] = (b.dynamic_shared.as_ptr() as u64, launch.shared as u64);
    }
    b.epoch += 1;
    b.epoch_start = b.epoch;
    b.clocks.clear();
    if warp_check_enabled() {
        b.clocks.extend((0..n).map(|l| {
            let mut c = [0u32; 32];
            c[l % 32] = 1;
            c
        }));
        let bytes = (b.shared_ranges[0].1 + b.shared_ranges[1].1) as usize;
        if b.shared_cells.len() < bytes {
            b.shared_cells.resize(bytes, SharedCell::default());
        }
    }
    let block_ptr: *mut Block = b;
    BLOCK.with(|c| c.set(block_ptr));
    let args = launch.args.as_ptr() as *mut *mut c_void;
    let entry = launch.func.kernel().entry;
    w.fibers.clear();
    for (i, stack) in w.stacks.iter_mut().take(n).enumerate() {
        // SAFETY: the stack lives in the worker for the thread's life and is
        // used by this fiber only; the fiber ends (or is reset) before the
        // next block reuses it.
        let stack: &'static mut DefaultStack = unsafe { &mut *(stack as *mut DefaultStack) };
        let slot: *mut LaneSlot = &mut w.block.lanes[i];
        let fiber = unsafe {
            Fiber::with_stack_unchecked(stack, move |y: &Yielder<(), ()>, ()| {
                (*slot).yielder = y;
                entry(args);
                LaneEnd::Returned
            })
        };
        w.fibers.push(Some(fiber));
    }
    let result = schedule(w, n, order);
    for f in w.fibers.iter_mut() {
        if let Some(mut f) = f.take() {
            if !f.done() {
                // SAFETY: the lane was stopped inside a runtime call or a
                // fault; nothing on its stack needs dropping (kernel frames
                // are C, ours hold no owned values across a suspend).
                unsafe { f.force_reset() };
            }
        }
    }
    BLOCK.with(|c| c.set(std::ptr::null_mut()));
    w.block.shadow = None;
    result
}

fn schedule(w: &mut Worker, n: usize, order: LaneOrder) -> Result<()> {
    let block: *mut Block = &mut w.block;
    loop {
        let mut ran = false;
        for k in 0..n {
            let i = if order == LaneOrder::Ascending { k } else { n - 1 - k };
            // SAFETY: no fiber runs while the scheduler reads the block.
            if unsafe { (&(*block).lanes)[i].state } != State::Ready {
                continue;
            }
            ran = true;
            let fiber = w.fibers[i].as_mut().expect("a fiber per lane");
            LANE.with(|c| c.set(i));
            TRAP.with(|c| c.set(Some(fiber.trap_handler())));
            let r = fiber.resume(());
            TRAP.with(|c| c.set(None));
            // SAFETY: the fiber is suspended or done.
            let b = unsafe { &mut *block };
            match r {
                CoroutineResult::Yield(()) => {}
                CoroutineResult::Return(LaneEnd::Returned) => {
                    b.lanes[i].state = State::Exited;
                    b.exited += 1;
                    if b.at_barrier > 0 {
                        let msg = format!(
                            "__syncthreads (bar.sync 0) not reached by every thread: thread {} exited while others wait; {}",
                            tid_of(&b.lanes[i].lane),
                            b.whereabouts()
                        );
                        b.fail(cu::LAUNCH_FAILED, msg);
                    } else if let Some(p) = b.warps[i / 32].iter().find(|p| p.mask >> (i % 32) & 1 == 1) {
                        let msg = format!(
                            "warp {}: thread {} exited while lanes of mask {:#010x} wait for it at {}",
                            i / 32,
                            tid_of(&b.lanes[i].lane),
                            p.mask,
                            p.kind.name()
                        );
                        b.fail(cu::LAUNCH_FAILED, msg);
                    }
                }
                CoroutineResult::Return(LaneEnd::Fault(_, _, true)) => {
                    b.lanes[i].state = State::Stopped;
                    let msg = format!(
                        "thread {}: stack overflow (each thread has {} KiB of stack: deep recursion or large local arrays)",
                        tid_of(&b.lanes[i].lane),
                        STACK_BYTES >> 10
                    );
                    b.fail(cu::LAUNCH_OUT_OF_RESOURCES, msg);
                }
                CoroutineResult::Return(LaneEnd::Fault(sig, addr, false)) => {
                    b.lanes[i].state = State::Stopped;
                    let msg = fault_message(b, i, sig, addr);
                    b.fail(cu::ILLEGAL_ADDRESS, msg);
                }
            }
            if b.error.is_some() {
                return Err(b.error.take().expect("checked"));
            }
        }
        // SAFETY: as above.
        let b = unsafe { &mut *block };
        if b.exited as usize == n {
            return Ok(());
        }
        if !ran {
            return Err(EmuError::new(
                cu::LAUNCH_FAILED,
                format!("{}: threads wait for each other forever: {}", b.at(), b.whereabouts()),
            ));
        }
    }
}

fn fault_message(b: &Block, lane: usize, sig: c_int, addr: u64) -> String {
    let launch = b.launch();
    let what = if sig == libc::SIGBUS { "bus error" } else { "illegal address" };
    let mut msg = format!("thread {}: {what} at {}", tid_of(&b.lanes[lane].lane), memory::describe(addr));
    let k = launch.func.kernel();
    let near = launch.pointers.iter().filter(|p| {
        let a = p.alloc;
        addr + memory::ALIGN >= a.base && addr < a.base + a.size + 8192
    });
    for p in near {
        let param = &k.params[p.param];
        let _ = write!(
            msg,
            "; argument `{}` ({}) = {:#x} points into that allocation",
            param.name, param.type_, p.value
        );
    }
    msg
}

// ---------------------------------------------------------------------------
// Faults inside kernels.

static PREVIOUS: OnceLock<[libc::sigaction; 2]> = OnceLock::new();

fn give_alternate_signal_stack() {
    const BYTES: usize = 64 << 10;
    // SAFETY: queries, then installs a leaked buffer for this thread's life.
    unsafe {
        let mut current: libc::stack_t = std::mem::zeroed();
        if libc::sigaltstack(std::ptr::null(), &mut current) == 0 && current.ss_flags & libc::SS_DISABLE == 0
        {
            return;
        }
        let stack = Box::leak(vec![0u8; BYTES].into_boxed_slice());
        let alt = libc::stack_t { ss_sp: stack.as_mut_ptr() as *mut c_void, ss_flags: 0, ss_size: BYTES };
        libc::sigaltstack(&alt, std::ptr::null_mut());
    }
}

fn install_fault_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: sigaction with a zeroed (then filled) struct; the previous
        // handlers are kept to chain to for faults outside kernels.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_fault as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
            libc::sigemptyset(&mut act.sa_mask);
            let mut prev: [libc::sigaction; 2] = std::mem::zeroed();
            libc::sigaction(libc::SIGSEGV, &act, &mut prev[0]);
            libc::sigaction(libc::SIGBUS, &act, &mut prev[1]);
            let _ = PREVIOUS.set(prev);
        }
    });
}

unsafe extern "C" fn on_fault(sig: c_int, info: *mut libc::siginfo_t, uctx: *mut c_void) {
    let uc = uctx as *mut libc::ucontext_t;
    let trap = TRAP.with(Cell::get);
    if let Some(trap) = trap {
        let gregs = &mut (*uc).uc_mcontext.gregs;
        let sp = gregs[libc::REG_RSP as usize] as usize;
        if trap.stack_ptr_in_bounds(sp) {
            let addr = (*info).si_addr() as u64;
            let overflow = trap.stack_ptr_in_bounds(addr as usize);
            let regs = trap.setup_trap_handler(move || LaneEnd::Fault(sig, addr, overflow));
            gregs[libc::REG_RIP as usize] = regs.rip as i64;
            gregs[libc::REG_RSP as usize] = regs.rsp as i64;
            gregs[libc::REG_RBP as usize] = regs.rbp as i64;
            gregs[libc::REG_RDI as usize] = regs.rdi as i64;
            gregs[libc::REG_RSI as usize] = regs.rsi as i64;
            return;
        }
    }
    // Not a kernel's fault: whoever handled it before us does, or the
    // default action (the fault repeats on return and kills the process).
    let Some(prev) = PREVIOUS.get() else { return };
    let prev = &prev[if sig == libc::SIGBUS { 1 } else { 0 }];
    let h = prev.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        libc::sigaction(sig, prev, std::ptr::null_mut());
    } else if prev.sa_flags & libc::SA_SIGINFO != 0 {
        let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = std::mem::transmute(h);
        f(sig, info, uctx);
    } else {
        let f: extern "C" fn(c_int) = std::mem::transmute(h);
        f(sig);
    }
}
