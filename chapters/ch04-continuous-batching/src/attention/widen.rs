//! Stored K/V elements widened to f32 vectors, by the pool's dtype: one load and one or two
//! conversions for f32, bf16 and int8, about ten instructions for FP8 E4M3, the same values as
//! [`ToF32::to_f32`](ch02::kernels::vector::ToF32) lane by lane (exact for every dtype).
//!
//! ```text
//! f32       load
//! bf16      u16 → u32 lanes, << 16                  (the top half of an f32)
//! int8      i8 → i32 lanes, → f32
//! fp8_e4m3  u8 → u32 lanes; (mag << 20) as f32 · 2¹²⁰, NaN where mag = 0x7F, | sign << 24
//! ```
//! Written out rather than left to the compiler: from `to_f32` on each lane it made E4M3 codes
//! one byte at a time (some 20 shuffles and an integer multiply more per 8 codes, at a third of
//! int8's speed in decode attention), and how well it did for the others changed with the
//! shape of the loop around the call.

use std::arch::x86_64::*;

use ch03::{KvDtype, KvElement};

/// `size_of::<K>()` is the size of an element of `K::DTYPE`: what lets the loads below read
/// `K`s as that dtype's bits (checked when the code is compiled for `K`).
const fn element_size_matches<K: KvElement>() -> bool {
    size_of::<K>() == K::DTYPE.size()
}

// ANCHOR: widen8
/// Eight stored elements widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn widen<K: KvElement>(x: &[K; 8]) -> __m256 {
    const { assert!(element_size_matches::<K>()) };
    let p = x.as_ptr();
    // SAFETY: `x` is 8 elements of `K::DTYPE.size()` bytes each (the assertion above), every
    // byte initialized (KvElement's contract: no padding), so each load reads inside `x`.
    unsafe {
        match K::DTYPE {
            KvDtype::F32 => _mm256_loadu_ps(p.cast()),
            KvDtype::Bf16 => {
                let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
            }
            KvDtype::Int8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))),
            KvDtype::Fp8E4M3 => e4m3(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))),
        }
    }
}
// ANCHOR_END: widen8

/// The f32 values of eight E4M3 codes, one in the low byte of each lane (chapter 5's
/// `F8E4M3::to_f32`, eight at a time).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn e4m3(codes: __m256i) -> __m256 {
    let mag = _mm256_and_si256(codes, _mm256_set1_epi32(0x7F));
    let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(codes, _mm256_set1_epi32(0x80)));
    // e and m where an f32 keeps them: 2^(e − 127) · 1.m or m · 2⁻¹²⁹; · 2¹²⁰ rebiases both.
    let value = _mm256_mul_ps(
        _mm256_castsi256_ps(_mm256_slli_epi32::<20>(mag)),
        _mm256_set1_ps(f32::from_bits((127 + 120) << 23)),
    );
    let nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
    let value = _mm256_blendv_ps(value, _mm256_set1_ps(f32::NAN), nan);
    _mm256_or_ps(value, _mm256_castsi256_ps(sign))
}

/// Sixteen stored elements widened to f32.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) fn widen16<K: KvElement>(x: &[K; 16]) -> __m512 {
    const { assert!(element_size_matches::<K>()) };
    let p = x.as_ptr();
    // SAFETY: as in `widen`, for 16 elements.
    unsafe {
        match K::DTYPE {
            KvDtype::F32 => _mm512_loadu_ps(p.cast()),
            KvDtype::Bf16 => bf16_lanes(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))),
            KvDtype::Int8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))),
            KvDtype::Fp8E4M3 => e4m3_16(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))),
        }
    }
}

/// `[a | b]`: two rows' eight elements widened into one vector, `a` in the low eight lanes.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) fn widen_pair<K: KvElement>(a: &[K; 8], b: &[K; 8]) -> __m512 {
    const { assert!(element_size_matches::<K>()) };
    let (a, b) = (a.as_ptr(), b.as_ptr());
    // SAFETY: as in `widen`, for each of `a` and `b`.
    unsafe {
        match K::DTYPE {
            KvDtype::F32 => {
                let low = _mm512_castpd256_pd512(_mm256_loadu_pd(a.cast()));
                _mm512_castpd_ps(_mm512_insertf64x4::<1>(low, _mm256_loadu_pd(b.cast())))
            }
            KvDtype::Bf16 => {
                let both = _mm256_inserti128_si256::<1>(
                    _mm256_castsi128_si256(_mm_loadu_si128(a.cast())),
                    _mm_loadu_si128(b.cast()),
                );
                bf16_lanes(_mm512_cvtepu16_epi32(both))
            }
            KvDtype::Int8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes_pair(a, b))),
            KvDtype::Fp8E4M3 => e4m3_16(_mm512_cvtepu8_epi32(bytes_pair(a, b))),
        }
    }
}

/// The eight bytes at `a` then the eight at `b`.
///
/// # Safety
/// `a` and `b` each point at 8 readable bytes.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn bytes_pair<T>(a: *const T, b: *const T) -> __m128i {
    // SAFETY: the caller's.
    unsafe { _mm_unpacklo_epi64(_mm_loadl_epi64(a.cast()), _mm_loadl_epi64(b.cast())) }
}

/// bf16 bits, one in the low half of each lane, as f32.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn bf16_lanes(bits: __m512i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
}

/// [`e4m3`] on sixteen lanes.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn e4m3_16(codes: __m512i) -> __m512 {
    let mag = _mm512_and_si512(codes, _mm512_set1_epi32(0x7F));
    let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(codes, _mm512_set1_epi32(0x80)));
    let value = _mm512_mul_ps(
        _mm512_castsi512_ps(_mm512_slli_epi32::<20>(mag)),
        _mm512_set1_ps(f32::from_bits((127 + 120) << 23)),
    );
    let nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
    let value = _mm512_mask_blend_ps(nan, value, _mm512_set1_ps(f32::NAN));
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ch02::kernels::vector::ToF32;
    use half::bf16;

    /// An E4M3 code read from the format's definition (sign, 4 exponent bits of bias 7, 3
    /// mantissa bits, no infinities, NaN at magnitude 0x7F), not from chapter 5's bit trick.
    #[derive(Debug, Clone, Copy, Default)]
    #[repr(transparent)]
    struct E4M3(u8);

    impl ToF32 for E4M3 {
        fn to_f32(self) -> f32 {
            let (e, m) = ((self.0 >> 3) & 0xF, self.0 & 7);
            let magnitude = if self.0 & 0x7F == 0x7F {
                f32::NAN
            } else if e == 0 {
                m as f32 * 2f32.powi(-9)
            } else {
                (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7)
            };
            if self.0 & 0x80 != 0 {
                -magnitude
            } else {
                magnitude
            }
        }
    }

    // SAFETY: one byte (`repr(transparent)`), an E4M3 code; all-zero bits are +0.
    unsafe impl KvElement for E4M3 {
        const DTYPE: KvDtype = KvDtype::Fp8E4M3;
        fn from_f32(_: f32) -> Self {
            unreachable!("the test only reads codes")
        }
    }

    /// An int8 code.
    #[derive(Debug, Clone, Copy, Default)]
    #[repr(transparent)]
    struct Int8(i8);

    impl ToF32 for Int8 {
        fn to_f32(self) -> f32 {
            self.0 as f32
        }
    }

    // SAFETY: one byte (`repr(transparent)`), an int8 code; all-zero bits are 0.
    unsafe impl KvElement for Int8 {
        const DTYPE: KvDtype = KvDtype::Int8;
        fn from_f32(_: f32) -> Self {
            unreachable!("the test only reads codes")
        }
    }

    /// Whether `got` holds `want`'s values bit for bit (any NaN for a NaN).
    fn same(got: &[f32], want: &[f32]) -> bool {
        got.iter()
            .zip(want)
            .all(|(g, w)| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()))
    }

    /// Every widening of `elements` (16 at a time, and as two rows of 8) against `to_f32`.
    fn check<K: KvElement + std::fmt::Debug>(elements: &[K]) {
        let want: Vec<f32> = elements.iter().map(|e| e.to_f32()).collect();
        for (x, want) in elements.as_chunks::<16>().0.iter().zip(want.chunks(16)) {
            let (a, b) = x.split_at(8);
            let (a, b): (&[K; 8], &[K; 8]) = (a.try_into().unwrap(), b.try_into().unwrap());
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                let mut got = [0.0f32; 16];
                // SAFETY: the CPU has AVX2 and FMA (checked above); `got` holds 16 f32.
                unsafe {
                    _mm256_storeu_ps(got.as_mut_ptr(), widen(a));
                    _mm256_storeu_ps(got[8..].as_mut_ptr(), widen(b));
                }
                assert!(same(&got, want), "widen {x:?}: {got:?} != {want:?}");
            }
            if is_x86_feature_detected!("avx512f") {
                for got in [
                    // SAFETY: the CPU has AVX-512F (checked above), and AVX2 and FMA with it.
                    unsafe { widen16(x) },
                    unsafe { widen_pair(a, b) },
                ] {
                    let mut lanes = [0.0f32; 16];
                    // SAFETY: as above; `lanes` holds 16 f32.
                    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), got) };
                    assert!(same(&lanes, want), "{x:?}: {lanes:?} != {want:?}");
                }
            }
        }
    }

    #[test]
    fn every_byte_code_widens_to_its_value() {
        check(&(0..=255u8).map(E4M3).collect::<Vec<_>>());
        check(&(0..=255u8).map(|c| Int8(c as i8)).collect::<Vec<_>>());
    }

    #[test]
    fn every_bf16_and_random_f32_widen_to_their_values() {
        let bf16s: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        check(&bf16s);
        // A fixed-seed walk over f32 bit patterns (NaNs, infinities, subnormals among them).
        let mut bits = 0x9E37_79B9u32;
        let f32s: Vec<f32> = (0..4096)
            .map(|_| {
                bits ^= bits << 13;
                bits ^= bits >> 17;
                bits ^= bits << 5;
                f32::from_bits(bits)
            })
            .collect();
        check(&f32s);
    }
}
