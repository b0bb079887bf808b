//! The thread communicator allocates nothing once its slots have grown to the largest message:
//! a counting allocator sees no allocation on the ranks' threads over many all-reduces,
//! all-gathers and broadcasts after one of each at full size. (A test binary of its own: the
//! allocator is global.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use ch08_tensor_parallel::{Communicator, thread_group};

/// The system allocator, counting the allocations of threads that asked to be counted.
struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

fn note() {
    if COUNTED.with(Cell::get) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn collectives_allocate_nothing_once_the_slots_have_grown() {
    let world = 3;
    let n = 1000;
    std::thread::scope(|scope| {
        for mut comm in thread_group(world).unwrap() {
            scope.spawn(move || {
                let rank = comm.rank();
                let mut buf = vec![rank as f32; n];
                let mut gathered = vec![0.0f32; world * n];
                let mut bytes = vec![7u8; 64];
                // Once at full size: the slots and the broadcast buffer grow here.
                comm.all_reduce_sum(&mut buf).unwrap();
                comm.all_gather(&buf, &mut gathered).unwrap();
                comm.broadcast(&mut bytes, 0).unwrap();
                COUNTED.with(|c| c.set(true));
                for step in 0..50 {
                    let len = n - step; // smaller messages reuse the slots
                    comm.all_reduce_sum(&mut buf[..len]).unwrap();
                    comm.all_gather(&buf[..len], &mut gathered[..world * len])
                        .unwrap();
                    comm.broadcast(&mut bytes, 0).unwrap();
                }
                COUNTED.with(|c| c.set(false));
            });
        }
    });
    assert_eq!(ALLOCATIONS.load(Ordering::Relaxed), 0);
}
