//! The prefix cache: full blocks found again by their content, and evicted least recently
//! released first.
//!
//! Each full block of a sequence stands for the tokens of *every* position up to its end,
//! because its K/V depend on them all. So a block's key is a hash **chained** over the blocks
//! before it: `hash(block i) = fnv1a64(hash(block i-1) ‖ tokens of block i)`, starting from
//! [`ROOT_HASH`]. Two sequences with the same first `k` blocks of tokens get the same `k` keys.
//!
//! A 64-bit hash can collide (and FNV-1a is easy to make collide on purpose), so the hash only
//! *locates* a candidate; a hit is decided by content. Each registered block is a node of a trie:
//! it records its own tokens and the node id of its parent (the registered block standing for
//! the blocks before it). Node ids are never reused, so a parent link can never point at a block
//! that was since evicted and filled with something else. A lookup walks from the root; at each
//! step the candidate must have the walk's current node as parent *and* the same tokens. By
//! induction, an accepted chain holds exactly the prompt's tokens, whatever the hash does.
//!
//! Invariants:
//! - `map[h] == b` ⇔ block `b` is registered with hash `h` (one block per hash);
//! - a registered block with reference count 0 is in `lru` under its tick, and only those are;
//! - registered blocks are never written (the manager copies on write), so their K/V always
//!   match their recorded tokens and chain.
//!
//! Costs: lookup and registration O(block_size) (one hash, one comparison); eviction and
//! release O(log n) (a `BTreeMap` ordered by release tick).

use std::collections::{BTreeMap, HashMap};

use crate::block_table::BlockId;

/// Identity of a registered block's content; never reused. 0 is the root (the empty prefix).
pub(super) type NodeId = u64;

/// The chain hash of the empty prefix: the parent hash of every sequence's first block.
pub const ROOT_HASH: u64 = 0;

/// FNV-1a, 64-bit (offset basis and prime from the FNV specification).
// ANCHOR: block_hash
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// `hash` (start from [`FNV_OFFSET`]) extended by `bytes`.
pub fn fnv1a_extend(mut hash: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// The key of a full block: FNV-1a 64 over the parent's hash (8 bytes, little-endian) then the
/// block's token ids (4 bytes each, little-endian). Deterministic on every platform and Rust
/// version. Use [`ROOT_HASH`] as `parent` for a sequence's first block.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    // ANCHOR: task_3_2
    let mut hash = fnv1a_extend(FNV_OFFSET, &parent.to_le_bytes());
    for token in tokens {
        hash = fnv1a_extend(hash, &token.to_le_bytes());
    }
    hash
    // ANCHOR_END: task_3_2
}
// ANCHOR_END: block_hash

/// A point of a verified chain: the node standing for a prefix of whole blocks, and its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ChainPos {
    pub node: NodeId,
    pub hash: u64,
}

/// The start of every chain: the empty prefix.
pub(super) const ROOT: ChainPos = ChainPos {
    node: 0,
    hash: ROOT_HASH,
};

/// What a lookup of one block found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lookup {
    /// This block holds exactly these tokens after exactly this prefix.
    Hit(BlockId, ChainPos),
    /// Nothing is cached under the hash.
    Miss,
    /// Another content holds the hash: a collision, or a block whose parent was evicted.
    Taken,
}

/// What the cache records about one registered block.
#[derive(Debug, Clone)]
struct Entry {
    node: NodeId,
    parent: NodeId,
    hash: u64,
    tokens: Box<[u32]>,
    /// `Some(tick)` while the block's reference count is 0: its place in the LRU order.
    released_at: Option<u64>,
}

/// Hash → block map, per-block content records, and the LRU order of unreferenced blocks.
#[derive(Debug)]
pub(super) struct PrefixCache {
    map: HashMap<u64, BlockId>,
    entries: Vec<Option<Entry>>, // per block
    lru: BTreeMap<u64, BlockId>, // release tick → block, oldest first
    next_tick: u64,
    next_node: NodeId,
}

impl PrefixCache {
    pub fn new(num_blocks: usize) -> Self {
        PrefixCache {
            map: HashMap::new(),
            entries: vec![None; num_blocks],
            lru: BTreeMap::new(),
            next_tick: 0,
            next_node: ROOT.node + 1,
        }
    }

    /// The block after `parent` holding `tokens`, if it is cached. Pure: takes no reference.
    // ANCHOR: lookup
    pub fn lookup(&self, parent: ChainPos, tokens: &[u32]) -> Lookup {
        let hash = block_hash(parent.hash, tokens);
        let Some(&block) = self.map.get(&hash) else {
            return Lookup::Miss;
        };
        let entry = self.entry(block).expect("map and entries agree");
        if entry.parent == parent.node && *entry.tokens == *tokens {
            Lookup::Hit(
                block,
                ChainPos {
                    node: entry.node,
                    hash,
                },
            )
        } else {
            Lookup::Taken
        }
    }
    // ANCHOR_END: lookup

    /// Registers `block` as holding `tokens` after `parent`. The hash must be free (the caller
    /// looked it up and got [`Lookup::Miss`]) and the block not registered.
    pub fn register(&mut self, block: BlockId, parent: ChainPos, tokens: &[u32]) -> ChainPos {
        let hash = block_hash(parent.hash, tokens);
        debug_assert!(!self.map.contains_key(&hash), "hash already registered");
        debug_assert!(self.entry(block).is_none(), "block already registered");
        let node = self.next_node;
        self.next_node += 1;
        self.map.insert(hash, block);
        self.entries[block as usize] = Some(Entry {
            node,
            parent: parent.node,
            hash,
            tokens: tokens.into(),
            released_at: None,
        });
        ChainPos { node, hash }
    }

    pub fn is_registered(&self, block: BlockId) -> bool {
        self.entry(block).is_some()
    }

    /// The chain point a registered block stands for.
    pub fn chain_pos(&self, block: BlockId) -> Option<ChainPos> {
        self.entry(block).map(|e| ChainPos {
            node: e.node,
            hash: e.hash,
        })
    }

    /// The token ids a registered block holds.
    pub fn tokens(&self, block: BlockId) -> Option<&[u32]> {
        self.entry(block).map(|e| &*e.tokens)
    }

    /// Registered blocks with reference count 0, which an allocation may evict.
    pub fn num_evictable(&self) -> usize {
        self.lru.len()
    }

    pub fn is_evictable(&self, block: BlockId) -> bool {
        self.entry(block).is_some_and(|e| e.released_at.is_some())
    }

    /// A registered block's reference count fell to 0: it joins the LRU order, newest.
    pub fn release(&mut self, block: BlockId) {
        let tick = self.next_tick;
        self.next_tick += 1;
        let entry = self.entries[block as usize]
            .as_mut()
            .expect("only registered blocks are released to the cache");
        debug_assert!(entry.released_at.is_none(), "released twice");
        entry.released_at = Some(tick);
        self.lru.insert(tick, block);
    }

    /// An evictable block is referenced again (a prefix hit): it leaves the LRU order.
    pub fn revive(&mut self, block: BlockId) {
        if let Some(tick) = self.entries[block as usize]
            .as_mut()
            .and_then(|e| e.released_at.take())
        {
            self.lru.remove(&tick);
        }
    }

    /// Unregisters the least recently released unreferenced block and returns it, now plain.
    pub fn evict_lru(&mut self) -> Option<BlockId> {
        let (_, block) = self.lru.pop_first()?;
        let entry = self.entries[block as usize]
            .take()
            .expect("LRU blocks are registered");
        self.map.remove(&entry.hash);
        Some(block)
    }

    fn entry(&self, block: BlockId) -> Option<&Entry> {
        self.entries.get(block as usize).and_then(Option::as_ref)
    }

    /// Checks the map, the entries and the LRU order against each other and against the
    /// reference counts `refs` (one per block).
    pub fn check(&self, refs: &[u32], block_size: usize) -> Result<(), String> {
        let mut registered = 0;
        for (block, entry) in self.entries.iter().enumerate() {
            let Some(entry) = entry else { continue };
            registered += 1;
            let block = block as BlockId;
            if self.map.get(&entry.hash) != Some(&block) {
                return Err(format!(
                    "block {block} records hash {:#x} but the map does not point to it",
                    entry.hash
                ));
            }
            if entry.tokens.len() != block_size {
                return Err(format!(
                    "block {block} is registered with {} tokens, not {block_size}",
                    entry.tokens.len()
                ));
            }
            if entry.node == ROOT.node || entry.node >= self.next_node || entry.parent >= entry.node
            {
                return Err(format!(
                    "block {block}: node {} / parent {} out of order",
                    entry.node, entry.parent
                ));
            }
            match entry.released_at {
                Some(tick) if refs[block as usize] != 0 => {
                    return Err(format!(
                        "block {block} is in the LRU order (tick {tick}) with {} references",
                        refs[block as usize]
                    ));
                }
                Some(tick) if self.lru.get(&tick) != Some(&block) => {
                    return Err(format!("block {block}: LRU tick {tick} not in the LRU map"));
                }
                None if refs[block as usize] == 0 => {
                    return Err(format!(
                        "block {block} is cached with no references but not evictable"
                    ));
                }
                _ => {}
            }
        }
        if self.map.len() != registered {
            return Err(format!(
                "hash map holds {} entries for {registered} registered blocks",
                self.map.len()
            ));
        }
        for (&tick, &block) in &self.lru {
            if self.entry(block).and_then(|e| e.released_at) != Some(tick) {
                return Err(format!(
                    "LRU tick {tick} names block {block}, which is not evictable at that tick"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        assert_eq!(fnv1a_extend(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_extend(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_extend(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn block_hash_chains_over_the_parent() {
        let first = block_hash(ROOT_HASH, &[1, 2]);
        assert_eq!(first, block_hash(ROOT_HASH, &[1, 2]));
        assert_ne!(first, block_hash(ROOT_HASH, &[2, 1]));
        assert_ne!(
            block_hash(first, &[3, 4]),
            block_hash(block_hash(ROOT_HASH, &[9, 9]), &[3, 4])
        );
    }

    #[test]
    fn a_colliding_hash_is_never_a_hit() {
        let mut cache = PrefixCache::new(4);
        cache.register(0, ROOT, &[1, 2]);
        // Pretend [7, 7] hashes like [1, 2]: the map points at block 0, the tokens differ.
        cache.map.insert(block_hash(ROOT_HASH, &[7, 7]), 0);
        assert_eq!(cache.lookup(ROOT, &[7, 7]), Lookup::Taken);
        assert!(matches!(cache.lookup(ROOT, &[1, 2]), Lookup::Hit(0, _)));
    }

    #[test]
    fn a_child_of_an_evicted_parent_is_never_a_hit() {
        let mut cache = PrefixCache::new(4);
        let parent = cache.register(0, ROOT, &[1, 2]);
        cache.register(1, parent, &[3, 4]);
        cache.release(0);
        assert_eq!(cache.evict_lru(), Some(0));
        // The same prefix registered again is a new node: block 1's parent link is stale.
        let again = cache.register(2, ROOT, &[1, 2]);
        assert_eq!(again.hash, parent.hash);
        assert_ne!(again.node, parent.node);
        assert_eq!(cache.lookup(again, &[3, 4]), Lookup::Taken);
    }

    #[test]
    fn eviction_takes_the_least_recently_released() {
        let mut cache = PrefixCache::new(4);
        for block in 0..3 {
            cache.register(block, ROOT, &[block, block]);
        }
        cache.release(2);
        cache.release(0);
        cache.release(1);
        cache.revive(0);
        assert_eq!(cache.evict_lru(), Some(2));
        assert_eq!(cache.evict_lru(), Some(1));
        assert_eq!(cache.evict_lru(), None);
        assert!(cache.is_registered(0) && !cache.is_registered(1));
    }
}
