//! One HTTP request's generation, from submitting its choices to their last text.
//!
//! The engine sends token ids; the client wants text. Per choice, the driver turns ids into
//! text with chapter 1's [`OutputText`] (never half a character, never a stop string), aborts
//! the choice in the engine when a stop string completes, and stamps the latency metrics. Streamed and non-streamed responses are the same
//! deltas, gathered or sent, so their text is the same by construction.

use std::future::Future;
use std::time::Instant;

use ch01::OutputText;
use ch04::{FinishReason, RequestId, TokenLogprobs};
use tokio::sync::mpsc;

use crate::engine_thread::{Event, SubmitError};
use crate::error::ApiError;
use crate::params::{Generation, Planned};
use crate::protocol::Usage;
use crate::state::AppState;

/// A token's text and logprob, with its alternatives' (best first).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    pub text: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What one choice produced since the last delta.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    pub choice: usize,
    pub text: String,
    /// One per new token, when logprobs were asked for.
    pub logprobs: Vec<TokenInfo>,
    /// `"stop"`, `"length"` or `"abort"` on the choice's last delta.
    pub finish_reason: Option<&'static str>,
}

/// One choice being generated.
struct Choice<'t> {
    id: RequestId,
    text: OutputText<'t>,
    tokens: usize,
    last_token: Option<Instant>,
    done: bool,
}

fn reason_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    }
}

/// Submits the planned requests (choice `p × n + i` is prompt `p`'s), then calls `emit` with
/// every delta until every choice has finished. `echo[p]` is sent first as prompt `p`'s
/// choices' text. Returns the usage. Ends early, aborting what is left, when `gone` resolves
/// (the client disconnected) or `emit` returns false; dropping the returned future aborts too
/// (the engine drops requests whose channel is closed).
pub async fn generate(
    state: &AppState,
    started: Instant,
    planned: Planned,
    generation: &Generation,
    echo: Option<Vec<String>>,
    gone: impl Future<Output = ()>,
    mut emit: impl FnMut(Delta) -> bool,
) -> Result<Usage, ApiError> {
    let Planned {
        requests,
        prompt_tokens,
    } = planned;
    let (events, mut received) = mpsc::unbounded_channel();
    let mut choices = Vec::with_capacity(requests.len());
    for (index, request) in requests.into_iter().enumerate() {
        let id = state
            .engine
            .submit(request, index, events.clone())
            .await
            .map_err(|e| match e {
                SubmitError::Stopped => ApiError::unavailable("the server is shutting down"),
                SubmitError::Rejected(e) => ApiError::bad_request(e.to_string()),
            })?;
        choices.push(Choice {
            id,
            text: OutputText::new(&state.tokenizer, generation.stop.clone()),
            tokens: 0,
            last_token: None,
            done: false,
        });
    }
    drop(events);

    if let Some(echo) = echo {
        for (index, _) in choices.iter().enumerate() {
            let text = echo[index / generation.n].clone();
            if !emit(Delta {
                choice: index,
                text,
                logprobs: Vec::new(),
                finish_reason: None,
            }) {
                return Err(ApiError::bad_request("client disconnected"));
            }
        }
    }

    tokio::pin!(gone);
    let mut remaining = choices.len();
    while remaining > 0 {
        let event = tokio::select! {
            event = received.recv() => event,
            () = &mut gone => return Err(ApiError::bad_request("client disconnected")),
        };
        let Some(event) = event else {
            return Err(ApiError::internal("the engine stopped mid-request"));
        };
        let (index, tokens, logprobs, finished) = match event {
            Event::Tokens {
                choice,
                tokens,
                logprobs,
                finished,
            } => (choice, tokens, logprobs, finished),
            Event::Failed { message, .. } => return Err(ApiError::internal(message)),
        };
        let choice = &mut choices[index];
        if choice.done {
            continue; // stopped by a stop string; the engine's last tokens are dropped
        }
        let delta = advance(state, started, choice, index, &tokens, &logprobs, finished)?;
        if choice.done {
            remaining -= 1;
        }
        if !emit(delta) {
            return Err(ApiError::bad_request("client disconnected"));
        }
    }
    Ok(Usage::new(
        prompt_tokens,
        choices.iter().map(|c| c.tokens).sum(),
    ))
}

// ANCHOR: advance
/// Folds one event into its choice; the delta to send.
fn advance(
    state: &AppState,
    started: Instant,
    choice: &mut Choice<'_>,
    index: usize,
    tokens: &[u32],
    logprobs: &[TokenLogprobs],
    finished: Option<FinishReason>,
) -> Result<Delta, ApiError> {
    let now = Instant::now();
    let metrics = &state.metrics;
    let detokenize = |e: ch01::Error| ApiError::internal(format!("detokenizing: {e}"));
    let mut delta = Delta {
        choice: index,
        text: String::new(),
        logprobs: Vec::new(),
        finish_reason: None,
    };
    let mut stopped = false;
    for (i, &token) in tokens.iter().enumerate() {
        match choice.last_token {
            None => metrics.observe_ttft((now - started).as_secs_f64()),
            Some(last) => metrics.observe_inter_token((now - last).as_secs_f64()),
        }
        choice.last_token = Some(now);
        choice.tokens += 1;
        if let Some(lp) = logprobs.get(i) {
            delta.logprobs.push(token_info(state, lp)?);
        }
        let piece = choice.text.push(token).map_err(detokenize)?;
        delta.text.push_str(&piece.text);
        if piece.stopped {
            state.engine.abort(choice.id);
            stopped = true;
            break;
        }
    }
    if !stopped && finished.is_some() {
        // Ended by the engine: release what was held back (it may complete a stop string).
        let rest = choice.text.finish().map_err(detokenize)?;
        delta.text.push_str(&rest.text);
        stopped = rest.stopped;
    }
    let finish = if stopped {
        Some("stop")
    } else {
        finished.map(reason_name)
    };
    if let Some(reason) = finish {
        choice.done = true;
        delta.finish_reason = Some(reason);
        metrics.observe_e2e((now - started).as_secs_f64());
        metrics.request_finished(reason);
    }
    Ok(delta)
}
// ANCHOR_END: advance

fn token_info(state: &AppState, lp: &TokenLogprobs) -> Result<TokenInfo, ApiError> {
    let text = |id: u32| {
        state
            .tokenizer
            .decode(&[id])
            .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))
    };
    Ok(TokenInfo {
        text: text(lp.token)?,
        logprob: lp.logprob,
        top: lp
            .top
            .iter()
            .map(|&(id, logprob)| Ok((text(id)?, logprob)))
            .collect::<Result<_, ApiError>>()?,
    })
}
