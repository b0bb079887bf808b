//! Attention of a few new queries against a sequence's stored keys and values, written into a
//! caller's buffer with a caller's score scratch, so that a decode step allocates nothing.
//!
//! Same arithmetic as chapter 1's oracle (`ch01::attention::causal_attention`), one query row
//! at a time: query `i` is position `context_len − n + i` and sees keys `0..=` that position.
//! ```text
//! s[j] = q_h · k_j / √d        j ≤ pos      (one row of scores, in the scratch)
//! p    = softmax(s)
//! o_h  = Σ_j p[j] · v_j
//! ```

use ch01::attention::{AttentionShape, softmax_in_place};
use rayon::prelude::*;

use crate::decode_attention::{Stored, decode_attention};
use crate::kernels::Isa;
use crate::kernels::vector::dot;

/// Query rows one task handles when several are attended at once.
const ROWS_PER_TASK: usize = 4;

/// Score scratch [`cached_attention`] needs for `n` queries against `context_len` positions.
pub fn scratch_len(n: usize, context_len: usize, shape: AttentionShape) -> usize {
    if n == 1 {
        crate::decode_attention::scratch_len(context_len, shape) // chunks of positions in parallel
    } else {
        n.div_ceil(ROWS_PER_TASK) * context_len // one score row per task, tasks in parallel
    }
}

/// The score rows attention needs, kept by a store from call to call: sized at creation for a
/// decode step over its whole capacity, so decode never allocates; grown only by a prefill that
/// needs more.
pub struct ScoreScratch(Vec<f32>);

impl ScoreScratch {
    /// Room for one decode step against `capacity` positions.
    pub fn for_decode(shape: AttentionShape, capacity: usize) -> Self {
        ScoreScratch(vec![0.0; scratch_len(1, capacity, shape)])
    }

    /// Scratch for `n` queries against `context_len` positions ([`scratch_len`] elements).
    pub fn get(&mut self, n: usize, context_len: usize, shape: AttentionShape) -> &mut [f32] {
        let needed = scratch_len(n, context_len, shape);
        if self.0.len() < needed {
            self.0.resize(needed, 0.0);
        }
        &mut self.0[..needed]
    }
}

/// `q`, `out`: [n, num_heads · head_dim]; `k`, `v`: at least [context_len, num_kv_heads · head_dim],
/// row-major; `scores`: at least [`scratch_len`] elements.
pub fn cached_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    context_len: usize,
    shape: AttentionShape,
    out: &mut [f32],
    scores: &mut [f32],
) {
    cached_attention_mapped(q, k, v, &|pos| pos, context_len, shape, out, scores);
}

/// [`cached_attention`] with the K/V of position `pos` in row `row_of(pos)` of `k` and `v`
/// (rows of `num_kv_heads · head_dim`): contiguous storage maps `pos` to itself, chapter 3's
/// paged storage through a block table.
// ANCHOR: cached_attention
#[allow(clippy::too_many_arguments)]
pub fn cached_attention_mapped<R: Fn(usize) -> usize + Sync>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    row_of: &R,
    context_len: usize,
    shape: AttentionShape,
    out: &mut [f32],
    scores: &mut [f32],
) {
    let q_dim = shape.num_heads * shape.head_dim;
    let n = q.len() / q_dim;
    assert!(n >= 1 && n <= context_len, "queries are the last positions");
    assert!(scores.len() >= scratch_len(n, context_len, shape));
    let first_pos = context_len - n;
    let stored = Stored {
        k,
        v,
        row_of,
        shape,
    };
    if n == 1 {
        // Decode: chunks of positions in parallel, every head in each.
        decode_attention(Isa::detect(), &stored, q, context_len, out, scores);
    } else if n >= crate::prefill_attention::MIN_QUERIES {
        // A prompt chunk: two matrix products per head.
        crate::prefill_attention::prefill_attention(q, k, v, row_of, context_len, shape, out);
    } else {
        // A short chunk: query rows in parallel, heads one after another.
        out.par_chunks_mut(ROWS_PER_TASK * q_dim)
            .zip(scores.par_chunks_mut(context_len))
            .enumerate()
            .for_each(|(task, (out_rows, s))| {
                for (r, out_row) in out_rows.chunks_mut(q_dim).enumerate() {
                    let i = task * ROWS_PER_TASK + r;
                    let q_row = &q[i * q_dim..][..q_dim];
                    for (h, out_h) in out_row.chunks_mut(shape.head_dim).enumerate() {
                        attend_head_fastest(&stored, q_row, h, first_pos + i, out_h, s);
                    }
                }
            });
    }
}

/// Decode as this chapter first did it, kept for comparison (`examples/attention_speed.rs`):
/// one query row `q` [num_heads · d] at position `context_len − 1`, its heads in parallel, each
/// head a task reading its positions one at a time. `scores`: at least
/// `num_heads · context_len` elements.
pub fn decode_by_heads<R: Fn(usize) -> usize + Sync>(
    stored: &Stored<R>,
    q: &[f32],
    context_len: usize,
    out: &mut [f32],
    scores: &mut [f32],
) {
    let shape = stored.shape;
    out.par_chunks_mut(shape.head_dim)
        .zip(scores[..shape.num_heads * context_len].par_chunks_mut(context_len))
        .enumerate()
        .for_each(|(h, (out_h, s))| {
            attend_head_fastest(stored, q, h, context_len - 1, out_h, s);
        });
}

/// One query row (position `pos`), head `h`: `out_h` [head_dim] = softmax(q_h Kᵀ/√d) V.
#[inline(always)]
fn attend_head<R: Fn(usize) -> usize>(
    kv: &Stored<R>,
    q_row: &[f32],
    h: usize,
    pos: usize,
    out_h: &mut [f32],
    scores: &mut [f32],
) {
    // ANCHOR: task_2_1
    let Stored {
        k,
        v,
        row_of,
        shape,
    } = kv;
    let d = shape.head_dim;
    let kv_dim = shape.num_kv_heads * d;
    let kv_head = h / (shape.num_heads / shape.num_kv_heads); // GQA: heads share K/V
    let q_h = &q_row[h * d..][..d];
    let scale = 1.0 / (d as f32).sqrt();
    let scores = &mut scores[..=pos];
    for (j, s) in scores.iter_mut().enumerate() {
        *s = dot(q_h, &k[row_of(j) * kv_dim + kv_head * d..][..d]) * scale;
    }
    softmax_in_place(scores);
    out_h.fill(0.0);
    for (j, &p) in scores.iter().enumerate() {
        let v_j = &v[row_of(j) * kv_dim + kv_head * d..][..d];
        out_h.iter_mut().zip(v_j).for_each(|(o, v)| *o += p * v);
    }
    // ANCHOR_END: task_2_1
}
// ANCHOR_END: cached_attention

/// [`attend_head`] compiled for AVX2 + FMA when the CPU has them (the same Rust, vectorised
/// 8 lanes wide by the compiler), else as plain Rust.
fn attend_head_fastest<R: Fn(usize) -> usize>(
    kv: &Stored<R>,
    q_row: &[f32],
    h: usize,
    pos: usize,
    out_h: &mut [f32],
    scores: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if let crate::kernels::Isa::Avx2Fma(_) = crate::kernels::Isa::detect() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<R: Fn(usize) -> usize>(
            kv: &Stored<R>,
            q_row: &[f32],
            h: usize,
            pos: usize,
            out_h: &mut [f32],
            scores: &mut [f32],
        ) {
            attend_head(kv, q_row, h, pos, out_h, scores)
        }
        // SAFETY: an `Isa::Avx2Fma` exists only once run-time detection found AVX2 and FMA on
        // this CPU; `avx2` is safe Rust otherwise.
        return unsafe { avx2(kv, q_row, h, pos, out_h, scores) };
    }
    attend_head(kv, q_row, h, pos, out_h, scores)
}
