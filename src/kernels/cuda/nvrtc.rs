//! Run-time compilation of `kernels/*.cu` with NVRTC, cached on disk.
//!
//! The sources are built into the binary, so a GPU machine needs only the
//! binary, the driver and NVRTC. NVRTC emits a CUBIN for the device's exact
//! architecture (`sm_XY`), not PTX: PTX from an NVRTC newer than the driver
//! would not load, a CUBIN does. The cache key is the sources' hash, the
//! architecture, the options and NVRTC's version; a failed cache write costs
//! only a recompile next time.

use super::{CudaError, Result};
use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

/// Included by every kernel file as "common.cuh".
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel file: (name, source). The name is the file's stem.
pub const SOURCES: &[(&str, &str)] = &[
    ("adamw", include_str!("../../../kernels/adamw.cu")),
    ("attention", include_str!("../../../kernels/attention.cu")),
    ("cast", include_str!("../../../kernels/cast.cu")),
    ("crossentropy", include_str!("../../../kernels/crossentropy.cu")),
    ("ema", include_str!("../../../kernels/ema.cu")),
    ("embedding", include_str!("../../../kernels/embedding.cu")),
    ("flash_attention", include_str!("../../../kernels/flash_attention.cu")),
    ("gelu", include_str!("../../../kernels/gelu.cu")),
    ("layernorm", include_str!("../../../kernels/layernorm.cu")),
    ("matmul", include_str!("../../../kernels/matmul.cu")),
    ("norm", include_str!("../../../kernels/norm.cu")),
    ("residual", include_str!("../../../kernels/residual.cu")),
    ("rmsnorm", include_str!("../../../kernels/rmsnorm.cu")),
    ("rope", include_str!("../../../kernels/rope.cu")),
    ("swiglu", include_str!("../../../kernels/swiglu.cu")),
    ("tp", include_str!("../../../kernels/tp.cu")),
];

/// A compiled kernel file.
pub struct Compiled {
    pub cubin: Vec<u8>,
    /// NVRTC's log: empty when there was nothing to warn about.
    pub log: String,
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32)> {
    if !super::nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor).result()? };
    Ok((major, minor))
}

fn source(file: &str) -> Result<&'static str> {
    SOURCES
        .iter()
        .find(|(name, _)| *name == file)
        .map(|(_, src)| *src)
        .ok_or_else(|| CudaError::Shape(format!("no kernel file kernels/{file}.cu")))
}

fn options(arch: u32, f32: bool) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture=sm_{arch}"), "--std=c++17".to_string()];
    if f32 {
        o.push("-DPW_F32".to_string());
    }
    o
}

/// Compiles kernels/`file`.cu for `sm_{arch}` to a CUBIN (`f32`: the f32 storage path).
pub fn compile(file: &str, arch: u32, f32: bool) -> Result<Compiled> {
    compile_with(file, arch, f32, &[])
}

/// `compile` with options added (not part of the cache key: for reports only).
pub fn compile_with(file: &str, arch: u32, f32: bool, extra: &[&str]) -> Result<Compiled> {
    if !super::nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let src =
        CString::new(source(file)?).map_err(|_| CudaError::Shape(format!("NUL in kernels/{file}.cu")))?;
    let name = CString::new(format!("{file}.cu")).expect("no NUL");
    let header = CString::new(COMMON).map_err(|_| CudaError::Shape("NUL in kernels/common.cuh".into()))?;
    let header_name = CString::new("common.cuh").expect("no NUL");
    let headers = [header.as_ptr()];
    let include_names = [header_name.as_ptr()];
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a live C string for the program's lifetime.
    unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            1,
            headers.as_ptr(),
            include_names.as_ptr(),
        )
        .result()?;
    }
    let mut opts = options(arch, f32);
    opts.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: prog was created above and is destroyed below, once.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let log = unsafe { result::get_program_log(prog) }.map(|l| c_chars_to_string(&l)).unwrap_or_default();
    let out = match compiled {
        Ok(()) => unsafe { cubin(prog) }.map(|cubin| Compiled { cubin, log }),
        Err(_) => Err(CudaError::Compile { file: file.to_string(), arch: format!("sm_{arch}"), log }),
    };
    unsafe {
        let _ = result::destroy_program(prog);
    }
    out
}

unsafe fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
    let mut buf = vec![0u8; size];
    sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char).result()?;
    Ok(buf)
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().trim().to_string())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).trim().to_string())
}

/// Where compiled kernels are kept: $PIPEWRIGHT_KERNEL_CACHE, else
/// $XDG_CACHE_HOME/pipewright/kernels, else ~/.cache/pipewright/kernels.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("PIPEWRIGHT_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("pipewright").join("kernels"))
}

/// The cache file name for one compilation.
pub fn cache_key(file: &str, arch: u32, f32: bool, nvrtc: (i32, i32)) -> Result<String> {
    let mut h = blake3::Hasher::new();
    h.update(COMMON.as_bytes());
    h.update(source(file)?.as_bytes());
    for o in options(arch, f32) {
        h.update(o.as_bytes());
        h.update(&[0]);
    }
    h.update(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
    let hex = h.finalize().to_hex();
    Ok(format!("{file}-sm_{arch}-{}-{}.cubin", if f32 { "f32" } else { "bf16" }, &hex[..16]))
}

/// The CUBIN of kernels/`file`.cu for `sm_{arch}`: from the disk cache, or compiled and stored there.
pub fn cubin_cached(file: &str, arch: u32, f32: bool) -> Result<Vec<u8>> {
    let key = cache_key(file, arch, f32, version()?)?;
    let path = cache_dir().map(|d| d.join(&key));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let compiled = compile(file, arch, f32)?;
    if let Some(p) = &path {
        // Write under a temporary name and rename, so a reader never sees half a file.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        let stored = p
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .and_then(|_| std::fs::write(&tmp, &compiled.cubin))
            .and_then(|_| std::fs::rename(&tmp, p));
        if let Err(e) = stored {
            tracing::warn!("pipewright: could not cache kernels/{file}.cu in {}: {e}", p.display());
        }
    }
    Ok(compiled.cubin)
}

/// What ptxas reports for one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    pub kernel: String,
    pub registers: u32,
    /// Static shared memory per block, bytes.
    pub smem_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// Registers, shared memory and spills of every kernel in kernels/`file`.cu
/// for `sm_{arch}`, from ptxas's report (`--ptxas-options=-v`, which NVRTC 12
/// and 13 pass on when compiling to a CUBIN).
pub fn usage(file: &str, arch: u32, f32: bool) -> Result<Vec<Usage>> {
    let c = compile_with(file, arch, f32, &["--ptxas-options=-v"])?;
    Ok(parse_usage(&c.log))
}

/// Reads ptxas's `-v` report: per entry function, "Used N registers, …,
/// M bytes smem" and "X bytes spill stores, Y bytes spill loads".
pub fn parse_usage(log: &str) -> Vec<Usage> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find_map(|part| {
                part.trim().strip_suffix(unit).and_then(|n| n.trim().rsplit(' ').next()?.parse().ok())
            })
            .unwrap_or(0)
    };
    let mut out: Vec<Usage> = vec![];
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(Usage { kernel, registers: 0, smem_bytes: 0, spill_stores: 0, spill_loads: 0 });
        } else if let Some(u) = out.last_mut() {
            if line.contains("spill stores") {
                u.spill_stores = number_before(line, "bytes spill stores");
                u.spill_loads = number_before(line, "bytes spill loads");
            } else if line.contains("registers") {
                u.registers = number_before(line.split(':').nth(1).unwrap_or(line), "registers");
                u.smem_bytes = number_before(line, "bytes smem");
            }
        }
    }
    out
}
