//! # Chapter 7, part 1: FlashAttention on the CPU
//!
//! Naive attention materialises the `T × T` score matrix: its memory grows with the square of
//! the context, and every score is written to slow memory and read back. FlashAttention
//! computes the same result tile by tile with an **online softmax**, in O(T) extra memory and
//! far less traffic between slow and fast memory. The algorithm is the same whether the fast
//! memory is a GPU's shared memory or a CPU's cache, so this chapter builds and proves it on the
//! CPU; part 2 moves it to CUDA.
//!
//! | module        | what it does                                                            |
//! |---------------|-------------------------------------------------------------------------|
//! | [`online`]    | the online softmax: one tile's step, and the merge of two partial states |
//! | [`tile`]      | the tiles (Q, Kᵀ, V, S) and the two small products on them               |
//! | [`prefill`]   | one task of the tiled loop: a query tile × a KV head, causal tiles skipped |
//! | [`decode`]    | split-K decode: one query row's keys in partitions, merged by log-sum-exp |
//! | [`attention`] | a whole step: rows → tasks → one parallel pass → output rows             |
//! | [`dense`]     | naive and flash attention side by side over contiguous Q, K, V          |
//! | [`backend`]   | [`FlashAttention`], chapter 4's `AttentionBackend`; `--attention-backend` |
//! | [`traffic`]   | an instrumented model: bytes moved between slow and fast memory of size M |
//!
//! Every path is proven against chapter 1's naive attention (`tests/`), and the whole model
//! with the flash backend against the naive backend and the golden outputs.

pub mod attention;
pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decode;
pub mod dense;
pub mod online;
pub mod prefill;
pub mod tile;
pub mod traffic;

pub use attention::{
    FlashParams, ParamError, Partitions, Scratch, TileSizes, flash_attention_paged,
    set_prefill_avx512,
};
pub use backend::{
    AttentionKind, AutoAttention, FlashAttention, cpu_executor, populated_cpu_executor,
};
pub use dense::{ShapeError, flash_attention, flash_attention_with, naive_attention};
pub use tile::LayerKv;
