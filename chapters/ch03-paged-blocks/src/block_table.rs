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
        // ANCHOR: task_3_1
        self.blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size
        // ANCHOR_END: task_3_1
    }
    // ANCHOR_END: slot
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn slot_maps_each_position_through_its_block() {
        // Tables of distinct blocks in any order, block sizes that divide nothing in particular.
        let cases = (1usize..9, 1usize..12).prop_flat_map(|(block_size, num_blocks)| {
            let blocks = Just((0..num_blocks as BlockId * 2).collect::<Vec<_>>())
                .prop_shuffle()
                .prop_map(move |ids| ids[..num_blocks].to_vec());
            (Just(block_size), blocks)
        });
        ch01::testing::seeded_runner(200, 31)
            .run(&cases, |(block_size, blocks)| {
                let table = BlockTable {
                    num_tokens: blocks.len() * block_size,
                    blocks: blocks.clone(),
                    block_size,
                };
                // The slots of the table's blocks, one after another, are its positions.
                let expected: Vec<usize> = blocks
                    .iter()
                    .flat_map(|&b| (0..block_size).map(move |o| b as usize * block_size + o))
                    .collect();
                for (pos, &slot) in expected.iter().enumerate() {
                    prop_assert_eq!(
                        table.slot(pos),
                        slot,
                        "position {} of {:?} (block size {})",
                        pos,
                        blocks,
                        block_size
                    );
                }
                Ok(())
            })
            .unwrap();
    }
}
