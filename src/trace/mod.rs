//! Traces of a run in the Chrome Trace Event format, which Perfetto and
//! chrome://tracing open: a process per data-parallel replica (and per node
//! when the run spans processes), a thread per pipeline stage, a complete event
//! per action, spans for sends, waits, reduction, optimizer and checkpoints,
//! instants for receives, flows between stages, and counters of live
//! activations and the bytes they hold.
//!
//! Records are `tracing` spans and events that the record layer (`layer`) files
//! under their run (nothing is made when tracing is off); each stage takes its
//! own out at the end and the coordinator gathers every replica's records and
//! writes one file. Timestamps are microseconds from one `Instant` shared by
//! the actors of a process; other processes shift their epoch onto rank 0's
//! clock when they join (`cluster`), so lanes line up across processes too.

pub mod layer;
pub mod render;
pub mod simulated;
pub mod summary;

pub use layer::RunTrace;

use serde::{Deserialize, Serialize};
use std::time::Instant;

/// One recorded span or instant, before it becomes Chrome JSON.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Record {
    pub replica: usize,
    /// The process that recorded it (0 in a one-process run).
    pub node: usize,
    pub stage: usize,
    pub rank: usize,
    /// "F", "B", "I", "W" (actions); "wait", "send", "recv" (an instant: when a
    /// message reached the stage's actor), "optimizer", "reduce", "tied", "gather"
    /// (ZeRO-1's updated shards), "eval", "checkpoint" (a stage copying its state)
    /// or "checkpoint write".
    pub name: String,
    pub step: u64,
    /// Microbatch for actions and for waits, sends and receives of one microbatch.
    pub mb: Option<usize>,
    pub start_us: f64,
    pub dur_us: f64,
    /// What a wait waited for, e.g. "activation from stage 1"; what a send sent.
    pub detail: Option<String>,
    /// For sends and receives: the stage at the other end.
    pub peer: Option<usize>,
    /// Live activations (microbatches between F and the end of their backward) on
    /// `stage` after this record, and the bytes they hold.
    pub live: Option<(usize, usize)>,
    /// Set when an actor other than a stage recorded it (the checkpointer): it gets
    /// a thread of its own in replica 0's process.
    pub actor: Option<String>,
}

/// A stage's handle on its run's trace: the spans and instants it records
/// carry its replica and rank, and nothing is made when tracing is off.
pub struct Recorder {
    run: Option<RunTrace>,
    replica: usize,
    rank: usize,
}

impl Recorder {
    pub fn new(run: Option<RunTrace>, replica: usize, rank: usize) -> Self {
        Recorder { run, replica, rank }
    }

    pub fn enabled(&self) -> bool {
        self.run.is_some()
    }

    /// A span on `stage`, recorded from now until it is dropped; `peer` is the
    /// stage at the other end of a send. `Span::none()` when not tracing.
    pub fn span(
        &self,
        stage: usize,
        kind: &'static str,
        step: u64,
        mb: Option<usize>,
        detail: Option<&str>,
        peer: Option<usize>,
    ) -> tracing::Span {
        let Some(run) = &self.run else { return tracing::Span::none() };
        let (replica, rank) = (self.replica, self.rank);
        tracing::trace_span!(target: layer::TARGET, "record", run = run.id(), replica, rank, stage, kind, step, mb,
            detail, peer, live_n = tracing::field::Empty, live_bytes = tracing::field::Empty)
    }

    /// A receive instant on `stage`: when `what` of microbatch `mb` from
    /// stage `from` reached the stage's actor, however long it then waited in
    /// the inbox.
    pub fn recv(&self, step: u64, stage: usize, from: usize, mb: usize, arrived: Instant, what: &str) {
        let Some(run) = &self.run else { return };
        let (replica, rank, at_us) = (self.replica, self.rank, run.us_of(arrived));
        let detail = format!("{what} from stage {from}");
        tracing::trace!(target: layer::TARGET, run = run.id(), replica, rank, stage, kind = "recv", step, mb, at_us,
            detail = detail.as_str(), peer = from);
    }

    /// Takes this stage's records out of the run's trace.
    pub fn take(&self) -> Vec<Record> {
        let Some(run) = &self.run else { return Vec::new() };
        run.take(|r| r.actor.is_none() && r.replica == self.replica && r.rank == self.rank)
    }
}

/// Whether a record is an action (F, B, I or W).
pub fn is_action(name: &str) -> bool {
    matches!(name, "F" | "B" | "I" | "W")
}

/// A time inside the span [start, start + dur], at most `EDGE` µs in from its
/// ends: Perfetto binds a flow event to the slice that encloses it, and a
/// timestamp exactly on a slice's edge may bind to nothing.
fn inside(start: f64, dur: f64, t: f64) -> f64 {
    const EDGE: f64 = 1.0;
    let e = EDGE.min(dur / 2.0);
    t.clamp(start + e, start + dur - e)
}

/// Chrome Trace Event JSON of `records`; `meta` goes under "metadata"
/// (schedule, layout, config) so `trace summary` can compare with theory.
///
/// A process per (replica, node): pid `k` is the k-th pair in (replica, node)
/// order, so a one-process run has pid = replica. A thread per stage (tid =
/// stage), and one per other actor (tid 1000 + k). Flows start inside the
/// producer's send span (or its last µs when there is none) and end inside the
/// consumer's action, never before they start.
pub fn chrome_json(records: &[Record], meta: serde_json::Value) -> serde_json::Value {
    use serde_json::json;
    use std::collections::BTreeMap;
    let mut events = Vec::new();
    let mut procs: Vec<(usize, usize)> = records.iter().map(|r| (r.replica, r.node)).collect();
    procs.sort();
    procs.dedup();
    let multi_node = procs.iter().any(|p| p.1 > 0);
    let pid_of = |r: &Record| procs.binary_search(&(r.replica, r.node)).unwrap_or(0);
    for (pid, (replica, node)) in procs.iter().enumerate() {
        let name = if multi_node {
            format!("replica {replica} · node {node}")
        } else {
            format!("replica {replica}")
        };
        events.push(json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}));
        events
            .push(json!({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}));
    }
    let mut actors: Vec<&str> = records.iter().filter_map(|r| r.actor.as_deref()).collect();
    actors.sort();
    actors.dedup();
    let tid_of = |r: &Record| match &r.actor {
        Some(a) => 1000 + actors.iter().position(|x| x == a).unwrap_or(0),
        None => r.stage,
    };
    let mut threads: Vec<(usize, usize, String)> = records
        .iter()
        .map(|r| {
            let name = match &r.actor {
                Some(a) => a.clone(),
                None => format!("stage {} (rank {})", r.stage, r.rank),
            };
            (pid_of(r), tid_of(r), name)
        })
        .collect();
    threads.sort();
    threads.dedup();
    for (pid, tid, name) in &threads {
        events
            .push(json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}));
        events.push(
            json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}),
        );
    }
    for r in records {
        let (pid, tid) = (pid_of(r), tid_of(r));
        let action = is_action(&r.name);
        let name = match (action, r.mb) {
            (true, Some(mb)) => format!("{}{}", r.name, mb),
            _ => r.name.clone(),
        };
        let mut args =
            json!({"step": r.step, "stage": r.stage, "rank": r.rank, "replica": r.replica, "node": r.node});
        if let Some(mb) = r.mb {
            args["mb"] = mb.into();
        }
        if let Some(d) = &r.detail {
            args["detail"] = d.clone().into();
        }
        if let Some(p) = r.peer {
            args[if r.name == "send" { "to_stage" } else { "from_stage" }] = p.into();
        }
        let cat = if action { "action" } else { r.name.as_str() };
        if r.name == "recv" {
            events.push(json!({"ph": "i", "s": "t", "name": name, "cat": cat, "pid": pid, "tid": tid,
                "ts": r.start_us, "args": args}));
        } else {
            events.push(json!({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
                "ts": r.start_us, "dur": r.dur_us, "args": args}));
        }
        if let Some((n, bytes)) = r.live {
            let ts = r.start_us + r.dur_us;
            events.push(json!({"ph": "C", "name": format!("live activations, stage {}", r.stage),
                "pid": pid, "tid": tid, "ts": ts, "args": {"microbatches": n}}));
            events.push(json!({"ph": "C", "name": format!("activation bytes, stage {}", r.stage),
                "pid": pid, "tid": tid, "ts": ts, "args": {"bytes": bytes}}));
        }
    }
    // Flows: a microbatch's F on stage k to its F on k+1, and B (or I) on k+1 to k.
    let mut index = BTreeMap::new();
    let mut sends = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        if let (Some(mb), Some(class)) = (r.mb, flow_class(&r.name)) {
            index.insert((r.replica, r.step, r.stage, class, mb), i);
        }
        if let (Some(mb), Some(to), "send") = (r.mb, r.peer, r.name.as_str()) {
            sends.insert((r.replica, r.step, r.stage, to, mb), i);
        }
    }
    let (mut id, mut adjusted) = (0u64, 0u64);
    for r in records {
        let (Some(mb), Some(class)) = (r.mb, flow_class(&r.name)) else { continue };
        let target = match class {
            0 => Some(r.stage + 1),
            _ => r.stage.checked_sub(1),
        };
        let Some(t) = target else { continue };
        let Some(&j) = index.get(&(r.replica, r.step, t, class, mb)) else { continue };
        let n = &records[j];
        let mut start = match sends.get(&(r.replica, r.step, r.stage, t, mb)) {
            Some(&k) => inside(records[k].start_us, records[k].dur_us, records[k].start_us),
            None => inside(r.start_us, r.dur_us, r.start_us + r.dur_us),
        };
        let mut end = inside(n.start_us, n.dur_us, n.start_us);
        if end < start {
            // Only clocks that disagree (processes aligned to within half a round
            // trip) get here: the arrow starts earlier in its own slice.
            adjusted += 1;
            start = end.max(inside(r.start_us, r.dur_us, r.start_us));
            end = end.max(start);
        }
        id += 1;
        let cat = if class == 0 { "activation" } else { "gradient" };
        events.push(json!({"ph": "s", "id": id, "name": cat, "cat": cat, "pid": pid_of(r), "tid": tid_of(r),
            "ts": start}));
        events.push(json!({"ph": "f", "bp": "e", "id": id, "name": cat, "cat": cat, "pid": pid_of(n),
            "tid": tid_of(n), "ts": end}));
    }
    let mut meta = meta;
    if let Some(m) = meta.as_object_mut() {
        m.insert("flows".into(), id.into());
        m.insert("flows_moved_for_clock_skew".into(), adjusted.into());
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms", "metadata": meta})
}

/// Which flow a record starts: 0 = activation (F), 1 = gradient (B or I).
fn flow_class(name: &str) -> Option<u8> {
    match name {
        "F" => Some(0),
        "B" | "I" => Some(1),
        _ => None,
    }
}
