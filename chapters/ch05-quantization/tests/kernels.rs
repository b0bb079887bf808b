//! The integer kernels against dequantize-then-dense, within the bound `kernels`' module doc
//! derives, computed per output; every instruction set equal to the portable one bit for bit;
//! `matmul` equal to `matvec` token by token; and the shapes a kernel refuses.
//!
//! Shapes are random: any number of output rows, any whole number of blocks per row, and token
//! counts that include 1, 5, 7 and 13.

use ch01::linear::Linear;
use ch01::testing::seeded_runner;
use ch05_quantization::blocks::q4_k::scale_min;
use ch05_quantization::kernels::{Isa, KernelError, QuantMatrix, Scratch, matmul, matvec};
use ch05_quantization::{BlockError, GgmlType, QuantLinear};
use half::f16;
use ndarray::{Array1, Array2};
use proptest::prelude::*;

use ch05_quantization::kernels::KERNEL_FORMATS as FORMATS;

/// f32's unit roundoff.
const U: f64 = 1.0 / 16_777_216.0;

/// The offset term of each decoded weight of a row (Q4_1's and Q5_1's `m`, a K-quant's `dmin · m[j]`,
/// else 0), which the bound needs.
fn offsets(ty: GgmlType, row: &[u8]) -> Vec<f64> {
    let f16_at = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let mut out = Vec::new();
    for b in row.chunks_exact(ty.block_bytes()) {
        match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 => out.extend([f16_at(b, 2).abs() as f64; 32]),
            GgmlType::Q4K | GgmlType::Q5K => {
                let (_, m) = scale_min(&b[4..16]);
                for m in m {
                    out.extend([(f16_at(b, 2) * f32::from(m)).abs() as f64; 32]);
                }
            }
            _ => out.extend(std::iter::repeat_n(0.0, ty.block_elems())),
        }
    }
    out
}

/// The activation scale `d_x` of each element: its block's `max|x| / 127`, as the kernels
/// quantize it (32 per block for the 32-element formats, 256 for the K-quants).
fn act_scales(ty: GgmlType, x: &[f32]) -> Vec<f64> {
    x.chunks_exact(ty.block_elems())
        .flat_map(|b| {
            let d = b.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            std::iter::repeat_n(d as f64, b.len())
        })
        .collect()
}

/// `(reference, bound)` of output `(t, o)`: `Σ w̃ x` in f64 over the decoded weights, and the
/// module doc's bound.
fn reference(ty: GgmlType, w: &QuantMatrix, w_f32: &[f32], x_t: &[f32], o: usize) -> (f64, f64) {
    let cols = w.cols();
    let w_o = &w_f32[o * cols..(o + 1) * cols];
    let off = offsets(ty, &w.row(o));
    let dx = act_scales(ty, x_t);
    let n_b = (cols / ty.block_elems()) as f64;
    let (mut dot, mut act, mut mag) = (0.0f64, 0.0f64, 0.0f64);
    for l in 0..cols {
        let (w, x) = (w_o[l] as f64, x_t[l] as f64);
        dot += w * x;
        act += dx[l] * (0.5 + 1.0 / 32768.0) * w.abs();
        mag += (w.abs() + off[l]) * (x.abs() + dx[l]);
    }
    (dot, act + (n_b + 13.0) * U * mag)
}

/// A format, a weight [out, in] (values to encode) and an input [T, in].
fn case() -> impl Strategy<Value = (GgmlType, usize, usize, Vec<f32>, Vec<f32>, usize)> {
    let tokens = prop_oneof![Just(1usize), Just(5), Just(7), Just(13), 1usize..16];
    (0..FORMATS.len(), 1usize..40, 1usize..5, tokens, -6i32..6)
        .prop_flat_map(|(f, out, blocks, tokens, exp)| {
            let ty = FORMATS[f];
            let blocks = if ty.block_elems() == 32 {
                3 * blocks
            } else {
                blocks
            }; // 3..15 or 1..5
            let cols = blocks * ty.block_elems();
            let scale = 2f32.powi(exp);
            (
                Just(ty),
                Just(out),
                Just(tokens),
                proptest::collection::vec(-1.0f32..1.0, out * cols),
                proptest::collection::vec(-2.0f32..2.0, tokens * cols).prop_map(move |mut x| {
                    x.iter_mut().for_each(|v| *v *= scale);
                    if x.len() > 3 {
                        x[3] *= 40.0; // an outlier: its block's scale is large
                    }
                    x
                }),
                Just(cols),
            )
        })
        .prop_map(|(ty, out, tokens, w, x, cols)| (ty, out, tokens, w, x, cols))
}

#[test]
fn kernels_equal_dequantize_then_dense_within_the_derived_bound() {
    seeded_runner(160, 52)
        .run(&case(), |(ty, out, tokens, w, x, cols)| {
            let w = QuantMatrix::quantize(ty, &w, out, cols).unwrap();
            let w_f32 = w.dequantize();
            let mut scratch = Scratch::default();
            let mut portable = vec![0.0f32; tokens * out];
            matmul(Isa::Portable, &w, &x, &mut portable, tokens, &mut scratch);
            for t in 0..tokens {
                let x_t = &x[t * cols..(t + 1) * cols];
                for o in 0..out {
                    let (expected, bound) = reference(ty, &w, &w_f32, x_t, o);
                    let actual = portable[t * out + o] as f64;
                    let err = (actual - expected).abs();
                    prop_assert!(
                        err <= bound,
                        "{ty} W [{out}, {cols}], {tokens} tokens: output [{t}, {o}] = {actual}, \
                         reference {expected}, error {err:.3e} > bound {bound:.3e} \
                         ({:.2} of it)",
                        err / bound
                    );
                }
            }
            for isa in Isa::available() {
                // matvec token by token, and matmul over all tokens, equal bit for bit.
                let mut y = vec![0.0f32; tokens * out];
                matmul(isa, &w, &x, &mut y, tokens, &mut scratch);
                for t in 0..tokens {
                    let mut y_t = vec![0.0f32; out];
                    matvec(
                        isa,
                        &w,
                        &x[t * cols..(t + 1) * cols],
                        &mut y_t,
                        &mut scratch,
                    );
                    for o in 0..out {
                        prop_assert_eq!(
                            y_t[o].to_bits(),
                            portable[t * out + o].to_bits(),
                            "{:?} matvec vs portable matmul, {} [{}, {}], output [{}, {}]",
                            isa,
                            ty,
                            out,
                            cols,
                            t,
                            o
                        );
                        prop_assert_eq!(
                            y[t * out + o].to_bits(),
                            portable[t * out + o].to_bits(),
                            "{:?} matmul vs portable, {} [{}, {}], output [{}, {}]",
                            isa,
                            ty,
                            out,
                            cols,
                            t,
                            o
                        );
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

/// One token's product splits a matrix of up to 2048 rows (chapter 2's `EVEN_SPLIT_PANELS`
/// panels) evenly across the threads, a larger one into many tasks: both ways equal the
/// portable product bit for bit, on row counts around the boundary (and the boundary itself,
/// and fewer rows than a task's 32); every output is written (they start as NaN). Three
/// threads, so that splits are uneven.
#[test]
fn one_token_products_split_evenly_or_not_give_the_same_bits() {
    use ch02::kernels::{EVEN_SPLIT_PANELS, NR, set_even_split};
    let edge = EVEN_SPLIT_PANELS * NR;
    let rows = prop_oneof![
        Just(1usize),
        Just(31),
        Just(edge - 32),
        Just(edge - 1),
        Just(edge),
        Just(edge + 1),
        Just(edge + 32),
        1usize..2 * edge + 40,
    ];
    let shapes = (0..FORMATS.len(), rows, 1usize..3);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    pool.install(|| {
        seeded_runner(24, 57)
            .run(&shapes, |(f, out, blocks)| {
                let ty = FORMATS[f];
                let cols = blocks * ty.block_elems();
                let w: Vec<f32> = (0..out * cols)
                    .map(|i| ((i * 29) % 17) as f32 / 8.5 - 1.0)
                    .collect();
                let x: Vec<f32> = (0..cols)
                    .map(|i| ((i * 7) % 11) as f32 / 5.5 - 1.0)
                    .collect();
                let w = QuantMatrix::quantize(ty, &w, out, cols).unwrap();
                let mut scratch = Scratch::default();
                let mut expected = vec![0.0f32; out];
                matmul(Isa::Portable, &w, &x, &mut expected, 1, &mut scratch);
                let bits = |y: &[f32]| y.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                for isa in Isa::available() {
                    for even in [true, false] {
                        set_even_split(even);
                        let mut y = vec![f32::NAN; out];
                        matvec(isa, &w, &x, &mut y, &mut scratch);
                        set_even_split(true);
                        prop_assert_eq!(
                            bits(&y),
                            bits(&expected),
                            "{:?} {} [{}, {}], even split {}",
                            isa,
                            ty,
                            out,
                            cols,
                            even
                        );
                    }
                }
                Ok(())
            })
            .unwrap()
    });
}

/// Stored bytes that no encoder writes (random nibbles and scales, Q8_0's −128, Q6_K's
/// negative scales) multiply as their decoding says, on every instruction set.
#[test]
fn arbitrary_block_bytes_multiply_as_they_decode() {
    let strategy = (0..FORMATS.len(), 1usize..9, 1usize..4, any::<u64>());
    seeded_runner(120, 53)
        .run(&strategy, |(f, out, blocks, seed)| {
            let ty = FORMATS[f];
            let cols = blocks * 256; // a multiple of both block lengths
            let mut next = xorshift(seed);
            let mut bytes: Vec<u8> = (0..out * ty.row_bytes(cols).unwrap())
                .map(|_| next() as u8)
                .collect();
            // Finite, moderate f16 scales (random bytes would make infinities and NaNs).
            let scale_at: &[usize] = match ty {
                GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
                GgmlType::Q6K => &[208],
                _ => &[0, 2],
            };
            for b in bytes.chunks_exact_mut(ty.block_bytes()) {
                for &at in scale_at {
                    let v = ((next() % 2001) as f32 - 1000.0) / 1e5;
                    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            let w = QuantMatrix::new(ty, out, cols, bytes).unwrap();
            let w_f32 = w.dequantize();
            let x: Vec<f32> = (0..2 * cols)
                .map(|_| ((next() % 20001) as f32 - 10000.0) / 5000.0)
                .collect();
            let mut scratch = Scratch::default();
            let mut first: Option<Vec<f32>> = None;
            for isa in Isa::available() {
                let mut y = vec![0.0f32; 2 * out];
                matmul(isa, &w, &x, &mut y, 2, &mut scratch);
                for t in 0..2 {
                    for o in 0..out {
                        let (expected, bound) =
                            reference(ty, &w, &w_f32, &x[t * cols..(t + 1) * cols], o);
                        let err = (y[t * out + o] as f64 - expected).abs();
                        prop_assert!(
                            err <= bound,
                            "{:?} {}: output [{}, {}] error {:.3e} > bound {:.3e}",
                            isa,
                            ty,
                            t,
                            o,
                            err,
                            bound
                        );
                    }
                }
                match &first {
                    None => first = Some(y),
                    Some(p) => prop_assert!(
                        p.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{:?} differs from portable on {}",
                        isa,
                        ty
                    ),
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A seeded xorshift64 stream (the tests' random bytes and inputs).
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

/// Stores `group` consecutive blocks of each row of `ungrouped` (Q4_0 or Q4_1) under the
/// first one's header, the layout of [`QuantMatrix::grouped`]; every block of a run must
/// already carry that header.
fn group_blocks(ty: GgmlType, group: usize, ungrouped: &[u8]) -> Vec<u8> {
    let header = ty.block_bytes() - 16;
    let mut out = Vec::new();
    for run in ungrouped.chunks_exact(group * ty.block_bytes()) {
        out.extend_from_slice(&run[..header]);
        for block in run.chunks_exact(ty.block_bytes()) {
            out.extend_from_slice(&block[header..]);
        }
    }
    out
}

#[test]
fn grouped_blocks_equal_the_same_blocks_ungrouped_bit_for_bit() {
    let strategy = (
        prop::sample::select(vec![GgmlType::Q4_0, GgmlType::Q4_1]),
        prop::sample::select(vec![2usize, 4, 8]),
        1usize..11,
        1usize..4,
        1usize..7,
        any::<u64>(),
    );
    seeded_runner(64, 55)
        .run(&strategy, |(ty, group, out, runs, tokens, seed)| {
            let cols = 32 * group * runs;
            let mut next = xorshift(seed);
            let mut bytes: Vec<u8> = (0..out * ty.row_bytes(cols).unwrap())
                .map(|_| next() as u8)
                .collect();
            // One moderate header per run of `group` blocks, copied into each of its blocks.
            let header = ty.block_bytes() - 16;
            for run in bytes.chunks_exact_mut(group * ty.block_bytes()) {
                for at in (0..header).step_by(2) {
                    let v = ((next() % 2001) as f32 - 1000.0) / 1e4;
                    run[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
                let first = run[..header].to_vec();
                for block in run.chunks_exact_mut(ty.block_bytes()) {
                    block[..header].copy_from_slice(&first);
                }
            }
            let grouped_bytes = group_blocks(ty, group, &bytes);
            prop_assert!(grouped_bytes.len() < bytes.len());
            let plain = QuantMatrix::new(ty, out, cols, bytes).unwrap();
            let grouped = QuantMatrix::grouped(ty, group, out, cols, grouped_bytes).unwrap();
            prop_assert_eq!(grouped.group(), group);
            prop_assert_eq!(grouped.dequantize(), plain.dequantize());
            let x: Vec<f32> = (0..tokens * cols)
                .map(|_| ((next() % 20001) as f32 - 10000.0) / 5000.0)
                .collect();
            let mut scratch = Scratch::default();
            for isa in Isa::available() {
                let run = |w: &QuantMatrix, scratch: &mut Scratch| {
                    let mut y = vec![0.0f32; tokens * out];
                    if tokens == 1 {
                        matvec(isa, w, &x, &mut y, scratch);
                    } else {
                        matmul(isa, w, &x, &mut y, tokens, scratch);
                    }
                    y
                };
                let (a, b) = (run(&plain, &mut scratch), run(&grouped, &mut scratch));
                for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                    prop_assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{:?} {} groups of {}: output {} {} vs {}",
                        isa,
                        ty,
                        group,
                        i,
                        a,
                        b
                    );
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn grouped_layouts_that_do_not_fit_are_errors() {
    assert_eq!(
        QuantMatrix::grouped(GgmlType::Q8_0, 2, 1, 64, vec![0; 66]),
        Err(KernelError::Group {
            ty: GgmlType::Q8_0,
            group: 2
        })
    );
    assert!(matches!(
        QuantMatrix::grouped(GgmlType::Q4_0, 3, 1, 96, vec![0; 50]),
        Err(KernelError::Group { group: 3, .. })
    ));
    // 96 columns are not whole runs of 64; 128 columns of Q4_1 in runs of 2 are 2 · 36 bytes.
    assert!(QuantMatrix::grouped(GgmlType::Q4_0, 2, 1, 96, vec![0; 51]).is_err());
    assert!(QuantMatrix::grouped(GgmlType::Q4_1, 2, 1, 128, vec![0; 71]).is_err());
    assert!(QuantMatrix::grouped(GgmlType::Q4_1, 2, 1, 128, vec![0; 72]).is_ok());
}

#[test]
fn quant_linear_adds_its_bias_and_forward_into_equals_forward() {
    let (out, cols, tokens) = (7, 64, 3);
    let w = Array2::from_shape_fn((out, cols), |(o, k)| {
        ((o * 31 + k * 7) % 17) as f32 / 17.0 - 0.5
    });
    let bias = Array1::from_shape_fn(out, |o| o as f32);
    let x = Array2::from_shape_fn((tokens, cols), |(t, k)| {
        ((t * 13 + k) % 11) as f32 / 5.0 - 1.0
    });
    let with = QuantLinear::quantize(GgmlType::Q8_0, &w, Some(bias.clone())).unwrap();
    let without = QuantLinear::quantize(GgmlType::Q8_0, &w, None).unwrap();
    let (a, b) = (with.forward(x.view()), without.forward(x.view()));
    assert_eq!(a, b + &bias);
    let mut y = Array2::zeros((tokens, out));
    with.forward_into(x.view(), y.view_mut());
    assert_eq!(y, a);
    // A transposed (non-contiguous) output view takes the copying path.
    let mut yt = Array2::zeros((out, tokens));
    with.forward_into(x.view(), yt.view_mut().reversed_axes());
    assert_eq!(yt.t(), a);
    assert_eq!(with.weight_bytes(), out * 2 * 34 + out * 4);
    assert_eq!((with.in_features(), with.out_features()), (cols, out));
    assert!(matches!(
        QuantLinear::quantize(GgmlType::Q8_0, &w, Some(Array1::zeros(3))),
        Err(KernelError::Bias { bias: 3, out: 7 })
    ));
}

#[test]
fn shapes_that_do_not_fit_are_errors_at_construction() {
    assert_eq!(
        QuantMatrix::new(GgmlType::Q2K, 1, 256, vec![0; 84]),
        Err(KernelError::NoKernel(GgmlType::Q2K))
    );
    assert!(matches!(
        QuantMatrix::new(GgmlType::Q4K, 2, 576, vec![0; 2 * 144 * 2]),
        Err(KernelError::Block(BlockError::Length { .. }))
    ));
    assert!(matches!(
        QuantMatrix::new(GgmlType::Q8_0, 2, 64, vec![0; 3 * 34]),
        Err(KernelError::Block(BlockError::Length { .. }))
    ));
    assert!(QuantMatrix::quantize(GgmlType::Q4_0, &[0.0; 40], 1, 40).is_err());
    // Empty layers are valid and compute nothing.
    let empty = QuantMatrix::new(GgmlType::Q4_0, 0, 64, vec![]).unwrap();
    let mut scratch = Scratch::default();
    matmul(Isa::Portable, &empty, &[0.0; 128], &mut [], 2, &mut scratch);
    let no_inputs = QuantMatrix::new(GgmlType::Q4K, 3, 0, vec![]).unwrap();
    let mut y = [1.0f32; 3];
    matvec(Isa::detect(), &no_inputs, &[], &mut y, &mut scratch);
    assert_eq!(y, [0.0; 3]);
}
