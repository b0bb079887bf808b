//! The body of `engine_equals_alone.rs`, over any CPU executor (chapter 7 runs it with its
//! flash attention backend): for random request sets (prompt and output lengths, arrival
//! steps, priorities, aborts, choices forked from the first, `n` in the OpenAI API), random budgets and small block pools that force chunked prefill
//! and both kinds of preemption, every request's greedy output equals generating it alone;
//! every request finishes; aborted requests free their blocks at once; afterwards every block
//! is free or cached. Every step the scheduler hands the executor keeps the executor's
//! contract (see [`Checked`]).

use ch01::testing::seeded_runner;
use ch01::{Llama, fixtures_dir};
use ch02::{CachedSession, ContiguousKvCache};
use ch03::KvPool;
use ch04_continuous_batching::{
    BlockOp, Engine, EngineConfig, Executor, ExecutorError, FinishReason, KvLayout, ModelSpec,
    Preemption, Request, SchedulerOutput, Status,
};
use ndarray::ArrayView2;
use proptest::prelude::*;
use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

/// An executor that checks every step against the [`Executor`] contract before running it:
/// ids in the vocabulary, positions in the context, blocks in the pool and covering every
/// position run, no slot written twice in a step (copy-on-write did its job), logit rows
/// within the tokens, and swaps that pair up (a request is swapped in only after it was
/// swapped out, and at most once).
struct Checked<E> {
    inner: E,
    swapped_out: BTreeSet<u64>,
}

impl<E: Executor + ?Sized> Checked<Box<E>> {
    fn check(&mut self, step: &SchedulerOutput) -> Result<(), String> {
        let (kv, model) = (self.inner.kv_layout(), self.inner.model_spec());
        for op in &step.block_ops {
            match op {
                BlockOp::Copy(copy) => {
                    let ids = [copy.src, copy.dst];
                    if ids.iter().any(|&b| b as usize >= kv.num_blocks) || copy.src == copy.dst {
                        return Err(format!("bad copy {copy:?}"));
                    }
                }
                BlockOp::SwapOut { id, blocks } => {
                    if !self.swapped_out.insert(*id) {
                        return Err(format!("request {id} swapped out twice"));
                    }
                    if blocks.iter().any(|&b| b as usize >= kv.num_blocks) {
                        return Err(format!("swap-out of {id}: block out of range"));
                    }
                }
                BlockOp::SwapIn { id, .. } => {
                    if !self.swapped_out.remove(id) {
                        return Err(format!("request {id} swapped in but never out"));
                    }
                }
            }
        }
        for id in &step.finished {
            self.swapped_out.remove(id);
        }
        let mut written = HashSet::new();
        for seq in &step.seqs {
            let end = seq.start_pos + seq.tokens.len();
            if seq.tokens.is_empty() || end > model.max_model_len {
                return Err(format!("request {}: positions ..{end}", seq.id));
            }
            if seq.tokens.iter().any(|&t| t as usize >= model.vocab_size) {
                return Err(format!("request {}: token outside the vocabulary", seq.id));
            }
            if seq.block_table.len() * kv.block_size < end
                || seq.block_table.iter().any(|&b| b as usize >= kv.num_blocks)
            {
                return Err(format!("request {}: table does not cover ..{end}", seq.id));
            }
            if seq.logit_rows > seq.tokens.len() {
                return Err(format!("request {}: more logit rows than tokens", seq.id));
            }
            for pos in seq.start_pos..end {
                let slot = seq.block_table[pos / kv.block_size] as usize * kv.block_size
                    + pos % kv.block_size;
                if !written.insert(slot) {
                    return Err(format!("slot {slot} written twice in one step"));
                }
            }
        }
        Ok(())
    }
}

impl<E: Executor + Send + ?Sized> Executor for Checked<Box<E>> {
    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }

    fn model_spec(&self) -> ModelSpec {
        self.inner.model_spec()
    }

    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        self.check(step).map_err(ExecutorError)?;
        self.inner.execute(step)
    }
}

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
    /// Aborts the first choice (the others, forks waiting for its prompt, must go on).
    abort_at: Option<usize>,
    /// Choices of this prompt: the first a request, the others forks of it.
    choices: usize,
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
        prop_oneof![3 => Just(1usize), 1 => 2usize..=4],
    )
        .prop_map(
            |(prompt, max_tokens, arrive_at, priority, abort_at, choices)| Arrival {
                prompt,
                max_tokens,
                arrive_at,
                priority,
                abort_at,
                choices,
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

/// The executor under test, for `model`, over `pool` (or, for chapter 8's ranks, as many
/// blocks of the same size as `pool` has).
pub type MakeExecutor<'a> =
    dyn for<'m> Fn(&'m Llama, KvPool<f32>) -> Box<dyn Executor + Send + 'm> + 'a;

/// Runs the scenario with executors made by `make_executor`.
pub fn every_request_equals_generating_it_alone_with(make_executor: &MakeExecutor<'_>) {
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
                // The longest request alone may fill the pool exactly: the engine must serve it
                // however it is preempted or found in the prefix cache.
                let blocks = blocks.max(longest.div_ceil(block_size));
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
                let executor = Checked {
                    inner: make_executor(&model, pool),
                    swapped_out: BTreeSet::new(),
                };
                let mut engine = Engine::new(executor, config).unwrap();
                let mut ids: Vec<Option<Vec<u64>>> = vec![None; arrivals.len()];
                let mut step = 0;
                while ids.iter().any(Option::is_none) || engine.has_unfinished() {
                    for (i, a) in arrivals.iter().enumerate() {
                        if ids[i].is_none() && a.arrive_at <= step {
                            let mut request = Request::greedy(a.prompt.clone(), a.max_tokens);
                            request.priority = a.priority;
                            let first = engine.add_request(request.clone()).unwrap();
                            let mut choices = vec![first];
                            for _ in 1..a.choices {
                                let fork = engine.add_fork(first, request.clone(), None);
                                choices.push(fork.unwrap());
                            }
                            ids[i] = Some(choices);
                        }
                        if let (Some(choices), Some(at)) = (&ids[i], a.abort_at)
                            && at == step
                            && engine.abort(choices[0])
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
                let choices = arrivals
                    .iter()
                    .zip(&ids)
                    .flat_map(|(a, ids)| ids.as_ref().unwrap().iter().map(move |&id| (a, id)));
                for (a, id) in choices {
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
