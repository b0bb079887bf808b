//! `kiln bench serve --abusive-mix F`: what abusive clients cost the normal ones. Each rate
//! runs twice, side by side: clean (the normal requests alone), then abusive (the same normal
//! requests at the same times, and besides them ⌈F × N⌉ abusive requests arriving at the same
//! rate, one kind after another):
//!
//! ```text
//! slow client       sends a request's headers one byte every 500 ms, never finishing them
//! oversized prompt  a 7 MB prompt (under the 8 MiB body limit), which cannot fit any context
//! disconnect        a stream of n = 16 choices at the longest max_tokens, dropped after its
//!                   first chunk
//! ```
//! The normal requests' throughput and TTFT are measured as in a clean run; the table puts
//! both runs of a rate side by side, with the ratios.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use serde_json::json;
use tokio::net::TcpStream;

use super::Rate;
use super::client::RequestConfig;
use super::report::Metrics;
use crate::bench::table::Table;

/// Bytes of an oversized prompt.
pub const OVERSIZED_PROMPT_BYTES: usize = 7_000_000;
/// A slow client sends one byte this often.
const TRICKLE: Duration = Duration::from_millis(500);
/// The longest any abusive request is followed.
const GIVE_UP: Duration = Duration::from_secs(120);

/// One kind of abusive request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Abuse {
    SlowClient,
    OversizedPrompt,
    Disconnect,
}

impl Abuse {
    /// The `i`-th abusive request's kind: the three in turn.
    pub fn nth(i: usize) -> Self {
        [Abuse::SlowClient, Abuse::OversizedPrompt, Abuse::Disconnect][i % 3]
    }
}

/// What the server did with one abusive request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub kind: Abuse,
    /// Sent → the server closed the connection, refused the request, or (a disconnect) sent
    /// its first chunk; seconds.
    pub held_s: f64,
    /// The HTTP status, `closed` (a slow client the server hung up on), or what went wrong.
    pub result: String,
}

/// Sends one abusive request of `kind` to the server at `addr` (`host:port`).
pub async fn send(
    http: &reqwest::Client,
    config: &RequestConfig,
    addr: &str,
    kind: Abuse,
    max_tokens: usize,
) -> Outcome {
    let sent = Instant::now();
    let result = match kind {
        Abuse::SlowClient => slow_client(addr, config.endpoint.path()).await,
        Abuse::OversizedPrompt => {
            let prompt = "To be, or not to be, that is the question. "
                .repeat(OVERSIZED_PROMPT_BYTES / 43 + 1)[..OVERSIZED_PROMPT_BYTES]
                .to_string();
            let body = config.body(&prompt, max_tokens);
            match authorized(http.post(&config.url), config)
                .json(&body)
                .send()
                .await
            {
                Ok(response) => Ok(response.status().as_u16().to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
        Abuse::Disconnect => {
            let mut body = config.body("To be, or not to be", max_tokens);
            body["n"] = json!(16);
            body["ignore_eos"] = json!(true);
            match authorized(http.post(&config.url), config)
                .json(&body)
                .send()
                .await
            {
                Ok(response) => {
                    let status = response.status().as_u16().to_string();
                    // The first chunk, then gone (the response and its connection dropped).
                    let _ = response.bytes_stream().next().await;
                    Ok(status)
                }
                Err(e) => Err(e.to_string()),
            }
        }
    };
    Outcome {
        kind,
        held_s: sent.elapsed().as_secs_f64(),
        result: result.unwrap_or_else(|e| format!("error: {e}")),
    }
}

fn authorized(request: reqwest::RequestBuilder, config: &RequestConfig) -> reqwest::RequestBuilder {
    match &config.api_key {
        Some(key) => request.bearer_auth(key),
        None => request,
    }
}

/// Headers one byte at a time until the server hangs up: `closed`, or an error after
/// [`GIVE_UP`].
async fn slow_client(addr: &str, path: &str) -> Result<String, String> {
    let socket = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let head = format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\nx-slow: ");
    write_all(&socket, head.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    while started.elapsed() < GIVE_UP {
        if write_all(&socket, b"x").await.is_err() {
            return Ok("closed".into());
        }
        let read = async {
            socket.readable().await?;
            socket.try_read(&mut buf)
        };
        match tokio::time::timeout(TRICKLE, read).await {
            Ok(Ok(0)) => return Ok("closed".into()),
            Ok(Err(e)) if e.kind() != std::io::ErrorKind::WouldBlock => {
                return Ok("closed".into());
            }
            _ => {} // nothing yet, or an answer before the close
        }
    }
    Err(format!("still open after {} s", GIVE_UP.as_secs()))
}

async fn write_all(socket: &TcpStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        socket.writable().await?;
        match socket.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `host:port` of a base URL (`http://host:port/...`).
pub fn host_port(base_url: &str) -> anyhow::Result<String> {
    let rest = base_url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow::anyhow!("--abusive-mix needs an http:// --base-url"))?;
    let host = rest.split('/').next().unwrap_or(rest);
    Ok(if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:80")
    })
}

/// One line per kind: how many, what the server answered, how long each was held (mean).
pub fn summary(outcomes: &[Outcome]) -> String {
    let mut parts = Vec::new();
    for (kind, name) in [
        (Abuse::SlowClient, "slow clients"),
        (Abuse::OversizedPrompt, "oversized prompts"),
        (Abuse::Disconnect, "disconnects"),
    ] {
        let of_kind: Vec<&Outcome> = outcomes.iter().filter(|o| o.kind == kind).collect();
        if of_kind.is_empty() {
            continue;
        }
        let mut results: Vec<&str> = of_kind.iter().map(|o| o.result.as_str()).collect();
        results.sort_unstable();
        results.dedup();
        let mean = of_kind.iter().map(|o| o.held_s).sum::<f64>() / of_kind.len() as f64;
        parts.push(format!(
            "{} {name} ({}, {mean:.1} s)",
            of_kind.len(),
            results.join("/")
        ));
    }
    parts.join(", ")
}

/// The side-by-side table: per rate, the clean run, the abusive run, and the ratios.
pub fn table(runs: &[(Rate, Metrics, Metrics, Vec<Outcome>)]) -> String {
    let mut table = Table::new([
        "request rate (req/s)",
        "run",
        "completed",
        "failed",
        "output tok/s",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "abusive requests (answer, mean time held)",
    ])
    .align(1, crate::bench::table::Align::Left)
    .align(7, crate::bench::table::Align::Left);
    for (rate, clean, abusive, outcomes) in runs {
        for (name, m, what) in [
            ("clean", clean, "none".to_string()),
            ("abusive", abusive, summary(outcomes)),
        ] {
            table.row([
                rate.to_string(),
                name.to_string(),
                m.completed.to_string(),
                m.failed.to_string(),
                format!("{:.1}", m.output_throughput),
                format!("{:.0}", m.ttft.median_ms),
                format!("{:.0}", m.ttft.p99_ms),
                what,
            ]);
        }
        table.row([
            rate.to_string(),
            "abusive / clean".to_string(),
            String::new(),
            String::new(),
            format!(
                "{:.2}x",
                abusive.output_throughput / clean.output_throughput
            ),
            format!("{:.2}x", abusive.ttft.median_ms / clean.ttft.median_ms),
            format!("{:.2}x", abusive.ttft.p99_ms / clean.ttft.p99_ms),
            String::new(),
        ]);
    }
    table.to_markdown()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_take_turns_and_urls_give_their_address() {
        let kinds: Vec<Abuse> = (0..5).map(Abuse::nth).collect();
        assert_eq!(
            kinds,
            [
                Abuse::SlowClient,
                Abuse::OversizedPrompt,
                Abuse::Disconnect,
                Abuse::SlowClient,
                Abuse::OversizedPrompt
            ]
        );
        assert_eq!(
            host_port("http://127.0.0.1:8000").unwrap(),
            "127.0.0.1:8000"
        );
        assert_eq!(host_port("http://localhost/v1").unwrap(), "localhost:80");
        assert!(host_port("https://x").is_err());
    }

    #[test]
    fn the_summary_counts_each_kind_and_its_answers() {
        let outcome = |kind, held_s, result: &str| Outcome {
            kind,
            held_s,
            result: result.into(),
        };
        let outcomes = [
            outcome(Abuse::SlowClient, 10.0, "closed"),
            outcome(Abuse::SlowClient, 11.0, "closed"),
            outcome(Abuse::OversizedPrompt, 0.1, "400"),
            outcome(Abuse::Disconnect, 0.3, "200"),
        ];
        assert_eq!(
            summary(&outcomes),
            "2 slow clients (closed, 10.5 s), 1 oversized prompts (400, 0.1 s), \
             1 disconnects (200, 0.3 s)"
        );
    }
}
