//! A Llama-style model (model.family = "llama") through the whole trainer:
//! one weights digest whatever the layout, as GPT-2 has (tests/multiprocess.rs),
//! and its run folder read back through its own Hugging Face config.json.
//! (scripts/hf_check_llama.sh holds it to transformers and PyTorch.)

mod common;

use common::run_to_end;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_pipewright");

/// A small Llama with grouped-query attention (4 query heads over 2
/// key/value heads) and 4 layers, so pp = 4 has one each.
fn llama(extra: &[&str]) -> Vec<String> {
    let mut sets = vec![
        "model.family=\"llama\"",
        "model.n_layer=4",
        "model.n_embd=32",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.intermediate_size=48",
        "model.rope_theta=500000.0",
        "model.block_size=16",
        "train.micro_batch_size=2",
        "train.eval_every=0",
        "train.eval_batches=2",
        "optim.warmup_steps=1",
        "optim.schedule=\"constant\"",
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

fn train(dir: &Path, name: &str, args: &[String], flag: &str) -> String {
    let run = dir.join(name);
    let mut c = Command::new(BIN);
    c.arg("train").args(args).args(["--steps", "3"]).arg(flag).arg(&run);
    let o = run_to_end(c, Duration::from_secs(120));
    assert!(o.status.success(), "{name}: {}", text(&o));
    digest(&run)
}

/// pp 1/2 × tp 1/2 × dp 1/2 × ZeRO 0/1, ZeRO 2 and 3 at tp 1 (tp_slices = 2 on every run: the
/// slices define the sums, the ranks only who computes them), pp 4, GPipe,
/// interleaved, the zero-bubble schedules and DualPipeV beside 1F1B, recompute, two and
/// four processes (tp ranks across them), and a run stopped in its last step
/// resumed at another layout: one digest, untied and tied.
#[test]
fn a_llama_gives_one_digest_across_pp_tp_dp_zero_schedules_processes_and_a_resume_at_another_layout() {
    let dir = tempfile::tempdir().unwrap();
    for tied in ["false", "true"] {
        let tie = format!("model.tie_word_embeddings={tied}");
        let layout = |dp: usize, pp: usize, tp: usize, zero: u8, extra: &[&str]| {
            let m = format!("parallel.microbatches={}", 8 / dp);
            let (dp, pp, tp, zero) = (
                format!("parallel.dp={dp}"),
                format!("parallel.pp={pp}"),
                format!("parallel.tp={tp}"),
                format!("parallel.zero={zero}"),
            );
            let mut sets =
                vec![tie.as_str(), "checkpoint.every=1", "parallel.tp_slices=2", &dp, &pp, &tp, &m, &zero];
            sets.extend_from_slice(extra);
            llama(&sets)
        };
        let at = |name: &str| format!("{tied}-{name}");
        let reference = train(dir.path(), &at("ref"), &layout(1, 1, 1, 0, &[]), "--out");
        for pp in [1, 2] {
            for tp in [1, 2] {
                for (dp, zero) in [(1, 0), (2, 0), (2, 1)] {
                    if (pp, tp, dp) == (1, 1, 1) {
                        continue;
                    }
                    let name = at(&format!("dp{dp}-pp{pp}-tp{tp}-zero{zero}"));
                    let args = layout(dp, pp, tp, zero, &[]);
                    assert_eq!(train(dir.path(), &name, &args, "--out"), reference, "{name}");
                }
            }
        }
        let others: [(usize, usize, &[&str]); 7] = [
            (1, 4, &[]),
            (2, 2, &["parallel.schedule=\"gpipe\""]),
            (2, 2, &["parallel.schedule=\"interleaved\"", "parallel.chunks=2"]),
            (2, 2, &["parallel.schedule=\"zb-h1\""]),
            (1, 2, &["parallel.schedule=\"zb-v\""]),
            (1, 2, &["parallel.schedule=\"dualpipev\""]),
            (1, 2, &["train.recompute=true"]),
        ];
        for (i, (dp, pp, extra)) in others.iter().enumerate() {
            let name = at(&format!("other{i}"));
            let args = layout(*dp, *pp, 2, 0, extra);
            assert_eq!(train(dir.path(), &name, &args, "--out"), reference, "{name}: {extra:?}");
        }
        // ZeRO 2 and 3 (at tp 1: ZeRO-3 refuses tp > 1), with selective
        // recompute and with the weights kept for the step.
        let sharded: [(usize, usize, u8, &[&str]); 3] = [
            (2, 2, 2, &["train.recompute=\"selective\""]),
            (2, 1, 3, &[]),
            (4, 2, 3, &["parallel.reshard_after_forward=false"]),
        ];
        for (dp, pp, zero, extra) in sharded {
            let name = at(&format!("dp{dp}-pp{pp}-zero{zero}"));
            let args = layout(dp, pp, 1, zero, extra);
            assert_eq!(train(dir.path(), &name, &args, "--out"), reference, "{name}: {extra:?}");
        }
        // Two processes, a pipeline stage each; four, each stage's two tp
        // ranks in two processes (the all-reduces cross the data links).
        for nodes in [2, 4] {
            let run = dir.path().join(at(&format!("launch{nodes}")));
            let mut c = Command::new(BIN);
            c.args(["launch", "--nodes", &nodes.to_string()]).args(layout(1, 2, 2, 0, &[]));
            c.args(["--steps", "3", "--out"]).arg(&run);
            let o = run_to_end(c, Duration::from_secs(120));
            assert!(o.status.success(), "launch --nodes {nodes}: {}", text(&o));
            assert_eq!(digest(&run), reference, "pp 2 × tp 2 over {nodes} processes");
        }
        // Stopped in its last step at dp 1 × pp 1 × tp 1, resumed at dp 2 ×
        // pp 2 × tp 2 with ZeRO-1.
        let name = at("resumed");
        let mut c = Command::new(BIN);
        c.arg("train")
            .args(layout(1, 1, 1, 0, &[]))
            .args(["--steps", "3", "--out"])
            .arg(dir.path().join(&name));
        c.env("PIPEWRIGHT_FAULT", "stage=0,step=2,mb=1,kind=error");
        assert!(!run_to_end(c, Duration::from_secs(120)).status.success(), "the injected fault stops it");
        assert_eq!(train(dir.path(), &name, &layout(2, 2, 2, 1, &[]), "--resume"), reference, "{name}");
    }
}

/// The run folder holds what `LlamaForCausalLM.from_pretrained` reads: a
/// Llama config.json and `model.`-prefixed tensors; `eval` of that folder
/// with nothing but those two files gives the run's own evaluation.
#[test]
fn a_llama_run_folder_evaluates_the_same_from_its_hugging_face_files_alone() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut c = Command::new(BIN);
    c.arg("train").args(llama(&["parallel.microbatches=2"])).args(["--steps", "2", "--out"]).arg(&run);
    let o = run_to_end(c, Duration::from_secs(120));
    assert!(o.status.success(), "train: {}", text(&o));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(json["architectures"][0], "LlamaForCausalLM");
    assert_eq!((json["num_key_value_heads"].as_u64(), json["rope_theta"].as_f64()), (Some(2), Some(5e5)));
    // Only Hugging Face's two files: the shape must come from config.json.
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    std::fs::copy(run.join("config.json"), hf.join("config.json")).unwrap();
    let st = std::fs::read(run.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&st[8..8 + n]).unwrap();
    assert!(
        header.contains_key("model.layers.3.self_attn.k_proj.weight")
            && header.contains_key("lm_head.weight")
    );
    header.remove("__metadata__");
    let mut text_header = serde_json::to_vec(&header).unwrap();
    text_header.resize(text_header.len().next_multiple_of(8), b' ');
    let mut bare = (text_header.len() as u64).to_le_bytes().to_vec();
    bare.extend_from_slice(&text_header);
    bare.extend_from_slice(&st[8 + n..]);
    std::fs::write(hf.join("model.safetensors"), bare).unwrap();
    // Tokens as raw little-endian u16s.
    let data = dir.path().join("tokens.bin");
    let tokens: Vec<u8> =
        (0..2000u32).map(|i| ((i * 37 + 11) % 256) as u16).flat_map(u16::to_le_bytes).collect();
    std::fs::write(&data, tokens).unwrap();
    let eval = |weights: &Path| {
        let mut c = Command::new(BIN);
        c.args(["eval", "--windows", "8", "--json", "--weights"]).arg(weights).arg("--data").arg(&data);
        let o = run_to_end(c, Duration::from_secs(120));
        assert!(o.status.success(), "eval {}: {}", weights.display(), text(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        v["loss"].as_f64().unwrap()
    };
    assert_eq!(eval(&run), eval(&hf));
}
