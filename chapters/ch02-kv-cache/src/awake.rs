//! Keeping the thread pool's threads awake through a run of steps.
//!
//! A decode step is some 150 parallel regions of a few microseconds to a few tens each: a
//! product split across the threads, then a join. Between two regions a thread of rayon's pool
//! that finds no work spins briefly, then sleeps, and a sleeping thread must be woken for the
//! next region. Where waking takes about ten microseconds (measured on one of this book's
//! machines: the chapter's page, "Keeping the threads awake"), each region starts late on one
//! thread and may end late on the other: the cost of a whole product.
//!
//! [`awake`] runs a closure while every other thread of the current pool runs a **spinner**: a
//! job that looks for work in a loop ([`rayon::yield_now`], which runs any job it finds,
//! stolen or its own) until the closure returns. The threads then take each region's tasks as
//! soon as they are pushed, at the cost of spinning (one core busy) between them. Nothing the
//! closure computes changes: the same tasks run, only sooner.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Whether [`awake`] starts spinners; see [`set_keep_awake`].
static KEEP_AWAKE: AtomicBool = AtomicBool::new(true);

/// Spinners running now, in every pool of the process; see [`spinners`].
static SPINNERS: AtomicUsize = AtomicUsize::new(0);

/// How many spinners are running now: each stops once its [`awake`] call has returned (and it
/// next looks), so a spinner left running after every call has returned is a bug.
pub fn spinners() -> usize {
    SPINNERS.load(Ordering::Relaxed)
}

/// `false` makes [`awake`] run its closure alone, for the whole process, so that a measurement
/// can compare the two (`examples/keep_awake.rs`).
pub fn set_keep_awake(on: bool) {
    KEEP_AWAKE.store(on, Ordering::Relaxed);
}

/// Runs `f`, the other threads of the current rayon pool spinning for work until it returns
/// (see the module doc). Outside a pool's thread it runs `f` alone.
// ANCHOR: awake
pub fn awake<R>(f: impl FnOnce() -> R) -> R {
    let Some(me) = rayon::current_thread_index() else {
        return f();
    };
    if !KEEP_AWAKE.load(Ordering::Relaxed) || rayon::current_num_threads() == 1 {
        return f();
    }
    let running = Arc::new(AtomicBool::new(true));
    let spinning = Arc::clone(&running);
    rayon::spawn_broadcast(move |thread| {
        if thread.index() == me {
            return; // the caller's own copy: it has `f` to run
        }
        SPINNERS.fetch_add(1, Ordering::Relaxed);
        while spinning.load(Ordering::Acquire) {
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::hint::spin_loop();
            }
        }
        SPINNERS.fetch_sub(1, Ordering::Relaxed);
    });
    // Stops the spinners however `f` ends (a panic included).
    struct Stop(Arc<AtomicBool>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Release);
        }
    }
    let _stop = Stop(running);
    f()
}
// ANCHOR_END: awake
