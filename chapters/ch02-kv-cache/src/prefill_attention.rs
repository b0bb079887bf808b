//! Prefill attention as two matrix products per head, on this chapter's GEMM kernels.
//!
//! A prompt chunk of `n` queries against `ctx` stored positions is, per head `h` (with its KV
//! head `g`),
//! ```text
//! S = Q_h K_gᵀ / √d        [n, ctx]     matmul: K_g packed as a weight of ctx outputs, d inputs
//! S[i][j] = −∞, j > pos_i                (causal: query i is position ctx − n + i)
//! P = softmax(S) per row                 over 0..=pos_i only; the masked tail is exactly 0
//! O_h = P V_g              [n, d]       matmul: V_gᵀ packed as a weight of d outputs, ctx inputs
//! ```
//! The row-at-a-time loop of [`cached_attention`](crate::attention::cached_attention) does the
//! same arithmetic one dot product and one multiply-add row at a time; here each `k` of the
//! micro-kernel's inner loop feeds a whole tile of outputs. The queries go through the products
//! in blocks of at most [`CAUSAL_BLOCK`], and a block's products stop at the position its last
//! query sees ([`matmul_part`]): of the masked upper triangle only each block's own corner is
//! computed (zeros, which change no sum), instead of the whole triangle, which doubles the
//! multiply-adds of a prompt against itself. The softmax runs on the vectorised
//! [`exp`](crate::kernels::vector::exp). K and V are packed once per KV head and shared by its
//! query heads (GQA). Only prefill chunks of at least [`MIN_QUERIES`] queries come here:
//! packing every stored key and value for a handful of rows is work the row loop does not do
//! (the threshold is a choice, not a measured crossover).

use ch01::attention::AttentionShape;
use rayon::prelude::*;

use crate::kernels::vector::scaled_softmax_fastest;
use crate::kernels::{Gemm, Isa, PackedWeight, matmul_part};

/// The fewest queries of a chunk that go through the products.
pub const MIN_QUERIES: usize = 8;

/// Scores one head's block of queries may hold at once (1 MiB of f32): the queries go through
/// the products in blocks of `SCORE_BUDGET / context_len` (at least [`MIN_QUERIES`]), so a long
/// prompt's scores are never a whole `[n, ctx]` matrix per head.
const SCORE_BUDGET: usize = 1 << 18;

/// The most queries of one block: each block computes up to its last query's position, so the
/// wasted corner is at most this wide per row. A multiple of every micro-kernel's tile height
/// (6 and 12), so that blocks fill whole tiles.
pub const CAUSAL_BLOCK: usize = 48;

/// `out` [n, num_heads · d] = causal attention of the `n` queries `q` [n, num_heads · d] (the
/// last `n` of `context_len` positions) against the stored K/V: position `pos` in row
/// `row_of(pos)` of `k` and `v` (rows of `num_kv_heads · d`).
pub fn prefill_attention<R: Fn(usize) -> usize + Sync>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    row_of: &R,
    context_len: usize,
    shape: AttentionShape,
    out: &mut [f32],
) {
    let block = (SCORE_BUDGET / context_len).clamp(MIN_QUERIES, CAUSAL_BLOCK);
    prefill_attention_in_blocks(q, k, v, row_of, context_len, shape, out, block);
}

/// [`prefill_attention`], with queries through the products `block` at a time.
#[allow(clippy::too_many_arguments)]
fn prefill_attention_in_blocks<R: Fn(usize) -> usize + Sync>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    row_of: &R,
    context_len: usize,
    shape: AttentionShape,
    out: &mut [f32],
    block: usize,
) {
    let d = shape.head_dim;
    let (q_dim, kv_dim) = (shape.num_heads * d, shape.num_kv_heads * d);
    let n = q.len() / q_dim;
    assert!(n >= 1 && n <= context_len, "queries are the last positions");
    assert_eq!(out.len(), q.len(), "out is [n, num_heads · head_dim]");
    let gemm = Gemm::fastest(Isa::detect());
    // Per KV head: K_g as [ctx outputs][d inputs], V_gᵀ as [d outputs][ctx inputs], packed
    // straight from the stored rows (position `pos` of head `g`: `d` values in its row).
    let packed: Vec<(PackedWeight<f32>, PackedWeight<f32>)> = (0..shape.num_kv_heads)
        .into_par_iter()
        .map(|g| {
            let at = |pos: usize| row_of(pos) * kv_dim + g * d;
            (
                PackedWeight::pack_rows(context_len, d, |pos| &k[at(pos)..][..d]),
                PackedWeight::pack_columns(d, context_len, |pos| &v[at(pos)..][..d]),
            )
        })
        .collect();
    let group = shape.num_heads / shape.num_kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let first_pos = context_len - n;
    // One task per (head, block of queries), each writing its output [rows, d] into its own
    // chunk of `parts`, then put in its place in `out`. A block's products are small, so each
    // runs on its task's thread, in scratch buffers that live as long as the worker's share of
    // the tasks: a block's queries and scores are written whole before they are read, so they
    // are zeroed once, when they grow, not once per task.
    let blocks = n.div_ceil(block);
    let mut parts = vec![0.0f32; shape.num_heads * blocks * block * d]; // [task][block, d]
    // ANCHOR: head_products
    parts.par_chunks_mut(block * d).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(q_h, scores), (task, o)| {
            let (h, b) = (task / blocks, task % blocks);
            let (k_g, v_t) = &packed[h / group];
            let rows = b * block..(b * block + block).min(n);
            q_h.clear();
            for i in rows.clone() {
                q_h.extend_from_slice(&q[i * q_dim + h * d..][..d]); // [rows, d]
            }
            // The block's last query sees positions 0..seen; the others fewer.
            let seen = first_pos + rows.end;
            if scores.len() < rows.len() * seen {
                scores.resize(rows.len() * seen, 0.0);
            }
            let s = &mut scores[..rows.len() * seen]; // [rows, seen]
            matmul_part(gemm, k_g, seen, d, q_h, s, rows.len());
            for (i, row) in rows.clone().zip(s.chunks_exact_mut(seen)) {
                let (visible, masked) = row.split_at_mut(first_pos + i + 1);
                scaled_softmax_fastest(visible, scale);
                masked.fill(0.0);
            }
            let o = &mut o[..rows.len() * d]; // [rows, d]
            matmul_part(gemm, v_t, d, seen, s, o, rows.len());
        },
    );
    // ANCHOR_END: head_products
    for (task, o) in parts.chunks_exact(block * d).enumerate() {
        let (h, b) = (task / blocks, task % blocks);
        let rows = b * block..(b * block + block).min(n);
        for (r, o_r) in rows.zip(o.chunks_exact(d)) {
            out[r * q_dim + h * d..][..d].copy_from_slice(o_r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row's products do not depend on which rows share its block (each output is the same
    /// chain of multiply-adds over `k` for any tile height), so any block size gives the same
    /// bits as one block of every query.
    #[test]
    fn query_blocks_change_no_bit() {
        let shape = AttentionShape {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 20,
        };
        let (context_len, n) = (45, 37);
        let kv_dim = shape.num_kv_heads * shape.head_dim;
        let q_len = n * shape.num_heads * shape.head_dim;
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i * 7919 + seed) % 1000) as f32 / 500.0) - 1.0)
                .collect()
        };
        let (q, k, v) = (
            values(q_len, 1),
            values(context_len * kv_dim, 2),
            values(context_len * kv_dim, 3),
        );
        let row_of = |pos: usize| context_len - 1 - pos; // rows stored in reverse
        let run = |block| {
            let mut out = vec![f32::NAN; q_len];
            prefill_attention_in_blocks(&q, &k, &v, &row_of, context_len, shape, &mut out, block);
            out
        };
        let whole = run(n);
        for block in [1, 3, 8, 36] {
            let blocked = run(block);
            assert!(
                whole
                    .iter()
                    .zip(&blocked)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "blocks of {block} differ from one block"
            );
        }
    }
}
