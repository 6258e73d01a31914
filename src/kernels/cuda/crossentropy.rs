//! Fused softmax + cross-entropy launcher (kernels/crossentropy.cu), twin of
//! kernels/cpu/crossentropy.rs. logits (N, Vp) X with V real columns; the
//! padding columns get zero gradient and never enter the softmax.

use super::device::{args, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};

/// losses (N) = −log softmax(logits)[target]; logits ← dlogits·dloss.
/// Targets must be < V (checked on the host by the caller that uploaded them).
#[allow(clippy::too_many_arguments)]
pub fn crossentropy_forward_backward<X: Elem>(
    gpu: &Gpu,
    logits: &DeviceBuffer<X>,
    losses: &DeviceBuffer<f32>,
    targets: &DeviceBuffer<u32>,
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
) -> Result<()> {
    ensure(vp >= v && logits.len() >= n * vp && losses.len() >= n && targets.len() >= n, || {
        format!("crossentropy: buffers for N={n} V={v} Vp={vp}")
    })?;
    let f = gpu.function::<X>("crossentropy", "crossentropy_forward_backward")?;
    let (l, lo, t, ni, vi, vpi) = (logits.ptr(), losses.ptr(), targets.ptr(), n as i32, v as i32, vp as i32);
    gpu.launch(f, (n as u32, 1, 1), (1024, 1, 1), &mut args![l, lo, t, dloss, ni, vi, vpi])
}

/// Evaluation: losses (N) = −log softmax(logits)[target], logits untouched;
/// with `argmax`, each row's prediction (the first column of its maximum).
#[allow(clippy::too_many_arguments)]
pub fn crossentropy_forward<X: Elem>(
    gpu: &Gpu,
    logits: &DeviceBuffer<X>,
    losses: &DeviceBuffer<f32>,
    argmax: Option<&DeviceBuffer<u32>>,
    targets: &DeviceBuffer<u32>,
    n: usize,
    v: usize,
    vp: usize,
) -> Result<()> {
    ensure(vp >= v && logits.len() >= n * vp && losses.len() >= n && targets.len() >= n, || {
        format!("crossentropy_forward: buffers for N={n} V={v} Vp={vp}")
    })?;
    ensure(argmax.is_none_or(|a| a.len() >= n), || "crossentropy_forward: argmax buffer too small".into())?;
    let f = gpu.function::<X>("crossentropy", "crossentropy_forward")?;
    let am: u64 = argmax.map_or(0, |a| a.ptr());
    let (l, lo, t, ni, vi, vpi) = (logits.ptr(), losses.ptr(), targets.ptr(), n as i32, v as i32, vp as i32);
    gpu.launch(f, (n as u32, 1, 1), (1024, 1, 1), &mut args![l, lo, am, t, ni, vi, vpi])
}
