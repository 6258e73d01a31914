//! Matrix products through cuBLASLt, row-major like the CPU twin
//! (kernels/cpu/matmul.rs): inp (N, IC), weight (IC, OC), out (N, OC); a
//! model's weights are `nn.Linear`'s (out, in), which `product_linear` reads
//! transposed (with a bias) and `product_backward_weight` writes as they are.
//! Weight gradients are f32, accumulated (beta 1).
//!
//! cuBLASLt is column-major, so a row-major X is its transpose there. Each
//! distinct (shape, transposes, types, bias) gets its descriptors and the
//! heuristic's algorithm once; later calls reuse them (cudarc's safe `matmul`
//! would run the heuristic on every call). The bias gradient is our own
//! two-pass column sum (kernels/matmul.cu), deterministic.
//!
//! Alignment: cuBLASLt's heuristic assumes 256-byte aligned A, B, C and D
//! unless told otherwise, and may pick a kernel that faults or reads wrong
//! data on a pointer aligned to less. The part's layout aligns every tensor
//! to 256 bytes (`part::ALIGN`), and each plan is also made for the real
//! alignment of the pointers it runs on (part of its key), so a pointer
//! aligned to less gets a kernel that allows it instead of a fault.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, CudaError, Elem, Result};
use cudarc::cublaslt::{result, sys};
use std::collections::HashMap;
use std::ffi::c_void;

const WORKSPACE_BYTES: usize = 32 << 20;
/// Rows per chunk of the bias gradient's first pass.
const BIAS_ROWS: usize = 64;

/// One product D = alpha·op(A)·op(B) + beta·C (C = D), column-major, as cuBLASLt sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    /// A and B are f32 (else bf16).
    pub ab_f32: bool,
    /// C and D are f32 (else bf16).
    pub c_f32: bool,
    pub bias: bool,
}

/// The largest power of two, at most 256, that divides a device address:
/// what `CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES` is told.
pub fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        return 256;
    }
    1u32 << ptr.trailing_zeros().min(8)
}

/// A plan is made for a shape and the alignment of A, B and C = D.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    shape: GemmShape,
    align: [u32; 3],
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created once in `plan`, destroyed once here.
        unsafe {
            for l in self.layouts {
                let _ = result::destroy_matrix_layout(l);
            }
            let _ = result::destroy_matmul_desc(self.desc);
        }
    }
}

/// cuBLASLt's handle, workspace and the plans made so far.
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: DeviceBuffer<u8>,
    plans: HashMap<PlanKey, Plan>,
}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `Blas::new`, destroyed once.
        unsafe {
            let _ = result::destroy_handle(self.handle);
        }
    }
}

fn dtype(f32: bool) -> sys::cudaDataType {
    if f32 {
        sys::cudaDataType::CUDA_R_32F
    } else {
        sys::cudaDataType::CUDA_R_16BF
    }
}

impl Blas {
    fn new(gpu: &Gpu) -> Result<Blas> {
        if !super::cublaslt_present() {
            return Err(CudaError::NoCublasLt);
        }
        Ok(Blas {
            handle: result::create_handle()?,
            workspace: gpu.alloc(WORKSPACE_BYTES)?,
            plans: HashMap::new(),
        })
    }

    /// How many distinct products have been planned (the heuristic ran once for each).
    pub fn plans(&self) -> usize {
        self.plans.len()
    }

    fn plan(&mut self, key: PlanKey, bias: Option<u64>) -> Result<&Plan> {
        if let std::collections::hash_map::Entry::Vacant(e) = self.plans.entry(key) {
            e.insert(make_plan(self.handle, &key, bias)?);
        }
        Ok(self.plans.get(&key).expect("inserted above"))
    }
}

fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    // SAFETY: `v` is the attribute's documented type and lives through the call.
    unsafe {
        result::set_matmul_desc_attribute(
            desc,
            attr,
            v as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )?
    };
    Ok(())
}

fn blas_err<'a>(s: &'a GemmShape, what: &'static str) -> impl FnOnce(result::CublasError) -> CudaError + 'a {
    move |err| CudaError::Matmul {
        what,
        m: s.m,
        n: s.n,
        k: s.k,
        ta: s.trans_a,
        tb: s.trans_b,
        types: format!(
            "A,B {} C,D {}",
            if s.ab_f32 { "f32" } else { "bf16" },
            if s.c_f32 { "f32" } else { "bf16" }
        ),
        bias: s.bias,
        err,
    }
}

fn set_pref<T>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<()> {
    // SAFETY: `v` is the attribute's documented type and lives through the call.
    unsafe {
        result::set_matmul_pref_attribute(
            pref,
            attr,
            v as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )?
    };
    Ok(())
}

/// The descriptors and the heuristic's algorithm for one product. The bias
/// pointer is set before the heuristic runs (its choice may depend on it).
fn make_plan(handle: sys::cublasLtHandle_t, key: &PlanKey, bias: Option<u64>) -> Result<Plan> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let s = &key.shape;
    let desc = result::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType::CUDA_R_32F,
    )
    .map_err(blas_err(s, "creating the matmul descriptor"))?;
    let (ta, tb) = (s.trans_a as i32, s.trans_b as i32); // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
    set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &ta)?;
    set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &tb)?;
    if let Some(bias) = bias {
        let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &dtype(s.c_f32))?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
    }
    let (ar, ac) = if s.trans_a { (s.k, s.m) } else { (s.m, s.k) };
    let (br, bc) = if s.trans_b { (s.n, s.k) } else { (s.k, s.n) };
    let layout = |f32, r: usize, c: usize, ld: usize| {
        result::create_matrix_layout(dtype(f32), r as u64, c as u64, ld as i64)
            .map_err(blas_err(s, "creating a matrix layout"))
    };
    let a = layout(s.ab_f32, ar, ac, s.lda)?;
    let b = layout(s.ab_f32, br, bc, s.ldb)?;
    let c = layout(s.c_f32, s.m, s.n, s.ldc)?;
    let mut plan = Plan { desc, layouts: [a, b, c], algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] } };
    let pref = result::create_matmul_pref().map_err(blas_err(s, "creating the preference"))?;
    let [al_a, al_b, al_cd] = key.align;
    let prefs = set_pref(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &(WORKSPACE_BYTES as u64))
        .and_then(|_| set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a))
        .and_then(|_| set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b))
        .and_then(|_| set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_cd))
        .and_then(|_| set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_cd));
    // SAFETY: every handle is live; pref is destroyed once, here.
    let heuristic = prefs.and_then(|_| {
        unsafe { result::get_matmul_algo_heuristic(handle, desc, a, b, c, c, pref) }
            .map_err(blas_err(s, "heuristic (no algorithm)"))
    });
    unsafe {
        let _ = result::destroy_matmul_pref(pref);
    }
    // Not `Plan { algo, ..plan }`: the handles are Copy, so that copies them
    // into a second owner and `plan`'s Drop destroys them on return (found by
    // the emulated GPU: the next product set an attribute on a dead descriptor).
    plan.algo = heuristic?.algo;
    Ok(plan)
}

/// D = op(A)·op(B) + beta·D (column-major), with the bias added per row of D
/// when `bias` is given. Pointers are device addresses of the right types.
#[allow(clippy::too_many_arguments)]
pub fn gemm(gpu: &Gpu, s: &GemmShape, a: u64, b: u64, d: u64, bias: Option<u64>, beta: f32) -> Result<()> {
    ensure(s.bias == bias.is_some(), || "bias pointer and shape disagree".into())?;
    let mut guard = gpu.blas.borrow_mut();
    if guard.is_none() {
        *guard = Some(Blas::new(gpu)?);
    }
    let blas = guard.as_mut().expect("set above");
    let (handle, ws, ws_len) = (blas.handle, blas.workspace.ptr(), blas.workspace.bytes());
    let key = PlanKey { shape: *s, align: [alignment(a), alignment(b), alignment(d)] };
    let plan = blas.plan(key, bias)?;
    if let Some(bias) = bias {
        set_desc(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
    }
    let alpha = 1.0f32;
    super::counts::matmul();
    // SAFETY: layouts describe the buffers the callers checked; scalars are
    // f32 (the scale type); the workspace belongs to this handle.
    unsafe {
        result::matmul(
            handle,
            plan.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            a as *const c_void,
            plan.layouts[0],
            b as *const c_void,
            plan.layouts[1],
            d as *const c_void,
            plan.layouts[2],
            d as *mut c_void,
            plan.layouts[2],
            &plan.algo,
            ws as *mut c_void,
            ws_len,
            gpu.stream() as sys::cudaStream_t,
        )
    }
    .map_err(blas_err(s, "matmul"))
}

/// How many products have been planned on this GPU.
pub fn planned(gpu: &Gpu) -> usize {
    gpu.blas.borrow().as_ref().map_or(0, Blas::plans)
}

/// out (N, OC) = inp (N, IC) · weight (IC, OC) + bias (OC).
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<X: Elem>(
    gpu: &Gpu,
    out: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    weight: u64,
    bias: Option<u64>,
    n: usize,
    ic: usize,
    oc: usize,
) -> Result<()> {
    ensure(out.len() >= n * oc && inp.len() >= n * ic, || {
        format!("matmul_forward: buffers for N={n} IC={ic} OC={oc}")
    })?;
    let (o, x, w) = (View::new(out.ptr(), oc), View::new(inp.ptr(), ic), View::new(weight, oc));
    product_forward::<X>(gpu, o, Out::Storage, x, w, bias, (n, ic, oc), false)
}

/// dinp (N, IC) = dout (N, OC) · weightᵀ, overwritten.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_input<X: Elem>(
    gpu: &Gpu,
    dinp: &DeviceBuffer<X>,
    dout: &DeviceBuffer<X>,
    weight: u64,
    n: usize,
    ic: usize,
    oc: usize,
) -> Result<()> {
    ensure(dinp.len() >= n * ic && dout.len() >= n * oc, || {
        format!("matmul_backward_input: buffers for N={n} IC={ic} OC={oc}")
    })?;
    let (dx, dy, w) = (View::new(dinp.ptr(), ic), View::new(dout.ptr(), oc), View::new(weight, oc));
    product_backward_input::<X>(gpu, dx, Out::Storage, dy, w, (n, ic, oc), false)
}

/// dweight (IC, OC) f32 += inpᵀ · dout; dbias (OC) f32 += Σ_rows dout.
/// `partial` is scratch of at least `bias_partial_len(n, oc)` floats.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_weight<X: Elem>(
    gpu: &Gpu,
    dweight: u64,
    dbias: Option<u64>,
    partial: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<X>,
    inp: &DeviceBuffer<X>,
    n: usize,
    ic: usize,
    oc: usize,
) -> Result<()> {
    ensure(dout.len() >= n * oc && inp.len() >= n * ic, || {
        format!("matmul_backward_weight: buffers for N={n} IC={ic} OC={oc}")
    })?;
    let (dw, dy, x) = (View::new(dweight, oc), View::new(dout.ptr(), oc), View::new(inp.ptr(), ic));
    product_backward_weight::<X>(gpu, dw, dy, x, (n, ic, oc))?;
    if let Some(dbias) = dbias {
        bias_backward(gpu, dbias, partial, dout, n, oc)?;
    }
    Ok(())
}

/// Scratch floats the bias gradient needs.
pub fn bias_partial_len(n: usize, oc: usize) -> usize {
    n.div_ceil(BIAS_ROWS) * oc
}

/// dbias (OC) f32 += Σ_rows dout (N, OC), chunks summed in order.
pub fn bias_backward<X: Elem>(
    gpu: &Gpu,
    dbias: u64,
    partial: &DeviceBuffer<f32>,
    dout: &DeviceBuffer<X>,
    n: usize,
    oc: usize,
) -> Result<()> {
    ensure(dout.len() >= n * oc, || "bias_backward: dout too small".into())?;
    bias_backward_view::<X>(gpu, dbias, partial, View::new(dout.ptr(), oc), n, oc)
}

/// dbias (OC) f32 += Σ_rows of OC columns of a matrix whose rows lie `dout.ld`
/// elements apart (a tensor-parallel rank's block of q, k or v). Each column
/// is summed alone, so a column's bits do not depend on its neighbours.
pub fn bias_backward_view<X: Elem>(
    gpu: &Gpu,
    dbias: u64,
    partial: &DeviceBuffer<f32>,
    dout: View,
    n: usize,
    oc: usize,
) -> Result<()> {
    let chunks = n.div_ceil(BIAS_ROWS);
    ensure(partial.len() >= chunks * oc && dout.ld >= oc, || {
        format!("bias_backward: scratch of {} for {chunks}×{oc}, row stride {}", partial.len(), dout.ld)
    })?;
    let f = gpu.function::<X>("matmul", "bias_backward_partial")?;
    let (p, d, ni, oci, ld, rows) =
        (partial.ptr(), dout.ptr, n as i32, oc as i32, dout.ld as i32, BIAS_ROWS as i32);
    gpu.launch(f, (blocks(oc, 256), chunks as u32, 1), (256, 1, 1), &mut args![p, d, ni, oci, ld, rows])?;
    sum_chunks::<X>(gpu, dbias, partial, chunks, oc)
}

/// out (cols) f32 += Σ_k partial[k, ..] over `chunks` rows of per-chunk
/// column sums, chunks in order: the second pass of every column reduction
/// without atomics (bias and RMSNorm weight gradients).
pub fn sum_chunks<X: Elem>(
    gpu: &Gpu,
    out: u64,
    partial: &DeviceBuffer<f32>,
    chunks: usize,
    cols: usize,
) -> Result<()> {
    ensure(partial.len() >= chunks * cols, || {
        format!("sum_chunks: scratch of {} for {chunks}×{cols}", partial.len())
    })?;
    let f = gpu.function::<X>("matmul", "bias_backward_finish")?;
    let (p, ch, ci) = (partial.ptr(), chunks as i32, cols as i32);
    gpu.launch(f, (blocks(cols, 256), 1, 1), (256, 1, 1), &mut args![out, p, ch, ci])
}

/// A row-major matrix on the device: its address and its row stride in
/// elements (a block of a wider matrix has the wider one's stride).
#[derive(Clone, Copy, Debug)]
pub struct View {
    pub ptr: u64,
    pub ld: usize,
}

impl View {
    pub fn new(ptr: u64, ld: usize) -> View {
        View { ptr, ld }
    }

    /// The view starting `rows` rows and `cols` columns further on, for elements of `T`.
    pub fn at<T>(self, rows: usize, cols: usize) -> View {
        View { ptr: self.ptr + ((rows * self.ld + cols) * std::mem::size_of::<T>()) as u64, ld: self.ld }
    }
}

/// The storage of a product's output: X like its operands, or f32 (a
/// partial sum that more are added to before it is rounded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    Storage,
    F32,
}

/// out (N, OC) [+]= inp (N, IC) · w (IC, OC) [+ bias], over views (the
/// caller vouches that each view holds the block it names). The bias is of
/// the output's type; `accumulate` adds to what `out` holds.
#[allow(clippy::too_many_arguments)]
pub fn product_forward<X: Elem>(
    gpu: &Gpu,
    out: View,
    kind: Out,
    inp: View,
    w: View,
    bias: Option<u64>,
    (n, ic, oc): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    let s = GemmShape {
        m: oc,
        n,
        k: ic,
        trans_a: false,
        trans_b: false,
        lda: w.ld,
        ldb: inp.ld,
        ldc: out.ld,
        ab_f32: X::IS_F32,
        c_f32: X::IS_F32 || kind == Out::F32,
        bias: bias.is_some(),
    };
    gemm(gpu, &s, w.ptr, inp.ptr, out.ptr, bias, if accumulate { 1.0 } else { 0.0 })
}

/// dinp (N, IC) [+]= dout (N, OC) · wᵀ, w (IC, OC), over views.
#[allow(clippy::too_many_arguments)]
pub fn product_backward_input<X: Elem>(
    gpu: &Gpu,
    dinp: View,
    kind: Out,
    dout: View,
    w: View,
    (n, ic, oc): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    product_linear::<X>(gpu, dinp, kind, dout, w, None, (n, oc, ic), accumulate)
}

/// out (N, O) [+]= inp (N, I) · wᵀ [+ bias (O)], w (O, I) as `nn.Linear`
/// keeps it, over views: a linear layer's forward (the same product as the
/// input gradient of a weight seen as (I, O)). The bias, of the output's
/// type, joins in cuBLASLt's epilogue.
#[allow(clippy::too_many_arguments)]
pub fn product_linear<X: Elem>(
    gpu: &Gpu,
    out: View,
    kind: Out,
    inp: View,
    w: View,
    bias: Option<u64>,
    (n, i, o): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    let s = GemmShape {
        m: o,
        n,
        k: i,
        trans_a: true,
        trans_b: false,
        lda: w.ld,
        ldb: inp.ld,
        ldc: out.ld,
        ab_f32: X::IS_F32,
        c_f32: X::IS_F32 || kind == Out::F32,
        bias: bias.is_some(),
    };
    gemm(gpu, &s, w.ptr, inp.ptr, out.ptr, bias, if accumulate { 1.0 } else { 0.0 })
}

/// dw (IC, OC) f32 += inpᵀ · dout, over views.
pub fn product_backward_weight<X: Elem>(
    gpu: &Gpu,
    dw: View,
    dout: View,
    inp: View,
    (n, ic, oc): (usize, usize, usize),
) -> Result<()> {
    let s = GemmShape {
        m: oc,
        n: ic,
        k: n,
        trans_a: false,
        trans_b: true,
        lda: dout.ld,
        ldb: inp.ld,
        ldc: dw.ld,
        ab_f32: X::IS_F32,
        c_f32: true,
        bias: false,
    };
    gemm(gpu, &s, dout.ptr, inp.ptr, dw.ptr, None, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pointers_alignment_is_its_largest_power_of_two_divisor_up_to_256() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0100), 256);
        // 64 bf16 elements past a 256-byte boundary: the case the old layout made.
        assert_eq!(alignment(0x7f00_0000_0000 + 128), 128);
        assert_eq!(alignment(0x7f00_0000_0000 + 2), 2);
        assert_eq!(alignment(0x7f00_0000_0000 + 6), 2);
        assert_eq!(alignment(0x7f00_0000_0000 + 16), 16);
    }
}
