//! Random checkpoints: what `write_random_model` writes loads and runs, round-trips its config,
//! is reproducible from the seed, and a spec the loader would reject writes nothing.

use std::path::Path;

use ch01_naive_attention::random_model::INIT_STD;
use ch01_naive_attention::testing::relative_l2;
use ch01_naive_attention::{
    Error, Llama, LlamaConfig, RandomDtype, RandomModelSpec, Tokenizer, write_random_model,
};
use safetensors::{Dtype, SafeTensors};
use tempfile::TempDir;

/// `spec` written into a fresh temporary directory.
fn written(spec: &RandomModelSpec) -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_random_model(spec, dir.path()).unwrap();
    dir
}

/// The logits of "ROMEO:" (`[T, vocab]`, row-major) from the model in `dir`.
fn logits(dir: &Path) -> (Vec<usize>, Vec<f32>) {
    let model = Llama::load(dir).unwrap();
    let tokens = Tokenizer::from_dir(dir)
        .unwrap()
        .encode("ROMEO:", true)
        .unwrap();
    let logits = model.forward(&tokens).unwrap(); // [T, vocab]
    (logits.shape().to_vec(), logits.iter().copied().collect())
}

fn file(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap()
}

#[test]
fn random_model_tiny_d64_loads_and_runs() {
    let spec = RandomModelSpec::tiny_d64();
    let dir = written(&spec);

    let config = LlamaConfig::from_dir(dir.path()).unwrap();
    assert_eq!(config.head_dim, 64);
    assert_eq!(config.hidden_size, spec.hidden_size);
    assert_eq!(config.intermediate_size, spec.intermediate_size);
    assert_eq!(config.num_hidden_layers, spec.num_hidden_layers);
    assert_eq!(config.num_attention_heads, spec.num_attention_heads);
    assert_eq!(config.num_key_value_heads, spec.num_key_value_heads);
    assert_eq!(config.vocab_size, spec.vocab_size);
    assert_eq!(config.max_position_embeddings, spec.max_position_embeddings);
    assert_eq!(config.rope_theta, spec.rope_theta);
    assert!(config.tie_word_embeddings && !config.qkv_bias && !config.mlp_bias);
    assert_eq!(config.eos_token_ids, [1]);

    let (shape, values) = logits(dir.path());
    assert_eq!(shape[1], 4096);
    assert!(shape[0] >= 2, "`<s>` and at least one token of ROMEO:");
    assert!(values.iter().all(|v| v.is_finite()));
}

/// The file holds exactly the spec's tensors, `[out, in]`, in its dtype; norms are ones and
/// the matrices have the initializer's spread.
#[test]
fn random_model_tensors_match_the_spec() {
    let spec = RandomModelSpec {
        tie_word_embeddings: false,
        ..RandomModelSpec::tiny_d64()
    };
    let dir = written(&spec);
    let bytes = file(dir.path(), "model.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let expected = spec.tensors();
    assert_eq!(st.len(), expected.len());
    assert!(expected.iter().any(|t| t.name == "lm_head.weight"));
    for t in &expected {
        let view = st.tensor(&t.name).unwrap();
        assert_eq!(view.shape(), t.shape, "{}", t.name);
        assert_eq!(view.dtype(), Dtype::F32, "{}", t.name);
    }
    let floats = |name: &str| -> Vec<f32> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    assert!(floats("model.norm.weight").iter().all(|&v| v == 1.0));
    let q = floats("model.layers.1.self_attn.q_proj.weight");
    let std = (q.iter().map(|v| v * v).sum::<f32>() / q.len() as f32).sqrt();
    assert!((std - INIT_STD).abs() < 1e-3, "std {std}");
    Llama::load(dir.path()).unwrap();
}

#[test]
fn random_model_same_seed_same_bytes_other_seed_other_weights() {
    let spec = RandomModelSpec::tiny_d64();
    let (a, b) = (written(&spec), written(&spec));
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(
            file(a.path(), name) == file(b.path(), name),
            "{name} differs"
        );
    }

    let other = written(&RandomModelSpec { seed: 1, ..spec });
    let (this, that) = (
        file(a.path(), "model.safetensors"),
        file(other.path(), "model.safetensors"),
    );
    let (this, that) = (
        SafeTensors::deserialize(&this).unwrap(),
        SafeTensors::deserialize(&that).unwrap(),
    );
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.down_proj.weight",
    ] {
        assert_ne!(
            this.tensor(name).unwrap().data(),
            that.tensor(name).unwrap().data(),
            "{name} should change with the seed"
        );
    }
    assert_eq!(
        this.tensor("model.norm.weight").unwrap().data(),
        that.tensor("model.norm.weight").unwrap().data()
    );
}

/// bf16 stores the f32 model's samples rounded, so its logits are the f32 model's, nearly.
#[test]
fn random_model_bf16_loads_and_agrees_with_f32() {
    let f32_spec = RandomModelSpec::tiny_d64();
    let bf16_spec = RandomModelSpec {
        dtype: RandomDtype::Bf16,
        ..f32_spec.clone()
    };
    let (f32_dir, bf16_dir) = (written(&f32_spec), written(&bf16_spec));
    let bytes = file(bf16_dir.path(), "model.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        st.tensor("model.embed_tokens.weight").unwrap().dtype(),
        Dtype::BF16
    );

    let (shape, bf16_logits) = logits(bf16_dir.path());
    let (f32_shape, f32_logits) = logits(f32_dir.path());
    assert_eq!(shape, f32_shape);
    assert!(bf16_logits.iter().all(|v| v.is_finite()));
    let error = relative_l2(&bf16_logits, &f32_logits);
    assert!(error < 2e-2, "relative L2 {error}");
}

#[test]
fn random_model_a_spec_the_loader_rejects_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let spec = RandomModelSpec {
        num_attention_heads: 3,
        ..RandomModelSpec::tiny_d64()
    };
    let error = write_random_model(&spec, &dir).unwrap_err();
    assert!(matches!(error, Error::Config { .. }), "{error}");
    assert!(error.to_string().contains("num_key_value_heads"), "{error}");
    assert!(!dir.exists());
}
