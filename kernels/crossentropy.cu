// Fused softmax + cross-entropy with its gradient; twin of
// src/kernels/cpu/crossentropy.rs. logits is (N, Vp) floatX, of which the
// first V columns are real and the rest padding (the vocabulary rounded up
// for the matrix products): padding never enters the softmax and gets a zero
// gradient, so it is never predicted. targets (N) u32; losses (N) f32.
// One block per row; logits are overwritten by dlogits = (softmax − onehot)·dloss.
#include "common.cuh"

extern "C" __global__ void crossentropy_forward_backward(floatX* logits, float* losses, const unsigned int* targets,
                                                         float dloss, int N, int V, int Vp) {
    __shared__ float shared[32];
    int row = blockIdx.x;
    if (row >= N) return;
    floatX* x = logits + (size_t)row * Vp;
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, ldx(x[i]));
    mx = block_max(mx, shared);
    float s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(ldx(x[i]) - mx);
    s = block_sum(s, shared);
    float lse = mx + logf(s);
    unsigned int target = targets[row];
    if (threadIdx.x == 0) {
        // The launcher checks targets; a bad one still must not read out of the row.
        losses[row] = target < (unsigned int)V ? lse - ldx(x[target]) : __int_as_float(0x7fc00000);
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
