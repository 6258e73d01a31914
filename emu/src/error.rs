//! Errors: a CUresult-style code for the caller and a message naming the
//! culprit (kernel, block, thread, argument, rank...) for the person.
//!
//! Every stand-in returns its library's error codes, never a silent success
//! for something it does not implement. The message is printed once to
//! stderr (prefixed `pipewright-emu:`) where the error is found, and kept so
//! that the library's error-string function (cuGetErrorString,
//! nvrtcGetErrorString, ...) hands the latest message for that code back to
//! the caller, who then prints it in its own error.

use std::sync::Mutex;

/// CUDA driver codes the emulator uses (cuda.h's CUresult values).
pub mod cu {
    pub const SUCCESS: u32 = 0;
    pub const INVALID_VALUE: u32 = 1;
    pub const OUT_OF_MEMORY: u32 = 2;
    pub const NOT_INITIALIZED: u32 = 3;
    pub const INVALID_DEVICE: u32 = 101;
    pub const INVALID_IMAGE: u32 = 200;
    pub const INVALID_CONTEXT: u32 = 201;
    pub const NO_BINARY_FOR_GPU: u32 = 209;
    pub const INVALID_HANDLE: u32 = 400;
    pub const NOT_FOUND: u32 = 500;
    pub const NOT_READY: u32 = 600;
    pub const ILLEGAL_ADDRESS: u32 = 700;
    pub const LAUNCH_OUT_OF_RESOURCES: u32 = 701;
    pub const LAUNCH_TIMEOUT: u32 = 702;
    pub const ILLEGAL_INSTRUCTION: u32 = 715;
    pub const MISALIGNED_ADDRESS: u32 = 716;
    pub const INVALID_PC: u32 = 718;
    pub const LAUNCH_FAILED: u32 = 719;
    pub const NOT_PERMITTED: u32 = 800;
    pub const NOT_SUPPORTED: u32 = 801;
    pub const UNKNOWN: u32 = 999;
}

/// An error of one of the four libraries: its own code and what happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmuError {
    pub code: u32,
    pub message: String,
}

impl EmuError {
    pub fn new(code: u32, message: impl Into<String>) -> EmuError {
        EmuError { code, message: message.into() }
    }
}

impl std::fmt::Display for EmuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (code {})", self.message, self.code)
    }
}

impl std::error::Error for EmuError {}

pub type Result<T> = std::result::Result<T, EmuError>;

/// Which library an error belongs to (their codes overlap).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lib {
    Driver,
    Nvrtc,
    CublasLt,
    Nccl,
}

static LATEST: Mutex<Vec<(Lib, u32, std::ffi::CString)>> = Mutex::new(Vec::new());

/// Prints `e` once (`pipewright-emu: <lib>: message`) and keeps it as the
/// latest message for its code; returns its code for the C caller.
pub fn report(lib: Lib, e: &EmuError) -> u32 {
    eprintln!("pipewright-emu: {}: {}", lib_name(lib), e.message);
    let text = std::ffi::CString::new(e.message.replace('\0', " ")).expect("NULs replaced");
    let mut latest = LATEST.lock().unwrap_or_else(|p| p.into_inner());
    latest.retain(|(l, c, _)| !(*l == lib && *c == e.code));
    latest.push((lib, e.code, text));
    e.code
}

/// The latest message reported for (`lib`, `code`), as a C string that lives
/// for the rest of the process (the error-string functions return it).
pub fn latest_message(lib: Lib, code: u32) -> Option<*const std::ffi::c_char> {
    let latest = LATEST.lock().unwrap_or_else(|p| p.into_inner());
    let (_, _, text) = latest.iter().find(|(l, c, _)| *l == lib && *c == code)?;
    // Leaked on purpose: the caller may hold the pointer after a newer error
    // of the same code replaced this one.
    Some(Box::leak(text.clone().into_boxed_c_str()).as_ptr())
}

pub fn lib_name(lib: Lib) -> &'static str {
    match lib {
        Lib::Driver => "libcuda",
        Lib::Nvrtc => "NVRTC",
        Lib::CublasLt => "cuBLASLt",
        Lib::Nccl => "NCCL",
    }
}
