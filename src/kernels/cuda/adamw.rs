//! AdamW and the global gradient norm on the device (kernels/adamw.cu,
//! kernels/norm.cu), twins of kernels/cpu/adamw.rs. Master weights, moments
//! and gradients are f32; the X copy the model computes with is written from
//! the updated master weights.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};
use crate::kernels::cpu::adamw::AdamW;

/// Blocks of the norm's first pass: fixed, so the summation order is too.
pub const NORM_BLOCKS: usize = 1024;

/// One AdamW update of `n` elements starting at element `offset` of each buffer.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update<X: Elem>(
    gpu: &Gpu,
    master: &DeviceBuffer<f32>,
    param: &DeviceBuffer<X>,
    grad: &DeviceBuffer<f32>,
    m: &DeviceBuffer<f32>,
    v: &DeviceBuffer<f32>,
    offset: usize,
    n: usize,
    hp: &AdamW,
    decay: bool,
    grad_scale: f32,
) -> Result<()> {
    let end = offset + n;
    ensure(
        master.len() >= end && param.len() >= end && grad.len() >= end && m.len() >= end && v.len() >= end,
        || format!("adamw_update: elements {offset}..{end} out of range"),
    )?;
    ensure(hp.step >= 1, || "adamw_update: step counts from 1".into())?;
    // The scalars exactly as the CPU twin forms them (f64, rounded to f32).
    let decay_factor = if decay { (1.0 - hp.lr * hp.weight_decay) as f32 } else { 1.0 };
    let one_minus_b1 = (1.0 - hp.beta1) as f32;
    let b2 = hp.beta2 as f32;
    let one_minus_b2 = (1.0 - hp.beta2) as f32;
    let bc1 = 1.0 - hp.beta1.powi(hp.step as i32);
    let bc2 = 1.0 - hp.beta2.powi(hp.step as i32);
    let step_size = (hp.lr / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let eps = hp.eps as f32;
    let f = gpu.function::<X>("adamw", "adamw_update")?;
    let (pm, pp, pg, pmm, pv) = (
        master.ptr_at(offset),
        param.ptr_at(offset),
        grad.ptr_at(offset),
        m.ptr_at(offset),
        v.ptr_at(offset),
    );
    let nl = n as i64;
    gpu.launch(
        f,
        (blocks(n, 256), 1, 1),
        (256, 1, 1),
        &mut args![
            pm,
            pp,
            pg,
            pmm,
            pv,
            nl,
            decay_factor,
            one_minus_b1,
            b2,
            one_minus_b2,
            step_size,
            bc2_sqrt,
            eps,
            grad_scale
        ],
    )
}

/// Σ x² over the buffer, summed in a fixed order; `partial` holds NORM_BLOCKS
/// floats and `out` one. Waits for the result.
pub fn sum_squares(
    gpu: &Gpu,
    x: &DeviceBuffer<f32>,
    partial: &DeviceBuffer<f32>,
    out: &DeviceBuffer<f32>,
) -> Result<f32> {
    ensure(partial.len() >= NORM_BLOCKS && !out.is_empty(), || "sum_squares: scratch too small".into())?;
    let f = gpu.function::<f32>("norm", "global_norm_partial")?;
    let (p, xp, n) = (partial.ptr(), x.ptr(), x.len() as i64);
    gpu.launch(f, (NORM_BLOCKS as u32, 1, 1), (256, 1, 1), &mut args![p, xp, n])?;
    let f = gpu.function::<f32>("norm", "global_norm_finish")?;
    let (o, cnt) = (out.ptr(), NORM_BLOCKS as i32);
    gpu.launch(f, (1, 1, 1), (1024, 1, 1), &mut args![o, p, cnt])?;
    Ok(gpu.download(out)?[0])
}

/// Σ x² of each range `(offset, len)` of `x` into `out[k]`, each summed in
/// the fixed order of `sum_squares`; one download at the end. `partial`
/// holds NORM_BLOCKS floats and `out` one per range.
pub fn sum_squares_ranges(
    gpu: &Gpu,
    x: &DeviceBuffer<f32>,
    ranges: &[(usize, usize)],
    partial: &DeviceBuffer<f32>,
    out: &DeviceBuffer<f32>,
) -> Result<Vec<f32>> {
    ensure(partial.len() >= NORM_BLOCKS && out.len() >= ranges.len(), || {
        "sum_squares_ranges: scratch too small".into()
    })?;
    ensure(ranges.iter().all(|&(o, n)| o + n <= x.len()), || {
        "sum_squares_ranges: range out of bounds".into()
    })?;
    let first = gpu.function::<f32>("norm", "global_norm_partial")?;
    let finish = gpu.function::<f32>("norm", "global_norm_finish")?;
    let (p, cnt) = (partial.ptr(), NORM_BLOCKS as i32);
    // One stream: each range's finish reads the partials before the next range overwrites them.
    for (k, &(offset, len)) in ranges.iter().enumerate() {
        let (xp, n) = (x.ptr_at(offset), len as i64);
        gpu.launch(first, (NORM_BLOCKS as u32, 1, 1), (256, 1, 1), &mut args![p, xp, n])?;
        let o = out.ptr_at(k);
        gpu.launch(finish, (1, 1, 1), (1024, 1, 1), &mut args![o, p, cnt])?;
    }
    let all = gpu.download(out)?;
    Ok(all[..ranges.len()].to_vec())
}

/// out = a + b over `n` f32 elements at the given device addresses (out may be a).
pub fn add_f32(gpu: &Gpu, out: u64, a: u64, b: u64, n: usize) -> Result<()> {
    let f = gpu.function::<f32>("norm", "add_f32")?;
    let nl = n as i64;
    gpu.launch(f, (blocks(n, 256), 1, 1), (256, 1, 1), &mut args![out, a, b, nl])
}
