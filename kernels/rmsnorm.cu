// RMSNorm over channels (Llama); twin of src/kernels/cpu/rmsnorm.rs.
// inp, out, dout, dinp are (N, C) floatX; weight (C) floatX; rstd (N) f32;
// dweight (C) f32. One warp per row. eps is the model's rms_norm_eps. The
// weight gradient is summed without atomics: per-chunk column sums, then the
// chunks in order. Per-head RMSNorm (Qwen3's q_norm, k_norm) follows below.
#include "common.cuh"

extern "C" __global__ void rmsnorm_forward(floatX* out, float* rstd, const floatX* inp, const floatX* weight,
                                           int N, int C, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= N) return;
    const floatX* x = inp + (size_t)row * C;
    float ss = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float v = ldx(x[i]);
        ss += v * v;
    }
    float s = 1.0f / sqrtf(warp_sum(ss) / C + eps);
    floatX* o = out + (size_t)row * C;
    // Hugging Face's order: normalise, then scale by the weight.
    for (int i = lane; i < C; i += 32) o[i] = stx(ldx(weight[i]) * (ldx(x[i]) * s));
    if (lane == 0) rstd[row] = s;
}

// dinp += ∂L/∂inp: with x̂ = x·s and g = dout·w, dx = s·(g − x̂·mean(g·x̂)).
extern "C" __global__ void rmsnorm_backward_input(floatX* dinp, const floatX* dout, const floatX* inp,
                                                  const floatX* weight, const float* rstd, int N, int C) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= N) return;
    const floatX* x = inp + (size_t)row * C;
    const floatX* dy = dout + (size_t)row * C;
    float s = rstd[row];
    float dot = 0.0f;
    for (int i = lane; i < C; i += 32) dot += ldx(dy[i]) * ldx(weight[i]) * (ldx(x[i]) * s);
    float mean_dot = warp_sum(dot) / C;
    floatX* dx = dinp + (size_t)row * C;
    for (int i = lane; i < C; i += 32) {
        float xhat = ldx(x[i]) * s;
        dx[i] = stx(ldx(dx[i]) + (ldx(dy[i]) * ldx(weight[i]) - xhat * mean_dot) * s);
    }
}

// Pass 1: partial[k, c] = Σ dout·x·rstd over rows [k·rows, (k+1)·rows); pass 2
// is matmul.cu's bias_backward_finish (the chunks summed in order).
// Grid (ceil(C / blockDim.x), chunks).
extern "C" __global__ void rmsnorm_backward_weight_partial(float* partial, const floatX* dout, const floatX* inp,
                                                           const float* rstd, int N, int C, int rows) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    int chunk = blockIdx.y;
    if (col >= C) return;
    int r0 = chunk * rows, r1 = min(N, r0 + rows);
    float sw = 0.0f;
    for (int r = r0; r < r1; r++) sw += ldx(dout[(size_t)r * C + col]) * (ldx(inp[(size_t)r * C + col]) * rstd[r]);
    partial[(size_t)chunk * C + col] = sw;
}

// Per-head RMSNorm (Qwen3's q_norm and k_norm): the same norm over each
// head-wide block of HS columns; twin of head_rmsnorm_* in
// src/kernels/cpu/rmsnorm.rs. inp, out, dout, dinp are (N, W) floatX, the
// run's `heads` blocks starting at head `first` (column first·HS) of each
// row; weight (HS) floatX, shared by every head; rstd (N, heads) f32;
// dweight (G, HS) f32, the run's heads in G equal consecutive groups. One
// warp per (row, head) block; only the run's columns are written.
extern "C" __global__ void head_rmsnorm_forward(floatX* out, float* rstd, const floatX* inp, const floatX* weight,
                                                int N, int W, int first, int heads, int HS, float eps) {
    int blk = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (blk >= N * heads) return;
    size_t at = (size_t)(blk / heads) * W + (size_t)(first + blk % heads) * HS;
    const floatX* x = inp + at;
    float ss = 0.0f;
    for (int i = lane; i < HS; i += 32) {
        float v = ldx(x[i]);
        ss += v * v;
    }
    float s = 1.0f / sqrtf(warp_sum(ss) / HS + eps);
    floatX* o = out + at;
    // Hugging Face's order: normalise, then scale by the weight.
    for (int i = lane; i < HS; i += 32) o[i] = stx(ldx(weight[i]) * (ldx(x[i]) * s));
    if (lane == 0) rstd[blk] = s;
}

// dinp += ∂L/∂inp per block: with x̂ = x·s and g = dout·w, dx = s·(g − x̂·mean(g·x̂)).
extern "C" __global__ void head_rmsnorm_backward_input(floatX* dinp, const floatX* dout, const floatX* inp,
                                                       const floatX* weight, const float* rstd, int N, int W,
                                                       int first, int heads, int HS) {
    int blk = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (blk >= N * heads) return;
    size_t at = (size_t)(blk / heads) * W + (size_t)(first + blk % heads) * HS;
    const floatX* x = inp + at;
    const floatX* dy = dout + at;
    float s = rstd[blk];
    float dot = 0.0f;
    for (int i = lane; i < HS; i += 32) dot += ldx(dy[i]) * ldx(weight[i]) * (ldx(x[i]) * s);
    float mean_dot = warp_sum(dot) / HS;
    floatX* dx = dinp + at;
    for (int i = lane; i < HS; i += 32) {
        float xhat = ldx(x[i]) * s;
        dx[i] = stx(ldx(dx[i]) + (ldx(dy[i]) * ldx(weight[i]) - xhat * mean_dot) * s);
    }
}

// Pass 1 of the weight gradient: partial[k, g, j] = Σ dout·x·rstd over rows
// [k·rows, (k+1)·rows) in order and, within a row, group g's heads in order;
// pass 2 is matmul.cu's bias_backward_finish over the G·HS columns (the
// chunks summed in order). No atomics. Grid (ceil(G·HS / blockDim.x), chunks).
extern "C" __global__ void head_rmsnorm_backward_weight_partial(float* partial, const floatX* dout,
                                                                const floatX* inp, const float* rstd, int N,
                                                                int W, int first, int heads, int HS, int G,
                                                                int rows) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    int chunk = blockIdx.y;
    if (col >= G * HS) return;
    int g = col / HS, j = col % HS, per = heads / G;
    int r0 = chunk * rows, r1 = min(N, r0 + rows);
    float sw = 0.0f;
    for (int r = r0; r < r1; r++) {
        for (int h = g * per; h < (g + 1) * per; h++) {
            size_t at = (size_t)r * W + (size_t)(first + h) * HS + j;
            sw += ldx(dout[at]) * (ldx(inp[at]) * rstd[(size_t)r * heads + h]);
        }
    }
    partial[(size_t)chunk * G * HS + col] = sw;
}
