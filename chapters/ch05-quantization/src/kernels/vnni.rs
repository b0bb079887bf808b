//! The 32-element tiles on AVX-512 VNNI: `vpdpbusd` forms a block's 8 integer lanes in one
//! instruction where AVX2 takes two (`maddubs`, then `madd` by ones), and the EVEX encoding
//! gives the compiler 32 vector registers instead of 16, room for tiles of twice the
//! accumulators. The lanes are the same exact integers and the f32 steps after them are
//! [`super::avx2`]'s, so every output equals the AVX2 and portable kernels' bit for bit.

use std::arch::x86_64::*;

use super::Act32;
use super::avx2::{Avx2F16c, Block32, ByteDot, Tiles, rows32_in, tile32_body};
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

/// `vpdpbusd` on 256 bits: lane `k` accumulates `Σ u·s` over bytes `4k..4k + 4`, exactly what
/// [`super::avx2::Maddubs`] leaves there (it never saturates, so no bound is needed).
pub enum Dpbusd {}

impl ByteDot for Dpbusd {
    #[inline(always)]
    unsafe fn lanes(u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX-512 VNNI and VL.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s) }
    }
}

impl Tiles for Avx512Vnni {
    /// Decode takes 8 rows per activation load, prefill 4 rows × 4 tokens (16 accumulators and
    /// 8 unpacked weight registers: 32 registers hold them).
    fn rows<F: Block32>(self, rows: &[u8], acts: &[Act32], tokens: usize, yt: &mut [f32]) {
        rows32_in::<F, _, 8, 4, 4>(self, rows, acts, tokens, yt)
    }

    unsafe fn tile_body<F: Block32, const R: usize, const T: usize>(
        self,
        rows: *const u8,
        acts: *const Act32,
        n: usize,
        out: &mut [[f32; T]; R],
    ) {
        // SAFETY: `self` proves every instruction set `body` enables; the rest is the caller's.
        unsafe { body::<F, R, T>(rows, acts, n, out) }
    }
}

/// [`tile32_body`] with [`Dpbusd`], compiled for AVX-512 VNNI (inlined here, so that it gets
/// the 32 registers and `vpdpbusd` inline).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F, VL and VNNI; the pointers as
/// [`tile32_body`] requires.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn body<F: Block32, const R: usize, const T: usize>(
    rows: *const u8,
    acts: *const Act32,
    n: usize,
    out: &mut [[f32; T]; R],
) {
    // SAFETY: the caller's guarantees are `tile32_body`'s.
    unsafe { tile32_body::<F, Dpbusd, R, T>(rows, acts, n, out) }
}
