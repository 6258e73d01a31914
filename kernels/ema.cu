// The EMA of the weights; twin of src/kernels/cpu/ema.rs (PyTorch's
// AveragedModel with get_ema_multi_avg_fn: ATen's lerp, rounded as its
// vectorized CPU kernel rounds it). ema and param are f32 (n), param the
// master weights: ema <- lerp(ema, param, weight).
//
// Spelled with __fsub_rn and __fmaf_rn so each rounds once, exactly where the
// twin's `end - start` and `mul_add` do: NVRTC contracts a plain `a * b + c`
// into an fma by default (--fmad=true) and the emulator's compiler does not
// (-ffp-contract=off), so a plain spelling would give the GPU and the
// emulator different bits; the intrinsics are never fused nor split.
#include "common.cuh"

extern "C" __global__ void ema_update(float* ema, const float* param, long long n, float weight) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float start = ema[i], end = param[i];
    float diff = __fsub_rn(end, start);
    // |w| < 0.5: fma(w, diff, start); else fma(w - 1, diff, end) (w - 1 exact for w in [0.5, 1]).
    ema[i] = fabsf(weight) < 0.5f ? __fmaf_rn(weight, diff, start) : __fmaf_rn(weight - 1.0f, diff, end);
}
