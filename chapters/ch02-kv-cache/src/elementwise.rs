//! The row-wise work between the matrix products, split across threads when it is big enough:
//! RMSNorm, `silu(gate) · up` and the embedding gather (and RoPE and the residual additions,
//! which stay on the calling thread: see [`rope_rows`] and [`add_rows`]).
//!
//! ```text
//! buffer [n, cols]  ──▶  blocks of whole rows  ──▶  one rayon task per block
//!                        rows_per_task = max(⌈MIN_ELEMENTS_PER_TASK / cols⌉, ⌈n / (4 · threads)⌉)
//! ```
//! Invariant: every op computes each row with the same arithmetic whether it runs serially or
//! split, so the two paths give bit-identical results (the property tests assert equality).
//! A split only decides which thread computes which rows, never how a row is computed.
//!
//! The split can be switched off for the whole process ([`set_parallel_elementwise`]), so that
//! one benchmark run measures the same step before and after.

use std::sync::atomic::{AtomicBool, Ordering};

use ch01::model::RmsNorm;
use ch01::rope::Rope;
use ndarray::ArrayView2;
use rayon::prelude::*;

use crate::kernels::vector::silu_mul_fastest;

// ANCHOR: threshold
/// The fewest elements (f32 values of the written buffer) one task handles.
///
/// A rayon task costs about a microsecond to hand to another thread (more when the workers are
/// asleep); these ops run at a few elements per nanosecond, so a task needs thousands of
/// elements before the hand-off is small beside its work. At 4096: one decode row of
/// SmolLM2-135M (hidden 576, intermediate 1536) stays on the calling thread, whole; a batch of 32
/// decode rows (18 432 elements of hidden) splits into 4–5 tasks; a 124-token prefill into one
/// task per block of 8 rows (capped at 4 tasks per thread); and each sequence's 49 152-entry
/// vocabulary is one task of its own when a step samples several.
pub const MIN_ELEMENTS_PER_TASK: usize = 4096;
// ANCHOR_END: threshold

/// Whether the ops of this module may split across threads (the default).
static PARALLEL: AtomicBool = AtomicBool::new(true);

/// Lets the ops of this module split across threads (`true`, the default) or keeps them all on
/// the calling thread (`false`), for the whole process. Results are the same either way.
pub fn set_parallel_elementwise(parallel: bool) {
    PARALLEL.store(parallel, Ordering::Relaxed);
}

/// See [`set_parallel_elementwise`].
pub fn parallel_elementwise() -> bool {
    PARALLEL.load(Ordering::Relaxed)
}

/// How many of `items` (rows, sequences) of `item_len` elements each one task takes, or `None`
/// when they all stay on the calling thread: the split is off, there is one thread, or the
/// work fits in one task. Tasks hold at least [`MIN_ELEMENTS_PER_TASK`] elements (one item
/// when items are larger) and there are at most 4 per thread, to balance the cores without
/// paying for more hand-offs than that.
pub fn items_per_task(items: usize, item_len: usize) -> Option<usize> {
    let threads = rayon::current_num_threads();
    if !parallel_elementwise() || threads == 1 || items < 2 {
        return None;
    }
    let per_task = MIN_ELEMENTS_PER_TASK
        .div_ceil(item_len.max(1))
        .max(items.div_ceil(4 * threads));
    (per_task < items).then_some(per_task)
}

/// Runs `f(first_row, out_block, in_block)` over blocks of whole rows of `out` [n, out_cols]
/// and `input` [n, in_cols], in parallel when [`items_per_task`] says so; otherwise once,
/// with every row. `f` must treat each row on its own (the invariant of this module).
fn zip_row_blocks<F>(out: &mut [f32], out_cols: usize, input: &[f32], in_cols: usize, f: F)
where
    F: Fn(usize, &mut [f32], &[f32]) + Sync,
{
    let n = out.len() / out_cols.max(1);
    assert_eq!(out.len(), n * out_cols, "out is [n, out_cols]");
    assert_eq!(input.len(), n * in_cols, "input is [n, in_cols]");
    assert!(
        in_cols > 0 || n == 0,
        "input rows hold at least one element"
    );
    match items_per_task(n, out_cols) {
        None => f(0, out, input),
        Some(rows) => out
            .par_chunks_mut(rows * out_cols)
            .zip(input.par_chunks(rows * in_cols))
            .enumerate()
            .for_each(|(task, (out, input))| f(task * rows, out, input)),
    }
}

/// [`zip_row_blocks`] with nothing to read: `f(first_row, block)` over blocks of `out`
/// [n, cols].
fn row_blocks<F>(out: &mut [f32], cols: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let n = out.len() / cols.max(1);
    assert_eq!(out.len(), n * cols, "out is [n, cols]");
    match items_per_task(n, cols) {
        None => f(0, out),
        Some(rows) => out
            .par_chunks_mut(rows * cols)
            .enumerate()
            .for_each(|(task, out)| f(task * rows, out)),
    }
}

// ANCHOR: rms_norm_rows
/// `out = rms_norm(x)` row by row with [`RmsNorm::forward_into_row`] (chapter 1's
/// `forward_into`, bit for bit). `x`, `out`: [n, hidden].
pub fn rms_norm_rows(norm: &RmsNorm, x: &[f32], out: &mut [f32], hidden: usize) {
    zip_row_blocks(out, hidden, x, hidden, |_, out, x| {
        for (o, x) in out.chunks_exact_mut(hidden).zip(x.chunks_exact(hidden)) {
            norm.forward_into_row(x, o);
        }
    });
}
// ANCHOR_END: rms_norm_rows

/// `out[i] = rms_norm(x[picked[i]])`: the rows that want logits, selected and normed in one
/// pass with [`RmsNorm::forward_row`] (chapter 1's `forward`, bit for bit: what chapter 4's
/// final norm has always computed). `x`: [n, hidden], `out`: [picked, hidden].
pub fn rms_norm_picked_rows(
    norm: &RmsNorm,
    x: &[f32],
    picked: &[usize],
    out: &mut [f32],
    hidden: usize,
) {
    assert_eq!(out.len(), picked.len() * hidden, "out is [picked, hidden]");
    row_blocks(out, hidden, |first, out| {
        for (o, &row) in out.chunks_exact_mut(hidden).zip(&picked[first..]) {
            norm.forward_row(&x[row * hidden..(row + 1) * hidden], o);
        }
    });
}

/// RoPE on every row of `x` [n, heads · head_dim]: row `t` rotated by the angles
/// `cos_sin[t]` [head_dim / 2] ([`Rope::cos_sin`] of its position; the same bits as
/// [`Rope::rotate`]).
///
/// On the calling thread, like [`add_rows`]: with the angles computed once per step, a rotation
/// is three operations per value, and split it came out slower (chapter 2's profile,
/// 2026-12-04, SmolLM2-135M: a 124-token prefill's 60 rotations took 0.41 ms serial and 0.66 ms
/// split, a batch-32 decode step's 0.14 and 0.43 ms).
pub fn rope_rows(rope: &Rope, x: &mut [f32], width: usize, cos_sin: &[(f32, f32)]) {
    let half = rope.head_dim() / 2;
    assert!(
        width > 0 && x.len().is_multiple_of(width),
        "x is [n, width]"
    );
    assert_eq!(
        x.len() / width * half,
        cos_sin.len(),
        "cos_sin is [n, head_dim / 2]"
    );
    for (row, cos_sin) in x.chunks_exact_mut(width).zip(cos_sin.chunks_exact(half)) {
        rope.rotate_with(row, cos_sin);
    }
}

/// `x += h`, element by element (the residual addition). `x`, `h`: [n, cols].
///
/// Always on the calling thread: one addition per two values read is the cheapest op here, and
/// split it came out slower (chapter 2's profile, 2026-12-02: a 124-token prefill's 60 residual
/// additions took 1.3 ms serial and 3.4 ms split, a batch-32 decode step's 0.5 and 2.1 ms).
pub fn add_rows(x: &mut [f32], h: &[f32], cols: usize) {
    assert_eq!(x.len(), h.len(), "x and h are both [n, cols]");
    assert!(cols > 0 && x.len().is_multiple_of(cols), "x is [n, cols]");
    x.iter_mut().zip(h).for_each(|(x, o)| *x += o);
}

/// `gate = silu(gate) · up`, element by element. `gate`, `up`: [n, intermediate].
pub fn silu_mul_rows(gate: &mut [f32], up: &[f32], cols: usize) {
    zip_row_blocks(gate, cols, up, cols, |_, gate, up| {
        silu_mul_fastest(gate, up)
    });
}

/// `x[t] = table[ids[t]]`: the embedding gather. `table`: [vocab, hidden], `x`: [n, hidden]
/// with `n = ids.len()`; ids must be checked against the vocabulary first.
pub fn gather_rows(table: ArrayView2<f32>, ids: &[u32], x: &mut [f32]) {
    let hidden = table.ncols();
    assert_eq!(x.len(), ids.len() * hidden, "x is [ids, hidden]");
    row_blocks(x, hidden, |first, x| {
        for (x_t, &id) in x.chunks_exact_mut(hidden).zip(&ids[first..]) {
            let row = table.row(id as usize); // [hidden]
            match row.as_slice() {
                Some(row) => x_t.copy_from_slice(row),
                None => x_t.iter_mut().zip(row).for_each(|(x, &e)| *x = e),
            }
        }
    });
}
