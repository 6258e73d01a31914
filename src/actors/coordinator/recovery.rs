//! Recovery: the verdict on each step's loss and gradient norm (apply, skip,
//! loss-scale overflow, spike) and the roll-back decision (after too many
//! skipped steps in a row: back to the newest checkpoint, then a cooled-down
//! learning rate). Plain data in, plain data out: no actors, no I/O, so the
//! coordinator and its replay decide alike and the rules are tested here.

use crate::config::RecoverySection;
use std::collections::VecDeque;

/// What to do with one step's update.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub skip: bool,
    /// The gradients overflowed under loss scaling: the scaler backs off.
    pub overflow: bool,
    /// Why the step is remarkable, for the log and the metrics.
    pub alert: Option<String>,
}

/// The recovery state carried from step to step.
#[derive(Debug, Clone)]
pub struct Recovery {
    cfg: RecoverySection,
    /// (loss, grad norm) of recent non-skipped steps, for the spike detector.
    window: VecDeque<(f64, f64)>,
    consecutive_skips: usize,
    /// After a rollback, the LR is scaled until this step.
    cooldown_until: u64,
}

impl Recovery {
    pub fn new(cfg: &RecoverySection) -> Recovery {
        Recovery { cfg: cfg.clone(), window: VecDeque::new(), consecutive_skips: 0, cooldown_until: 0 }
    }

    /// Judges a step from its loss and (unscaled) gradient norm; `loss_scale`
    /// is set when loss scaling is on. Updates the window and the skip count.
    pub fn judge(&mut self, loss: f64, grad_norm: f64, loss_scale: Option<f64>) -> Verdict {
        let mut skip = !loss.is_finite() || !grad_norm.is_finite();
        let overflow = loss_scale.is_some() && loss.is_finite() && !grad_norm.is_finite();
        let mut alert = None;
        if let (true, Some(scale)) = (overflow, loss_scale) {
            alert =
                Some(format!("gradients overflowed at loss scale {scale}: update skipped, scale backs off"));
        } else if skip {
            alert = Some(format!("non-finite loss ({loss}) or gradient norm ({grad_norm}): update skipped"));
        } else if let Some(a) = self.spike(loss, grad_norm) {
            skip = self.cfg.spike_skip;
            alert = Some(if skip { format!("{a}; update skipped") } else { a });
        }
        if skip && !overflow {
            self.consecutive_skips += 1;
        } else if !skip {
            self.consecutive_skips = 0;
            self.window.push_back((loss, grad_norm));
            if self.window.len() > self.cfg.spike_window {
                self.window.pop_front();
            }
        }
        Verdict { skip, overflow, alert }
    }

    /// A loss above spike_factor × the window's mean, or a gradient norm
    /// spike_zscore deviations above its mean, over the last non-skipped steps.
    fn spike(&self, loss: f64, grad_norm: f64) -> Option<String> {
        let r = &self.cfg;
        let n = self.window.len();
        if n < r.spike_window.min(10) || !loss.is_finite() || !grad_norm.is_finite() {
            return None;
        }
        let mean_loss = self.window.iter().map(|w| w.0).sum::<f64>() / n as f64;
        if r.spike_factor > 0.0 && loss > r.spike_factor * mean_loss {
            return Some(format!("loss spike: {loss:.4} > {} × rolling mean {mean_loss:.4}", r.spike_factor));
        }
        if r.spike_zscore > 0.0 {
            let mean = self.window.iter().map(|w| w.1).sum::<f64>() / n as f64;
            let var = self.window.iter().map(|w| (w.1 - mean).powi(2)).sum::<f64>() / n as f64;
            let z = (grad_norm - mean) / var.sqrt().max(1e-12);
            if z > r.spike_zscore {
                return Some(format!(
                    "gradient-norm spike: {grad_norm:.4} is {z:.1} σ above the rolling mean {mean:.4}"
                ));
            }
        }
        None
    }

    /// Too many skipped steps in a row: time to roll back.
    pub fn roll_back_due(&self) -> bool {
        self.cfg.max_skips > 0 && self.consecutive_skips >= self.cfg.max_skips
    }

    pub fn consecutive_skips(&self) -> usize {
        self.consecutive_skips
    }

    /// The run went back to the checkpoint of `step`: the count and the
    /// window start again, and the learning rate cools down from there.
    pub fn rolled_back_to(&mut self, step: u64) {
        self.consecutive_skips = 0;
        self.window.clear();
        self.cooldown_until = step + self.cfg.cooldown_steps as u64;
    }

    /// A resumed run keeps its checkpoint's cooldown.
    pub fn continue_cooldown(&mut self, until: u64) {
        self.cooldown_until = until;
    }

    pub fn cooldown_until(&self) -> u64 {
        self.cooldown_until
    }

    /// The learning rate of 0-based `step` given its scheduled value.
    pub fn lr(&self, scheduled: f64, step: u64) -> f64 {
        if step < self.cooldown_until {
            scheduled * self.cfg.lr_factor
        } else {
            scheduled
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> RecoverySection {
        RecoverySection { max_skips: 2, spike_window: 10, spike_factor: 3.0, ..Default::default() }
    }

    fn warmed(r: &mut Recovery) {
        for _ in 0..10 {
            assert!(!r.judge(2.0, 1.0, None).skip);
        }
    }

    #[test]
    fn non_finite_loss_skips_and_counts_towards_a_rollback() {
        let mut r = Recovery::new(&cfg());
        let v = r.judge(f64::NAN, 1.0, None);
        assert!(v.skip && !v.overflow);
        assert!(!r.roll_back_due());
        r.judge(2.0, f64::INFINITY, None);
        assert!(r.roll_back_due());
        assert_eq!(r.consecutive_skips(), 2);
    }

    #[test]
    fn overflow_under_loss_scaling_skips_without_counting() {
        let mut r = Recovery::new(&cfg());
        for _ in 0..5 {
            let v = r.judge(2.0, f64::INFINITY, Some(65536.0));
            assert!(v.skip && v.overflow);
            assert!(v.alert.unwrap().contains("65536"));
        }
        assert!(!r.roll_back_due());
    }

    #[test]
    fn loss_spike_alerts_and_skips_only_when_configured() {
        let mut r = Recovery::new(&cfg());
        warmed(&mut r);
        let v = r.judge(7.0, 1.0, None);
        assert!(!v.skip && v.alert.unwrap().starts_with("loss spike"));
        let mut r = Recovery::new(&RecoverySection { spike_skip: true, ..cfg() });
        warmed(&mut r);
        let v = r.judge(7.0, 1.0, None);
        assert!(v.skip && v.alert.unwrap().ends_with("update skipped"));
    }

    #[test]
    fn no_spike_is_judged_before_the_window_fills() {
        let mut r = Recovery::new(&cfg());
        assert_eq!(r.judge(2.0, 1.0, None).alert, None);
        assert_eq!(r.judge(100.0, 1.0, None).alert, None);
    }

    #[test]
    fn a_rollback_cools_the_learning_rate_down_for_cooldown_steps() {
        let mut r = Recovery::new(&RecoverySection { cooldown_steps: 5, lr_factor: 0.5, ..cfg() });
        r.judge(f64::NAN, 1.0, None);
        r.judge(f64::NAN, 1.0, None);
        r.rolled_back_to(10);
        assert!(!r.roll_back_due());
        assert_eq!(r.cooldown_until(), 15);
        assert_eq!(r.lr(1e-3, 14), 5e-4);
        assert_eq!(r.lr(1e-3, 15), 1e-3);
    }
}
