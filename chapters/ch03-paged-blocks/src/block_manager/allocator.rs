//! The block allocator: a free list (a stack) and a reference count per block.
//!
//! Invariants: a block on the free list has reference count 0 and is there once; a block
//! with a count above 0 is in that many block tables. (Blocks with count 0 that are *not* on
//! the free list are held by the prefix cache; the manager keeps the two apart.)
//!
//! Costs: every operation O(1).

use crate::block_table::BlockId;

#[derive(Debug)]
pub(super) struct BlockAllocator {
    free: Vec<BlockId>,   // a stack: the last block pushed is the next one handed out
    ref_counts: Vec<u32>, // per block
}

impl BlockAllocator {
    /// All `num_blocks` blocks free, handed out from block 0 upward.
    pub fn new(num_blocks: usize) -> Self {
        let num_blocks = BlockId::try_from(num_blocks).expect("block ids are u32");
        BlockAllocator {
            free: (0..num_blocks).rev().collect(),
            ref_counts: vec![0; num_blocks as usize],
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks on the free list.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Takes a block off the free list, with reference count 1.
    pub fn pop_free(&mut self) -> Option<BlockId> {
        let block = self.free.pop()?;
        debug_assert_eq!(self.ref_counts[block as usize], 0);
        self.ref_counts[block as usize] = 1;
        Some(block)
    }

    /// Returns a block with reference count 0 to the free list.
    pub fn push_free(&mut self, block: BlockId) {
        debug_assert_eq!(
            self.ref_counts[block as usize], 0,
            "freeing a referenced block"
        );
        self.free.push(block);
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts.get(block as usize).copied().unwrap_or(0)
    }

    pub fn ref_counts(&self) -> &[u32] {
        &self.ref_counts
    }

    pub fn free_list(&self) -> &[BlockId] {
        &self.free
    }

    /// One more table holds `block`; returns the new count.
    pub fn incref(&mut self, block: BlockId) -> u32 {
        let count = &mut self.ref_counts[block as usize];
        *count += 1;
        *count
    }

    /// One table fewer holds `block`; returns the new count, or `None` (and changes nothing)
    /// if no table held it: a double free.
    pub fn decref(&mut self, block: BlockId) -> Option<u32> {
        let count = &mut self.ref_counts[block as usize];
        debug_assert!(*count > 0, "block {block} freed more often than allocated");
        *count = count.checked_sub(1)?;
        Some(*count)
    }
}
