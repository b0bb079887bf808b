//! The static batcher (the benchmark's baseline) computes the same tokens as the continuous
//! engine, and hence as generating each request alone: greedy and seeded, with early stops
//! (padding), batches limited by size or by free blocks. It admits nothing while a batch runs,
//! counts its padded rows, and gives every block back.

use std::cell::Cell;
use std::time::Duration;

use ch01::{Llama, SamplingParams, fixtures_dir};
use ch03::KvPool;
use ch04::{CpuExecutor, Engine, EngineConfig, FinishReason, Request};

use super::{Arrival, Clock, StaticBatcher, WallClock};

fn model() -> Llama {
    Llama::load(&fixtures_dir().join("shakespeare-tiny")).unwrap()
}

/// Prompts of several lengths and requests with several `max_tokens`; every third request
/// stops at a token the model is known to produce (found by a first engine run), so batches
/// hold sequences that finish early.
fn requests(model: &Llama, sampled: bool) -> Vec<Request> {
    let vocab = model.config.vocab_size as u32;
    let mut requests: Vec<Request> = (0..9u32)
        .map(|i| {
            let prompt = (0..(3 + 5 * i))
                .map(|t| (t * 37 + 11 * i + 5) % vocab)
                .collect();
            let mut request = Request::greedy(prompt, 2 + (i as usize * 7) % 13);
            if sampled {
                request.params = SamplingParams {
                    temperature: 0.8,
                    top_k: 50,
                    seed: 1000 + u64::from(i),
                    ..SamplingParams::default()
                };
            }
            request
        })
        .collect();
    let first = engine(model, 64).generate(requests.clone()).unwrap();
    for (i, request) in requests.iter_mut().enumerate() {
        if i % 3 == 0 && first[i].tokens.len() > 2 {
            request.stop_token_ids = vec![first[i].tokens[1]];
        }
    }
    requests
}

fn engine(model: &Llama, blocks: usize) -> Engine<'_> {
    let pool = KvPool::<f32>::new(&model.config, 4, blocks).unwrap();
    let config = EngineConfig {
        max_num_batched_tokens: 24,
        ..EngineConfig::default()
    };
    Engine::new(CpuExecutor::new(model, pool), config).unwrap()
}

fn at_zero(requests: &[Request]) -> Vec<Arrival> {
    requests
        .iter()
        .map(|r| Arrival {
            at: Duration::ZERO,
            request: r.clone(),
        })
        .collect()
}

fn assert_all_blocks_free(batcher: &StaticBatcher) {
    let manager = batcher.manager();
    assert_eq!(
        manager.num_free_blocks(),
        manager.num_blocks(),
        "blocks held"
    );
    manager.check_invariants(&[]).unwrap();
}

#[test]
fn static_batches_equal_the_continuous_engine() {
    let model = model();
    for sampled in [false, true] {
        let requests = requests(&model, sampled);
        let expected = engine(&model, 64).generate(requests.clone()).unwrap();
        assert!(
            expected
                .iter()
                .any(|c| c.finish_reason == FinishReason::Stop),
            "some request stops early"
        );
        // Batch sizes 1 (sequential), 3, all; then a pool that holds only a few requests.
        for (batch_size, blocks) in [(1, 64), (3, 64), (9, 64), (9, 16)] {
            let pool = KvPool::<f32>::new(&model.config, 4, blocks).unwrap();
            let mut batcher =
                StaticBatcher::new(CpuExecutor::new(&model, pool), batch_size).unwrap();
            let served = batcher
                .run(&at_zero(&requests), &WallClock::start())
                .unwrap();
            for (i, (got, want)) in served.iter().zip(&expected).enumerate() {
                let case =
                    format!("request {i}, batch {batch_size}, {blocks} blocks, sampled {sampled}");
                assert_eq!(got.tokens, want.tokens, "{case}");
                assert_eq!(got.finish_reason, want.finish_reason, "{case}");
                assert_eq!(got.token_times.len(), got.tokens.len(), "{case}");
                assert!(got.token_times.windows(2).all(|w| w[0] <= w[1]), "{case}");
            }
            assert_all_blocks_free(&batcher);
        }
    }
}

/// A clock that advances one millisecond every time it is read, and jumps when asked to wait.
struct TickClock(Cell<Duration>);

impl Clock for TickClock {
    fn now(&self) -> Duration {
        let t = self.0.get() + Duration::from_millis(1);
        self.0.set(t);
        t
    }

    fn sleep_until(&self, t: Duration) {
        if t > self.0.get() {
            self.0.set(t);
        }
    }
}

#[test]
fn nothing_joins_a_running_batch_and_finished_rows_are_padding() {
    let model = model();
    let pool = KvPool::<f32>::new(&model.config, 4, 64).unwrap();
    let mut batcher = StaticBatcher::new(CpuExecutor::new(&model, pool), 4).unwrap();
    let prompt: Vec<u32> = vec![0, 412, 306, 13, 534];
    let arrivals = [
        (0, Request::greedy(prompt.clone(), 10)),
        (0, Request::greedy(prompt.clone(), 3)),
        (2, Request::greedy(prompt.clone(), 4)), // arrives while the first batch runs
    ]
    .map(|(ms, request)| Arrival {
        at: Duration::from_millis(ms),
        request,
    });
    let served = batcher
        .run(&arrivals, &TickClock(Cell::new(Duration::ZERO)))
        .unwrap();
    let lens: Vec<usize> = served.iter().map(|s| s.tokens.len()).collect();
    assert_eq!(lens, [10, 3, 4]);
    // The third request starts only after the first batch's longest sequence is done.
    assert!(served[2].token_times[0] > served[0].token_times[9]);
    let stats = batcher.stats();
    assert_eq!(stats.batches, 2);
    assert_eq!(stats.steps, 10 + 4); // a prefill and 9 decodes; a prefill and 3 decodes
    assert_eq!(stats.useful_rows, 9 + 2 + 3);
    assert_eq!(stats.padded_rows, 9 - 2); // the second request idles for 7 decode steps
    assert_all_blocks_free(&batcher);
}

#[test]
fn a_request_that_can_never_fit_is_refused() {
    let model = model();
    let pool = KvPool::<f32>::new(&model.config, 4, 2).unwrap();
    let mut batcher = StaticBatcher::new(CpuExecutor::new(&model, pool), 4).unwrap();
    let too_long = at_zero(&[Request::greedy(vec![1, 2, 3], 6)]); // 9 positions > 8
    assert!(batcher.run(&too_long, &WallClock::start()).is_err());
    let pool = KvPool::<f32>::new(&model.config, 4, 8).unwrap();
    assert!(StaticBatcher::new(CpuExecutor::new(&model, pool), 0).is_err());
}
