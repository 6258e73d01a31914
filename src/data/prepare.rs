//! `pipewright prepare`: text file → `train.bin` + `val.bin` in llm.c format.
//!
//! Owns tokenizing a text file and the train/val split. Never downloads
//! anything (GPT-2's BPE ranks ship inside `tiktoken-rs`) and never overwrites
//! an existing output unless asked to.

use std::fs;
use std::path::{Path, PathBuf};

use super::token_file::{write_llmc, DataError};

/// How text becomes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokenizer {
    /// Each byte is a token (vocab 256).
    Bytes,
    /// GPT-2's BPE (`r50k_base`, vocab 50257).
    Gpt2,
}

impl Tokenizer {
    /// The vocabulary size to put in `model.vocab_size`.
    pub fn vocab_size(self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Gpt2 => 50257,
        }
    }
}

impl std::str::FromStr for Tokenizer {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self, DataError> {
        match s {
            "bytes" => Ok(Tokenizer::Bytes),
            "gpt2" => Ok(Tokenizer::Gpt2),
            other => Err(DataError::Invalid {
                what: format!("tokenizer: got {other:?}, expected \"bytes\" or \"gpt2\""),
            }),
        }
    }
}

/// The validation share `prepare` uses unless told otherwise.
pub const DEFAULT_VAL_FRACTION: f64 = 0.1;

/// What `prepare` wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareReport {
    pub tokenizer: Tokenizer,
    /// Put this in `model.vocab_size`.
    pub vocab_size: usize,
    pub train_path: PathBuf,
    pub train_tokens: usize,
    /// `None` when `val_fraction` is 0.
    pub val_path: Option<PathBuf>,
    pub val_tokens: usize,
}

/// Tokenizes `input` and writes `out_dir/train.bin` and (unless
/// `val_fraction` is 0) `out_dir/val.bin`; val is the last `val_fraction` of
/// the tokens, rounded to a whole token, so no token is in both. Creates
/// `out_dir` if needed. Refuses to replace existing outputs unless `force`.
///
/// With `Bytes` the input may be any bytes; with `Gpt2` it must be UTF-8.
/// Text is encoded as ordinary text: a literal `<|endoftext|>` in the file is
/// tokenized as characters, not as the special token, as nanoGPT's scripts do.
pub fn prepare(
    input: &Path,
    tokenizer: Tokenizer,
    out_dir: &Path,
    val_fraction: f64,
    force: bool,
) -> Result<PrepareReport, DataError> {
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(DataError::Invalid {
            what: format!("val_fraction: got {val_fraction}, expected a number in [0, 1)"),
        });
    }
    let train_path = out_dir.join("train.bin");
    let val_path = (val_fraction > 0.0).then(|| out_dir.join("val.bin"));
    // Check both before writing either, so a refusal leaves nothing changed.
    if !force {
        for p in std::iter::once(&train_path).chain(val_path.as_ref()) {
            if p.exists() {
                return Err(DataError::OutputExists { path: p.clone() });
            }
        }
    }

    let cap = crate::fsutil::memory_cap();
    let bytes = crate::fsutil::read_regular(input, cap, "this machine's memory holds").map_err(|error| {
        if error.kind() == std::io::ErrorKind::NotFound {
            DataError::Invalid { what: format!("text file {}: no such file", input.display()) }
        } else {
            DataError::Io { path: input.to_path_buf(), action: "read", error }
        }
    })?;
    let tokens: Vec<u32> = match tokenizer {
        Tokenizer::Bytes => bytes.iter().map(|&b| b as u32).collect(),
        Tokenizer::Gpt2 => {
            let text = std::str::from_utf8(&bytes)
                .map_err(|e| DataError::NotUtf8 { path: input.to_path_buf(), offset: e.valid_up_to() })?;
            tiktoken_rs::r50k_base_singleton().encode_ordinary(text)
        }
    };

    let n = tokens.len();
    let n_val = (n as f64 * val_fraction).round() as usize;
    let n_train = n - n_val;
    if n_train == 0 || (val_path.is_some() && n_val == 0) {
        return Err(DataError::Invalid {
            what: format!(
                "text file {}: {n} tokens cannot be split into non-empty train and val \
                 parts with val_fraction {val_fraction}",
                input.display()
            ),
        });
    }

    fs::create_dir_all(out_dir).map_err(|error| DataError::Io {
        path: out_dir.to_path_buf(),
        action: "create directory",
        error,
    })?;
    let vocab_size = tokenizer.vocab_size();
    write_llmc(&train_path, &tokens[..n_train], vocab_size)?;
    if let Some(vp) = &val_path {
        write_llmc(vp, &tokens[n_train..], vocab_size)?;
    }
    Ok(PrepareReport {
        tokenizer,
        vocab_size,
        train_path,
        train_tokens: n_train,
        val_path,
        val_tokens: n_val,
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
        assert!(err.to_string().contains("val.bin"), "{err}");
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
}
