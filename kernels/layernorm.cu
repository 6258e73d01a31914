// LayerNorm over channels, eps 1e-5 (GPT-2); twin of src/kernels/cpu/layernorm.rs.
// inp, out, dout, dinp are (N, C) floatX; weight, bias (C) floatX; mean, rstd
// (N) f32; dweight, dbias (C) f32. One warp per row. The weight gradient is
// summed without atomics: per-chunk column sums, then the chunks in order.
#include "common.cuh"

extern "C" __global__ void layernorm_forward(floatX* out, float* mean, float* rstd, const floatX* inp,
                                             const floatX* weight, const floatX* bias, int N, int C) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= N) return;
    const floatX* x = inp + (size_t)row * C;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32) s += ldx(x[i]);
    float m = warp_sum(s) / C;
    float v = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float d = ldx(x[i]) - m;
        v += d * d;
    }
    float r = 1.0f / sqrtf(warp_sum(v) / C + 1e-5f);
    floatX* o = out + (size_t)row * C;
    for (int i = lane; i < C; i += 32) o[i] = stx((ldx(x[i]) - m) * r * ldx(weight[i]) + ldx(bias[i]));
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// dinp += ∂L/∂inp. dinp may be the residual stream's gradient: the add of the
// residual branch is this +=.
extern "C" __global__ void layernorm_backward_input(floatX* dinp, const floatX* dout, const floatX* inp,
                                                    const floatX* weight, const float* mean, const float* rstd,
                                                    int N, int C) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= N) return;
    const floatX* x = inp + (size_t)row * C;
    const floatX* dy = dout + (size_t)row * C;
    float m = mean[row], r = rstd[row];
    float a = 0.0f, b = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float dn = ldx(weight[i]) * ldx(dy[i]);
        a += dn;
        b += dn * (ldx(x[i]) - m) * r;
    }
    a = warp_sum(a) / C;
    b = warp_sum(b) / C;
    floatX* dx = dinp + (size_t)row * C;
    for (int i = lane; i < C; i += 32) {
        float dn = ldx(weight[i]) * ldx(dy[i]);
        float xhat = (ldx(x[i]) - m) * r;
        dx[i] = stx(ldx(dx[i]) + (dn - a - xhat * b) * r);
    }
}

// Pass 1: partial_w[k, c] = Σ dout·x̂ and partial_b[k, c] = Σ dout over rows
// [k·rows, (k+1)·rows). Grid (ceil(C / blockDim.x), chunks).
extern "C" __global__ void layernorm_backward_weight_partial(float* partial_w, float* partial_b, const floatX* dout,
                                                             const floatX* inp, const float* mean, const float* rstd,
                                                             int N, int C, int rows) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    int chunk = blockIdx.y;
    if (col >= C) return;
    int r0 = chunk * rows, r1 = min(N, r0 + rows);
    float sw = 0.0f, sb = 0.0f;
    for (int r = r0; r < r1; r++) {
        float d = ldx(dout[(size_t)r * C + col]);
        sw += d * (ldx(inp[(size_t)r * C + col]) - mean[r]) * rstd[r];
        sb += d;
    }
    partial_w[(size_t)chunk * C + col] = sw;
    partial_b[(size_t)chunk * C + col] = sb;
}

// Pass 2: dweight[c] += Σ_k partial_w[k, c], chunks in order; same for dbias.
extern "C" __global__ void layernorm_backward_weight_finish(float* dweight, float* dbias, const float* partial_w,
                                                            const float* partial_b, int chunks, int C) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= C) return;
    float sw = 0.0f, sb = 0.0f;
    for (int k = 0; k < chunks; k++) {
        sw += partial_w[(size_t)k * C + col];
        sb += partial_b[(size_t)k * C + col];
    }
    dweight[col] += sw;
    dbias[col] += sb;
}
