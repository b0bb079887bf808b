//! GPTQ's tensors for one linear layer `[out, in]` (as AutoGPTQ writes them and vLLM's and
//! transformers' GPTQ kernels read them):
//!
//! ```text
//! {name}.qweight  i32 [in / 8, out]      bits 4k..4k+4 of qweight[r, o] = code of (o, 8r + k)
//! {name}.qzeros   i32 [groups, out / 8]  bits 4k..4k+4 of qzeros[g, c]  = zero(g, 8c + k) − 1
//! {name}.scales   f16 [groups, out]
//! {name}.g_idx    i32 [in]               group of each input column
//! w[o, i] = scales[g, o] · (code(o, i) − zero(g, o)),  g = g_idx[i]
//! ```
//!
//! The weights are stored transposed (input-major), eight codes of consecutive **input**
//! columns per word; the zero points eight consecutive **outputs** per word. The stored zero is
//! one less than the zero used (the original GPTQ convention, `checkpoint_format: "gptq"`), so a
//! zero of 0 cannot be written (it would read back as 16): [`pack`] refuses it. An asymmetric
//! grid gives it to any group whose smallest weight is above `−scale / 2` (weights all ≥ 0, or
//! barely below 0), so asymmetric grids are better written in AWQ's layout, which stores zeros
//! as they are.

use half::f16;

use super::{HfQuantError, finite_scales, i32s};
use crate::group_quant::GroupQuantized;

/// The tensors of one layer, each with its shape (the dtypes are fixed by the format).
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    pub qweight: (Vec<i32>, [usize; 2]),
    pub qzeros: (Vec<i32>, [usize; 2]),
    pub scales: (Vec<f16>, [usize; 2]),
    /// GPTQ only.
    pub g_idx: Option<Vec<i32>>,
}

fn layout(q: &GroupQuantized, reason: String) -> HfQuantError {
    HfQuantError::Layout {
        format: "GPTQ",
        rows: q.rows(),
        cols: q.cols(),
        reason,
    }
}

// ANCHOR: pack
/// Packs `q` in GPTQ's layout. `in` and `out` must be multiples of 8.
pub fn pack(q: &GroupQuantized) -> Result<Packed, HfQuantError> {
    let (rows, cols, groups) = (q.rows(), q.cols(), q.groups());
    if cols % 8 != 0 || rows % 8 != 0 {
        return Err(layout(q, "in and out must be multiples of 8".into()));
    }
    let mut qweight = vec![0i32; cols / 8 * rows]; // [in / 8, out]
    for o in 0..rows {
        for i in 0..cols {
            let code = u32::from(q.codes()[o * cols + i]);
            qweight[(i / 8) * rows + o] |= (code << (4 * (i % 8))) as i32;
        }
    }
    let mut qzeros = vec![0i32; groups * rows / 8]; // [groups, out / 8]
    for g in 0..groups {
        for o in 0..rows {
            let zero = q.zeros()[g * rows + o];
            if zero == 0 {
                return Err(layout(
                    q,
                    format!(
                        "zero point 0 (group {g}, row {o}) is not representable (stored − 1): \
                         write an asymmetric grid in AWQ's layout (--format awq)"
                    ),
                ));
            }
            qzeros[g * rows / 8 + o / 8] |= (u32::from(zero - 1) << (4 * (o % 8))) as i32;
        }
    }
    let scales = q.scales().iter().map(|&s| f16::from_f32(s)).collect();
    let g_idx = q.g_idx().iter().map(|&g| g as i32).collect();
    Ok(Packed {
        qweight: (qweight, [cols / 8, rows]),
        qzeros: (qzeros, [groups, rows / 8]),
        scales: (scales, [groups, rows]),
        g_idx: Some(g_idx),
    })
}
// ANCHOR_END: pack

/// The raw little-endian bytes of a layer's four tensors, and the expected shapes, checked.
pub struct Stored<'a> {
    pub qweight: (&'a [u8], &'a [usize]),
    pub qzeros: (&'a [u8], &'a [usize]),
    pub scales: (&'a [u8], &'a [usize]),
    pub g_idx: Option<(&'a [u8], &'a [usize])>,
}

pub(crate) fn expect_shape(
    name: &str,
    found: &[usize],
    expected: &[usize],
) -> Result<(), HfQuantError> {
    if found == expected {
        Ok(())
    } else {
        Err(HfQuantError::Tensor {
            name: name.into(),
            expected: format!("shape {expected:?}"),
            found: format!("shape {found:?}"),
        })
    }
}

// ANCHOR: unpack
/// The codes of a layer `[rows = out, cols = in]` stored by GPTQ (shapes checked against
/// `group_size`: `ceil(in / group_size)` groups; `None` is one group).
pub fn unpack(
    name: &str,
    stored: &Stored<'_>,
    rows: usize,
    cols: usize,
    group_size: Option<usize>,
) -> Result<GroupQuantized, HfQuantError> {
    if !cols.is_multiple_of(8) || !rows.is_multiple_of(8) {
        return Err(HfQuantError::Layout {
            format: "GPTQ",
            rows,
            cols,
            reason: "in and out must be multiples of 8".into(),
        });
    }
    let group_size = group_size.unwrap_or(cols).min(cols.max(1));
    let groups = cols.div_ceil(group_size);
    expect_shape(
        &format!("{name}.qweight"),
        stored.qweight.1,
        &[cols / 8, rows],
    )?;
    expect_shape(
        &format!("{name}.qzeros"),
        stored.qzeros.1,
        &[groups, rows / 8],
    )?;
    expect_shape(&format!("{name}.scales"), stored.scales.1, &[groups, rows])?;
    let qweight = i32s(stored.qweight.0);
    let qzeros = i32s(stored.qzeros.0);
    let mut codes = vec![0u8; rows * cols];
    for i in 0..cols {
        for o in 0..rows {
            codes[o * cols + i] =
                ((qweight[(i / 8) * rows + o] as u32 >> (4 * (i % 8))) & 0xF) as u8;
        }
    }
    let mut zeros = vec![0u8; groups * rows];
    for g in 0..groups {
        for o in 0..rows {
            let stored = (qzeros[g * rows / 8 + o / 8] as u32 >> (4 * (o % 8))) & 0xF;
            // A stored 15 stands for 16, outside the 4-bit grid: GroupQuantized::new refuses it.
            zeros[g * rows + o] = (stored + 1) as u8;
        }
    }
    let g_idx = match stored.g_idx {
        Some((bytes, shape)) => {
            expect_shape(&format!("{name}.g_idx"), shape, &[cols])?;
            let g = i32s(bytes);
            if let Some((i, bad)) = g
                .iter()
                .enumerate()
                .find(|(_, g)| !(0..groups as i32).contains(g))
            {
                return Err(HfQuantError::Tensor {
                    name: format!("{name}.g_idx"),
                    expected: format!("groups in 0..{groups}"),
                    found: format!("{bad} at {i}"),
                });
            }
            g.into_iter().map(|g| g as u32).collect()
        }
        None => crate::group_quant::sequential_g_idx(cols, group_size),
    };
    let scales = finite_scales(name, stored.scales.0)?;
    Ok(GroupQuantized::new(
        rows, cols, group_size, codes, scales, zeros, g_idx,
    )?)
}
// ANCHOR_END: unpack
