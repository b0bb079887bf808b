//! Every CUDA kernel against its CPU twin, on random shapes that are not multiples of the
//! kernels' tiles (rows of 16 and 64, keys of 32 and 64, warps of 32 lanes), random block tables
//! and block sizes, f32 and bf16 caches: within 1e-5, or 1e-2 for the tensor-core prefill (bf16
//! cache, head sizes 64 and 128), which rounds its inputs to bf16.
//!
//! Needs a GPU: without a CUDA driver each test prints that it skipped, unless
//! `KILN_REQUIRE_GPU=1` (set by `just gpu-check`), which turns a missing GPU into a failure.

use ch01::attention::AttentionShape;
use ch01::config::RopeScaling;
use ch01::rope::Rope;
use ch07_flash_attention::cuda::device::driver_present;
use ch07_flash_attention::cuda::{
    BatchIndex, DecodeKernel, GpuDevice, HeadShape, PrefillKernel, SeqRows, prefill_on_tensor_cores,
};
use ch07_flash_attention::naive_attention;
use cudarc::driver::CudaSlice;
use half::bf16;
use ndarray::Array2;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn device() -> Option<GpuDevice> {
    if !driver_present() {
        assert!(
            std::env::var_os("KILN_REQUIRE_GPU").is_none(),
            "KILN_REQUIRE_GPU is set but no CUDA driver can be loaded"
        );
        eprintln!("skipped: no CUDA driver on this machine");
        return None;
    }
    Some(GpuDevice::open(0).unwrap_or_else(|e| panic!("{e}")))
}

fn runner(cases: u32) -> TestRunner {
    let seed = [7u8; 32];
    TestRunner::new_with_rng(
        Config {
            cases,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed),
    )
}

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn download(dev: &GpuDevice, x: &CudaSlice<f32>) -> Vec<f32> {
    dev.stream.clone_dtoh(x).unwrap()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = tolerance * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= bound,
            "{what}[{i}]: GPU {g}, CPU {w}, |diff| {} > {bound}",
            (g - w).abs()
        );
    }
}

/// A random step: sequences with their K/V, queries and block tables over a shuffled pool.
struct Case {
    heads: HeadShape,
    block_size: usize,
    num_blocks: usize,
    seqs: Vec<SeqRows>,
    /// Per sequence: K and V of every position `[context, kv_dim]`, queries `[rows, q_dim]`.
    keys: Vec<Array2<f32>>,
    values: Vec<Array2<f32>>,
    queries: Vec<Array2<f32>>,
}

fn random_case(seed: u64, decode: bool) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (num_heads, num_kv_heads) = *[
        (1, 1),
        (4, 4),
        (6, 2),
        (9, 3),
        (8, 1),
        (12, 4),
        (8, 2),
        (8, 4),
    ]
    .choose(&mut rng)
    .unwrap();
    let head_dim = *[24, 64, 66, 128].choose(&mut rng).unwrap();
    let heads = HeadShape {
        num_heads,
        num_kv_heads,
        head_dim,
    };
    random_case_shaped(&mut rng, heads, decode)
}

/// How long a random case's sequences are: contexts of `min_context` to `max_context`
/// positions, of which up to `max_rows` are new (prefill) rows.
#[derive(Clone, Copy)]
struct Lengths {
    min_context: usize,
    max_context: usize,
    max_rows: usize,
}

/// A random batch of sequences (block size, lengths, block tables, values) for `heads`, of up
/// to 300 positions each.
fn random_case_shaped(rng: &mut ChaCha8Rng, heads: HeadShape, decode: bool) -> Case {
    let short = Lengths {
        min_context: 1,
        max_context: 300,
        max_rows: 300,
    };
    random_case_sized(rng, heads, decode, short)
}

/// [`random_case_shaped`] with sequences of `lengths`.
fn random_case_sized(
    rng: &mut ChaCha8Rng,
    heads: HeadShape,
    decode: bool,
    lengths: Lengths,
) -> Case {
    let block_size = *[1, 5, 16, 17].choose(rng).unwrap();
    let num_seqs = rng.random_range(1..=4);
    let mut lens: Vec<(usize, usize)> = vec![];
    for _ in 0..num_seqs {
        let context: usize = rng.random_range(lengths.min_context..=lengths.max_context);
        let rows = if decode {
            1
        } else {
            rng.random_range(1..=context.min(lengths.max_rows))
        };
        lens.push((context - rows, rows));
    }
    let needed: usize = lens.iter().map(|(p, r)| (p + r).div_ceil(block_size)).sum();
    let num_blocks = needed + rng.random_range(0..4);
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(rng);
    let mut ids = ids.into_iter();
    let (mut seqs, mut keys, mut values, mut queries) = (vec![], vec![], vec![], vec![]);
    for (start_pos, rows) in lens {
        let context = start_pos + rows;
        let block_table = ids.by_ref().take(context.div_ceil(block_size)).collect();
        seqs.push(SeqRows {
            start_pos,
            rows,
            block_table,
        });
        let kv = heads.kv_dim();
        keys.push(Array2::from_shape_vec((context, kv), random(rng, context * kv)).unwrap());
        values.push(Array2::from_shape_vec((context, kv), random(rng, context * kv)).unwrap());
        let q = heads.q_dim();
        queries.push(Array2::from_shape_vec((rows, q), random(rng, rows * q)).unwrap());
    }
    Case {
        heads,
        block_size,
        num_blocks,
        seqs,
        keys,
        values,
        queries,
    }
}

impl Case {
    /// The host pool with every position of every sequence in its slot, and the flattened q.
    fn host_pool(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let kv = self.heads.kv_dim();
        let mut k_pool = vec![0.0; self.num_blocks * self.block_size * kv];
        let mut v_pool = k_pool.clone();
        let mut q = vec![];
        for (i, seq) in self.seqs.iter().enumerate() {
            for pos in 0..seq.start_pos + seq.rows {
                let slot = seq.block_table[pos / self.block_size] as usize * self.block_size
                    + pos % self.block_size;
                k_pool[slot * kv..][..kv]
                    .copy_from_slice(self.keys[i].row(pos).as_slice().unwrap());
                v_pool[slot * kv..][..kv]
                    .copy_from_slice(self.values[i].row(pos).as_slice().unwrap());
            }
            q.extend(self.queries[i].iter());
        }
        (q, k_pool, v_pool)
    }

    /// Chapter 1's naive attention, sequence by sequence, over K/V rounded by `round`.
    fn expected(&self, round: impl Fn(f32) -> f32) -> Vec<f32> {
        let shape = AttentionShape {
            num_heads: self.heads.num_heads,
            num_kv_heads: self.heads.num_kv_heads,
            head_dim: self.heads.head_dim,
        };
        let mut out = vec![];
        for i in 0..self.seqs.len() {
            let (k, v) = (self.keys[i].mapv(&round), self.values[i].mapv(&round));
            let o = naive_attention(self.queries[i].view(), k.view(), v.view(), shape).unwrap();
            out.extend(o.iter());
        }
        out
    }
}

/// Which attention kernel a check runs.
#[derive(Clone, Copy, Debug)]
enum Attention {
    /// `flash_prefill`, on this tensor-core kernel where tensor cores apply.
    Prefill(PrefillKernel),
    /// Split-K decode with partitions of this many keys.
    Decode(usize, DecodeKernel),
}

fn check_attention(dev: &GpuDevice, case: &Case, cache_bf16: bool, attention: Attention) {
    let (q, k_pool, v_pool) = case.host_pool();
    let batch = dev
        .upload_batch(&case.seqs, case.block_size, case.num_blocks)
        .unwrap();
    let q_dev = dev.stream.clone_htod(&q).unwrap();
    let mut out = dev.stream.alloc_zeros::<f32>(q.len()).unwrap();
    let tensor_cores = cache_bf16 && prefill_on_tensor_cores::<bf16>(case.heads);
    let run = |out: &mut CudaSlice<f32>| {
        if cache_bf16 {
            let to_bf16 = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
            let k = dev.stream.clone_htod(&to_bf16(&k_pool)).unwrap();
            let v = dev.stream.clone_htod(&to_bf16(&v_pool)).unwrap();
            match attention {
                Attention::Decode(p, kernel) => {
                    dev.paged_decode_with(kernel, &batch, case.heads, p, &q_dev, &k, &v, out)
                }
                Attention::Prefill(kernel) if tensor_cores => {
                    dev.flash_prefill_tc(kernel, &batch, case.heads, &q_dev, &k, &v, out)
                }
                Attention::Prefill(_) => dev.flash_prefill(&batch, case.heads, &q_dev, &k, &v, out),
            }
        } else {
            let k = dev.stream.clone_htod(&k_pool).unwrap();
            let v = dev.stream.clone_htod(&v_pool).unwrap();
            match attention {
                Attention::Decode(p, kernel) => {
                    dev.paged_decode_with(kernel, &batch, case.heads, p, &q_dev, &k, &v, out)
                }
                Attention::Prefill(_) => dev.flash_prefill(&batch, case.heads, &q_dev, &k, &v, out),
            }
        }
        .unwrap()
    };
    run(&mut out);
    let round = |x: f32| {
        if cache_bf16 {
            bf16::from_f32(x).to_f32()
        } else {
            x
        }
    };
    let what = format!(
        "{} {:?} block {} {} cache, {} seqs",
        match attention {
            Attention::Decode(p, kernel) => format!("paged_decode {kernel:?}, partitions of {p}"),
            Attention::Prefill(kernel) if tensor_cores => format!("flash_prefill_tc {kernel:?}"),
            Attention::Prefill(_) => "flash_prefill".to_string(),
        },
        case.heads,
        case.block_size,
        if cache_bf16 { "bf16" } else { "f32" },
        case.seqs.len()
    );
    // The tensor-core prefill rounds q and the softmax weights to bf16 (relative error 2⁻⁹ each);
    // with |q|, |k|, |v| < 1 an output, a weighted mean of values, moves by well under 1e-2.
    let on_tensor_cores = matches!(attention, Attention::Prefill(_)) && tensor_cores;
    let tolerance = if on_tensor_cores { 1e-2 } else { 1e-5 };
    assert_close(
        &what,
        &download(dev, &out),
        &case.expected(round),
        tolerance,
    );
}

#[test]
fn flash_prefill_equals_naive_attention() {
    let Some(dev) = device() else { return };
    runner(48)
        .run(&(any::<u64>(), any::<bool>()), |(seed, bf16_cache)| {
            // Both tensor-core kernels where tensor cores apply (the f32 kernel, once, where not).
            let case = random_case(seed, false);
            for kernel in PrefillKernel::ALL {
                check_attention(&dev, &case, bf16_cache, Attention::Prefill(kernel));
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn paged_decode_equals_naive_attention() {
    let Some(dev) = device() else { return };
    runner(48)
        .run(
            &(
                any::<u64>(),
                any::<bool>(),
                prop::sample::select(vec![7usize, 64, 100, 256]),
            ),
            |(seed, bf16_cache, part)| {
                let case = random_case(seed, true);
                for kernel in [DecodeKernel::KeyPerThread, DecodeKernel::LaneGroups] {
                    if kernel.takes(case.heads) {
                        check_attention(&dev, &case, bf16_cache, Attention::Decode(part, kernel));
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn every_lane_group_decode_instance_equals_naive_attention() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for head_dim in [64, 128] {
        for group in [1, 2, 4, 8] {
            let num_kv_heads = rng.random_range(1..=3);
            let heads = HeadShape {
                num_heads: group * num_kv_heads,
                num_kv_heads,
                head_dim,
            };
            assert!(DecodeKernel::LaneGroups.takes(heads));
            let case = random_case_shaped(&mut rng, heads, true);
            for bf16_cache in [false, true] {
                for part in [7, 256] {
                    let decode = Attention::Decode(part, DecodeKernel::LaneGroups);
                    check_attention(&dev, &case, bf16_cache, decode);
                }
            }
        }
    }
}

/// Long contexts (3,000 to 5,000 positions: many K/V tiles and split-K partitions): the prefill
/// kernels (the new rows at the end of a long cached prefix; both tensor-core kernels with a
/// bf16 cache, the CUDA-core one with f32) and both decode kernels against naive attention, at
/// the head sizes of the tensor-core and lane-group instances.
#[test]
fn attention_over_long_contexts_equals_naive_attention() {
    let Some(dev) = device() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    let long = Lengths {
        min_context: 3000,
        max_context: 5000,
        max_rows: 160,
    };
    for head_dim in [64, 128] {
        let heads = HeadShape {
            num_heads: 8,
            num_kv_heads: 2,
            head_dim,
        };
        for bf16_cache in [false, true] {
            let prefill = random_case_sized(&mut rng, heads, false, long);
            // With an f32 cache every choice runs the one CUDA-core kernel: once is enough.
            let kernels = if bf16_cache {
                &PrefillKernel::ALL[..]
            } else {
                &PrefillKernel::ALL[..1]
            };
            for &kernel in kernels {
                check_attention(&dev, &prefill, bf16_cache, Attention::Prefill(kernel));
            }
            let decode = random_case_sized(&mut rng, heads, true, long);
            for kernel in [DecodeKernel::KeyPerThread, DecodeKernel::LaneGroups] {
                check_attention(&dev, &decode, bf16_cache, Attention::Decode(256, kernel));
            }
        }
    }
}

/// A step's arrays copied into the buffer a larger step left: the views read this step's.
#[test]
fn a_kept_index_buffer_takes_the_next_steps_arrays() {
    let Some(dev) = device() else { return };
    let seq = |start_pos, rows, blocks: &[u32]| SeqRows {
        start_pos,
        rows,
        block_table: blocks.to_vec(),
    };
    let mut large = BatchIndex::new(&[seq(0, 40, &[3, 1, 4]), seq(9, 7, &[0, 2])], 16, 5).unwrap();
    large.push_ids(&[7; 47], 8).unwrap();
    let kept = dev.upload(large, None).unwrap().into_buffer();
    let kept_len = kept.len();
    let mut small = BatchIndex::new(&[seq(20, 1, &[2, 4]), seq(5, 1, &[1])], 16, 5).unwrap();
    let tokens = small.push_ids(&[11, 12], 13).unwrap();
    let batch = dev.upload(small, Some(kept)).unwrap();
    assert_eq!(dev.stream.clone_dtoh(&batch.positions()).unwrap(), [20, 5]);
    let ids = batch.ids(tokens);
    assert_eq!(dev.stream.clone_dtoh(ids.view()).unwrap(), [11, 12]);
    assert_eq!(ids.vocab(), 13);
    assert!(batch.all_single_rows && batch.num_rows == 2);
    assert_eq!(
        batch.into_buffer().len(),
        kept_len,
        "the kept buffer, not a new one"
    );
}

#[test]
fn kv_write_puts_each_row_in_its_slot() {
    let Some(dev) = device() else { return };
    runner(24)
        .run(&any::<u64>(), |seed| {
            let case = random_case(seed, false);
            let kv = case.heads.kv_dim();
            let batch = dev
                .upload_batch(&case.seqs, case.block_size, case.num_blocks)
                .unwrap();
            // Only the step's rows (positions start_pos..) are written.
            let (mut k_rows, mut v_rows) = (vec![], vec![]);
            let mut k_want = vec![0.0f32; case.num_blocks * case.block_size * kv];
            let mut v_want = k_want.clone();
            for (i, seq) in case.seqs.iter().enumerate() {
                for pos in seq.start_pos..seq.start_pos + seq.rows {
                    let slot = seq.block_table[pos / case.block_size] as usize * case.block_size
                        + pos % case.block_size;
                    k_rows.extend(case.keys[i].row(pos).iter());
                    v_rows.extend(case.values[i].row(pos).iter());
                    k_want[slot * kv..][..kv]
                        .copy_from_slice(case.keys[i].row(pos).as_slice().unwrap());
                    v_want[slot * kv..][..kv]
                        .copy_from_slice(case.values[i].row(pos).as_slice().unwrap());
                }
            }
            let (k, v) = (
                dev.stream.clone_htod(&k_rows).unwrap(),
                dev.stream.clone_htod(&v_rows).unwrap(),
            );
            let mut k_cache = dev.stream.alloc_zeros::<f32>(k_want.len()).unwrap();
            let mut v_cache = dev.stream.alloc_zeros::<f32>(k_want.len()).unwrap();
            dev.kv_write(&batch, &k, &v, kv, &mut k_cache, &mut v_cache)
                .unwrap();
            assert_eq!(download(&dev, &k_cache), k_want);
            assert_eq!(download(&dev, &v_cache), v_want);
            Ok(())
        })
        .unwrap();
}

#[test]
fn rope_equals_chapter_1() {
    let Some(dev) = device() else { return };
    runner(24)
        .run(
            &(
                any::<u64>(),
                prop::sample::select(vec![
                    (4usize, 2usize, 64usize),
                    (9, 3, 64),
                    (3, 1, 30),
                    (32, 8, 128),
                ]),
            ),
            |(seed, (h, kvh, d))| {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let rows = rng.random_range(1..40);
                let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..8192)).collect();
                let rope = Rope::new(d, 10_000.0, &RopeScaling::Default);
                let (mut q, mut k) = (
                    random(&mut rng, rows * h * d),
                    random(&mut rng, rows * kvh * d),
                );
                let mut q_dev = dev.stream.clone_htod(&q).unwrap();
                let mut k_dev = dev.stream.clone_htod(&k).unwrap();
                let inv_freq: Vec<f32> = rope.inv_freq().iter().map(|&f| f as f32).collect();
                let heads = HeadShape {
                    num_heads: h,
                    num_kv_heads: kvh,
                    head_dim: d,
                };
                dev.rope(
                    &mut q_dev,
                    &mut k_dev,
                    &dev.stream.clone_htod(&positions).unwrap().as_view(),
                    &dev.stream.clone_htod(&inv_freq).unwrap(),
                    heads,
                )
                .unwrap();
                for (t, &pos) in positions.iter().enumerate() {
                    rope.rotate(&mut q[t * h * d..][..h * d], pos as usize);
                    rope.rotate(&mut k[t * kvh * d..][..kvh * d], pos as usize);
                }
                assert_close("rope q", &download(&dev, &q_dev), &q, 1e-5);
                assert_close("rope k", &download(&dev, &k_dev), &k, 1e-5);
                Ok(())
            },
        )
        .unwrap();
}

/// `y = x · Wᵀ + b` by cuBLAS, for f32 weights (SGEMM) and bf16 weights (GemmEx: bf16 inputs,
/// f32 accumulation): against the product in f64 of the same values (for bf16, x and W rounded
/// to bf16 first, as the device does), within 1e-5 relative. A bf16 projection given f32 input
/// is an error.
#[test]
fn linear_equals_the_product_in_f32_and_bf16() {
    use ch02::WeightDtype;
    use ch07_flash_attention::cuda::ops::LinearInput;
    use ch07_flash_attention::cuda::weights::{DeviceLinear, DeviceMatrix};
    let Some(dev) = device() else { return };
    let blas = cudarc::cublas::CudaBlas::new(dev.stream.clone()).unwrap();
    runner(24)
        .run(&any::<u64>(), |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let (rows, in_f, out_f) = (
                rng.random_range(1..40),
                rng.random_range(1..300),
                rng.random_range(1..300),
            );
            let (x, w, b) = (
                random(&mut rng, rows * in_f),
                random(&mut rng, out_f * in_f),
                random(&mut rng, out_f),
            );
            let with_bias = rng.random_bool(0.5);
            for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
                let round = |v: &[f32]| -> Vec<f32> {
                    match dtype {
                        WeightDtype::F32 => v.to_vec(),
                        WeightDtype::Bf16 => {
                            v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect()
                        }
                    }
                };
                let (xr, wr) = (round(&x), round(&w));
                let layer = DeviceLinear {
                    weight: DeviceMatrix::upload(
                        &dev,
                        &Array2::from_shape_vec((out_f, in_f), w.clone()).unwrap(),
                        dtype,
                    )
                    .unwrap(),
                    bias: with_bias.then(|| dev.stream.clone_htod(&b).unwrap()),
                    in_features: in_f,
                    out_features: out_f,
                };
                let x_f32 = dev.stream.clone_htod(&x).unwrap();
                let mut x_bf16 = dev.stream.alloc_zeros::<bf16>(rows * in_f).unwrap();
                dev.round_to_bf16(&x_f32, &mut x_bf16).unwrap();
                let input = match dtype {
                    WeightDtype::F32 => LinearInput::F32(&x_f32),
                    WeightDtype::Bf16 => LinearInput::Bf16(&x_bf16),
                };
                let mut y = dev.stream.alloc_zeros::<f32>(rows * out_f).unwrap();
                dev.linear(&blas, input, rows, &layer, &mut y).unwrap();
                let mut want = vec![0.0f32; rows * out_f];
                for r in 0..rows {
                    for o in 0..out_f {
                        let dot: f64 = (0..in_f)
                            .map(|i| xr[r * in_f + i] as f64 * wr[o * in_f + i] as f64)
                            .sum();
                        let bias = if with_bias { b[o] as f64 } else { 0.0 };
                        want[r * out_f + o] = (dot + bias) as f32;
                    }
                }
                assert_close(
                    &format!("linear {dtype:?}"),
                    &download(&dev, &y),
                    &want,
                    1e-5,
                );
                if dtype == WeightDtype::Bf16 {
                    let wrong = dev.linear(&blas, LinearInput::F32(&x_f32), rows, &layer, &mut y);
                    assert!(wrong.is_err(), "a bf16 projection took f32 input");
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn add_rmsnorm_silu_mul_embedding_and_argmax_equal_their_definitions() {
    let Some(dev) = device() else { return };
    runner(24)
        .run(&any::<u64>(), |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let (rows, dim) = (rng.random_range(1..20), rng.random_range(1..3000));
            let (x, delta, weight) = (
                random(&mut rng, rows * dim),
                random(&mut rng, rows * dim),
                random(&mut rng, dim),
            );
            let eps = 1e-5f32;
            let mut residual = dev.stream.clone_htod(&x).unwrap();
            let mut out = dev.stream.alloc_zeros::<f32>(rows * dim).unwrap();
            let mut out_bf16 = dev.stream.alloc_zeros::<bf16>(rows * dim).unwrap();
            let delta_dev = dev.stream.clone_htod(&delta).unwrap();
            dev.add_rmsnorm(
                &mut residual,
                Some(&delta_dev),
                &dev.stream.clone_htod(&weight).unwrap(),
                eps,
                &mut out,
                Some(&mut out_bf16),
            )
            .unwrap();
            // The bf16 output is the f32 output rounded, element for element.
            let rounded_as_written = |out: &CudaSlice<f32>, out_bf16: &CudaSlice<bf16>| {
                let want: Vec<bf16> = download(&dev, out)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect();
                assert_eq!(dev.stream.clone_dtoh(out_bf16).unwrap(), want);
            };
            rounded_as_written(&out, &out_bf16);
            let mut want_residual = x.clone();
            let mut want = vec![0.0f32; rows * dim];
            for r in 0..rows {
                let row = &mut want_residual[r * dim..][..dim];
                row.iter_mut()
                    .zip(&delta[r * dim..][..dim])
                    .for_each(|(a, b)| *a += b);
                let mean_sq = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
                let inv = 1.0 / (mean_sq + eps as f64).sqrt();
                for d in 0..dim {
                    want[r * dim + d] = (row[d] as f64 * inv * weight[d] as f64) as f32;
                }
            }
            assert_close("residual", &download(&dev, &residual), &want_residual, 1e-6);
            assert_close("rmsnorm", &download(&dev, &out), &want, 1e-5);

            let gate = dev.stream.clone_htod(&x).unwrap();
            dev.silu_mul(&gate, &delta_dev, &mut out, Some(&mut out_bf16))
                .unwrap();
            rounded_as_written(&out, &out_bf16);
            let want: Vec<f32> = x
                .iter()
                .zip(&delta)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            assert_close("silu_mul", &download(&dev, &out), &want, 1e-5);

            let vocab = rows * 7 + 1;
            let table: Vec<f32> = random(&mut rng, vocab * dim);
            let tokens: Vec<u32> = (0..rows)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect();
            let table_dev = dev.stream.clone_htod(&table).unwrap();
            dev.embedding(
                &table_dev,
                dim,
                &dev.upload_tokens(&tokens, vocab).unwrap().view(),
                &mut out,
            )
            .unwrap();
            let want: Vec<f32> = tokens
                .iter()
                .flat_map(|&t| table[t as usize * dim..][..dim].to_vec())
                .collect();
            assert_eq!(download(&dev, &out), want);
            assert!(dev.upload_tokens(&[vocab as u32], vocab).is_err());

            // Argmax with ties (the first maximum wins), NaN and −∞ passed over, and a last row
            // of nothing but −∞ and NaN: the CPU sampler's argmax, u32::MAX for its None.
            let mut logits = random(&mut rng, rows * dim);
            for r in 0..rows {
                let m = rng.random_range(0..dim);
                logits[r * dim + m] = 2.0;
                logits[r * dim + rng.random_range(m..dim)] = 2.0;
                logits[r * dim + rng.random_range(0..dim)] = f32::NAN;
            }
            for (i, x) in logits[(rows - 1) * dim..].iter_mut().enumerate() {
                *x = if i % 3 == 0 {
                    f32::NAN
                } else {
                    f32::NEG_INFINITY
                };
            }
            let mut argmax = dev.stream.alloc_zeros::<u32>(rows).unwrap();
            dev.argmax_rows(&dev.stream.clone_htod(&logits).unwrap(), dim, &mut argmax)
                .unwrap();
            let want: Vec<u32> = logits
                .chunks(dim)
                .map(|row| ch01::sampler::argmax(row).unwrap_or(u32::MAX))
                .collect();
            assert_eq!(want[rows - 1], u32::MAX);
            assert_eq!(dev.stream.clone_dtoh(&argmax).unwrap(), want);
            Ok(())
        })
        .unwrap();
}
