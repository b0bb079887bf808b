//! Memory for a model's weights, backed by 2 MiB pages where Linux allows it.
//!
//! Decode reads every weight once per token, front to back. The CPU translates each address
//! through the TLB, a small cache of page translations: with 4 KiB pages a 269 MB model spans
//! 66,000 pages, so a token takes tens of thousands of page-table walks, and the hardware
//! prefetcher stops at every 4 KiB boundary. With 2 MiB pages the same weights span 130 pages.
//! Linux backs anonymous memory with such transparent huge pages where a program asks for it
//! (`madvise(MADV_HUGEPAGE)`, the common `madvise` mode), but only for whole, aligned 2 MiB
//! ranges, and a projection of SmolLM2-135M is 0.2 to 1.8 MB in bf16: allocated one by one,
//! none of them would get one.
//!
//! So weights are carved from **chunks**: [`CHUNK`]-byte mappings, 2 MiB-aligned and advised
//! before anything touches them, handed out front to back ([`WeightBuffer::zeroed`]). A weight
//! larger than half a chunk gets a mapping of its own. Each buffer holds its chunk alive; a
//! chunk is unmapped when its last buffer is dropped, and the space of a dropped buffer is not
//! reused before that. Weights live as long as their model, so nothing is lost for them; a
//! short-lived weight belongs on the heap ([`Elements::on_heap`]), or its space stays taken
//! until every other buffer of its chunk is gone.
//!
//! `KILN_WEIGHT_MEMORY=heap` in the environment puts every weight on the heap instead, to
//! measure what the pages buy (read once, at the first weight).
//!
//! Cost: one `mmap` per chunk. Untouched pages cost no memory, so a chunk's unused tail is free;
//! each chunk's last huge page may hold up to 2 MiB of memory no weight uses. Elsewhere than
//! Linux, or when a mapping is refused, [`Elements`] falls back to the heap.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, Weak};

use crate::memory::HUGE_PAGE;

/// Bytes of a chunk that holds several weights.
pub const CHUNK: usize = 64 << 20;
/// Every buffer starts on a cache line.
const ALIGN: usize = 64;

/// Types for which all-zero bytes are a valid value, with alignment at most `ALIGN`.
///
/// # Safety
/// Implement only for types whose every all-zero bit pattern is a valid value and whose
/// alignment divides 64: [`WeightBuffer::zeroed`] hands out zero-filled memory as such values.
pub unsafe trait ZeroBits: Copy + Default + Send + Sync + 'static {}
// SAFETY: 0.0, 0 and 0 are their all-zero bit patterns; alignments 4, 2 and 1.
unsafe impl ZeroBits for f32 {}
unsafe impl ZeroBits for u16 {}
unsafe impl ZeroBits for u8 {}

/// One mapping: `len` bytes from `start`, 2 MiB-aligned, zero-filled by the system.
struct Chunk {
    /// What `mmap` returned and its length: what `munmap` takes.
    mapping: *mut libc::c_void,
    mapped: usize,
    start: *mut u8,
    len: usize,
}

// SAFETY: a chunk is plain memory; the buffers carved from it own disjoint ranges, and the
// chunk itself only unmaps on drop, when no buffer is left.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    /// Maps at least `len` bytes advised for huge pages; `None` where the system refuses (or is
    /// not Linux).
    #[cfg(target_os = "linux")]
    fn map(len: usize) -> Option<Chunk> {
        let len = len.checked_next_multiple_of(HUGE_PAGE)?;
        let mapped = len.checked_add(HUGE_PAGE)?; // room to align the start
        // SAFETY: an anonymous private mapping at an address the system picks: it touches no
        // memory of this process.
        let mapping = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if mapping == libc::MAP_FAILED {
            return None;
        }
        let offset = (mapping as usize).next_multiple_of(HUGE_PAGE) - mapping as usize;
        // SAFETY: `offset < HUGE_PAGE`, so `start..start + len` lies inside the mapping.
        let start = unsafe { mapping.cast::<u8>().add(offset) };
        // SAFETY: `start..start + len` is inside the fresh mapping, readable and zero-filled,
        // and no other reference to it exists yet; the advice reads and changes none of it.
        crate::memory::advise_huge_pages(unsafe { std::slice::from_raw_parts(start, len) });
        Some(Chunk {
            mapping,
            mapped,
            start,
            len,
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn map(_len: usize) -> Option<Chunk> {
        None
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        // SAFETY: `mapping` and `mapped` are what `mmap` returned and was given, and no buffer
        // of this chunk is left (each holds an `Arc` to it).
        unsafe {
            libc::munmap(self.mapping, self.mapped);
        }
    }
}

// ANCHOR: carve
/// The chunk being filled and how many of its bytes are handed out. `Weak`: the chunk belongs
/// to its buffers, so one whose buffers were all dropped is unmapped, not kept for later.
static FILLING: Mutex<Option<(Weak<Chunk>, usize)>> = Mutex::new(None);

/// `bytes` of zeroed memory at a 64-byte-aligned offset of some chunk: the chunk being filled
/// if it has room, else a new one (a request over half a chunk: a chunk of its own).
fn carve(bytes: usize) -> Option<(Arc<Chunk>, usize)> {
    if bytes > CHUNK / 2 {
        return Some((Arc::new(Chunk::map(bytes)?), 0));
    }
    let mut filling = FILLING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((weak, used)) = filling.as_mut()
        && let Some(chunk) = weak.upgrade()
    {
        let offset = used.next_multiple_of(ALIGN);
        if offset + bytes <= chunk.len {
            *used = offset + bytes;
            return Some((chunk, offset));
        }
    }
    let chunk = Arc::new(Chunk::map(CHUNK)?);
    *filling = Some((Arc::downgrade(&chunk), bytes));
    Some((chunk, 0))
}
// ANCHOR_END: carve

/// `len` zeroed `T`s in weight memory: a range of a chunk that no other buffer shares.
pub struct WeightBuffer<T> {
    /// Held, never read: the chunk stays mapped while this buffer lives.
    _chunk: Arc<Chunk>,
    ptr: *mut T,
    len: usize,
}

// SAFETY: the buffer owns its range exclusively (`carve` never hands a byte out twice), so it is
// as thread-safe as a `Vec<T>`.
unsafe impl<T: Send> Send for WeightBuffer<T> {}
unsafe impl<T: Sync> Sync for WeightBuffer<T> {}

impl<T: ZeroBits> WeightBuffer<T> {
    /// `len` zeros, or `None` where no weight memory can be mapped (then use the heap).
    pub fn zeroed(len: usize) -> Option<WeightBuffer<T>> {
        let bytes = len.checked_mul(size_of::<T>())?;
        let (chunk, offset) = carve(bytes.max(1))?;
        // SAFETY: `carve` returned `offset + bytes <= chunk.len`, so the pointer stays inside
        // the chunk; the mapping is zero-filled, which `ZeroBits` makes valid `T`s, and its
        // 2 MiB-aligned start plus a multiple of 64 is aligned for `T`.
        let ptr = unsafe { chunk.start.add(offset) }.cast::<T>();
        Some(WeightBuffer {
            _chunk: chunk,
            ptr,
            len,
        })
    }
}

impl<T> Deref for WeightBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr..ptr + len` is this buffer's own initialised range, alive while
        // `self._chunk` is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T> DerefMut for WeightBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference to the range.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Zeroed elements, read and written as a slice: in weight memory where the system gives it,
/// else on the heap.
pub enum Elements<T> {
    Weights(WeightBuffer<T>),
    Heap(Vec<T>),
}

/// Whether `KILN_WEIGHT_MEMORY=heap` asks for weights on the heap. Any other value is named on
/// stderr once and ignored, so that a misspelt switch does not pass for a measurement.
fn weights_on_heap() -> bool {
    static ON_HEAP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON_HEAP.get_or_init(|| match std::env::var_os("KILN_WEIGHT_MEMORY") {
        None => false,
        Some(v) if v == "heap" => true,
        Some(v) => {
            eprintln!(
                "KILN_WEIGHT_MEMORY={}: unknown value (only `heap` is known); weights go to \
                 weight memory",
                v.to_string_lossy()
            );
            false
        }
    })
}

impl<T: ZeroBits> Elements<T> {
    /// `len` zeros for a weight that lives as long as its model: weight memory (the heap under
    /// `KILN_WEIGHT_MEMORY=heap`, or where no weight memory can be mapped).
    pub fn for_weights(len: usize) -> Elements<T> {
        if weights_on_heap() {
            return Elements::on_heap(len);
        }
        match WeightBuffer::zeroed(len) {
            Some(buffer) => Elements::Weights(buffer),
            None => Elements::Heap(vec![T::default(); len]),
        }
    }

    /// `len` zeros for a short-lived value (one step's keys): the heap, whose freed memory the
    /// allocator reuses.
    pub fn on_heap(len: usize) -> Elements<T> {
        Elements::Heap(vec![T::default(); len])
    }

    /// Whether the elements are in weight memory.
    pub fn in_weight_memory(&self) -> bool {
        matches!(self, Elements::Weights(_))
    }
}

impl<T> Deref for Elements<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Elements::Weights(buffer) => buffer,
            Elements::Heap(vec) => vec,
        }
    }
}

impl<T> DerefMut for Elements<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Elements::Weights(buffer) => buffer,
            Elements::Heap(vec) => vec,
        }
    }
}

/// A copy in the same kind of memory.
impl<T: ZeroBits> Clone for Elements<T> {
    fn clone(&self) -> Elements<T> {
        match self {
            Elements::Weights(_) => {
                let mut copy = Elements::for_weights(self.len());
                copy.copy_from_slice(self);
                copy
            }
            Elements::Heap(vec) => Elements::Heap(vec.clone()),
        }
    }
}

/// Equal elements, wherever they live.
impl<T: PartialEq> PartialEq for Elements<T> {
    fn eq(&self, other: &Elements<T>) -> bool {
        self[..] == other[..]
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Elements<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self[..].fmt(f)
    }
}

/// Bytes of this process's memory on transparent huge pages (`AnonHugePages` of
/// `/proc/self/smaps_rollup`); `None` where the system does not say.
pub fn huge_page_bytes() -> Option<u64> {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = rollup.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers of many sizes, all alive at once, each written with its own pattern: none
    /// overlaps another, each starts on a cache line, and each reads back what was written.
    #[test]
    fn buffers_are_disjoint_aligned_and_zeroed() {
        let sizes = [1usize, 3, 16, 1000, 4096, 100_000, 1 << 20, 3 << 20];
        // u16 elements: just over half a chunk of bytes, a mapping of its own.
        let own = std::iter::once(CHUNK / 4 + 1);
        let mut buffers: Vec<Elements<u16>> = Vec::new();
        for (i, len) in sizes
            .iter()
            .copied()
            .cycle()
            .take(24)
            .chain(own)
            .enumerate()
        {
            let mut b = Elements::<u16>::for_weights(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&v| v == 0), "buffer {i} is zeroed");
            assert_eq!(b.as_ptr() as usize % ALIGN, 0, "buffer {i} is aligned");
            b.iter_mut().for_each(|v| *v = i as u16 + 1);
            buffers.push(b);
        }
        for (i, b) in buffers.iter().enumerate() {
            assert!(
                b.iter().all(|&v| v == i as u16 + 1),
                "buffer {i} kept its values"
            );
        }
    }

    #[test]
    fn empty_and_f32_buffers() {
        let empty = Elements::<f32>::for_weights(0);
        assert!(empty.is_empty());
        let mut x = Elements::<f32>::for_weights(7);
        x.copy_from_slice(&[1.5; 7]);
        assert_eq!(&x[..], &[1.5; 7]);
        assert!(!Elements::<f32>::on_heap(3).in_weight_memory());
        let copy = x.clone();
        assert_eq!(copy, x);
        assert_eq!(copy.in_weight_memory(), x.in_weight_memory());
        assert_ne!(copy.as_ptr(), x.as_ptr());
    }

    /// A chunk whose buffers are all dropped is unmapped: the next buffer comes from a new one
    /// (its memory reads as zeros again, though the dropped buffer had written there).
    #[test]
    fn dropped_chunks_are_released() {
        if WeightBuffer::<u8>::zeroed(1).is_none() {
            return; // no weight memory on this system: the heap serves, as tested above
        }
        for _ in 0..3 {
            let mut big = WeightBuffer::<u8>::zeroed(CHUNK / 2 + 1).expect("mapped before");
            assert!(big.iter().all(|&v| v == 0));
            big.fill(7);
            let weak = Arc::downgrade(&big._chunk);
            drop(big);
            assert!(
                weak.upgrade().is_none(),
                "the chunk went with its only buffer"
            );
        }
    }
}
