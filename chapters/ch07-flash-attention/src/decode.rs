//! Split-K decode (FlashDecoding): one query row against a long context, the context cut into
//! partitions that run in parallel, each producing a partial softmax state, merged at the end.
//!
//! ```text
//! context 0 ─────────────────────────────────────────────── pos
//!         │ partition 0 │ partition 1 │ partition 2 │ partition 3 │      in parallel
//!           (m₀, l₀, o₀)  (m₁, l₁, o₁)  (m₂, l₂, o₂)  (m₃, l₃, o₃)
//!                     └──────── ⊕ (log-sum-exp merge) ────────┘  →  o / l
//! ```
//!
//! A decode row has one query per head: there are no query tiles to spread over the cores, and
//! a single long sequence would run on one. Splitting the keys instead makes one task per
//! partition. A task covers every head, so that it reads each position's K (then V) row, all
//! KV heads of it, as one contiguous run, once (split by KV head, three tasks would each stride
//! through every row, and the cache would fetch most of each row three times). Inside a
//! partition the keys are walked in chunks of [`CHUNK`] positions with the same online softmax
//! as the tiled loop, so a partition of any length needs only `num_heads × CHUNK` scores.

use ch02::kernels::vector::{ToF32, axpy, dot};
use ch03::BlockId;

use crate::online::{RowStats, online_step};
use crate::tile::{LayerKv, slot_runs};

/// Positions scored at once inside a partition.
pub const CHUNK: usize = 64;

/// One partition of one decode row, every head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeTask {
    /// The row in the step.
    pub row: usize,
    /// Key positions `start..end` of the row's sequence.
    pub start: usize,
    pub end: usize,
}

/// f32 elements of one task's partial states: per query head, `[m, l, o[d]]`.
pub fn partial_len(num_heads: usize, d: usize) -> usize {
    num_heads * (d + 2)
}

/// Keys `start..end` of `0..len` cut into `parts` nearly equal pieces: piece `p`.
pub fn partition(len: usize, parts: usize, p: usize) -> (usize, usize) {
    (p * len / parts, (p + 1) * len / parts)
}

// ANCHOR: decode_task
/// Runs one partition: `q_r` is the row's queries [num_heads · d]; writes per query head h
/// `[m, l, o]` (o unnormalised) into `partial` [num_heads, d + 2]. `scores`: scratch
/// [num_heads, CHUNK].
#[inline(always)]
pub fn decode_task<K: ToF32>(
    kv: &LayerKv<K>,
    blocks: &[BlockId],
    task: DecodeTask,
    q_r: &[f32],
    scores: &mut [f32],
    partial: &mut [f32],
) {
    // ANCHOR: task_7_2
    let d = kv.shape.head_dim;
    let group = kv.shape.num_heads / kv.shape.num_kv_heads;
    let kv_dim = kv.kv_dim();
    let scale = 1.0 / (d as f32).sqrt();
    for state in partial.chunks_exact_mut(d + 2) {
        state.fill(0.0);
    }
    let mut chunk_start = task.start;
    while chunk_start < task.end {
        let n = CHUNK.min(task.end - chunk_start);
        // s[h][j] = q_h · k_j / √d, K head h / G (GQA), each K row read once for every head
        for (j0, slot0, run) in slot_runs(blocks, kv.block_size, chunk_start, n) {
            for i in 0..run {
                let k_j = &kv.keys[(slot0 + i) * kv_dim..][..kv_dim];
                for (h, q_h) in q_r.chunks_exact(d).enumerate() {
                    let kv_head = h / group;
                    let k_scale = scale * kv.scales.key(slot0 + i, kv_head);
                    scores[h * CHUNK + j0 + i] = dot(q_h, &k_j[kv_head * d..][..d]) * k_scale;
                }
            }
        }
        // The online step per head, then o_h ← α·o_h + Σ_j p[h][j] · v_j.
        for (h, state) in partial.chunks_exact_mut(d + 2).enumerate() {
            let (head, o) = state.split_at_mut(2);
            let mut row = if chunk_start == task.start {
                RowStats::EMPTY
            } else {
                RowStats {
                    max: head[0],
                    sum: head[1],
                }
            };
            let alpha = online_step(&mut row, &mut scores[h * CHUNK..][..n]);
            (head[0], head[1]) = (row.max, row.sum);
            if alpha != 1.0 {
                o.iter_mut().for_each(|x| *x *= alpha);
            }
        }
        for (j0, slot0, run) in slot_runs(blocks, kv.block_size, chunk_start, n) {
            for i in 0..run {
                let v_j = &kv.values[(slot0 + i) * kv_dim..][..kv_dim];
                for (h, state) in partial.chunks_exact_mut(d + 2).enumerate() {
                    let kv_head = h / group;
                    let p = scores[h * CHUNK + j0 + i] * kv.scales.value(slot0 + i, kv_head);
                    axpy(p, &v_j[kv_head * d..][..d], &mut state[2..]);
                }
            }
        }
        chunk_start += n;
    }
    if task.start == task.end {
        for state in partial.chunks_exact_mut(d + 2) {
            state[0] = f32::NEG_INFINITY; // the empty state: (−∞, 0, 0)
        }
    }
    // ANCHOR_END: task_7_2
}
// ANCHOR_END: decode_task

/// Reads the partial state of query head `h` from a task's `partial`: (stats, o `[d]`).
pub fn read_partial(partial: &[f32], h: usize, d: usize) -> (RowStats, &[f32]) {
    let state = &partial[h * (d + 2)..][..d + 2];
    (
        RowStats {
            max: state[0],
            sum: state[1],
        },
        &state[2..],
    )
}
