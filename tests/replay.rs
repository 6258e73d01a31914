//! Deterministic replay: record a run, replay each actor alone, re-run the whole
//! system under scrambled delivery, and catch (and pin down) what differs.

use pipewright::config::Config;
use pipewright::replay::run::{compare_logs, recorded_actors, replay_actor, Verdict};
use pipewright::replay::{log_path, LogReader};
use pipewright::train::run::{train_with, TrainOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

const TINY: &[&str] = &[
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "train.micro_batch_size=2",
    "train.steps=3",
    "train.eval_every=0",
    "parallel.microbatches=4",
    "optim.warmup_steps=1",
    "replay.record=true",
];

fn config(extra: &[&str]) -> Config {
    let o: Vec<String> = TINY.iter().chain(extra).map(|s| s.to_string()).collect();
    Config::load(None, &o).unwrap()
}

fn record(cfg: &Config, dir: &Path, chaos: Option<u64>) -> PathBuf {
    let out = dir.join("run");
    let opts = TrainOptions { out_dir: out.clone(), init: None, force: true, progress: false, resume: false };
    train_with(cfg, &opts, chaos).unwrap();
    out
}

fn assert_identical(run: &Path, actor: &str, from: Option<u64>) -> usize {
    match replay_actor(run, actor, from).unwrap() {
        Verdict::Identical { entries, .. } => {
            assert!(entries > 0, "{actor}: nothing replayed");
            entries
        }
        Verdict::Diverged(d) => panic!("{actor}: {d}"),
    }
}

fn pipewright(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn every_actor_kind_replays_alone_identically() {
    // pp = 2 × dp = 2 on the arithmetic corpus with an evaluation: stages of both
    // replicas, both loaders, the reducer and the coordinator (eval included).
    let cfg = config(&[
        "parallel.pp=2",
        "parallel.dp=2",
        "data.builtin=\"arithmetic\"",
        "train.eval_every=2",
        "replay.payloads=[\"all\"]",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let run = record(&cfg, dir.path(), None);
    let actors = recorded_actors(&run).unwrap();
    let want =
        ["coordinator", "loader-0", "loader-1", "reducer", "stage-0", "stage-0.1", "stage-1", "stage-1.1"];
    assert_eq!(actors, want);
    for a in want {
        assert_identical(&run, a, None);
    }
}

#[test]
fn digest_only_logs_replay_the_loader_and_coordinator_and_say_what_a_stage_needs() {
    let cfg = config(&["parallel.pp=2"]);
    let dir = tempfile::tempdir().unwrap();
    let run = record(&cfg, dir.path(), None);
    assert_identical(&run, "loader-0", None);
    assert_identical(&run, "coordinator", None);
    let e = replay_actor(&run, "stage-1", None).unwrap_err().to_string();
    assert!(e.contains("stage-1.log") && e.contains("--record-payloads stage-1"), "{e}");
    let e = replay_actor(&run, "stage-7", None).unwrap_err().to_string();
    assert!(e.contains("stage-7.log") && e.contains("stage-0, stage-1"), "{e}");
}

#[test]
fn scrambled_delivery_gives_identical_logs_for_every_actor() {
    for pp in ["parallel.pp=2", "parallel.pp=1"] {
        let cfg = config(&[pp, "parallel.dp=2"]);
        let base_dir = tempfile::tempdir().unwrap();
        let base = record(&cfg, base_dir.path(), None);
        let actors = recorded_actors(&base).unwrap();
        for seed in [1, 2, 3] {
            let d = tempfile::tempdir().unwrap();
            let run = record(&cfg, d.path(), Some(seed));
            assert_eq!(recorded_actors(&run).unwrap(), actors);
            for a in &actors {
                let diff = compare_logs(a, &log_path(&base, a), &log_path(&run, a)).unwrap();
                assert!(diff.is_none(), "{pp} seed {seed}: {}", diff.unwrap());
            }
        }
    }
}

#[test]
fn interleaved_and_zero_bubble_stages_replay_identically_and_from_a_checkpoint() {
    for extra in [
        &["parallel.pp=2", "parallel.schedule=\"interleaved\"", "parallel.chunks=2"][..],
        &["parallel.pp=2", "parallel.schedule=\"zb-h1\""][..],
    ] {
        let mut e = extra.to_vec();
        e.extend(["model.n_layer=4", "replay.payloads=[\"stage-0\", \"stage-1\"]", "checkpoint.every=2"]);
        e.push("train.steps=4");
        let cfg = config(&e);
        let dir = tempfile::tempdir().unwrap();
        let run = record(&cfg, dir.path(), None);
        assert_identical(&run, "stage-0", None);
        let all = assert_identical(&run, "stage-1", None);
        // From the step-2 checkpoint: fewer entries, same verdict.
        let later = assert_identical(&run, "stage-1", Some(2));
        assert!(later < all, "{later} vs {all}");
        assert_identical(&run, "coordinator", Some(2));
        let e = replay_actor(&run, "stage-0", Some(3)).unwrap_err().to_string();
        assert!(e.contains("no complete checkpoint of step 3") && e.contains("there are: 2, 4"), "{e}");
    }
}

#[test]
fn a_nondeterministic_kernel_is_caught_and_pinned_to_its_stage_and_message() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let args = [
        "train",
        "--out",
        run.to_str().unwrap(),
        "--record-payloads",
        "all",
        "--set",
        "model.n_layer=2",
        "--set",
        "model.n_embd=32",
        "--set",
        "model.n_head=2",
        "--set",
        "model.block_size=16",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "parallel.microbatches=4",
        "--set",
        "train.eval_every=0",
        "--steps",
        "2",
    ];
    // Stage 1's bias gradients are summed in a random row order.
    let (code, _, err) = pipewright(&args, &[("PIPEWRIGHT_NONDET", "stage-1")]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = pipewright(&["replay", run.to_str().unwrap(), "--actor", "stage-0"], &[]);
    assert_eq!(code, 0, "stage 0 is deterministic: {out}");
    assert!(out.contains("stage-0: identical"), "{out}");
    let (code, out, _) = pipewright(&["replay", run.to_str().unwrap(), "--actor", "stage-1"], &[]);
    assert_eq!(code, 1, "{out}");
    // The first thing that shows it: the squared gradient norms stage 1 reports
    // at the end of step 0 (its weight gradients are not sent anywhere else).
    assert!(out.starts_with("stage-1 diverges at seq"), "{out}");
    assert!(out.contains("step 0,") && out.contains("output of StageDone to coordinator"), "{out}");
    assert!(out.contains("`grad_sumsq` differs") && out.contains("max abs diff"), "{out}");
    // The whole-run replay shows the same first divergence on stage 1.
    let (code, out, _) = pipewright(&["replay", run.to_str().unwrap(), "--all"], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("loader-0: identical"), "{out}");
    assert!(out.lines().any(|l| l.starts_with("stage-1 diverges at seq") && l.contains("step 0,")), "{out}");
}

#[test]
fn tampered_truncated_and_garbage_logs_are_named_errors() {
    let cfg = config(&["parallel.pp=2", "replay.payloads=[\"stage-1\"]"]);
    let dir = tempfile::tempdir().unwrap();
    let run = record(&cfg, dir.path(), None);
    let path = log_path(&run, "stage-1");
    let good = std::fs::read(&path).unwrap();
    let r = run.to_str().unwrap();

    // Flip a byte in the middle of the log: the chain digest says where.
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x40;
    std::fs::write(&path, &bad).unwrap();
    let (code, _, err) = pipewright(&["replay", r, "--actor", "stage-1"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("stage-1.log") && err.contains("was altered after recording"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    std::fs::write(&path, &good[..good.len() - 100]).unwrap();
    let (code, _, err) = pipewright(&["replay", r, "--actor", "stage-1"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("stage-1.log") && err.contains("truncated"), "{err}");

    std::fs::write(&path, b"\x00garbage").unwrap();
    let (code, _, err) = pipewright(&["replay", r, "--actor", "stage-1"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("stage-1.log") && err.contains("not a pipewright replay log"), "{err}");

    // Back to the good log: identical again.
    std::fs::write(&path, &good).unwrap();
    let (code, out, _) = pipewright(&["replay", r, "--actor", "stage-1"], &[]);
    assert_eq!(code, 0, "{out}");
    let (_, entries) = LogReader::read_all(&path).unwrap();
    assert!(out.contains(&format!("identical: {} messages", entries.len())), "{out}");
}

#[test]
fn bad_replay_payload_names_are_refused_naming_the_field() {
    let o = ["replay.payloads=[\"stage-9\"]".to_string()];
    let e = Config::load(None, &o).unwrap().validate().unwrap_err().to_string();
    assert!(e.contains("replay.payloads") && e.contains("stage-9"), "{e}");
    let o = ["parallel.pp=2".to_string(), "replay.payloads=[\"stage-1\", \"reducer\"]".to_string()];
    let e = Config::load(None, &o).unwrap().validate().unwrap_err().to_string();
    assert!(e.contains("\"reducer\""), "{e}");
}
