//! The `WeightSource` seam: raw typed tensors by name.
//!
//! A checkpoint format is anything that can answer two questions: does it hold a tensor of this
//! name, and what are that tensor's dtype, shape and bytes? [`Weights`](crate::Weights) answers
//! them for safetensors (one file or sharded); chapter 5 adds a GGUF source and chapter 8 a
//! source per tensor-parallel rank, without touching this chapter's model code.
//!
//! The trait's provided methods do the dense work chapter 1 needs: decode F32, F16 or BF16 to f32
//! after checking the shape, for a whole tensor or for a block of rows and columns (one rank's
//! shard). A loader for another storage (GPTQ's int32 `qweight`, FP8) reads [`RawTensor`]s
//! instead and decodes them itself.

use std::borrow::Cow;
use std::ops::Range;
use std::path::Path;

use half::{bf16, f16};
use ndarray::{Array1, Array2};

use crate::error::{Error, Result};

/// The element type of a stored tensor. Every variant but [`TensorDtype::Blocks`] is a whole
/// number of bytes per element, stored little-endian; formats with smaller elements (4- and
/// 6-bit floats) are rejected by the source with an error naming the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorDtype {
    /// A block-quantized format (GGUF's Q8_0, Q4_K, ..., chapter 5): each run of `block_elems`
    /// consecutive elements of the innermost dimension is stored in `block_bytes` bytes.
    /// `format` names the format for the loader that knows it (GGUF's type id); this chapter
    /// only checks sizes and never decodes one.
    Blocks {
        format: u32,
        block_elems: usize,
        block_bytes: usize,
    },
    Bool,
    U8,
    I8,
    /// FP8 with 4 exponent and 3 mantissa bits (no infinities).
    F8E4M3,
    /// FP8 with 5 exponent and 2 mantissa bits.
    F8E5M2,
    /// An 8-bit power-of-two scale (microscaling formats).
    F8E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    I64,
    U64,
    F64,
}

impl TensorDtype {
    /// Bytes per element; `None` for [`TensorDtype::Blocks`], whose elements share bytes.
    pub const fn size_bytes(self) -> Option<usize> {
        use TensorDtype::*;
        Some(match self {
            Bool | U8 | I8 | F8E4M3 | F8E5M2 | F8E8M0 => 1,
            I16 | U16 | F16 | BF16 => 2,
            I32 | U32 | F32 => 4,
            I64 | U64 | F64 => 8,
            Blocks { .. } => return None,
        })
    }

    /// Bytes that hold a tensor of `shape`; `None` when the count overflows, or when a block
    /// format's innermost dimension is not a whole number of blocks.
    pub fn storage_bytes(self, shape: &[usize]) -> Option<usize> {
        match self {
            TensorDtype::Blocks {
                block_elems,
                block_bytes,
                ..
            } => {
                let (&inner, outer) = shape.split_last()?;
                if block_elems == 0 || inner % block_elems != 0 {
                    return None;
                }
                let row = (inner / block_elems).checked_mul(block_bytes)?;
                outer.iter().try_fold(row, |n, &d| n.checked_mul(d))
            }
            dense => {
                let size = dense.size_bytes()?;
                shape.iter().try_fold(size, |n, &d| n.checked_mul(d))
            }
        }
    }
}

impl std::fmt::Display for TensorDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorDtype::Blocks {
                format,
                block_elems,
                block_bytes,
            } => write!(
                f,
                "block format {format} ({block_elems} elements in {block_bytes} bytes)"
            ),
            dense => std::fmt::Debug::fmt(dense, f),
        }
    }
}

/// One tensor as stored: dtype, shape and little-endian bytes in row-major order.
///
/// Invariant (checked by [`RawTensor::new`]): `bytes.len() == dtype.storage_bytes(shape)`. The bytes may be borrowed from a memory map and carry no alignment
/// guarantee: decode them with `from_le_bytes`, never by casting the slice.
#[derive(Debug, Clone, PartialEq)]
pub struct RawTensor<'a> {
    dtype: TensorDtype,
    shape: Vec<usize>,
    bytes: Cow<'a, [u8]>,
}

impl<'a> RawTensor<'a> {
    /// Checks that `bytes` holds exactly `shape`'s elements of `dtype`; `name` and `location`
    /// only label the error.
    pub fn new(
        name: &str,
        location: &Path,
        dtype: TensorDtype,
        shape: Vec<usize>,
        bytes: impl Into<Cow<'a, [u8]>>,
    ) -> Result<Self> {
        let bytes = bytes.into();
        if dtype.storage_bytes(&shape) != Some(bytes.len()) {
            return Err(Error::Tensor {
                name: name.to_string(),
                location: location.to_path_buf(),
                message: format!(
                    "{} bytes do not hold shape {shape:?} of {dtype}",
                    bytes.len()
                ),
            });
        }
        Ok(RawTensor {
            dtype,
            shape,
            bytes,
        })
    }

    pub fn dtype(&self) -> TensorDtype {
        self.dtype
    }

    /// Dimensions, outermost first (`[out_features, in_features]` for a Hugging Face linear weight).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All elements as f32 (exact for F32, F16 and BF16; any other dtype is an error naming the
    /// tensor, since its values need scales or a codebook that only its own loader knows).
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>> {
        to_f32(name, self.dtype, &self.bytes)
    }
}

// ANCHOR: weight_source
/// Raw typed tensors by name: what every checkpoint format provides.
///
/// Object-safe and `Send + Sync`, so a model loads from a `&dyn WeightSource` and loading can be
/// spread over threads. Names are the checkpoint's own (`model.layers.0.self_attn.q_proj.weight`
/// for Hugging Face); a source for another naming scheme (GGUF's `blk.0.attn_q.weight`) is free
/// to answer Hugging Face names by translating them.
pub trait WeightSource: Send + Sync {
    /// Where the tensors come from (a directory or a file): named in every error.
    fn location(&self) -> &Path;

    /// Whether the source holds a tensor of this name.
    fn contains(&self, name: &str) -> bool;

    /// Tensor `name` as stored. A missing name is [`Error::MissingTensor`].
    fn tensor(&self, name: &str) -> Result<RawTensor<'_>>;

    /// Tensor `name` as f32 values in row-major order, after checking that its shape is `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let raw = self.tensor(name)?;
        check_shape(name, &raw, shape)?;
        raw.to_f32(name)
    }

    /// A 1-D tensor of length `n`.
    fn vector(&self, name: &str, n: usize) -> Result<Array1<f32>> {
        Ok(Array1::from_vec(self.get(name, &[n])?))
    }

    /// A 2-D tensor `[rows, cols]` (Hugging Face linear weights are `[out_features, in_features]`).
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Array2<f32>> {
        self.matrix_block(name, [rows, cols], 0..rows, 0..cols)
    }

    /// Rows `rows` and columns `cols` of the 2-D tensor `name`, whose shape must be `shape`:
    /// one rank's shard, decoded without decoding the rest. Ranges past `shape` are an error.
    fn matrix_block(
        &self,
        name: &str,
        shape: [usize; 2],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Array2<f32>> {
        let raw = self.tensor(name)?;
        check_shape(name, &raw, &shape)?;
        let [_, width] = shape;
        if rows.start > rows.end || rows.end > shape[0] || cols.start > cols.end || cols.end > width
        {
            return Err(Error::InvalidArgument(format!(
                "block rows {rows:?}, columns {cols:?} lie outside tensor `{name}` of shape {shape:?}"
            )));
        }
        let Some(size) = raw.dtype.size_bytes() else {
            return Err(Error::UnsupportedDtype {
                name: name.to_string(),
                dtype: raw.dtype.to_string(),
            });
        };
        let mut values = Vec::with_capacity(rows.len() * cols.len());
        for r in rows.clone() {
            let start = (r * width + cols.start) * size;
            let end = (r * width + cols.end) * size;
            values.extend(to_f32(name, raw.dtype, &raw.bytes[start..end])?);
        }
        Array2::from_shape_vec((rows.len(), cols.len()), values)
            .map_err(|e| Error::InvalidArgument(format!("tensor `{name}`: {e}")))
    }
}
// ANCHOR_END: weight_source

fn check_shape(name: &str, raw: &RawTensor<'_>, shape: &[usize]) -> Result<()> {
    if raw.shape != shape {
        return Err(Error::ShapeMismatch {
            name: name.to_string(),
            expected: shape.to_vec(),
            actual: raw.shape.clone(),
        });
    }
    Ok(())
}

/// Decodes little-endian F32/F16/BF16 bytes to f32 (the conversions are exact).
// ANCHOR: to_f32
fn to_f32(name: &str, dtype: TensorDtype, bytes: &[u8]) -> Result<Vec<f32>> {
    let values = match dtype {
        TensorDtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        TensorDtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        TensorDtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::UnsupportedDtype {
                name: name.to_string(),
                dtype: other.to_string(),
            });
        }
    };
    Ok(values)
}
// ANCHOR_END: to_f32
