//! Causal attention launchers (kernels/attention.cu), twin of
//! kernels/cpu/attention.rs: qkv (B, T, 3C) X, out (B, T, C) X, lse (B, NH, T) f32.
//! Head size 64 only (all GPT-2 sizes); other shapes are refused.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};

pub const HEAD_SIZE: usize = 64;
const ROWS: usize = 64;

fn check(c: usize, nh: usize) -> Result<()> {
    ensure(nh > 0 && c == nh * HEAD_SIZE, || {
        format!("the CUDA attention kernel needs head size {HEAD_SIZE}: n_embd {c} / n_head {nh}")
    })
}

#[allow(clippy::too_many_arguments)]
pub fn attention_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    lse: &DeviceBuffer<f32>,
    qkv: &DeviceBuffer<X>,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    check(c, nh)?;
    ensure(out.len() >= b * t * c && qkv.len() >= b * t * 3 * c && lse.len() >= b * nh * t, || {
        format!("attention_forward: buffers for B={b} T={t} C={c}")
    })?;
    let f = gpu.function::<X>("attention", "attention_forward")?;
    let (o, l, q, bi, ti, nhi) = (out.ptr(), lse.ptr(), qkv.ptr(), b as i32, t as i32, nh as i32);
    gpu.launch(
        f,
        (blocks(t, ROWS), nh as u32, b as u32),
        (2 * ROWS as u32, 1, 1),
        &mut args![o, l, q, bi, ti, nhi],
    )
}

/// Writes dqkv (B, T, 3C) whole (it is not accumulated, unlike the CPU twin's,
/// whose caller zeroes it first). `delta` is (B, NH, T) f32 scratch.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<X: Elem>(
    gpu: &Gpu,
    dqkv: &DeviceBuffer<X>,
    delta: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<X>,
    qkv: &DeviceBuffer<X>,
    out: &DeviceBuffer<X>,
    lse: &DeviceBuffer<f32>,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    check(c, nh)?;
    ensure(
        dqkv.len() >= b * t * 3 * c
            && qkv.len() >= b * t * 3 * c
            && dout.len() >= b * t * c
            && out.len() >= b * t * c
            && lse.len() >= b * nh * t
            && delta.len() >= b * nh * t,
        || format!("attention_backward: buffers for B={b} T={t} C={c}"),
    )?;
    let (dq, de, dy, q, o, l) = (dqkv.ptr(), delta.ptr(), dout.ptr(), qkv.ptr(), out.ptr(), lse.ptr());
    let (bi, ti, nhi) = (b as i32, t as i32, nh as i32);
    let f = gpu.function::<X>("attention", "attention_backward_delta")?;
    gpu.launch(f, (blocks(b * nh * t, 256), 1, 1), (256, 1, 1), &mut args![de, dy, o, bi, ti, nhi])?;
    let grid = (blocks(t, ROWS), nh as u32, b as u32);
    let block = (2 * ROWS as u32, 1, 1);
    let f = gpu.function::<X>("attention", "attention_backward_dq")?;
    gpu.launch(f, grid, block, &mut args![dq, dy, q, l, de, bi, ti, nhi])?;
    let f = gpu.function::<X>("attention", "attention_backward_dkdv")?;
    gpu.launch(f, grid, block, &mut args![dq, dy, q, l, de, bi, ti, nhi])
}
