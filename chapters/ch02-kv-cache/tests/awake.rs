//! `awake`: the closure's result comes back unchanged, parallel work inside it is done, every
//! spinner stops once its call has returned (a panicking closure included), two calls at once on
//! one pool finish, and a spinner that lands on top of a job its call waits for gives way.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Runs `work` with a new pool of `threads` threads, on another thread; `None` if it has not
/// finished within a minute (a deadlock).
fn on_a_pool<R: Send + 'static>(
    threads: usize,
    work: impl FnOnce(&rayon::ThreadPool) -> R + Send + 'static,
) -> Option<R> {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        done.send(work(&pool))
    });
    result.recv_timeout(Duration::from_secs(60)).ok()
}

fn sum_of_squares_mod_7() -> u64 {
    (0..100_000u64).into_par_iter().map(|i| i * i % 7).sum()
}

#[test]
fn outside_a_pool_it_runs_the_closure() {
    assert_eq!(awake(|| 6 * 7), 42);
}

/// A spinner starts as the call does. (It may give way before the call ends: the caller can be
/// descheduled for longer than a spinner waits for work on a busy machine.)
#[test]
fn inside_a_pool_the_other_threads_spin_while_it_runs() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let expected: u64 = (0..100_000u64).map(|i| i * i % 7).sum();
    let runs = on_a_pool(3, |pool| {
        pool.install(|| {
            (0..50)
                .map(|_| {
                    awake(|| {
                        let started = a_spinner_starts();
                        (sum_of_squares_mod_7(), started)
                    })
                })
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
    let (started, caught, after) = on_a_pool(2, |pool| {
        let started = AtomicBool::new(false);
        let caught = pool.install(|| {
            std::panic::catch_unwind(|| {
                awake(|| -> u32 {
                    started.store(a_spinner_starts(), Ordering::Relaxed);
                    panic!("inside awake")
                })
            })
        });
        let started = started.load(Ordering::Relaxed);
        (started, caught.is_err(), pool.install(|| awake(|| 1 + 1)))
    })
    .expect("awake deadlocked");
    assert!(started, "no spinner started");
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
    let sums = on_a_pool(2, move |pool| {
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

/// A job of the call's work can be stolen by another thread before that thread takes the call's
/// spinner (it was looking for work when the call began). If the job then looks for work while
/// it waits, it finds the spinner, which runs on top of it: the job cannot go on until the
/// spinner returns, and the call cannot end until the job does. Here the job is made to look
/// for work exactly then; the spinner, finding none, must give the thread back.
#[test]
fn a_spinner_on_top_of_a_job_its_call_waits_for_gives_way() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let finished = on_a_pool(2, |pool| {
        pool.install(|| {
            let (job_started, call_started, job_done) = (
                AtomicBool::new(false),
                AtomicBool::new(false),
                AtomicBool::new(false),
            );
            let wait_for = |flag: &AtomicBool| {
                while !flag.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
            };
            let ((), ran) = rayon::join(
                || {
                    wait_for(&job_started); // the other thread has stolen the job
                    awake(|| {
                        call_started.store(true, Ordering::Release);
                        wait_for(&job_done) // the call needs the job
                    })
                },
                || {
                    job_started.store(true, Ordering::Release);
                    wait_for(&call_started); // the spinner is queued for this thread now
                    // The job looks for work: it finds the spinner and runs it.
                    let ran = rayon::yield_now() == Some(rayon::Yield::Executed);
                    job_done.store(true, Ordering::Release);
                    ran
                },
            );
            ran
        })
    });
    let ran = finished.expect("the spinner held up the job its call waited for");
    assert!(ran, "the job found no spinner to run: nothing was stacked");
    assert!(spinners_stop(), "{} spinners still running", spinners());
}
