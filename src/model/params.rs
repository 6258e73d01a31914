//! Parameter tensors: names, shapes, which get weight decay, and GPT-2's
//! initialisation. Names and layouts are Hugging Face GPT-2's, so weights move
//! to and from that ecosystem unchanged.

use crate::rng::{hash_str, Purpose, Rng};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    pub block_size: usize,
}

impl GptConfig {
    pub fn from_config(c: &crate::config::Config) -> Self {
        GptConfig {
            n_layer: c.model.n_layer,
            n_head: c.model.n_head,
            n_embd: c.model.n_embd,
            vocab_size: c.model.vocab_size,
            block_size: c.model.block_size,
        }
    }

    /// Parameters in the model (the tied embedding counted once).
    pub fn num_params(&self) -> usize {
        all_tensors(self).iter().map(|(_, s)| s.iter().product::<usize>()).sum()
    }

    /// Training FLOPs per token as llm.c counts them: 6·N for the matrix products
    /// (forward + backward) plus 6·L·C·T for attention.
    pub fn flops_per_token(&self) -> f64 {
        let (l, c, t) = (self.n_layer as f64, self.n_embd as f64, self.block_size as f64);
        6.0 * self.num_params() as f64 + 6.0 * l * c * t
    }
}

/// One parameter tensor with its gradient accumulator. Serde writes its
/// name, shape and position only: messages carry the tensors beside it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Param {
    pub name: String,
    pub shape: Vec<usize>,
    #[serde(skip)]
    pub data: Vec<f32>,
    #[serde(skip)]
    pub grad: Vec<f32>,
    /// Position in `all_tensors` order, the order global sums run in.
    pub canonical: usize,
}

impl Param {
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// PyTorch practice (nanoGPT): decay tensors of 2 or more dimensions —
    /// matrix weights and both embeddings — not biases or LayerNorm parameters.
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// The 12 tensors of block `i` in canonical order, with their shapes.
pub fn block_tensors(cfg: &GptConfig, i: usize) -> Vec<(String, Vec<usize>)> {
    let c = cfg.n_embd;
    let p = |s: &str| format!("h.{i}.{s}");
    vec![
        (p("ln_1.weight"), vec![c]),
        (p("ln_1.bias"), vec![c]),
        (p("attn.c_attn.weight"), vec![c, 3 * c]),
        (p("attn.c_attn.bias"), vec![3 * c]),
        (p("attn.c_proj.weight"), vec![c, c]),
        (p("attn.c_proj.bias"), vec![c]),
        (p("ln_2.weight"), vec![c]),
        (p("ln_2.bias"), vec![c]),
        (p("mlp.c_fc.weight"), vec![c, 4 * c]),
        (p("mlp.c_fc.bias"), vec![4 * c]),
        (p("mlp.c_proj.weight"), vec![4 * c, c]),
        (p("mlp.c_proj.bias"), vec![c]),
    ]
}

pub fn embedding_tensors(cfg: &GptConfig) -> Vec<(String, Vec<usize>)> {
    vec![
        ("wte.weight".into(), vec![cfg.vocab_size, cfg.n_embd]),
        ("wpe.weight".into(), vec![cfg.block_size, cfg.n_embd]),
    ]
}

pub fn final_norm_tensors(cfg: &GptConfig) -> Vec<(String, Vec<usize>)> {
    vec![("ln_f.weight".into(), vec![cfg.n_embd]), ("ln_f.bias".into(), vec![cfg.n_embd])]
}

/// Every tensor of the model in canonical order (the order gradient norms are
/// summed in, whatever the layout).
pub fn all_tensors(cfg: &GptConfig) -> Vec<(String, Vec<usize>)> {
    let mut v = embedding_tensors(cfg);
    for i in 0..cfg.n_layer {
        v.extend(block_tensors(cfg, i));
    }
    v.extend(final_norm_tensors(cfg));
    v
}

/// GPT-2 initialisation, keyed by the tensor's name so every layout and every
/// copy of a tied tensor starts from the same values: LayerNorm weights 1,
/// biases 0, weights N(0, 0.02), residual output projections N(0, 0.02/√(2·L)).
pub fn init_tensor(cfg: &GptConfig, name: &str, shape: &[usize], seed: u64) -> Vec<f32> {
    let n: usize = shape.iter().product();
    if name.ends_with(".bias") {
        return vec![0.0; n];
    }
    if name.contains("ln_") {
        return vec![1.0; n];
    }
    let mut std = 0.02;
    if name.ends_with("c_proj.weight") {
        std /= (2.0 * cfg.n_layer as f64).sqrt();
    }
    let mut rng = Rng::new(seed, Purpose::Init, &[hash_str(name)]);
    (0..n).map(|_| (rng.normal() * std) as f32).collect()
}

pub fn new_param(cfg: &GptConfig, name: String, shape: Vec<usize>, seed: u64) -> Param {
    let data = init_tensor(cfg, &name, &shape, seed);
    let grad = vec![0.0; data.len()];
    let canonical = canonical_index(cfg, &name).expect("a GPT-2 tensor name");
    Param { name, shape, data, grad, canonical }
}

/// Position of a tensor in `all_tensors` order, from its name alone.
pub fn canonical_index(cfg: &GptConfig, name: &str) -> Option<usize> {
    const BLOCK: [&str; 12] = [
        "ln_1.weight",
        "ln_1.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "ln_2.weight",
        "ln_2.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    ];
    match name {
        "wte.weight" => Some(0),
        "wpe.weight" => Some(1),
        "ln_f.weight" => Some(2 + 12 * cfg.n_layer),
        "ln_f.bias" => Some(3 + 12 * cfg.n_layer),
        _ => {
            let rest = name.strip_prefix("h.")?;
            let (layer, tensor) = rest.split_once('.')?;
            let layer: usize = layer.parse().ok()?;
            let k = BLOCK.iter().position(|b| *b == tensor)?;
            (layer < cfg.n_layer).then_some(2 + 12 * layer + k)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_index_matches_all_tensors_order() {
        let cfg = GptConfig { n_layer: 3, n_head: 2, n_embd: 8, vocab_size: 10, block_size: 4 };
        for (i, (name, _)) in all_tensors(&cfg).iter().enumerate() {
            assert_eq!(canonical_index(&cfg, name), Some(i), "{name}");
        }
        assert_eq!(canonical_index(&cfg, "h.3.ln_1.weight"), None);
        assert_eq!(canonical_index(&cfg, "lm_head.weight"), None);
    }
}

/// Indices of a block's 12 tensors, in [`block_tensors`] order.
pub mod block {
    pub const LN1W: usize = 0;
    pub const LN1B: usize = 1;
    pub const QKVW: usize = 2;
    pub const QKVB: usize = 3;
    pub const PROJW: usize = 4;
    pub const PROJB: usize = 5;
    pub const LN2W: usize = 6;
    pub const LN2B: usize = 7;
    pub const FCW: usize = 8;
    pub const FCB: usize = 9;
    pub const FCPW: usize = 10;
    pub const FCPB: usize = 11;
}
