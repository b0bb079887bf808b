//! # Chapter 3: paged KV blocks
//!
//! Chapter 2 reserves, for every sequence, K/V memory for the longest sequence the model allows;
//! on a realistic workload most of it never holds a token. This chapter does what an operating
//! system does with memory: it cuts the KV memory into fixed-size **blocks** (pages), gives each
//! sequence a **block table** (page table) that maps its logical blocks to physical ones, and
//! allocates a block only when the sequence reaches it. Sequences can then **share** blocks:
//! a forked sequence (n > 1 sampling) shares all of its parent's, and a new prompt reuses the
//! blocks of a cached identical prefix (**prefix caching**); a shared block is copied only
//! when one of its owners writes into it (**copy-on-write**).
//!
//! | module               | what it does                                                          |
//! |----------------------|-----------------------------------------------------------------------|
//! | [`block_table`]      | [`BlockTable`]: logical → physical blocks, the slot mapping          |
//! | [`block_manager`]    | [`BlockManager`]: free list, reference counts, prefix cache, CoW     |
//! | [`pool`]             | [`KvPool`]: the K/V memory, `[num_blocks, block_size, kv_heads, head_dim]` per layer |
//! | [`kv_dtype`]         | [`KvElement`]: what the pool stores an element as (f32, bf16; 8-bit with [`KvScales`]) |
//! | [`utilisation`]      | the share of allocated KV memory holding tokens, on chapter 2's workload |
//! | [`paged_store`]      | [`PagedSequence`]: chapter 2's `KvStore` seam over blocks; [`PagedKv`], generation |
//!
//! Chapter 2's forward pass runs unchanged on paged storage: only the store differs.

pub mod block_manager;
pub mod block_table;
pub mod kv_dtype;
pub mod paged_store;
pub mod pool;
pub mod utilisation;

pub use block_manager::{BlockCopy, BlockError, BlockManager, PrefixStats};
pub use block_table::{BlockId, BlockTable};
pub use kv_dtype::{KvDtype, KvElement, KvScales};
pub use paged_store::{PagedKv, PagedSequence, Sequence, generate_paged};
pub use pool::{BlockData, KvPool, PoolError};
