//! Compute kernels. `cpu/` is always built and is the reference every other
//! backend is checked against. Kernels never allocate and never decide how
//! many threads to use: they run on the rayon pool the caller installed, and
//! split work so that every output element is computed in one fixed order,
//! whatever the thread count.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod profile;

/// Why a configured backend cannot start here.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("backend.kind = \"cuda\": built without the cuda feature: rebuild with --features cuda")]
    NotBuilt,
    // No #[from]: it would also make the CUDA error the source, printed twice.
    #[cfg(feature = "cuda")]
    #[error("backend.kind = \"cuda\": {0}")]
    Cuda(cuda::CudaError),
}

#[cfg(feature = "cuda")]
impl From<cuda::CudaError> for BackendError {
    fn from(e: cuda::CudaError) -> Self {
        BackendError::Cuda(e)
    }
}
