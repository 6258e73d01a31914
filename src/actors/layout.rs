//! How the model is spread: pipeline ranks, model chunks per rank, data-parallel
//! replicas, which layers each stage holds, and the threads each rank gets.
//! Refuses layouts that cannot work before anything starts, naming the field.

use crate::config::Config;
use crate::model::PartSpec;
use crate::optim::batch_ramp::BatchSizes;
use crate::schedule::{self, Schedule};
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Clone, Debug)]
pub struct Layout {
    /// Pipeline ranks (p).
    pub pp: usize,
    /// Data-parallel replicas.
    pub dp: usize,
    /// Model chunks per rank (v); stages = pp · chunks.
    pub chunks: usize,
    /// Microbatches per replica in a step with the full global batch.
    pub microbatches: usize,
    /// Each step's global batch (`train.batch_ramp`).
    pub batches: Arc<BatchSizes>,
    /// The schedules of the smaller steps of a ramp, by microbatches per replica.
    pub ramp_schedules: Arc<BTreeMap<usize, Schedule>>,
    /// One spec per global stage.
    pub stages: Vec<PartSpec>,
    pub schedule: Schedule,
    /// Compute threads per rank.
    pub threads_per_rank: usize,
}

/// Validates a schedule and dry-runs it: one that is malformed or would
/// deadlock is refused here, before any actor starts. `field` names the origin.
pub fn check_schedule(schedule: &Schedule, field: &str) -> Result<()> {
    schedule.validate().map_err(|e| anyhow::anyhow!("{field}: {e}"))?;
    schedule.simulate(&schedule::Costs::unit()).map_err(|e| anyhow::anyhow!("{field}: {e}"))?;
    Ok(())
}

impl Layout {
    pub fn from_config(cfg: &Config) -> Result<Layout> {
        let gpt = cfg.arch();
        let p = &cfg.parallel;
        let kind = p.schedule;
        let Some(chunks) = kind.chunks_for(p.chunks) else {
            bail!(
                "parallel.chunks: {}: more than one chunk per rank needs parallel.schedule = \"interleaved\" (or 2 with \"zb-v\" or \"dualpipev\")",
                p.chunks
            );
        };
        let n_stages = p.pp * chunks;
        let layers = if p.layers_per_stage.is_empty() {
            if n_stages > gpt.n_layer {
                bail!(
                    "parallel.pp: {}: {} stages (pp × chunks) but model.n_layer is {}; every stage needs at least one layer",
                    p.pp,
                    n_stages,
                    gpt.n_layer
                );
            }
            // Even split; the first (n_layer mod stages) stages take one more.
            (0..n_stages).map(|s| gpt.n_layer / n_stages + usize::from(s < gpt.n_layer % n_stages)).collect()
        } else {
            let l = &p.layers_per_stage;
            if l.len() != n_stages {
                bail!(
                    "parallel.layers_per_stage: {l:?}: expected {n_stages} entries (pp × chunks = {} × {chunks})",
                    p.pp
                );
            }
            if l.contains(&0) || l.iter().sum::<usize>() != gpt.n_layer {
                bail!(
                    "parallel.layers_per_stage: {l:?}: every entry must be >= 1 and they must sum to model.n_layer ({})",
                    gpt.n_layer
                );
            }
            l.clone()
        };
        let mut stages = Vec::with_capacity(n_stages);
        let mut first = 0;
        for (s, &n) in layers.iter().enumerate() {
            stages.push(PartSpec { layers: first..first + n, embedding: s == 0, head: s + 1 == n_stages });
            first += n;
        }
        let schedule = schedule::build(kind, p.pp, p.microbatches, chunks)
            .map_err(|e| anyhow::anyhow!("parallel.schedule = {:?}: {e}", p.schedule.name()))?;
        check_schedule(&schedule, &format!("parallel.schedule = {:?}", p.schedule.name()))?;
        let batches = BatchSizes::from_config(cfg);
        let mut ramp_schedules = BTreeMap::new();
        for m in batches.counts(cfg.train.steps as u64, p.dp).into_iter().filter(|&m| m != p.microbatches) {
            let field = format!("train.batch_ramp (a step of {m} microbatches per replica)");
            let s = schedule::build(kind, p.pp, m, chunks).map_err(|e| anyhow::anyhow!("{field}: {e}"))?;
            check_schedule(&s, &field)?;
            // The runtime finds a stage's rank once, from the full schedule.
            if s.stage_rank != schedule.stage_rank {
                bail!(
                    "{field}: the schedule places stages otherwise than with {} microbatches",
                    p.microbatches
                );
            }
            ramp_schedules.insert(m, s);
        }
        let total = crate::host::thread_count(cfg.backend.threads);
        let threads_per_rank = (total / (p.pp * p.dp)).max(1);
        Ok(Layout {
            pp: p.pp,
            dp: p.dp,
            chunks,
            microbatches: p.microbatches,
            batches: Arc::new(batches),
            ramp_schedules: Arc::new(ramp_schedules),
            stages,
            schedule,
            threads_per_rank,
        })
    }

    /// Step `step`'s microbatches per replica.
    pub fn microbatches_at(&self, step: u64) -> usize {
        self.batches.per_replica(step, self.dp)
    }

    /// The schedule of a step with `m` microbatches per replica.
    pub fn schedule_for(&self, m: usize) -> &Schedule {
        match m == self.microbatches {
            true => &self.schedule,
            false => &self.ramp_schedules[&m],
        }
    }

    pub fn n_stages(&self) -> usize {
        self.stages.len()
    }

    /// Where the schedule placed `stage`.
    pub fn rank_of(&self, stage: usize) -> usize {
        self.schedule.rank_of(stage)
    }

    /// Global stages held by `rank`, ascending.
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        self.schedule.stages_of(rank)
    }

    pub fn last_stage(&self) -> usize {
        self.n_stages() - 1
    }
}
