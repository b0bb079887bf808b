//! # Chapter 8, part 2: tensor parallelism
//!
//! A model too big for one device is split across `N` of them: every layer's projections are
//! cut so that each rank holds `1/N` of the weights and of the KV cache, and a few collective
//! operations per layer put the pieces back together. This crate adds the communicators, the
//! sharded ranks, and an [`Executor`](ch04::Executor) over them; chapter 4's engine drives it
//! unchanged.
//!
//! | module       | what it does                                                                 |
//! |--------------|------------------------------------------------------------------------------|
//! | [`comm`]     | the [`Communicator`] seam (all-reduce, all-gather, broadcast); [`ThreadComm`], `MpiComm` |
//! | [`load`]     | [`load_shards`]: one model shard per rank through chapter 1's shard specs     |
//! | [`rank`]     | [`Rank`]: one rank's shard, KV pool and step, with the collectives in place   |
//! | [`executor`] | [`TensorParallelExecutor`]: rank 0 schedules, every rank runs its shard        |
//! | [`group`]    | [`RankGroupExecutor`], [`run_worker`]: the same when ranks are processes (MPI)  |
//! | [`step_codec`] | a step as bytes, for ranks that share no memory                              |
//! | [`pipeline`] | a pipeline-parallel sketch: layers in stages on threads, micro-batches, the bubble |

pub mod comm;
pub mod executor;
pub mod group;
pub mod load;
pub mod pipeline;
pub mod rank;
pub mod step_codec;

pub use comm::{CommError, Communicator, ThreadComm, thread_group};
pub use executor::{BuildError, KvBlocks, TensorParallelExecutor, group_layout};
pub use group::{RankGroupExecutor, WorkerError, run_worker};
pub use load::{load_shard, load_shards};
pub use rank::{Rank, local_config};
