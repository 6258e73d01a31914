//! Contexts and the calling thread's current one (owner: the driver helper;
//! this interface is what cublaslt and nccl use and must keep its signatures).

use crate::error::{cu, EmuError, Result};

/// The device of the context bound to the calling thread.
pub fn current_device() -> Result<usize> {
    Err(EmuError::new(cu::INVALID_CONTEXT, "no context is bound to this thread"))
}
