//! The simplest KV cache: per layer, one K and one V buffer of `max_len` rows, preallocated.
//!
//! Memory is reserved for the longest sequence the model allows, whatever the request will
//! really use: `2 × layers × max_len × num_kv_heads × head_dim × 4 bytes` per sequence. That
//! reservation is what chapter 3's paged blocks stop wasting.

use ch01::LlamaConfig;
use ch01::attention::AttentionShape;
use ndarray::{Array2, ArrayView2, ArrayViewMut2, s};

use crate::attention::{ScoreScratch, cached_attention};
use crate::kv_store::{KvError, KvStore};

/// One sequence's K/V, contiguous per layer.
/// Invariant: `keys.len() == values.len() == num_layers`, each `[capacity, kv_dim]`.
pub struct ContiguousKvCache {
    keys: Vec<Array2<f32>>,   // per layer [capacity, num_kv_heads * head_dim]
    values: Vec<Array2<f32>>, // per layer [capacity, num_kv_heads * head_dim]
    len: usize,
    scores: ScoreScratch,
}

impl ContiguousKvCache {
    /// A cache for `capacity` positions of a model with this config.
    pub fn new(config: &LlamaConfig, capacity: usize) -> Self {
        let kv_dim = config.num_key_value_heads * config.head_dim;
        let buffer = || Array2::<f32>::zeros((capacity, kv_dim));
        ContiguousKvCache {
            keys: (0..config.num_hidden_layers).map(|_| buffer()).collect(),
            values: (0..config.num_hidden_layers).map(|_| buffer()).collect(),
            len: 0,
            scores: ScoreScratch::for_decode(config.attention_shape(), capacity),
        }
    }

    /// A cache for the model's whole context (`max_position_embeddings`), as a server that
    /// preallocates per sequence must reserve.
    pub fn for_max_len(config: &LlamaConfig) -> Self {
        Self::new(config, config.max_position_embeddings)
    }

    /// Bytes a cache of `capacity` positions for `config` reserves (what
    /// [`reserved_bytes`](Self::reserved_bytes) reports once it is made), known before making it.
    pub fn bytes_for(config: &LlamaConfig, capacity: usize) -> u64 {
        let kv_dim = config.num_key_value_heads * config.head_dim;
        2 * config.num_hidden_layers as u64 * capacity as u64 * (kv_dim * size_of::<f32>()) as u64
    }

    /// Bytes reserved: 2 (K and V) × layers × capacity × kv_dim × 4.
    pub fn reserved_bytes(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|b| b.len() * size_of::<f32>())
            .sum()
    }

    /// Backs the reserved memory at once ([`populate`](crate::memory::populate)), so that no
    /// step stops on a page fault at its first write of a page; nothing stored changes. Returns
    /// whether the system did it.
    pub fn populate(&mut self) -> bool {
        let buffers = self.keys.iter().chain(&self.values);
        buffers
            .map(|b| crate::memory::populate(b.as_slice().expect("a fresh buffer is contiguous")))
            .fold(true, |all, done| all & done)
    }

    /// Forgets every position; the memory stays reserved.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    fn capacity_rows(&self) -> usize {
        self.keys.first().map_or(0, |k| k.nrows())
    }
}

impl KvStore for ContiguousKvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.capacity_rows())
    }

    fn write(
        &mut self,
        layer: usize,
        start_pos: usize,
        k: ArrayView2<f32>,
        v: ArrayView2<f32>,
    ) -> Result<(), KvError> {
        // ANCHOR: task_2_2
        if start_pos != self.len {
            return Err(KvError::NotAppending {
                start_pos,
                len: self.len,
            });
        }
        let end = start_pos + k.nrows();
        if end > self.capacity_rows() {
            return Err(KvError::CacheFull {
                needed: end,
                capacity: self.capacity_rows(),
            });
        }
        self.keys[layer]
            .slice_mut(s![start_pos..end, ..])
            .assign(&k);
        self.values[layer]
            .slice_mut(s![start_pos..end, ..])
            .assign(&v);
        Ok(())
        // ANCHOR_END: task_2_2
    }

    fn attend(
        &mut self,
        layer: usize,
        q: ArrayView2<f32>,
        context_len: usize,
        shape: AttentionShape,
        mut out: ArrayViewMut2<f32>,
    ) {
        let q = q.as_standard_layout(); // borrows: the forward pass's buffers are contiguous
        cached_attention(
            q.as_slice().expect("standard layout"),
            self.keys[layer]
                .as_slice()
                .expect("a fresh buffer is contiguous"),
            self.values[layer]
                .as_slice()
                .expect("a fresh buffer is contiguous"),
            context_len,
            shape,
            out.as_slice_mut()
                .expect("attention output must be contiguous"),
            self.scores.get(q.nrows(), context_len, shape),
        );
    }

    fn commit(&mut self, new_len: usize) {
        debug_assert!(new_len <= self.capacity_rows());
        self.len = new_len;
    }
}
