//! [`GgufSource`]: a GGUF file seen as a Hugging Face checkpoint, through chapter 1's
//! [`WeightSource`] seam.
//!
//! Three translations happen here, and nothing else:
//!
//! 1. **Names.** GGUF calls `model.layers.3.self_attn.q_proj.weight` `blk.3.attn_q.weight`; the
//!    source answers Hugging Face names (table below) and keeps the GGUF ones for tools
//!    ([`GgufSource::gguf_tensor`]).
//! 2. **Shapes.** GGUF lists dimensions fastest-first (`[in, out]`); the source reports them
//!    outermost first (`[out, in]`), which is the same bytes in the same order.
//! 3. **q/k rows.** For the `llama` architecture, llama.cpp's converter reorders the rows of
//!    q_proj and k_proj within each head from Hugging Face's rotate-half RoPE pairing
//!    (row `i` with row `i + d/2`) to llama.cpp's interleaved pairing (rows `2i`, `2i + 1`).
//!    With `d` the head dimension, head `h`'s row `half · d/2 + i` in Hugging Face order is
//!    row `2i + half` of the same head in the file; a q or k bias has its elements moved the
//!    same way. [`permute_qk`] is the converter's direction. A row is a run of whole blocks in every
//!    type, so undoing this moves whole rows of bytes and never decodes anything: the source
//!    hands out q and k as owned, reordered bytes, and everything else borrowed from the map.
//!
//! ```text
//! GGUF                     Hugging Face
//! token_embd.weight        model.embed_tokens.weight
//! output_norm.weight       model.norm.weight
//! output.weight            lm_head.weight
//! blk.N.attn_norm          model.layers.N.input_layernorm
//! blk.N.ffn_norm           model.layers.N.post_attention_layernorm
//! blk.N.attn_q / _k / _v   model.layers.N.self_attn.q_proj / k_proj / v_proj
//! blk.N.attn_output        model.layers.N.self_attn.o_proj
//! blk.N.ffn_gate/_up/_down model.layers.N.mlp.gate_proj / up_proj / down_proj
//! ```
//! (each with its `.weight` / `.bias` suffix.)
//!
//! Block-quantized tensors are reported as [`TensorDtype::Blocks`](ch01::TensorDtype::Blocks);
//! the source's `get` and `matrix_block` decode them (and the dense float types) to f32 with
//! [`crate::blocks::dequantize`], one row at a time, so a shard decodes only its rows.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use ch01::{Error, RawTensor, Result, WeightSource};
use ndarray::Array2;
use rayon::prelude::*;

use super::config::GgufArch;
use super::error::GgufResult;
use super::file::{GgufFile, GgufTensorInfo};
use crate::blocks::{self, BlockError};
use crate::format::GgmlType;

/// Per-layer tensors: GGUF's name inside `blk.N.` → Hugging Face's inside `model.layers.N.`.
const LAYER_NAMES: [(&str, &str); 9] = [
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Tensors outside the layers.
const GLOBAL_NAMES: [(&str, &str); 3] = [
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
];

/// Splits `name` into its base and its `.weight` / `.bias` suffix.
fn split_suffix(name: &str) -> Option<(&str, &str)> {
    let (base, suffix) = name.rsplit_once('.')?;
    matches!(suffix, "weight" | "bias").then_some((base, suffix))
}

/// The Hugging Face name of GGUF tensor `gguf` (`blk.3.attn_q.weight` →
/// `model.layers.3.self_attn.q_proj.weight`); `None` for tensors Hugging Face has no name for.
pub fn hf_name(gguf: &str) -> Option<String> {
    let (base, suffix) = split_suffix(gguf)?;
    if let Some(rest) = base.strip_prefix("blk.") {
        let (layer, part) = rest.split_once('.')?;
        layer.parse::<usize>().ok()?;
        let (_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == part)?;
        return Some(format!("model.layers.{layer}.{hf}.{suffix}"));
    }
    let (_, hf) = GLOBAL_NAMES.iter().find(|(g, _)| *g == base)?;
    Some(format!("{hf}.{suffix}"))
}

/// The GGUF name of Hugging Face tensor `hf`: the inverse of [`hf_name`].
pub fn gguf_name(hf: &str) -> Option<String> {
    let (base, suffix) = split_suffix(hf)?;
    if let Some(rest) = base.strip_prefix("model.layers.") {
        let (layer, part) = rest.split_once('.')?;
        layer.parse::<usize>().ok()?;
        let (g, _) = LAYER_NAMES.iter().find(|(_, h)| *h == part)?;
        return Some(format!("blk.{layer}.{g}.{suffix}"));
    }
    let (g, _) = GLOBAL_NAMES.iter().find(|(_, h)| *h == base)?;
    Some(format!("{g}.{suffix}"))
}

/// Row `r` of a q or k weight in Hugging Face order is this row of the GGUF tensor, for
/// `rows` rows in `n_head` heads (see the module docs). `None` when the rows do not split into
/// heads of an even dimension.
pub fn unpermuted_row(r: usize, rows: usize, n_head: usize) -> Option<usize> {
    let d = rows.checked_div(n_head)?;
    if d * n_head != rows || d % 2 != 0 || r >= rows {
        return None;
    }
    let (head, j) = (r / d, r % d);
    let (half, i) = (j / (d / 2), j % (d / 2));
    Some(head * d + 2 * i + half)
}

/// Hugging Face order → the file's, for a q or k tensor of `units` rows (a weight) or elements
/// (a bias) in `n_head` heads: unit `r` moves to [`unpermuted_row`]`(r)`, each unit being
/// `bytes.len() / units` bytes. This is what llama.cpp's converter does, and what
/// [`GgufSource`] undoes. `None` when the units do not split into heads of an even size, or the
/// bytes into units.
pub fn permute_qk(bytes: &[u8], units: usize, n_head: usize) -> Option<Vec<u8>> {
    let unit = bytes.len().checked_div(units)?;
    if unit * units != bytes.len() {
        return None;
    }
    let mut out = vec![0u8; bytes.len()];
    for (r, src) in bytes.chunks_exact(unit.max(1)).enumerate().take(units) {
        let dst = unpermuted_row(r, units, n_head)?;
        out[dst * unit..(dst + 1) * unit].copy_from_slice(src);
    }
    Some(out)
}

/// A GGUF file answering Hugging Face tensor names. Invariant: every name in `hf` indexes a
/// tensor of `file`.
pub struct GgufSource {
    file: GgufFile,
    /// Hugging Face name → index into `file.tensors()`
    hf: HashMap<String, usize>,
    /// `(num_attention_heads, num_key_value_heads)` when q/k rows are permuted in the file.
    permuted_heads: Option<(usize, usize)>,
}

impl GgufSource {
    /// Opens and parses `path`.
    pub fn open(path: &Path) -> GgufResult<GgufSource> {
        GgufSource::new(GgufFile::open(path)?)
    }

    /// Wraps a parsed file; reads the architecture and, for `llama`, the head counts that undo
    /// the q/k permutation.
    pub fn new(file: GgufFile) -> GgufResult<GgufSource> {
        let arch = GgufArch::of(&file)?;
        let permuted_heads = if arch.permutes_qk() {
            let heads = file.get_usize(&format!("{}.attention.head_count", arch.name()))?;
            let kv = file
                .opt_usize(&format!("{}.attention.head_count_kv", arch.name()))?
                .unwrap_or(heads);
            Some((heads, kv))
        } else {
            None
        };
        let hf = file
            .tensors()
            .iter()
            .enumerate()
            .filter_map(|(i, t)| Some((hf_name(&t.name)?, i)))
            .collect();
        Ok(GgufSource {
            file,
            hf,
            permuted_heads,
        })
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub fn into_file(self) -> GgufFile {
        self.file
    }

    /// The GGUF type of Hugging Face tensor `name`.
    pub fn ggml_type(&self, name: &str) -> Option<GgmlType> {
        self.info(name).map(|t| t.ty)
    }

    /// GGUF tensor `gguf_name` exactly as stored (no row reordering), shape outermost first.
    pub fn gguf_tensor(&self, gguf_name: &str) -> Result<RawTensor<'_>> {
        let info = self
            .file
            .tensor_info(gguf_name)
            .ok_or_else(|| self.missing(gguf_name))?;
        self.raw(gguf_name, info, Cow::Borrowed(self.file.tensor_bytes(info)))
    }

    fn info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.hf.get(name).map(|&i| &self.file.tensors()[i])
    }

    fn missing(&self, name: &str) -> Error {
        Error::MissingTensor {
            name: name.to_string(),
            location: self.file.path().to_path_buf(),
        }
    }

    fn raw<'s>(
        &'s self,
        name: &str,
        info: &GgufTensorInfo,
        bytes: Cow<'s, [u8]>,
    ) -> Result<RawTensor<'s>> {
        RawTensor::new(
            name,
            self.file.path(),
            info.ty.tensor_dtype(),
            info.shape(),
            bytes,
        )
    }

    /// The heads whose rows (a weight) or elements (a bias) Hugging Face tensor `name` has
    /// permuted in the file, if any.
    fn permuted_head_count(&self, name: &str) -> Option<usize> {
        let (heads, kv_heads) = self.permuted_heads?;
        let (base, _) = split_suffix(name)?;
        if base.ends_with(".self_attn.q_proj") {
            Some(heads)
        } else if base.ends_with(".self_attn.k_proj") {
            Some(kv_heads)
        } else {
            None
        }
    }

    /// The units the permutation moves in tensor `info`: `(count, bytes each)`, rows of a
    /// weight or elements of a (dense) bias.
    fn units(info: &GgufTensorInfo) -> (usize, usize) {
        if info.dims.len() == 1 && !info.ty.is_quantized() {
            (info.n_elements(), info.ty.block_bytes())
        } else {
            (info.n_rows(), info.row_bytes())
        }
    }

    /// For each unit (row, or element of a bias) of tensor `name` in Hugging Face order, the
    /// unit of the file that holds it; `None` when they are stored in order.
    fn row_map(&self, name: &str, info: &GgufTensorInfo) -> Result<Option<Vec<usize>>> {
        let Some(n_head) = self.permuted_head_count(name) else {
            return Ok(None);
        };
        if info.size == 0 {
            return Ok(None); // nothing stored, nothing to reorder (however many empty rows)
        }
        let (rows, _) = Self::units(info);
        (0..rows)
            .map(|r| unpermuted_row(r, rows, n_head))
            .collect::<Option<Vec<_>>>()
            .map(Some)
            .ok_or_else(|| Error::Tensor {
                name: name.to_string(),
                location: self.file.path().to_path_buf(),
                message: format!("{rows} rows do not split into {n_head} heads of even size"),
            })
    }

    fn block_error(&self, name: &str, e: BlockError) -> Error {
        match e {
            BlockError::Unsupported(ty) => Error::UnsupportedDtype {
                name: name.to_string(),
                dtype: ty.to_string(),
            },
            other => Error::Tensor {
                name: name.to_string(),
                location: self.file.path().to_path_buf(),
                message: other.to_string(),
            },
        }
    }
}

impl WeightSource for GgufSource {
    fn location(&self) -> &Path {
        self.file.path()
    }

    fn contains(&self, name: &str) -> bool {
        self.hf.contains_key(name)
    }

    /// Tensor `name` in Hugging Face layout: q/k rows back in rotate-half order (owned bytes),
    /// every other tensor borrowed from the map.
    fn tensor(&self, name: &str) -> Result<RawTensor<'_>> {
        let info = self.info(name).ok_or_else(|| self.missing(name))?;
        let stored = self.file.tensor_bytes(info);
        let bytes = match self.row_map(name, info)? {
            None => Cow::Borrowed(stored),
            Some(map) => {
                let (_, row_bytes) = Self::units(info);
                let mut out = Vec::with_capacity(stored.len());
                for src in map {
                    out.extend_from_slice(&stored[src * row_bytes..(src + 1) * row_bytes]);
                }
                Cow::Owned(out)
            }
        };
        self.raw(name, info, bytes)
    }

    /// Every float and block type decodes to f32 (through [`blocks::dequantize`]).
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let raw = self.tensor(name)?;
        if raw.shape() != shape {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: shape.to_vec(),
                actual: raw.shape().to_vec(),
            });
        }
        if raw.is_empty() {
            return Ok(Vec::new()); // a zero dimension: nothing to decode
        }
        let ty = self.ggml_type(name).ok_or_else(|| self.missing(name))?;
        let mut out = vec![0.0f32; raw.len()];
        blocks::dequantize(ty, raw.bytes(), &mut out).map_err(|e| self.block_error(name, e))?;
        Ok(out)
    }

    /// Decodes only rows `rows` (each whole, since blocks span columns), keeping `cols`.
    fn matrix_block(
        &self,
        name: &str,
        shape: [usize; 2],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Array2<f32>> {
        let info = self.info(name).ok_or_else(|| self.missing(name))?;
        let actual = info.shape();
        if actual != shape {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: shape.to_vec(),
                actual,
            });
        }
        let [height, width] = shape;
        if rows.start > rows.end || rows.end > height || cols.start > cols.end || cols.end > width {
            return Err(Error::InvalidArgument(format!(
                "block rows {rows:?}, columns {cols:?} lie outside tensor `{name}` of shape {shape:?}"
            )));
        }
        let map = self.row_map(name, info)?;
        let stored = self.file.tensor_bytes(info);
        let row_bytes = info.row_bytes();
        let n_cols = cols.len();
        let mut values = vec![0.0f32; rows.len() * n_cols]; // [rows, cols]
        if n_cols > 0 {
            values
                .par_chunks_mut(n_cols)
                .zip(rows.clone().into_par_iter())
                .try_for_each_init(
                    || vec![0.0f32; width], // one decoded row [width]
                    |row, (out, r)| {
                        let src = map.as_ref().map_or(r, |m| m[r]);
                        let bytes = &stored[src * row_bytes..(src + 1) * row_bytes];
                        blocks::dequantize(info.ty, bytes, row)?;
                        out.copy_from_slice(&row[cols.clone()]);
                        Ok(())
                    },
                )
                .map_err(|e| self.block_error(name, e))?;
        }
        Array2::from_shape_vec((rows.len(), n_cols), values)
            .map_err(|e| Error::InvalidArgument(format!("tensor `{name}`: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_translate_both_ways() {
        for (gguf, hf) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.0.attn_norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            (
                "blk.12.attn_q.bias",
                "model.layers.12.self_attn.q_proj.bias",
            ),
            (
                "blk.3.ffn_down.weight",
                "model.layers.3.mlp.down_proj.weight",
            ),
        ] {
            assert_eq!(hf_name(gguf).as_deref(), Some(hf));
            assert_eq!(gguf_name(hf).as_deref(), Some(gguf));
        }
        for bad in [
            "rope_freqs.weight",
            "blk.x.attn_q.weight",
            "blk.0.attn_q.scale",
            "output",
        ] {
            assert_eq!(hf_name(bad), None, "{bad}");
        }
    }

    /// The permutation llama.cpp's converter applies (rotate-half → interleaved), written
    /// forward, is undone by `unpermuted_row`.
    #[test]
    fn unpermuting_inverts_the_converters_permutation() {
        let (n_head, d) = (3, 8);
        let rows = n_head * d;
        // Forward: file row (h, 2i + half) holds Hugging Face row (h, half · d/2 + i).
        let mut file_rows = vec![usize::MAX; rows];
        for h in 0..n_head {
            for half in 0..2 {
                for i in 0..d / 2 {
                    file_rows[h * d + 2 * i + half] = h * d + half * (d / 2) + i;
                }
            }
        }
        for r in 0..rows {
            assert_eq!(file_rows[unpermuted_row(r, rows, n_head).unwrap()], r);
        }
        assert_eq!(unpermuted_row(0, 10, 3), None, "10 rows are not 3 heads");
        // `permute_qk` moves whole units (here 2-byte rows) to the same places.
        let bytes: Vec<u8> = (0..rows).flat_map(|r| [r as u8, 100 + r as u8]).collect();
        let permuted = permute_qk(&bytes, rows, n_head).unwrap();
        for (f, unit) in permuted.chunks_exact(2).enumerate() {
            assert_eq!(unit, [file_rows[f] as u8, 100 + file_rows[f] as u8]);
        }
        assert_eq!(
            permute_qk(&bytes[1..], rows, n_head),
            None,
            "not whole units"
        );
        assert_eq!(permute_qk(&bytes, rows, 5), None, "24 rows are not 5 heads");
        assert_eq!(unpermuted_row(0, 9, 3), None, "head dim 3 is odd");
    }
}
