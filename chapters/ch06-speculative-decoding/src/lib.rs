//! # Chapter 6: speculative decoding
//!
//! A decode step reads every weight of the model to produce one token per sequence: at batch
//! size 1 the step is bound by memory bandwidth, and the arithmetic units mostly wait. Running
//! k + 1 tokens through the same step costs hardly more than one. Speculative decoding spends
//! that slack: a cheap **drafter** guesses the next k tokens, the **target** scores the last
//! token and the k guesses in one forward, and **verification** keeps the longest prefix the
//! target agrees with, plus one token of the target's own. The output is exactly what the
//! target alone produces (greedy), or distributed exactly as it (sampling, by modified
//! rejection sampling); only the number of target forwards per token changes.
//!
//! ```text
//! engine step:  propose   drafter: up to k drafts per running decode      (this chapter)
//!               schedule  [last, d1 .. dk] in k + 1 lookahead slots        (chapter 4's seam)
//!               execute   one batched forward, k + 1 logit rows per decode
//!               update    verify: a accepted + 1 emitted; K/V of the rest rolled back
//! ```
//!
//! | module           | what it does                                                          |
//! |------------------|-----------------------------------------------------------------------|
//! | [`drafter`]      | the [`Drafter`] seam                                                   |
//! | [`mod@verify`]   | greedy verification and modified rejection sampling, proven by enumeration |
//! | [`speculative`]  | [`SpeculativeDecoding`]: a drafter and the verifier as chapter 4's [`Speculator`](ch04::Speculator) |
//! | [`ngram`]        | [`NgramDrafter`]: prompt lookup, no model                              |
//! | [`draft_model`]  | [`ModelDrafter`]: a draft model, or the target's first layers, on its own paged cache |
//! | [`testing`]      | an adversarial and an oracle drafter                                   |

pub mod draft_model;
pub mod drafter;
pub mod ngram;
pub mod speculative;
pub mod testing;
pub mod verify;

pub use draft_model::{
    DEFAULT_CATCH_UP_BUDGET, ModelDrafter, draft_executor, layer_skip_config, layer_skip_executor,
};
pub use drafter::{DraftError, Drafter};
pub use ngram::{NgramDrafter, ngram_lookup};
pub use speculative::{SpecConfig, SpeculativeDecoding};
pub use verify::{accept_probability, speculative_step, verify};
