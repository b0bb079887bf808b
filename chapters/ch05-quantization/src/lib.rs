//! # Chapter 5: quantization
//!
//! Decode reads every weight once per token (chapter 2's roofline), so the bytes per weight set
//! the speed limit. This chapter stores weights in llama.cpp's block formats, reads and writes
//! GGUF files natively, and multiplies with integer dot products.
//!
//! | module     | what it does                                                              |
//! |------------|---------------------------------------------------------------------------|
//! | [`format`] | [`GgmlType`]: every GGUF tensor type, its id, block length and block bytes |
//! | [`blocks`] | the block formats: [`dequantize`](blocks::dequantize) and round-to-nearest encoding |
//! | [`gguf`]   | GGUF files: reader, writer, config, weight source, tokenizer, [`load_gguf`] |

pub mod blocks;
pub mod format;
pub mod gguf;

pub use blocks::BlockError;
pub use format::GgmlType;
pub use gguf::{
    GgufError, GgufFile, GgufModel, GgufSource, GgufTensorInfo, GgufValue, GgufValueType,
    GgufWriter, load_gguf,
};
