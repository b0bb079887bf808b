//! The machine's read bandwidth at this moment: the current pool's threads summing a buffer of
//! weight memory (2 MiB pages where the system gives them, like the weights a decode streams),
//! the bound that chapter 2's benchmark rates each decode against, and that its examples take to
//! name the moment they measure in.

use std::time::Instant;

use rayon::prelude::*;

use crate::weight_memory::Elements;

/// A read probe whose buffer stays allocated (and its pages backed), so that it can be taken
/// again and again around the measurements it rates: this machine's bandwidth drifts by more
/// than the gaps the page reports, and a probe minutes away measures another moment.
pub struct ReadProbe {
    buffer: Elements<f32>,
}

impl ReadProbe {
    /// A probe over `bytes` of weight memory, every page written (backed) now.
    pub fn new(bytes: usize) -> ReadProbe {
        ReadProbe {
            buffer: filled(bytes / 4, 1.0),
        }
    }

    /// GB/s summing the buffer on the current rayon pool's threads (every CPU's, on the global
    /// pool), now.
    pub fn gb_s(&self) -> f64 {
        let start = Instant::now();
        let sum: f32 = self
            .buffer
            .par_chunks(1 << 16)
            .map(|chunk| {
                let mut lanes = [0.0f32; 16];
                for c in chunk.chunks_exact(16) {
                    for l in 0..16 {
                        lanes[l] += c[l];
                    }
                }
                lanes.iter().sum::<f32>()
            })
            .sum();
        let seconds = start.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        self.bytes() as f64 / seconds / 1e9
    }

    /// `measure()`'s result, and the best of this probe taken twice right before it and twice
    /// right after: the same rule as the machine's figures (a probe's best, the better of
    /// before and after), at the moment of the measurement.
    pub fn around<T>(&self, measure: impl FnOnce() -> T) -> (T, f64) {
        let before = self.gb_s().max(self.gb_s());
        let result = measure();
        let after = self.gb_s().max(self.gb_s());
        (result, before.max(after))
    }

    /// The bytes it reads.
    pub fn bytes(&self) -> usize {
        self.buffer.len() * 4
    }
}

/// `len` elements of weight memory, each `value` (so every page is backed before a probe times
/// it).
pub fn filled(len: usize, value: f32) -> Elements<f32> {
    let mut buffer = Elements::for_weights(len);
    buffer.par_chunks_mut(1 << 16).for_each(|c| c.fill(value));
    buffer
}
