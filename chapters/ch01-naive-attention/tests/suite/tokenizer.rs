//! The tokenizer round-trips text, and the streaming detokeniser emits exactly the decoded text.

use ch01_naive_attention::testing::seeded_runner;
use ch01_naive_attention::tokenizer::{MAX_HELD_TOKENS, MAX_PENDING_TOKENS};
use ch01_naive_attention::{TextStream, Tokenizer, fixtures_dir};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

fn runner(cases: u32) -> TestRunner {
    seeded_runner(cases, 11)
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&fixtures_dir().join("tokenizer")).unwrap()
}

fn corpus() -> String {
    std::fs::read_to_string(fixtures_dir().join("corpus/hamlet.txt")).unwrap()
}

/// Pushes ids one at a time through a [`TextStream`]; returns the pieces.
fn stream_pieces(tokenizer: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut stream = TextStream::new(tokenizer);
    let mut pieces: Vec<String> = ids
        .iter()
        .filter_map(|&id| stream.push(id).unwrap())
        .collect();
    pieces.extend(stream.finish().unwrap());
    pieces
}

#[test]
fn special_tokens_and_bos_rule() {
    let tokenizer = tokenizer();
    assert_eq!(tokenizer.bos_token_id(), Some(0));
    assert_eq!(tokenizer.eos_token_id(), Some(1));
    assert!(tokenizer.adds_bos());
    let with = tokenizer.encode("Good night, sweet prince", true).unwrap();
    let without = tokenizer.encode("Good night, sweet prince", false).unwrap();
    assert_eq!(with[0], 0);
    assert_eq!(&with[1..], &without[..]);
    assert_eq!(tokenizer.decode(&with).unwrap(), "Good night, sweet prince");
}

#[test]
fn corpus_text_round_trips() {
    let tokenizer = tokenizer();
    let text = corpus();
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let spans = (0..chars.len() - 1).prop_flat_map(|start| (Just(start), 1usize..600));
    runner(200)
        .run(&spans, |(start, len)| {
            let end = chars.get(start + len).map_or(text.len(), |&(i, _)| i);
            let piece = &text[chars[start].0..end];
            let ids = tokenizer.encode(piece, false).unwrap();
            prop_assert_eq!(tokenizer.decode(&ids).unwrap(), piece);
            Ok(())
        })
        .unwrap();
}

#[test]
fn arbitrary_unicode_round_trips() {
    let tokenizer = tokenizer();
    runner(300)
        .run(&any::<String>(), |text| {
            let ids = tokenizer.encode(&text, false).unwrap();
            prop_assert_eq!(tokenizer.decode(&ids).unwrap(), text);
            Ok(())
        })
        .unwrap();
}

#[test]
fn streamed_text_equals_decoded_text_and_never_splits_a_character() {
    let tokenizer = tokenizer();
    let text_strategy = prop_oneof![
        any::<String>(),
        "[a-zA-Z ,.;:!?'\n]{0,80}",
        "(café|naïve|Ophélie|— |😀|日本語|, my lord|\n){1,20}",
    ];
    runner(300)
        .run(&text_strategy, |text| {
            let ids = tokenizer.encode(&text, false).unwrap();
            let pieces = stream_pieces(&tokenizer, &ids);
            prop_assert_eq!(pieces.concat(), text.clone());
            for piece in &pieces {
                // A U+FFFD in a piece would mean half a character was emitted
                prop_assert!(
                    !piece.contains('\u{FFFD}') || text.contains('\u{FFFD}'),
                    "piece {:?}",
                    piece
                );
            }
            Ok(())
        })
        .unwrap();
}

/// Bytes that never complete a character (a run of lone continuation bytes, which a model can
/// be made to write) are released as U+FFFD a few tokens at a time, not held back to the end:
/// the window each push re-decodes stays short. The text is still `decode(all tokens)`.
#[test]
fn invalid_bytes_are_released_not_held_back_forever() {
    let tokenizer = tokenizer();
    let inner = tokenizer.inner();
    // Byte 0xA9 alone: `©` in byte-level BPE's byte alphabet, `<0xA9>` with byte fallback.
    let byte = inner
        .token_to_id("©")
        .or_else(|| inner.token_to_id("<0xA9>"))
        .expect("a token for the byte 0xA9");
    let ids = vec![byte; 64];
    let pieces = stream_pieces(&tokenizer, &ids);
    let text = tokenizer.decode(&ids).unwrap();
    assert!(text.contains('\u{FFFD}'), "{text:?}");
    assert_eq!(pieces.concat(), text);
    assert!(pieces.len() >= 64 / 5, "{} pieces", pieces.len());
}

#[test]
fn token_bytes_join_into_the_text_even_where_a_token_splits_a_character() {
    let tokenizer = tokenizer();
    let text = "naïve café — 東京 🦀";
    let ids = tokenizer.encode(text, false).unwrap();
    let pieces: Vec<Vec<u8>> = ids
        .iter()
        .map(|&id| tokenizer.token_bytes(id).unwrap())
        .collect();
    // The case this is for: some token holds part of a character, so its text is U+FFFD.
    assert!(
        ids.iter()
            .any(|&id| tokenizer.decode(&[id]).unwrap().contains('\u{FFFD}'))
    );
    assert_eq!(pieces.concat(), text.as_bytes());

    runner(64)
        .run(&"\\PC{0,40}", |text| {
            let ids = tokenizer.encode(&text, false).unwrap();
            let joined: Vec<u8> = ids
                .iter()
                .flat_map(|&id| tokenizer.token_bytes(id).unwrap())
                .collect();
            prop_assert_eq!(joined, text.as_bytes());
            Ok(())
        })
        .unwrap();
}

/// A byte string as byte-level BPE spells it.
fn spell(bytes: &[u8]) -> String {
    use ch01_naive_attention::token_bytes::char_of_byte;
    bytes.iter().map(|&b| char_of_byte(b)).collect()
}

/// A byte-level tokenizer whose tokens are the 256 bytes and then `extra`, any byte strings
/// (each once), and the ids of `extra` in order: enough to decode ids, which is all a
/// [`TextStream`] does.
fn byte_level_tokens(extra: &[&[u8]]) -> (Tokenizer, Vec<u32>) {
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(spell(&[b]), serde_json::json!(b));
    }
    for bytes in extra {
        let next = vocab.len();
        vocab.entry(spell(bytes)).or_insert(serde_json::json!(next));
    }
    let file = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    let inner = tokenizers::Tokenizer::from_bytes(file.to_string().as_bytes()).unwrap();
    let ids = extra
        .iter()
        .map(|bytes| inner.token_to_id(&spell(bytes)).unwrap())
        .collect();
    (
        Tokenizer::from_parts(inner, "bytes.json".into(), None, None),
        ids,
    )
}

/// Tokens that each end inside a character (the tail of one and the head of the next) are
/// held until the character completes, never released as U+FFFD, however many in a row.
#[test]
fn tokens_that_straddle_characters_stream_without_replacement_characters() {
    let text = "中文字符串好, 😀 and ok";
    let bytes = text.as_bytes();
    // Cut the bytes into tokens of 2 and 3 bytes, most of them across characters.
    let mut pieces: Vec<&[u8]> = Vec::new();
    let mut at = 0;
    for size in [2, 3].iter().cycle() {
        let end = (at + size).min(bytes.len());
        pieces.push(&bytes[at..end]);
        at = end;
        if at == bytes.len() {
            break;
        }
    }
    let (tokenizer, ids) = byte_level_tokens(&pieces);
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    let streamed = stream_pieces(&tokenizer, &ids);
    assert_eq!(streamed.concat(), text, "{streamed:?}");
    assert!(
        streamed.iter().all(|p| !p.contains('\u{FFFD}')),
        "{streamed:?}"
    );
}

/// Every token of a run longer than [`MAX_PENDING_TOKENS`] ends inside a character (a 1-byte
/// head, then 2-byte tokens over 2-byte characters): the hold's release must find the
/// boundaries where the text is final, never emit U+FFFD for a character still completing.
#[test]
fn a_long_run_of_tokens_inside_characters_streams_exactly() {
    let text = "приветствую ok";
    let bytes = text.as_bytes();
    let cyrillic = bytes.len() - 3; // the bytes before " ok"
    let mut pieces: Vec<&[u8]> = vec![&bytes[..1]];
    let mut at = 1;
    while at < cyrillic {
        let end = (at + 2).min(cyrillic);
        pieces.push(&bytes[at..end]);
        at = end;
    }
    pieces.push(&bytes[cyrillic..]);
    let (tokenizer, ids) = byte_level_tokens(&pieces);
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    assert!(pieces.len() > MAX_PENDING_TOKENS + 2);
    let streamed = stream_pieces(&tokenizer, &ids);
    assert_eq!(streamed.concat(), text, "{streamed:?}");
}

/// A run longer than [`MAX_HELD_TOKENS`] with no boundary where the text is final is released
/// anyway (the window stays bounded): a character cut there shows as U+FFFD, and nothing else
/// is lost.
#[test]
fn a_run_longer_than_the_hold_is_released_and_loses_nothing_else() {
    let cyrillic = "б".repeat(3 * MAX_HELD_TOKENS);
    let text = format!("{cyrillic} ok");
    let bytes = text.as_bytes();
    let mut pieces: Vec<&[u8]> = vec![&bytes[..1]];
    let mut at = 1;
    while at < cyrillic.len() {
        let end = (at + 2).min(cyrillic.len());
        pieces.push(&bytes[at..end]);
        at = end;
    }
    pieces.push(&bytes[cyrillic.len()..]);
    let (tokenizer, ids) = byte_level_tokens(&pieces);
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    let streamed = stream_pieces(&tokenizer, &ids).concat();
    assert!(streamed.ends_with(" ok"), "{streamed:?}");
    let releases = pieces.len() / MAX_HELD_TOKENS + 1;
    let lost = streamed.matches('\u{FFFD}').count();
    assert!(
        lost <= 2 * releases,
        "{lost} replacement characters: {streamed:?}"
    );
    let kept = streamed.chars().filter(|&c| c == 'б').count();
    assert!(
        kept + releases >= 3 * MAX_HELD_TOKENS,
        "{kept} of the characters kept: {streamed:?}"
    );
}

/// A stream after the prompt's tokens emits only the new text, with the spaces the decoder
/// gives a token inside a text (the fixture's vocabulary keeps them either way).
#[test]
fn a_stream_after_a_context_emits_only_the_continuation() {
    let tokenizer = tokenizer();
    let prompt = tokenizer.encode("To be, or not", false).unwrap();
    let more = tokenizer.encode(" to be, that is", false).unwrap();
    let mut stream = TextStream::after(&tokenizer, &prompt);
    let mut out: String = more
        .iter()
        .filter_map(|&id| stream.push(id).unwrap())
        .collect();
    out.extend(stream.finish().unwrap());
    assert_eq!(out, " to be, that is");
    assert_eq!(stream.tokens(), &more[..]);
}
