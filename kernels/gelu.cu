// GELU in GPT-2's tanh form; twin of src/kernels/cpu/gelu.rs. Flat (n) buffers.
#include "common.cuh"

#define SQRT_2_OVER_PI 0.7978846f

extern "C" __global__ void gelu_forward(floatX* out, const floatX* inp, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = ldx(inp[i]);
    float u = SQRT_2_OVER_PI * (x + 0.044715f * x * x * x);
    out[i] = stx(0.5f * x * (1.0f + tanhf(u)));
}

// dinp = GELU'(inp)·dout, overwritten (the CPU model's gelu_backward_into with
// accumulate = false); dinp may alias dout.
extern "C" __global__ void gelu_backward(floatX* dinp, const floatX* inp, const floatX* dout, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = ldx(inp[i]);
    float u = SQRT_2_OVER_PI * (x + 0.044715f * x * x * x);
    float th = tanhf(u);
    float sech2 = 1.0f - th * th;
    float du = SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = stx((0.5f * (1.0f + th) + 0.5f * x * sech2 * du) * ldx(dout[i]));
}
