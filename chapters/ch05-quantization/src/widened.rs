//! Prefill for weights stored as codes with f32 arithmetic (FP8 weights, int8 weights with f32
//! activations): widen the codes of a chunk of output rows to f32 once, pack them as chapter 2
//! packs its weights, and multiply every token with chapter 2's GEMM.
//!
//! ```text
//! for each chunk c of outputs (about CHUNK_BYTES of f32):
//!     W_c  [rows, in]  = widen(codes of the rows of c)   packed in panels of 16 rows, in parallel
//!     acc  [T, rows]   = x [T, in] · W_cᵀ                chapter 2's micro-kernels
//!     y[t, o]          = finish(o, acc[t, o - c.start])  the layer's scale and bias, in parallel
//! ```
//! A dot product per output and token reads all of `x` once per output row, from L2 once `x`
//! outgrows L1; the GEMM keeps a tile of tokens in registers across a panel of 16 rows, as an
//! f32 prefill does. What it adds is the packed copy: each weight written as f32 and read back
//! once per call. Below [`GEMM_FROM_TOKENS`] rows (a batch of decodes, a speculative step's
//! few), that copy costs more than it saves and the layers keep their dot products.

use ch02::kernels::{Isa, NR, PackedWeight, matmul};
use ndarray::{Array1, ArrayViewMut2};
use rayon::prelude::*;

/// The fewest rows of a call that run on the GEMM. FP8 layers of SmolLM2's MLP shapes (1536 ×
/// 576, 576 × 1536) and of a sixth of its head (8192 × 576) took as long either way at 24 rows,
/// 23% to 32% longer on the GEMM at 16, and 4% to 18% less at 32 (AMD EPYC, 2 threads,
/// 2026-12-06). W8A16 layers use the same threshold, not measured apart.
pub(crate) const GEMM_FROM_TOKENS: usize = 24;

/// f32 bytes of weights widened at once, which bounds the copy however large the layer (a
/// vocabulary's output head). Alternating, 128 tokens through an FP8 layer of 1536 × 576 or
/// 576 × 1536 took 1.5 to 3.1 ms in one chunk (4 MiB) and 2.4 to 3.8 ms in seven or eight of
/// 512 KiB, each of which adds three parallel regions; through SmolLM2's head (49152 × 576), 60
/// to 98 ms in chunks of 4 MiB and 84 to 107 ms in chunks of 512 KiB (AMD EPYC, 2 threads,
/// 2026-12-06, three rounds each).
const CHUNK_BYTES: usize = 4 << 20;

/// The most products (f32) a thread's scratch keeps for the next call: a long prompt's are
/// given back rather than held for as long as the thread lives.
const KEEP_PRODUCTS: usize = CHUNK_BYTES / 4;

/// `y[t, o] = finish(o, Σ_i x[t, i] · w[o, i])` for every token `t` of `x` [tokens, in] and
/// output `o` of `y` [tokens, out], where `widen(o, k, part)` writes elements
/// `k..k + part.len()` of the weight's output row `o` as f32 into `part`. Each sum is f32, in
/// the order of chapter 2's GEMM.
fn widened_matmul(
    isa: Isa,
    x: &[f32],
    mut y: ArrayViewMut2<f32>,
    widen: impl Fn(usize, usize, &mut [f32]) + Sync,
    finish: impl Fn(usize, f32) -> f32 + Sync,
) {
    let (tokens, out) = y.dim();
    assert!(
        tokens > 0 && x.len().is_multiple_of(tokens),
        "x is [tokens, in]"
    );
    let n = x.len() / tokens;
    let chunk = (CHUNK_BYTES / (4 * n.max(1))).max(NR) / NR * NR; // whole panels
    crate::scratch::with_local(&SCRATCH, |Scratch { packed, acc }| {
        let packed = packed.get_or_insert_with(|| PackedWeight::pack_with(0, 0, |_, _, _| {}));
        for start in (0..out).step_by(chunk) {
            let rows = chunk.min(out - start);
            packed.refill_with(rows, n, |o, k, part| widen(start + o, k, part));
            acc.resize(tokens * rows, 0.0); // [tokens, rows]
            matmul(isa, packed, x, acc, tokens);
            let finish = &finish;
            let write = |(y_t, acc_t): (&mut [f32], &[f32])| {
                for (j, (y_o, &v)) in y_t[start..start + rows].iter_mut().zip(acc_t).enumerate() {
                    *y_o = finish(start + j, v);
                }
            };
            match y.as_slice_mut() {
                Some(y) => (y.par_chunks_mut(out).zip(acc.par_chunks(rows))).for_each(write),
                None => {
                    for (t, acc_t) in acc.chunks_exact(rows).enumerate() {
                        for (j, &v) in acc_t.iter().enumerate() {
                            y[[t, start + j]] = finish(start + j, v);
                        }
                    }
                }
            }
        }
        if acc.capacity() > KEEP_PRODUCTS {
            *acc = Vec::new();
        }
    });
}

/// `y[t, o] = scale[o] · Σ_i x[t, i] · f32(codes[o, i]) + bias[o]` for a layer stored as codes
/// [out, in] with one scale per output row (FP8 weights, int8 weights with f32 activations):
/// [`widened_matmul`] with `to_f32` widening each code.
pub(crate) fn scaled_codes_matmul<C: Copy + Sync>(
    isa: Isa,
    x: &[f32],
    y: ArrayViewMut2<f32>,
    codes: &[C],
    to_f32: impl Fn(C) -> f32 + Sync,
    scale: &[f32],
    bias: Option<&Array1<f32>>,
) {
    let n = x.len() / y.nrows().max(1); // in
    debug_assert_eq!(
        codes.len(),
        scale.len() * n,
        "codes [out, in], a scale per row"
    );
    let widen = |o: usize, k: usize, part: &mut [f32]| {
        let codes = &codes[o * n + k..][..part.len()];
        part.iter_mut()
            .zip(codes)
            .for_each(|(w, &c)| *w = to_f32(c));
    };
    let finish = |o: usize, v: f32| scale[o] * v + bias.map_or(0.0, |b| b[o]);
    widened_matmul(isa, x, y, widen, finish)
}

/// One thread's buffers for [`widened_matmul`], kept from call to call: fresh ones for every
/// chunk cost more than the widening (the allocator hands back zeroed pages). The packed chunk
/// stays at most [`CHUNK_BYTES`]; products beyond [`KEEP_PRODUCTS`] (a prompt of more than
/// about 580 tokens through a 1,808-row chunk) are allocated for their call and given back.
#[derive(Default)]
struct Scratch {
    packed: Option<PackedWeight<f32>>, // a chunk of the weight, widened and packed
    acc: Vec<f32>,                     // [tokens, rows] its products
}

thread_local! {
    static SCRATCH: crate::scratch::Spares<Scratch> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, ShapeBuilder};

    /// Every output of a layer wider than two chunks (the last one partial, and no multiple of a
    /// panel) is written, equal to its sum in f64 within f32's rounding, for token counts on
    /// either side of a micro-kernel's tile, on each instruction set's fastest GEMM, into a
    /// contiguous `y` and into a column-major one.
    #[test]
    fn every_output_of_every_chunk_is_its_sum() {
        let n = 131; // two whole parts of a panel's fill and a short one
        let chunk = CHUNK_BYTES / (4 * n) / NR * NR;
        let out = 2 * chunk + 37;
        let value = |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0;
        let w: Vec<f32> = (0..out * n).map(|i| value(i, 1) - 1.0).collect(); // [out, in]
        for tokens in [2, 3, 17] {
            let x: Vec<f32> = (0..tokens * n).map(|i| value(i, 2) - 1.0).collect(); // [tokens, in]
            for isa in Isa::available() {
                for column_major in [false, true] {
                    let mut y = Array2::from_elem((tokens, out).set_f(column_major), f32::NAN);
                    let widen = |o: usize, k: usize, part: &mut [f32]| {
                        part.copy_from_slice(&w[o * n + k..][..part.len()])
                    };
                    widened_matmul(isa, &x, y.view_mut(), widen, |o, v| v + o as f32);
                    for ((t, o), &v) in y.indexed_iter() {
                        let (mut sum, mut mag) = (0.0f64, 0.0f64);
                        for i in 0..n {
                            let term = f64::from(x[t * n + i]) * f64::from(w[o * n + i]);
                            sum += term;
                            mag += term.abs();
                        }
                        // The sum's f32 rounding, then the one of `finish`'s addition of `o`.
                        let bound = 1e-6 * n as f64 * mag + f64::from(f32::EPSILON) * o as f64;
                        let sum = sum + o as f64;
                        assert!(
                            (f64::from(v) - sum).abs() <= bound,
                            "{isa:?} [{t}, {o}] of [{tokens}, {out}]: {v} vs {sum}"
                        );
                    }
                }
            }
        }
    }
}
