//! Decode attention: one query row, every head, against `context_len` stored positions, with the
//! positions cut into chunks that run in parallel and are merged at the end (split-K).
//!
//! ```text
//! chunk c, positions a..b, every head h (KV head h / G, GQA):
//!     s[h][j] = q_h · k_j / √d          eight positions at a time, each K row read once
//!     m[h]    = max_j s[h][j]
//!     l[h]    = Σ_j e^(s[h][j] − m[h])
//!     o[h]    = Σ_j e^(s[h][j] − m[h]) · v_j
//! merge, per head:   M = max_c m_c,   out_h = Σ_c e^(m_c − M) · o_c / Σ_c e^(m_c − M) · l_c
//! ```
//!
//! Against [`attend_head`](crate::attention), one task per head reading its positions one by
//! one, three things change:
//! - **tasks split the positions, not the heads**: nine heads on two threads leave one thread a
//!   head short at the end of every layer, chunks of positions balance; and each task streams
//!   whole K and V rows (every KV head of a position, consecutive in memory) front to back;
//! - **eight positions at a time**: eight independent dot products per head keep eight vector
//!   accumulators busy, where one dot product at a time waits on its own additions;
//! - the softmax is a **log-sum-exp merge** of the chunks' partial results, exact in real
//!   arithmetic, so only the rounding differs from the one-chunk formula.
//!
//! The chunking depends on `context_len` only ([`chunk_len`]), never on the number of threads,
//! so a result does not change with `--threads`.

use ch01::attention::AttentionShape;
use rayon::prelude::*;

use crate::kernels::Isa;
use crate::kernels::vector::{
    KEYS, PREFETCH_POSITIONS, axpy8, dot8, exp, exp_shifted_sum, max, prefetch_l2,
};
/// The fewest positions a chunk has (unless the context is shorter): below this a task's
/// hand-off costs more than its work.
const MIN_CHUNK: usize = 32;
/// The most chunks of one row, whatever the context length: bounds the merge's work and the
/// scratch of partial results.
pub const MAX_CHUNKS: usize = 16;

/// Positions per chunk for a context of `context_len`: at least `MIN_CHUNK`, a multiple of
/// [`KEYS`], and few enough for at most [`MAX_CHUNKS`] chunks.
pub fn chunk_len(context_len: usize) -> usize {
    context_len
        .div_ceil(MAX_CHUNKS)
        .max(MIN_CHUNK)
        .next_multiple_of(KEYS)
}

/// Scratch [`decode_attention`] needs: the scores of every head at every position, then each
/// chunk's partial result (`o`, `m`, `l` of every head).
pub fn scratch_len(context_len: usize, shape: AttentionShape) -> usize {
    shape.num_heads * context_len + MAX_CHUNKS * partial_len(shape)
}

/// One chunk's partial result: `o` [num_heads, d], then `m` and `l` [num_heads].
fn partial_len(shape: AttentionShape) -> usize {
    shape.num_heads * (shape.head_dim + 2)
}

/// A layer's stored keys and values: position `pos` is row `row_of(pos)` of `k` and `v` (rows
/// of `num_kv_heads · head_dim`).
pub struct Stored<'a, R> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub row_of: &'a R,
    pub shape: AttentionShape,
}

// ANCHOR: decode_attention
/// `out` [num_heads · d] = attention of the query row `q` [num_heads · d] at position
/// `context_len − 1` against positions `0..context_len` of `kv`; `scratch`: at least
/// [`scratch_len`] elements.
pub fn decode_attention<R: Fn(usize) -> usize + Sync>(
    isa: Isa,
    kv: &Stored<R>,
    q: &[f32],
    context_len: usize,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let shape = kv.shape;
    let (heads, d) = (shape.num_heads, shape.head_dim);
    assert!(context_len >= 1, "the query's own position is stored");
    assert_eq!(q.len(), heads * d, "q is [num_heads · d]");
    assert_eq!(out.len(), q.len(), "out is [num_heads · d]");
    assert!(scratch.len() >= scratch_len(context_len, shape));
    let chunk = chunk_len(context_len);
    let chunks = context_len.div_ceil(chunk); // <= MAX_CHUNKS
    let (scores, partials) = scratch.split_at_mut(heads * context_len);
    let partials = &mut partials[..chunks * partial_len(shape)];
    scores
        .par_chunks_mut(heads * chunk) // chunk c's scores: [num_heads, its positions]
        .zip(partials.par_chunks_mut(partial_len(shape)))
        .enumerate()
        .for_each(|(c, (scores, partial))| {
            let positions = c * chunk..(c * chunk + chunk).min(context_len);
            attend_chunk_fastest(isa, kv, q, positions, scores, partial);
        });
    merge(shape, partials, out);
}
// ANCHOR_END: decode_attention

/// One chunk: `partial` = (`o` [num_heads, d], `m`, `l` [num_heads]) over `positions`;
/// `scores`: [num_heads, positions.len()].
#[inline(always)]
fn attend_chunk<'a, R: Fn(usize) -> usize>(
    kv: &Stored<'a, R>,
    q: &[f32],
    positions: std::ops::Range<usize>,
    scores: &mut [f32],
    partial: &mut [f32],
) {
    let AttentionShape {
        num_heads: heads,
        num_kv_heads,
        head_dim: d,
    } = kv.shape;
    let group = heads / num_kv_heads; // query heads per KV head
    let kv_dim = num_kv_heads * d;
    let len = positions.len();
    let scale = 1.0 / (d as f32).sqrt();
    // The K (or V) rows of the eight positions from `j` on, each [kv_dim]: a last group past
    // the chunk repeats its last row (scored, then dropped; weighted by zero in the V pass).
    // (Plain loops, not closures, so that they compile inside the caller's AVX2 function.)
    let rows_at = |stored: &'a [f32], j: usize, rows: &mut [&'a [f32]; KEYS]| {
        for (p, row) in rows.iter_mut().enumerate() {
            let pos = positions.start + (j + p).min(len - 1);
            *row = &stored[(kv.row_of)(pos) * kv_dim..][..kv_dim];
        }
    };
    // Asks for the rows of the eight positions from `j` on (none past the chunk), to be read
    // later: K rows `PREFETCH_POSITIONS` positions later, V rows in the V pass.
    let prefetch_rows = |stored: &[f32], j: usize| {
        for p in j..(j + KEYS).min(len) {
            prefetch_l2(&stored[(kv.row_of)(positions.start + p) * kv_dim..][..kv_dim]);
        }
    };
    let mut rows: [&[f32]; KEYS] = [&[]; KEYS];
    let mut heads_of = [&[][..]; KEYS]; // one head's part of each row, [d]

    // s[h][j] = q_h · k_j / √d. Each group also asks for its own V rows: they arrive while the
    // score pass and the softmax compute, instead of after them.
    for j in (0..PREFETCH_POSITIONS).step_by(KEYS) {
        prefetch_rows(kv.k, j);
    }
    for j in (0..len).step_by(KEYS) {
        prefetch_rows(kv.k, j + PREFETCH_POSITIONS);
        prefetch_rows(kv.v, j);
        rows_at(kv.k, j, &mut rows);
        for (h, q_h) in q.chunks_exact(d).enumerate() {
            let at = (h / group) * d;
            for (part, row) in heads_of.iter_mut().zip(&rows) {
                *part = &row[at..at + d];
            }
            let s = dot8(q_h, &heads_of);
            let s_h = &mut scores[h * len + j..][..(len - j).min(KEYS)];
            for (s_h, s) in s_h.iter_mut().zip(s) {
                *s_h = s * scale;
            }
        }
    }
    for j in (0..PREFETCH_POSITIONS).step_by(KEYS) {
        prefetch_rows(kv.v, j); // while the softmax computes
    }
    // m[h], l[h], and the scores become e^(s − m)
    let (o, ml) = partial.split_at_mut(heads * d);
    let (m, l) = ml.split_at_mut(heads);
    for (h, s_h) in scores.chunks_exact_mut(len).enumerate() {
        m[h] = max(s_h);
        l[h] = exp_shifted_sum(s_h, m[h]);
    }
    // o[h] = Σ_j e^(s[h][j] − m[h]) · v_j
    o.fill(0.0);
    for j in (0..len).step_by(KEYS) {
        // Asked again, ahead: a prefetch is a hint that is not always served, and a long chunk's
        // first V rows may have left L2 while its K rows streamed (without these requests and
        // the ones before the softmax, measured slower).
        prefetch_rows(kv.v, j + PREFETCH_POSITIONS);
        rows_at(kv.v, j, &mut rows);
        for (h, o_h) in o.chunks_exact_mut(d).enumerate() {
            let at = (h / group) * d;
            for (part, row) in heads_of.iter_mut().zip(&rows) {
                *part = &row[at..at + d];
            }
            let p_h = &scores[h * len + j..][..(len - j).min(KEYS)];
            let mut w = [0.0; KEYS];
            w[..p_h.len()].copy_from_slice(p_h);
            axpy8(&w, &heads_of, o_h);
        }
    }
}

/// `out_h = Σ_c e^(m_c − M) · o_c / Σ_c e^(m_c − M) · l_c` over the chunks' `partials`.
fn merge(shape: AttentionShape, partials: &[f32], out: &mut [f32]) {
    let (heads, d) = (shape.num_heads, shape.head_dim);
    let parts = || partials.chunks_exact(partial_len(shape));
    for (h, out_h) in out.chunks_exact_mut(d).enumerate() {
        let m_of = |part: &[f32]| part[heads * d + h];
        let l_of = |part: &[f32]| part[heads * d + heads + h];
        let top = parts().map(m_of).fold(f32::NEG_INFINITY, f32::max);
        out_h.fill(0.0);
        let mut total = 0.0;
        for part in parts() {
            let weight = exp(m_of(part) - top);
            total += weight * l_of(part);
            let o_h = &part[h * d..][..d];
            out_h
                .iter_mut()
                .zip(o_h)
                .for_each(|(out, o)| *out += weight * o);
        }
        let inv = 1.0 / total;
        out_h.iter_mut().for_each(|out| *out *= inv);
    }
}

/// [`attend_chunk`] compiled for AVX2 + FMA when `isa` says the CPU has them (the same Rust,
/// vectorised 8 lanes wide by the compiler), else as plain Rust.
fn attend_chunk_fastest<R: Fn(usize) -> usize>(
    isa: Isa,
    kv: &Stored<R>,
    q: &[f32],
    positions: std::ops::Range<usize>,
    scores: &mut [f32],
    partial: &mut [f32],
) {
    match isa {
        Isa::Portable => attend_chunk(kv, q, positions, scores, partial),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma(_) => {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<R: Fn(usize) -> usize>(
                kv: &Stored<R>,
                q: &[f32],
                positions: std::ops::Range<usize>,
                scores: &mut [f32],
                partial: &mut [f32],
            ) {
                attend_chunk(kv, q, positions, scores, partial)
            }
            // SAFETY: an `Isa::Avx2Fma` exists only once run-time detection found AVX2 and FMA
            // on this CPU (its proof field is private); `avx2` is safe Rust otherwise.
            unsafe { avx2(kv, q, positions, scores, partial) }
        }
    }
}
