// AdamW with PyTorch's semantics; twin of src/kernels/cpu/adamw.rs. master, m,
// v and grad are f32; param is the floatX copy the model computes with,
// written from the updated master weight. Scalars are formed on the host
// exactly as the CPU twin forms them.
//
// Every tensor of a part in one launch: block b updates one run of at most a
// few thousand consecutive elements, runs[2b] its first element and
// runs[2b + 1] its length (low 32 bits) and whether its tensor decays (bit
// 32). Each element's arithmetic is the one-tensor update's, so the
// partition into runs changes no bit.
#include "common.cuh"

extern "C" __global__ void adamw_update(float* master, floatX* param, const float* grad, float* m, float* v,
                                        const unsigned long long* runs, float decay_factor,
                                        float one_minus_b1, float b2, float one_minus_b2, float step_size,
                                        float bc2_sqrt, float eps, float grad_scale) {
    unsigned long long first = runs[2 * blockIdx.x], word = runs[2 * blockIdx.x + 1];
    long long n = (long long)(word & 0xffffffffull);
    float keep = (word >> 32) ? decay_factor : 1.0f;
    for (long long k = threadIdx.x; k < n; k += blockDim.x) {
        long long i = (long long)first + k;
        float g = grad_scale == 1.0f ? grad[i] : grad[i] * grad_scale;
        float p = master[i] * keep;
        float mi = m[i] + one_minus_b1 * (g - m[i]);
        float vi = v[i] * b2 + one_minus_b2 * g * g;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p -= step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
        master[i] = p;
        param[i] = stx(p);
    }
}
