//! Issue 27's second adversarial pass, kept as tests: files that are not
//! files (a FIFO, `/dev/zero`, a directory, a symlink loop) wherever the
//! program reads one, sizes that used to abort in the allocator, floats and
//! durations that used to panic (after `--force` had removed the earlier
//! run), `prepare` walking into symlink loops and safetensors files that name
//! one tensor twice. Each is refused by name, fast, with a non-zero exit and
//! no panic; docs/hardening.md ("Adversarial pass 2") holds the rows.

mod common;
use common::{run_to_end, TINY};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_pipewright");

const TWO_POW_40: &str = "1099511627776";

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn cmd(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args).stdin(Stdio::null());
    c
}

fn train(args: &[&str], extra: &[&str]) -> Command {
    let mut c = cmd(&["train"]);
    c.args(args);
    for set in TINY.iter().chain(extra) {
        c.args(["--set", set]);
    }
    c
}

/// Runs `c` to its end; still running after a minute means it hangs (on a
/// FIFO, or reading `/dev/zero`): killed, and the test fails saying so.
fn finish(c: Command) -> Output {
    run_to_end(c, Duration::from_secs(60))
}

fn text_of(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Refused: a non-zero exit that is neither a panic nor an abort.
fn refused(c: Command) -> String {
    let o = finish(c);
    let text = text_of(&o);
    assert!(!o.status.success(), "accepted: {text}");
    assert!(!text.contains("panicked"), "a panic: {text}");
    assert!(matches!(o.status.code(), Some(1) | Some(2)), "exit {:?}: {text}", o.status);
    text
}

fn ok(c: Command) -> String {
    let o = finish(c);
    assert!(o.status.success(), "{}", text_of(&o));
    text_of(&o)
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(s(p)).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// The four things a path can be that are not a file to read, with the
/// words each refusal must use.
const HOSTILE: [(&str, &str); 4] = [
    ("fifo", "FIFO"),
    ("dev-zero", "character device"),
    ("directory", "a directory"),
    ("loop", "symlink loop"),
];

/// Puts the hostile thing `kind` at `at`.
fn make_hostile(kind: &str, at: &Path) {
    match kind {
        "fifo" => mkfifo(at),
        "dev-zero" => std::os::unix::fs::symlink("/dev/zero", at).unwrap(),
        "directory" => std::fs::create_dir(at).unwrap(),
        "loop" => std::os::unix::fs::symlink(at.file_name().unwrap(), at).unwrap(),
        _ => unreachable!("{kind}"),
    }
}

/// The refusal of `bad` names it and says what it is.
fn names(text: &str, bad: &Path, words: &str, case: &str) {
    assert!(
        text.contains(s(bad)) && text.contains(words),
        "{case}: expected {} and {words:?}: {text}",
        s(bad)
    );
}

/// An llm.c token file of `n` byte-sized tokens.
fn token_file(p: &Path, n: usize) {
    let mut header = [0i32; 256];
    (header[0], header[1], header[2]) = (20240520, 1, n as i32);
    let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    bytes.extend((0..n).flat_map(|i| ((i * 7 % 251) as u16).to_le_bytes()));
    std::fs::write(p, bytes).unwrap();
}

/// A finished 2-step run with a checkpoint at step 2, in `dir/name`.
fn run_of(dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(name);
    ok(train(&["--steps", "2", "--out", s(&out)], &[]));
    out
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// `run`'s weights saved to `to` with `metadata` (none: the shape must come
/// from elsewhere) and `extra` tensors beside them.
fn resaved(run: &Path, to: &Path, metadata: HashMap<String, String>, extra: &[(&str, Vec<usize>, Vec<f32>)]) {
    let w = pipewright::model::io::load(&run.join("model.safetensors")).unwrap();
    let mut map: BTreeMap<String, (&[usize], &[f32])> =
        w.tensors.iter().map(|(n, (sh, d))| (n.clone(), (sh.as_slice(), d.as_slice()))).collect();
    for (n, sh, d) in extra {
        map.insert(n.to_string(), (sh.as_slice(), d.as_slice()));
    }
    pipewright::model::io::save_named(to, &map, metadata).unwrap();
}

// ---- reads that skipped the regular-file check ----

#[test]
fn a_hostile_config_json_beside_weights_is_named_by_eval_generate_inspect_and_train_init() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = run_of(d, "run");
    let tokens = d.join("tokens.bin");
    token_file(&tokens, 4096);
    for (kind, words) in HOSTILE {
        let folder = d.join(kind);
        std::fs::create_dir(&folder).unwrap();
        // The run's own weights: they carry their config, and config.json is read all the same.
        std::fs::copy(run.join("model.safetensors"), folder.join("model.safetensors")).unwrap();
        let bad = folder.join("config.json");
        make_hostile(kind, &bad);
        let f = s(&folder);
        let out = d.join(format!("out-{kind}"));
        for (case, c) in [
            ("eval", cmd(&["eval", "--weights", f, "--data", s(&tokens), "--batches", "1"])),
            ("generate", cmd(&["generate", "--weights", f, "--max-new-tokens", "1"])),
            ("train --init", train(&["--steps", "1", "--out", s(&out), "--init", f], &[])),
        ] {
            names(&refused(c), &bad, words, &format!("{case} with a {kind} config.json"));
        }
        // inspect reports the file it cannot use and goes on with the weights.
        let text = ok(cmd(&["inspect", f]));
        names(&text, &bad, words, &format!("inspect with a {kind} config.json"));
        assert!(!out.exists(), "{kind}: a refused train --init wrote {}", out.display());
    }
}

#[test]
fn hostile_trace_replay_tls_cookie_and_weights_files_are_refused_by_name_without_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let junk = d.join("junk.pem");
    std::fs::write(&junk, "not a PEM").unwrap();
    for (kind, words) in HOSTILE {
        let bad = d.join(format!("{kind}-file"));
        make_hostile(kind, &bad);
        let b = s(&bad);
        let mut cases = vec![
            ("trace summary", cmd(&["trace", "summary", b])),
            ("--tls-cert", cmd(&["bench", "--transport", "--tls-cert", b, "--tls-key", b, "--tls-ca", b])),
        ];
        // A directory given to inspect is a run folder: its model.safetensors is what is missing.
        if kind == "directory" {
            names(&refused(cmd(&["inspect", b])), &bad.join("model.safetensors"), "No such file", "inspect");
        } else {
            cases.push(("inspect", cmd(&["inspect", b])));
        }
        // A recorded run whose stage-0 log is the hostile thing.
        let run = d.join(format!("recorded-{kind}"));
        std::fs::create_dir_all(run.join("replay")).unwrap();
        let log = run.join("replay/stage-0.log");
        make_hostile(kind, &log);
        cases.push(("replay --list", cmd(&["replay", s(&run), "--list"])));
        cases.push(("replay --actor", cmd(&["replay", s(&run), "--actor", "stage-0"])));
        for (case, c) in cases {
            let text = refused(c);
            let named = if case.starts_with("replay") { &log } else { &bad };
            names(&text, named, words, &format!("{case} on a {kind}"));
        }
        // The cookie file's permissions are checked first (a directory and
        // /dev/zero fail that, naming the file); a FIFO and a loop get past it.
        let mut c = cmd(&["worker", "--join", "127.0.0.1:9", "--rank", "1", "--world", "2"]);
        c.env("PIPEWRIGHT_COOKIE_FILE", &bad).env_remove("PIPEWRIGHT_COOKIE");
        let text = refused(c);
        assert!(text.contains(b), "cookie file {kind}: {text}");
        if matches!(kind, "fifo" | "loop") {
            names(&text, &bad, words, &format!("cookie file {kind}"));
        }
    }
}

#[test]
fn a_resumed_run_names_a_hostile_metrics_jsonl_or_config_toml_instead_of_skipping_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = run_of(d, "run");
    for file in ["metrics.jsonl", "config.toml"] {
        for (kind, words) in [HOSTILE[0], HOSTILE[3]] {
            let copy = d.join(format!("{file}-{kind}"));
            copy_tree(&run, &copy);
            let bad = copy.join(file);
            std::fs::remove_file(&bad).unwrap();
            make_hostile(kind, &bad);
            let mut c = cmd(&["train", "--resume", s(&copy), "--steps", "4"]);
            c.stdout(Stdio::null());
            names(&refused(c), &bad, words, &format!("resume with a {kind} {file}"));
        }
    }
}

// ---- sizes that aborted instead of being refused ----

#[test]
fn eval_and_generate_refuse_a_model_shape_this_machine_cannot_hold_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = run_of(d, "run");
    let tokens = d.join("tokens.bin");
    token_file(&tokens, 4096);
    // A Hugging Face folder whose config.json says 10^12 layers.
    let hf = d.join("hf");
    std::fs::create_dir(&hf).unwrap();
    resaved(&run, &hf.join("model.safetensors"), HashMap::new(), &[]);
    let json = r#"{"model_type": "gpt2", "n_layer": 1000000000000, "n_head": 2, "n_embd": 32,
        "vocab_size": 256, "n_positions": 16}"#;
    std::fs::write(hf.join("config.json"), json).unwrap();
    // Weights whose stored config says 2^40 layers.
    let stored = d.join("stored.safetensors");
    let toml = std::fs::read_to_string(run.join("config.toml")).unwrap();
    let huge: String = toml
        .lines()
        .map(|l| if l.starts_with("n_layer") { format!("n_layer = {TWO_POW_40}") } else { l.to_string() })
        .collect::<Vec<_>>()
        .join("\n");
    assert_ne!(huge, toml, "config.toml holds an n_layer line");
    let meta = HashMap::from([(pipewright::inspect::CONFIG_METADATA_KEY.to_string(), huge)]);
    resaved(&run, &stored, meta, &[]);
    for (weights, value) in [(&hf, "1000000000000"), (&stored, TWO_POW_40)] {
        let w = s(weights);
        for c in [
            cmd(&["eval", "--weights", w, "--data", s(&tokens), "--batches", "1"]),
            cmd(&["generate", "--weights", w, "--max-new-tokens", "1"]),
        ] {
            let text = refused(c);
            assert!(text.contains(&format!("model.n_layer: {value}")) && text.contains("GiB"), "{text}");
        }
    }
}

#[test]
fn bench_and_schedule_refuse_sizes_by_field_and_limit_instead_of_aborting() {
    let dir = tempfile::tempdir().unwrap();
    let cells = "--cells=100000x100000";
    let plot = dir.path().join("p.svg");
    for (args, want) in [
        (vec!["bench", "--set", "model.n_embd=1000000", "--pp"], vec!["model.n_embd: 1000000", "GiB"]),
        (vec!["bench", "--sim", cells, "--plot", s(&plot)], vec!["parallel.pp: 100000", "4096"]),
        (
            vec!["schedule", "--kind", "1f1b", "--stages", TWO_POW_40, "--microbatches", "4"],
            vec!["--stages (parallel.pp): 1099511627776", "at most 4096"],
        ),
        (
            vec!["schedule", "--kind", "1f1b", "--stages", "100000", "--microbatches", "100000"],
            vec!["--stages (parallel.pp): 100000", "at most 4096"],
        ),
        (
            vec!["schedule", "--kind", "1f1b", "--stages", "4000", "--microbatches", "4000"],
            vec!["--microbatches (parallel.microbatches): 4000", "4194304"],
        ),
        (vec!["schedule", "--kind", "interleaved", "--stages", "2", "--microbatches", "4"], vec![]),
        (
            vec![
                "schedule",
                "--kind",
                "interleaved",
                "--stages",
                "2",
                "--microbatches",
                "4",
                "--chunks",
                "4611686018427387904",
            ],
            vec!["--chunks (parallel.chunks): 4611686018427387904", "4194304"],
        ),
    ] {
        if want.is_empty() {
            ok(cmd(&args));
            continue;
        }
        let text = refused(cmd(&args));
        assert!(want.iter().all(|w| text.contains(w)), "{args:?}: expected {want:?}: {text}");
    }
    assert!(!plot.exists());
}

// ---- sizes, floats and durations refused before --force removes anything ----

#[test]
fn sizes_floats_and_durations_are_refused_by_field_before_force_removes_the_earlier_run() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_of(dir.path(), "run");
    let before = std::fs::read(run.join("model.safetensors")).unwrap();
    let eval_batches = format!("train.eval_batches={TWO_POW_40}");
    let microbatches = format!("parallel.microbatches={TWO_POW_40}");
    let table: [(&[&str], &str); 6] = [
        (&[&eval_batches], "train.eval_batches: 1099511627776"),
        (&[&microbatches], "parallel.microbatches: 1099511627776"),
        (&["recovery.shutdown_timeout_s=1e300"], "recovery.shutdown_timeout_s"),
        (&["backend.kind=\"sim\"", "sim.forward_ms=1e300"], "sim.forward_ms"),
        (&["backend.kind=\"sim\"", "sim.backward_ms=1e300"], "sim.backward_ms"),
        (&["backend.kind=\"sim\"", "sim.stage_factors=[1e300]"], "sim.stage_factors"),
    ];
    for (sets, field) in table {
        let mut c = train(&["--steps", "2", "--out", s(&run), "--force"], sets);
        c.stdout(Stdio::null());
        let text = refused(c);
        assert!(text.contains(field), "{sets:?}: {text}");
        assert_eq!(
            std::fs::read(run.join("model.safetensors")).unwrap(),
            before,
            "{sets:?}: outputs removed"
        );
        assert!(run.join("summary.json").exists() && run.join("checkpoints").exists(), "{sets:?}");
    }
}

#[test]
fn out_of_range_timeouts_costs_and_mfu_are_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    let worker = ["worker", "--join", "127.0.0.1:9", "--rank", "1", "--world", "2"];
    let sched = ["schedule", "--kind", "1f1b", "--stages", "2", "--microbatches", "2", "--trace", s(&trace)];
    for (args, flag) in [
        ([&worker[..], &["--join-timeout", "18446744073709551615"]].concat(), "--join-timeout"),
        ([&sched[..], &["--costs", "1e308,1e308"]].concat(), "--costs"),
        (vec!["plan", "--gpu", "cpu", "--mfu", "nan"], "--mfu"),
        (vec!["plan", "--gpu", "cpu", "--mfu", "0"], "--mfu"),
    ] {
        let text = refused(cmd(&args));
        assert!(text.contains(flag), "{args:?}: {text}");
        assert!(!text.contains("makespan"), "{args:?}: a schedule was drawn: {text}");
    }
    assert!(!trace.exists(), "a refused schedule wrote its trace");
}

// ---- prepare and symlinks ----

#[test]
fn prepare_reads_a_folder_with_two_links_to_itself_once_and_warns_of_a_file_reached_twice() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    std::fs::create_dir(&input).unwrap();
    std::fs::write(input.join("a.txt"), "hello").unwrap();
    std::os::unix::fs::symlink(".", input.join("self")).unwrap();
    std::os::unix::fs::symlink(".", input.join("again")).unwrap();
    std::os::unix::fs::symlink("a.txt", input.join("b.txt")).unwrap();
    let out = dir.path().join("out");
    let text = ok(cmd(&["prepare", s(&input), "--out", s(&out), "--val-fraction", "0"]));
    assert!(text.contains("train: 5 tokens"), "{text}");
    assert!(
        text.contains(s(&input.join("a.txt"))) && text.contains(s(&input.join("b.txt"))),
        "the file reached twice is named by both paths: {text}"
    );
}

// ---- safetensors ambiguity ----

#[test]
fn eval_refuses_weights_naming_a_tensor_twice_and_warns_of_a_head_that_differs_from_wte() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = run_of(d, "run");
    let tokens = d.join("tokens.bin");
    token_file(&tokens, 4096);
    let w = pipewright::model::io::load(&run.join("model.safetensors")).unwrap();
    let (shape, wte) = w.tensors["wte.weight"].clone();
    let other: Vec<f32> = wte.iter().map(|x| x + 1.0).collect();
    let meta = w.metadata.clone();
    let twice = d.join("twice.safetensors");
    resaved(&run, &twice, meta.clone(), &[("transformer.wte.weight", shape.clone(), other.clone())]);
    let eval =
        |weights: &Path| cmd(&["eval", "--weights", s(weights), "--data", s(&tokens), "--batches", "1"]);
    let text = refused(eval(&twice));
    assert!(text.contains(s(&twice)) && text.contains("`transformer.wte.weight` and `wte.weight`"), "{text}");
    let head = d.join("head.safetensors");
    resaved(&run, &head, meta, &[("lm_head.weight", shape, other)]);
    let text = ok(eval(&head));
    assert!(text.contains("`lm_head.weight` differs from `wte.weight` and is ignored"), "{text}");
}
