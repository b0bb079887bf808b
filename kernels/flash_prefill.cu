// FlashAttention-2 over the paged KV cache, for the query rows of a flattened batch of
// sequences (prompt chunks, decode rows, drafts to verify): causal, grouped-query, each
// sequence reading its K/V through its block table. The CPU twin: ch07's `flash_attention`
// (query tiles outside, K/V tiles inside; running max, running denominator, rescaled output).
//
// One thread block takes BR query rows of one sequence for one query head. Its 4 warps own 4
// rows each. For every K/V tile of BC positions (gathered from the blocks into shared memory),
// lane j scores key j against the warp's rows, the warp updates each row's running max m and
// denominator l, rescales its output by exp(m_old − m_new), and adds p · V. Tiles wholly past the
// last row's position are never loaded (causal skipping); inside the last tile keys past a row's
// position are masked.
#include "common.cuh"

#define BR 16            // query rows per block: 4 warps x 4 rows
#define BC 32            // keys per tile: one per lane
#define ROWS_PER_WARP 4
#define HEAD_DIM_MAX 128  // the host refuses larger heads

// q, out: [rows, num_heads · head_dim] f32; k_cache, v_cache: [slots, num_kv_heads · head_dim];
// row_start: [num_seqs + 1] (sequence s owns rows row_start[s]..row_start[s+1]);
// start_pos: [num_seqs] (position of each sequence's first row); block_tables: [num_seqs,
// max_blocks]. Grid: (ceil(max rows of a sequence / BR), num_heads, num_seqs); block: 128.
template <typename T>
__device__ void flash_prefill(const float* q, const T* k_cache, const T* v_cache, float* out,
                              const u32* row_start, const u32* start_pos, const u32* block_tables,
                              int max_blocks, int block_size, int num_heads, int num_kv_heads,
                              int head_dim, float scale) {
    __shared__ float q_tile[BR][HEAD_DIM_MAX];
    __shared__ float k_tile[BC][HEAD_DIM_MAX + 1];  // +1: lanes read column d of 32 rows
    __shared__ float v_tile[BC][HEAD_DIM_MAX];

    int seq = blockIdx.z, head = blockIdx.y;
    int kv_head = head / (num_heads / num_kv_heads);
    int seq_rows = (int)(row_start[seq + 1] - row_start[seq]);
    int first = blockIdx.x * BR;  // the tile's first row within the sequence
    if (first >= seq_rows) return;
    int tile_rows = min(BR, seq_rows - first);
    long row0 = (long)row_start[seq] + first;
    int pos0 = (int)start_pos[seq] + first;  // position of the tile's first row
    int kv_len = pos0 + tile_rows;            // keys 0..kv_len are visible to some row
    int q_stride = num_heads * head_dim, kv_stride = num_kv_heads * head_dim;
    const u32* table = block_tables + (long)seq * max_blocks;

    for (int i = threadIdx.x; i < BR * head_dim; i += blockDim.x) {
        int r = i / head_dim, d = i % head_dim;
        q_tile[r][d] = r < tile_rows ? q[(row0 + r) * q_stride + head * head_dim + d] * scale : 0.0f;
    }

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][HEAD_DIM_MAX / 32];
    for (int i = 0; i < ROWS_PER_WARP; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        for (int t = 0; t < HEAD_DIM_MAX / 32; t++) acc[i][t] = 0.0f;
    }

    // ANCHOR: tile_loop
    for (int key0 = 0; key0 < kv_len; key0 += BC) {
        __syncthreads();  // the previous tile is no longer read (and q_tile is written)
        for (int i = threadIdx.x; i < BC * head_dim; i += blockDim.x) {
            int j = i / head_dim, d = i % head_dim, key = key0 + j;
            float kx = 0.0f, vx = 0.0f;
            if (key < kv_len) {
                long at = key_slot(table, key, block_size) * kv_stride + kv_head * head_dim + d;
                kx = load_f32(k_cache, at);
                vx = load_f32(v_cache, at);
            }
            k_tile[j][d] = kx;
            v_tile[j][d] = vx;
        }
        __syncthreads();
        // A warp whose rows are all padding (a short sequence's tile) has nothing to compute;
        // it only helps load the tiles.
        if (warp * ROWS_PER_WARP >= tile_rows) continue;

        // Scores of key key0 + lane against the warp's rows.
        float s[ROWS_PER_WARP];
        for (int i = 0; i < ROWS_PER_WARP; i++) s[i] = 0.0f;
        for (int d = 0; d < head_dim; d++) {
            float kx = k_tile[lane][d];
            for (int i = 0; i < ROWS_PER_WARP; i++) s[i] += q_tile[warp * ROWS_PER_WARP + i][d] * kx;
        }
        int key = key0 + lane;
        for (int i = 0; i < ROWS_PER_WARP; i++) {
            int r = warp * ROWS_PER_WARP + i;
            bool visible = r < tile_rows && key <= pos0 + r;
            float score = visible ? s[i] : -INFINITY;
            float m_new = fmaxf(m[i], warp_max(score));
            if (m_new == -INFINITY) {  // no visible key for this row yet (or a padding row)
                s[i] = 0.0f;
                continue;
            }
            float p = visible ? expf(score - m_new) : 0.0f;
            float correction = expf(m[i] - m_new);  // 0 on the first visible tile
            l[i] = l[i] * correction + warp_sum(p);
            m[i] = m_new;
            for (int t = 0; t < HEAD_DIM_MAX / 32; t++) acc[i][t] *= correction;
            s[i] = p;
        }
        for (int j = 0; j < BC; j++) {
            float vx[HEAD_DIM_MAX / 32];
            for (int t = 0; t < HEAD_DIM_MAX / 32; t++) {
                int d = lane + 32 * t;
                vx[t] = d < head_dim ? v_tile[j][d] : 0.0f;
            }
            for (int i = 0; i < ROWS_PER_WARP; i++) {
                float p = __shfl_sync(0xffffffffu, s[i], j);
                for (int t = 0; t < HEAD_DIM_MAX / 32; t++) acc[i][t] += p * vx[t];
            }
        }
    }

    // ANCHOR_END: tile_loop
    for (int i = 0; i < ROWS_PER_WARP; i++) {
        int r = warp * ROWS_PER_WARP + i;
        if (r >= tile_rows) continue;
        float inv_l = 1.0f / l[i];
        for (int t = 0; t < HEAD_DIM_MAX / 32; t++) {
            int d = lane + 32 * t;
            if (d < head_dim) out[(row0 + r) * q_stride + head * head_dim + d] = acc[i][t] * inv_l;
        }
    }
}

extern "C" __global__ void flash_prefill_f32(const float* q, const float* k_cache, const float* v_cache,
                                             float* out, const u32* row_start, const u32* start_pos,
                                             const u32* block_tables, int max_blocks, int block_size,
                                             int num_heads, int num_kv_heads, int head_dim, float scale) {
    flash_prefill(q, k_cache, v_cache, out, row_start, start_pos, block_tables, max_blocks, block_size,
                  num_heads, num_kv_heads, head_dim, scale);
}

extern "C" __global__ void flash_prefill_bf16(const float* q, const bf16_bits* k_cache,
                                              const bf16_bits* v_cache, float* out, const u32* row_start,
                                              const u32* start_pos, const u32* block_tables, int max_blocks,
                                              int block_size, int num_heads, int num_kv_heads, int head_dim,
                                              float scale) {
    flash_prefill(q, k_cache, v_cache, out, row_start, start_pos, block_tables, max_blocks, block_size,
                  num_heads, num_kv_heads, head_dim, scale);
}
