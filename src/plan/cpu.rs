//! The planner pointed at pipewright's own CPU backend, so that its models can be
//! checked against runs on this machine: memory per pipeline rank (f32 weights,
//! gradients and AdamW moments; f32 activations of an attention that never stores
//! its T×T scores; the working set of a backward pass) and the step time of a
//! layout (the schedule simulator fed with per-stage costs from FLOPs at a rate).
//!
//! It shares the GPU planner's parameter and FLOP counts and its simulator; only
//! the number formats and the buffers differ. It must never read a run's
//! measurements: they are what it is checked against (`tests/plan.rs`,
//! `pipewright bench --pp`).

use super::flops::ModelShape;
use crate::actors::Layout;
use crate::config::{BackendKind, Config};
use crate::model::block::{BlockActs, Recompute, Remade};
use crate::model::params;
use crate::model::tp::TpShape;
use crate::model::Arch;
use crate::schedule::{ActionKind, Costs, Schedule};
use anyhow::Result;
use serde::Serialize;

/// f32 weights, gradients and both AdamW moments: 4 B each, no separate master copy.
pub const STATE_BYTES_PER_PARAM: f64 = 16.0;

/// Bytes per parameter a replica keeps at its peak, in the backward: from
/// ZeRO-1 its share of the moments (1/dp, to a block: `optim::zero`); under
/// ZeRO-3 its share of the f32 weights (the master copy), a chunk gathered
/// whole counted apart ([`zero3_gather_bytes`]). ZeRO-2's shard-only
/// gradients hold between the reduction and the next step's backward, which
/// accumulates whole-tensor gradients again: at the peak it is ZeRO-1.
pub fn state_bytes_per_param(dp: usize, zero: u8) -> f64 {
    let share = 1.0 / dp as f64;
    let weights = if zero >= 3 { 4.0 * share } else { 4.0 };
    let moments = if zero >= 1 { 8.0 * share } else { 8.0 };
    weights + 4.0 + moments
}

/// ZeRO-3's gather buffer on a rank whose chunks have `chunk_params`: the
/// largest chunk whole when each action frees its weights, every chunk when
/// they are kept for the step (`parallel.reshard_after_forward = false`).
pub fn zero3_gather_bytes(chunk_params: &[f64], reshard_after_forward: bool) -> f64 {
    let whole = match reshard_after_forward {
        true => chunk_params.iter().copied().fold(0.0, f64::max),
        false => chunk_params.iter().sum(),
    };
    4.0 * whole
}

/// One pipeline rank of one replica.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CpuRank {
    pub rank: usize,
    pub params: f64,
    pub state_bytes: f64,
    /// What a replica's compute counts as training state at its peak
    /// (summary.json's `peak_state_bytes`): `state_bytes`, the head's share
    /// of the tied embedding's gradient, the gradient tree's partial sums
    /// and ZeRO-3's gathered chunk.
    pub state_peak_bytes: f64,
    /// Most microbatches alive at once on this rank's stages (from the simulator).
    pub live_microbatches: usize,
    /// Bytes those microbatches keep for their backward.
    pub activation_bytes: f64,
    /// Buffers a stage holds whatever is alive: backward scratch, attention tiles,
    /// the head's logits and its share of the tied embedding's gradient, and the
    /// partial sums of the microbatch gradient tree.
    pub workspace_bytes: f64,
    pub total_bytes: f64,
    /// FLOPs of one microbatch's forward over this rank's stages.
    pub forward_flops: f64,
    /// When its stages' tp ranks span processes: the bytes each process
    /// holding the other ranks keeps (the figures above are the owner's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub follower_bytes: Option<f64>,
    /// When its stages' tp ranks span processes: the tensor bytes the
    /// owner's tp frames carry per training microbatch (what summary.json's
    /// `tp_traffic` counts on rank 0, per microbatch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp_link_bytes: Option<TpLinkBytes>,
}

/// An owner's tp traffic for one training microbatch, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TpLinkBytes {
    /// Its ranks' all-reduce nodes to the other processes (and as many back).
    pub nodes_sent: f64,
    /// Commands: the part's input and its output gradient (gradient shards
    /// are all zero under the tree, and not sent).
    pub commands_sent: f64,
    /// The followers' gradient shards, once per backward.
    pub answers_received: f64,
    /// Once per step, not per microbatch: the followers' new weight shards.
    pub shards_per_step: f64,
}

/// [`TpLinkBytes`] of one part of `layers` blocks whose `tp` ranks sit
/// `held` to a process.
fn tp_link_bytes(
    shape: &ModelShape,
    n: usize,
    layers: usize,
    tp: TpShape,
    held: usize,
    recompute: Recompute,
) -> TpLinkBytes {
    let (nc4, l, h, t) = (4.0 * (n * shape.hidden()) as f64, layers as f64, held as f64, tp.size as f64);
    let followers = (tp.size / held - 1) as f64;
    // Two all-reduces in a block's forward, two in its backward, and the
    // forward's two again when the block is recomputed. Under sequence
    // parallelism they are reduce-scatters (whole nodes go out all the same),
    // and the exchange also carries all-gathers of a rank's rows (the
    // forward's two norm outputs and its output; the backward's two norm
    // outputs and two residual gradients) and the norms' weight gradients
    // handed on in turn (`block::norm_grad`: tp turns of one C-float node,
    // two for a LayerNorm's weight and bias, per norm).
    let full = recompute == Recompute::Full;
    let all_reduces = if full { 6.0 } else { 4.0 };
    let per_block = match tp.sequence_parallel() {
        false => all_reduces * nc4,
        true => {
            let gathers = if full { 10.0 } else { 7.0 };
            let per_norm = if shape.arch.norm == crate::model::arch::Norm::LayerNorm { 2.0 } else { 1.0 };
            all_reduces * nc4 + gathers * nc4 / t + 2.0 * t * per_norm * 4.0 * shape.hidden() as f64
        }
    };
    // A rank's shards of one block: 1/tp of it, the norms (and GPT-2's
    // projection biases) whole.
    let whole = shape.layer_whole_params();
    let shard = 4.0 * ((shape.layer_params() - whole) / t + whole);
    TpLinkBytes {
        nodes_sent: l * per_block * h * followers,
        commands_sent: followers * 2.0 * nc4,
        answers_received: followers * l * h * shard,
        shards_per_step: followers * l * h * shard,
    }
}

/// A config's layout on the CPU backend.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CpuPlan {
    /// Replica 0's ranks (every replica is the same).
    pub ranks: Vec<CpuRank>,
    /// The most one process holds: all ranks of all replicas in one process;
    /// over several, the fullest one's share.
    pub process_bytes: f64,
    /// Model FLOPs of one optimizer step (6·N + 6·L·C·T per token, over all replicas).
    pub step_flops: f64,
    /// The simulator's bubble for this schedule at these per-stage costs (FLOPs
    /// on the CPU backend; the `[sim]` costs and factors on the sim backend).
    pub bubble: f64,
}

/// Bytes one block keeps per microbatch of `n` tokens: its input, ln1, qkv (3C),
/// the attention output, the residual after attention, ln2, the MLP product and its
/// GELU (4C each) — 16 floats per token and channel — plus mean and rstd of both
/// LayerNorms and the attention's log-sum-exp per head. Selective recompute
/// keeps neither norm's output nor the GELU (10 floats, GPT-2's shape); full
/// recompute the input alone.
/// Under sequence parallelism a rank keeps its rows only of the norms'
/// outputs and statistics and of the residual.
pub fn block_activation_bytes(shape: &ModelShape, n: usize, recompute: Recompute, tp: TpShape) -> f64 {
    held_activation_bytes(shape, n, recompute, tp, tp.size)
}

/// [`block_activation_bytes`] in a process holding `held` of the `tp` ranks
/// (a follower keeps its own copy of the block's input, as the owner does).
fn held_activation_bytes(
    shape: &ModelShape,
    n: usize,
    recompute: Recompute,
    tp: TpShape,
    held: usize,
) -> f64 {
    let input = 4.0 * (n * shape.hidden()) as f64;
    match recompute {
        Recompute::Full => input,
        // The block's input, and each held rank's intermediates as the block
        // allocates them (its share of q, k, v, attention, the MLP; the norms'
        // outputs and statistics and the residual whole, or their rows).
        _ => {
            let per = BlockActs::bytes_for(n / shape.seq(), &shape.arch, tp.size, tp.sp, recompute);
            input + held as f64 * per as f64
        }
    }
}

/// How a stage's blocks are split, as the planner sees one process: `held`
/// of the `tp` ranks, microbatches of `b` sequences.
#[derive(Clone, Copy)]
struct TpSite<'a> {
    gpt: &'a Arch,
    shape: &'a ModelShape,
    b: usize,
    tp: TpShape,
    held: usize,
    recompute: Recompute,
}

impl TpSite<'_> {
    /// What a part's `layers` blocks hold beyond an unsplit part's buffers:
    /// the slices' partial sums (one rank's run, for each rank), and with
    /// more than one rank each held rank's shards and their gradients, its
    /// workspace and gradient set, and the other held ranks' copies of the
    /// stream (`model::tp`).
    fn workspace_bytes(&self, layers: usize) -> f64 {
        let TpSite { gpt, shape, b, tp, held, recompute } = *self;
        let n = b * gpt.block_size;
        let (nf, c, t, h) = (n as f64, gpt.n_embd as f64, tp.size as f64, held as f64);
        let leaves = 4.0 * (tp.slices / tp.size - 1) as f64 * nf * c;
        if tp.size == 1 {
            return leaves;
        }
        let cl = c / t;
        // A rank's 1/tp of the block's tensors, but the norms (and GPT-2's
        // projection biases) whole; data and gradient.
        let whole = shape.layer_whole_params();
        let shards = 8.0 * layers as f64 * h * ((shape.layer_params() - whole) / t + whole);
        let attn =
            crate::kernels::cpu::attention::scratch_len(b, gpt.n_head / tp.size, gpt.block_size) as f64;
        // The gradient set: the block's output and residual gradients whole,
        // the norms' output gradients whole or (sequence parallel) the
        // rank's rows, and then a norm output gathered whole and a split
        // region's own sum before its reduce-scatter, (N, C) each.
        let (rows_c, sp_bufs) = match tp.sequence_parallel() {
            true => (cl, 2.0 * c),
            false => (c, 0.0),
        };
        let grads = 2.0 * c + 2.0 * rows_c;
        let per_rank = leaves + 4.0 * (nf * 5.0 * cl + attn) + 4.0 * nf * (grads + 7.0 * cl + sp_bufs);
        let recomputed = match recompute {
            Recompute::Full => block_activation_bytes(shape, n, Recompute::None, tp) / t,
            _ => Remade::bytes_for(b, gpt, tp.size, tp.sp, recompute) as f64,
        };
        shards + h * (per_rank + recomputed) + 4.0 * (h - 1.0) * nf * c
    }

    /// What a process holding `held` of a stage's tp ranks for its owner
    /// keeps: those ranks' shards, workspace and copies of the stream, one
    /// more (N, C) buffer, and for each of `live` microbatches their
    /// activations and the blocks' inputs (`model::tp::TpFollower`).
    fn follower_bytes(&self, layers: usize, live: f64) -> f64 {
        let n = self.b * self.gpt.block_size;
        let acts = layers as f64 * held_activation_bytes(self.shape, n, self.recompute, self.tp, self.held);
        self.workspace_bytes(layers) + 4.0 * (n * self.gpt.n_embd) as f64 + live * acts
    }
}

/// Memory and FLOPs per rank, and the schedule's bubble, for `cfg` as configured.
pub fn plan(cfg: &Config) -> Result<CpuPlan> {
    plan_over(cfg, 1)
}

/// [`plan`] for a run launched over `nodes` processes (`launch --nodes`):
/// where a stage's tp ranks span processes, its rank's figures are its
/// owner's and `follower_bytes` each other process's.
pub fn plan_over(cfg: &Config, nodes: usize) -> Result<CpuPlan> {
    let layout = Layout::from_config(cfg)?;
    let shape = ModelShape::of(&cfg.model);
    let gpt = shape.arch;
    let (c, v) = (gpt.n_embd as f64, gpt.vocab_size as f64);
    let b = cfg.train.micro_batch_size;
    let n = b * gpt.block_size;
    let nf = n as f64;
    let costs = match cfg.backend.kind {
        BackendKind::Sim => sim_costs(cfg),
        _ => stage_costs(&layout, &shape, gpt.vocab_size, n).0,
    };
    let report = layout.schedule.simulate(&costs)?;
    let tp = TpShape::from_config(cfg);
    let placement = crate::cluster::Placement::new(layout.pp, layout.dp, tp.size, nodes.max(1))?;
    let held = placement.tp_held();
    let per_layer = held_activation_bytes(&shape, n, cfg.train.recompute, tp, held);
    let site = TpSite { gpt: &gpt, shape: &shape, b, tp, held, recompute: cfg.train.recompute };
    let ranks = (0..layout.pp)
        .map(|rank| {
            let (mut params, mut activations, mut workspace, mut flops) = (0.0, 0.0, 0.0, 0.0);
            let mut live_total = 0;
            let mut follower = 0.0;
            let mut link = TpLinkBytes::default();
            let mut chunk_params = Vec::new();
            for s in layout.stages_of(rank) {
                let before = params;
                let spec = &layout.stages[s];
                let layers = spec.layers.len() as f64;
                let live = report.peak_live[s] as f64;
                live_total += report.peak_live[s];
                params += layers * shape.layer_params();
                let mut per_mb = layers * per_layer;
                // Backward scratch: the gradients of one block's intermediates
                // (11 floats per token and channel) and of its LayerNorm, attention
                // and MLP inputs (6), and the attention's query tiles.
                workspace += 4.0 * nf * 17.0 * c
                    + 4.0 * crate::kernels::cpu::attention::scratch_len(b, gpt.n_head, gpt.block_size) as f64;
                match cfg.train.recompute {
                    // The one block being recomputed holds its full set.
                    Recompute::Full => {
                        workspace += block_activation_bytes(&shape, n, Recompute::None, tp) - per_layer
                    }
                    // The part's scratch lends one block the tensors it remakes
                    // (when split, each rank's does: `TpSite`).
                    Recompute::Selective if tp.size == 1 => {
                        workspace += Remade::bytes_for(b, &gpt, 1, false, Recompute::Selective) as f64
                    }
                    _ => {}
                }
                workspace += site.workspace_bytes(spec.layers.len());
                if held < tp.size {
                    let l = spec.layers.len();
                    follower += site.follower_bytes(l, live);
                    let part = tp_link_bytes(&shape, n, l, tp, held, cfg.train.recompute);
                    link.nodes_sent += part.nodes_sent;
                    link.commands_sent += part.commands_sent;
                    link.answers_received += part.answers_received;
                    link.shards_per_step += part.shards_per_step;
                }
                flops += stage_forward_flops(
                    &shape,
                    spec.layers.len(),
                    spec.embedding,
                    spec.head,
                    gpt.vocab_size,
                    n,
                );
                if spec.embedding {
                    params += numel(&params::embedding_tensors(&gpt));
                    per_mb += 4.0 * nf; // the tokens, for the embedding's backward
                }
                if spec.head {
                    params += numel(&params::final_norm_tensors(&gpt)) + numel(&params::head_tensors(&gpt));
                    if gpt.tied() && !spec.embedding {
                        params += v * c; // the tied head's own copy of the token embedding
                    }
                    // The head's input gradient, made in forward.
                    per_mb += 4.0 * nf * c;
                    // Final LayerNorm output, logits and the head's wte gradient share.
                    workspace += 4.0 * (nf * c + nf * v + v * c);
                }
                activations += live * per_mb;
                chunk_params.push(params - before);
            }
            let mut held_state = 0.0;
            if cfg.backend.kind != BackendKind::Sim {
                // Each microbatch's gradients are a leaf of the fixed reduction tree
                // (optim::grad_tree): besides the part's own set, up to
                // `held_sets(m)` partial sums live at once, the head's wte share with them.
                let head_share =
                    if layout.stages_of(rank).iter().any(|&s| layout.stages[s].head) { v * c } else { 0.0 };
                // ZeRO-2 and 3 over replicas scatter each leaf as it is made:
                // the shards of every replica's partial sums come to a
                // whole set per node, and no spare is kept.
                let scatters = cfg.parallel.zero >= 2 && layout.dp > 1;
                let sets = match scatters {
                    true => crate::optim::grad_tree::scattered_sets(layout.microbatches),
                    false => crate::optim::grad_tree::held_sets(layout.microbatches),
                } as f64;
                workspace += sets * 4.0 * (params + head_share);
                // An untied head's gradient is its own tensor's: no share apart.
                let tied_share = if gpt.tied() { head_share } else { 0.0 };
                held_state += sets * 4.0 * (params + tied_share) + 4.0 * tied_share;
            }
            if cfg.parallel.zero == 3 {
                let gather = zero3_gather_bytes(&chunk_params, cfg.parallel.reshard_after_forward);
                workspace += gather;
                held_state += gather;
            }
            let state_bytes = state_bytes_per_param(layout.dp, cfg.parallel.zero) * params;
            CpuRank {
                rank,
                params,
                state_bytes,
                state_peak_bytes: state_bytes + held_state,
                live_microbatches: live_total,
                activation_bytes: activations,
                workspace_bytes: workspace,
                total_bytes: state_bytes + activations + workspace,
                forward_flops: flops,
                follower_bytes: (held < tp.size).then_some(follower),
                tp_link_bytes: (held < tp.size).then_some(link),
            }
        })
        .collect::<Vec<_>>();
    // Replicas are alike: a process's bytes are those of the stages it runs
    // and of the one it follows, if any.
    let process_bytes = (0..placement.world)
        .map(|p| {
            let own: f64 = placement.slots(p).iter().map(|&(_, r)| ranks[r].total_bytes).sum();
            own + placement.follows(p).map_or(0.0, |(_, r, _)| ranks[r].follower_bytes.unwrap_or(0.0))
        })
        .fold(0.0, f64::max);
    let tokens_step = (layout.dp * layout.microbatches * n) as f64;
    Ok(CpuPlan {
        ranks,
        process_bytes,
        step_flops: gpt.flops_per_token() * tokens_step,
        bubble: report.mean_bubble_frac,
    })
}

/// Parameters in a list of tensors.
fn numel(tensors: &[(String, Vec<usize>)]) -> f64 {
    tensors.iter().map(|(_, shape)| shape.iter().product::<usize>() as f64).sum()
}

/// FLOPs of one microbatch's forward on a stage: 2 per parameter per token for its
/// blocks (and the tied head's product on the last stage), plus the causal attention
/// products, 2·C·T per token per layer — a third of llm.c's 6·L·C·T training count.
fn stage_forward_flops(
    shape: &ModelShape,
    layers: usize,
    first: bool,
    head: bool,
    vocab: usize,
    n: usize,
) -> f64 {
    let (c, t) = (shape.hidden() as f64, shape.seq() as f64);
    let a = &shape.arch;
    let mut per_token = layers as f64 * (2.0 * shape.layer_params() + 2.0 * c * t);
    if first && a.positions == crate::model::arch::Positions::Learned {
        per_token += 2.0 * t * c; // position embedding parameters, as 6·N counts them
    }
    if head {
        per_token += 2.0 * (vocab as f64 * c + numel(&params::final_norm_tensors(a)));
    }
    per_token * n as f64
}

/// Forward FLOPs of one microbatch on each global stage.
fn stages_forward_flops(layout: &Layout, shape: &ModelShape, vocab: usize, n: usize) -> Vec<f64> {
    layout
        .stages
        .iter()
        .map(|s| stage_forward_flops(shape, s.layers.len(), s.embedding, s.head, vocab, n))
        .collect()
}

/// The simulated backend's action times (ms) and per-stage factors, as its stages
/// sleep them: what the planner predicts a sim run's bubble from.
pub fn sim_costs(cfg: &Config) -> Costs {
    let s = &cfg.sim;
    Costs {
        forward: s.forward_ms,
        backward: s.backward_ms,
        backward_input: s.backward_ms - s.weight_ms,
        backward_weight: s.weight_ms,
        comm: 0.0,
        per_stage_factor: s.stage_factors.clone(),
    }
}

/// The ideal step of a sim config: its schedule's makespan at the `[sim]` costs, ms.
pub fn sim_step_ms(cfg: &Config) -> Result<f64> {
    let layout = Layout::from_config(cfg)?;
    Ok(layout.schedule.simulate(&sim_costs(cfg))?.makespan)
}

/// Simulator costs in units of the mean stage's forward: a stage's factor is its
/// share of the mean stage's FLOPs; B = 2·F, I = W = F. Returns the unit in FLOPs too.
fn stage_costs(layout: &Layout, shape: &ModelShape, vocab: usize, n: usize) -> (Costs, f64) {
    let f = stages_forward_flops(layout, shape, vocab, n);
    let mean = f.iter().sum::<f64>() / f.len() as f64;
    (Costs { per_stage_factor: f.iter().map(|x| x / mean).collect(), ..Costs::unit() }, mean)
}

/// Predicted milliseconds per optimizer step when the whole machine computes the
/// model at `gflops` (model FLOP/s with every core busy; measure it at pp = 1) on
/// `cores` cores, each core giving `gflops / cores`. The ranks share the cores:
/// at every moment the ranks with an action ready split them evenly, none using
/// more than its own threads ([`shared_cores_makespan`]). With a core per rank
/// that is the schedule simulator's makespan; with more ranks than cores, a rank
/// idle in the warmup or cooldown lends its share to the others, and a rank that
/// runs alone there gets no more than its threads.
pub fn step_ms(cfg: &Config, gflops: f64, cores: usize) -> Result<f64> {
    let layout = Layout::from_config(cfg)?;
    let shape = ModelShape::of(&cfg.model);
    let gpt = shape.arch;
    let n = cfg.train.micro_batch_size * gpt.block_size;
    let cores = cores.max(1) as f64;
    let per_core = gflops * 1e9 / cores;
    let (costs, mean_f) = stage_costs(&layout, &shape, gpt.vocab_size, n);
    // Data-parallel replicas run the same schedule side by side on the same cores.
    let share = cores / layout.dp as f64;
    let per_rank = (layout.threads_per_rank as f64).min(cores);
    let makespan = shared_cores_makespan(&layout.schedule, &costs, share, per_rank);
    Ok(1e3 * makespan * mean_f / per_core)
}

/// Makespan of `s` at `costs` (in core-time) when its ranks share `cores`
/// cores: whenever k ranks have an action whose inputs are done, each runs at
/// min(cores / k, `per_rank`) cores (processor sharing, as the OS gives busy
/// threads equal turns). Messages are free. With one core per rank this is
/// `Schedule::simulate`'s makespan.
pub fn shared_cores_makespan(s: &Schedule, costs: &Costs, cores: f64, per_rank: f64) -> f64 {
    let (p, stages, m) = (s.ranks, s.stages(), s.microbatches);
    let (mut f, mut grad, mut inp) =
        (vec![vec![false; m]; stages], vec![vec![false; m]; stages], vec![vec![false; m]; stages]);
    let mut next = vec![0usize; p];
    let mut left: Vec<Option<f64>> = vec![None; p];
    let mut now = 0.0;
    loop {
        for r in 0..p {
            if left[r].is_some() {
                continue;
            }
            let Some(&a) = s.actions[r].get(next[r]) else { continue };
            let ready = match a.kind {
                ActionKind::F => a.stage == 0 || f[a.stage - 1][a.mb],
                ActionKind::B | ActionKind::I => a.stage + 1 == stages || grad[a.stage + 1][a.mb],
                ActionKind::W => inp[a.stage][a.mb],
            };
            if ready {
                left[r] = Some(costs.of(&a));
            }
        }
        let running: Vec<usize> = (0..p).filter(|&r| left[r].is_some()).collect();
        if running.is_empty() {
            return now;
        }
        let rate = (cores / running.len() as f64).min(per_rank);
        let dt = running.iter().map(|&r| left[r].unwrap_or(0.0) / rate).fold(f64::INFINITY, f64::min);
        now += dt;
        for &r in &running {
            let l = left[r].unwrap_or(0.0) - dt * rate;
            if l > 1e-12 * (1.0 + dt * rate) {
                left[r] = Some(l);
                continue;
            }
            let a = s.actions[r][next[r]];
            match a.kind {
                ActionKind::F => f[a.stage][a.mb] = true,
                ActionKind::B => grad[a.stage][a.mb] = true,
                ActionKind::I => {
                    grad[a.stage][a.mb] = true;
                    inp[a.stage][a.mb] = true;
                }
                ActionKind::W => {}
            }
            left[r] = None;
            next[r] += 1;
        }
    }
}

impl CpuPlan {
    /// The report section `pipewright plan --config` adds for a CPU config.
    pub fn text(&self) -> String {
        let mb = |x: f64| x / 1e6;
        let mut s = String::from(
            "\nthis config on pipewright's CPU backend (f32 states 16 B/param, 8 + 8/dp under ZeRO-1; activations kept for backward)\n",
        );
        s += &format!(
            "  {:>4} {:>10} {:>11} {:>5} {:>14} {:>13} {:>10}\n",
            "rank", "params", "states MB", "live", "activations MB", "workspace MB", "total MB"
        );
        for r in &self.ranks {
            s += &format!(
                "  {:>4} {:>10.0} {:>11.1} {:>5} {:>14.1} {:>13.1} {:>10.1}\n",
                r.rank,
                r.params,
                mb(r.state_bytes),
                r.live_microbatches,
                mb(r.activation_bytes),
                mb(r.workspace_bytes),
                mb(r.total_bytes)
            );
            if let Some(f) = r.follower_bytes {
                s += &format!(
                    "       rank {}'s other tp ranks: {:.1} MB in each process following it (shards, their activations, workspace)\n",
                    r.rank,
                    mb(f)
                );
            }
            if let Some(t) = r.tp_link_bytes {
                s += &format!(
                    "       its tp links per microbatch: {:.2} MB of all-reduce nodes each way, {:.2} MB of commands out, {:.2} MB of gradient shards back; per step {:.2} MB of weight shards out\n",
                    mb(t.nodes_sent),
                    mb(t.commands_sent),
                    mb(t.answers_received),
                    mb(t.shards_per_step)
                );
            }
        }
        s += &format!(
            "  the fullest process holds {:.1} MB of model memory; step {:.3} GFLOP; schedule bubble {:.1}%\n",
            mb(self.process_bytes),
            self.step_flops / 1e9,
            100.0 * self.bubble
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bench_config(pp: usize, m: usize) -> Config {
        let sets = [format!("parallel.pp={pp}"), format!("parallel.microbatches={m}")];
        let path = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/bench-cpu.toml"));
        Config::load(Some(path), &sets).unwrap()
    }

    #[test]
    fn one_rank_takes_the_step_flops_at_the_given_rate() {
        let cfg = bench_config(1, 4);
        let p = plan(&cfg).unwrap();
        let ms = step_ms(&cfg, 100.0, 2).unwrap();
        assert!((ms - p.step_flops / 100e9 * 1e3).abs() < 1e-9 * ms, "{ms}");
        assert_eq!(p.bubble, 0.0);
    }

    #[test]
    fn two_ranks_on_two_cores_pay_the_bubble_and_four_fill_part_of_it() {
        let one = step_ms(&bench_config(1, 8), 100.0, 2).unwrap();
        let two = step_ms(&bench_config(2, 8), 100.0, 2).unwrap();
        // (m + p − 1) / m = 9/8 with equal stages; the head makes stages unequal.
        assert!(two > one * 1.1 && two < one * 1.3, "{one} {two}");
        // Four ranks on two cores: busy ranks share the cores, and the warmup and
        // cooldown, where fewer than two are ready, still leave a core idle.
        let four = step_ms(&bench_config(4, 8), 100.0, 2).unwrap();
        assert!(four > one * 1.01 && four < two, "{one} {two} {four}");
    }

    #[test]
    fn shared_cores_with_a_core_per_rank_is_the_simulator() {
        for (kind, v) in
            [(crate::schedule::ScheduleKind::OneFOneB, 1), (crate::schedule::ScheduleKind::ZbH1, 1)]
        {
            let s = crate::schedule::build(kind, 4, 8, v).unwrap();
            let c = Costs::unit();
            let want = s.simulate(&c).unwrap().makespan;
            assert!((shared_cores_makespan(&s, &c, 4.0, 1.0) - want).abs() < 1e-9);
            // Everything on one core: the sum of the work.
            let work: f64 = s.actions.iter().flatten().map(|a| c.of(a)).sum();
            assert!((shared_cores_makespan(&s, &c, 1.0, 1.0) - work).abs() < 1e-9);
        }
    }

    #[test]
    fn states_are_sixteen_bytes_per_parameter_and_every_parameter_is_counted_once() {
        let cfg = bench_config(2, 4);
        let p = plan(&cfg).unwrap();
        let gpt = cfg.arch();
        let counted: f64 = p.ranks.iter().map(|r| r.params).sum();
        // The last rank also holds the tied head's copy of wte.
        let wte = (gpt.vocab_size * gpt.n_embd) as f64;
        assert_eq!(counted, gpt.num_params() as f64 + wte);
        assert!(p.ranks.iter().all(|r| r.state_bytes == 16.0 * r.params));
    }

    #[test]
    fn an_untied_rotary_model_is_counted_without_a_position_table_or_a_second_head() {
        // Llama 3 8B's shape, cut to two layers over two stages: its
        // embedding, final RMSNorm and untied head, each once.
        let mut cfg = bench_config(2, 4);
        cfg.model = crate::model::ModelSection {
            family: "llama".into(),
            n_layer: 2,
            n_head: 32,
            n_kv_head: 8,
            n_embd: 4096,
            intermediate_size: 14336,
            vocab_size: 128_256,
            block_size: 64,
            rope_theta: 500_000.0,
            ..Default::default()
        };
        cfg.train.micro_batch_size = 1;
        let p = plan(&cfg).unwrap();
        let counted: f64 = p.ranks.iter().map(|r| r.params).sum();
        assert_eq!(counted, cfg.arch().num_params() as f64);
        // Llama 3 8B's 32 layers: 8,030,261,248, as transformers counts them.
        let layer = (cfg.arch().num_params() - 2 * 128_256 * 4096 - 4096) as f64 / 2.0;
        assert_eq!(32.0 * layer + 2.0 * 128_256.0 * 4096.0 + 4096.0, 8_030_261_248.0);
    }

    #[test]
    fn zero_1_shares_the_moments_out_over_the_replicas() {
        let mut cfg = bench_config(1, 2);
        cfg.parallel.dp = 2;
        let whole = plan(&cfg).unwrap();
        cfg.parallel.zero = 1;
        let sharded = plan(&cfg).unwrap();
        let params = whole.ranks[0].params;
        assert_eq!(whole.ranks[0].state_bytes - sharded.ranks[0].state_bytes, 4.0 * params);
        assert_eq!(whole.process_bytes - sharded.process_bytes, 2.0 * 4.0 * params);
    }

    /// ZeRO-2 holds ZeRO-1's state (the backward accumulates whole
    /// gradients) but not its tree's whole partial sums; ZeRO-3 keeps 1/dp
    /// of the weights plus the chunk it gathers: the largest, or every chunk
    /// when they stay for the step.
    #[test]
    fn zero_3_keeps_a_share_of_the_weights_and_a_gathered_chunk() {
        let mut cfg = bench_config(2, 2);
        (cfg.parallel.dp, cfg.parallel.zero) = (4, 1);
        cfg.parallel.schedule = crate::config::ScheduleKind::Interleaved1F1B;
        cfg.parallel.chunks = 2;
        let one = plan(&cfg).unwrap();
        cfg.parallel.zero = 2;
        let two = plan(&cfg).unwrap();
        for (a, b) in one.ranks.iter().zip(&two.ranks) {
            assert_eq!(a.state_bytes, b.state_bytes, "gradients accumulate whole in the backward");
            // 2 microbatches: ZeRO-1's tree holds a node and a spare, ZeRO-2's a node's shards.
            assert!(b.state_peak_bytes < a.state_peak_bytes - 4.0 * a.params * 0.99);
        }
        cfg.parallel.zero = 3;
        let three = plan(&cfg).unwrap();
        for (a, b) in two.ranks.iter().zip(&three.ranks) {
            assert_eq!(a.state_bytes - b.state_bytes, 3.0 * a.params, "4 B a weight, 3/4 of it shared out");
        }
        cfg.parallel.reshard_after_forward = false;
        let kept = plan(&cfg).unwrap();
        for (k, t) in kept.ranks.iter().zip(&three.ranks) {
            // Two chunks a rank: keeping both holds the smaller one too.
            assert!(k.workspace_bytes > t.workspace_bytes, "{} vs {}", k.workspace_bytes, t.workspace_bytes);
        }
        assert_eq!(zero3_gather_bytes(&[3.0, 5.0], true), 20.0);
        assert_eq!(zero3_gather_bytes(&[3.0, 5.0], false), 32.0);
    }

    #[test]
    fn a_stage_split_over_processes_shares_its_ranks_memory_between_owner_and_follower() {
        let mut cfg = bench_config(1, 1);
        cfg.parallel.tp = 2;
        cfg.parallel.tp_slices = 4;
        let (one, two) = (plan(&cfg).unwrap(), plan_over(&cfg, 2).unwrap());
        assert_eq!(one.ranks[0].follower_bytes, None);
        let (owner, follower) = (&two.ranks[0], two.ranks[0].follower_bytes.unwrap());
        // Each process keeps one rank's share; the follower also keeps its
        // own copy of every block's input per live microbatch, and one
        // (N, C) buffer where the owner no longer needs a copy for rank 1.
        let (n, c, l) = (8.0 * 256.0, 256.0, 4.0);
        let extra = one.ranks[0].live_microbatches as f64 * l * 4.0 * n * c;
        let split = owner.total_bytes + follower - one.ranks[0].total_bytes;
        assert!((split - extra).abs() < 1e-6 * extra, "{split} vs {extra}");
        assert_eq!(owner.state_bytes, one.ranks[0].state_bytes, "the owner keeps the whole tensors");
        assert_eq!(two.process_bytes, owner.total_bytes.max(follower));
    }
}
