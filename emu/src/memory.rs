//! Device memory (owner: the driver helper; this interface is what cublaslt
//! and nccl use and must keep its signatures).

use crate::error::{cu, EmuError, Result};

/// A live device allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub base: u64,
    pub size: u64,
    pub device: usize,
}

/// The live allocation holding `ptr`, if any.
pub fn find(ptr: u64) -> Option<Allocation> {
    let _ = ptr;
    None
}

/// Checks that `[ptr, ptr + bytes)` lies in one live allocation of `device`;
/// the error names `what` (e.g. "cublasLtMatmul: A").
pub fn check_range(ptr: u64, bytes: u64, device: usize, what: &str) -> Result<Allocation> {
    let _ = (bytes, device);
    Err(EmuError::new(cu::ILLEGAL_ADDRESS, format!("{what}: {ptr:#x} is in no live device allocation")))
}
