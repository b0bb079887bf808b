//! `POST /v1/chat/completions`: messages rendered by the model's chat template, then generated
//! as a completion and answered as an assistant message.

use std::sync::{Arc, Mutex};

use serde_json::Value as Json;

use axum::extract::{Request, State};
use axum::response::Response;

use super::{
    Accepted, Job, Shape, accept, chunk_usage, respond, serve_generation, to_json, unix_now,
};
use crate::chat_template::{ChatMessage, TemplateError};
use crate::driver::{Delta, TokenInfo};
use crate::error::ApiError;
use crate::params::{self, MAX_TOP_LOGPROBS};
use crate::prompt_pieces;
use crate::protocol::{
    ChatChoice, ChatLogprobs, ChatRequest, ChatResponse, ChatTokenLogprob, FunctionCall,
    ResponseMessage, ToolCall, Usage,
};
use crate::state::AppState;
use crate::tools::{self, ToolMode};

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
    let tools = tools::parse_tools(request.sampling.tools.as_deref().unwrap_or_default())?;
    let mode = tools::tool_mode(request.sampling.tool_choice.as_ref(), &tools)?;
    // Errors about the completion's length name the field the client sent.
    let max_tokens_param = match request.max_completion_tokens {
        Some(_) => "max_completion_tokens",
        None => "max_tokens",
    };
    let named = max_tokens.map(|m| (m, max_tokens_param));
    let prompt = render_and_tokenize(&state, messages, &request, named, &mode).await?;
    let (number, seed) = state.number_request();
    let mut generation = params::generation_as(
        &request.sampling,
        max_tokens,
        max_tokens_param,
        logprobs,
        seed,
        &state.limits,
    )?;
    let parallel = request.sampling.parallel_tool_calls.unwrap_or(true);
    if let Some(constraint) = tools::constraint(&mode, &tools, parallel) {
        if let Some((_, param)) = &generation.constraint {
            return Err(ApiError::bad_param(
                param,
                format!("{param} cannot be combined with a required or named tool_choice"),
            ));
        }
        generation.constraint = Some((constraint, "tool_choice"));
    }
    super::compile_rules(&state, &mut generation).await?;
    generation.decoder = tag_decoder(&state, &mode).await?;
    let planned = generation.plan(vec![prompt], "messages", &state.limits)?;
    let id = format!("chatcmpl-{number}");
    serve_generation(Job {
        shape: ChatShape {
            buffered: Mutex::new(vec![String::new(); planned.requests.len()]),
            id,
            created: unix_now(),
            model: state.served_model_name.clone(),
            logprobs: logprobs.is_some(),
            include_usage: generation.include_usage,
            tools: mode,
            parallel_tool_calls: parallel,
            hidden_tags: generation.decoder.is_some(),
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

/// The decoder an `auto` request's choices need so that their tool-call tags reach the parser
/// ([`tools::tag_decoder`]); `None` where the server's tokenizer writes them already (or no
/// copy could be made). Built off the runtime on the first request that needs it (it reloads
/// the tokenizer).
async fn tag_decoder(
    state: &Arc<AppState>,
    mode: &ToolMode,
) -> Result<Option<params::Decoder>, ApiError> {
    if *mode != ToolMode::Auto {
        return Ok(None);
    }
    let built = match state.tag_decoder.get() {
        Some(built) => built.clone(),
        None => {
            let shared = Arc::clone(state);
            (state.off_runtime(move || {
                let built = shared
                    .tag_decoder
                    .get_or_init(|| tools::tag_decoder(&shared.tokenizer).map(|d| d.map(Arc::new)));
                built.clone()
            }))
            .await?
        }
    };
    // A copy that cannot be built (never seen: every `tokenizers` part saves and loads) leaves
    // the request to the server's tokenizer, whose text lacks the tags: served, without calls,
    // as before there was a copy; said once.
    match built {
        Ok(decoder) => Ok(decoder.map(params::Decoder)),
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!("kiln serve: cannot decode the tool-call tags' tokens, so `auto` tool calls are not parsed: {e}")
            });
            Ok(None)
        }
    }
}

/// The messages through the chat template, then tokenized, off the async runtime. The
/// messages' text is refused by its bytes first (the template only adds to it), and the
/// rendered text again before it is tokenized; neither for a request that asks for
/// `truncate_prompt_tokens`, whose prompt may be longer than the context.
async fn render_and_tokenize(
    state: &Arc<AppState>,
    messages: Vec<ChatMessage>,
    request: &ChatRequest,
    max_tokens: Option<(u32, &'static str)>,
    mode: &ToolMode,
) -> Result<Vec<u32>, ApiError> {
    // A prompt of more than max_model_len tokens is refused whatever it keeps, so tokenizing
    // more of one than that from its end would only cost time.
    let keep = (request.sampling.truncate_prompt_tokens)
        .filter(|&k| k >= 1)
        .map(|k| (k as usize).min(state.limits.max_model_len));
    let truncating = keep.is_some();
    let bytes = messages.iter().map(|m| m.content.len()).sum();
    if !truncating {
        params::fits_by_bytes(bytes, max_tokens, "messages", &state.limits)?;
    }
    let continue_final = request.continue_final_message;
    let add_generation_prompt = match (continue_final, request.add_generation_prompt) {
        (true, Some(true)) => {
            return Err(ApiError::bad_param(
                "continue_final_message",
                "continue_final_message needs add_generation_prompt: false",
            ));
        }
        (true, _) => false,
        (false, given) => given.unwrap_or(true),
    };
    let last = messages.last().map(|m| (m.role.clone(), m.content.clone()));
    if continue_final && last.as_ref().is_none_or(|(role, _)| role != "assistant") {
        return Err(ApiError::bad_param(
            "continue_final_message",
            "continue_final_message needs the last message to be the assistant's",
        ));
    }
    // The template's variables: the request's chat_template_kwargs, then the tools (as
    // transformers passes them) unless tool_choice is none.
    let mut extra: Vec<(String, Json)> = request
        .chat_template_kwargs
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    if *mode != ToolMode::None
        && let Some(tools) = &request.sampling.tools
    {
        extra.push(("tools".into(), Json::Array(tools.clone())));
    }
    let add_special_tokens = request.add_special_tokens.unwrap_or(false);
    let shared = Arc::clone(state);
    state
        .off_runtime(move || {
            let template = shared.chat_template.as_ref().expect("checked before");
            let mut text = template
                .render_with(&messages, add_generation_prompt, &extra)
                .map_err(|e| match e {
                    TemplateError::Thread(_)
                    | TemplateError::Spawn(_)
                    | TemplateError::WorkerStart { .. } => ApiError::unavailable(e.to_string()),
                    e => ApiError::bad_param("messages", format!("chat template: {e}")),
                })?;
            if let Some((_, content)) = last.filter(|_| continue_final) {
                // End the prompt where the last message's text ends: the model continues it.
                let end = continuation_end(&text, &content).ok_or_else(|| {
                    ApiError::bad_param(
                        "continue_final_message",
                        "the chat template does not write the last message's text",
                    )
                })?;
                text.truncate(end);
            }
            if !truncating {
                params::fits_by_bytes(text.len(), max_tokens, "messages", &shared.limits)?;
                let (max_tokens, len) = (max_tokens.map(|(m, _)| m), shared.limits.max_model_len);
                prompt_pieces::fits_by_pieces(
                    &shared.tokenizer,
                    &text,
                    max_tokens,
                    len,
                    "messages",
                )?;
            }
            // The template writes the special tokens (BOS) itself, unless asked. A prompt to be
            // truncated is tokenized from its end, as far back as its kept tokens need.
            match keep {
                Some(k) => {
                    prompt_pieces::last_tokens(&shared.tokenizer, &text, k, add_special_tokens)
                }
                None => shared.tokenizer.encode(&text, add_special_tokens),
            }
            .map_err(|e| ApiError::bad_param("messages", format!("cannot tokenize: {e}")))
        })
        .await?
}

/// Where a rendered prompt ends for the model to continue its last message, `content`:
/// after the last place the template wrote it. A template may trim the message (Llama 3's
/// `| trim`), so it is looked for without its surrounding whitespace, and kept with its trailing
/// whitespace only where the template kept that too, as transformers does.
fn continuation_end(rendered: &str, content: &str) -> Option<usize> {
    let trimmed = content.trim();
    let at = rendered.rfind(trimmed)?;
    let kept = content.trim_start();
    Some(match rendered[at..].starts_with(kept) {
        true => at + kept.len(),
        false => at + trimmed.len(),
    })
}

struct ChatShape {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    include_usage: bool,
    tools: ToolMode,
    /// `parallel_tool_calls`: false keeps at most one call (the first), as OpenAI answers.
    parallel_tool_calls: bool,
    /// The text holds the tool-call tags although they are special tokens (decoded by
    /// [`tools::tag_decoder`]'s tokenizer, for the parser): they never reach the content.
    hidden_tags: bool,
    /// Streamed `required` / `auto` choices: their text so far, held back until it can be
    /// told apart into content and calls (at the choice's end).
    buffered: Mutex<Vec<String>>,
}

fn token_logprob(info: &TokenInfo) -> ChatTokenLogprob {
    let entry = |info: &TokenInfo| ChatTokenLogprob {
        token: info.text.clone(),
        logprob: info.logprob,
        bytes: info.bytes.clone(),
        top_logprobs: None,
    };
    ChatTokenLogprob {
        top_logprobs: Some(info.top.iter().map(entry).collect()),
        ..entry(info)
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

impl ChatShape {
    /// The message of a whole choice's text: content, or calls (`finish` becomes
    /// `tool_calls` for `required` and `auto` calls, as OpenAI answers).
    fn message(
        &self,
        choice: usize,
        text: String,
        finish: Option<&str>,
    ) -> (ResponseMessage, Option<String>) {
        let mut parsed = tools::parse(&self.tools, &text, self.parallel_tool_calls);
        if self.hidden_tags {
            parsed.content = parsed.content.as_deref().map(tools::without_tags);
        }
        let finish = finish.map(str::to_string);
        if parsed.calls.is_empty() {
            let message = ResponseMessage {
                role: Some("assistant".into()),
                content: parsed.content,
                tool_calls: None,
            };
            return (message, finish);
        }
        let calls = parsed
            .calls
            .iter()
            .enumerate()
            .map(|(i, (name, arguments))| {
                tools::call(self.call_id(choice, i), name, arguments.clone())
            })
            .collect();
        let finish = match (&self.tools, finish.as_deref()) {
            (ToolMode::Required | ToolMode::Auto, Some("stop")) => Some("tool_calls".into()),
            _ => finish,
        };
        let message = ResponseMessage {
            role: Some("assistant".into()),
            content: parsed.content,
            tool_calls: Some(calls),
        };
        (message, finish)
    }

    fn call_id(&self, choice: usize, call: usize) -> String {
        format!("call-{}-{choice}-{call}", self.id)
    }

    fn chunk_of(
        &self,
        index: usize,
        delta: ResponseMessage,
        delta_logprobs: Option<ChatLogprobs>,
        finish: Option<String>,
    ) -> String {
        self.envelope(
            "chat.completion.chunk",
            vec![ChatChoice {
                index,
                message: None,
                delta: Some(delta),
                logprobs: delta_logprobs,
                finish_reason: finish,
            }],
            chunk_usage(self.include_usage),
        )
    }
}

// ANCHOR: stream_calls
impl Shape for ChatShape {
    fn opening_chunks(&self, choices: usize) -> Vec<String> {
        (0..choices)
            .map(|index| {
                // A named call's name is known before its first token: it opens the call.
                let tool_calls = match &self.tools {
                    ToolMode::Named(name) => Some(vec![ToolCall {
                        index: Some(0),
                        ..tools::call(self.call_id(index, 0), name, String::new())
                    }]),
                    _ => None,
                };
                let content = tool_calls.is_none().then(String::new);
                self.chunk_of(
                    index,
                    ResponseMessage {
                        role: Some("assistant".into()),
                        content,
                        tool_calls,
                    },
                    None,
                    None,
                )
            })
            .collect()
    }

    fn chunk(&self, delta: &Delta) -> String {
        let finish = delta.finish_reason.map(str::to_string);
        let logprobs = self.logprobs(&[delta]);
        match &self.tools {
            ToolMode::None => self.chunk_of(
                delta.choice,
                ResponseMessage {
                    role: None,
                    content: (!delta.text.is_empty()).then(|| delta.text.clone()),
                    tool_calls: None,
                },
                logprobs,
                finish,
            ),
            // A named call streams its arguments as they come.
            ToolMode::Named(_) => self.chunk_of(
                delta.choice,
                ResponseMessage {
                    tool_calls: (!delta.text.is_empty()).then(|| {
                        vec![ToolCall {
                            index: Some(0),
                            function: FunctionCall {
                                name: None,
                                arguments: Some(delta.text.clone()),
                            },
                            ..ToolCall::default()
                        }]
                    }),
                    ..ResponseMessage::default()
                },
                logprobs,
                finish,
            ),
            // Content or calls? Known at the end: hold the text until then.
            ToolMode::Required | ToolMode::Auto => {
                let mut buffered = self.buffered.lock().unwrap_or_else(|p| p.into_inner());
                let Some(text) = buffered.get_mut(delta.choice) else {
                    return String::new();
                };
                text.push_str(&delta.text);
                if delta.finish_reason.is_none() {
                    return self.chunk_of(delta.choice, ResponseMessage::default(), logprobs, None);
                }
                let text = std::mem::take(text);
                drop(buffered);
                let (mut message, finish) = self.message(delta.choice, text, delta.finish_reason);
                message.role = None;
                if let Some(calls) = &mut message.tool_calls {
                    for (i, call) in calls.iter_mut().enumerate() {
                        call.index = Some(i);
                    }
                }
                self.chunk_of(delta.choice, message, logprobs, finish)
            }
        }
    }
    // ANCHOR_END: stream_calls

    fn usage_chunk(&self, usage: Usage) -> String {
        self.envelope("chat.completion.chunk", Vec::new(), Some(Some(usage)))
    }

    fn response(&self, choices: Vec<Vec<Delta>>, usage: Usage) -> String {
        let choices = choices
            .into_iter()
            .enumerate()
            .map(|(index, deltas)| {
                let deltas: Vec<&Delta> = deltas.iter().collect();
                let text: String = deltas.iter().map(|d| d.text.as_str()).collect();
                let finish = deltas.iter().rev().find_map(|d| d.finish_reason);
                let (message, finish_reason) = self.message(index, text, finish);
                ChatChoice {
                    index,
                    message: Some(message),
                    delta: None,
                    logprobs: self.logprobs(&deltas),
                    finish_reason,
                }
            })
            .collect();
        self.envelope("chat.completion", choices, Some(Some(usage)))
    }
}

#[cfg(test)]
mod tests {
    use super::continuation_end;

    #[test]
    fn a_continued_message_ends_where_the_template_wrote_it() {
        // The template keeps the text as it is: the prompt ends after it, spaces included.
        let kept = "<|user|>Hi<|assistant|>The answer is ";
        assert_eq!(continuation_end(kept, "The answer is "), Some(kept.len()));
        // The template trims it (Llama 3's `| trim`): the prompt ends after the trimmed text.
        let trimmed = "<|user|>Hi<|assistant|>The answer is<|eot|>";
        let end = continuation_end(trimmed, "The answer is ").unwrap();
        assert_eq!(&trimmed[..end], "<|user|>Hi<|assistant|>The answer is");
        // The last place it appears, and none at all.
        let twice = "<|user|>Yes<|assistant|>Yes";
        assert_eq!(continuation_end(twice, "Yes"), Some(twice.len()));
        assert_eq!(continuation_end(kept, "Goodbye"), None);
    }
}
