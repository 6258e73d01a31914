// Fused softmax + cross-entropy with its gradient; twin of
// src/kernels/cpu/crossentropy.rs. logits is (N, Vp) floatX, of which the
// first V columns are real and the rest padding (the vocabulary rounded up
// for the matrix products): padding never enters the softmax and gets a zero
// gradient, so it is never predicted. targets (N) u32; losses (N) f32.
// One block per row; logits are overwritten by dlogits = (softmax − onehot)·dloss.
#include "common.cuh"

// The exponential sum runs in double: at V = 50 257 a peaked row's terms
// (≈ 1e-8 beside the max's 1) fall below half a float ulp of the running sum
// and were dropped, reading the loss low. Same fixed tree as block_sum, so the
// bits stay the same run after run. `shared` holds 32 doubles.
__device__ __forceinline__ double block_sum_f64(double v, double* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nwarps ? shared[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void crossentropy_forward_backward(floatX* logits, float* losses, const unsigned int* targets,
                                                         float dloss, int N, int V, int Vp) {
    __shared__ float shared[32];
    __shared__ double shared64[32];
    int row = blockIdx.x;
    if (row >= N) return;
    floatX* x = logits + (size_t)row * Vp;
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, ldx(x[i]));
    mx = block_max(mx, shared);
    double s = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) s += (double)expf(ldx(x[i]) - mx);
    s = block_sum_f64(s, shared64);
    double lse64 = (double)mx + log(s);
    float lse = (float)lse64;
    unsigned int target = targets[row];
    if (threadIdx.x == 0) {
        // The launcher checks targets; a bad one still must not read out of the row.
        losses[row] = target < (unsigned int)V ? (float)(lse64 - (double)ldx(x[target])) : __int_as_float(0x7fc00000);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < Vp; i += blockDim.x) {
        float g = 0.0f;
        if (i < V) {
            g = expf(ldx(x[i]) - lse) * dloss;
            if ((unsigned int)i == target) g -= dloss;
        }
        x[i] = stx(g);
    }
}

// (value, column) pairs reduced over a warp in a fixed tree; equal values keep
// the lower column, so every lane ends with the first column of the maximum.
__device__ __forceinline__ void warp_argmax(float& v, int& at) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, at, o);
        if (ov > v || (ov == v && oi < at)) {
            v = ov;
            at = oi;
        }
    }
}

// Forward only (evaluation): losses (N) and, when argmax is not null, each
// row's prediction — the first column holding the row's maximum, the CPU
// twin's tie rule. Padding columns never take part.
extern "C" __global__ void crossentropy_forward(const floatX* logits, float* losses, unsigned int* argmax,
                                                const unsigned int* targets, int N, int V, int Vp) {
    __shared__ double shared64[32];
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    int row = blockIdx.x;
    if (row >= N) return;
    const floatX* x = logits + (size_t)row * Vp;
    float mx = NEG_INF;
    int at = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float xi = ldx(x[i]);
        // Each thread walks its columns upwards, so a strict > keeps its first maximum.
        if (xi > mx) {
            mx = xi;
            at = i;
        }
    }
    warp_argmax(mx, at);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (lane == 0) {
        best_v[warp] = mx;
        best_i[warp] = at;
    }
    __syncthreads();
    mx = lane < nwarps ? best_v[lane] : NEG_INF;
    at = lane < nwarps ? best_i[lane] : 0x7fffffff;
    warp_argmax(mx, at);
    double s = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) s += (double)expf(ldx(x[i]) - mx);
    s = block_sum_f64(s, shared64);
    if (threadIdx.x == 0) {
        unsigned int target = targets[row];
        losses[row] = target < (unsigned int)V ? (float)((double)mx + log(s) - (double)ldx(x[target]))
                                               : __int_as_float(0x7fc00000);
        if (argmax) argmax[row] = (unsigned int)at;
    }
}
