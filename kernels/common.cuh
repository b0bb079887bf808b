// Shared by every kernel: bf16 as raw bits (no CUDA headers needed, so NVRTC compiles these
// sources with nothing but itself), and warp / block reductions.
//
// bf16 is the top half of an f32: widening shifts it back; narrowing rounds to nearest, ties to
// even, as the CPU side (`half::bf16::from_f32`) does, and keeps NaN a NaN.
#pragma once

typedef unsigned short bf16_bits;
typedef unsigned int u32;

// A kernel's dynamic shared memory (its size set at launch): `name`, an array of `type`.
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif

// An exercise's unwritten body (`kiln exercise`): stops the kernel (a GPU reports a launch
// failure). On CPU threads (kernels/emulation) it prints `what` and ends the program, and
// `kiln_task_done` says whether a task counts as done there; on a GPU every task is done.
#ifndef KILN_TODO
#define KILN_TODO(what) __trap()
#define kiln_task_done(id) true
#endif

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float bf16_to_f32(bf16_bits x) {
    return __uint_as_float(((u32)x) << 16);
}

__device__ __forceinline__ bf16_bits f32_to_bf16(float f) {
    u32 bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_bits)((bits >> 16) | 0x0040u);  // quiet NaN
    }
    u32 rounding = 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_bits)((bits + rounding) >> 16);
}

// Loads element i of a K/V cache or weight stored as f32 or bf16.
__device__ __forceinline__ float load_f32(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float load_f32(const bf16_bits* p, long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store_from_f32(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_from_f32(bf16_bits* p, long i, float v) { p[i] = f32_to_bf16(v); }

// The pool slot of position `key` of a sequence whose block table is `table` (blocks of
// `block_size` positions), as ch03's `BlockTable::slot` finds it.
__device__ __forceinline__ long key_slot(const u32* table, int key, int block_size) {
    return (long)table[key / block_size] * block_size + key % block_size;
}

// The element offsets of keys begin .. begin + n's rows (`head_offset` into rows of `kv_stride`
// elements), into `rows`, by the block's threads together: split-K decode finds them once for
// both its passes (a division by the block size is some twenty instructions). The caller
// synchronises the block before reading them.
__device__ __forceinline__ void partition_rows(long* rows, const u32* table, int begin, int n,
                                               int block_size, long kv_stride, long head_offset) {
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        rows[j] = key_slot(table, begin + j, block_size) * kv_stride + head_offset;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `partial` may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

// One warp's softmax statistics over one head's scores p[0 .. n) (split-K decode's partition):
// m = max p, each p[j] replaced by exp(p[j] − m), l = Σ p[j]; lane 0 writes (m, l) to ml. m is
// −∞ and l 0 when n = 0 (a partition past the end of its context). Every lane must call it.
__device__ __forceinline__ void warp_softmax_stats(float* p, int n, float* ml) {
    int lane = threadIdx.x & 31;
    float m = -INFINITY;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, p[j]);
    m = warp_max(m);
    float l = 0.0f;
    for (int j = lane; j < n; j += 32) {
        float e = expf(p[j] - m);
        p[j] = e;
        l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
        ml[0] = m;
        ml[1] = l;
    }
}

// CH (8, 4 or 2) consecutive elements of a K/V row from element i (i a multiple of CH, so the
// load is aligned), widened to f32: one 16-byte load for 8 bf16, two for 8 f32.
template <int CH>
__device__ __forceinline__ void load_chunk(const bf16_bits* p, long i, float* out) {
    if (CH == 8) {
        uint4 u = *reinterpret_cast<const uint4*>(p + i);
        u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            out[2 * e] = __uint_as_float(w[e] << 16);
            out[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
        }
    } else if (CH == 4) {
        uint2 u = *reinterpret_cast<const uint2*>(p + i);
        out[0] = __uint_as_float(u.x << 16), out[1] = __uint_as_float(u.x & 0xffff0000u);
        out[2] = __uint_as_float(u.y << 16), out[3] = __uint_as_float(u.y & 0xffff0000u);
    } else {
        u32 w = *reinterpret_cast<const u32*>(p + i);
        out[0] = __uint_as_float(w << 16);
        out[1] = __uint_as_float(w & 0xffff0000u);
    }
}

template <int CH>
__device__ __forceinline__ void load_chunk(const float* p, long i, float* out) {
    if (CH == 8) {
        float4 a = *reinterpret_cast<const float4*>(p + i), b = *reinterpret_cast<const float4*>(p + i + 4);
        out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
        out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
    } else if (CH == 4) {
        float4 a = *reinterpret_cast<const float4*>(p + i);
        out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    } else {
        float2 a = *reinterpret_cast<const float2*>(p + i);
        out[0] = a.x, out[1] = a.y;
    }
}
