//! The tiled loop of FlashAttention-2 for one task: one query tile of one sequence, the G query
//! heads that share one KV head, against every K/V tile it can see.
//!
//! ```text
//! Q tile  = the task's rows (G heads × Br positions p₀..p₁), scaled by 1/√d  [G·Br, d]
//! m = −∞, l = 0, O = 0                                                       per row; O [G·Br, d]
//! for each K/V tile [k₀, k₀ + Bc) with k₀ <= p₁:      tiles wholly after p₁ are never loaded
//!     K, V ← the pool, through the block table                               [Bc, d] each
//!     S = Q Kᵀ                                                               [G·Br, Bc]
//!     per row at position p: only keys k <= p count   (only the diagonal tile masks anything)
//!     m' = max(m, rowmax S);  P = e^(S − m');  α = e^(m − m')
//!     l ← α·l + rowsum P;     O ← α·O + P V
//! O ← O / l
//! ```
//!
//! The loop order is FlashAttention-2's: query tiles outside, K/V tiles inside, so each task
//! owns its rows' running state and writes its outputs once, and tasks (query tile × KV head)
//! run in parallel without sharing anything. K/V tiles are read once per query tile instead of
//! once per query row, and the score matrix exists one `[G·Br, Bc]` tile at a time.

use ch02::kernels::vector::ToF32;
use ch03::BlockId;

use crate::online::{RowStats, finish, online_step};
use crate::tile::{LayerKv, TileDims, Tiles, accumulate_pv, load_kv_tile, scores};

/// One task of the tiled loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillTask {
    /// The step's first row of this tile; the tile's rows are `first_row..first_row + rows`.
    pub first_row: usize,
    pub rows: usize,
    /// Position of the tile's first row (its rows are consecutive positions).
    pub first_pos: usize,
    pub kv_head: usize,
}

// ANCHOR: prefill_task
/// Runs one task: `q` is the step's queries [n, num_heads · d]; `blocks` the sequence's table;
/// `kv_tile` = Bc; the outputs go to `o` [G, brp, dp] (head g's row i at `(g · brp + i) · dp`).
/// `FMA`: fuse the products' multiply-adds (only where the CPU has FMA).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn prefill_task<K: ToF32, const FMA: bool>(
    kv: &LayerKv<K>,
    blocks: &[BlockId],
    task: PrefillTask,
    q: &[f32],
    kv_tile: usize,
    dims: TileDims,
    tiles: &mut Tiles,
    stats: &mut [RowStats],
    o: &mut [f32],
) {
    let (d, q_dim) = (kv.shape.head_dim, kv.shape.num_heads * kv.shape.head_dim);
    let (brp, bcp, dp) = (dims.brp, dims.bcp, dims.dp);
    let scale = 1.0 / (d as f32).sqrt();
    let last_pos = task.first_pos + task.rows - 1;

    // Q tile [G·Br, d], scaled; rows and columns past the task's are zero.
    tiles.q.fill(0.0);
    for g in 0..dims.group {
        let h = task.kv_head * dims.group + g;
        for i in 0..task.rows {
            let src = &q[(task.first_row + i) * q_dim + h * d..][..d];
            let dst = &mut tiles.q[(g * brp + i) * dp..][..d];
            dst.iter_mut().zip(src).for_each(|(x, &y)| *x = y * scale);
        }
    }
    stats.fill(RowStats::EMPTY);
    o.fill(0.0);

    // ANCHOR: task_7_3
    // Causal: K/V tiles that start after the last query position are skipped whole.
    for k0 in (0..=last_pos).step_by(kv_tile) {
        let len = kv_tile.min(last_pos + 1 - k0);
        load_kv_tile(
            kv,
            blocks,
            task.kv_head,
            k0,
            len,
            dims,
            &mut tiles.kt,
            &mut tiles.v,
        );
        scores::<FMA>(&tiles.q, &tiles.kt, &mut tiles.s, dp, bcp); // S = Q Kᵀ  [G·Br, Bc]
        for g in 0..dims.group {
            for i in 0..brp {
                let r = g * brp + i;
                let s_r = &mut tiles.s[r * bcp..][..bcp];
                // Keys this row sees in the tile: all of them, except on the diagonal tile.
                let pos = task.first_pos + i;
                let visible = if i < task.rows && pos >= k0 {
                    (pos + 1 - k0).min(len)
                } else {
                    0
                };
                let alpha = online_step(&mut stats[r], &mut s_r[..visible]); // P = e^(S − m')
                s_r[visible..].fill(0.0); // masked and padding keys weigh nothing
                if alpha != 1.0 {
                    o[r * dp..][..dp].iter_mut().for_each(|x| *x *= alpha); // O ← α·O
                }
            }
        }
        accumulate_pv::<FMA>(&tiles.s, &tiles.v, o, dp, bcp, len); // O ← O + P V
    }
    // ANCHOR_END: task_7_3
    for (r, o_r) in o.chunks_exact_mut(dp).enumerate() {
        finish(stats[r], o_r); // O / l
    }
}
// ANCHOR_END: prefill_task
