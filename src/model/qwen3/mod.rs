//! Qwen3 as a preset of the one block: Llama's block with an RMSNorm over
//! each head of q and of k before RoPE (`q_norm`, `k_norm`), biases on the
//! attention's projections only if `attention_bias`, and a head size of its
//! own (`head_dim`, 128 in its config's default, whatever hidden/heads is).
//! Its files are `Qwen3ForCausalLM`'s, Llama's names plus the two norms'
//! (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`).

use super::arch::Arch;
use super::family::{Family, Spec};
use super::hf::{Fields, HfError};
use super::llama::{from_hf, hf_name, to_hf};
use super::qwen2::{read_unwindowed, write_unwindowed};
use super::section::ModelSection;
use crate::check::Checks;

pub static SPEC: Spec = Spec {
    name: "qwen3",
    title: "Qwen3",
    model_types: &["qwen3"],
    hf_class: "Qwen3ForCausalLM",
    preset,
    read_config,
    write_config,
    to_hf,
    from_hf,
    hf_name,
};

fn preset(m: &ModelSection, c: &mut Checks) -> Arch {
    let f = "qwen3";
    m.refuse_unless_unset(c, f, "sliding_window");
    c.check(
        m.mlp_bias != Some(true),
        "model.mlp_bias",
        "true",
        format!("must be false or unset with model.family = \"{f}\" (Qwen3's MLP has no biases)"),
    );
    Arch { qk_norm: true, mlp_bias: false, ..m.common(Family::named(f).expect("qwen3 is a family")) }
}

/// A `Qwen3Config`: Llama's fields, the window off, `head_dim` 128 when absent.
fn read_config(f: &Fields) -> Result<Vec<String>, HfError> {
    let mut o = read_unwindowed(f, "qwen3")?;
    if f.v.get("head_dim").is_none_or(|g| g.is_null()) {
        o.push("model.head_dim=128".into());
    }
    if let Some(b) = f.bool("attention_bias")? {
        o.push(format!("model.attention_bias={b}"));
    }
    Ok(o)
}

fn write_config(a: &Arch) -> serde_json::Value {
    let mut v = write_unwindowed(a, "Qwen3ForCausalLM", "qwen3");
    v["attention_bias"] = a.qkv_bias.into();
    v
}

#[cfg(test)]
mod tests {
    use super::super::hf::parse_config;
    use super::*;
    use std::path::Path;

    /// Qwen3-0.6B's `config.json` (trimmed of generation settings).
    const QWEN3_06B: &str = r#"{
      "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
      "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
      "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
      "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_cache": true,
      "use_sliding_window": false, "vocab_size": 151936
    }"#;

    fn arch(text: &str) -> Arch {
        parse_config(Path::new("config.json"), text).unwrap().section().unwrap().arch().unwrap()
    }

    #[test]
    fn qwen3_0_6b_gives_its_head_size_norms_and_parameter_count() {
        let a = arch(QWEN3_06B);
        assert_eq!(a.family.name(), "qwen3");
        assert!(a.qk_norm && !a.qkv_bias && !a.o_bias && a.tied && a.window.is_none());
        assert_eq!((a.n_head, a.n_kv_head, a.head_dim, a.n_embd), (16, 8, 128, 1024));
        // Qwen3-0.6B: 596,049,920 parameters (the tied embedding once).
        assert_eq!(a.num_params(), 596_049_920);
        let names: Vec<String> =
            super::super::params::block_tensors(&a, 0).into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"layers.0.self_attn.q_norm.weight".to_string()), "{names:?}");
        assert_eq!(arch(&serde_json::to_string(&write_config(&a)).unwrap()), a);
        // Without head_dim the config's default, 128, not hidden / heads.
        let bare = QWEN3_06B.replace("\"head_dim\": 128, ", "");
        assert_eq!(arch(&bare).head_dim, 128);
    }
}
