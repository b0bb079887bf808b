//! The SentencePiece-style (`tokenizer.ggml.model = llama`) tokenizer on a small vocabulary
//! built here, against a direct implementation of what llama.cpp does with it: replace spaces
//! by `▁`, prepend one, then repeatedly merge the adjacent pair whose concatenation is the
//! highest-scoring token; a character outside the vocabulary becomes its `<0xNN>` byte tokens.

use std::collections::HashMap;

use ch01::testing::seeded_config;
use ch05_quantization::gguf::tokenizer::{eos_token_ids, hf_tokenizer, load_tokenizer, token_type};
use ch05_quantization::gguf::{GgufFile, GgufValue, GgufWriter};
use ch05_quantization::testing::spm_vocabulary;
use proptest::prelude::*;

const PIECES: [&str; 24] = [
    "▁", "h", "e", "l", "o", "w", "r", "d", "a", "▁h", "he", "ll", "lo", "▁he", "llo", "▁hello",
    "▁w", "or", "▁wor", "ld", "▁world", "▁▁", "▁a", "ha",
];

/// `(tokens, scores, types)`: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then the pieces with
/// distinct scores (longer pieces score higher, except a few, so the order matters).
fn vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    let mut types = vec![
        token_type::UNKNOWN,
        token_type::CONTROL,
        token_type::CONTROL,
    ];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(token_type::BYTE);
    }
    let mut scores = vec![0.0; tokens.len()];
    for (i, p) in PIECES.iter().enumerate() {
        tokens.push(p.to_string());
        types.push(token_type::NORMAL);
        // Distinct: by length, then a per-piece offset that breaks ties in a mixed order.
        scores.push(p.chars().count() as f32 * 10.0 + ((i * 7) % 11) as f32);
    }
    (tokens, scores, types)
}

fn file(add_bos: Option<bool>) -> GgufFile {
    let (tokens, scores, types) = vocab();
    file_of(tokens, scores, types, add_bos)
}

fn file_of(
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
    add_bos: Option<bool>,
) -> GgufFile {
    let mut w = spm_vocabulary(tokens, scores, types);
    w.add_metadata("tokenizer.ggml.unknown_token_id", 0u32)
        .unwrap();
    if let Some(add) = add_bos {
        w.add_metadata("tokenizer.ggml.add_bos_token", add).unwrap();
    }
    GgufFile::from_bytes("spm.gguf", w.to_bytes()).unwrap()
}

/// llama.cpp's SentencePiece merge loop, written directly.
fn reference(text: &str) -> Vec<u32> {
    let (tokens, scores, types) = vocab();
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .filter(|&(i, _)| types[i] == token_type::NORMAL)
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let text = format!("▁{}", text.replace(' ', "▁"));
    let mut symbols: Vec<String> = text.chars().map(String::from).collect();
    loop {
        let mut best: Option<(f32, usize)> = None;
        for i in 0..symbols.len().saturating_sub(1) {
            let merged = format!("{}{}", symbols[i], symbols[i + 1]);
            if let Some(&id) = ids.get(merged.as_str())
                && best.is_none_or(|(s, _)| scores[id] > s)
            {
                best = Some((scores[id], i));
            }
        }
        let Some((_, i)) = best else { break };
        let right = symbols.remove(i + 1);
        symbols[i].push_str(&right);
    }
    symbols
        .iter()
        .flat_map(|s| match ids.get(s.as_str()) {
            Some(&id) => vec![id as u32],
            None => s.bytes().map(|b| 3 + u32::from(b)).collect(),
        })
        .collect()
}

#[test]
fn sentencepiece_vocab_tokenizes_like_llama_cpp() {
    let t = load_tokenizer(&file(None)).unwrap();
    assert_eq!((t.bos_token_id(), t.eos_token_id()), (Some(1), Some(2)));
    let id = |s: &str| vocab().0.iter().position(|t| t == s).unwrap() as u32;
    assert_eq!(
        t.encode("hello world", false).unwrap(),
        [id("▁hello"), id("▁world")]
    );
    // BOS by default for this model; `é` is not in the vocabulary: its two UTF-8 bytes.
    assert_eq!(
        t.encode("hello é", true).unwrap(),
        [1, id("▁hello"), id("▁"), 3 + 0xC3, 3 + 0xA9]
    );
    assert_eq!(
        t.decode(&t.encode("hello é", true).unwrap()).unwrap(),
        "hello é"
    );
    // Each byte token decodes to U+FFFD alone, but its logprobs bytes are its byte.
    assert_eq!(t.decode(&[3 + 0xC3]).unwrap(), "\u{FFFD}");
    assert_eq!(t.token_bytes(3 + 0xC3).unwrap(), [0xC3]);
    assert_eq!(t.token_bytes(3 + 0xA9).unwrap(), [0xA9]);
    // A piece's `▁` is a space (decoding `▁world` alone strips it), as llama.cpp's pieces.
    assert_eq!(t.token_bytes(id("▁world")).unwrap(), b" world");
    let joined: Vec<u8> = (t.encode("hello é", false).unwrap().iter())
        .flat_map(|&id| t.token_bytes(id).unwrap())
        .collect();
    assert_eq!(
        joined,
        " hello é".as_bytes(),
        "with the space the text is given"
    );
    // Streamed after a prompt, the first token keeps its space; alone the decoder strips it.
    let mut stream = ch01::TextStream::after(&t, &t.encode("hello", true).unwrap());
    assert_eq!(
        stream.push(id("▁world")).unwrap().as_deref(),
        Some(" world")
    );
    let mut alone = ch01::TextStream::new(&t);
    assert_eq!(alone.push(id("▁world")).unwrap().as_deref(), Some("world"));
    // A byte run that turns invalid (é, then a stray continuation byte) is rewritten by the
    // decoder as a whole: the stream goes on, and the words after it still come out.
    let mut ids = t.encode("hello é", false).unwrap();
    ids.push(3 + 0x80);
    ids.extend(t.encode(" world hello", false).unwrap());
    let mut stream = ch01::TextStream::new(&t);
    let mut text: String = ids
        .iter()
        .filter_map(|&i| stream.push(i).unwrap())
        .collect();
    text.extend(stream.finish().unwrap());
    assert!(
        text.starts_with("hello") && text.ends_with("world hello"),
        "{text:?}"
    );
    for text in [
        "hello world",
        "held a hall",
        "  two  spaces",
        "wordle",
        "ha",
        "z",
    ] {
        let ids = t.encode(text, false).unwrap();
        assert_eq!(ids, reference(text), "{text:?}");
        assert_eq!(t.decode(&ids).unwrap(), text, "{text:?}");
    }
    let no_bos = load_tokenizer(&file(Some(false))).unwrap();
    assert_eq!(no_bos.encode("hello", true).unwrap(), [id("▁hello")]);
    assert!(!no_bos.adds_bos() && t.adds_bos());
}

proptest! {
    #![proptest_config(seeded_config(128, 0x5350_4d21))]

    #[test]
    fn random_text_matches_the_reference(text in "[helowrda zé]{1,24}") {
        let t = load_tokenizer(&file(Some(false))).unwrap();
        let ids = t.encode(&text, false).unwrap();
        prop_assert_eq!(&ids, &reference(&text));
        // `load_tokenizer` encodes with llama.cpp's loop; with distinct scores the ranked
        // merges of `hf_tokenizer`'s `tokenizers` pipeline agree with it.
        let bpe = hf_tokenizer(&file(Some(false))).unwrap();
        let bpe_ids = bpe.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        prop_assert_eq!(&bpe_ids, &ids);
        prop_assert_eq!(t.decode(&ids).unwrap(), text);
    }
}

/// `hf_tokenizer`'s ranked merges come from splitting every normal token in two, which costs
/// about its length squared: a vocabulary of very long tokens (a hostile file) is refused as
/// soon as the splitting would pass a bound, with an error that says so, rather than keeping
/// the loader busy for hours. `load_tokenizer` derives no merges (llama.cpp's loop encodes), so
/// the same file loads, and a text costs what its own length does.
#[test]
fn a_vocabulary_too_costly_to_split_is_refused() {
    let (mut tokens, mut scores, mut types) = vocab();
    for i in 0..40 {
        tokens.push(format!("{i}{}", "x".repeat(6000)));
        scores.push(1.0);
        types.push(token_type::NORMAL);
    }
    let file = file_of(tokens, scores, types, None);
    let error = hf_tokenizer(&file).expect_err("refused").to_string();
    assert!(error.contains("would hash more than"), "{error}");
    let t = load_tokenizer(&file).unwrap();
    assert_eq!(
        t.encode("hello world", false).unwrap(),
        reference("hello world")
    );
}

/// The number of merges in a `tokenizers` pipeline's BPE, from its saved form.
fn merge_count(pipeline: &tokenizers::Tokenizer) -> usize {
    let saved: serde_json::Value =
        serde_json::from_str(&pipeline.to_string(false).unwrap()).unwrap();
    saved["model"]["merges"].as_array().expect("a BPE").len()
}

/// `load_tokenizer`'s pipeline only decodes (llama.cpp's loop encodes), so its BPE holds the
/// vocabulary and no merge list; every id decodes and names the same token as in
/// `hf_tokenizer`'s, whose BPE has the ranked merges.
#[test]
fn the_loaded_pipeline_keeps_no_merges_and_decodes_the_same() {
    let (t, full) = (
        load_tokenizer(&file(None)).unwrap(),
        hf_tokenizer(&file(None)).unwrap(),
    );
    assert_eq!(merge_count(t.inner()), 0);
    assert!(merge_count(&full) > 0, "the ranked merges");
    assert_eq!(t.vocab_size(), full.get_vocab_size(true));
    let ids: Vec<u32> = (0..t.vocab_size() as u32).collect();
    assert_eq!(t.decode(&ids).unwrap(), full.decode(&ids, true).unwrap());
    for id in ids {
        assert_eq!(t.inner().id_to_token(id), full.id_to_token(id), "{id}");
        assert_eq!(
            t.decode(&[id]).unwrap(),
            full.decode(&[id], true).unwrap(),
            "{id}"
        );
    }
}

/// Which added tokens decoded text keeps, and which end generation, as llama.cpp reads them:
/// a user-defined token is text the model writes (Qwen's `<tool_call>`), a control or unknown
/// token is not, and an end-of-generation text is a control stop token even when its file
/// types it otherwise.
#[test]
fn user_defined_tokens_are_text_and_end_of_generation_texts_stop() {
    let (mut tokens, mut scores, mut types) = vocab();
    for (token, ty) in [
        ("<tool_call>", token_type::USER_DEFINED),
        ("<|im_end|>", token_type::NORMAL),
    ] {
        tokens.push(token.to_string());
        scores.push(0.0);
        types.push(ty);
    }
    let (call, im_end) = (tokens.len() as u32 - 2, tokens.len() as u32 - 1);
    let file = file_of(tokens, scores, types, Some(false));
    let t = load_tokenizer(&file).unwrap();
    let ids = t
        .encode("hello<tool_call>world<unk><|im_end|>", false)
        .unwrap();
    assert!(
        ids.contains(&call) && ids.contains(&im_end) && ids.contains(&0),
        "{ids:?}"
    );
    // (Each stretch of text after an added token gets its `▁`, as in llama.cpp.)
    assert_eq!(t.decode(&ids).unwrap(), "hello<tool_call> world");
    assert_eq!(t.token_bytes(call).unwrap(), b"<tool_call>");
    assert_eq!(eos_token_ids(&file).unwrap(), [2, im_end]);
}

/// A control token is matched whole by an automaton the `tokenizers` crate builds at load, in
/// time that grows with the square of a self-repeating token's length: one of 100,000 `a`s is
/// refused with an error before that build (as `tokenizer.json`'s added tokens are, in ch01);
/// one of 1,024 bytes loads.
#[test]
fn a_control_token_too_long_to_match_is_refused() {
    for (len, loads) in [(100_000, false), (1024, true)] {
        let (mut tokens, mut scores, mut types) = vocab();
        tokens.push("a".repeat(len));
        scores.push(0.0);
        types.push(token_type::CONTROL);
        let file = file_of(tokens, scores, types, None);
        match load_tokenizer(&file) {
            Ok(_) => assert!(loads, "a control token of {len} bytes loaded"),
            Err(e) => {
                assert!(!loads, "a control token of {len} bytes: {e}");
                let e = e.to_string();
                assert!(
                    e.contains("spm.gguf") && e.contains("100000 bytes long"),
                    "{e}"
                );
            }
        }
    }
}

/// A byte-level file with Llama 3's pre-tokenizer: a piece that is a token is taken whole
/// before any merge (`abc` is a token that no merge reaches), and BOS begins every text unless
/// the file says otherwise.
#[test]
fn llama3_vocabularies_take_whole_tokens_first_and_begin_with_bos() {
    let file = |pre: &str| {
        let tokens = [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "a",
            "b",
            "c",
            "ab",
            "abc",
        ];
        let mut w = GgufWriter::new();
        w.add_metadata("tokenizer.ggml.model", "gpt2").unwrap();
        w.add_metadata("tokenizer.ggml.pre", pre).unwrap();
        w.add_metadata("tokenizer.ggml.tokens", GgufValue::strings(tokens))
            .unwrap();
        let types = [3i32, 3, 1, 1, 1, 1, 1];
        w.add_metadata("tokenizer.ggml.token_type", GgufValue::array(types))
            .unwrap();
        w.add_metadata("tokenizer.ggml.merges", GgufValue::strings(["a b"]))
            .unwrap();
        w.add_metadata("tokenizer.ggml.bos_token_id", 0u32).unwrap();
        w.add_metadata("tokenizer.ggml.eos_token_id", 1u32).unwrap();
        GgufFile::from_bytes("bpe.gguf", w.to_bytes()).unwrap()
    };
    let llama3 = load_tokenizer(&file("llama-bpe")).unwrap();
    assert_eq!(llama3.encode("abc", true).unwrap(), [0, 6]);
    let gpt2 = load_tokenizer(&file("gpt2")).unwrap();
    assert_eq!(gpt2.encode("abc", true).unwrap(), [5, 4]);
}
