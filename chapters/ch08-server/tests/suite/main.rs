//! The server's tests that no exercise task runs, one module per file, in one test binary: a
//! binary per file linked the same dependencies once per file, most of the test build's time.

#[path = "../support/mod.rs"]
mod support;

mod dashboard;
mod hardening;
mod http;
mod structured;
