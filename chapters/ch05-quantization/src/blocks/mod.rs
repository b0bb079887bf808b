//! llama.cpp's block formats: decoding (dequantization) and encoding (quantization).
//!
//! A row of `n` weights is `n / block_elems` blocks laid end to end (see [`GgmlType`]); rows are
//! independent, so a tensor `[rows, n]` is `rows` such runs. Every function here works on whole
//! rows of one type and checks the lengths it is given.
//!
//! | module   | block        | decode                        | encode                                   |
//! |----------|--------------|-------------------------------|------------------------------------------|
//! | [`q8_0`] | 32 in 34 B   | `d·q`                         | round to nearest, = gguf-py bit for bit  |
//! | [`q4_0`] | 32 in 18 B   | `d·(q − 8)`                   | round to nearest, = gguf-py bit for bit  |
//! | [`q4_1`] | 32 in 20 B   | `d·q + m`                     | round to nearest, = gguf-py bit for bit  |
//! | [`q5_0`] | 32 in 22 B   | `d·(q − 16)`, 5-bit q         | round to nearest, = gguf-py bit for bit  |
//! | [`q5_1`] | 32 in 24 B   | `d·q + m`, 5-bit q            | round to nearest, = gguf-py bit for bit  |
//! | [`q4_k`] | 256 in 144 B | `(d·sc)·q − dmin·m`           | covering min/max grid (own rule, bounded) |
//! | [`q5_k`] | 256 in 176 B | `(d·sc)·q − dmin·m`, 5-bit q  | covering min/max grid (own rule, bounded) |
//! | [`q6_k`] | 256 in 210 B | `(d·sc)·(q − 32)`             | covering symmetric grid (own rule, bounded) |
//! | [`q8_k`] | 256 in 292 B | `d·q` (f32 `d`)               | symmetric round to nearest (activations) |
//!
//! Decoding equals gguf-py's `gguf.quants.dequantize` bit for bit for every format but Q8_K
//! (which gguf-py does not decode): each value is computed by the same f32 operations in the
//! same order (`tests/blocks_golden.rs` checks it against fixtures the script
//! `fixtures/scripts/make_quant_golden.py` wrote). Rust never fuses a multiply and an add
//! unless asked, so `d * q + m` rounds twice, as numpy's does.
//!
//! Cost: decoding and encoding are one pass over the block; the K-quant encoders make three.

pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q5_1;
pub mod q5_k;
pub mod q6_k;
pub mod q8_0;
pub mod q8_k;

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
    #[error("kiln cannot encode tensors of type {0}")]
    UnsupportedEncoding(GgmlType),
}

/// Checks that `bytes` holds exactly `elems` elements of `ty`.
pub fn check_len(ty: GgmlType, bytes: usize, elems: usize) -> Result<(), BlockError> {
    if ty.row_bytes(elems) == Some(bytes) {
        Ok(())
    } else {
        Err(BlockError::Length { ty, bytes, elems })
    }
}

/// Whether [`dequantize`] decodes `ty`.
pub const fn can_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4K | Q5K | Q6K | Q8K
    )
}

/// Whether [`quantize`] encodes `ty`.
pub const fn can_quantize(ty: GgmlType) -> bool {
    can_dequantize(ty)
}

// ANCHOR: dequantize
/// Decodes `bytes`, a whole number of `ty` blocks, into `out` (one f32 per element).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), BlockError> {
    check_len(ty, bytes.len(), out.len())?;
    match ty {
        GgmlType::F32 => decode_plain::<4>(bytes, out, f32::from_le_bytes),
        GgmlType::F16 => decode_plain::<2>(bytes, out, |b| f16::from_le_bytes(b).to_f32()),
        GgmlType::BF16 => decode_plain::<2>(bytes, out, |b| bf16::from_le_bytes(b).to_f32()),
        GgmlType::Q8_0 => q8_0::dequantize(bytes, out),
        GgmlType::Q4_0 => q4_0::dequantize(bytes, out),
        GgmlType::Q4_1 => q4_1::dequantize(bytes, out),
        GgmlType::Q5_0 => q5_0::dequantize(bytes, out),
        GgmlType::Q5_1 => q5_1::dequantize(bytes, out),
        GgmlType::Q4K => q4_k::dequantize(bytes, out),
        GgmlType::Q5K => q5_k::dequantize(bytes, out),
        GgmlType::Q6K => q6_k::dequantize(bytes, out),
        GgmlType::Q8K => q8_k::dequantize(bytes, out),
        other => return Err(BlockError::Unsupported(other)),
    }
    Ok(())
}
// ANCHOR_END: dequantize

/// Encodes `values` (a whole number of `ty` blocks) into `out`, which must hold exactly their
/// bytes. F32, F16 and BF16 round to nearest even; the block formats follow their modules' rules.
pub fn quantize(ty: GgmlType, values: &[f32], out: &mut [u8]) -> Result<(), BlockError> {
    check_len(ty, out.len(), values.len())?;
    match ty {
        GgmlType::F32 => encode_plain::<4>(values, out, f32::to_le_bytes),
        GgmlType::F16 => encode_plain::<2>(values, out, |v| f16::from_f32(v).to_le_bytes()),
        GgmlType::BF16 => encode_plain::<2>(values, out, |v| bf16::from_f32(v).to_le_bytes()),
        GgmlType::Q8_0 => q8_0::quantize(values, out),
        GgmlType::Q4_0 => q4_0::quantize(values, out),
        GgmlType::Q4_1 => q4_1::quantize(values, out),
        GgmlType::Q5_0 => q5_0::quantize(values, out),
        GgmlType::Q5_1 => q5_1::quantize(values, out),
        GgmlType::Q4K => q4_k::quantize(values, out),
        GgmlType::Q5K => q5_k::quantize(values, out),
        GgmlType::Q6K => q6_k::quantize(values, out),
        GgmlType::Q8K => q8_k::quantize(values, out),
        other => return Err(BlockError::UnsupportedEncoding(other)),
    }
    Ok(())
}

/// Each `N` bytes decode to one value.
fn decode_plain<const N: usize>(bytes: &[u8], out: &mut [f32], decode: impl Fn([u8; N]) -> f32) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(N)) {
        *o = decode(b.try_into().expect("chunks of N bytes"));
    }
}

/// Each value encodes to `N` bytes.
fn encode_plain<const N: usize>(values: &[f32], out: &mut [u8], encode: impl Fn(f32) -> [u8; N]) {
    for (b, &v) in out.chunks_exact_mut(N).zip(values) {
        b.copy_from_slice(&encode(v));
    }
}

/// The little-endian f16 at `block[at..at + 2]`, widened to f32 (exact).
#[inline(always)]
pub(crate) fn f16_at(block: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([block[at], block[at + 1]]))
}

/// An f16 widened to f32, exactly, in a few integer operations that inline into the kernels'
/// loops (the library conversion is a call). The f16's exponent and mantissa, shifted into an
/// f32's fields, make the f32 `2¹¹²` times smaller than the f16 (the exponent biases differ by
/// 112), denormals included; multiplying by `2¹¹²` is exact. Infinities and NaNs keep an
/// all-ones exponent.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    const TWO_POW_112: f32 = 5.192_297e33; // 2¹¹², exact
    let magnitude = u32::from(h & 0x7FFF);
    let sign = u32::from(h & 0x8000) << 16;
    let value = if magnitude >= 0x7C00 {
        f32::from_bits(0x7F80_0000 | ((magnitude & 0x03FF) << 13))
    } else {
        f32::from_bits(magnitude << 13) * TWO_POW_112
    };
    f32::from_bits(value.to_bits() | sign)
}

/// Stores `v` rounded to the nearest f16 (ties to even; beyond ±65504 it becomes ±∞, as numpy's
/// `astype(np.float16)` does) at `block[at..at + 2]`.
#[inline]
pub(crate) fn put_f16(block: &mut [u8], at: usize, v: f32) {
    block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The smallest f16 that is `>= v` (`v >= 0`): a scale rounded up, so a grid built on it still
/// covers the values it was computed from.
pub(crate) fn f16_ceil(v: f64) -> f16 {
    let h = f16::from_f64(v);
    if h.to_f64() < v {
        f16::from_bits(h.to_bits() + 1)
    } else {
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_rows_and_wrong_lengths() {
        for ty in GgmlType::ALL.into_iter().filter(|&t| can_dequantize(t)) {
            dequantize(ty, &[], &mut []).unwrap();
            quantize(ty, &[], &mut []).unwrap();
            let n = ty.block_elems();
            let err = dequantize(ty, &vec![0; ty.block_bytes() + 1], &mut vec![0.0; n]);
            assert!(matches!(err, Err(BlockError::Length { .. })), "{ty}");
        }
        assert_eq!(
            dequantize(GgmlType::Q2K, &[0; 84], &mut [0.0; 256]),
            Err(BlockError::Unsupported(GgmlType::Q2K))
        );
    }

    #[test]
    fn the_inlined_f16_conversion_is_exact_for_every_f16() {
        for bits in 0..=u16::MAX {
            let (fast, lib) = (f16_bits_to_f32(bits), f16::from_bits(bits).to_f32());
            assert!(
                fast.to_bits() == lib.to_bits() || (fast.is_nan() && lib.is_nan()),
                "{bits:#06x}: {fast:e} vs {lib:e}"
            );
        }
    }

    #[test]
    fn f16_ceil_rounds_up() {
        for v in [0.0, 1e-9, 6e-8, 1.0 / 3.0, 1.0, 1000.1, 65504.0] {
            let h = f16_ceil(v);
            assert!(h.to_f64() >= v, "{v}");
            assert!(f16::from_bits(h.to_bits().saturating_sub(1)).to_f64() < v || v == 0.0);
        }
    }
}
