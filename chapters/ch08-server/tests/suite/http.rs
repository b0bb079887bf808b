//! The server over real HTTP: a `reqwest` client against a [`Server`] on a free port, with the
//! embedded shakespeare-small model (6 layers, 4096 tokens, context 512).
//!
//! Each test starts its own server (its own engine thread and KV pool) so that the metrics it
//! reads are its own; the model is loaded once per test binary. Every wait is bounded: the
//! client has a timeout, and polling loops give up after [`WAIT`].

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ch04::EngineConfig;
use ch08_server::ServerError;
use ch08_server::chat_template::{ChatMessage, ChatTemplate};
use ch08_server::rate_limit::RateLimit;
use reqwest::StatusCode;
use serde_json::{Value, json};

use support::*;

#[test]
fn start_up_refuses_what_cannot_serve_one_max_length_request() {
    // 20 blocks of 16 = 320 positions (less the watermark) < the context of 512.
    let small_pool = Setup {
        kv_blocks: 20,
        ..Setup::default()
    };
    match build(small_pool) {
        Err(ServerError::KvTooSmall {
            capacity,
            max_model_len: 512,
        }) => assert!(capacity < 512, "{capacity}"),
        other => panic!("expected KvTooSmall, got {:?}", other.err()),
    }
    // The same pool serves a shorter --max-model-len.
    let mut shorter = Setup {
        kv_blocks: 20,
        ..Setup::default()
    };
    shorter.config.max_model_len = Some(256);
    assert!(build(shorter).is_ok());

    let mut too_long = Setup::default();
    too_long.config.max_model_len = Some(1024);
    assert!(matches!(
        build(too_long).err(),
        Some(ServerError::MaxModelLen {
            requested: 1024,
            model: 512
        })
    ));

    // A prompt token and one more: 1 is a server no request could use.
    for useless in [0, 1] {
        let mut setup = Setup::default();
        setup.config.max_model_len = Some(useless);
        assert!(matches!(
            build(setup).err(),
            Some(ServerError::MaxModelLen { requested, model: 512 }) if requested == useless
        ));
    }

    let mut unchunked = Setup::default();
    unchunked.config.engine = EngineConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: 256,
        ..EngineConfig::default()
    };
    assert!(matches!(
        build(unchunked).err(),
        Some(ServerError::BudgetTooSmall {
            budget: 256,
            needed: 511,
            max_model_len: 512
        })
    ));
    // A budget of max_model_len − 1 serves every request: the longest step is a prompt of
    // 511 tokens, or under recomputation 1 + 510 rerun outputs.
    let mut unchunked = Setup::default();
    unchunked.config.engine = EngineConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: 511,
        ..EngineConfig::default()
    };
    assert!(build(unchunked).is_ok());
}

/// Weights left to an executor factory, as `kiln serve --device cuda` leaves them to the GPU:
/// the host holds only the configuration, the factory's executor serves, and the answers are
/// the engine's alone (greedy and seeded), with n-gram speculation too (greedy), whose factory
/// is handed no model. Without an executor factory, or with a speculator factory that needs
/// the host weights, such a server refuses to start, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_held_by_the_executor_serve_the_same_answers() {
    let elsewhere = || Setup {
        weights_elsewhere: true,
        ..Setup::default()
    };
    let server = start(elsewhere()).await;
    let ids = loaded().tokenizer.encode(PROMPT, true).unwrap();
    for (temperature, seed) in [(0.0, 0), (0.8, 7)] {
        let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 32,
                          "temperature": temperature, "seed": seed});
        let got = server.json("/v1/completions", &body).await;
        let (text, tokens, reason) = engine_alone(ids.clone(), temperature, seed, 32);
        assert_eq!(
            text_of(&got["choices"][0]),
            text,
            "temperature {temperature}"
        );
        assert_eq!(got["usage"]["completion_tokens"], tokens);
        assert_eq!(got["choices"][0]["finish_reason"], reason);
    }
    server.stop().await;

    // Speculation without host weights: n-gram lookup needs no model.
    let handed_a_model = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut speculating = elsewhere();
    let flag = Arc::clone(&handed_a_model);
    speculating.config.speculator = Some(ch08_server::SpeculatorFactory(Arc::new(move |model| {
        flag.store(model.is_some(), Ordering::Relaxed);
        let drafter = ch06::NgramDrafter::new(1, 4).map_err(|e| e.to_string())?;
        let config = ch06::SpecConfig {
            num_speculative_tokens: 4,
            disable_by_batch_size: None,
        };
        Ok(
            Box::new(ch06::SpeculativeDecoding::new(Box::new(drafter), config))
                as Box<dyn ch04::Speculator>,
        )
    })));
    let server = start(speculating).await;
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "temperature": 0.0});
    let got = server.json("/v1/completions", &body).await;
    let (text, tokens, _) = engine_alone(ids.clone(), 0.0, 0, 32);
    assert_eq!(text_of(&got["choices"][0]), text, "n-gram speculation");
    assert_eq!(got["usage"]["completion_tokens"], tokens);
    assert!(!handed_a_model.load(Ordering::Relaxed));
    let metrics = server.metrics().await;
    let drafts = metric(&metrics, "kiln:spec_decode_num_drafts_total", "");
    assert!(drafts > 0.0, "no step drafted:\n{metrics}");
    server.stop().await;

    let loaded = loaded();
    let served = || ch08_server::ServedModel {
        weights: ch08_server::ServedWeights::Elsewhere(loaded.model.config.clone()),
        tokenizer: std::sync::Arc::clone(&loaded.tokenizer),
        chat_template: None,
        eos_token_ids: loaded.eos_token_ids.clone(),
    };
    let cache = ch04::CacheConfig {
        memory: ch03::KvPool::<f32>::bytes_per_block(&loaded.model.config, 16) * 128,
        block_size: 16,
        dtype: ch03::KvDtype::F32,
    };
    let keys = || ch08_server::auth::ApiKeys::new(Vec::new());
    let refused = ch08_server::Server::new(
        served(),
        cache,
        keys(),
        ch08_server::ServerConfig::default(),
        |f| f(),
    );
    let message = refused
        .err()
        .expect("no executor for weights elsewhere")
        .to_string();
    assert!(
        message.contains("the CPU executor needs the weights in host memory"),
        "{message}"
    );
    // A speculator factory that needs the host weights: its reason fails the start.
    let mut config = elsewhere().config;
    let model: &'static ch01::Llama = &loaded.model;
    config.executor = Some(ch08_server::ExecutorFactory(Arc::new(
        move |_config, cache| {
            ch07::cpu_executor(model, cache, ch07::AttentionKind::Naive)
                .map(|e| e as Box<dyn ch04::Executor + Send>)
                .map_err(|e| e.to_string())
        },
    )));
    config.speculator = Some(ch08_server::SpeculatorFactory(Arc::new(
        |model| match model {
            Some(_) => Err("handed host weights that are not there".to_string()),
            None => Err("this drafter needs the weights in host memory".to_string()),
        },
    )));
    let refused = ch08_server::Server::new(served(), cache, keys(), config, |f| f());
    let message = refused
        .err()
        .expect("a speculator without host weights")
        .to_string();
    assert!(
        message.contains("this drafter needs the weights in host memory"),
        "{message}"
    );
}

// ───────────────────────────────────── 1. responses agree ─────────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_streamed_and_whole_agree_with_exact_usage() {
    let server = start(Setup::default()).await;
    let prompt_tokens = count_tokens(PROMPT) + 1; // completions add BOS
    let body = json!({
        "model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 7,
    });
    let whole = server.json("/v1/completions", &body).await;
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["model"], MODEL);
    assert!(whole["id"].as_str().unwrap().starts_with("cmpl-"));
    let choice = &whole["choices"][0];
    assert_eq!(choice["index"], 0);
    let text = text_of(choice);
    assert!(!text.contains("</s>"), "{text:?}");
    let reason = choice["finish_reason"].as_str().unwrap();
    let usage = &whole["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    let completion_tokens = usage["completion_tokens"].as_u64().unwrap();
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        prompt_tokens as u64 + completion_tokens
    );
    match reason {
        "length" => assert_eq!(completion_tokens, 24),
        "stop" => assert!(completion_tokens < 24),
        other => panic!("finish_reason {other}"),
    }
    // The text is what the engine generates alone with this seed, decoded in one go.
    let ids = loaded().tokenizer.encode(PROMPT, true).unwrap();
    let alone = engine_alone(ids.clone(), 0.8, 7, 24);
    assert_eq!(
        (text, completion_tokens as usize, reason),
        (alone.0.as_str(), alone.1, alone.2)
    );
    // More seeds and longer texts, so that some end at EOS and some cross odd characters.
    for seed in 1..=4u64 {
        let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 80,
                          "temperature": 1.0, "seed": seed});
        let got = server.json("/v1/completions", &body).await;
        let (text, tokens, reason) = engine_alone(ids.clone(), 1.0, seed, 80);
        assert_eq!(text_of(&got["choices"][0]), text, "seed {seed}");
        assert_eq!(got["usage"]["completion_tokens"], tokens, "seed {seed}");
        assert_eq!(got["choices"][0]["finish_reason"], reason, "seed {seed}");
    }

    let events = server.stream("/v1/completions", &streamed(&body)).await;
    let (chunks, last) = split_usage(&events);
    assert_eq!(last["usage"], *usage, "the stream's usage");
    let mut joined = String::new();
    for (i, chunk) in chunks.iter().enumerate() {
        assert_eq!(chunk["object"], "text_completion");
        assert_eq!(chunk["choices"].as_array().unwrap().len(), 1, "{chunk}");
        let c = &chunk["choices"][0];
        assert_eq!(c["index"], 0);
        joined.push_str(text_of(c));
        let expected = if i + 1 == chunks.len() {
            json!(reason)
        } else {
            Value::Null
        };
        assert_eq!(
            c["finish_reason"],
            expected,
            "chunk {i} of {}",
            chunks.len()
        );
    }
    assert_eq!(joined, text, "streamed text = whole text for the same seed");

    // ignore_eos: exactly max_tokens tokens, one chunk each, and no usage chunk unless asked.
    let seven = json!({
        "model": MODEL, "prompt": PROMPT, "max_tokens": 7, "ignore_eos": true, "temperature": 0,
    });
    let whole = server.json("/v1/completions", &seven).await;
    assert_eq!(whole["usage"]["completion_tokens"], 7);
    assert_eq!(whole["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    let mut plain = seven.clone();
    plain["stream"] = json!(true);
    let chunks = server.stream("/v1/completions", &plain).await;
    assert_eq!(chunks.len(), 7, "one chunk per token, no usage chunk");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    let joined: String = chunks.iter().map(|c| text_of(&c["choices"][0])).collect();
    assert_eq!(joined, text_of(&whole["choices"][0]));

    // Token-id prompts: no BOS added, the ids are the prompt.
    let ids = loaded().tokenizer.encode(PROMPT, true).unwrap();
    let by_ids = server
        .json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": ids, "max_tokens": 7, "ignore_eos": true, "temperature": 0}),
        )
        .await;
    assert_eq!(by_ids["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(by_ids["choices"][0]["text"], whole["choices"][0]["text"]);

    // echo: the prompt, then the completion.
    let mut echo = seven.clone();
    echo["echo"] = json!(true);
    let echoed = server.json("/v1/completions", &echo).await;
    assert_eq!(
        text_of(&echoed["choices"][0]),
        format!("{PROMPT}{}", text_of(&whole["choices"][0]))
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streamed_and_whole_agree_with_exact_usage() {
    let server = start(Setup::default()).await;
    let messages = json!([
        {"role": "system", "content": "Speak as a king."},
        {"role": "user", "content": "Who goes there?"},
    ]);
    // The template (tokenizer_config.json) writes BOS as text; the server must not add another.
    let rendered = "[Speak as a king.]\n\nUSER.\nWho goes there?\n\nASSISTANT.\n";
    let template = ChatTemplate::from_model_dir(&ch01::default_model_dir())
        .unwrap()
        .unwrap();
    let from_template = template
        .render(
            &[
                ChatMessage::new("system", "Speak as a king."),
                ChatMessage::new("user", "Who goes there?"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(from_template, format!("<s>{rendered}"));
    let prompt_tokens = 1 + count_tokens(rendered);

    let body = json!({
        "model": MODEL, "messages": messages, "max_tokens": 20, "temperature": 0.8, "seed": 11,
    });
    let whole = server.json("/v1/chat/completions", &body).await;
    assert_eq!(whole["object"], "chat.completion");
    assert!(whole["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &whole["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let content = choice["message"]["content"].as_str().unwrap();
    let reason = choice["finish_reason"].as_str().unwrap();
    let usage = &whole["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    let completion_tokens = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=20).contains(&completion_tokens));
    assert_eq!(reason == "length", completion_tokens == 20, "{reason}");
    let ids = loaded().tokenizer.encode(&from_template, false).unwrap();
    assert_eq!(ids.len(), prompt_tokens);
    let alone = engine_alone(ids, 0.8, 11, 20);
    assert_eq!(
        (content, completion_tokens as usize, reason),
        (alone.0.as_str(), alone.1, alone.2)
    );

    let events = server
        .stream("/v1/chat/completions", &streamed(&body))
        .await;
    let (chunks, last) = split_usage(&events);
    assert_eq!(last["usage"], *usage);
    assert_eq!(last["object"], "chat.completion.chunk");
    // The first chunk gives the role, with empty content, as OpenAI's do.
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let mut joined = String::new();
    for (i, chunk) in chunks.iter().enumerate() {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], chunks[0]["id"], "one id per stream");
        let c = &chunk["choices"][0];
        assert!(c.get("message").is_none(), "{chunk}");
        if i > 0 {
            assert!(c["delta"].get("role").is_none(), "{chunk}");
        }
        if let Some(text) = c["delta"]["content"].as_str() {
            joined.push_str(text);
        }
        let expected = if i + 1 == chunks.len() {
            json!(reason)
        } else {
            Value::Null
        };
        assert_eq!(c["finish_reason"], expected, "chunk {i}");
    }
    assert_eq!(joined, content);

    // max_completion_tokens, OpenAI's newer name.
    let five = json!({
        "model": MODEL, "messages": messages, "max_completion_tokens": 5, "ignore_eos": true,
        "temperature": 0,
    });
    let whole = server.json("/v1/chat/completions", &five).await;
    assert_eq!(whole["usage"]["completion_tokens"], 5);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    server.stop().await;
}

// ───────────────────────────────────────── 2. n choices ─────────────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_are_indexed_and_seeded_one_apart() {
    let server = start(Setup::default()).await;
    let base = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": true});
    let with = |extra: Value| {
        let mut body = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let indexes = |r: &Value| -> Vec<u64> {
        r["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect()
    };
    let texts = |r: &Value| -> Vec<String> {
        r["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| text_of(c).to_string())
            .collect()
    };
    let prompt_tokens = count_tokens(PROMPT) + 1;

    // Greedy: three equal choices; the prompt is counted once, completions three times.
    let greedy = server
        .json("/v1/completions", &with(json!({"n": 3, "temperature": 0})))
        .await;
    assert_eq!(indexes(&greedy), [0, 1, 2]);
    let t = texts(&greedy);
    assert!(t[0] == t[1] && t[1] == t[2], "{t:?}");
    assert_eq!(greedy["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(greedy["usage"]["completion_tokens"], 36);

    // Sampled: choice i is the request with seed + i (seeded sampling is batch-invariant).
    let sampled = server
        .json(
            "/v1/completions",
            &with(json!({"n": 3, "temperature": 1.0, "seed": 100})),
        )
        .await;
    assert_eq!(indexes(&sampled), [0, 1, 2]);
    for (i, text) in texts(&sampled).iter().enumerate() {
        let alone = server
            .json(
                "/v1/completions",
                &with(json!({"temperature": 1.0, "seed": 100 + i})),
            )
            .await;
        assert_eq!(text_of(&alone["choices"][0]), text, "choice {i}");
    }
    // The same streamed: chunks interleave choices; each choice's text is the same.
    let events = server
        .stream(
            "/v1/completions",
            &streamed(&with(json!({"n": 3, "temperature": 1.0, "seed": 100}))),
        )
        .await;
    let (chunks, last) = split_usage(&events);
    assert_eq!(last["usage"], sampled["usage"]);
    let mut per_choice = vec![String::new(); 3];
    let mut finished = [0; 3];
    for chunk in chunks {
        let c = &chunk["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        per_choice[i].push_str(text_of(c));
        if c["finish_reason"] == "length" {
            finished[i] += 1;
        }
    }
    assert_eq!(per_choice, texts(&sampled));
    assert_eq!(finished, [1, 1, 1], "one last chunk per choice");

    // Two prompts × n 2: choices p × n + i, each prompt's greedy text twice.
    let other = "JULIET.\nO Romeo, Romeo";
    let both = server
        .json(
            "/v1/completions",
            &with(json!({"prompt": [PROMPT, other], "n": 2, "temperature": 0})),
        )
        .await;
    assert_eq!(indexes(&both), [0, 1, 2, 3]);
    let alone = server
        .json(
            "/v1/completions",
            &with(json!({"prompt": other, "temperature": 0})),
        )
        .await;
    let t = texts(&both);
    assert_eq!([&t[0], &t[1]], [&texts(&greedy)[0], &texts(&greedy)[0]]);
    assert_eq!([&t[2], &t[3]], [&texts(&alone)[0], &texts(&alone)[0]]);
    assert_eq!(
        both["usage"]["prompt_tokens"],
        prompt_tokens + count_tokens(other) + 1
    );
    assert_eq!(both["usage"]["completion_tokens"], 48);

    // Chat with n 2, greedy.
    let chat = server
        .json(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "Speak."}],
                    "n": 2, "temperature": 0, "max_tokens": 6, "ignore_eos": true}),
        )
        .await;
    let choices = chat["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[1]["index"], 1);
    assert_eq!(choices[0]["message"], choices[1]["message"]);
    assert_eq!(chat["usage"]["completion_tokens"], 12);
    server.stop().await;
}

/// Without a `seed`, every choice of a prompt list samples its own stream: two equal prompts
/// answer differently, as vLLM's do. With a `seed`, each prompt's choice `i` is seeded
/// `seed + i` (vLLM's rule), so equal prompts answer the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_prompts_of_a_list_sample_apart_unless_seeded() {
    let server = start(Setup::default()).await;
    let body = json!({"model": MODEL, "prompt": [PROMPT, PROMPT], "temperature": 1.0,
                      "max_tokens": 20, "ignore_eos": true});
    let r = server.json("/v1/completions", &body).await;
    let (a, b) = (text_of(&r["choices"][0]), text_of(&r["choices"][1]));
    assert_ne!(a, b, "two unseeded prompts shared one random stream");
    // n 2: four choices, four streams.
    let mut wide = body.clone();
    wide["n"] = json!(2);
    let r = server.json("/v1/completions", &wide).await;
    let texts: Vec<&str> = (0..4).map(|i| text_of(&r["choices"][i])).collect();
    for i in 0..4 {
        for j in i + 1..4 {
            assert_ne!(texts[i], texts[j], "choices {i} and {j}: {texts:?}");
        }
    }
    // Seeded: prompt p's choice i is seed + i, whatever p.
    let mut seeded = wide.clone();
    seeded["seed"] = json!(7);
    let r = server.json("/v1/completions", &seeded).await;
    let texts: Vec<&str> = (0..4).map(|i| text_of(&r["choices"][i])).collect();
    assert_eq!([texts[0], texts[1]], [texts[2], texts[3]]);
    assert_ne!(texts[0], texts[1]);
    server.stop().await;
}

/// openai-python's `message.model_dump()` writes `annotations` and `function_call` (null)
/// into an assistant message, and vLLM's responses carry `reasoning_content`: a history sent
/// back as the client holds it is accepted. A real `function_call` is refused (kiln reads
/// `tool_calls`), never dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_as_openai_python_dumps_it_is_accepted() {
    let server = start(Setup::default()).await;
    let chat = |assistant: Value| {
        json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Speak."},
            assistant,
            {"role": "user", "content": "Again."}]})
    };
    let dumped = json!({"role": "assistant", "content": "Anon.", "refusal": null,
                        "annotations": [], "audio": null, "function_call": null,
                        "tool_calls": null, "reasoning_content": "thinking"});
    let plain = json!({"role": "assistant", "content": "Anon."});
    let mut greedy = chat(dumped);
    greedy["temperature"] = json!(0);
    let mut control = chat(plain);
    control["temperature"] = json!(0);
    let r = server.json("/v1/chat/completions", &greedy).await;
    let same = server.json("/v1/chat/completions", &control).await;
    assert_eq!(
        r["usage"], same["usage"],
        "the extra fields stay out of the prompt"
    );
    assert_eq!(r["choices"][0]["message"], same["choices"][0]["message"]);
    let called = json!({"role": "assistant", "content": null,
                        "function_call": {"name": "f", "arguments": "{}"}});
    let response = server
        .post("/v1/chat/completions")
        .json(&chat(called))
        .send()
        .await
        .unwrap();
    let e = expect_error(response, StatusCode::BAD_REQUEST).await;
    assert_eq!(e["param"], "messages", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("function_call"),
        "{e}"
    );
    server.stop().await;
}

/// A chat request that says `max_completion_tokens` is answered about
/// `max_completion_tokens`, not `max_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_max_completion_tokens_when_the_client_sent_it() {
    let server = start(Setup::default()).await;
    for field in ["max_completion_tokens", "max_tokens"] {
        // 0; more than the context of 512 tokens (refused before the prompt is tokenized);
        // more than it holds after the prompt (refused once the prompt is counted).
        for value in [0, 600, 500] {
            let response = server
                .post("/v1/chat/completions")
                .json(&json!({"model": MODEL, field: value,
                              "messages": [{"role": "user", "content": "Speak."}]}))
                .send()
                .await
                .unwrap();
            let e = expect_error(response, StatusCode::BAD_REQUEST).await;
            assert_eq!(e["param"], field, "{field}: {value}: {e}");
        }
    }
    server.stop().await;
}

// ───────────────────────────────────────── 3. stop strings ─────────────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_the_text_even_across_tokens() {
    let server = start(Setup::default()).await;
    let body = json!({
        "model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": true, "temperature": 0,
    });
    // The greedy text, token by token (one streamed chunk per token).
    let mut plain = body.clone();
    plain["stream"] = json!(true);
    let pieces: Vec<String> = server
        .stream("/v1/completions", &plain)
        .await
        .iter()
        .map(|c| text_of(&c["choices"][0]).to_string())
        .collect();
    let text: String = pieces.concat();
    assert_eq!(pieces.len(), 40);
    assert!(text.chars().count() > 10, "{text:?}");
    let with_stop = |stop: Value| {
        let mut b = body.clone();
        b["stop"] = stop;
        b
    };

    // A stop string inside the text: the text before its first occurrence, "stop".
    let middle: String = text
        .chars()
        .skip(text.chars().count() / 2)
        .take(3)
        .collect();
    let expected = &text[..text.find(&middle).unwrap()];
    let cut = server
        .json("/v1/completions", &with_stop(json!(middle)))
        .await;
    assert_eq!(text_of(&cut["choices"][0]), expected, "stop {middle:?}");
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    assert!(cut["usage"]["completion_tokens"].as_u64().unwrap() < 40);

    // A stop string that spans two tokens: the end of one piece and the start of the next,
    // chosen where it first appears across that boundary (not inside an earlier token).
    let (across, at) = (1..pieces.len() - 1)
        .find_map(|i| {
            let last = pieces[i].chars().last()?;
            let across: String = [last, pieces[i + 1].chars().next()?].into_iter().collect();
            let at = pieces[..=i].concat().len() - last.len_utf8();
            (text.find(&across) == Some(at)).then_some((across, at))
        })
        .expect("two characters that first appear across a token boundary");
    let expected = &text[..at];
    for stream in [false, true] {
        let mut b = with_stop(json!([across, "never appears \u{1F600}"]));
        let got = if stream {
            b["stream"] = json!(true);
            let chunks = server.stream("/v1/completions", &b).await;
            let last = chunks.last().unwrap();
            assert_eq!(last["choices"][0]["finish_reason"], "stop");
            chunks
                .iter()
                .map(|c| text_of(&c["choices"][0]).to_string())
                .collect::<String>()
        } else {
            let r = server.json("/v1/completions", &b).await;
            assert_eq!(r["choices"][0]["finish_reason"], "stop");
            text_of(&r["choices"][0]).to_string()
        };
        assert_eq!(got, expected, "stop {across:?} (stream {stream})");
    }

    // A stop string that never appears changes nothing.
    let never = server
        .json("/v1/completions", &with_stop(json!("\u{1F600}")))
        .await;
    assert_eq!(text_of(&never["choices"][0]), text);
    assert_eq!(never["choices"][0]["finish_reason"], "length");
    server.stop().await;
}

// ───────────────────────────────────────── 4. logprobs ─────────────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_complete_and_consistent() {
    let server = start(Setup::default()).await;
    let r = server
        .json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                    "logprobs": 3}),
        )
        .await;
    let n = r["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let lp = &r["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    let token_logprobs = lp["token_logprobs"].as_array().unwrap();
    let top = lp["top_logprobs"].as_array().unwrap();
    let offsets = lp["text_offset"].as_array().unwrap();
    assert_eq!(
        [tokens.len(), token_logprobs.len(), top.len(), offsets.len()],
        [n; 4]
    );
    let mut offset = 0;
    for i in 0..n {
        let token = tokens[i].as_str().unwrap();
        let logprob = token_logprobs[i].as_f64().unwrap();
        let alternatives = top[i].as_object().unwrap();
        assert!((1..=3).contains(&alternatives.len()), "{alternatives:?}");
        assert!(logprob <= 0.0, "{logprob}");
        let best = alternatives
            .values()
            .map(|v| v.as_f64().unwrap())
            .inspect(|&v| assert!(v <= 0.0))
            .fold(f64::NEG_INFINITY, f64::max);
        // Greedy: the sampled token is the most likely one.
        assert!(
            (logprob - best).abs() < 1e-6,
            "token {i}: {logprob} vs {best}"
        );
        assert_eq!(alternatives[token].as_f64().unwrap(), logprob, "token {i}");
        assert_eq!(offsets[i], offset);
        offset += token.len();
    }
    // Without EOS the tokens' texts are the text.
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    if r["choices"][0]["finish_reason"] == "length" {
        assert_eq!(joined, text_of(&r["choices"][0]));
    }
    // Without logprobs, the field is null.
    let none = server
        .json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}),
        )
        .await;
    assert!(none["choices"][0]["logprobs"].is_null());

    let chat = server
        .json(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "Speak."}],
                    "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
        )
        .await;
    let n = chat["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let content = chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), n);
    for entry in content {
        let logprob = entry["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0);
        let token = entry["token"].as_str().unwrap();
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        if !token.contains('\u{FFFD}') {
            assert_eq!(bytes, token.as_bytes());
        }
        let alternatives = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(alternatives.len(), 2, "{entry}");
        let values: Vec<f64> = alternatives
            .iter()
            .map(|a| a["logprob"].as_f64().unwrap())
            .collect();
        assert!(
            values[0] >= values[1] && values[1] <= 0.0,
            "best first: {values:?}"
        );
        assert!((logprob - values[0]).abs() < 1e-6, "greedy picks the best");
    }
    // Streamed chat logprobs: the same entries, chunk by chunk.
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Speak."}],
                          "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    body["stream"] = json!(true);
    let streamed: Vec<Value> = server
        .stream("/v1/chat/completions", &body)
        .await
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, content);

    // A token that holds part of a character: its text is U+FFFD, its bytes are its own. Token
    // 129 of the fixture's byte-level vocabulary is `Ã`, the byte 0xC3 (the first of `é`'s two).
    let partial = server
        .json(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "Speak."}],
                    "max_tokens": 1, "temperature": 0, "logprobs": true,
                    "logit_bias": {"129": 100}}),
        )
        .await;
    let entry = &partial["choices"][0]["logprobs"]["content"][0];
    assert_eq!(entry["token"], "\u{FFFD}", "{entry}");
    assert_eq!(entry["bytes"], json!([0xC3]), "{entry}");
    server.stop().await;
}

// ─────────────────────────────────────────── 5. errors ───────────────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_get_openai_errors_naming_the_parameter() {
    let server = start(Setup::default()).await;
    let raw = |path: &'static str, body: &'static str| {
        server
            .post(path)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let completion = |extra: Value| {
        let mut body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        server.post("/v1/completions").json(&body).send()
    };
    let bad = StatusCode::BAD_REQUEST;

    let e = expect_error(raw("/v1/completions", r#"{"model": "#).await.unwrap(), bad).await;
    assert_eq!(e["type"], "invalid_request_error");
    assert!(e["message"].as_str().unwrap().contains("JSON"), "{e}");

    let e = expect_error(completion(json!({"max_token": 3})).await.unwrap(), bad).await;
    assert_eq!(e["param"], "max_token");
    let e = expect_error(
        server
            .post("/v1/chat/completions")
            .json(
                &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "temprature": 1}),
            )
            .send()
            .await
            .unwrap(),
        bad,
    )
    .await;
    assert_eq!(e["param"], "temprature");

    // An unknown model is 404, as OpenAI and vLLM answer.
    let e = expect_error(
        completion(json!({"model": "gpt-4"})).await.unwrap(),
        StatusCode::NOT_FOUND,
    )
    .await;
    assert_eq!(e["code"], "model_not_found");
    assert_eq!(e["param"], "model");

    for (field, value) in [
        ("temperature", json!(-1)),
        ("top_p", json!(0)),
        ("n", json!(0)),
        ("n", json!(17)),
        ("logprobs", json!(21)),
        ("max_tokens", json!(0)),
        ("stop", json!(["a", "b", "c", "d", "e"])),
        ("logit_bias", json!({"5": 101})),
        ("suffix", json!("x")),
        ("stream_options", json!({"include_usage": true})),
        ("stop_token_ids", json!([4096])),
    ] {
        let response = completion(json!({ field: value })).await.unwrap();
        let e = expect_error(response, bad).await;
        assert_eq!(e["param"], field, "{field} = {value}: {e}");
    }

    // Prompt + max_tokens over the context of 512.
    let e = expect_error(completion(json!({"max_tokens": 510})).await.unwrap(), bad).await;
    assert_eq!(e["param"], "max_tokens");
    assert!(e["message"].as_str().unwrap().contains("512"), "{e}");
    let long = "ROMEO. ".repeat(400);
    assert!(count_tokens(&long) > 512);
    expect_error(completion(json!({"prompt": long})).await.unwrap(), bad).await;
    let e = expect_error(completion(json!({"prompt": [5000]})).await.unwrap(), bad).await;
    assert_eq!(e["param"], "prompt");
    expect_error(completion(json!({"prompt": []})).await.unwrap(), bad).await;

    // Chat-only checks.
    let chat = |body: Value| server.post("/v1/chat/completions").json(&body).send();
    let e = expect_error(
        chat(json!({"model": MODEL, "messages": []})).await.unwrap(),
        bad,
    )
    .await;
    assert_eq!(e["param"], "messages");
    let e = expect_error(
        chat(
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                    "top_logprobs": 2}),
        )
        .await
        .unwrap(),
        bad,
    )
    .await;
    assert_eq!(e["param"], "top_logprobs");
    let e = expect_error(
        chat(
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                    "logprobs": true, "top_logprobs": 21}),
        )
        .await
        .unwrap(),
        bad,
    )
    .await;
    assert_eq!(e["param"], "top_logprobs");
    let e = expect_error(
        chat(json!({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}))
            .await
            .unwrap(),
        bad,
    )
    .await;
    assert_eq!(e["param"], "messages");

    // Wrong types.
    for (field, value) in [
        ("max_tokens", json!("ten")),
        ("temperature", json!("hot")),
        ("n", json!(1.5)),
        ("stream", json!("yes")),
        ("prompt", json!(3)),
        ("stop", json!(5)),
    ] {
        let response = completion(json!({ field: value })).await.unwrap();
        expect_error(response, bad).await;
    }
    // Nothing was admitted or left running.
    let text = server.metrics().await;
    assert_eq!(metric(&text, "kiln:prompt_tokens_total", ""), 0.0);
    assert_eq!(server.state.in_flight.load(Ordering::SeqCst), 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_the_api_but_not_health_or_metrics() {
    let server = start(Setup {
        keys: vec!["sk-test".into()],
        ..Setup::default()
    })
    .await;
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 2});
    let unauthorized = StatusCode::UNAUTHORIZED;
    for key in [
        None,
        Some("Bearer sk-wrong"),
        Some("sk-test"),
        Some("Basic sk-test"),
    ] {
        let mut request = server.post("/v1/completions").json(&body);
        if let Some(key) = key {
            request = request.header("authorization", key);
        }
        let e = expect_error(request.send().await.unwrap(), unauthorized).await;
        assert_eq!(e["type"], "authentication_error", "{key:?}");
        assert_eq!(e["code"], "invalid_api_key");
    }
    let chat = server
        .post("/v1/chat/completions")
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    expect_error(chat, unauthorized).await;
    expect_error(server.get("/v1/models").send().await.unwrap(), unauthorized).await;

    let ok = server
        .post("/v1/completions")
        .bearer_auth("sk-test")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    let models: Value = server
        .get("/v1/models")
        .bearer_auth("sk-test")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["max_model_len"], 512);

    assert_eq!(
        server.get("/health").send().await.unwrap().status(),
        StatusCode::OK
    );
    let metrics = server.get("/metrics").send().await.unwrap();
    assert_eq!(metrics.status(), StatusCode::OK);
    let kind = metrics.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(kind.starts_with("text/plain"), "{kind}");
    let text = metrics.text().await.unwrap();
    assert!(text.contains(&format!("model_name=\"{MODEL}\"")), "{text}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_refuses_the_third_request_with_retry_after() {
    let mut setup = Setup::default();
    setup.config.rate_limit = Some(RateLimit {
        requests_per_minute: Some(2),
        tokens_per_minute: None,
    });
    let server = start(setup).await;
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 1});
    // A refused (invalid) request is not charged.
    let invalid = server
        .post("/v1/completions")
        .json(&json!({"model": MODEL, "prompt": PROMPT, "n": 0}))
        .send()
        .await
        .unwrap();
    expect_error(invalid, StatusCode::BAD_REQUEST).await;
    for _ in 0..2 {
        server.json("/v1/completions", &body).await;
    }
    let response = server
        .post("/v1/completions")
        .json(&body)
        .send()
        .await
        .unwrap();
    let retry_after: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "Retry-After {retry_after}");
    let e = expect_error(response, StatusCode::TOO_MANY_REQUESTS).await;
    assert_eq!(e["type"], "rate_limit_error");
    assert_eq!(e["code"], "rate_limit_exceeded");
    // Chat shares the key's bucket.
    let chat = server
        .post("/v1/chat/completions")
        .json(
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                      "max_tokens": 1}),
        )
        .send()
        .await
        .unwrap();
    expect_error(chat, StatusCode::TOO_MANY_REQUESTS).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_whole_token_limit_gets_429_without_retry_after() {
    let mut setup = Setup::default();
    setup.config.rate_limit = Some(RateLimit {
        requests_per_minute: None,
        tokens_per_minute: Some(50),
    });
    let server = start(setup).await;
    let response = server
        .post("/v1/completions")
        .json(&json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 60}))
        .send()
        .await
        .unwrap();
    assert!(
        response.headers().get("retry-after").is_none(),
        "waiting cannot help"
    );
    let e = expect_error(response, StatusCode::TOO_MANY_REQUESTS).await;
    assert!(e["message"].as_str().unwrap().contains("too large"), "{e}");
    // A request that fits is served.
    server
        .json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}),
        )
        .await;
    server.stop().await;
}

/// A chat request without `max_tokens` may use the rest of the context, for each of its
/// choices: 16 × ~490 tokens, more than a minute's 1,000. It is served, each choice held to
/// its share of the minute's tokens, and charged exactly that: the same request at once
/// must wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_max_tokens_is_held_to_the_token_limit_not_refused() {
    let mut setup = Setup::default();
    setup.config.rate_limit = Some(RateLimit {
        requests_per_minute: None,
        tokens_per_minute: Some(1000),
    });
    let server = start(setup).await;
    let body = json!({"model": MODEL, "n": 16, "temperature": 1.0, "seed": 3,
                      "messages": [{"role": "user", "content": "Speak."}]});
    let r = server.json("/v1/chat/completions", &body).await;
    let prompt = r["usage"]["prompt_tokens"].as_u64().unwrap();
    let completion = r["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(prompt + completion <= 1000, "{}", r["usage"]);
    let share = (1000 - prompt) / 16;
    for choice in r["choices"].as_array().unwrap() {
        let reason = choice["finish_reason"].as_str().unwrap();
        assert!(["stop", "length"].contains(&reason), "{choice}");
    }
    assert!(completion <= 16 * share, "{completion} > 16 × {share}");
    let again = server
        .post("/v1/chat/completions")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(
        again.headers().get("retry-after").is_some(),
        "waiting helps"
    );
    expect_error(again, StatusCode::TOO_MANY_REQUESTS).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_refuses_with_429_and_frees_its_place_after() {
    let mut setup = Setup::default();
    setup.config.engine.max_num_seqs = 1;
    setup.config.max_queue = Some(0);
    let server = start(setup).await;
    let long = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": true,
                      "stream": true});
    let response = server
        .post("/v1/completions")
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut events = Events::new(response);
    events.next().await.expect("a first chunk");

    let short = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 1});
    let refused = server
        .post("/v1/completions")
        .json(&short)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.headers()["retry-after"], "1");
    let e = expect_error(refused, StatusCode::TOO_MANY_REQUESTS).await;
    assert!(e["message"].as_str().unwrap().contains("queue"), "{e}");
    assert_eq!(server.state.in_flight.load(Ordering::SeqCst), 1);

    // Once the stream is gone, its place is given back.
    drop(events);
    let deadline = Instant::now() + WAIT;
    loop {
        let response = server
            .post("/v1/completions")
            .json(&short)
            .send()
            .await
            .unwrap();
        if response.status() == StatusCode::OK {
            break;
        }
        expect_error(response, StatusCode::TOO_MANY_REQUESTS).await;
        assert!(Instant::now() < deadline, "the place was never given back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.wait_idle().await;
    assert_eq!(server.state.in_flight.load(Ordering::SeqCst), 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_and_unknown_paths_never_crash_the_server() {
    let mut setup = Setup::default();
    setup.config.max_body_bytes = 16 * 1024;
    let server = start(setup).await;
    let send = |path: &'static str, body: Vec<u8>| {
        server
            .post(path)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    // 413 over the body limit.
    let big = format!(
        r#"{{"model": "{MODEL}", "prompt": "{}", "max_tokens": 1}}"#,
        "a".repeat(32 * 1024)
    );
    let response = send("/v1/completions", big.into_bytes()).await.unwrap();
    // The unread rest of the body makes the connection unusable: the client must not reuse it.
    assert_eq!(
        response.headers().get("connection").map(|v| v.as_bytes()),
        Some(&b"close"[..])
    );
    let e = expect_error(response, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert!(e["message"].as_str().unwrap().contains("too large"), "{e}");

    // 404 in JSON.
    let e = expect_error(
        server.get("/v1/nothing").send().await.unwrap(),
        StatusCode::NOT_FOUND,
    )
    .await;
    assert!(
        e["message"].as_str().unwrap().contains("/v1/nothing"),
        "{e}"
    );

    // 405 in JSON: a known path with the wrong method.
    let e = expect_error(
        server.get("/v1/completions").send().await.unwrap(),
        StatusCode::METHOD_NOT_ALLOWED,
    )
    .await;
    assert!(e["message"].as_str().unwrap().contains("GET"), "{e}");

    // Garbage of every kind: 400 each, and the server keeps answering.
    let mut random = Vec::with_capacity(4096);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for _ in 0..4096 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        random.push(x as u8);
    }
    let nested_top = "[".repeat(5000).into_bytes();
    let nested_prompt = format!(
        r#"{{"model": "{MODEL}", "prompt": {}"x"{}}}"#,
        "[".repeat(3000),
        "]".repeat(3000)
    )
    .into_bytes();
    let mut bad_utf8 = br#"{"model": ""#.to_vec();
    bad_utf8.extend_from_slice(&[0xff, 0xfe, 0xc3]);
    bad_utf8.extend_from_slice(br#"", "prompt": "x"}"#);
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("random bytes", random),
        ("empty", Vec::new()),
        ("nested top", nested_top),
        ("nested prompt", nested_prompt),
        ("invalid UTF-8", bad_utf8),
        ("null", b"null".to_vec()),
        (
            "huge max_tokens",
            format!(r#"{{"model": "{MODEL}", "prompt": "x", "max_tokens": 1e400}}"#).into_bytes(),
        ),
        (
            "u32 overflow",
            format!(r#"{{"model": "{MODEL}", "prompt": "x", "max_tokens": 4294967296}}"#)
                .into_bytes(),
        ),
        (
            "max u32",
            format!(r#"{{"model": "{MODEL}", "prompt": "x", "max_tokens": 4294967295}}"#)
                .into_bytes(),
        ),
        (
            "huge n",
            format!(r#"{{"model": "{MODEL}", "prompt": "x", "n": 18446744073709551616}}"#)
                .into_bytes(),
        ),
        (
            "huge seed",
            format!(r#"{{"model": "{MODEL}", "prompt": "x", "seed": 1e30}}"#).into_bytes(),
        ),
        (
            "f32 overflow",
            format!(r#"{{"model": "{MODEL}", "prompt": "x", "temperature": 1e39}}"#).into_bytes(),
        ),
        (
            "huge token id",
            format!(r#"{{"model": "{MODEL}", "prompt": [4294967295]}}"#).into_bytes(),
        ),
        (
            "negative token id",
            format!(r#"{{"model": "{MODEL}", "prompt": [-1]}}"#).into_bytes(),
        ),
    ];
    for (what, body) in bodies {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let response = send(path, body.clone()).await.unwrap();
            assert_eq!(
                response.status(),
                StatusCode::BAD_REQUEST,
                "{what} to {path}"
            );
            expect_error(response, StatusCode::BAD_REQUEST).await;
        }
    }

    // Not even HTTP.
    let addr = server.url.trim_start_matches("http://").to_string();
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut socket = std::net::TcpStream::connect(addr).unwrap();
        socket.set_read_timeout(Some(WAIT)).unwrap();
        socket.write_all(b"\x00\x01GARBAGE \xff\r\n\r\n").unwrap();
        let mut reply = Vec::new();
        // Closed after a 400, or closed without a word: never a hang or a 2xx/5xx.
        socket
            .read_to_end(&mut reply)
            .expect("the server closes the connection");
        assert!(
            reply.is_empty() || reply.starts_with(b"HTTP/1.1 400"),
            "{}",
            String::from_utf8_lossy(&reply)
        );
    })
    .await
    .unwrap();

    let health = server.get("/health").send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    // And it still generates.
    let ok = server
        .json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
    assert_eq!(ok["usage"]["completion_tokens"], 2);
    server.stop().await;
}

// ──────────────────────────────────────── 6. disconnects ────────────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_frees_everything() {
    // Prefix caching off: a free pool reads 0. Room for 16 choices of 512 positions.
    let server = start(Setup {
        kv_blocks: 600,
        ..Setup::default()
    })
    .await;
    let max_tokens = 480;
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                      "ignore_eos": true, "stream": true});
    let mut events = server.open_stream("/v1/completions", &body).await;
    for _ in 0..2 {
        events.next().await.expect("a chunk");
    }
    drop(events); // closes the connection

    let text = server.wait_idle().await;
    assert_eq!(
        finished(&text, "length"),
        0.0,
        "an abandoned request did not finish"
    );
    assert_eq!(finished(&text, "stop"), 0.0);
    let generated = metric(&text, "kiln:generation_tokens_total", "");
    assert!(
        generated >= 2.0 && generated < max_tokens as f64,
        "the engine stopped early: {generated} tokens"
    );
    let deadline = Instant::now() + WAIT;
    while server.state.in_flight.load(Ordering::SeqCst) != 0 {
        assert!(
            Instant::now() < deadline,
            "the request's place was never given back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The same for a non-streaming request whose client gives up: 16 × 480 tokens take far
    // longer than the client waits.
    let whole = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                       "ignore_eos": true, "n": 16});
    let request = server.post("/v1/completions").json(&whole).send();
    let gave_up = tokio::time::timeout(Duration::from_millis(200), request).await;
    assert!(gave_up.is_err(), "16 × 480 tokens in under 200 ms?");
    let text = server.wait_idle().await;
    assert_eq!(finished(&text, "length"), 0.0);
    let more = metric(&text, "kiln:generation_tokens_total", "") - generated;
    assert!(more < (16 * max_tokens) as f64, "{more} tokens");
    server.stop().await;
}

// ──────────────────────────────────────── 7. many clients ────────────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_streams_all_finish_and_the_counters_add_up() {
    let mut setup = Setup::default();
    setup.config.engine.max_num_seqs = 16;
    // 36 blocks: one request of 512 fits (35 above the watermark), 16 of ~50 tokens do not.
    setup.kv_blocks = 36;
    let server = Arc::new(start(setup).await);
    let prompts = [
        "ROMEO.",
        PROMPT,
        "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?",
        "HAMLET.\nTo be, or not to be",
        "KING.\nNow is the winter of our discontent made glorious summer",
        "First Citizen.\nBefore we proceed any further, hear me speak.",
    ];
    let mut tasks = tokio::task::JoinSet::new();
    let mut expected = BTreeMap::new();
    for i in 0..64usize {
        let max_tokens = 1 + (i * 17) % 40;
        let prompt = prompts[i % prompts.len()];
        expected.insert(i, (max_tokens, count_tokens(prompt) + 1));
        let server = Arc::clone(&server);
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                          "ignore_eos": true, "temperature": 0.7, "seed": i,
                          "stream": true, "stream_options": {"include_usage": true}});
        tasks.spawn(async move { (i, server.stream("/v1/completions", &body).await) });
    }
    let mut prompt_sum = 0;
    let mut completion_sum = 0;
    let mut done = 0;
    let all = async {
        while let Some(result) = tasks.join_next().await {
            let (i, events) = result.expect("a client task panicked");
            let (max_tokens, prompt_tokens) = expected[&i];
            let (chunks, last) = split_usage(&events);
            assert_eq!(last["usage"]["completion_tokens"], max_tokens, "client {i}");
            assert_eq!(last["usage"]["prompt_tokens"], prompt_tokens, "client {i}");
            assert_eq!(chunks.len(), max_tokens, "client {i}: one chunk per token");
            assert_eq!(
                chunks.last().unwrap()["choices"][0]["finish_reason"],
                "length",
                "client {i}"
            );
            prompt_sum += prompt_tokens;
            completion_sum += max_tokens;
            done += 1;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("64 clients finish");
    assert_eq!(done, 64);

    let text = server.wait_idle().await;
    assert_eq!(metric(&text, "kiln:num_requests_swapped", ""), 0.0);
    // The engine counts each sampled token once, and each prompt once when it is added: a
    // request preempted by recomputation reruns its prefill without counting it again.
    assert_eq!(
        metric(&text, "kiln:generation_tokens_total", ""),
        completion_sum as f64
    );
    assert_eq!(
        metric(&text, "kiln:prompt_tokens_total", ""),
        prompt_sum as f64
    );
    assert_eq!(
        metric(&text, "kiln:time_to_first_token_seconds_count", ""),
        64.0
    );
    assert_eq!(
        metric(&text, "kiln:e2e_request_latency_seconds_count", ""),
        64.0
    );
    assert_eq!(
        metric(&text, "kiln:inter_token_latency_seconds_count", ""),
        (completion_sum - 64) as f64
    );
    assert_eq!(finished(&text, "length"), 64.0);
    eprintln!(
        "64 clients: {completion_sum} tokens, {} preemptions",
        metric(&text, "kiln:num_preemptions_total", "")
    );
    assert_eq!(server.state.in_flight.load(Ordering::SeqCst), 0);
    let server = Arc::into_inner(server).expect("every client task is done");
    server.stop().await;
}

// ──────────────────────────────────────── 8. graceful shutdown ────────────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_refuses_new_work_and_aborts_streams_after_the_grace() {
    let mut setup = Setup::default();
    setup.config.shutdown_grace = Duration::from_millis(100);
    setup.kv_blocks = 600;
    let mut server = start(setup).await;
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": true,
                      "n": 16, "stream": true});
    let mut events = server.open_stream("/v1/completions", &body).await;
    events.next().await.expect("a chunk");

    let _ = server.shutdown.take().unwrap().send(());
    // New work is refused at once: the listener is closed, or /health says 503.
    let deadline = Instant::now() + WAIT;
    loop {
        match server.get("/health").send().await {
            Err(_) => break,
            Ok(r) if r.status() == StatusCode::SERVICE_UNAVAILABLE => break,
            Ok(r) => assert_eq!(r.status(), StatusCode::OK),
        }
        assert!(Instant::now() < deadline, "still healthy after shutdown");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The stream in flight ends with "abort" for every choice (16 × 480 tokens take far longer
    // than the grace), then [DONE].
    let mut reasons = BTreeMap::new();
    loop {
        let data = tokio::time::timeout(WAIT, events.next())
            .await
            .expect("the stream ends")
            .expect("[DONE] before the end");
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap();
        let choice = &chunk["choices"][0];
        if let Some(reason) = choice["finish_reason"].as_str() {
            let index = choice["index"].as_u64().unwrap();
            assert!(
                reasons.insert(index, reason.to_string()).is_none(),
                "{chunk}"
            );
        }
    }
    assert_eq!(reasons.len(), 16, "{reasons:?}");
    assert!(reasons.values().all(|r| r == "abort"), "{reasons:?}");
    let result = tokio::time::timeout(WAIT, &mut server.task)
        .await
        .expect("run returns after the grace")
        .unwrap();
    result.expect("run returns Ok");
    assert_eq!(
        server.state.metrics.engine().running,
        0,
        "the engine was stopped with nothing running"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_is_off_by_default_and_answers_allowed_origins_only() {
    let origin = "http://localhost:3000";
    let off = start(Setup::default()).await;
    let response = off
        .get("/v1/models")
        .header("Origin", origin)
        .send()
        .await
        .unwrap();
    assert!(
        response
            .headers()
            .get("access-control-allow-origin")
            .is_none()
    );
    off.stop().await;

    let mut setup = Setup {
        keys: vec!["k".into()],
        ..Setup::default()
    };
    setup.config.allowed_origins = vec![origin.into()];
    let server = start(setup).await;
    // A preflight needs no key, and names what the browser may send.
    let preflight = server.post("/v1/chat/completions").build().unwrap();
    let url = preflight.url().clone();
    let response = reqwest::Client::new()
        .request(reqwest::Method::OPTIONS, url)
        .header("Origin", origin)
        .header("Access-Control-Request-Method", "POST")
        .header(
            "Access-Control-Request-Headers",
            "authorization, content-type",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    let headers = response.headers();
    assert_eq!(headers["access-control-allow-origin"], origin);
    assert!(
        headers["access-control-allow-headers"]
            .to_str()
            .unwrap()
            .contains("authorization")
    );
    // An answer to the allowed origin is marked; one to another origin is not.
    let response = server
        .get("/v1/models")
        .header("Origin", origin)
        .bearer_auth("k")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["access-control-allow-origin"], origin);
    let response = server
        .get("/v1/models")
        .header("Origin", "http://evil.example")
        .bearer_auth("k")
        .send()
        .await
        .unwrap();
    assert!(
        response
            .headers()
            .get("access-control-allow-origin")
            .is_none()
    );
    server.stop().await;
}
