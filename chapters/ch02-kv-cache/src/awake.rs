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
//! stolen or its own) until the closure returns (and no other call of the same thread has
//! begun), giving its place on the thread's stack back after a millisecond without work
//! ([`GIVE_WAY_AFTER`]). The threads then take each region's tasks as soon as they are pushed,
//! at the cost of spinning (one core busy) between them. Nothing the closure computes changes:
//! the same tasks run, only sooner.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Whether [`awake`] starts spinners; see [`set_keep_awake`].
static KEEP_AWAKE: AtomicBool = AtomicBool::new(true);

/// How long a spinner goes on finding no work before it gives its place back: it returns and
/// queues itself again (see `spin`).
///
/// A spinner is a job, and a thread runs it where it finds it: perhaps while it waits inside
/// another job, one of the call's own, stolen before the spinner reached the thread (the thread
/// was looking for work when the call began). The spinner then runs on top of that job, which
/// cannot go on until the spinner returns, while the call cannot end until the job does: spinning
/// until the call's end would never end. Giving way costs such a stacking (`tests/awake.rs`
/// makes one happen) a millisecond, and about one more for each `join` the task is inside of
/// on that thread: each finds the queued copy on top of its deque and runs it before going on.
/// Where the spinner is at the bottom of its thread's stack, it takes its copy again at once and
/// spins on.
pub const GIVE_WAY_AFTER: Duration = Duration::from_millis(1);

/// Spinners running now, in every pool of the process; see [`spinners`].
static SPINNERS: AtomicUsize = AtomicUsize::new(0);

/// How many spinners are running now: each stops once its caller's [`awake`] calls have all
/// returned (and it next looks), so a spinner left running after every call has returned is a
/// bug.
pub fn spinners() -> usize {
    SPINNERS.load(Ordering::Relaxed)
}

/// `false` makes [`awake`] run its closure alone, for the whole process, so that a measurement
/// can compare the two (`examples/keep_awake.rs`).
pub fn set_keep_awake(on: bool) {
    KEEP_AWAKE.store(on, Ordering::Relaxed);
}

thread_local! {
    /// Whether this thread is inside an [`awake`] closure or a spinner. A spinner started on
    /// such a thread returns at once: run nested there, it would spin until its caller's calls
    /// had all returned while the closure or spinner under it waited, and two threads each
    /// inside an [`awake`] closure could each end up spinning for the other's. A nested
    /// [`awake`] starts none.
    static BUSY: Cell<bool> = const { Cell::new(false) };

    /// How many [`awake`] calls are in progress on this thread, shared with the spinners they
    /// started: a spinner spins while its caller has one. A spinner still spinning when the
    /// same thread's next call begins (an engine's steps follow each other closely) serves that
    /// call too, and the next call's own spinner, finding its thread busy, returns at once.
    static CALLS: Arc<AtomicUsize> = Arc::new(AtomicUsize::new(0));
}

/// This thread marked [`BUSY`] until dropped, then put back as it was.
struct Busy(bool);

impl Busy {
    fn enter() -> Busy {
        Busy(BUSY.replace(true))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.set(self.0);
    }
}

/// Runs `f`, the other threads of the current rayon pool spinning for work while it runs
/// (see the module doc). Outside a pool's thread, or inside another [`awake`], it runs `f`
/// alone.
// ANCHOR: awake
pub fn awake<R>(f: impl FnOnce() -> R) -> R {
    let Some(me) = rayon::current_thread_index() else {
        return f();
    };
    if !KEEP_AWAKE.load(Ordering::Relaxed) || rayon::current_num_threads() == 1 || BUSY.get() {
        return f();
    }
    let calls = CALLS.with(Arc::clone);
    calls.fetch_add(1, Ordering::AcqRel);
    let callers_calls = Arc::clone(&calls);
    rayon::spawn_broadcast(move |_| spin(me, Arc::clone(&callers_calls)));
    // Ends this call however `f` ends (a panic included): its spinners stop once their caller
    // has no other call in progress.
    struct Done(Arc<AtomicUsize>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::AcqRel);
        }
    }
    let _done = Done(calls);
    let _busy = Busy::enter();
    f()
}

/// A spinner for the calls of thread `caller`: looks for work while `callers_calls` is above
/// zero. After [`GIVE_WAY_AFTER`] without work it returns, so that whatever job it may be
/// running on top of goes on, and queues itself again on this thread's deque: at the bottom of
/// the thread's stack it is taken again at once and spins on; on top of a job whose wait is
/// over, that job goes on first.
fn spin(caller: usize, callers_calls: Arc<AtomicUsize>) {
    if rayon::current_thread_index() == Some(caller) {
        return; // the caller's own thread runs the call, not a spinner
    }
    if BUSY.get() {
        return; // a thread busy with another call or spinner (see `BUSY`)
    }
    let busy = Busy::enter();
    SPINNERS.fetch_add(1, Ordering::Relaxed);
    let mut last_work = Instant::now();
    let mut gave_way = false;
    while callers_calls.load(Ordering::Acquire) > 0 {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            last_work = Instant::now();
        } else if last_work.elapsed() > GIVE_WAY_AFTER {
            gave_way = true;
            break;
        } else {
            std::hint::spin_loop();
        }
    }
    SPINNERS.fetch_sub(1, Ordering::Relaxed);
    drop(busy);
    if gave_way {
        rayon::spawn(move || spin(caller, callers_calls));
    }
}
// ANCHOR_END: awake
