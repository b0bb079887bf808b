// The FlashAttention-2 prefill kernels on CPU threads against causal attention computed in f64
// over the same K/V: the tensor-core one (flash_prefill_tc.cu, bf16 K/V, head sizes 64 and 128;
// both its variants, 64 and 128 query rows a block; its PTX instructions emulated by
// ptx_on_threads.h) within 1e-2, the GPU test's bound (it rounds
// q and the softmax weights to bf16), and the CUDA-core one (flash_prefill.cu, f32 or bf16 K/V,
// any even head size) within 1e-5 (relative, or absolute below 1). GQA, block sizes 1 to 17,
// sequences of new rows (up to 150 or 200 on tensor cores, 40 on CUDA cores) after 0 to 100 cached
// positions, so that a sequence spans several query blocks and K/V tiles, partly filled. Exits
// non-zero on any failure.
//
// fixtures/scripts/emulate_kernels.sh builds and runs it under ThreadSanitizer.
#include "ptx_on_threads.h"
#include "common.cuh"
#include "flash_prefill.cu"
#include "flash_prefill_tc.cu"
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

enum class Kernel { TensorCores, TensorCoresRows128, CudaCoresF32, CudaCoresBf16 };

// One random case on `kernel`, head size d (64 or 128 on tensor cores), sequences of 1 to
// `max_new` new rows; the first sequence's rows start at `start0` when it is not −1 (and then
// there are `max_new` of them).
bool check(std::mt19937& rng, Kernel kernel, int D, int group, int num_kv_heads, int max_new, int start0 = -1) {
    std::uniform_real_distribution<float> uni(-1, 1);
    int num_heads = group * num_kv_heads, q_dim = num_heads * D, kv_dim = num_kv_heads * D;
    int block_sizes[] = {1, 5, 16, 17};
    int bs = block_sizes[rng() % 4], num_seqs = 1 + rng() % 2;
    std::vector<int> start(num_seqs), rows(num_seqs);
    std::vector<u32> row_start(num_seqs + 1, 0), start_pos(num_seqs);
    int needed = 0, max_rows = 0, max_blocks = 0;
    for (int s = 0; s < num_seqs; s++) {
        start[s] = rng() % 101;
        rows[s] = 1 + rng() % max_new;
        if (s == 0 && start0 >= 0) start[s] = start0, rows[s] = max_new;
        start_pos[s] = start[s];
        row_start[s + 1] = row_start[s] + rows[s];
        int blocks = (start[s] + rows[s] + bs - 1) / bs;
        needed += blocks;
        max_blocks = std::max(max_blocks, blocks);
        max_rows = std::max(max_rows, rows[s]);
    }
    int num_blocks = needed + 2;
    std::vector<u32> ids(num_blocks);
    for (int i = 0; i < num_blocks; i++) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<u32> tables(num_seqs * max_blocks, 0);
    for (int s = 0, next = 0; s < num_seqs; s++)
        for (int b = 0; b < (start[s] + rows[s] + bs - 1) / bs; b++) tables[s * max_blocks + b] = ids[next++];
    size_t pool = (size_t)num_blocks * bs * kv_dim;
    bool bf16 = kernel != Kernel::CudaCoresF32;
    std::vector<unsigned short> k(pool), v(pool);  // bf16 caches
    std::vector<float> kf(pool), vf(pool);         // the values every kernel reads, as f32
    for (size_t i = 0; i < pool; i++) {
        kf[i] = uni(rng), vf[i] = uni(rng);
        k[i] = f32_to_bf16(kf[i]), v[i] = f32_to_bf16(vf[i]);
        if (bf16) kf[i] = __uint_as_float((unsigned)k[i] << 16), vf[i] = __uint_as_float((unsigned)v[i] << 16);
    }
    std::vector<float> q(row_start[num_seqs] * q_dim), out(q.size(), NAN);
    for (auto& x : q) x = uni(rng);
    float scale = 1.0f / std::sqrt((float)D);
    bool tensor_cores = kernel == Kernel::TensorCores || kernel == Kernel::TensorCoresRows128;
    int rows_per_block = kernel == Kernel::TensorCores          ? tc_rows<1>()
                         : kernel == Kernel::TensorCoresRows128 ? tc_rows<2>()
                                                                : BR;
    dim3v grid{(unsigned)((max_rows + rows_per_block - 1) / rows_per_block), (unsigned)num_heads,
               (unsigned)num_seqs};
    launch(grid, 128, [&] {
        const u32 *rs = row_start.data(), *sp = start_pos.data(), *bt = tables.data();
        switch (kernel) {
            case Kernel::TensorCores:
                if (D == 64)
                    flash_prefill_tc_bf16_d64(q.data(), k.data(), v.data(), out.data(), rs, sp, bt, max_blocks, bs,
                                              num_heads, num_kv_heads, scale);
                else
                    flash_prefill_tc_bf16_d128(q.data(), k.data(), v.data(), out.data(), rs, sp, bt, max_blocks, bs,
                                               num_heads, num_kv_heads, scale);
                break;
            case Kernel::TensorCoresRows128:
                if (D == 64)
                    flash_prefill_tc_rows128_bf16_d64(q.data(), k.data(), v.data(), out.data(), rs, sp, bt, max_blocks,
                                                      bs, num_heads, num_kv_heads, scale);
                else
                    flash_prefill_tc_rows128_bf16_d128(q.data(), k.data(), v.data(), out.data(), rs, sp, bt,
                                                       max_blocks, bs, num_heads, num_kv_heads, scale);
                break;
            case Kernel::CudaCoresF32:
                flash_prefill_f32(q.data(), kf.data(), vf.data(), out.data(), rs, sp, bt, max_blocks, bs, num_heads,
                                  num_kv_heads, D, scale);
                break;
            case Kernel::CudaCoresBf16:
                flash_prefill_bf16(q.data(), k.data(), v.data(), out.data(), rs, sp, bt, max_blocks, bs, num_heads,
                                   num_kv_heads, D, scale);
                break;
        }
    });
    auto at = [&](const std::vector<float>& c, int s, int pos, int kh, int e) {
        size_t slot = (size_t)tables[s * max_blocks + pos / bs] * bs + pos % bs;
        return (double)c[slot * kv_dim + kh * D + e];
    };
    double worst = 0;
    for (int s = 0; s < num_seqs; s++)
        for (int r = 0; r < rows[s]; r++)
            for (int h = 0; h < num_heads; h++) {
                int pos = start[s] + r, kh = h / group;
                const float* qr = &q[(row_start[s] + r) * q_dim + h * D];
                std::vector<double> p(pos + 1);
                double m = -1e300, l = 0;
                for (int j = 0; j <= pos; j++) {
                    double dot = 0;
                    for (int e = 0; e < D; e++) dot += qr[e] * at(kf, s, j, kh, e);
                    p[j] = dot * scale;
                    m = std::max(m, p[j]);
                }
                for (auto& x : p) l += x = std::exp(x - m);
                for (int e = 0; e < D; e++) {
                    double o = 0;
                    for (int j = 0; j <= pos; j++) o += p[j] * at(vf, s, j, kh, e);
                    o /= l;
                    double got = out[(row_start[s] + r) * q_dim + h * D + e];
                    double err = std::fabs(got - o) / std::max(1.0, std::fabs(o));
                    if (!(err <= worst)) worst = std::isnan(err) ? INFINITY : err;
                }
            }
    bool ok = worst <= (tensor_cores ? 1e-2 : 1e-5);
    const char* name = kernel == Kernel::TensorCores          ? "flash_prefill_tc_bf16"
                       : kernel == Kernel::TensorCoresRows128 ? "flash_prefill_tc_rows128_bf16"
                       : kernel == Kernel::CudaCoresF32       ? "flash_prefill_f32"
                                                              : "flash_prefill_bf16";
    printf("%s d %d heads %d/%d block %d seqs %d (rows %d..): worst %.2e %s\n", name, D, num_heads,
           num_kv_heads, bs, num_seqs, rows[0], worst, ok ? "ok" : "FAIL");
    return ok;
}

// prefill_check [SEED]
int main(int argc, char** argv) {
    std::mt19937 rng(argc > 1 ? atoi(argv[1]) : 1);
    int fails = 0;
    fails += !check(rng, Kernel::TensorCores, 64, 1, 1, 150);
    fails += !check(rng, Kernel::TensorCores, 64, 4, 1, 150);
    fails += !check(rng, Kernel::TensorCores, 128, 2, 2, 150);
    fails += !check(rng, Kernel::TensorCores, 128, 1, 1, 150);
    // 128 rows a block: 200 rows span two blocks, the last partly filled.
    fails += !check(rng, Kernel::TensorCoresRows128, 64, 2, 1, 200);
    fails += !check(rng, Kernel::TensorCoresRows128, 128, 2, 2, 200);
    // A warp skips a K/V tile whose first key is past its last row, and masks only a tile that
    // reaches past its first row. Rows from position 1 put a tile's first key (64) at a warp's
    // last row (63 = 1 + 62: the 64-row block's warp 3, the 128-row block's warp 1); rows from
    // 30 put a tile's last key (63) one past a warp's first row (62 = 30 + 32: warp 2 of a
    // 64-row block, warp 1 of a 128-row one).
    for (int start0 : {1, 30}) {
        fails += !check(rng, Kernel::TensorCores, 64, 1, 1, 70, start0);
        fails += !check(rng, Kernel::TensorCoresRows128, 64, 1, 1, 70, start0);
    }
    // The CUDA-core kernel's blocks are 16 rows and its tiles 32 keys: 40 rows span several.
    fails += !check(rng, Kernel::CudaCoresF32, 24, 3, 1, 40);
    fails += !check(rng, Kernel::CudaCoresBf16, 66, 2, 1, 40);
    printf("%d failures\n", fails);
    return fails != 0;
}
