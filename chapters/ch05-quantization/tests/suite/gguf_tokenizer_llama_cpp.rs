//! Two places where a GGUF file's tokens are llama.cpp's to define, not a `tokenizer.json`'s:
//! ties between SentencePiece merge scores, and byte-level BPE with `tokenizer.ggml.pre =
//! default`. Each runs on a vocabulary built here, against tokens worked out by hand from
//! llama.cpp's rules (written in the comments).

use std::collections::HashMap;

use ch01::linear::DenseLoader;
use ch01::testing::seeded_config;
use ch05_quantization::gguf::tokenizer::{hf_tokenizer, load_tokenizer, token_type};
use ch05_quantization::gguf::{GgufFile, GgufHostSide, GgufValue, GgufWriter};
use ch05_quantization::testing::spm_vocabulary;
use ch05_quantization::{GgmlType, load_gguf};
use proptest::prelude::*;

/// A `llama` (SentencePiece-style) vocabulary: `<unk>`, `<s>`, `</s>`, then `pieces` with
/// their scores, all normal tokens.
fn spm_writer(pieces: &[(&str, f32)], add_space_prefix: bool) -> GgufWriter<'static> {
    let mut tokens = vec!["<unk>", "<s>", "</s>"];
    let mut scores = vec![0.0f32; 3];
    let mut types = vec![
        token_type::UNKNOWN,
        token_type::CONTROL,
        token_type::CONTROL,
    ];
    for &(piece, score) in pieces {
        tokens.push(piece);
        scores.push(score);
        types.push(token_type::NORMAL);
    }
    let mut w = spm_vocabulary(tokens, scores, types);
    w.add_metadata("tokenizer.ggml.add_space_prefix", add_space_prefix)
        .unwrap();
    w
}

/// [`spm_writer`]'s vocabulary alone, as a file.
fn spm_file(pieces: &[(&str, f32)], add_space_prefix: bool) -> GgufFile {
    GgufFile::from_bytes("ties.gguf", spm_writer(pieces, add_space_prefix).to_bytes()).unwrap()
}

/// Ids 3, 4, 5, 6: `a`, `b`, `ab`, `ba`, every score −1000 (as in a file converted without
/// `tokenizer.model`).
const AB_BA: [(&str, f32); 4] = [
    ("a", -1000.0),
    ("b", -1000.0),
    ("ab", -1000.0),
    ("ba", -1000.0),
];

/// llama.cpp on `bab`: symbols `b a b`; the candidates `ba` (its left symbol is the first)
/// and `ab` (the second) score the same, so the leftmost, `ba`, merges; `bab` is no token, so
/// `ba b` = [6, 4]. On `aba` the leftmost is `ab`: `ab a` = [5, 3]. A ranked merge list gets
/// one of the two wrong: the BPE of the `tokenizers` pipeline ranks `a b` first (lower ids)
/// and gives `b ab` = [4, 5] for `bab`, which `load_tokenizer` gave before it encoded with
/// llama.cpp's loop.
#[test]
fn equal_scores_merge_the_leftmost_pair_first() {
    let file = spm_file(&AB_BA, false);
    let t = load_tokenizer(&file).unwrap();
    assert_eq!(t.encode("bab", false).unwrap(), [6, 4]);
    assert_eq!(t.encode("aba", false).unwrap(), [5, 3]);
    // `abab`: candidates ab(0), ba(1), ab(2) tie; ab(0) merges, then ab(2) (ba(1) lost its
    // `a`): [5, 5]. `baba`: ba(0), then ba(2): [6, 6].
    assert_eq!(t.encode("abab", false).unwrap(), [5, 5]);
    assert_eq!(t.encode("baba", false).unwrap(), [6, 6]);
    // The rest of the pipeline is the file's: BOS by default, `<s>` in the text matched
    // whole, and decoding through the same `tokenizers` pipeline.
    assert_eq!(t.encode("<s>bab", true).unwrap(), [1, 1, 6, 4]);
    assert!(t.adds_bos());
    assert_eq!(t.decode(&[1, 6, 4]).unwrap(), "bab");
    // The pipeline's own BPE, which the loop replaces, ranks `a b` before `b a`.
    let bpe = hf_tokenizer(&file).unwrap();
    assert_eq!(bpe.encode("bab", false).unwrap().get_ids(), [4, 5]);
}

/// A higher score still wins over position: with `ab` at −1 and `ba` at −2, `bab` is
/// `b ab` = [4, 5], as both llama.cpp and the ranked merges say.
#[test]
fn a_higher_score_beats_a_more_leftward_pair() {
    let pieces = [("a", -1000.0), ("b", -1000.0), ("ab", -1.0), ("ba", -2.0)];
    let file = spm_file(&pieces, false);
    assert_eq!(
        load_tokenizer(&file).unwrap().encode("bab", false).unwrap(),
        [4, 5]
    );
    let bpe = hf_tokenizer(&file).unwrap();
    assert_eq!(bpe.encode("bab", false).unwrap().get_ids(), [4, 5]);
}

/// Scores of −0 and +0 are one score, as llama.cpp compares them: with `ab` at −0 and `ba` at
/// +0, `aba` is still `ab a` = [5, 3] (the leftmost), not `a ba`.
#[test]
fn signed_zero_scores_tie() {
    let pieces = [("a", -1000.0), ("b", -1000.0), ("ab", -0.0), ("ba", 0.0)];
    let file = spm_file(&pieces, false);
    let t = load_tokenizer(&file).unwrap();
    assert_eq!(t.encode("aba", false).unwrap(), [5, 3]);
    assert_eq!(t.encode("bab", false).unwrap(), [6, 4]);
}

/// A whole `llama` model with [`AB_BA`]'s vocabulary: one layer of zeros, 8 wide, 2 heads.
fn tiny_model(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let mut w = spm_writer(&AB_BA, false);
    w.add_metadata("general.architecture", "llama").unwrap();
    for (k, v) in [
        ("block_count", 1u32),
        ("context_length", 16),
        ("embedding_length", 8),
        ("feed_forward_length", 16),
        ("attention.head_count", 2),
    ] {
        w.add_metadata(format!("llama.{k}"), v).unwrap();
    }
    w.add_metadata("llama.attention.layer_norm_rms_epsilon", 1e-6f32)
        .unwrap();
    let vocab = 3 + AB_BA.len();
    let mut tensors = vec![
        ("token_embd.weight".to_string(), vec![vocab, 8]),
        ("output_norm.weight".to_string(), vec![8]),
    ];
    for (name, shape) in [
        ("attn_norm", vec![8]),
        ("ffn_norm", vec![8]),
        ("attn_q", vec![8, 8]),
        ("attn_k", vec![8, 8]),
        ("attn_v", vec![8, 8]),
        ("attn_output", vec![8, 8]),
        ("ffn_gate", vec![16, 8]),
        ("ffn_up", vec![16, 8]),
        ("ffn_down", vec![8, 16]),
    ] {
        tensors.push((format!("blk.0.{name}.weight"), shape));
    }
    for (name, shape) in tensors {
        let bytes = vec![0u8; 4 * shape.iter().product::<usize>()];
        w.add_tensor(name, GgmlType::F32, &shape, bytes).unwrap();
    }
    let path = dir.path().join("ties.gguf");
    w.write(&path).unwrap();
    path
}

/// What `kiln generate --model file.gguf` loads (`load_gguf`), and what the server keeps when
/// an executor reads the weights (`GgufHostSide`), encode a `llama` vocabulary as llama.cpp
/// does: `bab` is `ba b`, not the `b ab` of the ranked merges.
#[test]
fn the_engine_loaders_tokenize_ties_as_llama_cpp_does() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_model(&dir);
    let gguf = load_gguf(&path, &DenseLoader).unwrap();
    let host = GgufHostSide::read(&GgufFile::open(&path).unwrap()).unwrap();
    for t in [&gguf.tokenizer, &host.tokenizer] {
        assert_eq!(t.encode("bab", true).unwrap(), [1, 6, 4]);
        assert_eq!(t.encode("aba", false).unwrap(), [5, 3]);
        assert_eq!(t.decode(&[1, 6, 4]).unwrap(), "bab");
    }
}

/// Pieces for the random texts: many ties (−1000), a few distinct scores, and tokens that can
/// be reached in several ways.
const MIXED: [(&str, f32); 14] = [
    ("▁", -1000.0),
    ("a", -1000.0),
    ("b", -1000.0),
    ("c", -1000.0),
    ("ab", -1000.0),
    ("ba", -1000.0),
    ("bc", -1000.0),
    ("ca", -5.0),
    ("▁a", -1000.0),
    ("▁b", -3.0),
    ("abc", -1000.0),
    ("bab", -4.0),
    ("▁ab", -1000.0),
    ("cab", -1000.0),
];

/// llama.cpp's loop, written as directly as possible: prepend `▁`, then merge the adjacent
/// pair whose concatenation is the highest-scoring token, the leftmost of equals, until none is.
fn reference(pieces: &[(&str, f32)], text: &str) -> Vec<u32> {
    let ids: HashMap<&str, (u32, f32)> = (pieces.iter().enumerate())
        .map(|(i, &(p, s))| (p, (3 + i as u32, s)))
        .collect();
    let mut symbols: Vec<String> = format!("▁{}", text.replace(' ', "▁"))
        .chars()
        .map(String::from)
        .collect();
    loop {
        let mut best: Option<(f32, usize)> = None;
        for i in 1..symbols.len() {
            let merged = format!("{}{}", symbols[i - 1], symbols[i]);
            if let Some(&(_, score)) = ids.get(merged.as_str())
                && best.is_none_or(|(s, _)| score > s)
            {
                best = Some((score, i - 1));
            }
        }
        let Some((_, i)) = best else { break };
        let right = symbols.remove(i + 1);
        symbols[i].push_str(&right);
    }
    symbols.iter().map(|s| ids[s.as_str()].0).collect()
}

proptest! {
    #![proptest_config(seeded_config(64, 0x7469_6573))]

    #[test]
    fn random_texts_tokenize_as_llama_cpp_does(text in "[abc ]{1,16}") {
        let t = load_tokenizer(&spm_file(&MIXED, true)).unwrap();
        let ids = t.encode(&text, false).unwrap();
        prop_assert_eq!(&ids, &reference(&MIXED, &text));
        prop_assert_eq!(t.decode(&ids).unwrap(), text);
    }
}

/// A byte-level file with `pre` set to `value` (or left out). Ids: 0 `a`, 1 `s`, 2 `'`,
/// 3 `,`, 4 `Ġ` (a space), 5–9 `1`–`5`, 10 `'s`, 11 `Ġ,`, 12 `12`, 13 `34`, 14 `123`, 15 `45`.
fn bpe_file(pre: Option<&str>) -> GgufFile {
    let tokens = [
        "a", "s", "'", ",", "Ġ", "1", "2", "3", "4", "5", "'s", "Ġ,", "12", "34", "123", "45",
    ];
    let merges = ["' s", "Ġ ,", "1 2", "3 4", "12 3", "4 5"];
    let mut w = GgufWriter::new();
    w.add_metadata("tokenizer.ggml.model", "gpt2").unwrap();
    if let Some(pre) = pre {
        w.add_metadata("tokenizer.ggml.pre", pre).unwrap();
    }
    w.add_metadata("tokenizer.ggml.tokens", GgufValue::strings(tokens))
        .unwrap();
    w.add_metadata("tokenizer.ggml.token_type", GgufValue::array([1i32; 16]))
        .unwrap();
    w.add_metadata("tokenizer.ggml.merges", GgufValue::strings(merges))
        .unwrap();
    GgufFile::from_bytes("default-pre.gguf", w.to_bytes()).unwrap()
}

/// llama.cpp's `default` split of `a's ,12345`, one pattern after another over the pieces:
/// punctuation runs `a | ' | s␣ | , | 12345`; GPT-2's pattern splits `s␣` into `s | ␣`; digit
/// runs leave `12345`; threes make `123 | 45`. Merged: `a ' s Ġ , 123 45` =
/// [0, 2, 1, 4, 3, 14, 15] (`123`: `1 2`, then `12 3`). GPT-2's split (`pre = gpt-2`) is
/// `a | 's | ␣, | 12345` = [0, 10, 11, 12, 13, 9]: in `12345`, `1 2` then `3 4` (ranked
/// before `12 3`), leaving `5`. kiln used to split `default` as GPT-2 does.
#[test]
fn default_pre_tokenizer_splits_as_llama_cpp_does() {
    let text = "a's ,12345";
    for pre in [Some("default"), None] {
        let t = load_tokenizer(&bpe_file(pre)).unwrap();
        assert_eq!(
            t.encode(text, false).unwrap(),
            [0, 2, 1, 4, 3, 14, 15],
            "{pre:?}"
        );
        assert_eq!(t.decode(&t.encode(text, false).unwrap()).unwrap(), text);
    }
    let gpt2 = load_tokenizer(&bpe_file(Some("gpt-2"))).unwrap();
    assert_eq!(gpt2.encode(text, false).unwrap(), [0, 10, 11, 12, 13, 9]);
}
