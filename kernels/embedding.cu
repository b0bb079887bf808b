// Embedding gather: row `tokens[t]` of the table into row t of the hidden states.
// The CPU twin: ch01's `Embedding::forward` (one row copy per token).
#include "common.cuh"

// table: [vocab, dim]; tokens: [n]; out: [n, dim] f32. Grid: (n); block: any.
template <typename T>
__device__ void embedding(const T* table, const u32* tokens, float* out, int dim) {
    long row = tokens[blockIdx.x];
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        out[(long)blockIdx.x * dim + d] = load_f32(table, row * dim + d);
    }
}

extern "C" __global__ void embedding_f32(const float* table, const u32* tokens, float* out, int dim) {
    embedding(table, tokens, out, dim);
}

extern "C" __global__ void embedding_bf16(const bf16_bits* table, const u32* tokens, float* out, int dim) {
    embedding(table, tokens, out, dim);
}
