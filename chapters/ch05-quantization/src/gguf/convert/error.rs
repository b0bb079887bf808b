//! [`ConvertError`]: why a Hugging Face checkpoint could not be written as GGUF, naming the file,
//! tensor or setting at fault.

use std::path::PathBuf;

use crate::blocks::BlockError;
use crate::format::GgmlType;
use crate::gguf::error::GgufError;

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// Reading the checkpoint: config, safetensors, a tensor's shape or dtype.
    #[error(transparent)]
    Checkpoint(#[from] ch01::Error),

    /// Building or writing the GGUF file.
    #[error(transparent)]
    Gguf(#[from] GgufError),

    #[error(
        "type {0} is not one kiln writes (expected one of f32, f16, bf16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k)"
    )]
    UnsupportedType(GgmlType),

    /// A model the GGUF file (or kiln's reader of it) cannot represent.
    #[error("{path}: {message}")]
    Unsupported { path: PathBuf, message: String },

    /// A `tokenizer.json` / `tokenizer_config.json` that does not make `tokenizer.ggml.*`.
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },

    /// Encoding a tensor's values.
    #[error("tensor `{name}`: {error}")]
    Encode { name: String, error: BlockError },
}

impl ConvertError {
    /// A model config file (`config.json`, `generation_config.json`) that cannot be read as
    /// one: chapter 1's config error.
    pub(crate) fn config(path: &std::path::Path, message: String) -> Self {
        ConvertError::Checkpoint(ch01::Error::Config {
            path: path.to_path_buf(),
            message,
        })
    }

    pub(crate) fn tokenizer(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        ConvertError::Tokenizer {
            path: path.into(),
            message: message.into(),
        }
    }

    pub(crate) fn unsupported(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        ConvertError::Unsupported {
            path: path.into(),
            message: message.into(),
        }
    }
}

pub type ConvertResult<T> = std::result::Result<T, ConvertError>;
