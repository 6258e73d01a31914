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
    #[error(
        "backend.kind = \"cuda\": GPU {0} is there, but pipeline stages do not run on GPUs yet \
         (issue 7 is open); `pipewright gpu-check` checks the kernels on it"
    )]
    StagesNotOnGpus(String),
}

#[cfg(feature = "cuda")]
impl From<cuda::CudaError> for BackendError {
    fn from(e: cuda::CudaError) -> Self {
        BackendError::Cuda(e)
    }
}

/// Checks, before anything else runs, that the configured backend can start:
/// for "cuda", that this build has the feature and every listed GPU opens.
/// Never panics, with or without a driver.
pub fn check_backend(kind: &str, devices: &[usize]) -> Result<(), BackendError> {
    if kind != "cuda" {
        return Ok(());
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = devices;
        Err(BackendError::NotBuilt)
    }
    #[cfg(feature = "cuda")]
    {
        let mut names = vec![];
        for &d in if devices.is_empty() { &[0][..] } else { devices } {
            let gpu = cuda::Gpu::new(d)?;
            names.push(format!("{d} ({})", gpu.name));
        }
        Err(BackendError::StagesNotOnGpus(names.join(", ")))
    }
}
