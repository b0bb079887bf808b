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

/// Bytes or lengths that do not fit the block format, a format this chapter cannot decode, or
/// values a format cannot hold.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
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
    /// A NaN or infinite value given to a block format: it has no code for one (a NaN would
    /// round to code 0, a finite weight; an ∞ would spoil its block's scale), so the broken
    /// weight is refused rather than silently changed. `index` counts elements from the start
    /// of what was encoded (row-major for a matrix).
    #[error("{ty}: element {index} is {value}, which no {ty} code stands for")]
    NotFinite {
        ty: GgmlType,
        index: usize,
        value: f32,
    },
    /// Finite values too large for the f16 a format stores them with (a block's scale or
    /// minimum, or the value itself for F16 / BF16): it would be stored as ±∞. `index` is the
    /// first element of the block (of the value for F16 / BF16), `amax` its largest magnitude.
    #[error(
        "{ty}: the block from element {index} (largest magnitude {amax:e}) overflows the 16-bit float it is stored with, to infinity (its scale or minimum; for F16 and BF16 the value itself)"
    )]
    Overflow {
        ty: GgmlType,
        index: usize,
        amax: f32,
    },
}

impl BlockError {
    /// The same error with its element index moved by `offset`: for callers that encode a
    /// tensor in parts (rows, groups of rows) and report positions in the whole tensor.
    pub fn offset(self, offset: usize) -> Self {
        match self {
            BlockError::NotFinite { ty, index, value } => BlockError::NotFinite {
                ty,
                index: index + offset,
                value,
            },
            BlockError::Overflow { ty, index, amax } => BlockError::Overflow {
                ty,
                index: index + offset,
                amax,
            },
            other => other,
        }
    }
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
///
/// Refused, so that a broken or out-of-range weight is an error rather than a silently different
/// model: a NaN or ∞ for a block format ([`BlockError::NotFinite`]; F32, F16 and BF16 store
/// them as they are), and a finite value that F16 / BF16, or a block's f16 scale or minimum,
/// would store as ±∞ ([`BlockError::Overflow`]). The limits, in magnitude:
///
/// | format        | overflows from                                                            |
/// |---------------|---------------------------------------------------------------------------|
/// | F16           | a value of 65520 (BF16: 3.4·10³⁸)                                          |
/// | Q8_0          | a block's largest magnitude 8.3·10⁶ (`127 · 65520`)                        |
/// | Q4_0, Q5_0    | 5.2·10⁵, 1.0·10⁶ (`8 · 65520`, `16 · 65520`)                               |
/// | Q4_1, Q5_1    | a block's range (max − min) 9.8·10⁵, 2.0·10⁶, or its minimum 65520        |
/// | Q4_K, Q5_K    | a sub-block's range 6.2·10⁷, 1.3·10⁸ (`63 · 15 · 65504`, `63 · 31 · 65504`), or a value below −4.1·10⁶ (`dmin`, `63 · 65504`) |
/// | Q6_K          | a value of 2.6·10⁸ (`127 · 31 · 65504`)                                    |
///
/// Q8_K's scale is an f32: it never overflows. The checks are one pass over the values and
/// one look at each block's scales; what is accepted is encoded exactly as before.
pub fn quantize(ty: GgmlType, values: &[f32], out: &mut [u8]) -> Result<(), BlockError> {
    check_len(ty, out.len(), values.len())?;
    let plain = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    if !plain
        && can_quantize(ty)
        && let Some(index) = values.iter().position(|v| !v.is_finite())
    {
        return Err(BlockError::NotFinite {
            ty,
            index,
            value: values[index],
        });
    }
    encode(ty, values, out)?;
    check_overflow(ty, values, out)
}

/// The encoding itself, every value taken as it is.
fn encode(ty: GgmlType, values: &[f32], out: &mut [u8]) -> Result<(), BlockError> {
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

/// Where each block of `ty` stores an f16 scale or minimum (byte offsets in the block; none for
/// the plain types and Q8_K, whose scale is an f32).
pub fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    }
}

/// [`BlockError::Overflow`] for the first block of `out` (encoded from the finite `values`)
/// whose f16 scale or minimum is infinite, or, for F16 and BF16, the first finite value stored
/// as ±∞. One look per block: per element only for F16 and BF16.
fn check_overflow(ty: GgmlType, values: &[f32], out: &[u8]) -> Result<(), BlockError> {
    let overflow = |index: usize, block: &[f32]| BlockError::Overflow {
        ty,
        index,
        amax: block.iter().fold(0.0f32, |m, v| m.max(v.abs())),
    };
    let plain_inf = |v: f32, bits: u16, exponent: u16| v.is_finite() && bits & 0x7FFF == exponent;
    match ty {
        GgmlType::F16 | GgmlType::BF16 => {
            let exponent = if ty == GgmlType::F16 { 0x7C00 } else { 0x7F80 };
            let found = values
                .iter()
                .zip(out.chunks_exact(2))
                .position(|(&v, b)| plain_inf(v, u16::from_le_bytes([b[0], b[1]]), exponent));
            match found {
                Some(i) => Err(overflow(i, &values[i..i + 1])),
                None => Ok(()),
            }
        }
        _ => {
            let fields = f16_fields(ty);
            if fields.is_empty() {
                return Ok(());
            }
            let (elems, bytes) = (ty.block_elems(), ty.block_bytes());
            for (b, block) in out.chunks_exact(bytes).enumerate() {
                if fields.iter().any(|&at| !f16_at(block, at).is_finite()) {
                    return Err(overflow(b * elems, &values[b * elems..(b + 1) * elems]));
                }
            }
            Ok(())
        }
    }
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
/// `astype(np.float16)` does, and [`quantize`] then refuses the block) at `block[at..at + 2]`.
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

    /// The block formats, every one [`quantize`] encodes but the plain F32, F16 and BF16.
    fn block_formats() -> impl Iterator<Item = GgmlType> {
        GgmlType::ALL.into_iter().filter(|&t| {
            can_quantize(t) && !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
        })
    }

    /// Two blocks of ordinary values in `-1..1`.
    fn two_blocks(ty: GgmlType) -> Vec<f32> {
        (0..2 * ty.block_elems())
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect()
    }

    /// A NaN or ±∞ weight is an error naming its element, in every block format. (It once
    /// encoded as code 0, or, for ∞, as a block of zeros and NaN: a silently different model.)
    /// F32, F16 and BF16 store it as it is.
    #[test]
    fn a_nan_or_infinite_weight_is_an_error_not_a_code() {
        for ty in block_formats() {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut x = two_blocks(ty);
                let at = ty.block_elems() + 3;
                x[at] = bad;
                let mut out = vec![0u8; ty.row_bytes(x.len()).unwrap()];
                match quantize(ty, &x, &mut out) {
                    Err(BlockError::NotFinite {
                        ty: t,
                        index,
                        value,
                    }) => {
                        assert_eq!((t, index), (ty, at), "{ty} {bad}");
                        assert_eq!(value.to_bits(), bad.to_bits(), "{ty} {bad}");
                    }
                    other => panic!("{ty} {bad}: {other:?}"),
                }
            }
        }
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            let x = [1.0, f32::NAN, f32::INFINITY, -2.0];
            let mut out = vec![0u8; ty.row_bytes(4).unwrap()];
            quantize(ty, &x, &mut out).unwrap();
            let mut back = [0.0f32; 4];
            dequantize(ty, &out, &mut back).unwrap();
            assert!(
                back[1].is_nan() && back[2] == f32::INFINITY,
                "{ty}: {back:?}"
            );
        }
    }

    /// Just below each format's limit a block encodes (and decodes to finite values); just
    /// above, its f16 scale (or minimum, or the value itself for F16 and BF16) would be ±∞, and
    /// the block is an error naming its first element. (They once stored the ∞.)
    #[test]
    fn a_value_whose_f16_scale_would_overflow_is_an_error() {
        use GgmlType::*;
        // (format, a value that fits, one that overflows), placed in the second block.
        let cases: [(GgmlType, f32, f32); 13] = [
            (Q8_0, 8.32e6, 8.33e6),
            (Q4_0, 5.24e5, 5.25e5),
            (Q5_0, 1.048e6, 1.049e6),
            (Q4_1, 9.8e5, 9.9e5),
            (Q4_1, -6.5e4, -6.6e4), // the block's minimum is stored as an f16
            (Q5_1, 2.03e6, 2.04e6),
            (Q4K, 6.1e7, 6.3e7),
            (Q4K, -4.1e6, -4.2e6), // dmin
            (Q5K, 1.27e8, 1.29e8),
            (Q5K, -4.1e6, -4.2e6),
            (Q6K, 2.57e8, 2.59e8),
            (F16, 65504.0, 65520.0),
            (BF16, 3.38e38, f32::MAX),
        ];
        for (ty, fits, overflows) in cases {
            let block = if ty.block_elems() == 1 { 0 } else { 1 };
            let at = block * ty.block_elems() + ty.block_elems() / 2;
            let mut x = two_blocks(ty);
            if ty == Q4_1 && fits < 0.0 {
                // Every value of the block near the minimum, so that only the minimum is large.
                x[block * 32..block * 32 + 32].fill(fits);
            }
            x[at] = fits;
            let mut out = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            quantize(ty, &x, &mut out).unwrap_or_else(|e| panic!("{ty} {fits:e}: {e}"));
            let mut back = vec![0.0f32; x.len()];
            dequantize(ty, &out, &mut back).unwrap();
            assert!(back.iter().all(|v| v.is_finite()), "{ty} {fits:e}");

            if ty == Q4_1 && fits < 0.0 {
                x[block * 32..block * 32 + 32].fill(overflows);
            }
            x[at] = overflows;
            match quantize(ty, &x, &mut out) {
                Err(BlockError::Overflow { ty: t, index, amax }) => {
                    let first = if ty.block_elems() == 1 {
                        at
                    } else {
                        block * ty.block_elems()
                    };
                    assert_eq!((t, index, amax), (ty, first, overflows.abs()), "{ty}");
                }
                other => panic!("{ty} {overflows:e}: {other:?}"),
            }
        }
    }

    #[test]
    fn an_offset_moves_the_element_index() {
        let e = BlockError::NotFinite {
            ty: GgmlType::Q8_0,
            index: 3,
            value: f32::NAN,
        };
        assert!(matches!(
            e.offset(64),
            BlockError::NotFinite { index: 67, .. }
        ));
        let e = BlockError::Unsupported(GgmlType::Q2K);
        assert_eq!(e.clone().offset(64), e);
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
