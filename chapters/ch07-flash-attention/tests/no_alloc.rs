//! A decode step of the flash backend allocates nothing once its scratch has grown: split-K
//! partials and scores live in the backend, and the tasks run on rayon's own deques.
//!
//! A counting global allocator sees every allocation of every thread of this test binary; the
//! steps run inside a rayon pool, as `kiln` runs them (jobs injected from outside a pool go
//! through a global queue that allocates now and then).

use ch01::fixtures_dir;
use ch01::testing::CountingAllocator;
use ch03::KvPool;
use ch04::attention::{AttentionBackend, QueryRow};
use ch07_flash_attention::FlashAttention;
use ndarray::Array2;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

#[test]
fn decode_steps_allocate_nothing() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let model = ch02::load_fast(
        &fixtures_dir().join("shakespeare-small"),
        ch02::WeightDtype::F32,
    )
    .unwrap();
    let config = &model.config;
    let shape = model.layers[0].self_attn.shape();
    let (block_size, len): (usize, usize) = (16, 1500);
    let mut kv = KvPool::<f32>::new(config, block_size, len.div_ceil(block_size)).unwrap();
    let kv_dim = shape.num_kv_heads * shape.head_dim;
    let row = Array2::from_shape_fn((1, kv_dim), |(_, i)| (i % 7) as f32 * 0.1);
    for slot in 0..len {
        kv.write(0, slot, row.row(0), row.row(0));
    }
    let blocks: Vec<u32> = (0..len.div_ceil(block_size) as u32).collect();
    let q_dim = shape.num_heads * shape.head_dim;
    let q: Vec<f32> = (0..2 * q_dim).map(|i| (i % 5) as f32 * 0.2).collect();
    let mut out = vec![0.0; 2 * q_dim];
    let mut backend = FlashAttention::new();
    let allocations = pool.install(|| {
        // Two sequences decoding (two rows of one table at far-apart positions): the longest
        // step first, which grows the scratch to its size.
        let step = |pos: usize| {
            [
                QueryRow {
                    blocks: &blocks,
                    pos,
                },
                QueryRow {
                    blocks: &blocks,
                    pos: pos / 2,
                },
            ]
        };
        backend.attend(&kv, 0, &step(len - 1), &q, shape, &mut out);
        let before = CountingAllocator::count();
        for t in 0..32 {
            let rows = step(len - 33 + t);
            backend.attend(&kv, 0, &rows, &q, shape, &mut out);
            assert!(out.iter().all(|v| v.is_finite()));
        }
        CountingAllocator::count() - before
    });
    assert_eq!(
        allocations, 0,
        "32 decode steps allocated {allocations} times"
    );
}
