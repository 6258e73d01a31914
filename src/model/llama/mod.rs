//! Llama as a preset of the one block: RMSNorm, rotary positions (scaled as
//! Llama 3.1's `rope_type: "llama3"`, `linear` or `yarn` if asked), a SwiGLU
//! MLP, grouped-query attention, biases only if `attention_bias` /
//! `mlp_bias`, an untied head unless tied.
//!
//! Its files are `LlamaForCausalLM`'s: our names under `model.` (the head,
//! `lm_head.weight`, without it), the same (out, in) layouts. Qwen2, Qwen3
//! and Mistral keep these names and most of this `config.json`, so their
//! folders call the functions here with what is their own.

use super::arch::{Arch, RopeScaling};
use super::family::{Family, FromHfError, HfTensor, Spec, Tensor};
use super::hf::{Fields, HfError};
use super::section::ModelSection;
use crate::check::Checks;
use std::borrow::Cow;

pub static SPEC: Spec = Spec {
    name: "llama",
    title: "Llama",
    model_types: &["llama"],
    hf_class: "LlamaForCausalLM",
    preset,
    read_config,
    write_config,
    to_hf,
    from_hf,
    hf_name,
};

impl Arch {
    /// A Llama of this shape, its head untied (tests, benchmarks, the GPU checks).
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        n_layer: usize,
        n_head: usize,
        n_kv_head: usize,
        n_embd: usize,
        intermediate_size: usize,
        vocab_size: usize,
        block_size: usize,
        rope_theta: f32,
    ) -> Arch {
        let m = ModelSection {
            family: "llama".into(),
            n_layer,
            n_head,
            n_kv_head,
            n_embd,
            intermediate_size,
            vocab_size,
            block_size,
            rope_theta: rope_theta as f64,
            ..ModelSection::default()
        };
        m.arch().unwrap_or_else(|p| panic!("not a Llama: {p:?}"))
    }
}

fn preset(m: &ModelSection, c: &mut Checks) -> Arch {
    m.refuse_unless_unset(c, "llama", "sliding_window");
    m.common(Family::named("llama").expect("llama is a family"))
}

fn read_config(f: &Fields) -> Result<Vec<String>, HfError> {
    let mut o = read_common(f, "llama")?;
    if let Some(b) = f.bool("attention_bias")? {
        o.push(format!("model.attention_bias={b}"));
    }
    if let Some(b) = f.bool("mlp_bias")? {
        o.push(format!("model.mlp_bias={b}"));
    }
    Ok(o)
}

fn write_config(a: &Arch) -> serde_json::Value {
    let mut v = write_common(a, "LlamaForCausalLM", "llama");
    v["attention_bias"] = a.qkv_bias.into();
    v["mlp_bias"] = a.mlp_bias.into();
    v["pretraining_tp"] = 1.into();
    v
}

/// The fields every Llama-style `config.json` shares, as `--set` overrides
/// naming `family`, with every field whose other values would change the
/// arithmetic checked. The rotary base comes from `rope_theta`
/// (transformers 4) or `rope_parameters.rope_theta` (transformers 5), its
/// scaling from `rope_scaling` or `rope_parameters`.
pub fn read_common(f: &Fields, family: &str) -> Result<Vec<String>, HfError> {
    f.must("hidden_act", &|g| g == "silu", "\"silu\" (SwiGLU's gate, which pipewright computes)")?;
    f.must("pretraining_tp", &|g| g == 1, "1 (the plain products)")?;
    f.must(
        "partial_rotary_factor",
        &|g| g.as_f64() == Some(1.0),
        "1.0 or null (rotary embeddings on whole heads)",
    )?;
    let (n_head, n_embd) = (f.int("num_attention_heads")?, f.int("hidden_size")?);
    let mut o = vec![
        format!("model.family=\"{family}\""),
        format!("model.n_layer={}", f.int("num_hidden_layers")?),
        format!("model.n_head={n_head}"),
        format!("model.n_embd={n_embd}"),
        format!("model.vocab_size={}", f.int("vocab_size")?),
        format!("model.block_size={}", f.int("max_position_embeddings")?),
        format!("model.intermediate_size={}", f.int("intermediate_size")?),
    ];
    if f.v.get("num_key_value_heads").is_some_and(|g| !g.is_null()) {
        o.push(format!("model.n_kv_head={}", f.int("num_key_value_heads")?));
    }
    if f.v.get("head_dim").is_some_and(|g| !g.is_null()) {
        o.push(format!("model.head_dim={}", f.int("head_dim")?));
    }
    let params = f.v.get("rope_parameters").filter(|p| !p.is_null());
    let theta = match (params.and_then(|p| p.get("rope_theta")), f.v.get("rope_theta")) {
        (Some(t), _) => Some(f.positive("rope_parameters.rope_theta", t)?),
        (None, Some(t)) if !t.is_null() => Some(f.positive("rope_theta", t)?),
        _ => None,
    };
    // LlamaConfig's default base, and Qwen2's and Mistral's differ: absent, the family's default stays.
    if let Some(t) = theta {
        o.push(format!("model.rope_theta={t:?}"));
    }
    // Absent, transformers' default for every Llama-style config (1e-6), not pipewright's.
    let eps = match f.v.get("rms_norm_eps").filter(|e| !e.is_null()) {
        Some(e) => f.positive("rms_norm_eps", e)?,
        None => 1e-6,
    };
    o.push(format!("model.rms_norm_eps={eps:?}"));
    if let Some(b) = f.bool("tie_word_embeddings")? {
        o.push(format!("model.tie_word_embeddings={b}"));
    }
    let scaling =
        [("rope_parameters", params), ("rope_scaling", f.v.get("rope_scaling").filter(|p| !p.is_null()))];
    if let Some((field, p)) = scaling.into_iter().find_map(|(n, p)| Some((n, p?))).filter(|(_, p)| scaled(p))
    {
        o.extend(read_rope_scaling(f, field, p)?);
    }
    Ok(o)
}

/// Whether a `rope_scaling` / `rope_parameters` dictionary asks for a scaling.
fn scaled(p: &serde_json::Value) -> bool {
    p.get("rope_type").or_else(|| p.get("type")).is_some_and(|t| t != "default")
}

/// A scaled `rope_scaling` as `model.rope_scaling.*` overrides; a type
/// pipewright does not compute is refused naming it.
fn read_rope_scaling(f: &Fields, field: &'static str, p: &serde_json::Value) -> Result<Vec<String>, HfError> {
    let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(|t| t.as_str()).unwrap_or("");
    let bad = |why: &str| f.bad(field, p, why);
    let keys: &[&str] = match kind {
        "linear" => &["factor"],
        "llama3" => &["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
        "yarn" => &["factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"],
        _ => {
            return Err(bad(
                "rope_type \"default\", \"linear\", \"llama3\" or \"yarn\" (the scaled rotary embeddings pipewright \
                 computes)",
            ))
        }
    };
    if kind == "yarn" {
        for refused in ["mscale", "mscale_all_dim"] {
            if p.get(refused).is_some_and(|v| !v.is_null()) {
                return Err(bad("yarn without mscale / mscale_all_dim (DeepSeek's variant is not computed)"));
            }
        }
        if p.get("truncate").is_some_and(|v| v != true) {
            return Err(bad("yarn with truncate true or unset"));
        }
    }
    let mut o = vec![format!("model.rope_scaling.rope_type=\"{kind}\"")];
    for k in keys {
        match p.get(*k).filter(|v| !v.is_null()) {
            Some(v) if v.as_f64().is_some_and(|x| x.is_finite() && x > 0.0) => {
                let x = v.as_f64().expect("a number");
                o.push(match *k {
                    "original_max_position_embeddings" => format!("model.rope_scaling.{k}={}", x as u64),
                    _ => format!("model.rope_scaling.{k}={x:?}"),
                })
            }
            Some(_) => return Err(bad(&format!("`{k}` a positive number"))),
            // yarn's optional keys default as transformers does; llama3's and linear's are required.
            None if kind == "yarn" && *k != "factor" => {}
            None if *k == "original_max_position_embeddings" => {}
            None => return Err(bad(&format!("`{k}` set (rope_type \"{kind}\" needs it)"))),
        }
    }
    Ok(o)
}

/// The `config.json` fields every Llama-style family shares, for `class`.
pub fn write_common(a: &Arch, class: &str, model_type: &str) -> serde_json::Value {
    let theta = decimal(a.rope_theta);
    let scaling = rope_scaling_json(a.rope_scaling);
    let mut params = serde_json::json!({"rope_type": "default", "rope_theta": theta});
    if let Some(s) = scaling.as_object() {
        for (k, v) in s {
            params[k] = v.clone();
        }
    }
    serde_json::json!({
        "architectures": [class],
        "model_type": model_type,
        "num_hidden_layers": a.n_layer,
        "num_attention_heads": a.n_head,
        "num_key_value_heads": a.kv_heads(),
        "hidden_size": a.n_embd,
        "head_dim": a.head_dim,
        "intermediate_size": a.ffn,
        "vocab_size": a.vocab_size,
        "max_position_embeddings": a.block_size,
        "rms_norm_eps": decimal(a.norm_eps),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": params,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": a.tied,
        "initializer_range": a.init.std,
        "bos_token_id": null,
        "eos_token_id": null,
        "torch_dtype": "float32",
    })
}

/// `rope_scaling` as transformers 4 writes it (null when none).
fn rope_scaling_json(s: RopeScaling) -> serde_json::Value {
    match s {
        RopeScaling::None => serde_json::Value::Null,
        RopeScaling::Linear { factor } => {
            serde_json::json!({"rope_type": "linear", "factor": decimal(factor)})
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            serde_json::json!({
                "rope_type": "llama3",
                "factor": decimal(factor),
                "low_freq_factor": decimal(low_freq_factor),
                "high_freq_factor": decimal(high_freq_factor),
                "original_max_position_embeddings": original_max_position_embeddings,
            })
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            ..
        } => {
            serde_json::json!({
                "rope_type": "yarn",
                "factor": decimal(factor),
                "original_max_position_embeddings": original_max_position_embeddings,
                "beta_fast": decimal(beta_fast),
                "beta_slow": decimal(beta_slow),
                "attention_factor": decimal(attention_factor),
            })
        }
    }
}

/// An f32 field as the decimal it was written as (1e-5, not 9.99999974e-6).
pub fn decimal(x: f32) -> f64 {
    x.to_string().parse().expect("an f32 prints as a decimal")
}

/// Our tensor `name` in a `LlamaForCausalLM` file: the body under `model.`,
/// the head without it.
pub fn hf_name(_: &Arch, name: &str) -> String {
    match name {
        "lm_head.weight" => name.to_string(),
        _ => format!("model.{name}"),
    }
}

pub fn to_hf<'a>(a: &Arch, ours: Vec<(&'a str, &'a [usize], &'a [f32])>) -> Vec<HfTensor<'a>> {
    ours.into_iter().map(|(n, s, d)| (hf_name(a, n), s.to_vec(), Cow::Borrowed(d))).collect()
}

/// A `LlamaForCausalLM` file's tensor as ours; the `model.` prefix may be
/// missing (files written by pipewright before it wrote one).
pub fn from_hf(
    a: &Arch,
    file_name: &str,
    shape: Vec<usize>,
    data: Vec<f32>,
) -> Result<Vec<Tensor>, FromHfError> {
    let name = file_name.strip_prefix("model.").unwrap_or(file_name);
    let expected = match name {
        // The tied head is ours too: the loader compares it with the embedding and drops it.
        "lm_head.weight" => vec![a.vocab_size, a.n_embd],
        _ => super::params::shape_of(a, name).ok_or(FromHfError::Unknown)?,
    };
    if shape != expected {
        return Err(FromHfError::Shape { expected });
    }
    Ok(vec![(name.to_string(), shape, data)])
}

#[cfg(test)]
mod tests {
    use super::super::hf::parse_config;
    use super::*;
    use std::path::Path;

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

    fn section(text: &str) -> ModelSection {
        parse_config(Path::new("config.json"), text).unwrap().section().unwrap()
    }

    #[test]
    fn the_llama3_8b_config_gives_its_shape_and_rope_base() {
        let m = section(LLAMA3_8B);
        assert_eq!(
            (m.family.as_str(), m.n_layer, m.n_head, m.n_embd, m.vocab_size),
            ("llama", 32, 32, 4096, 128256)
        );
        assert_eq!((m.n_kv_head, m.intermediate_size, m.rope_theta, m.rms_norm_eps), (8, 14336, 5e5, 1e-5));
        let a = m.arch().unwrap();
        assert!(!a.tied && !a.qkv_bias && a.rope_scaling == RopeScaling::None);
        // Llama-3 8B: 8,030,261,248 parameters.
        assert_eq!(a.num_params(), 8_030_261_248);
    }

    #[test]
    fn transformers_5_rope_parameters_give_the_base_and_the_llama3_scaling() {
        let v5 = LLAMA3_8B.replace("\"rope_theta\": 500000.0,", "").replace(
            "\"rope_scaling\": null,",
            "\"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": 500000.0, \"factor\": 8.0, \
             \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192},",
        );
        let a = section(&v5).arch().unwrap();
        assert_eq!(a.rope_theta, 5e5);
        assert_eq!(
            a.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192
            }
        );
        let back = section(&serde_json::to_string(&write_config(&a)).unwrap()).arch().unwrap();
        assert_eq!(back, a);
    }

    #[test]
    fn a_scaling_not_computed_is_refused_by_name() {
        let dynamic = LLAMA3_8B.replace(
            "\"rope_scaling\": null",
            "\"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 2.0}",
        );
        let err = parse_config(Path::new("m/config.json"), &dynamic).unwrap_err().to_string();
        assert!(
            err.contains("m/config.json") && err.contains("`rope_scaling`") && err.contains("dynamic"),
            "{err}"
        );
    }

    #[test]
    fn biases_and_head_dim_are_read() {
        let biased =
            LLAMA3_8B.replace("\"attention_bias\": false", "\"attention_bias\": true, \"head_dim\": 64");
        let a = section(&biased).arch().unwrap();
        assert!(a.qkv_bias && a.o_bias && !a.mlp_bias);
        assert_eq!(a.head_dim, 64);
    }

    #[test]
    fn a_llama_we_write_reads_back_as_the_same_model() {
        for tied in [false, true] {
            let m = ModelSection {
                family: "llama".into(),
                n_layer: 3,
                n_head: 4,
                n_kv_head: 2,
                n_embd: 16,
                intermediate_size: 40,
                vocab_size: 256,
                block_size: 32,
                rope_theta: 5e5,
                tie_word_embeddings: Some(tied),
                ..Default::default()
            };
            let a = m.arch().unwrap();
            let back = section(&serde_json::to_string(&write_config(&a)).unwrap()).arch().unwrap();
            assert_eq!(back, a);
        }
    }
}
