//! The HTTP endpoints. Completions and chat share one flow ([`serve_generation`]); they differ
//! only in how a prompt is made and how a delta is shaped ([`Shape`]).

pub mod chat;
pub mod completions;
pub mod info;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use crate::driver::{self, Delta};
use crate::error::ApiError;
use crate::params::{Generation, Planned};
use crate::protocol::Usage;
use crate::state::{Admitted, AppState};

/// Parses a JSON body into `T`, with OpenAI-shaped errors: 413 for a body over the limit, 400
/// for anything that is not the request's JSON (the message names the field at fault).
pub fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(format!("the request body is too large: {rejection}"))
        } else {
            ApiError::bad_request(format!("could not read the request body: {rejection}"))
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        let param = unknown_field(&e.to_string());
        ApiError {
            param,
            ..ApiError::bad_request(format!("invalid JSON body: {e}"))
        }
    })
}

/// A generation request past the checks every endpoint makes first.
pub struct Accepted<T> {
    /// When the request arrived: the start of its TTFT and end-to-end latency.
    pub started: Instant,
    /// The caller's identity, for rate limiting.
    pub key: String,
    pub request: T,
}

/// The API key, then the body, then the model it names (`model_of`), in that order, so that a
/// caller without a valid key learns nothing about the request.
pub fn accept<T: DeserializeOwned>(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    model_of: impl Fn(&T) -> &str,
) -> Result<Accepted<T>, ApiError> {
    let started = Instant::now();
    let key = state.authorize(headers)?;
    let request: T = parse_body(body)?;
    state.check_model(model_of(&request))?;
    Ok(Accepted {
        started,
        key,
        request,
    })
}

/// A handler's result as a response: the error's own status and JSON when it failed.
pub fn respond(result: Result<Response, ApiError>) -> Response {
    result.unwrap_or_else(IntoResponse::into_response)
}

/// The field serde names in "unknown field `x`".
fn unknown_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    Some(rest.split('`').next()?.to_string())
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// How one endpoint shapes its responses.
pub trait Shape: Send + Sync + 'static {
    /// Chunks sent before any token (chat: each choice's role).
    fn opening_chunks(&self, choices: usize) -> Vec<serde_json::Value>;
    /// One stream chunk for one delta.
    fn chunk(&self, delta: &Delta) -> serde_json::Value;
    /// The stream's last chunk when usage was asked for.
    fn usage_chunk(&self, usage: Usage) -> serde_json::Value;
    /// The whole response from every choice's deltas, in order.
    fn response(&self, choices: Vec<Vec<Delta>>, usage: Usage) -> serde_json::Value;
}

/// A request that passed its checks: what to generate and how to answer.
pub struct Job<S: Shape> {
    pub state: Arc<AppState>,
    pub started: Instant,
    pub planned: Planned,
    pub generation: Generation,
    pub echo: Option<Vec<String>>,
    pub shape: S,
    /// The caller's identity: the rate limit charges it the planned budget.
    pub key: String,
}

/// Admits the job and answers it: a stream of server-sent events, or one JSON response.
pub async fn serve_generation<S: Shape>(job: Job<S>) -> Result<Response, ApiError> {
    // Check the admission rules before spawning anything.
    let admitted = job.state.admit(&job.key, job.planned.budget())?;
    if job.generation.stream {
        Ok(stream_response(job, admitted))
    } else {
        collect_response(job, admitted).await
    }
}

/// The request's place in the server (`admitted`) is given back when the response is done,
/// however it ends: both functions below own it until then.
async fn collect_response<S: Shape>(job: Job<S>, admitted: Admitted) -> Result<Response, ApiError> {
    let _admitted = admitted;
    let mut deltas: Vec<Vec<Delta>> = vec![Vec::new(); job.planned.requests.len()];
    let usage = driver::generate(
        &job.state,
        job.started,
        job.planned,
        &job.generation,
        job.echo,
        std::future::pending(),
        |delta| {
            deltas[delta.choice].push(delta);
            true
        },
    )
    .await?;
    Ok(axum::Json(job.shape.response(deltas, usage)).into_response())
}

// ANCHOR: stream_response
fn stream_response<S: Shape>(job: Job<S>, admitted: Admitted) -> Response {
    let (events, receiver) = mpsc::unbounded_channel::<SseEvent>();
    tokio::spawn(async move {
        let _admitted = admitted;
        let json = |value: serde_json::Value| SseEvent::default().data(value.to_string());
        for chunk in job.shape.opening_chunks(job.planned.requests.len()) {
            let _ = events.send(json(chunk));
        }
        let result = driver::generate(
            &job.state,
            job.started,
            job.planned,
            &job.generation,
            job.echo,
            events.closed(),
            |delta| events.send(json(job.shape.chunk(&delta))).is_ok(),
        )
        .await;
        match result {
            Ok(usage) => {
                if job.generation.include_usage {
                    let _ = events.send(json(job.shape.usage_chunk(usage)));
                }
            }
            Err(error) => {
                let _ = events.send(SseEvent::default().data(error.to_json()));
            }
        }
        let _ = events.send(SseEvent::default().data("[DONE]"));
    });
    let body = stream::unfold(receiver, |mut receiver| async move {
        receiver
            .recv()
            .await
            .map(|event| (Ok::<_, Infallible>(event), receiver))
    });
    Sse::new(body)
        .keep_alive(KeepAlive::default())
        .into_response()
}
// ANCHOR_END: stream_response
