//! The one block split over tensor-parallel ranks on GPUs: the twin of the
//! CPU block's split (model/block/split.rs, `Role::cut`), in tp.rs's phases,
//! reading the same settings as the plain block (part/block.rs). A rank
//! holds the q rows of its query heads, the k and v rows of their key/value
//! heads (a group never straddles ranks), a row block of gate and up (or of
//! up alone), with their biases' rows, and the matching input columns of o
//! and down; the norms are computed on every rank and their gradients, with
//! o's and down's biases', on rank 0 alone. Slice j of S reads query heads
//! [j·NH/S, (j+1)·NH/S), key/value heads [j·NKV/S, ..) and MLP rows
//! [j·F/S, ..); the sums over slices (o's and down's products, and in
//! backward the input gradients of q/k/v and of the MLP's first products,
//! parts added within a slice in that order) go through f32 leaves, the
//! rank's subtree and the group's join, so every rank count dividing S gives
//! one rank's bits. o's and down's biases join global slice 0's leaf (rank
//! 0's first), once, in f32 from the master copy. Weights are (out, in): a
//! rank's rows of q, k, v, gate and up are contiguous, its columns of o and
//! down are strided views.
//!
//! With the q/k norm (Qwen3's), each rank normalises its own heads of q and
//! k with the whole gains; a gain's gradient is a split sum too: a partial
//! per slice of the rank's heads (rows in chunk order, then the slice's
//! heads in order), the rank's slice tree into its node of a small gathered
//! buffer, the group's all-gather (tp.rs, after the attention phase), and
//! the owner's join of the nodes by the tree's upper levels, added to the
//! gradient once: the slice tree over all S slices, whatever the ranks.

use super::super::block::{
    act_backward, act_forward, mlp_in_parts, norm_backward_input, norm_backward_weight, norm_forward,
    product_view, qk_norm_backward_input, qk_norm_backward_weight, qk_norm_forward, qkv_parts, window,
};
use super::{at, GpuPart, GpuTp};
use crate::kernels::cuda::matmul::{self, Out, View};
use crate::kernels::cuda::{adamw, attention, rope, tree};
use crate::kernels::cuda::{ensure, DeviceBuffer, Elem, Gpu, Result};
use crate::model::arch::{Arch, Role};
use crate::model::block::Share;

/// One column-parallel product of a rank's: its weight's and bias's tensor
/// indices, its first column in the rank's output buffer, and the rank's
/// width (`leaves` slices).
type Part = (usize, Option<usize>, usize, usize);

/// One rank's share of a block and where its slices sit.
struct Split {
    local: Share,
    /// The global index of this rank's first slice, and its slice count.
    first: usize,
    leaves: usize,
}

impl Split {
    fn of(cfg: &Arch, tp: GpuTp) -> Split {
        Split { local: Share::of(cfg, tp.size), first: tp.rank * tp.leaves(), leaves: tp.leaves() }
    }

    /// Where the rank's slice j of a split tensor, `per` rows (column-parallel)
    /// or columns (row-parallel) wide, starts in the whole tensor.
    fn global(&self, j: usize, per: usize) -> usize {
        (self.first + j) * per
    }
}

impl<X: Elem> GpuPart<X> {
    fn split(&self) -> Split {
        Split::of(&self.cfg, self.tp)
    }

    /// Block l's q, k and v on this rank, as products of columns of the
    /// qkv rows `post` or, q's and k's with the q/k norm, `raw` (their
    /// outputs in forward, their gradients in backward: `product_view`).
    fn qkv_of(&self, l: usize, sp: &Split, post: View, raw: View) -> [(View, Part); 3] {
        let (ts, heads) = (self.block_tensors(l), sp.local.heads);
        qkv_parts(heads.out_width(), heads.nkv * heads.hs)
            .map(|(r, rb, col, w)| (product_view(&self.cfg, r, post, raw), (ts.at(r), ts.get(rb), col, w)))
    }

    /// Block l's MLP first products on this rank (gate and up, or up), as
    /// products of columns of the hidden rows `hidden`.
    fn mlp_in_of(&self, l: usize, sp: &Split, hidden: View) -> impl Iterator<Item = (View, Part)> + Clone {
        let (ts, f) = (self.block_tensors(l), sp.local.f);
        mlp_in_parts(&self.cfg, f).map(move |(r, rb, col)| (hidden, (ts.at(r), ts.get(rb), col, f)))
    }

    /// Column-parallel products of slices: out[:, col0 + j·per ..] (rows
    /// `out.ld` apart) = inp (N, C) · w[rows of global slice first + j, :]ᵀ
    /// + bias[those rows], per = width / leaves.
    fn columns(&self, gpu: &Gpu, out: View, inp: &DeviceBuffer<X>, part: Part, sp: &Split) -> Result<()> {
        let (n, c) = (self.n(), self.cfg.n_embd);
        let (wi, bi, col0, width) = part;
        let per = width / sp.leaves;
        for j in 0..sp.leaves {
            let row = sp.global(j, per);
            let w = View::new(self.w(wi), c).at::<X>(row, 0);
            let bias = self.w_opt(bi).map(|b| at::<X>(b, row));
            let (o, x) = (out.at::<X>(0, col0 + j * per), View::new(inp.ptr(), c));
            matmul::product_linear::<X>(gpu, o, Out::Storage, x, w, bias, (n, c, per), false)?;
        }
        Ok(())
    }

    /// Row-parallel products into the leaves, then the rank's subtree:
    /// leaf j (N, C) f32 = inp[:, j·per ..] (rows `inp.ld` apart) · w[:, global
    /// slice]ᵀ, w (C, K) with K = `per` · slices; the bias, when there is one,
    /// joins global slice 0.
    fn rows(
        &self,
        gpu: &Gpu,
        inp: View,
        (wi, bi): (usize, Option<usize>),
        per: usize,
        sp: &Split,
    ) -> Result<()> {
        let (n, c, k) = (self.n(), self.cfg.n_embd, per * self.tp.slices);
        for j in 0..sp.leaves {
            let col = sp.global(j, per);
            let leaf = View::new(self.s.leaves.ptr(), c).at::<f32>(j * n, 0);
            let w = View::new(self.w(wi), k).at::<X>(0, col);
            // In f32 (the master copy, the leaf's type), held by rank 0, whose first slice is global 0.
            let bias = bi.filter(|_| col == 0).map(|b| self.master.ptr_at(self.tensors[b].offset));
            ensure(bias.is_none() || self.is_owner(), || "a row-parallel bias off rank 0".into())?;
            let x = inp.at::<X>(0, j * per);
            matmul::product_linear::<X>(gpu, leaf, Out::F32, x, w, bias, (n, per, c), false)?;
        }
        self.subtree(gpu)
    }

    /// Forward from the block input to o's subtree sum.
    pub(super) fn tp_attention(&self, gpu: &Gpu, k: usize, l: usize, rc: bool) -> Result<()> {
        let (cfg, sp) = (&self.cfg, self.split());
        let (b, t, n, c, heads) = (self.b, cfg.block_size, self.n(), cfg.n_embd, sp.local.heads);
        let ts = self.block_tensors(l);
        let x = &self.slots[k].stream[l];
        let a = self.forward_acts(k, l, rc).0;
        let (w1, b1) = (self.w(ts.at(Role::AttnNorm)), self.w_opt(ts.get(Role::AttnNormBias)));
        norm_forward(gpu, cfg, (a.n1, &a.mean1, &a.rstd1), x, w1, b1, n, c)?;
        let (qkv, raw) =
            (View::new(a.qkv.ptr(), heads.qkv_width()), View::new(a.qkv_raw.ptr(), heads.qkv_width()));
        for (out, part) in self.qkv_of(l, &sp, qkv, raw) {
            self.columns(gpu, out, a.n1, part, &sp)?;
        }
        if cfg.qk_norm {
            qk_norm_forward(gpu, cfg, &a, |r| self.w(ts.at(r)), &sp.local, n)?;
        }
        if let Some(table) = &self.s.rope {
            rope::rope_forward(gpu, &a.qkv, table, n, heads.qkv_width(), 0, heads.nh + heads.nkv)?;
        }
        attention::gqa_window_forward(gpu, &a.atty, &a.lse, &a.qkv, b, t, heads, window(cfg))?;
        let o = (ts.at(Role::O), ts.get(Role::OBias));
        let q = heads.out_width();
        self.rows(gpu, View::new(a.atty.ptr(), q), o, q / sp.leaves, &sp)
    }

    /// From o's sums (h = Σ + x) to down's subtree sum.
    pub(super) fn tp_mlp(&self, gpu: &Gpu, k: usize, l: usize, rc: bool) -> Result<()> {
        let (cfg, sp) = (&self.cfg, self.split());
        let (n, c, f) = (self.n(), cfg.n_embd, sp.local.f);
        let ts = self.block_tensors(l);
        let a = self.forward_acts(k, l, rc).0;
        self.join(gpu, &a.h, Some(&self.slots[k].stream[l]))?;
        let (w2, b2) = (self.w(ts.at(Role::MlpNorm)), self.w_opt(ts.get(Role::MlpNormBias)));
        norm_forward(gpu, cfg, (a.n2, &a.mean2, &a.rstd2), &a.h, w2, b2, n, c)?;
        let hidden = View::new(a.hidden.ptr(), sp.local.hidden(cfg));
        for (out, part) in self.mlp_in_of(l, &sp, hidden) {
            self.columns(gpu, out, a.n2, part, &sp)?;
        }
        act_forward(gpu, cfg, a.act, &a.hidden, n, f)?;
        let down = (ts.at(Role::Down), ts.get(Role::DownBias));
        self.rows(gpu, View::new(a.act.ptr(), f), down, f / sp.leaves, &sp)
    }

    /// The block's output, out = Σ + h.
    pub(super) fn tp_out(&self, gpu: &Gpu, k: usize, l: usize, rc: bool) -> Result<()> {
        let (a, out) = self.forward_acts(k, l, rc);
        self.join(gpu, out, Some(&a.h))
    }

    /// A row-parallel product's backward: its weight's gradient, dw[:, global
    /// slice] += dresᵀ · inp[:, j·per ..], its bias's on rank 0 (the bias is
    /// whole), then dx[:, j·per ..] = dres · w[:, global slice].
    fn rows_back(
        &self,
        gpu: &Gpu,
        inp: View,
        dx: View,
        (wi, bi): (usize, Option<usize>),
        per: usize,
        sp: &Split,
    ) -> Result<()> {
        let (n, c, k) = (self.n(), self.cfg.n_embd, per * self.tp.slices);
        let dres = View::new(self.s.dres.ptr(), c);
        for j in 0..sp.leaves {
            let dw = View::new(self.g(wi), k).at::<f32>(0, sp.global(j, per));
            matmul::product_backward_weight::<X>(gpu, dw, inp.at::<X>(0, j * per), dres, (n, c, per))?;
        }
        if self.is_owner() {
            self.bias_grad(gpu, self.g_opt(bi), dres, c)?;
        }
        for j in 0..sp.leaves {
            let w = View::new(self.w(wi), k).at::<X>(0, sp.global(j, per));
            let d = dx.at::<X>(0, j * per);
            matmul::product_forward::<X>(gpu, d, Out::Storage, dres, w, None, (n, c, per), false)?;
        }
        Ok(())
    }

    /// The input gradient of column-parallel products into the leaves, then
    /// the rank's subtree: leaf j = Σ over `parts` (each with the rows of its
    /// output gradient, dy), in order, of dy[:, col0 + j·per ..] · w[rows of
    /// global slice first + j].
    fn columns_dx(
        &self,
        gpu: &Gpu,
        parts: impl Iterator<Item = (View, Part)> + Clone,
        sp: &Split,
    ) -> Result<()> {
        let (n, c) = (self.n(), self.cfg.n_embd);
        for j in 0..sp.leaves {
            let leaf = View::new(self.s.leaves.ptr(), c).at::<f32>(j * n, 0);
            for (q, (dy, (wi, _, col0, width))) in parts.clone().enumerate() {
                let per = width / sp.leaves;
                let w = View::new(self.w(wi), c).at::<X>(sp.global(j, per), 0);
                let d = dy.at::<X>(0, col0 + j * per);
                matmul::product_forward::<X>(gpu, leaf, Out::F32, d, w, None, (n, per, c), q > 0)?;
            }
        }
        self.subtree(gpu)
    }

    /// Column-parallel weights' gradients, each part (with the rows of its
    /// output gradient, dy) in turn: dw[rows of global slice] +=
    /// dy[:, col0 + j·per ..]ᵀ · inp for each of the rank's slices, then its
    /// bias's rows (this rank's, summed over rows of dy).
    fn columns_dw(
        &self,
        gpu: &Gpu,
        inp: &DeviceBuffer<X>,
        parts: impl Iterator<Item = (View, Part)>,
        sp: &Split,
    ) -> Result<()> {
        let (n, c) = (self.n(), self.cfg.n_embd);
        for (dy, (wi, bi, col0, width)) in parts {
            let per = width / sp.leaves;
            for j in 0..sp.leaves {
                let dw = View::new(self.g(wi), c).at::<f32>(sp.global(j, per), 0);
                let d = dy.at::<X>(0, col0 + j * per);
                matmul::product_backward_weight::<X>(gpu, dw, View::new(inp.ptr(), c), d, (n, per, c))?;
            }
            let db = self.g_opt(bi).map(|b| at::<f32>(b, sp.global(0, per)));
            self.bias_grad(gpu, db, dy.at::<X>(0, col0), width)?;
        }
        Ok(())
    }

    /// A norm's backward from `dln`: the input's gradient added to `dres` on
    /// every rank, the weights' (not split) on rank 0.
    fn norm_back(
        &self,
        gpu: &Gpu,
        inp: &DeviceBuffer<X>,
        (wi, bi): (usize, Option<usize>),
        stats: (&DeviceBuffer<f32>, &DeviceBuffer<f32>),
    ) -> Result<()> {
        let (cfg, n, c, s) = (&self.cfg, self.n(), self.cfg.n_embd, &self.s);
        norm_backward_input(gpu, cfg, &s.dres, &s.dln, inp, self.w(wi), stats, n, c)?;
        if self.is_owner() {
            let g = (self.g(wi), self.g_opt(bi));
            norm_backward_weight(gpu, cfg, g, &s.ln_partial, &s.dln, inp, stats, n, c)?;
        }
        Ok(())
    }

    /// Backward of down and the activation, up to the subtree sum of ∂L/∂n2.
    pub(super) fn tp_back_mlp(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        let (cfg, sp) = (&self.cfg, self.split());
        let (n, f, s) = (self.n(), sp.local.f, &self.s);
        let ts = self.block_tensors(l);
        // A selective set's n1, n2 and act, for this phase and the two after it.
        self.remake(gpu, k, l)?;
        let a = self.backward_acts(k, l);
        let (act, dact) = (View::new(a.act.ptr(), f), View::new(s.dact.ptr(), f));
        let down = (ts.at(Role::Down), ts.get(Role::DownBias));
        self.rows_back(gpu, act, dact, down, f / sp.leaves, &sp)?;
        act_backward(gpu, cfg, &s.dhidden, &s.dact, &a.hidden, n, f)?;
        let dh = View::new(s.dhidden.ptr(), sp.local.hidden(cfg));
        self.columns_dx(gpu, self.mlp_in_of(l, &sp, dh), &sp)
    }

    /// From ∂L/∂n2's sums through attention, up to the subtree sum of ∂L/∂n1.
    pub(super) fn tp_back_attention(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        let (cfg, sp) = (&self.cfg, self.split());
        let (b, t, n, heads, s) = (self.b, cfg.block_size, self.n(), sp.local.heads, &self.s);
        let ts = self.block_tensors(l);
        let a = self.backward_acts(k, l);
        self.join(gpu, &s.dln, None)?;
        let dh = View::new(s.dhidden.ptr(), sp.local.hidden(cfg));
        self.columns_dw(gpu, a.n2, self.mlp_in_of(l, &sp, dh), &sp)?;
        let norm2 = (ts.at(Role::MlpNorm), ts.get(Role::MlpNormBias));
        self.norm_back(gpu, &a.h, norm2, (&a.mean2, &a.rstd2))?;
        // dres is now ∂L/∂h.
        let q = heads.out_width();
        let (atty, datty) = (View::new(a.atty.ptr(), q), View::new(s.datty.ptr(), q));
        let o = (ts.at(Role::O), ts.get(Role::OBias));
        self.rows_back(gpu, atty, datty, o, q / sp.leaves, &sp)?;
        let (atty, lse, win) = (&a.atty, &a.lse, window(cfg));
        attention::gqa_window_backward(
            gpu, &s.dqkv, &s.delta, &s.datty, &a.qkv, atty, lse, b, t, heads, win,
        )?;
        let w = heads.qkv_width();
        if let Some(table) = &s.rope {
            rope::rope_backward(gpu, &s.dqkv, table, n, w, 0, heads.nh + heads.nkv)?;
        }
        if cfg.qk_norm {
            qk_norm_backward_input(gpu, &s.dqkv_raw, &s.dqkv, &a, |r| self.w(ts.at(r)), &sp.local, n)?;
            self.qk_norm_subtree(gpu, k, l, &sp)?;
        }
        let (post, raw) = (View::new(s.dqkv.ptr(), w), View::new(s.dqkv_raw.ptr(), w));
        self.columns_dx(gpu, self.qkv_of(l, &sp, post, raw).into_iter(), &sp)
    }

    /// The q and k norms' gain gradients on this rank: a partial per slice
    /// of its heads, joined by the rank's slice tree into its node of the
    /// gathered buffer (q's, then k's).
    fn qk_norm_subtree(&self, gpu: &Gpu, k: usize, l: usize, sp: &Split) -> Result<()> {
        let (s, a, n, hs) = (&self.s, self.backward_acts(k, l), self.n(), sp.local.heads.hs);
        // The partials accumulate: they start from zero.
        gpu.zero(&s.head_leaves)?;
        let leaves = |r: Role| at::<f32>(s.head_leaves.ptr(), usize::from(r == Role::KNorm) * sp.leaves * hs);
        qk_norm_backward_weight(gpu, leaves, sp.leaves, &s.head_partial, &s.dqkv, &a, &sp.local, n)?;
        for (j, role) in [Role::QNorm, Role::KNorm].into_iter().enumerate() {
            let node = at::<f32>(s.head_gathered.ptr(), (self.tp.rank * 2 + j) * hs);
            tree::tree_sum_f32(gpu, node, leaves(role), sp.leaves, hs)?;
        }
        Ok(())
    }

    /// The owner's q and k norm gain gradients += the tree over the ranks'
    /// gathered nodes (joined in place into node 0).
    fn qk_norm_join(&self, gpu: &Gpu, l: usize) -> Result<()> {
        let (ts, hs, nodes) = (self.block_tensors(l), self.cfg.heads().hs, self.s.head_gathered.ptr());
        tree::tree_sum_f32(gpu, nodes, nodes, self.tp.size, 2 * hs)?;
        for (j, role) in [Role::QNorm, Role::KNorm].into_iter().enumerate() {
            let g = self.g(ts.at(role));
            adamw::add_f32(gpu, g, g, at::<f32>(nodes, j * hs), hs)?;
        }
        Ok(())
    }

    /// From ∂L/∂n1's sums to ∂L/∂(block input) in `dres`.
    pub(super) fn tp_back_input(&self, gpu: &Gpu, k: usize, l: usize) -> Result<()> {
        let sp = self.split();
        let (ts, s) = (self.block_tensors(l), &self.s);
        let a = self.backward_acts(k, l);
        self.join(gpu, &s.dln, None)?;
        if self.cfg.qk_norm && self.is_owner() {
            self.qk_norm_join(gpu, l)?;
        }
        let w = sp.local.heads.qkv_width();
        let (post, raw) = (View::new(s.dqkv.ptr(), w), View::new(s.dqkv_raw.ptr(), w));
        self.columns_dw(gpu, a.n1, self.qkv_of(l, &sp, post, raw).into_iter(), &sp)?;
        let x = &self.slots[k].stream[l];
        let norm1 = (ts.at(Role::AttnNorm), ts.get(Role::AttnNormBias));
        self.norm_back(gpu, x, norm1, (&a.mean1, &a.rstd1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch::Cut;
    use crate::model::block::{shard, unshard};

    /// Rank `tp.rank`'s pieces of a whole (rows, cols) block tensor as its
    /// products address them, in its slice order: rows for a tensor cut by
    /// rows (q, k, v, gate, up and their biases), columns of every row for
    /// one cut by columns (o, down).
    fn gpu_pieces(cfg: &Arch, tp: GpuTp, cut: Cut, w: &[f32], (rows, cols): (usize, usize)) -> Vec<f32> {
        let sp = Split::of(cfg, tp);
        match cut {
            Cut::Whole => w.to_vec(),
            Cut::Rows => {
                let per = rows / tp.slices;
                (0..sp.leaves).flat_map(|j| w[sp.global(j, per) * cols..][..per * cols].to_vec()).collect()
            }
            Cut::Columns { .. } => {
                let per = cols / tp.slices;
                let mut out = vec![];
                for row in w.chunks(cols).take(rows) {
                    for j in 0..sp.leaves {
                        out.extend_from_slice(&row[sp.global(j, per)..][..per]);
                    }
                }
                out
            }
        }
    }

    #[test]
    fn a_gpu_rank_reads_the_cpu_rank_s_shard_of_every_block_tensor_and_the_ranks_tile_it() {
        let mut gpt2 = Arch::gpt2(1, 4, 32, 10, 4);
        gpt2.head_dim = 4; // head_dim apart from n_embd / n_head: q is (16, 32), o (32, 16)
        let llama = Arch {
            qkv_bias: true,
            mlp_bias: true,
            // Its gains are whole on every rank.
            qk_norm: true,
            ..Arch::llama(1, 4, 2, 32, 48, 10, 4, 1e4)
        };
        for cfg in [gpt2, llama] {
            for role in cfg.block_roles() {
                let shape = role.shape(&cfg);
                let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
                let w: Vec<f32> = (0..rows * cols).map(|e| e as f32).collect();
                for (size, slices) in [(1, 1), (1, 2), (2, 2), (1, 4), (2, 4), (4, 4)] {
                    if !cfg.kv_heads().is_multiple_of(slices) {
                        continue;
                    }
                    let pieces: Vec<Vec<f32>> = (0..size)
                        .map(|rank| {
                            gpu_pieces(&cfg, GpuTp { rank, size, slices }, role.cut(), &w, (rows, cols))
                        })
                        .collect();
                    for (rank, p) in pieces.iter().enumerate() {
                        let cpu = shard(role.cut(), &w, cols, rank, size);
                        assert_eq!(p, &cpu, "{role:?} rank {rank} of {size} over {slices} slices");
                    }
                    let refs: Vec<&[f32]> = pieces.iter().map(Vec::as_slice).collect();
                    assert_eq!(unshard(role.cut(), &refs, cols), w, "{role:?} over {size} ranks");
                }
            }
        }
    }
}
