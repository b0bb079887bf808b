//! # Chapter 8 (first part): the OpenAI-compatible server
//!
//! Chapter 4's engine serves many requests at once, but only to a caller in the same process.
//! This crate puts it behind the HTTP API that OpenAI clients, and vLLM's users, expect:
//! `/v1/completions`, `/v1/chat/completions` (streamed with server-sent events or not),
//! `/v1/models`, `/health`, Prometheus `/metrics`, and `/dashboard`, the engine drawn live.
//!
//! ```text
//! HTTP handlers (tokio tasks)                      engine thread (one, owns the Engine)
//!   auth, read + validate JSON, rate limit           loop {
//!   tokenize (blocking pool), submit ───Command──▶     drain commands: add / abort
//!   receive token deltas ◀──────────Event─────────     step(); send each request its tokens
//!   detokenize, stop strings, logprobs, SSE          }
//!   client gone → guard dropped → Abort ──────────▶
//! ```
//!
//! | module            | what it does                                                       |
//! |-------------------|--------------------------------------------------------------------|
//! | [`connections`]   | the accept loop: connection limit, header and keep-alive timeouts   |
//! | [`access_log`]    | one record per request: method, path, status, key id, tokens, time  |
//! | [`auth`]          | API keys from `--api-key` / a file; the `Authorization` header      |
//! | [`rate_limit`]    | per-key (or per-address) requests and tokens per minute             |
//! | [`metrics`]       | histograms, gauges, counters; Prometheus text, named like vLLM's    |
//! | [`chat_template`] | the model's Jinja chat template, rendered with minijinja            |
//! | [`protocol`]      | OpenAI's request and response bodies                                |
//! | [`params`]        | a request's parameters, checked, as the engine's `Request`s          |
//! | [`error`]         | errors in OpenAI's JSON shape, with their status codes              |
//! | [`engine_thread`] | the engine on its own thread; the handlers' `EngineHandle`          |
//! | [`driver`]        | one request's generation: tokens → text, stop strings, latencies    |
//! | [`routes`]        | the endpoints; streaming (SSE) or whole responses                   |
//! | [`state`]         | what handlers share; admission (keys, rate limits, queue bounds)     |
//! | [`server`]        | start-up checks, the router, graceful shutdown                       |
//! | [`dashboard`]     | `/dashboard`: the engine's queues, block tables and steps, live      |
//! | [`structured`]    | constrained decoding (llguidance token masks), tool calls, biases   |
//! | [`cors`]          | `--allowed-origins`: CORS headers for browser clients (off by default) |

pub mod access_log;
pub mod auth;
pub mod chat_template;
pub mod connections;
pub mod cors;
pub mod dashboard;
pub mod driver;
pub mod engine_thread;
pub mod error;
pub mod metrics;
pub mod params;
pub mod prompt_pieces;
pub mod protocol;
pub mod rate_limit;
pub mod routes;
pub mod server;
pub mod state;
pub mod structured;
pub mod template_size;
pub mod tools;

pub use connections::ConnectionLimits;
pub use server::{
    ExecutorFactory, ServedModel, ServedWeights, Server, ServerConfig, ServerError,
    SpeculatorFactory,
};
