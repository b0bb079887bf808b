//! `kiln diagrams`: the book's figures that are drawn from what the engine did, not measured.
//!
//! One function per figure, each a hand-written SVG string (deterministic: the same run, the
//! same bytes):
//!
//! | module          | figure                    | drawn from                                       |
//! |-----------------|---------------------------|--------------------------------------------------|
//! | [`ch03_blocks`] | `book/src/ch03/blocks.svg` | chapter 3's worked example replayed through `BlockManager` |
//! | [`ch04_trace`]  | `book/src/ch04/trace.svg`  | the `--trace` lines of chapter 4's demo          |
//!
//! `--check` (CI) draws them again and fails if a committed figure, or what a page prints
//! beside it (chapter 4's trace, chapter 3's block numbers), is not what the code does now.

mod ch03_blocks;
mod ch04_trace;

use std::path::PathBuf;

use anyhow::{Result, bail};

/// What the figures' descriptions name as the command that drew them (`kiln figures` checks it).
const COMMAND: &str = "kiln diagrams";

#[derive(clap::Args)]
pub struct Args {
    /// Fail if a committed figure (or what the book prints beside it) is out of date.
    #[arg(long)]
    check: bool,
}

pub fn run(args: Args) -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut stale = ch03_blocks::run(&root, args.check)?;
    stale.extend(ch04_trace::run(&root, args.check)?);
    if !stale.is_empty() {
        bail!("{}", stale.join("\n"));
    }
    Ok(())
}
