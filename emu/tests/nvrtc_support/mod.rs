//! Shared by the nvrtc_* tests: the NVRTC entry points called as Rust
//! functions, loading an image the way the driver's cuModuleLoadData will
//! (dlopen, pw_emu_module_init), and a runtime table of test functions that
//! records what a kernel asks of it.
#![allow(dead_code)]

use pipewright_emu::abi;
use pipewright_emu::nvrtc::*;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

/// Builds go to a cache private to this target directory, so a rerun of
/// the tests is quick and no user's cache is touched.
pub fn setup() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| std::env::set_var("PW_EMU_CACHE", cache()));
}

pub fn cache() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("pw-emu-nvrtc-cache")
}

pub struct Compiled {
    pub code: NvrtcResult,
    pub log: String,
    pub image: Option<Vec<u8>>,
}

/// Creates, compiles, reads back and destroys a program.
pub fn compile(name: &str, source: &str, headers: &[(&str, &str)], options: &[&str]) -> Compiled {
    setup();
    let src = CString::new(source).unwrap();
    let name = CString::new(name).unwrap();
    let contents: Vec<CString> = headers.iter().map(|h| CString::new(h.1).unwrap()).collect();
    let names: Vec<CString> = headers.iter().map(|h| CString::new(h.0).unwrap()).collect();
    let contents_p: Vec<*const c_char> = contents.iter().map(|c| c.as_ptr()).collect();
    let names_p: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let opts: Vec<CString> = options.iter().map(|o| CString::new(*o).unwrap()).collect();
    let opts_p: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: NvrtcProgram = std::ptr::null_mut();
    unsafe {
        let created = nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            headers.len() as c_int,
            contents_p.as_ptr(),
            names_p.as_ptr(),
        );
        assert_eq!(created, NVRTC_SUCCESS);
        let code = nvrtcCompileProgram(prog, opts_p.len() as c_int, opts_p.as_ptr());
        let mut size = 0usize;
        assert_eq!(nvrtcGetProgramLogSize(prog, &mut size), NVRTC_SUCCESS);
        let mut log = vec![0u8; size];
        assert_eq!(nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char), NVRTC_SUCCESS);
        let log = CStr::from_bytes_with_nul(&log)
            .expect("the log ends in its only NUL")
            .to_string_lossy()
            .into_owned();
        let image = (code == NVRTC_SUCCESS).then(|| {
            let mut size = 0usize;
            assert_eq!(nvrtcGetCUBINSize(prog, &mut size), NVRTC_SUCCESS);
            let mut image = vec![0u8; size];
            assert_eq!(nvrtcGetCUBIN(prog, image.as_mut_ptr() as *mut c_char), NVRTC_SUCCESS);
            image
        });
        assert_eq!(nvrtcDestroyProgram(&mut prog), NVRTC_SUCCESS);
        assert!(prog.is_null());
        Compiled { code, log, image }
    }
}

/// Every file of kernels/ whose name ends with `ext` (".cu", ".cuh"), sorted:
/// read from the folder, so a new kernel file is checked without a list to edit.
pub fn kernel_files(ext: &str) -> Vec<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("kernels");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(ext))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no {ext} file in {}", dir.display());
    files
}

/// The source of kernels/`file` (the repository's, unmodified).
pub fn kernel_source(file: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("kernels").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A loaded module: its table, valid while the process lives (never unloaded).
pub struct Module {
    pub info: &'static abi::ModuleInfo,
}

/// dlopens `image` from a temporary file and calls pw_emu_module_init with the test runtime.
pub fn load(image: &[u8]) -> Module {
    let file = tempfile::Builder::new().suffix(".so").tempfile().unwrap();
    std::fs::write(file.path(), image).unwrap();
    let path = CString::new(file.path().to_str().unwrap()).unwrap();
    unsafe {
        let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        assert!(!handle.is_null(), "dlopen: {:?}", CStr::from_ptr(libc::dlerror()));
        let init = libc::dlsym(handle, c"pw_emu_module_init".as_ptr());
        assert!(!init.is_null(), "the image exports no pw_emu_module_init");
        let init: abi::ModuleInitFn = std::mem::transmute(init);
        let info = init(&RUNTIME);
        assert!(!info.is_null(), "pw_emu_module_init refused the test runtime");
        Module { info: &*info }
    }
}

pub struct KernelView {
    pub name: String,
    pub launch_bounds: u32,
    /// (name, type, size, align, is_pointer, pointee_is_const)
    pub params: Vec<(String, String, usize, usize, bool, bool)>,
    pub entry: extern "C" fn(*mut *mut c_void),
}

fn c(s: *const c_char) -> String {
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

impl Module {
    pub fn source_name(&self) -> String {
        c(self.info.source_name)
    }

    pub fn arch(&self) -> String {
        c(self.info.arch)
    }

    pub fn kernels(&self) -> Vec<KernelView> {
        let ks = unsafe { std::slice::from_raw_parts(self.info.kernels, self.info.num_kernels as usize) };
        ks.iter()
            .map(|k| {
                let ps = if k.num_params == 0 {
                    &[][..]
                } else {
                    unsafe { std::slice::from_raw_parts(k.params, k.num_params as usize) }
                };
                KernelView {
                    name: c(k.name),
                    launch_bounds: k.launch_bounds,
                    params: ps
                        .iter()
                        .map(|p| {
                            (
                                c(p.name),
                                c(p.type_),
                                p.size,
                                p.align,
                                p.is_pointer != 0,
                                p.pointee_is_const != 0,
                            )
                        })
                        .collect(),
                    entry: k.entry,
                }
            })
            .collect()
    }

    pub fn kernel(&self, name: &str) -> KernelView {
        self.kernels().into_iter().find(|k| k.name == name).unwrap_or_else(|| panic!("no kernel {name}"))
    }
}

/// What the test runtime was asked to do, on this thread.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calls {
    /// (a, b, c) of each mma, in call order.
    pub mma: Vec<([u32; 4], [u32; 2], [f32; 4])>,
    pub syncthreads: usize,
    /// (mask, value, lane_or_delta, width, mode) of each shfl_sync.
    pub shfl: Vec<(u32, u32, i32, i32, i32)>,
    /// (mask, predicate, mode) of each vote_sync.
    pub votes: Vec<(u32, i32, i32)>,
    pub syncwarp: Vec<u32>,
}

thread_local! {
    pub static CALLS: RefCell<Calls> = RefCell::new(Calls::default());
}

thread_local! {
    /// The lane lane() reports: thread 0 of block 0 of a one-thread grid
    /// unless a test sets another.
    static LANE: std::cell::Cell<abi::Lane> = const {
        std::cell::Cell::new(abi::Lane {
            thread_idx: abi::Dim3 { x: 0, y: 0, z: 0 },
            block_idx: abi::Dim3 { x: 0, y: 0, z: 0 },
            block_dim: abi::Dim3 { x: 1, y: 1, z: 1 },
            grid_dim: abi::Dim3 { x: 1, y: 1, z: 1 },
        })
    };
}

pub fn set_lane(lane: abi::Lane) {
    LANE.with(|l| l.set(lane));
}

/// The mma's result in the test runtime: d[i] = 2·c[i] + i + 1, so a test
/// sees which accumulator and which result slot went where.
pub fn test_mma_result(c: [f32; 4]) -> [f32; 4] {
    [2.0 * c[0] + 1.0, 2.0 * c[1] + 2.0, 2.0 * c[2] + 3.0, 2.0 * c[3] + 4.0]
}

extern "C" fn lane() -> *const abi::Lane {
    LANE.with(|l| l.as_ptr() as *const abi::Lane)
}

extern "C" fn syncthreads() {
    CALLS.with(|c| c.borrow_mut().syncthreads += 1);
}

extern "C" fn syncwarp(mask: c_uint) {
    CALLS.with(|c| c.borrow_mut().syncwarp.push(mask));
}

/// Every shuffle reads the value plus one, so a test sees each word go through.
extern "C" fn shfl_sync(mask: c_uint, value: c_uint, lane: c_int, width: c_int, mode: c_int) -> c_uint {
    CALLS.with(|c| c.borrow_mut().shfl.push((mask, value, lane, width, mode)));
    value.wrapping_add(1)
}

/// One lane: all, any and the ballot's bit 0 are the lane's own predicate.
extern "C" fn vote_sync(mask: c_uint, predicate: c_int, mode: c_int) -> c_uint {
    CALLS.with(|c| c.borrow_mut().votes.push((mask, predicate, mode)));
    (predicate != 0) as c_uint
}

extern "C" fn mma(d: *mut f32, a: *const c_uint, b: *const c_uint, c: *const f32) {
    unsafe {
        let a: [u32; 4] = std::ptr::read(a as *const [u32; 4]);
        let b: [u32; 2] = std::ptr::read(b as *const [u32; 2]);
        let c: [f32; 4] = std::ptr::read(c as *const [f32; 4]);
        CALLS.with(|calls| calls.borrow_mut().mma.push((a, b, c)));
        std::ptr::write(d as *mut [f32; 4], test_mma_result(c));
    }
}

thread_local! {
    /// The one block's dynamic shared memory (extern __shared__), 64 floats.
    pub static DYNAMIC_SHARED: RefCell<[f32; 64]> = const { RefCell::new([0.0; 64]) };
}

extern "C" fn dynamic_shared() -> *mut c_void {
    DYNAMIC_SHARED.with(|d| d.as_ptr() as *mut c_void)
}

extern "C" fn trap(what: *const c_char) {
    eprintln!("test runtime: trap: {}", c(what));
    std::process::abort();
}

extern "C" fn misaligned(
    addr: *const c_void,
    align: std::ffi::c_ulong,
    _size: std::ffi::c_ulong,
    type_: *const c_char,
    _kind: c_int,
    file: *const c_char,
    line: c_uint,
) {
    eprintln!("test runtime: misaligned {} at {addr:?} (align {align}) at {}:{line}", c(type_), c(file));
    std::process::abort();
}

extern "C" fn access(_addr: *const c_void, _size: std::ffi::c_ulong, _is_store: c_int) {}

pub static RUNTIME: abi::Runtime = abi::Runtime {
    abi_version: abi::ABI_VERSION,
    lane,
    syncthreads,
    syncwarp,
    shfl_sync,
    vote_sync,
    mma_m16n8k16_f32_bf16: mma,
    dynamic_shared,
    trap,
    misaligned,
    access,
};
