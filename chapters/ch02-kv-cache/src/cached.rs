//! The forward pass over new tokens only, reading earlier positions from a [`KvStore`].
//!
//! ```text
//! prefill:  tokens [T] at positions 0..T        → K/V of 0..T stored,   logits [T, vocab]
//! decode:   token  [1] at position  len         → K/V of len stored,     logits [1, vocab]
//! ```
//! The weights and layers are chapter 1's (`ch01::Llama`); only attention changes: the new
//! queries attend to everything the store holds.

use ch01::generate::{GenerateOptions, Generation, generate_with};
use ch01::{Llama, Tokenizer};
use ndarray::{Array1, Array2, s};

use crate::kv_store::{KvError, KvStore};
use crate::{Error, Result};

/// Runs `tokens`, the positions `store.len()..store.len() + n`, through the model, storing their
/// K/V. Returns the final hidden states after the last norm: [n, hidden].
// ANCHOR: forward_cached
pub fn forward_hidden_cached(
    model: &Llama,
    tokens: &[u32],
    store: &mut dyn KvStore,
) -> Result<Array2<f32>> {
    model.check_tokens(tokens)?;
    let start = store.len();
    let context_len = start + tokens.len();
    if context_len > model.config.max_position_embeddings {
        return Err(ch01::Error::ContextOverflow {
            len: context_len,
            max_len: model.config.max_position_embeddings,
        }
        .into());
    }

    let mut x = model.embed(tokens); // [n, hidden]
    for (i, layer) in model.layers.iter().enumerate() {
        let h = layer.input_layernorm.forward(x.view()); // [n, hidden]
        let (q, k, v) = layer.self_attn.qkv(h.view(), &model.rope, start); // q [n, q_dim]; k, v [n, kv_dim]
        store.write(i, start, k.view(), v.view())?;
        let attn = store.attend(i, q.view(), context_len, layer.self_attn.shape()); // [n, q_dim]
        x += &layer.self_attn.output(attn.view()); // [n, hidden]
        x += &layer
            .mlp
            .forward(layer.post_attention_layernorm.forward(x.view()).view());
    }
    store.commit(context_len);
    Ok(model.norm.forward(x.view())) // [n, hidden]
}
// ANCHOR_END: forward_cached

/// Logits of every new position: [n, vocab].
pub fn forward_cached(
    model: &Llama,
    tokens: &[u32],
    store: &mut dyn KvStore,
) -> Result<Array2<f32>> {
    let hidden = forward_hidden_cached(model, tokens, store)?;
    Ok(model.lm_head.forward(hidden.view()))
}

/// Logits of the last new position only (what generation needs): [vocab].
pub fn next_token_logits_cached(
    model: &Llama,
    tokens: &[u32],
    store: &mut dyn KvStore,
) -> Result<Array1<f32>> {
    let hidden = forward_hidden_cached(model, tokens, store)?;
    let last = hidden.slice(s![hidden.nrows() - 1.., ..]); // [1, hidden]
    Ok(model.lm_head.forward(last).row(0).to_owned())
}

/// One sequence being generated: the model and its cache.
pub struct CachedSession<'m, S: KvStore> {
    pub model: &'m Llama,
    pub store: S,
}

impl<'m, S: KvStore> CachedSession<'m, S> {
    pub fn new(model: &'m Llama, store: S) -> Self {
        CachedSession { model, store }
    }

    /// Runs the prompt in one pass; returns the logits of its last position. [vocab]
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Array1<f32>> {
        next_token_logits_cached(self.model, prompt, &mut self.store)
    }

    /// Runs one new token against the cache; returns the logits of the next position. [vocab]
    pub fn decode(&mut self, token: u32) -> Result<Array1<f32>> {
        next_token_logits_cached(self.model, &[token], &mut self.store)
    }
}

/// Chapter 1's generation loop with a KV cache: the first call prefills the prompt, every later
/// call decodes the one token appended since.
// ANCHOR: generate_cached
pub fn generate_cached(
    model: &Llama,
    tokenizer: &Tokenizer,
    prompt_tokens: &[u32],
    store: &mut dyn KvStore,
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation> {
    model.check_tokens(prompt_tokens)?;
    if !store.is_empty() {
        return Err(KvError::NotAppending {
            start_pos: 0,
            len: store.len(),
        }
        .into());
    }
    let mut next_token_logits = |tokens: &[u32]| -> Result<Array1<f32>> {
        let new_tokens = &tokens[store.len()..]; // the whole prompt first, then one token
        next_token_logits_cached(model, new_tokens, store)
    };
    let max_len = model.config.max_position_embeddings;
    generate_with::<Error>(
        tokenizer,
        prompt_tokens,
        max_len,
        options,
        &mut next_token_logits,
        on_text,
    )
}
// ANCHOR_END: generate_cached
