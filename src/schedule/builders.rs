//! One function per schedule kind, each returning the per-rank action lists.
//!
//! A new kind is a variant of `ScheduleKind`, a function here and an arm in
//! [`build_actions`], which also names the kind's placement (looped, or a V). Every
//! builder keeps each stage's backwards (B, or I and W) in ascending microbatch order,
//! and the weight-gradient halves (B or W) too where a stage mixes both: gradient
//! accumulation then runs in microbatch order on every stage, which is what makes a
//! pipeline bit-identical to a single stage.

use super::{looped_placement, v_placement, Action, ActionKind, ScheduleError, ScheduleKind};
use std::collections::VecDeque;

type Lists = Vec<Vec<Action>>;

/// The most actions a schedule may hold: 2^22 (4 Mi) builds, checks and
/// simulates in a few seconds and a few hundred MB; 3000 × 3000 (18 M) takes
/// half a minute and 2.5 GB, and 2^40 ranks abort in the allocator.
pub const MAX_ACTIONS: u64 = 1 << 22;

/// The most pipeline ranks a schedule may have: the grid and the checks
/// compare every rank with its neighbours' timelines, so time grows with p²
/// whatever m is (20 000 ranks of one microbatch take 20 s).
pub const MAX_RANKS: usize = 4096;

/// Why a schedule of `p` ranks, `m` microbatches and `v` chunks is too large
/// to build here: the config field most to blame, its value and the limit.
/// Computed in u128 (the products overflow usize), before anything is allocated.
pub fn size_problem(p: usize, m: usize, v: usize) -> Option<(&'static str, usize, String)> {
    if p > MAX_RANKS {
        return Some(("parallel.pp", p, format!("expected at most {MAX_RANKS} pipeline ranks")));
    }
    // F and B (or F, I and W) per stage and microbatch: at most 3.
    let actions = 3 * p as u128 * m as u128 * v as u128;
    if actions <= MAX_ACTIONS as u128 {
        return None;
    }
    let (field, value) = if m >= v.max(p) {
        ("parallel.microbatches", m)
    } else if v >= p {
        ("parallel.chunks", v)
    } else {
        ("parallel.pp", p)
    };
    Some((
        field,
        value,
        format!(
            "{p} ranks × {v} chunks × {m} microbatches make about {actions} actions, more than the \
             {MAX_ACTIONS} a schedule may hold"
        ),
    ))
}

fn check_size(p: usize, m: usize, v: usize) -> Result<(), ScheduleError> {
    match size_problem(p, m, v) {
        None => Ok(()),
        Some((field, value, limit)) => Err(unsupported(field, format!("{value}: {limit}"))),
    }
}

fn unsupported(field: &str, reason: String) -> ScheduleError {
    ScheduleError::Unsupported { field: field.into(), reason }
}

/// Checks the shape, then dispatches to the kind's builder: the action lists and the
/// placement (`stage_rank`) they were built for.
pub(super) fn build_actions(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
) -> Result<(Lists, Vec<usize>), ScheduleError> {
    if p == 0 {
        return Err(unsupported("parallel.pp", "a pipeline needs at least 1 rank".into()));
    }
    if m == 0 {
        return Err(unsupported("parallel.microbatches", "a step needs at least 1 microbatch".into()));
    }
    if v == 0 {
        return Err(unsupported("parallel.chunks", "each rank needs at least 1 model chunk".into()));
    }
    check_size(p, m, v)?;
    let one_chunk = |name: &str| {
        if v == 1 {
            Ok(())
        } else {
            Err(unsupported(
                "parallel.chunks",
                format!("{name} runs one model chunk per rank, not {v}; use interleaved for more"),
            ))
        }
    };
    let looped = |lists: Lists| (lists, looped_placement(p, v));
    match kind {
        ScheduleKind::GPipe => one_chunk("gpipe").map(|_| looped(gpipe(p, m))),
        ScheduleKind::OneFOneB => one_chunk("1f1b").map(|_| looped(one_f_one_b(p, m))),
        ScheduleKind::Interleaved1F1B => interleaved(p, m, v).map(looped),
        ScheduleKind::ZbH1 => one_chunk("zb-h1").map(|_| looped(zb_h1(p, m))),
        ScheduleKind::ZbV if v != 2 => Err(unsupported(
            "parallel.chunks",
            format!("zb-v runs exactly 2 model chunks per rank (a V), not {v}"),
        )),
        ScheduleKind::ZbV => Ok((zb_v(p, m)?, v_placement(p))),
        ScheduleKind::DualPipeV if v != 2 => Err(unsupported(
            "parallel.chunks",
            format!("dualpipev runs exactly 2 model chunks per rank (a V), not {v}"),
        )),
        ScheduleKind::DualPipeV => Ok((dualpipe_v(p, m)?, v_placement(p))),
        ScheduleKind::Custom => {
            Err(unsupported("parallel.schedule", "a custom schedule is loaded from JSON, not built".into()))
        }
    }
}

/// GPipe: rank r runs F of every microbatch on stage r, then B of every microbatch,
/// both in microbatch order.
fn gpipe(p: usize, m: usize) -> Lists {
    (0..p)
        .map(|r| (0..m).map(|mb| Action::f(r, mb)).chain((0..m).map(|mb| Action::b(r, mb))).collect())
        .collect()
}

/// 1F1B: rank r runs min(p − r − 1, m) warmup forwards, then alternates one F and
/// one B, then the remaining Bs. At most p − r microbatches are alive on stage r.
fn one_f_one_b(p: usize, m: usize) -> Lists {
    (0..p)
        .map(|r| {
            let warmup = (p - r - 1).min(m);
            let mut list: Vec<Action> = (0..warmup).map(|mb| Action::f(r, mb)).collect();
            for i in 0..m - warmup {
                list.push(Action::f(r, warmup + i));
                list.push(Action::b(r, i));
            }
            list.extend((m - warmup..m).map(|mb| Action::b(r, mb)));
            list
        })
        .collect()
}

/// Interleaved 1F1B, Megatron-LM's rule. The m·v virtual microbatches k run, on
/// rank r, forward on chunk (k / p) % v and backward on chunk v − 1 − (k / p) % v,
/// both for microbatch (k / (p·v))·p + k % p; chunk c of rank r is stage c·p + r.
/// Warmup is min((p − r − 1)·2 + (v − 1)·p, m·v) forwards, then 1F1B, then cooldown.
/// Needs m % p == 0 so that every group of p microbatches visits every chunk.
fn interleaved(p: usize, m: usize, v: usize) -> Result<Lists, ScheduleError> {
    if v < 2 {
        return Err(unsupported(
            "parallel.chunks",
            format!("interleaved 1F1B needs at least 2 model chunks per rank, got {v}; use 1f1b for 1"),
        ));
    }
    if !m.is_multiple_of(p) {
        return Err(unsupported(
            "parallel.microbatches",
            format!("interleaved 1F1B needs a multiple of the {p} pipeline ranks, got {m}"),
        ));
    }
    let total = m * v;
    let mb_of = |k: usize| (k / (p * v)) * p + k % p;
    let fwd = |r: usize, k: usize| Action::f(((k / p) % v) * p + r, mb_of(k));
    let bwd = |r: usize, k: usize| Action::b((v - 1 - (k / p) % v) * p + r, mb_of(k));
    Ok((0..p)
        .map(|r| {
            let warmup = ((p - r - 1) * 2 + (v - 1) * p).min(total);
            let mut list: Vec<Action> = (0..warmup).map(|k| fwd(r, k)).collect();
            for i in 0..total - warmup {
                list.push(fwd(r, warmup + i));
                list.push(bwd(r, i));
            }
            list.extend((total - warmup..total).map(|k| bwd(r, k)));
            list
        })
        .collect())
}

/// ZB-H1, the zero-bubble paper's hand-built schedule (Qi et al. 2023, §2.1): 1F1B
/// with the backward split into I and W, and the W of stage s held back by s
/// microbatches. Stage s runs min(p − s − 1, m) warmup forwards, then for each
/// microbatch j: the next F (while any is left), I(j), and W(j − s) once j ≥ s; the
/// W's still owed come last.
///
/// Why it works (unit costs F = I = W): I is on the critical path and W is not, so
/// the gradient of a microbatch reaches stage 0 after p I's instead of p B's, which
/// saves (p − 1)·W of the 1F1B warmup bubble; the held-back W's fill the cooldown.
/// Bubble time per rank: p − 1 against 1F1B's 3(p − 1), a third, when m ≥ p.
///
/// Memory: after F on stage s, live microbatches (F done, W not) are
/// (p − s − 1 warmup) + 1 + (s W's held back) = p, the peak of 1F1B's stage 0 — the
/// paper's claim is about the pipeline's peak, the max over stages, which ZB-H1
/// spends on every stage (1F1B's stage s holds only p − s).
fn zb_h1(p: usize, m: usize) -> Lists {
    (0..p)
        .map(|s| {
            let warmup = (p - s - 1).min(m);
            let mut list: Vec<Action> = (0..warmup).map(|mb| Action::f(s, mb)).collect();
            let (mut next_f, mut next_w) = (warmup, 0);
            for j in 0..m {
                if next_f < m {
                    list.push(Action::f(s, next_f));
                    next_f += 1;
                }
                list.push(Action::i(s, j));
                if j >= s {
                    list.push(Action::w(s, next_w));
                    next_w += 1;
                }
            }
            list.extend((next_w..m).map(|mb| Action::w(s, mb)));
            list
        })
        .collect()
}

/// ZB-V (Qi et al. 2023, §6): 2p stages in a V, rank r holding stages r and
/// 2p − 1 − r, so rank 0 holds both ends and the turn (stages p − 1, p) stays on rank
/// p − 1; backward split into I and W. Built by list scheduling with unit costs
/// (F = I = W = 1 per stage, no comm): at each time step every idle rank takes, in
/// this order of preference,
///
/// 1. an I whose output gradient is in (its down-leg stage r before its up-leg stage
///    2p − 1 − r): I is the critical path;
/// 2. an F whose input is in, while the rank holds fewer than 2p stage-microbatches
///    alive (F done, W not) — each stage is half a 1F1B stage, so that is 1F1B's
///    peak of p microbatches — the up-leg stage first, as it leads to an I sooner;
/// 3. its oldest pending W (down-leg first): W fills what would be a bubble.
///
/// The order in which each rank ran its actions is the schedule; every stage's F, I
/// and W run in ascending microbatch order. For m a multiple of p and p ≤ 8 (and
/// any m ≥ p when p ≤ 4) this reaches the unit-cost lower bound 6m + p − 1 (rank
/// p − 1 waits p − 1 for its first input, then has 6m to do); otherwise it can land
/// a few units above (p = 8, m = 9: 4; p = 16: up to 12), still under ZB-H1. The
/// paper's own builder likewise tries heuristics rather than solving for the optimum.
fn zb_v(p: usize, m: usize) -> Result<Lists, ScheduleError> {
    let s_count = 2 * p;
    // Time steps at which F / I of (stage, mb) finished; None = not yet.
    let mut f_done = vec![vec![None::<usize>; m]; s_count];
    let mut i_done = vec![vec![None::<usize>; m]; s_count];
    let (mut next_f, mut next_i, mut next_w) = (vec![0; s_count], vec![0; s_count], vec![0; s_count]);
    let mut lists: Lists = vec![Vec::with_capacity(6 * m); p];
    let arrived = |t: Option<usize>, now: usize| t.is_some_and(|t| t <= now);
    let mut now = 0;
    while next_w.iter().any(|&w| w < m) {
        // Decide for every rank from what finished by `now`, then commit, so no rank
        // sees a result produced in the same time step.
        let mut chosen = Vec::with_capacity(p);
        for r in 0..p {
            let (down, up) = (r, s_count - 1 - r);
            let live = next_f[down] - next_w[down] + next_f[up] - next_w[up];
            let i_ready = |s: usize| {
                let j = next_i[s];
                j < m && arrived(f_done[s][j], now) && (s + 1 == s_count || arrived(i_done[s + 1][j], now))
            };
            let f_ready = |s: usize| {
                let j = next_f[s];
                j < m && live < 2 * p && (s == 0 || arrived(f_done[s - 1][j], now))
            };
            let w_ready = |s: usize| next_w[s] < next_i[s];
            let pick = [(down, ActionKind::I), (up, ActionKind::I)]
                .into_iter()
                .find(|&(s, _)| i_ready(s))
                .or_else(|| {
                    [(up, ActionKind::F), (down, ActionKind::F)].into_iter().find(|&(s, _)| f_ready(s))
                })
                .or_else(|| {
                    [(down, ActionKind::W), (up, ActionKind::W)].into_iter().find(|&(s, _)| w_ready(s))
                });
            chosen.push(pick.map(|(s, kind)| {
                let mb = match kind {
                    ActionKind::F => next_f[s],
                    ActionKind::I => next_i[s],
                    _ => next_w[s],
                };
                Action::new(s, kind, mb)
            }));
        }
        if chosen.iter().all(Option::is_none) {
            // Nothing is running either (unit costs: all of it ended by `now`), so
            // nothing would ever change.
            return Err(unsupported(
                "parallel.schedule",
                format!("zb-v: no schedule found for p = {p}, m = {m}"),
            ));
        }
        for (r, a) in chosen.into_iter().enumerate() {
            let Some(a) = a else { continue };
            match a.kind {
                ActionKind::F => {
                    f_done[a.stage][a.mb] = Some(now + 1);
                    next_f[a.stage] += 1;
                }
                ActionKind::I => {
                    i_done[a.stage][a.mb] = Some(now + 1);
                    next_i[a.stage] += 1;
                }
                _ => next_w[a.stage] += 1,
            }
            lists[r].push(a);
        }
        now += 1;
    }
    Ok(lists)
}

/// DualPipeV: DeepSeek's DualPipe (DeepSeek-V3 report, §3.2.1) folded into a V, in
/// the per-rank order of PyTorch's `ScheduleDualPipeV` (itself from
/// deepseek-ai/DualPipe's `dualpipev.py`). Rank r holds the down-leg stage r
/// (chunk 0) and the up-leg stage 2p − 1 − r (chunk 1); with k = p − r − 1 ranks
/// below it on the V's down leg, it runs
///
/// 1. 2k forwards of chunk 0 (rank 0 the most: the V's deepest fill);
/// 2. r + 1 pairs F0 F1: the up leg starts as the first microbatches turn;
/// 3. k times I1 W1 F1: a split backward of chunk 1 with its W at once, filling
///    the gap while the first gradients climb the down leg;
/// 4. m − 2p + r + 1 steady steps F0 B1 F1 B0: the forward of one chunk paired with
///    the backward of the other, DualPipe's overlapped "F&B" chunks;
/// 5. k times B1 F1 B0: the last forwards, paired likewise;
/// 6. r + 1 times B1 B0, switching to a split backward (I, W deferred) halfway
///    through (before B1 on odd ranks, before B0 on even ones);
/// 7. k times W I0: each deferred W fills the wait for the next gradient;
/// 8. the W's still owed, oldest first.
///
/// PyTorch emits each pair of step 4 and 5 as one `OVERLAP_F_B` action whose
/// sub-actions its runtime runs one after the other, forward first (unless an
/// overlap callback is registered to interleave their kernels, e.g. to hide an
/// MoE all-to-all behind the other's compute); our executor runs one action at a
/// time, so a pair is written as its F followed by its B, which is exactly that
/// sequential order. Likewise rank p − 1's first step-4 pair, which PyTorch leaves
/// un-overlapped on purpose, reads the same here. Each stage's F, B/I and W run in
/// ascending microbatch order, and a stage's B's all precede its deferred W's
/// except step 3's, whose W comes right after its I — so the weight gradients
/// accumulate in microbatch order. Needs m ≥ 2p, as PyTorch does (with fewer,
/// step 4's count goes negative and the fill-and-drain steps do not meet).
fn dualpipe_v(p: usize, m: usize) -> Result<Lists, ScheduleError> {
    if m < ScheduleKind::DualPipeV.min_microbatches(p) {
        return Err(unsupported(
            "parallel.microbatches",
            format!(
                "dualpipev needs at least as many microbatches as its 2 × {p} = {} stages (as PyTorch's \
                 ScheduleDualPipeV does), got {m}",
                2 * p
            ),
        ));
    }
    Ok((0..p).map(|r| DualPipeRank::new(p, r, m).build()).collect())
}

/// One rank's list as DualPipeV builds it: the next microbatch per chunk for F and
/// for the backward (B or I), and the W's owed, oldest first.
struct DualPipeRank {
    p: usize,
    r: usize,
    m: usize,
    /// [down-leg stage r, up-leg stage 2p − 1 − r].
    stage: [usize; 2],
    next_f: [usize; 2],
    next_back: [usize; 2],
    owed_w: VecDeque<Action>,
    list: Vec<Action>,
}

impl DualPipeRank {
    fn new(p: usize, r: usize, m: usize) -> DualPipeRank {
        DualPipeRank {
            p,
            r,
            m,
            stage: [r, 2 * p - 1 - r],
            next_f: [0; 2],
            next_back: [0; 2],
            owed_w: VecDeque::new(),
            list: Vec::with_capacity(5 * m),
        }
    }

    fn f(&mut self, chunk: usize) {
        self.list.push(Action::f(self.stage[chunk], self.next_f[chunk]));
        self.next_f[chunk] += 1;
    }

    /// The next backward of `chunk`: B, or I with its W owed when `split`.
    fn back(&mut self, chunk: usize, split: bool) {
        let (stage, mb) = (self.stage[chunk], self.next_back[chunk]);
        self.next_back[chunk] += 1;
        if split {
            self.list.push(Action::i(stage, mb));
            self.owed_w.push_back(Action::w(stage, mb));
        } else {
            self.list.push(Action::b(stage, mb));
        }
    }

    /// The oldest W owed, if any.
    fn w(&mut self) {
        if let Some(w) = self.owed_w.pop_front() {
            self.list.push(w);
        }
    }

    fn build(mut self) -> Vec<Action> {
        let (p, r, m) = (self.p, self.r, self.m);
        let below = p - r - 1;
        for _ in 0..2 * below {
            self.f(0);
        }
        for _ in 0..r + 1 {
            self.f(0);
            self.f(1);
        }
        for _ in 0..below {
            self.back(1, true);
            self.w();
            self.f(1);
        }
        for _ in 0..m + r + 1 - 2 * p {
            self.f(0);
            self.back(1, false);
            self.f(1);
            self.back(0, false);
        }
        for _ in 0..below {
            self.back(1, false);
            self.f(1);
            self.back(0, false);
        }
        // The drain's r + 1 pairs of backwards switch to split ones at the middle pair.
        let drain = r + 1;
        let halfway = drain / 2;
        let mut split = false;
        for i in 0..drain {
            split |= i == halfway && r % 2 == 1;
            self.back(1, split);
            split |= i == halfway && r % 2 == 0;
            self.back(0, split);
        }
        // Step 6 always ends split (halfway < drain).
        for _ in 0..below {
            self.w();
            self.back(0, true);
        }
        while !self.owed_w.is_empty() {
            self.w();
        }
        debug_assert_eq!((self.next_f, self.next_back), ([m; 2], [m; 2]));
        self.list
    }
}
