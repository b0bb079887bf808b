//! One task of [`batch_attention`](super::batch_attention) on a CPU with AVX-512, for the head
//! sizes 64 and 128: the same arithmetic as the AVX2 task (`avx2.rs`), every rounding in the
//! same order, so the two agree to the bit. What the 32 wide registers change is how often
//! each K/V element is loaded and widened, and whether the outputs stay in registers.
//!
//! A decode reads its K/V from memory, yet the AVX2 task is not waiting on memory alone: in a
//! scratch variant of `examples/batch_decode_attention.rs` that read one layer's K/V over and
//! over (from the L3 cache), a step of 32 sequences at 192 positions took about half as long as
//! the same step reading every layer's K/V from memory. Two of its costs went:
//!
//! - **Scores.** AVX2's 16 registers hold eight scores' accumulators for one query head, so
//!   each of the `G` query heads sharing a KV head loads and widens the same eight K rows again
//!   (`G` = 3 in SmolLM2: three loads and, in a bf16 pool, three conversions per element).
//!   Here the eight rows are widened once per chunk and the accumulators of up to four query
//!   heads stay in registers, two positions' 8-lane accumulators side by side in one 16-lane
//!   register (the lanes of each half compute exactly what the AVX2 task's register did).
//! - **Weighted values.** The AVX2 task adds eight positions into each output chunk, then
//!   stores it and loads it again for the next eight, and widens each V chunk once per query
//!   head. Here the outputs of up to four heads (two at d = 128) stay in 16-lane registers
//!   across a span of 64 positions, and each V chunk is widened once for all of them.
//!
//! ```text
//! for each group of 8 positions, KV head g, batch of g's query heads (≤ 4):
//!     k2[i] = [k_{2i}[c..c+8] | k_{2i+1}[c..c+8]]          widened once, i = 0..4
//!     acc[h][i] += [q_h[c..c+8] | q_h[c..c+8]] ⊙ k2[i]   c = 0, 8, ..., d − 8   (FMA)
//!     s[h][j..j+8] = lane_sums(halves of acc[h]) · (1/√d · key scale)
//! softmax per head; p[h][j] · value scale, zero past the row's last position
//! for each span of 64 positions, KV head g, batch of g's query heads (≤ 4, 2 at d = 128),
//! position j of the span in order:
//!     out[h][c..c+16] += p[h][j] · v_j[c..c+16]           widened once          (FMA)
//! ```

use std::arch::x86_64::*;
use std::ops::Range;

use ch02::kernels::Avx512;
use ch02::kernels::vector::KEYS;
use ch03::KvElement;

use super::avx2::{
    HeadLoops, LANES, ask_ahead, attend_row_on, head_row, lane_sums, load, row_task, store,
};
use super::widen::{widen_pair, widen16};
use super::{RowQuery, RowScratch};

/// Lanes per wide vector.
const WIDE_LANES: usize = 16;

/// `out_r` [num_heads · d] = the attention of the query row `query.q` [num_heads · d] at its
/// position, exactly as the AVX2 task computes it, in the thread's `scratch`.
///
/// Panics unless `d` (the shape's `head_dim`) is one of the AVX2 task's head sizes (64, 128)
/// and `query.q`, `out_r` hold `num_heads · d` values.
pub(super) fn attend_row<K: KvElement>(
    wide: Avx512,
    query: RowQuery<K>,
    out_r: &mut [f32],
    scratch: &mut RowScratch,
) {
    attend_row_on(Avx512Loops(wide), query, out_r, scratch);
}

/// The AVX-512 loops: the scores of up to four query heads in one pass over the K rows, the
/// outputs of up to four heads (two at d = 128) in registers across a span of 64 positions.
#[derive(Debug, Clone, Copy)]
struct Avx512Loops(Avx512);

impl HeadLoops for Avx512Loops {
    // 4 × 4 score accumulators, four K pairs and a query chunk fit the 32 registers.
    const SCORE_HEADS: usize = 4;
    fn value_heads(d: usize) -> usize {
        // 16 registers of outputs and a row's V chunks: 4 × 4 + 4 at d = 64, 2 × 8 + 8 at 128.
        if d <= 64 { 4 } else { 2 }
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
        let at = (at, stride);
        // SAFETY: `self.0` proves the CPU has AVX-512F, AVX2 and FMA.
        unsafe {
            match q.len() / (CHUNKS * LANES) {
                1 => score_heads::<K, CHUNKS, 1>(k, q, key_scale, s, at),
                2 => score_heads::<K, CHUNKS, 2>(k, q, key_scale, s, at),
                3 => score_heads::<K, CHUNKS, 3>(k, q, key_scale, s, at),
                _ => score_heads::<K, CHUNKS, 4>(k, q, key_scale, s, at),
            }
        }
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
        // SAFETY: `self.0` proves the CPU has AVX-512F, AVX2 and FMA.
        unsafe {
            match (CHUNKS, out.len() / (CHUNKS * LANES)) {
                (8, 1) => weigh_values::<K, 4, 1>(values, at, ahead, w, out),
                (8, 2) => weigh_values::<K, 4, 2>(values, at, ahead, w, out),
                (8, 3) => weigh_values::<K, 4, 3>(values, at, ahead, w, out),
                (8, _) => weigh_values::<K, 4, 4>(values, at, ahead, w, out),
                (_, 1) => weigh_values::<K, 8, 1>(values, at, ahead, w, out),
                (_, _) => weigh_values::<K, 8, 2>(values, at, ahead, w, out),
            }
        }
    }

    fn task<K: KvElement, const CHUNKS: usize>(
        self,
        query: RowQuery<K>,
        out_r: &mut [f32],
        scratch: &mut RowScratch,
    ) {
        #[target_feature(enable = "avx512f,avx2,fma")]
        fn task_avx512<K: KvElement, const CHUNKS: usize>(
            loops: Avx512Loops,
            query: RowQuery<K>,
            out_r: &mut [f32],
            scratch: &mut RowScratch,
        ) {
            row_task::<K, Avx512Loops, CHUNKS>(loops, query, out_r, scratch)
        }
        // SAFETY: `self.0` proves the CPU has AVX-512F, AVX2 and FMA.
        unsafe { task_avx512::<K, CHUNKS>(self, query, out_r, scratch) }
    }
}

/// The scores of `HEADS` query heads `q` [HEADS · d] (consecutive, sharing a KV head) against
/// the eight K rows `k`, into `s[at + h · stride..][..8]` for head `h`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn score_heads<K: KvElement, const CHUNKS: usize, const HEADS: usize>(
    k: &[&[[K; LANES]; CHUNKS]; KEYS],
    q: &[f32],
    key_scale: &[f32; KEYS],
    s: &mut [f32],
    (at, stride): (usize, usize),
) {
    let d = CHUNKS * LANES;
    debug_assert_eq!(q.len(), HEADS * d, "q is [HEADS · d]");
    let q: [&[[f32; LANES]; CHUNKS]; HEADS] = std::array::from_fn(|h| head_row(q, h * d));
    // ANCHOR: score_heads
    // acc[h][i]: position 2i's accumulator in the low half, 2i + 1's in the high half.
    let mut acc = [[_mm512_setzero_ps(); KEYS / 2]; HEADS];
    for c in 0..CHUNKS {
        let k2: [__m512; KEYS / 2] =
            std::array::from_fn(|i| widen_pair(&k[2 * i][c], &k[2 * i + 1][c]));
        for h in 0..HEADS {
            let q_c = load(&q[h][c]);
            let q2 = pair(q_c, q_c);
            for i in 0..KEYS / 2 {
                acc[h][i] = _mm512_fmadd_ps(q2, k2[i], acc[h][i]);
            }
        }
    }
    for (h, acc_h) in acc.iter().enumerate() {
        let lanes: [__m256; KEYS] = std::array::from_fn(|p| half(acc_h[p / 2], p % 2));
        let scores = _mm256_mul_ps(lane_sums(lanes), load(key_scale));
        store(
            scores,
            (&mut s[at + h * stride..][..KEYS]).try_into().unwrap(),
        );
    }
    // ANCHOR_END: score_heads
}

/// `out` [HEADS · d] += Σ_j w[h · stride + j] · v_j for every head `h`, over the positions j
/// of `positions` in order (stride = `slots.len()`), v_j the `d` values at `offset` of
/// `slot_j`'s row in `stored` [slots, kv_dim]; each V chunk widened once for every head. With
/// `ahead` = `Some(len)`, it asks for whole rows of the first `len` slots some positions ahead
/// ([`ask_ahead`]).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn weigh_values<K: KvElement, const WIDE: usize, const HEADS: usize>(
    (stored, kv_dim, offset): (&[K], usize, usize),
    (slots, positions): (&[usize], Range<usize>),
    ahead: Option<usize>,
    w: &[f32],
    out: &mut [f32],
) {
    debug_assert_eq!(out.len(), HEADS * WIDE * WIDE_LANES, "out is [HEADS · d]");
    let stride = slots.len();
    let out: &mut [[f32; WIDE_LANES]] = out.as_chunks_mut().0;
    // The outputs so far, in registers for the whole span.
    let mut acc = [[_mm512_setzero_ps(); WIDE]; HEADS];
    for (a, o) in acc.as_flattened_mut().iter_mut().zip(out.iter()) {
        // SAFETY: `o` is 16 readable f32 (an unaligned load).
        *a = unsafe { _mm512_loadu_ps(o.as_ptr()) };
    }
    for j in positions {
        if let Some(len) = ahead
            && j % KEYS == 0
        {
            ask_ahead(stored, kv_dim, slots, len, j);
        }
        let v: &[[K; WIDE_LANES]; WIDE] = head_row(stored, slots[j] * kv_dim + offset);
        let v: [__m512; WIDE] = std::array::from_fn(|c| widen16(&v[c]));
        for (h, acc_h) in acc.iter_mut().enumerate() {
            let w_h = _mm512_set1_ps(w[h * stride + j]);
            for c in 0..WIDE {
                acc_h[c] = _mm512_fmadd_ps(w_h, v[c], acc_h[c]);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc.as_flattened()) {
        // SAFETY: `o` is 16 writable f32 (an unaligned store).
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *a) };
    }
}

/// `[a | b]`: `a` in the low eight lanes, `b` in the high eight.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn pair(a: __m256, b: __m256) -> __m512 {
    let low = _mm512_castpd256_pd512(_mm256_castps_pd(a));
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(low, _mm256_castps_pd(b)))
}

/// The low (`which` = 0) or high (1) eight lanes of `a`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn half(a: __m512, which: usize) -> __m256 {
    if which == 0 {
        _mm512_castps512_ps256(a)
    } else {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)))
    }
}
