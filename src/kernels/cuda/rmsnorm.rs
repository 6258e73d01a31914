//! RMSNorm launchers (kernels/rmsnorm.cu), twin of kernels/cpu/rmsnorm.rs.
//! inp, out (N, C) X; weight (C) X at a device address; rstd (N) f32;
//! dweight (C) f32, accumulated.
//!
//! Per-head RMSNorm (Qwen3's q_norm, k_norm), the `head_` launchers: a
//! [`HeadRun`] of head blocks in (N, W) X rows; weight (HS) X at a device
//! address; rstd (N, heads) f32; dweight (G, HS) f32, accumulated.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};
pub use crate::kernels::cpu::rmsnorm::HeadRun;

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

/// The run's shape, or why the kernels cannot take it.
fn head_shape(run: HeadRun, what: &str) -> Result<()> {
    let HeadRun { n, w, first, heads, hs } = run;
    ensure(hs > 0 && heads > 0 && (first + heads) * hs <= w && n * heads <= i32::MAX as usize, || {
        format!("{what}: {run:?} (heads must lie inside a row of W columns)")
    })
}

/// The run's columns of out (N, W) = weight · x̂ per head block of inp (N, W);
/// rstd (N, heads).
pub fn head_rmsnorm_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    rstd: &DeviceBuffer<f32>,
    inp: &DeviceBuffer<X>,
    weight: u64,
    run: HeadRun,
    eps: f32,
) -> Result<()> {
    head_shape(run, "head_rmsnorm_forward")?;
    let HeadRun { n, w, first, heads, hs } = run;
    ensure(out.len() >= n * w && inp.len() >= n * w && rstd.len() >= n * heads, || {
        format!("head_rmsnorm_forward: buffers for {run:?}")
    })?;
    let f = gpu.function::<X>("rmsnorm", "head_rmsnorm_forward")?;
    let (o, r, i) = (out.ptr(), rstd.ptr(), inp.ptr());
    let (ni, wi, fi, hi, hsi) = (n as i32, w as i32, first as i32, heads as i32, hs as i32);
    gpu.launch(
        f,
        (blocks(n * heads, WARPS), 1, 1),
        (32 * WARPS as u32, 1, 1),
        &mut args![o, r, i, weight, ni, wi, fi, hi, hsi, eps],
    )
}

/// The run's columns of dinp (N, W) += ∂L/∂inp.
#[allow(clippy::too_many_arguments)]
pub fn head_rmsnorm_backward_input<X: Elem>(
    gpu: &Gpu,
    dinp: &DeviceBuffer<X>,
    dout: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    weight: u64,
    rstd: &DeviceBuffer<f32>,
    run: HeadRun,
) -> Result<()> {
    head_shape(run, "head_rmsnorm_backward_input")?;
    let HeadRun { n, w, first, heads, hs } = run;
    ensure(
        dinp.len() >= n * w && dout.len() >= n * w && inp.len() >= n * w && rstd.len() >= n * heads,
        || format!("head_rmsnorm_backward_input: buffers for {run:?}"),
    )?;
    let f = gpu.function::<X>("rmsnorm", "head_rmsnorm_backward_input")?;
    let (dx, dy, x, r) = (dinp.ptr(), dout.ptr(), inp.ptr(), rstd.ptr());
    let (ni, wi, fi, hi, hsi) = (n as i32, w as i32, first as i32, heads as i32, hs as i32);
    gpu.launch(
        f,
        (blocks(n * heads, WARPS), 1, 1),
        (32 * WARPS as u32, 1, 1),
        &mut args![dx, dy, x, weight, r, ni, wi, fi, hi, hsi],
    )
}

/// Scratch floats `head_rmsnorm_backward_weight` needs for `groups` groups.
pub fn head_partial_len(run: HeadRun, groups: usize) -> usize {
    run.n.div_ceil(ROWS) * groups * run.hs
}

/// dweight (G, HS) f32 += Σ dout·x·rstd over rows (in chunk order) and each
/// group's heads (in order), G = `groups` dividing the run's heads (1: the
/// weight's whole gradient). No atomics.
#[allow(clippy::too_many_arguments)]
pub fn head_rmsnorm_backward_weight<X: Elem>(
    gpu: &Gpu,
    dweight: u64,
    groups: usize,
    partial: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    rstd: &DeviceBuffer<f32>,
    run: HeadRun,
) -> Result<()> {
    head_shape(run, "head_rmsnorm_backward_weight")?;
    let HeadRun { n, w, first, heads, hs } = run;
    ensure(groups > 0 && heads.is_multiple_of(groups), || {
        format!("head_rmsnorm_backward_weight: {groups} groups do not divide the {heads} heads of {run:?}")
    })?;
    ensure(
        partial.len() >= head_partial_len(run, groups)
            && dout.len() >= n * w
            && inp.len() >= n * w
            && rstd.len() >= n * heads,
        || format!("head_rmsnorm_backward_weight: buffers for {run:?} in {groups} groups"),
    )?;
    let (chunks, cols) = (n.div_ceil(ROWS), groups * hs);
    let f = gpu.function::<X>("rmsnorm", "head_rmsnorm_backward_weight_partial")?;
    let (p, dy, x, r) = (partial.ptr(), dout.ptr(), inp.ptr(), rstd.ptr());
    let (ni, wi, fi, hi, hsi, gi, rows) =
        (n as i32, w as i32, first as i32, heads as i32, hs as i32, groups as i32, ROWS as i32);
    gpu.launch(
        f,
        (blocks(cols, 128), chunks as u32, 1),
        (128, 1, 1),
        &mut args![p, dy, x, r, ni, wi, fi, hi, hsi, gi, rows],
    )?;
    super::matmul::sum_chunks::<X>(gpu, dweight, partial, chunks, cols)
}
