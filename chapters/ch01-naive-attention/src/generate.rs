//! The generation loop of chapter 1: recompute everything, every token.
//!
//! ```text
//! tokens = prompt
//! loop:
//!     logits = model.forward(tokens)      // all T positions, from scratch: O(T²) attention
//!     next   = sampler.sample(logits[T-1])
//!     stop on EOS, a stop string, max_tokens or a full context
//!     tokens.push(next)
//! ```

use std::time::{Duration, Instant};

use ndarray::Array1;

use crate::error::{Error, Result};
use crate::model::Llama;
use crate::output_text::OutputText;
use crate::sampler::{Sampler, SamplingParams};
use crate::tokenizer::Tokenizer;

/// What to generate and when to stop.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops before any of these strings; they are not part of the output.
    pub stop: Vec<String>,
    /// Keep generating past EOS (for benchmarks and golden comparisons).
    pub ignore_eos: bool,
    /// Token ids that end generation (from the tokenizer and `generation_config.json`).
    pub eos_token_ids: Vec<u32>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 64,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            eos_token_ids: Vec::new(),
        }
    }
}

/// Why generation ended, named as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` reached, or the model's context is full.
    Length,
}

/// The result of one generation, with llama.cpp-style timings.
#[derive(Debug, Clone)]
pub struct Generation {
    pub output_tokens: Vec<u32>,
    /// Output text up to (not including) a stop string.
    pub text: String,
    pub finish_reason: FinishReason,
    /// Time of the first forward pass: the whole prompt, producing the first token.
    pub prompt_time: Duration,
    /// Time of every later forward pass.
    pub generation_time: Duration,
    /// Number of forward passes after the first (each yields one token or the final EOS).
    pub decode_steps: usize,
}

/// Generates from `prompt_tokens` with chapter 1's model, calling `on_text` with each piece of
/// text as soon as it is final.
// ANCHOR: generate
pub fn generate(
    model: &Llama,
    tokenizer: &Tokenizer,
    prompt_tokens: &[u32],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation> {
    model.check_tokens(prompt_tokens)?;
    // ANCHOR: recompute
    // Every step runs the whole sequence so far through the model: O(T²) attention.
    let mut next_token_logits = |tokens: &[u32]| model.next_token_logits(tokens);
    // ANCHOR_END: recompute
    let max_len = model.config.max_position_embeddings;
    generate_with(
        tokenizer,
        prompt_tokens,
        max_len,
        options,
        &mut next_token_logits,
        on_text,
    )
}
// ANCHOR_END: generate

/// Computes the logits `[vocab]` of the position after `tokens` (prompt + output so far).
pub type NextTokenLogits<'a, E> = dyn FnMut(&[u32]) -> Result<Array1<f32>, E> + 'a;

/// The generation loop, whatever computes the logits: `next_token_logits(tokens)` returns the
/// logits `[vocab]` of the position after `tokens` (the prompt plus everything generated so far).
/// Chapter 1 recomputes the whole sequence there; chapter 2 passes a closure that reads a KV cache.
/// `max_len` is the model's context: generation stops with [`FinishReason::Length`] when it is full.
// ANCHOR: generate_loop
pub fn generate_with<E: From<Error>>(
    tokenizer: &Tokenizer,
    prompt_tokens: &[u32],
    max_len: usize,
    options: &GenerateOptions,
    next_token_logits: &mut NextTokenLogits<'_, E>,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation, E> {
    let mut sampler = Sampler::new(options.sampling.clone()).map_err(Error::from)?;
    let mut text = OutputText::after(tokenizer, options.stop.clone(), prompt_tokens);
    let mut tokens = prompt_tokens.to_vec();
    let mut output_tokens = Vec::new();
    let (mut prompt_time, mut generation_time, mut decode_steps) =
        (Duration::ZERO, Duration::ZERO, 0);

    let mut finish_reason = FinishReason::Length;
    while output_tokens.len() < options.max_tokens && tokens.len() < max_len {
        let start = Instant::now();
        let logits = next_token_logits(&tokens)?; // [vocab]
        let next = sampler
            .sample(
                logits.as_slice().expect("contiguous"),
                prompt_tokens,
                &output_tokens,
            )
            .map_err(Error::from)?;
        if output_tokens.is_empty() {
            prompt_time = start.elapsed();
        } else {
            generation_time += start.elapsed();
            decode_steps += 1;
        }

        if !options.ignore_eos && options.eos_token_ids.contains(&next) {
            finish_reason = FinishReason::Stop;
            break;
        }
        tokens.push(next);
        output_tokens.push(next);
        let delta = text.push(next)?;
        on_text(&delta.text);
        if delta.stopped {
            finish_reason = FinishReason::Stop;
            break;
        }
    }
    // Ended by EOS or a length limit: release what was held back (it may complete a stop string).
    if !text.stopped() {
        let delta = text.finish()?;
        on_text(&delta.text);
        if delta.stopped {
            finish_reason = FinishReason::Stop;
        }
    }

    Ok(Generation {
        output_tokens,
        text: text.text().to_string(),
        finish_reason,
        prompt_time,
        generation_time,
        decode_steps,
    })
}
// ANCHOR_END: generate_loop
