//! The kernels' inner loops in plain Rust: the reference layout of the work, and what runs on
//! CPUs without AVX2/FMA. Fixed-size arrays let the compiler keep the accumulators in registers.

use super::{MR, NR, WeightElement};

/// `out[j] = Σ_k x[k] · panel[k][j]`. `panel`: [in][NR], `x`: [in].
pub fn panel_matvec<W: WeightElement>(panel: &[W], x: &[f32], out: &mut [f32; NR]) {
    let mut acc = [0.0f32; NR];
    for (w_k, &x_k) in panel.chunks_exact(NR).zip(x) {
        for j in 0..NR {
            acc[j] += w_k[W::slot(j)].to_f32() * x_k;
        }
    }
    *out = acc;
}

/// `c[r][j] = Σ_k a[k][r] · b[k][j]`. `a`: [in][MR] (tokens), `b`: [in][NR] (a weight panel),
/// `c`: [MR][NR].
pub fn tile_matmul<W: WeightElement>(a: &[f32], b: &[W], c: &mut [f32]) {
    let mut acc = [[0.0f32; NR]; MR];
    for (a_k, b_k) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
        let mut b_f32 = [0.0f32; NR];
        for j in 0..NR {
            b_f32[j] = b_k[W::slot(j)].to_f32();
        }
        for r in 0..MR {
            for j in 0..NR {
                acc[r][j] += a_k[r] * b_f32[j];
            }
        }
    }
    for (c_row, acc_row) in c.chunks_exact_mut(NR).zip(&acc) {
        c_row.copy_from_slice(acc_row);
    }
}
