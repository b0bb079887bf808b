//! How much of the KV memory a paged cache allocates actually holds tokens, on chapter 2's
//! workload, measured exactly as [`ch02::workload::ContiguousUtilisation`] measures a
//! contiguous reservation.

use ch02::workload::{RequestLengths, WorkloadError};

/// Allocated vs holding token slots of a workload in blocks of `block_size` positions.
///
/// Time model (chapter 2's): a request with `p` prompt and `o` output tokens lives `o` steps and
/// holds `p + k` tokens after step `k`; a paged cache has then allocated `⌈(p + k) / B⌉` blocks.
/// Invariant: `holding_slot_steps <= allocated_slot_steps`, `used_slots <= final_slots`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedUtilisation {
    pub requests: usize,
    pub block_size: usize,
    /// `Σ (p + o)`: slots that ever hold a token.
    pub used_slots: u64,
    /// `Σ ⌈(p + o) / B⌉ · B`: slots allocated when each request ends.
    pub final_slots: u64,
    /// `Σ_k ⌈(p + k) / B⌉ · B` over each request's steps.
    pub allocated_slot_steps: u128,
    /// `Σ_k (p + k)`.
    pub holding_slot_steps: u128,
}

// ANCHOR: paged_utilisation
impl PagedUtilisation {
    pub fn measure(requests: &[RequestLengths], block_size: usize) -> Result<Self, WorkloadError> {
        if requests.is_empty() {
            return Err(WorkloadError::EmptyWorkload);
        }
        let b = block_size.max(1) as u64;
        let mut m = PagedUtilisation {
            requests: requests.len(),
            block_size: b as usize,
            used_slots: 0,
            final_slots: 0,
            allocated_slot_steps: 0,
            holding_slot_steps: 0,
        };
        for r in requests {
            let (p, o) = (r.prompt_len as u64, r.output_len as u64);
            m.used_slots += p + o;
            m.final_slots += (p + o).div_ceil(b) * b;
            for k in 1..=o {
                m.allocated_slot_steps += ((p + k).div_ceil(b) * b) as u128;
                m.holding_slot_steps += (p + k) as u128;
            }
        }
        Ok(m)
    }

    /// Share of the slots allocated at the end that hold a token (only the last block of each
    /// request is partly empty).
    pub fn utilisation(&self) -> f64 {
        self.used_slots as f64 / self.final_slots as f64
    }

    /// Share of allocated slot-steps holding a token: what a snapshot of memory sees.
    pub fn time_weighted_utilisation(&self) -> f64 {
        self.holding_slot_steps as f64 / self.allocated_slot_steps as f64
    }
}
// ANCHOR_END: paged_utilisation

/// How many of `requests`, taken in order at their final length, fit at once in a pool of
/// `capacity` token slots: paged in blocks of `block_size`, or contiguous reserving `max_len`
/// each.
pub fn requests_that_fit(
    requests: &[RequestLengths],
    capacity: usize,
    block_size: Option<usize>,
    max_len: usize,
) -> usize {
    let mut used = 0usize;
    requests
        .iter()
        .take_while(|r| {
            used += match block_size {
                Some(b) => r.total().div_ceil(b.max(1)) * b.max(1),
                None => max_len,
            };
            used <= capacity
        })
        .count()
}
