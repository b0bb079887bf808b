//! Comparison helpers shared by every chapter's tests: tolerances per dtype, and on failure a
//! message that says where and by how much two outputs differ.

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
