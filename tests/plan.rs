//! The planner against published figures, our own schedule simulator, and the CLI.

use pipewright::plan::flops::{self, ModelShape};
use pipewright::plan::hardware::{A100, H100};
use pipewright::plan::memory::{self, rank_memory, MemLayout, StateBytes};
use pipewright::plan::search::{search, SearchInput};
use pipewright::plan::{plan, resolve, PlanArgs};
use pipewright::schedule::{self, Costs, ScheduleKind};
use std::process::Command;

fn close(got: f64, want: f64, tol: f64) -> bool {
    (got / want - 1.0).abs() <= tol
}

#[test]
fn gpt3_175b_on_300b_tokens_is_3_14e23_flops() {
    // GPT-3 paper, table D.1: 3.14e23 training FLOPs for 175B on 300B tokens.
    let shape = ModelShape { layers: 96, hidden: 12288, heads: 96, seq: 2048, vocab: 50257 };
    let f = flops::train_flops(175e9, 300e9, &shape);
    assert!(close(f.six_nd, 3.14e23, 0.01), "6ND = {:e}", f.six_nd);
    // The attention term is small for GPT-3 (T = 2048 ≪ 6·C): about 1.4% on top.
    assert!(f.attention / f.six_nd < 0.02 && f.attention > 0.0);
    assert_eq!(f.total, f.six_nd + f.attention);
    // The 175B shape itself counts to 175B within 1%.
    assert!(close(shape.params(), 175e9, 0.01), "{}", shape.params());
}

#[test]
fn adamw_mixed_precision_is_16_to_18_bytes_per_param() {
    let b = memory::bytes_per_param();
    assert!((16.0..=18.0).contains(&b), "{b}");
    let seven_b = StateBytes::new(7e9, 1, 0);
    assert!((112e9..=126e9).contains(&seven_b.total()), "{}", seven_b.total());
    assert_eq!(seven_b.master + seven_b.adam_m + seven_b.adam_v, 7e9 * 12.0);
}

#[test]
fn chinchilla_budget_gives_70b_and_1_4t() {
    // Chinchilla: 70B params on 1.4T tokens, C = 5.76e23.
    let c = flops::chinchilla(5.76e23);
    assert!(close(c.rule_20x.params, 70e9, 0.10), "{:e}", c.rule_20x.params);
    assert!(close(c.rule_20x.tokens, 1.4e12, 0.10), "{:e}", c.rule_20x.tokens);
    // The fitted law with the paper's rounded constants prefers a smaller model on
    // more data: about 33B on 2.9T (the paper's own approach-3 table has 40B; Besiroglu
    // et al. 2024 showed the published fit does not quite reproduce). Pin it.
    assert!((30e9..36e9).contains(&c.fitted.params), "{:e}", c.fitted.params);
    assert!(close(6.0 * c.fitted.params * c.fitted.tokens, 5.76e23, 1e-9));
    assert!(c.fitted.loss <= c.rule_20x.loss);
}

#[test]
fn one_f_one_b_keeps_p_minus_s_microbatches_on_stage_s() {
    for p in 1..=8 {
        for m in [p, 2 * p, 4 * p, 3] {
            let s = schedule::build(ScheduleKind::OneFOneB, p, m, 1).unwrap();
            let rep = s.simulate(&Costs::unit()).unwrap();
            let want: Vec<usize> = (0..p).map(|st| (p - st).min(m)).collect();
            assert_eq!(rep.peak_live, want, "1f1b p={p} m={m}");
            let g = schedule::build(ScheduleKind::GPipe, p, m, 1).unwrap();
            assert_eq!(g.simulate(&Costs::unit()).unwrap().peak_live, vec![m; p], "gpipe p={p} m={m}");
        }
    }
}

fn inputs() -> Vec<SearchInput> {
    let seven_b = ModelShape { layers: 32, hidden: 4096, heads: 32, seq: 4096, vocab: 32000 };
    let seventy_b = ModelShape { layers: 80, hidden: 8192, heads: 64, seq: 4096, vocab: 32000 };
    let gpt3 = ModelShape { layers: 96, hidden: 12288, heads: 96, seq: 2048, vocab: 50257 };
    let case = |shape: ModelShape, gpus, gpu, global_batch| SearchInput {
        shape,
        params: shape.params(),
        tokens: 1e12,
        gpus,
        gpu,
        mfu: 0.4,
        global_batch,
        micro_batch: None,
        price: Some(2.0),
        dp_overlap: 0.0,
    };
    vec![
        case(seven_b, 512, H100, 1024),
        case(seventy_b, 256, H100, 1024),
        case(gpt3, 1024, A100, 1536),
        case(gpt3, 64, A100, 512),
    ]
}

#[test]
fn search_never_proposes_a_config_over_memory() {
    for inp in inputs() {
        let r = search(&inp);
        for c in &r.candidates {
            assert!(c.memory_bytes <= inp.gpu.usable_bytes(), "{c:?}");
            assert_eq!(c.tp * c.pp * c.dp, inp.gpus);
            assert_eq!(c.dp * c.microbatches * c.micro_batch, inp.global_batch);
            // Recompute the memory from scratch: every rank, from a fresh simulation.
            let kind = c.schedule.split(' ').next().unwrap().parse::<ScheduleKind>().unwrap();
            let s = schedule::build(kind, c.pp, c.microbatches, c.chunks).unwrap();
            let live = s.simulate(&Costs::unit()).unwrap().peak_live;
            let layout = MemLayout {
                tp: c.tp,
                pp: c.pp,
                dp: c.dp,
                chunks: c.chunks,
                micro_batch: c.micro_batch,
                recompute: c.recompute,
                zero: c.zero,
            };
            let worst = rank_memory(&inp.shape, inp.params, &layout, &live)
                .iter()
                .map(|r| r.total)
                .fold(0.0, f64::max);
            assert_eq!(worst, c.memory_bytes);
            assert!(worst <= inp.gpu.usable_bytes());
            assert!((0.0..1.0).contains(&c.bubble) && c.step_s > 0.0 && c.mfu <= inp.mfu + 1e-9);
        }
        let steps: Vec<f64> = r.candidates.iter().map(|c| c.step_s).collect();
        assert!(steps.windows(2).all(|w| w[0] <= w[1]), "ranked fastest first");
    }
    // GPT-3 175B cannot fit on 8 A100s in any layout: 2.8 TB of model states.
    let mut tiny = inputs().remove(2);
    tiny.gpus = 8;
    tiny.global_batch = 64;
    let r = search(&tiny);
    assert!(r.candidates.is_empty() && r.rejected_for_memory > 0);
}

#[test]
fn resolve_names_the_flag() {
    let base = PlanArgs { gpu: "h100".into(), mfu: 0.4, ..PlanArgs::default() };
    let e = resolve(&PlanArgs { tokens: Some(1e9), gpus: Some(8), ..base.clone() }).unwrap_err();
    assert_eq!(e.flag, "--params");
    let e = resolve(&PlanArgs { params: Some(1e9), gpus: Some(8), ..base.clone() }).unwrap_err();
    assert_eq!(e.flag, "--tokens");
    let ok = PlanArgs { params: Some(1e9), tokens: Some(2e10), gpus: Some(8), ..base.clone() };
    assert_eq!(resolve(&PlanArgs { gpu: "b200".into(), ..ok.clone() }).unwrap_err().flag, "--gpu");
    assert_eq!(resolve(&PlanArgs { mfu: 1.5, ..ok.clone() }).unwrap_err().flag, "--mfu");
    assert_eq!(resolve(&PlanArgs { layers: Some(12), ..ok.clone() }).unwrap_err().flag, "--hidden");
    assert_eq!(resolve(&PlanArgs { gpus: Some(0), ..ok.clone() }).unwrap_err().flag, "--gpus");
    let p = plan(&resolve(&ok).unwrap());
    assert!(p.input.shape_guessed && !p.candidates.is_empty());
}

#[test]
fn resolve_reads_a_config() {
    let cfg = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/gpt2-124m.toml");
    let args = PlanArgs { config: Some(cfg.into()), gpu: "a100".into(), mfu: 0.4, ..PlanArgs::default() };
    let i = resolve(&args).unwrap();
    assert_eq!((i.shape.layers, i.shape.hidden, i.shape.heads), (12, 768, 12));
    assert_eq!(i.params, i.shape.params());
    assert!(i.tokens > 0.0 && i.gpus >= 1);
}

#[test]
fn cli_plan_json_has_the_fields() {
    let out = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(["plan", "--params", "7e9", "--tokens", "2e12", "--gpus", "512", "--gpu", "h100", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for k in ["train_flops", "chinchilla", "memory", "candidates"] {
        assert!(v.get(k).is_some(), "missing {k}");
    }
    let six_nd = v["train_flops"]["six_nd"].as_f64().unwrap();
    assert!(close(six_nd, 6.0 * 7e9 * 2e12, 1e-12));
    let c = v["candidates"].as_array().unwrap();
    assert!(!c.is_empty() && c[0]["why"].as_str().unwrap().contains("bubble"));

    let bad = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(["plan", "--params", "7e9", "--tokens", "2e12", "--gpus", "512", "--gpu", "tpu"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--gpu"));
}

/// Trains the bench model one step at a layout and plans the same config: the
/// planner's activation bytes per rank must match what the stages held, and its
/// whole-process figure the process's peak resident memory, each within 20%.
#[test]
fn planned_memory_matches_runs_of_the_bench_model_within_20_percent() {
    let dir = tempfile::tempdir().unwrap();
    let base =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/bench-cpu.toml")).unwrap();
    let layouts =
        [(1, 2, "1f1b", false), (2, 4, "1f1b", false), (2, 4, "gpipe", false), (4, 4, "1f1b", true)];
    for (pp, m, schedule, recompute) in layouts {
        let what = format!("pp={pp} m={m} {schedule} recompute={recompute}");
        let text = base
            .replace("pp = 1", &format!("pp = {pp}"))
            .replace("microbatches = 1", &format!("microbatches = {m}"))
            .replace("schedule = \"1f1b\"", &format!("schedule = \"{schedule}\""))
            .replace("eval_every = 0", &format!("eval_every = 0\nrecompute = {recompute}"));
        let config = dir.path().join(format!("pp{pp}-{schedule}.toml"));
        std::fs::write(&config, text).unwrap();
        let out = dir.path().join(format!("run-pp{pp}-{schedule}"));
        let run = Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args([
                "train",
                "--steps",
                "1",
                "--config",
                config.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert!(run.status.success(), "{what}: {}", String::from_utf8_lossy(&run.stderr));
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
        let cfg = pipewright::config::Config::load(Some(&config), &[]).unwrap();
        let planned = pipewright::plan::cpu::plan(&cfg).unwrap();
        let measured = summary["peak_activation_bytes"].as_array().unwrap();
        assert_eq!(measured.len(), pp, "{what}: one figure per rank");
        for (r, m) in planned.ranks.iter().zip(measured) {
            let m = m.as_f64().unwrap();
            assert!(
                close(m, r.activation_bytes, 0.2),
                "{what} rank {}: held {m} B, planned {}",
                r.rank,
                r.activation_bytes
            );
        }
        if let Some(rss) = summary["peak_rss_bytes"].as_f64() {
            assert!(
                close(rss, planned.process_bytes, 0.2),
                "{what}: peak resident {:.1} MB, planned {:.1} MB",
                rss / 1e6,
                planned.process_bytes / 1e6
            );
        }
    }
}
