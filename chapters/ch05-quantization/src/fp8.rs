//! FP8: the two 8-bit floats of Hopper GPUs, bit for bit as PyTorch casts to them.
//!
//! ```text
//! E4M3 (float8_e4m3fn)   s eeee mmm   bias 7    max ±448 = 0 1111 110   no ∞; NaN = s 1111 111
//! E5M2 (float8_e5m2)     s eeeee mm   bias 15   max ±57344 = 0 11110 11  ±∞ = s 11111 00, NaN above
//! value (e > 0)          (−1)^s · 2^(e − bias) · (1 + m / 2^M)
//! value (e = 0)          (−1)^s · 2^(1 − bias) · m / 2^M                  (subnormals, and ±0)
//! ```
//! E4M3 spends its codes on precision (3 mantissa bits: 2⁻⁴ relative rounding error), E5M2 on
//! range (5 exponent bits, IEEE-like: it is the top byte of an f16).
//!
//! Conversion from f32 rounds to nearest, ties to even; what PyTorch's CPU cast does past the
//! largest finite value differs by format, and so does this module's: E4M3 **saturates** to
//! ±448 (±∞ included, only NaN becomes NaN), E5M2 **overflows** to ±∞. f16 and bf16 widen to
//! f32 exactly first, so their conversion is f32's. The fixture `fixtures/golden/fp8/` holds
//! torch's codes for every f16 and bf16 input, and the tests compare all of them.

use half::{bf16, f16};

// ANCHOR: e4m3
/// An FP8 E4M3 number (PyTorch's `float8_e4m3fn`): 1 sign, 4 exponent, 3 mantissa bits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F8E4M3(u8);

impl F8E4M3 {
    /// The largest finite value, `0 1111 110`.
    pub const MAX: f32 = 448.0;

    pub const fn from_bits(bits: u8) -> Self {
        F8E4M3(bits)
    }

    pub const fn to_bits(self) -> u8 {
        self.0
    }

    /// Rounds to nearest even; saturates to ±448 (±∞ too); NaN becomes `s 1111 111`.
    pub fn from_f32(x: f32) -> Self {
        // ANCHOR: task_5_4
        let bits = x.to_bits();
        let sign = (bits >> 24) as u8 & 0x80;
        let mag = bits & 0x7FFF_FFFF; // |x|, as bits: ordered like the values
        let code = if mag > f32::INFINITY.to_bits() {
            0x7F // NaN
        } else if mag >= Self::MAX.to_bits() {
            0x7E // saturate
        } else if mag < (121 << 23) {
            // |x| < 2⁻⁶, the smallest normal: the code counts steps of 2⁻⁹. Adding 2¹⁴ (whose
            // ulp is 2⁻⁹) makes the f32 adder round |x| to that step, to nearest even.
            let magic = f32::from_bits(141 << 23);
            ((f32::from_bits(mag) + magic).to_bits() - magic.to_bits()) as u8
        } else {
            // Rebias the exponent (127 → 7) and round the 23-bit mantissa to 3 bits: add just
            // under half of the dropped part, plus 1 if the kept part is odd (ties to even).
            let odd = (mag >> 20) & 1;
            ((mag - (120 << 23) + 0x7_FFFF + odd) >> 20) as u8
        };
        F8E4M3(sign | code)
        // ANCHOR_END: task_5_4
    }

    /// 2¹²⁰: an E4M3 code's seven magnitude bits shifted left by 20 and read as an f32 are its
    /// magnitude times 2⁻¹²⁰ (the NaN code aside).
    pub(crate) const REBIAS: f32 = f32::from_bits((127 + 120) << 23);

    /// Exact: every E4M3 value is an f32.
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        let (sign, mag) = ((self.0 as u32 & 0x80) << 24, self.0 as u32 & 0x7F);
        // `mag << 20` puts e and m where an f32 keeps them; as an f32 that is
        // 2^(e − 127) · 1.m (normal) or m · 2⁻¹²⁹ (e = 0, an f32 subnormal); · 2¹²⁰ rebiases
        // both to E4M3's 2^(e − 7) · 1.m and m · 2⁻⁹.
        let value = f32::from_bits(mag << 20) * Self::REBIAS;
        let value = if mag == 0x7F { f32::NAN } else { value };
        f32::from_bits(value.to_bits() | sign)
    }
}
// ANCHOR_END: e4m3

/// An FP8 E5M2 number (PyTorch's `float8_e5m2`): 1 sign, 5 exponent, 2 mantissa bits, the top
/// byte of an IEEE f16 (with its infinities and NaNs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct F8E5M2(u8);

impl F8E5M2 {
    /// The largest finite value, `0 11110 11`.
    pub const MAX: f32 = 57344.0;

    pub const fn from_bits(bits: u8) -> Self {
        F8E5M2(bits)
    }

    pub const fn to_bits(self) -> u8 {
        self.0
    }

    /// Rounds to nearest even; overflows to ±∞ (from 61440, halfway to 2¹⁶, on); NaN becomes
    /// `s 11111 11`.
    pub fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        let sign = (bits >> 24) as u8 & 0x80;
        let mag = bits & 0x7FFF_FFFF;
        let code = if mag > f32::INFINITY.to_bits() {
            0x7F // NaN
        } else if mag >= (143 << 23) {
            0x7C // |x| ≥ 2¹⁶ (∞ too): ∞
        } else if mag < (113 << 23) {
            // |x| < 2⁻¹⁴: steps of 2⁻¹⁶, rounded by adding 2⁷ (ulp 2⁻¹⁶), as E4M3's.
            let magic = f32::from_bits(134 << 23);
            ((f32::from_bits(mag) + magic).to_bits() - magic.to_bits()) as u8
        } else {
            // Rebias 127 → 15, round 23 mantissa bits to 2; a carry past 57344 gives 0x7C, ∞.
            let odd = (mag >> 21) & 1;
            ((mag - (112 << 23) + 0xF_FFFF + odd) >> 21) as u8
        };
        F8E5M2(sign | code)
    }

    /// Exact: the f16 whose top byte this is, widened.
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        f16::from_bits((self.0 as u16) << 8).to_f32()
    }
}

/// The two formats, for code that picks one at run time (a checkpoint's dtype, a benchmark row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    E4M3,
    E5M2,
}

impl Fp8Format {
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => F8E4M3::MAX,
            Fp8Format::E5M2 => F8E5M2::MAX,
        }
    }

    /// The code of `x` (see [`F8E4M3::from_f32`], [`F8E5M2::from_f32`]).
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8Format::E4M3 => F8E4M3::from_f32(x).to_bits(),
            Fp8Format::E5M2 => F8E5M2::from_f32(x).to_bits(),
        }
    }

    /// The f16's code: its exact f32, converted.
    pub fn encode_f16(self, x: f16) -> u8 {
        self.encode(x.to_f32())
    }

    /// The bf16's code: its exact f32, converted.
    pub fn encode_bf16(self, x: bf16) -> u8 {
        self.encode(x.to_f32())
    }

    /// The value of `code`, exactly.
    pub fn decode(self, code: u8) -> f32 {
        match self {
            Fp8Format::E4M3 => F8E4M3::from_bits(code).to_f32(),
            Fp8Format::E5M2 => F8E5M2::from_bits(code).to_f32(),
        }
    }
}

impl ch02::kernels::vector::ToF32 for F8E4M3 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        F8E4M3::to_f32(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of an E4M3 or E5M2 code from its definition, in f64.
    fn reference(code: u8, exp_bits: u32, man_bits: u32) -> f64 {
        let bias = (1 << (exp_bits - 1)) - 1;
        let (s, e, m) = (
            code >> 7,
            (code as u32 >> man_bits) & ((1 << exp_bits) - 1),
            code as u32 & ((1 << man_bits) - 1),
        );
        let sign = if s == 1 { -1.0 } else { 1.0 };
        let frac = m as f64 / (1u32 << man_bits) as f64;
        if e == 0 {
            sign * 2f64.powi(1 - bias) * frac
        } else {
            sign * 2f64.powi(e as i32 - bias) * (1.0 + frac)
        }
    }

    #[test]
    fn every_code_decodes_to_its_definition() {
        for code in 0..=255u8 {
            let e4m3 = F8E4M3::from_bits(code).to_f32();
            if code & 0x7F == 0x7F {
                assert!(e4m3.is_nan(), "{code:#x}");
            } else {
                assert_eq!(e4m3 as f64, reference(code, 4, 3), "e4m3 {code:#x}");
            }
            let e5m2 = F8E5M2::from_bits(code).to_f32();
            match code & 0x7F {
                0x7C => assert_eq!(e5m2.abs(), f32::INFINITY, "{code:#x}"),
                0x7D..=0x7F => assert!(e5m2.is_nan(), "{code:#x}"),
                _ => assert_eq!(e5m2 as f64, reference(code, 5, 2), "e5m2 {code:#x}"),
            }
        }
        assert_eq!(F8E4M3::from_bits(0x7E).to_f32(), F8E4M3::MAX);
        assert_eq!(F8E5M2::from_bits(0x7B).to_f32(), F8E5M2::MAX);
    }

    #[test]
    fn every_finite_code_round_trips() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for code in 0..=255u8 {
                let x = format.decode(code);
                if x.is_finite() {
                    assert_eq!(format.encode(x), code, "{format:?} {code:#x} = {x}");
                }
            }
        }
    }

    #[test]
    fn ties_round_to_even_and_the_ends_saturate_or_overflow() {
        // Between 1 (0 0111 000) and 1.125 (0 0111 001): the tie goes to the even code.
        assert_eq!(F8E4M3::from_f32(1.0625).to_bits(), 0x38);
        assert_eq!(F8E4M3::from_f32(1.0626).to_bits(), 0x39);
        assert_eq!(F8E4M3::from_f32(1.1875).to_bits(), 0x3A); // tie between 001 and 010
        assert_eq!(F8E4M3::from_f32(1e9).to_bits(), 0x7E);
        assert_eq!(F8E4M3::from_f32(f32::NEG_INFINITY).to_bits(), 0xFE);
        assert_eq!(F8E4M3::from_f32(-f32::NAN).to_bits(), 0xFF);
        assert_eq!(F8E5M2::from_f32(61439.0).to_bits(), 0x7B);
        assert_eq!(F8E5M2::from_f32(61440.0).to_bits(), 0x7C);
        assert_eq!(F8E5M2::from_f32(-1e30).to_bits(), 0xFC);
        // The smallest subnormals, and below half of them: zero, with the sign kept.
        assert_eq!(F8E4M3::from_f32(2f32.powi(-9)).to_bits(), 0x01);
        assert_eq!(F8E4M3::from_f32(-(2f32.powi(-11))).to_bits(), 0x80);
        assert_eq!(F8E5M2::from_f32(2f32.powi(-16)).to_bits(), 0x01);
    }
}
