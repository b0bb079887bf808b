//! A Hugging Face checkpoint → a GGUF file that kiln and llama.cpp both load: what llama.cpp's
//! `convert_hf_to_gguf.py` followed by `llama-quantize` does, in one pass, without Python.
//!
//! ```text
//! config.json              → general.*, {arch}.* (the inverse of `config.rs`)
//! tokenizer*.json, ...     → tokenizer.ggml.*, tokenizer.chat_template   (`vocab.rs`)
//! *.safetensors            → tensors: GGUF names, q/k rows permuted for llama.cpp's RoPE
//!                            (`permute_qk`, the inverse of what `GgufSource` undoes), each in
//!                            the type `policy.rs` picks for `--type`
//! ```
//!
//! Invariants of the file [`convert_hf_dir`] builds:
//! - `load_gguf` on it gives the checkpoint's config (RoPE scaling none or linear; stop ids eos
//!   and eot), and the tokenizer of `tokenizer.json`: the converter encodes a set of check texts
//!   with both and refuses to write a file whose tokenizer differs.
//! - Every tensor holds exactly the checkpoint's values rounded once to its type: at `f32` the
//!   model computes the checkpoint's logits bit for bit; at a block type, those of the
//!   checkpoint whose weights were quantized and decoded with [`crate::blocks`].
//! - Nothing is written under the output's name until the whole file is ready
//!   ([`GgufWriter::write`]).
//!
//! Cost: one pass over the weights, encoding in parallel over rows; the encoded file is held in
//! memory until it is written (its size, not the checkpoint's).
//!
//! Not supported, each an error: SentencePiece (non-byte-level) tokenizers, Llama 3's RoPE
//! scaling (llama.cpp stores it as a `rope_freqs` tensor, which kiln's reader refuses), and
//! architectures other than llama / mistral / qwen2 (config.json's own check).

pub mod error;
pub mod policy;
pub mod vocab;

use std::path::Path;

use ch01::config::RopeScaling;
use ch01::{LlamaConfig, TensorDtype, WeightSource, Weights};
use rayon::prelude::*;

pub use error::{ConvertError, ConvertResult};
pub use policy::{
    QUANTIZE_TYPES, TensorRole, fallback, k_quant_fallback, llama_ftype, tensor_type,
};
pub use vocab::HfVocab;

use super::config::GgufArch;
use super::file::GgufFile;
use super::source::{gguf_name, permute_qk};
use super::writer::GgufWriter;
use crate::blocks;
use crate::format::GgmlType;

/// The llama.cpp quantization format version written as `general.quantization_version`.
pub const QUANTIZATION_VERSION: u32 = 2;

/// One tensor as written.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorReport {
    /// GGUF name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Outermost first, as Hugging Face lists it.
    pub shape: Vec<usize>,
    pub role: TensorRole,
    /// The checkpoint's dtype and bytes.
    pub source: TensorDtype,
    pub source_bytes: usize,
    /// The type written and its bytes.
    pub ty: GgmlType,
    pub bytes: usize,
}

/// What [`convert_hf_dir`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertReport {
    /// The `--type` asked for.
    pub target: GgmlType,
    pub tensors: Vec<TensorReport>,
    /// Things left out or changed that a user should know about.
    pub warnings: Vec<String>,
}

impl ConvertReport {
    /// Elements of every tensor written.
    pub fn parameters(&self) -> usize {
        self.tensors
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum()
    }

    /// Bytes of those tensors in the checkpoint.
    pub fn source_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.source_bytes).sum()
    }

    /// Bytes of those tensors in the GGUF file (metadata and padding not included).
    pub fn tensor_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.bytes).sum()
    }

    /// Bits of tensor data per weight in the GGUF file.
    pub fn bits_per_weight(&self) -> f64 {
        self.tensor_bytes() as f64 * 8.0 / self.parameters().max(1) as f64
    }

    /// How many tensors of each type, in the order the types first appear.
    pub fn type_counts(&self) -> Vec<(GgmlType, usize)> {
        let mut counts: Vec<(GgmlType, usize)> = Vec::new();
        for t in &self.tensors {
            match counts.iter_mut().find(|(ty, _)| *ty == t.ty) {
                Some((_, n)) => *n += 1,
                None => counts.push((t.ty, 1)),
            }
        }
        counts
    }

    /// Projections written in another type than the target (rows not whole blocks of it).
    pub fn fallbacks(&self) -> impl Iterator<Item = &TensorReport> {
        self.tensors
            .iter()
            .filter(|t| t.role == TensorRole::Projection && t.ty != self.target)
    }
}

/// A file ready to write, and what is in it.
pub struct Converted {
    pub writer: GgufWriter<'static>,
    pub report: ConvertReport,
}

/// Converts the checkpoint in `dir` to GGUF with projections in `ty` (see [`policy`]), and
/// writes it to `out`.
pub fn quantize_hf_dir(dir: &Path, ty: GgmlType, out: &Path) -> ConvertResult<ConvertReport> {
    let converted = convert_hf_dir(dir, ty)?;
    converted.writer.write(out)?;
    Ok(converted.report)
}

/// Converts the checkpoint in `dir` to a GGUF file in memory.
pub fn convert_hf_dir(dir: &Path, ty: GgmlType) -> ConvertResult<Converted> {
    if !QUANTIZE_TYPES.contains(&ty) {
        return Err(ConvertError::UnsupportedType(ty));
    }
    let config = LlamaConfig::from_dir(dir)?;
    let arch = if config.model_type == "qwen2" {
        GgufArch::Qwen2
    } else {
        GgufArch::Llama
    };
    let weights = Weights::open(dir)?;
    let vocab = HfVocab::read(dir, config.vocab_size)?;
    check_tokenizer(dir, &vocab)?;

    let mut w = GgufWriter::new();
    add_model_metadata(&mut w, dir, &config, arch, ty)?;
    vocab.add_to(&mut w)?;

    let mut report = ConvertReport {
        target: ty,
        tensors: Vec::new(),
        warnings: vocab.warnings.clone(),
    };
    if config.tie_word_embeddings && weights.contains("lm_head.weight") {
        report
            .warnings
            .push("lm_head.weight left out: tie_word_embeddings uses the embedding".into());
    }
    for expected in expected_tensors(&config) {
        let t = convert_tensor(&weights, &config, arch, ty, &expected)?;
        report.tensors.push(t.report);
        w.add_tensor(&t.gguf_name, t.ty, &expected.shape, t.bytes)?;
    }
    Ok(Converted { writer: w, report })
}

/// `general.*` and `{arch}.*`.
fn add_model_metadata(
    w: &mut GgufWriter<'_>,
    dir: &Path,
    c: &LlamaConfig,
    arch: GgufArch,
    ty: GgmlType,
) -> ConvertResult<()> {
    let path = dir.join("config.json");
    let a = arch.name();
    let key = |k: &str| format!("{a}.{k}");
    let u32_of = |what: &str, v: usize| {
        u32::try_from(v).map_err(|_| {
            ConvertError::unsupported(&path, format!("{what} {v} does not fit GGUF's u32"))
        })
    };
    let name = std::fs::canonicalize(dir)
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".to_string());
    w.add_metadata("general.architecture", a)?;
    w.add_metadata("general.type", "model")?;
    w.add_metadata("general.name", name)?;
    for (k, v) in [
        ("block_count", c.num_hidden_layers),
        ("context_length", c.max_position_embeddings),
        ("embedding_length", c.hidden_size),
        ("feed_forward_length", c.intermediate_size),
        ("attention.head_count", c.num_attention_heads),
        ("attention.head_count_kv", c.num_key_value_heads),
        ("attention.key_length", c.head_dim),
        ("attention.value_length", c.head_dim),
        ("rope.dimension_count", c.head_dim),
        ("vocab_size", c.vocab_size),
    ] {
        w.add_metadata(key(k), u32_of(k, v)?)?;
    }
    w.add_metadata(key("rope.freq_base"), c.rope_theta as f32)?;
    w.add_metadata(
        key("attention.layer_norm_rms_epsilon"),
        c.rms_norm_eps as f32,
    )?;
    match c.rope_scaling {
        RopeScaling::Default => {}
        RopeScaling::Linear { factor } => {
            w.add_metadata(key("rope.scaling.type"), "linear")?;
            w.add_metadata(key("rope.scaling.factor"), factor as f32)?;
        }
        RopeScaling::Llama3 { .. } => {
            return Err(ConvertError::unsupported(
                &path,
                "rope_scaling llama3 is not supported: llama.cpp stores it as a rope_freqs \
                 tensor, which kiln's GGUF reader does not read",
            ));
        }
    }
    let ftype = llama_ftype(ty).ok_or(ConvertError::UnsupportedType(ty))?;
    w.add_metadata("general.file_type", ftype)?;
    if ty.is_quantized() {
        w.add_metadata("general.quantization_version", QUANTIZATION_VERSION)?;
    }
    Ok(())
}

/// Texts the GGUF tokenizer must split exactly as `tokenizer.json` does: runs of whitespace,
/// emoji and joiners, digit runs, scripts without spaces, repeated punctuation, contractions.
const CHECK_TEXTS: [&str; 4] = [
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u{200d}🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3",
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!??????",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "Romeo, Romeo! wherefore art thou Romeo?  café naïve 日本語 2024-12-01",
];

/// Builds the tokenizer `vocab` describes, as `load_gguf` will, and checks that it encodes
/// [`CHECK_TEXTS`] (and the special tokens written in text) exactly as `tokenizer.json` does.
fn check_tokenizer(dir: &Path, vocab: &HfVocab) -> ConvertResult<()> {
    let path = dir.join("tokenizer.json");
    let mut w = GgufWriter::new();
    vocab.add_to(&mut w)?;
    let file = GgufFile::from_bytes(&path, w.to_bytes())?;
    let ours = super::tokenizer::hf_tokenizer(&file)?;
    let reference = ch01::Tokenizer::from_dir(dir)?;
    let specials: String = vocab
        .tokens
        .iter()
        .zip(&vocab.types)
        .filter(|&(_, &t)| t == super::tokenizer::token_type::CONTROL)
        .map(|(token, _)| format!("{token} x"))
        .collect();
    for text in CHECK_TEXTS.iter().copied().chain([specials.as_str()]) {
        for add_special in [false, true] {
            let want = reference.encode(text, add_special)?;
            let got = ours
                .encode(text, add_special)
                .map_err(|e| ConvertError::tokenizer(&path, e.to_string()))?;
            if got.get_ids() != want.as_slice() {
                return Err(ConvertError::tokenizer(
                    &path,
                    format!(
                        "the GGUF tokenizer (pre-tokenizer `{}`) splits {text:?} differently: \
                         {:?} instead of {want:?}",
                        vocab.pre,
                        got.get_ids()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A tensor the config implies.
struct Expected {
    /// Hugging Face name.
    name: String,
    shape: Vec<usize>,
    role: TensorRole,
}

/// Every tensor a checkpoint with config `c` must hold (biases where the config has them), in
/// the order llama.cpp writes them.
fn expected_tensors(c: &LlamaConfig) -> Vec<Expected> {
    let (hidden, inter, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let tensor = |name: String, shape: Vec<usize>, role| Expected { name, shape, role };
    let mut out = vec![tensor(
        "model.embed_tokens.weight".into(),
        vec![c.vocab_size, hidden],
        TensorRole::Embedding {
            tied: c.tie_word_embeddings,
        },
    )];
    for i in 0..c.num_hidden_layers {
        let p = |part: &str| format!("model.layers.{i}.{part}");
        let norm = |part: &str| tensor(p(part), vec![hidden], TensorRole::Vector);
        out.push(norm("input_layernorm.weight"));
        for (part, rows, cols, bias) in [
            ("self_attn.q_proj", q, hidden, c.qkv_bias),
            ("self_attn.k_proj", kv, hidden, c.qkv_bias),
            ("self_attn.v_proj", kv, hidden, c.qkv_bias),
            ("self_attn.o_proj", hidden, q, c.o_bias),
            ("mlp.gate_proj", inter, hidden, c.mlp_bias),
            ("mlp.up_proj", inter, hidden, c.mlp_bias),
            ("mlp.down_proj", hidden, inter, c.mlp_bias),
        ] {
            if part == "mlp.gate_proj" {
                out.push(norm("post_attention_layernorm.weight"));
            }
            let weight = format!("{part}.weight");
            out.push(tensor(p(&weight), vec![rows, cols], TensorRole::Projection));
            if bias {
                let bias = format!("{part}.bias");
                out.push(tensor(p(&bias), vec![rows], TensorRole::Vector));
            }
        }
    }
    out.push(tensor(
        "model.norm.weight".into(),
        vec![hidden],
        TensorRole::Vector,
    ));
    if !c.tie_word_embeddings {
        out.push(tensor(
            "lm_head.weight".into(),
            vec![c.vocab_size, hidden],
            TensorRole::Output,
        ));
    }
    out
}

struct EncodedTensor {
    gguf_name: String,
    ty: GgmlType,
    bytes: Vec<u8>,
    report: TensorReport,
}

/// Reads, checks, encodes and (q/k of llama) permutes one tensor.
fn convert_tensor(
    weights: &Weights,
    c: &LlamaConfig,
    arch: GgufArch,
    target: GgmlType,
    e: &Expected,
) -> ConvertResult<EncodedTensor> {
    let raw = weights.tensor(&e.name)?;
    if raw.shape() != e.shape.as_slice() {
        return Err(ch01::Error::ShapeMismatch {
            name: e.name.clone(),
            expected: e.shape.clone(),
            actual: raw.shape().to_vec(),
        }
        .into());
    }
    let gguf = gguf_name(&e.name).ok_or_else(|| {
        ConvertError::unsupported(
            weights.dir(),
            format!("tensor `{}` has no GGUF name", e.name),
        )
    })?;
    let cols = *e.shape.last().unwrap_or(&1);
    let ty = tensor_type(e.role, cols, target);
    let values = raw.to_f32(&e.name)?;
    let mut bytes = encode(ty, &values, cols).map_err(|error| ConvertError::Encode {
        name: e.name.clone(),
        error,
    })?;
    let heads = if e.name.contains(".self_attn.q_proj.") {
        Some(c.num_attention_heads)
    } else if e.name.contains(".self_attn.k_proj.") {
        Some(c.num_key_value_heads)
    } else {
        None
    };
    if let Some(n_head) = heads.filter(|_| arch.permutes_qk()) {
        bytes = permute_qk(&bytes, e.shape[0], n_head).ok_or_else(|| {
            ConvertError::unsupported(
                weights.dir(),
                format!(
                    "tensor `{}`: {} rows do not split into {n_head} heads of even size",
                    e.name, e.shape[0]
                ),
            )
        })?;
    }
    Ok(EncodedTensor {
        report: TensorReport {
            name: gguf.clone(),
            shape: e.shape.clone(),
            role: e.role,
            source: raw.dtype(),
            source_bytes: raw.bytes().len(),
            ty,
            bytes: bytes.len(),
        },
        gguf_name: gguf,
        ty,
        bytes,
    })
}

/// `values` (rows of `cols`) encoded as `ty`, in parallel over groups of rows. A value `ty`
/// cannot hold (NaN or ∞ in a block format, a block whose f16 scale overflows) is an error, its
/// element counted row-major from the start of `values` ([`blocks::quantize`]).
pub fn encode(ty: GgmlType, values: &[f32], cols: usize) -> Result<Vec<u8>, blocks::BlockError> {
    let length_error = || blocks::BlockError::Length {
        ty,
        bytes: 0,
        elems: values.len(),
    };
    let row_bytes = ty.row_bytes(cols).ok_or_else(length_error)?;
    if cols == 0 || !values.len().is_multiple_of(cols) {
        return Err(length_error());
    }
    let rows = values.len() / cols;
    let mut out = vec![0u8; rows * row_bytes];
    const ROWS_PER_TASK: usize = 16;
    out.par_chunks_mut(row_bytes * ROWS_PER_TASK)
        .zip(values.par_chunks(cols * ROWS_PER_TASK))
        .enumerate()
        .try_for_each(|(t, (o, v))| {
            blocks::quantize(ty, v, o).map_err(|e| e.offset(t * ROWS_PER_TASK * cols))
        })?;
    Ok(out)
}
