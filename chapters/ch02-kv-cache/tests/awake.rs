//! `awake`: the closure's result comes back unchanged, parallel work inside it is done, and
//! every spinner stops once its call has returned, a panicking closure included.

use std::time::{Duration, Instant};

use ch02_kv_cache::awake::{awake, spinners};
use rayon::prelude::*;

/// Waits up to a second for every spinner to stop.
fn spinners_stop() -> bool {
    let start = Instant::now();
    while spinners() > 0 {
        if start.elapsed() > Duration::from_secs(1) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

#[test]
fn outside_a_pool_it_runs_the_closure() {
    assert_eq!(awake(|| 6 * 7), 42);
}

#[test]
fn inside_a_pool_the_other_threads_spin_until_it_returns() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let expected: u64 = (0..100_000u64).map(|i| i * i % 7).sum();
    pool.install(|| {
        for _ in 0..50 {
            let (sum, seen) = awake(|| {
                // Long enough for the spinners to start: they run until this returns.
                let start = Instant::now();
                let mut seen = 0;
                while start.elapsed() < Duration::from_millis(50) && seen == 0 {
                    seen = spinners();
                }
                let sum: u64 = (0..100_000u64).into_par_iter().map(|i| i * i % 7).sum();
                (sum, seen)
            });
            assert_eq!(sum, expected);
            assert!(seen > 0, "no spinner started");
        }
    });
    assert!(spinners_stop(), "{} spinners still running", spinners());
}

#[test]
fn a_panic_inside_stops_the_spinners() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let caught =
        pool.install(|| std::panic::catch_unwind(|| awake(|| -> u32 { panic!("inside awake") })));
    assert!(caught.is_err());
    assert!(spinners_stop(), "{} spinners still running", spinners());
    assert_eq!(pool.install(|| awake(|| 1 + 1)), 2);
}
