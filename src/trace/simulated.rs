//! A schedule's simulated timeline written as a trace, in the same Chrome format a
//! run writes, so theory and measurement open side by side (and `trace summary`
//! reads both). Pure: builds JSON, writes nothing.

use super::{chrome_json, Record};
use crate::schedule::{self, Costs, Schedule, ScheduleError, ScheduleKind};
use serde_json::{json, Value};

/// The Chrome trace of `kind` for p = `ranks`, m = `microbatches`, v = `chunks`,
/// simulated at `costs` (in ms; unit costs F = 1, B = 2, I = W = 1 ms by default).
pub fn schedule_trace(
    kind: ScheduleKind,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
    costs_ms: &Costs,
) -> Result<Value, ScheduleError> {
    let s = schedule::build(kind, ranks, microbatches, chunks)?;
    let report = s.simulate(costs_ms)?;
    Ok(chrome_json(&simulated_records(&s, &report, 1e3), simulated_meta(&s, costs_ms, 1e3)))
}

/// Records of a simulated schedule (replica 0, step 0), `unit_us` µs per cost unit:
/// what `pipewright schedule --trace` writes.
pub fn simulated_records(s: &Schedule, report: &schedule::SimReport, unit_us: f64) -> Vec<Record> {
    let mut out = vec![];
    for (rank, lane) in report.timeline.iter().enumerate() {
        for (a, start, end) in lane {
            out.push(Record {
                replica: 0,
                stage: a.stage,
                rank,
                name: a.kind.letter().to_string(),
                step: 0,
                mb: Some(a.mb),
                start_us: start * unit_us,
                dur_us: (end - start) * unit_us,
                ..Record::default()
            });
        }
    }
    debug_assert!(out.iter().all(|r| s.rank_of(r.stage) == r.rank));
    out
}

/// The "metadata" object for a simulated schedule's trace.
pub fn simulated_meta(s: &Schedule, costs: &Costs, unit_us: f64) -> Value {
    json!({
        "schedule": s.kind.name(), "pp": s.ranks, "dp": 1, "chunks": s.chunks,
        "microbatches": s.microbatches, "steps": 1, "stages": s.stages(), "simulated": true,
        "costs_ms": {"F": costs.forward * unit_us / 1e3, "B": costs.backward * unit_us / 1e3,
            "I": costs.backward_input * unit_us / 1e3, "W": costs.backward_weight * unit_us / 1e3,
            "comm": costs.comm * unit_us / 1e3},
    })
}

/// The longest `--costs` entry, in ms (an hour): the makespan sums costs
/// over every action, and 1e308 twice is infinity.
pub const MAX_COST_MS: f64 = 3_600_000.0;

/// `--costs` of `pipewright schedule`: F,B or F,B,I,W in ms (I and W default to
/// half of B), each in (0, [`MAX_COST_MS`]]; none gives unit costs.
pub fn cli_costs(costs_ms: &[f64]) -> Result<Costs, ScheduleError> {
    let bad = |reason: String| ScheduleError::Unsupported { field: "--costs".into(), reason };
    if let Some(x) = costs_ms.iter().find(|x| !(**x > 0.0 && **x <= MAX_COST_MS)) {
        return Err(bad(format!("{x:?}: every cost must be a number of ms > 0 and at most {MAX_COST_MS}")));
    }
    let mut costs = Costs::unit();
    match *costs_ms {
        [] => {}
        [f, b] => {
            (costs.forward, costs.backward, costs.backward_input, costs.backward_weight) =
                (f, b, b / 2.0, b / 2.0)
        }
        [f, b, i, w] => {
            (costs.forward, costs.backward, costs.backward_input, costs.backward_weight) = (f, b, i, w)
        }
        _ => return Err(bad(format!("expected F,B or F,B,I,W in ms, got {} numbers", costs_ms.len()))),
    }
    Ok(costs)
}

fn parse_kind(kind: &str, chunks: Option<usize>) -> Result<(ScheduleKind, usize), ScheduleError> {
    let kind: ScheduleKind = kind.parse()?;
    Ok((kind, chunks.unwrap_or(kind.default_chunks())))
}

/// `pipewright schedule --trace`: like [`schedule_trace`], with `chunks` defaulting
/// as the schedule command does (2 for interleaved and zb-v, else 1) and `costs_ms` as
/// [`cli_costs`] reads them.
pub fn cli_trace(
    kind: &str,
    ranks: usize,
    microbatches: usize,
    chunks: Option<usize>,
    costs_ms: &[f64],
) -> Result<Value, ScheduleError> {
    let costs = cli_costs(costs_ms)?;
    let (kind, chunks) = parse_kind(kind, chunks)?;
    schedule_trace(kind, ranks, microbatches, chunks, &costs)
}

/// `pipewright schedule --costs …`: the schedule's grid simulated at those costs
/// (the grid `schedule` prints draws unit costs).
pub fn cli_grid(
    kind: &str,
    ranks: usize,
    microbatches: usize,
    chunks: Option<usize>,
    costs_ms: &[f64],
) -> Result<String, ScheduleError> {
    let costs = cli_costs(costs_ms)?;
    let (kind, chunks) = parse_kind(kind, chunks)?;
    let s = schedule::build(kind, ranks, microbatches, chunks)?;
    s.validate()?;
    let report = s.simulate(&costs)?;
    Ok(s.grid(&report) + &s.transports(&costs))
}
