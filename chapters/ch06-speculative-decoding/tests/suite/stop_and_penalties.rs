//! Requests that are not plain greedy through the speculative engine: a stop token among the
//! drafts ends the request at it (finish reason Stop, no block left), and greedy decoding with a
//! repetition penalty gives what the engine without speculation gives, whatever drafts.

use crate::common;

use ch01::{Llama, SamplingParams};
use ch03::KvPool;
use ch04::{Completion, Counters, CpuExecutor, Engine, EngineConfig, FinishReason, Request};
use ch06_speculative_decoding::testing::{OracleDrafter, RandomDrafter};
use ch06_speculative_decoding::{
    Drafter, ModelDrafter, NgramDrafter, SpecConfig, SpeculativeDecoding, draft_executor,
};
use common::{Checked, alone, load, prompts};

const MAX_TOKENS: usize = 24;

/// `requests` through an engine, speculating with `drafter` (k = 4) if there is one. Checks
/// that no target block is left; returns the completions and the counters.
fn run(
    target: &Llama,
    drafter: Option<Box<dyn Drafter + '_>>,
    requests: Vec<Request>,
) -> (Vec<Completion>, Counters) {
    let pool = KvPool::<f32>::new(&target.config, 4, 200).unwrap();
    let mut engine = Engine::new(
        Checked(CpuExecutor::new(target, pool)),
        EngineConfig::default(),
    )
    .unwrap();
    if let Some(drafter) = drafter {
        let config = SpecConfig {
            num_speculative_tokens: 4,
            disable_by_batch_size: None,
        };
        engine = engine.with_speculator(Box::new(SpeculativeDecoding::new(drafter, config)));
    }
    let done = engine.generate(requests).unwrap();
    assert_eq!(
        engine.scheduler().kv_usage(),
        0.0,
        "target blocks still held"
    );
    engine.scheduler().check_invariants().unwrap();
    let counters = engine.scheduler().counters();
    (done, counters)
}

#[test]
fn a_stop_token_among_the_drafts_ends_the_request_at_it() {
    let target = load("shakespeare-small");
    let prompt = prompts()[0].clone();
    let reference = alone(&target, &prompt, MAX_TOKENS);
    // The stop token: the first new token of the output at a draft position followed by
    // another draft (the prefill emits token 0; each decode step 4 drafts and a fifth token).
    let at = (1..MAX_TOKENS)
        .find(|&i| (1..=3).contains(&(i % 5)) && !reference[..i].contains(&reference[i]))
        .unwrap();
    let stop = reference[at];
    let oracle = OracleDrafter::new([(prompt.clone(), reference.clone())]);
    let request = Request {
        stop_token_ids: vec![stop],
        ..Request::greedy(prompt, MAX_TOKENS)
    };
    let (done, counters) = run(&target, Some(Box::new(oracle)), vec![request.clone()]);
    assert_eq!(done[0].tokens, reference[..=at], "cut at the stop token");
    assert_eq!(done[0].finish_reason, FinishReason::Stop);
    assert!(counters.spec_decode_num_accepted_tokens > 0);
    let (plain, _) = run(&target, None, vec![request]);
    assert_eq!(done, plain, "as without speculation");
}

#[test]
fn greedy_with_a_repetition_penalty_equals_the_engine_without_speculation() {
    let target = load("shakespeare-small");
    let draft = load("shakespeare-tiny");
    let vocab = target.config.vocab_size;
    let requests: Vec<Request> = prompts()
        .into_iter()
        .map(|p| Request {
            params: SamplingParams {
                repetition_penalty: 1.3,
                ..SamplingParams::greedy()
            },
            ..Request::greedy(p, MAX_TOKENS)
        })
        .collect();
    let (expected, _) = run(&target, None, requests.clone());
    let unpenalised: Vec<Vec<u32>> = prompts()
        .iter()
        .map(|p| alone(&target, p, MAX_TOKENS))
        .collect();
    assert!(
        expected
            .iter()
            .zip(&unpenalised)
            .any(|(e, u)| e.tokens != *u),
        "the penalty changes some output"
    );
    // An oracle that knows the unpenalised outputs is often wrong: the penalty decides.
    let oracle = OracleDrafter::new(prompts().into_iter().zip(unpenalised));
    // One that knows the penalised outputs is always right: the penalties see its drafts.
    let right = expected.iter().map(|c| c.tokens.clone());
    let (done, counters) = run(
        &target,
        Some(Box::new(OracleDrafter::new(
            prompts().into_iter().zip(right),
        ))),
        requests.clone(),
    );
    assert_eq!(done, expected, "the right oracle");
    assert_eq!(
        counters.spec_decode_num_accepted_tokens,
        counters.spec_decode_num_draft_tokens
    );
    let executor = draft_executor(&draft, 4, 4 << 20).unwrap();
    let drafters: Vec<Box<dyn Drafter>> = vec![
        Box::new(NgramDrafter::new(1, 3).unwrap()),
        Box::new(RandomDrafter::new(vocab, 5, false)),
        Box::new(oracle),
        Box::new(ModelDrafter::new(executor, vocab).unwrap()),
    ];
    for (i, drafter) in drafters.into_iter().enumerate() {
        let (done, counters) = run(&target, Some(drafter), requests.clone());
        assert_eq!(done, expected, "drafter {i}");
        assert!(counters.spec_decode_num_draft_tokens > 0, "drafter {i}");
    }
}
