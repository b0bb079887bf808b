//! `POST /v1/completions`: text (or token ids) in, text out.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Map, Value, json};

use super::{Accepted, Job, Shape, accept, respond, serve_generation, unix_now};
use crate::driver::Delta;
use crate::error::ApiError;
use crate::params;
use crate::protocol::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Prompt, Usage,
};
use crate::state::AppState;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: u32 = 16;

pub async fn handler(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(handle(state, headers, body).await)
}

async fn handle(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Accepted {
        started,
        key,
        request,
    } = accept::<CompletionRequest>(&state, &headers, body, |r| &r.model)?;
    if request.echo && request.logprobs.is_some() {
        return Err(ApiError::bad_param(
            "echo",
            "echo with logprobs is not supported (kiln does not score prompt tokens)",
        ));
    }
    let encode = |text: &str| {
        state
            .tokenizer
            .encode(text, true)
            .map_err(|e| ApiError::bad_param("prompt", format!("cannot tokenize: {e}")))
    };
    let (prompts, texts): (Vec<Vec<u32>>, Option<Vec<String>>) = match &request.prompt {
        Prompt::Text(text) => (vec![encode(text)?], Some(vec![text.clone()])),
        Prompt::Texts(texts) => (
            texts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
            Some(texts.clone()),
        ),
        Prompt::Tokens(tokens) => (vec![tokens.clone()], None),
        Prompt::TokenLists(lists) => (lists.clone(), None),
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt list is empty"));
    }
    let (number, seed) = state.number_request();
    let generation = params::generation(
        &request.sampling,
        Some(request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)),
        request.logprobs,
        seed,
        &state.limits,
    )?;
    let echo = if request.echo {
        Some(match texts {
            Some(texts) => texts,
            None => prompts
                .iter()
                .map(|p| {
                    state
                        .tokenizer
                        .decode(p)
                        .map_err(|e| ApiError::bad_param("prompt", e.to_string()))
                })
                .collect::<Result<_, _>>()?,
        })
    } else {
        None
    };
    serve_generation(Job {
        shape: CompletionShape {
            id: format!("cmpl-{number}"),
            created: unix_now(),
            model: state.served_model_name.clone(),
        },
        planned: generation.plan(prompts, &state.limits)?,
        state,
        started,
        generation,
        echo,
        key,
    })
    .await
}

struct CompletionShape {
    id: String,
    created: u64,
    model: String,
}

impl CompletionShape {
    fn envelope(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> Value {
        serde_json::to_value(CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
        .expect("serialisable")
    }
}

/// Appends `delta`'s logprobs; `offset` is where the delta's text starts in the choice's text.
fn push_logprobs(into: &mut CompletionLogprobs, delta: &Delta, mut offset: usize) {
    for token in &delta.logprobs {
        into.tokens.push(token.text.clone());
        into.token_logprobs.push(token.logprob);
        let mut top = Map::new();
        for (text, logprob) in &token.top {
            top.entry(text.clone()).or_insert(json!(logprob));
        }
        into.top_logprobs.push(top);
        into.text_offset.push(offset);
        offset += token.text.len();
    }
}

impl Shape for CompletionShape {
    fn opening_chunks(&self, _choices: usize) -> Vec<Value> {
        Vec::new()
    }

    fn chunk(&self, delta: &Delta) -> Value {
        let logprobs = (!delta.logprobs.is_empty()).then(|| {
            let mut lp = CompletionLogprobs::default();
            push_logprobs(&mut lp, delta, 0);
            lp
        });
        self.envelope(
            vec![CompletionChoice {
                index: delta.choice,
                text: delta.text.clone(),
                logprobs,
                finish_reason: delta.finish_reason.map(str::to_string),
            }],
            None,
        )
    }

    fn usage_chunk(&self, usage: Usage) -> Value {
        self.envelope(Vec::new(), Some(usage))
    }

    fn response(&self, choices: Vec<Vec<Delta>>, usage: Usage) -> Value {
        let wants_logprobs = choices.iter().flatten().any(|d| !d.logprobs.is_empty());
        let choices = choices
            .into_iter()
            .enumerate()
            .map(|(index, deltas)| {
                let mut text = String::new();
                let mut logprobs = CompletionLogprobs::default();
                let mut finish_reason = None;
                for delta in &deltas {
                    push_logprobs(&mut logprobs, delta, text.len());
                    text.push_str(&delta.text);
                    finish_reason = delta.finish_reason.or(finish_reason);
                }
                CompletionChoice {
                    index,
                    text,
                    logprobs: wants_logprobs.then_some(logprobs),
                    finish_reason: finish_reason.map(str::to_string),
                }
            })
            .collect();
        self.envelope(choices, Some(usage))
    }
}
