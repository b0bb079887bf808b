//! What every handler shares: the engine's handle, the tokenizer and template, the metrics,
//! and the admission rules (keys, rate limits, the queue limit).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use ch01::Tokenizer;

use crate::auth::ApiKeys;
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
    pub served_model_name: String,
    pub limits: Limits,
    /// Most requests in the server at once (running or queued); `None`: no limit.
    pub max_in_flight: Option<usize>,
    pub in_flight: AtomicUsize,
    /// Seeds requests that name none: `seed + request number`, so a server started with the
    /// same `--seed` answers the same requests in the same order the same way.
    pub seed: u64,
    pub next_request: AtomicU64,
    /// Unix time the server started (`created` of the model card).
    pub created: u64,
    pub shutting_down: AtomicBool,
}

/// A request admitted into the server; dropping it gives its place back.
pub struct Admitted {
    state: Arc<AppState>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::SeqCst);
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

    // ANCHOR: admit
    /// Admits a request of `tokens` (prompt + max_tokens, every choice) from `key`, or refuses
    /// it with 429 (rate limit or full queue) or 503 (shutting down).
    pub fn admit(self: &Arc<Self>, key: &str, tokens: u64) -> Result<Admitted, ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        // Take a place first, so that a request refused for a full queue is not charged to
        // the key's rate limit.
        let in_flight = self.in_flight.fetch_add(1, Ordering::SeqCst);
        let admitted = Admitted {
            state: Arc::clone(self),
        };
        if let Some(max) = self.max_in_flight
            && in_flight >= max
        {
            return Err(ApiError::too_many(
                format!("the server's queue is full ({max} requests): retry shortly"),
                Duration::from_secs(1),
            ));
        }
        if let Some(limiter) = &self.rate_limiter {
            match limiter.check(key, tokens, Instant::now()) {
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
                Err(too_large @ RateLimited::TooLarge { .. }) => {
                    // Waiting cannot help: no Retry-After.
                    return Err(ApiError {
                        retry_after: None,
                        ..ApiError::too_many(too_large.to_string(), Duration::ZERO)
                    });
                }
            }
        }
        Ok(admitted)
    }
    // ANCHOR_END: admit

    /// The model name a request must name.
    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.served_model_name {
            Ok(())
        } else {
            Err(ApiError {
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
