//! [`Engine`]: the step loop. Each [`Engine::step`] asks the scheduler which sequences run and
//! how many of their tokens, grows their block tables, runs one batched forward, samples, and
//! retires the sequences that finished.
//!
//! ```text
//! schedule:  running sequences first (decode 1 token, or the next prompt chunk),
//!            preempting the lowest-priority, latest-arrived one when blocks run out;
//!            then swapped-out ones, then waiting ones, while the token budget,
//!            max_num_seqs and the free-block watermark allow
//! execute:   ModelRunner over the flattened batch
//! sample:    per request, its own seeded sampler; stop checks; finished → blocks freed
//! ```

use std::collections::BTreeMap;

use ch01::{Llama, Sampler};
use ch03::{BlockError, PagedKv, PrefixStats};

use crate::logprobs::TokenLogprobs;
use crate::request::{FinishReason, Request, RequestId, Sequence, Status};
use crate::runner::{ModelRunner, ScheduledSeq};

/// How a preempted sequence gives its blocks back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preemption {
    /// Free the blocks; recompute the K/V (prompt and output so far) when readmitted.
    #[default]
    Recompute,
    /// Copy the blocks' K/V to CPU memory; copy them back when readmitted.
    Swap,
}

/// The scheduler's limits, named as vLLM names them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Most tokens in one step (prompt chunks plus decodes).
    pub max_num_batched_tokens: usize,
    /// Split long prompts into chunks that share steps with decodes; off: a prompt runs whole.
    pub enable_chunked_prefill: bool,
    /// Admit a waiting request only if this share of all blocks stays free afterwards.
    pub watermark: f64,
    pub preemption: Preemption,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            enable_chunked_prefill: true,
            watermark: 0.01,
            preemption: Preemption::Recompute,
        }
    }
}

/// Why a request or a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] ch01::Error),
    #[error(transparent)]
    Sampling(#[from] ch01::sampler::SamplingError),
    #[error(
        "request needs {needed} KV positions (prompt + max_tokens) but the cache holds {capacity} \
         above the free-block watermark"
    )]
    TooLong { needed: usize, capacity: usize },
    #[error(
        "without chunked prefill a step must hold a whole prompt: prompt + max_tokens ({needed}) \
         exceeds max_num_batched_tokens ({budget})"
    )]
    OverBudget { needed: usize, budget: usize },
    #[error("the scheduler can run none of the {0} unfinished requests (a bug: please report)")]
    Stalled(usize),
}

/// What one step produced for one request: the tokens sampled since the last report.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub id: RequestId,
    pub new_tokens: Vec<u32>,
    /// One entry per new token when the request asked for logprobs, else empty.
    pub logprobs: Vec<TokenLogprobs>,
    pub finished: Option<FinishReason>,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub id: RequestId,
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
}

/// What one step did: for the demo's trace and for tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepTrace {
    /// (request, tokens run, whether they were prompt tokens: a prefill or a chunk of one).
    pub scheduled: Vec<(RequestId, usize, bool)>,
    /// Requests preempted while scheduling this step.
    pub preempted: Vec<RequestId>,
    /// Requests admitted (from waiting or swapped) this step.
    pub admitted: Vec<RequestId>,
}

/// Counters for the server's metrics (chapter 8).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub steps: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
}

/// The engine over one model and one paged KV pool.
pub struct Engine<'m> {
    model: &'m Llama,
    kv: PagedKv,
    runner: ModelRunner,
    config: EngineConfig,
    seqs: BTreeMap<RequestId, Sequence>,
    next_id: RequestId,
    counters: Counters,
    trace: StepTrace,
}

impl<'m> Engine<'m> {
    pub fn new(model: &'m Llama, kv: PagedKv, config: EngineConfig) -> Result<Self, EngineError> {
        if config.max_num_seqs == 0 || config.max_num_batched_tokens == 0 {
            return Err(EngineError::Config(
                "max_num_seqs and max_num_batched_tokens must be at least 1".into(),
            ));
        }
        if !(0.0..1.0).contains(&config.watermark) {
            return Err(EngineError::Config("watermark must be in [0, 1)".into()));
        }
        Ok(Engine {
            runner: ModelRunner::new(model),
            model,
            kv,
            config,
            seqs: BTreeMap::new(),
            next_id: 0,
            counters: Counters::default(),
            trace: StepTrace::default(),
        })
    }

    /// Queues a request; it runs from the next step on.
    pub fn add_request(&mut self, request: Request) -> Result<RequestId, EngineError> {
        self.model.check_tokens(&request.prompt)?;
        request.params.validate()?;
        let needed = (request.prompt.len() + request.max_tokens)
            .min(self.model.config.max_position_embeddings);
        // A request alone must fit above the watermark, or it could never be admitted.
        let capacity = self.max_request_tokens();
        if needed > capacity {
            return Err(EngineError::TooLong { needed, capacity });
        }
        // Unchunked, a request readmitted after preemption by recomputation reruns its prompt
        // and its output so far in one step.
        let budget = self.config.max_num_batched_tokens;
        if !self.config.enable_chunked_prefill && needed > budget {
            return Err(EngineError::OverBudget { needed, budget });
        }
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
                swap: Vec::new(),
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

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// What the last step scheduled, preempted and admitted.
    pub fn last_step(&self) -> &StepTrace {
        &self.trace
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        self.kv.manager.stats()
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
        let m = &self.kv.manager;
        1.0 - m.num_free_blocks() as f64 / m.num_blocks() as f64
    }

    /// The pool's invariants against the live block tables.
    pub fn check_invariants(&self) -> Result<(), String> {
        let tables: Vec<_> = self
            .seqs
            .values()
            .filter_map(|s| s.table.as_ref())
            .collect();
        self.kv.manager.check_invariants(&tables)
    }

    /// Blocks that admission keeps free.
    /// The most KV positions one request may use (prompt + max_tokens): the pool above the
    /// free-block watermark. A server refuses to start if this is below its max_model_len.
    pub fn max_request_tokens(&self) -> usize {
        let blocks = self.kv.manager.num_blocks() - self.watermark_blocks();
        blocks * self.kv.pool.block_size()
    }

    fn watermark_blocks(&self) -> usize {
        (self.config.watermark * self.kv.manager.num_blocks() as f64).ceil() as usize
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

    /// One engine step; returns what each request produced. A step with nothing to run
    /// returns an empty list.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, EngineError> {
        self.trace = StepTrace::default();
        let scheduled = self.schedule();
        for &(id, n) in &scheduled {
            let s = &self.seqs[&id];
            let prompt = s.num_computed < s.request.prompt.len();
            self.trace.scheduled.push((id, n, prompt));
        }
        if scheduled.is_empty() {
            return Ok(Vec::new());
        }
        self.counters.steps += 1;
        let logits = {
            let batch: Vec<ScheduledSeq> = scheduled
                .iter()
                .map(|&(id, n)| {
                    let s = &self.seqs[&id];
                    ScheduledSeq {
                        tokens: &s.tokens[s.num_computed..s.num_computed + n],
                        start_pos: s.num_computed,
                        table: s.table.as_ref().expect("scheduled sequences hold blocks"),
                        wants_logits: s.num_computed + n == s.tokens.len(),
                    }
                })
                .collect();
            self.runner.execute(self.model, &mut self.kv.pool, &batch)
        };

        let mut outputs = Vec::new();
        let mut logit_rows = logits.rows().into_iter();
        for (id, n) in scheduled {
            let max_len = self.model.config.max_position_embeddings;
            let seq = self.seqs.get_mut(&id).expect("scheduled");
            let table = seq.table.as_mut().expect("scheduled sequences hold blocks");
            seq.num_computed += n;
            self.kv.manager.commit(table, seq.num_computed);
            self.kv
                .manager
                .cache_full_blocks(table, &seq.tokens[..seq.num_computed]);
            if seq.num_computed < seq.tokens.len() {
                continue; // a prompt chunk: no token yet
            }
            let row = logit_rows
                .next()
                .expect("one logits row per finished prompt or decode");
            let prompt = &seq.request.prompt;
            let row = row.as_slice().expect("contiguous");
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
                seq.finish(&mut self.kv.manager, reason); // (self.finish: logits borrow self)
            }
            let new_tokens = seq.output()[seq.streamed..].to_vec();
            seq.streamed += new_tokens.len();
            outputs.push(RequestOutput {
                id,
                new_tokens,
                logprobs,
                finished: finish,
            });
        }
        Ok(outputs)
    }

    /// [`Engine::step`], but an error instead of an endless loop if unfinished requests exist
    /// and none can run.
    pub fn step_or_stall(&mut self) -> Result<Vec<RequestOutput>, EngineError> {
        let steps = self.counters.steps;
        let outputs = self.step()?;
        if self.counters.steps == steps && self.has_unfinished() {
            let unfinished = self
                .seqs
                .values()
                .filter(|s| !matches!(s.status, Status::Finished(_)))
                .count();
            return Err(EngineError::Stalled(unfinished));
        }
        Ok(outputs)
    }

    /// Runs `requests` to completion; completions in request order.
    pub fn generate(&mut self, requests: Vec<Request>) -> Result<Vec<Completion>, EngineError> {
        let ids = requests
            .into_iter()
            .map(|r| self.add_request(r))
            .collect::<Result<Vec<_>, _>>()?;
        while self.has_unfinished() {
            self.step_or_stall()?;
        }
        Ok(ids
            .into_iter()
            .map(|id| self.take(id).expect("finished"))
            .collect())
    }

    /// Removes a finished request and returns its completion.
    pub fn take(&mut self, id: RequestId) -> Option<Completion> {
        match self.seqs.get(&id)?.status {
            Status::Finished(finish_reason) => {
                let seq = self.seqs.remove(&id)?;
                Some(Completion {
                    id,
                    tokens: seq.output().to_vec(),
                    finish_reason,
                })
            }
            _ => None,
        }
    }

    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let seq = self.seqs.get_mut(&id).expect("known request");
        seq.finish(&mut self.kv.manager, reason);
    }

    // ANCHOR: schedule
    /// Chooses this step's (sequence, number of tokens) and reserves their blocks.
    fn schedule(&mut self) -> Vec<(RequestId, usize)> {
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
            match self
                .kv
                .manager
                .reserve(self.seqs.get_mut(&id).unwrap().table.as_mut().unwrap(), n)
            {
                Ok(copy) => {
                    if let Some(copy) = copy {
                        self.kv.pool.copy_block(copy);
                    }
                    scheduled.push((id, n));
                    budget -= n;
                }
                Err(BlockError::OutOfBlocks { .. }) => {
                    self.preempt(id);
                    break;
                }
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

    /// Reserves `n` positions for running sequence `id`, preempting other running sequences
    /// (lowest priority, latest arrival first; never one already scheduled) until it fits, or
    /// `id` itself when it is the only candidate left. True if `id` got its blocks.
    fn reserve_or_preempt(
        &mut self,
        id: RequestId,
        n: usize,
        scheduled: &[(RequestId, usize)],
    ) -> bool {
        loop {
            let table = self
                .seqs
                .get_mut(&id)
                .unwrap()
                .table
                .as_mut()
                .expect("running");
            match self.kv.manager.reserve(table, n) {
                Ok(copy) => {
                    if let Some(copy) = copy {
                        self.kv.pool.copy_block(copy);
                    }
                    return true;
                }
                Err(BlockError::OutOfBlocks { .. }) => {
                    let victim = self
                        .seqs
                        .values()
                        .filter(|s| {
                            s.status == Status::Running
                                && !scheduled.iter().any(|&(v, _)| v == s.id)
                        })
                        .max_by_key(|s| s.victim_key())
                        .map(|s| s.id)
                        .expect("id itself is a candidate");
                    self.preempt(victim);
                    if victim == id {
                        return false;
                    }
                }
            }
        }
    }

    /// Frees `id`'s blocks: recomputed later, or its K/V kept in CPU memory (swap).
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
                seq.swap = table.blocks()[..written]
                    .iter()
                    .map(|&b| self.kv.pool.read_block(b))
                    .collect();
                seq.status = Status::Swapped;
            }
        }
        self.kv.manager.free(table);
    }

    /// Gives waiting or swapped `id` blocks for what it has computed (or may reuse from the
    /// prefix cache), if the free blocks stay above `watermark`. True if it is now running.
    fn admit(&mut self, id: RequestId, watermark: usize) -> bool {
        let seq = &self.seqs[&id];
        let known = match seq.status {
            Status::Swapped => seq.num_computed,
            _ => seq.tokens.len(),
        };
        let needed = known.max(1).div_ceil(self.kv.pool.block_size());
        if self.kv.manager.num_free_blocks() < needed + watermark {
            return false;
        }
        let seq = self.seqs.get_mut(&id).unwrap();
        let Ok(mut table) = self.kv.manager.allocate_prompt(&seq.tokens[..known.max(1)]) else {
            return false;
        };
        if seq.status == Status::Swapped {
            // Cached blocks already hold these tokens' K/V; copy the rest back.
            for (&block, data) in table.blocks().iter().zip(&seq.swap) {
                if !self.kv.manager.is_cached(block) {
                    self.kv.pool.write_block(block, data);
                }
            }
            self.kv.manager.commit(&mut table, seq.num_computed);
            seq.swap.clear();
        } else {
            seq.num_computed = table.num_tokens(); // prefix-cache hits
        }
        seq.table = Some(table);
        seq.status = Status::Running;
        self.trace.admitted.push(id);
        true
    }
}
