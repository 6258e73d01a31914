//! Mixtures of prepared datasets (`[[data.sources]]`): which source each
//! sequence of a run reads, in the proportions of the sources' weights.
//!
//! Owns the rule that routes global sequence g to (source k, the source's
//! own sequence j). Like the sampler's, it is a pure function of (seed, g):
//! sequences are grouped in blocks of [`BLOCK`]; each block holds every
//! source's share of the block (weights rounded to a thousandth of the mix
//! by largest remainder), in an order shuffled per block by
//! `Rng(seed, Mixture, block)`, and source k's j-th sequence is its j-th
//! across blocks. So a source reads its own windows in its own sampler's
//! order, each exactly once per epoch of that source, and a run resumed
//! mid-epoch, or run at another dp or pp, reads the same windows for the
//! same g.

use std::sync::Arc;

use super::shards::Manifest;
use super::token_file::{DataError, FileFormat, TokenFile, TokenSource};
use crate::rng::{Purpose, Rng};

/// Sequences per block of the schedule: the resolution of the weights.
pub const BLOCK: usize = 1000;

/// One entry of `[[data.sources]]`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    /// A prepared dataset's folder (its manifest's train shards) or one token file.
    pub path: String,
    /// The share of sequences, relative to the other sources' weights.
    pub weight: f64,
    /// How metrics name it [default: the path].
    #[serde(default)]
    pub name: String,
}

impl SourceSpec {
    pub fn label(&self) -> &str {
        if self.name.is_empty() {
            &self.path
        } else {
            &self.name
        }
    }
}

/// The problems of a sources table, each naming its entry.
pub fn problems(sources: &[SourceSpec]) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        if s.path.is_empty() {
            out.push((
                format!("data.sources[{i}].path"),
                "\"\"".into(),
                "a prepared dataset or token file".into(),
            ));
        }
        if !(s.weight.is_finite() && s.weight > 0.0) {
            out.push((
                format!("data.sources[{i}].weight"),
                s.weight.to_string(),
                "must be finite and > 0".into(),
            ));
        }
        if let Some(j) = sources[..i].iter().position(|o| o.label() == s.label()) {
            out.push((
                format!("data.sources[{i}].name"),
                format!("{:?}", s.label()),
                format!("names data.sources[{j}] too; give each source its own name"),
            ));
        }
    }
    out
}

/// Each source's sequences per block of [`BLOCK`], by largest remainder
/// (ties to the earlier source), every source at least one.
pub fn block_counts(weights: &[f64]) -> Vec<usize> {
    let total: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| w / total * BLOCK as f64).collect();
    let mut counts: Vec<usize> = exact.iter().map(|e| (e.floor() as usize).max(1)).collect();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| {
        (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b))
    });
    let mut given: usize = counts.iter().sum();
    for &k in order.iter().cycle().take(weights.len() * 2) {
        if given >= BLOCK {
            break;
        }
        counts[k] += 1;
        given += 1;
    }
    // Minimums of one may overfill the block: take back from the largest.
    while given > BLOCK {
        let k = (0..counts.len()).max_by_key(|&k| (counts[k], std::cmp::Reverse(k))).expect("a source");
        counts[k] -= 1;
        given -= 1;
    }
    counts
}

/// The routing of sequences to sources.
#[derive(Clone, Debug)]
pub struct Schedule {
    seed: u64,
    counts: Vec<usize>,
    /// (block, each position's (source, rank within the source in the block)).
    cache: Option<(u64, Vec<(u32, u32)>)>,
}

impl Schedule {
    pub fn new(seed: u64, weights: &[f64]) -> Schedule {
        Schedule { seed, counts: block_counts(weights), cache: None }
    }

    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    fn block(&mut self, b: u64) -> &[(u32, u32)] {
        if self.cache.as_ref().map(|(c, _)| *c) != Some(b) {
            let mut slots: Vec<u32> = Vec::with_capacity(BLOCK);
            for (k, &c) in self.counts.iter().enumerate() {
                slots.extend(std::iter::repeat_n(k as u32, c));
            }
            let perm = Rng::new(self.seed, Purpose::Mixture, &[b]).permutation(BLOCK);
            let mut seen = vec![0u32; self.counts.len()];
            let routed = perm
                .iter()
                .map(|&p| {
                    let k = slots[p as usize];
                    let rank = seen[k as usize];
                    seen[k as usize] += 1;
                    (k, rank)
                })
                .collect();
            self.cache = Some((b, routed));
        }
        &self.cache.as_ref().expect("filled above").1
    }

    /// Sequence g reads source k's sequence j: (k, j).
    pub fn route(&mut self, g: u64) -> (usize, u64) {
        let (b, at) = (g / BLOCK as u64, (g % BLOCK as u64) as usize);
        let (k, rank) = self.block(b)[at];
        (k as usize, b * self.counts[k as usize] as u64 + rank as u64)
    }

    /// Sequences of each source among g in [0, n).
    pub fn sequences_before(&mut self, n: u64) -> Vec<u64> {
        let (b, at) = (n / BLOCK as u64, (n % BLOCK as u64) as usize);
        let mut out: Vec<u64> = self.counts.iter().map(|&c| b * c as u64).collect();
        if at > 0 {
            for &(k, _) in &self.block(b)[..at] {
                out[k as usize] += 1;
            }
        }
        out
    }
}

/// A source's tokens: a prepared dataset's `split` ("train" or "val")
/// shards, back to back, or one token file.
pub fn open_source(
    path: &str,
    split: &str,
    vocab_size: usize,
    format: FileFormat,
) -> Result<TokenSource, DataError> {
    let p = std::path::Path::new(path);
    // A folder without a manifest is no dataset: the token file's own
    // refusal ("a directory, not a regular file") says what is wrong.
    if !p.join(super::shards::MANIFEST_FILE).exists() {
        return TokenFile::open_as(p, vocab_size, format).map(TokenSource::from);
    }
    let m = Manifest::read(p)?;
    if m.vocab_size > vocab_size {
        return Err(DataError::Invalid {
            what: format!(
                "{}: prepared with tokenizer {} of {} tokens, but model.vocab_size is {vocab_size} (expected at \
                 least the tokenizer's)",
                p.display(),
                m.tokenizer,
                m.vocab_size
            ),
        });
    }
    let shards = if split == "val" { &m.val } else { &m.train };
    if shards.is_empty() {
        return Err(DataError::Invalid {
            what: format!("{}: holds no {split} shards (prepared with val_fraction 0?)", p.display()),
        });
    }
    let files = shards
        .iter()
        .map(|s| TokenFile::open_as(&p.join(&s.file), vocab_size, format))
        .collect::<Result<Vec<_>, _>>()?;
    TokenSource::shards(path, files)
}

/// The sources of a mixture with their weights' schedule.
pub struct Mixture {
    pub names: Vec<String>,
    pub sources: Vec<Arc<TokenSource>>,
    pub weights: Vec<f64>,
}

impl Mixture {
    pub fn open(specs: &[SourceSpec], vocab_size: usize, format: FileFormat) -> Result<Mixture, DataError> {
        let mut sources = Vec::new();
        for s in specs {
            sources.push(Arc::new(open_source(&s.path, "train", vocab_size, format)?));
        }
        Ok(Mixture {
            names: specs.iter().map(|s| s.label().to_string()).collect(),
            sources,
            weights: specs.iter().map(|s| s.weight).collect(),
        })
    }
}

/// The tokenizer.json of the data a config trains on: the one beside its
/// prepared datasets (all the same file), if they have one.
pub fn tokenizer_of_data(
    train: &str,
    sources: &[SourceSpec],
) -> Result<Option<std::path::PathBuf>, DataError> {
    let dirs: Vec<&str> =
        if sources.is_empty() { vec![train] } else { sources.iter().map(|s| s.path.as_str()).collect() };
    let mut found: Option<(std::path::PathBuf, Vec<u8>)> = None;
    for d in dirs.into_iter().filter(|d| !d.is_empty()) {
        let p = std::path::Path::new(d);
        let dir = if p.is_dir() { p } else { p.parent().unwrap_or(std::path::Path::new(".")) };
        let file = dir.join(super::tokenizer::TOKENIZER_FILE);
        let Ok(bytes) = std::fs::read(&file) else { continue };
        match &found {
            Some((first, b)) if *b != bytes => {
                return Err(DataError::Invalid {
                    what: format!(
                        "{} and {} differ: the sources of one run must share a tokenizer",
                        first.display(),
                        file.display()
                    ),
                })
            }
            Some(_) => {}
            None => found = Some((file, bytes)),
        }
    }
    Ok(found.map(|(f, _)| f))
}

/// Tokens each source of `cfg`'s mixture has given by the time `tokens`
/// tokens were trained on (None without a mixture): the schedule's count of
/// sequences routed to it, times block_size. A pure function of the
/// config, so a resumed run's metrics continue the uninterrupted run's.
pub fn source_tokens(
    cfg: &crate::config::Config,
    tokens: u64,
) -> Option<std::collections::BTreeMap<String, u64>> {
    let sources = &cfg.data.sources;
    if sources.is_empty() || cfg.data.builtin != crate::config::Builtin::Files {
        return None;
    }
    let t = cfg.model.block_size.max(1) as u64;
    let weights: Vec<f64> = sources.iter().map(|s| s.weight).collect();
    let counts = Schedule::new(cfg.train.seed, &weights).sequences_before(tokens / t);
    Some(sources.iter().zip(counts).map(|(s, n)| (s.label().to_string(), n * t)).collect())
}

/// Copies the data's tokenizer (see [`tokenizer_of_data`]) into a run
/// folder, with a tokenizer_config.json for AutoTokenizer.
pub fn save_run_tokenizer(
    train: &str,
    sources: &[SourceSpec],
    run_dir: &std::path::Path,
) -> Result<(), DataError> {
    let Some(file) = tokenizer_of_data(train, sources)? else { return Ok(()) };
    let tok = super::tokenizer::Tokenizer::HuggingFace(Arc::new(super::tokenizer::HfTokenizer::open(&file)?));
    super::tokenizer::save_beside(&tok, run_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_counts_follow_the_weights_and_fill_the_block() {
        assert_eq!(block_counts(&[1.0, 1.0]), [500, 500]);
        assert_eq!(block_counts(&[3.0, 1.0]), [750, 250]);
        let c = block_counts(&[1.0, 1.0, 1.0]);
        assert_eq!(c.iter().sum::<usize>(), BLOCK);
        assert_eq!(c, [334, 333, 333]);
        let tiny = block_counts(&[1.0, 1e-9]);
        assert_eq!(tiny, [999, 1]);
    }

    #[test]
    fn every_source_sequence_is_read_once_in_order_and_shares_match_the_weights() {
        let mut s = Schedule::new(7, &[0.7, 0.3]);
        let n = 5 * BLOCK as u64 + 123;
        let mut next = [0u64; 2];
        for g in 0..n {
            let (k, j) = s.route(g);
            assert_eq!(j, next[k], "source {k} at g {g}");
            next[k] += 1;
        }
        assert_eq!(s.sequences_before(n), next.to_vec());
        assert_eq!(s.sequences_before(5 * BLOCK as u64), vec![3500, 1500]);
    }

    #[test]
    fn routing_is_a_pure_function_of_seed_and_sequence() {
        let mut a = Schedule::new(3, &[2.0, 1.0, 1.0]);
        let mut b = Schedule::new(3, &[2.0, 1.0, 1.0]);
        // Asked in another order (another replica, a resume): the same answers.
        let fwd: Vec<_> = (0..3000).map(|g| a.route(g)).collect();
        let back: Vec<_> =
            (0..3000).rev().map(|g| b.route(g)).collect::<Vec<_>>().into_iter().rev().collect();
        assert_eq!(fwd, back);
        let mut c = Schedule::new(4, &[2.0, 1.0, 1.0]);
        assert_ne!(fwd, (0..3000).map(|g| c.route(g)).collect::<Vec<_>>());
    }

    #[test]
    fn bad_sources_are_named_by_index() {
        let s = |p: &str, w: f64, n: &str| SourceSpec { path: p.into(), weight: w, name: n.into() };
        let p = problems(&[s("a", 1.0, ""), s("", 0.0, "x"), s("b", f64::NAN, "a")]);
        let keys: Vec<&str> = p.iter().map(|(k, _, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "data.sources[1].path",
                "data.sources[1].weight",
                "data.sources[2].weight",
                "data.sources[2].name"
            ]
        );
    }
}
