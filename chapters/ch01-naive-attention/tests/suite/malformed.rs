//! Bad input gets a clear error that names the file, tensor or limit — never a panic.
//! Each test copies a good fixture model into a temporary directory and breaks one thing.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use ch01_naive_attention::{Error, Llama, LlamaConfig, Tokenizer, eos_token_ids, fixtures_dir};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;
use tempfile::TempDir;

/// A writable copy of a fixture model directory.
fn copy_fixture(name: &str) -> TempDir {
    let tmp = TempDir::new().unwrap();
    for entry in fs::read_dir(fixtures_dir().join(name)).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    tmp
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let mut value: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    edit(value.as_object_mut().unwrap());
    fs::write(path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

fn load_error(dir: &Path) -> String {
    match Llama::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[track_caller]
fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "error {message:?} should mention {needle:?}"
        );
    }
}

/// Rewrites `model.safetensors` keeping the tensors `keep` accepts, with `metadata` unchanged.
fn rewrite_safetensors(dir: &Path, keep: impl Fn(&str) -> bool) {
    let path = dir.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| keep(name))
        .collect();
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, &path).unwrap();
}

#[test]
fn config_missing_required_field_is_named() {
    let dir = copy_fixture("random/gqa");
    edit_json(&dir.path().join("config.json"), |c| {
        c.remove("hidden_size");
    });
    assert_mentions(
        &load_error(dir.path()),
        &["config.json", "missing field `hidden_size`"],
    );
}

#[test]
fn config_that_is_not_json_names_the_file() {
    let dir = copy_fixture("random/gqa");
    fs::write(dir.path().join("config.json"), "{ \"hidden_size\": 64,").unwrap();
    assert_mentions(&load_error(dir.path()), &["invalid config", "config.json"]);
}

#[test]
fn config_unknown_fields_are_tolerated() {
    let dir = copy_fixture("random/gqa");
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert(
            "some_future_field".into(),
            serde_json::json!({"nested": [1, 2, 3]}),
        );
    });
    Llama::load(dir.path()).unwrap();
}

#[test]
fn config_inconsistent_heads_are_rejected() {
    let dir = copy_fixture("random/gqa");
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("num_key_value_heads".into(), 3.into());
    });
    assert_mentions(
        &load_error(dir.path()),
        &["num_attention_heads", "multiple of num_key_value_heads (3)"],
    );
}

/// A context of 10^12 positions (a typo) would size buffers of terabytes: refused, by name.
#[test]
fn config_absurd_context_is_rejected() {
    let dir = copy_fixture("random/gqa");
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert(
            "max_position_embeddings".into(),
            1_000_000_000_000u64.into(),
        );
    });
    assert_mentions(
        &load_error(dir.path()),
        &[
            "max_position_embeddings (1000000000000)",
            "16777216 positions",
        ],
    );
}

#[test]
fn config_unsupported_rope_scaling_is_named() {
    let dir = copy_fixture("random/gqa");
    edit_json(&dir.path().join("config.json"), |c| {
        c.remove("rope_parameters");
        c.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
        );
    });
    assert_mentions(
        &load_error(dir.path()),
        &["rope scaling `yarn` is not supported"],
    );
}

#[test]
fn config_llama3_rope_without_its_fields_is_rejected() {
    let dir = copy_fixture("random/gqa");
    edit_json(&dir.path().join("config.json"), |c| {
        c.remove("rope_parameters");
        c.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": "llama3", "factor": 8.0}),
        );
    });
    assert_mentions(&load_error(dir.path()), &["llama3", "low_freq_factor"]);
}

/// Rope factors that would make every rotation NaN (a factor of zero, a llama3 blend whose
/// bands meet) are refused by name.
#[test]
fn config_rope_factors_that_divide_by_zero_are_rejected() {
    let cases = [
        (
            serde_json::json!({"rope_type": "linear", "factor": 0.0}),
            "`factor` must be",
        ),
        (
            serde_json::json!({"rope_type": "linear", "factor": -2.0}),
            "`factor` must be",
        ),
        (
            serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                "high_freq_factor": 2.0, "original_max_position_embeddings": 8192}),
            "must be more than low_freq_factor",
        ),
        (
            serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 0}),
            "original_max_position_embeddings must be positive",
        ),
    ];
    for (rope, needle) in cases {
        let dir = copy_fixture("random/gqa");
        edit_json(&dir.path().join("config.json"), |c| {
            c.remove("rope_parameters");
            c.insert("rope_scaling".into(), rope.clone());
        });
        assert_mentions(&load_error(dir.path()), &[needle]);
    }
}

/// Numbers that pass `> 0` in f64 but break the f32 forward pass are refused by name: a
/// `rope_theta` or linear `factor` of 1e-300 makes a RoPE frequency infinite in f32 (every logit
/// NaN), an `rms_norm_eps` of 1e-50 rounds to zero in f32 and one of 1e300 to infinity.
#[test]
fn config_numbers_that_break_in_f32_are_rejected() {
    type Edit = fn(&mut serde_json::Map<String, serde_json::Value>);
    let cases: [(Edit, &str, &str); 5] = [
        (
            |c| c["rope_parameters"]["rope_theta"] = 1e-300.into(),
            "rope_theta gives",
            "inf in f32 (rope_theta 1e-300, Default)",
        ),
        (
            |c| c["rope_parameters"]["rope_theta"] = 1e300.into(),
            "rope_theta gives",
            "0 in f32 (rope_theta 1e300, Default)",
        ),
        (
            |c| {
                c.remove("rope_parameters");
                c.insert(
                    "rope_scaling".into(),
                    serde_json::json!({"rope_type": "linear", "factor": 1e-300}),
                );
            },
            "rope scaling `factor` gives",
            "inf in f32 (rope_theta 1e4, Linear { factor: 1e-300 })",
        ),
        (
            |c| c["rms_norm_eps"] = 1e-50.into(),
            "rms_norm_eps (",
            "must be a positive number that f32 holds (it is 0 in f32)",
        ),
        (
            |c| c["rms_norm_eps"] = 1e300.into(),
            "rms_norm_eps (1e300)",
            "must be a positive number that f32 holds (it is inf in f32)",
        ),
    ];
    for (edit, field, needle) in cases {
        let dir = copy_fixture("random/gqa");
        edit_json(&dir.path().join("config.json"), edit);
        assert_mentions(&load_error(dir.path()), &["config.json", field, needle]);
    }
}

/// Mistral's `sliding_window` (applied by transformers whenever it is set) holds the context to
/// the window, where the window's mask is the causal one; unset, larger than the context, or on
/// a model type that ignores it (Llama; Qwen2 without `use_sliding_window`), the context is
/// `max_position_embeddings`.
#[test]
fn config_mistral_sliding_window_clamps_the_context() {
    let context = |model_type: &str, window: serde_json::Value| {
        let dir = copy_fixture("random/gqa");
        edit_json(&dir.path().join("config.json"), |c| {
            c.insert("model_type".into(), model_type.into());
            c.insert("max_position_embeddings".into(), 512.into());
            c.insert("sliding_window".into(), window);
        });
        LlamaConfig::from_dir(dir.path())
            .map(|c| c.max_position_embeddings)
            .map_err(|e| e.to_string())
    };
    assert_eq!(context("mistral", 16.into()), Ok(16));
    assert_eq!(context("mistral", 4096.into()), Ok(512));
    assert_eq!(context("mistral", serde_json::Value::Null), Ok(512));
    assert_eq!(context("llama", 16.into()), Ok(512));
    assert_eq!(context("qwen2", 16.into()), Ok(512));
    let zero = context("mistral", 0.into()).unwrap_err();
    assert_mentions(&zero, &["config.json", "sliding_window must be positive"]);

    // The clamped context is the one the forward pass enforces.
    let dir = copy_fixture("random/gqa");
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("model_type".into(), "mistral".into());
        c.insert("sliding_window".into(), 16.into());
    });
    let model = Llama::load(dir.path()).unwrap();
    assert!(model.forward(&[5; 16]).is_ok());
    assert!(matches!(
        model.forward(&[5; 17]),
        Err(Error::ContextOverflow {
            len: 17,
            max_len: 16
        })
    ));
}

/// A stop or BOS id the model has no embedding row for (a generation config out of step with
/// the checkpoint) is refused, naming the file and the id: the server's grammar engine once
/// panicked on it.
#[test]
fn special_token_ids_outside_the_vocabulary_are_rejected() {
    for (key, value) in [
        ("eos_token_id", serde_json::json!([1, 40000])),
        ("eos_token_id", serde_json::json!(4096)),
        ("bos_token_id", serde_json::json!(40000)),
    ] {
        let dir = copy_fixture("random/gqa");
        edit_json(&dir.path().join("config.json"), |c| {
            c.insert(key.into(), value.clone());
        });
        let id = value.as_array().map_or(&value, |ids| &ids[1]).to_string();
        assert_mentions(
            &load_error(dir.path()),
            &["config.json", &format!("{key} {id} is outside"), "4096"],
        );
    }

    let dir = copy_fixture("random/gqa");
    let config = LlamaConfig::from_dir(dir.path()).unwrap();
    assert_eq!(eos_token_ids(dir.path(), &config).unwrap(), [1]);
    edit_json(&dir.path().join("generation_config.json"), |c| {
        c.insert("eos_token_id".into(), serde_json::json!([1, 40000]));
    });
    let error = eos_token_ids(dir.path(), &config).unwrap_err().to_string();
    assert_mentions(
        &error,
        &[
            "generation_config.json",
            "eos_token_id 40000 is outside",
            "4096",
        ],
    );
}

/// A count no model has (a corrupt file) is refused before it sizes anything.
#[test]
fn config_absurd_counts_are_rejected() {
    for (key, value) in [
        ("num_hidden_layers", 4_294_967_295u64),
        ("vocab_size", 1 << 40),
        ("num_attention_heads", 1 << 32),
    ] {
        let dir = copy_fixture("random/gqa");
        edit_json(&dir.path().join("config.json"), |c| {
            c.insert(key.into(), value.into());
        });
        assert_mentions(
            &load_error(dir.path()),
            &[&format!("{key} ({value}) is more than")],
        );
    }
}

#[test]
fn missing_config_file_is_named() {
    let dir = copy_fixture("random/gqa");
    fs::remove_file(dir.path().join("config.json")).unwrap();
    assert_mentions(&load_error(dir.path()), &["cannot read", "config.json"]);
}

#[test]
fn truncated_safetensors_names_the_file() {
    let dir = copy_fixture("random/gqa");
    let path = dir.path().join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert_mentions(
        &load_error(dir.path()),
        &["invalid safetensors file", "model.safetensors"],
    );
}

#[test]
fn empty_safetensors_names_the_file() {
    let dir = copy_fixture("random/gqa");
    fs::write(dir.path().join("model.safetensors"), b"").unwrap();
    assert_mentions(&load_error(dir.path()), &["model.safetensors", "too short"]);
}

#[test]
fn garbage_safetensors_header_names_the_file() {
    let dir = copy_fixture("random/gqa");
    let mut bytes = 64u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[b'x'; 64]);
    fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    assert_mentions(
        &load_error(dir.path()),
        &["invalid safetensors file", "model.safetensors"],
    );
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture("random/gqa");
    rewrite_safetensors(dir.path(), |name| {
        name != "model.layers.1.mlp.up_proj.weight"
    });
    assert_mentions(
        &load_error(dir.path()),
        &["tensor `model.layers.1.mlp.up_proj.weight` not found"],
    );
}

#[test]
fn untied_model_without_lm_head_is_an_error() {
    let dir = copy_fixture("random/untied");
    rewrite_safetensors(dir.path(), |name| name != "lm_head.weight");
    assert_mentions(
        &load_error(dir.path()),
        &["tensor `lm_head.weight` not found"],
    );
}

#[test]
fn shape_mismatch_names_tensor_and_shapes() {
    let dir = copy_fixture("random/gqa");
    let config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    let intermediate = config["intermediate_size"].as_u64().unwrap();
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("intermediate_size".into(), (intermediate + 1).into());
    });
    let message = load_error(dir.path());
    assert_mentions(
        &message,
        &[
            "model.layers.0.mlp.gate_proj.weight",
            "has shape",
            "expected",
        ],
    );
    assert!(matches!(
        Llama::load(dir.path()),
        Err(Error::ShapeMismatch { .. })
    ));
}

#[test]
fn shard_listed_in_index_but_missing_is_named() {
    let dir = copy_fixture("random/sharded");
    fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    assert_mentions(
        &load_error(dir.path()),
        &["cannot read", "model-00002-of-00002.safetensors"],
    );
}

#[test]
fn malformed_shard_index_is_named() {
    let dir = copy_fixture("random/sharded");
    fs::write(
        dir.path().join("model.safetensors.index.json"),
        "{\"weight_map\": 7}",
    )
    .unwrap();
    assert_mentions(&load_error(dir.path()), &["model.safetensors.index.json"]);
}

#[test]
fn shard_outside_the_model_directory_is_refused() {
    for shard in [
        "/dev/zero",
        "../model-00002-of-00002.safetensors",
        "a/../../b",
        "",
    ] {
        let dir = copy_fixture("random/sharded");
        edit_json(&dir.path().join("model.safetensors.index.json"), |index| {
            index["weight_map"]["model.embed_tokens.weight"] = shard.into();
        });
        assert_mentions(
            &load_error(dir.path()),
            &[
                "model.safetensors.index.json",
                "is not a file name inside the model directory",
            ],
        );
    }
}

#[test]
fn a_tensor_in_two_shards_is_refused() {
    let dir = copy_fixture("random/sharded");
    // The second shard gains a copy of a tensor the first holds.
    let first = fs::read(dir.path().join("model-00001-of-00002.safetensors")).unwrap();
    let first = SafeTensors::deserialize(&first).unwrap();
    let second_path = dir.path().join("model-00002-of-00002.safetensors");
    let second = fs::read(&second_path).unwrap();
    let second = SafeTensors::deserialize(&second).unwrap();
    let mut views: Vec<(String, TensorView)> = second.tensors();
    views.push((
        "model.embed_tokens.weight".into(),
        first.tensor("model.embed_tokens.weight").unwrap(),
    ));
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, &second_path).unwrap();
    assert_mentions(
        &load_error(dir.path()),
        &[
            "model-00002-of-00002.safetensors",
            "`model.embed_tokens.weight` is also in",
        ],
    );
}

#[cfg(unix)]
#[test]
fn a_weights_file_that_is_a_pipe_or_a_directory_is_refused_at_once() {
    let dir = copy_fixture("shakespeare-small");
    let path = dir.path().join("model.safetensors");
    fs::remove_file(&path).unwrap();
    // Opening a named pipe waits for a writer: this test would hang.
    let made = std::process::Command::new("mkfifo").arg(&path).status();
    assert!(made.unwrap().success(), "mkfifo");
    assert_mentions(
        &load_error(dir.path()),
        &["model.safetensors", "not a regular file"],
    );
    fs::remove_file(&path).unwrap();
    fs::create_dir(&path).unwrap();
    assert_mentions(
        &load_error(dir.path()),
        &["model.safetensors", "not a regular file"],
    );
}

fn tokenizer_error(dir: &Path) -> String {
    match Tokenizer::from_dir(dir) {
        Ok(_) => panic!("loading the tokenizer in {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn malformed_tokenizer_json_names_the_file() {
    let dir = copy_fixture("random/gqa");
    let path: PathBuf = dir.path().join("tokenizer.json");
    let text = fs::read_to_string(&path).unwrap();
    fs::write(&path, &text[..text.len() / 3]).unwrap();
    assert_mentions(
        &tokenizer_error(dir.path()),
        &["invalid tokenizer", "tokenizer.json"],
    );
}

#[test]
fn tokenizer_config_with_unknown_special_token_is_named() {
    let dir = copy_fixture("random/gqa");
    edit_json(&dir.path().join("tokenizer_config.json"), |c| {
        c.insert("eos_token".into(), "<|not-a-token|>".into());
    });
    assert_mentions(
        &tokenizer_error(dir.path()),
        &[
            "tokenizer_config.json",
            "eos_token",
            "not in the vocabulary",
        ],
    );
}

#[test]
fn tokenizer_config_special_token_object_without_content_is_named() {
    let dir = copy_fixture("random/gqa");
    edit_json(&dir.path().join("tokenizer_config.json"), |c| {
        c.insert("eos_token".into(), serde_json::json!({"foo": 1}));
    });
    assert_mentions(
        &tokenizer_error(dir.path()),
        &[
            "tokenizer_config.json",
            "`eos_token` must be a string or an object with a string `content`",
        ],
    );
}

#[test]
fn prompt_longer_than_the_context_is_rejected() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let max_len = model.config.max_position_embeddings;
    let tokens = vec![5u32; max_len + 1];
    let error = model.forward(&tokens).unwrap_err();
    assert!(
        matches!(error, Error::ContextOverflow { len, max_len: m } if len == max_len + 1 && m == max_len)
    );
    assert_mentions(
        &error.to_string(),
        &[
            &format!("{} tokens", max_len + 1),
            &format!("context of {max_len}"),
        ],
    );
}

#[test]
fn empty_prompt_and_out_of_vocabulary_ids_are_rejected() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    assert_mentions(
        &model.forward(&[]).unwrap_err().to_string(),
        &["prompt is empty"],
    );
    let vocab = model.config.vocab_size as u32;
    assert_mentions(
        &model.forward(&[0, vocab]).unwrap_err().to_string(),
        &[&format!("token id {vocab}"), "vocabulary"],
    );
}

/// `shakespeare-small`'s tokenizer with `edit` applied to its `tokenizer.json`.
fn edited_tokenizer(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> (TempDir, Result<Tokenizer, Error>) {
    let tmp = copy_fixture("shakespeare-small");
    edit_json(&tmp.path().join("tokenizer.json"), edit);
    let tokenizer = Tokenizer::from_dir(tmp.path());
    (tmp, tokenizer)
}

#[test]
fn tokenizer_truncation_and_padding_in_the_file_are_ignored() {
    let text =
        "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer";
    let (_tmp, plain) = edited_tokenizer(|_| {});
    let expected = plain.unwrap().encode(text, true).unwrap();
    assert!(
        expected.len() > 8,
        "a prompt longer than the file's max_length"
    );
    // A stride longer than max_length made the tokenizers crate panic; 2^42 of padding asked
    // it for 4 TB. transformers switches both off at every encode, and so does kiln.
    let (_tmp, hostile) = edited_tokenizer(|json| {
        json["truncation"] = serde_json::json!({
            "direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 5
        });
        json["padding"] = serde_json::json!({
            "strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": 1u64 << 42,
            "pad_id": 0, "pad_type_id": 0, "pad_token": "<s>"
        });
    });
    assert_eq!(hostile.unwrap().encode(text, true).unwrap(), expected);
}

#[test]
fn tokenizer_components_that_panic_give_errors() {
    // Each of these makes the tokenizers crate panic when it encodes.
    let components = [
        (
            "pre_tokenizer",
            serde_json::json!({"type": "FixedLength", "length": 0}),
        ),
        (
            "normalizer",
            serde_json::json!({"type": "Replace", "pattern": {"String": ""}, "content": "x"}),
        ),
    ];
    for (key, component) in components {
        let (_tmp, tokenizer) = edited_tokenizer(|json| {
            json[key] = component.clone();
        });
        let tokenizer = tokenizer.unwrap();
        let err = tokenizer
            .encode("Good night, sweet prince", true)
            .unwrap_err();
        assert_mentions(&err.to_string(), &["tokenizer.json", "panicked"]);
        // The tokenizer still answers, with the same error rather than a crash.
        assert!(tokenizer.encode("again", false).is_err(), "{key}");
    }
}

#[test]
fn tokenizer_precompiled_map_that_declares_more_than_it_holds_is_rejected() {
    use base64::Engine as _;
    // The header declares a 4 GB trie: the tokenizers crate would reserve 8.6 GB for it.
    let mut map = 0xFFFF_FFF0u32.to_le_bytes().to_vec();
    map.extend_from_slice(&[0; 12]);
    let map = base64::engine::general_purpose::STANDARD.encode(&map);
    for normalizer in [
        serde_json::json!({"type": "Precompiled", "precompiled_charsmap": map}),
        serde_json::json!({"type": "Sequence", "normalizers": [
            {"type": "NFC"}, {"type": "Precompiled", "precompiled_charsmap": map}
        ]}),
    ] {
        let (_tmp, tokenizer) = edited_tokenizer(|json| {
            json["normalizer"] = normalizer.clone();
        });
        let err = tokenizer
            .err()
            .expect("a map larger than its data")
            .to_string();
        assert_mentions(
            &err,
            &[
                "tokenizer.json",
                "declares a trie of 4294967280 bytes but holds 12",
            ],
        );
    }
    // At the boundary: a header of 8 with 8 bytes of trie after it is whole (what the crate
    // makes of a trie of zeros is its own affair); a header of 9 declares a byte more.
    for (declared, whole) in [(8u32, true), (9, false)] {
        let mut map = declared.to_le_bytes().to_vec();
        map.extend_from_slice(&[0; 8]);
        let map = base64::engine::general_purpose::STANDARD.encode(&map);
        let (_tmp, tokenizer) = edited_tokenizer(|json| {
            json["normalizer"] =
                serde_json::json!({"type": "Precompiled", "precompiled_charsmap": map});
        });
        match tokenizer {
            Ok(_) => assert!(whole, "header {declared} loaded"),
            Err(e) => {
                assert!(!whole, "header {declared}: {e}");
                assert_mentions(&e.to_string(), &["declares a trie of 9 bytes but holds 8"]);
            }
        }
    }
    // An empty map made the crate panic while it loaded.
    let (_tmp, tokenizer) = edited_tokenizer(|json| {
        json["normalizer"] = serde_json::json!({"type": "Precompiled", "precompiled_charsmap": ""});
    });
    let err = tokenizer.err().expect("an empty map").to_string();
    assert_mentions(&err, &["tokenizer.json", "shorter than its 4-byte header"]);
}

#[test]
fn added_tokens_beyond_the_limits_are_rejected_before_the_crate_builds_its_matcher() {
    use ch01_naive_attention::tokenizer::{
        MAX_ADDED_TOKEN_BYTES, MAX_ADDED_TOKENS, MAX_ADDED_TOKENS_BYTES,
    };
    let token = |id: usize, content: String| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let with_added = |added: Vec<serde_json::Value>| {
        edited_tokenizer(move |json| {
            json["added_tokens"].as_array_mut().unwrap().extend(added);
        })
    };
    // One token of 100,000 `a`s kept the tokenizers crate building its matcher past a minute.
    let started = std::time::Instant::now();
    let (_tmp, long) = with_added(vec![token(5000, "a".repeat(100_000))]);
    let err = long.err().expect("a 100,000-byte added token").to_string();
    assert_mentions(&err, &["tokenizer.json", "100000 bytes long", "up to 1024"]);
    assert!(
        started.elapsed().as_secs() < 30,
        "refused before the crate's build"
    );
    // At the limits: a token of exactly MAX_ADDED_TOKEN_BYTES loads, one byte more does not.
    for (len, loads) in [
        (MAX_ADDED_TOKEN_BYTES, true),
        (MAX_ADDED_TOKEN_BYTES + 1, false),
    ] {
        let (_tmp, tokenizer) = with_added(vec![token(5000, "a".repeat(len))]);
        assert_eq!(tokenizer.is_ok(), loads, "a token of {len} bytes");
    }
    let many = |count: usize, len: usize| {
        (0..count)
            .map(|i| token(5000 + i, format!("{i:0len$}")))
            .collect::<Vec<_>>()
    };
    // The fixture has added tokens of its own: the count and the bytes include them.
    let (_tmp, too_many) = with_added(many(MAX_ADDED_TOKENS, 6));
    assert_mentions(
        &too_many.err().expect("too many added tokens").to_string(),
        &["added tokens; kiln reads up to 65536"],
    );
    let (_tmp, too_big) = with_added(many(MAX_ADDED_TOKENS_BYTES / 1000 + 1, 1000));
    assert_mentions(
        &too_big
            .err()
            .expect("too many bytes of added tokens")
            .to_string(),
        &["bytes together; kiln reads up to 1048576"],
    );
}
