//! The data pipeline as a user runs it: a corpus of mixed formats through
//! `tokenizer train` and `prepare --clean --dedup`, the same bytes on any
//! number of threads, a weighted mixture that trains and resumes exactly,
//! the run's own tokenizer used by `generate` and `eval`, and a Llama 3-style
//! tokenizer (ids past 128 000) that round-trips text. Corpora are made here.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = bin().args(args).output().expect("run pipewright");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "pipewright panicked: {stderr}");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string(), stderr)
}

fn ok(args: &[&str]) -> String {
    let (ok, out, err) = run(args);
    assert!(ok, "{args:?} failed: {err}");
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const WORDS: [&str; 32] = [
    "river", "stone", "market", "winter", "garden", "letter", "window", "harbor", "silver", "forest",
    "engine", "candle", "meadow", "castle", "pepper", "lantern", "the", "of", "and", "to", "with", "that",
    "have", "be", "a", "in", "is", "was", "for", "on", "north", "quiet",
];

/// A document of `n` words from a seeded stream, in sentences of twelve.
fn doc(seed: u64, n: usize) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut w = WORDS[(x % 32) as usize].to_string();
        if i % 12 == 0 {
            w[..1].make_ascii_uppercase();
        }
        if i % 12 == 11 || i + 1 == n {
            w.push('.');
        }
        out.push(w);
    }
    out.join(" ")
}

/// 60 unique documents over txt, jsonl.zst and parquet, plus an exact
/// duplicate, a near duplicate (one word changed) and a junk document.
fn corpus(dir: &Path) -> PathBuf {
    let input = dir.join("corpus");
    std::fs::create_dir_all(&input).unwrap();
    let mut docs: Vec<String> = (0..60).map(|i| doc(i, 150)).collect();
    docs.push(docs[3].clone());
    let mut near: Vec<String> = docs[5].split(' ').map(String::from).collect();
    near[40] = "changed".into();
    docs.push(near.join(" "));
    docs.push("buy now ".repeat(60));
    for (i, d) in docs[..10].iter().enumerate() {
        std::fs::write(input.join(format!("doc{i:02}.txt")), d).unwrap();
    }
    let mut jsonl = Vec::new();
    for d in &docs[10..40] {
        writeln!(jsonl, "{}", serde_json::json!({ "id": 1, "text": d })).unwrap();
    }
    std::fs::write(input.join("part.jsonl.zst"), zstd::encode_all(&jsonl[..], 3).unwrap()).unwrap();
    pipewright::data::read::write_parquet(&input.join("part.parquet"), "text", &docs[40..], 7).unwrap();
    input
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

/// Every file in `dir`, by name, with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect();
    v.sort();
    v
}

/// Trains a tokenizer on the corpus and prepares it; returns (tokenizer, dataset).
fn prepared(dir: &Path, threads: &str) -> (PathBuf, PathBuf) {
    let input = corpus(dir);
    let tok = dir.join("tokenizer.json");
    if !tok.exists() {
        ok(&["tokenizer", "train", s(&input), "--vocab-size", "400", "--out", s(&tok), "--threads", threads]);
    }
    let out = dir.join(format!("ds-{threads}"));
    let args = ["prepare", s(&input), "--tokenizer", s(&tok), "--out", s(&out), "--clean", "--dedup"];
    ok(&[&args[..], &["--shard-tokens", "3000", "--threads", threads]].concat());
    (tok, out)
}

#[test]
fn mixed_txt_jsonl_zst_and_parquet_prepare_to_the_same_bytes_on_one_thread_and_eight() {
    let dir = tempfile::tempdir().unwrap();
    let (tok, one) = prepared(dir.path(), "1");
    let (_, eight) = prepared(dir.path(), "8");
    assert_eq!(files(&one), files(&eight), "every file, byte for byte");
    // The tokenizer trained on 1 or 8 threads is the same file too.
    let again = dir.path().join("again.json");
    let input = dir.path().join("corpus");
    ok(&["tokenizer", "train", s(&input), "--vocab-size", "400", "--out", s(&again), "--threads", "8"]);
    assert_eq!(std::fs::read(&tok).unwrap(), std::fs::read(&again).unwrap());

    let m = manifest(&one);
    let c = &m["counts"];
    assert_eq!(c["records"], 63);
    assert_eq!(c["exact_duplicates"], 1, "{c}");
    assert_eq!(c["near_duplicates"], 1, "{c}");
    assert_eq!(c["removed_by_filter"]["top_2_gram"], 1, "the junk document: {c}");
    assert_eq!(c["documents_kept"], 60);
    assert_eq!(m["inputs"].as_array().unwrap().len(), 12);
    assert_eq!(
        m["tokenizer_hash"],
        format!("blake3:{}", blake3::hash(&std::fs::read(&tok).unwrap()).to_hex())
    );
    let shards = m["train"].as_array().unwrap();
    assert!(shards.len() > 2, "{m}");
    assert!(shards.iter().all(|s| s["tokens"].as_u64().unwrap() <= 3000));
    // The dataset carries its tokenizer.
    assert_eq!(std::fs::read(one.join("tokenizer.json")).unwrap(), std::fs::read(&tok).unwrap());
}

#[test]
fn a_second_prepare_is_refused_and_an_interrupted_one_is_cleared_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("a.txt");
    std::fs::write(&input, doc(1, 300)).unwrap();
    let out = dir.path().join("ds");
    ok(&["prepare", s(&input), "--out", s(&out)]);
    let before = files(&out);
    let (ok_, _, err) = run(&["prepare", s(&input), "--out", s(&out)]);
    assert!(!ok_ && err.contains("train.bin") && err.contains("--force"), "{err}");
    assert_eq!(files(&out), before, "a refusal changes nothing");
    // The remains of a prepare that was killed: its work folder, half a shard.
    std::fs::create_dir(out.join(".prepare-partial")).unwrap();
    std::fs::write(out.join(".prepare-partial/train_000000.bin"), b"half").unwrap();
    let (ok_, _, err) = run(&["prepare", s(&input), "--out", s(&out), "--force"]);
    assert!(ok_, "{err}");
    assert!(err.contains("was interrupted; starting clean"), "{err}");
    assert_eq!(files(&out), before, "the same dataset again, nothing of the partial one");
}

#[test]
fn a_bad_json_line_is_named_by_file_and_line_or_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("c.jsonl");
    std::fs::write(&input, format!("{{\"text\": \"{}\"}}\n{{\"body\": 1}}\n", doc(2, 200))).unwrap();
    let out = dir.path().join("ds");
    let (ok_, _, err) = run(&["prepare", s(&input), "--out", s(&out)]);
    assert!(!ok_ && err.contains("c.jsonl: line 2") && err.contains("no field \"text\""), "{err}");
    assert!(!out.exists(), "nothing written");
    ok(&["prepare", s(&input), "--out", s(&out), "--skip-bad-lines"]);
    assert_eq!(manifest(&out)["counts"]["bad_records"]["missing_field"], 1);
}

/// A prepare config for one source and a training config that mixes two.
fn mixture_config(dir: &Path, a: &Path, b: &Path, vocab: u64) -> PathBuf {
    let cfg = dir.join("mix.toml");
    let text = format!(
        "[model]\nn_layer = 2\nn_embd = 16\nn_head = 2\nblock_size = 16\nvocab_size = {vocab}\n\n\
         [train]\nmicro_batch_size = 2\neval_every = 0\neval_batches = 1\n\n\
         [parallel]\npp = 1\nmicrobatches = 2\n\n[checkpoint]\nevery = 2\n\n\
         [data]\nbuiltin = \"\"\n\n\
         [[data.sources]]\npath = \"{}\"\nweight = 3.0\nname = \"web\"\n\n\
         [[data.sources]]\npath = \"{}\"\nweight = 1.0\nname = \"books\"\n",
        a.display(),
        b.display()
    );
    std::fs::write(&cfg, text).unwrap();
    cfg
}

fn digest(run: &Path) -> String {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    v["weights_digest"].as_str().unwrap().to_string()
}

#[test]
fn a_weighted_mixture_of_prepared_datasets_trains_resumes_exactly_and_carries_its_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let (tok, web) = prepared(dir.path(), "2");
    let books_text = dir.path().join("books.txt");
    std::fs::write(&books_text, (100..140).map(|i| doc(i, 80)).collect::<Vec<_>>().join("\n\n")).unwrap();
    let books = dir.path().join("books");
    ok(&["prepare", s(&books_text), "--tokenizer", s(&tok), "--out", s(&books)]);
    let cfg = mixture_config(dir.path(), &web, &books, 400);
    let full = dir.path().join("full");
    ok(&["train", "-c", s(&cfg), "--steps", "4", "--out", s(&full)]);
    // Killed after its step-2 checkpoint, resumed at pp 2: the same bits.
    let crashed = dir.path().join("crashed");
    let out = bin()
        .args(["train", "-c", s(&cfg), "--steps", "4", "--out", s(&crashed)])
        .env("PIPEWRIGHT_FAULT", "stage=0,step=3,mb=0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    ok(&["train", "--steps", "4", "--resume", s(&crashed), "--set", "parallel.pp=2"]);
    assert_eq!(digest(&crashed), digest(&full), "resumed mid-epoch at another pp");
    // Metrics count each source's tokens: 3 to 1, adding up to all tokens.
    let last = |run: &Path| -> serde_json::Value {
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        serde_json::from_str(text.lines().last().unwrap()).unwrap()
    };
    let m = last(&full);
    let (web, books) =
        (m["source_tokens"]["web"].as_u64().unwrap(), m["source_tokens"]["books"].as_u64().unwrap());
    assert_eq!(web + books, m["tokens"].as_u64().unwrap(), "{m}");
    assert!(web > 2 * books, "{m}");
    assert_eq!(last(&crashed)["source_tokens"], m["source_tokens"]);
    // The run folder holds the data's tokenizer: generate needs no flag.
    assert_eq!(std::fs::read(full.join("tokenizer.json")).unwrap(), std::fs::read(&tok).unwrap());
    let text = ok(&["generate", "--weights", s(&full), "--prompt", "The river", "--max-new-tokens", "5"]);
    assert!(text.starts_with("The river"), "{text}");
    // eval on text goes through the same tokenizer.
    let held = dir.path().join("held.txt");
    std::fs::write(&held, doc(999, 400)).unwrap();
    let out = ok(&["eval", "--weights", s(&full), "--text", s(&held), "--windows", "4", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["loss"].as_f64().unwrap().is_finite(), "{out}");
}

/// A tokenizer.json laid out as Llama 3's: the Llama 3 split regex, byte
/// level, a BPE vocabulary of 128 000 entries (ours, padded with entries no
/// merge reaches) and 256 special tokens after it, <|begin_of_text|> at
/// 128 000 and <|end_of_text|> at 128 001: ids up to 128 255.
fn llama3_style(dir: &Path) -> PathBuf {
    let text = dir.join("train.txt");
    std::fs::write(&text, (0..30).map(|i| doc(i, 100)).collect::<Vec<_>>().join("\n")).unwrap();
    let tok = dir.join("llama3.json");
    ok(&[
        "tokenizer",
        "train",
        s(&text),
        "--vocab-size",
        "500",
        "--pattern",
        "llama3",
        "--special",
        "<|x|>",
        "--out",
        s(&tok),
    ]);
    let mut j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tok).unwrap()).unwrap();
    let vocab = j["model"]["vocab"].as_object_mut().unwrap();
    for id in vocab.len()..128_000 {
        vocab.insert(format!("<unused_{id}>"), id.into());
    }
    let special = |id: usize, content: String| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
    };
    let mut added =
        vec![special(128_000, "<|begin_of_text|>".into()), special(128_001, "<|end_of_text|>".into())];
    added.extend(
        (128_002..128_256).map(|id| special(id, format!("<|reserved_special_token_{}|>", id - 128_002))),
    );
    j["added_tokens"] = serde_json::Value::Array(added);
    std::fs::write(&tok, serde_json::to_string(&j).unwrap()).unwrap();
    tok
}

#[test]
fn a_llama3_style_tokenizer_round_trips_text_through_prepare_and_generate() {
    let dir = tempfile::tempdir().unwrap();
    let tok = llama3_style(dir.path());
    let text = "Hello Fault: 12345 naïve — 数字 ok.\n\n  The river.";
    let input = dir.path().join("in.txt");
    std::fs::write(&input, text).unwrap();
    let out = dir.path().join("ds");
    let table = ok(&["prepare", s(&input), "--tokenizer", s(&tok), "--out", s(&out), "--val-fraction", "0"]);
    assert!(table.contains("model.vocab_size = 128256"), "{table}");
    let m = manifest(&out);
    assert_eq!(m["separator"], 128001, "Llama 3's <|end_of_text|> separates documents");
    let tokens = pipewright::data::TokenFile::open(&out.join("train.bin"), 128_256).unwrap();
    assert_eq!(tokens.format(), pipewright::data::TokenFormat::LlmcU32);
    let ids: Vec<u32> = (0..tokens.len()).map(|i| tokens.get(i)).collect();
    let t = pipewright::data::Tokenizer::from_arg(s(&tok)).unwrap();
    let mut stream = t.stream();
    let mut back: Vec<u8> = ids.iter().flat_map(|&i| stream.step(i)).collect();
    back.extend(stream.finish());
    assert_eq!(String::from_utf8(back).unwrap(), text);

    // A model of Llama 3's vocabulary generates through this tokenizer only.
    let run_dir = dir.path().join("run");
    let two_docs = dir.path().join("two.txt");
    std::fs::write(&two_docs, format!("{text} {}", doc(5, 200))).unwrap();
    let data = dir.path().join("ds2");
    ok(&["prepare", s(&two_docs), "--tokenizer", s(&tok), "--out", s(&data), "--val-fraction", "0"]);
    let train = data.join("train.bin");
    let sets = [
        "model.n_layer=1",
        "model.n_embd=16",
        "model.n_head=2",
        "model.block_size=16",
        "model.vocab_size=128256",
        "train.micro_batch_size=1",
        "parallel.pp=1",
        "parallel.microbatches=1",
        "train.eval_every=0",
    ];
    let mut args =
        vec!["train".to_string(), "--steps".into(), "1".into(), "--out".into(), s(&run_dir).into()];
    args.extend(["--set".into(), format!("data.train={}", s(&train))]);
    for kv in sets {
        args.extend(["--set".into(), kv.into()]);
    }
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(run_dir.join("tokenizer.json").exists(), "the run carries the data's tokenizer");
    let out = ok(&[
        "generate",
        "--weights",
        s(&run_dir),
        "--prompt",
        "Hello Fault",
        "--max-new-tokens",
        "3",
        "--temperature",
        "0",
    ]);
    assert!(out.starts_with("Hello Fault"), "{out}");
    // Without its tokenizer, the model is refused rather than decoded through GPT-2's.
    std::fs::remove_file(run_dir.join("tokenizer.json")).unwrap();
    let (ok_, _, err) = run(&["generate", "--weights", s(&run_dir), "--max-new-tokens", "1"]);
    assert!(!ok_ && err.contains("128256") && err.contains("tokenizer.json"), "{err}");
    let (ok_, _, err) =
        run(&["generate", "--weights", s(&run_dir), "--tokenizer", "gpt2", "--max-new-tokens", "1"]);
    assert!(ok_, "GPT-2's 50257 ids fit in 128256: {err}");
}
