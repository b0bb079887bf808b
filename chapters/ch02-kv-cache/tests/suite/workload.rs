//! The synthetic workload and the contiguous-reservation utilisation measure: seeded sampling,
//! the log-normal's median and spread, the clipping invariants, and the utilisation arithmetic
//! on a small example worked by hand.

use ch01::LlamaConfig;
use ch01::testing::seeded_runner;
use ch02_kv_cache::workload::{
    ContiguousUtilisation, LogNormal, LogNormalLengths, RequestLengths, Reservation, WorkloadError,
    WorkloadRng, bytes_per_token, contiguous_requests_that_fit,
};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

fn runner(cases: u32) -> TestRunner {
    seeded_runner(cases, 7)
}

fn req(prompt_len: usize, output_len: usize) -> RequestLengths {
    RequestLengths {
        prompt_len,
        output_len,
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

// ───────────────────────────── sampling ─────────────────────────────

#[test]
fn the_same_seed_gives_the_same_workload() {
    let lengths = LogNormalLengths::sharegpt_like(2048).unwrap();
    let a = lengths.sample(1000, 0);
    assert_eq!(a, lengths.sample(1000, 0));
    assert_ne!(a, lengths.sample(1000, 1), "another seed, another workload");
    assert_eq!(
        a[..10],
        lengths.sample(10, 0)[..],
        "a shorter sample is a prefix"
    );
    assert!(lengths.sample(0, 0).is_empty());
}

#[test]
fn the_empirical_median_and_spread_match_the_configuration() {
    // max_len so large that nothing is clipped: these are the log-normal's own draws, rounded.
    let p = LogNormal::new(100.0, 1.0).unwrap();
    let o = LogNormal::new(225.0, 0.9).unwrap();
    let lengths = LogNormalLengths::new(p, o, 1 << 40).unwrap();
    let sample = lengths.sample(10_000, 42);
    for (name, dist, xs) in [
        (
            "prompt",
            p,
            sample
                .iter()
                .map(|r| r.prompt_len as f64)
                .collect::<Vec<_>>(),
        ),
        (
            "output",
            o,
            sample.iter().map(|r| r.output_len as f64).collect(),
        ),
    ] {
        let m = median(xs);
        let rel = (m - dist.median()).abs() / dist.median();
        assert!(
            rel < 0.04,
            "{name}: median {m}, configured {}, off by {:.1}%",
            dist.median(),
            rel * 100.0
        );
    }

    // The continuous draws: ln X has mean ln(median) and standard deviation sigma.
    let mut rng = WorkloadRng::new(9);
    let logs: Vec<f64> = (0..10_000).map(|_| o.sample(&mut rng).ln()).collect();
    let mean = logs.iter().sum::<f64>() / logs.len() as f64;
    let var = logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (logs.len() - 1) as f64;
    assert!((mean - 225f64.ln()).abs() < 0.03, "mean of ln X {mean}");
    assert!((var.sqrt() - 0.9).abs() < 0.03, "sd of ln X {}", var.sqrt());
}

/// Random log-normal workloads (medians up to `max_median`, sigmas up to `max_sigma`, contexts
/// of 2 to `max_context`), with a request count from `n` and a seed.
fn workloads(
    max_median: f64,
    max_sigma: f64,
    max_context: usize,
    n: std::ops::Range<usize>,
) -> impl Strategy<Value = (LogNormalLengths, usize, u64)> {
    (
        (1.0f64..max_median, 0.0f64..max_sigma),
        (1.0f64..max_median, 0.0f64..max_sigma),
        2usize..max_context,
        n,
        any::<u64>(),
    )
        .prop_map(|((pm, ps), (om, os), max_len, n, seed)| {
            let lengths = LogNormalLengths::new(
                LogNormal::new(pm, ps).unwrap(),
                LogNormal::new(om, os).unwrap(),
                max_len,
            )
            .unwrap();
            (lengths, n, seed)
        })
}

#[test]
fn clipped_lengths_are_at_least_one_and_fit_the_context() {
    runner(256)
        .run(
            &workloads(20_000.0, 3.0, 10_000, 0..64),
            |(lengths, n, seed)| {
                let max_len = lengths.max_len();
                let sample = lengths.sample(n, seed);
                prop_assert_eq!(sample.len(), n);
                for r in sample {
                    prop_assert!(r.prompt_len >= 1 && r.output_len >= 1, "{r:?}");
                    prop_assert!(r.total() <= max_len, "{r:?} in a context of {max_len}");
                }
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn the_smallest_context_gives_one_prompt_and_one_output_token() {
    let wide = LogNormal::new(1000.0, 2.0).unwrap();
    let lengths = LogNormalLengths::new(wide, wide, 2).unwrap();
    assert!(lengths.sample(100, 3).iter().all(|&r| r == req(1, 1)));
}

#[test]
fn bad_parameters_are_typed_errors() {
    assert_eq!(LogNormal::new(0.0, 1.0), Err(WorkloadError::BadMedian(0.0)));
    assert_eq!(
        LogNormal::new(-5.0, 1.0),
        Err(WorkloadError::BadMedian(-5.0))
    );
    assert!(matches!(
        LogNormal::new(f64::NAN, 1.0),
        Err(WorkloadError::BadMedian(_))
    ));
    assert_eq!(
        LogNormal::new(10.0, f64::INFINITY),
        Err(WorkloadError::BadSigma(f64::INFINITY))
    );
    assert_eq!(
        LogNormal::new(10.0, -0.5),
        Err(WorkloadError::BadSigma(-0.5))
    );
    assert!(
        LogNormal::new(10.0, 0.0).is_ok(),
        "sigma 0 is a constant length"
    );
    assert_eq!(
        LogNormalLengths::sharegpt_like(1),
        Err(WorkloadError::MaxLenTooSmall(1))
    );
    assert_eq!(
        ContiguousUtilisation::measure(&[], Reservation::Fixed(8)),
        Err(WorkloadError::EmptyWorkload)
    );
    assert_eq!(
        ContiguousUtilisation::measure(&[req(2, 1), req(0, 3)], Reservation::Exact),
        Err(WorkloadError::EmptyRequest {
            index: 1,
            prompt_len: 0,
            output_len: 3
        })
    );
    assert_eq!(
        ContiguousUtilisation::measure(&[req(6, 3)], Reservation::Fixed(8)),
        Err(WorkloadError::DoesNotFit {
            index: 0,
            needed: 9,
            reserved: 8
        })
    );
}

// ───────────────────────────── utilisation ─────────────────────────────

#[test]
fn utilisation_of_a_small_example_worked_by_hand() {
    // Two requests, (p=2, o=3) and (p=1, o=1), each reserving 8 slots.
    let requests = [req(2, 3), req(1, 1)];
    let u = ContiguousUtilisation::measure(&requests, Reservation::Fixed(8)).unwrap();
    // Lifetime: 16 reserved, 5 + 2 = 7 ever written.
    assert_eq!((u.requests, u.reserved_slots, u.used_slots), (2, 16, 7));
    assert_eq!(u.utilisation(), 7.0 / 16.0);
    assert_eq!(u.wasted(), 9.0 / 16.0);
    // Time-weighted. Request 1 lives 3 steps and holds 3, 4, 5 slots: 12 slot-steps; it waits
    // for 2, 1, 0 future tokens: 3; 3 slots are never written for 3 steps: 9; 8 × 3 = 24 in all.
    // Request 2 lives 1 step and holds 2: 2; future 0; 6 never written: 6; 8 × 1 = 8 in all.
    assert_eq!(u.reserved_slot_steps, 32);
    assert_eq!(u.holding_slot_steps, 14);
    assert_eq!(u.future_slot_steps, 3);
    assert_eq!(u.fragmentation_slot_steps, 15);
    assert_eq!(u.time_weighted_utilisation(), 14.0 / 32.0);
    assert_eq!(u.time_weighted_future(), 3.0 / 32.0);
    assert_eq!(u.time_weighted_fragmentation(), 15.0 / 32.0);

    // max_tokens rounded up to a power of two: o = 3 → 4, o = 1 → 1; reservations 6 and 2.
    let u = ContiguousUtilisation::measure(
        &requests,
        Reservation::PromptPlusPow2MaxTokens { max_len: 8 },
    )
    .unwrap();
    assert_eq!((u.reserved_slots, u.used_slots), (8, 7));
    assert_eq!(u.reserved_slot_steps, 6 * 3 + 2);
    assert_eq!(u.fragmentation_slot_steps, 3);
    // The cap: p = 2 + max_tokens 8 would be 10 slots, but the context holds 8.
    assert_eq!(
        Reservation::PromptPlusPow2MaxTokens { max_len: 8 }.slots_for(req(2, 5)),
        8
    );

    // The oracle never fragments, but still holds slots for tokens not yet generated.
    let u = ContiguousUtilisation::measure(&requests, Reservation::Exact).unwrap();
    assert_eq!((u.reserved_slots, u.used_slots), (7, 7));
    assert_eq!(u.utilisation(), 1.0);
    assert_eq!((u.reserved_slot_steps, u.holding_slot_steps), (17, 14));
    assert_eq!((u.future_slot_steps, u.fragmentation_slot_steps), (3, 0));
}

#[test]
fn utilisation_is_a_share_in_zero_one_for_every_policy() {
    runner(256)
        .run(
            &workloads(5_000.0, 2.5, 9_000, 1..64),
            |(lengths, n, seed)| {
                let max_len = lengths.max_len();
                let requests = lengths.sample(n, seed);
                for policy in [
                    Reservation::Fixed(max_len),
                    Reservation::PromptPlusPow2MaxTokens { max_len },
                    Reservation::Exact,
                ] {
                    let u = ContiguousUtilisation::measure(&requests, policy).unwrap();
                    prop_assert!(u.used_slots <= u.reserved_slots);
                    prop_assert_eq!(
                        u.holding_slot_steps + u.future_slot_steps + u.fragmentation_slot_steps,
                        u.reserved_slot_steps
                    );
                    for share in [u.utilisation(), u.time_weighted_utilisation()] {
                        prop_assert!(share > 0.0 && share <= 1.0, "{policy:?}: {share}");
                    }
                    prop_assert!((u.utilisation() + u.wasted() - 1.0).abs() < 1e-12);
                }
                Ok(())
            },
        )
        .unwrap();
}

// ───────────────────────────── bytes ─────────────────────────────

#[test]
fn bytes_per_token_and_requests_that_fit() {
    let config = LlamaConfig::smollm2_135m();
    // 2 × 30 × 3 × 64 × 2 bytes (bf16) = 23 040 bytes = 22.5 KiB per token.
    assert_eq!(bytes_per_token(&config, 2), 23_040);
    assert_eq!(bytes_per_token(&config, 4), 46_080);
    // A whole 8192-token context in bf16 is 180 MiB, so 1 GiB holds 5 such reservations.
    assert_eq!(23_040 * 8192, 180 << 20);
    assert_eq!(contiguous_requests_that_fit(1 << 30, 23_040, 8192), Some(5));
    assert_eq!(contiguous_requests_that_fit(0, 23_040, 8192), Some(0));
    assert_eq!(contiguous_requests_that_fit(1 << 30, 23_040, 0), None);
    assert_eq!(
        contiguous_requests_that_fit(u64::MAX, u64::MAX, usize::MAX),
        Some(0)
    );
}

// ───────────────────────────── the chapter's figures ─────────────────────────────

/// The figures the chapter quotes: 1,000 ShareGPT-like requests, seed 0; pinned to 0.1% so the
/// book cannot drift from the code. Run with `--nocapture` to print them.
#[test]
fn sharegpt_like_utilisation_at_2048_and_8192() {
    // (max_len, policy, ever holds a token, time-weighted holding)
    let expected = [
        (2048, Reservation::Fixed(2048), 0.2529, 0.2520),
        (
            2048,
            Reservation::PromptPlusPow2MaxTokens { max_len: 2048 },
            0.7930,
            0.4754,
        ),
        (2048, Reservation::Exact, 1.0, 0.5958),
        (8192, Reservation::Fixed(8192), 0.0650, 0.0732),
        (
            8192,
            Reservation::PromptPlusPow2MaxTokens { max_len: 8192 },
            0.7705,
            0.4267,
        ),
        (8192, Reservation::Exact, 1.0, 0.5849),
    ];
    for (max_len, policy, lifetime, time_weighted) in expected {
        let requests = LogNormalLengths::sharegpt_like(max_len)
            .unwrap()
            .sample(1000, 0);
        let u = ContiguousUtilisation::measure(&requests, policy).unwrap();
        println!(
            "max_len {max_len}, {policy:?}: ever holds a token {:.1}%; time-weighted: \
             holding {:.1}%, reserved for future {:.1}%, internal fragmentation {:.1}%",
            100.0 * u.utilisation(),
            100.0 * u.time_weighted_utilisation(),
            100.0 * u.time_weighted_future(),
            100.0 * u.time_weighted_fragmentation(),
        );
        assert!(
            (u.utilisation() - lifetime).abs() < 1e-3,
            "{policy:?}: {u:?}"
        );
        assert!(
            (u.time_weighted_utilisation() - time_weighted).abs() < 1e-3,
            "{policy:?}: {u:?}"
        );
    }
}
