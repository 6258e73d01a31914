//! Hugging Face folders: the `config.json` (a `GPT2Config` or a
//! `LlamaConfig`) that sits beside `model.safetensors`. Read, it gives a
//! model its family and shape, so a `save_pretrained` folder needs no
//! `--set`; written into a run directory, it lets `GPT2LMHeadModel` or
//! `LlamaForCausalLM.from_pretrained(run_dir)` open the run unchanged.
//! Only the fields that change the arithmetic are checked; the rest (dropout,
//! token ids, generation settings) mean nothing to pipewright.

use super::params::{Arch, Family};
use std::path::{Path, PathBuf};

/// The file Hugging Face keeps a model's config in.
pub const HF_CONFIG_FILE: &str = "config.json";

/// A model's family and shape as its `config.json` states it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HfShape {
    pub family: Family,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    /// GPT-2: positions the file's `wpe.weight` holds; pipewright's
    /// `model.block_size` may be smaller (the table is cropped), never
    /// larger. Llama: `max_position_embeddings`, the default block size.
    pub n_positions: usize,
    /// Llama's own fields (GPT-2: one key/value head per query head, 4·C).
    pub llama: Option<LlamaFields>,
}

/// What a `LlamaConfig` adds to the shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaFields {
    pub n_kv_head: usize,
    pub intermediate_size: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
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

/// A parsed `config.json` and its path, for errors that name both.
struct Fields<'a> {
    path: &'a Path,
    v: &'a serde_json::Value,
}

impl Fields<'_> {
    fn bad(&self, field: &'static str, got: &serde_json::Value, expected: &str) -> HfError {
        HfError::Field {
            path: self.path.to_path_buf(),
            field,
            got: got.to_string(),
            expected: expected.to_string(),
        }
    }

    /// A whole number of at least 1.
    fn int(&self, field: &'static str) -> Result<usize, HfError> {
        let got = self.v.get(field).unwrap_or(&serde_json::Value::Null);
        match got.as_u64() {
            Some(n) if n > 0 => Ok(n as usize),
            _ => Err(self.bad(field, got, "a whole number of at least 1")),
        }
    }

    /// A field that, when present and not null, must pass `ok`.
    fn must(
        &self,
        field: &'static str,
        ok: &dyn Fn(&serde_json::Value) -> bool,
        expected: &str,
    ) -> Result<(), HfError> {
        match self.v.get(field) {
            Some(got) if !got.is_null() && !ok(got) => Err(self.bad(field, got, expected)),
            _ => Ok(()),
        }
    }
}

/// `config.json`'s text as a shape (`model_type` "gpt2", the default, or
/// "llama"); `path` names it in errors.
pub fn parse_shape(path: &Path, text: &str) -> Result<HfShape, HfError> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| HfError::Json { path: path.to_path_buf(), msg: e.to_string() })?;
    if v.get("model_type").is_some_and(|t| t == "llama") {
        return parse_llama(path, &v);
    }
    let f = Fields { path, v: &v };
    // Fields whose other values would change the arithmetic (absent: GPT-2's own).
    f.must("model_type", &|g| g == "gpt2", "\"gpt2\"")?;
    f.must(
        "activation_function",
        &|g| g == "gelu_new" || g == "gelu_pytorch_tanh",
        "\"gelu_new\" (GPT-2's tanh GELU, which pipewright computes)",
    )?;
    f.must("layer_norm_epsilon", &|g| g.as_f64() == Some(1e-5), "1e-05 (pipewright's LayerNorm)")?;
    f.must("tie_word_embeddings", &|g| g == true, "true (pipewright ties the head to wte)")?;
    f.must("scale_attn_by_inverse_layer_idx", &|g| g == false, "false")?;
    f.must("reorder_and_upcast_attn", &|g| g == false, "false")?;
    f.must(
        "n_inner",
        &|g| g.as_u64().is_some_and(|n| Some(n as usize) == f.int("n_embd").ok().map(|c| 4 * c)),
        "4 × n_embd or null",
    )?;
    let n_positions = match v.get("n_positions") {
        Some(_) => f.int("n_positions")?,
        None => f.int("n_ctx")?,
    };
    Ok(HfShape {
        family: Family::Gpt2,
        n_layer: f.int("n_layer")?,
        n_head: f.int("n_head")?,
        n_embd: f.int("n_embd")?,
        vocab_size: f.int("vocab_size")?,
        n_positions,
        llama: None,
    })
}

/// A `LlamaConfig`: the fields pipewright computes, and every field whose
/// other values would change the arithmetic checked. The rotary base comes
/// from `rope_theta` (transformers 4) or `rope_parameters.rope_theta`
/// (transformers 5); scaled rotary embeddings (Llama 3.1's "llama3" type,
/// YaRN, …) are refused, since pipewright computes the plain ones.
fn parse_llama(path: &Path, v: &serde_json::Value) -> Result<HfShape, HfError> {
    let f = Fields { path, v };
    f.must("hidden_act", &|g| g == "silu", "\"silu\" (SwiGLU's gate, which pipewright computes)")?;
    f.must("attention_bias", &|g| g == false, "false (pipewright's Llama has no biases)")?;
    f.must("mlp_bias", &|g| g == false, "false (pipewright's Llama has no biases)")?;
    f.must("pretraining_tp", &|g| g == 1, "1 (the plain products)")?;
    let (n_head, n_embd) = (f.int("num_attention_heads")?, f.int("hidden_size")?);
    f.must(
        "head_dim",
        &|g| g.as_u64().is_some_and(|d| d as usize * n_head == n_embd),
        "hidden_size / num_attention_heads",
    )?;
    let n_kv_head = match v.get("num_key_value_heads") {
        Some(g) if !g.is_null() => f.int("num_key_value_heads")?,
        _ => n_head,
    };
    let float = |field: &'static str, got: &serde_json::Value| -> Result<f64, HfError> {
        got.as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| f.bad(field, got, "a positive number"))
    };
    let scaled =
        |g: &serde_json::Value| g.get("rope_type").or_else(|| g.get("type")).is_some_and(|t| t != "default");
    let params = v.get("rope_parameters").filter(|p| !p.is_null());
    for (field, p) in [("rope_scaling", v.get("rope_scaling")), ("rope_parameters", params)] {
        if let Some(p) = p.filter(|p| !p.is_null() && scaled(p)) {
            return Err(f.bad(
                field,
                p,
                "null or rope_type \"default\" (scaled rotary embeddings are not computed)",
            ));
        }
    }
    let rope_theta = match (params.and_then(|p| p.get("rope_theta")), v.get("rope_theta")) {
        (Some(t), _) => float("rope_parameters", t)?,
        (None, Some(t)) if !t.is_null() => float("rope_theta", t)?,
        // LlamaConfig's default.
        _ => 10_000.0,
    };
    let rms_norm_eps = match v.get("rms_norm_eps") {
        Some(e) if !e.is_null() => float("rms_norm_eps", e)?,
        _ => 1e-6,
    };
    let tie_word_embeddings = match v.get("tie_word_embeddings") {
        Some(serde_json::Value::Bool(b)) => *b,
        Some(g) if !g.is_null() => return Err(f.bad("tie_word_embeddings", g, "true or false")),
        _ => false,
    };
    Ok(HfShape {
        family: Family::Llama,
        n_layer: f.int("num_hidden_layers")?,
        n_head,
        n_embd,
        vocab_size: f.int("vocab_size")?,
        n_positions: f.int("max_position_embeddings")?,
        llama: Some(LlamaFields {
            n_kv_head,
            intermediate_size: f.int("intermediate_size")?,
            rope_theta,
            rms_norm_eps,
            tie_word_embeddings,
        }),
    })
}

impl HfShape {
    /// `--set`-style overrides that give a config this shape, block_size
    /// included; put the user's own overrides after them so theirs win
    /// (a smaller `model.block_size` crops the position table).
    pub fn overrides(&self) -> Vec<String> {
        let mut v = vec![
            format!("model.family=\"{}\"", self.family),
            format!("model.n_layer={}", self.n_layer),
            format!("model.n_head={}", self.n_head),
            format!("model.n_embd={}", self.n_embd),
            format!("model.vocab_size={}", self.vocab_size),
            format!("model.block_size={}", self.n_positions),
        ];
        if let Some(l) = &self.llama {
            v.extend([
                format!("model.n_kv_head={}", l.n_kv_head),
                format!("model.intermediate_size={}", l.intermediate_size),
                format!("model.rope_theta={:?}", l.rope_theta),
                format!("model.rms_norm_eps={:?}", l.rms_norm_eps),
                format!("model.tie_word_embeddings={}", l.tie_word_embeddings),
            ]);
        }
        v
    }
}

/// A `config.json` that transformers' `GPT2LMHeadModel.from_pretrained`
/// reads as this model: GPT-2's tanh GELU, eps 1e-5, tied head, no dropout
/// (pipewright trains without it). GPT-2's end-of-text id only where the
/// vocabulary holds it.
pub fn config_json(cfg: &Arch) -> String {
    if cfg.family == Family::Llama {
        return llama_config_json(cfg);
    }
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

/// An f32 field as the decimal it was written as (1e-5, not 9.99999974e-6).
fn decimal(x: f32) -> f64 {
    x.to_string().parse().expect("an f32 prints as a decimal")
}

/// A `config.json` that `LlamaForCausalLM.from_pretrained` reads as this
/// model, under transformers 4 (`rope_theta`) and 5 (`rope_parameters`).
fn llama_config_json(cfg: &Arch) -> String {
    let theta = decimal(cfg.rope_theta);
    let v = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads(),
        "hidden_size": cfg.n_embd,
        "head_dim": cfg.head_dim(),
        "intermediate_size": cfg.ffn(),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": decimal(cfg.norm_eps),
        "rope_theta": theta,
        "rope_scaling": null,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tied(),
        "initializer_range": 0.02,
        "bos_token_id": null,
        "eos_token_id": null,
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
        let want = HfShape {
            family: Family::Gpt2,
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            vocab_size: 50257,
            n_positions: 1024,
            llama: None,
        };
        assert_eq!(s, want);
        assert!(s.overrides().contains(&"model.block_size=1024".to_string()));
    }

    #[test]
    fn what_we_write_reads_back_as_the_same_shape() {
        let cfg = Arch::gpt2(3, 2, 16, 256, 65);
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

    /// Meta's Llama 3 8B `config.json` as transformers 4 wrote it.
    const LLAMA3_8B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
      "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
      "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
      "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "use_cache": true, "vocab_size": 128256
    }"#;

    #[test]
    fn the_llama3_8b_config_gives_its_shape_and_rope_base() {
        let s = parse_shape(Path::new("config.json"), LLAMA3_8B).unwrap();
        assert_eq!(
            (s.family, s.n_layer, s.n_head, s.n_embd, s.vocab_size),
            (Family::Llama, 32, 32, 4096, 128256)
        );
        let l = s.llama.unwrap();
        assert_eq!((l.n_kv_head, l.intermediate_size, l.rope_theta, l.rms_norm_eps), (8, 14336, 5e5, 1e-5));
        assert!(!l.tie_word_embeddings);
        let o = s.overrides();
        for want in ["model.family=\"llama\"", "model.n_kv_head=8", "model.rope_theta=500000.0"] {
            assert!(o.contains(&want.to_string()), "{o:?}");
        }
    }

    #[test]
    fn transformers_5_rope_parameters_give_the_rope_base() {
        let v5 = LLAMA3_8B.replace("\"rope_theta\": 500000.0,", "").replace(
            "\"rope_scaling\": null,",
            "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 250000.0},",
        );
        let s = parse_shape(Path::new("config.json"), &v5).unwrap();
        assert_eq!(s.llama.unwrap().rope_theta, 2.5e5);
    }

    #[test]
    fn scaled_rope_and_biases_are_refused_by_name() {
        let scaled = LLAMA3_8B.replace(
            "\"rope_scaling\": null",
            "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}",
        );
        let err = parse_shape(Path::new("m/config.json"), &scaled).unwrap_err().to_string();
        assert!(err.contains("m/config.json") && err.contains("`rope_scaling`"), "{err}");
        let biased = LLAMA3_8B.replace("\"attention_bias\": false", "\"attention_bias\": true");
        let err = parse_shape(Path::new("config.json"), &biased).unwrap_err().to_string();
        assert!(err.contains("`attention_bias`"), "{err}");
    }

    #[test]
    fn a_llama_we_write_reads_back_as_the_same_shape() {
        for tied in [false, true] {
            let cfg = Arch { tie_word_embeddings: tied, ..Arch::llama(3, 4, 2, 16, 40, 256, 32, 5e5) };
            let s = parse_shape(Path::new("config.json"), &config_json(&cfg)).unwrap();
            assert_eq!(
                (s.family, s.n_layer, s.n_head, s.n_embd, s.n_positions),
                (Family::Llama, 3, 4, 16, 32)
            );
            let l = s.llama.unwrap();
            assert_eq!((l.n_kv_head, l.intermediate_size, l.rope_theta, l.rms_norm_eps), (2, 40, 5e5, 1e-5));
            assert_eq!(l.tie_word_embeddings, tied);
        }
    }
}
