//! The device playbook's budget logic (scripts/gpu-device.sh, phase `first`,
//! and scripts/gpu_summary.py), run here with a stand-in for the binary: no GPU
//! is needed to check that a step the budget cuts is listed as skipped and its
//! comparisons read "not run" rather than "different bits", and that with time
//! enough every step runs. The budgets are 0 and 600 s, so neither case depends
//! on how fast this machine is.

use std::path::Path;
use std::process::Command;

/// A stand-in `pipewright`: gpu-bench prints a report line, gpu-check passes,
/// train writes a summary with one digest (so every comparison is "same bits").
const FAKE: &str = r#"#!/usr/bin/env bash
case "$1" in
gpu-bench) echo '{"device":"stand-in","micro_batch":8,"seq":1024,"tokens_per_s":1000,"mfu":0.3,"matmul_flops":6e14,"ms_per_step":10}' ;;
gpu-check) echo "-- group layernorm f32"; echo "ok   [layernorm] stand-in"; echo "all 1 GPU checks passed" ;;
train) out=""; while [ $# -gt 0 ]; do [ "$1" = --out ] && out="$2"; shift; done
       mkdir -p "$out"; echo '{"weights_digest":"0123abcd"}' >"$out/summary.json" ;;
*) exit 2 ;;
esac
"#;

fn run_first(budget_s: u64) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("pipewright");
    std::fs::write(&bin, FAKE).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = dir.path().join("out");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let run = Command::new("bash")
        .arg(root.join("scripts/gpu-device.sh"))
        .arg("first")
        .arg(&out)
        .env("PIPEWRIGHT_BIN", &bin)
        .env("PIPEWRIGHT_COMMIT", "test")
        .env("PW_GPU_WORK", dir.path().join("work"))
        .env("BUDGET_S", budget_s.to_string())
        .output()
        .expect("bash runs");
    let log = String::from_utf8_lossy(&run.stdout).to_string() + &String::from_utf8_lossy(&run.stderr);
    let text = std::fs::read_to_string(out.join("first-summary.json"))
        .unwrap_or_else(|e| panic!("no first-summary.json ({e}); the phase printed:\n{log}"));
    assert!(out.join("first.tar.gz").is_file(), "{log}");
    assert!(out.join("first-summary.txt").is_file(), "{log}");
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_step_the_budget_cuts_is_skipped_not_failed() {
    let s = run_first(0);
    let skipped: Vec<&str> = s["skipped"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for step in
        ["gpu-bench", "gpu-bench-llama", "gpu-check", "torch-eager", "train-f32-pp1-1f1b", "train-bf16-tp2"]
    {
        assert!(skipped.contains(&step), "{step} not in skipped {skipped:?}");
    }
    assert!(s["gpu_check_passed"].is_null(), "{s}");
    for (name, verdict) in s["gpu_pipeline"].as_object().unwrap() {
        assert!(verdict.is_null(), "{name}: {verdict} (a comparison of runs that never ran is not run)");
    }
    assert_eq!(s["gpu_pipeline_bits_match"], false, "nothing compared is no match");
    assert_eq!(s["passed"], true, "skipped is not failed: {s}");
}

#[test]
fn with_time_enough_every_step_runs_and_the_bits_compare() {
    let s = run_first(600);
    let skipped = s["skipped"].as_array().unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(s["gpu_check_passed"], true, "{s}");
    assert_eq!(s["gpu_pipeline_bits_match"], true, "{s}");
    assert_eq!(s["gpu_pipeline"].as_object().unwrap().len(), 10);
    assert!(s["gpu_pipeline"].as_object().unwrap().values().all(|v| v == true), "{s}");
    assert_eq!(s["pipewright_tokens_per_s"], 1000.0);
    assert_eq!(s["llama_tokens_per_s"], 1000.0);
}
