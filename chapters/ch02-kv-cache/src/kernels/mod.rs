//! Fast CPU kernels for `y = x Wᵀ`, written by us: the work every projection does.
//!
//! Weights live in one **packed** layout that serves both phases (see [`PackedWeight`]): the
//! output rows are grouped into panels of [`NR`] = 16, and inside a panel the 16 weights of one
//! input feature `k` are adjacent. So both kernels stream a panel once, front to back:
//!
//! - **decode** ([`matvec`], one token, memory-bound): `y[panel] += x[k] · W[panel][k]` for every
//!   `k`, a broadcast and two 8-wide fused multiply-adds per 16 weights. Its speed is the speed at
//!   which the weights can be read, so panels are split across threads (rayon) and bf16 weights,
//!   half the bytes, are widened to f32 in registers (exact: `f32::from_bits((bits as u32) << 16)`).
//! - **prefill** ([`matmul`], many tokens, compute-bound): a register-blocked micro-kernel keeps an
//!   [`MR`] × [`NR`] = 6 × 16 tile of outputs in 12 vector registers and, for every `k`, loads 16
//!   weights once and uses each for 6 tokens, broadcast from the token rows of `x` where they lie
//!   (six sequential streams, nothing packed). A last tile of fewer tokens runs a kernel compiled
//!   for its height. Threads split the panels, so every weight is read from memory once per call,
//!   and each tile is written straight into its place in `y`. In a product of
//!   `AHEAD_FROM_TILES` to `AHEAD_UP_TO_TILES` tiles whose panels are read as stored (not
//!   widened), each tile also asks for its share of the task's next panels while it multiplies
//!   (`ahead.rs`), so that they come from L2 in their turn; the AVX-512 kernels also ask for
//!   their present panels' rows [`ROWS_AHEAD`] features ahead, into L1. On the two-panel
//!   kernel, a product of two or three tiles (13 to 36 tokens, a batch of decodes) goes through
//!   each pair of panels in stretches of [`STRETCH_ROWS`] features instead, every tile in turn
//!   over a stretch (`pair_in_stretches`): the stretch comes from memory once and stays in L1
//!   for the others.
//!
//! Two instruction sets implement the same loops: [`Isa::Avx2Fma`] with explicit intrinsics on
//! x86-64 CPUs that have them (checked at run time, and only the check can make that variant),
//! and [`Isa::Portable`], plain Rust that any target compiles. Tests compare both with a naive
//! product. On a CPU with AVX-512F the prefill micro-kernel has two more forms ([`Gemm`]): a
//! register holds 16 lanes, so a tile is 12 tokens tall and each weight loaded serves twice as
//! many tokens; and, the one `matmul` runs, two adjacent panels at once, so each token value
//! broadcast serves two multiply-adds. Both compute the same bits as the AVX2 one. Steps of two
//! to six tokens run a 16-lane several-token matvec there, two or three tokens AVX2's.

mod ahead;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod packed;
mod portable;
pub mod vector;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
pub use avx512::{Avx512, MR_512};
pub use packed::{FILL_FEATURES, NR, PackedWeight, WeightElement};

/// Token rows of the prefill micro-kernel's output tile (portable and AVX2).
pub const MR: usize = 6;

/// The most token rows of any micro-kernel's tile: the size of [`matmul`]'s tile buffer.
#[cfg(target_arch = "x86_64")]
const MAX_MR: usize = MR_512;
#[cfg(not(target_arch = "x86_64"))]
const MAX_MR: usize = MR;

/// Which implementation of the inner loops runs.
///
/// Invariant: an `Isa` names only instruction sets this CPU has. `Portable` runs anywhere; the
/// `Avx2Fma` variant carries an [`Avx2Fma`] proof, which safe code can only get from
/// [`Isa::avx2_fma`] (or [`Isa::detect`]) after run-time detection, so the kernels may use AVX2
/// and FMA instructions whenever they are handed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust: correct everywhere, vectorised only as far as the compiler manages.
    Portable,
    /// x86-64 AVX2 and FMA intrinsics: 8 f32 lanes, fused multiply-add.
    #[cfg(target_arch = "x86_64")]
    Avx2Fma(Avx2Fma),
}

/// Proof that the CPU running this process has AVX2 and FMA. Its field is private, so the only
/// way to get one is [`Isa::avx2_fma`], which makes it after `is_x86_feature_detected!` said so;
/// copies of a proof stay true because a process does not change CPU features.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx2Fma(());

impl Isa {
    /// The fastest implementation this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if let Some(isa) = Isa::avx2_fma() {
            return isa;
        }
        Isa::Portable
    }

    /// [`Isa::Avx2Fma`] if this CPU has AVX2 and FMA (checked now, at run time), else `None`.
    #[cfg(target_arch = "x86_64")]
    pub fn avx2_fma() -> Option<Isa> {
        (is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
            .then_some(Isa::Avx2Fma(Avx2Fma(())))
    }

    /// Every implementation this CPU can run (what the tests compare).
    pub fn available() -> Vec<Isa> {
        let mut isas = vec![Isa::Portable];
        if Isa::detect() != Isa::Portable {
            isas.push(Isa::detect());
        }
        isas
    }
}

/// Which prefill micro-kernel [`matmul_with`] runs: one per instruction set, each proof-carrying
/// like [`Isa`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gemm {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma(Avx2Fma),
    /// 12 × 16 tiles in 16-lane registers.
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx512),
    /// 12 × 32 tiles: two adjacent panels at once (`avx512::tile_matmul_pair`), the last odd
    /// panel of a task alone.
    #[cfg(target_arch = "x86_64")]
    Avx512Pair(Avx512),
}

impl Gemm {
    /// The fastest micro-kernel for `isa`: AVX-512's where the CPU has it and `isa` is AVX2's
    /// (so a caller that asked for the portable code gets it).
    pub fn fastest(isa: Isa) -> Gemm {
        match isa {
            Isa::Portable => Gemm::Portable,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma(cpu) => match Avx512::cached() {
                Some(wide) => Gemm::Avx512Pair(wide),
                None => Gemm::Avx2Fma(cpu),
            },
        }
    }

    /// Every micro-kernel this CPU can run (what the tests compare).
    pub fn available() -> Vec<Gemm> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut kernels = vec![Gemm::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(Isa::Avx2Fma(cpu)) = Isa::avx2_fma() {
                kernels.push(Gemm::Avx2Fma(cpu));
            }
            if let Some(wide) = Avx512::detect() {
                kernels.push(Gemm::Avx512(wide));
                kernels.push(Gemm::Avx512Pair(wide));
            }
        }
        kernels
    }

    /// Whether it computes two adjacent panels at once ([`avx512::tile_matmul_pair`]).
    fn pairs_panels(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Gemm::Avx512Pair(_) = self {
            return true;
        }
        false
    }

    /// Its name in tables: instruction set and tile.
    pub fn name(self) -> &'static str {
        match self {
            Gemm::Portable => "portable 6×16",
            #[cfg(target_arch = "x86_64")]
            Gemm::Avx2Fma(_) => "AVX2 6×16",
            #[cfg(target_arch = "x86_64")]
            Gemm::Avx512(_) => "AVX-512 12×16",
            #[cfg(target_arch = "x86_64")]
            Gemm::Avx512Pair(_) => "AVX-512 12×32 (two panels)",
        }
    }

    /// Token rows of its tile.
    pub fn tile_rows(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Gemm::Avx512(_) | Gemm::Avx512Pair(_) => MR_512,
            _ => MR,
        }
    }
}

/// Panels one task handles: enough work to amortise the task, few enough to balance the cores.
fn panels_per_task(panels: usize) -> usize {
    panels
        .div_ceil(4 * rayon::current_num_threads())
        .clamp(1, 8)
}

/// Matrices of at most this many panels (2048 output rows) are split evenly, one task per
/// thread, in [`matvec`]: every projection of a SmolLM2 layer (12 to 96 panels).
pub const EVEN_SPLIT_PANELS: usize = 128;

/// Whether [`matvec`] splits small matrices evenly; see [`set_even_split`].
static EVEN_SPLIT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `false` makes [`matvec`] split every matrix into tasks of at most 8 panels, about four per
/// thread, as before small ones were split evenly, for the whole process; the results are the
/// same bits either way. For measuring the difference (`examples/matvec_split.rs`).
pub fn set_even_split(on: bool) {
    EVEN_SPLIT.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether small one-token products are split evenly ([`set_even_split`]); chapter 5's integer
/// products follow the same switch.
pub fn even_split() -> bool {
    EVEN_SPLIT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Panels one task of [`matvec`] handles (at least 1). A decode product is a stream of its
/// weights from memory, and on two threads a short one reads slower than its bytes say: in a
/// fast moment of this machine's memory, one call cost about 4 µs more than its bytes at the
/// rate of a large matrix, on one thread nothing (`examples/projection_sizes.rs`). Cut into
/// about four tasks per thread, a layer's projection is several short runs per thread; one task
/// per thread makes it one contiguous run each: whole bf16 decodes 4% faster on two threads
/// (`examples/matvec_split.rs`), 3% to 8% in fast moments and 1% in a slow one (a temporary
/// switch in `examples/decode_profile.rs`; AMD EPYC, 2026-12-05). A large matrix (a model's
/// head) keeps the many tasks, which let a thread that falls behind be helped.
fn matvec_panels_per_task(panels: usize) -> usize {
    if panels <= EVEN_SPLIT_PANELS && even_split() {
        panels.div_ceil(rayon::current_num_threads()).max(1)
    } else {
        panels_per_task(panels)
    }
}

/// One token: `y[o] = Σ_k W[o, k] · x[k]` for every output row, panels split across threads.
/// `x`: `[in]`, `y`: `[out]`.
// ANCHOR: matvec
pub fn matvec<W: WeightElement>(isa: Isa, w: &PackedWeight<W>, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.in_features(), "x is [in]");
    assert_eq!(y.len(), w.out_features(), "y is [out]");
    let per_task = matvec_panels_per_task(w.num_panels());
    y.par_chunks_mut(per_task * NR)
        .enumerate()
        .for_each(|(task, y_chunk)| {
            let first_panel = task * per_task;
            for (i, y_panel) in y_chunk.chunks_mut(NR).enumerate() {
                let panel = w.panel(first_panel + i); // [in][NR]
                let mut out = [0.0f32; NR];
                match isa {
                    Isa::Portable => portable::panel_matvec(panel, x, &mut out),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2Fma(cpu) => avx2::panel_matvec(cpu, panel, x, &mut out),
                }
                y_panel.copy_from_slice(&out[..y_panel.len()]); // the last panel may be partial
            }
        });
}
// ANCHOR_END: matvec

/// Many tokens: `y[t, o] = Σ_k x[t, k] · W[o, k]`, i.e. `y = x Wᵀ`, on the fastest
/// micro-kernel for `isa` ([`Gemm::fastest`]).
/// `x`: [tokens, in], `y`: [tokens, out], both row-major.
pub fn matmul<W: WeightElement>(
    isa: Isa,
    w: &PackedWeight<W>,
    x: &[f32],
    y: &mut [f32],
    tokens: usize,
) {
    matmul_with(Gemm::fastest(isa), w, x, y, tokens);
}

/// [`matmul`] on the micro-kernel `gemm`.
pub fn matmul_with<W: WeightElement>(
    gemm: Gemm,
    w: &PackedWeight<W>,
    x: &[f32],
    y: &mut [f32],
    tokens: usize,
) {
    matmul_part(gemm, w, w.out_features(), w.in_features(), x, y, tokens);
}

/// Below this many multiply-adds a product runs on the calling thread: handing its tasks to
/// other threads costs microseconds, about what such a product takes (chapter 2's prefill
/// attention runs many of them, already one per task).
const SERIAL_MACS: usize = 1 << 20;

// ANCHOR: matmul
/// [`matmul_with`] on the top-left corner of `w`: outputs `0..outputs` over inputs `0..inputs`,
/// `y[t, o] = Σ_{k < inputs} x[t, k] · W[o, k]`. `x`: [tokens, inputs], `y`: [tokens, outputs].
/// Each output is the same chain of multiply-adds as [`matmul_with`]'s, cut after `inputs`
/// terms (causal attention: a block of queries sees only a prefix of the positions).
pub fn matmul_part<W: WeightElement>(
    gemm: Gemm,
    w: &PackedWeight<W>,
    outputs: usize,
    inputs: usize,
    x: &[f32],
    y: &mut [f32],
    tokens: usize,
) {
    let (k, n) = (inputs, outputs);
    assert!(
        n <= w.out_features() && k <= w.in_features(),
        "a corner of w"
    );
    assert_eq!(x.len(), tokens * k, "x is [tokens, in]");
    assert_eq!(y.len(), tokens * n, "y is [tokens, out]");
    if tokens == 0 || n == 0 {
        return; // nothing to compute (an engine step whose sequences all want no logits)
    }
    let mr = gemm.tile_rows();
    let tiles = tokens.div_ceil(mr);
    let out = SharedOut::new(y);
    let num_panels = n.div_ceil(NR);
    let mut per_task = panels_per_task(num_panels);
    if gemm.pairs_panels() {
        per_task = per_task.next_multiple_of(2); // whole pairs, but for the very last panel
    }
    let tasks = num_panels.div_ceil(per_task);
    let widen = W::WIDENS_ON_LOAD
        && tiles >= WIDEN_FROM_TILES
        && PANEL_WIDENING.load(std::sync::atomic::Ordering::Relaxed);
    // The pairs of a product of a few tiles go through their features in stretches, every tile
    // in turn ([`pair_in_stretches`]); they ask for nothing ahead but their rows.
    #[cfg(target_arch = "x86_64")]
    let in_stretches = match gemm {
        Gemm::Avx512Pair(cpu) if !widen && stretches(tiles) => Some(cpu),
        _ => None,
    };
    #[cfg(target_arch = "x86_64")]
    let stretched = in_stretches.is_some();
    #[cfg(not(target_arch = "x86_64"))]
    let stretched = false;
    let asks_ahead = !widen
        && !stretched
        && (AHEAD_FROM_TILES..=AHEAD_UP_TO_TILES).contains(&tiles)
        && PANELS_AHEAD.load(std::sync::atomic::Ordering::Relaxed);
    // Panel p's first k inputs: [k][NR].
    let panel = |p: usize| &w.panel(p)[..k * NR];
    let task = |task: usize| {
        let panels = task * per_task..((task + 1) * per_task).min(num_panels);
        // One or two weight panels at a time, so they stay in cache while every token tile
        // uses them.
        let mut p = panels.start;
        while p < panels.end {
            let width = if gemm.pairs_panels() && p + 1 < panels.end {
                2
            } else {
                1
            };
            let at = OutputColumns {
                cols: p * NR..((p + width) * NR).min(n), // the last panel may be partial
                row_len: n,
            };
            let pair = (panel(p), (width == 2).then(|| panel(p + 1)));
            // Columns `at.cols` belong to panels p..p + width, which only this task computes
            // (the tasks' panel ranges are disjoint), once: the safety of the calls below.
            #[cfg(target_arch = "x86_64")]
            if let (Some(cpu), Some(b1)) = (in_stretches, pair.1) {
                // SAFETY: see above.
                unsafe { pair_in_stretches(cpu, x, tokens, (pair.0, b1), &out, &at) };
                p += width;
                continue;
            }
            // Widening panels as they come from memory would stall on the loads; so the first
            // tile reads them as stored, its multiply-adds overlapping the loads, and the other
            // tiles read the widened copy of what it left in the cache.
            let stored = 0..if widen { mr } else { tokens };
            // The task's next `width` panels, asked for while these are multiplied ([`ahead`]).
            let ahead_to = (p + 2 * width).min(panels.end);
            let next = [p + width, p + width + 1].map(|q| match q < ahead_to && asks_ahead {
                true => panel(q),
                false => &[][..],
            });
            let ahead = ahead::Ahead { next, tiles };
            // SAFETY: see above.
            unsafe { tile_products(gemm, x, stored.clone(), pair, &ahead, &out, &at) };
            let rest = stored.end..tokens;
            if !rest.is_empty() && widen_panels(gemm, pair) {
                WIDE_PANELS.with_borrow(|wide| {
                    let b0 = &wide[..k * NR];
                    let b1 = pair.1.map(|_| &wide[k * NR..][..k * NR]);
                    // SAFETY: see above.
                    unsafe { tile_products(gemm, x, rest, (b0, b1), &ahead, &out, &at) }
                })
            } else if !rest.is_empty() {
                // SAFETY: see above.
                unsafe { tile_products(gemm, x, rest, pair, &ahead, &out, &at) }
            }
            p += width;
        }
    };
    if tokens * n * k < SERIAL_MACS {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}
// ANCHOR_END: matmul

/// How far ahead of their loads the decode kernels (`panel_matvec` and the several-token
/// matvecs, AVX2 and AVX-512) prefetch, in bytes of the panel (so in
/// features, half as many for f32 as for bf16): 4 KiB. One thread alone must keep enough reads
/// in flight to cover the memory's latency, and a distance counted in features left bf16 short:
/// at 32 features (2 KiB of f32, 1 KiB of bf16) one thread read bf16 weights at 26 GB/s and f32
/// at 30; at 4 KiB, at 31 and 32 (`examples/prefetch_distance.rs`, AMD EPYC).
///
/// Into which cache (`AskAhead::ask`): on an Intel Xeon (2 threads, 2026-12-06, three runs of
/// the same example) bf16 weights read at 29.1 to 33.9 GB/s asked for into L2 once per cache line,
/// at 19.1 to 22.5 asked for into L1 at every feature; f32 2% to 3% more slowly into L2 (three
/// runs of a scratch build), so f32 keeps L1.
pub const PREFETCH_BYTES: usize = 4096;

/// [`PREFETCH_BYTES`], unless [`set_prefetch_distance`] changed it.
static PREFETCH_DISTANCE: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(PREFETCH_BYTES);

/// Makes the decode kernels prefetch `bytes` ahead (rounded down to whole features; at most
/// 1 MiB), for the whole process; the results are the same bits at any distance. For measuring
/// the distance (`examples/prefetch_distance.rs`).
pub fn set_prefetch_distance(bytes: usize) {
    PREFETCH_DISTANCE.store(bytes.min(1 << 20), std::sync::atomic::Ordering::Relaxed);
}

/// The distance [`set_prefetch_distance`] last set, [`PREFETCH_BYTES`] if none.
#[cfg(target_arch = "x86_64")]
fn prefetch_distance() -> usize {
    PREFETCH_DISTANCE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether the decode kernels prefetch bf16 weights into L1 at every input feature, as they
/// first did; see [`set_prefetch_l1`].
static PREFETCH_L1: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `true` makes the decode kernels (`panel_matvec` and the several-token matvecs) prefetch bf16
/// weights into L1 once per input feature, as they first did, instead of into L2 once per cache
/// line, for the whole process (f32 weights go to L1 either way); the results are the same bits
/// either way. For measuring the difference (`examples/prefetch_distance.rs`).
pub fn set_prefetch_l1(on: bool) {
    PREFETCH_L1.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// [`set_prefetch_l1`]'s setting; the decode kernels read it once per panel.
#[cfg(target_arch = "x86_64")]
fn prefetch_l1() -> bool {
    PREFETCH_L1.load(std::sync::atomic::Ordering::Relaxed)
}

/// Input features of a panel that fill one cache line: 1 of f32 (16 × 4 bytes), 2 of bf16.
#[cfg(target_arch = "x86_64")]
const fn features_per_line<W>() -> usize {
    let features = vector::CACHE_LINE / size_of::<[W; NR]>();
    if features == 0 { 1 } else { features }
}

/// How a decode kernel asks for a panel's weights ahead of its loads, read once per panel: the
/// distance in features ([`set_prefetch_distance`]) and [`set_prefetch_l1`]'s setting.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy)]
struct AskAhead<W> {
    ahead: usize,
    l1: bool,
    /// The distance is counted in features of `W`, and [`AskAhead::ask`] takes panels of `W`.
    element: std::marker::PhantomData<W>,
}

#[cfg(target_arch = "x86_64")]
impl<W> AskAhead<W> {
    /// The settings now, for a kernel whose `k` loop steps by `UNROLL` features: a multiple of
    /// [`features_per_line`] (checked when the kernel is compiled), which [`AskAhead::ask`]
    /// relies on.
    #[inline(always)]
    fn new<const UNROLL: usize>() -> AskAhead<W> {
        const {
            assert!(
                UNROLL.is_multiple_of(features_per_line::<W>()),
                "whole lines"
            )
        };
        AskAhead {
            ahead: prefetch_distance() / size_of::<[W; NR]>(),
            l1: prefetch_l1(),
            element: std::marker::PhantomData,
        }
    }

    /// The request made at feature `k + u` of the loop (`p` the panel's start, `k` a multiple
    /// of the unroll), for feature `k + u + ahead`. f32 (a line per feature): into L1. bf16 (two
    /// features a line): into L2 where `u` is a multiple of [`features_per_line`], so requests
    /// fall a line (64 bytes) apart and each line ahead is asked for once, however the panel is
    /// aligned; or, under [`set_prefetch_l1`], into L1 at every feature as f32.
    ///
    /// Why the two differ is measured, not derived ([`PREFETCH_BYTES`]): on two threads bf16
    /// read 50% to 62% faster asked for into L2 once a line than into L1 at every feature, f32
    /// 2% to 3% slower into L2.
    #[inline(always)]
    fn ask(self, p: *const W, k: usize, u: usize) {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        let per_line = features_per_line::<W>();
        debug_assert!(k.is_multiple_of(per_line), "k starts a line's features");
        // A hint only (`wrapping_add`: past the panel's end the address is never dereferenced).
        let at = p.wrapping_add((k + u + self.ahead) * NR) as *const i8;
        // SAFETY: a prefetch neither faults nor writes, whatever the address.
        unsafe {
            if self.l1 || per_line == 1 {
                _mm_prefetch::<_MM_HINT_T0>(at);
            } else if u.is_multiple_of(per_line) {
                _mm_prefetch::<_MM_HINT_T1>(at);
            }
        }
    }
}

/// The fewest token tiles for which [`matmul_part`] widens bf16 panels once per call instead of
/// at every load. Measured on SmolLM2's projections (`examples/bf16_widening.rs`, AMD EPYC with
/// AVX-512): a loss at 2 tiles, about even at 3 and 4, a gain from 6 on.
const WIDEN_FROM_TILES: usize = 4;

/// Whether [`matmul_part`] widens bf16 panels once per call; see [`set_panel_widening`].
static PANEL_WIDENING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `false` makes every prefill product widen bf16 weights at each load, as before panels were
/// widened once per call, for the whole process; the results are the same bits either way. For
/// measuring the difference (`examples/bf16_widening.rs`).
pub fn set_panel_widening(on: bool) {
    PANEL_WIDENING.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Products of at most this many token tiles ask for their next panels ahead (`ahead.rs`), but
/// for the pairs that go in stretches ([`pair_in_stretches`], 2 and 3 tiles): 132
/// tokens on AVX-512's tiles of 12, 66 on AVX2's tiles of 6 (measured on AVX-512 only), and
/// only where the panels are read as stored (not widened once per call). With more tiles a
/// pair's first tile is a small part of its time, and the requests only compete with the token
/// rows for L2. On SmolLM2's projections (`examples/panels_ahead.rs`, Intel Xeon, three runs
/// with a limit of 16 tiles), with the rows of the present panels asked for too
/// ([`ROWS_AHEAD`]), they gained 0.3% to 3.8% in f32 from 24 to 128 tokens in all rows but one
/// (−0.3%) and lost 2% to 5% at 192; in bf16 they lost 1.5% to 3.6% from 64 to 192 tokens,
/// where its panels are widened once per call.
const AHEAD_UP_TO_TILES: usize = 11;

/// Products of fewer token tiles than this ask for none of their next panels: with the present
/// panels' rows asked for, a one-tile product (12 tokens) lost 1.7% to 5.4% in f32 with the
/// next panels' requests, in each of four runs of `examples/panels_ahead.rs` (Intel Xeon; in
/// bf16 it gained in two and lost in two).
const AHEAD_FROM_TILES: usize = 2;

/// Whether [`matmul_part`]'s tiles ask for the next panels ([`ahead`]); see
/// [`set_panels_ahead`].
static PANELS_AHEAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `false` makes the prefill products ask for none of their next panels, as before they did,
/// for the whole process (the rows of the present ones are still asked for: see
/// [`set_rows_ahead`]); the results are the same bits either way. For measuring the difference
/// (`examples/panels_ahead.rs`).
pub fn set_panels_ahead(on: bool) {
    PANELS_AHEAD.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// How many rows (input features) ahead of its loads an AVX-512 micro-kernel asks for the rows
/// of the panels it is multiplying into L1 (1 KiB ahead in an f32 panel). Every tile but a
/// pair's first finds its panels in L2, not L1 (a pair of f32 panels of 576 features is 72 KiB,
/// L1 48 KiB), and the hardware's prefetchers bring two streams of one line per feature from L2
/// less quickly than the 24 multiply-adds of a feature use them. On SmolLM2's projections
/// (`examples/panels_ahead.rs`, Intel Xeon with AVX-512, 24 to 512 tokens), runs alternating
/// none with 8, 16 and 32 rows ahead found f32 1% to 7% faster at each distance and bf16 up to
/// 6.5% faster (up to 2.5% slower at 24 or 32 tokens in one run); 16 and 24 rows ran alike. A
/// kernel asks once per cache line: at every row of f32, every other row of bf16 (two rows to a
/// line).
pub const ROWS_AHEAD: usize = 16;

/// Whether the AVX-512 micro-kernels ask for their panels' rows ahead; see [`set_rows_ahead`].
static ROWS_AHEAD_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `false` makes the AVX-512 micro-kernels ask for nothing ahead in the panels they multiply
/// ([`ROWS_AHEAD`]), as before they did, for the whole process; the results are the same bits
/// either way. For measuring the difference (`examples/panels_ahead.rs`).
pub fn set_rows_ahead(on: bool) {
    ROWS_AHEAD_ON.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// [`ROWS_AHEAD`], or 0 if [`set_rows_ahead`] switched the requests off.
#[cfg(target_arch = "x86_64")]
fn rows_ahead() -> usize {
    match ROWS_AHEAD_ON.load(std::sync::atomic::Ordering::Relaxed) {
        true => ROWS_AHEAD,
        false => 0,
    }
}

std::thread_local! {
    /// This thread's widened panels ([`widen_panels`]): `[2][k][NR]` f32, regrown only by a
    /// longer panel, so a thread allocates it once per panel length it meets, not per product.
    static WIDE_PANELS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Widens the panels `b0` and, if given, `b1` ([k][NR] each) to f32 into this thread's
/// [`WIDE_PANELS`] (`b0` first, then `b1`), if `gemm` has a kernel for it; returns whether it did
/// (if not, the micro-kernels read them as stored).
fn widen_panels<W: WeightElement>(gemm: Gemm, (b0, b1): (&[W], Option<&[W]>)) -> bool {
    #[cfg(target_arch = "x86_64")]
    if let Gemm::Avx512(cpu) | Gemm::Avx512Pair(cpu) = gemm {
        WIDE_PANELS.with_borrow_mut(|wide| {
            let len = b0.len();
            if wide.len() < 2 * len {
                wide.resize(2 * len, 0.0);
            }
            avx512::widen_panel(cpu, b0, &mut wide[..len]);
            if let Some(b1) = b1 {
                avx512::widen_panel(cpu, b1, &mut wide[len..2 * len]);
            }
        });
        return true;
    }
    let _ = (gemm, b0, b1);
    false
}

/// Where a tile's outputs go in `y` [tokens, row_len]: columns `cols` of every row.
struct OutputColumns {
    cols: std::ops::Range<usize>,
    row_len: usize,
}

// ANCHOR: tile_products
/// The token rows `tokens` of `x` [_, k], a tile at a time, against the panel `b0` [k][NR], or
/// the adjacent panels `b0`, `b1` on a kernel that pairs them, written into columns `at.cols`
/// of the same rows of `out`; each tile asks for its share of `ahead`'s panels.
///
/// # Safety
/// No other live reference may touch columns `at.cols` of `out`'s rows while this runs.
unsafe fn tile_products<W: WeightElement, V>(
    gemm: Gemm,
    x: &[f32],
    tokens: std::ops::Range<usize>,
    (b0, b1): (&[W], Option<&[W]>),
    ahead: &ahead::Ahead<V>,
    out: &SharedOut,
    at: &OutputColumns,
) {
    let (mr, k) = (gemm.tile_rows(), b0.len() / NR);
    let width = if b1.is_some() { 2 } else { 1 };
    let mut c = [0.0f32; MAX_MR * 2 * NR]; // [mr][width · NR] one tile's outputs
    for start in tokens.clone().step_by(mr) {
        let rows = start..(start + mr).min(tokens.end); // the last tile may be partial
        let x_tile = &x[rows.start * k..rows.end * k]; // [rows, k]
        let requests = ahead.share(start / mr, k); // tiles start at multiples of `mr`
        match b1 {
            Some(b1) => tile_matmul_pair(gemm, rows.len(), x_tile, b0, b1, requests, &mut c),
            None => {
                let single = (&mut c[..MAX_MR * NR]).try_into().expect("a prefix");
                tile_matmul(gemm, rows.len(), x_tile, b0, requests, single);
            }
        }
        // SAFETY: the caller's guarantee.
        unsafe { write_tile(&c, width, rows, out, at) };
    }
}
// ANCHOR_END: tile_products

/// Writes the tile `c` [_][width · NR] of token rows `rows` into columns `at.cols` of those rows
/// of `out`.
///
/// # Safety
/// No other live reference may touch columns `at.cols` of `out`'s rows `rows` while this runs.
unsafe fn write_tile(
    c: &[f32],
    width: usize,
    rows: std::ops::Range<usize>,
    out: &SharedOut,
    at: &OutputColumns,
) {
    for (r, c_row) in rows.zip(c.chunks_exact(width * NR)) {
        // SAFETY: elements `r * row_len + cols` are in row r and columns `at.cols`, which the
        // caller guarantees nothing else touches meanwhile.
        let y_row = unsafe { out.slice(r * at.row_len + at.cols.start, at.cols.len()) };
        y_row.copy_from_slice(&c_row[..at.cols.len()]);
    }
}

/// Products of `STRETCH_FROM_TILES` to `STRETCH_UP_TO_TILES` AVX-512 tiles (13 to 36 tokens)
/// take each pair of panels in stretches of [`STRETCH_ROWS`] input features
/// ([`pair_in_stretches`]), whose panels they read as stored. On SmolLM2's projections
/// (`examples/panels_ahead.rs`, Intel Xeon, two runs) that gained 0.4% to 14% in f32 and 3.5%
/// to 10% in bf16 from 16 to 36 tokens; four tiles (48 tokens) lost 3% to 4% in f32.
#[cfg(target_arch = "x86_64")]
const STRETCH_FROM_TILES: usize = 2;
#[cfg(target_arch = "x86_64")]
const STRETCH_UP_TO_TILES: usize = 3;

/// Input features of a stretch: 8 KiB of a pair of f32 panels, which stays in L1 while every
/// tile of the product multiplies it (128 did no better).
pub const STRETCH_ROWS: usize = 64;

/// Whether products of a few tiles go through their pairs in stretches; see
/// [`set_stretches`].
static STRETCHES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `false` makes every product multiply each pair of panels one whole tile after another, as
/// before products of a few tiles went through them in stretches, for the whole process; the
/// results are the same bits either way. For measuring the difference
/// (`examples/panels_ahead.rs`).
pub fn set_stretches(on: bool) {
    STRETCHES.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a product of `tiles` AVX-512 tiles goes through its pairs in stretches.
#[cfg(target_arch = "x86_64")]
fn stretches(tiles: usize) -> bool {
    (STRETCH_FROM_TILES..=STRETCH_UP_TO_TILES).contains(&tiles)
        && STRETCHES.load(std::sync::atomic::Ordering::Relaxed)
}

// ANCHOR: pair_in_stretches
/// The token rows `0..tokens` of `x` [tokens, k] (at most `STRETCH_UP_TO_TILES` tiles) against
/// the adjacent panels `b0`, `b1` [k][NR], written into columns `at.cols` of `out`: a stretch of
/// the features at a time, every tile in turn over it, so that the stretch of the panels comes
/// from memory once, while the first tile multiplies it, and from L1 for the others. Each output
/// is the same chain of multiply-adds as one tile's whole pass: the same bits.
///
/// # Safety
/// No other live reference may touch columns `at.cols` of `out`'s rows while this runs.
#[cfg(target_arch = "x86_64")]
unsafe fn pair_in_stretches<W: WeightElement>(
    cpu: Avx512,
    x: &[f32],
    tokens: usize,
    (b0, b1): (&[W], &[W]),
    out: &SharedOut,
    at: &OutputColumns,
) {
    let k = b0.len() / NR;
    let tiles = tokens.div_ceil(MR_512);
    assert!(tiles <= STRETCH_UP_TO_TILES, "a product of a few tiles");
    let mut lanes = [[[0.0f32; NR]; 2 * MR_512]; STRETCH_UP_TO_TILES]; // [tile] its accumulators
    for k0 in (0..k).step_by(STRETCH_ROWS) {
        let steps = STRETCH_ROWS.min(k - k0);
        let panels = (
            &b0[k0 * NR..(k0 + steps) * NR],
            &b1[k0 * NR..(k0 + steps) * NR],
        );
        for (tile, lanes) in lanes[..tiles].iter_mut().enumerate() {
            let start = tile * MR_512;
            let m = MR_512.min(tokens - start);
            // Token rows start..start + m, features k0..k0 + steps of each.
            let x_rows = &x[start * k + k0..(start + m - 1) * k + k0 + steps];
            macro_rules! heights {
                ($($h:literal)+) => {
                    match m {
                        $($h => avx512::tile_matmul_pair_stretch::<W, $h>(cpu, x_rows, k, panels, lanes),)+
                        _ => unreachable!("a tile height the kernel has no variant for"),
                    }
                };
            }
            heights!(1 2 3 4 5 6 7 8 9 10 11 12)
        }
    }
    let mut c = [0.0f32; MR_512 * 2 * NR];
    for (tile, lanes) in lanes[..tiles].iter().enumerate() {
        let rows = tile * MR_512..(tile * MR_512 + MR_512).min(tokens);
        avx512::pair_lanes_to_tile::<W>(lanes, rows.len(), &mut c);
        // SAFETY: the caller's guarantee.
        unsafe { write_tile(&c, 2, rows, out, at) };
    }
}
// ANCHOR_END: pair_in_stretches

/// The output `y` of a [`matmul`], written by many tasks at once, each to its own elements.
/// It borrows `y` mutably for `'a`, so `y` outlives every task and nothing else touches it.
struct SharedOut<'a> {
    ptr: *mut f32,
    len: usize,
    _y: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: a `SharedOut` is a `&mut [f32]` split among tasks; [`SharedOut::slice`] checks every
// range is inside the buffer, and its callers guarantee that no two live ranges overlap, so
// sharing it across threads is sharing disjoint `&mut [f32]`, which is `Send` and `Sync`.
unsafe impl Send for SharedOut<'_> {}
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    fn new(y: &'a mut [f32]) -> Self {
        SharedOut {
            ptr: y.as_mut_ptr(),
            len: y.len(),
            _y: std::marker::PhantomData,
        }
    }

    /// Elements `at..at + len` (panics if they are not all inside the buffer).
    ///
    /// # Safety
    /// No other live reference may touch `at..at + len` while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [f32] {
        assert!(
            at <= self.len && len <= self.len - at,
            "slice outside the output"
        );
        // SAFETY: the range is inside the buffer `y` borrowed for 'a (checked above), and the
        // caller guarantees it is not aliased.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len) }
    }
}

/// The micro-kernel for an `m`-token tile (`1 <= m <= gemm.tile_rows()`): `x_tile` [m, k],
/// `b` [k][NR] → rows `0..m` of `c` [MAX_MR][NR]. One compiled kernel per tile height, so that
/// the accumulators stay in registers and a partial last tile does no work for missing tokens.
fn tile_matmul<W: WeightElement, V>(
    gemm: Gemm,
    m: usize,
    x_tile: &[f32],
    b: &[W],
    requests: ahead::Requests<V>,
    c: &mut [f32; MAX_MR * NR],
) {
    macro_rules! with_height {
        ($c:expr, $module:ident: $($h:literal)+) => {
            match m {
                $($h => $module::tile_matmul::<W, V, $h>(x_tile, b, requests, $c),)+
                _ => unreachable!("a tile height the kernel has no variant for"),
            }
        };
        ($c:expr, $module:ident($cpu:ident): $($h:literal)+) => {
            match m {
                $($h => $module::tile_matmul::<W, V, $h>($cpu, x_tile, b, requests, $c),)+
                _ => unreachable!("a tile height the kernel has no variant for"),
            }
        };
    }
    let short: &mut [f32; MR * NR] = (&mut c[..MR * NR]).try_into().expect("MR <= MAX_MR");
    match gemm {
        Gemm::Portable => with_height!(short, portable: 1 2 3 4 5 6),
        #[cfg(target_arch = "x86_64")]
        Gemm::Avx2Fma(cpu) => with_height!(short, avx2(cpu): 1 2 3 4 5 6),
        #[cfg(target_arch = "x86_64")]
        Gemm::Avx512(cpu) | Gemm::Avx512Pair(cpu) => {
            with_height!(c, avx512(cpu): 1 2 3 4 5 6 7 8 9 10 11 12)
        }
    }
}

/// [`tile_matmul`] over two adjacent panels `b0`, `b1` ([k][NR] each) into `c` [MAX_MR][2 · NR],
/// for a kernel that [pairs panels](Gemm::pairs_panels).
fn tile_matmul_pair<W: WeightElement, V>(
    gemm: Gemm,
    m: usize,
    x_tile: &[f32],
    b0: &[W],
    b1: &[W],
    requests: ahead::Requests<V>,
    c: &mut [f32; MAX_MR * 2 * NR],
) {
    match gemm {
        #[cfg(target_arch = "x86_64")]
        Gemm::Avx512Pair(cpu) => {
            macro_rules! heights {
                ($($h:literal)+) => {
                    match m {
                        $($h => avx512::tile_matmul_pair::<W, V, $h>(cpu, x_tile, b0, b1, requests, c),)+
                        _ => unreachable!("a tile height the kernel has no variant for"),
                    }
                };
            }
            heights!(1 2 3 4 5 6 7 8 9 10 11 12)
        }
        _ => {
            let _ = (m, x_tile, b0, b1, requests, c);
            unreachable!("only Gemm::Avx512Pair pairs panels")
        }
    }
}

/// `y = x Wᵀ` for any number of tokens, choosing the kernel: [`matvec`] for one, [`matmul`] for
/// more. `x`: [tokens, in], `y`: [tokens, out].
pub fn linear<W: WeightElement>(
    isa: Isa,
    w: &PackedWeight<W>,
    x: &[f32],
    y: &mut [f32],
    tokens: usize,
) {
    if tokens == 1 {
        matvec(isa, w, x, y);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Isa::Avx2Fma(cpu) = isa
        && TOKENS_MATVEC.load(std::sync::atomic::Ordering::Relaxed)
    {
        let avx512 = Avx512::cached()
            .filter(|_| TOKENS_MATVEC_512.load(std::sync::atomic::Ordering::Relaxed));
        match (tokens, avx512) {
            (2, None) => return matvec_tokens::<W, 2>(w, x, y, avx2_tokens(cpu)),
            (3, None) => return matvec_tokens::<W, 3>(w, x, y, avx2_tokens(cpu)),
            (2, Some(wide)) => return matvec_tokens::<W, 2>(w, x, y, avx512_tokens(wide)),
            (3, Some(wide)) => return matvec_tokens::<W, 3>(w, x, y, avx512_tokens(wide)),
            (4, Some(wide)) => return matvec_tokens::<W, 4>(w, x, y, avx512_tokens(wide)),
            (5, Some(wide)) => return matvec_tokens::<W, 5>(w, x, y, avx512_tokens(wide)),
            (6, Some(wide)) => return matvec_tokens::<W, 6>(w, x, y, avx512_tokens(wide)),
            _ => {}
        }
    }
    matmul(isa, w, x, y, tokens);
}

/// Panics unless a panel of `panel` elements ([in][NR]) and an input of `x` elements fit
/// `tokens` tokens: `x` is [tokens, in]. What the several-token kernels' pointer arithmetic
/// relies on.
#[cfg(target_arch = "x86_64")]
fn check_tokens_shapes(panel: usize, x: usize, tokens: usize) {
    assert_eq!(x * NR, tokens * panel, "panel is [in][NR], x is [T, in]");
}

/// A panel of `T` tokens on AVX2 (`avx2::panel_matvec_tokens`).
#[cfg(target_arch = "x86_64")]
fn avx2_tokens<W: WeightElement, const T: usize>(
    cpu: Avx2Fma,
) -> impl Fn(&[W], &[f32], &mut [[f32; NR]; T]) + Sync {
    move |panel, x, out| avx2::panel_matvec_tokens::<W, T>(cpu, panel, x, out)
}

/// A panel of `T` tokens on AVX-512 (`avx512::panel_matvec_tokens`).
#[cfg(target_arch = "x86_64")]
fn avx512_tokens<W: WeightElement, const T: usize>(
    wide: Avx512,
) -> impl Fn(&[W], &[f32], &mut [[f32; NR]; T]) + Sync {
    move |panel, x, out| avx512::panel_matvec_tokens::<W, T>(wide, panel, x, out)
}

/// Products of up to this many tokens (and more than one) run `avx2::panel_matvec_tokens`
/// on AVX2 instead of the GEMM micro-kernel: a step of 2 or 3 tokens (speculative decoding's
/// checks, a batch at low concurrency) streams its weights as a decode does. Measured on passes
/// of 2 and 3 tokens through SmolLM2's projections (`examples/small_steps.rs`, AMD EPYC, 2
/// threads, 2026-12-05, two runs): 15% to 32% faster in seven of eight (bf16 and f32, 2 and 3
/// tokens), 8% slower once (f32, 3 tokens); at 4 tokens no faster (its accumulators no longer
/// fit the registers). On a CPU with AVX-512F, steps of up to [`MATVEC_TOKENS_512`] tokens
/// take `avx512::panel_matvec_tokens` instead.
pub const MATVEC_TOKENS: usize = 3;

/// The most tokens `avx512::panel_matvec_tokens` takes (24 accumulators), and [`linear`] runs
/// on it where the CPU has AVX-512F. Measured on passes through SmolLM2's projections from memory
/// (`examples/small_steps.rs`, Intel Xeon, 2 threads, 2026-12-05, two runs): the fastest way at
/// 2 to 4 tokens in bf16 and f32 and at 5 and 6 in bf16, by 1% to 37%; level with the GEMM
/// micro-kernel at 5 and 6 in f32 (within 3%).
pub const MATVEC_TOKENS_512: usize = 6;

/// Whether [`linear`] runs products of a few tokens through a several-token matvec (2 to
/// [`MATVEC_TOKENS`] tokens on AVX2, 2 to [`MATVEC_TOKENS_512`] on AVX-512); see
/// [`set_tokens_matvec`].
static TOKENS_MATVEC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `false` makes [`linear`] run every product of several tokens on the GEMM micro-kernel, as
/// before, for the whole process (neither several-token matvec). The rows differ in rounding
/// between the two (the GEMM sums each output's terms in one chain, the matvecs in four). For
/// measuring the difference (`examples/small_steps.rs`).
pub fn set_tokens_matvec(on: bool) {
    TOKENS_MATVEC.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`linear`] runs products of 2 to [`MATVEC_TOKENS_512`] tokens through
/// `avx512::panel_matvec_tokens` where the CPU has AVX-512F; see [`set_tokens_matvec_512`].
static TOKENS_MATVEC_512: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `false` makes [`linear`] keep to AVX2 for products of several tokens, as before, for the
/// whole process: 2 and 3 tokens on `avx2::panel_matvec_tokens` (the same bits as AVX-512's),
/// 4 to 6 on the GEMM micro-kernel. For measuring the difference (`examples/small_steps.rs`).
pub fn set_tokens_matvec_512(on: bool) {
    TOKENS_MATVEC_512.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// `y[t, o] = Σ_k x[t, k] · W[o, k]` for `T` tokens, each panel read once for all of them by
/// `panel_kernel` (a panel [in][NR], `x`, the panel's outputs of every token), the panels split
/// across threads as [`matvec`] splits them. With either kernel every row equals that token's
/// [`matvec`], bit for bit. `x`: [T, in], `y`: [T, out].
#[cfg(target_arch = "x86_64")]
fn matvec_tokens<W: WeightElement, const T: usize>(
    w: &PackedWeight<W>,
    x: &[f32],
    y: &mut [f32],
    panel_kernel: impl Fn(&[W], &[f32], &mut [[f32; NR]; T]) + Sync,
) {
    let (n, panels) = (w.out_features(), w.num_panels());
    assert_eq!(x.len(), T * w.in_features(), "x is [T, in]");
    assert_eq!(y.len(), T * n, "y is [T, out]");
    let per_task = matvec_panels_per_task(panels);
    let out = SharedOut::new(y);
    (0..panels.div_ceil(per_task))
        .into_par_iter()
        .for_each(|task| {
            for p in task * per_task..((task + 1) * per_task).min(panels) {
                let mut tile = [[0.0f32; NR]; T];
                panel_kernel(w.panel(p), x, &mut tile);
                let cols = p * NR..((p + 1) * NR).min(n); // the last panel may be partial
                for (t, row) in tile.iter().enumerate() {
                    // SAFETY: panel `p`'s columns of row `t` belong to this task alone.
                    let y_t = unsafe { out.slice(t * n + cols.start, cols.len()) };
                    y_t.copy_from_slice(&row[..cols.len()]);
                }
            }
        });
}
