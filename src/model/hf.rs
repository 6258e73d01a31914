//! Hugging Face GPT-2 folders: the `config.json` (a `GPT2Config`) that sits
//! beside `model.safetensors`. Read, it gives a model its shape, so a
//! `save_pretrained` folder needs no `--set`; written into a run directory,
//! it lets `GPT2LMHeadModel.from_pretrained(run_dir)` open the run unchanged.
//! Only the fields that change the arithmetic are checked; the rest (dropout,
//! token ids, generation settings) mean nothing to pipewright.

use super::params::GptConfig;
use std::path::{Path, PathBuf};

/// The file Hugging Face keeps a model's config in.
pub const HF_CONFIG_FILE: &str = "config.json";

/// A GPT-2's shape as its `config.json` states it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfShape {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    /// Positions the file's `wpe.weight` holds; pipewright's `model.block_size`
    /// may be smaller (the table is cropped), never larger.
    pub n_positions: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{}: not valid JSON: {msg}", path.display())]
    Json { path: PathBuf, msg: String },
    #[error("{}: `{field}` is {got}, expected {expected}", path.display())]
    Field { path: PathBuf, field: &'static str, got: String, expected: String },
}

/// The shape in `dir/config.json`, or None when the folder has no such file.
/// A config.json that is there but cannot be read (a FIFO, a device, a
/// symlink loop, a dangling link) is an error naming it, not "absent":
/// absent, the model's shape would silently come from elsewhere.
pub fn read_shape(dir: &Path) -> Result<Option<HfShape>, HfError> {
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
        Some(text) => parse_shape(&path, &text).map(Some),
        None => Ok(None),
    }
}

/// `config.json`'s text as a GPT-2 shape; `path` names it in errors.
pub fn parse_shape(path: &Path, text: &str) -> Result<HfShape, HfError> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| HfError::Json { path: path.to_path_buf(), msg: e.to_string() })?;
    let bad = |field: &'static str, got: &serde_json::Value, expected: &str| HfError::Field {
        path: path.to_path_buf(),
        field,
        got: got.to_string(),
        expected: expected.to_string(),
    };
    let int = |field: &'static str| -> Result<usize, HfError> {
        let got = v.get(field).unwrap_or(&serde_json::Value::Null);
        match got.as_u64() {
            Some(n) if n > 0 => Ok(n as usize),
            _ => Err(bad(field, got, "a whole number of at least 1")),
        }
    };
    // Fields whose other values would change the arithmetic (absent: GPT-2's own).
    let must =
        |field: &'static str, ok: &dyn Fn(&serde_json::Value) -> bool, expected: &str| match v.get(field) {
            Some(got) if !got.is_null() && !ok(got) => Err(bad(field, got, expected)),
            _ => Ok(()),
        };
    must("model_type", &|g| g == "gpt2", "\"gpt2\"")?;
    must(
        "activation_function",
        &|g| g == "gelu_new" || g == "gelu_pytorch_tanh",
        "\"gelu_new\" (GPT-2's tanh GELU, which pipewright computes)",
    )?;
    must("layer_norm_epsilon", &|g| g.as_f64() == Some(1e-5), "1e-05 (pipewright's LayerNorm)")?;
    must("tie_word_embeddings", &|g| g == true, "true (pipewright ties the head to wte)")?;
    must("scale_attn_by_inverse_layer_idx", &|g| g == false, "false")?;
    must("reorder_and_upcast_attn", &|g| g == false, "false")?;
    must(
        "n_inner",
        &|g| g.as_u64().is_some_and(|n| Some(n as usize) == int("n_embd").ok().map(|c| 4 * c)),
        "4 × n_embd or null",
    )?;
    let n_positions = match v.get("n_positions") {
        Some(_) => int("n_positions")?,
        None => int("n_ctx")?,
    };
    Ok(HfShape {
        n_layer: int("n_layer")?,
        n_head: int("n_head")?,
        n_embd: int("n_embd")?,
        vocab_size: int("vocab_size")?,
        n_positions,
    })
}

impl HfShape {
    /// `--set`-style overrides that give a config this shape, block_size
    /// included; put the user's own overrides after them so theirs win
    /// (a smaller `model.block_size` crops the position table).
    pub fn overrides(&self) -> Vec<String> {
        vec![
            format!("model.n_layer={}", self.n_layer),
            format!("model.n_head={}", self.n_head),
            format!("model.n_embd={}", self.n_embd),
            format!("model.vocab_size={}", self.vocab_size),
            format!("model.block_size={}", self.n_positions),
        ]
    }
}

/// A `config.json` that transformers' `GPT2LMHeadModel.from_pretrained`
/// reads as this model: GPT-2's tanh GELU, eps 1e-5, tied head, no dropout
/// (pipewright trains without it). GPT-2's end-of-text id only where the
/// vocabulary holds it.
pub fn config_json(cfg: &GptConfig) -> String {
    let eot = (cfg.vocab_size > 50_256).then_some(50_256);
    let v = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_embd": cfg.n_embd,
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": true,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    });
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
        let s = parse_shape(Path::new("config.json"), GPT2_HUB).unwrap();
        let want = HfShape { n_layer: 12, n_head: 12, n_embd: 768, vocab_size: 50257, n_positions: 1024 };
        assert_eq!(s, want);
        assert!(s.overrides().contains(&"model.block_size=1024".to_string()));
    }

    #[test]
    fn what_we_write_reads_back_as_the_same_shape() {
        let cfg = GptConfig::gpt2(3, 2, 16, 256, 65);
        let s = parse_shape(Path::new("config.json"), &config_json(&cfg)).unwrap();
        assert_eq!((s.n_layer, s.n_head, s.n_embd, s.vocab_size, s.n_positions), (3, 2, 16, 256, 65));
        let v: serde_json::Value = serde_json::from_str(&config_json(&cfg)).unwrap();
        assert!(v["eos_token_id"].is_null(), "a byte vocabulary has no id 50256");
    }

    #[test]
    fn a_field_that_changes_the_arithmetic_is_refused_by_name() {
        let relu = GPT2_HUB.replace("\"gelu_new\"", "\"relu\"");
        let err = parse_shape(Path::new("m/config.json"), &relu).unwrap_err().to_string();
        assert!(err.contains("m/config.json") && err.contains("`activation_function`"), "{err}");
        let no_layers = GPT2_HUB.replace("\"n_layer\": 12,", "");
        let err = parse_shape(Path::new("config.json"), &no_layers).unwrap_err().to_string();
        assert!(err.contains("`n_layer` is null"), "{err}");
    }

    #[test]
    fn a_folder_without_config_json_has_no_shape() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_shape(dir.path()).unwrap(), None);
        std::fs::write(dir.path().join(HF_CONFIG_FILE), GPT2_HUB).unwrap();
        assert_eq!(read_shape(dir.path()).unwrap().unwrap().n_layer, 12);
    }
}
