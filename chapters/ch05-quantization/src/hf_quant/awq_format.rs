//! AWQ's GEMM layout for one linear layer `[out, in]` (as AutoAWQ's `WQLinear_GEMM` writes it and
//! vLLM's and transformers' AWQ kernels read it):
//!
//! ```text
//! {name}.qweight  i32 [in, out / 8]          eight codes of consecutive outputs per word
//! {name}.qzeros   i32 [in / group, out / 8]  eight zero points of consecutive outputs per word
//! {name}.scales   f16 [in / group, out]
//! nibble k (bits 4k..4k+4) of a word holding outputs 8c..8c+8 is output 8c + ORDER[k]
//! ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
//! w[o, i] = scales[i / group, o] · (code(o, i) − zero(i / group, o))
//! ```
//!
//! Unlike GPTQ's, the weights are input-major with the codes of one input row side by side
//! across outputs, the nibbles interleaved (even outputs in the low half of the word, odd in the
//! high half, what the GEMM kernel's unpacking wants), and the zero is stored as is. There is no
//! `g_idx`: groups are consecutive, and `group` must divide `in`.

use half::f16;

use super::gptq_format::{Packed, expect_shape};
use super::{HfQuantError, finite_scales, i32s};
use crate::group_quant::{GroupQuantized, sequential_g_idx};

// ANCHOR: order
/// Which output of its group of eight each nibble of a word holds.
pub const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
// ANCHOR_END: order

/// Whether a layer `[rows = out, cols = in]` fits the layout with groups of `group` columns:
/// `out` a multiple of 8 and `group` dividing `in`. The reader checks the group size that
/// config.json records, so the writer checks that one too, not the layer's own (which
/// [`GroupQuantized::new`] narrows to `in` when it is wider).
pub fn check(rows: usize, cols: usize, group: usize) -> Result<(), HfQuantError> {
    let reason = if !rows.is_multiple_of(8) {
        format!("out_features ({rows}) must be a multiple of 8")
    } else if group == 0 || !cols.is_multiple_of(group) {
        format!("the group size {group} must divide in_features ({cols})")
    } else {
        return Ok(());
    };
    Err(HfQuantError::Layout {
        format: "AWQ",
        rows,
        cols,
        reason,
    })
}

/// Eight 4-bit values of outputs `8c..8c + 8` in one word, in [`ORDER`].
fn word(values: impl Fn(usize) -> u8) -> i32 {
    (0..8).fold(0u32, |w, k| w | (u32::from(values(ORDER[k])) << (4 * k))) as i32
}

/// Packs `q` in AWQ's GEMM layout (consecutive groups only: no act-order).
pub fn pack(q: &GroupQuantized) -> Result<Packed, HfQuantError> {
    let (rows, cols, group) = (q.rows(), q.cols(), q.group_size());
    check(rows, cols, group)?;
    if !q.is_sequential() {
        return Err(HfQuantError::Layout {
            format: "AWQ",
            rows,
            cols,
            reason: "AWQ stores consecutive groups only (no act-order)".into(),
        });
    }
    let groups = cols / group;
    let words = rows / 8;
    let mut qweight = vec![0i32; cols * words]; // [in, out / 8]
    for i in 0..cols {
        for c in 0..words {
            qweight[i * words + c] = word(|k| q.codes()[(8 * c + k) * cols + i]);
        }
    }
    let mut qzeros = vec![0i32; groups * words]; // [groups, out / 8]
    for g in 0..groups {
        for c in 0..words {
            qzeros[g * words + c] = word(|k| q.zeros()[g * rows + 8 * c + k]);
        }
    }
    let scales = q.scales().iter().map(|&s| f16::from_f32(s)).collect();
    Ok(Packed {
        qweight: (qweight, [cols, words]),
        qzeros: (qzeros, [groups, words]),
        scales: (scales, [groups, rows]),
        g_idx: None,
    })
}

/// Nibble `k` of `w` as the value of output `8c + ORDER[k]`.
fn unword(w: i32, mut put: impl FnMut(usize, u8)) {
    for (k, &o) in ORDER.iter().enumerate() {
        put(o, ((w as u32 >> (4 * k)) & 0xF) as u8);
    }
}

/// The codes of a layer `[rows = out, cols = in]` stored in AWQ's GEMM layout.
pub fn unpack(
    name: &str,
    stored: &super::gptq_format::Stored<'_>,
    rows: usize,
    cols: usize,
    group: usize,
) -> Result<GroupQuantized, HfQuantError> {
    check(rows, cols, group)?;
    let (groups, words) = (cols / group, rows / 8);
    expect_shape(&format!("{name}.qweight"), stored.qweight.1, &[cols, words])?;
    expect_shape(&format!("{name}.qzeros"), stored.qzeros.1, &[groups, words])?;
    expect_shape(&format!("{name}.scales"), stored.scales.1, &[groups, rows])?;
    let qweight = i32s(stored.qweight.0);
    let qzeros = i32s(stored.qzeros.0);
    let mut codes = vec![0u8; rows * cols];
    for i in 0..cols {
        for c in 0..words {
            unword(qweight[i * words + c], |k, v| {
                codes[(8 * c + k) * cols + i] = v
            });
        }
    }
    let mut zeros = vec![0u8; groups * rows];
    for g in 0..groups {
        for c in 0..words {
            unword(qzeros[g * words + c], |k, v| {
                zeros[g * rows + 8 * c + k] = v
            });
        }
    }
    let scales = finite_scales(name, stored.scales.0)?;
    let g_idx = sequential_g_idx(cols, group);
    Ok(GroupQuantized::new(
        rows, cols, group, codes, scales, zeros, g_idx,
    )?)
}
