// The tensor-core FlashAttention-2 prefill (flash_prefill_tc.cu) on CPU threads, its PTX
// instructions emulated (ptx_on_threads.h), against causal attention computed in f64 over the
// same bf16 K/V: head sizes 64 and 128, GQA, block sizes 1 to 17, sequences of 1 to 150 new rows
// after 0 to 100 cached positions (so a sequence spans several 64-row blocks and several 64-key
// tiles, partly filled). Within 1e-2 (relative, or absolute below 1), the GPU test's bound: the
// kernel rounds q and the softmax weights to bf16. Exits non-zero on any failure.
//
// fixtures/scripts/emulate_kernels.sh builds and runs it under ThreadSanitizer.
#include "ptx_on_threads.h"
#include "common.cuh"
#include "flash_prefill_tc.cu"
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

static unsigned short to_bf16(float f) {
    unsigned bits = __float_as_uint(f);
    return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <int D>
bool check(std::mt19937& rng, int group, int num_kv_heads) {
    std::uniform_real_distribution<float> uni(-1, 1);
    int num_heads = group * num_kv_heads, q_dim = num_heads * D, kv_dim = num_kv_heads * D;
    int block_sizes[] = {1, 5, 16, 17};
    int bs = block_sizes[rng() % 4], num_seqs = 1 + rng() % 2;
    std::vector<int> start(num_seqs), rows(num_seqs);
    std::vector<u32> row_start(num_seqs + 1, 0), start_pos(num_seqs);
    int needed = 0, max_rows = 0, max_blocks = 0;
    for (int s = 0; s < num_seqs; s++) {
        start[s] = rng() % 101;
        rows[s] = 1 + rng() % 150;
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
    std::vector<unsigned short> k(pool), v(pool);
    for (auto& x : k) x = to_bf16(uni(rng));
    for (auto& x : v) x = to_bf16(uni(rng));
    std::vector<float> q(row_start[num_seqs] * q_dim), out(q.size(), NAN);
    for (auto& x : q) x = uni(rng);
    float scale = 1.0f / std::sqrt((float)D);
    dim3v grid{(unsigned)((max_rows + TC_BR - 1) / TC_BR), (unsigned)num_heads, (unsigned)num_seqs};
    launch(grid, 32 * TC_WARPS, [&] {
        if (D == 64)
            flash_prefill_tc_bf16_d64(q.data(), k.data(), v.data(), out.data(), row_start.data(), start_pos.data(),
                                      tables.data(), max_blocks, bs, num_heads, num_kv_heads, scale);
        else
            flash_prefill_tc_bf16_d128(q.data(), k.data(), v.data(), out.data(), row_start.data(), start_pos.data(),
                                       tables.data(), max_blocks, bs, num_heads, num_kv_heads, scale);
    });
    auto at = [&](const std::vector<unsigned short>& c, int s, int pos, int kh, int e) {
        size_t slot = (size_t)tables[s * max_blocks + pos / bs] * bs + pos % bs;
        return (double)__uint_as_float((unsigned)c[slot * kv_dim + kh * D + e] << 16);
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
                    for (int e = 0; e < D; e++) dot += qr[e] * at(k, s, j, kh, e);
                    p[j] = dot * scale;
                    m = std::max(m, p[j]);
                }
                for (auto& x : p) l += x = std::exp(x - m);
                for (int e = 0; e < D; e++) {
                    double o = 0;
                    for (int j = 0; j <= pos; j++) o += p[j] * at(v, s, j, kh, e);
                    o /= l;
                    double got = out[(row_start[s] + r) * q_dim + h * D + e];
                    double err = std::fabs(got - o) / std::max(1.0, std::fabs(o));
                    if (!(err <= worst)) worst = std::isnan(err) ? INFINITY : err;
                }
            }
    bool ok = worst <= 1e-2;
    printf("flash_prefill_tc d %d heads %d/%d block %d seqs %d (rows %d..): worst %.2e %s\n", D, num_heads,
           num_kv_heads, bs, num_seqs, rows[0], worst, ok ? "ok" : "FAIL");
    return ok;
}

// prefill_check [SEED]
int main(int argc, char** argv) {
    std::mt19937 rng(argc > 1 ? atoi(argv[1]) : 1);
    int fails = 0;
    fails += !check<64>(rng, 1, 1);
    fails += !check<64>(rng, 4, 1);
    fails += !check<128>(rng, 2, 2);
    fails += !check<128>(rng, 1, 1);
    printf("%d failures\n", fails);
    return fails != 0;
}
