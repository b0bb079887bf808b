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
