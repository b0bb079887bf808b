//! `POST /v1/completions`: text (or token ids) in, text out.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::Response;

use super::{
    Accepted, Job, Shape, accept, chunk_usage, respond, serve_generation, to_json, unix_now,
};
use crate::driver::Delta;
use crate::error::ApiError;
use crate::params;
use crate::prompt_pieces;
use crate::protocol::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Prompt,
    TopLogprobs, Usage,
};
use crate::state::AppState;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: u32 = 16;

pub async fn handler(State(state): State<Arc<AppState>>, request: Request) -> Response {
    respond(handle(state, request).await)
}

async fn handle(state: Arc<AppState>, request: Request) -> Result<Response, ApiError> {
    let Accepted {
        started,
        key,
        request,
        note,
    } = accept::<CompletionRequest>(&state, request, |r| &r.model).await?;
    if request.echo && request.logprobs.is_some() {
        return Err(ApiError::bad_param(
            "echo",
            "echo with logprobs is not supported (kiln does not score prompt tokens)",
        ));
    }
    for (param, given) in [
        ("tools", request.sampling.tools.is_some()),
        ("tool_choice", request.sampling.tool_choice.is_some()),
    ] {
        if given {
            return Err(ApiError::bad_param(
                param,
                format!("{param} is for /v1/chat/completions only"),
            ));
        }
    }
    let max_tokens = request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let special = request.add_special_tokens.unwrap_or(true);
    // A prompt to be truncated may be longer than the context: no byte bound applies.
    // A prompt of more than max_model_len tokens is refused whatever it keeps, so tokenizing
    // more of one than that from its end would only cost time.
    let length = match request.sampling.truncate_prompt_tokens {
        Some(k) if k >= 1 => Length::Keep((k as usize).min(state.limits.max_model_len)),
        _ => Length::Fit(max_tokens),
    };
    let (prompts, texts) = match request.prompt {
        Prompt::Text(text) => tokenize(&state, vec![text], length, special).await?,
        Prompt::Texts(texts) => tokenize(&state, texts, length, special).await?,
        Prompt::Tokens(tokens) => (vec![tokens], None),
        Prompt::TokenLists(lists) => {
            params::check_prompt_count(lists.len(), &state.limits)?;
            (lists, None)
        }
    };
    let (number, seed) = state.number_request();
    let mut generation = params::generation(
        &request.sampling,
        Some(request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)),
        request.logprobs,
        seed,
        &state.limits,
    )?;
    super::compile_rules(&state, &mut generation).await?;
    // Token prompts are echoed once the plan has checked them (lengths, vocabulary).
    let echoed_tokens = (request.echo && texts.is_none()).then(|| prompts.clone());
    let planned = generation.plan(prompts, "prompt", &state.limits)?;
    let echo: Option<Vec<String>> = if request.echo {
        Some(match texts {
            Some(texts) => texts,
            None => echoed_tokens
                .unwrap_or_default()
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
    if let Some(echo) = &echo {
        generation.check_echo(&planned, echo)?;
    }
    serve_generation(Job {
        shape: CompletionShape {
            id: format!("cmpl-{number}"),
            created: unix_now(),
            model: state.served_model_name.clone(),
            include_usage: generation.include_usage,
        },
        planned,
        state,
        started,
        generation,
        echo,
        key,
        note,
    })
    .await
}

/// How long a text prompt may be.
#[derive(Clone, Copy)]
enum Length {
    /// It must fit the context with this many tokens (`max_tokens`) after it.
    Fit(u32),
    /// Its last this many tokens are kept (`truncate_prompt_tokens`): any length.
    Keep(usize),
}

// ANCHOR: tokenize
/// Tokenizes text prompts off the async runtime (see [`AppState::off_runtime`]), after
/// refusing a list that is too long and, unless its last tokens are to be kept, a text that
/// cannot fit the context: by its bytes alone, then, for a long one, by counting it in pieces
/// (`prompt_pieces`). A prompt to be truncated is tokenized from its end, as far back as its
/// kept tokens need. Returns the prompts' ids and their texts (for echo).
async fn tokenize(
    state: &Arc<AppState>,
    texts: Vec<String>,
    length: Length,
    add_special_tokens: bool,
) -> Result<(Vec<Vec<u32>>, Option<Vec<String>>), ApiError> {
    params::check_prompt_count(texts.len(), &state.limits)?;
    if let Length::Fit(max_tokens) = length {
        for text in &texts {
            let max_tokens = Some((max_tokens, "max_tokens"));
            params::fits_by_bytes(text.len(), max_tokens, "prompt", &state.limits)?;
        }
    }
    let shared = Arc::clone(state);
    state
        .off_runtime(move || {
            let tokenizer = &shared.tokenizer;
            if let Length::Fit(max_tokens) = length {
                let len = shared.limits.max_model_len;
                for text in &texts {
                    prompt_pieces::fits_by_pieces(
                        tokenizer,
                        text,
                        Some(max_tokens),
                        len,
                        "prompt",
                    )?;
                }
            }
            let prompts = texts
                .iter()
                .map(|text| match length {
                    Length::Fit(_) => tokenizer.encode(text, add_special_tokens),
                    Length::Keep(k) => {
                        prompt_pieces::last_tokens(tokenizer, text, k, add_special_tokens)
                    }
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ApiError::bad_param("prompt", format!("cannot tokenize: {e}")))?;
            Ok((prompts, Some(texts)))
        })
        .await?
}
// ANCHOR_END: tokenize

struct CompletionShape {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl CompletionShape {
    fn envelope(&self, choices: Vec<CompletionChoice>, usage: Option<Option<Usage>>) -> String {
        to_json(&CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
    }
}

/// Appends `delta`'s logprobs. A token's `text_offset` is where it starts in the choice's
/// whole text, in bytes: the delta's offset plus the bytes of the delta's tokens before it, so
/// streamed chunks carry the same offsets as the whole response. Bytes, not the tokens' texts:
/// a token that holds part of a character has the text U+FFFD, three bytes, whatever its own.
fn push_logprobs(into: &mut CompletionLogprobs, delta: &Delta) {
    let mut offset = delta.offset;
    for token in &delta.logprobs {
        into.tokens.push(token.text.clone());
        into.token_logprobs.push(token.logprob);
        into.top_logprobs.push(TopLogprobs::new(
            token.top.iter().map(|alt| (alt.text.clone(), alt.logprob)),
        ));
        into.text_offset.push(offset);
        offset += token.bytes.len();
    }
}

impl Shape for CompletionShape {
    fn opening_chunks(&self, _choices: usize) -> Vec<String> {
        Vec::new()
    }

    fn chunk(&self, delta: &Delta) -> String {
        let logprobs = (!delta.logprobs.is_empty()).then(|| {
            let mut lp = CompletionLogprobs::default();
            push_logprobs(&mut lp, delta);
            lp
        });
        self.envelope(
            vec![CompletionChoice {
                index: delta.choice,
                text: delta.text.clone(),
                logprobs,
                finish_reason: delta.finish_reason.map(str::to_string),
            }],
            chunk_usage(self.include_usage),
        )
    }

    fn usage_chunk(&self, usage: Usage) -> String {
        self.envelope(Vec::new(), Some(Some(usage)))
    }

    fn response(&self, choices: Vec<Vec<Delta>>, usage: Usage) -> String {
        let wants_logprobs = choices.iter().flatten().any(|d| !d.logprobs.is_empty());
        let choices = choices
            .into_iter()
            .enumerate()
            .map(|(index, deltas)| {
                let mut text = String::new();
                let mut logprobs = CompletionLogprobs::default();
                let mut finish_reason = None;
                for delta in &deltas {
                    push_logprobs(&mut logprobs, delta);
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
        self.envelope(choices, Some(Some(usage)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::TokenInfo;

    fn token(bytes: &[u8]) -> TokenInfo {
        TokenInfo {
            text: String::from_utf8_lossy(bytes).into_owned(),
            bytes: bytes.to_vec(),
            logprob: -1.0,
            top: Vec::new(),
        }
    }

    /// "中" (three bytes) in two tokens, then " x": each offset is where the token's bytes start
    /// in the text, though the first two tokens' texts are U+FFFD (three bytes each).
    #[test]
    fn offsets_count_the_tokens_bytes_not_their_texts() {
        let delta = Delta {
            choice: 0,
            offset: 5,
            text: "中 x".into(),
            logprobs: vec![token(&[0xE4, 0xB8]), token(&[0xAD]), token(b" x")],
            finish_reason: None,
        };
        let mut logprobs = CompletionLogprobs::default();
        push_logprobs(&mut logprobs, &delta);
        assert_eq!(logprobs.text_offset, [5, 7, 8]);
        assert_eq!(logprobs.tokens, ["\u{FFFD}", "\u{FFFD}", " x"]);
    }
}
