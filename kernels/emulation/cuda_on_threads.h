// Runs a CUDA kernel's source on CPU threads, to check a kernel's logic on a machine without a
// GPU: one block at a time, one std::thread per CUDA thread, `__shared__` variables as statics
// (so the block's threads share them, and the blocks, run one after another, reuse them),
// `__syncthreads` as a barrier of the block, and `__shfl_xor_sync` through a buffer between two
// barriers of the warp. Built with ThreadSanitizer, a read of shared memory that no barrier
// orders after its write is reported as a data race.
//
// It models what the kernels here use and no more: every lane of a warp must reach each shuffle
// (the kernels are written so), there is no memory coalescing, alignment fault or timing, and
// the float arithmetic is the host's (no fused multiply-add unless the compiler makes one).
#pragma once
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3v {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local dim3v threadIdx, blockIdx;
inline dim3v gridDim, blockDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define KILN_EMULATION
// Dynamic shared memory as a static array as large as any kernel here asks for.
#define DYNAMIC_SHARED(type, name) alignas(16) static type name[(128 << 10) / sizeof(type)]

struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float exp2f(float x) { return std::exp2(x); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }

namespace emulation {
constexpr unsigned MAX_THREADS = 1024;
inline std::barrier<>* block_barrier;
inline std::unique_ptr<std::barrier<>> warp_barriers[MAX_THREADS / 32];
inline unsigned shuffle_slots[MAX_THREADS];  // a lane's 32 bits, whatever their type
}  // namespace emulation

// An exercise's unwritten body: says so, as Rust's todo! does, and ends the program.
#define KILN_TODO(what) emulation::todo(what)
// Whether task `id` counts as done: listed in KILN_EXERCISE_DONE (kiln exercise verify).
inline bool kiln_task_done(const char* id) {
    const char* done = std::getenv("KILN_EXERCISE_DONE");
    std::string list = std::string(",") + (done ? done : "") + ",";
    return list.find(std::string(",") + id + ",") != std::string::npos;
}
namespace emulation {
inline void todo(const char* what) {
    std::printf("not yet implemented: %s\n", what);
    std::fflush(stdout);
    std::_Exit(101);
}
}  // namespace emulation

inline void __syncthreads() { emulation::block_barrier->arrive_and_wait(); }

namespace emulation {
// This thread's `v` for its warp, and lane `src`'s (below 32) back: its bits, as the GPU moves
// them (an int does not pass through a float).
template <typename T>
inline T shuffle(T v, unsigned src) {
    static_assert(sizeof(T) == 4, "a shuffle moves 32 bits");
    unsigned t = threadIdx.x;
    auto& warp = *warp_barriers[t / 32];
    shuffle_slots[t] = std::bit_cast<unsigned>(v);
    warp.arrive_and_wait();
    T other = std::bit_cast<T>(shuffle_slots[t / 32 * 32 + src]);
    warp.arrive_and_wait();  // nobody writes its slot again before every lane has read
    return other;
}
}  // namespace emulation

// Lane t gets the value of lane t ^ offset (offset < 32, so within the warp).
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int offset) {
    return emulation::shuffle(v, (threadIdx.x % 32) ^ offset);
}

// Lane t gets the value of lane `src` (below 32) of its warp.
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
    return emulation::shuffle(v, src);
}

// Runs `kernel` for every block of `grid`, one block after another, on `threads` (a multiple of
// 32, at most MAX_THREADS) threads that stay for the whole grid; between two blocks every thread
// waits at the block barrier, so no block's shared memory is reused while a thread still reads.
inline void launch(dim3v grid, unsigned threads, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    std::barrier<> block(threads);
    emulation::block_barrier = &block;
    for (unsigned w = 0; w < threads / 32; w++)
        emulation::warp_barriers[w] = std::make_unique<std::barrier<>>(32);
    std::vector<std::thread> block_threads;
    for (unsigned t = 0; t < threads; t++)
        block_threads.emplace_back([t, grid, &kernel] {
            threadIdx = {t, 0, 0};
            for (unsigned z = 0; z < grid.z; z++)
                for (unsigned y = 0; y < grid.y; y++)
                    for (unsigned x = 0; x < grid.x; x++) {
                        blockIdx = {x, y, z};
                        kernel();
                        __syncthreads();
                    }
        });
    for (auto& thread : block_threads) thread.join();
}
