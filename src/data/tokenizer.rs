//! Tokenizers: bytes, GPT-2's BPE, and any Hugging Face `tokenizer.json`
//! (loaded, or trained here as byte-level BPE).
//!
//! Owns turning text into token ids and back, and the rule that says which
//! tokenizer a model may be used with: a tokenizer whose ids reach past the
//! model's vocabulary is refused, naming both sizes, never silently mapped
//! through another tokenizer. Hugging Face tokenizers go through the
//! `tokenizers` crate (the implementation behind every "fast" tokenizer in
//! transformers), never a BPE of our own. Never downloads anything.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::token_file::DataError;

/// The file a tokenizer lives in inside a weights folder, a run folder or a
/// prepared dataset (Hugging Face's name).
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// What `AutoTokenizer` reads beside `tokenizer.json` to choose its class.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// GPT-2's vocabulary and the widest padding of it in use (nanoGPT rounds to
/// 50 304, a multiple of 64); a larger vocabulary is some other tokenizer's.
const GPT2_VOCAB: usize = 50_257;
const GPT2_PADDED_MAX: usize = 50_304;

/// Special tokens that end a document, in the order they are looked for in a
/// Hugging Face tokenizer: GPT-2 and Qwen2, Llama 3, Llama 2 and Mistral,
/// Gemma.
const END_OF_TEXT_NAMES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// How text becomes tokens.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// Each byte is a token (vocab 256).
    Bytes,
    /// GPT-2's BPE (`r50k_base` from tiktoken-rs, vocab 50257).
    Gpt2,
    /// A Hugging Face `tokenizer.json`.
    HuggingFace(Arc<HfTokenizer>),
}

impl PartialEq for Tokenizer {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Tokenizer::Bytes, Tokenizer::Bytes) | (Tokenizer::Gpt2, Tokenizer::Gpt2) => true,
            (Tokenizer::HuggingFace(a), Tokenizer::HuggingFace(b)) => a.hash == b.hash,
            _ => false,
        }
    }
}

/// A loaded `tokenizer.json` with what we need to know about it.
pub struct HfTokenizer {
    /// Where it was read from.
    pub path: PathBuf,
    /// The file's bytes, copied as they are into prepared datasets and runs.
    pub json: Vec<u8>,
    /// blake3 of `json`, hex: what manifests record.
    pub hash: String,
    /// One more than the largest id it can produce (added tokens included).
    pub vocab_size: usize,
    /// The id of its end-of-document token, if it has one of the known names.
    pub end_of_text: Option<u32>,
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("hash", &self.hash)
            .finish()
    }
}

impl HfTokenizer {
    /// Reads `path`: a `tokenizer.json`, or a folder holding one.
    pub fn open(path: &Path) -> Result<HfTokenizer, DataError> {
        let file = if path.is_dir() { path.join(TOKENIZER_FILE) } else { path.to_path_buf() };
        let json =
            crate::fsutil::read_regular(&file, crate::fsutil::memory_cap(), "this machine's memory holds")
                .map_err(|error| match error.kind() {
                    std::io::ErrorKind::NotFound if path.is_dir() => DataError::Invalid {
                        what: format!(
                    "tokenizer folder {}: holds no {TOKENIZER_FILE} (expected a Hugging Face tokenizer file)",
                    path.display()
                ),
                    },
                    std::io::ErrorKind::NotFound => DataError::Invalid {
                        what: format!(
                    "tokenizer {}: no such file (expected \"bytes\", \"gpt2\", a {TOKENIZER_FILE} or a \
                         folder holding one)",
                    file.display()
                ),
                    },
                    _ => DataError::Io { path: file.clone(), action: "read", error },
                })?;
        HfTokenizer::from_bytes(&file, json)
    }

    /// A tokenizer from a `tokenizer.json`'s bytes; `path` names it in errors.
    pub fn from_bytes(path: &Path, json: Vec<u8>) -> Result<HfTokenizer, DataError> {
        let mut inner = tokenizers::Tokenizer::from_bytes(&json).map_err(|e| DataError::Invalid {
            what: format!("tokenizer {}: not a Hugging Face tokenizer.json: {e}", path.display()),
        })?;
        // Corpus text is text: a literal "<|endoftext|>" in a document stays
        // characters, as with GPT-2's tokenizer here and nanoGPT's scripts.
        inner.set_encode_special_tokens(true);
        let vocab = inner.get_vocab(true);
        // BTreeMap-free: the maximum is the same whatever the map's order.
        let vocab_size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        if vocab_size == 0 {
            return Err(DataError::Invalid {
                what: format!("tokenizer {}: has no tokens (expected a vocabulary)", path.display()),
            });
        }
        let end_of_text = END_OF_TEXT_NAMES.iter().find_map(|name| inner.token_to_id(name));
        Ok(HfTokenizer {
            path: path.to_path_buf(),
            hash: blake3::hash(&json).to_hex().to_string(),
            json,
            vocab_size,
            end_of_text,
            inner,
        })
    }

    /// The crate's tokenizer, for what this type does not wrap.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl Tokenizer {
    /// `bytes`, `gpt2`, or a path to a `tokenizer.json` or a folder holding one.
    pub fn from_arg(arg: &str) -> Result<Tokenizer, DataError> {
        match arg {
            "bytes" => Ok(Tokenizer::Bytes),
            "gpt2" => Ok(Tokenizer::Gpt2),
            "" => Err(DataError::Invalid {
                what: "tokenizer: empty (expected \"bytes\", \"gpt2\", a tokenizer.json or a folder holding one)"
                    .into(),
            }),
            path => Ok(Tokenizer::HuggingFace(Arc::new(HfTokenizer::open(Path::new(path))?))),
        }
    }

    /// The tokenizer that goes with the weights in `folder`: its own
    /// `tokenizer.json` if it has one.
    pub fn beside_weights(folder: &Path) -> Result<Option<Tokenizer>, DataError> {
        let file = folder.join(TOKENIZER_FILE);
        if !file.exists() {
            return Ok(None);
        }
        Ok(Some(Tokenizer::HuggingFace(Arc::new(HfTokenizer::open(&file)?))))
    }

    /// The tokenizer a model of this vocabulary was trained with when its
    /// folder holds none: bytes up to 256, GPT-2's BPE for 50 257 (padded
    /// up to 50 304). Anything else needs its own tokenizer: GPT-2's would
    /// never produce (or print) the ids above 50 256.
    pub fn for_vocab(vocab_size: usize) -> Option<Tokenizer> {
        match vocab_size {
            1..=256 => Some(Tokenizer::Bytes),
            GPT2_VOCAB..=GPT2_PADDED_MAX => Some(Tokenizer::Gpt2),
            _ => None,
        }
    }

    /// A short name for messages and manifests.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Bytes => "bytes".into(),
            Tokenizer::Gpt2 => "gpt2".into(),
            Tokenizer::HuggingFace(t) => t.path.display().to_string(),
        }
    }

    /// One more than the largest id it produces: the smallest `model.vocab_size`.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Gpt2 => GPT2_VOCAB,
            Tokenizer::HuggingFace(t) => t.vocab_size,
        }
    }

    /// Refuses a tokenizer whose ids reach past the model's vocabulary.
    pub fn check_covers(&self, model_vocab: usize) -> Result<(), DataError> {
        let v = self.vocab_size();
        if v > model_vocab {
            return Err(DataError::Invalid {
                what: format!(
                    "tokenizer {} has {v} tokens but model.vocab_size is {model_vocab}: the model cannot \
                     read or write ids {model_vocab}..{v} (expected the tokenizer the model was trained with)",
                    self.describe()
                ),
            });
        }
        Ok(())
    }

    /// The token that separates documents; bytes have none.
    pub fn end_of_text(&self) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Gpt2 => Some(50256),
            Tokenizer::HuggingFace(t) => t.end_of_text,
        }
    }

    /// Text as tokens; a literal special token's name is ordinary text, and
    /// no beginning-of-text token is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(match self {
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2 => tiktoken_rs::r50k_base_singleton().encode_ordinary(text),
            Tokenizer::HuggingFace(t) => t
                .inner
                .encode_fast(text, false)
                .map_err(|e| DataError::Invalid {
                    what: format!("tokenizer {}: cannot encode text: {e}", t.path.display()),
                })?
                .get_ids()
                .to_vec(),
        })
    }

    /// A decoder that prints tokens as they come: whole characters only,
    /// holding back a token that ends inside one.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream { tok: self, ids: Vec::new(), printed: 0 }
    }

    /// The tokenizer's `tokenizer.json` bytes, when it has one.
    pub fn json(&self) -> Option<&[u8]> {
        match self {
            Tokenizer::HuggingFace(t) => Some(&t.json),
            _ => None,
        }
    }

    /// What a manifest records: the kind and, for a file, its blake3.
    pub fn hash(&self) -> String {
        match self {
            Tokenizer::Bytes => "bytes".into(),
            Tokenizer::Gpt2 => "tiktoken:r50k_base".into(),
            Tokenizer::HuggingFace(t) => format!("blake3:{}", t.hash),
        }
    }

    fn decode_all(&self, ids: &[u32]) -> Vec<u8> {
        match self {
            Tokenizer::Bytes => ids.iter().filter_map(|&t| u8::try_from(t).ok()).collect(),
            Tokenizer::Gpt2 => {
                let bpe = tiktoken_rs::r50k_base_singleton();
                ids.iter().flat_map(|&t| bpe.decode_bytes(&[t]).unwrap_or_default()).collect()
            }
            Tokenizer::HuggingFace(t) => t.inner.decode(ids, false).unwrap_or_default().into_bytes(),
        }
    }
}

/// Incremental decoding for `generate`: each step returns the bytes that the
/// tokens so far add to the text.
///
/// Byte-level tokenizers (GPT-2, Llama 3) may end a token inside a UTF-8
/// character, and SentencePiece ones (Mistral) decode a token differently
/// after another; so the whole text is decoded again and only what grew is
/// handed out, and a tail that ends in a replacement character waits for the
/// next token. Quadratic in the text's length, which a generation's few
/// hundred tokens never notice.
pub struct TextStream<'a> {
    tok: &'a Tokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl TextStream<'_> {
    pub fn step(&mut self, id: u32) -> Vec<u8> {
        self.ids.push(id);
        match self.tok {
            // Bytes and GPT-2's ranks are bytes already: print them as they come.
            Tokenizer::Bytes | Tokenizer::Gpt2 => self.tok.decode_all(&[id]),
            Tokenizer::HuggingFace(_) => {
                let text = self.tok.decode_all(&self.ids);
                if text.len() <= self.printed || text.ends_with("\u{FFFD}".as_bytes()) {
                    return Vec::new();
                }
                let new = text[self.printed..].to_vec();
                self.printed = text.len();
                new
            }
        }
    }

    /// What is still held back at the end (an unfinished character).
    pub fn finish(&mut self) -> Vec<u8> {
        match self.tok {
            Tokenizer::Bytes | Tokenizer::Gpt2 => Vec::new(),
            Tokenizer::HuggingFace(_) => {
                let text = self.tok.decode_all(&self.ids);
                let rest = text.get(self.printed..).unwrap_or_default().to_vec();
                self.printed = text.len();
                rest
            }
        }
    }
}

/// Which pre-tokenizer regex a trained tokenizer splits text with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitPattern {
    /// GPT-2's: contractions, letters, digits, punctuation, spaces.
    Gpt2,
    /// Llama 3's (tiktoken's cl100k): digits in groups of up to three,
    /// case-insensitive contractions, newlines kept apart.
    Llama3,
}

impl std::str::FromStr for SplitPattern {
    type Err = DataError;
    fn from_str(s: &str) -> Result<Self, DataError> {
        match s {
            "gpt2" => Ok(SplitPattern::Gpt2),
            "llama3" => Ok(SplitPattern::Llama3),
            other => Err(DataError::Invalid {
                what: format!("pattern: got {other:?}, expected \"gpt2\" or \"llama3\""),
            }),
        }
    }
}

/// Llama 3's pre-tokenizer regex, as its tokenizer.json writes it.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How `tokenizer train` trains.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSettings {
    /// Tokens in the result, special tokens and the 256 byte tokens included.
    pub vocab_size: usize,
    /// Given ids 0, 1, … in this order.
    pub special_tokens: Vec<String>,
    pub pattern: SplitPattern,
    /// Pairs seen fewer times are never merged.
    pub min_frequency: u64,
    /// Draw the trainer's progress bars (on a terminal).
    pub show_progress: bool,
}

impl TrainSettings {
    pub fn check(&self) -> Result<(), DataError> {
        let least = 256 + self.special_tokens.len();
        if self.vocab_size < least {
            return Err(DataError::Invalid {
                what: format!(
                    "--vocab-size: {}: expected at least {least} (256 byte tokens and {} special tokens)",
                    self.vocab_size,
                    self.special_tokens.len()
                ),
            });
        }
        let mut seen = std::collections::BTreeSet::new();
        for s in &self.special_tokens {
            if s.is_empty() || !seen.insert(s) {
                return Err(DataError::Invalid {
                    what: format!("--special: {s:?}: expected distinct, non-empty tokens"),
                });
            }
        }
        Ok(())
    }
}

/// Trains byte-level BPE over `documents` and returns the tokenizer.json's
/// text. The result depends only on the documents (in any order) and the
/// settings: merges are picked by count, ties by the pair's ids, and the
/// file lists the vocabulary by id. The pre-tokenizer is GPT-2's ByteLevel
/// (its own regex) or Llama 3's Split regex followed by ByteLevel without
/// one, as their tokenizer.json files have them, so transformers loads the
/// result and encodes as we do.
pub fn train_bpe<I>(documents: I, s: &TrainSettings) -> Result<String, DataError>
where
    I: Iterator<Item = String> + Send,
{
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern as HfPattern};
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::{AddedToken, SplitDelimiterBehavior, TokenizerImpl};
    s.check()?;
    let failed = |e: tokenizers::Error| DataError::Invalid { what: format!("tokenizer training: {e}") };
    let pre: PreTokenizerWrapper = match s.pattern {
        SplitPattern::Gpt2 => ByteLevel::new(false, true, true).into(),
        SplitPattern::Llama3 => {
            let split =
                Split::new(HfPattern::Regex(LLAMA3_PATTERN.into()), SplitDelimiterBehavior::Isolated, false)
                    .map_err(failed)?;
            Sequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
        }
    };
    let specials: Vec<AddedToken> =
        s.special_tokens.iter().map(|t| AddedToken::from(t.clone(), true)).collect();
    let mut trainer: tokenizers::models::TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(s.vocab_size)
        .min_frequency(s.min_frequency)
        .show_progress(s.show_progress)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tok: TokenizerImpl<
        tokenizers::models::ModelWrapper,
        tokenizers::normalizers::NormalizerWrapper,
        PreTokenizerWrapper,
        tokenizers::processors::PostProcessorWrapper,
        tokenizers::decoders::DecoderWrapper,
    > = TokenizerImpl::new(BPE::default().into());
    tok.with_pre_tokenizer(Some(pre));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    tok.train(&mut trainer, documents).map_err(failed)?;
    tok.to_string(true).map_err(failed)
}

/// Writes `tokenizer_config.json` beside a tokenizer.json so that
/// transformers' `AutoTokenizer` opens the folder as a fast tokenizer of
/// exactly that file (without it, AutoTokenizer guesses the class from
/// config.json's model_type, and some classes add their own rules).
pub fn tokenizer_config_json(tok: &HfTokenizer) -> String {
    let mut config = serde_json::Map::new();
    config.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
    if let Some(id) = tok.end_of_text {
        if let Some(name) = tok.inner.id_to_token(id) {
            config.insert("eos_token".into(), name.into());
        }
    }
    config.insert("model_max_length".into(), serde_json::Value::from(1_000_000_000_u64));
    let mut text = serde_json::to_string_pretty(&serde_json::Value::Object(config)).expect("plain JSON");
    text.push('\n');
    text
}

/// Copies `tok`'s tokenizer.json (and a tokenizer_config.json for
/// AutoTokenizer) into `dir`, each written whole under its final name.
pub fn save_beside(tok: &Tokenizer, dir: &Path) -> Result<(), DataError> {
    let Tokenizer::HuggingFace(t) = tok else { return Ok(()) };
    crate::data::shards::write_atomic(&dir.join(TOKENIZER_FILE), &t.json)?;
    crate::data::shards::write_atomic(&dir.join(TOKENIZER_CONFIG_FILE), tokenizer_config_json(t).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> Vec<String> {
        let base = [
            "The quick brown fox jumps over the lazy dog. ",
            "Pack my box with five dozen liquor jugs! ",
            "Numbers 12345 and 678, once more: 12345. ",
            "Ünïcödé text — 数字 and naïve café. ",
        ];
        (0..200).map(|i| format!("{} {}", base[i % 4].repeat(1 + i % 3), i)).collect()
    }

    fn train(pattern: SplitPattern, vocab: usize) -> String {
        let s = TrainSettings {
            vocab_size: vocab,
            special_tokens: vec!["<|endoftext|>".into()],
            pattern,
            min_frequency: 2,
            show_progress: false,
        };
        train_bpe(corpus().into_iter(), &s).unwrap()
    }

    fn load(json: &str) -> Tokenizer {
        Tokenizer::HuggingFace(Arc::new(HfTokenizer::from_bytes(Path::new("t.json"), json.into()).unwrap()))
    }

    #[test]
    fn training_twice_gives_the_same_file_byte_for_byte_in_any_document_order() {
        for pattern in [SplitPattern::Gpt2, SplitPattern::Llama3] {
            let a = train(pattern, 400);
            assert_eq!(a, train(pattern, 400));
            let s = TrainSettings {
                vocab_size: 400,
                special_tokens: vec!["<|endoftext|>".into()],
                pattern,
                min_frequency: 2,
                show_progress: false,
            };
            let reversed = train_bpe(corpus().into_iter().rev(), &s).unwrap();
            assert_eq!(a, reversed, "{pattern:?}");
        }
    }

    #[test]
    fn a_trained_tokenizer_round_trips_text_and_has_its_vocab_size() {
        for pattern in [SplitPattern::Gpt2, SplitPattern::Llama3] {
            let tok = load(&train(pattern, 300));
            assert_eq!(tok.vocab_size(), 300);
            assert_eq!(tok.end_of_text(), Some(0));
            let text = "The lazy fox, 9876 naïve cafés — 数字!\n\n  end";
            let ids = tok.encode(text).unwrap();
            assert!(ids.len() < text.len(), "merges shorten text: {}", ids.len());
            let mut stream = tok.stream();
            let out: Vec<u8> = ids.iter().flat_map(|&t| stream.step(t)).collect();
            assert_eq!(String::from_utf8(out).unwrap(), text);
            // A literal special token in text is text.
            let lit = tok.encode("a<|endoftext|>b").unwrap();
            assert!(!lit.contains(&0), "{lit:?}");
        }
    }

    #[test]
    fn llama3_pattern_groups_digits_by_three() {
        let tok = load(&train(SplitPattern::Llama3, 300));
        let Tokenizer::HuggingFace(t) = &tok else { unreachable!() };
        let enc = t.inner().encode("1234567", false).unwrap();
        // Pieces never cross a group of three digits: 123|456|7.
        let text: Vec<String> = enc.get_tokens().to_vec();
        let joined = text.join("|");
        assert!(!joined.contains("1234") && !joined.contains("4567"), "{joined}");
    }

    #[test]
    fn a_tokenizer_wider_than_the_model_is_refused_naming_both_sizes() {
        let tok = load(&train(SplitPattern::Gpt2, 300));
        let err = tok.check_covers(280).unwrap_err().to_string();
        assert!(err.contains("300 tokens") && err.contains("model.vocab_size is 280"), "{err}");
        tok.check_covers(300).unwrap();
        assert!(Tokenizer::Gpt2.check_covers(50_000).is_err());
    }

    #[test]
    fn the_fallback_tokenizer_follows_the_vocabulary_size_and_refuses_llama3s() {
        assert_eq!(Tokenizer::for_vocab(256), Some(Tokenizer::Bytes));
        assert_eq!(Tokenizer::for_vocab(50_304), Some(Tokenizer::Gpt2));
        assert_eq!(Tokenizer::for_vocab(128_256), None);
        assert_eq!(Tokenizer::for_vocab(1000), None);
    }

    #[test]
    fn bad_tokenizer_arguments_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_arg(dir.path().to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("holds no tokenizer.json"), "{err}");
        let f = dir.path().join("tokenizer.json");
        std::fs::write(&f, "{\"not\": 1}").unwrap();
        let err = Tokenizer::from_arg(f.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("not a Hugging Face tokenizer.json") && err.contains("tokenizer.json"), "{err}");
        let err = Tokenizer::from_arg("nowhere.json").unwrap_err().to_string();
        assert!(err.contains("no such file"), "{err}");
        let s = TrainSettings {
            vocab_size: 100,
            special_tokens: vec![],
            pattern: SplitPattern::Gpt2,
            min_frequency: 0,
            show_progress: false,
        };
        assert!(s.check().unwrap_err().to_string().contains("at least 256"));
    }
}
