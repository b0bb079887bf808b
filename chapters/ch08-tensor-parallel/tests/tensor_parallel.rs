//! Tensor-parallel N equals N = 1: the logits of a prefill and of decode steps over ranks equal
//! chapter 4's executor on the whole model within f32's tolerance, for every world that splits
//! each fixture model's heads (2, 4, 8; replicated KV heads where ranks outnumber them); each
//! rank's KV pool holds only its heads; a world that does not fit is a typed error.

use ch01::linear::DenseLoader;
use ch01::testing::{Tolerance, assert_close_shaped};
use ch01::{Llama, LlamaConfig, ShardError, fixtures_dir};
use ch03::KvPool;
use ch04::{CpuExecutor, Executor, ScheduledSeq, SchedulerOutput};
use ch08_tensor_parallel::{
    Communicator, KvBlocks, TensorParallelExecutor, load_shards, thread_group,
};

/// Every world of 2..=8 that the model's sizes allow.
fn worlds(config: &LlamaConfig) -> Vec<usize> {
    (2..=8)
        .filter(|&w| ch08_tensor_parallel::load::check_world(config, w).is_ok())
        .collect()
}

/// Two sequences: one prefilling 13 tokens (every row's logits), one decoding after a 5-token
/// prefill; then one decode step each. Block size 4, distinct blocks per sequence.
fn steps() -> Vec<SchedulerOutput> {
    let seq = |id, tokens: Vec<u32>, start_pos, blocks: Vec<u32>, logit_rows| ScheduledSeq {
        id,
        tokens,
        start_pos,
        block_table: blocks,
        logit_rows,
    };
    let step = |seqs| SchedulerOutput {
        seqs,
        ..SchedulerOutput::default()
    };
    let a: Vec<u32> = vec![3, 17, 99, 250, 7, 1024, 2100, 4095, 5, 64, 1, 2, 900];
    let b: Vec<u32> = vec![40, 41, 3000, 12, 8];
    vec![
        step(vec![
            seq(0, a.clone(), 0, vec![0, 1, 2, 3], a.len()),
            seq(1, b.clone(), 0, vec![4, 5], 1),
        ]),
        step(vec![
            seq(0, vec![77], a.len(), vec![0, 1, 2, 3], 1),
            seq(1, vec![2048], b.len(), vec![4, 5], 1),
        ]),
        step(vec![seq(1, vec![1], b.len() + 1, vec![4, 5], 1)]),
    ]
}

#[test]
fn tensor_parallel_logits_equal_one_rank_for_every_world_of_every_fixture() {
    let fixtures = [
        "shakespeare-tiny",
        "shakespeare-small",
        "random/gqa",
        "random/mha",
        "random/qwen2",
        "random/untied",
        "random/head-dim",
    ];
    let mut compared = 0;
    for name in fixtures {
        let dir = fixtures_dir().join(name);
        let whole = Llama::load(&dir).unwrap();
        let pool = KvPool::<f32>::new(&whole.config, 4, 8).unwrap();
        let mut reference = CpuExecutor::new(&whole, pool);
        let expected: Vec<Vec<f32>> = steps()
            .iter()
            .map(|s| reference.execute(s).unwrap().iter().copied().collect())
            .collect();
        let worlds = worlds(&whole.config);
        assert!(worlds.contains(&2), "{name}: {worlds:?}");
        for world in worlds {
            let shards = load_shards(&dir, &DenseLoader, world).unwrap();
            let mut tp = TensorParallelExecutor::new(shards, 4, KvBlocks::Count(8), 1).unwrap();
            assert_eq!(tp.model_spec(), reference.model_spec());
            for (i, (step, expected)) in steps().iter().zip(&expected).enumerate() {
                let logits = tp.execute(step).unwrap();
                let got: Vec<f32> = logits.iter().copied().collect();
                assert_close_shaped(
                    &format!("{name}, {world} ranks, step {i}"),
                    &got,
                    expected,
                    &[logits.nrows(), logits.ncols()],
                    Tolerance::F32,
                );
            }
            compared += 1;
        }
    }
    // 2 and 4 on every fixture, 8 where there are 8 query heads.
    assert!(compared >= 16, "{compared} comparisons");
}

#[test]
fn each_rank_pool_holds_only_its_kv_heads() {
    let dir = fixtures_dir().join("shakespeare-small"); // 8 query heads, 2 KV heads, d = 32
    let whole = Llama::load(&dir).unwrap();
    let c = &whole.config;
    for (world, kv_heads, q_heads) in [(1, 2, 8), (2, 1, 4), (4, 1, 2), (8, 1, 1)] {
        let shards = load_shards(&dir, &DenseLoader, world).unwrap();
        let tp =
            TensorParallelExecutor::new(shards, 16, KvBlocks::BudgetPerRank(1 << 20), 1).unwrap();
        let layout = tp.kv_layout();
        assert_eq!(layout.num_kv_heads, kv_heads, "world {world}");
        assert_eq!(tp.rank0().pool().kv_dim(), kv_heads * c.head_dim);
        assert_eq!(tp.rank0().local().num_attention_heads, q_heads);
        // The same bytes per rank hold `world / replication` times the blocks of one rank.
        let one_rank_blocks = (1 << 20) / (2 * c.num_hidden_layers * 16 * 2 * c.head_dim * 4);
        assert_eq!(layout.num_blocks, one_rank_blocks * 2 / kv_heads);
    }
}

#[test]
fn a_world_that_does_not_split_the_model_is_a_clear_error() {
    let dir = fixtures_dir().join("shakespeare-tiny"); // 4 query heads
    let error = load_shards(&dir, &DenseLoader, 3).err().unwrap();
    assert!(
        matches!(&error, ch01::Error::Shard(ShardError::NotDivisible { what, size: 4, world: 3 }) if what == "num_attention_heads"),
        "{error}"
    );
    assert!(
        error.to_string().contains("num_attention_heads = 4"),
        "{error}"
    );
    assert!(matches!(
        load_shards(&dir, &DenseLoader, 0),
        Err(ch01::Error::Shard(ShardError::EmptyWorld))
    ));
    // Shards given to the wrong ranks are refused, not run.
    let mut shards = load_shards(&dir, &DenseLoader, 2).unwrap();
    shards.swap(0, 1);
    assert!(TensorParallelExecutor::new(shards, 4, KvBlocks::Count(4), 1).is_err());
    // So are communicator handles that are not one per rank, in rank order.
    let boxed = |comms: Vec<ch08_tensor_parallel::ThreadComm>| {
        let boxed = comms
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>);
        boxed.collect::<Vec<_>>()
    };
    let two = || load_shards(&dir, &DenseLoader, 2).unwrap();
    let three = boxed(thread_group(3).unwrap());
    assert!(TensorParallelExecutor::with_comms(two(), three, 4, KvBlocks::Count(4), 1).is_err());
    let mut reversed = boxed(thread_group(2).unwrap());
    reversed.reverse();
    assert!(TensorParallelExecutor::with_comms(two(), reversed, 4, KvBlocks::Count(4), 1).is_err());
    let in_order = boxed(thread_group(2).unwrap());
    assert!(TensorParallelExecutor::with_comms(two(), in_order, 4, KvBlocks::Count(4), 1).is_ok());
}
