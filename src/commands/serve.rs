//! `kiln serve`: chapter 8's OpenAI-compatible server on the engine, with vLLM's flags.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ch07::cuda::DeviceSpec;
use ch08::access_log::{AccessLog, AccessRecord};
use ch08::auth::ApiKeys;
use ch08::chat_template::ChatTemplate;
use ch08::rate_limit::RateLimit;
use ch08::{
    ConnectionLimits, ExecutorFactory, ServedModel, ServedWeights, Server, ServerConfig,
    SpeculatorFactory,
};

use super::engine_args::{AttentionArgs, EngineArgs, KvArgs};
use super::speculative_args::{SpeculativeArgs, TargetWeights};
use super::tensor_parallel::TensorParallelArgs;
use super::{ModelArgs, ModelFormat};

/// The hidden subcommand that renders the served chat template in a process of its own
/// (`ch08::chat_template::worker::main`).
pub const CHAT_TEMPLATE_WORKER: &str = "chat-template-worker";

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The model name clients send (and /v1/models lists) [default: the model folder's name].
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Longest prompt + completion [default: the model's context].
    #[arg(long, value_name = "TOKENS")]
    pub max_model_len: Option<usize>,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub tensor_parallel: TensorParallelArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// Accepted for vLLM compatibility: chunked prefill is already on unless
    /// --no-enable-chunked-prefill.
    #[arg(
        long = "enable-chunked-prefill",
        conflicts_with = "enable_chunked_prefill"
    )]
    pub enable_chunked_prefill_flag: bool,
    /// An API key clients must send as `Authorization: Bearer KEY` (repeatable; also
    /// KILN_API_KEY). Without any, the server is open.
    #[arg(long = "api-key", value_name = "KEY", env = "KILN_API_KEY")]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line ('#' comments).
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Per API key (per client address on an open server), per minute: REQUESTS or
    /// REQUESTS:TOKENS (e.g. 60:20000; '-' for no request limit). A request counts once per
    /// engine sequence (prompts × n); tokens are prompt + max_tokens. Over it: 429 with
    /// Retry-After.
    #[arg(long, value_name = "LIMIT")]
    pub rate_limit: Option<RateLimit>,
    /// Engine sequences (prompts × n of each request) that may wait beyond the --max-num-seqs
    /// that run; a request that would pass it gets 429.
    #[arg(long, value_name = "N")]
    pub max_queue: Option<usize>,
    /// Prompt tokens the server may hold for the engine sequences in it at once, running or
    /// waiting: every choice's prompt (each holds a copy). A request that would pass it gets 429
    /// (with Retry-After: 1 unless it is larger than the limit); 0: no limit.
    #[arg(long, value_name = "TOKENS", default_value_t = ch08::server::DEFAULT_MAX_PROMPT_TOKENS_IN_FLIGHT)]
    pub max_prompt_tokens_in_flight: u64,
    /// Seed of the requests that name none (request n gets a seed derived from it and n).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seconds in-flight requests may go on after SIGTERM / Ctrl-C before they are aborted.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub shutdown_grace: f64,
    /// Seconds a connection may stay open with no request in progress and nothing received
    /// (uvicorn's and vLLM's name and default).
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub timeout_keep_alive: f64,
    /// Seconds from when a connection waits for a request until that request's headers are in.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub header_read_timeout: f64,
    /// Seconds a client may take none of a response (its socket's buffer full) before the
    /// connection is closed and its request aborted.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub send_timeout: f64,
    /// fcfs: requests run in arrival order, and one asking for a `priority` other than 0 is
    /// refused; priority: lower `priority` first, then arrival (vLLM's policies).
    #[arg(long, default_value = "fcfs", value_parser = ["fcfs", "priority"])]
    pub scheduling_policy: String,
    /// Seconds a request body may take to arrive once its headers are in (408 beyond).
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub body_read_timeout: f64,
    /// Most connections open at once; more are answered 503 and closed. Keep it under the
    /// file-descriptor limit (`ulimit -n`).
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub max_connections: usize,
    /// Most prompts in one /v1/completions request (each is n engine sequences).
    #[arg(long, default_value_t = ch08::params::DEFAULT_MAX_PROMPTS, value_name = "N")]
    pub max_prompts_per_request: usize,
    /// Failed authentications per minute from one client address before its requests are
    /// refused (429) without checking the key.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub auth_failures_per_minute: u32,
    /// No access log (by default one line per request on stderr: client, key id, method, path,
    /// status, tokens, latency; never the key).
    #[arg(long)]
    pub disable_access_log: bool,
    /// Origins a browser page may call the API from (CORS), comma-separated, or `*` for any.
    /// Off by default.
    #[arg(long, value_delimiter = ',', value_name = "ORIGINS", value_parser = parse_origin)]
    pub allowed_origins: Vec<String>,
}

/// A flag's seconds, checked.
fn seconds(value: f64, flag: &str) -> anyhow::Result<Duration> {
    // A day at most: deadlines are `Instant + Duration`, which panics past the clock's range.
    const DAY: f64 = 86_400.0;
    anyhow::ensure!(
        (0.0..=DAY).contains(&value),
        "--{flag} must be a number of seconds from 0 to {DAY} (a day)"
    );
    Ok(Duration::from_secs_f64(value))
}

/// One `--allowed-origins` entry as a browser sends it in `Origin`: `*`, or
/// `scheme://host[:port]` (spaces around it and a trailing `/` dropped), never a path.
fn parse_origin(text: &str) -> Result<String, String> {
    let origin = text.trim().trim_end_matches('/');
    if origin == "*" {
        return Ok(origin.to_string());
    }
    let valid = origin.split_once("://").is_some_and(|(scheme, host)| {
        matches!(scheme, "http" | "https") && !host.is_empty() && !host.contains('/')
    });
    match valid {
        true => Ok(origin.to_string()),
        false => Err(format!(
            "{text:?} is not an origin: expected `*` or scheme://host[:port], such as \
             https://example.com"
        )),
    }
}

/// `--host` and `--port` as an address to listen on: an IP address (`127.0.0.1`, `::1`,
/// `[::1]`) or a name the system resolves (`localhost`), its first address.
fn listen_address(host: &str, port: u16) -> anyhow::Result<SocketAddr> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .with_context(|| format!("--host {host}: not an IP address, nor a name that resolves"))?
        .next()
        .with_context(|| format!("--host {host} resolves to no address"))
}

pub fn run(args: Args, pool: Arc<rayon::ThreadPool>) -> anyhow::Result<()> {
    // What is cheap to check comes before the model loads.
    let addr = listen_address(&args.host, args.port)?;
    let keys = ApiKeys::load(&args.api_keys, args.api_key_file.as_deref())?;
    // On a GPU the host keeps the tokenizer and the configuration only; the engine thread's
    // executor reads the weights from --model straight onto the device. So it does with
    // tensor parallelism, whose ranks load their own shards, unless the drafter runs the
    // target's own layers from host memory (layer skip).
    let whole_target = args.speculative.needs_target_weights()?;
    let (host, model) =
        pool.install(|| args.tensor_parallel.load_host(&args.model, whole_target))?;
    let weights = match model {
        Some(model) => ServedWeights::Host(Arc::new(model)),
        None => ServedWeights::Elsewhere(host.config.clone()),
    };
    let path = &args.model.model;
    let chat_template = match &host.format {
        ModelFormat::HfDir => ChatTemplate::from_model_dir(path),
        ModelFormat::Gguf { chat_template } => chat_template
            .as_deref()
            .map(|source| {
                let token =
                    |id: Option<u32>| id.and_then(|id| host.tokenizer.inner().id_to_token(id));
                ChatTemplate::from_source(
                    source,
                    token(host.tokenizer.bos_token_id()),
                    token(host.tokenizer.eos_token_id()),
                )
            })
            .transpose(),
    }
    .with_context(|| format!("loading the chat template of {}", path.display()))?;
    // A template comes with the model file: it renders in worker processes (this binary's
    // hidden subcommand), so that one that crashes its render fails that request, not the
    // server.
    let chat_template = match chat_template {
        Some(template) => {
            let kiln = std::env::current_exe()
                .context("finding kiln's own executable, to render the chat template in")?;
            Some(template.isolated(kiln, vec![CHAT_TEMPLATE_WORKER.to_string()]))
        }
        None => None,
    };
    let name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| args.model.name());
    let cache = args.kv.cache(weights.config(), &args.model.dtype)?;
    anyhow::ensure!(
        args.max_connections >= 1 && args.max_prompts_per_request >= 1,
        "--max-connections and --max-prompts-per-request must be at least 1"
    );
    anyhow::ensure!(
        args.auth_failures_per_minute >= 1,
        "--auth-failures-per-minute must be at least 1"
    );
    let config = ServerConfig {
        served_model_name: name.clone(),
        max_model_len: args.max_model_len,
        engine: args.engine.config(),
        attention: args.attention.kind(),
        rate_limit: args.rate_limit,
        max_queue: args.max_queue,
        max_prompt_tokens_in_flight: (args.max_prompt_tokens_in_flight > 0)
            .then_some(args.max_prompt_tokens_in_flight),
        seed: args.seed,
        shutdown_grace: seconds(args.shutdown_grace, "shutdown-grace")?,
        priority_scheduling: args.scheduling_policy == "priority",
        connections: ConnectionLimits {
            max_connections: args.max_connections,
            header_read_timeout: seconds(args.header_read_timeout, "header-read-timeout")?,
            keep_alive_timeout: seconds(args.timeout_keep_alive, "timeout-keep-alive")?,
            send_timeout: seconds(args.send_timeout, "send-timeout")?,
        },
        body_read_timeout: seconds(args.body_read_timeout, "body-read-timeout")?,
        max_prompts: args.max_prompts_per_request,
        auth_failures_per_minute: args.auth_failures_per_minute,
        access_log: (!args.disable_access_log).then(|| {
            AccessLog(Arc::new(|record: &AccessRecord| {
                eprintln!("kiln serve: {record}");
            }))
        }),
        speculator: speculator_factory(&args, &weights, cache)?,
        executor: executor_factory(&args)?,
        allowed_origins: args.allowed_origins.clone(),
        ..ServerConfig::default()
    };
    let has_template = chat_template.is_some();
    let served = ServedModel {
        weights,
        tokenizer: Arc::new(host.tokenizer),
        chat_template,
        eos_token_ids: host.eos_token_ids,
    };
    let engine_pool = Arc::clone(&pool);
    let server = Server::new(served, cache, keys.clone(), config, move |f| {
        engine_pool.install(f)
    })?;
    eprintln!(
        "kiln serve: {name} | max-model-len {} | KV budget {} tokens above the watermark \
         ({:.1} max-length requests) | {}",
        server.max_model_len(),
        server.kv_capacity_tokens(),
        server.kv_capacity_tokens() as f64 / server.max_model_len() as f64,
        args.engine.describe()
    );
    eprintln!(
        "kiln serve: chat template {} | API keys: {} | rate limit: {} | max queue: {} | max \
         prompt tokens in flight: {}",
        if has_template {
            "yes"
        } else {
            "none (chat completions refused)"
        },
        if keys.is_open() {
            "none (open)".to_string()
        } else {
            keys.len().to_string()
        },
        args.rate_limit
            .map_or("none".into(), |r| format!("{r} per minute")),
        args.max_queue.map_or("none".into(), |q| q.to_string()),
        match args.max_prompt_tokens_in_flight {
            0 => "none".to_string(),
            tokens => tokens.to_string(),
        },
    );
    eprintln!(
        "kiln serve: max connections {} | timeouts: keep-alive {} s, headers {} s, body {} s, \
         send {} s | max prompts per request {} | access log {}",
        args.max_connections,
        args.timeout_keep_alive,
        args.header_read_timeout,
        args.body_read_timeout,
        args.send_timeout,
        args.max_prompts_per_request,
        if args.disable_access_log { "off" } else { "on" },
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        // The address bound (with --port 0, the port the system chose).
        let bound = listener.local_addr().unwrap_or(addr);
        eprintln!("kiln serve: listening on http://{bound} (Ctrl-C to stop)");
        server.run(listener, shutdown_signal()).await?;
        eprintln!("kiln serve: stopped");
        anyhow::Ok(())
    })
}

/// The engine thread's speculator (chapter 6), if the flags ask for one. A draft model lives
/// as long as the process (it is leaked, as the server runs until the process ends).
fn speculator_factory(
    args: &Args,
    weights: &ServedWeights,
    cache: ch04::CacheConfig,
) -> anyhow::Result<Option<SpeculatorFactory>> {
    let spec = args.speculative.clone();
    if spec.method()?.is_none() {
        return Ok(None);
    }
    let on_cpu = args.model.device == DeviceSpec::Cpu;
    // A GPU's executor loads the draft model itself.
    let draft: Option<&'static ch01::Llama> = match on_cpu {
        true => spec
            .load_draft(&args.model.dtype, weights.config())?
            .map(|d| &*Box::leak(Box::new(d))),
        false => None,
    };
    // Build one now, so that a bad flag fails at start rather than in the engine thread. (On a
    // GPU the engine thread's build fails the start just the same, and one build there loads
    // the drafter's weights onto the device once.)
    let target = match weights.host() {
        Some(target) => Some(TargetWeights::Host(target)),
        None if on_cpu => Some(TargetWeights::Ranks(weights.config())),
        None => None,
    };
    let engine = args.engine.config();
    if let Some(target) = target {
        spec.speculator(target, draft, &cache, &engine)?;
    }
    if let Some(line) = spec.describe()? {
        eprintln!("kiln serve: {line}");
    }
    let (model_args, config) = (args.model.clone(), weights.config().clone());
    Ok(Some(SpeculatorFactory(Arc::new(
        move |model: Option<&ch01::Llama>| {
            // No host weights: the tensor-parallel ranks hold them on the CPU, a GPU elsewhere.
            let target = match model {
                Some(model) => TargetWeights::Host(model),
                None if on_cpu => TargetWeights::Ranks(&config),
                None => TargetWeights::Gpu(&model_args, &config),
            };
            spec.speculator(target, draft, &cache, &engine)
                .map_err(|e| format!("{e:#}"))?
                .ok_or_else(|| "speculation is off".to_string())
        },
    ))))
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    eprintln!("kiln serve: shutting down: no new requests; in-flight ones get the grace period");
}

/// The engine thread's executor when it is not the CPU executor over the served model:
/// `--device cuda:N` builds chapter 7's GPU executor (weights read from `--model` onto the
/// device), `--tensor-parallel-size N > 1` one over N ranks. A GPU that is not there fails the
/// start, with the reason.
fn executor_factory(args: &Args) -> anyhow::Result<Option<ExecutorFactory>> {
    let tp = args.tensor_parallel;
    if let DeviceSpec::Cuda(_) = args.model.device {
        anyhow::ensure!(
            !tp.is_parallel(),
            "--device {}: tensor parallelism runs on the CPU only so far",
            args.model.device
        );
        args.attention.kind_on(args.model.device)?;
        let model = args.model.clone();
        return Ok(Some(ExecutorFactory(Arc::new(move |config, cache| {
            model
                .gpu_executor(config, cache)
                .map_err(|e| format!("{e:#}"))
        }))));
    }
    if !tp.is_parallel() {
        return Ok(None);
    }
    let model = args.model.clone();
    let attention = args.attention.kind();
    Ok(Some(ExecutorFactory(Arc::new(move |_config, cache| {
        tp.tensor_parallel_executor(&model, cache, attention)
            .map_err(|e| format!("{e:#}"))
    }))))
}

#[cfg(test)]
mod tests {
    use super::listen_address;

    #[test]
    fn origins_are_trimmed_and_checked() {
        use super::parse_origin;
        assert_eq!(
            parse_origin(" https://b.example/ ").unwrap(),
            "https://b.example"
        );
        assert_eq!(
            parse_origin("http://localhost:3000").unwrap(),
            "http://localhost:3000"
        );
        assert_eq!(parse_origin("*").unwrap(), "*");
        for bad in [
            "b.example",
            "https://",
            "https://a.example/app",
            "ftp://a.example",
            "",
        ] {
            assert!(parse_origin(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hosts_are_addresses_in_any_spelling_or_names() {
        let port = 8000;
        assert_eq!(
            listen_address("127.0.0.1", port).unwrap().to_string(),
            "127.0.0.1:8000"
        );
        assert_eq!(
            listen_address("::1", port).unwrap().to_string(),
            "[::1]:8000"
        );
        assert_eq!(
            listen_address("[::1]", port).unwrap().to_string(),
            "[::1]:8000"
        );
        assert!(
            listen_address("localhost", port)
                .unwrap()
                .ip()
                .is_loopback()
        );
    }
}
