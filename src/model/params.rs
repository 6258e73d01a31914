//! Parameter tensors: names, shapes, which get weight decay, and GPT-2's
//! initialisation. Names and layouts are Hugging Face GPT-2's, so weights move
//! to and from that ecosystem unchanged.

pub use crate::config::Family;
use crate::rng::{hash_str, Purpose, Rng};

/// The model's shape, for every family: the one description the runtime,
/// optimizer, checkpoints, tensor split and planner ask (through the
/// functions below), never a family's own fields.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arch {
    pub family: Family,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    pub block_size: usize,
    /// Key/value heads (read through [`Arch::kv_heads`]).
    pub n_kv_head: usize,
    /// The MLP's width (read through [`Arch::ffn`]).
    pub intermediate_size: usize,
    pub rope_theta: f32,
    pub norm_eps: f32,
    /// Whether the head reads the token embedding (read through [`Arch::tied`]).
    pub tie_word_embeddings: bool,
}

impl Arch {
    /// A GPT-2 of this shape.
    pub const fn gpt2(
        n_layer: usize,
        n_head: usize,
        n_embd: usize,
        vocab_size: usize,
        block_size: usize,
    ) -> Self {
        Arch {
            family: Family::Gpt2,
            n_layer,
            n_head,
            n_embd,
            vocab_size,
            block_size,
            n_kv_head: n_head,
            intermediate_size: 4 * n_embd,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
            tie_word_embeddings: true,
        }
    }

    /// A Llama of this shape, its head untied.
    #[allow(clippy::too_many_arguments)]
    pub const fn llama(
        n_layer: usize,
        n_head: usize,
        n_kv_head: usize,
        n_embd: usize,
        intermediate_size: usize,
        vocab_size: usize,
        block_size: usize,
        rope_theta: f32,
    ) -> Self {
        Arch {
            family: Family::Llama,
            n_layer,
            n_head,
            n_embd,
            vocab_size,
            block_size,
            n_kv_head,
            intermediate_size,
            rope_theta,
            norm_eps: 1e-5,
            tie_word_embeddings: false,
        }
    }

    pub fn from_config(c: &crate::config::Config) -> Self {
        let m = &c.model;
        Arch {
            family: m.family,
            n_layer: m.n_layer,
            n_head: m.n_head,
            n_embd: m.n_embd,
            vocab_size: m.vocab_size,
            block_size: m.block_size,
            n_kv_head: m.kv_heads(),
            intermediate_size: m.ffn_width(),
            rope_theta: m.rope_theta as f32,
            norm_eps: m.rms_norm_eps as f32,
            tie_word_embeddings: m.tied(),
        }
    }

    /// Key/value heads: GPT-2 has one per query head.
    pub fn kv_heads(&self) -> usize {
        match self.family {
            Family::Gpt2 => self.n_head,
            Family::Llama => self.n_kv_head,
        }
    }

    /// The MLP's hidden width: GPT-2's is 4·C whatever the field says.
    pub fn ffn(&self) -> usize {
        match self.family {
            Family::Gpt2 => 4 * self.n_embd,
            Family::Llama => self.intermediate_size,
        }
    }

    /// Whether the LM head reads the token embedding (GPT-2's always does).
    pub fn tied(&self) -> bool {
        self.family == Family::Gpt2 || self.tie_word_embeddings
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// The attention heads' shape.
    pub fn heads(&self) -> crate::kernels::cpu::attention::Heads {
        crate::kernels::cpu::attention::Heads { nh: self.n_head, nkv: self.kv_heads(), hs: self.head_dim() }
    }

    /// Tensors per block.
    pub fn block_len(&self) -> usize {
        match self.family {
            Family::Gpt2 => 12,
            Family::Llama => super::llama::BLOCK_LEN,
        }
    }

    /// Tensors of the embedding (GPT-2: tokens and positions; Llama:
    /// tokens), as [`embedding_tensors`] lists them; counted without building
    /// the list, since parts index by it on every step.
    pub fn embedding_len(&self) -> usize {
        match self.family {
            Family::Gpt2 => 2,
            Family::Llama => 1,
        }
    }

    /// Tensors of the final norm (GPT-2's LayerNorm has a bias, RMSNorm none).
    pub fn final_norm_len(&self) -> usize {
        match self.family {
            Family::Gpt2 => 2,
            Family::Llama => 1,
        }
    }

    /// Tensors in the model, as [`all_tensors`] lists them.
    pub fn tensor_count(&self) -> usize {
        self.embedding_len()
            + self.n_layer * self.block_len()
            + self.final_norm_len()
            + usize::from(!self.tied())
    }

    /// Whether tensor `canonical` has one row per vocabulary entry: the token
    /// embedding, and an untied head (the GPU pads both to 128-row multiples).
    pub fn vocab_rows(&self, canonical: usize) -> bool {
        canonical == 0 || (!self.tied() && canonical + 1 == self.tensor_count())
    }

    /// Parameters in the model (the tied embedding counted once).
    pub fn num_params(&self) -> usize {
        all_tensors(self).iter().map(|(_, s)| s.iter().product::<usize>()).sum()
    }

    /// Training FLOPs per token as llm.c counts them: 6·N for the matrix products
    /// (forward + backward) plus 6·L·C·T for attention (the query heads'
    /// width is C in both families).
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

/// Block `i`'s tensors in canonical order, with their shapes.
pub fn block_tensors(cfg: &Arch, i: usize) -> Vec<(String, Vec<usize>)> {
    if cfg.family == Family::Llama {
        return super::llama::block_tensors(&super::llama::LlamaBlockShape::of(cfg), i);
    }
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

/// The embedding's tensors, the token embedding first.
pub fn embedding_tensors(cfg: &Arch) -> Vec<(String, Vec<usize>)> {
    if cfg.family == Family::Llama {
        return vec![("embed_tokens.weight".into(), vec![cfg.vocab_size, cfg.n_embd])];
    }
    vec![
        ("wte.weight".into(), vec![cfg.vocab_size, cfg.n_embd]),
        ("wpe.weight".into(), vec![cfg.block_size, cfg.n_embd]),
    ]
}

pub fn final_norm_tensors(cfg: &Arch) -> Vec<(String, Vec<usize>)> {
    if cfg.family == Family::Llama {
        return vec![("norm.weight".into(), vec![cfg.n_embd])];
    }
    vec![("ln_f.weight".into(), vec![cfg.n_embd]), ("ln_f.bias".into(), vec![cfg.n_embd])]
}

/// The untied LM head's weight (none when the head reads the embedding).
pub fn head_tensors(cfg: &Arch) -> Vec<(String, Vec<usize>)> {
    match cfg.tied() {
        true => vec![],
        false => vec![("lm_head.weight".into(), vec![cfg.vocab_size, cfg.n_embd])],
    }
}

/// Every tensor of the model in canonical order (the order gradient norms are
/// summed in, whatever the layout).
pub fn all_tensors(cfg: &Arch) -> Vec<(String, Vec<usize>)> {
    let mut v = embedding_tensors(cfg);
    for i in 0..cfg.n_layer {
        v.extend(block_tensors(cfg, i));
    }
    v.extend(final_norm_tensors(cfg));
    v.extend(head_tensors(cfg));
    v
}

/// GPT-2 initialisation, keyed by the tensor's name so every layout and every
/// copy of a tied tensor starts from the same values: LayerNorm weights 1,
/// biases 0, weights N(0, 0.02), residual output projections N(0, 0.02/√(2·L)).
///
/// Llama as Hugging Face initialises it: norm weights 1, every other tensor
/// N(0, 0.02) (`initializer_range`).
pub fn init_tensor(cfg: &Arch, name: &str, shape: &[usize], seed: u64) -> Vec<f32> {
    let n: usize = shape.iter().product();
    if cfg.family == Family::Llama {
        if name.ends_with("norm.weight") {
            return vec![1.0; n];
        }
        let mut rng = Rng::new(seed, Purpose::Init, &[hash_str(name)]);
        return (0..n).map(|_| (rng.normal() * 0.02) as f32).collect();
    }
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

pub fn new_param(cfg: &Arch, name: String, shape: Vec<usize>, seed: u64) -> Param {
    let data = init_tensor(cfg, &name, &shape, seed);
    let grad = vec![0.0; data.len()];
    let canonical = canonical_index(cfg, &name).expect("a tensor name of the family");
    Param { name, shape, data, grad, canonical }
}

/// Position of a tensor in `all_tensors` order, from its name alone.
pub fn canonical_index(cfg: &Arch, name: &str) -> Option<usize> {
    let embed = embedding_tensors(cfg);
    if let Some(k) = embed.iter().position(|(n, _)| n == name) {
        return Some(k);
    }
    let (e, bl) = (embed.len(), cfg.block_len());
    let tail = e + bl * cfg.n_layer;
    let head = final_norm_tensors(cfg).into_iter().chain(head_tensors(cfg));
    if let Some(k) = head.map(|(n, _)| n).position(|n| n == name) {
        return Some(tail + k);
    }
    let prefix = match cfg.family {
        Family::Gpt2 => "h.",
        Family::Llama => "layers.",
    };
    let rest = name.strip_prefix(prefix)?;
    let (layer, tensor) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok().filter(|l| *l < cfg.n_layer && !layer.starts_with('+'))?;
    let want = format!("{prefix}0.{tensor}");
    let k = block_tensors(cfg, 0).iter().position(|(n, _)| *n == want)?;
    Some(e + bl * layer + k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_index_matches_all_tensors_order() {
        let cfg = Arch::gpt2(3, 2, 8, 10, 4);
        for (i, (name, _)) in all_tensors(&cfg).iter().enumerate() {
            assert_eq!(canonical_index(&cfg, name), Some(i), "{name}");
        }
        assert_eq!(canonical_index(&cfg, "h.3.ln_1.weight"), None);
        assert_eq!(canonical_index(&cfg, "lm_head.weight"), None);
        assert_eq!(embedding_tensors(&cfg).len(), cfg.embedding_len());
        assert_eq!(final_norm_tensors(&cfg).len(), cfg.final_norm_len());
        assert_eq!(block_tensors(&cfg, 0).len(), cfg.block_len());
        assert_eq!(all_tensors(&cfg).len(), cfg.tensor_count());
        let gpt2_vocab: Vec<usize> = (0..cfg.tensor_count()).filter(|&i| cfg.vocab_rows(i)).collect();
        assert_eq!(gpt2_vocab, [0], "wte alone: the head reads it");
        for tied in [false, true] {
            let llama = Arch { tie_word_embeddings: tied, ..Arch::llama(3, 4, 2, 8, 12, 10, 4, 1e4) };
            let all = all_tensors(&llama);
            assert_eq!(all.len(), 1 + 9 * 3 + 1 + usize::from(!tied));
            assert_eq!(embedding_tensors(&llama).len(), llama.embedding_len());
            assert_eq!(final_norm_tensors(&llama).len(), llama.final_norm_len());
            assert_eq!(block_tensors(&llama, 0).len(), llama.block_len());
            assert_eq!(all.len(), llama.tensor_count());
            let vocab: Vec<&str> = all
                .iter()
                .enumerate()
                .filter(|(i, _)| llama.vocab_rows(*i))
                .map(|(_, t)| t.0.as_str())
                .collect();
            let want: &[&str] =
                if tied { &["embed_tokens.weight"] } else { &["embed_tokens.weight", "lm_head.weight"] };
            assert_eq!(vocab, want);
            for (i, (name, _)) in all.iter().enumerate() {
                assert_eq!(canonical_index(&llama, name), Some(i), "{name}");
            }
            assert_eq!(canonical_index(&llama, "h.0.ln_1.weight"), None);
            assert_eq!(canonical_index(&llama, "layers.3.input_layernorm.weight"), None);
        }
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
