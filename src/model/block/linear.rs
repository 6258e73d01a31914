//! The block's linear layers on one tensor-parallel rank, over weights in
//! `nn.Linear`'s (out, in) layout read through strided views (the `gemm`
//! crate takes any strides), each cut into the split's slices (see
//! `block/mod.rs`): column-parallel products (q, k, v, gate, up) write a
//! rank's output columns, row-parallel ones (o, down) sum over the rank's
//! input columns by the slice tree and then over the group.
//!
//! A bias joins a column product before it accumulates; a row-parallel
//! product's bias joins slice 0 of rank 0, once, whatever the split.

use super::split::{sum_slices, TpRank};
use crate::kernels::cpu::matmul::{self, gemm_raw, pool_par, Mat};
use crate::kernels::profile::{timed, Kernel};

/// A strided view of a buffer: element (i, j) at `buf[at + i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(super) struct View<'a> {
    buf: &'a [f32],
    at: usize,
    rs: usize,
    cs: usize,
}

impl<'a> View<'a> {
    /// Row-major with `cols` columns, from column `col0` on.
    pub(super) fn rows(buf: &'a [f32], cols: usize, col0: usize) -> Self {
        View { buf, at: col0, rs: cols, cs: 1 }
    }

    /// The transpose of row-major with `cols` columns, from `at` on.
    pub(super) fn rows_t(buf: &'a [f32], cols: usize, at: usize) -> Self {
        View { buf, at, rs: 1, cs: cols }
    }

    /// Panics unless every element of an (r, c) window is in the buffer.
    fn mat(&self, r: usize, c: usize) -> Mat {
        assert!(
            r == 0 || c == 0 || self.at + (r - 1) * self.rs + (c - 1) * self.cs < self.buf.len(),
            "a ({r}, {c}) view at {} with strides ({}, {}) past a buffer of {}",
            self.at,
            self.rs,
            self.cs,
            self.buf.len()
        );
        Mat {
            ptr: self.buf[self.at.min(self.buf.len())..].as_ptr(),
            rs: self.rs as isize,
            cs: self.cs as isize,
        }
    }
}

/// dst[at..] (m, n), rows `dst_rs` apart, [+]= a (m, k) · b (k, n).
#[allow(clippy::too_many_arguments)]
fn gemm_into(
    dst: &mut [f32],
    at: usize,
    dst_rs: usize,
    accumulate: bool,
    a: View,
    b: View,
    (m, n, k): (usize, usize, usize),
) {
    assert!(m == 0 || n == 0 || at + (m - 1) * dst_rs + n <= dst.len(), "a product's rows past its output");
    let (a, b) = (a.mat(m, k), b.mat(k, n));
    // SAFETY: every element the three views address is in bounds (checked
    // above and by `mat`), and dst is a unique borrow, so it overlaps neither input.
    unsafe { gemm_raw(m, n, k, dst[at..].as_mut_ptr(), dst_rs as isize, accumulate, a, b, 1.0, pool_par()) };
}

/// Columns [col0, col0 + O) of every row of out (rows `cols` apart) set to `bias` (O).
fn fill_columns(out: &mut [f32], cols: usize, col0: usize, bias: &[f32]) {
    for row in out.chunks_mut(cols) {
        row[col0..col0 + bias.len()].copy_from_slice(bias);
    }
}

/// Column-parallel forward: out[:, col0..col0 + O] (rows `out_cols` apart) =
/// x (N, I) · wᵀ + bias, w (O, I) this rank's rows, one product per slice.
#[allow(clippy::too_many_arguments)]
pub(super) fn column_product(
    out: &mut [f32],
    out_cols: usize,
    col0: usize,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (n, i, o): (usize, usize, usize),
    leaves: usize,
) {
    assert!(x.len() == n * i && w.len() == o * i && bias.is_none_or(|b| b.len() == o));
    if let Some(b) = bias {
        fill_columns(out, out_cols, col0, b);
    }
    let per = o / leaves;
    for j in 0..leaves {
        let (xv, wv) = (View::rows(x, i, 0), View::rows_t(w, i, j * per * i));
        gemm_into(out, col0 + j * per, out_cols, bias.is_some(), xv, wv, (n, per, i));
    }
}

/// The weight gradient of a column-parallel product: dw (O, I) += dyᵀ · x
/// and db (O) += Σ over rows of dy, dy the columns [col0, col0 + O) of a
/// (N, dy_cols) buffer; per slice.
#[allow(clippy::too_many_arguments)]
pub(super) fn column_weight_grad(
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    dy: &[f32],
    dy_cols: usize,
    col0: usize,
    x: &[f32],
    (n, i, o): (usize, usize, usize),
    leaves: usize,
) {
    assert!(x.len() == n * i && dw.len() == o * i);
    let per = o / leaves;
    for j in 0..leaves {
        let dyt = View::rows_t(dy, dy_cols, col0 + j * per);
        gemm_into(dw, j * per * i, i, true, dyt, View::rows(x, i, 0), (per, i, n));
    }
    if let Some(db) = db {
        matmul::column_sum_accumulate_at(db, dy, n, dy_cols, col0);
    }
}

/// One of the products a column-parallel input gradient sums: `dy`'s columns
/// [col0, col0 + O) (of `dy_cols`) against w (O, I), this rank's rows.
pub(super) struct ColumnPart<'a> {
    pub dy: &'a [f32],
    pub dy_cols: usize,
    pub col0: usize,
    pub w: &'a [f32],
    pub o: usize,
}

/// The input gradient of column-parallel products, dx (N, I) = Σ over this
/// rank's slices of Σ over `parts` of dy[:, slice] · w[slice, :], added in
/// `parts` order within a slice, by the slice tree and then the group (or,
/// with `rows`, reduce-scattered there: this rank's rows of the sum).
pub(super) fn column_parallel_dx(
    dx: &mut [f32],
    leaves: &mut [Vec<f32>],
    parts: &[ColumnPart],
    (n, i): (usize, usize),
    tp: &TpRank,
    rows: Option<&mut [f32]>,
) {
    let count = leaves.len() + 1;
    let leaf = |dst: &mut [f32], j: usize| {
        for (q, part) in parts.iter().enumerate() {
            assert!(part.w.len() == part.o * i);
            let per = part.o / count;
            let dyv = View::rows(part.dy, part.dy_cols, part.col0 + j * per);
            gemm_into(dst, 0, i, q > 0, dyv, View::rows(part.w, i, j * per * i), (n, i, per));
        }
    };
    timed(Kernel::Matmul, || {
        leaf(dx, 0);
        for (j, l) in leaves.iter_mut().enumerate() {
            leaf(l, j + 1);
        }
    });
    sum_slices(dx, leaves, tp, rows);
}

/// Row-parallel forward: out (N, C) = Σ over this rank's slices of
/// x[:, slice] · w[:, slice]ᵀ (+ bias on slice 0 of rank 0), x (N, K) and
/// w (C, K) with K this rank's share of the reduction, by the slice tree
/// and then the group; with `rows`, the group's sum is reduce-scattered
/// there (this rank's rows) and `out` keeps the rank's own.
#[allow(clippy::too_many_arguments)]
pub(super) fn row_parallel(
    out: &mut [f32],
    leaves: &mut [Vec<f32>],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (n, k, c): (usize, usize, usize),
    tp: &TpRank,
    rows: Option<&mut [f32]>,
) {
    assert!(x.len() == n * k && w.len() == c * k);
    let ks = k / (leaves.len() + 1);
    let leaf = |dst: &mut [f32], j: usize, accumulate: bool| {
        let (xv, wv) = (View::rows(x, k, j * ks), View::rows_t(w, k, j * ks));
        gemm_into(dst, 0, c, accumulate, xv, wv, (n, c, ks));
    };
    let bias = bias.filter(|_| tp.rank == 0);
    timed(Kernel::Matmul, || {
        if let Some(b) = bias {
            matmul::fill_rows(out, b);
        }
        leaf(out, 0, bias.is_some());
        for (j, l) in leaves.iter_mut().enumerate() {
            leaf(l, j + 1, false);
        }
    });
    sum_slices(out, leaves, tp, rows);
}

/// The input gradient of a row-parallel product, dx (N, K) = dy (N, C) · w,
/// w (C, K) this rank's columns; per slice.
pub(super) fn row_parallel_dx(
    dx: &mut [f32],
    dy: &[f32],
    w: &[f32],
    (n, k, c): (usize, usize, usize),
    leaves: usize,
) {
    assert!(dy.len() == n * c && w.len() == c * k);
    let ks = k / leaves;
    for j in 0..leaves {
        let (dyv, wv) = (View::rows(dy, c, 0), View::rows(w, k, j * ks));
        gemm_into(dx, j * ks, k, false, dyv, wv, (n, ks, c));
    }
}

/// The weight gradient of a row-parallel product, dw (C, K) += dyᵀ · x per
/// slice, and its bias's, db (C) += Σ over rows of dy (every rank holds the
/// whole dy, so every rank's db is the same).
pub(super) fn row_weight_grad(
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    dy: &[f32],
    x: &[f32],
    (n, k, c): (usize, usize, usize),
    leaves: usize,
) {
    assert!(dy.len() == n * c && x.len() == n * k && dw.len() == c * k);
    let ks = k / leaves;
    for j in 0..leaves {
        let (dyt, xv) = (View::rows_t(dy, c, 0), View::rows(x, k, j * ks));
        gemm_into(dw, j * ks, k, true, dyt, xv, (c, ks, n));
    }
    if let Some(db) = db {
        matmul::column_sum_accumulate(db, dy, n, c);
    }
}
