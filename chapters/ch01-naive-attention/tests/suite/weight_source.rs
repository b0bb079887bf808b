//! The `WeightSource` seam and shard specs: raw typed reads come back exactly, column shards
//! concatenate and row shards sum to the whole layer, a two-rank model recombines to the whole
//! model, and impossible splits are typed errors.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ch01_naive_attention::linear::DenseLoader;
use ch01_naive_attention::testing::{assert_rel_close, seeded_runner};
use ch01_naive_attention::{
    DenseLinear, Error, Linear, LinearLoader, LinearSpec, Llama, LlamaConfig, RawTensor,
    ShardError, ShardSpec, Split, TensorDtype, TensorParallel, WeightSource, Weights, fixtures_dir,
};
use half::{bf16, f16};
use ndarray::{Array2, Axis, concatenate, s};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use tempfile::TempDir;

/// A source held in memory: shows that the trait is implementable outside chapter 1.
struct MemorySource {
    location: PathBuf,
    tensors: HashMap<String, (TensorDtype, Vec<usize>, Vec<u8>)>,
}

impl WeightSource for MemorySource {
    fn location(&self) -> &Path {
        &self.location
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn tensor(&self, name: &str) -> ch01_naive_attention::Result<RawTensor<'_>> {
        let (dtype, shape, bytes) = self.tensors.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            location: self.location.clone(),
        })?;
        RawTensor::new(
            name,
            &self.location,
            *dtype,
            shape.clone(),
            Cow::Borrowed(&bytes[..]),
        )
    }
}

/// `values` stored as `dtype` (F32, F16 or BF16), little-endian.
fn encode(values: &[f32], dtype: TensorDtype) -> Vec<u8> {
    match dtype {
        TensorDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        TensorDtype::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        TensorDtype::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        other => panic!("test encodes only float dtypes, not {other}"),
    }
}

/// A layer `proj` of shape `[out, in]` (with bias `[out]` when `bias`) of random values.
fn random_layer(
    in_f: usize,
    out_f: usize,
    bias: bool,
    dtype: TensorDtype,
    rng: &mut ChaCha8Rng,
) -> MemorySource {
    let mut random =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let mut tensors = HashMap::new();
    let w = random(out_f * in_f);
    tensors.insert(
        "proj.weight".to_string(),
        (dtype, vec![out_f, in_f], encode(&w, dtype)),
    );
    if bias {
        let b = random(out_f);
        tensors.insert(
            "proj.bias".to_string(),
            (dtype, vec![out_f], encode(&b, dtype)),
        );
    }
    MemorySource {
        location: PathBuf::from("memory"),
        tensors,
    }
}

/// Elements in row-major order, whatever the array's memory layout.
fn flat(a: &Array2<f32>) -> Vec<f32> {
    a.iter().copied().collect()
}

fn load(source: &dyn WeightSource, spec: LinearSpec<'_>) -> Box<dyn Linear> {
    DenseLoader.load(source, &spec).unwrap()
}

#[test]
fn column_shards_concatenate_and_row_shards_sum_to_the_whole_layer() {
    // (world, split, local size of the split dimension, size of the other, bias, dtype, T, seed)
    let cases = (
        1usize..=4,
        prop_oneof![Just(Split::Whole), Just(Split::Column), Just(Split::Row)],
        1usize..9,
        1usize..37,
        any::<bool>(),
        prop_oneof![
            Just(TensorDtype::F32),
            Just(TensorDtype::F16),
            Just(TensorDtype::BF16)
        ],
        1usize..5,
        any::<u64>(),
    );
    seeded_runner(96, 53)
        .run(
            &cases,
            |(world, split, local, other, bias, dtype, tokens, seed)| {
                // Only the split dimension must divide by world; the other is any size at all.
                let (in_f, out_f) = match split {
                    Split::Whole => (local * world, other),
                    Split::Column => (other, local * world),
                    Split::Row => (local * world, other),
                };
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let source = random_layer(in_f, out_f, bias, dtype, &mut rng);
                let x = Array2::from_shape_fn((tokens, in_f), |_| rng.random_range(-1.0f32..1.0)); // [T, in]
                let spec = LinearSpec::whole("proj", in_f, out_f, bias);
                let whole = load(&source, spec).forward(x.view()); // [T, out]

                let shards: Vec<Array2<f32>> = (0..world)
                    .map(|rank| {
                        let shard = ShardSpec { split, rank, world };
                        let layer = load(&source, spec.with_shard(shard));
                        let (rows, cols) = shard.ranges("proj", in_f, out_f).unwrap();
                        prop_assert_eq!(
                            (layer.in_features(), layer.out_features()),
                            (cols.len(), rows.len())
                        );
                        Ok(layer.forward(x.slice(s![.., cols])))
                    })
                    .collect::<Result<_, _>>()?;
                let combined = match split {
                    // every rank holds the whole layer: any one of them is the answer
                    Split::Whole => shards[world - 1].clone(),
                    Split::Column => {
                        let views: Vec<_> = shards.iter().map(|y| y.view()).collect();
                        concatenate(Axis(1), &views).unwrap() // [T, out]
                    }
                    Split::Row => shards
                        .iter()
                        .fold(Array2::<f32>::zeros((tokens, out_f)), |acc, y| acc + y),
                };
                assert_rel_close(
                    &format!("{split:?} world {world}, [{out_f}, {in_f}], bias {bias}, {dtype}"),
                    &flat(&combined),
                    &flat(&whole),
                    1e-5,
                );
                Ok(())
            },
        )
        .unwrap();
}

fn tiny() -> PathBuf {
    fixtures_dir().join("shakespeare-tiny")
}

#[test]
fn two_rank_model_has_local_heads_and_recombines_to_the_whole() {
    let whole = Llama::load(&tiny()).unwrap();
    let world = 2;
    let ranks: Vec<Llama> = (0..world)
        .map(|rank| {
            Llama::load_shard(&tiny(), &DenseLoader, TensorParallel { rank, world }).unwrap()
        })
        .collect();
    let c = &whole.config;

    for (rank, model) in ranks.iter().enumerate() {
        assert_eq!(model.shard, TensorParallel { rank, world });
        for layer in &model.layers {
            let shape = layer.self_attn.shape();
            assert_eq!(shape.num_heads, c.num_attention_heads / world);
            assert_eq!(shape.num_kv_heads, c.num_key_value_heads / world);
            assert_eq!(shape.head_dim, c.head_dim);
            assert_eq!(
                layer.mlp.up_proj.out_features(),
                c.intermediate_size / world
            );
            assert_eq!(
                layer.mlp.down_proj.in_features(),
                c.intermediate_size / world
            );
        }
    }

    // q_proj's column shards concatenate to the whole q_proj.
    let mut rng = ChaCha8Rng::seed_from_u64(53);
    let x = Array2::from_shape_fn((3, c.hidden_size), |_| rng.random_range(-1.0f32..1.0)); // [3, hidden]
    for l in 0..c.num_hidden_layers {
        let parts: Vec<Array2<f32>> = ranks
            .iter()
            .map(|m| m.layers[l].self_attn.q_proj.forward(x.view()))
            .collect();
        let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
        let q = concatenate(Axis(1), &views).unwrap(); // [3, heads * head_dim]
        let expected = whole.layers[l].self_attn.q_proj.forward(x.view());
        assert_rel_close(
            &format!("layer {l} q_proj"),
            &flat(&q),
            &flat(&expected),
            1e-6,
        );
    }

    // The whole forward, with the all-reduces done by hand: the ranks' attention and MLP
    // outputs summed after each block. Same logits as the unsharded model.
    // The embedding is split by vocabulary: the ranks' partial embeddings sum to the whole.
    let tokens = [3u32, 17, 99, 250, 7, 1024, 2100, 4095, 5];
    let mut h = ranks.iter().fold(
        Array2::<f32>::zeros((tokens.len(), c.hidden_size)),
        |acc, m| acc + m.embed(&tokens),
    ); // [T, hidden]
    assert_eq!(h, whole.embed(&tokens));
    for l in 0..c.num_hidden_layers {
        let n = ranks[0].layers[l].input_layernorm.forward(h.view());
        let attn = ranks.iter().fold(Array2::<f32>::zeros(h.dim()), |acc, m| {
            acc + m.layers[l].self_attn.forward(n.view(), &m.rope)
        });
        h = h + attn;
        let n = ranks[0].layers[l]
            .post_attention_layernorm
            .forward(h.view());
        let mlp = ranks.iter().fold(Array2::<f32>::zeros(h.dim()), |acc, m| {
            acc + m.layers[l].mlp.forward(n.view())
        });
        h = h + mlp;
    }
    // The head is split by vocabulary too: the ranks' logits concatenate (an all-gather).
    let normed = ranks[1].norm.forward(h.view());
    let parts: Vec<Array2<f32>> = ranks
        .iter()
        .map(|m| m.lm_head.forward(normed.view()))
        .collect(); // world × [T, vocab / world]
    let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
    let logits = concatenate(Axis(1), &views).unwrap(); // [T, vocab]
    let expected = whole.forward(&tokens).unwrap();
    assert_rel_close("two-rank logits", &flat(&logits), &flat(&expected), 1e-5);
}

#[test]
fn raw_typed_tensors_come_back_exactly() {
    let qweight: Vec<i32> = vec![-1, 0, 7, i32::MAX, i32::MIN, 0x1234_5678];
    let qweight_bytes: Vec<u8> = qweight.iter().flat_map(|v| v.to_le_bytes()).collect();
    let zeros: Vec<u8> = vec![0, 1, 2, 254, 255];
    let fp8: Vec<u8> = vec![0x00, 0x38, 0xb8, 0x7e]; // e4m3: 0, 1, -1, 448
    let fp8_e5m2: Vec<u8> = vec![0x3c, 0xbc];
    let counts: Vec<u8> = [1i64, -2].iter().flat_map(|v| v.to_le_bytes()).collect();

    let dir = TempDir::new().unwrap();
    let views = vec![
        (
            "proj.qweight",
            TensorView::new(Dtype::I32, vec![2, 3], &qweight_bytes).unwrap(),
        ),
        (
            "proj.qzeros",
            TensorView::new(Dtype::U8, vec![5], &zeros).unwrap(),
        ),
        (
            "proj.weight_fp8",
            TensorView::new(Dtype::F8_E4M3, vec![2, 2], &fp8).unwrap(),
        ),
        (
            "proj.weight_e5m2",
            TensorView::new(Dtype::F8_E5M2, vec![1, 2], &fp8_e5m2).unwrap(),
        ),
        (
            "proj.counts",
            TensorView::new(Dtype::I64, vec![2], &counts).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();

    let weights = Weights::open(dir.path()).unwrap();
    let source: &dyn WeightSource = &weights;
    assert_eq!(source.location(), dir.path());
    assert!(source.contains("proj.qweight"));
    assert!(!source.contains("proj.scales"));
    for (name, dtype, shape, bytes) in [
        ("proj.qweight", TensorDtype::I32, vec![2, 3], &qweight_bytes),
        ("proj.qzeros", TensorDtype::U8, vec![5], &zeros),
        ("proj.weight_fp8", TensorDtype::F8E4M3, vec![2, 2], &fp8),
        (
            "proj.weight_e5m2",
            TensorDtype::F8E5M2,
            vec![1, 2],
            &fp8_e5m2,
        ),
        ("proj.counts", TensorDtype::I64, vec![2], &counts),
    ] {
        let raw = source.tensor(name).unwrap();
        assert_eq!(raw.dtype(), dtype, "{name}");
        assert_eq!(raw.shape(), &shape[..], "{name}");
        assert_eq!(raw.bytes(), &bytes[..], "{name}");
        assert_eq!(
            raw.bytes().len(),
            raw.len() * dtype.size_bytes().unwrap(),
            "{name}"
        );
    }
    let decoded: Vec<i32> = source
        .tensor("proj.qweight")
        .unwrap()
        .bytes()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(decoded, qweight);

    // The dense f32 path refuses integer and FP8 tensors by name, and a missing one by name.
    let error = source.matrix("proj.qweight", 2, 3).unwrap_err();
    assert!(
        matches!(&error, Error::UnsupportedDtype { name, dtype } if name == "proj.qweight" && dtype == "I32"),
        "{error}"
    );
    let error = source.matrix("proj.weight_fp8", 2, 2).unwrap_err();
    assert!(error.to_string().contains("proj.weight_fp8"), "{error}");
    assert!(matches!(
        source.tensor("proj.scales"),
        Err(Error::MissingTensor { .. })
    ));
}

#[test]
fn sharded_checkpoint_is_a_source_too() {
    let dir = fixtures_dir().join("random/sharded");
    let config = LlamaConfig::from_dir(&dir).unwrap();
    let weights = Weights::open(&dir).unwrap();
    let raw = weights.tensor("model.norm.weight").unwrap();
    assert_eq!(raw.shape(), &[config.hidden_size]);
    let whole =
        Llama::from_source(config, &weights, &DenseLoader, TensorParallel::whole()).unwrap();
    let reference = Llama::load(&dir).unwrap();
    let tokens = [1u32, 2, 3];
    assert_eq!(
        whole.forward(&tokens).unwrap(),
        reference.forward(&tokens).unwrap()
    );
}

#[test]
fn impossible_shard_specs_are_typed_errors() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let source = random_layer(7, 5, true, TensorDtype::F32, &mut rng);
    let spec = LinearSpec::whole("proj", 7, 5, true);
    let load = |shard: ShardSpec| DenseLinear::load(&source, &spec.with_shard(shard)).err();

    assert!(matches!(
        load(ShardSpec::column(2, 2)),
        Some(Error::Shard(ShardError::RankOutOfRange {
            rank: 2,
            world: 2
        }))
    ));
    assert!(matches!(
        load(ShardSpec::row(0, 0)),
        Some(Error::Shard(ShardError::EmptyWorld))
    ));
    let error = load(ShardSpec::column(0, 2)).unwrap();
    assert!(
        matches!(
            &error,
            Error::Shard(ShardError::NotDivisible {
                size: 5,
                world: 2,
                ..
            })
        ),
        "{error}"
    );
    assert!(
        error.to_string().contains("out_features of `proj`"),
        "{error}"
    );
    assert!(matches!(
        load(ShardSpec::row(1, 3)),
        Some(Error::Shard(ShardError::NotDivisible {
            size: 7,
            world: 3,
            ..
        }))
    ));
    // Whole and one-rank splits of any size are fine.
    assert!(load(ShardSpec::whole()).is_none());
    assert!(load(ShardSpec::row(0, 1)).is_none());

    // Model level: 4 query heads and 2 KV heads of shakespeare-tiny.
    let shard = |rank, world| {
        Llama::load_shard(&tiny(), &DenseLoader, TensorParallel { rank, world }).err()
    };
    let error = shard(0, 3).unwrap();
    assert!(
        matches!(&error, Error::Shard(ShardError::NotDivisible { what, size: 4, world: 3 }) if what == "num_attention_heads"),
        "{error}"
    );
    // 4 ranks on 2 KV heads: each KV head is replicated on two ranks.
    assert!(shard(3, 4).is_none());
    assert!(matches!(
        shard(2, 2),
        Some(Error::Shard(ShardError::RankOutOfRange {
            rank: 2,
            world: 2
        }))
    ));
    assert!(matches!(
        shard(0, 0),
        Some(Error::Shard(ShardError::EmptyWorld))
    ));
}

/// A loader that builds a v_proj with half of k_proj's output features.
struct HalfV;

impl LinearLoader for HalfV {
    fn build(
        &self,
        weight: Array2<f32>,
        bias: Option<ndarray::Array1<f32>>,
    ) -> ch01_naive_attention::Result<Box<dyn Linear>> {
        Ok(Box::new(DenseLinear::new(weight, bias)))
    }

    fn load(
        &self,
        source: &dyn WeightSource,
        spec: &LinearSpec<'_>,
    ) -> ch01_naive_attention::Result<Box<dyn Linear>> {
        let dense = DenseLinear::load(source, spec)?;
        if spec.name.ends_with("v_proj") {
            let half = dense.weight().nrows() / 2;
            return self.build(dense.weight().slice(s![..half, ..]).to_owned(), None);
        }
        self.build(dense.weight().clone(), None)
    }
}

#[test]
fn projections_that_disagree_are_a_typed_error() {
    let error = Llama::load_with(&tiny(), &HalfV).err().unwrap();
    assert!(
        matches!(&error, Error::InconsistentLayer { layer: 0, message } if message.contains("v_proj")),
        "{error}"
    );
}

#[test]
fn malformed_raw_tensors_are_errors() {
    let error = RawTensor::new(
        "t",
        Path::new("memory"),
        TensorDtype::I32,
        vec![2, 2],
        vec![0u8; 15],
    )
    .unwrap_err();
    assert!(matches!(error, Error::Tensor { .. }), "{error}");
    assert!(error.to_string().contains("`t`"), "{error}");
    // A block outside the tensor is an error, not a panic.
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let source = random_layer(4, 3, false, TensorDtype::BF16, &mut rng);
    assert!(
        source
            .matrix_block("proj.weight", [3, 4], 0..4, 0..4)
            .is_err()
    );
    assert!(
        source
            .matrix_block("proj.weight", [3, 4], 1..3, 2..4)
            .is_ok()
    );
    assert!(matches!(
        source.matrix_block("proj.weight", [4, 3], 0..1, 0..1),
        Err(Error::ShapeMismatch { .. })
    ));
}

/// The header is parsed once, at open: a tensor read afterwards slices the map with what open
/// recorded, never parsing the header again (which made loading O(tensors × header)). Shown by
/// spoiling the header's length prefix after open, a part of the file no later read touches:
/// every tensor still reads back as it did, where a re-parse would fail.
#[test]
fn weights_parse_the_header_once_at_open() {
    use std::io::{Seek, SeekFrom, Write};
    let tmp = TempDir::new().unwrap();
    let fixture = fixtures_dir().join("random/gqa");
    let path = tmp.path().join("model.safetensors");
    std::fs::copy(fixture.join("model.safetensors"), &path).unwrap();
    let expected = Weights::open(&fixture).unwrap();
    let weights = Weights::open(tmp.path()).unwrap();
    let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.seek(SeekFrom::Start(0)).unwrap();
    file.write_all(&u64::MAX.to_le_bytes()).unwrap();
    file.sync_all().unwrap();
    assert!(Weights::open(tmp.path()).is_err(), "the header is spoiled");
    let bytes = std::fs::read(fixture.join("model.safetensors")).unwrap();
    let header = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert!(!header.names().is_empty());
    for name in header.names() {
        let (ours, theirs) = (
            weights.tensor(name).unwrap(),
            expected.tensor(name).unwrap(),
        );
        assert_eq!(ours.dtype(), theirs.dtype(), "{name}");
        assert_eq!(ours.shape(), theirs.shape(), "{name}");
        assert_eq!(ours.bytes(), theirs.bytes(), "{name}");
    }
}
