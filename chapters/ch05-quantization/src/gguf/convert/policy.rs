//! Which GGUF type each tensor of a checkpoint gets when it is written as `--type T`.
//!
//! The rules are llama.cpp's quantizer's for a uniform ("pure") mixture, plus its rule for the
//! output matrix:
//!
//! ```text
//! tensor                                   type
//! 1-D (norms, biases)                      F32
//! any tensor, T = F32 / F16 / BF16         T
//! projections (q k v o gate up down)       T
//! untied embedding                         T
//! output, and the embedding when tied      Q8_0 if T = Q8_0 or rows are not whole T blocks, else Q6_K
//! then, rows not whole blocks of the type  Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0 (Q5_0 / Q5_1
//!                                          only where `blocks` encodes them, else Q8_0);
//!                                          still not whole blocks → F16
//! ```
//!
//! "Rows" are the input dimension (the last of a Hugging Face shape): blocks run along it. So
//! SmolLM2-135M (hidden size 576 = 2.25 × 256) at Q4_K keeps its 576-wide projections in the
//! fallback type, and its tied embedding at Q8_0 for every quantized type, as the Q4_1 file
//! llama.cpp's tools made does.

use crate::blocks;
use crate::format::GgmlType;

/// The types `kiln quantize` writes.
pub const QUANTIZE_TYPES: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// What a tensor is, for the choice of its type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// A 1-D tensor: a norm's weight or a bias.
    Vector,
    /// q, k, v, o, gate, up, down.
    Projection,
    /// The token embedding; `tied` when it is also the output matrix.
    Embedding { tied: bool },
    /// `lm_head` (untied).
    Output,
}

/// `general.file_type` for a file written as `ty`: llama.cpp's `LLAMA_FTYPE` number. A uniform
/// K-quant file is filed as the "small" mixture of its type (Q4_K_S, Q5_K_S), the one closest
/// to it; `None` for types `kiln quantize` does not write.
pub fn llama_ftype(ty: GgmlType) -> Option<u32> {
    use GgmlType::*;
    Some(match ty {
        F32 => 0,
        F16 => 1,
        Q4_0 => 2,
        Q4_1 => 3,
        Q8_0 => 7,
        Q4K => 14,
        Q5K => 16,
        Q6K => 18,
        BF16 => 32,
        _ => return None,
    })
}

/// What llama.cpp's quantizer uses instead of a K-quant for rows that are not whole 256-blocks:
/// Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0 (`None` for a type with no such rule).
pub fn k_quant_fallback(ty: GgmlType) -> Option<GgmlType> {
    let or_q8_0 = |t: GgmlType| {
        if blocks::can_quantize(t) {
            t
        } else {
            GgmlType::Q8_0
        }
    };
    match ty {
        GgmlType::Q4K => Some(or_q8_0(GgmlType::Q5_0)),
        GgmlType::Q5K => Some(or_q8_0(GgmlType::Q5_1)),
        GgmlType::Q6K => Some(GgmlType::Q8_0),
        _ => None,
    }
}

/// `ty`, or what llama.cpp uses instead when rows of `cols` are not whole blocks of it.
pub fn fallback(ty: GgmlType, cols: usize) -> GgmlType {
    if ty.row_bytes(cols).is_some() {
        return ty;
    }
    let next = k_quant_fallback(ty).unwrap_or(ty);
    if next.row_bytes(cols).is_some() {
        next
    } else {
        GgmlType::F16
    }
}

/// The type of a tensor of `role` whose rows hold `cols` elements, in a file written as
/// `target` (see the module docs).
pub fn tensor_type(role: TensorRole, cols: usize, target: GgmlType) -> GgmlType {
    match role {
        TensorRole::Vector => GgmlType::F32,
        _ if !target.is_quantized() => target,
        TensorRole::Output | TensorRole::Embedding { tied: true } => {
            let ty = if target == GgmlType::Q8_0 || target.row_bytes(cols).is_none() {
                GgmlType::Q8_0
            } else {
                GgmlType::Q6K
            };
            fallback(ty, cols)
        }
        TensorRole::Projection | TensorRole::Embedding { tied: false } => fallback(target, cols),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType::*;

    #[test]
    fn smollm2_shapes_get_llama_cpps_types() {
        let q5_0 = if blocks::can_quantize(Q5_0) {
            Q5_0
        } else {
            Q8_0
        };
        let tied = TensorRole::Embedding { tied: true };
        for (target, projection_576, projection_1536, embedding) in [
            (Q8_0, Q8_0, Q8_0, Q8_0),
            (Q4_0, Q4_0, Q4_0, Q8_0),
            (Q4_1, Q4_1, Q4_1, Q8_0),
            (Q4K, q5_0, Q4K, Q8_0),
            (Q6K, Q8_0, Q6K, Q8_0),
            (F16, F16, F16, F16),
            (F32, F32, F32, F32),
        ] {
            let p = TensorRole::Projection;
            assert_eq!(tensor_type(p, 576, target), projection_576, "{target}");
            assert_eq!(tensor_type(p, 1536, target), projection_1536, "{target}");
            assert_eq!(tensor_type(tied, 576, target), embedding, "{target}");
            assert_eq!(tensor_type(TensorRole::Vector, 576, target), F32);
        }
        // Rows of 512: the output rule picks Q6_K, and an untied embedding keeps the type.
        assert_eq!(tensor_type(TensorRole::Output, 512, Q4_0), Q6K);
        assert_eq!(
            tensor_type(TensorRole::Embedding { tied: false }, 512, Q4_0),
            Q4_0
        );
        // Rows that are not even whole 32-blocks: F16.
        assert_eq!(tensor_type(TensorRole::Projection, 48, Q4_0), F16);
        assert_eq!(tensor_type(TensorRole::Projection, 48, Q4K), F16);
    }

    #[test]
    fn every_written_type_has_a_file_type_and_an_encoder() {
        for ty in QUANTIZE_TYPES {
            assert!(llama_ftype(ty).is_some(), "{ty}");
            assert!(blocks::can_quantize(ty), "{ty}");
        }
        assert_eq!(llama_ftype(Q2K), None);
    }
}
