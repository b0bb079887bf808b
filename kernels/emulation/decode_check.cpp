// Both split-K decode kernels (paged_decode.cu and paged_decode_lanes.cu, each finished by
// paged_decode_merge) on CPU threads (cuda_on_threads.h) against attention computed in f64, on
// random shapes: GQA groups of 1 to 8, head sizes 64 and 128, block sizes 1 to 17, partitions
// of 7 to 256 keys, contexts of 1 to 300 positions, f32 and bf16 caches; and the two kernels
// that write a bf16 rounding beside their f32 output (add_rmsnorm, silu_mul) against their
// definitions; and argmax_rows (greedy sampling on the device) against the CPU sampler's rule.
// Prints one line per case and exits non-zero if any output is off by more than
// 1e-5 (relative, or absolute below 1) or any rounding is not the f32 output's.
//
// fixtures/scripts/emulate_kernels.sh builds and runs it under ThreadSanitizer.
#include "cuda_on_threads.h"
#include "common.cuh"
#include "paged_decode.cu"
#include "paged_decode_lanes.cu"
#include "rmsnorm.cu"
#include "silu_mul.cu"
#include "argmax.cu"
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

// f32 to bf16 bits, round to nearest even, as the executor stores a bf16 cache: written apart
// from common.cuh's f32_to_bf16, so that the rounding checks below do not take the kernels' own
// rounding as their reference.
static unsigned short to_bf16(float f) {
    unsigned bits = __float_as_uint(f);
    unsigned rounding = 0x7fffu + ((bits >> 16) & 1u);
    return (unsigned short)((bits + rounding) >> 16);
}

template <typename T, int D, int G>
void run_lanes(const float* q, const T* k, const T* v, const u32* rows, const u32* lens, const u32* tables,
               float* po, float* pml, int max_blocks, int bs, int nh, int nkv, int part, float scale,
               dim3v grid) {
    launch(grid, 128, [&] { decode_lanes<T, D, G>(q, k, v, rows, lens, tables, po, pml, max_blocks, bs, nh, nkv, part, scale); });
}

// One random case on one kernel (`lanes`: paged_decode_lanes.cu, else paged_decode.cu).
template <typename T>
bool check(std::mt19937& rng, bool lanes, int nh, int nkv, int d, int bs, int part, int num_seqs) {
    std::uniform_real_distribution<float> uni(-1, 1);
    int kv_dim = nkv * d, q_dim = nh * d, group = nh / nkv;
    std::vector<int> ctx(num_seqs);
    int needed = 0, max_ctx = 0;
    for (auto& c : ctx) { c = std::uniform_int_distribution<int>(1, 300)(rng); needed += (c + bs - 1) / bs; max_ctx = std::max(max_ctx, c); }
    int num_blocks = needed + 3;
    std::vector<u32> ids(num_blocks);
    for (int i = 0; i < num_blocks; i++) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    int max_blocks = (max_ctx + bs - 1) / bs;
    std::vector<u32> tables(num_seqs * max_blocks, 0), rows(num_seqs), lens(num_seqs);
    int next = 0;
    for (int s = 0; s < num_seqs; s++) {
        rows[s] = s; lens[s] = ctx[s];
        for (int b = 0; b < (ctx[s] + bs - 1) / bs; b++) tables[s * max_blocks + b] = ids[next++];
    }
    size_t pool = (size_t)num_blocks * bs * kv_dim;
    std::vector<float> kf(pool), vf(pool), q(num_seqs * q_dim);
    std::vector<T> kt(pool), vt(pool);
    for (size_t i = 0; i < pool; i++) {
        float a = uni(rng), b = uni(rng);
        if constexpr (sizeof(T) == 2) { kt[i] = to_bf16(a); vt[i] = to_bf16(b); kf[i] = bf16_to_f32(kt[i]); vf[i] = bf16_to_f32(vt[i]); }
        else { kt[i] = a; vt[i] = b; kf[i] = a; vf[i] = b; }
    }
    for (auto& x : q) x = uni(rng);
    float scale = 1.0f / std::sqrt((float)d);
    int parts = (max_ctx + part - 1) / part;
    std::vector<float> po((size_t)num_seqs * nh * parts * d, NAN), pml((size_t)num_seqs * nh * parts * 2, NAN), out(num_seqs * q_dim, NAN);
    dim3v grid{(unsigned)nkv, (unsigned)num_seqs, (unsigned)parts};
    if (!lanes) {
        launch(grid, 128, [&] {
            if constexpr (sizeof(T) == 2) paged_decode_bf16(q.data(), kt.data(), vt.data(), rows.data(), lens.data(), tables.data(), po.data(), pml.data(), max_blocks, bs, nh, nkv, d, part, scale);
            else paged_decode_f32(q.data(), kt.data(), vt.data(), rows.data(), lens.data(), tables.data(), po.data(), pml.data(), max_blocks, bs, nh, nkv, d, part, scale);
        });
    } else {
#define CASE(DD, GG) if (d == DD && group == GG) run_lanes<T, DD, GG>(q.data(), kt.data(), vt.data(), rows.data(), lens.data(), tables.data(), po.data(), pml.data(), max_blocks, bs, nh, nkv, part, scale, grid); else
        CASE(64, 1) CASE(64, 2) CASE(64, 4) CASE(64, 8) CASE(128, 1) CASE(128, 2) CASE(128, 4) CASE(128, 8) { printf("no instance\n"); return false; }
    }
    launch({(unsigned)nh, (unsigned)num_seqs, 1}, 128, [&] { paged_decode_merge(po.data(), pml.data(), rows.data(), out.data(), nh, d, parts); });
    double worst = 0;
    for (int s = 0; s < num_seqs; s++)
        for (int h = 0; h < nh; h++) {
            int kh = h / group;
            std::vector<double> sc(ctx[s]);
            double m = -1e300;
            for (int p = 0; p < ctx[s]; p++) {
                size_t slot = (size_t)tables[s * max_blocks + p / bs] * bs + p % bs;
                double acc = 0;
                for (int e = 0; e < d; e++) acc += (double)q[s * q_dim + h * d + e] * kf[slot * kv_dim + kh * d + e];
                sc[p] = acc * scale; m = std::max(m, sc[p]);
            }
            double l = 0;
            for (auto& x : sc) { x = std::exp(x - m); l += x; }
            for (int e = 0; e < d; e++) {
                double o = 0;
                for (int p = 0; p < ctx[s]; p++) {
                    size_t slot = (size_t)tables[s * max_blocks + p / bs] * bs + p % bs;
                    o += sc[p] * vf[slot * kv_dim + kh * d + e];
                }
                o /= l;
                double got = out[s * q_dim + h * d + e];
                double err = std::fabs(got - o) / std::max(1.0, std::fabs(o));
                if (!(err <= worst)) worst = std::isnan(err) ? INFINITY : err;
            }
        }
    bool ok = worst <= 1e-5;
    printf("%s %s heads %d/%d d %d block %d part %d seqs %d: worst %.2e %s\n", lanes ? "lanes" : "thread", sizeof(T) == 2 ? "bf16" : "f32", nh, nkv, d, bs, part, num_seqs, worst, ok ? "ok" : "FAIL");
    return ok;
}

// add_rmsnorm and silu_mul with their bf16 outputs, rows of a width that is not a multiple of
// the block, against f64 and against their own f32 outputs rounded.
bool check_elementwise(std::mt19937& rng) {
    std::uniform_real_distribution<float> uni(-1, 1);
    int rows = 3, dim = 1000;
    std::vector<float> residual(rows * dim), delta(rows * dim), weight(dim), out(rows * dim);
    std::vector<unsigned short> out16(rows * dim);
    for (auto& x : residual) x = uni(rng);
    for (auto& x : delta) x = uni(rng);
    for (auto& x : weight) x = uni(rng);
    std::vector<float> before = residual;
    launch({(unsigned)rows, 1, 1}, 256, [&] {
        add_rmsnorm(residual.data(), delta.data(), weight.data(), out.data(), out16.data(), dim, 1e-5f);
    });
    double worst = 0;
    bool rounded = true;
    for (int r = 0; r < rows; r++) {
        double sum_sq = 0;
        for (int d = 0; d < dim; d++) {
            double x = (double)before[r * dim + d] + delta[r * dim + d];
            sum_sq += x * x;
        }
        double inv = 1.0 / std::sqrt(sum_sq / dim + 1e-5);
        for (int d = 0; d < dim; d++) {
            double x = (double)before[r * dim + d] + delta[r * dim + d];
            double want = x * inv * weight[d];
            worst = std::max(worst, std::fabs(out[r * dim + d] - want) / std::max(1.0, std::fabs(want)));
            rounded &= out16[r * dim + d] == to_bf16(out[r * dim + d]);
        }
    }
    std::vector<float> act(rows * dim);
    launch({2, 1, 1}, 128, [&] { silu_mul(residual.data(), delta.data(), act.data(), out16.data(), (long)rows * dim); });
    for (int i = 0; i < rows * dim; i++) {
        double g = residual[i], want = g / (1.0 + std::exp(-g)) * delta[i];
        worst = std::max(worst, std::fabs(act[i] - want) / std::max(1.0, std::fabs(want)));
        rounded &= out16[i] == to_bf16(act[i]);
    }
    bool ok = worst <= 1e-5 && rounded;
    printf("add_rmsnorm and silu_mul with bf16 outputs: worst %.2e, roundings %s: %s\n", worst,
           rounded ? "equal" : "DIFFER", ok ? "ok" : "FAIL");
    return ok;
}

// argmax_rows over rows of `vocab` logits, `threads` a row (the executor launches 1024; fewer
// keep ThreadSanitizer quick and change only how many warps the last loop reduces):
// random values with the maximum planted twice (the first must win), NaN scattered, a row whose
// maximum is +inf twice, a row whose only maxima are -0.0 then 0.0 (equal: the first), and a row
// of nothing but -inf and NaN (0xffffffff). Against the CPU sampler's rule written as one loop.
bool check_argmax(std::mt19937& rng, int vocab, unsigned threads) {
    std::uniform_real_distribution<float> uni(-1, 1);
    int rows = 6;
    std::vector<float> logits(rows * vocab);
    for (auto& x : logits) x = uni(rng);
    for (int r = 0; r < 3; r++) {
        float* row = &logits[r * vocab];
        int m = rng() % vocab;
        row[m] = row[m + rng() % (vocab - m)] = 2.0f;
        row[rng() % vocab] = NAN;
    }
    float* inf_row = &logits[3 * vocab];
    inf_row[vocab / 2] = inf_row[vocab - 1] = INFINITY;
    float* zero_row = &logits[4 * vocab];
    for (int i = 0; i < vocab; i++) zero_row[i] = -1.0f - uni(rng) * 0.5f;
    zero_row[vocab / 3] = -0.0f, zero_row[vocab - 1] = 0.0f;
    float* masked = &logits[5 * vocab];
    for (int i = 0; i < vocab; i++) masked[i] = i % 3 ? -INFINITY : NAN;
    std::vector<u32> out(rows, 7);
    launch({(unsigned)rows, 1, 1}, threads, [&] { argmax_rows(logits.data(), out.data(), vocab); });
    bool ok = true;
    for (int r = 0; r < rows; r++) {
        u32 want = 0xffffffffu;
        float best = -INFINITY;
        for (int i = 0; i < vocab; i++)
            if (logits[r * vocab + i] > best) best = logits[r * vocab + i], want = i;
        if (out[r] != want) {
            printf("argmax_rows vocab %d row %d: %u, want %u\n", vocab, r, out[r], want);
            ok = false;
        }
    }
    printf("argmax_rows vocab %d, %d rows, %u threads: %s\n", vocab, rows, threads, ok ? "ok" : "FAIL");
    return ok;
}

// decode_check [SEED]: every instance of paged_decode_lanes.cu (head sizes 64 and 128, groups of
// 1, 2, 4 and 8) on a random case with an f32 and with a bf16 cache, and paged_decode.cu on two
// (the kernel the GPU tests have checked: a control on the emulation itself).
int main(int argc, char** argv) {
    std::mt19937 rng(argc > 1 ? atoi(argv[1]) : 1);
    int fails = !check_elementwise(rng) + !check_argmax(rng, 3001, 256) + !check_argmax(rng, 37, 64), control = 2;
    int block_sizes[] = {1, 5, 16, 17}, partitions[] = {7, 64, 100, 256};
    for (int d : {64, 128}) {
        for (int g : {1, 2, 4, 8}) {
            int bs = block_sizes[rng() % 4], part = partitions[rng() % 4];
            int nkv = 1 + rng() % 2, seqs = 1 + rng() % 2;
            fails += !check<float>(rng, true, g * nkv, nkv, d, bs, part, seqs);
            fails += !check<unsigned short>(rng, true, g * nkv, nkv, d, bs, part, seqs);
            if (control-- > 0) {
                fails += !check<float>(rng, false, g * nkv, nkv, d, bs, part, seqs);
                fails += !check<unsigned short>(rng, false, g * nkv, nkv, d, bs, part, seqs);
            }
        }
    }
    printf("%d failures\n", fails);
    return fails != 0;
}
