//! Serving a workload in wall-clock time, and what a run measures.
//!
//! ```text
//! driver loop (continuous):  add every request whose arrival time has passed
//!                            engine has work?  one step, stamp each new token with the time
//!                            else              sleep until the next arrival
//! static baseline:           StaticBatcher::run, same arrivals, same clock
//! ```
//! A request that arrives during a step waits for the step to end, as in a real server.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::time::Duration;

use super::static_batch::{Arrival, Clock, Served};
use ch01::Llama;
use ch03::{KvElement, KvPool};
use ch04::{
    CpuExecutor, Engine, EngineClient, EngineConfig, FinishReason, RequestId, RequestOutput,
};
use ch07::AttentionKind;

/// What a run served, in the order of its arrivals, and how full its steps were.
pub struct Run {
    pub served: Vec<Served>,
    /// Mean over forward passes of the sequences in each (a static batch's finished
    /// sequences included).
    pub seqs_per_step: f64,
}

/// Serves `arrivals` with chapter 4's engine over `pool`, attention by `attention`.
pub fn continuous<K: KvElement>(
    model: &Llama,
    pool: KvPool<K>,
    config: EngineConfig,
    attention: AttentionKind,
    arrivals: &[Arrival],
    clock: &dyn Clock,
) -> anyhow::Result<Run> {
    let executor = CpuExecutor::with_backend(model, pool, attention.backend::<K>());
    let mut engine = Engine::new(executor, config)?;
    let mut order: Vec<usize> = (0..arrivals.len()).collect();
    order.sort_by_key(|&i| arrivals[i].at);
    let mut workload = Workload {
        arrivals,
        order,
        next: 0,
        clock,
        served: arrivals
            .iter()
            .map(|a| Served {
                arrival: a.at,
                tokens: Vec::new(),
                token_times: Vec::new(),
                finish_reason: FinishReason::Abort, // until it finishes
            })
            .collect(),
        index: HashMap::new(),
        seqs_in_steps: 0,
        error: None,
    };
    ch04::drive(&mut engine, &mut workload)?;
    if let Some(error) = workload.error {
        return Err(error.into());
    }
    let scheduler = engine.scheduler();
    scheduler.check_invariants().map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        scheduler.kv_usage() == 0.0,
        "the engine kept blocks after the run"
    );
    Ok(Run {
        served: workload.served,
        seqs_per_step: workload.seqs_in_steps as f64 / scheduler.counters().steps as f64,
    })
}

/// A timed workload as chapter 4's engine loop sees it.
///
/// ```text
/// poll:     add every request whose arrival time has passed
///           nothing to run?  sleep until the next arrival (none left: the run is over)
/// on_step:  stamp each new token with the time
/// ```
/// A request that arrives during a step waits for the step to end, as in a real server.
struct Workload<'a> {
    arrivals: &'a [Arrival],
    /// Indices into `arrivals`, by arrival time; `order[next..]` have not arrived yet.
    order: Vec<usize>,
    next: usize,
    clock: &'a dyn Clock,
    served: Vec<Served>,
    /// Engine id → index into `arrivals`.
    index: HashMap<RequestId, usize>,
    seqs_in_steps: usize,
    error: Option<ch04::EngineError>,
}

impl EngineClient for Workload<'_> {
    fn poll(&mut self, engine: &mut Engine<'_>) -> ControlFlow<()> {
        loop {
            let now = self.clock.now();
            while let Some(&i) = self.order.get(self.next)
                && self.arrivals[i].at <= now
            {
                match engine.add_request(self.arrivals[i].request.clone()) {
                    Ok(id) => self.index.insert(id, i),
                    Err(error) => {
                        self.error = Some(error);
                        return ControlFlow::Break(());
                    }
                };
                self.next += 1;
            }
            if engine.has_unfinished() {
                return ControlFlow::Continue(());
            }
            match self.order.get(self.next) {
                Some(&i) => self.clock.sleep_until(self.arrivals[i].at),
                None => return ControlFlow::Break(()),
            }
        }
    }

    fn on_step(&mut self, engine: &mut Engine<'_>, outputs: Vec<RequestOutput>) {
        let t = self.clock.now();
        self.seqs_in_steps += engine.scheduler().last_step().scheduled.len();
        for out in outputs {
            let s = &mut self.served[self.index[&out.id]];
            s.token_times
                .extend(std::iter::repeat_n(t, out.new_tokens.len()));
            s.tokens.extend(out.new_tokens);
            if let Some(reason) = out.finished {
                s.finish_reason = reason;
            }
        }
    }
}

/// The median, the 99th percentile and the largest of some values (seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Self {
        Spread {
            p50: percentile(values, 50.0),
            p99: percentile(values, 99.0),
            max: percentile(values, 100.0),
        }
    }
}

/// The `q`-th percentile (0..=100) of `values`, interpolating linearly between the two nearest
/// ranks (numpy's default): rank `q / 100 × (n − 1)` of the sorted values. NaN if empty.
pub fn percentile(values: &[f64], q: f64) -> f64 {
    assert!((0.0..=100.0).contains(&q), "percentile {q} outside 0..=100");
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = q / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// What one run measured. Times in seconds from the first arrival.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub requests: usize,
    pub output_tokens: usize,
    /// From the first arrival to the last token.
    pub makespan: f64,
    /// Output tokens per second of makespan.
    pub throughput: f64,
    /// Time to first token: arrival → first token.
    pub ttft: Spread,
    /// Time per output token after the first, per request: (last − first) / (n − 1).
    pub tpot: Spread,
    /// Inter-token latency: every gap between two consecutive tokens of a request.
    pub itl: Spread,
    /// End-to-end latency: arrival → last token.
    pub e2e: Spread,
    pub seqs_per_step: f64,
}

pub fn summarize(run: &Run) -> Summary {
    let served = &run.served;
    let secs = |d: Duration| d.as_secs_f64();
    let first = served.iter().map(|s| s.arrival).min().unwrap_or_default();
    let last = served
        .iter()
        .filter_map(|s| s.token_times.last().copied())
        .max()
        .unwrap_or_default();
    let makespan = secs(last.saturating_sub(first));
    let output_tokens: usize = served.iter().map(|s| s.tokens.len()).sum();
    let (mut ttft, mut tpot, mut itl, mut e2e) = (vec![], vec![], vec![], vec![]);
    for s in served {
        let (Some(&t0), Some(&tn)) = (s.token_times.first(), s.token_times.last()) else {
            continue;
        };
        ttft.push(secs(t0 - s.arrival));
        e2e.push(secs(tn - s.arrival));
        if s.token_times.len() > 1 {
            tpot.push(secs(tn - t0) / (s.token_times.len() - 1) as f64);
        }
        itl.extend(s.token_times.windows(2).map(|w| secs(w[1] - w[0])));
    }
    Summary {
        requests: served.len(),
        output_tokens,
        makespan,
        throughput: output_tokens as f64 / makespan,
        ttft: Spread::of(&ttft),
        tpot: Spread::of(&tpot),
        itl: Spread::of(&itl),
        e2e: Spread::of(&e2e),
        seqs_per_step: run.seqs_per_step,
    }
}

/// The median, field by field, of repeated runs' summaries.
pub fn median_summary(runs: &[Summary]) -> Summary {
    let mid =
        |f: &dyn Fn(&Summary) -> f64| percentile(&runs.iter().map(f).collect::<Vec<_>>(), 50.0);
    let spread = |f: &dyn Fn(&Summary) -> Spread| Spread {
        p50: mid(&|s| f(s).p50),
        p99: mid(&|s| f(s).p99),
        max: mid(&|s| f(s).max),
    };
    Summary {
        requests: runs[0].requests,
        output_tokens: runs[0].output_tokens,
        makespan: mid(&|s| s.makespan),
        throughput: mid(&|s| s.throughput),
        ttft: spread(&|s| s.ttft),
        tpot: spread(&|s| s.tpot),
        itl: spread(&|s| s.itl),
        e2e: spread(&|s| s.e2e),
        seqs_per_step: mid(&|s| s.seqs_per_step),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let values: Vec<f64> = (1..=100).rev().map(f64::from).collect(); // unsorted on purpose
        assert_eq!(percentile(&values, 0.0), 1.0);
        assert_eq!(percentile(&values, 50.0), 50.5);
        assert!((percentile(&values, 99.0) - 99.01).abs() < 1e-9);
        assert_eq!(percentile(&values, 100.0), 100.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert_eq!(percentile(&[1.0, 2.0], 50.0), 1.5);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn a_summary_of_two_requests() {
        let ms = Duration::from_millis;
        let served = [
            Served {
                arrival: ms(0),
                tokens: vec![1, 2, 3],
                token_times: vec![ms(100), ms(200), ms(400)],
                finish_reason: FinishReason::Length,
            },
            Served {
                arrival: ms(300),
                tokens: vec![4],
                token_times: vec![ms(500)],
                finish_reason: FinishReason::Length,
            },
        ];
        let s = summarize(&Run {
            served: served.to_vec(),
            seqs_per_step: 1.5,
        });
        assert_eq!((s.requests, s.output_tokens), (2, 4));
        assert!((s.makespan - 0.5).abs() < 1e-12);
        assert!((s.throughput - 8.0).abs() < 1e-9);
        assert!((s.ttft.p50 - 0.15).abs() < 1e-12); // 0.1 and 0.2
        assert!((s.tpot.max - 0.15).abs() < 1e-12); // one request with 3 tokens: 0.3 / 2
        assert!((s.itl.max - 0.2).abs() < 1e-12);
        assert!((s.e2e.max - 0.4).abs() < 1e-12);
        let m = median_summary(&[s, s, s]);
        assert_eq!(m.throughput, s.throughput);
    }
}
