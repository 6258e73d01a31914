//! libcuda's entry points, with the C signatures and versioned names cudarc
//! binds (it resolves each lazily and panics on a missing one, so every
//! function reachable from pipewright's backend is here). Entry points for
//! what the emulator does not do return CUDA_ERROR_NOT_SUPPORTED with a
//! reported message, never a silent success.
//!
//! Copies and memsets go through the stream queues like launches. Pageable
//! host memory behaves as the driver documents for it: an async host→device
//! copy reads the host bytes before returning, an async device→host copy
//! returns once the bytes have landed.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use crate::context;
use crate::error::{self, cu, EmuError, Lib, Result};
use crate::exec::{self, Launch};
use crate::memory;
use crate::module;
use crate::stream;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub type CUresult = u32;
pub type CUdevice = c_int;
pub type Handle = *mut c_void;

/// The CUDA version this driver reports (13.0).
pub const DRIVER_VERSION: c_int = 13000;

/// CUDA_ERROR_FILE_NOT_FOUND (not among error::cu's codes).
pub const FILE_NOT_FOUND: u32 = 301;

static INITIALIZED: AtomicBool = AtomicBool::new(false);

fn ret(r: Result<()>) -> CUresult {
    match r {
        Ok(()) => cu::SUCCESS,
        // Not an error: a poll's answer; printing it would flood stderr.
        Err(e) if e.code == cu::NOT_READY => e.code,
        Err(e) => error::report(Lib::Driver, &e),
    }
}

fn need_init(call: &str) -> Result<()> {
    if INITIALIZED.load(Ordering::Acquire) {
        return Ok(());
    }
    Err(EmuError::new(cu::NOT_INITIALIZED, format!("{call}: cuInit has not been called")))
}

/// Writes `value` through an out-pointer, refusing null.
unsafe fn out<T>(p: *mut T, value: T, call: &str, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(EmuError::new(cu::INVALID_VALUE, format!("{call}: the {what} out-pointer is null")));
    }
    p.write(value);
    Ok(())
}

fn device_arg(dev: CUdevice, call: &str) -> Result<usize> {
    need_init(call)?;
    let d = usize::try_from(dev)
        .map_err(|_| EmuError::new(cu::INVALID_DEVICE, format!("{call}: device {dev} is negative")))?;
    memory::check_device(d, call)?;
    Ok(d)
}

fn unsupported(call: &str, why: &str) -> CUresult {
    ret(Err(EmuError::new(cu::NOT_SUPPORTED, format!("{call}: not supported by the emulated GPU ({why})"))))
}

/// Which kind of handle `h` is, for an error about a handle of the wrong kind.
pub fn what_handle(h: usize) -> String {
    if h == 0 {
        return "null".into();
    }
    if stream::is_stream(h) {
        return "it is a stream".into();
    }
    if stream::is_event(h) {
        return "it is an event".into();
    }
    if module::is_module(h) {
        return "it is a module".into();
    }
    if module::is_function(h) {
        return "it is a function".into();
    }
    if context::is_context(h) {
        return "it is a context".into();
    }
    "unknown or destroyed".into()
}

// ---------------------------------------------------------------------------
// Initialization, devices

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    ret((|| {
        if flags != 0 {
            return Err(EmuError::new(cu::INVALID_VALUE, format!("cuInit: flags must be 0, got {flags}")));
        }
        memory::machine()?;
        INITIALIZED.store(true, Ordering::Release);
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    ret(out(version, DRIVER_VERSION, "cuDriverGetVersion", "version"))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    ret((|| {
        need_init("cuDeviceGetCount")?;
        out(count, memory::device_count()? as c_int, "cuDeviceGetCount", "count")
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    ret((|| {
        let d = device_arg(ordinal, "cuDeviceGet")?;
        out(device, d as CUdevice, "cuDeviceGet", "device")
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    ret((|| {
        let d = device_arg(dev, "cuDeviceGetName")?;
        if name.is_null() || len <= 0 {
            return Err(EmuError::new(
                cu::INVALID_VALUE,
                format!("cuDeviceGetName: buffer {name:?} of {len} bytes"),
            ));
        }
        // The emulated ordinal: a GPU keeps its name whatever CUDA_VISIBLE_DEVICES calls it.
        let text = format!("pipewright emulated GPU {} (sm_90)", memory::device_identity(d).1);
        // Truncated to the buffer, always NUL-terminated, as the driver does.
        let n = text.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(text.as_ptr(), name as *mut u8, n);
        *name.add(n) = 0;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    ret((|| {
        let d = device_arg(dev, "cuDeviceTotalMem")?;
        out(bytes, memory::total(d)? as usize, "cuDeviceTotalMem", "bytes")
    })())
}

/// A UUID that names the emulated GPU and the emulator session.
unsafe fn uuid(out_: *mut [u8; 16], dev: CUdevice, call: &str) -> Result<()> {
    let d = device_arg(dev, call)?;
    let (session, ordinal) = memory::device_identity(d);
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(b"pw-emu\0\0");
    bytes[8] = ordinal as u8;
    // FNV-1a of the session name: two sessions' GPUs differ.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in session.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    bytes[9..16].copy_from_slice(&h.to_le_bytes()[..7]);
    out(out_, bytes, call, "uuid")
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(out_: *mut [u8; 16], dev: CUdevice) -> CUresult {
    ret(uuid(out_, dev, "cuDeviceGetUuid"))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(out_: *mut [u8; 16], dev: CUdevice) -> CUresult {
    ret(uuid(out_, dev, "cuDeviceGetUuid_v2"))
}

/// An sm_90 (H100 SXM-like) device's answer to each attribute the emulator knows.
pub fn attribute(attrib: c_int, device: usize) -> Option<c_int> {
    Some(match attrib {
        1 => exec::MAX_THREADS_PER_BLOCK as c_int,
        2..=4 => exec::MAX_BLOCK_DIM[(attrib - 2) as usize] as c_int,
        5..=7 => exec::MAX_GRID_DIM[(attrib - 5) as usize] as c_int,
        8 => module::SHARED_DEFAULT as c_int,
        9 => 64 << 10,
        10 => 32,
        12 => 65536,
        13 => 1_980_000,
        15 => 1,
        16 => 132,
        17 | 18 | 19 | 32 | 35 | 83 | 95 | 115 => 0,
        20 => 0,
        31 => 1,
        33 => device as c_int,
        34 | 50 => 0,
        36 => 2_619_000,
        37 => 5120,
        38 => 50 << 20,
        39 => 2048,
        40 => 2,
        41 => 1,
        75 => 9,
        76 => 0,
        81 => 228 << 10,
        82 => 65536,
        97 => module::SHARED_OPTIN_MAX as c_int,
        106 => 32,
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attrib: c_int, dev: CUdevice) -> CUresult {
    ret((|| {
        let d = device_arg(dev, "cuDeviceGetAttribute")?;
        let v = attribute(attrib, d).ok_or_else(|| {
            EmuError::new(
                cu::INVALID_VALUE,
                format!("cuDeviceGetAttribute: attribute {attrib} is not emulated"),
            )
        })?;
        out(value, v, "cuDeviceGetAttribute", "value")
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: CUdevice, peer: CUdevice) -> CUresult {
    ret((|| {
        device_arg(dev, "cuDeviceCanAccessPeer")?;
        device_arg(peer, "cuDeviceCanAccessPeer")?;
        // Every emulated GPU's memory is this process's memory.
        out(can, (dev != peer) as c_int, "cuDeviceCanAccessPeer", "result")
    })())
}

// ---------------------------------------------------------------------------
// Contexts

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut Handle, dev: CUdevice) -> CUresult {
    ret((|| {
        let d = device_arg(dev, "cuDevicePrimaryCtxRetain")?;
        let ctx = context::retain_primary(d)?;
        out(pctx, ctx.handle as Handle, "cuDevicePrimaryCtxRetain", "context")
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    ret((|| context::release_primary(device_arg(dev, "cuDevicePrimaryCtxRelease")?))())
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    cuDevicePrimaryCtxRelease_v2(dev)
}

unsafe fn ctx_create(pctx: *mut Handle, flags: c_uint, dev: CUdevice, call: &str) -> Result<()> {
    let d = device_arg(dev, call)?;
    // Scheduling flags (SCHED_*, 0..=7) only say how the host waits; the
    // emulator always blocks, which every one of them allows.
    if flags & !7 != 0 {
        return Err(EmuError::new(
            cu::NOT_SUPPORTED,
            format!("{call}: context flags {flags:#x} are not emulated"),
        ));
    }
    let ctx = context::create(d)?;
    out(pctx, ctx.handle as Handle, call, "context")?;
    context::push_current(ctx.handle)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut Handle, flags: c_uint, dev: CUdevice) -> CUresult {
    ret(ctx_create(pctx, flags, dev, "cuCtxCreate"))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut Handle,
    params: *mut c_void,
    num_params: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    if !params.is_null() && num_params != 0 {
        return unsupported("cuCtxCreate_v3", "execution affinity parameters");
    }
    ret(ctx_create(pctx, flags, dev, "cuCtxCreate_v3"))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut Handle,
    params: *mut c_void,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    if !params.is_null() {
        return unsupported("cuCtxCreate_v4", "context creation parameters");
    }
    ret(ctx_create(pctx, flags, dev, "cuCtxCreate_v4"))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> CUresult {
    ret(context::destroy(ctx as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    ret(context::set_current(ctx as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut Handle) -> CUresult {
    ret(out(pctx, context::current_handle() as Handle, "cuCtxGetCurrent", "context"))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: Handle) -> CUresult {
    ret(context::push_current(ctx as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut Handle) -> CUresult {
    ret((|| {
        let h = context::pop_current()?;
        if !pctx.is_null() {
            *pctx = h as Handle;
        }
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    ret((|| out(device, context::current("cuCtxGetDevice")?.device as CUdevice, "cuCtxGetDevice", "device"))(
    ))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    ret((|| stream::synchronize_context(&context::current("cuCtxSynchronize")?))())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetFlags(flags: c_uint) -> CUresult {
    ret((|| {
        context::current("cuCtxSetFlags")?;
        if flags & !7 != 0 {
            return Err(EmuError::new(
                cu::NOT_SUPPORTED,
                format!("cuCtxSetFlags: flags {flags:#x} are not emulated"),
            ));
        }
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) -> CUresult {
    // One priority: the emulator runs streams side by side without preference.
    ret((|| {
        context::current("cuCtxGetStreamPriorityRange")?;
        if !least.is_null() {
            *least = 0;
        }
        if !greatest.is_null() {
            *greatest = 0;
        }
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetLimit(_value: *mut usize, _limit: c_int) -> CUresult {
    unsupported("cuCtxGetLimit", "context limits")
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetLimit(_limit: c_int, _value: usize) -> CUresult {
    unsupported("cuCtxSetLimit", "context limits")
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: Handle, flags: c_uint) -> CUresult {
    ret((|| {
        context::current("cuCtxEnablePeerAccess")?;
        context::get(peer as usize, "cuCtxEnablePeerAccess")?;
        if flags != 0 {
            return Err(EmuError::new(
                cu::INVALID_VALUE,
                format!("cuCtxEnablePeerAccess: flags must be 0, got {flags}"),
            ));
        }
        Ok(())
    })())
}

// ---------------------------------------------------------------------------
// Streams and events

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(pstream: *mut Handle, flags: c_uint) -> CUresult {
    ret((|| out(pstream, stream::create(flags)? as Handle, "cuStreamCreate", "stream"))())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    pstream: *mut Handle,
    flags: c_uint,
    priority: c_int,
) -> CUresult {
    if priority != 0 {
        return ret(Err(EmuError::new(
            cu::INVALID_VALUE,
            format!("cuStreamCreateWithPriority: priority {priority} (the emulated GPU has one priority, 0)"),
        )));
    }
    cuStreamCreate(pstream, flags)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: Handle) -> CUresult {
    ret(stream::destroy(s as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(s: Handle) -> CUresult {
    ret(stream::synchronize(s as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(s: Handle) -> CUresult {
    ret(stream::query(s as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(s: Handle, event: Handle, flags: c_uint) -> CUresult {
    if flags != 0 {
        return ret(Err(EmuError::new(
            cu::INVALID_VALUE,
            format!("cuStreamWaitEvent: flags {flags:#x} (only CU_EVENT_WAIT_DEFAULT is emulated)"),
        )));
    }
    ret(stream::wait_event(s as usize, event as usize))
}

pub type HostFn = Option<unsafe extern "C" fn(user: *mut c_void)>;

#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc(s: Handle, f: HostFn, user: *mut c_void) -> CUresult {
    ret((|| {
        let f =
            f.ok_or_else(|| EmuError::new(cu::INVALID_VALUE, "cuLaunchHostFunc: the function is null"))?;
        let user = user as usize;
        stream::enqueue(
            s as usize,
            "cuLaunchHostFunc".into(),
            Box::new(move || {
                f(user as *mut c_void);
                Ok(())
            }),
        )
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(pevent: *mut Handle, flags: c_uint) -> CUresult {
    ret((|| out(pevent, stream::event_create(flags)? as Handle, "cuEventCreate", "event"))())
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(event: Handle, s: Handle) -> CUresult {
    ret(stream::event_record(event as usize, s as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(event: Handle) -> CUresult {
    ret(stream::event_synchronize(event as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(event: Handle) -> CUresult {
    ret(stream::event_query(event as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(event: Handle) -> CUresult {
    ret(stream::event_destroy(event as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    ret(
        (|| out(ms, stream::elapsed_ms(start as usize, end as usize)?, "cuEventElapsedTime", "milliseconds"))(
        ),
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    cuEventElapsedTime(ms, start, end)
}

// ---------------------------------------------------------------------------
// Memory

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> CUresult {
    ret((|| {
        let ctx = context::current("cuMemAlloc")?;
        ctx.check("cuMemAlloc")?;
        if dptr.is_null() {
            return Err(EmuError::new(cu::INVALID_VALUE, "cuMemAlloc: the pointer out-pointer is null"));
        }
        *dptr = memory::alloc(ctx.device, bytes as u64)?;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: u64) -> CUresult {
    ret((|| {
        context::current("cuMemFree")?;
        if dptr == 0 {
            return Ok(());
        }
        // As cudaFree: work already queued that may use the memory finishes first.
        if let Some(a) = memory::find(dptr) {
            for ctx in context::all().into_iter().filter(|c| c.device == a.device) {
                let _ = stream::synchronize_context(&ctx);
            }
        }
        stream::race::forget(dptr);
        memory::free(dptr).map(|_| ())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    ret((|| {
        let ctx = context::current("cuMemGetInfo")?;
        let (f, t) = memory::info(ctx.device)?;
        out(free, f as usize, "cuMemGetInfo", "free")?;
        out(total, t as usize, "cuMemGetInfo", "total")
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(_dptr: *mut u64, _bytes: usize, _s: Handle) -> CUresult {
    unsupported("cuMemAllocAsync", "memory pools; CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0")
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(_dptr: u64, _s: Handle) -> CUresult {
    unsupported("cuMemFreeAsync", "memory pools; CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0")
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(_p: *mut *mut c_void, _bytes: usize, _flags: c_uint) -> CUresult {
    unsupported("cuMemHostAlloc", "pinned host memory")
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(_p: *mut c_void) -> CUresult {
    unsupported("cuMemFreeHost", "pinned host memory")
}

/// A device range of a copy or memset, checked before it is queued.
fn device_range(ptr: u64, bytes: u64, call: &str, what: &str) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let a = memory::find(ptr).ok_or_else(|| {
        EmuError::new(
            cu::INVALID_VALUE,
            format!("{call}: {what} is {}, not device memory", memory::describe(ptr)),
        )
    })?;
    memory::check_range(ptr, bytes, a.device, &format!("{call}: {what}"))
        .map_err(|e| EmuError::new(cu::INVALID_VALUE, e.message))?;
    Ok(())
}

fn host_range(ptr: *const c_void, bytes: usize, call: &str, what: &str) -> Result<()> {
    if bytes > 0 && ptr.is_null() {
        return Err(EmuError::new(cu::INVALID_VALUE, format!("{call}: {what} is null")));
    }
    if let Some(a) = memory::find(ptr as u64) {
        return Err(EmuError::new(
            cu::INVALID_VALUE,
            format!("{call}: {what} {ptr:?} is GPU {}'s memory, expected host memory", a.device),
        ));
    }
    Ok(())
}

unsafe fn memset(
    dst: u64,
    value: u32,
    elem: usize,
    count: usize,
    s: Handle,
    call: &str,
    wait: bool,
) -> Result<()> {
    let bytes = (count * elem) as u64;
    if !dst.is_multiple_of(elem as u64) {
        return Err(EmuError::new(cu::INVALID_VALUE, format!("{call}: {dst:#x} is not {elem}-byte aligned")));
    }
    device_range(dst, bytes, call, "destination")?;
    let work: stream::Work = Box::new(move || {
        // SAFETY: checked to lie in a live allocation; frees wait for queued work.
        unsafe {
            if elem == 1 {
                std::ptr::write_bytes(dst as *mut u8, value as u8, count);
            } else {
                std::slice::from_raw_parts_mut(dst as *mut u32, count).fill(value);
            }
        }
        Ok(())
    });
    queue(s, format!("{call}({dst:#x}, {count})"), work, wait, call, vec![(dst, true, "destination".into())])
}

/// Queues `work`; with `wait`, returns once it has run (the synchronous
/// calls, and copies into pageable host memory).
fn queue(
    s: Handle,
    label: String,
    work: stream::Work,
    wait: bool,
    call: &str,
    touches: Touches,
) -> Result<()> {
    let st = stream::resolve(s as usize, call)?;
    st.ctx.check(call)?;
    let touches =
        touches.into_iter().filter_map(|(p, w, what)| Some((memory::find(p)?.base, w, what))).collect();
    if !wait {
        return stream::enqueue_tracked(s as usize, label, work, touches);
    }
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    stream::enqueue_tracked(
        s as usize,
        label,
        Box::new(move || {
            let r = work();
            let _ = tx.send(());
            r
        }),
        touches,
    )?;
    // Dropped unsent when the stream skips the work after an earlier failure.
    let _ = rx.recv();
    // The host has seen the stream up to this copy.
    stream::host_saw(&st);
    st.ctx.check(call)
}

/// Device memory an operation touches: (pointer, written, what), for PW_EMU_CHECK=race.
type Touches = Vec<(u64, bool, String)>;

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(dst: u64, value: u8, count: usize, s: Handle) -> CUresult {
    ret(memset(dst, value as u32, 1, count, s, "cuMemsetD8Async", false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: u64, value: u8, count: usize) -> CUresult {
    ret(memset(dst, value as u32, 1, count, std::ptr::null_mut(), "cuMemsetD8", true))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(dst: u64, value: c_uint, count: usize, s: Handle) -> CUresult {
    ret(memset(dst, value, 4, count, s, "cuMemsetD32Async", false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: u64, value: c_uint, count: usize) -> CUresult {
    ret(memset(dst, value, 4, count, std::ptr::null_mut(), "cuMemsetD32", true))
}

unsafe fn htod(dst: u64, src: *const c_void, bytes: usize, s: Handle, call: &str, wait: bool) -> Result<()> {
    context::current(call)?;
    device_range(dst, bytes as u64, call, "destination")?;
    host_range(src, bytes, call, "source")?;
    // Pageable host memory: the bytes are staged before the call returns,
    // so the caller may reuse its buffer at once (as the driver documents).
    let staged = std::slice::from_raw_parts(src as *const u8, bytes).to_vec();
    let work: stream::Work = Box::new(move || {
        // SAFETY: a checked live device range; frees wait for queued work.
        unsafe { std::ptr::copy_nonoverlapping(staged.as_ptr(), dst as *mut u8, staged.len()) };
        Ok(())
    });
    queue(
        s,
        format!("{call}({dst:#x}, {bytes} bytes)"),
        work,
        wait,
        call,
        vec![(dst, true, "destination".into())],
    )
}

unsafe fn dtoh(dst: *mut c_void, src: u64, bytes: usize, s: Handle, call: &str) -> Result<()> {
    context::current(call)?;
    device_range(src, bytes as u64, call, "source")?;
    host_range(dst, bytes, call, "destination")?;
    let dst = dst as usize;
    let work: stream::Work = Box::new(move || {
        // SAFETY: a checked live device range, and the caller's host buffer,
        // which it keeps until this call returns (after the copy).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    });
    // Pageable host memory: returns once the copy has landed.
    queue(
        s,
        format!("{call}({src:#x}, {bytes} bytes)"),
        work,
        true,
        call,
        vec![(src, false, "source".into())],
    )
}

unsafe fn dtod(dst: u64, src: u64, bytes: usize, s: Handle, call: &str, wait: bool) -> Result<()> {
    context::current(call)?;
    device_range(dst, bytes as u64, call, "destination")?;
    device_range(src, bytes as u64, call, "source")?;
    let work: stream::Work = Box::new(move || {
        // SAFETY: checked live device ranges; `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    });
    let touches = vec![(src, false, "source".into()), (dst, true, "destination".into())];
    queue(s, format!("{call}({dst:#x} <- {src:#x}, {bytes} bytes)"), work, wait, call, touches)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    bytes: usize,
    s: Handle,
) -> CUresult {
    ret(htod(dst, src, bytes, s, "cuMemcpyHtoDAsync", false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, bytes: usize) -> CUresult {
    ret(htod(dst, src, bytes, std::ptr::null_mut(), "cuMemcpyHtoD", true))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    bytes: usize,
    s: Handle,
) -> CUresult {
    ret(dtoh(dst, src, bytes, s, "cuMemcpyDtoHAsync"))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, bytes: usize) -> CUresult {
    ret(dtoh(dst, src, bytes, std::ptr::null_mut(), "cuMemcpyDtoH"))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, bytes: usize, s: Handle) -> CUresult {
    ret(dtod(dst, src, bytes, s, "cuMemcpyDtoDAsync", false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, bytes: usize) -> CUresult {
    ret(dtod(dst, src, bytes, std::ptr::null_mut(), "cuMemcpyDtoD", true))
}

// cuMemcpyPeerAsync's own parameters, plus the caller's name and whether to wait.
#[allow(clippy::too_many_arguments)]
unsafe fn peer(
    dst: u64,
    dst_ctx: Handle,
    src: u64,
    src_ctx: Handle,
    bytes: usize,
    s: Handle,
    call: &str,
    wait: bool,
) -> Result<()> {
    let (dc, sc) = (context::get(dst_ctx as usize, call)?, context::get(src_ctx as usize, call)?);
    for (p, ctx, what) in [(dst, &dc, "destination"), (src, &sc, "source")] {
        if bytes > 0 {
            memory::check_range(p, bytes as u64, ctx.device, &format!("{call}: {what}"))
                .map_err(|e| EmuError::new(cu::INVALID_VALUE, e.message))?;
        }
    }
    dtod(dst, src, bytes, s, call, wait)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: u64,
    dst_ctx: Handle,
    src: u64,
    src_ctx: Handle,
    bytes: usize,
    s: Handle,
) -> CUresult {
    ret(peer(dst, dst_ctx, src, src_ctx, bytes, s, "cuMemcpyPeerAsync", false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeer(
    dst: u64,
    dst_ctx: Handle,
    src: u64,
    src_ctx: Handle,
    bytes: usize,
) -> CUresult {
    ret(peer(dst, dst_ctx, src, src_ctx, bytes, std::ptr::null_mut(), "cuMemcpyPeer", true))
}

// ---------------------------------------------------------------------------
// Modules, functions, launches

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(pmodule: *mut Handle, image: *const c_void) -> CUresult {
    ret((|| {
        let ctx = context::current("cuModuleLoadData")?;
        let m = module::load_data(image, ctx.handle)?;
        out(pmodule, m as Handle, "cuModuleLoadData", "module")
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoad(pmodule: *mut Handle, fname: *const c_char) -> CUresult {
    ret((|| {
        let ctx = context::current("cuModuleLoad")?;
        if fname.is_null() {
            return Err(EmuError::new(cu::INVALID_VALUE, "cuModuleLoad: the file name is null"));
        }
        let path = CStr::from_ptr(fname).to_string_lossy().into_owned();
        let bytes = std::fs::read(&path)
            .map_err(|e| EmuError::new(FILE_NOT_FOUND, format!("cuModuleLoad: {path}: {e}")))?;
        // A trailing NUL so a text image (PTX) is read as a C string.
        let mut bytes = bytes;
        bytes.extend_from_slice(&[0; 64]);
        let m = module::load_data(bytes.as_ptr() as *const c_void, ctx.handle)?;
        out(pmodule, m as Handle, "cuModuleLoad", "module")
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(m: Handle) -> CUresult {
    ret(module::unload(m as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(pfunc: *mut Handle, m: Handle, name: *const c_char) -> CUresult {
    ret((|| {
        if name.is_null() {
            return Err(EmuError::new(cu::INVALID_VALUE, "cuModuleGetFunction: the name is null"));
        }
        let name = CStr::from_ptr(name).to_string_lossy();
        let f = module::get_function(m as usize, &name)?;
        out(pfunc, f as Handle, "cuModuleGetFunction", "function")
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetGlobal_v2(
    _dptr: *mut u64,
    _bytes: *mut usize,
    _m: Handle,
    _name: *const c_char,
) -> CUresult {
    unsupported("cuModuleGetGlobal", "module globals (__device__ variables) live in the module's host memory")
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(value: *mut c_int, attrib: c_int, f: Handle) -> CUresult {
    ret((|| {
        let func = module::function(f as usize, "cuFuncGetAttribute")?;
        let k = func.kernel();
        let v = match attrib {
            0 => (if k.launch_bounds != 0 { k.launch_bounds } else { exec::MAX_THREADS_PER_BLOCK }) as c_int,
            5 | 6 => 90,
            8 => func.max_dynamic_shared() as c_int,
            _ => {
                return Err(EmuError::new(
                    cu::NOT_SUPPORTED,
                    format!("cuFuncGetAttribute: attribute {attrib} of {} is not emulated", func.label()),
                ))
            }
        };
        out(value, v, "cuFuncGetAttribute", "value")
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncSetAttribute(f: Handle, attrib: c_int, value: c_int) -> CUresult {
    ret((|| {
        let func = module::function(f as usize, "cuFuncSetAttribute")?;
        if attrib != 8 {
            return Err(EmuError::new(
                cu::NOT_SUPPORTED,
                format!("cuFuncSetAttribute: attribute {attrib} of {} is not emulated", func.label()),
            ));
        }
        if value < 0 || value as u32 > module::SHARED_OPTIN_MAX {
            return Err(EmuError::new(
                cu::INVALID_VALUE,
                format!(
                    "cuFuncSetAttribute: {}: MAX_DYNAMIC_SHARED_SIZE_BYTES {value} is past the device's opt-in maximum of {}",
                    func.label(),
                    module::SHARED_OPTIN_MAX
                ),
            ));
        }
        func.max_dynamic_shared.store(value as u32, Ordering::Relaxed);
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncSetCacheConfig(f: Handle, _config: c_int) -> CUresult {
    // A preference the driver may ignore, as this one does.
    ret(module::function(f as usize, "cuFuncSetCacheConfig").map(|_| ()))
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared: c_uint,
    s: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    ret((|| {
        let ctx = context::current("cuLaunchKernel")?;
        ctx.check("cuLaunchKernel")?;
        let func = module::function(f as usize, "cuLaunchKernel")?;
        if func.module.ctx != ctx.handle {
            // A module is loaded into one context, and its functions are
            // that context's resources: elsewhere the driver refuses the
            // handle (CUDA_ERROR_INVALID_HANDLE, "invalid resource handle").
            let loaded = match context::get(func.module.ctx, "cuLaunchKernel") {
                Ok(c) => format!("context {:#x} (GPU {})", c.handle, c.device),
                Err(_) => format!("context {:#x}", func.module.ctx),
            };
            return Err(EmuError::new(
                cu::INVALID_HANDLE,
                format!(
                    "cuLaunchKernel: {} (function {:#x}) was loaded in {loaded}, launched in context {:#x} (GPU {}); \
                     load the module in each context that launches it",
                    func.label(),
                    f as usize,
                    ctx.handle,
                    ctx.device
                ),
            ));
        }
        let st = stream::resolve(s as usize, "cuLaunchKernel")?;
        if st.ctx.handle != ctx.handle {
            return Err(EmuError::new(
                cu::INVALID_HANDLE,
                format!(
                    "cuLaunchKernel: {}: stream {:#x} belongs to another context (GPU {})",
                    func.label(),
                    s as usize,
                    st.ctx.device
                ),
            ));
        }
        let grid = crate::abi::Dim3 { x: grid_x, y: grid_y, z: grid_z };
        let block = crate::abi::Dim3 { x: block_x, y: block_y, z: block_z };
        let launch = Arc::new(Launch::new(func.clone(), grid, block, shared, ctx.device, params, extra)?);
        let label = format!(
            "{} grid ({grid_x}, {grid_y}, {grid_z}) block ({block_x}, {block_y}, {block_z})",
            func.label()
        );
        let k = func.kernel();
        let touches = launch
            .pointers
            .iter()
            .map(|p| {
                let param = &k.params[p.param];
                (
                    p.alloc.base,
                    !param.pointee_is_const,
                    format!("argument `{}` ({})", param.name, param.type_),
                )
            })
            .collect();
        stream::enqueue_tracked(s as usize, label, Box::new(move || exec::run(&launch)), touches)
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernelEx(
    _config: *const c_void,
    _f: Handle,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    unsupported("cuLaunchKernelEx", "launch attributes (clusters, ...); use cuLaunchKernel")
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchCooperativeKernel(
    _f: Handle,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _s: Handle,
    _params: *mut *mut c_void,
) -> CUresult {
    unsupported("cuLaunchCooperativeKernel", "grid-wide synchronization")
}

// ---------------------------------------------------------------------------
// Errors

/// cuda.h's name and standard description of each code the emulator returns.
pub fn code_text(code: u32) -> Option<(&'static str, &'static str)> {
    Some(match code {
        cu::SUCCESS => ("CUDA_SUCCESS", "no error"),
        cu::INVALID_VALUE => ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
        cu::OUT_OF_MEMORY => ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
        cu::NOT_INITIALIZED => ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
        cu::INVALID_DEVICE => ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
        cu::INVALID_IMAGE => ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
        cu::INVALID_CONTEXT => ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
        cu::NO_BINARY_FOR_GPU => {
            ("CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device")
        }
        FILE_NOT_FOUND => ("CUDA_ERROR_FILE_NOT_FOUND", "file not found"),
        cu::INVALID_HANDLE => ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
        cu::NOT_FOUND => ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
        cu::NOT_READY => ("CUDA_ERROR_NOT_READY", "device not ready"),
        cu::ILLEGAL_ADDRESS => ("CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"),
        cu::LAUNCH_OUT_OF_RESOURCES => {
            ("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch")
        }
        cu::LAUNCH_TIMEOUT => ("CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"),
        cu::ILLEGAL_INSTRUCTION => {
            ("CUDA_ERROR_ILLEGAL_INSTRUCTION", "an illegal instruction was encountered")
        }
        cu::MISALIGNED_ADDRESS => ("CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"),
        cu::INVALID_PC => ("CUDA_ERROR_INVALID_PC", "invalid program counter"),
        cu::LAUNCH_FAILED => ("CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
        cu::NOT_PERMITTED => ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
        cu::NOT_SUPPORTED => ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
        cu::UNKNOWN => ("CUDA_ERROR_UNKNOWN", "unknown error"),
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: u32, pstr: *mut *const c_char) -> CUresult {
    if pstr.is_null() {
        return cu::INVALID_VALUE;
    }
    if let Some(latest) = error::latest_message(Lib::Driver, code) {
        *pstr = latest;
        return cu::SUCCESS;
    }
    match code_text(code) {
        Some((_, text)) => {
            *pstr = leak(text);
            cu::SUCCESS
        }
        None => {
            *pstr = std::ptr::null();
            cu::INVALID_VALUE
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: u32, pstr: *mut *const c_char) -> CUresult {
    if pstr.is_null() {
        return cu::INVALID_VALUE;
    }
    match code_text(code) {
        Some((name, _)) => {
            *pstr = leak(name);
            cu::SUCCESS
        }
        None => {
            *pstr = std::ptr::null();
            cu::INVALID_VALUE
        }
    }
}

/// A 'static C string for a 'static str (interned: each text leaks once).
fn leak(text: &'static str) -> *const c_char {
    static TEXTS: std::sync::Mutex<Vec<(&'static str, &'static CStr)>> = std::sync::Mutex::new(Vec::new());
    let mut texts = TEXTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, c)) = texts.iter().find(|(t, _)| *t == text) {
        return c.as_ptr();
    }
    let c: &'static CStr =
        Box::leak(std::ffi::CString::new(text).expect("no NUL in cuda.h texts").into_boxed_c_str());
    texts.push((text, c));
    c.as_ptr()
}
