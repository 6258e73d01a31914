//! Accepted options take effect in the build: -D in both spellings (glued
//! and as two arguments), -I directories searched for #include, --std passed
//! to the host compiler.

mod nvrtc_support;
use nvrtc_support::*;
use pipewright_emu::nvrtc::NVRTC_SUCCESS;
use std::ffi::c_void;

const SRC: &str = r#"
#include "scale_factor.h"
extern "C" __global__ void scaled(float* x) {
    x[0] = SCALE * FACTOR_FROM_HEADER + OFFSET;
}
"#;

#[test]
fn defines_include_paths_and_the_standard_reach_the_compiler() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("scale_factor.h"), "#define FACTOR_FROM_HEADER 10.0f\n").unwrap();
    let inc = dir.path().to_str().unwrap();
    let c = compile(
        "scaled.cu",
        SRC,
        &[],
        &["-arch", "sm_90", "--std=c++14", "-D", "SCALE=3.0f", "-DOFFSET=0.5f", "-I", inc, "-default-device"],
    );
    assert_eq!(c.code, NVRTC_SUCCESS, "{}", c.log);
    let m = load(&c.image.unwrap());
    let mut x = [0f32];
    let mut p = x.as_mut_ptr();
    let mut args = [&mut p as *mut *mut f32 as *mut c_void];
    (m.kernel("scaled").entry)(args.as_mut_ptr());
    assert_eq!(x[0], 30.5);
}

#[test]
fn a_missing_include_directory_leaves_the_header_unfound_and_says_so() {
    let c = compile("scaled.cu", SRC, &[], &["-arch=sm_90", "-DSCALE=1", "-DOFFSET=0"]);
    assert_eq!(c.code, pipewright_emu::nvrtc::NVRTC_ERROR_COMPILATION);
    assert!(c.log.contains("scale_factor.h"), "{}", c.log);
}

#[test]
fn nvrtcs_predefined_macros_say_device_code_for_the_chosen_architecture() {
    let src = "extern \"C\" __global__ void arch(int* out) {\n#if defined(__CUDACC__) && defined(__CUDACC_RTC__)\n    \
               out[0] = __CUDA_ARCH__;\n    out[1] = __CUDACC_VER_MAJOR__;\n#endif\n}\n";
    for (arch, want) in [("sm_80", 800), ("sm_90", 900)] {
        let c = compile("arch.cu", src, &[], &[&format!("-arch={arch}")]);
        assert_eq!(c.code, NVRTC_SUCCESS, "{}", c.log);
        let m = load(&c.image.unwrap());
        let mut out = [0i32; 2];
        let mut p = out.as_mut_ptr();
        let mut args = [&mut p as *mut *mut i32 as *mut c_void];
        (m.kernel("arch").entry)(args.as_mut_ptr());
        assert_eq!(out, [want, 13], "{arch}");
    }
}
