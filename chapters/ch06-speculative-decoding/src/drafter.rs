//! The [`Drafter`] seam: what proposes draft tokens. This chapter's drafters: n-gram lookup in
//! the sequence's own tokens ([`NgramDrafter`](crate::NgramDrafter)), a smaller model with its
//! own paged KV cache, and the target's first layers
//! ([`ModelDrafter`](crate::ModelDrafter)); the tests add an adversary and an oracle
//! ([`testing`](crate::testing)).
//!
//! A drafter is consulted once per engine step for every running decode, all at once, so a
//! draft model can batch them as the target does. It may keep state per request (a draft
//! model's K/V); [`Drafter::release`] says when a request has ended.

use ch04::{Draft, DraftSeq, ExecutorError, RequestId};

/// Why a drafter could not propose.
#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    /// The draft model's executor failed.
    #[error("draft model: {0}")]
    Executor(#[from] ExecutorError),
    #[error("drafter: {0}")]
    Config(String),
}

// ANCHOR: drafter
/// Proposes draft tokens for sequences that are decoding.
pub trait Drafter: Send {
    /// Fills `drafts[i]` (empty on entry) with at most `seqs[i].max_drafts` tokens that are
    /// likely to follow `seqs[i].tokens`. A drafter that samples writes, for each token, the
    /// distribution it drew it from into `drafts[i].probs` (`[tokens, vocab]`); one that
    /// proposes with certainty leaves `probs` empty. Proposing nothing is always allowed.
    fn propose(&mut self, seqs: &[DraftSeq], drafts: &mut [Draft]) -> Result<(), DraftError>;

    /// Request `id` ended: drop whatever is kept for it.
    fn release(&mut self, _id: RequestId) {}
}
// ANCHOR_END: drafter

/// A borrowed drafter drafts as the drafter does (so a test can inspect it afterwards).
impl<D: Drafter + ?Sized> Drafter for &mut D {
    fn propose(&mut self, seqs: &[DraftSeq], drafts: &mut [Draft]) -> Result<(), DraftError> {
        (**self).propose(seqs, drafts)
    }

    fn release(&mut self, id: RequestId) {
        (**self).release(id);
    }
}

/// A drafter chosen at run time (`--speculative-method`).
impl<D: Drafter + ?Sized> Drafter for Box<D> {
    fn propose(&mut self, seqs: &[DraftSeq], drafts: &mut [Draft]) -> Result<(), DraftError> {
        (**self).propose(seqs, drafts)
    }

    fn release(&mut self, id: RequestId) {
        (**self).release(id);
    }
}
