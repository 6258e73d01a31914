//! The pre-pass on the repository's kernels and on the forms it rewrites:
//! lines are kept (so the compiler's messages point at the file as written),
//! flash_attention's mma statement binds its operands as its template says,
//! and `extern __shared__` arrays, at namespace or function scope, are the
//! runtime's dynamic shared memory.

mod nvrtc_support;
use nvrtc_support::*;
use pipewright_emu::nvrtc::prepass;
use std::ffi::c_void;

#[test]
fn every_kernel_file_keeps_its_line_count_through_the_pre_pass() {
    for file in [kernel_files(".cu"), kernel_files(".cuh")].concat() {
        let file = file.as_str();
        let src = kernel_source(file);
        let p =
            prepass::prepare(file, &src, file != "common.cuh").unwrap_or_else(|e| panic!("{file}: {e:?}"));
        assert_eq!(p.text.lines().count(), src.lines().count(), "{file}");
        assert!(!p.text.contains("#pragma unroll"), "{file}");
    }
}

#[test]
fn flash_attentions_mma_reads_d_as_its_accumulator_and_a_b_from_its_inputs() {
    let src = kernel_source("flash_attention.cu");
    let p = prepass::prepare("flash_attention.cu", &src, true).unwrap_or_else(|e| panic!("{e:?}"));
    assert!(!p.text.contains("asm volatile"), "the asm statement is rewritten");
    for bound in [
        "float& pw_op0 = (d[0]);",
        "const unsigned int pw_op4 = (a[0]);",
        "const unsigned int pw_op9 = (b1);",
        "const unsigned int pw_a[4] = {pw_op4, pw_op5, pw_op6, pw_op7};",
        "const unsigned int pw_b[2] = {pw_op8, pw_op9};",
        "const float pw_c[4] = {pw_op0, pw_op1, pw_op2, pw_op3};",
        "pw_op3 = pw_d[3];",
    ] {
        assert!(p.text.contains(bound), "missing `{bound}` in the rewrite");
    }
}

const SHARED: &str = r#"
extern __shared__ float staged[];

extern "C" {
__global__ void fill(float v) {
    staged[threadIdx.x] = v;
    extern __shared__ float again[];
    again[1] = staged[0] + 1.0f;
}
}
"#;

#[test]
fn extern_shared_arrays_are_the_runtimes_dynamic_shared_memory_at_either_scope() {
    let c = compile("shared.cu", SHARED, &[], &["--gpu-architecture=sm_80"]);
    assert_eq!(c.code, pipewright_emu::nvrtc::NVRTC_SUCCESS, "{}", c.log);
    assert_eq!(c.log, "");
    let m = load(&c.image.unwrap());
    let k = m.kernel("fill");
    let mut v = 2.5f32;
    let mut args = [&mut v as *mut f32 as *mut c_void];
    (k.entry)(args.as_mut_ptr());
    let got = DYNAMIC_SHARED.with(|d| [d.borrow()[0], d.borrow()[1]]);
    assert_eq!(got, [2.5, 3.5]);
}

#[test]
fn an_error_after_a_rewritten_statement_is_reported_on_its_own_line() {
    let src =
        "\nextern __shared__ float s[];\nextern \"C\" __global__ void k(float* x) {\n#pragma unroll\n  \
               for (int i = 0; i < 2; i++) x[i] = s[i];\n  x[0] = undeclared;\n}\n";
    let c = compile("late.cu", src, &[], &["--gpu-architecture=sm_90"]);
    assert!(c.log.contains("late.cu:6:10: error:") && c.log.contains("undeclared"), "{}", c.log);
}
