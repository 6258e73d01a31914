//! Parameter tensors: names, shapes, which get weight decay, and their
//! initialisation, all following from the model's settings ([`Arch`]).
//! Names are ours (Hugging Face Llama's, less the `model.` prefix); each
//! family's adapter maps them to its files' names and layouts.

pub use super::arch::Arch;
use super::arch::{Positions, Role};
use crate::rng::{hash_str, Purpose, Rng};

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
    /// Elements of the whole tensor, by its shape: a ZeRO-3 replica holds
    /// its data only while gathered.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// PyTorch practice (nanoGPT): decay tensors of 2 or more dimensions —
    /// matrix weights and both embeddings — not biases or LayerNorm parameters.
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// Block `i`'s tensors in canonical order, with their shapes.
pub fn block_tensors(cfg: &Arch, i: usize) -> Vec<(String, Vec<usize>)> {
    cfg.block_roles().into_iter().map(|r| (format!("layers.{i}.{}", r.name()), r.shape(cfg))).collect()
}

/// The embedding's tensors, the token embedding first.
pub fn embedding_tensors(cfg: &Arch) -> Vec<(String, Vec<usize>)> {
    let mut v = vec![("embed_tokens.weight".to_string(), vec![cfg.vocab_size, cfg.n_embd])];
    if cfg.positions == Positions::Learned {
        v.push(("embed_positions.weight".into(), vec![cfg.block_size, cfg.n_embd]));
    }
    v
}

/// The final norm's tensors (a LayerNorm's bias after its gain).
pub fn final_norm_tensors(cfg: &Arch) -> Vec<(String, Vec<usize>)> {
    let mut v = vec![("norm.weight".to_string(), vec![cfg.n_embd])];
    if cfg.final_norm_len() == 2 {
        v.push(("norm.bias".into(), vec![cfg.n_embd]));
    }
    v
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

/// The shape of our tensor `name` in a model of `cfg`'s settings.
pub fn shape_of(cfg: &Arch, name: &str) -> Option<Vec<usize>> {
    let i = canonical_index(cfg, name)?;
    let (e, bl) = (cfg.embedding_len(), cfg.block_len());
    if i < e {
        return Some(embedding_tensors(cfg).swap_remove(i).1);
    }
    if i < e + bl * cfg.n_layer {
        return Some(cfg.role((i - e) % bl).shape(cfg));
    }
    final_norm_tensors(cfg).into_iter().chain(head_tensors(cfg)).nth(i - e - bl * cfg.n_layer).map(|(_, s)| s)
}

/// Fresh values, keyed by the tensor's name so every layout and every copy
/// of a tied tensor starts from the same values: norm gains 1, biases 0,
/// other tensors N(0, std) (`cfg.init`), o and down over √(2·L) when the
/// residual init is scaled (GPT-2's rule; Hugging Face's Llama draws every
/// weight with `initializer_range` alone).
pub fn init_tensor(cfg: &Arch, name: &str, shape: &[usize], seed: u64) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let role = name
        .strip_prefix("layers.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(_, rest)| Role::ALL.into_iter().find(|r| r.name() == rest));
    let gain = role.is_some_and(Role::is_gain) || name == "norm.weight";
    let bias = role.is_some_and(Role::is_bias) || name == "norm.bias";
    if gain {
        return vec![1.0; n];
    }
    if bias {
        return vec![0.0; n];
    }
    let mut std = cfg.init.std as f64;
    if cfg.init.scaled_residual && matches!(role, Some(Role::O | Role::Down)) {
        std /= (2.0 * cfg.n_layer as f64).sqrt();
    }
    let mut rng = Rng::new(seed, Purpose::Init, &[hash_str(name)]);
    (0..n).map(|_| (rng.normal() * std) as f32).collect()
}

pub fn new_param(cfg: &Arch, name: String, shape: Vec<usize>, seed: u64) -> Param {
    let data = init_tensor(cfg, &name, &shape, seed);
    let grad = vec![0.0; data.len()];
    let canonical = canonical_index(cfg, &name).expect("a tensor name of the model");
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
    let rest = name.strip_prefix("layers.")?;
    let (layer, tensor) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok().filter(|l| *l < cfg.n_layer && !layer.starts_with('+'))?;
    let k = cfg.block_roles().iter().position(|r| r.name() == tensor)?;
    Some(e + bl * layer + k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_order(cfg: &Arch) {
        let all = all_tensors(cfg);
        for (i, (name, shape)) in all.iter().enumerate() {
            assert_eq!(canonical_index(cfg, name), Some(i), "{name}");
            assert_eq!(shape_of(cfg, name).as_ref(), Some(shape), "{name}");
        }
        assert_eq!(embedding_tensors(cfg).len(), cfg.embedding_len());
        assert_eq!(final_norm_tensors(cfg).len(), cfg.final_norm_len());
        assert_eq!(block_tensors(cfg, 0).len(), cfg.block_len());
        assert_eq!(all.len(), cfg.tensor_count());
        assert_eq!(canonical_index(cfg, &format!("layers.{}.input_layernorm.weight", cfg.n_layer)), None);
        assert_eq!(canonical_index(cfg, "h.0.ln_1.weight"), None);
    }

    #[test]
    fn canonical_index_matches_all_tensors_order() {
        let cfg = Arch::gpt2(3, 2, 8, 10, 4);
        check_order(&cfg);
        assert_eq!(canonical_index(&cfg, "lm_head.weight"), None);
        let gpt2_vocab: Vec<usize> = (0..cfg.tensor_count()).filter(|&i| cfg.vocab_rows(i)).collect();
        assert_eq!(gpt2_vocab, [0], "the token embedding alone: the head reads it");
        assert_eq!(cfg.block_len(), 16, "GPT-2's 12 tensors with c_attn as q, k and v");
        for tied in [false, true] {
            let llama = Arch { tied, ..Arch::llama(3, 4, 2, 8, 12, 10, 4, 1e4) };
            check_order(&llama);
            let all = all_tensors(&llama);
            assert_eq!(all.len(), 1 + 9 * 3 + 1 + usize::from(!tied));
            let vocab: Vec<&str> = all
                .iter()
                .enumerate()
                .filter(|(i, _)| llama.vocab_rows(*i))
                .map(|(_, t)| t.0.as_str())
                .collect();
            let want: &[&str] =
                if tied { &["embed_tokens.weight"] } else { &["embed_tokens.weight", "lm_head.weight"] };
            assert_eq!(vocab, want);
        }
    }

    #[test]
    fn llama_keeps_its_block_order_and_hugging_face_names() {
        let a = Arch::llama(1, 32, 8, 4096, 14336, 128256, 8192, 5e5);
        let names: Vec<String> = block_tensors(&a, 3).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names[0], "layers.3.input_layernorm.weight");
        assert_eq!(names[2], "layers.3.self_attn.k_proj.weight");
        assert_eq!(names[8], "layers.3.mlp.down_proj.weight");
        assert_eq!(block_tensors(&a, 3)[2].1, vec![1024, 4096]);
        // Llama-3 8B's block: 218,112,000 parameters.
        let per_block: usize = block_tensors(&a, 0).iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(per_block, 218_112_000);
    }
}
