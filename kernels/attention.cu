// Causal attention with grouped-query heads, fused and flash-style (online
// softmax: no T×T matrix in memory); twin of src/kernels/cpu/attention.rs.
//
// NKV key/value heads each serve NH / NKV query heads (NKV = NH: GPT-2's
// multi-head attention). qkv is (B, T, W) floatX, W = (NH + 2·NKV)·HS, with
// query head h at column h·HS, key head g at C + g·HS and value head g at
// C + NKV·HS + g·HS, where C = NH·HS; query head h uses key/value head
// h / (NH / NKV). out is (B, T, C); lse is (B, NH, T) f32, the log-sum-exp of
// each query's scaled scores, saved so backward recomputes probabilities.
// One kernel per head size HS (16, 32, 64, 80, 96, 128, 256: the `_hsN`
// wrappers at the end); the launcher refuses others.
//
// WIN is the attention window: query i sees key j when i − WIN < j ≤ i
// (Hugging Face's sliding window; src/kernels/cpu/attention.rs says where
// the rule comes from). The launcher passes WIN = T for plain causal
// attention, where the window test always holds and the tiles walked are
// those of causal attention. A block starts at the key tile holding its first
// query's first key; a row skips the tiles wholly before its own window.
//
// Each row (a query, or a key in backward) is held by TPR adjacent threads
// (2 up to HS 64, 4 up to 128, 8 at 256; a block holds 64 rows, 32 at 256), thread `part` owning the PER =
// HS / TPR interleaved dims TPR·k + part, so the threads of a row read
// neighbouring shared-memory banks and each holds at most 32 dims whatever
// the head size (the registers of HS 64, whose kernels and bits are those of
// the single-size kernel before: TPR 2, dims 2k + half). A row's partial dot
// products are summed across its TPR lanes by a butterfly, the same bits on
// each. Backward runs without atomics: one kernel owns dq per query, another
// owns dk, dv per key of a key/value head, summing over the head's query
// group in order.
//
// Every access is a scalar floatX or float (no vector loads), so any head
// size, 80 and 96 included, is aligned by construction. The tiles live in
// dynamic shared memory (the launcher's bytes: 2·TILE·HS floats, and 2·TILE
// more in dk/dv), one array for every head size's kernels: under 48 KiB at
// every size (TILE 16 at HS 256), so no opt-in is needed.
#include "common.cuh"

// The shape of one head size's kernels (the launcher, src/kernels/cuda/attention.rs
// `CudaCoreShape`, has the same table). At most 32 dims per thread keeps HS
// 80 to 256 at HS 64's registers; 256 threads, where a row needs 8, leave
// each thread the 255 registers a 128-thread block's have (512 would cap
// them at 128 and spill).
template <int HS>
struct Shape {
    static constexpr int TPR = HS <= 64 ? 2 : HS <= 128 ? 4 : 8;  // threads per row
    static constexpr int PER = HS / TPR;                            // dims per thread
    static constexpr int ROWS = HS <= 128 ? 64 : 32;                // rows per block: ROWS·TPR threads
    static constexpr int TILE = HS <= 128 ? 32 : 16;  // keys (forward, dq) or queries (dk, dv) per tile
    static_assert(HS % TPR == 0 && PER <= 32, "a head size the row layout covers");
};

extern __shared__ __align__(16) float attention_shared[];

// The lanes holding this thread's row: TPR adjacent lanes.
template <int TPR>
__device__ __forceinline__ unsigned int row_mask() {
    return ((1u << TPR) - 1u) << ((threadIdx.x & 31) & ~(unsigned int)(TPR - 1));
}

// Sum over a row's TPR lanes, butterfly: every lane ends with the same bits.
template <int TPR>
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
    for (int o = 1; o < TPR; o <<= 1) v += __shfl_xor_sync(row_mask<TPR>(), v, o);
    return v;
}

// Grid (ceil(T / ROWS), NH, B), block ROWS·TPR.
template <int HS>
__device__ __forceinline__ void attention_forward(floatX* out, float* lse, const floatX* qkv, int T, int NH,
                                                  int NKV, int WIN) {
    constexpr int TPR = Shape<HS>::TPR, PER = Shape<HS>::PER, TILE = Shape<HS>::TILE, ROWS = Shape<HS>::ROWS;
    float(*ks)[HS] = reinterpret_cast<float(*)[HS]>(attention_shared);
    float(*vs)[HS] = reinterpret_cast<float(*)[HS]>(attention_shared + TILE * HS);
    const float scale = 1.0f / sqrtf((float)HS);  // the CPU's 1/√HS (exactly 0.125 at 64)
    int C = NH * HS, C3 = (NH + 2 * NKV) * HS;
    int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * ROWS;
    int kcol = C + (h / (NH / NKV)) * HS, vcol = kcol + NKV * HS;
    int half = threadIdx.x & (TPR - 1);
    int i = q0 + (threadIdx.x / TPR);
    bool valid = i < T;
    float q[PER], acc[PER];
    const floatX* qrow = qkv + (size_t)(b * T + (valid ? i : 0)) * C3 + h * HS;
#pragma unroll
    for (int k = 0; k < PER; k++) {
        q[k] = valid ? ldx(qrow[TPR * k + half]) * scale : 0.0f;
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
            for (int k = 0; k < PER; k++) d += q[k] * ks[jr][TPR * k + half];
            d = row_sum<TPR>(d);
            s[jr] = (k0 + jr <= i && k0 + jr >= lo) ? d : NEG_INF;
            tmax = fmaxf(tmax, s[jr]);
        }
        float mnew = fmaxf(m, tmax);
        float corr = expf(m - mnew);
        l *= corr;
#pragma unroll
        for (int k = 0; k < PER; k++) acc[k] *= corr;
#pragma unroll
        for (int jr = 0; jr < TILE; jr++) {
            float p = expf(s[jr] - mnew);
            l += p;
#pragma unroll
            for (int k = 0; k < PER; k++) acc[k] += p * vs[jr][TPR * k + half];
        }
        m = mnew;
    }
    if (!valid) return;
    floatX* orow = out + (size_t)(b * T + i) * C + h * HS;
    float inv = 1.0f / l;
#pragma unroll
    for (int k = 0; k < PER; k++) orow[TPR * k + half] = stx(acc[k] * inv);
    if (half == 0) lse[(size_t)(b * NH + h) * T + i] = m + logf(l);
}

// delta[b, h, i] = Σ_d dout·out over the head's HS dims, in d order: the
// softmax backward's row term. Grid ceil(B·NH·T / blockDim.x).
extern "C" __global__ void attention_backward_delta(float* delta, const floatX* dout, const floatX* out, int B, int T,
                                                    int NH, int HS) {
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
// Grid (ceil(T / ROWS), NH, B), block ROWS·TPR.
template <int HS>
__device__ __forceinline__ void attention_backward_dq(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                      const float* lse, const float* delta, int T, int NH, int NKV,
                                                      int WIN) {
    constexpr int TPR = Shape<HS>::TPR, PER = Shape<HS>::PER, TILE = Shape<HS>::TILE, ROWS = Shape<HS>::ROWS;
    float(*ks)[HS] = reinterpret_cast<float(*)[HS]>(attention_shared);
    float(*vs)[HS] = reinterpret_cast<float(*)[HS]>(attention_shared + TILE * HS);
    const float scale = 1.0f / sqrtf((float)HS);
    int C = NH * HS, C3 = (NH + 2 * NKV) * HS;
    int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * ROWS;
    int kcol = C + (h / (NH / NKV)) * HS, vcol = kcol + NKV * HS;
    int half = threadIdx.x & (TPR - 1);
    int i = q0 + (threadIdx.x / TPR);
    bool valid = i < T;
    int ic = valid ? i : 0;
    float q[PER], dO[PER], dq[PER];
    const floatX* qrow = qkv + (size_t)(b * T + ic) * C3 + h * HS;
    const floatX* drow = dout + (size_t)(b * T + ic) * C + h * HS;
#pragma unroll
    for (int k = 0; k < PER; k++) {
        q[k] = ldx(qrow[TPR * k + half]) * scale;
        dO[k] = ldx(drow[TPR * k + half]);
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
            for (int k = 0; k < PER; k++) {
                s += q[k] * ks[jr][TPR * k + half];
                dp += dO[k] * vs[jr][TPR * k + half];
            }
            s = row_sum<TPR>(s);
            dp = row_sum<TPR>(dp);
            float p = (k0 + jr <= i && k0 + jr >= lo) ? expf(s - L) : 0.0f;
            float ds = p * (dp - D);
#pragma unroll
            for (int k = 0; k < PER; k++) dq[k] += ds * ks[jr][TPR * k + half];
        }
    }
    if (!valid) return;
    floatX* out = dqkv + (size_t)(b * T + i) * C3 + h * HS;
#pragma unroll
    for (int k = 0; k < PER; k++) out[TPR * k + half] = stx(dq[k] * scale);
}

// dk and dv for each key of key/value head g, summed over g's query heads in
// head order; writes (not accumulates) the k and v columns of dqkv.
// Grid (ceil(T / ROWS), NKV, B), block ROWS·TPR.
template <int HS>
__device__ __forceinline__ void attention_backward_dkdv(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                        const float* lse, const float* delta, int T, int NH,
                                                        int NKV, int WIN) {
    constexpr int TPR = Shape<HS>::TPR, PER = Shape<HS>::PER, TILE = Shape<HS>::TILE, ROWS = Shape<HS>::ROWS;
    float(*qs)[HS] = reinterpret_cast<float(*)[HS]>(attention_shared);
    float(*dos)[HS] = reinterpret_cast<float(*)[HS]>(attention_shared + TILE * HS);
    float* ls = attention_shared + 2 * TILE * HS;
    float* ds_ = ls + TILE;
    const float scale = 1.0f / sqrtf((float)HS);
    int C = NH * HS, C3 = (NH + 2 * NKV) * HS, group = NH / NKV;
    int b = blockIdx.z, g = blockIdx.y, j0 = blockIdx.x * ROWS;
    int kcol = C + g * HS, vcol = kcol + NKV * HS;
    int half = threadIdx.x & (TPR - 1);
    int j = j0 + (threadIdx.x / TPR);
    bool valid = j < T;
    int jc = valid ? j : 0;
    float k_[PER], v_[PER], dk[PER], dv[PER];
    const floatX* krow = qkv + (size_t)(b * T + jc) * C3;
#pragma unroll
    for (int k = 0; k < PER; k++) {
        k_[k] = ldx(krow[kcol + TPR * k + half]);
        v_[k] = ldx(krow[vcol + TPR * k + half]);
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
                    qv = ldx(qkv[(size_t)(b * T + i) * C3 + h * HS + d]) * scale;
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
                for (int k = 0; k < PER; k++) {
                    s += qs[ir][TPR * k + half] * k_[k];
                    dp += dos[ir][TPR * k + half] * v_[k];
                }
                s = row_sum<TPR>(s);
                dp = row_sum<TPR>(dp);
                float p = (j <= i && i < T && i - j < WIN) ? expf(s - ls[ir]) : 0.0f;
                float dsc = p * (dp - ds_[ir]);
#pragma unroll
                for (int k = 0; k < PER; k++) {
                    dv[k] += p * dos[ir][TPR * k + half];
                    dk[k] += dsc * qs[ir][TPR * k + half];
                }
            }
        }
    }
    if (!valid) return;
    floatX* out = dqkv + (size_t)(b * T + j) * C3;
#pragma unroll
    for (int k = 0; k < PER; k++) {
        out[kcol + TPR * k + half] = stx(dk[k]);
        out[vcol + TPR * k + half] = stx(dv[k]);
    }
}

// One entry point per head size and kernel (the emulated GPU registers
// kernels from their declarations, so none comes from a macro); block
// ROWS·TPR threads, as Shape<HS> has them.

extern "C" __global__ void __launch_bounds__(64 * 2)
    attention_forward_hs16(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    attention_forward<16>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 2)
    attention_backward_dq_hs16(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                               const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dq<16>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 2)
    attention_backward_dkdv_hs16(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dkdv<16>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 2)
    attention_forward_hs32(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    attention_forward<32>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 2)
    attention_backward_dq_hs32(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                               const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dq<32>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 2)
    attention_backward_dkdv_hs32(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dkdv<32>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 2)
    attention_forward_hs64(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    attention_forward<64>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 2)
    attention_backward_dq_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                               const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dq<64>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 2)
    attention_backward_dkdv_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dkdv<64>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 4)
    attention_forward_hs80(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    attention_forward<80>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 4)
    attention_backward_dq_hs80(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                               const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dq<80>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 4)
    attention_backward_dkdv_hs80(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dkdv<80>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 4)
    attention_forward_hs96(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    attention_forward<96>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 4)
    attention_backward_dq_hs96(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                               const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dq<96>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 4)
    attention_backward_dkdv_hs96(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dkdv<96>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 4)
    attention_forward_hs128(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    attention_forward<128>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 4)
    attention_backward_dq_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                               const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dq<128>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(64 * 4)
    attention_backward_dkdv_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dkdv<128>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(32 * 8)
    attention_forward_hs256(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    attention_forward<256>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(32 * 8)
    attention_backward_dq_hs256(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                               const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dq<256>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(32 * 8)
    attention_backward_dkdv_hs256(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* delta, int B, int T, int NH, int NKV, int WIN) {
    attention_backward_dkdv<256>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}
