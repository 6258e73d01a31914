//! Which token windows each sequence of a run reads.
//!
//! Owns the mapping from a global sequence number g to a window of T+1 tokens.
//! The only state is a cache of the current epoch's permutation, so the
//! sequence a (step, microbatch, replica, row) sees is a pure function of
//! (seed, g): it does not depend on the pipeline or data-parallel layout, on
//! which thread asked first, or on whether the run was resumed. Never draws
//! randomness from anything but `rng::Rng` keyed by (seed, Shuffle, epoch).
//!
//! The data cursor a checkpoint stores is just the number of sequences
//! consumed so far; the caller computes the first sequence of each microbatch as
//! `first_sequence = ((step * microbatches + mb) * dp + replica) * B`.

use std::str::FromStr;
use std::sync::Arc;

use super::token_file::{DataError, TokenSource};
use crate::rng::{Purpose, Rng};

/// The order in which windows are visited (`data.sampler`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SamplerKind {
    /// Windows 0, 1, 2, … and wrap around.
    Sequential,
    /// Each epoch visits every window exactly once, in a seeded permutation
    /// that is different for every epoch.
    Shuffled,
}

impl FromStr for SamplerKind {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self, DataError> {
        match s {
            "sequential" => Ok(SamplerKind::Sequential),
            "shuffled" => Ok(SamplerKind::Shuffled),
            other => Err(DataError::Invalid {
                what: format!("data.sampler: got {other:?}, expected \"shuffled\" or \"sequential\""),
            }),
        }
    }
}

/// Cuts a token source into non-overlapping windows of T+1 tokens
/// (window i = tokens[i·T .. i·T + T + 1]; consecutive windows share one token
/// so every token but the first is a target exactly once per epoch) and hands
/// them out by global sequence number.
#[derive(Debug)]
pub struct Sampler {
    kind: SamplerKind,
    source: Arc<TokenSource>,
    block_size: usize,
    micro_batch_size: usize,
    seed: u64,
    n_windows: u64,
    /// (epoch, permutation of that epoch), for the shuffled kind.
    perm: Option<(u64, Vec<u32>)>,
    scratch: Vec<u32>,
    /// For a mixture: the routing of sequences and a sampler per source
    /// (then `source` is the first source's and `n_windows` their sum).
    mixture: Option<Box<(super::mixture::Schedule, Vec<Sampler>)>>,
}

impl Sampler {
    /// `block_size` is T, `micro_batch_size` is B. Fails when the source has
    /// fewer than T+1 tokens (no window at all).
    pub fn new(
        kind: SamplerKind,
        source: impl Into<Arc<TokenSource>>,
        block_size: usize,
        micro_batch_size: usize,
        seed: u64,
    ) -> Result<Sampler, DataError> {
        let source = source.into();
        let bad = |what: String| DataError::BadShape { name: source.name(), what };
        if block_size == 0 {
            return Err(bad("block_size T is 0; expected at least 1".into()));
        }
        if micro_batch_size == 0 {
            return Err(bad("micro_batch_size B is 0; expected at least 1".into()));
        }
        let len = source.len();
        if len < block_size + 1 {
            return Err(DataError::TooShort { name: source.name(), len, block_size, needed: block_size + 1 });
        }
        let n_windows = ((len - 1) / block_size) as u64;
        if kind == SamplerKind::Shuffled && n_windows > u32::MAX as u64 {
            return Err(bad(format!(
                "{n_windows} windows of {block_size} tokens; the shuffled sampler supports at most {}",
                u32::MAX
            )));
        }
        Ok(Sampler {
            kind,
            source,
            block_size,
            micro_batch_size,
            seed,
            n_windows,
            perm: None,
            scratch: vec![0; block_size + 1],
            mixture: None,
        })
    }

    /// A sampler over a mixture: sequence g reads the source the mixture's
    /// schedule routes it to, at that source's own next sequence, through
    /// a sampler of `kind` per source (each seeded apart from the others).
    pub fn mixture(
        kind: SamplerKind,
        m: &super::mixture::Mixture,
        block_size: usize,
        micro_batch_size: usize,
        seed: u64,
    ) -> Result<Sampler, DataError> {
        let mut parts = Vec::with_capacity(m.sources.len());
        for (k, src) in m.sources.iter().enumerate() {
            let part_seed = crate::rng::mix64(seed ^ crate::rng::mix64(0x6d69_7800 + k as u64));
            parts.push(Sampler::new(kind, src.clone(), block_size, micro_batch_size, part_seed)?);
        }
        let mut s = Sampler::new(kind, m.sources[0].clone(), block_size, micro_batch_size, seed)?;
        s.n_windows = parts.iter().map(|p| p.n_windows).sum();
        s.mixture = Some(Box::new((super::mixture::Schedule::new(seed, &m.weights), parts)));
        Ok(s)
    }

    /// A sampler for validation: sequential windows from the start of the
    /// source, so every evaluation reads the same tokens. Evaluation batch k is
    /// `fill(k * B, ..)`; batches past `n_windows() / B` wrap around and repeat
    /// windows.
    pub fn eval(
        source: impl Into<Arc<TokenSource>>,
        block_size: usize,
        micro_batch_size: usize,
    ) -> Result<Sampler, DataError> {
        Sampler::new(SamplerKind::Sequential, source, block_size, micro_batch_size, 0)
    }

    pub fn kind(&self) -> SamplerKind {
        self.kind
    }

    pub fn source(&self) -> &Arc<TokenSource> {
        &self.source
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn micro_batch_size(&self) -> usize {
        self.micro_batch_size
    }

    /// Windows per epoch: (len − 1) / T.
    pub fn n_windows(&self) -> u64 {
        self.n_windows
    }

    /// The window the g-th sequence of the run reads.
    pub fn window_index(&mut self, g: u64) -> u64 {
        let i = g % self.n_windows;
        match self.kind {
            SamplerKind::Sequential => i,
            SamplerKind::Shuffled => {
                let epoch = g / self.n_windows;
                if self.perm.as_ref().map(|(e, _)| *e) != Some(epoch) {
                    let p =
                        Rng::new(self.seed, Purpose::Shuffle, &[epoch]).permutation(self.n_windows as usize);
                    self.perm = Some((epoch, p));
                }
                let (_, p) = self.perm.as_ref().expect("permutation cached above");
                p[i as usize] as u64
            }
        }
    }

    /// Fills B sequences, g = first_sequence .. first_sequence + B:
    /// `inputs` and `targets` are (B, T) row-major, inputs = window[..T],
    /// targets = window[1..]. Panics if a buffer is not B·T long.
    pub fn fill(&mut self, first_sequence: u64, inputs: &mut [u32], targets: &mut [u32]) {
        let (t, b) = (self.block_size, self.micro_batch_size);
        assert_eq!(inputs.len(), b * t, "inputs must be B*T = {b}*{t}");
        assert_eq!(targets.len(), b * t, "targets must be B*T = {b}*{t}");
        for row in 0..b {
            let g = first_sequence + row as u64;
            if let Some(mix) = self.mixture.as_mut() {
                let (k, j) = mix.0.route(g);
                let part = &mut mix.1[k];
                let w = part.window_index(j) as usize;
                part.source.window(w * t, &mut self.scratch);
            } else {
                let w = self.window_index(g) as usize;
                self.source.window(w * t, &mut self.scratch);
            }
            inputs[row * t..(row + 1) * t].copy_from_slice(&self.scratch[..t]);
            targets[row * t..(row + 1) * t].copy_from_slice(&self.scratch[1..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(n: u32) -> TokenSource {
        TokenSource::from_vec("test", (0..n).collect(), 1 << 20).unwrap()
    }

    #[test]
    fn windows_overlap_by_one_token_and_targets_shift_by_one() {
        // 10 tokens, T = 3: windows [0..4), [3..7), [6..10); n = (10-1)/3 = 3.
        let mut s = Sampler::new(SamplerKind::Sequential, source(10), 3, 2, 0).unwrap();
        assert_eq!(s.n_windows(), 3);
        let (mut x, mut y) = (vec![0; 6], vec![0; 6]);
        s.fill(1, &mut x, &mut y);
        assert_eq!(x, [3, 4, 5, 6, 7, 8]);
        assert_eq!(y, [4, 5, 6, 7, 8, 9]);
    }

    #[test]
    fn sequential_sampler_wraps_at_the_end() {
        let mut s = Sampler::new(SamplerKind::Sequential, source(10), 3, 2, 0).unwrap();
        let (mut x, mut y) = (vec![0; 6], vec![0; 6]);
        s.fill(2, &mut x, &mut y); // windows 2 and 0
        assert_eq!(x, [6, 7, 8, 0, 1, 2]);
        assert_eq!(y, [7, 8, 9, 1, 2, 3]);
        assert_eq!(s.window_index(3 * 1000 + 1), 1);
    }

    #[test]
    fn source_too_short_for_one_window_is_rejected_with_its_name() {
        let err = Sampler::new(SamplerKind::Sequential, source(8), 8, 1, 0).unwrap_err();
        assert!(matches!(err, DataError::TooShort { len: 8, needed: 9, .. }), "{err}");
        assert!(err.to_string().contains("test"), "{err}");
        assert!(Sampler::new(SamplerKind::Sequential, source(9), 8, 1, 0).is_ok());
    }

    #[test]
    fn shuffled_sampler_visits_every_window_once_per_epoch_and_repeats_for_the_same_seed() {
        let n = 101u64; // T = 1 over 102 tokens
        let mut a = Sampler::new(SamplerKind::Shuffled, source(102), 1, 4, 42).unwrap();
        let mut b = Sampler::new(SamplerKind::Shuffled, source(102), 1, 4, 42).unwrap();
        let mut c = Sampler::new(SamplerKind::Shuffled, source(102), 1, 4, 43).unwrap();
        assert_eq!(a.n_windows(), n);
        let mut epochs = Vec::new();
        for epoch in 0..3 {
            let order: Vec<u64> = (0..n).map(|i| a.window_index(epoch * n + i)).collect();
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "epoch {epoch} is not a permutation");
            // Asked in reverse, out of order: the answer is a function of g only.
            let again: Vec<u64> = (0..n).rev().map(|i| b.window_index(epoch * n + i)).collect();
            assert_eq!(again.into_iter().rev().collect::<Vec<_>>(), order);
            epochs.push(order);
        }
        assert_ne!(epochs[0], epochs[1], "epochs should use different permutations");
        let other: Vec<u64> = (0..n).map(|i| c.window_index(i)).collect();
        assert_ne!(other, epochs[0], "a different seed should give a different order");
    }

    #[test]
    fn fill_is_independent_of_how_sequences_are_split_into_calls() {
        // One call with B = 4 equals four calls with B = 1 at the same g.
        let mut big = Sampler::new(SamplerKind::Shuffled, source(200), 5, 4, 7).unwrap();
        let mut small = Sampler::new(SamplerKind::Shuffled, source(200), 5, 1, 7).unwrap();
        let (mut x, mut y) = (vec![0; 20], vec![0; 20]);
        big.fill(37, &mut x, &mut y); // crosses the epoch boundary at g = 39
        for r in 0..4 {
            let (mut x1, mut y1) = (vec![0; 5], vec![0; 5]);
            small.fill(37 + r as u64, &mut x1, &mut y1);
            assert_eq!(&x[r * 5..r * 5 + 5], &x1[..]);
            assert_eq!(&y[r * 5..r * 5 + 5], &y1[..]);
        }
    }

    #[test]
    fn eval_sampler_reads_sequential_windows_from_the_start() {
        let mut s = Sampler::eval(source(20), 4, 2).unwrap();
        let (mut x, mut y) = (vec![0; 8], vec![0; 8]);
        s.fill(0, &mut x, &mut y);
        assert_eq!(x, [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(y[7], 8);
    }

    #[test]
    fn sampler_kind_parses_config_strings() {
        assert_eq!("shuffled".parse::<SamplerKind>().unwrap(), SamplerKind::Shuffled);
        assert_eq!("sequential".parse::<SamplerKind>().unwrap(), SamplerKind::Sequential);
        let err = "random".parse::<SamplerKind>().unwrap_err();
        assert!(err.to_string().contains("data.sampler"), "{err}");
    }
}
