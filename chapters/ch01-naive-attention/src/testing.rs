//! Comparison helpers shared by every chapter's tests: tolerances per dtype, and on failure a
//! message that says where and by how much two outputs differ.

use std::any::Any;
use std::fmt;

use proptest::test_runner::{
    Config, FailurePersistence, PersistedSeed, RngAlgorithm, RngSeed, TestRng, TestRunner,
};

// ---------------------------------------------------------------------------------------------
// Seeded property-test runners, with environment overrides
// ---------------------------------------------------------------------------------------------

/// A u64 seed that replaces the test file's own.
pub const SEED_VAR: &str = "PROPTEST_RNG_SEED";
/// An absolute case count; wins over [`SCALE_VAR`].
pub const CASES_VAR: &str = "PROPTEST_CASES";
/// A whole-number multiplier of every test's own case count (`just soak` sets 10).
pub const SCALE_VAR: &str = "KILN_PROPTEST_SCALE";

/// What a seeded run does once the environment has been read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunSettings {
    /// Cases to run.
    pub cases: u32,
    /// `Some(seed)` from [`SEED_VAR`], or `None` for the test file's own fixed seed.
    pub seed: Option<u64>,
}

/// An environment override that is not a number of the kind it must be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is not {expected}")]
pub struct EnvError {
    pub var: &'static str,
    pub value: String,
    pub expected: &'static str,
}

/// Applies the overrides to a test's own case count: `seed` ([`SEED_VAR`], a decimal u64)
/// replaces the file's seed; `cases_var` ([`CASES_VAR`], a positive integer) replaces the count;
/// otherwise `scale` ([`SCALE_VAR`], a positive integer, default 1) multiplies it (saturating).
/// Unset or empty values are ignored. A pure function of its arguments, so that it is tested
/// without touching the process environment.
pub fn run_settings(
    cases: u32,
    seed: Option<&str>,
    cases_var: Option<&str>,
    scale: Option<&str>,
) -> Result<RunSettings, EnvError> {
    fn parse<T: std::str::FromStr + PartialOrd + From<u8>>(
        var: &'static str,
        value: Option<&str>,
        expected: &'static str,
        min: u8,
    ) -> Result<Option<T>, EnvError> {
        let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        match value.parse::<T>() {
            Ok(v) if v >= T::from(min) => Ok(Some(v)),
            _ => Err(EnvError {
                var,
                value: value.to_string(),
                expected,
            }),
        }
    }
    let seed = parse::<u64>(SEED_VAR, seed, "a decimal u64 seed", 0)?;
    let absolute = parse::<u32>(CASES_VAR, cases_var, "a positive case count", 1)?;
    let scale = parse::<u32>(SCALE_VAR, scale, "a positive whole multiplier", 1)?;
    let cases = absolute.unwrap_or_else(|| cases.saturating_mul(scale.unwrap_or(1)));
    Ok(RunSettings { cases, seed })
}

/// [`run_settings`] on this process's environment; panics with the variable and its value if
/// one is malformed (this is for tests).
fn settings_from_env(cases: u32) -> RunSettings {
    let var = |name| std::env::var(name).ok();
    run_settings(
        cases,
        var(SEED_VAR).as_deref(),
        var(CASES_VAR).as_deref(),
        var(SCALE_VAR).as_deref(),
    )
    .unwrap_or_else(|e| panic!("bad property-test setting: {e}"))
}

/// A proptest runner with a fixed seed, so every run checks the same `cases` inputs and a failure
/// reproduces exactly. Each test file passes its own `seed`.
///
/// The environment can grow or redirect a run ([`run_settings`]): `PROPTEST_RNG_SEED=<u64>` draws
/// other inputs, `KILN_PROPTEST_SCALE=<n>` runs n times the cases, `PROPTEST_CASES=<n>` runs
/// exactly n. On a failure the runner prints, with the test's output, the settings that
/// reproduce it.
pub fn seeded_runner(cases: u32, seed: u8) -> TestRunner {
    let settings = settings_from_env(cases);
    let config = Config {
        cases: settings.cases,
        failure_persistence: Some(Box::new(ReportFailure { settings })),
        ..Config::default()
    };
    match settings.seed {
        // The file's own seed: ChaCha from 32 copies of the byte (the inputs every run checks).
        None => TestRunner::new_with_rng(
            config,
            TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
        ),
        Some(seed) => TestRunner::new(Config {
            rng_algorithm: RngAlgorithm::ChaCha,
            rng_seed: RngSeed::Fixed(seed),
            ..config
        }),
    }
}

/// The config of a `proptest!` block, with the same overrides as [`seeded_runner`]: `cases`
/// inputs drawn by ChaCha from `seed`, unless the environment says otherwise.
pub fn seeded_config(cases: u32, seed: u64) -> Config {
    let env = settings_from_env(cases);
    let settings = RunSettings {
        cases: env.cases,
        seed: Some(env.seed.unwrap_or(seed)),
    };
    Config {
        cases: settings.cases,
        rng_algorithm: RngAlgorithm::ChaCha,
        rng_seed: RngSeed::Fixed(env.seed.unwrap_or(seed)),
        failure_persistence: Some(Box::new(ReportFailure { settings })),
        ..Config::default()
    }
}

/// proptest's hook for a failing case, used only to say how to rerun it: it saves and loads
/// nothing (every run checks the same inputs; there are no failure files).
#[derive(Debug, Clone, PartialEq)]
struct ReportFailure {
    settings: RunSettings,
}

impl FailurePersistence for ReportFailure {
    fn load_persisted_failures2(&self, _source_file: Option<&'static str>) -> Vec<PersistedSeed> {
        Vec::new()
    }

    fn save_persisted_failure2(
        &mut self,
        _source_file: Option<&'static str>,
        _seed: PersistedSeed,
        _shrunken_value: &dyn fmt::Debug,
    ) {
        let RunSettings { cases, seed } = self.settings;
        match seed {
            Some(seed) => eprintln!(
                "property test failed; reproduce with {SEED_VAR}={seed} {CASES_VAR}={cases}"
            ),
            None => eprintln!(
                "property test failed on the test file's own seed; reproduce with \
                 {CASES_VAR}={cases} and {SEED_VAR} unset"
            ),
        }
    }

    fn box_clone(&self) -> Box<dyn FailurePersistence> {
        Box::new(self.clone())
    }

    fn eq(&self, other: &dyn FailurePersistence) -> bool {
        other.as_any().downcast_ref::<ReportFailure>() == Some(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

// ---------------------------------------------------------------------------------------------
// Comparing outputs: tolerances per dtype, and where and by how much outputs differ
// ---------------------------------------------------------------------------------------------

/// How far an output may be from its reference, element by element:
/// `|actual − expected| <= atol + rtol · |expected|` (NaN never passes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Relative part, scaled by the reference element.
    pub rtol: f32,
    /// Absolute part, for elements whose sum cancelled to near zero, where a relative error
    /// means nothing.
    pub atol: f32,
}

impl Tolerance {
    /// Computed in f32 from f32 (or exactly widened) inputs, against a reference in f64 or in f32
    /// summed in another order. f32's unit roundoff is u = 2⁻²⁴ ≈ 6·10⁻⁸; a sum of n products
    /// accumulated in f32 errs by at most about n·u times `Σ|aᵢ·bᵢ|`, and typically √n·u; the
    /// kernels' sums have n up to a few thousand, split into 8 or more partial sums, which keeps
    /// one layer's outputs within about 10⁻⁶ of the inputs' scale. 10⁻⁵, relative and absolute
    /// (inputs of order 1), leaves a margin of ten.
    pub const F32: Tolerance = Tolerance {
        rtol: 1e-5,
        atol: 1e-5,
    };

    /// One side rounds its inputs to bf16 and the other does not. bf16 keeps 8 significant bits
    /// (7 stored and the implicit one), so rounding to nearest moves an element by at most 2⁻⁹
    /// of itself, and 2⁻⁸ bounds it with room for a second rounding; summed in f32 (whose own
    /// error is negligible beside it), a product's error is at most 2⁻⁸ · `Σ|aᵢ·bᵢ|`, and
    /// typically far less as the roundings' signs cancel. Four times that, 2⁻⁶ ≈ 1.6·10⁻²,
    /// relative and absolute, holds for outputs whose terms do not cancel by more than 4x.
    pub const BF16: Tolerance = Tolerance {
        rtol: 1.0 / 64.0,
        atol: 1.0 / 64.0,
    };

    /// The same tolerance times `factor`: for a comparison whose error compounds through several
    /// such steps (the layers of a model), with the reason written where it is used.
    pub fn times(self, factor: f32) -> Tolerance {
        Tolerance {
            rtol: self.rtol * factor,
            atol: self.atol * factor,
        }
    }

    /// Whether one element is within the tolerance (false for NaN on either side).
    pub fn allows(&self, actual: f32, expected: f32) -> bool {
        (actual - expected).abs() <= self.atol + self.rtol * expected.abs()
    }
}

/// Where and by how much `actual` differs from `expected` (the reference).
#[derive(Debug, Clone, PartialEq)]
pub struct Diff {
    /// Elements compared.
    pub len: usize,
    /// Index and size of the largest absolute difference (NaN counts as largest).
    pub max_abs: (usize, f32),
    /// `‖actual − expected‖₂ / ‖expected‖₂`.
    pub rel_l2: f64,
    /// Elements outside the tolerance.
    pub over: usize,
    /// The first of them.
    pub first_over: Option<usize>,
}

impl Diff {
    /// Compares two slices of the same length (panics otherwise: a test's own mistake).
    pub fn new(actual: &[f32], expected: &[f32], tolerance: Tolerance) -> Diff {
        assert_eq!(actual.len(), expected.len(), "length mismatch");
        let (over, first_over) = actual
            .iter()
            .zip(expected)
            .enumerate()
            .filter(|(_, (a, e))| !tolerance.allows(**a, **e))
            .fold((0, None), |(n, first), (i, _)| (n + 1, first.or(Some(i))));
        Diff {
            len: actual.len(),
            max_abs: max_abs_diff(actual, expected),
            rel_l2: relative_l2(actual, expected),
            over,
            first_over,
        }
    }

    /// A failure message's body: the largest difference and its position (also as a
    /// multi-index, `[row, col]` for a matrix, when `shape` is given), the relative L2, and how
    /// many elements are over the tolerance, with the first of them.
    pub fn report(&self, actual: &[f32], expected: &[f32], shape: &[usize]) -> String {
        let at = |i: usize| {
            if shape.is_empty() {
                return format!("index {i}");
            }
            let mut rest = i;
            let mut index = vec![0; shape.len()];
            for (d, &n) in shape.iter().enumerate().rev() {
                index[d] = rest % n.max(1);
                rest /= n.max(1);
            }
            format!("index {i} {index:?}")
        };
        let mut report = String::new();
        let (i, d) = self.max_abs;
        if i < self.len {
            report += &format!(
                "largest difference {d:.3e} at {} (actual {}, expected {}); ",
                at(i),
                actual[i],
                expected[i]
            );
        }
        report += &format!(
            "relative L2 {:.3e}; {} of {} elements over tolerance",
            self.rel_l2, self.over, self.len
        );
        if let Some(f) = self.first_over {
            report += &format!(
                ", the first at {} (actual {}, expected {})",
                at(f),
                actual[f],
                expected[f]
            );
        }
        report
    }
}

/// Panics with a [`Diff`] report unless every element of `actual` is within `tolerance` of
/// `expected` (the reference).
#[track_caller]
pub fn assert_close(what: &str, actual: &[f32], expected: &[f32], tolerance: Tolerance) {
    assert_close_shaped(what, actual, expected, &[], tolerance);
}

/// [`assert_close`] for a row-major tensor of `shape`, which the report uses to give positions
/// as `[row, col]` (or as many indices as the shape has).
#[track_caller]
pub fn assert_close_shaped(
    what: &str,
    actual: &[f32],
    expected: &[f32],
    shape: &[usize],
    tolerance: Tolerance,
) {
    assert_eq!(actual.len(), expected.len(), "{what}: length mismatch");
    let diff = Diff::new(actual, expected, tolerance);
    if diff.over > 0 {
        panic!(
            "{what}: not within {tolerance:?}: {}",
            diff.report(actual, expected, shape)
        );
    }
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

/// Panics with a diagnostic unless `relative_l2(actual, expected) <= tolerance`: one number for
/// a whole tensor, for outputs that went through many layers (a model's logits), where single
/// elements that cancelled to near zero carry relative errors that mean nothing. The report is
/// [`Diff`]'s, counting the elements outside [`Tolerance::F32`].
#[track_caller]
pub fn assert_rel_close(what: &str, actual: &[f32], expected: &[f32], tolerance: f64) {
    let rel = relative_l2(actual, expected);
    if rel.is_nan() || rel > tolerance {
        let diff = Diff::new(actual, expected, Tolerance::F32);
        panic!(
            "{what}: relative L2 error {rel:.3e} > {tolerance:.0e}; {}",
            diff.report(actual, expected, &[])
        );
    }
}

/// The largest logit's index and its lead over the runner-up (0 for a tie, NaN if a logit is
/// NaN, and +∞ for a row of one logit).
pub fn top2_margin(row: &[f32]) -> (usize, f32) {
    let (mut best, mut first, mut second) = (0, f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            return (i, f32::NAN);
        }
        if v > first {
            (best, first, second) = (i, v, first);
        } else if v > second {
            second = v;
        }
    }
    (best, first - second)
}

/// Checks greedy tokens made by another implementation (`expected`) against this one's
/// `logits` [T, vocab], computed with `expected` fed in (teacher forcing: row i is the
/// distribution `expected[i]` was drawn from).
///
/// Two implementations whose logit rows agree within relative L2 `rel_l2` differ in any
/// element by at most `rel_l2 · ‖row‖₂`, so their argmaxes can differ only where the top-2
/// margin is at most twice that. A row with a larger margin must pick `expected[i]`; a row
/// with a smaller one is a near tie that summation order may break either way, and is skipped.
/// Returns the index of the first near tie (T if none): greedy generations by the two
/// implementations must agree token for token before it, and may part after it.
#[track_caller]
pub fn assert_greedy_agrees(
    what: &str,
    logits: &[f32],
    vocab: usize,
    expected: &[u32],
    rel_l2: f64,
) -> usize {
    assert_eq!(
        logits.len(),
        expected.len() * vocab,
        "{what}: logits are [T, vocab]"
    );
    let mut first_tie = expected.len();
    for (i, (row, &token)) in logits.chunks_exact(vocab).zip(expected).enumerate() {
        let (argmax, margin) = top2_margin(row);
        let norm = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        let bound = 2.0 * rel_l2 * norm;
        if (margin as f64) > bound {
            assert_eq!(
                argmax, token as usize,
                "{what}: position {i}: argmax {argmax} leads by {margin:.3e} (> {bound:.1e}), \
                 expected token {token}"
            );
        } else {
            first_tie = first_tie.min(i);
        }
    }
    first_tie
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

/// A global allocator for tests that must prove a path allocates nothing: it forwards every call
/// to the system allocator and counts allocations (and reallocations) of every thread.
/// Declare it in the test binary with
/// `#[global_allocator] static GLOBAL: CountingAllocator = CountingAllocator;`
/// and compare [`CountingAllocator::count`] before and after.
pub struct CountingAllocator;

static ALLOCATIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl CountingAllocator {
    /// Allocations so far, of every thread of this process.
    pub fn count() -> usize {
        ALLOCATIONS.load(std::sync::atomic::Ordering::SeqCst)
    }
}

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_settings_defaults_to_the_files_own_cases_and_seed() {
        let s = run_settings(64, None, None, None).unwrap();
        assert_eq!(
            s,
            RunSettings {
                cases: 64,
                seed: None
            }
        );
        // Empty values count as unset (`VAR= cargo test`).
        assert_eq!(run_settings(64, Some(""), Some(" "), Some("")).unwrap(), s);
    }

    #[test]
    fn run_settings_applies_each_override() {
        let s = |seed, cases, scale| run_settings(64, seed, cases, scale).unwrap();
        assert_eq!(
            s(Some("123"), None, None),
            RunSettings {
                cases: 64,
                seed: Some(123)
            }
        );
        assert_eq!(s(None, None, Some("10")).cases, 640);
        assert_eq!(s(None, Some("5"), None).cases, 5);
        // An absolute count wins over the multiplier; a huge multiplier saturates.
        assert_eq!(s(None, Some("5"), Some("10")).cases, 5);
        assert_eq!(s(None, None, Some("4294967295")).cases, u32::MAX);
        assert_eq!(
            s(Some("18446744073709551615"), None, None).seed,
            Some(u64::MAX)
        );
    }

    #[test]
    fn run_settings_rejects_malformed_values_by_name() {
        let err = |seed, cases, scale| run_settings(64, seed, cases, scale).unwrap_err();
        for (e, var) in [
            (err(Some("-1"), None, None), SEED_VAR),
            (err(Some("0x10"), None, None), SEED_VAR),
            (err(None, Some("0"), None), CASES_VAR),
            (err(None, Some("ten"), None), CASES_VAR),
            (err(None, None, Some("0")), SCALE_VAR),
            (err(None, None, Some("2.5")), SCALE_VAR),
        ] {
            assert_eq!(e.var, var);
            assert!(e.to_string().starts_with(var), "{e}");
        }
    }

    #[test]
    fn greedy_agreement_skips_near_ties() {
        assert_eq!(top2_margin(&[1.0, 3.0, 2.5]), (1, 0.5));
        assert_eq!(top2_margin(&[3.0, 3.0]), (0, 0.0));
        // Row 0 leads clearly; row 1 is a near tie at relative L2 1e-3 (bound ≈ 2e-3 · 4.2).
        let logits = [0.0, 5.0, 1.0, 3.0, 3.001, 0.0];
        assert_eq!(assert_greedy_agrees("t", &logits, 3, &[1, 0], 1e-3), 1);
        assert_eq!(assert_greedy_agrees("t", &logits[..3], 3, &[1], 1e-3), 1);
        let wrong =
            std::panic::catch_unwind(|| assert_greedy_agrees("t", &logits, 3, &[2, 0], 1e-3));
        assert!(wrong.is_err());
    }

    #[test]
    fn tolerance_and_diff_report_where_and_by_how_much() {
        let expected = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut actual = expected;
        actual[4] += 0.5;
        actual[1] += 0.1;
        let diff = Diff::new(&actual, &expected, Tolerance::F32);
        assert_eq!(
            (diff.over, diff.first_over, diff.max_abs),
            (2, Some(1), (4, 0.5))
        );
        let report = diff.report(&actual, &expected, &[2, 3]);
        assert!(report.contains("at index 4 [1, 1]"), "{report}");
        assert!(
            report.contains("2 of 6 elements over tolerance"),
            "{report}"
        );
        assert!(Tolerance::BF16.allows(1.01, 1.0) && !Tolerance::F32.allows(1.01, 1.0));
        assert!(!Tolerance::BF16.allows(f32::NAN, 1.0));
        assert_close("itself", &expected, &expected, Tolerance::F32);
        let panic = std::panic::catch_unwind(|| {
            assert_close_shaped("x", &actual, &expected, &[2, 3], Tolerance::F32)
        })
        .unwrap_err();
        let message = panic.downcast_ref::<String>().unwrap();
        assert!(message.starts_with("x: not within"), "{message}");
    }
}
