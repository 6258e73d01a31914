//! The actor runtime against the one-stage reference: every pipeline layout and
//! schedule, data parallelism, scrambled message delivery and failures.

use pipewright::config::Config;
use pipewright::train::run::{train_with, Summary, TrainOptions};

/// A small model with 4 layers (so pp = 4 has a layer per stage).
fn config(extra: &[&str]) -> Config {
    let mut o: Vec<String> = [
        "model.n_layer=4",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=16",
        "train.micro_batch_size=2",
        "train.steps=3",
        "train.eval_every=0",
        "train.eval_batches=2",
        "parallel.microbatches=8",
        "optim.warmup_steps=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    o.extend(extra.iter().map(|s| s.to_string()));
    Config::load(None, &o).unwrap()
}

/// A run's summary, its losses, and its weights by name.
type Run = (Summary, Vec<f64>, Vec<(String, Vec<f32>)>);

fn train(cfg: &Config, chaos: Option<u64>) -> Run {
    let dir = tempfile::tempdir().unwrap();
    train_in(dir.path(), cfg, chaos)
}

/// A run into `dir`/run.
fn train_in(dir: &std::path::Path, cfg: &Config, chaos: Option<u64>) -> Run {
    let opts =
        TrainOptions { out_dir: dir.join("run"), init: None, force: false, progress: false, resume: false };
    let (s, out) = train_with(cfg, &opts, chaos).unwrap();
    let mut params: Vec<(String, Vec<f32>)> =
        out.params.iter().map(|p| (p.name.clone(), p.data.clone())).collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    params.dedup_by(|a, b| a.0 == b.0);
    (s, out.losses, params)
}

fn assert_same_bits(a: &Run, b: &Run, what: &str) {
    assert_eq!(a.1, b.1, "{what}: losses differ");
    assert_eq!(a.0.weights_digest, b.0.weights_digest, "{what}: weights differ");
}

#[test]
fn pipelines_of_1_2_and_4_stages_give_identical_bits_under_1f1b_and_gpipe() {
    let reference = train(&config(&[]), None);
    for schedule in ["1f1b", "gpipe"] {
        for pp in [1, 2, 4] {
            let cfg = config(&[&format!("parallel.pp={pp}"), &format!("parallel.schedule=\"{schedule}\"")]);
            assert_same_bits(&reference, &train(&cfg, None), &format!("{schedule} pp={pp}"));
        }
    }
}

/// Keeping every activation, keeping the selective set (the norms' outputs
/// and the MLP's activation remade in backward) and keeping each block's
/// input alone give one set of weights: at pp 1 and 2 (the default), and
/// selective also with two replicas under ZeRO-1 and under ZB-H1's split
/// backward, whose W remakes what it reads.
#[test]
fn recompute_none_selective_and_full_give_one_set_of_weights() {
    let run = |extra: &[&str]| {
        train(&config(&[&["train.steps=2", "parallel.microbatches=4"], extra].concat()), None)
    };
    let reference = run(&[]);
    let layouts: [&[&str]; 7] = [
        &["parallel.pp=1", "train.recompute=none"],
        &["parallel.pp=1", "train.recompute=selective"],
        &["parallel.pp=1", "train.recompute=full"],
        &["train.recompute=selective"],
        &["train.recompute=full"],
        &["parallel.dp=2", "parallel.zero=1", "parallel.microbatches=2", "train.recompute=selective"],
        &["parallel.schedule=\"zb-h1\"", "train.recompute=selective"],
    ];
    let mut held = Vec::new();
    for extra in layouts {
        let r = run(extra);
        assert_same_bits(&reference, &r, &format!("{extra:?}"));
        held.push(r.0.peak_activation_bytes[0]);
    }
    // At pp = 1: none holds the most, full the least.
    assert!(held[0] > held[1] && held[1] > held[2], "{held:?}");
}

#[test]
fn interleaved_and_zero_bubble_schedules_give_identical_bits_too() {
    let reference = train(&config(&[]), None);
    let interleaved = config(&["parallel.pp=2", "parallel.schedule=\"interleaved\"", "parallel.chunks=2"]);
    assert_same_bits(&reference, &train(&interleaved, None), "interleaved pp=2 v=2");
    for pp in [2, 4] {
        let zb = config(&[&format!("parallel.pp={pp}"), "parallel.schedule=\"zb-h1\""]);
        assert_same_bits(&reference, &train(&zb, None), &format!("zb-h1 pp={pp}"));
    }
    // ZB-V places rank r's stages at r and 2p − 1 − r: rank 0 holds the embedding
    // and the head, rank 1 turns the V. Under chaos too, as the placement changes
    // who sends what to whom.
    let zb_v = config(&["parallel.pp=2", "parallel.schedule=\"zb-v\""]);
    assert_same_bits(&reference, &train(&zb_v, None), "zb-v pp=2");
    assert_same_bits(&reference, &train(&zb_v, Some(7)), "zb-v pp=2 under chaos");
    // DualPipeV on the same V mixes full backwards (B) with split ones (I, W) on
    // one stage, W's deferred past other stages' work: still one set of bits.
    let dualpipe_v = config(&["parallel.pp=2", "parallel.schedule=\"dualpipev\""]);
    assert_same_bits(&reference, &train(&dualpipe_v, None), "dualpipev pp=2");
    assert_same_bits(&reference, &train(&dualpipe_v, Some(7)), "dualpipev pp=2 under chaos");
    let uneven = config(&["parallel.pp=2", "parallel.layers_per_stage=[3, 1]"]);
    assert_same_bits(&reference, &train(&uneven, Some(9)), "uneven split under chaos");
}

#[test]
fn a_deadlocking_schedule_is_refused_before_anything_runs() {
    use pipewright::schedule::{Action, Schedule};
    // Rank 0 waits for 0B0 (needing 1B0) before sending 0F1; rank 1 wants 1F1 first.
    let s = Schedule::from_lists(vec![
        ["0F0", "0B0", "0F1", "0B1"].iter().map(|a| a.parse::<Action>().unwrap()).collect(),
        ["1F1", "1F0", "1B0", "1B1"].iter().map(|a| a.parse::<Action>().unwrap()).collect(),
    ])
    .unwrap();
    let err = pipewright::actors::layout::check_schedule(&s, "parallel.schedule").unwrap_err().to_string();
    assert!(err.contains("parallel.schedule") && err.contains("rank 0") && err.contains("rank 1"), "{err}");
}

#[test]
fn the_actor_runtime_equals_the_one_process_engine() {
    use pipewright::train::engine::Engine;
    let cfg = config(&["parallel.pp=2"]);
    let run = train(&cfg, None);
    // The same steps through the plain engine, with the same data stream.
    let sources = pipewright::train::run::load_sources(&cfg).unwrap();
    let mut data = sources.replica_data(&cfg).unwrap();
    let mut e = Engine::new(&cfg);
    let sched = pipewright::optim::LrSchedule::from_config(&cfg);
    let (m, b) = (cfg.parallel.microbatches, cfg.train.micro_batch_size);
    let mut losses = vec![];
    for step in 0..cfg.train.steps {
        let s =
            e.step(sched.lr(step), |mb, inp, tgt| data.train.fill(((step * m + mb) * b) as u64, inp, tgt));
        losses.push(s.loss);
    }
    assert_eq!(losses, run.1);
    assert_eq!(pipewright::model::io::weights_digest(&[&e.part]), run.0.weights_digest);
}

/// The chaos transport delays every message the runtime files by key instead of
/// handling in order: tokens, targets, activations, gradients, the tied
/// embedding's shares, reduced gradients, and the replicas' gradients on their way
/// into the reducer.
#[test]
fn scrambled_message_delivery_changes_no_bits() {
    let cfg = config(&["parallel.pp=4"]);
    let calm = train(&cfg, None);
    for seed in [1, 2, 3] {
        assert_same_bits(&calm, &train(&cfg, Some(seed)), &format!("chaos seed {seed}"));
    }
    let cfg = config(&["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4"]);
    let calm = train(&cfg, None);
    for seed in [4, 5] {
        assert_same_bits(&calm, &train(&cfg, Some(seed)), &format!("dp=2, chaos seed {seed}"));
    }
}

/// dp = 2 with m microbatches against dp = 1 with 2m: the same bits, the
/// replicas' gradients reaching the reducer in scrambled order, and the
/// one-process engine over the global batch agrees with dp = 4. Each
/// microbatch's gradient is a leaf of one tree over the global microbatch
/// index; a replica folds its block into tree nodes and the reducer joins
/// the nodes by the same tree (before it, dp = 2 differed from dp = 1 by 4e-7
/// in the step-0 gradient and 1e-5 in the weights after 3 steps).
#[test]
fn two_and_four_replicas_give_the_bits_of_one_with_the_same_global_batch() {
    let one = train(&config(&["parallel.pp=2"]), None);
    let two = config(&["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4"]);
    assert_same_bits(&one, &train(&two, Some(3)), "dp=2 under chaos");
    let four = config(&["parallel.dp=4", "parallel.microbatches=2"]);
    assert_same_bits(&one, &train(&four, None), "dp=4 pp=1");

    use pipewright::train::engine::Engine;
    let sources = pipewright::train::run::load_sources(&four).unwrap();
    let mut data = sources.replica_data(&four).unwrap();
    let mut e = Engine::new(&four);
    let sched = pipewright::optim::LrSchedule::from_config(&four);
    let (m, b) = (e.microbatches, four.train.micro_batch_size);
    for step in 0..four.train.steps {
        e.step(sched.lr(step), |mb, inp, tgt| data.train.fill(((step * m + mb) * b) as u64, inp, tgt));
    }
    assert_eq!(pipewright::model::io::weights_digest(&[&e.part]), one.0.weights_digest, "engine");
}

/// ZeRO-1 (each replica keeps the AdamW moments of its shard, gradients come
/// reduce-scattered, updated shards are gathered) gives the bits of dp = 1
/// with replicas' gradients and shards reaching the reducer in scrambled
/// order, under 1F1B, ZB-H1 and interleaving (two chunks a rank, so two
/// gathers), and its checkpoints hold the same tensors and moments as dp = 1's.
#[test]
fn zero_1_gives_the_bits_and_checkpoints_of_dp_1_under_scrambled_delivery() {
    let cfg = |extra: &[&str]| config(&[&["parallel.pp=2", "checkpoint.every=1"], extra].concat());
    let (one, one_ckpt) = train_keeping_checkpoint(&cfg(&[]), None);
    let layouts: [&[&str]; 4] = [
        &["parallel.dp=2", "parallel.microbatches=4", "parallel.zero=1"],
        &["parallel.dp=4", "parallel.microbatches=2", "parallel.zero=1"],
        &["parallel.dp=2", "parallel.microbatches=4", "parallel.zero=1", "parallel.schedule=\"zb-h1\""],
        &[
            "parallel.dp=2",
            "parallel.microbatches=4",
            "parallel.zero=1",
            "parallel.schedule=\"interleaved\"",
            "parallel.chunks=2",
        ],
    ];
    for (seed, extra) in (11..).zip(layouts) {
        let (run, ckpt) = train_keeping_checkpoint(&cfg(extra), Some(seed));
        assert_same_bits(&one, &run, &format!("{extra:?} under chaos seed {seed}"));
        assert_eq!(ckpt, one_ckpt, "{extra:?}: the last checkpoint's tensors and moments");
    }
}

/// ZeRO-2 (each replica also keeps only its shard of the reduced gradients)
/// and ZeRO-3 (also only its shard of the weights, gathered for each action
/// and freed after, or kept for the step) give the bits, validation losses
/// and checkpoints of dp = 1 under scrambled delivery: with 1F1B, ZB-H1 (W
/// gathers too), interleaving, recompute, and the tied embedding's two
/// copies on the first and last stage. ZeRO-3's evaluations gather the
/// weights replica 0 evaluates with from every replica.
#[test]
fn zero_2_and_3_give_the_bits_and_checkpoints_of_dp_1_under_scrambled_delivery() {
    let cfg = |extra: &[&str]| {
        config(&[&["parallel.pp=2", "checkpoint.every=1", "train.eval_every=2"], extra].concat())
    };
    let (one, one_ckpt) = train_keeping_checkpoint(&cfg(&[]), None);
    assert!(one.0.val_loss.is_some(), "the reference evaluates");
    let layouts: [&[&str]; 6] = [
        &["parallel.dp=2", "parallel.microbatches=4", "parallel.zero=2"],
        &["parallel.dp=4", "parallel.microbatches=2", "parallel.zero=3"],
        &["parallel.dp=2", "parallel.microbatches=4", "parallel.zero=3", "parallel.schedule=\"zb-h1\""],
        &[
            "parallel.dp=2",
            "parallel.microbatches=4",
            "parallel.zero=3",
            "parallel.schedule=\"interleaved\"",
            "parallel.chunks=2",
            "parallel.reshard_after_forward=false",
        ],
        &["parallel.dp=2", "parallel.microbatches=4", "parallel.zero=3", "train.recompute=true"],
        &["parallel.dp=2", "parallel.microbatches=4", "parallel.zero=2", "train.recompute=\"selective\""],
    ];
    for (seed, extra) in (21..).zip(layouts) {
        let (run, ckpt) = train_keeping_checkpoint(&cfg(extra), Some(seed));
        assert_same_bits(&one, &run, &format!("{extra:?} under chaos seed {seed}"));
        assert_eq!(run.0.val_loss.map(f64::to_bits), one.0.val_loss.map(f64::to_bits), "{extra:?}: val loss");
        assert_eq!(ckpt, one_ckpt, "{extra:?}: the last checkpoint's tensors and moments");
    }
}

/// Every tensor of a checkpoint with its moments, by name.
type Tensors = Vec<(String, Vec<f32>, Vec<f32>, Vec<f32>)>;

/// A run, and its last checkpoint's tensors and moments.
fn train_keeping_checkpoint(cfg: &Config, chaos: Option<u64>) -> (Run, Tensors) {
    let dir = tempfile::tempdir().unwrap();
    let run = train_in(dir.path(), cfg, chaos);
    let last = dir.path().join("run/checkpoints").join(format!("step_{:08}", cfg.train.steps));
    let c = pipewright::checkpoint::load(&last).unwrap();
    let mut tensors: Tensors = c
        .weights
        .tensors
        .iter()
        .map(|(name, (_, data))| {
            let (m, v) = c.moments[name].clone();
            (name.clone(), data.clone(), m, v)
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    (run, tensors)
}

#[test]
fn a_failing_stage_is_reported_with_actor_step_and_microbatch_and_nothing_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(["train", "--steps", "5", "--out", dir.path().join("r").to_str().unwrap()])
        .args(["--set", "parallel.pp=2", "--set", "parallel.microbatches=4", "--set", "model.n_layer=2"])
        .args(["--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "train.micro_batch_size=2"])
        .env("PIPEWRIGHT_FAULT", "stage=1,step=2,mb=3")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("stage-1 failed at step 2") && err.contains("microbatch 3"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(60));
}

/// Runs the binary to its end, killing it (and failing) after `limit`.
fn run_with_deadline(cmd: &mut std::process::Command, limit: std::time::Duration) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let err_path = dir.path().join("stderr");
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("still running after {limit:?}: {}", std::fs::read_to_string(&err_path).unwrap());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    (status.success(), std::fs::read_to_string(&err_path).unwrap())
}

#[test]
fn a_stage_that_fails_to_start_is_reported_and_nothing_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = run_with_deadline(
        std::process::Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args(["train", "--steps", "3", "--out", dir.path().join("r").to_str().unwrap()])
            .args(["--set", "parallel.pp=2", "--set", "parallel.microbatches=4", "--set", "model.n_layer=2"])
            .args([
                "--set",
                "model.n_embd=32",
                "--set",
                "model.n_head=2",
                "--set",
                "train.micro_batch_size=2",
            ])
            .env("PIPEWRIGHT_FAULT_START", "stage-1"),
        std::time::Duration::from_secs(60),
    );
    assert!(!ok, "{err}");
    assert!(
        err.contains("stage-1 failed at step 0: could not start: injected fault (PIPEWRIGHT_FAULT_START)"),
        "{err}"
    );
}

#[test]
fn impossible_layouts_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let opts = TrainOptions {
        out_dir: dir.path().join("r"),
        init: None,
        force: false,
        progress: false,
        resume: false,
    };
    let err = train_with(&config(&["parallel.pp=5"]), &opts, None).unwrap_err().to_string();
    assert!(err.contains("parallel.pp"), "{err}");
    let err = train_with(&config(&["parallel.pp=2", "parallel.layers_per_stage=[3, 3]"]), &opts, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("parallel.layers_per_stage"), "{err}");
    assert!(!dir.path().join("r").exists(), "nothing is written for a refused layout");
}

#[test]
fn dynamic_loss_scaling_changes_no_bits_on_f32() {
    // Powers of two scale and unscale exactly, so until something overflows the
    // scaled run is the unscaled one, bit for bit.
    let plain = train(&config(&["parallel.pp=2"]), None);
    let scaled = train(
        &config(&["parallel.pp=2", "optim.loss_scale=\"dynamic\"", "optim.loss_scale_init=1024"]),
        None,
    );
    assert_same_bits(&plain, &scaled, "loss scale 1024");
}

#[test]
fn overflowing_gradients_skip_the_step_and_back_the_scale_off() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    // A separate process: the fault knob is an environment variable.
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(["train", "--steps", "6", "--out", out.to_str().unwrap()])
        .args(["--set", "parallel.pp=2", "--set", "optim.loss_scale=\"dynamic\""])
        .args(["--set", "optim.loss_scale_init=1024", "--set", "optim.loss_scale_hysteresis=1"])
        .args(["--set", "recovery.max_skips=1"])
        .env("PIPEWRIGHT_FAULT_INF", "2")
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let scales: Vec<f64> = metrics.iter().map(|m| m["loss_scale"].as_f64().unwrap()).collect();
    assert_eq!(metrics[2]["skipped"], true);
    assert!(metrics[2]["alert"].as_str().unwrap().contains("overflowed"));
    assert_eq!(scales, [1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0]);
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["rollbacks"], 0, "an overflow is the scaler's business, not a failure (max_skips = 1)");
    assert_eq!(s["skipped_steps"], 1);
}

/// The F actions in `dir`'s trace.json, as (replica, stage, step).
fn forward_spans(dir: &std::path::Path) -> Vec<(u64, u64, u64)> {
    let text = std::fs::read_to_string(dir.join("trace.json")).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let is_forward =
        |e: &&serde_json::Value| e["cat"] == "action" && e["name"].as_str().unwrap().starts_with('F');
    let arg = |e: &serde_json::Value, k: &str| e["args"][k].as_u64().unwrap();
    events.iter().filter(is_forward).map(|e| (arg(e, "replica"), arg(e, "stage"), arg(e, "step"))).collect()
}

#[test]
fn two_traced_runs_in_one_process_each_write_only_their_own_records() {
    let dir = tempfile::tempdir().unwrap();
    let layouts = [(2usize, 1usize), (4, 2)];
    // Both runs start together and run long enough to record at the same time.
    let together = std::sync::Arc::new(std::sync::Barrier::new(layouts.len()));
    let runs: Vec<_> = layouts
        .iter()
        .enumerate()
        .map(|(i, &(pp, dp))| {
            let sets = [
                "trace.enabled=true",
                "train.steps=12",
                &format!("parallel.pp={pp}"),
                &format!("parallel.dp={dp}"),
            ];
            let cfg = config(&sets);
            let out_dir = dir.path().join(format!("run{i}"));
            let opts = TrainOptions {
                out_dir: out_dir.clone(),
                init: None,
                force: false,
                progress: false,
                resume: false,
            };
            let together = together.clone();
            std::thread::spawn(move || {
                together.wait();
                train_with(&cfg, &opts, None).map(|_| out_dir).unwrap()
            })
        })
        .collect();
    for (run, (pp, dp)) in runs.into_iter().zip(layouts) {
        let out_dir = run.join().unwrap();
        let spans = forward_spans(&out_dir);
        // 12 steps × 8 microbatches on every stage of every replica, and nothing else.
        assert_eq!(spans.len(), 12 * 8 * pp * dp, "pp={pp} dp={dp}");
        assert!(spans.iter().all(|&(r, s, step)| (r as usize) < dp && (s as usize) < pp && step < 12));
    }
}
