//! RoPE launchers (kernels/rope.cu), twin of kernels/cpu/rope.rs: x (N, W) X,
//! rotated in place at columns [col0, col0 + heads·HS) of each row; the table
//! is the host's `RopeTable`, uploaded once.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};
use crate::kernels::cpu::rope::RopeTable;

/// The cos and sin tables (T, HS/2) on the device.
pub struct DeviceRope {
    pub t: usize,
    pub half: usize,
    cos: DeviceBuffer<f32>,
    sin: DeviceBuffer<f32>,
}

impl DeviceRope {
    pub fn upload(gpu: &Gpu, table: &RopeTable) -> Result<DeviceRope> {
        Ok(DeviceRope {
            t: table.t,
            half: table.half,
            cos: gpu.upload(&table.cos)?,
            sin: gpu.upload(&table.sin)?,
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn rotate<X: Elem>(
    gpu: &Gpu,
    x: &DeviceBuffer<X>,
    table: &DeviceRope,
    n: usize,
    w: usize,
    col0: usize,
    heads: usize,
    sign: f32,
) -> Result<()> {
    let hs = 2 * table.half;
    ensure(x.len() >= n * w && col0 + heads * hs <= w && table.t > 0 && table.half > 0, || {
        format!("rope: N={n} rows of {w} columns, heads {col0}+{heads}×{hs}, table T={}", table.t)
    })?;
    let pairs = n * heads * table.half;
    let f = gpu.function::<X>("rope", "rope_rotate")?;
    let (p, c, s) = (x.ptr(), table.cos.ptr(), table.sin.ptr());
    let (ni, wi, c0, hi, half, ti) =
        (n as i32, w as i32, col0 as i32, heads as i32, table.half as i32, table.t as i32);
    gpu.launch(
        f,
        (blocks(pairs, 256), 1, 1),
        (256, 1, 1),
        &mut args![p, c, s, ni, wi, c0, hi, half, ti, sign],
    )
}

/// Applies RoPE to `heads` head vectors of each row of x (N, W), in place.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward<X: Elem>(
    gpu: &Gpu,
    x: &DeviceBuffer<X>,
    table: &DeviceRope,
    n: usize,
    w: usize,
    col0: usize,
    heads: usize,
) -> Result<()> {
    rotate(gpu, x, table, n, w, col0, heads, 1.0)
}

/// dx from dout, in place: the transpose of forward's rotation (overwrites).
#[allow(clippy::too_many_arguments)]
pub fn rope_backward<X: Elem>(
    gpu: &Gpu,
    dx: &DeviceBuffer<X>,
    table: &DeviceRope,
    n: usize,
    w: usize,
    col0: usize,
    heads: usize,
) -> Result<()> {
    rotate(gpu, dx, table, n, w, col0, heads, -1.0)
}
