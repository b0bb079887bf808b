//! What one K or V element is stored as: the KV cache's storage dtype.
//!
//! Attention always computes in f32; the pool only stores. An element is widened to f32 where
//! a kernel reads it and rounded when the executor writes it, so a narrower dtype halves the
//! bytes each position takes (twice the tokens in the same memory, half the bytes a decode step
//! reads) at the price of rounding K and V once.

use ch02::kernels::vector::ToF32;
use half::bf16;

/// The storage dtype of a KV pool, named as vLLM's `--kv-cache-dtype` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    /// bfloat16: f32's exponent, 8 bits of mantissa; rounding to nearest even at write.
    Bf16,
}

impl KvDtype {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
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
            other => Err(format!(
                "unknown KV cache dtype {other:?}: expected f32 or bf16"
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
/// write (see `KvPool::new`).
/// Kernels read it widened to f32 ([`ToF32`], exact for every type here).
pub unsafe trait KvElement: ToF32 + Default + Send + Sync + 'static {
    const DTYPE: KvDtype;
    /// Rounds an f32 to this type (the executor's write).
    fn from_f32(x: f32) -> Self;
}
// ANCHOR_END: kv_element

// SAFETY: all-zero bits are 0.0.
unsafe impl KvElement for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
}

// SAFETY: all-zero bits are 0.0.
unsafe impl KvElement for bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
    #[inline(always)]
    fn from_f32(x: f32) -> bf16 {
        bf16::from_f32(x)
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
        assert!("fp8".parse::<KvDtype>().is_err());
    }
}
