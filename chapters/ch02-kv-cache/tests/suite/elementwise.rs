//! The threaded row-wise ops against the serial loops they replace (chapter 1's RMSNorm and
//! RoPE, a plain residual addition and `silu_mul` over the whole buffer, an embedding lookup
//! row by row), on random odd shapes: row counts around the task sizes (1, 3, 17, 33, 129),
//! widths that are not multiples of 8. A split changes only which thread computes a row, so
//! the results must be equal, bit for bit. The ops run inside a 4-thread pool, so that they
//! split even on a machine with fewer cores.

use ch01::config::RopeScaling;
use ch01::model::RmsNorm;
use ch01::rope::Rope;
use ch01::testing::seeded_runner;
use ch02_kv_cache::elementwise::{
    MIN_ELEMENTS_PER_TASK, add_rows, gather_rows, items_per_task, rms_norm_picked_rows,
    rms_norm_rows, rope_rows, silu_mul_rows,
};
use ch02_kv_cache::kernels::vector::silu_mul_fastest;
use ndarray::{Array1, Array2, ArrayView2};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

fn runner(cases: u32) -> TestRunner {
    seeded_runner(cases, 22)
}

/// A pool of 4 threads, whatever the machine has.
fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .expect("a 4-thread pool")
}

/// Row counts at and around the task sizes.
fn rows() -> impl Strategy<Value = usize> {
    prop_oneof![Just(1), Just(3), Just(17), Just(33), Just(129), 1usize..200]
}

/// Widths that are not multiples of 8 (up to 601, so that wide rows make many tasks).
fn odd_width() -> impl Strategy<Value = usize> {
    (1usize..600).prop_map(|w| if w % 8 == 0 { w + 1 } else { w })
}

fn values(len: usize) -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec(-4.0f32..4.0, len)
}

/// [n, width] random values, and `extra` more vectors of the same length.
fn buffers(extra: usize) -> impl Strategy<Value = (usize, usize, Vec<Vec<f32>>)> {
    (rows(), odd_width()).prop_flat_map(move |(n, width)| {
        (
            Just(n),
            Just(width),
            proptest::collection::vec(values(n * width), 1 + extra),
        )
    })
}

#[test]
fn the_threshold_keeps_a_decode_row_whole_and_splits_a_batch() {
    pool().install(|| {
        assert_eq!(items_per_task(1, 576), None, "one decode row");
        assert_eq!(items_per_task(7, 576), None, "7 rows fit in one task");
        let per_task = items_per_task(32, 576).expect("a batch of 32 rows splits");
        assert!(per_task * 576 >= MIN_ELEMENTS_PER_TASK && per_task < 32);
        assert_eq!(
            items_per_task(2, 49_152),
            Some(1),
            "two vocabularies: one task each"
        );
    });
}

#[test]
fn rms_norm_rows_equals_chapter_1() {
    let cases = buffers(1);
    runner(60)
        .run(&cases, |(n, hidden, v)| {
            let norm = RmsNorm::new(Array1::from(v[1][..hidden].to_vec()), 1e-5);
            let x = Array2::from_shape_vec((n, hidden), v[0].clone()).unwrap();
            let mut expected = Array2::from_elem((n, hidden), f32::NAN);
            norm.forward_into(x.view(), expected.view_mut());
            let mut out = vec![f32::NAN; n * hidden];
            pool().install(|| rms_norm_rows(&norm, &v[0], &mut out, hidden));
            prop_assert_eq!(
                &out[..],
                expected.as_slice().unwrap(),
                "[{}, {}]",
                n,
                hidden
            );

            // The final norm of chapter 4: picked rows, chapter 1's `forward`.
            let picked: Vec<usize> = (0..n).rev().step_by(2).collect();
            let expected = norm.forward(x.select(ndarray::Axis(0), &picked).view());
            let mut out = vec![f32::NAN; picked.len() * hidden];
            pool().install(|| rms_norm_picked_rows(&norm, &v[0], &picked, &mut out, hidden));
            prop_assert_eq!(
                &out[..],
                expected.as_slice().unwrap(),
                "picked of [{}, {}]",
                n,
                hidden
            );
            Ok(())
        })
        .unwrap();
}

#[test]
fn rope_rows_equals_rotating_each_row() {
    let cases = (rows(), (1usize..40).prop_map(|h| h * 2), 1usize..10).prop_flat_map(
        |(n, head_dim, heads)| {
            let width = head_dim * heads;
            (
                Just((n, head_dim, width)),
                values(n * width),
                proptest::collection::vec(0usize..2048, n),
            )
        },
    );
    runner(60)
        .run(&cases, |((n, head_dim, width), x, positions)| {
            let rope = Rope::new(head_dim, 10_000.0, &RopeScaling::Default);
            let mut expected = x.clone();
            for (row, &pos) in expected.chunks_exact_mut(width).zip(&positions) {
                rope.rotate(row, pos);
            }
            // The angles as a step computes them, once per row for every layer.
            let mut angles = vec![(0.0, 0.0); n * head_dim / 2];
            for (angles, &pos) in angles.chunks_exact_mut(head_dim / 2).zip(&positions) {
                rope.cos_sin(pos, angles);
            }
            let mut out = x.clone();
            pool().install(|| rope_rows(&rope, &mut out, width, &angles));
            prop_assert_eq!(out, expected, "[{}, {}]", n, width);
            Ok(())
        })
        .unwrap();
}

#[test]
fn add_and_silu_mul_rows_equal_the_whole_buffer_loops() {
    runner(60)
        .run(&buffers(1), |(n, cols, v)| {
            let mut expected = v[0].clone();
            expected.iter_mut().zip(&v[1]).for_each(|(x, h)| *x += h);
            let mut out = v[0].clone();
            pool().install(|| add_rows(&mut out, &v[1], cols));
            prop_assert_eq!(&out, &expected, "add [{}, {}]", n, cols);

            let mut expected = v[0].clone();
            silu_mul_fastest(&mut expected, &v[1]);
            let mut out = v[0].clone();
            pool().install(|| silu_mul_rows(&mut out, &v[1], cols));
            prop_assert_eq!(&out, &expected, "silu_mul [{}, {}]", n, cols);
            Ok(())
        })
        .unwrap();
}

#[test]
fn gather_rows_copies_each_token_s_embedding() {
    let cases = (1usize..300, odd_width(), rows()).prop_flat_map(|(vocab, hidden, n)| {
        (
            Just((vocab, hidden)),
            values(vocab * hidden),
            proptest::collection::vec(0..vocab as u32, n),
        )
    });
    runner(60)
        .run(&cases, |((vocab, hidden), table, ids)| {
            let table = ArrayView2::from_shape((vocab, hidden), &table).unwrap();
            let expected: Vec<f32> = ids
                .iter()
                .flat_map(|&id| table.row(id as usize).to_vec())
                .collect();
            let mut out = vec![f32::NAN; ids.len() * hidden];
            pool().install(|| gather_rows(table, &ids, &mut out));
            prop_assert_eq!(
                out,
                expected,
                "{} ids of [{}, {}]",
                ids.len(),
                vocab,
                hidden
            );
            Ok(())
        })
        .unwrap();
}
