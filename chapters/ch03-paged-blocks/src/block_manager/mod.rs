//! The block manager: which physical blocks each sequence owns, which it shares, and which
//! full blocks are kept for later prompts that start the same way.
//!
//! Three ideas, as vLLM has them:
//!
//! - **Paging.** The pool is `num_blocks` blocks of `block_size` positions. A sequence holds a
//!   [`BlockTable`] and grows it one block at a time from a free list (module `allocator`), so no
//!   memory is reserved for tokens that never come.
//! - **Prefix caching.** A full block is identified by its tokens *and everything before it*,
//!   through a chained hash ([`block_hash`]). When a sequence frees a block that is registered
//!   in the cache, the block keeps its K/V; a later prompt with the same prefix takes it back
//!   instead of recomputing it. Unreferenced cached blocks are evicted least recently released
//!   first, only when the free list is empty (module `prefix_cache`).
//! - **Copy-on-write.** A block in several tables (after [`BlockManager::fork`] or a prefix hit)
//!   or registered in the cache is read-only. Before a sequence writes into one,
//!   [`BlockManager::reserve`] gives it a private copy and returns the [`BlockCopy`] the pool
//!   must perform.
//!
//! One step of a sequence, as the engine drives it:
//!
//! ```text
//! table = allocate_prompt(prompt)        positions 0..table.num_tokens() are already there
//! loop {
//!     copy = reserve(&mut table, n)      room for the n new positions (n = the rest of the
//!                                        prompt, a chunk of it, or 1 decode token)
//!     if let Some(c) = copy: pool.copy_block(c.src, c.dst)   before anything else allocates
//!     forward pass writes positions num_tokens..num_tokens+n through table.slot(pos)
//!     commit(&mut table, num_tokens + n)
//!     cache_full_blocks(&table, &tokens[..num_tokens])       offer the full blocks to others
//! }
//! free(table)
//! ```
//!
//! Invariants (checked by [`BlockManager::check_invariants`] against the live tables):
//!
//! 1. The reference count of a block is the number of live tables that contain it.
//! 2. Every block is in exactly one state: on the free list (count 0, unregistered), cached and
//!    evictable (count 0, registered), or referenced (count > 0, registered or not). The free
//!    list holds no block twice. [`BlockManager::num_free_blocks`] counts the first two.
//! 3. The hash map and the per-block records agree: `map[h] == b` ⇔ block `b` is registered
//!    with hash `h`. A registered block holds the K/V of its recorded tokens after its recorded
//!    parent chain, and is never written again (invariant 4 keeps it so).
//! 4. A table only writes into a block it owns alone and that is not registered: `reserve`
//!    copies on write before handing out a position in any other block.
//! 5. A table's positions `0..num_tokens` hold the K/V of its tokens: a prefix hit returns only
//!    blocks whose chain of recorded tokens equals the prompt's, so a hash collision can never
//!    return wrong K/V.
//!
//! Costs: allocating or freeing a block is O(1) from the free list, O(log n) when it evicts from
//! or releases into the cache's LRU order. `allocate_prompt` is O(prompt length) (one hash and
//! one comparison per full block); `reserve` is O(blocks it adds); `fork` and `free` are
//! O(table length); `cache_full_blocks` is O(blocks not yet registered at the table's end).

mod allocator;
mod prefix_cache;

pub use prefix_cache::{FNV_OFFSET, ROOT_HASH, block_hash, fnv1a_extend};

use allocator::BlockAllocator;
use prefix_cache::{Lookup, PrefixCache, ROOT};

use crate::block_table::{BlockId, BlockTable};

/// A copy the pool must perform before a write: block `src`'s K/V into block `dst`, all layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
}

/// Why blocks could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// `needed` blocks would have left the free pool (fresh blocks, and cached blocks a prefix
    /// hit would take back), but only `free` ([`BlockManager::num_free_blocks`]) were there.
    #[error("out of KV blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
}

/// Counters of the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Full prompt blocks looked up / found.
    pub queried_blocks: u64,
    pub hit_blocks: u64,
    pub evictions: u64,
}

/// The pool's bookkeeping: free list, reference counts, prefix cache. It never touches K/V; it
/// tells the pool which slots to write and which blocks to copy.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    allocator: BlockAllocator,
    /// `None` when prefix caching is off: then nothing is ever looked up or registered.
    cache: Option<PrefixCache>,
    stats: PrefixStats,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks of `block_size` positions, all free.
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        assert!(block_size >= 1, "block_size must be at least 1");
        BlockManager {
            block_size,
            allocator: BlockAllocator::new(num_blocks),
            cache: enable_prefix_caching.then(|| PrefixCache::new(num_blocks)),
            stats: PrefixStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.allocator.num_blocks()
    }

    /// Blocks an allocation can have: the free list, plus cached blocks no table holds.
    pub fn num_free_blocks(&self) -> usize {
        self.allocator.num_free() + self.num_evictable_blocks()
    }

    /// Cached blocks no table holds: kept for later prompts, evicted when blocks run out.
    pub fn num_evictable_blocks(&self) -> usize {
        self.cache.as_ref().map_or(0, PrefixCache::num_evictable)
    }

    pub fn prefix_caching_enabled(&self) -> bool {
        self.cache.is_some()
    }

    /// Whether `block` is registered in the prefix cache (and so read-only).
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.cache.as_ref().is_some_and(|c| c.is_registered(block))
    }

    /// The token ids a cached block holds (`block_size` of them), or `None` if not cached.
    pub fn cached_tokens(&self, block: BlockId) -> Option<&[u32]> {
        self.cache.as_ref().and_then(|c| c.tokens(block))
    }

    /// A table for a new sequence whose prompt is `tokens`.
    ///
    /// With prefix caching, the longest cached prefix of whole blocks is reused (one more
    /// reference each). The table's `num_tokens()` is how many prompt positions already hold
    /// K/V: `min(hit blocks × block_size, tokens.len() − 1)`, so at least the last token is
    /// computed and yields logits. Its capacity covers the whole prompt. Call
    /// [`reserve`](Self::reserve) before writing the rest: on a full hit it copies the last
    /// (cached) block. An empty prompt gets an empty table.
    ///
    /// On `OutOfBlocks` nothing changes: no reference, no eviction, no statistic.
    // ANCHOR: allocate_prompt
    pub fn allocate_prompt(&mut self, tokens: &[u32]) -> Result<BlockTable, BlockError> {
        let bs = self.block_size;
        let mut table = BlockTable::new(bs);
        // 1. The longest cached prefix of whole blocks. Looking up takes nothing yet.
        table.blocks = self.cached_prefix(tokens);
        let hits = table.blocks.len();
        let total = tokens.len().div_ceil(bs);

        // 2. Enough blocks? Hits nobody holds leave the free pool too.
        let needed = self.new_blocks(&table.blocks, total);
        let free = self.num_free_blocks();
        if needed > free {
            return Err(BlockError::OutOfBlocks { needed, free });
        }

        // 3. Take the hits, then fresh blocks (from the free list, or by evicting).
        for &block in &table.blocks {
            self.take_cached(block);
        }
        for _ in hits..total {
            let block = self.alloc_block();
            table.blocks.push(block);
        }
        if self.cache.is_some() {
            self.stats.queried_blocks += (tokens.len() / bs) as u64;
            self.stats.hit_blocks += hits as u64;
        }
        table.num_tokens = (hits * bs).min(tokens.len().saturating_sub(1));
        Ok(table)
    }
    // ANCHOR_END: allocate_prompt

    /// The free blocks a prompt of `tokens` takes before its first token is computed, now:
    /// [`allocate_prompt`](Self::allocate_prompt)'s blocks but the cached prefix's that a
    /// table already holds (a waiting request whose prefix a running one holds needs only its
    /// own), and on a hit of every block the private copy of the last one, whose last position
    /// is computed again ([`reserve`](Self::reserve) copies it).
    pub fn blocks_for_prompt(&self, tokens: &[u32]) -> usize {
        let hits = self.cached_prefix(tokens);
        let total = tokens.len().div_ceil(self.block_size);
        let full_hit = total > 0 && hits.len() == total;
        self.new_blocks(&hits, total) + usize::from(full_hit)
    }

    /// The free blocks a table for `tokens` takes, now, when the K/V of every one of them is
    /// known already (a sequence swapped out after computing them, whose K/V is copied back):
    /// [`blocks_for_prompt`](Self::blocks_for_prompt)'s count without the copy of the last
    /// block on a hit of every block. No position of `tokens` is computed again, so the table
    /// is committed to `tokens.len()` positions and its next write, at a block boundary, goes
    /// to a new block.
    pub fn blocks_for_computed(&self, tokens: &[u32]) -> usize {
        let hits = self.cached_prefix(tokens);
        self.new_blocks(&hits, tokens.len().div_ceil(self.block_size))
    }

    /// The longest cached prefix of whole blocks of `tokens` (none without prefix caching).
    fn cached_prefix(&self, tokens: &[u32]) -> Vec<BlockId> {
        let mut blocks = Vec::new();
        if let Some(cache) = &self.cache {
            let mut parent = ROOT;
            for chunk in tokens.chunks_exact(self.block_size) {
                let Lookup::Hit(block, pos) = cache.lookup(parent, chunk) else {
                    break;
                };
                blocks.push(block);
                parent = pos;
            }
        }
        blocks
    }

    /// Free blocks a table of `total` blocks takes when `hits` start it: the rest, and the
    /// hits nobody holds (they leave the evictable part of the free pool).
    fn new_blocks(&self, hits: &[BlockId], total: usize) -> usize {
        let revived = hits.iter().filter(|&&b| self.ref_count(b) == 0).count();
        total - hits.len() + revived
    }

    /// Makes room for positions `num_tokens..num_tokens + n`: adds blocks as needed and, if a
    /// block that will receive one of them is shared or cached, swaps in a private copy.
    ///
    /// Returns the copy the pool must perform (before anything else allocates) when the block
    /// receiving position `num_tokens` already held positions of this sequence. Does not change
    /// `num_tokens`. On `OutOfBlocks` the table and the manager are unchanged.
    // ANCHOR: reserve
    pub fn reserve(
        &mut self,
        table: &mut BlockTable,
        n: usize,
    ) -> Result<Option<BlockCopy>, BlockError> {
        debug_assert_eq!(table.block_size, self.block_size, "foreign table");
        if n == 0 {
            return Ok(None);
        }
        let bs = self.block_size;
        let start = table.num_tokens;
        let first = start / bs; // the block receiving position `start`
        let end = (start + n).div_ceil(bs); // blocks the table must have
        let present = end.min(table.blocks.len()); // blocks first..present exist already

        // Count first, so that a failure changes nothing.
        let shared = (first..present)
            .filter(|&i| self.is_read_only(table.blocks[i]))
            .count();
        let needed = end.saturating_sub(table.blocks.len()) + shared;
        let free = self.num_free_blocks();
        if needed > free {
            return Err(BlockError::OutOfBlocks { needed, free });
        }

        // Copy-on-write. Only block `first` can hold written positions (those before `start`);
        // any later existing block was reserved but never written, so needs no copy.
        let mut copy = None;
        for i in first..present {
            let old = table.blocks[i];
            if !self.is_read_only(old) {
                continue;
            }
            let new = self.alloc_block();
            table.blocks[i] = new;
            if i == first && !start.is_multiple_of(bs) {
                copy = Some(BlockCopy { src: old, dst: new });
            } else {
                self.release(old);
            }
        }
        while table.blocks.len() < end {
            let block = self.alloc_block();
            table.blocks.push(block);
        }
        // The source is let go last, so no allocation above could have reused it.
        if let Some(BlockCopy { src, .. }) = copy {
            self.release(src);
        }
        Ok(copy)
    }
    // ANCHOR_END: reserve

    /// Positions `0..new_len` of the table now hold K/V (`new_len <= capacity()`). `new_len`
    /// may be below `num_tokens` (rejected speculative tokens): the blocks stay allocated.
    pub fn commit(&mut self, table: &mut BlockTable, new_len: usize) {
        assert!(
            new_len <= table.capacity(),
            "commit of {new_len} positions into a table of capacity {}",
            table.capacity()
        );
        table.num_tokens = new_len;
    }

    /// Rolls the table back to `len` positions (`len <= capacity()`): positions `len..` no
    /// longer hold K/V, and blocks no position below `len` lives in are let go, last first.
    /// Speculative decoding (chapter 6) writes drafts' K/V ahead and keeps only the accepted
    /// ones. The blocks let go were reserved past the sequence's end, so none is registered
    /// in the prefix cache; the block holding position `len - 1` stays.
    pub fn rollback(&mut self, table: &mut BlockTable, len: usize) {
        debug_assert_eq!(table.block_size, self.block_size, "foreign table");
        self.commit(table, len);
        let keep = len.div_ceil(self.block_size);
        while table.blocks.len() > keep {
            let block = table.blocks.pop().expect("more blocks than kept");
            self.release(block);
        }
    }

    /// Offers the table's full blocks to later prompts: registers, under its chained hash, each
    /// full block not registered yet. `tokens` are the ids of positions `0..num_tokens()` (ids
    /// past `num_tokens()`, of positions not yet computed, are ignored).
    ///
    /// If the same content is already cached in another block, this block stays private (it is
    /// freed normally). If another content holds the hash (a collision), registering stops
    /// there. A no-op with prefix caching off.
    // ANCHOR: cache_full_blocks
    pub fn cache_full_blocks(&mut self, table: &BlockTable, tokens: &[u32]) {
        let Some(cache) = &mut self.cache else {
            return;
        };
        let bs = self.block_size;
        let full = tokens.len().min(table.num_tokens) / bs;

        // Everything up to the last registered full block is settled: start after it.
        let mut start = full;
        let mut parent = ROOT;
        while start > 0 {
            if let Some(pos) = cache.chain_pos(table.blocks[start - 1]) {
                debug_assert_eq!(
                    cache.tokens(table.blocks[start - 1]),
                    Some(&tokens[(start - 1) * bs..start * bs]),
                    "a cached block of the table holds other tokens"
                );
                parent = pos;
                break;
            }
            start -= 1;
        }

        for (i, chunk) in tokens.chunks_exact(bs).enumerate().take(full).skip(start) {
            parent = match cache.lookup(parent, chunk) {
                Lookup::Hit(_, pos) => pos, // cached in another block: ours stays private
                Lookup::Miss => cache.register(table.blocks[i], parent, chunk),
                Lookup::Taken => return, // a collision: the chain cannot continue
            };
        }
    }
    // ANCHOR_END: cache_full_blocks

    /// A new table sharing every block of `table` (one more reference each), with the same
    /// `num_tokens`: parallel sampling of one prompt. The first branch to write into a shared
    /// block gets a copy from [`reserve`](Self::reserve).
    pub fn fork(&mut self, table: &BlockTable) -> BlockTable {
        // ANCHOR: task_3_3
        debug_assert_eq!(table.block_size, self.block_size, "foreign table");
        for &block in &table.blocks {
            let count = self.allocator.incref(block);
            debug_assert!(count > 1, "forking a table that holds a free block");
        }
        table.clone()
        // ANCHOR_END: task_3_3
    }

    /// Lets go of every block of the table. A block no table holds any more returns to the free
    /// list, or, if cached, becomes evictable. Blocks are released last first, so that a
    /// sequence's tail is evicted before its head, which more prompts share.
    pub fn free(&mut self, table: BlockTable) {
        // ANCHOR: task_3_3
        debug_assert_eq!(table.block_size, self.block_size, "foreign table");
        for &block in table.blocks.iter().rev() {
            self.release(block);
        }
        // ANCHOR_END: task_3_3
    }

    /// How many tables hold `block` (0 if free, cached or out of range).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.allocator.ref_count(block)
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// Checks the module's invariants 1–3 against `tables`, which must be every live table.
    pub fn check_invariants(&self, tables: &[&BlockTable]) -> Result<(), String> {
        let num_blocks = self.num_blocks();
        let refs = self.allocator.ref_counts();

        let mut holders = vec![0u32; num_blocks];
        let mut last_table = vec![usize::MAX; num_blocks];
        for (t, table) in tables.iter().enumerate() {
            if table.block_size != self.block_size {
                return Err(format!(
                    "table {t}: block size {} in a manager of block size {}",
                    table.block_size, self.block_size
                ));
            }
            if table.num_tokens > table.capacity() {
                return Err(format!(
                    "table {t}: {} tokens in a capacity of {}",
                    table.num_tokens,
                    table.capacity()
                ));
            }
            for &block in &table.blocks {
                let b = block as usize;
                if b >= num_blocks {
                    return Err(format!("table {t}: block {block} out of range"));
                }
                if last_table[b] == t {
                    return Err(format!("table {t} holds block {block} twice"));
                }
                last_table[b] = t;
                holders[b] += 1;
            }
        }

        let mut on_free_list = vec![false; num_blocks];
        for &block in self.allocator.free_list() {
            let b = block as usize;
            if b >= num_blocks {
                return Err(format!("free list: block {block} out of range"));
            }
            if on_free_list[b] {
                return Err(format!("block {block} is on the free list twice"));
            }
            on_free_list[b] = true;
        }

        for b in 0..num_blocks {
            let block = b as BlockId;
            if refs[b] != holders[b] {
                return Err(format!(
                    "block {block}: reference count {} but {} live tables hold it",
                    refs[b], holders[b]
                ));
            }
            let cached = self.is_cached(block);
            let evictable = self.cache.as_ref().is_some_and(|c| c.is_evictable(block));
            let exactly_one = match (on_free_list[b], evictable, refs[b] > 0) {
                (true, false, false) => !cached,
                (false, true, false) | (false, false, true) => true,
                _ => false,
            };
            if !exactly_one {
                return Err(format!(
                    "block {block}: free list {}, cached {cached}, evictable {evictable}, \
                     references {}: not exactly one of free / evictable / referenced",
                    on_free_list[b], refs[b]
                ));
            }
        }

        if let Some(cache) = &self.cache {
            cache.check(refs, self.block_size)?;
        }
        Ok(())
    }

    /// Whether writing into `block` would be seen by someone else: another table, or a later
    /// prompt through the prefix cache.
    fn is_read_only(&self, block: BlockId) -> bool {
        self.ref_count(block) > 1 || self.is_cached(block)
    }

    /// A block with reference count 1: off the free list, or else the least recently released
    /// cached block, evicted. Callers check `num_free_blocks()` first.
    fn alloc_block(&mut self) -> BlockId {
        if let Some(block) = self.allocator.pop_free() {
            return block;
        }
        let block = self
            .cache
            .as_mut()
            .and_then(PrefixCache::evict_lru)
            .expect("callers check num_free_blocks() first");
        self.stats.evictions += 1;
        self.allocator.incref(block);
        block
    }

    /// One more reference to a block a prefix hit found (which may be evictable).
    fn take_cached(&mut self, block: BlockId) {
        if self.allocator.incref(block) == 1
            && let Some(cache) = &mut self.cache
        {
            cache.revive(block);
        }
    }

    /// One reference fewer; at zero the block goes to the cache's LRU order or the free list.
    fn release(&mut self, block: BlockId) {
        if self.allocator.decref(block) != Some(0) {
            return;
        }
        match &mut self.cache {
            Some(cache) if cache.is_registered(block) => cache.release(block),
            _ => self.allocator.push_free(block),
        }
    }
}
