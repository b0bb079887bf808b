//! Requests and configurations the engine cannot serve are refused with a typed error at once,
//! never admitted to stall later.

use ch01::{Llama, fixtures_dir};
use ch03::KvPool;
use ch04_continuous_batching::{
    CpuExecutor, Engine, EngineConfig, EngineError, Executor, ExecutorError, KvLayout, ModelSpec,
    Preemption, Request, SchedulerOutput, Status,
};

fn engine(model: &Llama, blocks: usize, config: EngineConfig) -> Result<Engine<'_>, EngineError> {
    let pool = KvPool::<f32>::new(&model.config, 4, blocks).unwrap();
    Engine::new(CpuExecutor::new(model, pool), config)
}

#[test]
fn unservable_requests_and_configurations_are_refused() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let bad = EngineConfig {
        max_num_seqs: 0,
        ..EngineConfig::default()
    };
    assert!(matches!(
        engine(&model, 8, bad),
        Err(EngineError::Config(_))
    ));
    let bad = EngineConfig {
        watermark: 1.0,
        ..EngineConfig::default()
    };
    assert!(matches!(
        engine(&model, 8, bad),
        Err(EngineError::Config(_))
    ));

    let mut small = engine(
        &model,
        8,
        EngineConfig {
            watermark: 0.0,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let error = small
        .add_request(Request::greedy(vec![1; 20], 20))
        .unwrap_err();
    assert!(
        matches!(
            error,
            EngineError::TooLong {
                needed: 40,
                capacity: 32
            }
        ),
        "{error}"
    );
    let error = small
        .add_request(Request::greedy(Vec::new(), 4))
        .unwrap_err();
    assert!(matches!(error, EngineError::Model(_)), "{error}");

    // Unchunked, one step must hold a prompt, and when preemption recomputes, the prompt and
    // all but the last of its outputs: 12 + 9 - 1 = 20 > 16 tokens.
    let unchunked = EngineConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: 16,
        ..EngineConfig::default()
    };
    let mut unchunked = engine(&model, 64, unchunked).unwrap();
    let error = unchunked
        .add_request(Request::greedy(vec![1; 12], 9))
        .unwrap_err();
    assert!(
        matches!(
            error,
            EngineError::OverBudget {
                needed: 20,
                budget: 16
            }
        ),
        "{error}"
    );
    assert!(
        unchunked
            .add_request(Request::greedy(vec![1; 12], 5))
            .is_ok(),
        "12 + 5 - 1 = 16 tokens fit"
    );
    // Preempted by swapping, a request never reruns its output: only the prompt must fit.
    let swapping = EngineConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: 16,
        preemption: Preemption::Swap,
        ..EngineConfig::default()
    };
    let mut swapping = engine(&model, 64, swapping).unwrap();
    assert!(
        swapping
            .add_request(Request::greedy(vec![1; 16], 9))
            .is_ok()
    );
    let error = swapping
        .add_request(Request::greedy(vec![1; 17], 1))
        .unwrap_err();
    assert!(
        matches!(
            error,
            EngineError::OverBudget {
                needed: 17,
                budget: 16
            }
        ),
        "{error}"
    );
}

#[test]
fn a_request_that_fits_one_unchunked_step_is_served() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let unchunked = EngineConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: 16,
        ..EngineConfig::default()
    };
    let mut unchunked = engine(&model, 64, unchunked).unwrap();
    unchunked
        .add_request(Request::greedy(vec![1; 12], 5))
        .unwrap();
    while unchunked.has_unfinished() {
        unchunked.step_or_stall().unwrap();
    }
}

/// An engine with prefix caching and no watermark over `blocks` blocks of 4.
fn caching_engine(model: &Llama, blocks: usize) -> Engine<'_> {
    let config = EngineConfig {
        watermark: 0.0,
        enable_prefix_caching: true,
        ..EngineConfig::default()
    };
    engine(model, blocks, config).unwrap()
}

/// A waiting request whose prompt starts with blocks a running request holds needs free blocks
/// only for the rest: with 14 blocks of 4, a running request holding 11 and 3 free, a second
/// request with the same 40-token prefix (10 cached blocks) and 2 tokens more is admitted at
/// once, and shares them.
#[test]
fn a_prefix_that_a_running_request_holds_costs_no_free_blocks_at_admission() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let mut engine = caching_engine(&model, 14);
    let prefix: Vec<u32> = (1..=40).collect();
    let a = engine
        .add_request(Request::greedy(prefix.clone(), 3))
        .unwrap();
    engine.step_or_stall().unwrap(); // A's prompt: 10 blocks, cached once full
    let mut longer = prefix.clone();
    longer.extend([41, 42]);
    let b = engine.add_request(Request::greedy(longer, 2)).unwrap();
    engine.step_or_stall().unwrap();
    assert_eq!(engine.scheduler().status(a), Some(Status::Running));
    assert_eq!(
        engine.scheduler().status(b),
        Some(Status::Running),
        "admitted beside A"
    );
    assert_eq!(engine.scheduler().prefix_stats().hit_blocks, 10);
    while engine.has_unfinished() {
        engine.step_or_stall().unwrap();
    }
    assert_eq!(engine.scheduler().kv_usage(), 0.0);
}

/// An executor that records which requests each step tells it to forget.
struct Recording<E> {
    inner: E,
    finished: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
}

impl<E: Executor> Executor for Recording<E> {
    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }
    fn model_spec(&self) -> ModelSpec {
        self.inner.model_spec()
    }
    fn execute(
        &mut self,
        step: &SchedulerOutput,
    ) -> Result<ndarray::ArrayView2<'_, f32>, ExecutorError> {
        self.finished.lock().unwrap().extend(&step.finished);
        self.inner.execute(step)
    }
}

/// A swapped-out request aborted when nothing else is left still reaches the executor, which
/// drops its copy outside the pool: the engine has that step to run, not an idle wait for the
/// next request.
#[test]
fn an_aborted_swapped_request_is_dropped_even_when_nothing_else_runs() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let finished = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let executor = Recording {
        inner: CpuExecutor::new(&model, KvPool::<f32>::new(&model.config, 4, 6).unwrap()),
        finished: std::sync::Arc::clone(&finished),
    };
    let config = EngineConfig {
        watermark: 0.0,
        preemption: Preemption::Swap,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(executor, config).unwrap();
    let a = engine.add_request(Request::greedy(vec![1; 6], 12)).unwrap();
    let b = engine.add_request(Request::greedy(vec![2; 6], 12)).unwrap();
    // 6 blocks of 4 hold both prompts (2 blocks each) but not both outputs: one is swapped out.
    let swapped = loop {
        engine.step_or_stall().unwrap();
        if let Some(id) = [a, b]
            .into_iter()
            .find(|&id| engine.scheduler().status(id) == Some(Status::Swapped))
        {
            break id;
        }
        assert!(engine.has_unfinished(), "nothing was swapped out");
    };
    engine.abort(a);
    engine.abort(b);
    assert!(engine.has_unfinished(), "the swapped copy is still to drop");
    engine.step_or_stall().unwrap();
    assert!(!engine.has_unfinished());
    assert!(finished.lock().unwrap().contains(&swapped));
}

/// A prompt whose every block is a cache hit recomputes its last position into a private copy
/// of the last block: admission counts that block. With none free, the second request waits
/// rather than being admitted and preempted again, step after step.
#[test]
fn a_full_prefix_hit_waits_for_the_block_its_last_position_copies() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    // 3 blocks of 4: A's 8-token prompt and its next 4 tokens, nothing more.
    let mut engine = caching_engine(&model, 3);
    let prompt: Vec<u32> = (1..=8).collect();
    engine
        .add_request(Request::greedy(prompt.clone(), 4))
        .unwrap();
    engine.step_or_stall().unwrap();
    engine.step_or_stall().unwrap(); // A's first decode takes the third block
    engine.add_request(Request::greedy(prompt, 4)).unwrap();
    while engine.has_unfinished() {
        engine.step_or_stall().unwrap();
    }
    assert_eq!(engine.scheduler().counters().preemptions, 0);
}

/// `max_tokens` = 0 is refused: the step that computes a prompt always samples a token, so
/// the engine would return one that was not asked for. A fork is checked the same way.
#[test]
fn a_request_for_no_tokens_is_refused() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let mut engine = engine(&model, 8, EngineConfig::default()).unwrap();
    let error = engine
        .add_request(Request::greedy(vec![1, 2, 3], 0))
        .unwrap_err();
    assert!(matches!(error, EngineError::ZeroMaxTokens), "{error}");
    let first = engine
        .add_request(Request::greedy(vec![1, 2, 3], 2))
        .unwrap();
    let error = engine
        .add_fork(first, Request::greedy(vec![1, 2, 3], 0), None)
        .unwrap_err();
    assert!(matches!(error, EngineError::ZeroMaxTokens), "{error}");
}

/// An absurd `max_tokens` saturates instead of wrapping around: the request needs the whole
/// context, which a small pool, or an unchunked step budget, cannot hold.
#[test]
fn a_huge_max_tokens_is_refused_not_wrapped_around() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let max_len = model.config.max_position_embeddings; // 512
    let config = EngineConfig {
        watermark: 0.0,
        ..EngineConfig::default()
    };
    let mut small = engine(&model, 8, config).unwrap();
    for max_tokens in [usize::MAX, usize::MAX - 2] {
        let error = small
            .add_request(Request::greedy(vec![1; 4], max_tokens))
            .unwrap_err();
        assert!(
            matches!(error, EngineError::TooLong { needed, capacity: 32 } if needed == max_len),
            "{error}"
        );
    }

    let unchunked = EngineConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: 16,
        ..EngineConfig::default()
    };
    assert_eq!(
        unchunked.unchunked_step_tokens(4, usize::MAX),
        Some(usize::MAX)
    );
    // 200 blocks of 4 hold the whole context: only the step budget refuses it.
    let mut unchunked = engine(&model, 200, unchunked).unwrap();
    let error = unchunked
        .add_request(Request::greedy(vec![1; 4], usize::MAX))
        .unwrap_err();
    assert!(
        matches!(error, EngineError::OverBudget { needed, budget: 16 } if needed == max_len),
        "{error}"
    );
}

/// `generate` queues nothing when one of its requests is refused: the ones before it do not
/// linger in the engine (unfinished, never taken) to run with the caller's next requests.
#[test]
fn generate_queues_nothing_when_one_request_is_refused() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let config = EngineConfig {
        watermark: 0.0,
        ..EngineConfig::default()
    };
    let mut engine = engine(&model, 8, config).unwrap();
    let fits = Request::greedy(vec![1, 2, 3], 4);
    let error = engine
        .generate(vec![fits.clone(), Request::greedy(vec![1; 20], 20)])
        .unwrap_err();
    assert!(matches!(error, EngineError::TooLong { .. }), "{error}");
    assert!(!engine.has_unfinished());
    assert_eq!(engine.scheduler().sequences().count(), 0);
    let done = engine.generate(vec![fits]).unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].tokens.len(), 4);
}

/// The executor under test with a shorter context: `max_model_len` positions.
struct ShortContext<E> {
    inner: E,
    max_model_len: usize,
}

impl<E: Executor> Executor for ShortContext<E> {
    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }
    fn model_spec(&self) -> ModelSpec {
        ModelSpec {
            max_model_len: self.max_model_len,
            ..self.inner.model_spec()
        }
    }
    fn execute(
        &mut self,
        step: &SchedulerOutput,
    ) -> Result<ndarray::ArrayView2<'_, f32>, ExecutorError> {
        self.inner.execute(step)
    }
}

/// An engine with a 12-token context over `blocks` blocks of 4, no watermark, prefix caching
/// on or off.
fn twelve_token_engine(model: &Llama, blocks: usize, caching: bool) -> Engine<'_> {
    let executor = ShortContext {
        inner: CpuExecutor::new(model, KvPool::<f32>::new(&model.config, 4, blocks).unwrap()),
        max_model_len: 12,
    };
    let config = EngineConfig {
        watermark: 0.0,
        enable_prefix_caching: caching,
        ..EngineConfig::default()
    };
    Engine::new(executor, config).unwrap()
}

/// A prompt found whole in the prefix cache computes its last position again into a copy of
/// its last block, while the cached one is held: one block more than the prompt's. With a
/// 12-token context and 3 blocks of 4, a 12-token prompt fits the pool exactly, so with prefix
/// caching the second time it is asked it could never be admitted: it is refused up front (and
/// served, twice, without prefix caching or with one block more).
#[test]
fn a_prompt_that_fills_the_pool_is_refused_when_a_full_prefix_hit_could_not_be_admitted() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let prompt: Vec<u32> = (1..=12).collect();
    for (blocks, caching, served) in [(3, true, false), (3, false, true), (4, true, true)] {
        let mut engine = twelve_token_engine(&model, blocks, caching);
        let request = Request::greedy(prompt.clone(), 1);
        if !served {
            let error = engine.add_request(request).unwrap_err();
            assert!(
                matches!(
                    error,
                    EngineError::TooLong {
                        needed: 13,
                        capacity: 12
                    }
                ),
                "{error}"
            );
            continue;
        }
        for _ in 0..2 {
            let done = engine.generate(vec![request.clone()]).unwrap();
            assert_eq!(
                done[0].tokens.len(),
                1,
                "{blocks} blocks, caching {caching}"
            );
        }
        let hits = engine.scheduler().prefix_stats().hit_blocks;
        assert_eq!(
            hits,
            if caching { 3 } else { 0 },
            "the second is a full hit"
        );
    }
}

/// Task 4.1's part of the test above, the check alone: with prefix caching a 12-token prompt
/// in a pool of exactly 12 positions is refused when it is added (it needs 13), without it the
/// same request is accepted.
#[test]
fn a_prompt_that_fills_the_pool_alone_is_refused_with_prefix_caching() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let prompt: Vec<u32> = (1..=12).collect();
    for caching in [true, false] {
        let mut engine = twelve_token_engine(&model, 3, caching);
        let added = engine.add_request(Request::greedy(prompt.clone(), 1));
        match caching {
            true => assert!(
                matches!(
                    added,
                    Err(EngineError::TooLong {
                        needed: 13,
                        capacity: 12
                    })
                ),
                "{added:?}"
            ),
            false => assert!(added.is_ok(), "{added:?}"),
        }
    }
}

/// One request that fills the pool exactly (4 blocks of 4: a 4-token prompt and 12 tokens),
/// with prefix caching on, preempted for a request of higher priority just after its third
/// block filled (and was cached), is readmitted once that request is done and ends as it would
/// alone. Swapped out, its 12 computed positions are copied back or found in the cache; none
/// is computed again, so it needs its 3 blocks and its next token's, 4, never the copy of a
/// last block that a recomputed prompt makes.
#[test]
fn a_request_that_fills_the_pool_comes_back_after_preemption_with_prefix_caching() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let mut a = Request::greedy(vec![1, 2, 3, 4], 12);
    a.priority = 1;
    let b = Request::greedy(vec![5], 4); // priority 0: runs first
    for preemption in [Preemption::Swap, Preemption::Recompute] {
        let config = EngineConfig {
            watermark: 0.0,
            preemption,
            enable_prefix_caching: true,
            ..EngineConfig::default()
        };
        let alone = engine(&model, 4, config)
            .unwrap()
            .generate(vec![a.clone()])
            .unwrap();
        let mut engine = engine(&model, 4, config).unwrap();
        let a_id = engine.add_request(a.clone()).unwrap();
        let computed = |engine: &Engine<'_>| {
            let mut seqs = engine.scheduler().sequences();
            seqs.find(|s| s.id == a_id).unwrap().num_computed
        };
        // A's 11 positions fill 3 blocks but the last slot, which its next token takes.
        while computed(&engine) < 11 {
            engine.step_or_stall().unwrap();
        }
        let b_id = engine.add_request(b.clone()).unwrap();
        let mut swapped = false;
        while engine.has_unfinished() {
            engine
                .step_or_stall()
                .unwrap_or_else(|e| panic!("{preemption:?}: {e}"));
            engine.scheduler().check_invariants().unwrap();
            swapped |= engine.scheduler().status(a_id) == Some(Status::Swapped);
        }
        assert_eq!(
            engine.scheduler().counters().preemptions,
            1,
            "{preemption:?}"
        );
        assert_eq!(swapped, preemption == Preemption::Swap);
        assert_eq!(engine.take(a_id).unwrap().tokens, alone[0].tokens);
        assert_eq!(engine.take(b_id).unwrap().tokens.len(), 4);
        assert_eq!(engine.scheduler().kv_usage(), 0.0);
    }
}
