//! A step's index arrays: row offsets, positions, block tables, slots, token ids. They are built
//! and checked on the host ([`BatchIndex`]), end to end in one buffer, and go to the device in
//! one copy ([`GpuDevice::upload`]), into a buffer a caller can keep across steps
//! ([`PagedBatch::into_buffer`]): a steady decode step allocates no device memory for them.

use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView};

use super::CudaError;
use super::device::GpuDevice;

/// One sequence of a step on the host side: `rows` query rows at positions
/// `start_pos..start_pos + rows`, its K/V in the blocks of `block_table`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRows {
    pub start_pos: usize,
    pub rows: usize,
    pub block_table: Vec<u32>,
}

/// The sizes of a step, which the kernels' launches read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchShape {
    pub num_rows: usize,
    pub num_seqs: usize,
    pub max_rows: usize,
    pub max_blocks: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// The longest context (last position + 1) of any sequence.
    pub max_context: usize,
    /// Every sequence has exactly one row (a decode step): the split-K kernel applies.
    pub all_single_rows: bool,
}

/// Where each array sits in the packed buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    /// `[seqs + 1]`: each sequence's first row, then the row count.
    row_start: Range<usize>,
    /// `[seqs]`: each sequence's first position.
    start_pos: Range<usize>,
    /// `[seqs, max_blocks]`: each table padded with block 0.
    block_tables: Range<usize>,
    /// `[rows]`: where each row's K/V goes.
    slots: Range<usize>,
    /// `[rows]`: each row's position (RoPE's).
    positions: Range<usize>,
    /// `[seqs]`: each sequence's last row (the decode kernel's).
    rows: Range<usize>,
    /// `[seqs]`: each sequence's last position + 1.
    context_lens: Range<usize>,
    /// Arrays of ids, each id below the bound beside it.
    ids: Vec<(Range<usize>, usize)>,
}

// ANCHOR: batch_index
/// A step's arrays on the host, end to end in `data`, as [`GpuDevice::upload`] copies them.
///
/// Invariants (checked by [`BatchIndex::new`] and [`BatchIndex::push_ids`]): every sequence has
/// at least one row; every block id is below `num_blocks`; each table covers `start_pos + rows`
/// positions; the slots are every row's, in order, each below `num_blocks · block_size`; every
/// value fits in 32 bits; each array of ids holds only ids below its bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchIndex {
    data: Vec<u32>,
    layout: Layout,
    pub shape: BatchShape,
}

impl BatchIndex {
    /// The arrays of `seqs`, whose K/V live in a pool of `num_blocks` blocks of `block_size`.
    pub fn new(
        seqs: &[SeqRows],
        block_size: usize,
        num_blocks: usize,
    ) -> Result<BatchIndex, CudaError> {
        if block_size == 0 || seqs.is_empty() {
            return Err(shape(
                "a batch needs a block size and at least one sequence",
            ));
        }
        let pool_slots = num_blocks
            .checked_mul(block_size)
            .ok_or_else(|| shape(format!("{num_blocks} blocks of {block_size} positions")))?;
        u32_arg("slots", pool_slots)?;
        let max_blocks = seqs
            .iter()
            .map(|s| s.block_table.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let (mut row_start, mut start_pos, mut tables) = (vec![0u32], vec![], vec![]);
        let (mut slots, mut positions) = (vec![], vec![]);
        let (mut rows, mut context_lens) = (vec![], vec![]);
        let mut rows_before = 0usize; // rows of the sequences before this one
        for (i, seq) in seqs.iter().enumerate() {
            let end = seq.start_pos + seq.rows;
            if seq.rows == 0 || seq.block_table.len() * block_size < end {
                return Err(shape(format!(
                    "sequence {i}: {} rows from position {}, blocks for {} positions",
                    seq.rows,
                    seq.start_pos,
                    seq.block_table.len() * block_size
                )));
            }
            if let Some(&bad) = seq.block_table.iter().find(|&&b| b as usize >= num_blocks) {
                return Err(shape(format!("sequence {i}: block {bad} of {num_blocks}")));
            }
            rows.push(u32_arg("row", rows_before + seq.rows - 1)?);
            context_lens.push(u32_arg("context", end)?);
            for pos in seq.start_pos..end {
                let block = seq.block_table[pos / block_size] as usize;
                // Below num_blocks · block_size, which fits in 32 bits (checked above).
                slots.push((block * block_size + pos % block_size) as u32);
                positions.push(u32_arg("position", pos)?);
            }
            rows_before += seq.rows;
            row_start.push(u32_arg("rows", rows_before)?);
            start_pos.push(u32_arg("start_pos", seq.start_pos)?);
            tables.extend_from_slice(&seq.block_table);
            tables.resize((i + 1) * max_blocks, 0);
        }
        let mut data = Vec::new();
        let mut append = |values: &[u32]| {
            let at = data.len();
            data.extend_from_slice(values);
            at..data.len()
        };
        let layout = Layout {
            row_start: append(&row_start),
            start_pos: append(&start_pos),
            block_tables: append(&tables),
            slots: append(&slots),
            positions: append(&positions),
            rows: append(&rows),
            context_lens: append(&context_lens),
            ids: vec![],
        };
        let shape = BatchShape {
            num_rows: rows_before,
            num_seqs: seqs.len(),
            max_rows: seqs.iter().map(|s| s.rows).max().unwrap_or(0),
            max_blocks,
            block_size,
            num_blocks,
            max_context: seqs.iter().map(|s| s.start_pos + s.rows).max().unwrap_or(0),
            all_single_rows: seqs.iter().all(|s| s.rows == 1),
        };
        Ok(BatchIndex {
            data,
            layout,
            shape,
        })
    }

    /// Appends `ids`, each of which must be below `bound` (token ids below the vocabulary, rows
    /// below the step's row count), to go up in the same copy; returns the number
    /// [`PagedBatch::ids`] takes.
    pub fn push_ids(&mut self, ids: &[u32], bound: usize) -> Result<usize, CudaError> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= bound) {
            return Err(shape(format!("id {bad} is not below {bound}")));
        }
        let at = self.data.len();
        self.data.extend_from_slice(ids);
        self.layout.ids.push((at..self.data.len(), bound));
        Ok(self.layout.ids.len() - 1)
    }
}
// ANCHOR_END: batch_index

/// A step's arrays on the device, which the attention, KV-write, RoPE and embedding kernels
/// read: a [`BatchIndex`] (whose invariants it keeps) copied into `index`.
pub struct PagedBatch {
    pub shape: BatchShape,
    index: CudaSlice<u32>,
    layout: Layout,
}

impl std::ops::Deref for PagedBatch {
    type Target = BatchShape;

    fn deref(&self) -> &BatchShape {
        &self.shape
    }
}

impl PagedBatch {
    fn view(&self, range: &Range<usize>) -> CudaView<'_, u32> {
        self.index.slice(range.clone())
    }

    pub(super) fn row_start(&self) -> CudaView<'_, u32> {
        self.view(&self.layout.row_start)
    }

    pub(super) fn start_pos(&self) -> CudaView<'_, u32> {
        self.view(&self.layout.start_pos)
    }

    pub(super) fn block_tables(&self) -> CudaView<'_, u32> {
        self.view(&self.layout.block_tables)
    }

    pub(super) fn slots(&self) -> CudaView<'_, u32> {
        self.view(&self.layout.slots)
    }

    pub(super) fn rows(&self) -> CudaView<'_, u32> {
        self.view(&self.layout.rows)
    }

    pub(super) fn context_lens(&self) -> CudaView<'_, u32> {
        self.view(&self.layout.context_lens)
    }

    /// Each row's position, `[num_rows]`.
    pub fn positions(&self) -> CudaView<'_, u32> {
        self.view(&self.layout.positions)
    }

    /// The ids [`BatchIndex::push_ids`] appended as number `i`.
    ///
    /// # Panics
    /// If `i` is not a number `push_ids` returned for this batch's index: a programming error.
    pub fn ids(&self, i: usize) -> DeviceTokens<'_> {
        let (range, bound) = &self.layout.ids[i];
        DeviceTokens {
            ids: self.view(range),
            vocab: *bound,
        }
    }

    /// The device buffer, for [`GpuDevice::upload`] to copy a later step into.
    pub fn into_buffer(self) -> CudaSlice<u32> {
        self.index
    }
}

/// Token ids on the device. Invariant: every id is below `vocab`.
pub struct DeviceTokens<'a> {
    pub(super) ids: CudaView<'a, u32>,
    pub(super) vocab: usize,
}

impl DeviceTokens<'_> {
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.len() == 0
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The ids on the device.
    pub fn view(&self) -> &CudaView<'_, u32> {
        &self.ids
    }
}

/// Token ids uploaded on their own ([`GpuDevice::upload_tokens`]). Invariant: every id is below
/// `vocab`.
pub struct UploadedTokens {
    ids: CudaSlice<u32>,
    vocab: usize,
}

impl UploadedTokens {
    pub fn view(&self) -> DeviceTokens<'_> {
        DeviceTokens {
            ids: self.ids.as_view(),
            vocab: self.vocab,
        }
    }
}

impl GpuDevice {
    /// Uploads token ids, checking each is below `vocab`.
    pub fn upload_tokens(&self, ids: &[u32], vocab: usize) -> Result<UploadedTokens, CudaError> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(shape(format!(
                "token id {bad} is not below the vocabulary size {vocab}"
            )));
        }
        Ok(UploadedTokens {
            ids: self.stream.clone_htod(ids)?,
            vocab,
        })
    }

    /// Uploads a step's sequences ([`BatchIndex::new`]) into a new buffer.
    pub fn upload_batch(
        &self,
        seqs: &[SeqRows],
        block_size: usize,
        num_blocks: usize,
    ) -> Result<PagedBatch, CudaError> {
        self.upload(BatchIndex::new(seqs, block_size, num_blocks)?, None)
    }

    // ANCHOR: upload
    /// Copies `index` to the device in one transfer: into `kept` when it holds enough elements,
    /// else into a new buffer (`kept` freed).
    pub fn upload(
        &self,
        index: BatchIndex,
        kept: Option<CudaSlice<u32>>,
    ) -> Result<PagedBatch, CudaError> {
        let len = index.data.len();
        let mut buffer = match kept {
            Some(b) if b.len() >= len => b,
            old => {
                drop(old);
                // SAFETY: the copy below writes the first `len` elements, and the views of
                // PagedBatch read only those (its layout's ranges end at `len`).
                unsafe { self.stream.alloc::<u32>(len) }?
            }
        };
        self.stream
            .memcpy_htod(&index.data, &mut buffer.slice_mut(..len))?;
        Ok(PagedBatch {
            shape: index.shape,
            index: buffer,
            layout: index.layout,
        })
    }
    // ANCHOR_END: upload
}

fn shape(what: impl Into<String>) -> CudaError {
    CudaError::Shape(what.into())
}

fn u32_arg(name: &str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| shape(format!("{name} = {value} does not fit in 32 bits")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(start_pos: usize, rows: usize, block_table: &[u32]) -> SeqRows {
        SeqRows {
            start_pos,
            rows,
            block_table: block_table.to_vec(),
        }
    }

    fn array<'a>(index: &'a BatchIndex, range: &Range<usize>) -> &'a [u32] {
        &index.data[range.clone()]
    }

    #[test]
    fn every_array_of_a_step_in_one_buffer() {
        // A prefill of 3 rows from position 2 over blocks [5, 1] (block size 4), and a decode
        // at position 6 over [0, 3]: rows 0..3 and 3.
        let seqs = [seq(2, 3, &[5, 1]), seq(6, 1, &[0, 3, 7])];
        let mut index = BatchIndex::new(&seqs, 4, 8).unwrap();
        let tokens = index.push_ids(&[9, 8, 7, 6], 10).unwrap();
        let wanted = index.push_ids(&[2, 3], 4).unwrap();
        let l = &index.layout;
        assert_eq!(array(&index, &l.row_start), [0, 3, 4]);
        assert_eq!(array(&index, &l.start_pos), [2, 6]);
        assert_eq!(array(&index, &l.block_tables), [5, 1, 0, 0, 3, 7]);
        // Positions 2, 3 in block 5 (slots 22, 23), 4 in block 1 (slot 4); 6 in block 3 (14).
        assert_eq!(array(&index, &l.slots), [22, 23, 4, 14]);
        assert_eq!(array(&index, &l.positions), [2, 3, 4, 6]);
        assert_eq!(array(&index, &l.rows), [2, 3]);
        assert_eq!(array(&index, &l.context_lens), [5, 7]);
        assert_eq!((tokens, wanted), (0, 1));
        assert_eq!(array(&index, &l.ids[0].0), [9, 8, 7, 6]);
        assert_eq!(array(&index, &l.ids[1].0), [2, 3]);
        assert_eq!((l.ids[0].1, l.ids[1].1), (10, 4));
        // The arrays tile the buffer end to end.
        assert_eq!(l.row_start.start, 0);
        assert_eq!(l.ids[1].0.end, index.data.len());
        let s = index.shape;
        assert_eq!(
            (s.num_rows, s.num_seqs, s.max_rows, s.max_blocks),
            (4, 2, 3, 3)
        );
        assert_eq!((s.max_context, s.all_single_rows), (7, false));
        let decode = BatchIndex::new(&[seq(6, 1, &[0, 3])], 4, 8).unwrap();
        assert!(decode.shape.all_single_rows);
    }

    #[test]
    fn bad_batches_and_ids_are_errors() {
        let bad = |seqs: &[SeqRows], block_size, num_blocks| {
            matches!(
                BatchIndex::new(seqs, block_size, num_blocks),
                Err(CudaError::Shape(_))
            )
        };
        assert!(bad(&[], 4, 8), "no sequence");
        assert!(bad(&[seq(0, 1, &[0])], 0, 8), "block size 0");
        assert!(bad(&[seq(0, 0, &[0])], 4, 8), "no row");
        assert!(
            bad(&[seq(3, 2, &[0])], 4, 8),
            "a table short of the last position"
        );
        assert!(bad(&[seq(0, 1, &[8])], 4, 8), "a block past the pool");
        assert!(
            bad(&[seq(0, 1, &[0])], 1 << 16, 1 << 16),
            "slots past 32 bits"
        );
        assert!(bad(&[seq(0, 1, &[0])], usize::MAX, 2), "slots past usize");
        let mut index = BatchIndex::new(&[seq(0, 2, &[0])], 4, 8).unwrap();
        let before = index.clone();
        assert!(matches!(
            index.push_ids(&[3, 10], 10),
            Err(CudaError::Shape(_))
        ));
        assert_eq!(index, before, "a refused array leaves the index as it was");
    }
}
