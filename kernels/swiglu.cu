// SwiGLU, Llama's MLP activation: out = silu(gate)·up; twin of
// src/kernels/cpu/swiglu.rs. gate_up (N, 2H) floatX holds gate (columns 0..H)
// then up (H..2H) of each row; out (N, H). One thread per output element.
#include "common.cuh"

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

extern "C" __global__ void swiglu_forward(floatX* out, const floatX* gate_up, long long N, int H) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * H) return;
    long long r = i / H;
    int j = (int)(i % H);
    float g = ldx(gate_up[r * 2 * H + j]), u = ldx(gate_up[r * 2 * H + H + j]);
    out[i] = stx(g * sigmoidf_(g) * u);
}

// dgate_up (N, 2H) += ∂L/∂(gate, up) given dout (N, H).
extern "C" __global__ void swiglu_backward(floatX* dgate_up, const floatX* dout, const floatX* gate_up, long long N,
                                           int H) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * H) return;
    long long r = i / H;
    int j = (int)(i % H);
    size_t gi = (size_t)(r * 2 * H + j), ui = gi + H;
    float g = ldx(gate_up[gi]), u = ldx(gate_up[ui]), dy = ldx(dout[i]);
    float s = sigmoidf_(g);
    dgate_up[ui] = stx(ldx(dgate_up[ui]) + dy * (g * s));
    dgate_up[gi] = stx(ldx(dgate_up[gi]) + dy * u * (s * (1.0f + g * (1.0f - s))));
}
