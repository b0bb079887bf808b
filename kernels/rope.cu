// Rotary position embeddings in the "rotate half" layout: in every head, the pair
// (x[i], x[i + d/2]) turns by the angle pos · inv_freq[i]. The CPU twin: ch01's `Rope::rotate`
// (the angle in f32, then its sine and cosine).
#include "common.cuh"

// q: [n, num_heads · head_dim], k: [n, num_kv_heads · head_dim], positions: [n],
// inv_freq: [head_dim / 2] (any rope scaling is already in it).
// Grid: (n); block: any. Each thread turns pairs i of every head, q's and k's.
extern "C" __global__ void rope(float* q, float* k, const u32* positions, const float* inv_freq,
                                int num_heads, int num_kv_heads, int head_dim) {
    int half = head_dim / 2;
    long t = blockIdx.x;
    float pos = (float)positions[t];
    int pairs = (num_heads + num_kv_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int head = p / half, i = p % half;
        float sin_a, cos_a;
        sincosf(pos * inv_freq[i], &sin_a, &cos_a);
        float* x = head < num_heads ? q + (t * num_heads + head) * head_dim
                                    : k + (t * num_kv_heads + (head - num_heads)) * head_dim;
        float a = x[i], b = x[i + half];
        x[i] = a * cos_a - b * sin_a;
        x[i + half] = b * cos_a + a * sin_a;
    }
}
