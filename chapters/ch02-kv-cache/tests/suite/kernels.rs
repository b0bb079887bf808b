//! The fast kernels against chapter 1's dense reference, on random shapes that are not multiples
//! of the kernels' panel (16 outputs), tile (6 tokens) or unroll (4 inputs) sizes, for every
//! instruction set the CPU has; and whole models on the fast path.

use ch01::linear::{DenseLinear, Linear};
use ch01::testing::seeded_runner;
use ch01::testing::{Tolerance, assert_close_shaped, assert_rel_close, load_golden};
use ch01::{Llama, fixtures_dir};
use ch02_kv_cache::kernels::Isa;
use ch02_kv_cache::{ContiguousKvCache, FastLinear, WeightDtype, forward_cached, load_fast};
use half::bf16;
use ndarray::{Array1, Array2};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

fn runner(cases: u32) -> TestRunner {
    seeded_runner(cases, 3)
}

/// (weight [out, in], bias, x [T, in])
fn layer_and_input() -> impl Strategy<Value = (Array2<f32>, Option<Array1<f32>>, Array2<f32>)> {
    (1usize..150, 1usize..70, 1usize..20, any::<bool>()).prop_flat_map(
        |(out_f, in_f, tokens, has_bias)| {
            (
                proptest::collection::vec(-1.0f32..1.0, out_f * in_f)
                    .prop_map(move |w| Array2::from_shape_vec((out_f, in_f), w).unwrap()),
                proptest::collection::vec(-1.0f32..1.0, out_f)
                    .prop_map(move |b| has_bias.then(|| Array1::from_vec(b))),
                proptest::collection::vec(-2.0f32..2.0, tokens * in_f)
                    .prop_map(move |x| Array2::from_shape_vec((tokens, in_f), x).unwrap()),
            )
        },
    )
}

/// `y = x Wᵀ + b` in f64, on the weights as stored (bf16-rounded for bf16 storage).
fn naive(
    w: &Array2<f32>,
    b: &Option<Array1<f32>>,
    x: &Array2<f32>,
    dtype: WeightDtype,
) -> Vec<f32> {
    let stored = |v: f32| match dtype {
        WeightDtype::F32 => v,
        WeightDtype::Bf16 => bf16::from_f32(v).to_f32(),
    };
    let mut y = Vec::with_capacity(x.nrows() * w.nrows());
    for x_t in x.rows() {
        for (o, w_o) in w.rows().into_iter().enumerate() {
            let dot: f64 = w_o
                .iter()
                .zip(&x_t)
                .map(|(&w, &x)| stored(w) as f64 * x as f64)
                .sum();
            y.push((dot + b.as_ref().map_or(0.0, |b| b[o] as f64)) as f32);
        }
    }
    y
}

fn kernels_equal_the_naive_product(dtype: WeightDtype) {
    runner(300)
        .run(&layer_and_input(), |(w, b, x)| {
            let expected = naive(&w, &b, &x, dtype);
            for isa in Isa::available() {
                let layer = FastLinear::new(w.clone(), b.clone(), dtype).with_isa(isa);
                let actual = layer.forward(x.view());
                // f32 sums against f64 ones on the same (stored) weights: f32 rounding only.
                assert_close_shaped(
                    &format!("{isa:?} {dtype:?}: W {:?}, x {:?}", w.dim(), x.dim()),
                    actual.as_slice().unwrap(),
                    &expected,
                    &[x.nrows(), w.nrows()],
                    Tolerance::F32,
                );
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn f32_kernels_equal_the_naive_product() {
    kernels_equal_the_naive_product(WeightDtype::F32);
}

/// Products of 2^20 multiply-adds or more run on rayon's threads, each writing its own part of
/// the output: equal to the naive product too, on shapes that are multiples of nothing.
#[test]
fn threaded_products_equal_the_naive_product() {
    let shapes = (30usize..50, 180usize..260, 200usize..300, any::<bool>());
    runner(8)
        .run(&shapes, |(tokens, out_f, in_f, bf16)| {
            let w = Array2::from_shape_fn((out_f, in_f), |(o, i)| {
                ((o * 31 + i * 17) % 23) as f32 / 11.5 - 1.0
            });
            let x = Array2::from_shape_fn((tokens, in_f), |(t, i)| {
                ((t * 13 + i * 7) % 19) as f32 / 9.5 - 1.0
            });
            let b = Some(Array1::from_shape_fn(out_f, |o| o as f32 * 0.01));
            assert!(tokens * out_f * in_f >= 1 << 20);
            let dtype = if bf16 {
                WeightDtype::Bf16
            } else {
                WeightDtype::F32
            };
            let expected = naive(&w, &b, &x, dtype);
            for isa in Isa::available() {
                let layer = FastLinear::new(w.clone(), b.clone(), dtype).with_isa(isa);
                assert_close_shaped(
                    &format!("{isa:?} {dtype:?}: W {:?}, x {:?}", w.dim(), x.dim()),
                    layer.forward(x.view()).as_slice().unwrap(),
                    &expected,
                    &[tokens, out_f],
                    Tolerance::F32,
                );
            }
            Ok(())
        })
        .unwrap();
}

/// A weight [out, in] and input [tokens, in] of fixed patterns (large shapes without the cost
/// of random values), and the storage `bf16` asks for.
fn patterned(
    out_f: usize,
    in_f: usize,
    tokens: usize,
    bf16: bool,
) -> (Array2<f32>, Array2<f32>, WeightDtype) {
    let w = Array2::from_shape_fn((out_f, in_f), |(o, i)| {
        ((o * 29 + i * 13) % 17) as f32 / 8.5 - 1.0
    });
    let x = Array2::from_shape_fn((tokens, in_f), |(t, i)| {
        ((t * 5 + i * 7) % 11) as f32 / 5.5 - 1.0
    });
    let dtype = if bf16 {
        WeightDtype::Bf16
    } else {
        WeightDtype::F32
    };
    (w, x, dtype)
}

/// `layer` on `x` [T, in] into an output that starts as NaN: an output the product does not
/// write stays NaN and fails any comparison.
fn forward_from_nan(layer: &FastLinear, x: ndarray::ArrayView2<f32>) -> Array2<f32> {
    let mut y = Array2::from_elem((x.nrows(), layer.out_features()), f32::NAN);
    layer.forward_into(x, y.view_mut());
    y
}

/// One token's product splits a matrix of up to `EVEN_SPLIT_PANELS` panels evenly across the
/// threads, a larger one into many tasks: both ways give the same bits on sizes around the
/// boundary (and the boundary itself, fewer panels than threads, none), equal to the naive
/// product; every output is written (they start as NaN). Three threads, so that splits are
/// uneven.
#[test]
fn one_token_products_split_evenly_or_not_give_the_same_bits() {
    use ch02_kv_cache::kernels::{EVEN_SPLIT_PANELS, NR, set_even_split};
    let edge = EVEN_SPLIT_PANELS * NR;
    let rows = prop_oneof![
        Just(0usize),
        Just(1),
        Just(2 * NR - 1),
        Just(edge - NR),
        Just(edge - 1),
        Just(edge),
        Just(edge + 1),
        Just(edge + NR),
        1usize..2 * edge + 40,
    ];
    let shapes = (rows, 1usize..90, any::<bool>());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    pool.install(|| {
        runner(24)
            .run(&shapes, |(out_f, in_f, bf16)| {
                let (w, x, dtype) = patterned(out_f, in_f, 1, bf16);
                let expected = naive(&w, &None, &x, dtype);
                for isa in Isa::available() {
                    let layer = FastLinear::new(w.clone(), None, dtype).with_isa(isa);
                    let split = |even: bool| {
                        set_even_split(even);
                        let y = forward_from_nan(&layer, x.view());
                        set_even_split(true);
                        y
                    };
                    let (even, many) = (split(true), split(false));
                    let bits = |y: &Array2<f32>| y.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    prop_assert_eq!(
                        bits(&even),
                        bits(&many),
                        "{:?} {:?} W {:?}",
                        isa,
                        dtype,
                        w.dim()
                    );
                    assert_close_shaped(
                        &format!("{isa:?} {dtype:?}: W {:?}", w.dim()),
                        even.as_slice().unwrap(),
                        &expected,
                        &[1, out_f],
                        Tolerance::F32,
                    );
                }
                Ok(())
            })
            .unwrap()
    });
}

/// Products of 2 to `MATVEC_TOKENS` tokens run the several-token matvec on AVX2, and of 2 to
/// `MATVEC_TOKENS_512` on AVX-512 where the CPU has it: every row equals that token's one-token
/// product bit for bit, and the naive product, and the two kernels give the same bits; with the
/// switches off (the GEMM micro-kernel) they equal the naive product too. Outputs start as NaN,
/// so an unwritten one fails.
/// Whether this CPU has the AVX-512F the 16-lane several-token matvec needs.
fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    return ch02_kv_cache::kernels::Avx512::cached().is_some();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[test]
fn few_token_products_equal_one_token_products_bit_for_bit() {
    use ch02_kv_cache::kernels::{
        MATVEC_TOKENS, MATVEC_TOKENS_512, set_tokens_matvec, set_tokens_matvec_512,
    };
    let shapes = (
        0usize..300,
        1usize..90,
        2..=MATVEC_TOKENS_512,
        any::<bool>(),
    );
    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    runner(32)
        .run(&shapes, |(out_f, in_f, tokens, bf16)| {
            let (w, x, dtype) = patterned(out_f, in_f, tokens, bf16);
            let expected = naive(&w, &None, &x, dtype);
            for isa in Isa::available() {
                let layer = FastLinear::new(w.clone(), None, dtype).with_isa(isa);
                let run = |x: ndarray::ArrayView2<f32>| forward_from_nan(&layer, x);
                // (several-token matvec, AVX-512's where the CPU has it)
                for (matvec, wide) in [(true, true), (true, false), (false, false)] {
                    set_tokens_matvec(matvec);
                    set_tokens_matvec_512(wide);
                    let y = run(x.view());
                    set_tokens_matvec(true);
                    set_tokens_matvec_512(true);
                    let what = format!(
                        "{isa:?} {dtype:?} matvec {matvec} AVX-512 {wide}: W {:?}, x {:?}",
                        w.dim(),
                        x.dim()
                    );
                    let y = y.as_slice().unwrap();
                    assert_close_shaped(&what, y, &expected, &[tokens, out_f], Tolerance::F32);
                    // Which ways run a several-token matvec (the rest run the GEMM).
                    let several = matvec && (tokens <= MATVEC_TOKENS || (wide && has_avx512()));
                    if several && isa != Isa::Portable {
                        for t in 0..tokens {
                            let one = run(x.slice(ndarray::s![t..t + 1, ..]));
                            prop_assert_eq!(
                                bits(&y[t * out_f..][..out_f]),
                                bits(one.as_slice().unwrap()),
                                "{}, token {}",
                                what,
                                t
                            );
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn bf16_kernels_equal_the_naive_product_on_bf16_rounded_weights() {
    kernels_equal_the_naive_product(WeightDtype::Bf16);
}

/// Every instruction set this CPU has computes the same layer as the portable one (one token on
/// the decode kernel, several on the prefill kernel), and detection names one of them.
#[test]
fn detected_isa_agrees_with_the_portable_one() {
    assert!(Isa::available().contains(&Isa::detect()));
    assert_eq!(Isa::available()[0], Isa::Portable);
    #[cfg(target_arch = "x86_64")]
    assert_eq!(
        Isa::avx2_fma().is_some(),
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    );
    runner(50)
        .run(&layer_and_input(), |(w, b, x)| {
            for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
                let portable = FastLinear::new(w.clone(), b.clone(), dtype)
                    .with_isa(Isa::Portable)
                    .forward(x.view());
                let detected = FastLinear::new(w.clone(), b.clone(), dtype)
                    .with_isa(Isa::detect())
                    .forward(x.view());
                // Different summation orders (4 accumulators against 1): f32 rounding only.
                assert_close_shaped(
                    &format!("{:?} vs portable, {dtype:?}", Isa::detect()),
                    detected.as_slice().unwrap(),
                    portable.as_slice().unwrap(),
                    &[x.nrows(), w.nrows()],
                    Tolerance::F32,
                );
            }
            Ok(())
        })
        .unwrap();
}

/// No tokens in, no rows out (chapter 4's engine asks for no logits when a step only runs
/// prompt chunks).
#[test]
fn zero_tokens_give_zero_rows() {
    let w = Array2::from_shape_fn((40, 24), |(o, k)| (o * 24 + k) as f32 * 1e-3);
    for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
        for isa in Isa::available() {
            let layer = FastLinear::new(w.clone(), None, dtype).with_isa(isa);
            let y = layer.forward(Array2::<f32>::zeros((0, 24)).view());
            assert_eq!(y.dim(), (0, 40), "{isa:?} {dtype:?}");
        }
    }
}

/// The fast layer agrees with chapter 1's dense layer (ndarray's product) as well.
#[test]
fn fast_linear_equals_the_dense_layer() {
    runner(100)
        .run(&layer_and_input(), |(w, b, x)| {
            let expected = DenseLinear::new(w.clone(), b.clone()).forward(x.view());
            let actual = FastLinear::new(w, b, WeightDtype::F32).forward(x.view());
            let expected = expected.as_standard_layout();
            assert_close_shaped(
                "fast vs dense",
                actual.as_slice().unwrap(),
                expected.as_slice().unwrap(),
                &[actual.nrows(), actual.ncols()],
                Tolerance::F32,
            );
            Ok(())
        })
        .unwrap();
}

/// The fast f32 model on the cached path matches transformers' logits and greedy tokens.
#[test]
fn fast_model_matches_the_goldens() {
    for name in ["random-qwen2", "random-untied", "shakespeare-small"] {
        let golden = load_golden(name);
        let model = load_fast(&golden.model_dir, WeightDtype::F32).unwrap();
        for (case, expected) in golden.cases.iter().zip(&golden.logits) {
            let mut cache = ContiguousKvCache::for_max_len(&model.config);
            let logits = forward_cached(&model, &case.input_ids, &mut cache).unwrap();
            assert_rel_close(
                &format!("{name} fast logits"),
                logits.as_slice().unwrap(),
                expected,
                1e-4,
            );
        }
    }
}

/// A checkpoint stored in bf16 loses nothing in bf16 storage; an f32 one stays close.
#[test]
fn bf16_storage_tolerances() {
    let golden = load_golden("random-bf16");
    let model = load_fast(&golden.model_dir, WeightDtype::Bf16).unwrap();
    let case = &golden.cases[0];
    let logits = model.forward(&case.input_ids).unwrap();
    assert_rel_close(
        "bf16 checkpoint in bf16 storage",
        logits.as_slice().unwrap(),
        &golden.logits[0],
        1e-4,
    );

    let dir = fixtures_dir().join("shakespeare-small");
    let (f32_model, bf16_model) = (
        Llama::load(&dir).unwrap(),
        load_fast(&dir, WeightDtype::Bf16).unwrap(),
    );
    let tokens = [0u32, 412, 306, 13, 534, 325, 291, 306, 13, 330];
    let (a, b) = (
        f32_model.forward(&tokens).unwrap(),
        bf16_model.forward(&tokens).unwrap(),
    );
    // bf16 rounding (2⁻⁸ relative per weight, `Tolerance::BF16`) compounded through the
    // layers: a whole-tensor bound, as single logits near zero carry no relative meaning.
    assert_rel_close(
        "bf16 vs f32 logits",
        b.as_slice().unwrap(),
        a.as_slice().unwrap(),
        2e-2,
    );
}

/// Every prefill micro-kernel this CPU has ([`Gemm::available`]: portable, AVX2, AVX-512 one
/// panel or two at a time)
/// against the naive product, on token counts that leave partial tiles of every height (up to
/// 84 tokens: seven 12-token AVX-512 tiles, the last one partial) and output counts of 1 to 5
/// panels (AVX-512 runs panels in pairs, and a last odd or partial one alone), f32 and bf16
/// weights; and both AVX-512 kernels equal to the AVX2 one bit for bit (each output is the same
/// chain of fused multiply-adds over `k`), also from 4 tiles on, where they widen each bf16
/// panel to f32 once instead of at every load.
#[test]
fn every_prefill_micro_kernel_equals_the_naive_product_and_avx512_equals_avx2() {
    use ch02_kv_cache::kernels::{Gemm, PackedWeight, matmul_with};
    let shapes = (1usize..70, 1usize..40, 2usize..85);
    let inputs = shapes.prop_flat_map(|(out_f, in_f, tokens)| {
        (
            proptest::collection::vec(-1.0f32..1.0, out_f * in_f)
                .prop_map(move |w| Array2::from_shape_vec((out_f, in_f), w).unwrap()),
            proptest::collection::vec(-2.0f32..2.0, tokens * in_f)
                .prop_map(move |x| Array2::from_shape_vec((tokens, in_f), x).unwrap()),
        )
    });
    runner(200)
        .run(&inputs, |(w, x)| {
            let (tokens, (out_f, in_f)) = (x.nrows(), w.dim());
            let flat = w.as_slice().unwrap();
            for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
                let expected = naive(&w, &None, &x, dtype);
                let mut outputs = Vec::new();
                for gemm in Gemm::available() {
                    let mut y = vec![0.0f32; tokens * out_f];
                    match dtype {
                        WeightDtype::F32 => {
                            let packed = PackedWeight::<f32>::pack(flat, out_f, in_f);
                            matmul_with(gemm, &packed, x.as_slice().unwrap(), &mut y, tokens);
                        }
                        WeightDtype::Bf16 => {
                            let packed = PackedWeight::<u16>::pack(flat, out_f, in_f);
                            matmul_with(gemm, &packed, x.as_slice().unwrap(), &mut y, tokens);
                        }
                    }
                    assert_close_shaped(
                        &format!("{gemm:?} {dtype:?}: W {:?}, x {:?}", w.dim(), x.dim()),
                        &y,
                        &expected,
                        &[tokens, out_f],
                        Tolerance::F32,
                    );
                    outputs.push((gemm, y));
                }
                #[cfg(target_arch = "x86_64")]
                {
                    let of = |want: fn(&Gemm) -> bool| {
                        outputs.iter().find(|(g, _)| want(g)).map(|(_, y)| y)
                    };
                    let avx2 = of(|g| matches!(g, Gemm::Avx2Fma(_)));
                    let wide = [
                        of(|g| matches!(g, Gemm::Avx512(_))),
                        of(|g| matches!(g, Gemm::Avx512Pair(_))),
                    ];
                    for (avx2, avx512) in wide.into_iter().filter_map(|w| Some((avx2?, w?))) {
                        prop_assert!(
                            avx2.iter()
                                .zip(avx512)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "AVX-512 differs from AVX2 ({dtype:?}, W {:?}, x {:?})",
                            w.dim(),
                            x.dim()
                        );
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

/// `matmul_part` (causal attention's products) against the naive product of the corner it
/// names: `outputs` of the rows and `inputs` of the columns of a packed weight, any corner
/// (partial panels, a prefix of `k` that ends inside an unroll), every micro-kernel, f32 weights.
#[test]
fn matmul_part_equals_the_naive_product_of_its_corner() {
    use ch02_kv_cache::kernels::{Gemm, PackedWeight, matmul_part};
    let shapes = (1usize..70, 1usize..40, 1usize..31);
    let inputs = shapes.prop_flat_map(|(out_f, in_f, tokens)| {
        (
            proptest::collection::vec(-1.0f32..1.0, out_f * in_f)
                .prop_map(move |w| Array2::from_shape_vec((out_f, in_f), w).unwrap()),
            1..=out_f,
            1..=in_f,
            proptest::collection::vec(-2.0f32..2.0, tokens * in_f),
        )
    });
    runner(200)
        .run(&inputs, |(w, outputs, in_used, x)| {
            let (out_f, in_f) = w.dim();
            let tokens = x.len() / in_f;
            let x =
                Array2::from_shape_vec((tokens, in_used), x[..tokens * in_used].to_vec()).unwrap();
            let corner = w.slice(ndarray::s![..outputs, ..in_used]).to_owned();
            let expected = naive(&corner, &None, &x, WeightDtype::F32);
            let packed = PackedWeight::<f32>::pack(w.as_slice().unwrap(), out_f, in_f);
            for gemm in Gemm::available() {
                let mut y = vec![f32::NAN; tokens * outputs];
                let xs = x.as_slice().unwrap();
                matmul_part(gemm, &packed, outputs, in_used, xs, &mut y, tokens);
                assert_close_shaped(
                    &format!("{gemm:?}: W {:?}, corner {outputs} × {in_used}", w.dim()),
                    &y,
                    &expected,
                    &[tokens, outputs],
                    Tolerance::F32,
                );
            }
            Ok(())
        })
        .unwrap();
}

/// A weight packed from its columns (`pack_columns`: prefill attention's values, one column per
/// stored position), from rows lying anywhere (`pack_rows`) or from rows written on demand
/// (`pack_with`: chapter 5's widened codes) is the weight `pack` makes from the row-major
/// matrix, bit for bit, in both element types, on sizes that leave a partial last
/// panel.
#[test]
fn packing_from_rows_columns_or_a_filler_equals_packing_the_matrix() {
    use ch02_kv_cache::kernels::{PackedWeight, WeightElement};
    fn bits<W: WeightElement>(w: &PackedWeight<W>) -> Vec<u32> {
        let panels = (0..w.num_panels()).flat_map(|p| w.panel(p));
        panels.map(|v| v.to_f32().to_bits()).collect()
    }
    fn check<W: WeightElement>(w: &Array2<f32>) -> Result<(), TestCaseError> {
        let (out_f, in_f) = w.dim();
        let whole = PackedWeight::<W>::pack(w.as_slice().unwrap(), out_f, in_f);
        // Rows stored in reverse, as a KV store may hold positions.
        let reversed: Vec<f32> = w.rows().into_iter().rev().flatten().copied().collect();
        let from_rows = PackedWeight::<W>::pack_rows(out_f, in_f, |o| {
            &reversed[(out_f - 1 - o) * in_f..][..in_f]
        });
        let transposed = w.t().as_standard_layout().to_owned(); // [in, out]
        let columns = transposed.as_slice().unwrap();
        let from_columns =
            PackedWeight::<W>::pack_columns(out_f, in_f, |k| &columns[k * out_f..][..out_f]);
        let written = PackedWeight::<W>::pack_with(out_f, in_f, |o, k, part| {
            part.copy_from_slice(&reversed[(out_f - 1 - o) * in_f + k..][..part.len()])
        });
        // Refilled over a larger weight's storage: nothing of it may show through.
        let mut refilled =
            PackedWeight::<W>::pack_with(out_f + 17, in_f + 70, |_, _, part| part.fill(7.0));
        refilled.refill_with(out_f, in_f, |o, k, part| {
            part.copy_from_slice(&w.as_slice().unwrap()[o * in_f + k..][..part.len()])
        });
        prop_assert_eq!(
            bits(&refilled),
            bits(&whole),
            "refill_with, {} × {}",
            out_f,
            in_f
        );
        prop_assert_eq!(
            bits(&written),
            bits(&whole),
            "pack_with, {} × {}",
            out_f,
            in_f
        );
        prop_assert_eq!(
            bits(&from_rows),
            bits(&whole),
            "pack_rows, {} × {}",
            out_f,
            in_f
        );
        prop_assert_eq!(
            bits(&from_columns),
            bits(&whole),
            "pack_columns, {} × {}",
            out_f,
            in_f
        );
        Ok(())
    }
    let weights = (1usize..70, 1usize..150).prop_flat_map(|(out_f, in_f)| {
        proptest::collection::vec(-1.0f32..1.0, out_f * in_f)
            .prop_map(move |w| Array2::from_shape_vec((out_f, in_f), w).unwrap())
    });
    runner(200)
        .run(&weights, |w| {
            check::<f32>(&w)?;
            check::<u16>(&w)
        })
        .unwrap();
}

/// Turns every switch of the products' loops back on when dropped, even if a product panics,
/// for the other tests of this binary.
struct SwitchesBackOn;

impl Drop for SwitchesBackOn {
    fn drop(&mut self) {
        use ch02_kv_cache::kernels::{set_panels_ahead, set_rows_ahead, set_stretches};
        set_panels_ahead(true);
        set_rows_ahead(true);
        set_stretches(true);
    }
}

/// `matmul_part` of `gemm` on the top-left `outputs × inputs` corner of `w` [out, in], packed
/// as `dtype`, and `x` [tokens, inputs].
fn corner_product(
    gemm: ch02_kv_cache::kernels::Gemm,
    dtype: WeightDtype,
    w: &Array2<f32>,
    (outputs, inputs): (usize, usize),
    x: &[f32],
) -> Vec<f32> {
    use ch02_kv_cache::kernels::{PackedWeight, matmul_part};
    let ((out_f, in_f), tokens) = (w.dim(), x.len() / inputs.max(1));
    let flat = w.as_slice().unwrap();
    let mut y = vec![0.0f32; tokens * outputs];
    match dtype {
        WeightDtype::F32 => {
            let packed = PackedWeight::<f32>::pack(flat, out_f, in_f);
            matmul_part(gemm, &packed, outputs, inputs, x, &mut y, tokens);
        }
        WeightDtype::Bf16 => {
            let packed = PackedWeight::<u16>::pack(flat, out_f, in_f);
            matmul_part(gemm, &packed, outputs, inputs, x, &mut y, tokens);
        }
    }
    y
}

/// The requests for weights ahead, the next panels' (`kernels/ahead.rs`) and the rows of the
/// panels being multiplied (`kernels::ROWS_AHEAD`), change no product, and the next panels'
/// shares stay inside the panels (one that overran would panic here): on one thread (so that a
/// task holds several pairs of panels and asks for the next), every micro-kernel on 9 to 19
/// panels (odd and partial last ones), 2 to 200 tokens (1 to 17 AVX-512 tiles, across the 2-
/// and 11-tile limits and bf16's widening from 4 tiles), f32 and bf16, with both requests
/// equals the naive product and the same product with either or neither bit for bit; and so
/// does a top-left corner of the weight (8 to 19 panels; `matmul_part`, as causal attention
/// uses it), whose next panels are cut to the corner's inputs.
#[test]
fn asking_for_weights_ahead_changes_no_product() {
    use ch02_kv_cache::kernels::{Gemm, set_panels_ahead, set_rows_ahead};
    let shapes = (
        129usize..290,
        2usize..40,
        2usize..201,
        0usize..17,
        0usize..2,
    );
    let inputs = shapes.prop_flat_map(|(out_f, in_f, tokens, cut_out, cut_in)| {
        (
            proptest::collection::vec(-1.0f32..1.0, out_f * in_f)
                .prop_map(move |w| Array2::from_shape_vec((out_f, in_f), w).unwrap()),
            proptest::collection::vec(-2.0f32..2.0, tokens * in_f)
                .prop_map(move |x| Array2::from_shape_vec((tokens, in_f), x).unwrap()),
            Just((cut_out, cut_in)),
        )
    });
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| {
        runner(24)
            .run(&inputs, |(w, x, (cut_out, cut_in))| {
                let (tokens, (out_f, in_f)) = (x.nrows(), w.dim());
                // The whole weight, then a corner of it.
                for (outputs, inputs) in [(out_f, in_f), (out_f - cut_out, in_f - cut_in)] {
                    let corner = w.slice(ndarray::s![..outputs, ..inputs]).to_owned();
                    let x_in = x.slice(ndarray::s![.., ..inputs]).to_owned();
                    let x_in = x_in.as_slice().unwrap();
                    for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
                        let expected = naive(&corner, &None, &x.slice(ndarray::s![.., ..inputs]).to_owned(), dtype);
                        for gemm in Gemm::available() {
                            let run = |panels: bool, rows: bool| {
                                set_panels_ahead(panels);
                                set_rows_ahead(rows);
                                corner_product(gemm, dtype, &w, (outputs, inputs), x_in)
                            };
                            let _restore = SwitchesBackOn;
                            let with = run(true, true);
                            let what = format!("{gemm:?} {dtype:?}: W {:?} corner {outputs}×{inputs}, {tokens} tokens", w.dim());
                            assert_close_shaped(&what, &with, &expected, &[tokens, outputs], Tolerance::F32);
                            for (panels, rows) in [(false, true), (true, false), (false, false)] {
                                let without = run(panels, rows);
                                prop_assert!(
                                    with.iter().zip(&without).all(|(a, b)| a.to_bits() == b.to_bits()),
                                    "{what}: the requests changed the product (next panels {panels}, rows {rows})"
                                );
                            }
                        }
                    }
                }
                Ok(())
            })
            .unwrap();
    });
}

/// Going through the pairs of panels in stretches of `STRETCH_ROWS` features, every tile in
/// turn (products of 2 and 3 AVX-512 tiles), changes no product: on 2 to 50 tokens (1 to 5
/// tiles, across both limits), 1 to 200 input features (none, one or several whole stretches
/// and a partial last one), 17 to 80 outputs (odd and partial last panels), f32 and bf16, with
/// and without the rows asked for ahead, every micro-kernel's product with stretches equals
/// the naive product and the same product without them bit for bit; so does a top-left corner.
/// Four fixed shapes of 2 and 3 tiles come first, so that the stretches surely run.
#[test]
fn stretches_of_features_change_no_product() {
    use ch02_kv_cache::kernels::{
        Gemm, PackedWeight, STRETCH_ROWS, matmul_part, set_rows_ahead, set_stretches,
    };
    assert_eq!(
        STRETCH_ROWS, 64,
        "the feature counts below straddle one and two stretches"
    );
    let shapes = (17usize..81, 1usize..201, 2usize..51, 0usize..17, 0usize..2);
    let inputs = shapes.prop_flat_map(|(out_f, in_f, tokens, cut_out, cut_in)| {
        (
            proptest::collection::vec(-1.0f32..1.0, out_f * in_f)
                .prop_map(move |w| Array2::from_shape_vec((out_f, in_f), w).unwrap()),
            proptest::collection::vec(-2.0f32..2.0, tokens * in_f)
                .prop_map(move |x| Array2::from_shape_vec((tokens, in_f), x).unwrap()),
            Just((cut_out, cut_in.min(in_f - 1))),
        )
    });
    let _restore = SwitchesBackOn;
    // Cases sure to go in stretches (2 or 3 tiles, several stretches or one, a partial last),
    // whatever the generator draws below.
    for (tokens, in_f, out_f) in [(30, 150, 40), (25, 64, 32), (14, 129, 33), (36, 200, 80)] {
        let w = Array2::from_shape_fn((out_f, in_f), |(o, i)| {
            ((o * 7 + i * 3) % 17) as f32 / 17.0 - 0.5
        });
        let x = Array2::from_shape_fn((tokens, in_f), |(t, i)| {
            ((t * 5 + i * 11) % 13) as f32 / 6.5 - 1.0
        });
        let packed = PackedWeight::<f32>::pack(w.as_slice().unwrap(), out_f, in_f);
        for gemm in Gemm::available() {
            let run = |stretches: bool| {
                set_stretches(stretches);
                let mut y = vec![0.0f32; tokens * out_f];
                matmul_part(
                    gemm,
                    &packed,
                    out_f,
                    in_f,
                    x.as_slice().unwrap(),
                    &mut y,
                    tokens,
                );
                y
            };
            let (with, without) = (run(true), run(false));
            assert!(
                with.iter()
                    .zip(&without)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{gemm:?}: {tokens} tokens × {in_f} → {out_f}: the stretches changed the product"
            );
        }
    }
    runner(32)
        .run(&inputs, |(w, x, (cut_out, cut_in))| {
            let (tokens, (out_f, in_f)) = (x.nrows(), w.dim());
            for (outputs, inputs) in [(out_f, in_f), (out_f - cut_out, in_f - cut_in)] {
                let x_in = x.slice(ndarray::s![.., ..inputs]).to_owned();
                let corner = w.slice(ndarray::s![..outputs, ..inputs]).to_owned();
                for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
                    let expected = naive(&corner, &None, &x_in, dtype);
                    for gemm in Gemm::available() {
                        let run = |stretches: bool, rows: bool| {
                            set_stretches(stretches);
                            set_rows_ahead(rows);
                            corner_product(
                                gemm,
                                dtype,
                                &w,
                                (outputs, inputs),
                                x_in.as_slice().unwrap(),
                            )
                        };
                        let what = format!(
                            "{gemm:?} {dtype:?}: W {:?} corner {outputs}×{inputs}, {tokens} tokens",
                            w.dim()
                        );
                        for rows in [true, false] {
                            let with = run(true, rows);
                            assert_close_shaped(
                                &what,
                                &with,
                                &expected,
                                &[tokens, outputs],
                                Tolerance::F32,
                            );
                            let without = run(false, rows);
                            prop_assert!(
                                with.iter()
                                    .zip(&without)
                                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{what}: the stretches changed the product (rows ahead {rows})"
                            );
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}
