//! Dry run: every rank executes its list in order with given costs, and the result
//! is a timeline, the makespan, bubbles and peak live activations, or the deadlock.
//!
//! Model of the runtime: an action starts at max(its rank is free, its inputs have
//! arrived). An input from the same rank is there when its producer ends; one from
//! another rank arrives `comm` later. Sends are buffered: a rank never blocks on a
//! send, it hands the message off and goes on (the actor runtime does the same, a
//! stage's mailbox holds early messages keyed by (kind, mb)). So a rank only ever
//! waits for a receive, and a deadlock is a cycle of ranks each waiting for a
//! receive whose sender is itself stuck.
//!
//! Inputs: F(s, mb) needs F(s−1, mb) for s > 0; B or I(s, mb) needs F(s, mb) and,
//! for s < S−1, the B or I of (s+1, mb); W(s, mb) needs I(s, mb).

use super::{Action, ActionKind, Schedule, ScheduleError, Stuck};

/// Time each kind of action takes, plus message latency.
#[derive(Clone, Debug, PartialEq)]
pub struct Costs {
    pub forward: f64,
    /// Full backward B.
    pub backward: f64,
    /// Input half I of a split backward.
    pub backward_input: f64,
    /// Weight half W of a split backward.
    pub backward_weight: f64,
    /// Latency added to every message between different ranks.
    pub comm: f64,
    /// Optional multiplier per stage (uneven stages); empty means 1 everywhere.
    pub per_stage_factor: Vec<f64>,
}

impl Costs {
    /// F = 1, B = 2, I = 1, W = 1, comm = 0: the costs the theory figures assume.
    pub fn unit() -> Costs {
        Costs {
            forward: 1.0,
            backward: 2.0,
            backward_input: 1.0,
            backward_weight: 1.0,
            comm: 0.0,
            per_stage_factor: Vec::new(),
        }
    }

    /// Duration of `action`.
    pub fn of(&self, action: &Action) -> f64 {
        let base = match action.kind {
            ActionKind::F => self.forward,
            ActionKind::B => self.backward,
            ActionKind::I => self.backward_input,
            ActionKind::W => self.backward_weight,
        };
        base * self.per_stage_factor.get(action.stage).copied().unwrap_or(1.0)
    }

    fn check(&self, stages: usize) -> Result<(), ScheduleError> {
        let bad = |field: &str, reason: String| ScheduleError::Unsupported { field: field.into(), reason };
        for (field, x) in [
            ("costs.forward", self.forward),
            ("costs.backward", self.backward),
            ("costs.backward_input", self.backward_input),
            ("costs.backward_weight", self.backward_weight),
            ("costs.comm", self.comm),
        ] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(bad(field, format!("must be finite and ≥ 0, got {x}")));
            }
        }
        let f = &self.per_stage_factor;
        if !f.is_empty() && f.len() != stages {
            return Err(bad("costs.per_stage_factor", format!("{} factors for {stages} stages", f.len())));
        }
        if let Some(x) = f.iter().find(|x| !(x.is_finite() && **x >= 0.0)) {
            return Err(bad("costs.per_stage_factor", format!("must be finite and ≥ 0, got {x}")));
        }
        Ok(())
    }
}

impl Default for Costs {
    fn default() -> Costs {
        Costs::unit()
    }
}

/// What a dry run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// End of the last action on any rank (all ranks start at 0).
    pub makespan: f64,
    /// Per rank: time spent computing.
    pub busy: Vec<f64>,
    /// Per rank: (makespan − busy) / makespan.
    pub bubble_frac: Vec<f64>,
    pub mean_bubble_frac: f64,
    /// Per stage: the most microbatches alive at once, i.e. whose F is done and whose
    /// B (or W, for a split backward) is not: the activations the stage must hold.
    pub peak_live: Vec<usize>,
    /// Per rank: (action, start, end) in execution order.
    pub timeline: Vec<Vec<(Action, f64, f64)>>,
}

/// End times of what has run, per (stage, mb).
struct Done {
    f: Vec<Vec<Option<f64>>>,
    /// B or I: the gradient stage − 1 waits for.
    grad: Vec<Vec<Option<f64>>>,
    i: Vec<Vec<Option<f64>>>,
}

impl Schedule {
    /// Validates, then runs every rank's list in order under `costs` (see the module
    /// comment for the model). A deadlock is reported with each unfinished rank, the
    /// index and action it is stuck at, and the input it waits for.
    pub fn simulate(&self, costs: &Costs) -> Result<SimReport, ScheduleError> {
        self.validate()?;
        let (p, s_count, m) = (self.ranks, self.stages(), self.microbatches);
        costs.check(s_count)?;
        // Whether (stage, mb) uses I/W (else B): names the right action in a deadlock.
        let mut split = vec![vec![false; m]; s_count];
        for a in self.actions.iter().flatten().filter(|a| a.kind == ActionKind::I) {
            split[a.stage][a.mb] = true;
        }
        let grad_action = |stage: usize, mb: usize| {
            if split[stage][mb] {
                Action::i(stage, mb)
            } else {
                Action::b(stage, mb)
            }
        };

        let none = vec![vec![None; m]; s_count];
        let mut done = Done { f: none.clone(), grad: none.clone(), i: none };
        let mut next = vec![0usize; p];
        let mut free = vec![0.0f64; p];
        let mut timeline: Vec<Vec<(Action, f64, f64)>> =
            self.actions.iter().map(|l| Vec::with_capacity(l.len())).collect();

        // An input of `a` on `rank`: Ok(arrival time) or Err(the action it waits for).
        let input = |done: &Done, a: Action, rank: usize| -> Result<f64, Action> {
            let from = |t: Option<f64>, producer: Action| {
                let t = t.ok_or(producer)?;
                Ok(if self.rank_of(producer.stage) == rank { t } else { t + costs.comm })
            };
            let (s, mb) = (a.stage, a.mb);
            let mut ready = 0.0f64;
            match a.kind {
                ActionKind::F => {
                    if s > 0 {
                        ready = ready.max(from(done.f[s - 1][mb], Action::f(s - 1, mb))?);
                    }
                }
                ActionKind::B | ActionKind::I => {
                    ready = ready.max(from(done.f[s][mb], Action::f(s, mb))?);
                    if s + 1 < s_count {
                        ready = ready.max(from(done.grad[s + 1][mb], grad_action(s + 1, mb))?);
                    }
                }
                ActionKind::W => ready = ready.max(from(done.i[s][mb], Action::i(s, mb))?),
            }
            Ok(ready)
        };

        loop {
            let mut progressed = false;
            for r in 0..p {
                while let Some(&a) = self.actions[r].get(next[r]) {
                    let Ok(ready) = input(&done, a, r) else { break };
                    let start = free[r].max(ready);
                    let end = start + costs.of(&a);
                    match a.kind {
                        ActionKind::F => done.f[a.stage][a.mb] = Some(end),
                        ActionKind::B => done.grad[a.stage][a.mb] = Some(end),
                        ActionKind::I => {
                            done.grad[a.stage][a.mb] = Some(end);
                            done.i[a.stage][a.mb] = Some(end);
                        }
                        ActionKind::W => {}
                    }
                    timeline[r].push((a, start, end));
                    free[r] = end;
                    next[r] += 1;
                    progressed = true;
                }
            }
            if (0..p).all(|r| next[r] == self.actions[r].len()) {
                break;
            }
            if !progressed {
                let waiting = (0..p)
                    .filter_map(|r| {
                        let &action = self.actions[r].get(next[r])?;
                        let waits_for = input(&done, action, r).expect_err("a stuck rank waits for an input");
                        Some(Stuck { rank: r, index: next[r], action, waits_for })
                    })
                    .collect();
                return Err(ScheduleError::Deadlock { waiting });
            }
        }

        let makespan = free.iter().copied().fold(0.0, f64::max);
        let busy: Vec<f64> = timeline.iter().map(|l| l.iter().map(|(_, s, e)| e - s).sum()).collect();
        let bubble_frac: Vec<f64> =
            busy.iter().map(|b| if makespan > 0.0 { (makespan - b) / makespan } else { 0.0 }).collect();
        let mean_bubble_frac = bubble_frac.iter().sum::<f64>() / p as f64;

        // A stage runs only on its own rank, so its list order is its time order.
        let mut live = vec![0usize; s_count];
        let mut peak_live = vec![0usize; s_count];
        for a in self.actions.iter().flatten() {
            match a.kind {
                ActionKind::F => {
                    live[a.stage] += 1;
                    peak_live[a.stage] = peak_live[a.stage].max(live[a.stage]);
                }
                ActionKind::B | ActionKind::W => live[a.stage] -= 1,
                ActionKind::I => {}
            }
        }
        Ok(SimReport { makespan, busy, bubble_frac, mean_bubble_frac, peak_live, timeline })
    }
}
