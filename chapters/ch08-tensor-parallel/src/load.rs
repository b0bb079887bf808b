//! [`load_shards`]: one model shard per rank, through chapter 1's loader and shard specs;
//! [`load_shard`]: one rank's alone (a process of a group loads only its own).

use std::path::Path;

use ch01::linear::LinearLoader;
use ch01::{Llama, LlamaConfig, TensorParallel, Weights};

/// Rank `r`'s part of the model in `dir` for `r` in `0..world`, each projection built by
/// `loader`. The checkpoint is opened once (safetensors are memory-mapped: each rank decodes
/// only its rows or columns).
///
/// Errors, before any weight is decoded, when `world` is 0 or does not fit the model: the query
/// heads, intermediate size and vocabulary must divide by `world`, and the KV heads must divide
/// by it or divide it ([`TensorParallel::kv_spec`]).
pub fn load_shards(
    dir: &Path,
    loader: &dyn LinearLoader,
    world: usize,
) -> Result<Vec<Llama>, ch01::Error> {
    let config = LlamaConfig::from_dir(dir)?;
    check_world(&config, world)?;
    let weights = Weights::open(dir)?;
    (0..world)
        .map(|rank| {
            let shard = TensorParallel { rank, world };
            Llama::from_source(config.clone(), &weights, loader, shard)
        })
        .collect()
}

/// Rank `rank`'s part of the model in `dir` (of `world`), as [`load_shards`] loads it; the
/// same errors, and one for a rank outside the world.
pub fn load_shard(
    dir: &Path,
    loader: &dyn LinearLoader,
    rank: usize,
    world: usize,
) -> Result<Llama, ch01::Error> {
    let config = LlamaConfig::from_dir(dir)?;
    check_world(&config, world)?;
    if rank >= world {
        return Err(ch01::ShardError::RankOutOfRange { rank, world }.into());
    }
    let weights = Weights::open(dir)?;
    Llama::from_source(config, &weights, loader, TensorParallel { rank, world })
}

/// Checks that `world` ranks can split a model of `config`: the error `load_shards` returns.
pub fn check_world(config: &LlamaConfig, world: usize) -> Result<(), ch01::ShardError> {
    TensorParallel { rank: 0, world }
        .check_model(config)
        .map(|_| ())
}
