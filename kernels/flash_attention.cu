// Causal attention on tensor cores, FlashAttention-2 style, optionally over a
// sliding window; twin of src/kernels/cpu/flash_attention.rs. Head sizes 16,
// 32, 64, 80, 96 and 128 (one kernel each, and one each with a window: the
// `_hsN` entry points at the end); the tiles are the same at every size, as
// the registers of 128 (dk, dv: 2·D/2 f32 accumulators per thread) bound
// them and smaller heads only need fewer.
//
// Grouped-query heads as kernels/attention.cu lays them out: qkv is (B, T, W)
// floatX, W = (NH + 2·NKV)·D, query head h at column h·D, key head g at
// C + g·D, value head g at C + NKV·D + g·D (C = NH·D); query head h uses
// key/value head h / (NH / NKV); NKV = NH is multi-head attention. out is
// (B, T, C); lse is (B, NH, T) f32; dqkv is (B, T, W), written whole (not
// accumulated).
//
// Products run on mma.sync.m16n8k16 (bf16 in, f32 accumulate; sm_80 and
// sm_90): a warp owns 16 rows. Operands are staged as bf16 (the f32 storage
// build rounds them too: the backend uses these kernels for bf16 only).
// Fragment layout (PTX ISA, m16n8k16): with g = lane / 4 and t = lane % 4,
//   A (16×16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16×8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16×8):       c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// so the score accumulators of two adjacent 8-key tiles are, packed to bf16,
// the A fragment of P for the next product (no trip through shared memory).
//
// Forward: a block holds 64 queries (4 warps) and walks key tiles of 64 with
// an online softmax (running max m, sum l; lse = m + ln l). Backward keeps dq
// apart from dk, dv (no atomics, so it repeats bit for bit): one kernel per
// 64 queries walks their keys 16 at a time for dq; another per 64 keys of a
// key/value head walks the queries of each head of its group in turn, 16 at
// a time, for dk and dv. Every sum runs in a fixed order.
//
// Sliding windows (the `_window_` kernels, SLIDING = true): query i sees key
// j when i − WIN < j ≤ i (Hugging Face's rule; src/kernels/cpu/attention.rs
// says where it comes from). A block starts at the (aligned) tile holding its
// first row's first key and a warp skips tiles that none of its 16 rows sees.
// A row can still meet a tile whose keys all lie before its window (another
// row of its warp sees some): its scores there are all −inf, and forward
// keeps it from exp(−inf − (−inf)). The causal kernels (SLIDING = false)
// compile without any of it: the arithmetic (and so the bits) of causal
// attention before windows existed, and no register spent on a window.
#include "common.cuh"

#define FA_WARPS 4
#define FA_THREADS (32 * FA_WARPS)
#define FA_ROWS (16 * FA_WARPS)  // queries (forward, dq) or keys (dk, dv) per block
#define FA_KT 64                 // keys per tile in forward
#define FA_BT 16                 // keys (dq) or queries (dk, dv) per tile in backward
#define FA_PAD 8                 // bf16 padding per shared row: rows start on different banks

typedef unsigned short bf16_t;

__device__ __forceinline__ unsigned int pack_bf16(float lo, float hi) {
    return (unsigned int)f32_to_bf16(lo) | ((unsigned int)f32_to_bf16(hi) << 16);
}

__device__ __forceinline__ unsigned int pack_bits(bf16_t lo, bf16_t hi) {
    return (unsigned int)lo | ((unsigned int)hi << 16);
}

// Two adjacent bf16 of shared memory (the column is even) as one register.
__device__ __forceinline__ unsigned int lds2(const bf16_t* p) {
    return *reinterpret_cast<const unsigned int*>(p);
}

// d += a·b on tensor cores.
__device__ __forceinline__ void mma_bf16(float* d, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Elements (row, col) and (row, col + 1) of a row-major floatX matrix, as a
// bf16 pair; rows at or past T read as zero.
__device__ __forceinline__ unsigned int ldg2(const floatX* m, int row, int col, int T, int stride) {
    if (row >= T) return 0u;
    const floatX* p = m + (size_t)row * stride + col;
    return pack_bf16(ldx(p[0]), ldx(p[1]));
}

// The A fragments of 16 rows (r0 = first row + g, r1 = r0 + 8) over D columns.
template <int D>
__device__ __forceinline__ void load_a(unsigned int (&f)[D / 16][4], const floatX* m, int r0, int T, int stride,
                                       int t) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        int c = kk * 16 + 2 * t;
        f[kk][0] = ldg2(m, r0, c, T, stride);
        f[kk][1] = ldg2(m, r0 + 8, c, T, stride);
        f[kk][2] = ldg2(m, r0, c + 8, T, stride);
        f[kk][3] = ldg2(m, r0 + 8, c + 8, T, stride);
    }
}

// rows × D of a floatX matrix from row `first` into shared memory [row][D + pad]
// (`transpose`: [col][rows + pad]), zero past T.
template <int D>
__device__ __forceinline__ void stage(bf16_t* s, const floatX* m, int first, int rows, int T, int stride,
                                      bool transpose) {
    for (int e = threadIdx.x; e < rows * D; e += FA_THREADS) {
        int r = e / D, c = e % D, row = first + r;
        bf16_t v = row < T ? f32_to_bf16(ldx(m[(size_t)row * stride + c])) : (bf16_t)0;
        if (transpose) {
            s[c * (rows + FA_PAD) + r] = v;
        } else {
            s[r * (D + FA_PAD) + c] = v;
        }
    }
}

// Sum over the 4 lanes that share a row (lanes 4g..4g+3): the same bits on each.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Each kernel's shared memory, laid out per head size, in the block's dynamic
// shared memory (the launcher passes the bytes: `flash_shared_bytes` in
// src/kernels/cuda/attention.rs, the sizes the static_asserts below pin).
// Dynamic, not static: on hardware each kernel gets its own either way, but
// the emulated GPU counts a module's static shared memory together, and six
// head sizes' arrays, each twice (causal and window), would pass the
// 227 KiB a block may have. Every size here is under 48 KiB (the largest,
// dk/dv at D 128, is 43,648 bytes), so no opt-in is needed.
//
// Alignment, by construction for every D (80 and 96 included, which are not
// multiples of 64): the 4-byte pair reads (`lds2`) start at an even bf16
// index, as every row stride (D + FA_PAD, FA_KT + FA_PAD) and column offset
// (kk·16 + 2t, + 8) is even because D is a multiple of 16 and FA_PAD is 8;
// each array holds an even number of bf16, so the next one (and the float
// arrays of DkdvShared) starts on 4 bytes; the block's base is 16-aligned.
// Global memory is read and written one floatX at a time (`ldg2`, the
// stores), so a head's column offset h·D needs no alignment at all.
template <int D>
struct ForwardShared {
    bf16_t ks[FA_KT * (D + FA_PAD)];
    bf16_t vts[D * (FA_KT + FA_PAD)];  // V transposed: [d][key]
};

template <int D>
struct DqShared {
    bf16_t ks[FA_BT * (D + FA_PAD)];
    bf16_t vs[FA_BT * (D + FA_PAD)];
};

template <int D>
struct DkdvShared {
    bf16_t ks[FA_ROWS * (D + FA_PAD)];
    bf16_t vs[FA_ROWS * (D + FA_PAD)];
    bf16_t qs[FA_BT * (D + FA_PAD)];
    bf16_t dos[FA_BT * (D + FA_PAD)];
    float ls[FA_BT], dls[FA_BT];
};

extern __shared__ __align__(16) unsigned char flash_shared[];

template <typename S>
__device__ __forceinline__ S& block_shared() {
    return *reinterpret_cast<S*>(flash_shared);
}

// The launcher's byte counts, per head size (D a multiple of 16).
template <int D>
struct SharedBytes {
    static_assert(D % 16 == 0, "mma.m16n8k16 takes 16 dims per step");
    static_assert(sizeof(ForwardShared<D>) == 2 * (FA_KT * (D + FA_PAD) + D * (FA_KT + FA_PAD)), "forward");
    static_assert(sizeof(DqShared<D>) == 2 * 2 * FA_BT * (D + FA_PAD), "dq");
    static_assert(sizeof(DkdvShared<D>) == 2 * (2 * FA_ROWS + 2 * FA_BT) * (D + FA_PAD) + 2 * 4 * FA_BT, "dk/dv");
    static_assert(sizeof(DkdvShared<D>) <= 48 * 1024, "no opt-in past 48 KiB");
    static constexpr bool ok = true;
};

// Grid (ceil(T / 64), NH, B), block 128.
template <int D, bool SLIDING>
__device__ __forceinline__ void flash_forward(floatX* out, float* lse, const floatX* qkv, int T, int NH, int NKV,
                                              int WIN) {
    static_assert(SharedBytes<D>::ok, "");
    bf16_t* ks = block_shared<ForwardShared<D>>().ks;
    bf16_t* vts = block_shared<ForwardShared<D>>().vts;  // V transposed: [d][key]
    const int C = NH * D, C3 = (NH + 2 * NKV) * D;
    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * FA_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const float scale = rsqrtf((float)D);
    const floatX* base = qkv + (size_t)b * T * C3 + h * D;
    const floatX* kbase = qkv + (size_t)b * T * C3 + C + (h / (NH / NKV)) * D;
    const floatX* vbase = kbase + NKV * D;
    unsigned int qf[D / 16][4];
    load_a<D>(qf, base, r0, T, C3, t);
    float o[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    // Causal: every key tile starts at or before q0 <= r0, so each row sees
    // key k0 of every tile it visits and its running max is finite after the
    // first tile. A window can give a row tiles wholly before its first key.
    const int kend = min(T, q0 + FA_ROWS);
    const int wfirst = q0 + warp * 16 - WIN + 1;  // the first key of this warp's first row
    for (int k0 = SLIDING ? max(0, q0 - WIN + 1) / FA_KT * FA_KT : 0; k0 < kend; k0 += FA_KT) {
        __syncthreads();
        stage<D>(ks, kbase, k0, FA_KT, T, C3, false);
        stage<D>(vts, vbase, k0, FA_KT, T, C3, true);
        __syncthreads();
        if (SLIDING && k0 + FA_KT <= wfirst) continue;  // before every window of this warp's rows
        float s[FA_KT / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_KT / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int nt = 0; nt < FA_KT / 8; nt++) {
                const bf16_t* kr = ks + (nt * 8 + g) * (D + FA_PAD) + kk * 16 + 2 * t;
                mma_bf16(s[nt], qf[kk], lds2(kr), lds2(kr + 8));
            }
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < FA_KT / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int j = k0 + nt * 8 + 2 * t + (e & 1), row = e < 2 ? r0 : r1;
                float v = (j <= row && j < T && (!SLIDING || row - j < WIN)) ? s[nt][e] * scale : NEG_INF;
                s[nt][e] = v;
                if (e < 2) {
                    mx0 = fmaxf(mx0, v);
                } else {
                    mx1 = fmaxf(mx1, v);
                }
            }
        }
        mx0 = quad_max(mx0);
        mx1 = quad_max(mx1);
        // A row that has seen no key yet (max −inf) subtracts 0: its p are
        // exp(−inf) = 0 and its (zero) sums scale by 0, never by NaN. A row
        // with a finite max subtracts it, as causal attention always does.
        const float u0 = SLIDING && mx0 == NEG_INF ? 0.0f : mx0, u1 = SLIDING && mx1 == NEG_INF ? 0.0f : mx1;
        float c0 = expf(m0 - u0), c1 = expf(m1 - u1);
        m0 = mx0;
        m1 = mx1;
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            o[dt][0] *= c0;
            o[dt][1] *= c0;
            o[dt][2] *= c1;
            o[dt][3] *= c1;
        }
#pragma unroll
        for (int kk = 0; kk < FA_KT / 16; kk++) {
            float p[2][4];
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
#pragma unroll
                for (int e = 0; e < 4; e++) p[hf][e] = expf(s[2 * kk + hf][e] - (e < 2 ? u0 : u1));
                l0 += p[hf][0] + p[hf][1];
                l1 += p[hf][2] + p[hf][3];
            }
            unsigned int a[4] = {pack_bf16(p[0][0], p[0][1]), pack_bf16(p[0][2], p[0][3]),
                                 pack_bf16(p[1][0], p[1][1]), pack_bf16(p[1][2], p[1][3])};
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                const bf16_t* vr = vts + (dt * 8 + g) * (FA_KT + FA_PAD) + kk * 16 + 2 * t;
                mma_bf16(o[dt], a, lds2(vr), lds2(vr + 8));
            }
        }
    }
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) {
        int col = h * D + dt * 8 + 2 * t;
        if (r0 < T) {
            floatX* orow = out + (size_t)(b * T + r0) * C + col;
            orow[0] = stx(o[dt][0] * inv0);
            orow[1] = stx(o[dt][1] * inv0);
        }
        if (r1 < T) {
            floatX* orow = out + (size_t)(b * T + r1) * C + col;
            orow[0] = stx(o[dt][2] * inv1);
            orow[1] = stx(o[dt][3] * inv1);
        }
    }
    if (t == 0 && r0 < T) lse[(size_t)(b * NH + h) * T + r0] = m0 + logf(l0);
    if (t == 0 && r1 < T) lse[(size_t)(b * NH + h) * T + r1] = m1 + logf(l1);
}





// delta[b, h, i] = Σ_d dout·out over head h's D dims, in d order. Grid
// ceil(B·NH·T / 256), block 256.
extern "C" __global__ void flash_backward_delta(float* delta, const floatX* dout, const floatX* out, int B, int T,
                                                int NH, int D) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * NH * T) return;
    int i = idx % T, h = (idx / T) % NH, b = idx / (T * NH);
    size_t at = (size_t)(b * T + i) * NH * D + h * D;
    float s = 0.0f;
    for (int k = 0; k < D; k++) s += ldx(dout[at + k]) * ldx(out[at + k]);
    delta[idx] = s;
}

// dq for 64 queries; writes the q columns of dqkv. Grid (ceil(T / 64), NH, B), block 128.
template <int D, bool SLIDING>
__device__ __forceinline__ void flash_backward_dq(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                  const float* lse, const float* delta, int T, int NH, int NKV,
                                                  int WIN) {
    bf16_t* ks = block_shared<DqShared<D>>().ks;
    bf16_t* vs = block_shared<DqShared<D>>().vs;
    const int C = NH * D, C3 = (NH + 2 * NKV) * D;
    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * FA_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const float scale = rsqrtf((float)D);
    const floatX* base = qkv + (size_t)b * T * C3 + h * D;
    const floatX* kbase = qkv + (size_t)b * T * C3 + C + (h / (NH / NKV)) * D;
    const floatX* vbase = kbase + NKV * D;
    const floatX* dbase = dout + (size_t)b * T * C + h * D;
    unsigned int qf[D / 16][4], df[D / 16][4];
    load_a<D>(qf, base, r0, T, C3, t);
    load_a<D>(df, dbase, r0, T, C, t);
    const size_t lrow = (size_t)(b * NH + h) * T;
    const float L0 = r0 < T ? lse[lrow + r0] : 0.0f, L1 = r1 < T ? lse[lrow + r1] : 0.0f;
    const float D0 = r0 < T ? delta[lrow + r0] : 0.0f, D1 = r1 < T ? delta[lrow + r1] : 0.0f;
    float dq[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.0f;
    const int kend = min(T, q0 + FA_ROWS);
    const int wfirst = q0 + warp * 16 - WIN + 1;  // the first key of this warp's first row
    for (int k0 = SLIDING ? max(0, q0 - WIN + 1) / FA_BT * FA_BT : 0; k0 < kend; k0 += FA_BT) {
        __syncthreads();
        stage<D>(ks, kbase, k0, FA_BT, T, C3, false);
        stage<D>(vs, vbase, k0, FA_BT, T, C3, false);
        __syncthreads();
        // This warp's queries see none of these keys: all after them, or all
        // before their windows.
        if (q0 + warp * 16 + 15 < k0 || (SLIDING && k0 + FA_BT <= wfirst)) continue;
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        float dp[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                int at = (nt * 8 + g) * (D + FA_PAD) + kk * 16 + 2 * t;
                mma_bf16(s[nt], qf[kk], lds2(ks + at), lds2(ks + at + 8));
                mma_bf16(dp[nt], df[kk], lds2(vs + at), lds2(vs + at + 8));
            }
        }
        float ds[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int j = k0 + nt * 8 + 2 * t + (e & 1), row = e < 2 ? r0 : r1;
                bool seen = j <= row && j < T && (!SLIDING || row - j < WIN);
                float p = seen ? expf(s[nt][e] * scale - (e < 2 ? L0 : L1)) : 0.0f;
                ds[nt][e] = p * (dp[nt][e] - (e < 2 ? D0 : D1));
            }
        }
        unsigned int a[4] = {pack_bf16(ds[0][0], ds[0][1]), pack_bf16(ds[0][2], ds[0][3]),
                             pack_bf16(ds[1][0], ds[1][1]), pack_bf16(ds[1][2], ds[1][3])};
        // dQ += dS·K: B = K (keys × d), two keys per register, read down a column.
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            const bf16_t* kc = ks + dt * 8 + g;
            unsigned int b0 = pack_bits(kc[(2 * t) * (D + FA_PAD)], kc[(2 * t + 1) * (D + FA_PAD)]);
            unsigned int b1 = pack_bits(kc[(2 * t + 8) * (D + FA_PAD)], kc[(2 * t + 9) * (D + FA_PAD)]);
            mma_bf16(dq[dt], a, b0, b1);
        }
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) {
        int col = h * D + dt * 8 + 2 * t;
        if (r0 < T) {
            floatX* g0 = dqkv + (size_t)(b * T + r0) * C3 + col;
            g0[0] = stx(dq[dt][0] * scale);
            g0[1] = stx(dq[dt][1] * scale);
        }
        if (r1 < T) {
            floatX* g1 = dqkv + (size_t)(b * T + r1) * C3 + col;
            g1[0] = stx(dq[dt][2] * scale);
            g1[1] = stx(dq[dt][3] * scale);
        }
    }
}





// dk and dv for 64 keys; writes the k and v columns of dqkv. The products run
// transposed (keys as rows): Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q.
// K and V stay in shared memory (in registers they would not fit at D = 128).
// Grid (ceil(T / 64), NKV, B), block 128: the block sums over key/value head
// blockIdx.y's query heads in head order.
template <int D, bool SLIDING>
__device__ __forceinline__ void flash_backward_dkdv(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                    const float* lse, const float* delta, int T, int NH, int NKV,
                                                    int WIN) {
    DkdvShared<D>& sh = block_shared<DkdvShared<D>>();
    bf16_t *ks = sh.ks, *vs = sh.vs, *qs = sh.qs, *dos = sh.dos;
    float *ls = sh.ls, *dls = sh.dls;
    const int C = NH * D, C3 = (NH + 2 * NKV) * D, group = NH / NKV;
    const int b = blockIdx.z, kvh = blockIdx.y, j0 = blockIdx.x * FA_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int c0 = j0 + warp * 16 + g, c1 = c0 + 8;  // this thread's two keys
    const float scale = rsqrtf((float)D);
    const int kcol = C + kvh * D;
    const floatX* kbase = qkv + (size_t)b * T * C3 + kcol;
    stage<D>(ks, kbase, j0, FA_ROWS, T, C3, false);
    stage<D>(vs, kbase + NKV * D, j0, FA_ROWS, T, C3, false);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) {
        dk[dt][0] = dk[dt][1] = dk[dt][2] = dk[dt][3] = 0.0f;
        dv[dt][0] = dv[dt][1] = dv[dt][2] = dv[dt][3] = 0.0f;
    }
    const bf16_t* kw = ks + (warp * 16 + g) * (D + FA_PAD);  // row g of this warp's keys
    const bf16_t* vw = vs + (warp * 16 + g) * (D + FA_PAD);
    for (int h = kvh * group; h < (kvh + 1) * group; h++) {
        const floatX* base = qkv + (size_t)b * T * C3 + h * D;
        const floatX* dbase = dout + (size_t)b * T * C + h * D;
        const size_t lrow = (size_t)(b * NH + h) * T;
        // Only queries from the block's first key to its last key's last
        // query see any of its keys.
        const int iend = SLIDING ? min(T, j0 + FA_ROWS - 1 + WIN) : T;
        for (int i0 = j0; i0 < iend; i0 += FA_BT) {
            __syncthreads();
            stage<D>(qs, base, i0, FA_BT, T, C3, false);
            stage<D>(dos, dbase, i0, FA_BT, T, C, false);
            if (threadIdx.x < FA_BT) {
                int i = i0 + threadIdx.x;
                ls[threadIdx.x] = i < T ? lse[lrow + i] : 0.0f;
                dls[threadIdx.x] = i < T ? delta[lrow + i] : 0.0f;
            }
            __syncthreads();
            // Every query here precedes this warp's keys, or comes after their windows.
            if (i0 + FA_BT - 1 < j0 + warp * 16 || (SLIDING && i0 >= j0 + warp * 16 + 15 + WIN)) continue;
            float st[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            float dpt[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    #pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                int c = kk * 16 + 2 * t, r8 = 8 * (D + FA_PAD);
                unsigned int ka[4] = {lds2(kw + c), lds2(kw + r8 + c), lds2(kw + c + 8), lds2(kw + r8 + c + 8)};
                unsigned int va[4] = {lds2(vw + c), lds2(vw + r8 + c), lds2(vw + c + 8), lds2(vw + r8 + c + 8)};
    #pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    int at = (nt * 8 + g) * (D + FA_PAD) + c;
                    mma_bf16(st[nt], ka, lds2(qs + at), lds2(qs + at + 8));
                    mma_bf16(dpt[nt], va, lds2(dos + at), lds2(dos + at + 8));
                }
            }
            float pt[2][4], dst[2][4];
    #pragma unroll
            for (int nt = 0; nt < 2; nt++) {
    #pragma unroll
                for (int e = 0; e < 4; e++) {
                    int qi = nt * 8 + 2 * t + (e & 1), i = i0 + qi, key = e < 2 ? c0 : c1;
                    bool seen = key <= i && i < T && (!SLIDING || i - key < WIN);
                    float p = seen ? expf(st[nt][e] * scale - ls[qi]) : 0.0f;
                    pt[nt][e] = p;
                    dst[nt][e] = p * (dpt[nt][e] - dls[qi]);
                }
            }
            unsigned int ap[4] = {pack_bf16(pt[0][0], pt[0][1]), pack_bf16(pt[0][2], pt[0][3]),
                                  pack_bf16(pt[1][0], pt[1][1]), pack_bf16(pt[1][2], pt[1][3])};
            unsigned int as[4] = {pack_bf16(dst[0][0], dst[0][1]), pack_bf16(dst[0][2], dst[0][3]),
                                  pack_bf16(dst[1][0], dst[1][1]), pack_bf16(dst[1][2], dst[1][3])};
            // B = dO or Q (queries × d), two queries per register, read down a column.
    #pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                const bf16_t* oc = dos + dt * 8 + g;
                const bf16_t* qc = qs + dt * 8 + g;
                int i0r = (2 * t) * (D + FA_PAD), i1r = (2 * t + 1) * (D + FA_PAD);
                int i8r = (2 * t + 8) * (D + FA_PAD), i9r = (2 * t + 9) * (D + FA_PAD);
                mma_bf16(dv[dt], ap, pack_bits(oc[i0r], oc[i1r]), pack_bits(oc[i8r], oc[i9r]));
                mma_bf16(dk[dt], as, pack_bits(qc[i0r], qc[i1r]), pack_bits(qc[i8r], qc[i9r]));
            }
        }
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) {
        int col = kcol + dt * 8 + 2 * t, vo = NKV * D;
        if (c0 < T) {
            floatX* g0 = dqkv + (size_t)(b * T + c0) * C3 + col;
            g0[0] = stx(dk[dt][0] * scale);
            g0[1] = stx(dk[dt][1] * scale);
            g0[vo] = stx(dv[dt][0]);
            g0[vo + 1] = stx(dv[dt][1]);
        }
        if (c1 < T) {
            floatX* g1 = dqkv + (size_t)(b * T + c1) * C3 + col;
            g1[0] = stx(dk[dt][2] * scale);
            g1[1] = stx(dk[dt][3] * scale);
            g1[vo] = stx(dv[dt][2]);
            g1[vo + 1] = stx(dv[dt][3]);
        }
    }
}

// The entry points, per head size (the emulated GPU registers kernels from
// their declarations, so none comes from a macro). Grid (ceil(T / 64), NH
// or NKV, B), block 128, dynamic shared memory as SharedBytes<D> says.
// 64 and 128 have causal kernels (compiled without the window's tests: the
// bits and registers they had before windows) and window twins; the other
// sizes have the window kernels only, which are causal attention with
// WIN = T (every window test holds, every tile is walked): a third fewer
// kernels for NVRTC, and the emulator, to compile.

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_forward_window_hs16(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    flash_forward<16, true>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dq_window_hs16(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                  const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dq<16, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dkdv_window_hs16(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                    const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dkdv<16, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_forward_window_hs32(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    flash_forward<32, true>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dq_window_hs32(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                  const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dq<32, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dkdv_window_hs32(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                    const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dkdv<32, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_forward_hs64(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_forward<64, false>(out, lse, qkv, T, NH, NKV, T);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dq_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                           const float* delta, int B, int T, int NH, int NKV) {
    flash_backward_dq<64, false>(dqkv, dout, qkv, lse, delta, T, NH, NKV, T);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dkdv_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                             const float* delta, int B, int T, int NH, int NKV) {
    flash_backward_dkdv<64, false>(dqkv, dout, qkv, lse, delta, T, NH, NKV, T);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_forward_window_hs64(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    flash_forward<64, true>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dq_window_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                  const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dq<64, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dkdv_window_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                    const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dkdv<64, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_forward_window_hs80(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    flash_forward<80, true>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dq_window_hs80(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                  const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dq<80, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dkdv_window_hs80(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                    const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dkdv<80, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_forward_window_hs96(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    flash_forward<96, true>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dq_window_hs96(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                  const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dq<96, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dkdv_window_hs96(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                    const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dkdv<96, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_forward_hs128(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_forward<128, false>(out, lse, qkv, T, NH, NKV, T);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dq_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                           const float* delta, int B, int T, int NH, int NKV) {
    flash_backward_dq<128, false>(dqkv, dout, qkv, lse, delta, T, NH, NKV, T);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dkdv_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                             const float* delta, int B, int T, int NH, int NKV) {
    flash_backward_dkdv<128, false>(dqkv, dout, qkv, lse, delta, T, NH, NKV, T);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_forward_window_hs128(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV, int WIN) {
    flash_forward<128, true>(out, lse, qkv, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dq_window_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                  const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dq<128, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_backward_dkdv_window_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                    const float* delta, int B, int T, int NH, int NKV, int WIN) {
    flash_backward_dkdv<128, true>(dqkv, dout, qkv, lse, delta, T, NH, NKV, WIN);
}
