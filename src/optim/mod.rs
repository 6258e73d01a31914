//! The optimizer step: learning-rate schedules, global-norm clipping and AdamW
//! state for the parameters of one model part. It steps a slice of
//! parameters ([`Param`]s) and never sees the part that holds them.
//!
//! Global norms are summed per block of each tensor, in the model's canonical
//! tensor order and block order within a tensor (see `zero`), so the result is
//! the same bits however the model is split into parts or shards.

pub mod batch_ramp;
pub mod ema;
pub mod grad_tree;
pub mod scaler;
pub mod zero;

use crate::kernels::cpu::adamw::{adamw_update, AdamW};
use crate::kernels::profile::{timed, Kernel};
use crate::model::params::all_tensors;
use crate::model::{Arch, Param};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScheduleKind {
    /// Linear warmup, then cosine decay to min_lr at the last step.
    Cosine,
    /// Warmup, stable at lr, then linear decay to min_lr over the final `decay_frac` of steps.
    Wsd { decay_frac: f64 },
    /// Linear warmup, then lr.
    Constant,
}

#[derive(Clone, Debug)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
}

use crate::config::LrShape;

impl LrSchedule {
    pub fn from_config(c: &crate::config::Config) -> Self {
        let kind = match c.optim.schedule {
            LrShape::Wsd => ScheduleKind::Wsd { decay_frac: c.optim.decay_frac },
            LrShape::Constant => ScheduleKind::Constant,
            LrShape::Cosine => ScheduleKind::Cosine,
        };
        LrSchedule {
            kind,
            lr: c.optim.lr,
            min_lr: c.optim.min_lr,
            warmup_steps: c.optim.warmup_steps,
            total_steps: c.train.steps,
        }
    }

    /// The steps over which the rate decays from lr to min_lr, first and last
    /// (equal when it never decays).
    pub fn decay_bounds(&self) -> (usize, usize) {
        let last = self.total_steps.saturating_sub(1).max(self.warmup_steps);
        match self.kind {
            ScheduleKind::Constant => (self.warmup_steps, self.warmup_steps),
            ScheduleKind::Cosine => (self.warmup_steps, last),
            ScheduleKind::Wsd { decay_frac } => {
                let decay_steps = ((self.total_steps as f64 * decay_frac).round() as usize).max(1);
                (self.total_steps.saturating_sub(decay_steps).max(self.warmup_steps), last)
            }
        }
    }

    /// The learning rate of 0-based optimizer step `step`.
    pub fn lr(&self, step: usize) -> f64 {
        self.lr_at(step as f64)
    }

    /// The learning rate at a position on the step axis that need not be
    /// whole (a batch ramp counts the schedule in tokens: `batch_ramp`); at
    /// whole steps the same bits as `lr`, every integer here being exact.
    pub fn lr_at(&self, step: f64) -> f64 {
        let warmup = self.warmup_steps as f64;
        if step < warmup {
            return self.lr * (step + 1.0) / warmup;
        }
        let last = self.total_steps.saturating_sub(1).max(self.warmup_steps);
        match self.kind {
            ScheduleKind::Constant => self.lr,
            ScheduleKind::Cosine => {
                if last == self.warmup_steps {
                    return self.lr;
                }
                let ratio = ((step - warmup) / (last - self.warmup_steps) as f64).min(1.0);
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
                self.min_lr + coeff * (self.lr - self.min_lr)
            }
            ScheduleKind::Wsd { .. } => {
                let (decay_start, _) = self.decay_bounds();
                if step < decay_start as f64 {
                    self.lr
                } else {
                    let ratio = ((step - decay_start as f64 + 1.0) / (self.total_steps - decay_start) as f64)
                        .min(1.0);
                    self.lr + (self.min_lr - self.lr) * ratio
                }
            }
        }
    }
}

/// Σg² of each block of a part's tensors that `shard` owns, as (norm slot,
/// value). `holds_embedding`: whether the part holds the embedding; when it
/// does not, the head's copy of the tied wte is left out, since the
/// embedding's part reports the combined gradient once. `first` is
/// `zero::first_slots` of the model, made once by the caller: a steady-state
/// step allocates nothing.
pub fn grad_sum_squares(
    params: &[Param],
    holds_embedding: bool,
    shard: zero::Shard,
    first: &[usize],
    out: &mut Vec<(usize, f64)>,
) {
    out.clear();
    for p in params {
        if p.canonical == 0 && !holds_embedding {
            continue;
        }
        // A whole-length gradient (ZeRO 0, 1) or only the shard of it (ZeRO 2, 3).
        let (numel, slot) = (p.numel(), first[p.canonical]);
        timed(Kernel::GradNorm, || match p.grad.len() == numel {
            true => zero::block_sum_squares(&p.grad, slot, shard, out),
            false => zero::shard_sum_squares(&p.grad, numel, slot, shard, out),
        });
    }
}

/// √(Σ over all tensors, in canonical order, of Σg²).
pub fn global_norm(per_tensor: &mut [(usize, f64)]) -> f64 {
    per_tensor.sort_by_key(|&(i, _)| i);
    per_tensor.iter().map(|&(_, s)| s).sum::<f64>().sqrt()
}

/// torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6) when
/// that is below 1, else 1 (no clipping). max_norm = 0 disables clipping.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let c = max_norm / (norm + 1e-6);
    if c < 1.0 {
        c as f32
    } else {
        1.0
    }
}

/// AdamW moments for every parameter of one part, for the elements its
/// shard owns (all of them unless ZeRO-1 shares them out).
pub struct AdamState {
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    /// Updates applied so far (the bias-correction step count).
    pub t: u64,
    pub shard: zero::Shard,
}

#[derive(Clone, Copy, Debug)]
pub struct Hyper {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Hyper {
    /// The AdamW kernel's arguments for one update at `lr`, bias-corrected for `step`.
    pub fn adamw(&self, lr: f64, step: u64) -> AdamW {
        AdamW {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            step,
        }
    }

    pub fn from_config(c: &crate::config::Config) -> Self {
        Hyper {
            beta1: c.optim.beta1,
            beta2: c.optim.beta2,
            eps: c.optim.eps,
            weight_decay: c.optim.weight_decay,
        }
    }
}

impl AdamState {
    /// Zero moments for every element of `params`.
    pub fn new(params: &[Param]) -> Self {
        Self::sharded(params, zero::Shard::WHOLE)
    }

    /// Moments for the elements `shard` owns of each of `params`.
    pub fn sharded(params: &[Param], shard: zero::Shard) -> Self {
        let zeros = || params.iter().map(|p| vec![0.0; shard.range(p.numel()).len()]).collect();
        AdamState { m: zeros(), v: zeros(), t: 0, shard }
    }

    /// One AdamW step over the owned elements of `params` (the ones the
    /// state was made for, in the same order) with their (combined)
    /// gradients; the rest of each tensor is left as it is.
    pub fn step(&mut self, params: &mut [Param], hp: Hyper, lr: f64, clip: f32) {
        let shard = self.shard;
        self.step_tensors(
            params.iter_mut().map(|p| {
                let (r, decay) = (shard.range(p.numel()), p.decays());
                (&mut p.data[r.clone()], &p.grad[r], decay)
            }),
            hp,
            lr,
            clip,
        )
    }

    /// One AdamW step over each tensor's owned elements given as (values,
    /// gradients, decays?) in the state's tensor order: how a replica that
    /// holds only shards (ZeRO-2's gradients, ZeRO-3's weights) updates them.
    pub fn step_tensors<'a>(
        &mut self,
        tensors: impl ExactSizeIterator<Item = (&'a mut [f32], &'a [f32], bool)>,
        hp: Hyper,
        lr: f64,
        clip: f32,
    ) {
        assert_eq!(tensors.len(), self.m.len(), "AdamW state for {} tensors", self.m.len());
        self.t += 1;
        let h = hp.adamw(lr, self.t);
        for (i, (data, grad, decay)) in tensors.enumerate() {
            timed(Kernel::AdamW, || {
                adamw_update(data, grad, &mut self.m[i], &mut self.v[i], &h, decay, clip)
            });
        }
    }
}

/// Total parameters that get weight decay, for reports.
pub fn decayed_params(cfg: &Arch) -> usize {
    all_tensors(cfg).iter().filter(|(_, s)| s.len() >= 2).map(|(_, s)| s.iter().product::<usize>()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: ScheduleKind) -> LrSchedule {
        LrSchedule { kind, lr: 1.0, min_lr: 0.1, warmup_steps: 10, total_steps: 110 }
    }

    #[test]
    fn cosine_warms_up_linearly_then_decays_to_min_lr() {
        let s = sched(ScheduleKind::Cosine);
        assert_eq!(s.lr(0), 0.1);
        assert_eq!(s.lr(9), 1.0);
        assert_eq!(s.lr(10), 1.0);
        assert!((s.lr(60) - 0.55).abs() < 0.01);
        assert!((s.lr(109) - 0.1).abs() < 1e-12);
        assert!(s.lr(500) >= 0.1);
    }

    #[test]
    fn wsd_is_stable_then_decays_linearly() {
        let s = sched(ScheduleKind::Wsd { decay_frac: 0.2 });
        assert_eq!(s.lr(50), 1.0);
        assert_eq!(s.lr(87), 1.0);
        assert!(s.lr(99) < 1.0 && s.lr(99) > 0.1);
        assert!((s.lr(109) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn constant_after_warmup() {
        let s = sched(ScheduleKind::Constant);
        assert_eq!(s.lr(4), 0.5);
        assert_eq!(s.lr(100), 1.0);
    }

    /// PyTorch's AdamW (nanoGPT's parameter groups): decoupled decay
    /// `p ← p·(1 − lr·wd)` on the matmul weights and both embeddings, none on
    /// biases or LayerNorm parameters; then `p ← p − lr/bc1 · m/(√v/√bc2 + eps)`.
    #[test]
    fn adamw_decays_two_dimensional_tensors_only_as_pytorch_does() {
        let gpt = Arch::gpt2(2, 2, 8, 11, 5);
        // Every tensor of the model, with values where decay shows (biases
        // and LayerNorm would start at 0 and 1) and a gradient.
        let mut params: Vec<Param> = all_tensors(&gpt)
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let mut r = crate::rng::Rng::new(5, crate::rng::Purpose::Test, &[i as u64]);
                let n: usize = shape.iter().product();
                let data = (0..n).map(|_| r.normal() as f32).collect();
                let grad = (0..n).map(|_| r.normal() as f32).collect();
                Param { name, shape, data, grad, canonical: i }
            })
            .collect();
        let before: Vec<(String, Vec<f32>, Vec<f32>)> =
            params.iter().map(|p| (p.name.clone(), p.data.clone(), p.grad.clone())).collect();
        let hp = Hyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.5 };
        let lr = 0.1;
        let mut adam = AdamState::new(&params);
        adam.step(&mut params, hp, lr, 1.0);

        let two_d = |n: &str| {
            n == "embed_tokens.weight"
                || n == "embed_positions.weight"
                || [
                    "q_proj.weight",
                    "k_proj.weight",
                    "v_proj.weight",
                    "o_proj.weight",
                    "up_proj.weight",
                    "down_proj.weight",
                ]
                .iter()
                .any(|s| n.ends_with(s))
        };
        let mut decayed = 0;
        for ((name, p0, g), p) in before.iter().zip(&params) {
            let wd = if two_d(name) { hp.weight_decay } else { 0.0 };
            decayed += usize::from(wd > 0.0);
            let (bc1, bc2) = (1.0 - hp.beta1, 1.0 - hp.beta2);
            for ((&x, &g), &got) in p0.iter().zip(g).zip(&p.data) {
                let (x, g) = (x as f64, g as f64);
                let (m, v) = ((1.0 - hp.beta1) * g, (1.0 - hp.beta2) * g * g);
                let want = x * (1.0 - lr * wd) - lr / bc1 * m / ((v / bc2).sqrt() + hp.eps);
                assert!((got as f64 - want).abs() < 1e-5 * want.abs().max(1.0), "{name}: {got} vs {want}");
            }
        }
        // The two embeddings and six matrices per block (q, k, v, o, up, down).
        assert_eq!(decayed, 2 + 6 * gpt.n_layer);
    }

    #[test]
    fn clip_coefficient_follows_pytorch() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(4.0, 1.0), (1.0 / (4.0 + 1e-6)) as f32);
        assert_eq!(clip_coefficient(4.0, 0.0), 1.0);
    }
}
