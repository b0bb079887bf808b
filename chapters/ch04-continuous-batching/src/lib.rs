//! # Chapter 4: continuous batching
//!
//! Chapters 2 and 3 serve one sequence at a time: every decode step reads all the weights to
//! produce one token. Reading them once for many sequences costs hardly more, so an engine
//! should run every active sequence in each step. This chapter's engine decides, **once per
//! step** (iteration-level scheduling, as Orca and vLLM do), which sequences run and how many
//! of their tokens, and lets requests join and leave between any two steps.
//!
//! The engine is two halves joined by plain data, as vLLM's is: a [`Scheduler`] that decides
//! and an [`Executor`] that computes.
//!
//! ```text
//! Scheduler ──schedule()──▶ SchedulerOutput ──▶ Executor::execute() ──▶ logit rows
//!     ▲                                                                      │
//!     └──────────────────────────── update() ◀───────────────────────────────┘
//! ```
//!
//! | module           | what it does                                                           |
//! |------------------|------------------------------------------------------------------------|
//! | [`request`]      | [`Request`], its [`Status`] (waiting, running, swapped, finished)       |
//! | [`scheduler`]    | [`Scheduler`]: admission, chunks, preemption; [`SchedulerOutput`]; sampling in `update` |
//! | [`executor`]     | the [`Executor`] seam and the [`KvLayout`] it reports                   |
//! | [`mod@cpu_executor`] | [`CpuExecutor`]: chapter 1's model and chapter 3's pool, one batched forward |
//! | [`attention`]    | the [`AttentionBackend`] seam; [`batch_attention`](attention::batch_attention), the whole step's attention in one parallel pass |
//! | [`engine`]       | [`Engine`]: a scheduler, an executor, and the step between them         |
//! | [`driver`]       | [`drive`]: the one loop that feeds an engine and hands out its outputs  |
//! | [`logprobs`]     | [`TokenLogprobs`]: a sampled token's log-probability and the top alternatives |
//! | `presample`      | the step's plain decodes sampled on several threads before `update` takes their tokens in order |
//! | [`processor`]    | the [`LogitsProcessor`] seam: a per-sequence mask or bias on the logits before sampling (chapter 8) |
//! | [`speculation`]  | the [`Speculator`] seam: drafts proposed, lookahead slots, verification (chapter 6) |
//! | [`decode_workload`] | the batch-32 decode step the attention examples time                |

pub mod attention;
pub mod cpu_executor;
pub mod decode_workload;
pub mod driver;
pub mod engine;
pub mod executor;
pub mod logprobs;
mod presample;
pub mod processor;
pub mod request;
pub mod scheduler;
pub mod speculation;

pub use attention::{AttentionBackend, BatchAttention};
pub use cpu_executor::{CacheConfig, CpuExecutor, SwapSpace, cpu_executor};
pub use driver::{EngineClient, drive};
pub use engine::{
    Completion, Counters, Engine, EngineConfig, EngineError, Preemption, RequestOutput, StepTrace,
};
pub use executor::{Executor, ExecutorError, KvLayout, ModelSpec};
pub use logprobs::TokenLogprobs;
pub use processor::LogitsProcessor;
pub use request::{FinishReason, Request, RequestId, Status};
pub use scheduler::{BlockOp, ScheduledSeq, Scheduler, SchedulerOutput, SeqView};
pub use speculation::{Draft, DraftSeq, Speculator};
