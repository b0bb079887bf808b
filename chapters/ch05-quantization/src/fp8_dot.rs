//! The one-token FP8 product: `Σ_i x[i] · w[i]` over E4M3 codes, widened as they are read.
//!
//! ```text
//! code  s eeee mmm  →  sign-extended to 32 bits, shifted left by 20, AND 0x87F0_0000:
//!       s 0000 eeee mmm 0…0   (the sign where an f32 keeps it, e and m where an f32 keeps
//!                              its exponent's low bits and its mantissa's high ones)
//!       × 2¹²⁰ as an f32      →  2^(e − 7) · 1.m, or m · 2⁻⁹ when e = 0 (as `F8E4M3::to_f32`)
//! ```
//! Decode reads each weight once per token, so this loop is the whole of an FP8 decode's
//! products. Four accumulators of eight lanes keep four multiply-adds in flight, where one
//! would wait on its own previous add. A NaN code (0x7F, 0xFF) would come out as ±480 here:
//! layers holding one keep chapter 2's generic loop, which widens it to NaN.

use ch02::kernels::Isa;
use ch02::kernels::vector::dot;

use crate::fp8::F8E4M3;

/// `Σ_i x[i] · w[i]` over `x.len().min(w.len())` elements, in f32, for `w` that holds no NaN
/// code (the AVX2 loop reads one as ±480; callers with one use chapter 2's `dot`). Each code
/// widens exactly; products and sums round in f32 (unrounded inside the AVX2 loop's fused
/// multiply-adds), in an order of their own per instruction set.
pub fn dot_e4m3(isa: Isa, x: &[f32], w: &[F8E4M3]) -> f32 {
    match isa {
        Isa::Portable => dot(x, w),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma(_) => {
            // SAFETY: an `Isa::Avx2Fma` exists only once run-time detection found AVX2 and
            // FMA on this CPU.
            unsafe { avx2::dot(x, w) }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::fp8::F8E4M3;

    /// Eight codes at `w` as f32 lanes, exactly for every code but a NaN one (read as ±480).
    ///
    /// # Safety
    /// AVX2 must be present; `w` must point to 8 readable codes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen8(w: *const F8E4M3) -> __m256 {
        // SAFETY: 8 readable bytes at `w` (the caller's); `F8E4M3` is a transparent `u8`.
        let codes = unsafe { _mm_loadl_epi64(w as *const __m128i) };
        let bits = _mm256_slli_epi32::<20>(_mm256_cvtepi8_epi32(codes));
        let bits = _mm256_and_si256(bits, _mm256_set1_epi32(0x87F0_0000u32 as i32));
        let rebias = _mm256_set1_ps(F8E4M3::REBIAS);
        _mm256_mul_ps(_mm256_castsi256_ps(bits), rebias)
    }

    /// `Σ_i x[i] · w[i]`; a NaN code of `w` counts as ±480.
    ///
    /// # Safety
    /// AVX2 and FMA must be present.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(x: &[f32], w: &[F8E4M3]) -> f32 {
        let n = x.len().min(w.len());
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (a, acc) in acc.iter_mut().enumerate() {
                let j = i + 8 * a;
                // SAFETY: j + 8 ≤ n, within both slices.
                let (xv, wv) = unsafe { (_mm256_loadu_ps(xp.add(j)), widen8(wp.add(j))) };
                *acc = _mm256_fmadd_ps(xv, wv, *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n, within both slices.
            let (xv, wv) = unsafe { (_mm256_loadu_ps(xp.add(i)), widen8(wp.add(i))) };
            acc[0] = _mm256_fmadd_ps(xv, wv, acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        let tail: f32 = (x[i..n].iter().zip(&w[i..n]))
            .map(|(x, w)| x * w.to_f32())
            .sum();
        lanes.iter().sum::<f32>() + tail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite code, alone at positions of a 32-code block and of a tail, comes out as
    /// exactly its value (−0 as +0: the sum starts at +0); mixed codes at every length (tails
    /// included) sum within f32's rounding of the f64 sum; on every instruction set.
    #[test]
    fn every_code_widens_exactly_and_sums_round_as_f32() {
        for isa in Isa::available() {
            for code in (0..=255u8).map(F8E4M3::from_bits) {
                if code.to_f32().is_nan() {
                    continue;
                }
                for (n, p) in [(32, 0), (32, 13), (32, 31), (45, 40), (45, 44)] {
                    let mut w = vec![F8E4M3::from_bits(0); n];
                    w[p] = code;
                    let got = dot_e4m3(isa, &vec![1.0; n], &w);
                    assert_eq!(got, code.to_f32(), "{isa:?} {code:?} at {p}");
                }
            }
        }
        let finite: Vec<F8E4M3> = (0..=255u8)
            .map(F8E4M3::from_bits)
            .filter(|c| !c.to_f32().is_nan())
            .collect();
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 64, 100, 254] {
            let w: Vec<F8E4M3> = (0..n)
                .map(|i| finite[(i * 37 + n) % finite.len()])
                .collect();
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 201) as f32 / 50.0 - 2.0)
                .collect();
            let (mut sum, mut mag) = (0.0f64, 0.0f64);
            for (x, w) in x.iter().zip(&w) {
                let term = f64::from(*x) * f64::from(w.to_f32());
                sum += term;
                mag += term.abs();
            }
            for isa in Isa::available() {
                let got = f64::from(dot_e4m3(isa, &x, &w));
                // Each of n products and n additions rounds once: n · 2⁻²³ of the magnitudes.
                let bound = n as f64 * f64::from(f32::EPSILON) * mag;
                assert!((got - sum).abs() <= bound, "{isa:?} n={n}: {got} vs {sum}");
            }
        }
    }
}
