//! include/cuda_emu.h's built-ins as a kernel sees them: coordinates read
//! from the runtime's lane(), shuffles (64-bit ones as two 32-bit shuffles
//! of the low then the high word, as CUDA does), votes and barriers passed
//! to the runtime with their masks, and float arithmetic never fused.

mod nvrtc_support;
use nvrtc_support::*;
use pipewright_emu::abi;
use std::ffi::c_void;

const SRC: &str = r#"
extern "C" __global__ void coords(unsigned int* out) {
    out[0] = threadIdx.x; out[1] = threadIdx.y; out[2] = threadIdx.z;
    out[3] = blockIdx.x; out[4] = blockIdx.y; out[5] = blockIdx.z;
    out[6] = blockDim.x; out[7] = blockDim.y; out[8] = blockDim.z;
    out[9] = gridDim.x; out[10] = gridDim.y; out[11] = gridDim.z;
    out[12] = warpSize;
}

extern "C" __global__ void shuffles(double* d, float* f, long long* l, int* i) {
    d[0] = __shfl_xor_sync(0xffffffffu, d[0], 1);
    f[0] = __shfl_down_sync(0x0000ffffu, f[0], 2, 16);
    l[0] = __shfl_up_sync(0xffffffffu, l[0], 3);
    i[0] = __shfl_sync(0xffu, i[0], 5, 8);
}

extern "C" __global__ void votes_and_barriers(unsigned int* out, int p) {
    __syncthreads();
    __syncwarp();
    __syncwarp(0xfu);
    out[0] = __all_sync(0xffffffffu, p);
    out[1] = __any_sync(0x3u, p);
    out[2] = __ballot_sync(0x1u, p);
}

extern "C" __global__ void shared_cell(float* x) {
    __shared__ float cell[1];
    if (x[0] != 0.0f) cell[0] = x[0];
    x[1] = cell[0];
}

extern "C" __global__ void unfused(float* x) {
    x[0] = x[1] * x[2] + x[3];
    x[4] = __fmaf_rn(x[1], x[2], x[3]);
    x[5] = min(x[1], x[3]) + (float)max(2, 7) + (float)min(3u, 9u);
}
"#;

fn module() -> Module {
    let c = compile("builtins.cu", SRC, &[], &["--gpu-architecture=sm_90"]);
    assert_eq!(c.code, pipewright_emu::nvrtc::NVRTC_SUCCESS, "{}", c.log);
    assert_eq!(c.log, "");
    load(&c.image.unwrap())
}

/// Runs `kernel` with pointer arguments `pointers` (kernelParams point at each).
fn run(m: &Module, kernel: &str, pointers: &mut [*mut c_void]) {
    let mut args: Vec<*mut c_void> =
        pointers.iter_mut().map(|p| p as *mut *mut c_void as *mut c_void).collect();
    run_args(m, kernel, &mut args);
}

/// Runs `kernel` with kernelParams `args` as cuLaunchKernel takes them.
fn run_args(m: &Module, kernel: &str, args: &mut [*mut c_void]) {
    CALLS.with(|c| *c.borrow_mut() = Calls::default());
    (m.kernel(kernel).entry)(args.as_mut_ptr());
}

fn dim(x: u32, y: u32, z: u32) -> abi::Dim3 {
    abi::Dim3 { x, y, z }
}

#[test]
fn coordinates_are_the_running_lanes_and_warp_size_is_32() {
    let m = module();
    set_lane(abi::Lane {
        thread_idx: dim(1, 2, 3),
        block_idx: dim(4, 5, 6),
        block_dim: dim(7, 8, 9),
        grid_dim: dim(10, 11, 12),
    });
    let mut out = [0u32; 13];
    run(&m, "coords", &mut [out.as_mut_ptr() as *mut c_void]);
    assert_eq!(out, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 32]);
}

#[test]
fn shuffles_pass_mask_lane_width_and_mode_and_move_64_bit_values_low_word_first() {
    let m = module();
    let (mut d, mut f, mut l, mut i) = ([1.0f64], [1.0f32], [-1i64], [41i32]);
    run(
        &m,
        "shuffles",
        &mut [
            d.as_mut_ptr() as *mut c_void,
            f.as_mut_ptr() as *mut c_void,
            l.as_mut_ptr() as *mut c_void,
            i.as_mut_ptr() as *mut c_void,
        ],
    );
    let calls = CALLS.with(|c| c.borrow().shfl.clone());
    let (all, bfly, down, up, idx) =
        (0xffff_ffffu32, abi::SHFL_BFLY, abi::SHFL_DOWN, abi::SHFL_UP, abi::SHFL_IDX);
    assert_eq!(
        calls,
        [
            (all, 0, 1, 32, bfly),
            (all, 0x3ff0_0000, 1, 32, bfly),
            (0xffff, 0x3f80_0000, 2, 16, down),
            (all, 0xffff_ffff, 3, 32, up),
            (all, 0xffff_ffff, 3, 32, up),
            (0xff, 41, 5, 8, idx),
        ]
    );
    // The test runtime answers value + 1 for each word.
    assert_eq!(d[0].to_bits(), 0x3ff0_0001_0000_0001);
    assert_eq!(f[0].to_bits(), 0x3f80_0001);
    assert_eq!(l[0], 0);
    assert_eq!(i[0], 42);
}

#[test]
fn votes_and_barriers_reach_the_runtime_with_their_masks() {
    let m = module();
    let mut out = [9u32; 3];
    let (mut out_ptr, mut p) = (out.as_mut_ptr(), 1i32);
    run_args(
        &m,
        "votes_and_barriers",
        &mut [&mut out_ptr as *mut *mut u32 as *mut c_void, &mut p as *mut i32 as *mut c_void],
    );
    let calls = CALLS.with(|c| c.borrow().clone());
    assert_eq!(calls.syncthreads, 1);
    assert_eq!(calls.syncwarp, [0xffff_ffff, 0xf]);
    assert_eq!(
        calls.votes,
        [(0xffff_ffff, 1, abi::VOTE_ALL), (0x3, 1, abi::VOTE_ANY), (0x1, 1, abi::VOTE_BALLOT)]
    );
    assert_eq!(out, [1, 1, 1]);
}

#[test]
fn a_product_plus_a_sum_rounds_twice_unless_fmaf_is_asked_for() {
    let m = module();
    // a·a = 1 + 2^-11 + 2^-24: the 2^-24 is lost when the product is rounded.
    let a = 1.0f32 + 2f32.powi(-12);
    let mut x = [0.0f32, a, a, -(1.0 + 2f32.powi(-11)), 0.0, 0.0];
    run(&m, "unfused", &mut [x.as_mut_ptr() as *mut c_void]);
    assert_eq!(x[0], 0.0, "a*b + c was fused into one rounding");
    assert_eq!(x[4], 2f32.powi(-24), "__fmaf_rn rounds once");
    assert_eq!(x[5], x[3] + 7.0 + 3.0);
}

#[test]
fn shared_memory_is_per_os_thread_and_touch_shared_finds_this_threads_block_of_it() {
    let m = module();
    let touch = m.info.touch_shared;
    let here = touch() as usize;
    assert_ne!(here, 0);
    assert_eq!(touch() as usize, here, "the same anchor each call on one thread");
    let mut x = [5.0f32, 0.0];
    run(&m, "shared_cell", &mut [x.as_mut_ptr() as *mut c_void]);
    assert_eq!(x[1], 5.0);
    let entry = m.kernel("shared_cell").entry;
    let (there, seen) = std::thread::spawn(move || {
        // A worker thread's block starts with its own (zeroed) shared memory.
        let mut y = [0.0f32, 7.0];
        let mut py = y.as_mut_ptr();
        let mut args = [&mut py as *mut *mut f32 as *mut c_void];
        entry(args.as_mut_ptr());
        (touch() as usize, y[1])
    })
    .join()
    .unwrap();
    assert_ne!(there, here, "another thread, another block of shared memory");
    assert_eq!(seen, 0.0);
}
