//! A per-op profile of forward steps: where a step's time goes, op by op.
//!
//! ```text
//! let _span = profile::span(Op::RmsNorm);   // times until the end of the scope, if enabled
//! profile::set_enabled(true); …steps…; let totals = profile::take();
//! ```
//! Off by default: then a span costs one relaxed atomic load and reads no clock. On, a span
//! reads the clock twice and adds its nanoseconds to its op's total, an atomic counter that
//! any thread may add to. Spans wrap whole ops on the thread that runs the step (an op that
//! splits across threads is timed once, from the outside), so the totals of one step add up to
//! at most its wall time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The ops a step is made of, in the order a step runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Embed,
    RmsNorm,
    /// q, k and v, one parallel region.
    QkvProj,
    Rope,
    Attention,
    OProj,
    Residual,
    /// gate and up, one parallel region.
    GateUpProj,
    SiluMul,
    DownProj,
    FinalNorm,
    LmHead,
    Sampling,
}

impl Op {
    /// Every op, in step order.
    pub const ALL: [Op; 13] = [
        Op::Embed,
        Op::RmsNorm,
        Op::QkvProj,
        Op::Rope,
        Op::Attention,
        Op::OProj,
        Op::Residual,
        Op::GateUpProj,
        Op::SiluMul,
        Op::DownProj,
        Op::FinalNorm,
        Op::LmHead,
        Op::Sampling,
    ];

    /// The op's name as the profile table prints it.
    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embed",
            Op::RmsNorm => "rms_norm",
            Op::QkvProj => "qkv_proj",
            Op::Rope => "rope",
            Op::Attention => "attention",
            Op::OProj => "o_proj",
            Op::Residual => "residual",
            Op::GateUpProj => "gate_up_proj",
            Op::SiluMul => "silu_mul",
            Op::DownProj => "down_proj",
            Op::FinalNorm => "final_norm",
            Op::LmHead => "lm_head",
            Op::Sampling => "sampling",
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Nanoseconds spent in each op since the last [`take`], indexed like [`Op::ALL`].
static NANOS: [AtomicU64; Op::ALL.len()] = [const { AtomicU64::new(0) }; Op::ALL.len()];

/// Turns the profile on or off for the whole process.
pub fn set_enabled(enabled: bool) {
    ENABLED.store(enabled, Ordering::Relaxed);
}

/// Whether spans are being timed.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Times `op` from now until the span is dropped, when the profile is on.
#[inline]
pub fn span(op: Op) -> Span {
    Span {
        op,
        start: enabled().then(Instant::now),
    }
}

/// Runs `f` inside a [`span`] of `op`; returns what `f` returns.
#[inline]
pub fn timed<T>(op: Op, f: impl FnOnce() -> T) -> T {
    let _span = span(op);
    f()
}

/// A running timer for one op; see [`span`].
#[must_use = "a span times until it is dropped"]
pub struct Span {
    op: Op,
    start: Option<Instant>, // None: the profile was off when the span began
}

impl Drop for Span {
    #[inline]
    fn drop(&mut self) {
        if let Some(start) = self.start {
            let nanos = start.elapsed().as_nanos() as u64;
            NANOS[self.op as usize].fetch_add(nanos, Ordering::Relaxed);
        }
    }
}

/// Each op's time since the last call (or the start), in [`Op::ALL`] order; resets them to 0.
pub fn take() -> Vec<(Op, Duration)> {
    Op::ALL
        .iter()
        .map(|&op| {
            let nanos = NANOS[op as usize].swap(0, Ordering::Relaxed);
            (op, Duration::from_nanos(nanos))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_index_their_own_counter() {
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{}", op.name());
        }
    }
}
