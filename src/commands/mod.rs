//! One module per subcommand, plus what they share: loading a model directory.

pub mod engine_args;
pub mod forward;
pub mod generate;
pub mod perplexity;
pub mod quantize;
pub mod serve;
pub mod speculative_args;

use std::path::PathBuf;

use anyhow::{Context, bail};
use ch01::linear::LinearLoader;
use ch01::{Llama, Tokenizer};

/// `--model DIR|FILE.gguf`, shared by every command that loads a model.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json), or a GGUF
    /// file (llama.cpp's format: config, weights, tokenizer and chat template in one file).
    /// Defaults to the embedded shakespeare-small.
    #[arg(long, value_name = "DIR|FILE", default_value_os_t = ch01::default_model_dir())]
    pub model: PathBuf,
    /// Storage of the dense projection weights: f32, or bf16 (half the bytes read per token;
    /// arithmetic stays f32).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub dtype: String,
    /// Quantize dense projection weights on load to one of llama.cpp's block formats (chapter
    /// 5). A K-quant falls back to q8_0 for layers whose input size is not a multiple of 256.
    /// A GGUF file's quantized tensors are always used as stored.
    #[arg(long, value_name = "TYPE", value_parser = ["q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "q6_k", "q5_k", "q4_k"])]
    pub quantization: Option<String>,
}

/// A model ready to run: weights, tokenizer and the ids that end generation.
pub struct LoadedModel {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    pub eos_token_ids: Vec<u32>,
    /// Where the model came from.
    pub format: ModelFormat,
}

/// How a model is stored on disk.
pub enum ModelFormat {
    /// A Hugging Face directory; its chat template is in its files.
    HfDir,
    /// A GGUF file, with the chat template its metadata holds.
    Gguf { chat_template: Option<String> },
}

impl ModelArgs {
    /// Loads with the fast projections: a GGUF file's quantized tensors on chapter 5's integer
    /// kernels, dense weights on chapter 2's (stored as `--dtype` says) or quantized on load
    /// (`--quantization`).
    pub fn load(&self) -> anyhow::Result<LoadedModel> {
        let dtype: ch02::WeightDtype = self.dtype.parse().map_err(anyhow::Error::msg)?;
        // A Hugging Face FP8 checkpoint (`quant_method: "fp8"`): its projections as stored.
        if !self.is_gguf() && self.model.join("config.json").exists() {
            if let Some(fp8) = ch05::fp8_config(&self.model)? {
                if self.quantization.is_some() {
                    bail!(
                        "{} is an FP8 checkpoint: --quantization does not apply",
                        self.model.display()
                    );
                }
                return self.load_with(&ch05::Fp8Loader {
                    static_activations: fp8.static_activations,
                });
            }
        }
        match &self.quantization {
            Some(name) => {
                let ty = ch05::GgmlType::from_name(name)
                    .with_context(|| format!("unknown --quantization {name}"))?;
                self.load_with(&ch05::QuantLoader::to(ty)?)
            }
            None if self.is_gguf() => self.load_with(&ch05::QuantLoader::native().dense(dtype)),
            None => self.load_with(&ch02::FastLoader { dtype }),
        }
    }

    /// Whether `--model` names a GGUF file rather than a directory.
    pub fn is_gguf(&self) -> bool {
        self.model.is_file()
    }

    /// The model's name for tables and the API: the directory's name, or the file's without
    /// its extension.
    pub fn name(&self) -> String {
        let name = if self.is_gguf() {
            self.model.file_stem()
        } else {
            self.model.file_name()
        };
        name.map_or_else(|| "kiln".into(), |n| n.to_string_lossy().into_owned())
    }

    /// Loads with the given kind of projection (chapter 1's benchmark measures `DenseLoader`).
    pub fn load_with(&self, loader: &dyn LinearLoader) -> anyhow::Result<LoadedModel> {
        let path = &self.model;
        let context = || format!("loading model from {}", path.display());
        if self.is_gguf() {
            let gguf = ch05::load_gguf(path, loader).with_context(context)?;
            return Ok(LoadedModel {
                model: gguf.model,
                tokenizer: gguf.tokenizer,
                eos_token_ids: gguf.eos_token_ids,
                format: ModelFormat::Gguf {
                    chat_template: gguf.chat_template,
                },
            });
        }
        let model = Llama::load_with(path, loader).with_context(context)?;
        let tokenizer = Tokenizer::from_dir(path).with_context(context)?;
        let mut eos_token_ids = ch01::eos_token_ids(path, &model.config).with_context(context)?;
        if let Some(eos) = tokenizer.eos_token_id()
            && !eos_token_ids.contains(&eos)
        {
            eos_token_ids.push(eos);
        }
        Ok(LoadedModel {
            model,
            tokenizer,
            eos_token_ids,
            format: ModelFormat::HfDir,
        })
    }
}

/// Parses a memory size: a number of bytes, or a number with a unit: KB, MB, GB (powers of
/// 1000) or KiB, MiB, GiB (powers of 1024), e.g. `512MiB`, `1.5GB`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 512MiB, 2GB or 1000000"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "unknown size unit {other:?}: use KB, MB, GB, KiB, MiB or GiB"
            ));
        }
    };
    let bytes = number * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("{text:?} is not a usable size"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_and_without_units() {
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes(" 64 kib "), Ok(64 * 1024));
        for bad in ["", "MiB", "12XB", "-3MiB", "0", "1e400GB", "nan"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
