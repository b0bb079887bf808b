//! Putting it together: the checks a server makes before it starts, the router, and a
//! graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use ch01::{Llama, LlamaConfig, Tokenizer};
use ch04::{CacheConfig, EngineConfig, EngineError};
use ch07::AttentionKind;
use tokio::net::TcpListener;

use crate::access_log::{self, AccessLog};
use crate::auth::ApiKeys;
use crate::chat_template::ChatTemplate;
use crate::connections::{self, ConnectionLimits};
use crate::engine_thread::EngineThread;
use crate::metrics::Metrics;
use crate::params::Limits;
use crate::rate_limit::{RateLimit, RateLimiter};
use crate::routes::{self, unix_now};
use crate::state::AppState;

/// The default of [`ServerConfig::max_prompt_tokens_in_flight`]: 2²⁴ tokens, 2,048 waiting
/// sequences of 8,192 prompt tokens, or some 134 MB of prompt ids held twice (the request's
/// copy and the scheduler's).
pub const DEFAULT_MAX_PROMPT_TOKENS_IN_FLIGHT: u64 = 1 << 24;

/// Request bodies of the largest size (`max_body_bytes`) that may be read or parsed at once,
/// server-wide (`AppState::body_bytes`, which counts a body's bytes beyond its first
/// `routes::FREE_BODY_BYTES`): 256 MiB at the default 8 MiB.
pub const BODIES_AT_ONCE: usize = 32;

/// Where the served model's weights are.
#[derive(Clone)]
pub enum ServedWeights {
    /// In host memory: the CPU executor runs them, and a speculator can draft with them.
    Host(Arc<Llama>),
    /// Not on the host: the server's [`ExecutorFactory`] loads them where they run (a GPU), and
    /// the host keeps only the configuration rather than a second copy of the weights.
    Elsewhere(LlamaConfig),
}

impl ServedWeights {
    /// The weights in host memory, if they are there.
    pub fn host(&self) -> Option<&Llama> {
        match self {
            ServedWeights::Host(model) => Some(model),
            ServedWeights::Elsewhere(_) => None,
        }
    }

    pub fn config(&self) -> &LlamaConfig {
        match self {
            ServedWeights::Host(model) => &model.config,
            ServedWeights::Elsewhere(config) => config,
        }
    }
}

/// The model a server serves, loaded.
pub struct ServedModel {
    pub weights: ServedWeights,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub eos_token_ids: Vec<u32>,
}

/// Builds a [`Speculator`](ch04::Speculator) in the engine thread (speculative decoding,
/// chapter 6; the server knows no drafter), over the served model's host weights when it has
/// them: `None` when an executor factory loaded them elsewhere (a GPU), where the factory builds
/// a drafter that needs no host weights (n-gram lookup, or a model on an executor of its own).
#[derive(Clone)]
#[allow(clippy::type_complexity)]
pub struct SpeculatorFactory(
    pub  Arc<
        dyn for<'m> Fn(Option<&'m Llama>) -> Result<Box<dyn ch04::Speculator + 'm>, String>
            + Send
            + Sync,
    >,
);

impl std::fmt::Debug for SpeculatorFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpeculatorFactory")
    }
}

/// Builds the engine's executor in the engine thread from the model's configuration, instead
/// of the CPU executor over host weights (chapter 8's tensor-parallel ranks, chapter 7's GPU;
/// the server knows neither). The executor owns whatever weights it loads.
#[derive(Clone)]
#[allow(clippy::type_complexity)]
pub struct ExecutorFactory(
    pub  Arc<
        dyn Fn(&LlamaConfig, &CacheConfig) -> Result<Box<dyn ch04::Executor + Send>, String>
            + Send
            + Sync,
    >,
);

impl std::fmt::Debug for ExecutorFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExecutorFactory")
    }
}

/// Everything `kiln serve`'s flags set, besides the model and its KV pool.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub served_model_name: String,
    /// The longest prompt + completion; `None`: the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    pub engine: EngineConfig,
    /// The CPU executor's attention (chapter 7's `--attention-backend`).
    pub attention: AttentionKind,
    pub rate_limit: Option<RateLimit>,
    /// Engine sequences (prompts × n) that may wait beyond the `max_num_seqs` that run;
    /// `None`: no limit.
    pub max_queue: Option<usize>,
    /// Prompt tokens the server may hold for the sequences in it at once (every choice's
    /// prompt; see `AppState::max_prompt_tokens_in_flight`); `None`: no limit.
    pub max_prompt_tokens_in_flight: Option<u64>,
    pub seed: u64,
    /// How long in-flight requests may go on after a shutdown signal before they are aborted.
    pub shutdown_grace: Duration,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Most prompts in one completions request (each is `n` engine sequences).
    pub max_prompts: usize,
    /// Tokenizations (and chat template renderings) at once, on tokio's blocking threads.
    pub tokenizer_workers: usize,
    /// Open connections and their timeouts.
    pub connections: ConnectionLimits,
    /// Events a stream may hold for a client that reads slower than the engine writes
    /// (about 250 bytes each); one that falls further behind has its request aborted.
    pub stream_buffer: usize,
    /// Requests may ask for a `priority` (vLLM's `--scheduling-policy priority`); off, a
    /// priority other than 0 is a 400.
    pub priority_scheduling: bool,
    /// How long a body may take to arrive once its headers are in (408 beyond).
    pub body_read_timeout: Duration,
    /// Failed authentications a client address may make per minute before its requests are
    /// refused (429) without looking at the key.
    pub auth_failures_per_minute: u32,
    /// Where each request's record goes; `None`: no access log.
    pub access_log: Option<AccessLog>,
    /// Speculative decoding (chapter 6): builds the engine's speculator over the served model.
    pub speculator: Option<SpeculatorFactory>,
    /// The engine's executor; `None`: chapter 7's CPU executor with `attention`.
    pub executor: Option<ExecutorFactory>,
    /// Origins browsers may call the API from (`*`: any); empty: no CORS.
    pub allowed_origins: Vec<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            served_model_name: "kiln".into(),
            max_model_len: None,
            engine: EngineConfig::default(),
            attention: AttentionKind::default(),
            rate_limit: None,
            max_queue: None,
            max_prompt_tokens_in_flight: Some(DEFAULT_MAX_PROMPT_TOKENS_IN_FLIGHT),
            seed: 0,
            shutdown_grace: Duration::from_secs(30),
            max_body_bytes: 8 << 20,
            max_prompts: crate::params::DEFAULT_MAX_PROMPTS,
            tokenizer_workers: 2,
            connections: ConnectionLimits::default(),
            stream_buffer: 16_384,
            priority_scheduling: false,
            body_read_timeout: Duration::from_secs(30),
            auth_failures_per_minute: 10,
            access_log: None,
            speculator: None,
            executor: None,
            allowed_origins: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// At least 2: a request needs a prompt token and room for one more.
    #[error("--max-model-len {requested}: expected 2 to the model's context of {model} tokens")]
    MaxModelLen { requested: usize, model: usize },
    #[error(
        "the KV cache holds {capacity} tokens for one request (above the watermark), fewer than \
         one request of --max-model-len {max_model_len}: give --kv-cache-memory more, or lower \
         --max-model-len"
    )]
    KvTooSmall {
        capacity: usize,
        max_model_len: usize,
    },
    #[error(
        "without chunked prefill, a request within --max-model-len {max_model_len} can need \
         {needed} tokens in one step, more than --max-num-batched-tokens {budget}: enable \
         chunked prefill or raise the budget"
    )]
    BudgetTooSmall {
        budget: usize,
        needed: usize,
        max_model_len: usize,
    },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("serving HTTP: {0}")]
    Io(#[from] std::io::Error),
}

/// A configured server: its engine thread is running; [`Server::run`] serves HTTP.
pub struct Server {
    state: Arc<AppState>,
    engine: EngineThread,
    grace: Duration,
    connections: ConnectionLimits,
    access_log: Option<AccessLog>,
    allowed_origins: crate::cors::AllowedOrigins,
}

impl Server {
    /// Checks the configuration against the model and the KV memory `cache`, and starts the
    /// engine. `install` runs the engine loop in the caller's thread pool (see
    /// [`EngineThread::spawn`]).
    pub fn new(
        served: ServedModel,
        cache: CacheConfig,
        keys: ApiKeys,
        config: ServerConfig,
        install: impl FnOnce(Box<dyn FnOnce() + Send>) + Send + 'static,
    ) -> Result<Self, ServerError> {
        // ANCHOR: startup_checks
        let model_len = served.weights.config().max_position_embeddings;
        let max_model_len = config.max_model_len.unwrap_or(model_len);
        if max_model_len > model_len || max_model_len < 2 {
            return Err(ServerError::MaxModelLen {
                requested: max_model_len,
                model: model_len,
            });
        }
        // Unchunked, the longest step a request within max_model_len can need: the engine's
        // rule is linear in prompt and max_tokens, so the worst is at one end of
        // prompt + max_tokens = max_model_len.
        let engine = &config.engine;
        let longest_step = [(max_model_len - 1, 1), (1, max_model_len - 1)]
            .into_iter()
            .filter_map(|(prompt, max_tokens)| engine.unchunked_step_tokens(prompt, max_tokens))
            .max();
        if let Some(needed) = longest_step
            && needed > engine.max_num_batched_tokens
        {
            return Err(ServerError::BudgetTooSmall {
                budget: engine.max_num_batched_tokens,
                needed,
                max_model_len,
            });
        }
        let metrics = Arc::new(Metrics::new(&config.served_model_name));
        let vocab_size = served.weights.config().vocab_size;
        let engine = EngineThread::spawn_with(
            served.weights,
            cache,
            config.engine,
            config.attention,
            config.speculator.clone(),
            config.executor.clone(),
            Arc::clone(&metrics),
            install,
        )?;
        if engine.max_request_tokens < max_model_len {
            return Err(ServerError::KvTooSmall {
                capacity: engine.max_request_tokens,
                max_model_len,
            });
        }
        // ANCHOR_END: startup_checks
        let state = AppState {
            engine: engine.handle(),
            limits: Limits {
                max_model_len,
                eos_token_ids: served.eos_token_ids,
                vocab_size,
                max_prompts: config.max_prompts.max(1),
                max_token_bytes: crate::params::max_token_bytes(&served.tokenizer),
                priority_scheduling: config.priority_scheduling,
            },
            tokenizer: served.tokenizer,
            chat_template: served.chat_template,
            metrics,
            keys,
            rate_limiter: config.rate_limit.map(RateLimiter::new),
            auth_failures: RateLimiter::new(RateLimit {
                requests_per_minute: Some(config.auth_failures_per_minute.max(1)),
                tokens_per_minute: None,
            }),
            max_body_bytes: config.max_body_bytes,
            body_read_timeout: config.body_read_timeout,
            served_model_name: config.served_model_name,
            max_in_flight: config
                .max_queue
                .map(|queue| queue.saturating_add(config.engine.max_num_seqs)),
            in_flight: AtomicUsize::new(0),
            max_prompt_tokens_in_flight: config.max_prompt_tokens_in_flight,
            prompt_tokens_in_flight: AtomicU64::new(0),
            body_bytes: Arc::new(tokio::sync::Semaphore::new(
                (config.max_body_bytes.saturating_mul(BODIES_AT_ONCE))
                    .min(tokio::sync::Semaphore::MAX_PERMITS),
            )),
            parsing: Arc::new(tokio::sync::Semaphore::new(1)),
            tokenizing: Arc::new(tokio::sync::Semaphore::new(config.tokenizer_workers.max(1))),
            stream_buffer: config.stream_buffer.max(1),
            seed: config.seed,
            next_request: AtomicU64::new(0),
            created: unix_now(),
            shutting_down: AtomicBool::new(false),
            grammars: std::sync::OnceLock::new(),
            tag_decoder: std::sync::OnceLock::new(),
        };
        Ok(Server {
            state: Arc::new(state),
            engine,
            grace: config.shutdown_grace,
            connections: config.connections,
            access_log: config.access_log,
            allowed_origins: crate::cors::AllowedOrigins(Arc::new(config.allowed_origins)),
        })
    }

    /// KV positions one request may use (the budget the server logs).
    pub fn kv_capacity_tokens(&self) -> usize {
        self.engine.max_request_tokens
    }

    /// The longest prompt + completion this server accepts.
    pub fn max_model_len(&self) -> usize {
        self.state.limits.max_model_len
    }

    /// The routes, over this server's state, with the access log when there is one.
    pub fn router(&self) -> Router {
        let router = Router::new()
            .route("/v1/completions", post(routes::completions::handler))
            .route("/v1/chat/completions", post(routes::chat::handler))
            .route("/v1/models", get(routes::info::models))
            .route("/health", get(routes::info::health))
            .route("/metrics", get(routes::info::metrics))
            .route("/dashboard", get(crate::dashboard::page))
            .route("/dashboard/state", get(crate::dashboard::state))
            .fallback(routes::info::not_found)
            .method_not_allowed_fallback(routes::info::method_not_allowed)
            .with_state(Arc::clone(&self.state));
        let router = if self.allowed_origins.0.is_empty() {
            router
        } else {
            router.layer(axum::middleware::from_fn_with_state(
                self.allowed_origins.clone(),
                crate::cors::cors,
            ))
        };
        match &self.access_log {
            Some(log) => router.layer(axum::middleware::from_fn_with_state(
                log.clone(),
                access_log::log_access,
            )),
            None => router,
        }
    }

    // ANCHOR: run
    /// Serves on `listener` until `shutdown` resolves; then stops accepting, lets requests in
    /// flight finish for the grace period, aborts what is left (their streams end with
    /// `finish_reason: "abort"`), stops the engine and returns.
    pub async fn run(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let state = Arc::clone(&self.state);
        let grace = self.grace;
        let (signalled_tx, signalled) = tokio::sync::oneshot::channel::<()>();
        let graceful = async move {
            shutdown.await;
            state.shutting_down.store(true, Ordering::SeqCst);
            let _ = signalled_tx.send(());
        };
        let serve = connections::serve(listener, self.router(), self.connections, graceful);
        let handle = self.state.engine.clone();
        let deadline = async move {
            if signalled.await.is_err() {
                return std::future::pending().await; // the server ended first
            }
            tokio::time::sleep(grace).await;
            handle.abort_all();
            // Streams end within a step of the abort; give connections a moment to close.
            tokio::time::sleep(Duration::from_secs(5)).await;
        };
        tokio::select! {
            result = serve => result?,
            () = deadline => {}
        }
        self.engine.stop();
        Ok(())
    }
    // ANCHOR_END: run

    /// The state handlers share (tests read the metrics through it).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }
}
