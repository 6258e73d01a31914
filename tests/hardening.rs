//! The adversarial pass of issue 18, kept as tests: tampered checkpoints, two
//! processes on one run directory, impossible sizes, files that are not
//! files, NaN with nothing to roll back to, incomplete recordings, a full
//! disk (a file-size limit stands in for it) and a storm of SIGKILLs. Each
//! case is refused by name or survived with nothing lost; docs/hardening.md
//! holds the figures.
//!
//! Heavy: `sigkill_storm_…` (≥ 15 kills and resumes, ~1 minute on 2 cores).

mod common;
use common::{free_ports, kill_at_random_moment, run_to_end, tmps, wait_for_steps, Kill, TINY};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pipewright");

fn sets(extra: &[&str]) -> Vec<String> {
    TINY.iter().chain(extra).flat_map(|s| ["--set".to_string(), s.to_string()]).collect()
}

fn train(args: &[&str], extra: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("train").args(args).args(sets(extra)).stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

fn with_env(mut c: Command, key: &str, value: &str) -> Command {
    c.env(key, value);
    c
}

/// Runs `c` to its end; one that is still running after a minute hangs (a
/// FIFO waited on): it is killed and the test fails saying so.
fn finish(c: Command) -> Output {
    run_to_end(c, Duration::from_secs(60))
}

fn err_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(c: Command) -> String {
    let o = finish(c);
    assert!(o.status.success(), "{}", err_of(&o));
    err_of(&o)
}

/// Refused: a non-zero exit that is neither a panic nor an abort.
fn refused(c: Command) -> String {
    let o = finish(c);
    let err = err_of(&o);
    assert!(!o.status.success(), "accepted: {err}");
    assert!(!err.contains("panicked"), "a panic: {err}");
    assert!(matches!(o.status.code(), Some(1) | Some(2)), "exit {:?}: {err}", o.status);
    err
}

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn digest(run: &Path) -> String {
    json(&run.join("summary.json"))["weights_digest"].as_str().unwrap().to_string()
}

/// Every metrics.jsonl row (each must parse: no half line).
fn metrics(run: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"))).collect()
}

fn steps_in(run: &Path) -> Vec<u64> {
    metrics(run).iter().map(|m| m["step"].as_u64().unwrap()).collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A run of `steps` into `dir/name`.
fn run_of(dir: &Path, name: &str, steps: &str) -> PathBuf {
    let out = dir.join(name);
    ok(train(&["--steps", steps, "--out", s(&out)], &[]));
    out
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(s(p)).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// An llm.c token file of `n` byte-sized tokens.
fn token_file(p: &Path, n: usize) {
    let mut header = [0i32; 256];
    (header[0], header[1], header[2]) = (20240520, 1, n as i32);
    let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    bytes.extend((0..n).flat_map(|i| ((i * 7 % 251) as u16).to_le_bytes()));
    std::fs::write(p, bytes).unwrap();
}

// ---- 1: state.json is covered by the digests and must match its directory ----

#[test]
fn a_state_json_edited_to_another_step_is_damage_the_resume_falls_back_and_ends_on_the_uninterrupted_bits() {
    let dir = tempfile::tempdir().unwrap();
    let full = run_of(dir.path(), "full", "8");
    let out = dir.path().join("edited");
    let crash = train(&["--steps", "8", "--out", s(&out)], &["parallel.pp=2"]);
    let o = finish(with_env(crash, "PIPEWRIGHT_FAULT", "stage=0,step=5,mb=0"));
    assert!(!o.status.success());
    let sp = out.join("checkpoints/step_00000004/state.json");
    let text = std::fs::read_to_string(&sp).unwrap();
    assert!(text.contains("\"step\": 4,"), "{text}");
    std::fs::write(&sp, text.replacen("\"step\": 4,", "\"step\": 6,", 1)).unwrap();
    let err = ok(train(&["--steps", "8", "--resume", s(&out)], &["parallel.pp=2"]));
    assert!(err.contains("warning: checkpoint") && err.contains("step_00000004/state.json"), "{err}");
    assert!(err.contains("step_00000002 (step 2"), "falls back to step 2: {err}");
    assert!(out.join("checkpoints/step_00000004.damaged/state.json").exists(), "kept as .damaged");
    assert_eq!(digest(&out), digest(&full));
    assert_eq!(steps_in(&out), (1..=8).collect::<Vec<_>>(), "no step missing from metrics.jsonl");
    // A resume at the last step runs nothing and still reports the run's tokens.
    let tokens = json(&full.join("summary.json"))["tokens"].clone();
    ok(train(&["--steps", "8", "--resume", s(&out)], &["parallel.pp=2"]));
    assert_eq!(json(&out.join("summary.json"))["tokens"], tokens);
}

/// Ways to damage one file, each applied to a fresh copy.
const DAMAGE: [&str; 9] = [
    "flip-first",
    "flip-middle",
    "flip-last",
    "truncate-half",
    "empty",
    "append",
    "remove",
    "directory",
    "fifo",
];

fn damage(p: &Path, how: &str) {
    let bytes = std::fs::read(p).unwrap();
    let n = bytes.len();
    let flip = |i: usize| {
        let mut b = bytes.clone();
        b[i] ^= 0x10;
        std::fs::write(p, b).unwrap();
    };
    match how {
        "flip-first" => flip(0),
        "flip-middle" => flip(n / 2),
        "flip-last" => flip(n - 2),
        "truncate-half" => std::fs::write(p, &bytes[..n / 2]).unwrap(),
        "empty" => std::fs::write(p, b"").unwrap(),
        "append" => std::fs::write(p, [bytes.as_slice(), b"\0"].concat()).unwrap(),
        "remove" => std::fs::remove_file(p).unwrap(),
        "directory" => {
            std::fs::remove_file(p).unwrap();
            std::fs::create_dir(p).unwrap();
        }
        "fifo" => {
            std::fs::remove_file(p).unwrap();
            mkfifo(p);
        }
        _ => unreachable!("{how}"),
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn corruption_matrix_every_checkpoint_file_damaged_every_way_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_of(dir.path(), "run", "2");
    let good = run.join("checkpoints/step_00000002");
    pipewright::checkpoint::load(&good).unwrap();
    let mut cases = 0;
    for file in ["model.safetensors", "optimizer.safetensors", "state.json"] {
        for how in DAMAGE {
            let copy = dir.path().join(format!("m/{file}-{how}/step_00000002"));
            copy_dir(&good, &copy);
            damage(&copy.join(file), how);
            let err = match pipewright::checkpoint::load(&copy) {
                Ok(_) => panic!("{file} {how}: accepted"),
                Err(e) => e.to_string(),
            };
            // A damaged state.json can only be blamed on itself; a damaged
            // tensor file is named, or state.json is (whose digest it fails).
            assert!(err.contains(&format!("step_00000002/{file}")), "{file} {how}: {err}");
            cases += 1;
        }
    }
    eprintln!("{cases} damaged checkpoints refused by name");
    assert_eq!(cases, 27);
}

// ---- 2: one process per run directory ----

#[test]
fn a_second_process_on_a_live_run_directory_is_refused_naming_the_holder_and_the_live_run_is_unharmed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("live");
    let mut live: Child =
        train(&["--steps", "100000", "--out", s(&out)], &["checkpoint.every=0"]).spawn().unwrap();
    wait_for_steps(&out, 2, &mut [&mut live]);
    let pid = format!("pid {}", live.id());
    for (what, args) in [
        ("--resume", vec!["--steps", "100000", "--resume", s(&out)]),
        ("--force", vec!["--steps", "10", "--out", s(&out), "--force"]),
    ] {
        let err = refused(train(&args, &["checkpoint.every=0"]));
        assert!(err.contains("another pipewright process") && err.contains(&pid), "{what}: {err}");
        assert!(err.contains(s(&out)), "{what}: {err}");
    }
    unsafe { libc::kill(live.id() as i32, libc::SIGTERM) };
    let o = live.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let summary = json(&out.join("summary.json"));
    assert_eq!(summary["stopped_early"], true);
    let done = summary["steps"].as_u64().unwrap();
    assert_eq!(steps_in(&out), (1..=done).collect::<Vec<_>>(), "summary and metrics agree");
    // The lock ends with its process: the directory is free again.
    ok(train(&["--steps", &(done + 1).to_string(), "--resume", s(&out)], &["checkpoint.every=0"]));
}

// ---- 5: impossible sizes ----

#[test]
fn impossible_sizes_are_refused_by_field_before_force_removes_anything() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_of(dir.path(), "run", "2");
    let before = std::fs::read(run.join("model.safetensors")).unwrap();
    let table = [
        ("model.n_embd=1000000", "model.n_embd: 1000000"),
        ("model.n_layer=1000000", "model.n_layer: 1000000"),
        ("model.block_size=1000000000", "model.block_size: 1000000000"),
        ("train.micro_batch_size=100000000", "train.micro_batch_size: 100000000"),
        ("model.vocab_size=2147483648", "model.vocab_size"),
        ("backend.threads=100000", "backend.threads: 100000"),
        ("parallel.dp=100000", "parallel.dp: 100000"),
    ];
    for (set, field) in table {
        let err = refused(train(&["--steps", "2", "--out", s(&run), "--force"], &[set]));
        assert!(err.contains(field), "{set}: {err}");
        assert_eq!(std::fs::read(run.join("model.safetensors")).unwrap(), before, "{set}: outputs removed");
        assert!(run.join("summary.json").exists() && run.join("checkpoints").exists(), "{set}");
    }
}

// ---- 4: files that are not files ----

#[test]
fn files_that_are_not_files_are_refused_by_name_without_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = run_of(d, "run", "2");
    let (fifo, tokens) = (d.join("fifo"), d.join("tokens.bin"));
    mkfifo(&fifo);
    token_file(&tokens, 4096);
    let weights = run.join("model.safetensors");
    let file_data = |train_path: &Path, val: &Path| {
        vec![
            "data.builtin=".to_string(),
            format!("data.train={}", train_path.display()),
            format!("data.val={}", val.display()),
            "model.vocab_size=256".into(),
        ]
    };
    let out = d.join("out");
    let folder = d.join("folder");
    std::fs::create_dir(&folder).unwrap();
    let mut cases: Vec<(String, Command, &Path, &str)> = Vec::new();
    for (name, t, v, bad, kind) in [
        ("data.train FIFO", &fifo, &tokens, &fifo, "FIFO"),
        ("data.val FIFO", &tokens, &fifo, &fifo, "FIFO"),
        ("data.train directory", &folder, &tokens, &folder, "a directory"),
    ] {
        let sets = file_data(t, v);
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        cases.push((name.into(), train(&["--steps", "2", "--out", s(&out)], &sets), bad.as_path(), kind));
    }
    let zero = Path::new("/dev/zero");
    for (name, init, kind) in
        [("--init FIFO", fifo.as_path(), "FIFO"), ("--init /dev/zero", zero, "character device")]
    {
        cases.push((
            name.into(),
            train(&["--steps", "2", "--out", s(&out), "--init", s(init)], &[]),
            init,
            kind,
        ));
    }
    for (name, cfg, kind) in
        [("config FIFO", fifo.as_path(), "FIFO"), ("config /dev/zero", zero, "character device")]
    {
        let mut c = Command::new(BIN);
        c.args(["train", "--steps", "2", "--out", s(&out), "-c", s(cfg)]);
        cases.push((name.into(), c, cfg, kind));
    }
    let mut c = Command::new(BIN);
    c.args(["eval", "--weights", s(&weights), "--data", s(&fifo)]);
    cases.push(("eval --data FIFO".into(), c, &fifo, "FIFO"));
    let mut c = Command::new(BIN);
    c.args(["eval", "--weights", s(zero), "--data", s(&tokens)]);
    cases.push(("eval --weights /dev/zero".into(), c, zero, "character device"));
    let mut c = Command::new(BIN);
    c.args(["prepare", s(&fifo), "--out", s(&d.join("prepared"))]);
    cases.push(("prepare FIFO".into(), c, &fifo, "FIFO"));
    let n = cases.len();
    for (name, c, bad, kind) in cases {
        let err = refused(c);
        assert!(
            err.contains(s(bad)) && err.contains(kind) && err.contains("not a regular file"),
            "{name}: {err}"
        );
    }
    assert!(!out.exists(), "nothing written by a refused run");
    eprintln!("{n} non-files refused by name");
}

// ---- 6: non-finite with nothing to roll back to ----

/// `run`'s weights with element 3 of `tensor` set to NaN, saved as `to`.
fn poisoned(run: &Path, tensor: &str, to: &Path) {
    let w = pipewright::model::io::load(&run.join("model.safetensors")).unwrap();
    let mut tensors = w.tensors.clone();
    tensors.get_mut(tensor).unwrap().1[3] = f32::NAN;
    let map = tensors.iter().map(|(n, (s, d))| (n.clone(), (s.as_slice(), d.as_slice()))).collect();
    pipewright::model::io::save_named(to, &map, w.metadata.clone()).unwrap();
}

#[test]
fn weights_holding_nan_are_refused_naming_the_file_and_tensor_by_train_init_and_eval() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_of(dir.path(), "run", "2");
    let (nan, tokens) = (dir.path().join("nan.safetensors"), dir.path().join("tokens.bin"));
    poisoned(&run, "h.1.mlp.c_fc.weight", &nan);
    token_file(&tokens, 4096);
    let err = refused(train(&["--steps", "2", "--out", s(&dir.path().join("o")), "--init", s(&nan)], &[]));
    assert!(
        err.contains(s(&nan)) && err.contains("`h.1.mlp.c_fc.weight`") && err.contains("non-finite"),
        "{err}"
    );
    let mut c = Command::new(BIN);
    c.args(["eval", "--weights", s(&nan), "--data", s(&tokens), "--batches", "2"]);
    let err = refused(c);
    assert!(err.contains("`h.1.mlp.c_fc.weight`") && err.contains("non-finite"), "{err}");
}

#[test]
fn non_finite_steps_with_no_checkpoint_name_the_cause_and_every_skipped_step_is_in_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("nan");
    let run = train(&["--steps", "8", "--out", s(&out)], &["checkpoint.every=0", "recovery.max_skips=3"]);
    let err = refused(with_env(run, "PIPEWRIGHT_FAULT_NAN", "1,2,3"));
    assert!(err.contains("3 consecutive steps skipped") && err.contains("no checkpoint"), "{err}");
    assert!(!err.contains("without a result"), "{err}");
    let m = metrics(&out);
    assert_eq!(steps_in(&out), [1, 2, 3, 4]);
    let skipped: Vec<bool> = m.iter().map(|r| r["skipped"].as_bool().unwrap()).collect();
    assert_eq!(skipped, [false, true, true, true]);
}

// ---- 7: replay --all needs every log ----

#[test]
fn replay_all_with_a_missing_log_is_bad_input_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("rec");
    ok(train(&["--steps", "2", "--out", s(&run), "--record"], &["parallel.pp=2"]));
    for log in ["stage-1.log", "coordinator.log"] {
        let p = run.join("replay").join(log);
        let kept = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        let mut c = Command::new(BIN);
        c.args(["replay", s(&run), "--all"]);
        let o = finish(c);
        let err = err_of(&o);
        assert_eq!(o.status.code(), Some(2), "{log}: {err}");
        assert!(err.contains(s(&p)) && err.contains("missing"), "{log}: {err}");
        std::fs::write(&p, kept).unwrap();
    }
}

// ---- 8 and the full disk: a file-size limit ----

/// `c` under RLIMIT_FSIZE = `bytes`, with SIGXFSZ ignored so a write past it
/// fails with EFBIG as a write to a full disk fails with ENOSPC.
fn with_file_limit(mut c: Command, bytes: u64) -> Command {
    unsafe {
        c.pre_exec(move || {
            let lim = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    c
}

fn tmp_names(dir: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.contains(".tmp") {
            v.push(name);
        }
        if e.path().is_dir() {
            v.extend(tmp_names(&e.path()));
        }
    }
    v
}

#[test]
fn a_full_disk_fails_naming_the_file_keeps_earlier_checkpoints_and_leaves_no_temp_file_or_half_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_of(dir.path(), "run", "4");
    let model = std::fs::metadata(run.join("model.safetensors")).unwrap().len();
    // A checkpoint's model file fits, its optimizer file (twice as large) does not.
    let err = refused(with_file_limit(train(&["--steps", "8", "--resume", s(&run)], &[]), model + 4096));
    assert!(err.contains("step_00000006.tmp/optimizer.safetensors") && err.contains("too large"), "{err}");
    for step in [2, 4] {
        pipewright::checkpoint::load(&run.join(format!("checkpoints/step_{step:08}"))).unwrap();
    }
    assert_eq!(tmp_names(&run), Vec::<String>::new());
    metrics(&run);

    // The final weights do not fit: named, and no model.safetensors.tmp.
    let out = dir.path().join("final");
    let err = refused(with_file_limit(
        train(&["--steps", "2", "--out", s(&out)], &["checkpoint.every=0"]),
        model / 2,
    ));
    assert!(err.contains("model.safetensors") && err.contains("too large"), "{err}");
    assert_eq!(tmp_names(&out), Vec::<String>::new());

    // metrics.jsonl itself fills the disk: named, and only whole lines in it.
    // (config.toml, written when the run starts, is let fit.)
    let out = dir.path().join("metrics");
    let limit = std::fs::metadata(run.join("config.toml")).unwrap().len() + 1000;
    let err =
        refused(with_file_limit(train(&["--steps", "50", "--out", s(&out)], &["checkpoint.every=0"]), limit));
    assert!(err.contains(&format!("{}: cannot append step", out.join("metrics.jsonl").display())), "{err}");
    assert!(!metrics(&out).is_empty());
}

// ---- the SIGKILL storm ----

#[test]
fn sigkill_storm_of_fifteen_kills_mid_write_included_ends_on_the_uninterrupted_bits_with_every_step_once() {
    let dir = tempfile::tempdir().unwrap();
    let extra = ["checkpoint.every=1"];
    let full = dir.path().join("full");
    let started = Instant::now();
    ok(train(&["--steps", "12", "--out", s(&full)], &extra));
    let whole = started.elapsed().as_millis().max(200) as u64;
    let out = dir.path().join("storm");
    let root = out.join("checkpoints");
    let mut rng = 0x9E3779B97F4A7C15u64;
    let (mut kills, mut mid_write) = (0, 0);
    for attempt in 0..120 {
        if kills >= 15 && mid_write >= 5 {
            break;
        }
        let flag = if out.exists() { "--resume" } else { "--out" };
        let stale = tmps(&root);
        let mut child = train(&["--steps", "12", flag, s(&out)], &extra)
            .env("PIPEWRIGHT_CHECKPOINT_WRITE_DELAY_MS", "20")
            .spawn()
            .unwrap();
        let Kill { finished, mid_write: during } =
            kill_at_random_moment(&mut child, attempt, &mut rng, whole, 15, &root, &stale);
        if finished.is_none() {
            kills += 1;
            mid_write += during as usize;
        }
        let o = child.wait_with_output().unwrap();
        let err = err_of(&o);
        assert!(!err.contains("warning: checkpoint"), "a checkpoint was found damaged: {err}");
        if let Some(status) = finished {
            assert!(status.success(), "{err}");
            let _ = std::fs::remove_dir_all(&out);
        }
    }
    assert!(kills >= 15 && mid_write >= 5, "only {kills} kills landed, {mid_write} mid-write");
    ok(train(&["--steps", "12", "--resume", s(&out)], &extra));
    assert_eq!(digest(&out), digest(&full), "after {kills} kills ({mid_write} mid-write)");
    assert_eq!(steps_in(&out), (1..=12).collect::<Vec<_>>(), "every step once in metrics.jsonl");
    eprintln!("{kills} kills, {mid_write} mid-write: the uninterrupted run's bits");
}

// ---- 3: a peer with the right cookie but the wrong settings ----

fn worker(port: u16, rank: usize, world: usize, args: &[String]) -> Command {
    common::worker_command(port, rank, world, "h4rden", args)
}

#[test]
fn a_peer_with_the_right_cookie_but_another_world_or_a_taken_rank_is_refused_and_the_live_run_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let port = free_ports();
    // Long enough to outlast both newcomers' refusals (each takes about a second).
    let flags = ["--steps", "4000", "--join-timeout", "120", "--out", s(&run)].map(String::from);
    let args = [sets(&["parallel.pp=2", "checkpoint.every=0"]), flags.to_vec()].concat();
    let mut rank0 = worker(port, 0, 2, &args).spawn().unwrap();
    let mut rank1 = worker(port, 1, 2, &args).spawn().unwrap();
    wait_for_steps(&run, 2, &mut [&mut rank0, &mut rank1]);
    // ractor_cluster may end a second node of a name already connected
    // before it authenticates; if not, the data link's handshake refuses it.
    let node_level = "a live process of the run already holding this rank";
    for (world, truth) in [(3, "this run has 2 processes, the peer says 3"), (2, "rank 1 has already joined")]
    {
        let err = refused(worker(port, 1, world, &args));
        assert!(err.contains(truth) || err.contains(node_level), "rank 1 of {world}: {err}");
    }
    assert!(steps_in(&run).len() < 4000, "the run ended before the newcomers came: make it longer");
    // The run goes on to its end after both newcomers left.
    let (o0, o1) = (rank0.wait_with_output().unwrap(), rank1.wait_with_output().unwrap());
    assert!(o0.status.success(), "rank 0: {}", err_of(&o0));
    assert!(o1.status.success(), "rank 1: {}", err_of(&o1));
    let err = err_of(&o0);
    assert!(
        err.contains("rank 1 is already held by") || err.contains("a second process for a rank already held"),
        "rank 0 names the refused newcomer: {err}"
    );
    let summary = json(&run.join("summary.json"));
    assert_eq!((summary["steps"].as_u64(), summary["stopped_early"].as_bool()), (Some(4000), Some(false)));
    assert_eq!(steps_in(&run), (1..=4000).collect::<Vec<_>>());
}
