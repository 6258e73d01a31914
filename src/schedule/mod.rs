//! Pipeline schedules as data: one list of [`Action`]s per rank, built once, checked,
//! then only executed.
//!
//! p ranks each own v model chunks, so there are S = p·v stages and stage s lives on
//! rank s % p. Each rank's list says, in execution order, which (stage, kind,
//! microbatch) it computes; the actor runtime walks the lists and holds no schedule
//! logic of its own. This module is pure: it builds ([`build`], one function per kind
//! in `builders.rs`), checks ([`Schedule::validate`]), dry-runs
//! ([`Schedule::simulate`]) and draws ([`Schedule::grid`]) schedules, and never
//! touches threads or files.
//!
//! Kinds: GPipe, 1F1B, interleaved 1F1B (Megatron-LM's rule) and ZB-H1 (backward
//! split into I and W, W deferred into the bubbles).

mod action;
mod builders;
mod render;
mod simulate;
mod validate;

pub use action::{Action, ActionKind, ParseActionError};
pub use simulate::{Costs, SimReport};

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Which builder made a schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (backwards in microbatch order).
    GPipe,
    /// One forward one backward after a warmup of p − r − 1 forwards on rank r.
    OneFOneB,
    /// 1F1B over v ≥ 2 model chunks per rank (Megatron-LM's interleaving).
    Interleaved1F1B,
    /// Zero-bubble H1: backward split into I (input) and W (weights), W deferred.
    ZbH1,
    /// Loaded from JSON and not equal to any built schedule.
    Custom,
}

impl ScheduleKind {
    /// The kinds [`build`] can make.
    pub const BUILT: [ScheduleKind; 4] =
        [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B, ScheduleKind::ZbH1];

    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
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
            reason: format!("unknown schedule {s:?}; expected one of gpipe, 1f1b, interleaved, zb-h1"),
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
    /// The first input of `action` that never arrives.
    pub waits_for: Action,
}

impl fmt::Display for Stuck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} at index {} ({}) waits for {}", self.rank, self.index, self.action, self.waits_for)
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
    /// One list per rank, in execution order.
    pub actions: Vec<Vec<Action>>,
}

/// Builds the schedule `kind` for `ranks` (p) ranks, `microbatches` (m) microbatches
/// and `chunks` (v) model chunks per rank. Refuses (`Unsupported`, naming the config
/// field) what the kind cannot do: v ≠ 1 except interleaved, v < 2 or m % p ≠ 0 for
/// interleaved.
pub fn build(
    kind: ScheduleKind,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
) -> Result<Schedule, ScheduleError> {
    let actions = builders::build_actions(kind, ranks, microbatches, chunks)?;
    Ok(Schedule { kind, ranks, chunks, microbatches, actions })
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
        stage % self.ranks
    }

    /// The stages rank `rank` owns, in order: rank, rank + p, …
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        (0..self.chunks).map(|c| c * self.ranks + rank).collect()
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
    pub fn theory_bubble(&self) -> Option<f64> {
        let (p, m, v) = (self.ranks as f64, self.microbatches as f64, self.chunks as f64);
        match self.kind {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => Some((p - 1.0) / (m + p - 1.0)),
            ScheduleKind::Interleaved1F1B => Some((p - 1.0) / (v * m)),
            ScheduleKind::ZbH1 => {
                let makespan = (3.0 * m + p - 1.0).max(2.0 * m + 2.0 * p - 1.0);
                Some((makespan - 3.0 * m) / makespan)
            }
            ScheduleKind::Custom => None,
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

    /// Reads [`Schedule::to_json`]'s form. The shape is inferred: p = number of lists,
    /// S = highest stage + 1 (must be a multiple of p), m = highest microbatch + 1.
    /// `kind` is the built kind with the same lists, else `Custom`. Not validated:
    /// call [`Schedule::validate`].
    pub fn from_json(text: &str) -> Result<Schedule, ScheduleError> {
        let form: JsonForm = serde_json::from_str(text).map_err(|e| ScheduleError::Json(e.to_string()))?;
        let ranks = form.ranks.len();
        if ranks == 0 {
            return Err(ScheduleError::Json("\"ranks\" holds no lists".into()));
        }
        let all = || form.ranks.iter().flatten();
        let stages = all().map(|a| a.stage + 1).max().unwrap_or(ranks).max(ranks);
        if !stages.is_multiple_of(ranks) {
            return Err(ScheduleError::Unsupported {
                field: "ranks".into(),
                reason: format!("{stages} stages cannot be shared evenly by {ranks} ranks"),
            });
        }
        let chunks = stages / ranks;
        let microbatches = all().map(|a| a.mb + 1).max().unwrap_or(0);
        let kind = ScheduleKind::BUILT
            .into_iter()
            .find(|&k| build(k, ranks, microbatches, chunks).is_ok_and(|s| s.actions == form.ranks))
            .unwrap_or(ScheduleKind::Custom);
        Ok(Schedule { kind, ranks, chunks, microbatches, actions: form.ranks })
    }
}

/// The `pipewright schedule` command: builds, validates and simulates with unit
/// costs, and returns the grid and figures, or with `json` the action lists only.
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
    let chunks = chunks.unwrap_or(if kind == ScheduleKind::Interleaved1F1B { 2 } else { 1 });
    let schedule = build(kind, stages, microbatches, chunks).map_err(to_flag)?;
    schedule.validate()?;
    if json {
        return Ok(schedule.to_json() + "\n");
    }
    let report = schedule.simulate(&Costs::unit())?;
    Ok(schedule.grid(&report))
}

#[cfg(test)]
mod tests;
