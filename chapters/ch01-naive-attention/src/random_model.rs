//! Random-weight checkpoints: a Hugging Face Llama directory that nobody trained, for
//! benchmarks at real sizes (a Llama-3.2-1B shape, without downloading one) and for tests of
//! shapes the fixtures do not have (`head_dim` 64).
//!
//! [`write_random_model`] writes `config.json`, `generation_config.json`, `model.safetensors`
//! and the project's tokenizer (`fixtures/tokenizer`). Invariants:
//!
//! - **It loads.** The `config.json` text is parsed by [`LlamaConfig::from_json`] before any
//!   file is written, so a spec the loader would reject (heads not a multiple of the KV heads,
//!   an odd `head_dim`, a zero size) fails early with the loader's own message.
//! - **Hugging Face's initialisation.** Matrices and the embedding are `N(0, 0.02²)`
//!   (`initializer_range`), norms are all ones, there are no biases; `lm_head.weight` is
//!   written only when the embedding is not tied.
//! - **Deterministic in the seed.** Element `i` of tensor `t` (its index in
//!   [`RandomModelSpec::tensors`]) is a function of `(seed, t, i)` alone: ChaCha8 seeded by
//!   `seed`, stream `t`, the two words at `2⌊i/2⌋` feed one Box–Muller pair. The bytes do not
//!   depend on the number of threads, and a model with fewer layers has the same embedding and
//!   first layers. (Across platforms, `ln`/`sin`/`cos` may round their last bit differently.)
//! - **Memory.** Each tensor is generated straight into its stored bytes (bf16 is never an f32
//!   copy first): the peak is the data of `model.safetensors`, 2.5 GB for [`RandomModelSpec::llama_1b`].
//!
//! The tokenizer has 4096 tokens; with a larger `vocab_size` the ids above it are never
//! produced by `encode` and decode to no text.

use std::collections::HashMap;
use std::path::Path;

use half::bf16;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::json;

use crate::config::LlamaConfig;
use crate::error::{Error, Result};

/// Standard deviation of the random weights: Hugging Face's `initializer_range` for Llama.
pub const INITIALIZER_RANGE: f64 = 0.02;
/// [`INITIALIZER_RANGE`] as the samples are scaled.
pub const INIT_STD: f32 = INITIALIZER_RANGE as f32;

/// The token ids of `<s>` and `</s>` in the project's tokenizer.
const BOS_TOKEN_ID: u32 = 0;
const EOS_TOKEN_ID: u32 = 1;

/// Elements per unit of parallel work. Even, so that every chunk starts a Box–Muller pair.
const CHUNK: usize = 1 << 20;

/// How the weights are stored in `model.safetensors`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RandomDtype {
    F32,
    Bf16,
}

impl RandomDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            RandomDtype::F32 => 4,
            RandomDtype::Bf16 => 2,
        }
    }

    /// The name `config.json` gives it (`dtype` / `torch_dtype`).
    pub fn hf_name(self) -> &'static str {
        match self {
            RandomDtype::F32 => "float32",
            RandomDtype::Bf16 => "bfloat16",
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            RandomDtype::F32 => Dtype::F32,
            RandomDtype::Bf16 => Dtype::BF16,
        }
    }
}

impl std::str::FromStr for RandomDtype {
    type Err = Error;

    /// `f32` or `bf16`.
    fn from_str(text: &str) -> Result<Self> {
        match text {
            "f32" => Ok(RandomDtype::F32),
            "bf16" => Ok(RandomDtype::Bf16),
            other => Err(Error::InvalidArgument(format!(
                "dtype `{other}` is not supported (expected f32 or bf16)"
            ))),
        }
    }
}

/// The shape of a random Llama, and how its weights are drawn and stored.
#[derive(Debug, Clone, PartialEq)]
pub struct RandomModelSpec {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    pub dtype: RandomDtype,
    pub seed: u64,
}

/// How a tensor is filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// `N(0, INIT_STD²)`.
    Normal,
    /// All ones (RMSNorm weights).
    Ones,
}

/// One tensor of the checkpoint: its Hugging Face name, shape and fill.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl TensorSpec {
    fn new(name: String, shape: &[usize], init: Init) -> Self {
        TensorSpec {
            name,
            shape: shape.to_vec(),
            init,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it has no elements (never, for a spec that validates).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl RandomModelSpec {
    /// The presets' names, as `kiln random-model --preset` takes them.
    pub const PRESETS: [&str; 2] = ["llama-1b", "tiny-d64"];

    /// Llama-3.2-1B's shape (1.24B parameters, 2.5 GB in bf16), with plain RoPE and a
    /// context of 8192 rather than its 131072 with llama3 scaling.
    pub fn llama_1b() -> Self {
        RandomModelSpec {
            hidden_size: 2048,
            intermediate_size: 8192,
            num_hidden_layers: 16,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 64,
            vocab_size: 128_256,
            max_position_embeddings: 8192,
            rope_theta: 500_000.0,
            tie_word_embeddings: true,
            dtype: RandomDtype::Bf16,
            seed: 0,
        }
    }

    /// A small GQA model with `head_dim` 64 (the fixtures have 16 and 32), f32, 2.5M
    /// parameters: quick enough for tests.
    pub fn tiny_d64() -> Self {
        RandomModelSpec {
            hidden_size: 256,
            intermediate_size: 512,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 64,
            vocab_size: 4096,
            max_position_embeddings: 512,
            rope_theta: 10_000.0,
            tie_word_embeddings: true,
            dtype: RandomDtype::F32,
            seed: 0,
        }
    }

    /// The preset called `name` (one of [`RandomModelSpec::PRESETS`]).
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "llama-1b" => Ok(Self::llama_1b()),
            "tiny-d64" => Ok(Self::tiny_d64()),
            other => Err(Error::InvalidArgument(format!(
                "unknown preset `{other}` (expected one of {})",
                Self::PRESETS.join(", ")
            ))),
        }
    }

    /// Every tensor in Hugging Face's names and `[out, in]` layout, in the order that numbers
    /// their random streams: the embedding, each layer's nine, the final norm, then the head.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let (d, v, f) = (self.hidden_size, self.vocab_size, self.intermediate_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut tensors = vec![TensorSpec::new(
            "model.embed_tokens.weight".into(),
            &[v, d],
            Init::Normal,
        )];
        for i in 0..self.num_hidden_layers {
            let layer = [
                ("input_layernorm", &[d][..], Init::Ones),
                ("self_attn.q_proj", &[q, d], Init::Normal),
                ("self_attn.k_proj", &[kv, d], Init::Normal),
                ("self_attn.v_proj", &[kv, d], Init::Normal),
                ("self_attn.o_proj", &[d, q], Init::Normal),
                ("post_attention_layernorm", &[d], Init::Ones),
                ("mlp.gate_proj", &[f, d], Init::Normal),
                ("mlp.up_proj", &[f, d], Init::Normal),
                ("mlp.down_proj", &[d, f], Init::Normal),
            ];
            tensors.extend(layer.into_iter().map(|(name, shape, init)| {
                TensorSpec::new(format!("model.layers.{i}.{name}.weight"), shape, init)
            }));
        }
        tensors.push(TensorSpec::new(
            "model.norm.weight".into(),
            &[d],
            Init::Ones,
        ));
        if !self.tie_word_embeddings {
            tensors.push(TensorSpec::new(
                "lm_head.weight".into(),
                &[v, d],
                Init::Normal,
            ));
        }
        tensors
    }

    /// Number of parameters (a tied head counted once).
    pub fn parameter_count(&self) -> usize {
        self.tensors().iter().map(TensorSpec::len).sum()
    }

    /// `config.json`: the fields `transformers` writes for a Llama. RoPE's theta is written in
    /// both styles (`rope_parameters` for transformers 5, top-level `rope_theta` for older
    /// readers), with the same value.
    pub fn config_json(&self) -> serde_json::Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": BOS_TOKEN_ID,
            "dtype": self.dtype.hf_name(),
            "eos_token_id": EOS_TOKEN_ID,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": INITIALIZER_RANGE,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": false,
            "model_type": "llama",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-5,
            "rope_parameters": { "rope_theta": self.rope_theta, "rope_type": "default" },
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype.hf_name(),
            "use_cache": true,
            "vocab_size": self.vocab_size,
        })
    }
}

// ANCHOR: write_random_model
/// Writes the checkpoint `spec` describes into `dir` (created if missing; the five files it
/// writes are replaced, nothing else is touched). Fails before writing anything when the
/// config would not load. `config.json` is written last, so a checkpoint whose writing was cut
/// short has none and is not taken for a whole one.
pub fn write_random_model(spec: &RandomModelSpec, dir: &Path) -> Result<()> {
    let config_path = dir.join("config.json");
    let config_text = pretty(&spec.config_json());
    LlamaConfig::from_json(&config_text, &config_path)?;
    std::fs::create_dir_all(dir).map_err(|e| write_error(dir, e))?;

    let generation = json!({ "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID });
    write_file(
        &dir.join("generation_config.json"),
        pretty(&generation).as_bytes(),
    )?;
    write_tokenizer(spec, dir)?;
    write_weights(spec, &dir.join("model.safetensors"))?;
    write_file(&config_path, config_text.as_bytes())
}
// ANCHOR_END: write_random_model

/// `model.safetensors`: every tensor of [`RandomModelSpec::tensors`], generated in parallel.
fn write_weights(spec: &RandomModelSpec, path: &Path) -> Result<()> {
    let tensors = spec.tensors();
    let buffers = generate(&tensors, spec.dtype, spec.seed);
    let views = tensors
        .iter()
        .zip(&buffers)
        .map(|(t, bytes)| {
            let view = TensorView::new(spec.dtype.safetensors(), t.shape.clone(), bytes)
                .map_err(|e| write_error(path, std::io::Error::other(e.to_string())))?;
            Ok((t.name.as_str(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    // One entry only: safetensors writes the map in `HashMap` order, which varies per run.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(error) => write_error(path, error),
        other => write_error(path, std::io::Error::other(other.to_string())),
    })
}

/// The project's tokenizer (`fixtures/tokenizer`), its `model_max_length` set to the model's
/// context.
fn write_tokenizer(spec: &RandomModelSpec, dir: &Path) -> Result<()> {
    let source = crate::fixtures_dir().join("tokenizer");
    let read = |name: &str| {
        let path = source.join(name);
        std::fs::read(&path).map_err(|e| Error::io(&path, e))
    };
    write_file(&dir.join("tokenizer.json"), &read("tokenizer.json")?)?;

    let config_path = source.join("tokenizer_config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&read("tokenizer_config.json")?)
        .map_err(|e| Error::Tokenizer {
            path: config_path,
            message: e.to_string(),
        })?;
    config["model_max_length"] = json!(spec.max_position_embeddings);
    write_file(
        &dir.join("tokenizer_config.json"),
        pretty(&config).as_bytes(),
    )
}

/// One unit of work: elements `first..first + n` of tensor `stream`, as stored bytes.
struct Chunk<'a> {
    stream: u64,
    first: usize,
    init: Init,
    bytes: &'a mut [u8],
}

/// The stored bytes of every tensor (`[tensors.len()]` buffers of `len × dtype.size()` bytes),
/// filled by one thread per CPU taking [`CHUNK`]-element pieces round-robin.
fn generate(tensors: &[TensorSpec], dtype: RandomDtype, seed: u64) -> Vec<Vec<u8>> {
    let mut buffers: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| vec![0; t.len() * dtype.size()])
        .collect();
    let chunks =
        tensors
            .iter()
            .zip(&mut buffers)
            .enumerate()
            .flat_map(|(stream, (tensor, buffer))| {
                buffer
                    .chunks_mut(CHUNK * dtype.size())
                    .enumerate()
                    .map(move |(c, bytes)| Chunk {
                        stream: stream as u64,
                        first: c * CHUNK,
                        init: tensor.init,
                        bytes,
                    })
            });
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut work: Vec<Vec<Chunk>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, chunk) in chunks.enumerate() {
        work[i % threads].push(chunk);
    }
    std::thread::scope(|scope| {
        for chunks in work {
            scope.spawn(move || chunks.into_iter().for_each(|c| fill(c, dtype, seed)));
        }
    });
    buffers
}

/// Fills one chunk: its elements as [`Init`] says, encoded as `dtype`.
fn fill(chunk: Chunk, dtype: RandomDtype, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(chunk.stream);
    // Element i's pair starts at word 2⌊i/2⌋, which is `first` itself (chunks start even).
    rng.set_word_pos(chunk.first as u128);
    match (chunk.init, dtype) {
        (Init::Ones, RandomDtype::F32) => fill_ones(chunk.bytes, 1f32.to_le_bytes()),
        (Init::Ones, RandomDtype::Bf16) => fill_ones(chunk.bytes, bf16::ONE.to_le_bytes()),
        (Init::Normal, RandomDtype::F32) => fill_normal(chunk.bytes, &mut rng, f32::to_le_bytes),
        (Init::Normal, RandomDtype::Bf16) => {
            fill_normal(chunk.bytes, &mut rng, |x| bf16::from_f32(x).to_le_bytes())
        }
    }
}

fn fill_ones<const N: usize>(bytes: &mut [u8], one: [u8; N]) {
    for element in bytes.chunks_exact_mut(N) {
        element.copy_from_slice(&one);
    }
}

/// `N(0, INIT_STD²)` samples, two per Box–Muller pair, each written by `encode` into `N`
/// bytes. An odd element count uses the first sample of the last pair.
fn fill_normal<const N: usize>(
    bytes: &mut [u8],
    rng: &mut ChaCha8Rng,
    encode: impl Fn(f32) -> [u8; N],
) {
    let mut pairs = bytes.chunks_exact_mut(2 * N);
    for pair in &mut pairs {
        let (z0, z1) = normal_pair(rng);
        pair[..N].copy_from_slice(&encode(z0 * INIT_STD));
        pair[N..].copy_from_slice(&encode(z1 * INIT_STD));
    }
    let last = pairs.into_remainder();
    if !last.is_empty() {
        let (z0, _) = normal_pair(rng);
        last.copy_from_slice(&encode(z0 * INIT_STD));
    }
}

/// Two independent `N(0, 1)` samples from two 32-bit words (Box–Muller). `u1` is in `(0, 1]`
/// so `ln u1` is finite; |z| ≤ √(2 ln 2²⁴) ≈ 5.8.
fn normal_pair(rng: &mut ChaCha8Rng) -> (f32, f32) {
    const SCALE: f32 = 1.0 / (1u32 << 24) as f32;
    let u1 = ((rng.next_u32() >> 8) + 1) as f32 * SCALE;
    let u2 = (rng.next_u32() >> 8) as f32 * SCALE;
    let radius = (-2.0 * u1.ln()).sqrt();
    let (sin, cos) = (std::f32::consts::TAU * u2).sin_cos();
    (radius * cos, radius * sin)
}

/// JSON as `transformers` writes it: two-space indent, a final newline.
fn pretty(value: &serde_json::Value) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    text
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| write_error(path, e))
}

fn write_error(path: &Path, error: std::io::Error) -> Error {
    Error::Write {
        path: path.to_path_buf(),
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The presets have the sizes they claim.
    #[test]
    fn random_model_presets_have_their_sizes() {
        let params = RandomModelSpec::llama_1b().parameter_count();
        assert_eq!(params, 1_235_814_400, "Llama-3.2-1B has 1.24B parameters");
        let tiny = RandomModelSpec::tiny_d64();
        assert_eq!(tiny.head_dim, 64);
        assert!(!tiny.tensors().iter().any(|t| t.name == "lm_head.weight"));
        let untied = RandomModelSpec {
            tie_word_embeddings: false,
            ..tiny.clone()
        };
        assert_eq!(
            untied.parameter_count(),
            tiny.parameter_count() + tiny.vocab_size * tiny.hidden_size
        );
        assert!(RandomModelSpec::preset("llama-7b").is_err());
    }

    /// A chunk's samples do not depend on where the chunking put its boundaries: generating
    /// from word 2k equals skipping the first k pairs of a stream generated from 0.
    #[test]
    fn random_model_streams_are_position_addressed() {
        let whole = {
            let mut bytes = vec![0u8; 40];
            let mut rng = ChaCha8Rng::seed_from_u64(7);
            rng.set_stream(3);
            fill_normal(&mut bytes, &mut rng, f32::to_le_bytes);
            bytes
        };
        let mut tail = vec![0u8; 24];
        fill(
            Chunk {
                stream: 3,
                first: 4,
                init: Init::Normal,
                bytes: &mut tail,
            },
            RandomDtype::F32,
            7,
        );
        assert_eq!(tail, whole[16..]);
    }

    /// The samples have the mean and spread of `N(0, 0.02²)`.
    #[test]
    fn random_model_samples_are_normal() {
        let mut bytes = vec![0u8; 4 * 100_000];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        fill_normal(&mut bytes, &mut rng, f32::to_le_bytes);
        let values: Vec<f64> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect();
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64;
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "std {}", var.sqrt());
    }
}
