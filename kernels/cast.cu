// Casts between f32 and bf16 (stored as 16 bits), flat (n) buffers.
#include "common.cuh"

extern "C" __global__ void cast_f32_to_bf16(unsigned short* out, const float* inp, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(inp[i]);
}

extern "C" __global__ void cast_bf16_to_f32(float* out, const unsigned short* inp, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16_to_f32(inp[i]);
}
