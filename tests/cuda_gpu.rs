//! The CUDA kernels on a real GPU: each against its CPU twin (f32 < 1e-5,
//! bf16 < 1e-2 relative error), whole training steps against the CPU model's
//! (loss within 1e-2) and bit-identical repeats. Without a GPU the
//! tests say so and pass, unless PIPEWRIGHT_REQUIRE_GPU=1 (scripts/gpu-check.sh);
//! GPU pipeline stages at pp = 2 give the weights of pp = 1; and a cuda run on
//! a machine without a driver is refused before it writes anything.
#![cfg(feature = "cuda")]

use pipewright::kernels::cuda::{driver_present, CudaError, Gpu};
use pipewright::model::gpu::check;

fn gpu() -> Option<Gpu> {
    let required = std::env::var("PIPEWRIGHT_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) => {
            assert!(!required, "PIPEWRIGHT_REQUIRE_GPU=1 but no GPU: {e}");
            eprintln!("skipped: no GPU here ({e})");
            None
        }
    }
}

#[test]
fn every_cuda_kernel_matches_its_cpu_twin_and_repeats_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let checks = check::run_all(&gpu).expect("the checks run");
    let table = check::table(&checks);
    eprintln!("{table}");
    assert!(checks.iter().all(check::Check::passed), "{table}");
}

#[test]
fn a_whole_training_step_matches_the_cpu_and_repeats_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let checks = check::step_checks(&gpu).expect("the step checks run");
    let table = check::table(&checks);
    eprintln!("{table}");
    assert!(checks.iter().all(check::Check::passed), "{table}");
}

#[test]
fn without_a_driver_opening_a_gpu_is_an_error_not_a_panic() {
    if driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    assert!(matches!(Gpu::new(0), Err(CudaError::NoDriver)));
}

/// `train` with GPU stages at pp = 1 and pp = 2 on one GPU (1F1B), f32:
/// the same weights bit for bit.
#[test]
fn gpu_pipeline_stages_give_the_weights_of_one_stage() {
    let Some(_gpu) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let digest = |pp: usize| {
        let out = dir.path().join(format!("pp{pp}"));
        let devices = format!("backend.devices=[{}]", vec!["0"; pp].join(","));
        let sets = [
            "model.n_layer=4",
            "model.n_embd=128",
            "model.n_head=2",
            "model.vocab_size=256",
            "model.block_size=64",
            "train.micro_batch_size=2",
            "train.eval_every=0",
            "data.builtin=\"random\"",
            "parallel.microbatches=4",
            "backend.kind=\"cuda\"",
            "backend.dtype=\"f32\"",
            &format!("parallel.pp={pp}"),
            &devices,
        ];
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_pipewright"));
        c.arg("train").arg("--steps").arg("3").arg("--out").arg(&out);
        for s in sets {
            c.arg("--set").arg(s);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "pp={pp}: {}", String::from_utf8_lossy(&o.stderr));
        let s: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
        s["weights_digest"].as_str().unwrap().to_string()
    };
    assert_eq!(digest(1), digest(2));
}

/// Without a GPU, a cuda run stops before writing anything, with the reason.
#[test]
fn without_a_gpu_a_cuda_run_is_refused_with_the_reason() {
    if driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(["train", "--steps", "1", "--set", "backend.kind=\"cuda\"", "--set", "model.n_head=2", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("no CUDA driver"), "{err}");
    assert!(!out.join("metrics.jsonl").exists(), "a refused run wrote outputs");
}

/// gpu-bench's model flags are checked before the GPU opens, so each mistake
/// is named, with a non-zero exit, on any machine.
#[test]
fn gpu_bench_names_a_bad_model_flag_before_opening_a_gpu() {
    let cases: [(&[&str], &str); 4] = [
        (&["--family", "llama"], "--ffn 0 (--family llama: model.intermediate_size): must be > 0"),
        (
            &["--family", "llama", "--ffn", "64", "--heads", "12", "--kv-heads", "5"],
            "--kv-heads 5 (--family llama: model.n_kv_head): must be 0 or divide model.n_head = 12",
        ),
        (&["--kv-heads", "4"], "--kv-heads 4 (--family gpt2: model.n_kv_head)"),
        (&["--family", "mamba"], "expected one of \"gpt2\", \"llama\""),
    ];
    for (args, want) in cases {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .arg("gpu-bench")
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// `generate --temperature 0` on the GPU (f32) writes what the CPU writes for
/// the same weights, and refuses to sample there. (A near-tie between two
/// logits could flip an argmax between the backends' summation orders; a
/// trained model's top tokens are far apart.)
#[test]
fn greedy_generation_on_the_gpu_writes_the_cpus_text() {
    let Some(_gpu) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let pw = || std::process::Command::new(env!("CARGO_BIN_EXE_pipewright"));
    let shape =
        ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "parallel.pp=1", "optim.warmup_steps=10"];
    let mut c = pw();
    c.args(["train", "--steps", "200", "--out"]).arg(&run);
    for s in shape {
        c.arg("--set").arg(s);
    }
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let generate = |extra: &[&str]| {
        let o = pw()
            .args(["generate", "--weights"])
            .arg(&run)
            .args(["--prompt", "347+285=", "--max-new-tokens", "20"])
            .args(extra)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).to_string(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let cuda = ["--set", "backend.kind=\"cuda\"", "--set", "backend.dtype=\"f32\""];
    let (ok, cpu_text, err) = generate(&["--temperature", "0"]);
    assert!(ok, "{err}");
    let (ok, gpu_text, err) = generate(&[&["--temperature", "0"][..], &cuda[..]].concat());
    assert!(ok, "{err}");
    assert_eq!(gpu_text, cpu_text);
    let (ok, _, err) = generate(&[&["--temperature", "0.8"][..], &cuda[..]].concat());
    assert!(!ok && err.contains("--temperature") && err.contains("greedily"), "{err}");
}
