// RMSNorm fused with the residual add that comes before it:
//   residual += delta            (the attention or MLP output; skipped when delta is null)
//   out = residual / sqrt(mean(residual²) + eps) · weight
// One block per token row. The CPU twin: ch01's `RmsNorm::forward` after the `x += ...` of the
// decoder layer, two passes over the row fused into one kernel.
#include "common.cuh"

// residual, delta, out: [n, dim]; weight: [dim]. out_bf16, when not null: [n, dim], out rounded
// to bf16, the input of a bf16 matrix product (one kernel fewer than a separate cast).
// Grid: (n); block: a multiple of 32.
extern "C" __global__ void add_rmsnorm(float* residual, const float* delta, const float* weight,
                                       float* out, bf16_bits* out_bf16, int dim, float eps) {
    long base = (long)blockIdx.x * dim;
    float sum_sq = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float x = residual[base + d];
        if (delta != nullptr) {
            x += delta[base + d];
            residual[base + d] = x;
        }
        sum_sq += x * x;
    }
    float inv_rms = rsqrtf(block_sum(sum_sq) / (float)dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float y = residual[base + d] * inv_rms * weight[d];
        out[base + d] = y;
        if (out_bf16 != nullptr) out_bf16[base + d] = f32_to_bf16(y);
    }
}

// The last residual add of the model, with no norm after it: residual += delta. Grid-stride.
extern "C" __global__ void add_in_place(float* residual, const float* delta, long count) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long)gridDim.x * blockDim.x) {
        residual[i] += delta[i];
    }
}

// A projection's bias: y[r, c] += bias[c] for every row. Grid-stride over rows · cols.
extern "C" __global__ void add_bias(float* y, const float* bias, long rows, int cols) {
    long count = rows * cols;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long)gridDim.x * blockDim.x) {
        y[i] += bias[i % cols];
    }
}
