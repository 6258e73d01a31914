//! Parameter counts, training FLOPs and Chinchilla-optimal sizing.
//!
//! FLOPs per token of training: 6·N (a multiply-add is 2 FLOPs; backward costs
//! twice forward; Kaplan et al. 2020) plus the attention score and value products,
//! which no parameter accounts for: 6·L·C·T per token, llm.c's count (forward
//! QKᵀ and A·V are 2·2·T·C per token per layer over all positions, halved for the
//! causal mask, times 3 for forward + backward). nanoGPT and PaLM count 12·L·C·T
//! (no causal halving).

use serde::Serialize;

/// Shape of a model: GPT-2's, or Llama's when `llama` says how it differs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ModelShape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// Sequence length T.
    pub seq: usize,
    pub vocab: usize,
    /// A Llama block (RMSNorm, grouped-query attention, SwiGLU, no biases,
    /// no position table) instead of GPT-2's.
    pub llama: Option<LlamaShape>,
}

/// What a Llama adds to the shape.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LlamaShape {
    pub kv_heads: usize,
    /// The SwiGLU MLP's width F.
    pub ffn: usize,
    /// Whether the head reads the token embedding.
    pub tied: bool,
}

/// Shapes from the GPT-3 paper's table 2.1 (and LLaMA for the larger sizes), used to
/// guess a shape when only `--params` is given: (layers, hidden, heads).
pub const KNOWN_SHAPES: [(usize, usize, usize); 12] = [
    (12, 768, 12),
    (24, 1024, 16),
    (24, 1536, 16),
    (24, 2048, 16),
    (32, 2560, 32),
    (32, 4096, 32),
    (40, 5120, 40),
    (60, 6656, 52),
    (80, 8192, 64),
    (96, 10240, 80),
    (96, 12288, 96),
    (128, 16384, 128),
];

impl ModelShape {
    pub const fn gpt2(layers: usize, hidden: usize, heads: usize, seq: usize, vocab: usize) -> Self {
        ModelShape { layers, hidden, heads, seq, vocab, llama: None }
    }

    /// The shape of a model config, whichever its family.
    pub fn of(cfg: &crate::model::Arch) -> Self {
        let mut s = ModelShape::gpt2(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size);
        if cfg.family == crate::config::Family::Llama {
            s.llama = Some(LlamaShape { kv_heads: cfg.kv_heads(), ffn: cfg.ffn(), tied: cfg.tied() });
        }
        s
    }

    /// Parameters of one transformer block. GPT-2: attention 4C² + 4C, MLP
    /// 8C² + 5C, two layernorms 4C. Llama: q and o 2C², k and v 2·C·(C·KV/H),
    /// the SwiGLU MLP 3·C·F, two RMSNorms 2C.
    pub fn layer_params(&self) -> f64 {
        let c = self.hidden as f64;
        match self.llama {
            None => 12.0 * c * c + 13.0 * c,
            Some(l) => {
                let kv = c * l.kv_heads as f64 / self.heads as f64;
                2.0 * c * c + 2.0 * c * kv + 3.0 * c * l.ffn as f64 + 2.0 * c
            }
        }
    }

    /// A block's parameters every tensor-parallel rank holds whole: GPT-2's
    /// LayerNorms and row-parallel biases (6C), Llama's RMSNorms (2C).
    pub fn layer_whole_params(&self) -> f64 {
        let c = self.hidden as f64;
        if self.llama.is_some() {
            2.0 * c
        } else {
            6.0 * c
        }
    }

    /// The embedding: GPT-2's token and position tables (its head is tied to
    /// the first), Llama's token table.
    pub fn embedding_params(&self) -> f64 {
        match self.llama {
            None => ((self.vocab + self.seq) * self.hidden) as f64,
            Some(_) => (self.vocab * self.hidden) as f64,
        }
    }

    /// The final norm (GPT-2's LayerNorm has a bias, RMSNorm none) and an
    /// untied head.
    pub fn head_params(&self) -> f64 {
        let c = self.hidden as f64;
        match self.llama {
            None => 2.0 * c,
            Some(l) => c + if l.tied { 0.0 } else { (self.vocab * self.hidden) as f64 },
        }
    }

    /// All parameters. GPT-2: 12·L·C² + 13·L·C + (V + T)·C + 2C, its count
    /// with tied embeddings, as llm.c has it. Llama-3 8B: 8,030,261,248.
    pub fn params(&self) -> f64 {
        self.layers as f64 * self.layer_params() + self.embedding_params() + self.head_params()
    }

    /// The table shape whose parameter count is nearest `params` (in log space),
    /// with sequence length `seq` and vocabulary `vocab`.
    pub fn guess(params: f64, seq: usize, vocab: usize) -> ModelShape {
        let shape = |&(layers, hidden, heads): &(usize, usize, usize)| {
            ModelShape::gpt2(layers, hidden, heads, seq, vocab)
        };
        KNOWN_SHAPES
            .iter()
            .map(shape)
            .min_by(|a, b| {
                let d = |s: &ModelShape| (s.params().ln() - params.ln()).abs();
                d(a).total_cmp(&d(b))
            })
            .expect("table is not empty")
    }

    /// Attention FLOPs per token of training (llm.c): 6·L·C·T.
    pub fn attention_flops_per_token(&self) -> f64 {
        6.0 * (self.layers * self.hidden * self.seq) as f64
    }
}

/// Training FLOPs, split into the parameter and attention parts.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TrainFlops {
    /// 6·N·D.
    pub six_nd: f64,
    /// 6·L·C·T·D.
    pub attention: f64,
    /// The sum.
    pub total: f64,
}

/// FLOPs to train `params` parameters on `tokens` tokens with the attention of `shape`.
pub fn train_flops(params: f64, tokens: f64, shape: &ModelShape) -> TrainFlops {
    let six_nd = 6.0 * params * tokens;
    let attention = shape.attention_flops_per_token() * tokens;
    TrainFlops { six_nd, attention, total: six_nd + attention }
}

/// Hoffmann et al. (2022), approach 3: L(N, D) = E + A/N^α + B/D^β, with the
/// constants as the paper prints them (rounded). Its compute-optimal frontier is
/// N ∝ C^(β/(α+β)) = C^0.45 (the paper's Table 2: 0.46), and at Gopher's budget
/// (5.76e23) these constants give about 33B parameters where the paper's own
/// approach-3 figure reads 40B (rounding of α and β moves it that much; Besiroglu
/// et al. 2024). Chinchilla itself (70B on 1.4T) follows approaches 1 and 2
/// (N, D ∝ C^0.50, about 20 tokens per parameter), which [`Chinchilla::rule_20x`] is.
pub const CHINCHILLA_E: f64 = 1.69;
pub const CHINCHILLA_A: f64 = 406.4;
pub const CHINCHILLA_B: f64 = 410.7;
pub const CHINCHILLA_ALPHA: f64 = 0.34;
pub const CHINCHILLA_BETA: f64 = 0.28;

/// The fitted loss of N parameters trained on D tokens.
pub fn chinchilla_loss(n: f64, d: f64) -> f64 {
    CHINCHILLA_E + CHINCHILLA_A / n.powf(CHINCHILLA_ALPHA) + CHINCHILLA_B / d.powf(CHINCHILLA_BETA)
}

/// A compute-optimal model size and token count.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Sizing {
    pub params: f64,
    pub tokens: f64,
    /// The fitted law's loss at this (N, D).
    pub loss: f64,
}

/// Both Chinchilla answers for one compute budget C = 6·N·D.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Chinchilla {
    /// The budget, in FLOPs (6·N·D of the run being planned).
    pub budget: f64,
    /// Approaches 1 and 2 of the paper (N and D both ∝ C^0.50): D = 20·N, so
    /// N = √(C/120). The published Chinchilla (70B on 1.4T) is this point.
    pub rule_20x: Sizing,
    /// Approach 3: argmin over N of L(N, C/(6N)) with the printed constants
    /// (golden-section search in log N).
    pub fitted: Sizing,
    /// The fitted law's exponent a in N_opt ∝ C^a: β/(α+β).
    pub fitted_exponent: f64,
}

/// The compute-optimal sizes for `budget` FLOPs (counted as 6·N·D).
pub fn chinchilla(budget: f64) -> Chinchilla {
    let n = (budget / 120.0).sqrt();
    let rule_20x = Sizing { params: n, tokens: 20.0 * n, loss: chinchilla_loss(n, 20.0 * n) };
    let f = |log_n: f64| {
        let n = log_n.exp();
        chinchilla_loss(n, budget / (6.0 * n))
    };
    // L is convex in log N at fixed C: golden section over [1e3, C/6 / 1e3] parameters.
    let (mut a, mut b) = (1e3f64.ln(), (budget / 6.0e3).max(1e4).ln());
    let g = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..200 {
        let (x1, x2) = (b - g * (b - a), a + g * (b - a));
        if f(x1) < f(x2) {
            b = x2;
        } else {
            a = x1;
        }
    }
    let n = ((a + b) / 2.0).exp();
    let d = budget / (6.0 * n);
    Chinchilla {
        budget,
        rule_20x,
        fitted: Sizing { params: n, tokens: d, loss: chinchilla_loss(n, d) },
        fitted_exponent: CHINCHILLA_BETA / (CHINCHILLA_ALPHA + CHINCHILLA_BETA),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_124m_has_llm_c_parameter_count() {
        let s = ModelShape::gpt2(12, 768, 12, 1024, 50257);
        assert_eq!(s.params(), 124_439_808.0);
    }

    #[test]
    fn fitted_law_matches_closed_form() {
        // ∂L/∂N = 0 at fixed C gives N = G·(C/6)^(β/(α+β)), G = (αA/(βB))^(1/(α+β)).
        let c = 5.76e23;
        let (a, b) = (CHINCHILLA_ALPHA, CHINCHILLA_BETA);
        let g = (a * CHINCHILLA_A / (b * CHINCHILLA_B)).powf(1.0 / (a + b));
        let n = g * (c / 6.0f64).powf(b / (a + b));
        let got = chinchilla(c).fitted.params;
        assert!((got / n - 1.0).abs() < 1e-6, "{got} vs {n}");
    }
}
