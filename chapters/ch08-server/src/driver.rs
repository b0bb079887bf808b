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
use crate::structured::EndedEarly;

/// A token's text, bytes and logprob, with its alternatives' (best first; theirs empty).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    /// What `bytes` spell, U+FFFD for part of a character.
    pub text: String,
    /// The token's own bytes ([`Tokenizer::token_bytes`]): what it adds to the text, exactly.
    ///
    /// [`Tokenizer::token_bytes`]: ch01::Tokenizer::token_bytes
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<TokenInfo>,
}

/// What one choice produced since the last delta.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    pub choice: usize,
    /// The completions' `text_offset` of the delta's first token, in bytes: the echo's and
    /// every earlier token's own ([`TokenInfo::bytes`], not its text, which is U+FFFD for part
    /// of a character). Text held back (a possible
    /// stop string, a partial character) does not move it: it counts the tokens, not what was
    /// sent.
    pub offset: usize,
    pub text: String,
    /// One per new token, when logprobs were asked for.
    pub logprobs: Vec<TokenInfo>,
    /// `"stop"`, `"length"` or `"abort"` on the choice's last delta.
    pub finish_reason: Option<&'static str>,
}

/// One choice being generated.
struct Choice<'t> {
    id: RequestId,
    /// What decodes the choice's tokens: the server's tokenizer or the request's decoder.
    tokenizer: &'t ch01::Tokenizer,
    text: OutputText<'t>,
    /// The stop tokens whose text is left out when one ends the choice (as vLLM leaves it
    /// out): the request's stop_token_ids and EOS, none with `include_stop_str_in_output`.
    silent_stops: &'t [u32],
    /// Bytes of text sent so far (echo included).
    sent: usize,
    /// The echo's bytes and each token's own bytes so far: where the next token's
    /// `text_offset` lies.
    token_offset: usize,
    tokens: usize,
    last_token: Option<Instant>,
    finish: Option<&'static str>,
}

fn reason_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    }
}

/// The finish reason of a whole request, from its choices': `abort` if any was aborted,
/// else `length` if any hit its limit, else `stop`. A request is counted once in
/// `request_success_total`, however many choices it has.
fn request_reason(choices: &[Choice<'_>]) -> &'static str {
    ["abort", "length"]
        .into_iter()
        .find(|&r| choices.iter().any(|c| c.finish == Some(r)))
        .unwrap_or("stop")
}

/// The request-level metrics: one time to first token (the first token of any choice), one
/// end-to-end latency and one finish reason per HTTP request; inter-token gaps per choice.
struct RequestClock {
    started: Instant,
    first_token: bool,
}

impl RequestClock {
    fn token(&mut self, state: &AppState, now: Instant, last: Option<Instant>) {
        if !self.first_token {
            self.first_token = true;
            state
                .metrics
                .observe_ttft((now - self.started).as_secs_f64());
        }
        if let Some(last) = last {
            state
                .metrics
                .observe_inter_token((now - last).as_secs_f64());
        }
    }

    fn finished(&self, state: &AppState, reason: &str) {
        let e2e = self.started.elapsed().as_secs_f64();
        state.metrics.observe_e2e(e2e);
        state.metrics.request_finished(reason);
    }
}

/// Why [`generate`] ended before every choice finished.
fn disconnected(state: &AppState, clock: &RequestClock) -> ApiError {
    clock.finished(state, "abort");
    ApiError::bad_request("client disconnected")
}

// ANCHOR: generate
/// Submits the planned requests together (choice `p × n + i` is prompt `p`'s), then calls
/// `emit` with every delta until every choice has finished. `echo[p]` is sent first as prompt
/// `p`'s choices' text. Returns the usage. Ends early when `gone` resolves (the client
/// disconnected) or `emit` returns false, counting the request as aborted: the events'
/// receiver is dropped on return, and the engine aborts every choice of a closed channel
/// before its next step. Dropping the returned future aborts the same way.
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
        processors,
        ended_early,
        prompt_tokens,
    } = planned;
    // Each choice's text continues its prompt: the prompt's last tokens decode in front.
    let contexts: Vec<Vec<u32>> = (requests.iter())
        .map(|r| {
            r.prompt[r
                .prompt
                .len()
                .saturating_sub(ch01::tokenizer::CONTEXT_TOKENS)..]
                .to_vec()
        })
        .collect();
    // Every choice of a request has the same stop tokens.
    let silent_stops: Vec<u32> = match generation.include_stop_str_in_output {
        true => Vec::new(),
        false => (requests.first()).map_or_else(Vec::new, |r| r.stop_token_ids.clone()),
    };
    let tokenizer = (generation.decoder.as_ref()).map_or(&*state.tokenizer, |d| &*d.0);
    let (events, mut received) = mpsc::unbounded_channel();
    let ids = state
        .engine
        .submit(requests, processors, events)
        .await
        .map_err(|e| match e {
            SubmitError::Stopped => ApiError::unavailable("the engine has stopped"),
            SubmitError::Rejected(e) => ApiError::bad_request(e.to_string()),
        })?;
    let mut choices: Vec<Choice<'_>> = (ids.into_iter().zip(&contexts))
        .map(|(id, context)| Choice {
            id,
            tokenizer,
            text: OutputText::after(tokenizer, generation.stop.clone(), context),
            silent_stops: &silent_stops,
            sent: 0,
            token_offset: 0,
            tokens: 0,
            last_token: None,
            finish: None,
        })
        .collect();
    let mut clock = RequestClock {
        started,
        first_token: false,
    };

    if let Some(echo) = echo {
        for (index, choice) in choices.iter_mut().enumerate() {
            let text = echo[index / generation.n].clone();
            choice.sent = text.len();
            choice.token_offset = text.len();
            let delta = Delta {
                choice: index,
                offset: 0,
                text,
                logprobs: Vec::new(),
                finish_reason: None,
            };
            if !emit(delta) {
                return Err(disconnected(state, &clock));
            }
        }
    }

    tokio::pin!(gone);
    let mut remaining = choices.len();
    while remaining > 0 {
        let event = tokio::select! {
            event = received.recv() => event,
            () = &mut gone => return Err(disconnected(state, &clock)),
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
        if choice.finish.is_some() {
            continue; // stopped by a stop string; the engine's last tokens are dropped
        }
        // A choice its processor ended early (or must end) does not match what the request
        // asked for: the request fails, and its tokens from then on are never shown.
        if let Some(why) = ended_early.get(index).and_then(EndedEarly::reason) {
            clock.finished(state, "abort");
            return Err(ApiError::bad_request(format!("choice {index}: {why}")));
        }
        let delta = advance(
            state, &mut clock, choice, index, &tokens, &logprobs, finished,
        )?;
        if choice.finish.is_some() {
            remaining -= 1;
        }
        if !emit(delta) {
            return Err(disconnected(state, &clock));
        }
    }
    clock.finished(state, request_reason(&choices));
    Ok(Usage::new(
        prompt_tokens,
        choices.iter().map(|c| c.tokens).sum(),
    ))
}
// ANCHOR_END: generate

// ANCHOR: advance
/// Folds one event into its choice; the delta to send. A stop token that ends the choice is
/// counted and keeps its logprob, but adds no text unless the request asked for it
/// (`include_stop_str_in_output`), as in vLLM.
fn advance(
    state: &AppState,
    clock: &mut RequestClock,
    choice: &mut Choice<'_>,
    index: usize,
    tokens: &[u32],
    logprobs: &[TokenLogprobs],
    finished: Option<FinishReason>,
) -> Result<Delta, ApiError> {
    let now = Instant::now();
    let detokenize = |e: ch01::Error| ApiError::internal(format!("detokenizing: {e}"));
    let mut delta = Delta {
        choice: index,
        offset: choice.token_offset,
        text: String::new(),
        logprobs: Vec::new(),
        finish_reason: None,
    };
    let mut stopped = false;
    let ends_on_stop_token = finished == Some(FinishReason::Stop)
        && tokens
            .last()
            .is_some_and(|t| choice.silent_stops.contains(t));
    for (i, &token) in tokens.iter().enumerate() {
        clock.token(state, now, choice.last_token);
        choice.last_token = Some(now);
        choice.tokens += 1;
        if let Some(lp) = logprobs.get(i) {
            let info = token_info(choice.tokenizer, lp)?;
            choice.token_offset += info.bytes.len(); // not `text`: U+FFFD for part of a character
            delta.logprobs.push(info);
        }
        if i + 1 == tokens.len() && ends_on_stop_token {
            break; // the stop token: the engine ends the choice after it
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
    choice.sent += delta.text.len();
    let finish = if stopped {
        Some("stop")
    } else {
        finished.map(reason_name)
    };
    if let Some(reason) = finish {
        choice.finish = Some(reason);
        delta.finish_reason = Some(reason);
    }
    Ok(delta)
}
// ANCHOR_END: advance

fn token_info(tokenizer: &ch01::Tokenizer, lp: &TokenLogprobs) -> Result<TokenInfo, ApiError> {
    // The token's text is what its bytes spell (U+FFFD for part of a character): decoded alone,
    // a SentencePiece token would lose its leading space.
    let one = |id: u32, logprob: f32| {
        let bytes = (tokenizer.token_bytes(id))
            .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))?;
        Ok(TokenInfo {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob,
            top: Vec::new(),
        })
    };
    Ok(TokenInfo {
        top: lp
            .top
            .iter()
            .map(|&(id, logprob)| one(id, logprob))
            .collect::<Result<_, ApiError>>()?,
        ..one(lp.token, lp.logprob)?
    })
}
