//! Speculation inside the batched engine: for random request sets (prompt and output lengths,
//! arrival steps, aborts, extra choices of a prompt as the API's `n` asks), random budgets and small block pools that force chunked prefill and
//! both kinds of preemption, with prefix caching on or off, every drafter and k, and
//! speculation paused above a random batch size: every greedy output equals the target alone;
//! after every step the block manager's invariants hold; afterwards no block of the target's
//! cache, nor of a draft model's, is in use.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};

use ch01::testing::seeded_runner;
use ch03::KvPool;
use ch04::{CpuExecutor, Engine, EngineConfig, FinishReason, Preemption, Request, Status};
use ch06_speculative_decoding::testing::{OracleDrafter, RandomDrafter};
use ch06_speculative_decoding::{
    Drafter, ModelDrafter, NgramDrafter, SpecConfig, SpeculativeDecoding, layer_skip_executor,
};
use common::{Checked, alone, load};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Arrival {
    prompt: Vec<u32>,
    max_tokens: usize,
    arrive_at: usize,
    abort_at: Option<usize>,
    /// Extra choices forked from this request's prompt (`n` − 1).
    forks: usize,
}

#[derive(Debug, Clone)]
struct Case {
    arrivals: Vec<Arrival>,
    block_size: usize,
    blocks: usize,
    budget: usize,
    chunked: bool,
    swap: bool,
    caching: bool,
    drafter: usize,
    k: usize,
    disable_above: Option<usize>,
}

fn case(vocab: u32) -> impl Strategy<Value = Case> {
    // Prompts from a small alphabet repeat themselves, so n-gram lookup finds drafts.
    let arrival = (
        proptest::collection::vec(0..vocab.min(12), 1..30),
        1usize..14,
        0usize..6,
        proptest::option::weighted(0.15, 0usize..10),
        prop_oneof![3 => Just(0usize), 1 => 1usize..3],
    )
        .prop_map(|(prompt, max_tokens, arrive_at, abort_at, forks)| Arrival {
            prompt,
            max_tokens,
            arrive_at,
            abort_at,
            forks,
        });
    (
        proptest::collection::vec(arrival, 1..6),
        (1usize..=8, 6usize..40, 1usize..48),
        (any::<bool>(), any::<bool>(), any::<bool>()),
        (0usize..4, 1usize..=6, proptest::option::of(1usize..4)),
    )
        .prop_map(
            |(
                arrivals,
                (block_size, blocks, budget),
                (chunked, swap, caching),
                (drafter, k, disable_above),
            )| {
                Case {
                    arrivals,
                    block_size,
                    blocks,
                    budget,
                    chunked,
                    swap,
                    caching,
                    drafter,
                    k,
                    disable_above,
                }
            },
        )
}

static PREEMPTIONS: AtomicU64 = AtomicU64::new(0);
static ACCEPTED: AtomicU64 = AtomicU64::new(0);

#[test]
fn speculation_in_the_batched_engine_equals_the_target_alone_and_leaks_no_block() {
    let model = load("shakespeare-tiny");
    let vocab = model.config.vocab_size as u32;
    seeded_runner(64, 6)
        .run(&case(vocab), |c| {
            let references: Vec<Vec<u32>> = c
                .arrivals
                .iter()
                .map(|a| alone(&model, &a.prompt, a.max_tokens))
                .collect();
            let longest = c
                .arrivals
                .iter()
                .map(|a| a.prompt.len() + a.max_tokens)
                .max()
                .unwrap();
            let blocks = c.blocks.max(longest.div_ceil(c.block_size) + 1);
            let budget = if c.chunked {
                c.budget
            } else {
                c.budget.max(longest)
            };
            let pool = KvPool::<f32>::new(&model.config, c.block_size, blocks).unwrap();
            let config = EngineConfig {
                max_num_seqs: 4,
                max_num_batched_tokens: budget,
                enable_chunked_prefill: c.chunked,
                watermark: 0.0,
                preemption: if c.swap {
                    Preemption::Swap
                } else {
                    Preemption::Recompute
                },
                enable_prefix_caching: c.caching,
            };
            // The draft model's cache is small too, so that its states are evicted.
            let mut model_drafter = ModelDrafter::new(
                layer_skip_executor(&model, 2, c.block_size, 64 << 10).unwrap(),
                vocab as usize,
            )
            .unwrap();
            let drafter: Box<dyn Drafter> = match c.drafter {
                0 => Box::new(NgramDrafter::new(1, 3).unwrap()),
                1 => Box::new(RandomDrafter::new(vocab as usize, 7, false)),
                2 => Box::new(OracleDrafter::new(
                    c.arrivals
                        .iter()
                        .map(|a| a.prompt.clone())
                        .zip(references.iter().cloned()),
                )),
                _ => Box::new(&mut model_drafter),
            };
            let spec = SpeculativeDecoding::new(
                drafter,
                SpecConfig {
                    num_speculative_tokens: c.k,
                    disable_by_batch_size: c.disable_above,
                },
            );
            let mut engine = Engine::new(Checked(CpuExecutor::new(&model, pool)), config)
                .unwrap()
                .with_speculator(Box::new(spec));
            let mut ids = vec![None; c.arrivals.len()];
            // (arrival, fork): greedy, so each equals its parent's request alone.
            let mut forks = Vec::new();
            let mut step = 0;
            while ids.iter().any(Option::is_none) || engine.has_unfinished() {
                for (i, a) in c.arrivals.iter().enumerate() {
                    if ids[i].is_none() && a.arrive_at <= step {
                        let request = Request::greedy(a.prompt.clone(), a.max_tokens);
                        let id = engine.add_request(request).unwrap();
                        ids[i] = Some(id);
                        for _ in 0..a.forks {
                            let fork = Request::greedy(a.prompt.clone(), a.max_tokens);
                            forks.push((i, engine.add_fork(id, fork, None).unwrap()));
                        }
                    }
                    if let (Some(id), Some(at)) = (ids[i], a.abort_at)
                        && at == step
                    {
                        engine.abort(id);
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
            for ((a, id), reference) in c.arrivals.iter().zip(&ids).zip(&references) {
                let id = id.unwrap();
                let aborted =
                    engine.scheduler().status(id) == Some(Status::Finished(FinishReason::Abort));
                let done = engine.take(id).unwrap();
                if aborted {
                    prop_assert!(reference.starts_with(&done.tokens), "an aborted prefix");
                    continue;
                }
                prop_assert_eq!(done.finish_reason, FinishReason::Length);
                prop_assert_eq!(&done.tokens, reference, "max_tokens {}", a.max_tokens);
            }
            for &(i, id) in &forks {
                let done = engine.take(id).unwrap();
                prop_assert_eq!(done.finish_reason, FinishReason::Length);
                prop_assert_eq!(&done.tokens, &references[i], "a fork of request {}", i);
            }
            prop_assert_eq!(
                engine.scheduler().kv_usage(),
                0.0,
                "target blocks still held"
            );
            let counters = engine.scheduler().counters();
            PREEMPTIONS.fetch_add(counters.preemptions, Ordering::Relaxed);
            ACCEPTED.fetch_add(counters.spec_decode_num_accepted_tokens, Ordering::Relaxed);
            drop(engine);
            prop_assert_eq!(model_drafter.kv_usage(), 0.0, "draft blocks still held");
            model_drafter
                .check_invariants()
                .map_err(TestCaseError::fail)?;
            Ok(())
        })
        .unwrap();
    let (preemptions, accepted) = (
        PREEMPTIONS.load(Ordering::Relaxed),
        ACCEPTED.load(Ordering::Relaxed),
    );
    assert!(
        preemptions > 0 && accepted > 0,
        "preemptions {preemptions}, accepted drafts {accepted}"
    );
}

/// Drafts take only what a step leaves. Four requests of three prompt tokens, a budget of twelve
/// tokens a step (the four prompts at once, then four decodes and eight tokens to spare) and a
/// drafter that always proposes k = 4 tokens: every unfinished request runs in every step, since
/// the first sequences' drafts may not take the budget of those after them.
#[test]
fn drafts_never_crowd_out_another_sequence() {
    let model = load("shakespeare-tiny");
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..4u32).map(|i| vec![1 + i, 2, 3]).collect();
    let pool = KvPool::<f32>::new(&model.config, 4, 64).unwrap();
    let config = EngineConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 12,
        enable_chunked_prefill: true,
        watermark: 0.0,
        preemption: Preemption::Recompute,
        enable_prefix_caching: false,
    };
    let spec = SpeculativeDecoding::new(
        Box::new(RandomDrafter::new(vocab as usize, 3, false)),
        SpecConfig {
            num_speculative_tokens: 4,
            disable_by_batch_size: None,
        },
    );
    let mut engine = Engine::new(Checked(CpuExecutor::new(&model, pool)), config)
        .unwrap()
        .with_speculator(Box::new(spec));
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| engine.add_request(Request::greedy(p.clone(), 12)).unwrap())
        .collect();
    let mut drafted = 0;
    while engine.has_unfinished() {
        let unfinished: Vec<_> = ids
            .iter()
            .filter(|&&id| {
                let status = engine.scheduler().status(id);
                matches!(status, Some(Status::Running | Status::Waiting))
            })
            .copied()
            .collect();
        engine.step_or_stall().unwrap();
        let trace = engine.scheduler().last_step();
        for id in unfinished {
            assert!(
                trace.scheduled.iter().any(|s| s.0 == id),
                "request {id} was not scheduled: {:?}",
                trace.scheduled
            );
        }
        drafted += trace.speculated.len();
    }
    assert!(drafted > 0, "no step carried drafts");
    for (prompt, id) in prompts.iter().zip(ids) {
        assert_eq!(engine.take(id).unwrap().tokens, alone(&model, prompt, 12));
    }
}
