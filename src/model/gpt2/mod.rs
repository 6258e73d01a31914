//! GPT-2 as a preset of the one block: LayerNorm, a learned position table,
//! a tanh-GELU MLP, biases on every projection, a tied head, and the
//! residual projections' initialisation scaled by 1/√(2·L).
//!
//! Its files are `GPT2LMHeadModel`'s: `wte`, `wpe`, `h.{i}.ln_1`, the fused
//! `attn.c_attn` and the other projections as `Conv1D` keeps them, (in, out)
//! where ours are `nn.Linear`'s (out, in). The adapter splits `c_attn` into
//! q, k and v (and joins them back), transposes the projections, and renames.

use super::arch::{Arch, Init, Mlp, Norm, Positions};
use super::family::{Family, FromHfError, HfTensor, Spec, Tensor};
use super::hf::{Fields, HfError};
use super::section::ModelSection;
use crate::check::Checks;
use std::borrow::Cow;

pub static SPEC: Spec = Spec {
    name: "gpt2",
    title: "GPT-2",
    model_types: &["gpt2"],
    hf_class: "GPT2LMHeadModel",
    preset,
    read_config,
    write_config,
    to_hf,
    from_hf,
    hf_name,
};

impl Arch {
    /// A GPT-2 of this shape (tests, benchmarks, the GPU checks).
    pub fn gpt2(n_layer: usize, n_head: usize, n_embd: usize, vocab_size: usize, block_size: usize) -> Arch {
        let m = ModelSection { n_layer, n_head, n_embd, vocab_size, block_size, ..ModelSection::default() };
        m.arch().unwrap_or_else(|p| panic!("not a GPT-2: {p:?}"))
    }
}

/// GPT-2's LayerNorm epsilon, the one its kernels compute with.
const EPS: f64 = 1e-5;

fn preset(m: &ModelSection, c: &mut Checks) -> Arch {
    let f = "gpt2";
    for field in ["sliding_window", "rope_scaling", "head_dim"] {
        m.refuse_unless_unset(c, f, field);
    }
    c.check(
        m.n_kv_head == 0 || m.n_kv_head == m.n_head,
        "model.n_kv_head",
        m.n_kv_head,
        "must be 0 or model.n_head with model.family = \"gpt2\" (GPT-2 has a key/value head per query head; \
         grouped-query attention is a Llama-style family's)",
    );
    let always = |c: &mut Checks, path: &str, v: Option<bool>, what: &str| {
        c.check(
            v != Some(false),
            path,
            "false",
            format!("must be true or unset with model.family = \"gpt2\" ({what})"),
        )
    };
    always(c, "model.tie_word_embeddings", m.tie_word_embeddings, "GPT-2's head reads wte");
    always(c, "model.attention_bias", m.attention_bias, "GPT-2's projections all have biases");
    always(c, "model.mlp_bias", m.mlp_bias, "GPT-2's projections all have biases");
    c.check(
        m.rms_norm_eps == EPS,
        "model.rms_norm_eps",
        m.rms_norm_eps,
        "must be 1e-5 with model.family = \"gpt2\" (GPT-2's LayerNorm epsilon)",
    );
    let family = Family::named(f).expect("gpt2 is a family");
    Arch {
        norm: Norm::LayerNorm,
        positions: Positions::Learned,
        mlp: Mlp::Gelu,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        tied: true,
        ffn: if m.intermediate_size == 0 { 4 * m.n_embd } else { m.intermediate_size },
        init: Init { std: 0.02, scaled_residual: true },
        ..m.common(family)
    }
}

/// A `GPT2Config`: the fields pipewright computes, and every field whose
/// other values would change the arithmetic checked.
fn read_config(f: &Fields) -> Result<Vec<String>, HfError> {
    f.must(
        "activation_function",
        &|g| g == "gelu_new" || g == "gelu_pytorch_tanh",
        "\"gelu_new\" (GPT-2's tanh GELU, which pipewright computes)",
    )?;
    f.must("layer_norm_epsilon", &|g| g.as_f64() == Some(EPS), "1e-05 (pipewright's LayerNorm)")?;
    f.must("tie_word_embeddings", &|g| g == true, "true (GPT-2's head reads wte)")?;
    f.must("scale_attn_by_inverse_layer_idx", &|g| g == false, "false")?;
    f.must("reorder_and_upcast_attn", &|g| g == false, "false")?;
    f.must("scale_attn_weights", &|g| g == true, "true (attention scaled by 1/√head size)")?;
    let n_positions = match f.v.get("n_positions") {
        Some(_) => f.int("n_positions")?,
        None => f.int("n_ctx")?,
    };
    let mut o = vec![
        "model.family=\"gpt2\"".to_string(),
        format!("model.n_layer={}", f.int("n_layer")?),
        format!("model.n_head={}", f.int("n_head")?),
        format!("model.n_embd={}", f.int("n_embd")?),
        format!("model.vocab_size={}", f.int("vocab_size")?),
        format!("model.block_size={n_positions}"),
    ];
    if f.v.get("n_inner").is_some_and(|g| !g.is_null()) {
        o.push(format!("model.intermediate_size={}", f.int("n_inner")?));
    }
    Ok(o)
}

/// A `config.json` that transformers' `GPT2LMHeadModel.from_pretrained`
/// reads as this model: GPT-2's tanh GELU, eps 1e-5, tied head, no dropout
/// (pipewright trains without it). GPT-2's end-of-text id only where the
/// vocabulary holds it.
fn write_config(a: &Arch) -> serde_json::Value {
    let eot = (a.vocab_size > 50_256).then_some(50_256);
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": a.n_layer,
        "n_head": a.n_head,
        "n_embd": a.n_embd,
        "vocab_size": a.vocab_size,
        "n_positions": a.block_size,
        "n_ctx": a.block_size,
        "n_inner": (a.ffn != 4 * a.n_embd).then_some(a.ffn),
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": true,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "initializer_range": a.init.std,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    })
}

/// Where one of our tensors lives in GPT-2's files.
#[derive(Debug, PartialEq)]
enum Place {
    /// The same values under another name.
    Same(String),
    /// Transposed (Conv1D's (in, out) against our (out, in)) under another name.
    Transposed(String),
    /// Part `k` of 3 of `c_attn` (q, k, v), transposed if a weight.
    Fused { name: String, k: usize, weight: bool },
}

/// Our block tensor name after `layers.{i}.`, as GPT-2 places it.
fn place_in_block(i: &str, rest: &str) -> Option<Place> {
    let h = |s: &str| format!("h.{i}.{s}");
    let qkv = |k, weight| {
        Some(Place::Fused {
            name: h(if weight { "attn.c_attn.weight" } else { "attn.c_attn.bias" }),
            k,
            weight,
        })
    };
    match rest {
        "input_layernorm.weight" => Some(Place::Same(h("ln_1.weight"))),
        "input_layernorm.bias" => Some(Place::Same(h("ln_1.bias"))),
        "self_attn.q_proj.weight" => qkv(0, true),
        "self_attn.k_proj.weight" => qkv(1, true),
        "self_attn.v_proj.weight" => qkv(2, true),
        "self_attn.q_proj.bias" => qkv(0, false),
        "self_attn.k_proj.bias" => qkv(1, false),
        "self_attn.v_proj.bias" => qkv(2, false),
        "self_attn.o_proj.weight" => Some(Place::Transposed(h("attn.c_proj.weight"))),
        "self_attn.o_proj.bias" => Some(Place::Same(h("attn.c_proj.bias"))),
        "post_attention_layernorm.weight" => Some(Place::Same(h("ln_2.weight"))),
        "post_attention_layernorm.bias" => Some(Place::Same(h("ln_2.bias"))),
        "mlp.up_proj.weight" => Some(Place::Transposed(h("mlp.c_fc.weight"))),
        "mlp.up_proj.bias" => Some(Place::Same(h("mlp.c_fc.bias"))),
        "mlp.down_proj.weight" => Some(Place::Transposed(h("mlp.c_proj.weight"))),
        "mlp.down_proj.bias" => Some(Place::Same(h("mlp.c_proj.bias"))),
        _ => None,
    }
}

/// Where our tensor `name` lives in GPT-2's files.
fn place(name: &str) -> Option<Place> {
    match name {
        "embed_tokens.weight" => Some(Place::Same("wte.weight".into())),
        "embed_positions.weight" => Some(Place::Same("wpe.weight".into())),
        "norm.weight" => Some(Place::Same("ln_f.weight".into())),
        "norm.bias" => Some(Place::Same("ln_f.bias".into())),
        "lm_head.weight" => Some(Place::Same("lm_head.weight".into())),
        _ => {
            let (i, rest) = name.strip_prefix("layers.")?.split_once('.')?;
            place_in_block(i, rest)
        }
    }
}

fn hf_name(_: &Arch, name: &str) -> String {
    match place(name) {
        Some(Place::Same(n) | Place::Transposed(n) | Place::Fused { name: n, .. }) => n,
        None => name.to_string(),
    }
}

/// (rows, cols) row-major → (cols, rows).
pub(crate) fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
    out
}

fn to_hf<'a>(a: &Arch, ours: Vec<(&'a str, &'a [usize], &'a [f32])>) -> Vec<HfTensor<'a>> {
    let c = a.n_embd;
    let mut out = Vec::with_capacity(ours.len());
    // c_attn's three parts by layer, joined once all three are seen.
    let mut fused: std::collections::BTreeMap<String, [Option<&'a [f32]>; 3]> = Default::default();
    for (name, shape, data) in ours {
        match place(name).unwrap_or_else(|| panic!("`{name}` is not a GPT-2 tensor")) {
            Place::Same(n) => out.push((n, shape.to_vec(), Cow::Borrowed(data))),
            Place::Transposed(n) => {
                out.push((n, vec![shape[1], shape[0]], Cow::Owned(transpose(data, shape[0], shape[1]))))
            }
            Place::Fused { name, k, .. } => fused.entry(name).or_default()[k] = Some(data),
        }
    }
    for (name, parts) in fused {
        let parts = parts.map(|p| p.unwrap_or_else(|| panic!("`{name}` lacks one of q, k, v")));
        if name.ends_with(".weight") {
            // Our q, k, v are (C, C) each, (out, in); c_attn is (C, 3C), (in, out).
            let mut w = vec![0.0; 3 * c * c];
            for (k, part) in parts.iter().enumerate() {
                for o in 0..c {
                    for i in 0..c {
                        w[i * 3 * c + k * c + o] = part[o * c + i];
                    }
                }
            }
            out.push((name, vec![c, 3 * c], Cow::Owned(w)));
        } else {
            out.push((name, vec![3 * c], Cow::Owned(parts.concat())));
        }
    }
    out
}

fn from_hf(a: &Arch, file_name: &str, shape: Vec<usize>, data: Vec<f32>) -> Result<Vec<Tensor>, FromHfError> {
    let name = file_name.strip_prefix("transformer.").unwrap_or(file_name);
    // The causal mask GPT-2's checkpoints carry beside the weights.
    if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
        return Ok(vec![]);
    }
    let c = a.n_embd;
    let want = |ours: &str| -> Option<Vec<usize>> {
        super::params::all_tensors(a).into_iter().find(|(n, _)| n == ours).map(|(_, s)| s)
    };
    let check =
        |expected: Vec<usize>| if shape == expected { Ok(()) } else { Err(FromHfError::Shape { expected }) };
    // The tied head is ours too: the loader compares it with wte and drops it.
    let plain = |ours: &str| -> Result<Vec<Tensor>, FromHfError> {
        let expected = match ours {
            "lm_head.weight" => vec![a.vocab_size, c],
            "embed_positions.weight" if shape.len() == 2 && shape[1] == c && shape[0] >= a.block_size => {
                shape.clone()
            }
            _ => want(ours).ok_or(FromHfError::Unknown)?,
        };
        check(expected)?;
        Ok(vec![(ours.to_string(), shape.clone(), data.clone())])
    };
    match name {
        "wte.weight" => return plain("embed_tokens.weight"),
        "wpe.weight" => return plain("embed_positions.weight"),
        "ln_f.weight" => return plain("norm.weight"),
        "ln_f.bias" => return plain("norm.bias"),
        "lm_head.weight" => return plain("lm_head.weight"),
        _ => {}
    }
    let (i, rest) = name.strip_prefix("h.").and_then(|r| r.split_once('.')).ok_or(FromHfError::Unknown)?;
    let layer = |s: &str| format!("layers.{i}.{s}");
    let ours_of = |s: &str| -> Result<String, FromHfError> {
        let n = layer(s);
        want(&n).map(|_| n).ok_or(FromHfError::Unknown)
    };
    let transposed = |s: &str| -> Result<Vec<Tensor>, FromHfError> {
        let ours = ours_of(s)?;
        let w = want(&ours).ok_or(FromHfError::Unknown)?;
        check(vec![w[1], w[0]])?;
        Ok(vec![(ours, w.clone(), transpose(&data, w[1], w[0]))])
    };
    match rest {
        "ln_1.weight" => plain(&ours_of("input_layernorm.weight")?),
        "ln_1.bias" => plain(&ours_of("input_layernorm.bias")?),
        "ln_2.weight" => plain(&ours_of("post_attention_layernorm.weight")?),
        "ln_2.bias" => plain(&ours_of("post_attention_layernorm.bias")?),
        "attn.c_proj.weight" => transposed("self_attn.o_proj.weight"),
        "attn.c_proj.bias" => plain(&ours_of("self_attn.o_proj.bias")?),
        "mlp.c_fc.weight" => transposed("mlp.up_proj.weight"),
        "mlp.c_fc.bias" => plain(&ours_of("mlp.up_proj.bias")?),
        "mlp.c_proj.weight" => transposed("mlp.down_proj.weight"),
        "mlp.c_proj.bias" => plain(&ours_of("mlp.down_proj.bias")?),
        "attn.c_attn.weight" => {
            ours_of("self_attn.q_proj.weight")?;
            check(vec![c, 3 * c])?;
            Ok(["q", "k", "v"]
                .iter()
                .enumerate()
                .map(|(k, p)| {
                    let mut w = vec![0.0; c * c];
                    for i in 0..c {
                        for o in 0..c {
                            w[o * c + i] = data[i * 3 * c + k * c + o];
                        }
                    }
                    (layer(&format!("self_attn.{p}_proj.weight")), vec![c, c], w)
                })
                .collect())
        }
        "attn.c_attn.bias" => {
            ours_of("self_attn.q_proj.bias")?;
            check(vec![3 * c])?;
            Ok(["q", "k", "v"]
                .iter()
                .enumerate()
                .map(|(k, p)| {
                    (layer(&format!("self_attn.{p}_proj.bias")), vec![c], data[k * c..(k + 1) * c].to_vec())
                })
                .collect())
        }
        _ => Err(FromHfError::Unknown),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::params::all_tensors;

    fn arch() -> Arch {
        let m = ModelSection {
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            vocab_size: 11,
            block_size: 5,
            ..Default::default()
        };
        m.arch().unwrap()
    }

    #[test]
    fn our_tensors_go_to_gpt2_files_and_come_back_the_same() {
        let a = arch();
        let ours: Vec<(String, Vec<usize>, Vec<f32>)> = all_tensors(&a)
            .into_iter()
            .enumerate()
            .map(|(t, (n, s))| {
                let len: usize = s.iter().product();
                (n, s, (0..len).map(|i| (t * 1000 + i) as f32).collect())
            })
            .collect();
        let refs = ours.iter().map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice())).collect();
        let hf = to_hf(&a, refs);
        let names: Vec<&str> = hf.iter().map(|(n, ..)| n.as_str()).collect();
        for want in ["wte.weight", "wpe.weight", "h.1.attn.c_attn.weight", "h.0.mlp.c_proj.bias", "ln_f.bias"]
        {
            assert!(names.contains(&want), "{want} in {names:?}");
        }
        let c_attn = hf.iter().find(|(n, ..)| n == "h.0.attn.c_attn.weight").unwrap();
        assert_eq!(c_attn.1, vec![8, 24]);
        let mut back: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        for (n, s, d) in hf {
            back.extend(from_hf(&a, &format!("transformer.{n}"), s, d.into_owned()).unwrap());
        }
        back.sort_by(|x, y| x.0.cmp(&y.0));
        let mut want = ours.clone();
        want.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(back, want);
    }

    #[test]
    fn c_attn_columns_are_q_then_k_then_v_transposed() {
        let a = arch();
        let c = 8;
        // c_attn[i][j] = j: column j of the fused (in, out) weight.
        let data: Vec<f32> = (0..c * 3 * c).map(|x| (x % (3 * c)) as f32).collect();
        let got = from_hf(&a, "h.0.attn.c_attn.weight", vec![c, 3 * c], data).unwrap();
        assert_eq!(got[1].0, "layers.0.self_attn.k_proj.weight");
        // Row o of our k is c_attn's column C + o.
        assert!(got[1].2[3 * c..4 * c].iter().all(|&x| x == (c + 3) as f32));
        let bad = from_hf(&a, "h.0.attn.c_attn.weight", vec![c, 2 * c], vec![0.0; 2 * c * c]);
        assert_eq!(bad, Err(FromHfError::Shape { expected: vec![c, 3 * c] }));
        assert_eq!(from_hf(&a, "h.2.ln_1.weight", vec![c], vec![0.0; c]), Err(FromHfError::Unknown));
        assert_eq!(from_hf(&a, "h.0.attn.bias", vec![1], vec![0.0]), Ok(vec![]));
    }
}
