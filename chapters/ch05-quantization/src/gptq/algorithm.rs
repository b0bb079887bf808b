//! [`gptq`]: one layer's weights `W` `[out, in]` quantized column by column.
//!
//! Quantizing column `i` of every row at once leaves an error `e = (w_i − q_i) / U[i, i]` per
//! row; the columns after `i` absorb it, `w_j −= e · U[i, j]` for `j > i`, where `U` is the upper
//! Cholesky factor of `H⁻¹` ([`super::cholesky`]). This is the optimal (least-squares in
//! `‖W X − Ŵ X‖²`) update once column `i` is fixed (Optimal Brain Surgeon's rule, one column
//! at a time, in the same order for every row).
//!
//! - **Dampening**: `H += percdamp · mean(diag H) · I` before the factorisation, so a direction
//!   the calibration data barely excites cannot blow the updates up. A column no input ever
//!   touched (`H[i, i] = 0`) gets `H[i, i] = 1` and weight 0, as the reference does.
//! - **Lazy batches**: the updates inside a block of [`GptqConfig::block_size`] columns are
//!   applied at once; those to the columns after the block wait and go in as one matrix product
//!   `W[:, after] −= E · U[block, after]` (same result, cache friendly).
//! - **Groups**: the grid of columns `g·gs .. (g+1)·gs` (in processing order) is fitted when its
//!   first column is reached, on the weights as updated so far. With act-order the processing
//!   order is a permutation, so a group's columns are scattered in the original order and
//!   `g_idx` records each column's group. The last group holds `in mod gs` columns when `gs`
//!   does not divide `in` (`ceil(in / gs)` groups, as GPTQ checkpoints do).
//! - **Act-order** (`desc_act`): columns in decreasing order of `H[i, i]`, the ones with the
//!   largest inputs first, while many columns are left to absorb their errors.
//!
//! Block size and group size must nest (one divides the other) so that a group is fitted on
//! weights that have received every update before its first column: when they do not, the
//! block is shortened to a multiple of the group (`gs · ⌊bs / gs⌋`), or lengthened to one group.
//!
//! Cost: `O(in³)` for the factorisations, `O(out · in²)` for the updates (the matrix products
//! of the lazy batches); rows are independent inside a block and run on rayon's threads.

use ndarray::{Array2, Axis, s};
use rayon::prelude::*;

use super::cholesky::{NotPositiveDefinite, inverse_upper_cholesky};
use crate::group_quant::{Grid, GroupQuantError, GroupQuantized, check_finite};

/// GPTQ's settings (the names of the Hugging Face `quantization_config`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptqConfig {
    /// Input columns per group (`-1` in the files, whole rows here, is `usize::MAX`).
    pub group_size: usize,
    /// `sym`: a symmetric grid (zero 8) or an asymmetric one with a zero point per group.
    pub symmetric: bool,
    /// `desc_act`: act-order.
    pub act_order: bool,
    /// `damp_percent`: the dampening, a fraction of the mean of `H`'s diagonal.
    pub percdamp: f64,
    /// Columns per lazy batch.
    pub block_size: usize,
}

impl Default for GptqConfig {
    /// 4-bit, group 128, symmetric, no act-order, dampening 0.01, lazy batches of 128.
    fn default() -> Self {
        GptqConfig {
            group_size: 128,
            symmetric: true,
            act_order: false,
            percdamp: 0.01,
            block_size: 128,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GptqError {
    #[error("weight has {actual} elements, expected [out, in] = {expected:?}")]
    WeightShape { expected: [usize; 2], actual: usize },
    #[error("the Hessian is {actual:?}, expected [{expected}, {expected}]")]
    HessianShape { expected: usize, actual: [usize; 2] },
    #[error("damp_percent {0} must be finite and in [0, 1]")]
    Damp(f64),
    #[error("the dampened Hessian: {0}")]
    Factor(#[from] NotPositiveDefinite),
    #[error(transparent)]
    Codes(#[from] GroupQuantError),
}

// ANCHOR: gptq
/// Quantizes `weight` `[out, in]` (row-major) against the Hessian `h` `[in, in]` of its inputs.
/// A NaN or infinite weight or Hessian entry is refused ([`GroupQuantError::NotFinite`]).
pub fn gptq(
    weight: &[f32],
    out: usize,
    h: &Array2<f64>,
    config: &GptqConfig,
) -> Result<GroupQuantized, GptqError> {
    let cols = h.nrows();
    if h.ncols() != cols {
        return Err(GptqError::HessianShape {
            expected: cols,
            actual: [h.nrows(), h.ncols()],
        });
    }
    if weight.len() != out.saturating_mul(cols) {
        return Err(GptqError::WeightShape {
            expected: [out, cols],
            actual: weight.len(),
        });
    }
    check_finite("weight", weight.iter().map(|&w| f64::from(w)))?;
    check_finite("Hessian", h.iter().copied())?;
    let (gs, bs) = (config.group_size.min(cols.max(1)), config.block_size.max(1));
    if gs == 0 {
        return Err(GroupQuantError::GroupSize(0).into());
    }
    let bs = if gs % bs == 0 || bs % gs == 0 {
        bs
    } else if gs < bs {
        gs * (bs / gs)
    } else {
        gs
    };
    if !(0.0..=1.0).contains(&config.percdamp) {
        return Err(GptqError::Damp(config.percdamp));
    }

    // 1. Dead columns, act-order, dampening, U = chol(H⁻¹)ᵀ.
    let mut h = h.clone();
    let mut w = Array2::from_shape_fn((out, cols), |(o, i)| f64::from(weight[o * cols + i]));
    for i in 0..cols {
        if h[[i, i]] == 0.0 {
            h[[i, i]] = 1.0;
            w.column_mut(i).fill(0.0);
        }
    }
    let mut perm: Vec<usize> = (0..cols).collect();
    if config.act_order {
        // Largest diagonal first; a stable sort keeps ties in column order.
        perm.sort_by(|&a, &b| h[[b, b]].total_cmp(&h[[a, a]]));
        w = w.select(Axis(1), &perm);
        h = h.select(Axis(0), &perm).select(Axis(1), &perm);
    }
    let damp = config.percdamp * h.diag().mean().unwrap_or(0.0);
    h.diag_mut().mapv_inplace(|d| d + damp);
    let u = inverse_upper_cholesky(&h)?; // [in, in], upper

    // 2. Column by column, in lazy batches of `bs` columns.
    let groups = cols.div_ceil(gs);
    let mut codes = Array2::<u8>::zeros((out, cols)); // processing order
    let mut grids = vec![
        Grid {
            scale: 0.0,
            zero: 0
        };
        groups * out
    ]; // [groups, out]
    for i1 in (0..cols).step_by(bs) {
        let i2 = (i1 + bs).min(cols);
        let u_block = u.slice(s![i1..i2, i1..i2]);
        let width = i2 - i1;
        let mut errors = Array2::<f64>::zeros((out, width)); // E [out, block]
        let mut w_block = Array2::from_shape_fn((out, width), |(o, i)| w[[o, i1 + i]]); // [out, block]
        let mut q_block = vec![0u8; out * width]; // [out, block]
        let mut row_grids: Vec<Vec<Grid>> = (0..out)
            .map(|o| (0..groups).map(|g| grids[g * out + o]).collect())
            .collect();
        let w_all = w.view();
        // Rows in parallel: each owns its block of weights, errors, codes and grids.
        w_block
            .as_slice_mut()
            .expect("a fresh array is contiguous")
            .par_chunks_mut(width)
            .zip(
                errors
                    .as_slice_mut()
                    .expect("contiguous")
                    .par_chunks_mut(width),
            )
            .zip(q_block.par_chunks_mut(width))
            .zip(row_grids.par_iter_mut())
            .enumerate()
            .for_each(|(o, (((wr, er), qr), gr))| {
                // ANCHOR: task_5_3
                for i in 0..width {
                    let col = i1 + i;
                    if col % gs == 0 {
                        // The group's weights as updated so far: this block's from `wr`, any
                        // after the block (a group longer than the block) from `w`.
                        let end = (col + gs).min(cols);
                        let inside = wr[i..(end - i1).min(width)].iter().copied();
                        let after = (i2.max(col)..end).map(|j| w_all[[o, j]]);
                        gr[col / gs] = Grid::fit(inside.chain(after), config.symmetric);
                    }
                    let grid = gr[col / gs];
                    let q = grid.quantize(wr[i]);
                    qr[i] = q;
                    let e = (wr[i] - f64::from(grid.dequantize(q))) / u_block[[i, i]];
                    er[i] = e;
                    for j in i + 1..width {
                        wr[j] -= e * u_block[[i, j]];
                    }
                }
                // ANCHOR_END: task_5_3
            });
        for o in 0..out {
            codes
                .slice_mut(s![o, i1..i2])
                .iter_mut()
                .zip(&q_block[o * width..(o + 1) * width])
                .for_each(|(c, &q)| *c = q);
        }
        for (o, gr) in row_grids.iter().enumerate() {
            for (g, grid) in gr.iter().enumerate() {
                grids[g * out + o] = *grid;
            }
        }
        // The lazy update of every column after the block: W[:, i2..] −= E · U[i1..i2, i2..].
        if i2 < cols {
            let update = errors.dot(&u.slice(s![i1..i2, i2..])); // [out, in − i2]
            let mut rest = w.slice_mut(s![.., i2..]);
            rest -= &update;
        }
    }

    // 3. Back to the original column order; column perm[p] is in group p / gs.
    let mut codes_out = vec![0u8; out * cols];
    let mut g_idx = vec![0u32; cols];
    for (p, &c) in perm.iter().enumerate() {
        g_idx[c] = (p / gs) as u32;
        for o in 0..out {
            codes_out[o * cols + c] = codes[[o, p]];
        }
    }
    let scales = grids.iter().map(|g| g.scale).collect();
    let zeros = grids.iter().map(|g| g.zero).collect();
    Ok(GroupQuantized::new(
        out,
        cols,
        config.group_size.min(cols.max(1)),
        codes_out,
        scales,
        zeros,
        g_idx,
    )?)
}
// ANCHOR_END: gptq
