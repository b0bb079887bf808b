//! The tiles of the tiled loop and the two small matrix products on them: what a GPU kernel
//! keeps in shared memory and registers, kept here in buffers small enough for the CPU's cache.
//!
//! ```text
//! q   [rows, dp]    the query tile, scaled by 1/√d          rows = G heads × Br positions
//! kt  [dp, bcp]     the K tile, transposed                  loaded from the pool through the
//! v   [bcp, dp]     the V tile                              block table, widened to f32
//! s   [rows, bcp]   S = Q Kᵀ, then P = e^(S − m) in place
//! o   [rows, dp]    O ← α·O + P V                           the running outputs
//! ```
//! Every dimension is padded so that the products run on whole register blocks: `dp` = d and
//! `bcp` = Bc rounded up to [`LANES`] = 16, the rows of each head rounded up to [`ROWS`] = 4.
//! Padding is zero in `q`, `kt` and `v`, and the probabilities of padding (or masked) columns
//! are set to 0 before `P V`, so padding never reaches an output.

use ch01::attention::AttentionShape;
use ch02::kernels::vector::ToF32;
use ch03::{BlockId, KvScales};

/// Columns of one register block: two 8-lane vectors (AVX2), or one 16-lane vector (AVX-512).
pub const LANES: usize = 16;
/// Rows of one register block.
pub const ROWS: usize = 4;

/// `acc + a · b`, fused into one instruction (one rounding) when `FMA`: the AVX2 + FMA build
/// of the kernels passes `true`, the portable one `false` (where `mul_add` would be a library
/// call per element).
#[inline(always)]
pub fn madd<const FMA: bool>(acc: f32, a: f32, b: f32) -> f32 {
    if FMA { a.mul_add(b, acc) } else { acc + a * b }
}

/// `n` rounded up to a multiple of `to`.
pub fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// One layer's keys and values as the kernels read them: slot `s` is row `s` of
/// `[slots, kv_dim]`, and a sequence's position `p` lives in slot
/// `blocks[p / block_size] · block_size + p % block_size`. An 8-bit pool's rows are codes:
/// head `h` of slot `s` is `code · scales.key(s, h)` (or `.value`), and every scale is 1 in an
/// f32 or bf16 pool ([`KvScales::NONE`]).
#[derive(Debug, Clone, Copy)]
pub struct LayerKv<'a, K> {
    pub keys: &'a [K],
    pub values: &'a [K],
    pub scales: KvScales<'a>,
    pub block_size: usize,
    pub shape: AttentionShape,
}

impl<K> LayerKv<'_, K> {
    pub fn kv_dim(&self) -> usize {
        self.shape.num_kv_heads * self.shape.head_dim
    }
}

/// The runs of consecutive slots that hold positions `start..start + len` of a sequence with
/// `blocks`, as `(j, slot, run)`: position `start + j + i` is in slot `slot + i` for `i < run`.
/// One table lookup per block: the tile follows the block table. An iterator rather than a
/// closure, so that the loops over it are compiled inside the caller's AVX2 function (a
/// closure is a function of its own, without the caller's target features).
#[inline(always)]
pub fn slot_runs(blocks: &[BlockId], block_size: usize, start: usize, len: usize) -> SlotRuns<'_> {
    SlotRuns {
        blocks,
        block_size,
        start,
        len,
        j: 0,
    }
}

/// See [`slot_runs`].
pub struct SlotRuns<'a> {
    blocks: &'a [BlockId],
    block_size: usize,
    start: usize,
    len: usize,
    j: usize,
}

impl Iterator for SlotRuns<'_> {
    type Item = (usize, usize, usize);

    #[inline(always)]
    fn next(&mut self) -> Option<(usize, usize, usize)> {
        if self.j >= self.len {
            return None;
        }
        let pos = self.start + self.j;
        let offset = pos % self.block_size;
        let run = (self.block_size - offset).min(self.len - self.j);
        let item = (
            self.j,
            self.blocks[pos / self.block_size] as usize * self.block_size + offset,
            run,
        );
        self.j += run;
        Some(item)
    }
}

/// The sizes of one task's tiles, padded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileDims {
    /// Query heads per KV head (G).
    pub group: usize,
    /// Query positions per tile, padded to [`ROWS`] (Br rounded up).
    pub brp: usize,
    /// Key positions per tile, padded to [`LANES`] (Bc rounded up).
    pub bcp: usize,
    /// Head dimension padded to [`LANES`].
    pub dp: usize,
}

impl TileDims {
    pub fn new(shape: AttentionShape, q_tile: usize, kv_tile: usize) -> TileDims {
        TileDims {
            group: shape.num_heads / shape.num_kv_heads,
            brp: round_up(q_tile, ROWS),
            bcp: round_up(kv_tile, LANES),
            dp: round_up(shape.head_dim, LANES),
        }
    }

    /// Rows of the query tile: G heads × Br positions.
    pub fn rows(&self) -> usize {
        self.group * self.brp
    }

    /// f32 elements of one task's output tile `o` [rows, dp].
    pub fn out_len(&self) -> usize {
        self.rows() * self.dp
    }
}

/// One worker's tiles (its "shared memory"), reused from task to task.
pub struct Tiles {
    pub q: Vec<f32>,  // [rows, dp]
    pub kt: Vec<f32>, // [dp, bcp]
    pub v: Vec<f32>,  // [bcp, dp]
    pub s: Vec<f32>,  // [rows, bcp]
}

impl Tiles {
    pub fn new(dims: TileDims) -> Tiles {
        Tiles {
            q: vec![0.0; dims.rows() * dims.dp],
            kt: vec![0.0; dims.dp * dims.bcp],
            v: vec![0.0; dims.bcp * dims.dp],
            s: vec![0.0; dims.rows() * dims.bcp],
        }
    }
}

/// K and V of positions `start..start + len` of KV head `kv` into `kt` [dp, bcp] (transposed)
/// and `v` [bcp, dp], widened to f32 (and multiplied by their scales); columns (rows of `v`) from `len` on are zeroed.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn load_kv_tile<K: ToF32>(
    kv: &LayerKv<K>,
    blocks: &[BlockId],
    kv_head: usize,
    start: usize,
    len: usize,
    dims: TileDims,
    kt: &mut [f32],
    v: &mut [f32],
) {
    let (d, kv_dim) = (kv.shape.head_dim, kv.kv_dim());
    let (bcp, dp) = (dims.bcp, dims.dp);
    for (j0, slot0, run) in slot_runs(blocks, kv.block_size, start, len) {
        for i in 0..run {
            let (j, slot) = (j0 + i, slot0 + i);
            let at = slot * kv_dim + kv_head * d;
            let (k_scale, v_scale) = (kv.scales.key(slot, kv_head), kv.scales.value(slot, kv_head));
            for (x, k) in kv.keys[at..at + d].iter().enumerate() {
                kt[x * bcp + j] = k.to_f32() * k_scale;
            }
            for (dst, val) in v[j * dp..j * dp + d].iter_mut().zip(&kv.values[at..at + d]) {
                *dst = val.to_f32() * v_scale;
            }
        }
    }
    if len < bcp {
        for x in 0..d {
            kt[x * bcp + len..(x + 1) * bcp].fill(0.0);
        }
        v[len * dp..].fill(0.0);
    }
}

// ANCHOR: scores
/// `S = Q Kᵀ`: `q` [rows, dp], `kt` [dp, bcp] → `s` [rows, bcp], a register block of 4 rows ×
/// 16 columns at a time (8 vector accumulators with AVX2, 4 with AVX-512), so that every K
/// element loaded serves 4 rows.
#[inline(always)]
pub fn scores<const FMA: bool>(q: &[f32], kt: &[f32], s: &mut [f32], dp: usize, bcp: usize) {
    for (q4, s4) in q
        .chunks_exact(ROWS * dp)
        .zip(s.chunks_exact_mut(ROWS * bcp))
    {
        for j in (0..bcp).step_by(LANES) {
            let mut acc = [[0.0f32; LANES]; ROWS];
            for x in 0..dp {
                let k: &[f32; LANES] = kt[x * bcp + j..][..LANES].try_into().expect("16 wide");
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let q_rx = q4[r * dp + x];
                    for l in 0..LANES {
                        acc_r[l] = madd::<FMA>(acc_r[l], q_rx, k[l]);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                s4[r * bcp + j..][..LANES].copy_from_slice(acc_r);
            }
        }
    }
}
// ANCHOR_END: scores

// ANCHOR: accumulate_pv
/// `O += P V` over the first `cols` columns of `p` [rows, bcp] and rows of `v` [bcp, dp] →
/// `o` [rows, dp], 4 rows × 16 output columns held in registers while `j` runs.
#[inline(always)]
pub fn accumulate_pv<const FMA: bool>(
    p: &[f32],
    v: &[f32],
    o: &mut [f32],
    dp: usize,
    bcp: usize,
    cols: usize,
) {
    for (p4, o4) in p
        .chunks_exact(ROWS * bcp)
        .zip(o.chunks_exact_mut(ROWS * dp))
    {
        for x in (0..dp).step_by(LANES) {
            let mut acc = [[0.0f32; LANES]; ROWS];
            for (r, acc_r) in acc.iter_mut().enumerate() {
                acc_r.copy_from_slice(&o4[r * dp + x..][..LANES]);
            }
            for j in 0..cols {
                let v_j: &[f32; LANES] = v[j * dp + x..][..LANES].try_into().expect("16 wide");
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let p_rj = p4[r * bcp + j];
                    for l in 0..LANES {
                        acc_r[l] = madd::<FMA>(acc_r[l], p_rj, v_j[l]);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                o4[r * dp + x..][..LANES].copy_from_slice(acc_r);
            }
        }
    }
}
// ANCHOR_END: accumulate_pv

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_runs_follow_the_block_table() {
        let runs: Vec<_> = slot_runs(&[5, 2, 7], 4, 3, 7).collect();
        // positions 3 | 4 5 6 7 | 8 9: block 5 offset 3, block 2 whole, block 7 offsets 0-1
        assert_eq!(runs, vec![(0, 23, 1), (1, 8, 4), (5, 28, 2)]);
    }

    #[test]
    fn the_register_blocked_products_are_matrix_products() {
        let (rows, dp, bcp) = (8, 16, 32);
        let q: Vec<f32> = (0..rows * dp).map(|i| (i % 7) as f32 - 3.0).collect();
        let kt: Vec<f32> = (0..dp * bcp).map(|i| (i % 5) as f32 - 2.0).collect();
        let mut s = vec![0.0; rows * bcp];
        scores::<false>(&q, &kt, &mut s, dp, bcp);
        for r in 0..rows {
            for j in 0..bcp {
                let e: f32 = (0..dp).map(|x| q[r * dp + x] * kt[x * bcp + j]).sum();
                assert_eq!(s[r * bcp + j], e);
            }
        }
        let v: Vec<f32> = (0..bcp * dp).map(|i| (i % 3) as f32).collect();
        let mut o = vec![1.0; rows * dp];
        accumulate_pv::<false>(&s, &v, &mut o, dp, bcp, 20);
        for r in 0..rows {
            for x in 0..dp {
                let e: f32 = 1.0 + (0..20).map(|j| s[r * bcp + j] * v[j * dp + x]).sum::<f32>();
                assert_eq!(o[r * dp + x], e);
            }
        }
    }
}
