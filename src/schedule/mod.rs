//! Pipeline schedules as data: one list of [`Action`]s per rank, built once, checked,
//! then only executed.
//!
//! p ranks each own v model chunks, so there are S = p·v stages. Which rank holds
//! which stage (the placement, [`Schedule::stage_rank`]) is part of the schedule,
//! chosen by its builder: looped (stage s on rank s % p) for most kinds, V-shaped
//! (rank r holds stages r and 2p − 1 − r) for ZB-V and DualPipeV. Each rank's list says, in
//! execution order, which (stage, kind, microbatch) it computes; the actor runtime
//! walks the lists, asks the schedule where a stage lives, and holds no schedule
//! logic of its own. This module is pure: it builds ([`build`], one function per kind
//! in `builders.rs`), checks ([`Schedule::validate`]), dry-runs
//! ([`Schedule::simulate`]) and draws ([`Schedule::grid`]) schedules, and never
//! touches threads or files.
//!
//! Kinds: GPipe, 1F1B, interleaved 1F1B (Megatron-LM's rule), ZB-H1 (backward
//! split into I and W, W deferred into the bubbles), ZB-V (the same split over two
//! chunks per rank in a V) and DualPipeV (DeepSeek's DualPipe folded into the same V,
//! in PyTorch's order).

mod action;
mod builders;
pub use builders::{size_problem, MAX_ACTIONS, MAX_RANKS};
mod render;
mod simulate;
mod validate;

pub use action::{Action, ActionKind, ParseActionError};
pub use simulate::{Costs, SimReport, Transport};

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Which builder made a schedule; a config names one (`parallel.schedule`)
/// by [`ScheduleKind::name`], the only spelling read or written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (backwards in microbatch order).
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward one backward after a warmup of p − r − 1 forwards on rank r.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over v ≥ 2 model chunks per rank (Megatron-LM's interleaving).
    #[serde(rename = "interleaved")]
    Interleaved1F1B,
    /// Zero-bubble H1: backward split into I (input) and W (weights), W deferred.
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// Zero-bubble V: two chunks per rank placed in a V, split backward.
    #[serde(rename = "zb-v")]
    ZbV,
    /// DualPipeV (DeepSeek's DualPipe on a V, PyTorch's `ScheduleDualPipeV`): two
    /// chunks per rank in a V, F of one chunk paired with B of the other, the
    /// backward split into I and W only where W fills a bubble.
    #[serde(rename = "dualpipev")]
    DualPipeV,
    /// Loaded from JSON and not equal to any built schedule: no config names it.
    #[serde(rename = "custom", skip_deserializing)]
    Custom,
}

impl ScheduleKind {
    /// The kinds [`build`] can make.
    pub const BUILT: [ScheduleKind; 6] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
        ScheduleKind::DualPipeV,
    ];

    /// v when not given: 2 for interleaved and the V kinds (ZB-V, DualPipeV), else 1.
    pub fn default_chunks(self) -> usize {
        match self {
            ScheduleKind::Interleaved1F1B | ScheduleKind::ZbV | ScheduleKind::DualPipeV => 2,
            _ => 1,
        }
    }

    /// The chunks per rank a run with `configured` chunks uses, or `None` if
    /// this kind cannot: interleaved runs any v (at least 2: a configured 1 is
    /// raised), the V kinds (ZB-V, DualPipeV) exactly 2 (likewise), the others 1.
    pub fn chunks_for(self, configured: usize) -> Option<usize> {
        let v = configured.max(self.default_chunks());
        let ok = match self {
            ScheduleKind::Interleaved1F1B => true,
            ScheduleKind::ZbV | ScheduleKind::DualPipeV => v == 2,
            _ => v == 1,
        };
        ok.then_some(v)
    }

    /// The fewest microbatches a step of `ranks` pipeline ranks may have: DualPipeV
    /// needs one per stage (2p, as PyTorch's `ScheduleDualPipeV` does), the others 1.
    pub fn min_microbatches(self, ranks: usize) -> usize {
        match self {
            ScheduleKind::DualPipeV => ranks.saturating_mul(2),
            _ => 1,
        }
    }

    /// The kinds whose backward is split into I and W: the zero-bubble ones, and
    /// DualPipeV (for the microbatches whose W it defers into a bubble).
    pub fn splits_backward(self) -> bool {
        matches!(self, ScheduleKind::ZbH1 | ScheduleKind::ZbV | ScheduleKind::DualPipeV)
    }

    /// Whether the kind places its two chunks per rank in a V ([`v_placement`]).
    pub fn v_shaped(self) -> bool {
        matches!(self, ScheduleKind::ZbV | ScheduleKind::DualPipeV)
    }

    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbV => "zb-v",
            ScheduleKind::DualPipeV => "dualpipev",
            ScheduleKind::Custom => "custom",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<ScheduleKind, ScheduleError> {
        ScheduleKind::BUILT.into_iter().find(|k| k.name() == s).ok_or_else(|| ScheduleError::Unsupported {
            field: "parallel.schedule".into(),
            reason: format!(
                "unknown schedule {s:?}; expected one of gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipev"
            ),
        })
    }
}

/// A rank that cannot go on, in a [`ScheduleError::Deadlock`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stuck {
    pub rank: usize,
    /// Position of `action` in the rank's list.
    pub index: usize,
    pub action: Action,
    /// The first input of `action` that never arrives or, when `sending`, the
    /// action on another rank that never posts the receive for `action`'s output.
    pub waits_for: Action,
    /// `action` ran and is blocked handing its output over (rendezvous sends only).
    pub sending: bool,
}

impl fmt::Display for Stuck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (r, i, a, w) = (self.rank, self.index, self.action, self.waits_for);
        if self.sending {
            write!(f, "rank {r} at index {i} ({a}) is blocked sending to {w}, whose receive is never posted")
        } else {
            write!(f, "rank {r} at index {i} ({a}) waits for {w}")
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    /// An action breaks a rule. For something missing, `index` is the length of the
    /// rank's list (where it would have to go) and `action` the missing one.
    #[error("rank {rank}, index {index} ({action}): {reason}")]
    Invalid { rank: usize, index: usize, action: Action, reason: String },
    /// Each rank that has not finished waits for something that never comes.
    #[error("deadlock: {}", waiting.iter().map(|s| s.to_string()).collect::<Vec<_>>().join("; "))]
    Deadlock { waiting: Vec<Stuck> },
    /// A request no builder can satisfy, or a malformed schedule shape; `field` names
    /// the setting (config path, or the CLI flag from [`cli_text`]).
    #[error("{field}: {reason}")]
    Unsupported { field: String, reason: String },
    /// Schedule JSON that does not parse.
    #[error("schedule JSON: {0}")]
    Json(String),
}

/// Per-rank action lists and the shape they were built for.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    /// p, the pipeline-parallel size.
    pub ranks: usize,
    /// v, model chunks per rank.
    pub chunks: usize,
    /// m, microbatches per step.
    pub microbatches: usize,
    /// The placement: `stage_rank[s]` is the rank that holds stage s (S entries,
    /// each rank holding v of them).
    pub stage_rank: Vec<usize>,
    /// One list per rank, in execution order.
    pub actions: Vec<Vec<Action>>,
}

/// Stage s on rank s % p: Megatron-LM's interleaving, and the plain pipeline for v = 1.
pub fn looped_placement(ranks: usize, chunks: usize) -> Vec<usize> {
    (0..ranks * chunks).map(|s| s % ranks).collect()
}

/// Rank r holds stages r and 2p − 1 − r: the zero-bubble paper's V, where the first
/// and last stages share rank 0 and the turn (stages p − 1 and p) sits on rank p − 1.
pub fn v_placement(ranks: usize) -> Vec<usize> {
    (0..2 * ranks).map(|s| if s < ranks { s } else { 2 * ranks - 1 - s }).collect()
}

/// Builds the schedule `kind` for `ranks` (p) ranks, `microbatches` (m) microbatches
/// and `chunks` (v) model chunks per rank. Refuses (`Unsupported`, naming the config
/// field) what the kind cannot do: v ≠ 1 except interleaved and the V kinds, v < 2
/// or m % p ≠ 0 for interleaved, v ≠ 2 for the V kinds, m < 2p for DualPipeV.
pub fn build(
    kind: ScheduleKind,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
) -> Result<Schedule, ScheduleError> {
    let (actions, stage_rank) = builders::build_actions(kind, ranks, microbatches, chunks)?;
    Ok(Schedule { kind, ranks, chunks, microbatches, stage_rank, actions })
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonForm {
    ranks: Vec<Vec<Action>>,
}

impl Schedule {
    /// S = p·v.
    pub fn stages(&self) -> usize {
        self.ranks * self.chunks
    }

    /// The rank that owns `stage`.
    pub fn rank_of(&self, stage: usize) -> usize {
        self.stage_rank[stage]
    }

    /// The stages rank `rank` owns, ascending.
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        (0..self.stage_rank.len()).filter(|&s| self.stage_rank[s] == rank).collect()
    }

    /// A schedule from per-rank lists alone, of kind `Custom`. The shape is inferred:
    /// p = number of lists, S = highest stage + 1 (a multiple of p), m = highest
    /// microbatch + 1, and each stage is placed on the rank whose list holds its
    /// first action. Not validated: call [`Schedule::validate`].
    pub fn from_lists(lists: Vec<Vec<Action>>) -> Result<Schedule, ScheduleError> {
        let ranks = lists.len();
        if ranks == 0 {
            return Err(ScheduleError::Json("\"ranks\" holds no lists".into()));
        }
        let all = || lists.iter().flatten();
        let stages = all().map(|a| a.stage + 1).max().unwrap_or(ranks).max(ranks);
        if !stages.is_multiple_of(ranks) {
            return Err(ScheduleError::Unsupported {
                field: "ranks".into(),
                reason: format!("{stages} stages cannot be shared evenly by {ranks} ranks"),
            });
        }
        let mut stage_rank = vec![None; stages];
        for (r, list) in lists.iter().enumerate() {
            for a in list {
                stage_rank[a.stage].get_or_insert(r);
            }
        }
        // A stage no list mentions: where the looped placement would put it, so the
        // validator reports it as missing on that rank.
        let stage_rank: Vec<usize> =
            stage_rank.iter().enumerate().map(|(s, r)| r.unwrap_or(s % ranks)).collect();
        let microbatches = all().map(|a| a.mb + 1).max().unwrap_or(0);
        Ok(Schedule {
            kind: ScheduleKind::Custom,
            ranks,
            chunks: stages / ranks,
            microbatches,
            stage_rank,
            actions: lists,
        })
    }

    /// The bubble fraction theory predicts with unit costs (F = 1, B = 2,
    /// I = W = 1, no comm), where known: GPipe and 1F1B (p−1)/(m+p−1) (exact);
    /// interleaved ≈ (p−1)/(v·m) (Megatron-LM's figure: bubble over ideal time).
    ///
    /// ZB-H1: makespan max(3m + p − 1, 2m + 2p − 1), each rank busy 3m. For m ≥ p
    /// that is the zero-bubble paper's (p−1)/(3m+p−1): bubble time (p−1)(F+I−W) =
    /// p − 1, a third of 1F1B's (p−1)(F+B) = 3(p−1), at 1F1B's peak memory (p live
    /// microbatches, which 1F1B holds on stage 0 and ZB-H1 on every stage). Both
    /// terms are lower bounds: the last stage cannot start before p − 1 and has 3m
    /// to do; stage 0's first I cannot start before 2p − 1 (p F's down, p − 1 I's
    /// up) and 2m I's and W's remain from there.
    ///
    /// ZB-V (m ≥ p): (p−1)/(6m+p−1), a lower bound — rank p − 1 waits p − 1 for its
    /// first input and then has 6m to do (2 stages × F, I, W) — which the builder
    /// reaches when m is a multiple of p (p ≤ 8; see `zb_v` for the rest). In bubble
    /// time that is a sixth of 1F1B's over the same layers (1F1B's stages are twice
    /// as long: 6(p−1)), at 1F1B's peak memory.
    ///
    /// DualPipeV (m ≥ 2p, which it needs): the same (p−1)/(6m+p−1), reached for every
    /// m, at one stage-microbatch more per rank (2p + 1, DeepSeek's "PP + 1" in
    /// chunks). DeepSeek's formula, (PP/2 − 1)(F&B + B − 3W) with PP = 2p stages,
    /// gives 2(p − 1) here (F&B = F + B = 3): it draws each overlapped F&B pair as
    /// one block that starts when both inputs are in, while the pair run as F then
    /// B (here, and in PyTorch's runtime without an overlap callback) lets the F
    /// start before the B's gradient arrives.
    pub fn theory_bubble(&self) -> Option<f64> {
        let (p, m, v) = (self.ranks as f64, self.microbatches as f64, self.chunks as f64);
        match self.kind {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => Some((p - 1.0) / (m + p - 1.0)),
            ScheduleKind::Interleaved1F1B => Some((p - 1.0) / (v * m)),
            ScheduleKind::ZbH1 => {
                let makespan = (3.0 * m + p - 1.0).max(2.0 * m + 2.0 * p - 1.0);
                Some((makespan - 3.0 * m) / makespan)
            }
            ScheduleKind::ZbV if m >= p => Some((p - 1.0) / (6.0 * m + p - 1.0)),
            ScheduleKind::DualPipeV if m >= 2.0 * p => Some((p - 1.0) / (6.0 * m + p - 1.0)),
            ScheduleKind::ZbV | ScheduleKind::DualPipeV | ScheduleKind::Custom => None,
        }
    }

    /// `{"ranks": [["0F0","0F1",...], ...]}`: the action lists only.
    pub fn to_json(&self) -> String {
        let lists: Vec<String> = self
            .actions
            .iter()
            .map(|l| format!("[{}]", l.iter().map(|a| format!("\"{a}\"")).collect::<Vec<_>>().join(",")))
            .collect();
        format!("{{\"ranks\": [{}]}}", lists.join(", "))
    }

    /// Reads [`Schedule::to_json`]'s form, as [`Schedule::from_lists`] does; `kind`
    /// is the built kind with the same lists and placement, else `Custom`.
    pub fn from_json(text: &str) -> Result<Schedule, ScheduleError> {
        let form: JsonForm = serde_json::from_str(text).map_err(|e| ScheduleError::Json(e.to_string()))?;
        let mut s = Schedule::from_lists(form.ranks)?;
        s.kind = ScheduleKind::BUILT
            .into_iter()
            .find(|&k| {
                build(k, s.ranks, s.microbatches, s.chunks)
                    .is_ok_and(|b| b.actions == s.actions && b.stage_rank == s.stage_rank)
            })
            .unwrap_or(ScheduleKind::Custom);
        Ok(s)
    }
}

/// The `pipewright schedule` command: builds, validates and simulates with unit
/// costs, and returns the grid, the figures and whether it runs with buffered and
/// with rendezvous sends, or with `json` the action lists only.
/// Errors name the command-line flag.
pub fn cli_text(
    kind: &str,
    stages: usize,
    microbatches: usize,
    chunks: Option<usize>,
    json: bool,
) -> Result<String, ScheduleError> {
    let to_flag = |e: ScheduleError| match e {
        ScheduleError::Unsupported { field, reason } => {
            let flag = match field.as_str() {
                "parallel.schedule" => "--kind",
                "parallel.pp" => "--stages",
                "parallel.microbatches" => "--microbatches",
                "parallel.chunks" => "--chunks",
                _ => return ScheduleError::Unsupported { field, reason },
            };
            ScheduleError::Unsupported { field: format!("{flag} ({field})"), reason }
        }
        e => e,
    };
    let kind: ScheduleKind = kind.parse().map_err(to_flag)?;
    let chunks = chunks.unwrap_or(kind.default_chunks());
    let schedule = build(kind, stages, microbatches, chunks).map_err(to_flag)?;
    schedule.validate()?;
    if json {
        return Ok(schedule.to_json() + "\n");
    }
    let report = schedule.simulate(&Costs::unit())?;
    Ok(schedule.grid(&report) + &schedule.transports(&Costs::unit()))
}

#[cfg(test)]
mod tests;
