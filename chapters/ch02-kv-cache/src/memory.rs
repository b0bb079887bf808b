//! Backing a buffer's pages with memory before it is used.
//!
//! A large zeroed buffer comes from the system as promised pages: the first write to each page
//! stops the thread for a page fault while the system finds and zeroes memory for it. A KV
//! cache written one position at a time takes those faults in the middle of its steps. Engines
//! allocate and back their KV memory once, at start-up (llama.cpp clears its KV buffers when it
//! makes a context); [`populate`] is that step.

/// Bytes of a base page (x86-64 and most Linux systems): `madvise` takes page-aligned ranges.
const PAGE: usize = 4096;

/// Asks Linux to fault in every page of `buffer` for writing (`MADV_POPULATE_WRITE`, Linux
/// 5.14 and later): the memory is allocated and zeroed now; no byte of `buffer` changes. Returns
/// whether the system did it (an empty buffer: yes; elsewhere than Linux, or a refusal: no, and
/// the pages fault lazily as before).
pub fn populate<T>(buffer: &[T]) -> bool {
    if buffer.is_empty() || size_of::<T>() == 0 {
        return true;
    }
    #[cfg(target_os = "linux")]
    {
        let start = buffer.as_ptr() as usize;
        let first = start / PAGE * PAGE;
        let len = start + std::mem::size_of_val(buffer) - first;
        // SAFETY: the pages `first..first + len` hold `buffer`, which this process owns (the
        // first and last may hold other memory of the allocator's too, also this process's);
        // MADV_POPULATE_WRITE faults pages in without changing any byte.
        unsafe { libc::madvise(first as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// Bytes of a transparent huge page (x86-64 and most Linux systems).
pub const HUGE_PAGE: usize = 2 << 20;

/// Asks Linux to back the whole 2 MiB pages inside `buffer` with huge pages (transparent huge
/// pages, in the common `madvise` mode): the first write to a block then faults once per 2 MiB
/// instead of once per 4 KiB, and the zeroing the kernel does per fault runs in bulk. Advice
/// only: contents, laziness and failure behaviour are unchanged (an unsupported or refused
/// advice is ignored); elsewhere it does nothing.
pub fn advise_huge_pages<T>(buffer: &[T]) {
    #[cfg(target_os = "linux")]
    {
        let start = buffer.as_ptr() as usize;
        let end = start + std::mem::size_of_val(buffer);
        let first = start.next_multiple_of(HUGE_PAGE);
        if end >= first + HUGE_PAGE {
            let len = (end - first) / HUGE_PAGE * HUGE_PAGE;
            // SAFETY: `first..first + len` lies inside `buffer`'s allocation, which this
            // process owns; MADV_HUGEPAGE neither reads nor changes its contents.
            unsafe {
                libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (buffer, HUGE_PAGE);
}
