//! AdamW and the global gradient norm on the device (kernels/adamw.cu,
//! kernels/norm.cu), twins of kernels/cpu/adamw.rs. Master weights, moments
//! and gradients are f32; the X copy the model computes with is written from
//! the updated master weights.

use super::device::{args, blocks, DeviceBuffer, Gpu};
use super::{ensure, Elem, Result};
use crate::kernels::cpu::adamw::AdamW;

/// Blocks of the norm's first pass per range: fixed, so the summation order is too.
pub const NORM_BLOCKS: usize = 1024;

/// The most elements one block of the AdamW launch updates: a run longer
/// than this is cut into several (each element's update is its own, so the
/// cut changes no bit).
pub const ADAMW_RUN: usize = 8192;

/// Where a part's tensors lie in its flat buffers, as one AdamW launch reads
/// it: each tensor's elements cut into runs of at most [`ADAMW_RUN`], with
/// whether it decays. Built and uploaded once per part (the layout never
/// changes), so a step uploads nothing.
pub struct AdamwRuns {
    /// Two words a run: its first element; its length | decay << 32.
    table: DeviceBuffer<u64>,
    runs: usize,
    /// One past the last element any run updates.
    end: usize,
}

impl AdamwRuns {
    /// `tensors`: (first element, elements, decays) of each tensor.
    pub fn new(gpu: &Gpu, tensors: &[(usize, usize, bool)]) -> Result<Self> {
        let mut words = Vec::new();
        for &(offset, n, decay) in tensors {
            for start in (0..n).step_by(ADAMW_RUN) {
                let len = ADAMW_RUN.min(n - start);
                words.extend([(offset + start) as u64, len as u64 | u64::from(decay) << 32]);
            }
        }
        let runs = words.len() / 2;
        ensure(runs <= i32::MAX as usize, || format!("adamw: {runs} runs are more blocks than a grid has"))?;
        let end = tensors.iter().map(|&(o, n, _)| o + n).max().unwrap_or(0);
        Ok(AdamwRuns { table: gpu.upload(&words)?, runs, end })
    }

    /// Blocks (kernel launches' runs) of the update.
    pub fn runs(&self) -> usize {
        self.runs
    }
}

/// One AdamW update of every run of `runs`, in one launch.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update<X: Elem>(
    gpu: &Gpu,
    master: &DeviceBuffer<f32>,
    param: &DeviceBuffer<X>,
    grad: &DeviceBuffer<f32>,
    m: &DeviceBuffer<f32>,
    v: &DeviceBuffer<f32>,
    runs: &AdamwRuns,
    hp: &AdamW,
    grad_scale: f32,
) -> Result<()> {
    let end = runs.end;
    ensure(
        master.len() >= end && param.len() >= end && grad.len() >= end && m.len() >= end && v.len() >= end,
        || format!("adamw_update: elements up to {end} out of range"),
    )?;
    ensure(hp.step >= 1, || "adamw_update: step counts from 1".into())?;
    if runs.runs == 0 {
        return Ok(());
    }
    // The scalars exactly as the CPU twin forms them (f64, rounded to f32).
    let decay_factor = (1.0 - hp.lr * hp.weight_decay) as f32;
    let one_minus_b1 = (1.0 - hp.beta1) as f32;
    let b2 = hp.beta2 as f32;
    let one_minus_b2 = (1.0 - hp.beta2) as f32;
    let bc1 = 1.0 - hp.beta1.powi(hp.step as i32);
    let bc2 = 1.0 - hp.beta2.powi(hp.step as i32);
    let step_size = (hp.lr / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let eps = hp.eps as f32;
    let f = gpu.function::<X>("adamw", "adamw_update")?;
    let (pm, pp, pg, pmm, pv, table) =
        (master.ptr(), param.ptr(), grad.ptr(), m.ptr(), v.ptr(), runs.table.ptr());
    gpu.launch(
        f,
        (runs.runs as u32, 1, 1),
        (256, 1, 1),
        &mut args![
            pm,
            pp,
            pg,
            pmm,
            pv,
            table,
            decay_factor,
            one_minus_b1,
            b2,
            one_minus_b2,
            step_size,
            bc2_sqrt,
            eps,
            grad_scale
        ],
    )
}

/// The ranges of a buffer whose sums of squares one pair of launches forms
/// (a part's tensors, for the gradient norm), with their scratch: built and
/// uploaded once, so a step allocates and uploads nothing.
pub struct NormRanges {
    /// Two words a range: its first element and its length.
    table: DeviceBuffer<u64>,
    /// NORM_BLOCKS partials per range.
    partial: DeviceBuffer<f32>,
    /// One sum per range.
    out: DeviceBuffer<f32>,
    count: usize,
    end: usize,
}

impl NormRanges {
    /// `ranges`: (first element, length) of each range.
    pub fn new(gpu: &Gpu, ranges: &[(usize, usize)]) -> Result<Self> {
        // blockIdx.y picks the range.
        ensure(ranges.len() <= 65_535, || {
            format!("sum of squares: {} ranges (at most 65535)", ranges.len())
        })?;
        let words: Vec<u64> = ranges.iter().flat_map(|&(o, n)| [o as u64, n as u64]).collect();
        Ok(NormRanges {
            table: gpu.upload(&words)?,
            partial: gpu.alloc(NORM_BLOCKS * ranges.len())?,
            out: gpu.alloc(ranges.len())?,
            count: ranges.len(),
            end: ranges.iter().map(|&(o, n)| o + n).max().unwrap_or(0),
        })
    }
}

/// Σ x² of each range of `r` into element k of the result, each summed in
/// the fixed order a range has alone (NORM_BLOCKS blocks of 256 threads,
/// then one block over their partials): two launches for all the ranges,
/// and one download.
pub fn sum_squares_ranges(gpu: &Gpu, x: &DeviceBuffer<f32>, r: &NormRanges) -> Result<Vec<f32>> {
    ensure(r.end <= x.len(), || {
        format!("sum_squares_ranges: ranges reach element {}, the buffer has {}", r.end, x.len())
    })?;
    if r.count == 0 {
        return Ok(Vec::new());
    }
    let first = gpu.function::<f32>("norm", "global_norm_partial")?;
    let finish = gpu.function::<f32>("norm", "global_norm_finish")?;
    let (p, xp, table, o, cnt) = (r.partial.ptr(), x.ptr(), r.table.ptr(), r.out.ptr(), NORM_BLOCKS as i32);
    let ranges = r.count as u32;
    gpu.launch(first, (NORM_BLOCKS as u32, ranges, 1), (256, 1, 1), &mut args![p, xp, table])?;
    gpu.launch(finish, (ranges, 1, 1), (1024, 1, 1), &mut args![o, p, cnt])?;
    gpu.download(&r.out)
}

/// out = a + b over `n` f32 elements at the given device addresses (out may be a).
pub fn add_f32(gpu: &Gpu, out: u64, a: u64, b: u64, n: usize) -> Result<()> {
    let f = gpu.function::<f32>("norm", "add_f32")?;
    let nl = n as i64;
    gpu.launch(f, (blocks(n, 256), 1, 1), (256, 1, 1), &mut args![out, a, b, nl])
}
