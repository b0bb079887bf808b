// SwiGLU's middle: out = silu(gate) · up, elementwise. The CPU twin: the `zip_mut_with` in
// ch01's `Mlp::forward`.
#include "common.cuh"

// gate, up, out: [count]; out_bf16, when not null: [count], out rounded to bf16 (down_proj's
// input with bf16 weights). Grid-stride.
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, bf16_bits* out_bf16,
                                    long count) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long)gridDim.x * blockDim.x) {
        float g = gate[i];
        float y = g / (1.0f + expf(-g)) * up[i];
        out[i] = y;
        if (out_bf16 != nullptr) out_bf16[i] = f32_to_bf16(y);
    }
}

// f32 → bf16 (round to nearest even), for the activations that enter a bf16 matrix product.
extern "C" __global__ void cast_f32_bf16(const float* x, bf16_bits* out, long count) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(x[i]);
    }
}
