//! The integer kernels on the activations and weights the random tests rarely draw: a NaN, an
//! infinity, all zeros, huge and tiny values, and blocks whose every code is at the edge of its
//! range (where `maddubs` would saturate if a kernel's bound were wrong). Every instruction set
//! of this CPU, `matvec` and `matmul`.

use ch05_quantization::GgmlType;
use ch05_quantization::kernels::{Isa, Outs, QuantMatrix, Scratch, matmul, matvec};
use half::f16;

use ch05_quantization::kernels::KERNEL_FORMATS as FORMATS;

/// Where each format keeps its f16 scales (and offsets) in a block.
fn scale_at(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q6K => &[208],
        _ => &[0, 2],
    }
}

/// `rows` rows of `cols` weights of `ty`, every byte `fill`, every f16 scale `scale`.
fn filled(ty: GgmlType, rows: usize, cols: usize, fill: u8, scale: f32) -> QuantMatrix {
    let mut bytes = vec![fill; rows * ty.row_bytes(cols).unwrap()];
    for b in bytes.chunks_exact_mut(ty.block_bytes()) {
        for &at in scale_at(ty) {
            b[at..at + 2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
        }
    }
    QuantMatrix::new(ty, rows, cols, bytes).unwrap()
}

/// Random moderate weights of `ty` (quantized from seeded values).
fn weights(ty: GgmlType, rows: usize, cols: usize) -> QuantMatrix {
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 2003) as f32 / 1001.5 - 1.0) * 0.5)
        .collect();
    QuantMatrix::quantize(ty, &w, rows, cols).unwrap()
}

/// `y` [tokens, out] by `matmul` and, token by token, by `matvec` (which must agree bit for bit).
fn run(isa: Isa, w: &QuantMatrix, x: &[f32], tokens: usize) -> Vec<f32> {
    let mut scratch = Scratch::default();
    let mut y = vec![0.0f32; tokens * w.rows()];
    matmul(isa, w, x, &mut y, tokens, &mut scratch);
    for t in 0..tokens {
        let mut y_t = vec![0.0f32; w.rows()];
        let x_t = &x[t * w.cols()..(t + 1) * w.cols()];
        matvec(isa, w, x_t, &mut y_t, &mut scratch);
        for (o, (a, b)) in y_t.iter().zip(&y[t * w.rows()..]).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{isa:?} {}: matvec {a:e} vs matmul {b:e} at [{t}, {o}]",
                w.ty()
            );
        }
    }
    y
}

/// `Σ w̃ x` in f64 over the decoded weights, and `Σ |w̃ x|`.
fn dense(w: &QuantMatrix, x_t: &[f32], o: usize) -> (f64, f64) {
    let w_f32 = w.dequantize();
    let row = &w_f32[o * w.cols()..(o + 1) * w.cols()];
    row.iter().zip(x_t).fold((0.0, 0.0), |(s, a), (&w, &x)| {
        let p = w as f64 * x as f64;
        (s + p, a + p.abs())
    })
}

/// A NaN in one token's activations makes every output of that token NaN, as the dense product
/// does, on every format and instruction set; the other tokens are untouched. (The activation
/// quantizer used to skip the NaN in the block's maximum and round it to the code 0, so the
/// output was a finite number as if the element were 0.)
#[test]
fn a_nan_activation_makes_its_outputs_nan() {
    let (rows, tokens) = (11, 3);
    for ty in FORMATS {
        let cols = 2 * ty.block_elems();
        let w = weights(ty, rows, cols);
        let clean: Vec<f32> = (0..tokens * cols)
            .map(|i| (i % 13) as f32 / 6.0 - 1.0)
            .collect();
        for at in [0, 5, ty.block_elems() + 31] {
            let mut x = clean.clone();
            x[cols + at] = f32::NAN; // token 1
            for isa in Isa::available() {
                let (y, y_clean) = (run(isa, &w, &x, tokens), run(isa, &w, &clean, tokens));
                for o in 0..rows {
                    assert!(dense(&w, &x[cols..2 * cols], o).0.is_nan());
                    assert!(
                        y[rows + o].is_nan(),
                        "{isa:?} {ty}: NaN at {at} gives output {o} = {:e}",
                        y[rows + o]
                    );
                    for t in [0, 2] {
                        let (a, b) = (y[t * rows + o], y_clean[t * rows + o]);
                        assert_eq!(a.to_bits(), b.to_bits(), "{isa:?} {ty}: token {t}");
                    }
                }
            }
        }
    }
}

/// An infinite activation gives a non-finite output (not a finite one); all-zero activations
/// give exactly 0 (the zero block's scale is 0, never 0 / 0).
#[test]
fn infinite_and_zero_activations() {
    let rows = 9;
    for ty in FORMATS {
        let cols = ty.block_elems();
        let w = weights(ty, rows, cols);
        for isa in Isa::available() {
            let zeros = run(isa, &w, &vec![0.0; 2 * cols], 2);
            assert!(zeros.iter().all(|&y| y == 0.0), "{isa:?} {ty}: {zeros:?}");
            for inf in [f32::INFINITY, f32::NEG_INFINITY] {
                let mut x = vec![0.25f32; cols];
                x[3] = inf;
                let y = run(isa, &w, &x, 1);
                assert!(y.iter().all(|y| !y.is_finite()), "{isa:?} {ty}: {y:?}");
            }
        }
    }
}

/// Huge activations (near f32's largest, with small weights so that the sums stay finite) and
/// tiny ones (subnormal) stay within a relative error of dequantize-then-dense; nothing panics.
#[test]
fn huge_and_tiny_activations_stay_close_to_dense() {
    let rows = 10;
    for ty in FORMATS {
        let cols = 2 * ty.block_elems();
        for (magnitude, weight_scale) in [(1e36f32, 1e-4f32), (1e-39, 1.0), (1.0, 1.0)] {
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 7919 % 2003) as f32 / 1001.5 - 1.0) * weight_scale)
                .collect();
            let w = QuantMatrix::quantize(ty, &w, rows, cols).unwrap();
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 31 % 17) as f32 / 8.0 - 1.0) * magnitude)
                .collect();
            for isa in Isa::available() {
                let y = run(isa, &w, &x, 1);
                for (o, &y) in y.iter().enumerate() {
                    let (reference, abs) = dense(&w, &x, o);
                    // The activations' rounding (max|x| / 254 per unit of Σ|w|), with room for
                    // the floor of a subnormal block's scale (f32's smallest normal / 2).
                    let amax = x.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
                    let sum_w: f64 = w.dequantize()[o * cols..(o + 1) * cols]
                        .iter()
                        .map(|w| w.abs() as f64)
                        .sum();
                    let bound = (amax / 250.0 + f32::MIN_POSITIVE as f64) * sum_w + 1e-5 * abs;
                    assert!(
                        y.is_finite() && (y as f64 - reference).abs() <= bound,
                        "{isa:?} {ty} |x| ~ {magnitude:e}: output {o} = {y:e}, dense \
                         {reference:e}, bound {bound:e}"
                    );
                }
            }
        }
    }
}

/// Every code at the edge of its range (each byte 0x00, 0x7F, 0x80 or 0xFF: Q8_0's ±127 and
/// −128, nibbles 15, Q5's 31, Q6_K's 63 under scales ±127 and −128, K-quant scales and mins 63)
/// times activations all at ±127: the products `maddubs` pairs are as large as the format
/// allows, and every instruction set must still equal dequantize-then-dense, whose products are
/// exact here (the weights are small integers times a power of two, the activations ±1/16).
#[test]
fn extreme_codes_do_not_saturate() {
    let rows = 13;
    for ty in FORMATS {
        let cols = 2 * ty.block_elems();
        for fill in [0x00u8, 0x7F, 0x80, 0xFF] {
            let w = filled(ty, rows, cols, fill, 1.0 / 64.0);
            let patterns: [&dyn Fn(usize) -> f32; 3] = [
                &|_| 1.0 / 16.0,
                &|_| -1.0 / 16.0,
                &|i| if (i / 2) % 2 == 0 { 1.0 } else { -1.0 } / 16.0,
            ];
            for p in patterns {
                let x: Vec<f32> = (0..2 * cols).map(p).collect();
                let mut first: Option<Vec<f32>> = None;
                for isa in Isa::available() {
                    let y = run(isa, &w, &x, 2);
                    for t in 0..2 {
                        for o in 0..rows {
                            let (reference, abs) = dense(&w, &x[t * cols..(t + 1) * cols], o);
                            let got = y[t * rows + o] as f64;
                            assert!(
                                (got - reference).abs() <= 1e-5 * abs + 1e-30,
                                "{isa:?} {ty} bytes {fill:#04x}: output [{t}, {o}] = {got:e}, \
                                 dense {reference:e}"
                            );
                        }
                    }
                    match &first {
                        None => first = Some(y),
                        Some(p) => assert!(
                            p.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa:?} {ty} bytes {fill:#04x} differs from portable"
                        ),
                    }
                }
            }
        }
    }
}

/// Empty layers and inputs: no rows, no columns, no tokens compute nothing and never panic.
#[test]
fn empty_shapes_compute_nothing() {
    for ty in FORMATS {
        let be = ty.block_elems();
        let mut scratch = Scratch::default();
        for isa in Isa::available() {
            let no_rows = QuantMatrix::new(ty, 0, be, vec![]).unwrap();
            matvec(isa, &no_rows, &vec![1.0; be], &mut [], &mut scratch);
            matmul(isa, &no_rows, &vec![1.0; 3 * be], &mut [], 3, &mut scratch);
            let no_cols = QuantMatrix::new(ty, 9, 0, vec![]).unwrap();
            let mut y = vec![1.0f32; 9 * 3];
            matmul(isa, &no_cols, &[], &mut y, 3, &mut scratch);
            assert!(y.iter().all(|&y| y == 0.0), "{isa:?} {ty}");
            let mut y = vec![1.0f32; 9];
            matvec(isa, &no_cols, &[], &mut y, &mut scratch);
            assert!(y.iter().all(|&y| y == 0.0), "{isa:?} {ty}");
            let w = weights(ty, 9, be);
            matmul(isa, &w, &[], &mut [], 0, &mut scratch);
        }
    }
}

/// Outputs of no tokens hold nothing, whatever the rows (the size check once wrapped
/// `tokens − 1` and panicked).
#[test]
fn outputs_of_no_tokens_are_empty() {
    let outs = Outs::new(&mut [], 13, 0);
    assert_eq!(outs.rows(), 13);
    let outs = Outs::new(&mut [], 0, 0);
    assert_eq!(outs.rows(), 0);
}

/// Widths that are not whole blocks are refused with a typed error, never a panic, for every
/// format, by both constructors.
#[test]
fn partial_blocks_are_errors() {
    for ty in FORMATS {
        let be = ty.block_elems();
        for cols in [1, be - 1, be + 1, be + be / 2] {
            assert!(QuantMatrix::quantize(ty, &vec![0.5; 3 * cols], 3, cols).is_err());
            let bytes = vec![0u8; 3 * (cols / be + 1) * ty.block_bytes()];
            assert!(QuantMatrix::new(ty, 3, cols, bytes).is_err());
        }
        // Whole blocks, but a weight of the wrong length.
        assert!(QuantMatrix::quantize(ty, &vec![0.5; 2 * be + 1], 2, be).is_err());
        assert!(QuantMatrix::new(ty, 2, be, vec![0; 2 * ty.block_bytes() - 1]).is_err());
        assert!(QuantMatrix::new(ty, usize::MAX, be, vec![]).is_err());
    }
}
