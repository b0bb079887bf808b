//! Chapter 2's [`KvStore`] seam over paged blocks, and generation on it.

use ch01::attention::AttentionShape;
use ch01::generate::{GenerateOptions, Generation, generate_with};
use ch01::{Llama, LlamaConfig, Tokenizer};
use ch02::cached::{Workspace, next_token_logits_cached};
use ch02::{KvError, KvStore};
use ndarray::{Array1, ArrayView2, ArrayViewMut2};

use crate::block_manager::{BlockError, BlockManager};
use crate::block_table::BlockTable;
use crate::pool::{KvPool, PoolError};

/// One sequence: its block table and the token ids of its positions (those written and, before
/// a step, those about to be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    pub table: BlockTable,
    pub tokens: Vec<u32>,
}

/// The KV memory of every sequence: the pool and the manager that hands out its blocks.
///
/// Invariant: the manager was made for this pool (same number of blocks, same block size), so
/// every block id it hands out names a block of the pool.
pub struct PagedKv {
    pool: KvPool,
    manager: BlockManager,
}

impl PagedKv {
    pub fn new(pool: KvPool, enable_prefix_caching: bool) -> Self {
        let manager =
            BlockManager::new(pool.num_blocks(), pool.block_size(), enable_prefix_caching);
        PagedKv { pool, manager }
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn manager(&self) -> &BlockManager {
        &self.manager
    }

    /// A pool of `budget` bytes in blocks of `block_size` positions.
    pub fn with_budget(
        config: &LlamaConfig,
        block_size: usize,
        budget: u64,
        enable_prefix_caching: bool,
    ) -> Result<Self, PoolError> {
        Ok(Self::new(
            KvPool::with_budget(config, block_size, budget)?,
            enable_prefix_caching,
        ))
    }

    /// Starts a sequence for `prompt`: blocks for every prompt position, the cached ones reused
    /// (`table.num_tokens()` positions need no compute).
    pub fn start(&mut self, prompt: &[u32]) -> Result<Sequence, BlockError> {
        Ok(Sequence {
            table: self.manager.allocate_prompt(prompt)?,
            tokens: prompt.to_vec(),
        })
    }

    /// A sequence sharing every block of `seq` (n > 1 sampling); writes copy on demand.
    pub fn fork(&mut self, seq: &Sequence) -> Sequence {
        Sequence {
            table: self.manager.fork(&seq.table),
            tokens: seq.tokens.clone(),
        }
    }

    /// Returns the sequence's blocks (cached full blocks stay reusable until evicted).
    pub fn free(&mut self, seq: Sequence) {
        self.manager.free(seq.table);
    }

    /// The store chapter 2's forward pass writes `seq`'s new K/V into.
    pub fn store<'a>(&'a mut self, seq: &'a mut Sequence) -> PagedSequence<'a> {
        PagedSequence {
            pool: &mut self.pool,
            manager: &mut self.manager,
            table: &mut seq.table,
        }
    }

    /// Runs `seq.tokens[seq.table.num_tokens()..]` (the prompt's uncached part, or the tokens
    /// appended since the last step) and returns the next-token logits; registers the full
    /// blocks in the prefix cache.
    pub fn step<'w>(
        &mut self,
        model: &Llama,
        seq: &mut Sequence,
        workspace: &'w mut Workspace,
    ) -> ch02::Result<ndarray::ArrayView1<'w, f32>> {
        let start = seq.table.num_tokens();
        let tokens = std::mem::take(&mut seq.tokens);
        let logits =
            next_token_logits_cached(model, &tokens[start..], &mut self.store(seq), workspace);
        seq.tokens = tokens;
        let logits = logits?;
        self.manager.cache_full_blocks(&seq.table, &seq.tokens);
        Ok(logits)
    }
}

/// One sequence's view of the pool, as chapter 2's [`KvStore`].
///
/// The first layer's [`KvStore::write`] of a step reserves the step's slots in the block table
/// (allocating blocks, copying a shared last block first); every layer then writes through the
/// slot mapping. Nothing is written if the reservation fails ([`KvError::OutOfBlocks`]).
pub struct PagedSequence<'a> {
    pool: &'a mut KvPool,
    manager: &'a mut BlockManager,
    table: &'a mut BlockTable,
}

impl KvStore for PagedSequence<'_> {
    fn len(&self) -> usize {
        self.table.num_tokens()
    }

    fn capacity(&self) -> Option<usize> {
        None // as many positions as the pool has free blocks
    }

    // ANCHOR: paged_write
    fn write(
        &mut self,
        layer: usize,
        start_pos: usize,
        k: ArrayView2<f32>,
        v: ArrayView2<f32>,
    ) -> Result<(), KvError> {
        if start_pos != self.table.num_tokens() {
            return Err(KvError::NotAppending {
                start_pos,
                len: self.table.num_tokens(),
            });
        }
        if layer == 0 {
            let copy = self.manager.reserve(self.table, k.nrows()).map_err(
                |BlockError::OutOfBlocks { needed, free }| KvError::OutOfBlocks { needed, free },
            )?;
            if let Some(copy) = copy {
                self.pool.copy_block(copy); // copy-on-write of a shared last block
            }
        }
        for (t, (k_t, v_t)) in k.rows().into_iter().zip(v.rows()).enumerate() {
            let slot = self.table.slot(start_pos + t); // the slot mapping
            self.pool.write(layer, slot, k_t, v_t);
        }
        Ok(())
    }
    // ANCHOR_END: paged_write

    fn attend(
        &mut self,
        layer: usize,
        q: ArrayView2<f32>,
        context_len: usize,
        shape: AttentionShape,
        mut out: ArrayViewMut2<f32>,
    ) {
        let q = q.as_standard_layout();
        self.pool.attend(
            layer,
            self.table,
            q.as_slice().expect("standard layout"),
            context_len,
            shape,
            out.as_slice_mut()
                .expect("attention output must be contiguous"),
        );
    }

    fn commit(&mut self, new_len: usize) {
        self.manager.commit(self.table, new_len);
    }
}

/// Chapter 1's generation loop on paged storage: the prompt's cached prefix is skipped, then
/// one token per step. The sequence's blocks are returned at the end (full ones stay cached).
pub fn generate_paged(
    model: &Llama,
    tokenizer: &Tokenizer,
    prompt_tokens: &[u32],
    kv: &mut PagedKv,
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> ch02::Result<Generation> {
    model.check_tokens(prompt_tokens)?;
    let mut seq = kv
        .start(prompt_tokens)
        .map_err(|BlockError::OutOfBlocks { needed, free }| {
            ch02::Error::Kv(KvError::OutOfBlocks { needed, free })
        })?;
    let mut workspace = Workspace::new(&model.config, prompt_tokens.len());
    let result = {
        let mut next_token_logits = |tokens: &[u32]| -> ch02::Result<Array1<f32>> {
            // `tokens` is the sequence so far: the prompt, then one more token per call.
            debug_assert!(tokens.starts_with(&seq.tokens));
            seq.tokens.extend_from_slice(&tokens[seq.tokens.len()..]);
            Ok(kv.step(model, &mut seq, &mut workspace)?.to_owned())
        };
        generate_with::<ch02::Error>(
            tokenizer,
            prompt_tokens,
            model.config.max_position_embeddings,
            options,
            &mut next_token_logits,
            on_text,
        )
    };
    kv.free(seq);
    result
}
