//! Chapter 4's engine property test, run with the flash backend: for random arrivals, budgets,
//! chunking and preemption, every request's greedy output equals generating it alone (on
//! chapter 2's cache). The scenario is chapter 4's own test body, shared, not copied.

use crate::engine_scenario;

use ch02::kernels::Isa;
use ch04::CpuExecutor;
use ch07_flash_attention::{FlashAttention, FlashParams, Partitions, TileSizes};

#[test]
fn every_request_equals_generating_it_alone_with_flash_attention() {
    engine_scenario::every_request_equals_generating_it_alone_with(&|model, pool| {
        // Tiles smaller than the prompts (up to 40 tokens) and 3 partitions per decode.
        let params = FlashParams {
            tiles: TileSizes::new(8, 16).unwrap(),
            partitions: Partitions::fixed(3).unwrap(),
        };
        Box::new(CpuExecutor::with_backend(
            model,
            pool,
            Box::new(FlashAttention::with_params(Isa::detect(), params)),
        ))
    });
}
