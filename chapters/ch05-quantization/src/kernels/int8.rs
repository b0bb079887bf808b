//! Int8 weights times int8 activations on interleaved rows: the exact i32 sums of W8A8
//! ([`crate::smoothquant::W8A8Linear`]), computed in register tiles as the 32-element formats'
//! tiles compute theirs ([`super::interleave`]).
//!
//! ```text
//! W: groups of 8 rows, word k = codes 4k..4k+4 of each row     [groups, cols/4, 8 rows × 4 bytes]
//! for k < cols/4:
//!     w[g] = word k of group g                   loaded once, used by T tokens
//!     for t < T:
//!         x = bcast(X[t, 4k..4k+4])              4 activation codes in every lane
//!         acc[g][t] += w[g] · x                  [8 rows × i32], 4 products per lane
//! ```
//!
//! Unlike a block format, W8A8 has one scale per row and one per token, so a row's whole sum
//! stays in integers: no f32 step runs inside the loop, and the sums are exact, whatever the
//! tile shape or the instruction set. Two ways to multiply signed bytes by signed bytes:
//!
//! - AVX2 (`maddubs`, unsigned × signed bytes): `|w| · (x · sign w)`. Each pair of products is
//!   at most `2 · 127 · 127 = 32258`, below the i16 saturation of `maddubs`.
//! - AVX-512 VNNI (`vpdpbusd`): the activations as unsigned bytes `x + 128` (its four products
//!   add in i32, never saturating), so a lane gains `Σ x·w + 128 · Σ w`; the second term is a
//!   constant of the row, stored beside the codes when they are packed and taken off at the end.
//!   The arithmetic wraps modulo 2³², so the result is exact whenever the true sum fits an i32.
//!
//! The codes must lie in `-127..=127` (W8A8's symmetric grid): a `-128` would overflow the
//! absolute value of the AVX2 form.

use std::ops::Range;

use super::interleave::ROWS;
use ch02::kernels::Isa;

/// An `[rows, cols]` matrix of int8 codes as the tiles read it: groups of [`ROWS`] rows, each a
/// run of 32-byte words (word `k`: codes `4k..4k + 4` of row `r` at bytes `4r..4r + 4`), the
/// columns filled up with zeros to a multiple of 4 and the last group with zero rows.
///
/// Invariant: `words.len() == groups · stride · ROWS`, `row_bias.len() == groups · ROWS`,
/// `row_bias[r] == 128 · Σ_i codes[r][i]` (wrapping), every code in `-127..=127`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Int8Rows {
    words: Vec<i8>,     // [groups, stride / 4, ROWS, 4]
    row_bias: Vec<i32>, // [groups · ROWS] 128 · Σ codes of the row
    rows: usize,
    cols: usize,
}

/// Why codes could not be packed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Int8RowsError {
    #[error("{codes} codes are not [{rows}, {cols}]")]
    Shape {
        codes: usize,
        rows: usize,
        cols: usize,
    },
    #[error("code -128 at {0}: the tiles take -127..=127")]
    Code(usize),
}

impl Int8Rows {
    /// Packs `codes` `[rows, cols]`, row-major.
    pub fn pack(codes: &[i8], rows: usize, cols: usize) -> Result<Int8Rows, Int8RowsError> {
        if Some(codes.len()) != rows.checked_mul(cols) {
            return Err(Int8RowsError::Shape {
                codes: codes.len(),
                rows,
                cols,
            });
        }
        if let Some(at) = codes.iter().position(|&c| c == i8::MIN) {
            return Err(Int8RowsError::Code(at));
        }
        let stride = cols.next_multiple_of(4);
        let groups = rows.div_ceil(ROWS);
        let mut words = vec![0i8; groups * stride * ROWS];
        let mut row_bias = vec![0i32; groups * ROWS];
        for (r, row) in codes.chunks_exact(cols.max(1)).take(rows).enumerate() {
            let (g, lane) = (r / ROWS, r % ROWS);
            for (i, &c) in row.iter().enumerate() {
                words[Self::at(g, i, lane, stride)] = c;
            }
            let sum = row
                .iter()
                .map(|&c| i32::from(c))
                .fold(0i32, i32::wrapping_add);
            row_bias[r] = sum.wrapping_mul(128);
        }
        Ok(Int8Rows {
            words,
            row_bias,
            rows,
            cols,
        })
    }

    /// Where code `i` of lane `lane` of group `g` lies in `words`.
    fn at(g: usize, i: usize, lane: usize, stride: usize) -> usize {
        g * stride * ROWS + (i / 4) * 4 * ROWS + 4 * lane + i % 4
    }

    /// The codes `[rows, cols]`, row-major, as they were packed.
    pub fn unpack(&self) -> Vec<i8> {
        let stride = self.stride();
        (0..self.rows)
            .flat_map(|r| (0..self.cols).map(move |i| (r, i)))
            .map(|(r, i)| self.words[Self::at(r / ROWS, i, r % ROWS, stride)])
            .collect()
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Codes per row as stored: `cols` rounded up to a multiple of 4, the length each token's
    /// activation codes must have.
    pub fn stride(&self) -> usize {
        self.cols.next_multiple_of(4)
    }

    /// Groups of [`ROWS`] rows.
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(ROWS)
    }

    /// Bytes held: the codes with their padding, and the rows' constants.
    pub fn bytes(&self) -> usize {
        self.words.len() + 4 * self.row_bias.len()
    }
}

/// A CPU that runs the tiles: AVX2, or AVX-512 VNNI too. Safe code gets one only from
/// [`Int8Cpu::detect`], after run-time detection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int8Cpu(Cpu);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cpu {
    #[cfg(target_arch = "x86_64")]
    Avx2(ch02::kernels::Avx2Fma),
    #[cfg(target_arch = "x86_64")]
    Vnni(super::vnni::Avx512Vnni),
}

impl Int8Cpu {
    /// The fastest form for `isa` on this CPU: `None` for [`Isa::Portable`] (or a CPU without
    /// AVX2), whose callers keep their dot products.
    pub fn detect(isa: Isa) -> Option<Int8Cpu> {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(cpu) = super::vnni::Avx512Vnni::detect(isa) {
                return Some(Int8Cpu(Cpu::Vnni(cpu)));
            }
            if let Isa::Avx2Fma(cpu) = isa {
                return Some(Int8Cpu(Cpu::Avx2(cpu)));
            }
        }
        let _ = isa;
        None
    }

    /// This CPU's AVX2 form (for the tests, which compare both forms).
    #[cfg(test)]
    fn avx2(self) -> Int8Cpu {
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            Cpu::Vnni(cpu) => Int8Cpu(Cpu::Avx2(cpu.avx2_f16c().avx2_fma())),
            #[cfg(target_arch = "x86_64")]
            Cpu::Avx2(_) => self,
        }
    }
}

/// The exact sums `out[(g − groups.start) · ROWS + r][t] = Σ_i x[t][i] · w[ROWS·g + r][i]` for
/// the groups `groups` of `w` and every token of `x` (`[tokens, w.stride()]`, codes in
/// `-127..=127`, zeros past `w.cols()`). `out` is `[groups.len() · ROWS, tokens]`; the rows past
/// `w.rows()` are zero.
///
/// Panics if the lengths do not match, or a group lies past `w`'s last.
pub fn int8_products(cpu: Int8Cpu, w: &Int8Rows, groups: Range<usize>, x: &[i8], out: &mut [i32]) {
    let stride = w.stride();
    let tokens = x.len().checked_div(stride).unwrap_or(0);
    assert_eq!(
        x.len(),
        tokens * stride,
        "[tokens, stride] activation codes"
    );
    assert!(
        groups.start <= groups.end && groups.end <= w.groups(),
        "groups of w"
    );
    assert_eq!(
        out.len(),
        groups.len() * ROWS * tokens,
        "[rows, tokens] sums"
    );
    #[cfg(target_arch = "x86_64")]
    use x86::Int8Tiles;
    match cpu.0 {
        #[cfg(target_arch = "x86_64")]
        Cpu::Avx2(cpu) => cpu.rows(w, groups, x, tokens, out),
        #[cfg(target_arch = "x86_64")]
        Cpu::Vnni(cpu) => cpu.rows(w, groups, x, tokens, out),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::super::avx2::load32;
    use super::super::tiles::{ByteDot, Maddubs};
    use super::super::vnni::{Avx512Vnni, Dpbusd};
    use super::{Int8Rows, ROWS};
    use ch02::kernels::Avx2Fma;

    /// A CPU proof with its tile shapes and its body compiled for it.
    pub trait Int8Tiles: Copy {
        /// `groups` × every token in tiles of this CPU's shapes.
        fn rows(self, w: &Int8Rows, groups: Range<usize>, x: &[i8], tokens: usize, out: &mut [i32]);

        /// [`body`] compiled for this CPU.
        ///
        /// # Safety
        /// As [`body`]'s, but for the instruction sets, which `self` proves.
        unsafe fn body<const G: usize, const T: usize>(
            self,
            w: *const i8,
            bias: *const i32,
            x: *const i8,
            stride: usize,
            out: &mut [[[i32; ROWS]; T]; G],
        );
    }

    impl Int8Tiles for Avx2Fma {
        /// Decode: 2 groups (two chains of sums); prefill: 2 groups × 2 tokens (the weights,
        /// their absolute values, 4 accumulators and the broadcasts fill 16 registers).
        fn rows(
            self,
            w: &Int8Rows,
            groups: Range<usize>,
            x: &[i8],
            tokens: usize,
            out: &mut [i32],
        ) {
            if tokens == 1 {
                tiles::<_, 2, 1>(self, w, groups, x, tokens, out)
            } else {
                tiles::<_, 2, 2>(self, w, groups, x, tokens, out)
            }
        }

        unsafe fn body<const G: usize, const T: usize>(
            self,
            w: *const i8,
            bias: *const i32,
            x: *const i8,
            stride: usize,
            out: &mut [[[i32; ROWS]; T]; G],
        ) {
            // SAFETY: `self` proves AVX2 and FMA; the rest is the caller's.
            unsafe { body::<Maddubs, G, T>(w, bias, x, stride, out) }
        }
    }

    impl Int8Tiles for Avx512Vnni {
        /// Decode: 4 groups; prefill: 4 groups × 4 tokens (16 accumulators, 4 words and the
        /// broadcasts among 32 registers).
        fn rows(
            self,
            w: &Int8Rows,
            groups: Range<usize>,
            x: &[i8],
            tokens: usize,
            out: &mut [i32],
        ) {
            if tokens == 1 {
                tiles::<_, 4, 1>(self, w, groups, x, tokens, out)
            } else {
                tiles::<_, 4, 4>(self, w, groups, x, tokens, out)
            }
        }

        unsafe fn body<const G: usize, const T: usize>(
            self,
            w: *const i8,
            bias: *const i32,
            x: *const i8,
            stride: usize,
            out: &mut [[[i32; ROWS]; T]; G],
        ) {
            // SAFETY: `self` proves every instruction set `vnni_body` enables; the rest is the
            // caller's.
            unsafe { vnni_body::<G, T>(w, bias, x, stride, out) }
        }
    }

    /// [`body`] with `vpdpbusd`, compiled for AVX-512 VNNI (inlined here, so that it gets the 32
    /// registers and the instruction inline).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and AVX-512 F, VL and VNNI; the pointers as [`body`]
    /// requires.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn vnni_body<const G: usize, const T: usize>(
        w: *const i8,
        bias: *const i32,
        x: *const i8,
        stride: usize,
        out: &mut [[[i32; ROWS]; T]; G],
    ) {
        // SAFETY: the caller's guarantees are `body`'s.
        unsafe { body::<Dpbusd, G, T>(w, bias, x, stride, out) }
    }

    /// `groups` of `w` × the `tokens` tokens of `x` into `out` ([`super::int8_products`]'s
    /// layout): tiles of `G` groups × `T` tokens, then the groups and tokens left over one at a
    /// time.
    fn tiles<C: Int8Tiles, const G: usize, const T: usize>(
        cpu: C,
        w: &Int8Rows,
        groups: Range<usize>,
        x: &[i8],
        tokens: usize,
        out: &mut [i32],
    ) {
        let mut g = groups.start;
        while g + G <= groups.end {
            token_tiles::<C, G, T>(cpu, w, g, groups.start, x, tokens, out);
            g += G;
        }
        for g in g..groups.end {
            token_tiles::<C, 1, T>(cpu, w, g, groups.start, x, tokens, out);
        }
    }

    /// Groups `g..g + G` × every token: tiles of `T` tokens, then single tokens.
    #[inline]
    fn token_tiles<C: Int8Tiles, const G: usize, const T: usize>(
        cpu: C,
        w: &Int8Rows,
        g: usize,
        g0: usize,
        x: &[i8],
        tokens: usize,
        out: &mut [i32],
    ) {
        let mut write = |t: usize, j: usize, sums: &[i32; ROWS]| {
            for (r, &s) in sums.iter().enumerate() {
                out[((g - g0 + j) * ROWS + r) * tokens + t] = s;
            }
        };
        let mut t = 0;
        while t + T <= tokens {
            let mut sums = [[[0i32; ROWS]; T]; G];
            tile::<C, G, T>(
                cpu,
                w,
                g,
                &x[t * w.stride()..(t + T) * w.stride()],
                &mut sums,
            );
            for (j, s) in sums.iter().enumerate() {
                for (i, s) in s.iter().enumerate() {
                    write(t + i, j, s);
                }
            }
            t += T;
        }
        for t in t..tokens {
            let mut sums = [[[0i32; ROWS]; 1]; G];
            tile::<C, G, 1>(
                cpu,
                w,
                g,
                &x[t * w.stride()..(t + 1) * w.stride()],
                &mut sums,
            );
            for (j, s) in sums.iter().enumerate() {
                write(t, j, &s[0]);
            }
        }
    }

    /// Groups `g..g + G` of `w` × the `T` tokens of `x`.
    ///
    /// Panics unless the groups exist and `x` is `T` tokens of `w.stride()` codes.
    fn tile<C: Int8Tiles, const G: usize, const T: usize>(
        cpu: C,
        w: &Int8Rows,
        g: usize,
        x: &[i8],
        out: &mut [[[i32; ROWS]; T]; G],
    ) {
        let group_len = w.stride() * ROWS;
        let words = &w.words[g * group_len..(g + G) * group_len];
        let bias = &w.row_bias[g * ROWS..(g + G) * ROWS];
        assert_eq!(x.len(), T * w.stride(), "T tokens of stride codes");
        // SAFETY: `cpu` proves the instruction sets; `words` holds the G groups' `stride · ROWS`
        // codes each and `bias` their `ROWS` constants each, `x` T tokens of `stride` codes
        // (checked above, and by the slicing).
        unsafe { cpu.body::<G, T>(words.as_ptr(), bias.as_ptr(), x.as_ptr(), w.stride(), out) }
    }

    // ANCHOR: int8_tile
    /// `out[g][t][r]` = the exact sum of row `ROWS·g + r` of the `G` groups at `w` times token
    /// `t` of `x`, when every code lies in `-127..=127` (else the sums may be wrong, never
    /// unsafe).
    ///
    /// # Safety
    /// The CPU must support AVX2 and what `D` uses; `w` must point to `G · stride · ROWS` codes
    /// (the groups, one after the other), `bias` to the groups' `G · ROWS` constants (read only
    /// when `D` multiplies biased activations), `x` to `T · stride` codes; `stride` is a
    /// multiple of 4.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn body<D: ByteDot, const G: usize, const T: usize>(
        w: *const i8,
        bias: *const i32,
        x: *const i8,
        stride: usize,
        out: &mut [[[i32; ROWS]; T]; G],
    ) {
        let mut acc = [[_mm256_setzero_si256(); T]; G]; // [G, T, 8 rows] i32
        for k in 0..stride / 4 {
            // SAFETY: word k of each group lies in its `stride · ROWS` codes (caller).
            let w_k: [__m256i; G] = std::array::from_fn(|g| unsafe {
                load32(w.add(g * stride * ROWS + 32 * k).cast())
            });
            // The AVX2 form multiplies |w| (unsigned) by x · sign(w).
            let abs: [__m256i; G] = std::array::from_fn(|g| _mm256_sign_epi8(w_k[g], w_k[g]));
            for t in 0..T {
                // SAFETY: codes 4k..4k + 4 of token t lie in `x` (caller).
                let x4 = unsafe { (x.add(t * stride + 4 * k) as *const i32).read_unaligned() };
                let x_b = _mm256_set1_epi32(x4);
                // The VNNI form multiplies x + 128 (unsigned: the sign bit flipped) by w.
                let x_u = _mm256_xor_si256(x_b, _mm256_set1_epi8(i8::MIN));
                for ((acc, w), abs) in acc.iter_mut().zip(w_k).zip(abs) {
                    // SAFETY: `D`'s instructions are present (caller). With |w|, |x| ≤ 127 a
                    // pair of `maddubs` products stays below 32768; `vpdpbusd` adds in i32 and
                    // never saturates, so x + 128 ≤ 255 is exact there.
                    acc[t] = unsafe {
                        if D::BIASED_SIGNED {
                            D::dot(acc[t], x_u, w)
                        } else {
                            D::dot(acc[t], abs, _mm256_sign_epi8(x_b, w))
                        }
                    };
                }
            }
        }
        for g in 0..G {
            let row_bias = if D::BIASED_SIGNED {
                // SAFETY: the group's ROWS constants lie in `bias` (caller).
                unsafe { _mm256_loadu_si256(bias.add(g * ROWS) as *const __m256i) }
            } else {
                _mm256_setzero_si256()
            };
            for t in 0..T {
                let sums = _mm256_sub_epi32(acc[g][t], row_bias); // wraps, as the sums did
                // SAFETY: `out[g][t]` is 8 writable i32.
                unsafe { _mm256_storeu_si256(out[g][t].as_mut_ptr() as *mut __m256i, sums) };
            }
        }
    }
    // ANCHOR_END: int8_tile
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `out` [rows, tokens] as i64 sums, the reference.
    fn naive(codes: &[i8], rows: usize, cols: usize, x: &[i8], tokens: usize) -> Vec<i64> {
        let mut out = vec![0i64; rows * tokens];
        for r in 0..rows {
            for t in 0..tokens {
                out[r * tokens + t] = (0..cols)
                    .map(|i| i64::from(codes[r * cols + i]) * i64::from(x[t * cols + i]))
                    .sum();
            }
        }
        out
    }

    /// The tiles' sums over all groups, with `x` `[tokens, cols]` padded to the stride.
    fn tiled(cpu: Int8Cpu, w: &Int8Rows, x: &[i8], tokens: usize) -> Vec<i64> {
        let (cols, stride) = (w.cols(), w.stride());
        let mut padded = vec![0i8; tokens * stride];
        for t in 0..tokens {
            padded[t * stride..t * stride + cols].copy_from_slice(&x[t * cols..(t + 1) * cols]);
        }
        let mut out = vec![0i32; w.groups() * ROWS * tokens];
        int8_products(cpu, w, 0..w.groups(), &padded, &mut out);
        out[..w.rows() * tokens]
            .iter()
            .map(|&s| i64::from(s))
            .collect()
    }

    /// Both forms this CPU has, or none.
    fn cpus() -> Vec<Int8Cpu> {
        match Int8Cpu::detect(Isa::detect()) {
            Some(cpu) if cpu.avx2() != cpu => vec![cpu, cpu.avx2()],
            Some(cpu) => vec![cpu],
            None => {
                eprintln!("skipped: no int8 tiles on this CPU");
                vec![]
            }
        }
    }

    fn codes(len: usize, seed: u64) -> Vec<i8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state % 255) as i32 - 127) as i8
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Random shapes (rows and columns that are not multiples of 8 or 4, one token or
        /// several, tokens left over from the tiles): the tiles' sums equal the naive ones.
        #[test]
        fn tiles_equal_naive(rows in 1usize..40, cols in 1usize..90, tokens in 1usize..11, seed: u64) {
            let w = codes(rows * cols, seed);
            let x = codes(tokens * cols, seed ^ 0x5eed);
            let packed = Int8Rows::pack(&w, rows, cols).unwrap();
            prop_assert_eq!(packed.unpack(), w.clone());
            let want = naive(&w, rows, cols, &x, tokens);
            for cpu in cpus() {
                prop_assert_eq!(tiled(cpu, &packed, &x, tokens), want.clone(), "{:?}", cpu);
            }
        }
    }

    /// Codes of ±127 in every sign pattern, the largest products either form makes: no pair
    /// saturates `maddubs`, and the biased form's wrapping sums come back exact, in rows as
    /// long as W8A8 takes (`⌊(2³¹ − 1) / 127²⌋` codes), where `128 · Σ w` alone overflows an
    /// i32 and the sum itself just fits.
    #[test]
    fn extreme_codes_are_exact() {
        let (rows, cols, tokens) = (9, (i32::MAX as usize) / (127 * 127), 3);
        let patterns: [fn(usize) -> i8; 3] =
            [|_| 127, |_| -127, |i| if i % 2 == 0 { 127 } else { -127 }];
        for w_of in patterns {
            let w: Vec<i8> = (0..rows * cols).map(w_of).collect();
            let packed = Int8Rows::pack(&w, rows, cols).unwrap();
            for x_of in patterns {
                let x: Vec<i8> = (0..tokens * cols).map(x_of).collect();
                let want = naive(&w, rows, cols, &x, tokens);
                for cpu in cpus() {
                    assert_eq!(tiled(cpu, &packed, &x, tokens), want, "{cpu:?}");
                }
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_multiply() {
        assert_eq!(
            Int8Rows::pack(&[1, -128, 3], 1, 3).unwrap_err(),
            Int8RowsError::Code(1)
        );
        assert!(matches!(
            Int8Rows::pack(&[1, 2, 3], 2, 2),
            Err(Int8RowsError::Shape { .. })
        ));
        assert!(matches!(
            Int8Rows::pack(&[], usize::MAX, 2),
            Err(Int8RowsError::Shape { .. })
        ));
        let empty = Int8Rows::pack(&[], 0, 5).unwrap();
        assert_eq!((empty.groups(), empty.unpack()), (0, vec![]));
    }
}
