//! A static picture of one step: a lane per pipeline stage with its actions as
//! boxes (coloured by kind, microbatch inside), waits hatched, and beneath them the
//! schedule the simulator predicts at the measured costs, on the same time axis.
//!
//! Output is plain SVG (or an HTML page holding it inline): no scripts, no fonts or
//! anything else fetched, so it opens anywhere and can be attached to an issue.

use super::summary::{lane_name, theory, Summary, Trace, TraceError};
use crate::schedule::ActionKind;
use std::fmt::Write;

const WIDTH: f64 = 1360.0;
const LEFT: f64 = 190.0;
const RIGHT: f64 = 30.0;
const LANE_H: f64 = 30.0;
const LANE_GAP: f64 = 8.0;

/// Fill colour of an action kind.
pub fn colour(kind: ActionKind) -> &'static str {
    match kind {
        ActionKind::F => "#4e79a7",
        ActionKind::B => "#59a14f",
        ActionKind::I => "#f28e2b",
        ActionKind::W => "#b07aa1",
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A box to draw: lane index, kind, microbatch, stage, start and end (ms from the step start).
struct Item {
    lane: usize,
    kind: ActionKind,
    mb: usize,
    stage: usize,
    t0: f64,
    t1: f64,
}

/// The step `render` draws: `step` if given (must be in the trace), else the median one.
pub fn chosen_step(trace: &Trace, summary: &Summary, step: Option<u64>) -> Result<u64, TraceError> {
    match step {
        None => Ok(summary.median_step),
        Some(s) if trace.actions.iter().any(|a| a.step == s && a.replica == 0) => Ok(s),
        Some(s) => Err(TraceError::Empty {
            path: trace.path.clone(),
            reason: format!("--step {s}: no actions of that step (steps {:?})", summary.steps),
        }),
    }
}

/// The SVG picture of `step` (replica 0).
pub fn svg(trace: &Trace, summary: &Summary, step: u64) -> String {
    let ranks: Vec<usize> = summary.lanes.iter().map(|l| l.rank).collect();
    let lane_of = |rank: usize| ranks.iter().position(|r| *r == rank).unwrap_or(0);
    let spans: Vec<_> = trace.actions.iter().filter(|a| a.step == step && a.replica == 0).collect();
    let w0 = spans.iter().map(|a| a.start_us).fold(f64::INFINITY, f64::min);
    let w1 = spans.iter().map(|a| a.end_us).fold(f64::NEG_INFINITY, f64::max);
    let measured: Vec<Item> = spans
        .iter()
        .filter_map(|a| {
            Some(Item {
                lane: lane_of(a.rank),
                kind: a.kind?,
                mb: a.mb?,
                stage: a.stage,
                t0: (a.start_us - w0) / 1e3,
                t1: (a.end_us - w0) / 1e3,
            })
        })
        .collect();
    let waits: Vec<(usize, f64, f64, String)> = trace
        .waits
        .iter()
        .filter(|w| w.step == step && w.replica == 0 && ranks.contains(&w.rank))
        .map(|w| {
            let (a, b) = (w.start_us.max(w0), w.end_us.min(w1));
            (lane_of(w.rank), (a - w0) / 1e3, (b - w0) / 1e3, w.detail.clone().unwrap_or_default())
        })
        .filter(|w| w.2 > w.1)
        .collect();
    let sim = theory(trace, &summary.costs).ok();
    let simulated: Vec<Item> = sim
        .iter()
        .flat_map(|r| r.timeline.iter().enumerate())
        .flat_map(|(rank, l)| {
            l.iter().map(move |(a, s, e)| Item {
                lane: rank,
                kind: a.kind,
                mb: a.mb,
                stage: a.stage,
                t0: s / 1e3,
                t1: e / 1e3,
            })
        })
        .collect();
    let measured_ms = (w1 - w0) / 1e3;
    let span_ms = measured_ms.max(sim.as_ref().map_or(0.0, |r| r.makespan / 1e3)).max(1e-9);
    let x = |t: f64| LEFT + t / span_ms * (WIDTH - LEFT - RIGHT);
    let n = ranks.len();
    let block = n as f64 * (LANE_H + LANE_GAP);
    let header_h = 92.0;
    let top_measured = header_h + 24.0;
    let top_theory = top_measured + block + 46.0;
    let axis_y = top_theory + if sim.is_some() { block } else { 0.0 } + 6.0;
    let legend_y = axis_y + 44.0;
    let height = legend_y + 30.0;

    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="12">"#
    );
    o.push_str(
        r##"<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#f3f3f3"/><line x1="0" y1="0" x2="0" y2="6" stroke="#c0504d" stroke-width="2" stroke-opacity="0.55"/></pattern></defs>
<rect width="100%" height="100%" fill="white"/>
"##,
    );
    // Header: what and the figures.
    let m = &trace.meta;
    let _ = writeln!(
        o,
        r#"<text x="16" y="26" font-size="18" font-weight="bold">{} — step {step}: {} schedule, pp {}, {} microbatches{}</text>"#,
        esc(&trace.path.display().to_string()),
        esc(m.schedule.as_deref().unwrap_or("unknown")),
        m.pp,
        m.microbatches,
        if m.chunks > 1 { format!(", {} chunks per rank", m.chunks) } else { String::new() }
    );
    let theory_txt = summary.theory_bubble_frac.map_or("unknown".into(), |t| format!("{:.1}%", 100.0 * t));
    let _ = writeln!(
        o,
        r#"<text class="figures" x="16" y="50" font-size="14">bubble: measured {:.1}% · theory {theory_txt} (simulated at the measured mean costs) · step {:.2} ms (median){}</text>"#,
        100.0 * summary.bubble_frac,
        summary.step_ms,
        summary.theory_step_ms.map(|t| format!(" · theory step {t:.2} ms")).unwrap_or_default()
    );
    let means: Vec<String> = summary.mean_ms.iter().map(|(k, v)| format!("{k} {v:.2} ms")).collect();
    let _ = writeln!(
        o,
        r##"<text x="16" y="72" font-size="12" fill="#555">this step: {measured_ms:.2} ms; mean action time {}; figures over steps {:?}</text>"##,
        means.join(", "),
        summary.counted_steps
    );

    // Grid lines and the time axis.
    let tick = nice_tick(span_ms);
    let decimals = (-tick.log10().floor()).max(0.0) as usize;
    for i in 0..=(span_ms / tick + 1e-6).floor() as usize {
        let t = i as f64 * tick;
        let xx = x(t);
        let _ = writeln!(
            o,
            r##"<line x1="{xx:.1}" y1="{:.1}" x2="{xx:.1}" y2="{axis_y:.1}" stroke="#e4e4e4"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle" fill="#333">{t:.decimals$}</text>"##,
            top_measured - 4.0,
            axis_y + 16.0,
        );
    }
    let _ = writeln!(
        o,
        r##"<line x1="{LEFT}" y1="{axis_y:.1}" x2="{:.1}" y2="{axis_y:.1}" stroke="#333"/><text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#333">time from the step's first action (ms)</text>"##,
        WIDTH - RIGHT,
        (LEFT + WIDTH - RIGHT) / 2.0,
        axis_y + 32.0
    );

    let lanes_block = |o: &mut String, top: f64, title: &str, group: &str, items: &[Item], end_ms: f64| {
        let _ = writeln!(
            o,
            r#"<text x="16" y="{:.1}" font-size="14" font-weight="bold">{title}</text>"#,
            top - 8.0
        );
        let _ = writeln!(o, r#"<g class="{group}">"#);
        for (i, l) in summary.lanes.iter().enumerate() {
            let y = top + i as f64 * (LANE_H + LANE_GAP);
            let _ = writeln!(
                o,
                r##"<g class="lane" data-stage="{}"><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text><rect class="lane-bg" x="{LEFT}" y="{y:.1}" width="{:.1}" height="{LANE_H}" fill="#f7f7f7" stroke="#ddd"/></g>"##,
                l.stage,
                LEFT - 10.0,
                y + LANE_H / 2.0 + 4.0,
                esc(&lane_name(l.rank, &l.stages)),
                (x(end_ms) - LEFT).max(0.0)
            );
        }
        for it in items {
            let y = top + it.lane as f64 * (LANE_H + LANE_GAP);
            let (x0, x1) = (x(it.t0), x(it.t1));
            let w = (x1 - x0).max(0.5);
            let _ = write!(
                o,
                r##"<g class="action" data-kind="{k}"><title>{s}{k}{mb}: {:.2}–{:.2} ms</title><rect x="{x0:.2}" y="{:.1}" width="{w:.2}" height="{:.1}" fill="{}" fill-opacity="{}" stroke="white" stroke-width="0.6"/>"##,
                it.t0,
                it.t1,
                y + 1.0,
                LANE_H - 2.0,
                colour(it.kind),
                // Later model chunks of a rank (interleaved) are drawn lighter.
                if (it.stage / m.pp.max(1)) % 2 == 1 { 0.6 } else { 1.0 },
                s = it.stage,
                k = it.kind.letter(),
                mb = it.mb,
            );
            if w >= 9.0 {
                let _ = write!(
                    o,
                    r#"<text x="{:.2}" y="{:.1}" text-anchor="middle" fill="white" font-size="{}">{}</text>"#,
                    x0 + w / 2.0,
                    y + LANE_H / 2.0 + 4.0,
                    if w >= 18.0 { 12 } else { 9 },
                    it.mb
                );
            }
            let _ = writeln!(o, "</g>");
        }
        let _ = writeln!(o, "</g>");
    };

    lanes_block(
        &mut o,
        top_measured,
        &format!("measured (step {step}, replica 0)"),
        "measured",
        &measured,
        measured_ms,
    );
    let _ = writeln!(o, r#"<g class="waits">"#);
    for (lane, t0, t1, what) in &waits {
        let y = top_measured + *lane as f64 * (LANE_H + LANE_GAP);
        let _ = writeln!(
            o,
            r#"<rect class="wait" x="{:.2}" y="{:.1}" width="{:.2}" height="{:.1}" fill="url(#hatch)"><title>waited {:.2} ms for {}</title></rect>"#,
            x(*t0),
            y + 1.0,
            (x(*t1) - x(*t0)).max(0.5),
            LANE_H - 2.0,
            t1 - t0,
            esc(what)
        );
    }
    let _ = writeln!(o, "</g>");
    match &sim {
        Some(r) => lanes_block(
            &mut o,
            top_theory,
            "theory (the same schedule simulated at the measured mean F/B/I/W costs and per-stage factors)",
            "theory",
            &simulated,
            r.makespan / 1e3,
        ),
        None => {
            let _ = writeln!(
                o,
                r##"<text x="16" y="{:.1}" fill="#a00">theory: {}</text>"##,
                top_theory - 8.0,
                esc(summary.theory_note.as_deref().unwrap_or("unavailable"))
            );
        }
    }

    // Legend.
    let _ = writeln!(o, r#"<g class="legend">"#);
    let mut lx = LEFT;
    for (label, fill) in [
        ("F forward", colour(ActionKind::F)),
        ("B backward", colour(ActionKind::B)),
        ("I backward (input)", colour(ActionKind::I)),
        ("W backward (weights)", colour(ActionKind::W)),
        ("wait (hover for what)", "url(#hatch)"),
        ("idle", "#f7f7f7"),
    ] {
        let _ = writeln!(
            o,
            r##"<rect x="{lx:.1}" y="{:.1}" width="18" height="14" fill="{fill}" stroke="#999"/><text x="{:.1}" y="{:.1}">{label}</text>"##,
            legend_y - 11.0,
            lx + 24.0,
            legend_y
        );
        lx += 40.0 + 7.0 * label.len() as f64;
    }
    let note = if m.chunks > 1 {
        "numbers are microbatches; lighter: odd model chunks"
    } else {
        "numbers are microbatches"
    };
    let _ = writeln!(o, "<text x=\"{lx:.1}\" y=\"{legend_y:.1}\" fill=\"#555\">{note}</text>");
    let _ = writeln!(o, "</g>\n</svg>");
    o
}

/// `svg` inside a self-contained HTML page.
pub fn html(trace: &Trace, summary: &Summary, step: u64) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>pipewright timeline: {}</title>\
         <style>body{{margin:12px;background:#fff}}</style></head><body>\n{}</body></html>\n",
        esc(&trace.path.display().to_string()),
        svg(trace, summary, step)
    )
}

/// A tick spacing of 1, 2 or 5 × 10^k giving 5–12 ticks.
fn nice_tick(span: f64) -> f64 {
    let raw = span / 8.0;
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|k| k * p).find(|t| *t >= raw).unwrap_or(10.0 * p)
}

/// `pipewright trace render`: reads `trace`, draws `step` (default the median one)
/// and writes `out`, as SVG if its name ends in ".svg", else as HTML. Returns the step.
pub fn write(trace: &std::path::Path, out: &std::path::Path, step: Option<u64>) -> Result<u64, TraceError> {
    let ext = out.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    let svg_out = match ext.as_deref() {
        Some("svg") => true,
        Some("html") => false,
        _ => {
            return Err(TraceError::Output {
                path: out.into(),
                reason: "trace render writes an HTML page (.html) or a bare SVG (.svg); \
                         name the output with one of those extensions"
                    .into(),
            })
        }
    };
    let t = super::summary::load(trace)?;
    let s = super::summary::summarize(&t)?;
    let step = chosen_step(&t, &s, step)?;
    let text = if svg_out { svg(&t, &s, step) } else { html(&t, &s, step) };
    std::fs::write(out, text).map_err(|error| TraceError::Write { path: out.into(), error })?;
    Ok(step)
}
