//! What the driver and execution tests share: an emulated machine of two
//! GPUs, a context and stream per test, modules made of Rust kernel bodies
//! (the NVRTC stand-in's job in real use), launches through cuLaunchKernel.
#![allow(dead_code)]

use pipewright_emu::abi::{Lane, Runtime};
pub use pipewright_emu::driver::Handle;
use pipewright_emu::driver::*;
use pipewright_emu::error::cu;
use pipewright_emu::exec::RUNTIME;
use pipewright_emu::module::{self, KernelInfo, ParamInfo};
use std::ffi::{c_void, CStr, CString};
use std::sync::{Mutex, MutexGuard, Once};

pub type Entry = extern "C" fn(args: *mut *mut c_void);

/// The runtime table kernels call, as a module gets it.
pub fn rt() -> &'static Runtime {
    &RUNTIME
}

pub fn lane() -> &'static Lane {
    // SAFETY: valid while the running lane's kernel runs.
    unsafe { &*(rt().lane)() }
}

/// The running lane's linear thread index in its block.
pub fn tid() -> usize {
    let l = lane();
    (l.thread_idx.x + l.thread_idx.y * l.block_dim.x + l.thread_idx.z * l.block_dim.x * l.block_dim.y)
        as usize
}

/// The running lane's global index along x.
pub fn gid() -> usize {
    let l = lane();
    (l.block_idx.x * l.block_dim.x + l.thread_idx.x) as usize
}

/// Parameter `i` of a kernel, read as `T`.
///
/// # Safety
/// `args` must be the kernel's args and parameter `i` a `T`.
pub unsafe fn arg<T: Copy>(args: *mut *mut c_void, i: usize) -> T {
    *(*args.add(i) as *const T)
}

/// Tests of one binary run one at a time: the latest message per error code
/// is process-wide, and each test reads back its own.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Read once per process by the emulator, before its first call.
        std::env::set_var("PW_EMU_GPUS", "2");
        std::env::set_var("PW_EMU_THREADS", "2");
        // SAFETY: the driver's entry point.
        assert_eq!(unsafe { cuInit(0) }, cu::SUCCESS);
    });
}

/// A fresh context on one GPU (a test's failure stays its own: a context's
/// sticky error is every later call's), bound to the calling thread, and a
/// non-blocking stream.
pub struct Gpu {
    pub ordinal: i32,
    pub ctx: Handle,
    pub stream: Handle,
}

impl Gpu {
    pub fn new(ordinal: i32) -> Gpu {
        init();
        let mut ctx: Handle = std::ptr::null_mut();
        let mut stream: Handle = std::ptr::null_mut();
        // SAFETY: the driver's entry points with valid out-pointers.
        unsafe {
            assert_eq!(cuCtxCreate_v2(&mut ctx, 0, ordinal), cu::SUCCESS);
            assert_eq!(cuCtxSetCurrent(ctx), cu::SUCCESS);
            assert_eq!(cuStreamCreate(&mut stream, 1), cu::SUCCESS);
        }
        Gpu { ordinal, ctx, stream }
    }

    pub fn bind(&self) {
        // SAFETY: our live context.
        assert_eq!(unsafe { cuCtxSetCurrent(self.ctx) }, cu::SUCCESS);
    }

    pub fn alloc(&self, bytes: usize) -> u64 {
        self.bind();
        let mut p = 0u64;
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { cuMemAlloc_v2(&mut p, bytes) }, cu::SUCCESS);
        p
    }

    pub fn upload<T: Copy>(&self, dst: u64, host: &[T]) {
        self.bind();
        // SAFETY: `host` is readable for its size.
        let r = unsafe {
            cuMemcpyHtoDAsync_v2(
                dst,
                host.as_ptr() as *const c_void,
                std::mem::size_of_val(host),
                self.stream,
            )
        };
        assert_eq!(r, cu::SUCCESS);
    }

    pub fn download<T: Copy + Default>(&self, src: u64, len: usize) -> Vec<T> {
        self.bind();
        let mut out = vec![T::default(); len];
        // SAFETY: `out` is writable for its size.
        let r = unsafe {
            cuMemcpyDtoHAsync_v2(
                out.as_mut_ptr() as *mut c_void,
                src,
                len * std::mem::size_of::<T>(),
                self.stream,
            )
        };
        assert_eq!(r, cu::SUCCESS, "download: {}", error_text(r));
        out
    }

    pub fn sync(&self) -> u32 {
        // SAFETY: our live stream.
        unsafe { cuStreamSynchronize(self.stream) }
    }
}

/// A parameter description: (name, C type, is a pointer).
pub type P = (&'static str, &'static str, bool);

pub fn kernel(name: &str, entry: Entry, launch_bounds: u32, params: &[P]) -> KernelInfo {
    KernelInfo {
        name: name.to_string(),
        entry,
        launch_bounds,
        params: params
            .iter()
            .map(|&(n, t, ptr)| ParamInfo {
                name: n.into(),
                type_: t.into(),
                size: if ptr { 8 } else { 4 },
                align: if ptr { 8 } else { 4 },
                is_pointer: ptr,
                pointee_is_const: t.starts_with("const"),
            })
            .collect(),
    }
}

/// A function from a module made of one Rust kernel.
pub fn function(source: &str, k: KernelInfo) -> Handle {
    let name = CString::new(k.name.clone()).unwrap();
    let m = module::from_kernels(source, vec![k]);
    let mut f: Handle = std::ptr::null_mut();
    // SAFETY: a loaded module and a valid name.
    assert_eq!(unsafe { cuModuleGetFunction(&mut f, m as Handle, name.as_ptr()) }, cu::SUCCESS);
    f
}

/// Launches `f` with arguments given as pointers to their values.
pub fn launch(
    f: Handle,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared: u32,
    s: Handle,
    args: &mut [*mut c_void],
) -> u32 {
    let params = if args.is_empty() { std::ptr::null_mut() } else { args.as_mut_ptr() };
    // SAFETY: the arguments match the kernel's parameters.
    unsafe {
        cuLaunchKernel(
            f,
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            shared,
            s,
            params,
            std::ptr::null_mut(),
        )
    }
}

/// cuGetErrorString's text for `code` (the latest detailed message).
pub fn error_text(code: u32) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: a valid out-pointer; the string lives for the process.
    unsafe {
        cuGetErrorString(code, &mut p);
        if p.is_null() {
            return String::new();
        }
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// Asserts `code` is `want` and the latest message for it mentions every
/// one of `needles`; returns the message.
#[track_caller]
pub fn assert_error(code: u32, want: u32, needles: &[&str]) -> String {
    let text = error_text(code);
    assert_eq!(code, want, "expected code {want}, got {code}: {text}");
    for n in needles {
        assert!(text.contains(n), "the message does not name {n:?}: {text}");
    }
    text
}

/// A pointer to a value, as kernelParams holds it.
pub fn p<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}
