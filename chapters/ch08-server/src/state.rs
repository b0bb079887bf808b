//! What every handler shares: the engine's handle, the tokenizer and template, the metrics,
//! and the admission rules (keys, rate limits, the queue limit, the prompt tokens and request
//! bodies held at once).

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use ch01::Tokenizer;
use tokio::sync::Semaphore;

use crate::auth::{ANONYMOUS, ApiKeys};
use crate::chat_template::ChatTemplate;
use crate::engine_thread::EngineHandle;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::params::Limits;
use crate::rate_limit::{RateLimited, RateLimiter};

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub metrics: Arc<Metrics>,
    pub keys: ApiKeys,
    pub rate_limiter: Option<RateLimiter>,
    /// Failed authentications per client address: past the limit, a client's requests are
    /// refused (429) before its key is even looked at, so keys cannot be guessed at speed.
    pub auth_failures: RateLimiter,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// How long a request's body may take to arrive once its headers are in (408 beyond).
    pub body_read_timeout: Duration,
    pub served_model_name: String,
    pub limits: Limits,
    /// Most engine sequences in the server at once (running or queued; a request of `p`
    /// prompts and `n` choices is `p × n`); `None`: no limit.
    pub max_in_flight: Option<usize>,
    /// Engine sequences admitted and not yet finished.
    pub in_flight: AtomicUsize,
    /// Most prompt tokens the server holds for the sequences in it at once, every choice's
    /// prompt counted (each holds a copy; [`Planned::held_tokens`](crate::params::Planned::held_tokens));
    /// `None`: no limit. Without it, waiting sequences grew memory without bound: 60 requests
    /// of 64 prompts of 8,000 token ids × 16 choices took a server from 1.2 GB to 5.3 GB.
    pub max_prompt_tokens_in_flight: Option<u64>,
    /// Prompt tokens held for the sequences admitted and not yet finished.
    pub prompt_tokens_in_flight: AtomicU64,
    /// Bytes of request bodies being read or parsed, server-wide, as permits: a body that
    /// would pass them is refused (503, retry) rather than buffered. Without it, 480 bodies of
    /// 8 MiB, each answered 400, took a server from 1.2 GB to 5.9 GB at once.
    pub body_bytes: Arc<Semaphore>,
    /// Large bodies are parsed on tokio's blocking threads one at a time, apart from
    /// [`AppState::tokenizing`]: a flood of them delays other large bodies, not every
    /// request's tokenization (a request of a few tokens waited 19 s behind such a flood).
    pub parsing: Arc<Semaphore>,
    /// Tokenizing and template rendering run on tokio's blocking threads, this many at once,
    /// so that no HTTP worker thread ever tokenizes.
    pub tokenizing: Arc<Semaphore>,
    /// Events a stream holds for a client that reads slower than the engine writes; a client
    /// that falls this far behind has its request aborted, as if it had gone.
    pub stream_buffer: usize,
    /// Seeds requests that name none: `seed + request number`, so a server started with the
    /// same `--seed` answers the same requests in the same order the same way.
    pub seed: u64,
    pub next_request: AtomicU64,
    /// Unix time the server started (`created` of the model card).
    pub created: u64,
    pub shutting_down: AtomicBool,
    /// The grammar engine for structured outputs, built on the first request that needs it.
    pub grammars: std::sync::OnceLock<Result<crate::structured::Grammars, String>>,
    /// The tokenizer that decodes `auto` tool calls' tags ([`crate::tools::tag_decoder`];
    /// `None`: the server's does), built on the first request that needs it.
    pub tag_decoder: std::sync::OnceLock<Result<Option<Arc<Tokenizer>>, String>>,
}

/// The tokens a request counts for at admission.
#[derive(Debug, Clone, Copy)]
pub struct RequestTokens {
    /// What the key's tokens per minute are charged: every prompt once, every choice's
    /// max_tokens ([`Planned::budget`](crate::params::Planned::budget)).
    pub charged: u64,
    /// What the server holds while the request is in it: every choice's prompt
    /// ([`Planned::held_tokens`](crate::params::Planned::held_tokens)).
    pub held: u64,
}

/// A request admitted into the server; dropping it gives its sequences' places and tokens
/// back.
pub struct Admitted {
    state: Arc<AppState>,
    sequences: usize,
    held_tokens: u64,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.state
            .in_flight
            .fetch_sub(self.sequences, Ordering::SeqCst);
        self.state
            .prompt_tokens_in_flight
            .fetch_sub(self.held_tokens, Ordering::SeqCst);
    }
}

impl AppState {
    /// Checks the API key; returns the caller's identity (for rate limiting).
    pub fn authorize(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        let header = match headers.get(AUTHORIZATION) {
            None => None,
            Some(value) => Some(
                value
                    .to_str()
                    .map_err(|_| ApiError::unauthorized("the Authorization header is not text"))?,
            ),
        };
        self.keys
            .check(header)
            .map_err(|e| ApiError::unauthorized(e.to_string()))
    }

    // ANCHOR: authorize_client
    /// [`AppState::authorize`], for a client at `client`: refused with 429 while the client
    /// is over its failed-authentication limit (whatever key it sends now), and a failure is
    /// charged to it.
    pub fn authorize_client(
        &self,
        headers: &HeaderMap,
        client: Option<IpAddr>,
    ) -> Result<String, ApiError> {
        if self.keys.is_open() {
            return Ok(ANONYMOUS.to_string());
        }
        let who = client.map_or_else(|| "unknown".to_string(), |ip| ip.to_string());
        let now = Instant::now();
        if let Err(RateLimited::Wait(wait)) = self.auth_failures.peek(&who, now) {
            return Err(ApiError::too_many(
                format!(
                    "too many failed authentications from this address: retry in {:.0} s",
                    wait.as_secs_f64().ceil()
                ),
                wait,
            ));
        }
        self.authorize(headers).inspect_err(|_| {
            let _ = self.auth_failures.check(&who, 0, now);
        })
    }
    // ANCHOR_END: authorize_client

    /// Whom the rate limit charges: the key's identity, or on an open server (where every
    /// caller is `anonymous`) the client's address, so that one client cannot spend everyone's
    /// allowance.
    pub fn limiter_key(&self, key: String, client: Option<IpAddr>) -> String {
        match client {
            Some(ip) if self.keys.is_open() => format!("client {ip}"),
            _ => key,
        }
    }

    // ANCHOR: admit
    /// Admits a request of `sequences` engine sequences (prompts × n), charged `tokens.charged`
    /// (every prompt once, every choice's max_tokens) and holding `tokens.held` (every choice's
    /// prompt), from `key`, or refuses it with 429 (rate limit, full queue, too many prompt
    /// tokens held) or 503 (shutting down). Both the queue and the requests-per-minute limit
    /// count sequences, not HTTP requests: one request of 64 prompts × 16 choices is 1,024.
    pub fn admit(
        self: &Arc<Self>,
        key: &str,
        sequences: usize,
        tokens: RequestTokens,
    ) -> Result<Admitted, ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        // A request no wait can admit is told so first, without Retry-After.
        let never = |message: String| ApiError {
            retry_after: None,
            ..ApiError::too_many(message, Duration::ZERO)
        };
        if let Some(max) = self.max_in_flight
            && sequences > max
        {
            return Err(never(format!(
                "the request is {sequences} sequences (prompts × n), more than the server's \
                 queue of {max}"
            )));
        }
        if let Some(max) = self.max_prompt_tokens_in_flight
            && tokens.held > max
        {
            return Err(never(format!(
                "the request holds {} prompt tokens (every choice's prompt), more than the \
                 server's {max}",
                tokens.held
            )));
        }
        if let Some(limiter) = &self.rate_limiter
            && let Err(too_large) = limiter.never(sequences as u64, tokens.charged)
        {
            return Err(never(too_large.to_string()));
        }
        // Take the places first, so that a request refused for a full queue is not charged
        // to the key's rate limit.
        let in_flight = self.in_flight.fetch_add(sequences, Ordering::SeqCst);
        let prompt_tokens_in_flight =
            (self.prompt_tokens_in_flight).fetch_add(tokens.held, Ordering::SeqCst);
        let admitted = Admitted {
            state: Arc::clone(self),
            sequences,
            held_tokens: tokens.held,
        };
        if let Some(max) = self.max_in_flight
            && in_flight + sequences > max
        {
            return Err(ApiError::too_many(
                format!("the server's queue is full ({max} sequences): retry shortly"),
                Duration::from_secs(1),
            ));
        }
        if let Some(max) = self.max_prompt_tokens_in_flight
            && prompt_tokens_in_flight.saturating_add(tokens.held) > max
        {
            return Err(ApiError::too_many(
                format!(
                    "the server holds its most prompt tokens ({max}) for other requests: retry \
                     shortly"
                ),
                Duration::from_secs(1),
            ));
        }
        if let Some(limiter) = &self.rate_limiter {
            match limiter.check_many(key, sequences as u64, tokens.charged, Instant::now()) {
                Ok(()) => {}
                Err(RateLimited::Wait(wait)) => {
                    return Err(ApiError::too_many(
                        format!(
                            "rate limit reached for this API key: retry in {:.1} s",
                            wait.as_secs_f64()
                        ),
                        wait,
                    ));
                }
                Err(
                    too_large @ (RateLimited::TooLarge { .. }
                    | RateLimited::TooManySequences { .. }),
                ) => {
                    // Checked above, with the other refusals no wait can lift.
                    return Err(never(too_large.to_string()));
                }
            }
        }
        Ok(admitted)
    }
    // ANCHOR_END: admit

    /// Runs `work` (tokenizing, rendering a template) on tokio's blocking threads, at most
    /// [`AppState::tokenizing`]'s permits at once; a caller waits its turn without holding an
    /// HTTP worker thread. The permit travels with the work: a client that goes away frees
    /// its HTTP task, but the blocking work it started runs to the end, and still counts.
    pub async fn off_runtime<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        Self::off_runtime_on(&self.tokenizing, work).await
    }

    /// [`AppState::off_runtime`] under another semaphore's permits.
    pub async fn off_runtime_on<T: Send + 'static>(
        semaphore: &Arc<Semaphore>,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = Arc::clone(semaphore)
            .acquire_owned()
            .await
            .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))
    }

    /// The model name a request must name; another is 404, as OpenAI and vLLM answer.
    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.served_model_name {
            Ok(())
        } else {
            Err(ApiError {
                status: axum::http::StatusCode::NOT_FOUND,
                code: Some("model_not_found"),
                ..ApiError::bad_param(
                    "model",
                    format!(
                        "The model `{model}` does not exist. This server serves `{}`.",
                        self.served_model_name
                    ),
                )
            })
        }
    }

    /// A new request's number (its id, `cmpl-N`) and the seed it gets if it names none.
    pub fn number_request(&self) -> (u64, u64) {
        let number = self.next_request.fetch_add(1, Ordering::SeqCst);
        (
            number,
            self.seed
                .wrapping_add(number.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        )
    }
}
