//! Per-kernel wall-clock accounting for `pipewright bench`.
//!
//! Off by default; when on, callers wrap kernel calls in `timed`. Counters are
//! process-wide atomics, so they never feed arithmetic and cannot perturb results.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Embedding,
    LayerNorm,
    Matmul,
    Attention,
    Gelu,
    Residual,
    CrossEntropy,
    AdamW,
    GradNorm,
    RmsNorm,
    Rope,
    Swiglu,
}

pub const ALL: [Kernel; 12] = [
    Kernel::Embedding,
    Kernel::LayerNorm,
    Kernel::Matmul,
    Kernel::Attention,
    Kernel::Gelu,
    Kernel::Residual,
    Kernel::CrossEntropy,
    Kernel::AdamW,
    Kernel::GradNorm,
    Kernel::RmsNorm,
    Kernel::Rope,
    Kernel::Swiglu,
];

impl Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Embedding => "embedding",
            Kernel::LayerNorm => "layernorm",
            Kernel::Matmul => "matmul",
            Kernel::Attention => "attention",
            Kernel::Gelu => "gelu",
            Kernel::Residual => "residual",
            Kernel::CrossEntropy => "crossentropy",
            Kernel::AdamW => "adamw",
            Kernel::GradNorm => "grad_norm",
            Kernel::RmsNorm => "rmsnorm",
            Kernel::Rope => "rope",
            Kernel::Swiglu => "swiglu",
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; ALL.len()] = [const { AtomicU64::new(0) }; ALL.len()];

pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn reset() {
    for n in &NANOS {
        n.store(0, Ordering::Relaxed);
    }
}

/// Seconds spent in each kernel since the last reset.
pub fn snapshot() -> Vec<(Kernel, f64)> {
    ALL.iter().map(|&k| (k, NANOS[k as usize].load(Ordering::Relaxed) as f64 * 1e-9)).collect()
}

#[inline]
pub fn timed<R>(kernel: Kernel, f: impl FnOnce() -> R) -> R {
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    let t = Instant::now();
    let r = f();
    NANOS[kernel as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    r
}
