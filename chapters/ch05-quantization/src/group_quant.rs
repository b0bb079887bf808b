//! [`GroupQuantized`]: a weight matrix in 4-bit codes with one affine grid per group of input
//! columns and output row, what round-to-nearest, GPTQ and AWQ all produce and what the Hugging
//! Face GPTQ and AWQ layouts pack ([`crate::hf_quant`]).
//!
//! ```text
//! w[o, i] = scales[g, o] · (codes[o, i] − zeros[g, o])      g = g_idx[i]
//! codes  [out, in]     u8 in 0..=15 (one per byte here; the file formats pack 8 per i32)
//! scales [groups, out] f16 values (held as f32, every one exactly an f16)
//! zeros  [groups, out] u8 in 0..=15 (8 for a symmetric grid)
//! g_idx  [in]          group of each input column, < groups
//! ```
//!
//! Invariants (checked by [`GroupQuantized::new`]): the lengths above, `group_size ≤ in` (a
//! larger one is stored as `in`), codes and zeros below 16,
//! every `g_idx` below `groups`, every scale finite and representable in f16. The product
//! `scale · (code − zero)` of an f16 and an integer of magnitude ≤ 15 is exact in f32, so
//! [`GroupQuantized::dequantize`] has no rounding at all: it is *the* weight every reader of
//! the file sees.

use half::f16;

/// The largest 4-bit code.
pub const MAXQ: u8 = 15;

/// Why a [`GroupQuantized`] cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GroupQuantError {
    #[error("{what} has {actual} elements, expected {expected}")]
    Length {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("{what} value {value} at {index} is out of range (at most {max})")]
    Range {
        what: &'static str,
        index: usize,
        value: u64,
        max: u64,
    },
    #[error("scale {value} at {index} is not a finite f16")]
    Scale { index: usize, value: f32 },
    #[error("group size {0} is invalid: it must be at least 1")]
    GroupSize(usize),
    /// A NaN or infinite input to a quantizer: a grid cannot hold it, and without this check
    /// [`Grid::fit`] would skip a NaN (`f64::min`/`max` ignore it) and [`Grid::quantize`] make
    /// it code 0, a finite weight.
    #[error("{what} value {value} at {index} is not finite")]
    NotFinite {
        what: &'static str,
        index: usize,
        value: f64,
    },
}

/// Refuses the first element of `values` that is NaN or infinite, as [`GroupQuantError::NotFinite`].
pub fn check_finite(
    what: &'static str,
    values: impl IntoIterator<Item = f64>,
) -> Result<(), GroupQuantError> {
    match values.into_iter().enumerate().find(|(_, v)| !v.is_finite()) {
        Some((index, value)) => Err(GroupQuantError::NotFinite { what, index, value }),
        None => Ok(()),
    }
}

/// The affine 4-bit grid of one group of one row: `w ≈ scale · (q − zero)`, `q` in `0..=15`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grid {
    /// An f16 value (rounded when the grid is fitted, so what is stored is what is used).
    pub scale: f32,
    pub zero: u8,
}

// ANCHOR: grid
impl Grid {
    /// The grid over `values` (GPTQ's rule, also round-to-nearest's): the range is widened to
    /// contain 0; symmetric: `[−m, m]` with `m = max|w|` and `zero = 8`; asymmetric:
    /// `[min, max]` and `zero = round(−min / scale)`. `scale = range / 15`, rounded to f16
    /// (never to 0). An all-zero group gets the range `[−1, 1]`. `values` must be finite (a
    /// NaN is skipped: the quantizers refuse one first, [`check_finite`]).
    pub fn fit(values: impl IntoIterator<Item = f64>, symmetric: bool) -> Grid {
        let (mut lo, mut hi) = values
            .into_iter()
            .fold((0.0f64, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
        if symmetric {
            hi = hi.max(-lo);
            lo = -hi;
        }
        if lo == 0.0 && hi == 0.0 {
            (lo, hi) = (-1.0, 1.0);
        }
        let scale = f16::from_f64((hi - lo) / f64::from(MAXQ)).to_f32();
        let scale = if scale > 0.0 {
            scale
        } else {
            f16::from_bits(1).to_f32() // the smallest positive f16
        };
        let zero = if symmetric {
            MAXQ.div_ceil(2)
        } else {
            (-lo / f64::from(scale))
                .round_ties_even()
                .clamp(0.0, f64::from(MAXQ)) as u8
        };
        Grid { scale, zero }
    }

    /// The code of `w`: `clamp(round(w / scale) + zero, 0, 15)`, halves to even.
    pub fn quantize(self, w: f64) -> u8 {
        ((w / f64::from(self.scale)).round_ties_even() + f64::from(self.zero))
            .clamp(0.0, f64::from(MAXQ)) as u8
    }

    /// The weight a code stands for (exact).
    pub fn dequantize(self, q: u8) -> f32 {
        self.scale * (f32::from(q) - f32::from(self.zero))
    }
}
// ANCHOR_END: grid

/// A weight matrix `[out, in]` in 4-bit group-wise codes (see the module doc for the layout).
#[derive(Debug, Clone, PartialEq)]
pub struct GroupQuantized {
    rows: usize,
    cols: usize,
    group_size: usize,
    groups: usize,
    codes: Vec<u8>,   // [out, in]
    scales: Vec<f32>, // [groups, out]
    zeros: Vec<u8>,   // [groups, out]
    g_idx: Vec<u32>,  // [in]
}

impl GroupQuantized {
    /// Checks every invariant of the module doc. `groups = scales.len() / rows`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rows: usize,
        cols: usize,
        group_size: usize,
        codes: Vec<u8>,
        scales: Vec<f32>,
        zeros: Vec<u8>,
        g_idx: Vec<u32>,
    ) -> Result<Self, GroupQuantError> {
        if group_size == 0 {
            return Err(GroupQuantError::GroupSize(group_size));
        }
        let length = |what, expected: usize, actual: usize| {
            if expected == actual {
                Ok(())
            } else {
                Err(GroupQuantError::Length {
                    what,
                    expected,
                    actual,
                })
            }
        };
        length("codes", rows.saturating_mul(cols), codes.len())?;
        length("g_idx", cols, g_idx.len())?;
        let groups = scales.len().checked_div(rows).unwrap_or(0);
        length("scales", groups.saturating_mul(rows), scales.len())?;
        length("zeros", scales.len(), zeros.len())?;
        let range = |what, values: &mut dyn Iterator<Item = u64>, max: u64| {
            for (index, value) in values.enumerate() {
                if value > max {
                    return Err(GroupQuantError::Range {
                        what,
                        index,
                        value,
                        max,
                    });
                }
            }
            Ok(())
        };
        let maxq = u64::from(MAXQ);
        range("code", &mut codes.iter().map(|&q| u64::from(q)), maxq)?;
        range("zero", &mut zeros.iter().map(|&q| u64::from(q)), maxq)?;
        let last_group = groups.saturating_sub(1) as u64;
        if groups == 0 && cols > 0 {
            return Err(GroupQuantError::Length {
                what: "scales (no groups)",
                expected: rows,
                actual: scales.len(),
            });
        }
        range(
            "g_idx",
            &mut g_idx.iter().map(|&g| u64::from(g)),
            last_group,
        )?;
        for (index, &value) in scales.iter().enumerate() {
            if !value.is_finite() || f16::from_f32(value).to_f32() != value {
                return Err(GroupQuantError::Scale { index, value });
            }
        }
        Ok(GroupQuantized {
            rows,
            cols,
            group_size: group_size.min(cols.max(1)), // the one form of "whole rows"
            groups,
            codes,
            scales,
            zeros,
            g_idx,
        })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The group size of the configuration (the last group may be shorter, and with act-order
    /// a group's columns are scattered: `g_idx` says which columns each group holds).
    pub fn group_size(&self) -> usize {
        self.group_size
    }

    pub fn groups(&self) -> usize {
        self.groups
    }

    /// `[out, in]`.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// `[groups, out]`.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// `[groups, out]`.
    pub fn zeros(&self) -> &[u8] {
        &self.zeros
    }

    /// `[in]`.
    pub fn g_idx(&self) -> &[u32] {
        &self.g_idx
    }

    /// The grid of row `o` for input column `i`.
    pub fn grid(&self, o: usize, i: usize) -> Grid {
        let g = self.g_idx[i] as usize;
        Grid {
            scale: self.scales[g * self.rows + o],
            zero: self.zeros[g * self.rows + o],
        }
    }

    /// Whether `g_idx[i] == i / group_size` for every column (no act-order permutation).
    pub fn is_sequential(&self) -> bool {
        self.g_idx
            .iter()
            .enumerate()
            .all(|(i, &g)| g as usize == i / self.group_size)
    }

    /// Whether every zero is 8 (a symmetric grid).
    pub fn is_symmetric(&self) -> bool {
        self.zeros.iter().all(|&z| z == MAXQ.div_ceil(2))
    }

    /// The weights `[out, in]` row-major, exactly (see the module doc).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        for (o, row) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            for (i, w) in row.iter_mut().enumerate() {
                *w = self.grid(o, i).dequantize(self.codes[o * self.cols + i]);
            }
        }
        out
    }
}

/// `g_idx` without act-order: column `i` in group `i / group_size`, `ceil(in / group_size)`
/// groups, the last one shorter when `group_size` does not divide `in`.
pub fn sequential_g_idx(cols: usize, group_size: usize) -> Vec<u32> {
    (0..cols).map(|i| (i / group_size.max(1)) as u32).collect()
}

/// Round-to-nearest: each group's [`Grid::fit`] on the weights themselves, then
/// [`Grid::quantize`]. `weight` `[rows, cols]` row-major, every value finite (else
/// [`GroupQuantError::NotFinite`]).
// ANCHOR: rtn
pub fn round_to_nearest(
    weight: &[f32],
    rows: usize,
    cols: usize,
    group_size: usize,
    symmetric: bool,
) -> Result<GroupQuantized, GroupQuantError> {
    if group_size == 0 {
        return Err(GroupQuantError::GroupSize(group_size));
    }
    if weight.len() != rows.saturating_mul(cols) {
        return Err(GroupQuantError::Length {
            what: "weight",
            expected: rows.saturating_mul(cols),
            actual: weight.len(),
        });
    }
    check_finite("weight", weight.iter().map(|&w| f64::from(w)))?;
    let groups = cols.div_ceil(group_size);
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0.0f32; groups * rows];
    let mut zeros = vec![0u8; groups * rows];
    for o in 0..rows {
        let row = &weight[o * cols..(o + 1) * cols];
        for (g, chunk) in row.chunks(group_size).enumerate() {
            let grid = Grid::fit(chunk.iter().map(|&w| f64::from(w)), symmetric);
            scales[g * rows + o] = grid.scale;
            zeros[g * rows + o] = grid.zero;
            for (j, &w) in chunk.iter().enumerate() {
                codes[o * cols + g * group_size + j] = grid.quantize(f64::from(w));
            }
        }
    }
    let g_idx = sequential_g_idx(cols, group_size);
    GroupQuantized::new(rows, cols, group_size, codes, scales, zeros, g_idx)
}
// ANCHOR_END: rtn
