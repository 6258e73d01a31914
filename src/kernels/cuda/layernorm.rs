//! LayerNorm launchers (kernels/layernorm.cu), twin of kernels/cpu/layernorm.rs.
//! inp, out (N, C) X; weight, bias (C) X at device addresses; mean, rstd (N) f32;
//! dweight, dbias (C) f32, accumulated.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};

/// Rows per chunk of the weight gradient's first pass.
const ROWS: usize = 64;
/// Rows per block in the row kernels (one warp each).
const WARPS: usize = 8;

/// Scratch floats `layernorm_backward_weight` needs.
pub fn partial_len(n: usize, c: usize) -> usize {
    2 * n.div_ceil(ROWS) * c
}

#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    mean: &DeviceBuffer<f32>,
    rstd: &DeviceBuffer<f32>,
    inp: &DeviceBuffer<X>,
    weight: u64,
    bias: u64,
    n: usize,
    c: usize,
) -> Result<()> {
    ensure(out.len() >= n * c && inp.len() >= n * c && mean.len() >= n && rstd.len() >= n, || {
        format!("layernorm_forward: buffers for N={n} C={c}")
    })?;
    let f = gpu.function::<X>("layernorm", "layernorm_forward")?;
    let (o, m, r, i, ni, ci) = (out.ptr(), mean.ptr(), rstd.ptr(), inp.ptr(), n as i32, c as i32);
    gpu.launch(
        f,
        (blocks(n, WARPS), 1, 1),
        (32 * WARPS as u32, 1, 1),
        &mut args![o, m, r, i, weight, bias, ni, ci],
    )
}

/// dinp (N, C) += ∂L/∂inp.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_input<X: Elem>(
    gpu: &Gpu,
    dinp: &DeviceBuffer<X>,
    dout: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    weight: u64,
    mean: &DeviceBuffer<f32>,
    rstd: &DeviceBuffer<f32>,
    n: usize,
    c: usize,
) -> Result<()> {
    ensure(dinp.len() >= n * c && dout.len() >= n * c && inp.len() >= n * c, || {
        format!("layernorm_backward_input: buffers for N={n} C={c}")
    })?;
    let f = gpu.function::<X>("layernorm", "layernorm_backward_input")?;
    let (dx, dy, x, m, r, ni, ci) =
        (dinp.ptr(), dout.ptr(), inp.ptr(), mean.ptr(), rstd.ptr(), n as i32, c as i32);
    gpu.launch(
        f,
        (blocks(n, WARPS), 1, 1),
        (32 * WARPS as u32, 1, 1),
        &mut args![dx, dy, x, weight, m, r, ni, ci],
    )
}

/// dweight (C) f32 += Σ_rows dout·x̂; dbias (C) f32 += Σ_rows dout. No atomics.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_weight<X: Elem>(
    gpu: &Gpu,
    dweight: u64,
    dbias: u64,
    partial: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    mean: &DeviceBuffer<f32>,
    rstd: &DeviceBuffer<f32>,
    n: usize,
    c: usize,
) -> Result<()> {
    let chunks = n.div_ceil(ROWS);
    ensure(partial.len() >= partial_len(n, c) && dout.len() >= n * c && inp.len() >= n * c, || {
        format!("layernorm_backward_weight: buffers for N={n} C={c}")
    })?;
    let (pw, pb) = (partial.ptr(), partial.ptr_at(chunks * c));
    let f = gpu.function::<X>("layernorm", "layernorm_backward_weight_partial")?;
    let (dy, x, m, r, ni, ci, rows) =
        (dout.ptr(), inp.ptr(), mean.ptr(), rstd.ptr(), n as i32, c as i32, ROWS as i32);
    gpu.launch(
        f,
        (blocks(c, 256), chunks as u32, 1),
        (256, 1, 1),
        &mut args![pw, pb, dy, x, m, r, ni, ci, rows],
    )?;
    let f = gpu.function::<X>("layernorm", "layernorm_backward_weight_finish")?;
    let ch = chunks as i32;
    gpu.launch(f, (blocks(c, 256), 1, 1), (256, 1, 1), &mut args![dweight, dbias, pw, pb, ch, ci])
}
