//! Property tests of the model's building blocks against straightforward references.
//! Seeded so a failure reproduces (`PROPTEST_RNG_SEED`, `PROPTEST_CASES` and
//! `KILN_PROPTEST_SCALE` override: see `testing::seeded_runner`); shapes are random and
//! deliberately not multiples of anything.

use ch01_naive_attention::attention::{AttentionShape, causal_attention, softmax_in_place};
use ch01_naive_attention::config::RopeScaling;
use ch01_naive_attention::model::RmsNorm;
use ch01_naive_attention::rope::Rope;
use ch01_naive_attention::testing::{Tolerance, assert_close_shaped, seeded_runner};
use ch01_naive_attention::{Llama, fixtures_dir};
use ndarray::{Array1, Array2};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

fn runner(cases: u32) -> TestRunner {
    seeded_runner(cases, 7)
}

/// Causal attention in f64 with explicit loops: the reference for the reference.
fn attention_f64(
    q: &Array2<f32>,
    k: &Array2<f32>,
    v: &Array2<f32>,
    shape: AttentionShape,
) -> Vec<f64> {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim: d,
    } = shape;
    let (t_q, t_k) = (q.nrows(), k.nrows());
    let mut out = vec![0.0f64; t_q * num_heads * d];
    for h in 0..num_heads {
        let kv = h / (num_heads / num_kv_heads);
        for i in 0..t_q {
            let visible = t_k - t_q + i + 1; // keys 0..visible
            let scores: Vec<f64> = (0..visible)
                .map(|j| {
                    (0..d)
                        .map(|c| q[[i, h * d + c]] as f64 * k[[j, kv * d + c]] as f64)
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for c in 0..d {
                let value: f64 = (0..visible)
                    .map(|j| weights[j] * v[[j, kv * d + c]] as f64)
                    .sum();
                out[i * num_heads * d + h * d + c] = value / total;
            }
        }
    }
    out
}

fn matrix(rows: usize, cols: usize) -> impl Strategy<Value = Array2<f32>> {
    proptest::collection::vec(-2.0f32..2.0, rows * cols)
        .prop_map(move |data| Array2::from_shape_vec((rows, cols), data).unwrap())
}

#[test]
fn attention_equals_f64_reference_on_random_shapes() {
    let shapes = (1usize..4, 1usize..4, 1usize..20, 1usize..37).prop_flat_map(
        |(num_kv_heads, group, head_dim, t_k)| {
            let shape = AttentionShape {
                num_heads: num_kv_heads * group,
                num_kv_heads,
                head_dim,
            };
            (Just(shape), 1..=t_k, Just(t_k))
        },
    );
    let inputs = shapes.prop_flat_map(|(shape, t_q, t_k)| {
        (
            Just(shape),
            matrix(t_q, shape.num_heads * shape.head_dim),
            matrix(t_k, shape.num_kv_heads * shape.head_dim),
            matrix(t_k, shape.num_kv_heads * shape.head_dim),
        )
    });
    runner(200)
        .run(&inputs, |(shape, q, k, v)| {
            let out = causal_attention(q.view(), k.view(), v.view(), shape);
            let expected: Vec<f32> = attention_f64(&q, &k, &v, shape)
                .iter()
                .map(|&e| e as f32)
                .collect();
            let out = out.as_standard_layout();
            assert_close_shaped(
                &format!("{shape:?}"),
                out.as_slice().unwrap(),
                &expected,
                &[out.nrows(), out.ncols()],
                Tolerance::F32,
            );
            Ok(())
        })
        .unwrap();
}

#[test]
fn softmax_rows_sum_to_one() {
    let rows = proptest::collection::vec(
        prop_oneof![8 => -90.0f32..90.0, 1 => Just(f32::NEG_INFINITY)],
        1..200,
    )
    .prop_filter("at least one finite score", |row| {
        row.iter().any(|x| x.is_finite())
    });
    runner(500)
        .run(&rows, |mut row| {
            let masked: Vec<bool> = row.iter().map(|x| x.is_infinite()).collect();
            softmax_in_place(&mut row);
            let sum: f64 = row.iter().map(|&p| p as f64).sum();
            prop_assert!((sum - 1.0).abs() < 1e-5, "sum {sum}");
            for (p, masked) in row.iter().zip(masked) {
                prop_assert!(*p >= 0.0 && *p <= 1.0);
                if masked {
                    prop_assert_eq!(*p, 0.0);
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn changing_later_tokens_never_changes_earlier_logits() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let vocab = model.config.vocab_size as u32;
    let cases = (2usize..40).prop_flat_map(move |len| {
        (
            proptest::collection::vec(0..vocab, len),
            proptest::collection::vec(0..vocab, len),
            1..len,
        )
    });
    runner(24)
        .run(&cases, |(a, b, keep)| {
            // b shares a's first `keep` tokens and differs afterwards.
            let b: Vec<u32> = a[..keep].iter().chain(&b[keep..]).copied().collect();
            let (la, lb) = (model.forward(&a).unwrap(), model.forward(&b).unwrap());
            // The same kernel on different sequence lengths: within f32 rounding, not bit for bit.
            let vocab = la.ncols();
            assert_close_shaped(
                &format!("logits of the first {keep} positions"),
                &lb.as_slice().unwrap()[..keep * vocab],
                &la.as_slice().unwrap()[..keep * vocab],
                &[keep, vocab],
                Tolerance::F32,
            );
            Ok(())
        })
        .unwrap();
}

fn rope_strategy() -> impl Strategy<Value = Rope> {
    let scaling = prop_oneof![
        Just(RopeScaling::Default),
        (1.0f64..8.0).prop_map(|factor| RopeScaling::Linear { factor }),
        (1.0f64..16.0, 16usize..256).prop_map(|(factor, original)| RopeScaling::Llama3 {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: original,
        }),
    ];
    (
        (1usize..40).prop_map(|half| half * 2),
        prop_oneof![Just(10_000.0), Just(500_000.0), 100.0f64..1e6],
        scaling,
    )
        .prop_map(|(head_dim, theta, scaling)| Rope::new(head_dim, theta, &scaling))
}

fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt()
}

#[test]
fn rope_keeps_vector_norms() {
    let cases = rope_strategy().prop_flat_map(|rope| {
        let d = rope.head_dim();
        (Just(rope), 1usize..4, 0usize..4096).prop_flat_map(move |(rope, heads, pos)| {
            (
                Just(rope),
                proptest::collection::vec(-3.0f32..3.0, heads * d),
                Just(pos),
            )
        })
    });
    runner(300)
        .run(&cases, |(rope, x, pos)| {
            let mut rotated = x.clone();
            rope.rotate(&mut rotated, pos);
            for (head, head_rotated) in x
                .chunks(rope.head_dim())
                .zip(rotated.chunks(rope.head_dim()))
            {
                let (n0, n1) = (norm(head), norm(head_rotated));
                prop_assert!((n0 - n1).abs() <= 1e-5 * (1.0 + n0), "{n0} vs {n1}");
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn rope_scores_depend_only_on_relative_offset() {
    let cases = rope_strategy().prop_flat_map(|rope| {
        let d = rope.head_dim();
        (
            Just(rope),
            proptest::collection::vec(-1.0f32..1.0, d),
            proptest::collection::vec(-1.0f32..1.0, d),
            0usize..512,
            0usize..512,
            0usize..512,
        )
    });
    runner(300)
        .run(&cases, |(rope, q, k, m, n, shift)| {
            let score = |m: usize, n: usize| {
                let (mut q, mut k) = (q.clone(), k.clone());
                rope.rotate(&mut q, m);
                rope.rotate(&mut k, n);
                q.iter().zip(&k).map(|(a, b)| (a * b) as f64).sum::<f64>()
            };
            let (s0, s1) = (score(m, n), score(m + shift, n + shift));
            // Angles are computed in f32 (as transformers does), so allow for their rounding.
            let scale = norm(&q) * norm(&k);
            prop_assert!(
                (s0 - s1).abs() <= 2e-3 * (1.0 + scale),
                "q·k at ({m},{n}) = {s0}, shifted by {shift} = {s1}"
            );
            Ok(())
        })
        .unwrap();
}

/// RMSNorm in f64, row by row: `x / sqrt(mean(x²) + eps) * weight`.
fn rms_norm_f64(x: &Array2<f32>, weight: &[f32], eps: f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.rows() {
        let mean_square = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / row.len() as f64;
        let inv_rms = 1.0 / (mean_square + eps).sqrt();
        out.extend(
            row.iter()
                .zip(weight)
                .map(|(&v, &w)| (v as f64 * inv_rms * w as f64) as f32),
        );
    }
    out
}

#[test]
fn rms_norm_equals_f64_reference_on_random_shapes() {
    let cases = (1usize..9, 1usize..70).prop_flat_map(|(t, hidden)| {
        (
            matrix(t, hidden),
            proptest::collection::vec(-2.0f32..2.0, hidden),
            prop_oneof![Just(1e-5), Just(1e-6)],
        )
    });
    runner(200)
        .run(&cases, |(x, weight, eps)| {
            let norm = RmsNorm::new(Array1::from(weight.clone()), eps);
            let expected = rms_norm_f64(&x, &weight, eps);
            let shape = [x.nrows(), x.ncols()];
            let out = norm.forward(x.view());
            assert_close_shaped(
                "forward",
                out.as_slice().unwrap(),
                &expected,
                &shape,
                Tolerance::F32,
            );
            // The allocation-free path (chapter 2's decode) against the same reference.
            let mut into = Array2::<f32>::from_elem(x.dim(), f32::NAN);
            norm.forward_into(x.view(), into.view_mut());
            assert_close_shaped(
                "forward_into",
                into.as_slice().unwrap(),
                &expected,
                &shape,
                Tolerance::F32,
            );
            Ok(())
        })
        .unwrap();
}

/// The one-row forms (chapter 2 threads them over rows) repeat the bits of the whole-matrix
/// forms. Apart from the test above, which is task 1.2's: a learner's `forward` may round
/// differently from `forward_row` and still be right.
#[test]
fn rms_norm_one_row_forms_repeat_the_matrix_forms() {
    let cases = (1usize..9, 1usize..70).prop_flat_map(|(t, hidden)| {
        (
            matrix(t, hidden),
            proptest::collection::vec(-2.0f32..2.0, hidden),
        )
    });
    runner(100)
        .run(&cases, |(x, weight)| {
            let norm = RmsNorm::new(Array1::from(weight), 1e-5);
            let out = norm.forward(x.view());
            let mut into = Array2::<f32>::from_elem(x.dim(), f32::NAN);
            norm.forward_into(x.view(), into.view_mut());
            let mut row_out = vec![f32::NAN; x.ncols()];
            for t in 0..x.nrows() {
                let x_t = x.row(t).to_vec();
                norm.forward_row(&x_t, &mut row_out);
                prop_assert_eq!(&row_out, &out.row(t).to_vec(), "forward_row, row {}", t);
                norm.forward_into_row(&x_t, &mut row_out);
                prop_assert_eq!(
                    &row_out,
                    &into.row(t).to_vec(),
                    "forward_into_row, row {}",
                    t
                );
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn rope_rotates_each_half_pair_like_the_reference() {
    let cases = (
        (1usize..40).prop_map(|half| half * 2),
        100.0f64..1e6,
        1usize..4,
        0usize..2048,
    )
        .prop_flat_map(|(d, theta, heads, pos)| {
            (
                Just((d, theta, pos)),
                proptest::collection::vec(-3.0f32..3.0, heads * d),
            )
        });
    runner(300)
        .run(&cases, |((d, theta, pos), x)| {
            let rope = Rope::new(d, theta, &RopeScaling::Default);
            let mut rotated = x.clone();
            rope.rotate(&mut rotated, pos);
            // Pair (i, i + d/2) of every head turns by pos · theta^(-2i/d); the angle is
            // rounded to f32 as transformers computes it, the rest is f64.
            let mut expected = x.clone();
            for (head, out) in x.chunks(d).zip(expected.chunks_mut(d)) {
                for i in 0..d / 2 {
                    let freq = 1.0 / theta.powf((2 * i) as f64 / d as f64);
                    let angle = ((pos as f32) * (freq as f32)) as f64;
                    let (sin, cos) = angle.sin_cos();
                    let (a, b) = (head[i] as f64, head[i + d / 2] as f64);
                    out[i] = (a * cos - b * sin) as f32;
                    out[i + d / 2] = (b * cos + a * sin) as f32;
                }
            }
            assert_close_shaped(
                &format!("head_dim {d}, theta {theta}, position {pos}"),
                &rotated,
                &expected,
                &[x.len() / d, d],
                Tolerance::F32,
            );
            Ok(())
        })
        .unwrap();
}
