//! Asking for a product's next weight panels while the present ones are multiplied.
//!
//! A step of a few dozen tokens (a batch-32 decode step, a short prompt) multiplies each pair of
//! panels by a few token tiles, then moves on to the next pair. The first tile reads the pair
//! from memory and waits on it; the others find it in the cache and are bound by arithmetic,
//! while the memory system idles. So each tile also *prefetches* its share of the pair its task
//! computes next: tile `i` of `tiles` asks for rows `i · k / tiles ..` of the next panels,
//! spread evenly over its `k` steps (at most one row of each panel per step), so that the
//! requests overlap the multiply-adds rather than queue up in one burst. The aim is that the next
//! pair's weights are in L2 when its turn comes, the stream from memory one pair ahead of the
//! arithmetic; what was measured is the time it saves (`examples/panels_ahead.rs`). Requests are
//! hints: they change no result.
//!
//! Only the panels of the same task are asked for (another thread may take the next task), so a
//! task of one pair asks for nothing: with many threads SmolLM2's small projections are cut into
//! such tasks. And only a product of `AHEAD_FROM_TILES` to `AHEAD_UP_TO_TILES` tiles whose
//! panels are read as stored (not widened) asks (see there), but for the pairs that go in
//! stretches (`pair_in_stretches`, 2 and 3 tiles on AVX-512), which hide the first tile's wait
//! by another order of the loops.

use super::NR;
use super::vector::{CACHE_LINE as LINE, prefetch_l2};

/// The weight panels a task computes next ([k][NR] each, or empty) and the number of token
/// tiles that share the requests for them.
pub(super) struct Ahead<'a, V> {
    pub next: [&'a [V]; 2],
    pub tiles: usize,
}

impl<'a, V> Ahead<'a, V> {
    /// Tile `tile`'s share of the rows of each next panel, as [`Requests`] over a tile of `k`
    /// steps.
    pub fn share(&self, tile: usize, k: usize) -> Requests<'a, V> {
        let row = |i: usize| (i * k / self.tiles.max(1)).min(k) * NR;
        let next = self.next.map(|n| match n.len() >= k * NR {
            true => &n[row(tile)..row(tile + 1)],
            false => &[][..],
        });
        Requests {
            rows: next[0].len().max(next[1].len()) / NR,
            next,
            asked: 0,
            due: 0,
            k: k.max(1),
            lines: [NewLines::default(), NewLines::default()],
        }
    }
}

/// One tile's requests: `rows` rows of each of two panels over `k` steps of its loop.
pub struct Requests<'a, V> {
    next: [&'a [V]; 2],
    rows: usize,
    /// Rows asked for so far.
    asked: usize,
    /// The steps' share of the rows not yet asked for, times `k` (an error term, as in drawing
    /// a line on a grid: no division per step).
    due: usize,
    k: usize,
    /// Each panel's last line asked for.
    lines: [NewLines; 2],
}

// ANCHOR: requests
impl<V> Requests<'_, V> {
    /// One step of the tile's loop: asks for the row that falls due at it, if one does (a share
    /// has at most `k` rows, so at most one falls due per step), unless the cache line it begins
    /// in was the last one asked for (a bf16 row is half a line).
    #[inline(always)]
    pub fn step(&mut self) {
        self.due += self.rows;
        if self.due >= self.k {
            let row = self.asked * NR;
            for (panel, lines) in self.next.iter().zip(&mut self.lines) {
                if let Some(row) = panel.get(row..row + NR)
                    && lines.is_new(row.as_ptr() as usize)
                {
                    prefetch_l2(row);
                }
            }
            self.asked += 1;
            self.due -= self.k;
        }
    }
}
// ANCHOR_END: requests

/// The cache line last asked for in one panel: rows asked in order fall in lines in order, so a
/// row whose line is the last one's needs no request of its own.
#[derive(Default)]
struct NewLines {
    last: Option<usize>,
}

impl NewLines {
    /// Whether the line holding `address` differs from the last one seen (and it is now the last).
    #[inline(always)]
    fn is_new(&mut self, address: usize) -> bool {
        let line = address / LINE;
        let new = self.last != Some(line);
        self.last = Some(line);
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiles' shares cut each next panel into consecutive pieces that cover it once, and
    /// each tile's loop of `k` steps asks for the rows of its share evenly: after step `s`,
    /// `⌊(s + 1) · rows / k⌋` of them, so every row by the last step and never two at once.
    #[test]
    fn the_tiles_ask_for_every_row_of_the_next_panels_once_and_evenly() {
        for k in [1, 2, 7, 64, 576, 1536] {
            for tiles in 1..=13 {
                let panel: Vec<f32> = (0..k * NR).map(|i| i as f32).collect();
                let ahead = Ahead {
                    next: [&panel[..], &[][..]],
                    tiles,
                };
                let mut covered = Vec::new();
                for tile in 0..tiles {
                    let mut requests = ahead.share(tile, k);
                    covered.extend_from_slice(requests.next[0]);
                    assert!(requests.rows <= k);
                    for step in 0..k {
                        requests.step();
                        assert_eq!(
                            requests.asked,
                            (step + 1) * requests.rows / k,
                            "k {k}, tile {tile} of {tiles}, step {step}"
                        );
                    }
                    assert_eq!(requests.next[1], &[] as &[f32]);
                }
                assert_eq!(covered, panel, "k {k}, {tiles} tiles");
            }
        }
    }

    /// Rows of bf16 (half a line) asked in order, from any first row and any alignment: every
    /// line in which a row begins is new exactly once (with weight memory's 64-byte alignment,
    /// that is every line of the rows; on an unaligned heap buffer the line holding only the
    /// last row's end is left to the hardware).
    #[test]
    fn each_line_where_a_row_begins_is_asked_for_once() {
        #[repr(align(64))]
        struct OnALine([u16; 41 * NR]);
        let panel = OnALine([0; 41 * NR]);
        let panel = &panel.0;
        let mut aligned_runs = 0;
        for skew in 0..2 {
            for first in 0..6 {
                for last in first + 1..40 {
                    let rows = &panel[skew + first * NR..skew + last * NR];
                    let mut lines = NewLines::default();
                    let starts = rows.chunks_exact(NR).map(|r| r.as_ptr() as usize / LINE);
                    let asked: Vec<usize> = starts
                        .clone()
                        .filter(|&line| lines.is_new(line * LINE))
                        .collect();
                    let mut expected: Vec<usize> = starts.collect();
                    expected.dedup();
                    assert_eq!(asked, expected, "rows {first}..{last}, skew {skew}");
                    if (rows.as_ptr() as usize).is_multiple_of(LINE) {
                        let end = (rows.as_ptr() as usize + size_of_val(rows) - 1) / LINE;
                        assert_eq!(asked.last(), Some(&end), "aligned: the last line too");
                        aligned_runs += 1;
                    }
                }
            }
        }
        assert!(aligned_runs > 0);
    }

    /// A panel shorter than `k` rows (none next, or a corner that does not fit) asks for nothing.
    #[test]
    fn an_empty_or_short_next_panel_asks_for_nothing() {
        let short = [0u16; 3 * NR];
        let ahead = Ahead {
            next: [&[][..], &short[..]],
            tiles: 2,
        };
        let mut requests = ahead.share(1, 4);
        for _ in 0..4 {
            requests.step();
        }
        assert_eq!((requests.rows, requests.asked), (0, 0));
    }
}
