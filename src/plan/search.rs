//! The ranked search over parallel layouts.
//!
//! Layouts: tp ∈ divisors of heads up to 8 (one NVLink domain), pp dividing the
//! layers, dp = G/(tp·pp); m ∈ {pp, 2pp, 4pp, 8pp} microbatches per replica with the
//! global batch fixed; schedules 1F1B, interleaved 1F1B (v = 2) and ZB-H1; recompute
//! none / selective / full; ZeRO-1 or ZeRO-3 (ZeRO-0 when dp = 1).
//!
//! Step time model, per step:
//! - compute at the MFU: the step's FLOPs ÷ (G · peak · MFU), split into F : B = 1 : 2
//!   per microbatch (I = W = B/2 for ZB-H1); recompute adds the recomputed forward
//!   (full: all of F; selective: the attention core's forward share) to B or I;
//! - tensor parallel: 2 all-reduces of s·b·h bf16 in each layer's forward and 2 in its
//!   backward (2 more with full recompute), ring cost 2(t−1)/t · bytes / NVLink, on
//!   the stage's critical path (added to each F and B);
//! - pipeline: our simulator runs the schedule with those F/B/I/W costs and a message
//!   latency of (s·b·h·2 / tp) bytes over each hop's link, averaged over the hops,
//!   giving the makespan and the bubble;
//! - data parallel: the gradient all-reduce, 2(dp−1)/dp · bytes / link (ZeRO-1: a
//!   reduce-scatter plus an all-gather, the same volume; ZeRO-3: 1.5×), not
//!   overlapped with compute (overlap fraction 0: conservative).
//!
//! Rank placement follows Megatron-LM's default order, tp fastest, then dp, then pp:
//! global rank = t + tp·(d + dp·p). A tp or dp group uses NVLink when the ranks it
//! spans fit in one node, else InfiniBand; a pipeline hop joins ranks tp·dp apart,
//! so it stays on NVLink exactly when both ends sit in the same node (never once
//! tp·dp ≥ the node's 8 GPUs; for smaller tp·dp, the hops inside a node).

use super::flops::ModelShape;
use super::hardware::Gpu;
use super::memory::{rank_memory, MemLayout, RankMemory, Recompute};
use crate::schedule::{self, Costs, ScheduleKind};
use serde::Serialize;
use std::collections::BTreeMap;

/// What the search needs to know.
#[derive(Clone, Debug)]
pub struct SearchInput {
    pub shape: ModelShape,
    pub params: f64,
    /// Training tokens (for total time and cost).
    pub tokens: f64,
    pub gpus: usize,
    pub gpu: Gpu,
    pub mfu: f64,
    /// Sequences per optimizer step, over all replicas.
    pub global_batch: usize,
    /// Fix the sequences per microbatch; None lets the search choose.
    pub micro_batch: Option<usize>,
    /// $ per GPU-hour.
    pub price: Option<f64>,
    /// Fraction of the DP gradient all-reduce hidden behind backward (0: none).
    pub dp_overlap: f64,
}

/// One layout that fits, with its predicted step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    /// Microbatches per replica per step.
    pub microbatches: usize,
    /// Sequences per microbatch.
    pub micro_batch: usize,
    pub schedule: String,
    /// Model chunks per rank.
    pub chunks: usize,
    pub recompute: Recompute,
    pub zero: u8,
    /// Peak bytes on the fullest GPU.
    pub memory_bytes: f64,
    /// That GPU's breakdown.
    pub memory: RankMemory,
    /// Mean idle fraction of the pipeline ranks in the simulated step.
    pub bubble: f64,
    /// Seconds per step: compute at the MFU with no bubble (recompute included).
    pub compute_s: f64,
    pub tp_comm_s: f64,
    /// Point-to-point time of one microbatch hop, mean over the pp − 1 hops.
    pub p2p_s: f64,
    /// Hops whose two stages sit in different nodes (InfiniBand), of pp − 1.
    pub p2p_ib_hops: usize,
    /// Most microbatches alive at once on each stage under this schedule (from the
    /// simulator; 1F1B: min(p − s, m) on stage s).
    pub live_microbatches: Vec<usize>,
    /// The simulated pipeline makespan (compute, TP and p2p, with bubbles).
    pub pipeline_s: f64,
    /// The whole gradient all-reduce (or ZeRO-3's 1.5×), before overlap.
    pub dp_allreduce_s: f64,
    /// Simulated pipeline makespan plus the part of the DP all-reduce not overlapped.
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation this step time implies.
    pub mfu: f64,
    pub train_days: f64,
    pub cost_usd: Option<f64>,
    pub why: String,
    /// What pipewright's trainer lacks to run this layout (see [`super::runnable`]);
    /// None when it runs today.
    pub lacks: Option<String>,
}

/// Layouts the trainer runs first, then the fastest, then the smallest.
fn order(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    (a.lacks.is_some().cmp(&b.lacks.is_some()))
        .then(a.step_s.total_cmp(&b.step_s))
        .then(a.memory_bytes.total_cmp(&b.memory_bytes))
}

/// The search's result: fitting layouts, fastest first (best per tp, pp, schedule),
/// and how many were looked at.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SearchResult {
    pub candidates: Vec<Candidate>,
    pub layouts_tried: usize,
    pub rejected_for_memory: usize,
    /// The smallest peak memory seen among layouts that did not fit (bytes).
    pub smallest_rejected_bytes: Option<f64>,
}

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

/// Ring all-reduce time of `bytes` over `n` ranks at `bw` bytes/s.
pub fn allreduce_s(bytes: f64, n: usize, bw: f64) -> f64 {
    if n <= 1 {
        0.0
    } else {
        2.0 * (n - 1) as f64 / n as f64 * bytes / bw
    }
}

/// For each pipeline hop (stage k to k+1, k < pp − 1): whether any of its tp·dp
/// rank pairs crosses a node boundary, with ranks ordered tp, dp, pp (see the
/// module comment).
pub fn hops_across_nodes(tp: usize, dp: usize, pp: usize, gpus_per_node: usize) -> Vec<bool> {
    let span = tp * dp;
    (0..pp.saturating_sub(1))
        .map(|k| (0..span).any(|j| (k * span + j) / gpus_per_node != ((k + 1) * span + j) / gpus_per_node))
        .collect()
}

/// Every fitting layout, fastest first, keeping the best (m, recompute, ZeRO) per
/// (tp, pp, schedule).
pub fn search(inp: &SearchInput) -> SearchResult {
    let shape = &inp.shape;
    let g = inp.gpus;
    let usable = inp.gpu.usable_bytes();
    let flops_per_token = 6.0 * inp.params + shape.attention_flops_per_token();
    let tokens_step = (inp.global_batch * shape.seq()) as f64;
    let compute_s = flops_per_token * tokens_step / g as f64 / (inp.gpu.peak_flops * inp.mfu);
    // Forward share of the attention core, recomputed by selective recompute.
    let attn_fwd_share = shape.attention_flops_per_token() / flops_per_token;
    let mut best: BTreeMap<(usize, usize, String), Candidate> = BTreeMap::new();
    let (mut tried, mut rejected, mut smallest) = (0, 0, None::<f64>);

    let tps = divisors(shape.heads())
        .filter(|&t| t <= 8 && shape.hidden().is_multiple_of(t) && g.is_multiple_of(t));
    for tp in tps.collect::<Vec<_>>() {
        for pp in divisors(shape.layers()).filter(|&p| g.is_multiple_of(tp * p)) {
            let dp = g / (tp * pp);
            if !inp.global_batch.is_multiple_of(dp) {
                continue;
            }
            let per_replica = inp.global_batch / dp;
            for m in [pp, 2 * pp, 4 * pp, 8 * pp] {
                if !per_replica.is_multiple_of(m) {
                    continue;
                }
                let b = per_replica / m;
                if inp.micro_batch.is_some_and(|mb| mb != b) {
                    continue;
                }
                let mut kinds = vec![(ScheduleKind::OneFOneB, 1)];
                if pp > 1 {
                    if shape.layers().is_multiple_of(2 * pp) {
                        kinds.push((ScheduleKind::Interleaved1F1B, 2));
                    }
                    kinds.push((ScheduleKind::ZbH1, 1));
                }
                for (kind, v) in kinds {
                    let Ok(sched) = schedule::build(kind, pp, m, v) else { continue };
                    let Ok(unit) = sched.simulate(&Costs::unit()) else { continue };
                    // ZeRO-0 too: as fast as ZeRO-1, and what the trainer runs today.
                    let zeros: &[u8] = if dp == 1 { &[0] } else { &[0, 1, 3] };
                    for &zero in zeros {
                        for recompute in Recompute::ALL {
                            tried += 1;
                            let layout = MemLayout { tp, pp, dp, chunks: v, micro_batch: b, recompute, zero };
                            let mem = rank_memory(shape, inp.params, &layout, &unit.peak_live);
                            let worst =
                                *mem.iter().max_by(|a, b| a.total.total_cmp(&b.total)).expect("pp ≥ 1");
                            if worst.total > usable {
                                rejected += 1;
                                smallest = Some(smallest.map_or(worst.total, |s| s.min(worst.total)));
                                continue;
                            }
                            let mut c =
                                evaluate(inp, &layout, kind, &sched, worst, compute_s, attn_fwd_share);
                            c.live_microbatches = unit.peak_live.clone();
                            let key = (tp, pp, kind.name().to_string());
                            c.lacks = super::runnable(shape, &layout, kind, m, super::Backend::Cuda).err();
                            if best.get(&key).is_none_or(|old| order(&c, old).is_lt()) {
                                best.insert(key, c);
                            }
                        }
                    }
                }
            }
        }
    }
    let mut candidates: Vec<Candidate> = best.into_values().collect();
    candidates.sort_by(order);
    SearchResult {
        candidates,
        layouts_tried: tried,
        rejected_for_memory: rejected,
        smallest_rejected_bytes: smallest,
    }
}

fn evaluate(
    inp: &SearchInput,
    l: &MemLayout,
    kind: ScheduleKind,
    sched: &schedule::Schedule,
    worst: RankMemory,
    compute_s: f64,
    attn_fwd_share: f64,
) -> Candidate {
    let shape = &inp.shape;
    let gpu = &inp.gpu;
    let (tp, pp, dp, m, v, b) = (l.tp, l.pp, l.dp, sched.microbatches, l.chunks, l.micro_batch);
    // Per action (one microbatch through one model chunk).
    let f = compute_s / m as f64 / 3.0 / v as f64;
    let extra = match l.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => f * attn_fwd_share,
        Recompute::Full => f,
    };
    let layers_per_chunk = shape.layers() as f64 / (pp * v) as f64;
    let act_bytes = (shape.seq() * b * shape.hidden()) as f64 * 2.0;
    let one_ar = allreduce_s(act_bytes, tp, gpu.nvlink_bytes_per_s);
    let tp_f = layers_per_chunk * 2.0 * one_ar;
    let tp_b = layers_per_chunk * if l.recompute == Recompute::Full { 4.0 } else { 2.0 } * one_ar;
    let hops = hops_across_nodes(tp, dp, pp, gpu.gpus_per_node);
    let p2p_ib_hops = hops.iter().filter(|&&x| x).count();
    let hop_s =
        |ib: bool| act_bytes / tp as f64 / if ib { gpu.ib_bytes_per_s } else { gpu.nvlink_bytes_per_s };
    // The simulator takes one message cost; the mean keeps the sum over the hops a
    // microbatch crosses (the warmup's critical path) right.
    let p2p_s = if pp > 1 { hops.iter().map(|&ib| hop_s(ib)).sum::<f64>() / hops.len() as f64 } else { 0.0 };
    let costs = Costs {
        forward: f + tp_f,
        backward: 2.0 * f + extra + tp_b,
        backward_input: f + extra + tp_b,
        backward_weight: f,
        comm: p2p_s,
        per_stage_factor: vec![],
    };
    let rep = sched.simulate(&costs).expect("a built schedule simulates");
    let grad_bytes = worst.params * 2.0;
    let zero_factor = if l.zero == 3 { 1.5 } else { 1.0 };
    let dp_allreduce_s = zero_factor * allreduce_s(grad_bytes, dp, gpu.link(tp * dp));
    let dp_exposed_s = dp_allreduce_s * (1.0 - inp.dp_overlap);
    let step_s = rep.makespan + dp_exposed_s;
    let tokens_step = (inp.global_batch * shape.seq()) as f64;
    let flops_step = (6.0 * inp.params + shape.attention_flops_per_token()) * tokens_step;
    let mfu = flops_step / (step_s * inp.gpus as f64 * gpu.peak_flops);
    let train_s = inp.tokens / tokens_step * step_s;
    let cost_usd = inp.price.map(|p| p * inp.gpus as f64 * train_s / 3600.0);
    let tp_comm_s = m as f64 * v as f64 * (tp_f + tp_b);
    let sched_name = if v > 1 { format!("{} v={v}", kind.name()) } else { kind.name().to_string() };
    let why = format!(
        "fits at {:.1} GB of {:.0} ({} recompute, ZeRO-{}, rank {} holds {} microbatch activations{}); \
         bubble {:.1}%; TP all-reduce {:.2} s, p2p {:.1} ms/hop ({} of {} hops across nodes), DP all-reduce {:.2} s{} per {:.2} s step",
        worst.total / 1e9,
        gpu.memory_bytes / 1e9,
        match l.recompute {
            Recompute::None => "no",
            r => r.name(),
        },
        l.zero,
        worst.rank,
        worst.live_microbatches,
        if v > 1 { format!(" over {v} chunks") } else { String::new() },
        100.0 * rep.mean_bubble_frac,
        tp_comm_s,
        1e3 * p2p_s,
        p2p_ib_hops,
        pp.saturating_sub(1),
        dp_allreduce_s,
        if inp.dp_overlap > 0.0 {
            format!(" ({:.0}% hidden)", 100.0 * inp.dp_overlap)
        } else {
            String::new()
        },
        step_s,
    );
    Candidate {
        tp,
        pp,
        dp,
        microbatches: m,
        micro_batch: b,
        schedule: sched_name,
        chunks: v,
        recompute: l.recompute,
        zero: l.zero,
        memory_bytes: worst.total,
        memory: worst,
        bubble: rep.mean_bubble_frac,
        compute_s: compute_s * (1.0 + extra / (3.0 * f)),
        tp_comm_s,
        p2p_s,
        p2p_ib_hops,
        live_microbatches: Vec::new(),
        pipeline_s: rep.makespan,
        dp_allreduce_s,
        step_s,
        tokens_per_s: tokens_step / step_s,
        mfu,
        train_days: train_s / 86_400.0,
        cost_usd,
        why,
        lacks: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_hops_cross_nodes_by_the_rank_order() {
        // tp·dp = 4: two stages per 8-GPU node, so only the middle hop leaves one.
        assert_eq!(hops_across_nodes(2, 2, 4, 8), vec![false, true, false]);
        // tp·dp = 8 fills a node: every hop crosses.
        assert_eq!(hops_across_nodes(8, 1, 2, 8), vec![true]);
        assert_eq!(hops_across_nodes(1, 8, 3, 8), vec![true, true]);
        // Eight stages of one GPU each fit one node: NVLink all the way.
        assert_eq!(hops_across_nodes(1, 1, 8, 8), vec![false; 7]);
        // tp·dp = 3 does not divide a node: a hop crosses when any rank pair does.
        assert_eq!(hops_across_nodes(1, 3, 3, 8), vec![false, true]);
    }
}
