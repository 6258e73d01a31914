//! What a stage's compute thread computes with: its model chunks on the CPU
//! (`ModelPart`s on a rayon pool pinned to the rank's cores) or on a GPU
//! (`GpuPart`s on the device the rank owns), behind one interface, so the
//! schedule executor in stage/executor.rs is the same for every backend.
//!
//! Chunks are addressed by their local index (position in the rank's
//! ascending list of stages). Activations and gradients cross this border as
//! host `Vec<f32>`s: that is what messages carry between ranks, processes and
//! replay logs. A GPU backend stages them through host memory.
//!
//! Gradients follow one fixed tree over the global microbatch index
//! (optim::grad_tree) on every backend: each microbatch's gradient is a leaf
//! in a zeroed buffer, folded into nodes in the tree's order (on the GPU, in
//! device buffers by `add_f32`), so a run gives dp 1's bits at any dp. Over
//! data-parallel replicas, the nodes travel in host memory to the reducer
//! actor, which adds them by the same tree; there is no NCCL all-reduce of
//! gradients, whose order of adds is NCCL's own.
//!
//! A backend error on the GPU is a failure of the stage: it panics with the
//! error, and the stage reports it (actor, step, action) like any other.
//!
//! The CPU half is `cpu`; the GPU half, `gpu`, is built with the `cuda`
//! feature. What both share (the trait, a chunk's input and output, a
//! checkpoint's moments by tensor name) is here.

mod cpu;
#[cfg(feature = "cuda")]
mod gpu;

pub use cpu::{load_ema, load_moments, CpuCompute};
#[cfg(feature = "cuda")]
pub use gpu::{GpuCompute, GpuPlace};

use crate::checkpoint::{Loaded, TensorState};
use crate::model::part::Mode;
use crate::model::Param;
use crate::optim::grad_tree::Span;
use crate::optim::Hyper;

/// Which half of a backward to run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BackwardPart {
    /// B: input and weight gradients together.
    Full,
    /// I: the input gradient only (zero-bubble schedules).
    Input,
    /// W: the weight gradients of a microbatch whose I ran.
    Weight,
}

/// The input of a chunk's forward.
pub enum ChunkInput<'a> {
    Tokens(&'a [u32]),
    Activation(Vec<f32>),
}

/// What a forward hands back: the next chunk's input, or the loss sum.
pub struct ChunkOutput {
    pub output: Option<Vec<f32>>,
    pub loss_sum: Option<f64>,
}

pub trait StageCompute {
    /// Sequences per microbatch.
    fn micro_batch(&self) -> usize;
    /// Whether there are weight gradients to combine, reduce and clip (the
    /// simulated backend has none).
    fn has_gradients(&self) -> bool {
        true
    }
    /// Zero every gradient accumulator (the start of a step).
    fn zero_grads(&mut self);
    /// F of microbatch `mb` on chunk `i`; in eval mode on the last chunk
    /// `argmax` (N) receives predictions.
    fn forward(
        &mut self,
        i: usize,
        mb: usize,
        input: ChunkInput,
        targets: Option<&[u32]>,
        mode: Mode,
        argmax: Option<&mut [u32]>,
    ) -> ChunkOutput;
    /// B, I or W of microbatch `mb` on chunk `i`; `dout` is the gradient of
    /// the chunk's output (None on the last chunk, and for W). Returns the
    /// gradient of the chunk's input (None on the first chunk, and for W).
    fn backward(
        &mut self,
        i: usize,
        mb: usize,
        which: BackwardPart,
        dout: Option<Vec<f32>>,
    ) -> Option<Vec<f32>>;
    /// (microbatches awaiting backward, bytes they hold) on chunk `i`.
    fn live(&self, i: usize) -> (usize, usize);
    /// Peak activation bytes held, over all chunks.
    fn peak_live_bytes(&self) -> usize;
    /// Peak bytes of training state (weights, gradients, optimizer state)
    /// held, over all chunks; 0 where the backend does not count them.
    fn peak_state_bytes(&self) -> usize {
        0
    }
    /// Chunk `i`'s share of the tied wte gradient (the embedding's, or the head's).
    fn tied_share(&self, i: usize) -> Vec<f32>;
    /// Sums the tied embedding's shares into chunk `i`'s wte gradient, embedding
    /// share + head share; `other` is None when chunk `i` holds both ends.
    fn combine_tied(&mut self, i: usize, other: Option<&[f32]>);
    /// Chunk `i`'s gradients, per tensor, moved out (for the reducer).
    fn take_grads(&mut self, i: usize) -> Vec<Vec<f32>>;
    /// Chunk `i`'s gradients as the nodes of the step's microbatch tree its
    /// replica's block covers ([`crate::optim::grad_tree`]), moved out for
    /// the reducer. A backend that sums its block in its own order hands it
    /// over as one set.
    fn take_grad_nodes(&mut self, i: usize, block: std::ops::Range<usize>) -> Vec<(Span, Vec<Vec<f32>>)> {
        vec![(Span { lo: block.start, hi: block.end }, self.take_grads(i))]
    }
    /// ZeRO-2 and 3 over replicas: the microbatch gradients made since the
    /// last call, as (chunk, microbatch, head's tensors?, tensors), moved
    /// out for scattering to their shards' owners.
    fn take_leaves(&mut self) -> Vec<(usize, usize, bool, Vec<Vec<f32>>)> {
        Vec::new()
    }
    /// ZeRO-2 and 3: this replica's shards of every replica's gradient of
    /// microbatch `mb` on chunk `i` (replicas in order), folded by the tree.
    fn fold_scattered(&mut self, _i: usize, _mb: usize, _head: bool, _shards: Vec<Vec<f32>>) {
        unreachable!("ZeRO runs on the CPU backend only: the config refuses the rest")
    }
    /// ZeRO-2 and 3: chunk `i`'s folded shards joined into its gradients
    /// (this replica's shard of the step's sum).
    fn finish_scattered(&mut self, _i: usize) {
        unreachable!("ZeRO runs on the CPU backend only: the config refuses the rest")
    }
    /// The coming step's microbatches on this replica, as global indices of
    /// `total` (a batch ramp's steps differ in size); before `zero_grads`.
    fn set_block(&mut self, _block: std::ops::Range<usize>, _total: usize) {}
    /// Sums chunk `i`'s tree nodes into its gradients when one replica holds
    /// every microbatch (dp = 1).
    fn finish_grad_tree(&mut self, _i: usize) {}
    /// Whether gradients are summed by the microbatch tree, the tied
    /// embedding's two shares apart (reduced over replicas one by one, then
    /// added); otherwise the shares are added first and the sum reduced.
    fn sums_by_tree(&self) -> bool {
        false
    }
    /// Replaces chunk `i`'s gradients (their sum over replicas); under ZeRO,
    /// the shard of each tensor this replica owns.
    fn set_grads(&mut self, i: usize, grads: Vec<Vec<f32>>);
    /// Σg² of chunk `i`'s gradients as (norm slot, value): per owned block on
    /// the CPU (see `optim::zero`), per tensor under its first block's slot
    /// on GPUs (same order, other bits).
    fn grad_sum_squares(&mut self, i: usize, out: &mut Vec<(usize, f64)>);
    /// ZeRO: copies of the owned elements of chunk `i`'s parameters, one
    /// vector per tensor (what this replica updated).
    fn param_shards(&self, _i: usize) -> Vec<Vec<f32>> {
        unreachable!("ZeRO runs on the CPU backend only: the config refuses the rest")
    }
    /// ZeRO: replaces chunk `i`'s parameters with whole tensors (their
    /// shards gathered from every replica); under ZeRO-3 they are held from
    /// here until [`StageCompute::release_params`].
    fn set_params(&mut self, _i: usize, _params: &[Vec<f32>]) {
        unreachable!("ZeRO runs on the CPU backend only: the config refuses the rest")
    }
    /// ZeRO-3: frees chunk `i`'s whole parameters, keeping the owned shards.
    fn release_params(&mut self, _i: usize) {
        unreachable!("ZeRO-3 runs on the CPU backend only: the config refuses the rest")
    }
    /// Overwrites a gradient element of chunk `i` (the overflow fault knob).
    fn poison_grad(&mut self, i: usize, value: f32);
    /// One AdamW step of every chunk, gradients scaled by `clip`.
    fn adamw(&mut self, hyper: Hyper, lr: f64, clip: f32);
    /// One update of the EMA of the weights (`optim.ema_decay`), after an
    /// applied AdamW step; nothing when no EMA is kept.
    fn update_ema(&mut self) {}
    /// The EMA's update count; None when no EMA is kept (the config keeps
    /// none on the simulated backend).
    fn ema_updates(&self) -> Option<u64> {
        None
    }
    /// Chunk `i`'s EMA: the elements this replica's shard owns of each
    /// tensor (all of them without ZeRO-1).
    fn ema_shards(&self, _i: usize) -> Vec<Vec<f32>> {
        unreachable!("an EMA is kept on the CPU and CUDA backends only: the config refuses the rest")
    }
    /// Calls `f(chunk, name, values)` for every parameter, in chunk order.
    fn visit_params(&self, f: &mut dyn FnMut(usize, &str, &[f32]));
    /// Tensor `k`'s name in chunk `i`.
    fn param_name(&self, i: usize, k: usize) -> Option<String>;
    /// Copies of every parameter (the end of a run).
    fn params(&self) -> Vec<Param>;
    /// Parameters, AdamW moments and the EMA for a checkpoint, with AdamW's
    /// step count; under ZeRO-1 the moments and the EMA are this replica's
    /// shard of each tensor.
    fn snapshot(&self) -> (Vec<TensorState>, u64);
    /// Loads parameters and moments from a checkpoint (a rollback).
    fn restore(&mut self, c: &Loaded) -> Result<(), String>;
}

/// A checkpoint's EMA of the weights (whole tensors by name) and its
/// update count, for a run that keeps one with `decay`.
type CheckpointEma<'c> = (&'c std::collections::HashMap<String, Vec<f32>>, u64);

fn ema_of(c: &Loaded, decay: f64) -> Result<CheckpointEma<'_>, String> {
    match (&c.ema, c.state.ema_updates) {
        (Some(whole), Some(n)) => Ok((whole, n)),
        _ => Err(format!(
            "{}: the checkpoint holds no EMA of the weights, and optim.ema_decay = {decay} keeps one \
             (resume with optim.ema_decay = 0, or start a new run)",
            c.dir.display(),
        )),
    }
}

/// A checkpoint's AdamW moments (exp_avg, exp_avg_sq) of tensor `name`.
fn moments_of<'c>(c: &'c Loaded, name: &str) -> Result<&'c (Vec<f32>, Vec<f32>), String> {
    c.moments.get(name).ok_or_else(|| format!("checkpoint lacks moments of {name}"))
}
