//! The [`Speculator`] seam: draft tokens proposed before a step, verified from its logit rows
//! after it. This chapter's engine only reserves room for them and keeps what was accepted;
//! chapter 6 plugs in the drafters (n-gram lookup, a draft model, layer skipping) and the
//! verification rule (greedy matching, modified rejection sampling).
//!
//! ```text
//! before schedule():  propose(running decodes) → Draft per sequence: up to k tokens (and,
//!                     when the drafter sampled them, its distribution q for each)
//! schedule():         a decode runs [last token, d1 .. dk]: k + 1 positions reserved (the
//!                     lookahead slots), k + 1 logit rows; the drafts are cut to the budget
//!                     and dropped rather than preempt anyone
//! update():           verify(k + 1 rows, drafts) → a accepted drafts + 1 token of the target;
//!                     tokens appended one by one through the stop checks; the K/V of the
//!                     k − a rejected positions rolled back (blocks past the end freed)
//! ```
//!
//! Invariants: a draft exists only for a running sequence with exactly one pending token (a
//! decode); it never makes the sequence exceed `max_tokens` or the model's context; a
//! sequence's KV positions always hold the K/V of its own tokens (rejected drafts' positions
//! are past `num_computed`, never read, overwritten by the next step).

use ch01::Sampler;
use ch01::SamplingParams;
use ch01::sampler::SamplingError;
use ndarray::ArrayView2;

use crate::executor::ExecutorError;
use crate::request::RequestId;

/// What a drafter sees of one running decode sequence.
#[derive(Debug, Clone, Copy)]
pub struct DraftSeq<'a> {
    pub id: RequestId,
    /// Prompt then output so far; the last token is the one the next step runs.
    pub tokens: &'a [u32],
    pub prompt_len: usize,
    pub params: &'a SamplingParams,
    /// Most drafts worth proposing: `min(k, tokens left to max_tokens − 1, room left in the
    /// context − 1)`, at least 1.
    pub max_drafts: usize,
}

/// Draft tokens for one sequence, with the distributions they were drawn from.
///
/// Invariant: `probs` is empty (every token proposed with certainty, q = one-hot: n-gram
/// lookup, greedy drafting) or `[tokens.len(), vocab]`, row `i` the distribution `tokens[i]`
/// was sampled from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub probs: Vec<f32>,
}

impl Draft {
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.probs.clear();
    }

    /// Keeps the first `n` drafts (and their rows).
    pub fn truncate(&mut self, n: usize) {
        if n < self.tokens.len() && !self.probs.is_empty() {
            let vocab = self.probs.len() / self.tokens.len();
            self.probs.truncate(n * vocab);
        }
        self.tokens.truncate(n);
    }
}

// ANCHOR: speculator
/// Proposes draft tokens and verifies them: speculative decoding, plugged into the engine with
/// [`Engine::with_speculator`](crate::Engine::with_speculator).
pub trait Speculator: Send {
    /// Most drafts per sequence and step (k).
    fn num_speculative_tokens(&self) -> usize;

    /// Speculation pauses in steps where more sequences than this are running (`None`: never).
    fn disable_by_batch_size(&self) -> Option<usize>;

    /// Fills `drafts[i]` (cleared by the caller) with at most `seqs[i].max_drafts` tokens for
    /// `seqs[i]`; an empty draft is always allowed.
    fn propose(&mut self, seqs: &[DraftSeq], drafts: &mut [Draft]) -> Result<(), ExecutorError>;

    /// Appends to `accepted` the tokens one verification step yields: the accepted prefix of
    /// `draft` (a tokens), then one token of the target (a correction, or a bonus when all
    /// were accepted). `rows` `[draft.tokens.len() + 1, vocab]`: row `i` the target's logits
    /// after `draft.tokens[..i]`. `output` is the sequence's output before this step; the
    /// request's `sampler` supplies the target's distribution and the randomness.
    fn verify(
        &mut self,
        sampler: &mut Sampler,
        rows: ArrayView2<f32>,
        prompt: &[u32],
        output: &[u32],
        draft: &Draft,
        accepted: &mut Vec<u32>,
    ) -> Result<(), SamplingError>;

    /// Request `id` ended: drop whatever is kept for it.
    fn release(&mut self, id: RequestId);
}
// ANCHOR_END: speculator
