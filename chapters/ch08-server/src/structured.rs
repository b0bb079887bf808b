//! Structured outputs: a grammar turned into a token mask, one per sequence.
//!
//! A request may ask that its output match a JSON schema, any JSON object, a regular
//! expression, one of a few strings, or a Lark grammar. The grammar engine (`llguidance`)
//! compiles it once per request; each choice gets its own [`Matcher`] (its parse so far), which
//! chapter 4's [`LogitsProcessor`] seam runs before every token:
//!
//! ```text
//! prepare()   mask = matcher.compute_mask()      which tokens can extend a valid prefix
//! process()   logits[t] = -inf  for every t not in mask
//! accept(t)   matcher.consume_token(t)           the parse moves on; stopped → end "stop"
//! ```
//!
//! The engine knows tokens; the grammar knows bytes. [`Grammars`] bridges them once per server:
//! a trie of every token's bytes ([`TokTrie`]), built from the Hugging Face tokenizer kiln
//! already loads. Special tokens get a marker byte so no grammar can spell one by accident.
//!
//! Bounded work per request: the grammar's text is capped at [`MAX_GRAMMAR_BYTES`], the
//! engine's own [`ParserLimits`] cap compile time and each mask's work, and a grammar that
//! does not compile is a 400, never a panic.

use std::sync::{Arc, Mutex, OnceLock};

use ch04::LogitsProcessor;
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::ApiError;

/// The most bytes a schema, regex, grammar or choice list may have, as JSON text.
pub const MAX_GRAMMAR_BYTES: usize = 64 << 10;
/// The most strings `guided_choice` may list.
pub const MAX_CHOICES: usize = 256;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Output matches this JSON schema.
    JsonSchema(Value),
    /// Output is any JSON object.
    JsonObject,
    /// Output matches this regular expression, whole.
    Regex(String),
    /// Output is exactly one of these strings.
    Choice(Vec<String>),
    /// Output matches this Lark grammar.
    Lark(String),
}

impl Constraint {
    /// The grammar engine's form of it. Refuses what is over [`MAX_GRAMMAR_BYTES`] or
    /// [`MAX_CHOICES`]; `param` names the request field in errors.
    pub fn grammar(&self, param: &str) -> Result<TopLevelGrammar, ApiError> {
        let too_big = |bytes: usize| {
            ApiError::bad_param(
                param,
                format!(
                    "{param} is {bytes} bytes: at most {MAX_GRAMMAR_BYTES} bytes of schema, \
                     regex or grammar are accepted"
                ),
            )
        };
        let check = |bytes: usize| {
            if bytes > MAX_GRAMMAR_BYTES {
                Err(too_big(bytes))
            } else {
                Ok(())
            }
        };
        Ok(match self {
            Constraint::JsonSchema(schema) => {
                check(schema.to_string().len())?;
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(ApiError::bad_param(
                        param,
                        "a JSON schema must be an object (or true / false)",
                    ));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"})))
            }
            Constraint::Regex(regex) => {
                check(regex.len())?;
                TopLevelGrammar::from_regex(regex)
            }
            Constraint::Choice(choices) => {
                if choices.is_empty() || choices.len() > MAX_CHOICES {
                    return Err(ApiError::bad_param(
                        param,
                        format!("{param} must list 1 to {MAX_CHOICES} strings"),
                    ));
                }
                check(choices.iter().map(|c| c.len() + 4).sum())?;
                // Each choice a Lark string literal (JSON's escapes), one alternative each.
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::to_string(c).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Constraint::Lark(grammar) => {
                check(grammar.len())?;
                TopLevelGrammar::from_lark(grammar.clone())
            }
        })
    }
}

/// JSON without free whitespace (`{"a":1}`, as OpenAI writes it), unless the schema sets
/// the engine's own `x-guidance` options: a small model left free to write whitespace may
/// write nothing else.
fn compact(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut() {
        object
            .entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false}));
    }
    schema
}

// ANCHOR: token_bytes
/// Every token's bytes, as the grammar engine needs them: what the token adds to the text
/// (chapter 1's `ByteForm`: byte-level BPE writes each byte as one printable character,
/// SentencePiece a space as `▁` and an odd byte as `<0xNN>`). A special token, and every stop
/// token, is its text after the marker byte 0xFF, which no text contains: a grammar can never
/// spell one inside a string.
fn token_bytes(tokenizer: &ch01::Tokenizer, vocab_size: usize, eos: &[u32]) -> Vec<Vec<u8>> {
    let inner = tokenizer.inner();
    let form = tokenizer.byte_form();
    let added = inner.get_added_vocabulary();
    (0..vocab_size as u32)
        .map(|id| {
            let Some(token) = inner.id_to_token(id) else {
                return Vec::new(); // a row of the model past the tokenizer's vocabulary
            };
            if eos.contains(&id) || added.is_special_token(&token) {
                let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                bytes.extend_from_slice(token.as_bytes());
                return bytes;
            }
            form.bytes(&token)
        })
        .collect()
}
// ANCHOR_END: token_bytes

/// The tokenizer as the grammar engine sees it: the trie, and the tokenizer for the few strings
/// a grammar forces.
struct KilnTokEnv {
    trie: TokTrie,
    tokenizer: Arc<ch01::Tokenizer>,
}

impl TokenizerEnv for KilnTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokens a grammar forces for the bytes `s`: they must spell exactly `s`, since the
    /// engine forces them without checking. The tokenizer's own where they do; else (bytes that
    /// end inside a character, a SentencePiece tokenizer's `▁` in front of the text) the trie's
    /// greedy tokens, valid if not the tokenizer's choice.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            match self.tokenizer.encode(text, false) {
                Ok(ids) if self.trie.decode_raw(&ids) == text.as_bytes() => ids,
                _ => self.trie.greedy_tokenize(text.as_bytes()),
            }
        })
    }
}

/// The grammar engine over one model's tokenizer: built once (on the first constrained
/// request), shared by every request.
pub struct Grammars {
    factory: ParserFactory,
    /// The stop tokens a finished grammar allows.
    eos: Vec<u32>,
}

impl Grammars {
    /// Over `tokenizer`, for a model of `vocab_size` logits whose stop tokens are `eos`.
    pub fn new(
        tokenizer: Arc<ch01::Tokenizer>,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<Self, String> {
        let &first = eos
            .first()
            .ok_or("the model has no end-of-sequence token: a grammar could never end")?;
        let words = token_bytes(&tokenizer, vocab_size, eos);
        let info = TokRxInfo::new(vocab_size as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(KilnTokEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Quiet: errors reach the client as 400s, not stderr.
        factory.set_stderr_log_level(0);
        *factory.limits_mut() = ParserLimits {
            // Compile-time work: a tenth of the engine's default (~2 ms of lexer building).
            initial_lexer_fuel: 100_000,
            max_grammar_size: 100_000,
            // The lexer's states (1-2 kB each) grow with what a choice generates, and every
            // choice of a request clones the lexer: a tenth of the engine's default 250,000.
            max_lexer_states: 25_000,
            ..ParserLimits::default()
        };
        Ok(Grammars {
            factory,
            eos: eos.to_vec(),
        })
    }

    /// Compiles `constraint`; a grammar that does not compile (or is over the limits) is a 400
    /// naming `param`.
    pub fn compile(&self, constraint: &Constraint, param: &str) -> Result<Compiled, ApiError> {
        let grammar = constraint.grammar(param)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ApiError::bad_param(param, not_compiled(param, &e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(ApiError::bad_param(param, not_compiled(param, &error)));
        }
        Ok(Compiled {
            matcher: Mutex::new(matcher),
            eos: self.eos.clone(),
        })
    }
}

/// The server's grammar engine, built on first use (most servers never need one).
pub fn grammars<'s>(
    cell: &'s OnceLock<Result<Grammars, String>>,
    tokenizer: &Arc<ch01::Tokenizer>,
    vocab_size: usize,
    eos: &[u32],
) -> Result<&'s Grammars, ApiError> {
    cell.get_or_init(|| Grammars::new(Arc::clone(tokenizer), vocab_size, eos))
        .as_ref()
        .map_err(|e| ApiError::bad_request(format!("structured outputs are unavailable: {e}")))
}

/// A compiled grammar, ready to start a matcher per choice.
pub struct Compiled {
    /// The start state; each choice gets a copy. (A mutex only to be `Sync`: it is read once
    /// per choice.)
    matcher: Mutex<Matcher>,
    eos: Vec<u32>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiled grammar")
    }
}

impl Compiled {
    /// A fresh matcher at the grammar's start, for one choice; why it ended the choice early,
    /// if it does, goes to `error`.
    pub fn start(&self, error: EndedEarly) -> GrammarState {
        let matcher = match self.matcher.lock() {
            Ok(m) => m.deep_clone(),
            Err(poisoned) => poisoned.into_inner().deep_clone(),
        };
        GrammarState {
            matcher,
            mask: None,
            eos: self.eos.clone(),
            error,
        }
    }
}

/// Why a choice's processor ended it before its output was complete (a grammar past the
/// engine's limits, token rules that leave no token): written once by the processor inside
/// the engine, read by the request's driver, which fails the choice instead of reporting a
/// normal `stop`.
#[derive(Debug, Clone, Default)]
pub struct EndedEarly(Arc<OnceLock<String>>);

impl EndedEarly {
    fn set(&self, why: impl Into<String>) {
        let _ = self.0.set(why.into()); // the first reason is the one to report
    }

    /// The reason, once the processor has ended its choice early.
    pub fn reason(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }
}

// ANCHOR: grammar_state
/// One choice's grammar: where its parse is, and the mask for its next token.
pub struct GrammarState {
    matcher: Matcher,
    /// Computed by [`GrammarState::prepare`]; `None`: the grammar cannot go on (only stop).
    mask: Option<SimpleVob>,
    eos: Vec<u32>,
    error: EndedEarly,
}

impl GrammarState {
    /// The mask of tokens that keep the output a prefix of the grammar's language (only the
    /// stop tokens once it is complete). The costly part: a walk of the token trie. An engine
    /// error (a limit passed) leaves only stop, and says so through [`EndedEarly`].
    pub fn prepare(&mut self) {
        self.mask = match self.matcher.compute_mask_or_eos() {
            Ok(mask) => Some(mask),
            Err(e) => {
                self.error.set(format!("the grammar engine stopped: {e}"));
                None
            }
        };
    }

    /// Whether the output so far is a whole word of the grammar's language.
    fn is_complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }

    /// Every token the mask forbids to `-inf`. With no mask (an error), only stop is allowed.
    pub fn apply(&self, logits: &mut [f32]) {
        match &self.mask {
            Some(mask) => {
                for (token, logit) in logits.iter_mut().enumerate() {
                    if !mask.is_allowed(token as TokenId) {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
            None => allow_only(logits, &self.eos),
        }
    }

    /// Moves the parse on by `token`; true when the output is complete (or cannot go on,
    /// which [`EndedEarly`] reports).
    pub fn accept(&mut self, token: u32) -> bool {
        if self.matcher.is_stopped() || self.eos.contains(&token) {
            return true;
        }
        if let Err(e) = self.matcher.consume_token(token) {
            self.error
                .set(format!("the grammar refused token {token}: {e}"));
            return true;
        }
        self.matcher.is_stopped()
    }
}
// ANCHOR_END: grammar_state

/// Every logit but those of `keep` to `-inf` (those keep their value, or 0 if it was `-inf`).
fn allow_only(logits: &mut [f32], keep: &[u32]) {
    for (token, logit) in logits.iter_mut().enumerate() {
        if keep.contains(&(token as u32)) {
            if !logit.is_finite() {
                *logit = 0.0;
            }
        } else {
            *logit = f32::NEG_INFINITY;
        }
    }
}

/// The cheap token rules of a request, besides its grammar (vLLM's names).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenRules {
    /// Added to the token's logit (`logit_bias`, -100..=100).
    pub logit_bias: Vec<(u32, f32)>,
    /// Only these tokens may be sampled (`allowed_token_ids`), sorted, each id once (the mask
    /// walks the list beside the vocabulary).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Token sequences that must never be completed (`bad_words`, tokenized).
    pub bad_words: Vec<Vec<u32>>,
    /// Stop tokens are masked until this many tokens are out (`min_tokens`).
    pub min_tokens: usize,
    /// The tokens `min_tokens` holds back: the model's stop tokens and `stop_token_ids`.
    pub stop_token_ids: Vec<u32>,
}

impl TokenRules {
    pub fn is_empty(&self) -> bool {
        self.logit_bias.is_empty()
            && self.allowed_token_ids.is_none()
            && self.bad_words.is_empty()
            && self.min_tokens == 0
    }
}

// ANCHOR: processor
/// One choice's [`LogitsProcessor`]: its token rules, then its grammar.
pub struct RequestProcessor {
    rules: Arc<TokenRules>,
    grammar: Option<GrammarState>,
    /// The stop tokens, allowed when the rules and the grammar together left nothing.
    fallback: Vec<u32>,
    /// Why the choice ended before its output was complete, for the request's driver.
    error: EndedEarly,
}

impl RequestProcessor {
    pub fn new(
        rules: Arc<TokenRules>,
        grammar: Option<GrammarState>,
        fallback: Vec<u32>,
        error: EndedEarly,
    ) -> Self {
        RequestProcessor {
            rules,
            grammar,
            fallback,
            error,
        }
    }
}

impl LogitsProcessor for RequestProcessor {
    fn prepare(&mut self) {
        if let Some(grammar) = &mut self.grammar {
            grammar.prepare();
        }
    }

    fn process(&mut self, output: &[u32], logits: &mut [f32]) {
        let rules = &self.rules;
        for &(token, bias) in &rules.logit_bias {
            if let Some(logit) = logits.get_mut(token as usize) {
                *logit += bias;
            }
        }
        if let Some(allowed) = &rules.allowed_token_ids {
            // One walk over the vocabulary beside the sorted list (a binary search per token
            // took 2.2 ms a step at 49,152 tokens, on the engine's thread).
            let mut next = allowed.iter().peekable();
            for (token, logit) in logits.iter_mut().enumerate() {
                if next.next_if(|&&id| id as usize == token).is_none() {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        for word in &rules.bad_words {
            if let Some((&last, prefix)) = word.split_last()
                && output.ends_with(prefix)
                && let Some(logit) = logits.get_mut(last as usize)
            {
                *logit = f32::NEG_INFINITY;
            }
        }
        if output.len() < rules.min_tokens {
            for &token in &rules.stop_token_ids {
                if let Some(logit) = logits.get_mut(token as usize) {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        if let Some(grammar) = &self.grammar {
            grammar.apply(logits);
        }
        // Rules that contradict each other must not leave nothing to sample: then the
        // sequence stops. Against a complete grammar (min_tokens not yet reached) that is a
        // normal stop; against one that is not (allowed_token_ids outside the grammar's
        // tokens), the output does not match the constraint, which the driver reports as the
        // error it is.
        if !logits.iter().any(|l| *l > f32::NEG_INFINITY) {
            if let Some(grammar) = self.grammar.as_mut()
                && !grammar.is_complete()
            {
                self.error.set(
                    "the request's token rules (allowed_token_ids, bad_words, logit_bias, \
                     min_tokens) and its constraint leave no token that continues the output",
                );
            }
            if self.fallback.is_empty() {
                // A model with no stop token: nothing can end the choice here, and an empty
                // row would fail the engine's whole step. The choice is failed instead, and
                // the token sampled from this open row is never shown.
                self.error.set(
                    "the request's token rules leave no token, and the model has no stop token \
                     to end the output with",
                );
                logits.fill(0.0);
                return;
            }
            allow_only(logits, &self.fallback);
        }
    }

    fn accept(&mut self, token: u32) -> bool {
        // Under a grammar, a stop token (the model's, or one of the request's
        // `stop_token_ids`) ends the output whatever the grammar would say of it: never fed to
        // the grammar as text. Without one, the engine's own stop checks decide (`ignore_eos`).
        match &mut self.grammar {
            Some(_) if self.fallback.contains(&token) => true,
            Some(grammar) => grammar.accept(token),
            None => false,
        }
    }
}
// ANCHOR_END: processor

/// The longest grammar-engine message a 400 quotes: some of its errors dump the parser's whole
/// state, tens of kilobytes.
const COMPILE_ERROR_CHARS: usize = 1000;

/// "`param` does not compile: `message`", the message cut to [`COMPILE_ERROR_CHARS`].
fn not_compiled(param: &str, message: &str) -> String {
    match message.char_indices().nth(COMPILE_ERROR_CHARS) {
        Some((cut, _)) => format!(
            "{param} does not compile: {} ... ({} more bytes)",
            &message[..cut],
            message.len() - cut
        ),
        None => format!("{param} does not compile: {message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grammar engine's message of tens of kilobytes (a parser state dump) is quoted to its
    /// first 1000 characters, cut on a character boundary; a short one whole.
    #[test]
    fn long_compile_errors_are_cut() {
        let long = "é".repeat(30_000);
        let cut = not_compiled("guided_regex", &long);
        assert!(cut.starts_with("guided_regex does not compile: éé"));
        assert!(
            cut.ends_with(&format!("... ({} more bytes)", 2 * (30_000 - 1000))),
            "{cut}"
        );
        assert_eq!(cut.matches('é').count(), COMPILE_ERROR_CHARS);
        assert_eq!(not_compiled("x", "bad"), "x does not compile: bad");
    }

    /// A SentencePiece-style tokenizer (Llama 2's layout: `▁` for spaces, one in front of the
    /// text, `<0xNN>` byte fallback) over a few pieces: `encode("\"")` gives `▁"`, whose bytes
    /// are not `"`.
    fn sentencepiece_tokenizer() -> ch01::Tokenizer {
        let mut vocab = serde_json::Map::new();
        for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert(t.to_string(), json!(i));
        }
        for b in 0..=255u32 {
            vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
        }
        for (i, piece) in ["▁", "\"", "▁\"", "{", "▁{", "}"].iter().enumerate() {
            vocab.insert(piece.to_string(), json!(259 + i));
        }
        let special = |id: u32, content: &str| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        };
        let file = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": [["▁", "\""], ["▁", "{"]]}
        });
        let inner = tokenizers::Tokenizer::from_bytes(file.to_string().as_bytes()).unwrap();
        ch01::Tokenizer::from_parts(inner, "spm.json".into(), Some(1), Some(2))
    }

    /// Runs `constraint` to its end (a token that completes it, or a stop token), always taking
    /// the lowest token id the mask allows; the text it spells.
    fn lowest_token_walk(tokenizer: ch01::Tokenizer, constraint: Constraint) -> String {
        let vocab = tokenizer.vocab_size();
        let tokenizer = Arc::new(tokenizer);
        let grammars = Grammars::new(Arc::clone(&tokenizer), vocab, &[2]).unwrap();
        let mut state =
            (grammars.compile(&constraint, "test").unwrap()).start(EndedEarly::default());
        let mut bytes = Vec::new();
        for _ in 0..64 {
            state.prepare();
            let mut logits = vec![0.0f32; vocab];
            state.apply(&mut logits);
            let token = logits.iter().position(|l| l.is_finite()).unwrap() as u32;
            bytes.extend(tokenizer.token_bytes(token).unwrap());
            if state.accept(token) {
                return String::from_utf8(bytes).unwrap();
            }
        }
        panic!(
            "no end after 64 tokens: {:?}",
            String::from_utf8_lossy(&bytes)
        );
    }

    #[test]
    fn forced_text_is_spelled_exactly_by_sentencepiece_and_inside_a_character() {
        // The schema forces `"` and then the byte 0xE6 that both choices start with: a
        // SentencePiece tokenizer would put `▁` before the quote, and the byte alone is no
        // character. Either way tokens that spell other bytes were forced, and the grammar
        // rejected them.
        let schema = Constraint::JsonSchema(json!({"enum": ["日本", "月曜"]}));
        assert_eq!(
            lowest_token_walk(sentencepiece_tokenizer(), schema),
            "\"日本\""
        );
        let object = Constraint::JsonSchema(json!({
            "type": "object", "properties": {"a": {"enum": ["é", "è"]}}, "required": ["a"],
            "additionalProperties": false}));
        let text = lowest_token_walk(sentencepiece_tokenizer(), object);
        assert_eq!(text, "{\"a\":\"è\"}");
    }

    #[test]
    fn oversized_or_malformed_constraints_are_refused_by_name() {
        let big = Constraint::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1));
        let err = big.grammar("guided_regex").unwrap_err();
        assert_eq!(err.param.as_deref(), Some("guided_regex"));
        let err = Constraint::Choice(Vec::new())
            .grammar("guided_choice")
            .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("guided_choice"));
        let err = Constraint::JsonSchema(json!(3))
            .grammar("response_format")
            .unwrap_err();
        assert!(err.message.contains("object"), "{}", err.message);
    }

    /// A model with no stop token and rules that leave nothing: the row stays samplable (an
    /// empty one would fail the engine's whole step) and the choice is marked to fail.
    #[test]
    fn rules_that_leave_nothing_without_a_stop_token_fail_only_their_choice() {
        let rules = Arc::new(TokenRules {
            allowed_token_ids: Some(vec![1]),
            bad_words: vec![vec![1]],
            ..TokenRules::default()
        });
        let error = EndedEarly::default();
        let mut p = RequestProcessor::new(rules, None, Vec::new(), error.clone());
        let mut logits = vec![0.5; 4];
        p.process(&[], &mut logits);
        assert!(logits.iter().all(|l| l.is_finite()), "{logits:?}");
        assert!(error.reason().is_some_and(|r| r.contains("no stop token")));
    }

    /// allowed_token_ids masks every other token, ids at both ends of the vocabulary included,
    /// and ids past the logits change nothing.
    #[test]
    fn allowed_token_ids_leave_exactly_their_tokens() {
        for allowed in [vec![0, 3, 4, 11], vec![11], vec![0], vec![2, 7, 40]] {
            let rules = Arc::new(TokenRules {
                allowed_token_ids: Some(allowed.clone()),
                ..TokenRules::default()
            });
            let mut p = RequestProcessor::new(rules, None, vec![0], EndedEarly::default());
            let mut logits = vec![0.5; 12];
            p.process(&[], &mut logits);
            for (token, logit) in logits.iter().enumerate() {
                assert_eq!(
                    logit.is_finite(),
                    allowed.contains(&(token as u32)),
                    "{allowed:?}"
                );
            }
        }
    }

    #[test]
    fn min_tokens_against_a_stop_only_mask_still_leaves_a_token() {
        let rules = Arc::new(TokenRules {
            min_tokens: 5,
            stop_token_ids: vec![1],
            allowed_token_ids: Some(vec![1]),
            ..TokenRules::default()
        });
        let mut p = RequestProcessor::new(rules, None, vec![1], EndedEarly::default());
        let mut logits = vec![0.5; 4];
        p.process(&[], &mut logits);
        assert!(logits[1].is_finite(), "the stop token is left");
        assert!(
            logits
                .iter()
                .enumerate()
                .all(|(i, l)| i == 1 || *l == f32::NEG_INFINITY)
        );
    }
}
