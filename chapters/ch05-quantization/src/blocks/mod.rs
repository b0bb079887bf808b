//! llama.cpp's block formats: decoding (dequantization) and round-to-nearest encoding.
//!
//! A row of `n` weights is `n / block_elems` blocks laid end to end (see [`GgmlType`]); rows are
//! independent, so a tensor `[rows, n]` is `rows` such runs. Every function here works on whole
//! rows of one type and checks the lengths it is given.

mod q8_0;

use half::{bf16, f16};

use crate::format::GgmlType;

/// Bytes or lengths that do not fit the block format, or a format this chapter cannot decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("{ty}: {bytes} bytes do not hold {elems} elements ({per} elements per {block} bytes)", per = .ty.block_elems(), block = .ty.block_bytes())]
    Length {
        ty: GgmlType,
        bytes: usize,
        elems: usize,
    },
    #[error("kiln cannot decode tensors of type {0}")]
    Unsupported(GgmlType),
}

/// Checks that `bytes` holds exactly `elems` elements of `ty`.
pub fn check_len(ty: GgmlType, bytes: usize, elems: usize) -> Result<(), BlockError> {
    if ty.row_bytes(elems) == Some(bytes) {
        Ok(())
    } else {
        Err(BlockError::Length { ty, bytes, elems })
    }
}

/// Decodes `bytes`, a whole number of `ty` blocks, into `out` (one f32 per element).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), BlockError> {
    check_len(ty, bytes.len(), out.len())?;
    match ty {
        GgmlType::F32 => decode_plain(bytes, out, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => decode_plain(bytes, out, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::BF16 => decode_plain(bytes, out, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::Q8_0 => q8_0::dequantize(bytes, out),
        other => return Err(BlockError::Unsupported(other)),
    }
    Ok(())
}

/// Each `size_of::<T>()` bytes decode to one value.
fn decode_plain(bytes: &[u8], out: &mut [f32], decode: impl Fn(&[u8]) -> f32) {
    let size = bytes.len() / out.len().max(1);
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(size)) {
        *o = decode(b);
    }
}
