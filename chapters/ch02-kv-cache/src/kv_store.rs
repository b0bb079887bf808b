//! The attention/KV seam: where one sequence's keys and values live, and how its queries read them.
//!
//! The forward pass (see [`crate::cached`]) computes q, k, v for the *new* tokens of a sequence,
//! hands k and v to the store with [`KvStore::write`], and asks the store for the attention
//! output of the new queries with [`KvStore::attend`]. It never sees the layout. Chapter 2's
//! store is one contiguous buffer per layer; chapter 3's is a table of fixed-size blocks.

use ch01::attention::AttentionShape;
use ndarray::{ArrayView2, ArrayViewMut2};

/// Why a store could not take more positions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("KV cache is full: {needed} positions needed, it holds {capacity}")]
    CacheFull { needed: usize, capacity: usize },
    #[error("KV write at position {start_pos} but {len} positions are stored: writes must append")]
    NotAppending { start_pos: usize, len: usize },
    /// A store that draws blocks from a shared pool (chapter 3) found too few free: the caller
    /// can wait, free or preempt another sequence (chapter 4), and retry.
    #[error("out of KV blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
}

// ANCHOR: kv_store
/// K/V storage for one sequence, all layers.
///
/// Invariants: positions `0..len()` hold, in every layer, the keys (RoPE applied) and values of
/// the sequence's first `len()` tokens. A forward step over `n` new tokens writes positions
/// `len()..len() + n` of every layer, attends with `context_len = len() + n`, then calls
/// [`KvStore::commit`] once; between the writes and the commit `len()` does not change.
pub trait KvStore {
    /// Positions stored in every layer.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most positions this store can hold (`None`: limited only by the memory it can get).
    fn capacity(&self) -> Option<usize>;

    /// Stores the K/V of positions `start_pos..start_pos + n` of `layer`.
    /// `k`, `v`: [n, num_kv_heads * head_dim]; `start_pos == len()`.
    fn write(
        &mut self,
        layer: usize,
        start_pos: usize,
        k: ArrayView2<f32>,
        v: ArrayView2<f32>,
    ) -> Result<(), KvError>;

    /// Causal attention of the queries `q` [n, num_heads * head_dim], which are positions
    /// `context_len - n..context_len`, against the stored positions `0..context_len` of `layer`,
    /// written into `out` [n, num_heads * head_dim]. `&mut self` lets a store keep the scratch it
    /// needs, so that a decode step allocates nothing.
    fn attend(
        &mut self,
        layer: usize,
        q: ArrayView2<f32>,
        context_len: usize,
        shape: AttentionShape,
        out: ArrayViewMut2<f32>,
    );

    /// Declares positions `0..new_len` stored in every layer.
    fn commit(&mut self, new_len: usize);
}
// ANCHOR_END: kv_store
