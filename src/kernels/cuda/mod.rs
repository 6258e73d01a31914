//! The CUDA backend (feature `cuda`): launchers for the kernels in `kernels/*.cu`,
//! named like their CPU twins in `kernels/cpu`, and cuBLASLt matrix products.
//!
//! Storage is bf16 (`Bf16`) or f32 (the test path), chosen per call by the
//! element type; arithmetic and every reduction are f32 and run in a fixed
//! order (no atomics), so a GPU run repeats bit for bit. Launchers check shapes
//! and return `CudaError`, never panic. Nothing here touches the driver before
//! `Gpu::new` has checked that the driver library can be loaded.

pub mod adamw;
pub mod attention;
pub mod cast;
pub mod check;
pub mod counts;
pub mod crossentropy;
pub mod device;
pub mod ema;
pub mod embedding;
pub mod gelu;
pub mod layernorm;
pub mod matmul;
pub mod nccl;
pub mod nccl_lib;
pub mod nvrtc;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;
pub mod transfer;
pub mod tree;

pub use device::{DeviceBuffer, Gpu};

/// Errors at the CUDA backend's border.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver on this machine (libcuda.so could not be loaded): backend.kind = \"cuda\" needs an NVIDIA GPU and its driver")]
    NoDriver,
    #[error("the CUDA driver sees no GPU with ordinal {ordinal} ({count} present)")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("NVRTC could not be loaded (libnvrtc.so.13 or libnvrtc.so.12): install the CUDA toolkit or PyPI's nvidia-cuda-nvrtc and put its lib directory on LD_LIBRARY_PATH")]
    NoNvrtc,
    #[error(
        "cuBLASLt could not be loaded (libcublasLt.so.13 or .so.12): put its directory on LD_LIBRARY_PATH"
    )]
    NoCublasLt,
    // No #[from]: it would also make the driver error the source, printed twice.
    #[error("CUDA driver: {0}")]
    Driver(cudarc::driver::DriverError),
    #[error("NVRTC: {0:?}")]
    Nvrtc(cudarc::nvrtc::result::NvrtcError),
    #[error("NVRTC compiling kernels/{file}.cu for {arch}:\n{log}")]
    Compile { file: String, arch: String, log: String },
    /// What was tried and what to do (`nccl_lib::not_found`).
    #[error("NCCL could not be loaded: {0}")]
    NoNccl(String),
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error("cuBLASLt: {0:?}")]
    Blas(cudarc::cublaslt::result::CublasError),
    /// A kernel launch the driver refused, or whose earlier asynchronous
    /// error it reported (run with CUDA_LAUNCH_BLOCKING=1 to pin it down).
    #[error("launching {kernel} with grid {grid:?}, block {block:?}: {err}")]
    Launch { kernel: String, grid: (u32, u32, u32), block: (u32, u32, u32), err: cudarc::driver::DriverError },
    /// A cuBLASLt product that failed, with its shape (column-major, as cuBLASLt sees it).
    #[error(
        "cuBLASLt {what} for m={m} n={n} k={k} (transA {ta}, transB {tb}, {types}, bias {bias}): {err:?}"
    )]
    Matmul {
        what: &'static str,
        m: usize,
        n: usize,
        k: usize,
        ta: bool,
        tb: bool,
        types: String,
        bias: bool,
        err: cudarc::cublaslt::result::CublasError,
    },
    #[error("{0}")]
    Shape(String),
    #[error("gpu-check group {group}: {source}")]
    InCheck { group: &'static str, source: Box<CudaError> },
}

impl CudaError {
    /// The same error, saying which `gpu-check` group it stopped.
    pub fn in_group(self, g: check::Group) -> CudaError {
        CudaError::InCheck { group: g.name(), source: Box::new(self) }
    }
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e)
    }
}

impl From<cudarc::nvrtc::result::NvrtcError> for CudaError {
    fn from(e: cudarc::nvrtc::result::NvrtcError) -> Self {
        CudaError::Nvrtc(e)
    }
}

impl From<cudarc::cublaslt::result::CublasError> for CudaError {
    fn from(e: cudarc::cublaslt::result::CublasError) -> Self {
        CudaError::Blas(e)
    }
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// A shape check that fails with a message instead of a panic.
pub(crate) fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(what()))
    }
}

/// Whether the CUDA driver library can be loaded, found without touching any
/// driver entry point (cudarc panics on a missing library; this does not).
pub fn driver_present() -> bool {
    // SAFETY: only tries dlopen on the candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be loaded (from LD_LIBRARY_PATH or the system paths).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries dlopen on the candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether cuBLASLt can be loaded.
pub fn cublaslt_present() -> bool {
    // SAFETY: only tries dlopen on the candidate names.
    unsafe { cudarc::cublaslt::sys::is_culib_present() }
}

/// bf16 on the host: `half`'s, whose conversion rounds to nearest even and
/// keeps NaN a NaN exactly as the kernels' `f32_to_bf16` (kernels/common.cuh)
/// does, so the host and the GPU round the same value to the same bits.
pub type Bf16 = half::bf16;

/// A storage type the kernels are compiled for: `floatX` in kernels/common.cuh.
pub trait Elem: Copy + Default + Send + Sync + 'static {
    /// Compile the kernels with `-DPW_F32`.
    const IS_F32: bool;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    const IS_F32: bool = true;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for Bf16 {
    const IS_F32: bool = false;
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels' rounding (kernels/common.cuh `f32_to_bf16`), written out
    /// here to hold `half`'s to it.
    fn kernel_rounding(x: f32) -> u16 {
        let u = x.to_bits();
        if u & 0x7fff_ffff > 0x7f80_0000 {
            return ((u >> 16) | 0x40) as u16;
        }
        (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
    }

    #[test]
    fn host_bf16_rounds_like_the_kernels_on_every_kind_of_value() {
        let mut r = crate::rng::Rng::new(3, crate::rng::Purpose::Test, &[]);
        let specials =
            [0.0f32, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY, f32::NAN, -f32::NAN];
        let random = (0..100_000).map(|_| f32::from_bits(r.below(1 << 32) as u32));
        for x in specials.into_iter().chain(random) {
            assert_eq!(Bf16::from_f32(x).to_bits(), kernel_rounding(x), "{x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).to_bits(), 0x3f80);
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even one (1).
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).to_bits(), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).to_bits(), 0x3f82);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Bf16::from_f32(f32::INFINITY).to_f32(), f32::INFINITY);
        assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
    }
}
