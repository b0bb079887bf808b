//! # Chapter 2: the KV cache
//!
//! Chapter 1 recomputes every position for every new token. But under a causal mask the keys
//! and values of position `t` never change once computed, so they can be kept: a **KV cache**.
//! Generation then splits into two phases:
//!
//! - **prefill**: the whole prompt in one pass (matrix-matrix work), filling the cache;
//! - **decode**: one new position per step (matrix-vector work), reading every earlier
//!   position's K/V from the cache.
//!
//! | module         | what it does                                                               |
//! |----------------|----------------------------------------------------------------------------|
//! | [`kv_store`]   | the [`KvStore`] seam: where K/V live and how queries read them             |
//! | [`contiguous`] | [`ContiguousKvCache`]: one preallocated `[max_len, kv_dim]` buffer per layer |
//! | [`attention`]  | attention of new queries against stored K/V, into reused buffers             |
//! | [`decode_attention`] | one decode row against the cache: chunks of positions in parallel, merged |
//! | [`cached`]     | the forward pass over new tokens only, and generation with a cache         |
//! | [`kernels`]    | our matrix-vector and matrix-matrix products: threaded, vectorised, f32/bf16 |
//! | [`elementwise`]| the row-wise ops between the products (norms, RoPE, residuals, SiLU), threaded when big enough |
//! | [`profile`]    | an off-by-default, per-op timer of forward steps                           |
//! | [`read_probe`] | the machine's read bandwidth now, summing weight memory on every thread     |
//! | [`workload`]   | a seeded log-normal request workload; how much of a contiguous reservation it uses |
//! | [`fast_linear`]| [`FastLinear`]: chapter 1's `Linear` seam on those kernels                 |
//! | [`weight_memory`] | memory for a model's weights, on 2 MiB pages where Linux allows it      |
//!
//! Chapter 3 plugs paged storage into the same [`KvStore`] seam without touching this chapter.

pub mod attention;
pub mod awake;
pub mod cached;
pub mod contiguous;
pub mod decode_attention;
pub mod elementwise;
pub mod fast_linear;
pub mod kernels;
pub mod kv_store;
pub mod memory;
pub mod prefill_attention;
pub mod profile;
pub mod read_probe;
pub mod weight_memory;
pub mod workload;

pub use cached::{CachedSession, Workspace, forward_cached, generate_cached};
pub use contiguous::ContiguousKvCache;
pub use fast_linear::{FastLinear, FastLoader, WeightDtype, load_fast};
pub use kv_store::{KvError, KvStore};

/// Errors of the cached forward pass.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] ch01::Error),
    #[error(transparent)]
    Kv(#[from] KvError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
