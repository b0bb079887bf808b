//! Paged == contiguous: chapter 2's forward pass over blocks gives the same logits as over one
//! contiguous buffer, for random block sizes (1 to 32), physical blocks scattered by earlier
//! allocations, sequence lengths that are not multiples of the block size, prefill chunks and
//! decode steps; and running out of blocks is a typed error that writes nothing.

use ch01::testing::{Tolerance, assert_close_shaped, seeded_runner};
use ch01::{Llama, fixtures_dir};
use ch02::{ContiguousKvCache, KvError, KvStore, forward_cached};
use ch03_paged_blocks::{KvPool, PagedKv};
use proptest::prelude::*;

/// (tokens, chunk sizes, block size, lengths of earlier sequences, which of them to free)
type Case = (Vec<u32>, Vec<usize>, usize, Vec<usize>, Vec<bool>);

fn case(vocab: u32) -> impl Strategy<Value = Case> {
    (1usize..40, 0usize..10, 1usize..=32).prop_flat_map(move |(prompt_len, decode, block_size)| {
        (
            proptest::collection::vec(0..vocab, prompt_len + decode),
            1usize..=prompt_len,
            Just((prompt_len, decode, block_size)),
            proptest::collection::vec(1usize..40, 0..6),
            proptest::collection::vec(any::<bool>(), 6),
        )
            .prop_map(
                |(tokens, first, (prompt_len, decode, block_size), others, free)| {
                    let mut chunks = vec![first];
                    if prompt_len > first {
                        chunks.push(prompt_len - first);
                    }
                    chunks.extend(std::iter::repeat_n(1, decode));
                    (tokens, chunks, block_size, others, free)
                },
            )
    })
}

fn check_model(name: &str, cases: u32) {
    let model = Llama::load(&fixtures_dir().join(name)).unwrap();
    let vocab = model.config.vocab_size as u32;
    seeded_runner(cases, 31)
        .run(
            &case(vocab),
            |(tokens, chunks, block_size, others, free)| {
                let num_blocks = 64 + tokens.len();
                let pool = KvPool::new(&model.config, block_size, num_blocks).unwrap();
                let mut kv = PagedKv::new(pool, false);
                // Scatter the free list: allocate some sequences, free some of them.
                let mut earlier = Vec::new();
                for (i, &len) in others.iter().enumerate() {
                    let seq = kv.start(&vec![1; len]).unwrap();
                    if free[i] {
                        kv.free(seq)
                    } else {
                        earlier.push(seq)
                    }
                }

                let mut contiguous = ContiguousKvCache::new(&model.config, tokens.len());
                let mut seq = kv.start(&tokens[..chunks[0]]).unwrap();
                let mut pos = 0;
                for n in chunks {
                    let new = &tokens[pos..pos + n];
                    let expected = forward_cached(&model, new, &mut contiguous).unwrap(); // [n, vocab]
                    let actual = forward_cached(&model, new, &mut kv.store(&mut seq)).unwrap();
                    // Bit-identical today (the same attention code reads rows through the block
                    // table, in the same order, on the same chunks); compared within f32 rounding
                    // so that a paged kernel summing in another order still passes.
                    assert_close_shaped(
                        &format!("{name}: block size {block_size}, chunk of {n} at {pos}"),
                        actual.as_slice().unwrap(),
                        expected.as_slice().unwrap(),
                        &[n, vocab as usize],
                        Tolerance::F32,
                    );
                    pos += n;
                    prop_assert_eq!(seq.table.num_tokens(), pos);
                }
                let mut live: Vec<_> = earlier.iter().map(|s| &s.table).collect();
                live.push(&seq.table);
                kv.manager()
                    .check_invariants(&live)
                    .map_err(TestCaseError::fail)?;
                kv.free(seq);
                for s in earlier {
                    kv.free(s);
                }
                prop_assert_eq!(kv.manager().num_free_blocks(), num_blocks);
                Ok(())
            },
        )
        .unwrap();
}

macro_rules! paged_tests {
    ($($test:ident => ($name:literal, $cases:literal)),* $(,)?) => {
        $(#[test] fn $test() { check_model($name, $cases); })*
    };
}

paged_tests! {
    mha => ("random/mha", 24),
    gqa => ("random/gqa", 24),
    head_dim => ("random/head-dim", 24),
    qwen2_bias => ("random/qwen2", 16),
    llama3_rope => ("random/llama3-rope", 16),
    shakespeare_tiny => ("shakespeare-tiny", 8),
}

/// A pool too small for the next step: a typed error, nothing written, the sequence intact.
#[test]
fn out_of_blocks_is_a_typed_error_that_writes_nothing() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let pool = KvPool::new(&model.config, 4, 2).unwrap(); // 8 positions in all
    let mut kv = PagedKv::new(pool, false);
    let mut seq = kv.start(&[1, 2, 3, 4, 5, 6]).unwrap();
    forward_cached(&model, &[1, 2, 3, 4, 5, 6], &mut kv.store(&mut seq)).unwrap();
    forward_cached(&model, &[7, 8], &mut kv.store(&mut seq)).unwrap();
    let error = forward_cached(&model, &[9], &mut kv.store(&mut seq)).unwrap_err();
    assert!(
        matches!(
            error,
            ch02::Error::Kv(KvError::OutOfBlocks { needed: 1, free: 0 })
        ),
        "{error}"
    );
    assert_eq!(kv.store(&mut seq).len(), 8);
    kv.manager().check_invariants(&[&seq.table]).unwrap();
}
