//! A sequence's block table: logical block `i` of the sequence lives in physical block
//! `blocks[i]` of the pool, like a page table maps virtual pages to frames.

/// Index of a physical block in the pool.
pub type BlockId = u32;

/// Logical → physical block map of one sequence.
///
/// Invariants: positions `0..num_tokens` hold K/V; `num_tokens <= capacity()`, where
/// `capacity() = blocks.len() × block_size`; position `p` lives in slot
/// `blocks[p / block_size] × block_size + p % block_size` of the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTable {
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) num_tokens: usize,
    pub(crate) block_size: usize,
}

impl BlockTable {
    /// An empty table for blocks of `block_size` tokens (`block_size >= 1`).
    pub fn new(block_size: usize) -> Self {
        assert!(block_size >= 1, "block_size must be at least 1");
        BlockTable {
            blocks: Vec::new(),
            num_tokens: 0,
            block_size,
        }
    }

    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Positions that hold K/V.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Positions the allocated blocks can hold.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * self.block_size
    }

    /// The pool slot of position `pos` (`pos < capacity()`): the slot mapping.
    // ANCHOR: slot
    pub fn slot(&self, pos: usize) -> usize {
        self.blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }
    // ANCHOR_END: slot
}
