//! The block formats against gguf-py, bit for bit: decoding every format, and round-to-nearest
//! encoding of Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, on the seeded cases of `fixtures/golden/quant/` (written by
//! `fixtures/scripts/make_quant_golden.py` with gguf-py 0.19.0; the one block whose f16 scale
//! gguf-py stores as infinity, kiln refuses with an error). Then the K-quant encoders,
//! which are this crate's own, within the bound their module docs derive.

use ch01::fixtures_dir;
use ch05_quantization::GgmlType;
use ch05_quantization::blocks::{BlockError, dequantize, f16_fields, quantize};
use proptest::prelude::*;

#[derive(serde::Deserialize)]
struct Case {
    kind: String,
    #[serde(rename = "type")]
    ty: String,
    shape: [usize; 2],
    bytes: String,
    values: String,
}

fn cases() -> Vec<Case> {
    #[derive(serde::Deserialize)]
    struct Index {
        cases: Vec<Case>,
    }
    let path = fixtures_dir().join("golden/quant/index.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str::<Index>(&text).unwrap().cases
}

fn read(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join("golden/quant").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Equal bits, or both NaN (an infinite scale times 0; NaN payloads are not compared).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn dequantize_equals_gguf_py_bit_for_bit() {
    let mut seen = 0;
    for case in cases().iter().filter(|c| c.kind == "dequantize") {
        let ty = GgmlType::from_name(&case.ty).unwrap();
        let bytes = read(&case.bytes);
        let expected = f32s(&read(&case.values));
        let [rows, cols] = case.shape;
        assert_eq!(expected.len(), rows * cols);
        let mut actual = vec![0.0f32; rows * cols];
        // Row by row, as a loader decodes a tensor.
        let row_bytes = ty.row_bytes(cols).unwrap();
        for (r, out) in actual.chunks_exact_mut(cols).enumerate() {
            dequantize(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], out).unwrap();
        }
        for (i, (&a, &e)) in actual.iter().zip(&expected).enumerate() {
            assert!(
                same(a, e),
                "{ty}: element {i} (row {}, block {}, index {} in it): kiln {a:e} ({:#010x}), \
                 gguf-py {e:e} ({:#010x})",
                i / cols,
                (i % cols) / ty.block_elems(),
                i % ty.block_elems(),
                a.to_bits(),
                e.to_bits()
            );
        }
        seen += 1;
    }
    assert_eq!(seen, 8, "one case per format");
}

#[test]
fn round_to_nearest_equals_gguf_py_bit_for_bit() {
    let mut seen = 0;
    for case in cases().iter().filter(|c| c.kind == "quantize") {
        let ty = GgmlType::from_name(&case.ty).unwrap();
        let x = f32s(&read(&case.values));
        let expected = read(&case.bytes);
        // Block by block: gguf-py stores an infinite f16 scale where kiln refuses the block.
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        let mut refused = 0;
        for (b, (x, e)) in x
            .chunks_exact(be)
            .zip(expected.chunks_exact(bb))
            .enumerate()
        {
            let mut a = vec![0u8; bb];
            let result = quantize(ty, x, &mut a);
            let infinite = f16_fields(ty)
                .iter()
                .any(|&at| u16::from_le_bytes([e[at], e[at + 1]]) & 0x7FFF == 0x7C00);
            if infinite {
                assert!(
                    matches!(result, Err(BlockError::Overflow { index: 0, .. })),
                    "{ty}: block {b}, an infinite scale in gguf-py: {result:?}"
                );
                refused += 1;
                continue;
            }
            result.unwrap();
            assert_eq!(a, e, "{ty}: block {b} differs; its input: {x:?}");
        }
        assert_eq!(refused, 1, "{ty}: the case's one block of 1e7");
        assert_eq!(case.shape[0] * case.shape[1], x.len());
        seen += 1;
    }
    assert_eq!(seen, 5, "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1");
}

/// The bound of `q4_k`'s and `q6_k`'s module docs, per element, from the input alone.
fn k_bound(ty: GgmlType, x: &[f32]) -> Vec<f64> {
    const F16_ULP: f64 = 1.0 / 1024.0; // relative step of a normal f16
    const F16_TINY: f64 = 5.960464477539063e-8; // 2⁻²⁴, the f16 denormal step
    let up = |v: f64| v * (1.0 + F16_ULP) + F16_TINY; // an upper bound of f16_ceil(v)
    let amax = x.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
    let slack = amax * 1e-6 + 1e-30; // f32 rounding of the decode
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => {
            let levels = if ty == GgmlType::Q4K { 15.0 } else { 31.0 };
            let subs: Vec<(f64, f64)> = x
                .chunks_exact(32)
                .map(|s| {
                    let lo = s.iter().fold(0.0f64, |m, &v| m.min(v as f64));
                    let hi = s.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
                    (lo, hi)
                })
                .collect();
            let dmin = up(subs.iter().fold(0.0f64, |m, s| m.max(-s.0)) / 63.0);
            let r = |&(lo, hi): &(f64, f64)| (hi - lo + dmin) / levels;
            let d = up(subs.iter().map(r).fold(0.0, f64::max) / 63.0);
            subs.iter()
                .flat_map(|s| std::iter::repeat_n((r(s) + d) / 2.0 + slack, 32))
                .collect()
        }
        GgmlType::Q6K => {
            let r: Vec<f64> = x
                .chunks_exact(16)
                .map(|s| s.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64)) / 31.0)
                .collect();
            let d = up(r.iter().copied().fold(0.0, f64::max) / 127.0);
            r.iter()
                .flat_map(|&r| std::iter::repeat_n((r + d) / 2.0 + slack, 16))
                .collect()
        }
        other => unreachable!("{other} is not a K-quant"),
    }
}

/// One super-block of 256: normal values times a scale, with edge blocks mixed in.
fn super_block() -> impl Strategy<Value = Vec<f32>> {
    let values = proptest::collection::vec(-1.0f32..1.0, 256);
    (values, 0usize..6, -8i32..8).prop_map(|(mut x, edge, exp)| {
        let scale = 2f32.powi(exp);
        x.iter_mut().for_each(|v| *v *= scale);
        match edge {
            0 => x.fill(0.0),
            1 => x[17] = 1e4,
            2 => x.iter_mut().for_each(|v| *v = -v.abs()),
            3 => x.iter_mut().for_each(|v| *v *= 1e-6),
            4 => x.iter_mut().for_each(|v| *v = v.abs() + 1.0), // positive, far from 0
            _ => {}
        }
        x
    })
}

#[test]
fn k_quants_stay_within_their_bound() {
    let mut runner = ch01::testing::seeded_runner(200, 51);
    let blocks = proptest::collection::vec(super_block(), 1..4).prop_map(|b| b.concat());
    runner
        .run(&blocks, |x| {
            for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
                let mut bytes = vec![0u8; ty.row_bytes(x.len()).unwrap()];
                quantize(ty, &x, &mut bytes).unwrap();
                let mut back = vec![0.0f32; x.len()];
                dequantize(ty, &bytes, &mut back).unwrap();
                let bound = x
                    .chunks_exact(256)
                    .flat_map(|b| k_bound(ty, b))
                    .collect::<Vec<_>>();
                for (i, ((&v, &b), &bound)) in x.iter().zip(&back).zip(&bound).enumerate() {
                    let err = (v as f64 - b as f64).abs();
                    prop_assert!(
                        err <= bound,
                        "{ty}: element {i}: {v} decodes to {b}, error {err:e} > bound {bound:e}"
                    );
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn every_format_round_trips_its_own_encoding() {
    // Decoding an encoding and encoding it again changes nothing (the grid points are fixed
    // points), for the formats whose rule reproduces its scales from the decoded values.
    let x: Vec<f32> = (0..512)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q8K,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
    ] {
        let mut bytes = vec![0u8; ty.row_bytes(x.len()).unwrap()];
        quantize(ty, &x, &mut bytes).unwrap();
        let mut back = vec![0.0f32; x.len()];
        dequantize(ty, &bytes, &mut back).unwrap();
        let mut again = vec![0u8; bytes.len()];
        quantize(ty, &back, &mut again).unwrap();
        let mut back2 = vec![0.0f32; x.len()];
        dequantize(ty, &again, &mut back2).unwrap();
        let max = back
            .iter()
            .zip(&back2)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        let step = x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        assert!(
            max <= step * 1e-2,
            "{ty}: re-encoding moved a value by {max:e}"
        );
    }
}
