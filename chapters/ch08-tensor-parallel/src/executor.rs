//! [`TensorParallelExecutor`]: chapter 4's [`Executor`] over `world` ranks in one process.
//!
//! ```text
//! engine thread = rank 0:  schedule ─▶ step ─┬─▶ rank 0 runs its shard ──┐
//!                                            ├─▶ rank 1 (thread) ───────┤ all-reduces and the
//!                                            └─▶ rank N−1 (thread) ─────┘ all-gather meet here
//!                          update ◀── logits [S, vocab] (rank 0's copy)
//! ```
//! One scheduler, many ranks: the scheduler and the block manager live once, on rank 0 (the
//! engine's thread), and every step is handed to the other ranks whole; each runs its shard
//! on its own pool, whose block ids mean the same positions as everyone else's. Each rank's
//! kernels run in its own thread pool of `threads_per_rank` threads.

use std::sync::Arc;
use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;

use ch01::Llama;
use ch03::{KvDtype, KvPool, PoolError};
use ch04::{Executor, ExecutorError, KvLayout, ModelSpec, SchedulerOutput};
use ndarray::ArrayView2;

use crate::comm::{CommError, Communicator, thread_group};
use crate::rank::{Rank, local_config};

/// Why a tensor-parallel executor could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("no ranks: a tensor-parallel executor needs at least one model shard")]
    NoRanks,
    #[error("rank {rank} holds rank {holds} of a world of {world}: load shard r of N for rank r")]
    WrongShard {
        rank: usize,
        holds: usize,
        world: usize,
    },
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("starting rank {rank}'s thread: {message}")]
    Thread { rank: usize, message: String },
}

/// Rank 0 on the caller's thread, ranks 1.. on threads of their own.
pub struct TensorParallelExecutor {
    rank0: Rank,
    comm0: Box<dyn Communicator>,
    pool0: rayon::ThreadPool,
    /// Ranks 1..world: where each one's steps go. Dropping them ends the threads.
    workers: Vec<Sender<Arc<SchedulerOutput>>>,
    handles: Vec<JoinHandle<()>>,
    layout: KvLayout,
    spec: ModelSpec,
    /// The first failed step's error. Threads meeting through [`ThreadComm`] all see a failure
    /// (a lost rank, lengths that differ), but NCCL reports some on one rank only, leaving the
    /// others inside a collective: another step would pair its collectives with theirs. So
    /// every later step fails with this one, and the group is not joined on drop.
    ///
    /// [`ThreadComm`]: crate::comm::ThreadComm
    broken: Option<String>,
}

/// Where the KV memory of each rank comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBlocks {
    /// Exactly this many blocks per rank.
    Count(usize),
    /// As many blocks as this many bytes hold on each rank (a GPU's memory is per rank too).
    BudgetPerRank(u64),
}

/// What every rank of a group over shards like `shard` stores, and the model's limits: the
/// shard's KV heads in `blocks` blocks of `block_size` positions (f32).
pub fn group_layout(shard: &Llama, block_size: usize, blocks: KvBlocks) -> (KvLayout, ModelSpec) {
    let local = local_config(shard);
    let num_blocks = match blocks {
        KvBlocks::Count(n) => n,
        KvBlocks::BudgetPerRank(bytes) => {
            let block_bytes = KvPool::<f32>::bytes_per_block(&local, block_size).max(1);
            (bytes / block_bytes).max(1) as usize
        }
    };
    let layout = KvLayout {
        num_layers: local.num_hidden_layers,
        num_kv_heads: local.num_key_value_heads,
        head_dim: local.head_dim,
        block_size,
        num_blocks,
        dtype: KvDtype::F32,
    };
    let spec = ModelSpec {
        vocab_size: local.vocab_size,
        max_model_len: local.max_position_embeddings,
    };
    (layout, spec)
}

impl TensorParallelExecutor {
    /// An executor over `shards` (shard `r` of `shards.len()` for rank `r`, as
    /// [`crate::load_shards`] loads them), f32 KV blocks of `block_size` positions, and
    /// `threads_per_rank` kernel threads per rank; the ranks meet through a [`thread_group`].
    pub fn new(
        shards: Vec<Llama>,
        block_size: usize,
        blocks: KvBlocks,
        threads_per_rank: usize,
    ) -> Result<Self, BuildError> {
        let comms = thread_group(shards.len())?
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect();
        Self::with_comms(shards, comms, block_size, blocks, threads_per_rank)
    }

    /// [`TensorParallelExecutor::new`] with the ranks meeting through `comms` (rank `r`'s
    /// handle at index `r`, one group): threads, or NCCL over one GPU per rank.
    pub fn with_comms(
        shards: Vec<Llama>,
        comms: Vec<Box<dyn Communicator>>,
        block_size: usize,
        blocks: KvBlocks,
        threads_per_rank: usize,
    ) -> Result<Self, BuildError> {
        let world = shards.len();
        let ranked = comms
            .iter()
            .enumerate()
            .all(|(r, c)| c.rank() == r && c.world() == world);
        if comms.len() != world || !ranked {
            return Err(BuildError::Comm(CommError::Backend(format!(
                "{} communicator handles for {world} shards, not one per rank in rank order",
                comms.len()
            ))));
        }
        let first = shards.first().ok_or(BuildError::NoRanks)?;
        for (rank, shard) in shards.iter().enumerate() {
            if shard.shard.rank != rank || shard.shard.world != world {
                return Err(BuildError::WrongShard {
                    rank,
                    holds: shard.shard.rank,
                    world,
                });
            }
        }
        let (layout, spec) = group_layout(first, block_size, blocks);
        let num_blocks = layout.num_blocks;
        let thread_pool = |rank: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads_per_rank.max(1))
                .thread_name(move |i| format!("kiln-tp{rank}-{i}"))
                .build()
                .map_err(|e| BuildError::Thread {
                    rank,
                    message: e.to_string(),
                })
        };
        let mut comms = comms.into_iter();
        let mut shards = shards.into_iter();
        let rank0 = Rank::new(
            shards.next().ok_or(BuildError::NoRanks)?,
            block_size,
            num_blocks,
        )?;
        let comm0 = comms.next().ok_or(BuildError::NoRanks)?;
        let (mut workers, mut handles) = (Vec::new(), Vec::new());
        for (i, (shard, mut comm)) in shards.zip(comms).enumerate() {
            let rank = i + 1;
            let mut state: Rank = Rank::new(shard, block_size, num_blocks)?;
            let pool = thread_pool(rank)?;
            let (tx, rx) = channel::<Arc<SchedulerOutput>>();
            let handle = std::thread::Builder::new()
                .name(format!("kiln-tp-rank{rank}"))
                .spawn(move || {
                    // Until rank 0 hangs up; an error here is rank 0's too (the same collective
                    // fails on every rank), so rank 0 reports it.
                    for step in rx {
                        if pool
                            .install(|| state.execute(&step, &mut *comm).map(|_| ()))
                            .is_err()
                        {
                            break;
                        }
                    }
                })
                .map_err(|e| BuildError::Thread {
                    rank,
                    message: e.to_string(),
                })?;
            workers.push(tx);
            handles.push(handle);
        }
        Ok(TensorParallelExecutor {
            rank0,
            comm0,
            pool0: thread_pool(0)?,
            workers,
            handles,
            layout,
            spec,
            broken: None,
        })
    }

    pub fn world(&self) -> usize {
        self.comm0.world()
    }

    /// Rank 0's state (its shard and pool).
    pub fn rank0(&self) -> &Rank {
        &self.rank0
    }
}

impl Executor for TensorParallelExecutor {
    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn model_spec(&self) -> ModelSpec {
        self.spec
    }

    // ANCHOR: tp_execute
    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        if let Some(error) = &self.broken {
            return Err(ExecutorError(format!(
                "the tensor-parallel group is down: {error}"
            )));
        }
        // "Broadcast" the step: in one process, hand each rank the same plan.
        if !self.workers.is_empty() {
            let shared = Arc::new(step.clone());
            for (i, worker) in self.workers.iter().enumerate() {
                worker.send(Arc::clone(&shared)).map_err(|_| {
                    ExecutorError(format!("tensor-parallel rank {} is gone", i + 1))
                })?;
            }
        }
        let (rank0, comm0, broken) = (&mut self.rank0, &mut *self.comm0, &mut self.broken);
        self.pool0
            .install(|| rank0.execute(step, comm0))
            .map_err(|e| {
                let error = format!("tensor-parallel step: {e}");
                *broken = Some(error.clone());
                ExecutorError(error)
            })
    }
    // ANCHOR_END: tp_execute
}

impl Drop for TensorParallelExecutor {
    fn drop(&mut self) {
        self.workers.clear(); // the ranks' loops end
        if self.broken.is_some() || std::thread::panicking() {
            return; // a rank may wait in a collective for good: it ends with the process
        }
        for handle in self.handles.drain(..) {
            let _ = handle.join(); // a rank that panicked has already lost the group
        }
    }
}
