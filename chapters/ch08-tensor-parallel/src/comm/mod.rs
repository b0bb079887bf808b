//! The [`Communicator`] seam: the three collectives tensor parallelism needs.
//!
//! ```text
//! all-reduce (sum)   rank r: [a_r]            → every rank: [a_0 + a_1 + … + a_{N-1}]
//! all-gather         rank r: [p_r]            → every rank: [p_0 | p_1 | … | p_{N-1}]
//! broadcast(root)    root: [b], others: [·]   → every rank: [b]
//! ```
//! Every rank of a group calls the same collectives in the same order with buffers of the same
//! length (a collective is a meeting: a rank that skips one leaves the others waiting). A
//! length that differs between ranks is an error on every rank, never a silent truncation.

#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod thread;

#[cfg(feature = "mpi")]
pub use mpi::MpiComm;
#[cfg(feature = "nccl")]
pub use nccl::{NcclComm, nccl_group};
pub use thread::{ThreadComm, thread_group};

/// Why a collective failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    #[error("{op}: ranks passed buffers of different lengths {lens:?}")]
    LengthMismatch { op: &'static str, lens: Vec<usize> },
    #[error("all-gather: output of {out} elements for {world} parts of {part}")]
    GatherShape {
        out: usize,
        world: usize,
        part: usize,
    },
    #[error("broadcast root {root} is outside a world of {world}")]
    RootOutOfRange { root: usize, world: usize },
    #[error("a rank of the group was lost (it panicked or was dropped mid-collective)")]
    RankLost,
    /// An error of the runtime underneath (MPI, NCCL).
    #[error("communicator: {0}")]
    Backend(String),
}

// ANCHOR: communicator
/// One rank's handle on a group of `world` ranks.
///
/// Invariants every implementation keeps: after `all_reduce_sum` every rank holds the same
/// bits (the sum is taken in one fixed order, not each rank's own), so ranks that start equal
/// stay equal; `all_gather` orders the parts by rank.
pub trait Communicator: Send {
    fn rank(&self) -> usize;

    fn world(&self) -> usize;

    /// `buf` `[n]` ← the element-wise sum of every rank's `buf` `[n]`.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError>;

    /// `out` `[world · n]` ← every rank's `part` `[n]`, in rank order.
    fn all_gather(&mut self, part: &[f32], out: &mut [f32]) -> Result<(), CommError>;

    /// `buf` ← the root's `buf` (any length: the others' buffers are resized to it).
    fn broadcast(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), CommError>;

    /// The group closed as agreed: this rank's last collective is behind it. A communicator
    /// dropped without it (an error, a panic) must not wait for its peers on the way out:
    /// `mpi::MpiComm` then skips MPI's finalize, which waits for every process, so
    /// the process exits with its error and mpirun ends the others.
    fn finish(&mut self) {}
}
// ANCHOR_END: communicator
