// Residual add; twin of src/kernels/cpu/residual.rs. out = a + b, flat (n); out may alias a.
#include "common.cuh"

extern "C" __global__ void residual_forward(floatX* out, const floatX* a, const floatX* b, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = stx(ldx(a[i]) + ldx(b[i]));
}
