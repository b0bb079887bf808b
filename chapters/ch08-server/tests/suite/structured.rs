//! Structured outputs and tool calls, end to end over HTTP on the test model: every
//! constrained output parses or matches, over many seeds, streamed and not; bad constraints
//! are 400s naming their field.

use crate::support;

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::*;

/// Each choice's text of a completions or chat response, with its finish reason.
fn texts(body: &Value) -> Vec<(String, String)> {
    body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let text = c["text"]
                .as_str()
                .or_else(|| c["message"]["content"].as_str())
                .unwrap_or_default();
            (
                text.to_string(),
                c["finish_reason"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The streamed text of every choice, joined, with its finish reason.
fn streamed_texts(events: &[Value], n: usize) -> Vec<(String, String)> {
    let mut out = vec![(String::new(), String::new()); n];
    for event in events {
        for c in event["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if let Some(t) = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str())
            {
                out[i].0.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                out[i].1 = f.to_string();
            }
        }
    }
    out
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 12},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "object",
               "properties": {"mood": {"enum": ["happy", "sad", "angry"]},
                              "ok": {"type": "boolean"}},
               "required": ["mood", "ok"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
               "minItems": 1, "maxItems": 4}),
    ]
}

/// The checks a schema's output must pass (kiln has no JSON schema validator: the test
/// checks each schema's own rules).
fn check_schema(which: usize, value: &Value) {
    match which {
        0 => {
            let o = value.as_object().expect("an object");
            assert_eq!(o.len(), 2, "{value}");
            assert!(o["name"].as_str().unwrap().chars().count() <= 12, "{value}");
            assert!((0..=150).contains(&o["age"].as_i64().unwrap()), "{value}");
        }
        1 => {
            let o = value.as_object().expect("an object");
            assert!(["happy", "sad", "angry"].contains(&o["mood"].as_str().unwrap()));
            assert!(o["ok"].is_boolean());
        }
        _ => {
            let a = value.as_array().expect("an array");
            assert!((1..=4).contains(&a.len()), "{value}");
            assert!(a.iter().all(|x| (1..=9).contains(&x.as_i64().unwrap())));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schemas_always_parse_over_many_seeds_streamed_and_not() {
    let server = start(Setup::default()).await;
    for (which, schema) in schemas().into_iter().enumerate() {
        for seed in [1, 2] {
            // n = 8 at temperature 1: sixteen sampled outputs per schema, batched together.
            let completions = json!({
                "model": MODEL, "prompt": PROMPT, "max_tokens": 60, "n": 8,
                "temperature": 1.0, "seed": seed, "guided_json": schema,
            });
            let chat = json!({
                "model": MODEL, "messages": [{"role": "user", "content": "Who art thou?"}],
                "max_tokens": 60, "n": 8, "temperature": 1.0, "seed": seed + 10,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "x", "schema": schema}},
            });
            for (path, body) in [
                ("/v1/completions", completions),
                ("/v1/chat/completions", chat),
            ] {
                let whole = texts(&server.json(path, &body).await);
                let events = server.stream(path, &streamed(&body)).await;
                let stream = streamed_texts(&events, 8);
                assert_eq!(whole, stream, "streamed and whole agree ({path})");
                for (text, finish) in whole {
                    assert_eq!(finish, "stop", "{path} {text:?}");
                    let value: Value = serde_json::from_str(&text)
                        .unwrap_or_else(|e| panic!("{path}: {text:?} does not parse: {e}"));
                    check_schema(which, &value);
                }
            }
        }
    }
    server.wait_idle().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regexes_choices_grammars_and_json_objects_match() {
    let server = start(Setup::default()).await;
    let complete = |extra: Value| {
        let mut body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "n": 6,
                              "temperature": 1.0, "seed": 3});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    // Every one of the 6 choices, so that a short or empty list cannot pass the checks.
    let texts = |body: &Value| {
        let texts = texts(body);
        assert_eq!(texts.len(), 6, "{body}");
        texts
    };
    // A date, a word of capitals, a bounded number.
    for (regex, check) in [
        (
            r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
            (|t: &str| t.len() == 10 && t.as_bytes()[4] == b'-' && t.as_bytes()[7] == b'-')
                as fn(&str) -> bool,
        ),
        (r"[A-Z][a-z]{1,8}", |t: &str| {
            (2..=9).contains(&t.len()) && t.as_bytes()[0].is_ascii_uppercase()
        }),
        (r"(yes|no), [0-9]{1,3}", |t: &str| {
            (t.starts_with("yes, ") || t.starts_with("no, "))
                && t.rsplit(' ').next().unwrap().parse::<u32>().is_ok()
        }),
    ] {
        for seed in 0..3 {
            let mut body = complete(json!({"guided_regex": regex}));
            body["seed"] = json!(seed);
            for (text, finish) in texts(&server.json("/v1/completions", &body).await) {
                assert!(check(&text), "{regex}: {text:?}");
                assert_eq!(finish, "stop");
            }
        }
    }
    let choices = ["Romeo", "Juliet", "Mercutio"];
    for body in [
        complete(json!({"guided_choice": choices})),
        complete(json!({"structured_outputs": {"choice": choices}})),
    ] {
        for (text, _) in texts(&server.json("/v1/completions", &body).await) {
            assert!(choices.contains(&text.as_str()), "{text:?}");
        }
    }
    let lark = r#"start: "Act " DIGIT " scene " DIGIT
DIGIT: /[1-5]/"#;
    for (text, _) in texts(
        &server
            .json(
                "/v1/completions",
                &complete(json!({"guided_grammar": lark})),
            )
            .await,
    ) {
        let b = text.as_bytes();
        assert!(
            text.len() == 13 && text.starts_with("Act ") && b[12].is_ascii_digit(),
            "{text:?}"
        );
    }
    // Any JSON object: the output parses whenever it ends by itself (this model, free to add
    // keys, rarely closes one within max_tokens: a cut output is still an object's start).
    let body = complete(json!({"response_format": {"type": "json_object"}, "max_tokens": 60}));
    for (text, finish) in texts(&server.json("/v1/completions", &body).await) {
        if finish == "stop" {
            let value: Value = serde_json::from_str(&text).expect(&text);
            assert!(value.is_object());
        } else {
            assert!(text.starts_with('{'), "{text:?}");
        }
    }
    server.wait_idle().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_constraints_and_parameters_are_400s_naming_their_field() {
    let server = start(Setup::default()).await;
    let post = |extra: Value| {
        let mut body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 4});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        server.post("/v1/completions").json(&body).send()
    };
    for (extra, param) in [
        (json!({"guided_regex": "(unclosed"}), "guided_regex"),
        (
            json!({"guided_grammar": "start: nowhere"}),
            "guided_grammar",
        ),
        (json!({"guided_json": "{not json"}), "guided_json"),
        (
            json!({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}),
            "guided_json",
        ),
        (json!({"guided_regex": "a".repeat(70_000)}), "guided_regex"),
        (json!({"guided_choice": []}), "guided_choice"),
        // 5 prompts × n = 16, and 2 × 9: more constrained choices than one request may run.
        (
            json!({"guided_regex": "a", "n": 16, "prompt": vec![PROMPT; 5]}),
            "n",
        ),
        (
            json!({"guided_regex": "a", "n": 9, "prompt": vec![PROMPT; 2]}),
            "n",
        ),
        (
            json!({"guided_regex": "a", "guided_choice": ["a"]}),
            "guided_choice",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format",
        ),
        (
            json!({"structured_outputs": {"regex": "("}}),
            "structured_outputs",
        ),
        (json!({"tools": []}), "tools"),
        (json!({"logit_bias": {"99999": 5}}), "logit_bias"),
        (json!({"logit_bias": {"5": 500}}), "logit_bias"),
        (json!({"allowed_token_ids": [99999]}), "allowed_token_ids"),
        // Sizes one request could blow up: every choice holds its own copy of these.
        (json!({"stop": ["a".repeat(1025)]}), "stop"),
        (json!({"stop_token_ids": vec![5; 1025]}), "stop_token_ids"),
        (json!({"bad_words": ["a".repeat(1025)]}), "bad_words"),
        (
            json!({"bad_words": vec!["a".repeat(1024); 65]}),
            "bad_words",
        ),
        (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
        (json!({"best_of": 2}), "best_of"),
        (json!({"skip_special_tokens": false}), "skip_special_tokens"),
        (
            json!({"include_stop_str_in_output": true, "stop": ["x"]}),
            "include_stop_str_in_output",
        ),
        (
            json!({"guided_decoding_backend": "xgrammar"}),
            "guided_decoding_backend",
        ),
    ] {
        let err = expect_error(post(extra.clone()).await.unwrap(), StatusCode::BAD_REQUEST).await;
        assert_eq!(err["param"], param, "{extra}: {err}");
    }
    // Rules that leave no token of the grammar end the choice early: an error, never an
    // output cut short and reported as a normal stop. (Token 5 is no prefix of "yes" or "no".)
    let tokenizer = &loaded().tokenizer;
    let yes_no = ["yes", "no"].map(|w| tokenizer.encode(w, false).unwrap()[0]);
    assert!(!yes_no.contains(&5), "{yes_no:?}");
    for stream in [false, true] {
        let contradiction = json!({"guided_choice": ["yes", "no"], "allowed_token_ids": [5],
                                   "stream": stream});
        let response = post(contradiction).await.unwrap();
        let text = match stream {
            false => expect_error(response, StatusCode::BAD_REQUEST)
                .await
                .to_string(),
            true => response.text().await.unwrap(),
        };
        assert!(text.contains("leave no token"), "{text}");
    }
    // The server is still fine.
    let ok = post(json!({"guided_choice": ["a", "b"]})).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    server.wait_idle().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cheap_vllm_parameters_are_honoured() {
    let server = start(Setup::default()).await;
    let tokenizer = &loaded().tokenizer;
    let base = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0,
                      "seed": 5, "n": 4, "logprobs": 0});
    let with = |extra: Value| {
        let mut body = base.clone();
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let ids_of = |body: &Value| -> Vec<Vec<u32>> {
        body["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                tokenizer
                    .encode(c["text"].as_str().unwrap(), false)
                    .unwrap()
            })
            .collect()
    };
    // allowed_token_ids: only those tokens come out.
    let allowed: Vec<u32> = tokenizer.encode(" the king and queen", false).unwrap();
    let body = server
        .json(
            "/v1/completions",
            &with(json!({"allowed_token_ids": allowed})),
        )
        .await;
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{body}");
    for choice in choices {
        let tokens = choice["logprobs"]["tokens"].as_array().unwrap();
        assert!(!tokens.is_empty(), "{choice}");
        for token in tokens {
            let id = tokenizer.encode(token.as_str().unwrap(), false).unwrap();
            assert!(id.iter().all(|t| allowed.contains(t)), "{token}");
        }
    }
    // logit_bias: +100 on one token makes it every token.
    let the = tokenizer.encode(" the", false).unwrap()[0];
    let body = server
        .json(
            "/v1/completions",
            &with(json!({"logit_bias": {the.to_string(): 100}})),
        )
        .await;
    let ids = ids_of(&body);
    assert_eq!(ids.len(), 4, "{body}");
    for ids in ids {
        assert!(!ids.is_empty() && ids.iter().all(|&t| t == the), "{ids:?}");
    }
    // bad_words: a word the unconstrained run writes never appears.
    let free = server.json("/v1/completions", &base).await;
    let word = free["choices"][0]["text"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .find(|w| w.chars().all(char::is_alphabetic))
        .unwrap_or("the")
        .to_string();
    let body = server
        .json(
            "/v1/completions",
            &with(json!({"bad_words": [word.clone()]})),
        )
        .await;
    for (text, _) in texts(&body) {
        assert!(
            !text.split(|c: char| !c.is_alphabetic()).any(|w| w == word),
            "{word:?} in {text:?}"
        );
    }
    // min_tokens: no choice stops early. The control: the same greedy run without it stops
    // before 12 tokens, at a stop token that its first greedy token is made into.
    let first = ids_of(
        &server
            .json(
                "/v1/completions",
                &with(json!({"temperature": 0.0, "n": 1, "max_tokens": 1})),
            )
            .await,
    )[0][0];
    let greedy = json!({"temperature": 0.0, "n": 1, "stop_token_ids": [first]});
    let body = server.json("/v1/completions", &with(greedy.clone())).await;
    assert_eq!(body["usage"]["completion_tokens"], 1, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let mut min = greedy;
    min["min_tokens"] = json!(12);
    let body = server.json("/v1/completions", &with(min)).await;
    assert_eq!(body["usage"]["completion_tokens"], 12, "{body}");
    // truncate_prompt_tokens keeps the prompt's last tokens; priority 0 is accepted (another
    // needs --scheduling-policy priority).
    let body = server
        .json(
            "/v1/completions",
            &with(json!({"truncate_prompt_tokens": 3, "priority": 0, "n": 1})),
        )
        .await;
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    server.wait_idle().await;
    server.stop().await;
}

/// A `stop_token_ids` token ends its choice and, as in vLLM, its text is not in the output
/// (it is still counted in the usage and has its logprob); `include_stop_str_in_output`
/// keeps it. `logit_bias` makes " the" every token, `min_tokens` masks it for three first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_token_ids_text_is_left_out_unless_asked_for() {
    let server = start(Setup::default()).await;
    let the = loaded().tokenizer.encode(" the", false).unwrap();
    assert_eq!(the.len(), 1, "{the:?}");
    let the = the[0];
    let body = |extra: Value| {
        let mut body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 10,
                              "temperature": 0.0, "logprobs": 0,
                              "logit_bias": {the.to_string(): 100}, "stop_token_ids": [the]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    for stream in [false, true] {
        let mut cases = vec![
            (json!({}), 1, String::new()),
            (
                json!({"include_stop_str_in_output": true}),
                1,
                " the".to_string(),
            ),
        ];
        // Three other tokens first: their text, without the stop token's.
        let three = server
            .json("/v1/completions", &body(json!({"min_tokens": 3})))
            .await;
        let tokens = three["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap();
        assert_eq!(tokens.len(), 4, "{three}");
        assert_eq!(tokens[3], " the");
        let before: String = tokens[..3].iter().map(|t| t.as_str().unwrap()).collect();
        cases.push((json!({"min_tokens": 3}), 4, before));
        for (extra, count, text) in cases {
            let mut b = body(extra.clone());
            let (got, usage, reason) = if stream {
                let events = server.stream("/v1/completions", &streamed(&b)).await;
                let (chunks, last) = split_usage(&events);
                let text: String = chunks.iter().map(|c| text_of(&c["choices"][0])).collect();
                let reason = chunks.last().unwrap()["choices"][0]["finish_reason"].clone();
                (text, last["usage"].clone(), reason)
            } else {
                b["stream"] = json!(false);
                let r = server.json("/v1/completions", &b).await;
                let lp = &r["choices"][0]["logprobs"]["tokens"];
                assert_eq!(lp.as_array().unwrap().len(), count, "{r}");
                let c = &r["choices"][0];
                (
                    text_of(c).to_string(),
                    r["usage"].clone(),
                    c["finish_reason"].clone(),
                )
            };
            assert_eq!(got, text, "{extra} (stream {stream})");
            assert_eq!(usage["completion_tokens"], count, "{extra}");
            assert_eq!(reason, "stop", "{extra}");
        }
    }
    server.stop().await;
}

fn weather_tool() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 10},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
         "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": false}}}])
}

fn check_call(call: &Value) {
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().is_some_and(|id| !id.is_empty()));
    let name = call["function"]["name"].as_str().unwrap();
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    match name {
        "get_weather" => {
            assert!(arguments["city"].as_str().unwrap().chars().count() <= 10);
            assert!((1..=7).contains(&arguments["days"].as_i64().unwrap()));
        }
        "get_time" => assert!(["UTC", "CET"].contains(&arguments["zone"].as_str().unwrap())),
        other => panic!("unknown tool {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_and_named_tool_calls_always_parse_streamed_too() {
    let server = start(Setup::default()).await;
    let messages = json!([
        {"role": "user", "content": "What is the weather in Verona?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call-0", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Verona\", \"days\": 1}"}}]},
        {"role": "user", "content": "And tomorrow, and the time?", "name": "romeo"},
    ]);
    for (choice, named) in [
        (json!("required"), None),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            Some("get_time"),
        ),
    ] {
        for seed in 0..3 {
            let body = json!({"model": MODEL, "messages": messages, "tools": weather_tool(),
                              "tool_choice": choice, "max_tokens": 100, "n": 4,
                              "parallel_tool_calls": false,
                              "temperature": 1.0, "seed": seed});
            let whole = server.json("/v1/chat/completions", &body).await;
            let mut whole_calls = Vec::new();
            for c in whole["choices"].as_array().unwrap() {
                let calls = c["message"]["tool_calls"]
                    .as_array()
                    .unwrap_or_else(|| panic!("no tool_calls: {c}"));
                assert!(!calls.is_empty());
                calls.iter().for_each(check_call);
                if let Some(name) = named {
                    assert_eq!(calls[0]["function"]["name"], name);
                    assert_eq!(c["finish_reason"], "stop");
                } else {
                    assert_eq!(c["finish_reason"], "tool_calls");
                }
                whole_calls.push(
                    calls
                        .iter()
                        .map(|c| c["function"].clone())
                        .collect::<Vec<_>>(),
                );
            }
            // Streamed: pieces of each call, put back together by index, as clients do.
            let events = server
                .stream("/v1/chat/completions", &streamed(&body))
                .await;
            let mut calls: Vec<Vec<(String, String)>> = vec![Vec::new(); 4];
            for event in &events {
                for c in event["choices"].as_array().unwrap() {
                    let i = c["index"].as_u64().unwrap() as usize;
                    for piece in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                        let k = piece["index"].as_u64().unwrap() as usize;
                        if calls[i].len() <= k {
                            calls[i].resize(k + 1, Default::default());
                        }
                        if let Some(name) = piece["function"]["name"].as_str() {
                            calls[i][k].0 = name.to_string();
                        }
                        if let Some(a) = piece["function"]["arguments"].as_str() {
                            calls[i][k].1.push_str(a);
                        }
                    }
                }
            }
            for (i, choice_calls) in calls.iter().enumerate() {
                let from_stream: Vec<Value> = choice_calls
                    .iter()
                    .map(|(name, arguments)| {
                        let args: Value = serde_json::from_str(arguments).unwrap();
                        json!({"name": name, "arguments": args})
                    })
                    .collect();
                let from_whole: Vec<Value> = whole_calls[i]
                    .iter()
                    .map(|f| {
                        let args: Value =
                            serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
                        json!({"name": f["name"], "arguments": args})
                    })
                    .collect();
                assert_eq!(from_stream, from_whole, "choice {i}");
            }
        }
    }
    // Errors: a named function that is not a tool; a required call without tools.
    let bad = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                     "tools": weather_tool(),
                     "tool_choice": {"type": "function", "function": {"name": "nope"}}});
    let err = expect_error(
        server
            .post("/v1/chat/completions")
            .json(&bad)
            .send()
            .await
            .unwrap(),
        StatusCode::BAD_REQUEST,
    )
    .await;
    assert_eq!(err["param"], "tool_choice");
    let bad = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                     "tool_choice": "required"});
    let err = expect_error(
        server
            .post("/v1/chat/completions")
            .json(&bad)
            .send()
            .await
            .unwrap(),
        StatusCode::BAD_REQUEST,
    )
    .await;
    assert_eq!(err["param"], "tool_choice");
    server.wait_idle().await;
    server.stop().await;
}

/// `auto` calls whose tags are special tokens (as some models' tokenizers have them): decoded
/// text leaves special tokens out, yet the parser must see the tags. The model is made to
/// write a call with the tag tokens (and BOS, another special token, before it): the call is
/// read back, whole and streamed, and neither the tags nor BOS reach the content, even where
/// the call is cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_calls_tagged_by_special_tokens_are_read_back() {
    let (tokenizer, [open, close]) = tool_tag_tokenizer();
    let bos = tokenizer.bos_token_id().unwrap();
    let server = start(Setup {
        tokenizer: Some(tokenizer),
        ..Setup::default()
    })
    .await;
    let call = r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}"#;
    let grammar = format!(
        "start: \"Let me look.\" <[{bos}]> <[{open}]> {} <[{close}]>",
        serde_json::to_string(call).unwrap()
    );
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
                      "tools": weather_tool(), "guided_grammar": grammar, "max_tokens": 60,
                      "logprobs": true, "temperature": 0.0});
    let whole = server.json("/v1/chat/completions", &body).await;
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{whole}");
    assert_eq!(choice["message"]["content"], "Let me look.", "{whole}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{whole}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let arguments: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris", "days": 2}));
    // The logprobs spell the text the parser read, tags included (BOS has no text).
    let spelled: String = (choice["logprobs"]["content"].as_array().unwrap().iter())
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert_eq!(
        spelled,
        format!("Let me look.<tool_call>{call}</tool_call>")
    );

    // Streamed: the content in pieces, the call whole at the end.
    let events = server
        .stream("/v1/chat/completions", &streamed(&body))
        .await;
    let (chunks, _) = split_usage(&events);
    let mut content = String::new();
    let mut streamed_calls = Vec::new();
    for chunk in chunks {
        let delta = &chunk["choices"][0]["delta"];
        content.push_str(delta["content"].as_str().unwrap_or_default());
        streamed_calls.extend(
            delta["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
                .cloned(),
        );
    }
    assert_eq!(content, "Let me look.");
    assert_eq!(streamed_calls.len(), 1, "{events:?}");
    assert_eq!(streamed_calls[0]["function"], calls[0]["function"]);
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "tool_calls");

    // Cut off inside the call: no call, and the content is the text without the tags.
    for stream in [false, true] {
        let mut cut = body.clone();
        // The text, BOS, the open tag and two tokens of the call.
        cut["max_tokens"] = json!(count_tokens("Let me look.") + 4);
        let (text, reason) = if stream {
            let events = server.stream("/v1/chat/completions", &streamed(&cut)).await;
            let (chunks, _) = split_usage(&events);
            assert!(
                chunks
                    .iter()
                    .all(|c| c["choices"][0]["delta"]["tool_calls"].is_null()),
                "{events:?}"
            );
            streamed_texts(chunks, 1).remove(0)
        } else {
            let whole = server.json("/v1/chat/completions", &cut).await;
            assert!(
                whole["choices"][0]["message"]["tool_calls"].is_null(),
                "{whole}"
            );
            texts(&whole).remove(0)
        };
        assert_eq!(reason, "length");
        assert!(text.starts_with("Let me look.{"), "{text:?}");
        assert!(
            !text.contains("<tool_call>") && !text.contains("<s>"),
            "{text:?}"
        );
    }
    server.wait_idle().await;
    server.stop().await;
}
