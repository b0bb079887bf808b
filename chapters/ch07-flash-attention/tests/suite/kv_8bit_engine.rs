//! The engine on chapter 5's 8-bit KV pools (`--kv-cache-dtype fp8_e4m3|int8`), on the
//! shakespeare-tiny fixture: what the memory holds, how close the model stays to its f32 self,
//! and that preemption by swapping keeps codes and scales (no block leaks after any run).

use ch01::testing::{relative_l2, top2_margin};
use ch01::{Llama, fixtures_dir};
use ch03::{KvDtype, KvElement, KvPool};
use ch04::{
    CacheConfig, CpuExecutor, Engine, EngineConfig, Executor, Preemption, Request, ScheduledSeq,
    SchedulerOutput,
};
use ch05::fp8::F8E4M3;
use ch05::kv_cache::KvInt8;
use ch07_flash_attention::{AttentionKind, cpu_executor};

fn model() -> Llama {
    ch02::load_fast(
        &fixtures_dir().join("shakespeare-tiny"),
        ch02::WeightDtype::F32,
    )
    .unwrap()
}

#[test]
fn the_same_memory_holds_the_tokens_its_layout_says() {
    let model = model();
    let (layers, heads, d) = (4u64, 2u64, 32u64); // shakespeare-tiny
    let cache = |dtype| CacheConfig {
        memory: 1 << 24,
        block_size: 16,
        dtype,
    };
    let layout = |dtype| {
        cpu_executor(&model, &cache(dtype), AttentionKind::Auto)
            .unwrap()
            .kv_layout()
    };
    let f32_kv = layout(KvDtype::F32);
    for dtype in [KvDtype::Fp8E4M3, KvDtype::Int8] {
        let kv = layout(dtype);
        assert_eq!(kv.dtype, dtype);
        // K and V, every layer and position: head_dim one-byte codes and a 4-byte scale per head.
        assert_eq!(kv.bytes_per_block(), 2 * layers * 16 * heads * (d + 4));
        assert_eq!(kv.num_blocks as u64, (1 << 24) / kv.bytes_per_block());
        // 4 bytes per element against (d + 4) / d: 128 / 36 = 3.56× at head_dim 32 (3.76× at
        // SmolLM2's 64), less what a last partial block loses.
        let ratio = kv.token_capacity() as f64 / f32_kv.token_capacity() as f64;
        let exact = (4 * d) as f64 / (d + 4) as f64;
        assert!(
            (ratio - exact).abs() < 0.005,
            "{dtype}: {ratio:.3}× vs {exact:.3}×"
        );
    }
}

/// The logits of a prefill of `prompt`, then of one decode per token of `decodes`, on a pool of
/// `K`: every position's K/V written once, in 8 bits for an 8-bit `K`.
fn logits<K: KvElement>(model: &Llama, prompt: &[u32], decodes: &[u32]) -> Vec<Vec<f32>> {
    let pool = KvPool::<K>::new(&model.config, 4, 32).unwrap();
    let mut executor = CpuExecutor::with_backend(model, pool, AttentionKind::Auto.backend());
    let blocks: Vec<u32> = (0..32).rev().collect();
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
    let mut rows = vec![
        executor
            .execute(&step(prompt.to_vec(), 0))
            .unwrap()
            .row(0)
            .to_vec(),
    ];
    for (i, &token) in decodes.iter().enumerate() {
        let row = executor.execute(&step(vec![token], prompt.len() + i));
        rows.push(row.unwrap().row(0).to_vec());
    }
    rows
}

#[test]
fn logits_over_8_bit_kv_stay_close_to_f32_kv() {
    let model = model();
    let prompt: Vec<u32> = vec![0, 412, 306, 13, 534, 325, 291, 306, 13, 330, 17];
    let decodes: Vec<u32> = vec![64, 291, 13, 534, 306, 17, 412, 325];
    let reference = logits::<f32>(&model, &prompt, &decodes);
    // Not equal: every K/V element is rounded once (int8 to within max|row| / 254, E4M3 to 2⁻⁴
    // of itself), and the logits move with them. Measured here, relative L2 per row: int8
    // 2.5e-4 to 9.3e-4, E4M3 1.2e-3 to 8.1e-3 (E4M3's 3 mantissa bits are coarser than int8's
    // 7 for a row's large elements). The bounds give about 5× headroom; a kernel that dropped
    // the scales is off by orders of magnitude.
    for (dtype, rows, allowed) in [
        (
            KvDtype::Int8,
            logits::<KvInt8>(&model, &prompt, &decodes),
            5e-3,
        ),
        (
            KvDtype::Fp8E4M3,
            logits::<F8E4M3>(&model, &prompt, &decodes),
            4e-2,
        ),
    ] {
        let mut agree = 0;
        for (step, (row, want)) in rows.iter().zip(&reference).enumerate() {
            let rel = relative_l2(row, want);
            assert!(rel <= allowed, "{dtype} step {step}: relative L2 {rel:.3e}");
            assert!(
                rel > 0.0 || step == 0,
                "{dtype} step {step}: nothing was rounded"
            );
            let (a, b) = (top2_margin(row).0, top2_margin(want).0);
            agree += usize::from(a == b);
        }
        // The greedy token: measured, E4M3 agrees at all 9 steps, int8 at 8 (step 1 is a near
        // tie in f32 that int8's rounding flips). Not equality: a tie can go either way.
        assert!(
            agree >= rows.len() - 1,
            "{dtype}: top token agrees at {agree} of {}",
            rows.len()
        );
    }
}

/// Greedy outputs of `requests` on an engine with a pool of `blocks` blocks of `K`.
fn greedy<K: KvElement>(model: &Llama, blocks: usize, swap: bool) -> (Vec<Vec<u32>>, u64) {
    let config = EngineConfig {
        max_num_batched_tokens: 24,
        preemption: if swap {
            Preemption::Swap
        } else {
            Preemption::Recompute
        },
        watermark: 0.0,
        ..EngineConfig::default()
    };
    let pool = KvPool::<K>::new(&model.config, 4, blocks).unwrap();
    let executor = CpuExecutor::with_backend(model, pool, AttentionKind::Auto.backend());
    let mut engine = Engine::new(executor, config).unwrap();
    let requests: Vec<Request> = (0..4)
        .map(|i| Request::greedy(vec![0, 412 + i, 306, 13, 534, 325], 14))
        .collect();
    let done = engine.generate(requests).unwrap();
    let scheduler = engine.scheduler();
    scheduler.check_invariants().unwrap();
    assert_eq!(scheduler.kv_usage(), 0.0, "every block back after the run");
    let preemptions = scheduler.counters().preemptions;
    (done.into_iter().map(|c| c.tokens).collect(), preemptions)
}

#[test]
fn swapping_8_bit_blocks_keeps_their_scales() {
    let model = model();
    for (dtype, roomy, tight) in [
        (
            KvDtype::Int8,
            greedy::<KvInt8>(&model, 200, false),
            greedy::<KvInt8>(&model, 12, true),
        ),
        (
            KvDtype::Fp8E4M3,
            greedy::<F8E4M3>(&model, 200, false),
            greedy::<F8E4M3>(&model, 12, true),
        ),
    ] {
        assert_eq!(roomy.1, 0, "{dtype}: 200 blocks preempt nothing");
        assert!(tight.1 > 0, "{dtype}: 12 blocks forced no preemption");
        // Each position is quantized on its own, whatever else runs in the step: swapped out
        // and back in (codes and scales), a sequence computes what it computed undisturbed.
        assert_eq!(tight.0, roomy.0, "{dtype}");
        assert!(tight.0.iter().all(|t| t.len() == 14));
    }
}
