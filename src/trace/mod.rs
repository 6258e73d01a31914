//! Traces of a run in the Chrome Trace Event format, which Perfetto and
//! chrome://tracing open: a process per data-parallel replica, a thread per
//! pipeline stage, a complete event per action, flows between stages, and
//! counters of live activations.
//!
//! Stages record into their own `Recorder` (a plain Vec, no locks, nothing when
//! tracing is off); the coordinator gathers the records at the end and writes
//! one file. All timestamps are microseconds from one `Instant` shared by every
//! actor of the run, so lanes line up without clock alignment.

pub mod render;
pub mod simulated;
pub mod summary;

use serde::{Deserialize, Serialize};
use std::time::Instant;

/// One recorded span or instant, before it becomes Chrome JSON.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Record {
    pub replica: usize,
    pub stage: usize,
    pub rank: usize,
    /// "F", "B", "I", "W" (actions) or "wait", "send", "optimizer", "reduce", "tied", "eval".
    pub name: String,
    pub step: u64,
    /// Microbatch for actions and waits on a microbatch.
    pub mb: Option<usize>,
    pub start_us: f64,
    pub dur_us: f64,
    /// What a wait waited for, e.g. "activation from stage 1".
    pub detail: Option<String>,
    /// Live activations (microbatches between F and the end of their backward) on
    /// `stage` after this record, and the bytes they hold.
    pub live: Option<(usize, usize)>,
}

/// A stage's trace buffer.
pub struct Recorder {
    pub enabled: bool,
    pub epoch: Instant,
    pub records: Vec<Record>,
}

impl Recorder {
    pub fn new(enabled: bool, epoch: Instant) -> Self {
        Recorder { enabled, epoch, records: Vec::new() }
    }

    pub fn now_us(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e6
    }

    /// Records a span that started at `start_us` and ends now.
    #[allow(clippy::too_many_arguments)]
    pub fn span(
        &mut self,
        replica: usize,
        rank: usize,
        stage: usize,
        name: &str,
        step: u64,
        mb: Option<usize>,
        start_us: f64,
        detail: Option<String>,
        live: Option<(usize, usize)>,
    ) {
        if !self.enabled {
            return;
        }
        let end = self.now_us();
        self.records.push(Record {
            replica,
            stage,
            rank,
            name: name.to_string(),
            step,
            mb,
            start_us,
            dur_us: (end - start_us).max(0.0),
            detail,
            live,
        });
    }
}

/// Chrome Trace Event JSON of `records`; `meta` goes under "metadata"
/// (schedule, layout, config) so `trace summary` can compare with theory.
pub fn chrome_json(records: &[Record], meta: serde_json::Value) -> serde_json::Value {
    use serde_json::json;
    let mut events = Vec::new();
    let mut lanes: Vec<(usize, usize, usize)> =
        records.iter().map(|r| (r.replica, r.stage, r.rank)).collect();
    lanes.sort();
    lanes.dedup();
    let mut replicas: Vec<usize> = lanes.iter().map(|l| l.0).collect();
    replicas.dedup();
    for p in replicas {
        events.push(
            json!({"ph": "M", "name": "process_name", "pid": p, "args": {"name": format!("replica {p}")}}),
        );
        events.push(json!({"ph": "M", "name": "process_sort_index", "pid": p, "args": {"sort_index": p}}));
    }
    for (p, s, r) in &lanes {
        events.push(json!({"ph": "M", "name": "thread_name", "pid": p, "tid": s,
            "args": {"name": format!("stage {s} (rank {r})")}}));
        events.push(
            json!({"ph": "M", "name": "thread_sort_index", "pid": p, "tid": s, "args": {"sort_index": s}}),
        );
    }
    for r in records {
        let action = matches!(r.name.as_str(), "F" | "B" | "I" | "W");
        let name = match (action, r.mb) {
            (true, Some(mb)) => format!("{}{}", r.name, mb),
            _ => r.name.clone(),
        };
        let mut args = json!({"step": r.step, "stage": r.stage, "rank": r.rank});
        if let Some(mb) = r.mb {
            args["mb"] = mb.into();
        }
        if let Some(d) = &r.detail {
            args["detail"] = d.clone().into();
        }
        let cat = if action { "action" } else { r.name.as_str() };
        events.push(json!({"ph": "X", "name": name, "cat": cat, "pid": r.replica, "tid": r.stage,
            "ts": r.start_us, "dur": r.dur_us, "args": args}));
        if let Some((n, bytes)) = r.live {
            events.push(json!({"ph": "C", "name": format!("live activations, stage {}", r.stage),
                "pid": r.replica, "tid": r.stage, "ts": r.start_us + r.dur_us,
                "args": {"microbatches": n, "MiB": bytes as f64 / (1 << 20) as f64}}));
        }
    }
    // Flows: a microbatch's F on stage k to its F on k+1, and B (or I) on k+1 to k.
    let mut index = std::collections::BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        if let (Some(mb), Some(class)) = (r.mb, flow_class(&r.name)) {
            index.insert((r.replica, r.step, r.stage, class, mb), i);
        }
    }
    let mut id = 0u64;
    for r in records {
        let (Some(mb), Some(class)) = (r.mb, flow_class(&r.name)) else { continue };
        let target = match class {
            0 => Some(r.stage + 1),
            _ => r.stage.checked_sub(1),
        };
        let Some(&j) = target.and_then(|t| index.get(&(r.replica, r.step, t, class, mb))) else { continue };
        let n = &records[j];
        id += 1;
        let cat = if class == 0 { "activation" } else { "gradient" };
        events.push(json!({"ph": "s", "id": id, "name": cat, "cat": cat, "pid": r.replica, "tid": r.stage,
            "ts": r.start_us + r.dur_us}));
        events.push(json!({"ph": "f", "bp": "e", "id": id, "name": cat, "cat": cat, "pid": n.replica,
            "tid": n.stage, "ts": n.start_us}));
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
