//! A decode step allocates nothing: every intermediate lives in the session's workspace, the
//! attention scratch in the cache, the weights in their packed layout.
//!
//! A counting global allocator sees every allocation of every thread of this test binary.
//! The steps run inside a rayon pool (as `kiln generate` runs them), so that parallel loops are
//! started from a worker thread and queue their jobs on its own deque, which allocates nothing;
//! jobs injected from outside a pool go through a global queue that allocates a block now and then.

use ch01::fixtures_dir;
use ch01::testing::CountingAllocator;
use ch02_kv_cache::{CachedSession, ContiguousKvCache, WeightDtype, load_fast};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

#[test]
fn decode_steps_allocate_nothing() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
        let model = load_fast(&fixtures_dir().join("shakespeare-small"), dtype).unwrap();
        let cache = ContiguousKvCache::new(&model.config, 64);
        let mut session = CachedSession::new(&model, cache);
        let allocations = pool.install(|| {
            session.prefill(&[0, 412, 306, 13, 534, 325, 291]).unwrap();
            session.decode(306).unwrap(); // the first decode sizes nothing new, but warm up anyway
            let before = CountingAllocator::count();
            for t in 0..32 {
                let logits = session.decode(100 + t).unwrap();
                assert!(logits.iter().all(|v| v.is_finite()));
            }
            CountingAllocator::count() - before
        });
        assert_eq!(
            allocations, 0,
            "{dtype:?}: 32 decode steps allocated {allocations} times"
        );
    }
}
