//! cublasLtMatmul on the emulated device: operands in device memory, the
//! product queued on the stream after the uploads before it, D's padding
//! untouched, and the pointer checks against real allocations (another
//! GPU's memory, a handle of another device, a short workspace).

use half::bf16;
use pipewright_emu::cublaslt::problem::{
    compute, compute_type as ct, data_type as dt, status, LayoutSpec, OpSpec, Problem,
};
use pipewright_emu::cublaslt::*;
use pipewright_emu::driver::*;
use pipewright_emu::error::cu;
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;
use std::sync::{Mutex, MutexGuard, Once};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn message(code: u32) -> String {
    unsafe { CStr::from_ptr(cublasLtGetStatusString(code)) }.to_string_lossy().into_owned()
}

struct Gpu {
    ctx: Handle,
    stream: Handle,
}

impl Gpu {
    fn new(ordinal: i32) -> Gpu {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            std::env::set_var("PW_EMU_GPUS", "2");
            assert_eq!(unsafe { cuInit(0) }, cu::SUCCESS);
        });
        let (mut ctx, mut stream): (Handle, Handle) = (null_mut(), null_mut());
        unsafe {
            assert_eq!(cuCtxCreate_v2(&mut ctx, 0, ordinal), cu::SUCCESS);
            assert_eq!(cuCtxSetCurrent(ctx), cu::SUCCESS);
            assert_eq!(cuStreamCreate(&mut stream, 1), cu::SUCCESS);
        }
        Gpu { ctx, stream }
    }

    fn bind(&self) {
        assert_eq!(unsafe { cuCtxSetCurrent(self.ctx) }, cu::SUCCESS);
    }

    fn alloc(&self, bytes: usize) -> u64 {
        self.bind();
        let mut p = 0u64;
        assert_eq!(unsafe { cuMemAlloc_v2(&mut p, bytes) }, cu::SUCCESS);
        p
    }

    fn upload(&self, dst: u64, host: &[u8]) {
        let r = unsafe { cuMemcpyHtoDAsync_v2(dst, host.as_ptr() as *const c_void, host.len(), self.stream) };
        assert_eq!(r, cu::SUCCESS);
    }

    fn download(&self, src: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let r = unsafe { cuMemcpyDtoHAsync_v2(out.as_mut_ptr() as *mut c_void, src, len, self.stream) };
        assert_eq!(r, cu::SUCCESS);
        assert_eq!(unsafe { cuStreamSynchronize(self.stream) }, cu::SUCCESS);
        out
    }
}

unsafe fn set<T>(
    f: unsafe extern "C" fn(*mut c_void, u32, *const c_void, usize) -> u32,
    obj: *mut c_void,
    attr: u32,
    v: T,
) -> u32 {
    f(obj, attr, &v as *const T as *const c_void, std::mem::size_of::<T>())
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect()
}

/// The backend's forward product as cuBLASLt sees it, bf16 with bias:
/// m = 24, n = 5, k = 16, D a 24-column block of a row-major matrix 40 wide
/// (ld 40), accumulated in place (beta 1).
struct Forward {
    handle: *mut c_void,
    desc: *mut c_void,
    a: *mut c_void,
    b: *mut c_void,
    c: *mut c_void,
    algo: HeuristicResult,
}

const M: usize = 24;
const N: usize = 5;
const K: usize = 16;
const LDD: usize = 40;

unsafe fn forward(bias_ptr: u64, max_workspace: u64) -> Forward {
    let mut handle = null_mut();
    assert_eq!(cublasLtCreate(&mut handle), 0);
    let mut desc = null_mut();
    assert_eq!(cublasLtMatmulDescCreate(&mut desc, ct::C32F, dt::R_32F), 0);
    assert_eq!(set(cublasLtMatmulDescSetAttribute, desc, 7, 4u32), 0);
    assert_eq!(set(cublasLtMatmulDescSetAttribute, desc, 26, dt::R_16BF), 0);
    assert_eq!(set(cublasLtMatmulDescSetAttribute, desc, 8, bias_ptr), 0);
    let (mut a, mut b, mut c) = (null_mut(), null_mut(), null_mut());
    assert_eq!(cublasLtMatrixLayoutCreate(&mut a, dt::R_16BF, M as u64, K as u64, M as i64), 0);
    assert_eq!(cublasLtMatrixLayoutCreate(&mut b, dt::R_16BF, K as u64, N as u64, K as i64), 0);
    assert_eq!(cublasLtMatrixLayoutCreate(&mut c, dt::R_16BF, M as u64, N as u64, LDD as i64), 0);
    let mut pref = null_mut();
    assert_eq!(cublasLtMatmulPreferenceCreate(&mut pref), 0);
    assert_eq!(set(cublasLtMatmulPreferenceSetAttribute, pref, 1, max_workspace), 0);
    let mut algo =
        HeuristicResult { algo: [0; 8], workspace_size: 0, state: 0, waves_count: 0.0, reserved: [0; 4] };
    let mut count = 0;
    let r = cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, pref, 1, &mut algo, &mut count);
    assert_eq!((r, count), (0, 1), "{}", message(r));
    Forward { handle, desc, a, b, c, algo }
}

unsafe fn run(f: &Forward, a: u64, b: u64, d: u64, ws: u64, ws_bytes: usize, stream: Handle) -> u32 {
    let (alpha, beta) = (1f32, 1f32);
    cublasLtMatmul(
        f.handle,
        f.desc,
        &alpha as *const f32 as *const c_void,
        a as *const c_void,
        f.a,
        b as *const c_void,
        f.b,
        &beta as *const f32 as *const c_void,
        d as *const c_void,
        f.c,
        d as *mut c_void,
        f.c,
        &f.algo.algo,
        ws as *mut c_void,
        ws_bytes,
        stream,
    )
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.37 + seed).sin() * 2.0).collect()
}

#[test]
fn a_queued_product_equals_the_pure_function_on_the_same_bytes_and_keeps_ds_padding() {
    let _g = serial();
    let gpu = Gpu::new(0);
    let (a_h, b_h) = (bytes_of(&values(M * K, 0.1)), bytes_of(&values(K * N, 0.7)));
    let bias_h = bytes_of(&values(M, 1.3));
    let d_len = (N - 1) * LDD + M;
    let d_h = bytes_of(&values(d_len, 2.9));
    let (a, b, d, bias, ws) = (
        gpu.alloc(a_h.len()),
        gpu.alloc(b_h.len()),
        gpu.alloc(d_h.len()),
        gpu.alloc(bias_h.len()),
        gpu.alloc(1 << 16),
    );
    gpu.upload(a, &a_h);
    gpu.upload(b, &b_h);
    gpu.upload(d, &d_h);
    gpu.upload(bias, &bias_h);
    unsafe {
        let f = forward(bias, 1 << 16);
        assert_eq!(f.algo.workspace_size, M * N * 4);
        let r = run(&f, a, b, d, ws, 1 << 16, gpu.stream);
        assert_eq!(r, status::SUCCESS, "{}", message(r));
    }
    let got = gpu.download(d, d_h.len());
    let l = |rows, cols, ld| LayoutSpec { data_type: dt::R_16BF, rows, cols, ld };
    let op = OpSpec {
        compute_type: ct::C32F,
        scale_type: dt::R_32F,
        trans_a: false,
        trans_b: false,
        bias_type: Some(-1),
    };
    let (la, lb, lc) =
        (l(M as u64, K as u64, M as i64), l(K as u64, N as u64, K as i64), l(M as u64, N as u64, LDD as i64));
    let p = Problem::new("test", &op, [&la, &lb, &lc, &lc]).unwrap();
    let mut want = d_h.clone();
    compute(&p, 1.0, 1.0, &a_h, &b_h, Some(&d_h), Some(&bias_h), &mut want).unwrap();
    assert_eq!(got, want);
    // The padding rows M..LDD of each column kept their bytes.
    assert_eq!(&got[M * 2..LDD * 2], &d_h[M * 2..LDD * 2]);
}

#[test]
fn another_gpus_operand_is_refused_naming_it() {
    let _g = serial();
    let (g0, g1) = (Gpu::new(0), Gpu::new(1));
    let foreign = g1.alloc(4096);
    let (a, d, bias) = (g0.alloc(4096), g0.alloc(4096), g0.alloc(256));
    g0.bind();
    unsafe {
        let f = forward(bias, 0);
        let r = run(&f, a, foreign, d, 0, 0, g0.stream);
        assert_eq!(r, status::INVALID_VALUE);
        let msg = message(r);
        assert!(msg.contains("cublasLtMatmul: B") && msg.contains("GPU 1"), "{msg}");
    }
}

#[test]
fn a_handle_used_with_another_devices_stream_is_refused() {
    let _g = serial();
    let (g0, g1) = (Gpu::new(0), Gpu::new(1));
    g0.bind();
    let f = unsafe { forward(0x1000, 0) };
    let (a, b, d) = (g1.alloc(4096), g1.alloc(4096), g1.alloc(4096));
    let r = unsafe { run(&f, a, b, d, 0, 0, g1.stream) };
    assert_eq!(r, status::INVALID_VALUE);
    assert!(
        message(r).contains("the handle belongs to device 0 but the stream to device 1"),
        "{}",
        message(r)
    );
}

#[test]
fn a_workspace_allocation_smaller_than_claimed_is_refused() {
    let _g = serial();
    let gpu = Gpu::new(0);
    let (a, b, d, bias, ws) =
        (gpu.alloc(4096), gpu.alloc(4096), gpu.alloc(4096), gpu.alloc(256), gpu.alloc(256));
    unsafe {
        let f = forward(bias, 1 << 16);
        // The heuristic asked for M·N·4 = 480 bytes; the caller claims 1024 of a 256-byte buffer.
        let r = run(&f, a, b, d, ws, 1024, gpu.stream);
        assert_eq!(r, status::INVALID_VALUE);
        assert!(message(r).contains("cublasLtMatmul: workspace"), "{}", message(r));
    }
}

#[test]
fn the_legacy_default_stream_runs_the_product_on_the_current_contexts_device() {
    let _g = serial();
    let gpu = Gpu::new(1);
    let (a_h, b_h, bias_h) =
        (bytes_of(&values(M * K, 0.3)), bytes_of(&values(K * N, 0.9)), bytes_of(&values(M, 0.2)));
    let d_h = bytes_of(&values((N - 1) * LDD + M, 1.1));
    let (a, b, d, bias) =
        (gpu.alloc(a_h.len()), gpu.alloc(b_h.len()), gpu.alloc(d_h.len()), gpu.alloc(bias_h.len()));
    for (dst, src) in [(a, &a_h), (b, &b_h), (d, &d_h), (bias, &bias_h)] {
        gpu.upload(dst, src);
    }
    assert_eq!(unsafe { cuStreamSynchronize(gpu.stream) }, cu::SUCCESS);
    unsafe {
        let f = forward(bias, 0);
        let r = run(&f, a, b, d, 0, 0, null_mut());
        assert_eq!(r, status::SUCCESS, "{}", message(r));
        assert_eq!(cuCtxSynchronize(), cu::SUCCESS);
    }
    let got = gpu.download(d, d_h.len());
    let l = |rows: usize, cols: usize, ld: usize| LayoutSpec {
        data_type: dt::R_16BF,
        rows: rows as u64,
        cols: cols as u64,
        ld: ld as i64,
    };
    let op = OpSpec {
        compute_type: ct::C32F,
        scale_type: dt::R_32F,
        trans_a: false,
        trans_b: false,
        bias_type: Some(-1),
    };
    let p = Problem::new("test", &op, [&l(M, K, M), &l(K, N, K), &l(M, N, LDD), &l(M, N, LDD)]).unwrap();
    let mut want = d_h.clone();
    compute(&p, 1.0, 1.0, &a_h, &b_h, Some(&d_h), Some(&bias_h), &mut want).unwrap();
    assert_eq!(got, want);
}
