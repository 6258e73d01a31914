//! What the NVRTC stand-in refuses, with which code, and that its log names
//! the culprit: unknown options and architectures, bad programs, inline PTX
//! it does not implement, outputs it does not produce, stale handles.

mod nvrtc_support;
use nvrtc_support::*;
use pipewright_emu::nvrtc::*;
use std::ffi::c_char;

const OK_KERNEL: &str = "extern \"C\" __global__ void scale(float* x, float s) { x[threadIdx.x] *= s; }\n";

#[test]
fn an_unknown_option_fails_with_invalid_option_and_a_log_naming_it() {
    let c = compile("scale.cu", OK_KERNEL, &[], &["--gpu-architecture=sm_90", "--use_fast_math"]);
    assert_eq!(c.code, NVRTC_ERROR_INVALID_OPTION);
    assert!(c.log.contains("'--use_fast_math'"), "{}", c.log);
}

#[test]
fn ptxas_report_options_are_refused_rather_than_answered_with_nothing() {
    let c = compile("scale.cu", OK_KERNEL, &[], &["--gpu-architecture=sm_90", "--ptxas-options=-v"]);
    assert_eq!(c.code, NVRTC_ERROR_INVALID_OPTION);
    assert!(c.log.contains("--ptxas-options=-v") && c.log.contains("ptxas"), "{}", c.log);
}

#[test]
fn an_architecture_outside_the_emulated_families_fails_with_a_log_naming_it() {
    for arch in ["sm_75", "sm_100", "compute_90"] {
        let c = compile("scale.cu", OK_KERNEL, &[], &[&format!("-arch={arch}")]);
        assert_eq!(c.code, NVRTC_ERROR_INVALID_OPTION, "{arch}");
        assert!(c.log.contains(&format!("'{arch}'")), "{arch}: {}", c.log);
    }
}

#[test]
fn a_syntax_error_fails_compilation_with_the_file_and_line_in_the_log() {
    let src = "extern \"C\" __global__ void broken(int* x) {\n    x[0] = ;\n}\n";
    let c = compile("broken.cu", src, &[], &["--gpu-architecture=sm_90"]);
    assert_eq!(c.code, NVRTC_ERROR_COMPILATION);
    assert!(c.log.contains("broken.cu:2:"), "{}", c.log);
    assert!(c.image.is_none());
}

#[test]
fn an_unsupported_ptx_instruction_fails_compilation_naming_the_instruction() {
    let src = "extern \"C\" __global__ void load(float* out, const float* p) {\n    float v;\n    \
               asm volatile(\"ld.global.nc.f32 %0, [%1];\" : \"=f\"(v) : \"l\"(p));\n    out[0] = v;\n}\n";
    let c = compile("load.cu", src, &[], &["--gpu-architecture=sm_80"]);
    assert_eq!(c.code, NVRTC_ERROR_COMPILATION);
    assert!(c.log.contains("load.cu:3:5: error:"), "{}", c.log);
    assert!(
        c.log.contains("`ld.global.nc.f32`") && c.log.contains("not implemented by the emulator"),
        "{}",
        c.log
    );
}

#[test]
fn a_kernel_without_extern_c_fails_compilation_naming_it() {
    let src = "__global__ void mangled(float* x) { x[0] = 1.0f; }\n";
    let c = compile("mangled.cu", src, &[], &["--gpu-architecture=sm_90"]);
    assert_eq!(c.code, NVRTC_ERROR_COMPILATION);
    assert!(c.log.contains("`mangled`") && c.log.contains("extern \"C\""), "{}", c.log);
}

#[test]
fn activemask_and_atomics_do_not_compile() {
    for body in ["x[0] = __activemask();", "atomicAdd(x, 1u);"] {
        let src = format!("extern \"C\" __global__ void k(unsigned int* x) {{ {body} }}\n");
        let c = compile("k.cu", &src, &[], &["--gpu-architecture=sm_90"]);
        assert_eq!(c.code, NVRTC_ERROR_COMPILATION, "{body}");
        assert!(c.log.contains("k.cu:1:"), "{body}: {}", c.log);
    }
}

#[test]
fn compiler_warnings_reach_the_log_of_a_successful_compilation() {
    let src =
        "extern \"C\" __global__ void warns(float* x) {\n    int unused_here = 3;\n    x[0] = 1.0f;\n}\n";
    let c = compile("warns.cu", src, &[], &["--gpu-architecture=sm_90"]);
    assert_eq!(c.code, NVRTC_SUCCESS, "{}", c.log);
    assert!(c.log.contains("warns.cu:2:") && c.log.contains("unused_here"), "{}", c.log);
}

#[test]
fn comparing_an_int_with_thread_idx_is_everyday_cuda_and_leaves_the_log_empty() {
    let src = "extern \"C\" __global__ void k(float* x, int n) {\n    if (threadIdx.x < n) x[0] = 1.0f;\n}\n";
    let c = compile("signs.cu", src, &[], &["--gpu-architecture=sm_90"]);
    assert_eq!(c.code, NVRTC_SUCCESS, "{}", c.log);
    assert_eq!(c.log, "");
}

#[test]
fn ptx_is_refused_and_a_cubin_exists_only_after_a_successful_compile() {
    setup();
    let src = std::ffi::CString::new(OK_KERNEL).unwrap();
    let mut prog: NvrtcProgram = std::ptr::null_mut();
    unsafe {
        assert_eq!(
            nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                std::ptr::null(),
                0,
                std::ptr::null(),
                std::ptr::null()
            ),
            NVRTC_SUCCESS
        );
        let mut size = 0usize;
        assert_eq!(nvrtcGetCUBINSize(prog, &mut size), NVRTC_ERROR_INVALID_PROGRAM);
        assert_eq!(nvrtcGetProgramLogSize(prog, &mut size), NVRTC_SUCCESS);
        assert_eq!(size, 1, "before compiling, the log is the empty string");
        let arch = c"--gpu-architecture=sm_90";
        assert_eq!(nvrtcCompileProgram(prog, 1, &arch.as_ptr()), NVRTC_SUCCESS);
        assert_eq!(nvrtcGetCUBINSize(prog, &mut size), NVRTC_SUCCESS);
        assert!(size > 0);
        assert_eq!(nvrtcGetPTXSize(prog, &mut size), NVRTC_ERROR_INVALID_INPUT);
        let mut buf = [0 as c_char; 4];
        assert_eq!(nvrtcGetPTX(prog, buf.as_mut_ptr()), NVRTC_ERROR_INVALID_INPUT);
        assert_eq!(nvrtcAddNameExpression(prog, c"scale".as_ptr()), NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID);
        let stale = prog;
        assert_eq!(nvrtcDestroyProgram(&mut prog), NVRTC_SUCCESS);
        assert_eq!(nvrtcGetCUBINSize(stale, &mut size), NVRTC_ERROR_INVALID_PROGRAM);
        let mut again = stale;
        assert_eq!(nvrtcDestroyProgram(&mut again), NVRTC_ERROR_INVALID_PROGRAM);
    }
}

#[test]
fn version_and_architectures_are_those_of_the_emulated_stack() {
    let (mut major, mut minor, mut n) = (0, 0, 0);
    unsafe {
        assert_eq!(nvrtcVersion(&mut major, &mut minor), NVRTC_SUCCESS);
        assert_eq!(nvrtcGetNumSupportedArchs(&mut n), NVRTC_SUCCESS);
        let mut archs = vec![0; n as usize];
        assert_eq!(nvrtcGetSupportedArchs(archs.as_mut_ptr()), NVRTC_SUCCESS);
        assert_eq!(archs, [80, 90]);
        let name = std::ffi::CStr::from_ptr(nvrtcGetErrorString(NVRTC_SUCCESS));
        assert_eq!(name.to_str().unwrap(), "NVRTC_SUCCESS");
    }
    assert_eq!((major, minor), (13, 0));
}
