//! A step survives the trip through bytes unchanged, and corrupt bytes are an error, never a
//! panic or a huge allocation; a step that decodes but does not fit a worker's pool is refused
//! before it runs.

use ch02::{FastLoader, WeightDtype};
use ch03::BlockCopy;
use ch04::{BlockOp, ScheduledSeq, SchedulerOutput};
use ch08_tensor_parallel::group::fingerprint;
use ch08_tensor_parallel::step_codec::{InvalidStep, StepCodecError, check, decode, encode};
use ch08_tensor_parallel::{Communicator, WorkerError, load_shards, run_worker, thread_group};
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

/// What a worker rank (shard 1 of shakespeare-tiny, a pool of 8 blocks of 4 positions) returns
/// when rank 0 sends it `step`, then leaves the group.
fn worker_given(step: &SchedulerOutput) -> Result<(), WorkerError> {
    let loader = FastLoader {
        dtype: WeightDtype::F32,
    };
    let dir = ch01::fixtures_dir().join("shakespeare-tiny");
    let shard = load_shards(&dir, &loader, 2).unwrap().pop().unwrap();
    let mut plan = Vec::new();
    for word in [4u64, 8, fingerprint(&shard)] {
        plan.extend_from_slice(&word.to_le_bytes());
    }
    let mut comms = thread_group(2).unwrap().into_iter();
    let (mut rank0, comm1) = (comms.next().unwrap(), comms.next().unwrap());
    let worker = std::thread::spawn(move || run_worker(shard, comm1));
    rank0.broadcast(&mut plan, 0).unwrap();
    let mut message = Vec::new();
    encode(step, &mut message);
    rank0.broadcast(&mut message, 0).unwrap();
    drop(rank0);
    worker.join().expect("the worker returns, never panics")
}

/// A step that decodes but does not fit the worker's pool (a block past its 8, more logit rows
/// than tokens, positions past the block table or past `usize`) ends the worker with an error
/// that says so, before the step runs: it used to index the pool out of bounds (a panic), or
/// wrap `end - logit_rows` around in release.
#[test]
fn a_worker_refuses_a_step_that_does_not_fit_its_pool() {
    let seq = |start_pos: usize, tokens: usize, block_table: Vec<u32>, logit_rows: usize| {
        SchedulerOutput {
            seqs: vec![ScheduledSeq {
                id: 7,
                tokens: vec![1; tokens],
                start_pos,
                block_table,
                logit_rows,
            }],
            ..SchedulerOutput::default()
        }
    };
    let ops = |block_ops: Vec<BlockOp>| SchedulerOutput {
        block_ops,
        ..SchedulerOutput::default()
    };
    let cases = [
        (
            ops(vec![BlockOp::Copy(BlockCopy { src: 0, dst: 8 })]),
            "a block copy's target names block 8, but this rank's pool has 8 blocks",
        ),
        (
            ops(vec![BlockOp::SwapIn {
                id: 7,
                blocks: vec![None, Some(9)],
            }]),
            "a swap-in names block 9, but this rank's pool has 8 blocks",
        ),
        (
            seq(0, 3, vec![8], 1),
            "request 7's block table names block 8, but this rank's pool has 8 blocks",
        ),
        (
            seq(0, 3, vec![0], 4),
            "request 7 asks for 4 logit rows of its 3 tokens",
        ),
        (
            seq(2, 3, vec![0], 1),
            "request 7's 3 tokens from position 2 run past its block table (1 blocks of 4 positions)",
        ),
        (
            seq(usize::MAX - 1, 3, vec![0], 1),
            "request 7's 3 tokens from position 18446744073709551614 run past its block table",
        ),
    ];
    for (step, needle) in cases {
        let error = worker_given(&step).unwrap_err().to_string();
        assert!(
            error.starts_with("a step from rank 0 does not fit this rank: ")
                && error.contains(needle),
            "{error:?} should say {needle:?}"
        );
    }
}

/// `check` passes what the scheduler sends (a block table that holds exactly the step's
/// positions, every logit row, a sequence of no tokens, the pool's last block) and names what
/// does not fit, on one field at a time.
#[test]
fn check_holds_a_step_to_the_pool() {
    let step =
        |start_pos: usize, tokens: usize, logit_rows: usize, op: Option<BlockOp>| SchedulerOutput {
            seqs: vec![
                ScheduledSeq {
                    id: 3,
                    tokens: vec![5; tokens],
                    start_pos,
                    block_table: vec![7, 0],
                    logit_rows,
                },
                ScheduledSeq {
                    id: 4,
                    tokens: Vec::new(),
                    start_pos: 100,
                    block_table: Vec::new(),
                    logit_rows: 0,
                },
            ],
            block_ops: op.into_iter().collect(),
            finished: vec![9],
        };
    let copy = |src, dst| Some(BlockOp::Copy(BlockCopy { src, dst }));
    // A pool of 8 blocks of 4 positions: the two blocks hold positions 0..8.
    let fits = |s: &SchedulerOutput| check(s, 4, 8);
    assert_eq!(fits(&step(5, 3, 3, copy(7, 0))), Ok(()));
    assert_eq!(fits(&step(0, 8, 1, None)), Ok(()));
    assert_eq!(
        fits(&step(6, 3, 1, None)),
        Err(InvalidStep::Positions {
            id: 3,
            start_pos: 6,
            tokens: 3,
            blocks: 2,
            block_size: 4
        })
    );
    assert_eq!(
        fits(&step(0, 2, 3, None)),
        Err(InvalidStep::LogitRows {
            id: 3,
            logit_rows: 3,
            tokens: 2
        })
    );
    assert_eq!(
        fits(&step(0, 1, 1, copy(8, 0))),
        Err(InvalidStep::Block {
            what: "a block copy's source".into(),
            block: 8,
            num_blocks: 8
        })
    );
    let swap_out = Some(BlockOp::SwapOut {
        id: 3,
        blocks: vec![1, u32::MAX],
    });
    assert!(matches!(
        fits(&step(0, 1, 1, swap_out)),
        Err(InvalidStep::Block {
            block: u32::MAX,
            ..
        })
    ));
    // A pool of 7 blocks: block 7 of the table is past it.
    assert!(matches!(
        check(&step(0, 1, 1, None), 4, 7),
        Err(InvalidStep::Block { block: 7, .. })
    ));
}
