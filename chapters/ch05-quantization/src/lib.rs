//! # Chapter 5: quantization
//!
//! Decode reads every weight once per token (chapter 2's roofline), so the bytes per weight set
//! the speed limit. This chapter stores weights in llama.cpp's block formats, reads and writes
//! GGUF files natively, and multiplies with integer dot products.
//!
//! | module           | what it does                                                              |
//! |------------------|---------------------------------------------------------------------------|
//! | [`mod@format`]   | [`GgmlType`]: every GGUF tensor type, its id, block length and block bytes |
//! | [`blocks`]       | the block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q8_K): [`dequantize`](blocks::dequantize) and [`quantize`](blocks::quantize) |
//! | [`kernels`]      | integer `matvec` / `matmul` on [`QuantMatrix`] weights, activations quantized to 8 bits, AVX2 and portable; W8A8's int8 tiles |
//! | [`quant_linear`] | [`QuantLinear`] (chapter 1's `Linear` seam on those kernels) and [`QuantLoader`] |
//! | [`gguf`]         | GGUF files: reader, writer, config, weight source, tokenizer, [`load_gguf`] |
//! | [`group_quant`]  | part 2: [`GroupQuantized`], 4-bit codes with a grid per group; round-to-nearest |
//! | [`hf_quant`]     | part 2: GPTQ's and AWQ's Hugging Face layouts, written and loaded; [`GroupLinear`] |
//! | [`awq`]          | part 2: AWQ's activation-aware scales and their grid search |
//! | [`model_quant`]  | part 2: [`quantize_model`](model_quant::quantize_model), every projection in sequence, calibrated |
//! | [`gptq`]         | part 2: GPTQ, the Hessian, its Cholesky factors and the column-by-column update |
//! | [`fp8`]          | FP8 E4M3 and E5M2: conversion bit for bit as PyTorch's, exact decoding     |
//! | [`fp8_linear`]   | [`Fp8Linear`]: E4M3 weights with per-tensor or per-channel scales; [`Fp8Loader`] for Hugging Face FP8 checkpoints |
//! | [`kv_cache`]     | the 8-bit KV cache: chapter 3's pool storing FP8 or int8 codes with scales  |
//! | [`smoothquant`]  | [`W8A8Linear`]: int8 weights × int8 activations in i32; SmoothQuant's outlier migration |

pub mod awq;
pub mod blocks;
mod codes_dot;
pub mod format;
pub mod fp8;
pub mod fp8_linear;
pub mod gguf;
pub mod gptq;
pub mod group_quant;
pub mod hf_quant;
pub mod kernels;
pub mod kv_cache;
pub mod model_quant;
pub mod quant_linear;
mod scratch;
pub mod smoothquant;
pub mod testing;
mod widened;

pub use blocks::BlockError;
pub use format::GgmlType;
pub use fp8_linear::{Fp8Linear, Fp8Loader, fp8_config};
pub use gguf::{
    GgufError, GgufFile, GgufHostSide, GgufModel, GgufSource, GgufTensorInfo, GgufValue,
    GgufValueType, GgufWriter, load_gguf,
};
pub use group_quant::{Grid, GroupQuantError, GroupQuantized};
pub use hf_quant::{GroupLinear, HfQuantConfig, HfQuantError, HfQuantLoader, QuantMethod};
pub use kernels::{KernelError, QuantMatrix};
pub use quant_linear::{QuantLinear, QuantLoader};
pub use smoothquant::{W8A8Linear, W8A8Quantizer};
