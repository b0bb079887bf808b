//! A decode step through `QuantLinear::forward_into` allocates nothing once this thread's
//! scratch has grown: the activation blocks are reused, the weights are read as stored.
//! (Run inside a rayon pool, as `kiln generate` runs layers: see chapter 2's no_alloc test.)

use ch01::linear::Linear;
use ch01::testing::CountingAllocator;
use ch05_quantization::{GgmlType, QuantLinear};
use ndarray::{Array1, Array2};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

#[test]
fn decode_steps_allocate_nothing() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let (out, cols) = (300, 512);
    let w = Array2::from_shape_fn((out, cols), |(o, k)| {
        ((o * 7 + k * 3) % 19) as f32 / 19.0 - 0.5
    });
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
    ] {
        let layer = QuantLinear::quantize(ty, &w, Some(Array1::zeros(out))).unwrap();
        let x = Array2::from_shape_fn((1, cols), |(_, k)| (k % 13) as f32 / 13.0 - 0.5);
        // Every worker calls the layer once: the caller of a parallel loop always runs its first
        // piece itself, so each worker grows its own scratch here, whichever worker the
        // scheduling later hands a piece (one warm-up call alone left a worker cold when the
        // other took every piece, and its first piece in the timed steps then allocated).
        pool.broadcast(|_| {
            let mut y = Array2::<f32>::zeros((1, out));
            layer.forward_into(x.view(), y.view_mut());
        });
        let mut y = Array2::<f32>::zeros((1, out));
        let allocations = pool.install(|| {
            layer.forward_into(x.view(), y.view_mut()); // grows the scratch
            let before = CountingAllocator::count();
            for _ in 0..32 {
                layer.forward_into(x.view(), y.view_mut());
            }
            CountingAllocator::count() - before
        });
        assert!(y.iter().all(|v| v.is_finite()));
        assert_eq!(
            allocations, 0,
            "{ty}: 32 decode steps allocated {allocations} times"
        );
    }
}
