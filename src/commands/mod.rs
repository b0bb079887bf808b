//! One module per subcommand, plus what they share: loading a model directory.

pub mod forward;
pub mod generate;
pub mod perplexity;

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
