//! The EMA of the weights as PyTorch updates it: `AveragedModel` with
//! `get_ema_multi_avg_fn(decay)` calls `torch._foreach_lerp_(ema, params,
//! 1 - decay)`, and on the CPU that is ATen's `lerp_scalar_kernel`.
//!
//! ema and param are flat slices of one tensor, the same length.
//!
//! Where the rounding happens, from ATen (native/cpu/LerpKernel.cpp `lerp_vec`,
//! native/Lerp.h `lerp`): the weight is the Python float `1 - decay` rounded
//! to f32; with |w| < 0.5 the result is `fma(w, param - ema, ema)`, else
//! `fma(w - 1, param - ema, param)` (`w - 1` is exact for w in [0.5, 1]):
//! `param - ema` rounds once and the multiply-add once. That is the vectorized
//! path every element of a contiguous tensor but the last few takes, and the
//! CUDA kernel's under nvcc's default contraction; ATen's scalar tail spells
//! the same formula unfused, and we follow the vectorized path everywhere so
//! an element's bits never depend on its position in the tensor.

use super::math::simd_fn;
use rayon::prelude::*;

const CHUNK: usize = 4096;

/// ATen's `lerp(start, end, weight)` in f32, as its vectorized CPU kernel rounds it.
#[inline(always)]
pub fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    let diff = end - start;
    if weight.abs() < 0.5 {
        weight.mul_add(diff, start)
    } else {
        (weight - 1.0).mul_add(diff, end)
    }
}

/// The lerp weight PyTorch passes for `decay`: `1 - decay` in Python (f64),
/// rounded to f32 when the kernel reads the scalar.
pub fn weight_of(decay: f64) -> f32 {
    (1.0 - decay) as f32
}

simd_fn! {
    fn lerp_chunk(ema: &mut [f32], param: &[f32], weight: f32) {
        for (e, &p) in ema.iter_mut().zip(param) {
            *e = lerp(*e, p, weight);
        }
    }
}

/// One EMA update of one tensor: `ema ← lerp(ema, param, weight)`. Elementwise,
/// so chunking (and the thread count) cannot change the bits.
pub fn ema_update(ema: &mut [f32], param: &[f32], weight: f32) {
    assert_eq!(ema.len(), param.len(), "EMA and parameter of one tensor");
    ema.par_chunks_mut(CHUNK).zip(param.par_chunks(CHUNK)).for_each(|(e, p)| lerp_chunk(e, p, weight));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{Purpose, Rng};

    /// The lerp worked in f64: the difference rounded to f32 (one rounding, as
    /// ATen's `end - start`), then `base + coeff·diff` exact in f64 (a product
    /// of two f32s has at most 48 bits) and rounded once to f32. The f64 sum
    /// can round before the f32 rounding only on a tie at f32 precision, which
    /// these draws do not hit.
    fn reference(start: f32, end: f32, decay: f64) -> f32 {
        let w = (1.0 - decay) as f32;
        let diff = (end as f64 - start as f64) as f32 as f64;
        let (coeff, base) =
            if (w as f64).abs() < 0.5 { (w as f64, start as f64) } else { (w as f64 - 1.0, end as f64) };
        (base + coeff * diff) as f32
    }

    fn draws(seed: u64, n: usize) -> Vec<f32> {
        let mut r = Rng::new(seed, Purpose::Test, &[]);
        (0..n).map(|_| (r.normal() * 0.05) as f32).collect()
    }

    #[test]
    fn the_update_is_atens_lerp_rounded_as_its_vectorized_kernel_on_both_branches() {
        let n = 3 * CHUNK + 17;
        let (ema0, param) = (draws(1, n), draws(2, n));
        // 0.999 and 0.9: the small-weight branch; 0.3 and 0.5: w ≥ 0.5, the other.
        for decay in [0.999, 0.9, 0.5, 0.3] {
            let mut ema = ema0.clone();
            ema_update(&mut ema, &param, weight_of(decay));
            for i in 0..n {
                let want = reference(ema0[i], param[i], decay);
                assert_eq!(ema[i].to_bits(), want.to_bits(), "decay {decay}, element {i}");
            }
        }
    }

    /// What the fused rounding and the branch buy, so a kernel that dropped
    /// either would fail: the unfused formula lands elsewhere on some
    /// elements, and at weight 1 the second branch returns the parameter
    /// exactly, which `start + 1·(end − start)` does not.
    #[test]
    fn an_unfused_or_unbranched_lerp_gives_other_bits() {
        let (a, b) = (draws(3, 4096), draws(4, 4096));
        let w = weight_of(0.9);
        let unfused = |s: f32, e: f32| s + w * (e - s);
        assert!(a.iter().zip(&b).any(|(&s, &e)| lerp(s, e, w).to_bits() != unfused(s, e).to_bits()));
        let one_branch = |s: f32, e: f32| 1.0f32.mul_add(e - s, s);
        assert!(a.iter().zip(&b).all(|(&s, &e)| lerp(s, e, 1.0) == e));
        assert!(a.iter().zip(&b).any(|(&s, &e)| one_branch(s, e) != e));
    }

    #[test]
    fn the_weight_is_one_minus_decay_formed_in_f64_then_rounded() {
        assert_eq!(weight_of(0.999), (1.0f64 - 0.999) as f32);
        assert_ne!(weight_of(0.999), 1.0f32 - 0.999f32);
    }
}
