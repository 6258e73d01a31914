//! Mistral as a preset of the one block: Llama's block with sliding-window
//! attention (a query sees the `sliding_window` keys up to itself; none:
//! full attention) and a head size of its own when `head_dim` says. Its
//! files are `MistralForCausalLM`'s, Llama's names and layouts.

use super::arch::Arch;
use super::family::{Family, Spec};
use super::hf::{Fields, HfError};
use super::llama::{from_hf, hf_name, read_common, to_hf, write_common};
use super::section::ModelSection;
use crate::check::Checks;

pub static SPEC: Spec = Spec {
    name: "mistral",
    title: "Mistral",
    model_types: &["mistral"],
    hf_class: "MistralForCausalLM",
    preset,
    read_config,
    write_config,
    to_hf,
    from_hf,
    hf_name,
};

fn preset(m: &ModelSection, c: &mut Checks) -> Arch {
    let f = "mistral";
    for (path, v) in [("model.attention_bias", m.attention_bias), ("model.mlp_bias", m.mlp_bias)] {
        c.check(
            v != Some(true),
            path,
            "true",
            format!(
                "must be false or unset with model.family = \"{f}\" (Mistral's projections have no biases)"
            ),
        );
    }
    m.common(Family::named(f).expect("mistral is a family"))
}

/// A `MistralConfig`: Llama's fields and the window (absent: its default
/// 4096; null: full attention).
fn read_config(f: &Fields) -> Result<Vec<String>, HfError> {
    let mut o = read_common(f, "mistral")?;
    let window = match f.v.get("sliding_window") {
        None => 4096,
        Some(serde_json::Value::Null) => 0,
        Some(_) => f.int("sliding_window")?,
    };
    o.push(format!("model.sliding_window={window}"));
    Ok(o)
}

fn write_config(a: &Arch) -> serde_json::Value {
    let mut v = write_common(a, "MistralForCausalLM", "mistral");
    v["sliding_window"] = a.window.into();
    v
}

#[cfg(test)]
mod tests {
    use super::super::hf::parse_config;
    use super::*;
    use std::path::Path;

    /// Mistral-7B-v0.1's `config.json`.
    const MISTRAL_7B: &str = r#"{
      "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 32000
    }"#;

    fn arch(text: &str) -> Arch {
        parse_config(Path::new("config.json"), text).unwrap().section().unwrap().arch().unwrap()
    }

    #[test]
    fn mistral_7b_gives_its_window_and_parameter_count() {
        let a = arch(MISTRAL_7B);
        assert_eq!(a.family.name(), "mistral");
        assert_eq!(a.window, Some(4096));
        assert!(!a.qkv_bias && !a.tied && !a.qk_norm);
        // Mistral-7B: 7,241,732,096 parameters.
        assert_eq!(a.num_params(), 7_241_732_096);
        assert_eq!(arch(&serde_json::to_string(&write_config(&a)).unwrap()), a);
        let full = MISTRAL_7B.replace("\"sliding_window\": 4096", "\"sliding_window\": null");
        assert_eq!(arch(&full).window, None);
        let absent = MISTRAL_7B.replace("\"sliding_window\": 4096, ", "");
        assert_eq!(arch(&absent).window, Some(4096));
    }
}
