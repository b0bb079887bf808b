//! The SmolLM2 GGUF suite: kiln's reader, source and tokenizer on the real
//! SmolLM2-135M-Instruct.Q4_1.gguf, against gguf-py and the Hugging Face directory that
//! `fixtures/scripts/convert_gguf.py` made from the same file. Needs the download, so a plain
//! `cargo test` ignores it:
//!
//! ```bash
//! just fetch-smollm2 && cargo test --release -p ch05-quantization --test smollm2_gguf -- --ignored
//! ```
//! Run with `--ignored` but without it, every test here fails and says how to fetch it.
//!
//! `logits_match_transformers` decodes the Q4_1 projections, so it passes once
//! `blocks::dequantize` knows Q4_1; everything else needs only F32 and Q8_0.

use std::path::PathBuf;
use std::process::Command;

use ch01::linear::DenseLoader;
use ch01::testing::{assert_rel_close, load_golden};
use ch01::{LlamaConfig, Tokenizer, WeightSource, Weights};
use ch05_quantization::gguf::tokenizer::{chat_template, eos_token_ids, load_tokenizer};
use ch05_quantization::gguf::{GgufFile, GgufSource, GgufValue, hf_name, llama_config};
use ch05_quantization::{GgmlType, load_gguf};
use serde_json::Value;

fn gguf_path() -> PathBuf {
    let path = ch01::fixtures_dir().join(".cache/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run `just fetch-smollm2` first",
        path.display()
    );
    path
}

fn hf_dir() -> PathBuf {
    let dir = ch01::fixtures_dir().join(".cache/SmolLM2-135M-Instruct");
    assert!(
        dir.join("config.json").exists(),
        "{} is missing: run `just fetch-smollm2` first",
        dir.display()
    );
    dir
}

/// `fixtures/scripts/gguf_dump.py`'s JSON for the file (gguf-py's view of it).
fn gguf_py_dump() -> Value {
    let fixtures = ch01::fixtures_dir();
    let python = fixtures.join(".venv-smollm2/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run `just fetch-smollm2` first",
        python.display()
    );
    let out = Command::new(&python)
        .arg(fixtures.join("scripts/gguf_dump.py"))
        .arg(gguf_path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gguf_dump.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A metadata value as gguf-py's `contents()` prints it.
fn as_json(v: &GgufValue) -> Value {
    match v {
        GgufValue::F32(x) => Value::from(f64::from(*x)),
        GgufValue::F64(x) => Value::from(*x),
        GgufValue::Bool(b) => Value::from(*b),
        GgufValue::String(s) => Value::from(s.as_str()),
        GgufValue::Array(a) => Value::Array(a.values().iter().map(as_json).collect()),
        int => int
            .as_i64()
            .map(Value::from)
            .or_else(|| int.as_u64().map(Value::from))
            .unwrap(),
    }
}

#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn reader_matches_gguf_py() {
    let dump = gguf_py_dump();
    let file = GgufFile::open(&gguf_path()).unwrap();
    assert_eq!(u64::from(file.version()), dump["version"]);
    assert_eq!(file.alignment(), dump["alignment"]);
    assert_eq!(file.data_offset() as u64, dump["data_offset"]);

    let metadata = dump["metadata"].as_array().unwrap();
    assert_eq!(file.metadata().len(), metadata.len());
    for ((key, value), want) in file.metadata().iter().zip(metadata) {
        assert_eq!(key, want["key"].as_str().unwrap());
        assert_eq!(u64::from(value.value_type().id()), want["type"], "{key}");
        if let GgufValue::Array(a) = value {
            assert_eq!(u64::from(a.elem().id()), want["elem"], "{key}");
        }
        assert_eq!(as_json(value), want["value"], "{key}");
    }

    let tensors = dump["tensors"].as_array().unwrap();
    assert_eq!(file.tensors().len(), tensors.len());
    for (t, want) in file.tensors().iter().zip(tensors) {
        assert_eq!(t.name, want["name"].as_str().unwrap());
        assert_eq!(u64::from(t.ty.id()), want["type"], "{}", t.name);
        assert_eq!(
            serde_json::to_value(&t.dims).unwrap(),
            want["dims"],
            "{}",
            t.name
        );
        assert_eq!(t.offset, want["offset"], "{}", t.name);
        assert_eq!(t.size as u64, want["n_bytes"], "{}", t.name);
    }
}

/// q/k rows come back in the order convert_gguf.py's `unpermute` puts them, as whole rows of
/// Q4_1 blocks.
#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn q_and_k_rows_are_unpermuted_like_the_converter() {
    let dump = gguf_py_dump();
    let source = GgufSource::open(&gguf_path()).unwrap();
    for gguf in ["blk.0.attn_q.weight", "blk.0.attn_k.weight"] {
        let order: Vec<usize> = serde_json::from_value(dump["qk_row_order"][gguf].clone()).unwrap();
        let stored = source.gguf_tensor(gguf).unwrap();
        let hf = source.tensor(&hf_name(gguf).unwrap()).unwrap();
        assert_eq!(source.file().tensor_info(gguf).unwrap().ty, GgmlType::Q4_1);
        let row_bytes = stored.bytes().len() / order.len();
        for (r, &src) in order.iter().enumerate() {
            assert_eq!(
                hf.bytes()[r * row_bytes..(r + 1) * row_bytes],
                stored.bytes()[src * row_bytes..(src + 1) * row_bytes],
                "{gguf} row {r}"
            );
        }
    }
}

#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn source_matches_the_converted_safetensors() {
    let source = GgufSource::open(&gguf_path()).unwrap();
    let weights = Weights::open(&hf_dir()).unwrap();
    let mut names: Vec<String> = source
        .file()
        .tensors()
        .iter()
        .map(|t| hf_name(&t.name).unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 272);
    let mut dense = 0;
    for name in &names {
        let ours = source.tensor(name).unwrap();
        let theirs = weights.tensor(name).unwrap();
        assert_eq!(ours.shape(), theirs.shape(), "{name}");
        let ty = source.ggml_type(name).unwrap();
        assert_eq!(ours.dtype(), ty.tensor_dtype(), "{name}");
        // Everything decodable today: the F32 norms and the Q8_0 embedding table, which
        // gguf-py decodes to exactly the same f32 values.
        if matches!(ty, GgmlType::F32 | GgmlType::Q8_0) {
            let shape = ours.shape().to_vec();
            let got = source.get(name, &shape).unwrap();
            assert_eq!(got, theirs.to_f32(name).unwrap(), "{name}");
            dense += 1;
        }
    }
    assert_eq!(
        dense,
        1 + 2 * 30 + 1,
        "embedding, two norms per layer, the final norm"
    );
    assert!(!source.contains("lm_head.weight"), "tied embeddings");
}

#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn config_matches_the_converted_config() {
    let file = GgufFile::open(&gguf_path()).unwrap();
    let dir = hf_dir();
    let mut want = LlamaConfig::from_dir(&dir).unwrap();
    want.eos_token_ids = ch01::eos_token_ids(&dir, &want).unwrap();
    assert_eq!(llama_config(&file).unwrap(), want);
    // The directory's stop tokens, then `<|endoftext|>` (id 0), which ends generation by its
    // text in a GGUF file, as in llama.cpp.
    let mut stops = want.eos_token_ids.clone();
    stops.push(0);
    assert_eq!(eos_token_ids(&file).unwrap(), stops);
    let tokenizer_config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        chat_template(&file).unwrap().as_deref(),
        tokenizer_config["chat_template"].as_str()
    );
}

#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn tokenizer_matches_the_converted_tokenizer_json() {
    let file = GgufFile::open(&gguf_path()).unwrap();
    let ours = load_tokenizer(&file).unwrap();
    let theirs = Tokenizer::from_dir(&hf_dir()).unwrap();
    assert_eq!(
        (
            ours.bos_token_id(),
            ours.eos_token_id(),
            ours.adds_bos(),
            ours.vocab_size()
        ),
        (
            theirs.bos_token_id(),
            theirs.eos_token_id(),
            theirs.adds_bos(),
            theirs.vocab_size()
        )
    );
    let corpus = ch01::fixtures_dir().join("corpus");
    let mut texts: Vec<String> = ["hamlet.txt", "sample.txt"]
        .iter()
        .map(|f| std::fs::read_to_string(corpus.join(f)).unwrap())
        .collect();
    texts.extend(
        [
            "The capital of France is 2024.",
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            "<|endoftext|><repo_name>x</s><s> specials as text",
            "     five spaces, \t\ttabs, \r\n\r\n crlf   ",
            "digits 0123456789 3.14159 1,000,000 ١٢٣ ½",
            "unicode: café naïve Ünïcödé 日本語 한국어 Ελληνικά русский עברית العربية",
            "emoji: 🦀🔥👍🏽 👨‍👩‍👧 🇫🇷 ",
            "it's they're we've I'm you'll he'd DON'T",
            "code: fn main() { println!(\"{}\", x[0] >= 1 && y != 2); } // ok",
            "\u{0}\u{1f}\u{7f} control characters and a lone \u{fffd}",
            "",
            " ",
            "\n",
        ]
        .map(String::from),
    );
    for text in &texts {
        for special in [false, true] {
            let ids = ours.encode(text, special).unwrap();
            assert_eq!(
                ids,
                theirs.encode(text, special).unwrap(),
                "{:?}",
                &text[..text.len().min(60)]
            );
            assert_eq!(ours.decode(&ids).unwrap(), theirs.decode(&ids).unwrap());
        }
    }
    // Ordinary text round-trips through ids.
    for text in &texts[..2] {
        assert_eq!(
            ours.decode(&ours.encode(text, false).unwrap()).unwrap(),
            *text
        );
    }
}

/// Needs Q4_1 in `blocks::dequantize`: the model from the GGUF file alone gives the logits
/// transformers computed on the converted f32 weights.
#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn logits_match_transformers() {
    let golden = load_golden("smollm2-135m");
    let gguf = load_gguf(&gguf_path(), &DenseLoader).unwrap();
    for (case, expected) in golden.cases.iter().zip(&golden.logits) {
        assert_eq!(
            gguf.tokenizer.encode(&case.prompt, true).unwrap(),
            case.input_ids
        );
        let logits = gguf.model.forward(&case.input_ids).unwrap();
        assert_rel_close(
            "SmolLM2 GGUF logits",
            logits.as_slice().unwrap(),
            expected,
            1e-4,
        );
    }
}
