//! Per-thread buffers that grow once to their largest call, so a projection's forward
//! allocates nothing per token.

use std::cell::RefCell;
use std::thread::LocalKey;

/// A thread's spare buffers of one kind: one per level of nesting reached so far.
pub(crate) type Spares<T> = RefCell<Vec<T>>;

/// Runs `f` with one of this thread's `T`s from `key`, given back afterwards. A call nested in
/// another on the same thread (a rayon worker that picked up a second projection of the layer,
/// chapter 2's joined q/k/v, while waiting for its own tasks) takes the next one: the first
/// time a thread nests that deep it makes a new `T`, and from then on reuses it.
pub(crate) fn with_local<T: Default, R>(
    key: &'static LocalKey<Spares<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    let mut buffer = key
        .with(|spares| spares.borrow_mut().pop())
        .unwrap_or_default();
    let result = f(&mut buffer);
    key.with(|spares| spares.borrow_mut().push(buffer));
    result
}
