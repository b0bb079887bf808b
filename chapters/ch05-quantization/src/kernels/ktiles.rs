//! Q4_K and Q6_K on interleaved rows ([`super::interleave`]): tiles of one group of 8 rows × `T`
//! tokens, one vector lane per output row, as [`super::tiles`] does for the 32-element formats.
//!
//! ```text
//! for each super-block (256 weights of 8 rows):
//!     for each sub-block j:                               32 weights (Q4_K), 16 (Q6_K)
//!         s_j = Σ_k w[k] · bcast(x[4k..4k+4])             [8 rows × i32], exact
//!     i = Σ_j sc_j · s_j                                  the sub-block scales, in integers
//!     acc += (d · d_x) · i  (− (dmin · d_x) · Σ_j m_j · Σx_j for Q4_K)       [8 rows × f32]
//! ```
//!
//! The integer sums are the portable kernels' exactly (Q6_K's `q − 32` is folded into each
//! sub-block's start, `−32 · Σx_j`), and the f32 steps are [`super::acc_k`]'s and
//! [`super::acc_d`]'s, lane by lane: every output equals the portable kernel's bit for bit.

use std::arch::x86_64::*;

use super::avx2::{broadcast4, load32, prefetch};
use super::interleave::{Q4K_M, Q4K_QS, Q4K_SC, Q6K_SC, Q6K_WORDS, ROWS, block_bytes};
use super::tiles::{ByteDot, Tiles};
use super::{Act256, Outs};
use crate::format::GgmlType;

/// A K-quant format as the interleaved tiles see it.
pub trait KBlock {
    /// Bytes of one interleaved block (a super-block of 8 rows).
    const BYTES: usize;
    /// Adds block `p`'s part of `T` tokens' outputs (`acts[t]`, that super-block of each
    /// token) to `acc[t]` [8 rows].
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA, F16C and what `D` uses; `p` must point to
    /// [`KBlock::BYTES`] readable bytes.
    unsafe fn block<D: ByteDot, const T: usize>(
        p: *const u8,
        acts: [&Act256; T],
        acc: &mut [__m256; T],
    );
}

/// Q4_K: `x = d · sc_j · q − dmin · m_j`, nibbles.
pub struct Q4K;
/// Q6_K: `x = d · sc_j · (q − 32)`, 6-bit weights in sub-blocks of 16.
pub struct Q6K;

/// The 8 bytes at `p` (one sub-block's scale of each of 8 rows) widened to i32 lanes, as
/// unsigned or signed bytes.
///
/// # Safety
/// The CPU must support AVX2; `p` must point to 8 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scales8(p: *const u8, signed: bool) -> __m256i {
    // SAFETY: 8 readable bytes at `p` (caller).
    let v = unsafe { _mm_loadl_epi64(p as *const __m128i) };
    if signed {
        _mm256_cvtepi8_epi32(v)
    } else {
        _mm256_cvtepu8_epi32(v)
    }
}

impl KBlock for Q4K {
    const BYTES: usize = 32 + 128 + 32 * 32;

    #[inline(always)]
    unsafe fn block<D: ByteDot, const T: usize>(
        p: *const u8,
        acts: [&Act256; T],
        acc: &mut [__m256; T],
    ) {
        // SAFETY (whole body): AVX2, F16C and `D`'s instructions are present, every activation
        // word lies in the 256 bytes of `a.q`, and every weight read lies in the block's `BYTES` (the caller's): d at 0..16, dmin at 16..32, the scales
        // and mins at 32..160, the nibbles' 32 word vectors at 160..1184. Nibbles (≤ 15) times
        // |x| ≤ 127 never saturate `maddubs`.
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let mut isum = [_mm256_setzero_si256(); T];
            // Chunk i: its words' low nibbles are sub-block 2i, the high ones 2i + 1.
            for i in 0..4 {
                let mut s = [[_mm256_setzero_si256(); 2]; T];
                for v in 0..8 {
                    let raw = load32(p.add(Q4K_QS + 32 * (8 * i + v)));
                    let lo = _mm256_and_si256(raw, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
                    for (s, a) in s.iter_mut().zip(acts) {
                        s[0] = D::dot(s[0], lo, broadcast4(&a.q, 64 * i + 4 * v));
                        s[1] = D::dot(s[1], hi, broadcast4(&a.q, 64 * i + 32 + 4 * v));
                    }
                }
                let sc_lo = scales8(p.add(Q4K_SC + ROWS * 2 * i), false);
                let sc_hi = scales8(p.add(Q4K_SC + ROWS * (2 * i + 1)), false);
                for (isum, s) in isum.iter_mut().zip(s) {
                    let both = _mm256_add_epi32(
                        _mm256_mullo_epi32(s[0], sc_lo),
                        _mm256_mullo_epi32(s[1], sc_hi),
                    );
                    *isum = _mm256_add_epi32(*isum, both);
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i));
            for ((acc, isum), a) in acc.iter_mut().zip(isum).zip(acts) {
                // Σ_j m_j · (the sums of the sub-block's two halves of 16).
                let mut imin = _mm256_setzero_si256();
                for j in 0..8 {
                    let bsum = i32::from(a.bsums[2 * j]) + i32::from(a.bsums[2 * j + 1]);
                    let m = scales8(p.add(Q4K_M + ROWS * j), false);
                    imin = _mm256_add_epi32(imin, _mm256_mullo_epi32(m, _mm256_set1_epi32(bsum)));
                }
                let dx = _mm256_set1_ps(a.d);
                let sums = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum));
                let mins = _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(imin));
                *acc = _mm256_add_ps(*acc, _mm256_sub_ps(sums, mins));
            }
        }
    }
}

impl KBlock for Q6K {
    const BYTES: usize = 16 + 128 + 48 * 32;

    #[inline(always)]
    unsafe fn block<D: ByteDot, const T: usize>(
        p: *const u8,
        acts: [&Act256; T],
        acc: &mut [__m256; T],
    ) {
        // SAFETY (whole body): AVX2, F16C and `D`'s instructions are present, every activation
        // word lies in the 256 bytes of `a.q`, and every weight read lies in the block's `BYTES` (the caller's): d at 0..16, the scales at 16..144, the
        // 16 triples of word vectors (`ql` a, `ql` b, `qh`) at 144..1680. Weights ≤ 63 times
        // |x| ≤ 127 never saturate `maddubs`.
        unsafe {
            let (m4, m2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
            let mut isum = [_mm256_setzero_si256(); T];
            // Half h holds elements 128h + 32q + l (quarter q < 4, l < 32): the low 4 bits in
            // `ql` chunk a (q = 0, 2: low, high nibbles) or b (q = 1, 3), the high 2 bits at 2q
            // in `qh`. Word v of a quarter is sub-block 8h + 2q + v / 4. The three words of each
            // v lie side by side, so that one token (decode) reads the block front to back, all
            // four quarters at once (8 partial sums); several tokens (prefill) take one quarter
            // at a time (2 partial sums per token), each unpacked word serving all of them.
            let unpack = |q: usize, ql: __m256i, qh: __m256i| {
                let low = if q < 2 {
                    _mm256_and_si256(ql, m4)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql), m4)
                };
                let shift = _mm_cvtsi32_si128(2 * q as i32);
                let high = _mm256_and_si256(_mm256_srl_epi16(qh, shift), m2);
                _mm256_or_si256(low, _mm256_slli_epi16::<4>(high)) // 0..64
            };
            for h in 0..2 {
                // s[t][q][half of the quarter], each starting at −32 · Σx of its sub-block
                // (sub-block 8h + 2q + half). Plain loops: `array::from_fn`'s closures were not
                // inlined here, and their intrinsics were calls.
                let mut s = [[[_mm256_setzero_si256(); 2]; 4]; T];
                for (s, a) in s.iter_mut().zip(acts) {
                    for (q, s) in s.iter_mut().enumerate() {
                        for (half, s) in s.iter_mut().enumerate() {
                            let sum = i32::from(a.bsums[8 * h + 2 * q + half]);
                            *s = _mm256_set1_epi32(-32 * sum);
                        }
                    }
                }
                let word =
                    |v: usize, c: usize| load32(p.add(Q6K_WORDS + 96 * (8 * h + v) + 32 * c));
                if T == 1 {
                    for v in 0..8 {
                        let (ql_a, ql_b, qh) = (word(v, 0), word(v, 1), word(v, 2));
                        for (q, s) in s[0].iter_mut().enumerate() {
                            let u = unpack(q, if q % 2 == 0 { ql_a } else { ql_b }, qh);
                            let x = broadcast4(&acts[0].q, 128 * h + 32 * q + 4 * v);
                            s[v / 4] = D::dot(s[v / 4], u, x);
                        }
                    }
                } else {
                    for q in 0..4 {
                        for v in 0..8 {
                            let u = unpack(q, word(v, q % 2), word(v, 2));
                            for (s, a) in s.iter_mut().zip(acts) {
                                let x = broadcast4(&a.q, 128 * h + 32 * q + 4 * v);
                                s[q][v / 4] = D::dot(s[q][v / 4], u, x);
                            }
                        }
                    }
                }
                for q in 0..4 {
                    let j = 8 * h + 2 * q;
                    let sc_a = scales8(p.add(Q6K_SC + ROWS * j), true);
                    let sc_b = scales8(p.add(Q6K_SC + ROWS * (j + 1)), true);
                    for (isum, s) in isum.iter_mut().zip(&s) {
                        let both = _mm256_add_epi32(
                            _mm256_mullo_epi32(s[q][0], sc_a),
                            _mm256_mullo_epi32(s[q][1], sc_b),
                        );
                        *isum = _mm256_add_epi32(*isum, both);
                    }
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            for ((acc, isum), a) in acc.iter_mut().zip(isum).zip(acts) {
                let dx = _mm256_set1_ps(a.d);
                let term = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum));
                *acc = _mm256_add_ps(*acc, term);
            }
        }
    }
}

/// `out[t][r]` = row `r` of the group at `packed` (`n` interleaved blocks) · token `t` of `acts`
/// (`T` tokens of `n` super-blocks).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and what `D` uses; `packed` must point to `n` blocks
/// of [`KBlock::BYTES`] readable bytes, and `acts` to `T · n` activation blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k_body<F: KBlock, D: ByteDot, const T: usize>(
    packed: *const u8,
    acts: *const Act256,
    n: usize,
    out: &mut [[f32; ROWS]; T],
) {
    let mut acc = [_mm256_setzero_ps(); T]; // [T, 8 rows]
    // Decode: whole super-blocks on (16 KiB: `K_PREFETCH_BYTES`), into L2 (`PrefetchInto`); a
    // prompt's tiles, which read each block for several tokens: two super-blocks on, into L1.
    let (ahead, l1) = if T == 1 {
        let ahead = super::k_prefetch_distance() / F::BYTES * F::BYTES;
        (ahead, super::prefetch_into_l1(T))
    } else {
        (2 * F::BYTES, true)
    };
    for b in 0..n {
        let p = packed.wrapping_add(b * F::BYTES);
        prefetch(p.wrapping_add(ahead), F::BYTES, l1);
        // SAFETY: activation block `t·n + b` is readable for t < T (caller).
        let mut a: [&Act256; T] = [unsafe { &*acts.add(b) }; T];
        for (t, a) in a.iter_mut().enumerate().skip(1) {
            // SAFETY: as above.
            *a = unsafe { &*acts.add(t * n + b) };
        }
        // SAFETY: block `b` is readable; the instruction sets are the caller's.
        unsafe { F::block::<D, T>(p, a, &mut acc) };
    }
    for (out, acc) in out.iter_mut().zip(acc) {
        // SAFETY: `out` is 8 writable f32.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    }
}

/// One group (`n` interleaved super-blocks) times `T` tokens of `acts`.
///
/// Panics unless `packed` is one group of one super-block per activation block of a token.
pub fn k_tile<F: KBlock, C: Tiles, const T: usize>(
    cpu: C,
    packed: &[u8],
    acts: &[Act256],
    out: &mut [[f32; ROWS]; T],
) {
    let n = acts.len() / T;
    assert_eq!(acts.len(), n * T, "T tokens of whole super-blocks");
    assert_eq!(
        packed.len(),
        n * F::BYTES,
        "one group of one block per activation block"
    );
    // SAFETY: `cpu` proves the instruction sets; the body reads blocks `b < n` of `packed` and
    // activation blocks `t·n + b < T·n`, as checked above.
    unsafe { cpu.k_body::<F, T>(packed.as_ptr(), acts.as_ptr(), n, out) }
}

/// The rows of `packed` (groups of `n` super-blocks, the last possibly part zero rows) times
/// every token of `acts` into `outs`: tiles of one group × `T` tokens, then the tokens left
/// over one at a time.
pub fn k_rows<F: KBlock, C: Tiles, const T: usize>(
    cpu: C,
    packed: &[u8],
    acts: &[Act256],
    tokens: usize,
    outs: &mut Outs<'_>,
) {
    let n_rows = outs.rows();
    if n_rows == 0 || tokens == 0 {
        return;
    }
    let n = acts.len() / tokens;
    let group_bytes = n * F::BYTES;
    for g in 0..n_rows.div_ceil(ROWS) {
        let packed = &packed[g * group_bytes..(g + 1) * group_bytes];
        let mut t = 0;
        while t + T <= tokens {
            let mut out = [[0.0f32; ROWS]; T];
            k_tile::<F, C, T>(cpu, packed, &acts[t * n..(t + T) * n], &mut out);
            for (j, o) in out.iter().enumerate() {
                outs.set8(g, t + j, o);
            }
            t += T;
        }
        for t in t..tokens {
            let mut out = [[0.0f32; ROWS]; 1];
            k_tile::<F, C, 1>(cpu, packed, &acts[t * n..(t + 1) * n], &mut out);
            outs.set8(g, t, &out[0]);
        }
    }
}

/// [`k_rows`] for `ty` (Q4_K or Q6_K) with one token per tile for decode, `T` for prefill.
pub fn k_rows_of<C: Tiles, const T: usize>(
    cpu: C,
    ty: GgmlType,
    packed: &[u8],
    acts: &[Act256],
    tokens: usize,
    outs: &mut Outs<'_>,
) {
    debug_assert_eq!(block_bytes(GgmlType::Q4K, 1), Q4K::BYTES);
    debug_assert_eq!(block_bytes(GgmlType::Q6K, 1), Q6K::BYTES);
    match (ty, tokens) {
        (GgmlType::Q4K, 1) => k_rows::<Q4K, C, 1>(cpu, packed, acts, tokens, outs),
        (GgmlType::Q4K, _) => k_rows::<Q4K, C, T>(cpu, packed, acts, tokens, outs),
        (GgmlType::Q6K, 1) => k_rows::<Q6K, C, 1>(cpu, packed, acts, tokens, outs),
        (GgmlType::Q6K, _) => k_rows::<Q6K, C, T>(cpu, packed, acts, tokens, outs),
        _ => unreachable!("{ty} has no interleaved K-quant kernel"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::avx2::Avx2F16c;
    use super::super::interleave::pack;
    use super::super::portable;
    use super::super::test_util::{
        EXTREME_FILLS, EXTREME_SIGNS, assert_bits, filled_rows, portable_outputs, random_inputs,
        random_rows,
    };
    use super::super::vnni::Avx512Vnni;
    use super::*;
    use ch02::kernels::Isa;

    /// Random K-quant rows (moderate f16 scales) and `tokens` tokens' activations.
    fn case(ty: GgmlType, rows: usize, n: usize, tokens: usize) -> (Vec<u8>, Vec<Act256>) {
        let scale_at: &[usize] = if ty == GgmlType::Q6K { &[208] } else { &[0, 2] };
        let w = random_rows(rows * n * ty.block_bytes(), ty.block_bytes(), scale_at, 5);
        let x = random_inputs(tokens * n * 256, 9);
        (w, x.chunks_exact(256).map(Act256::quantize).collect())
    }

    /// One token per tile and several, on AVX2 and AVX-512 VNNI, equal the portable one-row
    /// kernels bit for bit, on 13 rows (a ragged last group) and 5 tokens.
    #[test]
    fn k_tiles_equal_portable() {
        let isa = Isa::detect();
        let (rows, n, tokens) = (13, 2, 5);
        for (ty, portable) in [
            (
                GgmlType::Q4K,
                portable::dot_q4_k as fn(&[u8], &[Act256]) -> f32,
            ),
            (GgmlType::Q6K, portable::dot_q6_k),
        ] {
            let (w, acts) = case(ty, rows, n, tokens);
            compare(isa, ty, (rows, n, tokens), &w, &acts, portable);
        }
    }

    /// Every tile shape on `w` (`rows` rows of `n` super-blocks, the file's layout) times
    /// `acts` (`tokens` tokens) against the portable kernel, bit for bit.
    fn compare(
        isa: Isa,
        ty: GgmlType,
        (rows, n, tokens): (usize, usize, usize),
        w: &[u8],
        acts: &[Act256],
        portable: fn(&[u8], &[Act256]) -> f32,
    ) {
        let row_bytes = n * ty.block_bytes();
        let packed = pack(ty, 1, rows, row_bytes, w);
        let expected = portable_outputs(w, row_bytes, acts, n, portable);
        let check =
            |name: &str, got: Vec<f32>| assert_bits(&format!("{ty} {name}"), &expected, &got);
        let (p, a) = (&packed[..], acts);
        if let Some(cpu) = Avx2F16c::detect(isa) {
            check("AVX2 T=1", run::<1, _>(cpu, ty, p, a, tokens, rows));
            check("AVX2 T=2", run::<2, _>(cpu, ty, p, a, tokens, rows));
        } else {
            eprintln!("skipped: {ty} tiles on AVX2 (not on this CPU)");
        }
        if let Some(cpu) = Avx512Vnni::detect(isa) {
            check("VNNI T=1", run::<1, _>(cpu, ty, p, a, tokens, rows));
            check("VNNI T=4", run::<4, _>(cpu, ty, p, a, tokens, rows));
        } else {
            eprintln!("skipped: {ty} tiles on AVX-512 VNNI (not on this CPU)");
        }
    }

    /// Every byte `fill` (nibbles 0, 15, 7, 8; Q4_K's scales and mins 0 or 63; Q6_K's codes
    /// 0, 63, ... under scales 0, 127, −128, −1) times activations that all quantize to ±127:
    /// the largest sums `maddubs` forms from a pair of bytes, and the largest sub-block sums
    /// the integer scales multiply. Every tile shape still equals the portable kernel.
    #[test]
    fn extreme_codes_equal_portable() {
        let isa = Isa::detect();
        let (rows, n, tokens) = (9, 2, 5);
        for (ty, portable) in [
            (
                GgmlType::Q4K,
                portable::dot_q4_k as fn(&[u8], &[Act256]) -> f32,
            ),
            (GgmlType::Q6K, portable::dot_q6_k),
        ] {
            let scale_at: &[usize] = if ty == GgmlType::Q6K { &[208] } else { &[0, 2] };
            for fill in EXTREME_FILLS {
                let bytes = rows * n * ty.block_bytes();
                let w = filled_rows(bytes, ty.block_bytes(), scale_at, fill);
                for sign in EXTREME_SIGNS {
                    let x: Vec<f32> = (0..tokens * n * 256).map(sign).collect();
                    let acts: Vec<Act256> = x.chunks_exact(256).map(Act256::quantize).collect();
                    compare(isa, ty, (rows, n, tokens), &w, &acts, portable);
                }
            }
        }
    }

    fn run<const T: usize, C: Tiles>(
        cpu: C,
        ty: GgmlType,
        packed: &[u8],
        acts: &[Act256],
        tokens: usize,
        n_rows: usize,
    ) -> Vec<f32> {
        let mut yt = vec![0.0f32; n_rows * tokens]; // [rows, tokens]
        let n = acts.len() / tokens;
        let mut buf = vec![0.0f32; n_rows.next_multiple_of(ROWS) * tokens];
        if T == 1 {
            // One token at a time, as decode runs.
            for t in 0..tokens {
                let mut outs = Outs::new(&mut buf, n_rows, 1);
                k_rows_of::<C, T>(cpu, ty, packed, &acts[t * n..(t + 1) * n], 1, &mut outs);
                (0..n_rows).for_each(|r| yt[r * tokens + t] = outs.get(r, 0));
            }
        } else {
            let mut outs = Outs::new(&mut buf, n_rows, tokens);
            k_rows_of::<C, T>(cpu, ty, packed, acts, tokens, &mut outs);
            for (i, y) in yt.iter_mut().enumerate() {
                *y = outs.get(i / tokens, i % tokens);
            }
        }
        yt
    }
}
