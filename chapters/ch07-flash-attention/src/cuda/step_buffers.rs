//! The device buffers a step computes in, kept across steps: at a steady batch a decode step
//! allocates no device memory (its index arrays go into a kept buffer too, `batch`). Each is
//! re-made (zeroed) only when a step's row count changes its length;
//! every kernel and product of a step writes a buffer before it reads it, so what a previous
//! step left there is never seen.

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};

use super::CudaError;
use super::device::GpuDevice;
use super::ops::HeadShape;

/// `buffer` as it is when `keep` accepts it, else a new one of `len` elements (the old one
/// freed first).
fn kept_or_new<'a, T: DeviceRepr + ValidAsZeroBits>(
    dev: &GpuDevice,
    buffer: &'a mut Option<CudaSlice<T>>,
    len: usize,
    keep: impl Fn(&CudaSlice<T>) -> bool,
) -> Result<&'a mut CudaSlice<T>, CudaError> {
    let slice = match buffer.take() {
        Some(b) if keep(&b) => b,
        old => {
            drop(old);
            dev.stream.alloc_zeros(len)?
        }
    };
    Ok(buffer.insert(slice))
}

/// `buffer` holding exactly `len` elements: kept when it does, else newly allocated.
pub(super) fn exact<'a, T: DeviceRepr + ValidAsZeroBits>(
    dev: &GpuDevice,
    buffer: &'a mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<&'a mut CudaSlice<T>, CudaError> {
    kept_or_new(dev, buffer, len, |b| b.len() == len)
}

/// The f32 activations of a step of `rows` rows.
pub(super) struct Activations {
    pub rows: usize,
    pub residual: CudaSlice<f32>, // [rows, hidden]
    pub h: CudaSlice<f32>,        // [rows, hidden]: the normed input of a block
    pub delta: CudaSlice<f32>,    // [rows, hidden]: a block's output, before it joins the residual
    pub q: CudaSlice<f32>,        // [rows, q_dim]
    pub k: CudaSlice<f32>,        // [rows, kv_dim]
    pub v: CudaSlice<f32>,        // [rows, kv_dim]
    pub attn: CudaSlice<f32>,     // [rows, q_dim]
    pub gate: CudaSlice<f32>,     // [rows, intermediate]
    pub up: CudaSlice<f32>,       // [rows, intermediate]
    pub act: CudaSlice<f32>,      // [rows, intermediate]: silu(gate) · up
}

impl Activations {
    /// The activations for a step of `rows` rows: `kept` when it has that many, else new ones.
    pub fn for_rows<'a>(
        dev: &GpuDevice,
        kept: &'a mut Option<Activations>,
        rows: usize,
        hidden: usize,
        heads: HeadShape,
        inter: usize,
    ) -> Result<&'a mut Activations, CudaError> {
        if let Some(a) = kept.take().filter(|a| a.rows == rows) {
            return Ok(kept.insert(a));
        }
        let zeros = |len: usize| dev.stream.alloc_zeros::<f32>(len);
        Ok(kept.insert(Activations {
            rows,
            residual: zeros(rows * hidden)?,
            h: zeros(rows * hidden)?,
            delta: zeros(rows * hidden)?,
            q: zeros(rows * heads.q_dim())?,
            k: zeros(rows * heads.kv_dim())?,
            v: zeros(rows * heads.kv_dim())?,
            attn: zeros(rows * heads.q_dim())?,
            gate: zeros(rows * inter)?,
            up: zeros(rows * inter)?,
            act: zeros(rows * inter)?,
        }))
    }
}

/// The bf16 roundings of a step's projection inputs (with bf16 weights).
#[derive(Default)]
pub(super) struct RoundedInputs {
    pub hidden: Option<CudaSlice<half::bf16>>, // [rows, hidden]: q/k/v's and gate/up's input
    pub attn: Option<CudaSlice<half::bf16>>,   // [rows, q_dim]: o_proj's
    pub act: Option<CudaSlice<half::bf16>>,    // [rows, intermediate]: down_proj's
    pub head: Option<CudaSlice<half::bf16>>,   // [logit rows, hidden]: the head's
}

/// `buffer` as a step needs it: `None` without bf16 weights, else exactly `len` elements.
pub(super) fn rounded(
    dev: &GpuDevice,
    bf16_weights: bool,
    buffer: &mut Option<CudaSlice<half::bf16>>,
    len: usize,
) -> Result<(), CudaError> {
    if bf16_weights {
        exact(dev, buffer, len)?;
    } else {
        *buffer = None;
    }
    Ok(())
}

/// Where split-K decode leaves each partition's result for the merge: `o` `[seqs, heads,
/// partitions, head_dim]` and `ml` (max and sum of exponentials) `[seqs, heads, partitions, 2]`,
/// grown to the largest launch so far and never shrunk (a launch uses their first elements).
/// Launches on one stream run in order, so one launch's merge reads them before the next
/// launch's partitions write them.
#[derive(Default)]
pub(super) struct DecodePartials {
    o: Option<CudaSlice<f32>>,
    ml: Option<CudaSlice<f32>>,
}

impl DecodePartials {
    /// The two buffers, holding at least `partials` (sequences · heads · partitions) entries of
    /// `head_dim` outputs and of 2 statistics.
    pub fn at_least(
        &mut self,
        dev: &GpuDevice,
        partials: usize,
        head_dim: usize,
    ) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<f32>), CudaError> {
        let (o_len, ml_len) = (partials * head_dim, partials * 2);
        let o = kept_or_new(dev, &mut self.o, o_len, |b| b.len() >= o_len)?;
        let ml = kept_or_new(dev, &mut self.ml, ml_len, |b| b.len() >= ml_len)?;
        Ok((o, ml))
    }
}
