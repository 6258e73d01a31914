//! `pipewright prepare`: corpus files → a prepared dataset (llm.c token
//! shards and a manifest), through read → clean → deduplicate → tokenize →
//! shard, as datatrove arranges FineWeb's pipeline.
//!
//! Owns the order of the steps, their parallelism and the guarantee that
//! makes them safe to run on many threads: documents are read by one thread
//! in a fixed order (files as given, folders in name order), processed in
//! batches by a pool whose results are taken back in that order, and
//! written by one thread. So the same inputs and settings give the same
//! bytes on any number of threads; nothing that varies (threads, time)
//! enters the manifest.
//!
//! Two passes over the documents' tokens: the first filters, signs,
//! tokenizes and spools tokens to disk, the second (once duplicates and the
//! total are known) writes the shards, the last `val_fraction` of the tokens
//! going to val. Memory holds one batch of documents in flight, ~21 bytes per
//! document (token and character counts, dedup's state) and one dedup
//! partition: bounded by the number of documents, not their size.
//!
//! Never downloads anything, and never overwrites an earlier dataset unless
//! asked to; an interrupted prepare leaves only its work folder
//! ([`PARTIAL_DIR`]), which the next one removes, saying so.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use super::clean::{CleanSettings, Cleaner, Verdict};
use super::dedup::{DedupSettings, MinHasher, Removal, Signature, Spill};
use super::read::{read_file, RawDoc, ReadSettings};
use super::shards::{InputEntry, Manifest, ShardWriter, MANIFEST_FILE, MANIFEST_FORMAT, PARTIAL_DIR};
use super::token_file::DataError;
use super::tokenizer::Tokenizer;

/// The validation share `prepare` uses unless told otherwise.
pub const DEFAULT_VAL_FRACTION: f64 = 0.1;

/// Everything about a prepare but its inputs, tokenizer and output folder.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareOptions {
    pub read: ReadSettings,
    /// Quality filters; None: off.
    pub clean: Option<CleanSettings>,
    /// Deduplication; None: off.
    pub dedup: Option<DedupSettings>,
    /// Share of the tokens, from the end, written as val.
    pub val_fraction: f64,
    /// Tokens per shard; 0 writes one `train.bin` (and `val.bin`).
    pub shard_tokens: u64,
    /// Worker threads; 0: one per core. Changes no output byte.
    pub threads: usize,
    /// Replace an earlier dataset in the output folder.
    pub force: bool,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions {
            read: ReadSettings::default(),
            clean: None,
            dedup: None,
            val_fraction: DEFAULT_VAL_FRACTION,
            shard_tokens: 0,
            threads: 0,
            force: false,
            progress: false,
        }
    }
}

/// A prepare config file (`prepare --config`): the reader's keys and
/// shard size at the top, and a `[clean]` or `[dedup]` table that turns
/// that step on with its settings.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepareConfig {
    pub text_field: Option<String>,
    pub skip_bad_lines: Option<bool>,
    pub val_fraction: Option<f64>,
    pub shard_tokens: Option<u64>,
    pub clean: Option<CleanSettings>,
    pub dedup: Option<DedupSettings>,
}

impl PrepareConfig {
    pub fn load(path: &Path) -> Result<PrepareConfig, DataError> {
        let text = crate::fsutil::read_regular_to_string(
            path,
            crate::fsutil::MAX_CONFIG_BYTES,
            "a config file may hold",
        )
        .map_err(|error| DataError::Io { path: path.to_path_buf(), action: "read", error })?;
        let de = toml::Deserializer::parse(&text).map_err(|e| DataError::Invalid {
            what: format!("{}: {}", path.display(), e.to_string().trim_end()),
        })?;
        serde_path_to_error::deserialize(de).map_err(|e| DataError::Invalid {
            what: format!("{}: {}: {}", path.display(), e.path(), e.inner().to_string().trim_end()),
        })
    }

    /// The options this config gives over `base` (the command line's).
    pub fn apply(self, mut base: PrepareOptions) -> PrepareOptions {
        if let Some(f) = self.text_field {
            base.read.text_field = f;
        }
        if let Some(s) = self.skip_bad_lines {
            base.read.skip_bad_lines = s;
        }
        if let Some(v) = self.val_fraction {
            base.val_fraction = v;
        }
        if let Some(n) = self.shard_tokens {
            base.shard_tokens = n;
        }
        if self.clean.is_some() {
            base.clean = self.clean;
        }
        if self.dedup.is_some() {
            base.dedup = self.dedup;
        }
        base
    }
}

/// What `prepare` wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareReport {
    /// Documents read (records: files, lines, rows).
    pub documents: usize,
    pub tokenizer: Tokenizer,
    /// Put this in `model.vocab_size`.
    pub vocab_size: usize,
    /// The first train shard.
    pub train_path: PathBuf,
    pub train_tokens: usize,
    /// The first val shard; `None` when `val_fraction` is 0.
    pub val_path: Option<PathBuf>,
    pub val_tokens: usize,
    /// Files reached twice (through links) and read once, an earlier
    /// interrupted prepare cleared away: in words (each also logged).
    pub warnings: Vec<String>,
    pub manifest: Manifest,
}

/// [`prepare_all`] for one text file.
pub fn prepare(
    input: &Path,
    tokenizer: Tokenizer,
    out_dir: &Path,
    val_fraction: f64,
    force: bool,
) -> Result<PrepareReport, DataError> {
    prepare_all(&[input.to_path_buf()], tokenizer, out_dir, val_fraction, force)
}

/// [`run`] with every step but tokenizing off: each file one document
/// (text files) or one a line or row, GPT-2's end-of-text token between
/// documents (bytes have none), one `train.bin` and (unless `val_fraction`
/// is 0) one `val.bin`.
///
/// With `Bytes` the input may be any bytes; with other tokenizers it must be
/// UTF-8. A literal `<|endoftext|>` in the text is tokenized as characters,
/// not as the special token, as nanoGPT's scripts do.
pub fn prepare_all(
    inputs: &[PathBuf],
    tokenizer: Tokenizer,
    out_dir: &Path,
    val_fraction: f64,
    force: bool,
) -> Result<PrepareReport, DataError> {
    let o = PrepareOptions { val_fraction, force, ..Default::default() };
    run(inputs, &tokenizer, out_dir, &o)
}

/// The files `inputs` name: files as given, folders' regular files in name
/// order (subfolders too, hidden entries skipped), so a folder always gives
/// the same token stream.
///
/// Symlinks are followed, but each folder is walked once and each file read
/// once, by (device, inode): `ln -s . self` would otherwise read the folder
/// again at every level until paths grow too long (two such links: 2^40
/// paths), and a file linked under two names would count twice. A file
/// reached again is skipped with a warning naming both paths.
fn documents(inputs: &[PathBuf]) -> Result<(Vec<PathBuf>, Vec<String>), DataError> {
    let mut walk = Walk::default();
    for input in inputs {
        if input.is_dir() {
            let before = walk.files.len();
            walk.folder(input)?;
            if walk.files.len() == before {
                return Err(DataError::Invalid {
                    what: format!("folder {}: holds no files not already read", input.display()),
                });
            }
        } else {
            walk.file(input)?;
        }
    }
    if walk.files.is_empty() {
        return Err(DataError::Invalid { what: "prepare: no input files given".into() });
    }
    Ok((walk.files, walk.warnings))
}

/// Where `documents` has been: folders and files by (device, inode), with
/// the first path each was reached by.
#[derive(Default)]
struct Walk {
    folders: std::collections::HashSet<(u64, u64)>,
    seen: std::collections::HashMap<(u64, u64), PathBuf>,
    files: Vec<PathBuf>,
    warnings: Vec<String>,
}

impl Walk {
    fn id(path: &Path, action: &'static str) -> Result<(u64, u64), DataError> {
        use std::os::unix::fs::MetadataExt;
        let m =
            fs::metadata(path).map_err(|error| DataError::Io { path: path.to_path_buf(), action, error })?;
        Ok((m.dev(), m.ino()))
    }

    /// A file to read, unless it was reached before (then a warning). A path
    /// that is not there is kept so that reading it names it.
    fn file(&mut self, path: &Path) -> Result<(), DataError> {
        if !path.exists() {
            self.files.push(path.to_path_buf());
            return Ok(());
        }
        let id = Self::id(path, "stat")?;
        match self.seen.get(&id) {
            Some(first) => {
                let w = format!("{}: the same file as {}: read once", path.display(), first.display());
                tracing::warn!("{w}");
                self.warnings.push(w);
            }
            None => {
                self.seen.insert(id, path.to_path_buf());
                self.files.push(path.to_path_buf());
            }
        }
        Ok(())
    }

    fn folder(&mut self, dir: &Path) -> Result<(), DataError> {
        // A folder reached again (through a link to itself or an ancestor,
        // or a second link to it) holds nothing not already listed.
        if !self.folders.insert(Self::id(dir, "list")?) {
            return Ok(());
        }
        let io = |error| DataError::Io { path: dir.to_path_buf(), action: "list", error };
        let mut entries: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(io)?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()
            .map_err(io)?;
        entries.sort();
        for p in entries {
            if p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
                continue;
            }
            if p.is_dir() {
                self.folder(&p)?;
            } else if p.is_file() {
                self.file(&p)?;
            }
        }
        Ok(())
    }
}

/// Records handed from the reader to the workers at a time (at most).
const BATCH_DOCS: usize = 4096;
const BATCH_BYTES: usize = 8 << 20;

/// One record after the parallel steps.
enum Processed {
    /// A record that holds no document (a bad JSON line, say): skipped and
    /// counted under `--skip-bad-lines`, else an error naming it.
    Bad(super::read::BadRecord),
    Dropped {
        filter: &'static str,
        chars: u64,
    },
    Kept {
        tokens: Vec<u32>,
        sig: Option<Signature>,
        chars_before: u64,
        chars: u64,
        trimmed: bool,
    },
}

/// What every worker applies to a record.
struct Steps<'a> {
    tok: &'a Tokenizer,
    read: &'a ReadSettings,
    cleaner: Option<Cleaner>,
    hasher: Option<MinHasher>,
}

impl Steps<'_> {
    /// Bytes become tokens as they are (any bytes, as `prepare` always took)
    /// when nothing needs the text as text.
    fn raw_bytes(&self) -> bool {
        matches!(self.tok, Tokenizer::Bytes) && self.cleaner.is_none() && self.hasher.is_none()
    }

    fn process(&self, d: RawDoc) -> Result<Processed, DataError> {
        if self.raw_bytes() && !d.json {
            let chars = d.body.len() as u64;
            let tokens = d.body.into_iter().map(u32::from).collect();
            return Ok(Processed::Kept { tokens, sig: None, chars_before: chars, chars, trimmed: false });
        }
        let text = match d.text(&self.read.text_field) {
            Ok(t) => t,
            Err(bad) => return Ok(Processed::Bad(bad)),
        };
        let chars_before = text.chars().count() as u64;
        let (text, trimmed) = match self.cleaner.as_ref().map(|c| c.check(&text)) {
            None | Some(Verdict::Keep) => (text, false),
            Some(Verdict::Trimmed(t)) => (t, true),
            Some(Verdict::Drop(filter)) => return Ok(Processed::Dropped { filter, chars: chars_before }),
        };
        let chars = if trimmed { text.chars().count() as u64 } else { chars_before };
        let sig = self.hasher.as_ref().map(|h| h.sign(&text));
        let tokens = self.tok.encode(&text)?;
        Ok(Processed::Kept { tokens, sig, chars_before, chars, trimmed })
    }
}

/// Document lengths in characters, by powers of two: bucket k holds
/// lengths in [2^k, 2^(k+1)), bucket 0 also the empty ones.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LengthHistogram {
    pub before: Vec<u64>,
    pub after: Vec<u64>,
}

impl LengthHistogram {
    fn bucket(chars: u64) -> usize {
        (63 - chars.max(1).leading_zeros()) as usize
    }

    fn add(v: &mut Vec<u64>, chars: u64) {
        let b = Self::bucket(chars);
        if v.len() <= b {
            v.resize(b + 1, 0);
        }
        v[b] += 1;
    }
}

/// Tallies of the first pass, in the order records came.
#[derive(Default)]
struct Tally {
    records: u64,
    bad: BTreeMap<String, u64>,
    removed: BTreeMap<String, u64>,
    trimmed: u64,
    empty: u64,
    histogram: LengthHistogram,
    /// Per document that reached dedup: tokens and characters.
    doc_tokens: Vec<u32>,
    doc_chars: Vec<u32>,
}

fn io<'a>(path: &'a Path, action: &'static str) -> impl Fn(std::io::Error) -> DataError + 'a {
    move |error| DataError::Io { path: path.to_path_buf(), action, error }
}

/// Is `name` one of the files a prepared dataset consists of?
fn is_dataset_file(name: &str) -> bool {
    name == MANIFEST_FILE
        || ((name.starts_with("train") || name.starts_with("val")) && name.ends_with(".bin"))
}

/// The earlier dataset's files in `out_dir`, sorted.
fn earlier_outputs(out_dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let Ok(entries) = fs::read_dir(out_dir) else { return Ok(Vec::new()) };
    let mut found = Vec::new();
    for e in entries {
        let e = e.map_err(io(out_dir, "list"))?;
        if is_dataset_file(&e.file_name().to_string_lossy()) {
            found.push(e.path());
        }
    }
    // A shard named first (then the manifest): "train.bin already exists"
    // is what a user of the single-file layout looks for.
    found.sort_by_key(|p| (p.file_name().is_some_and(|n| n == MANIFEST_FILE), p.clone()));
    Ok(found)
}

/// Reads, cleans, deduplicates and tokenizes `inputs` into a prepared
/// dataset in `out_dir` (shards, `manifest.json`, and the tokenizer's
/// `tokenizer.json` when it has one). Refuses an `out_dir` that holds an
/// earlier dataset unless `o.force`; bad settings and bad input are refused
/// before any output is replaced.
pub fn run(
    inputs: &[PathBuf],
    tok: &Tokenizer,
    out_dir: &Path,
    o: &PrepareOptions,
) -> Result<PrepareReport, DataError> {
    if !(0.0..1.0).contains(&o.val_fraction) {
        return Err(DataError::Invalid {
            what: format!("val_fraction: got {}, expected a number in [0, 1)", o.val_fraction),
        });
    }
    let mut problems: Vec<String> = Vec::new();
    problems.extend(o.clean.iter().flat_map(CleanSettings::problems));
    problems.extend(o.dedup.iter().flat_map(DedupSettings::problems));
    if !problems.is_empty() {
        return Err(DataError::Invalid { what: problems.join("\n") });
    }
    if !o.force {
        // Checked before anything is written, so a refusal changes nothing.
        if let Some(first) = earlier_outputs(out_dir)?.into_iter().next() {
            return Err(DataError::OutputExists { path: first });
        }
    }
    let (files, mut warnings) = documents(inputs)?;
    let partial = out_dir.join(PARTIAL_DIR);
    let created = !out_dir.exists();
    if partial.exists() {
        let w = format!(
            "{}: an earlier prepare into {} was interrupted; starting clean",
            partial.display(),
            out_dir.display()
        );
        tracing::warn!("{w}");
        warnings.push(w);
        fs::remove_dir_all(&partial).map_err(io(&partial, "remove"))?;
    }
    fs::create_dir_all(&partial).map_err(io(&partial, "create directory"))?;
    let result = run_in(&files, tok, out_dir, &partial, o, warnings);
    if result.is_err() {
        let _ = fs::remove_dir_all(&partial);
        if created {
            let _ = fs::remove_dir(out_dir);
        }
    }
    result
}

fn run_in(
    files: &[PathBuf],
    tok: &Tokenizer,
    out_dir: &Path,
    partial: &Path,
    o: &PrepareOptions,
    warnings: Vec<String>,
) -> Result<PrepareReport, DataError> {
    let threads = if o.threads == 0 { crate::host::thread_count(0) } else { o.threads };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("prepare-{i}"))
        .build()
        .map_err(|e| DataError::Invalid { what: format!("prepare: cannot start {threads} threads: {e}") })?;
    let steps = Steps {
        tok,
        read: &o.read,
        cleaner: o.clean.clone().map(Cleaner::new),
        hasher: o.dedup.as_ref().filter(|d| d.exact || d.near).map(MinHasher::new),
    };
    let spool_path = partial.join("tokens.spool");
    let mut spool =
        BufWriter::with_capacity(1 << 20, fs::File::create(&spool_path).map_err(io(&spool_path, "create"))?);
    let mut spill = match &o.dedup {
        Some(d) if d.exact || d.near => Some(Spill::new(&partial.join("dedup"), d)?),
        _ => None,
    };
    let mut tally = Tally::default();
    let bar = o.progress.then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {elapsed} {pos} documents {msg}")
                .expect("a fixed template"),
        );
        b
    });

    // Pass 1: one reader thread, the pool over each batch, results in order.
    let (send, recv) = crossbeam_channel::bounded::<Vec<RawDoc>>(2);
    let inputs = std::thread::scope(|scope| -> Result<Vec<InputEntry>, DataError> {
        let reader = scope.spawn(|| read_all(files, &o.read, send));
        let mut bytes_read = 0u64;
        for batch in recv.iter() {
            bytes_read += batch.iter().map(|d| d.body.len() as u64).sum::<u64>();
            let places: Vec<(u32, u64)> = batch.iter().map(|d| (d.file, d.line)).collect();
            let out: Vec<Result<Processed, DataError>> = pool.install(|| {
                use rayon::prelude::*;
                batch.into_par_iter().map(|d| steps.process(d)).collect()
            });
            for (p, (file, line)) in out.into_iter().zip(places) {
                tally.records += 1;
                match p? {
                    Processed::Bad(bad) => {
                        let place = RawDoc { file, line, body: Vec::new(), json: false }.place(files);
                        if !o.read.skip_bad_lines {
                            return Err(match bad {
                                super::read::BadRecord::NotUtf8(offset) if line == 0 => {
                                    DataError::NotUtf8 { path: files[file as usize].clone(), offset }
                                }
                                _ => DataError::Invalid {
                                    what: format!(
                                        "{place}: {} (--skip-bad-lines skips and counts such records)",
                                        bad.describe(&o.read.text_field)
                                    ),
                                },
                            });
                        }
                        *tally.bad.entry(bad.counter().to_string()).or_default() += 1;
                    }
                    Processed::Dropped { filter, chars } => {
                        LengthHistogram::add(&mut tally.histogram.before, chars);
                        *tally.removed.entry(filter.to_string()).or_default() += 1;
                    }
                    Processed::Kept { tokens, sig, chars_before, chars, trimmed } => {
                        LengthHistogram::add(&mut tally.histogram.before, chars_before);
                        tally.trimmed += trimmed as u64;
                        if tokens.is_empty() {
                            tally.empty += 1;
                            continue;
                        }
                        let n = u32::try_from(tokens.len()).map_err(|_| DataError::Invalid {
                            what: format!(
                                "{}: a document of {} tokens (at most {} per document)",
                                RawDoc { file, line, body: Vec::new(), json: false }.place(files),
                                tokens.len(),
                                u32::MAX
                            ),
                        })?;
                        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
                        spool.write_all(&bytes).map_err(io(&spool_path, "write"))?;
                        tally.doc_tokens.push(n);
                        tally.doc_chars.push(chars.min(u32::MAX as u64) as u32);
                        if let (Some(spill), Some(sig)) = (spill.as_mut(), sig) {
                            spill.add(&sig)?;
                        }
                    }
                }
            }
            if let Some(b) = &bar {
                b.set_position(tally.records);
                b.set_message(format!("{:.1} MB read", bytes_read as f64 / 1e6));
            }
        }
        reader.join().expect("the reader thread does not panic")
    })?;
    spool.flush().map_err(io(&spool_path, "write"))?;
    drop(spool);
    if let Some(b) = &bar {
        b.set_message("resolving duplicates");
    }

    let removed: Vec<Removal> = match spill {
        Some(s) => s.resolve(&pool)?.removed,
        None => vec![Removal::Kept; tally.doc_tokens.len()],
    };
    let count = |r: Removal| removed.iter().filter(|&&x| x == r).count() as u64;

    // Pass 2: the kept documents' tokens into shards.
    let sep = tok.end_of_text();
    let kept_docs = count(Removal::Kept);
    let kept_tokens: u64 = tally
        .doc_tokens
        .iter()
        .zip(&removed)
        .filter(|(_, &r)| r == Removal::Kept)
        .map(|(&n, _)| n as u64)
        .sum::<u64>()
        + if sep.is_some() { kept_docs.saturating_sub(1) } else { 0 };
    let n_val = (kept_tokens as f64 * o.val_fraction).round() as u64;
    let n_train = kept_tokens - n_val;
    if n_train == 0 || (o.val_fraction > 0.0 && n_val == 0) {
        let input = match files {
            [one] => one.display().to_string(),
            many => format!("{} input files", many.len()),
        };
        let why = if kept_docs == 0 {
            "no document was kept: every one was empty or removed by the filters (--clean) or \
             deduplication (--dedup)"
                .to_string()
        } else {
            format!("{kept_tokens} tokens cannot be split into non-empty train and val parts with val_fraction {}", o.val_fraction)
        };
        return Err(DataError::Invalid { what: format!("{input}: {why}") });
    }
    if let Some(b) = &bar {
        b.set_message("writing shards");
    }
    let vocab = tok.vocab_size();
    let mut train = ShardWriter::new(partial, out_dir, "train", o.shard_tokens, vocab);
    let mut val = ShardWriter::new(partial, out_dir, "val", o.shard_tokens, vocab);
    let mut r =
        BufReader::with_capacity(1 << 20, fs::File::open(&spool_path).map_err(io(&spool_path, "open"))?);
    let (mut emitted, mut first) = (0u64, true);
    let mut buf: Vec<u8> = Vec::new();
    let mut doc: Vec<u32> = Vec::new();
    for (i, &n) in tally.doc_tokens.iter().enumerate() {
        buf.resize(n as usize * 4, 0);
        r.read_exact(&mut buf).map_err(io(&spool_path, "read"))?;
        if removed[i] != Removal::Kept {
            continue;
        }
        LengthHistogram::add(&mut tally.histogram.after, tally.doc_chars[i] as u64);
        doc.clear();
        if !first {
            doc.extend(sep);
        }
        first = false;
        doc.extend(buf.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))));
        let to_train = (n_train.saturating_sub(emitted) as usize).min(doc.len());
        if to_train > 0 {
            train.start_document()?;
            train.push(&doc[..to_train])?;
        }
        if to_train < doc.len() {
            if to_train == 0 {
                val.start_document()?;
            }
            val.push(&doc[to_train..])?;
        }
        emitted += doc.len() as u64;
    }
    let train = train.finish()?;
    let val = val.finish()?;

    let mut counts = serde_json::Map::new();
    counts.insert("records".into(), tally.records.into());
    counts.insert("bad_records".into(), serde_json::to_value(&tally.bad).expect("plain JSON"));
    counts.insert("removed_by_filter".into(), serde_json::to_value(&tally.removed).expect("plain JSON"));
    counts.insert("trimmed_by_c4".into(), tally.trimmed.into());
    counts.insert("empty".into(), tally.empty.into());
    counts.insert("exact_duplicates".into(), count(Removal::Exact).into());
    counts.insert("near_duplicates".into(), count(Removal::Near).into());
    counts.insert("documents_kept".into(), kept_docs.into());
    counts.insert("train_tokens".into(), n_train.into());
    counts.insert("val_tokens".into(), n_val.into());
    counts.insert("length_histogram".into(), serde_json::to_value(&tally.histogram).expect("plain JSON"));
    let settings = serde_json::json!({
        "read": o.read,
        "clean": o.clean,
        "dedup": o.dedup,
        "val_fraction": o.val_fraction,
        "shard_tokens": o.shard_tokens,
    });
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        inputs,
        tokenizer: tok.describe(),
        tokenizer_hash: tok.hash(),
        vocab_size: vocab,
        separator: sep,
        settings,
        counts: serde_json::Value::Object(counts),
        train,
        val,
    };
    publish(out_dir, partial, tok, &manifest)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(PrepareReport {
        documents: tally.records as usize,
        tokenizer: tok.clone(),
        vocab_size: vocab,
        train_path: out_dir.join(&manifest.train[0].file),
        train_tokens: n_train as usize,
        val_path: manifest.val.first().map(|s| out_dir.join(&s.file)),
        val_tokens: n_val as usize,
        warnings,
        manifest,
    })
}

/// Moves the finished shards into `out_dir` and writes the manifest last.
/// The earlier dataset's manifest goes first, so that at no moment does the
/// folder's manifest name shards of two different prepares.
fn publish(out_dir: &Path, partial: &Path, tok: &Tokenizer, manifest: &Manifest) -> Result<(), DataError> {
    let old_manifest = out_dir.join(MANIFEST_FILE);
    if old_manifest.exists() {
        fs::remove_file(&old_manifest).map_err(io(&old_manifest, "remove"))?;
    }
    for p in earlier_outputs(out_dir)? {
        fs::remove_file(&p).map_err(io(&p, "remove"))?;
    }
    for name in [super::tokenizer::TOKENIZER_FILE, super::tokenizer::TOKENIZER_CONFIG_FILE] {
        let p = out_dir.join(name);
        if p.exists() {
            fs::remove_file(&p).map_err(io(&p, "remove"))?;
        }
    }
    for s in manifest.train.iter().chain(&manifest.val) {
        let to = out_dir.join(&s.file);
        fs::rename(partial.join(&s.file), &to).map_err(io(&to, "move into place"))?;
    }
    super::tokenizer::save_beside(tok, out_dir)?;
    let mut text = serde_json::to_string_pretty(manifest).expect("plain JSON");
    text.push('\n');
    super::shards::write_atomic(&old_manifest, text.as_bytes())?;
    fs::remove_dir_all(partial).map_err(io(partial, "remove"))?;
    if let Ok(d) = fs::File::open(out_dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The reader thread: every file's hash, then its records in batches.
fn read_all(
    files: &[PathBuf],
    settings: &ReadSettings,
    send: crossbeam_channel::Sender<Vec<RawDoc>>,
) -> Result<Vec<InputEntry>, DataError> {
    let mut entries = Vec::with_capacity(files.len());
    let mut batch: Vec<RawDoc> = Vec::with_capacity(BATCH_DOCS);
    let mut bytes = 0usize;
    // The workers stopped (an error of theirs is the one reported).
    let gone = || DataError::Invalid { what: "prepare: stopped".into() };
    for (i, path) in files.iter().enumerate() {
        let (size, hash) = hash_file(path)?;
        let (format, compression) = super::read::format_of(path);
        let format = match compression {
            super::read::Compression::None => format!("{format:?}").to_lowercase(),
            c => format!("{format:?}+{c:?}").to_lowercase(),
        };
        entries.push(InputEntry { path: path.display().to_string(), bytes: size, blake3: hash, format });
        read_file(files, i, settings, &mut |d| {
            bytes += d.body.len();
            batch.push(d);
            if batch.len() >= BATCH_DOCS || bytes >= BATCH_BYTES {
                bytes = 0;
                send.send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH_DOCS)))
                    .map_err(|_| gone())?;
            }
            Ok(())
        })?;
    }
    if !batch.is_empty() {
        send.send(batch).map_err(|_| gone())?;
    }
    Ok(entries)
}

/// A file's size and blake3 (hex); a FIFO or device is refused by name.
fn hash_file(path: &Path) -> Result<(u64, String), DataError> {
    let mut f = crate::fsutil::open_regular(path).map_err(|error| {
        if error.kind() == std::io::ErrorKind::NotFound {
            DataError::Invalid { what: format!("text file {}: no such file", path.display()) }
        } else {
            DataError::Io { path: path.to_path_buf(), action: "read", error }
        }
    })?;
    let mut h = blake3::Hasher::new();
    let size = std::io::copy(&mut f, &mut h).map_err(io(path, "read"))?;
    Ok((size, h.finalize().to_hex().to_string()))
}

/// What `tokenizer train` wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrainedTokenizer {
    pub documents: u64,
    pub path: PathBuf,
    pub vocab_size: usize,
    /// blake3 of the file, hex.
    pub hash: String,
}

/// `pipewright tokenizer train`: byte-level BPE over the documents of
/// `inputs` (read as `prepare` reads them), saved as `out` (or
/// `out/tokenizer.json` when `out` is a folder). Refuses an existing file
/// unless `force`. The file depends on the documents and settings only, not
/// on `threads`.
pub fn train_tokenizer(
    inputs: &[PathBuf],
    read: &ReadSettings,
    s: &super::tokenizer::TrainSettings,
    out: &Path,
    threads: usize,
    force: bool,
) -> Result<TrainedTokenizer, DataError> {
    s.check()?;
    let path = if out.is_dir() { out.join(super::tokenizer::TOKENIZER_FILE) } else { out.to_path_buf() };
    if path.exists() && !force {
        return Err(DataError::OutputExists { path });
    }
    let (files, _) = documents(inputs)?;
    let threads = if threads == 0 { crate::host::thread_count(0) } else { threads };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().map_err(|e| {
        DataError::Invalid { what: format!("tokenizer train: cannot start {threads} threads: {e}") }
    })?;
    let (send, recv) = crossbeam_channel::bounded::<Vec<RawDoc>>(2);
    let bad: std::sync::Mutex<Option<DataError>> = std::sync::Mutex::new(None);
    let docs = std::sync::atomic::AtomicU64::new(0);
    let json = std::thread::scope(|scope| -> Result<String, DataError> {
        let reader = scope.spawn(|| read_all(&files, read, send));
        let texts = recv.into_iter().flatten().filter_map(|d| {
            let place = RawDoc { file: d.file, line: d.line, body: Vec::new(), json: false }.place(&files);
            match d.text(&read.text_field) {
                Ok(t) => {
                    docs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Some(t)
                }
                Err(b) if !read.skip_bad_lines => {
                    let mut first = bad.lock().expect("not poisoned");
                    first.get_or_insert_with(|| DataError::Invalid {
                        what: format!(
                            "{place}: {} (--skip-bad-lines skips such records)",
                            b.describe(&read.text_field)
                        ),
                    });
                    None
                }
                Err(_) => None,
            }
        });
        let json = pool.install(|| super::tokenizer::train_bpe(texts, s));
        reader.join().expect("the reader thread does not panic")?;
        json
    })?;
    if let Some(e) = bad.into_inner().expect("not poisoned") {
        return Err(e);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(io(dir, "create directory"))?;
    }
    super::shards::write_atomic(&path, json.as_bytes())?;
    let tok = super::tokenizer::HfTokenizer::from_bytes(&path, json.into_bytes())?;
    Ok(TrainedTokenizer {
        documents: docs.into_inner(),
        path,
        vocab_size: tok.vocab_size,
        hash: tok.hash.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::token_file::{TokenFile, TokenFormat};

    const TEXT: &str = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n\
                        All:\nSpeak, speak. Ünïcödé — 数字 123+456=579\n";

    fn read_all(path: &Path, vocab: usize) -> Vec<u32> {
        let f = TokenFile::open(path, vocab).unwrap();
        let mut out = vec![0; f.len()];
        f.window(0, &mut out);
        out
    }

    #[test]
    fn prepare_with_bytes_writes_every_byte_split_at_the_val_fraction() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.txt");
        fs::write(&input, TEXT).unwrap();
        let out = dir.path().join("out");
        let r = prepare(&input, Tokenizer::Bytes, &out, 0.1, false).unwrap();
        let n = TEXT.len();
        assert_eq!(r.vocab_size, 256);
        assert_eq!(r.train_tokens + r.val_tokens, n);
        assert_eq!(r.val_tokens, (n as f64 * 0.1).round() as usize);
        let mut all = read_all(&r.train_path, 256);
        assert_eq!(TokenFile::open(&r.train_path, 256).unwrap().format(), TokenFormat::LlmcU16);
        all.extend(read_all(r.val_path.as_ref().unwrap(), 256));
        assert_eq!(all, TEXT.bytes().map(|b| b as u32).collect::<Vec<_>>());
    }

    #[test]
    fn prepare_with_gpt2_matches_tiktoken_directly() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.txt");
        fs::write(&input, TEXT).unwrap();
        let r = prepare(&input, Tokenizer::Gpt2, dir.path(), 0.25, false).unwrap();
        let expected = tiktoken_rs::r50k_base().unwrap().encode_ordinary(TEXT);
        assert_eq!(r.vocab_size, 50257);
        assert_eq!(r.train_tokens + r.val_tokens, expected.len());
        assert!(expected.len() < TEXT.len(), "BPE should merge bytes");
        let mut all = read_all(&r.train_path, 50257);
        all.extend(read_all(r.val_path.as_ref().unwrap(), 50257));
        assert_eq!(all, expected);
    }

    #[test]
    fn prepare_refuses_to_overwrite_existing_outputs_unless_forced() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.txt");
        fs::write(&input, TEXT).unwrap();
        let out = dir.path().join("out");
        fs::create_dir(&out).unwrap();
        fs::write(out.join("val.bin"), b"keep me").unwrap();
        let err = prepare(&input, Tokenizer::Bytes, &out, 0.1, false).unwrap_err();
        assert!(matches!(err, DataError::OutputExists { .. }), "{err}");
        assert!(err.to_string().contains("val.bin") && err.to_string().contains("pass --force"), "{err}");
        assert!(!out.join("train.bin").exists(), "a refusal must write nothing");
        assert_eq!(fs::read(out.join("val.bin")).unwrap(), b"keep me");
        prepare(&input, Tokenizer::Bytes, &out, 0.1, true).unwrap();
        assert!(TokenFile::open(&out.join("val.bin"), 256).is_ok());
    }

    #[test]
    fn prepare_with_gpt2_rejects_invalid_utf8_with_offset() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("bad.txt");
        fs::write(&input, b"abc\xffdef").unwrap();
        let err = prepare(&input, Tokenizer::Gpt2, dir.path(), 0.1, false).unwrap_err();
        assert!(matches!(err, DataError::NotUtf8 { offset: 3, .. }), "{err}");
        assert!(err.to_string().contains("bad.txt"), "{err}");
    }

    #[test]
    fn zero_val_fraction_writes_only_train() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.txt");
        fs::write(&input, TEXT).unwrap();
        let r = prepare(&input, Tokenizer::Bytes, dir.path(), 0.0, false).unwrap();
        assert_eq!((r.train_tokens, r.val_tokens, r.val_path), (TEXT.len(), 0, None));
        assert!(!dir.path().join("val.bin").exists());
    }

    #[test]
    fn a_folder_is_its_files_in_name_order_separated_by_end_of_text() {
        let dir = tempfile::tempdir().unwrap();
        let docs = dir.path().join("docs");
        fs::create_dir_all(docs.join("sub")).unwrap();
        fs::write(docs.join("b.txt"), "second").unwrap();
        fs::write(docs.join("a.txt"), "first").unwrap();
        fs::write(docs.join("sub/c.txt"), "third").unwrap();
        fs::write(docs.join(".hidden"), "never").unwrap();
        let r = prepare_all(std::slice::from_ref(&docs), Tokenizer::Gpt2, &dir.path().join("o"), 0.0, false)
            .unwrap();
        assert_eq!(r.documents, 3);
        let bpe = tiktoken_rs::r50k_base().unwrap();
        let mut want = bpe.encode_ordinary("first");
        for doc in ["second", "third"] {
            want.push(50256);
            want.extend(bpe.encode_ordinary(doc));
        }
        assert_eq!(read_all(&r.train_path, 50257), want);
        // Bytes have no end-of-text token: the files' bytes, back to back.
        let extra = dir.path().join("z.txt");
        fs::write(&extra, "!").unwrap();
        let r = prepare_all(&[docs, extra], Tokenizer::Bytes, &dir.path().join("b"), 0.0, false).unwrap();
        assert_eq!(
            read_all(&r.train_path, 256),
            "firstsecondthird!".bytes().map(u32::from).collect::<Vec<_>>()
        );
    }

    #[test]
    fn links_to_the_folder_itself_are_walked_once_so_each_file_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let docs = dir.path().join("in");
        fs::create_dir(&docs).unwrap();
        fs::write(docs.join("a.txt"), "abc").unwrap();
        // Two links back to the folder: followed blindly, 2^40 paths.
        std::os::unix::fs::symlink(".", docs.join("self")).unwrap();
        std::os::unix::fs::symlink("..", docs.join("up")).unwrap();
        let r = prepare_all(std::slice::from_ref(&docs), Tokenizer::Bytes, &dir.path().join("o"), 0.0, false)
            .unwrap();
        assert_eq!(r.documents, 1);
        assert_eq!(read_all(&r.train_path, 256), "abc".bytes().map(u32::from).collect::<Vec<_>>());
        // Folders reached twice hold nothing new; only files reached twice are news.
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    }

    #[test]
    fn a_file_reached_under_two_names_is_read_once_with_a_warning_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let docs = dir.path().join("in");
        fs::create_dir(&docs).unwrap();
        fs::write(docs.join("gpl.txt"), "GPL").unwrap();
        std::os::unix::fs::symlink("gpl.txt", docs.join("gpl-3.txt")).unwrap();
        fs::write(docs.join("mit.txt"), "MIT").unwrap();
        let r = prepare_all(std::slice::from_ref(&docs), Tokenizer::Bytes, &dir.path().join("o"), 0.0, false)
            .unwrap();
        assert_eq!(r.documents, 2);
        assert_eq!(read_all(&r.train_path, 256), "GPLMIT".bytes().map(u32::from).collect::<Vec<_>>());
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
        let w = &r.warnings[0];
        assert!(w.contains("in/gpl.txt") && w.contains("in/gpl-3.txt"), "{w}");
        // Named twice on the command line: the same.
        let a = docs.join("mit.txt");
        let r = prepare_all(&[a.clone(), a], Tokenizer::Bytes, &dir.path().join("p"), 0.0, false).unwrap();
        assert_eq!((r.documents, r.warnings.len()), (1, 1));
    }

    #[test]
    fn a_non_utf8_file_among_many_is_refused_by_name_unless_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.txt");
        let bad = dir.path().join("latin1.txt");
        fs::write(&good, "fine").unwrap();
        fs::write(&bad, b"caf\xe9").unwrap();
        let both = [good, bad];
        let err = prepare_all(&both, Tokenizer::Gpt2, &dir.path().join("o"), 0.0, false).unwrap_err();
        assert!(err.to_string().contains("latin1.txt") && err.to_string().contains("offset 3"), "{err}");
        assert!(!dir.path().join("o").exists(), "a refusal writes nothing");
        prepare_all(&both, Tokenizer::Bytes, &dir.path().join("o"), 0.0, false).unwrap();
    }
}
