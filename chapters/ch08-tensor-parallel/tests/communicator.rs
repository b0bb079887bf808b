//! Every collective of the thread communicator against a sequential reference, on random
//! buffers of random lengths (not multiples of anything) over random group sizes; the group
//! reused for several collectives in a row; mismatched lengths and lost ranks as errors on
//! every rank.

use ch01::testing::seeded_config;
use ch08_tensor_parallel::{CommError, Communicator, ThreadComm, thread_group};
use proptest::prelude::*;

/// Runs `body` on every rank of `comms`, each on its own thread; the results in rank order.
fn on_ranks<T: Send>(comms: Vec<ThreadComm>, body: impl Fn(&mut ThreadComm) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let body = &body;
                s.spawn(move || body(&mut comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The reference all-reduce: the parts summed one after another, in rank order.
fn sequential_sum(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut sum = parts[0].clone();
    for part in &parts[1..] {
        for (s, v) in sum.iter_mut().zip(part) {
            *s += v;
        }
    }
    sum
}

/// `world` ranks' buffers of `len` values each, drawn from `seed`.
fn parts(world: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..world)
        .map(|_| (0..len).map(|_| rng.random_range(-10.0f32..10.0)).collect())
        .collect()
}

proptest! {
    #![proptest_config(seeded_config(64, 81))]

    #[test]
    fn all_reduce_equals_the_sequential_sum_on_every_rank(
        world in 1usize..=5, len in 0usize..700, seed in any::<u64>(), rounds in 1usize..4,
    ) {
        let data = parts(world, len, seed);
        let results = on_ranks(thread_group(world).unwrap(), |comm| {
            // Several rounds through one group: the barrier and the slots are reused.
            let reduce = |comm: &mut ThreadComm| {
                let mut buf = data[comm.rank()].clone();
                comm.all_reduce_sum(&mut buf).unwrap();
                buf
            };
            (1..rounds).for_each(|_| drop(reduce(comm)));
            reduce(comm)
        });
        let expected = sequential_sum(&data);
        for (rank, got) in results.iter().enumerate() {
            // Bit for bit: every rank sums in rank order, as the reference does.
            prop_assert_eq!(got, &expected, "rank {}", rank);
        }
    }

    #[test]
    fn all_gather_concatenates_the_parts_in_rank_order(
        world in 1usize..=5, len in 0usize..300, seed in any::<u64>(),
    ) {
        let data = parts(world, len, seed);
        let results = on_ranks(thread_group(world).unwrap(), |comm| {
            let mut out = vec![f32::NAN; world * len];
            comm.all_gather(&data[comm.rank()], &mut out).unwrap();
            out
        });
        let expected: Vec<f32> = data.concat();
        for got in &results {
            prop_assert_eq!(got, &expected);
        }
    }

    #[test]
    fn broadcast_gives_every_rank_the_roots_bytes(
        world in 1usize..=5, root_pick in any::<prop::sample::Index>(),
        message in proptest::collection::vec(any::<u8>(), 0..500),
    ) {
        let root = root_pick.index(world);
        let results = on_ranks(thread_group(world).unwrap(), |comm| {
            // The others start with junk of another length: it is replaced, not merged.
            let mut buf = if comm.rank() == root { message.clone() } else { vec![7; 3] };
            comm.broadcast(&mut buf, root).unwrap();
            buf
        });
        for got in &results {
            prop_assert_eq!(got, &message);
        }
    }
}

#[test]
fn mismatched_lengths_are_an_error_on_every_rank_and_the_group_goes_on() {
    let results = on_ranks(thread_group(3).unwrap(), |comm| {
        let mut buf = vec![1.0; 4 + comm.rank()];
        let first = comm.all_reduce_sum(&mut buf);
        let mut ok = vec![comm.rank() as f32; 5];
        comm.all_reduce_sum(&mut ok).unwrap();
        (first, ok)
    });
    for (first, ok) in results {
        assert_eq!(
            first,
            Err(CommError::LengthMismatch {
                op: "all-reduce",
                lens: vec![4, 5, 6]
            })
        );
        assert_eq!(ok, vec![3.0; 5]); // 0 + 1 + 2
    }
}

#[test]
fn a_wrong_gather_output_and_a_bad_root_are_errors() {
    let results = on_ranks(thread_group(2).unwrap(), |comm| {
        let mut out = vec![0.0; 5];
        let gather = comm.all_gather(&[1.0, 2.0], &mut out);
        let bad_root = comm.broadcast(&mut Vec::new(), 2);
        (gather, bad_root)
    });
    for (gather, bad_root) in results {
        assert_eq!(
            gather,
            Err(CommError::GatherShape {
                out: 5,
                world: 2,
                part: 2
            })
        );
        assert_eq!(
            bad_root,
            Err(CommError::RootOutOfRange { root: 2, world: 2 })
        );
    }
    assert!(thread_group(0).is_err());
}

#[test]
fn a_lost_rank_is_an_error_for_the_others_not_a_hang() {
    let mut comms = thread_group(3).unwrap();
    drop(comms.pop()); // rank 2 is gone before the first collective
    let results = on_ranks(comms, |comm| comm.all_reduce_sum(&mut [1.0; 8]));
    for result in results {
        assert_eq!(result, Err(CommError::RankLost));
    }
    // A rank that panics mid-run loses the group too.
    let results = on_ranks(thread_group(2).unwrap(), |comm| {
        if comm.rank() == 1 {
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _owned = std::mem::replace(comm, thread_group(1).unwrap().remove(0));
                panic!("rank 1 fails");
            }));
            assert!(panicked.is_err());
            return Ok(());
        }
        comm.all_reduce_sum(&mut [1.0; 8])
    });
    assert_eq!(results[0], Err(CommError::RankLost));
}
