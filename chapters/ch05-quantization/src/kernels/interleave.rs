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
//! activation block. The groups follow one another; a last group of fewer rows is filled up with
//! zero rows, whose outputs are never written.
//!
//! Q4_K and Q6_K are interleaved the same way, a super-block of 256 weights of 8 rows at a time
//! (`ktiles.rs`): the 8 rows' `d` (and Q4_K's `dmin`), their sub-block scales as bytes
//! `[sub-block][row]` (Q4_K's 6-bit scales and mins unpacked, 32 bytes more than the file's 12
//! per row: 8 · 144 + 32; Q6_K's are bytes already), then the quant bytes as word vectors:
//! Q4_K's 128 nibble bytes as 32 vectors in order (vector `8i + v`: its low nibbles are
//! sub-block `2i`'s elements `4v..4v + 4`, its high nibbles sub-block `2i + 1`'s), Q6_K's `ql`
//! and `qh` as triples of vectors, one per word `v` of each half, so that the kernel reads a
//! block front to back. Q5_K keeps the file's rows.

use crate::blocks::q4_k::{pack_scale_min, scale_min};
use crate::format::GgmlType;

/// Rows per interleaved group.
pub const ROWS: usize = 8;

/// Where each part of one row's block lies in the file and in the interleaved block (the
/// 32-element formats).
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
            _ => unreachable!("{ty} is not a 32-element format"),
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

/// Whether [`super::QuantMatrix`] stores `ty` interleaved: every 32-element format, Q4_K and
/// Q6_K (Q5_K keeps the file's rows).
pub const fn interleaved(ty: GgmlType) -> bool {
    ty.block_elems() == 32 || matches!(ty, GgmlType::Q4K | GgmlType::Q6K)
}

/// Bytes of one row's block in the file (`group` blocks of 32 sharing a header for a grouped
/// Q4_0/Q4_1).
fn file_block(ty: GgmlType, group: usize) -> usize {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => ty.block_bytes(),
        _ => Parts::of(ty, group).file_block(),
    }
}

/// Bytes of one interleaved block, the same block of 8 rows: the 8 file blocks' bytes in another
/// order, but for Q4_K, whose 6-bit scales and mins are stored as bytes (8 · 144 + 32).
pub fn block_bytes(ty: GgmlType, group: usize) -> usize {
    match ty {
        GgmlType::Q4K => Q4K_BLOCK,
        _ => ROWS * file_block(ty, group),
    }
}

/// An interleaved Q4_K block: `d[8]`, `dmin[8]` (f16), `sc[8 sub-blocks][8 rows]`,
/// `m[8][8]` (bytes), then the 32 word vectors of the nibbles.
const Q4K_BLOCK: usize = 16 + 16 + 64 + 64 + 32 * 32;
/// Where an interleaved Q4_K block's scales, mins and nibbles start.
pub const Q4K_SC: usize = 32;
pub const Q4K_M: usize = 96;
pub const Q4K_QS: usize = 160;
/// Where an interleaved Q6_K block's (`d[8]` f16 first) scales `sc[16 sub-blocks][8 rows]`
/// (i8) and its words start: for half h < 2 and word v < 8, three word vectors side by side,
/// `ql` bytes `64h + 4v..` (chunk a), `64h + 32 + 4v..` (chunk b) and `qh` bytes `32h + 4v..`.
pub const Q6K_SC: usize = 16;
pub const Q6K_WORDS: usize = 144;

/// `rows` file rows of `row_bytes` each (blocks of `ty`, `group` runs per block) → the
/// interleaved layout: `rows.div_ceil(8)` groups of `row_bytes / file block` interleaved blocks.
pub fn pack(ty: GgmlType, group: usize, rows: usize, row_bytes: usize, file: &[u8]) -> Vec<u8> {
    let (fb, pb) = (file_block(ty, group), block_bytes(ty, group));
    let group_bytes = row_bytes / fb * pb;
    let mut out = vec![0u8; rows.div_ceil(ROWS) * group_bytes];
    if row_bytes == 0 {
        return out;
    }
    // Where each byte of a block goes, for each row of a group: worked out once.
    let maps: [Vec<(usize, usize)>; ROWS] = std::array::from_fn(|r| {
        let mut map = Vec::new();
        for_each_byte(ty, group, r, |f, p| map.push((f, p)));
        map
    });
    for (r, row) in file.chunks_exact(row_bytes).enumerate().take(rows) {
        for (b, src) in row.chunks_exact(fb).enumerate() {
            let dst = &mut out[r / ROWS * group_bytes + b * pb..][..pb];
            for &(f, p) in &maps[r % ROWS] {
                dst[p] = src[f];
            }
            for (f, p) in bit_map(ty, group, r % ROWS) {
                let bit = (src[f / 8] >> (f % 8)) & 1;
                dst[p / 8] |= bit << (p % 8);
            }
            if ty == GgmlType::Q4K {
                let (sc, m) = scale_min(&src[4..16]);
                for j in 0..8 {
                    dst[Q4K_SC + ROWS * j + r % ROWS] = sc[j];
                    dst[Q4K_M + ROWS * j + r % ROWS] = m[j];
                }
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
    let (fb, pb) = (file_block(ty, group), block_bytes(ty, group));
    let group_bytes = row_bytes / fb * pb;
    for (b, dst) in out[..row_bytes].chunks_exact_mut(fb).enumerate() {
        let src = &packed[r / ROWS * group_bytes + b * pb..][..pb];
        dst.fill(0);
        for_each_byte(ty, group, r % ROWS, |f, p| dst[f] = src[p]);
        for (f, p) in bit_map(ty, group, r % ROWS) {
            let bit = (src[p / 8] >> (p % 8)) & 1;
            dst[f / 8] |= bit << (f % 8);
        }
        if ty == GgmlType::Q4K {
            let sc = std::array::from_fn(|j| src[Q4K_SC + ROWS * j + r % ROWS]);
            let m = std::array::from_fn(|j| src[Q4K_M + ROWS * j + r % ROWS]);
            dst[4..16].copy_from_slice(&pack_scale_min(&sc, &m));
        }
    }
}

/// Calls `f(file byte, interleaved byte)` for every whole byte of row `r`'s block that moves as
/// a byte (all but Q5's fifth bits and Q4_K's packed scales). Allocates nothing.
fn for_each_byte(ty: GgmlType, group: usize, r: usize, mut f: impl FnMut(usize, usize)) {
    // The f16 of the file block at `at` ↔ row r's slot in the 8 f16 at `to`.
    let half = |f: &mut dyn FnMut(usize, usize), at: usize, to: usize| {
        (0..2).for_each(|i| f(at + i, to + 2 * r + i))
    };
    match ty {
        GgmlType::Q4K => {
            half(&mut f, 0, 0);
            half(&mut f, 2, 16);
            words(16, Q4K_QS, 128, 32, r).for_each(|(a, b)| f(a, b));
        }
        GgmlType::Q6K => {
            half(&mut f, 208, 0);
            (0..16).for_each(|j| f(192 + j, Q6K_SC + ROWS * j + r));
            for h in 0..2 {
                let triple = |c: usize| Q6K_WORDS + 96 * 8 * h + 32 * c;
                words(64 * h, triple(0), 32, 96, r)
                    .chain(words(64 * h + 32, triple(1), 32, 96, r))
                    .chain(words(128 + 32 * h, triple(2), 32, 96, r))
                    .for_each(|(a, b)| f(a, b));
            }
        }
        _ => {
            let parts = Parts::of(ty, group);
            // d of row r at 2r, m at 16 + 2r.
            (0..parts.scales).for_each(|s| half(&mut f, 2 * s, 2 * ROWS * s));
            for j in 0..parts.runs {
                let (at, to) = run_starts(parts, j);
                let (at, to) = if parts.high {
                    (at + 4, to + 32)
                } else {
                    (at, to)
                };
                words(at, to, parts.quant, 32, r).for_each(|(a, b)| f(a, b));
            }
        }
    }
}

/// The word vectors of `bytes` file bytes at `at`: file bytes `4v..4v + 4` ↔ bytes `4r..4r + 4`
/// of word vector `v` (32 bytes), the vectors `stride` bytes apart from `to` on.
fn words(
    at: usize,
    to: usize,
    bytes: usize,
    stride: usize,
    r: usize,
) -> impl Iterator<Item = (usize, usize)> {
    (0..bytes).map(move |l| (at + l, to + stride * (l / 4) + 4 * r + l % 4))
}

/// `(file bit, interleaved bit)`, counted from the block's first byte, of row `r`'s fifth bits
/// (Q5_0, Q5_1): bit l of the run's u32 ↔ bit l / 4 of byte 4r + l % 4 of the plane.
fn bit_map(ty: GgmlType, group: usize, r: usize) -> impl Iterator<Item = (usize, usize)> {
    let parts = (ty.block_elems() == 32).then(|| Parts::of(ty, group));
    let runs = parts.filter(|p| p.high).map_or(0, |p| p.runs);
    (0..runs).flat_map(move |j| {
        let (f, p) = run_starts(parts.expect("a 32-element format"), j);
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
    use super::super::test_util::random_rows;
    use super::*;

    #[test]
    fn unpack_row_undoes_pack_for_every_format_and_ragged_row_counts() {
        let cases = [
            (GgmlType::Q8_0, 1),
            (GgmlType::Q4_0, 1),
            (GgmlType::Q4_1, 1),
            (GgmlType::Q5_0, 1),
            (GgmlType::Q5_1, 1),
            (GgmlType::Q4_0, 4),
            (GgmlType::Q4_1, 8),
            (GgmlType::Q4K, 1),
            (GgmlType::Q6K, 1),
        ];
        for (ty, group) in cases {
            let block = file_block(ty, group);
            for rows in [1, 7, 8, 9, 17] {
                let row_bytes = 3 * block;
                let file = random_rows(rows * row_bytes, block, &[], (rows * block) as u64);
                if ty == GgmlType::Q4K {
                    // Q4_K's 12 bytes of scales hold 6-bit values: every byte pattern is one.
                    for b in file.chunks_exact(block) {
                        let (sc, m) = scale_min(&b[4..16]);
                        assert_eq!(pack_scale_min(&sc, &m), b[4..16]);
                    }
                }
                let packed = pack(ty, group, rows, row_bytes, &file);
                assert_eq!(packed.len(), rows.div_ceil(8) * 3 * block_bytes(ty, group));
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
