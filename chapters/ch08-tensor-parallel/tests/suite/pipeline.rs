//! The pipeline sketch computes what the whole model computes: for random stage counts and
//! micro-batches of random lengths, every micro-batch's logits equal chapter 1's forward
//! exactly (the same layers in the same order); the stages tile the layers; bad counts are
//! errors; the measured bubble is a fraction of a makespan from the first stage's start to the
//! last stage's end.

use ch01::testing::seeded_config;
use ch01::{Llama, fixtures_dir};
use ch08_tensor_parallel::pipeline::{PipelineError, ideal_bubble, run_pipeline, stage_layers};
use proptest::prelude::*;
use std::time::Duration;

fn tiny() -> Llama {
    Llama::load(&fixtures_dir().join("shakespeare-tiny")).unwrap() // 4 layers
}

proptest! {
    #![proptest_config(seeded_config(12, 84))]

    #[test]
    fn every_micro_batch_equals_the_whole_forward(
        stages in 1usize..=4,
        batches in proptest::collection::vec(proptest::collection::vec(0u32..4096, 1..23), 1..6),
    ) {
        let model = tiny();
        let run = run_pipeline(&model, stages, &batches).unwrap();
        prop_assert_eq!(run.logits.len(), batches.len());
        for (tokens, logits) in batches.iter().zip(&run.logits) {
            prop_assert_eq!(logits, &model.forward(tokens).unwrap());
        }
        prop_assert_eq!(run.busy.len(), stages);
        prop_assert!(run.busy.iter().all(|b| b.len() == batches.len()));
        // The makespan is the stages' own span (first start to last end), not the setup's.
        let intervals = || run.busy.iter().flatten();
        prop_assert_eq!(intervals().map(|r| r.start).min(), Some(Duration::ZERO));
        prop_assert_eq!(intervals().map(|r| r.end).max(), Some(run.makespan));
        let bubble = run.bubble_fraction();
        prop_assert!((0.0..1.0).contains(&bubble), "bubble {}", bubble);
    }

    #[test]
    fn stages_tile_the_layers(layers in 1usize..100, p_pick in any::<prop::sample::Index>()) {
        let p = p_pick.index(layers) + 1;
        let ranges: Vec<_> = (0..p).map(|s| stage_layers(s, p, layers)).collect();
        prop_assert_eq!(ranges[0].start, 0);
        prop_assert_eq!(ranges[p - 1].end, layers);
        for pair in ranges.windows(2) {
            prop_assert_eq!(pair[0].end, pair[1].start);
            prop_assert!(pair[0].len().abs_diff(pair[1].len()) <= 1 && !pair[1].is_empty());
        }
    }
}

#[test]
fn bad_stage_counts_and_tokens_are_errors() {
    let model = tiny();
    assert!(matches!(
        run_pipeline(&model, 0, &[vec![1]]),
        Err(PipelineError::Stages {
            stages: 0,
            layers: 4
        })
    ));
    assert!(run_pipeline(&model, 5, &[vec![1]]).is_err());
    assert!(matches!(
        run_pipeline(&model, 2, &[vec![1], vec![9999]]),
        Err(PipelineError::Tokens(_))
    ));
    assert_eq!(ideal_bubble(4, 1), 0.75);
    assert_eq!(ideal_bubble(1, 7), 0.0);
}
