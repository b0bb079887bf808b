//! Test helpers: a small Hugging Face → GGUF converter (what llama.cpp's converter does for
//! the Llama and Qwen2 architectures, for the committed random checkpoints), and a Q8_0 encoder.
#![allow(dead_code)]

use std::path::Path;

use ch01::config::RopeScaling;
use ch01::{LlamaConfig, TensorDtype, WeightSource, Weights};
use ch05_quantization::GgmlType;
use ch05_quantization::gguf::{GgufValue, GgufWriter, gguf_name};
use serde_json::Value;

/// Round-to-nearest Q8_0 of `values` (a whole number of 32-element blocks).
pub fn encode_q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks_exact(32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|v| (v * inv).round() as i8 as u8));
    }
    out
}

/// Hugging Face row order → the file's, for q/k of the llama architecture: file row
/// `h·d + 2i + half` holds Hugging Face row `h·d + half·d/2 + i`.
pub fn permute_rows(bytes: &[u8], rows: usize, n_head: usize) -> Vec<u8> {
    let row_bytes = bytes.len() / rows;
    let d = rows / n_head;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..n_head {
        for half in 0..2 {
            for i in 0..d / 2 {
                let (file, hf) = (h * d + 2 * i + half, h * d + half * (d / 2) + i);
                out[file * row_bytes..(file + 1) * row_bytes]
                    .copy_from_slice(&bytes[hf * row_bytes..(hf + 1) * row_bytes]);
            }
        }
    }
    out
}

/// Every tensor name of a Llama checkpoint with this config.
pub fn hf_tensor_names(c: &LlamaConfig, source: &dyn WeightSource) -> Vec<String> {
    let mut names = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".to_string(),
    ];
    if source.contains("lm_head.weight") {
        names.push("lm_head.weight".to_string());
    }
    for i in 0..c.num_hidden_layers {
        for part in [
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            for suffix in ["weight", "bias"] {
                let name = format!("model.layers.{i}.{part}.{suffix}");
                if source.contains(&name) {
                    names.push(name);
                }
            }
        }
    }
    names
}

/// The GGUF file of the Hugging Face directory `dir`: config and tokenizer metadata, every
/// tensor in its own float type, or (2-D weights whose rows are whole blocks) in `quantize`.
pub fn hf_dir_to_gguf(dir: &Path, quantize: Option<GgmlType>) -> GgufWriter<'static> {
    let c = LlamaConfig::from_dir(dir).unwrap();
    let weights = Weights::open(dir).unwrap();
    let arch = c.model_type.as_str();
    let arch = if arch == "qwen2" { "qwen2" } else { "llama" };
    let mut w = GgufWriter::new();
    let key = |k: &str| format!("{arch}.{k}");
    w.add_metadata("general.architecture", arch).unwrap();
    w.add_metadata("general.name", dir.file_name().unwrap().to_str().unwrap())
        .unwrap();
    w.add_metadata(key("block_count"), c.num_hidden_layers as u32)
        .unwrap();
    w.add_metadata(key("context_length"), c.max_position_embeddings as u32)
        .unwrap();
    w.add_metadata(key("embedding_length"), c.hidden_size as u32)
        .unwrap();
    w.add_metadata(key("feed_forward_length"), c.intermediate_size as u32)
        .unwrap();
    w.add_metadata(key("attention.head_count"), c.num_attention_heads as u32)
        .unwrap();
    w.add_metadata(key("attention.head_count_kv"), c.num_key_value_heads as u32)
        .unwrap();
    w.add_metadata(key("attention.key_length"), c.head_dim as u32)
        .unwrap();
    w.add_metadata(key("attention.value_length"), c.head_dim as u32)
        .unwrap();
    w.add_metadata(key("rope.dimension_count"), c.head_dim as u32)
        .unwrap();
    w.add_metadata(key("rope.freq_base"), c.rope_theta as f32)
        .unwrap();
    w.add_metadata(
        key("attention.layer_norm_rms_epsilon"),
        c.rms_norm_eps as f32,
    )
    .unwrap();
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Default,
        "only default RoPE here"
    );
    add_tokenizer(&mut w, dir);

    for name in hf_tensor_names(&c, &weights) {
        let raw = weights.tensor(&name).unwrap();
        let shape = raw.shape().to_vec();
        let (mut ty, mut bytes) = match raw.dtype() {
            TensorDtype::F32 => (GgmlType::F32, raw.bytes().to_vec()),
            TensorDtype::BF16 => (GgmlType::BF16, raw.bytes().to_vec()),
            TensorDtype::F16 => (GgmlType::F16, raw.bytes().to_vec()),
            other => panic!("{name}: {other}"),
        };
        if let Some(q) = quantize
            && shape.len() == 2
            && q.row_bytes(shape[1]).is_some()
        {
            assert_eq!(q, GgmlType::Q8_0, "the tests encode Q8_0 only");
            let values = raw.to_f32(&name).unwrap();
            (ty, bytes) = (q, encode_q8_0(&values));
        }
        if arch == "llama" {
            if name.ends_with("q_proj.weight") {
                bytes = permute_rows(&bytes, shape[0], c.num_attention_heads);
            } else if name.ends_with("k_proj.weight") {
                bytes = permute_rows(&bytes, shape[0], c.num_key_value_heads);
            }
        }
        w.add_tensor(gguf_name(&name).unwrap(), ty, &shape, bytes)
            .unwrap();
    }
    w
}

/// `tokenizer.ggml.*` from `dir/tokenizer.json` (byte-level BPE) and `tokenizer_config.json`.
pub fn add_tokenizer(w: &mut GgufWriter<'_>, dir: &Path) {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let model = &json["model"];
    assert_eq!(model["type"], "BPE");
    let vocab = model["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (token, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = token.clone();
    }
    let mut types = vec![1i32; tokens.len()];
    for added in json["added_tokens"].as_array().unwrap() {
        let id = added["id"].as_u64().unwrap() as usize;
        assert_eq!(tokens[id], added["content"].as_str().unwrap());
        if added["special"].as_bool().unwrap() {
            types[id] = 3;
        }
    }
    let merges: Vec<String> = model["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => s.clone(),
            Value::Array(pair) => format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            ),
            other => panic!("merge {other}"),
        })
        .collect();
    let adds_bos = json["post_processor"]["type"] == "TemplateProcessing";
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    let id_of = |key: &str| {
        let token = config[key]
            .as_str()
            .or_else(|| config[key]["content"].as_str())
            .unwrap();
        tokens.iter().position(|t| t == token).unwrap() as u32
    };
    w.add_metadata("tokenizer.ggml.model", "gpt2").unwrap();
    w.add_metadata("tokenizer.ggml.pre", "gpt2").unwrap();
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::strings(tokens.clone()))
        .unwrap();
    w.add_metadata("tokenizer.ggml.token_type", GgufValue::array(types))
        .unwrap();
    w.add_metadata("tokenizer.ggml.merges", GgufValue::strings(merges))
        .unwrap();
    w.add_metadata("tokenizer.ggml.bos_token_id", id_of("bos_token"))
        .unwrap();
    w.add_metadata("tokenizer.ggml.eos_token_id", id_of("eos_token"))
        .unwrap();
    w.add_metadata("tokenizer.ggml.add_bos_token", adds_bos)
        .unwrap();
    w.add_metadata("tokenizer.chat_template", "{{ messages }}")
        .unwrap();
}
