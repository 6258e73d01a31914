//! The execution engine runs kernels as CUDA defines them, and each planted
//! bug inside a kernel is an error naming the kernel and the culprit.

mod exec_support;

use exec_support::*;
use pipewright_emu::abi::{SHFL_BFLY, SHFL_DOWN, SHFL_IDX, SHFL_UP, VOTE_ALL, VOTE_ANY, VOTE_BALLOT};
use pipewright_emu::error::cu;
use std::ffi::c_void;

const OUT: P = ("out", "float*", true);
const N: P = ("n", "int", false);

extern "C" fn iota_k(args: *mut *mut c_void) {
    let (out, n): (*mut f32, i32) = unsafe { (arg(args, 0), arg(args, 1)) };
    let i = gid();
    if i < n as usize {
        unsafe { *out.add(i) = i as f32 * 2.0 };
    }
}

#[test]
fn a_grid_of_blocks_writes_every_element_once() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let n = 1000usize;
    let buf = gpu.alloc(n * 4);
    let f = function("iota.cu", kernel("iota", iota_k, 0, &[OUT, N]));
    let (mut o, mut nn) = (buf, n as i32);
    assert_eq!(launch(f, (4, 1, 1), (256, 1, 1), 0, gpu.stream, &mut [p(&mut o), p(&mut nn)]), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::SUCCESS);
    let host: Vec<f32> = gpu.download(buf, n);
    assert!(host.iter().enumerate().all(|(i, &v)| v == i as f32 * 2.0));
}

extern "C" fn coords_k(args: *mut *mut c_void) {
    let out: *mut u32 = unsafe { arg(args, 0) };
    let l = lane();
    let block = l.block_idx.x + l.block_idx.y * l.grid_dim.x;
    let t = tid() as u32 + block * l.block_dim.x * l.block_dim.y * l.block_dim.z;
    unsafe {
        *out.add(t as usize) = l.thread_idx.x | l.thread_idx.y << 8 | l.thread_idx.z << 16 | block << 24
    };
}

#[test]
fn each_lane_sees_its_own_thread_and_block_coordinates() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let (bx, by, bz, gx, gy) = (4u32, 3u32, 2u32, 2u32, 2u32);
    let total = (bx * by * bz * gx * gy) as usize;
    let buf = gpu.alloc(total * 4);
    let f = function("coords.cu", kernel("coords", coords_k, 0, &[("out", "unsigned*", true)]));
    let mut o = buf;
    assert_eq!(launch(f, (gx, gy, 1), (bx, by, bz), 0, gpu.stream, &mut [p(&mut o)]), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::SUCCESS);
    let host: Vec<u32> = gpu.download(buf, total);
    for block in 0..gx * gy {
        for z in 0..bz {
            for y in 0..by {
                for x in 0..bx {
                    let t = (x + y * bx + z * bx * by + block * bx * by * bz) as usize;
                    assert_eq!(
                        host[t],
                        x | y << 8 | z << 16 | block << 24,
                        "thread ({x},{y},{z}) of block {block}"
                    );
                }
            }
        }
    }
}

/// A block-wide sum: shared memory, barriers and warp shuffles together.
extern "C" fn block_sum_k(args: *mut *mut c_void) {
    let (out, inp): (*mut f32, *const f32) = unsafe { (arg(args, 0), arg(args, 1)) };
    let sh = (rt().dynamic_shared)() as *mut f32;
    let t = tid();
    let mut v = unsafe { *inp.add(t) };
    for d in [16, 8, 4, 2, 1] {
        v += f32::from_bits((rt().shfl_sync)(u32::MAX, v.to_bits(), d, 32, SHFL_DOWN));
    }
    if t.is_multiple_of(32) {
        unsafe { *sh.add(t / 32) = v };
    }
    (rt().syncthreads)();
    if t == 0 {
        let warps = lane().block_dim.x as usize / 32;
        let total: f32 = (0..warps).map(|w| unsafe { *sh.add(w) }).sum();
        unsafe { *out = total };
    }
}

#[test]
fn shuffles_and_barriers_sum_a_block() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let inp: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let (d_in, d_out) = (gpu.alloc(256 * 4), gpu.alloc(4));
    gpu.upload(d_in, &inp);
    let f = function(
        "sum.cu",
        kernel("block_sum", block_sum_k, 256, &[("out", "float*", true), ("inp", "const float*", true)]),
    );
    let (mut o, mut i) = (d_out, d_in);
    assert_eq!(
        launch(f, (1, 1, 1), (256, 1, 1), 8 * 4, gpu.stream, &mut [p(&mut o), p(&mut i)]),
        cu::SUCCESS
    );
    assert_eq!(gpu.sync(), cu::SUCCESS);
    assert_eq!(gpu.download::<f32>(d_out, 1)[0], (0..256).sum::<i32>() as f32);
}

/// Every shuffle mode and width, against the PTX ISA's definition computed by hand.
extern "C" fn shfl_modes_k(args: *mut *mut c_void) {
    let out: *mut u32 = unsafe { arg(args, 0) };
    let t = tid() as u32;
    let mut k = 0;
    for width in [32, 16, 8, 1] {
        for (mode, b) in [(SHFL_IDX, 5), (SHFL_UP, 3), (SHFL_DOWN, 3), (SHFL_BFLY, 6)] {
            let v = (rt().shfl_sync)(u32::MAX, 100 + t, b, width, mode);
            unsafe { *out.add(k * 32 + t as usize) = v };
            k += 1;
        }
    }
}

#[test]
fn shuffles_follow_the_ptx_modes_and_widths() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let buf = gpu.alloc(16 * 32 * 4);
    let f = function("shfl.cu", kernel("shfl_modes", shfl_modes_k, 0, &[("out", "unsigned*", true)]));
    let mut o = buf;
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o)]), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::SUCCESS);
    let host: Vec<u32> = gpu.download(buf, 16 * 32);
    let mut k = 0;
    for width in [32u32, 16, 8, 1] {
        for (mode, b) in [(SHFL_IDX, 5u32), (SHFL_UP, 3), (SHFL_DOWN, 3), (SHFL_BFLY, 6)] {
            for lane in 0..32u32 {
                let seg = lane / width * width;
                let src = match mode {
                    SHFL_IDX => seg + b % width,
                    SHFL_UP => {
                        if lane - seg >= b {
                            lane - b
                        } else {
                            lane
                        }
                    }
                    SHFL_DOWN => {
                        if lane - seg + b < width {
                            lane + b
                        } else {
                            lane
                        }
                    }
                    // CUDA documents it: xor may read earlier segments, never later ones.
                    _ => {
                        if (lane ^ b) < seg + width {
                            lane ^ b
                        } else {
                            lane
                        }
                    }
                };
                assert_eq!(host[k * 32 + lane as usize], 100 + src, "mode {mode} width {width} lane {lane}");
            }
            k += 1;
        }
    }
}

extern "C" fn vote_k(args: *mut *mut c_void) {
    let out: *mut u32 = unsafe { arg(args, 0) };
    let t = tid() as u32;
    let ballot = (rt().vote_sync)(u32::MAX, t.is_multiple_of(3) as i32, VOTE_BALLOT);
    let all = (rt().vote_sync)(u32::MAX, (t < 40) as i32, VOTE_ALL);
    let any = (rt().vote_sync)(u32::MAX, (t == 7) as i32, VOTE_ANY);
    let none = (rt().vote_sync)(u32::MAX, 0, VOTE_ANY);
    if t == 0 {
        unsafe { *out = ballot };
        unsafe { *out.add(1) = all | any << 1 | none << 2 };
    }
}

#[test]
fn votes_see_every_member_predicate() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let buf = gpu.alloc(8);
    let f = function("vote.cu", kernel("vote", vote_k, 0, &[("out", "unsigned*", true)]));
    let mut o = buf;
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o)]), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::SUCCESS);
    let host: Vec<u32> = gpu.download(buf, 2);
    let want = (0..32).filter(|t| t % 3 == 0).fold(0u32, |m, t| m | 1 << t);
    assert_eq!(host, vec![want, 0b011]);
}

// ---------------------------------------------------------------------------
// Planted bugs inside kernels: each is the launch's (sticky) error.

extern "C" fn skip_barrier_k(_args: *mut *mut c_void) {
    if tid() == 63 {
        return;
    }
    (rt().syncthreads)();
}

#[test]
fn a_syncthreads_skipped_by_an_early_return_is_named() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("early.cu", kernel("early_return", skip_barrier_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (64, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    let code = gpu.sync();
    assert_error(
        code,
        cu::LAUNCH_FAILED,
        &["early_return", "__syncthreads", "thread 63 exited", "block (0, 0, 0)"],
    );
}

extern "C" fn shfl_skipped_k(_args: *mut *mut c_void) {
    if tid() == 5 {
        return;
    }
    (rt().shfl_sync)(u32::MAX, 1, 0, 32, SHFL_IDX);
}

#[test]
fn a_shuffle_not_reached_by_every_lane_of_its_mask_is_named() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("shfl_skip.cu", kernel("shfl_skip", shfl_skipped_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    assert_error(gpu.sync(), cu::LAUNCH_FAILED, &["shfl_skip", "thread 5 exited", "0xffffffff", "__shfl"]);
}

extern "C" fn shfl_outside_mask_k(_args: *mut *mut c_void) {
    // Lanes 0..16 shuffle among themselves but read from lane + 16.
    if tid() < 16 {
        (rt().shfl_sync)(0xFFFF, 1, 16, 32, SHFL_DOWN);
    }
}

#[test]
fn a_shuffle_reading_a_lane_outside_its_mask_is_named() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("shfl_mask.cu", kernel("shfl_mask", shfl_outside_mask_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    assert_error(
        gpu.sync(),
        cu::LAUNCH_FAILED,
        &["shfl_mask", "thread 0 shuffles from lane 16", "0x0000ffff"],
    );
}

extern "C" fn mixed_collectives_k(_args: *mut *mut c_void) {
    if tid().is_multiple_of(2) {
        (rt().syncwarp)(u32::MAX);
    } else {
        (rt().vote_sync)(u32::MAX, 1, VOTE_ANY);
    }
}

#[test]
fn lanes_of_one_mask_at_different_collectives_are_named() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("mixed.cu", kernel("mixed", mixed_collectives_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    assert_error(
        gpu.sync(),
        cu::LAUNCH_FAILED,
        &["mixed", "thread 1 reached __all/__any/__ballot_sync", "__syncwarp"],
    );
}

extern "C" fn barrier_vs_syncwarp_k(_args: *mut *mut c_void) {
    if tid() < 32 {
        (rt().syncthreads)();
    } else {
        (rt().syncwarp)(u32::MAX);
        (rt().syncwarp)(u32::MAX);
        (rt().syncthreads)();
        (rt().syncwarp)(u32::MAX);
    }
}

#[test]
fn syncwarps_of_one_warp_between_block_barriers_are_legal() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("mismatch.cu", kernel("mismatch", barrier_vs_syncwarp_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (64, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    // Lanes 32..64 pass their syncwarps, meet lanes 0..32 at __syncthreads,
    // then wait at a syncwarp that warp 1 completes: no violation.
    assert_eq!(gpu.sync(), cu::SUCCESS);
}

extern "C" fn deadlock_k(_args: *mut *mut c_void) {
    if tid() < 32 {
        (rt().syncthreads)();
    } else {
        (rt().syncwarp)(0xFFFF_FFFF);
        if tid() != 40 {
            (rt().syncwarp)(0xFFFF_FFFF);
        } else {
            (rt().syncthreads)();
        }
        (rt().syncthreads)();
    }
}

#[test]
fn a_barrier_nobody_can_finish_names_where_each_thread_waits() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("deadlock.cu", kernel("deadlock", deadlock_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (64, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    assert_error(
        gpu.sync(),
        cu::LAUNCH_FAILED,
        &[
            "deadlock",
            "wait for each other forever",
            "waiting at __syncthreads: 0..=31, 40",
            "__syncwarp",
            "members not arrived: 40",
        ],
    );
}

extern "C" fn read_past_end_k(args: *mut *mut c_void) {
    let (out, x): (*mut f32, *const f32) = unsafe { (arg(args, 0), arg(args, 1)) };
    let i = gid();
    // The bug: thread i reads x[i + 1]; the last one reads past the end.
    unsafe { *out.add(i) = std::ptr::read_volatile(x.add(i + 1)) };
}

#[test]
fn a_read_one_element_past_an_allocation_faults_and_names_the_argument() {
    let _s = serial();
    let gpu = Gpu::new(0);
    // 1024 floats fill whole pages: the element past the end is on the guard page.
    let (out, x) = (gpu.alloc(1024 * 4), gpu.alloc(1024 * 4));
    let f = function(
        "shift.cu",
        kernel("shift_left", read_past_end_k, 0, &[("out", "float*", true), ("x", "const float*", true)]),
    );
    let (mut o, mut xx) = (out, x);
    assert_eq!(launch(f, (4, 1, 1), (256, 1, 1), 0, gpu.stream, &mut [p(&mut o), p(&mut xx)]), cu::SUCCESS);
    assert_error(
        gpu.sync(),
        cu::ILLEGAL_ADDRESS,
        &[
            "shift_left",
            "block (3, 0, 0)",
            "thread 255",
            "1 byte(s) past the end",
            "argument `x` (const float*)",
        ],
    );
}

extern "C" fn write_past_end_k(args: *mut *mut c_void) {
    let (out, n): (*mut f32, i32) = unsafe { (arg(args, 0), arg(args, 1)) };
    let i = gid();
    // The bug: `<=` instead of `<`.
    if i <= n as usize {
        unsafe { *out.add(i) = 1.0 };
    }
}

#[test]
fn a_write_into_the_alignment_slack_is_caught_by_the_canary() {
    let _s = serial();
    let gpu = Gpu::new(0);
    // 1000 bytes: the 24 bytes up to the 256-byte boundary are slack before the guard page.
    let out = gpu.alloc(1000);
    let f = function("fill.cu", kernel("fill_le", write_past_end_k, 0, &[OUT, N]));
    let (mut o, mut n) = (out, 250i32);
    assert_eq!(launch(f, (1, 1, 1), (256, 1, 1), 0, gpu.stream, &mut [p(&mut o), p(&mut n)]), cu::SUCCESS);
    assert_error(
        gpu.sync(),
        cu::ILLEGAL_ADDRESS,
        &["fill_le", "argument `out`", "1000-byte allocation", "past its end"],
    );
}

extern "C" fn null_deref_k(args: *mut *mut c_void) {
    let out: *mut f32 = unsafe { arg(args, 0) };
    unsafe { std::ptr::write_volatile(out.add(gid()), 1.0) };
}

#[test]
fn a_null_pointer_write_in_a_kernel_is_an_illegal_address() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("null.cu", kernel("null_write", null_deref_k, 0, &[OUT]));
    let mut o = 0u64;
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o)]), cu::SUCCESS);
    assert_error(
        gpu.sync(),
        cu::ILLEGAL_ADDRESS,
        &["null_write", "thread 0", "illegal address", "the null pointer"],
    );
}

extern "C" fn trap_k(_args: *mut *mut c_void) {
    if tid() == 9 {
        (rt().trap)(c"assertion `i < n` failed".as_ptr());
    }
}

#[test]
fn a_device_assert_names_the_lane_and_the_assertion() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("assert.cu", kernel("asserting", trap_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    assert_error(gpu.sync(), cu::LAUNCH_FAILED, &["asserting", "thread 9", "assertion `i < n` failed"]);
}

#[test]
fn after_a_kernel_fails_every_later_call_returns_the_sticky_error() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("assert2.cu", kernel("asserting_again", trap_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::LAUNCH_FAILED);
    // The next launch and allocation are refused with the same error.
    assert_error(
        launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut []),
        cu::LAUNCH_FAILED,
        &["failed earlier", "asserting_again"],
    );
    let mut ptr = 0u64;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { pipewright_emu::driver::cuMemAlloc_v2(&mut ptr, 16) }, cu::LAUNCH_FAILED);
}

extern "C" fn read_shared_unwritten_k(args: *mut *mut c_void) {
    let out: *mut u32 = unsafe { arg(args, 0) };
    let sh = (rt().dynamic_shared)() as *const u32;
    if !(sh as usize).is_multiple_of(128) {
        (rt().trap)(c"dynamic shared memory is not 128-byte aligned".as_ptr());
    }
    unsafe { *out.add(tid()) = *sh.add(tid()) };
}

#[test]
fn dynamic_shared_memory_is_aligned_and_poison_until_written() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let out = gpu.alloc(64 * 4);
    let f = function(
        "shared.cu",
        kernel("read_unwritten", read_shared_unwritten_k, 0, &[("out", "unsigned*", true)]),
    );
    let mut o = out;
    assert_eq!(launch(f, (1, 1, 1), (64, 1, 1), 64 * 4, gpu.stream, &mut [p(&mut o)]), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::SUCCESS);
    let host: Vec<u32> = gpu.download(out, 64);
    // 0xFFFFFFFF: a NaN as f32, -1 as int.
    assert!(host.iter().all(|&v| v == u32::MAX && f32::from_bits(v).is_nan()), "{host:x?}");
}

// ---------------------------------------------------------------------------
// mma.sync.m16n8k16 against a plain matrix product.

fn bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

extern "C" fn mma_k(args: *mut *mut c_void) {
    let (d, a, b, c): (*mut f32, *const u32, *const u32, *const f32) =
        unsafe { (arg(args, 0), arg(args, 1), arg(args, 2), arg(args, 3)) };
    let l = tid();
    let mut out = [0f32; 4];
    let (fa, fb, fc) = unsafe { (a.add(l * 4), b.add(l * 2), c.add(l * 4)) };
    (rt().mma_m16n8k16_f32_bf16)(out.as_mut_ptr(), fa, fb, fc);
    for (i, v) in out.iter().enumerate() {
        unsafe { *d.add(l * 4 + i) = *v };
    }
}

#[test]
fn mma_m16n8k16_computes_a_times_b_plus_c_in_the_ptx_fragment_layout() {
    let _s = serial();
    let gpu = Gpu::new(0);
    // A 16×16, B 16×8, C 16×8, small integers and halves: exact in bf16 and f32.
    let a: Vec<Vec<f32>> =
        (0..16).map(|r| (0..16).map(|k| ((r * 3 + k * 5) % 7) as f32 - 3.0).collect()).collect();
    let b: Vec<Vec<f32>> =
        (0..16).map(|k| (0..8).map(|n| ((k * 2 + n * 3) % 5) as f32 * 0.5 - 1.0).collect()).collect();
    let c: Vec<Vec<f32>> = (0..16).map(|r| (0..8).map(|n| (r * 8 + n) as f32 * 0.25).collect()).collect();
    // Fragments per lane as the PTX ISA lays them out (groupID g = lane / 4, t = lane % 4).
    let (mut fa, mut fb, mut fc) = (vec![0u32; 32 * 4], vec![0u32; 32 * 2], vec![0f32; 32 * 4]);
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        let a_at = |i: usize| a[g + 8 * ((i / 2) % 2)][2 * t + i % 2 + 8 * (i / 4)];
        for reg in 0..4 {
            fa[lane * 4 + reg] = bf16(a_at(2 * reg)) as u32 | (bf16(a_at(2 * reg + 1)) as u32) << 16;
        }
        let b_at = |i: usize| b[2 * t + i % 2 + 8 * (i / 2)][g];
        for reg in 0..2 {
            fb[lane * 2 + reg] = bf16(b_at(2 * reg)) as u32 | (bf16(b_at(2 * reg + 1)) as u32) << 16;
        }
        for i in 0..4 {
            fc[lane * 4 + i] = c[g + 8 * (i / 2)][2 * t + i % 2];
        }
    }
    let (dd, da, db, dc) = (gpu.alloc(32 * 16), gpu.alloc(32 * 16), gpu.alloc(32 * 8), gpu.alloc(32 * 16));
    gpu.upload(da, &fa);
    gpu.upload(db, &fb);
    gpu.upload(dc, &fc);
    let f = function(
        "mma.cu",
        kernel(
            "mma",
            mma_k,
            0,
            &[
                ("d", "float*", true),
                ("a", "const unsigned*", true),
                ("b", "const unsigned*", true),
                ("c", "const float*", true),
            ],
        ),
    );
    let (mut d0, mut a0, mut b0, mut c0) = (dd, da, db, dc);
    let mut args = [p(&mut d0), p(&mut a0), p(&mut b0), p(&mut c0)];
    assert_eq!(launch(f, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut args), cu::SUCCESS);
    assert_eq!(gpu.sync(), cu::SUCCESS);
    let d: Vec<f32> = gpu.download(dd, 32 * 4);
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        for i in 0..4 {
            let (row, col) = (g + 8 * (i / 2), 2 * t + i % 2);
            let want: f32 = (0..16).map(|k| a[row][k] * b[k][col]).sum::<f32>() + c[row][col];
            assert_eq!(d[lane * 4 + i], want, "D[{row}][{col}] (lane {lane}, d{i})");
        }
    }
}

extern "C" fn mma_partial_k(_args: *mut *mut c_void) {
    let mut d = [0f32; 4];
    (rt().mma_m16n8k16_f32_bf16)(d.as_mut_ptr(), [0u32; 4].as_ptr(), [0u32; 2].as_ptr(), [0f32; 4].as_ptr());
}

#[test]
fn mma_in_a_block_smaller_than_a_warp_is_refused() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let f = function("mma16.cu", kernel("mma16", mma_partial_k, 0, &[]));
    assert_eq!(launch(f, (1, 1, 1), (16, 1, 1), 0, gpu.stream, &mut []), cu::SUCCESS);
    assert_error(gpu.sync(), cu::LAUNCH_FAILED, &["mma16", "all 32 lanes", "has 16"]);
}

extern "C" fn chase_k(args: *mut *mut c_void) {
    // The table holds a pointer the kernel follows (a launch cannot check it).
    let table: *const *const f32 = unsafe { arg(args, 0) };
    let out: *mut f32 = unsafe { arg(args, 1) };
    unsafe { *out = std::ptr::read_volatile(*table) };
}

#[test]
fn a_kernel_following_a_pointer_to_freed_memory_faults_naming_the_freed_allocation() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let (victim, table, out) = (gpu.alloc(4096), gpu.alloc(8), gpu.alloc(4));
    gpu.upload(table, &[victim]);
    assert_eq!(gpu.sync(), cu::SUCCESS);
    // SAFETY: our own live allocation.
    assert_eq!(unsafe { pipewright_emu::driver::cuMemFree_v2(victim) }, cu::SUCCESS);
    let f = function(
        "chase.cu",
        kernel("chase", chase_k, 0, &[("table", "const float* const*", true), ("out", "float*", true)]),
    );
    let (mut t, mut o) = (table, out);
    assert_eq!(launch(f, (1, 1, 1), (1, 1, 1), 0, gpu.stream, &mut [p(&mut t), p(&mut o)]), cu::SUCCESS);
    assert_error(
        gpu.sync(),
        cu::ILLEGAL_ADDRESS,
        &["chase", "thread 0", "in the freed 4096-byte allocation"],
    );
}

#[inline(never)]
fn deep(n: usize) -> u64 {
    let frame = std::hint::black_box([n as u8; 4096]);
    if n == 0 {
        return 0;
    }
    deep(n - 1) + frame[n % 4096] as u64
}

extern "C" fn recurse_k(args: *mut *mut c_void) {
    let out: *mut u64 = unsafe { arg(args, 0) };
    unsafe { *out = deep(1000) };
}

#[test]
fn a_stack_overflow_in_a_kernel_is_named_as_one() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let out = gpu.alloc(8);
    let f = function("deep.cu", kernel("recurse", recurse_k, 0, &[("out", "unsigned long*", true)]));
    let mut o = out;
    assert_eq!(launch(f, (1, 1, 1), (1, 1, 1), 0, gpu.stream, &mut [p(&mut o)]), cu::SUCCESS);
    assert_error(
        gpu.sync(),
        cu::LAUNCH_OUT_OF_RESOURCES,
        &["recurse", "thread 0", "stack overflow", "256 KiB"],
    );
}
