//! # Chapter 4: continuous batching
//!
//! Chapters 2 and 3 serve one sequence at a time: every decode step reads all the weights to
//! produce one token. Reading them once for many sequences costs hardly more, so an engine
//! should run every active sequence in each step. This chapter's engine decides, **once per
//! step** (iteration-level scheduling, as Orca and vLLM do), which sequences run and how many
//! of their tokens, and lets requests join and leave between any two steps.
//!
//! | module        | what it does                                                              |
//! |---------------|---------------------------------------------------------------------------|
//! | [`request`]   | [`Request`], its [`Status`] (waiting, running, swapped, finished)          |
//! | [`attention`] | [`batch_attention`](attention::batch_attention): the whole step's attention in one parallel pass |
//! | [`engine`]    | [`Engine`]: the scheduler and the step loop; preemption; counters          |
//! | [`logprobs`]  | [`TokenLogprobs`]: a sampled token's log-probability and the top alternatives |
//! | [`runner`]    | [`ModelRunner`]: one forward over a flattened batch of prefill chunks and decodes |
//! | [`static_batch`] | [`StaticBatcher`](static_batch::StaticBatcher): static batching, only the benchmark's baseline |

pub mod attention;
pub mod engine;
pub mod logprobs;
pub mod request;
pub mod runner;
pub mod static_batch;

pub use engine::{
    Completion, Counters, Engine, EngineConfig, EngineError, Preemption, RequestOutput, StepTrace,
};
pub use logprobs::TokenLogprobs;
pub use request::{FinishReason, Request, RequestId, Status};
pub use runner::{ModelRunner, ScheduledBatch, ScheduledSeq};
