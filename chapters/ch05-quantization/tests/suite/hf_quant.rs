//! The GPTQ and AWQ layouts (chapter 5, part 2): pack → unpack is the identity on random
//! layers, `GroupLinear` (repacked onto Q4_0 / Q4_1, act-order permuted) against the dense
//! reference within a derived bound, kiln's files against an independent numpy unpacker
//! (fixtures/scripts/hf_quant_unpack.py, golden committed), and malformed checkpoints.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use ch01::linear::{Linear, LinearLoader, LinearSpec};
use ch01::testing::seeded_runner;
use ch05_quantization::group_quant::{Grid, GroupQuantized, MAXQ};
use ch05_quantization::hf_quant::gptq_format::{Packed, Stored};
use ch05_quantization::hf_quant::linear::GroupKind;
use ch05_quantization::hf_quant::{awq_format, gptq_format};
use ch05_quantization::{
    GroupLinear, HfQuantConfig, HfQuantError, HfQuantLoader, QuantLoader, QuantMethod,
};
use ndarray::Array2;
use proptest::prelude::*;
use safetensors::tensor::{Dtype, TensorView};

/// A checkpoint's tensors: (name, dtype, shape, bytes).
type Tensors = Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)>;
/// A change to a checkpoint's tensors.
type Edit = Box<dyn FnOnce(&mut Tensors)>;
/// One golden directory: its layout, and its layers by name.
type GoldenDir = (
    &'static str,
    HfQuantConfig,
    Vec<(&'static str, GroupQuantized)>,
);

/// A random layer: codes, scales, zeros and (with `shuffle`) an act-order `g_idx`.
fn layer(
    rows: usize,
    cols: usize,
    group: usize,
    symmetric: bool,
    shuffle: bool,
    seed: u64,
) -> GroupQuantized {
    let mut state = seed | 1;
    let mut next = move |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let groups = cols.div_ceil(group);
    let codes = (0..rows * cols).map(|_| next(16) as u8).collect();
    let scales = (0..groups * rows)
        .map(|_| half::f16::from_f32((1 + next(1000)) as f32 * 1e-4).to_f32())
        .collect();
    let zeros = (0..groups * rows)
        .map(|_| if symmetric { 8 } else { 1 + next(15) as u8 })
        .collect();
    let mut positions: Vec<usize> = (0..cols).collect();
    if shuffle {
        for i in (1..cols).rev() {
            positions.swap(i, next(i as u64 + 1) as usize);
        }
    }
    // Column positions[p] is the p-th processed: in group p / group.
    let mut g_idx = vec![0u32; cols];
    for (p, &c) in positions.iter().enumerate() {
        g_idx[c] = (p / group) as u32;
    }
    GroupQuantized::new(rows, cols, group, codes, scales, zeros, g_idx).unwrap()
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f16_bytes(v: &[half::f16]) -> Vec<u8> {
    v.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The packed tensors as bytes, for `unpack`.
struct Bytes {
    qweight: (Vec<u8>, Vec<usize>),
    qzeros: (Vec<u8>, Vec<usize>),
    scales: (Vec<u8>, Vec<usize>),
    g_idx: Option<(Vec<u8>, Vec<usize>)>,
}

impl Bytes {
    fn of(p: &Packed) -> Bytes {
        Bytes {
            qweight: (i32_bytes(&p.qweight.0), p.qweight.1.to_vec()),
            qzeros: (i32_bytes(&p.qzeros.0), p.qzeros.1.to_vec()),
            scales: (f16_bytes(&p.scales.0), p.scales.1.to_vec()),
            g_idx: p.g_idx.as_ref().map(|g| (i32_bytes(g), vec![g.len()])),
        }
    }

    fn stored(&self) -> Stored<'_> {
        Stored {
            qweight: (&self.qweight.0, &self.qweight.1),
            qzeros: (&self.qzeros.0, &self.qzeros.1),
            scales: (&self.scales.0, &self.scales.1),
            g_idx: self.g_idx.as_ref().map(|(b, s)| (&b[..], &s[..])),
        }
    }
}

#[test]
fn pack_then_unpack_is_the_identity() {
    let strategy = (
        1usize..5,
        1usize..20,
        prop::sample::select(vec![8usize, 16, 32, 64, 128]),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    );
    seeded_runner(64, 51)
        .run(&strategy, |(r8, c8, group, symmetric, shuffle, seed)| {
            let (rows, cols) = (8 * r8, 8 * c8);
            let q = layer(rows, cols, group, symmetric, shuffle, seed);
            let bytes = Bytes::of(&gptq_format::pack(&q).unwrap());
            let back = gptq_format::unpack("l", &bytes.stored(), rows, cols, Some(group)).unwrap();
            prop_assert_eq!(&back, &q);
            if cols % group == 0 {
                let q = layer(rows, cols, group, symmetric, false, seed);
                let bytes = Bytes::of(&awq_format::pack(&q).unwrap());
                let back = awq_format::unpack("l", &bytes.stored(), rows, cols, group).unwrap();
                prop_assert_eq!(&back, &q);
            }
            Ok(())
        })
        .unwrap();
}

/// AWQ's nibble order, by hand: outputs 0..8 of input row 0 with codes 0..8 pack to the word
/// whose nibbles, low to high, are outputs 0, 2, 4, 6, 1, 3, 5, 7.
#[test]
fn awq_interleaves_the_nibbles() {
    let codes: Vec<u8> = (0..8).collect(); // [8 rows, 1 column]: code of output o is o
    let q = GroupQuantized::new(8, 1, 1, codes, vec![1.0; 8], vec![0; 8], vec![0]).unwrap();
    let packed = awq_format::pack(&q).unwrap();
    assert_eq!(packed.qweight.0, vec![0x7531_6420]);
    // GPTQ packs along the input: 8 columns of one row, codes 1..9 (9 wraps to nibble 9).
    let codes: Vec<u8> = (0..64).map(|k| (k % 8 + 1) as u8).collect(); // [8, 8]
    let q = GroupQuantized::new(8, 8, 8, codes, vec![1.0; 8], vec![8; 8], vec![0; 8]).unwrap();
    let packed = gptq_format::pack(&q).unwrap();
    assert!(
        packed
            .qweight
            .0
            .iter()
            .all(|&w| w == 0x8765_4321_u32 as i32)
    );
    assert!(packed.qzeros.0.iter().all(|&w| w == 0x7777_7777)); // zero 8 stored as 7
}

/// `|y − y_ref|` of the repacked kernel, per output: the activation rounding of part 1's
/// kernels (`d_x (½ + 2⁻¹⁵) Σ|w|` per block of 32), Q4_1's offset rounded to f16
/// (`2⁻¹¹ |scale · zero|` per weight), and f32 accumulation (`(blocks + 9) u Σ|w||x|`, with
/// room to spare).
fn bound(q: &GroupQuantized, x: &[f32], o: usize, order: &[usize]) -> f64 {
    let mut b = 0.0;
    let blocks = q.cols() / 32;
    let deq = q.dequantize();
    let u = f64::from(f32::EPSILON) / 2.0;
    for block in order.chunks(32) {
        let amax = block.iter().fold(0.0f32, |m, &i| m.max(x[i].abs()));
        let dx = f64::from(amax) / 127.0;
        for &i in block {
            let w = f64::from(deq[o * q.cols() + i]).abs();
            let grid: Grid = q.grid(o, i);
            let offset = if q.is_symmetric() {
                0.0
            } else {
                f64::from(grid.scale) * f64::from(grid.zero)
            };
            b += dx * (0.5 + 2f64.powi(-15)) * (w + offset * 2f64.powi(-11));
            b += offset * 2f64.powi(-11) * f64::from(x[i].abs());
            b += (blocks as f64 + 9.0) * u * (w + offset) * (f64::from(x[i].abs()) + dx) * 2.0;
        }
    }
    b
}

#[test]
fn group_linear_matches_the_dense_reference() {
    let strategy = (
        1usize..4,
        1usize..17,
        // 16 and 48: groups whose boundaries split runs of 32 columns, so the layer cannot be
        // repacked as blocks (unless one group holds the whole row) and stays dense.
        prop::sample::select(vec![16usize, 32, 48, 64, 128, 256]),
        any::<bool>(),
        any::<bool>(),
        1usize..6,
        any::<u64>(),
    );
    let kinds_seen = [AtomicUsize::new(0), AtomicUsize::new(0)]; // [dense, blocks]
    seeded_runner(64, 52)
        .run(
            &strategy,
            |(r8, c32, group, symmetric, shuffle, tokens, seed)| {
                let (rows, cols) = (8 * r8, 32 * c32);
                let q = layer(rows, cols, group, symmetric, shuffle, seed);
                let linear = GroupLinear::new(&q, None).unwrap();
                // Runs of `width` columns stay inside one group when every group boundary
                // inside the row, and the row's end, are multiples of `width`.
                let boundaries: Vec<usize> =
                    (1..).map(|k| k * group).take_while(|&b| b < cols).collect();
                let fits =
                    |width: usize| cols % width == 0 && boundaries.iter().all(|b| b % width == 0);
                let repacks = fits(32);
                // One stored scale per run of 32·g columns: the largest g whose runs fit.
                let g = [8, 4, 2, 1]
                    .into_iter()
                    .find(|&g| fits(32 * g))
                    .unwrap_or(1);
                kinds_seen[usize::from(repacks)].fetch_add(1, Ordering::Relaxed);
                let expected_kind = match (repacks, symmetric) {
                    (false, _) => GroupKind::Dense,
                    (true, true) => GroupKind::Blocks {
                        ty: ch05_quantization::GgmlType::Q4_0,
                        group: g,
                    },
                    (true, false) => GroupKind::Blocks {
                        ty: ch05_quantization::GgmlType::Q4_1,
                        group: g,
                    },
                };
                prop_assert_eq!(linear.kind(), expected_kind);
                let x: Vec<f32> = (0..tokens * cols)
                    .map(|k| ((k * 7919 + seed as usize % 977) % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let xa = Array2::from_shape_vec((tokens, cols), x.clone()).unwrap();
                let y = linear.forward(xa.view());
                let deq = q.dequantize();
                let mut order: Vec<usize> = (0..cols).collect();
                order.sort_by_key(|&i| q.g_idx()[i]);
                for t in 0..tokens {
                    let xt = &x[t * cols..(t + 1) * cols];
                    for o in 0..rows {
                        let reference: f64 = (0..cols)
                            .map(|i| f64::from(deq[o * cols + i]) * f64::from(xt[i]))
                            .sum();
                        let b = if repacks {
                            bound(&q, xt, o, &order)
                        } else {
                            1e-5 * (1.0 + reference.abs())
                        };
                        let err = (f64::from(y[[t, o]]) - reference).abs();
                        prop_assert!(
                            err <= b,
                            "token {t}, output {o}: |{} − {reference}| = {err} > {b}",
                            y[[t, o]]
                        );
                    }
                }
                Ok(())
            },
        )
        .unwrap();
    let [dense, blocks] = kinds_seen.map(|n| n.into_inner());
    assert!(dense > 0 && blocks > 0, "dense {dense}, blocks {blocks}");
}

fn write_safetensors(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn gptq_config() -> HfQuantConfig {
    HfQuantConfig {
        method: QuantMethod::Gptq,
        group_size: Some(32),
        desc_act: true,
        sym: true,
        damp_percent: 0.01,
    }
}

/// A checkpoint directory holding one GPTQ layer `l` [16, 64], with `edit` applied to its
/// tensors first; the layer loaded through `HfQuantLoader` and `ch01::Weights`.
fn load_edited(edit: impl FnOnce(&mut Tensors)) -> Result<GroupQuantized, String> {
    let q = layer(16, 64, 32, true, true, 7);
    let p = gptq_format::pack(&q).unwrap();
    let b = Bytes::of(&p);
    let mut tensors = vec![
        (
            "l.qweight",
            Dtype::I32,
            b.qweight.1.clone(),
            b.qweight.0.clone(),
        ),
        (
            "l.qzeros",
            Dtype::I32,
            b.qzeros.1.clone(),
            b.qzeros.0.clone(),
        ),
        (
            "l.scales",
            Dtype::F16,
            b.scales.1.clone(),
            b.scales.0.clone(),
        ),
        ("l.g_idx", Dtype::I32, vec![64], b.g_idx.clone().unwrap().0),
    ];
    edit(&mut tensors);
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &tensors);
    let weights = ch01::Weights::open(dir.path()).map_err(|e| e.to_string())?;
    let loader = HfQuantLoader {
        config: gptq_config(),
        dense: QuantLoader::native(),
    };
    let read = loader
        .read(&weights, "l", 16, 64)
        .map_err(|e| e.to_string())?;
    // The loader's Linear too (its errors are the same).
    loader
        .load(&weights, &LinearSpec::whole("l", 64, 16, false))
        .map_err(|e| e.to_string())?;
    Ok(read)
}

#[test]
fn a_checkpoint_loads_and_malformed_ones_are_typed_errors() {
    let q = layer(16, 64, 32, true, true, 7);
    assert_eq!(load_edited(|_| {}).unwrap(), q);
    let cases: Vec<(&str, Edit)> = vec![
        (
            "expected shape [8, 16]",
            Box::new(|t| {
                t[0].2 = vec![16, 8];
                t[0].3.truncate(16 * 8 * 4);
            }),
        ),
        (
            "stored as BF16, expected F16",
            Box::new(|t| t[2].1 = Dtype::BF16),
        ),
        (
            "groups in 0..2",
            Box::new(|t| t[3].3[0..4].copy_from_slice(&5i32.to_le_bytes())),
        ),
        (
            "finite scales",
            Box::new(|t| t[2].3[0..2].copy_from_slice(&half::f16::INFINITY.to_le_bytes())),
        ),
        // A stored zero of 15 reads as 16: outside the 4-bit grid.
        (
            "zero value 16",
            Box::new(|t| t[1].3[0..4].copy_from_slice(&(-1i32).to_le_bytes())),
        ),
        (
            "qweight",
            Box::new(|t| {
                t.remove(0);
            }),
        ),
        // desc_act: without g_idx every column would read its neighbour's group.
        (
            "l.g_idx",
            Box::new(|t| {
                t.remove(3);
            }),
        ),
    ];
    for (needle, edit) in cases {
        let err = load_edited(edit).expect_err(needle);
        assert!(
            err.contains(needle),
            "expected an error about {needle:?}, got: {err}"
        );
    }
}

#[test]
fn malformed_quantization_configs_are_typed_errors() {
    use serde_json::json;
    let parse = |q: serde_json::Value| {
        HfQuantConfig::from_config_json(&json!({ "quantization_config": q }))
    };
    let gptq = |k: &str, v: serde_json::Value| {
        let mut q = json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true});
        q[k] = v;
        parse(q)
    };
    assert!(gptq("bits", json!(4)).unwrap().is_some());
    assert!(matches!(
        gptq("bits", json!(8)),
        Err(HfQuantError::Unsupported(_))
    ));
    assert!(matches!(
        gptq("bits", json!("four")),
        Err(HfQuantError::Config(_))
    ));
    assert!(matches!(
        gptq("group_size", json!(0)),
        Err(HfQuantError::Config(_))
    ));
    assert!(matches!(
        gptq("group_size", json!(1u64 << 40)),
        Err(HfQuantError::Config(_))
    ));
    assert_eq!(
        gptq("group_size", json!(-1)).unwrap().unwrap().group_size,
        None
    );
    assert!(matches!(
        gptq("sym", json!("yes")),
        Err(HfQuantError::Config(_))
    ));
    assert!(matches!(
        gptq("checkpoint_format", json!("gptq_v2")),
        Err(HfQuantError::Unsupported(_))
    ));
    assert!(matches!(
        gptq("quant_method", json!("fp8")),
        Err(HfQuantError::Unsupported(_))
    ));
    assert!(matches!(
        gptq("quant_method", json!(3)),
        Err(HfQuantError::Config(_))
    ));
    assert!(matches!(parse(json!([1, 2])), Err(HfQuantError::Config(_))));
    let awq = json!({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": true, "version": "gemv"});
    assert!(matches!(parse(awq), Err(HfQuantError::Unsupported(_))));
    let awq = json!({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": true, "version": "GEMM"});
    assert_eq!(parse(awq).unwrap().unwrap().group_size, Some(64));
}

#[test]
fn layers_a_format_cannot_hold_are_typed_errors() {
    let q = layer(16, 64, 32, true, true, 3);
    assert!(
        matches!(awq_format::pack(&q), Err(HfQuantError::Layout { .. })),
        "AWQ has no act-order"
    );
    let q = layer(16, 60, 32, true, false, 3);
    assert!(
        matches!(awq_format::pack(&q), Err(HfQuantError::Layout { .. })),
        "64 does not divide 60"
    );
    let q = layer(12, 64, 32, true, false, 3);
    assert!(
        matches!(gptq_format::pack(&q), Err(HfQuantError::Layout { .. })),
        "out 12"
    );
    let zero =
        GroupQuantized::new(8, 8, 8, vec![0; 64], vec![1.0; 8], vec![0; 8], vec![0; 8]).unwrap();
    assert!(
        matches!(gptq_format::pack(&zero), Err(HfQuantError::Layout { .. })),
        "zero 0 in GPTQ v1"
    );
    assert!(awq_format::pack(&zero).is_ok(), "AWQ stores zero 0");
    assert_eq!(MAXQ, 15);
}

/// The layers of the unpacker's golden files: (method, config, [(name, layer)]).
fn golden_layers() -> Vec<GoldenDir> {
    let gptq = HfQuantConfig {
        group_size: Some(32),
        ..gptq_config()
    };
    let awq = HfQuantConfig {
        method: QuantMethod::Awq,
        group_size: Some(32),
        desc_act: false,
        sym: false,
        damp_percent: 0.0,
    };
    vec![
        (
            "gptq",
            gptq,
            vec![
                ("act_order", layer(24, 96, 32, true, true, 1)),
                // 72 = 2 · 32 + 8: a short last group; asymmetric.
                ("short_group", layer(16, 72, 32, false, false, 2)),
            ],
        ),
        (
            "awq",
            awq,
            vec![
                ("a", layer(24, 128, 32, false, false, 3)),
                ("b", layer(8, 64, 32, false, false, 4)),
            ],
        ),
    ]
}

fn golden_dir(method: &str) -> std::path::PathBuf {
    ch01::fixtures_dir().join("golden/hf_quant").join(method)
}

fn packed_tensors(
    config: &HfQuantConfig,
    layers: &[(&str, GroupQuantized)],
) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let mut out = Vec::new();
    for (name, q) in layers {
        let p = match config.method {
            QuantMethod::Gptq => gptq_format::pack(q),
            QuantMethod::Awq => awq_format::pack(q),
        }
        .unwrap();
        let b = Bytes::of(&p);
        out.push((
            format!("{name}.qweight"),
            Dtype::I32,
            b.qweight.1,
            b.qweight.0,
        ));
        out.push((format!("{name}.qzeros"), Dtype::I32, b.qzeros.1, b.qzeros.0));
        out.push((format!("{name}.scales"), Dtype::F16, b.scales.1, b.scales.0));
        if let Some((g, shape)) = b.g_idx {
            out.push((format!("{name}.g_idx"), Dtype::I32, shape, g));
        }
    }
    out
}

/// Regenerates the unpacker's inputs:
/// `cargo test -p ch05-quantization --test suite -- --ignored hf_quant::`,
/// then `fixtures/scripts/hf_quant_unpack.py DIR DIR/dequantized.safetensors` for each.
#[test]
#[ignore]
fn write_unpacker_inputs() {
    for (method, config, layers) in golden_layers() {
        let dir = golden_dir(method);
        std::fs::create_dir_all(&dir).unwrap();
        let tensors = packed_tensors(&config, &layers);
        let tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone()))
            .collect();
        write_safetensors(&dir.join("model.safetensors"), &tensors);
        let json = serde_json::json!({ "quantization_config": config.to_json() });
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&json).unwrap(),
        )
        .unwrap();
    }
}

/// kiln's files (regenerated here and compared byte for byte with the committed ones) decode,
/// in the independent numpy unpacker, to exactly the weights kiln computes with.
#[test]
fn the_numpy_unpacker_reads_kilns_files_as_kiln_does() {
    for (method, config, layers) in golden_layers() {
        let dir = golden_dir(method);
        let committed = std::fs::read(dir.join("model.safetensors")).unwrap();
        let committed = safetensors::SafeTensors::deserialize(&committed).unwrap();
        for (name, dtype, shape, bytes) in packed_tensors(&config, &layers) {
            let t = committed.tensor(&name).unwrap();
            assert_eq!(
                (t.dtype(), t.shape()),
                (dtype, &shape[..]),
                "{method} {name}"
            );
            assert!(
                t.data() == &bytes[..],
                "{method} {name}: kiln's bytes changed"
            );
        }
        let numpy = std::fs::read(dir.join("dequantized.safetensors")).unwrap();
        let numpy = safetensors::SafeTensors::deserialize(&numpy).unwrap();
        let weights = ch01::Weights::open(&dir).unwrap();
        let loader = HfQuantLoader {
            config,
            dense: QuantLoader::native(),
        };
        for (name, q) in &layers {
            let read = loader.read(&weights, name, q.rows(), q.cols()).unwrap();
            assert_eq!(&read, q, "{method} {name}");
            let t = numpy.tensor(&format!("{name}.weight")).unwrap();
            assert_eq!(t.shape(), &[q.rows(), q.cols()]);
            let theirs: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let ours = read.dequantize();
            let differing = ours.iter().zip(&theirs).filter(|(a, b)| a != b).count();
            assert_eq!(
                differing, 0,
                "{method} {name}: {differing} weights differ from numpy's"
            );
        }
    }
}

/// A Q4_1 offset `−scale · zero` past f16's range (scale 8192, zero 15: −122,880) cannot be
/// stored in a block: the layer stays dense and computes the finite product.
#[test]
fn an_offset_past_f16s_range_keeps_the_layer_dense_and_finite() {
    let (rows, cols, group) = (2, 64, 32);
    let codes = vec![3u8; rows * cols];
    let scales = vec![8192.0; rows * cols / group];
    let zeros = vec![15u8; rows * cols / group];
    let g_idx = (0..cols).map(|c| (c / group) as u32).collect();
    let q = GroupQuantized::new(rows, cols, group, codes, scales, zeros, g_idx).unwrap();
    let layer = GroupLinear::new(&q, None).unwrap();
    assert_eq!(layer.kind(), GroupKind::Dense);
    let x = Array2::from_elem((1, cols), 1e-3f32);
    let y = layer.forward(x.view());
    // Each weight is 8192 · (3 − 15) = −98,304; the row sums 64 of them times 1e-3.
    for v in y.iter() {
        assert!((v + 98_304.0 * 64.0 * 1e-3).abs() < 1.0, "{v}");
    }
}
