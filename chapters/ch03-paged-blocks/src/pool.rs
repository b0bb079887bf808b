//! The K/V memory of every sequence: per layer, one K and one V array of fixed-size blocks.

use ch01::LlamaConfig;
use ch01::attention::AttentionShape;
use ch02::attention::{ScoreScratch, cached_attention_mapped};
use ch02::memory::{advise_huge_pages, populate};
use std::borrow::Cow;

use ndarray::ArrayView1;

use crate::block_manager::BlockCopy;
use crate::block_table::{BlockId, BlockTable};
use crate::kv_dtype::{KvElement, KvScales};

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
    #[error("a {dtype} KV pool is built from chapter 5's element types, not by this constructor")]
    DtypeElsewhere { dtype: crate::KvDtype },
}

// ANCHOR: pool
/// Per layer, K and V laid out `[num_blocks, block_size, num_kv_heads, head_dim]`, stored as
/// `K` (f32 by default, bf16 for half the bytes: see [`KvElement`]).
/// Slot `s = block · block_size + offset` holds one position's K (or V): row `s` of
/// `[num_blocks · block_size, kv_dim]`.
///
/// A scaled `K` (8-bit, chapter 5) also keeps, per layer, one f32 scale per slot and KV head
/// for K and for V, `[num_blocks · block_size, num_kv_heads]` (see [`KvScales`]).
///
/// Invariant: `keys.len() == values.len() == num_layers`, each `num_blocks · block_size · kv_dim`
/// long; `key_scales`, `value_scales` are as many, each `num_blocks · block_size · num_kv_heads`
/// long if `K::SCALED`, else empty. The pool does not know who owns a block: the
/// [`crate::BlockManager`] does.
pub struct KvPool<K: KvElement = f32> {
    keys: Vec<Vec<K>>,
    values: Vec<Vec<K>>,
    key_scales: Vec<Vec<f32>>,
    value_scales: Vec<Vec<f32>>,
    num_blocks: usize,
    block_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scores: ScoreScratch,
}

/// One block's K/V (and scales) in every layer, as [`KvPool::read_block`] copies it out.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockData<K> {
    /// Every layer's K block, then every layer's V block.
    pub elements: Vec<K>,
    /// Their scales in the same order (empty for an unscaled pool).
    pub scales: Vec<f32>,
}
// ANCHOR_END: pool

impl<K: KvElement> KvPool<K> {
    /// Bytes one block takes: K and V, every layer, `block_size` positions, `K` each (and the
    /// scales of a scaled `K`).
    pub fn bytes_per_block(config: &LlamaConfig, block_size: usize) -> u64 {
        K::DTYPE.bytes_per_token(config) * block_size as u64
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
        let (num_kv_heads, head_dim) = (config.num_key_value_heads, config.head_dim);
        let kv_dim = num_kv_heads * head_dim;
        let bytes =
            K::DTYPE.bytes_per_token(config) as u128 * num_blocks as u128 * block_size as u128;
        let slots = num_blocks
            .checked_mul(block_size)
            .ok_or(PoolError::OutOfMemory { bytes })?;
        fn layers<T: KvElement>(n: usize, len: Option<usize>, bytes: u128) -> PoolResult<T> {
            let len = len.ok_or(PoolError::OutOfMemory { bytes })?;
            (0..n)
                .map(|_| zeroed(len).ok_or(PoolError::OutOfMemory { bytes }))
                .collect()
        }
        let n = config.num_hidden_layers;
        let scale_layers = if K::SCALED { n } else { 0 };
        Ok(KvPool {
            keys: layers(n, slots.checked_mul(kv_dim), bytes)?,
            values: layers(n, slots.checked_mul(kv_dim), bytes)?,
            key_scales: layers(scale_layers, slots.checked_mul(num_kv_heads), bytes)?,
            value_scales: layers(scale_layers, slots.checked_mul(num_kv_heads), bytes)?,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            // One query's scores over the longest context the pool can hold (it grows on
            // demand, never past what a step asks).
            scores: ScoreScratch::for_decode(
                config.attention_shape(),
                config.max_position_embeddings.min(slots),
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

    /// Backs every page of the pool with memory now instead of at each block's first write,
    /// which otherwise takes a page fault (and the system's zeroing of the page) in the middle
    /// of a step. A server does this at start-up, where a pool that does not fit in memory fails
    /// at once rather than under load; llama.cpp's context creation does the same when it clears
    /// its KV buffers. The contents stay zeros. Advice only: where the system does not offer it
    /// (Linux before 5.14, other systems), nothing happens and the pages fault lazily as before.
    /// Returns whether every buffer was populated.
    pub fn populate(&mut self) -> bool {
        let (keys, values) = (self.keys.iter(), self.values.iter());
        let elements = keys.chain(values).map(|b| populate(b));
        let scales = (self.key_scales.iter().chain(&self.value_scales)).map(|b| populate(b));
        // Every buffer is asked, even after one refusal.
        elements.chain(scales).fold(true, |all, done| all & done)
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
        self.num_kv_heads * self.head_dim
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    /// Positions the whole pool holds.
    pub fn token_capacity(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Copies block `src`'s K/V (and scales) into block `dst` in every layer (copy-on-write).
    pub fn copy_block(&mut self, copy: BlockCopy) {
        let (src, dst) = (copy.src as usize, copy.dst as usize);
        let len = self.block_size * self.kv_dim();
        for buffer in self.keys.iter_mut().chain(self.values.iter_mut()) {
            buffer.copy_within(src * len..(src + 1) * len, dst * len);
        }
        let len = self.block_size * self.num_kv_heads;
        for buffer in self
            .key_scales
            .iter_mut()
            .chain(self.value_scales.iter_mut())
        {
            buffer.copy_within(src * len..(src + 1) * len, dst * len);
        }
    }

    /// Block `id`'s K and V (and scales) in every layer, one after the other: what swapping
    /// copies out to CPU memory (chapter 4).
    pub fn read_block(&self, id: BlockId) -> BlockData<K> {
        let id = id as usize;
        let len = self.block_size * self.kv_dim();
        let elements = self.keys.iter().chain(&self.values);
        let elements = elements.flat_map(|b| &b[id * len..(id + 1) * len]).copied();
        let len = self.block_size * self.num_kv_heads;
        let scales = self.key_scales.iter().chain(&self.value_scales);
        let scales = scales.flat_map(|b| &b[id * len..(id + 1) * len]).copied();
        BlockData {
            elements: elements.collect(),
            scales: scales.collect(),
        }
    }

    /// Writes back what [`KvPool::read_block`] read, into block `id`.
    pub fn write_block(&mut self, id: BlockId, data: &BlockData<K>) {
        let id = id as usize;
        let len = self.block_size * self.kv_dim();
        let buffers = self.keys.iter_mut().chain(self.values.iter_mut());
        for (buffer, part) in buffers.zip(data.elements.chunks_exact(len)) {
            buffer[id * len..(id + 1) * len].copy_from_slice(part);
        }
        let len = self.block_size * self.num_kv_heads;
        let buffers = self
            .key_scales
            .iter_mut()
            .chain(self.value_scales.iter_mut());
        for (buffer, part) in buffers.zip(data.scales.chunks_exact(len)) {
            buffer[id * len..(id + 1) * len].copy_from_slice(part);
        }
    }

    /// Layer `layer`'s keys and values, each `[num_blocks · block_size, kv_dim]` row-major:
    /// row `s` is slot `s` (what a batched attention kernel reads, see chapter 4). For a scaled
    /// `K` these are codes: [`KvPool::layer_scales`] holds what to multiply them by.
    pub fn layer_kv(&self, layer: usize) -> (&[K], &[K]) {
        (&self.keys[layer], &self.values[layer])
    }

    /// Layer `layer`'s scales ([`KvScales::NONE`]-like, all 1, for an unscaled `K`).
    pub fn layer_scales(&self, layer: usize) -> KvScales<'_> {
        if K::SCALED {
            KvScales::new(
                &self.key_scales[layer],
                &self.value_scales[layer],
                self.num_kv_heads,
            )
        } else {
            KvScales::NONE
        }
    }

    /// Writes one position's K and V rows (`kv_dim` values each) of `layer` into `slot`,
    /// rounded to `K` (a scaled `K`: each head's row quantized with its own scale).
    pub fn write<'r>(
        &mut self,
        layer: usize,
        slot: usize,
        k: ArrayView1<'r, f32>,
        v: ArrayView1<'r, f32>,
    ) {
        let (d, kv_dim) = (self.head_dim, self.kv_dim());
        let at = slot * kv_dim;
        let halves = [
            (&mut self.keys[layer], self.key_scales.get_mut(layer), k),
            (&mut self.values[layer], self.value_scales.get_mut(layer), v),
        ];
        for (buffer, scales, row) in halves {
            let codes = &mut buffer[at..at + kv_dim];
            // The executor's rows are contiguous; a strided view is copied first. (A slice's
            // loop compiles to vector code; ndarray's element iterator does not.)
            let row = row
                .as_slice()
                .map_or_else(|| Cow::Owned(row.to_vec()), Cow::Borrowed);
            match scales {
                Some(scales) if K::SCALED => {
                    let scales = &mut scales[slot * self.num_kv_heads..][..self.num_kv_heads];
                    let heads = codes.chunks_exact_mut(d).zip(row.chunks_exact(d));
                    for ((codes_h, x_h), s) in heads.zip(scales) {
                        *s = K::quantize_head(x_h, codes_h);
                    }
                }
                _ => {
                    for (dst, &x) in codes.iter_mut().zip(row.iter()) {
                        *dst = K::from_f32(x);
                    }
                }
            }
        }
    }
}

type PoolResult<T> = Result<Vec<Vec<T>>, PoolError>;

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
/// until blocks are used; unlike it, failure is a value instead of an abort, and the buffer
/// asks for huge pages ([`advise_huge_pages`]).
fn zeroed<K: KvElement>(len: usize) -> Option<Vec<K>> {
    if len == 0 || size_of::<K>() == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<K>(len).ok()?;
    // SAFETY: `layout` has a non-zero size (len > 0, K not zero-sized). A non-null result
    // points to `len` zeroed `K`s (valid values: `KvElement`'s safety contract) allocated by the
    // global allocator with this layout, which is what `Vec::from_raw_parts` requires for length
    // and capacity `len`.
    let buffer = unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut K;
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, len, len))
    }?;
    advise_huge_pages(&buffer);
    Some(buffer)
}
