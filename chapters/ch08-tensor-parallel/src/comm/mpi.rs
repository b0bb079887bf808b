//! [`MpiComm`]: ranks as processes (on one machine or many), through MPI (feature `mpi`; the
//! `mpi` crate over the system's OpenMPI or MPICH, started by `mpirun`).
//!
//! ```text
//! all-reduce on rank r:  all-gather every rank's buf ── buf = part_0 + part_1 + … (rank order)
//! all-gather:            all-gather the lengths (checked equal) ── all-gather the parts
//! broadcast:             broadcast the length ── broadcast the bytes
//! ```
//! The sum is [`ThreadComm`](super::ThreadComm)'s: every rank adds all the parts itself, in
//! rank order, so every rank holds the same bits and a group of processes computes exactly
//! what a group of threads does. (MPI's own all-reduce may sum in a different order on
//! different ranks.) Each collective first exchanges the lengths, so a rank whose buffer
//! differs gets [`CommError::LengthMismatch`] on every rank instead of a corrupt exchange.

use mpi::Threading;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives, Root};

use super::{CommError, Communicator};

/// This process's rank of `MPI_COMM_WORLD`.
///
/// Invariant: at most one exists per process (MPI starts once: [`MpiComm::init`] fails the
/// second time), so `&mut self` on it serializes every MPI call of the process, the
/// threading level it asks MPI for.
pub struct MpiComm {
    /// Ends MPI when dropped after [`finish`](Communicator::finish); forgotten otherwise,
    /// since its finalize waits for every rank, and a peer waiting in a collective for this
    /// one never comes: both would hang.
    universe: Option<Universe>,
    finished: bool,
    rank: usize,
    world: usize,
    lens: Vec<u64>,     // [world] the lengths every rank passed
    gathered: Vec<f32>, // [world · n] every rank's part
}

impl MpiComm {
    /// Starts MPI and joins the world `mpirun` made. Errors when MPI already started in this
    /// process or cannot run calls from more than one thread (one at a time).
    pub fn init() -> Result<Self, CommError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| CommError::Backend("MPI is already initialized".into()))?;
        if !matches!(threading, Threading::Serialized | Threading::Multiple) {
            return Err(CommError::Backend(format!(
                "MPI offers threading level {threading:?}, kiln needs Serialized"
            )));
        }
        let world = universe.world();
        Ok(MpiComm {
            rank: world.rank() as usize,
            world: world.size() as usize,
            universe: Some(universe),
            finished: false,
            lens: Vec::new(),
            gathered: Vec::new(),
        })
    }

    /// The world communicator: a handle, re-made per call so that `MpiComm` holds no raw MPI
    /// pointer and is `Send`.
    fn comm(&self) -> SimpleCommunicator {
        SimpleCommunicator::world()
    }

    /// Every rank's `len`, checked equal (the same answer on every rank).
    fn equal_lengths(&mut self, op: &'static str, len: usize) -> Result<usize, CommError> {
        self.lens.resize(self.world, 0);
        self.comm()
            .all_gather_into(&(len as u64), &mut self.lens[..]);
        if self.lens.iter().any(|&l| l != len as u64) {
            let lens = self.lens.iter().map(|&l| l as usize).collect();
            return Err(CommError::LengthMismatch { op, lens });
        }
        Ok(len)
    }

    /// `self.gathered` [world · n] ← every rank's `part` [n].
    fn gather(&mut self, op: &'static str, part: &[f32]) -> Result<usize, CommError> {
        let n = self.equal_lengths(op, part.len())?;
        self.gathered.resize(self.world * n, 0.0);
        if n > 0 {
            self.comm().all_gather_into(part, &mut self.gathered[..]);
        }
        Ok(n)
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        let Some(universe) = self.universe.take() else {
            return;
        };
        if self.finished {
            drop(universe);
        } else {
            std::mem::forget(universe);
            eprintln!(
                "kiln: MPI rank {} leaves before its group closed: MPI is not finalized, so the \
                 process ends with its error and mpirun ends the other ranks",
                self.rank
            );
        }
    }
}

impl Communicator for MpiComm {
    fn finish(&mut self) {
        self.finished = true;
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    // ANCHOR: mpi_all_reduce
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let n = self.gather("all-reduce", buf)?;
        // Rank 0's part, then each later rank's added in order: ThreadComm's sum, bit for bit.
        buf.copy_from_slice(&self.gathered[..n]);
        for part in self.gathered.chunks_exact(n.max(1)).skip(1) {
            for (b, v) in buf.iter_mut().zip(part) {
                *b += v;
            }
        }
        Ok(())
    }
    // ANCHOR_END: mpi_all_reduce

    fn all_gather(&mut self, part: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        let n = self.gather("all-gather", part)?;
        if out.len() != self.world * n {
            return Err(CommError::GatherShape {
                out: out.len(),
                world: self.world,
                part: n,
            });
        }
        out.copy_from_slice(&self.gathered);
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        if root >= self.world {
            return Err(CommError::RootOutOfRange {
                root,
                world: self.world,
            });
        }
        let comm = self.comm();
        let root_process = comm.process_at_rank(root as i32);
        let mut len = buf.len() as u64;
        root_process.broadcast_into(&mut len);
        let len = usize::try_from(len)
            .map_err(|_| CommError::Backend(format!("a broadcast of {len} bytes")))?;
        buf.resize(len, 0);
        if len > 0 {
            root_process.broadcast_into(&mut buf[..]);
        }
        Ok(())
    }
}
