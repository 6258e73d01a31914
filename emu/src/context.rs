//! Contexts and the calling thread's current one (this interface is what
//! cublaslt and nccl use and must keep its signatures).
//!
//! A context belongs to one device and holds the sticky error: the first
//! asynchronous failure (a kernel's violation, a fault) of any of its
//! streams, which every later synchronizing call returns, as on real
//! hardware. Handles are opaque numbers in a range of their own
//! (`CTX_TAG`), so a stream or event handle passed as a context is named
//! as such instead of being dereferenced.

use crate::error::{cu, EmuError, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub const CTX_TAG: usize = 0xC0_0000_0000;

pub struct Context {
    pub handle: usize,
    pub device: usize,
    pub primary: bool,
    sticky: Mutex<Option<EmuError>>,
}

impl Context {
    /// Keeps `e` as the sticky error unless one is already kept (the first
    /// failure is the one that explains the rest).
    pub fn fail(&self, e: EmuError) {
        let mut sticky = self.sticky.lock().unwrap_or_else(|p| p.into_inner());
        if sticky.is_none() {
            *sticky = Some(e);
        }
    }

    /// The sticky error, if a failure has happened on this context.
    pub fn sticky(&self) -> Option<EmuError> {
        self.sticky.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// `Err(sticky error)` when there is one, re-worded for `call`.
    pub fn check(&self, call: &str) -> Result<()> {
        match self.sticky() {
            None => Ok(()),
            Some(e) => Err(EmuError::new(
                e.code,
                format!("{call}: the context of GPU {} failed earlier: {}", self.device, e.message),
            )),
        }
    }
}

struct Registry {
    contexts: HashMap<usize, Arc<Context>>,
    /// Per device: the primary context and its retain count.
    primary: HashMap<usize, (usize, usize)>,
    next: usize,
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Registry { contexts: HashMap::new(), primary: HashMap::new(), next: 1 }))
}

fn lock() -> std::sync::MutexGuard<'static, Registry> {
    registry().lock().unwrap_or_else(|p| p.into_inner())
}

thread_local! {
    /// The calling thread's context stack; the top is the current context.
    static CURRENT: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// A new (non-primary) context on `device` (cuCtxCreate).
pub fn create(device: usize) -> Result<Arc<Context>> {
    crate::memory::check_device(device, "cuCtxCreate")?;
    let mut r = lock();
    let handle = CTX_TAG + r.next;
    r.next += 1;
    let ctx = Arc::new(Context { handle, device, primary: false, sticky: Mutex::new(None) });
    r.contexts.insert(handle, ctx.clone());
    Ok(ctx)
}

/// The device's primary context, made on the first retain (cuDevicePrimaryCtxRetain).
pub fn retain_primary(device: usize) -> Result<Arc<Context>> {
    crate::memory::check_device(device, "cuDevicePrimaryCtxRetain")?;
    let mut r = lock();
    if let Some((handle, count)) = r.primary.get_mut(&device) {
        *count += 1;
        let handle = *handle;
        return Ok(r.contexts[&handle].clone());
    }
    let handle = CTX_TAG + r.next;
    r.next += 1;
    let ctx = Arc::new(Context { handle, device, primary: true, sticky: Mutex::new(None) });
    r.contexts.insert(handle, ctx.clone());
    r.primary.insert(device, (handle, 1));
    Ok(ctx)
}

/// Drops one retain of the device's primary context. The context itself
/// stays (its handle stays valid, as the driver keeps a released primary
/// context's handle for a later retain).
pub fn release_primary(device: usize) -> Result<()> {
    crate::memory::check_device(device, "cuDevicePrimaryCtxRelease")?;
    let mut r = lock();
    match r.primary.get_mut(&device) {
        Some((_, count)) if *count > 0 => {
            *count -= 1;
            Ok(())
        }
        _ => Err(EmuError::new(
            cu::INVALID_CONTEXT,
            format!("cuDevicePrimaryCtxRelease: GPU {device}'s primary context is not retained"),
        )),
    }
}

/// Destroys a non-primary context (cuCtxDestroy): it is unbound from the
/// calling thread; its handle is invalid from now on.
pub fn destroy(handle: usize) -> Result<()> {
    let ctx = get(handle, "cuCtxDestroy")?;
    if ctx.primary {
        return Err(EmuError::new(
            cu::INVALID_CONTEXT,
            format!("cuCtxDestroy: {handle:#x} is GPU {}'s primary context (release it instead)", ctx.device),
        ));
    }
    // Destroying a failed context is how a program recovers: its sticky
    // error does not stop it.
    let _ = crate::stream::synchronize_context(&ctx);
    crate::stream::retire_context(&ctx);
    crate::module::unload_context(handle, ctx.device);
    lock().contexts.remove(&handle);
    CURRENT.with(|c| c.borrow_mut().retain(|&h| h != handle));
    Ok(())
}

/// The context of a handle; `call` names the caller in the error.
pub fn get(handle: usize, call: &str) -> Result<Arc<Context>> {
    let found = lock().contexts.get(&handle).cloned();
    if let Some(ctx) = found {
        return Ok(ctx);
    }
    Err(EmuError::new(
        cu::INVALID_CONTEXT,
        format!("{call}: {handle:#x} is not a context handle ({})", crate::driver::what_handle(handle)),
    ))
}

/// Makes `handle` (0: none) the calling thread's current context (cuCtxSetCurrent).
pub fn set_current(handle: usize) -> Result<()> {
    if handle != 0 {
        get(handle, "cuCtxSetCurrent")?;
    }
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        c.pop();
        if handle != 0 {
            c.push(handle);
        }
    });
    Ok(())
}

pub fn push_current(handle: usize) -> Result<()> {
    get(handle, "cuCtxPushCurrent")?;
    CURRENT.with(|c| c.borrow_mut().push(handle));
    Ok(())
}

pub fn pop_current() -> Result<usize> {
    CURRENT.with(|c| c.borrow_mut().pop()).ok_or_else(|| {
        EmuError::new(cu::INVALID_CONTEXT, "cuCtxPopCurrent: no context is bound to this thread")
    })
}

/// The calling thread's current context handle, 0 when none.
pub fn current_handle() -> usize {
    CURRENT.with(|c| c.borrow().last().copied().unwrap_or(0))
}

/// The context bound to the calling thread; `call` names the caller in the error.
pub fn current(call: &str) -> Result<Arc<Context>> {
    let handle = current_handle();
    if handle == 0 {
        return Err(EmuError::new(
            cu::INVALID_CONTEXT,
            format!("{call}: no context is bound to this thread (cuCtxSetCurrent or cuDevicePrimaryCtxRetain first)"),
        ));
    }
    get(handle, call)
}

/// The device of the context bound to the calling thread.
pub fn current_device() -> Result<usize> {
    Ok(current("current device")?.device)
}

pub fn is_context(h: usize) -> bool {
    lock().contexts.contains_key(&h)
}

/// Every context of `device` (a failure of a device is every context's).
pub fn all() -> Vec<Arc<Context>> {
    lock().contexts.values().cloned().collect()
}
