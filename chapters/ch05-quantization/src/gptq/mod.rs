//! GPTQ: quantize a layer's weights column by column, each rounding error compensated by the
//! columns not yet quantized, weighted by the layer's input statistics.
//!
//! | file            | what it holds                                                          |
//! |-----------------|------------------------------------------------------------------------|
//! | [`hessian`]     | `H = 2/T · Σ x xᵀ` over a layer's calibration inputs                    |
//! | [`cholesky`]    | Cholesky factorisation and the upper factor of `H⁻¹` GPTQ walks        |
//! | [`algorithm`]   | [`gptq`]: dampening, act-order, lazy batches, groups                   |

pub mod algorithm;
pub mod cholesky;
pub mod hessian;

pub use algorithm::{GptqConfig, GptqError, gptq};
pub use hessian::Hessian;
