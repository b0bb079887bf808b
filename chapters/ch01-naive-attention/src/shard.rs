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
//! [`crate::Llama::load_shard`] and adds the communication (the all-reduces and all-gathers).

use std::ops::Range;

use crate::config::LlamaConfig;

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
    #[error(
        "num_key_value_heads = {num_kv_heads} neither divides by nor divides the tensor-parallel \
         world size {world}: ranks cannot hold whole KV heads (split or replicated)"
    )]
    KvHeads { num_kv_heads: usize, world: usize },
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
        // ANCHOR: task_8_3
        self.check_rank()?;
        let part = |size: usize, what: &str| -> Result<Range<usize>, ShardError> {
            if !size.is_multiple_of(self.world) {
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
        // ANCHOR_END: task_8_3
    }

    /// Whether this rank holds the bias: every rank but those of a row split after rank 0 (the
    /// row shards' outputs are summed, so the bias must be added exactly once).
    pub fn holds_bias(&self) -> bool {
        self.split != Split::Row || self.rank == 0
    }
}

/// A model-level tensor-parallel placement: rank `rank` of `world` (Megatron-LM's split).
///
/// [`crate::Llama::load_shard`] splits q/k/v, gate and up by column (each rank owns whole heads
/// and whole intermediate features) and o_proj and down_proj by row (their partial outputs are
/// summed), so one all-reduce after attention and one after the MLP restore the full hidden
/// state. The embedding table and the output head are split by vocabulary: each rank holds the
/// rows of the tokens in [`TensorParallel::vocab_range`], its embedding of the other tokens is
/// zero (an all-reduce sums the parts), and its head computes those tokens' logits (an
/// all-gather joins them). The norms stay whole on every rank.
///
/// With more ranks than KV heads, the KV heads are replicated rather than split (see
/// [`TensorParallel::kv_spec`]).
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

    /// The spec of k_proj and v_proj for a model of `num_kv_heads`. When `world` divides
    /// `num_kv_heads`, a column split like q's. When `world` is a multiple of `num_kv_heads`
    /// (more ranks than KV heads), each KV head is replicated on `world / num_kv_heads`
    /// consecutive ranks: rank `r` holds head `r / (world / num_kv_heads)`, the one its query
    /// heads read (column `r · kv / world` of a world of `num_kv_heads`). Otherwise no rank's
    /// query heads would form whole groups over whole KV heads: an error.
    // ANCHOR: kv_spec
    pub fn kv_spec(&self, num_kv_heads: usize) -> Result<ShardSpec, ShardError> {
        // ANCHOR: task_8_4
        check_rank(self.rank, self.world)?;
        if num_kv_heads.is_multiple_of(self.world) {
            Ok(self.spec(Split::Column))
        } else if num_kv_heads > 0 && self.world.is_multiple_of(num_kv_heads) {
            let copies = self.world / num_kv_heads;
            Ok(ShardSpec::column(self.rank / copies, num_kv_heads))
        } else {
            Err(ShardError::KvHeads {
                num_kv_heads,
                world: self.world,
            })
        }
        // ANCHOR_END: task_8_4
    }
    // ANCHOR_END: kv_spec

    /// The token ids whose embedding rows and logits this rank holds: `vocab_size / world`
    /// consecutive ids (the vocabulary must divide by `world`; [`Self::check`] it first).
    pub fn vocab_range(&self, vocab_size: usize) -> Range<usize> {
        let n = vocab_size / self.world.max(1);
        self.rank * n..(self.rank + 1) * n
    }

    /// Checks that this placement can split a model of `config`: the query heads,
    /// intermediate size and vocabulary divide by `world`, and the KV heads divide by it or
    /// divide it. Returns the spec of k_proj and v_proj ([`Self::kv_spec`]).
    pub fn check_model(&self, config: &LlamaConfig) -> Result<ShardSpec, ShardError> {
        self.check(&[
            ("num_attention_heads", config.num_attention_heads),
            ("intermediate_size", config.intermediate_size),
            ("vocab_size", config.vocab_size),
        ])?;
        self.kv_spec(config.num_key_value_heads)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_heads_split_when_they_divide_and_replicate_when_ranks_outnumber_them() {
        let kv = |rank, world, heads| TensorParallel { rank, world }.kv_spec(heads);
        // 4 KV heads on 2 ranks: a column split of world 2.
        assert_eq!(kv(1, 2, 4), Ok(ShardSpec::column(1, 2)));
        // 2 KV heads on 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 hold head 1.
        let heads: Vec<_> = (0..4).map(|r| kv(r, 4, 2).unwrap().rank).collect();
        assert_eq!(heads, [0, 0, 1, 1]);
        assert!(kv(3, 4, 2).unwrap().world == 2);
        // 4 KV heads on 6 ranks: neither divides the other.
        assert_eq!(
            kv(0, 6, 4),
            Err(ShardError::KvHeads {
                num_kv_heads: 4,
                world: 6
            })
        );
        assert_eq!(kv(0, 0, 4), Err(ShardError::EmptyWorld));
    }

    #[test]
    fn vocab_ranges_tile_the_vocabulary() {
        let ranges: Vec<_> = (0..4)
            .map(|rank| TensorParallel { rank, world: 4 }.vocab_range(4096))
            .collect();
        assert_eq!(ranges, [0..1024, 1024..2048, 2048..3072, 3072..4096]);
        assert_eq!(TensorParallel::whole().vocab_range(7), 0..7);
    }
}
