//! The 32-element tiles on AVX-512 VNNI: `vpdpbusd` adds 4 byte products per i32 lane in one
//! instruction where AVX2 takes three (`maddubs`, `madd` by ones, an add), and the EVEX encoding
//! gives the compiler 32 vector registers instead of 16, room for larger tiles. The integers
//! are the same exact sums and the f32 steps after them are [`super::tiles`]'s, so every output
//! equals the AVX2 and portable kernels' bit for bit.

use std::arch::x86_64::*;

use super::avx2::Avx2F16c;
use super::interleave::ROWS;
use super::ktiles::{KBlock, k_body, k_rows_of};
use super::tiles::{ByteDot, Packed, Tiles, rows_in, tile_body};
use super::{Act32, Act256, Outs};
use crate::format::GgmlType;
use ch02::kernels::Isa;

/// Proof that this CPU has what [`Avx2F16c`] proves and AVX-512 F, VL and VNNI. Safe code gets
/// one only from [`Avx512Vnni::detect`], after run-time detection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512Vnni(Avx2F16c);

impl Avx512Vnni {
    /// `Some` if `isa` is AVX2 + FMA and this CPU also has F16C and AVX-512 F, VL and VNNI
    /// (checked now, at run time).
    pub fn detect(isa: Isa) -> Option<Avx512Vnni> {
        let cpu = Avx2F16c::detect(isa)?;
        (is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni"))
        .then_some(Avx512Vnni(cpu))
    }

    /// The AVX2 proof this one includes (for the kernels that have no VNNI form: the K-quants).
    pub fn avx2_f16c(self) -> Avx2F16c {
        self.0
    }
}

/// `vpdpbusd` on 256 bits: lane `k` accumulates `Σ u·s` over bytes `4k..4k + 4` into `acc`,
/// exactly what [`super::tiles::Maddubs`] adds there (it never saturates, so no bound is needed).
pub enum Dpbusd {}

impl ByteDot for Dpbusd {
    /// `vpdpbusd` adds its four products in 32 bits: `w + 128` (up to 255) is exact.
    const BIASED_SIGNED: bool = true;

    #[inline(always)]
    unsafe fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX-512 VNNI and VL.
        unsafe { _mm256_dpbusd_epi32(acc, u, s) }
    }
}

impl Tiles for Avx512Vnni {
    /// Decode takes 4 groups (32 rows) per activation load, prefill 2 groups × 4 tokens (16
    /// unpacked weight registers and 8 accumulators: 32 registers hold them).
    fn rows<F: Packed>(self, packed: &[u8], acts: &[Act32], tokens: usize, outs: &mut Outs<'_>) {
        rows_in::<F, _, 4, 2, 4>(self, packed, acts, tokens, outs)
    }

    unsafe fn tile_body<F: Packed, const G: usize, const T: usize>(
        self,
        packed: *const u8,
        group_bytes: usize,
        acts: *const Act32,
        n: usize,
        out: &mut [[[f32; ROWS]; T]; G],
    ) {
        // SAFETY: `self` proves every instruction set `body` enables; the rest is the caller's.
        unsafe { body::<F, G, T>(packed, group_bytes, acts, n, out) }
    }

    /// Four tokens per tile for several.
    fn rows_k(
        self,
        ty: GgmlType,
        packed: &[u8],
        acts: &[Act256],
        tokens: usize,
        outs: &mut Outs<'_>,
    ) {
        k_rows_of::<_, 4>(self, ty, packed, acts, tokens, outs)
    }

    unsafe fn k_body<F: KBlock, const T: usize>(
        self,
        packed: *const u8,
        acts: *const Act256,
        n: usize,
        out: &mut [[f32; ROWS]; T],
    ) {
        // SAFETY: `self` proves every instruction set `body_k` enables; the rest is the caller's.
        unsafe { body_k::<F, T>(packed, acts, n, out) }
    }
}

/// [`k_body`] with [`Dpbusd`], compiled for AVX-512 VNNI.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F, VL and VNNI; the pointers as
/// [`k_body`] requires.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn body_k<F: KBlock, const T: usize>(
    packed: *const u8,
    acts: *const Act256,
    n: usize,
    out: &mut [[f32; ROWS]; T],
) {
    // SAFETY: the caller's guarantees are `k_body`'s.
    unsafe { k_body::<F, Dpbusd, T>(packed, acts, n, out) }
}

/// [`tile_body`] with [`Dpbusd`], compiled for AVX-512 VNNI (inlined here, so that it gets
/// the 32 registers and `vpdpbusd` inline).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F, VL and VNNI; the pointers as
/// [`tile_body`] requires.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn body<F: Packed, const G: usize, const T: usize>(
    packed: *const u8,
    group_bytes: usize,
    acts: *const Act32,
    n: usize,
    out: &mut [[[f32; ROWS]; T]; G],
) {
    // SAFETY: the caller's guarantees are `tile_body`'s.
    unsafe { tile_body::<F, Dpbusd, G, T>(packed, group_bytes, acts, n, out) }
}
