//! `pipewright bench --data`: the data pipeline's figures on a corpus it
//! generates — MB/s of read+clean, dedup, tokenize and the whole `prepare`,
//! peak memory, and dedup's recall of planted near-duplicates with the share
//! of unique documents it removed by mistake.
//!
//! Owns the benchmark corpus (seeded, so every run measures the same text)
//! and the ground truth planted in it. Never run by tests: it writes and
//! reads a gigabyte.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::clean::{CleanSettings, Cleaner, Verdict};
use super::dedup::{DedupSettings, MinHasher, Removal, Spill};
use super::hash::mix;
use super::read::{read_file, ReadSettings};
use super::token_file::DataError;
use super::tokenizer::Tokenizer;

/// What a generated document is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Planted {
    Unique,
    /// A copy of document i (up to case and punctuation).
    Exact(u32),
    /// Document i with about one word in fifty replaced.
    Near(u32),
    /// Text the filters should remove (repeated lines, lists, symbols).
    Junk,
}

/// A pseudo-word list with a Zipf-like frequency: the corpus reads like a
/// language to the filters and the tokenizer (stop words included).
fn lexicon() -> Vec<String> {
    let stop = ["the", "of", "and", "to", "a", "in", "that", "is", "was", "with", "for", "be", "have", "on"];
    let syll =
        ["ka", "lo", "mi", "ren", "sa", "tu", "ve", "dor", "an", "el", "is", "om", "pra", "quin", "ta", "ul"];
    let mut words: Vec<String> = stop.iter().map(|s| s.to_string()).collect();
    let mut i = 0u64;
    while words.len() < 6000 {
        let n = 1 + (mix(i) % 3) as usize;
        let w: String = (0..n).map(|k| syll[(mix(i * 7 + k as u64) % 16) as usize]).collect();
        words.push(w);
        i += 1;
    }
    words
}

struct Gen {
    words: Vec<String>,
}

impl Gen {
    fn word(&self, r: u64) -> &str {
        // Zipf-ish: squaring a uniform draw favours low ranks.
        let u = (r >> 11) as f64 / (1u64 << 53) as f64;
        &self.words[((u * u * u) * self.words.len() as f64) as usize]
    }

    fn unique(&self, seed: u64) -> String {
        let mut s = String::new();
        let paragraphs = 2 + mix(seed) % 5;
        let mut r = seed;
        for p in 0..paragraphs {
            if p > 0 {
                s.push_str("\n\n");
            }
            let sentences = 3 + mix(seed ^ p) % 6;
            for k in 0..sentences {
                if k > 0 {
                    s.push(' ');
                }
                let n = 8 + mix(seed ^ (p << 8) ^ k) % 14;
                for i in 0..n {
                    r = mix(r.wrapping_add(0x9E37_79B9_7F4A_7C15));
                    let w = self.word(r);
                    if i == 0 {
                        let mut c = w.chars();
                        if let Some(f) = c.next() {
                            s.extend(f.to_uppercase());
                            s.push_str(c.as_str());
                        }
                    } else {
                        s.push(' ');
                        s.push_str(w);
                    }
                    if i + 1 < n && mix(r).is_multiple_of(11) {
                        s.push(',');
                    }
                }
                s.push(if mix(r).is_multiple_of(9) { '?' } else { '.' });
            }
        }
        s
    }

    fn near(&self, base: &str, seed: u64) -> String {
        base.split(' ')
            .enumerate()
            .map(|(i, w)| if mix(seed ^ i as u64).is_multiple_of(50) { "altered" } else { w })
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn junk(&self, seed: u64) -> String {
        match mix(seed) % 3 {
            0 => "Home | About | Contact | Login\n".repeat(20),
            1 => (0..40).map(|i| format!("- item {} {}\n", i, self.word(mix(seed ^ i)))).collect(),
            _ => "#tag #sale #now !!! $$$ ".repeat(30),
        }
    }
}

/// Writes about `bytes` of documents as `files` jsonl.zst files in `dir`
/// (the last one parquet), with 4% exact and 4% near duplicates of earlier
/// documents and 4% junk; returns the files and each document's truth.
pub fn generate_corpus(
    dir: &Path,
    bytes: u64,
    files: usize,
) -> Result<(Vec<PathBuf>, Vec<Planted>), DataError> {
    std::fs::create_dir_all(dir).map_err(|error| DataError::Io {
        path: dir.into(),
        action: "create",
        error,
    })?;
    let g = Gen { words: lexicon() };
    let per_file = bytes / files as u64;
    let mut truth: Vec<Planted> = Vec::new();
    let mut texts_for_dups: Vec<(u32, String)> = Vec::new();
    let mut paths = Vec::new();
    let mut id = 0u64;
    for f in 0..files {
        let parquet = f + 1 == files;
        let path =
            dir.join(if parquet { format!("part-{f:03}.parquet") } else { format!("part-{f:03}.jsonl.zst") });
        let mut docs: Vec<String> = Vec::new();
        let mut written = 0u64;
        while written < per_file {
            let r = mix(id ^ 0xbe7c);
            let (text, kind) = match r % 100 {
                0..=3 if !texts_for_dups.is_empty() => {
                    let (i, t) = &texts_for_dups[(mix(r) % texts_for_dups.len() as u64) as usize];
                    (t.to_uppercase().replace('.', "!"), Planted::Exact(*i))
                }
                4..=7 if !texts_for_dups.is_empty() => {
                    let (i, t) = &texts_for_dups[(mix(r) % texts_for_dups.len() as u64) as usize];
                    (g.near(t, r), Planted::Near(*i))
                }
                8..=11 => (g.junk(r), Planted::Junk),
                _ => {
                    let t = g.unique(id);
                    // A bounded pool of originals to copy from (bounded memory).
                    if texts_for_dups.len() < 2000 {
                        texts_for_dups.push((id as u32, t.clone()));
                    } else if r.is_multiple_of(50) {
                        let k = (mix(r ^ 1) % 2000) as usize;
                        texts_for_dups[k] = (id as u32, t.clone());
                    }
                    (t, Planted::Unique)
                }
            };
            written += text.len() as u64;
            truth.push(kind);
            docs.push(text);
            id += 1;
        }
        if parquet {
            super::read::write_parquet(&path, "text", &docs, 10_000)?;
        } else {
            let file = std::fs::File::create(&path).map_err(|error| DataError::Io {
                path: path.clone(),
                action: "create",
                error,
            })?;
            let mut z = zstd::stream::write::Encoder::new(file, 1)
                .map_err(|error| DataError::Io { path: path.clone(), action: "zstd", error })?
                .auto_finish();
            for d in &docs {
                let line = serde_json::json!({ "text": d }).to_string();
                z.write_all(line.as_bytes())
                    .and_then(|_| z.write_all(b"\n"))
                    .map_err(|error| DataError::Io { path: path.clone(), action: "write", error })?;
            }
        }
        paths.push(path);
    }
    Ok((paths, truth))
}

/// The benchmark's figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DataBench {
    pub corpus_bytes: u64,
    pub documents: u64,
    pub threads: usize,
    pub read_clean_mb_s: f64,
    pub dedup_mb_s: f64,
    pub tokenize_mb_s: f64,
    pub prepare_mb_s: f64,
    /// The same steps in MB per CPU-second (user + system, all threads):
    /// what the step costs, whatever else the machine was running.
    pub read_clean_mb_cpu_s: f64,
    pub dedup_mb_cpu_s: f64,
    pub tokenize_mb_cpu_s: f64,
    pub prepare_mb_cpu_s: f64,
    /// Tokens the tokenize step produced (Python's count on the same file must match).
    pub tokens: u64,
    /// /proc/loadavg's 1-minute figure at the start and the end.
    pub load: (f64, f64),
    pub peak_rss_mb: f64,
    pub near_recall: f64,
    pub exact_recall: f64,
    pub unique_removed: f64,
    pub tokenize_file: PathBuf,
}

fn mb_s(bytes: u64, t: Instant) -> f64 {
    bytes as f64 / 1e6 / t.elapsed().as_secs_f64()
}

/// CPU seconds (user + system) of this process, or of its waited-for children.
fn cpu_seconds(children: bool) -> f64 {
    let who = if children { libc::RUSAGE_CHILDREN } else { libc::RUSAGE_SELF };
    // SAFETY: getrusage only writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(who, &mut u) } != 0 {
        return f64::NAN;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(f64::NAN)
}

fn all_texts(files: &[PathBuf]) -> Result<Vec<String>, DataError> {
    let mut out = Vec::new();
    let read = ReadSettings::default();
    for i in 0..files.len() {
        read_file(files, i, &read, &mut |d| {
            out.push(d.text("text").unwrap_or_default());
            Ok(())
        })?;
    }
    Ok(out)
}

/// Generates the corpus in `dir/corpus`, trains a `vocab`-token BPE
/// tokenizer on its first file (`dir/tokenizer.json`), then runs every stage
/// on `threads` threads. The whole `prepare` runs first, as a child process
/// of `exe` (this binary), so its peak memory is its own.
pub fn run(dir: &Path, bytes: u64, threads: usize, vocab: usize, exe: &Path) -> Result<DataBench, DataError> {
    use rayon::prelude::*;
    let out = dir;
    eprintln!("generating {:.0} MB of documents in {}", bytes as f64 / 1e6, dir.join("corpus").display());
    let (files, truth) = generate_corpus(&dir.join("corpus"), bytes, 8)?;
    let tok_path = dir.join("tokenizer.json");
    eprintln!("training a {vocab}-token tokenizer on {}", files[0].display());
    let settings = super::tokenizer::TrainSettings {
        vocab_size: vocab,
        special_tokens: vec!["<|endoftext|>".into()],
        pattern: super::tokenizer::SplitPattern::Gpt2,
        min_frequency: 2,
        show_progress: false,
    };
    super::prepare::train_tokenizer(
        &files[..1],
        &ReadSettings::default(),
        &settings,
        &tok_path,
        threads,
        true,
    )?;
    let tokenizer = Tokenizer::from_arg(tok_path.to_str().unwrap_or_default())?;
    let corpus_bytes: u64 = all_texts(&files)?.iter().map(|t| t.len() as u64).sum();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool");

    // The whole pipeline, as a user runs it.
    eprintln!("prepare --clean --dedup on {threads} threads");
    let load_start = load_average();
    let mb = corpus_bytes as f64 / 1e6;
    let c = cpu_seconds(true);
    let t = Instant::now();
    let status = std::process::Command::new(exe)
        .arg("prepare")
        .args(&files)
        .args(["--tokenizer", tok_path.to_str().unwrap_or_default(), "--clean", "--dedup"])
        .args(["--shard-tokens", "100000000", "--threads", &threads.to_string(), "--force", "--out"])
        .arg(out.join("prepared"))
        .status()
        .map_err(|error| DataError::Io { path: exe.into(), action: "run prepare", error })?;
    let prepare_mb_s = mb_s(corpus_bytes, t);
    let prepare_mb_cpu_s = mb / (cpu_seconds(true) - c);
    if !status.success() {
        return Err(DataError::Invalid { what: format!("bench: prepare failed ({status})") });
    }
    let peak_rss = children_peak_rss_bytes();
    let documents =
        super::shards::Manifest::read(&out.join("prepared"))?.counts["records"].as_u64().unwrap_or(0);

    eprintln!("read + clean");
    // Read + clean: the readers, then the filters over each batch in parallel.
    let c = cpu_seconds(false);
    let t = Instant::now();
    let cleaner = Cleaner::new(CleanSettings::default());
    let mut kept = 0u64;
    let read = ReadSettings::default();
    for i in 0..files.len() {
        let mut batch = Vec::new();
        let mut flush = |batch: &mut Vec<super::read::RawDoc>| {
            let n: u64 = pool.install(|| {
                std::mem::take(batch)
                    .into_par_iter()
                    .map(|d| {
                        d.text("text")
                            .map(|t| !matches!(cleaner.check(&t), Verdict::Drop(_)) as u64)
                            .unwrap_or(0)
                    })
                    .sum()
            });
            kept += n;
        };
        read_file(&files, i, &read, &mut |d| {
            batch.push(d);
            if batch.len() == 4096 {
                flush(&mut batch);
            }
            Ok(())
        })?;
        flush(&mut batch);
    }
    let read_clean_mb_s = mb_s(corpus_bytes, t);
    let read_clean_mb_cpu_s = mb / (cpu_seconds(false) - c);

    eprintln!("dedup");
    // Dedup alone, over the texts in memory: signatures in parallel, then clusters.
    let texts = all_texts(&files)?;
    let s = DedupSettings::default();
    let c = cpu_seconds(false);
    let t = Instant::now();
    let h = MinHasher::new(&s);
    let mut spill = Spill::new(&out.join("bench-dedup"), &s)?;
    for chunk in texts.chunks(8192) {
        let sigs: Vec<_> = pool.install(|| chunk.par_iter().map(|t| h.sign(t)).collect());
        for sig in &sigs {
            spill.add(sig)?;
        }
    }
    let removed = spill.resolve(&pool)?.removed;
    let dedup_mb_s = mb_s(corpus_bytes, t);
    let dedup_mb_cpu_s = mb / (cpu_seconds(false) - c);
    let (mut near, mut near_found, mut exact, mut exact_found, mut unique, mut unique_lost) =
        (0, 0, 0, 0, 0, 0);
    for (i, p) in truth.iter().enumerate() {
        match p {
            Planted::Near(j) => {
                near += 1;
                near_found += (removed[i] != Removal::Kept || removed[*j as usize] != Removal::Kept) as u64;
            }
            Planted::Exact(j) => {
                exact += 1;
                exact_found += (removed[i] != Removal::Kept || removed[*j as usize] != Removal::Kept) as u64;
            }
            Planted::Unique => {
                unique += 1;
                // Removed although nothing was planted against it, nor it against another.
                unique_lost += (removed[i] != Removal::Kept) as u64;
            }
            Planted::Junk => {}
        }
    }
    // Originals that had copies planted: their removal is right (one of the pair goes).
    let copied: std::collections::BTreeSet<u32> = truth
        .iter()
        .filter_map(|p| match p {
            Planted::Near(j) | Planted::Exact(j) => Some(*j),
            _ => None,
        })
        .collect();
    let wrongly = truth
        .iter()
        .enumerate()
        .filter(|(i, p)| {
            **p == Planted::Unique && !copied.contains(&(*i as u32)) && removed[*i] != Removal::Kept
        })
        .count() as u64;
    let _ = unique_lost;
    let unique_uncopied = truth
        .iter()
        .enumerate()
        .filter(|(i, p)| **p == Planted::Unique && !copied.contains(&(*i as u32)))
        .count() as u64;

    // Tokenize alone, over the texts as lines (newlines as spaces), the
    // very file the Python side reads.
    let lines: Vec<String> = texts.iter().map(|t| t.replace('\n', " ")).collect();
    drop(texts);
    let tokenize_file = out.join("tokenize-bench.txt");
    {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(&tokenize_file).map_err(|error| DataError::Io {
                path: tokenize_file.clone(),
                action: "create",
                error,
            })?,
        );
        for t in &lines {
            f.write_all(t.as_bytes()).and_then(|_| f.write_all(b"\n")).map_err(|error| DataError::Io {
                path: tokenize_file.clone(),
                action: "write",
                error,
            })?;
        }
    }
    eprintln!("tokenize");
    let c = cpu_seconds(false);
    let t = Instant::now();
    let n: usize =
        pool.install(|| lines.par_iter().map(|t| tokenizer.encode(t).map(|v| v.len()).unwrap_or(0)).sum());
    let tokenize_mb_s = mb_s(corpus_bytes, t);
    let tokenize_mb_cpu_s = mb / (cpu_seconds(false) - c);
    let _ = (kept, unique);

    Ok(DataBench {
        corpus_bytes,
        documents,
        threads,
        read_clean_mb_s,
        dedup_mb_s,
        tokenize_mb_s,
        prepare_mb_s,
        read_clean_mb_cpu_s,
        dedup_mb_cpu_s,
        tokenize_mb_cpu_s,
        prepare_mb_cpu_s,
        load: (load_start, load_average()),
        tokens: n as u64,
        peak_rss_mb: peak_rss as f64 / 1e6,
        near_recall: near_found as f64 / near.max(1) as f64,
        exact_recall: exact_found as f64 / exact.max(1) as f64,
        unique_removed: wrongly as f64 / unique_uncopied.max(1) as f64,
        tokenize_file,
    })
}

/// The largest peak memory of the child processes waited for so far.
fn children_peak_rss_bytes() -> u64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) } == 0 {
        u.ru_maxrss as u64 * 1024
    } else {
        0
    }
}

/// The figures as the table `bench --data` prints.
pub fn table(b: &DataBench) -> String {
    let mut t = format!(
        "corpus: {:.0} MB of text, {} documents (4% exact, 4% near duplicates, 4% junk planted), {} threads, \
         load average {:.1} → {:.1}\n{:<34}{:>12}{:>16}\n",
        b.corpus_bytes as f64 / 1e6,
        b.documents,
        b.threads,
        b.load.0,
        b.load.1,
        "",
        "MB/s (wall)",
        "MB per CPU-s"
    );
    for (name, wall, cpu) in [
        ("read + clean", b.read_clean_mb_s, b.read_clean_mb_cpu_s),
        ("dedup (exact + MinHash LSH)", b.dedup_mb_s, b.dedup_mb_cpu_s),
        ("tokenize", b.tokenize_mb_s, b.tokenize_mb_cpu_s),
        ("prepare --clean --dedup (whole)", b.prepare_mb_s, b.prepare_mb_cpu_s),
    ] {
        t += &format!("{name:<34}{wall:>12.1}{cpu:>16.1}\n");
    }
    t += &format!(
        "{:<34}{:>12.0} MB\n{:<34}{:>12.4}\n{:<34}{:>12.4}\n{:<34}{:>12.5}\n",
        "peak RSS of prepare",
        b.peak_rss_mb,
        "near-duplicate recall",
        b.near_recall,
        "exact-duplicate recall",
        b.exact_recall,
        "unique documents removed (share)",
        b.unique_removed,
    );
    t += &format!("tokens from the tokenize step: {}\n", b.tokens);
    t
}
