//! The kernels' inner loops with AVX2 + FMA intrinsics: 8 f32 lanes per register, one fused
//! multiply-add per lane per instruction.
//!
//! The kernels are safe functions: each takes an [`Avx2Fma`] proof that the CPU has both
//! instruction sets (only run-time detection makes one) and checks the lengths its pointer
//! arithmetic relies on, then calls its `unsafe` body compiled with those features.

use std::arch::x86_64::*;

use super::ahead::Requests;
use super::{Avx2Fma, MR, NR, WeightElement};

/// 16 f32 weights as two 8-lane vectors.
///
/// # Safety
/// `p` must point to 16 readable f32; the CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn load16_f32(p: *const f32) -> (__m256, __m256) {
    // SAFETY: the caller guarantees AVX2 and 16 readable f32 at `p` (two unaligned 8-wide loads).
    unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
}

/// 16 bf16 weights widened to f32: interleaving a zero below each 16-bit value puts it in the
/// high half of a 32-bit lane, which is the f32 with the same bits (exact). The interleave
/// works within 128-bit halves, so the vectors hold stored elements 0-3, 8-11 and 4-7, 12-15;
/// the packing stores outputs in that order (`u16::slot`), so they come out as outputs 0-7, 8-15.
///
/// # Safety
/// `p` must point to 16 readable u16; the CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn load16_bf16(p: *const u16) -> (__m256, __m256) {
    // SAFETY: the caller guarantees AVX2 and 16 readable u16 (32 bytes, one unaligned load) at `p`.
    unsafe {
        let bits = _mm256_loadu_si256(p as *const __m256i); // 16 × u16
        let zero = _mm256_setzero_si256();
        (
            _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits)),
        )
    }
}

/// `out[j] = Σ_k x[k] · panel[k][j]`, four `k` at a time into independent accumulators so that
/// the fused multiply-adds do not wait on each other. `panel`: [in][NR], `x`: [in].
///
/// Panics unless `panel.len() == x.len() * NR`.
pub fn panel_matvec<W: WeightElement>(_cpu: Avx2Fma, panel: &[W], x: &[f32], out: &mut [f32; NR]) {
    assert_eq!(panel.len(), x.len() * NR, "panel is [in][NR]");
    // SAFETY: `_cpu` proves the CPU has AVX2 and FMA, and the lengths were checked above.
    unsafe { panel_matvec_avx2(panel, x, out) }
}

/// [`panel_matvec`]'s body.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `panel.len() == x.len() * NR`.
#[target_feature(enable = "avx2,fma")]
unsafe fn panel_matvec_avx2<W: WeightElement>(panel: &[W], x: &[f32], out: &mut [f32; NR]) {
    const UNROLL: usize = 4;
    let ask = super::AskAhead::<W>::new::<UNROLL>();
    let p = panel.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 2 * UNROLL];
    let main = x.len() / UNROLL * UNROLL;
    // SAFETY: the caller guarantees AVX2 and FMA. Every `k` read is below `x.len()` (`main` is at
    // most `x.len()`), so `panel[k * NR..][..NR]` is inside `panel` (`x.len() * NR` elements);
    // `out` holds NR = 16 f32, the two 8-wide stores.
    unsafe {
        for k in (0..main).step_by(UNROLL) {
            for u in 0..UNROLL {
                // Ask for the weights `ahead` features on now, so that the memory system has
                // more reads in flight than the loads alone keep.
                ask.ask(p, k, u);
                let x_k = _mm256_set1_ps(*x.get_unchecked(k + u));
                let (w_lo, w_hi) = W::load16(p.add((k + u) * NR));
                acc[2 * u] = _mm256_fmadd_ps(w_lo, x_k, acc[2 * u]);
                acc[2 * u + 1] = _mm256_fmadd_ps(w_hi, x_k, acc[2 * u + 1]);
            }
        }
        for (k, &x_k) in x.iter().enumerate().skip(main) {
            let x_k = _mm256_set1_ps(x_k);
            let (w_lo, w_hi) = W::load16(p.add(k * NR));
            acc[0] = _mm256_fmadd_ps(w_lo, x_k, acc[0]);
            acc[1] = _mm256_fmadd_ps(w_hi, x_k, acc[1]);
        }
        let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[4], acc[6]));
        let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[3]), _mm256_add_ps(acc[5], acc[7]));
        _mm256_storeu_ps(out.as_mut_ptr(), lo);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), hi);
    }
}

/// [`panel_matvec`] for `T` tokens at once: `out[t][j] = Σ_k x[t][k] · panel[k][j]`, each weight
/// load serving every token, and each token's sums in [`panel_matvec`]'s order (the same four
/// `k` at a time into eight accumulators, added up the same way), so that every row equals
/// that token's [`panel_matvec`] bit for bit. `panel`: [in][NR], `x`: [T, in] row-major.
///
/// Panics unless `x.len() == T * in` where `panel.len() == in * NR`.
pub fn panel_matvec_tokens<W: WeightElement, const T: usize>(
    _cpu: Avx2Fma,
    panel: &[W],
    x: &[f32],
    out: &mut [[f32; NR]; T],
) {
    super::check_tokens_shapes(panel.len(), x.len(), T);
    // SAFETY: `_cpu` proves the CPU has AVX2 and FMA, and the lengths were checked above.
    unsafe { panel_matvec_tokens_avx2::<W, T>(panel, x, out) }
}

/// [`panel_matvec_tokens`]'s body.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `x.len() * NR == T * panel.len()`.
#[target_feature(enable = "avx2,fma")]
unsafe fn panel_matvec_tokens_avx2<W: WeightElement, const T: usize>(
    panel: &[W],
    x: &[f32],
    out: &mut [[f32; NR]; T],
) {
    const UNROLL: usize = 4;
    let k_len = panel.len() / NR;
    let ask = super::AskAhead::<W>::new::<UNROLL>();
    let (p, x) = (panel.as_ptr(), x.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2 * UNROLL]; T];
    let main = k_len / UNROLL * UNROLL;
    // SAFETY: the caller guarantees AVX2 and FMA. Every `k` read is below `k_len`, so
    // `panel[k * NR..][..NR]` is inside `panel` and `x[t * k_len + k]` inside `x` (`T * k_len`
    // elements) for t < T; each `out[t]` holds NR = 16 f32, the two 8-wide stores.
    unsafe {
        for k in (0..main).step_by(UNROLL) {
            for u in 0..UNROLL {
                ask.ask(p, k, u);
                let (w_lo, w_hi) = W::load16(p.add((k + u) * NR));
                for (t, acc) in acc.iter_mut().enumerate() {
                    let x_k = _mm256_set1_ps(*x.add(t * k_len + k + u));
                    acc[2 * u] = _mm256_fmadd_ps(w_lo, x_k, acc[2 * u]);
                    acc[2 * u + 1] = _mm256_fmadd_ps(w_hi, x_k, acc[2 * u + 1]);
                }
            }
        }
        for k in main..k_len {
            let (w_lo, w_hi) = W::load16(p.add(k * NR));
            for (t, acc) in acc.iter_mut().enumerate() {
                let x_k = _mm256_set1_ps(*x.add(t * k_len + k));
                acc[0] = _mm256_fmadd_ps(w_lo, x_k, acc[0]);
                acc[1] = _mm256_fmadd_ps(w_hi, x_k, acc[1]);
            }
        }
        for (acc, out) in acc.iter().zip(out.iter_mut()) {
            let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[4], acc[6]));
            let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[3]), _mm256_add_ps(acc[5], acc[7]));
            _mm256_storeu_ps(out.as_mut_ptr(), lo);
            _mm256_storeu_ps(out.as_mut_ptr().add(8), hi);
        }
    }
}

// ANCHOR: micro_kernel
/// `c[r][j] = Σ_k x[r][k] · b[k][j]`: an M × 16 output tile (M ≤ 6) held in 2·M registers; per
/// `k`, two weight loads, M broadcasts (one from each token row) and 2·M fused multiply-adds.
/// `x`: [M, in] row-major (the tokens), `b`: [in][NR] (a weight panel), `c`: [MR][NR], of which
/// rows `0..M` are written.
///
/// Panics unless `b.len()` is a multiple of `NR` and `x.len() == M * b.len() / NR`; `M <= MR`
/// is checked at compile time.
///
/// Each step of `k` also takes its turn of `requests`, the next panels' rows asked for ahead
/// (`ahead.rs`).
pub fn tile_matmul<W: WeightElement, V, const M: usize>(
    _cpu: Avx2Fma,
    x: &[f32],
    b: &[W],
    requests: Requests<V>,
    c: &mut [f32; MR * NR],
) {
    const { assert!(M <= MR, "a tile holds at most MR tokens") };
    assert!(b.len().is_multiple_of(NR), "b is [in][NR]");
    assert_eq!(x.len(), M * (b.len() / NR), "x is [M, in]");
    // SAFETY: `_cpu` proves the CPU has AVX2 and FMA, and the lengths were checked above.
    unsafe { tile_matmul_avx2::<W, V, M>(x, b, requests, c) }
}

/// [`tile_matmul`]'s body.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `x.len() == M * b.len() / NR`, `M <= MR`.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_matmul_avx2<W: WeightElement, V, const M: usize>(
    x: &[f32],
    b: &[W],
    mut requests: Requests<V>,
    c: &mut [f32; MR * NR],
) {
    let k = b.len() / NR;
    let (x, b) = (x.as_ptr(), b.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    // SAFETY: the caller guarantees AVX2 and FMA. For kk < k, `b[kk * NR..][..NR]` is inside `b`
    // (`k * NR <= b.len()`); for r < M, `x[r * k + kk]` is inside `x` (`M * k` elements); and rows
    // r < M <= MR of `c` ([MR][NR]) take the two 8-wide stores.
    unsafe {
        for kk in 0..k {
            requests.step(); // the next panel's rows due at this step (see `ahead`)
            let (b_lo, b_hi) = W::load16(b.add(kk * NR));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let x_rk = _mm256_broadcast_ss(&*x.add(r * k + kk));
                acc_r[0] = _mm256_fmadd_ps(x_rk, b_lo, acc_r[0]);
                acc_r[1] = _mm256_fmadd_ps(x_rk, b_hi, acc_r[1]);
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            _mm256_storeu_ps(c.as_mut_ptr().add(r * NR), acc_r[0]);
            _mm256_storeu_ps(c.as_mut_ptr().add(r * NR + 8), acc_r[1]);
        }
    }
}
// ANCHOR_END: micro_kernel
