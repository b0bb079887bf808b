//! What the attention tests share: seeded random values and shapes, a one-layer config.

use std::path::Path;

use ch01::LlamaConfig;
use ch01::attention::AttentionShape;
use ch02::workload::WorkloadRng;
use ch07_flash_attention::{FlashParams, Partitions, TileSizes};
use ndarray::Array2;
use proptest::prelude::*;

/// `len` values in (−scale, scale] from chapter 2's seeded generator.
pub fn values(rng: &mut WorkloadRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| (rng.uniform_open0() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

pub fn matrix(rng: &mut WorkloadRng, rows: usize, cols: usize, scale: f32) -> Array2<f32> {
    Array2::from_shape_vec((rows, cols), values(rng, rows * cols, scale)).unwrap()
}

/// Head dims 24, 64, 128 or a small one (odd ones too, unless `even`: a pool's model config
/// needs an even head dim for RoPE).
pub fn shape(even: bool) -> impl Strategy<Value = AttentionShape> {
    let small = (1usize..=20).prop_map(move |d| if even { 2 * d.div_ceil(2) } else { d });
    (
        1usize..=3,
        1usize..=4,
        prop_oneof![Just(24usize), Just(64), Just(128), small],
    )
        .prop_map(|(num_kv_heads, group, head_dim)| AttentionShape {
            num_heads: num_kv_heads * group,
            num_kv_heads,
            head_dim,
        })
}

/// A one-layer model config with `shape`'s heads (what a pool is made for).
pub fn config(shape: AttentionShape) -> LlamaConfig {
    let json = format!(
        r#"{{"model_type": "llama", "vocab_size": 8, "hidden_size": {hidden},
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": {heads},
            "num_key_value_heads": {kv_heads}, "head_dim": {d}, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0}}"#,
        hidden = shape.num_heads * shape.head_dim,
        heads = shape.num_heads,
        kv_heads = shape.num_kv_heads,
        d = shape.head_dim,
    );
    LlamaConfig::from_json(&json, Path::new("test/config.json")).unwrap()
}

/// Random tile sizes and partition counts (0: automatic split-K).
pub fn params() -> impl Strategy<Value = FlashParams> {
    (1usize..=40, 1usize..=70, 0usize..=12).prop_map(|(q, kv, parts)| FlashParams {
        tiles: TileSizes::new(q, kv).unwrap(),
        partitions: if parts == 0 {
            Partitions::Auto
        } else {
            Partitions::fixed(parts).unwrap()
        },
    })
}
