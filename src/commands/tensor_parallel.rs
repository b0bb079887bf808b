//! `--tensor-parallel-size N`: the engine's executor over N ranks (chapter 8), shared by every
//! command that runs the engine. N = 1 is chapter 7's CPU executor. The ranks are threads of
//! this process, or (`--tensor-parallel-backend mpi`) processes started by mpirun, whose ranks
//! 1.. run `kiln tp-worker`.

use anyhow::{Context, bail};
use ch01::Llama;
use ch03::KvDtype;
use ch04::{CacheConfig, Executor};
use ch07::AttentionKind;
use ch08tp::{KvBlocks, TensorParallelExecutor};

use super::{HostSide, ModelArgs};

/// Where the ranks run.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Threads of this process, meeting over shared memory.
    Threads,
    /// Processes under `mpirun`: this one is rank 0, ranks 1.. run `kiln tp-worker`
    /// (`mpirun -n 1 kiln generate ... : -n N-1 kiln tp-worker --model DIR`).
    Mpi,
    /// Threads of this process meeting over NCCL, rank r through GPU r (GPUs 0..N).
    Nccl,
}

/// `--tensor-parallel-size`, on the commands that run the engine (generate, perplexity, serve).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct TensorParallelArgs {
    /// Split the model across N ranks (chapter 8's tensor parallelism), each holding 1/N of
    /// the projections, of the vocabulary and of the KV heads, meeting in two all-reduces per
    /// layer. N must divide the query heads, the intermediate size and the vocabulary, and
    /// divide or be a multiple of the KV heads.
    #[arg(
        long,
        default_value_t = 1,
        value_name = "N",
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    pub tensor_parallel_size: usize,
    /// Where the ranks run: threads of this process, or MPI processes (a kiln built with
    /// `--features mpi`, started by mpirun); nccl: threads whose collectives go through NCCL,
    /// one GPU per rank.
    #[arg(long, value_enum, default_value = "threads")]
    pub tensor_parallel_backend: Backend,
}

impl TensorParallelArgs {
    /// Whether the model runs on the tensor-parallel executor: more than one rank, or a
    /// backend other than threads at any size (one MPI process, or one GPU through NCCL).
    pub fn is_parallel(&self) -> bool {
        self.tensor_parallel_size > 1 || self.tensor_parallel_backend != Backend::Threads
    }

    /// The flags that asked for the tensor-parallel executor, for messages:
    /// `--tensor-parallel-size N` and, unless threads, the backend.
    pub fn flags(&self) -> String {
        let size = format!("--tensor-parallel-size {}", self.tensor_parallel_size);
        match self.tensor_parallel_backend {
            Backend::Threads => size,
            Backend::Mpi => format!("{size} --tensor-parallel-backend mpi"),
            Backend::Nccl => format!("{size} --tensor-parallel-backend nccl"),
        }
    }

    /// What the host loads of `--model` for a command that may run on the ranks: with tensor
    /// parallelism the configuration and tokenizer only (`None`: each rank loads its own shard,
    /// and a whole copy on the host would double the memory), unless `whole_target`, when the
    /// whole model too, beside the shards (a layer-skip drafter runs the target's first layers
    /// from host memory; said on stderr); without it, what `--device` needs
    /// ([`ModelArgs::load_for_device`]).
    pub fn load_host(
        &self,
        args: &ModelArgs,
        whole_target: bool,
    ) -> anyhow::Result<(HostSide, Option<Llama>)> {
        if !self.is_parallel() {
            return args.load_for_device();
        }
        if !whole_target {
            return Ok((args.load_host_side()?, None));
        }
        eprintln!(
            "kiln: {}: the host loads the whole model as well as the ranks' shards, for the \
             drafter that runs its first layers",
            self.flags()
        );
        args.load_for_device()
    }

    /// The engine's executor: over `model` on one rank (the host's weights, which it needs), or
    /// over `--tensor-parallel-size` shards loaded from `--model` (`model` unused), each rank
    /// with `cache.memory` bytes of KV blocks (memory is per device, as a GPU's is) and an
    /// equal share of this thread pool's threads.
    pub fn executor<'m>(
        &self,
        args: &ModelArgs,
        model: Option<&'m Llama>,
        cache: &CacheConfig,
        attention: AttentionKind,
    ) -> anyhow::Result<Box<dyn Executor + Send + 'm>> {
        if self.is_parallel() {
            return self.tensor_parallel_executor(args, cache, attention);
        }
        let model = model.context("the CPU executor needs the host weights")?;
        Ok(ch07::cpu_executor(model, cache, attention)?)
    }

    /// `--tensor-parallel-size` ranks over shards of `--model` (see [`Self::executor`]).
    pub fn tensor_parallel_executor(
        &self,
        args: &ModelArgs,
        cache: &CacheConfig,
        attention: AttentionKind,
    ) -> anyhow::Result<Box<dyn Executor + Send + 'static>> {
        let world = self.tensor_parallel_size;
        let what = self.flags();
        if args.is_gguf() {
            bail!(
                "{what}: GGUF files load on the CPU executor only (use a Hugging Face directory)"
            );
        }
        if attention == AttentionKind::Flash {
            bail!(
                "{what} runs chapter 4's attention: --attention-backend flash is the CPU executor's"
            );
        }
        if cache.dtype != KvDtype::F32 {
            bail!("{what} stores K/V in f32: pass --kv-cache-dtype f32");
        }
        let blocks = KvBlocks::BudgetPerRank(cache.memory);
        if self.tensor_parallel_backend == Backend::Mpi {
            return mpi_rank0(args, world, cache.block_size, blocks);
        }
        let loader = args.loader()?;
        let shards = ch08tp::load_shards(&args.model, &*loader, world)
            .with_context(|| format!("splitting {} across {world} ranks", args.model.display()))?;
        let threads = (rayon::current_num_threads() / world).max(1);
        let executor = match self.tensor_parallel_backend {
            Backend::Nccl => {
                let ordinals: Vec<usize> = (0..world).collect();
                let comms = ch08tp::comm::nccl_group(&ordinals)
                    .with_context(|| format!("--tensor-parallel-backend nccl on GPUs 0..{world}"))?
                    .into_iter()
                    .map(|c| Box::new(c) as Box<dyn ch08tp::Communicator>)
                    .collect();
                TensorParallelExecutor::with_comms(
                    shards,
                    comms,
                    cache.block_size,
                    blocks,
                    threads,
                )?
            }
            _ => TensorParallelExecutor::new(shards, cache.block_size, blocks, threads)?,
        };
        let layout = executor.kv_layout();
        eprintln!(
            "kiln: tensor parallel: {world} ranks x {threads} threads, {} KV heads and {} blocks per rank",
            layout.num_kv_heads, layout.num_blocks
        );
        Ok(Box::new(executor))
    }
}

/// Loads shard `rank` of `world` of `--model` (the rank's part only).
#[cfg(feature = "mpi")]
fn load_shard(args: &ModelArgs, rank: usize, world: usize) -> anyhow::Result<Llama> {
    ch08tp::load_shard(&args.model, &*args.loader()?, rank, world).with_context(|| {
        format!(
            "loading shard {rank} of {world} of {}",
            args.model.display()
        )
    })
}

/// Joins MPI's world as rank 0 and returns its executor.
#[cfg(feature = "mpi")]
fn mpi_rank0(
    args: &ModelArgs,
    world: usize,
    block_size: usize,
    blocks: KvBlocks,
) -> anyhow::Result<Box<dyn Executor + Send + 'static>> {
    let comm = ch08tp::comm::MpiComm::init()?;
    use ch08tp::Communicator;
    if comm.world() != world || comm.rank() != 0 {
        bail!(
            "--tensor-parallel-size {world} under MPI needs {world} processes with this one first \
             (this is rank {} of {}): mpirun -n 1 kiln ... : -n {} kiln tp-worker --model DIR",
            comm.rank(),
            comm.world(),
            world.saturating_sub(1)
        );
    }
    let shard = load_shard(args, 0, world)?;
    let executor = ch08tp::RankGroupExecutor::new(shard, comm, block_size, blocks)?;
    let layout = executor.kv_layout();
    eprintln!(
        "kiln: tensor parallel over MPI: {world} processes, {} KV heads and {} blocks per rank",
        layout.num_kv_heads, layout.num_blocks
    );
    Ok(Box::new(executor))
}

#[cfg(not(feature = "mpi"))]
fn mpi_rank0(
    _: &ModelArgs,
    _: usize,
    _: usize,
    _: KvBlocks,
) -> anyhow::Result<Box<dyn Executor + Send + 'static>> {
    bail!(
        "--tensor-parallel-backend mpi: this kiln was built without MPI (cargo build --release --features mpi)"
    )
}

/// `kiln tp-worker`: rank 1.. of a group started by mpirun.
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// The model rank 0 runs (the same directory and --dtype / --quantization).
    #[command(flatten)]
    pub model: ModelArgs,
}

/// Runs this process's rank until rank 0 closes the group.
#[cfg(feature = "mpi")]
pub fn run_worker(args: WorkerArgs) -> anyhow::Result<()> {
    use ch08tp::Communicator;
    let comm = ch08tp::comm::MpiComm::init()?;
    let (rank, world) = (comm.rank(), comm.world());
    if rank == 0 {
        bail!("kiln tp-worker is rank 1.. of an MPI group: start rank 0 with a kiln command first");
    }
    let shard = load_shard(&args.model, rank, world)?;
    ch08tp::run_worker(shard, comm).with_context(|| format!("tensor-parallel rank {rank}"))
}

#[cfg(not(feature = "mpi"))]
pub fn run_worker(_: WorkerArgs) -> anyhow::Result<()> {
    bail!("kiln tp-worker: this kiln was built without MPI (cargo build --release --features mpi)")
}

#[cfg(test)]
mod tests {
    use super::{Backend, TensorParallelArgs};
    use crate::commands::ModelArgs;

    fn ranks(n: usize) -> TensorParallelArgs {
        TensorParallelArgs {
            tensor_parallel_size: n,
            tensor_parallel_backend: Backend::Threads,
        }
    }

    /// With tensor parallelism the host decodes no weight (each rank loads its own shard, and
    /// generate and serve load through `load_host`), unless a drafter runs the target's first
    /// layers from host memory; on one rank the host keeps the weights its executor runs.
    #[test]
    fn the_ranks_host_keeps_no_weights_unless_a_drafter_runs_the_targets_layers() {
        let args = ModelArgs::cpu(ch01::default_model_dir());
        let (host, model) = ranks(2).load_host(&args, false).unwrap();
        assert!(model.is_none());
        let (whole_host, whole) = ranks(2).load_host(&args, true).unwrap();
        let whole = whole.expect("the layer-skip drafter's copy");
        assert_eq!(whole.config, host.config);
        assert_eq!(whole_host.config, host.config);
        assert!(ranks(1).load_host(&args, false).unwrap().1.is_some());
    }
}
