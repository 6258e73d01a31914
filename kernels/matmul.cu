// The part of a linear layer cuBLASLt does not do for us: the bias gradient,
// dbias (OC) f32 += Σ_rows dout (N, OC), without atomics (per-chunk column
// sums, then the chunks in order). Twin of matmul::column_sum_accumulate.
#include "common.cuh"

// Grid (ceil(OC / blockDim.x), chunks); chunk k sums rows [k·rows, (k+1)·rows).
extern "C" __global__ void bias_backward_partial(float* partial, const floatX* dout, int N, int OC, int ld, int rows) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= OC) return;
    int chunk = blockIdx.y;
    int r0 = chunk * rows, r1 = min(N, r0 + rows);
    float s = 0.0f;
    for (int r = r0; r < r1; r++) s += ldx(dout[(size_t)r * ld + col]);
    partial[(size_t)chunk * OC + col] = s;
}

extern "C" __global__ void bias_backward_finish(float* dbias, const float* partial, int chunks, int OC) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= OC) return;
    float s = 0.0f;
    for (int k = 0; k < chunks; k++) s += partial[(size_t)k * OC + col];
    dbias[col] += s;
}
