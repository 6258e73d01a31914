//! The model's architecture: its shape and every setting a family varies,
//! the one description the block (CPU and GPU), the tensor-parallel split,
//! the gradient tree, ZeRO, checkpoints, replay naming, `inspect` and the
//! planner read. None of them asks which family a model is: a family
//! (`model/gpt2/`, `model/llama/`, …) is a preset of these settings plus its
//! Hugging Face names, and `family` is carried only so that the adapters at
//! the file boundary (names, `config.json`) can be found.
//!
//! Letters as everywhere: C = n_embd, NH query heads, NKV key/value heads,
//! HS = head_dim, F = the MLP's width, V = vocab_size, T = block_size,
//! L = n_layer.
//!
//! A block's tensors follow from the settings ([`Arch::block_roles`]), in a
//! fixed canonical order, with `nn.Linear`'s (out, in) layout whatever the
//! family's files use (GPT-2's fused, transposed `c_attn` is its adapter's
//! business): the attention norm (weight, bias if LayerNorm), q, k, v (each
//! with its bias if `qkv_bias`), the per-head q and k norms if `qk_norm`, o
//! (bias if `o_bias`), the MLP norm, the MLP's gate (SwiGLU only), up and
//! down (biases if `mlp_bias`).

use super::family::Family;
use crate::kernels::cpu::attention::Heads;

/// The normalization before attention, before the MLP and before the head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// Mean and variance, a gain and a bias (GPT-2's; eps 1e-5).
    LayerNorm,
    /// Root mean square and a gain (Llama's and its descendants').
    RmsNorm,
}

/// The MLP between the two projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mlp {
    /// up → GELU (tanh approximation, GPT-2's `gelu_new`) → down.
    Gelu,
    /// silu(gate) · up → down.
    SwiGlu,
}

/// Where a token's position enters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Positions {
    /// A learned table added to the token embedding (T rows).
    Learned,
    /// Rotary embeddings on q and k in every block.
    Rotary,
}

/// How rotary frequencies are rescaled for contexts beyond training's, as
/// transformers' `ROPE_INIT_FUNCTIONS` computes them (model/rope.rs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (every frequency over `factor`).
    Linear {
        factor: f32,
    },
    /// Llama 3.1's: long wavelengths over `factor`, short ones kept, a
    /// smooth ramp between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// YaRN: frequencies blended by a ramp over dimensions, cos and sin
    /// scaled by `attention_factor`.
    Yarn {
        factor: f32,
        original_max_position_embeddings: usize,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        truncate: bool,
    },
}

/// How fresh weights are drawn: norm gains 1, biases 0, every other tensor
/// N(0, std), the residual stream's output projections (o and down) over
/// √(2·L) when `scaled_residual` (GPT-2's rule).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Init {
    pub std: f32,
    pub scaled_residual: bool,
}

/// The model: its shape and the settings a family varies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arch {
    /// Whose names and `config.json` the files use (never read by the compute).
    pub family: Family,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub n_embd: usize,
    /// The MLP's hidden width F.
    pub ffn: usize,
    pub vocab_size: usize,
    pub block_size: usize,
    pub norm: Norm,
    pub norm_eps: f32,
    pub positions: Positions,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub mlp: Mlp,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// A bias on the attention's output projection.
    pub o_bias: bool,
    /// Biases on the MLP's projections.
    pub mlp_bias: bool,
    /// RMSNorm over each head of q and of k before RoPE (Qwen3's).
    pub qk_norm: bool,
    /// Sliding-window attention: a query sees at most this many keys (itself
    /// included); None is full causal attention.
    pub window: Option<usize>,
    /// Whether the head reads the token embedding.
    pub tied: bool,
    pub init: Init,
}

/// One tensor's job in a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    AttnNorm,
    AttnNormBias,
    Q,
    QBias,
    K,
    KBias,
    V,
    VBias,
    QNorm,
    KNorm,
    O,
    OBias,
    MlpNorm,
    MlpNormBias,
    Gate,
    GateBias,
    Up,
    UpBias,
    Down,
    DownBias,
}

impl Role {
    pub const ALL: [Role; 20] = [
        Role::AttnNorm,
        Role::AttnNormBias,
        Role::Q,
        Role::QBias,
        Role::K,
        Role::KBias,
        Role::V,
        Role::VBias,
        Role::QNorm,
        Role::KNorm,
        Role::O,
        Role::OBias,
        Role::MlpNorm,
        Role::MlpNormBias,
        Role::Gate,
        Role::GateBias,
        Role::Up,
        Role::UpBias,
        Role::Down,
        Role::DownBias,
    ];

    /// The tensor's name within block i's (`layers.{i}.` before it): Hugging
    /// Face Llama's, which Qwen2, Qwen3 and Mistral share; GPT-2's adapter
    /// maps its own.
    pub fn name(self) -> &'static str {
        match self {
            Role::AttnNorm => "input_layernorm.weight",
            Role::AttnNormBias => "input_layernorm.bias",
            Role::Q => "self_attn.q_proj.weight",
            Role::QBias => "self_attn.q_proj.bias",
            Role::K => "self_attn.k_proj.weight",
            Role::KBias => "self_attn.k_proj.bias",
            Role::V => "self_attn.v_proj.weight",
            Role::VBias => "self_attn.v_proj.bias",
            Role::QNorm => "self_attn.q_norm.weight",
            Role::KNorm => "self_attn.k_norm.weight",
            Role::O => "self_attn.o_proj.weight",
            Role::OBias => "self_attn.o_proj.bias",
            Role::MlpNorm => "post_attention_layernorm.weight",
            Role::MlpNormBias => "post_attention_layernorm.bias",
            Role::Gate => "mlp.gate_proj.weight",
            Role::GateBias => "mlp.gate_proj.bias",
            Role::Up => "mlp.up_proj.weight",
            Role::UpBias => "mlp.up_proj.bias",
            Role::Down => "mlp.down_proj.weight",
            Role::DownBias => "mlp.down_proj.bias",
        }
    }

    /// Whether a model of `a`'s settings has this tensor.
    pub fn present(self, a: &Arch) -> bool {
        let ln = a.norm == Norm::LayerNorm;
        match self {
            Role::AttnNorm
            | Role::MlpNorm
            | Role::Q
            | Role::K
            | Role::V
            | Role::O
            | Role::Up
            | Role::Down => true,
            Role::AttnNormBias | Role::MlpNormBias => ln,
            Role::QBias | Role::KBias | Role::VBias => a.qkv_bias,
            Role::QNorm | Role::KNorm => a.qk_norm,
            Role::OBias => a.o_bias,
            Role::Gate => a.mlp == Mlp::SwiGlu,
            Role::GateBias => a.mlp == Mlp::SwiGlu && a.mlp_bias,
            Role::UpBias | Role::DownBias => a.mlp_bias,
        }
    }

    /// The tensor's shape in a model of `a`'s settings.
    pub fn shape(self, a: &Arch) -> Vec<usize> {
        let (c, f, hs) = (a.n_embd, a.ffn, a.head_dim);
        let (q, kv) = (a.n_head * hs, a.kv_heads() * hs);
        match self {
            Role::AttnNorm | Role::AttnNormBias | Role::MlpNorm | Role::MlpNormBias => vec![c],
            Role::Q => vec![q, c],
            Role::QBias => vec![q],
            Role::K | Role::V => vec![kv, c],
            Role::KBias | Role::VBias => vec![kv],
            Role::QNorm | Role::KNorm => vec![hs],
            Role::O => vec![c, q],
            Role::OBias | Role::DownBias => vec![c],
            Role::Gate | Role::Up => vec![f, c],
            Role::GateBias | Role::UpBias => vec![f],
            Role::Down => vec![c, f],
        }
    }

    /// How the tensor is cut over tensor-parallel ranks (weights are (out,
    /// in)): q, k, v, gate and up by output rows (their biases with them),
    /// o and down by input columns; norms and the row-parallel products'
    /// biases whole (the bias joins the sum once).
    pub fn cut(self) -> Cut {
        match self {
            Role::Q
            | Role::QBias
            | Role::K
            | Role::KBias
            | Role::V
            | Role::VBias
            | Role::Gate
            | Role::GateBias
            | Role::Up
            | Role::UpBias => Cut::Rows,
            Role::O | Role::Down => Cut::Columns { parts: 1 },
            _ => Cut::Whole,
        }
    }

    /// Whether the tensor is a norm's gain (drawn as 1 at initialisation).
    pub fn is_gain(self) -> bool {
        matches!(self, Role::AttnNorm | Role::MlpNorm | Role::QNorm | Role::KNorm)
    }

    /// Whether the tensor is a bias (drawn as 0).
    pub fn is_bias(self) -> bool {
        matches!(
            self,
            Role::AttnNormBias
                | Role::MlpNormBias
                | Role::QBias
                | Role::KBias
                | Role::VBias
                | Role::OBias
                | Role::GateBias
                | Role::UpBias
                | Role::DownBias
        )
    }
}

/// How a block tensor is cut over tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Whole on every rank.
    Whole,
    /// Its last dimension is `parts` equal blocks, each cut into `size` runs
    /// of columns; rank r holds run r of every block, in order.
    Columns { parts: usize },
    /// Its rows are cut into `size` runs; rank r holds run r.
    Rows,
}

/// Where each of a block's tensors sits among the block's, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockIndex {
    at: [u8; Role::ALL.len()],
    len: usize,
}

const ABSENT: u8 = u8::MAX;

impl BlockIndex {
    pub fn of(a: &Arch) -> Self {
        let mut at = [ABSENT; Role::ALL.len()];
        let mut len = 0;
        for r in Role::ALL {
            if r.present(a) {
                at[r as usize] = len as u8;
                len += 1;
            }
        }
        BlockIndex { at, len }
    }

    /// The tensor of role `r`; panics if this model has none (the block asks
    /// only for what its settings say exists).
    pub fn at(&self, r: Role) -> usize {
        self.get(r).unwrap_or_else(|| panic!("a block without a {r:?} tensor asked for one"))
    }

    pub fn get(&self, r: Role) -> Option<usize> {
        let i = self.at[r as usize];
        (i != ABSENT).then_some(i as usize)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Arch {
    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_head
    }

    /// The MLP's hidden width.
    pub fn ffn(&self) -> usize {
        self.ffn
    }

    /// Whether the LM head reads the token embedding.
    pub fn tied(&self) -> bool {
        self.tied
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The attention heads' shape.
    pub fn heads(&self) -> Heads {
        Heads { nh: self.n_head, nkv: self.n_kv_head, hs: self.head_dim }
    }

    /// A block's tensors in canonical order.
    pub fn block_roles(&self) -> Vec<Role> {
        Role::ALL.into_iter().filter(|r| r.present(self)).collect()
    }

    pub fn block_index(&self) -> BlockIndex {
        BlockIndex::of(self)
    }

    /// Tensors per block.
    pub fn block_len(&self) -> usize {
        Role::ALL.iter().filter(|r| r.present(self)).count()
    }

    /// The role of block tensor `i` (its index among the block's).
    pub fn role(&self, i: usize) -> Role {
        self.block_roles()[i]
    }

    /// Tensors of the embedding: the token table, and a position table when positions are learned.
    pub fn embedding_len(&self) -> usize {
        1 + usize::from(self.positions == Positions::Learned)
    }

    /// Tensors of the final norm (a LayerNorm has a bias, RMSNorm none).
    pub fn final_norm_len(&self) -> usize {
        1 + usize::from(self.norm == Norm::LayerNorm)
    }

    /// Tensors in the model, as `params::all_tensors` lists them.
    pub fn tensor_count(&self) -> usize {
        self.embedding_len()
            + self.n_layer * self.block_len()
            + self.final_norm_len()
            + usize::from(!self.tied)
    }

    /// Whether tensor `canonical` has one row per vocabulary entry: the token
    /// embedding, and an untied head (the GPU pads both to 128-row multiples).
    pub fn vocab_rows(&self, canonical: usize) -> bool {
        canonical == 0 || (!self.tied && canonical + 1 == self.tensor_count())
    }

    /// Parameters in the model (the tied embedding counted once).
    pub fn num_params(&self) -> usize {
        super::params::all_tensors(self).iter().map(|(_, s)| s.iter().product::<usize>()).sum()
    }

    /// Training FLOPs per token as llm.c counts them: 6·N for the matrix
    /// products (forward + backward) plus 6·L·(NH·HS)·T for attention's
    /// two products over the context (half of them masked off by the causal
    /// mask, counted anyway as llm.c and PaLM do).
    pub fn flops_per_token(&self) -> f64 {
        let (l, q, t) = (self.n_layer as f64, (self.n_head * self.head_dim) as f64, self.block_size as f64);
        6.0 * self.num_params() as f64 + 6.0 * l * q * t
    }
}
