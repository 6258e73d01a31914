//! NCCL's enums as nccl.h numbers them (ncclResult_t, ncclDataType_t,
//! ncclRedOp_t) and the element arithmetic of its reductions.
//!
//! Reductions fold the ranks' values in rank order, one element at a time:
//! `((x0 ∘ x1) ∘ x2) ∘ …`, starting from rank 0's value (not from an
//! identity such as +0.0, which would turn a sum of -0.0s into +0.0). Real
//! NCCL's order depends on its algorithm (ring, tree, NVLS) and topology, so
//! it is fixed for one machine and configuration but not this one; the
//! emulator picks the plainest fixed order so a sum of one value and n-1
//! -0.0 fills is that value exactly, as the backend relies on.
//!
//! NCCL accumulates in the data type: a bf16 or f16 sum rounds to the type
//! after every addition (its kernels add two values in f32 and convert
//! back), so that is done here too. ncclAvg is, as in NCCL, a pre-multiplied
//! sum for floating types (each value times 1/nranks, rounded to the type,
//! then summed) and a sum divided by nranks afterwards, truncating toward
//! zero, for integers. Integer sums and products wrap, as GPU integers do.
//! Max and min keep the first operand unless the second is strictly
//! greater (less), so a NaN only wins from rank 0.

use crate::error::{EmuError, Result};
use half::{bf16, f16};

/// ncclResult_t values.
pub mod code {
    pub const SUCCESS: u32 = 0;
    pub const UNHANDLED_CUDA_ERROR: u32 = 1;
    pub const SYSTEM_ERROR: u32 = 2;
    pub const INTERNAL_ERROR: u32 = 3;
    pub const INVALID_ARGUMENT: u32 = 4;
    pub const INVALID_USAGE: u32 = 5;
    pub const REMOTE_ERROR: u32 = 6;
    pub const IN_PROGRESS: u32 = 7;
}

/// NCCL's own one-line description of a result code (what ncclGetErrorString
/// returns when the emulator has no more specific message for the code).
pub fn describe(result: u32) -> &'static std::ffi::CStr {
    match result {
        code::SUCCESS => c"no error",
        code::UNHANDLED_CUDA_ERROR => c"unhandled cuda error",
        code::SYSTEM_ERROR => c"unhandled system error",
        code::INTERNAL_ERROR => c"internal error",
        code::INVALID_ARGUMENT => c"invalid argument",
        code::INVALID_USAGE => c"invalid usage",
        code::REMOTE_ERROR => c"remote process exited or there was a network error",
        code::IN_PROGRESS => c"NCCL operation in progress",
        _ => c"unknown result code",
    }
}

/// ncclDataType_t (NCCL 2.19+ numbering; the fp8 types are refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    I8 = 0,
    U8 = 1,
    I32 = 2,
    U32 = 3,
    I64 = 4,
    U64 = 5,
    F16 = 6,
    F32 = 7,
    F64 = 8,
    Bf16 = 9,
}

impl DataType {
    const ALL: [DataType; 10] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::Bf16,
    ];

    /// The type a C caller passed; `what` names the call in the error.
    pub fn from_raw(raw: i64, what: &str) -> Result<DataType> {
        if let Some(t) = DataType::ALL.iter().find(|t| **t as i64 == raw) {
            return Ok(*t);
        }
        let why = match raw {
            10 | 11 => "the fp8 types (ncclFloat8e4m3, ncclFloat8e5m2) are not emulated",
            _ => "not an ncclDataType_t (0..=9 are emulated)",
        };
        Err(EmuError::new(code::INVALID_ARGUMENT, format!("{what}: datatype {raw}: {why}")))
    }

    pub fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DataType::I8 => "int8",
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
            DataType::F16 => "float16",
            DataType::F32 => "float32",
            DataType::F64 => "float64",
            DataType::Bf16 => "bfloat16",
        }
    }
}

/// ncclRedOp_t's built-in operations (user-defined ones, from
/// ncclRedOpCreatePreMulSum, are not emulated).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RedOp {
    Sum = 0,
    Prod = 1,
    Max = 2,
    Min = 3,
    Avg = 4,
}

impl RedOp {
    const ALL: [RedOp; 5] = [RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min, RedOp::Avg];

    pub fn from_raw(raw: i64, what: &str) -> Result<RedOp> {
        RedOp::ALL.iter().find(|o| **o as i64 == raw).copied().ok_or_else(|| {
            EmuError::new(
                code::INVALID_ARGUMENT,
                format!(
                    "{what}: reduction op {raw}: only the built-in ncclSum (0), ncclProd, ncclMax, ncclMin and \
                     ncclAvg (4) are emulated"
                ),
            )
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Prod => "prod",
            RedOp::Max => "max",
            RedOp::Min => "min",
            RedOp::Avg => "avg",
        }
    }
}

/// One element type's arithmetic, as NCCL's kernels do it for that type.
trait Elem: Copy {
    const SIZE: usize;
    fn load(b: &[u8]) -> Self;
    fn store(self, b: &mut [u8]);
    fn sum(self, o: Self) -> Self;
    fn prod(self, o: Self) -> Self;
    fn greater(self, o: Self) -> bool;
    fn less(self, o: Self) -> bool;
    /// ncclAvg's step before the sum (floats: times 1/n in the type).
    fn avg_pre(self, n: usize) -> Self;
    /// ncclAvg's step after the sum (integers: divided by n, toward zero).
    fn avg_post(self, n: usize) -> Self;
}

macro_rules! int_elem {
    ($t:ty) => {
        impl Elem for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn load(b: &[u8]) -> Self {
                <$t>::from_ne_bytes(b.try_into().expect("chunks of the element size"))
            }
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_ne_bytes())
            }
            fn sum(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            fn prod(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            fn greater(self, o: Self) -> bool {
                self > o
            }
            fn less(self, o: Self) -> bool {
                self < o
            }
            fn avg_pre(self, _: usize) -> Self {
                self
            }
            fn avg_post(self, n: usize) -> Self {
                // Rust's integer division truncates toward zero, as NCCL's does.
                self.wrapping_div(n as $t)
            }
        }
    };
}

int_elem!(i8);
int_elem!(u8);
int_elem!(i32);
int_elem!(u32);
int_elem!(i64);
int_elem!(u64);

macro_rules! float_elem {
    ($t:ty) => {
        impl Elem for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn load(b: &[u8]) -> Self {
                <$t>::from_ne_bytes(b.try_into().expect("chunks of the element size"))
            }
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_ne_bytes())
            }
            fn sum(self, o: Self) -> Self {
                self + o
            }
            fn prod(self, o: Self) -> Self {
                self * o
            }
            fn greater(self, o: Self) -> bool {
                self > o
            }
            fn less(self, o: Self) -> bool {
                self < o
            }
            fn avg_pre(self, n: usize) -> Self {
                self * (1.0 / n as $t)
            }
            fn avg_post(self, _: usize) -> Self {
                self
            }
        }
    };
}

float_elem!(f32);
float_elem!(f64);

/// bf16 and f16: each operation in f32, rounded to the type (round to
/// nearest even) once per operation, as NCCL's half-precision kernels do.
macro_rules! half_elem {
    ($t:ty) => {
        impl Elem for $t {
            const SIZE: usize = 2;
            fn load(b: &[u8]) -> Self {
                <$t>::from_ne_bytes(b.try_into().expect("chunks of the element size"))
            }
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_ne_bytes())
            }
            fn sum(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() + o.to_f32())
            }
            fn prod(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() * o.to_f32())
            }
            fn greater(self, o: Self) -> bool {
                self.to_f32() > o.to_f32()
            }
            fn less(self, o: Self) -> bool {
                self.to_f32() < o.to_f32()
            }
            fn avg_pre(self, n: usize) -> Self {
                let scale = <$t>::from_f32(1.0 / n as f32);
                <$t>::from_f32(self.to_f32() * scale.to_f32())
            }
            fn avg_post(self, _: usize) -> Self {
                self
            }
        }
    };
}

half_elem!(bf16);
half_elem!(f16);

fn reduce_typed<T: Elem>(op: RedOp, inputs: &[&[u8]], out: &mut [u8]) {
    let n = inputs.len();
    let pre = |x: T| if op == RedOp::Avg { x.avg_pre(n) } else { x };
    let mut acc: Vec<T> = inputs[0].chunks_exact(T::SIZE).map(|b| pre(T::load(b))).collect();
    for input in &inputs[1..] {
        for (a, b) in acc.iter_mut().zip(input.chunks_exact(T::SIZE)) {
            let x = pre(T::load(b));
            *a = match op {
                RedOp::Sum | RedOp::Avg => a.sum(x),
                RedOp::Prod => a.prod(x),
                RedOp::Max => {
                    if x.greater(*a) {
                        x
                    } else {
                        *a
                    }
                }
                RedOp::Min => {
                    if x.less(*a) {
                        x
                    } else {
                        *a
                    }
                }
            };
        }
    }
    for (a, b) in acc.into_iter().zip(out.chunks_exact_mut(T::SIZE)) {
        let v = if op == RedOp::Avg { a.avg_post(n) } else { a };
        v.store(b);
    }
}

/// out = the ranks' `inputs` (in rank order, each as long as `out`) reduced
/// with `op`, element by element.
pub fn reduce(dtype: DataType, op: RedOp, inputs: &[&[u8]], out: &mut [u8]) {
    debug_assert!(!inputs.is_empty() && inputs.iter().all(|i| i.len() == out.len()));
    match dtype {
        DataType::I8 => reduce_typed::<i8>(op, inputs, out),
        DataType::U8 => reduce_typed::<u8>(op, inputs, out),
        DataType::I32 => reduce_typed::<i32>(op, inputs, out),
        DataType::U32 => reduce_typed::<u32>(op, inputs, out),
        DataType::I64 => reduce_typed::<i64>(op, inputs, out),
        DataType::U64 => reduce_typed::<u64>(op, inputs, out),
        DataType::F16 => reduce_typed::<f16>(op, inputs, out),
        DataType::F32 => reduce_typed::<f32>(op, inputs, out),
        DataType::F64 => reduce_typed::<f64>(op, inputs, out),
        DataType::Bf16 => reduce_typed::<bf16>(op, inputs, out),
    }
}
