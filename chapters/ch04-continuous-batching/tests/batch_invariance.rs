//! Seeded sampling is batch-invariant: a request with a given seed produces the same tokens
//! whether it runs alone or among other requests that come and go. (Its logits may differ in
//! the last bits: a lone row runs the matrix-vector kernel, a batched row the matrix-matrix
//! one, which sum in another order; a draw within that rounding of a token boundary could
//! differ, and these seeds meet none.)

use ch01::{SamplingParams, fixtures_dir};
use ch03::KvPool;
use ch04_continuous_batching::{CpuExecutor, Engine, EngineConfig, Request};

fn sampled(prompt: Vec<u32>, seed: u64) -> Request {
    let mut request = Request::greedy(prompt, 24);
    request.params = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed,
        ..SamplingParams::default()
    };
    request
}

#[test]
fn the_same_seed_gives_the_same_tokens_in_any_batch() {
    // Chapter 2's fast layers, as the binary runs them.
    let model = ch02::load_fast(
        &fixtures_dir().join("shakespeare-tiny"),
        ch02::WeightDtype::F32,
    )
    .unwrap();
    let engine = || {
        let pool = KvPool::<f32>::new(&model.config, 8, 64).unwrap();
        let config = EngineConfig {
            max_num_batched_tokens: 32,
            enable_prefix_caching: true,
            ..EngineConfig::default()
        };
        Engine::new(CpuExecutor::new(&model, pool), config).unwrap()
    };
    let prompt: Vec<u32> = vec![0, 412, 306, 13, 534, 325, 291, 306, 13, 330];
    for seed in [1, 7, 42] {
        let alone = engine()
            .generate(vec![sampled(prompt.clone(), seed)])
            .unwrap();

        let mut crowd = engine();
        let mut others: Vec<_> = (0..5u32)
            .map(|i| {
                sampled(
                    (0..(5 + 7 * i)).map(|t| (t * 31 + i) % 4096).collect(),
                    100 + i as u64,
                )
            })
            .collect();
        others.insert(2, sampled(prompt.clone(), seed));
        let together = crowd.generate(others).unwrap();
        assert_eq!(together[2].tokens, alone[0].tokens, "seed {seed}");
    }
}

/// Sampling a step's sequences on several threads (`presample`) gives every request the same
/// tokens and logprobs as sampling them one after another: each has its own row and its own
/// seeded sampler.
#[test]
fn sampling_across_threads_equals_sampling_in_turn() {
    let model = ch02::load_fast(
        &fixtures_dir().join("shakespeare-tiny"),
        ch02::WeightDtype::F32,
    )
    .unwrap();
    let requests: Vec<Request> = (0..9u32)
        .map(|i| {
            let prompt = (0..(3 + 5 * i)).map(|t| (t * 29 + i) % 4096).collect();
            let mut request = match i % 3 {
                0 => Request::greedy(prompt, 12),
                _ => sampled(prompt, 1000 + i as u64),
            };
            request.logprobs = (i % 2 == 0).then_some(3);
            request
        })
        .collect();
    let run = |parallel: bool| {
        ch02::elementwise::set_parallel_elementwise(parallel);
        let pool = KvPool::<f32>::new(&model.config, 8, 128).unwrap();
        let mut engine =
            Engine::new(CpuExecutor::new(&model, pool), EngineConfig::default()).unwrap();
        for request in &requests {
            engine.add_request(request.clone()).unwrap();
        }
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        let mut outputs = Vec::new();
        threads.install(|| {
            while engine.has_unfinished() {
                outputs.extend(engine.step().unwrap());
            }
        });
        ch02::elementwise::set_parallel_elementwise(true);
        outputs
    };
    let (serial, threaded) = (run(false), run(true));
    assert!(serial.iter().any(|o| !o.logprobs.is_empty()));
    assert_eq!(serial, threaded);
}
