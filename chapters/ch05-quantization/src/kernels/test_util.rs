//! What the kernels' unit tests share: random blocks, the portable kernels' outputs, and a
//! bit-for-bit comparison (all but the blocks only for the x86-64 tile kernels' tests).

/// `bytes` random bytes (a seeded xorshift) with a moderate f16 at `scale_at` of every `block`
/// bytes (random bytes there would make infinities and NaNs).
pub fn random_rows(bytes: usize, block: usize, scale_at: &[usize], seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out: Vec<u8> = (0..bytes).map(|_| next() as u8).collect();
    for b in out.chunks_exact_mut(block) {
        for &at in scale_at {
            let v = ((next() % 2001) as f32 - 1000.0) / 1e4;
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    out
}

/// `count` activations in −2..2 from seeded random bytes.
#[cfg(target_arch = "x86_64")]
pub fn random_inputs(count: usize, seed: u64) -> Vec<f32> {
    random_rows(4 * count, 4, &[], seed)
        .chunks_exact(4)
        .map(|b| (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) % 20001) as f32 / 5e3 - 2.0)
        .collect()
}

/// `yt` [rows, tokens]: each row of `w` (`row_bytes` each, the file's layout) times each
/// token's `n` activation blocks, by the portable one-row kernel `portable`.
#[cfg(target_arch = "x86_64")]
pub fn portable_outputs<A>(
    w: &[u8],
    row_bytes: usize,
    acts: &[A],
    n: usize,
    portable: impl Fn(&[u8], &[A]) -> f32,
) -> Vec<f32> {
    let tokens = acts.len() / n;
    w.chunks_exact(row_bytes)
        .flat_map(|row| {
            (0..tokens)
                .map(|t| portable(row, &acts[t * n..(t + 1) * n]))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Panics at the first output of `got` whose bits differ from `expected`'s, naming `what`.
#[cfg(target_arch = "x86_64")]
pub fn assert_bits(what: &str, expected: &[f32], got: &[f32]) {
    assert_eq!(expected.len(), got.len(), "{what}: lengths");
    for (i, (e, g)) in expected.iter().zip(got).enumerate() {
        assert_eq!(
            g.to_bits(),
            e.to_bits(),
            "{what} output {i}: {g:e} vs {e:e}"
        );
    }
}

/// The bytes that take each code to an edge of its range: 0x00, 0x7F, 0x80, 0xFF.
#[cfg(target_arch = "x86_64")]
pub const EXTREME_FILLS: [u8; 4] = [0x00, 0x7F, 0x80, 0xFF];

/// Activation patterns whose codes are all ±127: all +1, all −1, and pairs alternating in sign
/// (what makes a pair of byte products largest in either sign).
#[cfg(target_arch = "x86_64")]
pub const EXTREME_SIGNS: [fn(usize) -> f32; 3] = [
    |_| 1.0,
    |_| -1.0,
    |i| if (i / 2) % 2 == 0 { 1.0 } else { -1.0 },
];

/// `bytes` bytes all `fill`, but for an f16 0.5 at `scale_at` of every `block` bytes.
#[cfg(target_arch = "x86_64")]
pub fn filled_rows(bytes: usize, block: usize, scale_at: &[usize], fill: u8) -> Vec<u8> {
    let mut w = vec![fill; bytes];
    for b in w.chunks_exact_mut(block) {
        for &at in scale_at {
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        }
    }
    w
}
