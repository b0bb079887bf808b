//! [`write_quantized_dir`]: a Hugging Face model directory with its projections replaced by
//! GPTQ or AWQ tensors, as vLLM and transformers load it: `config.json` with the
//! `quantization_config`, one `model.safetensors`, and the tokenizer files copied.
//!
//! Every tensor of the source that is neither a quantized projection (`{name}.weight` with
//! `name` in `layers`: written as `{name}.qweight`, `.qzeros`, `.scales` and, for GPTQ,
//! `.g_idx`) nor replaced (`dense`: AWQ's norms with the scales folded in, and `up_proj`'s
//! bias divided by `down_proj`'s scales, as f32) is copied with its dtype and bytes. The file is
//! written under a temporary name, then renamed.
//!
//! Every layer is checked against the layout as [`HfQuantLoader`](super::HfQuantLoader) will
//! read it, with the group size config.json records ([`check_layer`]); [`check_model`] does
//! the same from a model's config alone, before any calibration.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

use super::gptq_format::Packed;
use super::{HfQuantConfig, HfQuantError, QuantMethod, awq_format, gptq_format};
use crate::group_quant::GroupQuantized;

/// Why a directory could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: String, message: String },
    #[error("`{name}`: {source}")]
    Layer { name: String, source: HfQuantError },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> WriteError + '_ {
    move |source| WriteError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn format_error(path: &Path, message: impl ToString) -> WriteError {
    WriteError::Format {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

/// Whether the loader will read back a layer `[rows = out, cols = in]` written with `config`:
/// in and out multiples of 8 for GPTQ's layout; for AWQ's, out a multiple of 8 and the
/// **configured** group size (the whole row when there is none) dividing `in`.
pub fn check_layer(config: &HfQuantConfig, rows: usize, cols: usize) -> Result<(), HfQuantError> {
    match config.method {
        QuantMethod::Awq => awq_format::check(rows, cols, config.group_size.unwrap_or(cols)),
        QuantMethod::Gptq if !(rows.is_multiple_of(8) && cols.is_multiple_of(8)) => {
            Err(HfQuantError::Layout {
                format: "GPTQ",
                rows,
                cols,
                reason: "in and out must be multiples of 8".into(),
            })
        }
        QuantMethod::Gptq => Ok(()),
    }
}

/// [`check_layer`] for every projection of a model with config `model`: what `kiln quantize`
/// asks before calibrating (`--method awq --group-size 768` on a hidden size of 576 is refused
/// here, not after an hour of calibration, nor written as a directory no loader reads).
pub fn check_model(config: &HfQuantConfig, model: &ch01::LlamaConfig) -> Result<(), WriteError> {
    for l in 0..model.num_hidden_layers {
        for (name, rows, cols) in crate::model_quant::projections(model, l) {
            check_layer(config, rows, cols).map_err(|source| WriteError::Layer { name, source })?;
        }
    }
    Ok(())
}

fn le_bytes<T: Copy>(values: &[T], f: fn(T) -> [u8; 4]) -> Vec<u8> {
    values.iter().flat_map(|&v| f(v)).collect()
}

/// Writes the directory `out`, which must be new or empty, from the model directory `src`, all
/// at once (`ch01::new_dir`): a failure (a full disk, a layer the format cannot hold) leaves
/// nothing behind.
pub fn write_quantized_dir(
    src: &Path,
    out: &Path,
    config: &HfQuantConfig,
    layers: &BTreeMap<String, GroupQuantized>,
    dense: &BTreeMap<String, Vec<f32>>,
) -> Result<(), WriteError> {
    ch01::new_dir::write_new_dir(
        out,
        |staging| write_into(src, staging, config, layers, dense),
        |path, source| WriteError::Io {
            path: path.display().to_string(),
            source,
        },
    )
}

/// [`write_quantized_dir`]'s files, into the directory `out`.
fn write_into(
    src: &Path,
    out: &Path,
    config: &HfQuantConfig,
    layers: &BTreeMap<String, GroupQuantized>,
    dense: &BTreeMap<String, Vec<f32>>,
) -> Result<(), WriteError> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    // Tensors: (name, dtype, shape, bytes).
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(src)
        .map_err(io(src))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    files.sort();
    let mut seen = 0usize;
    for path in files
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
    {
        let bytes = std::fs::read(path).map_err(io(path))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| format_error(path, e))?;
        for (name, view) in st.tensors() {
            let layer = name
                .strip_suffix(".weight")
                .filter(|n| layers.contains_key(*n));
            if let Some(layer) = layer {
                seen += 1;
                let q = &layers[layer];
                let packed = check_layer(config, q.rows(), q.cols())
                    .and_then(|()| match config.method {
                        QuantMethod::Gptq => gptq_format::pack(q),
                        QuantMethod::Awq => awq_format::pack(q),
                    })
                    .map_err(|source| WriteError::Layer {
                        name: layer.into(),
                        source,
                    })?;
                push_packed(&mut tensors, layer, packed);
            } else if let Some(values) = dense.get(&name) {
                let bytes = le_bytes(values, f32::to_le_bytes);
                tensors.push((name, Dtype::F32, view.shape().to_vec(), bytes));
            } else {
                tensors.push((
                    name,
                    view.dtype(),
                    view.shape().to_vec(),
                    view.data().to_vec(),
                ));
            }
        }
    }
    if seen != layers.len() {
        return Err(format_error(
            src,
            format!(
                "{} quantized layers, but {seen} of their weights in the source",
                layers.len()
            ),
        ));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes).map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format_error(out, e))?;
    let model = out.join("model.safetensors");
    let metadata = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(views, Some(metadata), &model)
        .map_err(|e| format_error(&model, e))?;

    // config.json with the quantization_config.
    let config_path = src.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(io(&config_path))?;
    let mut json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format_error(&config_path, e))?;
    let object = json
        .as_object_mut()
        .ok_or_else(|| format_error(&config_path, "not a JSON object"))?;
    object.insert("quantization_config".into(), config.to_json());
    let text = serde_json::to_string_pretty(&json).expect("a Value serialises");
    std::fs::write(out.join("config.json"), text + "\n").map_err(io(out))?;

    // Everything else a loader reads (tokenizer, chat template, generation config).
    for path in &files {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let copied =
            name.ends_with(".json") && name != "config.json" && !name.ends_with(".index.json");
        if copied || name.ends_with(".jinja") || name.ends_with(".txt") {
            std::fs::copy(path, out.join(name)).map_err(io(path))?;
        }
    }
    Ok(())
}

fn push_packed(tensors: &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>, layer: &str, p: Packed) {
    let (qw, qw_shape) = p.qweight;
    let (qz, qz_shape) = p.qzeros;
    let (sc, sc_shape) = p.scales;
    tensors.push((
        format!("{layer}.qweight"),
        Dtype::I32,
        qw_shape.to_vec(),
        le_bytes(&qw, i32::to_le_bytes),
    ));
    tensors.push((
        format!("{layer}.qzeros"),
        Dtype::I32,
        qz_shape.to_vec(),
        le_bytes(&qz, i32::to_le_bytes),
    ));
    let scales: Vec<u8> = sc.iter().flat_map(|s| s.to_le_bytes()).collect();
    tensors.push((
        format!("{layer}.scales"),
        Dtype::F16,
        sc_shape.to_vec(),
        scales,
    ));
    if let Some(g) = p.g_idx {
        let n = g.len();
        tensors.push((
            format!("{layer}.g_idx"),
            Dtype::I32,
            vec![n],
            le_bytes(&g, i32::to_le_bytes),
        ));
    }
}
