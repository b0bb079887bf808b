//! The CUDA attention kernels timed on GPU 0, for chapter 7's second page: FlashAttention-2
//! prefill (causal, K/V read through block tables; bf16 K/V on tensor cores, with 64 and 128
//! query rows a block, f32 K/V on CUDA cores) in TFLOP/s, split-K paged decode in GB/s of K/V read, and the device's own copy bandwidth beside them.
//! `fixtures/scripts/gpu_sdpa_bench.py` times torch's SDPA on the same shapes in the same run.
//!
//! `cargo run --release -p ch07-flash-attention --features cuda --example gpu_attention_speed`
//!
//! Each figure is the mean of repetitions launched back to back after one warm-up, timed on the
//! host around a stream synchronisation (the kernels run for milliseconds, so the launch and the
//! synchronisation are a small share). K/V blocks of 16 positions, each sequence's blocks
//! consecutive in the pool. Last, what ptxas gave each attention kernel: registers a thread,
//! local memory a thread (spilled registers) and static shared memory.

use std::time::Instant;

use ch07_flash_attention::cuda::{
    DecodeKernel, DeviceScalar, GpuDevice, HeadShape, KERNELS, PrefillKernel, SeqRows,
};
use cudarc::driver::CudaSlice;
use half::bf16;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const BLOCK_SIZE: usize = 16;
/// Keys per split-K partition (the executor's).
const PARTITION: usize = 256;

/// Milliseconds per call of `f`: one warm-up, then repetitions adding up to about half a second.
fn time_ms(dev: &GpuDevice, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.stream.synchronize()?;
    let start = Instant::now();
    f()?;
    dev.stream.synchronize()?;
    let once = start.elapsed().as_secs_f64();
    let reps = ((0.5 / once) as usize).clamp(1, 50);
    let start = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    dev.stream.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / reps as f64)
}

/// `n` pseudo-random values in [-1, 1) (a repeated pattern: the values do not change the time).
fn pattern(n: usize) -> Vec<f32> {
    let mut x = 0x2545_f491_u32;
    let period: Vec<f32> = (0..4093)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect();
    (0..n).map(|i| period[i % period.len()]).collect()
}

/// `num_seqs` sequences of `context` positions, `rows` query rows each at the end, blocks
/// consecutive in a pool of exactly their blocks.
fn sequences(num_seqs: usize, context: usize, rows: usize) -> (Vec<SeqRows>, usize) {
    let per_seq = context.div_ceil(BLOCK_SIZE);
    let seqs = (0..num_seqs)
        .map(|s| SeqRows {
            start_pos: context - rows,
            rows,
            block_table: (0..per_seq).map(|b| (s * per_seq + b) as u32).collect(),
        })
        .collect();
    (seqs, num_seqs * per_seq)
}

fn bf16_cache(dev: &GpuDevice, n: usize) -> Result<CudaSlice<bf16>> {
    let host: Vec<bf16> = pattern(n).into_iter().map(bf16::from_f32).collect();
    Ok(dev.stream.clone_htod(&host)?)
}

fn f32_cache(dev: &GpuDevice, n: usize) -> Result<CudaSlice<f32>> {
    Ok(dev.stream.clone_htod(&pattern(n))?)
}

/// Times split-K decode of 64 sequences of 4096 cached positions, 32 query heads sharing 8 KV
/// heads of 128, over K/V caches that `cache` makes, and prints its row in GB/s of K/V read
/// (and as a share of the device's copy bandwidth, `copy_gbs`).
fn decode_row<T: DeviceScalar>(
    dev: &GpuDevice,
    kernel: DecodeKernel,
    label: &str,
    copy_gbs: f64,
    cache: fn(&GpuDevice, usize) -> Result<CudaSlice<T>>,
) -> Result<()> {
    let heads = HeadShape {
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
    };
    let (num_seqs, context) = (64, 4096);
    let (seqs, num_blocks) = sequences(num_seqs, context, 1);
    let batch = dev.upload_batch(&seqs, BLOCK_SIZE, num_blocks)?;
    let kv_len = num_blocks * BLOCK_SIZE * heads.kv_dim();
    let q = f32_cache(dev, num_seqs * heads.q_dim())?;
    let mut out = dev.stream.alloc_zeros::<f32>(num_seqs * heads.q_dim())?;
    let (k, v) = (cache(dev, kv_len)?, cache(dev, kv_len)?);
    let ms = time_ms(dev, || {
        Ok(dev.paged_decode_with(kernel, &batch, heads, PARTITION, &q, &k, &v, &mut out)?)
    })?;
    let gbs = (2 * kv_len * std::mem::size_of::<T>()) as f64 / ms / 1e6;
    println!(
        "| paged_decode {label}, {} | {num_seqs} x {context} positions, 32 / 8 heads, d 128 | {ms:.3} | {gbs:.0} GB/s of K/V ({:.0}% of the copy) |",
        match kernel {
            DecodeKernel::KeyPerThread => "a thread per key",
            DecodeKernel::LaneGroups => "lane groups per row",
        },
        100.0 * gbs / copy_gbs
    );
    Ok(())
}

/// Times the causal prefill of 4 sequences of `context` tokens, 32 heads of `head_dim` (as many
/// KV heads), over K/V caches that `cache` makes, and prints its row in TFLOP/s: on the
/// tensor-core kernel `tc` where tensor cores apply.
fn prefill_row<T: DeviceScalar>(
    dev: &GpuDevice,
    label: &str,
    tc: Option<PrefillKernel>,
    head_dim: usize,
    context: usize,
    cache: fn(&GpuDevice, usize) -> Result<CudaSlice<T>>,
) -> Result<()> {
    let heads = HeadShape {
        num_heads: 32,
        num_kv_heads: 32,
        head_dim,
    };
    let num_seqs = 4;
    let (seqs, num_blocks) = sequences(num_seqs, context, context);
    let batch = dev.upload_batch(&seqs, BLOCK_SIZE, num_blocks)?;
    let kv_len = num_blocks * BLOCK_SIZE * heads.kv_dim();
    let (k, v) = (cache(dev, kv_len)?, cache(dev, kv_len)?);
    let q = f32_cache(dev, batch.num_rows * heads.q_dim())?;
    let mut out = dev
        .stream
        .alloc_zeros::<f32>(batch.num_rows * heads.q_dim())?;
    let ms = time_ms(dev, || {
        match tc {
            Some(kernel) => dev.flash_prefill_tc(kernel, &batch, heads, &q, &k, &v, &mut out)?,
            None => dev.flash_prefill(&batch, heads, &q, &k, &v, &mut out)?,
        }
        Ok(())
    })?;
    let label = match tc {
        Some(kernel) => format!("{label}, {} rows a block", kernel.query_rows()),
        None => label.to_string(),
    };
    // Causal: half of the 2 · 2 · T² · d multiply-adds of QKᵀ and PV, per head.
    let flops = 2.0 * (num_seqs * 32) as f64 * (context as f64).powi(2) * head_dim as f64;
    println!(
        "| flash_prefill {label} | {num_seqs} x 32 heads x {context} tokens, d {head_dim} | {ms:.3} | {:.1} TFLOP/s |",
        flops / ms / 1e9
    );
    Ok(())
}

fn main() -> Result<()> {
    let dev = GpuDevice::open(0)?;
    println!("{} ({:?})", dev.name, dev.arch);
    println!();
    println!("| kernel | shape | ms | figure |");
    println!("|:---|:---|---:|---:|");

    // Device-to-device copy of 1 GiB: bytes read plus bytes written per second.
    let n = 1 << 28;
    let src = dev.stream.alloc_zeros::<f32>(n)?;
    let mut dst = dev.stream.alloc_zeros::<f32>(n)?;
    let ms = time_ms(&dev, || Ok(dev.stream.memcpy_dtod(&src, &mut dst)?))?;
    let copy_gbs = 2.0 * (n * 4) as f64 / ms / 1e6;
    println!("| copy (device to device) | 1 GiB | {ms:.3} | {copy_gbs:.0} GB/s (read + written) |");
    drop((src, dst));

    // Prefill: 4 sequences of T tokens, 32 heads (as many KV heads), causal; over a bf16 cache
    // (tensor cores), then over an f32 one (the CUDA-core kernel, flash_prefill.cu) for scale.
    for head_dim in [64, 128] {
        for context in [1024, 4096, 16384] {
            for kernel in PrefillKernel::ALL {
                let label = "bf16 K/V (tensor cores)";
                prefill_row(&dev, label, Some(kernel), head_dim, context, bf16_cache)?;
            }
        }
    }
    for head_dim in [64, 128] {
        prefill_row(
            &dev,
            "f32 K/V (CUDA cores)",
            None,
            head_dim,
            4096,
            f32_cache,
        )?;
    }

    // Decode: 64 sequences of 4096 positions, 32 query heads sharing 8 KV heads of 128.
    for kernel in [DecodeKernel::KeyPerThread, DecodeKernel::LaneGroups] {
        decode_row(&dev, kernel, "bf16 K/V", copy_gbs, bf16_cache)?;
        decode_row(&dev, kernel, "f32 K/V", copy_gbs, f32_cache)?;
    }
    resources(&dev)
}

/// Registers, local memory (spills) and static shared memory of every attention kernel, as
/// ptxas compiled them for this device.
fn resources(dev: &GpuDevice) -> Result<()> {
    println!();
    println!(
        "| attention kernel | registers / thread | local bytes / thread (spills) | static shared bytes |"
    );
    println!("|:---|---:|---:|---:|");
    let attention = KERNELS
        .iter()
        .flat_map(|k| k.functions.iter())
        .filter(|f| f.contains("prefill") || f.contains("decode"));
    for &name in attention {
        let f = dev.function(name);
        println!(
            "| {name} | {} | {} | {} |",
            f.num_regs()?,
            f.local_size_bytes()?,
            f.shared_size_bytes()?
        );
    }
    Ok(())
}
