//! The sampler against its specification (see the module docs of `sampler`).
//!
//! Property tests run on random vocabularies (1..300 tokens) whose logits are drawn partly
//! from a handful of values, so ties are common. Each filter is checked against a reference
//! computed here in f64, both on the candidate sets (`candidates`) and on the tokens a
//! `Sampler` actually draws. Ties are broken by the lower token id everywhere: top-k keeps
//! exactly `min(k, unmasked tokens)` tokens.

use approx::assert_abs_diff_eq;
use ch01_naive_attention::sampler::*;
use ch01_naive_attention::testing::seeded_config;
use proptest::prelude::*;

/// Fixed seed ("kiln"), no failure files: every run checks the same cases, unless the
/// environment grows or reseeds the run (see `seeded_config`).
fn config() -> ProptestConfig {
    seeded_config(256, 0x6b69_6c6e)
}

/// How many tokens a property test draws from one sampler.
const DRAWS: usize = 16;

// ---------------------------------------------------------------------------------------------
// Strategies and references
// ---------------------------------------------------------------------------------------------

/// A logit: often one of a few half-integers (so duplicates are common), else any in ±20.
fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => (-8i8..=8).prop_map(|v| f32::from(v) * 0.5),
        2 => -20.0f32..20.0,
    ]
}

fn logits() -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(logit(), 1..300)
}

/// Like `logits`, but some entries are masked with -inf or are NaN.
fn masked_logits() -> impl Strategy<Value = Vec<f32>> {
    let entry = prop_oneof![
        4 => logit(),
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::NAN),
    ];
    prop::collection::vec(entry, 1..300)
}

fn temperature() -> impl Strategy<Value = f32> {
    0.25f32..2.0
}

fn top_p() -> impl Strategy<Value = f32> {
    prop_oneof![Just(1.0f32), 0.01f32..1.0]
}

fn min_p() -> impl Strategy<Value = f32> {
    prop_oneof![Just(0.0f32), 0.0f32..=1.0]
}

/// Token ids below `vocab`, `len` of them at most.
fn tokens(vocab: usize, len: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0..vocab as u32, 0..len)
}

/// Logits with a prompt and an output over the same vocabulary.
fn logits_and_sequence() -> impl Strategy<Value = (Vec<f32>, Vec<u32>, Vec<u32>)> {
    logits().prop_flat_map(|logits| {
        let vocab = logits.len();
        (Just(logits), tokens(vocab, 40), tokens(vocab, 40))
    })
}

fn sampling(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        ..SamplingParams::default()
    }
}

/// The logits a sampler scores with at this temperature (the same f32 division it does).
fn scaled(logits: &[f32], temperature: f32) -> Vec<f32> {
    logits.iter().map(|l| l / temperature).collect()
}

/// Unmasked token ids, best first: higher logit, then lower id.
fn rank_order(logits: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..logits.len())
        .filter(|&i| !logits[i].is_nan() && logits[i] != f32::NEG_INFINITY)
        .collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
    order
}

/// Reference softmax in f64 over finite logits.
fn softmax64(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
    let weights: Vec<f64> = logits.iter().map(|&l| (f64::from(l) - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Reference probability mass of the tokens whose logit is strictly greater than `token`'s.
fn mass_above(logits: &[f32], probs: &[f64], token: usize) -> f64 {
    (0..logits.len())
        .filter(|&i| logits[i] > logits[token])
        .map(|i| probs[i])
        .sum()
}

/// `p_token / p_max` from the logits: what min-p compares against (normalisation cancels).
fn ratio_to_max(logits: &[f32], token: usize) -> f64 {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
    (f64::from(logits[token]) - max).exp()
}

/// The first index of the largest logit.
fn first_argmax(logits: &[f32]) -> u32 {
    rank_order(logits)[0] as u32
}

/// `n` tokens from `sampler`, each appended to the output it sees next.
fn generate(sampler: &mut Sampler, logits: &[f32], prompt: &[u32], n: usize) -> Vec<u32> {
    let mut output = Vec::with_capacity(n);
    for _ in 0..n {
        let token = sampler.sample(logits, prompt, &output).unwrap();
        output.push(token);
    }
    output
}

// ---------------------------------------------------------------------------------------------
// Candidate sets (the pure filtering function)
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    #[test]
    fn candidates_are_a_nonempty_distribution(
        logits in logits(), top_k in 0usize..400, top_p in top_p(), min_p in min_p(),
    ) {
        let kept = candidates(&logits, top_k, top_p, min_p).unwrap();
        prop_assert!(!kept.is_empty());
        let total: f64 = kept.iter().map(|c| f64::from(c.prob)).sum();
        prop_assert!((total - 1.0).abs() <= 1e-5, "probabilities sum to {total}");
        for pair in kept.windows(2) {
            prop_assert!(pair[0].prob >= pair[1].prob, "not sorted by probability: {pair:?}");
        }
        let mut seen = vec![false; logits.len()];
        for c in &kept {
            prop_assert!(c.prob > 0.0);
            prop_assert_eq!(c.logit, logits[c.token as usize]);
            prop_assert!(!seen[c.token as usize], "token {} listed twice", c.token);
            seen[c.token as usize] = true;
        }
    }

    #[test]
    fn top_k_keeps_exactly_the_k_best(logits in logits(), top_k in 1usize..300) {
        let kept = candidates(&logits, top_k, 1.0, 0.0).unwrap();
        let mut kept: Vec<usize> = kept.iter().map(|c| c.token as usize).collect();
        kept.sort_unstable();
        let mut expected: Vec<usize> = rank_order(&logits).into_iter().take(top_k).collect();
        expected.sort_unstable();
        prop_assert_eq!(kept, expected);
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus(logits in logits(), top_p in top_p()) {
        let kept = candidates(&logits, 0, top_p, 0.0).unwrap();
        let probs = softmax64(&logits);
        let mut in_set = vec![false; logits.len()];
        for c in &kept {
            in_set[c.token as usize] = true;
        }
        // Closed upwards: a kept token's betters are all kept.
        for c in &kept {
            for i in 0..logits.len() {
                prop_assert!(
                    logits[i] <= c.logit || in_set[i],
                    "token {} kept but better token {} dropped", c.token, i
                );
            }
        }
        // Reaches top_p ...
        let mass: f64 = kept.iter().map(|c| probs[c.token as usize]).sum();
        prop_assert!(mass >= f64::from(top_p) - 1e-5, "nucleus mass {mass} < top_p {top_p}");
        // ... and is the smallest that does: without its worst token it falls short.
        let worst = kept.last().unwrap();
        let without_worst = mass - probs[worst.token as usize];
        prop_assert!(
            without_worst < f64::from(top_p) + 1e-5,
            "nucleus not minimal: {without_worst} already reaches {top_p}"
        );
    }

    #[test]
    fn min_p_keeps_exactly_the_tokens_above_the_threshold(logits in logits(), min_p in min_p()) {
        let kept = candidates(&logits, 0, 1.0, min_p).unwrap();
        let mut in_set = vec![false; logits.len()];
        for c in &kept {
            in_set[c.token as usize] = true;
        }
        for (token, &kept) in in_set.iter().enumerate() {
            let ratio = ratio_to_max(&logits, token);
            if kept {
                prop_assert!(ratio >= f64::from(min_p) - 1e-5, "kept {token} at ratio {ratio}");
            } else {
                prop_assert!(ratio < f64::from(min_p) + 1e-5, "dropped {token} at ratio {ratio}");
            }
        }
    }
}

#[test]
fn top_k_breaks_ties_by_lower_token_id() {
    //            0    1    2    3    4
    let logits = [1.0, 2.0, 2.0, 2.0, 0.0];
    let kept = candidates(&logits, 2, 1.0, 0.0).unwrap();
    let tokens: Vec<u32> = kept.iter().map(|c| c.token).collect();
    assert_eq!(tokens, [1, 2]);
    assert_abs_diff_eq!(kept[0].prob, 0.5, epsilon = 1e-6);
}

#[test]
fn top_p_always_keeps_at_least_one_token() {
    let logits = [0.0, 5.0, 1.0];
    let kept = candidates(&logits, 0, 0.01, 0.0).unwrap();
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].token, 1);
    assert_eq!(kept[0].prob, 1.0);
}

#[test]
fn candidates_reject_out_of_range_filters() {
    for (top_p, min_p, name) in [
        (0.0, 0.0, "top_p"),
        (1.5, 0.0, "top_p"),
        (1.0, -0.5, "min_p"),
    ] {
        let err = candidates(&[1.0, 2.0], 0, top_p, min_p).unwrap_err();
        assert!(err.to_string().contains(name), "{err}");
    }
}

// ---------------------------------------------------------------------------------------------
// Drawn tokens respect every filter
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    #[test]
    fn top_k_never_samples_outside_the_k_largest(
        logits in logits(), top_k in 1usize..300, temperature in temperature(),
        seed in any::<u64>(),
    ) {
        let scores = scaled(&logits, temperature);
        let allowed: Vec<usize> = rank_order(&scores).into_iter().take(top_k).collect();
        let mut sampler = Sampler::new(sampling(temperature, top_k, 1.0, 0.0, seed)).unwrap();
        for token in generate(&mut sampler, &logits, &[], DRAWS) {
            prop_assert!(allowed.contains(&(token as usize)), "{token} outside the top {top_k}");
        }
    }

    #[test]
    fn top_p_never_samples_outside_the_nucleus(
        logits in logits(), top_p in top_p(), temperature in temperature(), seed in any::<u64>(),
    ) {
        let scores = scaled(&logits, temperature);
        let probs = softmax64(&scores);
        let mut sampler = Sampler::new(sampling(temperature, 0, top_p, 0.0, seed)).unwrap();
        for token in generate(&mut sampler, &logits, &[], DRAWS) {
            // In the nucleus iff the tokens strictly better than it do not already reach top_p.
            let above = mass_above(&scores, &probs, token as usize);
            prop_assert!(above < f64::from(top_p) + 1e-5, "token {token} has {above} above it");
        }
    }

    #[test]
    fn min_p_never_samples_below_the_threshold(
        logits in logits(), min_p in min_p(), temperature in temperature(), seed in any::<u64>(),
    ) {
        let scores = scaled(&logits, temperature);
        let mut sampler = Sampler::new(sampling(temperature, 0, 1.0, min_p, seed)).unwrap();
        for token in generate(&mut sampler, &logits, &[], DRAWS) {
            let ratio = ratio_to_max(&scores, token as usize);
            prop_assert!(ratio >= f64::from(min_p) - 1e-5, "token {token} at ratio {ratio}");
        }
    }

    #[test]
    fn sampled_tokens_are_candidates(
        logits in logits(), top_k in 0usize..300, top_p in top_p(), min_p in min_p(),
        temperature in temperature(), seed in any::<u64>(),
    ) {
        let kept = candidates(&scaled(&logits, temperature), top_k, top_p, min_p).unwrap();
        let mut sampler = Sampler::new(sampling(temperature, top_k, top_p, min_p, seed)).unwrap();
        for token in generate(&mut sampler, &logits, &[], DRAWS) {
            prop_assert!(kept.iter().any(|c| c.token == token), "token {token} is not a candidate");
        }
    }

    #[test]
    fn masked_logits_are_never_sampled(
        logits in masked_logits(), temperature in prop_oneof![Just(0.0f32), temperature()],
        seed in any::<u64>(),
    ) {
        let mut sampler = Sampler::new(sampling(temperature, 0, 1.0, 0.0, seed)).unwrap();
        let all_masked = logits.iter().all(|l| l.is_nan() || *l == f32::NEG_INFINITY);
        for _ in 0..DRAWS {
            match sampler.sample(&logits, &[], &[]) {
                Ok(token) => {
                    prop_assert!(!all_masked);
                    let logit = logits[token as usize];
                    prop_assert!(logit.is_finite(), "sampled token {token} with logit {logit}");
                }
                Err(err) => {
                    prop_assert!(all_masked, "unexpected error {err}");
                    prop_assert_eq!(err, SamplingError::NoCandidates { vocab_size: logits.len() });
                }
            }
        }
    }
}

#[test]
fn positive_infinity_takes_all_the_probability() {
    let logits = [0.0, f32::INFINITY, 1.0, f32::INFINITY];
    let kept = candidates(&logits, 0, 1.0, 0.0).unwrap();
    let tokens: Vec<u32> = kept.iter().map(|c| c.token).collect();
    assert_eq!(tokens, [1, 3]);
    assert_eq!(kept[0].prob, 0.5);

    let mut greedy = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(greedy.sample(&logits, &[], &[]), Ok(1));
    let mut sampler = Sampler::new(sampling(1.0, 0, 1.0, 0.0, 7)).unwrap();
    for token in generate(&mut sampler, &logits, &[], 100) {
        assert!(token == 1 || token == 3);
    }
}

// ---------------------------------------------------------------------------------------------
// Determinism and greedy
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    #[test]
    fn same_seed_gives_the_same_tokens(
        (logits, prompt, _) in logits_and_sequence(), top_k in 0usize..300, top_p in top_p(),
        min_p in min_p(), temperature in temperature(), seed in any::<u64>(),
        repetition_penalty in 0.5f32..2.0, frequency_penalty in -2.0f32..=2.0,
    ) {
        let params = SamplingParams {
            repetition_penalty,
            frequency_penalty,
            ..sampling(temperature, top_k, top_p, min_p, seed)
        };
        let mut first = Sampler::new(params.clone()).unwrap();
        let mut second = Sampler::new(params).unwrap();
        prop_assert_eq!(
            generate(&mut first, &logits, &prompt, 64),
            generate(&mut second, &logits, &prompt, 64)
        );
    }

    #[test]
    fn different_seeds_differ_on_a_flat_distribution(
        vocab in 2usize..300, seed in any::<u64>(), offset in 1u64..1000,
    ) {
        let flat = vec![0.0f32; vocab];
        let mut first = Sampler::new(sampling(1.0, 0, 1.0, 0.0, seed)).unwrap();
        let other_seed = seed.wrapping_add(offset);
        let mut second = Sampler::new(sampling(1.0, 0, 1.0, 0.0, other_seed)).unwrap();
        prop_assert_ne!(
            generate(&mut first, &flat, &[], 64),
            generate(&mut second, &flat, &[], 64)
        );
    }

    #[test]
    fn greedy_returns_the_first_largest_unmasked_logit(
        mut logits in masked_logits(), copy_at in any::<prop::sample::Index>(),
        zeros in prop::collection::vec((any::<prop::sample::Index>(), any::<bool>()), 0..4),
    ) {
        // The largest value again somewhere, so that it often ties; and some signed zeros
        // (0.0 and -0.0 are equal, but not the same bits).
        let largest = logits.iter().copied().filter(|l| !l.is_nan()).fold(f32::NEG_INFINITY, f32::max);
        let at = copy_at.index(logits.len());
        logits[at] = largest;
        for (at, negative) in zeros {
            let at = at.index(logits.len());
            logits[at] = if negative { -0.0 } else { 0.0 };
        }
        // One pass, a strict `>`: the specification of step 4.
        let mut expected: Option<(usize, f32)> = None;
        for (token, &logit) in logits.iter().enumerate() {
            let unmasked = !logit.is_nan() && logit != f32::NEG_INFINITY;
            if unmasked && expected.is_none_or(|(_, best)| logit > best) {
                expected = Some((token, logit));
            }
        }
        let mut sampler = Sampler::new(SamplingParams::greedy()).unwrap();
        match expected {
            Some((token, _)) => prop_assert_eq!(sampler.sample(&logits, &[], &[]), Ok(token as u32)),
            None => prop_assert!(sampler.sample(&logits, &[], &[]).is_err()),
        }
    }

    #[test]
    fn temperature_zero_returns_the_argmax_whatever_the_seed(
        logits in logits(), top_k in 0usize..300, top_p in top_p(), min_p in min_p(),
        seed in any::<u64>(),
    ) {
        let expected = first_argmax(&logits);
        let mut sampler = Sampler::new(sampling(0.0, top_k, top_p, min_p, seed)).unwrap();
        for _ in 0..4 {
            prop_assert_eq!(sampler.sample(&logits, &[], &[]).unwrap(), expected);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Frequencies match the distribution
// ---------------------------------------------------------------------------------------------

/// Draws `n` tokens (output not fed back) and returns each token's frequency.
fn frequencies(params: SamplingParams, logits: &[f32], n: usize) -> Vec<f64> {
    let mut sampler = Sampler::new(params).unwrap();
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..n {
        counts[sampler.sample(logits, &[], &[]).unwrap() as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / n as f64).collect()
}

#[test]
fn sampling_frequencies_match_the_probabilities() {
    let probs = [0.1f32, 0.2, 0.3, 0.4];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
    let seen = frequencies(sampling(1.0, 0, 1.0, 0.0, 42), &logits, 20_000);
    for (token, (&freq, &p)) in seen.iter().zip(&probs).enumerate() {
        assert!(
            (freq - f64::from(p)).abs() < 0.02,
            "token {token}: frequency {freq}, probability {p}"
        );
    }
}

#[test]
fn top_p_renormalises_the_nucleus() {
    // Sorted: 0.4 (token 3), 0.3 (token 2) reach 0.7 >= 0.65, so the nucleus is {3, 2}.
    let probs = [0.1f32, 0.2, 0.3, 0.4];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
    let kept = candidates(&logits, 0, 0.65, 0.0).unwrap();
    assert_eq!(kept.iter().map(|c| c.token).collect::<Vec<_>>(), [3, 2]);
    assert_abs_diff_eq!(kept[0].prob, 4.0 / 7.0, epsilon = 1e-6);
    assert_abs_diff_eq!(kept[1].prob, 3.0 / 7.0, epsilon = 1e-6);

    let seen = frequencies(sampling(1.0, 0, 0.65, 0.0, 42), &logits, 20_000);
    let expected = [0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0];
    for (token, (&freq, &p)) in seen.iter().zip(&expected).enumerate() {
        assert!(
            (freq - p).abs() < 0.02,
            "token {token}: frequency {freq}, probability {p}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Penalties
// ---------------------------------------------------------------------------------------------

fn penalized(params: SamplingParams, logits: &[f32], prompt: &[u32], output: &[u32]) -> Vec<f32> {
    let mut sampler = Sampler::new(params).unwrap();
    sampler
        .penalized_logits(logits, prompt, output)
        .unwrap()
        .to_vec()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn repetition_penalty_lowers_exactly_the_seen_tokens(
        (logits, prompt, output) in logits_and_sequence(), penalty in 1.0f32..3.0,
    ) {
        let params = SamplingParams { repetition_penalty: penalty, ..SamplingParams::default() };
        let after = penalized(params, &logits, &prompt, &output);
        for (token, (&before, &after)) in logits.iter().zip(&after).enumerate() {
            let seen = prompt.contains(&(token as u32)) || output.contains(&(token as u32));
            let expected = match (seen, before > 0.0) {
                (false, _) => before,
                (true, true) => before / penalty,
                (true, false) => before * penalty,
            };
            prop_assert_eq!(after, expected, "token {}", token);
            prop_assert!(after <= before);
        }
    }

    #[test]
    fn frequency_and_presence_change_exactly_the_output_tokens(
        (logits, prompt, output) in logits_and_sequence(),
        frequency_penalty in -2.0f32..=2.0, presence_penalty in -2.0f32..=2.0,
    ) {
        let params =
            SamplingParams { frequency_penalty, presence_penalty, ..SamplingParams::default() };
        let after = penalized(params, &logits, &prompt, &output);
        for (token, (&before, &after)) in logits.iter().zip(&after).enumerate() {
            let count = output.iter().filter(|&&t| t as usize == token).count();
            let expected = if count == 0 {
                before
            } else {
                before - (frequency_penalty * count as f32 + presence_penalty)
            };
            prop_assert!((after - expected).abs() <= 1e-4, "token {token}: {after} != {expected}");
        }
    }
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
    //             0     1    2    3
    let logits = [2.0, -1.0, 0.5, 3.0];
    let params = SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::default()
    };
    // Token 1 occurs three times but is penalised once; token 0 only in the prompt still counts.
    let after = penalized(params, &logits, &[0, 1], &[1, 1]);
    assert_eq!(after, [1.0, -2.0, 0.5, 3.0]);
}

#[test]
fn frequency_and_presence_penalties_unit_example() {
    let logits = [1.0f32; 6];
    let params = SamplingParams {
        frequency_penalty: 0.5,
        presence_penalty: 0.25,
        ..SamplingParams::default()
    };
    // Token 2 three times, token 5 once; prompt tokens 1 and 3 are not penalised.
    let after = penalized(params, &logits, &[1, 3], &[2, 2, 5, 2]);
    let expected = [
        1.0,
        1.0,
        1.0 - (0.5 * 3.0 + 0.25),
        1.0,
        1.0,
        1.0 - (0.5 + 0.25),
    ];
    for (got, want) in after.iter().zip(expected) {
        assert_abs_diff_eq!(*got, want, epsilon = 1e-6);
    }
}

#[test]
fn penalties_apply_in_order_repetition_then_frequency() {
    let logits = [4.0, -2.0, 1.0];
    let params = SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 1.0,
        ..SamplingParams::default()
    };
    // Token 0: 4 / 2. Token 1: -2 * 2, then - 1 * 2 occurrences. Token 2: untouched.
    let after = penalized(params, &logits, &[0], &[1, 1]);
    assert_eq!(after, [2.0, -6.0, 1.0]);
}

#[test]
fn penalty_scratch_is_clean_between_calls() {
    let logits = [1.0, 2.0, 3.0];
    let params = SamplingParams {
        repetition_penalty: 1.5,
        frequency_penalty: 1.0,
        presence_penalty: 1.0,
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(params).unwrap();
    sampler.penalized_logits(&logits, &[0], &[1, 1]).unwrap();
    assert_eq!(sampler.penalized_logits(&logits, &[], &[]).unwrap(), logits);
    // A different vocabulary size in between is fine too.
    sampler.penalized_logits(&[1.0; 8], &[7], &[7]).unwrap();
    // Token 2 only: 3 / 1.5, then - 1 * 1 occurrence - 1 for presence.
    assert_eq!(
        sampler.penalized_logits(&logits, &[], &[2]).unwrap(),
        [1.0, 2.0, 0.0]
    );
}

#[test]
fn penalties_can_flip_the_greedy_choice() {
    let logits = [1.0, 1.2];
    let params = SamplingParams {
        presence_penalty: 0.5,
        ..SamplingParams::greedy()
    };
    let mut sampler = Sampler::new(params).unwrap();
    assert_eq!(sampler.sample(&logits, &[], &[]), Ok(1));
    assert_eq!(sampler.sample(&logits, &[], &[1]), Ok(0));
}

// ---------------------------------------------------------------------------------------------
// Parameters and errors
// ---------------------------------------------------------------------------------------------

#[test]
fn validate_rejects_each_bad_parameter_by_name() {
    type Edit = fn(&mut SamplingParams);
    let cases: [(&str, Edit); 18] = [
        ("temperature", |p| p.temperature = -0.1),
        ("temperature", |p| p.temperature = f32::NAN),
        ("temperature", |p| p.temperature = f32::INFINITY),
        ("top_p", |p| p.top_p = 0.0),
        ("top_p", |p| p.top_p = 1.5),
        ("top_p", |p| p.top_p = f32::NAN),
        ("min_p", |p| p.min_p = -0.1),
        ("min_p", |p| p.min_p = 1.1),
        ("min_p", |p| p.min_p = f32::NAN),
        ("repetition_penalty", |p| p.repetition_penalty = 0.0),
        ("repetition_penalty", |p| p.repetition_penalty = -1.0),
        ("repetition_penalty", |p| {
            p.repetition_penalty = f32::INFINITY
        }),
        ("repetition_penalty", |p| p.repetition_penalty = f32::NAN),
        ("frequency_penalty", |p| p.frequency_penalty = 2.5),
        ("frequency_penalty", |p| p.frequency_penalty = -2.1),
        ("frequency_penalty", |p| p.frequency_penalty = f32::NAN),
        ("presence_penalty", |p| p.presence_penalty = -3.0),
        ("presence_penalty", |p| p.presence_penalty = f32::NAN),
    ];
    for (name, edit) in cases {
        let mut params = SamplingParams::default();
        edit(&mut params);
        let err = params.validate().unwrap_err();
        assert!(
            matches!(err, SamplingError::InvalidParameter { name: n, .. } if n == name),
            "{name}: {err:?}"
        );
        let message = err.to_string();
        assert!(
            message.starts_with(&format!("invalid sampling parameter {name} = ")),
            "{message}"
        );
        assert!(message.contains("expected"), "{message}");
        assert_eq!(Sampler::new(params).unwrap_err().to_string(), message);
    }
}

#[test]
fn validate_message_states_value_and_range() {
    let params = SamplingParams {
        top_p: 1.5,
        ..SamplingParams::default()
    };
    assert_eq!(
        params.validate().unwrap_err().to_string(),
        "invalid sampling parameter top_p = 1.5: expected a value in (0, 1]"
    );
}

#[test]
fn validate_accepts_the_boundaries() {
    let edges = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 100.0,
            top_k: usize::MAX,
            top_p: 1e-6,
            min_p: 1.0,
            repetition_penalty: 1e-3,
            frequency_penalty: -2.0,
            presence_penalty: 2.0,
            seed: u64::MAX,
        },
        SamplingParams {
            frequency_penalty: 2.0,
            presence_penalty: -2.0,
            ..SamplingParams::default()
        },
    ];
    for params in edges {
        assert_eq!(params.validate(), Ok(()), "{params:?}");
    }
}

#[test]
fn default_is_greedy_with_everything_disabled() {
    let params = SamplingParams::default();
    assert_eq!(params, SamplingParams::greedy());
    assert!(params.is_greedy());
    assert_eq!((params.top_k, params.top_p, params.min_p), (0, 1.0, 0.0));
    assert_eq!(params.repetition_penalty, 1.0);
    assert_eq!(
        (
            params.frequency_penalty,
            params.presence_penalty,
            params.seed
        ),
        (0.0, 0.0, 0)
    );
}

#[test]
fn params_deserialise_with_defaults_for_missing_fields() {
    let params: SamplingParams =
        serde_json::from_str(r#"{"temperature": 0.7, "top_p": 0.9, "seed": 3}"#).unwrap();
    assert_eq!(
        params,
        SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            seed: 3,
            ..SamplingParams::default()
        }
    );
}

#[test]
fn sample_errors_instead_of_panicking() {
    let mut sampler = Sampler::new(sampling(1.0, 0, 1.0, 0.0, 0)).unwrap();
    assert_eq!(
        sampler.sample(&[], &[], &[]),
        Err(SamplingError::EmptyLogits)
    );
    let masked = [f32::NEG_INFINITY, f32::NAN];
    assert_eq!(
        sampler.sample(&masked, &[], &[]),
        Err(SamplingError::NoCandidates { vocab_size: 2 })
    );
    let err = sampler.sample(&[0.0, 1.0], &[0, 2], &[]).unwrap_err();
    assert_eq!(
        err,
        SamplingError::TokenOutOfVocab {
            sequence: "prompt",
            token: 2,
            vocab_size: 2
        }
    );
    assert!(err.to_string().contains("prompt token id 2"), "{err}");
    assert!(matches!(
        sampler.sample(&[0.0, 1.0], &[], &[5]),
        Err(SamplingError::TokenOutOfVocab {
            sequence: "output",
            token: 5,
            ..
        })
    ));
    let mut greedy = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(
        greedy.sample(&masked, &[], &[]),
        Err(SamplingError::NoCandidates { vocab_size: 2 })
    );
    assert_eq!(
        candidates(&[], 0, 1.0, 0.0),
        Err(SamplingError::EmptyLogits)
    );
}

#[test]
fn distribution_is_what_sample_draws_from() {
    let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5, f32::NEG_INFINITY];
    let params = SamplingParams {
        temperature: 0.7,
        top_k: 4,
        top_p: 0.9,
        repetition_penalty: 1.3,
        seed: 11,
        ..SamplingParams::default()
    };
    let (prompt, output) = ([1u32, 4], [3u32]);
    let mut a = Sampler::new(params.clone()).unwrap();
    let mut b = Sampler::new(params).unwrap();
    for _ in 0..50 {
        let dist = a.distribution(&logits, &prompt, &output).unwrap().to_vec();
        let total: f32 = dist.iter().map(|c| c.prob).sum();
        assert!((total - 1.0).abs() < 1e-5);
        // The same draw by hand: inverse CDF over the candidates, best first.
        let u = a.uniform();
        let mut cumulative = 0.0f64;
        let by_hand = dist
            .iter()
            .find(|c| {
                cumulative += f64::from(c.prob);
                u < cumulative
            })
            .map_or(dist[dist.len() - 1].token, |c| c.token);
        assert_eq!(b.sample(&logits, &prompt, &output).unwrap(), by_hand);
    }
    // Greedy: the argmax alone (ties to the lower id), with probability 1, and no draw.
    let mut greedy = Sampler::new(SamplingParams::greedy()).unwrap();
    let dist = greedy.distribution(&logits, &[], &[]).unwrap();
    assert_eq!(dist.len(), 1);
    assert_eq!((dist[0].token, dist[0].prob), (1, 1.0));
}

/// Penalties and the temperature change how likely a token is, never whether it can be drawn:
/// one token left unmasked (as a grammar or `allowed_token_ids` leaves it) is still sampled
/// when a huge repetition penalty or a temperature of 1e-45 (both valid) drives its logit past
/// f32's range.
#[test]
fn a_penalty_or_a_tiny_temperature_never_masks_the_last_token() {
    let mut logits = vec![f32::NEG_INFINITY; 8];
    logits[5] = -100.0;
    let cases = [
        SamplingParams {
            repetition_penalty: 1e38,
            ..SamplingParams::greedy()
        },
        sampling(1e-45, 0, 1.0, 0.0, 7),
        SamplingParams {
            repetition_penalty: 1e38,
            ..sampling(1e-45, 3, 0.5, 0.5, 7)
        },
    ];
    for params in cases {
        let mut sampler = Sampler::new(params.clone()).unwrap();
        assert_eq!(sampler.sample(&logits, &[5], &[5, 5]), Ok(5), "{params:?}");
    }
    // Two tokens left, -2 and -50: a temperature of 1e-40 overflows both, yet it must pick
    // the likelier one every time, as a temperature near 0 does.
    let mut two = vec![f32::NEG_INFINITY; 8];
    two[2] = -50.0;
    two[6] = -2.0;
    for seed in 0..20 {
        let mut sampler = Sampler::new(sampling(1e-40, 0, 1.0, 0.0, seed)).unwrap();
        assert_eq!(sampler.sample(&two, &[], &[]), Ok(6), "seed {seed}");
    }
}
