//! The integer dot products with AVX2 intrinsics: 32 byte products per instruction.
//!
//! The core step is `_mm256_maddubs_epi16(u, s)`: 32 unsigned bytes `u` times 32 signed bytes
//! `s`, adjacent pairs summed into 16 i16; then `_mm256_madd_epi16` by ones (or by a sub-block's
//! scale) sums pairs of those into 8 i32. `maddubs` saturates at ±32767, so every use below
//! keeps `2 · max u · max |s|` under it: Q8_0 `2·128·127 = 32512` (the weight's sign moved onto
//! the activation, `|−128| = 128` read unsigned), Q4_0 `2·8·127` (the same sign trick on
//! `q − 8`), Q4_1 and Q4_K `2·15·127`, Q5 `2·31·127`, Q6 `2·63·127`
//! (activations are in −127..=127). Integer sums are exact, so each function returns exactly
//! what its [`super::portable`] twin returns: the f32 steps after the sums are the same.
//!
//! Each kernel is a safe function taking an [`Avx2Fma`] proof (only run-time detection makes
//! one), checking the lengths its pointer arithmetic relies on, then calling its `unsafe` body
//! compiled with AVX2.

use std::arch::x86_64::*;

use ch02::kernels::Avx2Fma;

use super::portable::mins_dot;
use super::{Act32, Act256, LANES, acc_d, acc_k, sum_lanes};
use crate::blocks::f16_at;
use crate::blocks::q4_k::scale_min;

/// The sum of 8 i32 lanes.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// 32 unsigned × signed byte products, summed into 8 i32 lanes (4 products each).
///
/// # Safety
/// The CPU must support AVX2; `2 · u · |s|` must stay below 32768 for every pair.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// 32 unaligned bytes at `p`.
///
/// # Safety
/// The CPU must support AVX2; `p` must point to 32 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes at `p` (an unaligned load).
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// A Q4 block's 16 bytes of nibbles as 32 bytes in element order (low nibbles, then high).
///
/// # Safety
/// The CPU must support AVX2; `p` must point to 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn nibbles16(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at `p` (an unaligned load).
    let raw = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let m4 = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(raw, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), m4);
    _mm256_set_m128i(hi, lo)
}

/// Bit `j` (0..8) of each byte of `qh`, moved to bit 4: 16-bit shifts, masked per byte.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn high_bit(qh: __m256i, j: i32) -> __m256i {
    let bit = _mm256_and_si256(
        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
        _mm256_set1_epi8(1),
    );
    _mm256_slli_epi16::<4>(bit)
}

macro_rules! safe_kernel {
    ($(#[$doc:meta])* $name:ident, $body:ident, $act:ty, $bytes:expr) => {
        $(#[$doc])*
        ///
        /// Panics unless `row` is exactly one block per activation block.
        pub fn $name(_cpu: Avx2Fma, row: &[u8], acts: &[$act]) -> f32 {
            assert_eq!(row.len(), acts.len() * $bytes, "one weight block per activation block");
            // SAFETY: `_cpu` proves the CPU has AVX2, and the lengths were checked above.
            unsafe { $body(row, acts) }
        }
    };
}

safe_kernel!(
    /// One Q8_0 row with one token's activation blocks.
    dot_q8_0, dot_q8_0_avx2, Act32, 34
);
safe_kernel!(
    /// One Q4_0 row with one token's activation blocks.
    dot_q4_0, dot_q4_0_avx2, Act32, 18
);
safe_kernel!(
    /// One Q4_1 row with one token's activation blocks.
    dot_q4_1, dot_q4_1_avx2, Act32, 20
);
safe_kernel!(
    /// One Q4_K row with one token's Q8_K activation blocks.
    dot_q4_k, dot_q4_k_avx2, Act256, 144
);
safe_kernel!(
    /// One Q5_K row with one token's Q8_K activation blocks.
    dot_q5_k, dot_q5_k_avx2, Act256, 176
);
safe_kernel!(
    /// One Q6_K row with one token's Q8_K activation blocks.
    dot_q6_k, dot_q6_k_avx2, Act256, 210
);

/// `acc + (d_w · d_x) · lanes`, lane by lane (multiply, then add: no fusing, as the portable
/// code does). A safe function with a target feature: only callers compiled with AVX2 (the
/// kernels' bodies) can call it without `unsafe`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn acc_lanes(acc: __m256, d: f32, dx: f32, lanes: __m256i) -> __m256 {
    _mm256_add_ps(
        acc,
        _mm256_mul_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(lanes)),
    )
}

/// The 8 lanes summed in [`sum_lanes`]' order (safe with a target feature, like [`acc_lanes`]).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn sum_acc(acc: __m256) -> f32 {
    let mut lanes = [0.0f32; LANES];
    // SAFETY: `lanes` holds 8 f32, the store's width.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    sum_lanes(&lanes)
}

/// # Safety
/// The CPU must support AVX2; `row.len() == acts.len() * 34`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q8_0_avx2(row: &[u8], acts: &[Act32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, a) in row.chunks_exact(34).zip(acts) {
        // SAFETY: AVX2 is present (caller); `b` is 34 bytes, so bytes 2..34 are readable, and
        // `a.q` is 32 bytes.
        let lanes = unsafe {
            let w = load32(b.as_ptr().add(2));
            let x = load32(a.q.as_ptr() as *const u8);
            // |w| · (x · sign(w)) = w · x, with the unsigned operand first.
            dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
        };
        acc = acc_lanes(acc, f16_at(b, 0), a.d, lanes);
    }
    sum_acc(acc)
}

/// # Safety
/// The CPU must support AVX2; `row.len() == acts.len() * 18`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q4_0_avx2(row: &[u8], acts: &[Act32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let eight = _mm256_set1_epi8(8);
    for (b, a) in row.chunks_exact(18).zip(acts) {
        // SAFETY: AVX2 is present (caller); `b` is 18 bytes (nibbles at 2..18), `a.q` 32 bytes.
        let lanes = unsafe {
            let w = _mm256_sub_epi8(nibbles16(b.as_ptr().add(2)), eight); // q − 8, in −8..8
            let x = load32(a.q.as_ptr() as *const u8);
            dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
        };
        acc = acc_lanes(acc, f16_at(b, 0), a.d, lanes);
    }
    sum_acc(acc)
}

/// # Safety
/// The CPU must support AVX2; `row.len() == acts.len() * 20`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q4_1_avx2(row: &[u8], acts: &[Act32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = 0.0f32;
    for (b, a) in row.chunks_exact(20).zip(acts) {
        // SAFETY: AVX2 is present (caller); `b` is 20 bytes (nibbles at 4..20), `a.q` 32 bytes.
        let lanes = unsafe {
            let u = nibbles16(b.as_ptr().add(4));
            dot_u8_i8(u, load32(a.q.as_ptr() as *const u8))
        };
        acc = acc_lanes(acc, f16_at(b, 0), a.d, lanes);
        acc_m = acc_d(acc_m, f16_at(b, 2), a.d, a.sum);
    }
    sum_acc(acc) + acc_m
}

/// # Safety
/// The CPU must support AVX2; `row.len() == acts.len() * 144`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q4_k_avx2(row: &[u8], acts: &[Act256]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(144).zip(acts) {
        let (sc, m) = scale_min(&b[4..16]);
        // SAFETY: AVX2 is present (caller); `b` is 144 bytes, so the four 32-byte loads at
        // 16 + 32i (i < 4) end by byte 144; `a.q` is 256 bytes, read at 64i and 64i + 32.
        let isum = unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let mut sums = _mm256_setzero_si256();
            for i in 0..4 {
                let raw = load32(b.as_ptr().add(16 + 32 * i));
                let lo = _mm256_and_si256(raw, m4); // sub-block 2i
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4); // sub-block 2i + 1
                let x_lo = load32(a.q.as_ptr().add(64 * i) as *const u8);
                let x_hi = load32(a.q.as_ptr().add(64 * i + 32) as *const u8);
                let p_lo = _mm256_maddubs_epi16(lo, x_lo);
                let p_hi = _mm256_maddubs_epi16(hi, x_hi);
                let s_lo = _mm256_set1_epi16(i16::from(sc[2 * i]));
                let s_hi = _mm256_set1_epi16(i16::from(sc[2 * i + 1]));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(p_lo, s_lo));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(p_hi, s_hi));
            }
            hsum_i32(sums)
        };
        let imin = mins_dot(&m, &a.bsums);
        acc = acc_k(acc, f16_at(b, 0), f16_at(b, 2), a.d, isum, imin);
    }
    acc
}

/// # Safety
/// The CPU must support AVX2; `row.len() == acts.len() * 176`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q5_k_avx2(row: &[u8], acts: &[Act256]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(176).zip(acts) {
        let (sc, m) = scale_min(&b[4..16]);
        // SAFETY: AVX2 is present (caller); `b` is 176 bytes: qh at 16..48, and the four
        // 32-byte loads of qs at 48 + 32i (i < 4) end by byte 176; `a.q` is 256 bytes, read at
        // 64i and 64i + 32.
        let isum = unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let qh = load32(b.as_ptr().add(16));
            let mut sums = _mm256_setzero_si256();
            for i in 0..4 {
                let raw = load32(b.as_ptr().add(48 + 32 * i));
                let j = 2 * i as i32;
                let lo = _mm256_or_si256(_mm256_and_si256(raw, m4), high_bit(qh, j));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4),
                    high_bit(qh, j + 1),
                );
                let x_lo = load32(a.q.as_ptr().add(64 * i) as *const u8);
                let x_hi = load32(a.q.as_ptr().add(64 * i + 32) as *const u8);
                let p_lo = _mm256_maddubs_epi16(lo, x_lo);
                let p_hi = _mm256_maddubs_epi16(hi, x_hi);
                let s_lo = _mm256_set1_epi16(i16::from(sc[2 * i]));
                let s_hi = _mm256_set1_epi16(i16::from(sc[2 * i + 1]));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(p_lo, s_lo));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(p_hi, s_hi));
            }
            hsum_i32(sums)
        };
        let imin = mins_dot(&m, &a.bsums);
        acc = acc_k(acc, f16_at(b, 0), f16_at(b, 2), a.d, isum, imin);
    }
    acc
}

/// # Safety
/// The CPU must support AVX2; `row.len() == acts.len() * 210`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q6_k_avx2(row: &[u8], acts: &[Act256]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(210).zip(acts) {
        let scales = &b[192..208];
        let sc = |j: usize| i16::from(scales[j] as i8);
        // SAFETY: AVX2 is present (caller); `b` is 210 bytes: the ql loads at 64h and 64h + 32
        // (h < 2) end by byte 128, the qh load at 128 + 32h by byte 192; `a.q` is 256 bytes,
        // read at 128h + 32k (k < 4).
        let isum = unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let m2 = _mm256_set1_epi8(0x03);
            let mut sums = _mm256_setzero_si256();
            for h in 0..2 {
                let ql_a = load32(b.as_ptr().add(64 * h));
                let ql_b = load32(b.as_ptr().add(64 * h + 32));
                let qh = load32(b.as_ptr().add(128 + 32 * h));
                let lows = [
                    _mm256_and_si256(ql_a, m4),
                    _mm256_and_si256(ql_b, m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql_a), m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql_b), m4),
                ];
                for (k, low) in lows.into_iter().enumerate() {
                    let shift = _mm_cvtsi32_si128(2 * k as i32);
                    let high = _mm256_and_si256(_mm256_srl_epi16(qh, shift), m2);
                    let u = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high)); // 0..64
                    let x = load32(a.q.as_ptr().add(128 * h + 32 * k) as *const u8);
                    let p = _mm256_maddubs_epi16(u, x);
                    // Lanes 0..8 are elements 0..16 (one sub-block), 8..16 the next.
                    let j = 8 * h + 2 * k;
                    let s = _mm256_set_m128i(_mm_set1_epi16(sc(j + 1)), _mm_set1_epi16(sc(j)));
                    sums = _mm256_add_epi32(sums, _mm256_madd_epi16(p, s));
                }
            }
            hsum_i32(sums)
        };
        let offset: i32 = (0..16)
            .map(|j| i32::from(sc(j)) * i32::from(a.bsums[j]))
            .sum();
        acc = acc_d(acc, f16_at(b, 208), a.d, isum - 32 * offset);
    }
    acc
}
