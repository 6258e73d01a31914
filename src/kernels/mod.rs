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

/// Checks, before anything else runs, that the configured backend can start:
/// for "cuda", that this build has the feature and every listed GPU opens.
/// Returns the names of the distinct GPUs the run uses (none off "cuda"). Never
/// panics, with or without a driver.
pub fn check_backend(
    kind: crate::config::BackendKind,
    devices: &[usize],
) -> Result<Vec<String>, BackendError> {
    if kind != crate::config::BackendKind::Cuda {
        return Ok(vec![]);
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = devices;
        Err(BackendError::NotBuilt)
    }
    #[cfg(feature = "cuda")]
    {
        // Opened and dropped here, so a missing driver or GPU stops the run
        // before any output is written; each stage opens its own later.
        let mut ordinals = if devices.is_empty() { vec![0] } else { devices.to_vec() };
        ordinals.sort_unstable();
        ordinals.dedup();
        let mut names = vec![];
        for d in ordinals {
            names.push(cuda::Gpu::new(d)?.name);
        }
        Ok(names)
    }
}

/// The dense bf16 peak of the GPUs a run uses (one entry per device), from the
/// planner's table by name, and where the figure comes from; NaN for a GPU
/// the table does not know.
pub fn gpu_peak_flops(names: &[String]) -> (f64, String) {
    let mut total = 0.0;
    for n in names {
        let n_low = n.to_ascii_lowercase();
        match crate::plan::hardware::GPUS.iter().find(|g| n_low.contains(g.name)) {
            Some(g) => total += g.peak_flops,
            None => return (f64::NAN, format!("no bf16 peak known for {n}")),
        }
    }
    (total, format!("bf16 dense datasheet peak of {}", names.join(", ")))
}
