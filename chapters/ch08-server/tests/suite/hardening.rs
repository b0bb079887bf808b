//! The server against abusive and careless clients: oversized prompts, slow and silent
//! sockets, too many connections, key guessing, prompt lists that fan out into thousands of
//! sequences, disconnects, a dead engine thread; and the output details such clients check
//! (logprob order and offsets, per-request counts). Each test fails on the server before
//! these fixes; the timeouts are small so that each takes a second or two.

use crate::support;

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ch08_server::ConnectionLimits;
use ch08_server::access_log::{AccessLog, AccessRecord};
use ch08_server::params::max_token_bytes;
use ch08_server::protocol::CompletionResponse;
use ch08_server::rate_limit::RateLimit;
use proptest::prelude::*;
use reqwest::StatusCode;
use serde_json::{Value, json};

use support::*;

/// The second loopback address: a client that is not 127.0.0.1.
const OTHER_CLIENT: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

/// Small timeouts, so that the tests wait for them in well under a second each.
fn quick_timeouts(max_connections: usize) -> ConnectionLimits {
    ConnectionLimits {
        max_connections,
        header_read_timeout: Duration::from_millis(800),
        keep_alive_timeout: Duration::from_millis(300),
        send_timeout: Duration::from_millis(500),
    }
}

/// A client whose connections come from `address`.
fn client_from(address: IpAddr) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(address)
        .timeout(WAIT)
        .build()
        .unwrap()
}

// ────────────────────────────────────── raw sockets ──────────────────────────────────────

/// A blocking socket to the server.
fn connect(server: &TestServer) -> TcpStream {
    let socket = TcpStream::connect(server.url.trim_start_matches("http://")).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    socket
}

/// What the server sent until it closed `socket`, and when it closed it (from `since`);
/// `None` if it was still open after [`WAIT`]. Every `trickle` it sends one more byte of
/// `drip` (a slow client), while there are any.
fn until_closed(
    mut socket: TcpStream,
    since: Instant,
    mut drip: &[u8],
    trickle: Duration,
) -> (Vec<u8>, Option<Duration>) {
    let mut received = Vec::new();
    let mut last_drip = Instant::now();
    let mut buf = [0u8; 4096];
    while since.elapsed() < WAIT {
        if let Some((&byte, rest)) = drip.split_first()
            && last_drip.elapsed() >= trickle
        {
            if socket.write_all(&[byte]).is_err() {
                return (received, Some(since.elapsed()));
            }
            drip = rest;
            last_drip = Instant::now();
        }
        match socket.read(&mut buf) {
            Ok(0) => return (received, Some(since.elapsed())),
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return (received, Some(since.elapsed())),
        }
    }
    (received, None)
}

/// Runs a blocking socket exchange off the test's runtime.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

fn closed_within(what: &str, closed: Option<Duration>, at_least: Duration) -> Duration {
    let closed = closed.unwrap_or_else(|| panic!("{what}: still open after {WAIT:?}"));
    // The clock here starts a moment after the server's: allow a little under.
    assert!(
        closed >= at_least.mul_f64(0.9) && closed < Duration::from_secs(3),
        "{what}: closed after {closed:?}, expected {at_least:?} or a little more"
    );
    closed
}

// ─────────────────────────────────── 1. tokenization ───────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_at_once_while_three_8_mb_prompts_are_rejected() {
    let server = Arc::new(start(Setup::default()).await);
    let prompt = "a".repeat(8_000_000);
    let body = Arc::new(
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 4})
            .to_string()
            .into_bytes(),
    );
    let chat = Arc::new(
        json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}]})
            .to_string()
            .into_bytes(),
    );
    // /health from a thread of its own, as a load balancer would ask it, every 10 ms.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = {
        let (url, stop) = (server.url.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut slowest = Duration::ZERO;
            let mut probes = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) || probes < 5 {
                let asked = Instant::now();
                let mut socket = TcpStream::connect(url.trim_start_matches("http://")).unwrap();
                socket.set_read_timeout(Some(WAIT)).unwrap();
                socket
                    .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                    .unwrap();
                let mut reply = Vec::new();
                socket.read_to_end(&mut reply).unwrap();
                assert!(reply.starts_with(b"HTTP/1.1 200"), "{reply:?}");
                slowest = slowest.max(asked.elapsed());
                probes += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            slowest
        })
    };
    let posts: Vec<_> = (0..3)
        .map(|i| {
            let server = Arc::clone(&server);
            let (path, body) = if i == 2 {
                ("/v1/chat/completions", Arc::clone(&chat))
            } else {
                ("/v1/completions", Arc::clone(&body))
            };
            tokio::spawn(async move {
                let response = server
                    .post(path)
                    .header("content-type", "application/json")
                    .body(body.to_vec())
                    .send()
                    .await
                    .unwrap();
                expect_error(response, StatusCode::BAD_REQUEST).await
            })
        })
        .collect();
    for (i, post) in posts.into_iter().enumerate() {
        let error = post.await.unwrap();
        let param = if i == 2 { "messages" } else { "prompt" };
        assert_eq!(error["param"], param, "{error}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains("8000000 bytes"), "{message}");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let slowest = probe.join().unwrap();
    // 1 s: room for a busy machine's scheduling delays (up to ~200 ms seen on 2 loaded cores),
    // far below what tokenizing an 8 MB prompt on the HTTP threads would hold them for.
    assert!(
        slowest < Duration::from_secs(1),
        "/health took {slowest:?} while the prompts were refused"
    );
    // Nothing reached the engine.
    let text = server.metrics().await;
    assert_eq!(metric(&text, "kiln:prompt_tokens_total", ""), 0.0);
}

proptest! {
    #![proptest_config(ch01::testing::seeded_config(64, 20))]

    /// The byte rule the server refuses long text by: no token stands for more than
    /// `max_token_bytes` bytes, so a text is at least `⌈bytes / max_token_bytes⌉` tokens. Text
    /// of any printable characters (ASCII, accents, CJK, emoji), or long runs of letters and
    /// spaces (the longest tokens).
    #[test]
    fn a_text_is_at_least_its_bytes_over_max_token_bytes_tokens(text in "\\PC{0,300}|[ a-z\\n]{0,2000}") {
        let tokenizer = &loaded().tokenizer;
        let per_token = max_token_bytes(tokenizer);
        for specials in [false, true] {
            let tokens = tokenizer.encode(&text, specials).unwrap().len();
            prop_assert!(
                tokens >= text.len().div_ceil(per_token),
                "{} bytes became {tokens} tokens, fewer than the bound at {per_token} bytes each",
                text.len()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_prompt_too_long_for_the_context_names_messages() {
    let server = start(Setup::default()).await;
    // Short enough in bytes to be tokenized, too many tokens for the context of 512.
    let long = "ROMEO. ".repeat(400);
    assert!(count_tokens(&long) > 512);
    let response = server
        .post("/v1/chat/completions")
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": long}]}))
        .send()
        .await
        .unwrap();
    let error = expect_error(response, StatusCode::BAD_REQUEST).await;
    assert_eq!(error["param"], "messages", "{error}");
    server.stop().await;
}

/// A tokenizer with one token of 300 bytes lets the byte bound through 512 × 1,200 bytes of
/// text; a prompt within that but far past the context is refused by counting it in pieces
/// (`prompt_pieces`), before the whole of it is tokenized, with an error that names the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_within_the_byte_bound_but_past_the_context_is_refused_by_its_pieces() {
    let path = ch01::default_model_dir().join("tokenizer.json");
    let mut saved: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    rename_last_merge(&mut saved, &"~".repeat(300));
    let inner = tokenizers::Tokenizer::from_bytes(saved.to_string().as_bytes()).unwrap();
    let (bos, eos) = (
        loaded().tokenizer.bos_token_id(),
        loaded().tokenizer.eos_token_id(),
    );
    let tokenizer = Arc::new(ch01::Tokenizer::from_parts(inner, path, bos, eos));
    assert_eq!(max_token_bytes(&tokenizer), 1200);
    let server = start(Setup {
        tokenizer: Some(tokenizer),
        ..Setup::default()
    })
    .await;
    let long = "ROMEO. ".repeat(40_000); // 280 KB: under 512 × 1,200 bytes
    let completion = json!({"model": MODEL, "prompt": long, "max_tokens": 2});
    let chat = json!({"model": MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": long}]});
    for (route, body, param) in [
        ("/v1/completions", &completion, "prompt"),
        ("/v1/chat/completions", &chat, "messages"),
    ] {
        let response = server.post(route).json(body).send().await.unwrap();
        let e = expect_error(response, StatusCode::BAD_REQUEST).await;
        assert_eq!(e["param"], param, "{e}");
        let message = e["message"].as_str().unwrap();
        assert!(
            message.contains("maximum context length is 512 tokens"),
            "{e}"
        );
        assert!(message.contains("bytes of your"), "{e}");
    }
    server.stop().await;
}

/// `truncate_prompt_tokens` keeps a prompt's last tokens, so a text far longer than the
/// context is served when it asks for truncation: the byte bound, which refuses such a text
/// before tokenizing it, does not apply (only the suffix the kept tokens need is tokenized).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_prompt_tokens_serves_a_text_longer_than_the_context() {
    let server = start(Setup::default()).await;
    let per_token = max_token_bytes(&loaded().tokenizer);
    let long = "ROMEO. ".repeat(512 * per_token / 7 + 100);
    assert!(long.len() > 512 * per_token, "beyond the byte bound");
    let completion = json!({"model": MODEL, "prompt": long, "max_tokens": 2,
                            "truncate_prompt_tokens": 8});
    let chat = json!({"model": MODEL, "max_tokens": 2, "truncate_prompt_tokens": 8,
                      "messages": [{"role": "user", "content": long}]});
    for (path, body) in [
        ("/v1/completions", &completion),
        ("/v1/chat/completions", &chat),
    ] {
        let r = server.json(path, body).await;
        assert_eq!(r["usage"]["prompt_tokens"], 8, "{path}");
        // Without truncation the same text is refused by its bytes.
        let mut refused = body.clone();
        refused
            .as_object_mut()
            .unwrap()
            .remove("truncate_prompt_tokens");
        let response = server.post(path).json(&refused).send().await.unwrap();
        let e = expect_error(response, StatusCode::BAD_REQUEST).await;
        assert!(e["message"].as_str().unwrap().contains("bytes"), "{e}");
    }
    server.stop().await;
}

// ─────────────────────────────────── 2. connections ───────────────────────────────────

/// A connection limit past what a semaphore counts (2^61 − 1) is no limit: the server starts
/// and serves (it panicked at start-up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_limit_past_counting_is_no_limit() {
    let mut setup = Setup::default();
    setup.config.connections = quick_timeouts(usize::MAX);
    let server = start(setup).await;
    let response = reqwest::get(format!("{}/health", server.url))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_idle_clients_are_closed_after_the_timeouts() {
    let limits = quick_timeouts(64);
    let mut setup = Setup::default();
    setup.config.connections = limits;
    setup.config.body_read_timeout = Duration::from_millis(500);
    let server = start(setup).await;

    // A socket that never sends a byte: the keep-alive timeout.
    let socket = connect(&server);
    let (_, closed) =
        blocking(move || until_closed(socket, Instant::now(), &[], Duration::ZERO)).await;
    closed_within("a silent socket", closed, limits.keep_alive_timeout);

    // Slowloris: a header byte every 100 ms keeps it from being idle; the header-read
    // timeout closes it.
    let socket = connect(&server);
    let drip =
        b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let (_, closed) =
        blocking(move || until_closed(socket, Instant::now(), drip, Duration::from_millis(100)))
            .await;
    closed_within("a slowloris client", closed, limits.header_read_timeout);

    // A body that stops coming: 408 after the body-read timeout.
    let mut socket = connect(&server);
    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                content-length: 200\r\n\r\n{\"model\": ";
    socket.write_all(head.as_bytes()).unwrap();
    let (reply, closed) =
        blocking(move || until_closed(socket, Instant::now(), &[], Duration::ZERO)).await;
    closed_within("a stalled body", closed, Duration::from_millis(500));
    assert!(
        reply.starts_with(b"HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&reply)
    );

    // An idle keep-alive connection, after a request: closed after the keep-alive timeout.
    let mut socket = connect(&server);
    socket
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let (reply, closed) =
        blocking(move || until_closed(socket, Instant::now(), &[], Duration::ZERO)).await;
    assert!(reply.starts_with(b"HTTP/1.1 200"), "{reply:?}");
    closed_within(
        "an idle keep-alive connection",
        closed,
        limits.keep_alive_timeout,
    );

    server.stop().await;
}

/// A request that takes longer than the keep-alive timeout is not cut: the timeout counts only
/// while no request is in progress. How long a request takes depends on the machine and the
/// build, so the request grows (more choices) until one outlasts the timeout; every one must
/// come back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_longer_than_the_keep_alive_timeout_is_not_cut() {
    let limits = ConnectionLimits {
        keep_alive_timeout: Duration::from_millis(100),
        ..quick_timeouts(64)
    };
    let mut setup = Setup::default();
    setup.config.connections = limits;
    let server = start(setup).await;
    let max_tokens = 400;
    let mut longest = Duration::ZERO;
    for n in [4, 8, 16, 32] {
        let asked = Instant::now();
        let long = server
            .json(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "n": n,
                        "ignore_eos": true}),
            )
            .await;
        assert_eq!(long["usage"]["completion_tokens"], max_tokens * n, "{long}");
        longest = asked.elapsed();
        if longest > 2 * limits.keep_alive_timeout {
            break;
        }
    }
    assert!(
        longest > limits.keep_alive_timeout,
        "no request ({longest:?}) outlasted the keep-alive timeout"
    );
    server.stop().await;
}

/// A connection past `--max-connections`: answered 503, and closed within 200 ms.
fn assert_refused_at_once(reply: &[u8], closed: Option<Duration>) {
    assert!(
        reply.starts_with(b"HTTP/1.1 503"),
        "{}",
        String::from_utf8_lossy(reply)
    );
    assert!(
        closed.is_some_and(|c| c < Duration::from_millis(200)),
        "refused at once: {closed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_get_503_and_the_server_recovers() {
    let mut setup = Setup::default();
    setup.config.connections = quick_timeouts(3);
    let server = start(setup).await;
    let idle: Vec<TcpStream> = (0..3).map(|_| connect(&server)).collect();
    // Let the accept loop take the three.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let fourth = connect(&server);
    let (reply, closed) =
        blocking(move || until_closed(fourth, Instant::now(), &[], Duration::ZERO)).await;
    assert_refused_at_once(&reply, closed);
    // The three idle ones are closed by the keep-alive timeout; then the server answers.
    for socket in idle {
        let (_, closed) =
            blocking(move || until_closed(socket, Instant::now(), &[], Duration::ZERO)).await;
        assert!(closed.is_some(), "an idle connection was never closed");
    }
    let health = server.get("/health").send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    server.stop().await;
}

/// A connection past the limit whose client has sent its request reads the 503, and can still
/// send the rest: the server reads what arrives for a moment before it closes. It used to close
/// without reading, and a socket closed with bytes unread (or that bytes reach after) is reset:
/// the client's next write failed with ECONNRESET, and an HTTP client reports that, not the 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_the_limit_that_sent_its_request_can_read_the_503() {
    let mut setup = Setup::default();
    setup.config.connections = quick_timeouts(1);
    let server = start(setup).await;
    let _idle = connect(&server);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut second = connect(&server);
    let (reply, closed, body_sent) = blocking(move || {
        let body = "x".repeat(4096);
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: kiln\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            body.len()
        );
        second.write_all(head.as_bytes()).unwrap();
        // The answer comes before the body is sent, as to a client that sends it in a second
        // write, or a moment later.
        let reader = second.try_clone().unwrap();
        let (reply, closed) = until_closed(reader, Instant::now(), &[], Duration::ZERO);
        std::thread::sleep(Duration::from_millis(10));
        let body_sent = second.write_all(body.as_bytes()).map_err(|e| e.kind());
        (reply, closed, body_sent)
    })
    .await;
    assert_refused_at_once(&reply, closed);
    assert_eq!(body_sent, Ok(()), "the connection was reset");
    server.stop().await;
}

// ─────────────────────────────────── 5. admission ───────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_is_checked_before_the_body_and_guessing_is_rate_limited() {
    let mut setup = Setup {
        keys: vec!["sk-right".into()],
        ..Setup::default()
    };
    setup.config.auth_failures_per_minute = 3;
    setup.config.body_read_timeout = Duration::from_secs(20);
    let server = start(setup).await;

    // No key, a 1 MB body announced and never sent: 401 at once, not after the body.
    let mut socket = connect(&server);
    socket
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
              content-length: 1000000\r\n\r\n",
        )
        .unwrap();
    let asked = Instant::now();
    let (reply, _) = blocking(move || until_closed(socket, asked, &[], Duration::ZERO)).await;
    assert!(
        reply.starts_with(b"HTTP/1.1 401"),
        "{}",
        String::from_utf8_lossy(&reply)
    );
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );

    // Two more failures make three: then this address is refused before its key is read,
    // even the right key.
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 1});
    for _ in 0..2 {
        let wrong = server
            .post("/v1/completions")
            .bearer_auth("sk-guess")
            .json(&body)
            .send()
            .await
            .unwrap();
        expect_error(wrong, StatusCode::UNAUTHORIZED).await;
    }
    for key in ["sk-guess", "sk-right"] {
        let refused = server
            .post("/v1/completions")
            .bearer_auth(key)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(refused.headers().contains_key("retry-after"));
        expect_error(refused, StatusCode::TOO_MANY_REQUESTS).await;
    }
    // Another address is not affected; a body that is not declared JSON is 415 there.
    let other = client_from(OTHER_CLIENT);
    let url = format!("{}/v1/completions", server.url);
    let ok = other
        .post(&url)
        .bearer_auth("sk-right")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    let plain = other
        .post(&url)
        .bearer_auth("sk-right")
        .header("content-type", "text/plain")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    expect_error(plain, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
    let text = server.wait_idle().await;
    assert_eq!(
        finished(&text, "length"),
        1.0,
        "only the one accepted request ran"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_server_limits_each_client_address_by_engine_sequences() {
    let mut setup = Setup::default();
    setup.config.rate_limit = Some("4".parse::<RateLimit>().unwrap());
    let server = start(setup).await;
    let request = |prompts: usize, n: usize| json!({"model": MODEL, "prompt": vec![vec![5u32]; prompts], "n": n, "max_tokens": 1});
    // 2 prompts × n = 2 is 4 sequences: the whole minute's allowance of 4.
    let response = server.json("/v1/completions", &request(2, 2)).await;
    assert_eq!(response["choices"].as_array().unwrap().len(), 4);
    let again = server
        .post("/v1/completions")
        .json(&request(1, 1))
        .send()
        .await
        .unwrap();
    expect_error(again, StatusCode::TOO_MANY_REQUESTS).await;
    // Another client has its own bucket.
    let other = client_from(OTHER_CLIENT)
        .post(format!("{}/v1/completions", server.url))
        .json(&request(1, 1))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::OK);
    // More sequences than a minute allows can never fit: no Retry-After.
    let huge = client_from(OTHER_CLIENT)
        .post(format!("{}/v1/completions", server.url))
        .json(&request(5, 1))
        .send()
        .await
        .unwrap();
    assert!(!huge.headers().contains_key("retry-after"));
    expect_error(huge, StatusCode::TOO_MANY_REQUESTS).await;
    server.stop().await;
}

// ─────────────────────────────────── 3. per-request caps ───────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_lists_are_capped_and_sequences_fill_the_queue() {
    let mut setup = Setup::default();
    setup.config.engine.max_num_seqs = 2;
    setup.config.max_queue = Some(2);
    let server = start(setup).await;
    let post = |body: Value| server.post("/v1/completions").json(&body).send();

    // The request: 5,000 token prompts × n = 16, refused before any work.
    let e = expect_error(
        post(json!({"model": MODEL, "prompt": vec![vec![5u32]; 5000], "n": 16, "max_tokens": 1}))
            .await
            .unwrap(),
        StatusCode::BAD_REQUEST,
    )
    .await;
    assert_eq!(e["param"], "prompt");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("at most 64 prompts"),
        "{e}"
    );
    let texts = vec!["ROMEO."; 65];
    let e = expect_error(
        post(json!({"model": MODEL, "prompt": texts, "max_tokens": 1}))
            .await
            .unwrap(),
        StatusCode::BAD_REQUEST,
    )
    .await;
    assert_eq!(e["param"], "prompt");
    // 64 prompts × 16 choices × 400 tokens × (1 + 5) logprob entries is too big an answer.
    let e = expect_error(
        post(
            json!({"model": MODEL, "prompt": vec![vec![5u32]; 64], "n": 16, "max_tokens": 400,
                    "logprobs": 5}),
        )
        .await
        .unwrap(),
        StatusCode::BAD_REQUEST,
    )
    .await;
    assert_eq!(e["param"], "logprobs");

    // The queue holds 2 running + 2 waiting sequences: 3 prompts × n = 2 never fits.
    let too_many = post(
        json!({"model": MODEL, "prompt": vec![vec![5u32]; 3], "n": 2,
                               "max_tokens": 1}),
    )
    .await
    .unwrap();
    assert!(!too_many.headers().contains_key("retry-after"));
    expect_error(too_many, StatusCode::TOO_MANY_REQUESTS).await;
    // One streaming request of n = 4 fills it; a request of one more sequence waits outside.
    let body = json!({"model": MODEL, "prompt": PROMPT, "n": 4, "max_tokens": 200,
                      "ignore_eos": true, "stream": true});
    let mut events = server.open_stream("/v1/completions", &body).await;
    events.next().await.expect("a first chunk");
    let full = post(json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}))
        .await
        .unwrap();
    assert!(full.headers().contains_key("retry-after"));
    expect_error(full, StatusCode::TOO_MANY_REQUESTS).await;
    drop(events);
    server.wait_idle().await;
    server.stop().await;
}

/// The prompt tokens the server holds for its sequences (every choice's prompt) are bounded: a
/// request larger than the bound is refused for good (and told not to retry), one that would
/// pass it while others run is told to retry, and every token is given back when its request
/// ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prompt_tokens_held_for_waiting_and_running_sequences_are_bounded() {
    let mut setup = Setup::default();
    setup.config.max_prompt_tokens_in_flight = Some(1_000);
    let server = start(setup).await;
    let post = |body: Value| server.post("/v1/completions").json(&body).send();
    let held = || (server.state.prompt_tokens_in_flight).load(std::sync::atomic::Ordering::SeqCst);
    // 3 prompts of 400 tokens hold 1,200.
    let too_big =
        post(json!({"model": MODEL, "prompt": vec![vec![5u32; 400]; 3], "max_tokens": 1}))
            .await
            .unwrap();
    assert!(!too_big.headers().contains_key("retry-after"));
    assert_eq!(too_big.headers()["x-should-retry"], "false");
    let e = expect_error(too_big, StatusCode::TOO_MANY_REQUESTS).await;
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("1200 prompt tokens"),
        "{e}"
    );
    // 4 choices of a 200-token prompt hold 800; a 201-token prompt does not fit beside them.
    let body = json!({"model": MODEL, "prompt": vec![5u32; 200], "n": 4, "max_tokens": 300,
                      "ignore_eos": true, "stream": true});
    let mut events = server.open_stream("/v1/completions", &body).await;
    events.next().await.expect("a first chunk");
    assert_eq!(held(), 800);
    let full = post(json!({"model": MODEL, "prompt": vec![5u32; 201], "max_tokens": 1}))
        .await
        .unwrap();
    assert!(full.headers().contains_key("retry-after"));
    expect_error(full, StatusCode::TOO_MANY_REQUESTS).await;
    let fits = post(json!({"model": MODEL, "prompt": vec![5u32; 200], "max_tokens": 1}))
        .await
        .unwrap();
    assert_eq!(fits.status(), StatusCode::OK);
    drop(events);
    server.wait_idle().await;
    let given_back = Instant::now();
    while held() != 0 && given_back.elapsed() < WAIT {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(held(), 0, "every request's tokens are given back");
    server.stop().await;
}

/// Large request bodies are bounded server-wide: what they hold beyond their first 64 KiB is
/// at most 32 of the largest size, a body that would pass it is refused at once with a 503 to
/// retry (not buffered), a small request is served all the while, a body announced and never
/// sent holds nothing, and the bytes are given back when the connections go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_request_bodies_held_at_once_are_bounded_server_wide() {
    const LIMIT: usize = 1 << 20;
    let mut setup = Setup::default();
    setup.config.max_body_bytes = LIMIT;
    let server = start(setup).await;
    let budget = Arc::clone(&server.state.body_bytes);
    let whole = budget.available_permits();
    assert_eq!(whole, ch08_server::server::BODIES_AT_ONCE * LIMIT);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n\
         Content-Length: {LIMIT}\r\n\r\n"
    );
    // Announced and never sent: nothing held.
    let mut silent = connect(&server);
    silent.write_all(head.as_bytes()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(budget.available_permits(), whole);
    // Bodies of the largest size, all but their last byte sent, until the server refuses one.
    let body_but_one = Arc::new(vec![b' '; LIMIT - 1]);
    // What a held body is charged at least: its buffer, 1 MiB (or 1 MiB − 1 if its last growth
    // came in one chunk), beyond the free 64 KiB.
    let charge = LIMIT - 1 - ch08_server::routes::FREE_BODY_BYTES;
    let (mut held, mut refusal) = (Vec::new(), None);
    for _ in 0..2 * ch08_server::server::BODIES_AT_ONCE {
        let (mut socket, head, body) = (connect(&server), head.clone(), Arc::clone(&body_but_one));
        let (budget, charged_before) = (Arc::clone(&budget), held.len() * charge);
        let (socket, reply) = blocking(move || {
            socket.write_all(head.as_bytes()).unwrap();
            let _ = socket.write_all(&body); // a refused body may be cut off while it is sent
            // Until the server has charged this body whole (held), or answered it (refused).
            let (mut reply, mut buf, since) = (Vec::new(), [0u8; 4096], Instant::now());
            while since.elapsed() < WAIT {
                if reply.is_empty() && whole - budget.available_permits() >= charged_before + charge
                {
                    break;
                }
                if String::from_utf8_lossy(&reply).contains("retry shortly") {
                    break;
                }
                match socket.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => reply.extend_from_slice(&buf[..n]),
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                    Err(_) => break,
                }
            }
            (socket, reply)
        })
        .await;
        if reply.is_empty() {
            held.push(socket);
        } else {
            refusal = Some(String::from_utf8_lossy(&reply).to_lowercase());
            break;
        }
    }
    let refusal = refusal.expect("a body past the budget is refused");
    assert!(refusal.starts_with("http/1.1 503"), "{refusal}");
    assert!(refusal.contains("retry-after: 1"), "{refusal}");
    assert!(refusal.contains("connection: close"), "{refusal}");
    assert!(
        refusal.contains("too many large request bodies"),
        "{refusal}"
    );
    assert_eq!(
        held.len(),
        whole / charge,
        "as many held as the budget pays for"
    );
    // A small request is served while the budget is spent.
    let ok = (server.post("/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    drop((held, silent));
    let since = Instant::now();
    while budget.available_permits() < whole && since.elapsed() < WAIT {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        budget.available_permits(),
        whole,
        "the bytes are given back"
    );
    server.stop().await;
}

// ─────────────────────────────────── 4. disconnects ───────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disconnect_of_a_16_choice_stream_stops_all_work_within_one_step() {
    // Room for 16 choices of 512 positions; all 16 run in one step.
    let server = start(Setup {
        kv_blocks: 600,
        ..Setup::default()
    })
    .await;
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "n": 16,
                      "ignore_eos": true, "stream": true});
    let mut events = server.open_stream("/v1/completions", &body).await;
    // The first chunk: the first step has run, all 16 choices in it.
    events.next().await.expect("a chunk");
    drop(events);
    let text = server.wait_idle().await;
    // Submitted together, every choice has its first token after one step (16 tokens). The
    // abort lands before the next step or the one after (16 or 32 tokens here; 48 allows one
    // step more on a loaded machine, where the HTTP side may notice the closed socket late).
    // Submitted one choice per step, the first chunk alone would come after 16 steps, 136
    // tokens.
    let generated = metric(&text, "kiln:generation_tokens_total", "");
    assert!(
        (16.0..=48.0).contains(&generated),
        "{generated} tokens generated for a stream abandoned after its first step"
    );
    // Counted once, as one aborted request.
    assert_eq!(finished(&text, "abort"), 1.0);
    assert_eq!(finished(&text, "length"), 0.0);
    server.stop().await;
}

/// A client that sends a streaming request and never reads: once the socket's buffers and
/// the stream's 64 events are full, the request is aborted, long before its tokens are all
/// generated (and buffered), and the send timeout closes the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_nobody_reads_is_closed_after_the_send_timeout_and_aborted() {
    // 4 prompts × 16 choices × 480 tokens: 30,720 chunks, about 8 MB of events, more than a
    // loopback socket's buffers take in (up to 4 MB for the sender here).
    let mut setup = Setup {
        kv_blocks: 2100,
        ..Setup::default()
    };
    setup.config.connections = quick_timeouts(64);
    setup.config.stream_buffer = 64; // events held for a client that does not read
    let server = start(setup).await;
    let body = json!({"model": MODEL, "prompt": [PROMPT, PROMPT, PROMPT, PROMPT],
                      "max_tokens": 480, "n": 16, "ignore_eos": true, "stream": true})
    .to_string();
    let address: std::net::SocketAddr = server.url.trim_start_matches("http://").parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(4096).unwrap(); // a small window: the server's writes block soon
    socket.connect(&address.into()).unwrap();
    let mut socket: TcpStream = socket.into();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).unwrap();
    // The response has begun (its headers, the first chunks); from here on nobody reads.
    let mut first = [0u8; 64];
    let n = std::io::Read::read(&mut socket, &mut first).unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &first[..n]);
    // The engine can be idle (the request aborted there) a moment before the HTTP side counts
    // the request as finished: wait for both.
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = server.wait_idle().await;
        if finished(&text, "abort") >= 1.0 || Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(finished(&text, "abort"), 1.0, "{text}");
    let generated = metric(&text, "kiln:generation_tokens_total", "");
    assert!(
        generated < 64.0 * 480.0,
        "{generated} tokens: the request ran to its end"
    );
    // The server closed the socket: after what the buffers held, the stream ends.
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let (_, closed) =
        blocking(move || until_closed(socket, Instant::now(), &[], Duration::ZERO)).await;
    assert!(closed.is_some(), "the connection is still open");
    server.stop().await;
}

// ─────────────────────────────────── 5. health and audit ───────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_engine_thread_makes_health_fail() {
    let server = start(Setup::default()).await;
    assert_eq!(
        server.get("/health").send().await.unwrap().status(),
        StatusCode::OK
    );
    server.state.engine.stop();
    let deadline = Instant::now() + WAIT;
    loop {
        let status = server.get("/health").send().await.unwrap().status();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/health still {status} with no engine"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refused = server
        .post("/v1/completions")
        .json(&json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    expect_error(refused, StatusCode::SERVICE_UNAVAILABLE).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_every_request_and_never_the_key() {
    let records: Arc<Mutex<Vec<AccessRecord>>> = Arc::default();
    let mut setup = Setup {
        keys: vec!["sk-secret-one".into(), "sk-secret-two".into()],
        ..Setup::default()
    };
    let sink = Arc::clone(&records);
    setup.config.access_log = Some(AccessLog(Arc::new(move |record: &AccessRecord| {
        sink.lock().unwrap().push(record.clone());
    })));
    let server = start(setup).await;
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": true});
    let whole = server
        .post("/v1/completions?key=sk-secret-one")
        .bearer_auth("sk-secret-two")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(whole.status(), StatusCode::OK);
    let whole: Value = whole.json().await.unwrap();
    let stream = server
        .post("/v1/completions")
        .bearer_auth("sk-secret-two")
        .json(&streamed(&body))
        .send()
        .await
        .unwrap();
    let mut events = Events::new(stream);
    while events.next().await.is_some() {}
    let wrong = server
        .post("/v1/completions")
        .bearer_auth("sk-secret-one-wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    expect_error(wrong, StatusCode::UNAUTHORIZED).await;
    server.get("/health").send().await.unwrap();

    let deadline = Instant::now() + WAIT;
    while records.lock().unwrap().len() < 4 {
        assert!(Instant::now() < deadline, "{:?}", records.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut records = records.lock().unwrap().clone();
    records.sort_by_key(|r| {
        (
            r.path.clone(),
            std::cmp::Reverse(r.usage.is_some()),
            r.status,
        )
    });
    let tokens = whole["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    // (status, path, key id, (prompt, completion) tokens)
    type Line<'a> = (u16, &'a str, Option<&'a str>, Option<(usize, usize)>);
    let lines: Vec<Line<'_>> = records
        .iter()
        .map(|r| {
            (
                r.status,
                r.path.as_str(),
                r.key_id.as_deref(),
                r.usage.map(|u| (u.prompt_tokens, u.completion_tokens)),
            )
        })
        .collect();
    assert_eq!(
        lines,
        [
            (200, "/health", None, None),
            (200, "/v1/completions", Some("key-2"), Some((tokens, 3))),
            (200, "/v1/completions", Some("key-2"), Some((tokens, 3))),
            (401, "/v1/completions", None, None),
        ]
    );
    for record in &records {
        assert_eq!(
            record.method,
            if record.path == "/health" {
                "GET"
            } else {
                "POST"
            }
        );
        assert_eq!(record.client, Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        let line = record.to_string();
        assert!(!line.contains("sk-secret"), "{line}");
    }
    server.stop().await;
}

// ─────────────────────────────────── 6. output ───────────────────────────────────

/// Checks one choice's completions logprobs against their definitions: `text_offset[i]` is
/// where `tokens[i]` starts in the text (the sum of the tokens' lengths before it), and each
/// `top_logprobs` object is written most likely first.
fn check_logprobs(response: &CompletionResponse) {
    let choice = &response.choices[0];
    let lp = choice.logprobs.as_ref().expect("logprobs");
    let joined: String = lp.tokens.concat();
    assert_eq!(
        joined, choice.text,
        "ignore_eos, no stop: the tokens are the text"
    );
    let mut offset = 0;
    for (i, token) in lp.tokens.iter().enumerate() {
        assert_eq!(lp.text_offset[i], offset, "token {i}");
        offset += token.len();
        let values: Vec<f32> = lp.top_logprobs[i].entries().iter().map(|e| e.1).collect();
        assert!(values.len() >= 2, "{values:?}");
        assert!(
            values.windows(2).all(|w| w[0] >= w[1]),
            "token {i}: {values:?}"
        );
        assert_eq!(
            values[0], lp.token_logprobs[i],
            "greedy picks the likeliest"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprob_offsets_and_order_follow_their_definitions_streamed_or_not() {
    let server = start(Setup::default()).await;
    // A stop string that never completes, but whose first character ends some tokens: their
    // text is held back until the next token shows it is no stop, and the offsets must not
    // lag behind.
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                      "logprobs": 5, "ignore_eos": true, "stop": ["\nQQQQ"]});
    let whole = server
        .post("/v1/completions")
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let whole: CompletionResponse = serde_json::from_str(&whole).unwrap();
    check_logprobs(&whole);
    let text = &whole.choices[0].text;
    assert!(
        text[..text.len() - 1].contains('\n'),
        "no text was held back: {text:?}"
    );

    // The stream's chunks, joined into one choice: the same offsets, running on from chunk
    // to chunk.
    let mut body = body;
    body["stream"] = json!(true);
    let response = server
        .post("/v1/completions")
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut events = Events::new(response);
    let mut joined: Option<CompletionResponse> = None;
    while let Some(data) = events.next().await {
        if data == "[DONE]" {
            break;
        }
        let chunk: CompletionResponse = serde_json::from_str(&data).unwrap();
        match &mut joined {
            None => joined = Some(chunk),
            Some(into) => {
                let (into, from) = (&mut into.choices[0], &chunk.choices[0]);
                into.text.push_str(&from.text);
                let (a, b) = (
                    into.logprobs.as_mut().unwrap(),
                    from.logprobs.as_ref().unwrap(),
                );
                a.tokens.extend(b.tokens.iter().cloned());
                a.token_logprobs.extend(&b.token_logprobs);
                a.top_logprobs.extend(b.top_logprobs.iter().cloned());
                a.text_offset.extend(&b.text_offset);
            }
        }
    }
    let joined = joined.expect("chunks");
    check_logprobs(&joined);
    assert_eq!(joined.choices[0].logprobs, whole.choices[0].logprobs);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_and_time_to_first_token_count_requests_not_choices() {
    let server = start(Setup::default()).await;
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 4,
                      "ignore_eos": true});
    let response = server.json("/v1/completions", &body).await;
    assert_eq!(response["choices"].as_array().unwrap().len(), 4);
    let text = server.wait_idle().await;
    for (name, label) in [
        ("kiln:request_success_total", "finished_reason=\"length\""),
        ("kiln:time_to_first_token_seconds_count", ""),
        ("kiln:e2e_request_latency_seconds_count", ""),
    ] {
        assert_eq!(metric(&text, name, label), 1.0, "{name}");
    }
    // Inter-token gaps stay per choice: 4 choices × 2 gaps.
    assert_eq!(
        metric(&text, "kiln:inter_token_latency_seconds_count", ""),
        8.0
    );
    server.stop().await;
}
