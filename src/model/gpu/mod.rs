//! The model's GPU half (feature `cuda`), the twin of the CPU model beside
//! it: `GpuPart` (part.rs, with its tensor-parallel ranks in part/tp.rs), the
//! whole model on one GPU (`GpuModel`, model.rs), `gpu-check`'s whole-model
//! checks (check.rs) and `gpu-bench` (bench.rs). They are built from the
//! launchers in `kernels::cuda` and read the model's and the optimizer's
//! types; `kernels` holds kernels, launchers and twin checks only, and sits
//! below this. Also here: whether a run's configured GPUs open before it
//! starts (`check_backend`), which reads the config `kernels` must not reach.

#[cfg(feature = "cuda")]
pub mod bench;
#[cfg(feature = "cuda")]
pub mod check;
#[cfg(feature = "cuda")]
pub mod model;
#[cfg(feature = "cuda")]
pub mod part;

use crate::config::BackendKind;
use crate::kernels::BackendError;

/// Checks, before anything else runs, that the configured backend can start:
/// for "cuda", that this build has the feature and every listed GPU opens.
/// Returns the names of the distinct GPUs the run uses (none off "cuda"). Never
/// panics, with or without a driver.
pub fn check_backend(kind: BackendKind, devices: &[usize]) -> Result<Vec<String>, BackendError> {
    if kind != BackendKind::Cuda {
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
            names.push(crate::kernels::cuda::Gpu::new(d)?.name);
        }
        Ok(names)
    }
}
