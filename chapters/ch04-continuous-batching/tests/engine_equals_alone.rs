//! Continuous batching changes when tokens are computed, never which: every request's greedy
//! output equals generating it alone, whatever the arrivals, budgets, chunking and preemption
//! (the scenario is in `engine_scenario/`, shared with chapter 7's flash attention backend).

mod engine_scenario;

use ch04_continuous_batching::CpuExecutor;

#[test]
fn every_request_equals_generating_it_alone() {
    engine_scenario::every_request_equals_generating_it_alone_with(&|model, pool| {
        Box::new(CpuExecutor::new(model, pool))
    });
}
