//! cuBLASLt's C entry points as cudarc calls them: the backend's exact call
//! sequence (kernels/cuda/matmul.rs `make_plan`) is accepted, and each
//! refusal returns its status with a message (cublasLtGetStatusString)
//! naming the call and the culprit. None of this needs the driver.

use pipewright_emu::cublaslt::problem::{compute_type as ct, data_type as dt, status};
use pipewright_emu::cublaslt::*;
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;
use std::sync::Mutex;

/// The latest message per status is process-wide: tests that read it take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn message(code: u32) -> String {
    unsafe { CStr::from_ptr(cublasLtGetStatusString(code)) }.to_string_lossy().into_owned()
}

/// Asserts `code` is `want` and the latest message for it names every part.
fn assert_refused(code: u32, want: u32, parts: &[&str]) {
    let name = unsafe { CStr::from_ptr(cublasLtGetStatusName(code)) }.to_string_lossy().into_owned();
    assert_eq!(code, want, "got {name}: {}", message(code));
    let msg = message(code);
    for part in parts {
        assert!(msg.contains(part), "{msg:?} does not name {part:?}");
    }
}

// Attribute numbers (CUDA 13.0's cublasLt.h, as cudarc binds them).
const DESC_TRANSA: u32 = 3;
const DESC_TRANSB: u32 = 4;
const DESC_EPILOGUE: u32 = 7;
const DESC_BIAS_POINTER: u32 = 8;
const DESC_BIAS_DATA_TYPE: u32 = 26;
const LAYOUT_ORDER: u32 = 1;
const LAYOUT_BATCH_COUNT: u32 = 5;
const PREF_MAX_WORKSPACE: u32 = 1;
const PREF_MIN_ALIGN_A: u32 = 5;
const EPILOGUE_BIAS: u32 = 4;
const EPILOGUE_GELU: u32 = 32;

unsafe fn set<T>(
    f: unsafe extern "C" fn(*mut c_void, u32, *const c_void, usize) -> u32,
    obj: *mut c_void,
    attr: u32,
    v: T,
) -> u32 {
    f(obj, attr, &v as *const T as *const c_void, std::mem::size_of::<T>())
}

fn new_handle() -> *mut c_void {
    let mut h = null_mut();
    assert_eq!(unsafe { cublasLtCreate(&mut h) }, status::SUCCESS);
    h
}

fn new_desc() -> *mut c_void {
    let mut d = null_mut();
    assert_eq!(unsafe { cublasLtMatmulDescCreate(&mut d, ct::C32F, dt::R_32F) }, status::SUCCESS);
    d
}

fn new_layout(t: u32, rows: u64, cols: u64, ld: i64) -> *mut c_void {
    let mut l = null_mut();
    assert_eq!(unsafe { cublasLtMatrixLayoutCreate(&mut l, t, rows, cols, ld) }, status::SUCCESS);
    l
}

fn new_pref() -> *mut c_void {
    let mut p = null_mut();
    assert_eq!(unsafe { cublasLtMatmulPreferenceCreate(&mut p) }, status::SUCCESS);
    p
}

/// The backend's forward product (bf16, bias): m = OC 64, n = N 8, k = IC 32.
struct Plan {
    handle: *mut c_void,
    desc: *mut c_void,
    a: *mut c_void,
    b: *mut c_void,
    c: *mut c_void,
    pref: *mut c_void,
}

unsafe fn backend_plan(max_workspace: u64, align: [u32; 4]) -> Plan {
    let (handle, desc) = (new_handle(), new_desc());
    assert_eq!(set(cublasLtMatmulDescSetAttribute, desc, DESC_TRANSA, 0i32), 0);
    assert_eq!(set(cublasLtMatmulDescSetAttribute, desc, DESC_TRANSB, 0i32), 0);
    assert_eq!(set(cublasLtMatmulDescSetAttribute, desc, DESC_EPILOGUE, EPILOGUE_BIAS), 0);
    assert_eq!(set(cublasLtMatmulDescSetAttribute, desc, DESC_BIAS_DATA_TYPE, dt::R_16BF), 0);
    assert_eq!(set(cublasLtMatmulDescSetAttribute, desc, DESC_BIAS_POINTER, 0x7f00_0000_0000u64), 0);
    let a = new_layout(dt::R_16BF, 64, 32, 64);
    let b = new_layout(dt::R_16BF, 32, 8, 32);
    let c = new_layout(dt::R_16BF, 64, 8, 64);
    let pref = new_pref();
    assert_eq!(set(cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE, max_workspace), 0);
    for (i, al) in align.into_iter().enumerate() {
        assert_eq!(set(cublasLtMatmulPreferenceSetAttribute, pref, PREF_MIN_ALIGN_A + i as u32, al), 0);
    }
    Plan { handle, desc, a, b, c, pref }
}

unsafe fn heuristic(p: &Plan) -> (u32, HeuristicResult, i32) {
    let mut r =
        HeuristicResult { algo: [0; 8], workspace_size: 0, state: 99, waves_count: 0.0, reserved: [0; 4] };
    let mut count = 0;
    let code =
        cublasLtMatmulAlgoGetHeuristic(p.handle, p.desc, p.a, p.b, p.c, p.c, p.pref, 1, &mut r, &mut count);
    (code, r, count)
}

#[test]
fn the_backends_plan_sequence_gets_one_algorithm_and_its_workspace() {
    let _g = serial();
    unsafe {
        let p = backend_plan(32 << 20, [256, 128, 256, 256]);
        let (code, r, count) = heuristic(&p);
        assert_eq!((code, count, r.state), (status::SUCCESS, 1, status::SUCCESS), "{}", message(code));
        assert_eq!(r.workspace_size, 64 * 8 * 4);
        let p = backend_plan(0, [256; 4]);
        let (_, r, _) = heuristic(&p);
        assert_eq!(r.workspace_size, 0, "no workspace allowed, none asked for");
        for l in [p.a, p.b, p.c] {
            assert_eq!(cublasLtMatrixLayoutDestroy(l), 0);
        }
        assert_eq!(cublasLtMatmulPreferenceDestroy(p.pref), 0);
        assert_eq!(cublasLtMatmulDescDestroy(p.desc), 0);
        assert_eq!(cublasLtDestroy(p.handle), 0);
    }
}

#[test]
fn attributes_read_back_as_they_were_set() {
    let _g = serial();
    unsafe {
        let p = backend_plan(1 << 20, [256, 16, 256, 256]);
        let mut ws = 0u64;
        let mut written = 0usize;
        let code = cublasLtMatmulPreferenceGetAttribute(
            p.pref,
            PREF_MAX_WORKSPACE,
            &mut ws as *mut u64 as *mut c_void,
            8,
            &mut written,
        );
        assert_eq!((code, ws, written), (0, 1 << 20, 8));
        let mut ld = 0i64;
        let code =
            cublasLtMatrixLayoutGetAttribute(p.b, 4, &mut ld as *mut i64 as *mut c_void, 8, &mut written);
        assert_eq!((code, ld), (0, 32));
        // Size query: a null buffer with size 0 gives the size only.
        let code = cublasLtMatmulDescGetAttribute(p.desc, DESC_BIAS_POINTER, null_mut(), 0, &mut written);
        assert_eq!((code, written), (0, 8));
        let mut bias = 0u64;
        let code = cublasLtMatmulDescGetAttribute(
            p.desc,
            DESC_BIAS_POINTER,
            &mut bias as *mut u64 as *mut c_void,
            8,
            &mut written,
        );
        assert_eq!((code, bias), (0, 0x7f00_0000_0000));
    }
}

#[test]
fn an_unknown_descriptor_attribute_is_refused_by_number() {
    let _g = serial();
    unsafe {
        let code = set(cublasLtMatmulDescSetAttribute, new_desc(), 999, 0u32);
        assert_refused(code, status::INVALID_VALUE, &["cublasLtMatmulDescSetAttribute", "attribute 999"]);
    }
}

#[test]
fn a_known_attribute_the_emulator_does_not_run_is_not_supported_by_name() {
    let _g = serial();
    unsafe {
        let code = set(cublasLtMatmulDescSetAttribute, new_desc(), 15, 4i32);
        assert_refused(
            code,
            status::NOT_SUPPORTED,
            &["CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET is not emulated"],
        );
        let code = set(cublasLtMatmulDescSetAttribute, new_desc(), DESC_EPILOGUE, EPILOGUE_GELU);
        assert_refused(code, status::NOT_SUPPORTED, &["CUBLASLT_EPILOGUE_GELU"]);
        let code = set(cublasLtMatmulDescSetAttribute, new_desc(), DESC_EPILOGUE, 12345u32);
        assert_refused(code, status::INVALID_VALUE, &["12345 is not a cublasLtEpilogue_t"]);
    }
}

#[test]
fn an_attribute_value_of_the_wrong_size_is_refused() {
    let _g = serial();
    unsafe {
        // The bias pointer as a 4-byte value: the caller's bug cuBLASLt refuses.
        let code = set(cublasLtMatmulDescSetAttribute, new_desc(), DESC_BIAS_POINTER, 0x1000u32);
        assert_refused(
            code,
            status::INVALID_VALUE,
            &["CUBLASLT_MATMUL_DESC_BIAS_POINTER takes 8 bytes", "4"],
        );
    }
}

#[test]
fn row_major_and_batched_layouts_are_refused() {
    let _g = serial();
    unsafe {
        let l = new_layout(dt::R_32F, 4, 4, 4);
        let code = set(cublasLtMatrixLayoutSetAttribute, l, LAYOUT_ORDER, 1i32);
        assert_refused(
            code,
            status::NOT_SUPPORTED,
            &["CUBLASLT_MATRIX_LAYOUT_ORDER = 1", "CUBLASLT_ORDER_COL"],
        );
        let code = set(cublasLtMatrixLayoutSetAttribute, l, LAYOUT_BATCH_COUNT, 4i32);
        assert_refused(code, status::NOT_SUPPORTED, &["CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 4"]);
        assert_eq!(set(cublasLtMatrixLayoutSetAttribute, l, LAYOUT_BATCH_COUNT, 1i32), 0);
    }
}

#[test]
fn an_alignment_promise_that_is_not_a_power_of_two_is_refused() {
    let _g = serial();
    unsafe {
        let code = set(cublasLtMatmulPreferenceSetAttribute, new_pref(), PREF_MIN_ALIGN_A + 2, 48u32);
        assert_refused(code, status::INVALID_VALUE, &["CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 48"]);
    }
}

#[test]
fn destroyed_null_and_wrong_kind_objects_are_refused() {
    let _g = serial();
    unsafe {
        let h = new_handle();
        assert_eq!(cublasLtDestroy(h), 0);
        assert_refused(cublasLtDestroy(h), status::NOT_INITIALIZED, &["cublasLtDestroy", "not live"]);
        let p = backend_plan(0, [256; 4]);
        let mut r =
            HeuristicResult { algo: [0; 8], workspace_size: 0, state: 0, waves_count: 0.0, reserved: [0; 4] };
        let mut n = 0;
        let code = cublasLtMatmulAlgoGetHeuristic(h, p.desc, p.a, p.b, p.c, p.c, p.pref, 1, &mut r, &mut n);
        assert_refused(
            code,
            status::NOT_INITIALIZED,
            &["cublasLtMatmulAlgoGetHeuristic", "handle", "not live"],
        );
        // A layout where the descriptor goes.
        let code =
            cublasLtMatmulAlgoGetHeuristic(p.handle, p.a, p.a, p.b, p.c, p.c, p.pref, 1, &mut r, &mut n);
        assert_refused(code, status::INVALID_VALUE, &["is a matrix layout, not a matmul descriptor"]);
        let code = cublasLtMatmulAlgoGetHeuristic(
            p.handle,
            p.desc,
            p.a,
            null_mut(),
            p.c,
            p.c,
            p.pref,
            1,
            &mut r,
            &mut n,
        );
        assert_refused(code, status::INVALID_VALUE, &["the B layout is null"]);
    }
}

#[test]
fn the_heuristic_refuses_a_type_combination_outside_the_table() {
    let _g = serial();
    unsafe {
        let p = backend_plan(0, [256; 4]);
        let f32_b = new_layout(dt::R_32F, 32, 8, 32);
        let mut r =
            HeuristicResult { algo: [0; 8], workspace_size: 0, state: 0, waves_count: 0.0, reserved: [0; 4] };
        let mut n = 0;
        let code =
            cublasLtMatmulAlgoGetHeuristic(p.handle, p.desc, p.a, f32_b, p.c, p.c, p.pref, 1, &mut r, &mut n);
        assert_refused(code, status::NOT_SUPPORTED, &["Atype CUDA_R_16BF", "Btype CUDA_R_32F"]);
    }
}

#[test]
fn matmul_refuses_an_algo_from_the_heuristic_for_another_problem() {
    let _g = serial();
    unsafe {
        let p = backend_plan(0, [256; 4]);
        let (_, r, _) = heuristic(&p);
        // Same shapes, but B's leading dimension differs from the planned one.
        let b2 = new_layout(dt::R_16BF, 32, 8, 48);
        let (alpha, beta) = (1f32, 0f32);
        let (al, be) = (&alpha as *const f32 as *const c_void, &beta as *const f32 as *const c_void);
        let x = 0x7f00_0000_0000usize as *mut c_void;
        let code = cublasLtMatmul(
            p.handle,
            p.desc,
            al,
            x,
            p.a,
            x,
            b2,
            be,
            x,
            p.c,
            x,
            p.c,
            &r.algo,
            null_mut(),
            0,
            null_mut(),
        );
        assert_refused(code, status::INVALID_VALUE, &["cublasLtMatmul", "for another problem"]);
    }
}

#[test]
fn matmul_in_place_with_different_c_and_d_layouts_is_refused() {
    let _g = serial();
    unsafe {
        let p = backend_plan(0, [256; 4]);
        let d2 = new_layout(dt::R_16BF, 64, 8, 128);
        let (alpha, beta) = (1f32, 1f32);
        let (al, be) = (&alpha as *const f32 as *const c_void, &beta as *const f32 as *const c_void);
        let x = 0x7f00_0000_0000usize as *mut c_void;
        let code = cublasLtMatmul(
            p.handle,
            p.desc,
            al,
            x,
            p.a,
            x,
            p.b,
            be,
            x,
            p.c,
            x,
            d2,
            std::ptr::null(),
            null_mut(),
            0,
            null_mut(),
        );
        assert_refused(code, status::INVALID_VALUE, &["C and D are the same memory", "layouts differ"]);
    }
}

#[test]
fn status_names_are_cublas_enumerators() {
    let name = |c| unsafe { CStr::from_ptr(cublasLtGetStatusName(c)) }.to_str().unwrap().to_owned();
    assert_eq!(name(status::SUCCESS), "CUBLAS_STATUS_SUCCESS");
    assert_eq!(name(status::NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
    assert_eq!(name(status::INVALID_VALUE), "CUBLAS_STATUS_INVALID_VALUE");
}
