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

    /// The token that separates documents (GPT-2's `<|endoftext|>`); bytes have none.
    pub fn end_of_text(self) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Gpt2 => Some(50256),
        }
    }

    /// Text as tokens; a literal `<|endoftext|>` is ordinary text.
    pub fn encode(self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2 => tiktoken_rs::r50k_base_singleton().encode_ordinary(text),
        }
    }

    /// One token's bytes (a GPT-2 token may hold part of a UTF-8 character);
    /// empty for an id the tokenizer does not know.
    pub fn decode(self, token: u32) -> Vec<u8> {
        match self {
            Tokenizer::Bytes => u8::try_from(token).map(|b| vec![b]).unwrap_or_default(),
            Tokenizer::Gpt2 => tiktoken_rs::r50k_base_singleton().decode_bytes(&[token]).unwrap_or_default(),
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
    /// Files read, each one document.
    pub documents: usize,
    pub tokenizer: Tokenizer,
    /// Put this in `model.vocab_size`.
    pub vocab_size: usize,
    pub train_path: PathBuf,
    pub train_tokens: usize,
    /// `None` when `val_fraction` is 0.
    pub val_path: Option<PathBuf>,
    pub val_tokens: usize,
    /// Files reached twice (through links) and read once, in words (each
    /// also logged as a warning).
    pub warnings: Vec<String>,
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

/// Tokenizes `inputs` (text files, or folders whose files are read in name
/// order, subfolders included) and writes `out_dir/train.bin` and (unless
/// `val_fraction` is 0) `out_dir/val.bin`; val is the last `val_fraction` of
/// the tokens, rounded to a whole token, so no token is in both. Each file is
/// one document; GPT-2's end-of-text token separates documents (bytes have
/// none). Creates `out_dir` if needed. Refuses to replace existing outputs
/// unless `force`.
///
/// With `Bytes` the input may be any bytes; with `Gpt2` it must be UTF-8.
/// Text is encoded as ordinary text: a literal `<|endoftext|>` in the file is
/// tokenized as characters, not as the special token, as nanoGPT's scripts do.
pub fn prepare_all(
    inputs: &[PathBuf],
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
    let (files, warnings) = documents(inputs)?;
    let mut tokens: Vec<u32> = Vec::new();
    for (i, file) in files.iter().enumerate() {
        if i > 0 {
            tokens.extend(tokenizer.end_of_text());
        }
        tokens.extend(tokenize_file(file, tokenizer)?);
    }
    let input = match files.as_slice() {
        [one] => one.display().to_string(),
        many => format!("{} files", many.len()),
    };
    let input = Path::new(&input);

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
        documents: files.len(),
        tokenizer,
        vocab_size,
        train_path,
        train_tokens: n_train,
        val_path,
        val_tokens: n_val,
        warnings,
    })
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

/// One document's tokens; non-UTF-8 text is refused for GPT-2, naming the file.
fn tokenize_file(input: &Path, tokenizer: Tokenizer) -> Result<Vec<u32>, DataError> {
    let cap = crate::fsutil::memory_cap();
    let bytes = crate::fsutil::read_regular(input, cap, "this machine's memory holds").map_err(|error| {
        if error.kind() == std::io::ErrorKind::NotFound {
            DataError::Invalid { what: format!("text file {}: no such file", input.display()) }
        } else {
            DataError::Io { path: input.to_path_buf(), action: "read", error }
        }
    })?;
    Ok(match tokenizer {
        Tokenizer::Bytes => bytes.iter().map(|&b| b as u32).collect(),
        Tokenizer::Gpt2 => {
            let text = std::str::from_utf8(&bytes)
                .map_err(|e| DataError::NotUtf8 { path: input.to_path_buf(), offset: e.valid_up_to() })?;
            tiktoken_rs::r50k_base_singleton().encode_ordinary(text)
        }
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
