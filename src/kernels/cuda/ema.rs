//! The EMA of the weights on the device (kernels/ema.cu), twin of
//! kernels/cpu/ema.rs bit for bit: the same lerp, each operation rounded
//! once where the CPU's rounds. f32 throughout (the EMA of the f32 master
//! weights), whatever the storage type.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Result};

/// One EMA update of the first `n` elements: `ema ← lerp(ema, param,
/// weight)`, `weight` as `kernels::cpu::ema::weight_of` forms it.
pub fn ema_update(
    gpu: &Gpu,
    ema: &DeviceBuffer<f32>,
    param: &DeviceBuffer<f32>,
    n: usize,
    weight: f32,
) -> Result<()> {
    ensure(ema.len() >= n && param.len() >= n, || {
        format!("ema_update: {n} elements, buffers of {} and {}", ema.len(), param.len())
    })?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function::<f32>("ema", "ema_update")?;
    let (e, p, nl) = (ema.ptr(), param.ptr(), n as i64);
    gpu.launch(f, (blocks(n, 256), 1, 1), (256, 1, 1), &mut args![e, p, nl, weight])
}
