//! llama.cpp's SentencePiece-style merge loop, written out: the exact tokenizer for a
//! `tokenizer.ggml.model = llama` vocabulary, ties between merge scores included.
//!
//! ```text
//! 1. every character of a stretch of normalized text ("▁hello▁world") is a symbol
//! 2. every adjacent pair of symbols whose concatenation is a token is a candidate, worth
//!    that token's score
//! 3. take the best candidate: highest score, and among equal scores the one whose left
//!    symbol starts first; skip it if either symbol has changed since it was found
//! 4. merge its two symbols into one, and make candidates of the pairs the new symbol forms
//!    with its two neighbours; repeat from 3 until no candidate is left
//! 5. each symbol is its token (a merged symbol always is one); a single character outside
//!    the vocabulary is its `<0xNN>` byte tokens, or the unknown token without them
//! ```
//!
//! Why the BPE of the `tokenizers` crate cannot do this (see the parent module): its merges are
//! a list, and two different pairs always have different ranks, so it breaks a tie by which pair
//! the list names first, wherever the pairs are in the text; only two places of the *same*
//! pair are ordered by position. With `ab` and `ba` equally scored, llama.cpp turns `aba` into
//! `ab a` and `bab` into `ba b`: the first needs `a b` ranked before `b a`, the second the
//! opposite, so no list gives both.
//!
//! Cost: a text of n characters starts n − 1 candidates and each merge adds at most two, so
//! the queue holds fewer than 3n, each found by hashing one slice of the text: O(n log n).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::ops::Range;

use ch01::tokenizer::Encoder;
use tokenizers::{OffsetType, Token};

use super::tokenizer_error;
use crate::gguf::error::GgufResult;
use crate::gguf::file::GgufFile;

/// One symbol: a byte range of the text, linked to its neighbours. A symbol merged into its
/// left neighbour keeps its place in the list with `len` 0.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A pair of adjacent symbols whose concatenation (`len` bytes) is a token of score `score`.
#[derive(Debug)]
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

/// The queue's order: higher score first, then the leftmost (smaller `left`) first. −0 and +0
/// are one score, as for llama.cpp's comparison (`total_cmp` alone would rank −0 lower).
impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.score + 0.0)
            .total_cmp(&(other.score + 0.0))
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// The vocabulary as the merge loop reads it: every token's id by its text, and its score. Like
/// llama.cpp, any token can be a merge's result; control, unknown and user-defined tokens
/// never are in practice, because the tokenizer matches their text before the loop runs.
#[derive(Debug)]
pub struct SpmMerges {
    /// Each text's (first) id: the vocabulary's only copy here.
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// `<0xNN>` token of each byte, where the vocabulary has one.
    byte_ids: [Option<u32>; 256],
    unk: u32,
}

impl SpmMerges {
    /// The merge loop over `tokens` (token i's text) with `scores` (token i's score), and
    /// `unk` for characters that are neither tokens nor spelled by byte tokens. Where a text
    /// appears twice, its first id is the one looked up.
    ///
    /// # Panics
    /// When `scores` and `tokens` differ in length, or `unk` is not a token id.
    pub fn new(tokens: &[&str], scores: &[f32], unk: u32) -> Self {
        assert_eq!(tokens.len(), scores.len(), "one score per token");
        assert!(
            (unk as usize) < tokens.len(),
            "unknown token {unk} out of range"
        );
        let mut ids = HashMap::with_capacity(tokens.len());
        for (id, &token) in tokens.iter().enumerate() {
            ids.entry(token.to_string()).or_insert(id as u32);
        }
        let byte_ids = std::array::from_fn(|b| ids.get(&format!("<0x{b:02X}>")).copied());
        SpmMerges {
            ids,
            scores: scores.to_vec(),
            byte_ids,
            unk,
        }
    }

    /// The tokens of one stretch of normalized text (spaces already `▁`), each with the byte
    /// range of `text` it covers (a character's byte tokens each cover the whole character).
    pub fn tokenize(&self, text: &str) -> Vec<(u32, Range<usize>)> {
        let mut symbols: Vec<Symbol> = text
            .char_indices()
            .map(|(start, c)| Symbol {
                start,
                len: c.len_utf8(),
                prev: None,
                next: None,
            })
            .collect();
        let n = symbols.len();
        for (i, s) in symbols.iter_mut().enumerate() {
            s.prev = i.checked_sub(1);
            s.next = (i + 1 < n).then_some(i + 1);
        }

        // Steps 2 to 4: a candidate is pushed when its pair forms, and skipped when popped
        // if a merge has since changed either symbol (a symbol only grows, or empties when
        // merged into its left neighbour, so the lengths tell).
        let mut queue = BinaryHeap::new();
        let candidate = |symbols: &[Symbol], left: usize, right: usize| {
            let (l, r) = (symbols[left], symbols[right]);
            let len = l.len + r.len;
            let &id = self.ids.get(&text[l.start..l.start + len])?;
            Some(Candidate {
                score: self.scores[id as usize],
                left,
                right,
                len,
            })
        };
        for i in 1..n {
            queue.extend(candidate(&symbols, i - 1, i));
        }
        while let Some(c) = queue.pop() {
            let (l, r) = (symbols[c.left], symbols[c.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != c.len {
                continue;
            }
            symbols[c.left].len = c.len;
            symbols[c.left].next = r.next;
            symbols[c.right].len = 0;
            if let Some(next) = r.next {
                symbols[next].prev = Some(c.left);
            }
            if let Some(prev) = l.prev {
                queue.extend(candidate(&symbols, prev, c.left));
            }
            if let Some(next) = r.next {
                queue.extend(candidate(&symbols, c.left, next));
            }
        }

        // Step 5, along the list from the first symbol (never merged away: it has no left).
        let mut out = Vec::new();
        let mut at = (n > 0).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let range = s.start..s.start + s.len;
            let piece = &text[range.clone()];
            if let Some(&id) = self.ids.get(piece) {
                out.push((id, range));
            } else if let Some(bytes) = piece
                .bytes()
                .map(|b| self.byte_ids[b as usize])
                .collect::<Option<Vec<u32>>>()
            {
                out.extend(bytes.into_iter().map(|id| (id, range.clone())));
            } else if let Some((last, last_range)) = out.last_mut()
                && *last == self.unk
                && last_range.end == range.start
            {
                // Without byte tokens, a run of unknown characters is one unknown token.
                last_range.end = range.end;
            } else {
                out.push((self.unk, range));
            }
            at = s.next;
        }
        out
    }
}

impl SpmMerges {
    /// The merge loop of a `tokenizer.ggml.model = llama` file (tokens, scores, unknown
    /// token); `None` for other models.
    pub fn from_file(file: &GgufFile) -> GgufResult<Option<SpmMerges>> {
        if file.get_str("tokenizer.ggml.model")? != "llama" {
            return Ok(None);
        }
        let path = file.path();
        let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
        let scores = super::scores(file, tokens.len())?;
        let unk = file
            .opt_u32("tokenizer.ggml.unknown_token_id")?
            .unwrap_or(0);
        if unk as usize >= tokens.len() {
            return Err(tokenizer_error(
                path,
                format!("unknown token id {unk} is outside the vocabulary"),
            ));
        }
        Ok(Some(SpmMerges::new(&tokens, &scores, unk)))
    }
}

/// The merge loop as the encoder of a [`ch01::Tokenizer`] ([`super::load_tokenizer`] sets it
/// for a `llama` vocabulary): the tokenizer's `tokenizers` pipeline ([`super::hf_tokenizer`]'s,
/// without its merge list) finds the added tokens, adds the `▁`s and BOS/EOS, and decodes,
/// while the loop takes the place of its BPE.
impl Encoder for SpmMerges {
    fn encode(
        &self,
        pipeline: &tokenizers::Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> tokenizers::Result<Vec<u32>> {
        let mut pieces = pipeline
            .get_added_vocabulary()
            .extract_and_normalize(pipeline.get_normalizer(), text);
        if let Some(pre) = pipeline.get_pre_tokenizer() {
            tokenizers::PreTokenizer::pre_tokenize(pre, &mut pieces)?;
        }
        // A token's text is left empty: of the encoding, only its ids are returned.
        pieces.tokenize(|normalized| {
            Ok((self.tokenize(normalized.get()).into_iter())
                .map(|(id, r)| Token::new(id, String::new(), (r.start, r.end)))
                .collect())
        })?;
        let encoding = pieces.into_encoding(None, 0, OffsetType::Byte)?;
        let encoding = pipeline.post_process(encoding, None, add_special_tokens)?;
        Ok(encoding.get_ids().to_vec())
    }
}
