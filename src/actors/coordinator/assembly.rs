//! Checkpoint assembly: every rank's snapshot, and the run's counters, into
//! what the checkpointer writes (the tensors once each, `state.json`, the
//! learning-rate position). Plain data in, plain data out: no actors, no I/O.

use crate::checkpoint::{LrPosition, RngState, StateFile, TensorState, FORMAT_VERSION, RNG_NOTE};
use crate::config::Config;
use crate::optim::{batch_ramp::BatchSizes, scaler::LossScaler, LrSchedule};
use crate::replay::Blob;

/// One rank's copy of its tensors, its AdamW step count and its EMA's
/// update count (None: no EMA kept).
pub type Snapshot = (Vec<TensorState>, u64, Option<u64>);

/// The ranks' snapshots, in rank order, as one list of tensors with the
/// AdamW step and the EMA's updates (every rank's are the same; the last
/// one read stands).
pub fn merge(snapshots: impl IntoIterator<Item = Snapshot>) -> Snapshot {
    let mut tensors = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    let (mut adam_step, mut ema_updates) = (0, None);
    for (ts, t, ema) in snapshots {
        (adam_step, ema_updates) = (t, ema);
        for tensor in ts {
            // The head's copy of the tied wte equals the embedding's; keep one.
            if seen.insert(tensor.name.clone()) {
                tensors.push(tensor);
            }
        }
    }
    (tensors, adam_step, ema_updates)
}

/// Where the run stands at a step boundary: what `state.json` records.
pub struct RunPosition<'a> {
    pub cfg: &'a Config,
    pub sched: &'a LrSchedule,
    /// Steps completed; the resumed run starts with this one.
    pub step: u64,
    pub adam_step: u64,
    pub tokens: u64,
    pub skipped_steps: usize,
    /// The learning rate of `step`, a cooldown included.
    pub next_lr: f64,
    pub cooldown_until: u64,
    pub dp: usize,
    /// Each step's global batch: where step `step`'s data starts.
    pub batches: &'a BatchSizes,
    pub loss_scaler: Option<LossScaler>,
    pub ema_updates: Option<u64>,
}

/// `state.json` of the checkpoint taken at `p.step`.
pub fn state_file(p: RunPosition) -> StateFile {
    // Replica r of step s reads from the step's global microbatch r·m, after
    // every sequence of the steps before (see data_loader).
    let (dp, before) = (p.dp, p.batches.sequences_before(p.step));
    let replica_seqs = (p.batches.per_replica(p.step, dp) * p.cfg.train.micro_batch_size) as u64;
    StateFile {
        format_version: FORMAT_VERSION,
        step: p.step,
        adam_step: p.adam_step,
        tokens: p.tokens,
        skipped_steps: p.skipped_steps,
        data_cursor: before,
        data_cursors: (0..dp as u64).map(|r| before + r * replica_seqs).collect(),
        rng: RngState { seed: p.cfg.train.seed, step: p.step, note: RNG_NOTE.into() },
        lr_schedule: lr_position(&p),
        config: p.cfg.to_toml_string(),
        config_hash: p.cfg.hash(),
        digests: Default::default(),
        loss_scaler: p.loss_scaler,
        ema_updates: p.ema_updates,
    }
}

fn lr_position(p: &RunPosition) -> LrPosition {
    let (decay_start, decay_end) = p.sched.decay_bounds();
    LrPosition {
        kind: p.cfg.optim.schedule.name().to_string(),
        step: p.step,
        warmup_steps: p.sched.warmup_steps as u64,
        decay_start: decay_start as u64,
        decay_end: decay_end as u64,
        lr: p.sched.lr,
        min_lr: p.sched.min_lr,
        next_lr: p.next_lr,
        cooldown_until: p.cooldown_until,
        cooldown_factor: p.cfg.recovery.lr_factor,
    }
}

/// The checkpointer's `Write` as the coordinator's replay log records it.
pub fn logged(state: &StateFile) -> Vec<Blob> {
    vec![
        Blob::f64("step", state.step as f64),
        Blob::f64("adam_step", state.adam_step as f64),
        Blob::f64("tokens", state.tokens as f64),
        Blob::f64("data_cursor", state.data_cursor as f64),
        Blob::f64("next_lr", state.lr_schedule.next_lr),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, v: f32) -> TensorState {
        TensorState {
            name: name.into(),
            shape: vec![1],
            data: vec![v],
            exp_avg: vec![0.0],
            exp_avg_sq: vec![0.0],
            ema: vec![],
        }
    }

    #[test]
    fn the_tied_embedding_is_written_once_from_the_first_rank_holding_it() {
        let (ts, adam, ema) = merge([
            (vec![tensor("wte", 1.0), tensor("h0.w", 2.0)], 7, Some(7)),
            (vec![tensor("h1.w", 3.0), tensor("wte", 9.0)], 7, Some(7)),
        ]);
        assert_eq!(ema, Some(7));
        let names: Vec<_> = ts.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["wte", "h0.w", "h1.w"]);
        assert_eq!(ts[0].data, [1.0]);
        assert_eq!(adam, 7);
    }

    #[test]
    fn data_cursors_count_global_microbatches_per_replica() {
        let mut cfg = Config::default();
        cfg.train.micro_batch_size = 2;
        (cfg.parallel.dp, cfg.parallel.microbatches) = (2, 4);
        let sched = LrSchedule::from_config(&cfg);
        let batches = BatchSizes::from_config(&cfg);
        let s = state_file(RunPosition {
            cfg: &cfg,
            sched: &sched,
            step: 3,
            adam_step: 2,
            tokens: 100,
            skipped_steps: 1,
            next_lr: 0.25,
            cooldown_until: 5,
            dp: 2,
            batches: &batches,
            loss_scaler: None,
            ema_updates: None,
        });
        // Step 3 of dp 2 × m 4 × b 2: replica r starts at microbatch (3·2 + r)·4.
        assert_eq!(s.data_cursor, 48);
        assert_eq!(s.data_cursors, [48, 56]);
        assert_eq!((s.lr_schedule.next_lr, s.lr_schedule.cooldown_until), (0.25, 5));
        assert_eq!(s.config_hash, cfg.hash());
        let blobs = logged(&s);
        assert_eq!(blobs.len(), 5);
    }
}
