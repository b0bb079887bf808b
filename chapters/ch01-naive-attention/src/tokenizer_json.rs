//! Reading a `tokenizer.json` that may be hostile, and calling the `tokenizers` crate on it.
//!
//! A tokenizer comes with the model, so it is untrusted input, and some of that crate's
//! components panic on values its parser accepts: a `FixedLength` pre-tokenizer of length 0, a
//! `Replace` normalizer with an empty pattern, a `TemplateProcessing` that names a special token
//! it does not define, a `Precompiled` normalizer whose character map is truncated. [`guarded`]
//! turns such a panic into an error message. One thing a panic cannot stand for: a
//! `Precompiled` map whose header declares a trie of up to 4 GB makes the crate reserve eight
//! bytes per four declared before it reads any of it, an allocation whose failure aborts the
//! process; [`check_precompiled`] refuses such a map before the crate sees it.
//!
//! The crate also matches every added token (`<|im_start|>`, `<tool_call>`) in one automaton it
//! builds as it loads, in time that grows with the square of a token's length when the token
//! repeats itself: one added token of 100,000 `a`s did not load within a minute.
//! [`check_added_tokens`] holds a file's added tokens to limits no real tokenizer comes near.
//!
//! The file's `truncation` and `padding` settings are switched off ([`without_length_rules`]),
//! as `transformers` overrides them at every encode: a prompt is never silently cut to the
//! file's `max_length`, and never padded to a length the file chose (`pad_to_multiple_of: 2^42`
//! asked for 4 TB).

use base64::Engine as _;
use serde_json::Value;

/// The parts of a `tokenizer.json` read before the crate reads it all.
#[derive(serde::Deserialize)]
struct Checked {
    #[serde(default)]
    normalizer: Value,
    #[serde(default)]
    added_tokens: Vec<AddedTokenText>,
}

#[derive(serde::Deserialize)]
struct AddedTokenText {
    content: String,
}

/// The longest added token [`check_added_tokens`] accepts, in bytes (real ones are tens).
pub const MAX_ADDED_TOKEN_BYTES: usize = 1 << 10;
/// The most added tokens [`check_added_tokens`] accepts (real tokenizers have up to thousands).
pub const MAX_ADDED_TOKENS: usize = 1 << 16;
/// The most bytes all added tokens together may hold.
pub const MAX_ADDED_TOKENS_BYTES: usize = 1 << 20;

/// Refuses added tokens that would make the `tokenizers` crate's matcher slow to build: more
/// than [`MAX_ADDED_TOKENS`] of them, one longer than [`MAX_ADDED_TOKEN_BYTES`], or more than
/// [`MAX_ADDED_TOKENS_BYTES`] together. Within these limits the slowest set measured (1,024
/// tokens of 1,000 bytes, each a run of one letter then of another) built in 0.05 s.
pub fn check_added_tokens<'a>(tokens: impl IntoIterator<Item = &'a str>) -> Result<(), String> {
    let (mut count, mut bytes) = (0usize, 0usize);
    for token in tokens {
        count += 1;
        bytes += token.len();
        if token.len() > MAX_ADDED_TOKEN_BYTES {
            let start: String = token.chars().take(16).collect();
            return Err(format!(
                "added token {start:?}... is {} bytes long; kiln reads added tokens of up to \
                 {MAX_ADDED_TOKEN_BYTES}",
                token.len()
            ));
        }
    }
    if count > MAX_ADDED_TOKENS {
        return Err(format!(
            "{count} added tokens; kiln reads up to {MAX_ADDED_TOKENS}"
        ));
    }
    if bytes > MAX_ADDED_TOKENS_BYTES {
        return Err(format!(
            "the added tokens hold {bytes} bytes together; kiln reads up to {MAX_ADDED_TOKENS_BYTES}"
        ));
    }
    Ok(())
}

/// `bytes` (a `tokenizer.json`) as a tokenizer, or why not. Its truncation and padding are as
/// the file says: [`crate::Tokenizer::from_parts`] switches them off.
pub(crate) fn load(bytes: &[u8]) -> Result<tokenizers::Tokenizer, String> {
    let json: Checked = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    check_precompiled(&json.normalizer)?;
    check_added_tokens(json.added_tokens.iter().map(|t| t.content.as_str()))?;
    guarded(|| tokenizers::Tokenizer::from_bytes(bytes))
}

/// `inner` with truncation and padding switched off (see the module doc).
pub(crate) fn without_length_rules(mut inner: tokenizers::Tokenizer) -> tokenizers::Tokenizer {
    inner.with_padding(None);
    (inner.with_truncation(None))
        .expect("no truncation cannot fail: only a stride too long for a max_length can");
    inner
}

/// Runs `call` into the `tokenizers` crate: its error, or a panic inside it, becomes the
/// message of an error (the crate's own panic message, after "panicked: ").
pub(crate) fn guarded<T>(call: impl FnOnce() -> tokenizers::Result<T>) -> Result<T, String> {
    // Unwind safety: after a panic the tokenizer may hold a poisoned cache lock, so later calls
    // may panic again, and each is caught here in turn; nothing else it holds is left half made.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(payload) => {
            let message = (payload.downcast_ref::<&str>().copied())
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("(no message)");
            Err(format!("the tokenizers crate panicked: {message}"))
        }
    }
}

/// Refuses a `Precompiled` normalizer (at any depth of `Sequence`s) whose character map is
/// shorter than the trie its first four bytes declare (a little-endian byte count, the trie
/// then the normalized strings after it). A map this cannot decode is left to the crate, whose
/// base64 reader is more lenient (unpadded text) and which reports, or panics, on its own.
fn check_precompiled(normalizer: &Value) -> Result<(), String> {
    if let Some(inner) = normalizer.get("normalizers").and_then(Value::as_array) {
        return inner.iter().try_for_each(check_precompiled);
    }
    if normalizer.get("type").and_then(Value::as_str) != Some("Precompiled") {
        return Ok(());
    }
    let Some(map) = normalizer
        .get("precompiled_charsmap")
        .and_then(Value::as_str)
    else {
        return Ok(()); // the crate's parser reports a missing or mistyped map itself
    };
    let Ok(map) = base64::engine::general_purpose::STANDARD.decode(map) else {
        return Ok(());
    };
    let declared = match map.first_chunk::<4>() {
        Some(size) => u32::from_le_bytes(*size) as usize,
        None => return Err("precompiled_charsmap is shorter than its 4-byte header".into()),
    };
    if declared > map.len() - 4 {
        return Err(format!(
            "precompiled_charsmap declares a trie of {declared} bytes but holds {}",
            map.len() - 4
        ));
    }
    Ok(())
}
