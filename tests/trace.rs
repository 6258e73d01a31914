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
/// Once per test binary: tests that read the page must not see another's half-written one.
fn rendered() -> (PathBuf, usize, usize) {
    static PAGE: std::sync::OnceLock<(PathBuf, usize, usize)> = std::sync::OnceLock::new();
    PAGE.get_or_init(|| {
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
    })
    .clone()
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

/// `chromium` or `chromium-browser` on PATH.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| ["chromium", "chromium-browser"].map(|n| d.join(n)))
        .find(|p| p.is_file())
}

/// Pixels of `png` that have exactly the colour `hex` ("#rrggbb"), as (x, y).
fn pixels_of(png: &Path, hex: &str) -> (Vec<(u32, u32)>, (u32, u32)) {
    let rgb: Vec<u8> = (0..3).map(|i| u8::from_str_radix(&hex[1 + 2 * i..3 + 2 * i], 16).unwrap()).collect();
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        other => panic!("screenshot colour type {other:?}"),
    };
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    let mut out = vec![];
    for y in 0..info.height {
        let row = &buf[(y as usize * info.line_size)..][..info.width as usize * channels];
        for x in 0..info.width {
            let px = &row[x as usize * channels..][..3];
            if px == rgb.as_slice() {
                out.push((x, y));
            }
        }
    }
    (out, (info.width, info.height))
}

/// Runs of consecutive rows holding at least one of `pixels`: the lanes drawn.
fn bands(pixels: &[(u32, u32)]) -> usize {
    let mut rows: Vec<u32> = pixels.iter().map(|p| p.1).collect();
    rows.sort();
    rows.dedup();
    rows.windows(2).filter(|w| w[1] > w[0] + 1).count() + usize::from(!rows.is_empty())
}

/// Loads the page in headless Chromium, takes a screenshot and checks what was
/// painted: the F and B colours in every lane, measured and theory (so the SVG
/// laid out and rendered, not just parsed). Skips, saying so, without Chromium.
#[test]
fn rendered_page_draws_every_lane_in_headless_chromium() {
    let Some(chromium) = chromium() else {
        let msg = "SKIPPED rendered_page_draws_every_lane_in_headless_chromium: no chromium or \
                   chromium-browser on PATH (apt-get install chromium)";
        println!("{msg}");
        eprintln!("{msg}");
        return;
    };
    let (html, lanes, _) = rendered();
    let shot = html.with_file_name("timeline.png");
    let _ = std::fs::remove_file(&shot);
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new(&chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1400,700",
            &format!("--user-data-dir={}", profile.path().display()),
            &format!("--screenshot={}", shot.display()),
            &format!("file://{}", html.display()),
        ])
        .output()
        .expect("run chromium");
    assert!(
        out.status.success() && shot.exists(),
        "{}: {}",
        chromium.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let colour = |k| render::colour(k);
    let (f, size) = pixels_of(&shot, colour(pipewright::schedule::ActionKind::F));
    let (b, _) = pixels_of(&shot, colour(pipewright::schedule::ActionKind::B));
    assert_eq!(size, (1400, 700));
    // Each lane has F and B boxes of at least a few hundred pixels each.
    assert!(f.len() > 400 * 2 * lanes && b.len() > 400 * 2 * lanes, "F {} px, B {} px", f.len(), b.len());
    // Measured and theory lanes: F boxes painted in 2 × lanes separate bands of
    // rows (the legend's swatch adds one), all within the page's width.
    assert!(bands(&f) >= 2 * lanes, "F drawn in {} bands, want {}", bands(&f), 2 * lanes);
    assert!(bands(&b) >= 2 * lanes, "B drawn in {} bands", bands(&b));
    assert!(f.iter().chain(&b).all(|p| p.0 < 1400));
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

/// The small run's args plus `sets`, for a traced run into `dir`.
fn traced_run(dir: &Path, sets: &[&str], steps: &str) {
    let mut args: Vec<String> =
        ["train", "--steps", steps, "--trace", "--force", "--out", path_str(dir)].map(String::from).to_vec();
    for s in [
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=2",
        "train.micro_batch_size=2",
        "train.eval_every=0",
    ]
    .iter()
    .chain(sets)
    {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, _, err) = pipewright(&args);
    assert!(ok, "{err}");
}

fn events(trace: &Path) -> Vec<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(trace).unwrap()).unwrap();
    v["traceEvents"].as_array().unwrap().clone()
}

fn ph<'a>(ev: &'a [serde_json::Value], p: &'a str) -> impl Iterator<Item = &'a serde_json::Value> + 'a {
    ev.iter().filter(move |e| e["ph"] == p)
}

/// Whether some complete event on (pid, tid) strictly encloses `ts`: where
/// Perfetto binds a flow event.
fn enclosed(ev: &[serde_json::Value], pid: &serde_json::Value, tid: &serde_json::Value, ts: f64) -> bool {
    ph(ev, "X").any(|x| {
        let (t0, d) = (x["ts"].as_f64().unwrap(), x["dur"].as_f64().unwrap());
        &x["pid"] == pid && &x["tid"] == tid && t0 < ts && ts < t0 + d
    })
}

/// Checks the Chrome trace format of a run's trace.json: metadata names every
/// process and thread, an X event per action with its step and microbatch, flow
/// pairs with one start and one end per id, bound inside slices and never ending
/// before they start, counters of live activations and their bytes, and spans of
/// the other things a stage does. Returns the events.
fn check_chrome_format(trace: &Path, pp: usize, dp: usize, m: usize, steps: usize) -> Vec<serde_json::Value> {
    let ev = events(trace);
    let names = |name: &str| -> Vec<(u64, Option<u64>, String)> {
        ph(&ev, "M")
            .filter(|e| e["name"] == name)
            .map(|e| {
                (e["pid"].as_u64().unwrap(), e["tid"].as_u64(), e["args"]["name"].as_str().unwrap().into())
            })
            .collect()
    };
    let procs = names("process_name");
    assert_eq!(procs.len(), dp, "a process per replica: {procs:?}");
    for r in 0..dp {
        assert!(procs.iter().any(|p| p.0 == r as u64 && p.2 == format!("replica {r}")), "{procs:?}");
        for s in 0..pp {
            let threads = names("thread_name");
            let want = format!("stage {s} (rank {s})");
            assert!(
                threads.iter().any(|t| t.0 == r as u64 && t.1 == Some(s as u64) && t.2 == want),
                "{threads:?}"
            );
        }
    }
    // An X event per action, named kind + microbatch, with step and mb in args.
    let actions: Vec<_> = ph(&ev, "X").filter(|e| e["cat"] == "action").collect();
    assert_eq!(actions.len(), steps * dp * pp * m * 2, "F and B of every (step, replica, stage, microbatch)");
    for a in &actions {
        let (step, mb) = (a["args"]["step"].as_u64(), a["args"]["mb"].as_u64());
        assert!(step.is_some_and(|s| s < steps as u64) && mb.is_some_and(|x| x < m as u64), "{a}");
        let name = a["name"].as_str().unwrap();
        assert!(["F", "B"].contains(&&name[..1]) && name[1..] == mb.unwrap().to_string(), "{a}");
        assert_eq!(a["args"]["replica"], a["pid"], "one process per replica in one process: {a}");
    }
    // Flows: each id once as s and once as f; f binds to the enclosing slice
    // ("bp": "e"), both sit strictly inside a slice, and none ends before it starts.
    let mut starts = std::collections::BTreeMap::new();
    for s in ph(&ev, "s") {
        assert!(starts.insert(s["id"].as_u64().unwrap(), s).is_none(), "duplicate flow start {s}");
        assert!(enclosed(&ev, &s["pid"], &s["tid"], s["ts"].as_f64().unwrap()), "unbound flow start {s}");
    }
    let mut ends = 0;
    for f in ph(&ev, "f") {
        let s =
            starts.remove(&f["id"].as_u64().unwrap()).unwrap_or_else(|| panic!("flow end without start {f}"));
        assert_eq!(f["bp"], "e", "{f}");
        assert_eq!(f["cat"], s["cat"]);
        assert!(
            f["ts"].as_f64().unwrap() >= s["ts"].as_f64().unwrap(),
            "flow ends before it starts: {s} → {f}"
        );
        assert!(enclosed(&ev, &f["pid"], &f["tid"], f["ts"].as_f64().unwrap()), "unbound flow end {f}");
        ends += 1;
    }
    assert!(starts.is_empty(), "flow starts without an end: {starts:?}");
    assert_eq!(
        ends,
        steps * dp * (pp - 1) * m * 2,
        "an activation and a gradient flow per hop and microbatch"
    );
    // Counters: live activations (1F1B: at most p − s on stage s, reached) and bytes.
    for r in 0..dp as u64 {
        for s in 0..pp {
            let series = |name: String, key: &str| -> Vec<f64> {
                ph(&ev, "C")
                    .filter(|c| c["pid"] == r && c["name"] == name)
                    .map(|c| c["args"][key].as_f64().unwrap())
                    .collect()
            };
            let live = series(format!("live activations, stage {s}"), "microbatches");
            let bytes = series(format!("activation bytes, stage {s}"), "bytes");
            assert_eq!(live.len(), steps * m * 2, "a counter sample per action, replica {r} stage {s}");
            assert_eq!(bytes.len(), live.len());
            let peak = live.iter().cloned().fold(0.0, f64::max);
            assert_eq!(peak, (pp - s).min(m) as f64, "replica {r} stage {s}: {live:?}");
            assert!(bytes.iter().cloned().fold(0.0, f64::max) > 0.0);
        }
    }
    // Spans of everything else a stage does, and receives as instants.
    let cats: std::collections::BTreeSet<&str> = ph(&ev, "X").filter_map(|e| e["cat"].as_str()).collect();
    for c in ["send", "optimizer", "tied"] {
        assert!(cats.contains(c), "no {c} span: {cats:?}");
    }
    let sends = ph(&ev, "X").filter(|e| e["cat"] == "send" && e["args"]["to_stage"].is_u64()).count();
    assert_eq!(sends, steps * dp * (pp - 1) * m * 2, "a send span per activation and gradient");
    let recvs = ph(&ev, "i").filter(|e| e["cat"] == "recv").count();
    assert_eq!(recvs, sends, "a receive instant per message, waited for or not");
    ev
}

#[test]
fn trace_json_is_chrome_trace_format_with_every_part() {
    check_chrome_format(&real_trace(), 2, 1, 4, 3);
}

#[test]
fn data_parallel_trace_has_every_replica_and_the_checkpointer() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trace-test-dp2");
    traced_run(
        &dir,
        &["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2", "checkpoint.every=2"],
        "3",
    );
    let ev = check_chrome_format(&dir.join("trace.json"), 2, 2, 2, 3);
    let cats: std::collections::BTreeSet<&str> = ph(&ev, "X").filter_map(|e| e["cat"].as_str()).collect();
    for c in ["reduce", "checkpoint", "checkpoint write"] {
        assert!(cats.contains(c), "no {c} span: {cats:?}");
    }
    // The checkpointer's background write on its own thread of replica 0's process.
    let w = ph(&ev, "X").find(|e| e["cat"] == "checkpoint write").unwrap();
    let thread =
        ph(&ev, "M").find(|e| e["name"] == "thread_name" && e["pid"] == w["pid"] && e["tid"] == w["tid"]);
    assert_eq!(thread.unwrap()["args"]["name"], "checkpointer");
    assert!(w["dur"].as_f64().unwrap() > 0.0);
    // Both replicas reach the summary.
    let t = summary::load(&dir.join("trace.json")).unwrap();
    assert!(t.actions.iter().any(|a| a.replica == 1) && t.meta.dp == 2);
}

/// Two processes (pp = 4 over 2 nodes): a process per node in the trace, every
/// flow ending after it starts, and each message between the nodes received no
/// earlier than it was sent, to within the clock alignment's error bound (half
/// the best probe's round trip) — which without the alignment, whose worker
/// clock starts when the roster arrives, does not hold.
#[test]
fn a_trace_across_two_processes_is_on_one_clock() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trace-test-launch");
    let mut args: Vec<String> =
        ["launch", "--nodes", "2", "--steps", "3", "--trace", "--force", "--out", path_str(&dir)]
            .map(String::from)
            .to_vec();
    for s in [
        "model.n_layer=4",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=16",
        "train.micro_batch_size=2",
        "train.eval_every=0",
        "parallel.microbatches=4",
        "parallel.pp=4",
    ] {
        args.extend(["--set".into(), s.into()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, _, err) = pipewright(&args);
    assert!(ok, "{err}");
    let trace = dir.join("trace.json");
    let ev = events(&trace);
    let procs: Vec<&str> = ph(&ev, "M")
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(procs, ["replica 0 · node 0", "replica 0 · node 1"]);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let clock = &v["metadata"]["clock_alignment"][0];
    let rtt = clock["rtt_us"].as_f64().unwrap_or_else(|| panic!("no clock alignment: {}", v["metadata"]));
    assert!(rtt > 0.0 && clock["rank"] == 1, "{clock}");
    // Every flow ends at or after its start.
    let starts: std::collections::BTreeMap<u64, f64> =
        ph(&ev, "s").map(|s| (s["id"].as_u64().unwrap(), s["ts"].as_f64().unwrap())).collect();
    let mut flows = 0;
    for f in ph(&ev, "f") {
        let s = starts[&f["id"].as_u64().unwrap()];
        assert!(f["ts"].as_f64().unwrap() >= s, "flow {} ends before it starts", f["id"]);
        flows += 1;
    }
    assert_eq!(flows, 3 * 3 * 4 * 2);
    // Raw times, before any flow placement: stage 1 (node 0) ↔ stage 2 (node 1).
    let key = |e: &serde_json::Value| {
        (e["args"]["step"].as_u64(), e["args"]["mb"].as_u64(), e["args"]["stage"].as_u64())
    };
    let mut crossings = 0;
    for (from, to) in [(1u64, 2u64), (2, 1)] {
        for send in ph(&ev, "X")
            .filter(|e| e["cat"] == "send" && e["args"]["stage"] == from && e["args"]["to_stage"] == to)
        {
            let recv = ph(&ev, "i")
                .find(|r| {
                    r["cat"] == "recv"
                        && r["args"]["from_stage"] == from
                        && key(r) == (key(send).0, key(send).1, Some(to))
                })
                .unwrap_or_else(|| panic!("no receive of {send}"));
            let (sent, got) = (send["ts"].as_f64().unwrap(), recv["ts"].as_f64().unwrap());
            assert!(
                got >= sent - rtt / 2.0,
                "received {:.1} µs before it was sent (round trip {rtt:.1} µs): {send} {recv}",
                sent - got
            );
            crossings += 1;
        }
    }
    assert_eq!(crossings, 3 * 4 * 2);
}

#[test]
fn render_refuses_an_output_it_cannot_write() {
    let png = real_trace().with_file_name("x.png");
    let (ok, _, err) = pipewright(&["trace", "render", path_str(&real_trace()), "-o", path_str(&png)]);
    assert!(!ok && err.contains("x.png") && err.contains(".html") && err.contains(".svg"), "{err}");
    assert!(!png.exists(), "nothing written");
}

#[test]
fn schedule_costs_shape_the_grid_and_must_be_positive() {
    let grid = |costs: Option<&str>| {
        let mut a = vec!["schedule", "--kind", "1f1b", "--stages", "2", "--microbatches", "2"];
        if let Some(c) = costs {
            a.extend(["--costs", c]);
        }
        pipewright(&a)
    };
    let (ok, unit, err) = grid(None);
    assert!(ok, "{err}");
    let (ok, slow_b, err) = grid(Some("1,4"));
    assert!(ok, "{err}");
    assert_ne!(unit, slow_b, "--costs changes the grid");
    // B takes four columns of F's one: "B0" then three continuation cells.
    assert!(slow_b.contains("B0 -- -- --"), "{slow_b}");
    for bad in ["0,0", "1,-2", "1,2,0,1"] {
        let (ok, _, err) = grid(Some(bad));
        assert!(!ok && err.contains("--costs") && err.contains("> 0"), "{bad}: {err}");
    }
}
