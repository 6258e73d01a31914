//! The CUDA kernels on a real GPU: each against its CPU twin (f32 < 1e-5,
//! bf16 < 1e-2 relative error), whole training steps against the CPU model's
//! (loss within 1e-2) and bit-identical repeats. Without a GPU the
//! tests say so and pass, unless PIPEWRIGHT_REQUIRE_GPU=1 (scripts/gpu-check.sh).
#![cfg(feature = "cuda")]

use pipewright::kernels::cuda::{check, driver_present, CudaError, Gpu};

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
