//! Dynamic loss scaling for reduced precision (Megatron-LM's DynamicGradScaler
//! rules): the loss gradient is multiplied by `scale` so small gradients
//! survive a narrow format; a step whose gradients overflow is skipped and,
//! after `hysteresis` such steps, the scale backs off; after `growth_interval`
//! clean steps it grows.
//!
//! Scales are powers of two, so on f32 scaling and unscaling are exact: a run
//! with scaling gives the same bits as one without, until something overflows.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    pub growth_interval: u64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub hysteresis: u64,
    pub min_scale: f64,
    /// Clean steps since the last change.
    pub growth_tracker: u64,
    /// Overflowing steps still tolerated before backing off.
    pub hysteresis_tracker: u64,
}

use crate::config::LossScaling;

impl LossScaler {
    pub fn from_config(c: &crate::config::OptimSection) -> Option<Self> {
        (c.loss_scale == LossScaling::Dynamic).then_some(LossScaler {
            scale: c.loss_scale_init,
            growth_interval: c.loss_scale_growth_interval as u64,
            growth_factor: c.loss_scale_growth_factor,
            backoff_factor: c.loss_scale_backoff_factor,
            hysteresis: c.loss_scale_hysteresis as u64,
            min_scale: c.loss_scale_min,
            growth_tracker: 0,
            hysteresis_tracker: c.loss_scale_hysteresis as u64,
        })
    }

    /// The scaler a run starts with: a resumed run's saved one when the
    /// config still asks for dynamic scaling, else a fresh one (or none).
    pub fn for_run(c: &crate::config::OptimSection, saved: Option<LossScaler>) -> Option<Self> {
        match saved {
            Some(s) if c.loss_scale == LossScaling::Dynamic => Some(s),
            _ => LossScaler::from_config(c),
        }
    }

    /// Updates the scale after a step; `overflow` when its gradients were not finite.
    pub fn update(&mut self, overflow: bool) {
        if overflow {
            self.growth_tracker = 0;
            self.hysteresis_tracker = self.hysteresis_tracker.saturating_sub(1);
            if self.hysteresis_tracker == 0 {
                self.scale = (self.scale * self.backoff_factor).max(self.min_scale);
            }
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.growth_interval {
                self.growth_tracker = 0;
                self.hysteresis_tracker = self.hysteresis;
                self.scale *= self.growth_factor;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler() -> LossScaler {
        LossScaler {
            scale: 1024.0,
            growth_interval: 3,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            hysteresis: 2,
            min_scale: 1.0,
            growth_tracker: 0,
            hysteresis_tracker: 2,
        }
    }

    #[test]
    fn grows_after_clean_steps_and_backs_off_after_hysteresis() {
        let mut s = scaler();
        for _ in 0..3 {
            s.update(false);
        }
        assert_eq!(s.scale, 2048.0);
        s.update(true);
        assert_eq!(s.scale, 2048.0, "one overflow is tolerated (hysteresis 2)");
        s.update(true);
        assert_eq!(s.scale, 1024.0);
        s.update(true);
        assert_eq!(s.scale, 512.0, "hysteresis stays spent until the scale grows again");
    }

    #[test]
    fn never_falls_below_the_minimum() {
        let mut s = scaler();
        s.scale = 2.0;
        for _ in 0..10 {
            s.update(true);
        }
        assert_eq!(s.scale, 1.0);
    }
}
