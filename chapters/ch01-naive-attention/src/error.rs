//! The crate's one error type. Every variant names the file, tensor or limit at fault, so a
//! user who points kiln at a broken checkpoint learns what to fix.

use std::path::PathBuf;

use crate::sampler::SamplingError;
use crate::shard::ShardError;

/// Errors from loading a model or running it on user input.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The I/O error is part of the message (not a `source`), so it is printed once.
    #[error("cannot read {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },

    /// Writing a file (a random checkpoint: see `random_model`).
    #[error("cannot write {path}: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },

    #[error("invalid config {path}: {message}")]
    Config { path: PathBuf, message: String },

    #[error("invalid safetensors file {path}: {message}")]
    Safetensors { path: PathBuf, message: String },

    #[error("tensor `{name}` not found in {location}")]
    MissingTensor { name: String, location: PathBuf },

    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },

    #[error("tensor `{name}` has dtype {dtype}, expected F32, F16 or BF16")]
    UnsupportedDtype { name: String, dtype: String },

    /// A tensor whose stored form contradicts itself (bytes that do not fill its shape).
    #[error("tensor `{name}` in {location}: {message}")]
    Tensor {
        name: String,
        location: PathBuf,
        message: String,
    },

    /// A shard spec or tensor-parallel world that the model's sizes do not allow.
    #[error(transparent)]
    Shard(#[from] ShardError),

    /// The projections a loader built do not make a valid attention layer.
    #[error("layer {layer}: {message}")]
    InconsistentLayer { layer: usize, message: String },

    #[error("invalid tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },

    #[error("prompt is empty: at least one token is needed")]
    EmptyPrompt,

    #[error("sequence of {len} tokens exceeds the model's context of {max_len} tokens")]
    ContextOverflow { len: usize, max_len: usize },

    #[error("token id {id} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange { id: u32, vocab_size: usize },

    #[error(transparent)]
    Sampling(#[from] SamplingError),

    #[error("{0}")]
    InvalidArgument(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
    }
}
