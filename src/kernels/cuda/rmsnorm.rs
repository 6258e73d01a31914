//! RMSNorm launchers (kernels/rmsnorm.cu), twin of kernels/cpu/rmsnorm.rs.
//! inp, out (N, C) X; weight (C) X at a device address; rstd (N) f32;
//! dweight (C) f32, accumulated.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};

/// Rows per chunk of the weight gradient's first pass.
const ROWS: usize = 64;
/// Rows per block in the row kernels (one warp each).
const WARPS: usize = 8;

/// Scratch floats `rmsnorm_backward_weight` needs.
pub fn partial_len(n: usize, c: usize) -> usize {
    n.div_ceil(ROWS) * c
}

#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    rstd: &DeviceBuffer<f32>,
    inp: &DeviceBuffer<X>,
    weight: u64,
    n: usize,
    c: usize,
    eps: f32,
) -> Result<()> {
    ensure(out.len() >= n * c && inp.len() >= n * c && rstd.len() >= n, || {
        format!("rmsnorm_forward: buffers for N={n} C={c}")
    })?;
    let f = gpu.function::<X>("rmsnorm", "rmsnorm_forward")?;
    let (o, r, i, ni, ci) = (out.ptr(), rstd.ptr(), inp.ptr(), n as i32, c as i32);
    gpu.launch(
        f,
        (blocks(n, WARPS), 1, 1),
        (32 * WARPS as u32, 1, 1),
        &mut args![o, r, i, weight, ni, ci, eps],
    )
}

/// dinp (N, C) += ∂L/∂inp.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_input<X: Elem>(
    gpu: &Gpu,
    dinp: &DeviceBuffer<X>,
    dout: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    weight: u64,
    rstd: &DeviceBuffer<f32>,
    n: usize,
    c: usize,
) -> Result<()> {
    ensure(dinp.len() >= n * c && dout.len() >= n * c && inp.len() >= n * c && rstd.len() >= n, || {
        format!("rmsnorm_backward_input: buffers for N={n} C={c}")
    })?;
    let f = gpu.function::<X>("rmsnorm", "rmsnorm_backward_input")?;
    let (dx, dy, x, r, ni, ci) = (dinp.ptr(), dout.ptr(), inp.ptr(), rstd.ptr(), n as i32, c as i32);
    gpu.launch(
        f,
        (blocks(n, WARPS), 1, 1),
        (32 * WARPS as u32, 1, 1),
        &mut args![dx, dy, x, weight, r, ni, ci],
    )
}

/// dweight (C) f32 += Σ_rows dout·x·rstd, rows in chunk order. No atomics.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_weight<X: Elem>(
    gpu: &Gpu,
    dweight: u64,
    partial: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    rstd: &DeviceBuffer<f32>,
    n: usize,
    c: usize,
) -> Result<()> {
    let chunks = n.div_ceil(ROWS);
    ensure(partial.len() >= partial_len(n, c) && dout.len() >= n * c && inp.len() >= n * c, || {
        format!("rmsnorm_backward_weight: buffers for N={n} C={c}")
    })?;
    let f = gpu.function::<X>("rmsnorm", "rmsnorm_backward_weight_partial")?;
    let (p, dy, x, r, ni, ci, rows) =
        (partial.ptr(), dout.ptr(), inp.ptr(), rstd.ptr(), n as i32, c as i32, ROWS as i32);
    gpu.launch(f, (blocks(c, 256), chunks as u32, 1), (256, 1, 1), &mut args![p, dy, x, r, ni, ci, rows])?;
    super::matmul::sum_chunks::<X>(gpu, dweight, partial, chunks, c)
}
