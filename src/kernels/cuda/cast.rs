//! f32 ↔ bf16 casts on the device (kernels/cast.cu).

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Bf16, Result};

pub fn cast_f32_to_bf16(gpu: &Gpu, out: &DeviceBuffer<Bf16>, inp: &DeviceBuffer<f32>) -> Result<()> {
    ensure(out.len() == inp.len(), || format!("cast of {} into {}", inp.len(), out.len()))?;
    let f = gpu.function::<Bf16>("cast", "cast_f32_to_bf16")?;
    let (o, i, n) = (out.ptr(), inp.ptr(), inp.len() as i64);
    gpu.launch(f, (blocks(inp.len(), 256), 1, 1), (256, 1, 1), &mut args![o, i, n])
}

pub fn cast_bf16_to_f32(gpu: &Gpu, out: &DeviceBuffer<f32>, inp: &DeviceBuffer<Bf16>) -> Result<()> {
    ensure(out.len() == inp.len(), || format!("cast of {} into {}", inp.len(), out.len()))?;
    let f = gpu.function::<Bf16>("cast", "cast_bf16_to_f32")?;
    let (o, i, n) = (out.ptr(), inp.ptr(), inp.len() as i64);
    gpu.launch(f, (blocks(inp.len(), 256), 1, 1), (256, 1, 1), &mut args![o, i, n])
}
