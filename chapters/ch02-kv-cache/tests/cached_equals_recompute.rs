//! Cached == recomputed: for random prompts, random prefill chunkings and random numbers of
//! decode steps, every logit row the cached path produces equals chapter 1's full recompute
//! (f32: relative L2 error under 1e-5), for every fixture model shape.

use ch01::testing::assert_rel_close;
use ch01::testing::seeded_runner;
use ch01::{Llama, fixtures_dir};
use ch02_kv_cache::{ContiguousKvCache, KvError, KvStore, forward_cached};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

fn runner(cases: u32) -> TestRunner {
    seeded_runner(cases, 2)
}

/// Tokens, and the sizes of the chunks they are fed in (the first chunk is the "prefill").
fn sequence(vocab: u32) -> impl Strategy<Value = (Vec<u32>, Vec<usize>)> {
    (1usize..48)
        .prop_flat_map(move |prompt_len| {
            (
                proptest::collection::vec(0..vocab, prompt_len + 12),
                Just(prompt_len),
                0usize..12,
                1usize..=prompt_len,
            )
        })
        .prop_map(|(tokens, prompt_len, decode_steps, first_chunk)| {
            // Prompt as two chunks (a chunked prefill), then one token per decode step.
            let mut chunks = vec![first_chunk];
            if prompt_len > first_chunk {
                chunks.push(prompt_len - first_chunk);
            }
            chunks.extend(std::iter::repeat_n(1, decode_steps));
            let total = prompt_len + decode_steps;
            (tokens[..total].to_vec(), chunks)
        })
}

fn check_model(name: &str, cases: u32) {
    let model = Llama::load(&fixtures_dir().join(name)).unwrap();
    let vocab = model.config.vocab_size as u32;
    runner(cases)
        .run(&sequence(vocab), |(tokens, chunks)| {
            let full = model.forward(&tokens).unwrap(); // [T, vocab], chapter 1
            let mut cache = ContiguousKvCache::new(&model.config, tokens.len());
            let mut pos = 0;
            for n in chunks {
                let logits = forward_cached(&model, &tokens[pos..pos + n], &mut cache).unwrap(); // [n, vocab]
                for (i, row) in logits.rows().into_iter().enumerate() {
                    let expected = full.row(pos + i);
                    // Another attention kernel and summation order: equal within f32 rounding.
                    assert_rel_close(
                        &format!("{name}: position {} (chunk of {n} at {pos})", pos + i),
                        row.as_slice().unwrap(),
                        expected.as_slice().unwrap(),
                        1e-5,
                    );
                }
                pos += n;
                prop_assert_eq!(cache.len(), pos);
            }
            Ok(())
        })
        .unwrap();
}

macro_rules! cached_tests {
    ($($test:ident => ($name:literal, $cases:literal)),* $(,)?) => {
        $(#[test] fn $test() { check_model($name, $cases); })*
    };
}

cached_tests! {
    mha => ("random/mha", 24),
    gqa => ("random/gqa", 24),
    head_dim => ("random/head-dim", 24),
    untied => ("random/untied", 24),
    qwen2_bias => ("random/qwen2", 24),
    llama3_rope => ("random/llama3-rope", 24),
    sharded => ("random/sharded", 12),
    bf16 => ("random/bf16", 12),
    shakespeare_tiny => ("shakespeare-tiny", 8),
    shakespeare_small => ("shakespeare-small", 4),
}

#[test]
fn a_full_cache_is_a_typed_error_and_keeps_its_contents() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let mut cache = ContiguousKvCache::new(&model.config, 4);
    forward_cached(&model, &[0, 5, 6], &mut cache).unwrap();
    let error = forward_cached(&model, &[7, 8], &mut cache).unwrap_err();
    assert!(
        matches!(
            error,
            ch02_kv_cache::Error::Kv(KvError::CacheFull {
                needed: 5,
                capacity: 4
            })
        ),
        "{error}"
    );
    assert_eq!(cache.len(), 3);
    forward_cached(&model, &[7], &mut cache).unwrap();
    assert_eq!(cache.len(), 4);
}

/// A write that does not append (a position before or after the stored ones) is a typed
/// error and changes nothing: the cache goes on from where it was.
#[test]
fn a_write_that_does_not_append_is_a_typed_error_and_changes_nothing() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let mut cache = ContiguousKvCache::new(&model.config, 8);
    forward_cached(&model, &[0, 5, 6], &mut cache).unwrap();
    let kv_dim = model.config.num_key_value_heads * model.config.head_dim;
    let rows = ndarray::Array2::<f32>::ones((1, kv_dim));
    for start_pos in [2, 4] {
        let error = cache
            .write(0, start_pos, rows.view(), rows.view())
            .unwrap_err();
        assert!(
            matches!(error, KvError::NotAppending { start_pos: s, len: 3 } if s == start_pos),
            "{error}"
        );
    }
    assert_eq!(cache.len(), 3);
    let mut fresh = ContiguousKvCache::new(&model.config, 8);
    let expected = forward_cached(&model, &[0, 5, 6, 7], &mut fresh).unwrap();
    let logits = forward_cached(&model, &[7], &mut cache).unwrap();
    assert_rel_close(
        "the next token after the refused writes",
        logits.as_slice().unwrap(),
        &expected.as_slice().unwrap()[expected.len() - logits.len()..],
        1e-5,
    );
}

#[test]
fn the_model_context_limit_still_applies() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let max_len = model.config.max_position_embeddings;
    let mut cache = ContiguousKvCache::new(&model.config, max_len + 8);
    forward_cached(&model, &vec![3; max_len], &mut cache).unwrap();
    let error = forward_cached(&model, &[3], &mut cache).unwrap_err();
    assert!(
        error
            .to_string()
            .contains(&format!("context of {max_len} tokens")),
        "{error}"
    );
}

#[test]
fn contiguous_cache_reserves_memory_for_the_whole_context() {
    let model = Llama::load(&fixtures_dir().join("shakespeare-small")).unwrap();
    let c = &model.config;
    let cache = ContiguousKvCache::for_max_len(c);
    // 2 (K and V) × layers × max_len × kv_heads × head_dim × 4 bytes
    let expected = 2
        * c.num_hidden_layers
        * c.max_position_embeddings
        * c.num_key_value_heads
        * c.head_dim
        * 4;
    assert_eq!(cache.reserved_bytes(), expected);
    assert_eq!(
        ContiguousKvCache::bytes_for(c, c.max_position_embeddings),
        expected as u64
    );
    assert_eq!(cache.capacity(), Some(c.max_position_embeddings));
}
