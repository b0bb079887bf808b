//! Causal self-attention that materialises the whole score matrix: the oracle.
//!
//! For each query head `h` (sharing key/value head `h / (num_heads / num_kv_heads)` under GQA):
//!
//! ```text
//! S = Q_h K_hᵀ / √d        [T_q, T_k]   every score, materialised
//! S[i, j] = -∞  if key j is after query i
//! P = softmax(S) row-wise  [T_q, T_k]
//! O_h = P V_h              [T_q, d]
//! ```
//!
//! Queries are the *last* `T_q` positions of the `T_k` keys (bottom-right alignment), so the same
//! function covers a whole prompt (`T_q == T_k`) and a few new tokens against a longer history.
//! Memory is O(T_q · T_k) per head and time O(T_q · T_k · d): fine as a reference, and exactly
//! what chapter 7's FlashAttention avoids.

use ndarray::{Array2, ArrayView2, s};

/// Shapes of one attention call. Invariant: `num_heads % num_kv_heads == 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Causal attention.
/// `q`: [T_q, num_heads * head_dim], `k`, `v`: [T_k, num_kv_heads * head_dim], `T_q <= T_k`.
/// Returns [T_q, num_heads * head_dim].
// ANCHOR: attention
pub fn causal_attention(
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    v: ArrayView2<f32>,
    shape: AttentionShape,
) -> Array2<f32> {
    // ANCHOR: task_1_4
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim: d,
    } = shape;
    let (t_q, t_k) = (q.nrows(), k.nrows());
    assert!(t_q <= t_k, "queries must be the last positions of the keys");
    let queries_per_kv = num_heads / num_kv_heads;
    let offset = t_k - t_q; // absolute position of query 0
    let scale = 1.0 / (d as f32).sqrt();

    let mut out = Array2::<f32>::zeros((t_q, num_heads * d));
    for h in 0..num_heads {
        let kv = h / queries_per_kv;
        let q_h = q.slice(s![.., h * d..(h + 1) * d]); // [T_q, d]
        let k_h = k.slice(s![.., kv * d..(kv + 1) * d]); // [T_k, d]
        let v_h = v.slice(s![.., kv * d..(kv + 1) * d]); // [T_k, d]

        let mut scores = q_h.dot(&k_h.t()) * scale; // [T_q, T_k]
        for (i, mut row) in scores.rows_mut().into_iter().enumerate() {
            for j in (offset + i + 1)..t_k {
                row[j] = f32::NEG_INFINITY; // key j is in query i's future
            }
            softmax_in_place(
                row.as_slice_mut()
                    .expect("rows of a fresh array are contiguous"),
            );
        }
        out.slice_mut(s![.., h * d..(h + 1) * d])
            .assign(&scores.dot(&v_h)); // [T_q, d]
    }
    out
    // ANCHOR_END: task_1_4
}
// ANCHOR_END: attention

/// Numerically stable softmax: subtract the row maximum before exponentiating.
/// Invariant: for a row with at least one finite value the result sums to 1.
// ANCHOR: softmax
pub fn softmax_in_place(row: &mut [f32]) {
    // ANCHOR: task_1_1
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    for x in row.iter_mut() {
        *x /= sum;
    }
    // ANCHOR_END: task_1_1
}
// ANCHOR_END: softmax

/// `ln Σ exp(row[i])`, the log of softmax's denominator, in f64 so that the sum over a whole
/// vocabulary does not lose its small terms: `log_softmax(row)[i] = row[i] − log_sum_exp(row)`.
/// Stable like [`softmax_in_place`]: the maximum is taken out before exponentiating.
pub fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + row
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
}
