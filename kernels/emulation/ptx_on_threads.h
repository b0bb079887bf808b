// The PTX instructions of kernels/flash_prefill_tc.cu on CPU threads (cuda_on_threads.h), with
// the meanings the kernel's comments give them: ldmatrix and mma.sync gather what the warp's 32
// lanes hold through slots and two barriers of the warp, as a shuffle does. A GPU lands a
// cp.async copy at any time between the instruction and the wait that completes its group, so
// both ends are checked: by default the copies are held back until that wait, so that reading a
// tile before its wait and the barrier after it shows as a data race (or as wrong values); with
// KILN_CP_ASYNC_EARLY set they land at once, so that restaging a buffer other warps may still be
// reading (a missing barrier before the copies) shows the same way.
#pragma once
#include "cuda_on_threads.h"

namespace emulation {
inline const unsigned short* ldmatrix_rows[MAX_THREADS];
inline unsigned mma_a[MAX_THREADS][4], mma_b[MAX_THREADS][2];

inline float bf16_bits_to_f32(unsigned bits) { return __uint_as_float(bits << 16); }

// The four 8 x 8 matrices whose rows lanes 8i .. 8i + 7 point at: lane 4g + t gets, from
// matrix i, row g columns 2t and 2t + 1 (or, transposed, rows 2t and 2t + 1 of column g).
inline void ldmatrix(unsigned* r, const unsigned short* row, bool trans) {
    unsigned t = threadIdx.x, warp0 = t / 32 * 32, lane = t % 32, g = lane / 4, c = lane % 4;
    ldmatrix_rows[t] = row;
    warp_barriers[t / 32]->arrive_and_wait();
    for (unsigned i = 0; i < 4; i++) {
        const unsigned short* const* m = ldmatrix_rows + warp0 + 8 * i;
        unsigned lo = trans ? m[2 * c][g] : m[g][2 * c];
        unsigned hi = trans ? m[2 * c + 1][g] : m[g][2 * c + 1];
        r[i] = lo | hi << 16;
    }
    warp_barriers[t / 32]->arrive_and_wait();
}
}  // namespace emulation

// cvt.rn.bf16x2.f32: two f32 rounded to bf16, nearest with ties to even, `lo` in the lower half
// (a NaN becomes the canonical one; the kernel's weights are never NaN).
inline unsigned pack_bf16(float lo, float hi) {
    auto round = [](float f) -> unsigned {
        unsigned bits = __float_as_uint(f);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
        return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    };
    return round(lo) | round(hi) << 16;
}

// ex2.approx.ftz.f32: 2^x, with subnormal inputs and results flushed to 0 (the hardware's
// approximation error of about 2^-22 is left out: the check's bound is 1e-2).
inline float exp2_approx(float x) {
    if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;
    float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

inline void ldmatrix_x4(unsigned* r, const unsigned short* row) { emulation::ldmatrix(r, row, false); }
inline void ldmatrix_x4_trans(unsigned* r, const unsigned short* row) { emulation::ldmatrix(r, row, true); }

namespace emulation {
struct AsyncCopy {
    unsigned short* dst;
    const unsigned short* src;
    int src_bytes;
};
// This thread's cp.async copies: the groups committed and not yet waited for (oldest first),
// and the group still open.
inline thread_local std::vector<std::vector<AsyncCopy>> committed_copies;
inline thread_local std::vector<AsyncCopy> open_copies;
// KILN_CP_ASYNC_EARLY: every copy lands when it is issued.
inline const bool cp_async_early = std::getenv("KILN_CP_ASYNC_EARLY") != nullptr;

inline void land(const AsyncCopy& copy) {
    std::memset(copy.dst, 0, 16);
    std::memcpy(copy.dst, copy.src, (size_t)copy.src_bytes);
}
}  // namespace emulation

// Starts copying 16 bytes from src to dst (16 zero bytes when src_bytes is 0). The bytes land
// when a cp_async_wait lets the copy's group complete (or at once, KILN_CP_ASYNC_EARLY): the two
// ends of the window in which a GPU lands them.
inline void cp_async_16(unsigned short* dst, const unsigned short* src, int src_bytes) {
    if (emulation::cp_async_early) {
        emulation::land({dst, src, src_bytes});
    } else {
        emulation::open_copies.push_back({dst, src, src_bytes});
    }
}
inline void cp_async_commit() {
    emulation::committed_copies.push_back(std::move(emulation::open_copies));
    emulation::open_copies.clear();
}
// Completes every committed group but the newest N.
template <int N>
inline void cp_async_wait() {
    auto& groups = emulation::committed_copies;
    while (groups.size() > (size_t)N) {
        for (const auto& copy : groups.front()) emulation::land(copy);
        groups.erase(groups.begin());
    }
}

// d (16 x 8) += a (16 x 16) · b (16 x 8), the fragments spread over the warp's lanes as
// flash_prefill_tc.cu's comment lays them out (lane 4g + t).
inline void mma_16816(float* d, const unsigned* a, const unsigned* b) {
    using namespace emulation;
    unsigned t = threadIdx.x, warp0 = t / 32 * 32, lane = t % 32, g = lane / 4, c = lane % 4;
    for (int i = 0; i < 4; i++) mma_a[t][i] = a[i];
    for (int i = 0; i < 2; i++) mma_b[t][i] = b[i];
    warp_barriers[t / 32]->arrive_and_wait();
    // A[row][k]: lane 4·(row % 8) + (k % 8) / 2, register (row ≥ 8) + 2·(k ≥ 8), half k % 2.
    auto a_at = [&](unsigned row, unsigned k) {
        unsigned bits = mma_a[warp0 + 4 * (row % 8) + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)];
        return bf16_bits_to_f32(k % 2 ? bits >> 16 : bits & 0xffffu);
    };
    // B[k][col]: lane 4·col + (k % 8) / 2, register k ≥ 8, half k % 2.
    auto b_at = [&](unsigned k, unsigned col) {
        unsigned bits = mma_b[warp0 + 4 * col + (k % 8) / 2][k >= 8];
        return bf16_bits_to_f32(k % 2 ? bits >> 16 : bits & 0xffffu);
    };
    unsigned rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * c, 2 * c + 1, 2 * c, 2 * c + 1};
    float sums[4];
    for (int i = 0; i < 4; i++) {
        float s = 0.0f;
        for (unsigned k = 0; k < 16; k++) s += a_at(rows[i], k) * b_at(k, cols[i]);
        sums[i] = s;
    }
    warp_barriers[t / 32]->arrive_and_wait();
    for (int i = 0; i < 4; i++) d[i] += sums[i];
}
