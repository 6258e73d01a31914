//! The NCCL stand-in's element arithmetic (types::reduce), per data type,
//! without ranks: the rank-order fold, rounding in the type, wrapping
//! integers, ncclAvg's two definitions, and the codes NCCL's enums refuse.

use pipewright_emu::nccl::types::{self, code, DataType, RedOp};

fn reduce(dtype: DataType, op: RedOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let views: Vec<&[u8]> = inputs.iter().map(|v| &v[..]).collect();
    let mut out = vec![0u8; inputs[0].len()];
    types::reduce(dtype, op, &views, &mut out);
    out
}

fn f16s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| half::f16::from_f32(*x).to_ne_bytes()).collect()
}

fn f64s(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

#[test]
fn f16_sums_round_to_f16_after_every_addition() {
    // 1 + 2^-11 is a tie in f16 (11 significant bits): rounds to even, 1.0, twice.
    let tiny = 2f32.powi(-11);
    let out = reduce(DataType::F16, RedOp::Sum, &[f16s(&[1.0]), f16s(&[tiny]), f16s(&[tiny])]);
    assert_eq!(half::f16::from_ne_bytes([out[0], out[1]]).to_f32(), 1.0);
}

#[test]
fn f64_sums_fold_in_rank_order() {
    let out = reduce(DataType::F64, RedOp::Sum, &[f64s(&[1e17]), f64s(&[1.0]), f64s(&[-1e17])]);
    // (1e17 + 1) rounds back to 1e17; another order would give 1.
    assert_eq!(f64::from_ne_bytes(out.try_into().unwrap()), 0.0);
}

#[test]
fn integer_sums_and_products_wrap_as_gpu_integers_do() {
    let out = reduce(DataType::U8, RedOp::Sum, &[vec![200, 3], vec![100, 4]]);
    assert_eq!(out, vec![44, 7]);
    let out = reduce(DataType::I8, RedOp::Prod, &[vec![16i8 as u8], vec![16]]);
    assert_eq!(out, vec![0]);
}

#[test]
fn integer_average_divides_the_sum_toward_zero() {
    let out = reduce(DataType::I8, RedOp::Avg, &[vec![(-4i8) as u8, 5], vec![(-3i8) as u8, 2]]);
    assert_eq!(out.iter().map(|&b| b as i8).collect::<Vec<_>>(), vec![-3, 3]);
}

#[test]
fn max_keeps_a_nan_only_from_rank_0() {
    let f = |x: f32| x.to_ne_bytes().to_vec();
    let first = reduce(DataType::F32, RedOp::Max, &[f(f32::NAN), f(1.0)]);
    assert!(f32::from_ne_bytes(first.try_into().unwrap()).is_nan());
    let later = reduce(DataType::F32, RedOp::Max, &[f(1.0), f(f32::NAN)]);
    assert_eq!(f32::from_ne_bytes(later.try_into().unwrap()), 1.0);
}

#[test]
fn fp8_and_unknown_types_and_ops_are_refused_naming_the_value() {
    let fp8 = DataType::from_raw(10, "ncclAllReduce").unwrap_err();
    assert_eq!(fp8.code, code::INVALID_ARGUMENT);
    assert!(fp8.message.contains("ncclAllReduce: datatype 10: the fp8 types"), "{}", fp8.message);
    assert!(DataType::from_raw(12, "x").unwrap_err().message.contains("not an ncclDataType_t"));
    let op = RedOp::from_raw(5, "ncclReduce").unwrap_err();
    assert!(op.message.contains("ncclReduce: reduction op 5"), "{}", op.message);
    assert_eq!(DataType::from_raw(9, "x").unwrap(), DataType::Bf16);
    assert_eq!(DataType::Bf16.size(), 2);
}
