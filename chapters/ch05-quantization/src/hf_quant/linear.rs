//! [`GroupLinear`]: a GPTQ or AWQ layer on part 1's integer kernels, and [`HfQuantLoader`], the
//! [`LinearLoader`] that reads the layouts of [`super::gptq_format`] and [`super::awq_format`].
//!
//! # Repacking, and why it is exact (or nearly)
//!
//! A group of `gs` columns shares one `(scale, zero)` per row, so every block of 32 consecutive
//! columns inside a group does too. Such a block *is* a Q4_0 block when `zero = 8`
//! (`x = d · (q − 8)`, `d = scale`, both f16: **exact**), and a Q4_1 block otherwise
//! (`x = d · q + m`, `d = scale`, `m = −scale · zero` rounded to f16: off by at most
//! `2⁻¹¹ · |scale · zero|`, a 256th of a step for `zero ≤ 8`). The 4-bit codes are copied as they
//! are. Every block of a group has the same scale, so the blocks are stored **grouped**
//! ([`QuantMatrix::grouped`]): one scale (and offset) per run of up to 8 blocks that one group
//! holds, on the same kernels with the same results. A 4-bit g128 GPTQ layer over SmolLM2's 576
//! inputs (groups of 128, 128, 128, 128, 64) shares a scale per 64 columns: 4.25 bits per
//! weight, against Q4_0's 4.5; an AWQ g64 layer with zero points, 4.5 (Q4_1's own is 5).
//!
//! With act-order a group's columns are scattered. Sorting the columns by `g_idx` (stably)
//! makes every group contiguous again; the layer stores its weights in that order and permutes
//! each input row the same way before the kernel (one gather of `in` floats per token, what
//! vLLM's GPTQ kernels do too). Repacking needs every run of 32 sorted columns to lie in one
//! group (group sizes and the last, shorter group all multiples of 32: SmolLM2's 576 = 4·128 +
//! 64 is); a layer where they do not is dequantized to chapter 2's dense f32 instead, and
//! [`GroupLinear::kind`] says so.

use std::cell::RefCell;

use ch01::linear::{Linear, LinearLoader, LinearSpec};
use ch01::{TensorDtype, WeightSource};
use ch02::{FastLinear, WeightDtype};
use half::f16;
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2, s};

use super::gptq_format::Stored;
use super::{HfQuantConfig, HfQuantError, QuantMethod, awq_format, gptq_format};
use crate::format::GgmlType;
use crate::group_quant::GroupQuantized;
use crate::kernels::{GROUPS, QuantMatrix, group_bytes, header_bytes};
use crate::quant_linear::{QuantLinear, QuantLoader};

thread_local! {
    /// Each thread's buffer for permuted inputs, grown once to its largest call.
    static PERMUTED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// How a [`GroupLinear`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// Repacked to this block type (Q4_0 or Q4_1) on the integer kernels, `group` blocks of 32
    /// per stored scale.
    Blocks { ty: GgmlType, group: usize },
    /// Dequantized to dense f32 (the groups do not fall on blocks of 32).
    Dense,
}

enum Inner {
    Blocks(QuantLinear),
    Dense(FastLinear),
}

/// A 4-bit group-quantized layer (see the module doc).
pub struct GroupLinear {
    inner: Inner,
    /// `x` column `perm[k]` feeds stored column `k`; `None`: the identity.
    perm: Option<Vec<usize>>,
    rows: usize,
    cols: usize,
}

/// The stable order of the columns by group, or `None` when it is the identity.
fn group_order(q: &GroupQuantized) -> Option<Vec<usize>> {
    let mut perm: Vec<usize> = (0..q.cols()).collect();
    perm.sort_by_key(|&i| q.g_idx()[i]);
    (!perm.iter().enumerate().all(|(k, &i)| k == i)).then_some(perm)
}

// ANCHOR: repack
/// The blocks of `q` with its columns in `order`: Q4_0 when every zero is 8, else Q4_1, in
/// runs of as many blocks per stored scale as every group allows (8, 4, 2 or 1: the largest `g`
/// such that each run of `32·g` ordered columns lies in one group). `None` when a block of 32
/// would straddle two groups, or when a Q4_1 offset `−scale · zero` is past f16's range.
pub fn repack(q: &GroupQuantized, order: &[usize]) -> Option<QuantMatrix> {
    let (rows, cols) = (q.rows(), q.cols());
    let one_group = |g: usize| {
        cols.is_multiple_of(32 * g)
            && order
                .chunks_exact(32 * g)
                .all(|run| run.iter().all(|&i| q.g_idx()[i] == q.g_idx()[run[0]]))
    };
    let group = GROUPS
        .into_iter()
        .rev()
        .chain([1])
        .find(|&g| one_group(g))?;
    let ty = if q.is_symmetric() {
        GgmlType::Q4_0
    } else {
        GgmlType::Q4_1
    };
    let (header, run_bytes) = (header_bytes(ty), group_bytes(ty, group)); // d (and m), `group` blocks
    let mut bytes = vec![0u8; rows * cols / (32 * group) * run_bytes];
    for (o, row) in bytes
        .chunks_exact_mut(cols / (32 * group) * run_bytes)
        .enumerate()
    {
        for (run, columns) in row
            .chunks_exact_mut(run_bytes)
            .zip(order.chunks_exact(32 * group))
        {
            let grid = q.grid(o, columns[0]);
            run[0..2].copy_from_slice(&f16::from_f32(grid.scale).to_le_bytes());
            if ty == GgmlType::Q4_1 {
                let m = f16::from_f32(-grid.scale * f32::from(grid.zero));
                if m.is_infinite() {
                    return None; // past f16's range: the dense layer keeps it exact
                }
                run[2..4].copy_from_slice(&m.to_le_bytes());
            }
            let code = |j: usize| q.codes()[o * cols + columns[j]];
            for (k, block) in run[header..].chunks_exact_mut(16).enumerate() {
                for (j, byte) in block.iter_mut().enumerate() {
                    *byte = code(32 * k + j) | (code(32 * k + j + 16) << 4);
                }
            }
        }
    }
    Some(QuantMatrix::grouped(ty, group, rows, cols, bytes).expect("whole runs of a kernel type"))
}
// ANCHOR_END: repack

impl GroupLinear {
    /// `q` on the kernels when its groups fall on blocks of 32, else dense; `bias` `[out]`.
    pub fn new(q: &GroupQuantized, bias: Option<Array1<f32>>) -> Result<Self, HfQuantError> {
        let (rows, cols) = (q.rows(), q.cols());
        if let Some(b) = &bias
            && b.len() != rows
        {
            return Err(HfQuantError::Tensor {
                name: "bias".into(),
                expected: format!("{rows} elements"),
                found: format!("{}", b.len()),
            });
        }
        let perm = group_order(q);
        let identity: Vec<usize>;
        let order = match &perm {
            Some(p) => p.as_slice(),
            None => {
                identity = (0..cols).collect();
                &identity
            }
        };
        if let Some(blocks) = repack(q, order) {
            let layer = QuantLinear::new(blocks, bias).expect("bias length checked");
            return Ok(GroupLinear {
                inner: Inner::Blocks(layer),
                perm,
                rows,
                cols,
            });
        }
        let dense = Array2::from_shape_vec((rows, cols), q.dequantize()).expect("[out, in]");
        Ok(GroupLinear {
            inner: Inner::Dense(FastLinear::new(dense, bias, WeightDtype::F32)),
            perm: None,
            rows,
            cols,
        })
    }

    pub fn kind(&self) -> GroupKind {
        match &self.inner {
            Inner::Blocks(l) => GroupKind::Blocks {
                ty: l.ty(),
                group: l.weight().group(),
            },
            Inner::Dense(_) => GroupKind::Dense,
        }
    }

    fn inner(&self) -> &dyn Linear {
        match &self.inner {
            Inner::Blocks(l) => l,
            Inner::Dense(l) => l,
        }
    }
}

impl Linear for GroupLinear {
    fn in_features(&self) -> usize {
        self.cols
    }

    fn out_features(&self) -> usize {
        self.rows
    }

    /// The blocks (or dense weights), the bias, and the permutation (4 bytes a column).
    fn weight_bytes(&self) -> usize {
        self.inner().weight_bytes() + self.perm.as_ref().map_or(0, |p| p.len() * 4)
    }

    fn forward(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let mut y = Array2::<f32>::zeros((x.nrows(), self.rows)); // [T, out]
        self.forward_into(x, y.view_mut());
        y
    }

    /// Allocates nothing once this thread's buffers have grown (the kernel's and, with
    /// act-order, the permuted input's).
    fn forward_into(&self, x: ArrayView2<f32>, y: ArrayViewMut2<f32>) {
        let Some(perm) = &self.perm else {
            return self.inner().forward_into(x, y);
        };
        assert_eq!(x.ncols(), self.cols, "x is [T, in]");
        PERMUTED.with(|cell| {
            let mut own = Vec::new();
            let mut borrowed = cell.try_borrow_mut();
            let buffer = match &mut borrowed {
                Ok(b) => &mut **b,
                Err(_) => &mut own, // re-entered on this thread (a rayon worker)
            };
            buffer.clear();
            for row in x.rows() {
                buffer.extend(perm.iter().map(|&i| row[i])); // x[t, perm[k]]
            }
            let permuted =
                ArrayView2::from_shape((x.nrows(), self.cols), &buffer[..]).expect("[T, in]");
            self.inner().forward_into(permuted, y);
        });
    }
}

/// Loads projections from a GPTQ or AWQ checkpoint as [`GroupLinear`]; a dense weight (the
/// output head, which these checkpoints keep in f16) goes to `dense`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HfQuantLoader {
    pub config: HfQuantConfig,
    /// How dense weights load (kiln's `--model DIR2` keeps the head as part 1 would quantize
    /// it on load, see the book).
    pub dense: QuantLoader,
}

/// Little-endian bytes and shape of `name`, which must be stored as `dtype`.
fn raw<'s>(
    source: &'s dyn WeightSource,
    name: &str,
    dtype: TensorDtype,
) -> ch01::Result<(std::borrow::Cow<'s, [u8]>, Vec<usize>)> {
    let t = source.tensor(name)?;
    if t.dtype() != dtype {
        return Err(ch01::Error::Tensor {
            name: name.into(),
            location: source.location().to_path_buf(),
            message: format!("stored as {}, expected {dtype}", t.dtype()),
        });
    }
    Ok((t.bytes().to_vec().into(), t.shape().to_vec()))
}

impl HfQuantLoader {
    /// The codes of layer `name` `[out, in]` as stored in this loader's layout.
    pub fn read(
        &self,
        source: &dyn WeightSource,
        name: &str,
        out: usize,
        cols: usize,
    ) -> ch01::Result<GroupQuantized> {
        let qweight = raw(source, &format!("{name}.qweight"), TensorDtype::I32)?;
        let qzeros = raw(source, &format!("{name}.qzeros"), TensorDtype::I32)?;
        let scales = raw(source, &format!("{name}.scales"), TensorDtype::F16)?;
        let g_idx_name = format!("{name}.g_idx");
        // Act-order (`desc_act`) permutes the groups through `g_idx`: without it every column
        // would read the wrong group's scale, so it is required (a missing-tensor error).
        let g_idx = match self.config.method {
            QuantMethod::Gptq if self.config.desc_act || source.contains(&g_idx_name) => {
                Some(raw(source, &g_idx_name, TensorDtype::I32)?)
            }
            _ => None,
        };
        let stored = Stored {
            qweight: (&qweight.0, &qweight.1),
            qzeros: (&qzeros.0, &qzeros.1),
            scales: (&scales.0, &scales.1),
            g_idx: g_idx.as_ref().map(|(b, s)| (&b[..], &s[..])),
        };
        let unpacked = match self.config.method {
            QuantMethod::Gptq => {
                gptq_format::unpack(name, &stored, out, cols, self.config.group_size)
            }
            QuantMethod::Awq => awq_format::unpack(
                name,
                &stored,
                out,
                cols,
                self.config.group_size.unwrap_or(cols),
            ),
        };
        unpacked.map_err(|e| ch01::Error::Tensor {
            name: name.into(),
            location: source.location().to_path_buf(),
            message: e.to_string(),
        })
    }
}

impl LinearLoader for HfQuantLoader {
    fn build(
        &self,
        weight: Array2<f32>,
        bias: Option<Array1<f32>>,
    ) -> ch01::Result<Box<dyn Linear>> {
        self.dense.build(weight, bias)
    }

    fn load(
        &self,
        source: &dyn WeightSource,
        spec: &LinearSpec<'_>,
    ) -> ch01::Result<Box<dyn Linear>> {
        if !source.contains(&format!("{}.qweight", spec.name)) {
            return self.dense.load(source, spec);
        }
        if spec.shard.world != 1 {
            return Err(ch01::Error::InvalidArgument(format!(
                "`{}`: tensor-parallel shards of GPTQ/AWQ layers are not supported",
                spec.name
            )));
        }
        let q = self.read(source, spec.name, spec.out_features, spec.in_features)?;
        let bias = if spec.bias {
            let b = source.vector(&format!("{}.bias", spec.name), spec.out_features)?;
            Some(b.slice(s![..]).to_owned())
        } else {
            None
        };
        let layer = GroupLinear::new(&q, bias).map_err(|e| ch01::Error::Tensor {
            name: spec.name.into(),
            location: source.location().to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(Box::new(layer))
    }
}
