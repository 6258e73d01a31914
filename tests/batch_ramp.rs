//! `train.batch_ramp`: a global batch that grows over the first tokens has
//! one set of bits at every layout and across a resume in the middle of the
//! ramp, reads the data a constant batch of its size would, and is refused,
//! naming the field, where a size would not split over the replicas.

use pipewright::config::Config;
use pipewright::train::run::{train_with, Summary, TrainOptions};
use std::path::Path;
use std::process::Command;

/// 2 → 8 sequences by 2 over 160 tokens (10 sequences of 16): Megatron's
/// rule gives the steps 2, 2, 4, 6, 8 sequences (22 in all).
const RAMP: &str = "train.batch_ramp={ start = 2, increment = 2, tokens = 160 }";

const TINY: [&str; 9] = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    "train.micro_batch_size=1",
    "train.steps=5",
    "train.eval_every=0",
    "train.eval_batches=2",
    "optim.warmup_steps=1",
];

fn config(extra: &[&str]) -> Config {
    let o: Vec<String> = TINY.iter().chain(extra).map(|s| s.to_string()).collect();
    let cfg = Config::load(None, &o).unwrap();
    cfg.validate().unwrap();
    cfg
}

type Run = (Summary, Vec<f64>);

fn train(cfg: &Config, chaos: Option<u64>) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let opts = TrainOptions {
        out_dir: dir.path().join("run"),
        init: None,
        force: false,
        progress: false,
        resume: false,
    };
    let (s, out) = train_with(cfg, &opts, chaos).unwrap();
    (s, out.losses)
}

fn assert_same_bits(a: &Run, b: &Run, what: &str) {
    assert_eq!(a.1, b.1, "{what}: losses differ");
    assert_eq!(a.0.weights_digest, b.0.weights_digest, "{what}: weights differ");
}

#[test]
fn a_ramped_run_has_one_set_of_bits_at_pp_1_2_dp_1_2_and_zero_1_and_3() {
    let reference = train(&config(&[RAMP, "parallel.microbatches=8"]), None);
    assert_eq!(reference.0.tokens, 22 * 16, "the steps' tokens add up");
    for (what, extra) in [
        ("pp 2", &["parallel.pp=2", "parallel.microbatches=8"][..]),
        ("dp 2", &["parallel.dp=2", "parallel.microbatches=4"]),
        (
            "pp 2 dp 2 zero 1",
            &["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4", "parallel.zero=1"],
        ),
        // Scattered gradients' shard trees follow the step's size too.
        ("dp 2 zero 3", &["parallel.dp=2", "parallel.microbatches=4", "parallel.zero=3"]),
    ] {
        let cfg = config(&[&[RAMP][..], extra].concat());
        assert_same_bits(&reference, &train(&cfg, Some(5)), what);
    }
}

/// Each step reads the sequences after all the steps before it, and its loss
/// gradient is scaled by its own tokens: the ramp's two first steps (2
/// sequences each) are a constant batch of 2's, to the bit.
#[test]
fn the_first_steps_of_a_ramp_are_a_constant_run_of_their_size() {
    let flat = ["optim.schedule=\"constant\"", "optim.warmup_steps=0"];
    let ramp = train(&config(&[&[RAMP, "parallel.microbatches=8"][..], &flat].concat()), None);
    let small = train(&config(&[&["parallel.microbatches=2", "train.steps=2"][..], &flat].concat()), None);
    assert_eq!(ramp.1[..2], small.1[..], "steps 0 and 1 of 2 sequences");
    assert_eq!(ramp.1.len(), 5);
}

#[test]
fn ramps_that_would_split_a_step_unevenly_are_refused_naming_the_field() {
    let refused = |extra: &[&str]| {
        let o: Vec<String> = TINY.iter().chain(extra).map(|s| s.to_string()).collect();
        Config::load(None, &o).unwrap().validate().unwrap_err().to_string()
    };
    let dp2 = ["parallel.dp=2", "parallel.microbatches=4"];
    // 3 sequences do not split over 2 replicas.
    let e = refused(&[&dp2[..], &["train.batch_ramp={ start = 3, increment = 1, tokens = 160 }"]].concat());
    assert!(e.contains("train.batch_ramp.start: 3") && e.contains("train.batch_ramp.increment: 1"), "{e}");
    assert!(e.contains("parallel.dp × train.micro_batch_size"), "{e}");
    // 8 → 8 is no ramp; 4 does not reach 8 by 3; a ramp over no tokens.
    let e =
        refused(&["parallel.microbatches=8", "train.batch_ramp={ start = 8, increment = 2, tokens = 0 }"]);
    assert!(e.contains("train.batch_ramp.start: 8: must be below the full global batch"), "{e}");
    assert!(e.contains("train.batch_ramp.tokens: 0"), "{e}");
    let e =
        refused(&["parallel.microbatches=8", "train.batch_ramp={ start = 4, increment = 3, tokens = 9 }"]);
    assert!(e.contains("train.batch_ramp.increment: 3: must divide"), "{e}");
    // The CUDA backend runs a ramp too (its bits: scripts/emulated-gpu-check.sh);
    // whatever else this tiny model asks of a GPU, the ramp is not refused.
    let o: Vec<String> = TINY
        .iter()
        .chain(&[RAMP, "parallel.microbatches=8", "backend.kind=\"cuda\""])
        .map(|s| s.to_string())
        .collect();
    if let Err(e) = Config::load(None, &o).unwrap().validate() {
        assert!(!e.to_string().contains("train.batch_ramp"), "{e}");
    }
    let o = vec!["train.batch_ramp={ start = 2, increments = 2, tokens = 9 }".to_string()];
    let e = Config::load(None, &o).unwrap_err().to_string();
    assert!(e.contains("train.batch_ramp") && e.contains("increments"), "{e}");
    // Interleaving needs a multiple of pp microbatches in every step, the ramp's too.
    let cfg = config(&[
        "train.batch_ramp={ start = 1, increment = 1, tokens = 160 }",
        "parallel.microbatches=4",
        "parallel.pp=2",
        "parallel.schedule=\"interleaved\"",
        "parallel.chunks=2",
        "model.n_layer=4",
    ]);
    let e = pipewright::actors::layout::Layout::from_config(&cfg).unwrap_err().to_string();
    assert!(e.contains("train.batch_ramp (a step of 1 microbatches per replica)"), "{e}");
}

fn pipewright(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.args(args);
    for s in TINY.iter().chain(&[RAMP, "checkpoint.every=3"]) {
        c.args(["--set", s]);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Every step's loss and gradient norm as bits.
fn loss_bits(dir: &Path) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let step = |l: &str| {
        let m: serde_json::Value = serde_json::from_str(l).unwrap();
        (m["loss"].as_f64().unwrap().to_bits(), m["grad_norm"].as_f64().unwrap().to_bits())
    };
    text.lines().map(step).collect()
}

#[test]
fn a_run_stopped_in_the_middle_of_the_ramp_resumes_at_another_layout_to_the_uninterrupted_bits() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full");
    let (ok, err) =
        pipewright(&["train", "--out", full.to_str().unwrap(), "--set", "parallel.microbatches=8"], &[]);
    assert!(ok, "{err}");
    let out = dir.path().join("crash");
    let o = out.to_str().unwrap();
    // Step 4 fails; the checkpoint of step 3 is inside the ramp, whose
    // steps 0–2 held 2, 2 and 4 sequences: step 3 reads from sequence 8.
    let fault = [("PIPEWRIGHT_FAULT", "stage=0,step=4,mb=1,kind=error")];
    let (ok, err) = pipewright(&["train", "--out", o, "--set", "parallel.microbatches=8"], &fault);
    assert!(!ok && err.contains("step 4"), "{err}");
    let state = json(&out.join("checkpoints/step_00000003/state.json"));
    assert_eq!((state["data_cursor"].as_u64(), state["tokens"].as_u64()), (Some(8), Some(8 * 16)), "{state}");
    let layout = ["--set", "parallel.pp=2", "--set", "parallel.dp=2", "--set", "parallel.microbatches=4"];
    let (ok, err) = pipewright(&[&["train", "--resume", o][..], &layout].concat(), &[]);
    assert!(ok, "{err}");
    assert_eq!(
        json(&out.join("summary.json"))["weights_digest"],
        json(&full.join("summary.json"))["weights_digest"]
    );
    assert_eq!(loss_bits(&out), loss_bits(&full), "every step's loss and gradient norm, to the bit");
    assert_eq!(json(&out.join("summary.json"))["tokens"].as_u64(), Some(22 * 16));
}
