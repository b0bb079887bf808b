//! The prefill micro-kernel with AVX-512F: 16 f32 lanes per register, so one register holds the
//! 16 outputs of a panel row and a tile can be [`MR_512`] = 12 tokens tall (12 accumulators of
//! the 32 registers) where AVX2 needs two registers per row and stops at 6.
//!
//! Per input feature `k` it loads the panel's 16 weights once (widening bf16 with one
//! zero-extension and one shift) and does one fused multiply-add per token of the tile: each
//! output is the same chain `acc = fma(x[t][k], w[k][o], acc)` over `k` in order as in the
//! AVX2 kernel, so the two compute **the same bits** (tested with `==`).
//!
//! [`panel_matvec_tokens`], for steps of two to six tokens, is AVX2's several-token matvec with
//! one 16-lane register where that one needs two: the same bits as AVX2's, without its spills.

use std::arch::x86_64::*;

use super::ahead::Requests;
use super::{MATVEC_TOKENS_512, NR, WeightElement};

/// Token rows of the AVX-512 micro-kernel's output tile.
pub const MR_512: usize = 12;

/// Proof that the CPU running this process has AVX-512F (and AVX2 and FMA, which the other
/// kernels of a step use). Its field is private: only [`Avx512::detect`] makes one, after
/// run-time detection said so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512(());

impl Avx512 {
    /// A proof if this CPU has AVX-512F, AVX2 and FMA (checked now), else `None`.
    pub fn detect() -> Option<Avx512> {
        (is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma"))
        .then_some(Avx512(()))
    }

    /// [`Avx512::detect`], checked once per process.
    pub fn cached() -> Option<Avx512> {
        static AVX512: std::sync::OnceLock<Option<Avx512>> = std::sync::OnceLock::new();
        *AVX512.get_or_init(Avx512::detect)
    }
}

/// 16 f32 weights as one 16-lane vector.
///
/// # Safety
/// `p` must point to 16 readable f32; the CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn load16_f32(p: *const f32) -> __m512 {
    // SAFETY: the caller guarantees AVX-512F and 16 readable f32 (one unaligned load) at `p`.
    unsafe { _mm512_loadu_ps(p) }
}

/// 16 bf16 weights (their bits) widened to one 16-lane f32 vector: zero-extend each to 32 bits,
/// shift it into the top half. Lane `i` is stored element `i` (no permutation, unlike AVX2's).
///
/// # Safety
/// `p` must point to 16 readable u16; the CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn load16_bf16(p: *const u16) -> __m512 {
    // SAFETY: the caller guarantees AVX-512F and 16 readable u16 (32 bytes, one unaligned load).
    unsafe {
        let bits = _mm256_loadu_si256(p as *const __m256i); // 16 × u16
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))
    }
}

// ANCHOR: rows_ahead
/// Asks for row `row` of the panel that starts at `panel` ([k][NR]) into L1
/// ([`super::ROWS_AHEAD`]). Past the panel's last row it asks for whatever memory follows: a
/// prefetch is a hint that neither faults nor writes, at any address, and changes no result.
#[inline(always)]
fn ask_row_l1<W>(panel: *const W, row: usize) {
    let at = panel.wrapping_add(row * NR) as *const i8;
    // SAFETY: a prefetch reads nothing into the program and cannot fault (see above).
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at) };
}
// ANCHOR_END: rows_ahead

// ANCHOR: widen_panel
/// `out` [k][NR] = the panel `b` [k][NR] widened to f32 with its outputs in order: `out[kk · NR +
/// j]` is output `j`'s weight for input `kk`, `b[kk · NR + slot(j)]` widened exactly. The f32
/// micro-kernels then read it as an f32 panel and compute the same bits as on `b` (the same
/// values, multiplied in the same order). For bf16 this is one load, widening and permute per 16
/// weights, instead of one widening per tile that reads the panel.
///
/// Panics unless `b.len() == out.len()`, a multiple of `NR`.
pub fn widen_panel<W: WeightElement>(_cpu: Avx512, b: &[W], out: &mut [f32]) {
    assert!(
        b.len() == out.len() && b.len().is_multiple_of(NR),
        "b and out are [k][NR]"
    );
    // SAFETY: `_cpu` proves the CPU has AVX-512F, and the lengths were checked above.
    unsafe { widen_panel_avx512(b, out) }
}

/// [`widen_panel`]'s body.
///
/// # Safety
/// The CPU must support AVX-512F; `b.len() == out.len()`, a multiple of `NR`.
#[target_feature(enable = "avx512f")]
unsafe fn widen_panel_avx512<W: WeightElement>(b: &[W], out: &mut [f32]) {
    let order: [i32; NR] = std::array::from_fn(|j| W::slot(j) as i32);
    // SAFETY: the caller guarantees AVX-512F; `order` holds 16 i32 (one unaligned load), and for
    // kk < len / NR both `b[kk * NR..][..NR]` and `out[kk * NR..][..NR]` are inside their slices.
    unsafe {
        let order = _mm512_loadu_si512(order.as_ptr() as *const __m512i);
        for kk in 0..b.len() / NR {
            let stored = W::load16_512(b.as_ptr().add(kk * NR)); // lane i: stored element i
            let outputs = _mm512_permutexvar_ps(order, stored); // lane j: stored slot(j)
            _mm512_storeu_ps(out.as_mut_ptr().add(kk * NR), outputs);
        }
    }
}
// ANCHOR_END: widen_panel

// ANCHOR: micro_kernel_512
/// `c[r][j] = Σ_k x[r][k] · b[k][j]` for an M × 16 tile (M ≤ 12), one register per row.
/// `x`: [M, in] row-major (the tokens), `b`: [in][NR] (a weight panel), `c`: [MR_512][NR], of
/// which rows `0..M` are written.
///
/// Panics unless `b.len()` is a multiple of `NR` and `x.len() == M * b.len() / NR`; `M <= MR_512`
/// is checked at compile time.
///
/// Each step of `k` also takes its turn of `requests`, the next panels' rows asked for ahead
/// (`ahead.rs`), and, once per cache line, asks for its panel's row [`super::ROWS_AHEAD`] on,
/// into L1 (`ask_row_l1`).
pub fn tile_matmul<W: WeightElement, V, const M: usize>(
    _cpu: Avx512,
    x: &[f32],
    b: &[W],
    requests: Requests<V>,
    c: &mut [f32; MR_512 * NR],
) {
    const { assert!(M <= MR_512, "a tile holds at most MR_512 tokens") };
    assert!(b.len().is_multiple_of(NR), "b is [in][NR]");
    assert_eq!(x.len(), M * (b.len() / NR), "x is [M, in]");
    // SAFETY: `_cpu` proves the CPU has AVX-512F, and the lengths were checked above.
    unsafe { tile_matmul_avx512::<W, V, M>(x, b, requests, c) }
}

/// [`tile_matmul`]'s body.
///
/// # Safety
/// The CPU must support AVX-512F; `x.len() == M * b.len() / NR`, `M <= MR_512`.
#[target_feature(enable = "avx512f")]
unsafe fn tile_matmul_avx512<W: WeightElement, V, const M: usize>(
    x: &[f32],
    b: &[W],
    mut requests: Requests<V>,
    c: &mut [f32; MR_512 * NR],
) {
    let k = b.len() / NR;
    let ahead = super::rows_ahead();
    let (x, b) = (x.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); M];
    // SAFETY: the caller guarantees AVX-512F. For kk < k, `b[kk * NR..][..NR]` is inside `b` (`k * NR <= b.len()`); for r < M,
    // `x[r * k + kk]` is inside `x` (`M * k` elements).
    unsafe {
        for kk in 0..k {
            requests.step(); // the next panel's rows due at this step (see `ahead`)
            if ahead > 0 && kk.is_multiple_of(super::features_per_line::<W>()) {
                ask_row_l1(b, kk + ahead); // this panel's line `ahead` rows on, into L1
            }
            let w = W::load16_512(b.add(kk * NR));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let x_rk = _mm512_set1_ps(*x.add(r * k + kk));
                *acc_r = _mm512_fmadd_ps(x_rk, w, *acc_r);
            }
        }
    }
    // Lane i holds stored element i, which is output j where `slot(j) = i` (bf16's packing
    // permutes the outputs for the AVX2 load): put each back in its place.
    for (r, acc_r) in acc.iter().enumerate() {
        let mut lanes = [0.0f32; NR];
        // SAFETY: `lanes` holds 16 f32, one unaligned 16-wide store.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *acc_r) };
        for (j, c) in c[r * NR..][..NR].iter_mut().enumerate() {
            *c = lanes[W::slot(j)];
        }
    }
}
// ANCHOR_END: micro_kernel_512

// ANCHOR: matvec_tokens_512
/// `out[t][j] = Σ_k x[t][k] · panel[k][j]` for `T` tokens (a step of a few tokens), one
/// 16-lane register per token and unrolled step where AVX2 needs two: `T` ≤ [`MATVEC_TOKENS_512`]
/// tokens' 4·`T` accumulators, the four weight vectors and a broadcast fit the 32 registers.
/// Each token's sums run in `avx2::panel_matvec`'s order (four `k` at a time into four chains,
/// added up as `(c0 + c1) + (c2 + c3)`), lane by lane the same multiply-adds, so every row equals
/// that token's one-token product bit for bit. `panel`: [in][NR], `x`: [T, in] row-major.
///
/// Panics unless `x.len() == T * in` where `panel.len() == in * NR`; `T <= MATVEC_TOKENS_512`
/// is checked at compile time.
pub fn panel_matvec_tokens<W: WeightElement, const T: usize>(
    _cpu: Avx512,
    panel: &[W],
    x: &[f32],
    out: &mut [[f32; NR]; T],
) {
    const { assert!(T <= MATVEC_TOKENS_512, "at most MATVEC_TOKENS_512 tokens") };
    super::check_tokens_shapes(panel.len(), x.len(), T);
    // SAFETY: `_cpu` proves the CPU has AVX-512F, and the lengths were checked above.
    unsafe { panel_matvec_tokens_avx512::<W, T>(panel, x, out) }
}

/// [`panel_matvec_tokens`]'s body.
///
/// # Safety
/// The CPU must support AVX-512F; `x.len() * NR == T * panel.len()`.
#[target_feature(enable = "avx512f")]
unsafe fn panel_matvec_tokens_avx512<W: WeightElement, const T: usize>(
    panel: &[W],
    x: &[f32],
    out: &mut [[f32; NR]; T],
) {
    const UNROLL: usize = 4;
    let k_len = panel.len() / NR;
    let ask = super::AskAhead::<W>::new::<UNROLL>();
    let (p, x) = (panel.as_ptr(), x.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); UNROLL]; T];
    let main = k_len / UNROLL * UNROLL;
    // SAFETY: the caller guarantees AVX-512F. Every `k` read is below `k_len`, so
    // `panel[k * NR..][..NR]` is inside `panel` and `x[t * k_len + k]` inside `x` (`T * k_len`
    // elements) for t < T.
    unsafe {
        for k in (0..main).step_by(UNROLL) {
            for u in 0..UNROLL {
                ask.ask(p, k, u);
                let w = W::load16_512(p.add((k + u) * NR)); // lane i: stored element i
                for (t, acc) in acc.iter_mut().enumerate() {
                    let x_k = _mm512_set1_ps(*x.add(t * k_len + k + u));
                    acc[u] = _mm512_fmadd_ps(w, x_k, acc[u]);
                }
            }
        }
        for k in main..k_len {
            let w = W::load16_512(p.add(k * NR));
            for (t, acc) in acc.iter_mut().enumerate() {
                let x_k = _mm512_set1_ps(*x.add(t * k_len + k));
                acc[0] = _mm512_fmadd_ps(w, x_k, acc[0]);
            }
        }
    }
    for (acc, out) in acc.iter().zip(out.iter_mut()) {
        let mut lanes = [0.0f32; NR];
        // SAFETY: the caller guarantees AVX-512F; `lanes` holds 16 f32, one unaligned store.
        unsafe {
            let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            _mm512_storeu_ps(lanes.as_mut_ptr(), sum);
        }
        // Lane i holds stored element i, output j where `slot(j) = i` (as in `tile_matmul`).
        for (j, out) in out.iter_mut().enumerate() {
            *out = lanes[W::slot(j)];
        }
    }
}
// ANCHOR_END: matvec_tokens_512

// ANCHOR: micro_kernel_512_pair
/// Two adjacent weight panels at once: an M × 32 tile (M ≤ 12), two registers per token row, 24
/// accumulators. Per input feature `k` it loads 32 weights and broadcasts each token's `x[r][k]`
/// once for **two** fused multiply-adds, where [`tile_matmul`] spends one broadcast per
/// multiply-add: the loads per multiply-add fall from 13/12 to 14/24, which is what bounds the
/// single-panel kernel. Each output is the same chain over `k` as there: the same bits.
/// `x`: [M, in], `b0`, `b1`: [in][NR] (panels p and p + 1), `c`: [MR_512][2 · NR] (row r: panel
/// p's 16 outputs, then panel p + 1's), of which rows `0..M` are written.
///
/// Panics unless both panels have the same length, a multiple of `NR`, and `x.len() == M *
/// b0.len() / NR`.
///
/// Each step of `k` also takes its turn of `requests`, the next pair's rows asked for ahead
/// (`ahead.rs`), and, once per cache line, asks for each panel's row [`super::ROWS_AHEAD`] on,
/// into L1 (`ask_row_l1`).
pub fn tile_matmul_pair<W: WeightElement, V, const M: usize>(
    _cpu: Avx512,
    x: &[f32],
    b0: &[W],
    b1: &[W],
    requests: Requests<V>,
    c: &mut [f32; MR_512 * 2 * NR],
) {
    const { assert!(M <= MR_512, "a tile holds at most MR_512 tokens") };
    assert!(
        b0.len().is_multiple_of(NR) && b0.len() == b1.len(),
        "b0, b1 are [in][NR]"
    );
    assert_eq!(x.len(), M * (b0.len() / NR), "x is [M, in]");
    // SAFETY: `_cpu` proves the CPU has AVX-512F, and the lengths were checked above.
    unsafe { tile_matmul_pair_avx512::<W, V, M>(x, b0, b1, requests, c) }
}

/// [`tile_matmul_pair`]'s body.
///
/// # Safety
/// The CPU must support AVX-512F; `b0.len() == b1.len()`, `x.len() == M * b0.len() / NR`,
/// `M <= MR_512`.
#[target_feature(enable = "avx512f")]
unsafe fn tile_matmul_pair_avx512<W: WeightElement, V, const M: usize>(
    x: &[f32],
    b0: &[W],
    b1: &[W],
    mut requests: Requests<V>,
    c: &mut [f32; MR_512 * 2 * NR],
) {
    let k = b0.len() / NR;
    let ahead = super::rows_ahead();
    let (x, b0, b1) = (x.as_ptr(), b0.as_ptr(), b1.as_ptr());
    let mut acc0 = [_mm512_setzero_ps(); M];
    let mut acc1 = [_mm512_setzero_ps(); M];
    // SAFETY: the caller guarantees AVX-512F. For kk < k, `b0[kk * NR..][..NR]` and the same
    // range of `b1` are inside them (`k * NR` elements each); for r < M, `x[r * k + kk]` is
    // inside `x` (`M * k` elements).
    unsafe {
        for kk in 0..k {
            requests.step(); // the next panels' rows due at this step (see `ahead`)
            if ahead > 0 && kk.is_multiple_of(super::features_per_line::<W>()) {
                ask_row_l1(b0, kk + ahead); // this pair's line `ahead` rows on, into L1
                ask_row_l1(b1, kk + ahead);
            }
            let w0 = W::load16_512(b0.add(kk * NR));
            let w1 = W::load16_512(b1.add(kk * NR));
            for r in 0..M {
                let x_rk = _mm512_set1_ps(*x.add(r * k + kk));
                acc0[r] = _mm512_fmadd_ps(x_rk, w0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(x_rk, w1, acc1[r]);
            }
        }
    }
    for r in 0..M {
        for (half, acc) in [acc0[r], acc1[r]].into_iter().enumerate() {
            let mut lanes = [0.0f32; NR];
            // SAFETY: `lanes` holds 16 f32, one unaligned 16-wide store.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
            let out = &mut c[(2 * r + half) * NR..][..NR];
            for (j, c) in out.iter_mut().enumerate() {
                *c = lanes[W::slot(j)];
            }
        }
    }
}
// ANCHOR_END: micro_kernel_512_pair

// ANCHOR: pair_stretch
/// A pair's accumulators between stretches of `k` ([`tile_matmul_pair_stretch`]): register
/// `2r` holds token row r's 16 lanes of panel p, `2r + 1` those of panel p + 1, lane i the
/// output stored at slot i (as the registers of [`tile_matmul_pair`] before its last store).
pub type PairLanes = [[f32; NR]; 2 * MR_512];

/// [`tile_matmul_pair`] over one stretch of the input features: `acc` (rows `0..M`) += the
/// products of the stretch, `x` holding token row r's features of the stretch at `r ·
/// x_stride..`, `b0`, `b1` the two panels' rows of the stretch ([steps][NR] each). Started from
/// zeros and run over consecutive stretches that cover `k`, it computes every output as the
/// same chain of multiply-adds as [`tile_matmul_pair`] over all of `k`: the same bits
/// ([`pair_lanes_to_tile`] puts them in their places).
///
/// Panics unless both panels have the same length, a multiple of `NR`, `x_stride` is at least
/// their steps and `x` holds `M` rows of them at that stride.
///
/// Its loop repeats [`tile_matmul_pair`]'s on purpose: written as one stretch of this kernel
/// from zeros, the whole-tile kernel ran about 3% slower across `kiln bench ch02 --only gemm`'s
/// products (three runs of each binary, alternating, Intel Xeon, 2026-12-06).
pub fn tile_matmul_pair_stretch<W: WeightElement, const M: usize>(
    _cpu: Avx512,
    x: &[f32],
    x_stride: usize,
    (b0, b1): (&[W], &[W]),
    acc: &mut PairLanes,
) {
    const { assert!(M >= 1 && M <= MR_512, "a tile holds 1 to MR_512 tokens") };
    assert!(
        b0.len().is_multiple_of(NR) && b0.len() == b1.len(),
        "b0, b1 are [steps][NR]"
    );
    let steps = b0.len() / NR;
    let x_needed = (M - 1)
        .checked_mul(x_stride)
        .and_then(|n| n.checked_add(steps));
    assert!(
        steps <= x_stride && x_needed.is_some_and(|n| n <= x.len()),
        "x holds M rows of the stretch"
    );
    // SAFETY: `_cpu` proves the CPU has AVX-512F, and the lengths were checked above.
    unsafe { tile_matmul_pair_stretch_avx512::<W, M>(x, x_stride, b0, b1, acc) }
}

/// [`tile_matmul_pair_stretch`]'s body.
///
/// # Safety
/// The CPU must support AVX-512F; `b0.len() == b1.len()`, a multiple of `NR`, of `steps` rows;
/// `x.len() >= (M - 1) * x_stride + steps`, `M <= MR_512`.
#[target_feature(enable = "avx512f")]
unsafe fn tile_matmul_pair_stretch_avx512<W: WeightElement, const M: usize>(
    x: &[f32],
    x_stride: usize,
    b0: &[W],
    b1: &[W],
    lanes: &mut PairLanes,
) {
    let steps = b0.len() / NR;
    let ahead = super::rows_ahead();
    let (x, b0, b1) = (x.as_ptr(), b0.as_ptr(), b1.as_ptr());
    let mut acc0 = [_mm512_setzero_ps(); M];
    let mut acc1 = [_mm512_setzero_ps(); M];
    // SAFETY: the caller guarantees AVX-512F. `lanes` rows 0..2M hold 16 f32 each (2M <= 24);
    // for kk < steps, `b0[kk * NR..][..NR]` and the same of `b1` are inside them; for r < M,
    // `x[r * x_stride + kk]` is inside `x` ((M - 1) * x_stride + steps elements).
    unsafe {
        for r in 0..M {
            acc0[r] = _mm512_loadu_ps(lanes[2 * r].as_ptr());
            acc1[r] = _mm512_loadu_ps(lanes[2 * r + 1].as_ptr());
        }
        for kk in 0..steps {
            if ahead > 0 && kk.is_multiple_of(super::features_per_line::<W>()) {
                ask_row_l1(b0, kk + ahead); // this pair's line `ahead` rows on, into L1
                ask_row_l1(b1, kk + ahead);
            }
            let w0 = W::load16_512(b0.add(kk * NR));
            let w1 = W::load16_512(b1.add(kk * NR));
            for r in 0..M {
                let x_rk = _mm512_set1_ps(*x.add(r * x_stride + kk));
                acc0[r] = _mm512_fmadd_ps(x_rk, w0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(x_rk, w1, acc1[r]);
            }
        }
        for r in 0..M {
            _mm512_storeu_ps(lanes[2 * r].as_mut_ptr(), acc0[r]);
            _mm512_storeu_ps(lanes[2 * r + 1].as_mut_ptr(), acc1[r]);
        }
    }
}
// ANCHOR_END: pair_stretch

/// Rows `0..m` of `c` [MR_512][2 · NR] (row r: panel p's 16 outputs, then panel p + 1's) from
/// the accumulators `lanes`, each output put back in its place from its stored slot.
pub fn pair_lanes_to_tile<W: WeightElement>(
    lanes: &PairLanes,
    m: usize,
    c: &mut [f32; MR_512 * 2 * NR],
) {
    for (lanes, out) in lanes.iter().zip(c.chunks_exact_mut(NR)).take(2 * m) {
        for (j, c) in out.iter_mut().enumerate() {
            *c = lanes[W::slot(j)];
        }
    }
}
