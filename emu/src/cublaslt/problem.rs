//! One cuBLASLt product as plain data, checked against NVIDIA's documented
//! rules, and computed on host slices.
//!
//! Owns the meaning of a product: which (computeType, scaleType, Atype/Btype,
//! Ctype/Dtype) rows of cuBLASLt's table the emulator runs, how layouts and
//! transposes give m, n and k, and the arithmetic (f32 products through the
//! `gemm` crate, the epilogue in f32, one rounding to D's type). It never
//! touches device memory, streams or the C handles: `compute` takes byte
//! slices, so the math is testable without a driver.

use crate::error::{EmuError, Result};
use half::{bf16, f16};

/// cublasStatus_t values (cublas_api.h).
pub mod status {
    pub const SUCCESS: u32 = 0;
    pub const NOT_INITIALIZED: u32 = 1;
    pub const ALLOC_FAILED: u32 = 3;
    pub const INVALID_VALUE: u32 = 7;
    pub const ARCH_MISMATCH: u32 = 8;
    pub const MAPPING_ERROR: u32 = 11;
    pub const EXECUTION_FAILED: u32 = 13;
    pub const INTERNAL_ERROR: u32 = 14;
    pub const NOT_SUPPORTED: u32 = 15;
    pub const LICENSE_ERROR: u32 = 16;

    /// The status's enumerator name, as cublasLtGetStatusName gives it.
    pub fn name(code: u32) -> Option<&'static str> {
        Some(match code {
            SUCCESS => "CUBLAS_STATUS_SUCCESS",
            NOT_INITIALIZED => "CUBLAS_STATUS_NOT_INITIALIZED",
            ALLOC_FAILED => "CUBLAS_STATUS_ALLOC_FAILED",
            INVALID_VALUE => "CUBLAS_STATUS_INVALID_VALUE",
            ARCH_MISMATCH => "CUBLAS_STATUS_ARCH_MISMATCH",
            MAPPING_ERROR => "CUBLAS_STATUS_MAPPING_ERROR",
            EXECUTION_FAILED => "CUBLAS_STATUS_EXECUTION_FAILED",
            INTERNAL_ERROR => "CUBLAS_STATUS_INTERNAL_ERROR",
            NOT_SUPPORTED => "CUBLAS_STATUS_NOT_SUPPORTED",
            LICENSE_ERROR => "CUBLAS_STATUS_LICENSE_ERROR",
            _ => return None,
        })
    }

    /// The standard description of a status (when no detailed message was reported).
    pub fn text(code: u32) -> &'static str {
        match code {
            SUCCESS => "success",
            NOT_INITIALIZED => "the library was not initialized",
            ALLOC_FAILED => "the resource allocation failed",
            INVALID_VALUE => "an invalid numeric value was used as an argument",
            ARCH_MISMATCH => "an absent device architectural feature is required",
            MAPPING_ERROR => "an access to GPU memory space failed",
            EXECUTION_FAILED => "the GPU program failed to execute",
            INTERNAL_ERROR => "an internal operation failed",
            NOT_SUPPORTED => "the functionality requested is not supported",
            LICENSE_ERROR => "an error was detected when checking the current licensing",
            _ => "unknown cuBLAS status",
        }
    }
}

/// cudaDataType values (library_types.h) the emulator names.
pub mod data_type {
    pub const R_32F: u32 = 0;
    pub const R_64F: u32 = 1;
    pub const R_16F: u32 = 2;
    pub const R_8I: u32 = 3;
    pub const C_32F: u32 = 4;
    pub const C_64F: u32 = 5;
    pub const C_8I: u32 = 7;
    pub const R_32I: u32 = 10;
    pub const R_16BF: u32 = 14;
    pub const R_8F_E4M3: u32 = 28;
    pub const R_8F_E5M2: u32 = 29;

    pub fn name(t: u32) -> String {
        match t {
            R_32F => "CUDA_R_32F".into(),
            R_64F => "CUDA_R_64F".into(),
            R_16F => "CUDA_R_16F".into(),
            R_8I => "CUDA_R_8I".into(),
            C_32F => "CUDA_C_32F".into(),
            C_64F => "CUDA_C_64F".into(),
            C_8I => "CUDA_C_8I".into(),
            R_32I => "CUDA_R_32I".into(),
            R_16BF => "CUDA_R_16BF".into(),
            R_8F_E4M3 => "CUDA_R_8F_E4M3".into(),
            R_8F_E5M2 => "CUDA_R_8F_E5M2".into(),
            other => format!("cudaDataType {other}"),
        }
    }
}

/// cublasComputeType_t values (cublas_api.h, CUDA 12/13).
pub mod compute_type {
    pub const C16F: u32 = 64;
    pub const C16F_PEDANTIC: u32 = 65;
    pub const C32F: u32 = 68;
    pub const C32F_PEDANTIC: u32 = 69;
    pub const C64F: u32 = 70;
    pub const C64F_PEDANTIC: u32 = 71;
    pub const C32I: u32 = 72;
    pub const C32I_PEDANTIC: u32 = 73;
    pub const C32F_FAST_16F: u32 = 74;
    pub const C32F_FAST_16BF: u32 = 75;
    pub const C32F_FAST_TF32: u32 = 77;
    pub const C32F_EMULATED_16BFX9: u32 = 78;

    pub fn name(t: u32) -> String {
        match t {
            C16F => "CUBLAS_COMPUTE_16F".into(),
            C16F_PEDANTIC => "CUBLAS_COMPUTE_16F_PEDANTIC".into(),
            C32F => "CUBLAS_COMPUTE_32F".into(),
            C32F_PEDANTIC => "CUBLAS_COMPUTE_32F_PEDANTIC".into(),
            C64F => "CUBLAS_COMPUTE_64F".into(),
            C64F_PEDANTIC => "CUBLAS_COMPUTE_64F_PEDANTIC".into(),
            C32I => "CUBLAS_COMPUTE_32I".into(),
            C32I_PEDANTIC => "CUBLAS_COMPUTE_32I_PEDANTIC".into(),
            C32F_FAST_16F => "CUBLAS_COMPUTE_32F_FAST_16F".into(),
            C32F_FAST_16BF => "CUBLAS_COMPUTE_32F_FAST_16BF".into(),
            C32F_FAST_TF32 => "CUBLAS_COMPUTE_32F_FAST_TF32".into(),
            C32F_EMULATED_16BFX9 => "CUBLAS_COMPUTE_32F_EMULATED_16BFX9".into(),
            other => format!("cublasComputeType_t {other}"),
        }
    }
}

/// A storage type the emulator reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    F32,
    F16,
    Bf16,
}

impl Elem {
    pub fn from_cuda(t: u32) -> Option<Elem> {
        match t {
            data_type::R_32F => Some(Elem::F32),
            data_type::R_16F => Some(Elem::F16),
            data_type::R_16BF => Some(Elem::Bf16),
            _ => None,
        }
    }

    pub fn cuda(self) -> u32 {
        match self {
            Elem::F32 => data_type::R_32F,
            Elem::F16 => data_type::R_16F,
            Elem::Bf16 => data_type::R_16BF,
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::Bf16 => 2,
        }
    }

    /// Every element of `bytes` as f32 (exact for all three types).
    fn load(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            Elem::F32 => {
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            Elem::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Elem::Bf16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        }
    }

    /// `v` rounded once to this type (round to nearest even), written to `out`.
    fn store(self, v: f32, out: &mut [u8]) {
        match self {
            Elem::F32 => out.copy_from_slice(&v.to_le_bytes()),
            Elem::F16 => out.copy_from_slice(&f16::from_f32(v).to_le_bytes()),
            Elem::Bf16 => out.copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
        }
    }
}

/// How the products are formed, per the compute type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Compute {
    /// CUBLAS_COMPUTE_32F(_PEDANTIC): f32 products, f32 accumulation.
    F32,
    /// CUBLAS_COMPUTE_32F_FAST_TF32 / _FAST_16BF / _FAST_16F: f32 data that
    /// the library may multiply at the lower precision; the emulator always
    /// does (inputs rounded to nearest even first), so code that depends on
    /// full f32 products under a FAST type shows it here.
    Tf32,
    Bf16,
    F16,
}

impl Compute {
    fn round(self, x: f32) -> f32 {
        match self {
            Compute::F32 => x,
            Compute::Bf16 => bf16::from_f32(x).to_f32(),
            Compute::F16 => f16::from_f32(x).to_f32(),
            // TF32 keeps 10 of f32's 23 mantissa bits; round to nearest even
            // on the 13 dropped (NaN and infinities pass through).
            Compute::Tf32 if !x.is_finite() => x,
            Compute::Tf32 => {
                let bits = x.to_bits();
                let lsb = (bits >> 13) & 1;
                f32::from_bits(bits.wrapping_add(0x0fff + lsb) & !0x1fff)
            }
        }
    }
}

/// Which rows of cuBLASLt's table of supported types the emulator runs:
/// `Ok` with how to compute, or the reason the combination is refused.
/// Rows: COMPUTE_32F(_PEDANTIC) with scale R_32F and A/B → C/D of
/// 16BF→16BF, 16F→16F, 16BF→32F, 16F→32F, 32F→32F; COMPUTE_32F_FAST_16F /
/// _FAST_16BF / _FAST_TF32 with scale R_32F and 32F→32F.
pub fn table_row(
    compute: u32,
    scale: u32,
    ab: [u32; 2],
    cd: [u32; 2],
) -> std::result::Result<Compute, String> {
    use compute_type as ct;
    use data_type as dt;
    let combo = format!(
        "(computeType {}, scaleType {}, Atype {}, Btype {}, Ctype {}, Dtype {})",
        ct::name(compute),
        dt::name(scale),
        dt::name(ab[0]),
        dt::name(ab[1]),
        dt::name(cd[0]),
        dt::name(cd[1])
    );
    if ab[0] != ab[1] {
        return Err(format!(
            "{combo}: Atype and Btype differ; every row of cuBLASLt's table has Atype = Btype"
        ));
    }
    if cd[0] != cd[1] {
        return Err(format!("{combo}: Ctype and Dtype differ; cuBLASLt allows that only for FP8 inputs"));
    }
    let (ab, cd) = (ab[0], cd[0]);
    let run = match (compute, scale, ab, cd) {
        (ct::C32F | ct::C32F_PEDANTIC, dt::R_32F, dt::R_16BF, dt::R_16BF | dt::R_32F)
        | (ct::C32F | ct::C32F_PEDANTIC, dt::R_32F, dt::R_16F, dt::R_16F | dt::R_32F)
        | (ct::C32F | ct::C32F_PEDANTIC, dt::R_32F, dt::R_32F, dt::R_32F) => Some(Compute::F32),
        (ct::C32F_FAST_TF32, dt::R_32F, dt::R_32F, dt::R_32F) => Some(Compute::Tf32),
        (ct::C32F_FAST_16BF, dt::R_32F, dt::R_32F, dt::R_32F) => Some(Compute::Bf16),
        (ct::C32F_FAST_16F, dt::R_32F, dt::R_32F, dt::R_32F) => Some(Compute::F16),
        _ => None,
    };
    if let Some(run) = run {
        return Ok(run);
    }
    // Rows of the table the emulator does not run (f16 accumulation,
    // integers, complex, f64, FP8): refused as not implemented, so that a
    // caller can tell them from combinations cuBLASLt itself refuses.
    let documented = matches!(
        (compute, scale, ab, cd),
        (ct::C16F | ct::C16F_PEDANTIC, dt::R_16F, dt::R_16F, dt::R_16F)
            | (ct::C32I | ct::C32I_PEDANTIC, dt::R_32I, dt::R_8I, dt::R_32I)
            | (ct::C32I | ct::C32I_PEDANTIC, dt::R_32F, dt::R_8I, dt::R_8I)
            | (ct::C32F | ct::C32F_PEDANTIC, dt::R_32F, dt::R_8I, dt::R_32F)
            | (ct::C32F | ct::C32F_PEDANTIC, dt::C_32F, dt::C_8I | dt::C_32F, dt::C_32F)
            | (ct::C32F_FAST_16F | ct::C32F_FAST_16BF | ct::C32F_FAST_TF32, dt::C_32F, dt::C_32F, dt::C_32F)
            | (ct::C64F | ct::C64F_PEDANTIC, dt::R_64F, dt::R_64F, dt::R_64F)
            | (ct::C64F | ct::C64F_PEDANTIC, dt::C_64F, dt::C_64F, dt::C_64F)
    );
    if documented {
        Err(format!("{combo}: a row of cuBLASLt's table that the emulator does not implement"))
    } else {
        Err(format!("{combo}: not a combination cuBLASLt supports (its table of cublasLtMatmul data types)"))
    }
}

/// A matrix as its layout stores it (column-major): `ld` elements between
/// the starts of consecutive columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Matrix {
    pub elem: Elem,
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
}

impl Matrix {
    /// Elements from the first to the last one the layout covers:
    /// (cols − 1)·ld + rows, or none for an empty matrix.
    pub fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.cols - 1) * self.ld + self.rows
        }
    }

    pub fn extent_bytes(&self) -> usize {
        self.extent() * self.elem.bytes()
    }
}

/// The epilogue applied to alpha·op(A)·op(B) + beta·C.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    Default,
    /// CUBLASLT_EPILOGUE_BIAS: a vector of m elements (of `Elem`, packed)
    /// added to every column of D.
    Bias(Elem),
}

/// D = alpha·op(A)·op(B) + beta·C (+ epilogue), column-major; A is m×k
/// after op, B k×n, C and D m×n. Built only by `Problem::new`, which
/// checks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Problem {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub a: Matrix,
    pub b: Matrix,
    pub c: Matrix,
    pub d: Matrix,
    pub compute: Compute,
    pub epilogue: Epilogue,
}

/// A matrix layout as the caller described it, before any check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutSpec {
    pub data_type: u32,
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
}

/// The operation as the caller described it, before any check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpSpec {
    pub compute_type: u32,
    pub scale_type: u32,
    pub trans_a: bool,
    pub trans_b: bool,
    /// None: CUBLASLT_EPILOGUE_DEFAULT; Some(t): BIAS with bias data type t
    /// (-1 means D's type, cuBLASLt's default).
    pub bias_type: Option<i32>,
}

fn invalid(msg: String) -> EmuError {
    EmuError::new(status::INVALID_VALUE, msg)
}

fn unsupported(msg: String) -> EmuError {
    EmuError::new(status::NOT_SUPPORTED, msg)
}

impl Problem {
    /// Checks the operation and the four layouts against cuBLASLt's rules;
    /// errors start with `call` and name the culprit.
    pub fn new(call: &str, op: &OpSpec, layouts: [&LayoutSpec; 4]) -> Result<Problem> {
        let [la, lb, lc, ld] = layouts;
        let compute = table_row(
            op.compute_type,
            op.scale_type,
            [la.data_type, lb.data_type],
            [lc.data_type, ld.data_type],
        )
        .map_err(|why| unsupported(format!("{call}: {why}")))?;
        let matrix = |name: &str, l: &LayoutSpec| -> Result<Matrix> {
            let elem = Elem::from_cuda(l.data_type).ok_or_else(|| {
                unsupported(format!("{call}: {name}'s type {} is not emulated", data_type::name(l.data_type)))
            })?;
            let too_big =
                || invalid(format!("{call}: {name} is {}×{}, beyond this host's memory", l.rows, l.cols));
            let rows = usize::try_from(l.rows).map_err(|_| too_big())?;
            let cols = usize::try_from(l.cols).map_err(|_| too_big())?;
            if l.ld < 0 || (l.ld as u64) < l.rows.max(1) {
                return Err(invalid(format!(
                    "{call}: {name}'s leading dimension {} is below its {} rows (a column-major layout \
                     needs ld ≥ max(1, rows))",
                    l.ld, l.rows
                )));
            }
            let ld = l.ld as usize;
            let m = Matrix { elem, rows, cols, ld };
            m.cols.checked_mul(ld).and_then(|e| e.checked_mul(elem.bytes())).ok_or_else(too_big)?;
            Ok(m)
        };
        let (a, b, c, d) = (matrix("A", la)?, matrix("B", lb)?, matrix("C", lc)?, matrix("D", ld)?);
        let (m, ka) = if op.trans_a { (a.cols, a.rows) } else { (a.rows, a.cols) };
        let (kb, n) = if op.trans_b { (b.cols, b.rows) } else { (b.rows, b.cols) };
        let op_name = |t: bool| if t { "T" } else { "N" };
        if ka != kb {
            return Err(invalid(format!(
                "{call}: op(A) = {}(A {}×{}) is {m}×{ka} but op(B) = {}(B {}×{}) is {kb}×{n}: \
                 their k differ",
                op_name(op.trans_a),
                a.rows,
                a.cols,
                op_name(op.trans_b),
                b.rows,
                b.cols
            )));
        }
        for (name, x) in [("C", &c), ("D", &d)] {
            if (x.rows, x.cols) != (m, n) {
                return Err(invalid(format!(
                    "{call}: {name} is {}×{} but op(A)·op(B) is {m}×{n}",
                    x.rows, x.cols
                )));
            }
        }
        let epilogue = match op.bias_type {
            None => Epilogue::Default,
            Some(t) => {
                // cuBLASLt: the bias has D's type for these rows (the
                // exceptions are integer and FP8 outputs, not emulated).
                let t = if t == -1 { ld.data_type } else { t as u32 };
                if t != ld.data_type {
                    return Err(unsupported(format!(
                        "{call}: bias type {} differs from D's type {}; for these types cuBLASLt takes \
                         the bias in D's type",
                        data_type::name(t),
                        data_type::name(ld.data_type)
                    )));
                }
                Epilogue::Bias(d.elem)
            }
        };
        let (trans_a, trans_b) = (op.trans_a, op.trans_b);
        Ok(Problem { m, n, k: ka, trans_a, trans_b, a, b, c, d, compute, epilogue })
    }

    /// Bytes of the bias vector the epilogue reads.
    pub fn bias_bytes(&self) -> usize {
        match self.epilogue {
            Epilogue::Default => 0,
            Epilogue::Bias(e) => self.m * e.bytes(),
        }
    }
}

/// D = alpha·op(A)·op(B) + beta·C (+ bias) on host bytes: each operand slice
/// holds its layout's extent (`Matrix::extent_bytes`), `d` too, and only
/// D's m×n elements are written (the bytes between columns are kept).
/// Products are f32 through `gemm`, summed in f32; alpha, beta and the
/// bias are applied in f32 and the result is rounded to D's type once.
/// C is not read when beta is 0 (BLAS: then C need not hold numbers).
#[allow(clippy::too_many_arguments)]
pub fn compute(
    p: &Problem,
    alpha: f32,
    beta: f32,
    a: &[u8],
    b: &[u8],
    c: Option<&[u8]>,
    bias: Option<&[u8]>,
    d: &mut [u8],
) -> Result<()> {
    let short = |name: &str, got: usize, want: usize| {
        if got < want {
            Err(invalid(format!("compute: {name} holds {got} bytes but its layout spans {want}")))
        } else {
            Ok(())
        }
    };
    short("A", a.len(), p.a.extent_bytes())?;
    short("B", b.len(), p.b.extent_bytes())?;
    short("D", d.len(), p.d.extent_bytes())?;
    let c = match (beta != 0.0, c) {
        (false, _) => None,
        (true, Some(c)) => {
            short("C", c.len(), p.c.extent_bytes())?;
            Some(p.c.elem.load(&c[..p.c.extent_bytes()]))
        }
        (true, None) => return Err(invalid("compute: beta is nonzero but there is no C".into())),
    };
    let bias = match (p.epilogue, bias) {
        (Epilogue::Default, _) => None,
        (Epilogue::Bias(e), Some(v)) => {
            short("bias", v.len(), p.bias_bytes())?;
            Some(e.load(&v[..p.bias_bytes()]))
        }
        (Epilogue::Bias(_), None) => return Err(invalid("compute: the BIAS epilogue has no bias".into())),
    };
    let load = |x: &Matrix, bytes: &[u8]| -> Vec<f32> {
        let mut v = x.elem.load(&bytes[..x.extent_bytes()]);
        if p.compute != Compute::F32 {
            v.iter_mut().for_each(|e| *e = p.compute.round(*e));
        }
        v
    };
    let (av, bv) = (load(&p.a, a), load(&p.b, b));
    let (m, n, k) = (p.m, p.n, p.k);
    // acc (m×n, column-major, packed) = op(A)·op(B).
    let mut acc = vec![0f32; m * n];
    if m > 0 && n > 0 && k > 0 {
        // Element (i, l) of op(A): A(i, l) at i + l·lda, or A(l, i) at l + i·lda.
        let (a_rs, a_cs) = if p.trans_a { (p.a.ld, 1) } else { (1, p.a.ld) };
        let (b_rs, b_cs) = if p.trans_b { (p.b.ld, 1) } else { (1, p.b.ld) };
        // SAFETY: every index gemm forms, (m−1)·rs + (k−1)·cs for op(A) and
        // likewise for op(B), is below the layout's extent, which `av`/`bv`
        // hold; `acc` is m×n with column stride m.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                acc.as_mut_ptr(),
                m as isize,
                1,
                false,
                av.as_ptr(),
                a_cs as isize,
                a_rs as isize,
                bv.as_ptr(),
                b_cs as isize,
                b_rs as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
    let size = p.d.elem.bytes();
    for j in 0..n {
        for i in 0..m {
            let mut v = alpha * acc[i + j * m];
            if let Some(c) = &c {
                v += beta * c[i + j * p.c.ld];
            }
            if let Some(bias) = &bias {
                v += bias[i];
            }
            let at = (i + j * p.d.ld) * size;
            p.d.elem.store(v, &mut d[at..at + size]);
        }
    }
    Ok(())
}
