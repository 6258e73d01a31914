//! Streams as ordered queues on worker threads (owner: the driver helper;
//! this interface is what cublaslt and nccl use and must keep its signatures).

use crate::error::{cu, EmuError, Result};

/// Work queued on a stream: runs on the stream's worker thread, after
/// everything queued on it before; an Err is the stream's context's sticky
/// error, reported by the next call that synchronizes with it.
pub type Work = Box<dyn FnOnce() -> Result<()> + Send>;

/// Queues `work` on `stream` (a CUstream's value; 0 is the legacy default
/// stream of the current context). `label` names the work in errors.
pub fn enqueue(stream: usize, label: String, work: Work) -> Result<()> {
    let _ = (stream, work);
    Err(EmuError::new(cu::NOT_SUPPORTED, format!("{label}: streams are not built yet")))
}

/// The device a stream belongs to.
pub fn device_of(stream: usize) -> Result<usize> {
    Err(EmuError::new(cu::INVALID_HANDLE, format!("stream {stream:#x}: unknown")))
}
