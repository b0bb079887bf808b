//! [`CudaExecutor`]: chapter 4's [`Executor`] on a GPU. The same step as the CPU executor, one
//! kernel per stage:
//!
//! ```text
//! upload in one copy per step: tokens, positions, row offsets, block tables, slots
//! x = embedding(tokens)                                   [n, hidden]
//! per layer:  h = add_rmsnorm(x += previous MLP output)
//!             q, k, v = cuBLAS(h · Wqᵀ), ...; rope(q, k)
//!             kv_write(k, v → slots); attention over block tables
//!               (split-K decode when every row is a decode, else FlashAttention-2 tiles)
//!             h = add_rmsnorm(x += cuBLAS(attn · Woᵀ)); silu_mul(gate, up); down
//! final norm, the logit rows gathered, cuBLAS(rows · Wheadᵀ) → host    [rows, vocab]
//! ```
//! Weights and K/V stay on the device; only the step's small arrays go up and the logit rows
//! come back. With bf16 weights each projection's input is rounded to bf16 once (by the RMSNorm
//! and SiLU·mul kernels beside their f32 outputs, and by one small kernel for the attention
//! output and the head's rows; shared by q/k/v and by gate/up) and cuBLAS multiplies bf16 by
//! bf16 into f32 on the tensor cores.

use std::collections::HashMap;
use std::marker::PhantomData;

use ch01::{LlamaConfig, WeightSource};
use ch03::KvDtype;
use ch04::executor::{Executor, ExecutorError, KvLayout, ModelSpec};
use ch04::request::RequestId;
use ch04::scheduler::{BlockOp, SchedulerOutput};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, PinnedHostSlice};
use ndarray::ArrayView2;

use super::CudaError;
use super::batch::{BatchIndex, PagedBatch, SeqRows};
use super::device::GpuDevice;
use super::ops::{DeviceScalar, HeadShape, LinearInput, prefill_on_tensor_cores};
use super::step_buffers::{self, Activations, RoundedInputs};
use super::weights::DeviceWeights;

/// Keys per split-K partition of the decode kernel.
const DECODE_PARTITION: usize = 256;

/// A KV element the executor can hold: f32, or bf16 for half the bytes.
pub trait DeviceKv: DeviceScalar {
    const DTYPE: KvDtype;
}

impl DeviceKv for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
}

impl DeviceKv for half::bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
}

/// How much device memory the K/V pool gets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// This many bytes (as many whole blocks as fit), as `--kv-cache-memory` says.
    Bytes(u64),
    /// vLLM's `--gpu-memory-utilization`: the pool takes what the weights leave of this share
    /// (0 to 1) of the device's memory, measured once they are loaded.
    DeviceShare(f64),
}

/// Rows of a step, and rows of logits, that a device share keeps memory for beside the weights
/// and the pool: a step's buffers are allocated at its first step, after the pool has taken
/// its share. kiln's defaults (`--max-num-batched-tokens` 512, `--max-num-seqs` 64) are well
/// within them; a larger step needs a smaller share.
const RESERVED_STEP_ROWS: u64 = 2048;
const RESERVED_LOGIT_ROWS: u64 = 256;

/// Device bytes a step of [`RESERVED_STEP_ROWS`] rows and [`RESERVED_LOGIT_ROWS`] rows of
/// logits needs at most: its f32 activations (`step_buffers::Activations`), the bf16
/// roundings of the projections' inputs, and the f32 logits.
fn reserved_step_bytes(config: &LlamaConfig, heads: HeadShape) -> u64 {
    let (hidden, inter, vocab) = (
        config.hidden_size as u64,
        config.intermediate_size as u64,
        config.vocab_size as u64,
    );
    let (q_dim, kv_dim) = (heads.q_dim() as u64, heads.kv_dim() as u64);
    let f32_row = 3 * hidden + 2 * q_dim + 2 * kv_dim + 3 * inter;
    let bf16_row = hidden + q_dim + inter;
    RESERVED_STEP_ROWS * (4 * f32_row + 2 * bf16_row) + RESERVED_LOGIT_ROWS * 4 * vocab
}

/// The pool's bytes under `share` of a device of `total` bytes of which `free` are free once
/// the weights are loaded: `share · total − (total − free)`, the memory in use (weights, the
/// context, other processes) counted against the share. Errors: a share outside (0, 1], or one
/// that the memory in use already exceeds.
pub fn kv_bytes_for_share(free: u64, total: u64, share: f64) -> Result<u64, CudaError> {
    if !(share > 0.0 && share <= 1.0) {
        return Err(CudaError::Shape(format!(
            "a GPU memory share of {share}: expected more than 0 and at most 1"
        )));
    }
    let used = total.saturating_sub(free);
    let allowed = (share * total as f64) as u64;
    match allowed.checked_sub(used) {
        Some(bytes) if bytes > 0 => Ok(bytes),
        _ => Err(CudaError::Shape(format!(
            "{:.2} GiB of the GPU's {:.2} GiB are in use once the weights are loaded (with \
             what a step needs kept aside), at or above the share of {share}: no memory is left \
             for K/V (raise --gpu-memory-utilization or use --dtype bf16)",
            used as f64 / f64::from(1u32 << 30),
            total as f64 / f64::from(1u32 << 30)
        ))),
    }
}

/// How many whole blocks of `block_bytes` (each `block_size` positions) `kv_memory` bytes
/// hold. Errors: none, or more than u32 slots can name (block ids and slots, `block ·
/// block_size + offset`, reach the kernels as u32).
fn blocks_in(kv_memory: u64, block_bytes: u64, block_size: usize) -> Result<usize, CudaError> {
    let num_blocks = kv_memory / block_bytes;
    if num_blocks == 0 {
        return Err(CudaError::Shape(format!(
            "a KV budget of {kv_memory} bytes holds no block of {block_bytes} bytes"
        )));
    }
    // The slot count `num_blocks · block_size` must fit in a u32 (`BatchIndex` checks the same).
    let max_blocks = u64::from(u32::MAX) / block_size as u64;
    if num_blocks > max_blocks {
        return Err(CudaError::Shape(format!(
            "{num_blocks} KV blocks of {block_size} positions are more than u32 slots can name \
             (at most {max_blocks} blocks): lower the K/V memory"
        )));
    }
    Ok(num_blocks as usize)
}

/// Runs steps on one GPU.
///
/// Invariant: every layer's `k_cache[l]`, `v_cache[l]` holds `num_blocks · block_size · kv_dim`
/// elements; `swapped` holds, per swapped-out request, per block, every layer's K then V.
pub struct CudaExecutor<K: DeviceKv = f32> {
    dev: GpuDevice,
    blas: CudaBlas,
    config: LlamaConfig,
    weights: DeviceWeights,
    heads: HeadShape,
    block_size: usize,
    num_blocks: usize,
    k_cache: Vec<CudaSlice<K>>,
    v_cache: Vec<CudaSlice<K>>,
    swapped: HashMap<RequestId, Vec<Vec<K>>>,
    logits: HostLogits,
    /// The step's buffers, kept across steps (`step_buffers`).
    activations: Option<Activations>,
    rounded: RoundedInputs,
    head_input: Option<CudaSlice<f32>>, // [logit rows, hidden]: the rows the head reads
    head_output: Option<CudaSlice<f32>>, // [logit rows, vocab]
    /// The device buffer of the last step's index arrays, which the next step copies into.
    step_index: Option<CudaSlice<u32>>,
    argmax_ids: Option<CudaSlice<u32>>, // [logit rows]: their argmaxes on the device
    /// The last step's argmaxes, when it was asked for them (`execute_argmax`).
    argmax: Vec<Option<u32>>,
    _kv: PhantomData<K>,
}

/// The last step's logit rows `[rows, vocab]` in page-locked host memory, which the GPU copies
/// into directly (a copy to pageable memory goes through a driver staging buffer; at 64 rows of
/// a 128k vocabulary a step copies 33 MB). Grown, never shrunk.
///
/// Invariant: `buffer[..rows · vocab]` holds the last step's rows, completely copied: the copy
/// writes exactly that prefix and [`HostLogits::copy_from`] waits for it. (A copy into page-locked
/// memory is truly asynchronous, and cudarc records no event for it on a context with one
/// stream, so nothing else would wait; and a copy into the whole buffer would read past the end
/// of a smaller step's logits on the device.)
struct HostLogits {
    buffer: Option<PinnedHostSlice<f32>>,
    rows: usize,
}

impl HostLogits {
    /// Copies `logits` (`rows · vocab` values on the device) into page-locked memory and waits
    /// until the copy is done.
    fn copy_from(
        &mut self,
        dev: &GpuDevice,
        logits: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), CudaError> {
        let len = logits.len();
        if self.buffer.as_ref().is_none_or(|b| b.len() < len) {
            // SAFETY: the allocation is uninitialised until the copy below, which writes its
            // first `len` elements, all that is read before the next copy (the invariant).
            // Flags 0: cached memory, fast for the host to read (write-combined memory is not).
            self.buffer = Some(unsafe { dev.context.alloc_pinned_with_flags::<f32>(len, 0) }?);
        }
        let buffer = self.buffer.as_mut().expect("allocated above");
        let prefix = &mut buffer.as_mut_slice()?[..len]; // exactly the device slice's length
        dev.stream.memcpy_dtoh(logits, prefix)?;
        dev.stream.synchronize()?;
        self.rows = rows;
        Ok(())
    }

    /// The rows of the last copy.
    fn rows(&self, vocab: usize) -> Result<ArrayView2<'_, f32>, CudaError> {
        let Some(buffer) = &self.buffer else {
            return Ok(ArrayView2::from_shape((0, vocab), &[]).expect("empty"));
        };
        let values = &buffer.as_slice()?[..self.rows * vocab];
        Ok(ArrayView2::from_shape((self.rows, vocab), values).expect("whole rows"))
    }
}

impl<K: DeviceKv> CudaExecutor<K> {
    /// Uploads the model from `source` to `dev` (projections and embedding in `weight_dtype`)
    /// and allocates as many KV blocks of `block_size` positions as `kv` gives the pool.
    pub fn new(
        dev: GpuDevice,
        config: LlamaConfig,
        source: &dyn WeightSource,
        weight_dtype: ch02::WeightDtype,
        block_size: usize,
        kv: KvBudget,
    ) -> Result<Self, CudaError> {
        // SAFETY: only tries to open the library by its candidate names.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::CublasMissing);
        }
        let heads = HeadShape {
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        };
        // An attention shape the kernels do not take fails here, before any weight is read.
        heads.check()?;
        let block_elems = block_size * heads.kv_dim();
        let block_bytes = 2 * config.num_hidden_layers * block_elems * size_of::<K>();
        if block_size == 0 || block_bytes == 0 {
            return Err(CudaError::Shape(format!(
                "KV blocks of {block_size} positions"
            )));
        }
        // The weights and cuBLAS first: a share of the device is what they leave of it, less
        // what the largest step will allocate.
        let weights = DeviceWeights::load(&dev, &config, source, weight_dtype)?;
        let blas = CudaBlas::new(dev.stream.clone()).map_err(CudaError::Cublas)?;
        let kv_memory = match kv {
            KvBudget::Bytes(bytes) => bytes,
            KvBudget::DeviceShare(share) => {
                let (free, total) = dev.context.mem_get_info()?;
                let free = (free as u64).saturating_sub(reserved_step_bytes(&config, heads));
                kv_bytes_for_share(free, total as u64, share)?
            }
        };
        let num_blocks = blocks_in(kv_memory, block_bytes as u64, block_size)?;
        let mut k_cache = Vec::with_capacity(config.num_hidden_layers);
        let mut v_cache = Vec::with_capacity(config.num_hidden_layers);
        for _ in 0..config.num_hidden_layers {
            k_cache.push(dev.stream.alloc_zeros::<K>(num_blocks * block_elems)?);
            v_cache.push(dev.stream.alloc_zeros::<K>(num_blocks * block_elems)?);
        }
        Ok(CudaExecutor {
            dev,
            blas,
            config,
            weights,
            heads,
            block_size,
            num_blocks,
            k_cache,
            v_cache,
            swapped: HashMap::new(),
            logits: HostLogits {
                buffer: None,
                rows: 0,
            },
            activations: None,
            rounded: RoundedInputs::default(),
            head_input: None,
            head_output: None,
            step_index: None,
            argmax_ids: None,
            argmax: Vec::new(),
            _kv: PhantomData,
        })
    }

    /// The attention kernels this model runs on this device, for the start-up line: the decode
    /// kernel that takes its heads, and the tensor-core prefill when its cache takes one.
    pub fn attention_kernels(&self) -> String {
        let d = self.heads.head_dim;
        let prefill = match prefill_on_tensor_cores::<K>(self.heads) {
            true => format!("{:?} on tensor cores", self.dev.tc_prefill_kernel(d)),
            false => "on CUDA cores (f32 K/V or a head size without a tensor-core kernel)".into(),
        };
        format!(
            "decode {:?}, prefill {prefill}",
            self.dev.decode_kernel_for(self.heads)
        )
    }

    /// Device bytes of the weights and of the K/V pool.
    pub fn device_bytes(&self) -> (u64, u64) {
        let kv: usize = self
            .k_cache
            .iter()
            .chain(&self.v_cache)
            .map(|c| c.len())
            .sum();
        (self.weights.bytes(), (kv * size_of::<K>()) as u64)
    }

    fn block_elems(&self) -> usize {
        self.block_size * self.heads.kv_dim()
    }

    fn apply(&mut self, op: &BlockOp) -> Result<(), CudaError> {
        let elems = self.block_elems();
        match op {
            BlockOp::Copy(copy) => {
                for (k, v) in self.k_cache.iter_mut().zip(&mut self.v_cache) {
                    self.dev.copy_block(k, v, elems, copy.src, copy.dst)?;
                }
            }
            BlockOp::SwapOut { id, blocks } => {
                let mut kept = Vec::with_capacity(blocks.len());
                for &b in blocks {
                    let range = b as usize * elems..(b as usize + 1) * elems;
                    let mut data = Vec::with_capacity(2 * elems * self.k_cache.len());
                    for (k, v) in self.k_cache.iter().zip(&self.v_cache) {
                        data.extend(self.dev.stream.clone_dtoh(&k.slice(range.clone()))?);
                        data.extend(self.dev.stream.clone_dtoh(&v.slice(range.clone()))?);
                    }
                    kept.push(data);
                }
                self.swapped.insert(*id, kept);
            }
            BlockOp::SwapIn { id, blocks } => {
                let kept = self.swapped.remove(id).unwrap_or_default();
                for (block, data) in blocks.iter().zip(&kept) {
                    let Some(b) = block else { continue };
                    let range = *b as usize * elems..(*b as usize + 1) * elems;
                    let layers = self.k_cache.iter_mut().zip(&mut self.v_cache);
                    for (l, (k, v)) in layers.enumerate() {
                        let at = 2 * l * elems;
                        let mut k_dst = k.slice_mut(range.clone());
                        self.dev
                            .stream
                            .memcpy_htod(&data[at..at + elems], &mut k_dst)?;
                        let mut v_dst = v.slice_mut(range.clone());
                        let v_src = &data[at + elems..at + 2 * elems];
                        self.dev.stream.memcpy_htod(v_src, &mut v_dst)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn run(&mut self, step: &SchedulerOutput, want: Wanted) -> Result<(), CudaError> {
        for op in &step.block_ops {
            self.apply(op)?;
        }
        for id in &step.finished {
            self.swapped.remove(id);
        }
        let vocab = self.config.vocab_size;
        self.logits.rows = 0;
        self.argmax.clear();
        if step.seqs.is_empty() {
            return Ok(());
        }
        let seqs: Vec<SeqRows> = step
            .seqs
            .iter()
            .map(|s| SeqRows {
                start_pos: s.start_pos,
                rows: s.tokens.len(),
                block_table: s.block_table.clone(),
            })
            .collect();
        let mut index = BatchIndex::new(&seqs, self.block_size, self.num_blocks)?;
        let tokens: Vec<u32> = step
            .seqs
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let tokens = index.push_ids(&tokens, vocab)?;
        // The logit rows: each sequence's last `logit_rows` rows.
        let mut wanted = vec![];
        let mut row = 0usize;
        for s in &step.seqs {
            let end = row + s.tokens.len();
            wanted.extend((end - s.logit_rows.min(s.tokens.len())..end).map(|r| r as u32));
            row = end;
        }
        let logit_rows = index.push_ids(&wanted, row)?;
        // One copy for every array of the step, into the buffer the last step copied into.
        let batch = self.dev.upload(index, self.step_index.take())?;
        let result = self.forward(&batch, tokens, logit_rows, want);
        self.step_index = Some(batch.into_buffer());
        result
    }

    /// The model over `batch`'s rows: its ids number `tokens` are the step's tokens, number
    /// `logit_rows` the rows whose logits (or their argmaxes) go to the host.
    fn forward(
        &mut self,
        batch: &PagedBatch,
        tokens: usize,
        logit_rows: usize,
        want: Wanted,
    ) -> Result<(), CudaError> {
        let dev = &self.dev;
        let vocab = self.config.vocab_size;
        let (hidden, inter) = (self.config.hidden_size, self.config.intermediate_size);
        let (heads, eps) = (self.heads, self.config.rms_norm_eps as f32);
        let (tokens, wanted) = (batch.ids(tokens), batch.ids(logit_rows));
        let positions = batch.positions();
        let n = batch.num_rows;

        // The step's buffers, kept across steps (`step_buffers`): with bf16 weights, each
        // projection input's bf16 rounding too, made once per input.
        let acts = Activations::for_rows(dev, &mut self.activations, n, hidden, heads, inter)?;
        let Activations {
            residual,
            h,
            delta,
            q,
            k,
            v,
            attn,
            gate,
            up,
            act,
            ..
        } = acts;
        let bf16_weights = self.weights.dtype == ch02::WeightDtype::Bf16;
        let rounded = &mut self.rounded;
        let (h16, attn16, act16) = (&mut rounded.hidden, &mut rounded.attn, &mut rounded.act);
        step_buffers::rounded(dev, bf16_weights, h16, n * hidden)?;
        step_buffers::rounded(dev, bf16_weights, attn16, n * heads.q_dim())?;
        step_buffers::rounded(dev, bf16_weights, act16, n * inter)?;
        dev.embed(self.weights.embedding_table(), hidden, &tokens, residual)?;

        for (l, layer) in self.weights.layers.iter().enumerate() {
            // The previous layer's MLP output joins the residual stream here (none before layer 0).
            let previous = (l > 0).then_some(&*delta);
            dev.add_rmsnorm(residual, previous, &layer.input_norm, eps, h, h16.as_mut())?;
            let x = written_input(h, h16);
            dev.linear(&self.blas, x, n, &layer.q, q)?;
            dev.linear(&self.blas, x, n, &layer.k, k)?;
            dev.linear(&self.blas, x, n, &layer.v, v)?;
            dev.rope(q, k, &positions, &self.weights.inv_freq, heads)?;
            let (k_cache, v_cache) = (&mut self.k_cache[l], &mut self.v_cache[l]);
            dev.kv_write(batch, k, v, heads.kv_dim(), k_cache, v_cache)?;
            if batch.all_single_rows {
                dev.paged_decode(batch, heads, DECODE_PARTITION, q, k_cache, v_cache, attn)?;
            } else {
                dev.flash_prefill(batch, heads, q, k_cache, v_cache, attn)?;
            }
            let x = linear_input(dev, attn, attn16)?;
            dev.linear(&self.blas, x, n, &layer.o, delta)?;
            dev.add_rmsnorm(
                residual,
                Some(delta),
                &layer.post_norm,
                eps,
                h,
                h16.as_mut(),
            )?;
            let x = written_input(h, h16);
            dev.linear(&self.blas, x, n, &layer.gate, gate)?;
            dev.linear(&self.blas, x, n, &layer.up, up)?;
            dev.silu_mul(gate, up, act, act16.as_mut())?;
            let x = written_input(act, act16);
            dev.linear(&self.blas, x, n, &layer.down, delta)?;
        }
        dev.add_rmsnorm(residual, Some(delta), &self.weights.norm, eps, h, None)?;

        // The logit rows, gathered like an embedding.
        if wanted.is_empty() {
            return Ok(());
        }
        let gathered = step_buffers::exact(dev, &mut self.head_input, wanted.len() * hidden)?;
        dev.embedding(h, hidden, &wanted, gathered)?;
        let logits = step_buffers::exact(dev, &mut self.head_output, wanted.len() * vocab)?;
        let head16 = &mut self.rounded.head;
        step_buffers::rounded(dev, bf16_weights, head16, wanted.len() * hidden)?;
        let x = linear_input(dev, gathered, head16)?;
        dev.linear(&self.blas, x, wanted.len(), &self.weights.lm_head, logits)?;
        match want {
            Wanted::Rows => self.logits.copy_from(dev, logits, wanted.len()),
            Wanted::Argmax => {
                let ids = step_buffers::exact(dev, &mut self.argmax_ids, wanted.len())?;
                dev.argmax_rows(logits, vocab, ids)?;
                let ids = dev.stream.clone_dtoh(&*ids)?;
                // u32::MAX: every logit of the row was −∞ or NaN.
                self.argmax = ids
                    .into_iter()
                    .map(|id| (id != u32::MAX).then_some(id))
                    .collect();
                Ok(())
            }
        }
    }
}

/// What a step brings back to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wanted {
    /// The logit rows (`execute`).
    Rows,
    /// Only each row's argmax (`execute_argmax`).
    Argmax,
}

// ANCHOR: linear_input
/// `x` as a projection reads it: itself when `rounded` is `None` (f32 weights), else its bf16
/// rounding, written into `rounded` (which must hold as many elements as `x`).
fn linear_input<'a>(
    dev: &GpuDevice,
    x: &'a CudaSlice<f32>,
    rounded: &'a mut Option<CudaSlice<half::bf16>>,
) -> Result<LinearInput<'a>, CudaError> {
    Ok(match rounded {
        None => LinearInput::F32(x),
        Some(r) => {
            dev.round_to_bf16(x, r)?;
            LinearInput::Bf16(r)
        }
    })
}
// ANCHOR_END: linear_input

/// `x` as a projection reads it when the kernel that wrote `x` also wrote its bf16 rounding
/// into `rounded` (RMSNorm, SiLU·mul): that rounding with bf16 weights, else `x`.
fn written_input<'a>(
    x: &'a CudaSlice<f32>,
    rounded: &'a Option<CudaSlice<half::bf16>>,
) -> LinearInput<'a> {
    match rounded {
        None => LinearInput::F32(x),
        Some(r) => LinearInput::Bf16(r),
    }
}

impl<K: DeviceKv> Executor for CudaExecutor<K> {
    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            num_layers: self.config.num_hidden_layers,
            num_kv_heads: self.heads.num_kv_heads,
            head_dim: self.heads.head_dim,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            dtype: K::DTYPE,
        }
    }

    fn model_spec(&self) -> ModelSpec {
        ModelSpec {
            vocab_size: self.config.vocab_size,
            max_model_len: self.config.max_position_embeddings,
        }
    }

    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        self.run(step, Wanted::Rows).map_err(executor_error)?;
        self.logits
            .rows(self.config.vocab_size)
            .map_err(executor_error)
    }

    /// The logit rows' argmaxes, computed on the device (`argmax_rows`): 4 bytes a row come
    /// back instead of a vocabulary of logits (512 KB a row at 128k tokens).
    fn execute_argmax(
        &mut self,
        step: &SchedulerOutput,
    ) -> Result<Vec<Option<u32>>, ExecutorError> {
        self.run(step, Wanted::Argmax).map_err(executor_error)?;
        Ok(self.argmax.clone())
    }
}

fn executor_error(e: CudaError) -> ExecutorError {
    ExecutorError(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::{blocks_in, kv_bytes_for_share};

    #[test]
    fn the_pool_holds_whole_blocks_whose_slots_fit_u32() {
        assert_eq!(blocks_in(1000, 100, 16).unwrap(), 10);
        assert_eq!(blocks_in(1099, 100, 16).unwrap(), 10);
        assert!(blocks_in(99, 100, 16).is_err());
        // Slots up to u32::MAX = 2^32 - 1 (the pool's slot count must fit u32, as BatchIndex
        // checks): 2^28 - 1 blocks of 16 positions, not one more.
        assert_eq!(blocks_in((1 << 28) - 1, 1, 16).unwrap(), (1 << 28) - 1);
        let error = blocks_in(1 << 28, 1, 16).unwrap_err().to_string();
        assert!(error.contains("more than u32 slots can name"), "{error}");
    }

    #[test]
    fn a_share_of_the_device_counts_what_is_in_use_against_it() {
        const GIB: u64 = 1 << 30;
        // 100 GiB device, 10 GiB in use: 0.9 leaves 80 GiB for K/V.
        let bytes = kv_bytes_for_share(90 * GIB, 100 * GIB, 0.9).unwrap();
        assert_eq!(bytes, 80 * GIB);
        assert_eq!(
            kv_bytes_for_share(90 * GIB, 100 * GIB, 1.0).unwrap(),
            90 * GIB
        );
        // In use already at or above the share: an error that says so.
        let error = kv_bytes_for_share(10 * GIB, 100 * GIB, 0.5)
            .unwrap_err()
            .to_string();
        assert!(error.contains("no memory is left for K/V"), "{error}");
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            assert!(
                kv_bytes_for_share(90 * GIB, 100 * GIB, bad).is_err(),
                "{bad}"
            );
        }
    }
}
