//! The batch-32 decode step that the attention examples time (this chapter's
//! `batch_decode_attention`, chapter 7's `kv_dtype_decode`): [`SEQUENCES`] sequences of `t`
//! cached positions each, one query row per sequence, in a pool of SmolLM2-135M's shape
//! ([`LAYERS`] layers, [`SHAPE`]: 9 query heads sharing 3 KV heads of 64), every position of
//! every layer written.
//!
//! ```text
//! sequence s holds blocks s, s + 32, s + 64, ...   interleaved, as sequences that grow
//!                                                  together get them from the free list
//! ```

use ch01::LlamaConfig;
use ch01::attention::AttentionShape;
use ch03::{BlockId, KvElement, KvPool};
use ndarray::ArrayView1;

use crate::attention::QueryRow;

/// SmolLM2-135M's layers.
pub const LAYERS: usize = 30;
/// Sequences in the step.
pub const SEQUENCES: usize = 32;
/// Positions per block.
pub const BLOCK_SIZE: usize = 16;
/// SmolLM2-135M's attention.
pub const SHAPE: AttentionShape = AttentionShape {
    num_heads: 9,
    num_kv_heads: 3,
    head_dim: 64,
};
/// Elements of one position's K (or V) row in one layer.
pub const KV_DIM: usize = SHAPE.num_kv_heads * SHAPE.head_dim;

/// A deterministic value in [−1, 1) for index `i`.
pub fn value(i: usize) -> f32 {
    ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0
}

/// The step's pool and block tables.
///
/// Invariant: every sequence's table holds `t.div_ceil(BLOCK_SIZE)` blocks of `pool`, and its
/// positions `0..t` are written in every layer.
pub struct DecodeWorkload<K: KvElement> {
    pub pool: KvPool<K>,
    pub tables: Vec<Vec<BlockId>>, // [SEQUENCES][blocks per sequence]
    pub t: usize,
}

impl<K: KvElement> DecodeWorkload<K> {
    /// The pool with `t` (at least 1) positions of every sequence written: position `pos` of
    /// slot `slot` in `layer` has V row `value(0..KV_DIM)` and K row that times
    /// `value(slot + layer)`.
    pub fn new(t: usize) -> Self {
        assert!(t >= 1, "a decode step reads at least one position");
        let blocks_per_seq = t.div_ceil(BLOCK_SIZE);
        let config = LlamaConfig::smollm2_135m();
        assert_eq!(config.num_hidden_layers, LAYERS, "SmolLM2-135M's layers");
        let mut pool = KvPool::<K>::new(&config, BLOCK_SIZE, SEQUENCES * blocks_per_seq)
            .expect("a pool this size");
        let tables: Vec<Vec<BlockId>> = (0..SEQUENCES)
            .map(|s| {
                (0..blocks_per_seq)
                    .map(|b| (b * SEQUENCES + s) as BlockId)
                    .collect()
            })
            .collect();
        let row: Vec<f32> = (0..KV_DIM).map(value).collect();
        for layer in 0..LAYERS {
            for table in &tables {
                for pos in 0..t {
                    let slot = table[pos / BLOCK_SIZE] as usize * BLOCK_SIZE + pos % BLOCK_SIZE;
                    let k: Vec<f32> = row.iter().map(|v| v * value(slot + layer)).collect();
                    pool.write(layer, slot, ArrayView1::from(&k), ArrayView1::from(&row));
                }
            }
        }
        DecodeWorkload { pool, tables, t }
    }

    /// The slot of the last position of sequence `s`.
    pub fn last_slot(&self, s: usize) -> usize {
        let pos = self.t - 1;
        self.tables[s][pos / BLOCK_SIZE] as usize * BLOCK_SIZE + pos % BLOCK_SIZE
    }

    /// The step's query rows: each sequence at its last position.
    pub fn rows(&self) -> Vec<QueryRow<'_>> {
        (self.tables.iter())
            .map(|blocks| QueryRow {
                blocks,
                pos: self.t - 1,
            })
            .collect()
    }
}
