//! The HTTP endpoints. Completions and chat share one flow ([`serve_generation`]); they differ
//! only in how a prompt is made and how a delta is shaped ([`Shape`]).

pub mod chat;
pub mod completions;
pub mod info;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use std::net::{IpAddr, SocketAddr};

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{Extensions, HeaderMap};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::{StreamExt, stream};
use serde::de::DeserializeOwned;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use crate::access_log::AccessNote;
use crate::driver::{self, Delta};
use crate::error::ApiError;
use crate::params::{Generation, Planned};
use crate::protocol::Usage;
use crate::state::{Admitted, AppState, RequestTokens};

/// Parses a JSON body into `T`, with OpenAI-shaped errors: 400 for anything that is not the
/// request's JSON (the message names the field at fault).
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        let param = unknown_field(&e.to_string());
        ApiError {
            param,
            ..ApiError::bad_request(format!("invalid JSON body: {e}"))
        }
    })
}

/// Bodies up to this size are parsed on the HTTP worker (a fraction of a millisecond); larger
/// ones on the blocking pool.
const PARSE_ON_RUNTIME_BYTES: usize = 64 << 10;

/// The bytes of every body that [`AppState::body_bytes`] does not count: a request of this size
/// is never refused for the large bodies others send (and the connection limit bounds what
/// these hold together: 512 × 64 KiB = 32 MiB). While a buffer grows it briefly holds its old
/// bytes beside the new ones, up to 1.5 times its charge.
pub const FREE_BODY_BYTES: usize = PARSE_ON_RUNTIME_BYTES;

/// A generation request past the checks every endpoint makes first.
pub struct Accepted<T> {
    /// When the request arrived: the start of its TTFT and end-to-end latency.
    pub started: Instant,
    /// Who the rate limit charges: the key's identity, or the client's address on an open
    /// server.
    pub key: String,
    pub request: T,
    pub note: AccessNote,
}

/// The client's address, as the accept loop recorded it.
pub fn client_of(extensions: &Extensions) -> Option<IpAddr> {
    extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip())
}

// ANCHOR: accept
/// The API key, then the content type, then the body (read under the size limit and the
/// body-read timeout), then the model it names (`model_of`), in that order: a caller without
/// a valid key learns nothing about the request and cannot make the server read its body.
pub async fn accept<T: DeserializeOwned + Send + 'static>(
    state: &AppState,
    request: Request,
    model_of: impl Fn(&T) -> &str,
) -> Result<Accepted<T>, ApiError> {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let client = client_of(&parts.extensions);
    let note = parts
        .extensions
        .get::<AccessNote>()
        .cloned()
        .unwrap_or_default();
    let key = state.authorize_client(&parts.headers, client)?;
    note.key_id(&key);
    require_json(&parts.headers)?;
    let (bytes, held) = read_body(state, &parts.headers, body).await?;
    // Parsing is linear in the body, up to the 8 MiB limit: a large body is parsed off the
    // HTTP worker threads too, one at a time. The body's bytes are held until it is parsed.
    let request: T = if bytes.len() > PARSE_ON_RUNTIME_BYTES {
        let parse = move || {
            let parsed = parse_body(&bytes);
            drop(held);
            parsed
        };
        AppState::off_runtime_on(&state.parsing, parse).await??
    } else {
        let parsed = parse_body(&bytes);
        drop(held);
        parsed?
    };
    state.check_model(model_of(&request))?;
    Ok(Accepted {
        started,
        key: state.limiter_key(key, client),
        request,
        note,
    })
}
// ANCHOR_END: accept

/// 415 unless the body is declared `application/json` (parameters allowed, but a `charset`
/// only if it names UTF-8, which is how the body is read): a browser may send a cross-site
/// `text/plain` POST without asking, never a JSON one.
fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let header = headers.get(CONTENT_TYPE);
    if header.is_some_and(|v| v.to_str().is_err()) {
        return Err(ApiError::unsupported_media_type(
            "the Content-Type header must be visible ASCII text",
        ));
    }
    let value = header.and_then(|v| v.to_str().ok());
    let mut parts = value.map(|v| v.split(';').map(str::trim));
    let declared = parts.as_mut().and_then(Iterator::next);
    let charset = (parts.into_iter().flatten())
        .filter_map(|p| p.split_once('='))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("charset"))
        .map(|(_, set)| set.trim().trim_matches('"'));
    let utf8 = |set: &str| {
        ["utf-8", "utf8", "unicode-1-1-utf-8"]
            .iter()
            .any(|name| set.eq_ignore_ascii_case(name))
    };
    match declared {
        Some(kind) if kind.eq_ignore_ascii_case("application/json") => match charset {
            Some(set) if !utf8(set) => Err(ApiError::unsupported_media_type(format!(
                "the request body must be UTF-8 JSON, not charset {set:?}"
            ))),
            _ => Ok(()),
        },
        other => Err(ApiError::unsupported_media_type(format!(
            "the request body must be JSON with Content-Type: application/json, not {}",
            other.map_or("none".to_string(), |k| format!("{k:?}"))
        ))),
    }
}

/// The body, at most `max_body_bytes` (413 beyond, from `Content-Length` before anything is
/// read), within the body-read timeout (408), and the permits of [`AppState::body_bytes`] it
/// holds: one a byte of the body's buffer beyond its first [`FREE_BODY_BYTES`], taken as the
/// buffer grows (503 with `Retry-After: 1` when the server holds too many large bodies
/// already). A body announced and never sent holds nothing. The caller keeps the permits until
/// it has parsed the body.
async fn read_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Bytes, OwnedSemaphorePermit), ApiError> {
    let limit = state.max_body_bytes;
    let too_large = || {
        ApiError::payload_too_large(format!(
            "the request body is too large: more than {limit} bytes"
        ))
    };
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(too_large());
    }
    let declared = declared.map(|length| length as usize); // within the limit
    let reserve = |bytes: usize| {
        let bytes = u32::try_from(bytes).unwrap_or(u32::MAX);
        Arc::clone(&state.body_bytes)
            .try_acquire_many_owned(bytes)
            .map_err(|_| ApiError {
                retry_after: Some(Duration::from_secs(1)),
                close_connection: true,
                ..ApiError::unavailable(
                    "the server is reading too many large request bodies at once: retry shortly",
                )
            })
    };
    let read = async {
        let mut held = reserve(0)?;
        let mut chunks = body.into_data_stream();
        let mut bytes = Vec::with_capacity(declared.unwrap_or(0).min(FREE_BODY_BYTES));
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::bad_request(format!("could not read the request body: {e}"))
            })?;
            let len = bytes.len() + chunk.len();
            if len > limit {
                return Err(too_large());
            }
            if len > bytes.capacity() {
                // The buffer grows by doubling, as a Vec would, to no more than the declared
                // length, the limit, or (while the body is within them) the free bytes, and is
                // charged for all of it beyond the free bytes.
                let mut capacity = len.max(bytes.capacity().saturating_mul(2));
                if len <= FREE_BODY_BYTES {
                    capacity = capacity.min(FREE_BODY_BYTES);
                }
                let capacity = capacity.min(declared.unwrap_or(limit)).min(limit).max(len);
                let charge = capacity.saturating_sub(FREE_BODY_BYTES);
                if charge > held.num_permits() {
                    held.merge(reserve(charge - held.num_permits())?);
                }
                bytes.reserve_exact(capacity - bytes.len());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok((Bytes::from(bytes), held))
    };
    tokio::time::timeout(state.body_read_timeout, read)
        .await
        .map_err(|_| {
            ApiError::request_timeout(format!(
                "the request body did not arrive within {:.1} s",
                state.body_read_timeout.as_secs_f64()
            ))
        })?
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

/// How one endpoint shapes its responses, as JSON text (serialised from the typed bodies of
/// [`crate::protocol`], so fields and logprob alternatives keep their written order).
pub trait Shape: Send + Sync + 'static {
    /// Chunks sent before any token (chat: each choice's role).
    fn opening_chunks(&self, choices: usize) -> Vec<String>;
    /// One stream chunk for one delta.
    fn chunk(&self, delta: &Delta) -> String;
    /// The stream's last chunk when usage was asked for.
    fn usage_chunk(&self, usage: Usage) -> String;
    /// The whole response from every choice's deltas, in order.
    fn response(&self, choices: Vec<Vec<Delta>>, usage: Usage) -> String;
}

/// A stream chunk's `usage` before the last chunk: `null` when usage was asked for (OpenAI's
/// shape, so a client can tell "not yet" from "not asked"), absent otherwise.
pub fn chunk_usage(include_usage: bool) -> Option<Option<Usage>> {
    include_usage.then_some(None)
}

/// A typed body as JSON text.
pub fn to_json(body: &impl serde::Serialize) -> String {
    serde_json::to_string(body).expect("response bodies serialise")
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
    /// The access log's note: the usage goes there when the generation ends.
    pub note: AccessNote,
}

/// Admits the job and answers it: a stream of server-sent events, or one JSON response.
// ANCHOR: compile_rules
/// Compiles the request's output constraint and tokenizes its `bad_words`, off the async
/// runtime (a schema compiles in a few milliseconds, the first one also builds the grammar
/// engine's token trie).
pub async fn compile_rules(
    state: &Arc<AppState>,
    generation: &mut Generation,
) -> Result<(), ApiError> {
    let constraint = generation.constraint.take();
    let bad_words = std::mem::take(&mut generation.bad_words);
    if constraint.is_none() && bad_words.is_empty() {
        return Ok(());
    }
    let shared = Arc::clone(state);
    let (grammar, words) = state
        .off_runtime(move || -> Result<_, ApiError> {
            let grammar = match constraint {
                Some((constraint, param)) => {
                    let limits = &shared.limits;
                    let grammars = crate::structured::grammars(
                        &shared.grammars,
                        &shared.tokenizer,
                        limits.vocab_size,
                        &limits.eos_token_ids,
                    )?;
                    Some(Arc::new(grammars.compile(&constraint, param)?))
                }
                None => None,
            };
            let mut words = Vec::new();
            for word in &bad_words {
                // As vLLM: the word alone, and after a space (as it appears mid-text).
                for text in [word.clone(), format!(" {word}")] {
                    let ids = shared.tokenizer.encode(&text, false).map_err(|e| {
                        ApiError::bad_param("bad_words", format!("cannot tokenize: {e}"))
                    })?;
                    if !ids.is_empty() && !words.contains(&ids) {
                        words.push(ids);
                    }
                }
            }
            Ok((grammar, words))
        })
        .await??;
    generation.grammar = grammar;
    generation.rules.bad_words = words;
    Ok(())
}
// ANCHOR_END: compile_rules

pub async fn serve_generation<S: Shape>(mut job: Job<S>) -> Result<Response, ApiError> {
    // Without max_tokens, each choice may use the rest of the context: under a tokens-per-
    // minute limit, no more than a minute's tokens (a larger budget could never be admitted).
    let tokens_per_minute =
        (job.state.rate_limiter.as_ref()).and_then(|l| l.limit().tokens_per_minute);
    if job.generation.max_tokens.is_none()
        && let Some(limit) = tokens_per_minute
    {
        job.planned.hold_to(limit);
    }
    // Check the admission rules before spawning anything.
    let sequences = job.planned.requests.len();
    let tokens = RequestTokens {
        charged: job.planned.budget(),
        held: job.planned.held_tokens(),
    };
    let admitted = job.state.admit(&job.key, sequences, tokens)?;
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
    job.note.usage(usage);
    let body = job.shape.response(deltas, usage);
    Ok(([(CONTENT_TYPE, "application/json")], body).into_response())
}

// ANCHOR: stream_response
fn stream_response<S: Shape>(job: Job<S>, admitted: Admitted) -> Response {
    // Bounded: a client that stops reading holds at most this many events; past them its
    // request is aborted (`emit` returns false), and the stream's last event says why.
    let (events, receiver) = mpsc::channel::<SseEvent>(job.state.stream_buffer);
    tokio::spawn(async move {
        let _admitted = admitted;
        let json = |text: String| SseEvent::default().data(text);
        for chunk in job.shape.opening_chunks(job.planned.requests.len()) {
            let _ = events.send(json(chunk)).await;
        }
        let mut behind = false; // the buffer filled: the client is there, but too slow
        let result = driver::generate(
            &job.state,
            job.started,
            job.planned,
            &job.generation,
            job.echo,
            events.closed(),
            |delta| match events.try_send(json(job.shape.chunk(&delta))) {
                Ok(()) => true,
                Err(error) => {
                    behind = matches!(error, mpsc::error::TrySendError::Full(_));
                    false
                }
            },
        )
        .await;
        let result = result.map_err(|error| {
            if behind {
                ApiError::bad_request(format!(
                    "the client read the stream too slowly: {} chunks were waiting for it, and \
                     the request was aborted",
                    job.state.stream_buffer
                ))
            } else {
                error
            }
        });
        match result {
            Ok(usage) => {
                job.note.usage(usage);
                if job.generation.include_usage {
                    let _ = events.send(json(job.shape.usage_chunk(usage))).await;
                }
            }
            Err(error) => {
                let _ = events.send(SseEvent::default().data(error.to_json())).await;
            }
        }
        let _ = events.send(SseEvent::default().data("[DONE]")).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with_type(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, value.parse().unwrap());
        headers
    }

    /// JSON with no charset or UTF-8's passes; another declared type, or a charset the body is
    /// not read in, is refused (UTF-16 was read as UTF-8).
    #[test]
    fn only_utf8_json_bodies_are_accepted() {
        for ok in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/json; charset=UTF8",
            "application/json;charset=\"UTF-8\"",
            "application/json; boundary=x",
        ] {
            assert!(require_json(&with_type(ok)).is_ok(), "{ok}");
        }
        for refused in [
            "text/plain",
            "application/json; charset=utf-16",
            "application/json; charset=\"latin1\"",
        ] {
            assert!(require_json(&with_type(refused)).is_err(), "{refused}");
        }
        assert!(require_json(&HeaderMap::new()).is_err());
        // A header that is not visible ASCII is named as such (it once read as no header).
        let mut headers = HeaderMap::new();
        let value = axum::http::HeaderValue::from_bytes(b"application/json\xe9").unwrap();
        headers.insert(CONTENT_TYPE, value);
        let err = require_json(&headers).unwrap_err();
        assert!(format!("{err:?}").contains("visible ASCII"), "{err:?}");
    }
}
