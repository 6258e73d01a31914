//! What a step reports and how a run shows it: the optimizer step's own
//! numbers ([`StepStats`]), a metrics.jsonl line ([`StepMetrics`]), the
//! progress bar or log lines ([`Progress`]), and the machine's gemm rate that
//! the throughput figures are read against ([`gemm_peak`]).
//!
//! Below both the runtime that measures steps (`actors/`) and the trainer
//! that runs them (`train/`), so neither reaches into the other for them.

use crate::kernels::cpu::matmul;
use crate::rng::{Purpose, Rng};
use serde::Serialize;
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    /// Mean loss over every token of the step.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// True when a non-finite loss or gradient stopped the update.
    pub skipped: bool,
}

/// One line of metrics.jsonl. JSON has no NaN or infinity: a non-finite loss
/// or gradient norm (a skipped step) is written as `null` and read back as NaN.
#[derive(Serialize, serde::Deserialize, Debug, Clone)]
pub struct StepMetrics {
    pub step: usize,
    #[serde(deserialize_with = "null_is_nan")]
    pub loss: f64,
    pub lr: f64,
    #[serde(deserialize_with = "null_is_nan")]
    pub grad_norm: f64,
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub ms: f64,
    pub skipped: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact_match: Option<f64>,
    /// What the spike detector or the recovery logic saw at this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alert: Option<String>,
    /// The dynamic loss scale used at this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// This step ran before and runs again after a rollback: the earlier row
    /// of the same step above it is the one that was rolled back.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub repeated: bool,
    /// Tokens read so far from each source of a `[[data.sources]]` mixture, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_tokens: Option<std::collections::BTreeMap<String, u64>>,
}

fn null_is_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(<Option<f64> as serde::Deserialize>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// GFLOP/s of a 1024×1024×1024 f32 product on `threads` threads (best of 5).
pub fn gemm_peak(threads: usize) -> f64 {
    let n = 1024;
    let mut rng = Rng::new(0, Purpose::Test, &[]);
    let a: Vec<f32> = (0..n * n).map(|_| rng.normal() as f32).collect();
    let b: Vec<f32> = (0..n * n).map(|_| rng.normal() as f32).collect();
    let mut c = vec![0.0f32; n * n];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
    let mut best = f64::INFINITY;
    pool.install(|| {
        for _ in 0..5 {
            let t = Instant::now();
            matmul::gemm_checked(&mut c, false, &a, (n as isize, 1), &b, (n as isize, 1), n, n, n, 1.0);
            best = best.min(t.elapsed().as_secs_f64());
        }
    });
    2.0 * (n * n * n) as f64 / best / 1e9
}

/// A progress bar on a terminal, plain log lines otherwise, or nothing when disabled.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    /// The bar's loss and rate text, read when the bar draws. indicatif draws
    /// on every `set_message` and `set_position`, so a step that set both
    /// drew twice, once with the previous step's loss; this text is set first,
    /// without drawing, and the position change then draws once.
    stats: Arc<std::sync::Mutex<String>>,
    steps: usize,
    every: usize,
    /// Neither bar nor lines (benchmarks and tests).
    quiet: bool,
}

impl Progress {
    pub fn new(steps: usize, enabled: bool) -> Self {
        let target = (enabled && std::io::stderr().is_terminal()).then(indicatif::ProgressDrawTarget::stderr);
        Progress::with_target(steps, enabled, target)
    }

    /// A bar drawn to `target`, or plain lines when there is none.
    fn with_target(steps: usize, enabled: bool, target: Option<indicatif::ProgressDrawTarget>) -> Self {
        let stats = Arc::new(std::sync::Mutex::new(String::new()));
        let bar = target.map(|target| {
            let b = indicatif::ProgressBar::with_draw_target(Some(steps as u64), target);
            let shown = stats.clone();
            let style = indicatif::ProgressStyle::with_template(
                "{bar:30.cyan/blue} step {pos}/{len} {stats} [{elapsed_precise} < {eta_precise}]",
            )
            .expect("valid template")
            .with_key(
                "stats",
                move |_: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = w.write_str(&shown.lock().unwrap_or_else(|e| e.into_inner()));
                },
            );
            b.set_style(style);
            b
        });
        Progress { bar, stats, steps, every: (steps / 20).max(1), quiet: !enabled }
    }

    pub fn update(&self, m: &StepMetrics) {
        if self.quiet {
            return;
        }
        let mut msg = format!("loss {:.4} | {:.0} tok/s", m.loss, m.tokens_per_s);
        if let Some(v) = m.val_loss {
            msg += &format!(" | val {v:.4}");
        }
        if let Some(e) = m.exact_match {
            msg += &format!(" | exact {:.1}%", 100.0 * e);
        }
        match &self.bar {
            Some(b) => {
                *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = msg;
                b.set_position(m.step as u64);
            }
            None => {
                if m.step.is_multiple_of(self.every) || m.step == self.steps || m.val_loss.is_some() {
                    let eta = (self.steps - m.step) as f64 * m.tokens as f64 / m.tokens_per_s / m.step as f64;
                    tracing::info!(
                        "step {:>6}/{} {msg} | lr {:.2e} | eta {:.0}s",
                        m.step,
                        self.steps,
                        m.lr,
                        eta
                    );
                }
            }
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A terminal that keeps every line drawn to it.
    #[derive(Clone, Debug, Default)]
    struct Screen(Arc<Mutex<Vec<String>>>);

    impl indicatif::TermLike for Screen {
        fn width(&self) -> u16 {
            160
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            if !s.trim().is_empty() {
                self.0.lock().unwrap().push(s.to_string());
            }
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn metrics(step: usize, loss: f64) -> StepMetrics {
        StepMetrics {
            step,
            loss,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens: 100 * step as u64,
            tokens_per_s: 1000.0,
            ms: 100.0,
            skipped: false,
            val_loss: None,
            exact_match: None,
            alert: None,
            loss_scale: None,
            repeated: false,
            source_tokens: None,
        }
    }

    #[test]
    fn progress_bar_draws_each_step_once_with_its_own_loss() {
        let screen = Screen::default();
        let target = indicatif::ProgressDrawTarget::term_like_with_hz(Box::new(screen.clone()), 200);
        let p = Progress::with_target(3, true, Some(target));
        for (step, loss) in [(1, 5.25), (2, 4.5), (3, 3.75)] {
            // Far apart in time, as steps are, so no draw is rate-limited away.
            std::thread::sleep(std::time::Duration::from_millis(30));
            let before = screen.0.lock().unwrap().len();
            p.update(&metrics(step, loss));
            let lines = screen.0.lock().unwrap()[before..].to_vec();
            assert_eq!(lines.len(), 1, "step {step} drew {lines:?}");
            assert!(lines[0].contains(&format!("step {step}/3 loss {loss:.4}")), "{lines:?}");
        }
    }
}
