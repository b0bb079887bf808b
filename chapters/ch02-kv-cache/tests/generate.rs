//! Generation with the cache gives exactly chapter 1's tokens, greedy and seeded.

use ch01::{GenerateOptions, Llama, SamplingParams, Tokenizer, fixtures_dir, generate};
use ch02_kv_cache::{ContiguousKvCache, KvStore, generate_cached};

#[test]
fn cached_generation_equals_recompute_generation() {
    for name in ["random/qwen2", "shakespeare-tiny", "shakespeare-small"] {
        let dir = fixtures_dir().join(name);
        let (model, tokenizer) = (
            Llama::load(&dir).unwrap(),
            Tokenizer::from_dir(&dir).unwrap(),
        );
        let prompt = tokenizer
            .encode("KING.\nWhat say you, my lord?", true)
            .unwrap();
        for sampling in [
            SamplingParams::greedy(),
            SamplingParams {
                temperature: 0.9,
                top_k: 40,
                top_p: 0.95,
                seed: 17,
                ..SamplingParams::default()
            },
        ] {
            let options = GenerateOptions {
                max_tokens: 40,
                sampling,
                ignore_eos: true,
                ..GenerateOptions::default()
            };
            let recomputed = generate(&model, &tokenizer, &prompt, &options, &mut |_| {}).unwrap();
            let mut cache = ContiguousKvCache::for_max_len(&model.config);
            let mut streamed = String::new();
            let cached = generate_cached(
                &model,
                &tokenizer,
                &prompt,
                &mut cache,
                &options,
                &mut |t| streamed.push_str(t),
            )
            .unwrap();
            assert_eq!(cached.output_tokens, recomputed.output_tokens, "{name}");
            assert_eq!(cached.text, streamed);
        }
    }
}

#[test]
fn cached_generation_matches_the_golden_greedy_continuation() {
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures_dir().join("golden/shakespeare-small.json")).unwrap(),
    )
    .unwrap();
    let dir = fixtures_dir().join("shakespeare-small");
    let (model, tokenizer) = (
        Llama::load(&dir).unwrap(),
        Tokenizer::from_dir(&dir).unwrap(),
    );
    for case in golden["cases"].as_array().unwrap() {
        let ids = |key: &str| -> Vec<u32> {
            case[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        };
        let options = GenerateOptions {
            max_tokens: 32,
            ignore_eos: true,
            ..GenerateOptions::default()
        };
        let mut cache = ContiguousKvCache::for_max_len(&model.config);
        let generation = generate_cached(
            &model,
            &tokenizer,
            &ids("input_ids"),
            &mut cache,
            &options,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(generation.output_tokens, ids("greedy_ids"));
    }
}

#[test]
fn prompts_over_the_context_are_rejected_before_anything_runs() {
    let dir = fixtures_dir().join("random/gqa");
    let (model, tokenizer) = (
        Llama::load(&dir).unwrap(),
        Tokenizer::from_dir(&dir).unwrap(),
    );
    let prompt = vec![5u32; model.config.max_position_embeddings + 1];
    let mut cache = ContiguousKvCache::for_max_len(&model.config);
    let error = generate_cached(
        &model,
        &tokenizer,
        &prompt,
        &mut cache,
        &GenerateOptions::default(),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(
        error.to_string().contains("exceeds the model's context"),
        "{error}"
    );
    assert!(cache.is_empty());
}
