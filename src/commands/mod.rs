//! One module per subcommand, plus what they share: loading a model directory.

pub mod engine_args;
pub mod forward;
pub mod generate;
pub mod perplexity;
pub mod serve;
pub mod speculative_args;

use std::path::PathBuf;

use anyhow::Context;
use ch01::linear::LinearLoader;
use ch01::{Llama, Tokenizer};

/// `--model DIR`, shared by every command that loads a model.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    /// Defaults to the embedded shakespeare-small.
    #[arg(long, value_name = "DIR", default_value_os_t = ch01::default_model_dir())]
    pub model: PathBuf,
    /// Storage of the projection weights: f32, or bf16 (half the bytes read per token;
    /// arithmetic stays f32).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub dtype: String,
}

/// A model ready to run: weights, tokenizer and the ids that end generation.
pub struct LoadedModel {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    pub eos_token_ids: Vec<u32>,
}

impl ModelArgs {
    /// Loads with chapter 2's fast projections, stored as `--dtype` says.
    pub fn load(&self) -> anyhow::Result<LoadedModel> {
        let dtype: ch02::WeightDtype = self.dtype.parse().map_err(anyhow::Error::msg)?;
        self.load_with(&ch02::FastLoader { dtype })
    }

    /// Loads with the given kind of projection (chapter 1's benchmark measures `DenseLoader`).
    pub fn load_with(&self, loader: &dyn LinearLoader) -> anyhow::Result<LoadedModel> {
        let dir = &self.model;
        let context = || format!("loading model from {}", dir.display());
        let model = Llama::load_with(dir, loader).with_context(context)?;
        let tokenizer = Tokenizer::from_dir(dir).with_context(context)?;
        let mut eos_token_ids = ch01::eos_token_ids(dir, &model.config).with_context(context)?;
        if let Some(eos) = tokenizer.eos_token_id()
            && !eos_token_ids.contains(&eos)
        {
            eos_token_ids.push(eos);
        }
        Ok(LoadedModel {
            model,
            tokenizer,
            eos_token_ids,
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
