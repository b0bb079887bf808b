//! The kernels' inner loops in plain Rust: the reference layout of the work, and what runs on
//! CPUs without AVX2/FMA. Fixed-size arrays let the compiler keep the accumulators in registers.

use super::ahead::Requests;
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

/// `c[r][j] = Σ_k x[r][k] · b[k][j]` for the `M <= MR` token rows of `x` [M, in] (row-major),
/// `b`: [in][NR] (a weight panel); rows `M..MR` of `c` [MR][NR] are left as they are. Each step
/// of `k` also takes its turn of `requests` (where there are prefetch instructions).
pub fn tile_matmul<W: WeightElement, V, const M: usize>(
    x: &[f32],
    b: &[W],
    mut requests: Requests<V>,
    c: &mut [f32; MR * NR],
) {
    let k = b.len() / NR;
    let mut acc = [[0.0f32; NR]; M];
    for (kk, b_k) in b.chunks_exact(NR).enumerate() {
        requests.step();
        let mut b_f32 = [0.0f32; NR];
        for j in 0..NR {
            b_f32[j] = b_k[W::slot(j)].to_f32();
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let x_rk = x[r * k + kk];
            for j in 0..NR {
                acc_r[j] += x_rk * b_f32[j];
            }
        }
    }
    for (c_row, acc_row) in c.chunks_exact_mut(NR).zip(&acc) {
        c_row.copy_from_slice(acc_row);
    }
}
