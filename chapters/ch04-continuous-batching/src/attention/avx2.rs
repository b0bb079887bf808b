//! One task of [`batch_attention`](super::batch_attention) with AVX2 + FMA intrinsics, for the
//! head sizes 64 and 128 (SmolLM2's and Llama's): the arithmetic of
//! [`attend_row`](super::attend_row), with three costs of the portable loops removed.
//!
//! - **Fused multiply-adds.** Rust does not fuse `a += b · c` by itself (it would change
//!   results), so the portable loops issue a multiply and an add per lane; here one
//!   `vfmadd` does both, rounding once.
//! - **One horizontal sum for eight scores.** A score is the sum of the 8 lanes of its
//!   accumulator. Reducing eight accumulators one at a time costs more instructions than the
//!   products (d = 64: 64 fused multiply-adds per eight positions, ~120 instructions of lane
//!   sums); three rounds of pairwise horizontal adds reduce all eight at once ([`lane_sums`]).
//! - **K/V rows located once per KV head.** The `G` query heads that share a KV head read the
//!   same eight rows one after the other while they sit in L1.
//!
//! ```text
//! for each group of 8 positions, for each KV head g, for each of g's query heads h:
//!     acc[p] (8 lanes)  += q_h[c..c+8] ⊙ k_p[c..c+8]       c = 0, 8, ..., d − 8   (FMA)
//!     s[h][j..j+8]       = lane_sums(acc) · (1/√d · key scale)
//! softmax per head, times V's scale; zero for the padding
//! for each span of 64 positions, KV head g, group of 8 positions of the span, g's query head h:
//!     out_h[c..c+8]     += Σ_p p[h][j+p] · v_p[c..c+8]                    (FMA, p in order)
//! ```
//!
//! The task itself (slots, prefetching, softmax, which heads go together) is [`row_task`],
//! shared with the AVX-512 task (`avx512.rs`); the loops over a batch of heads are a
//! [`HeadLoops`], [`Avx2Loops`] here.
//!
//! Sums are grouped differently from the portable loops (a tree across lanes, one rounding
//! per product and addition), so results agree with them and with the naive attention to a
//! few ulp rather than bit for bit; every row of a step computes the same way whichever batch
//! it is in.

use std::arch::x86_64::*;
use std::ops::Range;

use ch02::kernels::Avx2Fma;
use ch02::kernels::vector::{KEYS, PREFETCH_POSITIONS, softmax};
use ch03::KvElement;

use super::widen::widen;
use super::{RowQuery, RowScratch, prefetch_rows, slots as slots_of};

/// Lanes per vector.
pub(super) const LANES: usize = 8;

/// The head sizes this path is compiled for (each its own copy of the loops, unrolled).
pub(super) const HEAD_DIMS: [usize; 2] = [64, 128];

/// `out_r` [num_heads · d] = the attention of the query row `query.q` [num_heads · d] at its
/// position, as [`attend_row`](super::attend_row) computes it, in the thread's `scratch`.
///
/// Panics unless `d` (the shape's `head_dim`) is one of [`HEAD_DIMS`] and `query.q` and
/// `out_r` hold `num_heads · d` values.
pub(super) fn attend_row<K: KvElement>(
    cpu: Avx2Fma,
    query: RowQuery<K>,
    out_r: &mut [f32],
    scratch: &mut RowScratch,
) {
    attend_row_on(Avx2Loops(cpu), query, out_r, scratch);
}

/// The inner loops of a task with intrinsics, over a batch of the query heads that share one
/// KV head (consecutive heads, at most [`HeadLoops::SCORE_HEADS`] or
/// [`HeadLoops::value_heads`] of them). Implementations differ in registers, never in
/// arithmetic: each lane computes the same fused multiply-adds in the same order.
pub(super) trait HeadLoops: Copy {
    /// The most query heads one call of [`HeadLoops::score_heads`] takes.
    const SCORE_HEADS: usize;

    /// The most query heads one call of [`HeadLoops::weigh_values`] takes at head size `d`.
    fn value_heads(d: usize) -> usize;

    /// The scores of the heads `q` [heads · d] against the eight K rows `k`: `s[at + h ·
    /// stride..][..8]` = lane sums of `q_h ⊙ k_p` (FMA over the chunks in order), times
    /// `key_scale`.
    fn score_heads<K: KvElement, const CHUNKS: usize>(
        self,
        k: &[&[[K; LANES]; CHUNKS]; KEYS],
        q: &[f32],
        key_scale: &[f32; KEYS],
        s: &mut [f32],
        at: usize,
        stride: usize,
    );

    /// `out` [heads · d] += Σ_j w[h · stride + j] · v_j, one fused multiply-add per position j
    /// of `positions` in order (stride = `slots.len()`), v_j the `d` values at `offset` of
    /// `slot_j`'s row in `stored` [slots, kv_dim]. `positions` starts and ends at multiples of
    /// [`KEYS`]. With `ahead` = `Some(len)`, it asks for whole rows of the first
    /// `len` slots some positions ahead ([`ask_ahead`]).
    fn weigh_values<K: KvElement, const CHUNKS: usize>(
        self,
        values: (&[K], usize, usize),
        at: (&[usize], Range<usize>),
        ahead: Option<usize>,
        w: &[f32],
        out: &mut [f32],
    );

    /// [`row_task`] with these loops, compiled for their instruction set so that they inline
    /// into it; `CHUNKS` 8-lane chunks a head.
    fn task<K: KvElement, const CHUNKS: usize>(
        self,
        query: RowQuery<K>,
        out_r: &mut [f32],
        scratch: &mut RowScratch,
    );
}

/// Positions of a values' pass: spans of 64 (a multiple of [`KEYS`]), whose V rows, 48 KiB at
/// most for SmolLM2's f32 pool, stay in cache from one KV head's pass to the next.
const V_SPAN: usize = 8 * KEYS;

/// Asks for the whole rows of `slots[j + PREFETCH_POSITIONS..][..8]` (those below `len`) in
/// `stored` [slots, kv_dim]: what the scores pass (K) or the values' passes (V) read some
/// positions later.
#[inline(always)]
pub(super) fn ask_ahead<K>(stored: &[K], kv_dim: usize, slots: &[usize], len: usize, j: usize) {
    let next = (j + PREFETCH_POSITIONS).min(len)..(j + PREFETCH_POSITIONS + KEYS).min(len);
    prefetch_rows(stored, &mut slots[next].iter().copied(), KEYS, kv_dim);
}

/// [`attend_row`] on `loops` (which hold the proof of their instruction set).
pub(super) fn attend_row_on<K: KvElement, L: HeadLoops>(
    loops: L,
    query: RowQuery<K>,
    out_r: &mut [f32],
    scratch: &mut RowScratch,
) {
    let (kv, q_r) = (query.kv, query.q);
    let q_dim = kv.shape.num_heads * kv.shape.head_dim;
    assert_eq!(
        (q_r.len(), out_r.len()),
        (q_dim, q_dim),
        "rows are [num_heads · d]"
    );
    match kv.shape.head_dim {
        64 => loops.task::<K, 8>(query, out_r, scratch),
        128 => loops.task::<K, 16>(query, out_r, scratch),
        d => panic!("head size {d} is not one of {HEAD_DIMS:?}"),
    }
}

/// The task around the loops, shared by both instruction sets: the slots of the row's
/// positions, the requests ahead, the scores pass, the softmax with V's scale folded into the
/// weights, and the values' pass, each over batches of the query heads that share a KV head.
/// Inlined into each set's [`HeadLoops::task`], which compiles it for that set.
#[inline(always)]
pub(super) fn row_task<K: KvElement, L: HeadLoops, const CHUNKS: usize>(
    loops: L,
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
    let d = kv.shape.head_dim;
    let group_size = kv.shape.num_heads / kv.shape.num_kv_heads; // query heads per KV head
    let kv_dim = kv.shape.num_kv_heads * d;
    let len = row.pos + 1; // positions this row sees
    let stride = len.next_multiple_of(KEYS); // positions padded to whole groups
    let scale = 1.0 / (d as f32).sqrt();
    debug_assert_eq!(d, CHUNKS * LANES);
    // The pool slots of positions 0..len, then the last one repeated up to `stride`: a last
    // group short of eight reads its last row again (scored into the padding, weighted by zero).
    let RowScratch { scores, slots } = scratch;
    slots.clear();
    slots.extend(slots_of(row.blocks, kv.block_size, len));
    slots.resize(stride, slots[len - 1]);
    scores.clear();
    scores.resize(kv.shape.num_heads * stride, 0.0); // [num_heads, stride]
    let slots = &slots[..];
    // Asks for the rows of `stored` that the first groups read, before a pass starts.
    let ask_first = |stored: &[K]| {
        let first_rows = &slots[..PREFETCH_POSITIONS.min(len)];
        prefetch_rows(
            stored,
            &mut first_rows.iter().copied(),
            PREFETCH_POSITIONS,
            kv_dim,
        );
    };
    // The query heads of KV head `g`, in batches of at most `most` (a plain range mapped, not
    // `step_by`, whose set-up in these inner loops showed in profiles).
    let batches = |g: usize, most: usize| {
        let end = (g + 1) * group_size;
        (0..group_size.div_ceil(most)).map(move |b| {
            let start = g * group_size + b * most;
            start..start.saturating_add(most).min(end)
        })
    };

    // s[h][j..j+8] = q_h · k_{j..j+8} / √d, times K's scale (1 unless the pool is 8-bit).
    if prefetch {
        ask_first(kv.keys);
    }
    for j in (0..len).step_by(KEYS) {
        if prefetch {
            ask_ahead(kv.keys, kv_dim, slots, len, j);
        }
        let group: &[usize; KEYS] = slots[j..j + KEYS].try_into().unwrap();
        for g in 0..kv.shape.num_kv_heads {
            let k: [&[[K; LANES]; CHUNKS]; KEYS] =
                std::array::from_fn(|p| head_row(kv.keys, group[p] * kv_dim + g * d));
            // Unscaled pools (f32, bf16) multiply by 1 exactly: skipped, with its lookups.
            let key_scale: [f32; KEYS] = if K::SCALED {
                std::array::from_fn(|p| scale * kv.scales.key(group[p], g))
            } else {
                [scale; KEYS]
            };
            for heads in batches(g, L::SCORE_HEADS) {
                let q = &q_r[heads.start * d..heads.end * d];
                let at = heads.start * stride + j; // s[heads.start][j]
                loops.score_heads(&k, q, &key_scale, scores, at, stride);
            }
        }
    }
    if prefetch {
        ask_first(kv.values); // while the softmax computes
    }
    // p[h] = softmax(s[h]) over the positions the row sees, times V's scale (1 unless the pool
    // is 8-bit); the padding weighs zero.
    for (h, s_h) in scores.chunks_exact_mut(stride).enumerate() {
        let g = h / group_size;
        softmax(&mut s_h[..len]);
        if K::SCALED {
            for (p, &slot) in s_h[..len].iter_mut().zip(slots) {
                *p *= kv.scales.value(slot, g);
            }
        }
        s_h[len..].fill(0.0);
    }

    // out_h = Σ_j p[h][j] · v_j, one position after another. The positions go in spans of
    // V_SPAN, each span in a pass per KV head (and batch of its query heads): the first pass
    // asks ahead for whole rows, and the later ones find the span's rows in cache, so V streams
    // from memory once, in order, however long the context.
    out_r.fill(0.0);
    for span in (0..stride).step_by(V_SPAN) {
        let positions = span..(span + V_SPAN).min(stride);
        debug_assert!(positions.start % KEYS == 0 && positions.end % KEYS == 0);
        for g in 0..kv.shape.num_kv_heads {
            for (batch, heads) in batches(g, L::value_heads(d)).enumerate() {
                let first = g == 0 && batch == 0;
                let ahead = (prefetch && first).then_some(len);
                let out = &mut out_r[heads.start * d..heads.end * d];
                let w = &scores[heads.start * stride..heads.end * stride];
                let values = (kv.values, kv_dim, g * d);
                let at = (slots, positions.clone());
                loops.weigh_values::<K, CHUNKS>(values, at, ahead, w, out);
            }
        }
    }
}

/// The AVX2 loops: one query head at a time, its eight score accumulators and a query chunk
/// in 16 registers.
#[derive(Debug, Clone, Copy)]
struct Avx2Loops(Avx2Fma);

impl HeadLoops for Avx2Loops {
    const SCORE_HEADS: usize = usize::MAX; // one at a time, whatever the batch
    fn value_heads(_d: usize) -> usize {
        usize::MAX
    }

    #[inline]
    fn score_heads<K: KvElement, const CHUNKS: usize>(
        self,
        k: &[&[[K; LANES]; CHUNKS]; KEYS],
        q: &[f32],
        key_scale: &[f32; KEYS],
        s: &mut [f32],
        at: usize,
        stride: usize,
    ) {
        // SAFETY: `self.0` proves the CPU has AVX2 and FMA.
        unsafe { score_heads_avx2(k, q, key_scale, s, at, stride) }
    }

    #[inline]
    fn weigh_values<K: KvElement, const CHUNKS: usize>(
        self,
        values: (&[K], usize, usize),
        at: (&[usize], Range<usize>),
        ahead: Option<usize>,
        w: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: `self.0` proves the CPU has AVX2 and FMA.
        unsafe { weigh_values_avx2::<K, CHUNKS>(values, at, ahead, w, out) }
    }

    fn task<K: KvElement, const CHUNKS: usize>(
        self,
        query: RowQuery<K>,
        out_r: &mut [f32],
        scratch: &mut RowScratch,
    ) {
        #[target_feature(enable = "avx2,fma")]
        fn task_avx2<K: KvElement, const CHUNKS: usize>(
            loops: Avx2Loops,
            query: RowQuery<K>,
            out_r: &mut [f32],
            scratch: &mut RowScratch,
        ) {
            row_task::<K, Avx2Loops, CHUNKS>(loops, query, out_r, scratch)
        }
        // SAFETY: `self.0` proves the CPU has AVX2 and FMA.
        unsafe { task_avx2::<K, CHUNKS>(self, query, out_r, scratch) }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn score_heads_avx2<K: KvElement, const CHUNKS: usize>(
    k: &[&[[K; LANES]; CHUNKS]; KEYS],
    q: &[f32],
    key_scale: &[f32; KEYS],
    s: &mut [f32],
    at: usize,
    stride: usize,
) {
    // ANCHOR: scores
    debug_assert_eq!(q.len() % (CHUNKS * LANES), 0, "q is [heads · d]");
    for (h, q_h) in q.chunks_exact(CHUNKS * LANES).enumerate() {
        let q_h: &[[f32; LANES]; CHUNKS] = head_row(q_h, 0);
        let mut acc = [_mm256_setzero_ps(); KEYS];
        for c in 0..CHUNKS {
            let q_c = load(&q_h[c]);
            for p in 0..KEYS {
                acc[p] = _mm256_fmadd_ps(q_c, widen(&k[p][c]), acc[p]);
            }
        }
        let scores = _mm256_mul_ps(lane_sums(acc), load(key_scale));
        store(
            scores,
            (&mut s[at + h * stride..][..KEYS]).try_into().unwrap(),
        );
    }
    // ANCHOR_END: scores
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn weigh_values_avx2<K: KvElement, const CHUNKS: usize>(
    (stored, kv_dim, offset): (&[K], usize, usize),
    (slots, positions): (&[usize], Range<usize>),
    ahead: Option<usize>,
    w: &[f32],
    out: &mut [f32],
) {
    let (d, stride) = (CHUNKS * LANES, slots.len());
    // Eight positions at a time: each output chunk is loaded, takes eight multiply-adds and
    // is stored again.
    for j in positions.step_by(KEYS) {
        if let Some(len) = ahead {
            ask_ahead(stored, kv_dim, slots, len, j);
        }
        let v: [&[[K; LANES]; CHUNKS]; KEYS] =
            std::array::from_fn(|p| head_row(stored, slots[j + p] * kv_dim + offset));
        for (h, out_h) in out.chunks_exact_mut(d).enumerate() {
            let w: [__m256; KEYS] = std::array::from_fn(|p| _mm256_set1_ps(w[h * stride + j + p]));
            let out_h: &mut [[f32; LANES]; CHUNKS] = out_h.as_chunks_mut().0.try_into().unwrap();
            for (c, o) in out_h.iter_mut().enumerate() {
                let mut acc = load(o);
                for p in 0..KEYS {
                    acc = _mm256_fmadd_ps(w[p], widen(&v[p][c]), acc);
                }
                store(acc, o);
            }
        }
    }
}

/// The head row starting at `at` in `stored`, as `CHUNKS` groups of `N` (8 here; checked once
/// here, so that the loops index it without checks).
#[inline]
pub(super) fn head_row<T, const N: usize, const CHUNKS: usize>(
    stored: &[T],
    at: usize,
) -> &[[T; N]; CHUNKS] {
    stored[at..][..CHUNKS * N].as_chunks().0.try_into().unwrap()
}

// ANCHOR: lane_sums
/// `[Σ a[0], Σ a[1], ..., Σ a[7]]`, each the sum of one vector's 8 lanes: two rounds of
/// pairwise horizontal adds leave each vector's sum in two halves, one per 128-bit lane, and
/// one exchange of halves adds them.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn lane_sums(a: [__m256; KEYS]) -> __m256 {
    // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]
    let a01 = _mm256_hadd_ps(a[0], a[1]);
    let a23 = _mm256_hadd_ps(a[2], a[3]);
    let a45 = _mm256_hadd_ps(a[4], a[5]);
    let a67 = _mm256_hadd_ps(a[6], a[7]);
    // [Σ0..3 of a0, a1, a2, a3 | Σ4..7 of a0, a1, a2, a3], and the same for a4..a7
    let a0123 = _mm256_hadd_ps(a01, a23);
    let a4567 = _mm256_hadd_ps(a45, a67);
    let low = _mm256_permute2f128_ps::<0x20>(a0123, a4567); // the lanes' first halves
    let high = _mm256_permute2f128_ps::<0x31>(a0123, a4567); // their second halves
    _mm256_add_ps(low, high)
}
// ANCHOR_END: lane_sums

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn load(x: &[f32; LANES]) -> __m256 {
    // SAFETY: `x` is 8 readable f32 (an unaligned load).
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn store(v: __m256, x: &mut [f32; LANES]) {
    // SAFETY: `x` is 8 writable f32 (an unaligned store).
    unsafe { _mm256_storeu_ps(x.as_mut_ptr(), v) }
}
