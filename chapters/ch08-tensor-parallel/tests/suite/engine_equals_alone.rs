//! The engine over tensor-parallel ranks changes where tokens are computed, never which: chapter
//! 4's scenario (random arrivals, budgets, chunked prefill, both kinds of preemption, prefix
//! caching, aborts; every block back afterwards) with the executor replaced by 2 and by 4 ranks
//! of shakespeare-tiny (4 query heads, 2 KV heads: at 4 ranks each KV head is replicated twice),
//! and by ranks that share only a communicator (the step sent as bytes, as between processes).

use crate::engine_scenario;

use ch01::fixtures_dir;
use ch02::{FastLoader, WeightDtype};
use ch08_tensor_parallel::{
    KvBlocks, RankGroupExecutor, TensorParallelExecutor, WorkerError, load_shards, run_worker,
    thread_group,
};

fn with_world(world: usize) {
    let dir = fixtures_dir().join("shakespeare-tiny");
    engine_scenario::every_request_equals_generating_it_alone_with(&|_model, pool| {
        // The same fast f32 layers as the scenario's whole model, split across `world` ranks.
        let loader = FastLoader {
            dtype: WeightDtype::F32,
        };
        let shards = load_shards(&dir, &loader, world).unwrap();
        let blocks = KvBlocks::Count(pool.num_blocks());
        Box::new(TensorParallelExecutor::new(shards, pool.block_size(), blocks, 1).unwrap())
    });
}

#[test]
fn every_request_equals_generating_it_alone_on_two_ranks() {
    with_world(2);
}

#[test]
fn every_request_equals_generating_it_alone_on_four_ranks_with_replicated_kv_heads() {
    with_world(4);
}

#[test]
fn every_request_equals_generating_it_alone_on_ranks_that_share_only_messages() {
    // 2 ranks, the second a thread standing in for a process: nothing shared but the
    // communicator, every step sent as bytes.
    let dir = fixtures_dir().join("shakespeare-tiny");
    engine_scenario::every_request_equals_generating_it_alone_with(&|_model, pool| {
        let loader = FastLoader {
            dtype: WeightDtype::F32,
        };
        let mut shards = load_shards(&dir, &loader, 2).unwrap().into_iter();
        let mut comms = thread_group(2).unwrap().into_iter();
        let (shard0, comm0) = (shards.next().unwrap(), comms.next().unwrap());
        for (shard, comm) in shards.zip(comms) {
            // Ends when the executor below is dropped (its empty message closes the group).
            std::thread::spawn(move || run_worker(shard, comm).unwrap());
        }
        let blocks = KvBlocks::Count(pool.num_blocks());
        Box::new(RankGroupExecutor::new(shard0, comm0, pool.block_size(), blocks).unwrap())
    });
}

/// A worker whose shard is stored otherwise than rank 0's (bf16 against f32) refuses the
/// group's plan instead of adding its partial sums to rank 0's.
#[test]
fn a_worker_with_another_model_refuses_the_plan() {
    let dir = fixtures_dir().join("shakespeare-tiny");
    let load = |dtype| load_shards(&dir, &FastLoader { dtype }, 2).unwrap();
    let shard0 = load(WeightDtype::F32).into_iter().next().unwrap();
    let shard1 = load(WeightDtype::Bf16).into_iter().nth(1).unwrap();
    let mut comms = thread_group(2).unwrap().into_iter();
    let (comm0, comm1) = (comms.next().unwrap(), comms.next().unwrap());
    let worker = std::thread::spawn(move || run_worker(shard1, comm1));
    let _rank0 = RankGroupExecutor::new(shard0, comm0, 4, KvBlocks::Count(8)).unwrap();
    let refused = worker.join().unwrap();
    assert!(
        matches!(refused, Err(WorkerError::OtherModel)),
        "{refused:?}"
    );
}
