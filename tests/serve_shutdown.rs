//! `kiln serve` ends cleanly on SIGTERM: it stops taking new work at once, lets the stream in
//! flight finish (or aborts it after `--shutdown-grace`), and exits with status 0.
#![cfg(unix)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

/// The next server-sent event's data from `response` (keep-alive comments skipped).
async fn next_event(response: &mut reqwest::Response, buffer: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            let event = String::from_utf8(event).unwrap();
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect();
            if !data.is_empty() {
                return Some(data.join("\n"));
            }
            continue;
        }
        match response.chunk().await.expect("reading the stream") {
            Some(bytes) => buffer.extend_from_slice(&bytes),
            None => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_refuses_new_work_finishes_the_stream_and_exits_zero() {
    let grace = 5;
    // Up: /health answers 200.
    let (mut server, client, url) = common::serve(["--shutdown-grace", &grace.to_string()]).await;

    // A long stream in flight.
    let body = serde_json::json!({
        "model": "bard", "prompt": "ROMEO.", "max_tokens": 400, "ignore_eos": true,
        "stream": true,
    });
    let mut stream = client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), reqwest::StatusCode::OK, "{}", server.log());
    let mut buffer = Vec::new();
    next_event(&mut stream, &mut buffer)
        .await
        .expect("a first chunk");

    let pid = server.child.id().to_string();
    let signalled = Instant::now();
    let kill = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(kill.success());

    // New work is refused shortly: the connection is refused, or the answer is 503. (A fresh
    // client: the first one's idle connections would be reused.)
    let fresh = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    loop {
        match fresh.get(format!("{url}/health")).send().await {
            Err(_) => break,
            Ok(r) if r.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE => break,
            Ok(r) => assert_eq!(r.status(), reqwest::StatusCode::OK),
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(5),
            "still taking work 5 s after SIGTERM:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The stream in flight ends properly: a last chunk with its reason, then [DONE].
    let mut last = None;
    loop {
        let data = tokio::time::timeout(
            Duration::from_secs(grace + 10),
            next_event(&mut stream, &mut buffer),
        )
        .await
        .expect("the stream ends within the grace")
        .unwrap_or_else(|| panic!("the stream ended without [DONE]:\n{}", server.log()));
        if data == "[DONE]" {
            break;
        }
        last = Some(serde_json::from_str::<serde_json::Value>(&data).unwrap());
    }
    let reason = last.unwrap()["choices"][0]["finish_reason"].clone();
    assert!(
        reason == "length" || reason == "abort",
        "finish_reason {reason}"
    );
    drop(stream);
    drop(client);

    // And the process exits with 0 within the grace period and a margin.
    let status = loop {
        if let Some(status) = server.exited() {
            break status;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(grace + 10),
            "kiln serve did not exit:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "exit {status}:\n{}", server.log());
    let log = server.log();
    assert!(log.contains("shutting down"), "{log}");
    assert!(log.contains("stopped"), "{log}");
}
