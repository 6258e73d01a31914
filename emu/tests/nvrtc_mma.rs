//! An inline PTX mma.sync statement becomes one call of the runtime's mma
//! with the operands bound as the template's %N say ("+f" outputs read as
//! the accumulator too), checked with a test runtime that records its
//! arguments; the kernel's entry runs on the test thread as one lane.

mod nvrtc_support;
use nvrtc_support::*;
use std::ffi::c_void;

const SRC: &str = r#"
extern "C" __global__ void mma_in_place(float* acc, const unsigned int* frag) {
    float d[4] = {acc[0], acc[1], acc[2], acc[3]};
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(frag[0]), "r"(frag[1]), "r"(frag[2]), "r"(frag[3]), "r"(frag[4]), "r"(frag[5]));
    acc[0] = d[0];
    acc[1] = d[1];
    acc[2] = d[2];
    acc[3] = d[3];
}

extern "C" __global__ void mma_permuted(float* out, const float* c, const unsigned int* frag) {
    float d0, d1, d2, d3;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%3,%2,%1,%0}, {%11,%10,%9,%8}, {%5,%4}, {%6,%7,%12,%13};"
        : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
        : "r"(frag[0]), "r"(frag[1]), "f"(c[0]), "f"(c[1]), "r"(frag[2]), "r"(frag[3]), "r"(frag[4]),
          "r"(frag[5]), "f"(c[2]), "f"(c[3]));
    out[0] = d0;
    out[1] = d1;
    out[2] = d2;
    out[3] = d3;
}
"#;

fn module() -> Module {
    let c = compile("mma.cu", SRC, &[], &["--gpu-architecture=sm_90"]);
    assert_eq!(c.code, pipewright_emu::nvrtc::NVRTC_SUCCESS, "{}", c.log);
    assert_eq!(c.log, "");
    load(&c.image.unwrap())
}

fn run(entry: extern "C" fn(*mut *mut c_void), ptrs: &mut [*const c_void]) {
    let mut args: Vec<*mut c_void> =
        ptrs.iter_mut().map(|p| p as *mut *const c_void as *mut c_void).collect();
    CALLS.with(|c| c.borrow_mut().mma.clear());
    entry(args.as_mut_ptr());
}

#[test]
fn an_in_place_mma_passes_fragments_in_template_order_and_reads_the_accumulator() {
    let m = module();
    let mut acc = [1.0f32, 2.0, 3.0, 4.0];
    let frag = [10u32, 11, 12, 13, 14, 15];
    run(
        m.kernel("mma_in_place").entry,
        &mut [acc.as_mut_ptr() as *const c_void, frag.as_ptr() as *const c_void],
    );
    let calls = CALLS.with(|c| c.borrow().mma.clone());
    assert_eq!(calls, [([10, 11, 12, 13], [14, 15], [1.0, 2.0, 3.0, 4.0])]);
    assert_eq!(acc, test_mma_result([1.0, 2.0, 3.0, 4.0]));
}

#[test]
fn a_permuted_template_binds_each_operand_where_its_number_says() {
    let m = module();
    let mut out = [0f32; 4];
    let c = [5.0f32, 6.0, 7.0, 8.0];
    let frag = [20u32, 21, 22, 23, 24, 25];
    run(
        m.kernel("mma_permuted").entry,
        &mut [out.as_mut_ptr() as *const c_void, c.as_ptr() as *const c_void, frag.as_ptr() as *const c_void],
    );
    let calls = CALLS.with(|c| c.borrow().mma.clone());
    // %4..%13 are frag0, frag1, c0, c1, frag2..frag5, c2, c3.
    assert_eq!(calls, [([25, 24, 23, 22], [21, 20], [5.0, 6.0, 7.0, 8.0])]);
    // d = {%3,%2,%1,%0}: the runtime's d[0] lands in d3.
    let d = test_mma_result(c);
    assert_eq!(out, [d[3], d[2], d[1], d[0]]);
}

#[test]
fn an_mma_reading_a_write_only_output_as_its_accumulator_fails_naming_the_operand() {
    let src = "extern \"C\" __global__ void k(float* o, const unsigned int* f) {\n  float d0, d1, d2, d3;\n  \
               asm(\"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, \
               {%0,%1,%2,%3};\" : \"=f\"(d0), \"=f\"(d1), \"=f\"(d2), \"=f\"(d3) : \"r\"(f[0]), \"r\"(f[1]), \
               \"r\"(f[2]), \"r\"(f[3]), \"r\"(f[4]), \"r\"(f[5]));\n  o[0] = d0 + d1 + d2 + d3;\n}\n";
    let c = compile("k.cu", src, &[], &["--gpu-architecture=sm_90"]);
    assert_eq!(c.code, pipewright_emu::nvrtc::NVRTC_ERROR_COMPILATION);
    assert!(
        c.log.contains("k.cu:3:3: error:") && c.log.contains("`%0`") && c.log.contains("write-only"),
        "{}",
        c.log
    );
}
