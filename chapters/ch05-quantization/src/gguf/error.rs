//! [`GgufError`]: everything that can be wrong with a GGUF file, each variant naming the file
//! and the key, tensor or offset at fault.

use std::path::PathBuf;

use crate::format::GgmlType;

/// An error reading, interpreting or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The I/O error is part of the message (not a `source`), so it is printed once.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },

    #[error(
        "{path}: truncated: {what} needs {needed} bytes at offset {offset}, but only {available} remain"
    )]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    #[error("{path}: not a GGUF file (magic {found:02x?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: Vec<u8> },

    #[error("{path}: GGUF version {version} is not supported (expected 2 or 3)")]
    UnsupportedVersion { path: PathBuf, version: u32 },

    /// A count or length that the rest of the file cannot possibly hold: refused before
    /// anything is allocated for it.
    #[error(
        "{path}: {what} of {count} at offset {offset} cannot fit in the {available} bytes that remain"
    )]
    CountTooLarge {
        path: PathBuf,
        what: String,
        count: u64,
        offset: u64,
        available: u64,
    },

    /// More metadata array elements than [`MAX_METADATA_ELEMENTS`](super::file::MAX_METADATA_ELEMENTS)
    /// in all: refused before they are read.
    #[error("{path}: array `{key}` takes the file's metadata past {max} array elements")]
    TooManyElements {
        path: PathBuf,
        key: String,
        max: u64,
    },

    #[error("{path}: {what}: unknown metadata value type {id}")]
    UnknownValueType {
        path: PathBuf,
        what: String,
        id: u32,
    },

    #[error("{path}: metadata `{key}`: arrays nested deeper than {max} levels")]
    NestingTooDeep {
        path: PathBuf,
        key: String,
        max: usize,
    },

    #[error("{path}: {what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 {
        path: PathBuf,
        what: String,
        offset: u64,
    },

    #[error("{path}: metadata key `{key}` appears twice")]
    DuplicateKey { path: PathBuf, key: String },

    #[error("{path}: general.alignment {alignment} is not a power of two")]
    BadAlignment { path: PathBuf, alignment: u64 },

    #[error("{path}: tensor `{tensor}` has {n_dims} dimensions (1 to 4 are allowed)")]
    BadDimensionCount {
        path: PathBuf,
        tensor: String,
        n_dims: u32,
    },

    #[error("{path}: tensor `{tensor}` has unknown type id {id}")]
    UnknownTensorType {
        path: PathBuf,
        tensor: String,
        id: u32,
    },

    #[error("{path}: tensor `{tensor}`: dimensions {dims:?} (fastest first) overflow")]
    ShapeOverflow {
        path: PathBuf,
        tensor: String,
        dims: Vec<u64>,
    },

    #[error("{path}: tensor `{tensor}`: rows of {row_len} elements are not whole {ty} blocks of {block}", block = .ty.block_elems())]
    PartialBlock {
        path: PathBuf,
        tensor: String,
        ty: GgmlType,
        row_len: u64,
    },

    #[error(
        "{path}: tensor `{tensor}`: {size} bytes at data offset {offset} run past the {data_len} bytes of the data section"
    )]
    TensorOutOfBounds {
        path: PathBuf,
        tensor: String,
        offset: u64,
        size: u64,
        data_len: u64,
    },

    #[error(
        "{path}: tensor `{tensor}`: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        path: PathBuf,
        tensor: String,
        offset: u64,
        alignment: u64,
    },

    #[error("{path}: the data of tensors `{first}` and `{second}` overlap")]
    OverlappingTensors {
        path: PathBuf,
        first: String,
        second: String,
    },

    #[error("{path}: tensor `{tensor}` appears twice")]
    DuplicateTensor { path: PathBuf, tensor: String },

    #[error("{path}: metadata key `{key}` is missing")]
    MissingKey { path: PathBuf, key: String },

    #[error("{path}: metadata `{key}` is {found}, expected {expected}")]
    WrongType {
        path: PathBuf,
        key: String,
        expected: String,
        found: String,
    },

    #[error("{path}: tensor `{tensor}` is missing")]
    MissingTensor { path: PathBuf, tensor: String },

    /// A file whose metadata a model cannot be built from (an unsupported architecture, sizes
    /// that contradict each other).
    #[error("{path}: {message}")]
    Unsupported { path: PathBuf, message: String },

    /// `tokenizer.ggml.*` metadata that does not make a tokenizer.
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },

    /// What the writer was asked to write does not make a valid file.
    #[error("cannot write GGUF: {0}")]
    Write(String),

    /// An error from chapter 1 (building the model, the tokenizer).
    #[error(transparent)]
    Model(#[from] ch01::Error),
}

impl GgufError {
    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        GgufError::Io {
            path: path.into(),
            error,
        }
    }
}

pub type GgufResult<T> = std::result::Result<T, GgufError>;
