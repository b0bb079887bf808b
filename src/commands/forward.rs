//! `kiln forward`: the logits of every prompt position, for debugging and external comparison.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Context;
use safetensors::{Dtype, tensor::TensorView};

use super::ModelArgs;
use super::prompt_step::{cache_for, prompt_logits};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt, tokenized with the tokenizer's own special-token rules.
    #[arg(long)]
    pub prompt: String,
    /// Output safetensors file: tensor `logits`, shape [T, vocab], f32.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (host, model) = args.model.load_for_device()?;
    let tokens = host.tokenizer.encode(&args.prompt, true)?;
    let logits = match model {
        Some(model) => model.forward(&tokens)?, // [T, vocab]
        None => {
            // On a GPU: the prompt as one prefill step through its executor, f32 K/V.
            let cache = cache_for(&host.config, tokens.len(), ch03::KvDtype::F32);
            let mut executor = args.model.gpu_executor(&host.config, &cache)?;
            prompt_logits(&mut *executor, &tokens)?
        }
    };
    let shape = vec![logits.nrows(), logits.ncols()];
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::F32, shape.clone(), &bytes)?;
    let metadata = HashMap::from([("input_ids".to_string(), format!("{tokens:?}"))]);
    // Written whole, then renamed over the file: a failed write leaves no truncated file.
    let file = safetensors::serialize([("logits", view)], Some(metadata))?;
    ch01::new_dir::write_new_file(&args.out, &file)
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "wrote logits {shape:?} for {} tokens to {}",
        tokens.len(),
        args.out.display()
    );
    Ok(())
}
