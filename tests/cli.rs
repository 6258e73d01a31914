//! The command line as a user meets it: bad input of every kind is refused
//! with a message naming the file or field, a non-zero exit and no panic, and
//! nothing an earlier run wrote is touched. Plus the outputs of a good run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
}

/// Runs pipewright; returns (success, stdout, stderr).
fn run(args: &[&str]) -> (bool, String, String) {
    let out = bin().args(args).output().expect("run pipewright");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "pipewright panicked: {stderr}");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string(), stderr)
}

/// A tiny model over the byte-level corpus, fast enough for tests.
const TINY: [&str; 14] = [
    "--set",
    "parallel.pp=1",
    TINY_SHAPE[0],
    TINY_SHAPE[1],
    TINY_SHAPE[2],
    TINY_SHAPE[3],
    TINY_SHAPE[4],
    TINY_SHAPE[5],
    TINY_SHAPE[6],
    TINY_SHAPE[7],
    "--set",
    "train.micro_batch_size=2",
    "--set",
    "train.eval_batches=2",
];

/// The tiny model's shape alone.
const TINY_SHAPE: [&str; 8] = [
    "--set",
    "model.n_layer=1",
    "--set",
    "model.n_embd=16",
    "--set",
    "model.n_head=2",
    "--set",
    "model.block_size=16",
];

fn tiny_train(out: &Path, extra: &[&str]) -> (bool, String, String) {
    let mut args = vec!["train", "--steps", "3", "--out", out.to_str().unwrap()];
    args.extend(TINY);
    args.extend(extra);
    run(&args)
}

fn refused(r: (bool, String, String), needles: &[&str]) {
    let (ok, _, err) = r;
    assert!(!ok, "expected a refusal, got success: {err}");
    for n in needles {
        assert!(err.contains(n), "message should mention {n:?}: {err}");
    }
}

fn write_llmc(path: &Path, tokens: &[u16], magic: i32, version: i32, count: i32) {
    let mut b = Vec::new();
    let mut header = [0i32; 256];
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    for h in header {
        b.extend_from_slice(&h.to_le_bytes());
    }
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    std::fs::write(path, b).unwrap();
}

#[test]
fn a_good_run_writes_every_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, _, err) = tiny_train(&out, &[]);
    assert!(ok, "{err}");
    for f in ["metrics.jsonl", "summary.json", "model.safetensors", "config.toml", "loss.svg"] {
        assert!(out.join(f).exists(), "missing {f}");
    }
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    for key in ["step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"] {
        assert!(lines[0].get(key).is_some(), "metrics lack {key}");
    }
    assert!(lines[2].get("val_loss").is_some(), "the last step evaluates");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for key in ["steps", "final_loss", "val_loss", "tokens_per_s", "gemm_util", "weights_digest"] {
        assert!(summary.get(key).is_some(), "summary lacks {key}");
    }
    // A share of the gemm rate measured here is not an MFU, so a CPU run does not call it one.
    assert!(summary.get("mfu").is_none(), "a CPU summary claims an mfu: {summary}");
    assert_eq!(summary["val_loss_step"], 3, "val_loss is the last step's evaluation");
    let ran = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(ran.contains("dtype = \"f32\""), "a CPU run computed in f32: {ran}");
    // The same config and seed give the same weights, bit for bit.
    let again = dir.path().join("again");
    assert!(tiny_train(&again, &[]).0);
    let s2: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(again.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["weights_digest"], s2["weights_digest"]);
    // inspect shows names, shapes and the stored config.
    let (ok, text, _) = run(&["inspect", out.to_str().unwrap()]);
    assert!(ok);
    assert!(text.contains("h.0.attn.c_attn.weight") && text.contains("[16, 48]"), "{text}");
    assert!(text.contains("n_embd = 16"), "{text}");
}

#[test]
fn an_earlier_run_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    assert!(tiny_train(&out, &[]).0);
    let before = std::fs::read(out.join("model.safetensors")).unwrap();
    refused(tiny_train(&out, &[]), &["metrics.jsonl", "--force"]);
    // Bad input aimed at the same directory fails before touching anything.
    refused(tiny_train(&out, &["--force", "--set", "model.n_head=3"]), &["model.n_head"]);
    assert_eq!(before, std::fs::read(out.join("model.safetensors")).unwrap());
}

#[test]
fn prepare_then_eval_reads_what_prepare_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "12+34=46\n".repeat(200)).unwrap();
    let data = dir.path().join("data");
    let (ok, _, err) = run(&["prepare", text.to_str().unwrap(), "--out", data.to_str().unwrap()]);
    assert!(ok, "{err}");
    // A second prepare into the same place is refused.
    refused(run(&["prepare", text.to_str().unwrap(), "--out", data.to_str().unwrap()]), &["train.bin"]);
    let out = dir.path().join("run");
    assert!(tiny_train(&out, &[]).0);
    let mut args: Vec<String> = vec!["eval".into(), "--weights".into(), out.display().to_string()];
    args.extend([
        "--data".into(),
        data.join("val.bin").display().to_string(),
        "--batches".into(),
        "4".into(),
    ]);
    args.push("--json".into());
    args.extend(TINY.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let (ok, stdout, err) = run(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let loss = v["loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss > 0.0);
}

/// The files of a tiny earlier run (with a trace), made once per test binary:
/// the outputs that bad input must never touch.
fn earlier_run_fixture() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-earlier-run-{}", std::process::id()));
        let (ok, _, err) = tiny_train(&dir, &["--trace", "--force"]);
        assert!(ok, "{err}");
        dir
    })
}

/// Every file directly in `dir`, by name.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            files.insert(e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap());
        }
    }
    files
}

/// A copy of the earlier run in `dir/run`, and its snapshot.
fn earlier_run_in(dir: &Path) -> (PathBuf, BTreeMap<String, Vec<u8>>) {
    let out = dir.join("run");
    std::fs::create_dir_all(&out).unwrap();
    for (name, bytes) in snapshot(earlier_run_fixture()) {
        std::fs::write(out.join(name), bytes).unwrap();
    }
    let snap = snapshot(&out);
    for f in ["metrics.jsonl", "summary.json", "model.safetensors", "config.toml", "loss.svg", "trace.json"] {
        assert!(snap.contains_key(f), "the earlier run lacks {f}");
    }
    (out, snap)
}

/// `train ARGS --force` aimed at a copy of an earlier run is refused with a
/// message holding every needle, and the earlier run's files are untouched.
fn refused_without_touching_an_earlier_run(args: &[&str], needles: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (out, before) = earlier_run_in(dir.path());
    let mut all = vec!["train", "--steps", "3", "--force", "--out", out.to_str().unwrap()];
    all.extend(TINY);
    all.extend(args);
    let (ok, _, err) = run(&all);
    assert!(!ok, "expected a refusal, got success: {err}");
    for n in needles {
        assert!(err.contains(n), "message should mention {n:?}: {err}");
    }
    assert!(before == snapshot(&out), "an earlier run's outputs changed: {err}");
    err
}

fn data_args(train: &Path) -> Vec<String> {
    vec!["--set".into(), "data.builtin=".into(), "--set".into(), format!("data.train={}", train.display())]
}

fn refused_data(train: &Path, extra: &[&str], needles: &[&str]) -> String {
    let mut args = data_args(train);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    refused_without_touching_an_earlier_run(&args, needles)
}

#[test]
fn bad_config_never_touches_an_earlier_run() {
    let dir = tempfile::tempdir().unwrap();
    let err = refused_without_touching_an_earlier_run(
        &["--config", "/nonexistent/x.toml"],
        &["/nonexistent/x.toml"],
    );
    assert_eq!(err.matches("No such file or directory").count(), 1, "the OS error is printed once: {err}");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[model]\nn_layer = = 3\n").unwrap();
    refused_without_touching_an_earlier_run(&["--config", bad.to_str().unwrap()], &["bad.toml", "line 2"]);
    let typo = dir.path().join("typo.toml");
    std::fs::write(&typo, "[model]\nn_heads = 4\n").unwrap();
    refused_without_touching_an_earlier_run(&["--config", typo.to_str().unwrap()], &["typo.toml", "n_heads"]);
    refused_without_touching_an_earlier_run(&["--set", "optim.learning_rate=1"], &["learning_rate"]);
    refused_without_touching_an_earlier_run(
        &["--set", "model.n_head=3"],
        &["model.n_embd: 16", "model.n_head (3)"],
    );
}

#[test]
fn an_unknown_choice_is_refused_naming_its_field_and_the_accepted_names() {
    refused_without_touching_an_earlier_run(
        &["--set", "backend.kind=tpu"],
        &["--set backend.kind=tpu: backend.kind: unknown variant `tpu`, expected one of `cpu`, `sim`, `cuda`"],
    );
    refused_without_touching_an_earlier_run(
        &["--set", "optim.loss_scale=static"],
        &["optim.loss_scale: unknown variant `static`, expected `none` or `dynamic`"],
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sched.toml");
    std::fs::write(&file, "[parallel]\nschedule = \"zbh1\"\n").unwrap();
    refused_without_touching_an_earlier_run(
        &["--config", file.to_str().unwrap()],
        &["sched.toml: parallel.schedule: unknown variant `zbh1`, expected one of `gpipe`, `1f1b`, `interleaved`, `zb-h1`, `zb-v`, `dualpipev`"],
    );
}

#[test]
fn bad_token_files_never_touch_an_earlier_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    refused_data(&d.join("nope.bin"), &[], &["nope.bin", "no such file"]);
    let short = d.join("short.bin");
    write_llmc(&short, &[1, 2, 3], 20240520, 1, 3);
    refused_data(&short, &[], &["short.bin", "too short"]);
    let trunc = d.join("trunc.bin");
    write_llmc(&trunc, &[1; 100], 20240520, 1, 200);
    refused_data(&trunc, &[], &["trunc.bin", "truncated"]);
    let v7 = d.join("v7.bin");
    write_llmc(&v7, &[1; 100], 20240520, 7, 100);
    refused_data(&v7, &[], &["v7.bin", "version 7"]);
    let oov = d.join("oov.bin");
    let mut toks = vec![5u16; 100];
    toks[42] = 300;
    write_llmc(&oov, &toks, 20240520, 1, 100);
    refused_data(&oov, &[], &["oov.bin", "token 300", "byte offset 1108"]);
    // An llm.c header under another magic is not raw tokens (data.format = "auto").
    let other = d.join("other-magic.bin");
    write_llmc(&other, &[1; 100], 20240801, 1, 100);
    refused_data(&other, &[], &["other-magic.bin", "llm.c header with magic 20240801 (expected 20240520)"]);
    // data.format = "llmc" refuses a file without the magic, naming both.
    let raw = d.join("raw.bin");
    let bytes: Vec<u8> = (0..2000u16).flat_map(|t| (t % 200).to_le_bytes()).collect();
    std::fs::write(&raw, &bytes).unwrap();
    refused_data(&raw, &["--set", "data.format=llmc"], &["raw.bin", "magic 65536", "20240520"]);
}

#[test]
fn data_format_raw_reads_a_headerless_file() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("raw.bin");
    let bytes: Vec<u8> = (0..4000u16).flat_map(|t| (t % 200).to_le_bytes()).collect();
    std::fs::write(&raw, &bytes).unwrap();
    for format in ["auto", "raw"] {
        let mut args = data_args(&raw);
        args.extend(["--set".to_string(), format!("data.format={format}")]);
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (ok, _, err) = tiny_train(&dir.path().join(format), &args);
        assert!(ok, "{format}: {err}");
    }
}

/// The earlier run's weights, rewritten through `edit` into `dir/name`.
fn edited_weights(
    dir: &Path,
    name: &str,
    edit: impl Fn(Vec<(String, Vec<usize>, Vec<u8>)>) -> Vec<(String, Vec<usize>, Vec<u8>)>,
) -> PathBuf {
    let bytes = std::fs::read(earlier_run_fixture().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec())).collect();
    let edited = edit(tensors);
    let views = edited.iter().map(|(n, s, d)| {
        (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap())
    });
    let path = dir.join(name);
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

#[test]
fn bad_init_weights_never_touch_an_earlier_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let init = |p: &Path| vec!["--init".to_string(), p.display().to_string()];
    let refuse = |p: &Path, needles: &[&str]| {
        let args = init(p);
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        refused_without_touching_an_earlier_run(&args, needles)
    };
    let err = refuse(&d.join("none.safetensors"), &["none.safetensors"]);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    let missing = edited_weights(d, "missing.safetensors", |t| {
        t.into_iter().filter(|(n, ..)| n != "h.0.mlp.c_fc.bias").collect()
    });
    refuse(&missing, &["missing.safetensors", "h.0.mlp.c_fc.bias", "missing"]);
    let reshaped = edited_weights(d, "shape.safetensors", |t| {
        t.into_iter()
            .map(|(n, s, b)| if n == "ln_f.weight" { (n, vec![4, 4], b) } else { (n, s, b) })
            .collect()
    });
    refuse(&reshaped, &["shape.safetensors", "ln_f.weight", "[4, 4]"]);
    // A second layer's tensors: weights of a larger model are not silently cut.
    let extra = edited_weights(d, "two-layers.safetensors", |t| {
        let mut out = t.clone();
        out.extend(
            t.into_iter()
                .filter(|(n, ..)| n.starts_with("h.0."))
                .map(|(n, s, b)| (n.replacen("h.0.", "h.1.", 1), s, b)),
        );
        out
    });
    refuse(&extra, &["two-layers.safetensors", "`h.1.", "not part of this model"]);
    // Hugging Face's extras and prefix are harmless and accepted.
    let hf = edited_weights(d, "hf.safetensors", |t| {
        let mut out: Vec<_> = t.into_iter().map(|(n, s, b)| (format!("transformer.{n}"), s, b)).collect();
        let wte = out.iter().find(|(n, ..)| n == "transformer.wte.weight").unwrap().clone();
        out.push(("lm_head.weight".into(), wte.1, wte.2));
        out.push(("transformer.h.0.attn.bias".into(), vec![1], vec![0; 4]));
        out.push(("transformer.h.0.attn.masked_bias".into(), vec![1], vec![0; 4]));
        out
    });
    let (ok, _, err) = tiny_train(&d.join("from-hf"), &["--init", hf.to_str().unwrap()]);
    assert!(ok, "{err}");
}

#[test]
fn force_after_a_failure_midway_leaves_no_earlier_outputs_beside_partial_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (out, earlier) = earlier_run_in(dir.path());
    let mut args = vec!["train", "--steps", "3", "--force", "--out", out.to_str().unwrap()];
    args.extend(TINY);
    let status = bin()
        .args(&args)
        .env("PIPEWRIGHT_FAULT", "stage=0,step=1,mb=0")
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the injected fault should fail the run");
    let left = snapshot(&out);
    for f in ["summary.json", "model.safetensors", "loss.svg", "trace.json"] {
        assert!(!left.contains_key(f), "{f} of the earlier run survived --force: {:?}", left.keys());
    }
    // config.toml is the failed run's own, written when it started (the earlier run's traced).
    assert_ne!(left.get("config.toml"), earlier.get("config.toml"), "the earlier run's config.toml survived");
    assert!(left.contains_key("config.toml"), "a run that started leaves its config.toml");
    let metrics = String::from_utf8(left.get("metrics.jsonl").cloned().unwrap_or_default()).unwrap();
    assert!(metrics.lines().count() < 3, "metrics of the earlier run are mixed in: {metrics}");
}

#[test]
fn eval_takes_the_model_shape_from_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("val.bin");
    let toks: Vec<u16> = (0..2000u16).map(|i| (i * 7) % 256).collect();
    write_llmc(&data, &toks, 20240520, 1, 2000);
    let weights = earlier_run_fixture().join("model.safetensors");
    let (w, d) = (weights.to_str().unwrap(), data.to_str().unwrap());
    // No --config: the 1-layer, 16-wide shape comes from the weights' stored config.
    let (ok, stdout, err) = run(&["eval", "--weights", w, "--data", d, "--windows", "8", "--json"]);
    assert!(ok, "{err}");
    let loss = serde_json::from_str::<serde_json::Value>(stdout.trim()).unwrap()["loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss > 0.0);
    // --batches counts what train.eval_batches counts: batches of the
    // stored config's train.micro_batch_size (2) windows.
    let (ok, batches, err) = run(&["eval", "--weights", w, "--data", d, "--batches", "4", "--json"]);
    assert!(ok, "{err}");
    assert_eq!(batches, stdout, "4 batches of 2 windows are the first 8 windows");
    // A config whose pipeline does not fit the model is fine: eval runs no pipeline.
    let mut args = vec![
        "eval",
        "--config",
        "configs/default.toml",
        "--weights",
        w,
        "--data",
        d,
        "--windows",
        "8",
        "--json",
    ];
    args.extend(TINY_SHAPE);
    let (ok, stdout2, err) = run(&args);
    assert!(ok, "{err}");
    assert_eq!(stdout, stdout2, "the same weights and shape give the same loss");
    // A shape the weights do not have is still refused, naming a tensor as the file does.
    let (ok, _, err) = run(&["eval", "--weights", w, "--data", d, "--set", "model.n_embd=32"]);
    assert!(!ok && err.contains("`h.0.attn.c_attn.bias` has shape [48], expected [96]"), "{err}");
}

#[test]
fn config_toml_is_the_config_that_ran() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    // Interleaved with the default chunks = 1: the run uses 2 chunks per rank.
    let interleaved = [
        "--set",
        "model.n_layer=4",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.schedule=\"interleaved\"",
        "--set",
        "parallel.microbatches=2",
        "--trace",
    ];
    let (ok, _, err) = tiny_train(&out, &interleaved);
    assert!(ok, "{err}");
    let cfg = pipewright::config::Config::load(Some(&out.join("config.toml")), &[]).unwrap();
    assert_eq!(cfg.parallel.chunks, 2, "config.toml must record the chunks that ran");
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let layout = pipewright::actors::Layout::from_config(&cfg).unwrap();
    assert_eq!(trace["metadata"]["chunks"], layout.chunks);
    assert_eq!(trace["metadata"]["stages"], layout.n_stages());
    // Run again from config.toml alone: the same weights.
    let again = dir.path().join("again");
    let (ok, _, err) = run(&[
        "train",
        "--config",
        out.join("config.toml").to_str().unwrap(),
        "--out",
        again.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let digest = |d: &Path| {
        let s: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("summary.json")).unwrap()).unwrap();
        s["weights_digest"].clone()
    };
    assert_eq!(digest(&out), digest(&again));
}

/// A first user's run (issue 27): weights to start from, a token file named
/// for training and validation, a peak lr below the default's floor, and no
/// `--set data.builtin=` or `--set optim.min_lr` to know about: the file is
/// trained on and the floor follows the peak.
#[test]
fn a_named_token_file_and_a_lower_lr_train_from_init_on_the_default_without_further_sets() {
    let dir = tempfile::tempdir().unwrap();
    let init = dir.path().join("init");
    let (ok, _, err) = tiny_train(&init, &[]);
    assert!(ok, "{err}");
    let tokens = dir.path().join("tok.bin");
    write_llmc(&tokens, &[7; 3000], 20240520, 1, 3000);
    let t = tokens.to_str().unwrap();
    let out = dir.path().join("run");
    let (train, val) = (format!("data.train={t}"), format!("data.val={t}"));
    let mut args =
        vec!["train", "--steps", "2", "--out", out.to_str().unwrap(), "--init", init.to_str().unwrap()];
    args.extend(TINY);
    args.extend(["--set", &train, "--set", &val, "--set", "optim.lr=1e-4"]);
    let (ok, _, err) = run(&args);
    assert!(ok, "{err}");
    let ran = pipewright::config::Config::load(Some(&out.join("config.toml")), &[]).unwrap();
    assert_eq!(ran.data.builtin, pipewright::config::Builtin::Files);
    assert_eq!((ran.data.train.as_str(), ran.data.val.as_str()), (t, t));
    assert!((ran.optim.min_lr - 1e-5).abs() < 1e-18, "min_lr {}", ran.optim.min_lr);
}

#[test]
fn eval_batches_capped_by_a_short_val_file_are_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let train = dir.path().join("train.bin");
    write_llmc(&train, &[7; 3000], 20240520, 1, 3000);
    // One microbatch of two 17-token windows, and a little more.
    let val = dir.path().join("val.bin");
    write_llmc(&val, &[9; 40], 20240520, 1, 40);
    let out = dir.path().join("run");
    let mut args = data_args(&train);
    args.extend([
        "--set".into(),
        format!("data.val={}", val.display()),
        "--set".into(),
        "train.eval_batches=8".into(),
    ]);
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let mut all = vec!["train", "--steps", "2", "--out", out.to_str().unwrap()];
    all.extend(TINY);
    all.extend(&args);
    let (ok, _, err) = run(&all);
    assert!(ok, "{err}");
    assert!(err.contains("train.eval_batches: 8 → 1"), "{err}");
    let cfg = pipewright::config::Config::load(Some(&out.join("config.toml")), &[]).unwrap();
    assert_eq!(cfg.train.eval_batches, 1);
}

#[test]
fn inspect_help_says_what_it_reads() {
    let (ok, help, _) = run(&["inspect", "--help"]);
    assert!(ok && help.contains("run or checkpoint directory"), "{help}");
}

/// The earlier run's weights as Hugging Face's `save_pretrained` writes a
/// GPT2LMHeadModel: `transformer.` names, the tied `lm_head.weight`, no
/// pipewright metadata, and the run's `config.json` beside them.
fn hf_folder_of_the_earlier_run(dir: &Path) -> PathBuf {
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    let edited = edited_weights(&hf, "model.safetensors", |t| {
        let mut out: Vec<_> = t.into_iter().map(|(n, s, b)| (format!("transformer.{n}"), s, b)).collect();
        let wte = out.iter().find(|(n, ..)| n == "transformer.wte.weight").unwrap().clone();
        out.push(("lm_head.weight".into(), wte.1, wte.2));
        out
    });
    assert_eq!(edited, hf.join("model.safetensors"));
    std::fs::copy(earlier_run_fixture().join("config.json"), hf.join("config.json")).unwrap();
    hf
}

#[test]
fn a_hugging_face_folder_needs_no_shape_flags_in_eval_train_and_inspect() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = earlier_run_fixture();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("config.json")).unwrap()).unwrap();
    assert_eq!((cfg["model_type"].as_str(), cfg["n_embd"].as_u64()), (Some("gpt2"), Some(16)));
    assert_eq!(
        (cfg["n_positions"].as_u64(), cfg["activation_function"].as_str()),
        (Some(16), Some("gelu_new"))
    );
    let hf = hf_folder_of_the_earlier_run(dir.path());
    let data = dir.path().join("val.bin");
    let toks: Vec<u16> = (0..2000u16).map(|i| (i * 7) % 256).collect();
    write_llmc(&data, &toks, 20240520, 1, 2000);
    let eval = |w: &Path| {
        let (ok, out, err) =
            run(&["eval", "--weights", w.to_str().unwrap(), "--data", data.to_str().unwrap(), "--json"]);
        assert!(ok, "{err}");
        out
    };
    // Without a count each reads its own config's train.eval_batches; a count
    // of windows compares the models alone.
    let windows = |w: &Path| {
        let (ok, out, err) = run(&[
            "eval",
            "--weights",
            w.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--windows",
            "16",
            "--json",
        ]);
        assert!(ok, "{err}");
        out
    };
    assert_eq!(windows(&hf), windows(run_dir), "the HF folder is the same model");
    let (hf_default, run_default) = (eval(&hf), eval(run_dir));
    assert!(hf_default.contains("\"windows\":124") && run_default.contains("\"windows\":4"), "{hf_default}");

    let (ok, text, _) = run(&["inspect", hf.to_str().unwrap()]);
    assert!(ok && text.contains("config.json: GPT-2, n_layer = 1, n_head = 2, n_embd = 16"), "{text}");

    // train --init DIR: the shape from config.json; only what is not the shape is set.
    let out = dir.path().join("from-hf");
    let o = out.to_str().unwrap();
    let args = ["train", "--steps", "1", "--out", o, "--init", hf.to_str().unwrap()];
    let mut all = args.to_vec();
    all.extend([
        "--set",
        "parallel.pp=1",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "train.eval_batches=2",
    ]);
    let (ok, _, err) = run(&all);
    assert!(ok && err.contains("model from") && err.contains("config.json"), "{err}");

    let eval_setting = |set: &str| {
        let (ok, _, err) =
            run(&["eval", "--weights", hf.to_str().unwrap(), "--data", data.to_str().unwrap(), "--set", set]);
        (ok, err)
    };
    // A smaller block_size crops the position table, and says so.
    let (ok, err) = eval_setting("model.block_size=8");
    assert!(ok && err.contains("`transformer.wpe.weight` holds 16 positions; using the first 8"), "{err}");
    // Errors name tensors as the file does.
    let (ok, err) = eval_setting("model.n_embd=32");
    assert!(!ok && err.contains("`transformer.h.0.attn.c_attn.bias` has shape [48], expected [96]"), "{err}");
}

#[test]
fn resume_takes_the_runs_config_toml_and_lists_changes_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = out.to_str().unwrap();
    let (ok, _, err) = tiny_train(&out, &["--set", "checkpoint.every=2"]);
    assert!(ok, "{err}");
    // No shape flags: without the run's config.toml the default model would not fit.
    let (ok, _, err) = run(&["train", "--steps", "4", "--resume", o]);
    assert!(ok, "{err}");
    assert!(err.contains("config.toml (the run's own"), "{err}");
    let (ok, _, err) = run(&["train", "--steps", "5", "--resume", o, "--set", "model.n_layer=2"]);
    assert!(!ok && err.contains("model.n_layer: 1 → 2"), "{err}");
    assert!(!err.contains("ModelSection"), "{err}");
}

#[test]
fn generate_continues_a_prompt_greedily_and_reproducibly() {
    let w = earlier_run_fixture().to_str().unwrap().to_string();
    let gen = |extra: &[&str]| {
        let mut args = vec!["generate", "--weights", &w, "--prompt", "12+34=", "--max-new-tokens", "6"];
        args.extend(extra);
        let (ok, out, err) = run(&args);
        assert!(ok, "{err}");
        out
    };
    let greedy = gen(&["--temperature", "0"]);
    assert!(greedy.starts_with("12+34="), "{greedy}");
    assert!(greedy.ends_with('\n') && greedy.len() > "12+34=\n".len(), "{greedy:?}");
    assert_eq!(greedy, gen(&["--temperature", "0", "--seed", "99"]), "greedy ignores the seed");
    assert_eq!(gen(&["--seed", "5"]), gen(&["--seed", "5"]));
    assert_eq!(gen(&["--top-k", "1", "--temperature", "3"]), greedy);
    refused(run(&["generate", "--weights", &w, "--temperature=-1"]), &["--temperature"]);
    refused(run(&["generate", "--weights", &w, "--top-k", "0"]), &["--top-k"]);
    // A cuda config: this build (no cuda feature) says so before printing anything.
    let (ok, out, err) =
        run(&["generate", "--weights", &w, "--temperature", "0", "--set", "backend.kind=\"cuda\""]);
    assert!(!ok && err.contains("backend.kind") && out.is_empty(), "{out}{err}");
    #[cfg(not(feature = "cuda"))]
    assert!(err.contains("--features cuda"), "{err}");
}

#[test]
fn a_launch_whose_ranks_cannot_split_over_the_processes_is_refused_before_any_starts() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, _, err) =
        run(&["launch", "--nodes", "3", "--out", out.to_str().unwrap(), "--set", "parallel.pp=2"]);
    assert!(
        !ok && err.contains("parallel.pp × parallel.dp × parallel.tp") && err.contains("--nodes 3"),
        "{err}"
    );
    assert!(!out.exists(), "nothing is written before the refusal");
}

fn layers_per_stage(run: &Path) -> Vec<usize> {
    pipewright::config::Config::load(Some(&run.join("config.toml")), &[]).unwrap().parallel.layers_per_stage
}

#[test]
fn config_toml_records_the_layer_split_and_a_resume_at_another_pp_refits_only_a_stored_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = out.to_str().unwrap();
    let three = ["--set", "model.n_layer=3", "--set", "parallel.pp=2", "--set", "checkpoint.every=2"];
    let (ok, _, err) = tiny_train(&out, &three);
    assert!(ok, "{err}");
    assert_eq!(layers_per_stage(&out), [2, 1], "the split that ran, not []");
    // The stored split has two entries; three stages need three: the even split, said by field.
    let (ok, _, err) = run(&["train", "--steps", "4", "--resume", o, "--set", "parallel.pp=3"]);
    assert!(ok, "{err}");
    assert!(
        err.contains(
            "parallel.layers_per_stage: the run's config.toml recorded [2, 1] (3 layers over 2 stages)"
        ),
        "{err}"
    );
    assert_eq!(layers_per_stage(&out), [1, 1, 1]);
    // A split given on the command line is the user's: a misfit is refused.
    let given = ["train", "--steps", "5", "--resume", o, "--set", "parallel.pp=1"];
    let (ok, _, err) = run(&[&given[..], &["--set", "parallel.layers_per_stage=[2, 1]"]].concat());
    assert!(!ok && err.contains("parallel.layers_per_stage: [2, 1]: expected 1 entries"), "{err}");
}

#[test]
fn an_uneven_layer_split_is_said_with_the_field_to_choose_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, _, err) = tiny_train(&out, &["--set", "model.n_layer=3", "--set", "parallel.pp=2"]);
    assert!(ok, "{err}");
    assert!(
        err.contains("model.n_layer = 3 over 2 stages splits as parallel.layers_per_stage = [2, 1]"),
        "{err}"
    );
}

#[test]
fn generate_into_a_pipe_that_closes_ends_quietly() {
    let w = earlier_run_fixture().to_str().unwrap().to_string();
    let mut child = bin()
        .args(["generate", "--weights", &w, "--prompt", "12+34=", "--max-new-tokens", "200"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // `generate | head -c 0`: the reader is gone before the first byte.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {err}", out.status);
    assert!(!err.contains("Broken pipe") && !err.contains("error") && !err.contains("panicked"), "{err}");
}

#[test]
fn reports_into_a_pipe_that_closes_end_quietly() {
    let w = earlier_run_fixture().to_str().unwrap().to_string();
    let commands: [&[&str]; 2] = [
        &["inspect", &w],
        &["schedule", "--kind", "zb-v", "--stages", "8", "--microbatches", "64", "--json"],
    ];
    for args in commands {
        let mut child = bin()
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // `… | head -c 0`: the reader is gone before the first byte.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: exit {:?}: {err}", out.status);
        assert!(!err.contains("Broken pipe") && !err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn schedule_trace_files_end_with_a_newline() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let p = path.to_str().unwrap();
    let (ok, _, err) =
        run(&["schedule", "--kind", "1f1b", "--stages", "2", "--microbatches", "2", "--trace", p]);
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.ends_with("}\n"), "{:?}", &text[text.len().saturating_sub(20)..]);
    serde_json::from_str::<serde_json::Value>(&text).unwrap();
}

/// `train --resume` on `dir`: (success, stderr).
fn resume(dir: &Path, extra: &[&str]) -> (bool, String) {
    let mut args = vec!["train", "--resume", dir.to_str().unwrap()];
    args.extend(extra);
    let (ok, _, err) = run(&args);
    (ok, err)
}

#[test]
fn resuming_a_finished_run_says_so_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for (name, extra) in [("saved", &["--set", "checkpoint.every=1"][..]), ("unsaved", &[][..])] {
        let out = dir.path().join(name);
        let (ok, _, err) = tiny_train(&out, extra);
        assert!(ok, "{err}");
        let before = snapshot(&out);
        let summary: serde_json::Value = serde_json::from_slice(&before["summary.json"]).unwrap();
        assert!(summary["exact_match"].is_number() && summary["tokens_per_s"].as_f64() > Some(0.0));
        let (ok, err) = resume(&out, &[]);
        assert!(ok, "{name}: {err}");
        assert!(err.contains("this run is finished (step 3 of train.steps = 3); nothing was run"), "{err}");
        assert!(!err.contains("starting from step 0"), "{name}: {err}");
        assert!(snapshot(&out) == before, "{name}: resuming a finished run changed its files");
        if name == "unsaved" {
            assert!(err.contains("which needs a checkpoint: this run saved none"), "{err}");
            // More steps would retrain from step 0 over the finished run's outputs.
            let (ok, err) = resume(&out, &["--steps", "5"]);
            assert!(
                !ok && err.contains("no checkpoint to continue from") && err.contains("--force"),
                "{err}"
            );
            assert!(snapshot(&out) == before, "a refused resume changed the run's files");
        }
    }
    // A finished run with checkpoints continues to a larger --steps, as documented.
    let out = dir.path().join("saved");
    let (ok, err) = resume(&out, &["--steps", "5"]);
    assert!(ok, "{err}");
    let summary: serde_json::Value = serde_json::from_slice(&snapshot(&out)["summary.json"]).unwrap();
    assert_eq!((summary["steps"].as_u64(), summary["resumed_from"].as_u64()), (Some(5), Some(3)));
    assert!(summary["exact_match"].is_number(), "{summary}");
}

#[test]
fn eval_with_no_count_gives_a_runs_own_val_loss_as_train_eval_batches_counts() {
    let dir = tempfile::tempdir().unwrap();
    let (train_bin, val_bin) = (dir.path().join("train.bin"), dir.path().join("val.bin"));
    let toks: Vec<u16> = (0..3000u32).map(|i| ((i * 7 + i / 13) % 256) as u16).collect();
    write_llmc(&train_bin, &toks, 20240520, 1, toks.len() as i32);
    write_llmc(&val_bin, &toks[..1000], 20240520, 1, 1000);
    let out = dir.path().join("run");
    let files = [format!("data.train={}", train_bin.display()), format!("data.val={}", val_bin.display())];
    let extra =
        ["--set", "data.builtin=", "--set", &files[0], "--set", &files[1], "--set", "train.eval_batches=5"];
    let (ok, _, err) = tiny_train(&out, &extra);
    assert!(ok, "{err}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let (w, d) = (out.to_str().unwrap(), val_bin.to_str().unwrap());
    let (ok, stdout, err) = run(&["eval", "--weights", w, "--data", d, "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    // 5 batches of train.micro_batch_size = 2 windows, the run's own evaluation.
    assert_eq!(v["windows"], 10);
    assert_eq!(v["loss"], summary["val_loss"], "eval of a run on its val file is its val loss");
    let (ok, batches, err) = run(&["eval", "--weights", w, "--data", d, "--batches", "5", "--json"]);
    assert!(ok && batches == stdout, "{err}");
}

#[test]
fn an_earlier_sharded_run_is_seen_and_only_force_replaces_it() {
    // Above 5 GB a run's weights are shards and an index: a folder holding
    // only those is an earlier run's, as one holding model.safetensors is.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    std::fs::create_dir_all(&out).unwrap();
    let shard = out.join("model-00001-of-00002.safetensors");
    std::fs::write(&shard, b"an earlier run's shard").unwrap();
    let mine = out.join("notes.txt");
    std::fs::write(&mine, b"the user's own file").unwrap();
    refused(tiny_train(&out, &[]), &["model-00001-of-00002.safetensors", "an earlier run's output is there"]);
    assert_eq!(std::fs::read(&shard).unwrap(), b"an earlier run's shard");
    let (ok, _, err) = tiny_train(&out, &["--force"]);
    assert!(ok, "{err}");
    assert!(!shard.exists(), "--force left the earlier run's shard beside the new weights");
    assert_eq!(std::fs::read(&mine).unwrap(), b"the user's own file");
}
