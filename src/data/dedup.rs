//! Deduplication (`prepare --dedup`): exact, by a hash of the normalised
//! text, then near-duplicate, by MinHash with locality-sensitive hashing
//! (datatrove's scheme: word 5-gram shingles, 14 bands of 8 rows).
//!
//! Owns a document's signature (computed in parallel with the filters) and
//! the resolution of clusters once every document has been signed. Memory is
//! bounded by the number of documents, never their text: signatures go to
//! partition files on disk as they come (16 bytes per band per document),
//! and are read back one partition at a time; what stays in memory is
//! 13 bytes a document (its text's hash, a union-find parent, a flag) plus
//! one partition. See [`memory_bound`].
//!
//! Which document of a cluster is kept does not depend on the order the
//! inputs were listed in or the thread that saw a document first: it is the
//! one whose text has the smallest 64-bit hash ([`Signature::content`]), the
//! earliest among equal hashes (identical texts).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use super::hash::{hash_bytes, hash_seq, mix};
use super::token_file::DataError;

/// The `[dedup]` table of a prepare config.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DedupSettings {
    /// Remove documents whose normalised text equals an earlier one's.
    pub exact: bool,
    /// Remove near-duplicates by MinHash LSH.
    pub near: bool,
    /// Words per shingle.
    pub shingle: usize,
    /// LSH bands; two documents are candidates when any band matches.
    pub bands: usize,
    /// MinHash values per band.
    pub rows: usize,
    /// Seed of the hash functions (a different seed, different collisions).
    pub seed: u64,
    /// Partition files per kind; one partition is in memory at a time.
    pub partitions: usize,
}

impl Default for DedupSettings {
    fn default() -> Self {
        DedupSettings { exact: true, near: true, shingle: 5, bands: 14, rows: 8, seed: 1, partitions: 16 }
    }
}

impl DedupSettings {
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (key, v, max) in [
            ("dedup.shingle", self.shingle, 64),
            ("dedup.bands", self.bands, 64),
            ("dedup.rows", self.rows, 64),
            ("dedup.partitions", self.partitions, 4096),
        ] {
            if v == 0 || v > max {
                out.push(format!("{key}: {v}: expected 1 to {max}"));
            }
        }
        out
    }

    /// The Jaccard similarity at which a pair is caught half the time,
    /// (1/b)^(1/r): 0.72 for 14 × 8.
    pub fn threshold(&self) -> f64 {
        (1.0 / self.bands as f64).powf(1.0 / self.rows as f64)
    }
}

/// Bytes of memory dedup holds for `documents` documents, besides the
/// documents in flight: 13 per document, plus one partition of signatures.
pub fn memory_bound(s: &DedupSettings, documents: u64) -> u64 {
    let per_doc = 13;
    let entries = documents * (s.bands as u64 + 1);
    documents * per_doc + entries * 16 / s.partitions as u64
}

/// What dedup needs of one document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signature {
    /// Hash of the text as it is: picks the kept document of a cluster.
    pub content: u64,
    /// Hash of the normalised text (exact duplicates share it).
    pub exact: u64,
    /// One key per band (empty for a text with no words).
    pub bands: Vec<u64>,
}

/// Lowercase, digits as 0, punctuation and symbols dropped, whitespace runs as one
/// space (datatrove's simplify_text, less its Unicode normalisation).
pub fn normalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut space = false;
    for c in text.chars() {
        if c.is_whitespace() {
            space = !out.is_empty();
            continue;
        }
        // Punctuation and symbols: the same sentence punctuated otherwise is the same text.
        if !c.is_alphanumeric() {
            continue;
        }
        if space {
            out.push(' ');
            space = false;
        }
        if c.is_numeric() {
            out.push('0');
        } else {
            out.extend(c.to_lowercase());
        }
    }
    out
}

/// The hash functions of one configuration.
pub struct MinHasher {
    s: DedupSettings,
    /// Multiply-shift hashing: h_i(x) = (a_i·x + b_i) >> 32, a_i odd.
    a: Vec<u64>,
    b: Vec<u64>,
}

impl MinHasher {
    pub fn new(s: &DedupSettings) -> MinHasher {
        let n = s.bands * s.rows;
        let a = (0..n as u64).map(|i| mix(s.seed ^ mix(2 * i + 1)) | 1).collect();
        let b = (0..n as u64).map(|i| mix(s.seed.rotate_left(17) ^ mix(2 * i + 2))).collect();
        MinHasher { s: s.clone(), a, b }
    }

    pub fn sign(&self, text: &str) -> Signature {
        let norm = normalize(text);
        let content = hash_bytes(text.as_bytes());
        let exact = hash_bytes(norm.as_bytes());
        if !self.s.near {
            return Signature { content, exact, bands: Vec::new() };
        }
        let words: Vec<u64> =
            norm.split(' ').filter(|w| !w.is_empty()).map(|w| hash_bytes(w.as_bytes())).collect();
        if words.is_empty() {
            return Signature { content, exact, bands: Vec::new() };
        }
        let n = self.a.len();
        let mut mins = vec![u32::MAX; n];
        let k = self.s.shingle.min(words.len());
        for g in words.windows(k) {
            let x = hash_seq(g);
            for ((m, &a), &b) in mins.iter_mut().zip(&self.a).zip(&self.b) {
                let h = (a.wrapping_mul(x).wrapping_add(b) >> 32) as u32;
                *m = (*m).min(h);
            }
        }
        let r = self.s.rows;
        let bands = (0..self.s.bands)
            .map(|j| {
                let mut key = Vec::with_capacity(r + 1);
                key.push(j as u64);
                key.extend(mins[j * r..(j + 1) * r].iter().map(|&m| m as u64));
                hash_seq(&key)
            })
            .collect();
        Signature { content, exact, bands }
    }
}

/// Signatures on their way to disk: (key, document) pairs in partition
/// files, exact keys apart from band keys.
pub struct Spill {
    dir: PathBuf,
    partitions: usize,
    exact: Vec<BufWriter<File>>,
    near: Vec<BufWriter<File>>,
    /// Each document's content hash, by document number.
    pub content: Vec<u64>,
}

fn part_of(key: u64, partitions: usize) -> usize {
    ((key as u128 * partitions as u128) >> 64) as usize
}

fn file_name(kind: &str, p: usize) -> String {
    format!("{kind}-{p:04}.sig")
}

impl Spill {
    pub fn new(dir: &Path, s: &DedupSettings) -> Result<Spill, DataError> {
        std::fs::create_dir_all(dir).map_err(|error| DataError::Io {
            path: dir.to_path_buf(),
            action: "create directory",
            error,
        })?;
        let open = |kind: &str| -> Result<Vec<BufWriter<File>>, DataError> {
            (0..s.partitions)
                .map(|p| {
                    let path = dir.join(file_name(kind, p));
                    File::create(&path)
                        .map(|f| BufWriter::with_capacity(64 << 10, f))
                        .map_err(|error| DataError::Io { path, action: "create", error })
                })
                .collect()
        };
        Ok(Spill {
            dir: dir.to_path_buf(),
            partitions: s.partitions,
            exact: if s.exact { open("exact")? } else { Vec::new() },
            near: if s.near { open("near")? } else { Vec::new() },
            content: Vec::new(),
        })
    }

    /// Adds the next document's signature; returns its number.
    pub fn add(&mut self, sig: &Signature) -> Result<u64, DataError> {
        let doc = self.content.len() as u64;
        if doc >= u32::MAX as u64 {
            return Err(DataError::Invalid {
                what: format!("dedup: more than {} documents in one prepare (split the corpus)", u32::MAX),
            });
        }
        self.content.push(sig.content);
        let dir = &self.dir;
        let write = |w: &mut BufWriter<File>, key: u64| {
            let mut e = [0u8; 16];
            e[..8].copy_from_slice(&key.to_le_bytes());
            e[8..].copy_from_slice(&doc.to_le_bytes());
            w.write_all(&e).map_err(|error| DataError::Io {
                path: dir.clone(),
                action: "write signatures",
                error,
            })
        };
        if !self.exact.is_empty() {
            let p = part_of(sig.exact, self.partitions);
            write(&mut self.exact[p], sig.exact)?;
        }
        if !self.near.is_empty() {
            for &k in &sig.bands {
                let p = part_of(k, self.partitions);
                write(&mut self.near[p], k)?;
            }
        }
        Ok(doc)
    }

    /// Every cluster resolved: which documents go, and why.
    pub fn resolve(mut self, pool: &rayon::ThreadPool) -> Result<Outcome, DataError> {
        let flush = |w: &mut BufWriter<File>, dir: &Path| {
            w.flush().map_err(|error| DataError::Io {
                path: dir.to_path_buf(),
                action: "write signatures",
                error,
            })
        };
        for w in self.exact.iter_mut().chain(self.near.iter_mut()) {
            flush(w, &self.dir)?;
        }
        let n = self.content.len();
        let content = std::mem::take(&mut self.content);
        let key = |d: u32| (content[d as usize], d);
        let mut removed = vec![Removal::Kept; n];
        if !self.exact.is_empty() {
            for p in 0..self.partitions {
                let entries = read_partition(&self.dir.join(file_name("exact", p)), pool)?;
                for run in entries.chunk_by(|x, y| x.0 == y.0).filter(|r| r.len() > 1) {
                    let keep = run.iter().map(|e| e.1).min_by_key(|&d| key(d)).expect("a run");
                    for e in run.iter().filter(|e| e.1 != keep) {
                        removed[e.1 as usize] = Removal::Exact;
                    }
                }
            }
        }
        if !self.near.is_empty() {
            let mut parent: Vec<u32> = (0..n as u32).collect();
            for p in 0..self.partitions {
                let entries = read_partition(&self.dir.join(file_name("near", p)), pool)?;
                for run in entries.chunk_by(|x, y| x.0 == y.0).filter(|r| r.len() > 1) {
                    let mut live = run.iter().map(|e| e.1).filter(|&d| removed[d as usize] == Removal::Kept);
                    let Some(first) = live.next() else { continue };
                    for d in live {
                        union(&mut parent, first, d, &key);
                    }
                }
            }
            for d in 0..n as u32 {
                if removed[d as usize] == Removal::Kept && find(&mut parent, d) != d {
                    removed[d as usize] = Removal::Near;
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(Outcome { removed })
    }
}

/// A partition's entries sorted by (key, document).
fn read_partition(path: &Path, pool: &rayon::ThreadPool) -> Result<Vec<(u64, u32)>, DataError> {
    let f = File::open(path).map_err(|error| DataError::Io { path: path.into(), action: "open", error })?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let mut out = Vec::new();
    let mut e = [0u8; 16];
    loop {
        match r.read_exact(&mut e) {
            Ok(()) => out.push((
                u64::from_le_bytes(e[..8].try_into().expect("8 bytes")),
                u64::from_le_bytes(e[8..].try_into().expect("8 bytes")) as u32,
            )),
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(error) => return Err(DataError::Io { path: path.into(), action: "read", error }),
        }
    }
    pool.install(|| {
        use rayon::slice::ParallelSliceMut;
        out.par_sort_unstable();
    });
    Ok(out)
}

fn find(parent: &mut [u32], mut x: u32) -> u32 {
    while parent[x as usize] != x {
        let up = parent[parent[x as usize] as usize];
        parent[x as usize] = up;
        x = up;
    }
    x
}

/// Joins the clusters of `a` and `b` under the root with the smaller key,
/// so every cluster's root is its kept document.
fn union(parent: &mut [u32], a: u32, b: u32, key: &impl Fn(u32) -> (u64, u32)) {
    let (ra, rb) = (find(parent, a), find(parent, b));
    if ra == rb {
        return;
    }
    if key(ra) < key(rb) {
        parent[rb as usize] = ra;
    } else {
        parent[ra as usize] = rb;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    Kept,
    Exact,
    Near,
}

/// Dedup's verdict on every document, by number.
pub struct Outcome {
    pub removed: Vec<Removal>,
}

impl Outcome {
    pub fn count(&self, r: Removal) -> u64 {
        self.removed.iter().filter(|&&x| x == r).count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap()
    }

    fn run(docs: &[String], s: &DedupSettings) -> Vec<Removal> {
        let dir = tempfile::tempdir().unwrap();
        let h = MinHasher::new(s);
        let mut spill = Spill::new(&dir.path().join("sig"), s).unwrap();
        for d in docs {
            spill.add(&h.sign(d)).unwrap();
        }
        spill.resolve(&pool()).unwrap().removed
    }

    /// A document of `n` words drawn from a seeded stream: unrelated
    /// documents share almost no 5-gram.
    fn doc(seed: u64, n: usize) -> Vec<String> {
        const VOCAB: [&str; 16] = [
            "river", "stone", "market", "winter", "garden", "letter", "window", "harbor", "silver", "forest",
            "engine", "candle", "meadow", "castle", "pepper", "lantern",
        ];
        (0..n as u64).map(|i| VOCAB[(mix(seed * 1_000_003 + i) % 16) as usize].to_string()).collect()
    }

    #[test]
    fn normalizing_ignores_case_punctuation_digits_and_spacing() {
        assert_eq!(normalize("  Hello,   World! 2024\n\tbye."), "hello world 0000 bye");
        assert_eq!(normalize("Ünïcödé — text"), "ünïcödé text");
    }

    #[test]
    fn exact_duplicates_up_to_normalisation_are_removed_keeping_the_smallest_hash() {
        let a = "The cat sat on the mat.".to_string();
        let b = "the CAT sat on the mat".to_string();
        let c = "A different document entirely.".to_string();
        let s = DedupSettings { near: false, ..Default::default() };
        let got = run(&[a.clone(), c.clone(), b.clone()], &s);
        let keep_a = hash_bytes(a.as_bytes()) < hash_bytes(b.as_bytes());
        let want = if keep_a {
            [Removal::Kept, Removal::Kept, Removal::Exact]
        } else {
            [Removal::Exact, Removal::Kept, Removal::Kept]
        };
        assert_eq!(got, want);
        // Listed the other way round, the same text is kept.
        let got = run(&[b, c, a], &s);
        assert_eq!(got[0] == Removal::Kept, !keep_a);
    }

    #[test]
    fn a_near_duplicate_with_one_word_in_a_hundred_changed_is_found_and_unrelated_documents_are_not() {
        let s = DedupSettings::default();
        let mut docs = Vec::new();
        for k in 0..40u64 {
            let words = doc(k, 400);
            docs.push(words.join(" "));
            if k % 2 == 0 {
                let mut near = words.clone();
                for i in (7..400).step_by(100) {
                    near[i] = "changed".into();
                }
                docs.push(near.join(" "));
            }
        }
        let got = run(&docs, &s);
        // Each pair leaves one; no unrelated document goes.
        assert_eq!(got.iter().filter(|&&r| r == Removal::Near).count(), 20);
        assert_eq!(got.iter().filter(|&&r| r == Removal::Exact).count(), 0);
        let mut at = 0;
        for k in 0..40u64 {
            if k % 2 == 0 {
                assert_eq!(
                    [got[at], got[at + 1]].iter().filter(|&&r| r == Removal::Kept).count(),
                    1,
                    "pair {k}"
                );
                at += 2;
            } else {
                assert_eq!(got[at], Removal::Kept, "unique {k}");
                at += 1;
            }
        }
    }

    #[test]
    fn the_kept_document_of_a_cluster_does_not_depend_on_the_order_documents_come_in() {
        let s = DedupSettings { partitions: 3, ..Default::default() };
        let base = doc(7, 300);
        let mut docs: Vec<String> = Vec::new();
        for v in 0..5 {
            let mut w = base.clone();
            w[10 + v * 40] = format!("variant{v}");
            docs.push(w.join(" "));
        }
        docs.push(doc(8, 300).join(" "));
        let kept = |docs: &[String]| -> Vec<String> {
            let r = run(docs, &s);
            let mut k: Vec<String> =
                docs.iter().zip(&r).filter(|(_, &r)| r == Removal::Kept).map(|(d, _)| d.clone()).collect();
            k.sort();
            k
        };
        let forward = kept(&docs);
        assert_eq!(forward.len(), 2);
        let mut rev = docs.clone();
        rev.reverse();
        assert_eq!(kept(&rev), forward);
        rev.rotate_left(2);
        assert_eq!(kept(&rev), forward);
    }

    #[test]
    fn the_memory_bound_is_per_document_and_settings_are_checked() {
        let s = DedupSettings::default();
        assert_eq!(memory_bound(&s, 1_000_000), 13_000_000 + 15_000_000);
        assert!((s.threshold() - 0.719).abs() < 1e-3);
        let bad = DedupSettings { bands: 0, partitions: 10_000, ..Default::default() };
        let p = bad.problems().join("\n");
        assert!(p.contains("dedup.bands: 0") && p.contains("dedup.partitions: 10000"), "{p}");
    }
}
