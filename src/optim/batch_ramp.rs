//! The global batch of each step: the full dp · `parallel.microbatches` ·
//! `micro_batch_size` sequences, or, with `train.batch_ramp`, grown to it
//! from a smaller batch over the first tokens — GPT-3's ramp (Brown et al.
//! 2020, appendix B) by Megatron-LM's rule (`--rampup-batch-size`):
//!
//! with n = (full − start) / increment increments over T ramp tokens, a step
//! that begins with c tokens trained on has full sequences when c > T, else
//! start + ⌊c · n / T⌋ · increment. Megatron divides samples by a float
//! (T / n); here the quotient is taken exactly in integers, which is the
//! same wherever the float is exact.
//!
//! Sizes are global and a pure function of the config and the step, so
//! every actor computes them alone, a replay and a resumed run agree, and a
//! step's microbatches — its data, its gradient tree — are the same at any
//! pp and dp (the config refuses sizes that do not split over dp). Where a
//! step's data starts is the sequences of all the steps before it.

use crate::config::Config;

#[derive(Clone, Debug)]
pub struct BatchSizes {
    /// Sequences per microbatch.
    micro: u64,
    /// Tokens per sequence.
    seq: u64,
    /// The full global batch, in sequences.
    full: u64,
    ramp: Option<Ramp>,
    /// Sequences trained on before step k, from step 0 until the first step
    /// with the full batch (or the run's last step, whichever comes first).
    before: Vec<u64>,
}

#[derive(Clone, Copy, Debug)]
struct Ramp {
    start: u64,
    increment: u64,
    tokens: u64,
}

impl BatchSizes {
    /// The sizes of `cfg`'s steps (a validated config).
    pub fn from_config(cfg: &Config) -> BatchSizes {
        let p = &cfg.parallel;
        let micro = cfg.train.micro_batch_size as u64;
        let full = (p.dp * p.microbatches) as u64 * micro;
        let ramp = cfg.train.batch_ramp.as_ref().map(|r| Ramp {
            start: r.start as u64,
            increment: r.increment as u64,
            tokens: r.tokens,
        });
        BatchSizes::new(micro, cfg.model.block_size as u64, full, ramp, cfg.train.steps as u64)
    }

    fn new(micro: u64, seq: u64, full: u64, ramp: Option<Ramp>, steps: u64) -> BatchSizes {
        let mut s = BatchSizes { micro, seq, full, ramp, before: vec![0] };
        // Tabled up to the run's end at most: a ramp far longer than the run
        // costs no more than its steps.
        while (s.before.len() as u64) <= steps && !s.ramp_over(*s.before.last().expect("step 0")) {
            let c = *s.before.last().expect("a step");
            s.before.push(c + s.size_after(c));
        }
        s
    }

    /// Whether a step that begins after `c` sequences has the full batch.
    fn ramp_over(&self, c: u64) -> bool {
        self.ramp.is_none_or(|r| c as u128 * self.seq as u128 > r.tokens as u128)
    }

    /// Megatron's rule: the global batch of a step that begins after `c` sequences.
    fn size_after(&self, c: u64) -> u64 {
        let Some(r) = self.ramp else { return self.full };
        let tokens = c as u128 * self.seq as u128;
        if tokens > r.tokens as u128 {
            return self.full;
        }
        let n = ((self.full - r.start) / r.increment) as u128;
        let done = (tokens * n / r.tokens as u128) as u64;
        (r.start + done * r.increment).min(self.full)
    }

    /// Sequences trained on before 0-based step `step`.
    pub fn sequences_before(&self, step: u64) -> u64 {
        let last = self.before.len() as u64 - 1;
        let mut c = self.before[step.min(last) as usize];
        if step > last && self.ramp_over(c) {
            return c + (step - last) * self.full;
        }
        // Past the table inside the ramp: only a step beyond train.steps asks.
        for _ in last..step {
            c += self.size_after(c);
        }
        c
    }

    /// Sequences in step `step`'s global batch.
    pub fn sequences(&self, step: u64) -> u64 {
        self.size_after(self.sequences_before(step))
    }

    /// Tokens trained on before step `step`.
    pub fn tokens_before(&self, step: u64) -> u64 {
        self.sequences_before(step) * self.seq
    }

    /// Tokens in step `step`.
    pub fn tokens(&self, step: u64) -> u64 {
        self.sequences(step) * self.seq
    }

    /// Step `step`'s microbatches over all replicas.
    pub fn microbatches(&self, step: u64) -> usize {
        (self.sequences(step) / self.micro) as usize
    }

    /// Step `step`'s microbatches on each of `dp` replicas.
    pub fn per_replica(&self, step: u64, dp: usize) -> usize {
        let g = self.microbatches(step);
        debug_assert!(g.is_multiple_of(dp), "{g} microbatches over {dp} replicas");
        g / dp
    }

    /// Every count of microbatches per replica the steps below `steps` have,
    /// ascending (the full one last): what schedules are built for.
    pub fn counts(&self, steps: u64, dp: usize) -> Vec<usize> {
        let mut counts: Vec<usize> = (0..steps.min(self.before.len() as u64))
            .map(|k| self.per_replica(k, dp))
            .chain([(self.full / self.micro) as usize / dp])
            .collect();
        counts.sort_unstable();
        counts.dedup();
        counts
    }

    pub fn ramped(&self) -> bool {
        self.ramp.is_some()
    }

    /// Where step `step` stands in a learning-rate schedule of `steps`
    /// steps. With a ramp the schedule is counted in tokens: the run's
    /// tokens stretched over its steps, so warmup and decay take the same
    /// share of the tokens as of the steps without a ramp, and the decay
    /// still ends with the run (Megatron counts them in samples too, and
    /// refuses a ramp with step-counted schedules). Without one: `step`.
    pub fn lr_position(&self, step: u64, steps: u64) -> f64 {
        if self.ramp.is_none() || steps == 0 {
            return step as f64;
        }
        let run = self.sequences_before(steps) as u128;
        // Exact in integers up to the one rounding: k·full·steps / (steps·full) is k.
        (self.sequences_before(step) as u128 * steps as u128) as f64 / run as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(start: u64, increment: u64, tokens: u64, full: u64, steps: u64) -> Vec<u64> {
        let b = BatchSizes::new(1, 1, full, Some(Ramp { start, increment, tokens }), steps);
        (0..steps).map(|k| b.sequences(k)).collect()
    }

    /// Megatron's calculator, as written in Python (`update(consumed_samples)`),
    /// with its float division: the reference the ramp must match.
    fn megatron(start: u64, increment: u64, samples: u64, full: u64, steps: u64) -> Vec<u64> {
        let per_increment = samples as f64 / ((full - start) / increment) as f64;
        let mut consumed = 0u64;
        (0..steps)
            .map(|_| {
                let size = if consumed > samples {
                    full
                } else {
                    start + (consumed as f64 / per_increment) as u64 * increment
                };
                consumed += size;
                size
            })
            .collect()
    }

    #[test]
    fn the_ramp_grows_by_megatrons_rule_and_stays_full_after() {
        // 2 → 8 by 2 over 20 samples: 3 increments, one per 20/3 samples.
        // consumed 0, 2, 4, 6 → 2 (c·3/20 < 1); 8 → 2+2=4 (24/20 = 1); 12 → 4; 16 → 6 (48/20 = 2);
        // 22 > 20 → full.
        assert_eq!(sizes(2, 2, 20, 8, 10), [2, 2, 2, 2, 4, 4, 6, 8, 8, 8]);
        for (start, inc, t, full) in
            [(2, 2, 20, 8), (4, 4, 1000, 64), (1, 3, 77, 31), (8, 8, 8, 16), (6, 6, 1, 12)]
        {
            assert_eq!(
                sizes(start, inc, t, full, 60),
                megatron(start, inc, t, full, 60),
                "{start} {inc} {t} {full}"
            );
        }
    }

    #[test]
    fn tokens_count_sequences_times_the_block_size_and_the_table_ends_with_the_run() {
        // 4 tokens a sequence, microbatches of 2: the ramp is 4 → 8 over 40 tokens (10 sequences).
        let b = BatchSizes::new(2, 4, 8, Some(Ramp { start: 4, increment: 4, tokens: 40 }), 3);
        // consumed 0 → 4 (0·1/40); 4 seq = 16 tokens → 4; 8 seq = 32 → 4; 12 seq = 48 > 40 → 8.
        let seqs: Vec<u64> = (0..6).map(|k| b.sequences(k)).collect();
        assert_eq!(seqs, [4, 4, 4, 8, 8, 8]);
        assert_eq!((b.sequences_before(5), b.tokens_before(5), b.tokens(3)), (28, 112, 32));
        assert_eq!((b.microbatches(0), b.per_replica(0, 2), b.per_replica(3, 2)), (2, 1, 2));
        assert_eq!(b.counts(6, 1), [2, 4]);
        // Beyond the tabled steps the sums go on by the same rule.
        let long = BatchSizes::new(2, 4, 8, Some(Ramp { start: 4, increment: 4, tokens: 40 }), 100);
        assert!((0..10).all(|k| long.sequences_before(k) == b.sequences_before(k)));
    }

    #[test]
    fn without_a_ramp_every_step_is_full_and_the_lr_counts_steps() {
        let b = BatchSizes::new(4, 16, 32, None, 10);
        assert_eq!((b.sequences(0), b.sequences_before(7), b.microbatches(3)), (32, 224, 8));
        assert_eq!(b.counts(10, 2), [4]);
        assert_eq!(b.lr_position(7, 10), 7.0);
    }

    #[test]
    fn with_a_ramp_the_lr_position_is_the_share_of_the_runs_tokens() {
        let b = BatchSizes::new(1, 1, 8, Some(Ramp { start: 2, increment: 2, tokens: 20 }), 10);
        // Sizes 2, 2, 2, 2, 4, 4, 6, 8, 8, 8: 46 sequences in all.
        assert_eq!(b.sequences_before(10), 46);
        assert_eq!(b.lr_position(0, 10), 0.0);
        assert_eq!(b.lr_position(4, 10), 80.0 / 46.0);
        assert_eq!(b.lr_position(10, 10), 10.0);
        // A run that ends inside the ramp.
        let short = BatchSizes::new(1, 1, 8, Some(Ramp { start: 2, increment: 2, tokens: 20 }), 3);
        assert_eq!(short.lr_position(2, 3), 2.0);
    }
}
