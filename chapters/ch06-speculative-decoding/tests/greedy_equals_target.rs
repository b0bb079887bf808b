//! Greedy speculative decoding equals the target alone, token for token, whatever drafts:
//! n-gram lookup, the tiny model drafting for the small one, the small one's first layers, an
//! adversary's random tokens and an oracle's right ones; for several k, and with a draft model
//! that catches up a few tokens a step. Afterwards every KV block of the target's cache and of
//! the draft model's is free.

mod common;

use ch03::KvPool;
use ch04::{Counters, CpuExecutor, Engine, EngineConfig, Request};
use ch06_speculative_decoding::testing::{OracleDrafter, RandomDrafter};
use ch06_speculative_decoding::{
    Drafter, ModelDrafter, NgramDrafter, SpecConfig, SpeculativeDecoding, draft_executor,
    layer_skip_executor,
};
use common::{Checked, alone, load, prompts};

const MAX_TOKENS: usize = 24;

/// Every prompt at once through a speculative engine; checks each output against the target
/// alone and that no target block is left in use. Returns the engine's counters.
fn run(target: &ch01::Llama, drafter: impl Drafter, k: usize, expected: &[Vec<u32>]) -> Counters {
    let pool = KvPool::<f32>::new(&target.config, 4, 200).unwrap();
    let config = EngineConfig {
        max_num_batched_tokens: 64,
        ..EngineConfig::default()
    };
    let spec = SpeculativeDecoding::new(
        drafter,
        SpecConfig {
            num_speculative_tokens: k,
            disable_by_batch_size: None,
        },
    );
    let mut engine = Engine::new(Checked(CpuExecutor::new(target, pool)), config)
        .unwrap()
        .with_speculator(Box::new(spec));
    let requests = prompts()
        .into_iter()
        .map(|p| Request::greedy(p, MAX_TOKENS))
        .collect();
    let done = engine.generate(requests).unwrap();
    for (i, (done, expected)) in done.iter().zip(expected).enumerate() {
        assert_eq!(&done.tokens, expected, "prompt {i}, k = {k}");
    }
    assert_eq!(
        engine.scheduler().kv_usage(),
        0.0,
        "target blocks still held"
    );
    engine.scheduler().check_invariants().unwrap();
    engine.scheduler().counters()
}

fn expected(target: &ch01::Llama) -> Vec<Vec<u32>> {
    prompts()
        .iter()
        .map(|p| alone(target, p, MAX_TOKENS))
        .collect()
}

#[test]
fn ngram_lookup_equals_the_target_alone() {
    let target = load("shakespeare-small");
    let expected = expected(&target);
    for k in [1, 3, 5] {
        let c = run(&target, NgramDrafter::new(1, 3).unwrap(), k, &expected);
        assert!(c.spec_decode_num_drafts > 0, "k = {k}: no drafts proposed");
    }
}

#[test]
fn a_draft_model_equals_the_target_alone_and_frees_its_own_blocks() {
    let target = load("shakespeare-small");
    let draft = load("shakespeare-tiny");
    let expected = expected(&target);
    for k in [1, 4] {
        let executor = draft_executor(&draft, 4, 4 << 20).unwrap();
        let mut drafter = ModelDrafter::new(executor, target.config.vocab_size).unwrap();
        let c = run(&target, &mut drafter, k, &expected);
        assert!(
            c.spec_decode_num_accepted_tokens > 0,
            "k = {k}: nothing accepted"
        );
        assert_eq!(drafter.kv_usage(), 0.0, "draft blocks still held");
        drafter.check_invariants().unwrap();
    }
    // Catching up a few tokens a step: the prompts take several steps before drafting.
    let executor = draft_executor(&draft, 4, 4 << 20).unwrap();
    let drafter = ModelDrafter::new(executor, target.config.vocab_size)
        .unwrap()
        .with_catch_up_budget(5);
    let c = run(&target, drafter, 3, &expected);
    assert!(c.spec_decode_num_accepted_tokens > 0, "nothing accepted");
}

#[test]
fn layer_skipping_equals_the_target_alone() {
    let target = load("shakespeare-small");
    let expected = expected(&target);
    let executor = layer_skip_executor(&target, 3, 4, 4 << 20).unwrap();
    let mut drafter = ModelDrafter::new(executor, target.config.vocab_size).unwrap();
    let c = run(&target, &mut drafter, 3, &expected);
    assert!(c.spec_decode_num_drafts > 0);
    assert_eq!(drafter.kv_usage(), 0.0, "draft blocks still held");
}

#[test]
fn an_adversary_changes_nothing_and_an_oracle_is_always_accepted() {
    let target = load("shakespeare-small");
    let expected = expected(&target);
    let vocab = target.config.vocab_size;
    let c = run(&target, RandomDrafter::new(vocab, 1, false), 4, &expected);
    assert!(c.spec_decode_num_draft_tokens > 0);
    let oracle = OracleDrafter::new(prompts().into_iter().zip(expected.iter().cloned()));
    let c = run(&target, oracle, 4, &expected);
    assert_eq!(
        c.spec_decode_num_accepted_tokens, c.spec_decode_num_draft_tokens,
        "the oracle is always right"
    );
    // Each verification yields k + 1 tokens: far fewer steps than tokens.
    assert!(c.steps < (MAX_TOKENS / 2) as u64, "{c:?}");
}
