//! Continuous batching changes when tokens are computed, never which: for random request sets
//! (prompt and output lengths, arrival steps, priorities, aborts), random budgets and small
//! block pools that force chunked prefill and both kinds of preemption, every request's greedy
//! output equals generating it alone; every request finishes; aborted requests free their
//! blocks at once; afterwards every block is free or cached.

use ch01::testing::seeded_runner;
use ch01::{Llama, fixtures_dir};
use ch02::{CachedSession, ContiguousKvCache};
use ch03::KvPool;
use ch04_continuous_batching::{
    CpuExecutor, Engine, EngineConfig, FinishReason, Preemption, Request, Status,
};
use proptest::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// Over all cases: preemptions and steps that ran a prompt chunk, so that the test is known to
/// exercise both.
static PREEMPTIONS: AtomicU64 = AtomicU64::new(0);
static SWAPS: AtomicU64 = AtomicU64::new(0);

/// Greedy generation of one request alone, on chapter 2's contiguous cache.
fn alone(model: &Llama, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let cache = ContiguousKvCache::new(&model.config, prompt.len() + max_tokens + 1);
    let mut session = CachedSession::new(model, cache);
    let argmax = |logits: ndarray::ArrayView1<f32>| {
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 { (i, v) } else { best }
            })
            .0 as u32
    };
    let mut out = vec![argmax(session.prefill(prompt).unwrap())];
    while out.len() < max_tokens {
        let next = argmax(session.decode(*out.last().unwrap()).unwrap());
        out.push(next);
    }
    out
}

#[derive(Debug, Clone)]
struct Arrival {
    prompt: Vec<u32>,
    max_tokens: usize,
    arrive_at: usize,
    priority: i32,
    abort_at: Option<usize>,
}

fn scenario(
    vocab: u32,
) -> impl Strategy<Value = (Vec<Arrival>, usize, usize, usize, bool, bool, bool)> {
    let arrival = (
        proptest::collection::vec(0..vocab, 1..40),
        1usize..12,
        0usize..8,
        0i32..3,
        proptest::option::weighted(0.15, 0usize..10),
    )
        .prop_map(
            |(prompt, max_tokens, arrive_at, priority, abort_at)| Arrival {
                prompt,
                max_tokens,
                arrive_at,
                priority,
                abort_at,
            },
        );
    (
        proptest::collection::vec(arrival, 1..7),
        1usize..=8,    // block size
        6usize..40,    // blocks
        1usize..64,    // token budget
        any::<bool>(), // chunked prefill
        any::<bool>(), // swap (else recompute)
        any::<bool>(), // prefix caching
    )
}

#[test]
fn every_request_equals_generating_it_alone() {
    // Chapter 2's fast layers, as the binary runs them (matmul for batches, matvec alone).
    let model = ch02::load_fast(
        &fixtures_dir().join("shakespeare-tiny"),
        ch02::WeightDtype::F32,
    )
    .unwrap();
    let vocab = model.config.vocab_size as u32;
    seeded_runner(48, 43)
        .run(
            &scenario(vocab),
            |(arrivals, block_size, blocks, budget, chunked, swap, caching)| {
                let longest = arrivals
                    .iter()
                    .map(|a| a.prompt.len() + a.max_tokens)
                    .max()
                    .unwrap();
                let blocks = blocks.max(longest.div_ceil(block_size) + 1);
                let budget = if chunked { budget } else { budget.max(longest) };
                let pool = KvPool::<f32>::new(&model.config, block_size, blocks).unwrap();
                let config = EngineConfig {
                    max_num_seqs: 4,
                    max_num_batched_tokens: budget,
                    enable_chunked_prefill: chunked,
                    watermark: 0.0,
                    preemption: if swap {
                        Preemption::Swap
                    } else {
                        Preemption::Recompute
                    },
                    enable_prefix_caching: caching,
                };
                let mut engine = Engine::new(CpuExecutor::new(&model, pool), config).unwrap();
                let mut ids = vec![None; arrivals.len()];
                let mut step = 0;
                while ids.iter().any(Option::is_none) || engine.has_unfinished() {
                    for (i, a) in arrivals.iter().enumerate() {
                        if ids[i].is_none() && a.arrive_at <= step {
                            let mut request = Request::greedy(a.prompt.clone(), a.max_tokens);
                            request.priority = a.priority;
                            ids[i] = Some(engine.add_request(request).unwrap());
                        }
                        if let (Some(id), Some(at)) = (ids[i], a.abort_at)
                            && at == step
                            && engine.abort(id)
                        {
                            engine
                                .scheduler()
                                .check_invariants()
                                .map_err(TestCaseError::fail)?;
                        }
                    }
                    engine
                        .step_or_stall()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    engine
                        .scheduler()
                        .check_invariants()
                        .map_err(TestCaseError::fail)?;
                    step += 1;
                    prop_assert!(step < 2000, "no progress");
                }
                for (a, id) in arrivals.iter().zip(&ids) {
                    let id = id.unwrap();
                    let aborted = engine.scheduler().status(id)
                        == Some(Status::Finished(FinishReason::Abort));
                    let done = engine.take(id).unwrap();
                    if aborted {
                        continue;
                    }
                    prop_assert_eq!(done.finish_reason, FinishReason::Length);
                    prop_assert_eq!(
                        &done.tokens,
                        &alone(&model, &a.prompt, a.max_tokens),
                        "request {}",
                        id
                    );
                }
                prop_assert_eq!(engine.scheduler().kv_usage(), 0.0, "blocks still held");
                let preemptions = engine.scheduler().counters().preemptions;
                PREEMPTIONS.fetch_add(preemptions, Ordering::Relaxed);
                if swap {
                    SWAPS.fetch_add(preemptions, Ordering::Relaxed);
                }
                Ok(())
            },
        )
        .unwrap();
    let (all, swaps) = (
        PREEMPTIONS.load(Ordering::Relaxed),
        SWAPS.load(Ordering::Relaxed),
    );
    assert!(
        swaps > 0 && all > swaps,
        "preemptions: {all} in all, {swaps} by swapping"
    );
}
