//! Dot products over 8-bit weight codes: f32 activations times E4M3 codes (FP8 weights) or int8
//! codes (W8A16, int8 weights with f32 activations), the codes widened to f32 as they are read.
//! (W8A8's int8 times int8 runs on the tiles of `kernels::int8` where a CPU has AVX2.)
//!
//! ```text
//! E4M3  s eeee mmm  →  sign-extended to 32 bits, shifted left by 20, AND 0x87F0_0000:
//!       s 0000 eeee mmm 0…0   (the sign where an f32 keeps it, e and m where an f32 keeps
//!                              its exponent's low bits and its mantissa's high ones)
//!       × 2¹²⁰ as an f32      →  2^(e − 7) · 1.m, or m · 2⁻⁹ when e = 0 (as `F8E4M3::to_f32`)
//! int8  q                  →  sign-extended to 32 bits, converted to f32 (exact: |q| ≤ 128)
//! ```
//! Decode reads each weight once per token, so these loops are the whole of a decode's
//! products (and of a prefill below the GEMM's threshold). The f32 loop keeps four accumulators
//! of eight lanes, four multiply-adds in flight, where one would wait on its own previous add.
//! A NaN code (0x7F, 0xFF) would come out as ±480 in the E4M3 loop: layers holding one keep
//! chapter 2's generic loop, which widens it to NaN.

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

/// `Σ_i x[i] · q[i]` over `x.len().min(q.len())` elements, in f32: int8 codes, each widened
/// exactly; products and sums round as [`dot_e4m3`]'s do.
pub fn dot_int8(isa: Isa, x: &[f32], q: &[i8]) -> f32 {
    match isa {
        Isa::Portable => portable_dot_int8(x, q),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma(_) => {
            // SAFETY: as in `dot_e4m3`.
            unsafe { avx2::dot(x, q) }
        }
    }
}

/// 16 independent lanes, which the compiler vectorises as far as the target allows.
fn portable_dot_int8(x: &[f32], q: &[i8]) -> f32 {
    const LANES: usize = 16;
    let n = x.len().min(q.len());
    let main = n - n % LANES;
    let mut acc = [0f32; LANES];
    for (cx, cq) in (x[..main].chunks_exact(LANES)).zip(q[..main].chunks_exact(LANES)) {
        for k in 0..LANES {
            acc[k] += cx[k] * f32::from(cq[k]);
        }
    }
    let tail: f32 = (x[main..n].iter().zip(&q[main..n]))
        .map(|(&v, &c)| v * f32::from(c))
        .sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::fp8::F8E4M3;

    /// An 8-bit code that widens to f32 exactly, alone or eight at a time.
    pub trait Code: Copy {
        fn to_f32(self) -> f32;

        /// Eight codes at `w` as f32 lanes.
        ///
        /// # Safety
        /// AVX2 must be present; `w` must point to 8 readable codes.
        unsafe fn widen8(w: *const Self) -> __m256;
    }

    impl Code for F8E4M3 {
        #[inline(always)]
        fn to_f32(self) -> f32 {
            F8E4M3::to_f32(self)
        }

        /// Exact for every code but a NaN one (read as ±480).
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn widen8(w: *const F8E4M3) -> __m256 {
            // SAFETY: 8 readable bytes at `w` (the caller's); `F8E4M3` is a transparent `u8`.
            let codes = unsafe { _mm_loadl_epi64(w as *const __m128i) };
            let bits = _mm256_slli_epi32::<20>(_mm256_cvtepi8_epi32(codes));
            let bits = _mm256_and_si256(bits, _mm256_set1_epi32(0x87F0_0000u32 as i32));
            let rebias = _mm256_set1_ps(F8E4M3::REBIAS);
            _mm256_mul_ps(_mm256_castsi256_ps(bits), rebias)
        }
    }

    impl Code for i8 {
        #[inline(always)]
        fn to_f32(self) -> f32 {
            f32::from(self)
        }

        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn widen8(w: *const i8) -> __m256 {
            // SAFETY: 8 readable bytes at `w` (the caller's).
            let codes = unsafe { _mm_loadl_epi64(w as *const __m128i) };
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes))
        }
    }

    /// `Σ_i x[i] · w[i]` over `x.len().min(w.len())` elements, each code as `widen8` reads it.
    ///
    /// # Safety
    /// AVX2 and FMA must be present.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot<C: Code>(x: &[f32], w: &[C]) -> f32 {
        let n = x.len().min(w.len());
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (a, acc) in acc.iter_mut().enumerate() {
                let j = i + 8 * a;
                // SAFETY: j + 8 ≤ n, within both slices.
                let (xv, wv) = unsafe { (_mm256_loadu_ps(xp.add(j)), C::widen8(wp.add(j))) };
                *acc = _mm256_fmadd_ps(xv, wv, *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n, within both slices.
            let (xv, wv) = unsafe { (_mm256_loadu_ps(xp.add(i)), C::widen8(wp.add(i))) };
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

    /// Placements of one code: in a 32-code block (first, middle, last), in the 8-code loop
    /// after it, and in the scalar tail.
    const PLACES: [(usize, usize); 7] = [
        (32, 0),
        (32, 13),
        (32, 31),
        (45, 32),
        (45, 39),
        (45, 40),
        (45, 44),
    ];

    /// `dot(x, w)` for `w` of mixed codes at lengths that leave every tail of both loops (0 to
    /// 80) and longer ones is within f32's rounding of the f64 sum: each of n products and n
    /// additions rounds once.
    fn sums_round_as_f32<C: Copy>(
        codes: &[C],
        value: impl Fn(C) -> f32,
        dot: impl Fn(Isa, &[f32], &[C]) -> f32,
    ) {
        for n in (0..=80).chain([100, 254]) {
            let w: Vec<C> = (0..n).map(|i| codes[(i * 37 + n) % codes.len()]).collect();
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 201) as f32 / 50.0 - 2.0)
                .collect();
            let (mut sum, mut mag) = (0.0f64, 0.0f64);
            for (x, &w) in x.iter().zip(&w) {
                let term = f64::from(*x) * f64::from(value(w));
                sum += term;
                mag += term.abs();
            }
            for isa in Isa::available() {
                let got = f64::from(dot(isa, &x, &w));
                let bound = n as f64 * f64::from(f32::EPSILON) * mag;
                assert!((got - sum).abs() <= bound, "{isa:?} n={n}: {got} vs {sum}");
            }
        }
    }

    /// Every finite E4M3 code, alone at each of [`PLACES`], comes out as exactly its value (−0
    /// as +0: the sum starts at +0); mixed codes sum within f32's rounding; on every
    /// instruction set.
    #[test]
    fn every_e4m3_code_widens_exactly_and_sums_round_as_f32() {
        let finite: Vec<F8E4M3> = (0..=255u8)
            .map(F8E4M3::from_bits)
            .filter(|c| !c.to_f32().is_nan())
            .collect();
        for isa in Isa::available() {
            for &code in &finite {
                for (n, p) in PLACES {
                    let mut w = vec![F8E4M3::from_bits(0); n];
                    w[p] = code;
                    let got = dot_e4m3(isa, &vec![1.0; n], &w);
                    assert_eq!(got, code.to_f32(), "{isa:?} {code:?} at {p}");
                }
            }
        }
        sums_round_as_f32(&finite, F8E4M3::to_f32, dot_e4m3);
    }

    /// Every int8 code, alone at each of [`PLACES`], comes out as exactly its value; mixed
    /// codes sum within f32's rounding; on every instruction set.
    #[test]
    fn every_int8_code_widens_exactly_and_sums_round_as_f32() {
        let codes: Vec<i8> = (i8::MIN..=i8::MAX).collect();
        for isa in Isa::available() {
            for &code in &codes {
                for (n, p) in PLACES {
                    let mut q = vec![0i8; n];
                    q[p] = code;
                    let got = dot_int8(isa, &vec![1.0; n], &q);
                    assert_eq!(got, f32::from(code), "{isa:?} {code} at {p}");
                }
            }
        }
        sums_round_as_f32(&codes, f32::from, dot_int8);
    }
}
