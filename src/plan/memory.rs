//! Memory per GPU: model states (weights, gradients, master weights, Adam moments,
//! sharded ZeRO-style over data parallel) and activations.
//!
//! Model states, mixed precision with AdamW: bf16 weights 2 B/param, bf16 gradients
//! 2, f32 master weights 4, Adam m and v 4 + 4: 16 B/param before activations
//! (Rajbhandari et al. 2020, "ZeRO", §3.1). Megatron-LM accumulates gradients in f32
//! (4 B), which makes 18. ZeRO-1 shards master weights and moments over the dp
//! replicas, ZeRO-2 also the gradients, ZeRO-3 also the bf16 weights.
//!
//! Activations per layer per microbatch, counted as Korthikanti et al. 2022
//! ("Reducing activation recomputation in large transformer models", eq. 1)
//! count them, mixed precision, no flash attention, without the dropout masks
//! (pipewright trains without dropout), from the block's settings: GPT-3's
//! block gives s·b·h·(32 + 4·a·s/h) bytes where the paper's, with its masks,
//! gives 34 + 5·a·s/h. The a·s/h term is the attention scores and softmax;
//! flash attention (or Megatron's selective recompute) never stores them.
//! With full recompute only the layer input stays, 2·s·b·h, plus one layer's
//! full set while it is being recomputed.
//! Tensor parallelism is assumed to come with sequence parallelism (Megatron
//! practice), so everything above divides by t.

use super::flops::ModelShape;
use serde::Serialize;
use std::fmt;

/// Bytes per parameter of each model-state component.
pub const WEIGHT_BYTES: f64 = 2.0;
pub const GRAD_BYTES: f64 = 2.0;
pub const MASTER_BYTES: f64 = 4.0;
pub const ADAM_M_BYTES: f64 = 4.0;
pub const ADAM_V_BYTES: f64 = 4.0;

/// What the backward pass recomputes instead of storing, as Megatron-LM
/// means it. Its `Selective` is Megatron's (the attention core), which a
/// flash attention such as pipewright's never stores anyway; pipewright's
/// `train.recompute = "selective"` (`model::recompute`) keeps less
/// than that, and the CPU planner (`plan::cpu`) counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Store everything: 32 + 4·a·s/h per s·b·h for GPT-3's block.
    None,
    /// Recompute the attention core (scores, softmax): 32 per s·b·h for GPT-3's
    /// block. Flash attention stores the same.
    Selective,
    /// Store only each layer's input: 2 per s·b·h.
    Full,
}

impl Recompute {
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Activation bytes one layer keeps for one microbatch of `micro_batch` sequences,
/// per GPU of a tensor-parallel group of `tp`.
pub fn activation_bytes_per_layer(
    shape: &ModelShape,
    micro_batch: usize,
    recompute: Recompute,
    tp: usize,
) -> f64 {
    let (s, b, h, a) = (shape.seq() as f64, micro_batch as f64, shape.hidden() as f64, shape.heads() as f64);
    let m = &shape.arch;
    let (q, kv, f) =
        ((m.n_head * m.head_dim) as f64 / h, (m.kv_heads() * m.head_dim) as f64 / h, m.ffn as f64 / h);
    // 16-bit tensors per s·b·h: the two norms' inputs (4); attention's input,
    // q, k and v, and its output before o (2 + 2q + 4kv + 2q); the MLP's
    // input, its first products (gate and up, or up) and the activation
    // (2 + 2f·(2 or 1) + 2f); scores and softmax per head, 4·a·s/h.
    let first = if m.mlp == crate::model::arch::Mlp::SwiGlu { 4.0 * f } else { 2.0 * f };
    let body = 4.0 + (2.0 + 4.0 * q + 4.0 * kv) + (2.0 + first + 2.0 * f);
    let scores = 4.0;
    let per = match recompute {
        Recompute::None => body + scores * a * s / h,
        Recompute::Selective => body,
        Recompute::Full => 2.0,
    };
    s * b * h * per / tp as f64
}

/// Model-state bytes on one GPU, by component.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StateBytes {
    pub weights: f64,
    pub grads: f64,
    pub master: f64,
    pub adam_m: f64,
    pub adam_v: f64,
}

impl StateBytes {
    /// States for `params` parameters replicated over `dp` data-parallel ranks under
    /// ZeRO stage `zero` (0–3).
    pub fn new(params: f64, dp: usize, zero: u8) -> StateBytes {
        let shard = |level: u8| if zero >= level { 1.0 / dp as f64 } else { 1.0 };
        StateBytes {
            weights: params * WEIGHT_BYTES * shard(3),
            grads: params * GRAD_BYTES * shard(2),
            master: params * MASTER_BYTES * shard(1),
            adam_m: params * ADAM_M_BYTES * shard(1),
            adam_v: params * ADAM_V_BYTES * shard(1),
        }
    }

    pub fn total(&self) -> f64 {
        self.weights + self.grads + self.master + self.adam_m + self.adam_v
    }
}

/// Bytes per parameter before activations, unsharded.
pub fn bytes_per_param() -> f64 {
    StateBytes::new(1.0, 1, 0).total()
}

/// One GPU's memory under a layout, by component.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RankMemory {
    /// Pipeline rank.
    pub rank: usize,
    pub params: f64,
    pub states: StateBytes,
    /// Stored activations of the microbatches alive at the peak.
    pub activations: f64,
    /// Most microbatches alive at once, summed over this rank's model chunks.
    pub live_microbatches: usize,
    /// Working set: the layer being recomputed (full recompute) and the logits on
    /// the last stage.
    pub workspace: f64,
    pub total: f64,
}

/// The parallel layout memory depends on.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MemLayout {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    /// Model chunks per pipeline rank (interleaving's v).
    pub chunks: usize,
    pub micro_batch: usize,
    pub recompute: Recompute,
    pub zero: u8,
}

/// Memory of every pipeline rank. `params` is the model's parameter count (it may
/// differ from `shape.params()` when given by `--params`; every count is scaled by
/// the ratio). `peak_live[stage]` is the most microbatches stage `stage` keeps alive
/// (from the schedule simulator); stage `st` lives on rank `st % pp`.
pub fn rank_memory(shape: &ModelShape, params: f64, l: &MemLayout, peak_live: &[usize]) -> Vec<RankMemory> {
    let stages = l.pp * l.chunks;
    assert_eq!(peak_live.len(), stages, "one peak per stage");
    let scale = params / shape.params();
    let layers_per_stage = shape.layers() as f64 / stages as f64;
    let tp = l.tp as f64;
    let act = activation_bytes_per_layer(shape, l.micro_batch, l.recompute, l.tp);
    let full_layer = activation_bytes_per_layer(shape, l.micro_batch, Recompute::Selective, l.tp);
    let logits = 6.0 * (shape.seq() * l.micro_batch * shape.vocab()) as f64 / tp;
    (0..l.pp)
        .map(|rank| {
            let mine: Vec<usize> = (0..stages).filter(|st| st % l.pp == rank).collect();
            let mut p = mine.len() as f64 * layers_per_stage * shape.layer_params();
            if rank == 0 {
                p += shape.embedding_params();
            }
            if rank == l.pp - 1 {
                p += shape.head_params();
                let tied = shape.tied();
                if l.pp > 1 && tied {
                    p += (shape.vocab() * shape.hidden()) as f64; // the tied LM head's copy
                }
            }
            let p = p * scale / tp;
            let states = StateBytes::new(p, l.dp, l.zero);
            let live: usize = mine.iter().map(|&st| peak_live[st]).sum();
            let activations = live as f64 * layers_per_stage * act;
            let mut workspace = if l.recompute == Recompute::Full { full_layer } else { 0.0 };
            if rank == l.pp - 1 {
                workspace += logits;
            }
            let total = states.total() + activations + workspace;
            RankMemory { rank, params: p, states, activations, live_microbatches: live, workspace, total }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bytes_per_param_and_zero_sharding() {
        assert_eq!(bytes_per_param(), 16.0);
        let n = 1e9;
        assert_eq!(StateBytes::new(n, 8, 0).total(), 16e9);
        assert_eq!(StateBytes::new(n, 8, 1).total(), 4e9 + 12e9 / 8.0);
        assert_eq!(StateBytes::new(n, 8, 2).total(), 2e9 + 14e9 / 8.0);
        assert_eq!(StateBytes::new(n, 8, 3).total(), 16e9 / 8.0);
    }

    #[test]
    fn activation_formula() {
        // GPT-3 175B at Korthikanti et al.'s shape, s=2048, h=12288, a=96, b=1:
        // their 34 + 5·a·s/h less the dropout masks (s·b·h twice, a·s² once).
        let s = ModelShape::gpt2(96, 12288, 96, 2048, 51200);
        let none = activation_bytes_per_layer(&s, 1, Recompute::None, 1);
        assert_eq!(none, 2048.0 * 12288.0 * (32.0 + 4.0 * 96.0 * 2048.0 / 12288.0));
        let selective = activation_bytes_per_layer(&s, 1, Recompute::Selective, 1);
        assert_eq!(selective, 2048.0 * 12288.0 * 32.0);
        assert_eq!(activation_bytes_per_layer(&s, 1, Recompute::Full, 8), 2.0 * 2048.0 * 12288.0 / 8.0);
    }
}
