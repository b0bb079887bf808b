//! SmoothQuant W8A8: int8 weights times int8 activations, multiplied in integers, and the
//! migration of activation outliers into the weights that makes the activations quantizable.
//!
//! | file        | what it holds                                                                |
//! |-------------|------------------------------------------------------------------------------|
//! | [`w8a8`]    | [`W8A8Linear`]: per-channel int8 weights, per-token int8 activations, i32 sums; [`W8A8Quantizer`] |
//! | [`mod@smooth`] | the factors `s_j = max|X_j|^α / max|W_j|^(1−α)`, calibration, and [`SmoothedSource`] with `1/s` folded into the norms, up_proj and v_proj |
//!
//! The naive W8A8 model is `W8A8Quantizer` on the checkpoint; SmoothQuant is the same loader on
//! the [`SmoothedSource`] of the checkpoint.

pub mod smooth;
pub mod w8a8;

pub use smooth::{
    ChannelMax, LayerFactors, LayerStats, SmoothConfig, SmoothError, SmoothedSource, calibrate,
    smooth,
};
pub use w8a8::{Int8Activations, W8A8Error, W8A8Linear, W8A8Quantizer};
