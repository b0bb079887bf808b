//! The dashboard over real HTTP: `/dashboard` is the page, `/dashboard/state` the engine's
//! snapshot; the snapshot's counters and histograms are `/metrics`' numbers.

use crate::support;

use std::time::{Duration, Instant};

use ch08_server::dashboard::{BlockKind, DashboardState, MAX_LISTED_BLOCKS, MAX_LISTED_REQUESTS};
use reqwest::StatusCode;
use serde_json::json;

use support::*;

const KEY: &str = "sk-dash";

async fn state(server: &TestServer) -> DashboardState {
    let response = server
        .get("/dashboard/state")
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["cache-control"], "no-store");
    let text = response.text().await.unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// The values of `name`'s `_bucket` lines, in order (`le` ascending, `+Inf` last).
fn buckets(text: &str, name: &str) -> Vec<u64> {
    let prefix = format!("{name}_bucket{{");
    text.lines()
        .filter(|line| line.starts_with(&prefix))
        .map(|line| line.rsplit_once(' ').unwrap().1.parse().unwrap())
        .collect()
}

/// Checks what holds in every snapshot, whenever it is taken.
fn check_bounds(s: &DashboardState, max_num_seqs: usize) {
    let e = &s.engine;
    assert!(e.running.total <= max_num_seqs, "{:?}", e.running);
    assert_eq!(e.kv.used_blocks + e.kv.free_blocks, e.kv.num_blocks);
    assert!(e.kv.cached_free_blocks <= e.kv.free_blocks);
    for queue_len in [
        e.running.shown.len(),
        e.waiting.shown.len(),
        e.swapped.shown.len(),
    ] {
        assert!(queue_len <= MAX_LISTED_REQUESTS);
    }
    assert_eq!(e.running.total, e.running.shown.len() + e.running.left_out);
    let mut held = 0;
    for r in &e.running.shown {
        assert_eq!(r.blocks.len(), r.num_blocks.min(MAX_LISTED_BLOCKS));
        assert!(r.num_computed <= r.num_blocks * e.kv.block_size, "{r:?}");
        for b in &r.blocks {
            assert!(b.refs >= 1, "{r:?}");
            assert!(b.filled <= e.kv.block_size);
            assert_eq!(b.kind == BlockKind::Shared, b.refs > 1, "{r:?}");
        }
        held += r.num_blocks;
    }
    // Shared blocks are counted once per table here: at least the blocks in use.
    if e.running.left_out == 0 {
        assert!(held >= e.kv.used_blocks, "{held} < {:?}", e.kv);
    }
    for step in &e.steps {
        assert!(
            step.prefill_tokens + step.decode_tokens <= step.budget,
            "{step:?}"
        );
    }
    assert!(e.steps.len() <= e.limits.steps_kept);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_open_and_the_state_needs_the_key() {
    let server = start(Setup {
        keys: vec![KEY.into()],
        ..Setup::default()
    })
    .await;
    let page = server.get("/dashboard").send().await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    assert!(
        page.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    assert!(page.headers().contains_key("content-security-policy"));
    let html = page.text().await.unwrap();
    assert!(html.contains("dashboard/state"));
    assert!(html.contains("id=\"kv-used\""));

    let refused = server.get("/dashboard/state").send().await.unwrap();
    let error = expect_error(refused, StatusCode::UNAUTHORIZED).await;
    assert_eq!(error["type"], "authentication_error");
    let wrong = server
        .get("/dashboard/state")
        .bearer_auth("sk-wrong")
        .send()
        .await
        .unwrap();
    expect_error(wrong, StatusCode::UNAUTHORIZED).await;

    // Idle: nothing queued, nothing used, no step yet.
    let s = state(&server).await;
    assert_eq!(s.engine.step, 0);
    assert_eq!(s.engine.running.total + s.engine.waiting.total, 0);
    assert_eq!(s.engine.kv.used_blocks, 0);
    assert!(s.engine.speculative.is_none());
    assert_eq!(s.latency.ttft.count, 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_under_load_shows_shared_prefixes_and_ends_equal_to_metrics() {
    let mut setup = Setup {
        keys: vec![KEY.into()],
        prefix_caching: true,
        ..Setup::default()
    };
    setup.config.engine.max_num_seqs = 8;
    let max_num_seqs = setup.config.engine.max_num_seqs;
    let server = std::sync::Arc::new(start(setup).await);
    // Three blocks of 16 and more: the later requests find them in the prefix cache.
    let prompt = [PROMPT; 5].join("\n");
    assert!(count_tokens(&prompt) > 48);
    let body = |max_tokens: usize, seed: usize| {
        json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
               "temperature": 0.8, "seed": seed, "stream": true})
    };

    // The first request computes the prompt; once its first token is out, the prompt's full
    // blocks are in the cache.
    let post = |b: serde_json::Value| {
        let server = std::sync::Arc::clone(&server);
        async move {
            server
                .post("/v1/completions")
                .bearer_auth(KEY)
                .json(&b)
                .send()
                .await
                .unwrap()
        }
    };
    let mut first = Events::new(post(body(50, 0)).await);
    first.next().await.expect("a first token");
    let mut wave = Vec::new();
    for i in 1..=5 {
        let mut events = Events::new(post(body(12, i)).await);
        events.next().await.expect("a first token");
        wave.push(events);
    }
    // Every request of the wave runs beside the first, on its prefix blocks.
    let s = state(&server).await;
    check_bounds(&s, max_num_seqs);
    let shared: Vec<_> = s
        .engine
        .running
        .shown
        .iter()
        .filter(|r| r.num_cached_tokens >= 48)
        .collect();
    assert!(!shared.is_empty(), "{:?}", s.engine.running);
    for r in &shared {
        assert!(
            r.blocks[..3]
                .iter()
                .all(|b| b.refs >= 2 && b.kind == BlockKind::Shared),
            "{r:?}"
        );
    }
    assert!(s.engine.counters.prefix_cache_hits >= 3);

    // While they run: each snapshot lies between the /metrics before and after it.
    let deadline = Instant::now() + WAIT;
    let mut last_step = s.engine.step;
    loop {
        let before = server.metrics().await;
        let s = state(&server).await;
        let after = server.metrics().await;
        check_bounds(&s, max_num_seqs);
        assert!(s.engine.step >= last_step);
        last_step = s.engine.step;
        for (name, value) in [
            (
                "kiln:generation_tokens_total",
                s.engine.counters.generation_tokens,
            ),
            ("kiln:prompt_tokens_total", s.engine.counters.prompt_tokens),
            (
                "kiln:prefix_cache_hits_total",
                s.engine.counters.prefix_cache_hits,
            ),
            ("kiln:num_preemptions_total", s.engine.preemptions.total),
        ] {
            let value = value as f64;
            assert!(metric(&before, name, "") <= value && value <= metric(&after, name, ""));
        }
        let count = s.latency.inter_token.count as f64;
        let itl = "kiln:inter_token_latency_seconds_count";
        assert!(metric(&before, itl, "") <= count && count <= metric(&after, itl, ""));
        if s.engine.running.total == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the load never ended");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    while first.next().await.is_some() {}
    for mut events in wave {
        while events.next().await.is_some() {}
    }

    // Idle: every number equals /metrics'.
    let text = server.wait_idle().await;
    let s = state(&server).await;
    let e = &s.engine;
    let gauge = |name: &str| metric(&text, name, "");
    assert_eq!(e.running.total as f64, gauge("kiln:num_requests_running"));
    assert_eq!(e.waiting.total as f64, gauge("kiln:num_requests_waiting"));
    assert_eq!(e.swapped.total as f64, gauge("kiln:num_requests_swapped"));
    assert_eq!(e.kv.usage, gauge("kiln:kv_cache_usage_perc"));
    assert_eq!(
        e.preemptions.total as f64,
        gauge("kiln:num_preemptions_total")
    );
    for (name, value) in [
        ("kiln:prompt_tokens_total", e.counters.prompt_tokens),
        ("kiln:generation_tokens_total", e.counters.generation_tokens),
        (
            "kiln:prefix_cache_queries_total",
            e.counters.prefix_cache_queries,
        ),
        ("kiln:prefix_cache_hits_total", e.counters.prefix_cache_hits),
    ] {
        assert_eq!(value as f64, gauge(name), "{name}");
    }
    assert_eq!(e.counters.generation_tokens, 50 + 5 * 12);
    for (name, hist) in [
        ("kiln:time_to_first_token_seconds", &s.latency.ttft),
        ("kiln:inter_token_latency_seconds", &s.latency.inter_token),
        ("kiln:e2e_request_latency_seconds", &s.latency.e2e),
    ] {
        assert_eq!(buckets(&text, name), hist.cumulative, "{name}");
        assert_eq!(hist.count as f64, gauge(&format!("{name}_count")), "{name}");
        let sum = gauge(&format!("{name}_sum"));
        assert!((hist.sum - sum).abs() <= 1e-9 * sum.max(1.0), "{name}");
    }
    assert_eq!(s.latency.ttft.count, 6);
    for (reason, count) in &s.latency.finished {
        assert_eq!(*count as f64, finished(&text, reason), "{reason}");
    }
    // The steps add up to the tokens: every generated token but each request's last was run
    // as a decode, unless the history dropped the oldest steps.
    if e.steps.len() < e.limits.steps_kept {
        let decodes: usize = e.steps.iter().map(|s| s.decode_tokens).sum();
        assert_eq!(decodes as u64, e.counters.generation_tokens - 6);
    }
    let server = std::sync::Arc::into_inner(server).expect("no request left");
    server.stop().await;
}
