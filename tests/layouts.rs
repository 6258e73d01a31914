//! One set of bits across the memory-at-scale layouts, for GPT-2 and Llama,
//! with an EMA and a batch ramp on in every run: ZeRO 0–3 × dp 1/2/4 ×
//! pp 1/2 × sequence parallelism off/on (tp 2) × recompute none/selective/
//! full. CI runs an all-pairs table of them (every pair of values of any two
//! of the five factors — the family, dp with ZeRO, pp, SP and recompute —
//! meets in some run; the test checks that the table does); the whole
//! product, 108 runs a family, is `cargo test --release --test layouts --
//! --ignored`. Across processes, the same layouts are `tests/multiprocess.rs`'s.

use pipewright::config::Config;
use pipewright::train::run::{train_with, Summary, TrainOptions};
use std::path::Path;

/// (dp, ZeRO): ZeRO shares state between replicas, so it needs dp ≥ 2.
const DP_ZERO: [(usize, u8); 9] = [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 1), (4, 2), (4, 3)];
const RECOMPUTE: [&str; 3] = ["none", "selective", "full"];
const FAMILIES: [&str; 2] = ["gpt2", "llama"];

/// One run of the table: indices into DP_ZERO and RECOMPUTE, pp − 1, SP
/// (0 off, 1 on), and the family's index.
type Row = [usize; 5];

/// An all-pairs table over the five factors (found by a seeded search; the
/// test checks its coverage).
const PAIRS: [Row; 27] = [
    [0, 0, 1, 1, 1],
    [0, 1, 0, 1, 0],
    [0, 2, 1, 0, 1],
    [1, 0, 1, 1, 1],
    [1, 1, 0, 0, 0],
    [1, 2, 0, 0, 1],
    [2, 0, 0, 0, 0],
    [2, 1, 1, 0, 0],
    [2, 2, 0, 1, 1],
    [3, 0, 1, 1, 1],
    [3, 1, 0, 0, 0],
    [3, 2, 0, 1, 0],
    [4, 0, 1, 1, 1],
    [4, 1, 1, 1, 0],
    [4, 2, 0, 0, 0],
    [5, 0, 1, 1, 0],
    [5, 1, 0, 1, 1],
    [5, 2, 1, 0, 1],
    [6, 0, 1, 0, 0],
    [6, 1, 0, 1, 1],
    [6, 2, 0, 1, 1],
    [7, 0, 1, 1, 1],
    [7, 1, 0, 0, 0],
    [7, 2, 0, 1, 0],
    [8, 0, 1, 0, 1],
    [8, 1, 0, 1, 0],
    [8, 2, 1, 0, 0],
];

const SIZES: Row = [DP_ZERO.len(), RECOMPUTE.len(), 2, 2, FAMILIES.len()];

/// The family's tiny model cut to 2 blocks of width 32 over 16 positions,
/// 3 steps of a global batch of 8 microbatches of 2 sequences, the first
/// step at half of it (a ramp by whole microbatches at every dp), an EMA,
/// and the slices of tp 2 on every run (the slices define the bits).
fn config(family: &str, row: Row) -> Config {
    let [a, r, pp, sp, _] = row;
    let (dp, zero) = DP_ZERO[a];
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join(format!("{family}-tiny.toml"));
    let mut sets: Vec<String> = [
        "model.n_layer=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.micro_batch_size=2",
        "train.steps=3",
        "train.eval_every=0",
        "train.eval_batches=2",
        "optim.warmup_steps=1",
        "optim.ema_decay=0.9",
        "train.batch_ramp={ start = 8, increment = 8, tokens = 128 }",
        "parallel.tp_slices=2",
        "checkpoint.every=0",
    ]
    .map(String::from)
    .to_vec();
    if family == "llama" {
        sets.extend(["model.n_head=4", "model.n_kv_head=2", "model.intermediate_size=64"].map(String::from));
    } else {
        sets.push("model.n_head=2".into());
    }
    sets.extend([
        format!("parallel.dp={dp}"),
        format!("parallel.zero={zero}"),
        format!("parallel.microbatches={}", 8 / dp),
        format!("parallel.pp={}", pp + 1),
        format!("parallel.tp={}", 1 + sp),
        format!("parallel.sp={}", sp == 1),
        format!("train.recompute=\"{}\"", RECOMPUTE[r]),
    ]);
    let cfg = Config::load(Some(&path), &sets).unwrap();
    cfg.validate().unwrap_or_else(|e| panic!("{family} {row:?}: {e}"));
    cfg
}

/// The losses, weights digest and EMA digest of a run of `cfg`.
fn train(cfg: &Config) -> (Vec<f64>, String, Option<String>) {
    let dir = tempfile::tempdir().unwrap();
    let opts = TrainOptions {
        out_dir: dir.path().join("run"),
        init: None,
        force: false,
        progress: false,
        resume: false,
    };
    let (s, out): (Summary, _) = train_with(cfg, &opts, None).unwrap();
    (out.losses, s.weights_digest, s.ema_weights_digest)
}

fn what(row: Row) -> String {
    let [a, r, pp, sp, f] = row;
    let (dp, zero) = DP_ZERO[a];
    format!("{} dp {dp} ZeRO {zero} pp {} sp {} recompute {}", FAMILIES[f], pp + 1, sp == 1, RECOMPUTE[r])
}

/// Every run of `rows` against its family's dp 1, pp 1, tp 1 run keeping everything.
fn one_set_of_bits(rows: &[Row]) {
    for (f, family) in FAMILIES.iter().enumerate() {
        let reference = train(&config(family, [0, 0, 0, 0, f]));
        assert!(reference.2.is_some(), "{family}: the reference keeps an EMA");
        assert_eq!(reference.0.len(), 3, "{family}: three steps");
        for &row in rows.iter().filter(|r| r[4] == f && r[..4] != [0, 0, 0, 0]) {
            assert_eq!(train(&config(family, row)), reference, "{}", what(row));
        }
    }
}

#[test]
fn the_all_pairs_table_gives_one_set_of_bits_per_family() {
    // Every pair of values of every two factors meets in some row.
    for i in 0..5 {
        for j in i + 1..5 {
            for x in 0..SIZES[i] {
                for y in 0..SIZES[j] {
                    assert!(
                        PAIRS.iter().any(|r| r[i] == x && r[j] == y),
                        "factors {i} and {j}: values {x} and {y} never meet"
                    );
                }
            }
        }
    }
    one_set_of_bits(&PAIRS);
}

#[test]
#[ignore = "the whole product, 216 runs: cargo test --release --test layouts -- --ignored"]
fn every_layout_of_the_product_gives_one_set_of_bits_per_family() {
    let mut rows = Vec::new();
    for a in 0..SIZES[0] {
        for r in 0..SIZES[1] {
            for pp in 0..2 {
                for sp in 0..2 {
                    for f in 0..SIZES[4] {
                        rows.push([a, r, pp, sp, f]);
                    }
                }
            }
        }
    }
    one_set_of_bits(&rows);
}
