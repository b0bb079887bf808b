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
//!   weights once and uses each for 6 tokens. The tokens are packed first (`[tile][k][MR]`) so the
//!   micro-kernel reads both operands contiguously; threads split the panels, so every weight is
//!   read from memory once per call.
//!
//! Two instruction sets implement the same loops: [`Isa::Avx2Fma`] with explicit intrinsics on
//! x86-64 CPUs that have them (checked at run time), and [`Isa::Portable`], plain Rust that any
//! target compiles. Tests compare both with a naive product.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod packed;
mod portable;
pub mod vector;

use std::cell::RefCell;

use rayon::prelude::*;

pub use packed::{NR, PackedWeight, WeightElement};

/// Token rows of the prefill micro-kernel's output tile.
pub const MR: usize = 6;

/// Which implementation of the inner loops runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust: correct everywhere, vectorised only as far as the compiler manages.
    Portable,
    /// x86-64 AVX2 and FMA intrinsics: 8 f32 lanes, fused multiply-add.
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

impl Isa {
    /// The fastest implementation this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Isa::Avx2Fma;
        }
        Isa::Portable
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

/// Panels one task handles: enough work to amortise the task, few enough to balance the cores.
fn panels_per_task(panels: usize) -> usize {
    panels
        .div_ceil(4 * rayon::current_num_threads())
        .clamp(1, 8)
}

/// One token: `y[o] = Σ_k W[o, k] · x[k]` for every output row, panels split across threads.
/// `x`: [in], `y`: [out].
// ANCHOR: matvec
pub fn matvec<W: WeightElement>(isa: Isa, w: &PackedWeight<W>, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.in_features(), "x is [in]");
    assert_eq!(y.len(), w.out_features(), "y is [out]");
    let per_task = panels_per_task(w.num_panels());
    y.par_chunks_mut(per_task * NR)
        .enumerate()
        .for_each(|(task, y_chunk)| {
            let first_panel = task * per_task;
            for (i, y_panel) in y_chunk.chunks_mut(NR).enumerate() {
                let panel = w.panel(first_panel + i); // [in][NR]
                let mut out = [0.0f32; NR];
                match isa {
                    Isa::Portable => portable::panel_matvec(panel, x, &mut out),
                    // SAFETY: `Isa::Avx2Fma` is only constructed when the CPU has AVX2 and FMA.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2Fma => unsafe { avx2::panel_matvec(panel, x, &mut out) },
                }
                y_panel.copy_from_slice(&out[..y_panel.len()]); // the last panel may be partial
            }
        });
}
// ANCHOR_END: matvec

/// Many tokens: `y[t, o] = Σ_k x[t, k] · W[o, k]`, i.e. `y = x Wᵀ`.
/// `x`: [tokens, in], `y`: [tokens, out], both row-major.
// ANCHOR: matmul
pub fn matmul<W: WeightElement>(
    isa: Isa,
    w: &PackedWeight<W>,
    x: &[f32],
    y: &mut [f32],
    tokens: usize,
) {
    let (k, n) = (w.in_features(), w.out_features());
    assert_eq!(x.len(), tokens * k, "x is [tokens, in]");
    assert_eq!(y.len(), tokens * n, "y is [tokens, out]");
    if tokens == 0 {
        return; // nothing to compute (an engine step whose sequences all want no logits)
    }
    let tiles = tokens.div_ceil(MR);
    let out = SharedOut(y.as_mut_ptr());
    with_buffer(|a| {
        pack_tokens(x, tokens, k, a); // [tiles][k][MR], zero rows past `tokens`
        let per_task = panels_per_task(w.num_panels());
        let tasks = w.num_panels().div_ceil(per_task);
        (0..tasks).into_par_iter().for_each(|task| {
            let panels = task * per_task..((task + 1) * per_task).min(w.num_panels());
            // One weight panel at a time, so it stays in cache while every token tile uses it.
            for p in panels {
                let b = w.panel(p); // [k][NR]
                let cols = p * NR..((p + 1) * NR).min(n); // the last panel may be partial
                for tile in 0..tiles {
                    let a_tile = &a[tile * k * MR..][..k * MR]; // [k][MR]
                    let mut c = [0.0f32; MR * NR]; // [MR][NR]
                    match isa {
                        Isa::Portable => portable::tile_matmul(a_tile, b, &mut c),
                        // SAFETY: only constructed when the CPU has AVX2 and FMA.
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2Fma => unsafe { avx2::tile_matmul(a_tile, b, &mut c) },
                    }
                    let rows = tile * MR..((tile + 1) * MR).min(tokens); // the last tile too
                    for (r, c_row) in rows.zip(c.chunks_exact(NR)) {
                        // SAFETY: `y` is [tokens, n] and outlives the parallel loop; element
                        // (r, cols) belongs to panel p and tile r / MR, which only this
                        // iteration of this task writes.
                        let y_row = unsafe { out.slice(r * n + cols.start, cols.len()) };
                        y_row.copy_from_slice(&c_row[..cols.len()]);
                    }
                }
            }
        });
    });
}
// ANCHOR_END: matmul

thread_local! {
    /// The calling thread's packed tokens, kept between calls: a fresh multi-megabyte buffer
    /// would come from the kernel as zeroed pages on every prefill.
    static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's packing buffer, or with a fresh one if it is in use (a matmul
/// started by a task that this thread runs while it waits inside another matmul).
fn with_buffer(f: impl FnOnce(&mut Vec<f32>)) {
    PACKED.with(|buffer| match buffer.try_borrow_mut() {
        Ok(mut buffer) => f(&mut buffer),
        Err(_) => f(&mut Vec::new()),
    })
}

/// The output of a [`matmul`], written by many tasks at once, each to its own elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

// SAFETY: tasks write disjoint elements (see the one use), and the buffer outlives them.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `at..at + len` must be inside the buffer, and no other live reference may touch it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [f32] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

/// `x` [tokens, k] row-major → `a` = `[tiles][k][MR]`: for each tile of [`MR`] tokens, the MR
/// values of feature `k` adjacent (the micro-kernel broadcasts them one by one). Missing tokens
/// are zero.
fn pack_tokens(x: &[f32], tokens: usize, k: usize, a: &mut Vec<f32>) {
    let tiles = tokens.div_ceil(MR);
    a.resize(tiles * k * MR, 0.0); // every element is written below
    if k == 0 {
        return; // nothing to pack: every output is the empty sum
    }
    for (t, row) in x.chunks_exact(k).enumerate() {
        let tile = &mut a[(t / MR) * k * MR..][..k * MR];
        for (kk, &v) in row.iter().enumerate() {
            tile[kk * MR + t % MR] = v;
        }
    }
    for t in tokens..tiles * MR {
        let tile = &mut a[(t / MR) * k * MR..][..k * MR];
        for kk in 0..k {
            tile[kk * MR + t % MR] = 0.0; // the last tile's missing tokens
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
    } else {
        matmul(isa, w, x, y, tokens);
    }
}
