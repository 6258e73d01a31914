//! Stable CI's share of the fuzzing: every committed seed (`fuzz/corpus/*/seed-*`,
//! inputs a fuzz run once crashed on included) goes through the same body the
//! cargo-fuzz target runs, `pipewright::fuzz::*`.

use std::path::{Path, PathBuf};

type Body = fn(&[u8]) -> bool;
const TARGETS: [(&str, Body); 3] = [
    ("config", pipewright::fuzz::config),
    ("token_file", pipewright::fuzz::token_file),
    ("checkpoint", pipewright::fuzz::checkpoint),
];

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut v: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect();
    v.sort();
    v
}

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

#[test]
fn every_seed_runs_through_its_target_and_valid_ones_are_accepted() {
    for (target, body) in TARGETS {
        let seeds: Vec<PathBuf> = files(&fuzz_dir().join("corpus").join(target))
            .into_iter()
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("seed-"))
            .collect();
        assert!(seeds.iter().any(|p| p.to_string_lossy().contains("seed-valid-")), "{target}: no valid seed");
        for seed in seeds {
            let accepted = body(&std::fs::read(&seed).unwrap());
            let should = seed.file_name().unwrap().to_string_lossy().starts_with("seed-valid-");
            assert_eq!(accepted, should, "{}: accepted {accepted}", seed.display());
        }
    }
}
