//! Requests and configurations the engine cannot serve are refused with a typed error at once,
//! never admitted to stall later.

use ch01::{Llama, fixtures_dir};
use ch03::{KvPool, PagedKv};
use ch04_continuous_batching::{Engine, EngineConfig, EngineError, Request};

fn engine(model: &Llama, blocks: usize, config: EngineConfig) -> Result<Engine<'_>, EngineError> {
    let pool = KvPool::new(&model.config, 4, blocks).unwrap();
    Engine::new(model, PagedKv::new(pool, false), config)
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

    let unchunked = EngineConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: 16,
        ..EngineConfig::default()
    };
    let mut unchunked = engine(&model, 64, unchunked).unwrap();
    let error = unchunked
        .add_request(Request::greedy(vec![1; 12], 8))
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
            .add_request(Request::greedy(vec![1; 12], 4))
            .is_ok()
    );
    assert!(!unchunked.has_unfinished() || unchunked.step_or_stall().is_ok());
}
