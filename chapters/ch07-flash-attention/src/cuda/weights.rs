//! A Llama's weights in device memory, f32 (exact, for the tests against the CPU) or bf16 (half
//! the bytes each decode step streams), read from any chapter 1 [`WeightSource`] under the
//! Hugging Face names (the names `Llama::from_source` reads). Norm weights and biases stay f32.

use ch01::{DenseLinear, LinearSpec, LlamaConfig, WeightSource};
use ch02::WeightDtype;
use cudarc::driver::CudaSlice;
use half::bf16;
use ndarray::Array2;

use super::CudaError;
use super::device::GpuDevice;

/// A matrix in device memory, in the dtype its weights were uploaded in.
pub enum DeviceMatrix {
    F32(CudaSlice<f32>),
    /// Rounded to nearest even at upload; products accumulate in f32.
    Bf16(CudaSlice<bf16>),
}

impl DeviceMatrix {
    /// Uploads `m` (any layout) in `dtype`.
    pub fn upload(dev: &GpuDevice, m: &Array2<f32>, dtype: WeightDtype) -> Result<Self, CudaError> {
        let m = m.as_standard_layout();
        let values = m.as_slice().expect("standard layout");
        Ok(match dtype {
            WeightDtype::F32 => DeviceMatrix::F32(dev.stream.clone_htod(values)?),
            WeightDtype::Bf16 => {
                let rounded: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
                DeviceMatrix::Bf16(dev.stream.clone_htod(&rounded)?)
            }
        })
    }

    pub fn len(&self) -> usize {
        match self {
            DeviceMatrix::F32(m) => m.len(),
            DeviceMatrix::Bf16(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> WeightDtype {
        match self {
            DeviceMatrix::F32(_) => WeightDtype::F32,
            DeviceMatrix::Bf16(_) => WeightDtype::Bf16,
        }
    }

    /// Device bytes it occupies.
    pub fn bytes(&self) -> u64 {
        let size = match self {
            DeviceMatrix::F32(_) => 4,
            DeviceMatrix::Bf16(_) => 2,
        };
        (self.len() * size) as u64
    }
}

impl DeviceLinear {
    /// Device bytes of the weight and the bias.
    pub fn bytes(&self) -> u64 {
        self.weight.bytes() + self.bias.as_ref().map_or(0, |b| (b.len() * 4) as u64)
    }
}

/// One projection on the device. Invariant: `weight` holds `out_features · in_features` values
/// (`[out, in]`, row-major, as Hugging Face stores it), `bias` `out_features` when present.
pub struct DeviceLinear {
    pub weight: DeviceMatrix,
    pub bias: Option<CudaSlice<f32>>,
    pub in_features: usize,
    pub out_features: usize,
}

pub struct DeviceLayer {
    pub input_norm: CudaSlice<f32>,
    pub q: DeviceLinear,
    pub k: DeviceLinear,
    pub v: DeviceLinear,
    pub o: DeviceLinear,
    pub post_norm: CudaSlice<f32>,
    pub gate: DeviceLinear,
    pub up: DeviceLinear,
    pub down: DeviceLinear,
}

/// Every weight of the model on one device. Invariant: every projection and the embedding table
/// are stored in `dtype`.
pub struct DeviceWeights {
    pub dtype: WeightDtype,
    /// `[vocab, hidden]`; `None` when the embeddings are tied: the head's weight is the table.
    pub embed_tokens: Option<DeviceMatrix>,
    pub layers: Vec<DeviceLayer>,
    pub norm: CudaSlice<f32>,
    pub lm_head: DeviceLinear, // hidden → vocab
    /// RoPE's inverse frequencies (scaling applied), `[head_dim / 2]`.
    pub inv_freq: CudaSlice<f32>,
}

impl DeviceWeights {
    /// The embedding table `[vocab, hidden]`: its own, or the head's when they are tied.
    pub fn embedding_table(&self) -> &DeviceMatrix {
        self.embed_tokens.as_ref().unwrap_or(&self.lm_head.weight)
    }

    /// Device bytes of every weight (what `nvidia-smi` shows the process holding for them,
    /// beside the K/V pool and the CUDA context).
    pub fn bytes(&self) -> u64 {
        let f32s = |v: &CudaSlice<f32>| (v.len() * 4) as u64;
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                let projections = [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down];
                f32s(&l.input_norm)
                    + f32s(&l.post_norm)
                    + projections.iter().map(|p| p.bytes()).sum::<u64>()
            })
            .sum();
        self.embed_tokens.as_ref().map_or(0, DeviceMatrix::bytes)
            + layers
            + f32s(&self.norm)
            + self.lm_head.bytes()
            + f32s(&self.inv_freq)
    }

    /// Reads and uploads every weight, the projections and the embedding table in `dtype`.
    /// Errors: a missing or misshapen tensor (from the source), a device allocation that fails.
    pub fn load(
        dev: &GpuDevice,
        config: &LlamaConfig,
        source: &dyn WeightSource,
        dtype: WeightDtype,
    ) -> Result<DeviceWeights, CudaError> {
        let c = config;
        let load_err = |e: ch01::Error| CudaError::Weights(e.to_string());
        let (hidden, q_dim, kv_dim) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let linear = |name: &str, in_f: usize, out_f: usize, bias: bool| {
            let dense = DenseLinear::load(source, &LinearSpec::whole(name, in_f, out_f, bias))
                .map_err(load_err)?;
            Ok::<_, CudaError>(DeviceLinear {
                weight: DeviceMatrix::upload(dev, dense.weight(), dtype)?,
                bias: match dense.bias() {
                    Some(b) => Some(dev.stream.clone_htod(b.as_slice().expect("contiguous"))?),
                    None => None,
                },
                in_features: in_f,
                out_features: out_f,
            })
        };
        let norm = |name: &str| -> Result<CudaSlice<f32>, CudaError> {
            let v = source.vector(name, hidden).map_err(load_err)?;
            Ok(dev.stream.clone_htod(v.as_slice().expect("contiguous"))?)
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let (attn, mlp) = (
                format!("model.layers.{i}.self_attn"),
                format!("model.layers.{i}.mlp"),
            );
            let inter = c.intermediate_size;
            layers.push(DeviceLayer {
                input_norm: norm(&format!("model.layers.{i}.input_layernorm.weight"))?,
                q: linear(&format!("{attn}.q_proj"), hidden, q_dim, c.qkv_bias)?,
                k: linear(&format!("{attn}.k_proj"), hidden, kv_dim, c.qkv_bias)?,
                v: linear(&format!("{attn}.v_proj"), hidden, kv_dim, c.qkv_bias)?,
                o: linear(&format!("{attn}.o_proj"), q_dim, hidden, c.o_bias)?,
                post_norm: norm(&format!("model.layers.{i}.post_attention_layernorm.weight"))?,
                gate: linear(&format!("{mlp}.gate_proj"), hidden, inter, c.mlp_bias)?,
                up: linear(&format!("{mlp}.up_proj"), hidden, inter, c.mlp_bias)?,
                down: linear(&format!("{mlp}.down_proj"), inter, hidden, c.mlp_bias)?,
            });
        }
        // Tied embeddings: the head is the embedding matrix, as in chapter 1, held once.
        let tied = c.tie_word_embeddings && !source.contains("lm_head.weight");
        let head = if tied {
            "model.embed_tokens"
        } else {
            "lm_head"
        };
        let embed_tokens = match tied {
            true => None,
            false => {
                let embed = source
                    .matrix("model.embed_tokens.weight", c.vocab_size, hidden)
                    .map_err(load_err)?;
                Some(DeviceMatrix::upload(dev, &embed, dtype)?)
            }
        };
        let rope = ch01::rope::Rope::from_config(c);
        let inv_freq: Vec<f32> = rope.inv_freq().iter().map(|&f| f as f32).collect();
        Ok(DeviceWeights {
            dtype,
            embed_tokens,
            layers,
            norm: norm("model.norm.weight")?,
            lm_head: linear(head, hidden, c.vocab_size, false)?,
            inv_freq: dev.stream.clone_htod(&inv_freq)?,
        })
    }
}
