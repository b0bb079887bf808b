//! GGUF, llama.cpp's single-file model format, read and written natively.
//!
//! | module        | what it does                                                             |
//! |---------------|--------------------------------------------------------------------------|
//! | [`value`]     | [`GgufValue`]: the thirteen metadata value types                          |
//! | [`mod@file`]  | [`GgufFile`]: the memory-mapped reader, every length checked before use   |
//! | [`writer`]    | [`GgufWriter`]: metadata and encoded tensors → a version-3 file           |
//! | [`config`]    | metadata → chapter 1's [`ch01::LlamaConfig`]                              |
//! | [`source`]    | [`GgufSource`]: the file as a [`ch01::WeightSource`] with Hugging Face names |
//! | [`tokenizer`] | `tokenizer.ggml.*` → a [`ch01::Tokenizer`] (byte-level or SentencePiece BPE) |
//! | [`model`]     | [`load_gguf`]: model, tokenizer, stop tokens and chat template in one call |
//! | [`convert`]   | [`quantize_hf_dir`]: a Hugging Face checkpoint → a GGUF file (`kiln quantize`) |
//! | [`error`]     | [`GgufError`]: what is wrong, naming the file and the key or tensor       |

pub mod config;
pub mod convert;
pub mod error;
pub mod file;
pub mod model;
pub mod source;
pub mod tokenizer;
pub mod value;
pub mod writer;

pub use config::{GgufArch, llama_config};
pub use convert::{ConvertError, ConvertReport, convert_hf_dir, quantize_hf_dir};
pub use error::{GgufError, GgufResult};
pub use file::{GgufFile, GgufTensorInfo};
pub use model::{GgufHostSide, GgufModel, load_gguf};
pub use source::{GgufSource, gguf_name, hf_name, permute_qk};
pub use value::{GgufArray, GgufValue, GgufValueType};
pub use writer::GgufWriter;
