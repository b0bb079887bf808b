//! `QuantLoader` on an in-memory weight source: stored blocks on the kernels (whole, column and
//! row shards), dense tensors kept dense or quantized on load (with the K-quant fallback), and
//! the errors for what it cannot load.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ch01::linear::{Linear, LinearLoader, LinearSpec};
use ch01::testing::{Tolerance, assert_close};
use ch01::{RawTensor, ShardSpec, TensorDtype, WeightSource};
use ch05_quantization::kernels::QuantMatrix;
use ch05_quantization::{GgmlType, QuantLinear, QuantLoader};
use ndarray::{Array1, Array2};

#[derive(Default)]
struct Memory {
    location: PathBuf,
    tensors: HashMap<String, (TensorDtype, Vec<usize>, Vec<u8>)>,
}

impl Memory {
    fn put(&mut self, name: &str, dtype: TensorDtype, shape: &[usize], bytes: Vec<u8>) {
        self.tensors
            .insert(name.to_string(), (dtype, shape.to_vec(), bytes));
    }
}

impl WeightSource for Memory {
    fn location(&self) -> &Path {
        &self.location
    }
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    fn tensor(&self, name: &str) -> ch01::Result<RawTensor<'_>> {
        let (dtype, shape, bytes) =
            self.tensors
                .get(name)
                .ok_or_else(|| ch01::Error::MissingTensor {
                    name: name.to_string(),
                    location: self.location.clone(),
                })?;
        RawTensor::new(name, &self.location, *dtype, shape.clone(), &bytes[..])
    }
}

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104729) % 2003) as f32 / 1001.0) - 1.0)
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A source holding one f32 weight `layer.weight` `[out, cols]`.
fn dense_source(w: &[f32], out: usize, cols: usize) -> Memory {
    let mut source = Memory::default();
    source.put("layer.weight", TensorDtype::F32, &[out, cols], f32_bytes(w));
    source
}

/// A source with `layer.weight` [out, in] stored as `ty` blocks and `layer.bias` [out].
fn blocks_source(ty: GgmlType, out: usize, cols: usize) -> (Memory, QuantMatrix, Vec<f32>) {
    let w = QuantMatrix::quantize(ty, &values(out * cols, 1), out, cols).unwrap();
    let bias = values(out, 2);
    let mut source = Memory::default();
    source.put(
        "layer.weight",
        ty.tensor_dtype(),
        &[out, cols],
        w.bytes().to_vec(),
    );
    source.put("layer.bias", TensorDtype::F32, &[out], f32_bytes(&bias));
    (source, w, bias)
}

#[test]
fn stored_blocks_load_whole_and_in_shards() {
    let (out, cols, tokens) = (6, 512, 3);
    let (source, w, bias) = blocks_source(GgmlType::Q4K, out, cols);
    let x = Array2::from_shape_vec((tokens, cols), values(tokens * cols, 3)).unwrap();
    let spec = LinearSpec::whole("layer", cols, out, true);
    let loader = QuantLoader::to(GgmlType::Q8_0).unwrap(); // a target never re-quantizes blocks
    let whole = loader.load(&source, &spec).unwrap();
    let expected = QuantLinear::new(w.clone(), Some(Array1::from_vec(bias.clone())))
        .unwrap()
        .forward(x.view());
    assert_eq!(whole.forward(x.view()), expected);
    assert_eq!(whole.weight_bytes(), w.bytes().len() + out * 4);

    // Column split: rank 1 of 2 holds output rows 3..6, and computes exactly those outputs.
    let col = loader
        .load(&source, &spec.with_shard(ShardSpec::column(1, 2)))
        .unwrap();
    let y = col.forward(x.view());
    assert_eq!(y, expected.slice(ndarray::s![.., 3..6]));

    // Row split: each rank holds one block of every row; the partial outputs sum to the whole
    // (the bias only on rank 0), up to f32 rounding of the two sums.
    let parts: Vec<_> = (0..2)
        .map(|r| {
            let layer = loader
                .load(&source, &spec.with_shard(ShardSpec::row(r, 2)))
                .unwrap();
            assert_eq!((layer.in_features(), layer.out_features()), (256, out));
            let x_r = x.slice(ndarray::s![.., r * 256..(r + 1) * 256]);
            layer.forward(x_r)
        })
        .collect();
    let sum = &parts[0] + &parts[1];
    assert_close(
        "row shards summed",
        sum.as_slice().unwrap(),
        expected.as_slice().unwrap(),
        Tolerance::F32,
    );
}

#[test]
fn a_row_split_inside_a_block_is_an_error() {
    let (source, _, _) = blocks_source(GgmlType::Q4K, 4, 512);
    let spec = LinearSpec::whole("layer", 512, 4, false).with_shard(ShardSpec::row(1, 4));
    let err = QuantLoader::native().load(&source, &spec).err().unwrap();
    let message = err.to_string();
    assert!(message.contains("block boundaries"), "{message}");
    assert!(message.contains("multiple of 256"), "{message}");
    // Q8_0 blocks of 32 split into 4 × 128 columns are fine.
    let (source, _, _) = blocks_source(GgmlType::Q8_0, 4, 512);
    QuantLoader::native().load(&source, &spec).unwrap();
}

#[test]
fn dense_weights_stay_dense_or_are_quantized_on_load() {
    let (out, cols) = (5, 576); // 576: not a multiple of 256
    let w = values(out * cols, 4);
    let source = dense_source(&w, out, cols);
    let spec = LinearSpec::whole("layer", cols, out, false);
    let x = Array2::from_shape_vec((2, cols), values(2 * cols, 5)).unwrap();
    let dense = Array2::from_shape_vec((out, cols), w.clone()).unwrap();
    let reference = x.dot(&dense.t());

    // No target: chapter 2's FastLinear (f32, panels of 16 rows, so 16 rows' worth of bytes).
    let fast = QuantLoader::native().load(&source, &spec).unwrap();
    assert_eq!(fast.weight_bytes(), 16 * cols * 4);
    // Q4_0: blocks of 32 fit 576.
    let q4 = QuantLoader::to(GgmlType::Q4_0)
        .unwrap()
        .load(&source, &spec)
        .unwrap();
    assert_eq!(q4.weight_bytes(), out * 18 * 18);
    // Q4_K: 576 is not a multiple of 256, so the layer falls back to Q5_0 (22 bytes per 32),
    // as llama.cpp's quantizer does; Q5_K to Q5_1 (24 bytes), Q6_K to Q8_0 (34 bytes).
    let q4k = QuantLoader::to(GgmlType::Q4K).unwrap();
    let layer = q4k.load(&source, &spec).unwrap();
    assert_eq!(layer.weight_bytes(), out * 18 * 22);
    for (ty, bytes) in [(GgmlType::Q5K, 24), (GgmlType::Q6K, 34)] {
        let other = QuantLoader::to(ty).unwrap().load(&source, &spec).unwrap();
        assert_eq!(other.weight_bytes(), out * 18 * bytes, "{ty}");
    }
    for (name, layer, tol) in [("q4_0", &q4, 0.2f32), ("q5_0 fallback", &layer, 0.1)] {
        let y = layer.forward(x.view());
        assert_close(
            name,
            y.as_slice().unwrap(),
            reference.as_slice().unwrap(),
            Tolerance {
                rtol: tol,
                atol: tol,
            },
        );
    }
    // Without a fallback it is an error naming the layer and the block.
    let strict = QuantLoader {
        fallback: None,
        ..q4k
    };
    let message = strict.load(&source, &spec).err().unwrap().to_string();
    assert!(
        message.contains("layer.weight") && message.contains("256"),
        "{message}"
    );
    // `build` (a tied head) quantizes the same way.
    let built = q4k.build(dense, None).unwrap();
    assert_eq!(built.weight_bytes(), out * 18 * 22);
}

#[test]
fn formats_without_a_kernel_are_errors_or_decoded() {
    let mut source = Memory::default();
    source.put(
        "q2.weight",
        GgmlType::Q2K.tensor_dtype(),
        &[2, 256],
        vec![0; 2 * 84],
    );
    let err = QuantLoader::native()
        .load(&source, &LinearSpec::whole("q2", 256, 2, false))
        .err()
        .unwrap();
    assert!(err.to_string().contains("Q2_K"), "{err}");
    assert!(QuantLoader::to(GgmlType::Q2K).is_err());
    // Q8_K (no kernel, but decodable) is decoded and kept dense.
    let mut bytes = vec![0u8; 2 * 292];
    ch05_quantization::blocks::quantize(GgmlType::Q8K, &values(512, 6), &mut bytes).unwrap();
    source.put("q8k.weight", GgmlType::Q8K.tensor_dtype(), &[2, 256], bytes);
    let layer = QuantLoader::native()
        .load(&source, &LinearSpec::whole("q8k", 256, 2, false))
        .unwrap();
    assert_eq!(layer.out_features(), 2);
}

/// A dense checkpoint with a NaN or ∞ weight, quantized on load (`--quantization`), is an error
/// naming the tensor and the element, not a model with that weight silently 0; so is a weight
/// too large for a K-quant's f16 scales. Kept dense (no target), the NaN is loaded as it is.
#[test]
fn a_non_finite_or_overflowing_weight_quantized_on_load_is_an_error_naming_the_tensor() {
    let (out, cols) = (3, 256);
    let spec = LinearSpec::whole("layer", cols, out, false);
    for (bad, ty, says) in [
        (f32::NAN, GgmlType::Q8_0, "NaN"),
        (f32::INFINITY, GgmlType::Q4_0, "inf"),
        (f32::NAN, GgmlType::Q4K, "NaN"),
        (1e8, GgmlType::Q4K, "overflow"),
        (1e7, GgmlType::Q8_0, "overflow"),
    ] {
        let mut w = values(out * cols, 4);
        w[cols + 7] = bad; // row 1, column 7
        let source = dense_source(&w, out, cols);
        let err = QuantLoader::to(ty)
            .unwrap()
            .load(&source, &spec)
            .err()
            .unwrap_or_else(|| panic!("{ty} {bad}: loaded"))
            .to_string();
        let element = if says == "overflow" {
            format!("element {cols}") // the block's first element
        } else {
            format!("element {}", cols + 7)
        };
        assert!(
            err.contains("layer.weight") && err.contains(says) && err.contains(&element),
            "{ty} {bad}: {err}"
        );
        if bad.is_nan() {
            let dense = QuantLoader::native().load(&source, &spec).unwrap();
            let y = dense.forward(Array2::ones((1, cols)).view());
            assert!(y[[0, 1]].is_nan() && y[[0, 0]].is_finite(), "{y:?}");
        }
    }
    // On a rank holding part of the weight the element is counted within its part, and the
    // error says which part: rows 1..2 hold the NaN at column 7, element 7 of the part.
    let mut w = values(out * cols, 4);
    w[cols + 7] = f32::NAN;
    let source = dense_source(&w, out, cols);
    let part = spec.with_shard(ShardSpec::column(1, 3)); // rows 1..2
    let err = QuantLoader::to(GgmlType::Q8_0)
        .unwrap()
        .load(&source, &part)
        .err()
        .expect("a NaN in this rank's part")
        .to_string();
    assert!(
        err.contains("rows 1..2 and columns 0..256") && err.contains("element 7 is NaN"),
        "{err}"
    );
}
