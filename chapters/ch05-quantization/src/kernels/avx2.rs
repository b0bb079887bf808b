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
//! The 32-element formats run as register tiles ([`tile32`], described in the parent module):
//! each format says, through [`Block32`], how its block unpacks to 32 bytes, and one generic
//! body does the rest. Q5_0's and Q5_1's fifth bits (a u32 per block) become bytes by
//! [`bits32`]'s shuffle-or-compare.
//!
//! Each kernel is a safe function taking a proof ([`Avx2Fma`], or [`Avx2F16c`] for the tiles;
//! only run-time detection makes one), checking the lengths its pointer arithmetic relies on,
//! then calling its `unsafe` body compiled with those instruction sets.

use std::arch::x86_64::*;

use ch02::kernels::{Avx2Fma, Isa};

use super::portable::mins_dot;
use super::{Act32, Act256, acc_d, acc_k};
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
    /// One Q4_K row with `T` tokens' Q8_K activation blocks.
    dot_q4_k, dot_q4_k_avx2, 144
);
safe_kernel!(
    /// One Q5_K row with `T` tokens' Q8_K activation blocks.
    dot_q5_k, dot_q5_k_avx2, 176
);
safe_kernel!(
    /// One Q6_K row with `T` tokens' Q8_K activation blocks.
    dot_q6_k, dot_q6_k_avx2, 210
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

/// The 8 lanes summed in [`super::sum_lanes`]' order,
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, in registers: the two halves added
/// give `h = (l0 + l4, l1 + l5, l2 + l6, l3 + l7)`, then `(h0 + h2) + (h1 + h3)`. (Safe with a
/// target feature, like [`acc_lanes`].)
#[inline]
#[target_feature(enable = "avx2,fma")]
fn sum_acc(acc: __m256) -> f32 {
    let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let s = _mm_add_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// Asks for the `bytes` bytes at `p` to be brought into L1: a block that a kernel will read
/// soon (the same block of the next row, or of the next tile). Rows are short, so the hardware's
/// prefetcher, which follows a stream, falls behind a kernel that jumps from one to the next.
/// `p` is only a hint, never dereferenced: a prefetch cannot fault, even past the matrix (which
/// is why callers form it with `wrapping_add`).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch(p: *const u8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line) as *const i8);
    }
}

/// # Safety
/// The CPU must support AVX2; `row.len() == acts[t].len() * 144` for every `t`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q4_k_avx2<const T: usize>(row: &[u8], acts: [&[Act256]; T]) -> [f32; T] {
    let mut acc = [0.0f32; T];
    for (k, b) in row.chunks_exact(144).enumerate() {
        prefetch(b.as_ptr().wrapping_add(row.len()), 144); // the next row's block
        let (sc, m) = scale_min(&b[4..16]);
        // SAFETY: AVX2 is present (caller); `b` is 144 bytes, so the four 32-byte loads at
        // 16 + 32i (i < 4) end by byte 144; each token's block `k` exists (caller) and its `q`
        // is 256 bytes, read at 64i and 64i + 32.
        let sums = unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let mut sums = [_mm256_setzero_si256(); T];
            for i in 0..4 {
                let raw = load32(b.as_ptr().add(16 + 32 * i));
                let lo = _mm256_and_si256(raw, m4); // sub-block 2i
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4); // sub-block 2i + 1
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

/// # Safety
/// The CPU must support AVX2; `row.len() == acts[t].len() * 176` for every `t`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q5_k_avx2<const T: usize>(row: &[u8], acts: [&[Act256]; T]) -> [f32; T] {
    let mut acc = [0.0f32; T];
    for (k, b) in row.chunks_exact(176).enumerate() {
        prefetch(b.as_ptr().wrapping_add(row.len()), 176); // the next row's block
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

/// # Safety
/// The CPU must support AVX2; `row.len() == acts[t].len() * 210` for every `t`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q6_k_avx2<const T: usize>(row: &[u8], acts: [&[Act256]; T]) -> [f32; T] {
    let mut acc = [0.0f32; T];
    for (k, b) in row.chunks_exact(210).enumerate() {
        prefetch(b.as_ptr().wrapping_add(row.len()), 210); // the next row's block
        let scales = &b[192..208];
        let sc = |j: usize| i16::from(scales[j] as i8);
        // SAFETY: AVX2 is present (caller); `b` is 210 bytes: the ql loads at 64h and 64h + 32
        // (h < 2) end by byte 128, the qh load at 128 + 32h by byte 192; each token's block `k`
        // exists (caller) and its `q` is 256 bytes, read at 128h + 32k (k < 4).
        let sums = unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let m2 = _mm256_set1_epi8(0x03);
            let mut sums = [_mm256_setzero_si256(); T];
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
                for (quarter, low) in lows.into_iter().enumerate() {
                    let shift = _mm_cvtsi32_si128(2 * quarter as i32);
                    let high = _mm256_and_si256(_mm256_srl_epi16(qh, shift), m2);
                    let u = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high)); // 0..64
                    // Lanes 0..8 are elements 0..16 (one sub-block), 8..16 the next.
                    let j = 8 * h + 2 * quarter;
                    let s = _mm256_set_m128i(_mm_set1_epi16(sc(j + 1)), _mm_set1_epi16(sc(j)));
                    for (sums, a) in sums.iter_mut().zip(acts) {
                        let q = a.get_unchecked(k).q.as_ptr();
                        let x = load32(q.add(128 * h + 32 * quarter) as *const u8);
                        let p = _mm256_maddubs_epi16(u, x);
                        *sums = _mm256_add_epi32(*sums, _mm256_madd_epi16(p, s));
                    }
                }
            }
            sums
        };
        for ((acc, sums), a) in acc.iter_mut().zip(sums).zip(acts) {
            let a = &a[k];
            // SAFETY: AVX2 is present (caller).
            let isum = unsafe { hsum_i32(sums) };
            let offset: i32 = (0..16)
                .map(|j| i32::from(sc(j)) * i32::from(a.bsums[j]))
                .sum();
            *acc = acc_d(*acc, f16_at(b, 208), a.d, isum - 32 * offset);
        }
    }
    acc
}

// ---------------------------------------------------------------------------------------------
// The 32-element formats: register tiles of R rows × T tokens
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

/// The f16 at `p` widened to f32 by F16C's `vcvtph2ps`: exact, like
/// [`crate::blocks::f16_bits_to_f32`] (the test `f16c_conversion_is_exact` compares all 65536).
///
/// # Safety
/// The CPU must support F16C; `p` must point to 2 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_ptr(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes at `p` (an unaligned read).
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le(
        bits,
    )))))
}

/// The f16 `bits` widened to f32 with F16C (for the exhaustive test).
#[cfg(test)]
fn f16c_to_f32(_cpu: Avx2F16c, bits: u16) -> f32 {
    let bytes = bits.to_le_bytes();
    // SAFETY: `_cpu` proves F16C; `bytes` is 2 readable bytes.
    unsafe { f16_ptr(bytes.as_ptr()) }
}

/// Bit `l` of the little-endian u32 at `p` as byte `l` of the result: `0xFF` where it is set,
/// else 0. Each byte of the u32 is copied to 8 lanes (a shuffle), every bit but the lane's own
/// is forced to 1 (an OR), and the lanes that became all ones are the set bits (a compare).
///
/// # Safety
/// The CPU must support AVX2; `p` must point to 4 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bits32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes at `p` (an unaligned read).
    let qh = u32::from_le(unsafe { (p as *const u32).read_unaligned() });
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), spread);
    let others = _mm256_set1_epi64x(0x7FBF_DFEF_F7FB_FDFEu64 as i64);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1))
}

/// A 32-element weight format as the tile kernel sees it: where its scale (and offset) are,
/// and how one block's 32 weights become 32 bytes for `maddubs`. A block may hold
/// [`Block32::SUB`] runs of 32 weights that share its scale (the grouped layouts of
/// [`super::QuantMatrix::grouped`]); each run pairs with one activation block.
pub trait Block32 {
    /// Bytes of one block.
    const BYTES: usize;
    /// `false`: [`Block32::weights`] are signed (`x = d·w`), multiplied by the sign trick;
    /// `true`: unsigned (`x = d·w + m`, `m` the f16 at bytes 2..4), multiplied directly.
    const OFFSET: bool;
    /// Runs of 32 weights per block (sharing its scale and offset).
    const SUB: usize = 1;
    /// Run `j < SUB` of the block's weights, 32 in element order.
    ///
    /// # Safety
    /// The CPU must support AVX2; `p` must point to [`Block32::BYTES`] readable bytes.
    unsafe fn weights(p: *const u8, j: usize) -> __m256i;
}

/// Q8_0: 32 signed bytes at 2..34.
pub struct Q8_0;
/// Q4_0: nibbles at 2..18, minus 8.
pub struct Q4_0;
/// Q4_1: nibbles at 4..20.
pub struct Q4_1;
/// Q5_0: nibbles at 6..22 with the fifth bits at 2..6, minus 16.
pub struct Q5_0;
/// Q5_1: nibbles at 8..24 with the fifth bits at 4..8.
pub struct Q5_1;
/// `G` Q4_0 blocks sharing one scale: the f16 `d` at 0..2, then `G` runs of 16 nibble bytes.
pub struct Q4_0G<const G: usize>;
/// `G` Q4_1 blocks sharing one scale and offset: `d`, `m` at 0..4, then `G` runs of 16 bytes.
pub struct Q4_1G<const G: usize>;

impl Block32 for Q8_0 {
    const BYTES: usize = 34;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> __m256i {
        // SAFETY: bytes 2..34 of the block (caller).
        unsafe { load32(p.add(2)) }
    }
}

impl Block32 for Q4_0 {
    const BYTES: usize = 18;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> __m256i {
        // SAFETY: bytes 2..18 of the block (caller). q − 8 is in −8..8.
        unsafe { _mm256_sub_epi8(nibbles16(p.add(2)), _mm256_set1_epi8(8)) }
    }
}

impl Block32 for Q4_1 {
    const BYTES: usize = 20;
    const OFFSET: bool = true;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> __m256i {
        // SAFETY: bytes 4..20 of the block (caller).
        unsafe { nibbles16(p.add(4)) }
    }
}

impl<const G: usize> Block32 for Q4_0G<G> {
    const BYTES: usize = 2 + 16 * G;
    const OFFSET: bool = false;
    const SUB: usize = G;
    #[inline(always)]
    unsafe fn weights(p: *const u8, j: usize) -> __m256i {
        // SAFETY: bytes 2 + 16j..18 + 16j of the block, j < G (caller). q − 8 is in −8..8.
        unsafe { _mm256_sub_epi8(nibbles16(p.add(2 + 16 * j)), _mm256_set1_epi8(8)) }
    }
}

impl<const G: usize> Block32 for Q4_1G<G> {
    const BYTES: usize = 4 + 16 * G;
    const OFFSET: bool = true;
    const SUB: usize = G;
    #[inline(always)]
    unsafe fn weights(p: *const u8, j: usize) -> __m256i {
        // SAFETY: bytes 4 + 16j..20 + 16j of the block, j < G (caller).
        unsafe { nibbles16(p.add(4 + 16 * j)) }
    }
}

impl Block32 for Q5_0 {
    const BYTES: usize = 22;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> __m256i {
        // SAFETY: bytes 2..6 (qh) and 6..22 (nibbles) of the block (caller).
        unsafe {
            // q − 16: a set fifth bit makes it the nibble itself (16 + n − 16); a clear one,
            // the nibble with its high four bits set, which as a signed byte is n − 16.
            let clear = _mm256_andnot_si256(bits32(p.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
            _mm256_or_si256(nibbles16(p.add(6)), clear)
        }
    }
}

impl Block32 for Q5_1 {
    const BYTES: usize = 24;
    const OFFSET: bool = true;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> __m256i {
        // SAFETY: bytes 4..8 (qh) and 8..24 (nibbles) of the block (caller).
        unsafe {
            let high = _mm256_and_si256(bits32(p.add(4)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles16(p.add(8)), high)
        }
    }
}

/// `out[r][t]` = row `r` of `rows` (`R` rows of `n / SUB` blocks) · token `t` of `acts` (`T`
/// tokens of `n` blocks): a register tile of `R × T` accumulators of 8 f32 lanes each.
///
/// ```text
/// for each run k of 32 weights:      the R weight runs are unpacked once ...
///     w[r]  = weights(row r, k)      [32 × i8 or u8]   r < R (scale of the block holding k)
///     for each token t:              ... and used by T tokens
///         x = acts[t][k].q           [32 × i8]
///         acc[r][t] += (d_w[r] · d_x[t]) · lanes(w[r] · x)   [8 × f32]
/// out[r][t] = sum of acc[r][t]'s 8 lanes (+ the offsets' scalar accumulator)
/// ```
///
/// Each `(r, t)` accumulates exactly the operations of the portable one-row kernel in its
/// order, so any tile shape gives the same bits; and a grouped block ([`Block32::SUB`] > 1)
/// does exactly what `SUB` ungrouped blocks with its scale would.
///
/// Panics unless `rows` is `R` rows of one run of 32 weights per activation block of a token.
pub fn tile32<F: Block32, C: Tiles, const R: usize, const T: usize>(
    cpu: C,
    rows: &[u8],
    acts: &[Act32],
    out: &mut [[f32; T]; R],
) {
    let n = acts.len() / T;
    assert_eq!(acts.len(), n * T, "T tokens of whole blocks");
    assert_eq!(n % F::SUB, 0, "whole grouped blocks");
    assert_eq!(
        rows.len(),
        R * (n / F::SUB) * F::BYTES,
        "R rows of one run of 32 weights per activation block"
    );
    // SAFETY: `cpu` proves the instruction sets its body needs; the body reads blocks
    // `b < n / SUB` of rows `r < R` at `r·(n / SUB)·BYTES + b·BYTES`, inside `rows`, and
    // activation blocks `t·n + k < T·n`, inside `acts`, as checked above.
    unsafe { cpu.tile_body::<F, R, T>(rows.as_ptr(), acts.as_ptr(), n, out) }
}

/// A CPU proof that can run [`tile32`]'s body, and the tile shapes it runs best:
/// [`Avx2F16c`] (`maddubs`, 16 vector registers) or [`super::vnni::Avx512Vnni`] (`vpdpbusd`,
/// 32 registers).
pub trait Tiles: Copy {
    /// [`rows32`] with this CPU's tile shapes for one token (decode) and for several (prefill).
    fn rows<F: Block32>(self, rows: &[u8], acts: &[Act32], tokens: usize, yt: &mut [f32]);

    /// [`tile32_body`] compiled for this CPU.
    ///
    /// # Safety
    /// As [`tile32_body`]'s, but for the instruction sets, which `self` proves.
    unsafe fn tile_body<F: Block32, const R: usize, const T: usize>(
        self,
        rows: *const u8,
        acts: *const Act32,
        n: usize,
        out: &mut [[f32; T]; R],
    );
}

/// [`rows32`] in tiles of `D` rows × 1 token for one token (decode), `R × T` for several
/// (prefill): the shapes a [`Tiles`] CPU picks.
#[inline]
pub fn rows32_in<F: Block32, C: Tiles, const D: usize, const R: usize, const T: usize>(
    cpu: C,
    rows: &[u8],
    acts: &[Act32],
    tokens: usize,
    yt: &mut [f32],
) {
    if tokens == 1 {
        rows32::<F, C, D, 1>(cpu, rows, acts, tokens, yt)
    } else {
        rows32::<F, C, R, T>(cpu, rows, acts, tokens, yt)
    }
}

impl Tiles for Avx2F16c {
    /// One token (decode) takes 4 rows, so each activation block loaded serves 4 weight blocks;
    /// several tokens (prefill) take 2 rows × 4 tokens, so each unpacked weight block serves 4
    /// tokens. (16 registers hold no more.)
    fn rows<F: Block32>(self, rows: &[u8], acts: &[Act32], tokens: usize, yt: &mut [f32]) {
        rows32_in::<F, _, 4, 2, 4>(self, rows, acts, tokens, yt)
    }

    unsafe fn tile_body<F: Block32, const R: usize, const T: usize>(
        self,
        rows: *const u8,
        acts: *const Act32,
        n: usize,
        out: &mut [[f32; T]; R],
    ) {
        // SAFETY: `self` proves AVX2, FMA and F16C; the rest is the caller's.
        unsafe { tile32_body::<F, Maddubs, R, T>(rows, acts, n, out) }
    }
}

/// How a tile forms a block's 8 integer lanes from 32 unsigned bytes `u` and 32 signed bytes
/// `s`: lane `k` is `Σ u·s` over bytes `4k..4k + 4`, exactly (the module doc bounds the
/// products, so nothing saturates).
pub trait ByteDot {
    /// # Safety
    /// The CPU must support the instructions of the implementation; `2 · u · |s| < 32768` for
    /// every pair of bytes.
    unsafe fn lanes(u: __m256i, s: __m256i) -> __m256i;
}

/// AVX2: `maddubs` (pairs into i16), then `madd` by ones (pairs of those into i32).
pub enum Maddubs {}

impl ByteDot for Maddubs {
    #[inline(always)]
    unsafe fn lanes(u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: the caller's.
        unsafe { dot_u8_i8(u, s) }
    }
}

/// # Safety
/// The CPU must support AVX2, FMA, F16C and what `D` uses; `rows` must point to `R · n / SUB`
/// readable blocks and `acts` to `T · n` activation blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile32_body<F: Block32, D: ByteDot, const R: usize, const T: usize>(
    rows: *const u8,
    acts: *const Act32,
    n: usize,
    out: &mut [[f32; T]; R],
) {
    // ANCHOR: grouped_tile
    let row_bytes = n / F::SUB * F::BYTES;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut acc_m = [[0.0f32; T]; R];
    for b in 0..n / F::SUB {
        let mut d = [0.0f32; R];
        let mut m = [0.0f32; R];
        for r in 0..R {
            // The block the next tile reads here, `R` rows on (324 bytes a row of Q4_0 at 576
            // features: R short streams, which the hardware's prefetcher alone does not follow).
            prefetch(
                rows.wrapping_add((r + R) * row_bytes + b * F::BYTES),
                F::BYTES,
            );
            // SAFETY: block `b` of row `r` is readable (caller).
            unsafe {
                let p = rows.add(r * row_bytes + b * F::BYTES);
                d[r] = f16_ptr(p);
                if F::OFFSET {
                    m[r] = f16_ptr(p.add(2));
                }
            }
        }
        for j in 0..F::SUB {
            let k = b * F::SUB + j; // the run of 32 weights, and its activation block
            let mut w = [_mm256_setzero_si256(); R]; // the weights, signed or unsigned
            let mut u = [_mm256_setzero_si256(); R]; // maddubs' unsigned operand
            for r in 0..R {
                // SAFETY: block `b` of row `r` is readable (caller), `j < SUB`.
                w[r] = unsafe { F::weights(rows.add(r * row_bytes + b * F::BYTES), j) };
                // |w| for the sign trick: maddubs' first operand is unsigned.
                u[r] = if F::OFFSET {
                    w[r]
                } else {
                    _mm256_sign_epi8(w[r], w[r])
                };
            }
            for t in 0..T {
                // SAFETY: activation block `t·n + k` is readable (caller); `q` is 32 bytes.
                let (a, x) = unsafe {
                    let a = &*acts.add(t * n + k);
                    (a, load32(a.q.as_ptr() as *const u8))
                };
                for r in 0..R {
                    // w · x = |w| · (x · sign(w)) for signed weights.
                    let s = if F::OFFSET {
                        x
                    } else {
                        _mm256_sign_epi8(x, w[r])
                    };
                    // SAFETY: `D`'s instructions are present (caller); |w| ≤ 128 (Q8_0's −128
                    // read unsigned) or ≤ 31 and |x| ≤ 127, so nothing saturates (module doc).
                    let lanes = unsafe { D::lanes(u[r], s) };
                    acc[r][t] = acc_lanes(acc[r][t], d[r], a.d, lanes);
                    if F::OFFSET {
                        acc_m[r][t] = acc_d(acc_m[r][t], m[r], a.d, a.sum);
                    }
                }
            }
        }
    }
    // ANCHOR_END: grouped_tile
    for r in 0..R {
        for t in 0..T {
            let lanes = sum_acc(acc[r][t]);
            // Formats without an offset add nothing (not even +0.0, which would turn −0 into +0).
            out[r][t] = if F::OFFSET {
                lanes + acc_m[r][t]
            } else {
                lanes
            };
        }
    }
}

/// Rows `rows` (`n_rows` rows of `n / SUB` blocks, `n = acts.len() / tokens`) times every token of
/// `acts` into `yt` [n_rows, tokens]: tiles of `R × T`, then the rows and tokens left over one
/// at a time.
pub fn rows32<F: Block32, C: Tiles, const R: usize, const T: usize>(
    cpu: C,
    rows: &[u8],
    acts: &[Act32],
    tokens: usize,
    yt: &mut [f32],
) {
    let n_rows = yt.len() / tokens.max(1);
    if n_rows == 0 || tokens == 0 {
        return;
    }
    let n = acts.len() / tokens;
    let row_bytes = n / F::SUB * F::BYTES;
    let mut r = 0;
    while r + R <= n_rows {
        token_tiles::<F, C, R, T>(
            cpu,
            &rows[r * row_bytes..(r + R) * row_bytes],
            acts,
            n,
            tokens,
            &mut yt[r * tokens..(r + R) * tokens],
        );
        r += R;
    }
    for r in r..n_rows {
        token_tiles::<F, C, 1, T>(
            cpu,
            &rows[r * row_bytes..(r + 1) * row_bytes],
            acts,
            n,
            tokens,
            &mut yt[r * tokens..(r + 1) * tokens],
        );
    }
}

/// `R` rows times every token (`n` blocks each): tiles of `T` tokens, then single tokens.
#[inline]
fn token_tiles<F: Block32, C: Tiles, const R: usize, const T: usize>(
    cpu: C,
    rows: &[u8],
    acts: &[Act32],
    n: usize,
    tokens: usize,
    yt: &mut [f32], // [R, tokens]
) {
    let mut t = 0;
    while t + T <= tokens {
        let mut out = [[0.0f32; T]; R];
        tile32::<F, C, R, T>(cpu, rows, &acts[t * n..(t + T) * n], &mut out);
        for (r, o) in out.iter().enumerate() {
            yt[r * tokens + t..r * tokens + t + T].copy_from_slice(o);
        }
        t += T;
    }
    for t in t..tokens {
        let mut out = [[0.0f32; 1]; R];
        tile32::<F, C, R, 1>(cpu, rows, &acts[t * n..(t + 1) * n], &mut out);
        for (r, o) in out.iter().enumerate() {
            yt[r * tokens + t] = o[0];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16c_conversion_is_exact() {
        let Some(cpu) = Avx2F16c::detect(Isa::detect()) else {
            return; // nothing to compare on this CPU
        };
        for bits in 0..=u16::MAX {
            let (fast, exact) = (f16c_to_f32(cpu, bits), crate::blocks::f16_bits_to_f32(bits));
            assert!(
                fast.to_bits() == exact.to_bits() || (fast.is_nan() && exact.is_nan()),
                "{bits:#06x}: {fast:e} vs {exact:e}"
            );
        }
    }

    /// Random bytes with moderate f16 scales at `scale_at` of every block.
    fn random_rows(bytes: usize, block: usize, scale_at: &[usize], seed: u64) -> Vec<u8> {
        let mut state = seed | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut out: Vec<u8> = (0..bytes).map(|_| next() as u8).collect();
        for b in out.chunks_exact_mut(block) {
            for &at in scale_at {
                let v = ((next() % 2001) as f32 - 1000.0) / 1e4;
                b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        out
    }

    /// Every tile shape, on AVX2 and on AVX-512 VNNI, equals the portable one-row kernel bit for
    /// bit (the public tests reach only the shapes and the instruction set this CPU picks).
    fn tiles_equal_portable<F: Block32>(scale_at: &[usize], portable: fn(&[u8], &[Act32]) -> f32) {
        let isa = Isa::detect();
        let (rows, tokens, n) = (9, 7, 5);
        let w = random_rows(rows * n * F::BYTES, F::BYTES, scale_at, 7);
        let x: Vec<f32> = random_rows(tokens * n * 32 * 4, 4, &[], 11)
            .chunks_exact(4)
            .map(|b| (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) % 20001) as f32 / 5e3 - 2.0)
            .collect();
        let acts: Vec<Act32> = x.chunks_exact(32).map(Act32::quantize).collect();
        let row_bytes = n * F::BYTES;
        let expected: Vec<f32> = (0..rows)
            .flat_map(|r| {
                let row = &w[r * row_bytes..(r + 1) * row_bytes];
                (0..tokens)
                    .map(|t| portable(row, &acts[t * n..(t + 1) * n]))
                    .collect::<Vec<_>>()
            })
            .collect();
        let check = |name: &str, got: Vec<f32>| {
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert_eq!(g.to_bits(), e.to_bits(), "tile {name} output {i}");
            }
        };
        if let Some(cpu) = Avx2F16c::detect(isa) {
            check("AVX2 4x1", run::<F, _, 4, 1>(cpu, &w, &acts, tokens, rows));
            check("AVX2 2x4", run::<F, _, 2, 4>(cpu, &w, &acts, tokens, rows));
            check("AVX2 1x1", run::<F, _, 1, 1>(cpu, &w, &acts, tokens, rows));
        }
        if let Some(cpu) = super::super::vnni::Avx512Vnni::detect(isa) {
            check("VNNI 8x1", run::<F, _, 8, 1>(cpu, &w, &acts, tokens, rows));
            check("VNNI 4x4", run::<F, _, 4, 4>(cpu, &w, &acts, tokens, rows));
            check("VNNI 1x1", run::<F, _, 1, 1>(cpu, &w, &acts, tokens, rows));
        }
    }

    fn run<F: Block32, C: Tiles, const R: usize, const T: usize>(
        cpu: C,
        w: &[u8],
        acts: &[Act32],
        tokens: usize,
        rows: usize,
    ) -> Vec<f32> {
        let mut yt = vec![0.0f32; rows * tokens];
        rows32::<F, C, R, T>(cpu, w, acts, tokens, &mut yt);
        yt
    }

    #[test]
    fn every_tile_shape_equals_portable() {
        use super::super::portable;
        tiles_equal_portable::<Q8_0>(&[0], portable::dot_q8_0);
        tiles_equal_portable::<Q4_0>(&[0], portable::dot_q4_0);
        tiles_equal_portable::<Q4_1>(&[0, 2], portable::dot_q4_1);
        tiles_equal_portable::<Q5_0>(&[0], portable::dot_q5_0);
        tiles_equal_portable::<Q5_1>(&[0, 2], portable::dot_q5_1);
    }
}
