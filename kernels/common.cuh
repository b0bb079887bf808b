// Shared by every kernel: bf16 as raw bits (no CUDA headers needed, so NVRTC compiles these
// sources with nothing but itself), and warp / block reductions.
//
// bf16 is the top half of an f32: widening shifts it back; narrowing rounds to nearest, ties to
// even, as the CPU side (`half::bf16::from_f32`) does, and keeps NaN a NaN.
#pragma once

typedef unsigned short bf16_bits;
typedef unsigned int u32;

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
