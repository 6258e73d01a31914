//! Checkpoints as a user depends on them: a resumed run ends with the same
//! bits as one never interrupted, whatever killed it and whatever the layout
//! it resumes with; a damaged checkpoint is named and an older one used;
//! nothing saved before is ever lost; signals and failures end a run cleanly.

mod common;
use common::{kill_at_random_moment, tmps, wait_for_steps, Kill};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TINY: [&str; 18] = [
    "--set",
    "model.n_layer=4",
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
    "--set",
    "checkpoint.every=2",
    "--set",
    "train.eval_batches=2",
];

fn cmd(args: &[&str], extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.args(args).args(TINY).args(extra);
    c
}

fn run(args: &[&str], extra: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut c = cmd(args, extra);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    (out.status.success(), err)
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

fn digest(dir: &Path) -> String {
    summary(dir)["weights_digest"].as_str().unwrap().to_string()
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// (loss, grad_norm) of every step as f64 bits; a skipped step's are null.
fn loss_bits(dir: &Path) -> Vec<(Option<u64>, Option<u64>)> {
    let bits = |v: &serde_json::Value| v.as_f64().map(f64::to_bits);
    metrics(dir).iter().map(|m| (bits(&m["loss"]), bits(&m["grad_norm"]))).collect()
}

fn state(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).unwrap()).unwrap()
}

/// An uninterrupted run at pp = 2, in `dir/name`.
fn full_run_with(dir: &Path, name: &str, steps: &str, extra: &[&str], env: &[(&str, &str)]) -> PathBuf {
    let out = dir.join(name);
    let mut args = vec!["--set", "parallel.pp=2"];
    args.extend_from_slice(extra);
    let (ok, err) = run(&["train", "--steps", steps, "--out", out.to_str().unwrap()], &args, env);
    assert!(ok, "{err}");
    out
}

fn full_run(dir: &Path, steps: &str) -> String {
    digest(&full_run_with(dir, "full", steps, &[], &[]))
}

#[test]
fn a_crashed_run_resumed_at_any_layout_ends_with_the_uninterrupted_bits() {
    let dir = tempfile::tempdir().unwrap();
    let full = full_run_with(dir.path(), "full", "9", &[], &[]);
    let (want, want_losses) = (digest(&full), loss_bits(&full));
    for (pp, resume_pp) in [("1", "1"), ("4", "4"), ("4", "2")] {
        let out = dir.path().join(format!("crash-{pp}-{resume_pp}"));
        let o = out.to_str().unwrap();
        let (ok, err) = run(
            &["train", "--steps", "9", "--out", o],
            &["--set", &format!("parallel.pp={pp}")],
            &[("PIPEWRIGHT_FAULT", "stage=0,step=7,mb=1")],
        );
        assert!(!ok && err.contains("step 7"), "{err}");
        let (ok, err) = run(
            &["train", "--steps", "9", "--resume", o],
            &["--set", &format!("parallel.pp={resume_pp}")],
            &[],
        );
        assert!(ok, "{err}");
        assert!(err.contains("step 6"), "resumes from the checkpoint of step 6: {err}");
        assert_eq!(digest(&out), want, "crash at pp={pp}, resume at pp={resume_pp}");
        assert_eq!(loss_bits(&out), want_losses, "every step's loss and gradient norm, to the bit");
    }
}

/// A sequence's training tokens are a function of the seed and its global
/// index alone, never of train.steps: a 2-step run resumed to 3 steps reads
/// what a 3-step run reads. The learning rate is pinned (constant after one
/// warmup step) so that the data is the only thing the step count could move.
#[test]
fn a_run_resumed_to_more_steps_ends_with_the_bits_of_a_run_that_long_from_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let constant_lr = ["--set", "optim.schedule=constant", "--set", "optim.warmup_steps=1"];
    let full = full_run_with(dir.path(), "three", "3", &constant_lr, &[]);
    let short = full_run_with(dir.path(), "two", "2", &constant_lr, &[]);
    let s = short.to_str().unwrap();
    let (ok, err) = run(&["train", "--steps", "3", "--resume", s], &constant_lr, &[]);
    assert!(ok, "{err}");
    assert!(err.contains("step 2"), "resumes from the checkpoint of step 2: {err}");
    assert_eq!(digest(&short), digest(&full), "2 steps resumed to 3 against 3 steps");
    assert_eq!(loss_bits(&short), loss_bits(&full), "every step's loss and gradient norm, to the bit");
}

#[test]
fn a_run_with_a_skipped_step_resumes_and_restarts_to_the_uninterrupted_bits() {
    let dir = tempfile::tempdir().unwrap();
    let nan = [("PIPEWRIGHT_FAULT_NAN", "1")];
    let full = full_run_with(dir.path(), "full", "9", &[], &nan);
    let want = digest(&full);
    assert_eq!(metrics(&full)[1]["loss"], serde_json::Value::Null, "a NaN loss is written as null");
    let out = dir.path().join("crash");
    let o = out.to_str().unwrap();
    let (ok, err) = run(
        &["train", "--steps", "9", "--out", o],
        &["--set", "parallel.pp=2"],
        &[nan[0], ("PIPEWRIGHT_FAULT", "stage=0,step=7,mb=1")],
    );
    assert!(!ok && err.contains("step 7"), "{err}");
    let (ok, err) = run(&["train", "--steps", "9", "--resume", o], &["--set", "parallel.pp=2"], &[]);
    assert!(ok, "metrics.jsonl with a skipped step reads back: {err}");
    assert_eq!(digest(&out), want);
    assert_eq!(loss_bits(&out), loss_bits(&full));
    assert_eq!(summary(&out)["skipped_steps"], 1);

    let out = dir.path().join("restart");
    let (ok, err) = run(
        &["train", "--steps", "9", "--out", out.to_str().unwrap(), "--max-restarts", "1"],
        &["--set", "parallel.pp=2"],
        &[nan[0], ("PIPEWRIGHT_FAULT", "stage=0,step=7,mb=1"), ("PIPEWRIGHT_FAULT_ONCE", "1")],
    );
    assert!(ok && err.contains("restarting from the latest checkpoint"), "{err}");
    assert_eq!(digest(&out), want);
}

#[test]
fn sigkill_at_random_moments_mid_write_included_never_costs_a_complete_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let want = full_run(dir.path(), "14");
    // Kill moments are spread over the length of a whole run on this machine.
    let whole = started.elapsed().as_millis().max(200) as u64;
    let out = dir.path().join("killed");
    let root = out.join("checkpoints");
    let o = out.to_str().unwrap().to_string();
    // A slow disk: a kill that waits for a `.tmp` lands mid-write.
    let slow = ("PIPEWRIGHT_CHECKPOINT_WRITE_DELAY_MS", "25");
    let mut rng = 0x2545F4914F6CDD1Du64;
    let (mut kills, mut mid_write, mut resumes_checked) = (0, 0, 0);
    for attempt in 0..80 {
        if kills >= 12 && mid_write >= 4 && resumes_checked >= 5 {
            break;
        }
        // Every name a resume may pick must be a whole checkpoint, and the newest is the one to pick.
        let (done, _) = pipewright::checkpoint::list(&root).unwrap();
        for (step, path) in &done {
            let l = pipewright::checkpoint::load(path);
            assert!(l.is_ok(), "step {step} at {} does not verify: {}", path.display(), l.err().unwrap());
        }
        let expect = done.last().map(|d| d.0);
        let resuming = out.exists();
        let args = if resuming {
            vec!["train", "--steps", "14", "--resume", &o]
        } else {
            vec!["train", "--steps", "14", "--out", &o]
        };
        // `.tmp`s left by earlier kills, told apart from this process's own writes.
        let stale = tmps(&root);
        let mut child = cmd(&args, &["--set", "parallel.pp=2", "--set", "checkpoint.every=1"])
            .env(slow.0, slow.1)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let Kill { finished, mid_write: during } =
            kill_at_random_moment(&mut child, attempt, &mut rng, whole, 20, &root, &stale);
        if finished.is_none() {
            kills += 1;
            mid_write += during as usize;
        }
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(!err.contains("warning: checkpoint"), "a checkpoint was found damaged: {err}");
        if resuming {
            if let Some(at) = err.find("resuming from ") {
                let step: u64 =
                    err[at..].split("(step ").nth(1).unwrap().split(';').next().unwrap().parse().unwrap();
                assert_eq!(Some(step), expect, "resumed from the newest complete checkpoint: {err}");
                resumes_checked += 1;
            } else if err.contains("starting from step 0") {
                assert_eq!(expect, None, "{err}");
            }
        }
        if let Some(status) = finished {
            assert!(status.success(), "a resume failed: {err}");
            // Finished before the kill: start over to get more kills in.
            let _ = std::fs::remove_dir_all(&out);
        }
    }
    assert!(kills >= 10 && mid_write >= 3, "only {kills} kills landed, {mid_write} of them mid-write");
    assert!(resumes_checked >= 5, "only {resumes_checked} resumes were checked");
    eprintln!("{kills} kills, {mid_write} mid-write, {resumes_checked} resume points checked");
    let (ok, err) = run(&["train", "--steps", "14", "--resume", &o], &["--set", "parallel.pp=2"], &[]);
    assert!(ok, "{err}");
    assert_eq!(digest(&out), want, "after {kills} kills ({mid_write} mid-write)");
}

#[test]
fn sigint_and_sigterm_save_a_checkpoint_at_the_next_step_and_exit_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let want = full_run(dir.path(), "40");
    for (name, signal) in [("int", libc::SIGINT), ("term", libc::SIGTERM)] {
        let out = dir.path().join(name);
        let o = out.to_str().unwrap();
        let mut child = cmd(
            &["train", "--steps", "40", "--out", o],
            &["--set", "parallel.pp=2", "--set", "checkpoint.every=0"],
        )
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        wait_for_steps(&out, 2, &mut [&mut child]);
        unsafe { libc::kill(child.id() as i32, signal) };
        let res = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(res.status.success(), "{name}: {err}");
        assert!(err.contains("stopped by a signal"), "{name}: {err}");
        assert_eq!(summary(&out)["stopped_early"], true);
        let (ok, err) = run(&["train", "--steps", "40", "--resume", o], &["--set", "parallel.pp=2"], &[]);
        assert!(ok, "{name}: {err}");
        assert_eq!(digest(&out), want, "{name}");
    }
}

/// config.toml is written when a run starts, so one killed before its end
/// resumes with `train --resume DIR` alone, to the bits of the uninterrupted
/// run; a resume that is refused leaves it as it was.
#[test]
fn a_run_killed_before_its_end_resumes_from_its_own_config_toml_without_its_flags() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--set", "parallel.pp=2", "--set", "optim.lr=0.002", "--set", "train.seed=7"];
    let want = digest(&full_run_with(dir.path(), "full", "60", &flags[2..], &[]));
    let out = dir.path().join("killed");
    let o = out.to_str().unwrap();
    let mut child =
        cmd(&["train", "--steps", "60", "--out", o], &flags).stderr(Stdio::null()).spawn().unwrap();
    let first = out.join("checkpoints").join(pipewright::checkpoint::step_dir_name(2));
    let until = Instant::now() + Duration::from_secs(120);
    while !first.join("state.json").exists() {
        assert!(Instant::now() < until, "no checkpoint of step 2");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be killed");
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!out.join("summary.json").exists(), "killed before its end");
    let written = std::fs::read(out.join("config.toml")).expect("config.toml from the run's start");

    let resume = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args(["train", "--resume", o])
            .args(extra)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (ok, err) = resume(&["--set", "model.n_embd=64"]);
    assert!(!ok && err.contains("[model]"), "{err}");
    assert_eq!(std::fs::read(out.join("config.toml")).unwrap(), written, "a refused resume changes nothing");
    let (ok, err) = resume(&[]);
    assert!(ok && err.contains("config.toml (the run's own"), "{err}");
    assert_eq!(digest(&out), want);
}

#[test]
fn a_signal_during_start_up_exits_cleanly_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("early");
    let child = cmd(&["train", "--steps", "40", "--out", out.to_str().unwrap()], &[])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Start-up (config, data, the gemm-rate measurement: ~100 ms on 2 cores)
    // is still going on 50 ms after the spawn.
    std::thread::sleep(Duration::from_millis(50));
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{err}");
    if err.contains("before the first step") {
        assert!(err.contains("during start-up, before the first step: nothing to save"), "{err}");
        assert!(!out.exists(), "nothing written");
    } else {
        // A start-up faster than 50 ms got past its last check: the first
        // step's checkpoint is saved, as after any step.
        assert!(err.contains("stopped by a signal after step"), "{err}");
    }
}

#[test]
fn a_signal_after_the_last_step_lets_the_final_checkpoint_finish() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("late");
    let mut child =
        cmd(&["train", "--steps", "6", "--out", out.to_str().unwrap()], &["--set", "checkpoint.every=6"])
            .env("PIPEWRIGHT_CHECKPOINT_WRITE_DELAY_MS", "1500")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
    // The last step is done; its checkpoint is still being written.
    wait_for_steps(&out, 6, &mut [&mut child]);
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{err}");
    pipewright::checkpoint::load(&out.join("checkpoints/step_00000006")).unwrap();
    assert_eq!(summary(&out)["stopped_early"], false);
}

#[test]
fn a_second_interrupt_exits_at_once_with_130_saying_what_was_not_saved() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("twice");
    // The clean stop the first interrupt asks for writes a checkpoint that
    // takes a minute, so the second finds the process still stopping however
    // late a loaded machine runs it.
    let mut child =
        cmd(&["train", "--steps", "400", "--out", out.to_str().unwrap()], &["--set", "checkpoint.every=0"])
            .env("PIPEWRIGHT_CHECKPOINT_WRITE_DELAY_MS", "60000")
            // The notice below is an info-level line.
            .env_remove("RUST_LOG")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
    wait_for_steps(&out, 1, &mut [&mut child]);
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    // The second goes once the run says it heard the first: two sent back to
    // back reach a process that did not run in between as one.
    let mut err = String::new();
    loop {
        let mut line = String::new();
        if std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() == 0 {
            break;
        }
        err += &line;
        if line.contains("signal: saving a checkpoint") {
            break;
        }
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    std::io::Read::read_to_string(&mut stderr, &mut err).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("second interrupt") && err.contains("Not saved"), "{err}");
    assert!(err.contains(&format!("--resume {}", out.display())), "{err}");
}

#[test]
fn a_stage_error_ends_the_run_within_the_shutdown_timeout_naming_who_did_not_stop() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("stuck");
    let t = Instant::now();
    // The checkpointer is stuck on a write that takes a minute when stage 1 fails.
    let (ok, err) = run(
        &["train", "--steps", "8", "--out", out.to_str().unwrap()],
        &["--set", "parallel.pp=2", "--set", "checkpoint.every=1", "--set", "recovery.shutdown_timeout_s=1"],
        &[
            ("PIPEWRIGHT_FAULT", "stage=1,step=3,mb=1,kind=error"),
            ("PIPEWRIGHT_CHECKPOINT_WRITE_DELAY_MS", "60000"),
        ],
    );
    let took = t.elapsed();
    assert!(!ok, "{err}");
    assert!(
        err.contains("stage-1 failed at step 3 during 1F1 (stage 1, microbatch 1): injected error"),
        "{err}"
    );
    assert!(err.contains("checkpointer (writing the checkpoint of step 1) did not stop within 1 s"), "{err}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
}

/// A pp = 2 run of 8 steps that fails in step 5 (checkpoints of steps 2 and 4).
fn crashed_run(dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(name);
    let (ok, _) = run(
        &["train", "--steps", "8", "--out", out.to_str().unwrap()],
        &["--set", "parallel.pp=2"],
        &[("PIPEWRIGHT_FAULT", "stage=0,step=5,mb=0")],
    );
    assert!(!ok);
    out
}

fn resume(out: &Path, extra: &[&str]) -> (bool, String) {
    run(&["train", "--steps", "8", "--resume", out.to_str().unwrap()], extra, &[])
}

#[test]
fn a_damaged_newest_checkpoint_is_named_and_kept_and_the_run_resumes_from_an_older_one() {
    let dir = tempfile::tempdir().unwrap();
    let want = full_run(dir.path(), "8");
    let out = crashed_run(dir.path(), "flipped");
    let ck = out.join("checkpoints/step_00000004");
    // A flipped byte: the digest no longer matches.
    let model = ck.join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&model, &bytes).unwrap();
    let (ok, err) = resume(&out, &[]);
    assert!(ok, "{err}");
    assert!(
        err.contains("warning: checkpoint")
            && err.contains("step_00000004/model.safetensors")
            && err.contains("digest"),
        "{err}"
    );
    assert!(err.contains("resuming from") && err.contains("step_00000002 (step 2"), "{err}");
    let kept = out.join("checkpoints/step_00000004.damaged/model.safetensors");
    assert_eq!(std::fs::read(kept).unwrap(), bytes, "the damaged checkpoint is kept as it was");
    assert_eq!(digest(&out), want);

    // Damaged every way there is: a truncated file, a missing one. None verifies.
    let out = crashed_run(dir.path(), "ruined");
    let root = out.join("checkpoints");
    let model = root.join("step_00000004/model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::remove_file(root.join("step_00000002/optimizer.safetensors")).unwrap();
    let (ok, err) = resume(&out, &[]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("no checkpoint")
            && err.contains("verifies")
            && err.contains("step_00000004/model.safetensors")
            && err.contains("step_00000002/optimizer.safetensors"),
        "{err}"
    );
    assert!(
        root.join("step_00000004/state.json").exists() && root.join("step_00000002/state.json").exists(),
        "nothing moved or deleted"
    );
}

#[test]
fn a_different_model_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = crashed_run(dir.path(), "run");
    let (ok, err) = resume(&out, &["--set", "model.n_embd=64"]);
    assert!(!ok && err.contains("state.json") && err.contains("[model]"), "{err}");
}

#[test]
fn resuming_with_changed_settings_lists_each_change_and_warns_that_bits_will_differ() {
    let dir = tempfile::tempdir().unwrap();
    let out = crashed_run(dir.path(), "changed");
    let (ok, err) = resume(
        &out,
        &[
            "--set",
            "optim.lr=0.001",
            "--set",
            "train.seed=7",
            "--set",
            "parallel.microbatches=2",
            "--set",
            "parallel.pp=1",
            "--set",
            "parallel.tp_slices=2",
        ],
    );
    assert!(ok, "{err}");
    for want in [
        "warning: resuming with settings that differ",
        "optim.lr: 0.003 → 0.001",
        "train.seed: 1337 → 7",
        "the global batch changes: 8 → 4 sequences per step",
        "reads from sequence 16 while the checkpoint's cursor is 32",
        "will not match the bits of an uninterrupted run",
        "parallel.pp: 2 → 1",
        "parallel.tp_slices 1 → 2: the tensor-parallel sums are taken over other slices, so bits differ",
    ] {
        assert!(err.contains(want), "no `{want}` in: {err}");
    }

    let out = crashed_run(dir.path(), "relaid");
    let (ok, err) = resume(&out, &["--set", "parallel.pp=4", "--set", "checkpoint.keep=3"]);
    assert!(ok, "{err}");
    assert!(err.contains("layout changes only") && err.contains("parallel.pp: 2 → 4"), "{err}");
    // Config warnings (a short run inside warmup) may appear; none about the bits.
    assert!(!err.contains("warning: resuming") && !err.contains("will not match"), "{err}");
}

#[test]
fn state_json_records_cursors_rng_and_lr_position_and_tokens_add_up_across_batch_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let out = crashed_run(dir.path(), "tokens");
    // Up to step 4: 4 steps × 4 microbatches × 2 sequences × 16 tokens.
    let s4 = state(&out.join("checkpoints/step_00000004"));
    assert_eq!(s4["tokens"], 512);
    assert_eq!(s4["data_cursors"], serde_json::json!([32]));
    assert_eq!(s4["rng"]["seed"], 1337);
    assert_eq!(s4["rng"]["step"], 4);
    assert!(s4["rng"]["note"].as_str().unwrap().contains("(seed, purpose, ids)"));
    let lr = &s4["lr_schedule"];
    assert_eq!(
        (lr["kind"].as_str(), lr["step"].as_u64(), lr["warmup_steps"].as_u64()),
        (Some("cosine"), Some(4), Some(100))
    );
    assert_eq!((lr["decay_start"].as_u64(), lr["decay_end"].as_u64()), (Some(100), Some(100)));
    // Resumed with half the global batch, at dp = 2: 2 × 2 × 1 × 16 = 64 tokens per step.
    let (ok, err) = resume(
        &out,
        &["--set", "train.micro_batch_size=1", "--set", "parallel.dp=2", "--set", "parallel.microbatches=2"],
    );
    assert!(ok, "{err}");
    let s6 = state(&out.join("checkpoints/step_00000006"));
    assert_eq!(s6["tokens"], 512 + 2 * 64);
    assert_eq!(s6["data_cursor"], 24);
    assert_eq!(s6["data_cursors"], serde_json::json!([24, 26]), "replica r reads from (6·2 + r)·2·1");
    let m = metrics(&out);
    assert_eq!(s6["lr_schedule"]["next_lr"], m[6]["lr"], "the rate of the step the checkpoint precedes");
    assert_eq!(summary(&out)["tokens"], 512 + 4 * 64);
    assert_eq!(m[7]["tokens"], 512 + 4 * 64);
}

/// Gradients are summed by one tree over the global microbatch index, so a
/// run resumed at another dp (with the same global batch) is the uninterrupted
/// run, bit for bit.
#[test]
fn a_pp4_checkpoint_resumed_at_dp2_lands_on_the_bits_of_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let full = full_run_with(dir.path(), "full", "9", &[], &[]);
    let out = dir.path().join("pp4-dp2");
    let o = out.to_str().unwrap();
    let (ok, err) = run(
        &["train", "--steps", "9", "--out", o],
        &["--set", "parallel.pp=4"],
        &[("PIPEWRIGHT_FAULT", "stage=0,step=7,mb=1")],
    );
    assert!(!ok, "{err}");
    // The same global batch (dp·microbatches·B = 2·2·2 = 1·4·2): the same data.
    let (ok, err) = run(
        &["train", "--steps", "9", "--resume", o],
        &["--set", "parallel.pp=1", "--set", "parallel.dp=2", "--set", "parallel.microbatches=2"],
        &[],
    );
    assert!(ok, "{err}");
    assert!(err.contains("bits still match an uninterrupted run"), "{err}");
    assert_eq!(loss_bits(&out), loss_bits(&full));
    let load = |d: &Path| pipewright::model::io::load(&d.join("model.safetensors")).unwrap().tensors;
    let (wa, wb) = (load(&out), load(&full));
    assert_eq!(wa.len(), wb.len());
    for (name, (_, x)) in &wa {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(x) == bits(&wb[name].1), "{name}: weights differ");
    }
}

#[test]
fn a_full_disk_mid_write_fails_by_name_removes_the_partial_write_and_keeps_earlier_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, err) = run(
        &["train", "--steps", "8", "--out", out.to_str().unwrap()],
        &["--set", "parallel.pp=2"],
        &[("PIPEWRIGHT_FAULT_DISK_FULL", "4")],
    );
    assert!(
        !ok && err.contains("step_00000004.tmp/optimizer.safetensors") && err.contains("No space left"),
        "{err}"
    );
    let root = out.join("checkpoints");
    let names: Vec<String> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    // The checkpointer may finish a later step's write before the run stops:
    // that one is whole too. What must not be there is the partial one.
    assert!(names.contains(&"step_00000002".to_string()), "{names:?}");
    assert!(names.iter().all(|n| !n.contains('.')), "the partial write is removed: {names:?}");
    pipewright::checkpoint::load(&root.join("step_00000002")).unwrap();
    let (ok, err) = resume(&out, &[]);
    assert!(ok, "{err}");
    assert!(err.contains("resuming from"), "{err}");
}

#[test]
fn resuming_without_any_checkpoint_starts_from_step_zero_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fresh");
    let (ok, err) = resume(&out, &[]);
    assert!(ok, "{err}");
    assert!(err.contains("starting from step 0"), "{err}");
}

#[test]
fn max_restarts_resumes_a_failed_run_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let want = full_run(dir.path(), "9");
    let out = dir.path().join("restart");
    let (ok, err) = run(
        &["train", "--steps", "9", "--out", out.to_str().unwrap(), "--max-restarts", "2"],
        &["--set", "parallel.pp=2"],
        &[("PIPEWRIGHT_FAULT", "stage=1,step=5,mb=2"), ("PIPEWRIGHT_FAULT_ONCE", "1")],
    );
    assert!(ok, "{err}");
    assert!(
        err.contains("stage-1 failed at step 5") && err.contains("restarting from the latest checkpoint"),
        "{err}"
    );
    assert_eq!(digest(&out), want);
}

#[test]
fn a_nan_step_is_skipped_logged_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("nan");
    let (ok, err) = run(
        &["train", "--steps", "6", "--out", out.to_str().unwrap()],
        &[],
        &[("PIPEWRIGHT_FAULT_NAN", "3")],
    );
    assert!(ok, "{err}");
    assert!(err.contains("step 4: non-finite loss"), "{err}");
    let m = metrics(&out);
    assert_eq!(m[3]["skipped"], true);
    assert!(m[3]["alert"].as_str().unwrap().contains("update skipped"));
    assert_eq!(m.iter().filter(|x| x["skipped"] == true).count(), 1);
    assert_eq!(summary(&out)["skipped_steps"], 1);
}

#[test]
fn an_infinite_gradient_without_loss_scaling_is_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("inf");
    let (ok, err) = run(
        &["train", "--steps", "6", "--out", out.to_str().unwrap()],
        &["--set", "optim.loss_scale=none"],
        &[("PIPEWRIGHT_FAULT_INF", "2")],
    );
    assert!(ok, "{err}");
    assert!(err.contains("step 3: non-finite loss") && err.contains("gradient norm (inf)"), "{err}");
    let m = metrics(&out);
    assert_eq!((m[2]["skipped"].as_bool(), m[2]["grad_norm"].is_null()), (Some(true), true));
    assert!(m[2]["loss"].as_f64().unwrap().is_finite(), "the loss itself was finite");
    assert!(m[2].get("loss_scale").is_none());
    assert_eq!(m.iter().filter(|x| x["skipped"] == true).count(), 1);
    assert_eq!(summary(&out)["skipped_steps"], 1);
    assert!(summary(&out)["final_loss"].as_f64().unwrap().is_finite(), "the weights were not touched by inf");
}

#[test]
fn repeated_nan_steps_roll_back_to_the_last_checkpoint_with_a_lower_learning_rate() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rollback");
    let (ok, err) = run(
        &["train", "--steps", "10", "--out", out.to_str().unwrap()],
        &[
            "--set",
            "recovery.max_skips=3",
            "--set",
            "recovery.lr_factor=0.5",
            "--set",
            "optim.warmup_steps=0",
        ],
        &[("PIPEWRIGHT_FAULT_NAN", "4,5,6")],
    );
    assert!(ok, "{err}");
    assert!(err.contains("rolling back to") && err.contains("step_00000006"), "{err}");
    let s = summary(&out);
    assert_eq!(s["rollbacks"], 1);
    assert!(s["final_loss"].as_f64().unwrap().is_finite());
    // Step 7 ran twice: skipped, then again after the rollback at half the learning rate.
    let m = metrics(&out);
    let seventh: Vec<&serde_json::Value> = m.iter().filter(|x| x["step"] == 7).collect();
    assert_eq!(seventh.len(), 2);
    assert_eq!(seventh[0]["skipped"], true);
    assert_eq!(seventh[1]["skipped"], false);
    // The row of the second run is marked; the first is the one rolled back.
    assert_eq!((seventh[0].get("repeated"), &seventh[1]["repeated"]), (None, &serde_json::Value::Bool(true)));
    let lr = |x: &serde_json::Value| x["lr"].as_f64().unwrap();
    assert!((lr(seventh[1]) - 0.5 * lr(seventh[0])).abs() < 1e-12);
}

/// A rollback under ZeRO-1 reloads each replica's shard of the moments from
/// the whole tensors on disk, so it lands where dp = 1's rollback does.
#[test]
fn a_zero_1_rollback_lands_on_the_bits_of_a_dp_1_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let rolled_back = |name: &str, layout: &[&str]| {
        let out = dir.path().join(name);
        let mut extra = vec!["--set", "recovery.max_skips=3", "--set", "optim.warmup_steps=0"];
        extra.extend(layout.iter().flat_map(|s| ["--set", s]));
        let args = ["train", "--steps", "10", "--out", out.to_str().unwrap()];
        let (ok, err) = run(&args, &extra, &[("PIPEWRIGHT_FAULT_NAN", "4,5,6")]);
        assert!(ok && err.contains("rolling back to"), "{name}: {err}");
        digest(&out)
    };
    let one = rolled_back("dp1", &[]);
    let zero = rolled_back("zero1", &["parallel.dp=2", "parallel.microbatches=2", "parallel.zero=1"]);
    assert_eq!(zero, one);
}

/// A run that learns for a while, then meets a poisoned batch (every target
/// one random token) at 0-based step `SPIKE`.
const SPIKE: usize = 30;

fn spiked(dir: &Path, name: &str, detector: &[&str]) -> (Vec<serde_json::Value>, String) {
    let out = dir.join(name);
    let mut extra = vec!["--set", "optim.warmup_steps=5", "--set", "recovery.spike_window=10"];
    extra.extend_from_slice(detector);
    let spike = SPIKE.to_string();
    let (ok, err) = run(
        &["train", "--steps", &(SPIKE + 2).to_string(), "--out", out.to_str().unwrap()],
        &extra,
        &[("PIPEWRIGHT_FAULT_SPIKE", &spike)],
    );
    assert!(ok, "{err}");
    (metrics(&out), err)
}

fn alerted(m: &[serde_json::Value], what: &str) -> Vec<usize> {
    (0..m.len()).filter(|&i| m[i]["alert"].as_str().is_some_and(|a| a.contains(what))).collect()
}

#[test]
fn a_poisoned_batch_raises_a_loss_spike_alert_and_is_skipped_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let detector = ["--set", "recovery.spike_factor=1.5", "--set", "recovery.spike_zscore=0"];
    let (m, err) = spiked(dir.path(), "alert", &detector);
    assert_eq!(alerted(&m, "loss spike").first(), Some(&SPIKE), "{err}");
    assert_eq!(m[SPIKE]["skipped"], false, "alerts only, by default");
    assert!(err.contains(&format!("step {}: loss spike", SPIKE + 1)), "{err}");

    let mut skip = detector.to_vec();
    skip.extend_from_slice(&["--set", "recovery.spike_skip=true"]);
    let (m, err) = spiked(dir.path(), "skip", &skip);
    assert_eq!(alerted(&m, "loss spike"), [SPIKE], "{err}");
    assert_eq!(m[SPIKE]["skipped"], true);
    assert!(m[SPIKE]["alert"].as_str().unwrap().contains("update skipped"));
    assert_eq!(m.iter().filter(|x| x["skipped"] == true).count(), 1);
}

#[test]
fn a_poisoned_batch_raises_a_gradient_norm_z_score_alert() {
    let dir = tempfile::tempdir().unwrap();
    let detector = ["--set", "recovery.spike_factor=0", "--set", "recovery.spike_zscore=4"];
    let (m, err) = spiked(dir.path(), "zscore", &detector);
    assert_eq!(alerted(&m, "gradient-norm spike").first(), Some(&SPIKE), "{err}");
    assert!(alerted(&m, "loss spike").is_empty(), "the loss detector is off");
}

#[test]
fn loss_scaler_state_survives_a_crash_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let scaling = [
        "--set",
        "optim.loss_scale=dynamic",
        "--set",
        "optim.loss_scale_init=1024",
        "--set",
        "optim.loss_scale_growth_interval=2",
        "--set",
        "optim.loss_scale_growth_factor=4",
        "--set",
        "optim.loss_scale_backoff_factor=0.25",
        "--set",
        "optim.loss_scale_hysteresis=1",
    ];
    let overflow = ("PIPEWRIGHT_FAULT_INF", "1,4");
    let full = full_run_with(dir.path(), "full", "9", &scaling, &[overflow]);
    let scales =
        |d: &Path| -> Vec<f64> { metrics(d).iter().map(|m| m["loss_scale"].as_f64().unwrap()).collect() };
    assert_eq!(
        scales(&full),
        [1024.0, 1024.0, 256.0, 256.0, 1024.0, 256.0, 256.0, 1024.0, 1024.0],
        "growth ×4 after two clean steps, backoff ×0.25 on each overflow"
    );
    let out = dir.path().join("crash");
    let o = out.to_str().unwrap();
    let mut extra = vec!["--set", "parallel.pp=2"];
    extra.extend_from_slice(&scaling);
    let (ok, err) = run(
        &["train", "--steps", "9", "--out", o],
        &extra,
        &[overflow, ("PIPEWRIGHT_FAULT", "stage=0,step=7,mb=1")],
    );
    assert!(!ok, "{err}");
    let (ok, err) = run(&["train", "--steps", "9", "--resume", o], &extra, &[]);
    assert!(ok, "{err}");
    assert_eq!(scales(&out), scales(&full));
    assert_eq!(digest(&out), digest(&full));
}
