//! Whole models from GGUF files: the committed random checkpoints written by chapter 5's own
//! converter (`gguf::convert`), loaded by `load_gguf`, must give exactly the logits, config and
//! tokens that the safetensors directory gives. (`quantize.rs` beside it tests the converter.)

use std::path::PathBuf;

use ch01::linear::DenseLoader;
use ch01::{Llama, LlamaConfig, Tokenizer, WeightSource};
use ch05_quantization::gguf::{
    GgufError, GgufFile, GgufSource, GgufValue, GgufWriter, convert_hf_dir, llama_config,
};
use ch05_quantization::{GgmlType, blocks, load_gguf};

fn random_dir(name: &str) -> PathBuf {
    ch01::fixtures_dir().join("random").join(name)
}

fn write(w: &GgufWriter<'_>, dir: &tempfile::TempDir, name: &str) -> PathBuf {
    let path = dir.path().join(format!("{name}.gguf"));
    w.write(&path).unwrap();
    path
}

/// The GGUF file of checkpoint `dir` with projections in `ty`.
fn hf_dir_to_gguf(dir: &std::path::Path, ty: GgmlType) -> GgufWriter<'static> {
    convert_hf_dir(dir, ty).unwrap().writer
}

/// Prompts that cover the tokenizer's corners: specials written as text, unicode, digits and
/// runs of whitespace.
const TEXTS: [&str; 6] = [
    "Romeo, Romeo! wherefore art thou Romeo?",
    "<s>two specials</s> in the text",
    "  leading spaces,\ttabs\n\nand   runs   ",
    "café naïve 日本語 🦀🔥 emoji",
    "3.14159 and 2024-12-01, 1000000",
    "",
];

#[test]
fn gguf_tokenizer_matches_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = random_dir("gqa");
    let path = write(&hf_dir_to_gguf(&dir, GgmlType::F32), &tmp, "gqa");
    let gguf = load_gguf(&path, &DenseLoader).unwrap();
    let reference = Tokenizer::from_dir(&dir).unwrap();
    let sample = std::fs::read_to_string(ch01::fixtures_dir().join("corpus/sample.txt")).unwrap();
    for text in TEXTS.iter().copied().chain([sample.as_str()]) {
        for special in [false, true] {
            let ids = gguf.tokenizer.encode(text, special).unwrap();
            assert_eq!(ids, reference.encode(text, special).unwrap(), "{text:?}");
            assert_eq!(
                gguf.tokenizer.decode(&ids).unwrap(),
                reference.decode(&ids).unwrap()
            );
        }
    }
}

/// Q8_0 weights, q/k included: the source reorders whole rows of blocks, so it hands out
/// exactly the blocks the Hugging Face rows encode to, and decodes them through `blocks`.
#[test]
fn block_quantized_q_and_k_rows_are_unpermuted_as_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = random_dir("gqa");
    let path = write(&hf_dir_to_gguf(&dir, GgmlType::Q8_0), &tmp, "gqa-q8");
    let source = GgufSource::open(&path).unwrap();
    let weights = ch01::Weights::open(&dir).unwrap();
    let c = LlamaConfig::from_dir(&dir).unwrap();
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.embed_tokens.weight",
    ] {
        let hf = weights.tensor(name).unwrap();
        let [rows, cols] = [hf.shape()[0], hf.shape()[1]];
        let values = hf.to_f32(name).unwrap();
        let mut encoded = vec![0u8; GgmlType::Q8_0.row_bytes(cols).unwrap() * rows];
        blocks::quantize(GgmlType::Q8_0, &values, &mut encoded).unwrap(); // Hugging Face row order
        let raw = source.tensor(name).unwrap();
        assert_eq!(raw.shape(), [rows, cols]);
        assert_eq!(raw.dtype(), GgmlType::Q8_0.tensor_dtype());
        assert_eq!(raw.bytes(), &encoded[..], "{name}");

        let mut decoded = vec![0.0; rows * cols];
        blocks::dequantize(GgmlType::Q8_0, &encoded, &mut decoded).unwrap();
        assert_eq!(source.get(name, &[rows, cols]).unwrap(), decoded, "{name}");
        let m = source.matrix(name, rows, cols).unwrap();
        assert_eq!(m.as_slice().unwrap(), &decoded[..], "{name}");
        // A shard: some rows, some columns.
        let block = source
            .matrix_block(name, [rows, cols], 3..rows - 1, 5..cols - 2)
            .unwrap();
        for (i, r) in (3..rows - 1).enumerate() {
            assert_eq!(
                block.row(i).to_vec(),
                decoded[r * cols + 5..r * cols + cols - 2],
                "{name}"
            );
        }
    }
    // The raw GGUF view keeps the file's order.
    let q = source.gguf_tensor("blk.0.attn_q.weight").unwrap();
    assert_ne!(
        q.bytes(),
        source
            .tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .bytes()
    );
    // The whole model loads and runs, close to the f32 one (Q8_0 keeps ~8 bits).
    let model = Llama::from_source(
        llama_config(source.file()).unwrap(),
        &source,
        &DenseLoader,
        ch01::TensorParallel::whole(),
    )
    .unwrap();
    let want = Llama::load(&dir)
        .unwrap()
        .forward(&[0, 5, 77, 300])
        .unwrap();
    let got = model.forward(&[0, 5, 77, 300]).unwrap();
    let rel = ch01::testing::relative_l2(got.as_slice().unwrap(), want.as_slice().unwrap());
    assert!(rel < 0.05, "Q8_0 logits relative L2 {rel}");
    assert_eq!(c.num_hidden_layers, model.layers.len());
}

fn minimal(arch: &str) -> GgufWriter<'static> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", arch).unwrap();
    for (k, v) in [
        ("block_count", 1u32),
        ("context_length", 64),
        ("embedding_length", 32),
        ("feed_forward_length", 64),
        ("attention.head_count", 4),
    ] {
        w.add_metadata(format!("{arch}.{k}"), v).unwrap();
    }
    w.add_metadata(format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-6f32)
        .unwrap();
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::strings(["a", "b"]))
        .unwrap();
    w
}

fn config_of(w: &GgufWriter<'_>) -> Result<LlamaConfig, GgufError> {
    llama_config(&GgufFile::from_bytes("cfg.gguf", w.to_bytes()).unwrap())
}

#[test]
fn config_defaults_and_errors_name_the_key() {
    let c = config_of(&minimal("llama")).unwrap();
    assert_eq!((c.num_key_value_heads, c.head_dim, c.vocab_size), (4, 8, 2));
    assert_eq!(
        (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings),
        (10_000.0, 1e-6, true)
    );

    let mut w = minimal("llama");
    w.add_metadata("llama.rope.scaling.type", "linear").unwrap();
    w.add_metadata("llama.rope.scaling.factor", 4.0f32).unwrap();
    let c = config_of(&w).unwrap();
    assert_eq!(
        c.rope_scaling,
        ch01::config::RopeScaling::Linear { factor: 4.0 }
    );

    let e = config_of(&minimal("gpt2")).unwrap_err().to_string();
    assert!(e.contains("general.architecture `gpt2`"), "{e}");
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    assert!(
        matches!(config_of(&w), Err(GgufError::MissingKey { key, .. }) if key == "llama.embedding_length")
    );
    let mut w = minimal("llama");
    w.add_metadata("llama.attention.head_count_kv", "four")
        .unwrap();
    assert!(
        matches!(config_of(&w), Err(GgufError::WrongType { key, .. }) if key == "llama.attention.head_count_kv")
    );
    let mut w = minimal("llama");
    w.add_metadata("llama.attention.head_count_kv", 3u32)
        .unwrap();
    let e = config_of(&w).unwrap_err().to_string();
    assert!(e.contains("multiple of num_key_value_heads"), "{e}");
    let mut w = minimal("llama");
    w.add_metadata("llama.rope.dimension_count", 4u32).unwrap();
    assert!(
        config_of(&w)
            .unwrap_err()
            .to_string()
            .contains("partial rotary")
    );
    let mut w = minimal("llama");
    w.add_metadata("llama.rope.scaling.type", "yarn").unwrap();
    assert!(config_of(&w).unwrap_err().to_string().contains("`yarn`"));
    let mut w = minimal("llama");
    w.add_tensor("rope_freqs.weight", GgmlType::F32, &[4], vec![0; 16])
        .unwrap();
    assert!(
        config_of(&w)
            .unwrap_err()
            .to_string()
            .contains("rope_freqs.weight")
    );
    let c = config_of(&minimal("qwen2")).unwrap();
    assert!(c.qkv_bias && c.model_type == "qwen2");
    // JSON has no NaN: a non-finite float is refused by key, never read as absent (theta
    // 10,000) or misreported as a null.
    for (key, value) in [
        ("llama.rope.freq_base", f32::NAN),
        ("llama.rope.freq_base", f32::INFINITY),
        ("llama.rope.scale_linear", f32::NAN),
    ] {
        let mut w = minimal("llama");
        w.add_metadata(key, value).unwrap();
        assert!(
            matches!(config_of(&w), Err(GgufError::WrongType { key: k, .. }) if k == key),
            "{key} = {value}"
        );
    }
    let mut w = minimal("llama");
    w.add_metadata("llama.rope.scale_linear", 0.0f32).unwrap();
    let e = config_of(&w).unwrap_err().to_string();
    assert!(
        e.contains("`factor` must be a finite number above zero"),
        "{e}"
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write(&minimal("llama"), &tmp, "empty");
    let source = GgufSource::open(&path).unwrap();
    assert!(!source.contains("model.norm.weight"));
    let e = source.tensor("model.norm.weight").unwrap_err().to_string();
    assert!(
        e.contains("model.norm.weight") && e.contains("empty.gguf"),
        "{e}"
    );
}
