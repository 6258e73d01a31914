//! The bodies of the fuzz targets in `fuzz/`: the config parser, the token
//! file header and the checkpoint loader, each fed arbitrary bytes.
//!
//! They live in the library, not in the fuzz crate, so that plain `cargo test`
//! on stable (no libFuzzer, no nightly) runs every seed and every input a fuzz
//! run once crashed on through exactly the code the fuzzer runs. Each returns
//! normally for any input: bad input is an `Err` from the code under test,
//! which must name the file or field it blames. A panic here is a bug, either
//! in the code under test or in a property asserted below. Each returns
//! whether the input was accepted, so the corpus test can tell that a seed
//! still reaches past the first check. Nothing here touches the filesystem.

use std::collections::BTreeMap;
use std::path::Path;

use crate::checkpoint::{self, CheckpointError};
use crate::config::Config;
use crate::data::token_file::{self, TokenFormat, LLMC_HEADER_BYTES};

/// Names the fuzzed config in errors.
pub const CONFIG_ORIGIN: &str = "fuzz.toml";

/// A config file, then `--set` arguments, separated by NUL bytes (which TOML
/// text cannot contain). Parsed, validated, and the resolved config (what a
/// checkpoint stores and a resume parses again) must read back the same.
/// Accepted: it parsed (valid or not).
pub fn config(data: &[u8]) -> bool {
    // `Config::load` reads files as UTF-8 and rejects anything else before parsing.
    let Ok(text) = std::str::from_utf8(data) else { return false };
    let mut pieces = text.split('\0');
    let toml = pieces.next().unwrap_or_default();
    let overrides: Vec<String> = pieces.map(str::to_string).collect();
    let cfg = match Config::parse(toml, CONFIG_ORIGIN, &overrides) {
        Ok(cfg) => cfg,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(CONFIG_ORIGIN) || msg.contains("--set"), "error names no source: {msg}");
            return false;
        }
    };
    let valid = cfg.validate().is_ok();
    if valid && small_model(&cfg) {
        // Every run derives the parameter count from a validated config first.
        let _ = cfg.arch().num_params();
    }
    let resolved = cfg.to_toml_string();
    let again = Config::parse(&resolved, "resolved", &[])
        .unwrap_or_else(|e| panic!("the resolved config does not parse back: {e}\n{resolved}"));
    // Compared as text: NaN is a legal (if invalid) float and never equals itself.
    assert_eq!(again.to_toml_string(), resolved, "the resolved config changes when read back");
    assert_eq!(again.validate().is_ok(), valid, "validation differs after a round trip");
    assert_eq!(again.hash(), cfg.hash());
    true
}

/// Names the fuzzed token file in errors.
pub const TOKEN_FILE_PATH: &str = "fuzz.bin";

/// A token file's whole contents, checked as `TokenFile::open` checks a file,
/// against vocabularies on both sides of the 16-bit boundary.
pub fn token_file(data: &[u8]) -> bool {
    let path = Path::new(TOKEN_FILE_PATH);
    let mut accepted = false;
    for vocab_size in [0, 256, 50_257, 65_536, 100_277, usize::MAX] {
        match token_file::check_token_bytes(path, data, vocab_size) {
            Ok((format, len)) => {
                let header = if format == TokenFormat::RawU16 { 0 } else { LLMC_HEADER_BYTES };
                assert!(len > 0, "accepted a file without tokens");
                assert_eq!(header + len * format.width(), data.len(), "tokens do not fill the file");
                accepted = true;
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains(TOKEN_FILE_PATH), "error does not name the file: {msg}");
            }
        }
    }
    accepted
}

/// Separates the files of a checkpoint input.
pub const CHECKPOINT_SEPARATOR: &[u8] = b"\n--8<--\n";
/// The checkpoint directory the fuzzed files are served from.
pub const CHECKPOINT_DIR: &str = "fuzz-ckpt/step_00000001";

/// A checkpoint directory as bytes: a flags byte, then `state.json`,
/// `model.safetensors` and `optimizer.safetensors` separated by
/// [`CHECKPOINT_SEPARATOR`]; a file with no piece is missing. With flag bit 0
/// set, the digests in `state.json` (when it is a JSON object) are replaced by
/// the pieces' true blake3, so the fuzzer gets past the digest check into the
/// safetensors parser instead of stopping at a hash it cannot forge.
pub fn checkpoint(data: &[u8]) -> bool {
    let Some((&flags, rest)) = data.split_first() else { return false };
    let mut pieces = split(rest, CHECKPOINT_SEPARATOR);
    let names = ["state.json", "model.safetensors", "optimizer.safetensors"];
    if flags & 1 == 1 && pieces.len() >= 2 {
        if let Ok(serde_json::Value::Object(mut state)) = serde_json::from_slice(pieces[0]) {
            let digests: serde_json::Map<String, serde_json::Value> = names[1..]
                .iter()
                .zip(&pieces[1..])
                .map(|(n, p)| (n.to_string(), blake3::hash(p).to_hex().to_string().into()))
                .collect();
            state.insert("digests".into(), digests.into());
            let mut fixed = serde_json::to_vec(&state).expect("a JSON map serializes");
            // Sealed too, so the fuzzer gets past state.json's own digest.
            if let Ok(mut s) = serde_json::from_slice::<checkpoint::StateFile>(&fixed) {
                fixed = checkpoint::seal(&mut s).into_bytes();
            }
            return load_pieces(&names, &replace_first(&pieces, &fixed));
        }
    }
    pieces.truncate(names.len());
    load_pieces(&names, &pieces)
}

fn replace_first<'a>(pieces: &[&'a [u8]], first: &'a [u8]) -> Vec<&'a [u8]> {
    std::iter::once(first).chain(pieces[1..].iter().copied()).collect()
}

fn load_pieces(names: &[&str], pieces: &[&[u8]]) -> bool {
    let dir = Path::new(CHECKPOINT_DIR);
    let files: BTreeMap<_, _> = names.iter().zip(pieces).map(|(n, p)| (dir.join(n), p.to_vec())).collect();
    let read = |path: &Path| {
        files.get(path).cloned().ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
    };
    let loaded = match checkpoint::load_with(dir, read) {
        Ok(loaded) => loaded,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(CHECKPOINT_DIR), "error does not name a file of the checkpoint: {msg}");
            if let CheckpointError::Io { path, .. } = &e {
                assert!(!files.contains_key(path), "a file that is there was reported unreadable: {msg}");
            }
            return false;
        }
    };
    for (name, (shape, data)) in &loaded.weights.tensors {
        let (m, v) = &loaded.moments[name];
        let numel: usize = shape.iter().product();
        assert_eq!((data.len(), m.len(), v.len()), (numel, numel, numel), "tensor `{name}` is incomplete");
    }
    // What a resume does next with the checkpoint's own config.
    if let Ok(cfg) = Config::parse(&loaded.state.config, "state.json", &[]) {
        if cfg.validate().is_ok() && small_model(&cfg) {
            let _ = loaded.weights.check(&cfg.arch());
        }
    }
    true
}

/// Listing a model's tensors costs time in its layer count; the fuzzer would
/// otherwise spend its time on configs of a billion layers.
fn small_model(cfg: &Config) -> bool {
    cfg.model.n_layer <= 64
}

fn split<'a>(data: &'a [u8], separator: &[u8]) -> Vec<&'a [u8]> {
    let mut pieces = Vec::new();
    let mut rest = data;
    while let Some(at) = rest.windows(separator.len()).position(|w| w == separator) {
        pieces.push(&rest[..at]);
        rest = &rest[at + separator.len()..];
    }
    pieces.push(rest);
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keeps_empty_pieces_and_the_tail() {
        assert_eq!(split(b"a--b----", b"--"), vec![&b"a"[..], b"b", b"", b""]);
        assert_eq!(split(b"abc", b"--"), vec![&b"abc"[..]]);
    }

    #[test]
    fn empty_inputs_are_handled_without_a_panic() {
        // An empty config file takes every default.
        assert!(config(b""));
        assert!(!token_file(b""));
        assert!(!checkpoint(b""));
    }
}
