//! The K/V memory of every sequence: per layer, one K and one V array of fixed-size blocks.

use ch01::LlamaConfig;
use ch01::attention::AttentionShape;
use ch02::attention::{ScoreScratch, cached_attention_mapped};
use ndarray::ArrayView1;

use crate::block_manager::BlockCopy;
use crate::block_table::{BlockId, BlockTable};
use crate::kv_dtype::KvElement;

/// Why a pool could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("a KV budget of {budget} bytes holds no block of {block_bytes} bytes")]
    BudgetTooSmall { budget: u64, block_bytes: u64 },
    #[error("block size must be at least 1")]
    ZeroBlockSize,
    #[error("{num_blocks} KV blocks are more than block ids can name ({max})")]
    TooManyBlocks { num_blocks: usize, max: u64 },
    #[error("could not allocate the KV pool ({bytes} bytes)")]
    OutOfMemory { bytes: u128 },
}

// ANCHOR: pool
/// Per layer, K and V laid out `[num_blocks, block_size, num_kv_heads, head_dim]`, stored as
/// `K` (f32 by default, bf16 for half the bytes: see [`KvElement`]).
/// Slot `s = block · block_size + offset` holds one position's K (or V): row `s` of
/// `[num_blocks · block_size, kv_dim]`.
///
/// Invariant: `keys.len() == values.len() == num_layers`, each `num_blocks · block_size · kv_dim`
/// long. The pool does not know who owns a block: the [`crate::BlockManager`] does.
pub struct KvPool<K: KvElement = f32> {
    keys: Vec<Vec<K>>,
    values: Vec<Vec<K>>,
    num_blocks: usize,
    block_size: usize,
    kv_dim: usize,
    scores: ScoreScratch,
}
// ANCHOR_END: pool

impl<K: KvElement> KvPool<K> {
    /// Bytes one block takes: K and V, every layer, `block_size` positions, `K` each.
    pub fn bytes_per_block(config: &LlamaConfig, block_size: usize) -> u64 {
        ch02::workload::bytes_per_token(config, size_of::<K>()) * block_size as u64
    }

    pub fn new(
        config: &LlamaConfig,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, PoolError> {
        if block_size == 0 {
            return Err(PoolError::ZeroBlockSize);
        }
        if BlockId::try_from(num_blocks).is_err() {
            return Err(PoolError::TooManyBlocks {
                num_blocks,
                max: BlockId::MAX.into(),
            });
        }
        let kv_dim = config.num_key_value_heads * config.head_dim;
        let bytes = 2
            * config.num_hidden_layers as u128
            * num_blocks as u128
            * block_size as u128
            * kv_dim as u128
            * size_of::<K>() as u128;
        let layer = || -> Result<Vec<K>, PoolError> {
            let len = num_blocks
                .checked_mul(block_size)
                .and_then(|n| n.checked_mul(kv_dim))
                .ok_or(PoolError::OutOfMemory { bytes })?;
            zeroed(len).ok_or(PoolError::OutOfMemory { bytes })
        };
        Ok(KvPool {
            keys: (0..config.num_hidden_layers)
                .map(|_| layer())
                .collect::<Result<_, _>>()?,
            values: (0..config.num_hidden_layers)
                .map(|_| layer())
                .collect::<Result<_, _>>()?,
            num_blocks,
            block_size,
            kv_dim,
            scores: ScoreScratch::for_decode(
                config.num_attention_heads,
                config.max_position_embeddings,
            ),
        })
    }

    /// As many blocks as `budget` bytes hold (the `--kv-cache-memory` of a server).
    pub fn with_budget(
        config: &LlamaConfig,
        block_size: usize,
        budget: u64,
    ) -> Result<Self, PoolError> {
        if block_size == 0 {
            return Err(PoolError::ZeroBlockSize);
        }
        let block_bytes = Self::bytes_per_block(config, block_size);
        let num_blocks = budget / block_bytes.max(1);
        if num_blocks == 0 {
            return Err(PoolError::BudgetTooSmall {
                budget,
                block_bytes,
            });
        }
        Self::new(config, block_size, num_blocks as usize)
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Layers the pool holds K/V for.
    pub fn num_layers(&self) -> usize {
        self.keys.len()
    }

    /// Values in one position's K (or V) row: `num_kv_heads · head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Positions the whole pool holds.
    pub fn token_capacity(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Copies block `src`'s K/V into block `dst` in every layer (copy-on-write).
    pub fn copy_block(&mut self, copy: BlockCopy) {
        let len = self.block_size * self.kv_dim;
        let (src, dst) = (copy.src as usize * len, copy.dst as usize * len);
        for buffer in self.keys.iter_mut().chain(self.values.iter_mut()) {
            buffer.copy_within(src..src + len, dst);
        }
    }

    /// Block `id`'s K and V in every layer, one after the other: what swapping copies out to
    /// CPU memory (chapter 4).
    pub fn read_block(&self, id: BlockId) -> Vec<K> {
        let len = self.block_size * self.kv_dim;
        let at = id as usize * len;
        let mut data = Vec::with_capacity(2 * self.keys.len() * len);
        for buffer in self.keys.iter().chain(&self.values) {
            data.extend_from_slice(&buffer[at..at + len]);
        }
        data
    }

    /// Writes back what [`KvPool::read_block`] read, into block `id`.
    pub fn write_block(&mut self, id: BlockId, data: &[K]) {
        let len = self.block_size * self.kv_dim;
        let at = id as usize * len;
        for (buffer, part) in self
            .keys
            .iter_mut()
            .chain(self.values.iter_mut())
            .zip(data.chunks_exact(len))
        {
            buffer[at..at + len].copy_from_slice(part);
        }
    }

    /// Layer `layer`'s keys and values, each `[num_blocks · block_size, kv_dim]` row-major:
    /// row `s` is slot `s` (what a batched attention kernel reads, see chapter 4).
    pub fn layer_kv(&self, layer: usize) -> (&[K], &[K]) {
        (&self.keys[layer], &self.values[layer])
    }

    /// Writes one position's K and V rows (`kv_dim` values each) of `layer` into `slot`,
    /// rounded to `K`.
    pub fn write<'r>(
        &mut self,
        layer: usize,
        slot: usize,
        k: ArrayView1<'r, f32>,
        v: ArrayView1<'r, f32>,
    ) {
        let at = slot * self.kv_dim;
        for (buffer, row) in [(&mut self.keys[layer], k), (&mut self.values[layer], v)] {
            for (dst, &x) in buffer[at..at + self.kv_dim].iter_mut().zip(row.iter()) {
                *dst = K::from_f32(x);
            }
        }
    }
}

impl KvPool<f32> {
    /// Paged attention: chapter 2's attention, reading position `p`'s K/V from slot
    /// `table.slot(p)`. `q`, `out`: [n, num_heads · head_dim], positions `context_len − n..context_len`.
    // ANCHOR: paged_attention
    pub fn attend(
        &mut self,
        layer: usize,
        table: &BlockTable,
        q: &[f32],
        context_len: usize,
        shape: AttentionShape,
        out: &mut [f32],
    ) {
        let n = q.len() / (shape.num_heads * shape.head_dim);
        let row_of = |pos: usize| table.slot(pos); // the block table is the only change
        let (k, v) = (&self.keys[layer], &self.values[layer]);
        let scores = self.scores.get(n, context_len, shape);
        cached_attention_mapped(q, k, v, &row_of, context_len, shape, out, scores);
    }
    // ANCHOR_END: paged_attention
}

/// `len` zeros, or `None` if the memory cannot be had. Like `vec![0.0; len]`, the pages come
/// zeroed from the system and are only touched when written, so a large pool costs nothing
/// until blocks are used; unlike it, failure is a value instead of an abort.
fn zeroed<K: KvElement>(len: usize) -> Option<Vec<K>> {
    if len == 0 || size_of::<K>() == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<K>(len).ok()?;
    // SAFETY: `layout` has a non-zero size (len > 0, K not zero-sized). A non-null result
    // points to `len` zeroed `K`s (valid values: `KvElement`'s safety contract) allocated by the
    // global allocator with this layout, which is what `Vec::from_raw_parts` requires for length
    // and capacity `len`.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut K;
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, len, len))
    }
}
