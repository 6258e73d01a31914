// Causal attention with grouped-query heads, fused and flash-style (online
// softmax: no T×T matrix in memory); twin of src/kernels/cpu/attention.rs.
//
// NKV key/value heads each serve NH / NKV query heads (NKV = NH: GPT-2's
// multi-head attention). qkv is (B, T, W) floatX, W = (NH + 2·NKV)·HS, with
// query head h at column h·HS, key head g at C + g·HS and value head g at
// C + NKV·HS + g·HS, where C = NH·HS; query head h uses key/value head
// h / (NH / NKV). out is (B, T, C); lse is (B, NH, T) f32, the log-sum-exp of
// each query's scaled scores, saved so backward recomputes probabilities.
// HS = 64 (every GPT-2 size): the launcher refuses other head sizes.
//
// WIN is the attention window: query i sees key j when i − WIN < j ≤ i
// (Hugging Face's sliding window; src/kernels/cpu/attention.rs says where
// the rule comes from). The launcher passes WIN = T for plain causal
// attention, where the window test always holds and the tiles walked are
// those of causal attention. A block starts at the key tile holding its first
// query's first key; a row skips the tiles wholly before its own window.
//
// Each row (a query, or a key in backward) is held by a pair of adjacent
// threads, each owning the 32 interleaved dims 2k + half, so the two threads
// of a pair read neighbouring shared-memory banks. Backward runs without
// atomics: one kernel owns dq per query, another owns dk, dv per key of a
// key/value head, summing over the head's query group in order.
#include "common.cuh"

#define HS 64
#define HALF 32
#define ROWS 64   // rows per block: 128 threads
#define TILE 32   // keys (forward, dq) or queries (dk, dv) per shared tile
#define SCALE 0.125f  // 1/√HS, a power of two: scaling is exact

__device__ __forceinline__ unsigned int pair_mask() {
    return 3u << ((threadIdx.x & 31) & ~1u);
}

__device__ __forceinline__ float pair_sum(float v) {
    return v + __shfl_xor_sync(pair_mask(), v, 1);
}

// Grid (ceil(T / ROWS), NH, B), block 2·ROWS.
extern "C" __global__ void __launch_bounds__(2 * ROWS) attention_forward(floatX* out, float* lse, const floatX* qkv,
                                                                        int B, int T, int NH, int NKV, int WIN) {
    __shared__ float ks[TILE][HS];
    __shared__ float vs[TILE][HS];
    int C = NH * HS, C3 = (NH + 2 * NKV) * HS;
    int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * ROWS;
    int kcol = C + (h / (NH / NKV)) * HS, vcol = kcol + NKV * HS;
    int half = threadIdx.x & 1;
    int i = q0 + (threadIdx.x >> 1);
    bool valid = i < T;
    float q[HALF], acc[HALF];
    const floatX* qrow = qkv + (size_t)(b * T + (valid ? i : 0)) * C3 + h * HS;
#pragma unroll
    for (int k = 0; k < HALF; k++) {
        q[k] = valid ? ldx(qrow[2 * k + half]) * SCALE : 0.0f;
        acc[k] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    int lo = max(0, i - WIN + 1);  // this row's first key
    int kend = min(T, q0 + ROWS);
    for (int k0 = max(0, q0 - WIN + 1) / TILE * TILE; k0 < kend; k0 += TILE) {
        __syncthreads();
        for (int e = threadIdx.x; e < TILE * HS; e += blockDim.x) {
            int jr = e / HS, d = e % HS, j = k0 + jr;
            float kv = 0.0f, vv = 0.0f;
            if (j < T) {
                const floatX* base = qkv + (size_t)(b * T + j) * C3 + d;
                kv = ldx(base[kcol]);
                vv = ldx(base[vcol]);
            }
            ks[jr][d] = kv;
            vs[jr][d] = vv;
        }
        __syncthreads();
        // Every tile a row visits holds at least one of its keys, so its
        // running max is finite after its first tile.
        if (!valid || k0 > i || k0 + TILE <= lo) continue;
        float s[TILE];
        float tmax = NEG_INF;
#pragma unroll
        for (int jr = 0; jr < TILE; jr++) {
            float d = 0.0f;
#pragma unroll
            for (int k = 0; k < HALF; k++) d += q[k] * ks[jr][2 * k + half];
            d = pair_sum(d);
            s[jr] = (k0 + jr <= i && k0 + jr >= lo) ? d : NEG_INF;
            tmax = fmaxf(tmax, s[jr]);
        }
        float mnew = fmaxf(m, tmax);
        float corr = expf(m - mnew);
        l *= corr;
#pragma unroll
        for (int k = 0; k < HALF; k++) acc[k] *= corr;
#pragma unroll
        for (int jr = 0; jr < TILE; jr++) {
            float p = expf(s[jr] - mnew);
            l += p;
#pragma unroll
            for (int k = 0; k < HALF; k++) acc[k] += p * vs[jr][2 * k + half];
        }
        m = mnew;
    }
    if (!valid) return;
    floatX* orow = out + (size_t)(b * T + i) * C + h * HS;
    float inv = 1.0f / l;
#pragma unroll
    for (int k = 0; k < HALF; k++) orow[2 * k + half] = stx(acc[k] * inv);
    if (half == 0) lse[(size_t)(b * NH + h) * T + i] = m + logf(l);
}

// delta[b, h, i] = Σ_d dout·out over the head's dims: the softmax backward's
// row term. Grid ceil(B·NH·T / blockDim.x).
extern "C" __global__ void attention_backward_delta(float* delta, const floatX* dout, const floatX* out, int B, int T,
                                                    int NH) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * NH * T) return;
    int i = idx % T, h = (idx / T) % NH, b = idx / (T * NH);
    int C = NH * HS;
    const floatX* o = out + (size_t)(b * T + i) * C + h * HS;
    const floatX* d = dout + (size_t)(b * T + i) * C + h * HS;
    float s = 0.0f;
    for (int k = 0; k < HS; k++) s += ldx(d[k]) * ldx(o[k]);
    delta[idx] = s;
}

// dq for each query; writes (not accumulates) the q columns of dqkv.
// Grid (ceil(T / ROWS), NH, B), block 2·ROWS.
extern "C" __global__ void __launch_bounds__(2 * ROWS) attention_backward_dq(floatX* dqkv, const floatX* dout,
                                                                            const floatX* qkv, const float* lse,
                                                                            const float* delta, int B, int T, int NH,
                                                                            int NKV, int WIN) {
    __shared__ float ks[TILE][HS];
    __shared__ float vs[TILE][HS];
    int C = NH * HS, C3 = (NH + 2 * NKV) * HS;
    int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * ROWS;
    int kcol = C + (h / (NH / NKV)) * HS, vcol = kcol + NKV * HS;
    int half = threadIdx.x & 1;
    int i = q0 + (threadIdx.x >> 1);
    bool valid = i < T;
    int ic = valid ? i : 0;
    float q[HALF], dO[HALF], dq[HALF];
    const floatX* qrow = qkv + (size_t)(b * T + ic) * C3 + h * HS;
    const floatX* drow = dout + (size_t)(b * T + ic) * C + h * HS;
#pragma unroll
    for (int k = 0; k < HALF; k++) {
        q[k] = ldx(qrow[2 * k + half]) * SCALE;
        dO[k] = ldx(drow[2 * k + half]);
        dq[k] = 0.0f;
    }
    size_t row = (size_t)(b * NH + h) * T + ic;
    float L = lse[row], D = delta[row];
    int lo = max(0, i - WIN + 1);
    int kend = min(T, q0 + ROWS);
    for (int k0 = max(0, q0 - WIN + 1) / TILE * TILE; k0 < kend; k0 += TILE) {
        __syncthreads();
        for (int e = threadIdx.x; e < TILE * HS; e += blockDim.x) {
            int jr = e / HS, d = e % HS, j = k0 + jr;
            float kv = 0.0f, vv = 0.0f;
            if (j < T) {
                const floatX* base = qkv + (size_t)(b * T + j) * C3 + d;
                kv = ldx(base[kcol]);
                vv = ldx(base[vcol]);
            }
            ks[jr][d] = kv;
            vs[jr][d] = vv;
        }
        __syncthreads();
        if (!valid || k0 > i || k0 + TILE <= lo) continue;
#pragma unroll 4
        for (int jr = 0; jr < TILE; jr++) {
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int k = 0; k < HALF; k++) {
                s += q[k] * ks[jr][2 * k + half];
                dp += dO[k] * vs[jr][2 * k + half];
            }
            s = pair_sum(s);
            dp = pair_sum(dp);
            float p = (k0 + jr <= i && k0 + jr >= lo) ? expf(s - L) : 0.0f;
            float ds = p * (dp - D);
#pragma unroll
            for (int k = 0; k < HALF; k++) dq[k] += ds * ks[jr][2 * k + half];
        }
    }
    if (!valid) return;
    floatX* out = dqkv + (size_t)(b * T + i) * C3 + h * HS;
#pragma unroll
    for (int k = 0; k < HALF; k++) out[2 * k + half] = stx(dq[k] * SCALE);
}

// dk and dv for each key of key/value head g, summed over g's query heads in
// head order; writes (not accumulates) the k and v columns of dqkv.
// Grid (ceil(T / ROWS), NKV, B), block 2·ROWS.
extern "C" __global__ void __launch_bounds__(2 * ROWS) attention_backward_dkdv(floatX* dqkv, const floatX* dout,
                                                                              const floatX* qkv, const float* lse,
                                                                              const float* delta, int B, int T,
                                                                              int NH, int NKV, int WIN) {
    __shared__ float qs[TILE][HS];
    __shared__ float dos[TILE][HS];
    __shared__ float ls[TILE], ds_[TILE];
    int C = NH * HS, C3 = (NH + 2 * NKV) * HS, group = NH / NKV;
    int b = blockIdx.z, g = blockIdx.y, j0 = blockIdx.x * ROWS;
    int kcol = C + g * HS, vcol = kcol + NKV * HS;
    int half = threadIdx.x & 1;
    int j = j0 + (threadIdx.x >> 1);
    bool valid = j < T;
    int jc = valid ? j : 0;
    float k_[HALF], v_[HALF], dk[HALF], dv[HALF];
    const floatX* krow = qkv + (size_t)(b * T + jc) * C3;
#pragma unroll
    for (int k = 0; k < HALF; k++) {
        k_[k] = ldx(krow[kcol + 2 * k + half]);
        v_[k] = ldx(krow[vcol + 2 * k + half]);
        dk[k] = 0.0f;
        dv[k] = 0.0f;
    }
    // Queries before the block's first key, or past its last key's window,
    // see none of its keys.
    int iend = min(T, j0 + ROWS - 1 + WIN);
    for (int h = g * group; h < (g + 1) * group; h++) {
        for (int i0 = (j0 / TILE) * TILE; i0 < iend; i0 += TILE) {
            __syncthreads();
            for (int e = threadIdx.x; e < TILE * HS; e += blockDim.x) {
                int ir = e / HS, d = e % HS, i = i0 + ir;
                float qv = 0.0f, dv_ = 0.0f;
                if (i < T) {
                    qv = ldx(qkv[(size_t)(b * T + i) * C3 + h * HS + d]) * SCALE;
                    dv_ = ldx(dout[(size_t)(b * T + i) * C + h * HS + d]);
                }
                qs[ir][d] = qv;
                dos[ir][d] = dv_;
            }
            for (int ir = threadIdx.x; ir < TILE; ir += blockDim.x) {
                int i = i0 + ir;
                size_t row = (size_t)(b * NH + h) * T + (i < T ? i : 0);
                ls[ir] = lse[row];
                ds_[ir] = delta[row];
            }
            __syncthreads();
            if (!valid || i0 + TILE - 1 < j || i0 >= j + WIN) continue;
#pragma unroll 4
            for (int ir = 0; ir < TILE; ir++) {
                int i = i0 + ir;
                float s = 0.0f, dp = 0.0f;
#pragma unroll
                for (int k = 0; k < HALF; k++) {
                    s += qs[ir][2 * k + half] * k_[k];
                    dp += dos[ir][2 * k + half] * v_[k];
                }
                s = pair_sum(s);
                dp = pair_sum(dp);
                float p = (j <= i && i < T && i - j < WIN) ? expf(s - ls[ir]) : 0.0f;
                float dsc = p * (dp - ds_[ir]);
#pragma unroll
                for (int k = 0; k < HALF; k++) {
                    dv[k] += p * dos[ir][2 * k + half];
                    dk[k] += dsc * qs[ir][2 * k + half];
                }
            }
        }
    }
    if (!valid) return;
    floatX* out = dqkv + (size_t)(b * T + j) * C3;
#pragma unroll
    for (int k = 0; k < HALF; k++) {
        out[kcol + 2 * k + half] = stx(dk[k]);
        out[vcol + 2 * k + half] = stx(dv[k]);
    }
}
