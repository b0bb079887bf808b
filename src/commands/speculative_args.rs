//! Speculative decoding's flags (chapter 6), named as vLLM's: `kiln generate`, `kiln serve`
//! and `kiln bench ch06` share them.

use std::path::PathBuf;

use anyhow::{Context, bail};
use ch01::Llama;
use ch04::Speculator;
use ch06::{
    Drafter, ModelDrafter, NgramDrafter, SpecConfig, SpeculativeDecoding, draft_executor,
    layer_skip_executor,
};

/// `--speculative-method`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    /// A smaller model with the same tokenizer (`--speculative-model`).
    Draft,
    /// Prompt lookup: what followed the last earlier occurrence of the sequence's final n-gram.
    Ngram,
    /// The target's first `--speculative-layers` layers, its final norm and head.
    LayerSkip,
}

#[derive(clap::Args, Debug, Clone)]
pub struct SpeculativeArgs {
    /// Draft model directory (same tokenizer as --model); implies --speculative-method draft.
    #[arg(long, value_name = "DIR")]
    pub speculative_model: Option<PathBuf>,
    /// How drafts are proposed; speculation is off unless this or --speculative-model is given.
    #[arg(long, value_enum)]
    pub speculative_method: Option<SpecMethod>,
    /// Most draft tokens per sequence and step (k).
    #[arg(long, default_value_t = 4, value_name = "K")]
    pub num_speculative_tokens: usize,
    /// No drafts in steps where more than N sequences run.
    #[arg(long, value_name = "N")]
    pub speculative_disable_by_batch_size: Option<usize>,
    /// Shortest n-gram the n-gram method looks up.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub prompt_lookup_min: usize,
    /// Longest n-gram the n-gram method looks up (tried first).
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub prompt_lookup_max: usize,
    /// Layers the layer-skip drafter keeps [default: half the model's].
    #[arg(long, value_name = "L")]
    pub speculative_layers: Option<usize>,
    /// KV memory of the draft model's own paged cache (draft and layer-skip).
    #[arg(long, default_value = "64MiB", value_parser = super::parse_bytes)]
    pub speculative_kv_cache_memory: u64,
}

impl SpecMethod {
    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            SpecMethod::Draft => "draft",
            SpecMethod::Ngram => "ngram",
            SpecMethod::LayerSkip => "layer-skip",
        }
    }
}

impl SpeculativeArgs {
    /// The method asked for, if any.
    pub fn method(&self) -> anyhow::Result<Option<SpecMethod>> {
        match (self.speculative_method, &self.speculative_model) {
            (None, Some(_)) | (Some(SpecMethod::Draft), Some(_)) => Ok(Some(SpecMethod::Draft)),
            (Some(SpecMethod::Draft), None) => {
                bail!("--speculative-method draft needs --speculative-model DIR")
            }
            (Some(method), Some(_)) => {
                bail!("--speculative-model is for --speculative-method draft, not {method:?}")
            }
            (method, None) => Ok(method),
        }
    }

    pub fn config(&self) -> SpecConfig {
        SpecConfig {
            num_speculative_tokens: self.num_speculative_tokens,
            disable_by_batch_size: self.speculative_disable_by_batch_size,
        }
    }

    /// The draft model, loaded as the target was (`dtype`), if the method is `draft`.
    pub fn load_draft(&self, dtype: &str, target: &Llama) -> anyhow::Result<Option<Llama>> {
        let (Some(SpecMethod::Draft), Some(dir)) = (self.method()?, &self.speculative_model) else {
            return Ok(None);
        };
        let dtype: ch02::WeightDtype = dtype.parse().map_err(anyhow::Error::msg)?;
        let draft = ch02::load_fast(dir, dtype)
            .with_context(|| format!("loading the draft model from {}", dir.display()))?;
        if draft.config.vocab_size != target.config.vocab_size {
            bail!(
                "the draft model {} has {} tokens, the target {}: they must share a tokenizer",
                dir.display(),
                draft.config.vocab_size,
                target.config.vocab_size
            );
        }
        Ok(Some(draft))
    }

    /// The engine's speculator for a target of `vocab` tokens (and the draft model `load_draft`
    /// returned), or `None` when speculation is off. `target`: its weights in host memory, which
    /// the layer-skip drafter runs and beside which a draft model runs on the CPU; `None` when
    /// an executor holds them elsewhere (a GPU), where only n-gram lookup, which needs no model,
    /// drafts. `block_size`: the draft cache's.
    pub fn speculator<'m>(
        &self,
        vocab: usize,
        target: Option<&'m Llama>,
        draft: Option<&'m Llama>,
        block_size: usize,
    ) -> anyhow::Result<Option<Box<dyn Speculator + 'm>>> {
        let Some(method) = self.method()? else {
            return Ok(None);
        };
        if self.num_speculative_tokens == 0 {
            bail!("--num-speculative-tokens must be at least 1");
        }
        if target.is_none() && method != SpecMethod::Ngram {
            bail!(
                "--speculative-method {}: its drafter runs on the CPU beside the target's weights \
                 in host memory; with --device cuda only ngram drafts so far",
                method.name()
            );
        }
        let memory = self.speculative_kv_cache_memory;
        let drafter: Box<dyn Drafter + 'm> = match method {
            SpecMethod::Ngram => Box::new(NgramDrafter::new(
                self.prompt_lookup_min,
                self.prompt_lookup_max,
            )?),
            SpecMethod::Draft => {
                let draft = draft.context("the draft model was not loaded")?;
                let executor = draft_executor(draft, block_size, memory)?;
                Box::new(ModelDrafter::new(executor, vocab)?)
            }
            SpecMethod::LayerSkip => {
                let target = target.context("the target's weights are not in host memory")?;
                let layers = self
                    .speculative_layers
                    .unwrap_or(target.layers.len() / 2)
                    .max(1);
                let executor = layer_skip_executor(target, layers, block_size, memory)?;
                Box::new(ModelDrafter::new(executor, vocab)?)
            }
        };
        Ok(Some(Box::new(SpeculativeDecoding::new(
            drafter,
            self.config(),
        ))))
    }

    /// One line for the log.
    pub fn describe(&self) -> anyhow::Result<Option<String>> {
        Ok(self.method()?.map(|method| {
            let what = match method {
                SpecMethod::Ngram => format!(
                    "n-gram lookup (n = {}..={})",
                    self.prompt_lookup_min, self.prompt_lookup_max
                ),
                SpecMethod::Draft => format!(
                    "draft model {}",
                    self.speculative_model
                        .as_deref()
                        .map_or(String::new(), |d| d.display().to_string())
                ),
                SpecMethod::LayerSkip => match self.speculative_layers {
                    Some(l) => format!("layer skip (first {l} layers)"),
                    None => "layer skip (first half of the layers)".into(),
                },
            };
            let pause = self
                .speculative_disable_by_batch_size
                .map_or(String::new(), |n| format!(", off above {n} sequences"));
            format!(
                "speculative decoding: {what}, k = {}{pause}",
                self.num_speculative_tokens
            )
        }))
    }
}

/// The speculation counters of an engine run, for the log.
pub fn summary(c: &ch04::Counters) -> Option<String> {
    if c.spec_decode_num_drafts == 0 {
        return None;
    }
    let rate = c.spec_decode_num_accepted_tokens as f64 / c.spec_decode_num_draft_tokens as f64;
    let per_step = (c.spec_decode_num_accepted_tokens + c.spec_decode_num_drafts) as f64
        / c.spec_decode_num_drafts as f64;
    Some(format!(
        "speculation: {} verifications | {} draft tokens, {} accepted ({:.1}%) | {:.2} tokens per \
         verification",
        c.spec_decode_num_drafts,
        c.spec_decode_num_draft_tokens,
        c.spec_decode_num_accepted_tokens,
        rate * 100.0,
        per_step
    ))
}

#[cfg(test)]
mod tests {
    use super::{SpecMethod, SpeculativeArgs};

    fn args(method: SpecMethod) -> SpeculativeArgs {
        SpeculativeArgs {
            speculative_model: None,
            speculative_method: Some(method),
            num_speculative_tokens: 4,
            speculative_disable_by_batch_size: None,
            prompt_lookup_min: 1,
            prompt_lookup_max: 4,
            speculative_layers: None,
            speculative_kv_cache_memory: 1 << 20,
        }
    }

    /// Without the target's weights in host memory (`--device cuda`), n-gram lookup still
    /// drafts; the layer-skip drafter, which runs the target's own layers, is refused, saying why.
    #[test]
    fn without_host_weights_only_ngram_drafts() {
        let speculator = args(SpecMethod::Ngram).speculator(100, None, None, 16);
        assert!(speculator.unwrap().is_some());
        let error = args(SpecMethod::LayerSkip)
            .speculator(100, None, None, 16)
            .err()
            .expect("layer skip needs the target's weights")
            .to_string();
        assert!(
            error.contains("layer-skip") && error.contains("only ngram drafts"),
            "{error}"
        );
        let target = ch01::Llama::load(&ch01::default_model_dir()).unwrap();
        let vocab = target.config.vocab_size;
        let with_host = args(SpecMethod::LayerSkip).speculator(vocab, Some(&target), None, 16);
        assert!(with_host.unwrap().is_some());
    }
}
