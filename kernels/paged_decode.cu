// Split-K paged decode attention (FlashDecoding): one query row per sequence against its whole
// context, the context cut into partitions that run as separate thread blocks, merged by
// log-sum-exp. The CPU twin: ch07's split-K decode (`Partitions`, then the merge).
//
// Pass 1, one block per (KV head, sequence, partition of at most PART_MAX keys). Decode reads
// every K and V row once and does little arithmetic with it, so the block is built to keep many
// loads in flight, in three phases over its partition:
//   scores  each thread takes whole keys: it reads a K row in chunks of CH elements (16 bytes of
//           bf16 where the head size allows) and scores it against every query head of the
//           group, which all share that KV head;
//   softmax a warp per head: the partition's max m and the sum l of exp(s − m), over scores
//           held in shared memory (no rescaling per key);
//   values  each thread takes one chunk of the head dimension for a strided set of keys and
//           adds p · V for every head of the group; the key sets are then summed in order.
// It writes the partition's (m, l, unnormalised output).
// Pass 2, one block per (query head, sequence): out = Σ_p exp(m_p − m) · o_p / Σ_p exp(m_p − m) · l_p.
#include "common.cuh"

#define THREADS 128
#define HEAD_DIM_MAX 128
#define GROUP_MAX 8   // query heads per KV head; the host refuses more
#define PART_MAX 256  // keys per partition; the host refuses more

// q: [rows, num_heads · head_dim]; rows: [num_seqs] (the q row of each sequence);
// context_lens: [num_seqs]; block_tables: [num_seqs, max_blocks];
// partial_o: [num_seqs, num_heads, num_partitions, head_dim]; partial_ml: [..., num_partitions, 2].
// Grid: (num_kv_heads, num_seqs, num_partitions); block: THREADS. CH divides head_dim.
struct __align__(16) DecodeShared {
    long row[PART_MAX];                // element offset of each key's row (its slot, its head)
    float q[GROUP_MAX][HEAD_DIM_MAX];  // the group's queries, times 1/√d
    float p[GROUP_MAX][PART_MAX];      // scores, then exp(s − m)
    float o[GROUP_MAX][HEAD_DIM_MAX];  // the partition's output, summed over key sets
    float ml[GROUP_MAX][2];
};

template <typename T, int CH>
__device__ void paged_decode(DecodeShared& sh, const float* q, const T* k_cache, const T* v_cache,
                             const u32* rows, const u32* context_lens, const u32* block_tables,
                             float* partial_o, float* partial_ml, int max_blocks, int block_size,
                             int num_heads, int num_kv_heads, int head_dim, int partition_size,
                             float scale) {
    float(&q_s)[GROUP_MAX][HEAD_DIM_MAX] = sh.q;
    float(&p_s)[GROUP_MAX][PART_MAX] = sh.p;
    float(&o_s)[GROUP_MAX][HEAD_DIM_MAX] = sh.o;
    float(&ml_s)[GROUP_MAX][2] = sh.ml;

    int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z, num_parts = gridDim.z;
    int group = num_heads / num_kv_heads;
    int ctx = (int)context_lens[seq];
    int begin = part * partition_size, n = max(0, min(ctx, begin + partition_size) - begin);
    int tid = threadIdx.x, warp = tid >> 5;
    const u32* table = block_tables + (long)seq * max_blocks;
    long q_row = (long)rows[seq] * num_heads * head_dim;
    int kv_stride = num_kv_heads * head_dim, chunks = head_dim / CH;

    for (int i = tid; i < group * head_dim; i += THREADS) {
        int g = i / head_dim, d = i % head_dim;
        q_s[g][d] = q[q_row + (kv_head * group + g) * head_dim + d] * scale;
    }
    partition_rows(sh.row, table, begin, n, block_size, kv_stride, (long)kv_head * head_dim);
    __syncthreads();

    // ANCHOR: key_loop
    // Scores: thread t scores keys t, t + THREADS, ... against every head of the group.
    for (int j = tid; j < n; j += THREADS) {
        long at = sh.row[j];
        float s[GROUP_MAX];
#pragma unroll
        for (int g = 0; g < GROUP_MAX; g++) s[g] = 0.0f;
#pragma unroll 8
        for (int c = 0; c < chunks; c++) {
            float k[CH];
            load_chunk<CH>(k_cache, at + c * CH, k);
#pragma unroll
            for (int g = 0; g < GROUP_MAX; g++) {
                if (g < group) {
                    float qc[CH];  // q_s[g][c·CH ..], in 16-byte reads where CH allows
                    if (CH % 4 == 0) {
#pragma unroll
                        for (int e = 0; e < CH; e += 4) {
                            float4 x = *reinterpret_cast<const float4*>(&q_s[g][c * CH + e]);
                            qc[e] = x.x, qc[e + 1] = x.y, qc[e + 2] = x.z, qc[e + 3] = x.w;
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < CH; e++) qc[e] = q_s[g][c * CH + e];
                    }
#pragma unroll
                    for (int e = 0; e < CH; e++) s[g] += qc[e] * k[e];
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP_MAX; g++) {
            if (g < group) p_s[g][j] = s[g];
        }
    }
    __syncthreads();

    // Softmax statistics: warp w takes heads w, w + 4, ...
    for (int g = warp; g < group; g += THREADS / 32) warp_softmax_stats(p_s[g], n, ml_s[g]);
    __syncthreads();

    // Values: thread t takes chunk t % v_chunks of every key of set t / v_chunks (keys set, set +
    // sets, ...); the sets are then added into o_s one after another, in order.
    // Chunks of CV = 4 elements here where K's were 8: 8 bytes of bf16 per lane still reads a whole
    // row per warp, and half the accumulators leave room for more blocks on each multiprocessor.
    constexpr int CV = CH == 8 ? 4 : CH;
    int v_chunks = head_dim / CV;
    int sets = THREADS / v_chunks, set = tid / v_chunks, c = tid % v_chunks;
    bool active = set < sets;
    float acc[GROUP_MAX][CV];
#pragma unroll
    for (int g = 0; g < GROUP_MAX; g++) {
#pragma unroll
        for (int e = 0; e < CV; e++) acc[g][e] = 0.0f;
    }
    if (active) {
#pragma unroll 8
        for (int j = set; j < n; j += sets) {
            long at = sh.row[j] + c * CV;
            float v[CV];
            load_chunk<CV>(v_cache, at, v);
#pragma unroll
            for (int g = 0; g < GROUP_MAX; g++) {
                if (g < group) {
                    float p = p_s[g][j];
#pragma unroll
                    for (int e = 0; e < CV; e++) acc[g][e] += p * v[e];
                }
            }
        }
    }
    // ANCHOR_END: key_loop
    for (int r = 0; r < sets; r++) {
        if (active && set == r) {
#pragma unroll
            for (int g = 0; g < GROUP_MAX; g++) {
                if (g < group) {
#pragma unroll
                    for (int e = 0; e < CV; e++) {
                        float before = r == 0 ? 0.0f : o_s[g][c * CV + e];
                        o_s[g][c * CV + e] = before + acc[g][e];
                    }
                }
            }
        }
        __syncthreads();
    }

    for (int i = tid; i < group * head_dim; i += THREADS) {
        int g = i / head_dim, d = i % head_dim;
        long at = (((long)seq * num_heads + kv_head * group + g) * num_parts + part);
        partial_o[at * head_dim + d] = o_s[g][d];
        if (d == 0) {
            partial_ml[2 * at] = ml_s[g][0];
            partial_ml[2 * at + 1] = ml_s[g][1];
        }
    }
}

// Chunks of 8 elements where the head size is a multiple of 8 (16-byte loads of bf16), else of 2
// (head sizes are even). The choice is uniform across the grid.
#define PAGED_DECODE_ARGS                                                                           \
    sh, q, k_cache, v_cache, rows, context_lens, block_tables, partial_o, partial_ml, max_blocks,       \
        block_size, num_heads, num_kv_heads, head_dim, partition_size, scale

extern "C" __global__ void __launch_bounds__(THREADS) paged_decode_f32(
    const float* q, const float* k_cache, const float* v_cache, const u32* rows, const u32* context_lens,
    const u32* block_tables, float* partial_o, float* partial_ml, int max_blocks, int block_size, int num_heads,
    int num_kv_heads, int head_dim, int partition_size, float scale) {
    __shared__ DecodeShared sh;
    if (head_dim % 8 == 0) paged_decode<float, 8>(PAGED_DECODE_ARGS);
    else paged_decode<float, 2>(PAGED_DECODE_ARGS);
}

extern "C" __global__ void __launch_bounds__(THREADS) paged_decode_bf16(
    const float* q, const bf16_bits* k_cache, const bf16_bits* v_cache, const u32* rows, const u32* context_lens,
    const u32* block_tables, float* partial_o, float* partial_ml, int max_blocks, int block_size, int num_heads,
    int num_kv_heads, int head_dim, int partition_size, float scale) {
    __shared__ DecodeShared sh;
    if (head_dim % 8 == 0) paged_decode<bf16_bits, 8>(PAGED_DECODE_ARGS);
    else paged_decode<bf16_bits, 2>(PAGED_DECODE_ARGS);
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
