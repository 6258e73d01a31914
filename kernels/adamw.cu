// AdamW with PyTorch's semantics; twin of src/kernels/cpu/adamw.rs. master, m,
// v and grad are f32 (n); param (n) is the floatX copy the model computes with,
// written from the updated master weight. Scalars are formed on the host
// exactly as the CPU twin forms them.
#include "common.cuh"

extern "C" __global__ void adamw_update(float* master, floatX* param, const float* grad, float* m, float* v,
                                        long long n, float decay_factor, float one_minus_b1, float b2,
                                        float one_minus_b2, float step_size, float bc2_sqrt, float eps,
                                        float grad_scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = grad_scale == 1.0f ? grad[i] : grad[i] * grad_scale;
    float p = master[i] * decay_factor;
    float mi = m[i] + one_minus_b1 * (g - m[i]);
    float vi = v[i] * b2 + one_minus_b2 * g * g;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    p -= step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    param[i] = stx(p);
}
