//! The OpenAI wire format: request bodies as clients send them, responses and stream chunks
//! as clients parse them.
//!
//! Requests deny unknown fields: a misspelt parameter (`max_token`) is an error, not a silent
//! default. Fields OpenAI defines that kiln does not implement are parsed only to be rejected
//! with a clear message in [`crate::params`], so nothing accepted is ever ignored.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::chat_template::ChatMessage;

/// `"stop": "x"` or `"stop": ["x", "y"]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

/// The four shapes of a completions `prompt`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default, deserialize_with = "null_is_false")]
    pub include_usage: bool,
}

/// What completions and chat requests share: sampling and stopping.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM's extension; `-1` or `0` disable it.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub n: Option<u32>,
    pub stop: Option<StringOrList>,
    /// vLLM's extension: token ids that end generation, besides EOS.
    pub stop_token_ids: Option<Vec<u32>>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    #[serde(default, deserialize_with = "null_is_false")]
    pub ignore_eos: bool,
    #[serde(default, deserialize_with = "null_is_false")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// An end-user id; it names the caller and never changes generation.
    pub user: Option<String>,
    /// `{"token id": bias}`, each bias in -100..=100, added to the logit.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}`.
    pub response_format: Option<Value>,
    /// Chat only (rejected by completions): the functions the model may call.
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// Accepted as vLLM does: a `required` call may list several functions.
    pub parallel_tool_calls: Option<bool>,
    // vLLM's extensions.
    /// Output matches this JSON schema (an object, or its JSON text).
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    /// A Lark grammar.
    pub guided_grammar: Option<String>,
    /// vLLM's newer form of the four above.
    pub structured_outputs: Option<StructuredOutputs>,
    /// Only these tokens may be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Words (each tokenized with and without a leading space) that are never generated.
    pub bad_words: Option<Vec<String>>,
    /// EOS and stop_token_ids are masked until this many tokens are out.
    pub min_tokens: Option<u32>,
    /// Keep the text of the stop token (`stop_token_ids`, EOS) that ended a choice at the end
    /// of its text; refused with `stop` strings, which are always cut.
    #[serde(default, deserialize_with = "null_is_false")]
    pub include_stop_str_in_output: bool,
    /// Only `true` (the default): kiln never writes special tokens into the text.
    pub skip_special_tokens: Option<bool>,
    /// Only `true` (the default), for the same reason.
    pub spaces_between_special_tokens: Option<bool>,
    /// Scheduling priority: lower runs first (vLLM's); 0 by default.
    pub priority: Option<i32>,
    /// Keep only the prompt's last this many tokens (`-1`: the model's context).
    pub truncate_prompt_tokens: Option<i64>,
    // Defined by OpenAI or vLLM, not implemented by kiln: rejected unless they ask for the
    // default.
    pub best_of: Option<u32>,
    pub suffix: Option<String>,
    pub prompt_logprobs: Option<u32>,
}

/// vLLM's `structured_outputs`: one of its fields.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    #[serde(default, deserialize_with = "null_is_false")]
    pub json_object: bool,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    /// Default 16, as OpenAI's.
    pub max_tokens: Option<u32>,
    /// Return the `logprobs` most likely tokens at each position, besides the sampled one.
    pub logprobs: Option<u32>,
    #[serde(default, deserialize_with = "null_is_false")]
    pub echo: bool,
    /// Add the tokenizer's special tokens (BOS) to a text prompt; default true.
    pub add_special_tokens: Option<bool>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// A chat message's `content`: a string, or a list of parts of which kiln reads the text ones.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RequestMessage {
    pub role: String,
    /// May be null for an assistant message that only called tools.
    pub content: Option<MessageContent>,
    /// A participant's name, passed to the chat template (which may or may not write it).
    pub name: Option<String>,
    /// An assistant message's tool calls, as a response carried them.
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the id of the call it answers.
    pub tool_call_id: Option<String>,
    /// What an OpenAI response's assistant message may carry back into the history (a
    /// refusal's text, audio, annotations such as URL citations; vLLM's reasoning text):
    /// accepted, and left out of the prompt. openai-python's `model_dump()` writes them, null
    /// or empty, into every assistant message.
    #[serde(default, rename = "refusal")]
    pub _refusal: Option<Value>,
    #[serde(default, rename = "audio")]
    pub _audio: Option<Value>,
    #[serde(default, rename = "annotations")]
    pub _annotations: Option<Value>,
    #[serde(default, rename = "reasoning_content")]
    pub _reasoning_content: Option<Value>,
    /// The deprecated form of `tool_calls`: accepted when null (as `model_dump()` writes it);
    /// a call in it is refused, since the template would never see it.
    #[serde(default)]
    pub function_call: Option<Value>,
}

/// A boolean the OpenAI API allows to be `null`: absent and `null` both read as false.
fn null_is_false<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<RequestMessage>,
    pub max_tokens: Option<u32>,
    /// OpenAI's newer name for `max_tokens`; give at most one of the two.
    pub max_completion_tokens: Option<u32>,
    #[serde(default, deserialize_with = "null_is_false")]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
    /// transformers' `add_generation_prompt` (vLLM's extension), default true.
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: the last (assistant) message is left open for the model to continue; needs
    /// `add_generation_prompt: false`.
    #[serde(default, deserialize_with = "null_is_false")]
    pub continue_final_message: bool,
    /// vLLM's: more variables for the chat template.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// vLLM's: add the tokenizer's special tokens to the rendered prompt (default false: the
    /// template writes them).
    pub add_special_tokens: Option<bool>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

impl RequestMessage {
    /// The message as the chat template sees it: the text parts joined by newlines.
    pub fn to_template(&self) -> Result<ChatMessage, String> {
        if self.function_call.is_some() {
            return Err("function_call is not supported: send the call in tool_calls".into());
        }
        let content = match &self.content {
            None if self.role == "assistant" && self.tool_calls.is_some() => String::new(),
            None => return Err(format!("a {} message needs content", self.role)),
            Some(MessageContent::Text(text)) => text.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut texts = Vec::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(text)) => texts.push(text.as_str()),
                        ("text", None) => {
                            return Err("a content part of type \"text\" needs a `text`".into());
                        }
                        (kind, _) => {
                            return Err(format!(
                                "content parts of type {kind:?} are not supported (text only)"
                            ));
                        }
                    }
                }
                texts.join("\n")
            }
        };
        if self.tool_calls.is_some() && self.role != "assistant" {
            return Err(format!("a {} message cannot carry tool_calls", self.role));
        }
        if self.role == "tool" && self.tool_call_id.is_none() {
            return Err("a tool message needs tool_call_id".into());
        }
        let tool_calls = match &self.tool_calls {
            None => None,
            Some(calls) => Some(calls.iter().map(template_call).collect::<Result<_, _>>()?),
        };
        Ok(ChatMessage {
            role: self.role.clone(),
            content,
            name: self.name.clone(),
            tool_calls,
            tool_call_id: self.tool_call_id.clone(),
        })
    }
}

/// A tool call as templates read it: `function.arguments` as an object (transformers'
/// convention), parsed from the JSON text OpenAI sends.
fn template_call(call: &Value) -> Result<Value, String> {
    let mut call = call.clone();
    let function = call
        .get_mut("function")
        .and_then(Value::as_object_mut)
        .ok_or("a tool call needs a function object")?;
    if !function.get("name").is_some_and(Value::is_string) {
        return Err("a tool call's function needs a name".into());
    }
    if let Some(Value::String(text)) = function.get("arguments") {
        let parsed: Value = serde_json::from_str(text)
            .map_err(|e| format!("a tool call's arguments are not JSON: {e}"))?;
        function.insert("arguments".into(), parsed);
    }
    Ok(call)
}

// ───────────────────────────────────────── responses ─────────────────────────────────────────

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// Completions' logprobs: parallel lists, one entry per token. `text_offset[i]` is the byte
/// offset in the choice's text (echo included) where `tokens[i]` starts.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<TopLogprobs>,
    pub text_offset: Vec<usize>,
}

/// One position's alternatives, `{token text: logprob}`, written most likely first (a JSON
/// object keeps the order it is written in; a sorted map would put them in key order).
/// Invariant: no text appears twice (of two tokens with the same text, the likelier is kept).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobs(Vec<(String, f32)>);

impl TopLogprobs {
    /// From alternatives best first; a text seen before is skipped.
    pub fn new(best_first: impl IntoIterator<Item = (String, f32)>) -> Self {
        let mut entries: Vec<(String, f32)> = Vec::new();
        for (text, logprob) in best_first {
            if !entries.iter().any(|(t, _)| *t == text) {
                entries.push((text, logprob));
            }
        }
        TopLogprobs(entries)
    }

    /// The entries in the order they are written.
    pub fn entries(&self) -> &[(String, f32)] {
        &self.0
    }
}

impl Serialize for TopLogprobs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (text, logprob) in &self.0 {
            map.serialize_entry(text, logprob)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for TopLogprobs {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Ordered;
        impl<'de> serde::de::Visitor<'de> for Ordered {
            type Value = TopLogprobs;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object of token texts to logprobs")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, f32>()? {
                    entries.push(entry);
                }
                Ok(TopLogprobs(entries))
            }
        }
        deserializer.deserialize_map(Ordered)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

/// A completions response, or one chunk of a stream. `usage`: absent (`None`) in a stream
/// that did not ask for it; in one that did, `null` (`Some(None)`) in every chunk but the
/// last, which has the counts (as a whole response does).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub usage: Option<Option<Usage>>,
}

/// A field that is present, `null` or not: `Some(None)` for `null` (absent is the default).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<Usage>>, D::Error> {
    Option::<Usage>::deserialize(d).map(Some)
}

/// Chat's logprobs: one entry per token, with its bytes and alternatives.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<ChatTokenLogprob>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ResponseMessage {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// A tool call in a response, or a piece of one in a stream chunk (OpenAI's shape: the first
/// piece has `id`, `type` and the name; later ones more `arguments` text).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ToolCall {
    /// Stream chunks only: which call of the message this piece belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FunctionCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The arguments as JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatChoice {
    pub index: usize,
    /// `message` in a response, `delta` in a stream chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<ResponseMessage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<ResponseMessage>,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    /// As [`CompletionResponse::usage`].
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    pub max_model_len: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_parse_in_all_four_shapes() {
        let parse = |v: &str| {
            serde_json::from_str::<CompletionRequest>(&format!(
                r#"{{"model": "m", "prompt": {v}}}"#
            ))
            .map(|r| r.prompt)
        };
        assert_eq!(parse(r#""hi""#).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(
            parse(r#"["a", "b"]"#).unwrap(),
            Prompt::Texts(vec!["a".into(), "b".into()])
        );
        assert_eq!(parse("[1, 2]").unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(
            parse("[[1], [2, 3]]").unwrap(),
            Prompt::TokenLists(vec![vec![1], vec![2, 3]])
        );
        assert!(parse("3").is_err());
    }

    /// What the OpenAI API allows and its clients send: `null` for a boolean, and an
    /// assistant message carried back from a response with its `refusal` and `audio`.
    #[test]
    fn null_booleans_and_a_responses_message_fields_parse() {
        let chat: ChatRequest = serde_json::from_str(
            r#"{"model": "m", "stream": null, "logprobs": null, "ignore_eos": null,
                "stream_options": {"include_usage": null},
                "messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "yes", "refusal": null,
                              "audio": null}]}"#,
        )
        .unwrap();
        assert!(!chat.sampling.stream && !chat.logprobs);
        assert_eq!(chat.messages.len(), 2);
        let completion: CompletionRequest =
            serde_json::from_str(r#"{"model": "m", "prompt": "hi", "echo": null}"#).unwrap();
        assert!(!completion.echo);
        assert!(
            serde_json::from_str::<CompletionRequest>(
                r#"{"model": "m", "prompt": "hi", "echo": 3}"#
            )
            .is_err()
        );
    }

    #[test]
    fn unknown_fields_are_errors_in_both_requests() {
        let completion = r#"{"model": "m", "prompt": "x", "max_token": 3}"#;
        let err = serde_json::from_str::<CompletionRequest>(completion).unwrap_err();
        assert!(err.to_string().contains("max_token"), "{err}");
        let chat = r#"{"model": "m", "messages": [], "temprature": 1}"#;
        let err = serde_json::from_str::<ChatRequest>(chat).unwrap_err();
        assert!(err.to_string().contains("temprature"), "{err}");
    }

    #[test]
    fn top_logprobs_are_written_best_first_not_in_key_order() {
        let top = TopLogprobs::new([
            ("z".to_string(), -0.1),
            ("a".to_string(), -1.5),
            ("z".to_string(), -2.0),
            ("m".to_string(), -3.0),
        ]);
        let text = serde_json::to_string(&top).unwrap();
        assert_eq!(text, r#"{"z":-0.1,"a":-1.5,"m":-3.0}"#);
        let back: TopLogprobs = serde_json::from_str(&text).unwrap();
        assert_eq!(back, top);
    }

    #[test]
    fn usage_is_absent_null_or_counts() {
        let chunk = |usage: Option<Option<Usage>>| CompletionResponse {
            id: "c".into(),
            object: "text_completion".into(),
            created: 0,
            model: "m".into(),
            choices: Vec::new(),
            usage,
        };
        for usage in [None, Some(None), Some(Some(Usage::new(2, 3)))] {
            let text = serde_json::to_string(&chunk(usage)).unwrap();
            let value: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(value.get("usage").is_some(), usage.is_some(), "{text}");
            let back: CompletionResponse = serde_json::from_str(&text).unwrap();
            assert_eq!(back.usage, usage);
        }
    }

    #[test]
    fn shared_fields_parse_through_the_flattened_sampling() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                "temperature": 0.5, "stop": "x", "stream": true, "stream_options": {"include_usage": true}}"#,
        )
        .unwrap();
        assert_eq!(r.sampling.temperature, Some(0.5));
        assert_eq!(r.sampling.stop, Some(StringOrList::One("x".into())));
        assert!(r.sampling.stream && r.sampling.stream_options.unwrap().include_usage);
        assert_eq!(r.messages[0].to_template().unwrap().content, "a\nb");
        // A part the template cannot take is named for what is wrong with it.
        for (part, says) in [
            (r#"{"type": "text"}"#, "needs a `text`"),
            (
                r#"{"type": "image_url", "image_url": {"url": "x"}}"#,
                "\"image_url\" are not supported",
            ),
        ] {
            let body = format!(
                r#"{{"model": "m", "messages": [{{"role": "user", "content": [{part}]}}]}}"#
            );
            let r: ChatRequest = serde_json::from_str(&body).unwrap();
            let err = r.messages[0].to_template().unwrap_err();
            assert!(err.contains(says), "{part}: {err}");
        }
    }

    #[test]
    fn tool_messages_and_calls_reach_the_template_with_parsed_arguments() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"model": "m", "messages": [
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "f"}]}"#,
        )
        .unwrap();
        let call = r.messages[0].to_template().unwrap();
        assert_eq!(call.content, "");
        assert_eq!(call.tool_calls.unwrap()[0]["function"]["arguments"]["x"], 1);
        let answer = r.messages[1].to_template().unwrap();
        assert_eq!(answer.tool_call_id.as_deref(), Some("c1"));
        assert_eq!(answer.name.as_deref(), Some("f"));
        let no_id: RequestMessage =
            serde_json::from_str(r#"{"role": "tool", "content": "42"}"#).unwrap();
        assert!(no_id.to_template().is_err());
    }
}
