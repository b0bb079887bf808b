//! SmoothQuant W8A8: the int8 kernel against a dense reference of its dequantized operands, on
//! random shapes that are multiples of nothing; the migration with quantization switched off
//! is an identity (every layer of shakespeare-tiny, o_proj smoothed or not); and on a layer
//! whose activations carry a few outlier channels, smoothing lowers W8A8's output error.

use ch01::linear::{DenseLoader, Linear};
use ch01::testing::{relative_l2, seeded_runner};
use ch01::{Llama, LlamaConfig, TensorParallel, Tokenizer, Weights, fixtures_dir};
use ch02::kernels::Isa;
use ch02::workload::WorkloadRng;
use ch05_quantization::smoothquant::smooth::{column_max, factors};
use ch05_quantization::smoothquant::w8a8::{MAX_IN_FEATURES, dot_i8, grid_scale, quantize_token};
use ch05_quantization::smoothquant::{
    ChannelMax, Int8Activations, SmoothConfig, SmoothError, W8A8Error, W8A8Linear, calibrate,
    smooth,
};
use ch05_quantization::testing::{PatchedSource, weights_with_tiny_and_zero_rows};
use ndarray::{Array1, Array2};
use proptest::prelude::*;

const EPS: f64 = f32::EPSILON as f64 / 2.0; // the unit roundoff of f32

fn uniform(rng: &mut WorkloadRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| (rng.uniform_open0() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// Shapes that are multiples of no lane width (32, 16), of the tiles' groups of 8 rows and words
/// of 4, nor of the 16- or 32-row tasks; token counts below and above the W8A16 layer's switch
/// to the GEMM (24) and the tiles' 32-token step.
fn shape() -> impl Strategy<Value = (usize, usize, usize, u64)> {
    let tokens = prop_oneof![1usize..7, 24usize..31, 61usize..68];
    (tokens, 1usize..300, 1usize..45, any::<u64>())
}

#[test]
fn int8_dot_is_exact() {
    let mut runner = seeded_runner(64, 21);
    runner
        .run(&(0usize..400, any::<u64>()), |(n, seed)| {
            let mut rng = WorkloadRng::new(seed);
            let mut codes = || -> Vec<i8> {
                (0..n)
                    .map(|_| (rng.uniform_open0() * 255.0 - 127.5).round() as i8)
                    .map(|c| c.max(-127))
                    .collect()
            };
            let (a, b) = (codes(), codes());
            let want: i64 = a.iter().zip(&b).map(|(&x, &y)| x as i64 * y as i64).sum();
            prop_assert_eq!(dot_i8(&a, &b) as i64, want);
            Ok(())
        })
        .unwrap();
}

#[test]
fn activation_codes_round_to_nearest() {
    let mut runner = seeded_runner(64, 22);
    runner
        .run(
            &(1usize..300, 0.0f32..100.0, any::<u64>()),
            |(n, m, seed)| {
                let x = uniform(&mut WorkloadRng::new(seed), n, m);
                let mut q = vec![0i8; n];
                let s = quantize_token(&x, &mut q);
                let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                prop_assert!(s > 0.0 && (amax == 0.0 || (s * 127.0 - amax).abs() <= amax * 1e-6));
                for (&v, &c) in x.iter().zip(&q) {
                    prop_assert!((-127..=127).contains(&c));
                    let err = (f64::from(c) * f64::from(s) - f64::from(v)).abs();
                    prop_assert!(err <= 0.5 * f64::from(s) * (1.0 + 1e-5), "{v} -> {c} · {s}");
                }
                Ok(())
            },
        )
        .unwrap();
}

/// Seeded weights `[out, in]` in ±0.3, inputs `[t, in]` in ±4 and, if `bias`, a bias in ±1.
fn random_layer(
    seed: u64,
    (t, n, out): (usize, usize, usize),
    bias: bool,
) -> (Array2<f32>, Array2<f32>, Option<Array1<f32>>) {
    let mut rng = WorkloadRng::new(seed);
    let w = Array2::from_shape_vec((out, n), uniform(&mut rng, out * n, 0.3)).unwrap();
    let x = Array2::from_shape_vec((t, n), uniform(&mut rng, t * n, 4.0)).unwrap();
    let b = bias.then(|| Array1::from(uniform(&mut rng, out, 1.0)));
    (w, x, b)
}

/// The W8A8 (or W8A16) layer against `Σ_i x'[i] · w'[o, i] + b[o]` in f64, where `x'` and `w'`
/// are the dequantized f32 operands; the bound is f32's rounding of the operands, of the scales'
/// product and of the bias addition, relative to `Σ |terms| + |b|`; on every instruction set.
fn check_kernel(activations: Int8Activations, seed_byte: u8) {
    let mut runner = seeded_runner(48, seed_byte);
    runner
        .run(&(shape(), any::<bool>()), |((t, n, out, seed), bias)| {
            let (w, x, b) = random_layer(seed, (t, n, out), bias);
            let layer = || W8A8Linear::quantize(w.view(), b.clone(), activations).unwrap();
            let w_deq = layer().dequantized(); // [out, in]
            for isa in Isa::available() {
                let y = layer().with_isa(isa).forward(x.view());
                for r in 0..t {
                    let row = x.row(r).to_vec();
                    let x_deq: Vec<f32> = match activations {
                        Int8Activations::None => row,
                        Int8Activations::PerToken => {
                            let mut q = vec![0i8; n];
                            let s = quantize_token(&row, &mut q);
                            q.iter().map(|&c| f32::from(c) * s).collect()
                        }
                    };
                    for o in 0..out {
                        let (mut sum, mut mag) = (0.0f64, 0.0f64);
                        for i in 0..n {
                            let term = f64::from(x_deq[i]) * f64::from(w_deq[[o, i]]);
                            sum += term;
                            mag += term.abs();
                        }
                        let bo = b.as_ref().map_or(0.0, |b| f64::from(b[o]));
                        let bound = 8.0 * EPS * (mag + bo.abs()) + 1e-30;
                        let err = (f64::from(y[[r, o]]) - sum - bo).abs();
                        prop_assert!(
                            err <= bound,
                            "{isa:?} [{t}, {n}] -> {out}: y[{r}, {o}] = {} vs {}, error {err:e} > \
                         {bound:e}",
                            y[[r, o]],
                            sum + bo
                        );
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn w8a8_kernel_matches_dequantized_reference() {
    check_kernel(Int8Activations::PerToken, 23);
}

#[test]
fn w8a16_kernel_matches_dequantized_reference() {
    check_kernel(Int8Activations::None, 24);
}

/// W8A8 on the int8 tiles (interleaved rows, a CPU with AVX2) equals the layer of
/// [`Isa::Portable`], one dot product per output and token, bit for bit: the same exact i32
/// sums, the same scaling. Rows and columns past the tiles' groups of 8 and words of 4, outputs
/// past a 32-row task, tokens past a 32-token step.
#[test]
fn w8a8_tiles_equal_dot_products() {
    let mut runner = seeded_runner(48, 25);
    runner
        .run(&(shape(), any::<bool>()), |((t, n, out, seed), bias)| {
            let (w, x, b) = random_layer(seed, (t, n, out), bias);
            let layer = || W8A8Linear::quantize(w.view(), b.clone(), Int8Activations::PerToken);
            let tiled = layer().unwrap().with_isa(Isa::detect());
            let dots = layer().unwrap().with_isa(Isa::Portable);
            prop_assert!(!dots.tiled());
            if !tiled.tiled() {
                eprintln!("skipped: no int8 tiles on this CPU");
                return Ok(());
            }
            let (got, want) = (tiled.forward(x.view()), dots.forward(x.view()));
            for ((r, o), &v) in got.indexed_iter() {
                let w = want[[r, o]];
                prop_assert_eq!(
                    v.to_bits(),
                    w.to_bits(),
                    "[{}, {}] -> {}: y[{}, {}]",
                    t,
                    n,
                    out,
                    r,
                    o
                );
            }
            prop_assert_eq!(tiled.codes(), dots.codes());
            Ok(())
        })
        .unwrap();
}

/// A layer without inputs (in = 0) gives its bias for every token, on the tiles' instruction
/// set and on the portable one.
#[test]
fn a_layer_without_inputs_gives_its_bias() {
    let w = Array2::<f32>::zeros((11, 0));
    let b = Array1::from(vec![0.5f32; 11]);
    let x = Array2::<f32>::zeros((3, 0));
    for isa in Isa::available() {
        let layer = W8A8Linear::quantize(w.view(), Some(b.clone()), Int8Activations::PerToken)
            .unwrap()
            .with_isa(isa);
        let y = layer.forward(x.view());
        assert_eq!(y.dim(), (3, 11));
        assert!(y.iter().all(|&v| v == 0.5), "{isa:?}: {y:?}");
    }
}

#[test]
fn bad_layers_are_errors() {
    let new = |codes: Vec<i8>, out, n, scale: Vec<f32>| {
        W8A8Linear::new(codes, out, n, scale, None, Int8Activations::PerToken).err()
    };
    assert!(matches!(
        new(vec![0; 5], 2, 3, vec![1.0; 2]),
        Some(W8A8Error::Codes { .. })
    ));
    assert!(matches!(
        new(vec![0; 6], 2, 3, vec![1.0; 3]),
        Some(W8A8Error::Scales { .. })
    ));
    assert!(matches!(
        new(vec![0; 6], 2, 3, vec![1.0, 0.0]),
        Some(W8A8Error::BadScale(_))
    ));
    assert!(matches!(
        new(vec![0, 0, -128, 0, 0, 0], 2, 3, vec![1.0; 2]),
        Some(W8A8Error::Code(2))
    ));
    assert!(matches!(
        new(Vec::new(), 0, MAX_IN_FEATURES + 1, Vec::new()),
        Some(W8A8Error::TooWide(_))
    ));
    let w = Array2::from_shape_vec((1, 2), vec![1.0, f32::NAN]).unwrap();
    assert!(W8A8Linear::quantize(w.view(), None, Int8Activations::PerToken).is_err());
}

fn tiny() -> (std::path::PathBuf, LlamaConfig, Vec<Vec<u32>>) {
    let dir = fixtures_dir().join("shakespeare-tiny");
    let config = LlamaConfig::from_dir(&dir).unwrap();
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let text = std::fs::read_to_string(fixtures_dir().join("corpus/sample.txt")).unwrap();
    let tokens = tokenizer.encode(&text, false).unwrap();
    let samples = tokens.chunks(96).take(4).map(<[u32]>::to_vec).collect();
    (dir, config, samples)
}

/// With dense layers, the smoothed checkpoint computes what the original does, layer by layer.
#[test]
fn smoothing_without_quantization_is_an_identity() {
    let (dir, config, samples) = tiny();
    let model = Llama::load_with(&dir, &DenseLoader).unwrap();
    let stats = calibrate(&model, &samples).unwrap();
    let weights = Weights::open(&dir).unwrap();
    let prompt: Vec<u32> = samples[0].iter().rev().take(40).copied().collect();
    for o_proj in [false, true] {
        let cfg = SmoothConfig { alpha: 0.5, o_proj };
        let smoothed = smooth(&weights, &config, &stats, &cfg).unwrap();
        // Not vacuous: the factors move some channel by more than 2x.
        let moved = smoothed
            .factors
            .iter()
            .flat_map(|f| &f.attn)
            .any(|&s| !(0.5..2.0).contains(&s));
        assert!(moved, "every factor within 2x of 1");
        if o_proj {
            assert!(
                smoothed
                    .factors
                    .iter()
                    .flat_map(|f| &f.o)
                    .any(|&s| s != 1.0)
            );
        }
        let other = Llama::from_source(
            config.clone(),
            &smoothed,
            &DenseLoader,
            TensorParallel::whole(),
        )
        .unwrap();
        let (mut a, mut b) = (model.embed(&prompt), other.embed(&prompt));
        for (l, (la, lb)) in model.layers.iter().zip(&other.layers).enumerate() {
            a = la.forward(&a, &model.rope);
            b = lb.forward(&b, &other.rope);
            let rel = relative_l2(b.as_slice().unwrap(), a.as_slice().unwrap());
            assert!(rel < 1e-4, "o_proj {o_proj}: layer {l} differs by {rel:e}");
        }
        let (la, lb) = (
            model.forward(&prompt).unwrap(),
            other.forward(&prompt).unwrap(),
        );
        let rel = relative_l2(lb.as_slice().unwrap(), la.as_slice().unwrap());
        assert!(rel < 1e-4, "o_proj {o_proj}: logits differ by {rel:e}");
    }
}

#[test]
fn smoothing_rejects_bad_settings() {
    let (dir, config, samples) = tiny();
    let model = Llama::load_with(&dir, &DenseLoader).unwrap();
    assert!(calibrate(&model, &[Vec::new()]).is_err());
    let stats = calibrate(&model, &samples[..1]).unwrap();
    let weights = Weights::open(&dir).unwrap();
    let bad = SmoothConfig {
        alpha: 1.5,
        o_proj: true,
    };
    assert!(smooth(&weights, &config, &stats, &bad).is_err());
    assert!(smooth(&weights, &config, &stats[1..], &SmoothConfig::default()).is_err());
}

/// `‖X Wᵀ − layer(X)‖ / ‖X Wᵀ‖` in f64.
fn output_error(x: &Array2<f32>, w: &Array2<f32>, y: &Array2<f32>) -> f64 {
    let exact = x.mapv(f64::from).dot(&w.mapv(f64::from).t());
    let (mut diff, mut norm) = (0.0, 0.0);
    for (e, &a) in exact.iter().zip(y) {
        diff += (f64::from(a) - e).powi(2);
        norm += e * e;
    }
    (diff / norm).sqrt()
}

/// Activations whose few outlier channels are 20–80x the rest: per-token int8 spends its grid
/// on them, and naive W8A8 loses the other channels; smoothing moves the range into the
/// weights' columns and the error drops.
#[test]
fn smoothing_beats_naive_w8a8_on_outlier_channels() {
    let mut runner = seeded_runner(32, 25);
    let strategy = (
        8usize..40,
        40usize..260,
        5usize..70,
        1usize..5,
        20.0f32..80.0,
        any::<u64>(),
    );
    runner
        .run(&strategy, |(t, n, out, outliers, big, seed)| {
            let mut rng = WorkloadRng::new(seed);
            let mut x = Array2::from_shape_vec((t, n), uniform(&mut rng, t * n, 1.0)).unwrap();
            for k in 0..outliers {
                let c = (k * 7919 + seed as usize) % n;
                x.column_mut(c).mapv_inplace(|v| v * big);
            }
            let w = Array2::from_shape_vec((out, n), uniform(&mut rng, out * n, 0.1)).unwrap();
            let naive = W8A8Linear::quantize(w.view(), None, Int8Activations::PerToken).unwrap();
            let naive_err = output_error(&x, &w, &naive.forward(x.view()));

            let mut x_max = ChannelMax::new(n);
            x_max.add(x.view());
            let s = factors(&x_max.0, &column_max(&[&w]), 0.5);
            let x_s = Array2::from_shape_fn((t, n), |(r, i)| x[[r, i]] / s[i]);
            let w_s = Array2::from_shape_fn((out, n), |(o, i)| w[[o, i]] * s[i]);
            let smooth =
                W8A8Linear::quantize(w_s.view(), None, Int8Activations::PerToken).unwrap();
            let smooth_err = output_error(&x, &w, &smooth.forward(x_s.view()));
            prop_assert!(
                smooth_err < naive_err,
                "[{t}, {n}] -> {out}, {outliers} outliers x{big}: smooth {smooth_err:.4} >= naive {naive_err:.4}"
            );
            Ok(())
        })
        .unwrap();
}

/// Weight quantization against its definition, element by element: each weight is within half
/// a step of its row's grid (`max |row| / 127`), rows of tiny and zero values included. (The
/// kernel tests take the layer's own codes, so only this checks how they were made.)
#[test]
fn weight_codes_are_round_to_nearest_on_each_rows_grid() {
    seeded_runner(64, 0x57)
        .run(&(1usize..9, 1usize..70, any::<u64>()), |(out, n, seed)| {
            // Row 0 scaled by 1e-38: a scale too small to invert.
            let w = weights_with_tiny_and_zero_rows(out, n, seed, 1e-38);
            let layer = W8A8Linear::quantize(w.view(), None, Int8Activations::PerToken).unwrap();
            let dequantized = layer.dequantized();
            for (o, (row, got)) in w.rows().into_iter().zip(dequantized.rows()).enumerate() {
                let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let step = f64::from(layer.scales()[o]);
                prop_assert!(step >= f64::from(amax) / 127.0 * (1.0 - 1e-6));
                for (&v, &g) in row.iter().zip(got) {
                    let err = (f64::from(v) - f64::from(g)).abs();
                    prop_assert!(err <= step * (0.5 + 1e-5), "{v:e} → {g:e}, step {step:e}");
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A NaN or infinite activation makes its token's outputs NaN in W8A8, as in f32; the other
/// tokens are untouched. (int8 has no NaN code: the token's scale carries it. The NaN once
/// became code 0 under a finite scale, and the token's outputs came out finite.)
#[test]
fn a_non_finite_activation_gives_nan_outputs_not_finite_ones() {
    let (out, n) = (5, 40);
    let w = Array2::from_shape_fn((out, n), |(o, i)| ((o * n + i) as f32 * 0.61).sin());
    let layer = W8A8Linear::quantize(w.view(), None, Int8Activations::PerToken).unwrap();
    let clean = Array2::from_shape_fn((3, n), |(t, i)| ((t * n + i) as f32 * 0.23).cos());
    let before = layer.forward(clean.view());
    for bad in [f32::NAN, f32::INFINITY] {
        let mut x = clean.clone();
        x[[1, 7]] = bad;
        let y = layer.forward(x.view());
        assert!(y.row(1).iter().all(|v| v.is_nan()), "{bad}: {:?}", y.row(1));
        assert_eq!(y.row(0), before.row(0));
        assert_eq!(y.row(2), before.row(2));
        let mut codes = vec![0i8; n];
        assert!(quantize_token(x.row(1).as_slice().unwrap(), &mut codes).is_nan());
    }
}

/// A NaN in a channel's activations keeps that channel's maximum NaN (and an ∞ keeps it ∞),
/// whatever comes after: `f32::max` alone skips a NaN, and the maximum came out finite. The
/// weights' column maxima and the W8A8 grid do the same, and a factor from a NaN or ∞ maximum
/// is NaN, never a finite (once 1) one.
#[test]
fn a_nan_or_infinity_survives_the_maxima_and_factors() {
    let mut m = ChannelMax::new(3);
    let x =
        Array2::from_shape_vec((2, 3), vec![1.0, f32::NAN, -2.0, 3.0, 0.5, f32::INFINITY]).unwrap();
    m.add(x.view());
    m.add(Array2::from_elem((1, 3), 9.0f32).view());
    assert_eq!(m.0[0], 9.0);
    assert!(m.0[1].is_nan(), "{:?}", m.0);
    assert_eq!(m.0[2], f32::INFINITY);
    assert_eq!(m.first_non_finite().map(|(c, _)| c), Some(1));

    let w = Array2::from_shape_vec((2, 2), vec![f32::NAN, 1.0, 2.0, -3.0]).unwrap();
    let w_max = column_max(&[&w]);
    assert!(w_max[0].is_nan() && w_max[1] == 3.0, "{w_max:?}");

    let s = factors(
        &[4.0, f32::NAN, f32::INFINITY, 4.0, 0.0],
        &[1.0, 1.0, 1.0, f32::NAN, 1.0],
        0.5,
    );
    assert_eq!(s[0], 2.0);
    assert!(s[1..4].iter().all(|s| s.is_nan()), "{s:?}");
    assert_eq!(s[4], 1.0, "a zero maximum leaves its channel alone");

    assert!(grid_scale(&[1.0, f32::NAN, 2.0]).is_nan());
    assert!(grid_scale(&[1.0, f32::NEG_INFINITY]).is_nan());
    assert_eq!(grid_scale(&[1.0, -127.0]), 1.0);
}

/// Smoothing refuses what it cannot choose a factor from, naming it: a NaN or ∞ calibration
/// maximum (a model that produced one on the calibration tokens fails in `calibrate`), and a
/// NaN or ∞ weight in a projection it smooths. (All three once gave a smoothed checkpoint,
/// with the channel's factor silently 1 or chosen without the NaN.)
#[test]
fn nan_or_infinite_statistics_and_weights_are_errors_naming_them() {
    let (dir, config, samples) = tiny();
    let model = Llama::load_with(&dir, &DenseLoader).unwrap();
    let stats = calibrate(&model, &samples[..1]).unwrap();
    let weights = Weights::open(&dir).unwrap();
    let cfg = SmoothConfig::default();
    for bad in [f32::NAN, f32::INFINITY] {
        let mut broken = stats.clone();
        broken[1].mlp_in.0[3] = bad;
        match smooth(&weights, &config, &broken, &cfg) {
            Err(SmoothError::Activation {
                layer: 1,
                input: "mlp_in",
                channel: 3,
                value,
            }) => {
                assert_eq!(value.to_bits(), bad.to_bits());
            }
            Err(e) => panic!("{bad}: {e}"),
            Ok(_) => panic!("{bad}: smoothed"),
        }
    }

    let (inter, hidden) = (config.intermediate_size, config.hidden_size);
    let name = "model.layers.0.mlp.gate_proj.weight";
    for bad in [f32::NAN, f32::NEG_INFINITY] {
        let at = 5 * hidden + 2; // row 5, column 2
        let source = PatchedSource::new(&weights, name, (inter, hidden), at, bad);
        match smooth(&source, &config, &stats, &cfg) {
            Err(e @ SmoothError::Weight { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains(name) && text.contains(&format!("weight {at}")),
                    "{text}"
                );
            }
            Err(e) => panic!("{bad}: {e}"),
            Ok(_) => panic!("{bad}: smoothed"),
        }
        // The model with that weight makes a NaN (or ∞) in down_proj's input channel 5 of
        // layer 0: calibration says so.
        let broken = Llama::from_source(
            config.clone(),
            &source,
            &DenseLoader,
            TensorParallel::whole(),
        )
        .unwrap();
        match calibrate(&broken, &samples[..1]) {
            Err(SmoothError::Activation {
                layer: 0,
                input: "down_in",
                channel: 5,
                value,
            }) => {
                assert!(!value.is_finite(), "{value}");
            }
            Err(e) => panic!("{bad}: {e}"),
            Ok(_) => panic!("{bad}: calibrated"),
        }
    }
}
