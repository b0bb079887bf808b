//! Tensor parallelism's tests that no exercise task runs, one module per file, in one test binary: a
//! binary per file linked the same dependencies once per file, most of the test build's time.
//! An exercise task's tests, the allocation counters (each sets its own global allocator)
//! and the suites that need a download keep binaries of their own (`tests/*.rs`).

// Chapter 4's scenario names chapter 4's crate by its package name.
extern crate ch04 as ch04_continuous_batching;

#[path = "../../../ch04-continuous-batching/tests/engine_scenario/mod.rs"]
mod engine_scenario;

mod engine_equals_alone;
mod pipeline;
mod sharded_load;
mod step_codec;
