//! A whole model's decode steps on quantized layers allocate nothing. Its own test binary:
//! the counting allocator sees every thread of the process, so no other test may run beside it.

use ch01::testing::CountingAllocator;
use ch05_quantization::GgmlType;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// A whole model's decode steps on quantized layers do not allocate per step: chapter 2 runs q,
/// k and v (and gate and up) as one parallel region, so a worker may start a second projection
/// while its first waits, and each nesting level keeps its own scratch. The first time a thread
/// nests one level deeper than ever before it makes that level's scratch (a few allocations,
/// once, whenever the scheduling first leads there); an allocation per step would be 64 or more.
#[test]
fn quantized_model_decode_steps_allocate_nothing() {
    use ch02::{CachedSession, ContiguousKvCache};
    use ch05_quantization::QuantLoader;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let dir = ch01::fixtures_dir().join("shakespeare-small");
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
        let model = ch01::Llama::load_with(&dir, &QuantLoader::to(ty).unwrap()).unwrap();
        let mut session = CachedSession::new(&model, ContiguousKvCache::new(&model.config, 96));
        let allocations = pool.install(|| {
            session.prefill(&[0, 412, 306, 13, 534, 325, 291]).unwrap();
            for t in 0..16 {
                session.decode(200 + t).unwrap(); // warm-up
            }
            let before = CountingAllocator::count();
            for t in 0..64 {
                let logits = session.decode(100 + t).unwrap();
                assert!(logits.iter().all(|v| v.is_finite()));
            }
            CountingAllocator::count() - before
        });
        assert!(
            allocations <= 8,
            "{ty}: 64 decode steps of the model allocated {allocations} times"
        );
    }
}
