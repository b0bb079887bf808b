//! The Hessian of a layer's reconstruction error `‖W X − Ŵ X‖²` with respect to one row of `Ŵ`:
//! `H = 2 X Xᵀ`, here `2/T · Σ_t x_t x_tᵀ` over the `T` calibration tokens (the mean; GPTQ's
//! dampening is relative to `H`'s diagonal, so the scale does not change the result).

use ndarray::{Array2, ArrayView2};

/// `H` `[in, in]` accumulated over batches of inputs, in f64.
#[derive(Debug, Clone)]
pub struct Hessian {
    sum: Array2<f64>, // Σ x xᵀ  [in, in]
    tokens: usize,
}

impl Hessian {
    pub fn new(in_features: usize) -> Self {
        Hessian {
            sum: Array2::zeros((in_features, in_features)),
            tokens: 0,
        }
    }

    pub fn in_features(&self) -> usize {
        self.sum.nrows()
    }

    /// Adds the rows of `x` `[T, in]`, one token each. The product `xᵀ x` is taken in f32 by
    /// the matrix multiply of ndarray, then added in f64.
    pub fn add(&mut self, x: ArrayView2<f32>) {
        assert_eq!(x.ncols(), self.in_features(), "x is [T, in]");
        let xtx = x.t().dot(&x); // [in, in]
        self.sum.zip_mut_with(&xtx, |s, &v| *s += f64::from(v));
        self.tokens += x.nrows();
    }

    /// Tokens added so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// `2/T · Σ x xᵀ` (all zeros before any token).
    pub fn matrix(&self) -> Array2<f64> {
        let scale = if self.tokens == 0 {
            0.0
        } else {
            2.0 / self.tokens as f64
        };
        self.sum.mapv(|v| v * scale)
    }
}
