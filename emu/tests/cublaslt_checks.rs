//! Each strict check of the emulated cuBLASLt, planted: the status AND a
//! message naming the culprit. Pointer checks run against stand-in
//! allocations (the same contract as memory::check_range), so they need no
//! driver.

use pipewright_emu::cublaslt::launch::{self, Algo, Operands, DEFAULT_ALIGNMENT};
use pipewright_emu::cublaslt::problem::{
    compute_type as ct, data_type as dt, status, LayoutSpec, OpSpec, Problem,
};
use pipewright_emu::error::{cu, EmuError, Result};
use pipewright_emu::memory::Allocation;

fn op(trans_a: bool, trans_b: bool, bias_type: Option<i32>) -> OpSpec {
    OpSpec { compute_type: ct::C32F, scale_type: dt::R_32F, trans_a, trans_b, bias_type }
}

fn lay(data_type: u32, rows: u64, cols: u64, ld: i64) -> LayoutSpec {
    LayoutSpec { data_type, rows, cols, ld }
}

fn refused(r: Result<Problem>) -> EmuError {
    r.expect_err("the problem must be refused")
}

fn assert_names(e: &EmuError, code: u32, parts: &[&str]) {
    assert_eq!(e.code, code, "status of: {}", e.message);
    for part in parts {
        assert!(e.message.contains(part), "{:?} does not name {part:?}", e.message);
    }
}

/// The backend's forward product for bf16: A = weight (OC×IC col-major), B = inp.
fn forward_bf16() -> Problem {
    let (a, b, c) = (lay(dt::R_16BF, 64, 32, 64), lay(dt::R_16BF, 32, 8, 32), lay(dt::R_16BF, 64, 8, 64));
    Problem::new("cublasLtMatmul", &op(false, false, Some(dt::R_16BF as i32)), [&a, &b, &c, &c]).unwrap()
}

#[test]
fn mixed_a_and_b_types_are_outside_the_table() {
    let (a, b, c) = (lay(dt::R_16BF, 4, 4, 4), lay(dt::R_32F, 4, 4, 4), lay(dt::R_32F, 4, 4, 4));
    let e = refused(Problem::new("cublasLtMatmul", &op(false, false, None), [&a, &b, &c, &c]));
    assert_names(&e, status::NOT_SUPPORTED, &["cublasLtMatmul", "Atype CUDA_R_16BF", "Btype CUDA_R_32F"]);
}

#[test]
fn f32_inputs_with_a_bf16_output_are_outside_the_table() {
    let (a, c) = (lay(dt::R_32F, 4, 4, 4), lay(dt::R_16BF, 4, 4, 4));
    let e = refused(Problem::new("cublasLtMatmul", &op(false, false, None), [&a, &a, &c, &c]));
    assert_names(&e, status::NOT_SUPPORTED, &["Ctype CUDA_R_16BF", "not a combination cuBLASLt supports"]);
}

#[test]
fn a_bf16_scale_type_with_32f_compute_is_outside_the_table() {
    let a = lay(dt::R_16BF, 4, 4, 4);
    let spec = OpSpec { scale_type: dt::R_16BF, ..op(false, false, None) };
    let e = refused(Problem::new("cublasLtMatmul", &spec, [&a, &a, &a, &a]));
    assert_names(&e, status::NOT_SUPPORTED, &["scaleType CUDA_R_16BF", "not a combination"]);
}

#[test]
fn documented_rows_the_emulator_does_not_run_say_so() {
    let h = lay(dt::R_16F, 4, 4, 4);
    let spec = OpSpec { compute_type: ct::C16F, scale_type: dt::R_16F, ..op(false, false, None) };
    let e = refused(Problem::new("cublasLtMatmul", &spec, [&h, &h, &h, &h]));
    assert_names(&e, status::NOT_SUPPORTED, &["CUBLAS_COMPUTE_16F", "does not implement"]);
}

#[test]
fn a_leading_dimension_below_the_rows_is_refused_naming_the_matrix() {
    let (a, b, c) = (lay(dt::R_16BF, 64, 32, 48), lay(dt::R_16BF, 32, 8, 32), lay(dt::R_32F, 64, 8, 64));
    let e = refused(Problem::new("cublasLtMatmul", &op(false, false, None), [&a, &b, &c, &c]));
    assert_names(&e, status::INVALID_VALUE, &["A's leading dimension 48 is below its 64 rows"]);
    let d = lay(dt::R_32F, 64, 8, 63);
    let a = lay(dt::R_16BF, 64, 32, 64);
    let e = refused(Problem::new("cublasLtMatmul", &op(false, false, None), [&a, &b, &c, &d]));
    assert_names(&e, status::INVALID_VALUE, &["D's leading dimension 63 is below its 64 rows"]);
}

#[test]
fn the_leading_dimension_is_checked_against_the_stored_not_the_transposed_rows() {
    // Aᵀ is 64×32 but A is stored 32×64: ld 32 is enough.
    let (a, b, c) = (lay(dt::R_16BF, 32, 64, 32), lay(dt::R_16BF, 32, 8, 32), lay(dt::R_32F, 64, 8, 64));
    Problem::new("cublasLtMatmul", &op(true, false, None), [&a, &b, &c, &c]).unwrap();
    let a = lay(dt::R_16BF, 32, 64, 31);
    let e = refused(Problem::new("cublasLtMatmul", &op(true, false, None), [&a, &b, &c, &c]));
    assert_names(&e, status::INVALID_VALUE, &["A's leading dimension 31 is below its 32 rows"]);
}

#[test]
fn disagreeing_k_is_refused_with_both_shapes() {
    let (a, b, c) = (lay(dt::R_32F, 8, 5, 8), lay(dt::R_32F, 6, 3, 6), lay(dt::R_32F, 8, 3, 8));
    let e = refused(Problem::new("cublasLtMatmul", &op(false, false, None), [&a, &b, &c, &c]));
    assert_names(&e, status::INVALID_VALUE, &["N(A 8×5) is 8×5", "N(B 6×3) is 6×3", "k differ"]);
    let e = refused(Problem::new("cublasLtMatmul", &op(true, false, None), [&a, &b, &c, &c]));
    assert_names(&e, status::INVALID_VALUE, &["T(A 8×5) is 5×8"]);
}

#[test]
fn c_or_d_of_the_wrong_shape_is_refused_naming_it() {
    let (a, b) = (lay(dt::R_32F, 8, 5, 8), lay(dt::R_32F, 5, 3, 5));
    let (good, bad) = (lay(dt::R_32F, 8, 3, 8), lay(dt::R_32F, 3, 8, 8));
    let e = refused(Problem::new("cublasLtMatmul", &op(false, false, None), [&a, &b, &bad, &good]));
    assert_names(&e, status::INVALID_VALUE, &["C is 3×8 but op(A)·op(B) is 8×3"]);
    let e = refused(Problem::new("cublasLtMatmul", &op(false, false, None), [&a, &b, &good, &bad]));
    assert_names(&e, status::INVALID_VALUE, &["D is 3×8"]);
}

#[test]
fn a_bias_of_another_type_than_d_is_refused() {
    let (a, c) = (lay(dt::R_16BF, 4, 4, 4), lay(dt::R_32F, 4, 4, 4));
    let e =
        refused(Problem::new("cublasLtMatmul", &op(false, false, Some(dt::R_16BF as i32)), [&a, &a, &c, &c]));
    assert_names(&e, status::NOT_SUPPORTED, &["bias type CUDA_R_16BF differs from D's type CUDA_R_32F"]);
    // The default (-1) is D's type.
    Problem::new("cublasLtMatmul", &op(false, false, Some(-1)), [&a, &a, &c, &c]).unwrap();
}

/// memory::check_range's signature.
type RangeCheck = Box<dyn Fn(u64, u64, usize, &str) -> Result<Allocation>>;

/// Stand-in allocations with memory::check_range's contract.
fn arena(allocs: Vec<Allocation>) -> RangeCheck {
    Box::new(move |ptr, bytes, device, what| {
        let a = allocs.iter().find(|a| ptr >= a.base && ptr < a.base + a.size).ok_or_else(|| {
            EmuError::new(cu::ILLEGAL_ADDRESS, format!("{what}: {ptr:#x} is in no allocation"))
        })?;
        if a.device != device || ptr + bytes > a.base + a.size {
            return Err(EmuError::new(cu::ILLEGAL_ADDRESS, format!("{what}: {ptr:#x}+{bytes} is outside")));
        }
        Ok(*a)
    })
}

const BASE: u64 = 0x7f00_0000_0000;

/// One 1 MiB allocation on device 0 and the forward problem's operands in it.
fn setup() -> (Problem, Algo, Operands, RangeCheck) {
    let p = forward_bf16();
    let algo = launch::choose("cublasLtMatmulAlgoGetHeuristic", &p, 1 << 20, [DEFAULT_ALIGNMENT; 4]).unwrap();
    let ops = Operands {
        a: BASE,
        b: BASE + 0x1_0000,
        c: BASE + 0x2_0000,
        d: BASE + 0x2_0000,
        bias: BASE + 0x3_0000,
        workspace: BASE + 0x4_0000,
        workspace_bytes: algo.workspace,
    };
    (p, algo, ops, arena(vec![Allocation { base: BASE, size: 1 << 20, device: 0 }]))
}

#[test]
fn operands_inside_a_live_allocation_of_the_device_pass() {
    let (p, algo, ops, range) = setup();
    launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 1.0, 0, &range).unwrap();
}

#[test]
fn a_pointer_aligned_below_the_promise_is_refused() {
    let (p, algo, ops, range) = setup();
    let ops = Operands { b: BASE + 0x1_0000 + 128, ..ops };
    let e = launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 1.0, 0, &range).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["B = 0x7f0000010080 is aligned to 128 bytes", "256-byte"]);
    // Promised 128 for B, the same pointer passes.
    let algo = launch::choose("h", &p, 1 << 20, [256, 128, 256, 256]).unwrap();
    launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 1.0, 0, &range).unwrap();
}

#[test]
fn a_bias_not_aligned_to_its_element_is_refused() {
    let (p, algo, ops, range) = setup();
    let ops = Operands { bias: BASE + 0x3_0001, ..ops };
    let e = launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 1.0, 0, &range).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["bias = 0x7f0000030001 is aligned to 1 bytes"]);
}

#[test]
fn an_operand_whose_layout_runs_past_its_allocation_is_refused_with_its_extent() {
    let (p, algo, ops, range) = setup();
    // A spans (32 − 1)·64 + 64 = 2048 bf16 = 4096 bytes; start it 2048 bytes before the end.
    let ops = Operands { a: BASE + (1 << 20) - 2048, ..ops };
    let e = launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 1.0, 0, &range).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["cublasLtMatmul: A (4096 bytes)"]);
}

#[test]
fn an_operand_of_another_device_is_refused() {
    let (p, algo, ops, _) = setup();
    let range = arena(vec![
        Allocation { base: BASE, size: 1 << 20, device: 0 },
        Allocation { base: BASE << 1, size: 1 << 20, device: 1 },
    ]);
    let ops = Operands { d: BASE << 1, c: BASE << 1, ..ops };
    let e = launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 1.0, 0, &range).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["cublasLtMatmul: C"]);
}

#[test]
fn c_is_not_checked_when_beta_is_zero_but_d_is() {
    let (p, algo, ops, range) = setup();
    let ops = Operands { c: 0, ..ops };
    launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 0.0, 0, &range).unwrap();
    let e = launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 0.5, 0, &range).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["C is a null pointer"]);
    let ops = Operands { d: 0, ..ops };
    let e = launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 0.0, 0, &range).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["D is a null pointer"]);
}

#[test]
fn a_workspace_smaller_than_the_algorithm_asked_for_is_refused() {
    let (p, algo, ops, range) = setup();
    assert_eq!(algo.workspace, 64 * 8 * 4, "D's f32 partial sums");
    let small = Operands { workspace_bytes: algo.workspace - 1, ..ops };
    let e = launch::check_operands("cublasLtMatmul", &p, &algo, &small, 1.0, 0, &range).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["workspace of 2047 bytes", "needs 2048"]);
    let null = Operands { workspace: 0, ..ops };
    let e = launch::check_operands("cublasLtMatmul", &p, &algo, &null, 1.0, 0, &range).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["null workspace", "2048 bytes"]);
}

#[test]
fn the_workspace_asked_for_never_exceeds_the_preferences_maximum() {
    let p = forward_bf16();
    assert_eq!(launch::choose("h", &p, 0, [256; 4]).unwrap().workspace, 0);
    assert_eq!(launch::choose("h", &p, 100, [256; 4]).unwrap().workspace, 100);
    assert_eq!(launch::choose("h", &p, 32 << 20, [256; 4]).unwrap().workspace, 2048);
}

#[test]
fn the_heuristic_refuses_an_alignment_promise_below_the_element_size() {
    let p = forward_bf16();
    let e = launch::choose("cublasLtMatmulAlgoGetHeuristic", &p, 0, [256, 1, 256, 256]).unwrap_err();
    assert_names(&e, status::NOT_SUPPORTED, &["no algorithm for B aligned to only 1 bytes"]);
}

#[test]
fn an_algo_chosen_for_another_problem_is_refused() {
    let p = forward_bf16();
    let algo = launch::choose("h", &p, 0, [256; 4]).unwrap().encode();
    assert_eq!(Algo::decode("cublasLtMatmul", &algo, &p).unwrap().workspace, 0);
    let (a, b, c) = (lay(dt::R_16BF, 64, 32, 64), lay(dt::R_16BF, 32, 8, 40), lay(dt::R_16BF, 64, 8, 64));
    let other = Problem::new("m", &op(false, false, Some(-1)), [&a, &b, &c, &c]).unwrap();
    let e = Algo::decode("cublasLtMatmul", &algo, &other).unwrap_err();
    assert_names(
        &e,
        status::INVALID_VALUE,
        &["chosen by the heuristic for another problem", "m=64 n=8 k=32"],
    );
    let e = Algo::decode("cublasLtMatmul", &[0; 8], &p).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["did not come from cublasLtMatmulAlgoGetHeuristic"]);
}

/// D (32×8, ld 64) at `d`, A (32×8, ld 64) at `a`, B separate: the row
/// blocks of one wide bf16 matrix when a and d are 64 bytes apart.
fn check_blocks(a: u64, d: u64) -> Result<()> {
    let (wide, b) = (lay(dt::R_16BF, 32, 8, 64), lay(dt::R_16BF, 8, 8, 8));
    let p = Problem::new("cublasLtMatmul", &op(false, false, None), [&wide, &b, &wide, &wide]).unwrap();
    let algo = launch::choose("h", &p, 0, [2, 256, 2, 2]).unwrap();
    let ops = Operands { a, b: BASE + 0x1_0000, c: d, d, bias: 0, workspace: 0, workspace_bytes: 0 };
    let range = arena(vec![Allocation { base: BASE, size: 1 << 20, device: 0 }]);
    launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 1.0, 0, &range)
}

#[test]
fn d_interleaved_with_a_but_sharing_no_element_passes() {
    // Rows 0..32 and 32..64 of the same columns: extents overlap, elements do not.
    check_blocks(BASE + 64, BASE).unwrap();
    check_blocks(BASE, BASE + 64).unwrap();
}

#[test]
fn d_sharing_elements_with_a_is_refused_naming_the_first_shared_address() {
    // Rows 16..48 of A's columns are rows 0..32 of D's: they share rows 16..32.
    let e = check_blocks(BASE + 32, BASE).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["D overlaps A", "0x7f0000000020"]);
    let e = check_blocks(BASE, BASE + 62).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["D overlaps A", "0x7f000000003e"]);
}

#[test]
fn c_equal_to_d_with_one_layout_is_in_place_not_an_overlap() {
    // check_blocks passes C = D with the same layout: beta 1 reads C in place.
    check_blocks(BASE + 64, BASE).unwrap();
    let (wide, b) = (lay(dt::R_16BF, 32, 8, 64), lay(dt::R_16BF, 8, 8, 8));
    let p = Problem::new("cublasLtMatmul", &op(false, false, None), [&wide, &b, &wide, &wide]).unwrap();
    let algo = launch::choose("h", &p, 0, [2, 256, 2, 2]).unwrap();
    // C one row below D: every column shares 31 elements.
    let ops = Operands {
        a: BASE + 0x2_0000,
        b: BASE + 0x1_0000,
        c: BASE + 2,
        d: BASE,
        bias: 0,
        workspace: 0,
        workspace_bytes: 0,
    };
    let range = arena(vec![Allocation { base: BASE, size: 1 << 20, device: 0 }]);
    let e = launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 1.0, 0, &range).unwrap_err();
    assert_names(&e, status::INVALID_VALUE, &["D overlaps C"]);
    // With beta 0, C is not read: nothing to race with.
    launch::check_operands("cublasLtMatmul", &p, &algo, &ops, 0.0, 0, &range).unwrap();
}
