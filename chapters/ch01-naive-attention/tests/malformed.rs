//! Bad input gets a clear error that names the file, tensor or limit — never a panic.
//! Each test copies a good fixture model into a temporary directory and breaks one thing.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use ch01_naive_attention::{Error, Llama, Tokenizer, fixtures_dir};
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
