//! [`NcclComm`]: one rank per GPU, through NCCL (feature `nccl`; cudarc loads the CUDA driver
//! and NCCL at run time, by the name `libnccl.so`: NCCL installs `libnccl.so.2`, so a link to it
//! by that name must be on the library path).
//!
//! ```text
//! all-reduce on rank r:  all-gather the lengths (checked equal)
//!                        buf ─copy→ GPU ── ncclAllReduce(sum) ── GPU ─copy→ buf
//! all-gather:            the lengths ── part ─→ GPU ── ncclAllGather ── GPU ─→ out
//! broadcast:             the root's length ── bytes ─→ GPU ── ncclBroadcast ── GPU ─→ buf
//! ```
//! The seam passes host buffers, so each collective copies its buffer to the rank's GPU and
//! back: the chapter's executor computes on the CPU, and this is the communicator a GPU executor
//! would call with device buffers instead. Each collective first exchanges the lengths, so a rank
//! whose buffer differs gets [`CommError::LengthMismatch`] on every rank (NCCL itself would read
//! past the shorter buffer).
//!
//! NCCL's sum leaves the same bits on every rank (each element is reduced once and the result
//! sent to all), as [`Communicator`] requires, but in NCCL's order, not rank order: its results
//! can differ from [`ThreadComm`](super::ThreadComm)'s in the last place.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::safe::{Comm, ReduceOp};

use super::{CommError, Communicator};

fn backend(what: &str, error: impl std::fmt::Debug) -> CommError {
    CommError::Backend(format!("NCCL {what}: {error:?}"))
}

/// A rank's NCCL communicator, movable to the rank's thread.
struct RankComm(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; `NcclComm`'s methods take `&mut self`, so one thread at a time calls it.
unsafe impl Send for RankComm {}

/// One rank of a group of GPUs, one GPU per rank.
///
/// Invariant: `comm` is rank `rank` of a group of `world`, its stream on the rank's GPU; each
/// call sizes the device buffers it uses to exactly its lengths (`sized`), as NCCL takes its
/// counts from them.
pub struct NcclComm {
    comm: RankComm,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    lens: CudaSlice<u64>,    // [world] every rank's length
    send: CudaSlice<f32>,    // this rank's part
    recv: CudaSlice<f32>,    // the result
    bytes: CudaSlice<u8>,    // a broadcast's payload
    len_out: CudaSlice<u64>, // [1] a broadcast's length
}

/// One [`NcclComm`] per GPU of `ordinals` (rank `r` on GPU `ordinals[r]`), made together in
/// this process (`ncclCommInitAll`): a group whose ranks are threads, each driving its own GPU.
/// Errors: no CUDA driver or NCCL library, a GPU that is not there, or a GPU named twice (NCCL
/// takes one rank per GPU).
pub fn nccl_group(ordinals: &[usize]) -> Result<Vec<NcclComm>, CommError> {
    if ordinals.is_empty() {
        return Err(CommError::Backend("a group needs at least one rank".into()));
    }
    // SAFETY: each only tries to open the library by its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CommError::Backend(
            "no CUDA driver (libcuda.so): NCCL ranks need NVIDIA GPUs".into(),
        ));
    }
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(CommError::Backend(
            "the NCCL library was not found: cudarc opens it as libnccl.so (or \
             libnccl.so.<CUDA major>), not as libnccl.so.2, the name NCCL's packages and the \
             nvidia-nccl wheels install; put a link named libnccl.so to libnccl.so.2 in a folder \
             on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let count = CudaContext::device_count().map_err(|e| backend("device count", e))? as usize;
    for (rank, &ordinal) in ordinals.iter().enumerate() {
        if ordinal >= count {
            return Err(CommError::Backend(format!(
                "rank {rank} asks for GPU {ordinal}; this machine has {count}"
            )));
        }
        if ordinals[..rank].contains(&ordinal) {
            return Err(CommError::Backend(format!(
                "GPU {ordinal} is named twice: NCCL runs one rank per GPU"
            )));
        }
    }
    let streams = ordinals
        .iter()
        .map(|&o| Ok(CudaContext::new(o)?.default_stream()))
        .collect::<Result<Vec<_>, cudarc::driver::DriverError>>()
        .map_err(|e| backend("opening the GPUs", e))?;
    let comms = Comm::from_devices(streams.clone()).map_err(|e| backend("init", e))?;
    let world = ordinals.len();
    comms
        .into_iter()
        .zip(streams)
        .enumerate()
        .map(|(rank, (comm, stream))| {
            let zeros = |s: &Arc<CudaStream>| -> Result<_, CommError> {
                Ok((
                    alloc::<u64>(s, world)?,
                    alloc::<f32>(s, 1)?,
                    alloc::<f32>(s, 1)?,
                    alloc::<u8>(s, 1)?,
                    alloc::<u64>(s, 1)?,
                ))
            };
            let (lens, send, recv, bytes, len_out) = zeros(&stream)?;
            Ok(NcclComm {
                comm: RankComm(comm),
                stream,
                rank,
                world,
                lens,
                send,
                recv,
                bytes,
                len_out,
            })
        })
        .collect()
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>, CommError> {
    stream
        .alloc_zeros(len.max(1))
        .map_err(|e| backend("allocation", e))
}

/// `buffer` at exactly `len` elements (re-allocated when the length changes).
fn sized<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    buffer: &mut CudaSlice<T>,
    len: usize,
) -> Result<(), CommError> {
    if buffer.len() != len {
        *buffer = alloc(stream, len)?;
    }
    Ok(())
}

impl NcclComm {
    /// Every rank's `len`, checked equal (the same answer on every rank).
    fn equal_lengths(&mut self, op: &'static str, len: usize) -> Result<usize, CommError> {
        let mine = self
            .stream
            .clone_htod(&[len as u64])
            .map_err(|e| backend("copy", e))?;
        self.comm
            .0
            .all_gather(&mine, &mut self.lens)
            .map_err(|e| backend(op, e))?;
        let lens = self
            .stream
            .clone_dtoh(&self.lens)
            .map_err(|e| backend("copy", e))?;
        if lens.iter().any(|&l| l != len as u64) {
            let lens = lens.iter().map(|&l| l as usize).collect();
            return Err(CommError::LengthMismatch { op, lens });
        }
        Ok(len)
    }

    /// `self.send` ← `part`, sized to it (one element when empty: NCCL is not called then).
    fn upload(&mut self, part: &[f32]) -> Result<(), CommError> {
        sized(&self.stream, &mut self.send, part.len().max(1))?;
        if !part.is_empty() {
            let mut dst = self.send.slice_mut(..part.len());
            self.stream
                .memcpy_htod(part, &mut dst)
                .map_err(|e| backend("copy", e))?;
        }
        Ok(())
    }
}

// ANCHOR: nccl_all_reduce
impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let n = self.equal_lengths("all-reduce", buf.len())?;
        if n == 0 {
            return Ok(());
        }
        self.upload(buf)?;
        sized(&self.stream, &mut self.recv, n)?;
        self.comm
            .0
            .all_reduce(&self.send, &mut self.recv, &ReduceOp::Sum)
            .map_err(|e| backend("all-reduce", e))?;
        self.stream
            .memcpy_dtoh(&self.recv, buf)
            .map_err(|e| backend("copy", e))?;
        self.stream.synchronize().map_err(|e| backend("sync", e))
    }
    // ANCHOR_END: nccl_all_reduce

    fn all_gather(&mut self, part: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        let n = self.equal_lengths("all-gather", part.len())?;
        if n > 0 {
            self.upload(part)?;
            sized(&self.stream, &mut self.recv, self.world * n)?;
            self.comm
                .0
                .all_gather(&self.send, &mut self.recv)
                .map_err(|e| backend("all-gather", e))?;
        }
        // Checked after the collective, which every rank has then joined: a rank that left
        // before it would leave the others waiting in NCCL for ever.
        if out.len() != self.world * n {
            return Err(CommError::GatherShape {
                out: out.len(),
                world: self.world,
                part: n,
            });
        }
        if n == 0 {
            return Ok(());
        }
        self.stream
            .memcpy_dtoh(&self.recv, out)
            .map_err(|e| backend("copy", e))?;
        self.stream.synchronize().map_err(|e| backend("sync", e))
    }

    fn broadcast(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        if root >= self.world {
            return Err(CommError::RootOutOfRange {
                root,
                world: self.world,
            });
        }
        let root_arg = root as i32;
        // The root's length first, so that every rank sizes its buffer to it.
        let len = self
            .stream
            .clone_htod(&[buf.len() as u64])
            .map_err(|e| backend("copy", e))?;
        self.comm
            .0
            .broadcast(Some(&len), &mut self.len_out, root_arg)
            .map_err(|e| backend("broadcast", e))?;
        let n = self
            .stream
            .clone_dtoh(&self.len_out)
            .map_err(|e| backend("copy", e))?[0] as usize;
        if self.rank != root {
            buf.resize(n, 0);
        }
        if n == 0 {
            return Ok(());
        }
        sized(&self.stream, &mut self.bytes, n)?;
        if self.rank == root {
            self.stream
                .memcpy_htod(buf.as_slice(), &mut self.bytes)
                .map_err(|e| backend("copy", e))?;
        }
        self.comm
            .0
            .broadcast_in_place(&mut self.bytes, root_arg)
            .map_err(|e| backend("broadcast", e))?;
        self.stream
            .memcpy_dtoh(&self.bytes, buf.as_mut_slice())
            .map_err(|e| backend("copy", e))?;
        self.stream.synchronize().map_err(|e| backend("sync", e))
    }
}
