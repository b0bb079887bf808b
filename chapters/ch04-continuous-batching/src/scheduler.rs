//! [`Scheduler`]: which sequences run in the next step and how many of their tokens; what the
//! step produced. It owns the sequences and chapter 3's [`BlockManager`], and never touches K/V
//! data: what must happen to it (copies, swaps) goes to the executor as [`BlockOp`]s.
//!
//! ```text
//! schedule():  running sequences first (decode 1 token, or the next prompt chunk),
//!              preempting the lowest-priority, latest-arrived one when blocks run out;
//!              then swapped-out ones, then waiting ones, while the token budget,
//!              max_num_seqs and the free-block watermark allow      → SchedulerOutput
//! update():    per sequence, its own seeded sampler on its logit row; stop checks;
//!              finished → blocks freed                                → RequestOutputs
//! ```

use std::collections::BTreeMap;

use ch01::Sampler;
use ch03::{BlockCopy, BlockError, BlockId, BlockManager, PrefixStats};
use ndarray::{ArrayView2, s};

use crate::engine::{Counters, EngineConfig, EngineError, Preemption, RequestOutput, StepTrace};
use crate::executor::{ExecutorError, KvLayout, ModelSpec};
use crate::logprobs::TokenLogprobs;
use crate::request::{FinishReason, Request, RequestId, Sequence, Status};

// ANCHOR: scheduler_output
/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub id: RequestId,
    /// The tokens to run: a prompt chunk, the token sampled last step, or (chapter 6) that
    /// token followed by draft tokens to verify.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`; positions `0..start_pos` already hold K/V.
    pub start_pos: usize,
    /// The sequence's blocks, covering at least `start_pos + tokens.len()` positions.
    pub block_table: Vec<BlockId>,
    /// Logit rows wanted: those of the last `logit_rows` tokens. 0 for a prompt chunk that
    /// does not end the prompt, 1 to sample the next token, k + 1 to verify k drafts.
    pub logit_rows: usize,
}

/// Something the executor does to K/V data before the step's forward, in list order (a block
/// freed by one operation may be the target of a later one in the same step).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockOp {
    /// Copy-on-write: the last block of a sequence was shared, and it is about to write there.
    Copy(BlockCopy),
    /// Preempted by swapping: keep these blocks' K/V (positions `0..num_computed` of the
    /// request) outside the pool until it is swapped back in.
    SwapOut { id: RequestId, blocks: Vec<BlockId> },
    /// Readmitted: put what `SwapOut` kept back, block `i` into `blocks[i]`; `None` where the
    /// prefix cache supplied a block that already holds those positions.
    SwapIn {
        id: RequestId,
        blocks: Vec<Option<BlockId>>,
    },
}

/// What one step runs: plain data, so that any executor (CPU, GPU, tensor-parallel ranks) can
/// run it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// The batch, flattened in this order.
    pub seqs: Vec<ScheduledSeq>,
    pub block_ops: Vec<BlockOp>,
    /// Requests that ended while swapped out: the executor drops what it kept for them.
    pub finished: Vec<RequestId>,
}
// ANCHOR_END: scheduler_output

impl SchedulerOutput {
    /// Nothing to run, move or drop.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty() && self.block_ops.is_empty() && self.finished.is_empty()
    }

    /// Logit rows the executor returns: the sum of every sequence's `logit_rows`.
    pub fn num_logit_rows(&self) -> usize {
        self.seqs.iter().map(|s| s.logit_rows).sum()
    }
}

/// The scheduler over one executor's KV memory.
///
/// Invariants: the block manager was sized from the executor's [`KvLayout`]; a running
/// sequence holds a table, a waiting, swapped or finished one none.
pub struct Scheduler {
    config: EngineConfig,
    model: ModelSpec,
    manager: BlockManager,
    seqs: BTreeMap<RequestId, Sequence>,
    next_id: RequestId,
    counters: Counters,
    trace: StepTrace,
    /// The step being planned: block operations so far, and swapped requests that ended.
    block_ops: Vec<BlockOp>,
    finished_swapped: Vec<RequestId>,
}

impl Scheduler {
    /// A scheduler for an executor with this KV memory and model.
    pub fn new(config: EngineConfig, kv: KvLayout, model: ModelSpec) -> Result<Self, EngineError> {
        if config.max_num_seqs == 0 || config.max_num_batched_tokens == 0 {
            return Err(EngineError::Config(
                "max_num_seqs and max_num_batched_tokens must be at least 1".into(),
            ));
        }
        if !(0.0..1.0).contains(&config.watermark) {
            return Err(EngineError::Config("watermark must be in [0, 1)".into()));
        }
        if kv.num_blocks == 0 || kv.block_size == 0 {
            return Err(EngineError::Config(format!(
                "the executor's KV memory holds no block ({} blocks of {} positions)",
                kv.num_blocks, kv.block_size
            )));
        }
        Ok(Scheduler {
            manager: BlockManager::new(kv.num_blocks, kv.block_size, config.enable_prefix_caching),
            config,
            model,
            seqs: BTreeMap::new(),
            next_id: 0,
            counters: Counters::default(),
            trace: StepTrace::default(),
            block_ops: Vec::new(),
            finished_swapped: Vec::new(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    // ANCHOR: admission
    /// Checks `request` and queues it; it runs from the next step on.
    pub fn add_request(&mut self, request: Request) -> Result<RequestId, EngineError> {
        self.model.check_tokens(&request.prompt)?;
        request.params.validate()?;
        let max_len = self.model.max_model_len;
        let needed = (request.prompt.len() + request.max_tokens).min(max_len);
        // A request alone must fit above the watermark, or it could never be admitted.
        let capacity = self.max_request_tokens();
        if needed > capacity {
            return Err(EngineError::TooLong { needed, capacity });
        }
        // Unchunked, a prompt runs in one step, and so does a prompt plus its output so far
        // when preemption by recomputation readmits it.
        if let Some(tokens) = self
            .config
            .unchunked_step_tokens(request.prompt.len(), request.max_tokens)
        {
            let (needed, budget) = (tokens.min(max_len), self.config.max_num_batched_tokens);
            if needed > budget {
                return Err(EngineError::OverBudget { needed, budget });
            }
        }
        // ANCHOR_END: admission
        let id = self.next_id;
        self.next_id += 1;
        self.counters.prompt_tokens += request.prompt.len() as u64;
        self.seqs.insert(
            id,
            Sequence {
                id,
                sampler: Sampler::new(request.params.clone())?,
                tokens: request.prompt.clone(),
                request,
                status: Status::Waiting,
                num_computed: 0,
                table: None,
                streamed: 0,
            },
        );
        Ok(id)
    }

    /// Ends a request now and frees its blocks. False if it is unknown or already finished.
    pub fn abort(&mut self, id: RequestId) -> bool {
        match self.seqs.get(&id).map(|s| s.status) {
            Some(Status::Finished(_)) | None => false,
            Some(_) => {
                self.finish(id, FinishReason::Abort);
                true
            }
        }
    }

    pub fn status(&self, id: RequestId) -> Option<Status> {
        self.seqs.get(&id).map(|s| s.status)
    }

    pub fn has_unfinished(&self) -> bool {
        self.seqs
            .values()
            .any(|s| !matches!(s.status, Status::Finished(_)))
    }

    fn num_unfinished(&self) -> usize {
        self.seqs
            .values()
            .filter(|s| !matches!(s.status, Status::Finished(_)))
            .count()
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// What the last step scheduled, preempted and admitted.
    pub fn last_step(&self) -> &StepTrace {
        &self.trace
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        self.manager.stats()
    }

    /// (waiting, running, swapped) requests.
    pub fn queue_lengths(&self) -> (usize, usize, usize) {
        let count = |st: Status| self.seqs.values().filter(|s| s.status == st).count();
        (
            count(Status::Waiting),
            count(Status::Running),
            count(Status::Swapped),
        )
    }

    /// Share of KV blocks in use.
    pub fn kv_usage(&self) -> f64 {
        let m = &self.manager;
        1.0 - m.num_free_blocks() as f64 / m.num_blocks() as f64
    }

    /// The block manager's invariants against the live block tables.
    pub fn check_invariants(&self) -> Result<(), String> {
        let tables: Vec<_> = self
            .seqs
            .values()
            .filter_map(|s| s.table.as_ref())
            .collect();
        self.manager.check_invariants(&tables)
    }

    /// The most KV positions one request may use (prompt + max_tokens): the pool above the
    /// free-block watermark. A server refuses to start if this is below its max_model_len.
    pub fn max_request_tokens(&self) -> usize {
        let blocks = self.manager.num_blocks() - self.watermark_blocks();
        blocks * self.manager.block_size()
    }

    /// Blocks that admission keeps free.
    fn watermark_blocks(&self) -> usize {
        (self.config.watermark * self.manager.num_blocks() as f64).ceil() as usize
    }

    /// Removes a finished request; its output tokens and why it ended.
    pub(crate) fn take(&mut self, id: RequestId) -> Option<(Vec<u32>, FinishReason)> {
        match self.seqs.get(&id)?.status {
            Status::Finished(reason) => {
                let seq = self.seqs.remove(&id)?;
                Some((seq.output().to_vec(), reason))
            }
            _ => None,
        }
    }

    /// The unfinished requests, if none of them could be scheduled (a bug).
    pub(crate) fn stalled(&self) -> Option<usize> {
        self.has_unfinished().then(|| self.num_unfinished())
    }

    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let seq = self.seqs.get_mut(&id).expect("known request");
        if seq.status == Status::Swapped {
            self.finished_swapped.push(id);
        }
        seq.finish(&mut self.manager, reason);
    }

    /// Sequences in scheduling order: priority, then arrival.
    fn in_order(&self, status: Status) -> Vec<RequestId> {
        let mut ids: Vec<_> = self
            .seqs
            .values()
            .filter(|s| s.status == status)
            .map(|s| (s.request.priority, s.id))
            .collect();
        ids.sort_unstable();
        ids.into_iter().map(|(_, id)| id).collect()
    }

    /// Plans the next step: which sequences run, how many tokens each, and what the executor
    /// must do to K/V data first.
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.trace = StepTrace::default();
        let picked = self.pick();
        let mut seqs = Vec::with_capacity(picked.len());
        for (id, n) in picked {
            let s = &self.seqs[&id];
            let (start, end) = (s.num_computed, s.num_computed + n);
            self.trace
                .scheduled
                .push((id, n, start < s.request.prompt.len()));
            seqs.push(ScheduledSeq {
                id,
                tokens: s.tokens[start..end].to_vec(),
                start_pos: start,
                block_table: s.table.as_ref().expect("running").blocks().to_vec(),
                logit_rows: usize::from(end == s.tokens.len()),
            });
        }
        if !seqs.is_empty() {
            self.counters.steps += 1;
        }
        SchedulerOutput {
            seqs,
            block_ops: std::mem::take(&mut self.block_ops),
            finished: std::mem::take(&mut self.finished_swapped),
        }
    }

    // ANCHOR: schedule
    /// Chooses this step's (sequence, number of tokens) and reserves their blocks.
    fn pick(&mut self) -> Vec<(RequestId, usize)> {
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled: Vec<(RequestId, usize)> = Vec::new();

        // 1. Running sequences, highest priority and earliest first.
        for id in self.in_order(Status::Running) {
            if self.seqs[&id].status != Status::Running {
                continue; // preempted by an earlier one this step
            }
            let Some(n) = self.chunk(id, budget) else {
                continue;
            };
            if self.reserve_or_preempt(id, n, &scheduled) {
                scheduled.push((id, n));
                budget -= n;
            }
        }

        // 2. Swapped-out, then 3. waiting sequences, while there is room.
        let candidates: Vec<_> = self
            .in_order(Status::Swapped)
            .into_iter()
            .chain(self.in_order(Status::Waiting))
            .collect();
        let watermark = self.watermark_blocks();
        for id in candidates {
            let running = self
                .seqs
                .values()
                .filter(|s| s.status == Status::Running)
                .count();
            if budget == 0 || running >= self.config.max_num_seqs {
                break;
            }
            if !self.admit(id, watermark) {
                break; // FCFS: do not let later requests overtake this one
            }
            let Some(n) = self.chunk(id, budget) else {
                break;
            };
            if self.reserve(id, n).is_ok() {
                scheduled.push((id, n));
                budget -= n;
            } else {
                self.preempt(id);
                break;
            }
        }
        scheduled
    }
    // ANCHOR_END: schedule

    /// Tokens of `id` to run within `budget`: its pending tokens, or with chunked prefill as
    /// many as fit. `None` if it cannot run this step.
    fn chunk(&self, id: RequestId, budget: usize) -> Option<usize> {
        let pending = self.seqs[&id].pending();
        let n = if self.config.enable_chunked_prefill {
            pending.min(budget)
        } else {
            pending
        };
        (n >= 1 && n <= budget).then_some(n)
    }

    /// Reserves `n` more positions in running sequence `id`'s table; a shared last block is
    /// copied first (a [`BlockOp::Copy`] for the executor).
    fn reserve(&mut self, id: RequestId, n: usize) -> Result<(), BlockError> {
        let seq = self.seqs.get_mut(&id).expect("known");
        let table = seq.table.as_mut().expect("running");
        if let Some(copy) = self.manager.reserve(table, n)? {
            self.block_ops.push(BlockOp::Copy(copy));
        }
        Ok(())
    }

    /// Reserves `n` positions for running sequence `id`, preempting other running sequences
    /// (lowest priority, latest arrival first; never one already scheduled) until it fits, or
    /// `id` itself when it is the only candidate left. True if `id` got its blocks.
    fn reserve_or_preempt(
        &mut self,
        id: RequestId,
        n: usize,
        scheduled: &[(RequestId, usize)],
    ) -> bool {
        while self.reserve(id, n).is_err() {
            let victim = self
                .seqs
                .values()
                .filter(|s| {
                    s.status == Status::Running && !scheduled.iter().any(|&(v, _)| v == s.id)
                })
                .max_by_key(|s| s.victim_key())
                .map(|s| s.id)
                .expect("id itself is a candidate");
            self.preempt(victim);
            if victim == id {
                return false;
            }
        }
        true
    }

    /// Frees `id`'s blocks: recomputed later, or its K/V kept outside the pool (swap).
    fn preempt(&mut self, id: RequestId) {
        self.counters.preemptions += 1;
        self.trace.preempted.push(id);
        let seq = self.seqs.get_mut(&id).expect("known");
        let table = seq.table.take().expect("preempted sequences hold blocks");
        match self.config.preemption {
            Preemption::Recompute => {
                seq.num_computed = 0;
                seq.status = Status::Waiting;
            }
            Preemption::Swap => {
                let written = seq.num_computed.div_ceil(table.block_size());
                self.block_ops.push(BlockOp::SwapOut {
                    id,
                    blocks: table.blocks()[..written].to_vec(),
                });
                seq.status = Status::Swapped;
            }
        }
        self.manager.free(table);
    }

    /// Gives waiting or swapped `id` blocks for what it has computed (or may reuse from the
    /// prefix cache), if the free blocks stay above `watermark`. True if it is now running.
    fn admit(&mut self, id: RequestId, watermark: usize) -> bool {
        let seq = &self.seqs[&id];
        let known = match seq.status {
            Status::Swapped => seq.num_computed,
            _ => seq.tokens.len(),
        };
        let needed = known.max(1).div_ceil(self.manager.block_size());
        if self.manager.num_free_blocks() < needed + watermark {
            return false;
        }
        let seq = self.seqs.get_mut(&id).expect("known");
        let Ok(mut table) = self.manager.allocate_prompt(&seq.tokens[..known.max(1)]) else {
            return false;
        };
        if seq.status == Status::Swapped {
            // Cached blocks already hold these tokens' K/V; the executor copies the rest back.
            let written = seq.num_computed.div_ceil(table.block_size());
            let blocks = table.blocks()[..written]
                .iter()
                .map(|&b| (!self.manager.is_cached(b)).then_some(b))
                .collect();
            self.block_ops.push(BlockOp::SwapIn { id, blocks });
            self.manager.commit(&mut table, seq.num_computed);
        } else {
            seq.num_computed = table.num_tokens(); // prefix-cache hits
        }
        seq.table = Some(table);
        seq.status = Status::Running;
        self.trace.admitted.push(id);
        true
    }

    // ANCHOR: update
    /// Folds a step's results in: the scheduled positions now hold K/V, and each sequence
    /// with a logit row samples its next token. `logits`: `[step.num_logit_rows(), vocab]`.
    pub fn update(
        &mut self,
        step: &SchedulerOutput,
        logits: ArrayView2<f32>,
    ) -> Result<Vec<RequestOutput>, EngineError> {
        if logits.nrows() != step.num_logit_rows() {
            return Err(EngineError::Executor(ExecutorError(format!(
                "returned {} logit rows for a step that wants {}",
                logits.nrows(),
                step.num_logit_rows()
            ))));
        }
        let max_len = self.model.max_model_len;
        let mut outputs = Vec::new();
        let mut first_row = 0;
        for scheduled in &step.seqs {
            let rows = logits.slice(s![first_row..first_row + scheduled.logit_rows, ..]);
            first_row += scheduled.logit_rows;
            let seq = self.seqs.get_mut(&scheduled.id).expect("scheduled");
            let table = seq.table.as_mut().expect("scheduled sequences hold blocks");
            seq.num_computed += scheduled.tokens.len();
            self.manager.commit(table, seq.num_computed);
            self.manager
                .cache_full_blocks(table, &seq.tokens[..seq.num_computed]);
            let Some(row) = rows.rows().into_iter().next_back() else {
                continue; // a prompt chunk: no token yet
            };
            let row = row.as_slice().expect("contiguous rows");
            let prompt = &seq.request.prompt;
            let token = seq
                .sampler
                .sample(row, prompt, &seq.tokens[prompt.len()..])?;
            let logprobs: Vec<TokenLogprobs> = seq
                .request
                .logprobs
                .map(|top| TokenLogprobs::of(row, token, top))
                .into_iter()
                .collect();
            seq.tokens.push(token);
            self.counters.generation_tokens += 1;
            let generated = seq.tokens.len() - prompt.len();
            let finish = if !seq.request.ignore_eos && seq.request.stop_token_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if generated >= seq.request.max_tokens || seq.tokens.len() >= max_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = finish {
                seq.finish(&mut self.manager, reason);
            }
            let new_tokens = seq.output()[seq.streamed..].to_vec();
            seq.streamed += new_tokens.len();
            outputs.push(RequestOutput {
                id: scheduled.id,
                new_tokens,
                logprobs,
                finished: finish,
            });
        }
        Ok(outputs)
    }
    // ANCHOR_END: update
}
