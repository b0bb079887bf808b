//! A token's bytes: what it adds to the text.
//!
//! Decoding one token alone gives text, which loses bytes twice over: a token that holds only
//! part of a UTF-8 character (the first byte of `é`, say) decodes to U+FFFD, and a SentencePiece
//! decoder strips the space in front of the first token (`▁Paris` alone decodes to `Paris`).
//! The OpenAI API's logprobs carry each token's `bytes` so that a client can join them back into
//! the text, and a grammar engine needs every token's bytes to walk its automaton. Both kinds of
//! vocabulary that Llama models use spell every byte in their token strings, and [`ByteForm`]
//! reads them back:
//!
//! - **byte-level BPE** (GPT-2, Llama 3, SmolLM2): every byte `b` is one printable character,
//!   `b` itself for the printable ASCII and Latin-1 ranges, `U+0100 + n` for the n-th of the
//!   other 68 bytes in order, so a token string maps back to its bytes character by character;
//! - **SentencePiece** (Llama 2, Mistral): a space is `▁`, and a byte with no token of its own is
//!   the token `<0xNN>`.

use serde_json::Value;

/// How a vocabulary spells bytes in its token strings, read from the tokenizer's decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteForm {
    /// Every character of a token stands for one byte (a `ByteLevel` decoder, alone or in a
    /// sequence).
    ByteLevel,
    /// `▁` stands for a space and `<0xNN>` for the byte `NN` (any other decoder).
    SentencePiece,
}

impl ByteForm {
    /// Reads the form from the decoder, or from any decoder of a sequence of them.
    pub fn of(tokenizer: &tokenizers::Tokenizer) -> Self {
        let decoder = tokenizer
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok());
        let mut form = ByteForm::SentencePiece;
        if let Some(decoder) = decoder {
            visit_types(&decoder, &mut |kind| {
                if kind == "ByteLevel" {
                    form = ByteForm::ByteLevel;
                }
            });
        }
        form
    }

    /// The bytes a vocabulary token adds to the text. A byte-level piece with a character
    /// outside the byte alphabet (an added token, written as plain text) is its own UTF-8.
    pub fn bytes(self, piece: &str) -> Vec<u8> {
        match self {
            ByteForm::ByteLevel => piece
                .chars()
                .map(byte_of_char)
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_else(|| piece.as_bytes().to_vec()),
            ByteForm::SentencePiece => match fallback_byte(piece) {
                Some(byte) => vec![byte],
                None => piece.replace('\u{2581}', " ").into_bytes(),
            },
        }
    }
}

/// Calls `f` with every `"type"` in a serialized decoder, nested sequences included.
fn visit_types(value: &Value, f: &mut impl FnMut(&str)) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(kind)) = map.get("type") {
                f(kind);
            }
            map.values().for_each(|v| visit_types(v, f));
        }
        Value::Array(items) => items.iter().for_each(|v| visit_types(v, f)),
        _ => {}
    }
}

/// Whether byte-level BPE spells byte `b` as the character `b` itself: the printable ASCII
/// `!`..=`~` and the printable Latin-1 ranges `¡`..=`¬` and `®`..=`ÿ`.
fn is_printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// Byte-level BPE's character for a byte; the inverse of `byte_of_char`.
pub fn char_of_byte(b: u8) -> char {
    if is_printable(b) {
        char::from(b)
    } else {
        // The n-th byte (in order) that is not printable becomes U+0100 + n.
        let n = (0..b).filter(|&x| !is_printable(x)).count() as u32;
        char::from_u32(0x100 + n).unwrap_or(char::REPLACEMENT_CHARACTER)
    }
}

/// The byte that byte-level BPE spells with `c`, if any.
fn byte_of_char(c: char) -> Option<u8> {
    let code = u32::from(c);
    if code < 0x100 {
        let b = code as u8;
        return is_printable(b).then_some(b);
    }
    let n = usize::try_from(code - 0x100).ok()?;
    (0..=u8::MAX).filter(|&b| !is_printable(b)).nth(n)
}

/// `<0xNN>` → `NN`.
fn fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    let hex_digits = hex.len() == 2 && hex.bytes().all(|b| b.is_ascii_hexdigit());
    hex_digits
        .then(|| u8::from_str_radix(hex, 16).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_characters_round_trip_every_byte_and_nothing_else() {
        let chars: Vec<char> = (0..=u8::MAX).map(char_of_byte).collect();
        for (b, &c) in chars.iter().enumerate() {
            assert_eq!(byte_of_char(c), Some(b as u8), "byte {b} as {c:?}");
        }
        // 256 distinct characters, the last of the 68 moved ones at U+0143.
        let mut sorted = chars.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
        assert_eq!(char_of_byte(b' '), '\u{120}');
        assert_eq!(char_of_byte(0xAD), '\u{143}');
        assert_eq!(byte_of_char('\u{144}'), None);
        assert_eq!(byte_of_char('\u{3000}'), None);
    }

    #[test]
    fn sentencepiece_pieces_spell_spaces_and_fallback_bytes() {
        let sp = ByteForm::SentencePiece;
        assert_eq!(sp.bytes("<0xC3>"), [0xC3]);
        assert_eq!(sp.bytes("<0x0A>"), [0x0A]);
        assert_eq!(sp.bytes("<0xC>"), b"<0xC>");
        assert_eq!(sp.bytes("<0x+C>"), b"<0x+C>");
        assert_eq!(sp.bytes("\u{2581}the"), b" the");
        assert_eq!(sp.bytes("\u{2581}\u{2581}"), b"  ");
    }

    #[test]
    fn byte_level_pieces_map_back_and_added_tokens_are_plain_text() {
        let bl = ByteForm::ByteLevel;
        assert_eq!(bl.bytes("\u{120}the"), b" the");
        assert_eq!(bl.bytes("\u{c3}"), [0xC3]);
        // A character outside the alphabet: an added token, written as itself.
        assert_eq!(
            bl.bytes("<tool_call>\u{3000}"),
            "<tool_call>\u{3000}".as_bytes()
        );
    }
}
