// Split-K paged decode attention with every K and V row read by a group of lanes together: the
// same partitions, phases and partial results as paged_decode.cu (whose paged_decode_merge
// finishes both), for head sizes 64 and 128 and groups of 1, 2, 4 or 8 query heads per KV head.
//
// In paged_decode.cu each thread scores whole keys, so the 32 lanes of one load instruction read
// 16 bytes from 32 different rows: 32 cache lines touched for 512 bytes used. Here a group of
// LANES = D / CH lanes reads one row, CH elements (16 bytes) each, so one warp instruction reads
// 32 / LANES whole rows, contiguous 16-byte pieces of them (bf16, head size 128: two rows of 256
// bytes, four cache lines). Each lane keeps its CH elements of every query of the group in
// registers; the group's partial dot products meet by shuffles within the group. V is read the
// same way: a lane adds p · v for its CH elements over the rows its group reads, the lanes of a
// warp that hold the same elements meet by shuffles, and the 4 warps in shared memory, in order.
// Each warp keeps UNROLL load instructions in flight before it uses any of them.
//
// Grid: (num_kv_heads, num_seqs, num_partitions); block: THREADS. The host launches the
// instance for the cache's element type, head size D and group G, and partitions of at most
// PART_MAX keys.
#include "common.cuh"

#define THREADS 128
#define WARPS (THREADS / 32)
#define PART_MAX 256  // keys per partition; the host refuses more
#define UNROLL 4      // load instructions each warp issues before using their rows

// Elements of a 16-byte load: 4 f32 or 8 bf16.
template <typename T>
struct Chunk;
template <>
struct Chunk<float> {
    static constexpr int N = 4;
};
template <>
struct Chunk<bf16_bits> {
    static constexpr int N = 8;
};

template <typename T, int D, int G>
__device__ void decode_lanes(const float* q, const T* k_cache, const T* v_cache, const u32* rows,
                             const u32* context_lens, const u32* block_tables, float* partial_o,
                             float* partial_ml, int max_blocks, int block_size, int num_heads,
                             int num_kv_heads, int partition_size, float scale) {
    constexpr int CH = Chunk<T>::N;       // elements a lane loads at once
    constexpr int LANES = D / CH;         // lanes reading one row: 8 to 32
    constexpr int ROWS = 32 / LANES;      // rows one warp instruction reads: 1 to 4
    constexpr int STEP = WARPS * ROWS;    // rows the block reads per instruction
    static_assert(LANES <= 32 && 32 % LANES == 0, "a row is read by a power-of-two group of lanes");
    __shared__ long row_s[PART_MAX];      // element offset of each key's row (its slot, its head)
    __shared__ float p_s[G][PART_MAX];    // scores, then exp(s − m)
    __shared__ float o_s[WARPS][G][D];    // each warp's sum of p · v
    __shared__ float ml_s[G][2];

    int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z, num_parts = gridDim.z;
    int ctx = (int)context_lens[seq];
    int begin = part * partition_size, n = max(0, min(ctx, begin + partition_size) - begin);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int sub = lane / LANES, c = lane % LANES;  // which row of an instruction, which chunk of it
    const u32* table = block_tables + (long)seq * max_blocks;
    long kv_stride = (long)num_kv_heads * D;

    // This lane's chunk of every query of the group, times 1/√d.
    float qr[G][CH];
    long q_row = (long)rows[seq] * num_heads * D;
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int e = 0; e < CH; e++) qr[g][e] = q[q_row + (long)(kv_head * G + g) * D + c * CH + e] * scale;
    }

    partition_rows(row_s, table, begin, n, block_size, kv_stride, (long)kv_head * D);
    __syncthreads();

    // ANCHOR: lane_groups
    // Scores: warp w reads rows w·ROWS + sub, then STEP further on, UNROLL instructions at a time.
    // The loop bound is the same for every lane of a warp, so every lane reaches the shuffles.
    // ANCHOR: task_7_4
    for (int j0 = warp * ROWS + sub; j0 - sub < n; j0 += STEP * UNROLL) {
        float k[UNROLL][CH];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int j = j0 + u * STEP;
            if (j < n) {
                load_chunk<CH>(k_cache, row_s[j] + c * CH, k[u]);
            } else {
#pragma unroll
                for (int e = 0; e < CH; e++) k[u][e] = 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int j = j0 + u * STEP;
#pragma unroll
            for (int g = 0; g < G; g++) {
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < CH; e++) s += qr[g][e] * k[u][e];
#pragma unroll
                for (int offset = LANES / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
                if (c == 0 && j < n) p_s[g][j] = s;
            }
        }
    }
    // ANCHOR_END: task_7_4
    // ANCHOR_END: lane_groups
    __syncthreads();

    // Softmax statistics: warp w takes heads w, w + WARPS, ...
    for (int g = warp; g < G; g += WARPS) warp_softmax_stats(p_s[g], n, ml_s[g]);
    __syncthreads();

    // Values: the rows as the scores read them; each lane sums p · v for its chunk.
    float acc[G][CH];
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int e = 0; e < CH; e++) acc[g][e] = 0.0f;
    }
    for (int j0 = warp * ROWS + sub; j0 - sub < n; j0 += STEP * UNROLL) {
        float v[UNROLL][CH];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int j = j0 + u * STEP;
            if (j < n) {
                load_chunk<CH>(v_cache, row_s[j] + c * CH, v[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int j = j0 + u * STEP;
            if (j < n) {
#pragma unroll
                for (int g = 0; g < G; g++) {
                    float p = p_s[g][j];
#pragma unroll
                    for (int e = 0; e < CH; e++) acc[g][e] += p * v[u][e];
                }
            }
        }
    }
    // The ROWS lanes of a warp that hold chunk c summed different keys: add them, then the warps.
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int e = 0; e < CH; e++) {
#pragma unroll
            for (int offset = LANES; offset < 32; offset <<= 1)
                acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], offset);
            if (sub == 0) o_s[warp][g][c * CH + e] = acc[g][e];
        }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < G * D; i += THREADS) {
        int g = i / D, d = i % D;
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) o += o_s[w][g][d];
        long at = (((long)seq * num_heads + kv_head * G + g) * num_parts + part);
        partial_o[at * D + d] = o;
        if (d == 0) {
            partial_ml[2 * at] = ml_s[g][0];
            partial_ml[2 * at + 1] = ml_s[g][1];
        }
    }
}

// One entry point per (cache type, head size, group): paged_decode_lanes_{f32|bf16}_d{D}_g{G}.
#define DECODE_LANES(NAME, T, D, G)                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                              \
        const float* q, const T* k_cache, const T* v_cache, const u32* rows, const u32* context_lens,        \
        const u32* block_tables, float* partial_o, float* partial_ml, int max_blocks, int block_size,       \
        int num_heads, int num_kv_heads, int partition_size, float scale) {                                  \
        decode_lanes<T, D, G>(q, k_cache, v_cache, rows, context_lens, block_tables, partial_o, partial_ml, \
                              max_blocks, block_size, num_heads, num_kv_heads, partition_size, scale);       \
    }

DECODE_LANES(paged_decode_lanes_f32_d64_g1, float, 64, 1)
DECODE_LANES(paged_decode_lanes_f32_d64_g2, float, 64, 2)
DECODE_LANES(paged_decode_lanes_f32_d64_g4, float, 64, 4)
DECODE_LANES(paged_decode_lanes_f32_d64_g8, float, 64, 8)
DECODE_LANES(paged_decode_lanes_f32_d128_g1, float, 128, 1)
DECODE_LANES(paged_decode_lanes_f32_d128_g2, float, 128, 2)
DECODE_LANES(paged_decode_lanes_f32_d128_g4, float, 128, 4)
DECODE_LANES(paged_decode_lanes_f32_d128_g8, float, 128, 8)
DECODE_LANES(paged_decode_lanes_bf16_d64_g1, bf16_bits, 64, 1)
DECODE_LANES(paged_decode_lanes_bf16_d64_g2, bf16_bits, 64, 2)
DECODE_LANES(paged_decode_lanes_bf16_d64_g4, bf16_bits, 64, 4)
DECODE_LANES(paged_decode_lanes_bf16_d64_g8, bf16_bits, 64, 8)
DECODE_LANES(paged_decode_lanes_bf16_d128_g1, bf16_bits, 128, 1)
DECODE_LANES(paged_decode_lanes_bf16_d128_g2, bf16_bits, 128, 2)
DECODE_LANES(paged_decode_lanes_bf16_d128_g4, bf16_bits, 128, 4)
DECODE_LANES(paged_decode_lanes_bf16_d128_g8, bf16_bits, 128, 8)
