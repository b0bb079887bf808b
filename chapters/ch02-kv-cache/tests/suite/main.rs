//! Chapter 2's tests that no exercise task runs, one module per file, in one test binary: a
//! binary per file linked the same dependencies once per file, most of the test build's time.
//! An exercise task's tests, the allocation counters (each sets its own global allocator)
//! and the suites that need a download keep binaries of their own (`tests/*.rs`), as do tests
//! that read or change process-wide state: `awake.rs` counts every pool's spinners.

mod elementwise;
mod generate;
mod kernels;
mod populate;
mod workload;
