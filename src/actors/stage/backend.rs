//! Builds what a rank computes with, from the config's backend: its chunks
//! (initial, `--init` or resumed tensors) with their optimizer state on CPU
//! cores or a GPU, or the simulated backend.

use super::super::compute::{CpuCompute, StageCompute};
use super::faults::Faults;
use super::sim::SimCompute;
use super::StageArgs;
use crate::config::BackendKind;
use crate::model::tp::TpShape;
use crate::model::ModelPart;
use crate::optim::ema::EmaState;
use crate::optim::AdamState;

/// The rank's compute, or why it could not start.
pub fn build(args: &StageArgs, faults: &Faults) -> Result<Box<dyn StageCompute>, String> {
    let name = super::super::protocol::stage_name(args.rank, args.replica);
    if faults.fails_to_start(&name) {
        return Err("injected fault (PIPEWRIGHT_FAULT_START)".into());
    }
    let cfg = &args.cfg;
    if cfg.backend.kind == BackendKind::Sim {
        pin_here(&args.cores);
        let stages = args.layout.stages_of(args.rank);
        let last = args.layout.last_stage();
        return Ok(Box::new(SimCompute::new(cfg, stages, last, args.rank, args.replica)));
    }
    let gpt = cfg.arch();
    let mut chunks = Vec::new();
    for s in args.layout.stages_of(args.rank) {
        let spec = args.layout.stages[s].clone();
        let mut params = crate::model::part::part_params(&gpt, &spec, cfg.train.seed);
        if let Some(w) = &args.init {
            w.assign_params(&mut params).map_err(|e| e.to_string())?;
        }
        if let Some(c) = &args.resume {
            c.weights.assign_params(&mut params).map_err(|e| e.to_string())?;
        }
        chunks.push((spec, params));
    }
    if cfg.backend.kind == BackendKind::Cuda {
        return build_gpu(args, chunks);
    }
    build_cpu(args, chunks, faults.nondeterministic(&name))
}

/// The compute thread itself is the pool's first worker, so a rank with one
/// thread runs its kernels where it stands, with no hand-off.
fn pin_here(cores: &[core_affinity::CoreId]) {
    if let Some(&core) = cores.first() {
        core_affinity::set_for_current(core);
    }
}

/// The elements of each tensor whose optimizer state this replica keeps.
fn zero_shard(args: &StageArgs) -> crate::optim::zero::Shard {
    match args.cfg.parallel.zero {
        0 => crate::optim::zero::Shard::WHOLE,
        _ => crate::optim::zero::Shard { replica: args.replica, dp: args.layout.dp },
    }
}

fn build_cpu(
    args: &StageArgs,
    chunks: Vec<(crate::model::PartSpec, Vec<crate::model::Param>)>,
    nondet: bool,
) -> Result<Box<dyn StageCompute>, String> {
    let cfg = &args.cfg;
    let gpt = cfg.arch();
    let b = cfg.train.micro_batch_size;
    let mut parts = Vec::new();
    let mut adam = Vec::new();
    let mut ema = Vec::new();
    for (chunk, (spec, params)) in chunks.into_iter().enumerate() {
        let tp = TpShape::from_config(cfg);
        let remote = match &args.processes {
            Some(p) if tp.size > 1 => {
                p.clone().tp_remote(args.replica, args.rank, chunk, cfg.parallel.tp_timeout())?
            }
            _ => None,
        };
        let part = ModelPart::from_params(gpt, spec, b, cfg.train.recompute, params).with_tp_over(
            tp,
            args.layout.threads_per_rank,
            remote,
        );
        let mut st = AdamState::sharded(&part.params, zero_shard(args));
        if let Some(c) = &args.resume {
            super::super::compute::load_moments(&part.params, &mut st, c)?;
        }
        if cfg.optim.ema_decay > 0.0 {
            let mut e = EmaState::sharded(&part.params, zero_shard(args), cfg.optim.ema_decay);
            if let Some(c) = &args.resume {
                super::super::compute::load_ema(&part.params, &mut e, c)?;
            }
            ema.push(e);
        }
        parts.push(part);
        adam.push(st);
    }
    let cores = args.cores.clone();
    pin_here(&cores);
    let (rank, replica) = (args.rank, args.replica);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.layout.threads_per_rank)
        .use_current_thread()
        .thread_name(move |i| format!("stage-{rank}.{replica}-compute-{i}"))
        .start_handler(move |i| {
            if !cores.is_empty() {
                core_affinity::set_for_current(cores[i % cores.len()]);
            }
        })
        .build()
        .map_err(|e| e.to_string())?;
    let m = args.layout.microbatches;
    let block = args.replica * m..(args.replica + 1) * m;
    let total = args.layout.dp * m;
    let compute = CpuCompute::new(parts, adam, pool, nondet, b, block, total, cfg.parallel.zero);
    Ok(Box::new(if ema.is_empty() { compute } else { compute.with_ema(ema) }))
}

/// The rank's chunks on its GPU (`backend.devices`), or on its stage's
/// tensor-parallel GPUs, with as many activation slots per chunk as the
/// schedule keeps microbatches alive there.
#[cfg(feature = "cuda")]
fn build_gpu(
    args: &StageArgs,
    chunks: Vec<(crate::model::PartSpec, Vec<crate::model::Param>)>,
) -> Result<Box<dyn StageCompute>, String> {
    use super::super::compute::{GpuCompute, GpuPlace};
    use crate::kernels::cuda::Bf16;
    use crate::model::gpu::part::TpDevices;
    let cfg = &args.cfg;
    let ordinals =
        tp_ordinals(&cfg.backend.devices, args.layout.pp, cfg.parallel.tp, args.rank, args.replica);
    let dev = TpDevices::open(&ordinals).map_err(|e| format!("backend.devices: GPUs {ordinals:?}: {e}"))?;
    // Slots for the most microbatches any step keeps alive on each stage:
    // a batch ramp's smaller steps run schedules of their own.
    let mut peak = vec![0; args.layout.n_stages()];
    for s in std::iter::once(&args.layout.schedule).chain(args.layout.ramp_schedules.values()) {
        let p = s.simulate(&crate::schedule::Costs::unit()).map_err(|e| e.to_string())?.peak_live;
        peak.iter_mut().zip(p).for_each(|(a, b)| *a = (*a).max(b));
    }
    let live: Vec<usize> = args.layout.stages_of(args.rank).iter().map(|&s| peak[s]).collect();
    let rc = cfg.train.recompute;
    let (gpt, b) = (cfg.arch(), cfg.train.micro_batch_size);
    let resume = args.resume.as_deref();
    let place = || GpuPlace {
        layout: &args.layout,
        rank: args.rank,
        replica: args.replica,
        plan: args.gpu_plan.clone(),
        host_only: args.log.is_some(),
        tp_slices: cfg.parallel.tp_slices,
    };
    let decay = cfg.optim.ema_decay;
    Ok(if cfg.backend.dtype == crate::config::Dtype::F32 {
        Box::new(
            GpuCompute::<f32>::new(dev, chunks, gpt, b, rc, &live, resume, place())?
                .with_ema(decay, resume)?,
        )
    } else {
        Box::new(
            GpuCompute::<Bf16>::new(dev, chunks, gpt, b, rc, &live, resume, place())?
                .with_ema(decay, resume)?,
        )
    })
}

/// The GPU ordinals of pipeline rank `rank`'s tensor-parallel ranks in
/// replica `replica`, from `backend.devices` (`config::gpu_ordinals`, where
/// `launch` also reads them to keep processes off each other's GPUs).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn tp_ordinals(devices: &[usize], pp: usize, tp: usize, rank: usize, replica: usize) -> Vec<usize> {
    crate::config::gpu_ordinals(devices, pp, tp, rank, replica)
}

#[cfg(not(feature = "cuda"))]
fn build_gpu(
    _args: &StageArgs,
    _chunks: Vec<(crate::model::PartSpec, Vec<crate::model::Param>)>,
) -> Result<Box<dyn StageCompute>, String> {
    Err(crate::kernels::BackendError::NotBuilt.to_string())
}

#[cfg(test)]
mod tests {
    use super::tp_ordinals;

    #[test]
    fn each_rank_takes_tp_devices_in_a_row_per_rank_or_per_rank_and_replica() {
        // pp 2, tp 1: the layout every run before tensor parallelism used.
        assert_eq!(tp_ordinals(&[3, 5], 2, 1, 1, 0), vec![5]);
        assert_eq!(tp_ordinals(&[0, 1, 2, 3], 2, 1, 1, 1), vec![3]);
        // pp 2, tp 2: ranks' GPUs side by side (tp fastest).
        assert_eq!(tp_ordinals(&[0, 1, 2, 3], 2, 2, 1, 0), vec![2, 3]);
        assert_eq!(tp_ordinals(&[0, 1, 2, 3], 2, 2, 1, 1), vec![2, 3]);
        // pp 2, dp 2, tp 2: replica-major.
        assert_eq!(tp_ordinals(&[0, 1, 2, 3, 4, 5, 6, 7], 2, 2, 0, 1), vec![4, 5]);
        assert_eq!(tp_ordinals(&[], 2, 4, 1, 1), vec![0; 4]);
    }
}
