//! [`Engine`]: a [`Scheduler`] and an [`Executor`], and the step that joins them.
//!
//! ```text
//! step:  plan    = scheduler.schedule()         which sequences, how many tokens, block ops
//!        logits  = executor.execute(&plan)      swaps, copies, one batched forward
//!        outputs = scheduler.update(&plan, logits)   sample, stop checks, free finished blocks
//! ```
//! When every token of a step is greedy, the executor returns each logit row's argmax instead
//! of the row (`execute_argmax`: a GPU then copies back one id a row). With a [`Speculator`]
//! (chapter 6), each step starts by proposing drafts for the running decodes, and `update`
//! verifies them.
//! The engine knows neither where K/V live nor which device runs the forward: chapter 7's GPU
//! executor and chapter 8's tensor-parallel one plug in here unchanged.

use crate::executor::{Executor, ExecutorError};
use crate::logprobs::TokenLogprobs;
use crate::request::{FinishReason, Request, RequestId};
use crate::scheduler::{Scheduler, StepLogits};
use crate::speculation::Speculator;

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
    /// Reuse the KV blocks of prompt prefixes already computed (chapter 3's prefix cache).
    pub enable_prefix_caching: bool,
}

impl EngineConfig {
    /// Tokens one step must hold for a request of `prompt_len` tokens and `max_tokens`, when
    /// prompts are not chunked: its prompt, and when preemption recomputes, the prompt and its
    /// output so far, all but the last sampled token (which ends the request without running).
    /// `None` with chunked prefill: any chunk fits. Saturates rather than wraps on absurd
    /// `max_tokens`, so that the sum stays an upper bound.
    pub fn unchunked_step_tokens(&self, prompt_len: usize, max_tokens: usize) -> Option<usize> {
        if self.enable_chunked_prefill {
            return None;
        }
        Some(match self.preemption {
            Preemption::Recompute => prompt_len.saturating_add(max_tokens.saturating_sub(1)),
            Preemption::Swap => prompt_len,
        })
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            enable_chunked_prefill: true,
            watermark: 0.01,
            preemption: Preemption::Recompute,
            enable_prefix_caching: false,
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
    /// A request must ask for at least one token: the step that computes its prompt always
    /// samples one.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error(
        "without chunked prefill one step must hold a whole prompt (plus, when preemption \
         recomputes, its output so far): up to {needed} tokens here, but max_num_batched_tokens \
         is {budget}"
    )]
    OverBudget { needed: usize, budget: usize },
    #[error(transparent)]
    Executor(#[from] ExecutorError),
    #[error(transparent)]
    Pool(#[from] ch03::PoolError),
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
    /// Speculative decodes verified this step: (request, drafts run, drafts accepted).
    pub speculated: Vec<(RequestId, usize, usize)>,
    /// Copies-on-write this step: (request, the shared block copied, its private copy).
    pub copied: Vec<(RequestId, ch03::BlockCopy)>,
    /// Choices that started from their parent's blocks this step: (parent, fork).
    pub forked: Vec<(RequestId, RequestId)>,
}

/// Counters for the server's metrics (chapter 8).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub steps: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Speculative decoding (chapter 6), named as vLLM's metrics: verification steps of a
    /// sequence with at least one draft, draft tokens verified, draft tokens accepted.
    pub spec_decode_num_drafts: u64,
    pub spec_decode_num_draft_tokens: u64,
    pub spec_decode_num_accepted_tokens: u64,
}

/// The engine: a scheduler and the executor it drives.
pub struct Engine<'e> {
    scheduler: Scheduler,
    executor: Box<dyn Executor + Send + 'e>,
    /// Chapter 6: drafts proposed before each step, verified after it.
    speculator: Option<Box<dyn Speculator + 'e>>,
}

impl<'e> Engine<'e> {
    /// An engine over `executor`; the scheduler's block pool is sized from its KV layout.
    pub fn new(
        executor: impl Executor + Send + 'e,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        Self::boxed(Box::new(executor), config)
    }

    /// [`Engine::new`] over an executor chosen at run time.
    pub fn boxed(
        executor: Box<dyn Executor + Send + 'e>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        let scheduler = Scheduler::new(config, executor.kv_layout(), executor.model_spec())?;
        Ok(Engine {
            scheduler,
            executor,
            speculator: None,
        })
    }

    /// Speculative decoding (chapter 6): before each step `speculator` proposes drafts for the
    /// running decodes; the step verifies them.
    pub fn with_speculator(mut self, speculator: Box<dyn Speculator + 'e>) -> Self {
        self.scheduler.set_speculative(true);
        self.speculator = Some(speculator);
        self
    }

    pub fn speculator(&self) -> Option<&(dyn Speculator + 'e)> {
        self.speculator.as_deref()
    }

    /// The scheduler: queues, counters, the last step's trace, KV usage.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn executor(&self) -> &(dyn Executor + Send + 'e) {
        self.executor.as_ref()
    }

    /// Queues a request; it runs from the next step on.
    pub fn add_request(&mut self, request: Request) -> Result<RequestId, EngineError> {
        self.scheduler.add_request(request)
    }

    /// [`Engine::add_request`], with a [`LogitsProcessor`](crate::LogitsProcessor) over its
    /// logits (chapter 8).
    pub fn add_request_with(
        &mut self,
        request: Request,
        processor: Box<dyn crate::processor::LogitsProcessor>,
    ) -> Result<RequestId, EngineError> {
        self.scheduler.add_request_with(request, processor)
    }

    /// Queues another choice of `parent`'s prompt (the OpenAI API's `n`), prefilled once for
    /// all of them: see [`Scheduler::add_fork`].
    pub fn add_fork(
        &mut self,
        parent: RequestId,
        request: Request,
        processor: Option<Box<dyn crate::processor::LogitsProcessor>>,
    ) -> Result<RequestId, EngineError> {
        self.scheduler.add_fork(parent, request, processor)
    }

    /// Ends a request now and frees its blocks. False if it is unknown or already finished.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let aborted = self.scheduler.abort(id);
        self.release_ended();
        aborted
    }

    /// Tells the speculator which requests ended, so that it frees what it kept for them.
    fn release_ended(&mut self) {
        if let Some(speculator) = self.speculator.as_deref_mut() {
            for id in self.scheduler.take_ended() {
                speculator.release(id);
            }
        }
    }

    /// Whether a step has work to do: a request not finished, or the copy outside the pool of
    /// a swapped-out request that was aborted, which the executor drops in a step. (Without
    /// the latter, an idle engine would keep that copy until the next request came.)
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished() || self.scheduler.has_pending_drops()
    }

    // ANCHOR: step
    /// One engine step; returns what each request produced. A step with nothing to run
    /// returns an empty list.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, EngineError> {
        if let Some(speculator) = self.speculator.as_deref_mut() {
            self.scheduler.propose(speculator)?;
        }
        let plan = self.scheduler.schedule();
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        // A step whose every token is greedy needs only each row's argmax (one id a row, not a
        // vocabulary of logits, from a GPU).
        let argmax;
        let results = if self.scheduler.samples_argmax_only(&plan) {
            argmax = self.executor.execute_argmax(&plan)?;
            StepLogits::Argmax(&argmax)
        } else {
            StepLogits::Rows(self.executor.execute(&plan)?)
        };
        let outputs = ch02::profile::timed(ch02::profile::Op::Sampling, || {
            let speculator = self.speculator.as_deref_mut();
            self.scheduler.update_with(&plan, results, speculator)
        })?;
        self.release_ended();
        Ok(outputs)
    }
    // ANCHOR_END: step

    /// [`Engine::step`], but an error instead of an endless loop if unfinished requests exist
    /// and none can run.
    pub fn step_or_stall(&mut self) -> Result<Vec<RequestOutput>, EngineError> {
        let steps = self.scheduler.counters().steps;
        let outputs = self.step()?;
        if self.scheduler.counters().steps == steps
            && let Some(unfinished) = self.scheduler.stalled()
        {
            return Err(EngineError::Stalled(unfinished));
        }
        Ok(outputs)
    }

    /// Runs `requests` to completion; completions in request order. If one is refused, none
    /// is queued: all are checked before the first is added.
    pub fn generate(&mut self, requests: Vec<Request>) -> Result<Vec<Completion>, EngineError> {
        for request in &requests {
            self.scheduler.check(request)?;
        }
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
        let (tokens, finish_reason) = self.scheduler.take(id)?;
        Some(Completion {
            id,
            tokens,
            finish_reason,
        })
    }
}
