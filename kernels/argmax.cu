// Greedy sampling on the device: the index of each logit row's maximum (the lowest index among
// equal maxima, NaN and −∞ never chosen, as the CPU sampler's argmax), or 0xffffffff for a row
// whose every logit is −∞ or NaN (the CPU's `None`). One block per row.
#include "common.cuh"

// logits: [rows, vocab]; out: [rows]. Grid: (rows); block: a multiple of 32, at most 1024.
extern "C" __global__ void argmax_rows(const float* logits, u32* out, int vocab) {
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    const float* row = logits + (long)blockIdx.x * vocab;
    float value = -INFINITY;
    int index = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float x = row[i];
        if (x > value) { value = x; index = i; }  // i grows: the first maximum stays; NaN > v is false
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, value, offset);
        int j = __shfl_xor_sync(0xffffffffu, index, offset);
        if (v > value || (v == value && j < index)) { value = v; index = j; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_value[warp] = value; best_index[warp] = index; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) {
            if (best_value[w] > value || (best_value[w] == value && best_index[w] < index)) {
                value = best_value[w];
                index = best_index[w];
            }
        }
        out[blockIdx.x] = index == 0x7fffffff ? 0xffffffffu : (u32)index;
    }
}
