//! [`ModelDrafter`]: drafts from a model: a smaller one with the same tokenizer
//! (`shakespeare-tiny` for `shakespeare-small`), or the target's own first layers
//! ([`layer_skip_executor`]: self-speculation).
//!
//! The draft model runs on chapter 4's [`Executor`] seam with its own paged KV cache: its own
//! executor (a [`CpuExecutor`] over its own pool) and its own chapter 3 [`BlockManager`], one
//! [`BlockTable`] per request. One proposal for every decoding sequence at once:
//!
//! ```text
//! sync:    known = the tokens whose K/V the draft cache holds; keep their longest common
//!          prefix with the sequence (at most all but its last token); roll back the rest
//!          (rejected drafts of the last step, nothing after a full acceptance)
//! step 1:  one batched forward over every sequence's tokens past `keep` (the last token, or
//!          the accepted ones too, or the whole prompt the first time)   → d1
//! step j:  one batched forward over every sequence's d(j-1)               → dj,  j ≤ k
//! ```
//! So k draft forwards per engine step, each as wide as the batch. Greedy requests draft the
//! argmax (q one-hot, no `probs`); sampled ones draw from the draft model's distribution
//! with the request's temperature and filters (no penalties), from a stream seeded by the
//! request's seed, and hand over that distribution as `probs`.
//!
//! Catching up (a new request's prompt, or a state dropped and recomputed) is bounded: the
//! tokens of step 1 of one proposal are at most the catch-up budget
//! ([`ModelDrafter::with_catch_up_budget`]). A sequence whose tokens past `keep` do not fit in
//! what is left of it runs a chunk of them (never its last token) and gets no drafts this step.
//!
//! Invariants: a cache's `known.len() == table.num_tokens()`, and `known` is never longer than
//! all but the sequence's last token after a sync; every block of every cache is the draft
//! manager's, held by that cache alone, and [`ModelDrafter::release`] frees them. A request's
//! drafting sampler lives apart from its cache, from its first proposal to its release: a
//! cache that is dropped and recomputed continues the same random stream, so each draft is a
//! fresh draw from q given the history (a restarted stream would reuse uniforms that already
//! shaped the output, and the output would no longer be distributed as the target's). When
//! blocks run out, the caches of requests not proposing now are dropped, least recently used
//! first (ties: lowest id), and only if that makes room; a sequence that still does not fit,
//! or that has reached the draft model's context, gets no drafts and lets go of its cache.

use std::collections::HashMap;

use ch01::{Llama, LlamaConfig, Sampler, SamplingParams};
use ch03::{BlockManager, BlockTable, KvDtype, KvPool};
use ch04::{
    CpuExecutor, Draft, DraftSeq, Executor, ExecutorError, RequestId, ScheduledSeq, SchedulerOutput,
};

use crate::drafter::{DraftError, Drafter};

/// Tokens step 1 of one proposal runs at most, unless set with
/// [`ModelDrafter::with_catch_up_budget`] (`--speculative-catch-up-budget` on kiln's command
/// line, which also keeps it within the engine's `max_num_batched_tokens`).
pub const DEFAULT_CATCH_UP_BUDGET: usize = 512;

/// What the draft cache holds for one request. Dropped when blocks run out (the request's
/// sampler is kept elsewhere).
struct DraftCache {
    table: BlockTable,
    /// Tokens whose K/V are in `table`, positions `0..known.len()`.
    known: Vec<u32>,
    /// The proposal that last used this cache (eviction order: least recent first).
    last_used: u64,
}

/// A draft model with its own executor and paged KV cache.
pub struct ModelDrafter<'m> {
    executor: Box<dyn Executor + Send + 'm>,
    manager: BlockManager,
    vocab: usize,
    max_len: usize,
    caches: HashMap<RequestId, DraftCache>,
    /// Each sampled request's drafting sampler (no penalties), from its first proposal to its
    /// release: never dropped with its cache, so its stream never restarts.
    samplers: HashMap<RequestId, Sampler>,
    /// Most tokens step 1 of one proposal runs.
    catch_up_budget: usize,
    /// Proposals so far (the clock of `DraftCache::last_used`).
    proposals: u64,
    /// The draft step being run (reused).
    plan: SchedulerOutput,
    /// Per entry of `plan.seqs`: the index of its sequence in the proposal, and its k (0 for a
    /// catch-up chunk, which wants no logits).
    active: Vec<(usize, usize)>,
}

/// The configuration of `config`'s model cut to its first `num_layers` layers (the final norm
/// and head kept): the target as its own draft model. Errors: `num_layers` is 0 or not fewer
/// than the model's.
pub fn layer_skip_config(
    config: &LlamaConfig,
    num_layers: usize,
) -> Result<LlamaConfig, DraftError> {
    let total = config.num_hidden_layers;
    if total < 2 {
        return Err(DraftError::Config(format!(
            "layer skipping needs a model of at least 2 layers to keep fewer of; this one has {total}"
        )));
    }
    if num_layers == 0 || num_layers >= total {
        return Err(DraftError::Config(format!(
            "layer skipping keeps 1 to {} of the model's {total} layers, not {num_layers}",
            total.saturating_sub(1)
        )));
    }
    let mut config = config.clone();
    config.num_hidden_layers = num_layers;
    Ok(config)
}

/// A chapter 4 CPU executor over `model`'s first `num_layers` layers, the final norm and the
/// head ([`layer_skip_config`]), with a pool of `memory` bytes.
pub fn layer_skip_executor<'m>(
    model: &'m Llama,
    num_layers: usize,
    block_size: usize,
    memory: u64,
) -> Result<Box<dyn Executor + Send + 'm>, DraftError> {
    let config = layer_skip_config(&model.config, num_layers)?;
    let pool = KvPool::<f32>::with_budget(&config, block_size, memory)
        .map_err(|e| DraftError::Config(e.to_string()))?;
    Ok(Box::new(CpuExecutor::new(model, pool)))
}

/// A chapter 4 CPU executor over all of `model` with an f32 pool of `memory` bytes.
pub fn draft_executor<'m>(
    model: &'m Llama,
    block_size: usize,
    memory: u64,
) -> Result<Box<dyn Executor + Send + 'm>, DraftError> {
    let cache = ch04::CacheConfig {
        memory,
        block_size,
        dtype: KvDtype::F32,
    };
    ch04::cpu_executor(model, &cache).map_err(|e| DraftError::Config(e.to_string()))
}

impl<'m> ModelDrafter<'m> {
    /// A drafter running `executor`, for a target of `target_vocab` tokens (the draft model
    /// must share the target's tokenizer, so at least its vocabulary size).
    pub fn new(
        executor: Box<dyn Executor + Send + 'm>,
        target_vocab: usize,
    ) -> Result<Self, DraftError> {
        let (kv, spec) = (executor.kv_layout(), executor.model_spec());
        if spec.vocab_size != target_vocab {
            return Err(DraftError::Config(format!(
                "the draft model has {} tokens, the target {target_vocab}: they must share a \
                 tokenizer",
                spec.vocab_size
            )));
        }
        Ok(ModelDrafter {
            manager: BlockManager::new(kv.num_blocks, kv.block_size, false),
            executor,
            vocab: spec.vocab_size,
            max_len: spec.max_model_len,
            caches: HashMap::new(),
            samplers: HashMap::new(),
            catch_up_budget: DEFAULT_CATCH_UP_BUDGET,
            proposals: 0,
            plan: SchedulerOutput::default(),
            active: Vec::new(),
        })
    }

    /// The same drafter, whose step 1 runs at most `tokens` tokens a proposal (at least 1):
    /// a sequence that has more to catch up runs it in chunks over several steps, without
    /// drafts until it has caught up.
    pub fn with_catch_up_budget(mut self, tokens: usize) -> Self {
        self.catch_up_budget = tokens.max(1);
        self
    }

    /// Share of the draft cache's blocks in use (0 once every request was released).
    pub fn kv_usage(&self) -> f64 {
        1.0 - self.manager.num_free_blocks() as f64 / self.manager.num_blocks() as f64
    }

    /// The draft manager's invariants against its live tables.
    pub fn check_invariants(&self) -> Result<(), String> {
        let tables: Vec<&BlockTable> = self.caches.values().map(|c| &c.table).collect();
        self.manager.check_invariants(&tables)
    }

    /// Drops `id`'s cache and frees its blocks; its sampler stays.
    fn evict(&mut self, id: RequestId) {
        if let Some(cache) = self.caches.remove(&id) {
            self.manager.free(cache.table);
        }
    }

    /// Reserves `n` more positions for `id`, dropping the caches of requests not in `keep`,
    /// least recently used first, when blocks run out. False, and nothing dropped, if even
    /// all of those would not make room.
    fn reserve(&mut self, id: RequestId, n: usize, keep: &[DraftSeq]) -> bool {
        let evictable = |v: &RequestId| !keep.iter().any(|s| s.id == *v);
        let table = &self.caches[&id].table;
        let needed = (table.num_tokens() + n)
            .div_ceil(self.manager.block_size())
            .saturating_sub(table.blocks().len());
        // No prefix caching and no forks: every block of a dropped cache comes back.
        let reclaimable: usize = self
            .caches
            .iter()
            .filter(|(v, _)| evictable(v))
            .map(|(_, c)| c.table.blocks().len())
            .sum();
        if needed > self.manager.num_free_blocks() + reclaimable {
            return false;
        }
        loop {
            let cache = self.caches.get_mut(&id).expect("made by the caller");
            if self.manager.reserve(&mut cache.table, n).is_ok() {
                return true;
            }
            let victim = self
                .caches
                .iter()
                .filter(|(v, _)| evictable(v))
                .min_by_key(|(v, c)| (c.last_used, **v))
                .map(|(v, _)| *v);
            match victim {
                Some(v) => self.evict(v),
                None => return false,
            }
        }
    }
}

/// Longest common prefix of two token lists.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The argmax of `row`, lowest id on ties.
fn argmax(row: &[f32]) -> u32 {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0 as u32
}

/// The next draft from logits `row`: the argmax for greedy requests; otherwise a draw from
/// the drafting sampler's distribution, written into `draft.probs` as q.
fn choose(
    row: &[f32],
    sampler: Option<&mut Sampler>,
    vocab: usize,
    draft: &mut Draft,
) -> Result<u32, DraftError> {
    let Some(sampler) = sampler else {
        return Ok(argmax(row));
    };
    let q = sampler
        .distribution(row, &[], &[])
        .map_err(|e| DraftError::Config(e.to_string()))?;
    let start = draft.probs.len();
    draft.probs.resize(start + vocab, 0.0);
    let q_row = &mut draft.probs[start..];
    for c in q {
        q_row[c.token as usize] = c.prob;
    }
    // Inverse CDF over q in token order: a draw from q like any other.
    let u = sampler.uniform();
    let mut cumulative = 0.0f64;
    let mut last = 0;
    for (t, &p) in draft.probs[start..].iter().enumerate() {
        if p > 0.0 {
            cumulative += f64::from(p);
            last = t;
            if u < cumulative {
                return Ok(t as u32);
            }
        }
    }
    Ok(last as u32)
}

/// The drafting sampler of a request: its temperature and filters, no penalties, its own
/// stream.
fn drafting_sampler(params: &SamplingParams) -> Result<Option<Sampler>, DraftError> {
    if params.is_greedy() {
        return Ok(None);
    }
    let params = SamplingParams {
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        seed: params.seed ^ 0xD4AF_7000_0000_0006,
        ..params.clone()
    };
    Sampler::new(params)
        .map(Some)
        .map_err(|e| DraftError::Config(e.to_string()))
}

impl Drafter for ModelDrafter<'_> {
    // ANCHOR: propose
    fn propose(&mut self, seqs: &[DraftSeq], drafts: &mut [Draft]) -> Result<(), DraftError> {
        let block_size = self.manager.block_size();
        self.proposals += 1;
        self.plan.seqs.clear();
        self.active.clear();
        let mut budget = self.catch_up_budget;
        // Sync each sequence's draft cache with its tokens; plan the first draft step.
        for (i, seq) in seqs.iter().enumerate() {
            if !self.samplers.contains_key(&seq.id)
                && let Some(sampler) = drafting_sampler(seq.params)?
            {
                self.samplers.insert(seq.id, sampler);
            }
            // Positions T-1 .. T+k-2 run: all within the draft model's context.
            let len = seq.tokens.len();
            let k = seq.max_drafts.min(self.max_len.saturating_sub(len));
            if k == 0 {
                self.evict(seq.id); // past the draft model's context: it never drafts again
                continue;
            }
            let cache = self.caches.entry(seq.id).or_insert_with(|| DraftCache {
                table: BlockTable::new(block_size),
                known: Vec::new(),
                last_used: 0,
            });
            cache.last_used = self.proposals;
            let keep = common_prefix(&cache.known, seq.tokens).min(len - 1);
            cache.known.truncate(keep);
            self.manager.rollback(&mut cache.table, keep);
            // All of its new tokens and k drafts if they fit in the budget; else a chunk
            // short of its last token, and no drafts.
            let (run, k) = if len - keep <= budget {
                (len - keep, k)
            } else {
                ((len - 1 - keep).min(budget), 0)
            };
            if run == 0 {
                continue; // the budget is spent: its cache waits for the next step
            }
            if !self.reserve(seq.id, run + k.saturating_sub(1), seqs) {
                self.evict(seq.id); // no drafts, and no blocks held for nothing
                continue;
            }
            budget -= run;
            self.plan.seqs.push(ScheduledSeq {
                id: seq.id,
                tokens: seq.tokens[keep..keep + run].to_vec(),
                start_pos: keep,
                block_table: self.caches[&seq.id].table.blocks().to_vec(),
                logit_rows: usize::from(k > 0),
            });
            self.active.push((i, k));
        }
        // k batched draft forwards.
        while !self.plan.seqs.is_empty() {
            let logits = self.executor.execute(&self.plan)?;
            let mut r = 0;
            for (scheduled, &(i, k)) in self.plan.seqs.iter().zip(&self.active) {
                let cache = self.caches.get_mut(&scheduled.id).expect("planned");
                cache.known.extend_from_slice(&scheduled.tokens);
                self.manager.commit(&mut cache.table, cache.known.len());
                if k == 0 {
                    continue; // a catch-up chunk: no logits
                }
                let row = logits.row(r);
                r += 1;
                let row = row
                    .to_slice()
                    .ok_or_else(|| ExecutorError("non-contiguous logits".into()))?;
                let sampler = self.samplers.get_mut(&scheduled.id);
                let token = choose(row, sampler, self.vocab, &mut drafts[i])?;
                drafts[i].tokens.push(token);
            }
            // The next step: every sequence that wants more drafts runs its last one.
            let mut kept = 0;
            for j in 0..self.plan.seqs.len() {
                let (i, k) = self.active[j];
                if drafts[i].tokens.len() < k {
                    let id = self.plan.seqs[j].id;
                    let last = *drafts[i].tokens.last().expect("drafted above");
                    let next = &mut self.plan.seqs[j];
                    next.tokens.clear();
                    next.tokens.push(last);
                    next.start_pos = self.caches[&id].known.len();
                    self.plan.seqs.swap(kept, j);
                    self.active.swap(kept, j);
                    kept += 1;
                }
            }
            self.plan.seqs.truncate(kept);
            self.active.truncate(kept);
        }
        // The lookahead reserved but not written goes back.
        for seq in seqs {
            if let Some(cache) = self.caches.get_mut(&seq.id) {
                self.manager.rollback(&mut cache.table, cache.known.len());
            }
        }
        Ok(())
    }
    // ANCHOR_END: propose

    fn release(&mut self, id: RequestId) {
        self.evict(id);
        self.samplers.remove(&id);
    }
}
