//! Chapter 5's tests that no exercise task runs, one module per file, in one test binary: a
//! binary per file linked the same dependencies once per file, most of the test build's time.
//! An exercise task's tests, the allocation counters (each sets its own global allocator)
//! and the suites that need a download keep binaries of their own (`tests/*.rs`).

mod fp8_linear;
mod gguf_model;
mod gguf_tokenizer;
mod gguf_tokenizer_llama_cpp;
mod hf_quant;
mod kernels_edge;
mod model_quant;
mod quant_loader;
mod quantize;
mod smoothquant;
