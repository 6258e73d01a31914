//! Weights in and out of files.
//!
//! Two kinds of file: pipewright's own (checkpoints, `eval`'s and replay's
//! inputs) keep our names and layouts under `model.` (the head without it),
//! which for the Llama-style families is exactly `…ForCausalLM`'s; the
//! run's final weights and `export` are the family's Hugging Face files,
//! through its adapter (`family.rs`): GPT-2's fused `c_attn` and `Conv1D`
//! layouts, a `model.safetensors` or shards with their index
//! (`model.safetensors.index.json`, as transformers writes them above
//! `max_shard_size`), in f32, bf16 or f16.
//!
//! Reading takes either kind: a file, a folder's `model.safetensors`, or a
//! folder's index and its shards (each checked against the index), one
//! shard in memory at a time; bf16 and f16 are widened to f32 exactly (every
//! bf16 and f16 value is an f32 value). A file's names are ours or the
//! family's; `fit` turns them into ours.
//!
//! Files are written to a temporary name in the same directory, synced and then
//! renamed, so a crash never leaves a half-written file under the final name.
//! Reading never panics on bad bytes: every problem names the file.

use super::family::FromHfError;
use super::params::{all_tensors, Arch};
use super::{ModelPart, Param};
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The `__metadata__` key under which a run stores its resolved config TOML.
pub const CONFIG_METADATA_KEY: &str = "pipewright.config";

/// The file a checkpoint directory keeps its weights in.
pub const MODEL_FILE: &str = "model.safetensors";

/// The index of a sharded folder (transformers' name).
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The name the model's weight files start with (`model.safetensors`, `model-00001-of-00002.safetensors`).
pub const MODEL_STEM: &str = "model";

/// The same for the EMA of the weights (`optim.ema_decay`) beside them: `model.ema.safetensors`, or
/// `model.ema-00001-of-00002.safetensors` and `model.ema.safetensors.index.json`.
pub const EMA_STEM: &str = "model.ema";

/// The EMA of the weights as one file, in a run folder and in a checkpoint.
pub const EMA_FILE: &str = "model.ema.safetensors";

/// transformers' default `max_shard_size`: 5 GB.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: not a valid safetensors file: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("{path}: {msg}")]
    Index { path: PathBuf, msg: String },
    #[error("{path}: tensor `{name}` is missing (expected shape {expected:?})")]
    Missing { path: PathBuf, name: String, expected: Vec<usize> },
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape { path: PathBuf, name: String, got: Vec<usize>, expected: Vec<usize> },
    #[error("{path}: tensor `{name}` has dtype {got}, expected F32, BF16 or F16")]
    Dtype { path: PathBuf, name: String, got: String },
    #[error(
        "{path}: tensor `{name}` is not part of this model ({count} such tensor(s); expected exactly the \
         {expected} tensors of a {family} with n_layer = {n_layer}: is the file from a larger model, or \
         another family (model.family)?)"
    )]
    Unexpected {
        path: PathBuf,
        name: String,
        count: usize,
        expected: usize,
        family: super::Family,
        n_layer: usize,
    },
    #[error(
        "{path}: tensors `{first}` and `{second}` are both `{canonical}` (one with Hugging Face's \
         `transformer.` or `model.` prefix, one without, or one in our names and one in the family's): \
         expected each tensor once"
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

/// A tensor's name in pipewright's own files: the body under `model.`, the
/// head (`lm_head.weight`) without it, as `LlamaForCausalLM` names them.
pub fn file_name_of(name: &str) -> std::borrow::Cow<'_, str> {
    match name {
        "lm_head.weight" => name.into(),
        _ => format!("model.{name}").into(),
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
    let named: BTreeMap<String, (&[usize], &[f32])> =
        tensors.iter().map(|(n, t)| (file_name_of(n).into_owned(), *t)).collect();
    named_safetensors(path, &named, metadata)
}

/// Writes `tensors` (F32) under exactly the names given, atomically: a file
/// another tool would write (tests craft Hugging Face files with it).
pub fn save_named(
    path: &Path,
    tensors: &BTreeMap<String, (&[usize], &[f32])>,
    metadata: HashMap<String, String>,
) -> Result<(), WeightsError> {
    let buf = named_safetensors(path, tensors, metadata)?;
    write_atomic(path, &buf).map_err(|error| WeightsError::Io { path: path.to_path_buf(), error })
}

fn named_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, (&[usize], &[f32])>,
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, WeightsError> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        tensors.iter().map(|(n, (s, d))| (n.clone(), s.to_vec(), to_le_bytes(d))).collect();
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

/// Tensors read from a file or a sharded folder, by name, as f32.
pub struct LoadedWeights {
    /// The file, or the index of a sharded folder.
    pub path: PathBuf,
    /// By the file's name (less a `transformer.` or `model.` prefix) until
    /// [`LoadedWeights::fit`], by our name after.
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    pub metadata: HashMap<String, String>,
    /// `transformer.` (Hugging Face's GPT2LMHeadModel) or `model.`
    /// (the Llama-style families, and pipewright's own files) when the
    /// file names its tensors so: errors name tensors as the file does.
    pub prefix: String,
    /// Each tensor's name as the file spells it, by the name it is held
    /// under, and the file it came from (a shard).
    spelled: HashMap<String, (String, PathBuf)>,
    /// What the file holds that loading drops though it matters (a head
    /// that differs from the embedding), each also logged as a warning.
    pub warnings: Vec<String>,
}

/// Where a weights argument's tensors are.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightsSource {
    /// One safetensors file.
    File(PathBuf),
    /// A folder's index and the shards it names, in name order.
    Sharded { index: PathBuf, shards: Vec<PathBuf>, weight_map: BTreeMap<String, String> },
}

/// The safetensors file a weights argument names: the path itself, or a
/// folder's `model.safetensors` (a run, a checkpoint, a `save_pretrained`
/// folder). A sharded folder's index when it has no such file.
pub fn weights_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        match (path.join(MODEL_FILE).exists(), path.join(INDEX_FILE).exists()) {
            (false, true) => path.join(INDEX_FILE),
            _ => path.join(MODEL_FILE),
        }
    } else {
        path.to_path_buf()
    }
}

/// Where the weights `path` names are: a file, a folder with
/// `model.safetensors`, or a folder (or its index) with shards. A folder
/// holding both a single file and an index is refused: which one is the
/// model would be a guess.
pub fn locate(path: &Path) -> Result<WeightsSource, WeightsError> {
    let (dir, index) = match path.file_name().and_then(|n| n.to_str()) {
        Some(n) if n.ends_with(".index.json") => {
            (path.parent().unwrap_or(Path::new(".")).to_path_buf(), path.to_path_buf())
        }
        _ if path.is_dir() => (path.to_path_buf(), path.join(INDEX_FILE)),
        _ => return Ok(WeightsSource::File(path.to_path_buf())),
    };
    // The single file of the same stem: an EMA's index sits beside the model's files.
    let index_name = index.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let stem = index_name.strip_suffix(".safetensors.index.json").unwrap_or(MODEL_STEM).to_string();
    let single = dir.join(format!("{stem}.safetensors"));
    if !crate::fsutil::is_present(&index).map_err(|error| WeightsError::Io { path: index.clone(), error })? {
        return Ok(WeightsSource::File(single));
    }
    if crate::fsutil::is_present(&single).unwrap_or(false) {
        return Err(WeightsError::Index {
            path: dir,
            msg: format!("holds both {stem}.safetensors and {index_name}: expected one model (remove one)"),
        });
    }
    let text =
        crate::fsutil::read_regular_to_string(&index, crate::fsutil::MAX_CONFIG_BYTES, "an index may hold")
            .map_err(|error| WeightsError::Io { path: index.clone(), error })?;
    let bad = |msg: String| WeightsError::Index { path: index.clone(), msg };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut weight_map = BTreeMap::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("`weight_map.{name}` is {file}, expected a file name")))?;
        // A shard is a file beside the index: no paths out of the folder.
        if file.contains('/') || file.contains('\\') || file == ".." || !file.ends_with(".safetensors") {
            return Err(bad(format!(
                "`weight_map.{name}` names {file:?}, expected a .safetensors file in the folder"
            )));
        }
        weight_map.insert(name.clone(), file.to_string());
    }
    if weight_map.is_empty() {
        return Err(bad("`weight_map` names no tensor".into()));
    }
    let named: std::collections::BTreeSet<&String> = weight_map.values().collect();
    let shards: Vec<PathBuf> = named.iter().map(|f| dir.join(f)).collect();
    for (f, p) in named.iter().zip(&shards) {
        if !p.is_file() {
            let tensor = weight_map.iter().find(|(_, s)| s == f).map(|(t, _)| t.as_str()).unwrap_or("");
            return Err(bad(format!("shard {f} (holding `{tensor}`, …) is missing from {}", dir.display())));
        }
    }
    // A shard the index does not name: the folder holds more model than the index says.
    let mut stray: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|error| WeightsError::Io { path: dir.clone(), error })?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".safetensors") && !named.contains(n))
        // The model's files beside its EMA's, or the other way round, are another set of weights.
        .filter(|n| ![MODEL_STEM, EMA_STEM].iter().any(|&s| s != stem && is_model_file_of(s, n)))
        .collect();
    stray.sort();
    if let Some(f) = stray.first() {
        return Err(bad(format!("{} holds shard {f}, which the index does not name", dir.display())));
    }
    Ok(WeightsSource::Sharded { index, shards, weight_map })
}

/// Weights for a model of `cfg`'s settings from any weights argument (see
/// [`locate`]), fitted (see [`LoadedWeights::fit`]).
pub fn load_for(path: &Path, cfg: &Arch) -> Result<LoadedWeights, WeightsError> {
    let mut w = load(path)?;
    w.fit(cfg)?;
    Ok(w)
}

/// Reads the weights `path` names (a file, a folder, a sharded folder), a
/// shard at a time. Accepts Hugging Face's `transformer.` and `model.`
/// prefixes; `lm_head.weight` is kept: a tied model drops it when fitted.
pub fn load(path: &Path) -> Result<LoadedWeights, WeightsError> {
    let source = match path.is_dir() || path.to_string_lossy().ends_with(".index.json") {
        true => locate(path)?,
        false => WeightsSource::File(path.to_path_buf()),
    };
    match source {
        WeightsSource::File(p) => {
            let buf = read_file(&p)?;
            parse(&p, &buf)
        }
        WeightsSource::Sharded { index, shards, weight_map } => {
            let mut all = LoadedWeights::empty(&index);
            all.metadata.insert("pipewright.shards".into(), shards.len().to_string());
            for shard in &shards {
                let buf = read_file(shard)?;
                let part = parse(shard, &buf)?;
                drop(buf);
                all.join_shard(part, &weight_map)?;
            }
            // Every tensor the index names came from its shard.
            if let Some((name, file)) =
                weight_map.iter().find(|(n, _)| !all.spelled.values().any(|(s, _)| s == *n))
            {
                return Err(WeightsError::Index {
                    path: index,
                    msg: format!("`{name}` is mapped to {file}, which does not hold it"),
                });
            }
            Ok(all)
        }
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, WeightsError> {
    let cap = crate::fsutil::memory_cap();
    crate::fsutil::read_regular(path, cap, "this machine's memory holds")
        .map_err(|error| WeightsError::Io { path: path.to_path_buf(), error })
}

/// The metadata of the weights `path` names, from the header alone (a
/// sharded folder's: its index's, then its first shard's).
pub fn read_metadata(path: &Path) -> Result<HashMap<String, String>, WeightsError> {
    let file = match locate(path)? {
        WeightsSource::File(p) => p,
        WeightsSource::Sharded { shards, .. } => shards[0].clone(),
    };
    let io = |error| WeightsError::Io { path: file.clone(), error };
    let fmt = |msg: String| WeightsError::Format { path: file.clone(), msg };
    let mut f = crate::fsutil::open_regular(&file).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let mut n = [0u8; 8];
    std::io::Read::read_exact(&mut f, &mut n)
        .map_err(|_| fmt(format!("{len} bytes is too short for a header")))?;
    let n = u64::from_le_bytes(n);
    // safetensors' own bound on a header.
    if n > 100_000_000 || n > len.saturating_sub(8) {
        return Err(fmt(format!("header length {n} does not fit in a file of {len} bytes")));
    }
    let mut header = vec![0u8; n as usize];
    std::io::Read::read_exact(&mut f, &mut header).map_err(io)?;
    let v: serde_json::Value = serde_json::from_slice(&header).map_err(|e| fmt(e.to_string()))?;
    let meta = v.get("__metadata__").and_then(|m| m.as_object());
    Ok(meta
        .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
        .unwrap_or_default())
}

/// f32 values of a tensor's little-endian bytes in `dtype` (bf16 and f16
/// widen exactly: every value of theirs is an f32 value).
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    match dtype {
        Dtype::F32 => {
            Some(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
        }
        Dtype::BF16 => Some(
            bytes
                .chunks_exact(2)
                .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
                .collect(),
        ),
        Dtype::F16 => {
            Some(bytes.chunks_exact(2).map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect())
        }
        _ => None,
    }
}

/// IEEE half precision to single, exactly (subnormals, infinities, NaN payloads).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let (exp, man) = (((h >> 10) & 0x1f) as u32, (h & 0x3ff) as u32);
    let bits = match (exp, man) {
        (0, 0) => sign,
        // Subnormal: man · 2^-24, normalised into f32's wider exponent.
        (0, m) => {
            let shift = m.leading_zeros() - 21;
            sign | ((127 - 15 + 1 - shift) << 23) | ((m << shift) & 0x3ff) << 13
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// f32 to bf16, rounding to nearest even once (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// f32 to f16, rounding to nearest even once (overflow to infinity, NaN stays NaN).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    // The value's significand with its hidden bit, and how far right it shifts.
    let (m, shift) = if e <= 0 { (man | 0x80_0000, (14 - e) as u32) } else { (man, 13) };
    if shift > 24 {
        return sign;
    }
    let half = 1u32 << (shift - 1);
    let rest = m & ((1 << shift) - 1);
    let mut out = (m >> shift) as u16;
    if rest > half || (rest == half && out & 1 == 1) {
        out += 1;
    }
    if e <= 0 {
        // Subnormal (a carry into the exponent field makes the smallest normal, as it should).
        sign | out
    } else {
        // A carry out of the mantissa bumps the exponent (up to infinity), as it should.
        sign | (((e as u16) << 10) + out)
    }
}

/// [`load`] for a file's bytes already in memory; `path` names them in errors.
pub fn parse(path: &Path, buf: &[u8]) -> Result<LoadedWeights, WeightsError> {
    let fmt = |msg: String| WeightsError::Format { path: path.to_path_buf(), msg };
    let st = SafeTensors::deserialize(buf).map_err(|e| fmt(e.to_string()))?;
    let (_, meta) = SafeTensors::read_metadata(buf).map_err(|e| fmt(e.to_string()))?;
    let mut w = LoadedWeights::empty(path);
    w.metadata = meta.metadata().clone().unwrap_or_default();
    let mut names = st.names();
    // Sorted, so which duplicate is named first does not depend on the header's order.
    names.sort();
    for file_name in names {
        let view = st.tensor(file_name).map_err(|e| fmt(e.to_string()))?;
        let stripped = ["transformer.", "model."].iter().find_map(|p| Some((*p, file_name.strip_prefix(p)?)));
        let name = match stripped {
            Some((p, n)) => {
                w.prefix = p.to_string();
                n.to_string()
            }
            None => file_name.to_string(),
        };
        // `wte.weight` beside `transformer.wte.weight`: which one a HashMap
        // kept would decide the model, so neither is chosen.
        if let Some((other, _)) = w.spelled.get(&name) {
            let (first, second) = sorted_pair(other, file_name);
            return Err(WeightsError::Duplicate { path: path.to_path_buf(), first, second, canonical: name });
        }
        let data = to_f32(view.dtype(), view.data()).ok_or_else(|| WeightsError::Dtype {
            path: path.to_path_buf(),
            name: file_name.to_string(),
            got: format!("{:?}", view.dtype()),
        })?;
        w.spelled.insert(name.clone(), (file_name.to_string(), path.to_path_buf()));
        w.tensors.insert(name, (view.shape().to_vec(), data));
    }
    Ok(w)
}

fn sorted_pair(a: &str, b: &str) -> (String, String) {
    if a < b {
        (a.to_string(), b.to_string())
    } else {
        (b.to_string(), a.to_string())
    }
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
    fn empty(path: &Path) -> Self {
        LoadedWeights {
            path: path.to_path_buf(),
            tensors: HashMap::new(),
            metadata: HashMap::new(),
            prefix: String::new(),
            spelled: HashMap::new(),
            warnings: Vec::new(),
        }
    }

    /// Takes one shard's tensors, each checked against the index.
    fn join_shard(
        &mut self,
        part: LoadedWeights,
        weight_map: &BTreeMap<String, String>,
    ) -> Result<(), WeightsError> {
        let shard = part.path.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        for (k, v) in part.metadata {
            self.metadata.entry(k).or_insert(v);
        }
        if !part.prefix.is_empty() {
            self.prefix = part.prefix;
        }
        let mut names: Vec<String> = part.tensors.keys().cloned().collect();
        names.sort();
        let mut tensors = part.tensors;
        for name in names {
            let (spelled, _) = part.spelled[&name].clone();
            match weight_map.get(&spelled) {
                Some(f) if *f == shard => {}
                Some(f) => {
                    return Err(WeightsError::Index {
                        path: self.path.clone(),
                        msg: format!("`{spelled}` is in shard {shard}, but the index maps it to {f}"),
                    })
                }
                None => {
                    return Err(WeightsError::Index {
                        path: self.path.clone(),
                        msg: format!("shard {shard} holds `{spelled}`, which the index does not name"),
                    })
                }
            }
            if let Some((other, other_shard)) = self.spelled.get(&name) {
                let (first, second) = sorted_pair(other, &spelled);
                let where_ = format!("{} and {shard}", other_shard.display());
                return Err(WeightsError::Duplicate {
                    path: PathBuf::from(where_),
                    first,
                    second,
                    canonical: name,
                });
            }
            self.spelled.insert(name.clone(), (spelled, part.path.clone()));
            let t = tensors.remove(&name).expect("a listed tensor");
            self.tensors.insert(name, t);
        }
        Ok(())
    }

    /// A tensor's name as the file spells it (`name` ours or the file's).
    pub fn file_name(&self, name: &str) -> String {
        match self.spelled.get(name) {
            Some((s, _)) => s.clone(),
            None if self.prefix == "model." => file_name_of(name).into_owned(),
            None => format!("{}{name}", self.prefix),
        }
    }

    /// The file a tensor came from (a shard of a sharded folder).
    fn file_of(&self, name: &str) -> PathBuf {
        self.spelled.get(name).map_or_else(|| self.path.clone(), |(_, p)| p.clone())
    }

    /// Turns the file's names into ours (our own files' names are ours; a
    /// family's Hugging Face names go through its adapter), crops a learned
    /// position table to `cfg.block_size` (saying so on stderr), drops a tied
    /// model's `lm_head.weight` (warning, naming it, when it is not the
    /// embedding: that head is not the one trained), then checks every
    /// tensor against `cfg`.
    pub fn fit(&mut self, cfg: &Arch) -> Result<(), WeightsError> {
        self.rename_to_ours(cfg)?;
        if cfg.tied() {
            if let Some(head) = self.tensors.remove("lm_head.weight") {
                let embed = "embed_tokens.weight";
                if !head_is_wte(&head, self.tensors.get(embed)) {
                    let w = format!(
                        "{}: `{}` differs from `{}` and is ignored: this model's output head is tied to it",
                        self.path.display(),
                        self.file_name("lm_head.weight"),
                        self.file_name(embed)
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
                self.file_name("embed_positions.weight"),
                cfg.block_size
            );
        }
        self.check(cfg)
    }

    /// The tensors under our names: a name of ours stays, any other goes
    /// through the family's adapter (GPT-2's `c_attn` becomes q, k and v).
    fn rename_to_ours(&mut self, cfg: &Arch) -> Result<(), WeightsError> {
        let spec = cfg.family.spec();
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        let known: std::collections::HashSet<String> = all_tensors(cfg).into_iter().map(|(n, _)| n).collect();
        let mut out = HashMap::new();
        let mut spelled: HashMap<String, (String, PathBuf)> = HashMap::new();
        let mut unknown = Vec::new();
        for name in names {
            let (shape, data) = self.tensors.remove(&name).expect("a listed tensor");
            let file = self.spelled.get(&name).cloned().unwrap_or_else(|| (name.clone(), self.path.clone()));
            let got = shape.clone();
            let ours = match known.contains(&name) || name == "lm_head.weight" {
                true => Ok(vec![(name.clone(), shape, data)]),
                false => (spec.from_hf)(cfg, &name, shape, data),
            };
            match ours {
                Ok(list) => {
                    for (n, s, d) in list {
                        if let Some((other, _)) = spelled.get(&n) {
                            let (first, second) = sorted_pair(other, &file.0);
                            return Err(WeightsError::Duplicate {
                                path: self.path.clone(),
                                first,
                                second,
                                canonical: n,
                            });
                        }
                        spelled.insert(n.clone(), file.clone());
                        out.insert(n, (s, d));
                    }
                }
                Err(FromHfError::Unknown) => unknown.push(file.0),
                Err(FromHfError::Shape { expected }) => {
                    return Err(WeightsError::Shape { path: file.1, name: file.0, got, expected })
                }
            }
        }
        if let Some(first) = unknown.iter().min() {
            return Err(WeightsError::Unexpected {
                path: self.path.clone(),
                name: first.clone(),
                count: unknown.len(),
                expected: cfg.tensor_count(),
                family: cfg.family,
                n_layer: cfg.n_layer,
            });
        }
        self.tensors = out;
        self.spelled = spelled;
        Ok(())
    }

    /// Keeps the first `block_size` rows of a learned position table when
    /// it holds more; returns how many it held.
    pub fn crop_positions(&mut self, block_size: usize) -> Option<usize> {
        let (shape, data) = self.tensors.get_mut("embed_positions.weight")?;
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
        let mut extra: Vec<String> =
            self.tensors.keys().filter(|n| !known.contains(n.as_str())).map(|n| self.file_name(n)).collect();
        if !extra.is_empty() {
            // Sorted, so the tensor named does not depend on hash order.
            extra.sort();
            return Err(WeightsError::Unexpected {
                path: self.path.clone(),
                name: extra[0].clone(),
                count: extra.len(),
                expected: all.len(),
                family: cfg.family,
                n_layer: cfg.n_layer,
            });
        }
        for (name, expected) in all {
            match self.tensors.get(&name) {
                None => {
                    let file = (cfg.family.spec().hf_name)(cfg, &name);
                    let spelled = match self.prefix.as_str() {
                        "" | "transformer." if file != name => file,
                        _ => self.file_name(&name),
                    };
                    return Err(WeightsError::Missing { path: self.path.clone(), name: spelled, expected });
                }
                Some((got, _)) if *got != expected => {
                    return Err(WeightsError::Shape {
                        path: self.file_of(&name),
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

    /// Copies the weights into a part (after `fit`).
    pub fn assign(&self, part: &mut ModelPart) -> Result<(), WeightsError> {
        self.assign_params(&mut part.params)
    }

    /// Copies the weights into parameters (after `fit`), by name.
    pub fn assign_params(&self, params: &mut [Param]) -> Result<(), WeightsError> {
        for p in params {
            let (shape, data) = self.tensors.get(&p.name).ok_or_else(|| WeightsError::Missing {
                path: self.path.clone(),
                name: self.file_name(&p.name),
                expected: p.shape.clone(),
            })?;
            if *shape != p.shape {
                return Err(WeightsError::Shape {
                    path: self.file_of(&p.name),
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

/// How an export stores its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreAs {
    F32,
    /// Rounded to nearest even, once.
    Bf16,
    F16,
}

impl StoreAs {
    pub fn parse(s: &str) -> Option<StoreAs> {
        match s {
            "f32" | "float32" => Some(StoreAs::F32),
            "bf16" | "bfloat16" => Some(StoreAs::Bf16),
            "f16" | "float16" => Some(StoreAs::F16),
            _ => None,
        }
    }

    fn dtype(self) -> Dtype {
        match self {
            StoreAs::F32 => Dtype::F32,
            StoreAs::Bf16 => Dtype::BF16,
            StoreAs::F16 => Dtype::F16,
        }
    }

    /// transformers' name, for `torch_dtype` in config.json.
    pub fn torch_name(self) -> &'static str {
        match self {
            StoreAs::F32 => "float32",
            StoreAs::Bf16 => "bfloat16",
            StoreAs::F16 => "float16",
        }
    }

    fn encode(self, x: &[f32]) -> Vec<u8> {
        match self {
            StoreAs::F32 => to_le_bytes(x),
            StoreAs::Bf16 => x.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect(),
            StoreAs::F16 => x.iter().flat_map(|&v| f32_to_f16(v).to_le_bytes()).collect(),
        }
    }
}

/// Writes the model's weights into `dir` as the family's Hugging Face files:
/// `model.safetensors`, or shards of at most `max_shard_bytes` each (a
/// tensor larger than that alone in its shard, as transformers does) with
/// `model.safetensors.index.json`; values stored as `store`; `metadata` in
/// every file. The files of another layout left in `dir` by an earlier
/// export are removed once the new ones are in place. Returns the files written.
pub fn export_hf(
    dir: &Path,
    arch: &Arch,
    tensors: &BTreeMap<String, (&[usize], &[f32])>,
    metadata: HashMap<String, String>,
    store: StoreAs,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>, WeightsError> {
    export_hf_as(dir, MODEL_STEM, arch, tensors, metadata, store, max_shard_bytes)
}

/// [`export_hf`] under another file stem: the EMA of the weights ([`EMA_STEM`])
/// is written by the same code, beside the model and in the same names.
pub fn export_hf_as(
    dir: &Path,
    stem: &str,
    arch: &Arch,
    tensors: &BTreeMap<String, (&[usize], &[f32])>,
    metadata: HashMap<String, String>,
    store: StoreAs,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>, WeightsError> {
    let ours: Vec<(&str, &[usize], &[f32])> =
        tensors.iter().map(|(n, (s, d))| (n.as_str(), *s, *d)).collect();
    let mut hf = (arch.family.spec().to_hf)(arch, ours);
    hf.sort_by(|a, b| natural_order(&a.0, &b.0));
    let width = if store == StoreAs::F32 { 4 } else { 2 };
    // Shards in name order, each filled up to the limit.
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut size = 0u64;
    for (i, (_, _, d)) in hf.iter().enumerate() {
        let bytes = (d.len() * width) as u64;
        if size > 0 && size + bytes > max_shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().expect("one shard").push(i);
        size += bytes;
    }
    let n = shards.len();
    let names: Vec<String> = match n {
        1 => vec![format!("{stem}.safetensors")],
        _ => (1..=n).map(|i| format!("{stem}-{i:05}-of-{n:05}.safetensors")).collect(),
    };
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (file, members) in names.iter().zip(&shards) {
        let path = dir.join(file);
        let encoded: Vec<(&str, &[usize], Vec<u8>)> =
            members.iter().map(|&i| (hf[i].0.as_str(), hf[i].1.as_slice(), store.encode(&hf[i].2))).collect();
        let views = encoded.iter().map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(store.dtype(), shape.to_vec(), bytes)
                .expect("shape matches data");
            (name.to_string(), view)
        });
        let format = |msg: String| WeightsError::Format { path: path.clone(), msg };
        let buf = safetensors::serialize(views, Some(metadata.clone())).map_err(|e| format(e.to_string()))?;
        let buf = sorted_header(buf).map_err(format)?;
        write_atomic(&path, &buf).map_err(|error| WeightsError::Io { path: path.clone(), error })?;
        for (name, _, bytes) in &encoded {
            weight_map.insert(name.to_string(), file.clone());
            total += bytes.len() as u64;
        }
        written.push(path);
    }
    let index = dir.join(format!("{stem}.safetensors.index.json"));
    if n > 1 {
        let v = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let text = serde_json::to_string_pretty(&v).expect("an index serializes") + "\n";
        write_atomic(&index, text.as_bytes())
            .map_err(|error| WeightsError::Io { path: index.clone(), error })?;
        written.push(index.clone());
    }
    // What an earlier export of another layout left: a single file, an index, shards.
    let stale =
        std::fs::read_dir(dir).map_err(|error| WeightsError::Io { path: dir.to_path_buf(), error })?;
    for e in stale.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let ours = written.iter().any(|w| w.file_name().is_some_and(|f| f.to_string_lossy() == name));
        if is_model_file_of(stem, &name) && !ours {
            std::fs::remove_file(e.path()).map_err(|error| WeightsError::Io { path: e.path(), error })?;
        }
    }
    Ok(written)
}

/// Whether a file name is one of a model's weight files as [`export_hf`]
/// (and transformers) write them: the single file, the index, or a shard.
pub fn is_model_file(name: &str) -> bool {
    is_model_file_of(MODEL_STEM, name)
}

/// [`is_model_file`] for the files [`export_hf_as`] writes under `stem`.
pub fn is_model_file_of(stem: &str, name: &str) -> bool {
    let Some(rest) = name.strip_prefix(stem) else { return false };
    rest == ".safetensors"
        || rest == ".safetensors.index.json"
        || (rest.starts_with('-') && rest.ends_with(".safetensors"))
}

/// Names in the order people read them: `layers.2` before `layers.10`.
fn natural_order(a: &str, b: &str) -> std::cmp::Ordering {
    let key = |s: &str| -> Vec<(String, u64)> {
        let mut out = Vec::new();
        let mut word = String::new();
        let mut num: Option<u64> = None;
        for ch in s.chars() {
            match (ch.to_digit(10), num) {
                (Some(d), Some(n)) => num = Some(n.saturating_mul(10).saturating_add(d as u64)),
                (Some(d), None) => num = Some(d as u64),
                (None, Some(n)) => {
                    out.push((std::mem::take(&mut word), n));
                    num = None;
                    word.push(ch);
                }
                (None, None) => word.push(ch),
            }
        }
        out.push((word, num.unwrap_or(0)));
        out
    };
    key(a).cmp(&key(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(n_layer: usize) -> Arch {
        Arch::gpt2(n_layer, 2, 8, 16, 4)
    }

    /// Values for every tensor of `cfg`, by our names: the token table 1.0
    /// everywhere, the rest counting up.
    fn ours(cfg: &Arch) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        all_tensors(cfg)
            .into_iter()
            .map(|(n, s)| {
                let len: usize = s.iter().product();
                let data = if n == "embed_tokens.weight" {
                    vec![1.0; len]
                } else {
                    (0..len).map(|i| i as f32).collect()
                };
                (n, s, data)
            })
            .collect()
    }

    /// A file with exactly these tensors under exactly these names.
    fn write_raw(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
            tensors.iter().map(|(n, s, d)| (n.clone(), s.clone(), to_le_bytes(d))).collect();
        let views = bytes.iter().map(|(n, s, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap())
        });
        std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
    }

    /// `cfg`'s tensors as GPT-2's Hugging Face files name them, each name
    /// through `rename`, plus `extra` tensors shaped like wte holding `value`.
    fn hf_file(
        cfg: &Arch,
        rename: impl Fn(&str) -> String,
        extra: &[(&str, f32)],
    ) -> (tempfile::TempDir, PathBuf) {
        let owned = ours(cfg);
        let refs = owned.iter().map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice())).collect();
        let mut hf: Vec<(String, Vec<usize>, Vec<f32>)> = (cfg.family.spec().to_hf)(cfg, refs)
            .into_iter()
            .map(|(n, s, d)| (rename(&n), s, d.into_owned()))
            .collect();
        for (name, value) in extra {
            hf.push((
                name.to_string(),
                vec![cfg.vocab_size, cfg.n_embd],
                vec![*value; cfg.vocab_size * cfg.n_embd],
            ));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        write_raw(&path, &hf);
        (dir, path)
    }

    /// A pipewright file (our names) of `cfg`'s tensors plus `extra` names.
    fn our_file(cfg: &Arch, extra: &[&str]) -> (tempfile::TempDir, PathBuf) {
        let mut owned = ours(cfg);
        for e in extra {
            owned.push((e.to_string(), vec![2, 2], vec![0.0; 4]));
        }
        let map: BTreeMap<String, (&[usize], &[f32])> =
            owned.iter().map(|(n, s, d)| (n.clone(), (s.as_slice(), d.as_slice()))).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        save(&path, &map, HashMap::new()).unwrap();
        (dir, path)
    }

    #[test]
    fn weights_of_a_larger_model_are_refused_naming_an_extra_tensor() {
        let (_d, path) = our_file(&tiny(2), &[]);
        let mut w = load(&path).unwrap();
        let err = w.fit(&tiny(1)).unwrap_err();
        assert!(
            matches!(&err, WeightsError::Unexpected { name, count: 16, .. } if name == "model.layers.1.input_layernorm.bias"),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("w.safetensors") && msg.contains("`model.layers.1.input_layernorm.bias`"),
            "{msg}"
        );
        assert!(load_for(&path, &tiny(2)).is_ok());
        // The same in GPT-2's own names.
        let (_d, path) = hf_file(&tiny(2), |n| n.to_string(), &[]);
        let err = load_for(&path, &tiny(1)).err().unwrap().to_string();
        assert!(err.contains("`h.1.attn.c_attn.bias`") && err.contains("12 such"), "{err}");
    }

    #[test]
    fn an_unknown_tensor_is_refused() {
        let (_d, path) = our_file(&tiny(1), &["layers.0.self_attn.rotary.inv_freq"]);
        let err = load_for(&path, &tiny(1)).err().unwrap();
        assert!(err.to_string().contains("model.layers.0.self_attn.rotary.inv_freq"), "{err}");
    }

    #[test]
    fn hugging_face_extras_and_prefix_are_accepted_and_give_our_tensors() {
        let extras = [
            ("lm_head.weight", 1.0),
            ("transformer.h.0.attn.bias", 0.0),
            ("transformer.h.0.attn.masked_bias", 0.0),
        ];
        let (_d, path) = hf_file(&tiny(1), |n| format!("transformer.{n}"), &extras);
        let w = load_for(&path, &tiny(1)).unwrap();
        assert!(w.warnings.is_empty(), "{:?}", w.warnings);
        for (n, s, d) in ours(&tiny(1)) {
            assert_eq!(w.tensors[&n], (s, d), "{n}");
        }
    }

    #[test]
    fn errors_name_tensors_as_a_prefixed_file_names_them() {
        let (_d, path) =
            hf_file(&tiny(1), |n| format!("transformer.{n}"), &[("transformer.h.0.mlp.extra", 0.0)]);
        let err = load_for(&path, &tiny(1)).err().unwrap().to_string();
        assert!(err.contains("`transformer.h.0.mlp.extra`"), "{err}");
        let (_d, path) = hf_file(&tiny(1), |n| format!("transformer.{n}"), &[]);
        let wide = Arch::gpt2(1, 2, 12, 16, 4);
        let err = load_for(&path, &wide).err().unwrap().to_string();
        assert!(
            err.contains("`transformer.h.0.attn.c_attn.bias`") || err.contains("`transformer.wte.weight`"),
            "{err}"
        );
    }

    #[test]
    fn a_longer_position_table_is_cropped_to_block_size() {
        let long = Arch { block_size: 10, ..tiny(1) };
        let (_d, path) = hf_file(&long, |n| n.to_string(), &[]);
        let w = load_for(&path, &tiny(1)).unwrap();
        let (shape, data) = &w.tensors["embed_positions.weight"];
        assert_eq!(shape, &vec![4, 8]);
        assert_eq!(data, &(0..32).map(|i| i as f32).collect::<Vec<_>>());
        let err = load_for(&path, &Arch { block_size: 11, ..tiny(1) }).err().unwrap().to_string();
        assert!(err.contains("`wpe.weight` has shape [10, 8], expected [11, 8]"), "{err}");
    }

    #[test]
    fn a_tensor_under_both_its_plain_and_its_prefixed_name_is_refused_naming_both() {
        // Equal values or not: which copy counts must never be a hash order's choice.
        for value in [5.0, 1.0] {
            let (_dir, path) = hf_file(&tiny(1), |n| n.to_string(), &[("transformer.wte.weight", value)]);
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
        // Our name beside the family's for one tensor.
        let (_dir, path) = hf_file(&tiny(1), |n| n.to_string(), &[("embed_tokens.weight", 1.0)]);
        let err = load_for(&path, &tiny(1)).err().expect("a duplicate is refused").to_string();
        assert!(err.contains("`embed_tokens.weight` and `wte.weight`"), "{err}");
    }

    #[test]
    fn a_head_that_differs_from_wte_is_named_in_a_warning_and_one_equal_to_it_is_not() {
        let (_dir, path) = hf_file(&tiny(1), |n| n.to_string(), &[("lm_head.weight", 2.0)]);
        let w = load_for(&path, &tiny(1)).unwrap();
        assert_eq!(w.warnings.len(), 1, "{:?}", w.warnings);
        assert!(
            w.warnings[0].contains("`lm_head.weight` differs from `wte.weight`")
                && w.warnings[0].contains("w.safetensors"),
            "{}",
            w.warnings[0]
        );
        let (_dir, path) = hf_file(&tiny(1), |n| n.to_string(), &[("lm_head.weight", 1.0)]);
        assert!(load_for(&path, &tiny(1)).unwrap().warnings.is_empty());
    }

    #[test]
    fn bf16_and_f16_widen_exactly_and_round_to_nearest_even_once() {
        for x in [0.0f32, -0.0, 1.0, -2.5, 1e-8, 65504.0, 3.0e38, f32::INFINITY, 1.0 + f32::EPSILON] {
            let b = f32_to_bf16(x);
            assert_eq!(f32_to_bf16(f32::from_bits((b as u32) << 16)), b, "bf16 of {x} is a fixed point");
            let h = f32_to_f16(x);
            assert_eq!(f32_to_f16(f16_to_f32(h)), h, "f16 of {x} is a fixed point");
        }
        // Ties go to even: 1 + 2^-8 is halfway between bf16's 1 and 1 + 2^-7.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), f32_to_bf16(1.0));
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), f32_to_bf16(1.0 + 4.0 / 256.0));
        assert_eq!(f16_to_f32(f32_to_f16(1.0 + 1.0 / 2048.0)), 1.0);
        assert_eq!(
            f16_to_f32(f32_to_f16(65520.0)),
            f32::INFINITY,
            "past f16's largest finite value, rounded"
        );
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24), "the smallest subnormal");
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert!(f16_to_f32(0x7e00).is_nan() && f32::from_bits((f32_to_bf16(f32::NAN) as u32) << 16).is_nan());
        // Every f16 value round-trips through f32.
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            if !x.is_nan() {
                assert_eq!(f32_to_f16(x), h, "{h:#06x}");
            }
        }
    }

    #[test]
    fn an_export_sharded_in_bf16_loads_back_as_its_rounded_values() {
        for cfg in [tiny(2), Arch::llama(2, 4, 2, 8, 12, 16, 4, 1e4)] {
            let part = ModelPart::new(cfg, crate::model::PartSpec::whole(&cfg), 1, 3, false);
            let dir = tempfile::tempdir().unwrap();
            let files =
                export_hf(dir.path(), &cfg, &gather(&[&part]), HashMap::new(), StoreAs::Bf16, 200).unwrap();
            assert!(files.len() > 2 && files.last().unwrap().ends_with(INDEX_FILE), "{files:?}");
            let w = load_for(dir.path(), &cfg).unwrap();
            for p in &part.params {
                let want: Vec<f32> =
                    p.data.iter().map(|&x| f32::from_bits((f32_to_bf16(x) as u32) << 16)).collect();
                assert_eq!(w.tensors[&p.name].1, want, "{}", p.name);
            }
            // A second export in f32 and one file replaces the shards.
            export_hf(
                dir.path(),
                &cfg,
                &gather(&[&part]),
                HashMap::new(),
                StoreAs::F32,
                DEFAULT_MAX_SHARD_BYTES,
            )
            .unwrap();
            let left: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            assert_eq!(left, [MODEL_FILE]);
            let w = load_for(dir.path(), &cfg).unwrap();
            for p in &part.params {
                assert_eq!(w.tensors[&p.name].1, p.data, "{}", p.name);
            }
        }
    }

    #[test]
    fn a_sharded_folder_is_checked_against_its_index() {
        let cfg = tiny(2);
        let part = ModelPart::new(cfg, crate::model::PartSpec::whole(&cfg), 1, 3, false);
        let fresh = || {
            let dir = tempfile::tempdir().unwrap();
            export_hf(dir.path(), &cfg, &gather(&[&part]), HashMap::new(), StoreAs::F32, 3000).unwrap();
            dir
        };
        let index = |d: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(d.join(INDEX_FILE)).unwrap()).unwrap()
        };
        let write_index =
            |d: &Path, v: &serde_json::Value| std::fs::write(d.join(INDEX_FILE), v.to_string()).unwrap();
        let shards = |d: &Path| -> Vec<PathBuf> {
            let mut v: Vec<PathBuf> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("model-"))
                .collect();
            v.sort();
            v
        };
        // A missing shard.
        let d = fresh();
        assert!(shards(d.path()).len() >= 3);
        std::fs::remove_file(&shards(d.path())[1]).unwrap();
        let err = load_for(d.path(), &cfg).err().unwrap().to_string();
        assert!(err.contains(INDEX_FILE) && err.contains("is missing"), "{err}");
        // A tensor the index maps elsewhere, one it does not name, one it names that is nowhere.
        let d = fresh();
        let mut v = index(d.path());
        let (name, file) =
            v["weight_map"].as_object().unwrap().iter().next().map(|(k, f)| (k.clone(), f.clone())).unwrap();
        let other = v["weight_map"].as_object().unwrap().values().find(|f| **f != file).unwrap().clone();
        v["weight_map"][&name] = other;
        write_index(d.path(), &v);
        let err = load_for(d.path(), &cfg).err().unwrap().to_string();
        assert!(err.contains(&format!("`{name}`")) && err.contains("maps it to"), "{err}");
        let d = fresh();
        let mut v = index(d.path());
        v["weight_map"].as_object_mut().unwrap().remove(&name);
        write_index(d.path(), &v);
        let err = load_for(d.path(), &cfg).err().unwrap().to_string();
        assert!(err.contains(&format!("`{name}`")) && err.contains("does not name"), "{err}");
        let d = fresh();
        let mut v = index(d.path());
        v["weight_map"]["h.0.attn.ghost"] = file.clone();
        write_index(d.path(), &v);
        let err = load_for(d.path(), &cfg).err().unwrap().to_string();
        assert!(err.contains("`h.0.attn.ghost`") && err.contains("does not hold it"), "{err}");
        // A shard the index does not name, and a single file beside the index.
        let d = fresh();
        std::fs::copy(&shards(d.path())[0], d.path().join("model-00009-of-00009.safetensors")).unwrap();
        let err = load_for(d.path(), &cfg).err().unwrap().to_string();
        assert!(err.contains("model-00009-of-00009.safetensors") && err.contains("does not name"), "{err}");
        let d = fresh();
        std::fs::write(d.path().join(MODEL_FILE), b"x").unwrap();
        let err = load_for(d.path(), &cfg).err().unwrap().to_string();
        assert!(err.contains("holds both"), "{err}");
        // A shard path out of the folder.
        let d = fresh();
        let mut v = index(d.path());
        v["weight_map"][&name] = "../x.safetensors".into();
        write_index(d.path(), &v);
        let err = load_for(d.path(), &cfg).err().unwrap().to_string();
        assert!(err.contains("in the folder"), "{err}");
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
            let cfg = Arch { tied, ..Arch::llama(2, 4, 2, 8, 12, 16, 4, 1e4) };
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
        let tied = Arch { tied: true, ..untied };
        let part = ModelPart::new(tied, crate::model::PartSpec::whole(&tied), 1, 3, false);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        save(&path, &gather(&[&part]), HashMap::new()).unwrap();
        let err = load_for(&path, &untied).err().unwrap().to_string();
        assert!(err.contains("tensor `lm_head.weight` is missing"), "{err}");
        // A GPT-2 file read as a Llama names the family.
        let (_gpt2_dir, gpt2) = hf_file(&tiny(1), |n| n.to_string(), &[]);
        let err = load_for(&gpt2, &untied).err().unwrap().to_string();
        assert!(err.contains("llama"), "{err}");
    }
}
