//! Safe launches of the kernels. Each checks, on the host, every length and index bound its
//! kernel relies on, so that no call with valid Rust values reads or writes past a device
//! buffer: token ids and slots are uploaded through types that checked them
//! ([`DeviceTokens`], [`PagedBatch`], in `batch`), and lengths are checked against the shapes
//! given.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use half::bf16;

use super::CudaError;
use super::batch::{DeviceTokens, PagedBatch};
use super::device::GpuDevice;
use super::kernel_choice::{DecodeKernel, PrefillKernel};
use super::weights::{DeviceLinear, DeviceMatrix};

/// An element type of weights or K/V on the device: f32, or bf16 for half the bytes.
pub trait DeviceScalar:
    DeviceRepr + ValidAsZeroBits + Copy + Unpin + Send + Sync + 'static
{
    /// The suffix of the kernel variant that reads this type (`kv_write_f32`, `..._bf16`).
    const SUFFIX: &'static str;
}

impl DeviceScalar for f32 {
    const SUFFIX: &'static str = "f32";
}

impl DeviceScalar for bf16 {
    const SUFFIX: &'static str = "bf16";
}

/// A projection's input `[rows, in]` in its weights' dtype: the f32 activations, or their bf16
/// rounding ([`GpuDevice::round_to_bf16`]).
#[derive(Clone, Copy)]
pub enum LinearInput<'a> {
    F32(&'a CudaSlice<f32>),
    Bf16(&'a CudaSlice<bf16>),
}

impl LinearInput<'_> {
    pub fn len(&self) -> usize {
        match self {
            LinearInput::F32(x) => x.len(),
            LinearInput::Bf16(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> ch02::WeightDtype {
        match self {
            LinearInput::F32(_) => ch02::WeightDtype::F32,
            LinearInput::Bf16(_) => ch02::WeightDtype::Bf16,
        }
    }
}

fn shape(what: impl Into<String>) -> CudaError {
    CudaError::Shape(what.into())
}

fn check_len(name: &str, actual: usize, expected: usize) -> Result<(), CudaError> {
    if actual == expected {
        Ok(())
    } else {
        Err(shape(format!(
            "{name}: {actual} elements, expected {expected}"
        )))
    }
}

fn grid_stride(count: usize) -> LaunchConfig {
    let blocks = count.div_ceil(256).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` per row: the launch of the row kernels.
fn one_block_per_row(what: &str, rows: usize, threads: u32) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (u32_arg(what, rows)?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn u32_arg(name: &str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| shape(format!("{name} = {value} does not fit in 32 bits")))
}

fn i32_arg(name: &str, value: usize) -> Result<i32, CudaError> {
    i32::try_from(value).map_err(|_| shape(format!("{name} = {value} does not fit in 32 bits")))
}

/// The largest head the attention kernels take (their per-lane registers are sized for it).
pub const HEAD_DIM_MAX: usize = 128;
/// The largest GQA group the decode kernel takes.
pub const GROUP_MAX: usize = 8;
/// The most keys in one split-K partition of the decode kernel (its scores sit in shared memory).
pub const PARTITION_MAX: usize = 256;
/// The most blocks a launch grid holds along y or z (CUDA's limit).
pub const GRID_YZ_MAX: usize = 65_535;

/// `value` as a grid's y or z extent: an error past [`GRID_YZ_MAX`], which a launch would
/// refuse with a less telling one.
fn grid_yz(name: &str, value: usize) -> Result<u32, CudaError> {
    if value > GRID_YZ_MAX {
        return Err(shape(format!(
            "{name} = {value}: a launch grid holds at most {GRID_YZ_MAX} blocks along y and z"
        )));
    }
    u32_arg(name, value)
}

/// The launch of a prefill kernel: one block of 128 threads per `rows_per_block` query rows of a
/// sequence, per head, per sequence, with `shared` bytes of dynamic shared memory.
fn prefill_grid(
    batch: &PagedBatch,
    heads: HeadShape,
    rows_per_block: usize,
    shared: u32,
) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (
            u32_arg("query tiles", batch.max_rows.div_ceil(rows_per_block))?,
            grid_yz("heads", heads.num_heads)?,
            grid_yz("sequences", batch.num_seqs)?,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: shared,
    })
}

/// Whether [`GpuDevice::flash_prefill`] runs on tensor cores for a cache of `T` and these heads:
/// a bf16 cache and a head size of 64 or 128. It rounds the queries and the softmax weights to
/// bf16 for the tensor cores, so its results agree with the f32 kernel's to about 1e-2.
pub fn prefill_on_tensor_cores<T: DeviceScalar>(heads: HeadShape) -> bool {
    T::SUFFIX == bf16::SUFFIX && PrefillKernel::HEAD_DIMS.contains(&heads.head_dim)
}

/// The attention shape of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl HeadShape {
    /// Errors: KV heads that do not divide the query heads, a head size the kernels do not
    /// take, or more query heads per KV head than the decode kernel holds.
    pub fn check(&self) -> Result<(), CudaError> {
        let HeadShape {
            num_heads,
            num_kv_heads,
            head_dim,
        } = *self;
        let Some(group) = self.group() else {
            return Err(shape(format!(
                "{num_heads} query heads cannot share {num_kv_heads} KV heads evenly"
            )));
        };
        if head_dim == 0 || head_dim > HEAD_DIM_MAX || head_dim % 2 != 0 {
            return Err(shape(format!(
                "head_dim {head_dim}: the kernels take even head dims up to {HEAD_DIM_MAX}"
            )));
        }
        if group > GROUP_MAX {
            return Err(shape(format!(
                "{group} query heads per KV head: the decode kernel takes at most {GROUP_MAX}"
            )));
        }
        Ok(())
    }

    /// Query heads per KV head (GQA's group), when the KV heads divide the query heads evenly.
    pub fn group(&self) -> Option<usize> {
        (self.num_kv_heads > 0 && self.num_heads.is_multiple_of(self.num_kv_heads))
            .then(|| self.num_heads / self.num_kv_heads)
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

impl GpuDevice {
    /// `out[t] = table[tokens[t]]`. table: `[vocab, dim]`; out: `[tokens, dim]`.
    pub fn embedding<T: DeviceScalar>(
        &self,
        table: &CudaSlice<T>,
        dim: usize,
        tokens: &DeviceTokens<'_>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        check_len("embedding table", table.len(), tokens.vocab * dim)?;
        check_len("embedding output", out.len(), tokens.len() * dim)?;
        if tokens.is_empty() {
            return Ok(());
        }
        let dim = i32_arg("dim", dim)?;
        let config = one_block_per_row("tokens", tokens.len(), 256)?;
        let function = self.function(&format!("embedding_{}", T::SUFFIX));
        let mut launch = self.stream.launch_builder(function);
        launch.arg(table).arg(&tokens.ids).arg(out).arg(&dim);
        // SAFETY: table holds vocab·dim elements and every id is below vocab (DeviceTokens);
        // out holds tokens·dim; the argument types match the kernel's signature.
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    /// [`GpuDevice::embedding`] from a table in either weight dtype.
    pub fn embed(
        &self,
        table: &DeviceMatrix,
        dim: usize,
        tokens: &DeviceTokens<'_>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        match table {
            DeviceMatrix::F32(t) => self.embedding(t, dim, tokens, out),
            DeviceMatrix::Bf16(t) => self.embedding(t, dim, tokens, out),
        }
    }

    /// `residual += delta` (when given), then `out = rmsnorm(residual) · weight`, row by row,
    /// and `out_bf16`, when given, `out` rounded to bf16 (a bf16 projection's input).
    /// residual, delta, out, out_bf16: `[rows, dim]`; weight: `[dim]`.
    pub fn add_rmsnorm(
        &self,
        residual: &mut CudaSlice<f32>,
        delta: Option<&CudaSlice<f32>>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
        out_bf16: Option<&mut CudaSlice<bf16>>,
    ) -> Result<(), CudaError> {
        let dim = weight.len();
        if dim == 0 || !residual.len().is_multiple_of(dim) {
            return Err(shape(format!(
                "residual of {} is not rows of {dim}",
                residual.len()
            )));
        }
        let rows = residual.len() / dim;
        if let Some(delta) = delta {
            check_len("delta", delta.len(), residual.len())?;
        }
        check_len("rmsnorm output", out.len(), residual.len())?;
        if let Some(rounded) = &out_bf16 {
            check_len("rmsnorm bf16 output", rounded.len(), residual.len())?;
        }
        if rows == 0 {
            return Ok(());
        }
        let dim_arg = i32_arg("dim", dim)?;
        let config = one_block_per_row("rows", rows, 256)?;
        let mut launch = self.stream.launch_builder(self.function("add_rmsnorm"));
        launch.arg(residual);
        // A null delta pointer skips the add.
        let null: u64 = 0;
        match delta {
            Some(delta) => launch.arg(delta),
            None => launch.arg(&null),
        };
        launch.arg(weight).arg(out);
        match out_bf16 {
            Some(rounded) => launch.arg(rounded),
            None => launch.arg(&null), // a null pointer: no rounding written
        };
        launch.arg(&dim_arg).arg(&eps);
        // SAFETY: every buffer holds rows·dim elements (weight dim); blockDim is a multiple of 32.
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    /// `out = silu(gate) · up`, elementwise, and `out_bf16`, when given, its bf16 rounding.
    pub fn silu_mul(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        out_bf16: Option<&mut CudaSlice<bf16>>,
    ) -> Result<(), CudaError> {
        check_len("up", up.len(), gate.len())?;
        check_len("silu_mul output", out.len(), gate.len())?;
        if let Some(rounded) = &out_bf16 {
            check_len("silu_mul bf16 output", rounded.len(), gate.len())?;
        }
        let count = gate.len() as i64;
        let mut launch = self.stream.launch_builder(self.function("silu_mul"));
        launch.arg(gate).arg(up).arg(out);
        let null: u64 = 0;
        match out_bf16 {
            Some(rounded) => launch.arg(rounded),
            None => launch.arg(&null), // a null pointer: no rounding written
        };
        launch.arg(&count);
        // SAFETY: the buffers given hold `count` elements.
        unsafe { launch.launch(grid_stride(gate.len())) }?;
        Ok(())
    }

    /// Rotates q `[rows, num_heads·head_dim]` and k `[rows, num_kv_heads·head_dim]` in place,
    /// row t at `positions[t]`; `inv_freq`: `[head_dim / 2]`.
    pub fn rope(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        positions: &CudaView<'_, u32>,
        inv_freq: &CudaSlice<f32>,
        heads: HeadShape,
    ) -> Result<(), CudaError> {
        heads.check()?;
        let rows = positions.len();
        check_len("q", q.len(), rows * heads.q_dim())?;
        check_len("k", k.len(), rows * heads.kv_dim())?;
        check_len("inv_freq", inv_freq.len(), heads.head_dim / 2)?;
        if rows == 0 {
            return Ok(());
        }
        let (h, kvh, d) = (
            i32_arg("heads", heads.num_heads)?,
            i32_arg("kv heads", heads.num_kv_heads)?,
            i32_arg("head_dim", heads.head_dim)?,
        );
        let config = one_block_per_row("rows", rows, 128)?;
        let mut launch = self.stream.launch_builder(self.function("rope"));
        launch.arg(q).arg(k).arg(positions).arg(inv_freq);
        launch.arg(&h).arg(&kvh).arg(&d);
        // SAFETY: q, k hold rows of their widths; inv_freq head_dim/2; positions any value.
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    /// Writes each row's K and V (`[rows, kv_dim]`) into its slot of one layer's caches
    /// (`[num_blocks · block_size, kv_dim]`).
    pub fn kv_write<T: DeviceScalar>(
        &self,
        batch: &PagedBatch,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        kv_dim: usize,
        k_cache: &mut CudaSlice<T>,
        v_cache: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        check_len("k", k.len(), batch.num_rows * kv_dim)?;
        check_len("v", v.len(), batch.num_rows * kv_dim)?;
        let cache = batch.num_blocks * batch.block_size * kv_dim;
        check_len("k cache", k_cache.len(), cache)?;
        check_len("v cache", v_cache.len(), cache)?;
        let kv_dim = i32_arg("kv_dim", kv_dim)?;
        let config = one_block_per_row("rows", batch.num_rows, 128)?;
        let function = self.function(&format!("kv_write_{}", T::SUFFIX));
        let slots = batch.slots();
        let mut launch = self.stream.launch_builder(function);
        launch
            .arg(k)
            .arg(v)
            .arg(&slots)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&kv_dim);
        // SAFETY: every slot is below num_blocks·block_size (PagedBatch), the caches hold
        // that many rows of kv_dim, k and v hold num_rows rows.
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    // ANCHOR: flash_prefill_launch
    /// Causal attention of every query row of the batch over its sequence's paged K/V
    /// (FlashAttention-2 tiles). q, out: `[rows, num_heads·head_dim]`. On tensor cores where
    /// [`prefill_on_tensor_cores`] says so, else on the f32 kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill<T: DeviceScalar>(
        &self,
        batch: &PagedBatch,
        heads: HeadShape,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if prefill_on_tensor_cores::<T>(heads) {
            let kernel = self.tc_prefill_kernel(heads.head_dim);
            return self.flash_prefill_tc(kernel, batch, heads, q, k_cache, v_cache, out);
        }
        self.check_attention(batch, heads, q, k_cache, v_cache, out)?;
        let config = prefill_grid(batch, heads, 16, 0)?;
        let args = self.attention_args(batch, heads)?;
        let function = self.function(&format!("flash_prefill_{}", T::SUFFIX));
        let mut launch = self.stream.launch_builder(function);
        launch.arg(q).arg(k_cache).arg(v_cache).arg(out);
        let (row_start, start_pos) = (batch.row_start(), batch.start_pos());
        let block_tables = batch.block_tables();
        launch.arg(&row_start).arg(&start_pos).arg(&block_tables);
        launch.arg(&args.max_blocks).arg(&args.block_size);
        launch
            .arg(&args.num_heads)
            .arg(&args.num_kv_heads)
            .arg(&args.head_dim);
        launch.arg(&args.scale);
        // SAFETY: check_attention and PagedBatch's invariants bound every row, slot and block
        // id; head_dim ≤ HEAD_DIM_MAX as the kernel's shared tiles require; blockDim is 128 (4
        // warps x 4 rows = BR).
        unsafe { launch.launch(config) }?;
        Ok(())
    }
    // ANCHOR_END: flash_prefill_launch

    /// The tensor-core prefill kernel [`flash_prefill`](Self::flash_prefill) runs: this
    /// device's [`prefill_kernel`](GpuDevice::prefill_kernel) where its shared memory fits the
    /// device's limit for head size `d`, else [`PrefillKernel::Rows64`] (which fits every GPU
    /// kiln runs on).
    pub fn tc_prefill_kernel(&self, d: usize) -> PrefillKernel {
        if self.prefill_kernel.shared_bytes(d) <= self.max_shared_per_block {
            self.prefill_kernel
        } else {
            PrefillKernel::Rows64
        }
    }

    /// [`Self::flash_prefill`] on tensor cores (`kernels/flash_prefill_tc.cu`), on `kernel`,
    /// where `T` and `heads` take them ([`prefill_on_tensor_cores`]) and the kernel's shared
    /// memory fits the device.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill_tc<T: DeviceScalar>(
        &self,
        kernel: PrefillKernel,
        batch: &PagedBatch,
        heads: HeadShape,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.check_attention(batch, heads, q, k_cache, v_cache, out)?;
        let d = heads.head_dim;
        let shared = kernel.shared_bytes(d);
        if !prefill_on_tensor_cores::<T>(heads) || shared > self.max_shared_per_block {
            return Err(shape(format!(
                "the tensor-core prefill takes bf16 K/V of head size 64 or 128 and {shared} \
                 bytes of shared memory a block (this GPU: {}); got {heads:?}",
                self.max_shared_per_block
            )));
        }
        let config = prefill_grid(batch, heads, kernel.query_rows(), shared)?;
        let args = self.attention_args(batch, heads)?;
        let function = self.function(&kernel.function(d));
        let mut launch = self.stream.launch_builder(function);
        launch.arg(q).arg(k_cache).arg(v_cache).arg(out);
        let (row_start, start_pos) = (batch.row_start(), batch.start_pos());
        let block_tables = batch.block_tables();
        launch.arg(&row_start).arg(&start_pos).arg(&block_tables);
        launch.arg(&args.max_blocks).arg(&args.block_size);
        launch.arg(&args.num_heads).arg(&args.num_kv_heads);
        launch.arg(&args.scale);
        // SAFETY: as flash_prefill (check_attention and PagedBatch's invariants bound every row,
        // slot and block id); T is bf16 and head_dim is the kernel's D (checked above), so every
        // K/V row holds whole 16-byte chunks at 16-byte-aligned offsets; blockDim is 128, the
        // kernel's 4 warps, of 16 or 32 rows (query_rows); the dynamic shared memory is the size
        // its tiles take for D, which the kernel was allowed when the device opened
        // (allow_tensor_core_prefill) as it is within the device's limit (checked above).
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    /// Lets each tensor-core prefill kernel take the dynamic shared memory it launches with:
    /// above 48 KiB a kernel must ask for it. Every GPU from sm_80 on gives at least 99 KiB a
    /// block, which the 64-row kernel fits; the 128-row one at head size 128 needs 102 KiB
    /// (sm_80, sm_90 and sm_100 give more; sm_86 and sm_89 do not, and run the 64-row one).
    /// Once, when the device opens.
    pub(super) fn allow_tensor_core_prefill(&self) -> Result<(), CudaError> {
        for kernel in PrefillKernel::ALL {
            for d in PrefillKernel::HEAD_DIMS {
                let shared = kernel.shared_bytes(d);
                if shared <= self.max_shared_per_block {
                    self.function(&kernel.function(d)).set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        shared as i32,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The decode kernel [`paged_decode`](Self::paged_decode) runs for `heads`: this device's
    /// [`decode_kernel`](GpuDevice::decode_kernel) where it takes them, else
    /// [`DecodeKernel::KeyPerThread`].
    pub fn decode_kernel_for(&self, heads: HeadShape) -> DecodeKernel {
        if self.decode_kernel.takes(heads) {
            self.decode_kernel
        } else {
            DecodeKernel::KeyPerThread
        }
    }

    /// Split-K decode attention: every sequence of the batch has one row, its context cut in
    /// partitions of `partition_size` keys merged by log-sum-exp. Runs this device's
    /// [`decode_kernel`](GpuDevice::decode_kernel) where it takes `heads`, else
    /// [`DecodeKernel::KeyPerThread`].
    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode<T: DeviceScalar>(
        &self,
        batch: &PagedBatch,
        heads: HeadShape,
        partition_size: usize,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let kernel = self.decode_kernel_for(heads);
        self.paged_decode_with(
            kernel,
            batch,
            heads,
            partition_size,
            q,
            k_cache,
            v_cache,
            out,
        )
    }

    /// [`paged_decode`](GpuDevice::paged_decode) on `kernel`, which must take `heads`.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode_with<T: DeviceScalar>(
        &self,
        kernel: DecodeKernel,
        batch: &PagedBatch,
        heads: HeadShape,
        partition_size: usize,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.check_attention(batch, heads, q, k_cache, v_cache, out)?;
        if !kernel.takes(heads) {
            return Err(shape(format!("{kernel:?} decode does not take {heads:?}")));
        }
        if !batch.all_single_rows || !(1..=PARTITION_MAX).contains(&partition_size) {
            return Err(shape(format!(
                "split-K decode takes one row per sequence and partitions of 1 to \
                 {PARTITION_MAX} keys (got {partition_size})"
            )));
        }
        let num_parts = batch.max_context.div_ceil(partition_size);
        let partials = batch.num_seqs * heads.num_heads * num_parts;
        let mut kept = self
            .decode_partials
            .lock()
            .map_err(|_| shape("a panic while the decode partials were held"))?;
        let (partial_o, partial_ml) = kept.at_least(self, partials, heads.head_dim)?;
        let args = self.attention_args(batch, heads)?;
        let part = i32_arg("partition size", partition_size)?;
        let config = LaunchConfig {
            grid_dim: (
                u32_arg("kv heads", heads.num_kv_heads)?,
                grid_yz("sequences", batch.num_seqs)?,
                grid_yz("split-K partitions (context / partition size)", num_parts)?,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let function = self.function(&kernel.function::<T>(heads));
        let mut launch = self.stream.launch_builder(function);
        launch.arg(q).arg(k_cache).arg(v_cache);
        let (rows, context_lens) = (batch.rows(), batch.context_lens());
        let block_tables = batch.block_tables();
        launch.arg(&rows).arg(&context_lens).arg(&block_tables);
        launch.arg(&mut *partial_o).arg(&mut *partial_ml);
        launch.arg(&args.max_blocks).arg(&args.block_size);
        launch.arg(&args.num_heads).arg(&args.num_kv_heads);
        if kernel == DecodeKernel::KeyPerThread {
            launch.arg(&args.head_dim); // the lane-group kernels are compiled for theirs
        }
        launch.arg(&part).arg(&args.scale);
        // SAFETY: as flash_prefill; the partial buffers hold at least seqs·heads·partitions
        // entries (`DecodePartials::at_least`), of which the kernels index only those;
        // the group is at most GROUP_MAX (HeadShape::check) and a partition at most
        // PARTITION_MAX keys (checked above), the sizes of the kernels' shared arrays; blockDim
        // is 128, the kernels' THREADS. A lane-group kernel is the instance compiled for this
        // head size and group (`DecodeKernel::takes`, `function`), and its 16-byte loads are
        // aligned: every row offset is a multiple of the head size, 64 or 128 elements.
        unsafe { launch.launch(config) }?;

        let parts = i32_arg("partitions", num_parts)?;
        let config = LaunchConfig {
            grid_dim: (
                u32_arg("heads", heads.num_heads)?,
                grid_yz("sequences", batch.num_seqs)?,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self
            .stream
            .launch_builder(self.function("paged_decode_merge"));
        launch
            .arg(&*partial_o)
            .arg(&*partial_ml)
            .arg(&rows)
            .arg(out);
        launch.arg(&args.num_heads).arg(&args.head_dim).arg(&parts);
        // SAFETY: the partial buffers hold the entries the first kernel wrote (above); rows are
        // below num_rows.
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    /// The index of each row's maximum (the first among equals, NaN and −∞ never chosen), or
    /// `u32::MAX` for a row whose every logit is −∞ or NaN: `ch01::sampler::argmax` of each
    /// row. logits: `[rows, vocab]`.
    pub fn argmax_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        if vocab == 0 {
            return Err(shape("an empty vocabulary"));
        }
        check_len("logits", logits.len(), out.len() * vocab)?;
        if out.is_empty() {
            return Ok(());
        }
        let vocab = i32_arg("vocab", vocab)?;
        let config = one_block_per_row("rows", out.len(), 1024)?;
        let mut launch = self.stream.launch_builder(self.function("argmax_rows"));
        launch.arg(logits).arg(out).arg(&vocab);
        // SAFETY: logits holds rows·vocab; blockDim is 1024 (32 warps, the kernel's maximum).
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    fn check_attention<T: DeviceScalar>(
        &self,
        batch: &PagedBatch,
        heads: HeadShape,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        out: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        heads.check()?;
        check_len("q", q.len(), batch.num_rows * heads.q_dim())?;
        check_len(
            "attention output",
            out.len(),
            batch.num_rows * heads.q_dim(),
        )?;
        let cache = batch.num_blocks * batch.block_size * heads.kv_dim();
        check_len("k cache", k_cache.len(), cache)?;
        check_len("v cache", v_cache.len(), cache)
    }

    fn attention_args(
        &self,
        batch: &PagedBatch,
        heads: HeadShape,
    ) -> Result<AttentionArgs, CudaError> {
        Ok(AttentionArgs {
            max_blocks: i32_arg("max blocks", batch.max_blocks)?,
            block_size: i32_arg("block size", batch.block_size)?,
            num_heads: i32_arg("heads", heads.num_heads)?,
            num_kv_heads: i32_arg("kv heads", heads.num_kv_heads)?,
            head_dim: i32_arg("head_dim", heads.head_dim)?,
            scale: 1.0 / (heads.head_dim as f32).sqrt(),
        })
    }
}

struct AttentionArgs {
    max_blocks: i32,
    block_size: i32,
    num_heads: i32,
    num_kv_heads: i32,
    head_dim: i32,
    scale: f32,
}

impl GpuDevice {
    /// `out = bf16(x)`, rounding to nearest even: the input of the bf16 projections, made once
    /// for every projection that reads `x`. x and out: the same length.
    pub fn round_to_bf16(
        &self,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        check_len("bf16 rounding output", out.len(), x.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let count = x.len() as i64;
        let mut launch = self.stream.launch_builder(self.function("cast_f32_bf16"));
        launch.arg(x).arg(out).arg(&count);
        // SAFETY: both buffers hold `count` elements.
        unsafe { launch.launch(grid_stride(x.len())) }?;
        Ok(())
    }

    /// `y = x · Wᵀ (+ bias)`: x `[rows, in]`, W `[out, in]` (row-major), y `[rows, out]` f32, by
    /// one cuBLAS GEMM: SGEMM for f32 weights; for bf16 weights GemmEx with bf16 x and W, f32
    /// accumulation and an f32 y (the tensor cores' mode). Row-major `y` is column-major
    /// `yᵀ = W · xᵀ`, so W is passed transposed. The input's dtype must be the weights'.
    pub fn linear(
        &self,
        blas: &cudarc::cublas::CudaBlas,
        x: LinearInput<'_>,
        rows: usize,
        layer: &DeviceLinear,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t};
        let (in_f, out_f) = (layer.in_features, layer.out_features);
        check_len("linear input", x.len(), rows * in_f)?;
        check_len("linear output", y.len(), rows * out_f)?;
        check_len("linear weight", layer.weight.len(), out_f * in_f)?;
        if rows == 0 {
            return Ok(());
        }
        let config = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: i32_arg("out_features", out_f)?,
            n: i32_arg("rows", rows)?,
            k: i32_arg("in_features", in_f)?,
            alpha: 1.0f32,
            lda: i32_arg("in_features", in_f)?,
            ldb: i32_arg("in_features", in_f)?,
            beta: 0.0f32,
            ldc: i32_arg("out_features", out_f)?,
        };
        match (&layer.weight, x) {
            // SAFETY: W is [out, in] (out·in elements), x [rows, in], y [rows, out], checked
            // above; the leading dimensions are the row lengths of those row-major arrays.
            (DeviceMatrix::F32(w), LinearInput::F32(x)) => {
                unsafe { blas.gemm(config, w, x, y) }.map_err(CudaError::Cublas)?
            }
            (DeviceMatrix::Bf16(w), LinearInput::Bf16(x)) => {
                self.gemm_bf16_f32(blas, config, w, x, y)?
            }
            (w, x) => {
                return Err(shape(format!(
                    "a {:?} projection given {:?} input",
                    w.dtype(),
                    x.dtype()
                )));
            }
        }
        if let Some(bias) = &layer.bias {
            check_len("bias", bias.len(), out_f)?;
            let (rows_arg, cols) = (rows as i64, i32_arg("out_features", out_f)?);
            let mut launch = self.stream.launch_builder(self.function("add_bias"));
            launch.arg(&mut *y).arg(bias).arg(&rows_arg).arg(&cols);
            // SAFETY: y holds rows·out, bias out.
            unsafe { launch.launch(grid_stride(rows * out_f)) }?;
        }
        Ok(())
    }

    /// cuBLAS GemmEx `c = aᵀ · b` (column-major, `a` transposed, `b` not, as [`GpuDevice::linear`]
    /// calls it) with bf16 `a` and `b`, an f32 `c` and f32 accumulation (cudarc's bf16 `gemm`
    /// writes a bf16 `c`). Checks that each buffer holds what `config`'s sizes and leading
    /// dimensions address.
    fn gemm_bf16_f32(
        &self,
        blas: &cudarc::cublas::CudaBlas,
        config: cudarc::cublas::GemmConfig<f32>,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        c: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::{result, sys};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let dim = |v: i32| usize::try_from(v).map_err(|_| shape(format!("GEMM size {v}")));
        let (m, n, k) = (dim(config.m)?, dim(config.n)?, dim(config.k)?);
        let (lda, ldb, ldc) = (dim(config.lda)?, dim(config.ldb)?, dim(config.ldc)?);
        let transposed_a = config.transa == sys::cublasOperation_t::CUBLAS_OP_T;
        let plain_b = config.transb == sys::cublasOperation_t::CUBLAS_OP_N;
        if !transposed_a || !plain_b || lda < k || ldb < k || ldc < m {
            return Err(shape("a bf16 GEMM other than c = aᵀ·b with packed rows"));
        }
        check_len("GEMM a", a.len(), lda * m)?;
        check_len("GEMM b", b.len(), ldb * n)?;
        check_len("GEMM c", c.len(), ldc * n)?;
        let (alpha, beta) = (config.alpha, config.beta);
        let (a, _a_in_use) = a.device_ptr(&self.stream);
        let (b, _b_in_use) = b.device_ptr(&self.stream);
        let (c, _c_in_use) = c.device_ptr_mut(&self.stream);
        // SAFETY: the three pointers are live device buffers on the handle's stream (the guards
        // above record their use) whose lengths were checked above against m, n, k and the
        // leading dimensions; alpha and beta are f32, as CUBLAS_COMPUTE_32F reads them.
        unsafe {
            result::gemm_ex(
                *blas.handle(),
                config.transa,
                config.transb,
                config.m,
                config.n,
                config.k,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                config.lda,
                b as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                config.ldb,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                config.ldc,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(CudaError::Cublas)
    }

    /// Copies block `from` to block `to` in one layer's K and V caches
    /// (`block_elems` = block_size · kv_dim elements of `T` per block).
    pub fn copy_block<T: DeviceScalar>(
        &self,
        k_cache: &mut CudaSlice<T>,
        v_cache: &mut CudaSlice<T>,
        block_elems: usize,
        from: u32,
        to: u32,
    ) -> Result<(), CudaError> {
        let blocks = k_cache.len() / block_elems.max(1);
        if block_elems == 0
            || v_cache.len() != k_cache.len()
            || from as usize >= blocks
            || to as usize >= blocks
        {
            return Err(shape(format!(
                "copy of block {from} to {to} in a pool of {blocks}"
            )));
        }
        let bytes = (block_elems * size_of::<T>()) as i64;
        let mut launch = self.stream.launch_builder(self.function("copy_block"));
        launch
            .arg(k_cache)
            .arg(v_cache)
            .arg(&from)
            .arg(&to)
            .arg(&bytes);
        // SAFETY: both blocks lie inside both caches (checked); the kernel copies bytes.
        unsafe { launch.launch(grid_stride(bytes as usize)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{GRID_YZ_MAX, grid_yz};

    #[test]
    fn a_grid_extent_past_the_y_z_limit_is_a_shape_error() {
        assert_eq!(grid_yz("sequences", GRID_YZ_MAX).unwrap(), 65_535);
        let error = grid_yz("partitions", GRID_YZ_MAX + 1)
            .unwrap_err()
            .to_string();
        assert!(error.contains("partitions = 65536"), "{error}");
    }
}
