//! The 8-bit KV cache: chapter 3's pool storing FP8 E4M3 or int8 codes with one f32 scale per
//! position and KV head (`--kv-cache-dtype fp8_e4m3|int8`).
//!
//! ```text
//! write, one head's row x [head_dim]      scale = max|x| / MAX      code_i = round(x_i / scale)   (ties to even)
//! read, inside the attention kernels      q · k = scale_k · (q · code_k)       p · v = (p · scale_v) · code_v
//! bytes per position and head              head_dim codes + 4 (the scale): 68 for head_dim 64, against 256 in f32
//! ```
//! **Granularity.** A scale per position and head is what a write can compute alone: the
//! executor writes one position at a time, and a per-tensor scale (vLLM's FP8 KV cache) must be
//! known before the first write, from calibration, or every block is requantized when a larger
//! value arrives. Per position, a head's outlier only coarsens its own row. The cost is the
//! scale: 4 bytes per `head_dim` codes, 1/16 more memory at head_dim 64 (3.76× the tokens of
//! f32 in the same memory instead of 4×), and one multiply per head and position in attention.
//!
//! **Error.** int8 rounds each element to within `scale / 2 = max|x| / 254` of itself. E4M3
//! rounds to within 2⁻⁴ of the element (3 mantissa bits), or `scale · 2⁻¹⁰` for values below
//! its normal range (2⁻⁶ · scale): relatively finer for small elements, coarser for the largest.
//! [`KvInt8::error_bound`] and [`F8E4M3`]'s [`e4m3_error_bound`] state these bounds; the
//! attention tests derive theirs from them.

use ch02::kernels::vector::ToF32;
use ch03::{KvDtype, KvElement};

use crate::fp8::F8E4M3;

/// max |x| over a row, NaN-free (a NaN element is ignored for the scale, as it has no
/// magnitude; it is stored as whatever the format makes of it: E4M3's NaN code, or for int8,
/// which has none, a NaN scale, [`int8_scale`]).
pub(crate) fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The int8 scale of a row `x`: [`scale_for`]`(amax(x), 127)`, or NaN when an element of `x`
/// is NaN or infinite. int8 has no NaN code (`NaN as i8` is 0): the row's scale carries it
/// instead, so that every value read back from the row is NaN, as an f32 row's NaN would spread
/// through the products, rather than a finite 0. An ∞ shows in `amax`; a NaN, which `amax`
/// skips, is looked for by a second fold: both vectorize, and together cost within 2% of
/// `amax` alone on a token's quantization (measured on rows of 64 to 1536; one fold that did
/// both cost 40% more, as it did not vectorize).
pub(crate) fn int8_scale(x: &[f32]) -> f32 {
    let amax = amax(x);
    let nan = x.iter().fold(false, |nan, v| nan | v.is_nan());
    if amax.is_finite() && !nan {
        scale_for(amax, 127.0)
    } else {
        f32::NAN
    }
}

/// The scale that maps `amax` to `max`; 1 for an all-zero row (every code is then 0). Never
/// below f32's smallest normal number, so that `1 / scale` stays finite: a row of magnitudes
/// near 1e-37 would otherwise get an infinite inverse, and `0 · inf` a NaN code.
pub(crate) fn scale_for(amax: f32, max: f32) -> f32 {
    if amax > 0.0 {
        (amax / max).max(f32::MIN_POSITIVE)
    } else {
        1.0
    }
}

// ANCHOR: kv_int8
/// A symmetric int8 KV code: the element is `code · scale`, `code` in −127..=127.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct KvInt8(pub i8);

impl KvInt8 {
    /// Largest |element − code · scale| for a row whose largest magnitude is `amax`.
    pub fn error_bound(amax: f32) -> f32 {
        scale_for(amax, 127.0) / 2.0
    }
}

impl ToF32 for KvInt8 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.0 as f32
    }
}

// SAFETY: one byte (`repr(transparent)` over an i8), an int8 code; all-zero bits are the code 0.
unsafe impl KvElement for KvInt8 {
    const DTYPE: KvDtype = KvDtype::Int8;
    const SCALED: bool = true;

    /// The code of `x` at scale 1 (saturating; to nearest, ties to even; NaN to 0): only
    /// [`KvElement::quantize_head`] is used by the pool.
    #[inline(always)]
    fn from_f32(x: f32) -> KvInt8 {
        // Clamped, then rounded by adding 1.5 · 2²³: the sum's ulp is 1, so the adder rounds
        // (to nearest even) and the low bits of its mantissa hold the integer, two's
        // complement, whose low byte is the code. Plain f32 arithmetic, so a row's loop compiles
        // to vector code; `f32::round` is a call into the C library per element (a batch-32
        // step's writes took 1.04-1.21 ms, now 0.28-0.33; chapter 7's `kv_dtype_decode`).
        const ROUND: f32 = 12_582_912.0;
        let clamped = x.clamp(-127.0, 127.0);
        let code = (clamped + ROUND).to_bits() as u8 as i8;
        KvInt8(if clamped.is_nan() { 0 } else { code })
    }

    /// A NaN or infinite element makes the row's scale NaN (`int8_scale`).
    fn quantize_head(x: &[f32], codes: &mut [KvInt8]) -> f32 {
        let scale = int8_scale(x);
        let inv = 1.0 / scale;
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = KvInt8::from_f32(v * inv);
        }
        scale
    }
}
// ANCHOR_END: kv_int8

// ANCHOR: kv_fp8
// SAFETY: one byte (`repr(transparent)` over a u8), an E4M3 code; all-zero bits are +0.
unsafe impl KvElement for F8E4M3 {
    const DTYPE: KvDtype = KvDtype::Fp8E4M3;
    const SCALED: bool = true;

    /// Round to nearest even, saturating at ±448.
    fn from_f32(x: f32) -> F8E4M3 {
        F8E4M3::from_f32(x)
    }

    fn quantize_head(x: &[f32], codes: &mut [F8E4M3]) -> f32 {
        let scale = scale_for(amax(x), F8E4M3::MAX);
        let inv = 1.0 / scale;
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = F8E4M3::from_f32(v * inv);
        }
        scale
    }
}
// ANCHOR_END: kv_fp8

/// Largest |element − code · scale| for an element `x` of a row whose largest magnitude is
/// `amax`: half an ulp of 3 mantissa bits (2⁻⁴ |x|) in E4M3's normal range, half a subnormal step
/// (2⁻¹⁰ · scale) below it. A small slack covers the f32 rounding of `x / scale`.
pub fn e4m3_error_bound(x: f32, amax: f32) -> f32 {
    let scale = scale_for(amax, F8E4M3::MAX);
    (x.abs() * 2f32.powi(-4)).max(scale * 2f32.powi(-10)) * (1.0 + 2f32.powi(-20))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip<K: KvElement>(x: &[f32]) -> Vec<f32> {
        let mut codes = vec![K::default(); x.len()];
        let scale = K::quantize_head(x, &mut codes);
        codes.iter().map(|c| c.to_f32() * scale).collect()
    }

    /// A row of magnitudes near 1e-37 (its scale would be subnormal and its inverse infinite)
    /// rounds to finite values, zeros to zero.
    #[test]
    fn a_row_of_tiny_values_rounds_to_finite_values() {
        let x = [1e-37, 0.0, -3e-38, 0.0];
        for back in [round_trip::<KvInt8>(&x), round_trip::<F8E4M3>(&x)] {
            assert!(back.iter().all(|v| v.is_finite()), "{back:?}");
            assert_eq!((back[1], back[3]), (0.0, 0.0));
        }
    }

    /// A NaN (or ±∞) in a row reads back as NaN in both 8-bit caches, as it would from an f32
    /// cache: never as a finite value. (int8 has no NaN code; the row's scale carries it. It
    /// once gave the NaN code 0 and a finite scale: the attention saw a 0.)
    #[test]
    fn a_non_finite_element_reads_back_as_nan_not_a_finite_value() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let x = [0.5, bad, -2.0, 1.0];
            let int8 = round_trip::<KvInt8>(&x);
            assert!(int8.iter().all(|v| v.is_nan()), "int8 {bad}: {int8:?}");
            let fp8 = round_trip::<F8E4M3>(&x);
            assert!(!fp8[1].is_finite(), "e4m3 {bad}: {fp8:?}");
        }
        let mut codes = [KvInt8::default(); 3];
        assert!(KvInt8::quantize_head(&[1.0, f32::NAN, 0.0], &mut codes).is_nan());
    }

    /// The int8 code is the value clamped to ±127 and rounded to nearest, ties to even (NaN to
    /// 0): at every half integer of the range and both its neighbours, the extremes, and a
    /// fixed-seed sample of bit patterns and of values in range.
    #[test]
    fn an_int8_code_is_the_clamped_value_rounded_ties_to_even() {
        let reference = |x: f32| {
            if x.is_nan() {
                0
            } else {
                x.clamp(-127.0, 127.0).round_ties_even() as i8
            }
        };
        let mut xs = vec![
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::MAX,
        ];
        for k in -300..=300 {
            let half = k as f32 / 2.0;
            xs.extend([half, half.next_up(), half.next_down()]);
        }
        let mut bits = 0x2545_F491u32;
        for _ in 0..500_000 {
            bits ^= bits << 13;
            bits ^= bits >> 17;
            bits ^= bits << 5;
            xs.extend([
                f32::from_bits(bits),
                bits as f32 / u32::MAX as f32 * 300.0 - 150.0,
            ]);
        }
        for x in xs {
            assert_eq!(
                KvInt8::from_f32(x).0,
                reference(x),
                "{x} ({:#x})",
                x.to_bits()
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(5), ..ProptestConfig::default() })]
        #[test]
        fn a_head_round_trips_within_its_bound(
            x in proptest::collection::vec(-1e4f32..1e4, 1..=130),
            shrink in -30i32..=4,
        ) {
            let x: Vec<f32> = x.iter().map(|v| v * 2f32.powi(shrink)).collect();
            let a = amax(&x);
            for (v, r) in x.iter().zip(round_trip::<KvInt8>(&x)) {
                prop_assert!((v - r).abs() <= KvInt8::error_bound(a) * (1.0 + 1e-6), "int8 {v} → {r}");
            }
            for (v, r) in x.iter().zip(round_trip::<F8E4M3>(&x)) {
                prop_assert!((v - r).abs() <= e4m3_error_bound(*v, a), "e4m3 {v} → {r}");
            }
        }
    }

    #[test]
    fn a_zero_row_is_zero_codes_and_the_extremes_hit_the_largest_code() {
        assert_eq!(round_trip::<KvInt8>(&[0.0; 5]), vec![0.0; 5]);
        assert_eq!(round_trip::<F8E4M3>(&[0.0; 5]), vec![0.0; 5]);
        let mut codes = [KvInt8(0); 3];
        KvInt8::quantize_head(&[-2.0, 1.0, 2.0], &mut codes);
        assert_eq!(codes, [KvInt8(-127), KvInt8(64), KvInt8(127)]);
        let mut codes = [F8E4M3::default(); 2];
        let scale = F8E4M3::quantize_head(&[-3.0, 0.5], &mut codes);
        assert_eq!(codes[0].to_bits(), 0xFE);
        assert_eq!(codes[0].to_f32() * scale, -3.0);
    }
}
