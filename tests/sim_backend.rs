//! The simulated backend runs the real actors, messages and schedules with
//! sleeping stages. These tests check what a run does, not how long it takes:
//! each rank ran its schedule list in order, one action at a time, no action
//! started before its inputs could exist, and the bubble of the order the
//! runtime recorded, replayed at the sim's declared costs, is the schedule
//! simulator's and the planner's exactly. How close the measured (wall-clock)
//! bubble and step come to theory depends on the machine's load, so that is
//! what `pipewright bench --sim` measures and docs/benchmarks.md reports, never
//! an assertion here. In its own binary, and its runs take turns
//! (`ONE_AT_A_TIME`) so a test's sleeping stages do not crowd another's.

use pipewright::config::Config;
use pipewright::schedule::{Action, Costs, Schedule};
use pipewright::trace::summary::{self, Trace};
use std::path::Path;

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The checks every traced sim run must pass, whatever the machine's load,
/// over every step of replica 0. Returns each rank's recorded list (the same
/// for every step, or the check fails).
///
/// - Each rank's actions, in the order its compute thread started them, are
///   its list in `schedule`: every action where the schedule puts it.
/// - A rank runs one action at a time: each starts after the previous ended.
/// - Each action lasts at least its least cost, and no action starts before
///   its inputs could exist: F(s, mb) starts at least the least cost of
///   F(s − 1, mb) after that one started, likewise a backward after the
///   backward of stage s + 1. The least cost is the declared one shrunk by
///   `jitter`; a stage sleeps at least that long before it sends (a sleep
///   never ends early), so load can only widen these gaps, never close them.
fn recorded_lists(t: &Trace, schedule: &Schedule, costs: &Costs, jitter: f64) -> Vec<Vec<Action>> {
    let mut steps: Vec<u64> = t.actions.iter().filter(|a| a.replica == 0).map(|a| a.step).collect();
    steps.sort();
    steps.dedup();
    assert!(!steps.is_empty(), "{}: no actions of replica 0", t.path.display());
    let least_us = |a: &Action| 1e3 * costs.of(a) * (1.0 - jitter);
    let mut lists = Vec::new();
    for step in steps {
        let mut lanes: Vec<Vec<&summary::Span>> = vec![Vec::new(); schedule.ranks];
        for a in t.actions.iter().filter(|a| a.replica == 0 && a.step == step) {
            assert!(
                a.rank < schedule.ranks,
                "step {step}: an action on rank {} of {}",
                a.rank,
                schedule.ranks
            );
            lanes[a.rank].push(a);
        }
        lists.clear();
        for (rank, lane) in lanes.iter_mut().enumerate() {
            lane.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
            for w in lane.windows(2) {
                assert!(
                    w[1].start_us >= w[0].end_us,
                    "step {step}, rank {rank}: {} started at {} µs, before {} ended at {} µs",
                    action(w[1]),
                    w[1].start_us,
                    action(w[0]),
                    w[0].end_us
                );
            }
            for a in lane.iter() {
                // One µs for the trace's rounding of timestamps, here and below.
                let took = a.end_us - a.start_us;
                assert!(took + 1.0 >= least_us(&action(a)), "step {step}: {} took {took} µs", action(a));
            }
            let list: Vec<Action> = lane.iter().map(|a| action(a)).collect();
            assert_eq!(list, schedule.actions[rank], "step {step}, rank {rank}: the order the runtime ran");
            lists.push(list);
        }
        let start = |a: Action| {
            lanes[schedule.rank_of(a.stage)].iter().find(|s| action(s) == a).map(|s| s.start_us).unwrap()
        };
        for a in lists.iter().flatten() {
            for input in inputs(a, schedule.stages()) {
                let gap = start(*a) - start(input);
                assert!(
                    gap + 1.0 >= least_us(&input),
                    "step {step}: {a} started {gap} µs after {input} began, which sleeps at least {} µs \
                     before sending what {a} needs",
                    least_us(&input)
                );
            }
        }
    }
    lists
}

fn action(s: &summary::Span) -> Action {
    Action {
        stage: s.stage,
        kind: s.kind.expect("an action span has a kind"),
        mb: s.mb.expect("an action span has a microbatch"),
    }
}

/// The actions whose output `a` needs (the simulator's rule): the F of the
/// stage before for an F, the backward of the stage after for a B or I (whose
/// own F ran earlier on the same rank), the I for a W.
fn inputs(a: &Action, stages: usize) -> Vec<Action> {
    use pipewright::schedule::ActionKind::*;
    let at = |stage, kind| Action { stage, kind, mb: a.mb };
    match a.kind {
        F if a.stage > 0 => vec![at(a.stage - 1, F)],
        B if a.stage + 1 < stages => vec![at(a.stage + 1, B)],
        I if a.stage + 1 < stages => vec![at(a.stage + 1, I)],
        W => vec![at(a.stage, I)],
        _ => vec![],
    }
}

/// A traced sim run of `sets`, checked by [`recorded_lists`]. The bubble of
/// the recorded lists replayed at the declared costs must be the simulator's
/// and the CPU planner's, exactly (same order, same costs, same arithmetic),
/// and the closed form's where the schedule has one. Returns the trace, the
/// lists and that bubble.
fn check_sim_run(dir: &Path, sets: &[String], steps: usize) -> (Trace, Vec<Vec<Action>>, f64) {
    let cfg = Config::load(None, sets).unwrap();
    let schedule = pipewright::actors::Layout::from_config(&cfg).unwrap().schedule;
    let costs = pipewright::plan::cpu::sim_costs(&cfg);
    let theory = schedule.simulate(&costs).unwrap().mean_bubble_frac;
    traced_sim(dir, sets, steps);
    let t = summary::load(&dir.join("trace.json")).unwrap();
    let what = format!("{} pp={} m={}", schedule.kind, schedule.ranks, schedule.microbatches);
    let lists = recorded_lists(&t, &schedule, &costs, cfg.sim.jitter);
    let replayed =
        Schedule::from_lists(lists.clone()).and_then(|s| s.simulate(&costs)).unwrap().mean_bubble_frac;
    assert_eq!(replayed, theory, "{what}: replayed bubble vs the simulator's");
    assert_eq!(pipewright::plan::cpu::plan(&cfg).unwrap().bubble, theory, "{what}: the planner's bubble");
    if costs.per_stage_factor.is_empty() && costs.backward == 2.0 * costs.forward {
        let closed = schedule.theory_bubble().expect("gpipe and 1f1b have a closed form");
        assert!((replayed - closed).abs() < 1e-12, "{what}: replayed {replayed} vs (p−1)/(m+p−1) = {closed}");
    }
    (t, lists, replayed)
}

/// `bench --sim`'s action times: 2 ms forward, 4 ms backward (I = W = 2 ms).
fn bench_costs(schedule: &str) -> Vec<String> {
    vec![
        format!("parallel.schedule=\"{schedule}\""),
        "sim.forward_ms=2".into(),
        "sim.backward_ms=4".into(),
        "sim.weight_ms=2".into(),
    ]
}

#[test]
fn each_rank_runs_its_schedule_in_order_and_the_replayed_bubble_is_theory() {
    let _turn = turn();
    let dir = tempfile::tempdir().unwrap();
    for schedule in ["1f1b", "gpipe"] {
        for (pp, m) in [(2, 4), (4, 8), (4, 16)] {
            check_sim_run(dir.path(), &sim_config(pp, m, &bench_costs(schedule)), 2);
        }
    }
}

/// The issue's own cell at the bench's costs: pp = 8, m = 32, 2 ms forward and
/// 4 ms backward, eight stage threads on however few cores CI has. How long
/// the steps took is `bench --sim`'s to report; what the runtime did is here.
#[test]
fn headline_cell_runs_the_schedule_and_replays_to_the_theory_bubble_at_bench_costs() {
    let _turn = turn();
    let dir = tempfile::tempdir().unwrap();
    for schedule in ["1f1b", "gpipe"] {
        check_sim_run(dir.path(), &sim_config(8, 32, &bench_costs(schedule)), 2);
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

/// Runs `pipewright train --trace` on a sim config, writing `dir/trace.json`.
fn traced_sim(dir: &Path, sets: &[String], steps: usize) {
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
}

#[test]
fn stage_factors_of_the_wrong_length_are_refused_naming_the_field() {
    let sets = sim_config(4, 8, &["sim.stage_factors=[1.0, 2.0]".into()]);
    let e = Config::load(None, &sets).and_then(|c| c.validate().map(|_| c)).unwrap_err().to_string();
    assert!(e.contains("sim.stage_factors") && e.contains("4"), "{e}");
    let ok = sim_config(4, 8, &["sim.stage_factors=[1.0, 1.0, 2.0, 1.0]".into()]);
    Config::load(None, &ok).unwrap().validate().unwrap();
}

/// A stage twice as slow as the others: the run sleeps the factor (each of
/// that stage's actions lasts at least twice the others' declared cost), the
/// bubble of its recorded order at the declared costs is the simulator's and
/// the planner's for those factors, and `trace summary` of that replay names
/// the stage as the bottleneck at exactly twice the median lane.
#[test]
fn a_slow_stage_sets_the_replayed_bubble_and_is_the_bottleneck_of_the_replay() {
    let _turn = turn();
    let dir = tempfile::tempdir().unwrap();
    let sets = sim_config(4, 8, &["sim.stage_factors=[1.0, 1.0, 2.0, 1.0]".into()]);
    let cfg = Config::load(None, &sets).unwrap();
    let schedule = pipewright::actors::Layout::from_config(&cfg).unwrap().schedule;
    let costs = pipewright::plan::cpu::sim_costs(&cfg);
    let even = schedule
        .simulate(&pipewright::plan::cpu::sim_costs(&Config::load(None, &sim_config(4, 8, &[])).unwrap()));
    let (t, lists, replayed) = check_sim_run(dir.path(), &sets, 2);
    assert!(replayed > even.unwrap().mean_bubble_frac + 0.05, "the slow stage must matter");
    let f_ms = |stage: usize| {
        t.actions
            .iter()
            .filter(|a| a.stage == stage && a.kind == Some(pipewright::schedule::ActionKind::F))
            .map(|a| (a.end_us - a.start_us) / 1e3)
            .fold(f64::INFINITY, f64::min)
    };
    assert!(f_ms(2) >= 2.0 * cfg.sim.forward_ms, "stage 2's shortest F: {} ms", f_ms(2));

    let replay = Schedule::from_lists(lists).unwrap();
    let report = replay.simulate(&costs).unwrap();
    let records = pipewright::trace::simulated::simulated_records(&replay, &report, 1e3);
    let meta = pipewright::trace::simulated::simulated_meta(&replay, &costs, 1e3);
    let json = pipewright::trace::chrome_json(&records, meta).to_string();
    let s = summary::summarize(&summary::parse(&json, Path::new("replay.json")).unwrap()).unwrap();
    let b = s.bottleneck.clone().expect("four lanes");
    assert_eq!((b.stage, b.vs_median), (2, 2.0), "{}", s.text());
    assert!(s.text().contains("bottleneck: stage 2"), "{}", s.text());
}

/// Jitter draws each action's time around its cost, yet the runtime still
/// runs the schedule in order and its replay at the declared (mean) costs is
/// theory. The F times spread over several ms: drawn within ±30% of 10 ms
/// (the least, 7 ms, is checked for every action), their spread can only
/// vanish if every draw under 10 ms woke over 3 ms late.
#[test]
fn jitter_varies_action_times_and_the_schedule_still_holds() {
    let _turn = turn();
    let dir = tempfile::tempdir().unwrap();
    let sets = sim_config(4, 8, &["sim.jitter=0.3".into()]);
    let (t, _, _) = check_sim_run(dir.path(), &sets, 2);
    let f: Vec<f64> = t
        .actions
        .iter()
        .filter(|a| a.kind == Some(pipewright::schedule::ActionKind::F))
        .map(|a| (a.end_us - a.start_us) / 1e3)
        .collect();
    let (lo, hi) = f.iter().fold((f64::INFINITY, 0.0f64), |(l, h), &x| (l.min(x), h.max(x)));
    assert!(hi - lo > 3.0, "F from {lo:.2} to {hi:.2} ms");
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
