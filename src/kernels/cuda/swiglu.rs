//! SwiGLU launchers (kernels/swiglu.cu), twin of kernels/cpu/swiglu.rs:
//! gate_up (N, 2H) X, out (N, H) X.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};

pub fn swiglu_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    gate_up: &DeviceBuffer<X>,
    n: usize,
    h: usize,
) -> Result<()> {
    ensure(out.len() >= n * h && gate_up.len() >= 2 * n * h, || {
        format!("swiglu_forward: buffers for N={n} H={h}")
    })?;
    let f = gpu.function::<X>("swiglu", "swiglu_forward")?;
    let (o, g, nl, hi) = (out.ptr(), gate_up.ptr(), n as i64, h as i32);
    gpu.launch(f, (blocks(n * h, 256), 1, 1), (256, 1, 1), &mut args![o, g, nl, hi])
}

/// dgate_up (N, 2H) += ∂L/∂(gate, up) given dout (N, H).
pub fn swiglu_backward<X: Elem>(
    gpu: &Gpu,
    dgate_up: &DeviceBuffer<X>,
    dout: &DeviceBuffer<X>,
    gate_up: &DeviceBuffer<X>,
    n: usize,
    h: usize,
) -> Result<()> {
    ensure(dgate_up.len() >= 2 * n * h && gate_up.len() >= 2 * n * h && dout.len() >= n * h, || {
        format!("swiglu_backward: buffers for N={n} H={h}")
    })?;
    let f = gpu.function::<X>("swiglu", "swiglu_backward")?;
    let (d, dy, g, nl, hi) = (dgate_up.ptr(), dout.ptr(), gate_up.ptr(), n as i64, h as i32);
    gpu.launch(f, (blocks(n * h, 256), 1, 1), (256, 1, 1), &mut args![d, dy, g, nl, hi])
}
