//! Every CUDA kernel against its CPU twin on random inputs, for the f32 path
//! (relative error < 1e-5) and bf16 (< 1e-2), plus bit-identical repeats.
//! Used by `tests/cuda_gpu.rs` and by `pipewright gpu-check` (through
//! model/gpu/check.rs, which adds the whole-model group), so a GPU machine
//! without Rust runs the same checks from the release binary.
//!
//! Relative error is max |gpu − cpu| / max |cpu| over a tensor. bf16 inputs are
//! rounded before the CPU twin sees them, so only the GPU's storage rounding
//! and its summation order differ.

mod llama;

use super::{adamw, attention, crossentropy, ema, embedding, gelu, layernorm, matmul, residual, tree};
use super::{Bf16, DeviceBuffer, Elem, Gpu, Result};
use crate::kernels::cpu;
use crate::rng::{Purpose, Rng};
use attention::{Heads, Window};

/// One comparison's outcome.
#[derive(Clone, Debug)]
pub struct Check {
    pub name: String,
    pub rel_err: f64,
    pub tol: f64,
}

impl Check {
    pub fn passed(&self) -> bool {
        self.rel_err.is_finite() && self.rel_err < self.tol
    }
}

pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want.iter().fold(0.0f64, |m, &w| m.max((w as f64).abs())).max(1e-30);
    let diff = got.iter().zip(want).fold(0.0f64, |m, (&g, &w)| {
        let d = (g as f64 - w as f64).abs();
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    });
    diff / scale
}

/// [`rel_err`] of each `row`-long range against its own scale, the largest:
/// a tensor whose rows are separate results (a norm's rows, one loss per
/// position, a sum per range) is wrong when any row is, however small that
/// row's values are beside the others'.
pub fn rel_err_rows(got: &[f32], want: &[f32], row: usize) -> f64 {
    if got.len() != want.len() || row == 0 {
        return f64::INFINITY;
    }
    got.chunks(row).zip(want.chunks(row)).map(|(g, w)| rel_err(g, w)).fold(0.0, f64::max)
}

fn randn(n: usize, seed: u64, std: f64) -> Vec<f32> {
    let mut r = Rng::new(seed, Purpose::Test, &[n as u64]);
    (0..n).map(|_| (r.normal() * std) as f32).collect()
}

/// Rounds through X, so the CPU sees what the GPU stores.
fn rounded<X: Elem>(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| X::from_f32(x).to_f32()).collect()
}

struct Ctx<'a, X: Elem> {
    gpu: &'a Gpu,
    d: Dims,
    tag: &'static str,
    tol: f64,
    out: Vec<Check>,
    _x: std::marker::PhantomData<X>,
}

impl<X: Elem> Ctx<'_, X> {
    fn up(&self, v: &[f32]) -> Result<DeviceBuffer<X>> {
        self.gpu.upload_from_f32::<X>(v)
    }
    fn down(&self, b: &DeviceBuffer<X>) -> Result<Vec<f32>> {
        self.gpu.download_f32(b)
    }
    /// The storage type and the pass: "bf16", "f32 ragged".
    fn tagged(&self) -> String {
        format!("{}{}", self.tag, self.d.label)
    }
    fn push(&mut self, name: &str, got: &[f32], want: &[f32]) {
        self.out.push(Check {
            name: format!("{name} ({})", self.tagged()),
            rel_err: rel_err(got, want),
            tol: self.tol,
        });
    }
    /// Each `row`-long range against its own scale ([`rel_err_rows`]).
    fn push_rows(&mut self, name: &str, got: &[f32], want: &[f32], row: usize) {
        self.out.push(Check {
            name: format!("{name} ({})", self.tagged()),
            rel_err: rel_err_rows(got, want, row),
            tol: self.tol,
        });
    }
}

// The exactness checks' shapes: small enough to check in a second, large
// enough to cross every tile edge.
const B: usize = 2;
const T: usize = 160;
const NH: usize = 2;
const C: usize = NH * attention::HEAD_SIZE;
const N: usize = B * T;

/// The shapes one pass of a kernel group runs at. Every group runs twice per
/// storage type: at [`Dims::EVEN`], where grids are whole multiples of their
/// blocks, and at [`Dims::RAGGED`], where nothing is: an odd row count, a
/// sequence length that is a multiple of no tile (16, 32, 64), a channel count
/// that leaves a warp's last stride partial, element counts one past a multiple
/// of 256 (the grid's last block has one live thread). An off-by-one guard, or a
/// warp collective in code some lanes have left, fails only at the second.
#[derive(Clone, Copy, Debug)]
struct Dims {
    /// Appended to the storage type in each check's name.
    label: &'static str,
    b: usize,
    t: usize,
    /// Channels of the row kernels and the products (attention takes its own heads).
    c: usize,
    v: usize,
    /// The padded vocabulary (row stride of the logits).
    vp: usize,
    /// SwiGLU's hidden size.
    h: usize,
    /// Elements of the element-wise kernels.
    elems: usize,
}

impl Dims {
    /// Rows: b · t.
    fn n(&self) -> usize {
        self.b * self.t
    }

    const EVEN: Dims = Dims { label: "", b: 2, t: 160, c: C, v: 1000, vp: 1024, h: 200, elems: 4 * N * C };
    // 3 · 33 = 99 rows; 104 channels = 3 warp strides and 8 lanes (a multiple of
    // 8, as cuBLASLt's 16-byte rows need in bf16); 99 · 75 = 29 · 256 + 1
    // SwiGLU threads; 40961 = 160 · 256 + 1 elements.
    const RAGGED: Dims =
        Dims { label: " ragged", b: 3, t: 33, c: 104, v: 1001, vp: 1008, h: 75, elems: 40_961 };
}

fn layernorm_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    let gpu = cx.gpu;
    let x = rounded::<X>(&randn(d.n() * d.c, 1, 1.0));
    let w = rounded::<X>(&randn(d.c, 2, 1.0));
    let bias = rounded::<X>(&randn(d.c, 3, 1.0));
    let (mut out, mut mean, mut rstd) = (vec![0.0; d.n() * d.c], vec![0.0; d.n()], vec![0.0; d.n()]);
    cpu::layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &bias, d.n(), d.c);
    let (dx, dw, db) = (cx.up(&x)?, cx.up(&w)?, cx.up(&bias)?);
    let (gout, gmean, grstd) =
        (gpu.alloc::<X>(d.n() * d.c)?, gpu.alloc::<f32>(d.n())?, gpu.alloc::<f32>(d.n())?);
    layernorm::layernorm_forward(gpu, &gout, &gmean, &grstd, &dx, dw.ptr(), db.ptr(), d.n(), d.c)?;
    cx.push_rows("layernorm_forward out", &cx.down(&gout)?, &out, d.c);
    cx.push_rows("layernorm_forward rstd", &gpu.download(&grstd)?, &rstd, 1);

    let dout = rounded::<X>(&randn(d.n() * d.c, 4, 1.0));
    let dinp0 = rounded::<X>(&randn(d.n() * d.c, 5, 1.0));
    let (mut dinp, mut dweight, mut dbias) = (dinp0.clone(), vec![0.0; d.c], vec![0.0; d.c]);
    cpu::layernorm::layernorm_backward(
        &mut dinp,
        &mut dweight,
        &mut dbias,
        &dout,
        &x,
        &w,
        &mean,
        &rstd,
        d.n(),
        d.c,
    );
    let (gdout, gdinp) = (cx.up(&dout)?, cx.up(&dinp0)?);
    let (gdw, gdb) = (gpu.alloc::<f32>(d.c)?, gpu.alloc::<f32>(d.c)?);
    let partial = gpu.alloc::<f32>(layernorm::partial_len(d.n(), d.c))?;
    layernorm::layernorm_backward_input(gpu, &gdinp, &gdout, &dx, dw.ptr(), &gmean, &grstd, d.n(), d.c)?;
    layernorm::layernorm_backward_weight(
        gpu,
        gdw.ptr(),
        gdb.ptr(),
        &partial,
        &gdout,
        &dx,
        &gmean,
        &grstd,
        d.n(),
        d.c,
    )?;
    cx.push_rows("layernorm_backward dinp", &cx.down(&gdinp)?, &dinp, d.c);
    cx.push("layernorm_backward dweight", &gpu.download(&gdw)?, &dweight);
    cx.push("layernorm_backward dbias", &gpu.download(&gdb)?, &dbias);
    Ok(())
}

fn matmul_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    let gpu = cx.gpu;
    let (ic, oc) = (d.c, 3 * d.c);
    let inp = rounded::<X>(&randn(d.n() * ic, 10, 1.0));
    let w = rounded::<X>(&randn(ic * oc, 11, 0.1));
    let bias = rounded::<X>(&randn(oc, 12, 1.0));
    let mut out = vec![0.0; d.n() * oc];
    cpu::matmul::matmul_forward(&mut out, &inp, &w, Some(&bias), d.n(), ic, oc);
    let (ginp, gw, gb, gout) = (cx.up(&inp)?, cx.up(&w)?, cx.up(&bias)?, gpu.alloc::<X>(d.n() * oc)?);
    matmul::matmul_forward(gpu, &gout, &ginp, gw.ptr(), Some(gb.ptr()), d.n(), ic, oc)?;
    cx.push_rows("matmul_forward", &cx.down(&gout)?, &out, oc);

    let dout = rounded::<X>(&randn(d.n() * oc, 13, 1.0));
    let mut dinp = vec![0.0; d.n() * ic];
    cpu::matmul::matmul_backward_input(&mut dinp, &dout, &w, d.n(), ic, oc, false);
    let (gdout, gdinp) = (cx.up(&dout)?, gpu.alloc::<X>(d.n() * ic)?);
    matmul::matmul_backward_input(gpu, &gdinp, &gdout, gw.ptr(), d.n(), ic, oc)?;
    cx.push_rows("matmul_backward_input", &cx.down(&gdinp)?, &dinp, ic);

    let dw0 = randn(ic * oc, 14, 1.0);
    let (mut dw, mut db) = (dw0.clone(), vec![0.5; oc]);
    cpu::matmul::matmul_backward_weight(&mut dw, Some(&mut db), &dout, &inp, d.n(), ic, oc);
    let (gdw, gdb) = (gpu.upload(&dw0)?, gpu.upload(&vec![0.5f32; oc])?);
    let partial = gpu.alloc::<f32>(matmul::bias_partial_len(d.n(), oc))?;
    matmul::matmul_backward_weight(gpu, gdw.ptr(), Some(gdb.ptr()), &partial, &gdout, &ginp, d.n(), ic, oc)?;
    cx.push("matmul_backward_weight dweight", &gpu.download(&gdw)?, &dw);
    cx.push("matmul_backward_weight dbias", &gpu.download(&gdb)?, &db);
    Ok(())
}

fn attention_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    let causal = |heads| Case { heads, t: d.t, window: Window::Causal };
    // Sliding windows (Mistral) over a ragged T that is a multiple of no
    // tile (16, 32, 64): two keys (a row's window straddles tile edges, and
    // rows of one warp see none of a tile another row needs), a window inside
    // a 64-row block and one reaching past it. (One key would leave q and k
    // no gradient but rounding noise, which compares as noise.)
    // They run in the even pass only: their T is ragged in both.
    let sliding = |heads, w| Case { heads, t: T_RAGGED, window: Window::Sliding(w) };
    let windows = d.label.is_empty();
    let gqa64 = Heads { nh: 4, nkv: 2, hs: 64 };
    let mha = Heads::mha(NH * attention::HEAD_SIZE, NH);
    if X::IS_F32 {
        // The CUDA-core kernels (f32 storage) against the CPU backend's attention:
        // GPT-2's multi-head layout, then grouped-query heads (Llama's).
        attention_vs_cpu(cx, "", causal(mha), 20)?;
        attention_vs_cpu(cx, "gqa 4q/2kv ", causal(gqa64), 22)?;
        for w in [2, 37, 100].into_iter().filter(|_| windows) {
            attention_vs_cpu(cx, &format!("gqa 4q/2kv T={T_RAGGED} window {w} "), sliding(gqa64, w), 24)?;
        }
    } else {
        attention_vs_cpu(cx, "", causal(mha), 20)?;
        for heads in [
            Heads::mha(NH * 64, NH),
            Heads::mha(NH * 128, NH),
            Heads { nh: 4, nkv: 2, hs: 64 },
            Heads { nh: 4, nkv: 1, hs: 128 },
        ] {
            flash_against_twin(cx, causal(heads))?;
        }
        let sliding_cases = [(gqa64, 2), (gqa64, 37), (Heads { nh: 4, nkv: 1, hs: 128 }, 100)];
        for (heads, w) in sliding_cases.into_iter().filter(|_| windows) {
            flash_against_twin(cx, sliding(heads, w))?;
        }
    }
    if !windows {
        other_head_size_checks(cx)?;
    }
    Ok(())
}

/// Every other head size the kernels take (64 and, in bf16, 128 run above at
/// both passes), in the ragged pass only, small so CI barely notices (B 3,
/// T 33, two query heads sharing one key/value head): causal, and over a
/// window of 5 (rows of one 16-row warp see different tiles' keys). f32
/// runs the CUDA-core kernels against the CPU's attention; bf16 the
/// tensor-core kernels against their twin, and at 256 the CUDA-core kernels
/// against the CPU's attention.
fn other_head_size_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let t = cx.d.t;
    for hs in attention::CUDA_CORE_HEAD_SIZES {
        let heads = Heads { nh: 2, nkv: 1, hs };
        let kernels = attention::kernels_for_heads::<X>(heads)?;
        let skip = match kernels {
            attention::Kernels::TensorCore { .. } => hs == 64 || hs == 128,
            attention::Kernels::CudaCore { .. } => hs == 64,
        };
        if skip {
            continue;
        }
        for (window, seed) in [(Window::Causal, 30), (Window::Sliding(5), 40)] {
            let case = Case { heads, t, window };
            if matches!(kernels, attention::Kernels::TensorCore { .. }) {
                flash_against_twin(cx, case)?;
            } else {
                let label = match window {
                    Window::Causal => format!("hs{hs} gqa 2q/1kv "),
                    Window::Sliding(w) => format!("hs{hs} gqa 2q/1kv window {w} "),
                };
                attention_vs_cpu(cx, &label, case, seed + hs as u64)?;
            }
        }
    }
    Ok(())
}

/// The ragged sequence length of the sliding-window checks.
const T_RAGGED: usize = 147;

/// One attention problem: heads, sequence length and window (batch B).
#[derive(Clone, Copy)]
struct Case {
    heads: Heads,
    t: usize,
    window: Window,
}

/// Forward and backward of `case` against kernels/cpu/attention.rs.
fn attention_vs_cpu<X: Elem>(cx: &mut Ctx<X>, label: &str, case: Case, seed: u64) -> Result<()> {
    let d = cx.d;
    let gpu = cx.gpu;
    let Case { heads, t, window } = case;
    let (nh, w, c, n) = (heads.nh, heads.qkv_width(), heads.out_width(), d.b * t);
    let qkv = rounded::<X>(&randn(n * w, seed, 1.0));
    let (mut out, mut lse) = (vec![0.0; n * c], vec![0.0; d.b * nh * t]);
    let mut scratch = vec![0.0; cpu::attention::scratch_len(d.b, nh, t)];
    cpu::attention::gqa_window_forward(&mut out, &mut lse, &mut scratch, &qkv, d.b, t, heads, window);
    let (gqkv, gout, glse) = (cx.up(&qkv)?, gpu.alloc::<X>(n * c)?, gpu.alloc::<f32>(d.b * nh * t)?);
    attention::gqa_window_forward(gpu, &gout, &glse, &gqkv, d.b, t, heads, window)?;
    cx.push_rows(&format!("attention_forward {label}out"), &cx.down(&gout)?, &out, c);
    cx.push_rows(&format!("attention_forward {label}lse"), &gpu.download(&glse)?, &lse, t);

    let dout = rounded::<X>(&randn(n * c, seed + 1, 1.0));
    // The CPU backward gets the GPU's forward results, as the model would hand them over.
    let (gpu_out, gpu_lse) = (cx.down(&gout)?, gpu.download(&glse)?);
    let mut dqkv = vec![0.0; n * w];
    let (o, l) = (&gpu_out, &gpu_lse);
    cpu::attention::gqa_window_backward(&mut dqkv, &mut scratch, &dout, &qkv, o, l, d.b, t, heads, window);
    let (gdout, gdqkv, delta) = (cx.up(&dout)?, gpu.alloc::<X>(n * w)?, gpu.alloc::<f32>(d.b * nh * t)?);
    attention::gqa_window_backward(gpu, &gdqkv, &delta, &gdout, &gqkv, &gout, &glse, d.b, t, heads, window)?;
    push_qkv_parts(cx, &format!("attention_backward {label}"), heads, &cx.down(&gdqkv)?, &dqkv);
    Ok(())
}

/// Compares q, k and v gradients separately: each has its own scale.
fn push_qkv_parts<X: Elem>(cx: &mut Ctx<X>, prefix: &str, heads: Heads, got: &[f32], want: &[f32]) {
    let (w, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
    for (name, cols) in [("dq", 0..q), ("dk", q..q + kv), ("dv", q + kv..w)] {
        let pick =
            |v: &[f32]| -> Vec<f32> { v.chunks(w).flat_map(|row| row[cols.clone()].to_vec()).collect() };
        cx.push(&format!("{prefix}{name}"), &pick(got), &pick(want));
    }
}

/// The tensor-core kernels (bf16) against their CPU twin, which rounds P and
/// dS to bf16 where the kernels do: what is left is bf16 storage of the
/// outputs and the order of f32 sums (< 1e-2 relative, as every bf16 check).
fn flash_against_twin<X: Elem>(cx: &mut Ctx<X>, case: Case) -> Result<()> {
    let d = cx.d;
    use cpu::flash_attention::{flash_attention_backward, flash_attention_forward, Rounding};
    let gpu = cx.gpu;
    let Case { heads, t, window } = case;
    let (nh, hs, w, c, n) = (heads.nh, heads.hs, heads.qkv_width(), heads.out_width(), d.b * t);
    let mut label =
        if heads.nkv == nh { format!("hs{hs}") } else { format!("hs{hs} gqa {nh}q/{}kv", heads.nkv) };
    let mut seed = 90 + hs as u64 + 7 * heads.nkv as u64;
    if let Window::Sliding(width) = window {
        label = format!("{label} d.t={t} window {width}");
        seed += 1000 + width as u64;
    }
    let qkv = rounded::<X>(&randn(n * w, seed, 1.0));
    let (mut out, mut lse) = (vec![0.0; n * c], vec![0.0; d.b * nh * t]);
    flash_attention_forward(&mut out, &mut lse, &qkv, d.b, t, heads, window, Rounding::Bf16);
    let (gqkv, gout, glse) = (cx.up(&qkv)?, gpu.alloc::<X>(n * c)?, gpu.alloc::<f32>(d.b * nh * t)?);
    attention::gqa_window_forward(gpu, &gout, &glse, &gqkv, d.b, t, heads, window)?;
    cx.push_rows(&format!("flash forward {label} out vs twin"), &cx.down(&gout)?, &out, c);
    cx.push_rows(&format!("flash forward {label} lse vs twin"), &gpu.download(&glse)?, &lse, t);
    let dout = rounded::<X>(&randn(n * c, seed + 1, 1.0));
    let (gpu_out, gpu_lse) = (cx.down(&gout)?, gpu.download(&glse)?);
    let mut dqkv = vec![0.0; n * w];
    let (o, l) = (&gpu_out, &gpu_lse);
    flash_attention_backward(&mut dqkv, &dout, &qkv, o, l, d.b, t, heads, window, Rounding::Bf16);
    let (gdout, gdqkv, delta) = (cx.up(&dout)?, gpu.alloc::<X>(n * w)?, gpu.alloc::<f32>(d.b * nh * t)?);
    attention::gqa_window_backward(gpu, &gdqkv, &delta, &gdout, &gqkv, &gout, &glse, d.b, t, heads, window)?;
    push_qkv_parts(cx, &format!("flash backward {label} "), heads, &cx.down(&gdqkv)?, &dqkv);
    Ok(())
}

fn elementwise_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    let gpu = cx.gpu;
    let n = d.elems;
    let x = rounded::<X>(&randn(n, 30, 2.0));
    let mut y = vec![0.0; n];
    cpu::gelu::gelu_forward(&mut y, &x);
    let (gx, gy) = (cx.up(&x)?, gpu.alloc::<X>(n)?);
    gelu::gelu_forward(gpu, &gy, &gx, n)?;
    cx.push("gelu_forward", &cx.down(&gy)?, &y);
    let dy = rounded::<X>(&randn(n, 31, 1.0));
    let mut dx = vec![0.0; n];
    cpu::gelu::gelu_backward_into(&mut dx, &x, &dy, false);
    let gdy = cx.up(&dy)?;
    gelu::gelu_backward(gpu, &gdy, &gx, &gdy, n)?;
    cx.push("gelu_backward", &cx.down(&gdy)?, &dx);

    let a = rounded::<X>(&randn(n, 32, 1.0));
    let b = rounded::<X>(&randn(n, 33, 1.0));
    let mut s = vec![0.0; n];
    cpu::residual::residual_forward(&mut s, &a, &b);
    let (ga, gb) = (cx.up(&a)?, cx.up(&b)?);
    residual::residual_forward(gpu, ga.ptr(), ga.ptr(), &gb, n)?;
    cx.push("residual_forward", &cx.down(&ga)?, &s);
    Ok(())
}

fn crossentropy_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    let gpu = cx.gpu;
    let logits = rounded::<X>(&randn(d.n() * d.v, 40, 3.0));
    let mut r = Rng::new(41, Purpose::Test, &[]);
    let targets: Vec<u32> = (0..d.n()).map(|_| r.below(d.v as u64) as u32).collect();
    let dloss = 1.0 / d.n() as f32;
    let (mut grad, mut losses) = (logits.clone(), vec![0.0; d.n()]);
    cpu::crossentropy::crossentropy_forward_backward(&mut grad, &mut losses, &targets, dloss, d.n(), d.v);
    // Padding columns hold garbage on purpose: they must neither count nor get a gradient.
    let mut padded = vec![50.0f32; d.n() * d.vp];
    for (row, src) in padded.chunks_mut(d.vp).zip(logits.chunks(d.v)) {
        row[..d.v].copy_from_slice(src);
    }
    let (gl, glosses, gt) = (cx.up(&padded)?, gpu.alloc::<f32>(d.n())?, gpu.upload(&targets)?);
    crossentropy::crossentropy_forward_backward(gpu, &gl, &glosses, &gt, dloss, d.n(), d.v, d.vp)?;
    cx.push_rows("crossentropy losses", &gpu.download(&glosses)?, &losses, 1);
    let got = cx.down(&gl)?;
    let real: Vec<f32> = got.chunks(d.vp).flat_map(|r| r[..d.v].to_vec()).collect();
    cx.push_rows("crossentropy dlogits", &real, &grad, d.v);
    let pad: Vec<f32> = got.chunks(d.vp).flat_map(|r| r[d.v..].to_vec()).collect();
    cx.push("crossentropy padding gradient is zero", &pad, &vec![0.0; pad.len()]);

    // Evaluation: losses and argmax predictions, logits untouched.
    let (mut eval_losses, mut argmax) = (vec![0.0; d.n()], vec![0u32; d.n()]);
    cpu::crossentropy::crossentropy_forward(
        &logits,
        &mut eval_losses,
        &targets,
        Some(&mut argmax),
        d.n(),
        d.v,
    );
    let (gl, gam) = (cx.up(&padded)?, gpu.alloc::<u32>(d.n())?);
    crossentropy::crossentropy_forward(gpu, &gl, &glosses, Some(&gam), &gt, d.n(), d.v, d.vp)?;
    cx.push_rows("crossentropy_forward losses", &gpu.download(&glosses)?, &eval_losses, 1);
    let got_am = gpu.download(&gam)?;
    let wrong = got_am.iter().zip(&argmax).filter(|(a, b)| a != b).count();
    cx.out.push(Check {
        name: format!("crossentropy_forward argmax, rows differing ({})", cx.tagged()),
        rel_err: wrong as f64,
        tol: 0.5,
    });
    Ok(())
}

/// GPT-2's vocabulary with peaked rows (peak term 1, each other ≈ 4e-8, below
/// half an f32 ulp of 1), against an f64 reference of the same stored logits:
/// each row's loss within 1e-5 of its own size, in both precisions, since only
/// the summation can lose the tail.
fn crossentropy_gpt2_vocab_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    const V50K: usize = 50_257;
    const VP50K: usize = 50_304;
    let gpu = cx.gpu;
    let peaks = [0, 1, V50K / 2, V50K - 1, 64, 12_345];
    let n = peaks.len();
    let mut logits: Vec<f32> = randn(n * V50K, 42, 0.5).iter().map(|x| x - 17.0).collect();
    for (row, &p) in peaks.iter().enumerate() {
        logits[row * V50K + p] = 0.0;
    }
    let logits = rounded::<X>(&logits);
    let targets: Vec<u32> =
        peaks.iter().enumerate().map(|(i, &p)| if i % 2 == 0 { p } else { (p + 7) % V50K } as u32).collect();
    let want: Vec<f64> = logits
        .chunks(V50K)
        .zip(&targets)
        .map(|(row, &t)| {
            let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
            m + z.ln() - row[t as usize] as f64
        })
        .collect();
    let mut padded = vec![0.0f32; n * VP50K];
    for (row, src) in padded.chunks_mut(VP50K).zip(logits.chunks(V50K)) {
        row[..V50K].copy_from_slice(src);
    }
    let (glosses, gt) = (gpu.alloc::<f32>(n)?, gpu.upload(&targets)?);
    let row_err = |got: &[f32]| {
        got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs() / w.abs()).fold(0.0, f64::max)
    };
    let gl = cx.up(&padded)?;
    crossentropy::crossentropy_forward(gpu, &gl, &glosses, None, &gt, n, V50K, VP50K)?;
    let eval = row_err(&gpu.download(&glosses)?);
    crossentropy::crossentropy_forward_backward(gpu, &gl, &glosses, &gt, 1.0, n, V50K, VP50K)?;
    let train = row_err(&gpu.download(&glosses)?);
    for (name, err) in [("crossentropy_forward", eval), ("crossentropy_forward_backward", train)] {
        cx.out.push(Check {
            name: format!("{name} peaked V=50257 vs f64 ({})", cx.tagged()),
            rel_err: err,
            tol: 1e-5,
        });
    }
    Ok(())
}

/// Per-tensor sums of squares and the f32 add of the tied gradient shares.
fn norm_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let gpu = cx.gpu;
    let x = randn(70_001, 60, 1.0);
    let ranges = [(0, 1), (64, 5_000), (5_120, 64_881)];
    let gx = gpu.upload(&x)?;
    let got = adamw::sum_squares_ranges(gpu, &gx, &adamw::NormRanges::new(gpu, &ranges)?)?;
    let want: Vec<f32> = ranges.iter().map(|&(o, n)| cpu::adamw::sum_squares(&x[o..o + n]) as f32).collect();
    cx.push_rows("sum_squares_ranges", &got, &want, 1);
    // All ranges in one launch give each range the bits it has alone.
    let mut alone = Vec::new();
    for &r in &ranges {
        alone.extend(adamw::sum_squares_ranges(gpu, &gx, &adamw::NormRanges::new(gpu, &[r])?)?);
    }
    cx.out.push(Check {
        name: format!("sum_squares_ranges: each one's bits alone ({})", cx.tagged()),
        rel_err: bits_differ(&got, &alone),
        tol: 0.5,
    });
    let y = randn(70_001, 61, 1.0);
    let gy = gpu.upload(&y)?;
    let gs = gpu.alloc::<f32>(x.len())?;
    adamw::add_f32(gpu, gs.ptr(), gx.ptr(), gy.ptr(), x.len())?;
    let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    // An f32 add has one right answer: exact.
    let exact = rel_err(&gpu.download(&gs)?, &sum);
    cx.out.push(Check {
        name: format!("add_f32, exact ({})", cx.tagged()),
        rel_err: exact,
        tol: f64::MIN_POSITIVE,
    });
    Ok(())
}

/// The tensor-parallel tree join against its CPU twin `cpu::tree::tree_sum`, bit for bit:
/// the f32 sum (also in place on node 0) for 1, 2, 4 and 8 nodes of an odd
/// length, and the join into storage without and with a residual (in place
/// on it), which round exactly as the CPU's X(sum) and X(X(sum) + residual).
fn tree_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let gpu = cx.gpu;
    let len = 1_001;
    for count in [1, 2, 4, 8] {
        let flat = randn(count * len, 80 + count as u64, 1.0);
        let sum = cpu_tree(&flat, len);
        let nodes = gpu.upload(&flat)?;
        if X::IS_F32 {
            let out = gpu.alloc::<f32>(len)?;
            tree::tree_sum_f32(gpu, out.ptr(), nodes.ptr(), count, len)?;
            push_bits(cx, format!("tree_sum_f32 of {count}"), &gpu.download(&out)?, &sum);
        }
        let out = gpu.alloc::<X>(len)?;
        tree::tree_join::<X>(gpu, out.ptr(), nodes.ptr(), count, len, None)?;
        push_bits(cx, format!("tree_join of {count}"), &cx.down(&out)?, &rounded::<X>(&sum));
        let res = rounded::<X>(&randn(len, 90 + count as u64, 1.0));
        let want: Vec<f32> = rounded::<X>(&sum).iter().zip(&res).map(|(s, r)| s + r).collect();
        let gres = cx.up(&res)?;
        tree::tree_join::<X>(gpu, gres.ptr(), nodes.ptr(), count, len, Some(gres.ptr()))?;
        push_bits(cx, format!("tree_join of {count} + residual"), &cx.down(&gres)?, &rounded::<X>(&want));
        if X::IS_F32 {
            tree::tree_sum_f32(gpu, nodes.ptr(), nodes.ptr(), count, len)?;
            let got = gpu.download(&nodes)?;
            push_bits(cx, format!("tree_sum_f32 of {count} into node 0"), &got[..len], &sum);
        }
    }
    Ok(())
}

/// `cpu::tree::tree_sum` over the contiguous nodes of `flat`: node 0's result.
fn cpu_tree(flat: &[f32], len: usize) -> Vec<f32> {
    let mut nodes = flat.to_vec();
    let mut bufs: Vec<&mut [f32]> = nodes.chunks_mut(len).collect();
    cpu::tree::tree_sum(&mut bufs);
    bufs[0].to_vec()
}

/// A comparison that passes only when every element has the same bits.
fn push_bits<X: Elem>(cx: &mut Ctx<X>, name: String, got: &[f32], want: &[f32]) {
    let name = format!("{name}, bit for bit ({})", cx.tagged());
    cx.out.push(Check { name, rel_err: bits_differ(got, want), tol: 0.5 });
}

fn embedding_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    let gpu = cx.gpu;
    let wte = rounded::<X>(&randn(d.v * d.c, 50, 1.0));
    let wpe = rounded::<X>(&randn(d.t * d.c, 51, 1.0));
    let mut r = Rng::new(52, Purpose::Test, &[]);
    // A small id range, so ids repeat and the ownership lists matter.
    let tokens: Vec<u32> = (0..d.n()).map(|_| r.below(37) as u32 * 7).collect();
    let mut out = vec![0.0; d.n() * d.c];
    cpu::embedding::embedding_forward(&mut out, &tokens, &wte, &wpe, d.t, d.c);
    let (gwte, gwpe, mut gtok, gout) =
        (cx.up(&wte)?, cx.up(&wpe)?, embedding::DeviceTokens::new(gpu, d.n())?, gpu.alloc::<X>(d.n() * d.c)?);
    gtok.upload(gpu, &tokens)?;
    embedding::embedding_forward(gpu, &gout, &gtok, gwte.ptr(), gwpe.ptr(), d.n(), d.t, d.c)?;
    cx.push_rows("embedding_forward", &cx.down(&gout)?, &out, d.c);
    let dout = rounded::<X>(&randn(d.n() * d.c, 53, 1.0));
    let (mut dwte, mut dwpe) = (vec![0.0; d.v * d.c], vec![0.0; d.t * d.c]);
    cpu::embedding::embedding_backward(&mut dwte, &mut dwpe, &dout, &tokens, d.t, d.c);
    let (gdwte, gdwpe, gdout) = (gpu.alloc::<f32>(d.v * d.c)?, gpu.alloc::<f32>(d.t * d.c)?, cx.up(&dout)?);
    embedding::embedding_backward(gpu, gdwte.ptr(), Some(gdwpe.ptr()), &gdout, &gtok, d.b, d.t, d.c)?;
    cx.push_rows("embedding_backward dwte", &gpu.download(&gdwte)?, &dwte, d.c);
    cx.push("embedding_backward dwpe", &gpu.download(&gdwpe)?, &dwpe);
    // The token embedding alone (Llama), into fresh buffers: nothing of the above carries over.
    let mut out = vec![0.0; d.n() * d.c];
    cpu::embedding::token_embedding_forward(&mut out, &tokens, &wte, d.c);
    let gout = gpu.alloc::<X>(d.n() * d.c)?;
    embedding::token_embedding_forward(gpu, &gout, &gtok, gwte.ptr(), d.n(), d.c)?;
    cx.push_rows("token_embedding_forward", &cx.down(&gout)?, &out, d.c);
    let mut dwte = vec![0.0; d.v * d.c];
    cpu::embedding::token_embedding_backward(&mut dwte, &dout, &tokens, d.c);
    let gdwte = gpu.alloc::<f32>(d.v * d.c)?;
    embedding::embedding_backward(gpu, gdwte.ptr(), None, &gdout, &gtok, d.b, d.t, d.c)?;
    cx.push_rows("token_embedding_backward dwte", &gpu.download(&gdwte)?, &dwte, d.c);
    Ok(())
}

/// Three steps of one AdamW launch over three tensors against the CPU twin
/// applied tensor by tensor: one of a single element, one cut into two runs
/// (no decay), one into four (decay), with gaps between them that must come
/// through untouched.
fn adamw_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let gpu = cx.gpu;
    let run = adamw::ADAMW_RUN;
    let tensors = [(0, 1, true), (256, run + 300, false), (run + 768, 3 * run + 5, true)];
    let n = tensors[2].0 + tensors[2].1 + 77;
    let mut p = randn(n, 60, 1.0);
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let (gm, gp, gmm, gv) = (gpu.upload(&p)?, cx.up(&p)?, gpu.alloc::<f32>(n)?, gpu.alloc::<f32>(n)?);
    let runs = adamw::AdamwRuns::new(gpu, &tensors)?;
    assert_eq!(runs.runs(), 1 + 2 + 4);
    for step in 1..=3u64 {
        let g = randn(n, 60 + step, 1.0);
        let hp = cpu::adamw::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step };
        for &(o, len, decay) in &tensors {
            let r = o..o + len;
            cpu::adamw::adamw_update(
                &mut p[r.clone()],
                &g[r.clone()],
                &mut m[r.clone()],
                &mut v[r],
                &hp,
                decay,
                0.5,
            );
        }
        let gg = gpu.upload(&g)?;
        adamw::adamw_update(gpu, &gm, &gp, &gg, &gmm, &gv, &runs, &hp, 0.5)?;
    }
    cx.push("adamw_update master", &gpu.download(&gm)?, &p);
    cx.push("adamw_update m", &gpu.download(&gmm)?, &m);
    cx.push("adamw_update v", &gpu.download(&gv)?, &v);
    let copy = cx.down(&gp)?;
    let want: Vec<f32> = gpu.download(&gm)?.iter().map(|&x| X::from_f32(x).to_f32()).collect();
    cx.push("adamw_update param copy", &copy, &want);
    Ok(())
}

/// The EMA of the weights against its CPU twin `cpu::ema::ema_update`, bit
/// for bit: three updates of `d.elems` elements at decays on both sides of
/// the lerp's branch (a weight below 0.5, and from 0.5 up), values at the
/// scale of weights.
fn ema_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let gpu = cx.gpu;
    let n = cx.d.elems;
    for (k, decay) in [0.999, 0.9, 0.5, 0.3].into_iter().enumerate() {
        let seed = 90 + 10 * k as u64;
        let mut want = randn(n, seed, 0.05);
        let (ge, gp) = (gpu.upload(&want)?, gpu.alloc::<f32>(n)?);
        let weight = cpu::ema::weight_of(decay);
        for step in 1..=3 {
            let p = randn(n, seed + step, 0.05);
            cpu::ema::ema_update(&mut want, &p, weight);
            gpu.copy_to(&gp, 0, &p)?;
            ema::ema_update(gpu, &ge, &gp, n, weight)?;
        }
        push_bits(cx, format!("ema_update decay {decay}, 3 updates"), &gpu.download(&ge)?, &want);
    }
    Ok(())
}

/// The checks in the order `gpu-check` runs them; `gpu-check --only NAME` runs one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    Layernorm,
    Rmsnorm,
    Rope,
    Swiglu,
    Matmul,
    Attention,
    Elementwise,
    Crossentropy,
    Embedding,
    Adamw,
    Ema,
    Norm,
    Tree,
    Exactness,
    /// Whole training steps, run by model/gpu/check.rs (see [`StepChecks`]).
    Steps,
}

impl Group {
    pub const ALL: [Group; 15] = [
        Group::Layernorm,
        Group::Rmsnorm,
        Group::Rope,
        Group::Swiglu,
        Group::Matmul,
        Group::Attention,
        Group::Elementwise,
        Group::Crossentropy,
        Group::Embedding,
        Group::Adamw,
        Group::Ema,
        Group::Norm,
        Group::Tree,
        Group::Exactness,
        Group::Steps,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Group::Layernorm => "layernorm",
            Group::Rmsnorm => "rmsnorm",
            Group::Rope => "rope",
            Group::Swiglu => "swiglu",
            Group::Matmul => "matmul",
            Group::Attention => "attention",
            Group::Elementwise => "elementwise",
            Group::Crossentropy => "crossentropy",
            Group::Embedding => "embedding",
            Group::Adamw => "adamw",
            Group::Ema => "ema",
            Group::Norm => "norm",
            Group::Tree => "tree",
            Group::Exactness => "exactness",
            Group::Steps => "steps",
        }
    }

    /// Kernel groups run once per storage type (f32, then bf16); the EMA's
    /// kernel is f32 whatever the storage type: once, as f32.
    fn per_precision(self) -> bool {
        !matches!(self, Group::Ema | Group::Exactness | Group::Steps)
    }
}

impl std::str::FromStr for Group {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Group, String> {
        Group::ALL.into_iter().find(|g| g.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Group::ALL.iter().map(|g| g.name()).collect();
            format!("no check group {s:?}: expected one of {}", names.join(", "))
        })
    }
}

/// What `run` reports as it goes, so a crash still shows what ran before it.
pub enum Progress<'a> {
    /// A group starts (with its storage type, or "" for the whole-model groups).
    Started(Group, &'static str),
    Finished(Group, &'a Check),
}

fn run_precision<X: Elem>(
    gpu: &Gpu,
    g: Group,
    tag: &'static str,
    tol: f64,
    out: &mut Vec<Check>,
) -> Result<()> {
    for d in [Dims::EVEN, Dims::RAGGED] {
        let mut cx = Ctx::<X> { gpu, d, tag, tol, out: vec![], _x: std::marker::PhantomData };
        let even = d.label.is_empty();
        // adamw, norm and tree choose their own odd lengths: one pass.
        let ran = match g {
            Group::Layernorm => layernorm_checks(&mut cx),
            Group::Rmsnorm => llama::rmsnorm_checks(&mut cx),
            Group::Rope => llama::rope_checks(&mut cx),
            Group::Swiglu => llama::swiglu_checks(&mut cx),
            Group::Matmul => matmul_checks(&mut cx),
            Group::Attention => attention_checks(&mut cx),
            Group::Elementwise => elementwise_checks(&mut cx),
            Group::Crossentropy => crossentropy_checks(&mut cx).and_then(|()| {
                if even {
                    crossentropy_gpt2_vocab_checks(&mut cx)
                } else {
                    Ok(())
                }
            }),
            Group::Embedding => embedding_checks(&mut cx),
            Group::Adamw if even => adamw_checks(&mut cx),
            Group::Norm if even => norm_checks(&mut cx),
            Group::Tree if even => tree_checks(&mut cx),
            Group::Ema => ema_checks(&mut cx),
            Group::Adamw | Group::Norm | Group::Tree | Group::Exactness | Group::Steps => Ok(()),
        };
        // Checks made before an error are kept: they are reported with it.
        out.append(&mut cx.out);
        ran?;
    }
    Ok(())
}

/// The checks of group `steps`, which drive the whole model: that sits above
/// the kernels (model/gpu/check.rs), so it is handed to [`run`] from there.
pub type StepChecks<'a> = &'a mut dyn FnMut(&mut Vec<Check>) -> Result<()>;

/// Runs every group (or `only` one), reporting each check as it finishes;
/// on an error, the checks that finished before it have been reported.
/// Without `steps` the `steps` group is left out: the kernels' checks alone.
pub fn run(
    gpu: &Gpu,
    only: Option<Group>,
    report: &mut dyn FnMut(Progress),
    mut steps: Option<StepChecks>,
) -> Result<Vec<Check>> {
    let mut all = vec![];
    let has_steps = steps.is_some();
    let wanted = |g: &Group| only.is_none_or(|o| o == *g) && (*g != Group::Steps || has_steps);
    for g in Group::ALL.into_iter().filter(wanted) {
        let runs: &[(&'static str, bool)] =
            if g.per_precision() { &[("f32", true), ("bf16", false)] } else { &[("", false)] };
        for &(tag, f32) in runs {
            report(Progress::Started(g, tag));
            let mut out = vec![];
            let ran = match g {
                Group::Exactness => exactness_checks(gpu, &mut out),
                Group::Ema => run_precision::<f32>(gpu, g, "f32", 1e-5, &mut out),
                Group::Steps => steps.as_mut().map_or(Ok(()), |run_steps| run_steps(&mut out)),
                _ if f32 => run_precision::<f32>(gpu, g, tag, 1e-5, &mut out),
                _ => run_precision::<Bf16>(gpu, g, tag, 1e-2, &mut out),
            };
            for c in &out {
                report(Progress::Finished(g, c));
            }
            all.append(&mut out);
            ran.map_err(|e| e.in_group(g))?;
        }
    }
    Ok(all)
}

/// One check as `gpu-check` prints it: verdict, [group], name, error, tolerance.
pub fn line(g: Group, c: &Check) -> String {
    let verdict = if c.passed() { "ok  " } else { "FAIL" };
    format!("{verdict} [{}] {:<52} {:>10.3e}  (< {:.0e})", g.name(), c.name, c.rel_err, c.tol)
}

/// The global norm, the casts, and bit-identical repeats of the kernels whose
/// reductions could drift between runs if they used atomics.
fn exactness_checks(gpu: &Gpu, out: &mut Vec<Check>) -> Result<()> {
    let x = randn(3_000_001, 70, 1.0);
    let (gx, whole) = (gpu.upload(&x)?, adamw::NormRanges::new(gpu, &[(0, x.len())])?);
    let got = adamw::sum_squares_ranges(gpu, &gx, &whole)?[0];
    let want = cpu::adamw::sum_squares(&x);
    out.push(Check {
        name: "global norm (sum of squares)".into(),
        rel_err: (got as f64 - want).abs() / want,
        tol: 1e-5,
    });
    let again = adamw::sum_squares_ranges(gpu, &gx, &whole)?[0];
    out.push(Check {
        name: "global norm repeats bit for bit".into(),
        rel_err: bits_differ(&[got], &[again]),
        tol: 0.5,
    });

    let gb = gpu.alloc::<Bf16>(x.len())?;
    super::cast::cast_f32_to_bf16(gpu, &gb, &gx)?;
    let host: Vec<u16> = x.iter().map(|&v| Bf16::from_f32(v).to_bits()).collect();
    let dev: Vec<u16> = gpu.download(&gb)?.iter().map(|b| b.to_bits()).collect();
    let mismatches = host.iter().zip(&dev).filter(|(a, b)| a != b).count();
    out.push(Check {
        name: "cast f32 → bf16 equals the host's rounding".into(),
        rel_err: mismatches as f64,
        tol: 0.5,
    });
    let back = gpu.alloc::<f32>(x.len())?;
    super::cast::cast_bf16_to_f32(gpu, &back, &gb)?;
    let host_back: Vec<f32> = host.iter().map(|&h| Bf16::from_bits(h).to_f32()).collect();
    out.push(Check {
        name: "cast bf16 → f32 is exact".into(),
        rel_err: bits_differ(&gpu.download(&back)?, &host_back),
        tol: 0.5,
    });

    // Attention backward and LayerNorm weight gradients twice on the same inputs.
    let qkv = gpu.upload_from_f32::<Bf16>(&randn(N * 3 * C, 80, 1.0))?;
    let dout = gpu.upload_from_f32::<Bf16>(&randn(N * C, 81, 1.0))?;
    let (o, lse, delta) =
        (gpu.alloc::<Bf16>(N * C)?, gpu.alloc::<f32>(B * NH * T)?, gpu.alloc::<f32>(B * NH * T)?);
    attention::attention_forward(gpu, &o, &lse, &qkv, B, T, C, NH)?;
    let mut runs = vec![];
    for _ in 0..2 {
        let d = gpu.alloc::<Bf16>(N * 3 * C)?;
        attention::attention_backward(gpu, &d, &delta, &dout, &qkv, &o, &lse, B, T, C, NH)?;
        runs.push(gpu.download_f32(&d)?);
    }
    out.push(Check {
        name: "attention_backward repeats bit for bit".into(),
        rel_err: bits_differ(&runs[0], &runs[1]),
        tol: 0.5,
    });
    let partial = gpu.alloc::<f32>(layernorm::partial_len(N, C))?;
    let (mean, rstd) = (gpu.upload(&vec![0.1f32; N])?, gpu.upload(&vec![1.3f32; N])?);
    let mut runs = vec![];
    for _ in 0..2 {
        let (dw, db) = (gpu.alloc::<f32>(C)?, gpu.alloc::<f32>(C)?);
        layernorm::layernorm_backward_weight(
            gpu,
            dw.ptr(),
            db.ptr(),
            &partial,
            &dout,
            &o,
            &mean,
            &rstd,
            N,
            C,
        )?;
        let mut v = gpu.download(&dw)?;
        v.extend(gpu.download(&db)?);
        runs.push(v);
    }
    out.push(Check {
        name: "layernorm weight gradient repeats bit for bit".into(),
        rel_err: bits_differ(&runs[0], &runs[1]),
        tol: 0.5,
    });
    Ok(())
}

/// 1.0 when any element's bits differ, else 0.0 (checked against tolerance 0.5).
pub fn bits_differ(a: &[f32], b: &[f32]) -> f64 {
    let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    if same {
        0.0
    } else {
        1.0
    }
}

/// Every kernel check (each group in f32, then bf16), then the exactness checks.
pub fn run_all(gpu: &Gpu) -> Result<Vec<Check>> {
    let mut all = vec![];
    for g in Group::ALL.into_iter().filter(|&g| g != Group::Steps) {
        all.extend(run(gpu, Some(g), &mut |_| {}, None)?);
    }
    Ok(all)
}

/// A table of the checks, one per line.
pub fn table(checks: &[Check]) -> String {
    let mut s = String::new();
    for c in checks {
        let verdict = if c.passed() { "ok  " } else { "FAIL" };
        s.push_str(&format!("{verdict} {:<52} {:>10.3e}  (< {:.0e})\n", c.name, c.rel_err, c.tol));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_small_range_fails_against_its_own_scale_not_the_largest() {
        // Three sums of squares of very different sizes; the smallest is 40% off
        // (a sum one element too long), the others exact.
        let want = [1.0f32, 5_000.0, 65_000.0];
        let got = [1.4f32, 5_000.0, 65_000.0];
        assert!(rel_err(&got, &want) < 1e-5, "the whole tensor's scale hides it");
        assert!((rel_err_rows(&got, &want, 1) - 0.4).abs() < 1e-6);
        // Rows of two: the first row holds the wrong value.
        assert!(rel_err_rows(&[1.0, 1.4, 9.0, 9.0], &[1.0, 1.0, 9.0, 9.0], 2) > 0.39);
        assert_eq!(rel_err_rows(&[1.0, 2.0], &[1.0, 2.0], 2), 0.0);
        assert_eq!(rel_err_rows(&[1.0], &[1.0, 2.0], 1), f64::INFINITY);
        assert_eq!(rel_err_rows(&[1.0], &[1.0], 0), f64::INFINITY);
        // A row of exact zeros on both sides compares equal; a nonzero there does not.
        assert_eq!(rel_err_rows(&[0.0, 0.0, 3.0], &[0.0, 0.0, 3.0], 2), 0.0);
        assert!(rel_err_rows(&[1e-6, 0.0], &[0.0, 0.0], 2) > 1.0);
    }

    #[test]
    fn the_ragged_pass_leaves_every_grid_partial() {
        let d = Dims::RAGGED;
        assert_eq!(d.n() % 2, 1, "an odd row count");
        for tile in [16, 32, 64] {
            assert_ne!(d.t % tile, 0, "T a multiple of no tile");
        }
        assert_ne!(d.c % 32, 0, "a warp's last stride partial");
        assert_eq!(d.c % 8, 0, "bf16 rows of whole 16 bytes, as cuBLASLt's plans take");
        assert_eq!(d.n() * d.h % 256, 1, "SwiGLU's last block has one live thread");
        assert_eq!(d.elems % 256, 1, "the element-wise kernels' last block has one live thread");
        assert!(d.vp >= d.v && d.v % 2 == 1);
        // The even pass is what its name says, so a failure at the ragged one
        // alone points at an edge.
        let e = Dims::EVEN;
        assert_eq!((e.n() * e.h) % 256, 0);
        assert_eq!(e.elems % 256, 0);
    }
}
