//! [`StaticBatcher`]: static (request-level) batching, kept **only as the baseline** that
//! `kiln bench ch04` measures continuous batching against (it lives with the benchmark, not in
//! chapter 4's crate). It is a second client of chapter 4's executor seam: it plans its own
//! steps and runs them on the same [`Executor`].
//!
//! A static batcher decides the batch once per *batch*, not once per step:
//!
//! ```text
//! wait:     until at least one request has arrived
//! admit:    up to batch_size arrived requests, FCFS, each reserving blocks for
//!           prompt + max_tokens up front (as systems without paging reserve)
//! prefill:  every prompt in one batched forward
//! decode:   one token per sequence per step, until the LONGEST one finishes;
//!           a finished sequence keeps its slot and keeps computing (padding waste)
//! release:  free every block; only now is the next batch admitted
//! ```
//!
//! Two costs follow, and chapter 4's engine removes both:
//!
//! - **padding waste**: a sequence that finished early (a stop token, a small `max_tokens`)
//!   still occupies its row in every step until the batch's longest sequence is done. Here it
//!   re-runs its last computed position each step, logits included, and the result is thrown
//!   away: the same work a padded tensor row costs. [`StaticStats::padded_rows`] counts them.
//! - **head-of-line blocking**: a request that arrives while a batch runs waits for the whole
//!   batch to finish, however short the batch's other requests are.
//!
//! Prompts of different lengths need no padding in the prefill: the [`Executor`] runs a
//! flattened batch and gives every token its own position. The batcher plans its own steps
//! (a [`SchedulerOutput`] per forward) over its own [`BlockManager`], sized from the executor's
//! KV layout, and registers nothing in the prefix cache (a static system has none).
//! Every request samples with its own seeded [`Sampler`], as in the engine, so greedy and
//! seeded outputs equal the engine's.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ch01::Sampler;
use ch03::{BlockManager, BlockTable};

use ch04::{
    BlockOp, EngineError, Executor, FinishReason, ModelSpec, Request, ScheduledSeq, SchedulerOutput,
};

#[cfg(test)]
mod tests;

/// Time since the start of a run, and a way to wait for a later one. The benchmark uses
/// [`WallClock`]; the engine's drivers take the same trait.
pub trait Clock {
    /// Time since the run started.
    fn now(&self) -> Duration;
    /// Returns once `now() >= t`.
    fn sleep_until(&self, t: Duration);
}

/// Real time, from the moment of [`WallClock::start`].
#[derive(Debug, Clone, Copy)]
pub struct WallClock(Instant);

impl WallClock {
    pub fn start() -> Self {
        WallClock(Instant::now())
    }
}

impl Clock for WallClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }

    fn sleep_until(&self, t: Duration) {
        let now = self.now();
        if t > now {
            std::thread::sleep(t - now);
        }
    }
}

/// A request and the time it reaches the server.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at: Duration,
    pub request: Request,
}

/// How one request was served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// When it arrived (copied from its [`Arrival`]).
    pub arrival: Duration,
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// When each token was sampled (the end of the step that produced it).
    pub token_times: Vec<Duration>,
    pub finish_reason: FinishReason,
}

/// What the batcher did, for the benchmark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StaticStats {
    pub batches: u64,
    /// Forward passes (a batch's prefill counts as one).
    pub steps: u64,
    /// Decode rows that produced a token someone wanted.
    pub useful_rows: u64,
    /// Decode rows of finished sequences, computed and thrown away.
    pub padded_rows: u64,
}

/// One batch member.
struct Slot {
    index: usize, // into the run's arrivals
    tokens: Vec<u32>,
    prompt_len: usize,
    table: BlockTable,
    sampler: Sampler,
    token_times: Vec<Duration>,
    finished: Option<FinishReason>,
}

impl Slot {
    /// Positions that hold K/V: all but the last sampled token (the prompt, before the prefill).
    fn computed(&self) -> usize {
        if self.tokens.len() == self.prompt_len {
            self.table.num_tokens()
        } else {
            self.tokens.len() - 1
        }
    }
}

/// The static batcher over one executor.
pub struct StaticBatcher<'e> {
    executor: Box<dyn Executor + Send + 'e>,
    model: ModelSpec,
    manager: BlockManager,
    batch_size: usize,
    stats: StaticStats,
}

impl<'e> StaticBatcher<'e> {
    pub fn new(
        executor: impl Executor + Send + 'e,
        batch_size: usize,
    ) -> Result<Self, EngineError> {
        if batch_size == 0 {
            return Err(EngineError::Config("batch_size must be at least 1".into()));
        }
        let kv = executor.kv_layout();
        Ok(StaticBatcher {
            model: executor.model_spec(),
            manager: BlockManager::new(kv.num_blocks, kv.block_size, false),
            executor: Box::new(executor),
            batch_size,
            stats: StaticStats::default(),
        })
    }

    pub fn stats(&self) -> StaticStats {
        self.stats
    }

    /// The blocks (every one is free again after [`run`](Self::run)).
    #[cfg(test)]
    pub fn manager(&self) -> &BlockManager {
        &self.manager
    }

    /// Positions a request reserves: its whole possible length, within the context.
    fn reservation(&self, request: &Request) -> usize {
        (request.prompt.len() + request.max_tokens).min(self.model.max_model_len)
    }

    /// Serves `arrivals` (in any order; FCFS by arrival time, ties in list order) on `clock`
    /// and returns how each was served, in the order given. Checks every request first.
    pub fn run(
        &mut self,
        arrivals: &[Arrival],
        clock: &dyn Clock,
    ) -> Result<Vec<Served>, EngineError> {
        let bs = self.manager.block_size();
        let capacity = self.manager.num_blocks() * bs;
        for a in arrivals {
            self.model.check_tokens(&a.request.prompt)?;
            a.request.params.validate()?;
            let needed = self.reservation(&a.request);
            if needed > capacity {
                return Err(EngineError::TooLong { needed, capacity });
            }
        }
        let mut order: Vec<usize> = (0..arrivals.len()).collect();
        order.sort_by_key(|&i| arrivals[i].at); // stable: ties keep list order
        let mut queue: VecDeque<usize> = order.into();
        let mut served: Vec<Option<Served>> = vec![None; arrivals.len()];

        while let Some(&first) = queue.front() {
            clock.sleep_until(arrivals[first].at);
            // Admit: arrived requests, FCFS, while the batch and the blocks allow.
            let now = clock.now();
            let mut slots = Vec::new();
            let mut copies = Vec::new();
            while let Some(&i) = queue.front() {
                let request = &arrivals[i].request;
                if slots.len() == self.batch_size || arrivals[i].at > now {
                    break;
                }
                let needed = self.reservation(request).div_ceil(bs);
                if needed > self.manager.num_free_blocks() {
                    break; // never for the first: it fits in the empty pool (checked above)
                }
                let mut table = self
                    .manager
                    .allocate_prompt(&request.prompt)
                    .expect("enough free blocks");
                let rest = self.reservation(request) - table.num_tokens();
                if let Some(copy) = self.manager.reserve(&mut table, rest).expect("fits") {
                    copies.push(BlockOp::Copy(copy));
                }
                slots.push(Slot {
                    index: i,
                    tokens: request.prompt.clone(),
                    prompt_len: request.prompt.len(),
                    table,
                    sampler: Sampler::new(request.params.clone())?,
                    token_times: Vec::new(),
                    finished: None,
                });
                queue.pop_front();
            }
            self.run_batch(&mut slots, copies, arrivals, clock)?;
            for slot in slots {
                self.manager.free(slot.table);
                served[slot.index] = Some(Served {
                    arrival: arrivals[slot.index].at,
                    tokens: slot.tokens[slot.prompt_len..].to_vec(),
                    token_times: slot.token_times,
                    finish_reason: slot.finished.expect("the batch ran to the end"),
                });
            }
        }
        Ok(served
            .into_iter()
            .map(|s| s.expect("every request served"))
            .collect())
    }

    // ANCHOR: run_batch
    /// Prefills the batch in one forward, then decodes until every sequence has finished; the
    /// finished ones keep computing (their rows are the padding waste).
    fn run_batch(
        &mut self,
        slots: &mut [Slot],
        mut block_ops: Vec<BlockOp>,
        arrivals: &[Arrival],
        clock: &dyn Clock,
    ) -> Result<(), EngineError> {
        self.stats.batches += 1;
        let max_len = self.model.max_model_len;
        let mut prefill = true;
        while prefill || slots.iter().any(|s| s.finished.is_none()) {
            let step = SchedulerOutput {
                seqs: slots
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let (start, end) = match s.finished {
                            None => (s.computed(), s.tokens.len()), // the prompt, or the last token
                            Some(_) => (s.computed() - 1, s.computed()), // padding: re-run a position
                        };
                        ScheduledSeq {
                            id: i as u64,
                            tokens: s.tokens[start..end].to_vec(),
                            start_pos: start,
                            block_table: s.table.blocks().to_vec(),
                            logit_rows: 1, // a padded row costs the output head too
                        }
                    })
                    .collect(),
                block_ops: std::mem::take(&mut block_ops),
                finished: Vec::new(),
            };
            let logits = self.executor.execute(&step)?; // [slots, vocab]
            let now = clock.now();
            self.stats.steps += 1;
            for (slot, row) in slots.iter_mut().zip(logits.rows()) {
                if slot.finished.is_some() {
                    self.stats.padded_rows += 1;
                    continue; // thrown away
                }
                if !prefill {
                    self.stats.useful_rows += 1;
                }
                let request = &arrivals[slot.index].request;
                let (prompt, output) = slot.tokens.split_at(slot.prompt_len);
                let token =
                    slot.sampler
                        .sample(row.as_slice().expect("contiguous"), prompt, output)?;
                slot.tokens.push(token);
                slot.token_times.push(now);
                let generated = slot.tokens.len() - slot.prompt_len;
                slot.finished = if !request.ignore_eos && request.stop_token_ids.contains(&token) {
                    Some(FinishReason::Stop)
                } else if generated >= request.max_tokens || slot.tokens.len() >= max_len {
                    Some(FinishReason::Length)
                } else {
                    None
                };
            }
            prefill = false;
        }
        Ok(())
    }
    // ANCHOR_END: run_batch
}
