//! A schedule's timeline as text: one row per rank, one column per time slot.
//!
//! ```text
//! rank 0 | F0 F1 F2 F3 .  .  .  B0 -- F4 B1 -- …
//! ```
//! A column is the shortest action's duration (one time unit with unit costs); an
//! action longer than that spans several columns (`B0 --`); `.` is a bubble. With
//! v > 1 the stage is written too (`4F0`). A summary follows: makespan, bubble
//! fraction per rank and mean, the theory where known, peak live per stage, and
//! whether the schedule runs with each transport ([`Schedule::transports`]).

use super::{Costs, Schedule, ScheduleError, ScheduleKind, SimReport, Transport};
use std::fmt::Write;

/// Columns beyond this are merged into coarser slots.
const MAX_COLUMNS: f64 = 400.0;

impl Schedule {
    /// Draws `report` (from [`Schedule::simulate`] of this schedule).
    pub fn grid(&self, report: &SimReport) -> String {
        let label = |a: &super::Action| {
            if self.chunks > 1 {
                a.to_string()
            } else {
                format!("{}{}", a.kind, a.mb)
            }
        };
        let shortest = report
            .timeline
            .iter()
            .flatten()
            .map(|(_, s, e)| e - s)
            .filter(|d| *d > 0.0)
            .fold(f64::INFINITY, f64::min);
        let mut slot = if shortest.is_finite() { shortest } else { 1.0 };
        if report.makespan / slot > MAX_COLUMNS {
            slot = report.makespan / MAX_COLUMNS;
        }
        let columns = (report.makespan / slot).round() as usize;
        let width = report.timeline.iter().flatten().map(|(a, ..)| label(a).len()).max().unwrap_or(1);

        let mut out = String::new();
        let rank_w = (self.ranks.saturating_sub(1)).to_string().len();
        for (r, line) in report.timeline.iter().enumerate() {
            // Per column: the label of the action starting there, or a continuation.
            let mut cells: Vec<Option<String>> = vec![None; columns];
            for (a, start, end) in line {
                let c0 = ((start / slot).round() as usize).min(columns.saturating_sub(1));
                let c1 = ((end / slot).round() as usize).clamp(c0 + 1, columns.max(c0 + 1));
                for (c, cell) in cells.iter_mut().enumerate().take(c1).skip(c0) {
                    *cell = Some(if c == c0 { label(a) } else { "-".repeat(width) });
                }
            }
            let row: Vec<String> =
                cells.into_iter().map(|c| format!("{:<width$}", c.unwrap_or_else(|| ".".into()))).collect();
            writeln!(out, "rank {r:>rank_w$} | {}", row.join(" ").trim_end()).unwrap();
        }

        let (p, m, v) = (self.ranks, self.microbatches, self.chunks);
        writeln!(out).unwrap();
        writeln!(
            out,
            "{}: {p} rank(s) × {v} chunk(s) = {} stage(s), {m} microbatch(es); one column = {} time unit(s)",
            self.kind,
            self.stages(),
            fmt_num(slot)
        )
        .unwrap();
        writeln!(out, "makespan: {}", fmt_num(report.makespan)).unwrap();
        let per_rank: Vec<String> =
            report.bubble_frac.iter().enumerate().map(|(r, b)| format!("{r}: {b:.4}")).collect();
        writeln!(out, "bubble fraction per rank: {}", per_rank.join(", ")).unwrap();
        write!(out, "bubble fraction mean: {:.4}", report.mean_bubble_frac).unwrap();
        if let Some(t) = self.theory_bubble() {
            let formula = match self.kind {
                ScheduleKind::GPipe | ScheduleKind::OneFOneB => "(p−1)/(m+p−1)",
                ScheduleKind::Interleaved1F1B => "≈ (p−1)/(v·m), bubble over ideal time",
                ScheduleKind::ZbH1 => "(p−1)/(3m+p−1) for m ≥ p: a third of 1F1B's bubble time",
                ScheduleKind::ZbV => "(p−1)/(6m+p−1), the lower bound: a sixth of 1F1B's bubble time",
                ScheduleKind::DualPipeV => {
                    "(p−1)/(6m+p−1), ZB-V's bound; DeepSeek's (p−1)(F&B+B−3W) counts each F&B pair as one block: 2(p−1)"
                }
                ScheduleKind::Custom => "",
            };
            write!(out, " (theory with unit costs: {t:.4}, {formula})").unwrap();
        }
        writeln!(out).unwrap();
        let peaks: Vec<String> =
            report.peak_live.iter().enumerate().map(|(s, n)| format!("{s}: {n}")).collect();
        writeln!(out, "peak live microbatches per stage: {}", peaks.join(", ")).unwrap();
        if self.chunks > 1 {
            let peaks: Vec<String> =
                report.peak_live_rank.iter().enumerate().map(|(r, n)| format!("{r}: {n}")).collect();
            writeln!(
                out,
                "peak live stage-microbatches per rank (each 1/{} of a rank's layers): {}",
                self.chunks,
                peaks.join(", ")
            )
            .unwrap();
        }
        out
    }

    /// One line per transport: whether the schedule runs with buffered sends (the
    /// actor runtime's) and with rendezvous sends (a send completes only when the
    /// receiver posts its receive: NCCL-style send/recv issued one at a time), and
    /// where it deadlocks if not.
    pub fn transports(&self, costs: &Costs) -> String {
        let line = |t: Transport| match self.simulate_with(costs, t) {
            Ok(_) => "deadlock-free".to_string(),
            Err(ScheduleError::Deadlock { waiting }) => {
                let first = &waiting[0];
                let all: Vec<String> = waiting.iter().map(|w| w.to_string()).collect();
                format!(
                    "deadlocks at rank {} step {} ({}): {}",
                    first.rank,
                    first.index,
                    first.action,
                    all.join("; ")
                )
            }
            Err(e) => format!("refused: {e}"),
        };
        let mut out = format!("buffered sends (the actor runtime): {}\n", line(Transport::Buffered));
        let rendezvous = line(Transport::Rendezvous);
        let hint = if rendezvous.starts_with("deadlocks") {
            " — on such a transport, pair each send with the receive it waits on \
             (Megatron-LM's send_forward_recv_backward) or post sends asynchronously"
        } else {
            ""
        };
        out += &format!("rendezvous sends (blocking, unpaired, NCCL-style): {rendezvous}{hint}\n");
        out
    }
}

/// 3 for 3.0, 2.5 for 2.5, 0.333 for 1/3.
fn fmt_num(x: f64) -> String {
    let s = format!("{x:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}
