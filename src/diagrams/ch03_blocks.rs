//! Chapter 3's worked example as a figure (`book/src/ch03/blocks.svg`), drawn from the block
//! manager's own state: the example is replayed through `BlockManager` (blocks of 4 positions, a
//! 10-token prompt, a fork for `n = 2`, a decode in both branches that copies on write, a second
//! request that hits the prefix cache), and after each stage the figure draws what the manager
//! holds: every sequence's block table (logical → physical, and which positions hold K/V), the
//! pool's blocks with their reference counts and holders, the copy the pool must perform, and the
//! prefix cache's entries under their chained hashes.
//!
//! `--check` draws it again and fails if the committed figure differs, or if the page's worked
//! example no longer names the blocks the replay hands out (`block table [7, 2, 5]`,
//! `BlockCopy { src: 5, dst: 11 }`, ...).

use std::fmt::Write;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use ch03::block_manager::{ROOT_HASH, block_hash};
use ch03::{BlockCopy, BlockId, BlockManager, BlockTable};

const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 12;
/// What the free list hands out first, in order: the prompt's three blocks, then the block the
/// child's copy-on-write takes. The replay frees earlier sequences so that it does.
const HANDED_OUT: [BlockId; 4] = [7, 2, 5, 11];

/// The prompt `t0 … t9`, as token ids 100..110.
fn prompt() -> Vec<u32> {
    (100..110).collect()
}

/// The later request: the prompt's first 8 tokens, then a tail of its own, `u8 u9`.
fn second_prompt() -> Vec<u32> {
    (100..108).chain([208, 209]).collect()
}

/// One sequence's block table at a stage.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seq {
    name: &'static str,
    blocks: Vec<BlockId>,
    num_tokens: usize,
    /// Leading blocks this stage took from the prefix cache.
    hits: usize,
}

/// A block registered in the prefix cache, found by walking a live table's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    hash: u64,
    block: BlockId,
    /// The block's first position in its sequence (its tokens are `first..first + 4`).
    first: usize,
}

/// What the manager holds after one stage of the example.
#[derive(Debug, Clone)]
struct Stage {
    title: &'static str,
    /// One or two lines saying what the stage called.
    notes: Vec<String>,
    seqs: Vec<Seq>,
    /// Per block of the pool.
    ref_counts: Vec<u32>,
    /// In chain order: `entries[i]` is drawn as `h{i}`.
    entries: Vec<Entry>,
    copy: Option<BlockCopy>,
}

/// The worked example through the real `BlockManager`: four stages, each checked against the
/// manager's invariants.
fn replay() -> Result<Vec<Stage>> {
    let mut m = BlockManager::new(NUM_BLOCKS, BLOCK_SIZE, true);

    // Other sequences have come and gone: twelve one-block prompts (never offered to the prefix
    // cache), freed so that the blocks of HANDED_OUT are on top of the free list, in order.
    let others: Vec<BlockTable> = (0..NUM_BLOCKS as u32)
        .map(|i| m.allocate_prompt(&[1000 + i; BLOCK_SIZE]))
        .collect::<Result<_, _>>()?;
    let (first, mut last): (Vec<_>, Vec<_>) = others
        .into_iter()
        .partition(|t| !HANDED_OUT.contains(&t.blocks()[0]));
    last.sort_by_key(|t| {
        let at = HANDED_OUT.iter().position(|&b| b == t.blocks()[0]);
        std::cmp::Reverse(at)
    });
    for table in first.into_iter().chain(last) {
        m.free(table);
    }

    // 1. Prefill: the prompt's blocks, its K/V written, its full blocks offered to the cache.
    let tokens = prompt();
    let mut parent = m.allocate_prompt(&tokens)?;
    let rest = tokens.len() - parent.num_tokens();
    ensure!(m.reserve(&mut parent, rest)?.is_none(), "a copy in prefill");
    m.commit(&mut parent, tokens.len());
    m.cache_full_blocks(&parent, &tokens);
    let prefill = snapshot(
        &m,
        "prefill",
        vec![
            format!(
                "allocate_prompt(t0 … t9): ⌈10 / 4⌉ = 3 blocks off the free list, {:?}; reserve({rest}), commit({});",
                parent.blocks(),
                tokens.len()
            ),
            "cache_full_blocks registers the two full blocks under chained hashes".to_string(),
        ],
        &[("parent", &parent, 0)],
        None,
    )?;

    // 2. Fork for n = 2: the child shares every block.
    let mut child = m.fork(&parent);
    let fork = snapshot(
        &m,
        "fork (n = 2)",
        vec![
            "fork(parent): the child's table is a copy and each block takes one more reference; no K/V moves"
                .to_string(),
        ],
        &[("parent", &parent, 0), ("child", &child, 0)],
        None,
    )?;

    // 3. Both decode position 10, the child first: it copies the shared block on write.
    let copy = m.reserve(&mut child, 1)?;
    let c = copy.context("the child's first decode copied nothing")?;
    m.commit(&mut child, tokens.len() + 1);
    ensure!(m.reserve(&mut parent, 1)?.is_none(), "the parent copied");
    m.commit(&mut parent, tokens.len() + 1);
    let cow = snapshot(
        &m,
        "decode position 10 in both, the child first",
        vec![
            format!(
                "child: reserve(1) finds block {} shared, takes block {} and returns {c:?};",
                c.src, c.dst
            ),
            format!(
                "parent: reserve(1) finds block {} held by it alone and writes position 10 in place",
                c.src
            ),
        ],
        &[("parent", &parent, 0), ("child", &child, 0)],
        copy,
    )?;

    // 4. A later request with the same first 8 tokens: two prefix hits, one fresh block.
    let before = m.stats().hit_blocks;
    let second = second_prompt();
    let request = m.allocate_prompt(&second)?;
    let hits = (m.stats().hit_blocks - before) as usize;
    let hit = snapshot(
        &m,
        "a second request, t0 … t7 u8 u9",
        vec![
            format!(
                "allocate_prompt: h0 and h1 hit blocks {:?} (one more reference each); {} positions already hold K/V,",
                &request.blocks()[..hits],
                request.num_tokens()
            ),
            format!(
                "only the tail u8 u9 is computed, into block {}",
                request.blocks()[hits]
            ),
        ],
        &[
            ("parent", &parent, 0),
            ("child", &child, 0),
            ("request 2", &request, hits),
        ],
        None,
    )?;
    Ok(vec![prefill, fork, cow, hit])
}

/// The manager's state, checked against its invariants, with `seqs` its live tables.
fn snapshot(
    m: &BlockManager,
    title: &'static str,
    notes: Vec<String>,
    seqs: &[(&'static str, &BlockTable, usize)],
    copy: Option<BlockCopy>,
) -> Result<Stage> {
    let tables: Vec<&BlockTable> = seqs.iter().map(|s| s.1).collect();
    m.check_invariants(&tables).map_err(anyhow::Error::msg)?;
    // The cache's entries: each table's registered blocks from its start, hashed as the cache
    // chains them.
    let mut entries: Vec<Entry> = Vec::new();
    for (_, table, _) in seqs {
        let mut parent = ROOT_HASH;
        for (i, &block) in table.blocks().iter().enumerate() {
            let Some(tokens) = m.cached_tokens(block) else {
                break;
            };
            let hash = block_hash(parent, tokens);
            if !entries.iter().any(|e| e.block == block) {
                entries.push(Entry {
                    hash,
                    block,
                    first: i * BLOCK_SIZE,
                });
            }
            parent = hash;
        }
    }
    let cached = (0..NUM_BLOCKS as BlockId)
        .filter(|&b| m.is_cached(b))
        .count();
    ensure!(
        cached == entries.len(),
        "{cached} cached blocks, {} on the live tables' chains",
        entries.len()
    );
    Ok(Stage {
        title,
        notes,
        seqs: seqs
            .iter()
            .map(|&(name, table, hits)| Seq {
                name,
                blocks: table.blocks().to_vec(),
                num_tokens: table.num_tokens(),
                hits,
            })
            .collect(),
        ref_counts: (0..NUM_BLOCKS as BlockId).map(|b| m.ref_count(b)).collect(),
        entries,
        copy,
    })
}

/// Draws the figure (or, with `check`, compares it and the page's block numbers with the
/// replay); returns what is out of date.
pub fn run(root: &Path, check: bool) -> Result<Vec<String>> {
    let stages = replay()?;
    let svg = crate::bench::describe_svg(&figure(&stages), super::COMMAND);
    let path = root.join("book/src/ch03/blocks.svg");
    let page = root.join("book/src/ch03/index.md");
    let text =
        std::fs::read_to_string(&page).with_context(|| format!("reading {}", page.display()))?;
    let missing = missing_phrases(&text, &stages);
    let mut stale = Vec::new();
    if check {
        if std::fs::read_to_string(&path).ok().as_deref() != Some(svg.as_str()) {
            stale.push(format!(
                "{} is out of date: run `kiln diagrams`",
                path.display()
            ));
        }
        if !missing.is_empty() {
            stale.push(format!(
                "the worked example in {} does not say what the replay does: {}",
                page.display(),
                missing.join("; ")
            ));
        }
        if stale.is_empty() {
            println!(
                "chapter 3's block figure is up to date ({} stages)",
                stages.len()
            );
        }
    } else {
        std::fs::write(&path, &svg).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {} ({} stages)", path.display(), stages.len());
        if !missing.is_empty() {
            println!(
                "note: the worked example in {} lacks {}",
                page.display(),
                missing.join("; ")
            );
        }
    }
    Ok(stale)
}

/// The phrases of the page's worked example that name the replay's blocks.
fn phrases(stages: &[Stage]) -> Vec<String> {
    let (prefill, fork, cow, hit) = (&stages[0], &stages[1], &stages[2], &stages[3]);
    let prompt = &prefill.seqs[0].blocks;
    let mut out = vec![
        format!(
            "hands out blocks {}, {} and {}",
            prompt[0], prompt[1], prompt[2]
        ),
        format!("block table {prompt:?}"),
        format!("the child's table is a copy, `{:?}`", fork.seqs[1].blocks),
        format!("table {:?}", cow.seqs[1].blocks),
    ];
    if let Some(copy) = cow.copy {
        out.push(format!("{copy:?}"));
    }
    for (i, e) in prefill.entries.iter().enumerate() {
        out.push(format!("block {} under `h{i}", e.block));
    }
    out.push(format!("its table is `{:?}`", hit.seqs[2].blocks));
    out
}

/// The phrases the page's "A worked example" section lacks (whitespace runs compare as one
/// space, so line breaks do not matter).
fn missing_phrases(page: &str, stages: &[Stage]) -> Vec<String> {
    let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let section = page.find("## A worked example").map_or("", |at| {
        let rest = &page[at..];
        let end = rest[2..].find("\n## ").map_or(rest.len(), |e| e + 2);
        &rest[..end]
    });
    let section = squash(section);
    phrases(stages)
        .into_iter()
        .filter(|p| !section.contains(&squash(p)))
        .map(|p| format!("`{p}`"))
        .collect()
}

const WIDTH: usize = 780;
const LABEL_X: usize = 16;
const CELL_X: usize = 100; // the first logical block's cell
const CELL_W: usize = 60;
const CELL_PITCH: usize = 66;
const CELL_H: usize = 30;
const ROW_H: usize = 36;
const CACHE_X: usize = 430;
const BLOCK_W: usize = 48;
const BLOCK_PITCH: usize = 54;
const BLOCK_H: usize = 46;

const FREE: &str = "#f2f2f2";
const ONE: &str = "#dbe7f3";
const SHARED: &str = "#f6c28b";
const HIT: &str = "#fdf2c4";

fn seq_colour(i: usize) -> &'static str {
    ["#4a7fb5", "#27ae60", "#9b59b6", "#7f8c8d"][i.min(3)]
}

/// The whole figure as an SVG document, one panel per stage.
fn figure(stages: &[Stage]) -> String {
    let mut body = String::new();
    let mut y = 52;
    for (n, stage) in stages.iter().enumerate() {
        if n > 0 {
            writeln!(
                body,
                r##"<line x1="{LABEL_X}" y1="{y}" x2="{}" y2="{y}" stroke="#ccc"/>"##,
                WIDTH - LABEL_X
            )
            .unwrap();
        }
        y = panel(&mut body, n + 1, stage, y + 8);
    }
    let legend_y = y + 14;
    let height = legend_y + 40;
    let mut svg = String::new();
    writeln!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">"##
    )
    .unwrap();
    svg.push_str(
        r##"<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0 0 L10 5 L0 10 z" fill="#c0392b"/></marker></defs>"##,
    );
    svg.push('\n');
    writeln!(
        svg,
        r##"<rect width="{WIDTH}" height="{height}" fill="white"/>"##
    )
    .unwrap();
    writeln!(
        svg,
        r##"<text x="{LABEL_X}" y="18" font-size="12">chapter 3's worked example through BlockManager: blocks of {BLOCK_SIZE} positions, a pool of {NUM_BLOCKS} (kiln diagrams)</text>"##
    )
    .unwrap();
    writeln!(
        svg,
        r##"<text x="{LABEL_X}" y="36" fill="#555">Before it, {NUM_BLOCKS} one-block sequences came and went, freed in an order that leaves {} on top of the free list.</text>"##,
        HANDED_OUT.map(|b| b.to_string()).join(", ")
    )
    .unwrap();
    svg.push_str(&body);
    legend(&mut svg, legend_y);
    svg.push_str("</svg>\n");
    svg
}

/// One stage from `top`: title, tables, cache entries, pool, copy; returns its bottom.
fn panel(svg: &mut String, n: usize, stage: &Stage, top: usize) -> usize {
    writeln!(
        svg,
        r##"<text x="{LABEL_X}" y="{}" font-size="12" font-weight="bold">{n}. {}</text>"##,
        top + 14,
        stage.title
    )
    .unwrap();
    for (i, note) in stage.notes.iter().enumerate() {
        writeln!(
            svg,
            r##"<text x="{LABEL_X}" y="{}" fill="#555">{note}</text>"##,
            top + 30 + i * 14
        )
        .unwrap();
    }
    let header = top + 30 + stage.notes.len() * 14 + 8;
    let rows = header + 6;

    // The block tables: one row per sequence, one cell per logical block.
    let longest = stage.seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(0);
    writeln!(
        svg,
        r##"<text x="{LABEL_X}" y="{header}" fill="#555">logical block</text>"##
    )
    .unwrap();
    for i in 0..longest {
        writeln!(
            svg,
            r##"<text x="{}" y="{header}" text-anchor="middle" fill="#555">{i}</text>"##,
            CELL_X + i * CELL_PITCH + CELL_W / 2
        )
        .unwrap();
    }
    for (r, seq) in stage.seqs.iter().enumerate() {
        let y = rows + r * ROW_H;
        let colour = seq_colour(r);
        writeln!(
            svg,
            r##"<text x="{LABEL_X}" y="{}" font-weight="bold" fill="{colour}">{}</text>"##,
            y + 19,
            seq.name
        )
        .unwrap();
        for (i, &block) in seq.blocks.iter().enumerate() {
            let x = CELL_X + i * CELL_PITCH;
            let (fill, dash) = if i < seq.hits {
                (HIT, r##" stroke-dasharray="4 2""##)
            } else {
                ("white", "")
            };
            writeln!(
                svg,
                r##"<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" fill="{fill}" stroke="{colour}"{dash}><title>{}: logical block {i} → physical block {block}</title></rect>"##,
                seq.name
            )
            .unwrap();
            writeln!(
                svg,
                r##"<text x="{}" y="{}" text-anchor="middle">block {block}</text>"##,
                x + CELL_W / 2,
                y + 13
            )
            .unwrap();
            // One square per position: filled if it holds K/V.
            for o in 0..BLOCK_SIZE {
                let pos = i * BLOCK_SIZE + o;
                let sq = if pos < seq.num_tokens {
                    format!(r##"fill="{colour}""##)
                } else {
                    r##"fill="white" stroke="#bbb""##.to_string()
                };
                writeln!(
                    svg,
                    r##"<rect x="{}" y="{}" width="11" height="7" {sq}><title>position {pos}</title></rect>"##,
                    x + 5 + o * 13,
                    y + 18
                )
                .unwrap();
            }
        }
        writeln!(
            svg,
            r##"<text x="{}" y="{}" fill="#555">{} positions</text>"##,
            CELL_X + longest * CELL_PITCH + 2,
            y + 19,
            seq.num_tokens
        )
        .unwrap();
    }
    let tables_bottom = rows + stage.seqs.len() * ROW_H;

    // The prefix cache: each entry's hash, how it chains, and its block.
    writeln!(
        svg,
        r##"<text x="{CACHE_X}" y="{header}" fill="#555">prefix cache (hash → block)</text>"##
    )
    .unwrap();
    if stage.entries.is_empty() {
        writeln!(
            svg,
            r##"<text x="{CACHE_X}" y="{}" fill="#555">(empty)</text>"##,
            rows + 13
        )
        .unwrap();
    }
    for (i, e) in stage.entries.iter().enumerate() {
        let y = rows + 13 + i * 30;
        let parent = if i == 0 {
            "root".to_string()
        } else {
            format!("h{}", i - 1)
        };
        writeln!(
            svg,
            r##"<text x="{CACHE_X}" y="{y}"><tspan font-weight="bold">h{i}</tspan> = hash({parent}, t{} … t{}) → block {}</text>"##,
            e.first,
            e.first + BLOCK_SIZE - 1,
            e.block
        )
        .unwrap();
        writeln!(
            svg,
            r##"<text x="{}" y="{}" fill="#555" font-family="monospace" font-size="10">= {:#018x}</text>"##,
            CACHE_X + 18,
            y + 13,
            e.hash
        )
        .unwrap();
    }
    let cache_bottom = rows + stage.entries.len().max(1) * 30;

    // The pool: every block, its reference count, who holds it, its hash if registered.
    let pool = tables_bottom.max(cache_bottom) + 10;
    writeln!(
        svg,
        r##"<text x="{LABEL_X}" y="{}" font-weight="bold">pool</text>"##,
        pool + 18
    )
    .unwrap();
    writeln!(
        svg,
        r##"<text x="{LABEL_X}" y="{}" fill="#555">block, refs</text>"##,
        pool + 32
    )
    .unwrap();
    for (b, &refs) in stage.ref_counts.iter().enumerate() {
        let x = CELL_X + b * BLOCK_PITCH;
        let block = b as BlockId;
        let tag = stage.entries.iter().position(|e| e.block == block);
        let fill = match refs {
            0 => FREE,
            1 => ONE,
            _ => SHARED,
        };
        let stroke = if tag.is_some() { "#333" } else { "#999" };
        writeln!(
            svg,
            r##"<rect x="{x}" y="{pool}" width="{BLOCK_W}" height="{BLOCK_H}" fill="{fill}" stroke="{stroke}"><title>block {b}: reference count {refs}</title></rect>"##
        )
        .unwrap();
        let ink = if refs == 0 && tag.is_none() {
            "#999"
        } else {
            "black"
        };
        writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="middle" font-weight="bold" fill="{ink}">{b}</text>"##,
            x + BLOCK_W / 2,
            pool + 14
        )
        .unwrap();
        let count = if refs == 0 && tag.is_none() {
            "free".to_string()
        } else {
            format!("ref {refs}")
        };
        writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="middle" fill="{ink}">{count}</text>"##,
            x + BLOCK_W / 2,
            pool + 28
        )
        .unwrap();
        let holders = stage
            .seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.blocks.contains(&block));
        for (k, (r, _)) in holders.enumerate() {
            writeln!(
                svg,
                r##"<rect x="{}" y="{}" width="6" height="6" fill="{}"/>"##,
                x + 5 + k * 8,
                pool + 35,
                seq_colour(r)
            )
            .unwrap();
        }
        if let Some(i) = tag {
            writeln!(
                svg,
                r##"<text x="{}" y="{}" text-anchor="end" font-size="10" font-weight="bold">h{i}</text>"##,
                x + BLOCK_W - 4,
                pool + 42
            )
            .unwrap();
        }
    }
    let mut bottom = pool + BLOCK_H + 8;

    // The copy-on-write: an arrow under the pool from the source block to the copy.
    if let Some(BlockCopy { src, dst }) = stage.copy {
        let xs = CELL_X + src as usize * BLOCK_PITCH + BLOCK_W / 2;
        let xd = CELL_X + dst as usize * BLOCK_PITCH + BLOCK_W / 2;
        let y = pool + BLOCK_H + 2;
        writeln!(
            svg,
            r##"<path d="M{xs} {y} C{xs} {} {xd} {} {xd} {}" fill="none" stroke="#c0392b" stroke-width="1.5" marker-end="url(#arrow)"/>"##,
            y + 26,
            y + 26,
            y + 2
        )
        .unwrap();
        writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="middle" fill="#c0392b">copy on write: BlockCopy {{ src: {src}, dst: {dst} }}, every layer's K and V</text>"##,
            (xs + xd) / 2,
            y + 36
        )
        .unwrap();
        bottom = y + 44;
    }
    bottom
}

/// What the colours and marks mean, in two lines.
fn legend(svg: &mut String, y: usize) {
    let pool = [
        (FREE, "#999", "free"),
        (ONE, "#999", "held by one table"),
        (SHARED, "#999", "shared: read-only, copied on write"),
        ("white", "#333", "hN: registered in the prefix cache"),
    ];
    let mut x = LABEL_X;
    for (fill, stroke, label) in pool {
        writeln!(
            svg,
            r##"<rect x="{x}" y="{}" width="12" height="12" fill="{fill}" stroke="{stroke}"/><text x="{}" y="{y}">{label}</text>"##,
            y - 10,
            x + 16
        )
        .unwrap();
        x += 30 + 6 * label.chars().count();
    }
    let y = y + 20;
    let mut x = LABEL_X;
    writeln!(
        svg,
        r##"<rect x="{x}" y="{}" width="11" height="7" fill="{}"/><text x="{}" y="{y}">a position holding K/V</text>"##,
        y - 8,
        seq_colour(0),
        x + 16
    )
    .unwrap();
    x += 30 + 6 * "a position holding K/V".len();
    writeln!(
        svg,
        r##"<rect x="{x}" y="{}" width="11" height="7" fill="white" stroke="#bbb"/><text x="{}" y="{y}">a position reserved, not written</text>"##,
        y - 8,
        x + 16
    )
    .unwrap();
    x += 30 + 6 * "a position reserved, not written".len();
    writeln!(
        svg,
        r##"<rect x="{x}" y="{}" width="12" height="12" fill="{HIT}" stroke="#999" stroke-dasharray="4 2"/><text x="{}" y="{y}">a block found in the prefix cache</text>"##,
        y - 10,
        x + 16
    )
    .unwrap();
    x += 30 + 6 * "a block found in the prefix cache".len();
    writeln!(
        svg,
        r##"<rect x="{x}" y="{}" width="6" height="6" fill="{}"/><text x="{}" y="{y}">a table holding the block</text>"##,
        y - 7,
        seq_colour(1),
        x + 10
    )
    .unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(stage: &Stage) -> Vec<(BlockId, u32)> {
        (0..NUM_BLOCKS as BlockId)
            .map(|b| (b, stage.ref_counts[b as usize]))
            .filter(|&(_, c)| c > 0)
            .collect()
    }

    #[test]
    fn the_replay_does_what_the_worked_example_says() {
        let stages = replay().unwrap();
        assert_eq!(stages.len(), 4);

        // Prefill: blocks 7, 2, 5, each held once; the two full ones registered, chained.
        let [parent] = &stages[0].seqs[..] else {
            panic!("one sequence in prefill")
        };
        assert_eq!(
            (&parent.blocks[..], parent.num_tokens),
            (&[7, 2, 5][..], 10)
        );
        assert_eq!(counts(&stages[0]), [(2, 1), (5, 1), (7, 1)]);
        let tokens = prompt();
        let h0 = block_hash(ROOT_HASH, &tokens[0..4]);
        let h1 = block_hash(h0, &tokens[4..8]);
        let cache: Vec<_> = stages[0]
            .entries
            .iter()
            .map(|e| (e.hash, e.block))
            .collect();
        assert_eq!(cache, [(h0, 7), (h1, 2)]);

        // Fork: the child's table is a copy; every block has count 2.
        assert_eq!(stages[1].seqs[1].blocks, [7, 2, 5]);
        assert_eq!(counts(&stages[1]), [(2, 2), (5, 2), (7, 2)]);

        // The child's decode copies block 5 into block 11; the parent writes in place.
        let cow = &stages[2];
        assert_eq!(cow.copy, Some(BlockCopy { src: 5, dst: 11 }));
        assert_eq!(cow.seqs[0].blocks, [7, 2, 5]);
        assert_eq!(cow.seqs[1].blocks, [7, 2, 11]);
        assert!(cow.seqs.iter().all(|s| s.num_tokens == 11));
        assert_eq!(counts(cow), [(2, 2), (5, 1), (7, 2), (11, 1)]);

        // The second request hits h0 and h1 (blocks 7 and 2) and computes its tail in block 10.
        let hit = &stages[3];
        let request = &hit.seqs[2];
        assert_eq!((&request.blocks[..], request.hits), (&[7, 2, 10][..], 2));
        assert_eq!(request.num_tokens, 8);
        assert_eq!(counts(hit), [(2, 3), (5, 1), (7, 3), (10, 1), (11, 1)]);
        assert_eq!(hit.entries, stages[0].entries);
    }

    #[test]
    fn the_page_names_the_replays_blocks() {
        let stages = replay().unwrap();
        let page = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("book/src/ch03/index.md"),
        )
        .unwrap();
        assert_eq!(missing_phrases(&page, &stages), Vec::<String>::new());
        // A wrong block number, across a line break, is caught.
        let wrong = "## A worked example\nthe free list hands out\nblocks 7, 2 and 6\n## Next\n";
        assert!(
            missing_phrases(wrong, &stages)
                .iter()
                .any(|p| p.contains("hands out blocks 7, 2 and 5"))
        );
    }

    #[test]
    fn the_figure_is_deterministic_and_draws_every_stage() {
        let stages = replay().unwrap();
        let svg = figure(&stages);
        assert_eq!(svg, figure(&replay().unwrap()));
        for stage in &stages {
            assert!(svg.contains(stage.title));
        }
        assert!(svg.contains("BlockCopy { src: 5, dst: 11 }"));
    }
}
