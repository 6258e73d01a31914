//! The EMA of the weights (`optim.ema_decay`) as a user relies on it:
//! PyTorch's `AveragedModel` step by step (the first update copies, later
//! ones lerp, a skipped step leaves it alone), the same bits at every layout
//! and across a resume, written beside the weights as
//! `model.ema.safetensors`, and evaluated by `eval --ema`.

use std::path::{Path, PathBuf};
use std::process::Command;

const TINY: [&str; 20] = [
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
    "train.eval_every=0",
    "--set",
    "train.eval_batches=2",
    "--set",
    "checkpoint.every=2",
    "--set",
    "optim.ema_decay=0.9",
    "--set",
    "optim.warmup_steps=1",
];

fn run(args: &[&str], extra: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.args(args).args(TINY).args(extra);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// A finished run of `steps` steps in `dir/name` with `layout` (and more `--set`s).
fn train(dir: &Path, name: &str, steps: &str, layout: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let mut extra = Vec::new();
    for s in layout {
        extra.extend(["--set", s]);
    }
    let (ok, _, err) = run(&["train", "--steps", steps, "--out", out.to_str().unwrap()], &extra, &[]);
    assert!(ok, "{name}: {err}");
    out
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

fn field(dir: &Path, key: &str) -> String {
    summary(dir)[key].as_str().unwrap_or_else(|| panic!("{key} in {}", dir.display())).to_string()
}

/// One global batch of 4 microbatches, cut five ways (pp × dp, ZeRO 0, 1, 3).
const LAYOUTS: [(&str, [&str; 4]); 5] = [
    ("pp1", ["parallel.pp=1", "parallel.dp=1", "parallel.microbatches=4", "parallel.zero=0"]),
    ("pp2", ["parallel.pp=2", "parallel.dp=1", "parallel.microbatches=4", "parallel.zero=0"]),
    ("dp2", ["parallel.pp=1", "parallel.dp=2", "parallel.microbatches=2", "parallel.zero=0"]),
    ("pp2-dp2-zero1", ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2", "parallel.zero=1"]),
    ("pp2-dp2-zero3", ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2", "parallel.zero=3"]),
];

#[test]
fn the_ema_has_the_same_bits_at_every_layout_and_differs_from_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let mut seen = Vec::new();
    for (name, layout) in LAYOUTS {
        let out = train(dir.path(), name, "3", &layout);
        let (ema, weights) = (field(&out, "ema_weights_digest"), field(&out, "weights_digest"));
        assert_ne!(ema, weights, "{name}: after 3 steps the EMA lags the weights");
        assert!(out.join("model.ema.safetensors").is_file(), "{name}");
        seen.push((name, ema, weights));
    }
    for (name, ema, weights) in &seen[1..] {
        assert_eq!((ema, weights), (&seen[0].1, &seen[0].2), "{name} against pp1");
    }
}

/// ATen's lerp as its vectorized CPU kernel rounds it, written out here
/// apart from the crate's kernel.
fn lerp(ema: f32, param: f32, decay: f64) -> f32 {
    let w = (1.0 - decay) as f32;
    let d = param - ema;
    if w < 0.5 {
        w.mul_add(d, ema)
    } else {
        (w - 1.0).mul_add(d, param)
    }
}

/// Every step checkpointed: the EMA after step 1 is the weights, after each
/// later applied step it is lerp(EMA before, weights after AdamW), and a step
/// skipped for an overflowing gradient leaves it and its count alone.
#[test]
fn the_ema_copies_then_lerps_after_each_applied_step_and_a_skipped_step_leaves_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = out.to_str().unwrap();
    let every = ["--set", "checkpoint.every=1", "--set", "checkpoint.keep=10", "--set", "parallel.pp=2"];
    let (ok, _, err) = run(&["train", "--steps", "4", "--out", o], &every, &[("PIPEWRIGHT_FAULT_INF", "2")]);
    assert!(ok, "{err}");
    let root = out.join("checkpoints");
    let load = |step: u64| pipewright::checkpoint::load(&root.join(format!("step_{step:08}"))).unwrap();
    let mut before = load(1);
    let ema_of = |c: &pipewright::checkpoint::Loaded| c.ema.clone().expect("the checkpoint holds the EMA");
    assert_eq!(before.state.ema_updates, Some(1));
    for (name, (_, w)) in &before.weights.tensors {
        assert_eq!(&ema_of(&before)[name], w, "{name}: the first update copies");
    }
    let mut skipped = 0;
    for step in 2..=4 {
        let now = load(step);
        let (ema0, ema1) = (ema_of(&before), ema_of(&now));
        assert_eq!(now.state.ema_updates, Some(now.state.adam_step), "step {step}: once per applied step");
        if now.state.adam_step == before.state.adam_step {
            skipped += 1;
            assert_eq!(ema1, ema0, "step {step} was skipped: the EMA stays");
        } else {
            for (name, (_, w)) in &now.weights.tensors {
                let want: Vec<f32> = ema0[name].iter().zip(w).map(|(&e, &p)| lerp(e, p, 0.9)).collect();
                assert!(ema1[name] == want, "step {step}, {name}: lerp(EMA, weights after AdamW)");
            }
        }
        before = now;
    }
    assert_eq!(skipped, 1, "PIPEWRIGHT_FAULT_INF skips one step");
}

#[test]
fn a_run_resumed_at_another_layout_ends_with_the_uninterrupted_ema() {
    let dir = tempfile::tempdir().unwrap();
    let full = train(dir.path(), "full", "5", &LAYOUTS[0].1);
    let out = dir.path().join("crashed");
    let o = out.to_str().unwrap();
    let zero1: Vec<&str> = LAYOUTS[3].1.iter().flat_map(|s| ["--set", s]).collect();
    let fault = [("PIPEWRIGHT_FAULT", "stage=0,step=3,mb=1")];
    let (ok, _, err) = run(&["train", "--steps", "5", "--out", o], &zero1, &fault);
    assert!(!ok && err.contains("step 3"), "{err}");
    let pp1: Vec<&str> = LAYOUTS[0].1.iter().flat_map(|s| ["--set", s]).collect();
    let (ok, _, err) = run(&["train", "--steps", "5", "--resume", o], &pp1, &[]);
    assert!(ok, "{err}");
    assert!(err.contains("step 2"), "resumes from the checkpoint of step 2: {err}");
    for key in ["ema_weights_digest", "weights_digest"] {
        assert_eq!(field(&out, key), field(&full, key), "{key}");
    }
}

#[test]
fn an_ema_on_a_checkpoint_without_one_or_out_of_range_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = train(dir.path(), "plain", "2", &["optim.ema_decay=0"]);
    assert!(!out.join("model.ema.safetensors").exists());
    let o = out.to_str().unwrap();
    let (ok, _, err) = run(&["train", "--steps", "4", "--resume", o], &[], &[]);
    assert!(!ok, "{err}");
    assert!(err.contains("step_00000002") && err.contains("optim.ema_decay"), "{err}");
    // Without an EMA the old checkpoint resumes as it always did.
    let (ok, _, err) = run(&["train", "--steps", "4", "--resume", o], &["--set", "optim.ema_decay=0"], &[]);
    assert!(ok, "{err}");
    let fresh = dir.path().join("fresh");
    let (ok, _, err) = run(
        &["train", "--steps", "1", "--out", fresh.to_str().unwrap()],
        &["--set", "optim.ema_decay=1"],
        &[],
    );
    assert!(!ok && err.contains("optim.ema_decay") && err.contains("[0, 1)"), "{err}");
    let (ok, _, err) = run(&["eval", "--ema", "--weights", o, "--data", o], &[], &[]);
    assert!(!ok && err.contains("model.ema.safetensors"), "{err}");
}

fn write_llmc(path: &Path, tokens: &[u16]) {
    let mut header = [0i32; 256];
    (header[0], header[1], header[2]) = (20240520, 1, tokens.len() as i32);
    let mut b: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    b.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    std::fs::write(path, b).unwrap();
}

/// `eval --ema` on the run folder reads model.ema.safetensors and gives the
/// EMA's val loss the run reported; plain `eval` gives the weights'.
#[test]
fn eval_ema_on_the_run_folder_gives_the_ema_val_loss_the_run_reported() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tokens.bin");
    write_llmc(&data, &(0..4000u32).map(|i| ((i * 7 + i / 5) % 61) as u16).collect::<Vec<_>>());
    let d = data.to_str().unwrap();
    let (train_at, val_at) = (format!("data.train={d:?}"), format!("data.val={d:?}"));
    let out = train(dir.path(), "run", "3", &["data.builtin=\"\"", &train_at, &val_at]);
    let s = summary(&out);
    let o = out.to_str().unwrap();
    let eval = |ema: bool| {
        let mut args = vec!["eval", "--weights", o, "--data", d, "--json"];
        if ema {
            args.push("--ema");
        }
        let out = Command::new(env!("CARGO_BIN_EXE_pipewright")).args(&args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let (ema, weights) = (eval(true), eval(false));
    assert_eq!(Some(ema), s["ema_val_loss"].as_f64(), "{s}");
    assert_eq!(Some(weights), s["val_loss"].as_f64(), "{s}");
    assert_ne!(ema, weights);
}
