// FlashAttention-2 on tensor cores, for a bf16 KV cache and head sizes 64 and 128: the same
// algorithm as flash_prefill.cu (query tiles outside, K/V tiles inside, running max and
// denominator, causal skipping), with both products done by mma.sync (bf16 in, f32
// accumulate). The CPU twin: ch07's `flash_attention`.
//
// One thread block takes the query rows of one sequence for one query head; each of its 4 warps
// owns MF blocks of 16 rows (MF = 1: 64 rows a thread block, MF = 2: 128). For every tile of
// BC = 64 keys, gathered through the block table into shared memory (a key per row; the next
// tile arrives by cp.async while this one is computed on), a warp computes, for each of its
// 16-row blocks,
//   S (16 x 64) = Q (16 x D) · Kᵀ      as 8 x D/16 mma of shape m16n8k16,
// updates its rows' running max m and denominator l, rescales its output O (16 x D), and adds
//   O += P (16 x 64) · V (64 x D)      as D/8 x 4 mma,
// taking P's fragments straight from S's accumulators (the two layouts line up), and the K and
// V fragments from shared memory with ldmatrix (V's transposed on the way: .trans). With MF = 2
// each K and V fragment read from shared memory serves two mma instead of one, and each tile
// copied in serves twice the rows; Q's fragments then come from a shared Q tile (the registers
// go to the second block's O and S).
// Queries and the softmax weights P are rounded to bf16 for the tensor cores (8 significant
// bits), so results agree with the f32 kernels to about 1e-2, not 1e-5; f32 caches and other head
// sizes run flash_prefill.cu.
//
// Fragment layouts of mma.m16n8k16 (lane = 4·g + t, g = lane / 4, t = lane % 4), each register
// holding two consecutive columns (lower column in the lower half):
//   A (16 x 16, rows x k):  a0 = (g, 2t..), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..)
//   B (16 x 8, k x cols):   b0 = (2t.., g), b1 = (2t + 8.., g)   (two consecutive k)
//   C (16 x 8, f32):        c0, c1 = (g, 2t), (g, 2t + 1);  c2, c3 = (g + 8, 2t), (g + 8, 2t + 1)
#include "common.cuh"

#define TC_BC 64
#define TC_WARPS 4
#define TC_PAD 8  // bf16 elements of padding per shared row: fragment reads hit 32 banks

// The PTX instructions, each behind a function (kernels/emulation/ptx_on_threads.h gives each
// its meaning on CPU threads, where KILN_EMULATION is defined).
#ifndef KILN_EMULATION
// Two f32 rounded to bf16 (nearest, ties to even), `lo` in the lower half: one instruction
// (sm_80 and later) where common.cuh's f32_to_bf16 takes five integer ones per value. The
// softmax weights of every tile go through it, so it is part of the work beside the mma.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

// 2^x by the special-function unit alone (relative error about 2^-22; results below 2^-126,
// weights too small to count beside the row's largest, which is 1, flush to 0). exp2f's
// precise form adds a scaling around it for subnormal results.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The four 8 x 8 bf16 matrices whose rows lanes 0-7, 8-15, 16-23 and 24-31 point at, one
// register each, in the B layout above (lane 4g + t: row g, columns 2t, 2t + 1); with .trans,
// transposed (row 2t and 2t + 1, column g).
__device__ __forceinline__ void ldmatrix_x4(u32* r, const bf16_bits* row) {
    u32 at = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const bf16_bits* row) {
    u32 at = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

// Starts an asynchronous copy of 16 bytes from global `src` to shared `dst` (cp.async, sm_80 and
// later): `src_bytes` = 0 reads nothing and fills zeros.
__device__ __forceinline__ void cp_async_16(bf16_bits* dst, const bf16_bits* src, int src_bytes) {
    u32 at = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src), "r"(src_bytes));
}

// Closes this thread's group of cp.async copies started since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// d (16 x 8, f32) += a (16 x 16, bf16) · b (16 x 8, bf16).
__device__ __forceinline__ void mma_16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// The K/V tiles, in dynamic shared memory: two buffers (the tile computed on and the next one,
// arriving), each K then V, [TC_BC][D + TC_PAD] bf16; with MF = 2 the Q tile after them,
// [tc_rows<2>()][D + TC_PAD] bf16. The host asks for their size (`PrefillKernel::shared_bytes`).
DYNAMIC_SHARED(bf16_bits, tc_smem);

// Query rows per thread block.
template <int MF>
__device__ constexpr int tc_rows() {
    return 16 * MF * TC_WARPS;
}

template <int D>
__device__ __forceinline__ bf16_bits (*tc_tile(int buf, int kv))[D + TC_PAD] {
    return reinterpret_cast<bf16_bits(*)[D + TC_PAD]>(tc_smem + (buf * 2 + kv) * TC_BC * (D + TC_PAD));
}

template <int D>
__device__ __forceinline__ bf16_bits (*tc_q_tile())[D + TC_PAD] {
    return reinterpret_cast<bf16_bits(*)[D + TC_PAD]>(tc_smem + 4 * TC_BC * (D + TC_PAD));
}

// Starts copying the K and V rows of keys key0 .. key0 + TC_BC into buffer `buf`, 16 bytes (8
// elements) of one key's row per thread and step, keys past kv_len as zeros; one commit group.
// Thread 2j + h copies the 16-byte chunks 2i + h (0 <= i < D / 16) of key j's row, finding its
// slot once: a warp's copy instruction then reads 16 whole 32-byte sectors, two threads each,
// never half of one (whose other half another instruction would fetch again).
template <int D>
__device__ __forceinline__ void stage_tile(int buf, int key0, int kv_len, const bf16_bits* k_cache,
                                           const bf16_bits* v_cache, const u32* table,
                                           int block_size, int kv_stride, int kv_head) {
    static_assert(32 * TC_WARPS == 2 * TC_BC, "two threads per key");
    bf16_bits(*k_s)[D + TC_PAD] = tc_tile<D>(buf, 0);
    bf16_bits(*v_s)[D + TC_PAD] = tc_tile<D>(buf, 1);
    int j = threadIdx.x >> 1, half = threadIdx.x & 1, key = key0 + j;
    // A key past kv_len copies nothing (zeros land); its source address, row 0, is never read.
    long at = 0;
    int bytes = 0;
    if (key < kv_len) {
        at = key_slot(table, key, block_size) * kv_stride + (long)kv_head * D;
        bytes = 16;
    }
    const bf16_bits* k_row = k_cache + at + half * 8;
    const bf16_bits* v_row = v_cache + at + half * 8;
#pragma unroll
    for (int i = 0; i < D / 16; i++) {
        cp_async_16(&k_s[j][i * 16 + half * 8], k_row + i * 16, bytes);
        cp_async_16(&v_s[j][i * 16 + half * 8], v_row + i * 16, bytes);
    }
    cp_async_commit();
}

// q, out: [rows, num_heads · D] f32; k_cache, v_cache: [slots, num_kv_heads · D] bf16; the other
// arrays as flash_prefill.cu. Grid: (ceil(max rows of a sequence / tc_rows<MF>()), num_heads,
// num_seqs), as the CUDA-core kernel's, its blocks taken in another order (below); block:
// 32 · TC_WARPS.
template <int D, int MF>
__device__ void flash_prefill_tc(const float* q, const bf16_bits* k_cache, const bf16_bits* v_cache,
                                 float* out, const u32* row_start, const u32* start_pos,
                                 const u32* block_tables, int max_blocks, int block_size,
                                 int num_heads, int num_kv_heads, float scale) {
    constexpr int block_rows = tc_rows<MF>();
    // Which tile of which head and sequence this block takes: the grid's blocks in order of their
    // index (x fastest, then y, then z, the order a GPU roughly starts them in) take the last
    // query tile of every head and sequence, then the one before it, and so on. A causal tile's
    // work grows with its position, so the longest tiles start first and the short ones fill in
    // behind them; the blocks started last are short ones.
    long pairs = (long)gridDim.y * gridDim.z;  // (head, sequence) pairs
    long index = blockIdx.x + (long)gridDim.x * (blockIdx.y + (long)gridDim.y * blockIdx.z);
    int tile = (int)(gridDim.x - 1 - index / pairs);
    int head = (int)(index % pairs % gridDim.y), seq = (int)(index % pairs / gridDim.y);
    int kv_head = head / (num_heads / num_kv_heads);
    int seq_rows = (int)(row_start[seq + 1] - row_start[seq]);
    int first = tile * block_rows;
    if (first >= seq_rows) return;
    int tile_rows = min(block_rows, seq_rows - first);
    long row0 = (long)row_start[seq] + first;
    int pos0 = (int)start_pos[seq] + first;
    int kv_len = pos0 + tile_rows;  // keys 0..kv_len are visible to some row of the tile
    int q_stride = num_heads * D, kv_stride = num_kv_heads * D;
    const u32* table = block_tables + (long)seq * max_blocks;

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int warp_row0 = warp * 16 * MF;  // this warp's first row within the tile
    // This thread's two rows of 16-row block f within the tile: warp_row0 + 16f + g, and + 8.

    // Q, scaled by 1/√d · log2(e) (the softmax then uses exp2), rounded to bf16: as A fragments
    // held in registers (MF = 1), or in the shared Q tile, read back by ldmatrix (MF = 2).
    const float q_scale = scale * 1.4426950408889634f;
    u32 qa[MF == 1 ? D / 16 : 1][4];
    if constexpr (MF == 1) {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int r = warp_row0 + g + ((i & 1) ? 8 : 0), col = kk * 16 + 2 * t + ((i & 2) ? 8 : 0);
                float x0 = 0.0f, x1 = 0.0f;
                if (r < tile_rows) {
                    const float* src = q + (row0 + r) * q_stride + head * D + col;
                    x0 = src[0] * q_scale;
                    x1 = src[1] * q_scale;
                }
                qa[kk][i] = pack_bf16(x0, x1);
            }
        }
    } else {
        // Read by every warp after the loop's first barrier.
        bf16_bits(*q_s)[D + TC_PAD] = tc_q_tile<D>();
        for (int i = threadIdx.x; i < block_rows * D; i += 32 * TC_WARPS) {
            int r = i / D, col = i % D;
            float x = r < tile_rows ? q[(row0 + r) * q_stride + head * D + col] * q_scale : 0.0f;
            q_s[r][col] = f32_to_bf16(x);
        }
    }

    float o[MF][D / 8][4];
#pragma unroll
    for (int f = 0; f < MF; f++)
#pragma unroll
        for (int n = 0; n < D / 8; n++) o[f][n][0] = o[f][n][1] = o[f][n][2] = o[f][n][3] = 0.0f;
    // Rows 16f + g and 16f + g + 8 of this warp (l: this thread's share of their sums).
    float m[MF][2], l[MF][2];
#pragma unroll
    for (int f = 0; f < MF; f++) m[f][0] = m[f][1] = -INFINITY, l[f][0] = l[f][1] = 0.0f;

    // ANCHOR: tc_tile_loop
    // Tile it + 1 is copied in (cp.async) while tile it is computed on.
    int tiles = (kv_len + TC_BC - 1) / TC_BC;
    stage_tile<D>(0, 0, kv_len, k_cache, v_cache, table, block_size, kv_stride, kv_head);
    for (int it = 0; it < tiles; it++) {
        int key0 = it * TC_BC, buf = it & 1;
        __syncthreads();  // every warp is done with buffer buf ^ 1 (tile it − 1)
        if (it + 1 < tiles) {
            stage_tile<D>(buf ^ 1, key0 + TC_BC, kv_len, k_cache, v_cache, table, block_size,
                          kv_stride, kv_head);
            cp_async_wait<1>();  // this thread's copies of tile it are in
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // and every thread's
        // A tile whose first key lies past this warp's last row is masked for all its rows: the
        // warp skips it (its m, l and O would not change), and masks only the tiles that reach
        // past its first row. A warp whose rows are all padding (a short sequence's tile, a
        // decode row in a mixed batch) skips every tile: it only helps load them.
        if (warp_row0 >= tile_rows || key0 > pos0 + warp_row0 + 16 * MF - 1) continue;
        bool diagonal = key0 + TC_BC - 1 > pos0 + warp_row0;
        bf16_bits(*k_s)[D + TC_PAD] = tc_tile<D>(buf, 0);
        bf16_bits(*v_s)[D + TC_PAD] = tc_tile<D>(buf, 1);

        // S = Q · Kᵀ for this warp's rows and the tile's 64 keys (8 column blocks of 8 keys),
        // two column blocks per ldmatrix: lanes 0-15 point at block n's keys (dims kk·16.. and
        // kk·16 + 8..), lanes 16-31 at block n + 1's. Each K fragment serves all MF row blocks.
        float s[MF][TC_BC / 8][4];
#pragma unroll
        for (int f = 0; f < MF; f++)
#pragma unroll
            for (int n = 0; n < TC_BC / 8; n++) s[f][n][0] = s[f][n][1] = s[f][n][2] = s[f][n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            u32 a[MF][4];
#pragma unroll
            for (int f = 0; f < MF; f++) {
                if constexpr (MF == 1) {
#pragma unroll
                    for (int i = 0; i < 4; i++) a[f][i] = qa[kk][i];
                } else {
                    // Lanes 0-15 point at the block's rows 0-15, dims kk·16..; lanes 16-31 at the
                    // same rows, dims kk·16 + 8..: the four matrices of the A layout, in order.
                    ldmatrix_x4(a[f], &tc_q_tile<D>()[warp_row0 + 16 * f + (lane & 15)][kk * 16 + (lane >> 4) * 8]);
                }
            }
#pragma unroll
            for (int n = 0; n < TC_BC / 8; n += 2) {
                u32 b[4];
                ldmatrix_x4(b, &k_s[(n + (lane >> 4)) * 8 + (lane & 7)][kk * 16 + (lane & 8)]);
#pragma unroll
                for (int f = 0; f < MF; f++) {
                    mma_16816(s[f][n], a[f], b);
                    mma_16816(s[f][n + 1], a[f], b + 2);
                }
            }
        }

        // Causal mask (and keys past the tile's last row), then the online softmax per row.
        // Each row's 64 scores lie in the 4 threads of its quad: reduce over them with shuffles.
        // Only diagonal tiles are masked, behind a branch the whole warp takes or skips, so the
        // other tiles issue none of its compares.
#pragma unroll
        for (int f = 0; f < MF; f++) {
            if (diagonal) {
#pragma unroll
                for (int n = 0; n < TC_BC / 8; n++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int r = warp_row0 + 16 * f + g + ((i & 2) ? 8 : 0);
                        int key = key0 + n * 8 + 2 * t + (i & 1);
                        if (key > pos0 + r) s[f][n][i] = -INFINITY;
                    }
                }
            }
            float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < TC_BC / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) row_max[i >> 1] = fmaxf(row_max[i >> 1], s[f][n][i]);
            }
            float correction[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
                row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
                // Key 0 is visible to every row, so from the first tile on m is finite.
                float m_new = fmaxf(m[f][h], row_max[h]);
                correction[h] = exp2_approx(m[f][h] - m_new);  // 0 on the first tile (m = −∞)
                m[f][h] = m_new;
                l[f][h] *= correction[h];
            }
#pragma unroll
            for (int n = 0; n < TC_BC / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float p = exp2_approx(s[f][n][i] - m[f][i >> 1]);  // 0 where masked
                    s[f][n][i] = p;
                    l[f][i >> 1] += p;
                }
            }
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                o[f][n][0] *= correction[0];
                o[f][n][1] *= correction[0];
                o[f][n][2] *= correction[1];
                o[f][n][3] *= correction[1];
            }
        }

        // O += P · V: P's A fragment for keys 16·kk.. is S's column blocks 2·kk and 2·kk + 1;
        // V's fragments come transposed by ldmatrix, two blocks of 8 dims at a time: lanes 0-15
        // point at keys 16·kk.. (rows of dims n·8..), lanes 16-31 at the same keys for dims (n+1)·8..
        // Each V fragment serves all MF row blocks.
#pragma unroll
        for (int kk = 0; kk < TC_BC / 16; kk++) {
            u32 pa[MF][4];
#pragma unroll
            for (int f = 0; f < MF; f++) {
                pa[f][0] = pack_bf16(s[f][2 * kk][0], s[f][2 * kk][1]);
                pa[f][1] = pack_bf16(s[f][2 * kk][2], s[f][2 * kk][3]);
                pa[f][2] = pack_bf16(s[f][2 * kk + 1][0], s[f][2 * kk + 1][1]);
                pa[f][3] = pack_bf16(s[f][2 * kk + 1][2], s[f][2 * kk + 1][3]);
            }
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                u32 b[4];
                ldmatrix_x4_trans(b, &v_s[kk * 16 + (lane & 15)][(n + (lane >> 4)) * 8]);
#pragma unroll
                for (int f = 0; f < MF; f++) {
                    mma_16816(o[f][n], pa[f], b);
                    mma_16816(o[f][n + 1], pa[f], b + 2);
                }
            }
        }
    }
    // ANCHOR_END: tc_tile_loop

    // The denominators: each thread holds a quarter of its rows' sums.
#pragma unroll
    for (int f = 0; f < MF; f++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            l[f][h] += __shfl_xor_sync(0xffffffffu, l[f][h], 1);
            l[f][h] += __shfl_xor_sync(0xffffffffu, l[f][h], 2);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = warp_row0 + 16 * f + g + 8 * h;
            if (r >= tile_rows) continue;
            float inv_l = 1.0f / l[f][h];
            float* dst = out + (row0 + r) * q_stride + head * D + 2 * t;
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                dst[n * 8] = o[f][n][2 * h] * inv_l;
                dst[n * 8 + 1] = o[f][n][2 * h + 1] * inv_l;
            }
        }
    }
}

#define TC_ARGS                                                                                              \
    const float *q, const bf16_bits *k_cache, const bf16_bits *v_cache, float *out, const u32 *row_start,  \
        const u32 *start_pos, const u32 *block_tables, int max_blocks, int block_size, int num_heads,      \
        int num_kv_heads, float scale
#define TC_PASS q, k_cache, v_cache, out, row_start, start_pos, block_tables, max_blocks, block_size, num_heads, num_kv_heads, scale

// 64 rows a block, at least 3 blocks per multiprocessor: registers capped at 65536 / (3 · 128) =
// 170 a thread. Uncapped the compiler took 174, which with the 70 KB of tiles (d = 128) left room
// for 2 blocks, 8 warps: 12.5% occupancy, too few to hide the loads (Nsight Compute on the H200).
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 3) flash_prefill_tc_bf16_d64(TC_ARGS) {
    flash_prefill_tc<64, 1>(TC_PASS);
}

extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 3) flash_prefill_tc_bf16_d128(TC_ARGS) {
    flash_prefill_tc<128, 1>(TC_PASS);
}

// 128 rows a block: two blocks per multiprocessor (registers up to 255 a thread; 102 KB of
// shared memory each at d = 128).
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) flash_prefill_tc_rows128_bf16_d64(TC_ARGS) {
    flash_prefill_tc<64, 2>(TC_PASS);
}

extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) flash_prefill_tc_rows128_bf16_d128(TC_ARGS) {
    flash_prefill_tc<128, 2>(TC_PASS);
}
