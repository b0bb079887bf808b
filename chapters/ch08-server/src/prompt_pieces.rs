//! Counting a long prompt's tokens in pieces, so that one that cannot fit the context is refused
//! before the whole of it is tokenized.
//!
//! [`crate::params::fits_by_bytes`] refuses a text that is too long by its bytes alone, but its
//! bound must hold for every text, so it lets a text through that many tokens as long as the
//! vocabulary's longest token: 5.3 MB for SmolLM2 at 8,192 positions, whose full tokenization
//! took 6.6 s and 1.85 GB (a digit a token). [`fits_by_pieces`] tokenizes such a text in pieces
//! of [`PIECE_BYTES`] and stops as soon as their count shows it cannot fit: for that text, after
//! two pieces. A text that fits is tokenized whole afterwards, as before, so its tokens are the
//! tokenizer's own.

use crate::error::ApiError;

/// Texts longer than this are counted in pieces of about this many bytes.
pub const PIECE_BYTES: usize = 64 << 10;

/// The most tokens a seam between two pieces may add to the pieces' count over the whole text's:
/// a word or a run of spaces cut in two, an added token (`<|im_start|>`) cut into its letters, a
/// SentencePiece word marker at a piece's start. Each of these costs a few tokens; the pieces
/// are cut at whitespace where they can be, and 16 a seam leaves room.
pub const SEAM_TOKENS: usize = 16;

/// The tokens a prompt may hold: the context, less `max_tokens` (at least one), as
/// [`crate::params::fits_by_bytes`] counts it.
pub fn room(max_tokens: Option<u32>, max_model_len: usize) -> usize {
    max_model_len.saturating_sub(max_tokens.map_or(1, |m| m.max(1) as usize))
}

/// `text` cut into pieces of at least [`PIECE_BYTES`] (the last shorter), each ending before the
/// first whitespace after that length, or at a character boundary when none comes within 4 KiB.
fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len();
        if rest.len() > PIECE_BYTES {
            let window = &rest.as_bytes()[PIECE_BYTES..rest.len().min(PIECE_BYTES + 4096)];
            end = match window.iter().position(u8::is_ascii_whitespace) {
                Some(at) => PIECE_BYTES + at,
                None => (PIECE_BYTES..)
                    .find(|&i| rest.is_char_boundary(i))
                    .unwrap_or(rest.len()),
            };
        }
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

/// Refuses `text` (the request's `param`) when, counted in pieces, it already comes to more than
/// `room` tokens with [`SEAM_TOKENS`] allowed for each seam: a text of `n` tokens whose pieces
/// make `m` is refused only if `m - SEAM_TOKENS · seams > room`, so one that fits is never
/// refused while no seam adds more than that. Texts of at most [`PIECE_BYTES`] are left to the
/// tokenizer (they cost little).
pub fn fits_by_pieces(
    tokenizer: &ch01::Tokenizer,
    text: &str,
    room: usize,
    param: &str,
) -> Result<(), ApiError> {
    if text.len() <= PIECE_BYTES {
        return Ok(());
    }
    let mut count = 0usize;
    for (seams, piece) in pieces(text).enumerate() {
        let tokens = (tokenizer.encode(piece, false))
            .map_err(|e| ApiError::bad_param(param, format!("cannot tokenize: {e}")))?;
        count += tokens.len();
        let at_least = count.saturating_sub(SEAM_TOKENS * seams);
        if at_least > room {
            return Err(ApiError::bad_param(
                param,
                format!(
                    "This model's context leaves {room} tokens for the {param}. However, the \
                     first {} bytes of it are already at least {at_least} tokens. Please reduce \
                     the length of the {param}.",
                    text.len()
                        .min(pieces(text).take(seams + 1).map(str::len).sum())
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
    fn pieces_cover_the_text_in_order_and_cut_at_whitespace() {
        let text = "word ".repeat(40_000) + &"x".repeat(200_000) + "é".repeat(50_000).as_str();
        let cut: Vec<&str> = pieces(&text).collect();
        assert_eq!(cut.concat(), text);
        assert!(cut.len() > 3);
        for piece in &cut[..cut.len() - 1] {
            assert!(piece.len() >= PIECE_BYTES, "{}", piece.len());
        }
        // The word pieces end before a space; the others at a character boundary.
        assert!(cut[1].starts_with(' ') || cut[1].starts_with('x'));
    }

    /// On seeded random texts of words, runs of spaces, digits and accents, the pieces' count,
    /// less the seams' allowance, never passes the whole text's count.
    #[test]
    fn the_pieces_bound_never_passes_the_whole_count() {
        let tokenizer = tokenizer();
        let mut state = 7u64; // a seeded linear congruential generator
        let mut below = |n: usize| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as usize % n
        };
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
        for _ in 0..6 {
            let mut text = String::new();
            let len = 3 * PIECE_BYTES + below(PIECE_BYTES);
            while text.len() < len {
                text.push_str(parts[below(parts.len())]);
                if below(2) == 0 {
                    text.push(' ');
                }
            }
            let whole = tokenizer.encode(&text, false).unwrap().len();
            let seams = pieces(&text).count() - 1;
            let counted: usize = pieces(&text)
                .map(|p| tokenizer.encode(p, false).unwrap().len())
                .sum();
            assert!(
                counted.saturating_sub(SEAM_TOKENS * seams) <= whole,
                "{counted} {whole}"
            );
            assert!(fits_by_pieces(&tokenizer, &text, whole, "prompt").is_ok());
        }
    }

    #[test]
    fn a_text_far_too_long_is_refused_after_its_first_pieces() {
        let tokenizer = tokenizer();
        let digits = "7".repeat(5_000_000);
        let err = fits_by_pieces(&tokenizer, &digits, 8192, "prompt").unwrap_err();
        let message = format!("{err:?}");
        assert!(message.contains("leaves 8192 tokens"), "{message}");
        // Refused on the strength of its first pieces, not all 77 of them.
        let first = message.split("the first ").nth(1).unwrap();
        let bytes: usize = first.split(' ').next().unwrap().parse().unwrap();
        assert!(bytes <= 4 * PIECE_BYTES, "{message}");
        assert!(fits_by_pieces(&tokenizer, &digits[..1000], 10, "prompt").is_ok());
    }
}
