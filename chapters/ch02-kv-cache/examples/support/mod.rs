//! What the attention examples share: SmolLM2-135M's attention shape, the context lengths from
//! the command line, and seeded per-layer K/V buffers.

use ch01::attention::AttentionShape;

/// SmolLM2-135M's layers.
pub const LAYERS: usize = 30;

/// SmolLM2-135M's attention: 9 query heads sharing 3 KV heads of 64.
pub const SHAPE: AttentionShape = AttentionShape {
    num_heads: 9,
    num_kv_heads: 3,
    head_dim: 64,
};

/// The context lengths given as arguments, or `default` when there are none.
pub fn lengths(default: &[usize]) -> Vec<usize> {
    let given: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if given.is_empty() {
        default.to_vec()
    } else {
        given
    }
}

/// A deterministic value in [−1, 1) for index `i`.
pub fn value(i: usize) -> f32 {
    ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0
}

/// Every layer's K and V [t, kv_dim], each in its own buffer (so a pass over the layers streams
/// them from memory, as a model does).
pub fn layers(t: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    let kv_dim = SHAPE.num_kv_heads * SHAPE.head_dim;
    (0..LAYERS)
        .map(|l| {
            let kv = |o: usize| (0..t * kv_dim).map(|i| value(i + o)).collect();
            (kv(l * 7), kv(l * 11 + 3))
        })
        .collect()
}
