//! Asking for a product's next weight panels while the present ones are multiplied.
//!
//! A step of a few dozen tokens (a batch-32 decode step, a short prompt) multiplies each pair of
//! panels by a few token tiles, then moves on to the next pair. The first tile reads the pair
//! from memory and waits on it; the others find it in the cache and are bound by arithmetic,
//! while the memory system idles. So each tile also *prefetches* its share of the pair that
//! comes next: tile `i` of `tiles` asks for rows `i · k / tiles ..` of the next panels, spread
//! evenly over its `k` steps, a request or two per step, so that the requests overlap the
//! multiply-adds instead of stalling them in a burst. When the next pair's turn comes its
//! weights are in L2, and the stream from memory runs one pair ahead of the arithmetic.
//! Requests are hints: they change no result.

use super::NR;

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
}

// ANCHOR: requests
impl<V> Requests<'_, V> {
    /// One step of the tile's loop: asks for the rows that fall due at it.
    #[inline(always)]
    pub fn step(&mut self) {
        self.due += self.rows;
        while self.due >= self.k {
            for panel in self.next {
                if let Some(row) = panel.get(self.asked * NR) {
                    prefetch(row);
                }
            }
            self.asked += 1;
            self.due -= self.k;
        }
    }
}
// ANCHOR_END: requests

/// Asks for the cache line holding `value` to be brought into L2 (and L3). A hint: it reads
/// nothing the program can see.
#[inline(always)]
fn prefetch<V>(value: &V) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86-64; a prefetch of a valid reference's address reads nothing.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T1>(value as *const V as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiles' shares cut each next panel into consecutive pieces that cover it once, and
    /// each tile's loop of `k` steps asks for every row of its share, once each, the last by its
    /// last step.
    #[test]
    fn the_tiles_ask_for_every_row_of_the_next_panels_once() {
        for k in [1, 2, 7, 64, 576, 1536] {
            for tiles in 1..=13 {
                let panel: Vec<f32> = (0..k * NR).map(|i| i as f32).collect();
                let ahead = Ahead {
                    next: [&panel[..], &panel[..]],
                    tiles,
                };
                let mut covered = Vec::new();
                for tile in 0..tiles {
                    let mut requests = ahead.share(tile, k);
                    assert_eq!(requests.next[0], requests.next[1]);
                    covered.extend_from_slice(requests.next[0]);
                    for _ in 0..k {
                        requests.step();
                    }
                    assert_eq!(
                        requests.asked, requests.rows,
                        "k {k}, tile {tile} of {tiles}"
                    );
                }
                assert_eq!(covered, panel, "k {k}, {tiles} tiles");
            }
        }
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
