//! Token files: reading llm.c `.bin` and nanoGPT raw uint16 files through a
//! memory map, and writing llm.c files atomically.
//!
//! Owns the on-disk token formats and every check that a file is what it says
//! it is (magic, version, size, token range). Errors name the file and what was
//! expected. Never modifies a file it reads, and never leaves a half-written
//! file under its final name.

use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

/// First int32 of an llm.c token file header.
pub const LLMC_MAGIC: i32 = 20240520;
/// llm.c's header: 256 little-endian int32 values.
pub const LLMC_HEADER_BYTES: usize = 256 * 4;
/// llm.c version with uint16 tokens (vocabularies up to 65 536).
pub const LLMC_VERSION_U16: i32 = 1;
/// Our variant with uint32 tokens, for vocabularies over 65 536.
pub const LLMC_VERSION_U32: i32 = 2;

/// Everything that can go wrong with token data. Every variant names the file
/// (or, for in-memory corpora, the source's name) and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("token file {path}: no such file (expected an llm.c .bin or a raw uint16 token file)")]
    Missing { path: PathBuf },

    #[error("{path}: {action} failed: {error}")]
    Io { path: PathBuf, action: &'static str, error: io::Error },

    #[error(
        "token file {path}: llm.c header (magic {LLMC_MAGIC}) has version {version}; \
         expected 1 (uint16 tokens) or 2 (uint32 tokens)"
    )]
    BadVersion { path: PathBuf, version: i32 },

    #[error(
        "token file {path}: {size} bytes, shorter than the {LLMC_HEADER_BYTES}-byte llm.c header \
         its magic number announces"
    )]
    TruncatedHeader { path: PathBuf, size: u64 },

    #[error(
        "token file {path}: header says {header_tokens} tokens of {width} bytes \
         ({expected} bytes after the header) but the file has {actual} bytes after the header \
         ({what})"
    )]
    SizeMismatch {
        path: PathBuf,
        header_tokens: i64,
        width: usize,
        expected: u64,
        actual: u64,
        what: &'static str,
    },

    #[error(
        "token file {path}: read as raw uint16 tokens (no llm.c magic, or data.format = \"raw\"), \
         but its size {size} bytes is odd (expected a whole number of 2-byte tokens)"
    )]
    OddRawSize { path: PathBuf, size: u64 },

    #[error(
        "token file {path}: magic {found} where data.format = \"llmc\" expects llm.c's {LLMC_MAGIC} \
         (set data.format = \"raw\" for nanoGPT's headerless uint16 files)"
    )]
    WrongMagic { path: PathBuf, found: i32 },

    #[error(
        "token file {path}: llm.c header with magic {found} (expected {LLMC_MAGIC}): its version \
         {version} and token count {count} fit the file's size, so it is not raw uint16 tokens; \
         refusing to guess (set data.format = \"raw\" if it really is headerless)"
    )]
    ForeignHeader { path: PathBuf, found: i32, version: i32, count: i32 },

    #[error("token file {path}: holds no tokens (expected at least one)")]
    Empty { path: PathBuf },

    #[error(
        "token file {path}: token {token} at index {index} (byte offset {offset}) is out of range; \
         expected ids below vocab_size {vocab_size}"
    )]
    TokenOutOfRange { path: PathBuf, index: u64, offset: u64, token: u32, vocab_size: usize },

    #[error(
        "token source {name}: {len} tokens is too short for one window of block_size {block_size} \
         (expected at least {needed} tokens: T inputs plus one target)"
    )]
    TooShort { name: String, len: usize, block_size: usize, needed: usize },

    #[error("token source {name}: {what}")]
    BadShape { name: String, what: String },

    #[error("token file {path}: {count} tokens do not fit llm.c's int32 token count")]
    TooManyTokens { path: PathBuf, count: usize },

    #[error("{path} already exists; refusing to overwrite it (pass --force to replace it)")]
    OutputExists { path: PathBuf },

    #[error("text file {path}: not valid UTF-8 at byte offset {offset} (expected UTF-8 text)")]
    NotUtf8 { path: PathBuf, offset: usize },

    #[error("{what}")]
    Invalid { what: String },
}

/// Which layout a token file has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenFormat {
    /// llm.c `.bin`, version 1: uint16 tokens after a 1024-byte header.
    LlmcU16,
    /// Our llm.c variant, version 2: uint32 tokens after a 1024-byte header.
    LlmcU32,
    /// nanoGPT: raw little-endian uint16 tokens, no header.
    RawU16,
}

/// How a token file's layout is chosen (`data.format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileFormat {
    /// llm.c when the file starts with its magic; raw uint16 otherwise, unless
    /// the first 1024 bytes are an llm.c header with another magic (a file from
    /// a newer or foreign tool), which is refused rather than read as tokens.
    #[default]
    Auto,
    /// llm.c `.bin` only: any other magic is an error.
    Llmc,
    /// nanoGPT's raw uint16, whatever the first bytes look like.
    Raw,
}

impl std::str::FromStr for FileFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(FileFormat::Auto),
            "llmc" => Ok(FileFormat::Llmc),
            "raw" => Ok(FileFormat::Raw),
            other => Err(format!("{other:?}: expected one of \"auto\", \"llmc\", \"raw\"")),
        }
    }
}

impl TokenFormat {
    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            TokenFormat::LlmcU16 | TokenFormat::RawU16 => 2,
            TokenFormat::LlmcU32 => 4,
        }
    }
}

/// A read-only, memory-mapped token file whose tokens were all checked to be
/// below the vocabulary size when it was opened.
///
/// The file must not be modified while it is open: the map would change under
/// us (and truncation would fault).
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    format: TokenFormat,
    offset: usize,
    len: usize,
}

fn io_err<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(io::Error) -> DataError + 'a {
    move |error| {
        if error.kind() == io::ErrorKind::NotFound && action == "open" {
            DataError::Missing { path: path.to_path_buf() }
        } else {
            DataError::Io { path: path.to_path_buf(), action, error }
        }
    }
}

impl TokenFile {
    /// Opens `path` with [`FileFormat::Auto`]: see [`TokenFile::open_as`].
    pub fn open(path: &Path, vocab_size: usize) -> Result<TokenFile, DataError> {
        TokenFile::open_as(path, vocab_size, FileFormat::Auto)
    }

    /// Opens `path` as `format` says and checks every token against
    /// `vocab_size`. A file that starts with llm.c's magic must be a valid
    /// llm.c file.
    pub fn open_as(path: &Path, vocab_size: usize, format: FileFormat) -> Result<TokenFile, DataError> {
        // A FIFO, directory or device is refused here, not waited on or mapped.
        let file = crate::fsutil::open_regular(path).map_err(io_err(path, "open"))?;
        let size = file.metadata().map_err(io_err(path, "stat"))?.len();
        let p = || path.to_path_buf();
        if size == 0 {
            // Checked before mapping: a zero-length map is an error on Linux.
            return Err(DataError::Empty { path: p() });
        }
        // SAFETY: the map is read-only and we never hand out references that
        // outlive it; the documented contract is that token files are not
        // modified while a run reads them.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(path, "mmap"))?;

        let (format, offset, len) = layout(path, &map, format)?;
        check_range(path, &map, format, offset, len, vocab_size)?;
        Ok(TokenFile { path: p(), map, format, offset, len })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn format(&self) -> TokenFormat {
        self.format
    }

    /// Number of tokens (never zero).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an empty file is rejected on open. Present for clippy's
    /// `len_without_is_empty` and for symmetry with `TokenSource`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The token at index `i`. Panics when `i >= len()`.
    pub fn get(&self, i: usize) -> u32 {
        assert!(i < self.len, "token index {i} out of range for {} tokens", self.len);
        let at = self.offset + i * self.format.width();
        match self.format.width() {
            2 => u16::from_le_bytes([self.map[at], self.map[at + 1]]) as u32,
            _ => u32::from_le_bytes([self.map[at], self.map[at + 1], self.map[at + 2], self.map[at + 3]]),
        }
    }

    /// Copies tokens `[start, start + out.len())` into `out`. Panics when the
    /// range runs past the end: callers compute windows from `len()`, so an
    /// overrun is a bug, not a data problem.
    pub fn window(&self, start: usize, out: &mut [u32]) {
        let end = start.checked_add(out.len()).expect("window end overflows usize");
        assert!(end <= self.len, "window [{start}, {end}) out of range for {} tokens", self.len);
        let w = self.format.width();
        let bytes = &self.map[self.offset + start * w..self.offset + end * w];
        match w {
            2 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u16::from_le_bytes([c[0], c[1]]) as u32;
                }
            }
            _ => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
    }
}

/// The checks [`TokenFile::open`] makes, on bytes already in memory: the
/// format, then every token against `vocab_size`. Returns the format and the
/// token count; `path` only names the bytes in errors. The fuzz target reaches
/// the header logic through this, without a file.
pub fn check_token_bytes(
    path: &Path,
    bytes: &[u8],
    vocab_size: usize,
) -> Result<(TokenFormat, usize), DataError> {
    let (format, offset, len) = layout(path, bytes, FileFormat::Auto)?;
    check_range(path, bytes, format, offset, len, vocab_size)?;
    Ok((format, len))
}

/// Where the tokens lie in a token file's bytes: its format, the byte offset
/// of the first token and the token count (never zero), as `choice` says.
fn layout(path: &Path, bytes: &[u8], choice: FileFormat) -> Result<(TokenFormat, usize, usize), DataError> {
    let p = || path.to_path_buf();
    let size = bytes.len() as u64;
    let magic = (bytes.len() >= 4).then(|| read_i32(bytes, 0));
    let has_magic = magic == Some(LLMC_MAGIC);
    match choice {
        FileFormat::Llmc if !has_magic => {
            // A file too short for even the magic has none; say what it holds.
            let found = magic.unwrap_or(0);
            return Err(DataError::WrongMagic { path: p(), found });
        }
        FileFormat::Auto if !has_magic => {
            if let Some((found, version, count)) = foreign_llmc_header(bytes) {
                return Err(DataError::ForeignHeader { path: p(), found, version, count });
            }
        }
        _ => {}
    }
    let (format, offset, len) = if has_magic && choice != FileFormat::Raw {
        if bytes.len() < LLMC_HEADER_BYTES {
            return Err(DataError::TruncatedHeader { path: p(), size });
        }
        let version = read_i32(bytes, 1);
        let format = match version {
            LLMC_VERSION_U16 => TokenFormat::LlmcU16,
            LLMC_VERSION_U32 => TokenFormat::LlmcU32,
            _ => return Err(DataError::BadVersion { path: p(), version }),
        };
        let width = format.width();
        let header_tokens = read_i32(bytes, 2) as i64;
        let actual = size - LLMC_HEADER_BYTES as u64;
        let expected = header_tokens.max(0) as u64 * width as u64;
        if header_tokens < 0 || expected != actual {
            let what = if header_tokens < 0 {
                "negative token count"
            } else if actual < expected {
                "truncated"
            } else {
                "oversized"
            };
            return Err(DataError::SizeMismatch { path: p(), header_tokens, width, expected, actual, what });
        }
        (format, LLMC_HEADER_BYTES, header_tokens as usize)
    } else {
        if !size.is_multiple_of(2) {
            return Err(DataError::OddRawSize { path: p(), size });
        }
        (TokenFormat::RawU16, 0, (size / 2) as usize)
    };
    if len == 0 {
        return Err(DataError::Empty { path: p() });
    }
    Ok((format, offset, len))
}

/// Every token of `bytes` (laid out as [`layout`] found) below `vocab_size`.
fn check_range(
    path: &Path,
    bytes: &[u8],
    format: TokenFormat,
    offset: usize,
    len: usize,
    vocab_size: usize,
) -> Result<(), DataError> {
    let width = format.width();
    let data = &bytes[offset..offset + len * width];
    let token = |c: &[u8]| match width {
        2 => u16::from_le_bytes([c[0], c[1]]) as u32,
        _ => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
    };
    match data.chunks_exact(width).position(|c| token(c) as usize >= vocab_size) {
        None => Ok(()),
        Some(index) => Err(DataError::TokenOutOfRange {
            path: path.to_path_buf(),
            index: index as u64,
            offset: (offset + index * width) as u64,
            token: token(&data[index * width..]),
            vocab_size,
        }),
    }
}

/// (magic, version, count) when `bytes` start with what can only be an llm.c
/// header under another magic: a known version whose token count is exactly
/// what the file's size holds. Raw tokens match this by chance with odds far
/// below one in 2^32, so such a file is refused instead of read as tokens.
fn foreign_llmc_header(bytes: &[u8]) -> Option<(i32, i32, i32)> {
    if bytes.len() < LLMC_HEADER_BYTES {
        return None;
    }
    let (magic, version, count) = (read_i32(bytes, 0), read_i32(bytes, 1), read_i32(bytes, 2));
    let width = match version {
        LLMC_VERSION_U16 => 2,
        LLMC_VERSION_U32 => 4,
        _ => return None,
    };
    let body = (bytes.len() - LLMC_HEADER_BYTES) as u64;
    (count >= 0 && body == count as u64 * width).then_some((magic, version, count))
}

fn read_i32(bytes: &[u8], index: usize) -> i32 {
    let at = index * 4;
    i32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Where training or validation tokens come from: a checked file, an
/// in-memory corpus, or a generated text whose every token is a function of
/// (seed, position) and which is never held in memory.
#[derive(Debug)]
pub enum TokenSource {
    File(TokenFile),
    Memory {
        name: String,
        tokens: Vec<u32>,
    },
    Arithmetic {
        name: String,
        text: super::arithmetic::TrainText,
    },
    Random(RandomText),
    /// A prepared dataset's shards, back to back (`starts[i]`: the first
    /// token of shard i; a window may span two shards).
    Shards {
        name: String,
        files: Vec<TokenFile>,
        starts: Vec<usize>,
        len: usize,
    },
}

/// Length of the generated random text (generated by position, never stored).
pub const RANDOM_TOKENS: usize = 1 << 26;

/// Uniformly random tokens, token i drawn from a stream keyed by (seed, i).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RandomText {
    pub seed: u64,
    pub vocab_size: usize,
    pub len: usize,
}

impl RandomText {
    fn window(&self, start: usize, out: &mut [u32]) {
        assert!(start + out.len() <= self.len, "window past the random text's {} tokens", self.len);
        for (i, o) in out.iter_mut().enumerate() {
            let mut r =
                crate::rng::Rng::new(self.seed, crate::rng::Purpose::Data, &[0xb, (start + i) as u64]);
            *o = r.below(self.vocab_size as u64) as u32;
        }
    }
}

impl TokenSource {
    /// An in-memory source, with the same range check a file gets on open.
    pub fn from_vec(
        name: impl Into<String>,
        tokens: Vec<u32>,
        vocab_size: usize,
    ) -> Result<TokenSource, DataError> {
        let name = name.into();
        if tokens.is_empty() {
            return Err(DataError::Empty { path: PathBuf::from(name) });
        }
        if let Some(index) = tokens.iter().position(|&t| t as usize >= vocab_size) {
            return Err(DataError::TokenOutOfRange {
                path: PathBuf::from(name),
                index: index as u64,
                offset: index as u64 * 4,
                token: tokens[index],
                vocab_size,
            });
        }
        Ok(TokenSource::Memory { name, tokens })
    }

    /// Shards read as one source, in order.
    pub fn shards(name: impl Into<String>, files: Vec<TokenFile>) -> Result<TokenSource, DataError> {
        let name = name.into();
        if files.is_empty() {
            return Err(DataError::Empty { path: PathBuf::from(name) });
        }
        let mut starts = Vec::with_capacity(files.len());
        let mut len = 0;
        for f in &files {
            starts.push(len);
            len += f.len();
        }
        Ok(TokenSource::Shards { name, files, starts, len })
    }

    /// The file path, or the in-memory corpus's name, for error messages.
    pub fn name(&self) -> String {
        match self {
            TokenSource::File(f) => f.path().display().to_string(),
            TokenSource::Memory { name, .. }
            | TokenSource::Arithmetic { name, .. }
            | TokenSource::Shards { name, .. } => name.clone(),
            TokenSource::Random(_) => "builtin:random".into(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            TokenSource::File(f) => f.len(),
            TokenSource::Memory { tokens, .. } => tokens.len(),
            TokenSource::Arithmetic { text, .. } => text.len(),
            TokenSource::Random(r) => r.len,
            TokenSource::Shards { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies tokens `[start, start + out.len())` into `out`; panics on overrun.
    pub fn window(&self, start: usize, out: &mut [u32]) {
        match self {
            TokenSource::File(f) => f.window(start, out),
            TokenSource::Memory { tokens, .. } => out.copy_from_slice(&tokens[start..start + out.len()]),
            TokenSource::Arithmetic { text, .. } => text.window(start, out),
            TokenSource::Random(r) => r.window(start, out),
            TokenSource::Shards { files, starts, .. } => {
                let mut at = start;
                let mut done = 0;
                let mut i = starts.partition_point(|&s| s <= at) - 1;
                while done < out.len() {
                    let n = (files[i].len() - (at - starts[i])).min(out.len() - done);
                    files[i].window(at - starts[i], &mut out[done..done + n]);
                    done += n;
                    at += n;
                    i += 1;
                }
            }
        }
    }
}

impl From<TokenFile> for TokenSource {
    fn from(f: TokenFile) -> Self {
        TokenSource::File(f)
    }
}

/// Writes `tokens` as an llm.c `.bin`: version 1 (uint16) when every id of the
/// vocabulary fits 16 bits, else version 2 (uint32). The bytes go to a
/// temporary file in the same directory, are fsync'd, and are renamed into
/// place, so `path` holds either the old file or the complete new one.
pub fn write_llmc(path: &Path, tokens: &[u32], vocab_size: usize) -> Result<(), DataError> {
    if tokens.is_empty() {
        return Err(DataError::Empty { path: path.to_path_buf() });
    }
    if tokens.len() > i32::MAX as usize {
        return Err(DataError::TooManyTokens { path: path.to_path_buf(), count: tokens.len() });
    }
    if let Some(index) = tokens.iter().position(|&t| t as usize >= vocab_size) {
        return Err(DataError::TokenOutOfRange {
            path: path.to_path_buf(),
            index: index as u64,
            offset: index as u64 * 4,
            token: tokens[index],
            vocab_size,
        });
    }
    let version = if vocab_size <= 1 << 16 { LLMC_VERSION_U16 } else { LLMC_VERSION_U32 };

    let file_name = path.file_name().ok_or_else(|| DataError::Invalid {
        what: format!("{}: expected a file path, found a directory-like path", path.display()),
    })?;
    let tmp = path.with_file_name(format!(".{}.tmp-{}", file_name.to_string_lossy(), std::process::id()));
    let result = write_llmc_to(&tmp, tokens, version).and_then(|()| {
        fs::rename(&tmp, path).map_err(|error| DataError::Io {
            path: path.to_path_buf(),
            action: "rename temporary file",
            error,
        })
    });
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
        return result;
    }
    // Make the rename itself durable; failing to open a directory for fsync
    // (some filesystems refuse) does not make the written data wrong.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

fn write_llmc_to(tmp: &Path, tokens: &[u32], version: i32) -> Result<(), DataError> {
    let file = File::create(tmp).map_err(io_err(tmp, "create"))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut header = [0i32; 256];
    header[0] = LLMC_MAGIC;
    header[1] = version;
    header[2] = tokens.len() as i32;
    let write = |w: &mut BufWriter<File>, b: &[u8]| w.write_all(b).map_err(io_err(tmp, "write"));
    for h in header {
        write(&mut w, &h.to_le_bytes())?;
    }
    if version == LLMC_VERSION_U16 {
        for &t in tokens {
            write(&mut w, &(t as u16).to_le_bytes())?;
        }
    } else {
        for &t in tokens {
            write(&mut w, &t.to_le_bytes())?;
        }
    }
    let file = w.into_inner().map_err(|e| DataError::Io {
        path: tmp.to_path_buf(),
        action: "write",
        error: e.into_error(),
    })?;
    file.sync_all().map_err(io_err(tmp, "fsync"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw_u16(tokens: &[u16]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    fn llmc_header(version: i32, count: i32) -> Vec<u8> {
        let mut h = [0i32; 256];
        h[0] = LLMC_MAGIC;
        h[1] = version;
        h[2] = count;
        h.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn u16_llmc_file_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        let tokens: Vec<u32> = (0..1000).map(|i| (i * 37) % 50257).collect();
        write_llmc(&path, &tokens, 50257).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), 1024 + 2 * 1000);
        let f = TokenFile::open(&path, 50257).unwrap();
        assert_eq!(f.format(), TokenFormat::LlmcU16);
        assert_eq!(f.len(), 1000);
        let mut out = vec![0; 1000];
        f.window(0, &mut out);
        assert_eq!(out, tokens);
        let mut mid = [0; 3];
        f.window(500, &mut mid);
        assert_eq!(&mid, &tokens[500..503]);
    }

    #[test]
    fn u32_llmc_file_round_trips_for_vocab_over_65536() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.bin");
        let tokens: Vec<u32> = vec![0, 65535, 65536, 100_276, 7];
        write_llmc(&path, &tokens, 100_277).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), 1024 + 4 * 5);
        let f = TokenFile::open(&path, 100_277).unwrap();
        assert_eq!(f.format(), TokenFormat::LlmcU32);
        let mut out = vec![0; 5];
        f.window(0, &mut out);
        assert_eq!(out, tokens);
    }

    #[test]
    fn vocab_of_exactly_65536_still_uses_u16() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        write_llmc(&path, &[65535, 0], 65536).unwrap();
        let f = TokenFile::open(&path, 65536).unwrap();
        assert_eq!(f.format(), TokenFormat::LlmcU16);
        assert_eq!(f.get(0), 65535);
    }

    #[test]
    fn writer_leaves_no_temporary_file_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        write_llmc(&path, &[1, 2, 3], 256).unwrap();
        write_llmc(&path, &[4, 5], 256).unwrap();
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("a.bin")]);
        assert_eq!(TokenFile::open(&path, 256).unwrap().len(), 2);
    }

    #[test]
    fn writer_rejects_token_out_of_vocab_and_keeps_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        write_llmc(&path, &[1, 2, 3], 256).unwrap();
        let err = write_llmc(&path, &[1, 256], 256).unwrap_err();
        assert!(matches!(err, DataError::TokenOutOfRange { index: 1, .. }), "{err}");
        assert_eq!(TokenFile::open(&path, 256).unwrap().len(), 3);
    }

    #[test]
    fn file_without_magic_is_read_as_raw_uint16() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raw.bin");
        fs::write(&path, raw_u16(&[3, 1, 4, 1, 5])).unwrap();
        let f = TokenFile::open(&path, 256).unwrap();
        assert_eq!(f.format(), TokenFormat::RawU16);
        let mut out = [0; 5];
        f.window(0, &mut out);
        assert_eq!(out, [3, 1, 4, 1, 5]);
    }

    #[test]
    fn raw_file_of_odd_size_is_rejected_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("odd.bin");
        fs::write(&path, [1u8, 0, 2]).unwrap();
        let err = TokenFile::open(&path, 256).unwrap_err();
        assert!(matches!(err, DataError::OddRawSize { size: 3, .. }), "{err}");
        assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    }

    #[test]
    fn llmc_header_with_unknown_version_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v7.bin");
        let mut bytes = llmc_header(7, 2);
        bytes.extend(raw_u16(&[1, 2]));
        fs::write(&path, bytes).unwrap();
        let err = TokenFile::open(&path, 256).unwrap_err();
        assert!(matches!(err, DataError::BadVersion { version: 7, .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()) && msg.contains("expected 1"), "{msg}");
    }

    #[test]
    fn truncated_token_file_is_rejected_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cut.bin");
        write_llmc(&path, &[1, 2, 3, 4], 256).unwrap();
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
        let err = TokenFile::open(&path, 256).unwrap_err();
        assert!(
            matches!(err, DataError::SizeMismatch { what: "truncated", expected: 8, actual: 6, .. }),
            "{err}"
        );
        assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    }

    #[test]
    fn oversized_token_file_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("long.bin");
        let mut bytes = llmc_header(1, 2);
        bytes.extend(raw_u16(&[1, 2, 3]));
        fs::write(&path, bytes).unwrap();
        let err = TokenFile::open(&path, 256).unwrap_err();
        assert!(matches!(err, DataError::SizeMismatch { what: "oversized", .. }), "{err}");
    }

    #[test]
    fn file_cut_inside_the_header_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hdr.bin");
        fs::write(&path, &llmc_header(1, 2)[..100]).unwrap();
        let err = TokenFile::open(&path, 256).unwrap_err();
        assert!(matches!(err, DataError::TruncatedHeader { size: 100, .. }), "{err}");
    }

    #[test]
    fn empty_files_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("empty.bin");
        fs::write(&raw, b"").unwrap();
        assert!(matches!(TokenFile::open(&raw, 256), Err(DataError::Empty { .. })));
        let llmc = dir.path().join("hdr_only.bin");
        fs::write(&llmc, llmc_header(1, 0)).unwrap();
        let err = TokenFile::open(&llmc, 256).unwrap_err();
        assert!(matches!(err, DataError::Empty { .. }), "{err}");
        assert!(err.to_string().contains("hdr_only.bin"), "{err}");
    }

    #[test]
    fn token_at_or_above_vocab_size_reports_file_index_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("oov.bin");
        let mut bytes = llmc_header(1, 4);
        bytes.extend(raw_u16(&[1, 2, 256, 3]));
        fs::write(&path, bytes).unwrap();
        let err = TokenFile::open(&path, 256).unwrap_err();
        match &err {
            DataError::TokenOutOfRange { path: p, index, offset, token, vocab_size } => {
                assert_eq!((p, *index, *offset, *token, *vocab_size), (&path, 2, 1028, 256, 256));
            }
            other => panic!("unexpected {other}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("oov.bin") && msg.contains("index 2") && msg.contains("1028"), "{msg}");
        // The same file is fine for a vocabulary that contains id 256.
        assert!(TokenFile::open(&path, 257).is_ok());
    }

    #[test]
    fn missing_file_is_reported_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.bin");
        let err = TokenFile::open(&path, 256).unwrap_err();
        assert!(matches!(err, DataError::Missing { .. }), "{err}");
        assert!(err.to_string().contains("nope.bin"), "{err}");
    }

    /// An llm.c-shaped header under `magic`, then `tokens` as uint16.
    fn foreign(magic: i32, tokens: &[u16]) -> Vec<u8> {
        let mut bytes = llmc_header(1, tokens.len() as i32);
        bytes[..4].copy_from_slice(&magic.to_le_bytes());
        bytes.extend(raw_u16(tokens));
        bytes
    }

    #[test]
    fn llmc_format_refuses_a_file_without_the_magic_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raw.bin");
        fs::write(&path, raw_u16(&[7, 1, 4, 1, 5, 9])).unwrap();
        let err = TokenFile::open_as(&path, 256, FileFormat::Llmc).unwrap_err();
        assert!(matches!(err, DataError::WrongMagic { found: 65543, .. }), "{err}");
        let msg = err.to_string();
        for needle in ["raw.bin", "magic 65543", "20240520"] {
            assert!(msg.contains(needle), "{needle:?} missing: {msg}");
        }
        // The same file is fine when read as what it is.
        assert_eq!(TokenFile::open_as(&path, 256, FileFormat::Raw).unwrap().len(), 6);
        assert_eq!(TokenFile::open_as(&path, 256, FileFormat::Auto).unwrap().format(), TokenFormat::RawU16);
    }

    #[test]
    fn auto_format_refuses_an_llmc_header_with_another_magic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("other.bin");
        fs::write(&path, foreign(20240801, &[1, 2, 3, 4])).unwrap();
        let err = TokenFile::open(&path, 256).unwrap_err();
        assert!(
            matches!(err, DataError::ForeignHeader { found: 20240801, version: 1, count: 4, .. }),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains("other.bin"), "{msg}");
        assert!(msg.contains("llm.c header with magic 20240801 (expected 20240520)"), "{msg}");
        // Told it is raw, it is read as raw (the header becomes 512 tokens).
        let f = TokenFile::open_as(&path, 1 << 16, FileFormat::Raw).unwrap();
        assert_eq!((f.format(), f.len()), (TokenFormat::RawU16, 512 + 4));
        // And version 2 (uint32 tokens) is recognised the same way.
        let mut v2 = llmc_header(2, 2);
        v2[..4].copy_from_slice(&7i32.to_le_bytes());
        v2.extend([1u8, 0, 0, 0, 2, 0, 0, 0]);
        let path2 = dir.path().join("other32.bin");
        fs::write(&path2, v2).unwrap();
        let err = TokenFile::open(&path2, 256).unwrap_err();
        assert!(matches!(err, DataError::ForeignHeader { found: 7, version: 2, count: 2, .. }), "{err}");
    }

    #[test]
    fn auto_format_reads_raw_tokens_that_only_resemble_a_header() {
        let dir = tempfile::tempdir().unwrap();
        // int32 [1] is 1, but int32 [2] is not the count the size implies.
        let mut tokens = vec![9u16; 600];
        tokens[2] = 1;
        tokens[3] = 0;
        tokens[4] = 100;
        tokens[5] = 0;
        let path = dir.path().join("raw.bin");
        fs::write(&path, raw_u16(&tokens)).unwrap();
        let f = TokenFile::open(&path, 256).unwrap();
        assert_eq!((f.format(), f.len()), (TokenFormat::RawU16, 600));
        // A raw file shorter than a header cannot be mistaken for one.
        fs::write(&path, raw_u16(&[1, 0, 1, 0, 0, 0])).unwrap();
        assert_eq!(TokenFile::open(&path, 256).unwrap().format(), TokenFormat::RawU16);
    }

    #[test]
    fn raw_format_reads_even_an_llmc_file_as_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        write_llmc(&path, &[1, 2, 3], 256).unwrap();
        let f = TokenFile::open_as(&path, 1 << 16, FileFormat::Raw).unwrap();
        assert_eq!(
            (f.format(), f.len(), f.get(0)),
            (TokenFormat::RawU16, 512 + 3, (LLMC_MAGIC & 0xffff) as u32)
        );
    }

    #[test]
    fn format_names_parse() {
        assert_eq!("auto".parse(), Ok(FileFormat::Auto));
        assert_eq!("llmc".parse(), Ok(FileFormat::Llmc));
        assert_eq!("raw".parse(), Ok(FileFormat::Raw));
        assert!("bin".parse::<FileFormat>().unwrap_err().contains("\"llmc\""));
    }

    #[test]
    fn memory_source_checks_range_and_copies_windows() {
        let err = TokenSource::from_vec("gen", vec![1, 300], 256).unwrap_err();
        assert!(err.to_string().contains("gen") && err.to_string().contains("index 1"), "{err}");
        let s = TokenSource::from_vec("gen", vec![5, 6, 7, 8], 256).unwrap();
        let mut out = [0; 2];
        s.window(1, &mut out);
        assert_eq!(out, [6, 7]);
        assert_eq!(s.len(), 4);
    }
}
