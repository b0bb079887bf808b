//! The online softmax: a softmax computed one tile of scores at a time, in O(1) state per row.
//!
//! For one query row, after the keys seen so far, the state is
//!
//! ```text
//! m = max_j s_j                  the running maximum
//! l = Σ_j e^(s_j − m)            the running denominator
//! o = Σ_j e^(s_j − m) · v_j      the running output, not yet divided by l     [d]
//! ```
//!
//! and the attention output is `o / l`. A new tile of scores `s'` (with its values `v'`) is
//! folded in by [`online_step`]: with `m' = max(m, max s')` and `α = e^(m − m')`,
//! `l ← α·l + Σ e^(s' − m')` and `o ← α·o + Σ e^(s' − m')·v'`. Two states over disjoint sets of
//! keys combine the same way ([`merge_into`]), which is commutative exactly and associative up
//! to rounding, so the keys may be cut into pieces in any way and the pieces combined in any
//! order: tiles (prefill), partitions (split-K decode).
//!
//! Invariants: `l > 0` exactly when at least one key with a score above −∞ has been seen, and
//! then `m` is finite (a −∞ score, a masked key, weighs 0); the empty state is
//! `(m, l, o) = (−∞, 0, 0)`. No exponent is ever taken of a positive number, so
//! no step overflows, whatever the scores' size (the tests use scores of 10⁴).

use ch02::kernels::vector::{exp, exp_shifted_sum, max};

/// The running maximum and denominator of one row's softmax.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowStats {
    /// `m`: the largest score seen (−∞ before any).
    pub max: f32,
    /// `l`: `Σ e^(s − m)` over the scores seen.
    pub sum: f32,
}

impl RowStats {
    /// No key seen yet.
    pub const EMPTY: RowStats = RowStats {
        max: f32::NEG_INFINITY,
        sum: 0.0,
    };

    pub fn is_empty(&self) -> bool {
        self.sum == 0.0
    }

    /// `ln l + m`: the log of the softmax denominator over every score seen (what a GPU kernel
    /// stores per row for its backward pass, and what split-K partitions are weighted by).
    pub fn log_sum_exp(&self) -> f32 {
        self.max + self.sum.ln()
    }
}

/// `e^(from − to)` for `from <= to`: 1 when they are equal (no rescaling), 0 from −∞.
#[inline(always)]
fn rescale_factor(from: f32, to: f32) -> f32 {
    if from == to {
        1.0
    } else if from == f32::NEG_INFINITY {
        0.0
    } else {
        exp(from - to)
    }
}

// ANCHOR: online_step
/// One tile of one row: folds the scores `s` into `stats`, turning each into its unnormalised
/// probability `e^(s − m')` in place, and returns `α = e^(m − m')`, by which the caller scales
/// the row's output `o` before adding `Σ_j s[j] · v_j`.
#[inline(always)]
pub fn online_step(stats: &mut RowStats, s: &mut [f32]) -> f32 {
    // ANCHOR: task_7_1
    let m_new = stats.max.max(max(s)); // m' = max(m, max s)
    if m_new == f32::NEG_INFINITY {
        // No finite score yet (every one −∞, masked, or NaN): e^(s − m') would be e^(−∞ + ∞) =
        // NaN. A −∞ score weighs 0 and leaves the state empty; a NaN stays NaN.
        s.iter_mut()
            .for_each(|x| *x = if x.is_nan() { *x } else { 0.0 });
        stats.sum += s.iter().sum::<f32>();
        return 1.0;
    }
    let alpha = rescale_factor(stats.max, m_new); // α = e^(m − m')
    let tile_sum = exp_shifted_sum(s, m_new); // s ← e^(s − m'), Σ
    stats.sum = alpha * stats.sum + tile_sum; // l ← α·l + Σ e^(s − m')
    stats.max = m_new;
    alpha
    // ANCHOR_END: task_7_1
}
// ANCHOR_END: online_step

// ANCHOR: merge
/// Combines two states over disjoint sets of keys: `(a, o_a) ← (a, o_a) ⊕ (b, o_b)`.
/// `o_a`, `o_b`: the rows' unnormalised outputs `[d]`.
#[inline(always)]
pub fn merge_into(a: &mut RowStats, o_a: &mut [f32], b: RowStats, o_b: &[f32]) {
    // ANCHOR: task_7_1
    if b.is_empty() {
        return;
    }
    if a.is_empty() {
        *a = b;
        o_a.copy_from_slice(o_b);
        return;
    }
    let m = a.max.max(b.max);
    let (wa, wb) = (rescale_factor(a.max, m), rescale_factor(b.max, m));
    a.sum = a.sum * wa + b.sum * wb; // l = l_a·e^(m_a − m) + l_b·e^(m_b − m)
    a.max = m;
    for (x, &y) in o_a.iter_mut().zip(o_b) {
        *x = *x * wa + y * wb; // o = o_a·e^(m_a − m) + o_b·e^(m_b − m)
    }
    // ANCHOR_END: task_7_1
}
// ANCHOR_END: merge

/// The attention output of a finished row: `o / l` in place (a row that saw no key stays 0).
#[inline(always)]
pub fn finish(stats: RowStats, o: &mut [f32]) {
    if !stats.is_empty() {
        let inv = 1.0 / stats.sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// One row's whole state, owned: what the property tests and the book's worked example use.
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    pub stats: RowStats,
    /// Unnormalised output `[d]`.
    pub o: Vec<f32>,
}

impl Partial {
    pub fn empty(d: usize) -> Partial {
        Partial {
            stats: RowStats::EMPTY,
            o: vec![0.0; d],
        }
    }

    /// The state after the keys with `scores` and `values` [len, d] (one tile, folded in one step).
    pub fn of_tile(scores: &[f32], values: &[f32], d: usize) -> Partial {
        let mut partial = Partial::empty(d);
        partial.absorb(scores, values);
        partial
    }

    /// Folds in one more tile: `scores` `[len]`, `values` `[len, d]`.
    pub fn absorb(&mut self, scores: &[f32], values: &[f32]) {
        let d = self.o.len();
        assert_eq!(values.len(), scores.len() * d, "values are [len, d]");
        let mut p = scores.to_vec();
        let alpha = online_step(&mut self.stats, &mut p);
        self.o.iter_mut().for_each(|x| *x *= alpha);
        for (&p_j, v_j) in p.iter().zip(values.chunks_exact(d.max(1))) {
            ch02::kernels::vector::axpy(p_j, v_j, &mut self.o);
        }
    }

    /// `self ⊕ other`.
    pub fn merge(&self, other: &Partial) -> Partial {
        let mut out = self.clone();
        merge_into(&mut out.stats, &mut out.o, other.stats, &other.o);
        out
    }

    /// The normalised output `o / l` `[d]`.
    pub fn output(&self) -> Vec<f32> {
        let mut o = self.o.clone();
        finish(self.stats, &mut o);
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_tiles_merge_to_the_softmax_of_both() {
        // The book's worked example: scores (1, 2) then (3, 0), values 10, 20, 30, 40.
        let a = Partial::of_tile(&[1.0, 2.0], &[10.0, 20.0], 1);
        let b = Partial::of_tile(&[3.0, 0.0], &[30.0, 40.0], 1);
        let merged = a.merge(&b);
        let e = [1f64, 2.0, 3.0, 0.0].map(f64::exp);
        let expected =
            (10.0 * e[0] + 20.0 * e[1] + 30.0 * e[2] + 40.0 * e[3]) / e.iter().sum::<f64>();
        assert!((merged.output()[0] as f64 - expected).abs() < 1e-4 * expected);
        assert_eq!(merged.stats.max, 3.0);
        // The same as folding the second tile into the first.
        let mut folded = a.clone();
        folded.absorb(&[3.0, 0.0], &[30.0, 40.0]);
        assert!((folded.output()[0] - merged.output()[0]).abs() < 1e-4);
    }

    #[test]
    fn empty_states_are_the_identity() {
        let a = Partial::of_tile(&[0.5, -1.0], &[1.0, 2.0, 3.0, 4.0], 2);
        let empty = Partial::empty(2);
        assert_eq!(a.merge(&empty), a);
        assert_eq!(empty.merge(&a), a);
        assert_eq!(empty.merge(&empty), empty);
        assert_eq!(empty.output(), vec![0.0, 0.0]);
    }

    #[test]
    fn a_tile_of_only_masked_scores_weighs_nothing() {
        // −∞ is how a mask reads as a score (chapter 1's oracle): a tile of nothing else, before
        // any finite score, once gave e^(−∞ − (−∞)) = NaN and poisoned the whole row.
        let ninf = f32::NEG_INFINITY;
        let mut row = Partial::of_tile(&[ninf, ninf], &[1.0, 2.0, 3.0, 4.0], 2);
        assert_eq!(row, Partial::empty(2));
        row.absorb(&[0.5, ninf], &[5.0, 6.0, 7.0, 8.0]);
        assert_eq!(row.output(), vec![5.0, 6.0]);
        let masked_first = Partial::of_tile(&[ninf], &[9.0, 9.0], 2);
        let one = Partial::of_tile(&[0.5], &[5.0, 6.0], 2);
        assert_eq!(masked_first.merge(&one).output(), vec![5.0, 6.0]);
        // A NaN score is not a mask: it still reaches the output.
        let mut nan = Partial::of_tile(&[f32::NAN, ninf], &[1.0, 2.0, 3.0, 4.0], 2);
        nan.absorb(&[0.5], &[5.0, 6.0]);
        assert!(nan.output().iter().all(|x| x.is_nan()));
    }
}
