//! The Hugging Face layouts of 4-bit checkpoints that vLLM and transformers read, written and
//! loaded: GPTQ's and AWQ's (GEMM version).
//!
//! | file             | what it holds                                                         |
//! |------------------|-----------------------------------------------------------------------|
//! | [`config`]       | `quantization_config` of config.json: parsed, checked, written         |
//! | [`gptq_format`]  | `qweight` / `qzeros` / `scales` / `g_idx`: pack and unpack             |
//! | [`awq_format`]   | AWQ's `qweight` / `qzeros` / `scales` with its interleaved nibble order |
//! | [`linear`]       | [`GroupLinear`] (chapter 1's `Linear`) and [`HfQuantLoader`]            |
//! | [`writer`]       | a quantized model directory: config.json, model.safetensors, tokenizer  |

pub mod awq_format;
pub mod config;
pub mod error;
pub mod gptq_format;
pub mod linear;
pub mod writer;

pub use config::{HfQuantConfig, QuantMethod};
pub use error::HfQuantError;
pub use linear::{GroupLinear, HfQuantLoader};
pub use writer::{WriteError, check_model, write_quantized_dir};

/// Decodes little-endian i32 words.
pub(crate) fn i32s(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Decodes little-endian f16 values to f32 (exact).
pub(crate) fn f16s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

/// Decodes a layer's f16 `scales`, refusing any that is not finite.
pub(crate) fn finite_scales(name: &str, bytes: &[u8]) -> Result<Vec<f32>, HfQuantError> {
    let scales = f16s(bytes);
    match scales.iter().position(|s| !s.is_finite()) {
        Some(i) => Err(HfQuantError::Tensor {
            name: format!("{name}.scales"),
            expected: "finite scales".into(),
            found: format!("{} at {i}", scales[i]),
        }),
        None => Ok(scales),
    }
}
