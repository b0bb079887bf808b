//! The integer dot products with AVX2 intrinsics: 32 byte products per instruction.
//!
//! The core step is `_mm256_maddubs_epi16(u, s)`: 32 unsigned bytes `u` times 32 signed bytes
//! `s`, adjacent pairs summed into 16 i16; then `_mm256_madd_epi16` by ones (or by a sub-block's
//! scale) sums pairs of those into 8 i32. `maddubs` saturates at ±32767, so every use below
//! keeps `2 · max u · max |s|` under it: Q8_0 `2·128·127 = 32512` (the weight's sign moved onto
//! the activation, `|−128| = 128` read unsigned), Q4_0 `2·8·127` (the same sign trick on
//! `q − 8`), Q5_0 `2·16·127` (`q − 16`), Q4_1 and Q4_K `2·15·127`, Q5 `2·31·127`, Q6 `2·63·127`
//! (activations are in −127..=127). Integer sums are exact, so each function returns exactly what
//! its [`super::portable`] twin returns: the f32 steps after the sums are the same.
//!
//! This file holds the K-quants' kernels, which read rows as the file stores them, and the
//! helpers the 32-element formats' interleaved tiles (`tiles.rs`) share with them.
//!
//! Each kernel is a safe function taking a proof ([`Avx2Fma`], or [`Avx2F16c`] for the tiles;
//! only run-time detection makes one), checking the lengths its pointer arithmetic relies on,
//! then calling its `unsafe` body compiled with those instruction sets.

use std::arch::x86_64::*;

use ch02::kernels::{Avx2Fma, Isa};

use super::portable::mins_dot;
use super::{Act32, Act256, acc_k};
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
pub(super) unsafe fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// 32 unaligned bytes at `p`.
///
/// # Safety
/// The CPU must support AVX2; `p` must point to 32 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes at `p` (an unaligned load).
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// The 4 activation bytes `q[at..at + 4]` in every i32 lane: the word a tile multiplies with
/// 4 weights of each of 8 interleaved rows.
///
/// # Safety
/// The CPU must support AVX2; `at + 4 ≤ q.len()`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn broadcast4(q: &[i8], at: usize) -> __m256i {
    debug_assert!(at + 4 <= q.len());
    // SAFETY: bytes at..at + 4 of `q` (caller).
    _mm256_set1_epi32(unsafe { (q.as_ptr().add(at) as *const i32).read_unaligned() })
}

/// Bit `j` (0..8) of each byte of `qh`, moved to bit 4: 16-bit shifts, masked per byte.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn high_bit(qh: __m256i, j: i32) -> __m256i {
    let bit = _mm256_and_si256(
        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
        _mm256_set1_epi8(1),
    );
    _mm256_slli_epi16::<4>(bit)
}

macro_rules! safe_kernel {
    ($(#[$doc:meta])* $name:ident, $body:ident, $bytes:expr) => {
        $(#[$doc])*
        ///
        /// `T` tokens at once: each weight super-block is unpacked once and used by all of them;
        /// every token's output is exactly the one-token kernel's. Panics unless `row` is
        /// exactly one block per activation block of each token.
        pub fn $name<const T: usize>(_cpu: Avx2Fma, row: &[u8], acts: [&[Act256]; T]) -> [f32; T] {
            for a in acts {
                assert_eq!(row.len(), a.len() * $bytes, "one weight block per activation block");
            }
            // SAFETY: `_cpu` proves the CPU has AVX2, and the lengths were checked above.
            unsafe { $body(row, acts) }
        }
    };
}

safe_kernel!(
    /// One Q5_K row with `T` tokens' Q8_K activation blocks.
    dot_q5_k, dot_q5_k_avx2, 176
);

/// Asks for the `bytes` bytes at `p` to be brought into L2 (`l1`: into L1, see
/// [`super::PrefetchInto`]): a block that a kernel will read soon (the same block of the next
/// row or of the next tile, or one further on in a K-quant tile's group). Rows are short, so the
/// hardware's prefetcher, which follows a stream, falls behind a kernel that jumps from one to
/// the next. `p` is only a hint, never dereferenced: a prefetch cannot fault, even past the
/// matrix (which is why callers form it with `wrapping_add`).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn prefetch(p: *const u8, bytes: usize, l1: bool) {
    for line in (0..bytes).step_by(64) {
        let at = p.wrapping_add(line) as *const i8;
        if l1 {
            _mm_prefetch::<_MM_HINT_T0>(at);
        } else {
            _mm_prefetch::<_MM_HINT_T1>(at);
        }
    }
}

/// # Safety
/// The CPU must support AVX2; `row.len() == acts[t].len() * 176` for every `t`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q5_k_avx2<const T: usize>(row: &[u8], acts: [&[Act256]; T]) -> [f32; T] {
    let mut acc = [0.0f32; T];
    for (k, b) in row.chunks_exact(176).enumerate() {
        // The next row's block, into L1: Q5_K's rows were measured only that way.
        prefetch(b.as_ptr().wrapping_add(row.len()), 176, true);
        let (sc, m) = scale_min(&b[4..16]);
        // SAFETY: AVX2 is present (caller); `b` is 176 bytes: qh at 16..48, and the four
        // 32-byte loads of qs at 48 + 32i (i < 4) end by byte 176; each token's block `k`
        // exists (caller) and its `q` is 256 bytes, read at 64i and 64i + 32.
        let sums = unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let qh = load32(b.as_ptr().add(16));
            let mut sums = [_mm256_setzero_si256(); T];
            for i in 0..4 {
                let raw = load32(b.as_ptr().add(48 + 32 * i));
                let j = 2 * i as i32;
                let lo = _mm256_or_si256(_mm256_and_si256(raw, m4), high_bit(qh, j));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4),
                    high_bit(qh, j + 1),
                );
                let s_lo = _mm256_set1_epi16(i16::from(sc[2 * i]));
                let s_hi = _mm256_set1_epi16(i16::from(sc[2 * i + 1]));
                for (sums, a) in sums.iter_mut().zip(acts) {
                    let q = a.get_unchecked(k).q.as_ptr();
                    let x_lo = load32(q.add(64 * i) as *const u8);
                    let x_hi = load32(q.add(64 * i + 32) as *const u8);
                    let p_lo = _mm256_maddubs_epi16(lo, x_lo);
                    let p_hi = _mm256_maddubs_epi16(hi, x_hi);
                    *sums = _mm256_add_epi32(*sums, _mm256_madd_epi16(p_lo, s_lo));
                    *sums = _mm256_add_epi32(*sums, _mm256_madd_epi16(p_hi, s_hi));
                }
            }
            sums
        };
        for ((acc, sums), a) in acc.iter_mut().zip(sums).zip(acts) {
            let a = &a[k];
            // SAFETY: AVX2 is present (caller).
            let isum = unsafe { hsum_i32(sums) };
            let imin = mins_dot(&m, &a.bsums);
            *acc = acc_k(*acc, f16_at(b, 0), f16_at(b, 2), a.d, isum, imin);
        }
    }
    acc
}

// ---------------------------------------------------------------------------------------------
// The proof the 32-element formats' tiles (`tiles.rs`) take
// ---------------------------------------------------------------------------------------------

/// Proof that this CPU has AVX2, FMA and F16C (the f16 → f32 conversion instruction). Like
/// chapter 2's [`Avx2Fma`], safe code can only get one from [`Avx2F16c::detect`], after run-time
/// detection, so the kernels that take it may use all three.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx2F16c(Avx2Fma);

impl Avx2F16c {
    /// `Some` if `isa` is AVX2 + FMA and this CPU also has F16C (checked now, at run time).
    /// Every CPU with AVX2 has shipped with F16C; one without runs the portable kernels.
    pub fn detect(isa: Isa) -> Option<Avx2F16c> {
        match isa {
            Isa::Avx2Fma(cpu) if is_x86_feature_detected!("f16c") => Some(Avx2F16c(cpu)),
            _ => None,
        }
    }

    /// The AVX2 + FMA proof this one includes.
    pub fn avx2_fma(self) -> Avx2Fma {
        self.0
    }
}

/// [`Act32::quantize`] with AVX2, the same bits: the largest magnitude by `max` (which, like
/// `f32::max`, skips a NaN, and is order-free) and whether any value is NaN (then the maximum is
/// NaN, as [`super::act_amax`] makes it), the scale and its inverse as the scalar code
/// computes them, then 8 values per step through [`super::round_half_away`]'s steps: clamp to
/// ±127, truncate, compare the remainder with ±½, NaN to 0.
pub fn quantize_act32(_cpu: Avx2F16c, x: &[f32]) -> Act32 {
    assert_eq!(x.len(), 32, "one block of 32");
    // SAFETY: `_cpu` proves AVX2; `x` is 32 readable f32 (checked above).
    unsafe { quantize_act32_avx2(x) }
}

/// # Safety
/// The CPU must support AVX2; `x.len() == 32`.
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_act32_avx2(x: &[f32]) -> Act32 {
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // SAFETY: x[8i..8i + 8] for i < 4 lie in the 32 values (caller).
    let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
    // `maxps(a, b)` returns b when a is NaN: with the running maximum as b, a NaN is skipped,
    // as `f32::max` skips it.
    let (mut m, mut any_nan) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for v in v {
        m = _mm256_max_ps(_mm256_and_ps(v, abs), m);
        any_nan = _mm256_or_ps(any_nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` is 8 writable f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    let amax = if _mm256_movemask_ps(any_nan) != 0 {
        f32::NAN
    } else {
        lanes.iter().fold(0.0f32, |m, &v| m.max(v))
    };
    let d = super::act_scale(amax);
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    let (half, id) = (_mm256_set1_ps(0.5), _mm256_set1_ps(id));
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let mut q = [0i8; 32];
    let mut sum = _mm256_setzero_si256();
    let mut words = [_mm256_setzero_si256(); 4];
    for (w, v) in words.iter_mut().zip(v) {
        let v = _mm256_mul_ps(v, id);
        // A NaN (`x · 0` for an infinite x, or a NaN x) becomes 0, as `as i32` makes it.
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        let v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
        let t = _mm256_cvttps_epi32(v);
        let frac = _mm256_sub_ps(v, _mm256_cvtepi32_ps(t));
        // Compare masks are −1 where true: t + (frac ≥ ½) − (frac ≤ −½).
        let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half));
        let minus_half = _mm256_sub_ps(_mm256_setzero_ps(), half);
        let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(frac, minus_half));
        let r = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
        *w = _mm256_andnot_si256(nan, r);
        sum = _mm256_add_epi32(sum, *w);
    }
    // i32 → i8 in element order: the packs interleave 128-bit halves, the permute undoes it.
    let w16_a = _mm256_packs_epi32(words[0], words[1]);
    let w16_b = _mm256_packs_epi32(words[2], words[3]);
    let w8 = _mm256_packs_epi16(w16_a, w16_b);
    let w8 = _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: `q` is 32 writable bytes.
    unsafe { _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, w8) };
    Act32 {
        q,
        d,
        // SAFETY: AVX2 is present (caller).
        sum: unsafe { hsum_i32(sum) },
    }
}

/// The f16 `bits` widened to f32 by F16C's `vcvtph2ps`, as the tiles widen 8 scales at once
/// (for the exhaustive test: it is exact, like [`crate::blocks::f16_bits_to_f32`]).
#[cfg(test)]
fn f16c_to_f32(_cpu: Avx2F16c, bits: u16) -> f32 {
    // SAFETY: `_cpu` proves F16C.
    unsafe { f16c_lane(bits) }
}

/// # Safety
/// The CPU must support F16C.
#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16c_lane(bits: u16) -> f32 {
    let v = _mm256_cvtph_ps(_mm_set1_epi16(bits as i16));
    _mm256_cvtss_f32(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16c_conversion_is_exact() {
        let Some(cpu) = Avx2F16c::detect(Isa::detect()) else {
            eprintln!("skipped: no AVX2 and F16C on this CPU");
            return;
        };
        for bits in 0..=u16::MAX {
            let (fast, exact) = (f16c_to_f32(cpu, bits), crate::blocks::f16_bits_to_f32(bits));
            assert!(
                fast.to_bits() == exact.to_bits() || (fast.is_nan() && exact.is_nan()),
                "{bits:#06x}: {fast:e} vs {exact:e}"
            );
        }
    }

    #[test]
    fn the_avx2_activation_quantizer_equals_the_scalar_one() {
        let Some(cpu) = Avx2F16c::detect(Isa::detect()) else {
            eprintln!("skipped: no AVX2 and F16C on this CPU");
            return;
        };
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let special = [
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            -3e-39,
            f32::MAX,
            f32::MIN_POSITIVE,
            0.5,
            -1.5,
        ];
        for case in 0..20_000 {
            let scale = f32::powi(2.0, (next() % 40) as i32 - 20);
            let mut x: Vec<f32> = (0..32)
                .map(|_| ((next() % 20001) as f32 / 1e4 - 1.0) * scale)
                .collect();
            // Ties: the largest value 127, the others halves after scaling.
            if case % 5 == 0 {
                x[0] = 127.0;
                for v in &mut x[1..8] {
                    *v = (next() % 255) as f32 - 127.0 + 0.5;
                }
            }
            if case % 3 == 0 {
                for _ in 0..1 + next() % 3 {
                    x[(next() % 32) as usize] = special[(next() % special.len() as u64) as usize];
                }
            }
            if case % 7 == 0 {
                x.iter_mut()
                    .for_each(|v| *v = special[(next() % 3) as usize]);
            }
            let (fast, exact) = (quantize_act32(cpu, &x), Act32::quantize(&x));
            assert_eq!(fast.q, exact.q, "{x:?}");
            assert_eq!(fast.d.to_bits(), exact.d.to_bits(), "{x:?}");
            assert_eq!(fast.sum, exact.sum, "{x:?}");
        }
    }
}
