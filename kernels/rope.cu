// Rotary position embeddings, Llama's "rotate half" form; twin of
// src/kernels/cpu/rope.rs. x is (N, W) floatX, rotated in place: `heads` head
// vectors of size 2·half at columns [col0, col0 + heads·2·half) of each row; a
// row's position is row mod T. cos, sin are (T, half) f32, the host's table
// (Hugging Face's order of rounding), so both backends rotate by the same
// numbers. sign = +1 rotates (forward), −1 rotates back (the gradient's
// backward: the transpose of a rotation). One thread per (row, head, j) pair.
#include "common.cuh"

extern "C" __global__ void rope_rotate(floatX* x, const float* cos_t, const float* sin_t, int N, int W, int col0,
                                       int heads, int half, int T, float sign) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long pairs = (long long)N * heads * half;
    if (i >= pairs) return;
    int j = (int)(i % half);
    long long rh = i / half;
    int h = (int)(rh % heads);
    long long row = rh / heads;
    int p = (int)(row % T);
    float c = cos_t[(size_t)p * half + j], s = sign * sin_t[(size_t)p * half + j];
    floatX* head = x + (size_t)row * W + col0 + (size_t)h * 2 * half;
    float a = ldx(head[j]), b = ldx(head[j + half]);
    head[j] = stx(a * c + (-b) * s);
    head[j + half] = stx(b * c + a * s);
}
