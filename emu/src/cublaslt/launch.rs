//! What the emulated heuristic hands out and what cublasLtMatmul checks
//! before it queues a product: the algorithm (a fingerprint of the problem
//! it was chosen for, its workspace and the alignments it was promised),
//! and the operand pointers (inside live allocations of the stream's
//! device, aligned as promised, the workspace large enough).
//!
//! The emulator has one "algorithm": the f32 product of `problem::compute`.
//! Like a split-K kernel it asks for a workspace (the f32 partial sums of D,
//! m·n·4 bytes, or as much of that as the preference allows), so a caller
//! that passes none or less than the heuristic said is caught here, as it
//! would be on hardware when the heuristic picks such a kernel. It does
//! not write the workspace.

use super::problem::{status, Epilogue, Matrix, Problem};
use crate::error::{EmuError, Result};
use crate::memory::Allocation;
use std::hash::{Hash, Hasher};

/// cuBLASLt's default for every CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES:
/// the heuristic assumes 256-byte aligned A, B, C and D unless told less.
pub const DEFAULT_ALIGNMENT: u32 = 256;

/// Marks an algorithm the emulated heuristic made ("pwemuLt1").
const MAGIC: u64 = u64::from_le_bytes(*b"pwemuLt1");

/// What the heuristic promised for a product, carried in the 64 opaque
/// bytes of cublasLtMatmulAlgo_t.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Algo {
    /// `fingerprint` of the problem the heuristic ran for.
    pub problem: u64,
    pub workspace: u64,
    /// Alignment in bytes each of A, B, C, D may have (at least).
    pub align: [u32; 4],
}

/// A problem's identity for matching an algorithm to a later matmul:
/// everything but the pointers.
pub fn fingerprint(p: &Problem) -> u64 {
    // `DefaultHasher::new` always starts from the same keys: the same
    // problem gives the same value on every call.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    p.hash(&mut h);
    h.finish()
}

/// The workspace the emulated algorithm asks for under a preference's
/// maximum: D's f32 partial sums, capped at the maximum.
pub fn workspace_for(p: &Problem, max_workspace: u64) -> u64 {
    ((p.m as u64) * (p.n as u64) * 4).min(max_workspace)
}

/// The heuristic's answer for `p` under the preference's maximum workspace
/// and alignment promises; refuses promises no algorithm could honour.
pub fn choose(call: &str, p: &Problem, max_workspace: u64, align: [u32; 4]) -> Result<Algo> {
    for (name, x, promise) in
        [("A", &p.a, align[0]), ("B", &p.b, align[1]), ("C", &p.c, align[2]), ("D", &p.d, align[3])]
    {
        if (promise as usize) < x.elem.bytes() {
            return Err(EmuError::new(
                status::NOT_SUPPORTED,
                format!(
                    "{call}: no algorithm for {name} aligned to only {promise} bytes (its elements take {})",
                    x.elem.bytes()
                ),
            ));
        }
    }
    Ok(Algo { problem: fingerprint(p), workspace: workspace_for(p, max_workspace), align })
}

impl Algo {
    pub fn encode(&self) -> [u64; 8] {
        let a = self.align;
        [
            MAGIC,
            self.problem,
            self.workspace,
            u64::from(a[0]) | (u64::from(a[1]) << 32),
            u64::from(a[2]) | (u64::from(a[3]) << 32),
            0,
            0,
            0,
        ]
    }

    /// The algorithm in `data`, if the emulated heuristic made it for `p`.
    pub fn decode(call: &str, data: &[u64; 8], p: &Problem) -> Result<Algo> {
        if data[0] != MAGIC || data[5..] != [0, 0, 0] {
            return Err(EmuError::new(
                status::INVALID_VALUE,
                format!("{call}: the algo did not come from cublasLtMatmulAlgoGetHeuristic"),
            ));
        }
        let algo = Algo {
            problem: data[1],
            workspace: data[2],
            align: [data[3] as u32, (data[3] >> 32) as u32, data[4] as u32, (data[4] >> 32) as u32],
        };
        if algo.problem != fingerprint(p) {
            return Err(EmuError::new(
                status::INVALID_VALUE,
                format!(
                    "{call}: the algo was chosen by the heuristic for another problem (types, shapes, \
                     transposes, leading dimensions or epilogue differ from m={} n={} k={} {}{})",
                    p.m,
                    p.n,
                    p.k,
                    if p.trans_a { "T" } else { "N" },
                    if p.trans_b { "T" } else { "N" },
                ),
            ));
        }
        Ok(algo)
    }
}

/// The device addresses one cublasLtMatmul reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operands {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
    pub bias: u64,
    pub workspace: u64,
    pub workspace_bytes: u64,
}

/// Checks `ops` for `p` run with `algo` on `device`: every pointer the
/// product touches lies, with the exact extent its layout spans, in one live
/// allocation of `device` (`check_range`, memory::check_range in the
/// emulator, a stand-in in tests), is aligned as the heuristic was promised
/// and to its element size, and the workspace is what the algorithm asked
/// for. C is checked only when beta is nonzero (otherwise it is not read).
pub fn check_operands(
    call: &str,
    p: &Problem,
    algo: &Algo,
    ops: &Operands,
    beta: f32,
    device: usize,
    check_range: &dyn Fn(u64, u64, usize, &str) -> Result<Allocation>,
) -> Result<()> {
    let mut operands = vec![("A", ops.a, p.a.extent_bytes(), algo.align[0], p.a.elem.bytes())];
    operands.push(("B", ops.b, p.b.extent_bytes(), algo.align[1], p.b.elem.bytes()));
    if beta != 0.0 {
        operands.push(("C", ops.c, p.c.extent_bytes(), algo.align[2], p.c.elem.bytes()));
    }
    operands.push(("D", ops.d, p.d.extent_bytes(), algo.align[3], p.d.elem.bytes()));
    if let Epilogue::Bias(e) = p.epilogue {
        operands.push(("bias", ops.bias, p.bias_bytes(), e.bytes() as u32, e.bytes()));
    }
    for (name, ptr, bytes, promise, elem) in operands {
        if bytes == 0 {
            continue;
        }
        if ptr == 0 {
            return Err(EmuError::new(status::INVALID_VALUE, format!("{call}: {name} is a null pointer")));
        }
        let promise = (promise as u64).max(elem as u64);
        if ptr % promise != 0 {
            return Err(EmuError::new(
                status::INVALID_VALUE,
                format!(
                    "{call}: {name} = {ptr:#x} is aligned to {} bytes but the algorithm was chosen for \
                     {promise}-byte alignment (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES, default 256)",
                    1u64 << ptr.trailing_zeros().min(63)
                ),
            ));
        }
        check_range(ptr, bytes as u64, device, &format!("{call}: {name} ({bytes} bytes)"))
            .map_err(|e| EmuError::new(status::INVALID_VALUE, e.message))?;
    }
    // On a GPU, D written while A, B or C are still being read gives
    // whatever the thread blocks' timing makes of it; the emulator copies
    // its operands first and would hide that, so any shared element is an
    // error (C = D in place with one layout is the documented exception).
    let mut inputs = vec![("A", ops.a, &p.a), ("B", ops.b, &p.b)];
    if beta != 0.0 && !(ops.c == ops.d && p.c == p.d) {
        inputs.push(("C", ops.c, &p.c));
    }
    for (name, ptr, x) in inputs {
        if let Some(at) = shared_element(ops.d, &p.d, ptr, x) {
            return Err(EmuError::new(
                status::INVALID_VALUE,
                format!("{call}: D overlaps {name}: both hold the bytes at {at:#x}, so D is written while {name} is read"),
            ));
        }
    }
    if ops.workspace_bytes < algo.workspace {
        return Err(EmuError::new(
            status::INVALID_VALUE,
            format!(
                "{call}: workspace of {} bytes but the heuristic's algorithm needs {}",
                ops.workspace_bytes, algo.workspace
            ),
        ));
    }
    if algo.workspace > 0 {
        if ops.workspace == 0 {
            return Err(EmuError::new(
                status::INVALID_VALUE,
                format!(
                    "{call}: null workspace but the heuristic's algorithm needs {} bytes",
                    algo.workspace
                ),
            ));
        }
        check_range(ops.workspace, ops.workspace_bytes, device, &format!("{call}: workspace"))
            .map_err(|e| EmuError::new(status::INVALID_VALUE, e.message))?;
    }
    Ok(())
}

/// An address that both matrices' elements cover (x at `xp`, y at `yp`),
/// if any. Columns of one matrix never overlap each other (ld ≥ rows), so
/// for each column of x only the first column of y ending after its start
/// can meet it.
pub fn shared_element(xp: u64, x: &Matrix, yp: u64, y: &Matrix) -> Option<u64> {
    if x.extent() == 0 || y.extent() == 0 {
        return None;
    }
    let (x_end, y_end) = (xp as i128 + x.extent_bytes() as i128, yp as i128 + y.extent_bytes() as i128);
    if x_end <= yp as i128 || y_end <= xp as i128 {
        return None;
    }
    let (x_stride, y_stride) = ((x.ld * x.elem.bytes()) as i128, (y.ld * y.elem.bytes()) as i128);
    let (x_len, y_len) = ((x.rows * x.elem.bytes()) as i128, (y.rows * y.elem.bytes()) as i128);
    for j in 0..x.cols as i128 {
        let (start, end) = (xp as i128 + j * x_stride, xp as i128 + j * x_stride + x_len);
        // The first column of y whose end lies past `start`.
        let first = (start - yp as i128 - y_len).div_euclid(y_stride) + 1;
        let first = first.max(0);
        if first >= y.cols as i128 {
            continue;
        }
        let (y_start, y_stop) = (yp as i128 + first * y_stride, yp as i128 + first * y_stride + y_len);
        if y_start < end && y_stop > start {
            return Some(start.max(y_start) as u64);
        }
    }
    None
}
