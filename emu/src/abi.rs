//! The Rust side of include/pw_emu_abi.h (read that file first): the
//! contract between the emulator and a kernel module. Field for field the
//! same; `abi_layout_matches_the_header` in tests/ holds them together.

use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void};

pub const ABI_VERSION: c_uint = 2;
pub const MODULE_INIT: &str = "pw_emu_module_init";

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dim3 {
    pub x: c_uint,
    pub y: c_uint,
    pub z: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Lane {
    pub thread_idx: Dim3,
    pub block_idx: Dim3,
    pub block_dim: Dim3,
    pub grid_dim: Dim3,
}

pub const SHFL_IDX: c_int = 0;
pub const SHFL_UP: c_int = 1;
pub const SHFL_DOWN: c_int = 2;
pub const SHFL_BFLY: c_int = 3;

pub const VOTE_ALL: c_int = 0;
pub const VOTE_ANY: c_int = 1;
pub const VOTE_BALLOT: c_int = 2;

#[repr(C)]
pub struct Runtime {
    pub abi_version: c_uint,
    pub lane: extern "C" fn() -> *const Lane,
    pub syncthreads: extern "C" fn(),
    pub syncwarp: extern "C" fn(mask: c_uint),
    pub shfl_sync:
        extern "C" fn(mask: c_uint, value: c_uint, lane_or_delta: c_int, width: c_int, mode: c_int) -> c_uint,
    pub vote_sync: extern "C" fn(mask: c_uint, predicate: c_int, mode: c_int) -> c_uint,
    pub mma_m16n8k16_f32_bf16: extern "C" fn(d: *mut f32, a: *const c_uint, b: *const c_uint, c: *const f32),
    pub dynamic_shared: extern "C" fn() -> *mut c_void,
    pub trap: extern "C" fn(what: *const c_char),
    pub misaligned: extern "C" fn(
        addr: *const c_void,
        align: c_ulong,
        size: c_ulong,
        type_: *const c_char,
        kind: c_int,
        file: *const c_char,
        line: c_uint,
    ),
    pub access: extern "C" fn(addr: *const c_void, size: c_ulong, is_store: c_int),
}

#[repr(C)]
pub struct Param {
    pub name: *const c_char,
    pub type_: *const c_char,
    pub size: usize,
    pub align: usize,
    pub is_pointer: c_int,
    pub pointee_is_const: c_int,
}

#[repr(C)]
pub struct Kernel {
    pub name: *const c_char,
    pub entry: extern "C" fn(args: *mut *mut c_void),
    pub launch_bounds: c_uint,
    pub num_params: c_uint,
    pub params: *const Param,
}

#[repr(C)]
pub struct ModuleInfo {
    pub abi_version: c_uint,
    pub source_name: *const c_char,
    pub arch: *const c_char,
    pub num_kernels: c_uint,
    pub kernels: *const Kernel,
    pub touch_shared: extern "C" fn() -> *mut c_void,
    pub instrumented: c_uint,
}

pub type ModuleInitFn = unsafe extern "C" fn(rt: *const Runtime) -> *const ModuleInfo;
