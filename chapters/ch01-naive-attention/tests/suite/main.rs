//! Chapter 1's tests that no exercise task runs, one module per file, in one test binary: a
//! binary per file linked the same dependencies once per file, most of the test build's time.
//! An exercise task's tests, the allocation counters (each sets its own global allocator)
//! and the suites that need a download keep binaries of their own (`tests/*.rs`).

mod generate;
mod golden;
mod malformed;
mod random_model;
mod sampler;
mod tokenizer;
mod weight_source;
