//! Trace analysis as a user meets it: `schedule --trace` round-trips through
//! `trace summary` to the theory, a real run's trace summarises and renders with a
//! lane per stage, the page renders in a browser, and a bad file is named.

use pipewright::trace::{render, summary};
use std::path::{Path, PathBuf};
use std::process::Command;

fn pipewright(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pipewright")).args(args).output().expect("run pipewright");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "pipewright panicked: {stderr}");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string(), stderr)
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn simulated_1f1b_trace_has_the_theory_bubble() {
    let dir = tempfile::tempdir().unwrap();
    for (p, m) in [(2, 4), (4, 8), (4, 16), (8, 8)] {
        let file = dir.path().join(format!("1f1b-{p}-{m}.json"));
        let (ok, _, err) = pipewright(&[
            "schedule",
            "--kind",
            "1f1b",
            "--stages",
            &p.to_string(),
            "--microbatches",
            &m.to_string(),
            "--trace",
            path_str(&file),
            "--costs",
            "1.5,3",
        ]);
        assert!(ok, "{err}");
        let (ok, out, err) = pipewright(&["trace", "summary", path_str(&file), "--json"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let theory = (p as f64 - 1.0) / (m as f64 + p as f64 - 1.0);
        let measured = v["bubble_frac"].as_f64().unwrap();
        assert!((measured - theory).abs() < 1e-6, "p {p} m {m}: {measured} vs {theory}");
        assert!((v["theory_bubble_frac"].as_f64().unwrap() - theory).abs() < 1e-6, "p {p} m {m}");
        assert_eq!(v["stages"].as_array().unwrap().len(), p);
        // Step = (m + p − 1) × (F + B) = (m + p − 1) × 4.5 ms.
        assert!((v["step_ms"].as_f64().unwrap() - (m + p - 1) as f64 * 4.5).abs() < 1e-6);
    }
}

#[test]
fn every_schedule_kind_written_as_a_trace_summarises_to_its_simulation() {
    let dir = tempfile::tempdir().unwrap();
    for kind in ["gpipe", "1f1b", "interleaved", "zb-h1"] {
        let file = dir.path().join(format!("{kind}.json"));
        let args = ["schedule", "--kind", kind, "--stages", "4", "--microbatches", "8", "--trace"];
        let (ok, _, err) = pipewright(&[&args[..], &[path_str(&file)]].concat());
        assert!(ok, "{kind}: {err}");
        let s = summary::summarize(&summary::load(&file).unwrap()).unwrap();
        assert_eq!(s.lanes.len(), 4, "{kind}: one lane per rank");
        let t = s.theory_bubble_frac.unwrap_or_else(|| panic!("{kind}: {:?}", s.theory_note));
        assert!((s.bubble_frac - t).abs() < 1e-6, "{kind}: {} vs {t}", s.bubble_frac);
    }
}

/// A tiny real run with --trace (3 steps, pp = 2, 4 microbatches), once per test binary.
fn real_trace() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trace-test-run");
        let (ok, _, err) = pipewright(&[
            "train",
            "--steps",
            "3",
            "--trace",
            "--force",
            "--out",
            path_str(&dir),
            "--set",
            "model.n_layer=2",
            "--set",
            "model.n_embd=32",
            "--set",
            "model.n_head=2",
            "--set",
            "train.micro_batch_size=2",
            "--set",
            "parallel.microbatches=4",
            "--set",
            "parallel.pp=2",
        ]);
        assert!(ok, "{err}");
        dir
    })
    .join("trace.json")
}

#[test]
fn real_run_trace_summarises_with_one_lane_per_stage() {
    let (ok, out, err) = pipewright(&["trace", "summary", path_str(&real_trace()), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["stages"].as_array().unwrap().len(), 2, "{out}");
    assert_eq!(v["stage_count"], 2);
    for k in ["bubble_frac", "theory_bubble_frac", "step_ms"] {
        assert!(v[k].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0), "{k}: {out}");
    }
    for st in v["stages"].as_array().unwrap() {
        let (busy, bubble) = (st["busy_frac"].as_f64().unwrap(), st["bubble_frac"].as_f64().unwrap());
        assert!((busy + bubble - 1.0).abs() < 1e-9, "{st}");
        for k in ["warmup_ms", "cooldown_ms", "wait_ms"] {
            assert!(st[k].as_f64().unwrap() >= 0.0, "{k}: {st}");
        }
    }
    let (ok, text, err) = pipewright(&["trace", "summary", path_str(&real_trace())]);
    assert!(ok, "{err}");
    assert!(text.contains("bubble: measured") && text.contains("critical path"), "{text}");
}

/// Renders the real trace and returns (HTML path, number of lanes, number of actions drawn).
fn rendered() -> (PathBuf, usize, usize) {
    let trace = real_trace();
    let out = trace.with_file_name("timeline.html");
    let (ok, _, err) = pipewright(&["trace", "render", path_str(&trace), "-o", path_str(&out)]);
    assert!(ok, "{err}");
    let t = summary::load(&trace).unwrap();
    let s = summary::summarize(&t).unwrap();
    let step = render::chosen_step(&t, &s, None).unwrap();
    let measured = t.actions.iter().filter(|a| a.step == step && a.replica == 0).count();
    // Measured plus theory: the same actions twice.
    (out, s.lanes.len(), 2 * measured)
}

#[test]
fn render_is_well_formed_with_a_lane_per_stage_and_a_legend() {
    let (html, lanes, actions) = rendered();
    let text = std::fs::read_to_string(&html).unwrap();
    assert!(text.starts_with("<!DOCTYPE html>") && !text.contains("<script"), "static page");
    let body = text.split_once("<body>").unwrap().1.rsplit_once("</body>").unwrap().0;
    let doc = roxmltree::Document::parse(body).expect("the SVG is well-formed XML");
    let class = |c: &str| doc.descendants().filter(|n| n.attribute("class") == Some(c)).count();
    assert_eq!(lanes, 2);
    assert_eq!(class("lane"), 2 * lanes, "measured and theory lanes");
    assert_eq!(class("action"), actions);
    assert_eq!(class("legend"), 1);
    assert!(body.contains("bubble: measured"), "header with the figures");
    // -o x.svg writes the bare SVG.
    let svg = html.with_file_name("timeline.svg");
    let (ok, _, err) =
        pipewright(&["trace", "render", path_str(&real_trace()), "-o", path_str(&svg), "--step", "1"]);
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(&svg).unwrap();
    roxmltree::Document::parse(&text).expect("well-formed SVG");
    let (ok, _, err) =
        pipewright(&["trace", "render", path_str(&real_trace()), "-o", path_str(&svg), "--step", "99"]);
    assert!(!ok && err.contains("--step 99"), "{err}");
}

#[test]
fn rendered_page_draws_every_action_in_headless_chromium() {
    let chromium = Path::new("/usr/bin/chromium");
    if !chromium.exists() {
        println!("skipped: /usr/bin/chromium is not installed");
        return;
    }
    let (html, _, actions) = rendered();
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            &format!("--user-data-dir={}", profile.path().display()),
            "--dump-dom",
            &format!("file://{}", html.display()),
        ])
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "chromium: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(dom.matches("class=\"action\"").count(), actions, "action boxes in the browser's DOM");
    assert!(dom.contains("<svg"), "{dom}");
}

#[test]
fn corrupt_trace_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("corrupt-trace.json");
    std::fs::write(&file, "{\"traceEvents\": [{\"ph\": \"X\", ").unwrap();
    for cmd in ["summary", "render"] {
        let out = dir.path().join("t.html");
        let args: Vec<&str> = match cmd {
            "summary" => vec!["trace", "summary", path_str(&file)],
            _ => vec!["trace", "render", path_str(&file), "-o", path_str(&out)],
        };
        let (ok, _, err) = pipewright(&args);
        assert!(!ok, "{cmd}");
        assert!(err.contains("corrupt-trace.json"), "{cmd}: {err}");
    }
    let missing = dir.path().join("missing.json");
    let (ok, _, err) = pipewright(&["trace", "summary", path_str(&missing)]);
    assert!(!ok && err.contains("missing.json"), "{err}");
}
