// Writes each token's K and V into its slot of the paged pool. The CPU twin: ch03's
// `KvPool::write` (slot = block · block_size + offset, from the block table on the host).
#include "common.cuh"

// k, v: [n, kv_dim] f32; slots: [n]; k_cache, v_cache: [num_slots, kv_dim] of T (one layer).
// Grid: (n); block: any.
template <typename T>
__device__ void kv_write(const float* k, const float* v, const u32* slots, T* k_cache, T* v_cache,
                         int kv_dim) {
    long src = (long)blockIdx.x * kv_dim, dst = (long)slots[blockIdx.x] * kv_dim;
    for (int d = threadIdx.x; d < kv_dim; d += blockDim.x) {
        store_from_f32(k_cache, dst + d, k[src + d]);
        store_from_f32(v_cache, dst + d, v[src + d]);
    }
}

extern "C" __global__ void kv_write_f32(const float* k, const float* v, const u32* slots,
                                        float* k_cache, float* v_cache, int kv_dim) {
    kv_write(k, v, slots, k_cache, v_cache, kv_dim);
}

extern "C" __global__ void kv_write_bf16(const float* k, const float* v, const u32* slots,
                                         bf16_bits* k_cache, bf16_bits* v_cache, int kv_dim) {
    kv_write(k, v, slots, k_cache, v_cache, kv_dim);
}

// Copy-on-write and swaps: one whole block from id `from` to id `to`, K and V of one layer
// (`block_bytes` = block_size · kv_dim · element size). One launch per copy, in list order: a
// block written by one copy may be the source of the next. Grid-stride over the bytes.
extern "C" __global__ void copy_block(unsigned char* k_cache, unsigned char* v_cache, u32 from, u32 to,
                                      long block_bytes) {
    long src = (long)from * block_bytes, dst = (long)to * block_bytes;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < block_bytes; i += (long)gridDim.x * blockDim.x) {
        k_cache[dst + i] = k_cache[src + i];
        v_cache[dst + i] = v_cache[src + i];
    }
}
