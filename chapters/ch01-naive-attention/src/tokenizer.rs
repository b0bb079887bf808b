//! `tokenizer.json` → token ids and back.
//!
//! The heavy lifting (byte-level BPE, normalisers, special tokens) is Hugging Face's `tokenizers`
//! crate, so ids match `transformers` exactly. What this module adds is what serving needs:
//! the special ids from `tokenizer_config.json`, and [`TextStream`], which turns a stream of ids
//! into a stream of text without ever emitting half a UTF-8 character. A vocabulary whose
//! encoding that crate cannot express (chapter 5's SentencePiece-style GGUF files, whose equal
//! merge scores llama.cpp breaks by position) brings its own [`Encoder`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::token_bytes::ByteForm;
use crate::tokenizer_json;
pub use crate::tokenizer_json::{
    MAX_ADDED_TOKEN_BYTES, MAX_ADDED_TOKENS, MAX_ADDED_TOKENS_BYTES, check_added_tokens,
};

/// Text → ids done by other code than the `tokenizers` pipeline's own `encode`, for a
/// vocabulary whose model that crate cannot express. It is handed the tokenizer's pipeline
/// for the steps it keeps (added tokens, normalizer, post-processor); decoding, the
/// vocabulary and the special ids stay the pipeline's.
pub trait Encoder: Send + Sync {
    /// `text`'s ids, BOS/EOS added as the pipeline's post-processor says when
    /// `add_special_tokens` (what [`Tokenizer::encode`] returns).
    fn encode(
        &self,
        pipeline: &tokenizers::Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> tokenizers::Result<Vec<u32>>;
}

/// A loaded tokenizer with its special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Encodes in place of `inner.encode` when set ([`Tokenizer::with_encoder`]).
    encoder: Option<Arc<dyn Encoder>>,
    path: PathBuf,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    /// How the vocabulary spells bytes, for [`Tokenizer::token_bytes`].
    byte_form: ByteForm,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json` for the
    /// `bos_token` / `eos_token` names.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        let inner = tokenizer_json::load(&bytes).map_err(|message| Error::Tokenizer {
            path: path.clone(),
            message,
        })?;
        let mut tokenizer = Tokenizer::from_parts(inner, path, None, None);

        let config_path = dir.join("tokenizer_config.json");
        if config_path.exists() {
            let text =
                std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
            let config: Value = serde_json::from_str(&text).map_err(|e| Error::Tokenizer {
                path: config_path.clone(),
                message: e.to_string(),
            })?;
            tokenizer.bos_token_id = tokenizer.special_id(&config, "bos_token", &config_path)?;
            tokenizer.eos_token_id = tokenizer.special_id(&config, "eos_token", &config_path)?;
        }
        Ok(tokenizer)
    }

    /// A tokenizer built by other means than a `tokenizer.json` (chapter 5 builds one from a
    /// GGUF file's metadata); `path` names the file it came from in errors.
    pub fn from_parts(
        inner: tokenizers::Tokenizer,
        path: PathBuf,
        bos_token_id: Option<u32>,
        eos_token_id: Option<u32>,
    ) -> Self {
        let inner = tokenizer_json::without_length_rules(inner);
        Tokenizer {
            byte_form: ByteForm::of(&inner),
            inner,
            encoder: None,
            path,
            bos_token_id,
            eos_token_id,
        }
    }

    /// The same tokenizer with `encoder` doing every encoding ([`Tokenizer::encode`] and what
    /// calls it); decoding is unchanged.
    pub fn with_encoder(mut self, encoder: Arc<dyn Encoder>) -> Self {
        self.encoder = Some(encoder);
        self
    }

    /// The encoder set by [`Tokenizer::with_encoder`], for a copy that must encode the same
    /// way ([`Tokenizer::from_parts`] makes one without).
    pub fn encoder(&self) -> Option<&Arc<dyn Encoder>> {
        self.encoder.as_ref()
    }

    /// The `tokenizers` tokenizer inside. Its own `encode` ignores an [`Encoder`]: encode
    /// with [`Tokenizer::encode`].
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// `config[key]` is a token string or `{"content": string, ...}`; it must be in the vocabulary.
    fn special_id(&self, config: &Value, key: &str, path: &Path) -> Result<Option<u32>> {
        let token = match config.get(key) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s.as_str(),
            // An added token's form: `{"content": "<s>", "lstrip": false, ...}`.
            Some(Value::Object(o)) if o.get("content").is_some_and(Value::is_string) => {
                o["content"].as_str().unwrap_or_default()
            }
            Some(other) => {
                return Err(Error::Tokenizer {
                    path: path.to_path_buf(),
                    message: format!(
                        "`{key}` must be a string or an object with a string `content`, found {other}"
                    ),
                });
            }
        };
        match self.inner.token_to_id(token) {
            Some(id) => Ok(Some(id)),
            None => Err(Error::Tokenizer {
                path: path.to_path_buf(),
                message: format!("`{key}` {token:?} is not in the vocabulary"),
            }),
        }
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Text → ids. With `add_special_tokens` the tokenizer's own post-processor runs (for Llama-style
    /// tokenizers it prepends BOS), as `transformers`' `encode` does by default. The
    /// [`Encoder`], when there is one, encodes instead of the pipeline.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        tokenizer_json::guarded(|| match &self.encoder {
            Some(encoder) => encoder.encode(&self.inner, text, add_special_tokens),
            None => (self.inner.encode(text, add_special_tokens))
                .map(|encoding| encoding.get_ids().to_vec()),
        })
        .map_err(|message| self.error(message))
    }

    /// Ids → text, leaving out special tokens such as BOS and EOS.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        tokenizer_json::guarded(|| self.inner.decode(ids, true))
            .map_err(|message| self.error(message))
    }

    /// One token's bytes: what it adds to the text after earlier tokens, which decoding it
    /// alone loses where it holds part of a UTF-8 character (that decodes to U+FFFD) or starts
    /// with a SentencePiece space (which a decoder strips from the first token). Read from its
    /// vocabulary string ([`ByteForm`]); a special token, which decoded text leaves out, has
    /// none. Joining the bytes of a run of tokens gives the text they add.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        let Some(piece) = self.inner.id_to_token(id) else {
            return Ok(self.decode(&[id])?.into_bytes());
        };
        Ok(
            match self.inner.get_added_vocabulary().is_special_token(&piece) {
                true => Vec::new(),
                false => self.byte_form.bytes(&piece),
            },
        )
    }

    /// How the vocabulary spells bytes in its token strings.
    pub fn byte_form(&self) -> ByteForm {
        self.byte_form
    }

    /// Whether encoding with special tokens prepends BOS (llama.cpp's `add_bos`).
    pub fn adds_bos(&self) -> bool {
        match (self.bos_token_id, self.encode("a", true)) {
            (Some(bos), Ok(ids)) => ids.first() == Some(&bos),
            _ => false,
        }
    }

    fn error(&self, message: String) -> Error {
        Error::Tokenizer {
            path: self.path.clone(),
            message,
        }
    }
}

/// Held-back tokens past which [`TextStream`] releases the text that is final.
pub const MAX_PENDING_TOKENS: usize = 4;

/// Held-back tokens past which [`TextStream`] releases text even if a later token might still
/// change it: only tokens that each end inside a character, one after another, are held so
/// long, and this bounds the window every push re-decodes.
pub const MAX_HELD_TOKENS: usize = 32;

/// `text` past its first `len` bytes, from the next character boundary: what a window's text
/// adds to the text already emitted. When a decoder rewrote earlier text (a byte-fallback run
/// that turned invalid decodes as U+FFFD as a whole), the emitted text is not a prefix of the
/// window's any more; the stream then goes on from the same length, never holding back.
fn after(text: &str, len: usize) -> &str {
    let mut at = len.min(text.len());
    while !text.is_char_boundary(at) {
        at += 1;
    }
    &text[at..]
}

/// Tokens of context (the prompt's last ones) that [`TextStream::after`] decodes in front.
pub const CONTEXT_TOKENS: usize = 5;

/// Incremental detokenisation.
///
/// Decoding ids one at a time is wrong twice over: a character can span several byte-level
/// tokens (the first ones decode to U+FFFD), and some tokenizers drop or add spaces depending on
/// the neighbouring token (a SentencePiece decoder strips the space of the first token it sees).
/// So the stream re-decodes a short window, `tokens[prefix_offset..]`, and emits only the text
/// past `tokens[prefix_offset..read_offset]`, holding it back while it ends in an incomplete
/// character.
///
/// Invariant: the concatenation of everything returned by [`TextStream::push`] and
/// [`TextStream::finish`] equals `decode(all tokens)` when that decodes cleanly (after the
/// context's text, with [`TextStream::after`]). Past [`MAX_PENDING_TOKENS`] held-back tokens,
/// the text up to the last token boundary that no later token can change is released (bytes that
/// stay invalid, as U+FFFD), so the window stays short; past [`MAX_HELD_TOKENS`] (tokens that
/// all end inside a character, one after another) the text is released even where a character
/// might still complete, and it shows as U+FFFD. Text is never dropped.
pub struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    tokens: Vec<u32>,
    /// How many of `tokens` are context, decoded in front but never emitted.
    context: usize,
    prefix_offset: usize,
    read_offset: usize,
}

impl<'t> TextStream<'t> {
    pub fn new(tokenizer: &'t Tokenizer) -> Self {
        Self::after(tokenizer, &[])
    }

    /// A stream whose text continues `context` (the prompt): its last [`CONTEXT_TOKENS`]
    /// tokens are decoded in front of the first generated ones, so that a token's leading space
    /// survives a decoder that strips the first token's (SentencePiece's `▁Paris` after "is"
    /// is " Paris", alone "Paris").
    pub fn after(tokenizer: &'t Tokenizer, context: &[u32]) -> Self {
        let tokens = context[context.len().saturating_sub(CONTEXT_TOKENS)..].to_vec();
        let context = tokens.len();
        TextStream {
            tokenizer,
            tokens,
            context,
            prefix_offset: 0,
            read_offset: context,
        }
    }

    /// Adds one token; returns the new text it completes, if any.
    // ANCHOR: text_stream_push
    pub fn push(&mut self, token: u32) -> Result<Option<String>> {
        self.tokens.push(token);
        let prefix_text = self
            .tokenizer
            .decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let new_text = self.tokenizer.decode(&self.tokens[self.prefix_offset..])?;
        let held = self.tokens.len() - self.read_offset;
        if new_text.len() > prefix_text.len() && !new_text.ends_with('\u{FFFD}') {
            let delta = after(&new_text, prefix_text.len()).to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            return Ok(Some(delta));
        }
        if held <= MAX_PENDING_TOKENS {
            return Ok(None);
        }
        // Held long: bytes that never make a character, a run of literal U+FFFD, or tokens
        // that each end inside a character. Release the text up to the latest token boundary
        // whose text the tokens after it only extend: final text.
        for cut in (self.read_offset + 1..self.tokens.len()).rev() {
            let settled = self
                .tokenizer
                .decode(&self.tokens[self.prefix_offset..cut])?;
            let last_final = !settled.ends_with('\u{FFFD}') || new_text.len() > settled.len();
            if settled.len() > prefix_text.len() && new_text.starts_with(&settled) && last_final {
                let delta = after(&settled, prefix_text.len()).to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = cut;
                return Ok(Some(delta));
            }
        }
        if held <= MAX_HELD_TOKENS {
            return Ok(None);
        }
        // No boundary where the text is final: the window must stay bounded. Release all but
        // the last token (a character cut there shows as U+FFFD) and start a new window there.
        let cut = self.tokens.len() - 1;
        let settled = self
            .tokenizer
            .decode(&self.tokens[self.prefix_offset..cut])?;
        let delta = after(&settled, prefix_text.len()).to_string();
        self.prefix_offset = cut;
        self.read_offset = cut;
        Ok((!delta.is_empty()).then_some(delta))
    }
    // ANCHOR_END: text_stream_push

    /// Whatever text is still held back (an incomplete character decodes as U+FFFD here).
    pub fn finish(&mut self) -> Result<Option<String>> {
        let prefix_text = self
            .tokenizer
            .decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let new_text = self.tokenizer.decode(&self.tokens[self.prefix_offset..])?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        let rest = after(&new_text, prefix_text.len());
        Ok((!rest.is_empty()).then(|| rest.to_string()))
    }

    /// Every token pushed so far (not the context).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens[self.context..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every text is the ids of its bytes' count, after BOS when asked; `"fail"` fails.
    struct Lengths;

    impl Encoder for Lengths {
        fn encode(
            &self,
            pipeline: &tokenizers::Tokenizer,
            text: &str,
            add_special_tokens: bool,
        ) -> tokenizers::Result<Vec<u32>> {
            if text == "fail" {
                return Err("no such text".into());
            }
            let bos = pipeline.token_to_id("<s>").ok_or("no <s>")?;
            let n = text.len() as u32;
            Ok(match add_special_tokens {
                true => vec![bos, n],
                false => vec![n],
            })
        }
    }

    #[test]
    fn an_encoder_replaces_every_encoding_and_no_decoding() {
        let plain = Tokenizer::from_dir(&crate::fixtures_dir().join("tokenizer")).unwrap();
        let ids = plain.encode("Good night", false).unwrap();
        let text = plain.decode(&ids).unwrap();
        let bos = plain.bos_token_id();
        let inner = plain.inner().clone();
        let t = Tokenizer::from_parts(inner, "lengths.json".into(), bos, None)
            .with_encoder(Arc::new(Lengths));
        assert!(t.encoder().is_some() && plain.encoder().is_none());
        assert_eq!(t.encode("Good night", false).unwrap(), [10]);
        assert_eq!(t.encode("abc", true).unwrap(), [bos.unwrap(), 3]);
        // What calls `encode` goes through the encoder too.
        assert!(t.adds_bos());
        assert_eq!(t.decode(&ids).unwrap(), text);
        // Its error is the tokenizer's, naming the file.
        let e = t.encode("fail", false).unwrap_err();
        assert!(
            matches!(&e, Error::Tokenizer { path, message }
                if path.ends_with("lengths.json") && message.contains("no such text")),
            "{e}"
        );
    }
}
