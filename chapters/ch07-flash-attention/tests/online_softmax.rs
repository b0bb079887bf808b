//! The merge of two partial softmax states is commutative (exactly) and associative (within
//! rounding), and merging the states of any split of the keys gives the softmax of them all.

use ch01::testing::{assert_rel_close, seeded_config};
use ch07_flash_attention::online::Partial;
use proptest::prelude::*;

/// A tile of 0 to 12 keys: (scores in ±30, values [len, d] in ±5).
fn tile(d: usize) -> impl Strategy<Value = (Vec<f32>, Vec<f32>)> {
    (0usize..=12).prop_flat_map(move |len| {
        (
            proptest::collection::vec(-30.0f32..30.0, len),
            proptest::collection::vec(-5.0f32..5.0, len * d),
        )
    })
}

fn softmax_output(scores: &[f32], values: &[f32], d: usize) -> Vec<f32> {
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = scores.iter().map(|&s| (s as f64 - m).exp()).collect();
    let sum: f64 = w.iter().sum();
    (0..d)
        .map(|x| {
            (w.iter()
                .enumerate()
                .map(|(j, w)| w * values[j * d + x] as f64)
                .sum::<f64>()
                / sum) as f32
        })
        .collect()
}

proptest! {
    #![proptest_config(seeded_config(256, 74))]

    #[test]
    fn merge_is_commutative_and_associative(
        (d, tiles) in (1usize..=9).prop_flat_map(|d| (Just(d), [tile(d), tile(d), tile(d)])),
    ) {
        let [a, b, c] = [0, 1, 2].map(|i| Partial::of_tile(&tiles[i].0, &tiles[i].1, d));
        prop_assert_eq!(a.merge(&b), b.merge(&a));
        let left = a.merge(&b).merge(&c);
        let right = a.merge(&b.merge(&c));
        prop_assert_eq!(left.stats.max, right.stats.max);
        let (l, r) = (left.output(), right.output());
        for (x, y) in l.iter().zip(&r) {
            prop_assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{l:?} vs {r:?}");
        }
        prop_assert!((left.stats.sum - right.stats.sum).abs() <= 1e-5 * right.stats.sum.max(1.0));
    }

    #[test]
    fn merged_pieces_are_the_softmax_of_the_whole(
        (d, scores, values, cuts) in (1usize..=9, 1usize..=40).prop_flat_map(|(d, len)| (
            Just(d),
            proptest::collection::vec(-50.0f32..50.0, len),
            proptest::collection::vec(-5.0f32..5.0, len * d),
            proptest::collection::vec(0..=len, 0..5),
        )),
    ) {
        let mut cuts = cuts;
        cuts.push(0);
        cuts.push(scores.len());
        cuts.sort_unstable();
        let mut merged = Partial::empty(d);
        for w in cuts.windows(2) {
            let piece = Partial::of_tile(&scores[w[0]..w[1]], &values[w[0] * d..w[1] * d], d);
            merged = merged.merge(&piece);
        }
        let expected = softmax_output(&scores, &values, d);
        assert_rel_close("merged pieces", &merged.output(), &expected, 1e-5);
    }

    /// The same with masked keys, scores of −∞ (as chapter 1's oracle masks), which weigh 0:
    /// a piece of masked keys only, folded or merged before any finite score, changes nothing.
    #[test]
    fn masked_keys_weigh_nothing_in_any_piece(
        (d, scores, values, cuts) in (1usize..=9, 1usize..=40).prop_flat_map(|(d, len)| (
            Just(d),
            proptest::collection::vec(
                prop_oneof![2 => -50.0f32..50.0, 1 => Just(f32::NEG_INFINITY)],
                len,
            ),
            proptest::collection::vec(-5.0f32..5.0, len * d),
            proptest::collection::vec(0..=len, 0..5),
        )),
    ) {
        prop_assume!(scores.iter().any(|s| s.is_finite()));
        let mut cuts = cuts;
        cuts.push(0);
        cuts.push(scores.len());
        cuts.sort_unstable();
        let (mut merged, mut folded) = (Partial::empty(d), Partial::empty(d));
        for w in cuts.windows(2) {
            let (s, v) = (&scores[w[0]..w[1]], &values[w[0] * d..w[1] * d]);
            merged = merged.merge(&Partial::of_tile(s, v, d));
            folded.absorb(s, v);
        }
        let expected = softmax_output(&scores, &values, d);
        assert_rel_close("merged pieces", &merged.output(), &expected, 1e-5);
        assert_rel_close("folded pieces", &folded.output(), &expected, 1e-5);
    }
}
