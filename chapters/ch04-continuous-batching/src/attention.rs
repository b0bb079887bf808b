//! A whole step's attention in one parallel pass: every query row of the batch is one task,
//! whichever sequence it belongs to.
//!
//! ```text
//! q [n, num_heads · d]   every row of the step, flattened (prefill chunks and decodes alike)
//! task r, for every head h (KV head h / G, G = num_heads / num_kv_heads, GQA):
//!     s[h][j]   = q[r]_h · k_j / √d      j = 0 ..= pos(r), block by block through r's table
//!     p[h]      = softmax(s[h])
//!     out[r]_h  = Σ_j p[h][j] · v_j
//! ```
//! Against chapter 3's [`KvPool::attend`], called once per sequence with the heads in parallel,
//! four things change, none of them the arithmetic:
//! - **one parallel region per layer** for the whole batch instead of one per sequence: with 32
//!   decodes that is 30 hand-offs between threads per step instead of 960, and the tasks of
//!   long and short sequences balance across the threads;
//! - **a block at a time**: the slots of one block are consecutive, so the slot mapping is one
//!   table lookup per block instead of a division per position, and a task reads each
//!   position's K (then V) row, every head of it, as one contiguous run;
//! - **a vectorised softmax**: [`exp`](ch02::kernels::vector::exp) instead of a library call per
//!   score;
//! - **eight positions at a time** ([`dot8`], [`axpy8`], as chapter 2's decode attention): eight
//!   independent dot products per head keep eight vector accumulators busy, where one at a time
//!   waits on its own additions. Each score and each output element is the same chain of
//!   operations as one position at a time, so the results do not change by a bit.
//!
//! On a CPU with AVX2 and FMA, head sizes 64 and 128 (SmolLM2's and Llama's) go one
//! step further, which does change the rounding: the same loops written with intrinsics (`avx2.rs`),
//! fused multiply-adds and one horizontal sum for eight scores. They agree with the loops above
//! to a few ulp; which loops run depends only on the CPU and the shape, never on the batch.
//! With AVX-512 as well, the same arithmetic runs on 32 wide registers (`avx512.rs`): each K/V
//! element is loaded and widened once for up to four of the query heads that share it (two for
//! V at head size 128), and the outputs stay in registers across spans of 64 positions. Its results equal the
//! AVX2 loops' bit for bit.
//!
//! K/V are stored as the pool's element type (f32 or bf16, see [`KvElement`]) and widened to
//! f32 as they are read; the arithmetic is f32 throughout. An 8-bit pool (chapter 5) stores
//! codes and one scale per position and KV head: the kernel multiplies a head's score
//! `q_h · k_j` by K's scale and its softmax weight by V's, the same arithmetic as dequantizing
//! each element first.
//!
//! This kernel is the CPU executor's first [`AttentionBackend`]; chapter 7's tiled flash
//! attention is the second.

use ch01::attention::AttentionShape;
use ch02::kernels::Isa;
use ch02::kernels::vector::{KEYS, PREFETCH_POSITIONS, axpy8, dot8, prefetch_l2, softmax};
#[cfg(target_arch = "x86_64")]
use ch02::kernels::{Avx2Fma, Avx512};
use ch03::{BlockId, KvElement, KvPool, KvScales};
use ndarray::ArrayView2;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod widen;

/// Which compiled form of a row's loops [`batch_attention_with`] runs: one per instruction set,
/// each carrying the proof that the CPU has it (as [`Isa`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowKernel {
    /// The loops as written, compiled for no particular CPU.
    Portable,
    /// The loops compiled for AVX2 + FMA, and for head sizes 64 and 128 their intrinsics.
    #[cfg(target_arch = "x86_64")]
    Avx2Fma(Avx2Fma),
    /// As `Avx2Fma`, with the head sizes 64 and 128 on AVX-512's 32 registers (the same
    /// results, bit for bit).
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx2Fma, Avx512),
}

impl RowKernel {
    /// The fastest kernel of instruction set `isa` on this CPU.
    pub fn fastest(isa: Isa) -> RowKernel {
        match isa {
            Isa::Portable => RowKernel::Portable,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma(cpu) => match Avx512::cached() {
                Some(wide) => RowKernel::Avx512(cpu, wide),
                None => RowKernel::Avx2Fma(cpu),
            },
        }
    }

    /// Every kernel this CPU runs.
    pub fn available() -> Vec<RowKernel> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut kernels = vec![RowKernel::Portable];
        #[cfg(target_arch = "x86_64")]
        if let Some(Isa::Avx2Fma(cpu)) = Isa::avx2_fma() {
            kernels.push(RowKernel::Avx2Fma(cpu));
            if let Some(wide) = Avx512::detect() {
                kernels.push(RowKernel::Avx512(cpu, wide));
            }
        }
        kernels
    }
}

/// One query row of the step: its sequence's block table and its position there.
#[derive(Debug, Clone, Copy)]
pub struct QueryRow<'a> {
    /// The sequence's blocks: position `p` is in block `blocks[p / block_size]`.
    pub blocks: &'a [BlockId],
    pub pos: usize,
}

impl QueryRow<'_> {
    /// Whether `other` is a row of the same sequence: a step's rows of one sequence share its
    /// block table (the same slice, not an equal copy).
    pub fn same_sequence(&self, other: &QueryRow) -> bool {
        std::ptr::eq(self.blocks, other.blocks)
    }

    /// The pool slot of this row's own position: where its K/V go.
    pub fn slot(&self, block_size: usize) -> usize {
        self.blocks[self.pos / block_size] as usize * block_size + self.pos % block_size
    }
}

// ANCHOR: backend
/// Attention inside the CPU executor: where a step's new K/V go, and how its queries read the
/// pool. Implementations differ in how they compute, never in what.
pub trait AttentionBackend<K: KvElement>: Send {
    /// Stores the step's new K/V: row `r` of `k`, `v` [rows, kv_dim] at `rows[r]`'s slot of
    /// `layer`.
    fn write_kv(
        &mut self,
        pool: &mut KvPool<K>,
        layer: usize,
        rows: &[QueryRow],
        k: ArrayView2<f32>,
        v: ArrayView2<f32>,
    ) {
        let block_size = pool.block_size();
        for (r, row) in rows.iter().enumerate() {
            pool.write(layer, row.slot(block_size), k.row(r), v.row(r));
        }
    }

    /// `out` [rows, num_heads · d] = attention of each row of `q` [rows, num_heads · d]
    /// against positions `0..=pos` of its sequence in `layer`. Every row's K/V up to its own
    /// position are in the pool already.
    fn attend(
        &mut self,
        pool: &KvPool<K>,
        layer: usize,
        rows: &[QueryRow],
        q: &[f32],
        shape: AttentionShape,
        out: &mut [f32],
    );
}
// ANCHOR_END: backend

/// The backend of this chapter: [`batch_attention`].
#[derive(Debug, Clone, Copy)]
pub struct BatchAttention {
    pub isa: Isa,
}

impl Default for BatchAttention {
    fn default() -> Self {
        BatchAttention { isa: Isa::detect() }
    }
}

impl<K: KvElement> AttentionBackend<K> for BatchAttention {
    fn attend(
        &mut self,
        pool: &KvPool<K>,
        layer: usize,
        rows: &[QueryRow],
        q: &[f32],
        shape: AttentionShape,
        out: &mut [f32],
    ) {
        batch_attention(self.isa, pool, layer, rows, q, shape, out);
    }
}

/// One layer's keys and values as the kernel reads them.
struct LayerKv<'a, K> {
    keys: &'a [K],   // [slots, kv_dim]
    values: &'a [K], // [slots, kv_dim]
    scales: KvScales<'a>,
    block_size: usize,
    shape: AttentionShape,
}

/// One task's query: the row `q` [num_heads · d] at `row.pos`, the layer's K/V it reads, and
/// whether it asks for them ahead (a decode) or finds them in cache (a prompt chunk's row).
struct RowQuery<'a, K> {
    kv: &'a LayerKv<'a, K>,
    row: QueryRow<'a>,
    prefetch: bool,
    q: &'a [f32],
}

impl<K> Clone for RowQuery<'_, K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for RowQuery<'_, K> {}

// ANCHOR: batch_attention
/// `out` [rows, num_heads · d] = attention of each row of `q` [rows, num_heads · d] against
/// positions `0..=pos` of its sequence in `layer` of `pool`.
///
/// Every row's K/V up to its own position must be in the pool already (the executor writes the
/// step's new K/V first), and its blocks must cover `pos`. `isa` picks the compiled form of the
/// loops ([`Isa::detect`] for the fastest): [`RowKernel::fastest`] of it.
pub fn batch_attention<K: KvElement>(
    isa: Isa,
    pool: &KvPool<K>,
    layer: usize,
    rows: &[QueryRow],
    q: &[f32],
    shape: AttentionShape,
    out: &mut [f32],
) {
    let kernel = RowKernel::fastest(isa);
    batch_attention_with(kernel, pool, layer, rows, q, shape, out);
}

/// [`batch_attention`] on the row kernel `kernel` (the tests compare every one).
pub fn batch_attention_with<K: KvElement>(
    kernel: RowKernel,
    pool: &KvPool<K>,
    layer: usize,
    rows: &[QueryRow],
    q: &[f32],
    shape: AttentionShape,
    out: &mut [f32],
) {
    let q_dim = shape.num_heads * shape.head_dim;
    assert_eq!(q.len(), rows.len() * q_dim, "q is [rows, q_dim]");
    assert_eq!(out.len(), q.len(), "out is [rows, q_dim]");
    for row in rows {
        assert!(
            row.pos < row.blocks.len() * pool.block_size(),
            "position past the table"
        );
    }
    let (keys, values) = pool.layer_kv(layer);
    let kv = LayerKv {
        keys,
        values,
        scales: pool.layer_scales(layer),
        block_size: pool.block_size(),
        shape,
    };
    out.par_chunks_mut(q_dim)
        .zip(q.par_chunks(q_dim))
        .enumerate()
        .for_each_init(RowScratch::default, |scratch, (r, (out_r, q_r))| {
            let row = rows[r];
            // A decode, its sequence's only row in the step, finds its K/V in memory (a model's
            // weights pass through the caches between two layers' attention), so it asks for
            // them ahead. The rows of a prompt chunk share theirs, which stay in cache from row
            // to row: asking again would only cost.
            let shares = |other: Option<&QueryRow>| other.is_some_and(|o| o.same_sequence(&row));
            let prefetch = !shares(r.checked_sub(1).map(|p| &rows[p])) && !shares(rows.get(r + 1));
            let query = RowQuery {
                kv: &kv,
                row,
                prefetch,
                q: q_r,
            };
            attend_row_with(kernel, query, out_r, scratch);
        });
}
// ANCHOR_END: batch_attention

/// A thread's scratch, reused from task to task.
#[derive(Debug, Default)]
struct RowScratch {
    /// [num_heads, positions]: scores, then softmax weights.
    scores: Vec<f32>,
    /// The pool slot of each position (the intrinsic tasks').
    #[cfg(target_arch = "x86_64")]
    slots: Vec<usize>,
}

// ANCHOR: attend_row
/// One task: the query row `q_r` [num_heads · d] at `row.pos` → `out_r` [num_heads · d].
/// `scores` is the thread's scratch, [num_heads, pos + 1] once filled.
#[inline(always)]
fn attend_row<K: KvElement>(
    kv: &LayerKv<K>,
    row: QueryRow,
    prefetch: bool,
    q_r: &[f32],
    out_r: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim: d,
    } = kv.shape;
    let group_size = num_heads / num_kv_heads; // query heads per KV head (GQA)
    let kv_dim = num_kv_heads * d;
    let len = row.pos + 1; // positions this row sees
    let scale = 1.0 / (d as f32).sqrt();
    scores.clear();
    scores.resize(num_heads * len, 0.0);

    // s[h][j] = q_h · k_j / √d, eight positions at a time, reading each position's K row once
    // for every head; an 8-bit row is codes times the head's scale (1 for f32 and bf16, an
    // exact product). A last group short of eight repeats its last slot (scored, then dropped;
    // weighted by zero in the V pass).
    let mut group = [0usize; KEYS]; // the pool slots of positions j..j + 8
    let mut heads_of: [&[K]; KEYS] = [&[]; KEYS]; // one head's part of each row, [d]
    let mut all_slots = slots(row.blocks, kv.block_size, len);
    // The slots whose rows are asked for in advance (none when `prefetch` is off).
    let ahead_len = if prefetch { len } else { 0 };
    let mut ahead = slots(row.blocks, kv.block_size, ahead_len);
    prefetch_rows(kv.keys, &mut ahead, PREFETCH_POSITIONS, kv_dim);
    for j in (0..len).step_by(KEYS) {
        prefetch_rows(kv.keys, &mut ahead, KEYS, kv_dim);
        let n = next_group(&mut all_slots, &mut group);
        for (h, q_h) in q_r.chunks_exact(d).enumerate() {
            let kv_head = h / group_size;
            for (part, &slot) in heads_of.iter_mut().zip(&group) {
                *part = &kv.keys[slot * kv_dim + kv_head * d..][..d];
            }
            let s = dot8(q_h, &heads_of);
            for p in 0..n {
                scores[h * len + j + p] = s[p] * (scale * kv.scales.key(group[p], kv_head));
            }
        }
    }
    let mut ahead = slots(row.blocks, kv.block_size, ahead_len);
    prefetch_rows(kv.values, &mut ahead, PREFETCH_POSITIONS, kv_dim); // while the softmax computes
    // p[h] = softmax(s[h])
    scores.chunks_exact_mut(len).for_each(softmax);
    // out_h = Σ_j p[h][j] · v_j, eight positions at a time
    out_r.fill(0.0);
    let mut all_slots = slots(row.blocks, kv.block_size, len);
    for j in (0..len).step_by(KEYS) {
        prefetch_rows(kv.values, &mut ahead, KEYS, kv_dim);
        let n = next_group(&mut all_slots, &mut group);
        for (h, out_h) in out_r.chunks_exact_mut(d).enumerate() {
            let kv_head = h / group_size;
            let mut w = [0.0; KEYS];
            for (p, (part, &slot)) in heads_of.iter_mut().zip(&group).enumerate() {
                *part = &kv.values[slot * kv_dim + kv_head * d..][..d];
                if p < n {
                    w[p] = scores[h * len + j + p] * kv.scales.value(slot, kv_head);
                }
            }
            axpy8(&w, &heads_of, out_h);
        }
    }
}
// ANCHOR_END: attend_row

/// The pool slots of positions `0..len` of a sequence with `blocks`, in order: one lookup per
/// block, then the block's consecutive slots (plain loops rather than a closure, so that they
/// are compiled inside the caller's AVX2 function).
#[inline(always)]
fn slots(blocks: &[BlockId], block_size: usize, len: usize) -> impl Iterator<Item = usize> {
    blocks
        .iter()
        .flat_map(move |&block| {
            let base = block as usize * block_size;
            base..base + block_size
        })
        .take(len)
}

/// Asks for the rows of the next (up to) `n` slots of `slots` in `stored` [slots, kv_dim], to be
/// read [`PREFETCH_POSITIONS`] positions later ([`prefetch_l2`]: decode finds K/V in memory).
#[inline(always)]
fn prefetch_rows<K>(
    stored: &[K],
    slots: &mut impl Iterator<Item = usize>,
    n: usize,
    kv_dim: usize,
) {
    for slot in slots.take(n) {
        prefetch_l2(&stored[slot * kv_dim..][..kv_dim]);
    }
}

/// Fills `group` with the next (up to) eight slots of `slots`; returns how many it took (at
/// least 1 while any remain), the rest of `group` repeating the last one taken.
#[inline(always)]
fn next_group(slots: &mut impl Iterator<Item = usize>, group: &mut [usize; KEYS]) -> usize {
    let mut n = 0;
    for slot in slots.take(KEYS) {
        group[n] = slot;
        n += 1;
    }
    let last = group[n.saturating_sub(1)];
    group[n..].fill(last);
    n
}

/// [`attend_row`] as `kernel` compiles it: for AVX2 + FMA (the same Rust, vectorised 8 lanes
/// wide by the compiler) or as plain Rust, and for head sizes 64 and 128 the intrinsics of
/// `avx2.rs` or `avx512.rs`.
fn attend_row_with<K: KvElement>(
    kernel: RowKernel,
    query: RowQuery<K>,
    out_r: &mut [f32],
    scratch: &mut RowScratch,
) {
    let RowQuery {
        kv,
        row,
        prefetch,
        q: q_r,
    } = query;
    let scores = &mut scratch.scores;
    match kernel {
        RowKernel::Portable => attend_row(kv, row, prefetch, q_r, out_r, scores),
        #[cfg(target_arch = "x86_64")]
        RowKernel::Avx512(_, wide) if avx2::HEAD_DIMS.contains(&kv.shape.head_dim) => {
            avx512::attend_row(wide, query, out_r, scratch)
        }
        #[cfg(target_arch = "x86_64")]
        RowKernel::Avx2Fma(cpu) | RowKernel::Avx512(cpu, _)
            if avx2::HEAD_DIMS.contains(&kv.shape.head_dim) =>
        {
            avx2::attend_row(cpu, query, out_r, scratch)
        }
        #[cfg(target_arch = "x86_64")]
        RowKernel::Avx2Fma(_) | RowKernel::Avx512(..) => {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<K: KvElement>(
                kv: &LayerKv<K>,
                row: QueryRow,
                prefetch: bool,
                q_r: &[f32],
                out_r: &mut [f32],
                scores: &mut Vec<f32>,
            ) {
                attend_row(kv, row, prefetch, q_r, out_r, scores)
            }
            // SAFETY: a `RowKernel` other than `Portable` holds an `Avx2Fma` proof, which exists
            // only once run-time detection found AVX2 and FMA on this CPU (its field is
            // private); `avx2` is safe Rust otherwise.
            unsafe { avx2(kv, row, prefetch, q_r, out_r, scores) }
        }
    }
}
