//! Counting a long prompt's tokens in pieces, so that one that cannot fit the context is refused
//! before the whole of it is tokenized.
//!
//! [`crate::params::fits_by_bytes`] refuses a text that is too long by its bytes alone, but its
//! bound must hold for every text, so it lets a text through that many tokens as long as the
//! vocabulary's longest token: 5.3 MB for SmolLM2 at 8,192 positions, whose full tokenization
//! took 6.6 s and 1.85 GB (a digit a token). [`fits_by_pieces`] tokenizes such a text in pieces
//! of [`PIECE_BYTES`] and stops as soon as their count shows it cannot fit: for that text, after
//! its first piece. A text that fits is tokenized whole afterwards, as before, so its tokens are the
//! tokenizer's own.
//!
//! A request with `truncate_prompt_tokens = k` keeps its prompt's last `k` tokens, and needed the
//! whole text tokenized for them: 8.3 MB took 11.3 s and 2.9 GB. [`last_tokens`] tokenizes a
//! suffix instead, doubled until it holds `k` tokens and a seam's worth more.

use crate::error::ApiError;

/// Texts longer than this are counted in pieces of about this many bytes.
pub const PIECE_BYTES: usize = 64 << 10;

/// The most tokens a seam between two pieces may add to the pieces' count over the whole text's:
/// a word or a run of spaces cut in two, an added token (`<|im_start|>`) cut into its letters, a
/// SentencePiece word marker at a piece's start. Each of these costs a few tokens; the pieces
/// are cut at whitespace where they can be, and 16 a seam leaves room.
pub const SEAM_TOKENS: usize = 16;

/// Where to cut `text` at or after byte `at`: where a run of whitespace begins after something
/// else, within 4 KiB (where pre-tokenizers split a text into words, so that each side's words
/// are the whole text's), else at the first character boundary (the text's length if `at` is
/// past it).
fn seam(text: &str, at: usize) -> usize {
    if at >= text.len() {
        return text.len();
    }
    let bytes = text.as_bytes();
    let word_ends = (at.max(1)..text.len().min(at + 4096))
        .find(|&i| bytes[i].is_ascii_whitespace() && !bytes[i - 1].is_ascii_whitespace());
    word_ends.unwrap_or_else(|| {
        (at..)
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(text.len())
    })
}

/// `text` cut into pieces of at least [`PIECE_BYTES`] (the last shorter), at [`seam`]s.
fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let (piece, tail) = rest.split_at(seam(rest, PIECE_BYTES));
        rest = tail;
        Some(piece)
    })
}

/// The tokens of `text` of which a request keeps the last `keep` (`truncate_prompt_tokens`):
/// those of a suffix of it, from a cut [`PIECE_BYTES`] before its end, then twice as far,
/// and so on, until the suffix makes `keep` tokens and [`SEAM_TOKENS`] more, or is the whole
/// text. Cut where a run of whitespace begins, a suffix's tokens are the whole text's past its
/// first word (a BOS the tokenizer adds goes before them), so the last `keep` are the whole
/// text's last `keep`. Where no run begins within 4 KiB of the cut (CJK prose, base64, a run of
/// one character), the suffix is cut inside a word, whose tokens may differ from the whole
/// text's; they fall among the [`SEAM_TOKENS`] extra unless the word runs on for more tokens
/// than that: 300,000 spaces, one word to a byte-level tokenizer, are cut into tokens of 81
/// spaces from a different start.
pub fn last_tokens(
    tokenizer: &ch01::Tokenizer,
    text: &str,
    keep: usize,
    add_special_tokens: bool,
) -> ch01::Result<Vec<u32>> {
    let mut span = PIECE_BYTES;
    loop {
        let from = match text.len().checked_sub(span) {
            Some(from) => seam(text, from),
            None => 0,
        };
        let tokens = tokenizer.encode(&text[from..], add_special_tokens)?;
        if from == 0 || tokens.len() >= keep.saturating_add(SEAM_TOKENS + 1) {
            return Ok(tokens);
        }
        span = span.saturating_mul(2);
    }
}

/// Refuses `text` (the request's `param`) when, counted in pieces, it already comes to more
/// tokens than the context leaves it beside the completion's `max_tokens` (at least one, as
/// [`crate::params::fits_by_bytes`] counts it), with [`SEAM_TOKENS`] allowed for each seam: a
/// text whose pieces make `m` tokens is refused only if `m - SEAM_TOKENS · seams` is more than
/// that, so one that fits is not refused while no seam adds more. Texts of at most
/// [`PIECE_BYTES`] are left to the tokenizer (they cost little).
pub fn fits_by_pieces(
    tokenizer: &ch01::Tokenizer,
    text: &str,
    max_tokens: Option<u32>,
    max_model_len: usize,
    param: &str,
) -> Result<(), ApiError> {
    if text.len() <= PIECE_BYTES {
        return Ok(());
    }
    let completion = max_tokens.map_or(1, |m| m.max(1) as usize);
    let room = max_model_len.saturating_sub(completion);
    let (mut count, mut counted_bytes) = (0usize, 0usize);
    for (seams, piece) in pieces(text).enumerate() {
        let tokens = (tokenizer.encode(piece, false))
            .map_err(|e| ApiError::bad_param(param, format!("cannot tokenize: {e}")))?;
        count += tokens.len();
        counted_bytes += piece.len();
        let at_least = count.saturating_sub(SEAM_TOKENS * seams);
        if at_least > room {
            return Err(ApiError::bad_param(
                param,
                format!(
                    "This model's maximum context length is {max_model_len} tokens. However, the \
                     first {counted_bytes} bytes of your {param} are already at least {at_least} \
                     tokens, and the completion needs {completion}. Please reduce the length of \
                     the {param}."
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> ch01::Tokenizer {
        ch01::Tokenizer::from_dir(&ch01::fixtures_dir().join("shakespeare-small")).unwrap()
    }

    #[test]
    fn pieces_cover_the_text_in_order_and_cut_where_whitespace_begins() {
        let text = "word  ".repeat(30_000) + &"x".repeat(200_000) + "é".repeat(50_000).as_str();
        let cut: Vec<&str> = pieces(&text).collect();
        assert_eq!(cut.concat(), text);
        assert!(cut.len() > 3);
        for piece in &cut[..cut.len() - 1] {
            assert!(piece.len() >= PIECE_BYTES, "{}", piece.len());
        }
        // The word pieces end where a run of spaces begins; the others at a character boundary.
        assert!(
            cut[0].ends_with("word") && cut[1].starts_with("  word"),
            "{:?}",
            &cut[1][..8]
        );
        assert!(cut.iter().all(|p| !p.is_empty()));
    }

    /// Seeded random text of at least `len` bytes: words, runs of spaces, newlines, digits,
    /// accents and special tokens, from a linear congruential generator.
    fn random_text(seed: u64, len: usize) -> String {
        let parts = [
            "To be, or not",
            "    ",
            "\n\n",
            "1234567",
            "é",
            "ROMEO.",
            "<s>",
            "</s>",
        ];
        let mut state = seed;
        let mut below = |n: usize| {
            state = (state.wrapping_mul(6364136223846793005)).wrapping_add(1442695040888963407);
            (state >> 33) as usize % n
        };
        let mut text = String::new();
        while text.len() < len {
            text.push_str(parts[below(parts.len())]);
            if below(2) == 0 {
                text.push(' ');
            }
        }
        text
    }

    /// On random texts, the pieces' count, less the seams' allowance, never passes the whole
    /// text's count.
    #[test]
    fn the_pieces_bound_never_passes_the_whole_count() {
        let tokenizer = tokenizer();
        for seed in 0..6 {
            let text = random_text(seed, 3 * PIECE_BYTES + 1000 * seed as usize);
            let whole = tokenizer.encode(&text, false).unwrap().len();
            let seams = pieces(&text).count() - 1;
            let counted: usize = pieces(&text)
                .map(|p| tokenizer.encode(p, false).unwrap().len())
                .sum();
            assert!(
                counted.saturating_sub(SEAM_TOKENS * seams) <= whole,
                "{counted} {whole}"
            );
            assert!(fits_by_pieces(&tokenizer, &text, Some(1), whole + 1, "prompt").is_ok());
        }
    }

    /// On random texts, the last `keep` tokens of the suffix `last_tokens` tokenizes are the
    /// whole text's, with and without special tokens, for `keep` from 1 to past the text's.
    #[test]
    fn the_last_tokens_of_a_suffix_are_the_whole_texts() {
        let tokenizer = tokenizer();
        for seed in 10..14 {
            let text = random_text(seed, 2 * PIECE_BYTES + 3000 * seed as usize);
            for special in [false, true] {
                let whole = tokenizer.encode(&text, special).unwrap();
                for keep in [1, 17, 5000, 40_000, whole.len() + 5] {
                    let tail = last_tokens(&tokenizer, &text, keep, special).unwrap();
                    let want = &whole[whole.len().saturating_sub(keep)..];
                    assert_eq!(
                        &tail[tail.len().saturating_sub(keep)..],
                        want,
                        "keep {keep}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_text_far_too_long_is_refused_after_its_first_pieces() {
        let tokenizer = tokenizer();
        let digits = "7".repeat(5_000_000);
        let err = fits_by_pieces(&tokenizer, &digits, Some(16), 8192, "prompt").unwrap_err();
        let message = format!("{err:?}");
        assert!(
            message.contains("maximum context length is 8192 tokens"),
            "{message}"
        );
        // Refused on the strength of its first pieces, not all 77 of them.
        let first = message.split("the first ").nth(1).unwrap();
        let bytes: usize = first.split(' ').next().unwrap().parse().unwrap();
        assert!(bytes <= 4 * PIECE_BYTES, "{message}");
        assert!(fits_by_pieces(&tokenizer, &digits[..1000], None, 10, "prompt").is_ok());
    }
}
