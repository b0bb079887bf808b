//! What part 2's benchmarks share: the model they run, Hamlet as its tokens, and the caption.

use std::path::PathBuf;

use anyhow::Context;

use super::super::RunFacts;
use super::super::ch02::references::fixtures;
use crate::commands::{LoadedModel, ModelArgs};

/// SmolLM2-135M-Instruct's directory with f32 weights (the default model with `--quick`).
pub fn model(quick: bool) -> anyhow::Result<ModelArgs> {
    let dir: PathBuf = if quick {
        ch01::default_model_dir()
    } else {
        fixtures().join(".cache/SmolLM2-135M-Instruct")
    };
    anyhow::ensure!(
        dir.exists(),
        "{} is missing (run `just fetch-smollm2`)",
        dir.display()
    );
    Ok(ModelArgs::cpu(dir))
}

/// Hamlet tokenized without special tokens, and the BOS that replaces each chunk's first token
/// (perplexity's scheme).
pub fn hamlet(loaded: &LoadedModel) -> anyhow::Result<(Vec<u32>, Option<u32>)> {
    let text = std::fs::read_to_string(ch01::fixtures_dir().join("corpus/hamlet.txt"))
        .context("reading fixtures/corpus/hamlet.txt")?;
    let bos = loaded
        .tokenizer
        .adds_bos()
        .then(|| loaded.tokenizer.bos_token_id())
        .flatten();
    Ok((loaded.tokenizer.encode(&text, false)?, bos))
}

/// `_{what}, N threads on CPU (n CPUs), date, runs. Command: `...`._`
pub fn caption(what: &str, facts: &RunFacts, reps: usize) -> String {
    format!(
        "_{what}, {}, {}. Command: `{}`._",
        facts.machine(rayon::current_num_threads()),
        crate::bench::runs(reps),
        facts.command
    )
}

/// The last component of the model's path, for captions.
pub fn name(args: &ModelArgs) -> String {
    args.model
        .file_name()
        .map_or("the model".into(), |n| n.to_string_lossy().into_owned())
}
