//! What one K or V element is stored as: the KV cache's storage dtype.
//!
//! Attention always computes in f32; the pool only stores. An element is widened to f32 where
//! a kernel reads it and rounded when the executor writes it, so a narrower dtype halves the
//! bytes each position takes (twice the tokens in the same memory, half the bytes a decode step
//! reads) at the price of rounding K and V once.
//!
//! An 8-bit dtype (chapter 5's FP8 E4M3 and int8) cannot hold K and V on its own scale: it
//! stores, per position and KV head, `head_dim` codes and one f32 scale, and an element is
//! `code · scale`. The pool keeps those scales beside the codes ([`KvElement::SCALED`]); the
//! kernels multiply a head's dot product (or its softmax weight) by the scale instead of every
//! element, which is the same arithmetic.

use ch02::kernels::vector::ToF32;
use half::bf16;

/// The storage dtype of a KV pool, named as vLLM's `--kv-cache-dtype` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    /// bfloat16: f32's exponent, 8 bits of mantissa; rounding to nearest even at write.
    Bf16,
    /// FP8 E4M3 codes with one f32 scale per position and KV head (chapter 5).
    Fp8E4M3,
    /// int8 codes with one f32 scale per position and KV head (chapter 5).
    Int8,
}

impl KvDtype {
    /// Every dtype, in order of size.
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8E4M3, KvDtype::Int8];

    /// Bytes of one element (a code, for a scaled dtype).
    pub const fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
            KvDtype::Fp8E4M3 | KvDtype::Int8 => 1,
        }
    }

    /// Whether a position's row carries one f32 scale per KV head (see [`KvElement::SCALED`]).
    pub fn scaled(self) -> bool {
        matches!(self, KvDtype::Fp8E4M3 | KvDtype::Int8)
    }

    /// Bytes one position's K (or V) row takes in one layer: `num_kv_heads · head_dim`
    /// elements, plus `num_kv_heads` f32 scales for a scaled dtype. Saturates.
    pub fn row_bytes(self, num_kv_heads: usize, head_dim: usize) -> u64 {
        let scale = if self.scaled() { size_of::<f32>() } else { 0 };
        (num_kv_heads as u64).saturating_mul(
            (head_dim as u64)
                .saturating_mul(self.size() as u64)
                .saturating_add(scale as u64),
        )
    }

    /// Bytes of KV cache one token occupies: K and V rows in every layer of `config`.
    pub fn bytes_per_token(self, config: &ch01::LlamaConfig) -> u64 {
        self.row_bytes(config.num_key_value_heads, config.head_dim)
            .saturating_mul(2 * config.num_hidden_layers as u64)
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8E4M3 => "fp8_e4m3",
            KvDtype::Int8 => "int8",
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "float32" => Ok(KvDtype::F32),
            "bf16" | "bfloat16" => Ok(KvDtype::Bf16),
            "fp8" | "fp8_e4m3" => Ok(KvDtype::Fp8E4M3),
            "int8" => Ok(KvDtype::Int8),
            other => Err(format!(
                "unknown KV cache dtype {other:?}: expected f32, bf16, fp8_e4m3 or int8"
            )),
        }
    }
}

// ANCHOR: kv_element
/// A type a KV pool stores its elements as.
///
/// # Safety
/// The all-zero bit pattern must be a valid value of the type (it is `0.0` for the floats
/// here): a pool takes its memory zeroed from the system and reads it as `Self` before any
/// write (see `KvPool::new`). The type is `DTYPE`'s element and nothing else: its
/// `DTYPE.size()` bytes, none of them padding, are an f32, a bf16, an FP8 E4M3 code or an int8
/// code, as `DTYPE` says (chapter 4's vector loops load them as that, and check the size).
/// Kernels read it widened to f32 ([`ToF32`], exact for every type here).
///
/// A `SCALED` type stores each head's row of a position as codes and one scale: the row's value
/// is `code.to_f32() · scale`, and [`KvElement::quantize_head`] picks the scale.
pub unsafe trait KvElement: ToF32 + Default + Send + Sync + 'static {
    const DTYPE: KvDtype;
    /// Whether the pool keeps one f32 scale per position and KV head for this type.
    const SCALED: bool = false;
    /// Rounds an f32 to this type (the executor's write, for an unscaled type).
    fn from_f32(x: f32) -> Self;
    /// Rounds one head's row `x` `[head_dim]` into `codes` `[head_dim]`; returns the scale that
    /// reads it back (`x[i] ≈ codes[i].to_f32() · scale`). An unscaled type rounds each element
    /// and returns 1.
    fn quantize_head(x: &[f32], codes: &mut [Self]) -> f32 {
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = Self::from_f32(v);
        }
        1.0
    }
}
// ANCHOR_END: kv_element

// SAFETY: an f32 is `DTYPE`'s element; all-zero bits are 0.0.
unsafe impl KvElement for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
}

// SAFETY: a bf16 (two bytes, no padding) is `DTYPE`'s element; all-zero bits are 0.0.
unsafe impl KvElement for bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
    #[inline(always)]
    fn from_f32(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
}

// ANCHOR: kv_scales
/// One layer's per-(position, KV head) scales: slot `s`, head `h` at `s · num_kv_heads + h`.
/// Empty for an unscaled pool, whose every scale is 1 (multiplying by it is exact, so an f32 or
/// bf16 pool computes bit for bit what it computed before scales existed).
#[derive(Debug, Clone, Copy)]
pub struct KvScales<'a> {
    keys: &'a [f32],   // [slots, num_kv_heads] or empty
    values: &'a [f32], // [slots, num_kv_heads] or empty
    num_kv_heads: usize,
}
// ANCHOR_END: kv_scales

impl<'a> KvScales<'a> {
    /// The scales of an unscaled pool.
    pub const NONE: KvScales<'static> = KvScales {
        keys: &[],
        values: &[],
        num_kv_heads: 0,
    };

    /// Scales of `num_kv_heads` heads per slot; both slices `[slots, num_kv_heads]` (or both
    /// empty, for an unscaled pool).
    pub fn new(keys: &'a [f32], values: &'a [f32], num_kv_heads: usize) -> Self {
        assert_eq!(keys.len(), values.len(), "one K and one V scale per head");
        KvScales {
            keys,
            values,
            num_kv_heads,
        }
    }

    /// The scale of the K row of `head` at `slot`.
    #[inline(always)]
    pub fn key(&self, slot: usize, head: usize) -> f32 {
        if self.keys.is_empty() {
            1.0
        } else {
            self.keys[slot * self.num_kv_heads + head]
        }
    }

    /// The scale of the V row of `head` at `slot`.
    #[inline(always)]
    pub fn value(&self, slot: usize, head: usize) -> f32 {
        if self.values.is_empty() {
            1.0
        } else {
            self.values[slot * self.num_kv_heads + head]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_and_widens_exactly() {
        for x in [0.0f32, 1.0, -2.5, 3.140625, 1e-20, 6.5e4, -0.0] {
            let b = <bf16 as KvElement>::from_f32(x);
            assert_eq!(ToF32::to_f32(b), bf16::from_f32(x).to_f32(), "{x}");
            // 8 bits of mantissa: half an ulp of relative error at most.
            assert!(
                (ToF32::to_f32(b) - x).abs() <= x.abs() * 2f32.powi(-8),
                "{x}"
            );
        }
        assert_eq!("bf16".parse::<KvDtype>(), Ok(KvDtype::Bf16));
        assert_eq!("f32".parse::<KvDtype>(), Ok(KvDtype::F32));
        assert_eq!("fp8".parse::<KvDtype>(), Ok(KvDtype::Fp8E4M3));
        assert!("fp4".parse::<KvDtype>().is_err());
        for dtype in KvDtype::ALL {
            assert_eq!(dtype.name().parse::<KvDtype>(), Ok(dtype));
        }
    }
}
