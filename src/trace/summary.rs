//! Reading a trace back and saying where the time went: per step and per lane,
//! busy time and idle time split into the warmup bubble, the cooldown bubble and
//! mid-schedule waits (each wait attributed to what it waited for), compared with
//! the bubble the schedule's simulator predicts at the measured costs.
//!
//! A lane is one pipeline rank (with one model chunk per rank, one stage). Only
//! `cat: "action"` spans count as busy; waits only explain idle time. This module
//! reads and computes; it never writes files and never panics on bad input.

use crate::schedule::{self, Action, ActionKind, Costs, ScheduleKind, SimReport};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Why a trace cannot be read or summarised; always names the file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{}: cannot read: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{}: cannot write: {error}", path.display())]
    Write { path: PathBuf, error: std::io::Error },
    #[error("{}: not a Chrome trace: {reason}", path.display())]
    Format { path: PathBuf, reason: String },
    #[error("{}: {reason}", path.display())]
    Empty { path: PathBuf, reason: String },
    #[error("{}: {reason}", path.display())]
    Output { path: PathBuf, reason: String },
}

/// A span read back from a trace (an action, or a wait with its detail).
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub replica: usize,
    pub stage: usize,
    pub rank: usize,
    pub step: u64,
    /// For actions: F, B, I or W.
    pub kind: Option<ActionKind>,
    pub mb: Option<usize>,
    pub start_us: f64,
    pub end_us: f64,
    /// For waits: what was waited for.
    pub detail: Option<String>,
}

impl Span {
    fn dur(&self) -> f64 {
        self.end_us - self.start_us
    }
    fn action(&self) -> Option<Action> {
        Some(Action::new(self.stage, self.kind?, self.mb?))
    }
}

/// The "metadata" object `chrome_json` writes (fields absent in foreign traces are
/// inferred from the events).
#[derive(Clone, Debug, PartialEq)]
pub struct TraceMeta {
    pub schedule: Option<String>,
    pub pp: usize,
    pub dp: usize,
    pub chunks: usize,
    pub microbatches: usize,
    pub stages: usize,
    /// "cpu", "sim", "cuda" (absent in older or foreign traces).
    pub backend: Option<String>,
    /// Cores of the machine that ran it, and the compute threads one process ran there.
    pub cores: Option<usize>,
    pub compute_threads: Option<usize>,
    /// Set when the figures are of one data-parallel replica (`--replica`).
    pub replica: Option<usize>,
}

/// A parsed trace: its layout and the spans that matter for bubbles.
#[derive(Clone, Debug)]
pub struct Trace {
    pub path: PathBuf,
    pub meta: TraceMeta,
    pub actions: Vec<Span>,
    pub waits: Vec<Span>,
}

impl Trace {
    /// Replica `r`'s spans alone, renumbered as replica 0 so that every figure
    /// (the step windows, the median step's critical path) is of that replica;
    /// `meta.replica` says which it was.
    pub fn replica(mut self, r: usize) -> Result<Trace, TraceError> {
        let dp = self.meta.dp;
        if r >= dp {
            return Err(TraceError::Empty {
                path: self.path,
                reason: format!(
                    "--replica {r}: the trace holds {dp} data-parallel replica(s), 0 to {}",
                    dp - 1
                ),
            });
        }
        self.actions.retain(|s| s.replica == r);
        self.waits.retain(|s| s.replica == r);
        for s in self.actions.iter_mut().chain(self.waits.iter_mut()) {
            s.replica = 0;
        }
        self.meta.replica = Some(r);
        Ok(self)
    }
}

/// Reads and parses `path`.
pub fn load(path: &Path) -> Result<Trace, TraceError> {
    let cap = crate::fsutil::memory_cap();
    let text = crate::fsutil::read_regular_to_string(path, cap, "this machine's memory holds")
        .map_err(|error| TraceError::Io { path: path.into(), error })?;
    parse(&text, path)
}

/// Parses Chrome trace JSON; `path` only names the source in errors.
pub fn parse(text: &str, path: &Path) -> Result<Trace, TraceError> {
    let bad = |reason: String| TraceError::Format { path: path.into(), reason };
    let root: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    let events = match &root {
        Value::Object(o) => o.get("traceEvents").and_then(Value::as_array),
        Value::Array(a) => Some(a),
        _ => None,
    }
    .ok_or_else(|| bad("no \"traceEvents\" array".into()))?;
    let (mut actions, mut waits) = (Vec::new(), Vec::new());
    for (i, e) in events.iter().enumerate() {
        if e.get("ph").and_then(Value::as_str) != Some("X") {
            continue;
        }
        let cat = e.get("cat").and_then(Value::as_str).unwrap_or("");
        if cat != "action" && cat != "wait" {
            continue;
        }
        let num = |v: Option<&Value>, what: &str| {
            v.and_then(Value::as_f64).ok_or_else(|| bad(format!("event {i}: no number {what}")))
        };
        let args = e.get("args");
        let arg = |k: &str| args.and_then(|a| a.get(k));
        let ts = num(e.get("ts"), "ts")?;
        let dur = num(e.get("dur"), "dur")?;
        let stage = num(arg("stage").or(e.get("tid")), "stage")? as usize;
        // pid is a process per (replica, node); traces from elsewhere may only have pid.
        let replica = arg("replica").or(e.get("pid")).and_then(Value::as_u64).unwrap_or(0) as usize;
        let span = Span {
            replica,
            stage,
            rank: arg("rank").and_then(Value::as_u64).map(|r| r as usize).unwrap_or(stage),
            step: arg("step").and_then(Value::as_u64).unwrap_or(0),
            kind: None,
            mb: arg("mb").and_then(Value::as_u64).map(|m| m as usize),
            start_us: ts,
            end_us: ts + dur.max(0.0),
            detail: arg("detail").and_then(Value::as_str).map(str::to_string),
        };
        if cat == "action" {
            let name = e.get("name").and_then(Value::as_str).unwrap_or("");
            let kind = name.chars().next().and_then(ActionKind::from_letter);
            let mb = span.mb.or_else(|| name.get(1..).and_then(|s| s.parse().ok()));
            let (Some(kind), Some(mb)) = (kind, mb) else {
                return Err(bad(format!("event {i}: action {name:?} is not F/B/I/W with a microbatch")));
            };
            actions.push(Span { kind: Some(kind), mb: Some(mb), ..span });
        } else {
            waits.push(span);
        }
    }
    if actions.is_empty() {
        return Err(TraceError::Empty { path: path.into(), reason: "the trace holds no actions".into() });
    }
    let m = root.get("metadata");
    let field = |k: &str| m.and_then(|m| m.get(k)).and_then(Value::as_u64).map(|x| x as usize);
    let pp = field("pp").unwrap_or_else(|| actions.iter().map(|a| a.rank + 1).max().unwrap_or(1));
    let stages = field("stages").unwrap_or_else(|| actions.iter().map(|a| a.stage + 1).max().unwrap_or(1));
    let meta = TraceMeta {
        schedule: m.and_then(|m| m.get("schedule")).and_then(Value::as_str).map(str::to_string),
        pp,
        dp: field("dp").unwrap_or_else(|| actions.iter().map(|a| a.replica + 1).max().unwrap_or(1)),
        chunks: field("chunks").unwrap_or((stages / pp.max(1)).max(1)),
        microbatches: field("microbatches")
            .unwrap_or_else(|| actions.iter().filter_map(|a| a.mb).max().map_or(0, |m| m + 1)),
        stages,
        backend: m.and_then(|m| m.get("backend")).and_then(Value::as_str).map(str::to_string),
        cores: field("cores"),
        compute_threads: field("compute_threads"),
        replica: None,
    };
    Ok(Trace { path: path.into(), meta, actions, waits })
}

/// One lane's (pipeline rank's) figures, means over the counted steps and replicas.
#[derive(Clone, Debug, PartialEq)]
pub struct LaneSummary {
    /// The rank's first stage (equal to `rank` with one chunk per rank).
    pub stage: usize,
    pub rank: usize,
    /// Every stage the rank runs.
    pub stages: Vec<usize>,
    pub busy_frac: f64,
    /// idle / step window.
    pub bubble_frac: f64,
    pub busy_ms: f64,
    /// Idle before the lane's first action of the step.
    pub warmup_ms: f64,
    /// Idle after its last action.
    pub cooldown_ms: f64,
    /// Idle between its first and last action.
    pub wait_ms: f64,
    /// Mean duration of each action kind on this lane, ms (the simulator gets one
    /// factor per stage, so lanes whose B/F ratios differ are where theory drifts).
    pub mean_ms: BTreeMap<char, f64>,
}

/// Idle time, per step, that one lane spent waiting for one thing.
#[derive(Clone, Debug, PartialEq)]
pub struct Cause {
    pub rank: usize,
    pub stage: usize,
    /// e.g. "gradient from stage 3"; "warmup bubble", "cooldown bubble", or
    /// "runtime (no recorded wait)" for idle no wait explains.
    pub what: String,
    pub ms_per_step: f64,
}

/// What `trace summary` reports.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub path: PathBuf,
    pub meta: TraceMeta,
    /// Steps in the trace, and those the figures average over (step 0 left out as
    /// warmup when there are at least 3).
    pub steps: Vec<u64>,
    pub counted_steps: Vec<u64>,
    pub lanes: Vec<LaneSummary>,
    /// Mean over lanes of `bubble_frac`.
    pub bubble_frac: f64,
    /// Simulated mean bubble of the same schedule at the measured costs, if the
    /// schedule is known and builds.
    pub theory_bubble_frac: Option<f64>,
    /// Why there is no theory, when there is none.
    pub theory_note: Option<String>,
    /// The schedule's closed-form bubble at equal costs (1F1B's
    /// (p − 1)/(m + p − 1), …), where it has one: the textbook figure the
    /// measured and simulated ones are read against.
    pub closed_form_bubble_frac: Option<f64>,
    /// The simulated step (makespan), ms.
    pub theory_step_ms: Option<f64>,
    /// Median over counted steps of the step window (first action start to last action end), ms.
    pub step_ms: f64,
    /// The step whose window is the median one (what `render` draws by default).
    pub median_step: u64,
    /// Measured mean duration of F, B, I, W (ms), where present.
    pub mean_ms: BTreeMap<char, f64>,
    /// Costs the theory was simulated with (µs).
    pub costs: Costs,
    /// Of the median step (replica 0): actions from the first to the last-ending one.
    pub critical_path: Vec<Action>,
    /// Sum of the critical path's action durations, ms.
    pub critical_path_busy_ms: f64,
    /// Largest causes of idle time first.
    pub causes: Vec<Cause>,
    /// The lane with the most compute per step, with more than one lane.
    pub bottleneck: Option<Bottleneck>,
    /// What to keep in mind reading the figures (e.g. ranks sharing cores).
    pub notes: Vec<String>,
}

/// The busiest lane: the one whose compute bounds the step.
#[derive(Clone, Debug, PartialEq)]
pub struct Bottleneck {
    pub rank: usize,
    pub stage: usize,
    pub busy_ms: f64,
    /// Its busy time over the median lane's.
    pub vs_median: f64,
}

/// Splits `actions` by (replica, step).
fn by_step(actions: &[Span]) -> BTreeMap<(usize, u64), Vec<&Span>> {
    let mut out: BTreeMap<(usize, u64), Vec<&Span>> = BTreeMap::new();
    for a in actions {
        out.entry((a.replica, a.step)).or_default().push(a);
    }
    out
}

/// (start, end) of the step window over all lanes.
fn window(spans: &[&Span]) -> (f64, f64) {
    let start = spans.iter().map(|a| a.start_us).fold(f64::INFINITY, f64::min);
    let end = spans.iter().map(|a| a.end_us).fold(f64::NEG_INFINITY, f64::max);
    (start, end)
}

/// The lanes (ranks) of a trace and the stages each runs.
fn lanes(trace: &Trace) -> BTreeMap<usize, Vec<usize>> {
    let mut out: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for a in &trace.actions {
        let v = out.entry(a.rank).or_default();
        if !v.contains(&a.stage) {
            v.push(a.stage);
        }
    }
    for v in out.values_mut() {
        v.sort();
    }
    out
}

/// The median of `xs`; 0 when there is none.
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Measured mean costs (µs) and per-stage factors, for the simulator.
pub fn measured_costs(trace: &Trace, steps: &[u64]) -> Costs {
    let counted = |a: &&Span| steps.contains(&a.step);
    let mean_of = |k: ActionKind| {
        let d: Vec<f64> =
            trace.actions.iter().filter(counted).filter(|a| a.kind == Some(k)).map(Span::dur).collect();
        (!d.is_empty()).then(|| d.iter().sum::<f64>() / d.len() as f64)
    };
    let f = mean_of(ActionKind::F).unwrap_or(1.0);
    let b = mean_of(ActionKind::B);
    let i = mean_of(ActionKind::I);
    let w = mean_of(ActionKind::W);
    let b = b.unwrap_or(i.unwrap_or(f) + w.unwrap_or(f));
    let mut costs = Costs {
        forward: f,
        backward: b,
        backward_input: i.unwrap_or(b / 2.0),
        backward_weight: w.unwrap_or(b / 2.0),
        comm: 0.0,
        per_stage_factor: Vec::new(),
    };
    // A stage's factor: its measured time over what the mean costs would give it.
    let stages = trace.meta.stages.max(trace.actions.iter().map(|a| a.stage + 1).max().unwrap_or(1));
    let (mut measured, mut expected) = (vec![0.0; stages], vec![0.0; stages]);
    for a in trace.actions.iter().filter(counted) {
        if let Some(act) = a.action() {
            measured[a.stage] += a.dur();
            expected[a.stage] += costs.of(&act);
        }
    }
    costs.per_stage_factor =
        measured.iter().zip(&expected).map(|(m, e)| if *e > 0.0 { m / e } else { 1.0 }).collect();
    costs
}

/// The schedule of `trace` simulated at `costs`, or why not.
pub fn theory(trace: &Trace, costs: &Costs) -> Result<SimReport, String> {
    let name = trace.meta.schedule.as_deref().ok_or("the trace names no schedule")?;
    let kind: ScheduleKind = name.parse().map_err(|e: schedule::ScheduleError| e.to_string())?;
    let m = &trace.meta;
    let s = schedule::build(kind, m.pp, m.microbatches, m.chunks).map_err(|e| e.to_string())?;
    let mut costs = costs.clone();
    costs.per_stage_factor.resize(s.stages(), 1.0);
    s.simulate(&costs).map_err(|e| e.to_string())
}

/// The closed-form bubble of the trace's schedule, if it names one that
/// builds and has a formula.
fn closed_form(trace: &Trace) -> Option<f64> {
    let kind: ScheduleKind = trace.meta.schedule.as_deref()?.parse().ok()?;
    let m = &trace.meta;
    schedule::build(kind, m.pp, m.microbatches, m.chunks).ok()?.theory_bubble()
}

/// The actions the last-ending action of `spans` (one step of one replica) waited
/// on, walked back: at each action, whichever finished later of the lane's previous
/// action and the cross-stage producer (F(s−1, mb) for F, B/I(s+1, mb) for B/I).
/// Each move goes to a dependency, so the walk ends; no timestamp order is assumed
/// (a producer's span may end a few µs after its consumer's starts: it ends after its send).
fn critical_path(spans: &[&Span]) -> Vec<Action> {
    let mut by_action: BTreeMap<Action, &Span> = BTreeMap::new();
    let mut per_rank: BTreeMap<usize, Vec<&Span>> = BTreeMap::new();
    for s in spans {
        if let Some(a) = s.action() {
            by_action.insert(a, s);
        }
        per_rank.entry(s.rank).or_default().push(s);
    }
    for v in per_rank.values_mut() {
        v.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    }
    let Some(mut cur) = spans.iter().copied().max_by(|a, b| a.end_us.total_cmp(&b.end_us)) else {
        return vec![];
    };
    let mut path = vec![];
    while let Some(a) = cur.action() {
        path.push(a);
        let lane = &per_rank[&cur.rank];
        let pos = lane.iter().position(|s| std::ptr::eq(*s, cur)).unwrap_or(0);
        let prev = pos.checked_sub(1).map(|p| lane[p]);
        let producer = match a.kind {
            ActionKind::F => a.stage.checked_sub(1).and_then(|s| by_action.get(&Action::f(s, a.mb))),
            ActionKind::B | ActionKind::I => {
                let up = a.stage + 1;
                by_action.get(&Action::b(up, a.mb)).or_else(|| by_action.get(&Action::i(up, a.mb)))
            }
            ActionKind::W => by_action.get(&Action::i(a.stage, a.mb)),
        }
        .copied();
        let next = match (prev, producer) {
            (Some(p), Some(q)) => Some(if q.end_us > p.end_us { q } else { p }),
            (p, q) => p.or(q),
        };
        match next {
            Some(n) if path.len() <= spans.len() => cur = n,
            _ => break,
        }
    }
    path.reverse();
    path
}

/// Mean duration (ms) per action kind over the counted steps' actions that `keep`.
fn mean_action_ms(trace: &Trace, steps: &[u64], keep: impl Fn(&Span) -> bool) -> BTreeMap<char, f64> {
    let mut out = BTreeMap::new();
    for k in [ActionKind::F, ActionKind::B, ActionKind::I, ActionKind::W] {
        let d: Vec<f64> = trace
            .actions
            .iter()
            .filter(|a| a.kind == Some(k) && steps.contains(&a.step) && keep(a))
            .map(Span::dur)
            .collect();
        if !d.is_empty() {
            out.insert(k.letter(), d.iter().sum::<f64>() / d.len() as f64 / 1e3);
        }
    }
    out
}

/// Summarises `trace` (see the module comment).
pub fn summarize(trace: &Trace) -> Result<Summary, TraceError> {
    let steps_map = by_step(&trace.actions);
    let mut steps: Vec<u64> = steps_map.keys().map(|k| k.1).collect();
    steps.sort();
    steps.dedup();
    let counted_steps: Vec<u64> = if steps.len() >= 3 { steps[1..].to_vec() } else { steps.clone() };
    let lane_stages = lanes(trace);
    // Per lane: sums over counted (replica, step) of fractions and ms.
    #[derive(Default, Clone)]
    struct Acc {
        n: f64,
        busy_frac: f64,
        bubble_frac: f64,
        busy: f64,
        warmup: f64,
        cooldown: f64,
        wait: f64,
    }
    let mut acc: BTreeMap<usize, Acc> = BTreeMap::new();
    let mut causes: BTreeMap<(usize, String), f64> = BTreeMap::new();
    let mut windows: Vec<(u64, f64)> = vec![];
    let mut samples = 0.0;
    for ((replica, step), spans) in &steps_map {
        if !counted_steps.contains(step) {
            continue;
        }
        let (w0, w1) = window(spans);
        let len = w1 - w0;
        if len <= 0.0 {
            continue;
        }
        samples += 1.0;
        if *replica == 0 {
            windows.push((*step, len));
        }
        for &rank in lane_stages.keys() {
            let mine: Vec<&&Span> = spans.iter().filter(|s| s.rank == rank).collect();
            let busy: f64 = mine.iter().map(|s| s.dur()).sum();
            let first = mine.iter().map(|s| s.start_us).fold(w1, f64::min);
            let last = mine.iter().map(|s| s.end_us).fold(w0, f64::max).max(first);
            let (warmup, cooldown) = (first - w0, w1 - last);
            let wait = (len - busy - warmup - cooldown).max(0.0);
            let a = acc.entry(rank).or_default();
            a.n += 1.0;
            a.busy_frac += busy / len;
            a.bubble_frac += (len - busy) / len;
            a.busy += busy;
            a.warmup += warmup;
            a.cooldown += cooldown;
            a.wait += wait;
            *causes.entry((rank, "warmup bubble".into())).or_default() += warmup;
            *causes.entry((rank, "cooldown bubble".into())).or_default() += cooldown;
            // Waits inside [first, last] explain the mid-schedule idle.
            let mut explained = 0.0;
            for wt in
                trace.waits.iter().filter(|w| w.replica == *replica && w.step == *step && w.rank == rank)
            {
                let d = (wt.end_us.min(last) - wt.start_us.max(first)).max(0.0);
                if d > 0.0 {
                    let what = wt.detail.clone().unwrap_or_else(|| "(unnamed wait)".into());
                    *causes.entry((rank, what)).or_default() += d;
                    explained += d;
                }
            }
            *causes.entry((rank, "runtime (no recorded wait)".into())).or_default() +=
                (wait - explained).max(0.0);
        }
    }
    if samples == 0.0 {
        return Err(TraceError::Empty {
            path: trace.path.clone(),
            reason: "no step has a non-empty window".into(),
        });
    }
    let lanes: Vec<LaneSummary> = acc
        .iter()
        .map(|(&rank, a)| LaneSummary {
            stage: lane_stages[&rank][0],
            rank,
            stages: lane_stages[&rank].clone(),
            busy_frac: a.busy_frac / a.n,
            bubble_frac: a.bubble_frac / a.n,
            busy_ms: a.busy / a.n / 1e3,
            warmup_ms: a.warmup / a.n / 1e3,
            cooldown_ms: a.cooldown / a.n / 1e3,
            wait_ms: a.wait / a.n / 1e3,
            mean_ms: mean_action_ms(trace, &counted_steps, |s| s.rank == rank),
        })
        .collect();
    let bubble_frac = lanes.iter().map(|l| l.bubble_frac).sum::<f64>() / lanes.len() as f64;
    let step_ms = median(windows.iter().map(|w| w.1).collect()) / 1e3;
    let median_step = windows
        .iter()
        .min_by(|a, b| (a.1 - step_ms * 1e3).abs().total_cmp(&(b.1 - step_ms * 1e3).abs()))
        .map(|w| w.0)
        .unwrap_or(steps[0]);
    let costs = measured_costs(trace, &counted_steps);
    let (theory_bubble_frac, theory_step_ms, theory_note) = match theory(trace, &costs) {
        Ok(r) => (Some(r.mean_bubble_frac), Some(r.makespan / 1e3), None),
        Err(e) => (None, None, Some(e)),
    };
    let closed_form_bubble_frac = closed_form(trace);
    let mean_ms = mean_action_ms(trace, &counted_steps, |_| true);
    let median_spans = steps_map.get(&(0, median_step)).cloned().unwrap_or_default();
    let critical_path = critical_path(&median_spans);
    let critical_path_busy_ms = critical_path
        .iter()
        .filter_map(|a| median_spans.iter().find(|s| s.action() == Some(*a)))
        .map(|s| s.dur())
        .sum::<f64>()
        / 1e3;
    let mut causes: Vec<Cause> = causes
        .into_iter()
        .filter(|(_, t)| *t > 0.0)
        .map(|((rank, what), t)| Cause {
            rank,
            stage: lane_stages[&rank][0],
            what,
            ms_per_step: t / samples / 1e3,
        })
        .collect();
    causes.sort_by(|a, b| b.ms_per_step.total_cmp(&a.ms_per_step));
    let median_busy = median(lanes.iter().map(|l| l.busy_ms).collect());
    let bottleneck = lanes
        .iter()
        .filter(|_| lanes.len() > 1 && median_busy > 0.0)
        .max_by(|a, b| a.busy_ms.total_cmp(&b.busy_ms))
        .map(|l| Bottleneck {
            rank: l.rank,
            stage: l.stage,
            busy_ms: l.busy_ms,
            vs_median: l.busy_ms / median_busy,
        });
    let mut notes = vec![];
    let m = &trace.meta;
    if let (Some("cpu"), Some(cores), Some(threads)) = (m.backend.as_deref(), m.cores, m.compute_threads) {
        if threads > cores {
            notes.push(format!(
                "{threads} compute threads shared {cores} cores: contention inflates every action's \
                 measured cost (ranks > cores), so these costs, and the theory simulated from them, are \
                 this machine's time-sharing, not what a rank with a core of its own would take"
            ));
        }
    }
    Ok(Summary {
        path: trace.path.clone(),
        meta: trace.meta.clone(),
        steps,
        counted_steps,
        lanes,
        bubble_frac,
        theory_bubble_frac,
        theory_note,
        closed_form_bubble_frac,
        theory_step_ms,
        step_ms,
        median_step,
        mean_ms,
        costs,
        critical_path,
        critical_path_busy_ms,
        causes,
        bottleneck,
        notes,
    })
}

impl Summary {
    /// A lane's name: "stage 2", or "rank 1 (stages 1, 5)" with several chunks.
    pub fn lane_name(&self, lane: &LaneSummary) -> String {
        lane_name(lane.rank, &lane.stages)
    }

    /// The figures as JSON (`bubble_frac`, `theory_bubble_frac`, `step_ms`, `stages`, …).
    pub fn to_json(&self) -> Value {
        let m = &self.meta;
        json!({
            "trace": self.path.display().to_string(),
            "schedule": m.schedule, "pp": m.pp, "dp": m.dp, "replica": m.replica, "chunks": m.chunks,
            "microbatches": m.microbatches, "stage_count": m.stages,
            "steps": self.steps, "counted_steps": self.counted_steps,
            "bubble_frac": self.bubble_frac,
            "theory_bubble_frac": self.theory_bubble_frac,
            "theory_note": self.theory_note,
            "closed_form_bubble_frac": self.closed_form_bubble_frac,
            "step_ms": self.step_ms,
            "theory_step_ms": self.theory_step_ms,
            "median_step": self.median_step,
            "mean_action_ms": self.mean_ms.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "stages": self.lanes.iter().map(|l| json!({
                "stage": l.stage, "rank": l.rank, "stages": l.stages,
                "busy_frac": l.busy_frac, "bubble_frac": l.bubble_frac, "busy_ms": l.busy_ms,
                "warmup_ms": l.warmup_ms, "cooldown_ms": l.cooldown_ms, "wait_ms": l.wait_ms,
                "mean_action_ms": l.mean_ms.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            })).collect::<Vec<_>>(),
            "critical_path": self.critical_path.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            "critical_path_busy_ms": self.critical_path_busy_ms,
            "idle_causes": self.causes.iter().map(|c| json!({
                "stage": c.stage, "rank": c.rank, "what": c.what, "ms_per_step": c.ms_per_step,
            })).collect::<Vec<_>>(),
            "bottleneck": self.bottleneck.as_ref().map(|b| json!({
                "stage": b.stage, "rank": b.rank, "busy_ms": b.busy_ms, "vs_median": b.vs_median,
            })),
            "notes": self.notes,
        })
    }

    /// The report for people.
    pub fn text(&self) -> String {
        use std::fmt::Write;
        let m = &self.meta;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "{}: {} schedule, pp {}, dp {}{}, {} chunk(s) per rank, {} microbatches, steps {:?} (figures over {:?})",
            self.path.display(),
            m.schedule.as_deref().unwrap_or("unknown"),
            m.pp,
            m.dp,
            m.replica.map(|r| format!(" (replica {r} only)")).unwrap_or_default(),
            m.chunks,
            m.microbatches,
            self.steps,
            self.counted_steps
        );
        let means: Vec<String> = self.mean_ms.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
        let _ = writeln!(
            o,
            "step {:.2} ms (median, first action to last){}; mean action ms: {}",
            self.step_ms,
            self.theory_step_ms.map(|t| format!(", theory {t:.2} ms")).unwrap_or_default(),
            means.join(", ")
        );
        let _ = writeln!(
            o,
            "\n{:<22} {:>6} {:>7} {:>10} {:>11} {:>9}  mean action ms",
            "lane", "busy", "bubble", "warmup ms", "cooldown ms", "wait ms"
        );
        for l in &self.lanes {
            let _ = writeln!(
                o,
                "{:<22} {:>5.1}% {:>6.1}% {:>10.2} {:>11.2} {:>9.2}  {}",
                self.lane_name(l),
                100.0 * l.busy_frac,
                100.0 * l.bubble_frac,
                l.warmup_ms,
                l.cooldown_ms,
                l.wait_ms,
                l.mean_ms.iter().map(|(k, v)| format!("{k} {v:.2}")).collect::<Vec<_>>().join(", ")
            );
        }
        let theory = match (self.theory_bubble_frac, &self.theory_note) {
            (Some(t), _) => format!("{:.1}% (simulated at the measured costs)", 100.0 * t),
            (None, Some(n)) => format!("unknown ({n})"),
            (None, None) => "unknown".into(),
        };
        let closed = self
            .closed_form_bubble_frac
            .map(|c| format!("; closed form {:.1}% (equal costs, no messages)", 100.0 * c))
            .unwrap_or_default();
        let _ = writeln!(o, "\nbubble: measured {:.1}%, theory {theory}{closed}", 100.0 * self.bubble_frac);
        if let Some(b) = &self.bottleneck {
            let lane =
                self.lanes.iter().find(|l| l.rank == b.rank).map(|l| self.lane_name(l)).unwrap_or_default();
            let _ = writeln!(
                o,
                "bottleneck: {lane}, the busiest lane: {:.2} ms of compute per step, {:.2}× the median lane's",
                b.busy_ms, b.vs_median
            );
        }
        let path: Vec<String> = self.critical_path.iter().map(|a| a.to_string()).collect();
        let _ = writeln!(
            o,
            "critical path of step {} ({} actions, {:.2} ms of compute): {}",
            self.median_step,
            path.len(),
            self.critical_path_busy_ms,
            path.join(" → ")
        );
        let _ = writeln!(o, "top causes of idle time (ms per step):");
        for c in self.causes.iter().take(6) {
            let lane = lane_name(
                c.rank,
                &self.lanes.iter().find(|l| l.rank == c.rank).map_or(vec![], |l| l.stages.clone()),
            );
            let line = match c.what.as_str() {
                "warmup bubble" | "cooldown bubble" => format!("{lane} sat in its {}", c.what),
                "runtime (no recorded wait)" => format!("{lane} idle with no recorded wait (runtime)"),
                w => format!("{lane} waited for {w}"),
            };
            let _ = writeln!(o, "  {:>8.2} ms  {line}", c.ms_per_step);
        }
        for n in &self.notes {
            let _ = writeln!(o, "note: {n}");
        }
        o
    }
}

pub(crate) fn lane_name(rank: usize, stages: &[usize]) -> String {
    match stages {
        [s] if *s == rank => format!("stage {s}"),
        _ => format!(
            "rank {rank} (stages {})",
            stages.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{chrome_json, Record};

    fn rec(stage: usize, name: &str, step: u64, mb: Option<usize>, start: f64, dur: f64) -> Record {
        Record {
            replica: 0,
            stage,
            rank: stage,
            name: name.into(),
            step,
            mb,
            start_us: start,
            dur_us: dur,
            detail: (name == "wait").then(|| format!("gradient from stage {}", stage + 1)),
            ..Record::default()
        }
    }

    fn summary_of(records: &[Record], meta: Value) -> Summary {
        let text = chrome_json(records, meta).to_string();
        summarize(&parse(&text, Path::new("synthetic.json")).unwrap()).unwrap()
    }

    #[test]
    fn hand_built_trace_gives_exact_busy_and_bubble_fractions() {
        // Two stages, one microbatch, 1 ms per action: window 0..4 ms.
        // Stage 0: F0 0..1, waits 1..3 for the gradient, B0 3..4 → busy 2, wait 2.
        // Stage 1: F0 1..2, B0 2..3 → busy 2, warmup 1, cooldown 1.
        let r = vec![
            rec(0, "F", 0, Some(0), 0.0, 1000.0),
            rec(0, "wait", 0, Some(0), 1000.0, 2000.0),
            rec(1, "F", 0, Some(0), 1000.0, 1000.0),
            rec(1, "B", 0, Some(0), 2000.0, 1000.0),
            rec(0, "B", 0, Some(0), 3000.0, 1000.0),
        ];
        let s = summary_of(&r, json!({"schedule": "1f1b", "pp": 2, "dp": 1, "chunks": 1, "microbatches": 1}));
        assert_eq!(s.lanes.len(), 2);
        assert_eq!(s.lanes[0].busy_frac, 0.5);
        assert_eq!(s.lanes[0].bubble_frac, 0.5);
        assert_eq!(s.lanes[0].wait_ms, 2.0);
        assert_eq!(s.lanes[0].warmup_ms, 0.0);
        assert_eq!(s.lanes[1].warmup_ms, 1.0);
        assert_eq!(s.lanes[1].cooldown_ms, 1.0);
        assert_eq!(s.lanes[1].wait_ms, 0.0);
        assert_eq!(s.bubble_frac, 0.5);
        assert_eq!(s.step_ms, 4.0);
        // Theory at F = 1, B = 1 ms: the same 0.5.
        assert!((s.theory_bubble_frac.unwrap() - 0.5).abs() < 1e-12);
        // And 1F1B's closed form, (p − 1)/(m + p − 1) = 1/2, beside them.
        assert_eq!(s.closed_form_bubble_frac, Some(0.5));
        assert!(s.text().contains(
            "bubble: measured 50.0%, theory 50.0% (simulated at the measured costs); \
             closed form 50.0% (equal costs, no messages)"
        ));
        assert_eq!(s.to_json()["closed_form_bubble_frac"], 0.5);
        assert_eq!(
            s.critical_path.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            ["0F0", "1F0", "1B0", "0B0"]
        );
        assert_eq!(s.causes[0].what, "gradient from stage 1");
        assert_eq!(s.causes[0].ms_per_step, 2.0);
    }

    #[test]
    fn step_zero_is_left_out_as_warmup_from_three_steps_on() {
        let mut r = vec![];
        for step in 0..3u64 {
            let t0 = step as f64 * 10_000.0;
            // Step 0 is slow on stage 1 (idle on stage 0), the others are not.
            let d1 = if step == 0 { 5000.0 } else { 1000.0 };
            r.push(rec(0, "F", step, Some(0), t0, 1000.0));
            r.push(rec(1, "F", step, Some(0), t0 + 1000.0, d1));
            r.push(rec(1, "B", step, Some(0), t0 + 1000.0 + d1, 1000.0));
            r.push(rec(0, "B", step, Some(0), t0 + 2000.0 + d1, 1000.0));
        }
        let s = summary_of(&r, json!({"schedule": "1f1b", "pp": 2, "microbatches": 1}));
        assert_eq!(s.counted_steps, vec![1, 2]);
        assert_eq!(s.bubble_frac, 0.5);
        assert_eq!(s.step_ms, 4.0);
    }

    #[test]
    fn one_replica_of_a_dp_trace_is_summarized_alone() {
        // Replica 0 takes 1 ms an action (window 4 ms); replica 1's first
        // forward takes 3 ms, so its window is 6 ms and its lanes' shares differ.
        let mut r = vec![
            rec(0, "F", 0, Some(0), 0.0, 1000.0),
            rec(1, "F", 0, Some(0), 1000.0, 1000.0),
            rec(1, "B", 0, Some(0), 2000.0, 1000.0),
            rec(0, "B", 0, Some(0), 3000.0, 1000.0),
        ];
        for (stage, kind, start, dur) in [
            (0, "F", 0.0, 3000.0),
            (1, "F", 3000.0, 1000.0),
            (1, "B", 4000.0, 1000.0),
            (0, "B", 5000.0, 1000.0),
        ] {
            r.push(Record { replica: 1, ..rec(stage, kind, 0, Some(0), start, dur) });
        }
        let meta = json!({"schedule": "1f1b", "pp": 2, "dp": 2, "chunks": 1, "microbatches": 1});
        let trace = parse(&chrome_json(&r, meta).to_string(), Path::new("dp.json")).unwrap();
        let one = summarize(&trace.clone().replica(1).unwrap()).unwrap();
        // Window 0..6 ms: stage 0 busy 4 of 6, stage 1 busy 2 of 6.
        assert_eq!(one.step_ms, 6.0);
        assert_eq!((one.lanes[0].busy_frac, one.lanes[1].busy_frac), (4.0 / 6.0, 2.0 / 6.0));
        assert!(one.text().contains("dp 2 (replica 1 only)"), "{}", one.text());
        assert_eq!(one.to_json()["replica"], 1);
        let zero = summarize(&trace.clone().replica(0).unwrap()).unwrap();
        assert_eq!(zero.step_ms, 4.0);
        let e = trace.replica(2).unwrap_err().to_string();
        assert!(e.contains("dp.json") && e.contains("--replica 2") && e.contains("2 data-parallel"), "{e}");
    }

    #[test]
    fn corrupt_json_is_an_error_naming_the_file() {
        let e = parse("{\"traceEvents\": [", Path::new("/x/broken.json")).unwrap_err();
        assert!(e.to_string().contains("/x/broken.json"), "{e}");
        let e = parse("{\"traceEvents\": []}", Path::new("/x/empty.json")).unwrap_err();
        assert!(e.to_string().contains("/x/empty.json") && e.to_string().contains("no actions"), "{e}");
    }
}
