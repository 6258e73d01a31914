// Shared by every kernels/*.cu: the storage type, its conversions and
// fixed-order reductions. Compiled by NVRTC at run time (src/kernels/cuda/nvrtc.rs
// hands this file over as the header "common.cuh"), so it uses no system header.
//
// floatX is bf16, kept as its 16 bits so no toolkit header is needed; defining
// PW_F32 makes it f32, the path the tests compare bit-for-bit-ish with the CPU.
// Arithmetic is always f32.
#pragma once

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even, as PyTorch and cuda_bf16.h do; NaN stays NaN.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

#ifdef PW_F32
typedef float floatX;
__device__ __forceinline__ float ldx(float x) { return x; }
__device__ __forceinline__ float stx(float x) { return x; }
#else
typedef unsigned short floatX;
__device__ __forceinline__ float ldx(unsigned short x) { return bf16_to_f32(x); }
__device__ __forceinline__ unsigned short stx(float x) { return f32_to_bf16(x); }
#endif

#define NEG_INF __int_as_float(0xff800000)

// Butterfly sums: lanes i and i^o add the same two numbers, so every lane ends
// with the same bits, run after run.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block in a fixed tree (blockDim.x a multiple of 32); every
// thread gets the total. `shared` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nwarps ? shared[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nwarps ? shared[lane] : NEG_INF;
    return warp_max(v);
}
