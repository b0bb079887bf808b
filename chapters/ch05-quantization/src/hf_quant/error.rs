//! [`HfQuantError`]: everything a malformed GPTQ or AWQ checkpoint can be.

use crate::group_quant::GroupQuantError;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HfQuantError {
    #[error("quantization_config: {0}")]
    Config(String),
    #[error("unsupported quantization_config: {0}")]
    Unsupported(String),
    #[error("tensor `{name}`: expected {expected}, found {found}")]
    Tensor {
        name: String,
        expected: String,
        found: String,
    },
    #[error("layer [{rows}, {cols}] cannot be stored as {format}: {reason}")]
    Layout {
        format: &'static str,
        rows: usize,
        cols: usize,
        reason: String,
    },
    #[error(transparent)]
    Codes(#[from] GroupQuantError),
}
