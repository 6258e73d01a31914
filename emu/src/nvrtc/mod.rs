//! NVRTC's entry points, as cudarc 0.19 (feature cuda-13000) declares them.
//!
//! "Compiling" a program builds it with the system C++ compiler against
//! include/cuda_emu.h into a shared object (`build`), after a source
//! pre-pass (`prepass`) that registers the extern "C" __global__ kernels for
//! the driver's cuModuleLoadData (include/pw_emu_abi.h). The shared object's
//! bytes are what nvrtcGetCUBIN returns.
//!
//! Every entry point cudarc can reach is exported: cudarc panics on a missing
//! symbol. What the emulator does not produce (PTX, LTO IR, OptiX IR, lowered
//! names) is refused with an NVRTC error code and a message, never a silent
//! success. nvrtcGetPTX in particular is refused: there is no PTX, and a
//! caller that loads PTX through the driver would otherwise get an image the
//! driver cannot tell from text.

pub mod build;
pub mod lex;
pub mod options;
pub mod prepass;

use crate::error::{self, EmuError, Lib};
use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Mutex;

pub use options::SUPPORTED_ARCHS;

/// nvrtcResult (nvrtc.h, CUDA 13.0).
pub type NvrtcResult = u32;
pub const NVRTC_SUCCESS: NvrtcResult = 0;
pub const NVRTC_ERROR_OUT_OF_MEMORY: NvrtcResult = 1;
pub const NVRTC_ERROR_PROGRAM_CREATION_FAILURE: NvrtcResult = 2;
pub const NVRTC_ERROR_INVALID_INPUT: NvrtcResult = 3;
pub const NVRTC_ERROR_INVALID_PROGRAM: NvrtcResult = 4;
pub const NVRTC_ERROR_INVALID_OPTION: NvrtcResult = 5;
pub const NVRTC_ERROR_COMPILATION: NvrtcResult = 6;
pub const NVRTC_ERROR_BUILTIN_OPERATION_FAILURE: NvrtcResult = 7;
pub const NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION: NvrtcResult = 8;
pub const NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION: NvrtcResult = 9;
pub const NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID: NvrtcResult = 10;
pub const NVRTC_ERROR_INTERNAL_ERROR: NvrtcResult = 11;

const NAMES: [&CStr; 18] = [
    c"NVRTC_SUCCESS",
    c"NVRTC_ERROR_OUT_OF_MEMORY",
    c"NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
    c"NVRTC_ERROR_INVALID_INPUT",
    c"NVRTC_ERROR_INVALID_PROGRAM",
    c"NVRTC_ERROR_INVALID_OPTION",
    c"NVRTC_ERROR_COMPILATION",
    c"NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
    c"NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION",
    c"NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
    c"NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID",
    c"NVRTC_ERROR_INTERNAL_ERROR",
    c"NVRTC_ERROR_TIME_FILE_WRITE_FAILED",
    c"NVRTC_ERROR_NO_PCH_CREATE_ATTEMPTED",
    c"NVRTC_ERROR_PCH_CREATE_HEAP_EXHAUSTED",
    c"NVRTC_ERROR_PCH_CREATE",
    c"NVRTC_ERROR_CANCELLED",
    c"NVRTC_ERROR_TIME_TRACE_FILE_WRITE_FAILED",
];

/// The version this stand-in answers to (the NVRTC the backend is built for).
pub const VERSION: (c_int, c_int) = (13, 0);

/// nvrtcProgram: an opaque handle, a `Box<Mutex<Program>>` while live.
pub type NvrtcProgram = *mut c_void;

struct Program {
    name: String,
    source: String,
    headers: Vec<(String, String)>,
    /// The latest compilation's log, NUL-terminated ("" before any).
    log: CString,
    /// The image of the latest successful compilation.
    image: Option<Vec<u8>>,
}

/// Live handles, so a stale or foreign one is an error, not a wild read.
static LIVE: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn fail(code: NvrtcResult, message: impl Into<String>) -> NvrtcResult {
    error::report(Lib::Nvrtc, &EmuError::new(code, message))
}

/// Runs `f` on the program behind `prog`, or fails naming the entry point.
fn with_program(prog: NvrtcProgram, entry: &str, f: impl FnOnce(&mut Program) -> NvrtcResult) -> NvrtcResult {
    let live =
        LIVE.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|l| l.contains(&(prog as usize)));
    if !live {
        return fail(NVRTC_ERROR_INVALID_PROGRAM, format!("{entry}: {prog:?} is not a live nvrtcProgram"));
    }
    // SAFETY: live handles point at a Box<Mutex<Program>> not yet destroyed.
    let program = unsafe { &*(prog as *const Mutex<Program>) };
    let mut p = program.lock().unwrap_or_else(|p| p.into_inner());
    f(&mut p)
}

/// A C string argument as UTF-8, or an error naming the argument.
///
/// # Safety
/// `s` is null or a NUL-terminated string.
unsafe fn text(s: *const c_char, what: &str) -> Result<String, String> {
    if s.is_null() {
        return Err(format!("{what} is null"));
    }
    CStr::from_ptr(s).to_str().map(str::to_string).map_err(|e| format!("{what} is not UTF-8: {e}"))
}

/// # Safety
/// As nvrtc.h's nvrtcGetErrorString.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetErrorString(result: NvrtcResult) -> *const c_char {
    if let Some(latest) = error::latest_message(Lib::Nvrtc, result) {
        return latest;
    }
    match NAMES.get(result as usize) {
        Some(name) => name.as_ptr(),
        None => c"NVRTC_ERROR unknown".as_ptr(),
    }
}

/// # Safety
/// As nvrtc.h's nvrtcVersion.
#[no_mangle]
pub unsafe extern "C" fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> NvrtcResult {
    if major.is_null() || minor.is_null() {
        return fail(NVRTC_ERROR_INVALID_INPUT, "nvrtcVersion: an out-parameter is null");
    }
    *major = VERSION.0;
    *minor = VERSION.1;
    NVRTC_SUCCESS
}

/// # Safety
/// As nvrtc.h's nvrtcGetNumSupportedArchs.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetNumSupportedArchs(num_archs: *mut c_int) -> NvrtcResult {
    if num_archs.is_null() {
        return fail(NVRTC_ERROR_INVALID_INPUT, "nvrtcGetNumSupportedArchs: numArchs is null");
    }
    *num_archs = SUPPORTED_ARCHS.len() as c_int;
    NVRTC_SUCCESS
}

/// # Safety
/// As nvrtc.h's nvrtcGetSupportedArchs: room for nvrtcGetNumSupportedArchs ints.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetSupportedArchs(archs: *mut c_int) -> NvrtcResult {
    if archs.is_null() {
        return fail(NVRTC_ERROR_INVALID_INPUT, "nvrtcGetSupportedArchs: supportedArchs is null");
    }
    for (i, a) in SUPPORTED_ARCHS.iter().enumerate() {
        *archs.add(i) = *a;
    }
    NVRTC_SUCCESS
}

/// # Safety
/// As nvrtc.h's nvrtcCreateProgram.
#[no_mangle]
pub unsafe extern "C" fn nvrtcCreateProgram(
    prog: *mut NvrtcProgram,
    src: *const c_char,
    name: *const c_char,
    num_headers: c_int,
    headers: *const *const c_char,
    include_names: *const *const c_char,
) -> NvrtcResult {
    let created = (|| -> Result<Program, String> {
        if prog.is_null() {
            return Err("prog is null".into());
        }
        let source = text(src, "src")?;
        let name = if name.is_null() { "default_program".to_string() } else { text(name, "name")? };
        if num_headers < 0 {
            return Err(format!("numHeaders is {num_headers}"));
        }
        if num_headers > 0 && (headers.is_null() || include_names.is_null()) {
            return Err(format!("numHeaders is {num_headers} but headers or includeNames is null"));
        }
        let mut hs = vec![];
        for i in 0..num_headers as usize {
            let include = text(*include_names.add(i), &format!("includeNames[{i}]"))?;
            let contents = text(*headers.add(i), &format!("headers[{i}] (`{include}`)"))?;
            hs.push((include, contents));
        }
        Ok(Program { name, source, headers: hs, log: CString::default(), image: None })
    })();
    match created {
        Ok(p) => {
            let handle = Box::into_raw(Box::new(Mutex::new(p))) as NvrtcProgram;
            LIVE.lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(HashSet::new)
                .insert(handle as usize);
            *prog = handle;
            NVRTC_SUCCESS
        }
        Err(e) => fail(NVRTC_ERROR_INVALID_INPUT, format!("nvrtcCreateProgram: {e}")),
    }
}

/// # Safety
/// As nvrtc.h's nvrtcDestroyProgram.
#[no_mangle]
pub unsafe extern "C" fn nvrtcDestroyProgram(prog: *mut NvrtcProgram) -> NvrtcResult {
    if prog.is_null() {
        return fail(NVRTC_ERROR_INVALID_PROGRAM, "nvrtcDestroyProgram: prog is null");
    }
    let handle = *prog;
    let removed =
        LIVE.lock().unwrap_or_else(|p| p.into_inner()).as_mut().is_some_and(|l| l.remove(&(handle as usize)));
    if !removed {
        return fail(
            NVRTC_ERROR_INVALID_PROGRAM,
            format!("nvrtcDestroyProgram: {handle:?} is not a live nvrtcProgram"),
        );
    }
    drop(Box::from_raw(handle as *mut Mutex<Program>));
    *prog = std::ptr::null_mut();
    NVRTC_SUCCESS
}

/// # Safety
/// As nvrtc.h's nvrtcCompileProgram.
#[no_mangle]
pub unsafe extern "C" fn nvrtcCompileProgram(
    prog: NvrtcProgram,
    num_options: c_int,
    options: *const *const c_char,
) -> NvrtcResult {
    let mut args = vec![];
    if num_options < 0 || (num_options > 0 && options.is_null()) {
        return fail(
            NVRTC_ERROR_INVALID_INPUT,
            format!("nvrtcCompileProgram: numOptions {num_options}, options {options:?}"),
        );
    }
    for i in 0..num_options as usize {
        match text(*options.add(i), &format!("options[{i}]")) {
            Ok(a) => args.push(a),
            Err(e) => return fail(NVRTC_ERROR_INVALID_INPUT, format!("nvrtcCompileProgram: {e}")),
        }
    }
    with_program(prog, "nvrtcCompileProgram", |p| {
        p.image = None;
        let set_log = |p: &mut Program, log: String| {
            p.log = CString::new(log.replace('\0', " ")).expect("NULs replaced");
        };
        let opts = match options::parse(&args) {
            Ok(o) => o,
            Err(e) => {
                set_log(p, format!("nvrtc: error: {e}\n"));
                return fail(NVRTC_ERROR_INVALID_OPTION, format!("compiling {}: {e}", p.name));
            }
        };
        let input = build::Program { name: &p.name, source: &p.source, headers: &p.headers };
        match build::build(&input, &opts) {
            build::Outcome::Built { image, log } => {
                set_log(p, log);
                p.image = Some(image);
                NVRTC_SUCCESS
            }
            build::Outcome::Failed { log } => {
                let message =
                    format!("compiling {} for {} failed:\n{}", p.name, opts.arch_name(), log.trim_end());
                set_log(p, log);
                fail(NVRTC_ERROR_COMPILATION, message)
            }
            build::Outcome::Broken { log } => {
                let message = format!("compiling {} for {}: {}", p.name, opts.arch_name(), log.trim_end());
                set_log(p, log);
                fail(NVRTC_ERROR_BUILTIN_OPERATION_FAILURE, message)
            }
        }
    })
}

/// # Safety
/// As nvrtc.h's nvrtcGetProgramLogSize (the size counts the closing NUL).
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLogSize(prog: NvrtcProgram, size: *mut usize) -> NvrtcResult {
    if size.is_null() {
        return fail(NVRTC_ERROR_INVALID_INPUT, "nvrtcGetProgramLogSize: logSizeRet is null");
    }
    with_program(prog, "nvrtcGetProgramLogSize", |p| {
        *size = p.log.as_bytes_with_nul().len();
        NVRTC_SUCCESS
    })
}

/// # Safety
/// As nvrtc.h's nvrtcGetProgramLog: room for nvrtcGetProgramLogSize bytes.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLog(prog: NvrtcProgram, log: *mut c_char) -> NvrtcResult {
    if log.is_null() {
        return fail(NVRTC_ERROR_INVALID_INPUT, "nvrtcGetProgramLog: log is null");
    }
    with_program(prog, "nvrtcGetProgramLog", |p| {
        let bytes = p.log.as_bytes_with_nul();
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), log as *mut u8, bytes.len());
        NVRTC_SUCCESS
    })
}

/// # Safety
/// As nvrtc.h's nvrtcGetCUBINSize.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBINSize(prog: NvrtcProgram, size: *mut usize) -> NvrtcResult {
    if size.is_null() {
        return fail(NVRTC_ERROR_INVALID_INPUT, "nvrtcGetCUBINSize: cubinSizeRet is null");
    }
    with_program(prog, "nvrtcGetCUBINSize", |p| match &p.image {
        Some(image) => {
            *size = image.len();
            NVRTC_SUCCESS
        }
        None => not_compiled("nvrtcGetCUBINSize", &p.name),
    })
}

/// # Safety
/// As nvrtc.h's nvrtcGetCUBIN: room for nvrtcGetCUBINSize bytes.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBIN(prog: NvrtcProgram, cubin: *mut c_char) -> NvrtcResult {
    if cubin.is_null() {
        return fail(NVRTC_ERROR_INVALID_INPUT, "nvrtcGetCUBIN: cubin is null");
    }
    with_program(prog, "nvrtcGetCUBIN", |p| match &p.image {
        Some(image) => {
            std::ptr::copy_nonoverlapping(image.as_ptr(), cubin as *mut u8, image.len());
            NVRTC_SUCCESS
        }
        None => not_compiled("nvrtcGetCUBIN", &p.name),
    })
}

fn not_compiled(entry: &str, name: &str) -> NvrtcResult {
    fail(NVRTC_ERROR_INVALID_PROGRAM, format!("{entry}: program {name} has not been compiled successfully"))
}

fn no_such_output(entry: &str, what: &str) -> NvrtcResult {
    fail(
        NVRTC_ERROR_INVALID_INPUT,
        format!("{entry}: the emulator produces no {what}: a program compiles to a host shared object, which nvrtcGetCUBIN returns"),
    )
}

/// # Safety
/// Any arguments: it refuses (the emulator has no PTX).
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetPTXSize(_prog: NvrtcProgram, _size: *mut usize) -> NvrtcResult {
    no_such_output("nvrtcGetPTXSize", "PTX")
}

/// # Safety
/// Any arguments: it refuses (the emulator has no PTX).
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetPTX(_prog: NvrtcProgram, _ptx: *mut c_char) -> NvrtcResult {
    no_such_output("nvrtcGetPTX", "PTX")
}

/// # Safety
/// Any arguments: it refuses.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetLTOIRSize(_prog: NvrtcProgram, _size: *mut usize) -> NvrtcResult {
    no_such_output("nvrtcGetLTOIRSize", "LTO IR")
}

/// # Safety
/// Any arguments: it refuses.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetLTOIR(_prog: NvrtcProgram, _ltoir: *mut c_char) -> NvrtcResult {
    no_such_output("nvrtcGetLTOIR", "LTO IR")
}

/// # Safety
/// Any arguments: it refuses.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetOptiXIRSize(_prog: NvrtcProgram, _size: *mut usize) -> NvrtcResult {
    no_such_output("nvrtcGetOptiXIRSize", "OptiX IR")
}

/// # Safety
/// Any arguments: it refuses.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetOptiXIR(_prog: NvrtcProgram, _optixir: *mut c_char) -> NvrtcResult {
    no_such_output("nvrtcGetOptiXIR", "OptiX IR")
}

/// # Safety
/// Any arguments: name expressions are refused (kernels are found by their
/// extern "C" names; templates cannot be registered).
#[no_mangle]
pub unsafe extern "C" fn nvrtcAddNameExpression(_prog: NvrtcProgram, name: *const c_char) -> NvrtcResult {
    let name = text(name, "name_expression").unwrap_or_else(|e| e);
    fail(
        NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID,
        format!(
            "nvrtcAddNameExpression(`{name}`): the emulator registers extern \"C\" kernels only, by name"
        ),
    )
}

/// # Safety
/// Any arguments: it refuses, as nvrtcAddNameExpression does.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetLoweredName(
    _prog: NvrtcProgram,
    name: *const c_char,
    _lowered: *mut *const c_char,
) -> NvrtcResult {
    let name = text(name, "name_expression").unwrap_or_else(|e| e);
    fail(
        NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID,
        format!(
            "nvrtcGetLoweredName(`{name}`): the emulator has no name expressions; use the extern \"C\" name"
        ),
    )
}
