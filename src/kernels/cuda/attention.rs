//! Causal attention launchers: qkv (B, T, 3C) X, out (B, T, C) X, lse (B, NH, T) f32;
//! the `gqa_` launchers take grouped-query heads (qkv (B, T, (NH + 2·NKV)·HS)).
//!
//! Two kernel families compute the same thing. In bf16 storage, head sizes 64
//! and 128 run on tensor cores (kernels/flash_attention.cu, FlashAttention-2
//! style; CPU twin kernels/cpu/flash_attention.rs). The f32 storage path, the
//! one checked against the CPU to 1e-5, keeps the CUDA-core kernels of
//! kernels/attention.cu (twin kernels/cpu/attention.rs), head size 64 only:
//! tensor cores would round its operands to bf16. Other shapes are refused.
//!
//! The `gqa_window_` launchers take a [`Window`]: a sliding window keeps query
//! i to keys (i − W, i] (Hugging Face's rule; kernels/cpu/attention.rs). The
//! CUDA-core kernels get the window as an int, T for plain causal attention;
//! the tensor-core ones have causal kernels (as before windows) and `_window_`
//! twins that take it.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};
pub use crate::kernels::cpu::attention::{Heads, Window};

/// The head size the CUDA-core kernels take (every GPT-2 size).
pub const HEAD_SIZE: usize = 64;
const ROWS: usize = 64;
/// Rows (queries or keys) per block of the tensor-core kernels.
const FLASH_ROWS: usize = 64;

/// Which kernels run one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// kernels/flash_attention.cu for this head size (64 or 128).
    TensorCore { head_size: usize },
    /// kernels/attention.cu (head size 64).
    CudaCore,
}

/// The kernels for storage X and n_embd `c` over `nh` heads, or why none fits.
pub fn kernels_for<X: Elem>(c: usize, nh: usize) -> Result<Kernels> {
    let hs = if nh > 0 && c.is_multiple_of(nh) { c / nh } else { 0 };
    match (X::IS_F32, hs) {
        (false, 64 | 128) => Ok(Kernels::TensorCore { head_size: hs }),
        (true, HEAD_SIZE) => Ok(Kernels::CudaCore),
        _ => Err(super::CudaError::Shape(format!(
            "the CUDA attention kernels take head size 64 or 128 in bf16 and 64 in f32: \
             n_embd {c} / n_head {nh} in {}",
            if X::IS_F32 { "f32" } else { "bf16" }
        ))),
    }
}

/// The tensor-core kernel names for a head size, causal or over a sliding
/// window (the `_window_` kernels: the causal ones compile without the
/// window's tests, so they keep their registers and bits).
fn flash_name(kernel: &str, head_size: usize, sliding: bool) -> &'static str {
    match (kernel, head_size, sliding) {
        ("forward", 64, false) => "flash_forward_hs64",
        ("forward", _, false) => "flash_forward_hs128",
        ("forward", 64, true) => "flash_forward_window_hs64",
        ("forward", _, true) => "flash_forward_window_hs128",
        ("dq", 64, false) => "flash_backward_dq_hs64",
        ("dq", _, false) => "flash_backward_dq_hs128",
        ("dq", 64, true) => "flash_backward_dq_window_hs64",
        ("dq", _, true) => "flash_backward_dq_window_hs128",
        (_, 64, false) => "flash_backward_dkdv_hs64",
        (_, _, false) => "flash_backward_dkdv_hs128",
        (_, 64, true) => "flash_backward_dkdv_window_hs64",
        _ => "flash_backward_dkdv_window_hs128",
    }
}

/// The kernels for grouped-query `heads` in storage X, or why none fits.
pub fn kernels_for_heads<X: Elem>(heads: Heads) -> Result<Kernels> {
    if heads.nh == 0 || heads.nkv == 0 || !heads.nh.is_multiple_of(heads.nkv) {
        return Err(super::CudaError::Shape(format!(
            "attention: {} key/value heads do not divide {} query heads",
            heads.nkv, heads.nh
        )));
    }
    kernels_for::<X>(heads.out_width(), heads.nh)
}

/// The window as the kernels take it: its width, T for plain causal attention.
fn window_arg(window: Window, t: usize) -> Result<i32> {
    if window == Window::Sliding(0) {
        return Err(super::CudaError::Shape(
            "attention: a sliding window must hold at least one key (the query's own)".into(),
        ));
    }
    Ok(match window.over(t) {
        Window::Sliding(w) => w,
        Window::Causal => t,
    } as i32)
}

/// out and lse from qkv (head sizes as `kernels_for` says), multi-head.
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
    kernels_for::<X>(c, nh)?;
    gqa_forward(gpu, out, lse, qkv, b, t, Heads::mha(c, nh))
}

/// out (B, T, NH·HS) and lse (B, NH, T) from qkv (B, T, (NH + 2·NKV)·HS),
/// grouped-query heads laid out as kernels/cpu/attention.rs has them; plain causal.
#[allow(clippy::too_many_arguments)]
pub fn gqa_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    lse: &DeviceBuffer<f32>,
    qkv: &DeviceBuffer<X>,
    b: usize,
    t: usize,
    heads: Heads,
) -> Result<()> {
    gqa_window_forward(gpu, out, lse, qkv, b, t, heads, Window::Causal)
}

/// [`gqa_forward`] over `window`.
#[allow(clippy::too_many_arguments)]
pub fn gqa_window_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    lse: &DeviceBuffer<f32>,
    qkv: &DeviceBuffer<X>,
    b: usize,
    t: usize,
    heads: Heads,
    window: Window,
) -> Result<()> {
    let kernels = kernels_for_heads::<X>(heads)?;
    let win = window_arg(window, t)?;
    let (nh, w, c) = (heads.nh, heads.qkv_width(), heads.out_width());
    ensure(out.len() >= b * t * c && qkv.len() >= b * t * w && lse.len() >= b * nh * t, || {
        format!("attention_forward: buffers for B={b} T={t} {heads:?}")
    })?;
    let (o, l, q, bi, ti, nhi, nkvi) =
        (out.ptr(), lse.ptr(), qkv.ptr(), b as i32, t as i32, nh as i32, heads.nkv as i32);
    if let Kernels::TensorCore { head_size } = kernels {
        let sliding = win < ti;
        let f = gpu.function::<X>("flash_attention", flash_name("forward", head_size, sliding))?;
        let grid = (blocks(t, FLASH_ROWS), nh as u32, b as u32);
        if sliding {
            return gpu.launch(f, grid, (128, 1, 1), &mut args![o, l, q, bi, ti, nhi, nkvi, win]);
        }
        return gpu.launch(f, grid, (128, 1, 1), &mut args![o, l, q, bi, ti, nhi, nkvi]);
    }
    let f = gpu.function::<X>("attention", "attention_forward")?;
    gpu.launch(
        f,
        (blocks(t, ROWS), nh as u32, b as u32),
        (2 * ROWS as u32, 1, 1),
        &mut args![o, l, q, bi, ti, nhi, nkvi, win],
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
    kernels_for::<X>(c, nh)?;
    gqa_backward(gpu, dqkv, delta, dout, qkv, out, lse, b, t, Heads::mha(c, nh))
}

/// Writes dqkv (B, T, (NH + 2·NKV)·HS) whole; a key/value head's gradient is
/// summed over its query group in head order by one block (no atomics).
/// Plain causal.
#[allow(clippy::too_many_arguments)]
pub fn gqa_backward<X: Elem>(
    gpu: &Gpu,
    dqkv: &DeviceBuffer<X>,
    delta: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<X>,
    qkv: &DeviceBuffer<X>,
    out: &DeviceBuffer<X>,
    lse: &DeviceBuffer<f32>,
    b: usize,
    t: usize,
    heads: Heads,
) -> Result<()> {
    gqa_window_backward(gpu, dqkv, delta, dout, qkv, out, lse, b, t, heads, Window::Causal)
}

/// [`gqa_backward`] over `window` (the forward's).
#[allow(clippy::too_many_arguments)]
pub fn gqa_window_backward<X: Elem>(
    gpu: &Gpu,
    dqkv: &DeviceBuffer<X>,
    delta: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<X>,
    qkv: &DeviceBuffer<X>,
    out: &DeviceBuffer<X>,
    lse: &DeviceBuffer<f32>,
    b: usize,
    t: usize,
    heads: Heads,
    window: Window,
) -> Result<()> {
    let kernels = kernels_for_heads::<X>(heads)?;
    let win = window_arg(window, t)?;
    let (nh, nkv, w, c) = (heads.nh, heads.nkv, heads.qkv_width(), heads.out_width());
    ensure(
        dqkv.len() >= b * t * w
            && qkv.len() >= b * t * w
            && dout.len() >= b * t * c
            && out.len() >= b * t * c
            && lse.len() >= b * nh * t
            && delta.len() >= b * nh * t,
        || format!("attention_backward: buffers for B={b} T={t} {heads:?}"),
    )?;
    let (dq, de, dy, q, o, l) = (dqkv.ptr(), delta.ptr(), dout.ptr(), qkv.ptr(), out.ptr(), lse.ptr());
    let (bi, ti, nhi, nkvi) = (b as i32, t as i32, nh as i32, nkv as i32);
    let (queries, keys) = ((blocks(t, ROWS), nh as u32, b as u32), (blocks(t, ROWS), nkv as u32, b as u32));
    if let Kernels::TensorCore { head_size } = kernels {
        let hsi = head_size as i32;
        let f = gpu.function::<X>("flash_attention", "flash_backward_delta")?;
        gpu.launch(f, (blocks(b * nh * t, 256), 1, 1), (256, 1, 1), &mut args![de, dy, o, bi, ti, nhi, hsi])?;
        let (queries, keys) =
            ((blocks(t, FLASH_ROWS), nh as u32, b as u32), (blocks(t, FLASH_ROWS), nkv as u32, b as u32));
        let sliding = win < ti;
        for (kernel, grid) in [("dq", queries), ("dkdv", keys)] {
            let f = gpu.function::<X>("flash_attention", flash_name(kernel, head_size, sliding))?;
            if sliding {
                gpu.launch(f, grid, (128, 1, 1), &mut args![dq, dy, q, l, de, bi, ti, nhi, nkvi, win])?;
            } else {
                gpu.launch(f, grid, (128, 1, 1), &mut args![dq, dy, q, l, de, bi, ti, nhi, nkvi])?;
            }
        }
        return Ok(());
    }
    let f = gpu.function::<X>("attention", "attention_backward_delta")?;
    gpu.launch(f, (blocks(b * nh * t, 256), 1, 1), (256, 1, 1), &mut args![de, dy, o, bi, ti, nhi])?;
    let block = (2 * ROWS as u32, 1, 1);
    let f = gpu.function::<X>("attention", "attention_backward_dq")?;
    gpu.launch(f, queries, block, &mut args![dq, dy, q, l, de, bi, ti, nhi, nkvi, win])?;
    let f = gpu.function::<X>("attention", "attention_backward_dkdv")?;
    gpu.launch(f, keys, block, &mut args![dq, dy, q, l, de, bi, ti, nhi, nkvi, win])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cuda::Bf16;

    #[test]
    fn bf16_runs_head_sizes_64_and_128_on_tensor_cores_and_f32_keeps_the_cuda_core_kernels() {
        assert_eq!(kernels_for::<Bf16>(768, 12).unwrap(), Kernels::TensorCore { head_size: 64 });
        assert_eq!(kernels_for::<Bf16>(1024, 8).unwrap(), Kernels::TensorCore { head_size: 128 });
        assert_eq!(kernels_for::<f32>(768, 12).unwrap(), Kernels::CudaCore);
        let err = kernels_for::<f32>(1024, 8).unwrap_err().to_string();
        assert!(err.contains("n_embd 1024 / n_head 8 in f32"), "{err}");
        assert!(kernels_for::<Bf16>(96 * 4, 4).is_err());
        assert!(kernels_for::<Bf16>(100, 0).is_err());
    }

    #[test]
    fn the_kernels_get_the_window_width_and_t_for_plain_causal_attention() {
        assert_eq!(window_arg(Window::Causal, 100).unwrap(), 100);
        assert_eq!(window_arg(Window::Sliding(37), 100).unwrap(), 37);
        assert_eq!(window_arg(Window::Sliding(4096), 100).unwrap(), 100);
        let err = window_arg(Window::Sliding(0), 100).unwrap_err().to_string();
        assert!(err.contains("at least one key"), "{err}");
    }

    #[test]
    fn grouped_query_heads_must_divide_and_keep_the_head_size_rules() {
        let llama = Heads { nh: 32, nkv: 8, hs: 128 };
        assert_eq!(kernels_for_heads::<Bf16>(llama).unwrap(), Kernels::TensorCore { head_size: 128 });
        assert!(kernels_for_heads::<f32>(llama).is_err());
        assert_eq!(kernels_for_heads::<f32>(Heads { nh: 4, nkv: 2, hs: 64 }).unwrap(), Kernels::CudaCore);
        let err = kernels_for_heads::<Bf16>(Heads { nh: 6, nkv: 4, hs: 64 }).unwrap_err().to_string();
        assert!(err.contains("4 key/value heads do not divide 6 query heads"), "{err}");
    }
}
