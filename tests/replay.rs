//! Deterministic replay: record a run, replay each actor alone, re-run the whole
//! system under scrambled delivery, and catch (and pin down) what differs.

use pipewright::config::Config;
use pipewright::replay::{log_path, LogReader};
use pipewright::train::replay::{
    compare_logs, recorded_actors, replay_actor, replay_all, ReplayOptions, Verdict,
};
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
    record_from(cfg, dir, None, chaos)
}

fn record_from(cfg: &Config, dir: &Path, init: Option<&Path>, chaos: Option<u64>) -> PathBuf {
    let out = dir.join("run");
    let opts = TrainOptions {
        out_dir: out.clone(),
        init: init.map(Path::to_path_buf),
        force: true,
        progress: false,
        resume: false,
    };
    train_with(cfg, &opts, chaos).unwrap();
    out
}

fn from(step: Option<u64>) -> ReplayOptions {
    ReplayOptions { from_step: step, ..ReplayOptions::default() }
}

fn assert_identical(run: &Path, actor: &str, step: Option<u64>) -> usize {
    match replay_actor(run, actor, &from(step)).unwrap() {
        Verdict::Identical { entries, note: None, .. } => {
            assert!(entries > 0, "{actor}: nothing replayed");
            entries
        }
        v => panic!("{actor}: {v}"),
    }
}

fn assert_all_identical(verdicts: &[Verdict]) {
    assert!(!verdicts.is_empty());
    for v in verdicts {
        assert!(matches!(v, Verdict::Identical { note: None, .. }), "{v}");
    }
}

/// Byte offsets where each entry of a log ends (the trailer's start last).
fn entry_ends(bytes: &[u8]) -> Vec<usize> {
    let mut at = 16 + u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let mut ends = Vec::new();
    loop {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        if len == u64::MAX {
            return ends;
        }
        at += 8 + len as usize + 32;
        ends.push(at);
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
    // pp = 2 × dp = 2 on the arithmetic corpus with an evaluation and a
    // checkpoint: stages of both replicas, both loaders, the reducer, the
    // checkpointer and the coordinator (eval included).
    let cfg = config(&[
        "parallel.pp=2",
        "parallel.dp=2",
        "data.builtin=\"arithmetic\"",
        "train.eval_every=2",
        "checkpoint.every=1",
        "replay.payloads=[\"all\"]",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let run = record(&cfg, dir.path(), None);
    let actors = recorded_actors(&run).unwrap();
    let want = [
        "checkpointer",
        "coordinator",
        "loader-0",
        "loader-1",
        "reducer",
        "stage-0",
        "stage-0.1",
        "stage-1",
        "stage-1.1",
    ];
    assert_eq!(actors, want);
    for a in want {
        assert_identical(&run, a, None);
    }
    // One checkpoint per step, each file compared by digest.
    let (_, es) = LogReader::read_all(&log_path(&run, "checkpointer")).unwrap();
    assert_eq!(es.iter().map(|e| e.step).collect::<Vec<_>>(), [1, 2, 3]);
    let files: Vec<&str> = es[0].state.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(files, ["model.safetensors", "optimizer.safetensors", "state.json"]);
    // The monitor's output is timing (ms, tokens/s): not recorded, and said so.
    let e = replay_actor(&run, "monitor", &from(None)).unwrap_err().to_string();
    assert!(e.contains("monitor is not recorded") && e.contains("timing"), "{e}");
}

/// ZeRO-1's reduce-scatter and gathers (of updated shards, and of moments
/// for each checkpoint) are logged by the stages and the reducer, replay
/// alone identically, and log the same under scrambled delivery.
#[test]
fn a_zero_1_run_replays_every_actor_alone_and_logs_the_same_under_scrambled_delivery() {
    let cfg = config(&[
        "parallel.pp=2",
        "parallel.dp=2",
        "parallel.zero=1",
        "checkpoint.every=1",
        "replay.payloads=[\"all\"]",
    ]);
    // Two stages × two replicas, each sending shards of its updated
    // parameters (3 steps) and of its moments (checkpoints at steps 1, 2, 3).
    assert_eq!(replays_alone_and_scrambled_alike(&cfg, 5), 2 * 2 * (3 + 3));
}

/// Records `cfg`, replays every actor alone against its log, records it
/// again under scrambled delivery (`seed`) and compares every actor's logs;
/// returns how many `Gather`s the reducer logged.
fn replays_alone_and_scrambled_alike(cfg: &Config, seed: u64) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let run = record(cfg, dir.path(), None);
    let actors = recorded_actors(&run).unwrap();
    for a in &actors {
        assert_identical(&run, a, None);
    }
    let d = tempfile::tempdir().unwrap();
    let scrambled = record(cfg, d.path(), Some(seed));
    for a in &actors {
        let diff = compare_logs(a, &log_path(&run, a), &log_path(&scrambled, a)).unwrap();
        assert!(diff.is_none(), "{a}: {}", diff.unwrap());
    }
    let (_, es) = LogReader::read_all(&log_path(&run, "reducer")).unwrap();
    es.iter().filter(|e| e.kind == "Gather").count()
}

/// ZeRO-3's many gathers a step (a chunk's weights for each action, its
/// weights and moments for each checkpoint, the weights for evaluation and
/// at the end) replay alone identically and log the same under scrambled
/// delivery: the reducer numbers each stage's gathers of a step by round.
#[test]
fn a_zero_3_run_replays_every_actor_alone_and_logs_the_same_under_scrambled_delivery() {
    let cfg = config(&[
        "parallel.pp=2",
        "parallel.dp=2",
        "parallel.zero=3",
        "checkpoint.every=2",
        "replay.payloads=[\"all\"]",
    ]);
    let (steps, m) = (cfg.train.steps, cfg.parallel.microbatches);
    let checkpoints = steps / 2 + usize::from(!steps.is_multiple_of(2));
    // Per stage and replica: a gather for each F and B of each step, one per
    // checkpoint, one for the evaluation after the last step, and one at the
    // end for the weights.
    let per = steps * 2 * m + checkpoints + 2;
    assert_eq!(replays_alone_and_scrambled_alike(&cfg, 7), 2 * 2 * per, "{steps} steps of {m} microbatches");
}

/// With an EMA of the weights (optim.ema_decay) its shards ride in the
/// checkpoints' gathers and have one gather of their own at the end, and
/// every actor still replays alone identically.
#[test]
fn a_zero_1_run_with_an_ema_replays_every_actor_alone_identically() {
    let cfg = config(&[
        "parallel.pp=2",
        "parallel.dp=2",
        "parallel.zero=1",
        "checkpoint.every=1",
        "optim.ema_decay=0.9",
        "replay.payloads=[\"all\"]",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let run = record(&cfg, dir.path(), None);
    for a in &recorded_actors(&run).unwrap() {
        assert_identical(&run, a, None);
    }
    let (_, es) = LogReader::read_all(&log_path(&run, "reducer")).unwrap();
    // As without an EMA (3 updates, 3 checkpoints), plus the EMA gathered whole at the end.
    let gathers = es.iter().filter(|e| e.kind == "Gather").count();
    assert_eq!(gathers, 2 * 2 * (3 + 3 + 1));
}

#[test]
fn a_checkpointer_that_writes_other_bytes_is_caught() {
    let cfg = config(&["checkpoint.every=2", "replay.payloads=[\"checkpointer\"]"]);
    let dir = tempfile::tempdir().unwrap();
    let run = record(&cfg, dir.path(), None);
    let path = log_path(&run, "checkpointer");
    let (h, mut es) = LogReader::read_all(&path).unwrap();
    // A recording whose snapshot said another learning rate: the state.json
    // the replay writes is not the one recorded.
    let blob = es[0].inputs.iter_mut().find(|b| b.name == "state").unwrap();
    let mut state: pipewright::checkpoint::StateFile = serde_json::from_str(&blob.to_str().unwrap()).unwrap();
    state.lr_schedule.next_lr = 0.5;
    *blob = pipewright::replay::Blob::str("state", &serde_json::to_string(&state).unwrap());
    let mut w = pipewright::replay::LogWriter::create(&path, &h).unwrap();
    for e in es {
        w.append(e).unwrap();
    }
    w.finish().unwrap();
    match replay_actor(&run, "checkpointer", &from(None)).unwrap() {
        Verdict::Diverged(d) => {
            assert_eq!((d.step, d.kind.as_str()), (2, "Write"), "{d}");
            assert!(d.what.contains("state `state.json`"), "{d}");
        }
        v => panic!("{v}"),
    }
}

#[test]
fn digest_only_logs_replay_the_loader_and_coordinator_and_say_what_a_stage_needs() {
    let cfg = config(&["parallel.pp=2", "checkpoint.every=2"]);
    let dir = tempfile::tempdir().unwrap();
    let run = record(&cfg, dir.path(), None);
    assert_identical(&run, "loader-0", None);
    assert_identical(&run, "coordinator", None);
    let e = replay_actor(&run, "stage-1", &from(None)).unwrap_err().to_string();
    assert!(e.contains("stage-1.log") && e.contains("--record-payloads stage-1"), "{e}");
    let e = replay_actor(&run, "checkpointer", &from(None)).unwrap_err().to_string();
    assert!(e.contains("checkpointer.log") && e.contains("--record-payloads checkpointer"), "{e}");
    let e = replay_actor(&run, "stage-7", &from(None)).unwrap_err().to_string();
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
        let e = replay_actor(&run, "stage-0", &from(Some(3))).unwrap_err().to_string();
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
    // The report names the parameter: one of stage 1's biases (layer 1's or the final norm's).
    let at = out.split("(at grad_sumsq[").nth(1).expect("the element, named").split(';').next().unwrap();
    let named = at.split("the Σg² of ").nth(1).expect("the parameter's name");
    assert!(
        (named.starts_with("layers.1.") || named.starts_with("norm.")) && named.contains(".bias"),
        "{out}"
    );
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

#[test]
fn a_run_from_init_weights_replays_identically_alone_and_whole() {
    let dir = tempfile::tempdir().unwrap();
    // Weights to start from: what a short unrecorded run ends with.
    let warm = dir.path().join("warm");
    let mut c = config(&["train.steps=1"]);
    c.replay.record = false;
    let opts =
        TrainOptions { out_dir: warm.clone(), init: None, force: true, progress: false, resume: false };
    train_with(&c, &opts, None).unwrap();
    let init = dir.path().join("init.safetensors");
    std::fs::copy(warm.join("model.safetensors"), &init).unwrap();

    let cfg = config(&["parallel.pp=2", "replay.payloads=[\"all\"]"]);
    let run = record_from(&cfg, dir.path(), Some(&init), None);
    for a in ["stage-0", "stage-1", "coordinator", "loader-0"] {
        assert_identical(&run, a, None);
    }
    let out = dir.path().join("again");
    assert_all_identical(&replay_all(&run, &out, &from(None), None).unwrap());

    // The weights changed, or are gone: refused, naming the file.
    let good = std::fs::read(&init).unwrap();
    let mut other = good.clone();
    let n = other.len();
    other[n - 1] ^= 1;
    std::fs::write(&init, &other).unwrap();
    let e = replay_actor(&run, "stage-0", &from(None)).unwrap_err().to_string();
    assert!(e.contains("init.safetensors") && e.contains("changed since the run"), "{e}");
    std::fs::remove_file(&init).unwrap();
    for e in [
        replay_actor(&run, "stage-1", &from(None)).unwrap_err(),
        replay_all(&run, &dir.path().join("again2"), &from(None), None).unwrap_err(),
    ] {
        let e = format!("{e:#}");
        assert!(e.contains("init.safetensors") && e.contains("cannot read the --init weights"), "{e}");
    }
}

#[test]
fn a_log_cut_at_or_inside_an_entry_is_truncated_not_complete() {
    let cfg = config(&["parallel.pp=2", "replay.payloads=[\"stage-1\"]"]);
    let dir = tempfile::tempdir().unwrap();
    let run = record(&cfg, dir.path(), None);
    let r = run.to_str().unwrap();
    let path = log_path(&run, "stage-1");
    let good = std::fs::read(&path).unwrap();
    let ends = entry_ends(&good);
    assert!(ends.len() > 6);
    for (cut, what) in [
        (ends[4], "truncated after entry 4 (5 complete entries)"),
        (ends[4] + 20, "truncated inside entry 5"),
        (*ends.last().unwrap(), &format!("truncated after entry {}", ends.len() - 1) as &str),
    ] {
        std::fs::write(&path, &good[..cut]).unwrap();
        let (code, out, err) = pipewright(&["replay", r, "--actor", "stage-1"], &[]);
        assert_eq!(code, 2, "{cut}: {out}{err}");
        assert!(err.contains("stage-1.log") && err.contains(what), "{err}");
        assert!(err.contains("--allow-truncated"), "{err}");
        // --all refuses before it runs anything.
        let (code, out, err) = pipewright(&["replay", r, "--all"], &[]);
        assert_eq!(code, 2, "{out}{err}");
        assert!(err.contains("stage-1.log") && err.contains(what), "{err}");
        assert!(!err.contains("re-running"), "{err}");
    }
    // With --allow-truncated: the entries present, and said so.
    std::fs::write(&path, &good[..ends[4] + 20]).unwrap();
    let (code, out, err) = pipewright(&["replay", r, "--actor", "stage-1", "--allow-truncated"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("stage-1: identical: 5 messages") && out.contains("as far as recorded"), "{out}");
    let (code, out, err) = pipewright(&["replay", r, "--all", "--allow-truncated"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("stage-1: identical: 5 messages") && l.contains("cut inside entry 5")),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("stage-0: identical")), "{out}");
    std::fs::write(&path, &good).unwrap();
    let (code, out, _) = pipewright(&["replay", r, "--all"], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("as far as recorded"), "{out}");
}

#[test]
fn a_resumed_run_replays_from_its_pinned_checkpoint_and_its_first_part_too() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let r = run.to_str().unwrap();
    let mut args =
        vec!["train", "--out", r, "--record-payloads", "all", "--max-restarts", "1", "--steps", "6"];
    for s in [
        "model.n_layer=2",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=16",
        "train.micro_batch_size=2",
        "parallel.microbatches=4",
        "parallel.pp=2",
        "train.eval_every=0",
        "checkpoint.every=1",
        "checkpoint.keep=2",
    ] {
        args.extend(["--set", s]);
    }
    // Stage 1 fails once in step 3; the run finishes writing the checkpoint of
    // step 3 it had handed over, and restarts from it.
    let env = [("PIPEWRIGHT_FAULT", "stage=1,step=3,mb=0"), ("PIPEWRIGHT_FAULT_ONCE", "1")];
    let (code, _, err) = pipewright(&args, &env);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("restarting from the latest checkpoint"), "{err}");
    let dirs = pipewright::train::replay::log_dirs(&run);
    assert_eq!(dirs, ["replay", "replay.before-step-3"]);
    // Retention kept the two newest and the one the logs start from.
    let (done, _) = pipewright::checkpoint::list(&run.join("checkpoints")).unwrap();
    assert_eq!(done.iter().map(|d| d.0).collect::<Vec<_>>(), [3, 5, 6]);
    assert_eq!(std::fs::read_to_string(run.join("checkpoints/pinned.json")).unwrap(), "[3]");

    for (a, steps) in
        [("stage-1", "(steps 3–5)"), ("coordinator", "(steps 3–6)"), ("checkpointer", "(steps 4–6)")]
    {
        let (code, out, err) = pipewright(&["replay", r, "--actor", a], &[]);
        assert_eq!(code, 0, "{a}: {out}{err}");
        assert!(out.contains(&format!("{a}: identical")) && out.contains(steps), "{out}");
    }
    let (code, out, err) = pipewright(&["replay", r, "--all"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("from the checkpoint of step 3"), "{err}");
    assert!(out.contains("the whole run replayed identically"), "{out}");

    // The part before the restart: stage 1 failed inside step 3, so its log
    // has no end marker, nor has the coordinator's (the run did not complete).
    let before = ["--log-dir", "replay.before-step-3"];
    let (code, _, err) = pipewright(&[&["replay", r, "--actor", "stage-1"][..], &before].concat(), &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("replay.before-step-3/stage-1.log: truncated after entry"), "{err}");
    let cmd = [&["replay", r, "--actor", "stage-1", "--allow-truncated"][..], &before].concat();
    let (code, out, err) = pipewright(&cmd, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("stage-1: identical") && out.contains("as far as recorded"), "{out}");
    let (code, out, err) = pipewright(&[&["replay", r, "--all"][..], &before].concat(), &[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("--allow-truncated") && !err.contains("re-running"), "{err}");
    let (code, out, err) =
        pipewright(&[&["replay", r, "--all", "--allow-truncated"][..], &before].concat(), &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("coordinator: identical") && out.contains("the whole run replayed identically"),
        "{out}"
    );
}

#[test]
fn from_step_refuses_a_checkpoint_of_another_run_naming_both_hashes() {
    let extra = ["parallel.pp=2", "checkpoint.every=2", "train.steps=4", "replay.payloads=[\"stage-1\"]"];
    let dir = tempfile::tempdir().unwrap();
    let run = record(&config(&extra), dir.path(), None);
    let other_dir = tempfile::tempdir().unwrap();
    let other_cfg = config(&[&extra[..], &["train.seed=7"]].concat());
    let other = record(&other_cfg, other_dir.path(), None);
    assert_identical(&run, "stage-1", Some(2));
    let step2 = |r: &Path| r.join("checkpoints").join(pipewright::checkpoint::step_dir_name(2));
    std::fs::remove_dir_all(step2(&run)).unwrap();
    std::fs::create_dir(step2(&run)).unwrap();
    for f in ["model.safetensors", "optimizer.safetensors", "state.json"] {
        std::fs::copy(step2(&other).join(f), step2(&run).join(f)).unwrap();
    }
    let hash = |r: &Path| LogReader::read_all(&log_path(r, "stage-1")).unwrap().0.config_hash;
    let (mine, theirs) = (hash(&run), hash(&other));
    assert_ne!(mine, theirs);
    for a in ["stage-1", "coordinator"] {
        let e = replay_actor(&run, a, &from(Some(2))).unwrap_err().to_string();
        assert!(e.contains("step_00000002/state.json") && e.contains("belongs to another run"), "{e}");
        assert!(e.contains(&theirs) && e.contains(&mine), "{e}");
    }
}

#[test]
fn a_log_copied_in_from_a_run_with_another_seed_is_refused_alone_naming_both_runs() {
    let extra = ["replay.payloads=[\"stage-0\"]"];
    let dir = tempfile::tempdir().unwrap();
    let run = record(&config(&extra), dir.path(), None);
    let other_dir = tempfile::tempdir().unwrap();
    let other = record(&config(&[&extra[..], &["train.seed=7"]].concat()), other_dir.path(), None);
    assert_identical(&other, "stage-0", None);
    std::fs::copy(log_path(&other, "stage-0"), log_path(&run, "stage-0")).unwrap();
    let e = replay_actor(&run, "stage-0", &from(None)).unwrap_err().to_string();
    assert!(e.contains("stage-0.log: recorded by another run than"), "{e}");
    // Alone in its directory it is still measured against the run's config.toml.
    for a in recorded_actors(&run).unwrap().iter().filter(|a| *a != "stage-0") {
        std::fs::remove_file(log_path(&run, a)).unwrap();
    }
    let e = replay_actor(&run, "stage-0", &from(None)).unwrap_err().to_string();
    assert!(e.contains("recorded by another run") && e.contains("train.seed 7 in the log"), "{e}");
    assert!(e.contains("config.toml"), "{e}");
}
