//! `config.json` → [`LlamaConfig`].
//!
//! Hugging Face configs come in two RoPE styles, and kiln reads both:
//! - the hub style: top-level `rope_theta` and an optional `rope_scaling` object;
//! - the newer style written by recent transformers: a `rope_parameters` object that holds
//!   `rope_theta` together with the scaling fields.
//!
//! Unknown fields are ignored (configs carry many that inference does not need); a missing
//! required field is an error that names it. `head_dim` is read when present and only
//! defaults to `hidden_size / num_attention_heads` when absent.
//!
//! Mistral's `sliding_window` (transformers applies it whenever it is not null) is honoured by
//! clamping the context: `max_position_embeddings` becomes `min(max_position_embeddings,
//! sliding_window)`. That is exact, not an approximation: for sequences no longer than the
//! window, the sliding-window mask is the causal mask. Qwen2's window only applies with
//! `use_sliding_window`, which is refused.
//!
//! Numbers are checked as the forward pass uses them, in f32: `rms_norm_eps` must stay above
//! zero, and every RoPE frequency (after `rope_theta` and the scaling) finite and above zero.
//! Special token ids (`bos_token_id`, `eos_token_id`) must lie inside `vocab_size`.

use std::path::Path;

use serde::Deserialize;

use crate::attention::AttentionShape;
use crate::error::{Error, Result};
use crate::rope::Rope;

/// The longest context a config may declare (2^24 positions).
pub const MAX_CONTEXT: usize = 1 << 24;
/// How RoPE frequencies are adjusted for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = theta^(-2i/head_dim)`.
    Default,
    /// Positions divided by `factor` (all frequencies divided by `factor`).
    Linear { factor: f64 },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

/// The architecture facts the forward pass needs. Invariants (checked by [`LlamaConfig::from_json`]):
/// `num_attention_heads % num_key_value_heads == 0`, `head_dim` is even, every size is non-zero,
/// `rms_norm_eps` and every RoPE frequency are finite and above zero in f32, and the special
/// token ids are below `vocab_size`. `max_position_embeddings` is the usable context: a Mistral
/// `sliding_window` below the declared context has already replaced it.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2 always; Llama when `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama `attention_bias`).
    pub o_bias: bool,
    /// Bias on gate/up/down projections (Llama `mlp_bias`).
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// `eos_token_id` is an integer or a list of integers.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn ids(&self) -> &[u32] {
        match self {
            TokenIds::One(id) => std::slice::from_ref(id),
            TokenIds::Many(ids) => ids,
        }
    }

    fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![id],
            TokenIds::Many(ids) => ids,
        }
    }
}

/// The RoPE object of either style. `type` is the older spelling of `rope_type`.
#[derive(Debug, Default, Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    hidden_act: Option<String>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
}

impl LlamaConfig {
    /// The whole model's attention shape (a tensor-parallel rank's layers hold fewer heads:
    /// see `SelfAttention::shape`).
    pub fn attention_shape(&self) -> AttentionShape {
        AttentionShape {
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
        }
    }

    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        Self::from_json(&text, &path)
    }

    /// SmolLM2-135M-Instruct's architecture, the fields of its `config.json` that kiln reads:
    /// 30 layers of 9 query heads sharing 3 KV heads of 64, hidden size 576. For examples and
    /// tests that need the model's shapes (a KV pool's, attention's) without its weights.
    pub fn smollm2_135m() -> LlamaConfig {
        let json = r#"{
            "model_type": "llama", "hidden_act": "silu", "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": true,
            "attention_bias": false, "mlp_bias": false, "vocab_size": 49152,
            "bos_token_id": 1, "eos_token_id": 2
        }"#;
        Self::from_json(json, Path::new("SmolLM2-135M-Instruct/config.json"))
            .expect("SmolLM2-135M's config is valid")
    }

    /// Parses a config; `path` is only used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let bad = |message: String| Error::Config {
            path: path.to_path_buf(),
            message,
        };
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;

        let model_type = raw.model_type.unwrap_or_else(|| "llama".to_string());
        let (is_qwen2, is_mistral) = match model_type.as_str() {
            "llama" => (false, false),
            "mistral" => (false, true),
            "qwen2" => (true, false),
            other => {
                return Err(bad(format!(
                    "model_type `{other}` is not supported (expected llama, mistral or qwen2)"
                )));
            }
        };
        if let Some(act) = raw.hidden_act.as_deref()
            && act != "silu"
        {
            return Err(bad(format!(
                "hidden_act `{act}` is not supported (expected silu)"
            )));
        }
        if raw.use_sliding_window == Some(true) {
            return Err(bad("sliding-window attention is not supported".to_string()));
        }

        let num_key_value_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        // ANCHOR: head_dim
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.num_attention_heads > 0 => raw.hidden_size / raw.num_attention_heads,
            None => 0,
        };
        // ANCHOR_END: head_dim
        for (name, value) in [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("num_key_value_heads", num_key_value_heads),
            ("head_dim", head_dim),
            ("max_position_embeddings", raw.max_position_embeddings),
        ] {
            if value == 0 {
                return Err(bad(format!("{name} must be positive")));
            }
        }
        // Counts far past any model's (the largest Llamas have 126 layers, 128 heads, hidden
        // size 16,384, 256k-token vocabularies): a corrupt count would otherwise size
        // allocations, or overflow a product of two, before any tensor is read.
        for (name, value, max) in [
            ("vocab_size", raw.vocab_size, 1 << 24),
            ("hidden_size", raw.hidden_size, 1 << 20),
            ("intermediate_size", raw.intermediate_size, 1 << 22),
            ("num_hidden_layers", raw.num_hidden_layers, 1 << 12),
            ("num_attention_heads", raw.num_attention_heads, 1 << 12),
            ("head_dim", head_dim, 1 << 12),
        ] {
            if value > max {
                return Err(bad(format!("{name} ({value}) is more than {max}")));
            }
        }
        // Buffers are sized from the context (a sequence's cache, attention scores): a bound
        // keeps a config's typo from becoming a terabyte allocation. Llama 4 Scout's 10M fits.
        if raw.max_position_embeddings > MAX_CONTEXT {
            return Err(bad(format!(
                "max_position_embeddings ({}) is more than {MAX_CONTEXT} positions",
                raw.max_position_embeddings
            )));
        }
        if !raw.num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(bad(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({num_key_value_heads})",
                raw.num_attention_heads
            )));
        }
        if head_dim % 2 != 0 {
            return Err(bad(format!("head_dim ({head_dim}) must be even for RoPE")));
        }
        // The norm adds eps in f32: 1e-50 would round to zero (a zero row divides by zero), and
        // 1e300 to infinity (every row zero).
        let eps = raw.rms_norm_eps as f32;
        if !(eps.is_finite() && eps > 0.0) {
            return Err(bad(format!(
                "rms_norm_eps ({:e}) must be a positive number that f32 holds (it is {eps} in f32)",
                raw.rms_norm_eps
            )));
        }
        // ANCHOR: sliding_window
        // transformers' Mistral masks keys `sliding_window` or more positions back whenever
        // the field is not null. Within the window that mask is the causal one, so holding the
        // context to the window gives exactly its results; past it kiln would silently differ.
        let mut max_position_embeddings = raw.max_position_embeddings;
        if is_mistral && let Some(window) = raw.sliding_window {
            if window == 0 {
                return Err(bad("sliding_window must be positive".to_string()));
            }
            max_position_embeddings = max_position_embeddings.min(window);
        }
        // ANCHOR_END: sliding_window
        for (key, id) in raw
            .bos_token_id
            .iter()
            .map(|&id| ("bos_token_id", id))
            .chain(
                raw.eos_token_id
                    .iter()
                    .flat_map(|ids| ids.ids().iter().map(|&id| ("eos_token_id", id))),
            )
        {
            check_token_id(key, id, raw.vocab_size).map_err(bad)?;
        }

        // ANCHOR: rope_styles
        // The newer `rope_parameters` wins over the hub-style fields when both are present.
        let rope = raw.rope_parameters.or(raw.rope_scaling).unwrap_or_default();
        let rope_theta = rope.rope_theta.or(raw.rope_theta).unwrap_or(10_000.0);
        if rope_theta.is_nan() || rope_theta <= 0.0 {
            return Err(bad("rope_theta must be positive".to_string()));
        }
        let rope_scaling = parse_rope_scaling(&rope).map_err(bad)?;
        // ANCHOR_END: rope_styles
        // The rotation angles are computed in f32: a frequency that overflows (a theta or a
        // factor far below 1) or underflows to zero there is refused, naming the field at fault.
        check_frequencies(head_dim, rope_theta, &RopeScaling::Default, "rope_theta")
            .map_err(bad)?;
        check_frequencies(head_dim, rope_theta, &rope_scaling, "rope scaling `factor`")
            .map_err(bad)?;

        let attention_bias = raw.attention_bias.unwrap_or(false);
        Ok(LlamaConfig {
            model_type,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: is_qwen2 || attention_bias,
            o_bias: !is_qwen2 && attention_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            bos_token_id: raw.bos_token_id,
            eos_token_ids: raw.eos_token_id.map(TokenIds::into_vec).unwrap_or_default(),
        })
    }

    /// Query heads that share one key/value head (1 for MHA).
    pub fn num_queries_per_kv(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

/// Refuses special token `key`'s `id` when the model's embedding has no such row: the model
/// could never emit it (a stop token that never stops, on which the server's grammar engine
/// asserts) nor read it (a BOS: every prompt's first token out of range). Such an id means the
/// files of a checkpoint disagree; `Err` holds the message, for the caller to name the file.
pub fn check_token_id(key: &str, id: u32, vocab_size: usize) -> std::result::Result<(), String> {
    if (id as usize) < vocab_size {
        Ok(())
    } else {
        Err(format!(
            "{key} {id} is outside the model's vocabulary of {vocab_size} tokens (vocab_size)"
        ))
    }
}

/// Refuses RoPE frequencies that are not finite and above zero once cast to f32, as the
/// rotation uses them; `field` names the key whose value is at fault.
fn check_frequencies(
    head_dim: usize,
    theta: f64,
    scaling: &RopeScaling,
    field: &str,
) -> std::result::Result<(), String> {
    let rope = Rope::new(head_dim, theta, scaling);
    match rope.inv_freq().iter().find(|&&f| {
        let f = f as f32;
        !(f.is_finite() && f > 0.0)
    }) {
        None => Ok(()),
        Some(f) => Err(format!(
            "{field} gives a RoPE frequency of {f:e}, {} in f32 (rope_theta {theta:e}, \
             {scaling:?}): every frequency must be a finite number above zero in f32",
            *f as f32
        )),
    }
}

/// `value` of rope scaling field `name` if it is a finite number above zero (a factor of zero
/// divides a frequency by zero: every rotation NaN).
fn positive(name: &str, value: f64) -> std::result::Result<f64, String> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(format!(
            "rope scaling `{name}` must be a finite number above zero, got {value}"
        ))
    }
}

fn parse_rope_scaling(rope: &RawRope) -> std::result::Result<RopeScaling, String> {
    let kind = rope
        .rope_type
        .as_deref()
        .or(rope.legacy_type.as_deref())
        .unwrap_or("default");
    let field = |name: &str, value: Option<f64>| {
        value.ok_or_else(|| format!("rope scaling `{kind}` needs `{name}`"))
    };
    match kind {
        "default" => Ok(RopeScaling::Default),
        "linear" => Ok(RopeScaling::Linear {
            factor: positive("factor", field("factor", rope.factor)?)?,
        }),
        "llama3" => {
            let low_freq_factor = positive(
                "low_freq_factor",
                field("low_freq_factor", rope.low_freq_factor)?,
            )?;
            let high_freq_factor = positive(
                "high_freq_factor",
                field("high_freq_factor", rope.high_freq_factor)?,
            )?;
            // The wavelengths between the two bands are blended by (high − low): they must
            // differ, high above low.
            if high_freq_factor <= low_freq_factor {
                return Err(format!(
                    "rope scaling `{kind}`: high_freq_factor ({high_freq_factor}) must be more \
                     than low_freq_factor ({low_freq_factor})"
                ));
            }
            let original = rope.original_max_position_embeddings.ok_or_else(|| {
                format!("rope scaling `{kind}` needs `original_max_position_embeddings`")
            })?;
            if original == 0 {
                return Err(format!(
                    "rope scaling `{kind}`: original_max_position_embeddings must be positive"
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: positive("factor", field("factor", rope.factor)?)?,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: original,
            })
        }
        other => Err(format!(
            "rope scaling `{other}` is not supported (expected default, linear or llama3)"
        )),
    }
}

/// The stop token ids a model declares: `generation_config.json`'s `eos_token_id` when that file
/// exists (it is what `transformers`' `generate` uses), else `config.json`'s.
pub fn eos_token_ids(dir: &Path, config: &LlamaConfig) -> Result<Vec<u32>> {
    #[derive(Deserialize)]
    struct GenerationConfig {
        eos_token_id: Option<TokenIds>,
    }
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(config.eos_token_ids.clone());
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let bad = |message: String| Error::Config {
        path: path.clone(),
        message,
    };
    let generation: GenerationConfig =
        serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let Some(ids) = generation.eos_token_id else {
        return Ok(config.eos_token_ids.clone());
    };
    for &id in ids.ids() {
        check_token_id("eos_token_id", id, config.vocab_size).map_err(bad)?;
    }
    Ok(ids.into_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_135m_is_the_checkpoints_config() {
        let config = LlamaConfig::smollm2_135m();
        let shape = config.attention_shape();
        assert_eq!(
            (shape.num_heads, shape.num_kv_heads, shape.head_dim),
            (9, 3, 64)
        );
        assert_eq!((config.hidden_size, config.num_hidden_layers), (576, 30));
        // Where the checkpoint has been fetched (`just fetch-smollm2`, as CI does): its own file.
        let dir = crate::fixtures_dir().join(".cache/SmolLM2-135M-Instruct");
        if dir.join("config.json").exists() {
            assert_eq!(LlamaConfig::from_dir(&dir).unwrap(), config);
        }
    }
}
