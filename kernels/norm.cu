// Sums of squares of ranges of a flat f32 buffer (each tensor's share of the
// global gradient norm, squared), every range of a part in one launch of each
// kernel, deterministic: a fixed grid of blocks per range (blockIdx.y picks
// the range) writes one partial per block (each thread walks a fixed stride,
// each block sums in a fixed tree), then one block per range adds its
// partials in order. A range gets the bits it would get launched alone.
// Twin of adamw::sum_squares on the CPU.
#include "common.cuh"

// ranges: (first element, length) of range y at [2y], [2y + 1].
extern "C" __global__ void global_norm_partial(float* partial, const float* base,
                                               const unsigned long long* ranges) {
    __shared__ float shared[32];
    const float* x = base + ranges[2 * blockIdx.y];
    long long n = (long long)ranges[2 * blockIdx.y + 1];
    float s = 0.0f;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) s += x[i] * x[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) partial[(long long)blockIdx.y * gridDim.x + blockIdx.x] = s;
}

// out[r] = Σ partial[r·count .. (r + 1)·count], in order; block r, range r.
extern "C" __global__ void global_norm_finish(float* out, const float* partial, int count) {
    __shared__ float shared[32];
    const float* p = partial + (long long)blockIdx.x * count;
    float s = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) s += p[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// out (n) = a + b, all f32: the tied embedding's two gradient shares, summed
// in the one order every layout uses (embedding share + head share).
extern "C" __global__ void add_f32(float* out, const float* a, const float* b, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
