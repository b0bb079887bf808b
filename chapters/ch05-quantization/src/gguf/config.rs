//! GGUF metadata → [`LlamaConfig`].
//!
//! llama.cpp's GGUF format keeps the architecture facts under `{arch}.*` keys, where `arch` is
//! `general.architecture`:
//!
//! ```text
//! GGUF key                                 Hugging Face config field
//! {arch}.block_count                       num_hidden_layers
//! {arch}.embedding_length                  hidden_size
//! {arch}.feed_forward_length               intermediate_size
//! {arch}.attention.head_count              num_attention_heads
//! {arch}.attention.head_count_kv           num_key_value_heads (default: head_count)
//! {arch}.attention.key_length              head_dim (default: embedding_length / head_count)
//! {arch}.attention.layer_norm_rms_epsilon  rms_norm_eps
//! {arch}.rope.freq_base                    rope_theta (default 10000)
//! {arch}.rope.scaling.type / .factor       rope_scaling (none or linear)
//! {arch}.context_length                    max_position_embeddings
//! token_embd.weight rows                   vocab_size
//! no output.weight tensor                  tie_word_embeddings
//! tokenizer.ggml.bos/eos_token_id          bos_token_id / eos_token_id
//! ```
//!
//! The config is assembled as the Hugging Face `config.json` it stands for and parsed by
//! [`LlamaConfig::from_json`], so a GGUF model is held to exactly the same checks (head counts
//! that divide, an even head dimension, positive sizes) as a safetensors one. A missing key or
//! one of the wrong type is an error naming the GGUF key.

use ch01::LlamaConfig;
use serde_json::{Value, json};

use super::error::{GgufError, GgufResult};
use super::file::GgufFile;

/// The architectures kiln can build from a GGUF file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArch {
    /// Llama (and Mistral, which llama.cpp files as `llama`): q/k rows permuted for
    /// llama.cpp's interleaved RoPE.
    Llama,
    /// Qwen2: bias on q/k/v; rows not permuted (llama.cpp runs it with rotate-half RoPE).
    Qwen2,
}

impl GgufArch {
    /// `general.architecture`, checked.
    pub fn of(file: &GgufFile) -> GgufResult<GgufArch> {
        match file.get_str("general.architecture")? {
            "llama" => Ok(GgufArch::Llama),
            "qwen2" => Ok(GgufArch::Qwen2),
            other => Err(GgufError::Unsupported {
                path: file.path().to_path_buf(),
                message: format!(
                    "general.architecture `{other}` is not supported (expected llama or qwen2)"
                ),
            }),
        }
    }

    /// The prefix of the architecture keys, and the Hugging Face `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            GgufArch::Llama => "llama",
            GgufArch::Qwen2 => "qwen2",
        }
    }

    /// Whether llama.cpp's converter permuted the rows of q and k (see `source.rs`).
    pub fn permutes_qk(self) -> bool {
        self == GgufArch::Llama
    }
}

/// The model's config, from the metadata and the tensor directory.
pub fn llama_config(file: &GgufFile) -> GgufResult<LlamaConfig> {
    let arch = GgufArch::of(file)?;
    let key = |k: &str| format!("{}.{k}", arch.name());
    let unsupported = |message: String| GgufError::Unsupported {
        path: file.path().to_path_buf(),
        message,
    };

    let hidden = file.get_usize(&key("embedding_length"))?;
    let heads = file.get_usize(&key("attention.head_count"))?;
    let kv_heads = file
        .opt_usize(&key("attention.head_count_kv"))?
        .unwrap_or(heads);
    let head_dim = match file.opt_usize(&key("attention.key_length"))? {
        Some(d) => d,
        None => hidden.checked_div(heads).unwrap_or(0),
    };
    if let Some(v) = file.opt_usize(&key("attention.value_length"))?
        && v != head_dim
    {
        return Err(unsupported(format!(
            "{} ({v}) differs from the key length ({head_dim})",
            key("attention.value_length")
        )));
    }
    if let Some(rope_dim) = file.opt_usize(&key("rope.dimension_count"))?
        && rope_dim != head_dim
    {
        return Err(unsupported(format!(
            "{} ({rope_dim}) differs from the head dimension ({head_dim}): partial rotary \
             embeddings are not supported",
            key("rope.dimension_count")
        )));
    }
    if file.tensor_info("rope_freqs.weight").is_some() {
        return Err(unsupported(
            "tensor rope_freqs.weight (per-frequency RoPE factors, as Llama 3.1 files carry) is \
             not supported"
                .to_string(),
        ));
    }

    let rope_scaling = match file.opt_str(&key("rope.scaling.type"))? {
        None | Some("none") => match file.opt_f64(&key("rope.scale_linear"))? {
            Some(factor) if factor != 1.0 => {
                let factor = finite(file, &key("rope.scale_linear"), factor)?;
                json!({"rope_type": "linear", "factor": factor})
            }
            _ => Value::Null,
        },
        Some("linear") => {
            let k = key("rope.scaling.factor");
            json!({"rope_type": "linear", "factor": finite(file, &k, file.get_f64(&k)?)?})
        }
        Some(other) => {
            return Err(unsupported(format!(
                "{} `{other}` is not supported (expected none or linear)",
                key("rope.scaling.type")
            )));
        }
    };

    // The rows of the embedding table are the vocabulary.
    let vocab_size = match file.tensor_info("token_embd.weight") {
        Some(t) => match t.shape()[..] {
            [rows, _] => rows,
            ref shape => {
                return Err(unsupported(format!(
                    "tensor token_embd.weight has shape {shape:?} (outermost first): the \
                     embedding table must be a matrix [vocab, hidden]"
                )));
            }
        },
        None => match file.opt_usize(&key("vocab_size"))? {
            Some(n) => n,
            None => file.get_array("tokenizer.ggml.tokens")?.len(),
        },
    };

    let (eps_key, theta_key) = (
        key("attention.layer_norm_rms_epsilon"),
        key("rope.freq_base"),
    );
    let theta = file.opt_f32(&theta_key)?.unwrap_or(10_000.0);
    let config = json!({
        "model_type": arch.name(),
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": file.get_usize(&key("feed_forward_length"))?,
        "num_hidden_layers": file.get_usize(&key("block_count"))?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": file.get_usize(&key("context_length"))?,
        "rms_norm_eps": f32_as_decimal(file, &eps_key, file.get_f32(&eps_key)?)?,
        "rope_theta": f32_as_decimal(file, &theta_key, theta)?,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": file.tensor_info("output.weight").is_none(),
        "attention_bias": arch == GgufArch::Llama && file.tensor_info("blk.0.attn_q.bias").is_some(),
        "mlp_bias": file.tensor_info("blk.0.ffn_up.bias").is_some(),
        "bos_token_id": file.opt_u32("tokenizer.ggml.bos_token_id")?,
        "eos_token_id": file.opt_u32("tokenizer.ggml.eos_token_id")?,
    });
    Ok(LlamaConfig::from_json(&config.to_string(), file.path())?)
}

/// The f64 a Hugging Face config would hold for value `x` of `key`, which GGUF stores as f32:
/// the shortest decimal that reads back as the same f32 (`1e-5`, not `9.99999974738e-06`).
fn f32_as_decimal(file: &GgufFile, key: &str, x: f32) -> GgufResult<f64> {
    let x = finite(file, key, f64::from(x))? as f32;
    Ok(x.to_string().parse().unwrap_or(f64::from(x)))
}

/// `x`, the value of `key`, if finite. JSON has no NaN or infinity (serde_json writes `null`),
/// so a non-finite value would reach the config as absent and take its default.
fn finite(file: &GgufFile, key: &str, x: f64) -> GgufResult<f64> {
    if x.is_finite() {
        Ok(x)
    } else {
        Err(GgufError::WrongType {
            path: file.path().to_path_buf(),
            key: key.to_string(),
            expected: "a finite number".to_string(),
            found: x.to_string(),
        })
    }
}
