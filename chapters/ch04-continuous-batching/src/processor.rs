//! The [`LogitsProcessor`] seam: a per-sequence hook between the model's logits and the
//! sampler.
//!
//! Chapter 8 plugs in here what a request asks of its tokens beyond sampling parameters: a
//! grammar (structured outputs, tool calls) as a token mask, `logit_bias`, `allowed_token_ids`,
//! `bad_words`, `min_tokens`. Each sequence owns its processor, so its state (a grammar's parse
//! so far) lives and dies with the sequence, and survives preemption: recomputed K/V give the
//! same tokens, and the processor has already seen them.
//!
//! ```text
//! update(step):  prepare()   every processor of the step's sampling sequences, in parallel
//!                per sequence, in order:
//!                  row     = its logits, copied          (the executor's rows stay as they are)
//!                  process(row)                          mask / bias the copy
//!                  token   = sampler.sample(row)
//!                  accept(token) → true ends it ("stop")
//! ```
//!
//! A processor never fails the engine: one that cannot go on (a grammar in an error state)
//! ends its own sequence, and says why in its own way to whoever built it.
//! A sequence with a processor is never speculated on: drafts would have to be checked
//! against its state token by token.

// ANCHOR: processor
/// A per-sequence rewrite of the logits before each token is sampled, and a look at the token
/// sampled. `Send`: sequences are created on one thread and stepped on the engine's.
pub trait LogitsProcessor: Send {
    /// Gets ready for the next token: the expensive part (a grammar's token mask), run for all
    /// the step's sampling sequences in parallel, before any of them samples.
    fn prepare(&mut self) {}

    /// Rewrites `logits: [vocab]` for the next token; `output` is the sequence's output so
    /// far. A token set to `-inf` is never sampled.
    fn process(&mut self, output: &[u32], logits: &mut [f32]);

    /// The token sampled from the processed logits. True ends the sequence with `stop` (the
    /// grammar is complete, or cannot go on).
    fn accept(&mut self, token: u32) -> bool;
}
// ANCHOR_END: processor
