//! [`quantize_model`]: every projection of a Llama quantized to 4-bit groups, layer after layer,
//! each layer calibrated on the outputs of the layers before it *as quantized*.
//!
//! ```text
//! x_0 = embed(calibration tokens)                                   [T, hidden] per sample
//! for each layer l:
//!     a = norm1(x)              → q, k, v quantized   (their Hessian / AWQ magnitudes from a)
//!     o_in = attention(q(a), k(a), v(a))  with the quantized q, k, v
//!                               → o quantized
//!     h = x + o(o_in);  m = norm2(h)
//!                               → gate, up quantized
//!     d_in = silu(gate(m)) · up(m)        with the quantized gate, up
//!                               → down quantized
//!     x = h + down(d_in)                  the next layer's input
//! ```
//!
//! GPTQ follows the diagram exactly (the order within a layer is GPTQ's `true_sequential`).
//! AWQ searches the scales of q/k/v and of gate/up on the inputs of the unscaled layer (the
//! scales of gate/up and of down both touch `up_proj`, so the three are quantized together),
//! then runs the scaled, quantized layer to feed the next one; `o_proj` is not scaled (its
//! input comes from `v_proj` through the attention, which with grouped KV heads is shared by
//! several heads: no single row of `v_proj` can absorb a scale), as AWQ's reference skips it
//! for such models. Round-to-nearest needs no calibration.
//!
//! The model runs in f32 with chapter 2's dense projections; a quantized projection is
//! replaced by its dequantized weights, the exact weights any reader of the file computes with,
//! and keeps its bias (Qwen2's q/k/v, Llama's `attention_bias` / `mlp_bias`): every later
//! projection is calibrated on the model the file holds. AWQ's `1 / s` for `down_proj` divides
//! `up_proj`'s bias as well as its rows (`silu(g) · (u / s + b / s)`); the divided bias is one
//! of the dense tensors the file replaces.

use std::collections::BTreeMap;

use ch01::attention::causal_attention;
use ch01::model::{RmsNorm, silu};
use ch01::{Linear, Llama, WeightSource};
use ch02::{FastLinear, WeightDtype};
use ndarray::{Array1, Array2};

use crate::awq::{self, ChannelMagnitude};
use crate::gptq::{GptqConfig, GptqError, Hessian, gptq};
use crate::group_quant::{GroupQuantError, GroupQuantized, round_to_nearest};

/// How to quantize.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Method {
    /// Round-to-nearest, group-wise.
    Rtn {
        group_size: usize,
        symmetric: bool,
    },
    Gptq(GptqConfig),
    /// AWQ's scale search, then round-to-nearest with zero points; `tokens` bounds the tokens
    /// the search evaluates its error on.
    Awq {
        group_size: usize,
        tokens: usize,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum ModelQuantError {
    #[error(transparent)]
    Model(#[from] ch01::Error),
    #[error("`{name}`: {source}")]
    Gptq { name: String, source: GptqError },
    #[error("`{name}`: {source}")]
    Codes {
        name: String,
        source: GroupQuantError,
    },
    #[error("calibration needs at least one sample of at least one token")]
    NoCalibration,
}

/// What [`quantize_model`] produced: the codes of every projection, by layer name
/// (`model.layers.0.self_attn.q_proj`), and the dense tensors it changed by tensor name (AWQ's
/// norms, and `up_proj`'s bias when the model has one).
#[derive(Debug, Default)]
pub struct QuantizedModel {
    pub layers: BTreeMap<String, GroupQuantized>,
    pub dense: BTreeMap<String, Vec<f32>>,
    /// AWQ: `(group, α, error, round-to-nearest's error)` per searched group.
    pub awq: Vec<(String, f64, f64, f64)>,
}

const ATTN: [&str; 3] = ["q_proj", "k_proj", "v_proj"];
const MLP_IN: [&str; 2] = ["gate_proj", "up_proj"];

/// A dense f32 projection with weights `w` `[out, in]` and the projection's own bias `[out]`.
fn dense(w: &Array2<f32>, bias: &Option<Array1<f32>>) -> Box<dyn Linear> {
    // On the heap: calibration replaces these while the model lives, and weight memory would
    // keep the space of every replaced one until the model goes.
    Box::new(FastLinear::on_heap(
        w.clone(),
        bias.clone(),
        WeightDtype::F32,
    ))
}

/// Whether the projection `short` of a model with config `c` has a bias.
fn has_bias(c: &ch01::LlamaConfig, short: &str) -> bool {
    match short {
        "q_proj" | "k_proj" | "v_proj" => c.qkv_bias,
        "o_proj" => c.o_bias,
        _ => c.mlp_bias,
    }
}

fn dequantized(q: &GroupQuantized) -> Array2<f32> {
    Array2::from_shape_vec((q.rows(), q.cols()), q.dequantize()).expect("[out, in]")
}

// ANCHOR: quantize_model
/// Quantizes the projections of `model` (loaded with dense f32 projections from `source`) with
/// `method`, calibrating on `samples` (token sequences). `model`'s projections and norms are
/// left as the quantized model computes them. `on_layer(l)` is called after layer `l`.
pub fn quantize_model(
    model: &mut Llama,
    source: &dyn WeightSource,
    samples: &[Vec<u32>],
    method: &Method,
    on_layer: &mut dyn FnMut(usize),
) -> Result<QuantizedModel, ModelQuantError> {
    let config = model.config.clone();
    let mut result = QuantizedModel::default();
    let weight =
        |name: &str, out: usize, cols: usize| source.matrix(&format!("{name}.weight"), out, cols);
    if let Method::Rtn {
        group_size,
        symmetric,
    } = *method
    {
        for l in 0..config.num_hidden_layers {
            for (name, out, cols) in projections(&config, l) {
                let w = weight(&name, out, cols)?.as_standard_layout().into_owned();
                let q = round_to_nearest(
                    w.as_slice().expect("standard"),
                    out,
                    cols,
                    group_size,
                    symmetric,
                )
                .map_err(|source| ModelQuantError::Codes {
                    name: name.clone(),
                    source,
                })?;
                result.layers.insert(name, q);
            }
        }
        return Ok(result);
    }
    if samples.iter().all(|s| s.is_empty()) {
        return Err(ModelQuantError::NoCalibration);
    }
    for s in samples {
        model.check_tokens(s)?;
    }
    let mut xs: Vec<Array2<f32>> = samples.iter().map(|s| model.embed(s)).collect(); // [T, hidden]
    let eps = config.rms_norm_eps;
    for l in 0..config.num_hidden_layers {
        let prefix = format!("model.layers.{l}");
        let names: Vec<(String, usize, usize)> = projections(&config, l);
        let shape_of = |short: &str| {
            names
                .iter()
                .find(|n| n.0.ends_with(short))
                .expect("a projection")
                .clone()
        };
        // Weights [out, in] and biases [out] (None: the projection has none), by short name.
        let mut w: BTreeMap<&str, Array2<f32>> = BTreeMap::new();
        let mut b: BTreeMap<&str, Option<Array1<f32>>> = BTreeMap::new();
        for short in ATTN
            .iter()
            .chain(&["o_proj"])
            .chain(&MLP_IN)
            .chain(&["down_proj"])
        {
            let (name, out, cols) = shape_of(short);
            w.insert(short, weight(&name, out, cols)?);
            let bias = if has_bias(&config, short) {
                Some(source.vector(&format!("{name}.bias"), out)?)
            } else {
                None
            };
            b.insert(short, bias);
        }
        let rope = &model.rope;
        let layer = &mut model.layers[l];
        let quantize = |short: &str,
                        w: &Array2<f32>,
                        stats: &Stats,
                        result: &mut QuantizedModel|
         -> Result<Array2<f32>, ModelQuantError> {
            let name = format!("{prefix}.{}", short_path(short));
            let (out, cols) = w.dim();
            let w = w.as_standard_layout();
            let flat = w.as_slice().expect("standard");
            let q = match (method, stats) {
                (Method::Gptq(c), Stats::Hessian(h)) => {
                    gptq(flat, out, &h.matrix(), c).map_err(|source| ModelQuantError::Gptq {
                        name: name.clone(),
                        source,
                    })?
                }
                (Method::Awq { group_size, .. }, _) => {
                    round_to_nearest(flat, out, cols, *group_size, false).map_err(|source| {
                        ModelQuantError::Codes {
                            name: name.clone(),
                            source,
                        }
                    })?
                }
                _ => unreachable!("round-to-nearest returned above"),
            };
            let deq = dequantized(&q);
            result.layers.insert(name, q);
            Ok(deq)
        };
        let stats = |inputs: &[Array2<f32>]| -> Stats {
            match method {
                Method::Gptq(_) => {
                    let mut h = Hessian::new(inputs[0].ncols());
                    inputs.iter().for_each(|x| h.add(x.view()));
                    Stats::Hessian(h)
                }
                _ => {
                    let mut m = ChannelMagnitude::new(inputs[0].ncols());
                    inputs.iter().for_each(|x| m.add(x.view()));
                    let tokens = match method {
                        Method::Awq { tokens, .. } => *tokens,
                        _ => 0,
                    };
                    let per = tokens.div_ceil(inputs.len()).max(1);
                    let parts: Vec<Array2<f32>> = inputs
                        .iter()
                        .map(|x| awq::subsample(x.view(), per))
                        .collect();
                    let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
                    Stats::Awq(
                        m,
                        ndarray::concatenate(ndarray::Axis(0), &views).expect("same width"),
                    )
                }
            }
        };

        // q, k, v on norm1's output.
        let a: Vec<Array2<f32>> = xs
            .iter()
            .map(|x| layer.input_layernorm.forward(x.view()))
            .collect();
        let st = stats(&a);
        let a = if let Stats::Awq(m, x) = &st {
            let group_size = awq_group(method);
            let norm_name = format!("{prefix}.input_layernorm.weight");
            let norm = source.vector(&norm_name, config.hidden_size)?;
            let norm = awq_into_norm(AwqGroup {
                label: format!("{prefix}.self_attn"),
                shorts: &ATTN,
                weights: &mut w,
                x: x.view(),
                mean: m.mean(),
                group_size,
                norm: (norm_name, norm),
                result: &mut result,
            })?;
            layer.input_layernorm = RmsNorm::new(norm, eps);
            xs.iter()
                .map(|x| layer.input_layernorm.forward(x.view()))
                .collect()
        } else {
            a
        };
        for short in ATTN {
            let deq = quantize(short, &w[short], &st, &mut result)?;
            *attn_slot(layer, short) = dense(&deq, &b[short]);
        }
        drop(st);

        // o on the attention's output, with the quantized q, k, v.
        let shape = layer.self_attn.shape();
        let o_in: Vec<Array2<f32>> = a
            .iter()
            .map(|a| {
                let (q, k, v) = layer.self_attn.qkv(a.view(), rope, 0);
                causal_attention(q.view(), k.view(), v.view(), shape)
            })
            .collect();
        drop(a);
        let st = stats(&o_in);
        let deq = quantize("o_proj", &w["o_proj"], &st, &mut result)?;
        layer.self_attn.o_proj = dense(&deq, &b["o_proj"]);
        drop(st);
        let h: Vec<Array2<f32>> = xs
            .iter()
            .zip(&o_in)
            .map(|(x, o)| x + &layer.self_attn.o_proj.forward(o.view()))
            .collect();
        drop(o_in);

        // gate, up on norm2's output; down on silu(gate) · up.
        let mut m: Vec<Array2<f32>> = h
            .iter()
            .map(|h| layer.post_attention_layernorm.forward(h.view()))
            .collect();
        let down_input = |layer: &ch01::model::DecoderLayer, m: &Array2<f32>| {
            let mut g = layer.mlp.gate_proj.forward(m.view()); // [T, intermediate]
            let up = layer.mlp.up_proj.forward(m.view());
            g.zip_mut_with(&up, |g, u| *g = silu(*g) * u);
            g
        };
        let st = stats(&m);
        if let Stats::Awq(mag, x) = &st {
            let group_size = &awq_group(method);
            let norm_name = format!("{prefix}.post_attention_layernorm.weight");
            let norm = source.vector(&norm_name, config.hidden_size)?;
            let norm = awq_into_norm(AwqGroup {
                label: format!("{prefix}.mlp.gate_up"),
                shorts: &MLP_IN,
                weights: &mut w,
                x: x.view(),
                mean: mag.mean(),
                group_size: *group_size,
                norm: (norm_name, norm),
                result: &mut result,
            })?;
            layer.post_attention_layernorm = RmsNorm::new(norm, eps);
            m = h
                .iter()
                .map(|h| layer.post_attention_layernorm.forward(h.view()))
                .collect();
            // down's scales, searched on the input of the unquantized (scaled) gate and up,
            // fold into up's output rows.
            layer.mlp.gate_proj = dense(&w["gate_proj"], &b["gate_proj"]);
            layer.mlp.up_proj = dense(&w["up_proj"], &b["up_proj"]);
            let d_in: Vec<Array2<f32>> = m.iter().map(|m| down_input(layer, m)).collect();
            let Stats::Awq(dmag, dx) = stats(&d_in) else {
                unreachable!()
            };
            let found = awq::search(&[&w["down_proj"]], dx.view(), &dmag.mean(), *group_size)
                .map_err(|source| ModelQuantError::Codes {
                    name: format!("{prefix}.mlp.down_proj"),
                    source,
                })?;
            result.awq.push((
                format!("{prefix}.mlp.down"),
                found.alpha,
                found.error,
                found.rtn_error,
            ));
            let down = awq::scale_columns(&w["down_proj"], &found.scales);
            w.insert("down_proj", down);
            let mut up = w["up_proj"].clone();
            for (mut row, &s) in up.rows_mut().into_iter().zip(&found.scales) {
                row.mapv_inplace(|v| (f64::from(v) / s) as f32);
            }
            w.insert("up_proj", up);
            // up's bias is part of its output: divided too, and written in place of the
            // checkpoint's.
            if let Some(bias) = &b["up_proj"] {
                let divided: Array1<f32> = bias
                    .iter()
                    .zip(&found.scales)
                    .map(|(&v, &s)| (f64::from(v) / s) as f32)
                    .collect();
                result
                    .dense
                    .insert(format!("{prefix}.mlp.up_proj.bias"), divided.to_vec());
                b.insert("up_proj", Some(divided));
            }
        }
        for short in MLP_IN {
            let deq = quantize(short, &w[short], &st, &mut result)?;
            *mlp_slot(layer, short) = dense(&deq, &b[short]);
        }
        drop(st);
        let d_in: Vec<Array2<f32>> = m.iter().map(|m| down_input(layer, m)).collect();
        drop(m);
        let st = if matches!(method, Method::Gptq(_)) {
            stats(&d_in)
        } else {
            Stats::None
        };
        let deq = quantize("down_proj", &w["down_proj"], &st, &mut result)?;
        layer.mlp.down_proj = dense(&deq, &b["down_proj"]);
        xs = h
            .iter()
            .zip(&d_in)
            .map(|(h, d)| h + &layer.mlp.down_proj.forward(d.view()))
            .collect();
        on_layer(l);
    }
    Ok(result)
}
// ANCHOR_END: quantize_model

/// The group size of an AWQ method.
fn awq_group(method: &Method) -> usize {
    match method {
        Method::Awq { group_size, .. } => *group_size,
        _ => unreachable!("only AWQ gathers magnitudes"),
    }
}

/// One AWQ search whose `1 / s` folds into an RMSNorm.
struct AwqGroup<'a, 'w> {
    label: String,
    shorts: &'a [&'static str],
    weights: &'a mut BTreeMap<&'w str, Array2<f32>>,
    /// The search's tokens `[T, in]` and the channel magnitudes.
    x: ndarray::ArrayView2<'a, f32>,
    mean: ndarray::Array1<f64>,
    group_size: usize,
    /// The norm's tensor name and weights.
    norm: (String, ndarray::Array1<f32>),
    result: &'a mut QuantizedModel,
}

/// Searches the scales of `g.shorts`, scales their weights' columns by `s`, and returns the norm
/// divided by `s` (also recorded in `g.result.dense`).
fn awq_into_norm(g: AwqGroup<'_, '_>) -> Result<ndarray::Array1<f32>, ModelQuantError> {
    let layers: Vec<&Array2<f32>> = g.shorts.iter().map(|s| &g.weights[s]).collect();
    let found = awq::search(&layers, g.x, &g.mean, g.group_size).map_err(|source| {
        ModelQuantError::Codes {
            name: g.label.clone(),
            source,
        }
    })?;
    g.result
        .awq
        .push((g.label, found.alpha, found.error, found.rtn_error));
    let (name, norm) = g.norm;
    let norm = norm / &found.scales.mapv(|s| s as f32);
    g.result.dense.insert(name, norm.to_vec());
    for short in g.shorts {
        let scaled = awq::scale_columns(&g.weights[short], &found.scales);
        g.weights.insert(short, scaled);
    }
    Ok(norm)
}

/// A group's calibration statistics.
enum Stats {
    Hessian(Hessian),
    /// Channel magnitudes and the tokens the search evaluates on.
    Awq(ChannelMagnitude, Array2<f32>),
    None,
}

fn short_path(short: &str) -> String {
    match short {
        "q_proj" | "k_proj" | "v_proj" | "o_proj" => format!("self_attn.{short}"),
        _ => format!("mlp.{short}"),
    }
}

fn attn_slot<'a>(layer: &'a mut ch01::model::DecoderLayer, short: &str) -> &'a mut Box<dyn Linear> {
    match short {
        "q_proj" => &mut layer.self_attn.q_proj,
        "k_proj" => &mut layer.self_attn.k_proj,
        _ => &mut layer.self_attn.v_proj,
    }
}

fn mlp_slot<'a>(layer: &'a mut ch01::model::DecoderLayer, short: &str) -> &'a mut Box<dyn Linear> {
    match short {
        "gate_proj" => &mut layer.mlp.gate_proj,
        _ => &mut layer.mlp.up_proj,
    }
}

/// The seven projections of layer `l`: (name, out, in).
pub fn projections(c: &ch01::LlamaConfig, l: usize) -> Vec<(String, usize, usize)> {
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let p = format!("model.layers.{l}");
    vec![
        (format!("{p}.self_attn.q_proj"), q, h),
        (format!("{p}.self_attn.k_proj"), kv, h),
        (format!("{p}.self_attn.v_proj"), kv, h),
        (format!("{p}.self_attn.o_proj"), h, q),
        (format!("{p}.mlp.gate_proj"), i, h),
        (format!("{p}.mlp.up_proj"), i, h),
        (format!("{p}.mlp.down_proj"), h, i),
    ]
}
