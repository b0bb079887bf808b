//! `kiln serve` renders its chat template in worker processes (`kiln chat-template-worker`,
//! ch08's `chat_template/isolated.rs`): the two templates that crash whatever renders them (the
//! module doc of ch08's `chat_template.rs`) fail one render, and the next render gets a fresh
//! worker. Without the worker these tests abort their own process.
//!
//! Linux only: elsewhere the worker has no address-space limit, and the lazy list would take
//! gigabytes before it fails.
#![cfg(target_os = "linux")]

mod common;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::Instant;

use ch08::chat_template::{ChatMessage, ChatTemplate, TemplateError};

/// SmolLM2-Instruct's template, as in its tokenizer_config.json.
const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A namespace that contains itself, printed: minijinja recurses until the stack overflows.
const SELF_CONTAINING: &str = "{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns }}";
/// A lazy list of a million megabyte strings made one string: the allocation fails.
const HUGE_LAZY_LIST: &str = "{{ (['x' * 1000000] * 1000000) ~ '' }}";

/// `crash` when the first message says "boom", SmolLM2's template otherwise.
fn booby_trapped(crash: &str) -> String {
    format!("{{% if messages[0].content == 'boom' %}}{crash}{{% else %}}{SMOLLM2}{{% endif %}}")
}

fn compiled(source: &str) -> ChatTemplate {
    ChatTemplate::from_source(source, Some("<s>".into()), Some("</s>".into())).unwrap()
}

fn isolated(source: &str) -> ChatTemplate {
    compiled(source).isolated(
        PathBuf::from(env!("CARGO_BIN_EXE_kiln")),
        vec!["chat-template-worker".into()],
    )
}

fn conversation(list: &[(&str, &str)]) -> Vec<ChatMessage> {
    list.iter().map(|(r, c)| ChatMessage::new(r, c)).collect()
}

/// Both ways, the same prompt or the same error message.
fn same_both_ways(source: &str, messages: &[ChatMessage], extra: &[(String, serde_json::Value)]) {
    let outcome = |template: ChatTemplate| {
        template
            .render_with(messages, true, extra)
            .map_err(|e| e.to_string())
    };
    let here = outcome(compiled(source));
    let there = outcome(isolated(source));
    assert_eq!(there, here, "{source}");
}

#[test]
fn an_isolated_template_renders_what_it_renders_in_process() {
    let hello = conversation(&[("user", "Hi!"), ("assistant", "Hello."), ("user", "Why?")]);
    same_both_ways(SMOLLM2, &hello, &[]);
    let tools = [(
        "tools".into(),
        serde_json::json!([{"name": "f", "é": [1, 2.5, null]}]),
    )];
    same_both_ways(
        "{{ bos_token }}{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}\
         {{ eos_token }}",
        &hello,
        &tools,
    );
    // The template's own errors, as they were.
    same_both_ways(
        "{{ raise_exception('no ' ~ messages[0].content) }}",
        &hello,
        &[],
    );
    same_both_ways("{% for i in range(100000000) %}{% endfor %}", &hello, &[]);
    // Bounded renders still work under the worker's address-space limit: a list nested as
    // deep as the fuel allows, printed on the render's 1 GiB stack (some 250 MiB of it), and
    // megabyte strings kept until the fuel runs out (some hundreds of megabytes).
    let deep = "{% set ns = namespace(d=[]) %}{% for i in range(500) %}{% for j in range(1000) %}\
                {% set ns.d = [ns.d] %}{% endfor %}{% endfor %}{{ (ns.d ~ '') | length }}";
    assert_eq!(isolated(deep).render(&hello, true).unwrap(), "1000002");
    let kept = "{% set ns = namespace(s='x', l=[]) %}{% for i in range(20) %}\
                {% set ns.s = ns.s ~ ns.s %}{% endfor %}{% for i in range(400) %}\
                {% set ns.l = ns.l + [ns.s ~ i] %}{% endfor %}{{ ns.l | length }}";
    same_both_ways(kept, &hello, &[]);
    // A message as large as the server's default body limit (8 MiB).
    same_both_ways(
        SMOLLM2,
        &conversation(&[("user", &"x".repeat(8 << 20))]),
        &[],
    );
}

#[test]
fn a_template_that_crashes_fails_its_render_and_the_next_gets_a_fresh_worker() {
    let hello = conversation(&[("user", "Hi!")]);
    let boom = conversation(&[("user", "boom")]);
    let expected = compiled(SMOLLM2).render(&hello, true).unwrap();
    for (crash, said) in [
        (SELF_CONTAINING, "overflowed its stack"),
        (HUGE_LAZY_LIST, "memory allocation"),
    ] {
        let template = isolated(&booby_trapped(crash));
        assert_eq!(template.render(&hello, true).unwrap(), expected);
        let start = Instant::now();
        let err = template.render(&boom, true).unwrap_err();
        let TemplateError::Crashed { status } = &err else {
            panic!("{crash}: {err:?}");
        };
        assert!(status.contains(said), "{crash}: {status}");
        assert!(status.contains("SIGABRT"), "{crash}: {status}");
        eprintln!("{crash}: {err} ({:.2?})", start.elapsed());
        // The next render starts a fresh worker, which renders, and waits for the next.
        assert_eq!(template.render(&hello, true).unwrap(), expected);
        let without_prompt = compiled(SMOLLM2).render(&hello, false).unwrap();
        assert_eq!(template.render(&hello, false).unwrap(), without_prompt);
    }
}

/// Renders at once share the pool without mixing their prompts.
#[test]
fn renders_at_the_same_time_each_get_their_own_prompt() {
    let template = isolated(&booby_trapped(SELF_CONTAINING));
    let reference = compiled(SMOLLM2);
    std::thread::scope(|scope| {
        for t in 0..3 {
            let (template, reference) = (&template, &reference);
            scope.spawn(move || {
                for i in 0..5 {
                    let text = format!("thread {t} message {i}");
                    let messages = conversation(&[("user", &text)]);
                    let expected = reference.render(&messages, true).unwrap();
                    assert_eq!(template.render(&messages, true).unwrap(), expected);
                    if t == 0 && i == 2 {
                        let boom = conversation(&[("user", "boom")]);
                        assert!(template.render(&boom, true).is_err());
                    }
                }
            });
        }
    });
}

/// Through `kiln serve`: a model folder whose chat_template.jinja crashes on "boom" answers
/// that request with a 400 that says so, and goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kiln_serve_answers_a_crashing_template_with_400_and_goes_on() {
    let model = tempfile::tempdir().unwrap();
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/shakespeare-tiny");
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.path().join(entry.file_name())).unwrap();
    }
    std::fs::write(
        model.path().join("chat_template.jinja"),
        booby_trapped(SELF_CONTAINING),
    )
    .unwrap();
    let (mut server, client, url) =
        common::serve([OsStr::new("--model"), model.path().as_os_str()]).await;

    let chat = |content: &str| {
        client
            .post(format!("{url}/v1/chat/completions"))
            .json(&serde_json::json!({
                "model": "bard", "max_tokens": 2,
                "messages": [{"role": "user", "content": content}],
            }))
            .send()
    };
    for round in 0..2 {
        let response = chat("boom").await.unwrap();
        assert_eq!(
            response.status(),
            reqwest::StatusCode::BAD_REQUEST,
            "{}",
            server.log()
        );
        let body: serde_json::Value = response.json().await.unwrap();
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("chat template: the chat template crashed its render process"),
            "{message}"
        );
        let response = chat("Good morrow.").await.unwrap();
        assert_eq!(
            response.status(),
            reqwest::StatusCode::OK,
            "round {round}:\n{}",
            server.log()
        );
        assert!(server.exited().is_none(), "{}", server.log());
    }
}
