// Joins a tensor-parallel stage's partial sums: the pairwise tree over `count`
// f32 nodes (contiguous, count × len), element by element, in the order of
// tree_sum in src/kernels/cpu/tree.rs (step 1, 2, 4…: node[i] += node[i + step]),
// so a GPU join has the CPU's bits whatever the layout. Every add is
// __fadd_rn: one rounding each, never fused or reordered by the compiler.
#include "common.cuh"

// Unrolled per count so the nodes stay in registers (a runtime-sized array
// would spill to local memory).
template <int N>
__device__ __forceinline__ float tree_of(const float* nodes, long long len, long long e) {
    float v[N];
#pragma unroll
    for (int j = 0; j < N; j++) v[j] = nodes[j * len + e];
#pragma unroll
    for (int step = 1; step < N; step *= 2) {
#pragma unroll
        for (int i = 0; i + step < N; i += 2 * step) v[i] = __fadd_rn(v[i], v[i + step]);
    }
    return v[0];
}

// The launcher (src/kernels/cuda/tree.rs) refuses any other count.
__device__ __forceinline__ float tree_at(const float* nodes, int count, long long len, long long e) {
    switch (count) {
        case 1: return tree_of<1>(nodes, len, e);
        case 2: return tree_of<2>(nodes, len, e);
        case 4: return tree_of<4>(nodes, len, e);
        case 8: return tree_of<8>(nodes, len, e);
        case 16: return tree_of<16>(nodes, len, e);
        case 32: return tree_of<32>(nodes, len, e);
        default: return tree_of<64>(nodes, len, e);
    }
}

// out (len, floatX) = X(tree), or with a residual X(f32(X(tree)) + residual),
// the sum rounded to storage first exactly as a residual_forward after a
// separate join would. Each thread reads its element of every node and of the
// residual before writing its own out, so out may be node 0 (f32 storage) or
// the residual.
extern "C" __global__ void tree_join(floatX* out, const float* nodes, int count, long long len,
                                     const floatX* residual) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= len) return;
    floatX v = stx(tree_at(nodes, count, len, e));
    out[e] = residual ? stx(__fadd_rn(ldx(v), ldx(residual[e]))) : v;
}
