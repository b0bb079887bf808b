//! `tokenizer.ggml.*` metadata → a [`ch01::Tokenizer`], built natively with the `tokenizers`
//! crate (no `tokenizer.json` involved).
//!
//! ```text
//! key                            meaning
//! tokenizer.ggml.model           gpt2 (byte-level BPE) or llama (SentencePiece-style BPE)
//! tokenizer.ggml.tokens          [string; vocab]: token i's text
//! tokenizer.ggml.token_type      [i32; vocab]: 1 normal, 2 unknown, 3 control, 4 user-defined,
//!                                5 unused, 6 byte (`<0xNN>`, the SentencePiece byte fallback)
//! tokenizer.ggml.merges          [string; n]: "left right", best first (gpt2 only)
//! tokenizer.ggml.scores          [f32; vocab]: merge priority of each token (llama only)
//! tokenizer.ggml.pre             the pre-tokenizer (gpt2 only): how text is split before BPE
//! tokenizer.ggml.bos/eos_token_id, add_bos_token, add_eos_token, add_space_prefix
//! tokenizer.chat_template        the Jinja chat template
//! ```
//!
//! Control and user-defined tokens become special added tokens, matched in the text before BPE
//! runs and left out of decoded text. Byte-level BPE is exactly what `tokenizer.json` files of
//! the same model describe. The SentencePiece-style vocabulary has no merge list, only a score
//! per token: llama.cpp repeatedly merges the adjacent pair whose concatenation is the
//! highest-scoring token, and between pairs of equal score the leftmost (its queue orders
//! candidates by score, then by the position of the left symbol). The same result comes from
//! BPE with one merge per way of splitting a token into two tokens, ranked by the merged
//! token's score; unknown characters fall back to their `<0xNN>` byte tokens. Only while no two
//! candidates tie: the BPE of `tokenizers` ranks two different pairs apart whatever their
//! place, so here equal scores rank by token id and can merge in another order than
//! llama.cpp's. No ranking can do better (with `ab` and `ba` equally scored, `aba` needs `a b`
//! first and `bab` needs `b a` first), so [`spm`] runs llama.cpp's loop itself, and
//! [`load_tokenizer`] makes it the tokenizer's [`Encoder`](ch01::tokenizer::Encoder): a
//! `llama` vocabulary encodes exactly as llama.cpp does, ties included, while the pipeline
//! built here still matches added tokens, adds BOS/EOS and decodes. That pipeline's BPE gets
//! the vocabulary alone, no merges: it never encodes, and decoding reads the vocabulary only,
//! so the ranked list (61,249 merges for LLaMA's 32,000 tokens, derived by hashing every split
//! of every token) would be built and kept for nothing. [`hf_tokenizer`] still derives it, for a
//! `tokenizers` tokenizer that encodes by itself. Ties are the rule in vocabularies converted
//! without `tokenizer.model`, which carry one score for every token (−1000).
//!
//! Byte-level BPE splits the text before merging; `tokenizer.ggml.pre` names how. `default`
//! (and a file without the key) is llama.cpp's fallback, not GPT-2's split: runs of
//! punctuation first, then GPT-2's pattern, then runs of digits apart from what precedes them,
//! then digits in threes ([`DEFAULT_PUNCTUATION_SPLIT`]).

use std::path::Path;
use std::sync::Arc;

use ch01::Tokenizer;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::error::{GgufError, GgufResult};
use super::file::GgufFile;

pub mod spm;

/// `tokenizer.ggml.token_type` values.
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Llama 3's split: case-insensitive contractions, digits in runs of at most three.
pub(crate) const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: Llama 3's with digits one by one.
pub(crate) const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-2's split: contractions, letters, digits, other symbols, whitespace, each optionally
/// after one space (what `ByteLevel` splits with when `use_regex`).
pub const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// `tokenizer.ggml.pre = default` (or no `pre` at all) is llama.cpp's fallback, four splits
/// applied in turn, each to every piece the one before made:
/// 1. runs of punctuation (Unicode's, and `$+<=>^~|`: every ASCII symbol but the backtick)
///    become pieces of their own ([`DEFAULT_PUNCTUATION_SPLIT`]), so GPT-2's contractions
///    (`'s`) never match and no space leads a punctuation piece;
/// 2. GPT-2's split ([`GPT2_SPLIT`]);
/// 3. runs of digits (`\p{N}+`) leave the space before them (`Digits`, whose `is_numeric` is
///    `\p{N}`, with no regex to compile);
/// 4. ASCII digits in threes from the left ([`DEFAULT_DIGITS_SPLIT`]).
pub const DEFAULT_PUNCTUATION_SPLIT: &str = r"[\p{P}\$\+<=>\^~\|]+";
/// The last of `default`'s splits (see [`DEFAULT_PUNCTUATION_SPLIT`]).
pub const DEFAULT_DIGITS_SPLIT: &str = r"[0-9][0-9][0-9]";

/// The values of `tokenizer.ggml.pre` kiln knows, for byte-level BPE.
pub const PRE_TOKENIZERS: [&str; 7] = [
    "default",
    "gpt2",
    "gpt-2",
    "smollm",
    "llama-bpe",
    "llama3",
    "qwen2",
];

/// The model's tokenizer, with BOS and EOS from the metadata; a `llama` vocabulary encodes
/// with llama.cpp's merge loop ([`spm::SpmMerges`]), and its `tokenizers` pipeline holds no
/// merges (only [`hf_tokenizer`]'s derives them).
pub fn load_tokenizer(file: &GgufFile) -> GgufResult<Tokenizer> {
    let inner = pipeline(file, SpmMergeList::None)?;
    let tokenizer = Tokenizer::from_parts(
        inner,
        file.path().to_path_buf(),
        special_id(file, "tokenizer.ggml.bos_token_id")?,
        special_id(file, "tokenizer.ggml.eos_token_id")?,
    );
    Ok(match spm::SpmMerges::from_file(file)? {
        Some(merges) => tokenizer.with_encoder(Arc::new(merges)),
        None => tokenizer,
    })
}

/// Tokens that end generation by their text alone, whatever the metadata names: files made
/// before the end-of-turn keys existed name only EOS (Llama 3 Instruct's is
/// `<|end_of_text|>`, while its turns end with `<|eot_id|>`). llama.cpp stops on the same list,
/// and treats each as a control token.
pub const END_OF_GENERATION_TEXTS: [&str; 12] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// The stop tokens: EOS, the end-of-turn and end-of-message tokens the file names, and every
/// token of [`END_OF_GENERATION_TEXTS`] (EOS first).
pub fn eos_token_ids(file: &GgufFile) -> GgufResult<Vec<u32>> {
    let mut ids = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = special_id(file, key)?
            && !ids.contains(&id)
        {
            ids.push(id);
        }
    }
    for (id, token) in file
        .get_str_array("tokenizer.ggml.tokens")?
        .iter()
        .enumerate()
    {
        let id = id as u32;
        if END_OF_GENERATION_TEXTS.contains(token) && !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// `tokenizer.chat_template`, when present.
pub fn chat_template(file: &GgufFile) -> GgufResult<Option<String>> {
    Ok(file.opt_str("tokenizer.chat_template")?.map(str::to_string))
}

/// A special token id from `key`, checked against the vocabulary.
fn special_id(file: &GgufFile, key: &str) -> GgufResult<Option<u32>> {
    let Some(id) = file.opt_u32(key)? else {
        return Ok(None);
    };
    let n = file.get_array("tokenizer.ggml.tokens")?.len();
    if id as usize >= n {
        return Err(tokenizer_error(
            file.path(),
            format!("{key} {id} is outside the vocabulary of {n} tokens"),
        ));
    }
    Ok(Some(id))
}

fn tokenizer_error(path: &Path, message: impl Into<String>) -> GgufError {
    GgufError::Tokenizer {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// `tokenizer.ggml.scores`, checked to hold one score for each of `tokens` tokens.
fn scores(file: &GgufFile, tokens: usize) -> GgufResult<Vec<f32>> {
    let scores = file.get_f32_array("tokenizer.ggml.scores")?;
    if scores.len() != tokens {
        return Err(tokenizer_error(
            file.path(),
            format!(
                "tokenizer.ggml.scores has {} entries for {tokens} tokens",
                scores.len()
            ),
        ));
    }
    Ok(scores)
}

/// The `tokenizers` tokenizer the metadata describes. For a `llama` vocabulary its own
/// `encode` breaks ties between merge scores by token id, not as llama.cpp does;
/// [`load_tokenizer`] encodes with [`spm::SpmMerges`] instead (and builds no merge list).
pub fn hf_tokenizer(file: &GgufFile) -> GgufResult<tokenizers::Tokenizer> {
    pipeline(file, SpmMergeList::Ranked)
}

/// The merges a `llama` vocabulary's BPE gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SpmMergeList {
    /// One per way of splitting a normal token in two, ranked by its score: the pipeline's own
    /// `encode` works (ties apart).
    Ranked,
    /// None: the pipeline decodes, and [`spm::SpmMerges`] encodes.
    None,
}

/// [`hf_tokenizer`], with `merges` for a `llama` vocabulary.
fn pipeline(file: &GgufFile, merges: SpmMergeList) -> GgufResult<tokenizers::Tokenizer> {
    let path = file.path();
    let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
    let types = match file.opt_i32_array("tokenizer.ggml.token_type")? {
        Some(types) if types.len() != tokens.len() => {
            return Err(tokenizer_error(
                path,
                format!(
                    "tokenizer.ggml.token_type has {} entries for {} tokens",
                    types.len(),
                    tokens.len()
                ),
            ));
        }
        Some(types) => types,
        None => vec![token_type::NORMAL; tokens.len()],
    };
    let mut vocab = Vocab::default();
    for (id, &token) in tokens.iter().enumerate() {
        if let Some(first) = vocab.insert(token.to_string(), id as u32) {
            return Err(tokenizer_error(
                path,
                format!("token {token:?} appears twice (ids {first} and {id})"),
            ));
        }
    }

    let model = file.get_str("tokenizer.ggml.model")?;
    let (mut tokenizer, default_add_bos) = match model {
        // Llama 3's vocabulary begins every text with `<|begin_of_text|>`, as llama.cpp does.
        "gpt2" => {
            let llama3 = matches!(
                file.opt_str("tokenizer.ggml.pre")?,
                Some("llama-bpe" | "llama3")
            );
            (byte_level_bpe(file, vocab)?, llama3)
        }
        "llama" => (
            sentencepiece_bpe(file, vocab, &tokens, &types, merges)?,
            true,
        ),
        other => {
            return Err(tokenizer_error(
                path,
                format!("tokenizer.ggml.model `{other}` is not supported (expected gpt2 or llama)"),
            ));
        }
    };

    // Control, unknown and user-defined tokens are matched whole, before the model sees the
    // text, as llama.cpp does. Control and unknown tokens (and the end-of-generation texts,
    // control tokens whatever the file says) are special: decoded text leaves them out. A
    // user-defined token is text the model writes (Qwen's `<tool_call>`, `<think>`), so
    // decoded text keeps it.
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter_map(|(&t, &ty)| {
            let control = ty == token_type::CONTROL
                || ty == token_type::UNKNOWN
                || END_OF_GENERATION_TEXTS.contains(&t);
            (control || ty == token_type::USER_DEFINED)
                .then(|| AddedToken::from(t, control).normalized(false))
        })
        .collect();
    ch01::tokenizer::check_added_tokens(added.iter().map(|t| t.content.as_str()))
        .map_err(|e| tokenizer_error(path, e))?;
    tokenizer.add_tokens(&added);

    // BOS / EOS added around every encoded text when the file says so.
    let add_bos = file
        .opt_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(default_add_bos);
    let add_eos = file
        .opt_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);
    let mut single = Vec::new();
    let mut special_tokens = Vec::new();
    for (add, key) in [
        (add_bos, "tokenizer.ggml.bos_token_id"),
        (add_eos, "tokenizer.ggml.eos_token_id"),
    ] {
        if !add {
            continue;
        }
        let id = special_id(file, key)?.ok_or_else(|| {
            tokenizer_error(path, format!("{key} is needed: the file asks to add it"))
        })?;
        let token = tokens[id as usize].to_string();
        special_tokens.push((token.clone(), id));
        single.push(token);
    }
    if !single.is_empty() {
        let template = if add_bos {
            let mut t = vec![single[0].clone(), "$A".to_string()];
            t.extend(single.iter().skip(1).cloned());
            t
        } else {
            vec!["$A".to_string(), single[0].clone()]
        };
        let processor = TemplateProcessing::builder()
            .try_single(template.join(" "))
            .map_err(|e| tokenizer_error(path, e))?
            .special_tokens(special_tokens)
            .build()
            .map_err(|e| tokenizer_error(path, e.to_string()))?;
        tokenizer.with_post_processor(Some(processor));
    }
    Ok(tokenizer)
}

/// Byte-level BPE (`tokenizer.ggml.model = gpt2`): text is split by the pre-tokenizer, each
/// piece's bytes mapped to printable characters, then merged by the merge list.
fn byte_level_bpe(file: &GgufFile, vocab: Vocab) -> GgufResult<tokenizers::Tokenizer> {
    let path = file.path();
    let merges: Merges = file
        .get_str_array("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| tokenizer_error(path, format!("merge {m:?} is not two tokens")))
        })
        .collect::<GgufResult<_>>()?;
    let pre_name = file.opt_str("tokenizer.ggml.pre")?;

    // With `use_regex`, ByteLevel first splits with GPT-2's pattern: contractions, letters,
    // digits, other symbols, whitespace, each optionally after one space.
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
    let split = |pattern: &str| -> GgufResult<PreTokenizerWrapper> {
        Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map(Into::into)
        .map_err(|e| tokenizer_error(path, e.to_string()))
    };
    let pre: PreTokenizerWrapper = match pre_name {
        Some("gpt2" | "gpt-2") => byte_level(true).into(),
        None | Some("default") => PreSequence::new(vec![
            split(DEFAULT_PUNCTUATION_SPLIT)?,
            split(GPT2_SPLIT)?,
            Digits::new(false).into(),
            split(DEFAULT_DIGITS_SPLIT)?,
            byte_level(false).into(),
        ])
        .into(),
        // Digits one by one, then GPT-2's split.
        Some("smollm") => {
            PreSequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into()
        }
        Some("llama-bpe" | "llama3") => {
            PreSequence::new(vec![split(LLAMA3_SPLIT)?, byte_level(false).into()]).into()
        }
        Some("qwen2") => {
            PreSequence::new(vec![split(QWEN2_SPLIT)?, byte_level(false).into()]).into()
        }
        Some(other) => {
            return Err(tokenizer_error(
                path,
                format!(
                    "tokenizer.ggml.pre `{other}` is not supported (expected one of {})",
                    PRE_TOKENIZERS.join(", ")
                ),
            ));
        }
    };
    // The BPE after the pre-tokenizer: compiling the patterns briefly takes a few hundred
    // kilobytes, freed before the BPE's word cache is reserved, so the two never add up.
    // Llama 3's vocabulary takes a piece that is a token as it is, before any merge (some of
    // its tokens cannot be reached by merging), as its tokenizer.json and llama.cpp do.
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(matches!(pre_name, Some("llama-bpe" | "llama3")))
        .build()
        .map_err(|e| tokenizer_error(path, e.to_string()))?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    Ok(tokenizer)
}

/// SentencePiece-style BPE (`tokenizer.ggml.model = llama`): spaces become `▁` (one prepended
/// when `add_space_prefix`), merges come from the scores (see the module docs) when `merges`
/// asks for them, and characters outside the vocabulary become `<0xNN>` byte tokens.
fn sentencepiece_bpe(
    file: &GgufFile,
    vocab: Vocab,
    tokens: &[&str],
    types: &[i32],
    merges: SpmMergeList,
) -> GgufResult<tokenizers::Tokenizer> {
    let path = file.path();
    let merges = match merges {
        SpmMergeList::Ranked => ranked_merges(file, &vocab, tokens, types)?,
        // `spm::SpmMerges::from_file` reads (and checks) the scores.
        SpmMergeList::None => Merges::new(),
    };

    let unk_id = file
        .opt_u32("tokenizer.ggml.unknown_token_id")?
        .unwrap_or(0) as usize;
    let unk = tokens.get(unk_id).ok_or_else(|| {
        tokenizer_error(
            path,
            format!("unknown token id {unk_id} is outside the vocabulary"),
        )
    })?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token(unk.to_string())
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| tokenizer_error(path, e.to_string()))?;

    // Spaces become `▁`, and each stretch of text between special tokens gets one `▁` in
    // front when `add_space_prefix` (as llama.cpp does); the whole stretch is one BPE word.
    let add_space_prefix = file
        .opt_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let fail = |e: tokenizers::Error| tokenizer_error(path, e.to_string());
    let mut normalizers = Vec::new();
    if add_space_prefix {
        normalizers.push(Prepend::new("▁".to_string()).into());
    }
    normalizers.push(Replace::new(" ", "▁").map_err(fail)?.into());
    let mut decoders = vec![
        Replace::new("▁", " ").map_err(fail)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// Bytes hashed at most while deriving SentencePiece merges (the sum over normal tokens of their
/// length squared): a 256k-token vocabulary of real text needs well under 1% of it.
const MAX_SPLIT_BYTES: usize = 1 << 30;

/// The ranked merges of a `llama` vocabulary (see the module docs): one per way of splitting a
/// normal token into two mergeable tokens, best score first. Refused when the splitting would
/// hash more than [`MAX_SPLIT_BYTES`].
fn ranked_merges(
    file: &GgufFile,
    vocab: &Vocab,
    tokens: &[&str],
    types: &[i32],
) -> GgufResult<Merges> {
    let path = file.path();
    let scores = scores(file, tokens.len())?;
    // A token can be a piece of a merge, or its result, when it is ordinary text.
    let mergeable = |id: u32| {
        matches!(
            types[id as usize],
            token_type::NORMAL | token_type::USER_DEFINED | token_type::UNUSED
        )
    };
    // (score of the merged token, left id, right id, left, right), best first.
    let mut ranked: Vec<(f32, u32, u32, &str, &str)> = Vec::new();
    // Each split of a token hashes its two halves: a token of n bytes costs about n² bytes
    // hashed, which a hostile file's long tokens would turn into hours.
    let mut hashed = 0usize;
    for (id, &token) in tokens.iter().enumerate() {
        if types[id] != token_type::NORMAL {
            continue;
        }
        hashed = hashed.saturating_add(token.len().saturating_mul(token.len()));
        if hashed > MAX_SPLIT_BYTES {
            return Err(tokenizer_error(
                path,
                format!(
                    "tokenizer.ggml.tokens: deriving merges from these tokens (up to token {id}, \
                     {} bytes long) would hash more than {MAX_SPLIT_BYTES} bytes",
                    token.len()
                ),
            ));
        }
        for (k, _) in token.char_indices().skip(1) {
            let (left, right) = token.split_at(k);
            if let (Some(&l), Some(&r)) = (vocab.get(left), vocab.get(right))
                && mergeable(l)
                && mergeable(r)
            {
                ranked.push((scores[id], l, r, left, right));
            }
        }
    }
    // Higher score first; the sort is stable, and ties keep token order then split order.
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
    Ok(ranked
        .into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect())
}
