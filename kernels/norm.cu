// Sum of squares of a flat f32 buffer (the global gradient norm, squared),
// deterministic: a fixed grid writes one partial per block (each thread walks
// a fixed stride, each block sums in a fixed tree), then one block adds the
// partials in order. Twin of adamw::sum_squares on the CPU.
#include "common.cuh"

extern "C" __global__ void global_norm_partial(float* partial, const float* x, long long n) {
    __shared__ float shared[32];
    float s = 0.0f;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) s += x[i] * x[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// out[0] = Σ partial[0..count]; one block.
extern "C" __global__ void global_norm_finish(float* out, const float* partial, int count) {
    __shared__ float shared[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) out[0] = s;
}

// out (n) = a + b, all f32: the tied embedding's two gradient shares, summed
// in the one order every layout uses (embedding share + head share).
extern "C" __global__ void add_f32(float* out, const float* a, const float* b, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
