//! What the server's integration tests share: the model loaded once, a server on a free port
//! per test, a streaming reader, and the checks of OpenAI's shapes.
#![allow(dead_code)]

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use ch01::SamplingParams;
use ch01::{Llama, Tokenizer};
use ch03::{KvDtype, KvPool};
use ch04::{CacheConfig, CpuExecutor, Engine, EngineConfig, FinishReason, Request};
use ch08_server::auth::ApiKeys;
use ch08_server::chat_template::ChatTemplate;
use ch08_server::state::AppState;
use ch08_server::{ExecutorFactory, ServedModel, ServedWeights, Server, ServerConfig, ServerError};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The model name the test servers serve.
pub const MODEL: &str = "shakespeare";
/// The longest any one wait may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(30);
pub const PROMPT: &str = "ROMEO.\nBut soft, what light through yonder window breaks?";

// ───────────────────────────────────────── the server ─────────────────────────────────────────

pub struct Loaded {
    pub model: Arc<Llama>,
    pub tokenizer: Arc<Tokenizer>,
    pub eos_token_ids: Vec<u32>,
}

/// The model, tokenizer and stop ids, loaded once (as `kiln serve` loads them).
pub fn loaded() -> &'static Loaded {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    LOADED.get_or_init(|| {
        let dir = ch01::default_model_dir();
        let model = ch02::load_fast(&dir, ch02::WeightDtype::F32).expect("load the model");
        let tokenizer = Tokenizer::from_dir(&dir).expect("load the tokenizer");
        let mut eos_token_ids = ch01::eos_token_ids(&dir, &model.config).expect("eos ids");
        if let Some(eos) = tokenizer.eos_token_id()
            && !eos_token_ids.contains(&eos)
        {
            eos_token_ids.push(eos);
        }
        Loaded {
            model: Arc::new(model),
            tokenizer: Arc::new(tokenizer),
            eos_token_ids,
        }
    })
}

/// In a saved `tokenizer.json`, drops the last merge and gives the token it made (which no
/// later merge uses) the text `to`: its id.
pub fn rename_last_merge(saved: &mut Value, to: &str) -> Value {
    let merge = saved["model"]["merges"]
        .as_array_mut()
        .unwrap()
        .pop()
        .unwrap();
    let pieces: Vec<&str> = match &merge {
        Value::String(m) => m.split(' ').collect(),
        m => m
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect(),
    };
    let vocab = saved["model"]["vocab"].as_object_mut().unwrap();
    let id = vocab.remove(&pieces.concat()).unwrap();
    vocab.insert(to.to_string(), id.clone());
    id
}

/// The model's tokenizer with its last two tokens (each made by the last merges, never merged
/// further) turned into the special tokens `<tool_call>` and `</tool_call>`, as some models'
/// tokenizers have them: the model can sample them, and decoded text leaves them out. Their ids.
pub fn tool_tag_tokenizer() -> (Arc<Tokenizer>, [u32; 2]) {
    let dir = ch01::default_model_dir();
    let path = dir.join("tokenizer.json");
    let mut saved: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let mut ids = [0; 2];
    for (i, tag) in ["</tool_call>", "<tool_call>"].into_iter().enumerate() {
        let id = rename_last_merge(&mut saved, tag);
        ids[1 - i] = id.as_u64().unwrap() as u32;
        saved["added_tokens"].as_array_mut().unwrap().push(json!({
            "id": id, "content": tag, "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": true}));
    }
    let inner = tokenizers::Tokenizer::from_bytes(saved.to_string().as_bytes()).unwrap();
    let eos = loaded().tokenizer.eos_token_id();
    let bos = loaded().tokenizer.bos_token_id();
    let tokenizer = Tokenizer::from_parts(inner, path, bos, eos);
    assert_eq!(tokenizer.inner().token_to_id("<tool_call>"), Some(ids[0]));
    assert_eq!(tokenizer.decode(&ids).unwrap(), "", "the tags are special");
    (Arc::new(tokenizer), ids)
}

/// Token count of `text` without special tokens.
pub fn count_tokens(text: &str) -> usize {
    loaded().tokenizer.encode(text, false).unwrap().len()
}

/// The oracle: what chapter 4's engine generates for `prompt` alone, decoded, with its token
/// count and finish reason ("stop" or "length").
pub fn engine_alone(
    prompt: Vec<u32>,
    temperature: f32,
    seed: u64,
    max_tokens: usize,
) -> (String, usize, &'static str) {
    let loaded = loaded();
    let pool = KvPool::<f32>::new(&loaded.model.config, 16, 64).unwrap();
    let mut engine = Engine::new(
        CpuExecutor::new(&loaded.model, pool),
        EngineConfig::default(),
    )
    .unwrap();
    let request = Request {
        prompt,
        params: SamplingParams {
            temperature,
            seed,
            ..SamplingParams::default()
        },
        max_tokens,
        stop_token_ids: loaded.eos_token_ids.clone(),
        ignore_eos: false,
        priority: 0,
        logprobs: None,
    };
    let done = engine.generate(vec![request]).unwrap().remove(0);
    let reason = match done.finish_reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    };
    let text = loaded.tokenizer.decode(&done.tokens).unwrap();
    (text, done.tokens.len(), reason)
}

/// How to configure one test's server.
pub struct Setup {
    pub config: ServerConfig,
    pub keys: Vec<String>,
    /// Blocks of 16 positions in the KV pool (at least 33 for one request of 512).
    pub kv_blocks: usize,
    pub prefix_caching: bool,
    /// Serve as on a GPU: the host keeps only the configuration (`ServedWeights::Elsewhere`) and
    /// an executor factory builds the executor, here chapter 4's CPU executor over the loaded
    /// model, so the answers must be the host-weights server's.
    pub weights_elsewhere: bool,
    /// The tokenizer to serve with, instead of the model's own.
    pub tokenizer: Option<Arc<Tokenizer>>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            config: ServerConfig {
                served_model_name: MODEL.into(),
                shutdown_grace: Duration::from_secs(2),
                ..ServerConfig::default()
            },
            keys: Vec::new(),
            kv_blocks: 128,
            prefix_caching: false,
            weights_elsewhere: false,
            tokenizer: None,
        }
    }
}

pub struct TestServer {
    pub url: String,
    pub client: reqwest::Client,
    pub state: Arc<AppState>,
    pub shutdown: Option<oneshot::Sender<()>>,
    pub task: JoinHandle<Result<(), ServerError>>,
}

/// The server of `setup`, checked and with its engine running, not yet serving.
pub fn build(setup: Setup) -> Result<Server, ServerError> {
    let loaded = loaded();
    let dir = ch01::default_model_dir();
    let block_bytes = KvPool::<f32>::bytes_per_block(&loaded.model.config, 16);
    let cache = CacheConfig {
        memory: block_bytes * setup.kv_blocks as u64,
        block_size: 16,
        dtype: KvDtype::F32,
    };
    let mut config = setup.config;
    config.engine.enable_prefix_caching = setup.prefix_caching;
    let weights = if setup.weights_elsewhere {
        let (model, attention): (&'static Llama, _) = (&loaded.model, config.attention);
        config.executor = Some(ExecutorFactory(Arc::new(move |_config, cache| {
            ch07::populated_cpu_executor(model, cache, attention)
                .map(|e| e as Box<dyn ch04::Executor + Send>)
                .map_err(|e| e.to_string())
        })));
        ServedWeights::Elsewhere(loaded.model.config.clone())
    } else {
        ServedWeights::Host(Arc::clone(&loaded.model))
    };
    let served = ServedModel {
        weights,
        tokenizer: setup
            .tokenizer
            .unwrap_or_else(|| Arc::clone(&loaded.tokenizer)),
        chat_template: ChatTemplate::from_model_dir(&dir).unwrap(),
        eos_token_ids: loaded.eos_token_ids.clone(),
    };
    Server::new(served, cache, ApiKeys::new(setup.keys), config, |f| f())
}

pub async fn start(setup: Setup) -> TestServer {
    let server = build(setup).expect("start the server");
    let state = Arc::clone(server.state());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (shutdown, signal) = oneshot::channel::<()>();
    let task = tokio::spawn(server.run(listener, async move {
        let _ = signal.await;
    }));
    TestServer {
        url,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .unwrap(),
        state,
        shutdown: Some(shutdown),
        task,
    }
}

impl TestServer {
    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.post(format!("{}{path}", self.url))
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.get(format!("{}{path}", self.url))
    }

    /// POSTs `body`, expects 200 and a JSON answer.
    pub async fn json(&self, path: &str, body: &Value) -> Value {
        let response = self.post(path).json(body).send().await.unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        assert_eq!(status, StatusCode::OK, "{path} {body}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    /// POSTs a streaming `body`; every event's JSON up to `data: [DONE]`, which must be last.
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let response = self.post(path).json(body).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path} {body}");
        let kind = response.headers()["content-type"].to_str().unwrap();
        assert!(kind.starts_with("text/event-stream"), "{kind}");
        let mut events = Events::new(response);
        let mut out = Vec::new();
        loop {
            let data = events
                .next()
                .await
                .unwrap_or_else(|| panic!("the stream ended without [DONE] after {out:?}"));
            if data == "[DONE]" {
                break;
            }
            out.push(serde_json::from_str(&data).unwrap());
        }
        assert!(events.next().await.is_none(), "events after [DONE]");
        out
    }

    /// POSTs a streaming `body`, expects 200; its events as they come.
    pub async fn open_stream(&self, path: &str, body: &Value) -> Events {
        let response = self.post(path).json(body).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path} {body}");
        Events::new(response)
    }

    pub async fn metrics(&self) -> String {
        let response = self.get("/metrics").send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.text().await.unwrap()
    }

    /// Polls `/metrics` until nothing runs or waits and the KV cache is empty; its text then.
    pub async fn wait_idle(&self) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let text = self.metrics().await;
            let idle = metric(&text, "kiln:num_requests_running", "") == 0.0
                && metric(&text, "kiln:num_requests_waiting", "") == 0.0
                && metric(&text, "kiln:kv_cache_usage_perc", "") == 0.0;
            if idle {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "the server never went idle:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Signals shutdown and waits for `run` to return.
    pub async fn stop(mut self) {
        let _ = self.shutdown.take().unwrap().send(());
        let result = tokio::time::timeout(WAIT, &mut self.task)
            .await
            .expect("the server stops")
            .expect("the server task did not panic");
        result.expect("run returns Ok");
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// Server-sent events, read as they arrive.
pub struct Events {
    response: reqwest::Response,
    buffer: Vec<u8>,
}

impl Events {
    pub fn new(response: reqwest::Response) -> Self {
        Events {
            response,
            buffer: Vec::new(),
        }
    }

    /// The next event's data (comments such as keep-alives skipped); `None` at the end.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let event = String::from_utf8(event).expect("events are UTF-8");
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|line| line.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if !data.is_empty() {
                    return Some(data.join("\n"));
                }
                continue;
            }
            match self.response.chunk().await.expect("reading the stream") {
                Some(bytes) => self.buffer.extend_from_slice(&bytes),
                None => {
                    assert!(self.buffer.is_empty(), "a partial event at the end");
                    return None;
                }
            }
        }
    }
}

/// The value of the series `name` whose labels contain `label` ("" for any).
pub fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (key, value) = line.rsplit_once(' ')?;
            let (series, labels) = key.split_once('{')?;
            (series == name && labels.contains(label)).then(|| value.parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {name}{{{label}}} in /metrics:\n{text}"))
}

/// `kiln:request_success_total{finished_reason="<reason>"}` in `/metrics`' `text`.
pub fn finished(text: &str, reason: &str) -> f64 {
    metric(
        text,
        "kiln:request_success_total",
        &format!("finished_reason=\"{reason}\""),
    )
}

/// Checks an error response: its status, JSON content type and OpenAI's shape (the four keys
/// present); returns `error`.
pub async fn expect_error(response: reqwest::Response, status: StatusCode) -> Value {
    assert_eq!(response.status(), status);
    let kind = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(kind.starts_with("application/json"), "{kind}");
    let body: Value = response.json().await.unwrap();
    let error = body["error"]
        .as_object()
        .unwrap_or_else(|| panic!("{body}"));
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(error["type"].is_string(), "{body}");
    assert!(
        error.contains_key("param") && error.contains_key("code"),
        "{body}"
    );
    body["error"].clone()
}

pub fn text_of(choice: &Value) -> &str {
    choice["text"].as_str().unwrap()
}

/// `body` with `"stream": true` and usage asked for.
pub fn streamed(body: &Value) -> Value {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body
}

/// Splits a stream with usage into its chunks and its last (usage) chunk, which must have no
/// choices; every other chunk says `"usage": null` (OpenAI's shape with include_usage).
pub fn split_usage(events: &[Value]) -> (&[Value], &Value) {
    let (last, chunks) = events.split_last().expect("events");
    assert_eq!(last["choices"], json!([]), "{last}");
    assert!(last["usage"].is_object(), "{last}");
    for chunk in chunks {
        assert_eq!(
            chunk.get("usage"),
            Some(&Value::Null),
            "a chunk before the end without usage: null: {chunk}"
        );
    }
    (chunks, last)
}
