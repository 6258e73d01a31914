//! Kernels written in CUDA C++ in a test, built by the NVRTC stand-in and
//! loaded and launched through the driver's entry points, as the backend
//! does: what the compiler instruments (alignment, and every access in the
//! PW_EMU_CHECK modes that watch memory) is only seen this way.
#![allow(dead_code)]

use crate::exec_support::Handle;
use pipewright_emu::driver::{cuModuleGetFunction, cuModuleLoadData};
use pipewright_emu::error::cu;
use std::ffi::{c_void, CString};

/// Builds `source` (named `name`) for sm_90 and loads it into the current
/// context; returns the module.
pub fn load_cu(name: &str, source: &str) -> Handle {
    let c = crate::nvrtc_support::compile(name, source, &[], &["--gpu-architecture=sm_90", "--std=c++17"]);
    let image = c.image.unwrap_or_else(|| panic!("{name} does not compile:\n{}", c.log));
    let mut m: Handle = std::ptr::null_mut();
    // SAFETY: a complete image from the stand-in.
    let code = unsafe { cuModuleLoadData(&mut m, image.as_ptr() as *const c_void) };
    assert_eq!(code, cu::SUCCESS, "{}", crate::exec_support::error_text(code));
    m
}

pub fn get(m: Handle, name: &str) -> Handle {
    let name = CString::new(name).unwrap();
    let mut f: Handle = std::ptr::null_mut();
    // SAFETY: a loaded module and a NUL-terminated name.
    assert_eq!(unsafe { cuModuleGetFunction(&mut f, m, name.as_ptr()) }, cu::SUCCESS);
    f
}
