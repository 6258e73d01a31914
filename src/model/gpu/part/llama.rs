//! A Llama block on the GPU: the twin of model/llama.rs's block on one rank
//! (RMSNorm, q/k/v products, RoPE on q and k, grouped-query attention, o,
//! RMSNorm, SwiGLU, down), in the same kernel order, read from the part's
//! flat buffers. Weights keep Hugging Face's (out, in) layout, so every
//! product reads its weight transposed: forward is the input-gradient
//! product of a weight seen as (out, in), backward's input gradient the
//! forward product, and the weight gradient lands in (out, in) directly.
//! q, k and v are written into one (N, (NH + 2·NKV)·HS) buffer through
//! strided views, the layout the attention kernels read.
//!
//! This is the plain block (one rank, one slice); tp/llama.rs runs it split
//! over tensor-parallel ranks.

use super::{GpuPart, Result};
use crate::kernels::cuda::matmul::{self, Out, View};
use crate::kernels::cuda::rope::DeviceRope;
use crate::kernels::cuda::{attention, residual, rmsnorm, rope, swiglu};
use crate::kernels::cuda::{CudaError, DeviceBuffer, Elem, Gpu};
use crate::model::llama::{LlamaBlockShape, DOWN, GATE, IN_NORM, K, O, POST_NORM, Q, UP, V};

/// One Llama block's intermediates for one microbatch, kept from forward for backward.
pub(in crate::model::gpu) struct LlamaActs<X: Elem> {
    pub(in crate::model::gpu::part) n1: DeviceBuffer<X>,
    pub(in crate::model::gpu::part) rstd1: DeviceBuffer<f32>,
    /// (N, W): q and k after RoPE, then v.
    pub(in crate::model::gpu::part) qkv: DeviceBuffer<X>,
    pub(in crate::model::gpu::part) atty: DeviceBuffer<X>,
    pub(in crate::model::gpu::part) lse: DeviceBuffer<f32>,
    /// The residual stream after attention.
    pub(in crate::model::gpu::part) h: DeviceBuffer<X>,
    pub(in crate::model::gpu::part) n2: DeviceBuffer<X>,
    pub(in crate::model::gpu::part) rstd2: DeviceBuffer<f32>,
    /// (N, 2F): gate's outputs, then up's.
    pub(in crate::model::gpu::part) gate_up: DeviceBuffer<X>,
    pub(in crate::model::gpu::part) act: DeviceBuffer<X>,
}

impl<X: Elem> LlamaActs<X> {
    pub(super) fn new(gpu: &Gpu, b: usize, t: usize, s: &LlamaBlockShape) -> Result<Self> {
        let (n, c, f, heads) = (b * t, s.c, s.f, s.heads);
        Ok(LlamaActs {
            n1: gpu.alloc(n * c)?,
            rstd1: gpu.alloc(n)?,
            qkv: gpu.alloc(n * heads.qkv_width())?,
            atty: gpu.alloc(n * heads.out_width())?,
            lse: gpu.alloc(b * heads.nh * t)?,
            h: gpu.alloc(n * c)?,
            n2: gpu.alloc(n * c)?,
            rstd2: gpu.alloc(n)?,
            gate_up: gpu.alloc(n * 2 * f)?,
            act: gpu.alloc(n * f)?,
        })
    }

    pub(super) fn bytes(&self) -> usize {
        [&self.n1, &self.qkv, &self.atty, &self.h, &self.n2, &self.gate_up, &self.act]
            .iter()
            .map(|b| b.bytes())
            .sum::<usize>()
            + [&self.rstd1, &self.lse, &self.rstd2].iter().map(|b| b.bytes()).sum::<usize>()
    }
}

/// y (N, O) = x (N, I) · wᵀ, w (O, I) as `nn.Linear` keeps it.
fn linear<X: Elem>(gpu: &Gpu, y: View, x: View, w: u64, (n, i, o): (usize, usize, usize)) -> Result<()> {
    matmul::product_backward_input::<X>(gpu, y, Out::Storage, x, View::new(w, i), (n, o, i), false)
}

/// dx (N, I) [+]= dy (N, O) · w, w (O, I): a linear layer's input gradient.
fn linear_dx<X: Elem>(
    gpu: &Gpu,
    dx: View,
    dy: View,
    w: u64,
    (n, i, o): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    matmul::product_forward::<X>(gpu, dx, Out::Storage, dy, View::new(w, i), None, (n, o, i), accumulate)
}

/// dw (O, I) f32 += dyᵀ · x: a linear layer's weight gradient.
fn linear_dw<X: Elem>(gpu: &Gpu, dw: u64, dy: View, x: View, (n, i, o): (usize, usize, usize)) -> Result<()> {
    matmul::product_backward_weight::<X>(gpu, View::new(dw, i), x, dy, (n, o, i))
}

impl<X: Elem> GpuPart<X> {
    pub(super) fn rope_table(&self) -> Result<&DeviceRope> {
        self.s.rope.as_ref().ok_or_else(|| CudaError::Shape("a Llama part without its rotary table".into()))
    }

    /// Block l's forward for slot k (see `GpuPart::block_forward`).
    pub(super) fn llama_block_forward(&self, gpu: &Gpu, k: usize, l: usize, recomputing: bool) -> Result<()> {
        let s = LlamaBlockShape::of(&self.cfg);
        let (b, t, n) = (self.b, self.cfg.block_size, self.n());
        let (c, f, heads) = (s.c, s.f, s.heads);
        let (wd, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
        let base = self.spec.block_base(&self.cfg, l);
        let w = |i: usize| self.w(base + i);
        let x = &self.slots[k].stream[l];
        let (a, out) = self.forward_acts(k, l, recomputing);
        let a = a.llama()?;
        let table = self.rope_table()?;
        rmsnorm::rmsnorm_forward(gpu, &a.n1, &a.rstd1, x, w(IN_NORM), n, c, s.eps)?;
        let (n1, qkv) = (View::new(a.n1.ptr(), c), View::new(a.qkv.ptr(), wd));
        for (wi, col, width) in [(Q, 0, q), (K, q, kv), (V, q + kv, kv)] {
            linear::<X>(gpu, qkv.at::<X>(0, col), n1, w(wi), (n, c, width))?;
        }
        // q's and k's heads are the first NH + NKV head-wide column blocks.
        rope::rope_forward(gpu, &a.qkv, table, n, wd, 0, heads.nh + heads.nkv)?;
        attention::gqa_forward(gpu, &a.atty, &a.lse, &a.qkv, b, t, heads)?;
        linear::<X>(gpu, View::new(a.h.ptr(), c), View::new(a.atty.ptr(), q), w(O), (n, q, c))?;
        residual::residual_forward(gpu, a.h.ptr(), a.h.ptr(), x, n * c)?;
        rmsnorm::rmsnorm_forward(gpu, &a.n2, &a.rstd2, &a.h, w(POST_NORM), n, c, s.eps)?;
        let (n2, gate_up) = (View::new(a.n2.ptr(), c), View::new(a.gate_up.ptr(), 2 * f));
        for (wi, col) in [(GATE, 0), (UP, f)] {
            linear::<X>(gpu, gate_up.at::<X>(0, col), n2, w(wi), (n, c, f))?;
        }
        swiglu::swiglu_forward(gpu, &a.act, &a.gate_up, n, f)?;
        linear::<X>(gpu, View::new(out.ptr(), c), View::new(a.act.ptr(), f), w(DOWN), (n, f, c))?;
        residual::residual_forward(gpu, out.ptr(), out.ptr(), &a.h, n * c)
    }

    /// Block l's backward for slot k: `dres` holds ∂L/∂(block output) on
    /// entry and ∂L/∂(block input) on return; weight gradients accumulate
    /// as soon as their output gradient exists, as the CPU's full backward.
    pub(super) fn llama_block_backward(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        let s = LlamaBlockShape::of(&self.cfg);
        let (b, t, n) = (self.b, self.cfg.block_size, self.n());
        let (c, f, heads) = (s.c, s.f, s.heads);
        let (wd, q, kv) = (heads.qkv_width(), heads.out_width(), heads.nkv * heads.hs);
        let base = self.spec.block_base(&self.cfg, l);
        let (w, g) = (|i: usize| self.w(base + i), |i: usize| self.g(base + i));
        let x = &self.slots[k].stream[l];
        let a = self.backward_acts(k, l).llama()?;
        let table = self.rope_table()?;
        let sc = &self.s;
        let (dres, dn) = (View::new(sc.dres.ptr(), c), View::new(sc.dln.ptr(), c));
        // MLP: dres is ∂L/∂out, which is also the residual's share of ∂L/∂h.
        linear_dw::<X>(gpu, g(DOWN), dres, View::new(a.act.ptr(), f), (n, f, c))?;
        linear_dx::<X>(gpu, View::new(sc.dact.ptr(), f), dres, w(DOWN), (n, f, c), false)?;
        // swiglu_backward accumulates: its gradient starts from zero.
        gpu.zero(&sc.dfch)?;
        swiglu::swiglu_backward(gpu, &sc.dfch, &sc.dact, &a.gate_up, n, f)?;
        let dgu = View::new(sc.dfch.ptr(), 2 * f);
        for (j, (wi, col)) in [(GATE, 0), (UP, f)].into_iter().enumerate() {
            linear_dx::<X>(gpu, dn, dgu.at::<X>(0, col), w(wi), (n, c, f), j > 0)?;
        }
        let n2 = View::new(a.n2.ptr(), c);
        for (wi, col) in [(GATE, 0), (UP, f)] {
            linear_dw::<X>(gpu, g(wi), dgu.at::<X>(0, col), n2, (n, c, f))?;
        }
        rmsnorm::rmsnorm_backward_input(gpu, &sc.dres, &sc.dln, &a.h, w(POST_NORM), &a.rstd2, n, c)?;
        rmsnorm::rmsnorm_backward_weight(gpu, g(POST_NORM), &sc.ln_partial, &sc.dln, &a.h, &a.rstd2, n, c)?;
        // Attention: dres is now ∂L/∂h, the residual's share of ∂L/∂x.
        linear_dw::<X>(gpu, g(O), dres, View::new(a.atty.ptr(), q), (n, q, c))?;
        linear_dx::<X>(gpu, View::new(sc.datty.ptr(), q), dres, w(O), (n, q, c), false)?;
        attention::gqa_backward(gpu, &sc.dqkv, &sc.delta, &sc.datty, &a.qkv, &a.atty, &a.lse, b, t, heads)?;
        rope::rope_backward(gpu, &sc.dqkv, table, n, wd, 0, heads.nh + heads.nkv)?;
        let (dqkv, n1) = (View::new(sc.dqkv.ptr(), wd), View::new(a.n1.ptr(), c));
        let qkv = [(Q, 0, q), (K, q, kv), (V, q + kv, kv)];
        for (j, &(wi, col, width)) in qkv.iter().enumerate() {
            linear_dx::<X>(gpu, dn, dqkv.at::<X>(0, col), w(wi), (n, c, width), j > 0)?;
        }
        for (wi, col, width) in qkv {
            linear_dw::<X>(gpu, g(wi), dqkv.at::<X>(0, col), n1, (n, c, width))?;
        }
        rmsnorm::rmsnorm_backward_input(gpu, &sc.dres, &sc.dln, x, w(IN_NORM), &a.rstd1, n, c)?;
        rmsnorm::rmsnorm_backward_weight(gpu, g(IN_NORM), &sc.ln_partial, &sc.dln, x, &a.rstd1, n, c)
    }
}
