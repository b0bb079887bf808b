//! What this machine can do, measured in the same run as the model: memory bandwidth (a large
//! read and a large copy) and matrix-multiply throughput (our GEMM and matrixmultiply's).
//!
//! The bandwidth probes read and write weight memory
//! ([`ch02::weight_memory::Elements::for_weights`]: 2 MiB pages
//! where the system gives them), the memory decode streams its weights from: a bound measured on
//! other memory bounds nothing. On the Intel Xeon of 2026-12-06 a sum over 4 KiB heap pages
//! read 20.5 GB/s and the same sum over weight memory 32-33 GB/s, so a probe on the heap rated
//! f32 decode at 130% of the machine (`examples/weight_pages.rs` compares the two).

use std::time::Instant;

use ch01::linear::Linear;
pub use ch02::read_probe::ReadProbe;
use ch02::read_probe::filled;
use ch02::{FastLinear, WeightDtype};
use ndarray::Array2;
use rayon::prelude::*;

/// Bytes streamed by the bandwidth probes: far larger than any cache.
const PROBE_BYTES: usize = 1 << 30;
/// The GEMM probe: x [M, K] · Wᵀ [K, N].
const GEMM: (usize, usize, usize) = (384, 1024, 1024);

pub struct Machine {
    /// GB/s (10⁹ bytes) reading a 1 GiB buffer of weight memory with every thread: what decode
    /// needs.
    pub read_gb_s: f64,
    /// GB/s copying 512 MiB to another 512 MiB buffer (both weight memory), read and write
    /// bytes both counted.
    pub copy_gb_s: f64,
    /// GFLOP/s of this chapter's GEMM (f32 weights) on [`GEMM`].
    pub kiln_gemm_gflop_s: f64,
    /// GFLOP/s of `matrixmultiply` (through ndarray, one thread: kiln does not enable its
    /// threading), a tuned BLAS-like GEMM, on the same shape: a yardstick for one core.
    pub reference_gemm_gflop_s: f64,
}

impl Machine {
    pub fn measure(reps: usize, quick: bool) -> Machine {
        let bytes = if quick { PROBE_BYTES / 16 } else { PROBE_BYTES };
        Machine {
            read_gb_s: best_of(reps, || read_probe(bytes)),
            copy_gb_s: best_of(reps, || copy_probe(bytes / 2)),
            kiln_gemm_gflop_s: best_of(reps, || gemm_probe(true)),
            reference_gemm_gflop_s: best_of(reps, || gemm_probe(false)),
        }
    }

    /// Each figure's best of two measurements, before and after the model's runs: this
    /// machine's speed drifts within a run, and a probe taken in a slow moment alone would rate
    /// the model against too low a limit.
    pub fn best_with(self, other: Machine) -> Machine {
        Machine {
            read_gb_s: self.read_gb_s.max(other.read_gb_s),
            copy_gb_s: self.copy_gb_s.max(other.copy_gb_s),
            kiln_gemm_gflop_s: self.kiln_gemm_gflop_s.max(other.kiln_gemm_gflop_s),
            reference_gemm_gflop_s: self
                .reference_gemm_gflop_s
                .max(other.reference_gemm_gflop_s),
        }
    }
}

/// Runs a probe `reps` times after one warm-up and keeps the best rate (the least disturbed run).
fn best_of(reps: usize, probe: impl Fn() -> f64) -> f64 {
    probe();
    (0..reps.max(1)).map(|_| probe()).fold(0.0, f64::max)
}

/// GB/s summing `bytes` of f32 of weight memory in parallel.
fn read_probe(bytes: usize) -> f64 {
    ReadProbe::new(bytes).gb_s()
}

/// Bytes of the read probe taken right before and right after each decode measurement: eight
/// times these machines' last-level cache, a few milliseconds of reading.
pub const AROUND_BYTES: usize = 1 << 28;

/// GB/s copying `bytes` in parallel, counting the bytes read and the bytes written.
fn copy_probe(bytes: usize) -> f64 {
    let src = filled(bytes / 4, 1.0);
    let mut dst = filled(bytes / 4, 2.0); // written now, so no page is first touched while timed
    let start = Instant::now();
    dst.par_chunks_mut(1 << 16)
        .zip(src.par_chunks(1 << 16))
        .for_each(|(d, s)| d.copy_from_slice(s));
    let seconds = start.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    2.0 * bytes as f64 / seconds / 1e9
}

/// GFLOP/s of one [`GEMM`]-shaped product, ours (`kiln`) or matrixmultiply's.
fn gemm_probe(kiln: bool) -> f64 {
    let (m, k, n) = GEMM;
    let x = Array2::from_shape_fn((m, k), |(i, j)| ((i * 7 + j * 3) % 11) as f32 * 0.1);
    let w = Array2::from_shape_fn((n, k), |(i, j)| ((i * 5 + j) % 13) as f32 * 0.1);
    let mut y = Array2::<f32>::zeros((m, n));
    let seconds = if kiln {
        let layer = FastLinear::new(w, None, WeightDtype::F32);
        let start = Instant::now();
        layer.forward_into(x.view(), y.view_mut());
        start.elapsed().as_secs_f64()
    } else {
        let start = Instant::now();
        ndarray::linalg::general_mat_mul(1.0, &x, &w.t(), 0.0, &mut y);
        start.elapsed().as_secs_f64()
    };
    std::hint::black_box(&y);
    2.0 * (m * k * n) as f64 / seconds / 1e9
}
