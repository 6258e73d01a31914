//! Scalar math written so the compiler vectorizes it: branch-free exp and tanh.
//! libm's `expf`/`tanhf` are calls the compiler cannot vectorize, and GELU and
//! softmax spend most of their time there.
//!
//! `simd_fn!` compiles a loop twice: for the baseline target and with AVX2+FMA,
//! picked at run time. Both compute the same bits: `mul_add` is one correctly
//! rounded fused operation either way (an instruction or libm's `fmaf`), every
//! other operation is IEEE-exact, and without fast-math the compiler never
//! reorders a floating-point sum.

/// Defines `fn name(args) body` that runs `body` compiled with AVX2+FMA where
/// the CPU has them. The body must not depend on which version runs.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        $crate::kernels::cpu::math::simd_fn! { $(#[$m])* $vis fn $name($($arg: $ty),*) -> () $body }
    };
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($arg: $ty),*) -> $ret {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU has the features `fast` was compiled for.
                    return unsafe { fast($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

/// e^x for f32, relative error below 2e-7 on [-87, 88]; returns 0 below -87.3
/// (so exp(-inf) = 0, which masked softmax relies on).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln2 split in two so r = x - n·ln2 keeps its low bits.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let xc = x.clamp(-87.3, 88.3);
    // Round to nearest by the 1.5·2^23 trick: `round()` is a libm call on the
    // baseline target and would stop vectorization.
    const MAGIC: f32 = 12_582_912.0;
    let n = (xc * LOG2E + MAGIC) - MAGIC;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // Minimax polynomial for e^r on [-ln2/2, ln2/2] (Cephes expf).
    let p = 1.987_569_1e-4_f32;
    let p = p.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 5e-1);
    let y = (p * r).mul_add(r, r) + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let out = y * scale;
    if x < -87.3 {
        0.0
    } else {
        out
    }
}

/// tanh for f32 through exp: tanh(x) = 1 − 2 / (e^{2x} + 1), exact to a few ulp
/// away from 0; near 0 a short odd polynomial avoids the cancellation.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let ax = x.abs();
    let big = 1.0 - 2.0 / (exp(2.0 * ax) + 1.0);
    let x2 = x * x;
    // Taylor to x^9 is accurate to ~1e-8 for |x| < 0.1.
    let small =
        ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))));
    let t = if ax < 0.1 { small } else { big };
    t.copysign(x)
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_matches_libm() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let a = super::exp(x) as f64;
            let b = (x as f64).exp();
            worst = worst.max(((a - b) / b).abs());
            x += 0.001_3;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(super::exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(super::exp(-1000.0), 0.0);
    }

    #[test]
    fn tanh_matches_libm() {
        let mut worst = 0.0f64;
        let mut x = -12.0f32;
        while x < 12.0 {
            let a = super::tanh(x) as f64;
            let b = (x as f64).tanh();
            worst = worst.max((a - b).abs() / b.abs().max(1e-30));
            x += 0.000_77;
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        assert_eq!(super::tanh(0.0), 0.0);
    }
}
