//! A whole model from one GGUF file: config, weights, tokenizer, stop tokens, chat template.

use std::path::Path;

use ch01::{LinearLoader, Llama, LlamaConfig, TensorParallel, Tokenizer};

use super::config::llama_config;
use super::error::{GgufError, GgufResult};
use super::file::GgufFile;
use super::source::GgufSource;
use super::tokenizer::{chat_template, eos_token_ids, load_tokenizer};

/// Everything a server needs from a GGUF file.
pub struct GgufModel {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    /// Tokens that end a generation ([`super::tokenizer::eos_token_ids`]: EOS, the end-of-turn
    /// and end-of-message tokens the file names, and the end-of-generation texts).
    pub eos_token_ids: Vec<u32>,
    /// `tokenizer.chat_template`, when present.
    pub chat_template: Option<String>,
}

/// What a GGUF file says besides its weights: all the host keeps when an executor reads the
/// weights onto a GPU itself, through a [`GgufSource`].
pub struct GgufHostSide {
    pub config: LlamaConfig,
    pub tokenizer: Tokenizer,
    /// Tokens that end a generation ([`super::tokenizer::eos_token_ids`]: EOS, the end-of-turn
    /// and end-of-message tokens the file names, and the end-of-generation texts).
    pub eos_token_ids: Vec<u32>,
    /// `tokenizer.chat_template`, when present.
    pub chat_template: Option<String>,
}

impl GgufHostSide {
    /// Reads the config, tokenizer, stop tokens and chat template from `file`'s metadata,
    /// decoding no tensor. The stop tokens and BOS are checked against the model's vocabulary
    /// (the embedding's rows), not only the tokenizer's: a token list longer than the
    /// embedding would otherwise name stop tokens the model cannot emit.
    pub fn read(file: &GgufFile) -> GgufResult<GgufHostSide> {
        let config = llama_config(file)?;
        let tokenizer = load_tokenizer(file)?;
        let eos_token_ids = eos_token_ids(file)?;
        let special = (tokenizer.bos_token_id().map(|id| ("BOS", id)).into_iter())
            .chain(eos_token_ids.iter().map(|&id| ("stop token", id)));
        for (what, id) in special {
            ch01::config::check_token_id(what, id, config.vocab_size).map_err(|message| {
                GgufError::Tokenizer {
                    path: file.path().to_path_buf(),
                    message,
                }
            })?;
        }
        Ok(GgufHostSide {
            config,
            tokenizer,
            eos_token_ids,
            chat_template: chat_template(file)?,
        })
    }
}

/// Loads the model in `path`, with `loader` choosing each projection's kind. With chapter 1's
/// `DenseLoader` every weight is decoded to f32 (through [`crate::blocks::dequantize`]).
pub fn load_gguf(path: &Path, loader: &dyn LinearLoader) -> GgufResult<GgufModel> {
    let source = GgufSource::open(path)?;
    let host = GgufHostSide::read(source.file())?;
    let model = Llama::from_source(host.config, &source, loader, TensorParallel::whole())?;
    Ok(GgufModel {
        model,
        tokenizer: host.tokenizer,
        eos_token_ids: host.eos_token_ids,
        chat_template: host.chat_template,
    })
}
