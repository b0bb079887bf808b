//! Per-thread buffers that grow once to their largest call, so a projection's forward
//! allocates nothing per token.

use std::cell::RefCell;
use std::thread::LocalKey;

/// Runs `f` with this thread's `T` from `key`; a re-entrant call on the same thread (a rayon
/// worker that picked up another layer's forward while waiting) gets a fresh `T` instead.
pub(crate) fn with_local<T: Default, R>(
    key: &'static LocalKey<RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        Err(_) => f(&mut T::default()),
    })
}
