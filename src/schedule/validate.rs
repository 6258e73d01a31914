//! The rules every schedule obeys, checked before anything runs it.
//!
//! - shape: one list per rank, p, v, m ≥ 1;
//! - placement: every one of the S stages on a rank < p, each rank holding v;
//! - every action's stage < S and microbatch < m, on the rank that owns the stage;
//! - each (stage, mb) has exactly one F and either exactly one B, or exactly one I
//!   and exactly one W;
//! - on the rank, F comes before its B or I, and I before its W.
//!
//! Cross-rank order (whether the lists can run together) is the simulator's job:
//! a valid schedule can still deadlock.

use super::{Action, ActionKind, Schedule, ScheduleError};

/// Where each action of one (stage, mb) sits in its rank's list.
#[derive(Clone, Copy, Default)]
struct Seen {
    f: Option<usize>,
    b: Option<usize>,
    i: Option<usize>,
    w: Option<usize>,
}

impl Schedule {
    /// Checks the rules above; the error names the rank, the index in its list and
    /// the action (for something missing: the list's length and the missing action).
    pub fn validate(&self) -> Result<(), ScheduleError> {
        let (p, s_count, m) = (self.ranks, self.stages(), self.microbatches);
        let shape = |field: &str, reason: String| ScheduleError::Unsupported { field: field.into(), reason };
        if p == 0 || self.chunks == 0 || m == 0 {
            return Err(shape(
                "ranks",
                format!("ranks ({p}), chunks ({}) and microbatches ({m}) must all be ≥ 1", self.chunks),
            ));
        }
        if self.actions.len() != p {
            return Err(shape("ranks", format!("{} action lists for {p} ranks", self.actions.len())));
        }
        if self.stage_rank.len() != s_count {
            return Err(shape(
                "stage_rank",
                format!("{} stages placed, but p·v = {s_count}", self.stage_rank.len()),
            ));
        }
        if let Some((stage, &r)) = self.stage_rank.iter().enumerate().find(|(_, &r)| r >= p) {
            return Err(shape(
                "stage_rank",
                format!("stage {stage} placed on rank {r}, but there are {p} ranks"),
            ));
        }
        // Equal shares: a rank's memory and threads are sized for v stages.
        for rank in 0..p {
            let held = self.stages_of(rank);
            if held.len() != self.chunks {
                return Err(shape(
                    "stage_rank",
                    format!("rank {rank} holds stages {held:?}; every rank must hold v = {}", self.chunks),
                ));
            }
        }
        let mut seen = vec![vec![Seen::default(); m]; s_count];
        for (rank, list) in self.actions.iter().enumerate() {
            for (index, &action) in list.iter().enumerate() {
                let bad = |reason: String| ScheduleError::Invalid { rank, index, action, reason };
                let Action { stage, kind, mb } = action;
                if stage >= s_count {
                    return Err(bad(format!("stage {stage} out of range: there are {s_count} stages")));
                }
                if mb >= m {
                    return Err(bad(format!("microbatch {mb} out of range: there are {m} microbatches")));
                }
                if self.rank_of(stage) != rank {
                    return Err(bad(format!(
                        "stage {stage} lives on rank {}, not {rank}",
                        self.rank_of(stage)
                    )));
                }
                let e = &mut seen[stage][mb];
                let slot = match kind {
                    ActionKind::F => &mut e.f,
                    ActionKind::B => &mut e.b,
                    ActionKind::I => &mut e.i,
                    ActionKind::W => &mut e.w,
                };
                if let Some(first) = *slot {
                    return Err(bad(format!("duplicate: {action} already at index {first}")));
                }
                *slot = Some(index);
                let f = Action::f(stage, mb);
                match kind {
                    ActionKind::F => {}
                    ActionKind::B | ActionKind::I if e.f.is_none() => {
                        return Err(bad(format!("comes before its forward {f}")));
                    }
                    ActionKind::W if e.i.is_none() => {
                        return Err(bad(format!("comes before its input backward {}", Action::i(stage, mb))));
                    }
                    _ => {}
                }
                if e.b.is_some() && (e.i.is_some() || e.w.is_some()) {
                    return Err(bad(format!(
                        "microbatch {mb} of stage {stage} has both a full backward B and a split one (I/W)"
                    )));
                }
            }
        }
        for (stage, per_mb) in seen.iter().enumerate() {
            let rank = self.rank_of(stage);
            let end = self.actions[rank].len();
            for (mb, e) in per_mb.iter().enumerate() {
                let missing = |action: Action, reason: String| ScheduleError::Invalid {
                    rank,
                    index: end,
                    action,
                    reason: format!("missing: {reason}"),
                };
                match (e.f, e.b, e.i, e.w) {
                    (None, ..) => {
                        return Err(missing(Action::f(stage, mb), "no forward for this microbatch".into()))
                    }
                    (Some(f), None, None, None) => {
                        return Err(missing(
                            Action::b(stage, mb),
                            format!("{} at index {f} has no backward (B, or I and W)", Action::f(stage, mb)),
                        ))
                    }
                    (_, None, Some(i), None) => {
                        return Err(missing(
                            Action::w(stage, mb),
                            format!("{} at index {i} has no weight backward W", Action::i(stage, mb)),
                        ))
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}
