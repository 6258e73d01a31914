//! PW_EMU_CHECK=bounds: kernels are built with a call per load and store,
//! and an access outside its allocation is an error naming the kernel,
//! thread, address, allocation and how far past its end, even inside the
//! alignment slack after the end, which no guard page covers (a read there
//! otherwise returns the canary's bytes, silently).

mod exec_compiled;
mod exec_support;
mod nvrtc_support;

use exec_compiled::*;
use exec_support::*;
use pipewright_emu::error::cu;

fn bounds_mode() {
    // Read once per process, before the first build and launch: set before any.
    std::env::set_var("PW_EMU_CHECK", "bounds");
    init();
    assert!(pipewright_emu::exec::bounds_check_enabled());
}

const SHIFT_CU: &str = r#"
// out[i] = in[i + 1]: the last thread reads one element past `in`
// unless `guarded` stops it.
extern "C" __global__ void shift_left(float* out, const float* in, int n, int guarded) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = (guarded && i + 1 >= n) ? 0.0f : in[i + 1];
}
"#;

fn run(guarded: bool) -> (u32, Gpu, u64) {
    bounds_mode();
    let gpu = Gpu::new(0);
    let m = load_cu("shift.cu", SHIFT_CU);
    let f = get(m, "shift_left");
    // 250 floats: 1,000 bytes, the allocation's last 24 bytes of its
    // 256-byte unit are slack, mapped and readable.
    let n = 250usize;
    let (out, inp) = (gpu.alloc(n * 4), gpu.alloc(n * 4));
    gpu.upload(inp, &(0..n).map(|i| i as f32).collect::<Vec<_>>());
    let (mut o, mut i, mut nn, mut g) = (out, inp, n as i32, guarded as i32);
    let code =
        launch(f, (2, 1, 1), (128, 1, 1), 0, gpu.stream, &mut [p(&mut o), p(&mut i), p(&mut nn), p(&mut g)]);
    assert_eq!(code, cu::SUCCESS);
    (gpu.sync(), gpu, inp)
}

#[test]
fn a_read_one_element_past_the_end_inside_the_alignment_slack_is_named() {
    let _s = serial();
    let (code, _gpu, inp) = run(false);
    let at = format!("at {:#x}", inp + 1000);
    let alloc = format!("GPU 0's 1000-byte allocation at {inp:#x}");
    assert_error(
        code,
        cu::ILLEGAL_ADDRESS,
        &[
            "kernel `shift_left` (shift.cu)",
            "block (1, 0, 0)",
            "thread 121",
            "out-of-bounds load: 4 byte(s)",
            &at,
            "bytes 1000..1004",
            &alloc,
            "4 byte(s) past its end",
            "argument `in` (const float*)",
        ],
    );
}

#[test]
fn a_kernel_that_stays_inside_its_allocations_passes_the_bounds_check() {
    let _s = serial();
    let (code, gpu, _) = run(true);
    assert_eq!(code, cu::SUCCESS, "{}", error_text(code));
    let _ = gpu;
}
