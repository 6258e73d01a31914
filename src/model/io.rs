//! Weights in and out: safetensors files with Hugging Face's names and
//! layouts (GPT-2's as `GPT2LMHeadModel` saves them, Llama's as
//! `LlamaForCausalLM` does, `model.` prefix included), and the
//! layout-independent weights digest, over pipewright's own names.
//!
//! Files are written to a temporary name in the same directory, synced and then
//! renamed, so a crash never leaves a half-written file under the final name.
//! Reading never panics on bad bytes: every problem names the file.

use super::params::{all_tensors, Arch, Family};
use super::{ModelPart, Param};
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The `__metadata__` key under which a run stores its resolved config TOML.
pub const CONFIG_METADATA_KEY: &str = "pipewright.config";

/// The file a checkpoint directory keeps its weights in.
pub const MODEL_FILE: &str = "model.safetensors";

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: not a valid safetensors file: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("{path}: tensor `{name}` is missing (expected shape {expected:?})")]
    Missing { path: PathBuf, name: String, expected: Vec<usize> },
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape { path: PathBuf, name: String, got: Vec<usize>, expected: Vec<usize> },
    #[error("{path}: tensor `{name}` has dtype {got}, expected F32")]
    Dtype { path: PathBuf, name: String, got: String },
    #[error(
        "{path}: tensor `{name}` is not part of this model ({count} such tensor(s); expected exactly the \
         {expected} tensors of a {family} with n_layer = {n_layer}: is the file from a larger model, or \
         another family (model.family)?)"
    )]
    Unexpected { path: PathBuf, name: String, count: usize, expected: usize, family: Family, n_layer: usize },
    #[error(
        "{path}: tensors `{first}` and `{second}` are both `{canonical}` (one with Hugging Face's \
         `transformer.` or `model.` prefix, one without): expected each tensor once"
    )]
    Duplicate { path: PathBuf, first: String, second: String, canonical: String },
}

/// Model tensors gathered from parts, by HF name, each exactly once (the
/// head's copy of the tied wte is skipped when the embedding is present).
pub fn gather<'a>(parts: &[&'a ModelPart]) -> BTreeMap<String, (&'a [usize], &'a [f32])> {
    gather_params(parts.iter().flat_map(|p| p.params.iter()))
}

/// The same from a list of parameters (for example all stages' of a pipeline).
pub fn gather_params<'a>(
    params: impl IntoIterator<Item = &'a Param>,
) -> BTreeMap<String, (&'a [usize], &'a [f32])> {
    let mut out = BTreeMap::new();
    for p in params {
        out.entry(p.name.clone()).or_insert((p.shape.as_slice(), p.data.as_slice()));
    }
    out
}

/// blake3 over every tensor in sorted-name order: name, then the values as
/// little-endian f32. Equal weights give equal digests whatever the layout.
pub fn weights_digest(parts: &[&ModelPart]) -> String {
    digest_of(&gather(parts))
}

pub fn digest_of(tensors: &BTreeMap<String, (&[usize], &[f32])>) -> String {
    let mut h = blake3::Hasher::new();
    for (name, (_, data)) in tensors {
        h.update(name.as_bytes());
        for x in data.iter() {
            h.update(&x.to_le_bytes());
        }
    }
    h.finalize().to_hex().to_string()
}

/// A tensor's name in a file: Llama's body lives under `model.` in
/// `LlamaForCausalLM`'s files (its head, `lm_head.weight`, does not);
/// GPT-2's names are written as they are, which `GPT2LMHeadModel` reads.
pub fn file_name_of(name: &str) -> std::borrow::Cow<'_, str> {
    let llama_body = name.starts_with("layers.") || name == "embed_tokens.weight" || name == "norm.weight";
    match llama_body {
        true => format!("model.{name}").into(),
        false => name.into(),
    }
}

fn to_le_bytes(x: &[f32]) -> Vec<u8> {
    let mut v = Vec::with_capacity(x.len() * 4);
    for f in x {
        v.extend_from_slice(&f.to_le_bytes());
    }
    v
}

/// Writes `tensors` as safetensors (F32) with `metadata`, atomically.
pub fn save(
    path: &Path,
    tensors: &BTreeMap<String, (&[usize], &[f32])>,
    metadata: HashMap<String, String>,
) -> Result<(), WeightsError> {
    let buf = to_safetensors(path, tensors, metadata)?;
    write_atomic(path, &buf).map_err(|error| WeightsError::Io { path: path.to_path_buf(), error })
}

/// The bytes of a safetensors file (F32) holding `tensors`; `path` only names
/// the file in errors.
pub fn to_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, (&[usize], &[f32])>,
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, WeightsError> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, (s, d))| (file_name_of(n).into_owned(), s.to_vec(), to_le_bytes(d)))
        .collect();
    let views = bytes.iter().map(|(n, s, b)| {
        (
            n.clone(),
            safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).expect("shape matches data"),
        )
    });
    let format = |msg: String| WeightsError::Format { path: path.to_path_buf(), msg };
    let buf = safetensors::serialize(views, Some(metadata)).map_err(|e| format(e.to_string()))?;
    sorted_header(buf).map_err(format)
}

/// safetensors writes the metadata map in `HashMap` order, which differs from
/// one map to the next: the header is rewritten with sorted keys so that the
/// same tensors always give the same bytes (replay compares checkpoint files
/// by digest). Readers look tensors up by name and offsets, never by order.
fn sorted_header(buf: Vec<u8>) -> Result<Vec<u8>, String> {
    let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes")) as usize;
    let mut head: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&buf[8..8 + n]).map_err(|e| e.to_string())?;
    if let Some(m) = head.get_mut("__metadata__") {
        let sorted: BTreeMap<String, serde_json::Value> =
            serde_json::from_value(m.take()).map_err(|e| e.to_string())?;
        *m = serde_json::to_value(sorted).map_err(|e| e.to_string())?;
    }
    let mut text = serde_json::to_vec(&head).map_err(|e| e.to_string())?;
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + text.len() + buf.len() - 8 - n);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(&buf[8 + n..]);
    Ok(out)
}

/// Write to `path.tmp`, fsync, rename over `path`, fsync the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(e) = written {
        // A full disk: the partial copy only holds space, and the old file is untouched.
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Tensors read from a file, by name, as f32.
pub struct LoadedWeights {
    pub path: PathBuf,
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    pub metadata: HashMap<String, String>,
    /// `transformer.` (Hugging Face's GPT2LMHeadModel) or `model.`
    /// (LlamaForCausalLM) when the file names its tensors so: errors name
    /// tensors as the file does.
    pub prefix: String,
    /// What the file holds that loading drops though it matters (a head
    /// that differs from wte), each also logged as a warning.
    pub warnings: Vec<String>,
}

/// The safetensors file a weights argument names: the path itself, or a
/// folder's `model.safetensors` (a run, a checkpoint, a `save_pretrained` folder).
pub fn weights_file(path: &Path) -> std::path::PathBuf {
    if path.is_dir() {
        path.join(MODEL_FILE)
    } else {
        path.to_path_buf()
    }
}

/// Weights for a model of `cfg`'s shape from a safetensors file or a folder
/// holding `model.safetensors` (a run, a checkpoint, a Hugging Face
/// `save_pretrained` folder). A position table longer than `cfg.block_size`
/// keeps its first rows, as nanoGPT crops GPT-2's 1024 (said on stderr).
pub fn load_for(path: &Path, cfg: &Arch) -> Result<LoadedWeights, WeightsError> {
    let mut w = load(&weights_file(path))?;
    w.fit(cfg)?;
    Ok(w)
}

/// Reads a safetensors file. Accepts Hugging Face's `transformer.` and
/// `model.` prefixes and ignores the attention mask buffers GPT-2
/// checkpoints carry beside the weights. `lm_head.weight` is kept: a tied
/// model drops it when fitted (see [`LoadedWeights::fit`]).
pub fn load(path: &Path) -> Result<LoadedWeights, WeightsError> {
    let cap = crate::fsutil::memory_cap();
    let buf = crate::fsutil::read_regular(path, cap, "this machine's memory holds")
        .map_err(|error| WeightsError::Io { path: path.to_path_buf(), error })?;
    parse(path, &buf)
}

/// [`load`] for a file's bytes already in memory; `path` names them in errors.
pub fn parse(path: &Path, buf: &[u8]) -> Result<LoadedWeights, WeightsError> {
    let fmt = |msg: String| WeightsError::Format { path: path.to_path_buf(), msg };
    let st = SafeTensors::deserialize(buf).map_err(|e| fmt(e.to_string()))?;
    let (_, meta) = SafeTensors::read_metadata(buf).map_err(|e| fmt(e.to_string()))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let mut tensors = HashMap::new();
    // The name each tensor had in the file, by the name it is loaded under.
    let mut spelled: HashMap<String, String> = HashMap::new();
    let mut prefix = String::new();
    for (file_name, view) in st.tensors() {
        let stripped = ["transformer.", "model."].iter().find_map(|p| Some((*p, file_name.strip_prefix(p)?)));
        let name = match stripped {
            Some((p, n)) => {
                prefix = p.to_string();
                n.to_string()
            }
            None => file_name.clone(),
        };
        if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
            continue;
        }
        // `wte.weight` beside `transformer.wte.weight`: which one a HashMap
        // kept would decide the model, so neither is chosen.
        if let Some(other) = spelled.insert(name.clone(), file_name.clone()) {
            let (first, second) = if other < file_name { (other, file_name) } else { (file_name, other) };
            return Err(WeightsError::Duplicate { path: path.to_path_buf(), first, second, canonical: name });
        }
        if view.dtype() != Dtype::F32 {
            return Err(WeightsError::Dtype {
                path: path.to_path_buf(),
                name: file_name,
                got: format!("{:?}", view.dtype()),
            });
        }
        let data: Vec<f32> =
            view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        tensors.insert(name, (view.shape().to_vec(), data));
    }
    Ok(LoadedWeights { path: path.to_path_buf(), tensors, metadata, prefix, warnings: Vec::new() })
}

/// Whether a file's head holds exactly the token embedding (as a tied model
/// saves it), bit for bit.
fn head_is_wte(head: &(Vec<usize>, Vec<f32>), wte: Option<&(Vec<usize>, Vec<f32>)>) -> bool {
    let Some((shape, data)) = wte else { return false };
    head.0 == *shape
        && head.1.len() == data.len()
        && head.1.iter().zip(data).all(|(a, b)| a.to_bits() == b.to_bits())
}

impl LoadedWeights {
    /// A tensor's name as the file spells it.
    pub fn file_name(&self, name: &str) -> String {
        match self.prefix.as_str() {
            "model." => file_name_of(name).into_owned(),
            p => format!("{p}{name}"),
        }
    }

    /// Crops the position table to `cfg.block_size` (saying so on stderr),
    /// drops a tied model's `lm_head.weight` (warning, naming it, when it is
    /// not the embedding: that head is not the one trained), then checks
    /// every tensor against `cfg`.
    pub fn fit(&mut self, cfg: &Arch) -> Result<(), WeightsError> {
        if cfg.tied() {
            if let Some(head) = self.tensors.remove("lm_head.weight") {
                let embed = super::params::embedding_tensors(cfg).remove(0).0;
                if !head_is_wte(&head, self.tensors.get(&embed)) {
                    // Hugging Face writes the head without the body's prefix.
                    let w = format!(
                        "{}: `lm_head.weight` differs from `{}` and is ignored: this model's output head is tied \
                         to it",
                        self.path.display(),
                        self.file_name(&embed)
                    );
                    tracing::warn!("{w}");
                    self.warnings.push(w);
                }
            }
        }
        if let Some(rows) = self.crop_positions(cfg.block_size) {
            tracing::warn!(
                "{}: `{}` holds {rows} positions; using the first {} (model.block_size)",
                self.path.display(),
                self.file_name("wpe.weight"),
                cfg.block_size
            );
        }
        self.check(cfg)
    }

    /// Keeps the first `block_size` rows of `wpe.weight` when it holds more;
    /// returns how many it held.
    pub fn crop_positions(&mut self, block_size: usize) -> Option<usize> {
        let (shape, data) = self.tensors.get_mut("wpe.weight")?;
        if shape.len() != 2 || shape[0] <= block_size {
            return None;
        }
        let rows = shape[0];
        data.truncate(block_size * shape[1]);
        shape[0] = block_size;
        Some(rows)
    }

    /// Checks that every tensor of `cfg`'s model is present with its shape,
    /// and that there is nothing else: extra tensors mean the file was made
    /// for another model, and loading part of it would pass silently.
    pub fn check(&self, cfg: &Arch) -> Result<(), WeightsError> {
        let all = all_tensors(cfg);
        let known: std::collections::HashSet<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
        let mut extra: Vec<&String> = self.tensors.keys().filter(|n| !known.contains(n.as_str())).collect();
        if !extra.is_empty() {
            // Sorted, so the tensor named does not depend on hash order.
            extra.sort();
            return Err(WeightsError::Unexpected {
                path: self.path.clone(),
                name: self.file_name(extra[0]),
                count: extra.len(),
                expected: all.len(),
                family: cfg.family,
                n_layer: cfg.n_layer,
            });
        }
        for (name, expected) in all {
            match self.tensors.get(&name) {
                None => {
                    return Err(WeightsError::Missing {
                        path: self.path.clone(),
                        name: self.file_name(&name),
                        expected,
                    })
                }
                Some((got, _)) if *got != expected => {
                    return Err(WeightsError::Shape {
                        path: self.path.clone(),
                        name: self.file_name(&name),
                        got: got.clone(),
                        expected,
                    })
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Copies the weights into a part (after `check`).
    pub fn assign(&self, part: &mut ModelPart) -> Result<(), WeightsError> {
        self.assign_params(&mut part.params)
    }

    /// Copies the weights into parameters (after `check`), by name.
    pub fn assign_params(&self, params: &mut [Param]) -> Result<(), WeightsError> {
        for p in params {
            let (shape, data) = self.tensors.get(&p.name).ok_or_else(|| WeightsError::Missing {
                path: self.path.clone(),
                name: self.file_name(&p.name),
                expected: p.shape.clone(),
            })?;
            if *shape != p.shape {
                return Err(WeightsError::Shape {
                    path: self.path.clone(),
                    name: self.file_name(&p.name),
                    got: shape.clone(),
                    expected: p.shape.clone(),
                });
            }
            p.data.copy_from_slice(data);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(n_layer: usize) -> Arch {
        Arch::gpt2(n_layer, 2, 8, 16, 4)
    }

    /// A safetensors file holding every tensor of `cfg` (zeros), each name
    /// passed through `rename`, plus `extra` tensors; parsed back.
    fn file_of(cfg: &Arch, rename: impl Fn(&str) -> String, extra: &[&str]) -> LoadedWeights {
        let mut owned: Vec<(String, Vec<usize>, Vec<f32>)> = all_tensors(cfg)
            .into_iter()
            .map(|(n, s)| {
                let len = s.iter().product();
                (rename(&n), s, vec![0.0; len])
            })
            .collect();
        for e in extra {
            owned.push((e.to_string(), vec![2, 2], vec![0.0; 4]));
        }
        let map: BTreeMap<String, (&[usize], &[f32])> =
            owned.iter().map(|(n, s, d)| (n.clone(), (s.as_slice(), d.as_slice()))).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        save(&path, &map, HashMap::new()).unwrap();
        load(&path).unwrap()
    }

    #[test]
    fn weights_of_a_larger_model_are_refused_naming_an_extra_tensor() {
        let w = file_of(&tiny(2), |n| n.to_string(), &[]);
        let err = w.check(&tiny(1)).unwrap_err();
        assert!(
            matches!(&err, WeightsError::Unexpected { name, count: 12, .. } if name == "h.1.attn.c_attn.bias")
        );
        let msg = err.to_string();
        assert!(msg.contains("w.safetensors") && msg.contains("`h.1.attn.c_attn.bias`"), "{msg}");
        assert!(w.check(&tiny(2)).is_ok());
    }

    #[test]
    fn an_unknown_tensor_is_refused() {
        let w = file_of(&tiny(1), |n| n.to_string(), &["h.0.attn.rotary.inv_freq"]);
        let err = w.check(&tiny(1)).unwrap_err();
        assert!(err.to_string().contains("h.0.attn.rotary.inv_freq"), "{err}");
    }

    #[test]
    fn hugging_face_extras_and_prefix_are_accepted() {
        let extras = ["lm_head.weight", "transformer.h.0.attn.bias", "transformer.h.0.attn.masked_bias"];
        let mut w = file_of(&tiny(1), |n| format!("transformer.{n}"), &extras);
        w.fit(&tiny(1)).unwrap();
    }

    #[test]
    fn errors_name_tensors_as_a_prefixed_file_names_them() {
        let w = file_of(&tiny(1), |n| format!("transformer.{n}"), &["transformer.h.0.mlp.extra"]);
        let err = w.check(&tiny(1)).unwrap_err().to_string();
        assert!(err.contains("`transformer.h.0.mlp.extra`"), "{err}");
        let w = file_of(&tiny(1), |n| format!("transformer.{n}"), &[]);
        let wide = Arch { n_embd: 12, ..tiny(1) };
        let err = w.check(&wide).unwrap_err().to_string();
        assert!(err.contains("`transformer.wte.weight`"), "{err}");
    }

    #[test]
    fn a_longer_position_table_is_cropped_to_block_size() {
        let long = Arch { block_size: 10, ..tiny(1) };
        let dir = tempfile::tempdir().unwrap();
        let mut owned: Vec<(String, Vec<usize>, Vec<f32>)> = vec![];
        for (n, s) in all_tensors(&long) {
            let len: usize = s.iter().product();
            owned.push((n, s, (0..len).map(|i| i as f32).collect()));
        }
        let map: BTreeMap<String, (&[usize], &[f32])> =
            owned.iter().map(|(n, s, d)| (n.clone(), (s.as_slice(), d.as_slice()))).collect();
        save(&dir.path().join("model.safetensors"), &map, HashMap::new()).unwrap();
        let w = load_for(dir.path(), &tiny(1)).unwrap();
        let (shape, data) = &w.tensors["wpe.weight"];
        assert_eq!(shape, &vec![4, 8]);
        assert_eq!(data, &(0..32).map(|i| i as f32).collect::<Vec<_>>());
        let err = load_for(dir.path(), &Arch { block_size: 11, ..tiny(1) }).err().unwrap().to_string();
        assert!(err.contains("`wpe.weight` has shape [10, 8], expected [11, 8]"), "{err}");
    }

    /// A file of `cfg`'s tensors (wte holding 1.0 everywhere, the rest
    /// zeros) plus `extra` named tensors shaped like wte, holding `value`.
    fn saved_with(cfg: &Arch, extra: &[(&str, f32)]) -> (tempfile::TempDir, PathBuf) {
        let mut owned: Vec<(String, Vec<usize>, Vec<f32>)> = all_tensors(cfg)
            .into_iter()
            .map(|(n, s)| {
                let len = s.iter().product();
                let fill = if n == "wte.weight" { 1.0 } else { 0.0 };
                (n, s, vec![fill; len])
            })
            .collect();
        let wte_shape = vec![cfg.vocab_size, cfg.n_embd];
        for (name, value) in extra {
            owned.push((name.to_string(), wte_shape.clone(), vec![*value; cfg.vocab_size * cfg.n_embd]));
        }
        let map: BTreeMap<String, (&[usize], &[f32])> =
            owned.iter().map(|(n, s, d)| (n.clone(), (s.as_slice(), d.as_slice()))).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        save(&path, &map, HashMap::new()).unwrap();
        (dir, path)
    }

    #[test]
    fn a_tensor_under_both_its_plain_and_its_prefixed_name_is_refused_naming_both() {
        // Equal values or not: which copy counts must never be a hash order's choice.
        for value in [5.0, 1.0] {
            let (_dir, path) = saved_with(&tiny(1), &[("transformer.wte.weight", value)]);
            let err = load(&path).err().expect("a duplicate is refused");
            assert!(matches!(&err, WeightsError::Duplicate { canonical, .. } if canonical == "wte.weight"));
            let msg = err.to_string();
            assert!(
                msg.contains("w.safetensors")
                    && msg.contains("`transformer.wte.weight` and `wte.weight`")
                    && msg.contains("both `wte.weight`"),
                "{msg}"
            );
        }
    }

    #[test]
    fn a_head_that_differs_from_wte_is_named_in_a_warning_and_one_equal_to_it_is_not() {
        let (_dir, path) = saved_with(&tiny(1), &[("lm_head.weight", 2.0)]);
        let mut w = load(&path).unwrap();
        w.fit(&tiny(1)).unwrap();
        assert_eq!(w.warnings.len(), 1, "{:?}", w.warnings);
        assert!(
            w.warnings[0].contains("`lm_head.weight` differs from `wte.weight`")
                && w.warnings[0].contains("w.safetensors"),
            "{}",
            w.warnings[0]
        );
        let (_dir, path) = saved_with(&tiny(1), &[("lm_head.weight", 1.0)]);
        assert!(load_for(&path, &tiny(1)).unwrap().warnings.is_empty());
    }

    #[test]
    fn the_same_tensors_and_metadata_give_the_same_file_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (shape, data) = (vec![2usize, 3], vec![1.5f32; 6]);
        let tensors: BTreeMap<String, (&[usize], &[f32])> =
            [("b".to_string(), (&shape[..], &data[..])), ("a".to_string(), (&shape[..], &data[..]))].into();
        let mut seen = Vec::new();
        // Each HashMap iterates in its own order: enough maps to see two orders.
        for i in 0..16 {
            let meta: HashMap<String, String> =
                [("format", "pt"), ("config", "x"), ("z", "1")].map(|(k, v)| (k.into(), v.into())).into();
            let p = dir.path().join(format!("{i}.safetensors"));
            save(&p, &tensors, meta).unwrap();
            seen.push(std::fs::read(&p).unwrap());
        }
        assert!(seen.iter().all(|b| b == &seen[0]));
        let loaded = load(&dir.path().join("0.safetensors")).unwrap();
        assert_eq!(loaded.tensors["a"], (shape, data));
        assert_eq!(loaded.metadata["format"], "pt");
    }

    #[test]
    fn llama_weights_are_written_as_llama_for_causal_lm_names_them_and_read_back() {
        for tied in [false, true] {
            let cfg = Arch { tie_word_embeddings: tied, ..Arch::llama(2, 4, 2, 8, 12, 16, 4, 1e4) };
            let part = ModelPart::new(cfg, crate::model::PartSpec::whole(&cfg), 1, 3, false);
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("model.safetensors");
            save(&path, &gather(&[&part]), HashMap::new()).unwrap();
            let raw = load(&path).unwrap();
            assert_eq!(raw.prefix, "model.");
            let bytes = std::fs::read(&path).unwrap();
            let names: Vec<String> =
                SafeTensors::deserialize(&bytes).unwrap().names().into_iter().map(String::from).collect();
            assert!(names.contains(&"model.layers.1.mlp.down_proj.weight".to_string()), "{names:?}");
            assert!(names.contains(&"model.embed_tokens.weight".to_string()));
            assert_eq!(names.contains(&"lm_head.weight".to_string()), !tied, "{names:?}");
            let w = load_for(&path, &cfg).unwrap();
            assert!(w.warnings.is_empty());
            for p in &part.params {
                assert_eq!(w.tensors[&p.name].1, p.data, "{}", p.name);
            }
        }
        // An untied model needs its head; the error names it as the file would.
        let untied = Arch::llama(2, 4, 2, 8, 12, 16, 4, 1e4);
        let tied = Arch { tie_word_embeddings: true, ..untied };
        let part = ModelPart::new(tied, crate::model::PartSpec::whole(&tied), 1, 3, false);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        save(&path, &gather(&[&part]), HashMap::new()).unwrap();
        let err = load_for(&path, &untied).err().unwrap().to_string();
        assert!(err.contains("tensor `lm_head.weight` is missing"), "{err}");
        // A GPT-2 file read as a Llama names the family.
        let (_gpt2_dir, gpt2) = saved_with(&tiny(1), &[]);
        let err = load_for(&gpt2, &untied).err().unwrap().to_string();
        assert!(err.contains("llama"), "{err}");
    }
}
