//! Helpers for kernel tests: seeded inputs, thread pools of a given size, and
//! central finite differences in f64.

use crate::rng::{Purpose, Rng};

pub fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed, Purpose::Test, &[n as u64]);
    (0..n).map(|_| r.normal() as f32).collect()
}

/// The same values in f64, for references computed in f64.
pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

pub fn with_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

/// Max abs difference relative to the reference's largest magnitude.
pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-12);
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

pub fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    let e = rel_err(got, want);
    assert!(e < tol, "relative error {e:e} >= {tol:e}");
}

/// Checks analytic gradients against central differences of `loss`, evaluated in
/// f64 at the same (f32-representable) point. The error of each tensor is its
/// largest absolute difference over its largest numeric gradient.
pub fn check_grads(params: &[Vec<f32>], grads: &[Vec<f32>], loss: impl Fn(&[Vec<f64>]) -> f64, tol: f64) {
    let mut p: Vec<Vec<f64>> = params.iter().map(|t| t.iter().map(|&x| x as f64).collect()).collect();
    for (ti, g) in grads.iter().enumerate() {
        assert_eq!(g.len(), p[ti].len());
        let mut numeric = vec![0.0f64; g.len()];
        for i in 0..g.len() {
            let x = p[ti][i];
            let h = 1e-6 * x.abs().max(1.0);
            p[ti][i] = x + h;
            let up = loss(&p);
            p[ti][i] = x - h;
            let down = loss(&p);
            p[ti][i] = x;
            numeric[i] = (up - down) / (2.0 * h);
        }
        let e = rel_err(g, &numeric);
        assert!(e < tol, "tensor {ti}: relative error {e:e} >= {tol:e}");
    }
}

/// The bits of `x`, so results compare exactly (NaN equal to itself, −0 ≠ +0).
pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `f` on pools of 1, 2 and 3 threads and asserts every result equals the
/// one-thread result: kernels split work into fixed tasks, never by thread.
pub fn assert_thread_count_independent<T: PartialEq + std::fmt::Debug + Send>(f: impl Fn() -> T + Sync) {
    let one = with_threads(1, &f);
    for t in [2, 3] {
        let other = with_threads(t, &f);
        assert!(other == one, "{t} threads give other bits than 1 thread");
    }
}

/// Counts every allocation per thread, split into those made inside a `gemm`
/// call and the rest (ours). The counters are const-initialised thread-locals
/// without destructors, so counting never allocates.
pub struct CountingAlloc;

thread_local! {
    static OURS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static GEMMS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn note_allocation() {
    let counter = if super::matmul::in_gemm() { &GEMMS } else { &OURS };
    let _ = counter.try_with(|c| c.set(c.get() + 1));
}

unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        note_allocation();
        std::alloc::System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        note_allocation();
        std::alloc::System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        note_allocation();
        std::alloc::System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        std::alloc::System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static COUNTING: CountingAlloc = CountingAlloc;

/// (ours, gemm's): allocations this thread has made so far.
pub fn allocations_on_this_thread() -> (u64, u64) {
    (OURS.with(|c| c.get()), GEMMS.with(|c| c.get()))
}
