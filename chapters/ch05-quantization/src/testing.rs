//! What tests of this and later chapters share: checkpoints written in this chapter's formats,
//! and GGUF vocabularies built by hand.

use std::collections::HashMap;
use std::io;
use std::path::Path;

use ch01::{RawTensor, TensorDtype, WeightSource};
use ndarray::Array2;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::Fp8Linear;
use crate::gguf::{GgufValue, GgufWriter};

/// Writes `src` (a Hugging Face directory) to `dst` as an FP8 checkpoint: every `*_proj.weight`
/// as F8_E4M3 with a per-channel `weight_scale` [out, 1], everything else as it was;
/// `config.json` gains `quantization_config` with `activation_scheme` `scheme` (`"static"`
/// also writes an `input_scale` of 4 / 448 per projection). `src`'s projections must be F32
/// matrices.
pub fn write_fp8_checkpoint(src: &Path, dst: &Path, scheme: &str) -> io::Result<()> {
    let bytes = std::fs::read(src.join("model.safetensors"))?;
    let file = SafeTensors::deserialize(&bytes).map_err(io::Error::other)?;
    let mut out: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = HashMap::new();
    for (name, view) in file.tensors() {
        if name.ends_with("_proj.weight") {
            let shape = view.shape().to_vec();
            if view.dtype() != Dtype::F32 || shape.len() != 2 {
                return Err(io::Error::other(format!("{name} is not an F32 matrix")));
            }
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let w =
                Array2::from_shape_vec((shape[0], shape[1]), values).map_err(io::Error::other)?;
            let (codes, scales) = Fp8Linear::quantize_per_channel(w.view())
                .map_err(|e| io::Error::other(format!("{name}: {e}")))?;
            let prefix = name.trim_end_matches(".weight");
            let codes = codes.iter().map(|c| c.to_bits()).collect();
            out.insert(name.clone(), (Dtype::F8_E4M3, shape.clone(), codes));
            let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
            out.insert(
                format!("{prefix}.weight_scale"),
                (Dtype::F32, vec![shape[0], 1], scale_bytes),
            );
            if scheme == "static" {
                let s = (4.0f32 / 448.0).to_le_bytes().to_vec();
                out.insert(format!("{prefix}.input_scale"), (Dtype::F32, vec![], s));
            }
        } else {
            out.insert(
                name.clone(),
                (view.dtype(), view.shape().to_vec(), view.data().to_vec()),
            );
        }
    }
    let views: Vec<(String, TensorView)> = out
        .iter()
        .map(|(n, (d, s, b))| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()
        .map_err(io::Error::other)?;
    std::fs::create_dir_all(dst)?;
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors"))
        .map_err(io::Error::other)?;
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    config["quantization_config"] =
        serde_json::json!({"quant_method": "fp8", "activation_scheme": scheme});
    std::fs::write(dst.join("config.json"), config.to_string())?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dst.join(f))?;
    }
    Ok(())
}

/// Random weights `[out, in]` (uniform in ±3, seeded) whose first row is scaled by `tiny` and
/// whose second (if any) is all zeros: the rows that test how a quantizer picks its scale.
pub fn weights_with_tiny_and_zero_rows(out: usize, n: usize, seed: u64, tiny: f32) -> Array2<f32> {
    let mut rng = ch02::workload::WorkloadRng::new(seed);
    let mut w = Array2::from_shape_fn((out, n), |_| (rng.uniform_open0() as f32 * 2.0 - 1.0) * 3.0);
    w.row_mut(0).mapv_inplace(|v| v * tiny);
    if out > 1 {
        w.row_mut(1).fill(0.0);
    }
    w
}

/// A writer holding a `llama` (SentencePiece-style) vocabulary: token `i` is `tokens[i]` with
/// score `scores[i]` and type `types[i]`; BOS is id 1 and EOS id 2.
pub fn spm_vocabulary<S: Into<String>>(
    tokens: impl IntoIterator<Item = S>,
    scores: Vec<f32>,
    types: Vec<i32>,
) -> GgufWriter<'static> {
    let mut w = GgufWriter::new();
    let entries = [
        ("tokenizer.ggml.model", GgufValue::from("llama")),
        ("tokenizer.ggml.tokens", GgufValue::strings(tokens)),
        ("tokenizer.ggml.scores", GgufValue::array(scores)),
        ("tokenizer.ggml.token_type", GgufValue::array(types)),
        ("tokenizer.ggml.bos_token_id", GgufValue::from(1u32)),
        ("tokenizer.ggml.eos_token_id", GgufValue::from(2u32)),
    ];
    for (key, value) in entries {
        w.add_metadata(key, value).expect("distinct keys");
    }
    w
}

/// `base` with the F32 matrix `name` [rows, cols] replaced by its values with element `at`
/// (row-major) set to `value`: a broken weight in an otherwise good checkpoint.
pub struct PatchedSource<'a> {
    base: &'a dyn WeightSource,
    name: String,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl<'a> PatchedSource<'a> {
    /// Panics unless `base` holds `name` as a [rows, cols] matrix and `at < rows · cols`.
    pub fn new(
        base: &'a dyn WeightSource,
        name: &str,
        (rows, cols): (usize, usize),
        at: usize,
        value: f32,
    ) -> Self {
        let mut w = base.matrix(name, rows, cols).expect("the matrix to patch");
        w.as_slice_mut().expect("a fresh matrix is contiguous")[at] = value;
        PatchedSource {
            base,
            name: name.to_string(),
            shape: vec![rows, cols],
            bytes: w.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

impl WeightSource for PatchedSource<'_> {
    fn location(&self) -> &Path {
        self.base.location()
    }
    fn contains(&self, name: &str) -> bool {
        self.base.contains(name)
    }
    fn tensor(&self, name: &str) -> ch01::Result<RawTensor<'_>> {
        if name == self.name {
            RawTensor::new(
                name,
                self.location(),
                TensorDtype::F32,
                self.shape.clone(),
                &self.bytes[..],
            )
        } else {
            self.base.tensor(name)
        }
    }
}
