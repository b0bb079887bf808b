//! Perplexity as llama.cpp's `perplexity` tool computes it, so the two can be compared.
//!
//! The text is tokenized without special tokens and cut into `tokens.len() / ctx` chunks of
//! `ctx` tokens (a remainder is dropped). When the tokenizer adds BOS, each chunk's first token
//! is replaced by BOS. Only the second half of each chunk is scored — positions
//! `ctx/2 .. ctx-1` predicting the next token — so every scored token has at least `ctx/2`
//! tokens of context. Perplexity is `exp(mean negative log-likelihood)` over all scored tokens.

use crate::attention::log_sum_exp;
use crate::error::{Error, Result};
use crate::model::Llama;

/// The result of scoring a text.
#[derive(Debug, Clone, PartialEq)]
pub struct Perplexity {
    pub perplexity: f64,
    pub num_chunks: usize,
    pub scored_tokens: usize,
    /// Running perplexity after each chunk (llama.cpp prints these as `[1]40.1,[2]...`).
    pub per_chunk: Vec<f64>,
}

/// Scores `tokens` (already tokenized without special tokens) in chunks of `ctx`.
/// `bos` replaces each chunk's first token when given. At most `max_chunks` chunks when given.
pub fn perplexity(
    model: &Llama,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    max_chunks: Option<usize>,
) -> Result<Perplexity> {
    perplexity_with(tokens, ctx, bos, max_chunks, |input| model.forward(input))
}

/// [`perplexity`] with any forward: `forward(chunk)` returns the chunk's logits
/// `[chunk.len(), vocab]` (a later chapter's engine, a KV cache of another dtype).
pub fn perplexity_with<E: From<Error>>(
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    max_chunks: Option<usize>,
    mut forward: impl FnMut(&[u32]) -> std::result::Result<ndarray::Array2<f32>, E>,
) -> std::result::Result<Perplexity, E> {
    if ctx < 4 {
        return Err(
            Error::InvalidArgument(format!("--ctx {ctx} is too small (at least 4)")).into(),
        );
    }
    let available = tokens.len() / ctx;
    let num_chunks = max_chunks.map_or(available, |m| m.min(available));
    if num_chunks == 0 {
        return Err(Error::InvalidArgument(format!(
            "the text has {} tokens, fewer than one chunk of {ctx}",
            tokens.len()
        ))
        .into());
    }

    let first = ctx / 2;
    let (mut nll_sum, mut scored) = (0.0f64, 0usize);
    let mut per_chunk = Vec::with_capacity(num_chunks);
    // ANCHOR: perplexity_chunks
    for chunk in tokens.chunks_exact(ctx).take(num_chunks) {
        let mut input = chunk.to_vec();
        if let Some(bos) = bos {
            input[0] = bos;
        }
        let logits = forward(&input)?; // [ctx, vocab]
        for j in first..ctx - 1 {
            let row = logits.row(j);
            let row = row
                .as_slice()
                .expect("rows of a fresh array are contiguous");
            nll_sum += log_sum_exp(row) - row[chunk[j + 1] as usize] as f64;
            scored += 1;
        }
        per_chunk.push((nll_sum / scored as f64).exp());
    }
    // ANCHOR_END: perplexity_chunks
    Ok(Perplexity {
        perplexity: (nll_sum / scored as f64).exp(),
        num_chunks,
        scored_tokens: scored,
        per_chunk,
    })
}
