//! The simulated backend runs the real actors, messages and schedules with
//! sleeping stages; what it measures must match what the schedule simulator
//! and the planner (which uses it) predict. In its own binary, and its tests
//! take turns (`ONE_AT_A_TIME`), so no other run competes while one measures.

use pipewright::bench::sim_rows;
use pipewright::config::Config;
use pipewright::trace::summary;
use std::path::Path;

/// How many times a cell is measured before a miss counts. A CI box shared
/// with other jobs can stall a thread for milliseconds; such a stall lands in
/// the measured bubble as idle time that the schedule did not cause. A
/// runtime that really adds waits misses on every attempt.
const ATTEMPTS: usize = 3;

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn measured_bubbles_match_the_simulator_and_the_planner() {
    let _turn = turn();
    for schedule in ["1f1b", "gpipe"] {
        for cell in [(2, 4), (4, 8), (4, 16)] {
            let mut seen = Vec::new();
            let matched = (0..ATTEMPTS).any(|_| {
                // 10 ms / 20 ms actions: long enough that scheduling jitter
                // stays small beside them (the bench uses 2 ms / 4 ms).
                let r = sim_rows(schedule, &[cell], 10.0, 20.0, 3).unwrap().remove(0);
                seen.push(format!(
                    "bubble {:.4} vs theory {:.4}, planner {:.4} (overhead {:.2}%)",
                    r.measured_bubble,
                    r.theory_bubble,
                    r.planned_bubble,
                    100.0 * r.overhead
                ));
                (r.measured_bubble - r.theory_bubble).abs() < 0.02
                    && (r.measured_bubble - r.planned_bubble).abs() < 0.02
            });
            assert!(matched, "{schedule} pp={} m={}: {}", cell.0, cell.1, seen.join("; "));
        }
    }
}

/// The issue's own cell at the bench's costs: pp = 8, m = 32, 2 ms forward and
/// 4 ms backward, eight stage threads on however few cores CI has. Sleeping
/// stages wake late when other processes hold the cores (two busy loops on a
/// 2-core box double the step), so an attempt during which others used more
/// than a quarter of the machine does not count as a miss; if every attempt
/// was contended the test says SKIPPED, with the figures.
#[test]
fn headline_cell_bubble_matches_theory_at_bench_costs() {
    let _turn = turn();
    for schedule in ["1f1b", "gpipe"] {
        let mut seen = Vec::new();
        let mut quiet_attempts = 0;
        let matched = (0..ATTEMPTS).any(|_| {
            let before = CpuSample::now();
            let r = sim_rows(schedule, &[(8, 32)], 2.0, 4.0, 6).unwrap().remove(0);
            let others = before.others_share();
            quiet_attempts += usize::from(others < 0.25);
            seen.push(format!(
                "bubble {:.4} vs theory {:.4} (overhead {:.2}%; other processes used {:.0}% of the cores)",
                r.measured_bubble,
                r.theory_bubble,
                100.0 * r.overhead,
                100.0 * others
            ));
            (r.measured_bubble - r.theory_bubble).abs() < 0.02
        });
        if !matched && quiet_attempts == 0 {
            let msg = format!(
                "SKIPPED headline_cell_bubble_matches_theory_at_bench_costs ({schedule}): other processes held \
                 the cores during every attempt: {}",
                seen.join("; ")
            );
            println!("{msg}");
            eprintln!("{msg}");
            continue;
        }
        assert!(matched, "{schedule} pp=8 m=32: {}", seen.join("; "));
    }
}

/// Busy CPU time of the whole machine and of this process, to tell how much
/// of the cores other processes (and the hypervisor's steal) took meanwhile.
struct CpuSample {
    machine_s: f64,
    own_s: f64,
    at: std::time::Instant,
}

impl CpuSample {
    fn now() -> CpuSample {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        // user nice system idle iowait irq softirq steal: all but idle and iowait.
        let f: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        let ticks: u64 = [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| f.get(i)).sum();
        // SAFETY: sysconf and getrusage only read settings and fill the struct given.
        let (per_s, own) = unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut u);
            (libc::sysconf(libc::_SC_CLK_TCK).max(1) as f64, u)
        };
        let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
        CpuSample {
            machine_s: ticks as f64 / per_s,
            own_s: t(own.ru_utime) + t(own.ru_stime),
            at: std::time::Instant::now(),
        }
    }

    /// Share of all cores that others used since this sample (0 where /proc is absent).
    fn others_share(&self) -> f64 {
        let now = CpuSample::now();
        let others = (now.machine_s - self.machine_s) - (now.own_s - self.own_s);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        (others / (self.at.elapsed().as_secs_f64() * cores)).max(0.0)
    }
}

#[test]
fn bench_sim_measures_the_cells_asked_for_and_refuses_malformed_ones() {
    let _turn = turn();
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("cells.svg");
    let run = |cells: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args(["bench", "--sim", "--json", "--cells", cells, "--plot"])
            .arg(&plot)
            .output()
            .unwrap()
    };
    let out = run("2x2,2X4");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let cells: Vec<(u64, u64)> =
        rows.iter().map(|r| (r["pp"].as_u64().unwrap(), r["microbatches"].as_u64().unwrap())).collect();
    assert_eq!(cells, [(2, 2), (2, 4)]);
    assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"));
    for bad in ["8y32", "0x4", "8x", "x8", "8x-1"] {
        let out = run(bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad} accepted");
        assert!(err.contains("--cells") && err.contains("PPxM"), "{bad}: {err}");
    }
}

/// A sim run's config: pp stages of one layer each, `sets` on top.
fn sim_config(pp: usize, m: usize, sets: &[String]) -> Vec<String> {
    let mut v: Vec<String> = vec![
        format!("model.n_layer={pp}"),
        "model.n_embd=8".into(),
        "model.n_head=1".into(),
        "model.block_size=4".into(),
        "model.vocab_size=16".into(),
        "train.micro_batch_size=1".into(),
        "train.eval_every=0".into(),
        "data.builtin=\"random\"".into(),
        format!("parallel.pp={pp}"),
        format!("parallel.microbatches={m}"),
        "backend.kind=\"sim\"".into(),
        "sim.forward_ms=10".into(),
        "sim.backward_ms=20".into(),
        "sim.weight_ms=10".into(),
    ];
    v.extend_from_slice(sets);
    v
}

/// Runs `pipewright train --trace` on a sim config and summarises its trace.
fn traced_sim(dir: &Path, sets: &[String], steps: usize) -> summary::Summary {
    let mut args = vec!["train".to_string(), "--steps".into(), steps.to_string(), "--trace".into()];
    args.extend(["--force".into(), "--out".into(), dir.display().to_string()]);
    for s in sets {
        args.extend(["--set".into(), s.clone()]);
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pipewright")).args(&args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("simulated backend") && !err.contains("GFLOP/s"),
        "sim figures, not compute's: {err}"
    );
    summary::summarize(&summary::load(&dir.join("trace.json")).unwrap()).unwrap()
}

#[test]
fn stage_factors_of_the_wrong_length_are_refused_naming_the_field() {
    let sets = sim_config(4, 8, &["sim.stage_factors=[1.0, 2.0]".into()]);
    let e = Config::load(None, &sets).and_then(|c| c.validate().map(|_| c)).unwrap_err().to_string();
    assert!(e.contains("sim.stage_factors") && e.contains("4"), "{e}");
    let ok = sim_config(4, 8, &["sim.stage_factors=[1.0, 1.0, 2.0, 1.0]".into()]);
    Config::load(None, &ok).unwrap().validate().unwrap();
}

/// A stage twice as slow as the others is the bottleneck `trace summary`
/// names, and the bubble the run measures is the simulator's for the same
/// factors (the planner's too).
#[test]
fn a_slow_stage_is_the_bottleneck_and_the_bubble_follows_the_factors() {
    let _turn = turn();
    let dir = tempfile::tempdir().unwrap();
    let sets = sim_config(4, 8, &["sim.stage_factors=[1.0, 1.0, 2.0, 1.0]".into()]);
    let cfg = Config::load(None, &sets).unwrap();
    let planned = pipewright::plan::cpu::plan(&cfg).unwrap().bubble;
    let costs = pipewright::plan::cpu::sim_costs(&cfg);
    let theory = pipewright::actors::Layout::from_config(&cfg).unwrap().schedule.simulate(&costs).unwrap();
    let even = pipewright::actors::Layout::from_config(&cfg)
        .unwrap()
        .schedule
        .simulate(&pipewright::plan::cpu::sim_costs(&Config::load(None, &sim_config(4, 8, &[])).unwrap()))
        .unwrap();
    assert!(theory.mean_bubble_frac > even.mean_bubble_frac + 0.05, "the slow stage must matter");
    assert_eq!(planned, theory.mean_bubble_frac);
    let mut seen = vec![];
    let ok = (0..ATTEMPTS).any(|_| {
        let s = traced_sim(dir.path(), &sets, 4);
        let b = s.bottleneck.clone().expect("four lanes");
        seen.push(format!(
            "bottleneck stage {} ({:.2}× median), bubble {:.4} vs simulator {:.4}",
            b.stage, b.vs_median, s.bubble_frac, theory.mean_bubble_frac
        ));
        assert_eq!(b.stage, 2, "{}", seen.join("; "));
        assert!((b.vs_median - 2.0).abs() < 0.2, "{}", seen.join("; "));
        (s.bubble_frac - theory.mean_bubble_frac).abs() < 0.02
    });
    assert!(ok, "{}", seen.join("; "));
    let text = summary::summarize(&summary::load(&dir.path().join("trace.json")).unwrap()).unwrap().text();
    assert!(text.contains("bottleneck: stage 2"), "{text}");
}

/// Jitter varies every action's time but the run completes, and the schedule
/// simulated at the measured mean costs still predicts the bubble measured.
#[test]
fn jitter_varies_action_times_and_theory_from_measured_costs_holds() {
    let _turn = turn();
    let dir = tempfile::tempdir().unwrap();
    let sets = sim_config(4, 8, &["sim.jitter=0.3".into()]);
    let mut seen = vec![];
    let ok = (0..ATTEMPTS).any(|_| {
        let s = traced_sim(dir.path(), &sets, 4);
        let t = summary::load(&dir.path().join("trace.json")).unwrap();
        let f: Vec<f64> = t
            .actions
            .iter()
            .filter(|a| a.kind == Some(pipewright::schedule::ActionKind::F))
            .map(|a| (a.end_us - a.start_us) / 1e3)
            .collect();
        let (lo, hi) = f.iter().fold((f64::INFINITY, 0.0f64), |(l, h), &x| (l.min(x), h.max(x)));
        // ±30% around 10 ms, drawn per action: a spread of several ms.
        assert!(hi - lo > 3.0 && lo > 6.0, "F from {lo:.2} to {hi:.2} ms");
        let theory = s.theory_bubble_frac.expect("the schedule is known");
        seen.push(format!("bubble {:.4} vs theory at measured means {theory:.4}", s.bubble_frac));
        (s.bubble_frac - theory).abs() < 0.03
    });
    assert!(ok, "{}", seen.join("; "));
}

#[test]
fn the_sim_plot_is_one_svg_with_both_panels_and_their_axes() {
    let row = |pp, m, bubble: f64| pipewright::bench::SimRow {
        pp,
        microbatches: m,
        schedule: "1f1b".into(),
        measured_bubble: bubble + 0.01,
        theory_bubble: bubble,
        planned_bubble: bubble,
        within_target: true,
        overhead: 0.02,
        step_ms: 10.0,
        ideal_ms: 9.8,
    };
    let svg = pipewright::bench::sim_plot(&[row(2, 4, 0.2), row(4, 8, 0.27)]);
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let black_lines = doc
        .descendants()
        .filter(|n| n.has_tag_name("line") && n.attribute("stroke") == Some("black"))
        .count();
    assert_eq!(black_lines, 4, "an x and a y axis per panel");
    assert!(svg.contains("target 3%") && svg.contains("Runtime overhead"));
}
