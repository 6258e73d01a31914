//! Causal attention launchers: qkv (B, T, 3C) X, out (B, T, C) X, lse (B, NH, T) f32;
//! the `gqa_` launchers take grouped-query heads (qkv (B, T, (NH + 2·NKV)·HS)).
//!
//! Two kernel families compute the same thing. In bf16 storage, head sizes
//! 16, 32, 64, 80, 96 and 128 run on tensor cores (kernels/flash_attention.cu,
//! FlashAttention-2 style; CPU twin kernels/cpu/flash_attention.rs). The f32
//! storage path, the one checked against the CPU to 1e-5, keeps the CUDA-core
//! kernels of kernels/attention.cu (twin kernels/cpu/attention.rs), at those
//! sizes and 256: tensor cores would round its operands to bf16. bf16 at head
//! size 256 runs the CUDA-core kernels too (f32 arithmetic on bf16 storage):
//! the tensor-core tiles' accumulators would not fit the registers there.
//! Other shapes are refused.
//!
//! The `gqa_window_` launchers take a [`Window`]: a sliding window keeps query
//! i to keys (i − W, i] (Hugging Face's rule; kernels/cpu/attention.rs). The
//! CUDA-core kernels get the window as an int, T for plain causal attention;
//! the tensor-core ones have causal kernels (as before windows) and `_window_`
//! twins that take it at 64 and 128, and the `_window_` kernels alone at the
//! other sizes (causal attention there is a window of T).

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};
pub use crate::kernels::cpu::attention::{Heads, Window};

/// The head size of GPT-2 (every size), which the checks' plain cases use.
pub const HEAD_SIZE: usize = 64;
/// The head sizes the CUDA-core kernels take (kernels/attention.cu's `_hsN`).
pub const CUDA_CORE_HEAD_SIZES: [usize; 7] = [16, 32, 64, 80, 96, 128, 256];
/// The head sizes the tensor-core kernels take (kernels/flash_attention.cu's `_hsN`).
pub const TENSOR_CORE_HEAD_SIZES: [usize; 6] = [16, 32, 64, 80, 96, 128];
/// Rows (queries or keys) per block of the tensor-core kernels.
const FLASH_ROWS: usize = 64;
/// Keys per forward tile and keys (dq) or queries (dk, dv) per backward tile
/// of the tensor-core kernels; their rows' bf16 padding.
const FLASH_KT: usize = 64;
const FLASH_BT: usize = 16;
const FLASH_PAD: usize = 8;

/// Which kernels run one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// kernels/flash_attention.cu for this head size.
    TensorCore { head_size: usize },
    /// kernels/attention.cu for this head size.
    CudaCore { head_size: usize },
}

/// The kernels for storage X and n_embd `c` over `nh` heads, or why none fits.
pub fn kernels_for<X: Elem>(c: usize, nh: usize) -> Result<Kernels> {
    let hs = if nh > 0 && c.is_multiple_of(nh) { c / nh } else { 0 };
    if !X::IS_F32 && TENSOR_CORE_HEAD_SIZES.contains(&hs) {
        return Ok(Kernels::TensorCore { head_size: hs });
    }
    if CUDA_CORE_HEAD_SIZES.contains(&hs) {
        return Ok(Kernels::CudaCore { head_size: hs });
    }
    Err(super::CudaError::Shape(format!(
        "the CUDA attention kernels take head size 16, 32, 64, 80, 96, 128 or 256: \
         n_embd {c} / n_head {nh} in {}",
        if X::IS_F32 { "f32" } else { "bf16" }
    )))
}

/// One head size's CUDA-core kernels: rows per block, threads per block and
/// dynamic shared memory per kernel (kernels/attention.cu's `Shape<HS>`:
/// 2 threads a row up to HS 64, 4 up to 128, 8 at 256; tiles of 32 keys or
/// queries, 16 at 256; a block of 64 rows, 32 at 256).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CudaCoreShape {
    rows: usize,
    threads: u32,
    /// Forward and dq: the K and V tiles, f32.
    tiles_bytes: u32,
    /// dk, dv: the Q and dO tiles and the tile's lse and delta, f32.
    dkdv_bytes: u32,
}

impl CudaCoreShape {
    fn of(hs: usize) -> CudaCoreShape {
        let tpr = if hs <= 64 {
            2
        } else if hs <= 128 {
            4
        } else {
            8
        };
        let (rows, tile) = if hs <= 128 { (64, 32) } else { (32, 16) };
        let tiles_bytes = (2 * tile * hs * 4) as u32;
        CudaCoreShape {
            rows,
            threads: (rows * tpr) as u32,
            tiles_bytes,
            dkdv_bytes: tiles_bytes + 2 * tile as u32 * 4,
        }
    }
}

/// The tensor-core kernels' dynamic shared memory for a head size, bytes
/// (kernels/flash_attention.cu's structs; its `SharedBytes` static_asserts
/// pin the same sums).
fn flash_shared_bytes(kernel: &str, d: usize) -> u32 {
    let bytes = match kernel {
        "forward" => 2 * (FLASH_KT * (d + FLASH_PAD) + d * (FLASH_KT + FLASH_PAD)),
        "dq" => 2 * 2 * FLASH_BT * (d + FLASH_PAD),
        _ => 2 * (2 * FLASH_ROWS + 2 * FLASH_BT) * (d + FLASH_PAD) + 2 * 4 * FLASH_BT,
    };
    bytes as u32
}

/// `prefix` + `_hsN` for each N of `$sizes` (written out: kernel names are `&'static str`).
macro_rules! per_size {
    ($prefix:literal, [$($n:literal),*]) => {
        [$(concat!($prefix, "_hs", $n)),*]
    };
}

/// The head sizes whose tensor-core kernels have causal versions (compiled
/// without the window's tests: their registers and bits from before windows);
/// the others run causal attention on their window kernels, WIN = T.
const CAUSAL_KERNEL_SIZES: [usize; 2] = [64, 128];

/// Whether a launch at `head_size` takes the `_window_` kernels: for a window
/// narrower than T, or at a size that has no causal ones.
fn takes_window_kernels(head_size: usize, win: i32, t: i32) -> bool {
    win < t || !CAUSAL_KERNEL_SIZES.contains(&head_size)
}

/// The tensor-core kernel's name for a head size, causal or over a sliding
/// window.
fn flash_name(kernel: &str, head_size: usize, sliding: bool) -> &'static str {
    let names: [&'static str; 6] = match (kernel, sliding) {
        ("forward", false) => per_size!("flash_forward", [16, 32, 64, 80, 96, 128]),
        ("forward", true) => per_size!("flash_forward_window", [16, 32, 64, 80, 96, 128]),
        ("dq", false) => per_size!("flash_backward_dq", [16, 32, 64, 80, 96, 128]),
        ("dq", true) => per_size!("flash_backward_dq_window", [16, 32, 64, 80, 96, 128]),
        (_, false) => per_size!("flash_backward_dkdv", [16, 32, 64, 80, 96, 128]),
        (_, true) => per_size!("flash_backward_dkdv_window", [16, 32, 64, 80, 96, 128]),
    };
    let at = TENSOR_CORE_HEAD_SIZES.iter().position(|&h| h == head_size);
    names[at.expect("kernels_for hands out tensor-core head sizes only")]
}

/// The CUDA-core kernel's name for a head size.
fn cuda_core_name(kernel: &str, head_size: usize) -> &'static str {
    let names: [&'static str; 7] = match kernel {
        "forward" => per_size!("attention_forward", [16, 32, 64, 80, 96, 128, 256]),
        "dq" => per_size!("attention_backward_dq", [16, 32, 64, 80, 96, 128, 256]),
        _ => per_size!("attention_backward_dkdv", [16, 32, 64, 80, 96, 128, 256]),
    };
    let at = CUDA_CORE_HEAD_SIZES.iter().position(|&h| h == head_size);
    names[at.expect("kernels_for hands out CUDA-core head sizes only")]
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
    match kernels {
        Kernels::TensorCore { head_size } => {
            let sliding = takes_window_kernels(head_size, win, ti);
            let f = gpu.function::<X>("flash_attention", flash_name("forward", head_size, sliding))?;
            let (grid, shared) =
                ((blocks(t, FLASH_ROWS), nh as u32, b as u32), flash_shared_bytes("forward", head_size));
            if sliding {
                return gpu.launch_shared(
                    f,
                    grid,
                    (128, 1, 1),
                    shared,
                    &mut args![o, l, q, bi, ti, nhi, nkvi, win],
                );
            }
            gpu.launch_shared(f, grid, (128, 1, 1), shared, &mut args![o, l, q, bi, ti, nhi, nkvi])
        }
        Kernels::CudaCore { head_size } => {
            let shape = CudaCoreShape::of(head_size);
            let f = gpu.function::<X>("attention", cuda_core_name("forward", head_size))?;
            gpu.launch_shared(
                f,
                (blocks(t, shape.rows), nh as u32, b as u32),
                (shape.threads, 1, 1),
                shape.tiles_bytes,
                &mut args![o, l, q, bi, ti, nhi, nkvi, win],
            )
        }
    }
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
    match kernels {
        Kernels::TensorCore { head_size } => {
            let hsi = head_size as i32;
            let f = gpu.function::<X>("flash_attention", "flash_backward_delta")?;
            gpu.launch(
                f,
                (blocks(b * nh * t, 256), 1, 1),
                (256, 1, 1),
                &mut args![de, dy, o, bi, ti, nhi, hsi],
            )?;
            let (queries, keys) =
                ((blocks(t, FLASH_ROWS), nh as u32, b as u32), (blocks(t, FLASH_ROWS), nkv as u32, b as u32));
            let sliding = takes_window_kernels(head_size, win, ti);
            for (kernel, grid) in [("dq", queries), ("dkdv", keys)] {
                let f = gpu.function::<X>("flash_attention", flash_name(kernel, head_size, sliding))?;
                let shared = flash_shared_bytes(kernel, head_size);
                if sliding {
                    let mut a = args![dq, dy, q, l, de, bi, ti, nhi, nkvi, win];
                    gpu.launch_shared(f, grid, (128, 1, 1), shared, &mut a)?;
                } else {
                    gpu.launch_shared(
                        f,
                        grid,
                        (128, 1, 1),
                        shared,
                        &mut args![dq, dy, q, l, de, bi, ti, nhi, nkvi],
                    )?;
                }
            }
            Ok(())
        }
        Kernels::CudaCore { head_size } => {
            let (shape, hsi) = (CudaCoreShape::of(head_size), head_size as i32);
            let f = gpu.function::<X>("attention", "attention_backward_delta")?;
            gpu.launch(
                f,
                (blocks(b * nh * t, 256), 1, 1),
                (256, 1, 1),
                &mut args![de, dy, o, bi, ti, nhi, hsi],
            )?;
            let block = (shape.threads, 1, 1);
            let (queries, keys) =
                ((blocks(t, shape.rows), nh as u32, b as u32), (blocks(t, shape.rows), nkv as u32, b as u32));
            let f = gpu.function::<X>("attention", cuda_core_name("dq", head_size))?;
            let mut a = args![dq, dy, q, l, de, bi, ti, nhi, nkvi, win];
            gpu.launch_shared(f, queries, block, shape.tiles_bytes, &mut a)?;
            let f = gpu.function::<X>("attention", cuda_core_name("dkdv", head_size))?;
            gpu.launch_shared(f, keys, block, shape.dkdv_bytes, &mut a)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cuda::Bf16;

    #[test]
    fn bf16_runs_head_sizes_to_128_on_tensor_cores_and_f32_and_256_on_the_cuda_core_kernels() {
        assert_eq!(kernels_for::<Bf16>(768, 12).unwrap(), Kernels::TensorCore { head_size: 64 });
        assert_eq!(kernels_for::<Bf16>(1024, 8).unwrap(), Kernels::TensorCore { head_size: 128 });
        assert_eq!(kernels_for::<Bf16>(96 * 32, 32).unwrap(), Kernels::TensorCore { head_size: 96 });
        assert_eq!(kernels_for::<Bf16>(64, 4).unwrap(), Kernels::TensorCore { head_size: 16 });
        assert_eq!(kernels_for::<Bf16>(2048, 8).unwrap(), Kernels::CudaCore { head_size: 256 });
        for hs in CUDA_CORE_HEAD_SIZES {
            assert_eq!(kernels_for::<f32>(hs * 3, 3).unwrap(), Kernels::CudaCore { head_size: hs });
        }
        let err = kernels_for::<f32>(48 * 4, 4).unwrap_err().to_string();
        assert!(err.contains("n_embd 192 / n_head 4 in f32"), "{err}");
        assert!(err.contains("16, 32, 64, 80, 96, 128 or 256"), "{err}");
        assert!(kernels_for::<Bf16>(512 * 2, 2).is_err());
        assert!(kernels_for::<Bf16>(100, 0).is_err());
        assert!(kernels_for::<f32>(100, 3).is_err());
    }

    #[test]
    fn every_head_size_names_its_own_kernels() {
        for hs in TENSOR_CORE_HEAD_SIZES {
            for (kernel, part) in [("forward", "forward"), ("dq", "backward_dq"), ("dkdv", "backward_dkdv")] {
                assert_eq!(flash_name(kernel, hs, false), format!("flash_{part}_hs{hs}"));
                assert_eq!(flash_name(kernel, hs, true), format!("flash_{part}_window_hs{hs}"));
            }
            // Causal attention (a window of T) takes the causal kernels where they exist.
            assert_eq!(!takes_window_kernels(hs, 100, 100), hs == 64 || hs == 128, "hs {hs}");
            assert!(takes_window_kernels(hs, 99, 100), "hs {hs}");
        }
        for hs in CUDA_CORE_HEAD_SIZES {
            for (kernel, part) in [("forward", "forward"), ("dq", "backward_dq"), ("dkdv", "backward_dkdv")] {
                assert_eq!(cuda_core_name(kernel, hs), format!("attention_{part}_hs{hs}"));
            }
        }
    }

    #[test]
    fn shared_memory_stays_under_48_kib_at_every_head_size() {
        // The figures kernels/flash_attention.cu's static_asserts pin, at 64 and 128.
        assert_eq!(flash_shared_bytes("forward", 64), 18_432);
        assert_eq!(flash_shared_bytes("dq", 128), 8_704);
        assert_eq!(flash_shared_bytes("dkdv", 128), 43_648);
        for hs in TENSOR_CORE_HEAD_SIZES {
            for kernel in ["forward", "dq", "dkdv"] {
                assert!(flash_shared_bytes(kernel, hs) <= 48 << 10, "{kernel} hs {hs}");
            }
        }
        for hs in CUDA_CORE_HEAD_SIZES {
            let shape = CudaCoreShape::of(hs);
            assert!(shape.dkdv_bytes <= 48 << 10 && shape.threads <= 256, "hs {hs}: {shape:?}");
            // Each thread holds at most 32 of its row's dims.
            assert!(hs / (shape.threads as usize / shape.rows) <= 32, "hs {hs}: {shape:?}");
        }
        assert_eq!(
            CudaCoreShape::of(64),
            CudaCoreShape { rows: 64, threads: 128, tiles_bytes: 16_384, dkdv_bytes: 16_640 }
        );
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
        assert_eq!(kernels_for_heads::<f32>(llama).unwrap(), Kernels::CudaCore { head_size: 128 });
        assert_eq!(
            kernels_for_heads::<f32>(Heads { nh: 4, nkv: 2, hs: 64 }).unwrap(),
            Kernels::CudaCore { head_size: 64 }
        );
        assert!(kernels_for_heads::<f32>(Heads { nh: 4, nkv: 2, hs: 48 }).is_err());
        let err = kernels_for_heads::<Bf16>(Heads { nh: 6, nkv: 4, hs: 64 }).unwrap_err().to_string();
        assert!(err.contains("4 key/value heads do not divide 6 query heads"), "{err}");
    }
}
