//! `n` choices of one prompt (the OpenAI API's `n`): the prompt is prefilled once, every other
//! choice starts from a fork of its blocks and samples its first token from the same logits row,
//! and each choice's tokens equal that request run alone, with its own seed (its logprobs too,
//! within the rounding that a different batch composition brings: matrix products of another
//! batch size sum in another order).

use ch01::testing::seeded_runner;
use ch01::{Llama, SamplingParams, fixtures_dir};
use ch03::KvPool;
use ch04_continuous_batching::{
    CpuExecutor, Engine, EngineConfig, EngineError, FinishReason, Request, RequestOutput,
};
use proptest::prelude::*;

fn model() -> Llama {
    ch02::load_fast(
        &fixtures_dir().join("shakespeare-tiny"),
        ch02::WeightDtype::F32,
    )
    .unwrap()
}

fn engine(model: &Llama, block_size: usize, config: EngineConfig) -> Engine<'_> {
    let pool = KvPool::<f32>::new(&model.config, block_size, 64).unwrap();
    Engine::new(CpuExecutor::new(model, pool), config).unwrap()
}

/// A sampled request (temperature 1, its own seed) that reports logprobs.
fn sampled(prompt: &[u32], max_tokens: usize, seed: u64) -> Request {
    let mut request = Request::greedy(prompt.to_vec(), max_tokens);
    request.params = SamplingParams {
        temperature: 1.0,
        seed,
        ..SamplingParams::greedy()
    };
    request.logprobs = Some(2);
    request
}

/// Every output of every step, until nothing is left to run.
fn run_all(engine: &mut Engine<'_>) -> Vec<RequestOutput> {
    let mut outputs = Vec::new();
    while engine.has_unfinished() {
        outputs.extend(engine.step_or_stall().unwrap());
    }
    outputs
}

/// Whether two runs of a request agree: the same tokens, logprobs within rounding.
fn same(a: (Vec<u32>, Vec<f32>), b: (Vec<u32>, Vec<f32>)) -> Result<(), String> {
    let close = a.1.len() == b.1.len() && a.1.iter().zip(&b.1).all(|(x, y)| (x - y).abs() < 1e-4);
    if a.0 == b.0 && close {
        Ok(())
    } else {
        Err(format!("{a:?} != {b:?}"))
    }
}

/// One request's tokens and logprobs, gathered from the step outputs.
fn of(outputs: &[RequestOutput], id: u64) -> (Vec<u32>, Vec<f32>) {
    let mine = outputs.iter().filter(|o| o.id == id);
    let tokens = mine.clone().flat_map(|o| o.new_tokens.clone()).collect();
    let logprobs = mine
        .flat_map(|o| o.logprobs.iter().map(|l| l.logprob))
        .collect();
    (tokens, logprobs)
}

#[test]
fn every_choice_equals_its_request_alone_and_the_prompt_runs_once() {
    let model = model();
    let vocab = model.config.vocab_size as u32;
    let cases = (
        proptest::collection::vec(0..vocab, 1..30),
        2usize..6,     // choices
        1usize..8,     // max_tokens
        1usize..=8,    // block size
        2usize..20,    // token budget (chunked prefill)
        any::<bool>(), // prefix caching
    );
    seeded_runner(24, 7)
        .run(
            &cases,
            |(prompt, n, max_tokens, block_size, budget, caching)| {
                let config = EngineConfig {
                    max_num_batched_tokens: budget,
                    enable_prefix_caching: caching,
                    ..EngineConfig::default()
                };
                let mut engine = engine(&model, block_size, config);
                let first = engine.add_request(sampled(&prompt, max_tokens, 0)).unwrap();
                let mut ids = vec![first];
                for seed in 1..n as u64 {
                    let fork = engine.add_fork(first, sampled(&prompt, max_tokens, seed), None);
                    ids.push(fork.unwrap());
                }
                let mut prompt_tokens = 0;
                let mut forked = Vec::new();
                let mut copies = 0;
                let mut outputs = Vec::new();
                while engine.has_unfinished() {
                    outputs.extend(engine.step_or_stall().unwrap());
                    let trace = engine.scheduler().last_step();
                    prompt_tokens += trace
                        .scheduled
                        .iter()
                        .filter(|s| s.2)
                        .map(|s| s.1)
                        .sum::<usize>();
                    forked.extend(trace.forked.iter().copied());
                    copies += trace.copied.len();
                }
                prop_assert_eq!(prompt_tokens, prompt.len(), "the prompt ran once");
                let expected: Vec<_> = ids[1..].iter().map(|&id| (first, id)).collect();
                prop_assert_eq!(forked, expected);
                // A partial last block is shared after the fork: each choice but the last to
                // write there copies it first.
                if prompt.len() % block_size != 0 && max_tokens > 1 {
                    prop_assert!(copies >= n - 1, "{copies} copies for {n} choices");
                }
                prop_assert_eq!(engine.scheduler().kv_usage(), 0.0, "blocks still held");
                for (seed, &id) in ids.iter().enumerate() {
                    let mut alone = self::engine(&model, block_size, config);
                    let lone = alone.add_request(sampled(&prompt, max_tokens, seed as u64));
                    let lone = lone.unwrap();
                    let reference = run_all(&mut alone);
                    same(of(&outputs, id), of(&reference, lone))
                        .map_err(|e| TestCaseError::fail(format!("choice {seed}: {e}")))?;
                }
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn forks_of_an_aborted_prompt_go_on_without_it() {
    let model = model();
    let prompt: Vec<u32> = (1..40).collect();
    let config = EngineConfig {
        max_num_batched_tokens: 8, // the prompt takes five steps
        ..EngineConfig::default()
    };
    let mut engine = engine(&model, 4, config);
    let first = engine.add_request(sampled(&prompt, 5, 0)).unwrap();
    let forks: Vec<_> = (1..4)
        .map(|seed| engine.add_fork(first, sampled(&prompt, 5, seed), None))
        .collect::<Result<_, _>>()
        .unwrap();
    engine.step_or_stall().unwrap(); // the first chunk of the prompt
    assert!(engine.abort(first));
    let outputs = run_all(&mut engine);
    for (seed, &id) in forks.iter().enumerate() {
        let mut alone = self::engine(&model, 4, config);
        let lone = alone
            .add_request(sampled(&prompt, 5, seed as u64 + 1))
            .unwrap();
        let reference = run_all(&mut alone);
        same(of(&outputs, id), of(&reference, lone)).unwrap();
        let finished = outputs.iter().find(|o| o.id == id && o.finished.is_some());
        assert_eq!(finished.unwrap().finished, Some(FinishReason::Length));
    }
    assert_eq!(engine.scheduler().kv_usage(), 0.0);
}

#[test]
fn more_choices_than_max_num_seqs_run_as_requests_of_their_own() {
    let model = model();
    let prompt: Vec<u32> = (1..12).collect();
    let config = EngineConfig {
        max_num_seqs: 2,
        ..EngineConfig::default()
    };
    let mut engine = engine(&model, 4, config);
    let first = engine.add_request(sampled(&prompt, 4, 0)).unwrap();
    let ids: Vec<_> = std::iter::once(first)
        .chain((1..5).map(|seed| {
            engine
                .add_fork(first, sampled(&prompt, 4, seed), None)
                .unwrap()
        }))
        .collect();
    let mut outputs = Vec::new();
    while engine.has_unfinished() {
        outputs.extend(engine.step_or_stall().unwrap());
        let running = engine.scheduler().queue_lengths().1;
        assert!(
            running <= 2,
            "{running} sequences running, max_num_seqs is 2"
        );
    }
    for (seed, &id) in ids.iter().enumerate() {
        let mut alone = self::engine(&model, 4, config);
        let lone = alone.add_request(sampled(&prompt, 4, seed as u64)).unwrap();
        same(of(&outputs, id), of(&run_all(&mut alone), lone)).unwrap();
    }
}

#[test]
fn a_fork_must_have_its_parents_prompt() {
    let model = model();
    let mut engine = engine(&model, 4, EngineConfig::default());
    let first = engine
        .add_request(Request::greedy(vec![1, 2, 3], 4))
        .unwrap();
    let other = engine.add_fork(first, Request::greedy(vec![1, 2], 4), None);
    assert!(matches!(other, Err(EngineError::Config(_))), "{other:?}");
    // A parent past its prompt: the choice runs as a request of its own.
    run_all(&mut engine);
    let late = engine
        .add_fork(first, Request::greedy(vec![1, 2, 3], 4), None)
        .unwrap();
    let outputs = run_all(&mut engine);
    assert_eq!(of(&outputs, late).0.len(), 4);
}

/// Allows one token, and only after `prepare` (as a grammar's mask must be computed first).
struct OnlyToken {
    token: u32,
    prepared: bool,
}

impl ch04_continuous_batching::LogitsProcessor for OnlyToken {
    fn prepare(&mut self) {
        self.prepared = true;
    }

    fn process(&mut self, _output: &[u32], logits: &mut [f32]) {
        assert!(self.prepared, "process before prepare");
        for (i, l) in logits.iter_mut().enumerate() {
            if i as u32 != self.token {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    fn accept(&mut self, token: u32) -> bool {
        assert_eq!(token, self.token);
        self.prepared = false;
        false
    }
}

#[test]
fn each_fork_samples_its_first_token_through_its_own_prepared_processor() {
    let model = model();
    let mut engine = engine(&model, 4, EngineConfig::default());
    let prompt: Vec<u32> = (1..10).collect();
    let only = |token| {
        Box::new(OnlyToken {
            token,
            prepared: false,
        })
    };
    let first = engine
        .add_request_with(sampled(&prompt, 3, 0), only(5))
        .unwrap();
    let forks: Vec<_> = (1..4)
        .map(|seed| {
            let processor = only(5 + seed as u32);
            engine.add_fork(first, sampled(&prompt, 3, seed), Some(processor))
        })
        .collect::<Result<_, _>>()
        .unwrap();
    let outputs = run_all(&mut engine);
    assert_eq!(of(&outputs, first).0, vec![5; 3]);
    for (i, &id) in forks.iter().enumerate() {
        assert_eq!(of(&outputs, id).0, vec![6 + i as u32; 3], "fork {id}");
    }
}

/// A fork whose first token cannot be sampled (its processor masks every token) fails the step,
/// as any sampling error does, and stays for the caller to abort. The forks after it had been
/// given shares of the parent's blocks: they give them back and wait as a request of their own
/// (the last as its fork), so no block leaks, and once the failed requests are aborted they
/// are served, each as it would be alone.
#[test]
fn a_fork_that_cannot_sample_leaks_no_blocks_and_strands_no_later_fork() {
    let model = model();
    let mut engine = engine(&model, 4, EngineConfig::default());
    let prompt: Vec<u32> = (1..10).collect();
    let first = engine.add_request(sampled(&prompt, 3, 0)).unwrap();
    let nothing = Box::new(OnlyToken {
        token: u32::MAX, // outside the vocabulary: every logit is masked
        prepared: false,
    });
    let failing = engine
        .add_fork(first, sampled(&prompt, 3, 1), Some(nothing))
        .unwrap();
    let later: Vec<_> = (2..4)
        .map(|seed| engine.add_fork(first, sampled(&prompt, 3, seed), None))
        .collect::<Result<_, _>>()
        .unwrap();

    let error = engine.step_or_stall().unwrap_err();
    assert!(matches!(error, EngineError::Sampling(_)), "{error}");
    engine.scheduler().check_invariants().unwrap();

    assert!(engine.abort(first));
    assert!(engine.abort(failing));
    let outputs = run_all(&mut engine);
    engine.scheduler().check_invariants().unwrap();
    assert_eq!(engine.scheduler().kv_usage(), 0.0, "every block is back");
    for (&id, seed) in later.iter().zip(2..) {
        let mut alone = self::engine(&model, 4, EngineConfig::default());
        let lone = alone.add_request(sampled(&prompt, 3, seed)).unwrap();
        same(of(&outputs, id), of(&run_all(&mut alone), lone)).unwrap();
    }
}
