//! The PW_EMU_CHECK modes that watch every load and store (kernels built
//! with a call per access), on together as a user would turn them on:
//! - bounds: an access outside its allocation is an error naming the
//!   kernel, thread, address, allocation and how far past its end, even
//!   inside the alignment slack after the end, which no guard page covers
//!   (a read there otherwise returns the canary's bytes, silently);
//! - blocks: two blocks of one launch touching one byte of global memory,
//!   one of them writing, with no atomic (a lost update);
//! - warp: two threads touching one byte of shared memory, one writing,
//!   with no barrier between (warp-synchronous code without __syncwarp).

mod exec_compiled;
mod exec_support;
mod nvrtc_support;

use exec_compiled::*;
use exec_support::*;
use pipewright_emu::error::cu;

fn watch_modes() {
    // Read once per process, before the first build and launch: set before any.
    std::env::set_var("PW_EMU_CHECK", "bounds,blocks,warp");
    init();
    assert!(pipewright_emu::exec::bounds_check_enabled());
    assert!(pipewright_emu::exec::blocks_check_enabled());
    assert!(pipewright_emu::exec::warp_check_enabled());
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
    watch_modes();
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

const TOTAL_CU: &str = r#"
// Each block sums its share of `in`. Planted bug: every block then adds
// its sum into one float with a plain `+=`; on a GPU two blocks read the
// same old total and one addition is lost.
extern "C" __global__ void total_racy(float* sum, const float* in) {
    __shared__ float part[64];
    part[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int k = 0; k < blockDim.x; k++) s += part[k];
        *sum += s;
    }
}

// The fix: one partial per block, added up by the host (or a second launch).
extern "C" __global__ void total_partials(float* partials, const float* in) {
    __shared__ float part[64];
    part[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int k = 0; k < blockDim.x; k++) s += part[k];
        partials[blockIdx.x] = s;
    }
}
"#;

fn total(kernel: &str) -> (u32, Vec<f32>) {
    watch_modes();
    let gpu = Gpu::new(0);
    let m = load_cu("total.cu", TOTAL_CU);
    let f = get(m, kernel);
    let (blocks, threads) = (4usize, 64usize);
    let (out, inp) = (gpu.alloc(blocks * 4), gpu.alloc(blocks * threads * 4));
    gpu.upload(out, &[0f32; 4]);
    gpu.upload(inp, &vec![1f32; blocks * threads]);
    let (mut o, mut i) = (out, inp);
    assert_eq!(
        launch(f, (blocks as u32, 1, 1), (threads as u32, 1, 1), 0, gpu.stream, &mut [p(&mut o), p(&mut i)]),
        cu::SUCCESS
    );
    let code = gpu.sync();
    let host = if code == cu::SUCCESS { gpu.download(out, blocks) } else { Vec::new() };
    (code, host)
}

#[test]
fn a_plain_add_from_every_block_into_one_global_is_a_named_lost_update() {
    let _s = serial();
    let (code, _) = total("total_racy");
    assert_error(
        code,
        cu::LAUNCH_FAILED,
        &[
            "kernel `total_racy` (total.cu)",
            "thread 0",
            "PW_EMU_CHECK=blocks",
            "byte 0 of argument `sum`",
            "in this launch with no atomic",
            "per-block partial",
        ],
    );
}

#[test]
fn per_block_partials_pass_the_blocks_check() {
    let _s = serial();
    let (code, host) = total("total_partials");
    assert_eq!(code, cu::SUCCESS, "{}", error_text(code));
    assert_eq!(host, vec![64f32; 4]);
}

const SWAP_CU: &str = r#"
// Neighbouring lanes swap values through shared memory. Planted bug when
// `synced` is 0: no __syncwarp between the write and the read, so a lane
// reads its neighbour's slot before the neighbour wrote it (lockstep is not
// guaranteed since Volta; the emulator runs lanes one after another and the
// read returns shared memory's poison, a NaN).
extern "C" __global__ void swap_pairs(float* out, const float* in, int synced) {
    __shared__ float s[32];
    unsigned t = threadIdx.x;
    s[t] = in[t];
    if (synced) __syncwarp();
    out[t] = s[t ^ 1];
}
"#;

fn swap(synced: bool) -> (u32, Vec<f32>) {
    watch_modes();
    let gpu = Gpu::new(0);
    let m = load_cu("swap.cu", SWAP_CU);
    let f = get(m, "swap_pairs");
    let (out, inp) = (gpu.alloc(32 * 4), gpu.alloc(32 * 4));
    gpu.upload(inp, &(0..32).map(|i| i as f32).collect::<Vec<_>>());
    let (mut o, mut i, mut s) = (out, inp, synced as i32);
    assert_eq!(
        launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o), p(&mut i), p(&mut s)]),
        cu::SUCCESS
    );
    let code = gpu.sync();
    let host = if code == cu::SUCCESS { gpu.download(out, 32) } else { Vec::new() };
    (code, host)
}

#[test]
fn a_warp_reading_shared_memory_its_neighbour_writes_without_syncwarp_is_a_named_race() {
    let _s = serial();
    let (code, _) = swap(false);
    assert_error(
        code,
        cu::LAUNCH_FAILED,
        &[
            "kernel `swap_pairs` (swap.cu)",
            "PW_EMU_CHECK=warp",
            "thread 1 writes shared memory",
            "which thread 0 read",
            "both in warp 0, with no __syncwarp",
        ],
    );
}

#[test]
fn the_same_swap_with_its_syncwarp_passes_the_warp_check() {
    let _s = serial();
    let (code, host) = swap(true);
    assert_eq!(code, cu::SUCCESS, "{}", error_text(code));
    assert_eq!(host, (0..32).map(|i| (i ^ 1) as f32).collect::<Vec<_>>());
}
