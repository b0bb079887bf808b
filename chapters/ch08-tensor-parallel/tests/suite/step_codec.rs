//! A step survives the trip through bytes unchanged, and corrupt bytes are an error, never a
//! panic or a huge allocation.

use ch03::BlockCopy;
use ch04::{BlockOp, ScheduledSeq, SchedulerOutput};
use ch08_tensor_parallel::step_codec::{StepCodecError, decode, encode};
use proptest::collection::vec;
use proptest::prelude::*;

fn seq() -> impl Strategy<Value = ScheduledSeq> {
    (
        any::<u64>(),
        0usize..100_000,
        0usize..9,
        vec(any::<u32>(), 0..40),
        vec(any::<u32>(), 0..12),
    )
        .prop_map(
            |(id, start_pos, logit_rows, tokens, block_table)| ScheduledSeq {
                id,
                tokens,
                start_pos,
                block_table,
                logit_rows,
            },
        )
}

fn op() -> impl Strategy<Value = BlockOp> {
    prop_oneof![
        (any::<u32>(), any::<u32>()).prop_map(|(src, dst)| BlockOp::Copy(BlockCopy { src, dst })),
        (any::<u64>(), vec(any::<u32>(), 0..10))
            .prop_map(|(id, blocks)| BlockOp::SwapOut { id, blocks }),
        (any::<u64>(), vec(proptest::option::of(any::<u32>()), 0..10))
            .prop_map(|(id, blocks)| BlockOp::SwapIn { id, blocks }),
    ]
}

fn step() -> impl Strategy<Value = SchedulerOutput> {
    (vec(seq(), 0..6), vec(op(), 0..5), vec(any::<u64>(), 0..4)).prop_map(
        |(seqs, block_ops, finished)| SchedulerOutput {
            seqs,
            block_ops,
            finished,
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(8), ..ProptestConfig::default() })]

    #[test]
    fn decode_inverts_encode(step in step()) {
        let mut bytes = Vec::new();
        encode(&step, &mut bytes);
        prop_assert_eq!(decode(&bytes).unwrap(), step);
    }

    #[test]
    fn every_cut_of_a_message_is_an_error(step in step(), cut in any::<prop::sample::Index>()) {
        let mut bytes = Vec::new();
        encode(&step, &mut bytes);
        let cut = cut.index(bytes.len());
        prop_assert!(decode(&bytes[..cut]).is_err());
    }

    #[test]
    fn flipped_bytes_never_panic(step in step(), at in any::<prop::sample::Index>(), flip in 1u8..) {
        let mut bytes = Vec::new();
        encode(&step, &mut bytes);
        let at = at.index(bytes.len());
        bytes[at] ^= flip;
        let _ = decode(&bytes); // an error or another step; returning is the property
    }
}

#[test]
fn corrupt_messages_say_what_is_wrong() {
    let mut bytes = Vec::new();
    encode(&SchedulerOutput::default(), &mut bytes);
    assert_eq!(decode(&bytes), Ok(SchedulerOutput::default()));
    let mut trailing = bytes.clone();
    trailing.push(0);
    assert_eq!(decode(&trailing), Err(StepCodecError::Trailing(1)));
    let mut version = bytes.clone();
    version[0] = 9;
    assert_eq!(decode(&version), Err(StepCodecError::Version(9)));
    // A count of 2^32 - 1 sequences in a 13-byte message: refused before allocating.
    let mut huge = bytes.clone();
    huge[1..5].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(decode(&huge), Err(StepCodecError::Truncated(_))));
    // An unknown block operation.
    let mut op = vec![1u8];
    op.extend_from_slice(&0u32.to_le_bytes());
    op.extend_from_slice(&1u32.to_le_bytes());
    op.extend_from_slice(&[7; 9]);
    op.extend_from_slice(&0u32.to_le_bytes());
    assert_eq!(decode(&op), Err(StepCodecError::UnknownOp(7)));
}
