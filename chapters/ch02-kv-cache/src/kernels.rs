//! Fast CPU kernels for `y = x Wᵀ`, written by us: the work every projection does.
//!
//! Decode multiplies every weight matrix by one vector, so its speed is the speed at which the
//! weights can be read from memory. These kernels therefore:
//! - read each weight row once per call, contiguously (`W` is `[out, in]`, row-major);
//! - accumulate in independent lanes ([`LANES`]) so the compiler vectorises the dot product;
//! - split the output rows across threads (rayon) for one token, so every core streams its own
//!   share of the weights;
//! - accept weights stored as bf16 (half the bytes per token), widened to f32 in registers
//!   (`f32::from_bits((bits as u32) << 16)` is exact), with f32 accumulation.

use rayon::prelude::*;

/// Independent accumulators in a dot product: enough for two 256-bit vectors of f32.
pub const LANES: usize = 16;

/// Rows of `W` one task handles in a matrix-vector product: large enough to amortise the task,
/// small enough to balance two or more cores.
const ROWS_PER_TASK: usize = 64;

/// A weight element: f32 or bf16 bits, widened to f32 where it is used.
pub trait WeightElement: Copy + Send + Sync {
    fn to_f32(self) -> f32;
}

impl WeightElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// bf16 stored as its bits: the top 16 bits of an f32.
impl WeightElement for u16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

/// `Σ w[i] · x[i]` with [`LANES`] independent partial sums (the order of additions differs from a
/// sequential sum by rounding only).
#[inline(always)]
pub fn dot<W: WeightElement>(w: &[W], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0.0f32; LANES];
    let (w_chunks, x_chunks) = (w.chunks_exact(LANES), x.chunks_exact(LANES));
    let (w_tail, x_tail) = (w_chunks.remainder(), x_chunks.remainder());
    for (wc, xc) in w_chunks.zip(x_chunks) {
        for lane in 0..LANES {
            acc[lane] += wc[lane].to_f32() * xc[lane];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (w, x) in w_tail.iter().zip(x_tail) {
        sum += w.to_f32() * x;
    }
    sum
}

/// One token: `y[o] = W[o, :] · x` for every output row, rows split across threads.
/// `w`: [out, in] row-major, `x`: [in], `y`: [out].
// ANCHOR: matvec
pub fn matvec<W: WeightElement>(w: &[W], x: &[f32], y: &mut [f32]) {
    let in_features = x.len();
    debug_assert_eq!(w.len(), y.len() * in_features);
    y.par_chunks_mut(ROWS_PER_TASK)
        .enumerate()
        .for_each(|(task, y_chunk)| {
            let first_row = task * ROWS_PER_TASK;
            for (i, y_o) in y_chunk.iter_mut().enumerate() {
                let row = &w[(first_row + i) * in_features..][..in_features];
                *y_o = dot(row, x);
            }
        });
}
// ANCHOR_END: matvec

/// Many tokens (prefill): `y[t, o] = W[o, :] · x[t, :]`, i.e. `y = x Wᵀ`.
/// `w`: [out, in], `x`: [T, in], `y`: [T, out], all row-major.
///
/// Prefill is compute-bound, so this hands the arithmetic to a packed, register-blocked GEMM
/// (`matrixmultiply`, through ndarray), widening bf16 weights to f32 a block of rows at a time.
/// Our own GEMM micro-kernel is still to come (see the book).
pub fn matmul<W: WeightElement>(
    w: &[W],
    x: &[f32],
    y: &mut [f32],
    in_features: usize,
    out_features: usize,
) {
    use ndarray::{ArrayView2, ArrayViewMut2, s};
    debug_assert_eq!(w.len(), out_features * in_features);
    let tokens = x.len() / in_features;
    let x = ArrayView2::from_shape((tokens, in_features), x).expect("x is [T, in]");
    let mut y = ArrayViewMut2::from_shape((tokens, out_features), y).expect("y is [T, out]");
    const ROWS_PER_BLOCK: usize = 256;
    let mut block = Vec::with_capacity(ROWS_PER_BLOCK * in_features);
    for (b, rows) in w.chunks(ROWS_PER_BLOCK * in_features).enumerate() {
        block.clear();
        block.extend(rows.iter().map(|v| v.to_f32()));
        let n = rows.len() / in_features;
        let w_block = ArrayView2::from_shape((n, in_features), &block[..]).expect("rows of W");
        let first = b * ROWS_PER_BLOCK;
        // y[:, first..first+n] = x · w_blockᵀ
        ndarray::linalg::general_mat_mul(
            1.0,
            &x,
            &w_block.t(),
            0.0,
            &mut y.slice_mut(s![.., first..first + n]),
        );
    }
}
