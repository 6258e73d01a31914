//! Every family pipewright knows (`model::family::ALL`) through the whole
//! trainer from its tiny config (`configs/<family>-tiny.toml`): one weights
//! digest whatever the layout (dp × pp × tp with ZeRO-1, the split backward,
//! recompute, two processes, a resume at another layout), and a run folder
//! that its Hugging Face files alone evaluate the same and whose config.json
//! names the family's class. A new family brings its tiny config and is
//! tested here with nothing else to write. (tests/llama.rs runs one family
//! over the full matrix of layouts; scripts/hf_families.py holds each to
//! transformers.)

mod common;

use common::run_to_end;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_pipewright");

fn tiny_config(family: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join(format!("{family}-tiny.toml"));
    assert!(p.is_file(), "family {family} has no tiny config at {}", p.display());
    p
}

/// The family's tiny model, cut short for a test: 16 positions, 3 steps at
/// a constant rate, checkpoints every step.
fn args(config: &Path, extra: &[String]) -> Vec<String> {
    let mut sets: Vec<String> = [
        "model.block_size=16",
        "train.micro_batch_size=2",
        "train.eval_every=0",
        "train.eval_batches=2",
        "optim.warmup_steps=1",
        "optim.schedule=\"constant\"",
        "checkpoint.every=1",
        "parallel.tp_slices=2",
    ]
    .map(String::from)
    .to_vec();
    sets.extend_from_slice(extra);
    let mut a = vec!["--config".to_string(), config.display().to_string()];
    a.extend(sets.into_iter().flat_map(|s| ["--set".to_string(), s]));
    a
}

fn layout(dp: usize, pp: usize, tp: usize, zero: u8, extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        format!("parallel.dp={dp}"),
        format!("parallel.pp={pp}"),
        format!("parallel.tp={tp}"),
        format!("parallel.zero={zero}"),
        format!("parallel.microbatches={}", 8 / dp),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn digest(run: &Path) -> String {
    let text = std::fs::read_to_string(run.join("summary.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["weights_digest"].as_str().unwrap().to_string()
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn train(run: &Path, args: &[String], flag: &str) -> String {
    let mut c = Command::new(BIN);
    c.arg("train").args(args).args(["--steps", "3"]).arg(flag).arg(run);
    let o = run_to_end(c, Duration::from_secs(180));
    assert!(o.status.success(), "{}: {}", run.display(), text(&o));
    digest(run)
}

#[test]
fn every_family_gives_one_digest_across_layouts_processes_and_a_resume_at_another_layout() {
    let dir = tempfile::tempdir().unwrap();
    for spec in pipewright::model::family::ALL {
        let config = tiny_config(spec.name);
        let run = |name: &str| dir.path().join(format!("{}-{name}", spec.name));
        let reference = train(&run("ref"), &args(&config, &layout(1, 1, 1, 0, &[])), "--out");
        let others: [(&str, Vec<String>); 4] = [
            ("dp2-pp2-tp2-zero1", layout(2, 2, 2, 1, &[])),
            ("zb-h1", layout(1, 2, 1, 0, &["parallel.schedule=\"zb-h1\""])),
            (
                "interleaved-tp2-sp",
                layout(
                    1,
                    2,
                    2,
                    0,
                    &["parallel.schedule=\"interleaved\"", "parallel.chunks=2", "parallel.sp=true"],
                ),
            ),
            ("recompute", layout(2, 2, 1, 0, &["train.recompute=true"])),
        ];
        for (name, l) in others {
            assert_eq!(train(&run(name), &args(&config, &l), "--out"), reference, "{}: {name}", spec.name);
        }
        // Two processes, a pipeline stage each, its two tp ranks in one.
        let launched = run("launch2");
        let mut c = Command::new(BIN);
        c.args(["launch", "--nodes", "2"]).args(args(&config, &layout(1, 2, 2, 0, &[])));
        c.args(["--steps", "3", "--out"]).arg(&launched);
        let o = run_to_end(c, Duration::from_secs(180));
        assert!(o.status.success(), "{}: launch --nodes 2: {}", spec.name, text(&o));
        assert_eq!(digest(&launched), reference, "{}: pp 2 × tp 2 over 2 processes", spec.name);
        // Stopped in its last step at one rank, resumed at dp 2 × pp 2 × tp 2 with ZeRO-1.
        let resumed = run("resumed");
        let mut c = Command::new(BIN);
        c.arg("train")
            .args(args(&config, &layout(1, 1, 1, 0, &[])))
            .args(["--steps", "3", "--out"])
            .arg(&resumed);
        c.env("PIPEWRIGHT_FAULT", "stage=0,step=2,mb=1,kind=error");
        assert!(!run_to_end(c, Duration::from_secs(180)).status.success(), "the injected fault stops it");
        assert_eq!(
            train(&resumed, &args(&config, &layout(2, 2, 2, 1, &[])), "--resume"),
            reference,
            "{}: resumed",
            spec.name
        );
    }
}

/// The run folder holds what the family's class `from_pretrained` reads (its
/// config.json names that class); `eval` of a folder holding nothing but
/// config.json and the weights (the run's stored config stripped) gives the
/// run's own evaluation, so the model came from config.json alone.
#[test]
fn every_family_run_folder_evaluates_the_same_from_its_hugging_face_files_alone() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tokens.bin");
    let tokens: Vec<u8> =
        (0..2000u32).map(|i| ((i * 37 + 11) % 256) as u16).flat_map(u16::to_le_bytes).collect();
    std::fs::write(&data, tokens).unwrap();
    let eval = |weights: &Path| {
        let mut c = Command::new(BIN);
        // One batch size and one slice count for both: the run's stored
        // config and the embedded default differ in them, and both shape the sums.
        c.args(["eval", "--windows", "8", "--json", "--set", "train.micro_batch_size=2"]);
        c.args(["--set", "parallel.tp_slices=1", "--weights"]);
        c.arg(weights).arg("--data").arg(&data);
        let o = run_to_end(c, Duration::from_secs(120));
        assert!(o.status.success(), "eval {}: {}", weights.display(), text(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        v["loss"].as_f64().unwrap()
    };
    for spec in pipewright::model::family::ALL {
        let run = dir.path().join(format!("{}-run", spec.name));
        train(
            &run,
            &args(&tiny_config(spec.name), &layout(1, 2, 1, 0, &["parallel.microbatches=2"])),
            "--out",
        );
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
        assert_eq!(json["architectures"][0], spec.hf_class, "{}", spec.name);
        assert!(spec.model_types.contains(&json["model_type"].as_str().unwrap()), "{}", spec.name);
        let hf = dir.path().join(format!("{}-hf", spec.name));
        std::fs::create_dir(&hf).unwrap();
        std::fs::copy(run.join("config.json"), hf.join("config.json")).unwrap();
        let st = std::fs::read(run.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&st[8..8 + n]).unwrap();
        header.remove("__metadata__");
        let mut text_header = serde_json::to_vec(&header).unwrap();
        text_header.resize(text_header.len().next_multiple_of(8), b' ');
        let mut bare = (text_header.len() as u64).to_le_bytes().to_vec();
        bare.extend_from_slice(&text_header);
        bare.extend_from_slice(&st[8 + n..]);
        std::fs::write(hf.join("model.safetensors"), bare).unwrap();
        assert_eq!(eval(&run), eval(&hf), "{}", spec.name);
    }
}
