//! [`quantize_model`] on models with biases (Qwen2's q/k/v; a Llama with `attention_bias` and
//! `mlp_bias`): the model it calibrates on, and leaves behind, is the model the quantized
//! checkpoint holds, biases included; AWQ's `down_proj` scales reach `up_proj`'s bias, in the
//! model and in the written directory; a group size AWQ's layout cannot read back is refused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ch01::testing::relative_l2;
use ch01::{Llama, LlamaConfig, RawTensor, TensorDtype, TensorParallel, WeightSource, Weights};
use ch02::{FastLoader, WeightDtype};
use ch05_quantization::gptq::GptqConfig;
use ch05_quantization::hf_quant::{
    HfQuantConfig, HfQuantLoader, QuantMethod, WriteError, check_model, write_quantized_dir,
};
use ch05_quantization::model_quant::{Method, QuantizedModel, quantize_model};
use ch05_quantization::{GroupQuantized, QuantLoader};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

const F32: FastLoader = FastLoader {
    dtype: WeightDtype::F32,
};

fn fixture(name: &str) -> PathBuf {
    ch01::fixtures_dir().join(name)
}

/// Deterministic values in `[-amplitude, amplitude)`.
fn values(n: usize, seed: u64, amplitude: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amplitude
        })
        .collect()
}

/// `random/gqa` (a Llama) with `attention_bias` and `mlp_bias`, and a bias on each of the seven
/// projections: `up_proj`'s of magnitude up to `up_bias` (larger than its outputs, so that
/// where it goes shows in the logits), the others up to 0.1.
fn llama_with_biases(dir: &Path, up_bias: f32) {
    std::fs::create_dir_all(dir).unwrap();
    let src = fixture("random/gqa");
    for name in [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(name), dir.join(name)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["attention_bias"] = true.into();
    config["mlp_bias"] = true.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let c = LlamaConfig::from_dir(dir).unwrap();

    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    for l in 0..c.num_hidden_layers {
        for (k, (name, out, _)) in ch05_quantization::model_quant::projections(&c, l)
            .into_iter()
            .enumerate()
        {
            let amplitude = if name.ends_with("up_proj") {
                up_bias
            } else {
                0.1
            };
            let b = values(out, (l * 7 + k) as u64 + 1, amplitude);
            let b: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((format!("{name}.bias"), Dtype::F32, vec![out], b));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// `base` with some tensors replaced by f32 values.
struct Overlay<'a> {
    base: &'a Weights,
    replaced: HashMap<String, (Vec<usize>, Vec<u8>)>,
}

impl<'a> Overlay<'a> {
    /// `base` with each quantized projection's weight replaced by its dequantized values and
    /// each of `dense` by its new values: the model a reader of the written file computes.
    fn quantized(base: &'a Weights, q: &QuantizedModel) -> Self {
        let mut replaced = HashMap::new();
        let bytes = |v: &[f32]| v.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        for (name, layer) in &q.layers {
            let shape = vec![layer.rows(), layer.cols()];
            replaced.insert(
                format!("{name}.weight"),
                (shape, bytes(&layer.dequantize())),
            );
        }
        for (name, values) in &q.dense {
            replaced.insert(name.clone(), (vec![values.len()], bytes(values)));
        }
        Overlay { base, replaced }
    }
}

impl WeightSource for Overlay<'_> {
    fn location(&self) -> &Path {
        self.base.location()
    }
    fn contains(&self, name: &str) -> bool {
        self.replaced.contains_key(name) || self.base.contains(name)
    }
    fn tensor(&self, name: &str) -> ch01::Result<RawTensor<'_>> {
        match self.replaced.get(name) {
            Some((shape, bytes)) => RawTensor::new(
                name,
                self.base.location(),
                TensorDtype::F32,
                shape.clone(),
                &bytes[..],
            ),
            None => self.base.tensor(name),
        }
    }
}

fn samples(vocab: usize) -> Vec<Vec<u32>> {
    (0..3u64)
        .map(|s| {
            values(24, 100 + s, 1.0)
                .iter()
                .map(|v| ((v.abs() * vocab as f32) as u32).min(vocab as u32 - 1))
                .collect()
        })
        .collect()
}

fn gptq() -> Method {
    Method::Gptq(GptqConfig {
        group_size: 32,
        ..GptqConfig::default()
    })
}

fn awq() -> Method {
    Method::Awq {
        group_size: 32,
        tokens: 64,
    }
}

/// Quantizes the model in `dir` with `method`; returns the model `quantize_model` leaves (the
/// one it calibrated every later layer on) and what it produced.
fn quantize(dir: &Path, method: &Method) -> (Llama, QuantizedModel) {
    let weights = Weights::open(dir).unwrap();
    let mut model = Llama::load_with(dir, &F32).unwrap();
    let samples = samples(model.config.vocab_size);
    let q = quantize_model(&mut model, &weights, &samples, method, &mut |_| {}).unwrap();
    (model, q)
}

/// The tokens the logits are compared on (not a calibration sample).
const TOKENS: [u32; 12] = [5, 17, 400, 3000, 12, 99, 1024, 7, 2222, 64, 31, 808];

/// The model `quantize_model` calibrated on and left behind computes what the quantized
/// checkpoint computes: its dequantized weights with every bias of the checkpoint. (It once
/// rebuilt each projection without its bias, so every layer after the first was calibrated,
/// by GPTQ's Hessians and AWQ's magnitudes, on the inputs of a model that is not the model.)
#[test]
fn calibration_keeps_every_projections_bias() {
    let tmp = tempfile::tempdir().unwrap();
    let llama = tmp.path().join("llama-bias");
    llama_with_biases(&llama, 0.1);
    for dir in [fixture("random/qwen2"), llama] {
        let config = LlamaConfig::from_dir(&dir).unwrap();
        assert!(config.qkv_bias, "{}: a model with biases", dir.display());
        for (label, method) in [("gptq", gptq()), ("awq", awq())] {
            let (model, q) = quantize(&dir, &method);
            let weights = Weights::open(&dir).unwrap();
            let overlay = Overlay::quantized(&weights, &q);
            let reference =
                Llama::from_source(config.clone(), &overlay, &F32, TensorParallel::whole())
                    .unwrap();
            let got = model.forward(&TOKENS).unwrap();
            let want = reference.forward(&TOKENS).unwrap();
            let err = relative_l2(got.as_slice().unwrap(), want.as_slice().unwrap());
            assert!(
                err < 1e-5,
                "{} {label}: the calibrated model differs from the quantized checkpoint's by {err:e} (relative L2)",
                dir.display()
            );
        }
    }
}

/// AWQ folds `1 / s` of `down_proj`'s scales into `up_proj`'s output: its rows *and its bias*
/// (`silu(g) · (u + b)` becomes `silu(g) · (u / s + b / s)`). With an `up_proj` bias larger than
/// its outputs, the written directory (loaded back as kiln loads it) stays as close to the f32
/// model as round-to-nearest's own error allows; it once kept the bias undivided, computing
/// `silu(g) · (u + s · b)`.
#[test]
fn awq_divides_up_projs_bias_by_down_projs_scales() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("llama-bias");
    llama_with_biases(&dir, 8.0);
    let original = Llama::load_with(&dir, &F32).unwrap();
    let (model, q) = quantize(&dir, &awq());
    let down: Vec<_> = q.awq.iter().filter(|a| a.0.ends_with("mlp.down")).collect();
    assert!(
        down.iter().any(|a| a.1 > 0.0),
        "the test needs down_proj scales other than 1: {down:?}"
    );
    let config = HfQuantConfig {
        method: QuantMethod::Awq,
        group_size: Some(32),
        desc_act: false,
        sym: false,
        damp_percent: 0.01,
    };
    let out = tmp.path().join("awq");
    write_quantized_dir(&dir, &out, &config, &q.layers, &q.dense).unwrap();
    let loader = HfQuantLoader {
        config,
        dense: QuantLoader::native(),
    };
    let written = Llama::load_with(&out, &loader).unwrap();

    let want = original.forward(&TOKENS).unwrap();
    let want = want.as_slice().unwrap();
    let err = |m: &Llama| relative_l2(m.forward(&TOKENS).unwrap().as_slice().unwrap(), want);
    // The same model quantized by plain round-to-nearest: the error AWQ must stay near.
    let (_, rtn) = quantize(
        &dir,
        &Method::Rtn {
            group_size: 32,
            symmetric: false,
        },
    );
    let weights = Weights::open(&dir).unwrap();
    let rtn_model = Llama::from_source(
        original.config.clone(),
        &Overlay::quantized(&weights, &rtn),
        &F32,
        TensorParallel::whole(),
    )
    .unwrap();
    let (err_rtn, err_model, err_written) = (err(&rtn_model), err(&model), err(&written));
    assert!(
        err_model < 1.3 * err_rtn && err_written < 1.3 * err_rtn,
        "relative L2 error against the f32 model: AWQ's calibrated model {err_model:e}, its \
         written directory {err_written:e}, round-to-nearest {err_rtn:e}"
    );
    for l in 0..original.config.num_hidden_layers {
        let name = format!("model.layers.{l}.mlp.up_proj.bias");
        assert!(q.dense.contains_key(&name), "{name} is replaced");
    }
}

/// A group size that does not divide every projection's input size cannot be read back from
/// AWQ's layout (the reader checks the configured size): the model is refused before any
/// calibration, and the writer refuses a layer quantized with it (a layer narrower than the
/// group is quantized with whole rows, which once passed the writer's check, written under a
/// config.json no loader reads).
#[test]
fn awq_group_sizes_that_do_not_divide_the_inputs_are_refused() {
    let dir = fixture("random/gqa"); // hidden 64, intermediate 96
    let model = LlamaConfig::from_dir(&dir).unwrap();
    let config = |g: usize| HfQuantConfig {
        method: QuantMethod::Awq,
        group_size: Some(g),
        desc_act: false,
        sym: false,
        damp_percent: 0.01,
    };
    assert!(check_model(&config(32), &model).is_ok());
    for g in [128, 48, 96] {
        let e = check_model(&config(g), &model).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("group size {g} must divide in_features (64)")),
            "{e}"
        );
    }
    // The writer: a [64, 64] layer quantized "with groups of 128" holds whole rows.
    let weights = Weights::open(&dir).unwrap();
    let mut layers = std::collections::BTreeMap::new();
    for (name, out, cols) in ch05_quantization::model_quant::projections(&model, 0) {
        let w = weights
            .matrix(&format!("{name}.weight"), out, cols)
            .unwrap();
        let w = w.as_standard_layout();
        let q: GroupQuantized = ch05_quantization::group_quant::round_to_nearest(
            w.as_slice().unwrap(),
            out,
            cols,
            128,
            false,
        )
        .unwrap();
        layers.insert(name, q);
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("awq");
    let e = write_quantized_dir(&dir, &out, &config(128), &layers, &Default::default());
    assert!(
        matches!(&e, Err(WriteError::Layer { source, .. })
            // Whichever layer the writer reaches first: in_features 64 or 96.
            if source.to_string().contains("group size 128 must divide in_features (")),
        "{e:?}"
    );
    assert!(!out.exists(), "nothing is written");
}

/// A NaN or infinite calibration input (a model with an infinite weight upstream) is refused
/// by AWQ's search, where every exponent's error would be NaN and the search would pick one
/// anyway, as GPTQ refuses the Hessian such inputs make.
#[test]
fn awq_search_refuses_inputs_that_are_not_finite() {
    use ch05_quantization::GroupQuantError;
    use ch05_quantization::awq;
    let w = ndarray::Array2::from_shape_fn((4, 32), |(o, i)| (o * 32 + i) as f32 / 64.0 - 1.0);
    let mean = ndarray::Array1::from_elem(32, 1.0);
    for bad in [f32::NAN, f32::INFINITY] {
        let mut x = ndarray::Array2::from_elem((3, 32), 0.5f32);
        x[[1, 7]] = bad;
        let err = awq::search(&[&w], x.view(), &mean, 32).unwrap_err();
        assert!(
            matches!(
                err,
                GroupQuantError::NotFinite {
                    what: "calibration input",
                    index: 39,
                    ..
                }
            ),
            "{err:?}"
        );
    }
    let x = ndarray::Array2::from_elem((3, 32), 0.5f32);
    assert!(awq::search(&[&w], x.view(), &mean, 32).is_ok());
}
