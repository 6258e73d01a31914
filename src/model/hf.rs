//! Hugging Face folders' `config.json`, for every family: read, it gives a
//! model its family and shape as `--set` overrides of `[model]` (so a
//! `save_pretrained` folder needs no flags); written into a run directory,
//! it lets the family's class (`GPT2LMHeadModel`, `LlamaForCausalLM`, …)
//! `from_pretrained(run_dir)` open the run unchanged.
//!
//! `model_type` picks the family; each family's folder reads and writes its
//! own fields and checks every field whose other values would change the
//! arithmetic. The rest (dropout, token ids, generation settings) mean
//! nothing to pipewright.

use super::arch::Arch;
use super::family::Family;
use super::section::ModelSection;
use std::path::{Path, PathBuf};

/// The file Hugging Face keeps a model's config in.
pub const HF_CONFIG_FILE: &str = "config.json";

/// A model as its `config.json` states it.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    pub path: PathBuf,
    pub family: Family,
    /// `--set` overrides of `[model]` giving this model, `model.block_size`
    /// included; put the user's own after them so theirs win (a smaller
    /// block size crops a learned position table).
    pub overrides: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{}: not valid JSON: {msg}", path.display())]
    Json { path: PathBuf, msg: String },
    #[error("{}: `{field}` is {got}, expected {expected}", path.display())]
    Field { path: PathBuf, field: String, got: String, expected: String },
}

/// The config in `dir/config.json`, or None when the folder has no such file.
/// A config.json that is there but cannot be read (a FIFO, a device, a
/// symlink loop, a dangling link) is an error naming it, not "absent":
/// absent, the model's shape would silently come from elsewhere.
pub fn read_config(dir: &Path) -> Result<Option<HfConfig>, HfError> {
    let path = dir.join(HF_CONFIG_FILE);
    if !dir.is_dir() {
        return Ok(None);
    }
    let read = crate::fsutil::read_optional_to_string(
        &path,
        crate::fsutil::MAX_CONFIG_BYTES,
        "a config.json may hold",
    );
    match read.map_err(|error| HfError::Io { path: path.clone(), error })? {
        Some(text) => parse_config(&path, &text).map(Some),
        None => Ok(None),
    }
}

/// A parsed `config.json` and its path, for errors that name both.
pub struct Fields<'a> {
    pub path: &'a Path,
    pub v: &'a serde_json::Value,
}

impl Fields<'_> {
    pub fn bad(&self, field: &str, got: &serde_json::Value, expected: &str) -> HfError {
        HfError::Field {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            got: got.to_string(),
            expected: expected.to_string(),
        }
    }

    /// A whole number of at least 1.
    pub fn int(&self, field: &str) -> Result<usize, HfError> {
        let got = self.v.get(field).unwrap_or(&serde_json::Value::Null);
        match got.as_u64() {
            Some(n) if n > 0 => Ok(n as usize),
            _ => Err(self.bad(field, got, "a whole number of at least 1")),
        }
    }

    /// A finite number above 0 (`got` is the field's value, `field` its name).
    pub fn positive(&self, field: &str, got: &serde_json::Value) -> Result<f64, HfError> {
        got.as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| self.bad(field, got, "a positive number"))
    }

    /// true, false, or None when absent or null.
    pub fn bool(&self, field: &str) -> Result<Option<bool>, HfError> {
        match self.v.get(field) {
            Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
            Some(g) if !g.is_null() => Err(self.bad(field, g, "true or false")),
            _ => Ok(None),
        }
    }

    /// A field that, when present and not null, must pass `ok`.
    pub fn must(
        &self,
        field: &str,
        ok: &dyn Fn(&serde_json::Value) -> bool,
        expected: &str,
    ) -> Result<(), HfError> {
        match self.v.get(field) {
            Some(got) if !got.is_null() && !ok(got) => Err(self.bad(field, got, expected)),
            _ => Ok(()),
        }
    }
}

/// `config.json`'s text as a model; `path` names it in errors. Without a
/// `model_type` it is GPT-2's (the oldest files carry none).
pub fn parse_config(path: &Path, text: &str) -> Result<HfConfig, HfError> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| HfError::Json { path: path.to_path_buf(), msg: e.to_string() })?;
    let f = Fields { path, v: &v };
    let kind = match v.get("model_type") {
        None | Some(serde_json::Value::Null) => "gpt2",
        Some(t) => t.as_str().ok_or_else(|| f.bad("model_type", t, "a string"))?,
    };
    let family = Family::of_model_type(kind).ok_or_else(|| {
        f.bad(
            "model_type",
            &v["model_type"],
            &format!("one of {} (the families pipewright computes)", Family::model_types()),
        )
    })?;
    let overrides = (family.spec().read_config)(&f)?;
    Ok(HfConfig { path: path.to_path_buf(), family, overrides })
}

impl HfConfig {
    /// The `[model]` section these overrides give on the defaults.
    pub fn section(&self) -> Result<ModelSection, HfError> {
        let bad = |msg: String| HfError::Json { path: self.path.clone(), msg };
        let mut table = toml::Table::new();
        for o in &self.overrides {
            let (key, raw) = o.split_once('=').expect("overrides are key=value");
            let mut path: Vec<&str> = key.split('.').skip(1).collect();
            let last = path.pop().expect("model.key");
            let mut at = &mut table;
            for p in path {
                at = at
                    .entry(p.to_string())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                    .as_table_mut()
                    .expect("a table");
            }
            let value = raw.parse::<toml::Value>().unwrap_or_else(|_| toml::Value::String(raw.to_string()));
            at.insert(last.to_string(), value);
        }
        ModelSection::deserialize(table).map_err(|e| bad(e.to_string()))
    }

    /// One line for people: the family and the overrides it gives.
    pub fn summary(&self) -> String {
        let fields: Vec<String> = self
            .overrides
            .iter()
            .skip(1)
            .map(|o| o.strip_prefix("model.").unwrap_or(o).replacen('=', " = ", 1))
            .collect();
        format!("{}: {}, {}", self.path.display(), self.family.title(), fields.join(", "))
    }
}

use serde::Deserialize;

/// The model a weights argument carries, by the one rule every command
/// (`eval`, `generate`, `train --init`, `inspect`) follows: the folder's
/// `config.json` and the config a pipewright run stored in the weights'
/// metadata each describe it; when both are there they must describe the
/// same model, or neither is trusted and the disagreement is an error naming
/// both values; when one is there it is the model; with neither, the
/// command's own config is.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightsModel {
    pub section: ModelSection,
    /// Where it came from, for messages.
    pub origin: String,
    /// The `config.json`, when the folder has one.
    pub hf: Option<HfConfig>,
}

/// The model of the weights in `file` (whose metadata holds `stored`, a
/// run's config TOML, if any), by the rule of [`WeightsModel`].
pub fn weights_model(file: &Path, stored: Option<&str>) -> Result<Option<WeightsModel>, HfError> {
    let folder = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let hf = read_config(folder)?;
    let from_hf = hf.as_ref().map(HfConfig::section).transpose()?;
    let stored_origin = format!("the config stored in {}", file.display());
    let from_stored = match stored {
        None => None,
        Some(text) => {
            let bad = |msg: String| HfError::Json {
                path: file.to_path_buf(),
                msg: format!("its stored config: {msg}"),
            };
            let table: toml::Table = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
            let model = table.get("model").cloned().unwrap_or(toml::Value::Table(toml::Table::new()));
            Some(ModelSection::deserialize(model).map_err(|e| bad(e.to_string()))?)
        }
    };
    Ok(match (from_hf, from_stored, hf) {
        (Some(a), Some(b), Some(h)) => {
            if let Some((field, x, y)) = first_difference(&a, &b) {
                return Err(HfError::Field {
                    path: h.path.clone(),
                    field: format!("model.{field}"),
                    got: x,
                    expected: format!(
                        "{y} as {stored_origin} says: the two disagree on the model (fix or remove one)"
                    ),
                });
            }
            Some(WeightsModel { section: a, origin: h.path.display().to_string(), hf: Some(h) })
        }
        (Some(a), None, Some(h)) => {
            Some(WeightsModel { section: a, origin: h.path.display().to_string(), hf: Some(h) })
        }
        (None, Some(b), _) => Some(WeightsModel { section: b, origin: stored_origin, hf: None }),
        _ => None,
    })
}

/// The first `[model]` field (in the schema's order) whose value differs
/// between two sections that describe models, with both values; None when
/// they give the same model (a field left unset on one side and set to what
/// the family's default gives on the other is no difference).
fn first_difference(a: &ModelSection, b: &ModelSection) -> Option<(String, String, String)> {
    if let (Ok(x), Ok(y)) = (a.arch(), b.arch()) {
        if x == y {
            return None;
        }
    }
    let flat = |m: &ModelSection| -> Vec<(String, String)> {
        let mut out = Vec::new();
        flatten("", &toml::Value::try_from(m).expect("a section serializes"), &mut out);
        out
    };
    let (fa, fb) = (flat(a), flat(b));
    let get = |f: &[(String, String)], k: &str| f.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let mut keys: Vec<String> = fa.iter().chain(&fb).map(|(k, _)| k.clone()).collect();
    keys.dedup();
    let unset = || "unset".to_string();
    keys.into_iter().find_map(|k| {
        let (x, y) = (get(&fa, &k), get(&fb, &k));
        (x != y).then(|| (k, x.unwrap_or_else(unset), y.unwrap_or_else(unset)))
    })
}

fn flatten(prefix: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out);
            }
        }
        v => out.push((prefix.to_string(), v.to_string())),
    }
}

impl ModelSection {
    /// `--set` overrides giving this section's every field (unset options left out).
    pub fn overrides(&self) -> Vec<String> {
        let mut flat = Vec::new();
        flatten("", &toml::Value::try_from(self).expect("a section serializes"), &mut flat);
        flat.into_iter().map(|(k, v)| format!("model.{k}={v}")).collect()
    }
}

/// The `config.json` text that the family's class reads as this model.
pub fn config_json(a: &Arch) -> String {
    let v = (a.family.spec().write_config)(a);
    let mut text = serde_json::to_string_pretty(&v).expect("a JSON value serializes");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `config.json` of Hugging Face's `gpt2` (trimmed of task settings).
    const GPT2_HUB: &str = r#"{
      "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
      "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
      "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
      "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
      "resid_pdrop": 0.1, "summary_activation": null, "vocab_size": 50257
    }"#;

    #[test]
    fn the_hub_gpt2_config_gives_the_124m_shape() {
        let c = parse_config(Path::new("config.json"), GPT2_HUB).unwrap();
        assert_eq!(c.family.name(), "gpt2");
        assert!(c.overrides.contains(&"model.block_size=1024".to_string()));
        let a = c.section().unwrap().arch().unwrap();
        assert_eq!((a.n_layer, a.n_head, a.n_embd, a.vocab_size, a.block_size), (12, 12, 768, 50257, 1024));
        assert_eq!(a.num_params(), 124_439_808);
    }

    #[test]
    fn what_we_write_reads_back_as_the_same_model() {
        let m = ModelSection {
            n_layer: 3,
            n_head: 2,
            n_embd: 16,
            vocab_size: 256,
            block_size: 65,
            ..Default::default()
        };
        let a = m.arch().unwrap();
        let c = parse_config(Path::new("config.json"), &config_json(&a)).unwrap();
        assert_eq!(c.section().unwrap().arch().unwrap(), a);
        let v: serde_json::Value = serde_json::from_str(&config_json(&a)).unwrap();
        assert!(v["eos_token_id"].is_null(), "a byte vocabulary has no id 50256");
    }

    #[test]
    fn a_field_that_changes_the_arithmetic_is_refused_by_name() {
        let relu = GPT2_HUB.replace("\"gelu_new\"", "\"relu\"");
        let err = parse_config(Path::new("m/config.json"), &relu).unwrap_err().to_string();
        assert!(err.contains("m/config.json") && err.contains("`activation_function`"), "{err}");
        let no_layers = GPT2_HUB.replace("\"n_layer\": 12,", "");
        let err = parse_config(Path::new("config.json"), &no_layers).unwrap_err().to_string();
        assert!(err.contains("`n_layer` is null"), "{err}");
    }

    #[test]
    fn an_unknown_model_type_lists_every_one_accepted() {
        let t5 = GPT2_HUB.replace("\"model_type\": \"gpt2\"", "\"model_type\": \"t5\"");
        let err = parse_config(Path::new("config.json"), &t5).unwrap_err().to_string();
        for f in super::super::family::ALL {
            for t in f.model_types {
                assert!(err.contains(&format!("\"{t}\"")), "{err}");
            }
        }
        assert!(!err.contains("expected gpt2"), "{err}");
    }

    #[test]
    fn a_folder_without_config_json_has_no_config() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_config(dir.path()).unwrap(), None);
        std::fs::write(dir.path().join(HF_CONFIG_FILE), GPT2_HUB).unwrap();
        assert!(read_config(dir.path())
            .unwrap()
            .unwrap()
            .overrides
            .contains(&"model.n_layer=12".to_string()));
    }
}
