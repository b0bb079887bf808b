//! The measurements of `kiln bench ch03`: block counts of shared sequences (the block manager
//! alone: memory does not depend on the numbers in it) and timings on the model.

use std::time::{Duration, Instant};

use ch01::Llama;
use ch02::cached::Workspace;
use ch02::{CachedSession, ContiguousKvCache};
use ch03::{BlockManager, BlockTable, KvPool, PagedKv};

/// Blocks in use.
fn used(manager: &BlockManager) -> usize {
    manager.num_blocks() - manager.num_free_blocks()
}

/// Appends `n` tokens to `table` one at a time, as decode does.
fn decode_tokens(manager: &mut BlockManager, table: &mut BlockTable, n: usize) {
    for _ in 0..n {
        manager.reserve(table, 1).expect("the pool is large enough");
        let len = table.num_tokens() + 1;
        manager.commit(table, len);
    }
}

/// Blocks held by `n` samples of one prompt: forked (sharing the prompt's blocks, copying the
/// partial last one on first write) vs `n` independent sequences. Returns (forked, independent).
pub fn parallel_sampling_blocks(
    block_size: usize,
    prompt: usize,
    output: usize,
    n: usize,
) -> (usize, usize) {
    let tokens: Vec<u32> = (0..prompt as u32).collect();
    let pool_blocks = 4 * n * (prompt + output).div_ceil(block_size);
    let mut forked = BlockManager::new(pool_blocks, block_size, false);
    let mut parent = forked.allocate_prompt(&tokens).expect("fits");
    forked.commit(&mut parent, prompt);
    let mut branches: Vec<BlockTable> = (1..n).map(|_| forked.fork(&parent)).collect();
    branches.push(parent);
    for branch in &mut branches {
        decode_tokens(&mut forked, branch, output);
    }
    let mut independent = BlockManager::new(pool_blocks, block_size, false);
    let mut held = Vec::new(); // alive until the count below
    for _ in 0..n {
        let mut table = independent.allocate_prompt(&tokens).expect("fits");
        independent.commit(&mut table, prompt);
        decode_tokens(&mut independent, &mut table, output);
        held.push(table);
    }
    (used(&forked), used(&independent))
}

/// Blocks held by `requests` prompts that share a `system`-token prefix followed by `user`
/// tokens of their own, all alive at once, with the prefix cache on or off.
pub fn shared_prefix_blocks(
    block_size: usize,
    system: usize,
    user: usize,
    requests: usize,
    prefix_caching: bool,
) -> usize {
    let per_request = (system + user).div_ceil(block_size);
    let mut manager = BlockManager::new(requests * per_request + 1, block_size, prefix_caching);
    let mut tables = Vec::new();
    for r in 0..requests {
        let prompt: Vec<u32> = (0..system as u32)
            .chain((0..user as u32).map(|i| 100_000 + (r * user) as u32 + i))
            .collect();
        let mut table = manager.allocate_prompt(&prompt).expect("fits");
        manager.commit(&mut table, prompt.len());
        manager.cache_full_blocks(&table, &prompt);
        tables.push(table);
    }
    used(&manager)
}

/// Time to first token of `user`-token prompts after a `system`-token prefix: (cold, hit),
/// medians of `reps`. Cold: an empty prefix cache. Hit: the prefix's blocks cached by an
/// earlier request with another user part.
pub fn ttft(
    model: &Llama,
    tokens: &[u32],
    system: usize,
    user: usize,
    block_size: usize,
    reps: usize,
) -> (Duration, Duration) {
    let len = system + user;
    let prompt = |variant: usize| -> Vec<u32> {
        tokens[..system]
            .iter()
            .chain(&tokens[system + variant * user..system + (variant + 1) * user])
            .copied()
            .collect()
    };
    let mut cold = Vec::new();
    let mut hit = Vec::new();
    for _ in 0..=reps.max(1) {
        let pool =
            KvPool::new(&model.config, block_size, 4 * len.div_ceil(block_size)).expect("pool");
        let mut kv = PagedKv::new(pool, true);
        let mut ws = Workspace::new(&model.config, len);
        for (variant, times) in [(0, &mut cold), (1, &mut hit)] {
            let start = Instant::now();
            let mut seq = kv.start(&prompt(variant)).expect("fits");
            kv.step(model, &mut seq, &mut ws).expect("valid tokens");
            times.push(start.elapsed());
            kv.free(seq);
        }
    }
    (median(cold[1..].to_vec()), median(hit[1..].to_vec())) // the first round warms up
}

/// Decode tokens/s after a `prompt`-token prefill: (contiguous, paged), one after the other in
/// each of `reps` rounds after an untimed one, medians.
pub fn decode_speed(
    model: &Llama,
    tokens: &[u32],
    prompt: usize,
    decode: usize,
    block_size: usize,
    reps: usize,
) -> (f64, f64) {
    let (mut contiguous, mut paged) = (Vec::new(), Vec::new());
    for _ in 0..=reps.max(1) {
        let mut session = CachedSession::new(
            model,
            ContiguousKvCache::new(&model.config, prompt + decode),
        );
        session.prefill(&tokens[..prompt]).expect("valid tokens");
        let start = Instant::now();
        for &t in &tokens[prompt..prompt + decode] {
            session.decode(t).expect("fits");
        }
        contiguous.push(start.elapsed());

        let pool = KvPool::new(
            &model.config,
            block_size,
            (prompt + decode).div_ceil(block_size) + 1,
        )
        .expect("pool");
        let mut kv = PagedKv::new(pool, false);
        let mut ws = Workspace::new(&model.config, prompt);
        let mut seq = kv.start(&tokens[..prompt]).expect("fits");
        kv.step(model, &mut seq, &mut ws).expect("valid tokens");
        let start = Instant::now();
        for &t in &tokens[prompt..prompt + decode] {
            seq.tokens.push(t);
            kv.step(model, &mut seq, &mut ws).expect("fits");
        }
        paged.push(start.elapsed());
    }
    // The first round warms both paths up.
    let rate = |times: Vec<Duration>| decode as f64 / median(times[1..].to_vec()).as_secs_f64();
    (rate(contiguous), rate(paged))
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}
