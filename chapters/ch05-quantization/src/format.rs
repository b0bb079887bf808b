//! [`GgmlType`]: the tensor types of a GGUF file, as llama.cpp numbers them.
//!
//! A block format stores each run of [`GgmlType::block_elems`] consecutive weights of a row
//! (32 for the classic formats, 256 for the K-quants' super-blocks) in
//! [`GgmlType::block_bytes`] bytes: the quantized values and the scale(s) they share.
//!
//! ```text
//! type   elements  bytes  bits/weight  layout of one block
//! F32         1       4     32.0
//! F16         1       2     16.0
//! Q8_0       32      34      8.5       d: f16 | q: 32 × i8                     x = d·q
//! Q4_0       32      18      4.5       d: f16 | q: 16 bytes, 32 × u4           x = d·(q − 8)
//! Q4_1       32      20      5.0       d, m: f16 | q: 16 bytes, 32 × u4        x = d·q + m
//! Q4_K      256     144      4.5       d, dmin: f16 | 8 × (6-bit scale, 6-bit min) | 256 × u4
//! Q5_K      256     176      5.5       d, dmin: f16 | scales, mins | high bits | 256 × u4
//! Q6_K      256     210      6.5625    256 × u4 low | 256 × u2 high | 16 × i8 scale | d: f16
//! ```

use ch01::TensorDtype;

/// A GGUF tensor type. The discriminant is the type id stored in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    BF16 = 30,
}

impl GgmlType {
    /// Every type kiln knows, for lookups by id or name.
    pub const ALL: [GgmlType; 20] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::BF16,
    ];

    /// The type with file id `id`, if kiln knows it (the IQ formats and removed ids are `None`).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// The type named `name` as llama.cpp spells it (`"Q4_K"`, `"q8_0"`: case-insensitive).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// The id stored in the file.
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// llama.cpp's name: `F32`, `Q8_0`, `Q4_K`, ...
    pub const fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            BF16 => "BF16",
        }
    }

    /// Elements per block (1 for the plain types).
    pub const fn block_elems(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        use GgmlType::*;
        match self {
            I8 => 1,
            F16 | BF16 | I16 => 2,
            F32 | I32 => 4,
            F64 | I64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
        }
    }

    /// Whether values are stored in blocks with shared scales (not one plain number each).
    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bits of storage per weight, scales included.
    pub fn bits_per_weight(self) -> f64 {
        (self.block_bytes() * 8) as f64 / self.block_elems() as f64
    }

    /// Bytes of a row of `n` elements; `None` when `n` is not a whole number of blocks or the
    /// byte count overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// How chapter 1's [`ch01::WeightSource`] carries a tensor of this type.
    pub const fn tensor_dtype(self) -> TensorDtype {
        use GgmlType::*;
        match self {
            F32 => TensorDtype::F32,
            F16 => TensorDtype::F16,
            BF16 => TensorDtype::BF16,
            I8 => TensorDtype::I8,
            I16 => TensorDtype::I16,
            I32 => TensorDtype::I32,
            I64 => TensorDtype::I64,
            F64 => TensorDtype::F64,
            quantized => TensorDtype::Blocks {
                format: quantized.id(),
                block_elems: quantized.block_elems(),
                block_bytes: quantized.block_bytes(),
            },
        }
    }

    /// The type a [`TensorDtype`] from a GGUF source stands for (`None` for other sources' types).
    pub fn from_tensor_dtype(dtype: TensorDtype) -> Option<GgmlType> {
        GgmlType::ALL
            .into_iter()
            .find(|t| t.tensor_dtype() == dtype)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::GgmlType;

    #[test]
    fn ids_names_and_dtypes_round_trip() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
            assert_eq!(GgmlType::from_tensor_dtype(t.tensor_dtype()), Some(t));
        }
        assert_eq!(
            GgmlType::from_id(4),
            None,
            "Q4_2 was removed from llama.cpp"
        );
        assert_eq!(
            GgmlType::Q4K.row_bytes(576),
            None,
            "576 is not a multiple of 256"
        );
        assert_eq!(GgmlType::Q8_0.row_bytes(576), Some(18 * 34));
        assert_eq!(GgmlType::Q6K.bits_per_weight(), 6.5625);
    }
}
