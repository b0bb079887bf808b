//! `awake`: the closure's result comes back unchanged, parallel work inside it is done, every
//! spinner stops once its call has returned (a panicking closure included), and two calls at
//! once on one pool finish.

use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ch02_kv_cache::awake::{awake, spinners};
use rayon::prelude::*;

/// `spinners()` counts every pool's spinners: the tests that start some run one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Waits up to five seconds for every spinner to stop.
fn spinners_stop() -> bool {
    let start = Instant::now();
    while spinners() > 0 {
        if start.elapsed() > Duration::from_secs(5) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// Waits up to five seconds for a spinner to start; whether one did.
fn a_spinner_starts() -> bool {
    let start = Instant::now();
    while spinners() == 0 {
        if start.elapsed() > Duration::from_secs(5) {
            return false;
        }
        std::hint::spin_loop();
    }
    true
}

/// Runs `work` on another thread; `None` if it has not finished within a minute (a deadlock).
fn within_a_minute<R: Send + 'static>(work: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || done.send(work()));
    result.recv_timeout(Duration::from_secs(60)).ok()
}

fn sum_of_squares_mod_7() -> u64 {
    (0..100_000u64).into_par_iter().map(|i| i * i % 7).sum()
}

#[test]
fn outside_a_pool_it_runs_the_closure() {
    assert_eq!(awake(|| 6 * 7), 42);
}

#[test]
fn inside_a_pool_the_other_threads_spin_until_it_returns() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let expected: u64 = (0..100_000u64).map(|i| i * i % 7).sum();
    let runs = within_a_minute(|| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(|| {
            (0..50)
                .map(|_| awake(|| (sum_of_squares_mod_7(), a_spinner_starts())))
                .collect::<Vec<_>>()
        })
    })
    .expect("awake deadlocked");
    for (sum, started) in runs {
        assert_eq!(sum, expected);
        assert!(started, "no spinner started");
    }
    assert!(spinners_stop(), "{} spinners still running", spinners());
}

#[test]
fn a_panic_inside_stops_the_spinners() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (caught, after) = within_a_minute(|| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let caught = pool.install(|| {
            std::panic::catch_unwind(|| {
                awake(|| -> u32 {
                    assert!(a_spinner_starts(), "no spinner started");
                    panic!("inside awake")
                })
            })
        });
        (caught.is_err(), pool.install(|| awake(|| 1 + 1)))
    })
    .expect("awake deadlocked");
    assert!(caught);
    assert_eq!(after, 2);
    assert!(spinners_stop(), "{} spinners still running", spinners());
}

/// Two threads of one pool, each inside `awake` at once, each waiting on parallel work: neither
/// may end up spinning for the other's call.
#[test]
fn two_calls_at_once_on_one_pool_finish() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let expected: u64 = (0..100_000u64).map(|i| i * i % 7).sum();
    let sums = within_a_minute(move || {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            (0..200)
                .map(|_| {
                    rayon::join(
                        || awake(|| awake(sum_of_squares_mod_7)),
                        || awake(sum_of_squares_mod_7),
                    )
                })
                .collect::<Vec<_>>()
        })
    })
    .expect("two awake calls at once deadlocked");
    assert!(sums.iter().all(|&(a, b)| a == expected && b == expected));
    assert!(spinners_stop(), "{} spinners still running", spinners());
}
