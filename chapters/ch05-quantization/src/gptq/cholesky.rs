//! The linear algebra GPTQ needs, written out (it is part of the lesson): the Cholesky factor of
//! a symmetric positive-definite matrix, and from it the upper Cholesky factor `U` of the inverse,
//! `H⁻¹ = Uᵀ U`, whose rows GPTQ reads one by one.
//!
//! Why `U`: quantizing column `i` and removing it from the problem updates the inverse Hessian of
//! the remaining columns by one step of Gaussian elimination. Row `i` of `U`, divided by
//! `U[i, i]`, is exactly that step's row, for every `i` in turn, so GPTQ never updates `H⁻¹`:
//! it reads `U` (see [`super::algorithm`]).

use ndarray::Array2;

/// `a` is not symmetric positive definite (a pivot at `index` was not positive).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the matrix is not positive definite (pivot {index} is {pivot})")]
pub struct NotPositiveDefinite {
    pub index: usize,
    pub pivot: f64,
}

// ANCHOR: cholesky
/// The lower factor `L` of `a = L Lᵀ` (`a` `[n, n]` symmetric; only its lower half is read).
pub fn cholesky(a: &Array2<f64>) -> Result<Array2<f64>, NotPositiveDefinite> {
    let n = a.nrows();
    assert_eq!(a.ncols(), n, "a is square");
    let mut l = Array2::<f64>::zeros((n, n));
    for j in 0..n {
        // L[j, j] = sqrt(a[j, j] − Σ_k<j L[j, k]²)
        let row_j = l.row(j).to_owned();
        let pivot = a[[j, j]]
            - row_j
                .slice(ndarray::s![..j])
                .dot(&row_j.slice(ndarray::s![..j]));
        if pivot.is_nan() || pivot <= 0.0 || !pivot.is_finite() {
            return Err(NotPositiveDefinite { index: j, pivot });
        }
        let d = pivot.sqrt();
        l[[j, j]] = d;
        // L[i, j] = (a[i, j] − Σ_k<j L[i, k] L[j, k]) / L[j, j]   for i > j
        for i in j + 1..n {
            let dot: f64 = l
                .row(i)
                .iter()
                .zip(row_j.iter())
                .take(j)
                .map(|(x, y)| x * y)
                .sum();
            l[[i, j]] = (a[[i, j]] - dot) / d;
        }
    }
    Ok(l)
}
// ANCHOR_END: cholesky

/// `L⁻¹` of a lower-triangular `l` with a positive diagonal: forward substitution against each
/// column `c` of the identity, kept transposed (`t[c, k] = L⁻¹[k, c]`) so that both operands of
/// the inner sum are contiguous rows.
fn lower_inverse(l: &Array2<f64>) -> Array2<f64> {
    let n = l.nrows();
    let mut t = Array2::<f64>::zeros((n, n)); // (L⁻¹)ᵀ
    for c in 0..n {
        let mut x = t.row_mut(c);
        // Solve L x = e_c; x[i] = 0 for i < c.
        x[c] = 1.0 / l[[c, c]];
        for i in c + 1..n {
            let s: f64 = l
                .row(i)
                .slice(ndarray::s![c..i])
                .iter()
                .zip(x.slice(ndarray::s![c..i]).iter())
                .map(|(a, b)| a * b)
                .sum();
            x[i] = -s / l[[i, i]];
        }
    }
    t.reversed_axes()
}

// ANCHOR: inverse_upper
/// The upper factor `U` of `a⁻¹ = Uᵀ U`: `a = L Lᵀ`, `a⁻¹ = L⁻ᵀ L⁻¹`, then `U = chol(a⁻¹)ᵀ`.
pub fn inverse_upper_cholesky(a: &Array2<f64>) -> Result<Array2<f64>, NotPositiveDefinite> {
    let l = cholesky(a)?;
    let m = lower_inverse(&l); // L⁻¹, lower
    let inverse = m.t().dot(&m); // a⁻¹ = L⁻ᵀ L⁻¹
    Ok(cholesky(&inverse)?.reversed_axes())
}
// ANCHOR_END: inverse_upper

#[cfg(test)]
mod tests {
    use super::*;

    fn spd(n: usize, seed: u64) -> Array2<f64> {
        let mut state = seed;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64) - 0.5
        };
        let x = Array2::from_shape_fn((n, n + 3), |_| next());
        x.dot(&x.t()) + Array2::<f64>::eye(n) * 0.1
    }

    #[test]
    fn cholesky_reproduces_the_matrix() {
        for n in [1, 2, 7, 33] {
            let a = spd(n, n as u64);
            let l = cholesky(&a).unwrap();
            let back = l.dot(&l.t());
            let err = (&back - &a).iter().fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(err < 1e-10, "n = {n}: max error {err}");
            assert!(l.indexed_iter().all(|((i, j), v)| j <= i || *v == 0.0));
        }
    }

    #[test]
    fn the_upper_factor_is_that_of_the_inverse() {
        for n in [1, 3, 17] {
            let a = spd(n, 100 + n as u64);
            let u = inverse_upper_cholesky(&a).unwrap();
            // Uᵀ U a = I
            let product = u.t().dot(&u).dot(&a);
            let err = (&product - &Array2::<f64>::eye(n))
                .iter()
                .fold(0.0f64, |m, v| m.max(v.abs()));
            assert!(err < 1e-8, "n = {n}: max error {err}");
            assert!(u.indexed_iter().all(|((i, j), v)| j >= i || *v == 0.0));
        }
    }

    #[test]
    fn an_indefinite_matrix_is_an_error() {
        let a = ndarray::arr2(&[[1.0, 2.0], [2.0, 1.0]]);
        assert_eq!(cholesky(&a).unwrap_err().index, 1);
        assert!(cholesky(&ndarray::arr2(&[[0.0]])).is_err());
    }
}
