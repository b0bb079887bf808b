//! `POST /v1/chat/completions`: messages rendered by the model's chat template, then generated
//! as a completion and answered as an assistant message.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::Response;

use super::{
    Accepted, Job, Shape, accept, chunk_usage, respond, serve_generation, to_json, unix_now,
};
use crate::chat_template::ChatMessage;
use crate::driver::{Delta, TokenInfo};
use crate::error::ApiError;
use crate::params::{self, MAX_TOP_LOGPROBS};
use crate::protocol::{
    ChatChoice, ChatLogprobs, ChatRequest, ChatResponse, ChatTokenLogprob, ResponseMessage, Usage,
};
use crate::state::AppState;

pub async fn handler(State(state): State<Arc<AppState>>, request: Request) -> Response {
    respond(handle(state, request).await)
}

async fn handle(state: Arc<AppState>, request: Request) -> Result<Response, ApiError> {
    let Accepted {
        started,
        key,
        request,
        note,
    } = accept::<ChatRequest>(&state, request, |r| &r.model).await?;
    if state.chat_template.is_none() {
        return Err(ApiError::bad_request(
            "this model has no chat template (tokenizer_config.json or chat_template.jinja): \
             use /v1/completions",
        ));
    }
    if request.messages.is_empty() {
        return Err(ApiError::bad_param("messages", "messages is empty"));
    }
    let messages = request
        .messages
        .iter()
        .map(|m| m.to_template())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiError::bad_param("messages", e))?;
    let max_tokens = match (request.max_tokens, request.max_completion_tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::bad_param(
                "max_completion_tokens",
                "give max_completion_tokens or max_tokens, not two different values",
            ));
        }
        (a, b) => b.or(a),
    };
    let logprobs = match (request.logprobs, request.top_logprobs) {
        (false, Some(_)) => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        (true, Some(k)) if k > MAX_TOP_LOGPROBS => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                format!("at most {MAX_TOP_LOGPROBS} top_logprobs, got {k}"),
            ));
        }
        (true, k) => Some(k.unwrap_or(0)),
        (false, None) => None,
    };
    let prompt = render_and_tokenize(&state, messages, &request, max_tokens).await?;
    let (number, seed) = state.number_request();
    let generation =
        params::generation(&request.sampling, max_tokens, logprobs, seed, &state.limits)?;
    let planned = generation.plan(vec![prompt], "messages", &state.limits)?;
    serve_generation(Job {
        shape: ChatShape {
            id: format!("chatcmpl-{number}"),
            created: unix_now(),
            model: state.served_model_name.clone(),
            logprobs: logprobs.is_some(),
            include_usage: generation.include_usage,
        },
        state,
        started,
        planned,
        generation,
        echo: None,
        key,
        note,
    })
    .await
}

/// The messages through the chat template, then tokenized, off the async runtime. The
/// messages' text is refused by its bytes first (the template only adds to it), and the
/// rendered text again before it is tokenized.
async fn render_and_tokenize(
    state: &Arc<AppState>,
    messages: Vec<ChatMessage>,
    request: &ChatRequest,
    max_tokens: Option<u32>,
) -> Result<Vec<u32>, ApiError> {
    let bytes = messages.iter().map(|m| m.content.len()).sum();
    params::fits_by_bytes(bytes, max_tokens, "messages", &state.limits)?;
    let add_generation_prompt = request.add_generation_prompt.unwrap_or(true);
    let shared = Arc::clone(state);
    state
        .off_runtime(move || {
            let template = shared.chat_template.as_ref().expect("checked before");
            let text = template
                .render(&messages, add_generation_prompt)
                .map_err(|e| ApiError::bad_param("messages", format!("chat template: {e}")))?;
            params::fits_by_bytes(text.len(), max_tokens, "messages", &shared.limits)?;
            // The template writes the special tokens (BOS) itself.
            shared
                .tokenizer
                .encode(&text, false)
                .map_err(|e| ApiError::bad_param("messages", format!("cannot tokenize: {e}")))
        })
        .await?
}

struct ChatShape {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    include_usage: bool,
}

fn token_logprob(info: &TokenInfo) -> ChatTokenLogprob {
    ChatTokenLogprob {
        token: info.text.clone(),
        logprob: info.logprob,
        bytes: info.text.as_bytes().to_vec(),
        top_logprobs: Some(
            info.top
                .iter()
                .map(|(text, logprob)| ChatTokenLogprob {
                    token: text.clone(),
                    logprob: *logprob,
                    bytes: text.as_bytes().to_vec(),
                    top_logprobs: None,
                })
                .collect(),
        ),
    }
}

impl ChatShape {
    fn envelope(
        &self,
        object: &str,
        choices: Vec<ChatChoice>,
        usage: Option<Option<Usage>>,
    ) -> String {
        to_json(&ChatResponse {
            id: self.id.clone(),
            object: object.into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
    }

    fn logprobs(&self, deltas: &[&Delta]) -> Option<ChatLogprobs> {
        self.logprobs.then(|| ChatLogprobs {
            content: deltas
                .iter()
                .flat_map(|d| d.logprobs.iter().map(token_logprob))
                .collect(),
        })
    }
}

impl Shape for ChatShape {
    fn opening_chunks(&self, choices: usize) -> Vec<String> {
        (0..choices)
            .map(|index| {
                self.envelope(
                    "chat.completion.chunk",
                    vec![ChatChoice {
                        index,
                        message: None,
                        delta: Some(ResponseMessage {
                            role: Some("assistant".into()),
                            content: Some(String::new()),
                        }),
                        logprobs: None,
                        finish_reason: None,
                    }],
                    chunk_usage(self.include_usage),
                )
            })
            .collect()
    }

    fn chunk(&self, delta: &Delta) -> String {
        self.envelope(
            "chat.completion.chunk",
            vec![ChatChoice {
                index: delta.choice,
                message: None,
                delta: Some(ResponseMessage {
                    role: None,
                    content: (!delta.text.is_empty()).then(|| delta.text.clone()),
                }),
                logprobs: self.logprobs(&[delta]),
                finish_reason: delta.finish_reason.map(str::to_string),
            }],
            chunk_usage(self.include_usage),
        )
    }

    fn usage_chunk(&self, usage: Usage) -> String {
        self.envelope("chat.completion.chunk", Vec::new(), Some(Some(usage)))
    }

    fn response(&self, choices: Vec<Vec<Delta>>, usage: Usage) -> String {
        let choices = choices
            .into_iter()
            .enumerate()
            .map(|(index, deltas)| {
                let deltas: Vec<&Delta> = deltas.iter().collect();
                ChatChoice {
                    index,
                    message: Some(ResponseMessage {
                        role: Some("assistant".into()),
                        content: Some(deltas.iter().map(|d| d.text.as_str()).collect()),
                    }),
                    delta: None,
                    logprobs: self.logprobs(&deltas),
                    finish_reason: deltas
                        .iter()
                        .rev()
                        .find_map(|d| d.finish_reason)
                        .map(str::to_string),
                }
            })
            .collect();
        self.envelope("chat.completion", choices, Some(Some(usage)))
    }
}
