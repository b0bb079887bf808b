//! Comparison helpers shared by every chapter's tests: tolerances per dtype, and on failure a
//! message that says where and by how much two outputs differ.

use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// A proptest runner with a fixed seed, so every run checks the same `cases` inputs and a failure
/// reproduces exactly. Each test file passes its own `seed`.
pub fn seeded_runner(cases: u32, seed: u8) -> TestRunner {
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(
        config,
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    )
}

/// `‖a - b‖₂ / ‖b‖₂` (b is the reference). Both slices have the same length.
pub fn relative_l2(actual: &[f32], expected: &[f32]) -> f64 {
    assert_eq!(actual.len(), expected.len(), "length mismatch");
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&a, &e) in actual.iter().zip(expected) {
        diff += (a as f64 - e as f64).powi(2);
        norm += (e as f64).powi(2);
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// Index and size of the largest absolute difference.
pub fn max_abs_diff(actual: &[f32], expected: &[f32]) -> (usize, f32) {
    actual
        .iter()
        .zip(expected)
        .map(|(a, e)| (a - e).abs())
        .enumerate()
        .fold((0, 0.0), |best, (i, d)| {
            if d > best.1 || d.is_nan() {
                (i, d)
            } else {
                best
            }
        })
}

/// Panics with a diagnostic unless `relative_l2(actual, expected) <= tolerance`.
#[track_caller]
pub fn assert_rel_close(what: &str, actual: &[f32], expected: &[f32], tolerance: f64) {
    let rel = relative_l2(actual, expected);
    if rel.is_nan() || rel > tolerance {
        let (i, d) = max_abs_diff(actual, expected);
        panic!(
            "{what}: relative L2 error {rel:.3e} > {tolerance:.0e}; largest difference {d:.3e} at index {i} \
             (actual {}, expected {})",
            actual[i], expected[i]
        );
    }
}

/// One golden case from `fixtures/golden/<name>.json` (written by `fixtures/scripts/make_golden.py`).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct GoldenCase {
    pub prompt: String,
    pub input_ids: Vec<u32>,
    /// 32 greedy tokens after the prompt (full recompute, EOS ignored).
    pub greedy_ids: Vec<u32>,
    pub greedy_text: String,
}

/// A model's golden outputs: its directory (relative to `fixtures/`), its cases, and for case `i`
/// the logits `[T, vocab]` that `transformers` computed in f32 (flattened row-major).
#[derive(Debug, Clone)]
pub struct Golden {
    pub model_dir: std::path::PathBuf,
    pub cases: Vec<GoldenCase>,
    pub logits: Vec<Vec<f32>>,
}

/// Reads `fixtures/golden/<name>.json` and `<name>.safetensors`. Panics with the file's name on any
/// problem: this is for tests, on committed files.
pub fn load_golden(name: &str) -> Golden {
    #[derive(serde::Deserialize)]
    struct File {
        model: String,
        cases: Vec<GoldenCase>,
    }
    let dir = crate::fixtures_dir().join("golden");
    let json_path = dir.join(format!("{name}.json"));
    let text = std::fs::read_to_string(&json_path)
        .unwrap_or_else(|e| panic!("{}: {e}", json_path.display()));
    let file: File =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", json_path.display()));
    let tensors_path = dir.join(format!("{name}.safetensors"));
    let bytes =
        std::fs::read(&tensors_path).unwrap_or_else(|e| panic!("{}: {e}", tensors_path.display()));
    let tensors = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap_or_else(|e| panic!("{}: {e}", tensors_path.display()));
    let logits = (0..file.cases.len())
        .map(|i| {
            let view = tensors
                .tensor(&format!("logits.{i}"))
                .unwrap_or_else(|e| panic!("{}: {e}", tensors_path.display()));
            view.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
        .collect();
    Golden {
        model_dir: crate::fixtures_dir().join(file.model),
        cases: file.cases,
        logits,
    }
}
