// Token plus learned position embedding (GPT-2), and the token embedding
// alone (Llama: positions enter as rotations of q and k); twin of
// src/kernels/cpu/embedding.rs.
// tokens (N = B·T) u32; wte (Vp, C) and wpe (maxT, C) floatX; out (N, C)
// floatX; dwte, dwpe f32. Backward has no atomics: dwpe sums over the batch
// per (t, c); dwte is owned per token id — the host lists each distinct id
// with its positions in ascending order (ids, offsets, positions, CSR-style),
// and one block sums one id's rows in that order.
#include "common.cuh"

extern "C" __global__ void embedding_forward(floatX* out, const unsigned int* tokens, const floatX* wte,
                                             const floatX* wpe, int N, int T, int C) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * C) return;
    int n = (int)(idx / C), c = (int)(idx % C);
    int t = n % T;
    unsigned int tok = tokens[n];
    out[idx] = stx(ldx(wte[(size_t)tok * C + c]) + ldx(wpe[(size_t)t * C + c]));
}

// out[n, c] = wte[tokens[n], c]. Grid ceil(N·C / blockDim.x).
extern "C" __global__ void embedding_forward_tokens(floatX* out, const unsigned int* tokens, const floatX* wte,
                                                    int N, int C) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * C) return;
    int n = (int)(idx / C), c = (int)(idx % C);
    out[idx] = wte[(size_t)tokens[n] * C + c];
}

// dwpe[t, c] += Σ_b dout[b, t, c], b in order. Grid ceil(T·C / blockDim.x).
extern "C" __global__ void embedding_backward_wpe(float* dwpe, const floatX* dout, int B, int T, int C) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= T * C) return;
    float s = 0.0f;
    for (int b = 0; b < B; b++) s += ldx(dout[(size_t)b * T * C + idx]);
    dwpe[idx] += s;
}

// dwte[ids[u]] += Σ dout[positions[offsets[u]..offsets[u+1]]]. Grid: one block per distinct id.
extern "C" __global__ void embedding_backward_wte(float* dwte, const floatX* dout, const unsigned int* ids,
                                                  const unsigned int* offsets, const unsigned int* positions,
                                                  int C) {
    int u = blockIdx.x;
    unsigned int tok = ids[u], k0 = offsets[u], k1 = offsets[u + 1];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float s = 0.0f;
        for (unsigned int k = k0; k < k1; k++) s += ldx(dout[(size_t)positions[k] * C + c]);
        dwte[(size_t)tok * C + c] += s;
    }
}
