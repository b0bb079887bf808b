//! Cached attention == chapter 1's oracle: for random shapes, context lengths and numbers of
//! new queries (one: a decode step; more: a prefill chunk), and stored rows in any order (as
//! chapter 3's block tables scatter them), the output equals `causal_attention` on the same
//! keys and values in position order.

use ch01::attention::{AttentionShape, causal_attention};
use ch01::testing::{Tolerance, assert_close_shaped, seeded_runner};
use ch02_kv_cache::attention::{cached_attention_mapped, scratch_len};
use ndarray::Array2;
use proptest::prelude::*;

fn values(len: usize) -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec(-2.0f32..2.0, len)
}

/// A GQA shape (1–3 KV heads, groups of 1–3 query heads, head_dim 1–19) and a context length
/// below `max_context`.
fn shapes(max_context: usize) -> impl Strategy<Value = (AttentionShape, usize)> {
    (1usize..4, 1usize..4, 1usize..20, 1..max_context).prop_map(
        |(num_kv_heads, group, head_dim, context_len)| {
            let shape = AttentionShape {
                num_heads: num_kv_heads * group,
                num_kv_heads,
                head_dim,
            };
            (shape, context_len)
        },
    )
}

/// What the oracle sees: rows `rows[0..context_len]` of `stored`, in position order.
/// [context_len, kv_dim]
fn in_order(stored: &[f32], rows: &[usize], context_len: usize, kv_dim: usize) -> Array2<f32> {
    let data: Vec<f32> = rows[..context_len]
        .iter()
        .flat_map(|&row| stored[row * kv_dim..][..kv_dim].to_vec())
        .collect();
    Array2::from_shape_vec((context_len, kv_dim), data).unwrap()
}

#[test]
fn cached_attention_equals_the_oracle_for_decode_and_prefill() {
    let shapes = shapes(40).prop_flat_map(|(shape, context_len)| {
        // Decode (one query) half the time, else a chunk of the last positions.
        let n = prop_oneof![Just(1), 1..=context_len];
        (Just(shape), Just(context_len), n, 0usize..8)
    });
    let cases = shapes.prop_flat_map(|(shape, context_len, n, spare)| {
        let kv_dim = shape.num_kv_heads * shape.head_dim;
        let rows = context_len + spare; // storage with rows no position uses
        (
            Just((shape, context_len)),
            values(n * shape.num_heads * shape.head_dim),
            values(rows * kv_dim),
            values(rows * kv_dim),
            Just((0..rows).collect::<Vec<usize>>()).prop_shuffle(),
        )
    });
    seeded_runner(300, 21)
        .run(&cases, |((shape, context_len), q, k, v, rows)| {
            let (q_dim, kv_dim) = (
                shape.num_heads * shape.head_dim,
                shape.num_kv_heads * shape.head_dim,
            );
            let n = q.len() / q_dim;
            let row_of = |pos: usize| rows[pos];
            let mut out = vec![f32::NAN; q.len()];
            let mut scores = vec![0.0; scratch_len(n, context_len, shape)];
            cached_attention_mapped(
                &q,
                &k,
                &v,
                &row_of,
                context_len,
                shape,
                &mut out,
                &mut scores,
            );

            let q = Array2::from_shape_vec((n, q_dim), q).unwrap();
            let (k_in_order, v_in_order) = (
                in_order(&k, &rows, context_len, kv_dim),
                in_order(&v, &rows, context_len, kv_dim),
            );
            let expected = causal_attention(q.view(), k_in_order.view(), v_in_order.view(), shape);
            assert_close_shaped(
                &format!("{shape:?}, {n} queries at the end of {context_len} positions"),
                &out,
                expected.as_slice().unwrap(),
                &[n, q_dim],
                Tolerance::F32,
            );
            Ok(())
        })
        .unwrap();
}

/// Decode attention split into chunks of positions (several chunks from 33 positions on, a
/// last chunk of any length; past 512 positions chunks longer than 32 and at most
/// `MAX_CHUNKS` of them) equals the oracle, on every instruction set of this CPU, with the
/// stored rows in any order.
#[test]
fn decode_attention_equals_the_oracle_across_chunks_on_every_isa() {
    use ch02_kv_cache::decode_attention::{self, Stored, decode_attention};
    use ch02_kv_cache::kernels::Isa;
    let cases =
        prop_oneof![3 => shapes(300), 1 => shapes(1500)].prop_flat_map(|(shape, context_len)| {
            let kv_len = context_len * shape.num_kv_heads * shape.head_dim;
            (
                Just((shape, context_len)),
                values(shape.num_heads * shape.head_dim),
                values(kv_len),
                values(kv_len),
                Just((0..context_len).collect::<Vec<usize>>()).prop_shuffle(),
            )
        });
    seeded_runner(120, 22)
        .run(&cases, |((shape, context_len), q, k, v, rows)| {
            let kv_dim = shape.num_kv_heads * shape.head_dim;
            let row_of = |pos: usize| rows[pos];
            let q_row = Array2::from_shape_vec((1, q.len()), q.clone()).unwrap();
            let (k_in_order, v_in_order) = (
                in_order(&k, &rows, context_len, kv_dim),
                in_order(&v, &rows, context_len, kv_dim),
            );
            let expected =
                causal_attention(q_row.view(), k_in_order.view(), v_in_order.view(), shape);
            let stored = Stored {
                k: &k,
                v: &v,
                row_of: &row_of,
                shape,
            };
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; q.len()];
                let mut scratch = vec![f32::NAN; decode_attention::scratch_len(context_len, shape)];
                decode_attention(isa, &stored, &q, context_len, &mut out, &mut scratch);
                assert_close_shaped(
                    &format!("{isa:?}, {shape:?}, one query against {context_len} positions"),
                    &out,
                    expected.as_slice().unwrap(),
                    &[1, q.len()],
                    Tolerance::F32,
                );
            }
            Ok(())
        })
        .unwrap();
}
