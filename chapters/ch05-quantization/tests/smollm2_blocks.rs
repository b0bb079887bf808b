//! Every tensor of the real SmolLM2-135M-Instruct GGUF file (Q4_1, Q8_0 and F32 tensors),
//! decoded by kiln and by gguf-py, bit for bit (ignored by a plain `cargo test`: run it with
//! `-- --ignored`).
//!
//! Needs the file (`just fetch-smollm2`) and the index that
//! `fixtures/.venv-smollm2/bin/python fixtures/scripts/make_quant_golden.py --smollm2
//! fixtures/.cache/SmolLM2-135M-Instruct.Q4_1.gguf` writes into `fixtures/.cache/`: each tensor's
//! data offset, byte length, shape, type, and a checksum of gguf-py's decoding. The test reads
//! the bytes at those offsets itself, so it needs no GGUF reader.

use std::io::{Read, Seek, SeekFrom};

use ch01::fixtures_dir;
use ch05_quantization::GgmlType;
use ch05_quantization::blocks::dequantize;

#[derive(serde::Deserialize)]
struct Tensor {
    name: String,
    #[serde(rename = "type")]
    ty: String,
    shape: Vec<usize>,
    offset: u64,
    n_bytes: usize,
    checksum: String,
    first: f32,
}

/// The script's checksum: `Σ bits[i] · (2i + 1)` wrapping in u64.
fn checksum(values: &[f32]) -> u64 {
    values.iter().enumerate().fold(0u64, |h, (i, v)| {
        h.wrapping_add(u64::from(v.to_bits()).wrapping_mul(2 * i as u64 + 1))
    })
}

#[test]
#[ignore = "needs the converted SmolLM2 (just fetch-smollm2); run with --ignored"]
fn every_tensor_of_the_smollm2_file_decodes_as_gguf_py_does() {
    #[derive(serde::Deserialize)]
    struct Index {
        tensors: Vec<Tensor>,
    }
    let cache = fixtures_dir().join(".cache");
    let index_path = cache.join("quant-golden-smollm2.json");
    let text = std::fs::read_to_string(&index_path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run fixtures/scripts/make_quant_golden.py --smollm2 first",
            index_path.display()
        )
    });
    let index: Index = serde_json::from_str(&text).unwrap();
    let gguf = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut file = std::fs::File::open(&gguf).unwrap_or_else(|e| panic!("{}: {e}", gguf.display()));
    let mut types = std::collections::BTreeMap::<String, usize>::new();
    for t in &index.tensors {
        let ty = GgmlType::from_name(&t.ty).unwrap();
        let elems: usize = t.shape.iter().product();
        let mut bytes = vec![0u8; t.n_bytes];
        file.seek(SeekFrom::Start(t.offset)).unwrap();
        file.read_exact(&mut bytes).unwrap();
        let mut values = vec![0.0f32; elems];
        dequantize(ty, &bytes, &mut values).unwrap_or_else(|e| panic!("{}: {e}", t.name));
        assert_eq!(
            values[0].to_bits(),
            t.first.to_bits(),
            "{}: first value",
            t.name
        );
        assert_eq!(
            checksum(&values).to_string(),
            t.checksum,
            "{} ({ty})",
            t.name
        );
        *types.entry(t.ty.clone()).or_default() += 1;
    }
    assert!(types.get("Q4_1").copied().unwrap_or(0) > 100, "{types:?}");
    eprintln!(
        "decoded {} tensors bit for bit: {types:?}",
        index.tensors.len()
    );
}
