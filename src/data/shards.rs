//! A prepared dataset on disk: llm.c token shards and the manifest that
//! names them.
//!
//! Owns the folder `prepare` writes and `train` reads: shards are llm.c
//! `.bin` files (uint16 tokens, or our uint32 variant past 65 536 ids), each
//! written under a temporary name, fsync'd and renamed; `manifest.json` is
//! written last, so a folder with a manifest is complete and a folder without
//! one is the remains of an interrupted prepare that nothing reads. Never
//! changes a shard after its manifest is written.

use std::fs::{self, File};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::token_file::{DataError, LLMC_MAGIC, LLMC_VERSION_U16, LLMC_VERSION_U32};

/// The manifest's file name inside a prepared dataset.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Where a prepare in progress keeps its work; removed when it finishes.
pub const PARTIAL_DIR: &str = ".prepare-partial";

/// Writes `bytes` to `path` whole or not at all: a temporary file beside
/// it, fsync'd, renamed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let io = |action, error| DataError::Io { path: path.to_path_buf(), action, error };
    let result = (|| {
        let mut f = File::create(&tmp).map_err(|e| io("create", e))?;
        f.write_all(bytes).map_err(|e| io("write", e))?;
        f.sync_all().map_err(|e| io("fsync", e))?;
        fs::rename(&tmp, path).map_err(|e| io("rename temporary file", e))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// One shard as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardEntry {
    /// File name inside the dataset's folder.
    pub file: String,
    pub tokens: u64,
    /// Documents that start in this shard.
    pub documents: u64,
    /// blake3 of the whole file, hex.
    pub blake3: String,
}

/// Streams tokens into numbered shards of at most `shard_tokens` tokens
/// (`split_000000.bin`, …), or one `split.bin` when `shard_tokens` is 0.
pub struct ShardWriter {
    dir: PathBuf,
    final_dir: PathBuf,
    split: &'static str,
    shard_tokens: u64,
    version: i32,
    done: Vec<ShardEntry>,
    open: Option<OpenShard>,
}

struct OpenShard {
    path: PathBuf,
    w: BufWriter<File>,
    tokens: u64,
    documents: u64,
}

impl ShardWriter {
    /// Shards are written in `work_dir` and named for `final_dir`.
    pub fn new(
        work_dir: &Path,
        final_dir: &Path,
        split: &'static str,
        shard_tokens: u64,
        vocab_size: usize,
    ) -> Self {
        let version = if vocab_size <= 1 << 16 { LLMC_VERSION_U16 } else { LLMC_VERSION_U32 };
        ShardWriter {
            dir: work_dir.to_path_buf(),
            final_dir: final_dir.to_path_buf(),
            split,
            shard_tokens,
            version,
            done: Vec::new(),
            open: None,
        }
    }

    fn name(&self, index: usize) -> String {
        if self.shard_tokens == 0 {
            format!("{}.bin", self.split)
        } else {
            format!("{}_{index:06}.bin", self.split)
        }
    }

    fn io<'a>(path: &'a Path, action: &'static str) -> impl Fn(std::io::Error) -> DataError + 'a {
        move |error| DataError::Io { path: path.to_path_buf(), action, error }
    }

    /// Marks the start of a document at the next token.
    pub fn start_document(&mut self) -> Result<(), DataError> {
        self.ensure_open()?;
        self.open.as_mut().expect("opened above").documents += 1;
        Ok(())
    }

    fn ensure_open(&mut self) -> Result<(), DataError> {
        if self.open.as_ref().is_some_and(|o| self.shard_tokens > 0 && o.tokens >= self.shard_tokens) {
            self.close_shard()?;
        }
        if self.open.is_none() {
            let path = self.dir.join(self.name(self.done.len()));
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(Self::io(&path, "create"))?;
            let mut w = BufWriter::with_capacity(1 << 20, f);
            // The header's count is filled in when the shard closes.
            w.write_all(&[0u8; super::token_file::LLMC_HEADER_BYTES]).map_err(Self::io(&path, "write"))?;
            self.open = Some(OpenShard { path, w, tokens: 0, documents: 0 });
        }
        Ok(())
    }

    pub fn push(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        let mut rest = tokens;
        while !rest.is_empty() {
            self.ensure_open()?;
            let o = self.open.as_mut().expect("opened above");
            let room = if self.shard_tokens == 0 { rest.len() as u64 } else { self.shard_tokens - o.tokens };
            let n = (room as usize).min(rest.len());
            let mut bytes = Vec::with_capacity(n * 4);
            if self.version == LLMC_VERSION_U16 {
                rest[..n].iter().for_each(|&t| bytes.extend_from_slice(&(t as u16).to_le_bytes()));
            } else {
                rest[..n].iter().for_each(|&t| bytes.extend_from_slice(&t.to_le_bytes()));
            }
            o.w.write_all(&bytes).map_err(Self::io(&o.path, "write"))?;
            o.tokens += n as u64;
            rest = &rest[n..];
        }
        Ok(())
    }

    fn close_shard(&mut self) -> Result<(), DataError> {
        let Some(o) = self.open.take() else { return Ok(()) };
        if o.tokens > i32::MAX as u64 {
            return Err(DataError::TooManyTokens { path: o.path, count: o.tokens as usize });
        }
        let mut header = [0i32; 256];
        header[0] = LLMC_MAGIC;
        header[1] = self.version;
        header[2] = o.tokens as i32;
        let header: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
        let mut f = o.w.into_inner().map_err(|e| DataError::Io {
            path: o.path.clone(),
            action: "write",
            error: e.into_error(),
        })?;
        f.seek(SeekFrom::Start(0)).map_err(Self::io(&o.path, "seek"))?;
        f.write_all(&header).map_err(Self::io(&o.path, "write"))?;
        f.sync_all().map_err(Self::io(&o.path, "fsync"))?;
        // Read back (from the page cache): the hash of the file as it lies.
        f.seek(SeekFrom::Start(0)).map_err(Self::io(&o.path, "seek"))?;
        let mut whole = blake3::Hasher::new();
        whole.update_reader(&mut f).map_err(Self::io(&o.path, "read back"))?;
        let file = o.path.file_name().expect("a shard name").to_string_lossy().into_owned();
        self.done.push(ShardEntry {
            file,
            tokens: o.tokens,
            documents: o.documents,
            blake3: whole.finalize().to_hex().to_string(),
        });
        Ok(())
    }

    /// Closes the last shard; the shards, still in the work folder.
    pub fn finish(mut self) -> Result<Vec<ShardEntry>, DataError> {
        self.close_shard()?;
        let _ = &self.final_dir;
        Ok(self.done)
    }
}

/// What one input was.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InputEntry {
    pub path: String,
    pub bytes: u64,
    pub blake3: String,
    pub format: String,
}

/// `manifest.json`: what a prepared dataset holds and how it was made.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// "pipewright-prepare/1".
    pub format: String,
    pub inputs: Vec<InputEntry>,
    pub tokenizer: String,
    /// "bytes", "tiktoken:r50k_base" or "blake3:<hex>" of tokenizer.json.
    pub tokenizer_hash: String,
    /// Put this (or more) in `model.vocab_size`.
    pub vocab_size: usize,
    /// The token between documents, if any.
    pub separator: Option<u32>,
    /// The settings, as the command line and config resolved them.
    pub settings: serde_json::Value,
    /// Documents (records) at each step, and removals by cause.
    pub counts: serde_json::Value,
    pub train: Vec<ShardEntry>,
    pub val: Vec<ShardEntry>,
}

pub const MANIFEST_FORMAT: &str = "pipewright-prepare/1";

impl Manifest {
    /// Reads `dir/manifest.json`.
    pub fn read(dir: &Path) -> Result<Manifest, DataError> {
        let path = dir.join(MANIFEST_FILE);
        let text = crate::fsutil::read_regular_to_string(&path, 1 << 30, "a manifest may hold").map_err(
            |error| {
                if error.kind() == std::io::ErrorKind::NotFound {
                    DataError::Invalid {
                        what: format!(
                            "{}: no such file (expected a folder written by `pipewright prepare`; a folder \
                         without one is an unfinished prepare)",
                            path.display()
                        ),
                    }
                } else {
                    DataError::Io { path: path.clone(), action: "read", error }
                }
            },
        )?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| DataError::Invalid {
            what: format!("{}: not a prepare manifest: {e}", path.display()),
        })?;
        if m.format != MANIFEST_FORMAT {
            return Err(DataError::Invalid {
                what: format!("{}: format {:?}; expected {MANIFEST_FORMAT:?}", path.display(), m.format),
            });
        }
        Ok(m)
    }

    pub fn train_tokens(&self) -> u64 {
        self.train.iter().map(|s| s.tokens).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::token_file::TokenFile;

    #[test]
    fn shards_hold_at_most_their_size_and_hash_as_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::new(dir.path(), dir.path(), "train", 4, 300);
        w.start_document().unwrap();
        w.push(&[1, 2, 3]).unwrap();
        w.start_document().unwrap();
        w.push(&[4, 5, 6, 7, 8]).unwrap();
        let shards = w.finish().unwrap();
        let names: Vec<_> = shards.iter().map(|s| (s.file.as_str(), s.tokens, s.documents)).collect();
        assert_eq!(names, [("train_000000.bin", 4, 2), ("train_000001.bin", 4, 0)]);
        for s in &shards {
            let bytes = fs::read(dir.path().join(&s.file)).unwrap();
            assert_eq!(blake3::hash(&bytes).to_hex().to_string(), s.blake3);
        }
        let f = TokenFile::open(&dir.path().join("train_000001.bin"), 300).unwrap();
        assert_eq!((0..4).map(|i| f.get(i)).collect::<Vec<_>>(), [5, 6, 7, 8]);
    }

    #[test]
    fn a_vocabulary_past_65536_writes_uint32_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::new(dir.path(), dir.path(), "val", 0, 128_256);
        w.start_document().unwrap();
        w.push(&[128_000, 5]).unwrap();
        let shards = w.finish().unwrap();
        assert_eq!(shards[0].file, "val.bin");
        let f = TokenFile::open(&dir.path().join("val.bin"), 128_256).unwrap();
        assert_eq!((f.get(0), f.get(1)), (128_000, 5));
    }
}
