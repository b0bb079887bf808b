//! Chapter 7's tests that no exercise task runs, one module per file, in one test binary: a
//! binary per file linked the same dependencies once per file, most of the test build's time.
//! An exercise task's tests, the allocation counters (each sets its own global allocator)
//! and the suites that need a download keep binaries of their own (`tests/*.rs`).

// Chapter 4's scenario names chapter 4's crate by its package name.
extern crate ch04 as ch04_continuous_batching;

#[path = "../../../ch04-continuous-batching/tests/engine_scenario/mod.rs"]
mod engine_scenario;
#[path = "../support/mod.rs"]
mod support;

mod engine_equals_alone;
mod kv_8bit;
mod kv_8bit_engine;
mod model;
mod traffic;
