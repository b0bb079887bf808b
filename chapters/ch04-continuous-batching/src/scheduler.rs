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
//! With speculative decoding (chapter 6, [`Speculator`]), `propose()` first asks for drafts for
//! the running decodes; `schedule()` puts them in lookahead slots; `update_with()` verifies
//! them, applies the stop checks to every emitted token in order and rolls back the rest.

use std::collections::BTreeMap;

use ch01::Sampler;
use ch01::sampler::SamplingError::NoCandidates;
use ch03::{BlockCopy, BlockError, BlockId, BlockManager, BlockTable, PrefixStats};
use ndarray::{ArrayView1, ArrayView2, s};

use crate::attention::QueryRow;
use crate::engine::{Counters, EngineConfig, EngineError, Preemption, RequestOutput, StepTrace};
use crate::executor::{ExecutorError, KvLayout, ModelSpec};
use crate::presample::presample;
use crate::processor::LogitsProcessor;
use crate::request::{FinishReason, Pushed, Request, RequestId, Sequence, Status};
use crate::speculation::{Draft, DraftSeq, Speculator};

/// What an executor returned for a step's logit rows.
#[derive(Debug, Clone, Copy)]
pub enum StepLogits<'a> {
    /// The rows, `[step.num_logit_rows(), vocab]` ([`Executor::execute`]).
    ///
    /// [`Executor::execute`]: crate::executor::Executor::execute
    Rows(ArrayView2<'a, f32>),
    /// Each row's argmax only ([`Executor::execute_argmax`]), for a step
    /// [`Scheduler::samples_argmax_only`] accepts.
    ///
    /// [`Executor::execute_argmax`]: crate::executor::Executor::execute_argmax
    Argmax(&'a [Option<u32>]),
}

impl StepLogits<'_> {
    fn rows(&self) -> usize {
        match self {
            StepLogits::Rows(logits) => logits.nrows(),
            StepLogits::Argmax(ids) => ids.len(),
        }
    }
}

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

    /// The step's tokens flattened, in batch order: each one's sequence table and position.
    /// `[n]`
    pub fn query_rows(&self) -> Vec<QueryRow<'_>> {
        self.seqs
            .iter()
            .flat_map(|seq| {
                (0..seq.tokens.len()).map(|t| QueryRow {
                    blocks: &seq.block_table,
                    pos: seq.start_pos + t,
                })
            })
            .collect()
    }

    /// Which of the flattened rows want logits: the last `logit_rows` of each sequence.
    /// `[num_logit_rows]`
    pub fn logit_row_indices(&self) -> Vec<usize> {
        let mut picked = Vec::with_capacity(self.num_logit_rows());
        let mut end = 0;
        for seq in &self.seqs {
            end += seq.tokens.len();
            picked.extend(end - seq.logit_rows..end);
        }
        picked
    }
}

/// A read-only view of one sequence in the scheduler, for observers that draw the engine
/// (chapter 8's dashboard); nothing in it can change the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqView<'a> {
    pub id: RequestId,
    pub status: Status,
    pub priority: i32,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// Prompt and output tokens so far.
    pub num_tokens: usize,
    /// Positions that hold K/V (while running; kept while swapped; 0 while waiting).
    pub num_computed: usize,
    /// Positions the prefix cache supplied when it was last admitted.
    pub num_cached_tokens: usize,
    /// Its block table while running; empty otherwise.
    pub blocks: &'a [BlockId],
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
    /// Chapter 6: whether a speculator proposes drafts; requests ended since it last heard;
    /// the tokens one verification accepted (a scratch buffer).
    speculative: bool,
    ended: Vec<RequestId>,
    accepted: Vec<u32>,
    /// A logits row rewritten by a sequence's [`LogitsProcessor`] (a scratch buffer).
    processed: Vec<f32>,
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
            speculative: false,
            ended: Vec::new(),
            accepted: Vec::new(),
            processed: Vec::new(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    // ANCHOR: admission
    /// Checks `request` and queues it; it runs from the next step on.
    pub fn add_request(&mut self, request: Request) -> Result<RequestId, EngineError> {
        self.check(&request)?;
        self.insert(request, None)
    }

    /// Refuses a request the engine could never serve. A request it accepts is queued by
    /// `insert` without error.
    pub(crate) fn check(&self, request: &Request) -> Result<(), EngineError> {
        // ANCHOR: task_4_1
        self.model.check_tokens(&request.prompt)?;
        request.params.validate()?;
        if request.max_tokens == 0 {
            return Err(EngineError::ZeroMaxTokens);
        }
        let max_len = self.model.max_model_len;
        let prompt_len = request.prompt.len();
        let mut needed = prompt_len.saturating_add(request.max_tokens).min(max_len);
        // A prompt found whole in the prefix cache computes its last position again, into a
        // private copy of its last block while the cached one is still held: one block past
        // the prompt's, which `prompt_len + 1` positions count exactly (a partial last block
        // is never a hit). Only a prompt that fills the pool needs more than the line above.
        if self.config.enable_prefix_caching {
            needed = needed.max(prompt_len + 1);
        }
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
        // ANCHOR_END: task_4_1
        Ok(())
        // ANCHOR_END: admission
    }

    /// Queues a checked request (with its logits processor, if any).
    fn insert(
        &mut self,
        request: Request,
        processor: Option<Box<dyn LogitsProcessor>>,
    ) -> Result<RequestId, EngineError> {
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
                draft: Draft::default(),
                num_cached_tokens: 0,
                processor,
                fork_of: None,
                forks: Vec::new(),
            },
        );
        Ok(id)
    }

    /// [`Scheduler::add_request`], with a [`LogitsProcessor`] that rewrites the logits before
    /// each of its tokens is sampled.
    pub fn add_request_with(
        &mut self,
        request: Request,
        processor: Box<dyn LogitsProcessor>,
    ) -> Result<RequestId, EngineError> {
        self.check(&request)?;
        self.insert(request, Some(processor))
    }

    // ANCHOR: add_fork
    /// Queues `request` as another choice of `parent`'s prompt (the OpenAI API's `n`): it is
    /// not prefilled itself; when `parent`'s prompt has been computed, it starts from a fork of
    /// `parent`'s blocks (chapter 3's copy-on-write shares them until one of them writes) and
    /// samples its first token, with its own sampler, from the same logits row. Its output is
    /// what it would have been alone. If `parent` is unknown, finished or past its prompt, it
    /// is queued as a request of its own; a prompt other than `parent`'s is refused.
    pub fn add_fork(
        &mut self,
        parent: RequestId,
        request: Request,
        processor: Option<Box<dyn LogitsProcessor>>,
    ) -> Result<RequestId, EngineError> {
        self.check(&request)?;
        let forkable = match self.seqs.get(&parent) {
            Some(p) if p.request.prompt != request.prompt => {
                return Err(EngineError::Config(format!(
                    "a fork of request {parent} must have its prompt"
                )));
            }
            Some(p) => !matches!(p.status, Status::Finished(_)) && p.output().is_empty(),
            None => false,
        };
        // A fork of a fork waits for the same request.
        let parent = self
            .seqs
            .get(&parent)
            .and_then(|p| p.fork_of)
            .unwrap_or(parent);
        let id = self.insert(request, processor)?;
        if forkable {
            self.seqs.get_mut(&id).expect("inserted").fork_of = Some(parent);
            self.seqs
                .get_mut(&parent)
                .expect("unfinished")
                .forks
                .push(id);
        }
        Ok(id)
    }
    // ANCHOR_END: add_fork

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

    /// Whether the next step has K/V copies outside the pool to drop: swapped-out requests
    /// that ended (aborted) since the last step.
    pub fn has_pending_drops(&self) -> bool {
        !self.finished_swapped.is_empty()
    }

    fn num_running(&self) -> usize {
        self.seqs
            .values()
            .filter(|s| s.status == Status::Running)
            .count()
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

    /// The block manager, to read (reference counts, the prefix cache, free blocks).
    pub fn block_manager(&self) -> &BlockManager {
        &self.manager
    }

    /// Every request the scheduler holds, finished ones not yet taken included, by id.
    pub fn sequences(&self) -> impl Iterator<Item = SeqView<'_>> {
        self.seqs.values().map(|s| SeqView {
            id: s.id,
            status: s.status,
            priority: s.request.priority,
            prompt_len: s.request.prompt.len(),
            max_tokens: s.request.max_tokens,
            num_tokens: s.tokens.len(),
            num_computed: s.num_computed,
            num_cached_tokens: s.num_cached_tokens,
            blocks: s.table.as_ref().map_or(&[], |t| t.blocks()),
        })
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
    /// free-block watermark. With prefix caching a prompt must also leave one position of it
    /// free (see `check`); with `max_tokens >= 1` every request within it does. A server
    /// refuses to start if this is below its max_model_len.
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
        let forks = std::mem::take(&mut seq.forks);
        self.promote(forks);
        if self.speculative {
            self.ended.push(id);
        }
    }

    /// The forks in `forks` still waiting for their parent, which will not compute its prompt
    /// for them: the first becomes a request of its own, the others its forks.
    fn promote(&mut self, forks: Vec<RequestId>) {
        let mut waiting = self.waiting_forks(forks).into_iter();
        let Some(first) = waiting.next() else {
            return;
        };
        let rest: Vec<_> = waiting.collect();
        for id in &rest {
            self.seqs.get_mut(id).expect("waiting").fork_of = Some(first);
        }
        let seq = self.seqs.get_mut(&first).expect("waiting");
        seq.fork_of = None;
        seq.forks = rest;
    }

    /// Those of `forks` that are still waiting to fork (not aborted or taken meanwhile).
    fn waiting_forks(&self, forks: Vec<RequestId>) -> Vec<RequestId> {
        forks
            .into_iter()
            .filter(|id| {
                self.seqs
                    .get(id)
                    .is_some_and(|s| s.status == Status::Waiting && s.fork_of.is_some())
            })
            .collect()
    }

    /// Whether a speculator proposes drafts (set by [`Engine::with_speculator`](crate::Engine::with_speculator)).
    pub fn set_speculative(&mut self, on: bool) {
        self.speculative = on;
    }

    /// Requests that ended since the last call (recorded only while speculative).
    pub(crate) fn take_ended(&mut self) -> std::vec::Drain<'_, RequestId> {
        self.ended.drain(..)
    }

    // ANCHOR: propose
    /// Asks `speculator` for the drafts of this step: every running decode gets up to k
    /// tokens, unless more sequences run than its `disable_by_batch_size`. Tells it first which
    /// requests ended since the last call.
    pub fn propose(&mut self, speculator: &mut dyn Speculator) -> Result<(), EngineError> {
        for id in self.ended.drain(..) {
            speculator.release(id);
        }
        let k = speculator.num_speculative_tokens();
        let running = self.in_order(Status::Running);
        let paused = speculator
            .disable_by_batch_size()
            .is_some_and(|limit| running.len() > limit);
        let max_len = self.model.max_model_len;
        let mut ids = Vec::new();
        let mut drafts = Vec::new();
        for id in running {
            let seq = self.seqs.get_mut(&id).expect("running");
            seq.draft.clear();
            // Drafts follow a decode's last sampled token, never a prompt's last token: a
            // request with `n` > 1 forks its choices from the prompt's K/V after that step,
            // and accepted drafts would already be in it.
            let decoding = seq.tokens.len() > seq.request.prompt.len();
            if paused || k == 0 || !decoding || seq.pending() != 1 || seq.processor.is_some() {
                continue;
            }
            // The step yields up to drafts + 1 tokens: stay within max_tokens and the context.
            let generated = seq.tokens.len() - seq.request.prompt.len();
            let left = seq.request.max_tokens.saturating_sub(generated);
            let room = max_len.saturating_sub(seq.tokens.len());
            let max_drafts = k.min(left.saturating_sub(1)).min(room.saturating_sub(1));
            if max_drafts > 0 {
                ids.push((id, max_drafts));
                drafts.push(std::mem::take(&mut seq.draft));
            }
        }
        if ids.is_empty() {
            return Ok(());
        }
        let views: Vec<DraftSeq> = ids
            .iter()
            .map(|&(id, max_drafts)| {
                let seq = &self.seqs[&id];
                DraftSeq {
                    id,
                    tokens: &seq.tokens,
                    prompt_len: seq.request.prompt.len(),
                    params: &seq.request.params,
                    max_drafts,
                }
            })
            .collect();
        let proposed = speculator.propose(&views, &mut drafts);
        for (&(id, max_drafts), mut draft) in ids.iter().zip(drafts) {
            draft.truncate(max_drafts);
            self.seqs.get_mut(&id).expect("running").draft = draft;
        }
        proposed?;
        Ok(())
    }
    // ANCHOR_END: propose

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
        let mut picked = self.pick();
        self.grant_drafts(&mut picked);
        let mut seqs = Vec::with_capacity(picked.len());
        for (id, n) in picked {
            let s = &self.seqs[&id];
            let (start, end) = (s.num_computed, s.num_computed + n);
            self.trace
                .scheduled
                .push((id, n, start < s.request.prompt.len()));
            // Past the sequence's end: its drafts (chapter 6), one logit row each.
            let drafts = end.saturating_sub(s.tokens.len());
            let mut tokens = s.tokens[start..end - drafts].to_vec();
            tokens.extend_from_slice(&s.draft.tokens[..drafts]);
            seqs.push(ScheduledSeq {
                id,
                tokens,
                start_pos: start,
                block_table: s.table.as_ref().expect("running").blocks().to_vec(),
                logit_rows: usize::from(end >= s.tokens.len()) + drafts,
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
        // ANCHOR: task_4_2
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
            if self.seqs[&id].fork_of.is_some() {
                continue; // it starts from its parent's blocks, see `start_forks`
            }
            if budget == 0 || self.num_running() >= self.config.max_num_seqs {
                break;
            }
            if !self.admit(id, watermark, budget) {
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
        // ANCHOR_END: task_4_2
    }
    // ANCHOR_END: schedule

    // ANCHOR: grant_drafts
    /// Gives chapter 6's drafts what the step leaves: once every running sequence has its
    /// tokens and every admitted one its chunk, each picked decode, in scheduling order, gets
    /// as many of its drafts as the rest of the token budget and the free blocks allow, in
    /// lookahead slots past its end. The others are dropped: drafts never delay, starve or
    /// preempt anyone's required tokens.
    fn grant_drafts(&mut self, picked: &mut [(RequestId, usize)]) {
        let used: usize = picked.iter().map(|&(_, n)| n).sum();
        let mut budget = self.config.max_num_batched_tokens.saturating_sub(used);
        for (id, n) in picked.iter_mut() {
            let seq = &self.seqs[id];
            // Only a step that reaches the sequence's last token can run its drafts.
            let reaches_end = seq.num_computed + *n == seq.tokens.len();
            let drafts = if reaches_end {
                seq.draft.tokens.len().min(budget)
            } else {
                0
            };
            if drafts == 0 || self.reserve(*id, *n + drafts).is_err() {
                self.seqs.get_mut(id).expect("picked").draft.clear();
                continue;
            }
            self.seqs
                .get_mut(id)
                .expect("picked")
                .draft
                .truncate(drafts);
            *n += drafts;
            budget -= drafts;
        }
    }
    // ANCHOR_END: grant_drafts

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
            self.trace.copied.push((id, copy));
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
        // ANCHOR: task_4_2
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
        // ANCHOR_END: task_4_2
    }

    /// Frees `id`'s blocks: recomputed later, or its K/V kept outside the pool (swap).
    fn preempt(&mut self, id: RequestId) {
        self.counters.preemptions += 1;
        self.trace.preempted.push(id);
        let seq = self.seqs.get_mut(&id).expect("known");
        seq.draft.clear();
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
    /// prefix cache), if the free blocks stay above `watermark`, counting for a swapped one the
    /// blocks of its next chunk within `budget` too. True if it is now running.
    fn admit(&mut self, id: RequestId, watermark: usize, budget: usize) -> bool {
        let seq = &self.seqs[&id];
        let bs = self.manager.block_size();
        let swapped = seq.status == Status::Swapped;
        // A waiting one's table covers its tokens, computed or not (at least one: it has a
        // prompt); a swapped one's the positions it computed (perhaps none).
        let known = if swapped {
            seq.num_computed
        } else {
            seq.tokens.len()
        };
        // Blocks for what it has (a prefix that running requests hold costs none). A waiting
        // one computes its last token again, on a full prefix hit into a copy of the last
        // block; a swapped one computes none of its `known` tokens again, so it copies
        // nothing, but needs the blocks its next chunk adds: admitted without them, it would
        // be swapped straight out again, step after step.
        let needed = if swapped {
            let chunk = seq.pending().min(budget);
            self.manager.blocks_for_computed(&seq.tokens[..known]) + (known + chunk).div_ceil(bs)
                - known.div_ceil(bs)
        } else {
            self.manager.blocks_for_prompt(&seq.tokens[..known])
        };
        if self.manager.num_free_blocks() < needed + watermark {
            return false;
        }
        let seq = self.seqs.get_mut(&id).expect("known");
        let Ok(mut table) = self.manager.allocate_prompt(&seq.tokens[..known]) else {
            return false;
        };
        seq.num_cached_tokens = table.num_tokens();
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

    /// Whether every token `step` samples is its row's argmax, so that the executor may return
    /// each row's argmax instead of the row ([`Executor::execute_argmax`]): every sequence with
    /// a logit row has exactly one (no drafts), samples greedily with no penalty, and has no
    /// logits processor, no logprobs and no forks waiting on its row.
    ///
    /// [`Executor::execute_argmax`]: crate::executor::Executor::execute_argmax
    pub fn samples_argmax_only(&self, step: &SchedulerOutput) -> bool {
        step.seqs.iter().filter(|s| s.logit_rows > 0).all(|s| {
            let seq = &self.seqs[&s.id];
            let p = seq.sampler.params();
            s.logit_rows == 1
                && p.is_greedy()
                && p.repetition_penalty == 1.0
                && p.frequency_penalty == 0.0
                && p.presence_penalty == 0.0
                && seq.processor.is_none()
                && seq.request.logprobs.is_none()
                && seq.forks.is_empty()
        })
    }

    // ANCHOR: update
    /// Folds a step's results in: the scheduled positions now hold K/V, and each sequence
    /// with a logit row samples its next token. `logits`: `[step.num_logit_rows(), vocab]`.
    /// A step with drafts needs [`update_with`](Self::update_with) and the speculator.
    pub fn update(
        &mut self,
        step: &SchedulerOutput,
        logits: ArrayView2<f32>,
    ) -> Result<Vec<RequestOutput>, EngineError> {
        self.update_with(step, StepLogits::Rows(logits), None)
    }

    /// Runs [`LogitsProcessor::prepare`] for every sequence of `step` that samples and has a
    /// processor, in parallel: the grammar masks of a batch cost one mask's time per core.
    fn prepare_processors(&mut self, step: &SchedulerOutput) {
        let sampling = step.seqs.iter().filter(|s| s.logit_rows > 0).map(|s| s.id);
        self.prepare_processors_of(sampling.collect());
    }

    /// [`LogitsProcessor::prepare`] for each of `sampling` that has a processor, in parallel.
    fn prepare_processors_of(&mut self, sampling: std::collections::HashSet<RequestId>) {
        use rayon::prelude::*;
        let mut processors: Vec<&mut Box<dyn LogitsProcessor>> = self
            .seqs
            .iter_mut()
            .filter(|(id, _)| sampling.contains(id))
            .filter_map(|(_, seq)| seq.processor.as_mut())
            .collect();
        match processors.len() {
            0 => {}
            1 => processors[0].prepare(),
            _ => processors.par_iter_mut().for_each(|p| p.prepare()),
        }
    }

    /// [`update`](Self::update), verifying the drafts of speculative decodes with
    /// `speculator`: each accepted token goes through the stop checks in order, and the K/V
    /// of rejected drafts is rolled back.
    pub fn update_with(
        &mut self,
        step: &SchedulerOutput,
        results: StepLogits,
        mut speculator: Option<&mut (dyn Speculator + '_)>,
    ) -> Result<Vec<RequestOutput>, EngineError> {
        if results.rows() != step.num_logit_rows() {
            return Err(EngineError::Executor(ExecutorError(format!(
                "returned {} logit rows for a step that wants {}",
                results.rows(),
                step.num_logit_rows()
            ))));
        }
        let (logits, argmax) = match results {
            StepLogits::Rows(logits) => (logits, None),
            StepLogits::Argmax(ids) if self.samples_argmax_only(step) => {
                // Rows of no logits: every use of a row below is a sample, which the argmax
                // replaces (the conditions of samples_argmax_only rule out the others).
                (
                    ArrayView2::from_shape((ids.len(), 0), &[]).expect("empty"),
                    Some(ids),
                )
            }
            StepLogits::Argmax(_) => {
                return Err(EngineError::Config(
                    "argmax rows for a step that samples more than argmaxes".into(),
                ));
            }
        };
        let max_len = self.model.max_model_len;
        self.prepare_processors(step);
        // Plain decodes sampled on several threads first; each takes its token below, in order.
        let mut presampled = match argmax {
            None => presample(&mut self.seqs, step, logits),
            Some(_) => (0..step.seqs.len()).map(|_| None).collect(),
        };
        let mut outputs = Vec::new();
        let mut first_row = 0;
        for (index, scheduled) in step.seqs.iter().enumerate() {
            let row0 = first_row;
            let rows = logits.slice(s![row0..row0 + scheduled.logit_rows, ..]);
            first_row += scheduled.logit_rows;
            // Drafts ran past the sequence's end: their K/V counts once they are accepted.
            let drafts = scheduled.logit_rows.saturating_sub(1);
            let seq = self.seqs.get_mut(&scheduled.id).expect("scheduled");
            seq.num_computed += scheduled.tokens.len() - drafts;
            if scheduled.logit_rows == 0 {
                // A prompt chunk: no token yet.
                let table = seq.table.as_mut().expect("scheduled sequences hold blocks");
                self.manager.commit(table, seq.num_computed);
                self.manager
                    .cache_full_blocks(table, &seq.tokens[..seq.num_computed]);
                continue;
            }
            let prompt = &seq.request.prompt;
            let accepted = &mut self.accepted;
            accepted.clear();
            let mut processor_stop = false;
            let (ahead_token, ahead_logprobs) = match presampled[index].take() {
                Some(ahead) => (Some(ahead.token), ahead.logprobs),
                None => (None, None),
            };
            if drafts == 0 {
                let row = rows.row(0);
                let token = match (ahead_token, argmax) {
                    (Some(token), _) => token?,
                    (None, Some(ids)) => ids[row0].ok_or(NoCandidates {
                        vocab_size: self.model.vocab_size,
                    })?,
                    (None, None) => {
                        let row = row.as_slice().expect("contiguous rows");
                        let (token, stop) = seq.sample(row, &mut self.processed)?;
                        processor_stop = stop;
                        token
                    }
                };
                accepted.push(token);
            } else {
                let speculator = speculator.as_deref_mut().ok_or_else(|| {
                    EngineError::Config("a step with draft tokens needs a speculator".into())
                })?;
                let output = &seq.tokens[prompt.len()..];
                speculator.verify(&mut seq.sampler, rows, prompt, output, &seq.draft, accepted)?;
                if accepted.is_empty() || accepted.len() > drafts + 1 {
                    return Err(EngineError::Config(format!(
                        "the speculator accepted {} tokens from {drafts} drafts",
                        accepted.len()
                    )));
                }
                let c = &mut self.counters;
                c.spec_decode_num_drafts += 1;
                c.spec_decode_num_draft_tokens += drafts as u64;
                c.spec_decode_num_accepted_tokens += accepted.len() as u64 - 1;
                self.trace
                    .speculated
                    .push((scheduled.id, drafts, accepted.len() - 1));
            }
            // Every token through the stop checks, in order; the first stop ends the request.
            let pushed = seq.push_tokens(accepted, rows, ahead_logprobs, processor_stop, max_len);
            self.counters.generation_tokens += pushed.tokens as u64;
            // Accepted drafts hold K/V (the last token pushed does not yet); rejected ones
            // are rolled back.
            let table = seq.table.as_mut().expect("scheduled sequences hold blocks");
            if drafts == 0 {
                self.manager.commit(table, seq.num_computed);
            } else {
                seq.num_computed += pushed.tokens.min(accepted.len() - 1);
                self.manager.rollback(table, seq.num_computed);
            }
            self.manager
                .cache_full_blocks(table, &seq.tokens[..seq.num_computed]);
            seq.draft.clear();
            // Only a sequence without output has forks: this row ended its prompt, and the
            // forks waiting for it start from here.
            let forks = std::mem::take(&mut seq.forks);
            let forks = self.fork_tables(scheduled.id, forks);
            outputs.push(self.report(scheduled.id, pushed));
            self.start_forks(forks, rows.row(0), max_len, &mut outputs)?;
        }
        Ok(outputs)
    }
    // ANCHOR_END: update

    /// Ends `id` if its last tokens finished it; what the step produced for it.
    fn report(&mut self, id: RequestId, pushed: Pushed) -> RequestOutput {
        let seq = self.seqs.get_mut(&id).expect("scheduled");
        if let Some(reason) = pushed.finish {
            seq.finish(&mut self.manager, reason);
            if self.speculative {
                self.ended.push(id);
            }
        }
        let new_tokens = seq.output()[seq.streamed..].to_vec();
        seq.streamed += new_tokens.len();
        RequestOutput {
            id,
            new_tokens,
            logprobs: pushed.logprobs,
            finished: pushed.finish,
        }
    }

    // ANCHOR: start_forks
    /// Forks `parent`'s table (its prompt just computed) for each of `forks` still waiting, as
    /// far as `max_num_seqs` allows; the others are promoted to requests of their own.
    fn fork_tables(
        &mut self,
        parent: RequestId,
        forks: Vec<RequestId>,
    ) -> Vec<(RequestId, BlockTable)> {
        let mut forks = self.waiting_forks(forks);
        if forks.is_empty() {
            return Vec::new();
        }
        let room = self.config.max_num_seqs.saturating_sub(self.num_running());
        let unforked = forks.split_off(room.min(forks.len()));
        self.promote(unforked);
        let table = self.seqs[&parent].table.as_ref().expect("just ran");
        let tables: Vec<_> = forks.iter().map(|_| self.manager.fork(table)).collect();
        self.trace
            .forked
            .extend(forks.iter().map(|&id| (parent, id)));
        forks.into_iter().zip(tables).collect()
    }

    /// Starts each fork from its table (every prompt position computed) and samples its first
    /// token from `row`, the logits of the prompt's last position: `[vocab]`.
    ///
    /// If a fork's sampling fails, the error is returned with that fork running (for the caller
    /// to fail or abort, as any request of a failed step); the forks after it give their tables
    /// back and wait as a request of their own (with the rest as its forks), as when a parent
    /// ends before its prompt is computed: no table is dropped unfreed, no fork waits for a
    /// parent that has already forked.
    fn start_forks(
        &mut self,
        forks: Vec<(RequestId, BlockTable)>,
        row: ArrayView1<f32>,
        max_len: usize,
        outputs: &mut Vec<RequestOutput>,
    ) -> Result<(), EngineError> {
        let logits = row.as_slice().expect("a contiguous row");
        let rows = row.insert_axis(ndarray::Axis(0)); // [1, vocab]
        self.prepare_processors_of(forks.iter().map(|(id, _)| *id).collect());
        let mut forks = forks.into_iter();
        while let Some((id, table)) = forks.next() {
            let seq = self.seqs.get_mut(&id).expect("a waiting fork");
            seq.fork_of = None;
            seq.num_computed = table.num_tokens();
            seq.table = Some(table);
            seq.status = Status::Running;
            let (token, stop) = match seq.sample(logits, &mut self.processed) {
                Ok(sampled) => sampled,
                Err(error) => {
                    let unstarted = forks
                        .map(|(id, table)| {
                            self.manager.free(table);
                            id
                        })
                        .collect();
                    self.promote(unstarted);
                    return Err(error.into());
                }
            };
            let pushed = seq.push_tokens(&[token], rows, None, stop, max_len);
            self.counters.generation_tokens += pushed.tokens as u64;
            outputs.push(self.report(id, pushed));
        }
        Ok(())
    }
    // ANCHOR_END: start_forks
}
