//! Runs that span processes, on loopback: the same bits as one process (also
//! under TLS), a killed worker stops the rest with an error naming it, a wrong
//! cookie or a certificate from another CA is refused, garbage on a data port
//! costs the run nothing, and a bad TLS file is an error naming it. Workers
//! started as srun starts them (`worker --slurm`, SLURM's variables and no
//! rank flags) give the bits of one process too.

mod common;
use common::{free_ports, run_to_end};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pipewright");

/// One multi-process run at a time: each starts up to four processes with
/// timeouts of their own, and on a 2-core box several at once starve each
/// other into spurious timeouts (and race for the loopback ports they pick).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static RUNS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    RUNS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A 2-step pp = 2 run into `dir`/run whose rank 0 gives up on a peer that
/// never joins after `join_timeout` seconds (the refused-peer tests).
fn refused_peer_args(dir: &Path, join_timeout: u32) -> Vec<String> {
    let run = dir.join("run").display().to_string();
    let flags =
        ["--steps", "2", "--join-timeout", &join_timeout.to_string(), "--out", &run].map(String::from);
    [model(&["parallel.pp=2"]), flags.to_vec()].concat()
}

/// The small model of tests/pipeline.rs (4 layers, so pp = 4 has one each).
fn model(extra: &[&str]) -> Vec<String> {
    let mut sets = vec![
        "model.n_layer=4",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=16",
        "train.micro_batch_size=2",
        "train.eval_every=0",
        "train.eval_batches=2",
        "parallel.microbatches=8",
        "optim.warmup_steps=1",
    ];
    sets.extend_from_slice(extra);
    sets.iter().flat_map(|s| ["--set".to_string(), s.to_string()]).collect()
}

fn digest(run: &Path) -> String {
    let text = std::fs::read_to_string(run.join("summary.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["weights_digest"].as_str().unwrap().to_string()
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn one_process(dir: &Path, args: &[String]) -> String {
    let run = dir.join("one");
    let mut c = Command::new(BIN);
    c.arg("train").args(args).arg("--out").arg(&run);
    let o = run_to_end(c, Duration::from_secs(60));
    assert!(o.status.success(), "train: {}", text(&o));
    digest(&run)
}

fn launched(dir: &Path, nodes: usize, args: &[String]) -> String {
    let run = dir.join(format!("launch{nodes}"));
    let mut c = Command::new(BIN);
    c.arg("launch").arg("--nodes").arg(nodes.to_string()).args(args).arg("--out").arg(&run);
    let o = run_to_end(c, Duration::from_secs(60));
    assert!(o.status.success(), "launch --nodes {nodes}: {}", text(&o));
    // A clean end is quiet about the sessions that close as the workers exit.
    assert!(!text(&o).contains("session closed"), "launch --nodes {nodes}: {}", text(&o));
    digest(&run)
}

#[test]
fn pp4_over_2_processes_gives_the_bits_of_one_process() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let args = [model(&["parallel.pp=4"]), vec!["--steps".into(), "3".into()]].concat();
    assert_eq!(launched(dir.path(), 2, &args), one_process(dir.path(), &args));
}

#[test]
fn pp2_dp2_over_4_processes_gives_the_bits_of_one_process() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let args = [model(&["parallel.pp=2", "parallel.dp=2"]), vec!["--steps".into(), "3".into()]].concat();
    assert_eq!(launched(dir.path(), 4, &args), one_process(dir.path(), &args));
}

#[test]
fn a_run_across_processes_resumes_with_the_bits_of_one_process() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let base = model(&["parallel.pp=4", "checkpoint.every=2"]);
    let steps = |n: &str| vec!["--steps".to_string(), n.to_string()];
    let (single, split) = (dir.path().join("single"), dir.path().join("split"));
    for (run, launch) in [(&single, false), (&split, true)] {
        for (n, flag) in [("4", "--out"), ("6", "--resume")] {
            let mut c = Command::new(BIN);
            if launch {
                c.args(["launch", "--nodes", "2"]);
            } else {
                c.arg("train");
            }
            c.args(&base).args(steps(n)).arg(flag).arg(run);
            let o = run_to_end(c, Duration::from_secs(60));
            assert!(o.status.success(), "{flag} {}: {}", run.display(), text(&o));
        }
    }
    assert_eq!(digest(&split), digest(&single));
}

/// The same bits whatever the layout: dp 1/2/4 × pp 1/2 × ZeRO 0/1 and some
/// ZeRO 2/3 layouts in one process, interleaved and ZB-H1 (whose W actions
/// finish microbatches out of order), dp = 2 × pp = 2 over two processes
/// (ZeRO 0–3) and four (ZeRO 1 and 3: the weights' shards live in the
/// replicas' processes and are gathered across them for every action), a
/// dp = 1 run resumed at dp = 4 × pp = 2 with ZeRO-1, a ZeRO-1 dp = 2
/// checkpoint (moments gathered whole from the replicas' shards) resumed at
/// dp = 1, and ZeRO-3 checkpoints (weights gathered whole too) resumed at
/// ZeRO 0, dp = 1 and at dp = 2, pp = 1. Gradients are summed by one tree over the global microbatch index
/// (`optim::grad_tree`) wherever they are computed; ZeRO-1's shards are whole
/// blocks of each tensor and the norm is summed per block in one order
/// whoever holds the blocks (`optim::zero`).
#[test]
fn every_dp_pp_zero_schedule_process_count_and_resume_at_another_layout_gives_one_digest() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    // A constant rate after warmup, so a run stopped in its last step and
    // resumed sees the learning rates of one uninterrupted run.
    let layout = |dp: usize, zero: u8, extra: &[&str]| {
        let m = format!("parallel.microbatches={}", 8 / dp);
        let (dp, zero) = (format!("parallel.dp={dp}"), format!("parallel.zero={zero}"));
        let mut sets = vec!["optim.schedule=\"constant\"", "checkpoint.every=2", &dp, &m, &zero];
        sets.extend_from_slice(extra);
        model(&sets)
    };
    let train = |name: &str, args: &[String], flag: &str| {
        let run = dir.path().join(name);
        let mut c = Command::new(BIN);
        c.arg("train").args(args).args(["--steps", "3"]).arg(flag).arg(&run);
        let o = run_to_end(c, Duration::from_secs(60));
        assert!(o.status.success(), "{name}: {}", text(&o));
        digest(&run)
    };
    let reference = train("dp1-pp1", &layout(1, 0, &[]), "--out");
    let table = [
        (1, 2, 0),
        (2, 1, 0),
        (2, 2, 0),
        (4, 1, 0),
        (4, 2, 0),
        (2, 1, 1),
        (2, 2, 1),
        (4, 1, 1),
        (4, 2, 1),
        (2, 2, 2),
        (4, 1, 3),
        (2, 2, 3),
    ];
    for (dp, pp, zero) in table {
        let name = format!("dp{dp}-pp{pp}-zero{zero}");
        let pp = format!("parallel.pp={pp}");
        assert_eq!(train(&name, &layout(dp, zero, &[&pp]), "--out"), reference, "{name}");
    }
    let schedules: [&[&str]; 2] = [
        &["parallel.pp=2", "parallel.schedule=\"interleaved\"", "parallel.chunks=2"],
        &["parallel.pp=2", "parallel.schedule=\"zb-h1\""],
    ];
    for (i, extra) in schedules.iter().enumerate() {
        let name = format!("schedule{i}");
        assert_eq!(train(&name, &layout(2, 0, extra), "--out"), reference, "dp=2 {extra:?}");
    }
    for (zero, nodes) in [(0, 2), (1, 2), (1, 4), (2, 2), (3, 2), (3, 4)] {
        let args = [layout(2, zero, &["parallel.pp=2"]), vec!["--steps".into(), "3".into()]].concat();
        let what = format!("zero={zero} dp=2 × pp=2 over {nodes} processes");
        let under = dir.path().join(format!("zero{zero}"));
        std::fs::create_dir_all(&under).unwrap();
        assert_eq!(launched(&under, nodes, &args), reference, "{what}");
    }
    // Runs that stop in their last step, resumed from their checkpoint of
    // step 2 at another layout.
    let resumes = [
        (
            "dp1",
            layout(1, 0, &["checkpoint.every=1"]),
            layout(4, 1, &["parallel.pp=2", "checkpoint.every=1"]),
        ),
        ("zero1-dp2", layout(2, 1, &["checkpoint.every=1"]), layout(1, 0, &["checkpoint.every=1"])),
        ("zero3-dp2", layout(2, 3, &["checkpoint.every=1"]), layout(1, 0, &["checkpoint.every=1"])),
        (
            "zero3-dp4",
            layout(4, 3, &["parallel.pp=2", "checkpoint.every=1"]),
            layout(2, 3, &["checkpoint.every=1", "parallel.reshard_after_forward=false"]),
        ),
    ];
    for (name, first, then) in resumes {
        let run = dir.path().join(name);
        let mut c = Command::new(BIN);
        c.arg("train").args(first).args(["--steps", "3", "--out"]).arg(&run);
        c.env("PIPEWRIGHT_FAULT", "stage=0,step=2,mb=1,kind=error");
        assert!(
            !run_to_end(c, Duration::from_secs(60)).status.success(),
            "{name}: the injected fault stops it"
        );
        assert_eq!(train(name, &then, "--resume"), reference, "{name} resumed at another layout");
    }
}

/// Tensor parallelism: the same bits at tp 1, 2 and 4 (tp_slices = 4 on
/// every run) with pp = 2 and dp = 2, in one process, over two (whole
/// stages each) and over eight (each stage's tp ranks split over two
/// processes, the all-reduces crossing the data links), with ZeRO-1 and
/// ZB-H1, with interleaving and recompute (those two with sequence
/// parallelism), with ZeRO-3 (with SP and selective recompute; with ZB-H1
/// keeping the weights for the step), and for a tp = 1 run stopped in
/// its last step and resumed at tp = 4 (and pp = 1) in one process and over
/// four. The row-parallel sums are one slice tree whoever computes the
/// slices (`model::block`, `model::tp`); checkpoints hold whole tensors.
#[test]
fn every_tp_dividing_the_slices_with_pp_dp_processes_and_a_resume_at_another_tp_gives_one_digest() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let layout = |tp: usize, pp: usize, slices: usize, extra: &[&str]| {
        let (tp, pp, slices) = (
            format!("parallel.tp={tp}"),
            format!("parallel.pp={pp}"),
            format!("parallel.tp_slices={slices}"),
        );
        let mut sets = vec![
            "model.n_head=4",
            "optim.schedule=\"constant\"",
            "parallel.dp=2",
            "parallel.microbatches=4",
            &tp,
            &pp,
            &slices,
        ];
        sets.extend_from_slice(extra);
        [model(&sets), vec!["--steps".into(), "3".into()]].concat()
    };
    let train = |name: &str, args: &[String], flag: &str| {
        let run = dir.path().join(name);
        let mut c = Command::new(BIN);
        c.arg("train").args(args).arg(flag).arg(&run);
        let o = run_to_end(c, Duration::from_secs(60));
        assert!(o.status.success(), "{name}: {}", text(&o));
        digest(&run)
    };
    let reference = train("tp1", &layout(1, 2, 4, &[]), "--out");
    for tp in [2, 4] {
        assert_eq!(train(&format!("tp{tp}"), &layout(tp, 2, 4, &[]), "--out"), reference, "tp = {tp}");
        let under = dir.path().join(format!("launch-tp{tp}"));
        std::fs::create_dir_all(&under).unwrap();
        assert_eq!(launched(&under, 2, &layout(tp, 2, 4, &[])), reference, "tp = {tp} over 2 processes");
        // 8 processes: each stage's tp ranks split over 2 of them (tp 2: one
        // rank each; tp 4: two each), the all-reduces crossing the links.
        assert_eq!(launched(&under, 8, &layout(tp, 2, 4, &[])), reference, "tp = {tp} over 8 processes");
    }
    // A stage's ranks in other processes under ZB-H1's split backward and
    // ZeRO-1, and under interleaving with recompute.
    let mixed: [(usize, &[&str]); 3] = [
        (4, &["parallel.zero=1", "parallel.schedule=\"zb-h1\"", "parallel.sp=true"]),
        (
            2,
            &[
                "parallel.schedule=\"interleaved\"",
                "parallel.chunks=2",
                "train.recompute=true",
                "parallel.sp=true",
            ],
        ),
        // ZeRO-3: the replicas' weight shards gathered across processes, each
        // stage's tp ranks cutting theirs from the gathered whole per action.
        (2, &["parallel.zero=3", "parallel.sp=true", "train.recompute=\"selective\""]),
    ];
    for (i, &(tp, extra)) in mixed.iter().enumerate() {
        let under = dir.path().join(format!("launch-mixed{i}"));
        std::fs::create_dir_all(&under).unwrap();
        assert_eq!(
            launched(&under, 8, &layout(tp, 2, 4, extra)),
            reference,
            "tp = {tp} over 8 processes {extra:?}"
        );
    }
    // With the other schedules, ZeRO-1 and recompute.
    let mixed: [(usize, &[&str]); 3] = [
        (2, &["parallel.zero=1", "parallel.schedule=\"zb-h1\"", "parallel.sp=true"]),
        (
            4,
            &[
                "parallel.schedule=\"interleaved\"",
                "parallel.chunks=2",
                "train.recompute=true",
                "parallel.sp=true",
            ],
        ),
        (4, &["parallel.zero=3", "parallel.schedule=\"zb-h1\"", "parallel.reshard_after_forward=false"]),
    ];
    for (i, &(tp, extra)) in mixed.iter().enumerate() {
        assert_eq!(
            train(&format!("mixed{i}"), &layout(tp, 2, 4, extra), "--out"),
            reference,
            "tp = {tp} {extra:?}"
        );
    }
    // The slices are the definition: plain products are other bits.
    assert_ne!(train("plain", &layout(1, 2, 1, &[]), "--out"), reference, "tp_slices = 1");
    // A tp = 1 run that failed in its last step, resumed at tp = 4 × pp = 1
    // in one process, and over 4 processes (each stage's ranks on two).
    for (name, nodes) in [("resumed", 1), ("resumed-split", 4)] {
        let run = dir.path().join(name);
        let mut c = Command::new(BIN);
        c.arg("train").args(layout(1, 2, 4, &["checkpoint.every=1"])).arg("--out").arg(&run);
        c.env("PIPEWRIGHT_FAULT", "stage=0,step=2,mb=1,kind=error");
        assert!(!run_to_end(c, Duration::from_secs(60)).status.success(), "the injected fault stops it");
        let mut c = Command::new(BIN);
        match nodes {
            1 => c.arg("train"),
            n => c.args(["launch", "--nodes", &n.to_string()]),
        };
        c.args(layout(4, 1, 4, &["checkpoint.every=1"])).arg("--resume").arg(&run);
        let o = run_to_end(c, Duration::from_secs(60));
        assert!(o.status.success(), "{name}: {}", text(&o));
        assert_eq!(digest(&run), reference, "resumed at tp = 4 over {nodes} process(es)");
    }
}

/// What rank 0's tp frames carried (summary.json's `tp_traffic`) is the
/// planner's count (`plan --nodes`: per microbatch, and the weight shards
/// per step) over the steps and microbatches trained, to the byte: plain, with recompute, interleaved (two chunks
/// on rank 0, each its own group), and sequence parallel with recompute.
#[test]
fn a_split_stage_s_tp_traffic_is_the_planner_s_count() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&[&str], usize); 4] = [
        (&["parallel.pp=1"], 2),
        (&["parallel.pp=1", "train.recompute=true"], 2),
        (&["parallel.pp=2", "parallel.schedule=\"interleaved\"", "parallel.chunks=2"], 4),
        // Sequence parallelism's gathers, reduce-scatters and the norms' turns.
        (&["parallel.pp=1", "parallel.sp=true", "train.recompute=true"], 2),
    ];
    for (i, (extra, nodes)) in cases.into_iter().enumerate() {
        // Random tokens: no validation split or exact-match set, so no
        // evaluation forwards beside the trained microbatches.
        let mut sets = vec![
            "parallel.tp=2",
            "parallel.tp_slices=2",
            "parallel.microbatches=4",
            "data.builtin=\"random\"",
        ];
        sets.extend_from_slice(extra);
        let (args, steps) = (model(&sets), 2.0);
        let run = dir.path().join(format!("run{i}"));
        let mut c = Command::new(BIN);
        c.args(["launch", "--nodes", &nodes.to_string()])
            .args(&args)
            .args(["--steps", "2", "--out"])
            .arg(&run);
        let o = run_to_end(c, Duration::from_secs(60));
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
        let got = &summary["tp_traffic"];
        let plan = Command::new(BIN)
            .args(["plan", "--gpu", "cpu", "--json", "--nodes", &nodes.to_string()])
            .args(&args)
            .output()
            .unwrap();
        assert!(plan.status.success(), "{}", String::from_utf8_lossy(&plan.stderr));
        let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
        let per_mb = &plan["cpu"]["ranks"][0]["tp_link_bytes"];
        // The weight shards go out once per step, the rest per microbatch.
        let per_step = per_mb["shards_per_step"].as_f64().unwrap();
        for (mine, theirs, once) in [
            ("nodes_sent", "nodes_sent", 0.0),
            ("nodes_received", "nodes_sent", 0.0),
            ("commands_sent", "commands_sent", per_step),
            ("answers_received", "answers_received", 0.0),
        ] {
            let want = steps * (per_mb[theirs].as_f64().unwrap() * 4.0 + once);
            assert_eq!(
                got[mine].as_f64(),
                Some(want),
                "{extra:?}: {mine}: {got} against {per_mb} per microbatch"
            );
        }
    }
}

/// `worker` as rank `rank` of `world`, with torchrun's variables.
fn worker(port: u16, rank: usize, world: usize, cookie: &str, args: &[String]) -> Child {
    common::worker_command(port, rank, world, cookie, args).spawn().unwrap()
}

/// Waits for `child` at most `limit`; kills it and fails the test past that.
fn finish(mut child: Child, limit: Duration, what: &str) -> Output {
    let until = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!("{what} still running after {limit:?}: {}", text(&o));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn killing_a_worker_stops_the_others_with_an_error_naming_it() {
    let _serial = one_at_a_time();
    kill_one_of_four(&["parallel.pp=2", "parallel.dp=2"], 2);
}

/// The same under ZeRO-3, where the killed process holds a replica's shards
/// of the weights and the others wait in its gathers and scatters.
#[test]
fn killing_a_zero_3_worker_stops_the_others_with_an_error_naming_it() {
    let _serial = one_at_a_time();
    kill_one_of_four(&["parallel.pp=2", "parallel.dp=2", "parallel.zero=3"], 3);
}

/// The same when the one killed holds tensor-parallel ranks of stage 0,
/// whose actor runs on rank 0: the owner's all-reduce waits must end too.
#[test]
fn killing_a_tp_follower_stops_the_others_with_an_error_naming_it() {
    let _serial = one_at_a_time();
    kill_one_of_four(&["parallel.pp=2", "parallel.tp=2", "parallel.tp_slices=2", "parallel.sp=true"], 1);
}

/// Four workers on `layout`; once two checkpoints are written, `victim` is
/// killed: every other rank must fail within 20 s naming it, and the newest
/// complete checkpoint still loads.
fn kill_one_of_four(layout: &[&str], victim: usize) {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let port = free_ports();
    let mut sets = vec!["checkpoint.every=2", "checkpoint.keep=2"];
    sets.extend_from_slice(layout);
    let args =
        [model(&sets), vec!["--steps".into(), "2000".into(), "--out".into(), run.display().to_string()]]
            .concat();
    let mut ranks: Vec<Option<Child>> = (0..4).map(|r| Some(worker(port, r, 4, "k1ll", &args))).collect();
    let checkpoints = run.join("checkpoints");
    let until = Instant::now() + Duration::from_secs(60);
    while pipewright::checkpoint::list(&checkpoints).unwrap().0.len() < 2 {
        assert!(Instant::now() < until, "no checkpoint within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut killed = ranks[victim].take().unwrap();
    killed.kill().unwrap();
    killed.wait().unwrap();
    let at = Instant::now();
    let name = format!("rank {victim}");
    for (r, c) in ranks.into_iter().enumerate() {
        let Some(c) = c else { continue };
        let o = finish(c, Duration::from_secs(20), &format!("rank {r}"));
        let err = text(&o);
        assert!(!o.status.success(), "rank {r} exited cleanly after {name} was killed: {err}");
        assert!(err.contains(&name), "rank {r}'s error does not name {name}: {err}");
    }
    assert!(at.elapsed() < Duration::from_secs(20));
    // The newest complete checkpoint still reads and verifies.
    let (done, _) = pipewright::checkpoint::list(&checkpoints).unwrap();
    let (_, last) = done.last().expect("a checkpoint");
    pipewright::checkpoint::load(last).unwrap();
}

#[test]
fn a_wrong_cookie_is_refused_and_logged() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports();
    let args = refused_peer_args(dir.path(), 5);
    let rank0 = worker(port, 0, 2, "right", &args);
    let intruder = finish(worker(port, 1, 2, "wrong", &args), Duration::from_secs(30), "intruder");
    assert!(!intruder.status.success());
    assert!(text(&intruder).contains("authentication failed"), "{}", text(&intruder));
    let o = finish(rank0, Duration::from_secs(30), "rank 0");
    let err = text(&o);
    assert!(!o.status.success(), "rank 0 ran without its worker: {err}");
    assert!(err.contains("refused cluster node 127.0.0.1:"), "rank 0 did not log the refusal: {err}");
    assert!(err.contains("ranks [1] did not join"), "{err}");
}

#[test]
fn garbage_on_a_data_port_is_refused_and_the_run_goes_on() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let steps = vec!["--steps".into(), "3".into()];
    let base = [model(&["parallel.pp=2"]), steps].concat();
    let reference = one_process(dir.path(), &base);
    let run = dir.path().join("run");
    let args = [base, vec!["--out".into(), run.display().to_string()]].concat();
    let port = free_ports();
    let rank0 = worker(port, 0, 2, "s3cret", &args);
    let data = ("127.0.0.1", port + 1);
    let until = Instant::now() + Duration::from_secs(30);
    let connect = || loop {
        match TcpStream::connect(data) {
            Ok(s) => return s,
            Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("rank 0's data port: {e}"),
        }
    };
    // Bytes that are no handshake at all.
    let mut raw = connect();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n\xff\xff\xff\xff garbage").unwrap();
    drop(raw);
    // A peer that holds the cookie and then sends a malformed frame: its link
    // is closed, and the real rank 1 still joins.
    let cookie = pipewright::cluster::link::Cookie::new("s3cret").unwrap();
    let (mut s, r) =
        pipewright::cluster::link::connect(data.into_addr(), 1, 2, "127.0.0.1:9", &cookie, None).unwrap();
    assert_eq!(r, 0);
    s.writer.write_all(b"PWF1\xff\xff\xff\x7f\x00\x00\x00\x00\x00\x00\x00\x00junk").unwrap();
    let mut buf = [0u8; 1];
    // Rank 0 closes the link.
    s.socket.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(s.reader.read(&mut buf).unwrap_or(0), 0);
    let rank1 = worker(port, 1, 2, "s3cret", &args);
    let o1 = finish(rank1, Duration::from_secs(60), "rank 1");
    let o0 = finish(rank0, Duration::from_secs(60), "rank 0");
    let err = text(&o0);
    assert!(o0.status.success() && o1.status.success(), "rank 0: {err}\nrank 1: {}", text(&o1));
    assert!(err.contains("refused data link 127.0.0.1:"), "the raw garbage was not reported: {err}");
    assert!(err.contains("dropped the data link from process rank 1 (127.0.0.1:"), "{err}");
    assert!(err.contains("header of"), "the malformed frame was not named: {err}");
    assert_eq!(digest(&run), reference);
}

trait IntoAddr {
    fn into_addr(self) -> std::net::SocketAddr;
}

impl IntoAddr for (&str, u16) {
    fn into_addr(self) -> std::net::SocketAddr {
        std::net::SocketAddr::new(self.0.parse().unwrap(), self.1)
    }
}

/// Test certificates made by scripts/make-test-certs.sh (the openssl
/// recipe of docs/guide/clusters.md): ca.pem signs node.pem; rogue.pem comes from another CA.
fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/tls/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn tls_flags(cert: &str, key: &str) -> Vec<String> {
    ["--tls-cert", &fixture(cert), "--tls-key", &fixture(key), "--tls-ca", &fixture("ca.pem")]
        .map(String::from)
        .to_vec()
}

/// `worker` with TLS from the environment (no TLS when `cert` is None).
fn tls_worker(port: u16, rank: usize, cookie: &str, cert: Option<(&str, &str)>, args: &[String]) -> Child {
    let mut c = common::worker_command(port, rank, 2, cookie, args);
    for v in ["PIPEWRIGHT_TLS_CERT", "PIPEWRIGHT_TLS_KEY", "PIPEWRIGHT_TLS_CA"] {
        c.env_remove(v);
    }
    if let Some((cert, key)) = cert {
        c.env("PIPEWRIGHT_TLS_CERT", fixture(cert))
            .env("PIPEWRIGHT_TLS_KEY", fixture(key))
            .env("PIPEWRIGHT_TLS_CA", fixture("ca.pem"));
    }
    c.spawn().unwrap()
}

#[test]
fn pp4_over_4_processes_under_tls_gives_the_bits_of_one_process() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let args = [model(&["parallel.pp=4"]), vec!["--steps".into(), "3".into()]].concat();
    let reference = one_process(dir.path(), &args);
    // Ranks 1–3 also link to each other, so every kind of link runs TLS.
    let run = dir.path().join("tls");
    let mut c = Command::new(BIN);
    c.args(["launch", "--nodes", "4"])
        .args(tls_flags("node.pem", "node.key"))
        .args(&args)
        .arg("--out")
        .arg(&run);
    let o = run_to_end(c, Duration::from_secs(90));
    assert!(o.status.success(), "launch under TLS: {}", text(&o));
    assert!(text(&o).contains("mutual TLS"), "rank 0 does not say it runs TLS: {}", text(&o));
    assert_eq!(digest(&run), reference);
}

#[test]
fn a_certificate_from_another_ca_or_no_tls_is_refused_and_logged() {
    let _serial = one_at_a_time();
    use pipewright::cluster::link;
    use pipewright::cluster::tls::{Tls, TlsFiles};
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports();
    let args = refused_peer_args(dir.path(), 8);
    let rank0 = tls_worker(port, 0, "c00kie", Some(("node.pem", "node.key")), &args);
    // The data link: a certificate rank 0's CA did not sign, and no TLS at all,
    // each with the right cookie.
    let data = ("127.0.0.1", port + 1).into_addr();
    let until = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(data).is_err() {
        assert!(Instant::now() < until, "rank 0's data port did not open");
        std::thread::sleep(Duration::from_millis(20));
    }
    let cookie = link::Cookie::new("c00kie").unwrap();
    let f = |name: &str| (name.to_string(), std::path::PathBuf::from(fixture(name)));
    let rogue = Tls::load(&TlsFiles { cert: f("rogue.pem"), key: f("rogue.key"), ca: f("ca.pem") }).unwrap();
    // In TLS 1.3 the server judges the client's certificate last, so this side
    // may hear an alert or only a reset: either way it is refused.
    assert!(link::connect(data, 1, 2, "127.0.0.1:9", &cookie, Some(&rogue)).is_err());
    let e = link::connect(data, 1, 2, "127.0.0.1:9", &cookie, None).err().expect("plain link");
    assert!(e.to_string().contains("speaks TLS"), "{e}");
    // The cluster node: the same two, as whole workers.
    let rogue = finish(
        tls_worker(port, 1, "c00kie", Some(("rogue.pem", "rogue.key")), &args),
        Duration::from_secs(30),
        "rogue worker",
    );
    assert!(!rogue.status.success(), "{}", text(&rogue));
    let plain = finish(tls_worker(port, 1, "c00kie", None, &args), Duration::from_secs(30), "plain worker");
    assert!(!plain.status.success(), "{}", text(&plain));
    assert!(text(&plain).contains("rank 0 runs with TLS?"), "{}", text(&plain));
    let o = finish(rank0, Duration::from_secs(30), "rank 0");
    let err = text(&o);
    assert!(!o.status.success(), "rank 0 ran without its worker: {err}");
    assert!(err.contains("ranks [1] did not join"), "{err}");
    // Each link logs both refusals with the peer's address and the reason
    // (the probe for the open port above adds one more data-link line).
    for link in ["refused data link 127.0.0.1:", "refused cluster node 127.0.0.1:"] {
        let logged = |why: &str| err.lines().any(|l| l.starts_with(link) && l.contains(why));
        assert!(logged("invalid peer certificate: UnknownIssuer"), "{link} from another CA: {err}");
        assert!(logged("InvalidContentType"), "{link} without TLS: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_bad_tls_file_is_an_error_naming_it() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-cert.pem").display().to_string();
    let not_pem = format!("{}/Cargo.toml", env!("CARGO_MANIFEST_DIR"));
    let (cert, key, ca) = (fixture("node.pem"), fixture("node.key"), fixture("ca.pem"));
    let launch = |tls: &[&str], expect: &[&str]| {
        let mut c = Command::new(BIN);
        c.args(["launch", "--nodes", "2"]).args(tls).args(model(&["parallel.pp=2"]));
        c.arg("--out").arg(dir.path().join("run"));
        for v in ["PIPEWRIGHT_TLS_CERT", "PIPEWRIGHT_TLS_KEY", "PIPEWRIGHT_TLS_CA"] {
            c.env_remove(v);
        }
        let o = run_to_end(c, Duration::from_secs(20));
        let err = text(&o);
        assert!(!o.status.success(), "{tls:?} was accepted: {err}");
        assert!(!err.contains("panicked"), "{err}");
        for e in expect {
            assert!(err.contains(e), "{tls:?}: the error does not say {e:?}: {err}");
        }
    };
    launch(&["--tls-cert", &missing, "--tls-key", &key, "--tls-ca", &ca], &[&missing, "cannot read"]);
    launch(
        &["--tls-cert", &not_pem, "--tls-key", &key, "--tls-ca", &ca],
        &[&not_pem, "no certificate in it", "BEGIN CERTIFICATE"],
    );
    launch(
        &["--tls-cert", &cert, "--tls-key", &cert, "--tls-ca", &ca],
        &[&cert, "no private key", "PRIVATE KEY"],
    );
    launch(
        &["--tls-cert", &cert, "--tls-key", &fixture("rogue.key"), "--tls-ca", &ca],
        &[&fixture("rogue.key"), "cannot use this key and certificate"],
    );
    launch(&["--tls-cert", &cert], &["--tls-cert given", "--tls-key and --tls-ca missing"]);
    // From the environment, a worker names the variable and the file.
    let mut c = Command::new(BIN);
    c.args(["worker", "--join", "127.0.0.1:1", "--rank", "1", "--world", "2"])
        .env("PIPEWRIGHT_TLS_CERT", &cert)
        .env("PIPEWRIGHT_TLS_KEY", &key)
        .env("PIPEWRIGHT_TLS_CA", &missing)
        .env("PIPEWRIGHT_COOKIE", "x");
    let o = run_to_end(c, Duration::from_secs(20));
    assert!(!o.status.success());
    assert!(text(&o).contains(&format!("PIPEWRIGHT_TLS_CA {missing}: cannot read")), "{}", text(&o));
}

#[test]
fn strangers_holding_connections_open_cannot_stop_a_run() {
    // Rank 0 may open 256 descriptors. Strangers open 300 connections to each
    // of its ports and say nothing, or a byte every two seconds: without caps
    // and deadlines they would hold every descriptor, and the run would end at
    // its next file. Past the caps they are closed at once; the admitted ones
    // are closed at the handshake deadline; then rank 1 joins and the run
    // ends on the bits of one process.
    use std::os::unix::process::CommandExt;
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let base = [model(&["parallel.pp=2"]), vec!["--steps".into(), "3".into()]].concat();
    let reference = one_process(dir.path(), &base);
    let run = dir.path().join("run");
    let args = [base, vec!["--out".into(), run.display().to_string(), "--join-timeout".into(), "120".into()]]
        .concat();
    let port = free_ports();
    let mut c = common::worker_command(port, 0, 2, "s3cret", &args);
    // SAFETY: setrlimit only, between fork and exec.
    unsafe {
        c.pre_exec(|| {
            let lim = libc::rlimit { rlim_cur: 256, rlim_max: 256 };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let rank0 = c.spawn().unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    for p in [port, port + 1] {
        while TcpStream::connect(("127.0.0.1", p)).is_err() {
            assert!(Instant::now() < until, "rank 0's port {p} did not open");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let mut strangers = vec![];
    for p in [port, port + 1] {
        for _ in 0..300 {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", p)) {
                strangers.push(s);
            }
        }
    }
    let trickle = |p: u16| {
        std::thread::spawn(move || {
            let Ok(mut s) = TcpStream::connect(("127.0.0.1", p)) else { return };
            for _ in 0..15 {
                if s.write_all(b"\x00").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_secs(2));
            }
        })
    };
    let tricklers = [trickle(port), trickle(port + 1)];
    // Past the handshake deadline, the admitted strangers are gone too.
    std::thread::sleep(Duration::from_secs(12));
    let rank1 = worker(port, 1, 2, "s3cret", &args);
    let o1 = finish(rank1, Duration::from_secs(90), "rank 1");
    let o0 = finish(rank0, Duration::from_secs(90), "rank 0");
    let err = text(&o0);
    assert!(o0.status.success() && o1.status.success(), "rank 0: {err}\nrank 1: {}", text(&o1));
    assert_eq!(digest(&run), reference);
    assert!(err.contains("have not authenticated yet (at most"), "no cap was reported: {err}");
    assert!(err.contains("no handshake within"), "the data port's deadline was not reported: {err}");
    assert!(err.contains("no authentication within"), "the cluster port's deadline was not reported: {err}");
    drop(strangers);
    for t in tricklers {
        t.join().unwrap();
    }
}

/// `worker --slurm` as task `rank` of an srun step of `ntasks` tasks on one
/// node named `localhost`: the variables srun sets for it, and no others
/// that place a worker (torchrun's, a GPU list).
fn slurm_task(job: u64, rank: usize, ntasks: usize, extra: &[&str], args: &[String]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["worker", "--slurm"]).args(extra).args(args);
    for v in
        ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "PIPEWRIGHT_COOKIE_FILE"]
    {
        c.env_remove(v);
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("SLURM") {
            c.env_remove(k);
        }
    }
    let n = ntasks.to_string();
    c.envs([
        ("SLURM_JOB_ID", job.to_string()),
        ("SLURM_STEP_ID", "0".into()),
        ("SLURM_PROCID", rank.to_string()),
        ("SLURM_LOCALID", rank.to_string()),
        ("SLURM_NODEID", "0".into()),
        ("SLURM_NTASKS", n.clone()),
        ("SLURM_NPROCS", n.clone()),
        ("SLURM_STEP_NUM_TASKS", n.clone()),
        ("SLURM_STEP_NUM_NODES", "1".into()),
        ("SLURM_NNODES", "1".into()),
        ("SLURM_STEP_NODELIST", "localhost".into()),
        ("SLURM_JOB_NODELIST", "localhost".into()),
        ("SLURM_NODELIST", "localhost".into()),
        ("SLURMD_NODENAME", "localhost".into()),
        ("SLURM_STEP_TASKS_PER_NODE", n.clone()),
        ("SLURM_TASKS_PER_NODE", n),
        ("PIPEWRIGHT_COOKIE", "one file for every job".into()),
    ])
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped());
    c
}

/// A job id whose default port (`cluster::slurm::default_port`) and the
/// next are free on loopback now.
fn job_with_free_default_port() -> u64 {
    let start = std::process::id() as u64 * 7919;
    (start..start + 5_000)
        .find(|job| {
            let port = 20_000 + 2 * (job % 5_000) as u16;
            let a = std::net::TcpListener::bind(("127.0.0.1", port));
            let b = std::net::TcpListener::bind(("127.0.0.1", port + 1));
            a.is_ok() && b.is_ok()
        })
        .expect("a free port pair in 20000..30000")
}

#[test]
fn two_and_four_srun_tasks_with_no_rank_flags_give_the_bits_of_one_process() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let steps = vec!["--steps".to_string(), "3".to_string()];
    let reference = one_process(dir.path(), &[model(&[]), steps.clone()].concat());
    // pp = 4 over 2 tasks at the port derived from the job id; pp = 2 ×
    // dp = 2 over 4 tasks at a --port (microbatches per replica halved: the
    // same global batch).
    let port = free_ports().to_string();
    let runs: [(usize, Vec<String>, Vec<&str>); 2] = [
        (2, model(&["parallel.pp=4"]), vec![]),
        (4, model(&["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4"]), vec!["--port", &port]),
    ];
    for (ntasks, layout, extra) in runs {
        let job = job_with_free_default_port();
        let run = dir.path().join(format!("srun{ntasks}"));
        let args = [layout, steps.clone(), vec!["--out".into(), run.display().to_string()]].concat();
        let tasks: Vec<Child> =
            (0..ntasks).map(|r| slurm_task(job, r, ntasks, &extra, &args).spawn().unwrap()).collect();
        let outs: Vec<Output> = tasks
            .into_iter()
            .enumerate()
            .map(|(r, t)| finish(t, Duration::from_secs(90), &format!("task {r}")))
            .collect();
        for (r, o) in outs.iter().enumerate() {
            assert!(o.status.success(), "{ntasks} tasks: task {r}: {}", text(o));
        }
        let log = text(&outs[1]);
        let want = format!(
            "SLURM job {job} step 0, task 1 of {ntasks} (local id 1) on localhost: rank 1 of {ntasks}"
        );
        assert!(log.contains(&want), "{ntasks} tasks: task 1 does not say where it stands: {log}");
        assert_eq!(digest(&run), reference, "{ntasks} srun tasks");
    }
}

#[test]
fn contradictory_slurm_variables_are_an_error_naming_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    let args = refused_peer_args(dir.path(), 5);
    let o = run_to_end(slurm_task(1, 3, 2, &[], &args), Duration::from_secs(30));
    assert!(!o.status.success());
    assert!(text(&o).contains("SLURM_PROCID=3: expected a rank below SLURM_NTASKS=2"), "{}", text(&o));
    let mut c = slurm_task(1, 0, 2, &[], &args);
    c.env("SLURM_STEP_NODELIST", "node[01-02").env("SLURM_STEP_TASKS_PER_NODE", "1(x2)");
    let o = run_to_end(c, Duration::from_secs(30));
    assert!(!o.status.success());
    assert!(text(&o).contains("SLURM_STEP_NODELIST=node[01-02: expected a SLURM hostlist"), "{}", text(&o));
    assert!(!dir.path().join("run").exists(), "a refused task wrote its run directory");
}
