//! A whole step's flash attention: the step's rows grouped into sequences, cut into tasks
//! (query tiles × KV heads for prefill chunks, partitions for decodes), the tasks
//! run in one parallel pass, then each output row assembled.
//!
//! ```text
//! rows (flattened, as chapter 4's executor hands them)
//!   seq A: positions 7..=40  → prefill tasks: ⌈34 / Br⌉ query tiles × KV heads
//!   seq B: position  900     → decode tasks: one per partition, every head    (split-K)
//! phase 1 (parallel): every task → its own region of `prefill_out` or `partials`
//! phase 2 (parallel over rows): copy a prefill row's outputs; merge a decode row's partitions
//! ```
//!
//! Every buffer lives in a [`Scratch`] that the caller keeps from step to step: once it has
//! grown to a step's size, a decode step allocates nothing (the tests count allocations).
//! Prefill tasks take their tiles from one allocation per worker per call.

use ch01::attention::AttentionShape;
use ch02::kernels::Isa;
use ch03::KvElement;
use ch04::attention::QueryRow;
use rayon::prelude::*;

use crate::decode::{CHUNK, DecodeTask, decode_task, partial_len, partition, read_partial};
use crate::online::{RowStats, finish, merge_into};
use crate::prefill::{PrefillTask, prefill_task};
use crate::tile::{LayerKv, TileDims, Tiles};

/// A parameter that must be at least 1 was 0.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamError {
    #[error("tile sizes must be at least 1 (got q {q}, kv {kv})")]
    ZeroTile { q: usize, kv: usize },
    #[error("a split-K decode needs at least 1 partition")]
    ZeroPartitions,
}

/// Br and Bc: query and key positions per tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileSizes {
    q: usize,
    kv: usize,
}

impl TileSizes {
    /// Measured on the benchmark's machine (`kiln bench ch07`): 32 query positions (× the G
    /// heads of a KV head) by 64 keys keep a task's tiles within a core's L2 cache.
    pub const DEFAULT: TileSizes = TileSizes { q: 32, kv: 64 };

    pub fn new(q: usize, kv: usize) -> Result<TileSizes, ParamError> {
        if q == 0 || kv == 0 {
            return Err(ParamError::ZeroTile { q, kv });
        }
        Ok(TileSizes { q, kv })
    }

    pub fn q(&self) -> usize {
        self.q
    }

    pub fn kv(&self) -> usize {
        self.kv
    }
}

impl Default for TileSizes {
    fn default() -> Self {
        TileSizes::DEFAULT
    }
}

/// How many partitions a decode row's keys are cut into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Partitions {
    /// Enough tasks for every core (4 per thread over the step's decode rows), but no
    /// partition under [`MIN_PARTITION`] keys.
    #[default]
    Auto,
    /// This many (≥ 1), but never more than a row's keys (more would only be empty).
    Fixed(usize),
}

/// The shortest partition [`Partitions::Auto`] makes: below it, merging costs more than the
/// parallelism gains.
pub const MIN_PARTITION: usize = 256;

impl Partitions {
    pub fn fixed(n: usize) -> Result<Partitions, ParamError> {
        if n == 0 {
            return Err(ParamError::ZeroPartitions);
        }
        Ok(Partitions::Fixed(n))
    }

    /// Partitions of a decode row with `len` keys in a step whose every partition index makes
    /// `tasks_per_partition` tasks (one per decode row: a task covers all of a row's KV heads).
    pub fn count(&self, len: usize, tasks_per_partition: usize) -> usize {
        match *self {
            Partitions::Fixed(n) => n.max(1),
            Partitions::Auto => {
                let wanted =
                    (4 * rayon::current_num_threads()).div_ceil(tasks_per_partition.max(1));
                wanted.min(len / MIN_PARTITION).max(1)
            }
        }
    }
}

/// Everything that decides how flash attention cuts the work (never what it computes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlashParams {
    pub tiles: TileSizes,
    pub partitions: Partitions,
}

/// Whether row `b` continues row `a`'s group: the same sequence (rows of one sequence share its
/// block table), the next position.
fn continues(a: &QueryRow, b: &QueryRow) -> bool {
    a.same_sequence(b) && b.pos == a.pos + 1
}

/// The end of the group that starts at row `r`: consecutive rows of one sequence at consecutive
/// positions.
fn group_end(rows: &[QueryRow], r: usize) -> usize {
    let mut end = r + 1;
    while end < rows.len() && continues(&rows[end - 1], &rows[end]) {
        end += 1;
    }
    end
}

/// How many of the step's groups are one row (decodes, which split-K may partition).
pub fn decode_rows(rows: &[QueryRow]) -> usize {
    let mut decodes = 0;
    let mut r = 0;
    while r < rows.len() {
        let end = group_end(rows, r);
        decodes += usize::from(end - r == 1);
        r = end;
    }
    decodes
}

/// What phase 2 does for one row.
#[derive(Debug, Clone, Copy)]
enum RowPlan {
    /// Row `i` of the prefill tasks `task..task + num_kv_heads` (one per KV head).
    Prefill { task: usize, i: usize },
    /// The decode tasks `task..task + parts`, one per partition.
    Decode { task: usize, parts: usize },
}

/// The buffers of [`flash_attention_paged`], kept by the caller from step to step.
#[derive(Default)]
pub struct Scratch {
    plans: Vec<RowPlan>,
    prefill: Vec<PrefillTask>,
    decode: Vec<DecodeTask>,
    prefill_out: Vec<f32>, // [prefill tasks, G, brp, dp]
    partials: Vec<f32>,    // [decode tasks, G, d + 2]
    scores: Vec<f32>,      // [decode tasks, G, CHUNK]
}

impl Scratch {
    pub fn new() -> Scratch {
        Scratch::default()
    }

    /// Bytes its buffers hold now (what the benchmark reports as flash attention's memory).
    pub fn bytes(&self) -> usize {
        self.plans.capacity() * size_of::<RowPlan>()
            + self.prefill.capacity() * size_of::<PrefillTask>()
            + self.decode.capacity() * size_of::<DecodeTask>()
            + (self.prefill_out.capacity() + self.partials.capacity() + self.scores.capacity())
                * size_of::<f32>()
    }

    /// Cuts the step into tasks: consecutive rows of one sequence at consecutive positions are
    /// one group; a group of one row is a decode, of more a prefill chunk.
    fn plan(&mut self, rows: &[QueryRow], shape: AttentionShape, params: &FlashParams) {
        self.plans.clear();
        self.prefill.clear();
        self.decode.clear();
        // First count the decode rows, to know how many share the cores.
        let decodes = decode_rows(rows);
        let kv_heads = shape.num_kv_heads;
        let mut r = 0;
        while r < rows.len() {
            let end = group_end(rows, r);
            if end - r == 1 {
                let len = rows[r].pos + 1;
                // More partitions than keys would only add empty ones (and their scratch).
                let parts = params.partitions.count(len, decodes).min(len);
                self.plans.push(RowPlan::Decode {
                    task: self.decode.len(),
                    parts,
                });
                for p in 0..parts {
                    let (start, end) = partition(len, parts, p);
                    self.decode.push(DecodeTask { row: r, start, end });
                }
            } else {
                for first in (r..end).step_by(params.tiles.q()) {
                    let n = params.tiles.q().min(end - first);
                    let task = self.prefill.len();
                    for kv_head in 0..kv_heads {
                        self.prefill.push(PrefillTask {
                            first_row: first,
                            rows: n,
                            first_pos: rows[first].pos,
                            kv_head,
                        });
                    }
                    self.plans
                        .extend((0..n).map(|i| RowPlan::Prefill { task, i }));
                }
            }
            r = end;
        }
    }
}

/// Grows `buffer` to at least `len` elements (never shrinks it: a kept buffer stops growing).
fn grow(buffer: &mut Vec<f32>, len: usize) {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
}

// ANCHOR: flash_attention_paged
/// `out` [rows, num_heads · d] = attention of each row of `q` [rows, num_heads · d] against
/// positions `0..=pos` of its sequence in `kv`: the same contract as chapter 4's
/// [`batch_attention`](ch04::attention::batch_attention), computed tile by tile.
///
/// Every row's K/V up to its own position must be in `kv` already, and its blocks must cover
/// `pos`. Rows of one sequence at consecutive positions should be consecutive (as chapter 4's
/// executor flattens them) to be tiled together; any order gives the same result.
pub fn flash_attention_paged<K: KvElement>(
    isa: Isa,
    kv: &LayerKv<K>,
    rows: &[QueryRow],
    q: &[f32],
    params: &FlashParams,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let shape = kv.shape;
    let (d, q_dim) = (shape.head_dim, shape.num_heads * shape.head_dim);
    assert_eq!(q.len(), rows.len() * q_dim, "q is [rows, q_dim]");
    assert_eq!(out.len(), q.len(), "out is [rows, q_dim]");
    for row in rows {
        assert!(
            row.pos < row.blocks.len() * kv.block_size,
            "position past the table"
        );
    }
    // Tiles no larger than the step: a query tile past its rows or a K/V tile past its longest
    // context only adds padding (the same results), and would let a parameter size the scratch.
    let longest = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
    let params = &FlashParams {
        tiles: TileSizes {
            q: params.tiles.q().min(rows.len().max(1)),
            kv: params.tiles.kv().min(longest),
        },
        ..*params
    };
    scratch.plan(rows, shape, params);
    let dims = TileDims::new(shape, params.tiles.q(), params.tiles.kv());
    let (out_len, part_len) = (dims.out_len(), partial_len(shape.num_heads, d));
    let Scratch {
        plans,
        prefill,
        decode,
        prefill_out,
        partials,
        scores,
    } = scratch;
    grow(prefill_out, prefill.len() * out_len);
    grow(partials, decode.len() * part_len);
    grow(scores, decode.len() * shape.num_heads * CHUNK);

    // Phase 1: every task, in parallel, into its own region.
    let kv_tile = params.tiles.kv();
    let run_prefill = || {
        if prefill.is_empty() {
            return;
        }
        prefill_out[..prefill.len() * out_len]
            .par_chunks_mut(out_len)
            .zip(prefill.par_iter())
            .for_each_init(
                || (Tiles::new(dims), vec![RowStats::EMPTY; dims.rows()]),
                |(tiles, stats), (o, &task)| {
                    let blocks = rows[task.first_row].blocks;
                    run_prefill_task(isa, kv, blocks, task, q, kv_tile, dims, tiles, stats, o);
                },
            );
    };
    let run_decode = || {
        partials[..decode.len() * part_len]
            .par_chunks_mut(part_len)
            .zip(scores.par_chunks_mut(shape.num_heads * CHUNK))
            .zip(decode.par_iter())
            .for_each(|((partial, s), &task)| {
                let q_r = &q[task.row * q_dim..][..q_dim];
                run_decode_task(isa, kv, rows[task.row].blocks, task, q_r, s, partial);
            });
    };
    rayon::join(run_prefill, run_decode);

    // Phase 2: each output row from its tasks' regions.
    let (group, dp, brp) = (dims.group, dims.dp, dims.brp);
    out.par_chunks_mut(q_dim)
        .zip(plans.par_iter())
        .for_each(|(out_r, &plan)| match plan {
            RowPlan::Prefill { task, i } => {
                for (h, out_h) in out_r.chunks_exact_mut(d).enumerate() {
                    let (kv_head, g) = (h / group, h % group);
                    let region = &prefill_out[(task + kv_head) * out_len..][..out_len];
                    out_h.copy_from_slice(&region[(g * brp + i) * dp..][..d]);
                }
            }
            RowPlan::Decode { task, parts } => {
                for (h, out_h) in out_r.chunks_exact_mut(d).enumerate() {
                    let mut stats = RowStats::EMPTY;
                    out_h.fill(0.0);
                    for p in 0..parts {
                        let region = &partials[(task + p) * part_len..][..part_len];
                        let (part, o_part) = read_partial(region, h, d);
                        merge_into(&mut stats, out_h, part, o_part); // ⊕, by log-sum-exp
                    }
                    finish(stats, out_h);
                }
            }
        });
}
// ANCHOR_END: flash_attention_paged

/// Whether the prefill tasks run their AVX-512 compilation where the CPU has AVX-512F; see
/// [`set_prefill_avx512`].
static PREFILL_AVX512: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `false` makes the prefill tasks run their AVX2 compilation even on a CPU with AVX-512F, for
/// the whole process; the results are the same bits either way (the tests check it). For
/// measuring the difference and for those tests.
pub fn set_prefill_avx512(on: bool) {
    PREFILL_AVX512.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// [`prefill_task`] compiled for AVX2 + FMA when `isa` says the CPU has them, and for AVX-512F
/// as well where the CPU also has that: the same code, whose 16-wide tile rows then take one
/// register instead of two (the same operations in the same order, so the same bits).
#[allow(clippy::too_many_arguments)]
fn run_prefill_task<K: KvElement>(
    isa: Isa,
    kv: &LayerKv<K>,
    blocks: &[ch03::BlockId],
    task: PrefillTask,
    q: &[f32],
    kv_tile: usize,
    dims: TileDims,
    tiles: &mut Tiles,
    stats: &mut [RowStats],
    o: &mut [f32],
) {
    match isa {
        Isa::Portable => {
            prefill_task::<K, false>(kv, blocks, task, q, kv_tile, dims, tiles, stats, o)
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma(_) => {
            // `prefill_task` compiled with each set of features: the same code in both.
            macro_rules! compiled_for {
                ($name:ident, $features:literal) => {
                    #[target_feature(enable = $features)]
                    #[allow(clippy::too_many_arguments)]
                    unsafe fn $name<K: KvElement>(
                        kv: &LayerKv<K>,
                        blocks: &[ch03::BlockId],
                        task: PrefillTask,
                        q: &[f32],
                        kv_tile: usize,
                        dims: TileDims,
                        tiles: &mut Tiles,
                        stats: &mut [RowStats],
                        o: &mut [f32],
                    ) {
                        prefill_task::<K, true>(kv, blocks, task, q, kv_tile, dims, tiles, stats, o)
                    }
                };
            }
            compiled_for!(avx2, "avx2,fma");
            compiled_for!(avx512, "avx512f,avx2,fma");
            if ch02::kernels::Avx512::cached().is_some()
                && PREFILL_AVX512.load(std::sync::atomic::Ordering::Relaxed)
            {
                // SAFETY: an `Avx512` proof exists only once run-time detection found AVX-512F,
                // AVX2 and FMA; `avx512` is safe Rust otherwise.
                return unsafe { avx512(kv, blocks, task, q, kv_tile, dims, tiles, stats, o) };
            }
            // SAFETY: an `Isa::Avx2Fma` exists only once run-time detection found AVX2 and FMA
            // on this CPU (its proof field is private); `avx2` is safe Rust otherwise.
            unsafe { avx2(kv, blocks, task, q, kv_tile, dims, tiles, stats, o) }
        }
    }
}

/// [`decode_task`] compiled for AVX2 + FMA when `isa` says the CPU has them.
fn run_decode_task<K: KvElement>(
    isa: Isa,
    kv: &LayerKv<K>,
    blocks: &[ch03::BlockId],
    task: DecodeTask,
    q_r: &[f32],
    scores: &mut [f32],
    partial: &mut [f32],
) {
    match isa {
        Isa::Portable => decode_task(kv, blocks, task, q_r, scores, partial),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma(_) => {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<K: KvElement>(
                kv: &LayerKv<K>,
                blocks: &[ch03::BlockId],
                task: DecodeTask,
                q_r: &[f32],
                scores: &mut [f32],
                partial: &mut [f32],
            ) {
                decode_task(kv, blocks, task, q_r, scores, partial)
            }
            // SAFETY: as above: the proof in `Isa::Avx2Fma` says the CPU has AVX2 and FMA.
            unsafe { avx2(kv, blocks, task, q_r, scores, partial) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Auto` never cuts a partition shorter than [`MIN_PARTITION`] keys (a row shorter than
    /// that stays whole), and never makes more than the threads want.
    #[test]
    fn auto_partitions_are_never_shorter_than_the_minimum() {
        for len in [1, 255, 256, 257, 511, 512, 1000, 1024, 5000, 100_000] {
            for rows in [1, 2, 7, 64] {
                let count = Partitions::Auto.count(len, rows);
                assert!(count >= 1);
                if count > 1 {
                    assert!(len / count >= MIN_PARTITION, "{len} keys in {count}");
                }
                let wanted = (4 * rayon::current_num_threads()).div_ceil(rows);
                assert!(count <= wanted.max(1), "{len} keys, {rows} rows: {count}");
            }
        }
        assert_eq!(Partitions::Auto.count(257, 1), 1);
    }
}
