//! cuBLASLt's entry points: handles, matmul descriptors, matrix layouts,
//! preferences, the heuristic and cublasLtMatmul, with the C signatures
//! cudarc 0.19 loads (CUDA 13 enum values).
//!
//! Owns the C objects (opaque ids in one registry, so a destroyed, null or
//! wrong-kind handle is an error naming the call, never a dereference) and
//! the refusals of what the emulator does not implement. The product itself
//! is `problem` (pure, on host slices); the algorithm and pointer checks are
//! `launch`. cublasLtMatmul queues the product on the caller's stream
//! (`stream::enqueue`), so it is ordered with the kernels on that stream.
//!
//! Every failure returns a cublasStatus_t and reports a message through
//! `error::report(Lib::CublasLt, ..)`; cublasLtGetStatusString gives the
//! latest message for a status back.

// The C entry points' safety contract is NVIDIA's documentation of each
// call (valid out-pointers, buffers of the stated size); they check what a
// C caller can get wrong and never trust an id they did not hand out.
#![allow(clippy::missing_safety_doc)]

pub mod launch;
pub mod problem;

use crate::error::{report, EmuError, Lib, Result};
use crate::{context, memory, stream};
use launch::{Algo, Operands, DEFAULT_ALIGNMENT};
use problem::{compute_type, status, LayoutSpec, OpSpec, Problem};
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// cublasLtEpilogue_t values.
pub mod epilogue {
    pub const DEFAULT: u32 = 1;
    pub const BIAS: u32 = 4;

    pub fn name(e: u32) -> Option<&'static str> {
        Some(match e {
            1 => "CUBLASLT_EPILOGUE_DEFAULT",
            2 => "CUBLASLT_EPILOGUE_RELU",
            130 => "CUBLASLT_EPILOGUE_RELU_AUX",
            4 => "CUBLASLT_EPILOGUE_BIAS",
            6 => "CUBLASLT_EPILOGUE_RELU_BIAS",
            134 => "CUBLASLT_EPILOGUE_RELU_AUX_BIAS",
            136 => "CUBLASLT_EPILOGUE_DRELU",
            152 => "CUBLASLT_EPILOGUE_DRELU_BGRAD",
            32 => "CUBLASLT_EPILOGUE_GELU",
            160 => "CUBLASLT_EPILOGUE_GELU_AUX",
            36 => "CUBLASLT_EPILOGUE_GELU_BIAS",
            164 => "CUBLASLT_EPILOGUE_GELU_AUX_BIAS",
            192 => "CUBLASLT_EPILOGUE_DGELU",
            208 => "CUBLASLT_EPILOGUE_DGELU_BGRAD",
            256 => "CUBLASLT_EPILOGUE_BGRADA",
            512 => "CUBLASLT_EPILOGUE_BGRADB",
            _ => return None,
        })
    }
}

/// cublasLtMatmulDescAttributes_t names (CUDA 13.0).
fn desc_attr_name(attr: u32) -> Option<&'static str> {
    Some(match attr {
        0 => "CUBLASLT_MATMUL_DESC_COMPUTE_TYPE",
        1 => "CUBLASLT_MATMUL_DESC_SCALE_TYPE",
        2 => "CUBLASLT_MATMUL_DESC_POINTER_MODE",
        3 => "CUBLASLT_MATMUL_DESC_TRANSA",
        4 => "CUBLASLT_MATMUL_DESC_TRANSB",
        5 => "CUBLASLT_MATMUL_DESC_TRANSC",
        6 => "CUBLASLT_MATMUL_DESC_FILL_MODE",
        7 => "CUBLASLT_MATMUL_DESC_EPILOGUE",
        8 => "CUBLASLT_MATMUL_DESC_BIAS_POINTER",
        10 => "CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE",
        11 => "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER",
        12 => "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD",
        13 => "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE",
        14 => "CUBLASLT_MATMUL_DESC_ALPHA_VECTOR_BATCH_STRIDE",
        15 => "CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET",
        17 => "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER",
        18 => "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER",
        19 => "CUBLASLT_MATMUL_DESC_C_SCALE_POINTER",
        20 => "CUBLASLT_MATMUL_DESC_D_SCALE_POINTER",
        21 => "CUBLASLT_MATMUL_DESC_AMAX_D_POINTER",
        22 => "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE",
        23 => "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_POINTER",
        24 => "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_AMAX_POINTER",
        25 => "CUBLASLT_MATMUL_DESC_FAST_ACCUM",
        26 => "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE",
        31 => "CUBLASLT_MATMUL_DESC_A_SCALE_MODE",
        32 => "CUBLASLT_MATMUL_DESC_B_SCALE_MODE",
        33 => "CUBLASLT_MATMUL_DESC_C_SCALE_MODE",
        34 => "CUBLASLT_MATMUL_DESC_D_SCALE_MODE",
        35 => "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_MODE",
        36 => "CUBLASLT_MATMUL_DESC_D_OUT_SCALE_POINTER",
        37 => "CUBLASLT_MATMUL_DESC_D_OUT_SCALE_MODE",
        38 => "CUBLASLT_MATMUL_DESC_EMULATION_DESCRIPTOR",
        _ => return None,
    })
}

fn layout_attr_name(attr: u32) -> Option<&'static str> {
    Some(match attr {
        0 => "CUBLASLT_MATRIX_LAYOUT_TYPE",
        1 => "CUBLASLT_MATRIX_LAYOUT_ORDER",
        2 => "CUBLASLT_MATRIX_LAYOUT_ROWS",
        3 => "CUBLASLT_MATRIX_LAYOUT_COLS",
        4 => "CUBLASLT_MATRIX_LAYOUT_LD",
        5 => "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT",
        6 => "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET",
        7 => "CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET",
        8 => "CUBLASLT_MATRIX_LAYOUT_BATCH_MODE",
        _ => return None,
    })
}

fn pref_attr_name(attr: u32) -> Option<&'static str> {
    Some(match attr {
        0 => "CUBLASLT_MATMUL_PREF_SEARCH_MODE",
        1 => "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES",
        3 => "CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK",
        5 => "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES",
        6 => "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES",
        7 => "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES",
        8 => "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES",
        9 => "CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT",
        12 => "CUBLASLT_MATMUL_PREF_IMPL_MASK",
        _ => return None,
    })
}

/// A cuBLASLt handle: the device current when it was made, if any (a
/// handle is tied to its device).
#[derive(Clone, Copy, Debug)]
struct Handle {
    device: Option<usize>,
}

/// A matmul descriptor's attributes, as set.
#[derive(Clone, Copy, Debug)]
struct Desc {
    compute_type: u32,
    scale_type: u32,
    trans_a: i32,
    trans_b: i32,
    epilogue: u32,
    bias_pointer: u64,
    bias_type: i32,
}

#[derive(Clone, Copy, Debug)]
struct Layout {
    spec: LayoutSpec,
    batch_offset: i64,
}

#[derive(Clone, Copy, Debug)]
struct Pref {
    max_workspace: u64,
    align: [u32; 4],
    reduction_mask: u32,
}

impl Default for Pref {
    fn default() -> Pref {
        Pref { max_workspace: 0, align: [DEFAULT_ALIGNMENT; 4], reduction_mask: 7 }
    }
}

#[derive(Clone, Copy, Debug)]
enum Object {
    Handle(Handle),
    Desc(Desc),
    Layout(Layout),
    Pref(Pref),
}

impl Object {
    fn kind(&self) -> &'static str {
        match self {
            Object::Handle(_) => "handle",
            Object::Desc(_) => "matmul descriptor",
            Object::Layout(_) => "matrix layout",
            Object::Pref(_) => "matmul preference",
        }
    }
}

static OBJECTS: Mutex<BTreeMap<usize, Object>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

fn objects() -> std::sync::MutexGuard<'static, BTreeMap<usize, Object>> {
    OBJECTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// A new object's id: never 0 and never reused, so a destroyed id stays unknown.
fn create(obj: Object) -> usize {
    let id = 0xb1a5_0000_0000 + NEXT_ID.fetch_add(1, Ordering::Relaxed) * 0x10;
    objects().insert(id, obj);
    id
}

fn invalid(msg: String) -> EmuError {
    EmuError::new(status::INVALID_VALUE, msg)
}

fn unsupported(msg: String) -> EmuError {
    EmuError::new(status::NOT_SUPPORTED, msg)
}

/// Runs `f` on the live object `id` of the kind `pick` accepts.
fn with<T>(
    call: &str,
    what: &str,
    id: usize,
    pick: impl FnOnce(&mut Object) -> Option<&mut T>,
    f: impl FnOnce(&mut T) -> Result<()>,
) -> Result<()> {
    let code = if what == "handle" { status::NOT_INITIALIZED } else { status::INVALID_VALUE };
    if id == 0 {
        return Err(EmuError::new(code, format!("{call}: the {what} is null")));
    }
    let mut objs = objects();
    let obj = objs.get_mut(&id).ok_or_else(|| {
        EmuError::new(code, format!("{call}: {what} {id:#x} is not live (destroyed, or never created)"))
    })?;
    let kind = obj.kind();
    let t = pick(obj).ok_or_else(|| invalid(format!("{call}: {id:#x} is a {kind}, not a {what}")))?;
    f(t)
}

fn handle_of(call: &str, id: usize) -> Result<Handle> {
    copy_of(call, "handle", id, pick_handle)
}

fn pick_handle(o: &mut Object) -> Option<&mut Handle> {
    if let Object::Handle(h) = o {
        Some(h)
    } else {
        None
    }
}

fn pick_desc(o: &mut Object) -> Option<&mut Desc> {
    if let Object::Desc(d) = o {
        Some(d)
    } else {
        None
    }
}

fn pick_layout(o: &mut Object) -> Option<&mut Layout> {
    if let Object::Layout(l) = o {
        Some(l)
    } else {
        None
    }
}

fn pick_pref(o: &mut Object) -> Option<&mut Pref> {
    if let Object::Pref(p) = o {
        Some(p)
    } else {
        None
    }
}

fn copy_of<T: Copy>(
    call: &str,
    what: &str,
    id: usize,
    pick: impl FnOnce(&mut Object) -> Option<&mut T>,
) -> Result<T> {
    let mut out = None;
    with(call, what, id, pick, |t: &mut T| {
        out = Some(*t);
        Ok(())
    })?;
    Ok(out.expect("set by with"))
}

fn destroy(call: &str, what: &str, id: usize, kind: &str) -> Result<()> {
    let code = if what == "handle" { status::NOT_INITIALIZED } else { status::INVALID_VALUE };
    if id == 0 {
        return Err(EmuError::new(code, format!("{call}: the {what} is null")));
    }
    let mut objs = objects();
    match objs.get(&id) {
        None => Err(EmuError::new(code, format!("{call}: {what} {id:#x} is not live (destroyed twice?)"))),
        Some(o) if o.kind() != kind => {
            Err(invalid(format!("{call}: {id:#x} is a {}, not a {what}", o.kind())))
        }
        Some(_) => {
            objs.remove(&id);
            Ok(())
        }
    }
}

/// Runs an entry point's body: its status, with any error reported.
fn entry(call: &str, f: impl FnOnce() -> Result<()>) -> u32 {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => status::SUCCESS,
        Ok(Err(e)) => report(Lib::CublasLt, &e),
        Err(_) => report(
            Lib::CublasLt,
            &EmuError::new(status::INTERNAL_ERROR, format!("{call}: the emulator panicked (a bug in it)")),
        ),
    }
}

/// Writes a new object's id through the caller's out-pointer.
unsafe fn hand_out(call: &str, out: *mut *mut c_void, obj: Object) -> Result<()> {
    if out.is_null() {
        return Err(invalid(format!("{call}: the out-pointer for the new {} is null", obj.kind())));
    }
    *out = create(obj) as *mut c_void;
    Ok(())
}

/// An attribute's value: exactly `N` bytes, as its documented type takes.
unsafe fn value<const N: usize>(call: &str, name: &str, buf: *const c_void, size: usize) -> Result<[u8; N]> {
    if buf.is_null() {
        return Err(invalid(format!("{call}: {name}: the value's buffer is null")));
    }
    if size != N {
        return Err(invalid(format!("{call}: {name} takes {N} bytes, got sizeInBytes {size}")));
    }
    let mut v = [0u8; N];
    std::ptr::copy_nonoverlapping(buf as *const u8, v.as_mut_ptr(), N);
    Ok(v)
}

fn u32_of(v: [u8; 4]) -> u32 {
    u32::from_ne_bytes(v)
}

fn i32_of(v: [u8; 4]) -> i32 {
    i32::from_ne_bytes(v)
}

/// Hands an attribute's value back per cuBLASLt's GetAttribute contract:
/// with sizeInBytes 0 and a null buffer only its size is written.
unsafe fn give_back(
    call: &str,
    name: &str,
    v: &[u8],
    buf: *mut c_void,
    size: usize,
    written: *mut usize,
) -> Result<()> {
    if size == 0 && buf.is_null() {
        if written.is_null() {
            return Err(invalid(format!("{call}: {name}: sizeInBytes is 0 and sizeWritten is null")));
        }
        *written = v.len();
        return Ok(());
    }
    if buf.is_null() || size < v.len() {
        return Err(invalid(format!(
            "{call}: {name} needs a buffer of {} bytes, got {size}{}",
            v.len(),
            if buf.is_null() { " (null)" } else { "" }
        )));
    }
    std::ptr::copy_nonoverlapping(v.as_ptr(), buf as *mut u8, v.len());
    if !written.is_null() {
        *written = v.len();
    }
    Ok(())
}

// ---- handles ---------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cublasLtCreate(handle: *mut *mut c_void) -> u32 {
    let call = "cublasLtCreate";
    // A handle belongs to the device current when it is made; one made
    // without a context takes the device of its first matmul's stream.
    entry(call, || hand_out(call, handle, Object::Handle(Handle { device: context::current_device().ok() })))
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtDestroy(handle: *mut c_void) -> u32 {
    let call = "cublasLtDestroy";
    entry(call, || destroy(call, "handle", handle as usize, "handle"))
}

#[no_mangle]
pub extern "C" fn cublasLtGetVersion() -> usize {
    // cuBLAS 13.0.0 (major·10000 + minor·100 + patch), the release whose
    // enum values the emulator uses.
    130000
}

#[no_mangle]
pub extern "C" fn cublasLtGetCudartVersion() -> usize {
    13000
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtGetProperty(kind: c_int, value: *mut c_int) -> u32 {
    let call = "cublasLtGetProperty";
    entry(call, || {
        if value.is_null() {
            return Err(invalid(format!("{call}: value is null")));
        }
        *value = match kind {
            0 => 13,
            1 | 2 => 0,
            other => return Err(invalid(format!("{call}: unknown libraryPropertyType {other}"))),
        };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cublasLtGetStatusName(code: u32) -> *const c_char {
    match status::name(code) {
        Some(name) => leak_c(name),
        None => c"CUBLAS_STATUS_UNKNOWN".as_ptr(),
    }
}

#[no_mangle]
pub extern "C" fn cublasLtGetStatusString(code: u32) -> *const c_char {
    crate::error::latest_message(Lib::CublasLt, code).unwrap_or_else(|| leak_c(status::text(code)))
}

/// A C string for a static text, kept for the rest of the process (one per
/// distinct text).
fn leak_c(text: &'static str) -> *const c_char {
    static TEXTS: Mutex<BTreeMap<&'static str, &'static std::ffi::CStr>> = Mutex::new(BTreeMap::new());
    let mut texts = TEXTS.lock().unwrap_or_else(|p| p.into_inner());
    let c = texts.entry(text).or_insert_with(|| {
        Box::leak(std::ffi::CString::new(text).expect("static texts hold no NUL").into_boxed_c_str())
    });
    c.as_ptr()
}

// ---- matmul descriptors ----------------------------------------------------

fn check_compute_type(call: &str, t: u32) -> Result<()> {
    if compute_type::name(t).starts_with("cublasComputeType_t") {
        return Err(invalid(format!("{call}: {t} is not a cublasComputeType_t")));
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulDescCreate(desc: *mut *mut c_void, compute: u32, scale: u32) -> u32 {
    let call = "cublasLtMatmulDescCreate";
    entry(call, || {
        check_compute_type(call, compute)?;
        let d = Desc {
            compute_type: compute,
            scale_type: scale,
            trans_a: 0,
            trans_b: 0,
            epilogue: epilogue::DEFAULT,
            bias_pointer: 0,
            bias_type: -1,
        };
        hand_out(call, desc, Object::Desc(d))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulDescDestroy(desc: *mut c_void) -> u32 {
    let call = "cublasLtMatmulDescDestroy";
    entry(call, || destroy(call, "matmul descriptor", desc as usize, "matmul descriptor"))
}

fn transpose(call: &str, name: &str, v: i32) -> Result<i32> {
    // CUBLAS_OP_N 0, CUBLAS_OP_T 1, CUBLAS_OP_C 2 (T for real types).
    match v {
        0..=2 => Ok(v),
        other => Err(invalid(format!("{call}: {name} = {other} is not a cublasOperation_t (N 0, T 1, C 2)"))),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulDescSetAttribute(
    desc: *mut c_void,
    attr: u32,
    buf: *const c_void,
    size: usize,
) -> u32 {
    let call = "cublasLtMatmulDescSetAttribute";
    entry(call, || {
        let name = desc_attr_name(attr)
            .ok_or_else(|| invalid(format!("{call}: unknown matmul descriptor attribute {attr}")))?;
        with(call, "matmul descriptor", desc as usize, pick_desc, |d: &mut Desc| {
            match attr {
                0 => {
                    let t = u32_of(value(call, name, buf, size)?);
                    check_compute_type(call, t)?;
                    d.compute_type = t;
                }
                1 => d.scale_type = u32_of(value(call, name, buf, size)?),
                2 => {
                    let mode = i32_of(value(call, name, buf, size)?);
                    if mode != 0 {
                        return Err(unsupported(format!(
                            "{call}: {name} = {mode}: only CUBLASLT_POINTER_MODE_HOST (0) is emulated"
                        )));
                    }
                }
                3 => d.trans_a = transpose(call, name, i32_of(value(call, name, buf, size)?))?,
                4 => d.trans_b = transpose(call, name, i32_of(value(call, name, buf, size)?))?,
                5 => {
                    let t = i32_of(value(call, name, buf, size)?);
                    if t != 0 {
                        return Err(unsupported(format!(
                            "{call}: {name} = {t}: cuBLASLt supports only CUBLAS_OP_N for C"
                        )));
                    }
                }
                6 => {
                    let fill = i32_of(value(call, name, buf, size)?);
                    if fill != 2 {
                        return Err(unsupported(format!(
                            "{call}: {name} = {fill}: only CUBLAS_FILL_MODE_FULL (2) is emulated"
                        )));
                    }
                }
                7 => {
                    let e = u32_of(value(call, name, buf, size)?);
                    match (e, epilogue::name(e)) {
                        (epilogue::DEFAULT | epilogue::BIAS, _) => d.epilogue = e,
                        (_, Some(known)) => {
                            return Err(unsupported(format!(
                                "{call}: {name} = {known}: only CUBLASLT_EPILOGUE_DEFAULT and \
                                 CUBLASLT_EPILOGUE_BIAS are emulated"
                            )))
                        }
                        (_, None) => {
                            return Err(invalid(format!("{call}: {name} = {e} is not a cublasLtEpilogue_t")))
                        }
                    }
                }
                8 => d.bias_pointer = u64::from_ne_bytes(value(call, name, buf, size)?),
                26 => d.bias_type = i32_of(value(call, name, buf, size)?),
                _ => return Err(unsupported(format!("{call}: {name} is not emulated"))),
            }
            Ok(())
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulDescGetAttribute(
    desc: *mut c_void,
    attr: u32,
    buf: *mut c_void,
    size: usize,
    written: *mut usize,
) -> u32 {
    let call = "cublasLtMatmulDescGetAttribute";
    entry(call, || {
        let name = desc_attr_name(attr)
            .ok_or_else(|| invalid(format!("{call}: unknown matmul descriptor attribute {attr}")))?;
        let d = copy_of(call, "matmul descriptor", desc as usize, pick_desc)?;
        let v: Vec<u8> = match attr {
            0 => d.compute_type.to_ne_bytes().into(),
            1 => d.scale_type.to_ne_bytes().into(),
            2 => 0i32.to_ne_bytes().into(),
            3 => d.trans_a.to_ne_bytes().into(),
            4 => d.trans_b.to_ne_bytes().into(),
            5 => 0i32.to_ne_bytes().into(),
            6 => 2i32.to_ne_bytes().into(),
            7 => d.epilogue.to_ne_bytes().into(),
            8 => d.bias_pointer.to_ne_bytes().into(),
            26 => d.bias_type.to_ne_bytes().into(),
            _ => return Err(unsupported(format!("{call}: {name} is not emulated"))),
        };
        give_back(call, name, &v, buf, size, written)
    })
}

// ---- matrix layouts --------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatrixLayoutCreate(
    layout: *mut *mut c_void,
    data_type: u32,
    rows: u64,
    cols: u64,
    ld: i64,
) -> u32 {
    let call = "cublasLtMatrixLayoutCreate";
    entry(call, || {
        let spec = LayoutSpec { data_type, rows, cols, ld };
        hand_out(call, layout, Object::Layout(Layout { spec, batch_offset: 0 }))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatrixLayoutDestroy(layout: *mut c_void) -> u32 {
    let call = "cublasLtMatrixLayoutDestroy";
    entry(call, || destroy(call, "matrix layout", layout as usize, "matrix layout"))
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatrixLayoutSetAttribute(
    layout: *mut c_void,
    attr: u32,
    buf: *const c_void,
    size: usize,
) -> u32 {
    let call = "cublasLtMatrixLayoutSetAttribute";
    entry(call, || {
        let name = layout_attr_name(attr)
            .ok_or_else(|| invalid(format!("{call}: unknown matrix layout attribute {attr}")))?;
        with(call, "matrix layout", layout as usize, pick_layout, |l: &mut Layout| {
            match attr {
                0 => l.spec.data_type = u32_of(value(call, name, buf, size)?),
                1 => {
                    let order = i32_of(value(call, name, buf, size)?);
                    if order != 0 {
                        return Err(unsupported(format!(
                            "{call}: {name} = {order}: only CUBLASLT_ORDER_COL (0) is emulated"
                        )));
                    }
                }
                2 => l.spec.rows = u64::from_ne_bytes(value(call, name, buf, size)?),
                3 => l.spec.cols = u64::from_ne_bytes(value(call, name, buf, size)?),
                4 => l.spec.ld = i64::from_ne_bytes(value(call, name, buf, size)?),
                5 => {
                    let count = i32_of(value(call, name, buf, size)?);
                    if count != 1 {
                        return Err(unsupported(format!(
                            "{call}: {name} = {count}: batched products are not emulated (only 1)"
                        )));
                    }
                }
                // Harmless with one batch: cuBLASLt reads it only between batches.
                6 => l.batch_offset = i64::from_ne_bytes(value(call, name, buf, size)?),
                _ => return Err(unsupported(format!("{call}: {name} is not emulated"))),
            }
            Ok(())
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatrixLayoutGetAttribute(
    layout: *mut c_void,
    attr: u32,
    buf: *mut c_void,
    size: usize,
    written: *mut usize,
) -> u32 {
    let call = "cublasLtMatrixLayoutGetAttribute";
    entry(call, || {
        let name = layout_attr_name(attr)
            .ok_or_else(|| invalid(format!("{call}: unknown matrix layout attribute {attr}")))?;
        let l = copy_of(call, "matrix layout", layout as usize, pick_layout)?;
        let v: Vec<u8> = match attr {
            0 => l.spec.data_type.to_ne_bytes().into(),
            1 => 0i32.to_ne_bytes().into(),
            2 => l.spec.rows.to_ne_bytes().into(),
            3 => l.spec.cols.to_ne_bytes().into(),
            4 => l.spec.ld.to_ne_bytes().into(),
            5 => 1i32.to_ne_bytes().into(),
            6 => l.batch_offset.to_ne_bytes().into(),
            _ => return Err(unsupported(format!("{call}: {name} is not emulated"))),
        };
        give_back(call, name, &v, buf, size, written)
    })
}

// ---- preferences -----------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulPreferenceCreate(pref: *mut *mut c_void) -> u32 {
    let call = "cublasLtMatmulPreferenceCreate";
    entry(call, || hand_out(call, pref, Object::Pref(Pref::default())))
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulPreferenceDestroy(pref: *mut c_void) -> u32 {
    let call = "cublasLtMatmulPreferenceDestroy";
    entry(call, || destroy(call, "matmul preference", pref as usize, "matmul preference"))
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulPreferenceSetAttribute(
    pref: *mut c_void,
    attr: u32,
    buf: *const c_void,
    size: usize,
) -> u32 {
    let call = "cublasLtMatmulPreferenceSetAttribute";
    entry(call, || {
        let name = pref_attr_name(attr)
            .ok_or_else(|| invalid(format!("{call}: unknown matmul preference attribute {attr}")))?;
        with(call, "matmul preference", pref as usize, pick_pref, |p: &mut Pref| {
            match attr {
                0 => {
                    let mode = u32_of(value(call, name, buf, size)?);
                    if mode != 0 {
                        return Err(unsupported(format!(
                            "{call}: {name} = {mode}: only CUBLASLT_SEARCH_BEST_FIT (0) is emulated"
                        )));
                    }
                }
                1 => p.max_workspace = u64::from_ne_bytes(value(call, name, buf, size)?),
                // The emulated algorithm reduces in place (no split-K
                // scheme), which every mask allows.
                3 => p.reduction_mask = u32_of(value(call, name, buf, size)?),
                5..=8 => {
                    let a = u32_of(value(call, name, buf, size)?);
                    if !a.is_power_of_two() {
                        return Err(invalid(format!("{call}: {name} = {a} is not a power of two")));
                    }
                    p.align[(attr - 5) as usize] = a;
                }
                _ => return Err(unsupported(format!("{call}: {name} is not emulated"))),
            }
            Ok(())
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulPreferenceGetAttribute(
    pref: *mut c_void,
    attr: u32,
    buf: *mut c_void,
    size: usize,
    written: *mut usize,
) -> u32 {
    let call = "cublasLtMatmulPreferenceGetAttribute";
    entry(call, || {
        let name = pref_attr_name(attr)
            .ok_or_else(|| invalid(format!("{call}: unknown matmul preference attribute {attr}")))?;
        let p = copy_of(call, "matmul preference", pref as usize, pick_pref)?;
        let v: Vec<u8> = match attr {
            0 => 0u32.to_ne_bytes().into(),
            1 => p.max_workspace.to_ne_bytes().into(),
            3 => p.reduction_mask.to_ne_bytes().into(),
            5..=8 => p.align[(attr - 5) as usize].to_ne_bytes().into(),
            _ => return Err(unsupported(format!("{call}: {name} is not emulated"))),
        };
        give_back(call, name, &v, buf, size, written)
    })
}

// ---- heuristic and matmul --------------------------------------------------

/// cublasLtMatmulHeuristicResult_t.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HeuristicResult {
    pub algo: [u64; 8],
    pub workspace_size: usize,
    pub state: u32,
    pub waves_count: f32,
    pub reserved: [c_int; 4],
}

// cublasLt.h's layout (cudarc's binding of it): 64 + 8 + 4 + 4 + 16 bytes.
const _: () = assert!(std::mem::size_of::<HeuristicResult>() == 96);

/// The problem the descriptor and the four layouts describe.
fn problem_of(call: &str, desc: usize, layouts: [usize; 4]) -> Result<Problem> {
    let d = copy_of(call, "matmul descriptor", desc, pick_desc)?;
    let mut specs = [LayoutSpec { data_type: 0, rows: 0, cols: 0, ld: 0 }; 4];
    for (i, (id, name)) in layouts.iter().zip(["A layout", "B layout", "C layout", "D layout"]).enumerate() {
        specs[i] = copy_of(call, name, *id, pick_layout)?.spec;
    }
    let op = OpSpec {
        compute_type: d.compute_type,
        scale_type: d.scale_type,
        trans_a: d.trans_a != 0,
        trans_b: d.trans_b != 0,
        bias_type: (d.epilogue == epilogue::BIAS).then_some(d.bias_type),
    };
    Problem::new(call, &op, [&specs[0], &specs[1], &specs[2], &specs[3]])
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulAlgoGetHeuristic(
    handle: *mut c_void,
    desc: *mut c_void,
    a: *mut c_void,
    b: *mut c_void,
    c: *mut c_void,
    d: *mut c_void,
    pref: *mut c_void,
    requested: c_int,
    results: *mut HeuristicResult,
    returned: *mut c_int,
) -> u32 {
    let call = "cublasLtMatmulAlgoGetHeuristic";
    entry(call, || {
        handle_of(call, handle as usize)?;
        if requested < 1 {
            return Err(invalid(format!("{call}: requestedAlgoCount = {requested}, at least 1 is needed")));
        }
        if results.is_null() || returned.is_null() {
            return Err(invalid(format!("{call}: heuristicResultsArray or returnAlgoCount is null")));
        }
        let p = problem_of(call, desc as usize, [a as usize, b as usize, c as usize, d as usize])?;
        let pref = copy_of(call, "matmul preference", pref as usize, pick_pref)?;
        let algo = launch::choose(call, &p, pref.max_workspace, pref.align)?;
        *results = HeuristicResult {
            algo: algo.encode(),
            workspace_size: algo.workspace as usize,
            state: status::SUCCESS,
            waves_count: 1.0,
            reserved: [0; 4],
        };
        *returned = 1;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmul(
    handle: *mut c_void,
    desc: *mut c_void,
    alpha: *const c_void,
    a: *const c_void,
    a_layout: *mut c_void,
    b: *const c_void,
    b_layout: *mut c_void,
    beta: *const c_void,
    c: *const c_void,
    c_layout: *mut c_void,
    d: *mut c_void,
    d_layout: *mut c_void,
    algo: *const [u64; 8],
    workspace: *mut c_void,
    workspace_bytes: usize,
    stream: *mut c_void,
) -> u32 {
    let call = "cublasLtMatmul";
    entry(call, || {
        handle_of(call, handle as usize)?;
        let layouts = [a_layout as usize, b_layout as usize, c_layout as usize, d_layout as usize];
        let p = problem_of(call, desc as usize, layouts)?;
        if alpha.is_null() || beta.is_null() {
            return Err(invalid(format!("{call}: alpha or beta is null (host scalars of the scale type)")));
        }
        // CUBLASLT_POINTER_MODE_HOST, scale type f32 (every emulated row).
        let (alpha, beta) = (*(alpha as *const f32), *(beta as *const f32));
        // Out of place (C ≠ D) the emulated algorithm takes any C layout of
        // the right shape and type. In place, reading C through one layout
        // while writing D through another races between thread blocks on a
        // GPU, so it is refused rather than given the emulator's
        // copy-first answer.
        if beta != 0.0 && std::ptr::eq(c, d) && p.c != p.d {
            return Err(invalid(format!(
                "{call}: C and D are the same memory (in place) but their layouts differ \
                 (C {:?}, D {:?}): D would overwrite elements C still has to supply",
                p.c, p.d
            )));
        }
        let algo = if algo.is_null() {
            // cuBLASLt runs its heuristic with default preferences when
            // no algorithm is given: no workspace, 256-byte alignment.
            launch::choose(call, &p, 0, [DEFAULT_ALIGNMENT; 4])?
        } else {
            Algo::decode(call, &*algo, &p)?
        };
        let device = stream::device_of(stream as usize)
            .map_err(|e| invalid(format!("{call}: stream {:#x}: {}", stream as usize, e.message)))?;
        // A handle made without a current context belongs to the device of
        // its first stream from then on.
        with(call, "handle", handle as usize, pick_handle, |h: &mut Handle| match h.device {
            Some(hd) if hd != device => Err(invalid(format!(
                "{call}: the handle belongs to device {hd} but the stream to device {device}"
            ))),
            _ => {
                h.device = Some(device);
                Ok(())
            }
        })?;
        let bias = copy_of(call, "matmul descriptor", desc as usize, pick_desc)?.bias_pointer;
        let ops = Operands {
            a: a as u64,
            b: b as u64,
            c: c as u64,
            d: d as u64,
            bias,
            workspace: workspace as u64,
            workspace_bytes: workspace_bytes as u64,
        };
        launch::check_operands(call, &p, &algo, &ops, beta, device, &memory::check_range)?;
        let label = format!("cublasLtMatmul m={} n={} k={}", p.m, p.n, p.k);
        stream::enqueue(stream as usize, label, Box::new(move || run(&p, alpha, beta, &ops, device)))
            .map_err(|e| EmuError::new(status::EXECUTION_FAILED, format!("{call}: {}", e.message)))
    })
}

/// The queued product: reads the operands from device memory (host
/// addresses in the emulator) once the stream reaches it, computes, and
/// writes D's m×n elements. The ranges are checked again, since a buffer
/// may have been freed between the call and its turn on the stream; the
/// operands are copied before D is written, so C = D in place is exact.
fn run(p: &Problem, alpha: f32, beta: f32, ops: &Operands, device: usize) -> Result<()> {
    let call = format!("cublasLtMatmul (m={} n={} k={}, on its stream)", p.m, p.n, p.k);
    let read = |name: &str, ptr: u64, bytes: usize| -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        memory::check_range(ptr, bytes as u64, device, &format!("{call}: {name}"))?;
        // SAFETY: [ptr, ptr + bytes) lies in a live allocation of this
        // device, whose address is its host address.
        Ok(unsafe { std::slice::from_raw_parts(ptr as *const u8, bytes) }.to_vec())
    };
    let a = read("A", ops.a, p.a.extent_bytes())?;
    let b = read("B", ops.b, p.b.extent_bytes())?;
    let c = if beta != 0.0 { Some(read("C", ops.c, p.c.extent_bytes())?) } else { None };
    let bias = match p.epilogue {
        problem::Epilogue::Bias(_) => Some(read("bias", ops.bias, p.bias_bytes())?),
        problem::Epilogue::Default => None,
    };
    let mut d = read("D", ops.d, p.d.extent_bytes())?;
    problem::compute(p, alpha, beta, &a, &b, c.as_deref(), bias.as_deref(), &mut d)
        .map_err(|e| EmuError::new(crate::error::cu::LAUNCH_FAILED, format!("{call}: {}", e.message)))?;
    let (size, col) = (p.d.elem.bytes(), p.d.rows * p.d.elem.bytes());
    for j in 0..p.d.cols {
        let at = j * p.d.ld * size;
        // SAFETY: the column lies inside D's extent, checked above; only
        // its m elements are written, never the bytes between columns.
        unsafe { std::ptr::copy_nonoverlapping(d[at..].as_ptr(), (ops.d as *mut u8).add(at), col) };
    }
    Ok(())
}

// ---- entry points the backend does not reach -------------------------------

/// Entry points cudarc binds that the emulator does not implement: each
/// refuses with CUBLAS_STATUS_NOT_SUPPORTED and says so, instead of the
/// process dying on a missing symbol.
macro_rules! not_emulated {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> u32 {
            $(let _ = $arg;)*
            report(Lib::CublasLt, &unsupported(format!("{}: not emulated", stringify!($name))))
        }
    )*};
}

not_emulated! {
    cublasLtMatmulAlgoInit(h: *mut c_void, ct: u32, st: u32, at: u32, bt: u32, ctype: u32, dt: u32,
        id: c_int, algo: *mut c_void);
    cublasLtMatmulAlgoCheck(h: *mut c_void, desc: *mut c_void, a: *mut c_void, b: *mut c_void,
        c: *mut c_void, d: *mut c_void, algo: *const c_void, result: *mut c_void);
    cublasLtMatmulAlgoGetIds(h: *mut c_void, ct: u32, st: u32, at: u32, bt: u32, ctype: u32, dt: u32,
        requested: c_int, ids: *mut c_int, returned: *mut c_int);
    cublasLtMatmulAlgoCapGetAttribute(algo: *const c_void, attr: u32, buf: *mut c_void, size: usize,
        written: *mut usize);
    cublasLtMatmulAlgoConfigGetAttribute(algo: *const c_void, attr: u32, buf: *mut c_void, size: usize,
        written: *mut usize);
    cublasLtMatmulAlgoConfigSetAttribute(algo: *mut c_void, attr: u32, buf: *const c_void, size: usize);
    cublasLtMatrixTransform(h: *mut c_void, desc: *mut c_void, alpha: *const c_void, a: *const c_void,
        al: *mut c_void, beta: *const c_void, b: *const c_void, bl: *mut c_void, c: *mut c_void,
        cl: *mut c_void, stream: *mut c_void);
    cublasLtMatrixTransformDescCreate(desc: *mut *mut c_void, scale: u32);
    cublasLtMatrixTransformDescDestroy(desc: *mut c_void);
    cublasLtMatrixTransformDescSetAttribute(desc: *mut c_void, attr: u32, buf: *const c_void, size: usize);
    cublasLtMatrixTransformDescGetAttribute(desc: *mut c_void, attr: u32, buf: *mut c_void, size: usize,
        written: *mut usize);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_of_destroyed_objects_are_never_handed_out_again() {
        let a = create(Object::Pref(Pref::default()));
        objects().remove(&a);
        let b = create(Object::Pref(Pref::default()));
        assert_ne!(a, b);
        assert_ne!(a, 0);
    }
}
