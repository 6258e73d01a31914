//! The rotary table of a model (both backends read it): the inverse
//! frequencies transformers' `ROPE_INIT_FUNCTIONS` compute for the model's
//! `rope_type`, in its order of f32 operations (the tensors are f32 and the
//! Python scalars join them as f32), then cos and sin of p·f, times YaRN's
//! attention factor.

use super::arch::{Arch, RopeScaling};
use crate::kernels::cpu::rope::{inv_freq, RopeTable};

/// The table of positions [0, T) for `a`'s head size, base and scaling.
pub fn rope_table(a: &Arch) -> RopeTable {
    let (freqs, factor) = scaled_inv_freq(a);
    RopeTable::new(a.block_size, &freqs).scaled(factor)
}

/// The inverse frequencies and the factor on cos and sin.
pub fn scaled_inv_freq(a: &Arch) -> (Vec<f32>, f32) {
    let hs = a.head_dim;
    let base = inv_freq(hs, a.rope_theta);
    match a.rope_scaling {
        RopeScaling::None => (base, 1.0),
        // `inv_freq /= factor`
        RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = original_max_position_embeddings as f32;
            let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
            let two_pi = (2.0 * std::f64::consts::PI) as f32;
            let freqs = base
                .iter()
                .map(|&f| {
                    let wavelen = two_pi / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    if wavelen < high_wavelen || wavelen > low_wavelen {
                        return scaled;
                    }
                    let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                })
                .collect();
            (freqs, 1.0)
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        } => {
            let dim = hs as f64;
            let theta = a.rope_theta as f64;
            let orig = original_max_position_embeddings as f64;
            // Where the ramp starts and ends, in dimensions (Python floats, f64).
            let correction = |rotations: f64| {
                dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction(beta_fast as f64), correction(beta_slow as f64));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
            if low == high {
                high += 0.001;
            }
            let freqs = (0..hs / 2)
                .map(|j| {
                    let pos = a.rope_theta.powf((2 * j) as f32 / hs as f32);
                    let extrapolation = 1.0 / pos;
                    let interpolation = 1.0 / (factor * pos);
                    let ramp = ((j as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
                })
                .collect();
            (freqs, attention_factor)
        }
    }
}
