//! `gguf::convert` (what `kiln quantize` runs) on the committed checkpoints: the file it writes
//! loads back as the same model, its block tensors hold exactly the checkpoint's weights
//! rounded once, its tokenizer is `tokenizer.json`'s, and its metadata says what llama.cpp
//! expects.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ch01::linear::DenseLoader;
use ch01::{Llama, LlamaConfig, RawTensor, TensorDtype, TensorParallel, Tokenizer, WeightSource};
use ch05_quantization::gguf::convert::{ConvertError, TensorRole};
use ch05_quantization::gguf::{
    GgufFile, GgufSource, GgufValue, GgufWriter, convert_hf_dir, hf_name, llama_config, permute_qk,
    quantize_hf_dir,
};
use ch05_quantization::{GgmlType, blocks, load_gguf};

fn fixture(name: &str) -> PathBuf {
    ch01::fixtures_dir().join(name)
}

/// Every committed checkpoint kiln can convert.
const CHECKPOINTS: [&str; 8] = [
    "random/gqa",
    "random/mha",
    "random/head-dim",
    "random/untied",
    "random/qwen2",
    "random/bf16",
    "random/sharded",
    "shakespeare-tiny",
];

const PROMPT: &str = "Romeo, Romeo! wherefore art thou Romeo? 3.14 café 🦀";

fn write_gguf(dir: &Path, ty: GgmlType, tmp: &tempfile::TempDir) -> PathBuf {
    let name = dir.file_name().unwrap().to_string_lossy();
    let path = tmp.path().join(format!("{name}-{ty}.gguf"));
    quantize_hf_dir(dir, ty, &path).unwrap();
    path
}

/// At f32 (bf16 for the bf16 checkpoint) the file holds the checkpoint's values exactly: the
/// same logits bit for bit, the same config, stop ids and special tokens.
#[test]
fn float_files_give_the_checkpoints_logits_config_and_tokens_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for name in CHECKPOINTS {
        let dir = fixture(name);
        let ty = if name.ends_with("bf16") {
            GgmlType::BF16
        } else {
            GgmlType::F32
        };
        let gguf = load_gguf(&write_gguf(&dir, ty, &tmp), &DenseLoader).unwrap();

        let mut expected_config = LlamaConfig::from_dir(&dir).unwrap();
        expected_config.eos_token_ids = ch01::eos_token_ids(&dir, &expected_config).unwrap();
        assert_eq!(gguf.model.config, expected_config, "{name}");
        assert_eq!(gguf.eos_token_ids, expected_config.eos_token_ids, "{name}");
        assert_eq!(
            gguf.chat_template, None,
            "{name}: the fixtures have no template"
        );

        let tokenizer = Tokenizer::from_dir(&dir).unwrap();
        let t = &gguf.tokenizer;
        assert_eq!(
            (
                t.bos_token_id(),
                t.eos_token_id(),
                t.adds_bos(),
                t.vocab_size()
            ),
            (
                tokenizer.bos_token_id(),
                tokenizer.eos_token_id(),
                tokenizer.adds_bos(),
                tokenizer.vocab_size()
            ),
            "{name}"
        );
        let prompt = tokenizer.encode(PROMPT, true).unwrap();
        let want = Llama::load(&dir).unwrap().forward(&prompt).unwrap();
        assert_eq!(
            gguf.model.forward(&prompt).unwrap(),
            want,
            "{name}: logits differ"
        );
    }
}

/// The checkpoint's tensors, each replaced by its values encoded in `types[name]` and decoded
/// again with `blocks` (f32 where `types` has no entry).
struct RoundedSource {
    dir: PathBuf,
    tensors: HashMap<String, (Vec<usize>, Vec<u8>)>, // name → (shape, f32 bytes)
}

impl RoundedSource {
    fn new(dir: &Path, types: &HashMap<String, GgmlType>) -> RoundedSource {
        let weights = ch01::Weights::open(dir).unwrap();
        let mut tensors = HashMap::new();
        for (name, &ty) in types {
            let raw = weights.tensor(name).unwrap();
            let values = raw.to_f32(name).unwrap();
            let cols = *raw.shape().last().unwrap();
            let rows = values.len() / cols;
            let mut encoded = vec![0u8; ty.row_bytes(cols).unwrap() * rows];
            blocks::quantize(ty, &values, &mut encoded).unwrap();
            let mut decoded = vec![0.0f32; values.len()];
            blocks::dequantize(ty, &encoded, &mut decoded).unwrap();
            let bytes = decoded.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.insert(name.clone(), (raw.shape().to_vec(), bytes));
        }
        RoundedSource {
            dir: dir.to_path_buf(),
            tensors,
        }
    }
}

impl WeightSource for RoundedSource {
    fn location(&self) -> &Path {
        &self.dir
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn tensor(&self, name: &str) -> ch01::Result<RawTensor<'_>> {
        let (shape, bytes) = self
            .tensors
            .get(name)
            .ok_or_else(|| ch01::Error::MissingTensor {
                name: name.to_string(),
                location: self.dir.clone(),
            })?;
        RawTensor::new(
            name,
            &self.dir,
            TensorDtype::F32,
            shape.clone(),
            Cow::Borrowed(&bytes[..]),
        )
    }
}

/// At a block type, decoding the file gives exactly the checkpoint's weights rounded through
/// `blocks` in the type the file records for each tensor (q/k rows permuted and unpermuted on
/// the way), so the logits equal those of that rounded checkpoint bit for bit.
#[test]
fn block_files_equal_the_checkpoint_rounded_through_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    // Widths of 256 and 512, where a K-quant holds every projection (the fixtures' widths are
    // not multiples of 256, so there Q6_K falls back to Q8_0 throughout).
    let d64 = tmp.path().join("tiny-d64");
    ch01::random_model::write_random_model(&ch01::random_model::RandomModelSpec::tiny_d64(), &d64)
        .unwrap();
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q6K,
    ] {
        for name in [
            "random/gqa",
            "random/untied",
            "random/qwen2",
            "shakespeare-tiny",
            "tiny-d64",
        ] {
            let dir = if name == "tiny-d64" {
                d64.clone()
            } else {
                fixture(name)
            };
            let path = write_gguf(&dir, ty, &tmp);
            let file = GgufFile::open(&path).unwrap();
            let types: HashMap<String, GgmlType> = file
                .tensors()
                .iter()
                .map(|t| (hf_name(&t.name).unwrap(), t.ty))
                .collect();
            assert!(
                types.values().any(|&t| t == ty) || (ty == GgmlType::Q6K && name != "tiny-d64"),
                "{name} {ty}"
            );
            let config = llama_config(&file).unwrap();
            let gguf = load_gguf(&path, &DenseLoader).unwrap();

            let rounded = RoundedSource::new(&dir, &types);
            let reference =
                Llama::from_source(config, &rounded, &DenseLoader, TensorParallel::whole())
                    .unwrap();
            let prompt = gguf.tokenizer.encode(PROMPT, true).unwrap();
            assert_eq!(
                gguf.model.forward(&prompt).unwrap(),
                reference.forward(&prompt).unwrap(),
                "{name} {ty}: logits differ"
            );
        }
    }
}

#[test]
fn tokenizer_ids_equal_tokenizer_json_on_the_sample_corpus() {
    let tmp = tempfile::tempdir().unwrap();
    let sample = std::fs::read_to_string(fixture("corpus/sample.txt")).unwrap();
    for name in ["random/gqa", "shakespeare-tiny"] {
        let dir = fixture(name);
        let gguf = load_gguf(&write_gguf(&dir, GgmlType::Q8_0, &tmp), &DenseLoader).unwrap();
        let reference = Tokenizer::from_dir(&dir).unwrap();
        for special in [false, true] {
            let ids = gguf.tokenizer.encode(&sample, special).unwrap();
            assert_eq!(ids, reference.encode(&sample, special).unwrap(), "{name}");
            assert_eq!(
                gguf.tokenizer.decode(&ids).unwrap(),
                reference.decode(&ids).unwrap()
            );
        }
    }
}

/// Sets element `index` (row-major) of the F32 tensor `name` of `dir/model.safetensors`.
fn set_weight(dir: &Path, name: &str, index: usize, value: f32) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let (_, dtype, _, data) = tensors.iter_mut().find(|t| t.0 == name).unwrap();
    assert_eq!(*dtype, safetensors::Dtype::F32, "{name}");
    data[4 * index..4 * index + 4].copy_from_slice(&value.to_le_bytes());
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

/// A copy of `name` whose JSON file `file` is changed by `edit`.
fn edited_copy(
    name: &str,
    file: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    let path = tmp.path().join(file);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, json.to_string()).unwrap();
    tmp
}

#[test]
fn metadata_round_trips_as_llama_cpp_names_it() {
    let template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}";
    let dir = edited_copy("random/gqa", "tokenizer_config.json", |j| {
        j["chat_template"] = template.into();
    });
    let converted = convert_hf_dir(dir.path(), GgmlType::Q4_0).unwrap();
    let file = GgufFile::from_bytes("gqa.gguf", converted.writer.to_bytes()).unwrap();
    let c = LlamaConfig::from_dir(dir.path()).unwrap();
    let u = |k: &str| file.get_u64(k).unwrap() as usize;
    assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(
        file.get_u32("general.file_type").unwrap(),
        2,
        "LLAMA_FTYPE_MOSTLY_Q4_0"
    );
    assert_eq!(file.get_u32("general.quantization_version").unwrap(), 2);
    assert!(!file.get_str("general.name").unwrap().is_empty());
    for (key, want) in [
        ("llama.block_count", c.num_hidden_layers),
        ("llama.context_length", c.max_position_embeddings),
        ("llama.embedding_length", c.hidden_size),
        ("llama.feed_forward_length", c.intermediate_size),
        ("llama.attention.head_count", c.num_attention_heads),
        ("llama.attention.head_count_kv", c.num_key_value_heads),
        ("llama.attention.key_length", c.head_dim),
        ("llama.attention.value_length", c.head_dim),
        ("llama.rope.dimension_count", c.head_dim),
        ("llama.vocab_size", c.vocab_size),
    ] {
        assert_eq!(u(key), want, "{key}");
    }
    assert_eq!(
        file.get_f32("llama.rope.freq_base").unwrap(),
        c.rope_theta as f32
    );
    assert_eq!(
        file.get_f32("llama.attention.layer_norm_rms_epsilon")
            .unwrap(),
        c.rms_norm_eps as f32
    );
    assert_eq!(file.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(file.get_str("tokenizer.ggml.pre").unwrap(), "gpt-2");
    assert_eq!(
        file.get_array("tokenizer.ggml.tokens").unwrap().len(),
        c.vocab_size
    );
    let types = file.get_i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(&types[..3], [3, 3, 1], "<s> and </s> are control tokens");
    assert_eq!(u("tokenizer.ggml.bos_token_id"), 0);
    assert_eq!(u("tokenizer.ggml.eos_token_id"), 1);
    assert!(file.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert!(!file.get_bool("tokenizer.ggml.add_eos_token").unwrap());
    assert_eq!(file.get_str("tokenizer.chat_template").unwrap(), template);
    assert_eq!(llama_config(&file).unwrap(), c);

    // Tensor types: norms f32, projections Q4_0, the tied embedding by llama.cpp's output rule
    // (Q6_K, whose 256-blocks do not divide 64: Q8_0).
    for t in file.tensors() {
        let want = match t.name.as_str() {
            n if n.ends_with("norm.weight") => GgmlType::F32,
            "token_embd.weight" => GgmlType::Q8_0,
            _ => GgmlType::Q4_0,
        };
        assert_eq!(t.ty, want, "{}", t.name);
    }
    let report = &converted.report;
    assert_eq!(report.tensors.len(), file.tensors().len());
    assert_eq!(report.fallbacks().count(), 0);
    assert!(
        report
            .tensors
            .iter()
            .any(|t| t.role == TensorRole::Embedding { tied: true })
    );
    let bpw = report.bits_per_weight();
    assert!(bpw > 4.5 && bpw < 8.5, "{bpw}");

    // A float file has no quantization version; F16 is file type 1.
    let f16 = convert_hf_dir(dir.path(), GgmlType::F16).unwrap();
    let file = GgufFile::from_bytes("f16.gguf", f16.writer.to_bytes()).unwrap();
    assert_eq!(file.get_u32("general.file_type").unwrap(), 1);
    assert!(!file.contains_key("general.quantization_version"));

    // K-quants: 64-wide rows are not whole 256-blocks, so every projection falls back.
    let q4k = convert_hf_dir(dir.path(), GgmlType::Q4K).unwrap().report;
    assert!(q4k.fallbacks().count() > 0);
    assert!(q4k.fallbacks().all(|t| t.ty != GgmlType::Q4K));
}

#[test]
fn bad_checkpoints_and_types_are_clear_errors() {
    let err = |dir: &Path, ty| {
        convert_hf_dir(dir, ty)
            .err()
            .expect("should fail")
            .to_string()
    };

    let e = err(&fixture("random/llama3-rope"), GgmlType::Q8_0);
    assert!(e.contains("llama3") && e.contains("rope_freqs"), "{e}");
    let e = err(Path::new("/nonexistent/model"), GgmlType::Q8_0);
    assert!(e.contains("/nonexistent/model/config.json"), "{e}");
    let e = convert_hf_dir(&fixture("random/gqa"), GgmlType::Q2K)
        .err()
        .unwrap();
    assert!(
        matches!(e, ConvertError::UnsupportedType(GgmlType::Q2K)),
        "{e}"
    );

    // The config disagrees with the weights: the tensor is named.
    let dir = edited_copy("random/gqa", "config.json", |j| {
        j["intermediate_size"] = 128.into()
    });
    let e = err(dir.path(), GgmlType::Q8_0);
    assert!(
        e.contains("mlp.gate_proj.weight") && e.contains("[128, 64]"),
        "{e}"
    );

    // A tokenizer GGUF cannot describe, or one kiln cannot reproduce.
    let dir = edited_copy("random/gqa", "tokenizer.json", |j| {
        j["model"]["type"] = "Unigram".into()
    });
    let e = err(dir.path(), GgmlType::Q8_0);
    assert!(e.contains("tokenizer") && e.contains("Unigram"), "{e}");
    let dir = edited_copy("random/gqa", "tokenizer.json", |j| {
        j["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"});
    });
    let e = err(dir.path(), GgmlType::Q8_0);
    assert!(
        e.contains("pre-tokenizer") && e.contains("Whitespace"),
        "{e}"
    );
    let dir = edited_copy("random/gqa", "tokenizer_config.json", |j| {
        j["eos_token"] = "<nope>".into()
    });
    let e = err(dir.path(), GgmlType::Q8_0);
    assert!(e.contains("eos_token \"<nope>\""), "{e}");
    let dir = edited_copy("random/gqa", "config.json", |_| {});
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let e = err(dir.path(), GgmlType::Q8_0);
    assert!(e.contains("tokenizer.json"), "{e}");

    // A NaN or ∞ weight, or one too large for the type's f16 scales, is an error naming the
    // tensor (it once became code 0, or an infinite scale, in a file that loaded fine).
    let tensor = "model.layers.1.mlp.down_proj.weight";
    for (bad, ty, says) in [
        (f32::NAN, GgmlType::Q8_0, "NaN"),
        (f32::NEG_INFINITY, GgmlType::Q4_0, "-inf"),
        (1e7, GgmlType::Q8_0, "overflow"),
    ] {
        let dir = edited_copy("random/gqa", "config.json", |_| {});
        set_weight(dir.path(), tensor, 5, bad);
        let e = convert_hf_dir(dir.path(), ty).err().expect("should fail");
        assert!(matches!(e, ConvertError::Encode { .. }), "{e}");
        let e = e.to_string();
        assert!(e.contains(tensor) && e.contains(says), "{ty} {bad}: {e}");
    }

    // Nothing is left behind when writing fails.
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("missing-dir").join("m.gguf");
    assert!(quantize_hf_dir(&fixture("random/gqa"), GgmlType::Q8_0, &target).is_err());
    assert!(!target.exists());
}

/// llama.cpp's converter permutes a llama q/k bias like the rows of its weight; the reader
/// undoes both.
#[test]
fn llama_q_and_k_biases_are_unpermuted_by_the_reader() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("llama.attention.head_count", 2u32).unwrap();
    w.add_metadata("llama.attention.head_count_kv", 1u32)
        .unwrap();
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::strings(["a"]))
        .unwrap();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let q: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let k: Vec<f32> = (0..4).map(|i| 10.0 + i as f32).collect();
    w.add_tensor(
        "blk.0.attn_q.bias",
        GgmlType::F32,
        &[8],
        permute_qk(&f32_bytes(&q), 8, 2).unwrap(),
    )
    .unwrap();
    w.add_tensor(
        "blk.0.attn_k.bias",
        GgmlType::F32,
        &[4],
        permute_qk(&f32_bytes(&k), 4, 1).unwrap(),
    )
    .unwrap();
    let file = GgufFile::from_bytes("bias.gguf", w.to_bytes()).unwrap();
    assert_ne!(
        file.tensor("blk.0.attn_q.bias").unwrap().1,
        &f32_bytes(&q)[..],
        "permuted"
    );
    let source = GgufSource::new(file).unwrap();
    assert_eq!(
        source
            .get("model.layers.0.self_attn.q_proj.bias", &[8])
            .unwrap(),
        q
    );
    assert_eq!(
        source
            .get("model.layers.0.self_attn.k_proj.bias", &[4])
            .unwrap(),
        k
    );
}

/// A side file that is not JSON is named with what it belongs to: the two tokenizer files are
/// tokenizer errors, `generation_config.json` a config error.
#[test]
fn side_files_that_are_not_json_are_named_by_what_they_belong_to() {
    for (file, tokenizer) in [
        ("tokenizer_config.json", true),
        ("generation_config.json", false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(fixture("random/gqa")).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
        std::fs::write(dir.path().join(file), "{ not json").unwrap();
        let target = dir.path().join("m.gguf");
        let e = quantize_hf_dir(dir.path(), GgmlType::Q8_0, &target).unwrap_err();
        assert_eq!(
            matches!(e, ConvertError::Tokenizer { .. }),
            tokenizer,
            "{e}"
        );
        let e = e.to_string();
        assert!(e.contains(file) && e.contains("not valid JSON"), "{e}");
        if !tokenizer {
            assert!(e.starts_with("invalid config"), "{e}");
        }
        assert!(!target.exists());
    }
}
