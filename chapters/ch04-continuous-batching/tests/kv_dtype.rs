//! The KV cache's storage dtype (`--kv-cache-dtype`): a bf16 pool holds twice the tokens of an
//! f32 one in the same memory, and the model's logits stay within bf16's rounding of f32's.

use ch01::testing::assert_rel_close;
use ch01::{Llama, fixtures_dir};
use ch03::{KvDtype, KvElement, KvPool};
use ch04_continuous_batching::{
    CacheConfig, CpuExecutor, Engine, EngineConfig, Executor, Preemption, Request, ScheduledSeq,
    SchedulerOutput, cpu_executor,
};
use half::bf16;

fn model() -> Llama {
    ch02::load_fast(
        &fixtures_dir().join("shakespeare-tiny"),
        ch02::WeightDtype::F32,
    )
    .unwrap()
}

/// The logits of a prefill of `prompt` then one decode of `next`, on a pool of `K`.
fn prefill_then_decode<K: KvElement>(model: &Llama, prompt: &[u32], next: u32) -> Vec<Vec<f32>> {
    let pool = KvPool::<K>::new(&model.config, 4, 16).unwrap();
    let mut executor = CpuExecutor::new(model, pool);
    let blocks: Vec<u32> = (0..16).rev().collect(); // any blocks, in any order
    let step = |tokens: Vec<u32>, start_pos: usize| SchedulerOutput {
        seqs: vec![ScheduledSeq {
            id: 0,
            tokens,
            start_pos,
            block_table: blocks.clone(),
            logit_rows: 1,
        }],
        ..SchedulerOutput::default()
    };
    let first = executor
        .execute(&step(prompt.to_vec(), 0))
        .unwrap()
        .row(0)
        .to_vec();
    let second = executor
        .execute(&step(vec![next], prompt.len()))
        .unwrap()
        .row(0)
        .to_vec();
    vec![first, second]
}

#[test]
fn bf16_kv_logits_stay_within_rounding_of_the_reference() {
    let model = model();
    let prompt: Vec<u32> = vec![0, 412, 306, 13, 534, 325, 291, 306, 13, 330, 17];
    let next = 64;
    // Chapter 1's forward recomputes everything in f32: the oracle.
    let mut all = prompt.clone();
    let reference = model.forward(&all).unwrap();
    let expected_prefill = reference.row(prompt.len() - 1).to_vec();
    all.push(next);
    let expected_decode = model.forward(&all).unwrap().row(prompt.len()).to_vec();

    let f32_rows = prefill_then_decode::<f32>(&model, &prompt, next);
    assert_rel_close("f32 KV, prefill", &f32_rows[0], &expected_prefill, 1e-5);
    assert_rel_close("f32 KV, decode", &f32_rows[1], &expected_decode, 1e-5);
    // bf16 keeps 8 bits of mantissa: K and V are rounded once, by at most 2⁻⁹ relative, and
    // the logits move by about that much (measured here: see the chapter 4 page).
    let bf16_rows = prefill_then_decode::<bf16>(&model, &prompt, next);
    assert_rel_close("bf16 KV, prefill", &bf16_rows[0], &expected_prefill, 1e-2);
    assert_rel_close("bf16 KV, decode", &bf16_rows[1], &expected_decode, 1e-2);
    // The prefill's last row attends to K/V written in the same step, already rounded.
    assert_ne!(
        bf16_rows[1], f32_rows[1],
        "bf16 storage must round something"
    );
}

#[test]
fn a_bf16_pool_holds_twice_the_tokens_and_serves_a_preempting_workload() {
    let model = model();
    let cache = |dtype| CacheConfig {
        memory: 1 << 16,
        block_size: 4,
        dtype,
    };
    let f32_exec = cpu_executor(&model, &cache(KvDtype::F32)).unwrap();
    let bf16_exec = cpu_executor(&model, &cache(KvDtype::Bf16)).unwrap();
    let (f32_kv, bf16_kv) = (f32_exec.kv_layout(), bf16_exec.kv_layout());
    assert_eq!(bf16_kv.dtype, KvDtype::Bf16);
    assert_eq!(2 * bf16_kv.bytes_per_block(), f32_kv.bytes_per_block());
    assert_eq!(bf16_kv.num_blocks, 2 * f32_kv.num_blocks);

    // A pool too small for every request at once: preemption by swapping moves bf16 blocks.
    let config = EngineConfig {
        max_num_batched_tokens: 24,
        preemption: Preemption::Swap,
        watermark: 0.0,
        ..EngineConfig::default()
    };
    let blocks = 12;
    let pool = KvPool::<bf16>::new(&model.config, 4, blocks).unwrap();
    let mut engine = Engine::new(CpuExecutor::new(&model, pool), config).unwrap();
    let requests: Vec<Request> = (0..4)
        .map(|i| Request::greedy(vec![0, 412 + i, 306, 13, 534, 325], 14))
        .collect();
    let done = engine.generate(requests).unwrap();
    assert!(done.iter().all(|c| c.tokens.len() == 14));
    let scheduler = engine.scheduler();
    assert!(
        scheduler.counters().preemptions > 0,
        "the pool forced no preemption"
    );
    scheduler.check_invariants().unwrap();
    assert_eq!(scheduler.kv_usage(), 0.0);
}
