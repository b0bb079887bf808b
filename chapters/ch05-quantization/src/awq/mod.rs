//! AWQ (activation-aware weight quantization): before rounding, scale every input channel `c`
//! of a layer's weights by `s_c`, and the layer's input by `1 / s_c`, which leaves the product
//! unchanged in exact arithmetic but gives the channels that carry large activations (the
//! *salient* ones) finer steps relative to their weights.
//!
//! `s = x̄^α` (`x̄_c` = mean `|x_c|` over the calibration tokens), normalised so that
//! `max(s) · min(s) = 1`; `α` is chosen per group of layers that share an input by a grid
//! search over `α ∈ {0, 1/20, …, 19/20}` minimising the group's output error
//! `Σ ‖X Wᵀ − X (Q(W·s) / s)ᵀ‖²` (`Q`: 4-bit round-to-nearest with zero points, group-wise).
//! `α = 0` is plain round-to-nearest, so the search can only improve on it (on its tokens).
//! The `1 / s` goes into whatever produced the input: the RMSNorm's weight before q/k/v and
//! gate/up, `up_proj`'s output rows (and bias) before `down_proj` (see [`crate::model_quant`]).

use ndarray::{Array1, Array2, ArrayView2, Axis};

use crate::group_quant::{GroupQuantError, GroupQuantized, check_finite, round_to_nearest};

/// The grid of exponents searched.
pub const GRID: usize = 20;

/// Mean `|x|` per input channel of `x` `[T, in]`, accumulated over batches.
#[derive(Debug, Clone)]
pub struct ChannelMagnitude {
    sum: Array1<f64>,
    tokens: usize,
}

impl ChannelMagnitude {
    pub fn new(in_features: usize) -> Self {
        ChannelMagnitude {
            sum: Array1::zeros(in_features),
            tokens: 0,
        }
    }

    pub fn add(&mut self, x: ArrayView2<f32>) {
        for row in x.rows() {
            self.sum
                .zip_mut_with(&row, |s, &v| *s += f64::from(v.abs()));
        }
        self.tokens += x.nrows();
    }

    pub fn mean(&self) -> Array1<f64> {
        self.sum.mapv(|s| s / self.tokens.max(1) as f64)
    }
}

/// The scales for exponent `alpha`: `x̄^α`, at least 1e-4, divided by `sqrt(max · min)`.
pub fn scales(mean: &Array1<f64>, alpha: f64) -> Array1<f64> {
    let s = mean.mapv(|m| m.powf(alpha).max(1e-4));
    let (lo, hi) = s
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    s / (lo * hi).sqrt()
}

/// `w` `[out, in]` with column `c` multiplied by `s[c]`.
pub fn scale_columns(w: &Array2<f32>, s: &Array1<f64>) -> Array2<f32> {
    let mut w = w.clone();
    for mut row in w.rows_mut() {
        row.zip_mut_with(s, |v, &s| *v = (f64::from(*v) * s) as f32);
    }
    w
}

/// Round-to-nearest with zero points, group-wise, of a standard-layout `w` `[out, in]`.
pub fn quantize(w: &Array2<f32>, group_size: usize) -> Result<GroupQuantized, GroupQuantError> {
    let (rows, cols) = w.dim();
    let w = w.as_standard_layout();
    round_to_nearest(
        w.as_slice().expect("standard layout"),
        rows,
        cols,
        group_size,
        false,
    )
}

/// What the search chose for one group of layers.
#[derive(Debug, Clone)]
pub struct Search {
    pub alpha: f64,
    pub scales: Array1<f64>,
    /// The output error at `alpha` and at `α = 0` (round-to-nearest).
    pub error: f64,
    pub rtn_error: f64,
}

// ANCHOR: search
/// The exponent that minimises the output error of `weights` (each `[out_k, in]`, one shared
/// input) on the tokens `x` `[T, in]`, with channel magnitudes `mean`. A NaN or infinite `x` is
/// refused ([`GroupQuantError::NotFinite`]).
pub fn search(
    weights: &[&Array2<f32>],
    x: ArrayView2<f32>,
    mean: &Array1<f64>,
    group_size: usize,
) -> Result<Search, GroupQuantError> {
    // A NaN or infinite input makes every error NaN, and no exponent would win on its merits.
    check_finite("calibration input", x.iter().map(|&v| f64::from(v)))?;
    // ANCHOR: task_5_5
    let x = x.mapv(f64::from); // [T, in]
    let mut best: Option<Search> = None;
    let mut rtn_error = f64::NAN;
    for step in 0..GRID {
        let alpha = step as f64 / GRID as f64;
        let s = scales(mean, alpha);
        let mut error = 0.0;
        for w in weights {
            // Ŵ = Q(W · s) / s, the weights the scaled model computes with.
            let q = quantize(&scale_columns(w, &s), group_size)?;
            let deq = Array2::from_shape_vec(w.dim(), q.dequantize()).expect("[out, in]");
            let diff = Array2::from_shape_fn(w.dim(), |(o, i)| {
                f64::from(w[[o, i]]) - f64::from(deq[[o, i]]) / s[i]
            });
            let y = x.dot(&diff.t()); // [T, out]
            error += y.iter().map(|v| v * v).sum::<f64>();
        }
        if step == 0 {
            rtn_error = error;
        }
        if best.as_ref().is_none_or(|b| error < b.error) {
            best = Some(Search {
                alpha,
                scales: s,
                error,
                rtn_error,
            });
        }
    }
    let mut best = best.expect("GRID > 0");
    best.rtn_error = rtn_error;
    Ok(best)
    // ANCHOR_END: task_5_5
}
// ANCHOR_END: search

/// Up to `n` rows of `x` `[T, in]`, evenly spaced (the search's tokens).
pub fn subsample(x: ArrayView2<f32>, n: usize) -> Array2<f32> {
    let step = x.nrows().div_ceil(n.max(1)).max(1);
    let rows: Vec<usize> = (0..x.nrows()).step_by(step).collect();
    x.select(Axis(0), &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The output error of `w` quantized with the scales of `alpha`, computed here apart.
    fn error_at(w: &Array2<f32>, x: &Array2<f64>, mean: &Array1<f64>, alpha: f64) -> f64 {
        let s = scales(mean, alpha);
        let deq = quantize(&scale_columns(w, &s), 64).unwrap().dequantize();
        let cols = w.ncols();
        let diff = Array2::from_shape_fn(w.dim(), |(o, i)| {
            f64::from(w[[o, i]]) - f64::from(deq[o * cols + i]) / s[i]
        });
        x.dot(&diff.t()).iter().map(|v| v * v).sum()
    }

    /// A layer whose every 16th input channel carries inputs 30 times larger than the rest:
    /// the search keeps the best exponent of its grid, reports round-to-nearest's error at
    /// `α = 0`, and beats it with an `α > 0`.
    #[test]
    fn the_search_keeps_the_grids_best_exponent_and_beats_round_to_nearest() {
        let (out, cols, tokens) = (16, 128, 64);
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        };
        let w = Array2::from_shape_fn((out, cols), |_| next() as f32);
        let x = Array2::from_shape_fn((tokens, cols), |(_, c)| {
            let salient = if c % 16 == 0 { 30.0 } else { 1.0 };
            (next() * salient) as f32
        });
        let mut magnitude = ChannelMagnitude::new(cols);
        magnitude.add(x.view());
        let mean = magnitude.mean();
        let found = search(&[&w], x.view(), &mean, 64).unwrap();

        let xf = x.mapv(f64::from);
        let errors: Vec<f64> = (0..GRID)
            .map(|step| error_at(&w, &xf, &mean, step as f64 / GRID as f64))
            .collect();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
        let best = errors.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(
            close(found.rtn_error, errors[0]),
            "rtn_error {} is not the error at α = 0, {}",
            found.rtn_error,
            errors[0]
        );
        assert!(
            close(found.error, best),
            "error {} at α = {}, but the grid's best is {best} (errors by step: {errors:?})",
            found.error,
            found.alpha
        );
        let step = (found.alpha * GRID as f64).round() as usize;
        assert!(
            step < GRID && close(errors[step], best),
            "α = {} is not the exponent of the smallest error (errors by step: {errors:?})",
            found.alpha
        );
        assert_eq!(found.scales, scales(&mean, found.alpha), "the scales of α");
        assert!(
            found.alpha > 0.0 && found.error < found.rtn_error,
            "salient channels, yet α = {} and error {} against round-to-nearest's {}",
            found.alpha,
            found.error,
            found.rtn_error
        );
    }
}
