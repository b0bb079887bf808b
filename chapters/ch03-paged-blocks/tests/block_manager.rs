//! The block manager against a model of what it must do: random prompts (drawn from a few
//! shared documents, so prefixes repeat), appends, rejected tails, forks and frees on small
//! pools. The model keeps, for every pool slot, the token prefix whose K/V it holds; every
//! sequence must read its own prefix at every position, whatever was shared, cached, copied or
//! evicted. Then unit tests of each mechanism: prefix hits, copy-on-write, LRU eviction, failure.

use ch01::testing::seeded_runner;
use ch03_paged_blocks::block_manager::{
    BlockCopy, BlockError, BlockManager, PrefixStats, ROOT_HASH, block_hash,
};
use ch03_paged_blocks::block_table::{BlockId, BlockTable};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------------------------
// The model-based property test
// ---------------------------------------------------------------------------------------------

const VOCAB: u32 = 4;
const DOCS: usize = 3;
const DOC_LEN: usize = 48;

#[derive(Debug, Clone)]
enum Op {
    /// A new sequence: `docs[doc][..len]` then `tail`, prefilled at once.
    Prompt {
        doc: usize,
        len: usize,
        tail: Vec<u32>,
    },
    /// A step of `tokens.len()` new tokens, of which the last `rejected` are then dropped
    /// (as speculative decoding rejects drafts).
    Append {
        seq: Index,
        tokens: Vec<u32>,
        rejected: usize,
    },
    Fork {
        seq: Index,
    },
    Free {
        seq: Index,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let token = 0..VOCAB;
    prop_oneof![
        3 => (0..DOCS, 1..=40usize, proptest::collection::vec(token.clone(), 0..3))
            .prop_map(|(doc, len, tail)| Op::Prompt { doc, len, tail }),
        4 => (
            any::<Index>(),
            proptest::collection::vec(token, 1..10),
            prop_oneof![3 => Just(0usize), 1 => 1..4usize],
        )
            .prop_map(|(seq, tokens, rejected)| Op::Append { seq, tokens, rejected }),
        1 => any::<Index>().prop_map(|seq| Op::Fork { seq }),
        2 => any::<Index>().prop_map(|seq| Op::Free { seq }),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    block_size: usize,
    num_blocks: usize,
    caching: bool,
    docs: Vec<Vec<u32>>,
    ops: Vec<Op>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1..=8usize,
        4..=40usize,
        any::<bool>(),
        proptest::collection::vec(proptest::collection::vec(0..VOCAB, DOC_LEN), DOCS),
        proptest::collection::vec(op(), 1..60),
    )
        .prop_map(|(block_size, num_blocks, caching, docs, ops)| Case {
            block_size,
            num_blocks,
            caching,
            docs,
            ops,
        })
}

/// Everything observable about the manager, to prove a failed call changed nothing.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    refs: Vec<u32>,
    cached: Vec<Option<Vec<u32>>>,
    free: usize,
    evictable: usize,
    stats: PrefixStats,
}

fn snapshot(bm: &BlockManager) -> Snapshot {
    let blocks = 0..bm.num_blocks() as BlockId;
    Snapshot {
        refs: blocks.clone().map(|b| bm.ref_count(b)).collect(),
        cached: blocks
            .map(|b| bm.cached_tokens(b).map(<[u32]>::to_vec))
            .collect(),
        free: bm.num_free_blocks(),
        evictable: bm.num_evictable_blocks(),
        stats: bm.stats(),
    }
}

struct Sequence {
    table: BlockTable,
    tokens: Vec<u32>, // ids of positions 0..table.num_tokens() (and, mid-step, the new ones)
}

/// The manager, its live sequences, and what each pool slot holds: the token prefix whose last
/// position's K/V was written there (K/V depend on every token up to their position).
struct Model {
    bm: BlockManager,
    seqs: Vec<Sequence>,
    slots: Vec<Option<Vec<u32>>>, // [num_blocks * block_size]
}

impl Model {
    fn new(c: &Case) -> Self {
        Model {
            bm: BlockManager::new(c.num_blocks, c.block_size, c.caching),
            seqs: Vec::new(),
            slots: vec![None; c.num_blocks * c.block_size],
        }
    }

    fn bs(&self) -> usize {
        self.bm.block_size()
    }

    /// Computes the positions `num_tokens..tokens.len()` of sequence `i`, as a forward pass
    /// would: reserve, copy, write, commit (`rejected` fewer), register full blocks.
    /// `Ok(false)`: out of blocks, and nothing changed.
    fn step(&mut self, i: usize, rejected: usize) -> Result<bool, TestCaseError> {
        let bs = self.bs();
        let seq = &mut self.seqs[i];
        let start = seq.table.num_tokens();
        let n = seq.tokens.len() - start;
        let (before, table_before) = (snapshot(&self.bm), seq.table.clone());
        let first_before = seq.table.blocks().get(start / bs).copied();

        match self.bm.reserve(&mut seq.table, n) {
            Err(BlockError::OutOfBlocks { needed, free }) => {
                prop_assert!(needed > free, "{needed} needed, {free} free");
                prop_assert_eq!(free, before.free);
                prop_assert_eq!(
                    &seq.table,
                    &table_before,
                    "a failed reserve changed the table"
                );
                prop_assert_eq!(
                    snapshot(&self.bm),
                    before,
                    "a failed reserve changed the manager"
                );
                seq.tokens.truncate(start);
                return Ok(false);
            }
            Ok(copy) => {
                prop_assert!(seq.table.capacity() >= seq.tokens.len());
                prop_assert_eq!(seq.table.num_tokens(), start, "reserve moved num_tokens");
                if let Some(BlockCopy { src, dst }) = copy {
                    prop_assert!(!start.is_multiple_of(bs), "a copy with nothing to copy");
                    prop_assert_eq!(Some(src), first_before);
                    prop_assert_eq!(seq.table.blocks()[start / bs], dst);
                    prop_assert_eq!(self.bm.ref_count(src), before.refs[src as usize] - 1);
                    let (s, d) = (src as usize * bs, dst as usize * bs);
                    for o in 0..bs {
                        self.slots[d + o] = self.slots[s + o].clone();
                    }
                }
            }
        }

        // Write: only into blocks this sequence owns alone and that are not cached.
        for p in start..seq.tokens.len() {
            let block = seq.table.blocks()[p / bs];
            prop_assert_eq!(
                self.bm.ref_count(block),
                1,
                "writing a shared block {}",
                block
            );
            prop_assert!(!self.bm.is_cached(block), "writing cached block {}", block);
            self.slots[seq.table.slot(p)] = Some(seq.tokens[..=p].to_vec());
        }
        let len = seq.tokens.len() - rejected.min(n - 1);
        seq.tokens.truncate(len);
        self.bm.commit(&mut seq.table, len);
        self.bm.cache_full_blocks(&seq.table, &seq.tokens);
        Ok(true)
    }

    fn apply(&mut self, c: &Case, op: &Op) -> Result<(), TestCaseError> {
        let bs = self.bs();
        match op {
            Op::Prompt { doc, len, tail } => {
                let mut prompt = c.docs[*doc][..*len].to_vec();
                prompt.extend(tail);
                let before = snapshot(&self.bm);
                let table = match self.bm.allocate_prompt(&prompt) {
                    Err(BlockError::OutOfBlocks { needed, free }) => {
                        prop_assert!(needed > free);
                        prop_assert_eq!(free, before.free);
                        prop_assert_eq!(
                            snapshot(&self.bm),
                            before,
                            "a failed prompt changed state"
                        );
                        return Ok(());
                    }
                    Ok(table) => table,
                };
                let stats = self.bm.stats();
                let hits = (stats.hit_blocks - before.stats.hit_blocks) as usize;
                if c.caching {
                    prop_assert_eq!(
                        stats.queried_blocks - before.stats.queried_blocks,
                        (prompt.len() / bs) as u64
                    );
                } else {
                    prop_assert_eq!(stats, PrefixStats::default());
                }
                prop_assert!(table.capacity() >= prompt.len());
                prop_assert_eq!(table.blocks().len(), prompt.len().div_ceil(bs));
                prop_assert_eq!(table.num_tokens(), (hits * bs).min(prompt.len() - 1));
                for (i, &block) in table.blocks()[..hits].iter().enumerate() {
                    prop_assert_eq!(
                        self.bm.cached_tokens(block),
                        Some(&prompt[i * bs..(i + 1) * bs]),
                        "hit block {} holds other tokens",
                        i
                    );
                }
                self.seqs.push(Sequence {
                    table,
                    tokens: prompt,
                });
                self.check_contents()?; // the reused positions hold this prompt's K/V
                let i = self.seqs.len() - 1;
                if !self.step(i, 0)? {
                    // Not even the copy of a cached last block fitted: give up the sequence.
                    let seq = self.seqs.pop().unwrap();
                    self.bm.free(seq.table);
                }
            }
            Op::Append {
                seq,
                tokens,
                rejected,
            } => {
                if self.seqs.is_empty() {
                    return Ok(());
                }
                let i = seq.index(self.seqs.len());
                self.seqs[i].tokens.extend(tokens);
                self.step(i, *rejected)?;
            }
            Op::Fork { seq } => {
                if self.seqs.is_empty() {
                    return Ok(());
                }
                let i = seq.index(self.seqs.len());
                let table = self.bm.fork(&self.seqs[i].table);
                prop_assert_eq!(&table, &self.seqs[i].table);
                let tokens = self.seqs[i].tokens.clone();
                self.seqs.push(Sequence { table, tokens });
            }
            Op::Free { seq } => {
                if self.seqs.is_empty() {
                    return Ok(());
                }
                let i = seq.index(self.seqs.len());
                let seq = self.seqs.swap_remove(i);
                self.bm.free(seq.table);
            }
        }
        Ok(())
    }

    /// Every sequence reads its own token prefix's K/V at each of its positions.
    fn check_contents(&self) -> Result<(), TestCaseError> {
        for (s, seq) in self.seqs.iter().enumerate() {
            for p in 0..seq.table.num_tokens() {
                prop_assert_eq!(
                    self.slots[seq.table.slot(p)].as_deref(),
                    Some(&seq.tokens[..=p]),
                    "sequence {} position {}",
                    s,
                    p
                );
            }
        }
        Ok(())
    }

    fn check(&self, c: &Case) -> Result<(), TestCaseError> {
        let tables: Vec<&BlockTable> = self.seqs.iter().map(|s| &s.table).collect();
        if let Err(e) = self.bm.check_invariants(&tables) {
            return Err(TestCaseError::fail(e));
        }
        // The same facts, counted independently.
        let mut holders = vec![0u32; c.num_blocks];
        for seq in &self.seqs {
            prop_assert!(seq.table.capacity() >= seq.table.num_tokens());
            prop_assert_eq!(seq.tokens.len(), seq.table.num_tokens());
            for &b in seq.table.blocks() {
                holders[b as usize] += 1;
            }
        }
        for (b, &n) in holders.iter().enumerate() {
            prop_assert_eq!(self.bm.ref_count(b as BlockId), n, "block {}", b);
        }
        let referenced = holders.iter().filter(|&&n| n > 0).count();
        prop_assert_eq!(self.bm.num_free_blocks(), c.num_blocks - referenced);
        if !c.caching {
            prop_assert_eq!(self.bm.num_evictable_blocks(), 0);
        }
        self.check_contents()
    }
}

#[test]
fn the_manager_agrees_with_a_model_of_random_workloads() {
    seeded_runner(512, 3)
        .run(&case(), |c| {
            let mut model = Model::new(&c);
            for op in &c.ops {
                model.apply(&c, op)?;
                model.check(&c)?;
            }
            for seq in std::mem::take(&mut model.seqs) {
                model.bm.free(seq.table);
            }
            prop_assert_eq!(model.bm.num_free_blocks(), c.num_blocks, "blocks leaked");
            if let Err(e) = model.bm.check_invariants(&[]) {
                return Err(TestCaseError::fail(e));
            }
            Ok(())
        })
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Unit tests
// ---------------------------------------------------------------------------------------------

/// Prefills `prompt` in a fresh table (as the engine does) and registers its full blocks.
fn prefill(bm: &mut BlockManager, prompt: &[u32]) -> Result<BlockTable, BlockError> {
    let mut table = bm.allocate_prompt(prompt)?;
    let n = prompt.len() - table.num_tokens();
    bm.reserve(&mut table, n)?;
    bm.commit(&mut table, prompt.len());
    bm.cache_full_blocks(&table, prompt);
    Ok(table)
}

fn assert_invariants(bm: &BlockManager, tables: &[&BlockTable]) {
    if let Err(e) = bm.check_invariants(tables) {
        panic!("{e}");
    }
}

#[test]
fn an_identical_prompt_reuses_the_cached_full_blocks_and_counts_hits() {
    let mut bm = BlockManager::new(16, 4, true);
    let prompt: Vec<u32> = (0..10).collect(); // blocks [0..4] [4..8] [8, 9]
    let a = prefill(&mut bm, &prompt).unwrap();
    assert_eq!(a.blocks(), &[0, 1, 2]);
    assert_eq!(bm.cached_tokens(0), Some(&[0, 1, 2, 3][..]));
    assert_eq!(bm.cached_tokens(2), None, "the partial block is not cached");

    let b = bm.allocate_prompt(&prompt).unwrap();
    assert_eq!(
        &b.blocks()[..2],
        &a.blocks()[..2],
        "both full blocks reused"
    );
    assert_ne!(b.blocks()[2], a.blocks()[2], "the partial block is private");
    assert_eq!(b.num_tokens(), 8, "8 positions need no compute");
    assert_eq!(
        (bm.ref_count(0), bm.ref_count(1), bm.ref_count(2)),
        (2, 2, 1)
    );
    let stats = bm.stats();
    assert_eq!((stats.queried_blocks, stats.hit_blocks), (4, 2));

    // A prompt that differs in the second block reuses only the first.
    let mut other = prompt.clone();
    other[5] = 99;
    let c = bm.allocate_prompt(&other).unwrap();
    assert_eq!(c.blocks()[0], 0);
    assert_eq!(c.num_tokens(), 4);
    assert_eq!(bm.stats().hit_blocks, 3);
    assert_invariants(&bm, &[&a, &b, &c]);
}

#[test]
fn a_full_hit_leaves_the_last_token_to_compute_and_copies_the_cached_last_block() {
    let mut bm = BlockManager::new(8, 4, true);
    let prompt: Vec<u32> = (0..8).collect(); // exactly two full blocks
    let a = prefill(&mut bm, &prompt).unwrap();
    let cached = a.blocks().to_vec();
    bm.free(a);
    assert_eq!(bm.num_evictable_blocks(), 2);
    assert_eq!(bm.num_free_blocks(), 8);

    let mut b = bm.allocate_prompt(&prompt).unwrap();
    assert_eq!(b.blocks(), &cached[..], "every block is a hit");
    assert_eq!(
        b.num_tokens(),
        7,
        "the last token is computed, for its logits"
    );
    assert_eq!(bm.num_evictable_blocks(), 0);

    // Position 7 lands in the cached last block: the write goes to a private copy.
    let copy = bm.reserve(&mut b, 1).unwrap();
    let fresh = b.blocks()[1];
    assert_eq!(
        copy,
        Some(BlockCopy {
            src: cached[1],
            dst: fresh
        })
    );
    assert_eq!(b.blocks()[0], cached[0]);
    assert_eq!(bm.ref_count(cached[1]), 0);
    assert!(
        bm.is_cached(cached[1]),
        "the original stays cached, evictable"
    );
    assert_eq!(bm.num_evictable_blocks(), 1);
    bm.commit(&mut b, 8);
    bm.cache_full_blocks(&b, &prompt);
    assert!(
        !bm.is_cached(fresh),
        "same content as a cached block: stays private"
    );
    assert_invariants(&bm, &[&b]);

    // The copy is private now: the next token is written in place.
    assert_eq!(bm.reserve(&mut b, 1).unwrap(), None);
    assert_eq!(b.blocks().len(), 3);
}

/// Tokens whose K/V is known already (a swapped-out sequence's computed positions, copied back
/// when it is readmitted) are never computed again: on a hit of every block the table takes the
/// hits, its next position starts a new block, and nothing is copied. `blocks_for_computed`
/// counts exactly that; `blocks_for_prompt` counts the copy a prompt's recomputed last
/// position needs.
#[test]
fn blocks_for_computed_counts_no_copy_on_a_full_hit() {
    let mut bm = BlockManager::new(8, 4, true);
    let tokens: Vec<u32> = (0..8).collect(); // exactly two full blocks
    let a = prefill(&mut bm, &tokens).unwrap();
    bm.free(a);
    assert_eq!(bm.blocks_for_prompt(&tokens), 3, "two hits and the copy");
    assert_eq!(bm.blocks_for_computed(&tokens), 2, "two hits");

    let free = bm.num_free_blocks();
    let mut b = bm.allocate_prompt(&tokens).unwrap();
    bm.commit(&mut b, tokens.len());
    assert_eq!(free - bm.num_free_blocks(), 2);
    assert_eq!(bm.reserve(&mut b, 1).unwrap(), None, "a new block, no copy");
    assert_eq!(free - bm.num_free_blocks(), 3);
    assert_invariants(&bm, &[&b]);

    // Without hits, both count the table's blocks.
    let other: Vec<u32> = (100..106).collect();
    assert_eq!(bm.blocks_for_computed(&other), 2);
    assert_eq!(bm.blocks_for_prompt(&other), 2);
}

#[test]
fn a_full_hit_while_the_owner_lives_copies_and_leaves_the_owner_alone() {
    let mut bm = BlockManager::new(8, 2, true);
    let prompt = [5, 6, 7, 8];
    let a = prefill(&mut bm, &prompt).unwrap();
    let mut b = bm.allocate_prompt(&prompt).unwrap();
    assert_eq!(b.blocks(), a.blocks());
    assert_eq!(bm.ref_count(a.blocks()[1]), 2);
    let copy = bm.reserve(&mut b, 1).unwrap().unwrap();
    assert_eq!(copy.src, a.blocks()[1]);
    assert_eq!(bm.ref_count(copy.src), 1);
    assert_eq!(bm.ref_count(copy.dst), 1);
    assert_invariants(&bm, &[&a, &b]);
}

#[test]
fn fork_then_append_copies_the_shared_partial_block_once_per_first_writer() {
    for caching in [false, true] {
        let mut bm = BlockManager::new(16, 4, caching);
        let mut parent = prefill(&mut bm, &[1, 2, 3, 4, 5, 6]).unwrap(); // a full and a partial block
        let mut child = bm.fork(&parent);
        assert_eq!(child, parent);
        let [full, partial] = [parent.blocks()[0], parent.blocks()[1]];
        assert_eq!((bm.ref_count(full), bm.ref_count(partial)), (2, 2));

        // The child writes first: it gets a copy of the partial block, with its 2 positions.
        let copy = bm.reserve(&mut child, 1).unwrap().expect("a copy");
        assert_eq!(copy.src, partial);
        assert_eq!(child.blocks(), &[full, copy.dst]);
        assert_eq!(bm.ref_count(partial), 1);
        bm.commit(&mut child, 7);

        // The parent now owns the partial block alone: it writes in place, no copy.
        assert_eq!(bm.reserve(&mut parent, 1).unwrap(), None);
        assert_eq!(parent.blocks(), &[full, partial]);
        bm.commit(&mut parent, 7);

        // Filling the block and starting a new one copies nothing either: new blocks are private.
        assert_eq!(bm.reserve(&mut parent, 3).unwrap(), None);
        assert_eq!(bm.reserve(&mut child, 3).unwrap(), None);
        assert_eq!(bm.ref_count(full), 2, "the full block stays shared");
        assert_invariants(&bm, &[&parent, &child]);
        bm.free(parent);
        bm.free(child);
        assert_eq!(bm.num_free_blocks(), 16);
        assert_invariants(&bm, &[]);
    }
}

#[test]
fn a_fork_of_reserved_unwritten_blocks_swaps_them_without_copying() {
    let mut bm = BlockManager::new(16, 2, false);
    let mut a = prefill(&mut bm, &[1, 2, 3]).unwrap();
    assert_eq!(bm.reserve(&mut a, 4).unwrap(), None); // positions 3..7 reserved, not written
    let mut b = bm.fork(&a);
    // Position 3 is in a shared block with one written position: copied. The next two blocks
    // were never written: swapped for private ones, no copy.
    let copy = bm.reserve(&mut b, 4).unwrap().unwrap();
    assert_eq!(copy.src, a.blocks()[1]);
    for i in 1..4 {
        assert_ne!(a.blocks()[i], b.blocks()[i]);
        assert_eq!(bm.ref_count(a.blocks()[i]), 1);
    }
    assert_invariants(&bm, &[&a, &b]);
}

#[test]
fn cached_blocks_are_evicted_least_recently_released_first() {
    let mut bm = BlockManager::new(4, 2, true);
    let [p, q, r] = [[1, 1], [2, 2], [3, 3]];
    for prompt in [p, q, r] {
        let table = prefill(&mut bm, &prompt).unwrap();
        bm.free(table);
    }
    assert_eq!(bm.num_evictable_blocks(), 3);
    assert_eq!(bm.num_free_blocks(), 4);

    // Q is used again: it is now the most recently released.
    let table = bm.allocate_prompt(&q).unwrap();
    assert_eq!(bm.stats().hit_blocks, 1);
    bm.free(table);

    // Three new blocks: the free one, then P's, then R's (Q was released last).
    let table = prefill(&mut bm, &[7, 7, 8, 8, 9, 9]).unwrap();
    assert_eq!(bm.stats().evictions, 2);
    let hits = |bm: &mut BlockManager, prompt: &[u32]| {
        let before = bm.stats().hit_blocks;
        let t = bm.allocate_prompt(prompt).unwrap();
        bm.free(t);
        bm.stats().hit_blocks - before
    };
    bm.free(table);
    assert_eq!(hits(&mut bm, &q), 1, "Q survived");
    assert_eq!(hits(&mut bm, &p), 0, "P was evicted");
    assert_invariants(&bm, &[]);
}

#[test]
fn a_freed_sequence_loses_its_tail_before_its_head() {
    let mut bm = BlockManager::new(3, 2, true);
    let prompt = [1, 2, 3, 4, 5, 6];
    let table = prefill(&mut bm, &prompt).unwrap();
    bm.free(table);
    // A new block: the last block of the prompt is evicted, the first two stay cached.
    let other = bm.allocate_prompt(&[9, 9]).unwrap();
    assert_eq!(bm.stats().evictions, 1);
    bm.free(other);
    let again = bm.allocate_prompt(&prompt).unwrap();
    assert_eq!(again.num_tokens(), 4, "the first two blocks still hit");
    assert_invariants(&bm, &[&again]);
}

#[test]
fn out_of_blocks_leaves_everything_unchanged() {
    let mut bm = BlockManager::new(4, 2, true);
    let cached = prefill(&mut bm, &[1, 2, 3, 4]).unwrap(); // 2 blocks
    bm.free(cached); // both evictable
    let holder = prefill(&mut bm, &[5, 5]).unwrap(); // 1 block; 3 free left (1 + 2 evictable)
    let state = |bm: &BlockManager| {
        let refs: Vec<u32> = (0..4).map(|b| bm.ref_count(b)).collect();
        let cached: Vec<bool> = (0..4).map(|b| bm.is_cached(b)).collect();
        (refs, cached, bm.num_free_blocks(), bm.stats())
    };
    let before = state(&bm);

    // Hits on both cached blocks, then 2 more: 4 would leave the free pool, 3 are there.
    assert_eq!(
        bm.allocate_prompt(&[1, 2, 3, 4, 0, 0, 0]),
        Err(BlockError::OutOfBlocks { needed: 4, free: 3 })
    );
    assert_eq!(state(&bm), before, "no hit kept, no eviction, no statistic");

    let mut table = holder.clone();
    assert_eq!(
        bm.reserve(&mut table, 7),
        Err(BlockError::OutOfBlocks { needed: 4, free: 3 })
    );
    assert_eq!(table, holder);
    assert_eq!(state(&bm), before);
    assert_invariants(&bm, &[&holder]);

    // What does fit still works, and the cached blocks are still found.
    let hit = bm.allocate_prompt(&[1, 2, 3, 4, 0]).unwrap();
    assert_eq!(hit.num_tokens(), 4);
    assert_invariants(&bm, &[&holder, &hit]);
}

#[test]
fn without_prefix_caching_nothing_is_looked_up_or_kept() {
    let mut bm = BlockManager::new(8, 2, false);
    let prompt = [1, 2, 3, 4];
    let a = prefill(&mut bm, &prompt).unwrap();
    let b = bm.allocate_prompt(&prompt).unwrap();
    assert_eq!(b.num_tokens(), 0);
    assert!(a.blocks().iter().all(|&x| !b.blocks().contains(&x)));
    assert!(!bm.is_cached(a.blocks()[0]));
    bm.free(a);
    bm.free(b);
    assert_eq!(bm.num_evictable_blocks(), 0);
    assert_eq!(bm.stats(), PrefixStats::default());
    assert_invariants(&bm, &[]);
}

#[test]
fn the_same_prefix_computed_twice_is_cached_once() {
    let mut bm = BlockManager::new(8, 2, true);
    let prompt = [1, 2, 3, 4, 5];
    // Both admitted before either registers (as in one batch): both compute everything.
    let mut a = bm.allocate_prompt(&prompt).unwrap();
    let mut b = bm.allocate_prompt(&prompt).unwrap();
    for t in [&mut a, &mut b] {
        bm.reserve(t, 5).unwrap();
        bm.commit(t, 5);
        bm.cache_full_blocks(t, &prompt);
    }
    assert!(a.blocks()[..2].iter().all(|&x| bm.is_cached(x)));
    assert!(b.blocks()[..2].iter().all(|&x| !bm.is_cached(x)));
    bm.free(b); // its duplicates go straight back to the free list
    assert_eq!(bm.num_evictable_blocks(), 0);
    // a's chain goes on: its next full block is registered after its cached ones.
    let mut tokens = prompt.to_vec();
    tokens.push(6);
    bm.reserve(&mut a, 1).unwrap();
    bm.commit(&mut a, 6);
    bm.cache_full_blocks(&a, &tokens);
    let c = bm.allocate_prompt(&[1, 2, 3, 4, 5, 6, 7]).unwrap();
    assert_eq!(c.num_tokens(), 6);
    assert_invariants(&bm, &[&a, &c]);
}

#[test]
fn check_invariants_reports_a_table_it_was_not_shown() {
    let mut bm = BlockManager::new(4, 2, true);
    let a = prefill(&mut bm, &[1, 2, 3]).unwrap();
    let err = bm.check_invariants(&[]).unwrap_err();
    assert!(err.contains("reference count 1"), "{err}");
    let b = a.clone();
    assert!(
        bm.check_invariants(&[&a, &b]).is_err(),
        "a table shown twice"
    );
    assert!(bm.check_invariants(&[&a]).is_ok());
}

#[test]
fn block_hash_is_fnv1a_64_over_the_parent_hash_and_token_bytes() {
    fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    }
    let mut bytes = ROOT_HASH.to_le_bytes().to_vec();
    for t in [1u32, 2, 300] {
        bytes.extend(t.to_le_bytes());
    }
    let first = block_hash(ROOT_HASH, &[1, 2, 300]);
    assert_eq!(first, fnv1a(&bytes));
    let mut bytes = first.to_le_bytes().to_vec();
    bytes.extend(7u32.to_le_bytes());
    assert_eq!(block_hash(first, &[7]), fnv1a(&bytes));
}

#[test]
fn rollback_keeps_the_block_of_the_last_kept_position_and_frees_the_rest() {
    let mut bm = BlockManager::new(8, 2, true);
    let mut table = prefill(&mut bm, &[1, 2, 3]).unwrap(); // 3 positions in 2 blocks
    bm.reserve(&mut table, 4).unwrap(); // lookahead: positions 3..7, 4 blocks in all
    assert_eq!(table.blocks().len(), 4);
    bm.commit(&mut table, 7);
    let kept = table.blocks()[..3].to_vec();
    bm.rollback(&mut table, 5); // positions 5 and 6 rejected
    assert_eq!(table.num_tokens(), 5);
    assert_eq!(
        table.blocks(),
        kept,
        "position 4 lives in block 2, which stays"
    );
    assert_eq!(bm.num_free_blocks(), 5);
    assert_invariants(&bm, &[&table]);
    bm.rollback(&mut table, 4); // on a block boundary: block 2 holds nothing kept
    assert_eq!(table.blocks(), &kept[..2]);
    assert_invariants(&bm, &[&table]);
    bm.free(table);
    assert_invariants(&bm, &[]);
}
