//! Shard specs: which part of a projection one tensor-parallel rank holds.
//!
//! A Hugging Face linear weight is `[out_features, in_features]` and computes `y = x Wᵀ + b`.
//! Split among `world` ranks it can be cut two ways:
//!
//! ```text
//! Column: rank r holds rows    r·out/world .. (r+1)·out/world of W and the same slice of b;
//!         it computes its slice of y, and the slices concatenate to y.
//! Row:    rank r holds columns r·in/world  .. (r+1)·in/world  of W (and b only on rank 0);
//!         it reads its slice of x, and the partial outputs sum to y (an all-reduce, chapter 8).
//! ```
//!
//! Chapter 1 runs one rank (`ShardSpec::whole()`); chapter 8 loads one model per rank with
//! [`crate::Llama::load_shard`] and adds the communication.

use std::ops::Range;

/// How a projection is split among ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds the whole layer.
    Whole,
    /// Split the output features (the rows of `[out, in]`).
    Column,
    /// Split the input features (the columns of `[out, in]`).
    Row,
}

/// One rank's part of a projection. Valid when `world >= 1`, `rank < world` and the split
/// dimension divides by `world` ([`ShardSpec::ranges`] checks all three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    pub split: Split,
    pub rank: usize,
    pub world: usize,
}

/// A shard spec or tensor-parallel world that does not fit the sizes it is applied to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    #[error("tensor-parallel world size must be at least 1")]
    EmptyWorld,
    #[error("rank {rank} is outside a tensor-parallel world of {world}")]
    RankOutOfRange { rank: usize, world: usize },
    #[error("{what} = {size} does not divide by the tensor-parallel world size {world}")]
    NotDivisible {
        what: String,
        size: usize,
        world: usize,
    },
}

impl ShardSpec {
    /// The whole layer on a single rank: what chapters 1–7 load.
    pub const fn whole() -> Self {
        ShardSpec {
            split: Split::Whole,
            rank: 0,
            world: 1,
        }
    }

    /// Rank `rank`'s rows (output features) of `world`.
    pub const fn column(rank: usize, world: usize) -> Self {
        ShardSpec {
            split: Split::Column,
            rank,
            world,
        }
    }

    /// Rank `rank`'s columns (input features) of `world`.
    pub const fn row(rank: usize, world: usize) -> Self {
        ShardSpec {
            split: Split::Row,
            rank,
            world,
        }
    }

    /// Checks `world >= 1` and `rank < world`.
    pub fn check_rank(&self) -> Result<(), ShardError> {
        check_rank(self.rank, self.world)
    }

    /// The rows (output features) and columns (input features) of the full `[out, in]` weight
    /// that this rank holds. `name` labels the error when the split dimension does not divide.
    pub fn ranges(
        &self,
        name: &str,
        in_features: usize,
        out_features: usize,
    ) -> Result<(Range<usize>, Range<usize>), ShardError> {
        self.check_rank()?;
        let part = |size: usize, what: &str| -> Result<Range<usize>, ShardError> {
            if size % self.world != 0 {
                return Err(ShardError::NotDivisible {
                    what: format!("{what} of `{name}`"),
                    size,
                    world: self.world,
                });
            }
            let n = size / self.world;
            Ok(self.rank * n..(self.rank + 1) * n)
        };
        Ok(match self.split {
            Split::Whole => (0..out_features, 0..in_features),
            Split::Column => (part(out_features, "out_features")?, 0..in_features),
            Split::Row => (0..out_features, part(in_features, "in_features")?),
        })
    }

    /// Whether this rank holds the bias: every rank but those of a row split after rank 0 (the
    /// row shards' outputs are summed, so the bias must be added exactly once).
    pub fn holds_bias(&self) -> bool {
        self.split != Split::Row || self.rank == 0
    }
}

/// A model-level tensor-parallel placement: rank `rank` of `world`.
///
/// [`crate::Llama::load_shard`] splits q/k/v, gate and up by column (each rank owns whole heads
/// and whole intermediate features) and o_proj and down_proj by row (their partial outputs are
/// summed), so one all-reduce after attention and one after the MLP restore the full hidden
/// state. The embeddings, norms and lm_head stay whole on every rank: they are a small part of
/// the weights, and keeping them whole means every rank holds full logits without a gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallel {
    pub rank: usize,
    pub world: usize,
}

impl TensorParallel {
    /// One rank holding everything.
    pub const fn whole() -> Self {
        TensorParallel { rank: 0, world: 1 }
    }

    /// The spec of a projection with this split on this rank.
    pub const fn spec(&self, split: Split) -> ShardSpec {
        ShardSpec {
            split,
            rank: self.rank,
            world: self.world,
        }
    }

    /// Checks `world >= 1`, `rank < world`, and that every named size divides by `world`.
    pub fn check(&self, sizes: &[(&str, usize)]) -> Result<(), ShardError> {
        check_rank(self.rank, self.world)?;
        for &(what, size) in sizes {
            if size % self.world != 0 {
                return Err(ShardError::NotDivisible {
                    what: what.to_string(),
                    size,
                    world: self.world,
                });
            }
        }
        Ok(())
    }
}

impl Default for TensorParallel {
    fn default() -> Self {
        TensorParallel::whole()
    }
}

fn check_rank(rank: usize, world: usize) -> Result<(), ShardError> {
    if world == 0 {
        return Err(ShardError::EmptyWorld);
    }
    if rank >= world {
        return Err(ShardError::RankOutOfRange { rank, world });
    }
    Ok(())
}
