//! Qwen2 (and Qwen2.5) as a preset of the one block: Llama's block with
//! biases on q, k and v (not on o, not in the MLP). Its files are
//! `Qwen2ForCausalLM`'s, Llama's names and layouts; its `config.json` is
//! Llama's less `attention_bias` / `mlp_bias` (the biases are fixed) plus the
//! sliding-window switch, which pipewright refuses on (Qwen2 slides the
//! window on the layers from `max_window_layers` on only).

use super::arch::Arch;
use super::family::{Family, Spec};
use super::hf::{Fields, HfError};
use super::llama::{from_hf, hf_name, read_common, to_hf, write_common};
use super::section::ModelSection;
use crate::check::Checks;

pub static SPEC: Spec = Spec {
    name: "qwen2",
    title: "Qwen2",
    model_types: &["qwen2"],
    hf_class: "Qwen2ForCausalLM",
    preset,
    read_config,
    write_config,
    to_hf,
    from_hf,
    hf_name,
};

fn preset(m: &ModelSection, c: &mut Checks) -> Arch {
    let f = "qwen2";
    for field in ["sliding_window", "head_dim"] {
        m.refuse_unless_unset(c, f, field);
    }
    let fixed = |c: &mut Checks, path: &str, v: Option<bool>, want: bool, what: &str| {
        c.check(
            v.is_none_or(|v| v == want),
            path,
            v.unwrap_or(want),
            format!("must be {want} or unset with model.family = \"{f}\" ({what})"),
        )
    };
    fixed(c, "model.attention_bias", m.attention_bias, true, "Qwen2's q, k and v have biases, its o none");
    fixed(c, "model.mlp_bias", m.mlp_bias, false, "Qwen2's MLP has no biases");
    Arch {
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        ..m.common(Family::named(f).expect("qwen2 is a family"))
    }
}

/// A `Qwen2Config`: Llama's fields, the window switched off.
pub fn read_config(f: &Fields) -> Result<Vec<String>, HfError> {
    read_unwindowed(f, "qwen2")
}

/// Llama's fields for a Qwen family, checking that no layer slides its
/// window (`use_sliding_window`, or `layer_types` naming a sliding layer).
pub fn read_unwindowed(f: &Fields, family: &str) -> Result<Vec<String>, HfError> {
    f.must("use_sliding_window", &|g| g == false, "false (Qwen's per-layer sliding window is not computed)")?;
    f.must(
        "layer_types",
        &|g| g.as_array().is_some_and(|l| l.iter().all(|t| t == "full_attention")),
        "every layer \"full_attention\"",
    )?;
    read_common(f, family)
}

fn write_config(a: &Arch) -> serde_json::Value {
    write_unwindowed(a, "Qwen2ForCausalLM", "qwen2")
}

/// Llama's fields with Qwen's per-layer window switched off (what
/// [`read_unwindowed`] requires back).
pub fn write_unwindowed(a: &Arch, class: &str, model_type: &str) -> serde_json::Value {
    let mut v = write_common(a, class, model_type);
    v["use_sliding_window"] = false.into();
    v["sliding_window"] = serde_json::Value::Null;
    v["max_window_layers"] = a.n_layer.into();
    v
}

#[cfg(test)]
mod tests {
    use super::super::hf::parse_config;
    use super::*;
    use std::path::Path;

    /// Qwen2.5-0.5B's `config.json` (trimmed of generation settings).
    const QWEN25_05B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
      "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
      "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
      "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
      "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
      "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_cache": true,
      "use_sliding_window": false, "vocab_size": 151936
    }"#;

    fn arch(text: &str) -> Arch {
        parse_config(Path::new("config.json"), text).unwrap().section().unwrap().arch().unwrap()
    }

    #[test]
    fn qwen2_5_0_5b_gives_its_shape_biases_and_parameter_count() {
        let a = arch(QWEN25_05B);
        assert_eq!(a.family.name(), "qwen2");
        assert!(a.qkv_bias && !a.o_bias && !a.mlp_bias && a.tied && !a.qk_norm && a.window.is_none());
        assert_eq!((a.n_head, a.n_kv_head, a.head_dim, a.rope_theta, a.norm_eps), (14, 2, 64, 1e6, 1e-6));
        // Qwen2.5-0.5B: 494,032,768 parameters (the tied embedding once).
        assert_eq!(a.num_params(), 494_032_768);
        let back = arch(&serde_json::to_string(&write_config(&a)).unwrap());
        assert_eq!(back, a);
    }

    #[test]
    fn a_sliding_window_is_refused_by_name() {
        let on = QWEN25_05B.replace("\"use_sliding_window\": false", "\"use_sliding_window\": true");
        let err = parse_config(Path::new("q/config.json"), &on).unwrap_err().to_string();
        assert!(err.contains("q/config.json") && err.contains("`use_sliding_window`"), "{err}");
        let m = ModelSection {
            family: "qwen2".into(),
            sliding_window: 16,
            intermediate_size: 8,
            ..Default::default()
        };
        let p = m.arch().unwrap_err();
        assert_eq!(p[0].path, "model.sliding_window", "{p:?}");
        let m = ModelSection {
            family: "qwen2".into(),
            attention_bias: Some(false),
            intermediate_size: 8,
            ..Default::default()
        };
        assert_eq!(m.arch().unwrap_err()[0].path, "model.attention_bias");
    }
}
