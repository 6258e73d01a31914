//! `pipewright bench`: training throughput on random tokens, with the share of
//! time per kernel and the machine's matrix-product rate measured in the same
//! run, so every figure can be read as a fraction of what this machine can do.

use crate::config::Config;
use crate::host::thread_count;
use crate::kernels::profile;
use crate::metrics::gemm_peak;
use crate::rng::{Purpose, Rng};
use crate::train::engine::Engine;
use serde::Serialize;
use std::time::Instant;

#[derive(Serialize, Debug)]
pub struct BenchReport {
    pub steps: usize,
    pub threads: usize,
    pub params: usize,
    pub tokens_per_step: usize,
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    /// Model FLOPs per second, counting (6·N + 6·L·C·T) per token as llm.c does.
    pub gflops: f64,
    /// A large f32 product (1024³) on the same threads, for scale.
    pub gemm_peak_gflops: f64,
    /// `gflops / gemm_peak_gflops`: the model's share of the gemm rate
    /// measured here. Not an MFU (that is against a datasheet peak).
    pub gemm_util: f64,
    /// Fraction of step time in each kernel.
    pub kernel_share: Vec<(String, f64)>,
    pub final_loss: f64,
}

pub fn run(cfg: &Config, steps: usize, warmup: usize, mut progress: impl FnMut(usize, f64)) -> BenchReport {
    let gpt = cfg.arch();
    let mut engine = Engine::new(cfg);
    let n = engine.tokens_per_step() / engine.microbatches;
    let vocab = gpt.vocab_size as u64;
    let seed = cfg.train.seed;
    let fill_step = |step: usize| {
        move |mb: usize, inp: &mut [u32], tgt: &mut [u32]| {
            let mut r = Rng::new(seed, Purpose::Data, &[step as u64, mb as u64]);
            for i in 0..n {
                inp[i] = r.below(vocab) as u32;
                tgt[i] = r.below(vocab) as u32;
            }
        }
    };
    let lr = cfg.optim.lr;
    for s in 0..warmup {
        engine.step(lr, fill_step(s));
    }
    profile::reset();
    profile::enable(true);
    let t0 = Instant::now();
    let mut last = 0.0;
    for s in 0..steps {
        last = engine.step(lr, fill_step(warmup + s)).loss;
        progress(s + 1, last);
    }
    let secs = t0.elapsed().as_secs_f64();
    profile::enable(false);
    let tokens = (steps * engine.tokens_per_step()) as f64;
    let tokens_per_s = tokens / secs;
    let kernel_share =
        profile::snapshot().into_iter().map(|(k, s)| (k.name().to_string(), s / secs)).collect();
    let gflops = tokens_per_s * gpt.flops_per_token() / 1e9;
    let gemm_peak_gflops = gemm_peak(thread_count(cfg.backend.threads));
    BenchReport {
        steps,
        threads: thread_count(cfg.backend.threads),
        params: gpt.num_params(),
        tokens_per_step: engine.tokens_per_step(),
        tokens_per_s,
        ms_per_step: secs * 1e3 / steps as f64,
        gflops,
        gemm_peak_gflops,
        gemm_util: gflops / gemm_peak_gflops,
        kernel_share,
        final_loss: last,
    }
}

/// A training run into a scratch directory that is removed afterwards, with no
/// progress output: what the benchmarks measure.
fn run_quietly(
    cfg: &Config,
    tag: &str,
) -> anyhow::Result<(crate::train::run::Summary, crate::actors::RunOutcome)> {
    let dir = std::env::temp_dir().join(format!("pipewright-bench-{}-{tag}", std::process::id()));
    let opts = crate::train::run::TrainOptions {
        out_dir: dir.clone(),
        init: None,
        force: true,
        progress: false,
        resume: false,
    };
    let result = crate::train::run::train_with(cfg, &opts, None);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// One row of the pipeline comparison: the same model and batch at one layout.
#[derive(Serialize, Debug, Clone)]
pub struct PipelineRow {
    pub pp: usize,
    pub schedule: String,
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    pub gflops: f64,
    /// Send → actor handle time of activation and gradient messages, µs.
    pub msg_median_us: f64,
    pub msg_p99_us: f64,
    pub messages: usize,
    /// The CPU planner's step time for this layout, at the model rate measured at
    /// pp = 1 (`plan::cpu::step_ms`); none without a pp = 1 row.
    pub planned_ms_per_step: Option<f64>,
    /// Activation bytes the fullest rank held at its peak, and the planner's figure.
    pub peak_activation_bytes: usize,
    pub planned_activation_bytes: f64,
}

/// Trains `steps` steps of `cfg` (random tokens) through the actor runtime at
/// each pipeline size in `pps`, with `microbatches` per step, and reports
/// throughput and message latency. Sizes that do not fit the model are skipped.
pub fn pipeline_rows(
    cfg: &Config,
    steps: usize,
    pps: &[usize],
    microbatches: usize,
) -> anyhow::Result<Vec<PipelineRow>> {
    let gpt = cfg.arch();
    let mut rows = Vec::new();
    for &pp in pps {
        if pp > gpt.n_layer {
            continue;
        }
        let mut c = cfg.clone();
        c.parallel.pp = pp;
        c.parallel.microbatches = microbatches;
        c.train.steps = steps;
        c.train.eval_every = 0;
        c.data.builtin = crate::config::Builtin::Random;
        c.data.train.clear();
        c.data.val.clear();
        let (summary, out) = run_quietly(&c, &format!("pp{pp}"))?;
        let plan = crate::plan::cpu::plan(&c)?;
        let fullest = (0..pp).max_by_key(|&r| out.peak_live_bytes.get(r).copied().unwrap_or(0)).unwrap_or(0);
        // The rate the planner is given: the whole machine on the model, as pp = 1 measured it.
        let base = rows
            .first()
            .filter(|r: &&PipelineRow| r.pp == 1)
            .map(|r| r.gflops)
            .or((pp == 1).then_some(summary.model_gflops));
        let planned_ms_per_step = match base {
            Some(g) => Some(crate::plan::cpu::step_ms(&c, g, thread_count(c.backend.threads))?),
            None => None,
        };
        let mut lat = out.message_latency_us.clone();
        lat.sort_by(f64::total_cmp);
        let q = |f: f64| if lat.is_empty() { 0.0 } else { lat[((lat.len() - 1) as f64 * f) as usize] };
        rows.push(PipelineRow {
            pp,
            schedule: c.parallel.schedule.name().to_string(),
            tokens_per_s: summary.tokens_per_s,
            ms_per_step: summary.train_seconds * 1e3 / steps as f64,
            gflops: summary.model_gflops,
            msg_median_us: q(0.5),
            msg_p99_us: q(0.99),
            messages: lat.len(),
            planned_ms_per_step,
            peak_activation_bytes: out.peak_live_bytes.get(fullest).copied().unwrap_or(0),
            planned_activation_bytes: plan.ranks[fullest].activation_bytes,
        });
    }
    Ok(rows)
}

pub fn pipeline_table(rows: &[PipelineRow]) -> String {
    let schedule = rows.first().map_or("1f1b", |r| r.schedule.as_str());
    let mut s = format!("\nthe same model through the actor runtime ({schedule}), per pipeline size\n");
    s += &format!(
        "  {:>3} {:>10} {:>9} {:>9} {:>8} {:>15} {:>15} {:>11} {:>9} {:>10} {:>12}\n",
        "pp",
        "tokens/s",
        "ms/step",
        "GFLOP/s",
        "vs pp=1",
        "busy msg med µs",
        "busy msg p99 µs",
        "planned ms",
        "measured/",
        "act. MB",
        "planned MB"
    );
    let base = rows.first().map(|r| r.tokens_per_s).unwrap_or(1.0);
    s += "  (busy msg: send → handle of the run's activation and gradient messages, while the compute\n   threads occupy the cores, so it includes waiting for a core; the runtime's own cost on an idle\n   actor is measured separately below)\n";
    s += "  (planned: the CPU planner's step time at the model rate pp = 1 measured, and its activation\n   memory of the fullest rank; measured/planned within 0.8–1.2 is the planner's target)\n";
    for r in rows {
        s += &format!(
            "  {:>3} {:>10.0} {:>9.1} {:>9.1} {:>8.2} {:>15.1} {:>15.1} {:>11} {:>9} {:>10.1} {:>12.1}\n",
            r.pp,
            r.tokens_per_s,
            r.ms_per_step,
            r.gflops,
            r.tokens_per_s / base,
            r.msg_median_us,
            r.msg_p99_us,
            r.planned_ms_per_step.map_or("–".into(), |p| format!("{p:.1}")),
            r.planned_ms_per_step.map_or("–".into(), |p| format!("{:.2}", r.ms_per_step / p)),
            r.peak_activation_bytes as f64 / 1e6,
            r.planned_activation_bytes / 1e6
        );
    }
    s
}

impl BenchReport {
    pub fn table(&self) -> String {
        let mut s = String::new();
        s += &format!(
            "{} params, {} tokens/step, {} threads, {} timed steps\n\n",
            self.params, self.tokens_per_step, self.threads, self.steps
        );
        s += &format!("{:<34}{:>14}\n", "tokens/s", format!("{:.0}", self.tokens_per_s));
        s += &format!("{:<34}{:>14}\n", "ms/step", format!("{:.1}", self.ms_per_step));
        s += &format!("{:<34}{:>14}\n", "model GFLOP/s (6N + 6LCT per token)", format!("{:.1}", self.gflops));
        s += &format!(
            "{:<34}{:>14}\n",
            "1024³ f32 gemm GFLOP/s, same threads",
            format!("{:.1}", self.gemm_peak_gflops)
        );
        s += &format!("{:<34}{:>14}\n", "gemm_util (model / gemm rate)", format!("{:.2}", self.gemm_util));
        s += "\nshare of step time per kernel\n";
        let mut shares = self.kernel_share.clone();
        shares.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total: f64 = shares.iter().map(|x| x.1).sum();
        for (k, f) in &shares {
            s += &format!("  {:<14}{:>7.1}%\n", k, 100.0 * f);
        }
        s += &format!("  {:<14}{:>7.1}%\n", "(other)", 100.0 * (1.0 - total).max(0.0));
        s
    }
}

/// The runtime's own cost per message, on an idle actor: `n` messages sent one
/// at a time, each timed from `send_message` to the start of the receiving
/// actor's handler (the path every activation and gradient takes before its
/// hop to the compute thread). Returns (median, p99) in µs.
pub fn message_latency(n: usize) -> anyhow::Result<(f64, f64)> {
    use ractor::{Actor, ActorProcessingErr, ActorRef, Message};
    use std::time::Instant;
    use tokio::sync::mpsc::UnboundedSender;

    struct Ping(Instant);
    impl Message for Ping {}
    struct Echo;
    impl Actor for Echo {
        type Msg = Ping;
        type State = UnboundedSender<f64>;
        type Arguments = UnboundedSender<f64>;
        async fn pre_start(
            &self,
            _: ActorRef<Ping>,
            a: Self::Arguments,
        ) -> Result<Self::State, ActorProcessingErr> {
            Ok(a)
        }
        async fn handle(
            &self,
            _: ActorRef<Ping>,
            m: Ping,
            st: &mut Self::State,
        ) -> Result<(), ActorProcessingErr> {
            st.send(m.0.elapsed().as_secs_f64() * 1e6)?;
            Ok(())
        }
    }
    let rt = crate::train::run::runtime()?;
    rt.block_on(async move {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let (echo, _) = Actor::spawn(None, Echo, tx).await?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            echo.send_message(Ping(Instant::now()))?;
            v.push(rx.recv().await.ok_or_else(|| anyhow::anyhow!("echo actor stopped"))?);
        }
        echo.stop(None);
        v.sort_by(f64::total_cmp);
        let q = |f: f64| v[((v.len() - 1) as f64 * f) as usize];
        Ok((q(0.5), q(0.99)))
    })
}

/// One cell of the simulated-backend table.
#[derive(Serialize, Debug, Clone)]
pub struct SimRow {
    pub pp: usize,
    pub microbatches: usize,
    pub schedule: String,
    /// Mean over stages and timed steps of idle / step window.
    pub measured_bubble: f64,
    /// The simulator's bubble for the same costs.
    pub theory_bubble: f64,
    /// The CPU planner's bubble for this config (`plan::cpu`, at the `[sim]` costs).
    pub planned_bubble: f64,
    /// |measured − theory| < 0.02, the target.
    pub within_target: bool,
    /// Measured step window ÷ the simulator's ideal makespan − 1.
    pub overhead: f64,
    pub step_ms: f64,
    pub ideal_ms: f64,
}

/// Runs the sim backend (sleeping stages, real actors and messages) for each
/// (pp, m) and compares what it measures with the schedule simulator.
pub fn sim_rows(
    schedule: &str,
    cells: &[(usize, usize)],
    forward_ms: f64,
    backward_ms: f64,
    steps: usize,
) -> anyhow::Result<Vec<SimRow>> {
    use crate::schedule::{build, Costs, ScheduleKind};
    let kind: ScheduleKind = schedule.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    let v = kind.default_chunks();
    // Every cell's config is built and checked against the machine before
    // the first runs, so a cell too large for it is refused up front, not
    // after minutes of the others (or in the allocator).
    let mut planned = Vec::new();
    for &(pp, m) in cells {
        let overrides: Vec<String> = vec![
            format!("model.n_layer={}", pp * v),
            "model.n_embd=8".into(),
            "model.n_head=1".into(),
            "model.block_size=4".into(),
            "model.vocab_size=16".into(),
            "train.micro_batch_size=1".into(),
            format!("train.steps={steps}"),
            "train.eval_every=0".into(),
            "data.builtin=\"random\"".into(),
            format!("parallel.pp={pp}"),
            format!("parallel.microbatches={m}"),
            format!("parallel.schedule=\"{schedule}\""),
            "backend.kind=\"sim\"".into(),
            format!("sim.forward_ms={forward_ms}"),
            format!("sim.backward_ms={backward_ms}"),
            format!("sim.weight_ms={}", backward_ms / 2.0),
            "trace.enabled=true".into(),
        ];
        let cfg = Config::load(None, &overrides).map_err(|e| anyhow::anyhow!("--cells {pp}x{m}: {e}"))?;
        crate::limits::check(&cfg).map_err(|e| anyhow::anyhow!("--cells {pp}x{m}: {e}"))?;
        let sched = build(kind, pp, m, v).map_err(|e| anyhow::anyhow!("--cells {pp}x{m}: {e}"))?;
        planned.push((pp, m, cfg, sched));
    }
    let mut rows = Vec::new();
    for (pp, m, cfg, sched) in planned {
        let planned_bubble = crate::plan::cpu::plan(&cfg)?.bubble;
        let (_, out) = run_quietly(&cfg, &format!("sim-{pp}-{m}"))?;
        let costs = Costs {
            forward: forward_ms,
            backward: backward_ms,
            backward_input: backward_ms / 2.0,
            backward_weight: backward_ms / 2.0,
            comm: 0.0,
            per_stage_factor: vec![],
        };
        let theory = sched.simulate(&costs).map_err(|e| anyhow::anyhow!("{e}"))?;
        let (bubble, window_ms) = measured_bubble(&out.trace, pp, steps);
        rows.push(SimRow {
            pp,
            microbatches: m,
            schedule: schedule.to_string(),
            measured_bubble: bubble,
            theory_bubble: theory.mean_bubble_frac,
            planned_bubble,
            within_target: (bubble - theory.mean_bubble_frac).abs() < 0.02,
            overhead: window_ms / theory.makespan - 1.0,
            step_ms: window_ms,
            ideal_ms: theory.makespan,
        });
    }
    Ok(rows)
}

/// (bubble, step window in ms) of replica 0: each the median over the steps
/// after the first (the first also pays for start-up), the same summary
/// `trace summary` gives for `step_ms`, so one step that the machine stalls
/// (a preempted vCPU) does not stand for the runtime. A step's bubble is the
/// mean over ranks of the share of its window the rank did not compute.
pub fn measured_bubble(trace: &[crate::trace::Record], ranks: usize, steps: usize) -> (f64, f64) {
    let first = usize::from(steps > 1);
    let n = steps - first;
    // One pass over the trace: each timed step's window and each rank's busy time.
    let mut window = vec![(f64::INFINITY, f64::NEG_INFINITY); n];
    let mut busy = vec![vec![0.0; ranks]; n];
    for r in trace.iter().filter(|r| r.replica == 0 && crate::trace::is_action(&r.name)) {
        let Some(i) = (r.step as usize).checked_sub(first).filter(|&i| i < n) else { continue };
        window[i].0 = window[i].0.min(r.start_us);
        window[i].1 = window[i].1.max(r.start_us + r.dur_us);
        // Per rank: with several chunks a rank's stages share its time.
        if let Some(b) = busy[i].get_mut(r.rank) {
            *b += r.dur_us;
        }
    }
    let widths: Vec<f64> = window.iter().map(|(start, end)| end - start).collect();
    let bubbles = widths
        .iter()
        .zip(&busy)
        .map(|(w, busy)| busy.iter().map(|b| 1.0 - b / w).sum::<f64>() / ranks as f64)
        .collect();
    use crate::trace::summary::median;
    (median(bubbles), median(widths.iter().map(|w| w / 1e3).collect()))
}

pub fn sim_table(rows: &[SimRow]) -> String {
    let mut s = String::from(
        "simulated backend: stages sleep for their costs; real actors, messages and schedules\n",
    );
    s += &format!(
        "  {:>3} {:>5} {:>9} {:>9} {:>8} {:>10} {:>10} {:>9}\n",
        "pp", "m", "bubble", "theory", "diff", "step ms", "ideal ms", "overhead"
    );
    for r in rows {
        s += &format!(
            "  {:>3} {:>5} {:>9.4} {:>9.4} {:>+8.4} {:>10.1} {:>10.1} {:>8.2}%{}\n",
            r.pp,
            r.microbatches,
            r.measured_bubble,
            r.theory_bubble,
            r.measured_bubble - r.theory_bubble,
            r.step_ms,
            r.ideal_ms,
            100.0 * r.overhead,
            if r.within_target { "" } else { "  ✗ misses 0.02" }
        );
    }
    let missed = rows.iter().filter(|r| !r.within_target).count();
    s += &format!(
        "  {} of {} cells within 0.02 of theory (✗: missed){}\n",
        rows.len() - missed,
        rows.len(),
        match rows.iter().find(|r| r.pp == 8 && r.microbatches == 32) {
            Some(r) => format!("; overhead at pp = 8, m = 32: {:.2}% (target ≤ 2%)", 100.0 * r.overhead),
            None => String::new(),
        }
    );
    s
}

/// Two panels as one SVG: measured against theoretical bubble, one point per
/// (pp, m); and the runtime overhead per cell against the 3% target.
pub fn sim_plot(rows: &[SimRow]) -> String {
    let (w, h) = (560.0, 460.0);
    let bubble = bubble_panel(rows);
    let overhead = overhead_panel(rows);
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<g>{bubble}</g>\n<g transform=\"translate({w} 0)\">{overhead}</g>\n</svg>\n",
        2.0 * w
    )
}

/// A panel's x and y axes: lines along its bottom and left, `pad` in from the edges.
fn panel_axes(w: f64, h: f64, pad: f64) -> String {
    let (b, r) = (h - pad, w - pad);
    format!(
        "<line x1=\"{pad}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{b}\" stroke=\"black\"/>\n"
    )
}

const PLOT_COLOURS: [&str; 6] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];

/// Runtime overhead (%) per cell: x = log2 pp, points coloured by m / pp, the 3%
/// target as a dashed line.
fn overhead_panel(rows: &[SimRow]) -> String {
    let (w, h, pad) = (560.0, 460.0, 60.0);
    let max = rows.iter().map(|r| 100.0 * r.overhead).fold(4.0f64, f64::max) * 1.1;
    let min = rows.iter().map(|r| 100.0 * r.overhead).fold(0.0f64, f64::min);
    let pps: Vec<usize> = {
        let mut v: Vec<usize> = rows.iter().map(|r| r.pp).collect();
        v.sort();
        v.dedup();
        v
    };
    let x = |pp: usize| {
        let i = pps.iter().position(|&p| p == pp).unwrap_or(0) as f64;
        pad + (i + 0.5) / pps.len().max(1) as f64 * (w - 2.0 * pad)
    };
    let y = |v: f64| h - pad - (v - min) / (max - min) * (h - 2.0 * pad);
    let mut s = format!(
        "<text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">Runtime overhead: measured step ÷ ideal makespan − 1</text>\n",
        w / 2.0
    );
    s += &panel_axes(w, h, pad);
    s += &format!(
        "<line x1=\"{pad}\" y1=\"{y3:.1}\" x2=\"{}\" y2=\"{y3:.1}\" stroke=\"#d62728\" stroke-dasharray=\"6 4\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#d62728\">target 3%</text>\n",
        w - pad,
        w - pad,
        y(3.0) - 4.0,
        y3 = y(3.0)
    );
    for i in 0..=5 {
        let v = min + (max - min) * i as f64 / 5.0;
        s += &format!(
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.1}%</text>\n",
            pad - 6.0,
            y(v) + 4.0
        );
    }
    for &pp in &pps {
        s += &format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{pp}</text>\n",
            x(pp),
            h - pad + 16.0
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">pipeline ranks pp</text>\n",
        w / 2.0,
        h - 18.0
    );
    let mut ks: Vec<usize> = rows.iter().map(|r| r.microbatches / r.pp.max(1)).collect();
    ks.sort();
    ks.dedup();
    for (i, k) in ks.iter().enumerate() {
        let c = PLOT_COLOURS[i % PLOT_COLOURS.len()];
        let dx = (i as f64 - (ks.len() as f64 - 1.0) / 2.0) * 8.0;
        for r in rows.iter().filter(|r| r.microbatches / r.pp.max(1) == *k) {
            s += &format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{c}\"><title>pp={} m={}: overhead {:.2}%</title></circle>\n",
                x(r.pp) + dx,
                y(100.0 * r.overhead),
                r.pp,
                r.microbatches,
                100.0 * r.overhead
            );
        }
        s += &format!(
            "<circle cx=\"{}\" cy=\"{}\" r=\"4\" fill=\"{c}\"/><text x=\"{}\" y=\"{}\">m = {k}·pp</text>\n",
            pad + 20.0,
            pad + 10.0 + 18.0 * i as f64,
            pad + 32.0,
            pad + 14.0 + 18.0 * i as f64
        );
    }
    s
}

/// Measured against theoretical bubble, one point per (pp, m).
fn bubble_panel(rows: &[SimRow]) -> String {
    let (w, h, pad) = (560.0, 460.0, 60.0);
    let max = rows.iter().map(|r| r.measured_bubble.max(r.theory_bubble)).fold(0.05f64, f64::max) * 1.1;
    let x = |v: f64| pad + v / max * (w - 2.0 * pad);
    let y = |v: f64| h - pad - v / max * (h - 2.0 * pad);
    let mut s = format!(
        "<text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">Pipeline bubble: measured (sim backend) vs schedule theory</text>\n",
        w / 2.0
    );
    s += &format!(
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#bbb\" stroke-dasharray=\"4 4\"/>\n",
        x(0.0),
        y(0.0),
        x(max),
        y(max)
    );
    s += &panel_axes(w, h, pad);
    for i in 0..=5 {
        let v = max * i as f64 / 5.0;
        s += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{v:.2}</text>\n", x(v), h - pad + 16.0);
        s += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.2}</text>\n", pad - 6.0, y(v) + 4.0);
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">theoretical bubble fraction</text>\n",
        w / 2.0,
        h - 18.0
    );
    s += &format!(
        "<text transform=\"translate(16 {}) rotate(-90)\" text-anchor=\"middle\">measured bubble fraction</text>\n",
        h / 2.0
    );
    let colours = PLOT_COLOURS;
    let mut pps: Vec<usize> = rows.iter().map(|r| r.pp).collect();
    pps.dedup();
    for (i, pp) in pps.iter().enumerate() {
        let c = colours[i % colours.len()];
        for r in rows.iter().filter(|r| r.pp == *pp) {
            s += &format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"5\" fill=\"{c}\"><title>pp={} m={}: measured {:.4}, theory {:.4}</title></circle>\n",
                x(r.theory_bubble),
                y(r.measured_bubble),
                r.pp,
                r.microbatches,
                r.measured_bubble,
                r.theory_bubble
            );
        }
        s += &format!(
            "<circle cx=\"{}\" cy=\"{}\" r=\"5\" fill=\"{c}\"/><text x=\"{}\" y=\"{}\">pp = {pp}</text>\n",
            pad + 20.0,
            pad + 10.0 + 18.0 * i as f64,
            pad + 32.0,
            pad + 14.0 + 18.0 * i as f64
        );
    }
    s
}
