//! The streaming HTTP client of `kiln bench serve`: one OpenAI request, timed chunk by chunk.
//!
//! ```text
//! POST /v1/completions {"prompt", "max_tokens", "stream": true,
//!                       "stream_options": {"include_usage": true}, ...}
//!   ← data: {"choices":[{"text":"To"}]}           t₁ = TTFT (from the send)
//!   ← data: {"choices":[{"text":" be"}]}          t₂   (ITL = t₂ − t₁)
//!   ← data: {"choices":[],"usage":{...}}          prompt_tokens, completion_tokens
//!   ← data: [DONE]                                e2e latency
//! ```
//!
//! [`SseLines`] and [`parse_chunk`] are pure (unit-tested below); [`send`] does the network.
//! A chunk is timed when the network read that completes it arrives, so several chunks that
//! arrive in one read share a time, as they do for every client.

use std::time::Instant;

use futures_util::StreamExt;
use serde_json::{Value, json};

/// Which OpenAI API the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`: `prompt`, text in `choices[0].text`.
    Completions,
    /// `/v1/chat/completions`: one user message, text in `choices[0].delta.content`.
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "/v1/completions" => Ok(Endpoint::Completions),
            "/v1/chat/completions" => Ok(Endpoint::Chat),
            _ => Err(format!(
                "unknown endpoint {s:?}: expected /v1/completions or /v1/chat/completions"
            )),
        }
    }
}

/// What every request of a run shares.
#[derive(Debug, Clone)]
pub struct RequestConfig {
    /// e.g. `http://127.0.0.1:8000/v1/completions`.
    pub url: String,
    pub endpoint: Endpoint,
    pub model: String,
    pub api_key: Option<String>,
    pub temperature: f64,
    pub ignore_eos: bool,
}

impl RequestConfig {
    /// The JSON body of one streamed request.
    pub fn body(&self, prompt: &str, max_tokens: usize) -> Value {
        let mut body = json!({
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        match self.endpoint {
            Endpoint::Completions => body["prompt"] = json!(prompt),
            Endpoint::Chat => body["messages"] = json!([{"role": "user", "content": prompt}]),
        }
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        body
    }
}

// ─────────────────────────────── server-sent events ───────────────────────────────

/// One `data:` payload of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseData {
    /// A JSON chunk (not parsed yet).
    Json(String),
    /// `data: [DONE]`: the stream is over.
    Done,
}

/// Cuts a byte stream into server-sent-event `data:` payloads. Bytes arrive in network reads
/// that split lines (and UTF-8 characters) anywhere, so an incomplete line waits in the buffer
/// for the next read. OpenAI servers send one `data:` line per event, so every `data:` line is
/// a payload; comments (`: keep-alive`), blank lines and other fields are skipped.
#[derive(Debug, Default)]
pub struct SseLines {
    buf: Vec<u8>,
}

impl SseLines {
    /// The payloads of every line that `bytes` completes.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseData> {
        self.buf.extend_from_slice(bytes);
        let Some(last_newline) = self.buf.iter().rposition(|&b| b == b'\n') else {
            return Vec::new();
        };
        let rest = self.buf.split_off(last_newline + 1);
        let complete = std::mem::replace(&mut self.buf, rest);
        complete
            .split(|&b| b == b'\n')
            .filter_map(data_of_line)
            .collect()
    }

    /// The payload of a last line that did not end in a newline, if any.
    pub fn finish(&mut self) -> Option<SseData> {
        data_of_line(&std::mem::take(&mut self.buf))
    }
}

fn data_of_line(line: &[u8]) -> Option<SseData> {
    let line = String::from_utf8_lossy(line);
    let line = line.strip_suffix('\r').unwrap_or(&line);
    let data = line.strip_prefix("data:")?;
    let data = data.strip_prefix(' ').unwrap_or(data);
    Some(if data.trim() == "[DONE]" {
        SseData::Done
    } else {
        SseData::Json(data.to_string())
    })
}

/// Token counts of the final `usage` chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What one JSON chunk carries.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Chunk {
    /// Generated text, when non-empty (a chat stream's first chunk carries only the role).
    pub text: Option<String>,
    pub usage: Option<Usage>,
    /// An error the server reported inside the stream.
    pub error: Option<String>,
}

/// Reads one chunk of either endpoint's stream.
pub fn parse_chunk(payload: &str) -> Result<Chunk, String> {
    let value: Value =
        serde_json::from_str(payload).map_err(|e| format!("bad chunk {payload:?}: {e}"))?;
    let choice = &value["choices"][0];
    let text = choice["text"]
        .as_str()
        .or_else(|| choice["delta"]["content"].as_str())
        .filter(|t| !t.is_empty())
        .map(str::to_string);
    let count = |key: &str| value["usage"][key].as_u64().map(|n| n as usize);
    let usage = match (count("prompt_tokens"), count("completion_tokens")) {
        (Some(prompt_tokens), Some(completion_tokens)) => Some(Usage {
            prompt_tokens,
            completion_tokens,
        }),
        _ => None,
    };
    let error = (!value["error"].is_null()).then(|| error_message(&value));
    Ok(Chunk { text, usage, error })
}

/// The message of an OpenAI error body (`{"error": {"message": ...}}`), else the body itself.
pub fn error_message(body: &Value) -> String {
    body["error"]["message"]
        .as_str()
        .or_else(|| body["error"].as_str())
        .or_else(|| body["message"].as_str())
        .map_or_else(|| body.to_string(), str::to_string)
}

// ─────────────────────────────── one request ───────────────────────────────

/// What one request measured. Times in seconds from the moment it was sent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timed {
    /// The arrival of every chunk that carried text; the first is the TTFT.
    pub chunk_times: Vec<f64>,
    /// Sent → end of the stream.
    pub e2e: f64,
    pub usage: Option<Usage>,
    /// Characters of generated text.
    pub output_chars: usize,
}

/// Sends one streamed request and times its chunks. `Err`: the HTTP status and the server's
/// message, or the transport error.
pub async fn send(
    client: &reqwest::Client,
    config: &RequestConfig,
    prompt: &str,
    max_tokens: usize,
) -> Result<Timed, String> {
    let sent = Instant::now();
    let mut request = client
        .post(&config.url)
        .json(&config.body(prompt, max_tokens));
    if let Some(key) = &config.api_key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.map_err(|e| transport_error(&e))?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&body)
            .map(|v| error_message(&v))
            .unwrap_or(body);
        return Err(format!("HTTP {}: {}", status.as_u16(), message.trim()));
    }
    let mut timed = Timed::default();
    let mut lines = SseLines::default();
    let mut stream = response.bytes_stream();
    'stream: loop {
        let read = stream.next().await;
        let at = sent.elapsed().as_secs_f64();
        let ended = read.is_none();
        let payloads = match read {
            Some(bytes) => lines.push(&bytes.map_err(|e| transport_error(&e))?),
            None => lines.finish().into_iter().collect(),
        };
        for payload in payloads {
            let chunk = match payload {
                SseData::Done => break 'stream,
                SseData::Json(json) => parse_chunk(&json)?,
            };
            if let Some(error) = chunk.error {
                return Err(format!("error in the stream: {error}"));
            }
            if let Some(text) = chunk.text {
                timed.output_chars += text.chars().count();
                timed.chunk_times.push(at);
            }
            timed.usage = chunk.usage.or(timed.usage);
        }
        if ended {
            return Err("the stream ended before data: [DONE]".to_string());
        }
    }
    timed.e2e = sent.elapsed().as_secs_f64();
    // Read to the end, so the connection goes back to the pool.
    while let Some(Ok(_)) = stream.next().await {}
    Ok(timed)
}

fn transport_error(e: &reqwest::Error) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message = format!("{message}: {s}");
        source = s.source();
    }
    message
}

/// `GET /v1/models`: the ids the server serves. The first call of a run, so a server that is
/// not there is reported here, with its URL.
pub async fn list_models(
    client: &reqwest::Client,
    base_url: &str,
    api_key: Option<&str>,
) -> anyhow::Result<Vec<String>> {
    let url = format!("{base_url}/v1/models");
    let mut request = client.get(&url);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.map_err(|e| {
        anyhow::anyhow!(
            "cannot reach the server at {base_url} ({}). Is `kiln serve` running there?",
            transport_error(&e)
        )
    })?;
    let status = response.status();
    let body: Value = response
        .json()
        .await
        .map_err(|e| anyhow::anyhow!("GET {url}: HTTP {status}, not JSON: {e}"))?;
    anyhow::ensure!(
        status.is_success(),
        "GET {url}: HTTP {}: {}",
        status.as_u16(),
        error_message(&body)
    );
    Ok(body["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str().map(str::to_string))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(s: &str) -> SseData {
        SseData::Json(s.to_string())
    }

    #[test]
    fn sse_lines_survive_any_split_of_the_stream() {
        let stream = "data: {\"a\":1}\n\n: keep-alive\n\ndata:{\"b\":\"é\"}\r\n\r\nevent: x\ndata: [DONE]\n\n";
        let expected = vec![json("{\"a\":1}"), json("{\"b\":\"é\"}"), SseData::Done];
        let bytes = stream.as_bytes();
        // Every split into two reads, including inside the two-byte `é`.
        for cut in 0..=bytes.len() {
            let mut lines = SseLines::default();
            let mut got = lines.push(&bytes[..cut]);
            got.extend(lines.push(&bytes[cut..]));
            assert_eq!(got, expected, "cut at {cut}");
            assert_eq!(lines.finish(), None);
        }
        // One byte per read.
        let mut lines = SseLines::default();
        let got: Vec<SseData> = bytes.iter().flat_map(|b| lines.push(&[*b])).collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn a_last_line_without_newline_is_read_at_the_end() {
        let mut lines = SseLines::default();
        assert_eq!(lines.push(b"data: {}\ndata: [DO"), vec![json("{}")]);
        assert_eq!(lines.push(b"NE]"), vec![]);
        assert_eq!(lines.finish(), Some(SseData::Done));
        assert_eq!(lines.finish(), None);
    }

    #[test]
    fn chunks_of_both_endpoints() {
        let completion = parse_chunk(r#"{"choices":[{"index":0,"text":" be"}]}"#).unwrap();
        assert_eq!(completion.text.as_deref(), Some(" be"));
        assert_eq!(completion.usage, None);
        let role = parse_chunk(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#);
        assert_eq!(role.unwrap(), Chunk::default());
        let chat = parse_chunk(r#"{"choices":[{"delta":{"content":"To"}}]}"#).unwrap();
        assert_eq!(chat.text.as_deref(), Some("To"));
        let usage = parse_chunk(
            r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":16,"total_tokens":23}}"#,
        )
        .unwrap();
        assert_eq!(
            usage.usage,
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 16
            })
        );
        assert_eq!(usage.text, None);
        let null_usage = parse_chunk(r#"{"choices":[{"text":"x"}],"usage":null}"#).unwrap();
        assert_eq!(null_usage.usage, None);
        let error = parse_chunk(r#"{"error":{"message":"engine died","code":500}}"#).unwrap();
        assert_eq!(error.error.as_deref(), Some("engine died"));
        assert!(parse_chunk("not json").is_err());
    }

    #[test]
    fn error_messages_of_openai_bodies() {
        let body =
            json!({"error": {"message": "max_tokens too large", "type": "invalid_request_error"}});
        assert_eq!(error_message(&body), "max_tokens too large");
        assert_eq!(error_message(&json!({"error": "nope"})), "nope");
        assert_eq!(error_message(&json!({"x": 1})), r#"{"x":1}"#);
    }

    #[test]
    fn request_bodies() {
        let mut config = RequestConfig {
            url: "http://h/v1/completions".into(),
            endpoint: Endpoint::Completions,
            model: "m".into(),
            api_key: None,
            temperature: 0.0,
            ignore_eos: false,
        };
        let body = config.body("HAMLET.", 16);
        assert_eq!(body["prompt"], "HAMLET.");
        assert_eq!(body["max_tokens"], 16);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert!(body.get("ignore_eos").is_none() && body.get("messages").is_none());
        config.endpoint = Endpoint::Chat;
        config.ignore_eos = true;
        let body = config.body("Hi", 4);
        assert_eq!(body["messages"], json!([{"role": "user", "content": "Hi"}]));
        assert_eq!(body["ignore_eos"], true);
        assert!(body.get("prompt").is_none());
        assert_eq!("/v1/chat/completions".parse(), Ok(Endpoint::Chat));
        assert!("/v1/embeddings".parse::<Endpoint>().is_err());
    }
}
