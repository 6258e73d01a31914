//! Matrix products through the `gemm` crate, and the linear layer built on them.
//!
//! inp is (N, C), weight is (C, OC) — Hugging Face GPT-2's Conv1D layout, in × out —
//! bias is (OC), out is (N, OC).
//!
//! gemm splits work over output tiles and keeps each element's sum over the inner
//! dimension in one fixed order, so results do not depend on the thread count
//! (tested below).

use super::COLS_PER_TASK;
use gemm::Parallelism;
use rayon::prelude::*;

/// A strided view of a row-major-or-not matrix: element (i, j) is at
/// `ptr[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub struct Mat {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

impl Mat {
    /// A row-major matrix with `cols` columns.
    pub fn rows(s: &[f32], cols: usize) -> Mat {
        Mat { ptr: s.as_ptr(), rs: cols as isize, cs: 1 }
    }
    /// The transpose of a row-major matrix with `cols` columns.
    pub fn rows_t(s: &[f32], cols: usize) -> Mat {
        Mat { ptr: s.as_ptr(), rs: 1, cs: cols as isize }
    }
}

/// dst (m, n) = [dst +] scale · lhs (m, k) · rhs (k, n); dst row-major with row stride dst_rs.
///
/// # Safety
/// Every element the views address must be in bounds for the given sizes, and
/// `dst` must not overlap `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_raw(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    accumulate: bool,
    lhs: Mat,
    rhs: Mat,
    scale: f32,
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::slice::from_raw_parts_mut(dst.offset(i as isize * dst_rs), n).fill(0.0);
            }
        }
        return;
    }
    #[cfg(test)]
    IN_GEMM.with(|f| f.set(true));
    gemm::gemm(
        m, n, k, dst, 1, dst_rs, accumulate, lhs.ptr, lhs.cs, lhs.rs, rhs.ptr, rhs.cs, rhs.rs, 1.0, scale,
        false, false, false, par,
    );
    #[cfg(test)]
    IN_GEMM.with(|f| f.set(false));
}

// gemm 0.19 allocates on every call (packing buffers, a `Vec<bool>` per
// thread) and offers no way to pass it memory, so the allocation tests need to
// tell its allocations from ours. On one thread everything gemm does happens
// inside this call.
#[cfg(test)]
thread_local! {
    static IN_GEMM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside a `gemm` call (tests only).
#[cfg(test)]
pub(crate) fn in_gemm() -> bool {
    IN_GEMM.try_with(|f| f.get()).unwrap_or(false)
}

/// The parallelism for a top-level product: every thread of the installed pool.
pub fn pool_par() -> Parallelism {
    Parallelism::Rayon(rayon::current_num_threads())
}

/// out (m, n) = a (m, k) · b (k, n) with views; safe wrapper with bounds checks.
#[allow(clippy::too_many_arguments)]
pub fn gemm_checked(
    out: &mut [f32],
    accumulate: bool,
    a: &[f32],
    a_view: (isize, isize),
    b: &[f32],
    b_view: (isize, isize),
    m: usize,
    n: usize,
    k: usize,
    scale: f32,
) {
    assert!(out.len() >= m * n);
    let reach = |len: usize, (rs, cs): (isize, isize), r: usize, c: usize| {
        assert!(rs >= 0 && cs >= 0);
        if r > 0 && c > 0 {
            assert!((r - 1) * (rs as usize) + (c - 1) * (cs as usize) < len, "view out of bounds");
        }
    };
    reach(a.len(), a_view, m, k);
    reach(b.len(), b_view, k, n);
    unsafe {
        gemm_raw(
            m,
            n,
            k,
            out.as_mut_ptr(),
            n as isize,
            accumulate,
            Mat { ptr: a.as_ptr(), rs: a_view.0, cs: a_view.1 },
            Mat { ptr: b.as_ptr(), rs: b_view.0, cs: b_view.1 },
            scale,
            pool_par(),
        )
    }
}

/// Every row of out (N, OC) set to `row` (OC): a product's bias, before the
/// product accumulates onto it.
pub fn fill_rows(out: &mut [f32], row: &[f32]) {
    let oc = row.len();
    out.par_chunks_mut(oc * super::ROWS_PER_TASK).for_each(|rows| {
        for r in rows.chunks_mut(oc) {
            r.copy_from_slice(row);
        }
    });
}

/// out (N, OC) = inp (N, C) · weight (C, OC) + bias (OC).
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    assert_eq!(out.len(), n * oc);
    assert_eq!(inp.len(), n * c);
    assert_eq!(weight.len(), c * oc);
    if let Some(bias) = bias {
        assert_eq!(bias.len(), oc);
        fill_rows(out, bias);
    }
    gemm_checked(out, bias.is_some(), inp, (c as isize, 1), weight, (oc as isize, 1), n, oc, c, 1.0);
}

/// Backward of `matmul_forward`:
/// dinp (N, C) += dout (N, OC) · weightᵀ; dweight (C, OC) += inpᵀ · dout; dbias (OC) += Σ_rows dout.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: Option<&mut [f32]>,
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) {
    if let Some(dinp) = dinp {
        matmul_backward_input(dinp, dout, weight, n, c, oc, true);
    }
    matmul_backward_weight(dweight, dbias, dout, inp, n, c, oc);
}

/// The input half of the backward (zero-bubble schedules' I): dinp (N, C) += dout · weightᵀ,
/// or = when `accumulate` is false (a fresh buffer needs no zeroing first).
pub fn matmul_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    oc: usize,
    accumulate: bool,
) {
    assert_eq!(dout.len(), n * oc);
    assert_eq!(weight.len(), c * oc);
    assert_eq!(dinp.len(), n * c);
    gemm_checked(dinp, accumulate, dout, (oc as isize, 1), weight, (1, oc as isize), n, c, oc, 1.0);
}

/// The weight half (zero-bubble schedules' W): dweight (C, OC) += inpᵀ · dout; dbias += Σ_rows dout.
pub fn matmul_backward_weight(
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) {
    assert_eq!(dout.len(), n * oc);
    assert_eq!(inp.len(), n * c);
    assert_eq!(dweight.len(), c * oc);
    gemm_checked(dweight, true, inp, (1, c as isize), dout, (oc as isize, 1), c, oc, n, 1.0);
    if let Some(dbias) = dbias {
        assert_eq!(dbias.len(), oc);
        column_sum_accumulate(dbias, dout, n, oc);
    }
}

/// acc (OC) += Σ over the N rows of x (N, OC), each column summed in row order.
pub fn column_sum_accumulate(acc: &mut [f32], x: &[f32], n: usize, oc: usize) {
    column_sum_accumulate_at(acc, x, n, oc, 0);
}

/// acc (OC) += Σ over the N rows of columns [col0, col0 + OC) of x (N, W),
/// each column summed in row order: the bias gradient of a product whose
/// output is a column block of a wider buffer (q, k, v in one row).
pub fn column_sum_accumulate_at(acc: &mut [f32], x: &[f32], n: usize, w: usize, col0: usize) {
    let oc = acc.len();
    assert!(col0 + oc <= w && x.len() >= n * w, "columns {col0}..{} past rows of {w}", col0 + oc);
    if RANDOM_ORDER.with(|r| r.get()) {
        return column_sum_random_order(acc, x, n, w, col0);
    }
    acc.par_chunks_mut(COLS_PER_TASK).enumerate().for_each(|(task, cols)| {
        let c0 = col0 + task * COLS_PER_TASK;
        for r in 0..n {
            let row = &x[r * w + c0..r * w + c0 + cols.len()];
            for (a, &v) in cols.iter_mut().zip(row) {
                *a += v;
            }
        }
    });
}

thread_local! {
    static RANDOM_ORDER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with bias-gradient sums taken in a random row order on this thread:
/// a deliberately non-deterministic kernel (what an atomics-based GPU reduction
/// does), switched on by `PIPEWRIGHT_NONDET` so the replay tests can show that
/// such a bug is caught and pinned to its actor and message.
pub fn with_random_order<R>(on: bool, f: impl FnOnce() -> R) -> R {
    let before = RANDOM_ORDER.with(|r| r.replace(on));
    let out = f();
    RANDOM_ORDER.with(|r| r.set(before));
    out
}

/// Whether this thread sums bias gradients in a random order (`with_random_order`),
/// for work handed to other threads to do the same.
pub fn random_order() -> bool {
    RANDOM_ORDER.with(|r| r.get())
}

fn column_sum_random_order(acc: &mut [f32], x: &[f32], n: usize, w: usize, col0: usize) {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let mut rng = crate::rng::Rng::new(seed as u64, crate::rng::Purpose::Test, &[0x4e0d]);
    let mut rows: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        rows.swap(i, rng.below(i as u64 + 1) as usize);
    }
    for (o, a) in acc.iter_mut().enumerate() {
        // Sum the column on its own, then add: the order of the rows is what varies.
        let mut s = 0.0f32;
        for &r in &rows {
            s += x[r * w + col0 + o];
        }
        *a += s;
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    fn naive(inp: &[f32], w: &[f32], b: &[f32], n: usize, c: usize, oc: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; n * oc];
        for i in 0..n {
            for o in 0..oc {
                let mut s = b[o] as f64;
                for k in 0..c {
                    s += inp[i * c + k] as f64 * w[k * oc + o] as f64;
                }
                out[i * oc + o] = s;
            }
        }
        out
    }

    #[test]
    fn forward_matches_naive() {
        let (n, c, oc) = (37, 29, 45);
        let inp = randn(n * c, 1);
        let w = randn(c * oc, 2);
        let b = randn(oc, 3);
        let mut out = vec![0.0; n * oc];
        with_threads(2, || matmul_forward(&mut out, &inp, &w, Some(&b), n, c, oc));
        assert_close(&out, &naive(&inp, &w, &b, n, c, oc), 1e-5);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, c, oc) = (7, 5, 11);
        // loss = Σ out ∘ g for a fixed random g; its gradient wrt out is g.
        let g = randn(n * oc, 9);
        let params = vec![randn(n * c, 1), randn(c * oc, 2), randn(oc, 3)];
        let loss = |p: &[Vec<f64>]| {
            let mut s = 0.0;
            for i in 0..n {
                for o in 0..oc {
                    let mut v = p[2][o];
                    for k in 0..c {
                        v += p[0][i * c + k] * p[1][k * oc + o];
                    }
                    s += v * g[i * oc + o] as f64;
                }
            }
            s
        };
        let mut dinp = vec![0.0; n * c];
        let mut dw = vec![0.0; c * oc];
        let mut db = vec![0.0; oc];
        with_threads(2, || {
            matmul_backward(Some(&mut dinp), &mut dw, Some(&mut db), &g, &params[0], &params[1], n, c, oc)
        });
        check_grads(&params, &[dinp, dw, db], loss, 1e-4);
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (n, c, oc) = (256, 192, 320);
        let inp = randn(n * c, 1);
        let w = randn(c * oc, 2);
        let dout = randn(n * oc, 3);
        let run = |threads| {
            with_threads(threads, || {
                let mut out = vec![0.0; n * oc];
                matmul_forward(&mut out, &inp, &w, None, n, c, oc);
                let mut dinp = vec![0.0; n * c];
                let mut dw = vec![0.0; c * oc];
                let mut db = vec![0.0; oc];
                matmul_backward(Some(&mut dinp), &mut dw, Some(&mut db), &dout, &inp, &w, n, c, oc);
                (out, dinp, dw, db)
            })
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }
}
