//! How [`super::QuantMatrix`] stores the 32-element formats: **rows in groups of 8,
//! interleaved**, so that one 32-byte vector holds the same 4 weights of 8 rows and one vector
//! lane is one output row.
//!
//! A file stores a matrix row after row. A kernel that keeps that layout computes one output per
//! accumulator, and pays the f32 steps of a block (scale product, conversion, multiply, add) for
//! every row. Interleaved, one set of vector instructions does those steps for 8 rows at once,
//! and the integer products need no horizontal sum: lane `r` of every vector belongs to row `r`.
//!
//! One stored block of a group (the same block `b` of its 8 rows), `8 · BYTES` bytes, exactly
//! the 8 file blocks' bytes in another order:
//!
//! ```text
//! d[8]       f16 × 8           the rows' scales, row r at bytes 2r..2r + 2
//! m[8]       f16 × 8           the rows' offsets (Q4_1, Q5_1 only)
//! per run j of 32 weights (one, or `group` for a grouped Q4_0/Q4_1 block):
//!   qh       32 bytes          Q5 only: byte 4r + i holds, at bit k, the fifth bit of
//!                              element 4k + i of row r
//!   words    W × 32 bytes      vector v: row r's quant bytes 4v..4v + 4 at bytes 4r..4r + 4
//!                              (W = 8 for Q8_0's bytes, 4 for the Q4/Q5 nibble bytes)
//! ```
//!
//! A Q4 or Q5 nibble byte `4v + i` holds element `4v + i` (low nibble) and element
//! `16 + 4v + i` (high nibble), so word vector `v` unpacks into the elements `4v..4v + 4`
//! (low nibbles) and `4(v + 4)..4(v + 4) + 4` (high nibbles) of all 8 rows: vector `k` of the
//! unpacked weights is always elements `4k..4k + 4`, which pair with one broadcast i32 of the
//! activation block. The groups follow one another, each `8 · row_bytes` bytes; a last group of
//! fewer rows is filled up with zero rows, whose outputs are never written.

use crate::format::GgmlType;

/// Rows per interleaved group.
pub const ROWS: usize = 8;

/// Where each part of one row's block lies in the file and in the interleaved block.
#[derive(Debug, Clone, Copy)]
struct Parts {
    /// f16 scales per row: 1 (`d`) or 2 (`d`, `m`).
    scales: usize,
    /// Q5's 4 bytes of fifth bits per run.
    high: bool,
    /// Quant bytes per run of 32 weights: 32 (Q8_0) or 16 (nibbles).
    quant: usize,
    /// Runs of 32 weights per block.
    runs: usize,
}

impl Parts {
    fn of(ty: GgmlType, group: usize) -> Parts {
        use GgmlType::*;
        let (scales, high, quant) = match ty {
            Q8_0 => (1, false, 32),
            Q4_0 => (1, false, 16),
            Q4_1 => (2, false, 16),
            Q5_0 => (1, true, 16),
            Q5_1 => (2, true, 16),
            _ => unreachable!("{ty} is not interleaved"),
        };
        Parts {
            scales,
            high,
            quant,
            runs: group,
        }
    }

    /// Bytes of one run in the file: its fifth bits and quants.
    fn file_run(self) -> usize {
        4 * usize::from(self.high) + self.quant
    }

    /// Bytes of one row's block in the file.
    fn file_block(self) -> usize {
        2 * self.scales + self.runs * self.file_run()
    }
}

/// Whether [`super::QuantMatrix`] stores `ty` interleaved (every 32-element format).
pub const fn interleaved(ty: GgmlType) -> bool {
    ty.block_elems() == 32
}

/// `rows` file rows of `row_bytes` each (blocks of `ty`, `group` runs per block) → the
/// interleaved layout, `rows.div_ceil(8) · 8 · row_bytes` bytes.
pub fn pack(ty: GgmlType, group: usize, rows: usize, row_bytes: usize, file: &[u8]) -> Vec<u8> {
    let parts = Parts::of(ty, group);
    let block = parts.file_block();
    let mut out = vec![0u8; rows.div_ceil(ROWS) * ROWS * row_bytes];
    if row_bytes == 0 {
        return out;
    }
    for (r, row) in file.chunks_exact(row_bytes).enumerate().take(rows) {
        let group_at = r / ROWS * ROWS * row_bytes;
        for (b, src) in row.chunks_exact(block).enumerate() {
            let dst = &mut out[group_at + b * ROWS * block..][..ROWS * block];
            for (f, p) in byte_map(parts, r % ROWS) {
                dst[p] = src[f];
            }
            for (f, p) in bit_map(parts, r % ROWS) {
                let bit = (src[f / 8] >> (f % 8)) & 1;
                dst[p / 8] |= bit << (p % 8);
            }
        }
    }
    out
}

/// Row `r`'s blocks in the file's layout, from the interleaved `packed` (`row_bytes` per row),
/// into `out[..row_bytes]`.
pub fn unpack_row(
    ty: GgmlType,
    group: usize,
    row_bytes: usize,
    packed: &[u8],
    r: usize,
    out: &mut [u8],
) {
    let parts = Parts::of(ty, group);
    let block = parts.file_block();
    let group_at = r / ROWS * ROWS * row_bytes;
    for (b, dst) in out[..row_bytes].chunks_exact_mut(block).enumerate() {
        let src = &packed[group_at + b * ROWS * block..][..ROWS * block];
        dst.fill(0);
        for (f, p) in byte_map(parts, r % ROWS) {
            dst[f] = src[p];
        }
        for (f, p) in bit_map(parts, r % ROWS) {
            let bit = (src[p / 8] >> (p % 8)) & 1;
            dst[f / 8] |= bit << (f % 8);
        }
    }
}

/// `(file byte, interleaved byte)` of every whole byte of row `r`'s block: the scales and the
/// quant bytes.
fn byte_map(parts: Parts, r: usize) -> impl Iterator<Item = (usize, usize)> {
    // d of row r at 2r, m at 16 + 2r.
    let scales = (0..parts.scales)
        .flat_map(move |s| (0..2).map(move |i| (2 * s + i, 2 * ROWS * s + 2 * r + i)));
    let quants = (0..parts.runs).flat_map(move |j| {
        let (f, p) = run_starts(parts, j);
        let (f, p) = if parts.high { (f + 4, p + 32) } else { (f, p) };
        // Quant bytes 4v..4v + 4 ↔ bytes 4r..4r + 4 of word vector v.
        (0..parts.quant).map(move |l| (f + l, p + 32 * (l / 4) + 4 * r + l % 4))
    });
    scales.chain(quants)
}

/// `(file bit, interleaved bit)`, counted from the block's first byte, of row `r`'s fifth bits:
/// bit l of the run's u32 ↔ bit l / 4 of byte 4r + l % 4 of the plane.
fn bit_map(parts: Parts, r: usize) -> impl Iterator<Item = (usize, usize)> {
    let runs = if parts.high { parts.runs } else { 0 };
    (0..runs).flat_map(move |j| {
        let (f, p) = run_starts(parts, j);
        (0..32).map(move |l| (8 * f + l, 8 * (p + 4 * r + l % 4) + l / 4))
    })
}

/// Where run `j` starts in a row's file block and in the interleaved block.
fn run_starts(parts: Parts, j: usize) -> (usize, usize) {
    (
        2 * parts.scales + j * parts.file_run(),
        2 * ROWS * parts.scales + j * ROWS * parts.file_run(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpack_row_undoes_pack_for_every_format_and_ragged_row_counts() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let cases = [
            (GgmlType::Q8_0, 1),
            (GgmlType::Q4_0, 1),
            (GgmlType::Q4_1, 1),
            (GgmlType::Q5_0, 1),
            (GgmlType::Q5_1, 1),
            (GgmlType::Q4_0, 4),
            (GgmlType::Q4_1, 8),
        ];
        for (ty, group) in cases {
            let block = Parts::of(ty, group).file_block();
            for rows in [1, 7, 8, 9, 17] {
                let row_bytes = 3 * block;
                let file: Vec<u8> = (0..rows * row_bytes)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        state as u8
                    })
                    .collect();
                let packed = pack(ty, group, rows, row_bytes, &file);
                assert_eq!(packed.len(), rows.div_ceil(8) * 8 * row_bytes);
                let mut row = vec![0u8; row_bytes];
                for r in 0..rows {
                    unpack_row(ty, group, row_bytes, &packed, r, &mut row);
                    assert_eq!(
                        row,
                        file[r * row_bytes..][..row_bytes],
                        "{ty} g{group} row {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_word_vector_holds_four_quant_bytes_of_each_row() {
        // Q8_0, two rows: row r's quant byte l is 100r + l.
        let row_bytes = 34;
        let mut file = vec![0u8; 2 * row_bytes];
        for r in 0..2 {
            for l in 0..32 {
                file[r * row_bytes + 2 + l] = (100 * r + l) as u8;
            }
        }
        let packed = pack(GgmlType::Q8_0, 1, 2, row_bytes, &file);
        // Vector 3 starts at 16 + 3·32; row 1's bytes 12..16 are at 4..8 of it.
        assert_eq!(packed[16 + 96 + 4..16 + 96 + 8], [112, 113, 114, 115]);
        assert_eq!(packed[16 + 96..16 + 96 + 4], [12, 13, 14, 15]);
    }
}
