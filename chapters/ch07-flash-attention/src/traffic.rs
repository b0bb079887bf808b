//! An instrumented model of attention's memory traffic: a machine with a slow memory (a GPU's
//! HBM, a CPU's DRAM) and a fast one of `M` bytes (shared memory, a cache), where arithmetic
//! happens only on what is in fast memory and every byte that crosses between them is counted.
//!
//! ```text
//! slow memory: Q, K, V [N, d]; O [N, d]; the naive path's S and P [N, N]
//!     │ load (counted)   ▲ store (counted)
//! fast memory: at most M bytes live at once (checked), where all arithmetic happens
//! ```
//!
//! Both algorithms really compute attention here (the tests compare them with chapter 1's),
//! for one head, so the counts are of a computation that is known to be right:
//!
//! - [`naive`]: chapter 1's order. `S = Q Kᵀ` in square blocks that fit, written out whole;
//!   each row of S read back, softmaxed, written out as P; `O = P V` in blocks. Its traffic is
//!   dominated by the `4 N²` elements of S and P going out and back, whatever M is.
//! - [`tiled`]: FlashAttention-2's loop. A query tile `Q_i` and its `O_i`, `m`, `l` stay in
//!   fast memory while every K/V tile streams past; S exists one tile at a time and is never
//!   stored. Q is read and O written once; K and V are read once per query tile, so
//!   `N/Br · 2Nd` elements, which with the largest tiles that fit is Θ(N²d²/M), the bound the
//!   FlashAttention paper proves (and proves optimal over a range of M).

/// Bytes of one element (the model computes in f32).
const F32: usize = 4;

/// Bytes that crossed between slow and fast memory, and the most fast memory held at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Traffic {
    /// Slow → fast.
    pub read: u64,
    /// Fast → slow.
    pub written: u64,
    /// Bytes of fast memory in use at the fullest moment.
    pub peak_fast: usize,
}

impl Traffic {
    pub fn total(&self) -> u64 {
        self.read + self.written
    }
}

/// A computation that does not fit in the fast memory it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrafficError {
    #[error("{what} needs {needed} bytes of fast memory at once; M = {capacity}")]
    DoesNotFit {
        what: &'static str,
        needed: usize,
        capacity: usize,
    },
    #[error("q, k and v must each be [n, d] = {expected} elements (got {got})")]
    Shape { expected: usize, got: usize },
}

/// The fast memory: what is reserved in it, and what crossed.
struct Fast {
    capacity: usize,
    in_use: usize,
    traffic: Traffic,
}

impl Fast {
    fn new(capacity: usize) -> Fast {
        Fast {
            capacity,
            in_use: 0,
            traffic: Traffic::default(),
        }
    }

    /// Room for `floats` more elements, or an error if they do not fit.
    fn reserve(&mut self, what: &'static str, floats: usize) -> Result<(), TrafficError> {
        let needed = self.in_use + floats * F32;
        if needed > self.capacity {
            return Err(TrafficError::DoesNotFit {
                what,
                needed,
                capacity: self.capacity,
            });
        }
        self.in_use = needed;
        self.traffic.peak_fast = self.traffic.peak_fast.max(needed);
        Ok(())
    }

    fn release(&mut self, floats: usize) {
        self.in_use -= floats * F32;
    }

    /// Slow `src` → fast `dst`.
    fn load(&mut self, src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
        self.traffic.read += (src.len() * F32) as u64;
    }

    /// Fast `src` → slow `dst`.
    fn store(&mut self, src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
        self.traffic.written += (src.len() * F32) as u64;
    }
}

fn check(q: &[f32], k: &[f32], v: &[f32], n: usize, d: usize) -> Result<(), TrafficError> {
    for x in [q, k, v] {
        if x.len() != n * d {
            return Err(TrafficError::Shape {
                expected: n * d,
                got: x.len(),
            });
        }
    }
    Ok(())
}

/// The side of the largest square blocks (b × b scores with their b × d operands) that fit
/// in `m_bytes` next to nothing else: `2bd + b² ≤ M / 4`.
fn naive_block(d: usize, m_bytes: usize) -> usize {
    let m = m_bytes / F32;
    (1..)
        .take_while(|&b| 2 * b * d + b * b <= m)
        .last()
        .unwrap_or(0)
}

/// `S · scale`, then −∞ above the diagonal when `causal` (as chapter 1 materialises it).
fn score(q_i: &[f32], k_j: &[f32], scale: f32, masked: bool) -> f32 {
    if masked {
        f32::NEG_INFINITY
    } else {
        q_i.iter().zip(k_j).map(|(a, b)| a * b).sum::<f32>() * scale
    }
}

// ANCHOR: naive_model
/// Naive attention of one head on the two-level machine: `q`, `k`, `v` [n, d] → (out [n, d],
/// traffic). S and P [n, n] live in slow memory.
pub fn naive(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    d: usize,
    causal: bool,
    m_bytes: usize,
) -> Result<(Vec<f32>, Traffic), TrafficError> {
    check(q, k, v, n, d)?;
    let mut fast = Fast::new(m_bytes);
    let b = naive_block(d, m_bytes).max(1);
    let scale = 1.0 / (d as f32).sqrt();
    let (mut s, mut p, mut out) = (vec![0.0; n * n], vec![0.0; n * n], vec![0.0; n * d]);

    // 1. S = Q Kᵀ / √d, block by block, every block written to slow memory.
    for i0 in (0..n).step_by(b) {
        let bi = b.min(n - i0);
        fast.reserve("a Q block", bi * d)?;
        let mut q_blk = vec![0.0; bi * d];
        fast.load(&q[i0 * d..(i0 + bi) * d], &mut q_blk);
        for j0 in (0..n).step_by(b) {
            let bj = b.min(n - j0);
            fast.reserve("a K block and its scores", bj * d + bi * bj)?;
            let mut k_blk = vec![0.0; bj * d];
            fast.load(&k[j0 * d..(j0 + bj) * d], &mut k_blk);
            for i in 0..bi {
                let row: Vec<f32> = (0..bj)
                    .map(|j| {
                        let masked = causal && j0 + j > i0 + i;
                        score(&q_blk[i * d..][..d], &k_blk[j * d..][..d], scale, masked)
                    })
                    .collect();
                fast.store(&row, &mut s[(i0 + i) * n + j0..][..bj]);
            }
            fast.release(bj * d + bi * bj);
        }
        fast.release(bi * d);
    }

    // 2. P = softmax(S), row by row: one read and one write of the row if it fits, else a
    //    pass for the maximum, one for the sum, one to write P.
    let m_floats = m_bytes / F32;
    for i in 0..n {
        let row = &s[i * n..(i + 1) * n];
        if n <= m_floats {
            fast.reserve("a row of S", n)?;
            let mut r = vec![0.0; n];
            fast.load(row, &mut r);
            let max = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            r.iter_mut().for_each(|x| *x = (*x - max).exp());
            let sum: f32 = r.iter().sum();
            r.iter_mut().for_each(|x| *x /= sum);
            fast.store(&r, &mut p[i * n..(i + 1) * n]);
            fast.release(n);
        } else {
            let c = m_floats.max(1);
            fast.reserve("a chunk of a row of S", c)?;
            let mut chunk = vec![0.0; c];
            let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f32);
            for j0 in (0..n).step_by(c) {
                let len = c.min(n - j0);
                fast.load(&row[j0..j0 + len], &mut chunk[..len]);
                max = chunk[..len].iter().copied().fold(max, f32::max);
            }
            for j0 in (0..n).step_by(c) {
                let len = c.min(n - j0);
                fast.load(&row[j0..j0 + len], &mut chunk[..len]);
                sum += chunk[..len].iter().map(|x| (x - max).exp()).sum::<f32>();
            }
            for j0 in (0..n).step_by(c) {
                let len = c.min(n - j0);
                fast.load(&row[j0..j0 + len], &mut chunk[..len]);
                chunk[..len]
                    .iter_mut()
                    .for_each(|x| *x = (*x - max).exp() / sum);
                fast.store(&chunk[..len], &mut p[i * n + j0..][..len]);
            }
            fast.release(c);
        }
    }

    // 3. O = P V, block by block.
    for i0 in (0..n).step_by(b) {
        let bi = b.min(n - i0);
        fast.reserve("an O block", bi * d)?;
        let mut o_blk = vec![0.0f32; bi * d];
        for j0 in (0..n).step_by(b) {
            let bj = b.min(n - j0);
            fast.reserve("a P block and a V block", bi * bj + bj * d)?;
            let (mut p_blk, mut v_blk) = (vec![0.0; bi * bj], vec![0.0; bj * d]);
            for i in 0..bi {
                fast.load(&p[(i0 + i) * n + j0..][..bj], &mut p_blk[i * bj..][..bj]);
            }
            fast.load(&v[j0 * d..(j0 + bj) * d], &mut v_blk);
            for i in 0..bi {
                for j in 0..bj {
                    let w = p_blk[i * bj + j];
                    for x in 0..d {
                        o_blk[i * d + x] += w * v_blk[j * d + x];
                    }
                }
            }
            fast.release(bi * bj + bj * d);
        }
        fast.store(&o_blk, &mut out[i0 * d..(i0 + bi) * d]);
        fast.release(bi * d);
    }
    Ok((out, fast.traffic))
}
// ANCHOR_END: naive_model

/// Fast memory one step of the tiled loop holds, in elements: Q_i and O_i `[Br, d]`, m and l
/// `[Br]`, K_j and V_j `[Bc, d]`, S_ij `[Br, Bc]`.
pub fn tiled_footprint(d: usize, br: usize, bc: usize) -> usize {
    2 * br * d + 2 * br + 2 * bc * d + br * bc
}

/// The largest square tiles (Br = Bc) whose [`tiled_footprint`] fits in `m_bytes`, if any.
pub fn largest_tiles(d: usize, m_bytes: usize) -> Option<usize> {
    (1..)
        .take_while(|&b| tiled_footprint(d, b, b) * F32 <= m_bytes)
        .last()
}

// ANCHOR: tiled_model
/// FlashAttention-2's tiled loop of one head on the two-level machine, with `br` × `bc`
/// tiles: `q`, `k`, `v` [n, d] → (out [n, d], traffic). Nothing of size n × n exists.
#[allow(clippy::too_many_arguments)]
pub fn tiled(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    d: usize,
    causal: bool,
    m_bytes: usize,
    (br, bc): (usize, usize),
) -> Result<(Vec<f32>, Traffic), TrafficError> {
    check(q, k, v, n, d)?;
    let (br, bc) = (br.max(1), bc.max(1));
    let mut fast = Fast::new(m_bytes);
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0.0; n * d];
    for i0 in (0..n).step_by(br) {
        let bi = br.min(n - i0);
        fast.reserve("Q_i, O_i, m and l", 2 * bi * d + 2 * bi)?;
        let mut q_i = vec![0.0; bi * d];
        fast.load(&q[i0 * d..(i0 + bi) * d], &mut q_i);
        let (mut o_i, mut m, mut l) = (
            vec![0.0f32; bi * d],
            vec![f32::NEG_INFINITY; bi],
            vec![0.0f32; bi],
        );
        // Causal: K/V tiles after the tile's last query are never loaded.
        let kv_end = if causal { i0 + bi } else { n };
        for j0 in (0..kv_end).step_by(bc) {
            let bj = bc.min(kv_end - j0);
            fast.reserve("K_j, V_j and S_ij", 2 * bj * d + bi * bj)?;
            let (mut k_j, mut v_j) = (vec![0.0; bj * d], vec![0.0; bj * d]);
            fast.load(&k[j0 * d..(j0 + bj) * d], &mut k_j);
            fast.load(&v[j0 * d..(j0 + bj) * d], &mut v_j);
            for i in 0..bi {
                let visible = if causal {
                    (i0 + i + 1).saturating_sub(j0).min(bj)
                } else {
                    bj
                };
                if visible == 0 {
                    continue;
                }
                let s: Vec<f32> = (0..visible)
                    .map(|j| score(&q_i[i * d..][..d], &k_j[j * d..][..d], scale, false))
                    .collect();
                let m_new = s.iter().copied().fold(m[i], f32::max);
                let alpha = if m[i] == f32::NEG_INFINITY {
                    0.0
                } else {
                    (m[i] - m_new).exp()
                };
                l[i] *= alpha;
                o_i[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= alpha);
                for (j, s_j) in s.iter().enumerate() {
                    let p = (s_j - m_new).exp();
                    l[i] += p;
                    for x in 0..d {
                        o_i[i * d + x] += p * v_j[j * d + x];
                    }
                }
                m[i] = m_new;
            }
            fast.release(2 * bj * d + bi * bj);
        }
        for i in 0..bi {
            o_i[i * d..(i + 1) * d].iter_mut().for_each(|x| *x /= l[i]);
        }
        fast.store(&o_i, &mut out[i0 * d..(i0 + bi) * d]);
        fast.release(2 * bi * d + 2 * bi);
    }
    Ok((out, fast.traffic))
}
// ANCHOR_END: tiled_model

/// The bytes [`tiled`] moves with query tiles of `br`, in closed form: Q read and O written
/// once (`2nd`), and per query tile the keys it visits read once from K and once from V. Bc
/// does not appear: the visited K/V tiles cover keys `0..kv_end` whatever their size.
pub fn tiled_bytes(n: usize, d: usize, causal: bool, br: usize) -> u64 {
    let br = br.max(1);
    let mut elements = 2 * n * d;
    for i0 in (0..n).step_by(br) {
        let kv_end = if causal { (i0 + br).min(n) } else { n };
        elements += 2 * kv_end * d;
    }
    (elements * F32) as u64
}

/// The FlashAttention paper's bound on the tiled loop's traffic, `N² d² / M` elements (M in
/// elements), in bytes: Θ of it, so it is drawn beside the measured counts as a guide.
pub fn paper_bound_bytes(n: usize, d: usize, m_bytes: usize) -> f64 {
    let m = (m_bytes / F32) as f64;
    (n as f64).powi(2) * (d as f64).powi(2) / m * F32 as f64
}
