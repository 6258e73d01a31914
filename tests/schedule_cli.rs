//! `pipewright schedule` as a user meets it: the JSON form parses and has one list
//! per rank; an impossible request is refused naming the flag, without a panic.

use std::process::Command;

fn run(args: &[&str]) -> (bool, String, String) {
    let out =
        Command::new(env!("CARGO_BIN_EXE_pipewright")).arg("schedule").args(args).output().expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "pipewright panicked: {stderr}");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string(), stderr)
}

#[test]
fn json_has_one_list_per_rank() {
    for kind in ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"] {
        let (ok, out, err) = run(&["--kind", kind, "--stages", "4", "--microbatches", "8", "--json"]);
        assert!(ok, "{kind}: {err}");
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{kind}: {e}: {out}"));
        let ranks = v["ranks"].as_array().expect("ranks");
        assert_eq!(ranks.len(), 4, "{kind}");
        assert_eq!(ranks[0][0], "0F0", "{kind}");
        assert_eq!(v.as_object().unwrap().len(), 1, "{kind}: only \"ranks\"");
    }
}

#[test]
fn text_has_the_grid_and_the_figures() {
    let (ok, out, err) = run(&["--kind", "1f1b", "--stages", "4", "--microbatches", "8"]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().filter(|l| l.starts_with("rank ")).count(), 4, "{out}");
    assert!(out.contains("bubble fraction mean: 0.2727"), "{out}");
    assert!(out.contains("buffered sends (the actor runtime): deadlock-free"), "{out}");
    assert!(
        out.contains("rendezvous sends (blocking, unpaired, NCCL-style): deadlocks at rank 0 step "),
        "{out}"
    );
    let (ok, out, err) = run(&["--kind", "gpipe", "--stages", "4", "--microbatches", "8"]);
    assert!(ok, "{err}");
    assert!(out.contains("rendezvous sends (blocking, unpaired, NCCL-style): deadlock-free"), "{out}");
}

#[test]
fn zb_v_is_drawn_on_its_v() {
    let (ok, out, err) = run(&["--kind", "zb-v", "--stages", "4", "--microbatches", "8"]);
    assert!(ok, "{err}");
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("rank ")).collect();
    assert_eq!(rows.len(), 4, "{out}");
    // Rank 0 holds the first and the last stage, rank 3 the turn.
    assert!(rows[0].contains("7F0") && rows[3].contains("4F0"), "{out}");
    assert!(out.contains("zb-v: 4 rank(s) × 2 chunk(s) = 8 stage(s)"), "{out}");
    assert!(out.contains("makespan: 51"), "{out}");
}

/// PyTorch's order on the V: rank 3 (the turn) starts with F0 F1 pairs and its
/// first pair is 3F4 then 4B0; the figures reach ZB-V's 6m + p − 1 and name
/// DeepSeek's formula.
#[test]
fn dualpipev_is_drawn_on_its_v_with_deepseeks_formula() {
    let (ok, out, err) = run(&["--kind", "dualpipev", "--stages", "4", "--microbatches", "8"]);
    assert!(ok, "{err}");
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("rank ")).collect();
    assert_eq!(rows.len(), 4, "{out}");
    assert!(rows[0].contains("7F0") && rows[3].starts_with("rank 3 | .   .   .   3F0 4F0 3F1 4F1"), "{out}");
    assert!(out.contains("dualpipev: 4 rank(s) × 2 chunk(s) = 8 stage(s)"), "{out}");
    assert!(out.contains("makespan: 51"), "{out}");
    assert!(out.contains("bubble fraction mean: 0.0588") && out.contains("(p−1)(F&B+B−3W)"), "{out}");
    assert!(out.contains("buffered sends (the actor runtime): deadlock-free"), "{out}");
    let (ok, out, err) = run(&["--kind", "dualpipev", "--stages", "4", "--microbatches", "7"]);
    assert!(!ok, "{out}");
    assert!(err.contains("--microbatches") && err.contains("2 × 4 = 8 stages"), "{err}");
}

#[test]
fn impossible_requests_name_the_flag() {
    let (ok, out, err) = run(&["--kind", "interleaved", "--stages", "4", "--microbatches", "6"]);
    assert!(!ok, "{out}");
    assert!(err.contains("--microbatches"), "{err}");
    let (ok, _, err) = run(&["--kind", "zbh1", "--stages", "4", "--microbatches", "8"]);
    assert!(!ok);
    assert!(err.contains("--kind"), "{err}");
    let (ok, _, err) = run(&["--kind", "1f1b", "--stages", "4", "--microbatches", "8", "--chunks", "2"]);
    assert!(!ok);
    assert!(err.contains("--chunks"), "{err}");
}
