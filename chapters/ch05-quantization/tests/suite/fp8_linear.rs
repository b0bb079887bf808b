//! FP8 weights: [`Fp8Linear`] against the definition computed naively in f64, on random shapes
//! (sizes that are multiples of no lane or task width), per-tensor and per-channel scales,
//! static and dynamic activation scales, in every instruction set; and Hugging Face FP8
//! checkpoints written by this test (`quant_method: "fp8"`, F8_E4M3 weights, `weight_scale`)
//! loaded back through [`Fp8Loader`].

use ch01::linear::Linear;
use ch01::testing::{relative_l2, seeded_runner};
use ch01::{Llama, fixtures_dir};
use ch02::kernels::Isa;
use ch02::workload::WorkloadRng;
use ch05_quantization::fp8::F8E4M3;
use ch05_quantization::fp8_linear::{ActivationScale, Fp8Error, Fp8Linear, Fp8Loader, fp8_config};
use ch05_quantization::testing::{
    PatchedSource, weights_with_tiny_and_zero_rows, write_fp8_checkpoint,
};
use ndarray::{Array1, Array2};
use proptest::prelude::*;

fn uniform(rng: &mut WorkloadRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| (rng.uniform_open0() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// `y = scale[o] · Σ_i q(x)_i · w[o, i] + b[o]` from the definition, in f64; also `Σ |terms|`
/// per output (what f32 rounding is relative to).
fn reference(
    layer: (&[F8E4M3], &[f32], Option<&[f32]>),
    activations: ActivationScale,
    x: &Array2<f32>,
) -> (Array2<f64>, Array2<f64>) {
    let (codes, scale, bias) = layer;
    let (t, n, out) = (x.nrows(), x.ncols(), scale.len());
    let (mut y, mut mag) = (Array2::zeros((t, out)), Array2::zeros((t, out)));
    for r in 0..t {
        let row = x.row(r);
        let s_x = match activations {
            ActivationScale::None => f32::NAN, // unused: x as it is
            ActivationScale::Static(s) => s,
            ActivationScale::Dynamic => {
                let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                if amax > 0.0 { amax / 448.0 } else { 1.0 }
            }
        };
        let q: Vec<f64> = row
            .iter()
            .map(|&v| match activations {
                ActivationScale::None => v as f64,
                _ => F8E4M3::from_f32(v * (1.0 / s_x)).to_f32() as f64 * s_x as f64,
            })
            .collect();
        for o in 0..out {
            let (mut sum, mut abs) = (0.0f64, 0.0f64);
            for i in 0..n {
                let term = q[i] * codes[o * n + i].to_f32() as f64 * scale[o] as f64;
                sum += term;
                abs += term.abs();
            }
            let b = bias.map_or(0.0, |b| b[o] as f64);
            y[[r, o]] = sum + b;
            mag[[r, o]] = abs + b.abs();
        }
    }
    (y, mag)
}

#[test]
fn fp8_linear_equals_its_definition() {
    let case = (
        1usize..=70,                                         // out
        1usize..=300,                                        // in
        prop_oneof![1usize..=4, 24usize..=30, 61usize..=67], // tokens: dot products, then the GEMM
        any::<bool>(),                                       // per channel
        0usize..3,     // activations: dynamic, static, not rounded
        any::<bool>(), // bias
        any::<u64>(),
    );
    seeded_runner(48, 81)
        .run(&case, |(out, n, t, per_channel, scheme, has_bias, seed)| {
            let mut rng = WorkloadRng::new(seed);
            let w = Array2::from_shape_vec((out, n), uniform(&mut rng, out * n, 0.5)).unwrap();
            let (codes, channel) = Fp8Linear::quantize_per_channel(w.view()).unwrap();
            let scale = if per_channel {
                channel
            } else {
                vec![channel[0]]
            };
            let x = Array2::from_shape_vec((t, n), uniform(&mut rng, t * n, 3.0)).unwrap();
            let activations = match scheme {
                0 => ActivationScale::Dynamic,
                1 => ActivationScale::Static(3.0 / 448.0),
                _ => ActivationScale::None,
            };
            let bias = has_bias.then(|| Array1::from_vec(uniform(&mut rng, out, 1.0)));
            let full_scale: Vec<f32> = (0..out).map(|o| scale[o % scale.len()]).collect();
            let (expected, mag) = reference(
                (
                    &codes,
                    &full_scale,
                    bias.as_ref().and_then(|b| b.as_slice()),
                ),
                activations,
                &x,
            );
            for isa in Isa::available() {
                let layer =
                    Fp8Linear::new(codes.clone(), out, n, &scale, bias.clone(), activations)
                        .unwrap()
                        .with_isa(isa);
                prop_assert_eq!(
                    layer.weight_bytes(),
                    out * n + 4 * out + if has_bias { 4 * out } else { 0 }
                );
                let y = layer.forward(x.view());
                for ((got, want), m) in y.iter().zip(&expected).zip(&mag) {
                    // f32 products and sums: a few ulps of the sum of magnitudes.
                    let allowed = 1e-6 * (1.0 + n as f64) * m + 1e-30;
                    prop_assert!(
                        (*got as f64 - want).abs() <= allowed,
                        "{isa:?} [{out}, {n}] × {t}: {got} vs {want}"
                    );
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A checkpoint's NaN codes (0x7F or 0xFF, which the quantizer never writes) make their rows'
/// outputs NaN and leave the other rows as they were, one token or several, in every
/// instruction set: decode's fast loop, which would read them as ±480, is not taken.
#[test]
fn a_nan_code_gives_its_row_nan_and_no_other() {
    let (out, n) = (4, 41);
    let mut codes: Vec<F8E4M3> = (0..out * n)
        .map(|i| F8E4M3::from_bits((i % 50) as u8))
        .collect();
    codes[n + 17] = F8E4M3::from_bits(0xFF);
    codes[3 * n + 38] = F8E4M3::from_bits(0x7F);
    for isa in Isa::available() {
        let layer = Fp8Linear::new(codes.clone(), out, n, &[0.5], None, ActivationScale::None)
            .unwrap()
            .with_isa(isa);
        for t in [1, 3] {
            let y = layer.forward(Array2::from_elem((t, n), 1.0f32).view());
            for ((_, o), v) in y.indexed_iter() {
                let nan_row = o == 1 || o == 3;
                assert_eq!(
                    v.is_nan(),
                    nan_row,
                    "{isa:?}, {t} tokens: output {o} is {v}"
                );
            }
        }
    }
}

#[test]
fn bad_layers_are_errors() {
    let codes = vec![F8E4M3::default(); 6];
    let dynamic = ActivationScale::Dynamic;
    assert!(Fp8Linear::new(codes.clone(), 2, 4, &[1.0], None, dynamic).is_err());
    assert!(Fp8Linear::new(codes.clone(), 2, 3, &[1.0, 1.0, 1.0], None, dynamic).is_err());
    assert!(Fp8Linear::new(codes.clone(), 2, 3, &[0.0], None, dynamic).is_err());
    assert!(
        Fp8Linear::new(
            codes.clone(),
            2,
            3,
            &[1.0],
            None,
            ActivationScale::Static(f32::NAN)
        )
        .is_err()
    );
    assert!(Fp8Linear::new(codes.clone(), 2, 3, &[1.0], Some(Array1::zeros(3)), dynamic).is_err());
    assert!(Fp8Linear::new(codes, 2, 3, &[1.0, 2.0], None, dynamic).is_ok());
}

/// A static input scale is inverted for every row: a subnormal one (positive and finite, but
/// with an inverse that is infinite, or nearly: 1e-39's overflows) is refused as a bad scale, and the smallest normal one is kept and
/// gives finite outputs. Weight scales are only multiplied: a subnormal one stays allowed.
#[test]
fn a_subnormal_input_scale_is_refused() {
    let codes = vec![F8E4M3::from_f32(1.0); 6];
    for subnormal in [1e-39f32, f32::from_bits(1), f32::MIN_POSITIVE / 2.0] {
        assert!(subnormal > 0.0 && subnormal < f32::MIN_POSITIVE);
        let layer = Fp8Linear::new(
            codes.clone(),
            2,
            3,
            &[1.0],
            None,
            ActivationScale::Static(subnormal),
        );
        assert!(
            matches!(layer, Err(Fp8Error::BadInputScale(s)) if s == subnormal),
            "input scale {subnormal:e}: {:?}",
            layer.err()
        );
    }
    let normal = Fp8Linear::new(
        codes.clone(),
        2,
        3,
        &[1.0],
        None,
        ActivationScale::Static(f32::MIN_POSITIVE),
    )
    .unwrap();
    let y = normal.forward(Array2::from_elem((1, 3), 1e-38f32).view());
    assert!(y.iter().all(|v| v.is_finite()), "{y:?}");
    let tiny_weights = Fp8Linear::new(
        codes.clone(),
        2,
        3,
        &[1e-39],
        None,
        ActivationScale::Dynamic,
    );
    assert!(tiny_weights.is_ok());
    // A bad weight scale is named as one, whatever the activations' scheme.
    for bad in [f32::NAN, 0.0, -1.0, f32::INFINITY] {
        let layer = Fp8Linear::new(codes.clone(), 2, 3, &[bad], None, ActivationScale::Dynamic);
        let err = layer.err().expect("a bad weight scale");
        assert!(matches!(err, Fp8Error::BadWeightScale(_)), "{err:?}");
        assert!(err.to_string().starts_with("weight scale"), "{err}");
    }
}

#[test]
fn an_fp8_checkpoint_loads_and_stays_close_to_its_f32_model() {
    let src = fixtures_dir().join("shakespeare-tiny");
    let reference = ch02::load_fast(&src, ch02::WeightDtype::F32).unwrap();
    let tokens: Vec<u32> = vec![0, 412, 306, 13, 534, 325, 291, 306, 13, 330, 17];
    let expected = reference.forward(&tokens).unwrap();
    for scheme in ["dynamic", "static"] {
        let dir = tempfile::tempdir().unwrap();
        write_fp8_checkpoint(&src, dir.path(), scheme).unwrap();
        let config = fp8_config(dir.path()).unwrap().expect("an FP8 checkpoint");
        assert_eq!(config.static_activations, scheme == "static");
        let loader = Fp8Loader {
            static_activations: config.static_activations,
        };
        let model = Llama::load_with(dir.path(), &loader).unwrap();
        // Every projection holds one byte per weight and a scale per output channel.
        let c = &model.config;
        let (h, i, kv) = (
            c.hidden_size,
            c.intermediate_size,
            c.num_key_value_heads * c.head_dim,
        );
        let per_layer = |p: usize, q: usize| p * q + 4 * p;
        let layer =
            per_layer(h, h) * 2 + per_layer(kv, h) * 2 + per_layer(i, h) * 2 + per_layer(h, i);
        // The head (tied to the embedding, which FP8 checkpoints keep dense) stays f32.
        let head = 4 * c.vocab_size * h;
        assert_eq!(
            model.projection_bytes(),
            c.num_hidden_layers * layer + head,
            "{scheme}"
        );
        // Not equal: weights rounded to 3 mantissa bits (2⁻⁴ relative at most) and activations
        // too. Measured, relative L2 of the logits: 9.0e-3 with dynamic (per-token) activation
        // scales, 6.0e-2 with the static input_scale this test writes (4 / 448, which clips the
        // activations beyond ±4: what a badly calibrated scale costs). Asserted with about 3×
        // headroom.
        let logits = model.forward(&tokens).unwrap();
        let rel = relative_l2(logits.as_slice().unwrap(), expected.as_slice().unwrap());
        let allowed = if scheme == "static" { 0.15 } else { 0.03 };
        assert!(
            rel < allowed && rel > 0.0,
            "{scheme}: relative L2 {rel:.3e}"
        );
    }
}

#[test]
fn unsupported_fp8_checkpoints_are_errors() {
    let src = fixtures_dir().join("shakespeare-tiny");
    let dir = tempfile::tempdir().unwrap();
    write_fp8_checkpoint(&src, dir.path(), "dynamic").unwrap();
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["quantization_config"]["weight_block_size"] = serde_json::json!([128, 128]);
    std::fs::write(&path, config.to_string()).unwrap();
    let error = fp8_config(dir.path()).unwrap_err().to_string();
    assert!(error.contains("weight_block_size"), "{error}");
    // A static scheme without input scales names the missing tensor.
    let loader = Fp8Loader {
        static_activations: true,
    };
    let error = Llama::load_with(dir.path(), &loader)
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("input_scale"), "{error}");
    assert_eq!(fp8_config(&src).unwrap(), None);
}

/// Weight quantization to E4M3 against its bound, element by element, rows of tiny and zero
/// values included: every scale is finite and positive, so the layer always builds.
#[test]
fn per_channel_codes_keep_the_e4m3_bound() {
    use ch05_quantization::kv_cache::e4m3_error_bound;
    seeded_runner(64, 0xF8)
        .run(&(1usize..9, 1usize..70, any::<u64>()), |(out, n, seed)| {
            // Row 0 scaled by 1e-44: amax / 448 would round to 0.
            let w = weights_with_tiny_and_zero_rows(out, n, seed, 1e-44);
            let (codes, scales) = Fp8Linear::quantize_per_channel(w.view()).unwrap();
            for (o, row) in w.rows().into_iter().enumerate() {
                let scale = scales[o];
                prop_assert!(scale.is_finite() && scale > 0.0, "row {o}: scale {scale:e}");
                let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (i, &v) in row.iter().enumerate() {
                    let got = codes[o * n + i].to_f32() * scale;
                    let bound = e4m3_error_bound(v, amax);
                    prop_assert!(
                        (v - got).abs() <= bound,
                        "{v:e} → {got:e} (bound {bound:e})"
                    );
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A NaN or infinite weight is refused by the per-channel quantizer, and by the on-load
/// quantizer naming the tensor. (An ∞ once made its row's scale ∞ and every other weight of the
/// row 0; a NaN was skipped by the row's maximum.)
#[test]
fn a_non_finite_weight_is_refused_not_quantized() {
    use ch01::WeightSource;
    use ch01::linear::{LinearLoader, LinearSpec};
    use ch05_quantization::fp8_linear::Fp8Quantizer;
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut w = Array2::from_shape_fn((3, 5), |(o, i)| (o * 5 + i) as f32 / 7.0 - 1.0);
        w[[1, 2]] = bad;
        match Fp8Linear::quantize_per_channel(w.view()) {
            Err(Fp8Error::NotFinite { index: 7, value }) => {
                assert_eq!(value.to_bits(), bad.to_bits())
            }
            other => panic!("{bad}: {:?}", other.map(|(_, s)| s)),
        }
    }
    let dir = fixtures_dir().join("shakespeare-tiny");
    let weights = ch01::Weights::open(&dir).unwrap();
    let config = ch01::LlamaConfig::from_dir(&dir).unwrap();
    let (h, i) = (config.hidden_size, config.intermediate_size);
    let spec = LinearSpec::whole("model.layers.0.mlp.up_proj", h, i, false);
    let quantizer = Fp8Quantizer {
        activations: ActivationScale::Dynamic,
    };
    quantizer.load(&weights, &spec).unwrap();
    let name = "model.layers.0.mlp.up_proj.weight";
    let broken = PatchedSource::new(&weights, name, (i, h), h + 3, f32::NAN); // row 1, column 3
    let err = quantizer.load(&broken, &spec).err().unwrap().to_string();
    assert!(err.contains(name) && err.contains("NaN"), "{err}");
    let mut w = WeightSource::matrix(&weights, name, i, h).unwrap();
    w[[0, 0]] = f32::NAN;
    let err = quantizer.build(w, None).err().unwrap().to_string();
    assert!(err.contains("NaN"), "{err}");
}
