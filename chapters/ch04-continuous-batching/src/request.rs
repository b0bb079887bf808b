//! What a caller asks for, and the state of each request inside the engine.

use ch01::{Sampler, SamplingParams};
use ch03::{BlockManager, BlockTable};

use ch01::sampler::SamplingError;
use ndarray::ArrayView2;

use crate::logprobs::TokenLogprobs;
use crate::processor::LogitsProcessor;
use crate::speculation::Draft;

/// Engine-wide request id, in arrival order.
pub type RequestId = u64;

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids (non-empty, within the vocabulary).
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token ids that end generation (EOS), unless `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Scheduling priority: lower runs first (as vLLM's `priority`); FCFS among equals.
    pub priority: i32,
    /// Report each sampled token's log-probability and this many top alternatives
    /// ([`TokenLogprobs`]); `None`: none (nothing is computed).
    pub logprobs: Option<usize>,
}

impl Request {
    /// A greedy request with no stop token.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Request {
            prompt,
            params: SamplingParams::greedy(),
            max_tokens,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            priority: 0,
            logprobs: None,
        }
    }
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token.
    Stop,
    /// `max_tokens`, or the model's context is full.
    Length,
    /// The caller aborted it.
    Abort,
}

/// Where a request is in its life.
// ANCHOR: status
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Queued: not admitted yet, or preempted by recomputation (its blocks freed).
    Waiting,
    /// Admitted: holds blocks; scheduled in a step whenever the token budget allows.
    Running,
    /// Preempted by swapping: its K/V copied to CPU memory, its blocks freed.
    Swapped,
    Finished(FinishReason),
}
// ANCHOR_END: status

/// A request inside the engine.
///
/// Invariants: `tokens = prompt ++ output`; positions `0..num_computed` hold K/V in `table`'s
/// blocks (or, while swapped, in what the executor kept); `num_computed < tokens.len()` while
/// unfinished, since the last token is the one the next step runs. `fork_of` is `Some` only
/// while waiting with nothing computed, and names an unfinished request of the same prompt
/// that has no output yet and lists this one in its `forks`.
pub(crate) struct Sequence {
    pub id: RequestId,
    pub request: Request,
    pub status: Status,
    pub tokens: Vec<u32>,
    pub num_computed: usize,
    pub table: Option<BlockTable>,
    pub sampler: Sampler,
    /// Tokens sent to the caller so far (`output_len()` when finished).
    pub streamed: usize,
    /// Draft tokens for the next step (chapter 6's speculation); empty unless a decode.
    pub draft: Draft,
    /// Positions whose K/V the prefix cache supplied when it was last admitted.
    pub num_cached_tokens: usize,
    /// Rewrites the logits before each token is sampled (chapter 8's grammars and biases).
    pub processor: Option<Box<dyn LogitsProcessor>>,
    /// Another choice of this request's prompt, waiting to be forked from it (the OpenAI API's
    /// `n`): while `Some`, it is never admitted; when that request's prompt has been computed,
    /// it starts from a fork of its blocks.
    pub fork_of: Option<RequestId>,
    /// The choices waiting to fork from this one (empty once its prompt has been computed).
    pub forks: Vec<RequestId>,
}

impl Sequence {
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.request.prompt.len()..]
    }

    /// Tokens the next steps must run before this sequence has logits again.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Ends the sequence: its blocks go back to `manager`.
    pub fn finish(&mut self, manager: &mut BlockManager, reason: FinishReason) {
        if let Some(table) = self.table.take() {
            manager.free(table);
        }
        self.draft.clear();
        self.status = Status::Finished(reason);
    }

    /// Orders victims of preemption: lowest priority (largest value) first, then latest arrival.
    pub fn victim_key(&self) -> (i32, RequestId) {
        (self.request.priority, self.id)
    }

    /// Samples the next token from `row` (`[vocab]`) with the sequence's own sampler, after its
    /// logits processor, if any, rewrote a copy in `scratch`. The token, and whether the
    /// processor ends the request with it.
    pub fn sample(
        &mut self,
        row: &[f32],
        scratch: &mut Vec<f32>,
    ) -> Result<(u32, bool), SamplingError> {
        let prompt = &self.request.prompt;
        let output = &self.tokens[prompt.len()..];
        let Some(processor) = self.processor.as_deref_mut() else {
            return Ok((self.sampler.sample(row, prompt, output)?, false));
        };
        // ANCHOR: process
        scratch.clear();
        scratch.extend_from_slice(row);
        processor.process(output, scratch);
        let token = self.sampler.sample(scratch, prompt, output)?;
        let stop = processor.accept(token);
        // ANCHOR_END: process
        Ok((token, stop))
    }

    /// Appends `accepted` (sampled from `rows`, `[accepted.len(), vocab]`) through the stop
    /// checks in order: the first stop ends the request and drops the tokens after it.
    /// `first_logprobs`: the first token's logprobs if they were computed already.
    pub fn push_tokens(
        &mut self,
        accepted: &[u32],
        rows: ArrayView2<f32>,
        mut first_logprobs: Option<TokenLogprobs>,
        processor_stop: bool,
        max_len: usize,
    ) -> Pushed {
        let mut pushed = Pushed {
            tokens: 0,
            logprobs: Vec::new(),
            finish: None,
        };
        for (i, &token) in accepted.iter().enumerate() {
            if let Some(top) = self.request.logprobs {
                pushed
                    .logprobs
                    .push(first_logprobs.take().unwrap_or_else(|| {
                        let row = rows.row(i);
                        TokenLogprobs::of(row.as_slice().expect("contiguous rows"), token, top)
                    }));
            }
            self.tokens.push(token);
            pushed.tokens += 1;
            let generated = self.tokens.len() - self.request.prompt.len();
            pushed.finish = if processor_stop
                || !self.request.ignore_eos && self.request.stop_token_ids.contains(&token)
            {
                Some(FinishReason::Stop)
            } else if generated >= self.request.max_tokens || self.tokens.len() >= max_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            if pushed.finish.is_some() {
                break;
            }
        }
        pushed
    }
}

/// What [`Sequence::push_tokens`] appended.
pub(crate) struct Pushed {
    pub tokens: usize,
    /// One per token pushed, when the request asked for logprobs.
    pub logprobs: Vec<TokenLogprobs>,
    /// Why the last token pushed ended the request, if it did.
    pub finish: Option<FinishReason>,
}
