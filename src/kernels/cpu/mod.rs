//! CPU kernels, one file per layer kind, in the style of llm.c: plain
//! functions whose first lines give every buffer's shape with the letters
//! B (batch), T (time), C (channels), NH (heads), HS (head size), V (vocab),
//! N (= B·T rows), OC (output channels).
//!
//! Backward functions *accumulate* (`+=`) into every gradient they produce, so
//! accumulation over microbatches needs nothing special; callers zero scratch.

pub mod adamw;
pub mod attention;
pub mod crossentropy;
pub mod ema;
pub mod embedding;
pub mod flash_attention;
pub mod gelu;
pub mod layernorm;
pub mod math;
pub mod matmul;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;
pub mod tree;

#[cfg(test)]
pub(crate) mod testutil;

/// Rows per parallel task for row-independent kernels. Work is split into
/// fixed-size chunks so the split never depends on the thread count.
pub(crate) const ROWS_PER_TASK: usize = 16;

/// Columns per parallel task in column reductions (bias and LayerNorm weight
/// gradients): each task sums its columns over all rows, in row order.
pub(crate) const COLS_PER_TASK: usize = 64;

/// A raw pointer that may cross threads. Used only where tasks write disjoint
/// regions that slices cannot express (strided per-head blocks).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// Read through a method so closures capture the whole (Send) wrapper,
    /// not its raw-pointer field.
    #[inline]
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}
