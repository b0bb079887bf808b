//! A step as bytes: how rank 0 hands [`SchedulerOutput`] to ranks in other processes (one
//! [`Communicator::broadcast`](crate::Communicator::broadcast) per step).
//!
//! ```text
//! u8 version
//! u32 #seqs     then per seq:  u64 id, u64 start_pos, u32 logit_rows, u32 #tokens, u32 × tokens,
//!                              u32 #blocks, u32 × blocks
//! u32 #ops      then per op:   u8 tag: 0 Copy {u32 src, u32 dst}
//!                                      1 SwapOut {u64 id, u32 #blocks, u32 × blocks}
//!                                      2 SwapIn {u64 id, u32 #blocks, (u8 some, u32 block) × blocks}
//! u32 #finished then u64 × finished
//! ```
//! Little-endian throughout. [`decode`] checks every length against the bytes that remain before
//! it allocates, so a corrupt message is a [`StepCodecError`], never a huge allocation or a
//! panic; `decode(encode(step)) == step` for every step. [`check`] then holds a decoded step to
//! the rank's pool (its blocks, each sequence's positions and logit rows): a step that decodes
//! but could not come from rank 0's scheduler is an [`InvalidStep`], not a panic in the forward.

use ch03::BlockCopy;
use ch04::{BlockOp, ScheduledSeq, SchedulerOutput};

const VERSION: u8 = 1;

/// Why bytes are not a step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepCodecError {
    #[error("step message version {0}, this build reads version {VERSION}")]
    Version(u8),
    #[error("step message ends early (reading {0})")]
    Truncated(&'static str),
    #[error("step message: unknown block operation {0}")]
    UnknownOp(u8),
    #[error("step message: {0} bytes after the end")]
    Trailing(usize),
    #[error("step message: a value of {0} does not fit this machine's usize")]
    TooLarge(u64),
}

// ANCHOR: encode
/// Appends `step` to `out` (cleared first).
pub fn encode(step: &SchedulerOutput, out: &mut Vec<u8>) {
    out.clear();
    out.push(VERSION);
    put_u32(out, step.seqs.len());
    for seq in &step.seqs {
        put_u64(out, seq.id);
        put_u64(out, seq.start_pos as u64);
        put_u32(out, seq.logit_rows);
        put_u32s(out, &seq.tokens);
        put_u32s(out, &seq.block_table);
    }
    put_u32(out, step.block_ops.len());
    for op in &step.block_ops {
        match op {
            BlockOp::Copy(copy) => {
                out.push(0);
                out.extend_from_slice(&copy.src.to_le_bytes());
                out.extend_from_slice(&copy.dst.to_le_bytes());
            }
            BlockOp::SwapOut { id, blocks } => {
                out.push(1);
                put_u64(out, *id);
                put_u32s(out, blocks);
            }
            BlockOp::SwapIn { id, blocks } => {
                out.push(2);
                put_u64(out, *id);
                put_u32(out, blocks.len());
                for block in blocks {
                    out.push(u8::from(block.is_some()));
                    out.extend_from_slice(&block.unwrap_or(0).to_le_bytes());
                }
            }
        }
    }
    put_u32(out, step.finished.len());
    for id in &step.finished {
        put_u64(out, *id);
    }
}
// ANCHOR_END: encode

/// The step `bytes` hold (see the module's layout).
pub fn decode(bytes: &[u8]) -> Result<SchedulerOutput, StepCodecError> {
    let mut r = Reader { bytes };
    let version = r.u8("the version")?;
    if version != VERSION {
        return Err(StepCodecError::Version(version));
    }
    // Each sequence takes at least 28 bytes, each op 9, each finished id 8: a count larger
    // than the rest of the message allows is corrupt before anything is allocated.
    let n = r.count("the sequence count", 28)?;
    let mut seqs = Vec::with_capacity(n);
    for _ in 0..n {
        seqs.push(ScheduledSeq {
            id: r.u64("a request id")?,
            start_pos: r.usize("a start position")?,
            logit_rows: r.u32("the logit rows")? as usize,
            tokens: r.u32s("the tokens")?,
            block_table: r.u32s("a block table")?,
        });
    }
    let n = r.count("the block-op count", 9)?;
    let mut block_ops = Vec::with_capacity(n);
    for _ in 0..n {
        block_ops.push(match r.u8("a block-op tag")? {
            0 => BlockOp::Copy(BlockCopy {
                src: r.u32("a copy source")?,
                dst: r.u32("a copy target")?,
            }),
            1 => BlockOp::SwapOut {
                id: r.u64("a swap-out id")?,
                blocks: r.u32s("swapped-out blocks")?,
            },
            2 => {
                let id = r.u64("a swap-in id")?;
                let n = r.count("the swap-in count", 5)?;
                let mut blocks = Vec::with_capacity(n);
                for _ in 0..n {
                    let some = r.u8("a swap-in slot")? != 0;
                    let block = r.u32("a swap-in block")?;
                    blocks.push(some.then_some(block));
                }
                BlockOp::SwapIn { id, blocks }
            }
            tag => return Err(StepCodecError::UnknownOp(tag)),
        });
    }
    let n = r.count("the finished count", 8)?;
    let finished = (0..n)
        .map(|_| r.u64("a finished id"))
        .collect::<Result<_, _>>()?;
    if !r.bytes.is_empty() {
        return Err(StepCodecError::Trailing(r.bytes.len()));
    }
    Ok(SchedulerOutput {
        seqs,
        block_ops,
        finished,
    })
}

/// Why a step that decodes cannot run on a rank's pool. Rank 0's scheduler never sends one (a
/// sequence's blocks cover its positions, every block is the pool's), so it is a corrupt or
/// foreign message; [`check`] refuses it before it indexes the pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidStep {
    #[error("{what} names block {block}, but this rank's pool has {num_blocks} blocks")]
    Block {
        what: String,
        block: u32,
        num_blocks: usize,
    },
    #[error("request {id} asks for {logit_rows} logit rows of its {tokens} tokens")]
    LogitRows {
        id: u64,
        logit_rows: usize,
        tokens: usize,
    },
    #[error(
        "request {id}'s {tokens} tokens from position {start_pos} run past its block table \
         ({blocks} blocks of {block_size} positions)"
    )]
    Positions {
        id: u64,
        start_pos: usize,
        tokens: usize,
        blocks: usize,
        block_size: usize,
    },
}

/// Checks a decoded `step` against a pool of `num_blocks` blocks of `block_size` positions:
/// every block it names is one of the pool's, every sequence's logit rows are among its tokens,
/// and its block table holds every position its tokens write. What [`decode`] cannot know, and
/// what the executor would otherwise index out of bounds (a panic) or subtract past zero.
pub fn check(
    step: &SchedulerOutput,
    block_size: usize,
    num_blocks: usize,
) -> Result<(), InvalidStep> {
    let block = |what: &dyn Fn() -> String, block: u32| {
        if (block as usize) < num_blocks {
            Ok(())
        } else {
            Err(InvalidStep::Block {
                what: what(),
                block,
                num_blocks,
            })
        }
    };
    for seq in &step.seqs {
        let (id, tokens) = (seq.id, seq.tokens.len());
        if seq.logit_rows > tokens {
            return Err(InvalidStep::LogitRows {
                id,
                logit_rows: seq.logit_rows,
                tokens,
            });
        }
        let blocks = seq.block_table.len();
        let end = seq.start_pos.checked_add(tokens);
        if tokens > 0 && end.is_none_or(|end| end > blocks.saturating_mul(block_size)) {
            return Err(InvalidStep::Positions {
                id,
                start_pos: seq.start_pos,
                tokens,
                blocks,
                block_size,
            });
        }
        for &b in &seq.block_table {
            block(&|| format!("request {id}'s block table"), b)?;
        }
    }
    for op in &step.block_ops {
        match op {
            BlockOp::Copy(copy) => {
                block(&|| "a block copy's source".into(), copy.src)?;
                block(&|| "a block copy's target".into(), copy.dst)?;
            }
            BlockOp::SwapOut { blocks, .. } => {
                for &b in blocks {
                    block(&|| "a swap-out".into(), b)?;
                }
            }
            BlockOp::SwapIn { blocks, .. } => {
                for &b in blocks.iter().flatten() {
                    block(&|| "a swap-in".into(), b)?;
                }
            }
        }
    }
    Ok(())
}

/// `n` as a u32 length or count. Steps are bounded by the scheduler's token budget and block
/// count, far below 2³² of anything.
fn put_u32(out: &mut Vec<u8>, n: usize) {
    let n = u32::try_from(n).expect("a step holds fewer than 2^32 of anything");
    out.extend_from_slice(&n.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(&n.to_le_bytes());
}

fn put_u32s(out: &mut Vec<u8>, values: &[u32]) {
    put_u32(out, values.len());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// The unread rest of a message.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], StepCodecError> {
        let (head, rest) = self
            .bytes
            .split_first_chunk::<N>()
            .ok_or(StepCodecError::Truncated(what))?;
        self.bytes = rest;
        Ok(*head)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, StepCodecError> {
        Ok(self.take::<1>(what)?[0])
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, StepCodecError> {
        self.take(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, StepCodecError> {
        self.take(what).map(u64::from_le_bytes)
    }

    fn usize(&mut self, what: &'static str) -> Result<usize, StepCodecError> {
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| StepCodecError::TooLarge(v))
    }

    /// A count of items of at least `min_bytes` each, checked against what remains.
    fn count(&mut self, what: &'static str, min_bytes: usize) -> Result<usize, StepCodecError> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_bytes) > self.bytes.len() {
            return Err(StepCodecError::Truncated(what));
        }
        Ok(n)
    }

    fn u32s(&mut self, what: &'static str) -> Result<Vec<u32>, StepCodecError> {
        let n = self.count(what, 4)?;
        (0..n).map(|_| self.u32(what)).collect()
    }
}
