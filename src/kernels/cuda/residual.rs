//! Residual add launcher (kernels/residual.cu), twin of kernels/cpu/residual.rs.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};

/// out = a + b over n elements; out may be a.
pub fn residual_forward<X: Elem>(gpu: &Gpu, out: u64, a: u64, b: &DeviceBuffer<X>, n: usize) -> Result<()> {
    ensure(b.len() >= n, || format!("residual_forward: buffer for {n}"))?;
    let f = gpu.function::<X>("residual", "residual_forward")?;
    let (bp, nl) = (b.ptr(), n as i64);
    gpu.launch(f, (blocks(n, 256), 1, 1), (256, 1, 1), &mut args![out, a, bp, nl])
}
