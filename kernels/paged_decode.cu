// Split-K paged decode attention (FlashDecoding): one query row per sequence against its whole
// context, the context cut into partitions that run as separate thread blocks, merged by
// log-sum-exp. The CPU twin: ch07's split-K decode (`Partitions`, then the merge).
//
// Pass 1, one block per (KV head, sequence, partition): the block reads each K and V row of its
// partition once for every query head of the group that shares that KV head. Its 4 warps take
// keys in turn; for each key a warp's lanes split the head dimension, sum the dot products,
// and update the running max m, denominator l and output of every head of the group. The warps'
// states are then merged and written as the partition's (m, l, unnormalised output).
// Pass 2, one block per (query head, sequence): out = Σ_p exp(m_p − m) · o_p / Σ_p exp(m_p − m) · l_p.
#include "common.cuh"

#define WARPS 4
#define HEAD_DIM_MAX 128
#define GROUP_MAX 8  // query heads per KV head; the host refuses more

// q, out: [rows, num_heads · head_dim]; rows: [num_seqs] (the q/out row of each sequence);
// context_lens: [num_seqs]; block_tables: [num_seqs, max_blocks];
// partial_o: [num_seqs, num_heads, num_partitions, head_dim]; partial_ml: [..., num_partitions, 2].
// Grid: (num_kv_heads, num_seqs, num_partitions); block: 32 · WARPS.
template <typename T>
__device__ void paged_decode(const float* q, const T* k_cache, const T* v_cache, const u32* rows,
                             const u32* context_lens, const u32* block_tables, float* partial_o,
                             float* partial_ml, int max_blocks, int block_size, int num_heads,
                             int num_kv_heads, int head_dim, int partition_size, float scale) {
    __shared__ float warp_o[WARPS][GROUP_MAX][HEAD_DIM_MAX];
    __shared__ float warp_ml[WARPS][GROUP_MAX][2];

    int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z, num_parts = gridDim.z;
    int group = num_heads / num_kv_heads;
    int ctx = (int)context_lens[seq];
    int begin = part * partition_size, end = min(ctx, begin + partition_size);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32* table = block_tables + (long)seq * max_blocks;
    long q_row = (long)rows[seq] * num_heads * head_dim;
    int kv_stride = num_kv_heads * head_dim;

    float qx[GROUP_MAX][HEAD_DIM_MAX / 32], acc[GROUP_MAX][HEAD_DIM_MAX / 32], m[GROUP_MAX], l[GROUP_MAX];
    for (int g = 0; g < GROUP_MAX; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int t = 0; t < HEAD_DIM_MAX / 32; t++) {
            int d = lane + 32 * t, head = kv_head * group + g;
            qx[g][t] = g < group && d < head_dim ? q[q_row + head * head_dim + d] * scale : 0.0f;
            acc[g][t] = 0.0f;
        }
    }

    // ANCHOR: key_loop
    for (int key = begin + warp; key < end; key += WARPS) {
        long slot = (long)table[key / block_size] * block_size + key % block_size;
        long at = slot * kv_stride + kv_head * head_dim;
        float kx[HEAD_DIM_MAX / 32], vx[HEAD_DIM_MAX / 32];
        for (int t = 0; t < HEAD_DIM_MAX / 32; t++) {
            int d = lane + 32 * t;
            kx[t] = d < head_dim ? load_f32(k_cache, at + d) : 0.0f;
            vx[t] = d < head_dim ? load_f32(v_cache, at + d) : 0.0f;
        }
        for (int g = 0; g < group; g++) {
            float s = 0.0f;
            for (int t = 0; t < HEAD_DIM_MAX / 32; t++) s += qx[g][t] * kx[t];
            s = warp_sum(s);
            float m_new = fmaxf(m[g], s);
            float correction = expf(m[g] - m_new), p = expf(s - m_new);
            l[g] = l[g] * correction + p;
            for (int t = 0; t < HEAD_DIM_MAX / 32; t++) acc[g][t] = acc[g][t] * correction + p * vx[t];
            m[g] = m_new;
        }
    }

    // ANCHOR_END: key_loop
    for (int g = 0; g < group; g++) {
        for (int t = 0; t < HEAD_DIM_MAX / 32; t++) {
            int d = lane + 32 * t;
            if (d < head_dim) warp_o[warp][g][d] = acc[g][t];
        }
        if (lane == 0) {
            warp_ml[warp][g][0] = m[g];
            warp_ml[warp][g][1] = l[g];
        }
    }
    __syncthreads();

    // Merge the warps: thread i takes (head g, dim d) pairs of the group.
    for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) {
        int g = i / head_dim, d = i % head_dim;
        float m_all = -INFINITY;
        for (int w = 0; w < WARPS; w++) m_all = fmaxf(m_all, warp_ml[w][g][0]);
        float o = 0.0f, l_all = 0.0f;
        if (m_all != -INFINITY) {
            for (int w = 0; w < WARPS; w++) {
                float c = expf(warp_ml[w][g][0] - m_all);  // 0 for a warp that saw no key
                o += c * warp_o[w][g][d];
                l_all += c * warp_ml[w][g][1];
            }
        }
        long at = (((long)seq * num_heads + kv_head * group + g) * num_parts + part);
        partial_o[at * head_dim + d] = o;
        if (d == 0) {
            partial_ml[2 * at] = m_all;
            partial_ml[2 * at + 1] = l_all;
        }
    }
}

extern "C" __global__ void paged_decode_f32(const float* q, const float* k_cache, const float* v_cache,
                                            const u32* rows, const u32* context_lens, const u32* block_tables,
                                            float* partial_o, float* partial_ml, int max_blocks, int block_size,
                                            int num_heads, int num_kv_heads, int head_dim, int partition_size,
                                            float scale) {
    paged_decode(q, k_cache, v_cache, rows, context_lens, block_tables, partial_o, partial_ml, max_blocks,
                 block_size, num_heads, num_kv_heads, head_dim, partition_size, scale);
}

extern "C" __global__ void paged_decode_bf16(const float* q, const bf16_bits* k_cache, const bf16_bits* v_cache,
                                             const u32* rows, const u32* context_lens, const u32* block_tables,
                                             float* partial_o, float* partial_ml, int max_blocks, int block_size,
                                             int num_heads, int num_kv_heads, int head_dim, int partition_size,
                                             float scale) {
    paged_decode(q, k_cache, v_cache, rows, context_lens, block_tables, partial_o, partial_ml, max_blocks,
                 block_size, num_heads, num_kv_heads, head_dim, partition_size, scale);
}

// Pass 2. Grid: (num_heads, num_seqs); block: any (threads take dimensions d).
extern "C" __global__ void paged_decode_merge(const float* partial_o, const float* partial_ml, const u32* rows,
                                              float* out, int num_heads, int head_dim, int num_parts) {
    int head = blockIdx.x, seq = blockIdx.y;
    long base = ((long)seq * num_heads + head) * num_parts;
    float m_all = -INFINITY;
    for (int p = 0; p < num_parts; p++) m_all = fmaxf(m_all, partial_ml[2 * (base + p)]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f, l_all = 0.0f;
        for (int p = 0; p < num_parts; p++) {
            float m_p = partial_ml[2 * (base + p)];
            if (m_p == -INFINITY) continue;  // a partition past the end of this context
            float c = expf(m_p - m_all);
            o += c * partial_o[(base + p) * head_dim + d];
            l_all += c * partial_ml[2 * (base + p) + 1];
        }
        out[(long)rows[seq] * num_heads * head_dim + head * head_dim + d] = o / l_all;
    }
}
