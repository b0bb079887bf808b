//! The IO model: both algorithms on the two-level machine compute attention (equal to chapter
//! 1's), never hold more than M bytes of fast memory, and move the bytes the analysis says:
//! the tiled loop its closed form, within a constant of the paper's Θ(N²d²/M) bound and falling
//! as M grows; the naive one at least the 4N² elements of S and P, whatever M is.

use ch01::attention::{AttentionShape, causal_attention};
use ch01::testing::assert_rel_close;
use ch02::workload::WorkloadRng;
use ch07_flash_attention::traffic::{
    largest_tiles, naive, paper_bound_bytes, tiled, tiled_bytes, tiled_footprint,
};
use ndarray::ArrayView2;

fn inputs(n: usize, d: usize) -> [Vec<f32>; 3] {
    let mut rng = WorkloadRng::new(9);
    [0, 1, 2].map(|_| {
        (0..n * d)
            .map(|_| rng.uniform_open0() as f32 * 2.0 - 1.0)
            .collect()
    })
}

fn non_causal(q: &[f32], k: &[f32], v: &[f32], n: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0; n * d];
    for i in 0..n {
        let s: Vec<f64> = (0..n)
            .map(|j| {
                (0..d)
                    .map(|x| (q[i * d + x] * k[j * d + x]) as f64)
                    .sum::<f64>()
                    / (d as f64).sqrt()
            })
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let sum: f64 = w.iter().sum();
        for x in 0..d {
            out[i * d + x] = (w
                .iter()
                .enumerate()
                .map(|(j, w)| w * v[j * d + x] as f64)
                .sum::<f64>()
                / sum) as f32;
        }
    }
    out
}

#[test]
fn both_models_compute_attention_within_their_fast_memory() {
    let (n, d) = (77, 16);
    let [q, k, v] = inputs(n, d);
    let shape = AttentionShape {
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: d,
    };
    let view = |x: &[f32]| ArrayView2::from_shape((n, d), x).unwrap().to_owned();
    let causal = causal_attention(view(&q).view(), view(&k).view(), view(&v).view(), shape);
    let full = non_causal(&q, &k, &v, n, d);
    for m_bytes in [2 << 10, 8 << 10, 64 << 10] {
        let b = largest_tiles(d, m_bytes).unwrap();
        for (is_causal, expected) in [(true, causal.as_slice().unwrap()), (false, &full[..])] {
            let (out, t) = naive(&q, &k, &v, n, d, is_causal, m_bytes).unwrap();
            assert_rel_close("naive model", &out, expected, 1e-5);
            assert!(t.peak_fast <= m_bytes);
            // S written and read, P written and read: 4 N² elements at least.
            assert!(t.total() >= (4 * n * n * 4) as u64);
            for tiles in [(b, b), (3, 5), (b, 1)] {
                let (out, t) = tiled(&q, &k, &v, n, d, is_causal, m_bytes, tiles).unwrap();
                assert_rel_close(&format!("tiled model {tiles:?}"), &out, expected, 1e-5);
                assert!(t.peak_fast <= m_bytes);
                assert!(t.peak_fast <= tiled_footprint(d, tiles.0, tiles.1) * 4);
                assert_eq!(t.total(), tiled_bytes(n, d, is_causal, tiles.0));
            }
        }
    }
    // Tiles that do not fit are refused, not silently shrunk.
    assert!(tiled(&q, &k, &v, n, d, false, 1 << 10, (64, 64)).is_err());
}

#[test]
fn tiled_traffic_falls_with_fast_memory_and_tracks_the_bound() {
    let (n, d) = (4096, 64);
    let mut last = u64::MAX;
    for m_bytes in [16 << 10, 32 << 10, 64 << 10, 128 << 10] {
        let b = largest_tiles(d, m_bytes).unwrap();
        let bytes = tiled_bytes(n, d, false, b);
        assert!(bytes < last, "more fast memory, less traffic");
        last = bytes;
        // Θ(N²d²/M): within a constant factor (here between 1 and 20) while the tiles are
        // smaller than d, the regime of the paper's bound.
        let ratio = bytes as f64 / paper_bound_bytes(n, d, m_bytes);
        assert!((1.0..20.0).contains(&ratio), "M = {m_bytes}: ratio {ratio}");
    }
}
