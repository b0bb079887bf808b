//! The 32-element formats on interleaved rows ([`super::interleave`]): register tiles of `G`
//! groups of 8 rows × `T` tokens, one vector lane per output row.
//!
//! ```text
//! for each block b:                           W: groups of 8 rows, interleaved
//!     d = the 8 rows' scales                  [8 × f32]    (and the offsets m)
//!     w[k] = elements 4k..4k+4 of the 8 rows  [8 × 4 bytes], k < 8, unpacked once per tile
//!     for each token t:                       ... and used by T tokens
//!         i = −c·Σx                           [8 × i32]    c: the format's zero point
//!         for k < 8: i += w[k] · bcast(x[4k..4k+4])       (vpdpbusd, or maddubs + madd)
//!         acc += (d · d_x) · i                [8 × f32]    the f32 steps, once per 8 rows
//! out[8 rows] = acc (+ the offsets' accumulator)
//! ```
//!
//! Lane `r` of every step is row `r`'s: its integer sum is the exact `Σ q_w · q_x` of the block,
//! and its f32 steps are [`super::acc_d`]'s in the portable kernels' order, so every output equals
//! the portable one-row kernel's bit for bit, whatever the tile shape or instruction set.
//!
//! Each kernel is a safe function taking a proof ([`Avx2F16c`], or [`super::vnni::Avx512Vnni`]),
//! checking the lengths its pointer arithmetic relies on, then calling its `unsafe` body
//! compiled with those instruction sets.

use std::arch::x86_64::*;

use super::Outs;
use super::avx2::{Avx2F16c, broadcast4, dot_u8_i8, high_bit, load32, prefetch};
use super::interleave::ROWS;
use super::ktiles::{KBlock, k_body, k_rows_of};
use super::{Act32, Act256};
use crate::format::GgmlType;

/// A 32-element format as the interleaved tiles see it: where its scales are and how a run of
/// 32 weights of 8 rows unpacks to 8 vectors. See [`super::interleave`] for the layout.
pub trait Packed {
    /// Bytes of one row's block in the file (an interleaved block of 8 rows is `8 · BYTES`).
    const BYTES: usize;
    /// `true`: 8 f16 offsets `m` follow the 8 scales (`x = d·q + m`).
    const OFFSET: bool;
    /// Runs of 32 weights per block (sharing its scales).
    const SUB: usize = 1;
    /// The zero point `c`: a stored weight `q` has the value `q − c` (Q4_0's 8, Q5_0's 16).
    const ZERO: i32 = 0;
    /// `true`: the weights are signed bytes (Q8_0), multiplied as [`ByteDot::BIASED_SIGNED`]
    /// says.
    const SIGNED: bool = false;
    /// Run `j < SUB` of the block at `p`: vector `k` holds elements `4k..4k + 4` of the 8 rows
    /// (row `r` at bytes `4r..4r + 4`), unsigned bytes (`q`), or signed ones if [`Packed::SIGNED`].
    ///
    /// # Safety
    /// The CPU must support AVX2; `p` must point to `8 · BYTES` readable bytes.
    unsafe fn weights(p: *const u8, j: usize) -> [__m256i; 8];
}

/// Bytes of the 8 rows' scales (and offsets) at the head of an interleaved block.
const fn head<F: Packed>() -> usize {
    if F::OFFSET { 4 * ROWS } else { 2 * ROWS }
}

/// Q8_0: 8 word vectors of signed bytes.
pub struct Q8_0;
/// Q4_0: 4 word vectors of nibbles, minus 8.
pub struct Q4_0;
/// Q4_1: 4 word vectors of nibbles, with offsets.
pub struct Q4_1;
/// Q5_0: the fifth-bit plane and 4 word vectors of nibbles, minus 16.
pub struct Q5_0;
/// Q5_1: the fifth-bit plane and 4 word vectors of nibbles, with offsets.
pub struct Q5_1;
/// `G` Q4_0 blocks sharing one scale per row.
pub struct Q4_0G<const G: usize>;
/// `G` Q4_1 blocks sharing one scale and offset per row.
pub struct Q4_1G<const G: usize>;

/// The 8 vectors of 4 word vectors of nibbles at `p`: vector `v`'s low nibbles are elements
/// `4v..4v + 4`, its high nibbles elements `4(v + 4)..`.
///
/// # Safety
/// The CPU must support AVX2; `p` must point to 128 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn nibble_words(p: *const u8) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut w = [_mm256_setzero_si256(); 8];
    for v in 0..4 {
        // SAFETY: bytes 32v..32v + 32 < 128 (caller).
        let raw = unsafe { load32(p.add(32 * v)) };
        w[v] = _mm256_and_si256(raw, m4);
        w[v + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
    }
    w
}

/// [`nibble_words`] with the fifth bits of the plane at `p` (the words follow it).
///
/// # Safety
/// The CPU must support AVX2; `p` must point to 160 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q5_words(p: *const u8) -> [__m256i; 8] {
    // SAFETY: the plane at 0..32, the words at 32..160 (caller).
    unsafe {
        let qh = load32(p);
        let mut w = nibble_words(p.add(32));
        for (k, w) in w.iter_mut().enumerate() {
            *w = _mm256_or_si256(*w, high_bit(qh, k as i32));
        }
        w
    }
}

impl Packed for Q8_0 {
    const BYTES: usize = 34;
    const OFFSET: bool = false;
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> [__m256i; 8] {
        // SAFETY: the 8 word vectors at 16..272 of the block (caller).
        std::array::from_fn(|k| unsafe { load32(p.add(head::<Self>() + 32 * k)) })
    }
}

impl Packed for Q4_0 {
    const BYTES: usize = 18;
    const OFFSET: bool = false;
    const ZERO: i32 = 8;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> [__m256i; 8] {
        // SAFETY: the words at 16..144 of the block (caller).
        unsafe { nibble_words(p.add(head::<Self>())) }
    }
}

impl Packed for Q4_1 {
    const BYTES: usize = 20;
    const OFFSET: bool = true;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> [__m256i; 8] {
        // SAFETY: the words at 32..160 of the block (caller).
        unsafe { nibble_words(p.add(head::<Self>())) }
    }
}

impl Packed for Q5_0 {
    const BYTES: usize = 22;
    const OFFSET: bool = false;
    const ZERO: i32 = 16;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> [__m256i; 8] {
        // SAFETY: the plane and words at 16..176 of the block (caller).
        unsafe { q5_words(p.add(head::<Self>())) }
    }
}

impl Packed for Q5_1 {
    const BYTES: usize = 24;
    const OFFSET: bool = true;
    #[inline(always)]
    unsafe fn weights(p: *const u8, _: usize) -> [__m256i; 8] {
        // SAFETY: the plane and words at 32..192 of the block (caller).
        unsafe { q5_words(p.add(head::<Self>())) }
    }
}

// ANCHOR: grouped_weights
impl<const G: usize> Packed for Q4_0G<G> {
    const BYTES: usize = 2 + 16 * G;
    const OFFSET: bool = false;
    const SUB: usize = G;
    const ZERO: i32 = 8;
    #[inline(always)]
    unsafe fn weights(p: *const u8, j: usize) -> [__m256i; 8] {
        // SAFETY: run j's words at 16 + 128j..144 + 128j, j < G (caller).
        unsafe { nibble_words(p.add(head::<Self>() + 128 * j)) }
    }
}

impl<const G: usize> Packed for Q4_1G<G> {
    const BYTES: usize = 4 + 16 * G;
    const OFFSET: bool = true;
    const SUB: usize = G;
    #[inline(always)]
    unsafe fn weights(p: *const u8, j: usize) -> [__m256i; 8] {
        // SAFETY: run j's words at 32 + 128j..160 + 128j, j < G (caller).
        unsafe { nibble_words(p.add(head::<Self>() + 128 * j)) }
    }
}
// ANCHOR_END: grouped_weights

/// How a tile adds 4 byte products per i32 lane: `acc + Σ u·s` over bytes `4k..4k + 4`,
/// exactly (the weights are at most 31, or 128 with the sign trick, and `|s| ≤ 127`, so
/// nothing saturates).
pub trait ByteDot {
    /// `true`: signed weights `w` are multiplied as `w + 128` (unsigned, up to 255), and
    /// `128 · Σx` is taken off the sum, which needs a product that cannot saturate; `false`:
    /// by the sign trick, `|w| · (x · sign w)`.
    const BIASED_SIGNED: bool;

    /// # Safety
    /// The CPU must support the instructions of the implementation. (For an exact sum, when
    /// `BIASED_SIGNED` is false: `2 · u · |s| < 32768` for every pair of bytes.)
    unsafe fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i;
}

/// AVX2: `maddubs` (pairs into i16), `madd` by ones (pairs of those into i32), then an add.
pub enum Maddubs {}

impl ByteDot for Maddubs {
    /// `maddubs` would saturate on `2 · 255 · 127`.
    const BIASED_SIGNED: bool = false;

    #[inline(always)]
    unsafe fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: the caller's.
        unsafe { _mm256_add_epi32(acc, dot_u8_i8(u, s)) }
    }
}

/// A CPU proof that can run the tiles' body, and the tile shapes it runs best: [`Avx2F16c`]
/// (`maddubs`, 16 vector registers) or [`super::vnni::Avx512Vnni`] (`vpdpbusd`, 32 registers).
pub trait Tiles: Copy {
    /// [`rows`] with this CPU's tile shapes for one token (decode) and several (prefill).
    fn rows<F: Packed>(self, packed: &[u8], acts: &[Act32], tokens: usize, outs: &mut Outs<'_>);

    /// [`tile_body`] compiled for this CPU.
    ///
    /// # Safety
    /// As [`tile_body`]'s, but for the instruction sets, which `self` proves.
    unsafe fn tile_body<F: Packed, const G: usize, const T: usize>(
        self,
        packed: *const u8,
        group_bytes: usize,
        acts: *const Act32,
        n: usize,
        out: &mut [[[f32; ROWS]; T]; G],
    );

    /// [`k_rows_of`] (Q4_K, Q6_K) with this CPU's tokens per tile for several tokens.
    fn rows_k(
        self,
        ty: GgmlType,
        packed: &[u8],
        acts: &[Act256],
        tokens: usize,
        outs: &mut Outs<'_>,
    );

    /// [`k_body`] compiled for this CPU.
    ///
    /// # Safety
    /// As [`k_body`]'s, but for the instruction sets, which `self` proves.
    unsafe fn k_body<F: KBlock, const T: usize>(
        self,
        packed: *const u8,
        acts: *const Act256,
        n: usize,
        out: &mut [[f32; ROWS]; T],
    );
}

impl Tiles for Avx2F16c {
    /// One token (decode) takes 2 groups (16 rows), so each activation load serves 16 rows and
    /// two integer chains are in flight; several tokens (prefill) take 1 group × 2 tokens: the
    /// unpacked weights (8 registers) and the accumulators fill the 16 registers.
    fn rows<F: Packed>(self, packed: &[u8], acts: &[Act32], tokens: usize, outs: &mut Outs<'_>) {
        rows_in::<F, _, 2, 1, 2>(self, packed, acts, tokens, outs)
    }

    unsafe fn tile_body<F: Packed, const G: usize, const T: usize>(
        self,
        packed: *const u8,
        group_bytes: usize,
        acts: *const Act32,
        n: usize,
        out: &mut [[[f32; ROWS]; T]; G],
    ) {
        // SAFETY: `self` proves AVX2, FMA and F16C; the rest is the caller's.
        unsafe { tile_body::<F, Maddubs, G, T>(packed, group_bytes, acts, n, out) }
    }

    /// Two tokens per tile for several (16 registers hold two tokens' partial sums).
    fn rows_k(
        self,
        ty: GgmlType,
        packed: &[u8],
        acts: &[Act256],
        tokens: usize,
        outs: &mut Outs<'_>,
    ) {
        k_rows_of::<_, 2>(self, ty, packed, acts, tokens, outs)
    }

    unsafe fn k_body<F: KBlock, const T: usize>(
        self,
        packed: *const u8,
        acts: *const Act256,
        n: usize,
        out: &mut [[f32; ROWS]; T],
    ) {
        // SAFETY: `self` proves AVX2, FMA and F16C; the rest is the caller's.
        unsafe { k_body::<F, Maddubs, T>(packed, acts, n, out) }
    }
}

/// `out[g][t][r]` = row `8g + r` of the `G` groups at `packed` (`group_bytes` apart) · token `t`
/// of `acts` (`T` tokens of `n` blocks): `G × T` accumulators of 8 f32 lanes, one per row.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and what `D` uses; `packed + g · group_bytes` must point
/// to `n / SUB` interleaved blocks of `8 · BYTES` readable bytes for every `g < G`, and `acts` to
/// `T · n` activation blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_body<F: Packed, D: ByteDot, const G: usize, const T: usize>(
    packed: *const u8,
    group_bytes: usize,
    acts: *const Act32,
    n: usize,
    out: &mut [[[f32; ROWS]; T]; G],
) {
    // ANCHOR: interleaved_tile
    let block_bytes = ROWS * F::BYTES; // one block of the group's 8 rows
    let l1 = super::prefetch_into_l1(T);
    let mut acc = [[_mm256_setzero_ps(); T]; G]; // [G, T, 8 rows]
    let mut acc_m = [[_mm256_setzero_ps(); T]; G];
    // Signed weights, as `D` multiplies them: w + 128 (the sign bit flipped), or the sign trick
    // w · x = |w| · (x · sign(w)).
    let (biased, trick) = (
        F::SIGNED && D::BIASED_SIGNED,
        F::SIGNED && !D::BIASED_SIGNED,
    );
    let zero = F::ZERO + if biased { 128 } else { 0 }; // the sum starts at −zero · Σx
    for b in 0..n / F::SUB {
        for g in 0..G {
            let p = packed.wrapping_add(g * group_bytes + b * block_bytes);
            // The same block of the group the next tile reads, `G` groups on: a group is a
            // short stream (8 rows of a few hundred bytes), too short for the hardware's
            // prefetcher to reach full speed on its own. A decode tile's into L2 (the next tile
            // is 10 to 51 KiB of SmolLM2's weights, more than L1 holds beside this one), a
            // tile of several tokens' into L1 (`prefetch_into_l1`).
            prefetch(p.wrapping_add(G * group_bytes), block_bytes, l1);
            // SAFETY: block `b` of group `g` is readable (caller): the scales at 0..16, the
            // offsets at 16..32.
            let (d, m) = unsafe {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                let m = if F::OFFSET {
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i))
                } else {
                    d
                };
                (d, m)
            };
            for j in 0..F::SUB {
                let k = b * F::SUB + j; // the run of 32 weights, and its activation block
                // SAFETY: block `b` of group `g` is readable (caller), `j < SUB`.
                let w = unsafe { F::weights(p, j) }; // [8 k, 8 rows × 4 bytes]
                let u = if biased {
                    w.map(|w| _mm256_xor_si256(w, _mm256_set1_epi8(i8::MIN)))
                } else if trick {
                    w.map(|w| _mm256_sign_epi8(w, w))
                } else {
                    w
                };
                for t in 0..T {
                    // SAFETY: activation block `t·n + k` is readable (caller).
                    let a = unsafe { &*acts.add(t * n + k) };
                    // Two chains of integer sums, so that one waits less on the other.
                    let mut i = [_mm256_set1_epi32(-zero * a.sum), _mm256_setzero_si256()];
                    for kk in 0..8 {
                        // SAFETY: 4kk + 4 ≤ 32; `D`'s instructions are present (caller), and the
                        // weights (≤ 31, or |w| ≤ 128) times |x| ≤ 127 never saturate.
                        unsafe {
                            let x = broadcast4(&a.q, 4 * kk);
                            let s = if trick { _mm256_sign_epi8(x, w[kk]) } else { x };
                            i[kk % 2] = D::dot(i[kk % 2], u[kk], s);
                        }
                    }
                    let isum = _mm256_add_epi32(i[0], i[1]); // [8 rows] exact Σ q_w·q_x
                    let dx = _mm256_set1_ps(a.d);
                    let scale = _mm256_mul_ps(d, dx);
                    acc[g][t] =
                        _mm256_add_ps(acc[g][t], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum)));
                    if F::OFFSET {
                        let sum = _mm256_set1_ps(a.sum as f32);
                        acc_m[g][t] =
                            _mm256_add_ps(acc_m[g][t], _mm256_mul_ps(_mm256_mul_ps(m, dx), sum));
                    }
                }
            }
        }
    }
    // ANCHOR_END: interleaved_tile
    for g in 0..G {
        for t in 0..T {
            // Formats without an offset add nothing (not even +0.0, which would turn −0 into +0).
            let v = if F::OFFSET {
                _mm256_add_ps(acc[g][t], acc_m[g][t])
            } else {
                acc[g][t]
            };
            // SAFETY: `out[g][t]` is 8 writable f32.
            unsafe { _mm256_storeu_ps(out[g][t].as_mut_ptr(), v) };
        }
    }
}

/// `G` groups (whole groups of `packed`, `n / SUB` blocks a row) times `T` tokens of `acts`.
///
/// Panics unless `packed` is `G` groups of one run of 32 weights per activation block.
pub fn tile<F: Packed, C: Tiles, const G: usize, const T: usize>(
    cpu: C,
    packed: &[u8],
    acts: &[Act32],
    out: &mut [[[f32; ROWS]; T]; G],
) {
    let n = acts.len() / T;
    assert_eq!(acts.len(), n * T, "T tokens of whole blocks");
    assert_eq!(n % F::SUB, 0, "whole grouped blocks");
    let group_bytes = n / F::SUB * ROWS * F::BYTES;
    assert_eq!(
        packed.len(),
        G * group_bytes,
        "G groups of one run per activation block"
    );
    // SAFETY: `cpu` proves the instruction sets its body needs; the body reads blocks
    // `b < n / SUB` of groups `g < G` at `g·group_bytes + b·8·BYTES`, inside `packed`, and
    // activation blocks `t·n + k < T·n`, inside `acts`, as checked above.
    unsafe { cpu.tile_body::<F, G, T>(packed.as_ptr(), group_bytes, acts.as_ptr(), n, out) }
}

/// [`rows`] in tiles of `D` groups × 1 token for one token (decode), `R × T` for several
/// (prefill): the shapes a [`Tiles`] CPU picks.
#[inline]
pub fn rows_in<F: Packed, C: Tiles, const D: usize, const R: usize, const T: usize>(
    cpu: C,
    packed: &[u8],
    acts: &[Act32],
    tokens: usize,
    outs: &mut Outs<'_>,
) {
    if tokens == 1 {
        rows::<F, C, D, 1>(cpu, packed, acts, tokens, outs)
    } else {
        rows::<F, C, R, T>(cpu, packed, acts, tokens, outs)
    }
}

/// The rows of `packed` (interleaved groups, the last one possibly part zero rows) times every
/// token of `acts` into `outs` (`outs.rows()` rows): tiles of `G` groups × `T` tokens, then the
/// groups and tokens left over one at a time.
pub fn rows<F: Packed, C: Tiles, const G: usize, const T: usize>(
    cpu: C,
    packed: &[u8],
    acts: &[Act32],
    tokens: usize,
    outs: &mut Outs<'_>,
) {
    let n_rows = outs.rows();
    if n_rows == 0 || tokens == 0 {
        return;
    }
    let n = acts.len() / tokens;
    let group_bytes = n / F::SUB * ROWS * F::BYTES;
    let groups = n_rows.div_ceil(ROWS);
    let mut g = 0;
    while g + G <= groups {
        let packed = &packed[g * group_bytes..(g + G) * group_bytes];
        token_tiles::<F, C, G, T>(cpu, packed, acts, n, tokens, g, outs);
        g += G;
    }
    for g in g..groups {
        let packed = &packed[g * group_bytes..(g + 1) * group_bytes];
        token_tiles::<F, C, 1, T>(cpu, packed, acts, n, tokens, g, outs);
    }
}

/// Groups `g0..g0 + G` times every token (`n` blocks each): tiles of `T` tokens, then single
/// tokens; writes the rows of `outs` that exist.
#[inline]
fn token_tiles<F: Packed, C: Tiles, const G: usize, const T: usize>(
    cpu: C,
    packed: &[u8],
    acts: &[Act32],
    n: usize,
    tokens: usize,
    g0: usize,
    outs: &mut Outs<'_>,
) {
    let mut write = |t: usize, g: usize, o: &[f32; ROWS]| outs.set8(g0 + g, t, o);
    let mut t = 0;
    while t + T <= tokens {
        let mut out = [[[0.0f32; ROWS]; T]; G];
        tile::<F, C, G, T>(cpu, packed, &acts[t * n..(t + T) * n], &mut out);
        for (g, o) in out.iter().enumerate() {
            for (j, o) in o.iter().enumerate() {
                write(t + j, g, o);
            }
        }
        t += T;
    }
    for t in t..tokens {
        let mut out = [[[0.0f32; ROWS]; 1]; G];
        tile::<F, C, G, 1>(cpu, packed, &acts[t * n..(t + 1) * n], &mut out);
        for (g, o) in out.iter().enumerate() {
            write(t, g, &o[0]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::interleave::pack;
    use super::super::portable;
    use super::super::test_util::{
        EXTREME_FILLS, EXTREME_SIGNS, assert_bits, filled_rows, portable_outputs, random_inputs,
        random_rows,
    };
    use super::super::vnni::Avx512Vnni;
    use super::*;
    use crate::format::GgmlType;
    use ch02::kernels::Isa;

    /// Every tile shape, on AVX2 and on AVX-512 VNNI, equals the portable one-row kernel bit for
    /// bit (the public tests reach only the shapes and the instruction set this CPU picks).
    /// 21 rows: two whole groups and a third of 5 rows and 3 zero rows.
    fn tiles_equal_portable<F: Packed>(
        ty: GgmlType,
        scale_at: &[usize],
        portable: impl Fn(&[u8], &[Act32]) -> f32,
    ) {
        let (rows, tokens, n) = (21, 7, 2 * F::SUB);
        let row_bytes = n / F::SUB * F::BYTES;
        let w = random_rows(rows * row_bytes, F::BYTES, scale_at, 7);
        let x = random_inputs(tokens * n * 32, 11);
        compare::<F>(ty, (rows, tokens, n), &w, &x, portable);
    }

    /// Every tile shape on `w` (`rows` rows of `n` runs of 32, the file's layout) times `x`
    /// (`tokens` tokens) against the portable kernel, bit for bit.
    fn compare<F: Packed>(
        ty: GgmlType,
        (rows, tokens, n): (usize, usize, usize),
        w: &[u8],
        x: &[f32],
        portable: impl Fn(&[u8], &[Act32]) -> f32,
    ) {
        let isa = Isa::detect();
        let row_bytes = n / F::SUB * F::BYTES;
        let packed = pack(ty, F::SUB, rows, row_bytes, w);
        let acts: Vec<Act32> = x.chunks_exact(32).map(Act32::quantize).collect();
        let expected = portable_outputs(w, row_bytes, &acts, n, portable);
        let check =
            |name: &str, got: Vec<f32>| assert_bits(&format!("{ty} tile {name}"), &expected, &got);
        let (p, a) = (&packed[..], &acts[..]);
        if let Some(cpu) = Avx2F16c::detect(isa) {
            check("AVX2 2x1", run::<F, _, 2, 1>(cpu, p, a, tokens, rows));
            check("AVX2 1x2", run::<F, _, 1, 2>(cpu, p, a, tokens, rows));
            check("AVX2 1x1", run::<F, _, 1, 1>(cpu, p, a, tokens, rows));
            check("AVX2 3x3", run::<F, _, 3, 3>(cpu, p, a, tokens, rows));
        } else {
            eprintln!("skipped: {ty} tiles on AVX2 (not on this CPU)");
        }
        if let Some(cpu) = Avx512Vnni::detect(isa) {
            check("VNNI 4x1", run::<F, _, 4, 1>(cpu, p, a, tokens, rows));
            check("VNNI 2x4", run::<F, _, 2, 4>(cpu, p, a, tokens, rows));
            check("VNNI 1x1", run::<F, _, 1, 1>(cpu, p, a, tokens, rows));
        } else {
            eprintln!("skipped: {ty} tiles on AVX-512 VNNI (not on this CPU)");
        }
    }

    fn run<F: Packed, C: Tiles, const G: usize, const T: usize>(
        cpu: C,
        packed: &[u8],
        acts: &[Act32],
        tokens: usize,
        n_rows: usize,
    ) -> Vec<f32> {
        let mut buf = vec![0.0f32; n_rows.next_multiple_of(ROWS) * tokens];
        let mut outs = Outs::new(&mut buf, n_rows, tokens);
        rows::<F, C, G, T>(cpu, packed, acts, tokens, &mut outs);
        // [rows, tokens], as `portable_outputs` lays them.
        (0..n_rows)
            .flat_map(|r| (0..tokens).map(move |t| (r, t)))
            .map(|(r, t)| outs.get(r, t))
            .collect()
    }

    /// Every byte `fill` (Q8_0's codes 0, 127, −128, −1; nibbles 0, 15, 7, 8 and Q5's fifth
    /// bits all 0 or all 1) times activations that all quantize to +127, −127, or ±127 in pairs
    /// of alternate sign: the largest sums `maddubs` forms from each pair of bytes. Every tile
    /// shape still equals the portable kernel, whose sums are plain i32 (a saturating pair, or
    /// Q8_0's `w + 128` on `maddubs`, would not).
    fn extremes<F: Packed>(
        ty: GgmlType,
        scale_at: &[usize],
        portable: impl Fn(&[u8], &[Act32]) -> f32 + Copy,
    ) {
        let (rows, tokens, n) = (11, 3, 2 * F::SUB);
        let row_bytes = n / F::SUB * F::BYTES;
        for fill in EXTREME_FILLS {
            let w = filled_rows(rows * row_bytes, F::BYTES, scale_at, fill);
            for sign in EXTREME_SIGNS {
                let x: Vec<f32> = (0..tokens * n * 32).map(sign).collect();
                compare::<F>(ty, (rows, tokens, n), &w, &x, portable);
            }
        }
    }

    #[test]
    fn extreme_codes_equal_portable() {
        use GgmlType as T;
        extremes::<Q8_0>(T::Q8_0, &[0], portable::dot_q8_0);
        extremes::<Q4_0>(T::Q4_0, &[0], portable::dot_q4_0);
        extremes::<Q4_1>(T::Q4_1, &[0, 2], portable::dot_q4_1);
        extremes::<Q5_0>(T::Q5_0, &[0], portable::dot_q5_0);
        extremes::<Q5_1>(T::Q5_1, &[0, 2], portable::dot_q5_1);
        extremes::<Q4_0G<2>>(T::Q4_0, &[0], |r, a| portable::dot_q4_0_grouped(r, a, 2));
    }

    #[test]
    fn every_tile_shape_equals_portable() {
        use GgmlType as T;
        tiles_equal_portable::<Q8_0>(T::Q8_0, &[0], portable::dot_q8_0);
        tiles_equal_portable::<Q4_0>(T::Q4_0, &[0], portable::dot_q4_0);
        tiles_equal_portable::<Q4_1>(T::Q4_1, &[0, 2], portable::dot_q4_1);
        tiles_equal_portable::<Q5_0>(T::Q5_0, &[0], portable::dot_q5_0);
        tiles_equal_portable::<Q5_1>(T::Q5_1, &[0, 2], portable::dot_q5_1);
        tiles_equal_portable::<Q4_0G<4>>(T::Q4_0, &[0], |r, a| portable::dot_q4_0_grouped(r, a, 4));
        tiles_equal_portable::<Q4_1G<2>>(T::Q4_1, &[0, 2], |r, a| {
            portable::dot_q4_1_grouped(r, a, 2)
        });
    }
}
