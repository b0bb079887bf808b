//! `--tensor-parallel-size N`: the engine's executor over N ranks (chapter 8), shared by every
//! command that runs the engine. N = 1 is chapter 7's CPU executor.

use anyhow::{Context, bail};
use ch01::Llama;
use ch03::KvDtype;
use ch04::{CacheConfig, Executor};
use ch07::AttentionKind;
use ch08tp::{KvBlocks, TensorParallelExecutor};

use super::ModelArgs;

/// `--tensor-parallel-size`, on the commands that run the engine (generate, perplexity, serve).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct TensorParallelArgs {
    /// Split the model across N ranks (chapter 8's tensor parallelism): threads of this
    /// process, each holding 1/N of the projections, of the vocabulary and of the KV heads,
    /// meeting in two all-reduces per layer. N must divide the query heads, the intermediate
    /// size and the vocabulary, and divide or be a multiple of the KV heads.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tensor_parallel_size: usize,
}

impl TensorParallelArgs {
    /// The engine's executor: over `model` on one rank, or over `--tensor-parallel-size` shards
    /// loaded from `--model`, each rank with `cache.memory` bytes of KV blocks (memory is per
    /// device, as a GPU's is) and an equal share of this thread pool's threads.
    pub fn executor<'m>(
        &self,
        args: &ModelArgs,
        model: &'m Llama,
        cache: &CacheConfig,
        attention: AttentionKind,
    ) -> anyhow::Result<Box<dyn Executor + Send + 'm>> {
        let world = self.tensor_parallel_size;
        if world == 1 {
            return Ok(ch07::cpu_executor(model, cache, attention)?);
        }
        Ok(Box::new(
            self.tensor_parallel_executor(args, cache, attention)?,
        ))
    }

    /// `--tensor-parallel-size` ranks over shards of `--model` (see [`Self::executor`]).
    pub fn tensor_parallel_executor(
        &self,
        args: &ModelArgs,
        cache: &CacheConfig,
        attention: AttentionKind,
    ) -> anyhow::Result<TensorParallelExecutor> {
        let world = self.tensor_parallel_size;
        if args.is_gguf() {
            bail!(
                "--tensor-parallel-size {world}: GGUF files load on one rank only (use a Hugging Face directory)"
            );
        }
        if attention == AttentionKind::Flash {
            bail!(
                "--tensor-parallel-size {world} runs chapter 4's attention: --attention-backend flash is one rank only"
            );
        }
        if cache.dtype != KvDtype::F32 {
            bail!("--tensor-parallel-size {world} stores K/V in f32: pass --kv-cache-dtype f32");
        }
        let loader = args.loader()?;
        let shards = ch08tp::load_shards(&args.model, &*loader, world)
            .with_context(|| format!("splitting {} across {world} ranks", args.model.display()))?;
        let threads = (rayon::current_num_threads() / world).max(1);
        let executor = TensorParallelExecutor::new(
            shards,
            cache.block_size,
            KvBlocks::BudgetPerRank(cache.memory),
            threads,
        )?;
        let layout = executor.kv_layout();
        eprintln!(
            "kiln: tensor parallel: {world} ranks x {threads} threads, {} KV heads and {} blocks per rank",
            layout.num_kv_heads, layout.num_blocks
        );
        Ok(executor)
    }
}
