//! # Chapter 1: a naive Llama that talks
//!
//! Everything needed to turn a Hugging Face checkpoint into text, written to be read:
//!
//! | module        | what it does                                                                    |
//! |---------------|---------------------------------------------------------------------------------|
//! | [`config`]    | `config.json` → [`LlamaConfig`] (both RoPE config styles, GQA, `head_dim`)     |
//! | [`source`]    | the [`WeightSource`] seam: raw typed tensors by name; f32 with shape checks    |
//! | [`weights`]   | safetensors (single or sharded): the Hugging Face [`WeightSource`]             |
//! | [`shard`]     | [`ShardSpec`]: the rows or columns of a projection that one rank holds         |
//! | [`tokenizer`] | `tokenizer.json` → ids and back, with streaming detokenisation                  |
//! | [`token_bytes`] | a token's raw bytes when its text is part of a character (for logprobs)     |
//! | [`rope`]      | rotary position embeddings (default, linear and llama3 frequency scaling)       |
//! | [`attention`] | causal self-attention that materialises the full score matrix: the oracle     |
//! | [`linear`]    | the [`Linear`] seam: dense f32 here, quantized kinds in chapter 5               |
//! | [`new_dir`]   | writing a model directory all at once (staged, then renamed into place)        |
//! | [`model`]     | the Llama forward pass: embedding → N × (RMSNorm, attention, SwiGLU) → logits   |
//! | [`output_text`] | generated ids → text: detokenisation and stop strings, one fold for every caller |
//! | [`sampler`]   | greedy, temperature, top-k/top-p/min-p, penalties, seeded                       |
//! | [`mod@generate`] | the generation loop that recomputes the whole sequence for every token       |
//! | [`perplexity`]| llama.cpp-style perplexity over a text                                          |
//! | [`random_model`] | a Llama checkpoint with random weights (benchmark and test shapes), seeded   |
//!
//! Generation here is deliberately wasteful: each new token runs the whole sequence through
//! the model again, so the cost of token `t` grows like `t²`. Chapter 2 fixes that with a KV
//! cache; this chapter's forward stays as the reference every faster path is tested against.

pub mod attention;
pub mod config;
pub mod error;
pub mod generate;
pub mod linear;
pub mod model;
pub mod new_dir;
pub mod output_text;
pub mod perplexity;
pub mod random_model;
pub mod rope;
pub mod sampler;
pub mod shard;
pub mod source;
pub mod stop;
pub mod text_file;
pub mod token_bytes;
pub mod tokenizer;
mod tokenizer_json;
pub mod weights;

pub use config::{LlamaConfig, eos_token_ids};
pub use error::{Error, Result};
pub use generate::{FinishReason, GenerateOptions, Generation, generate, generate_with};
pub use linear::{DenseLinear, Linear, LinearLoader, LinearSpec};
pub use model::Llama;
pub use output_text::{OutputText, TextDelta};
pub use random_model::{RandomDtype, RandomModelSpec, write_random_model};
pub use sampler::{Sampler, SamplingParams};
pub use shard::{ShardError, ShardSpec, Split, TensorParallel};
pub use source::{RawTensor, TensorDtype, WeightSource};
pub use tokenizer::{TextStream, Tokenizer};
pub use weights::Weights;

pub mod testing;

use std::path::{Path, PathBuf};

/// The repository's `fixtures/` directory: `$KILN_FIXTURES` when set, else resolved when the
/// crate is compiled (this crate lives at `chapters/<name>/`, two levels below the repository
/// root).
pub fn fixtures_dir() -> PathBuf {
    // A binary built here and run from another checkout (a GPU box) is told where it is.
    if let Some(dir) = std::env::var_os("KILN_FIXTURES") {
        return PathBuf::from(dir);
    }
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    crate_dir
        .ancestors()
        .nth(2)
        .unwrap_or(crate_dir)
        .join("fixtures")
}

/// The embedded default model: `fixtures/shakespeare-small`, trained by the project on Shakespeare.
pub fn default_model_dir() -> PathBuf {
    fixtures_dir().join("shakespeare-small")
}
