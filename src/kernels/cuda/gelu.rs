//! GELU launchers (kernels/gelu.cu), twin of kernels/cpu/gelu.rs; flat buffers.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};

pub fn gelu_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    n: usize,
) -> Result<()> {
    ensure(out.len() >= n && inp.len() >= n, || format!("gelu_forward: buffers for {n}"))?;
    let f = gpu.function::<X>("gelu", "gelu_forward")?;
    let (o, i, nl) = (out.ptr(), inp.ptr(), n as i64);
    gpu.launch(f, (blocks(n, 256), 1, 1), (256, 1, 1), &mut args![o, i, nl])
}

/// dinp = GELU'(inp)·dout, overwritten; dinp may be dout itself.
pub fn gelu_backward<X: Elem>(
    gpu: &Gpu,
    dinp: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    dout: &DeviceBuffer<X>,
    n: usize,
) -> Result<()> {
    ensure(dinp.len() >= n && inp.len() >= n && dout.len() >= n, || {
        format!("gelu_backward: buffers for {n}")
    })?;
    let f = gpu.function::<X>("gelu", "gelu_backward")?;
    let (dx, x, dy, nl) = (dinp.ptr(), inp.ptr(), dout.ptr(), n as i64);
    gpu.launch(f, (blocks(n, 256), 1, 1), (256, 1, 1), &mut args![dx, x, dy, nl])
}
