//! A Llama block split over tensor-parallel ranks on GPUs: the twin of
//! model/llama.rs's split, in tp.rs's phases. A rank holds the q rows of
//! its query heads, the k and v rows of their key/value heads (a group never
//! straddles ranks), a row block of gate and up, and the matching input
//! columns of o and down; the RMSNorms are computed on every rank and their
//! weight gradients on rank 0. Slice j of S reads query heads
//! [j·NH/S, (j+1)·NH/S), key/value heads [j·NKV/S, ..) and MLP rows
//! [j·F/S, ..); the sums over slices (o's and down's products, and in
//! backward the input gradients of q/k/v and of gate/up, parts added within a
//! slice in that order) go through f32 leaves, the rank's subtree and the
//! group's join as GPT-2's do, so every rank count dividing S gives one
//! rank's bits. Weights are (out, in): a rank's rows of q, k, v, gate and up
//! are contiguous, its columns of o and down are strided views.

use super::GpuPart;
use crate::kernels::cuda::matmul::{self, Out, View};
use crate::kernels::cuda::{attention, rmsnorm, rope, swiglu};
use crate::kernels::cuda::{DeviceBuffer, Elem, Gpu, Result};
use crate::model::llama::{LlamaBlockShape, DOWN, GATE, IN_NORM, K, O, POST_NORM, Q, UP, V};

/// One rank's share of a block: the whole shape, this rank's, and one slice's widths.
struct Split {
    whole: LlamaBlockShape,
    local: LlamaBlockShape,
    /// Query, key/value and MLP widths of one slice.
    pq: usize,
    pkv: usize,
    pf: usize,
    /// The global index of this rank's first slice, and its slice count.
    first: usize,
    leaves: usize,
}

impl Split {
    /// The rank's q, k and v: (weight, this rank's first column in qkv, slice width).
    fn qkv(&self) -> [(usize, usize, usize); 3] {
        let (q, kv) = (self.local.heads.out_width(), self.local.heads.nkv * self.local.heads.hs);
        [(Q, 0, self.pq), (K, q, self.pkv), (V, q + kv, self.pkv)]
    }

    /// The rank's gate and up: (weight, this rank's first column in gate_up).
    fn gate_up(&self) -> [(usize, usize); 2] {
        [(GATE, 0), (UP, self.local.f)]
    }
}

impl<X: Elem> GpuPart<X> {
    fn split(&self) -> Split {
        let whole = LlamaBlockShape::of(&self.cfg);
        let (size, slices) = (self.tp.size, self.tp.slices);
        Split {
            local: whole.share(size),
            pq: whole.heads.out_width() / slices,
            pkv: whole.heads.nkv * whole.heads.hs / slices,
            pf: whole.f / slices,
            first: self.tp.rank * self.tp.leaves(),
            leaves: self.tp.leaves(),
            whole,
        }
    }

    /// Column-parallel products of slices: out[:, col0 + j·per ..] (rows `ld`
    /// apart) = inp (N, C) · w[rows of global slice first + j, :]ᵀ.
    fn llama_columns(
        &self,
        gpu: &Gpu,
        out: View,
        inp: &DeviceBuffer<X>,
        wi: usize,
        (col0, per): (usize, usize),
        sp: &Split,
    ) -> Result<()> {
        let (n, c) = (self.n(), sp.whole.c);
        for j in 0..sp.leaves {
            let w = View::new(self.w(wi), c).at::<X>((sp.first + j) * per, 0);
            let (o, x) = (out.at::<X>(0, col0 + j * per), View::new(inp.ptr(), c));
            matmul::product_backward_input::<X>(gpu, o, Out::Storage, x, w, (n, per, c), false)?;
        }
        Ok(())
    }

    /// Row-parallel products into the leaves, then the rank's subtree:
    /// leaf j (N, C) f32 = inp[:, j·per ..] (rows `ld` apart) · w[:, global slice]ᵀ,
    /// w (C, K) with K = `per` · slices.
    fn llama_rows(&self, gpu: &Gpu, inp: View, wi: usize, per: usize, sp: &Split) -> Result<()> {
        let (n, c, k) = (self.n(), sp.whole.c, per * self.tp.slices);
        for j in 0..sp.leaves {
            let leaf = View::new(self.s.leaves.ptr(), c).at::<f32>(j * n, 0);
            let w = View::new(self.w(wi), k).at::<X>(0, (sp.first + j) * per);
            matmul::product_backward_input::<X>(
                gpu,
                leaf,
                Out::F32,
                inp.at::<X>(0, j * per),
                w,
                (n, c, per),
                false,
            )?;
        }
        self.subtree(gpu)
    }

    /// Forward from the block input to o's subtree sum.
    pub(super) fn llama_tp_attention(&self, gpu: &Gpu, k: usize, l: usize, rc: bool) -> Result<()> {
        let sp = self.split();
        let (b, t, n, c, eps) = (self.b, self.cfg.block_size, self.n(), sp.whole.c, sp.whole.eps);
        let (base, heads) = (self.spec.block_base(&self.cfg, l), sp.local.heads);
        let x = &self.slots[k].stream[l];
        let a = self.forward_acts(k, l, rc).0.llama()?;
        rmsnorm::rmsnorm_forward(gpu, &a.n1, &a.rstd1, x, self.w(base + IN_NORM), n, c, eps)?;
        let qkv = View::new(a.qkv.ptr(), heads.qkv_width());
        for (wi, col0, per) in sp.qkv() {
            self.llama_columns(gpu, qkv, &a.n1, base + wi, (col0, per), &sp)?;
        }
        rope::rope_forward(gpu, &a.qkv, self.rope_table()?, n, heads.qkv_width(), 0, heads.nh + heads.nkv)?;
        attention::gqa_forward(gpu, &a.atty, &a.lse, &a.qkv, b, t, heads)?;
        self.llama_rows(gpu, View::new(a.atty.ptr(), heads.out_width()), base + O, sp.pq, &sp)
    }

    /// From o's sums (h = Σ + x) to down's subtree sum.
    pub(super) fn llama_tp_mlp(&self, gpu: &Gpu, k: usize, l: usize, rc: bool) -> Result<()> {
        let sp = self.split();
        let (n, c, f, eps) = (self.n(), sp.whole.c, sp.local.f, sp.whole.eps);
        let base = self.spec.block_base(&self.cfg, l);
        let a = self.forward_acts(k, l, rc).0.llama()?;
        self.join(gpu, &a.h, Some(&self.slots[k].stream[l]))?;
        rmsnorm::rmsnorm_forward(gpu, &a.n2, &a.rstd2, &a.h, self.w(base + POST_NORM), n, c, eps)?;
        let gate_up = View::new(a.gate_up.ptr(), 2 * f);
        for (wi, col0) in sp.gate_up() {
            self.llama_columns(gpu, gate_up, &a.n2, base + wi, (col0, sp.pf), &sp)?;
        }
        swiglu::swiglu_forward(gpu, &a.act, &a.gate_up, n, f)?;
        self.llama_rows(gpu, View::new(a.act.ptr(), f), base + DOWN, sp.pf, &sp)
    }

    /// The block's output, out = Σ + h.
    pub(super) fn llama_tp_out(&self, gpu: &Gpu, k: usize, l: usize, rc: bool) -> Result<()> {
        let (a, out) = self.forward_acts(k, l, rc);
        self.join(gpu, out, Some(&a.llama()?.h))
    }

    /// A row-parallel product's backward: its weight's gradient, dw[:, global
    /// slice] += dresᵀ · inp[:, j·per ..], and dx[:, j·per ..] = dres · w[:, global slice].
    fn llama_rows_back(
        &self,
        gpu: &Gpu,
        inp: View,
        dx: View,
        wi: usize,
        per: usize,
        sp: &Split,
    ) -> Result<()> {
        let (n, c, k) = (self.n(), sp.whole.c, per * self.tp.slices);
        let dres = View::new(self.s.dres.ptr(), c);
        for j in 0..sp.leaves {
            let col = (sp.first + j) * per;
            let dw = View::new(self.g(wi), k).at::<f32>(0, col);
            matmul::product_backward_weight::<X>(gpu, dw, inp.at::<X>(0, j * per), dres, (n, c, per))?;
            let w = View::new(self.w(wi), k).at::<X>(0, col);
            matmul::product_forward::<X>(
                gpu,
                dx.at::<X>(0, j * per),
                Out::Storage,
                dres,
                w,
                None,
                (n, c, per),
                false,
            )?;
        }
        Ok(())
    }

    /// The input gradient of column-parallel products into the leaves, then
    /// the rank's subtree: leaf j = Σ over `parts` (weight, first column of
    /// dy, slice width), in order, of dy[:, col0 + j·per ..] · w[rows of global slice].
    fn llama_columns_dx(
        &self,
        gpu: &Gpu,
        dy: View,
        parts: &[(usize, usize, usize)],
        sp: &Split,
    ) -> Result<()> {
        let (n, c) = (self.n(), sp.whole.c);
        for j in 0..sp.leaves {
            let leaf = View::new(self.s.leaves.ptr(), c).at::<f32>(j * n, 0);
            for (q, &(wi, col0, per)) in parts.iter().enumerate() {
                let w = View::new(self.w(wi), c).at::<X>((sp.first + j) * per, 0);
                let d = dy.at::<X>(0, col0 + j * per);
                matmul::product_forward::<X>(gpu, leaf, Out::F32, d, w, None, (n, per, c), q > 0)?;
            }
        }
        self.subtree(gpu)
    }

    /// Column-parallel weights' gradients: dw[rows of global slice] += dy[:, col0 + j·per ..]ᵀ · inp.
    fn llama_columns_dw(
        &self,
        gpu: &Gpu,
        dy: View,
        inp: &DeviceBuffer<X>,
        parts: &[(usize, usize, usize)],
        sp: &Split,
    ) -> Result<()> {
        let (n, c) = (self.n(), sp.whole.c);
        for j in 0..sp.leaves {
            for &(wi, col0, per) in parts {
                let dw = View::new(self.g(wi), c).at::<f32>((sp.first + j) * per, 0);
                let d = dy.at::<X>(0, col0 + j * per);
                matmul::product_backward_weight::<X>(gpu, dw, View::new(inp.ptr(), c), d, (n, per, c))?;
            }
        }
        Ok(())
    }

    /// An RMSNorm's backward from `dln`: the input's gradient added to `dres`
    /// on every rank, the weight's (not split) on rank 0.
    fn llama_norm_back(
        &self,
        gpu: &Gpu,
        inp: &DeviceBuffer<X>,
        wi: usize,
        rstd: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let (n, c, s) = (self.n(), self.cfg.n_embd, &self.s);
        rmsnorm::rmsnorm_backward_input(gpu, &s.dres, &s.dln, inp, self.w(wi), rstd, n, c)?;
        if self.is_owner() {
            rmsnorm::rmsnorm_backward_weight(gpu, self.g(wi), &s.ln_partial, &s.dln, inp, rstd, n, c)?;
        }
        Ok(())
    }

    /// Backward of down and SwiGLU, up to the subtree sum of ∂L/∂n2.
    pub(super) fn llama_tp_back_mlp(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        let sp = self.split();
        let (n, f, base, s) = (self.n(), sp.local.f, self.spec.block_base(&self.cfg, l), &self.s);
        let a = self.backward_acts(k, l).llama()?;
        let (act, dact) = (View::new(a.act.ptr(), f), View::new(s.dact.ptr(), f));
        self.llama_rows_back(gpu, act, dact, base + DOWN, sp.pf, &sp)?;
        // swiglu_backward accumulates: its gradient starts from zero.
        gpu.zero(&s.dfch)?;
        swiglu::swiglu_backward(gpu, &s.dfch, &s.dact, &a.gate_up, n, f)?;
        let parts = sp.gate_up().map(|(wi, col0)| (base + wi, col0, sp.pf));
        self.llama_columns_dx(gpu, View::new(s.dfch.ptr(), 2 * f), &parts, &sp)
    }

    /// From ∂L/∂n2's sums through attention, up to the subtree sum of ∂L/∂n1.
    pub(super) fn llama_tp_back_attention(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        let sp = self.split();
        let (b, t, n, f) = (self.b, self.cfg.block_size, self.n(), sp.local.f);
        let (base, heads, s) = (self.spec.block_base(&self.cfg, l), sp.local.heads, &self.s);
        let a = self.backward_acts(k, l).llama()?;
        self.join(gpu, &s.dln, None)?;
        let parts = sp.gate_up().map(|(wi, col0)| (base + wi, col0, sp.pf));
        self.llama_columns_dw(gpu, View::new(s.dfch.ptr(), 2 * f), &a.n2, &parts, &sp)?;
        self.llama_norm_back(gpu, &a.h, base + POST_NORM, &a.rstd2)?;
        // dres is now ∂L/∂h.
        let q = heads.out_width();
        let (atty, datty) = (View::new(a.atty.ptr(), q), View::new(s.datty.ptr(), q));
        self.llama_rows_back(gpu, atty, datty, base + O, sp.pq, &sp)?;
        attention::gqa_backward(gpu, &s.dqkv, &s.delta, &s.datty, &a.qkv, &a.atty, &a.lse, b, t, heads)?;
        let w = heads.qkv_width();
        rope::rope_backward(gpu, &s.dqkv, self.rope_table()?, n, w, 0, heads.nh + heads.nkv)?;
        let parts = sp.qkv().map(|(wi, col0, per)| (base + wi, col0, per));
        self.llama_columns_dx(gpu, View::new(s.dqkv.ptr(), w), &parts, &sp)
    }

    /// From ∂L/∂n1's sums to ∂L/∂(block input) in `dres`.
    pub(super) fn llama_tp_back_input(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        let sp = self.split();
        let (base, s) = (self.spec.block_base(&self.cfg, l), &self.s);
        let a = self.backward_acts(k, l).llama()?;
        self.join(gpu, &s.dln, None)?;
        let parts = sp.qkv().map(|(wi, col0, per)| (base + wi, col0, per));
        let dqkv = View::new(s.dqkv.ptr(), sp.local.heads.qkv_width());
        self.llama_columns_dw(gpu, dqkv, &a.n1, &parts, &sp)?;
        let x = &self.slots[k].stream[l];
        self.llama_norm_back(gpu, x, base + IN_NORM, &a.rstd1)
    }
}
