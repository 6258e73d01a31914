//! Dry run: every rank executes its list in order with given costs, and the result
//! is a timeline, the makespan, bubbles and peak live activations, or the deadlock.
//!
//! Model of a rank: for each action in its list it receives the inputs it needs, runs
//! for the action's cost, then sends its output. An input from the same rank is there
//! when its producer ends; one from another rank travels `comm`. Two transports:
//!
//! - [`Transport::Buffered`] (what the actor runtime does, and what [`Schedule::simulate`]
//!   uses): a send never blocks; the message waits in the receiver's buffer, keyed by
//!   (kind, mb), until its action comes. A rank only ever waits for a receive.
//! - [`Transport::Rendezvous`] (NCCL-style blocking send/recv, each posted alone): a
//!   send completes only when the receiver posts the matching receive, which it does
//!   when it reaches the action that needs it; until then the sender can do nothing
//!   else. 1F1B deadlocks under it for p ≥ 2 and m ≥ 2 (rank 0 sends F(1) while rank
//!   1 sends B(0) back, each waiting for the other to receive): Megatron-LM pairs
//!   `send_forward_recv_backward` into one batched exchange for this reason. A
//!   schedule meant for such a transport must pass here, or pair its exchanges.
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
    /// Per rank: the most (stage, microbatch) pairs alive at once over all its
    /// stages. With v chunks a stage holds 1/v of a rank's layers, so this over v is
    /// comparable with a one-chunk schedule's `peak_live`.
    pub peak_live_rank: Vec<usize>,
    /// Per rank: (action, start, end) in execution order.
    pub timeline: Vec<Vec<(Action, f64, f64)>>,
}

/// How a send completes; see the module comment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Buffered,
    Rendezvous,
}

/// Where a rank is in its current action.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the action's inputs (its receive is posted).
    Receive,
    /// The action ran; its output waits for the receiver (rendezvous only).
    Send,
}

/// End times of what has run, and arrival times of what was sent, per (stage, mb).
struct Done {
    f: Vec<Vec<Option<f64>>>,
    /// B or I: the gradient stage − 1 waits for.
    grad: Vec<Vec<Option<f64>>>,
    i: Vec<Vec<Option<f64>>>,
    /// The activation F(s, mb) takes, when it came from another rank.
    act_in: Vec<Vec<Option<f64>>>,
    /// The gradient B/I(s, mb) takes, when it came from another rank.
    grad_in: Vec<Vec<Option<f64>>>,
}

impl Schedule {
    /// Validates, then runs every rank's list in order under `costs` with buffered
    /// sends (as the actor runtime delivers). See [`Schedule::simulate_with`].
    pub fn simulate(&self, costs: &Costs) -> Result<SimReport, ScheduleError> {
        self.simulate_with(costs, Transport::Buffered)
    }

    /// Validates, then runs every rank's list in order under `costs` and `transport`
    /// (see the module comment for the model). A deadlock is reported with each
    /// unfinished rank, the index and action it is stuck at, and the input it waits
    /// for or, blocked in a send, the action that has not posted its receive.
    pub fn simulate_with(&self, costs: &Costs, transport: Transport) -> Result<SimReport, ScheduleError> {
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
        // The action on another rank that takes `a`'s output, if any.
        let consumer = |a: Action| -> Option<Action> {
            let to = match a.kind {
                ActionKind::F if a.stage + 1 < s_count => Action::f(a.stage + 1, a.mb),
                ActionKind::B | ActionKind::I if a.stage > 0 => grad_action(a.stage - 1, a.mb),
                _ => return None,
            };
            (self.rank_of(to.stage) != self.rank_of(a.stage)).then_some(to)
        };

        let none = vec![vec![None; m]; s_count];
        let mut done = Done {
            f: none.clone(),
            grad: none.clone(),
            i: none.clone(),
            act_in: none.clone(),
            grad_in: none,
        };
        let mut next = vec![0usize; p];
        let mut phase = vec![Phase::Receive; p];
        let mut free = vec![0.0f64; p];
        let mut timeline: Vec<Vec<(Action, f64, f64)>> =
            self.actions.iter().map(|l| Vec::with_capacity(l.len())).collect();

        // The inputs of `a` on `rank`: Ok(when all are in hand) or Err(what is missing).
        let input = |done: &Done, a: Action, rank: usize| -> Result<f64, Action> {
            let (s, mb) = (a.stage, a.mb);
            // A producer on this rank hands over when it ends; one elsewhere sends.
            let from = |producer: Action, local: Option<f64>, sent: Option<f64>| {
                if self.rank_of(producer.stage) == rank {
                    local.ok_or(producer)
                } else {
                    sent.ok_or(producer)
                }
            };
            let mut ready = 0.0f64;
            match a.kind {
                ActionKind::F => {
                    if s > 0 {
                        ready = ready.max(from(Action::f(s - 1, mb), done.f[s - 1][mb], done.act_in[s][mb])?);
                    }
                }
                ActionKind::B | ActionKind::I => {
                    ready = ready.max(done.f[s][mb].ok_or(Action::f(s, mb))?);
                    if s + 1 < s_count {
                        let g = from(grad_action(s + 1, mb), done.grad[s + 1][mb], done.grad_in[s][mb])?;
                        ready = ready.max(g);
                    }
                }
                ActionKind::W => ready = ready.max(done.i[s][mb].ok_or(Action::i(s, mb))?),
            }
            Ok(ready)
        };
        let deliver = |done: &mut Done, to: Action, at: f64| match to.kind {
            ActionKind::F => done.act_in[to.stage][to.mb] = Some(at),
            _ => done.grad_in[to.stage][to.mb] = Some(at),
        };

        loop {
            let mut progressed = false;
            for r in 0..p {
                while let Some(&a) = self.actions[r].get(next[r]) {
                    if phase[r] == Phase::Send {
                        // Rendezvous: the receiver must be at `to`, its receive posted.
                        let to = consumer(a).expect("only a sending action waits in Send");
                        let q = self.rank_of(to.stage);
                        if self.actions[q].get(next[q]) != Some(&to) || phase[q] != Phase::Receive {
                            break;
                        }
                        let at = free[r].max(free[q]) + costs.comm;
                        deliver(&mut done, to, at);
                        free[r] = at;
                        phase[r] = Phase::Receive;
                        next[r] += 1;
                        progressed = true;
                        continue;
                    }
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
                    progressed = true;
                    match (consumer(a), transport) {
                        (Some(to), Transport::Buffered) => deliver(&mut done, to, end + costs.comm),
                        (Some(_), Transport::Rendezvous) => {
                            phase[r] = Phase::Send;
                            continue;
                        }
                        (None, _) => {}
                    }
                    next[r] += 1;
                }
            }
            if (0..p).all(|r| next[r] == self.actions[r].len()) {
                break;
            }
            if !progressed {
                let waiting = (0..p)
                    .filter_map(|r| {
                        let &action = self.actions[r].get(next[r])?;
                        let (waits_for, sending) = match phase[r] {
                            Phase::Send => (consumer(action).expect("a sending action has a receiver"), true),
                            Phase::Receive => {
                                (input(&done, action, r).expect_err("a stuck rank waits for an input"), false)
                            }
                        };
                        Some(Stuck { rank: r, index: next[r], action, waits_for, sending })
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

        // A rank's list order is its time order, and a stage runs only on its rank.
        let mut peak_live = vec![0usize; s_count];
        let mut peak_live_rank = vec![0usize; p];
        for (r, list) in self.actions.iter().enumerate() {
            let (mut live, mut rank_live) = (vec![0usize; s_count], 0usize);
            for a in list {
                match a.kind {
                    ActionKind::F => {
                        live[a.stage] += 1;
                        rank_live += 1;
                        peak_live[a.stage] = peak_live[a.stage].max(live[a.stage]);
                        peak_live_rank[r] = peak_live_rank[r].max(rank_live);
                    }
                    ActionKind::B | ActionKind::W => {
                        live[a.stage] -= 1;
                        rank_live -= 1;
                    }
                    ActionKind::I => {}
                }
            }
        }
        Ok(SimReport { makespan, busy, bubble_frac, mean_bubble_frac, peak_live, peak_live_rank, timeline })
    }
}
