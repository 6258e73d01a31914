//! The command line as a user meets it: bad input of every kind is refused
//! with a message naming the file or field, a non-zero exit and no panic, and
//! nothing an earlier run wrote is touched. Plus the outputs of a good run.

use std::path::Path;
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
    "--set",
    "model.n_layer=1",
    "--set",
    "model.n_embd=16",
    "--set",
    "model.n_head=2",
    "--set",
    "model.block_size=16",
    "--set",
    "train.micro_batch_size=2",
    "--set",
    "train.eval_batches=2",
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

fn files_train(dir: &Path, train: &Path) -> Vec<String> {
    let _ = dir;
    vec!["--set".into(), "data.builtin=".into(), "--set".into(), format!("data.train={}", train.display())]
}

fn train_on_file(dir: &Path, file: &Path) -> (bool, String, String) {
    let extra = files_train(dir, file);
    let extra: Vec<&str> = extra.iter().map(|s| s.as_str()).collect();
    tiny_train(&dir.join("out"), &extra)
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
    for key in ["steps", "final_loss", "val_loss", "tokens_per_s", "mfu", "weights_digest"] {
        assert!(summary.get(key).is_some(), "summary lacks {key}");
    }
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
fn missing_config_file_is_named() {
    refused(run(&["train", "--config", "/nonexistent/x.toml"]), &["/nonexistent/x.toml"]);
}

#[test]
fn malformed_config_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.toml");
    std::fs::write(&p, "[model]\nn_layer = = 3\n").unwrap();
    refused(run(&["train", "--config", p.to_str().unwrap()]), &["bad.toml", "line 2"]);
}

#[test]
fn unknown_config_key_is_named_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("typo.toml");
    std::fs::write(&p, "[model]\nn_heads = 4\n").unwrap();
    refused(run(&["train", "--config", p.to_str().unwrap()]), &["typo.toml", "n_heads"]);
    refused(run(&["train", "--set", "optim.learning_rate=1"]), &["learning_rate"]);
}

#[test]
fn heads_must_divide_the_width() {
    refused(run(&["train", "--set", "model.n_head=3"]), &["model.n_head", "3"]);
}

#[test]
fn missing_data_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    refused(train_on_file(dir.path(), &dir.path().join("nope.bin")), &["nope.bin"]);
}

#[test]
fn data_too_short_for_one_window_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("short.bin");
    write_llmc(&f, &[1, 2, 3], 20240520, 1, 3);
    refused(train_on_file(dir.path(), &f), &["short.bin"]);
}

#[test]
fn bad_header_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("v7.bin");
    write_llmc(&f, &[1; 100], 20240520, 7, 100);
    refused(train_on_file(dir.path(), &f), &["v7.bin", "version"]);
}

#[test]
fn truncated_token_file_is_rejected_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("trunc.bin");
    write_llmc(&f, &[1; 100], 20240520, 1, 200);
    refused(train_on_file(dir.path(), &f), &["trunc.bin"]);
}

#[test]
fn token_beyond_the_vocabulary_is_reported_with_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("oov.bin");
    let mut toks = vec![5u16; 100];
    toks[42] = 300; // the tiny model's vocabulary is 256
    write_llmc(&f, &toks, 20240520, 1, 100);
    refused(train_on_file(dir.path(), &f), &["oov.bin", "300", &(1024 + 42 * 2).to_string()]);
}

fn train_with_init(dir: &Path, init: &Path) -> (bool, String, String) {
    tiny_train(&dir.join("out2"), &["--init", init.to_str().unwrap()])
}

#[test]
fn init_weights_with_a_missing_or_misshaped_tensor_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    assert!(tiny_train(&out, &[]).0);
    let good = out.join("model.safetensors");
    // Starting from a run's own weights works.
    assert!(train_with_init(dir.path(), &good).0);
    // Rewrite the file without one tensor, and with one tensor reshaped.
    let bytes = std::fs::read(&good).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let drop: Vec<_> = tensors.iter().filter(|(n, _)| n != "h.0.mlp.c_fc.bias").cloned().collect();
    let missing = dir.path().join("missing.safetensors");
    safetensors::serialize_to_file(drop, None, &missing).unwrap();
    refused(train_with_init(dir.path(), &missing), &["missing.safetensors", "h.0.mlp.c_fc.bias"]);
    let reshaped: Vec<_> = tensors
        .iter()
        .map(|(n, v)| {
            if n == "ln_f.weight" {
                (n.clone(), safetensors::tensor::TensorView::new(v.dtype(), vec![4, 4], v.data()).unwrap())
            } else {
                (n.clone(), v.clone())
            }
        })
        .collect();
    let bad = dir.path().join("shape.safetensors");
    safetensors::serialize_to_file(reshaped, None, &bad).unwrap();
    refused(train_with_init(dir.path(), &bad), &["shape.safetensors", "ln_f.weight", "[4, 4]"]);
    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").unwrap();
    refused(train_with_init(dir.path(), &garbage), &["garbage.safetensors"]);
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
