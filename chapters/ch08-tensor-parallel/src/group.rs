//! [`RankGroupExecutor`] and [`run_worker`]: tensor parallelism when the ranks share nothing
//! but a [`Communicator`] (processes under MPI, or machines), so the step itself must travel.
//!
//! ```text
//! rank 0 (the engine's process)                 rank r ≥ 1 (run_worker)
//!   new:     broadcast plan (block size, blocks, ─▶ check the model, build my pool
//!            the model's fingerprint)
//!   execute: broadcast encode(step) ───────────────▶ decode, run my shard
//!            run my shard ◀──── all-reduces, all-gather ────▶
//!   drop:    broadcast an empty message ──────────▶ return
//! ```
//! [`TensorParallelExecutor`](crate::TensorParallelExecutor) hands its threads the step in
//! memory; here it is one broadcast of [`step_codec`] bytes per step, the
//! only message the ranks exchange besides the forward's collectives. Every rank must load
//! shard `r` of the same model, and the group runs as long as rank 0's executor lives.

use ch01::Llama;
use ch04::{Executor, ExecutorError, KvLayout, ModelSpec, SchedulerOutput};
use ndarray::ArrayView2;

use crate::comm::{CommError, Communicator};
use crate::executor::{BuildError, KvBlocks, group_layout};
use crate::rank::Rank;
use crate::step_codec::{self, InvalidStep, StepCodecError};

/// Why a worker rank stopped before rank 0 closed the group.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Codec(#[from] StepCodecError),
    #[error("a step from rank 0 does not fit this rank: {0}")]
    Step(#[from] InvalidStep),
    #[error("the group plan from rank 0 is {0} bytes, not 24")]
    Plan(usize),
    #[error(
        "this rank's model differs from rank 0's (its config, or how its projections are stored): \
         start every rank with the same --model, --dtype and --quantization"
    )]
    OtherModel,
}

/// Rank 0 of a group whose other ranks run [`run_worker`].
pub struct RankGroupExecutor<C: Communicator> {
    rank0: Rank,
    comm: C,
    message: Vec<u8>, // the step in flight, encoded
    layout: KvLayout,
    spec: ModelSpec,
    /// The first failed step's error. The workers stop at their first error, so a later
    /// broadcast would wait for ranks that are gone: every later step fails with this one.
    broken: Option<String>,
}

/// What every rank of a group must agree on, hashed (rank 0 sends it in the plan): the model's
/// config and how its projections are stored (the bytes of a column-split projection and of the
/// head shard, the same on every rank; a row-split bias lives on rank 0 only, so those are left
/// out).
pub fn fingerprint(shard: &Llama) -> u64 {
    let q_proj = shard
        .layers
        .first()
        .map_or(0, |l| l.self_attn.q_proj.weight_bytes());
    let text = format!(
        "{:?} {q_proj} {}",
        shard.config,
        shard.lm_head.weight_bytes()
    );
    ch03::block_manager::fnv1a_extend(ch03::block_manager::FNV_OFFSET, text.as_bytes())
}

/// Checks that `shard` is shard `rank` of a world of `comm.world()`.
fn check_shard(shard: &Llama, comm: &dyn Communicator) -> Result<(), BuildError> {
    let (rank, world) = (comm.rank(), comm.world());
    if shard.shard.rank != rank || shard.shard.world != world {
        return Err(BuildError::WrongShard {
            rank,
            holds: shard.shard.rank,
            world,
        });
    }
    Ok(())
}

impl<C: Communicator> RankGroupExecutor<C> {
    /// Rank 0 over `shard` (shard 0 of `comm.world()`), with KV blocks of `block_size` as
    /// `blocks` says; tells the workers the same plan, so every pool has the same block ids.
    pub fn new(
        shard: Llama,
        mut comm: C,
        block_size: usize,
        blocks: KvBlocks,
    ) -> Result<Self, BuildError> {
        check_shard(&shard, &comm)?;
        let (layout, spec) = group_layout(&shard, block_size, blocks);
        let mut plan = Vec::with_capacity(24);
        plan.extend_from_slice(&(block_size as u64).to_le_bytes());
        plan.extend_from_slice(&(layout.num_blocks as u64).to_le_bytes());
        plan.extend_from_slice(&fingerprint(&shard).to_le_bytes());
        comm.broadcast(&mut plan, 0)?;
        Ok(RankGroupExecutor {
            rank0: Rank::new(shard, block_size, layout.num_blocks)?,
            comm,
            message: Vec::new(),
            layout,
            spec,
            broken: None,
        })
    }

    pub fn world(&self) -> usize {
        self.comm.world()
    }
}

impl<C: Communicator> Executor for RankGroupExecutor<C> {
    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn model_spec(&self) -> ModelSpec {
        self.spec
    }

    // ANCHOR: group_execute
    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        if let Some(error) = &self.broken {
            return Err(ExecutorError(format!(
                "the tensor-parallel group is down: {error}"
            )));
        }
        step_codec::encode(step, &mut self.message);
        let broken = &mut self.broken;
        let mut failed = |e: CommError| {
            let error = format!("tensor-parallel step: {e}");
            *broken = Some(error.clone());
            ExecutorError(error)
        };
        self.comm
            .broadcast(&mut self.message, 0)
            .map_err(&mut failed)?;
        self.rank0.execute(step, &mut self.comm).map_err(failed)
    }
    // ANCHOR_END: group_execute
}

impl<C: Communicator> Drop for RankGroupExecutor<C> {
    /// An empty message closes the group: every worker's [`run_worker`] returns. A broken
    /// group is left as it is (its workers are gone, or stopped at their own error).
    fn drop(&mut self) {
        if self.broken.is_some() {
            return;
        }
        self.message.clear();
        if self.comm.broadcast(&mut self.message, 0).is_ok() {
            self.comm.finish();
        }
    }
}

// ANCHOR: run_worker
/// Rank `comm.rank() ≥ 1` of a group: builds its pool from rank 0's plan, then runs every step
/// rank 0 broadcasts on `shard`, until rank 0's executor is dropped.
pub fn run_worker<C: Communicator>(shard: Llama, mut comm: C) -> Result<(), WorkerError> {
    check_shard(&shard, &comm)?;
    let mut message = Vec::new();
    comm.broadcast(&mut message, 0)?;
    let plan: [u8; 24] = message
        .as_slice()
        .try_into()
        .map_err(|_| WorkerError::Plan(message.len()))?;
    let [block_size, num_blocks, model] = [&plan[..8], &plan[8..16], &plan[16..]]
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    if model != fingerprint(&shard) {
        return Err(WorkerError::OtherModel);
    }
    let [block_size, num_blocks] =
        [block_size, num_blocks].map(|v| usize::try_from(v).unwrap_or(usize::MAX));
    let mut rank: Rank = Rank::new(shard, block_size, num_blocks).map_err(BuildError::from)?;
    loop {
        comm.broadcast(&mut message, 0)?;
        if message.is_empty() {
            comm.finish();
            return Ok(());
        }
        let step = step_codec::decode(&message)?;
        step_codec::check(&step, rank.pool().block_size(), rank.pool().num_blocks())?;
        rank.execute(&step, &mut comm)?;
    }
}
// ANCHOR_END: run_worker
