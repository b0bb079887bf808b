//! `kiln bench structured`: what a grammar's token mask costs per token (chapter 8).
//!
//! For each constraint, many walks through the grammar: at every token, compute the mask
//! (`prepare`), apply it to a logits row (`apply`), pick an allowed token at random (a model
//! would sample one) and move the parse on (`accept`). Reported: the median time per token of
//! each part, the allowed tokens per step, and the compile time. The model's forward is not
//! run: the mask's cost is what is added to each decode step of a constrained sequence.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use ch08::structured::{Constraint, Grammars};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use super::table::{Align, Table};
use super::{Output, RunFacts};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model folders whose tokenizers are measured [default: the embedded model].
    #[arg(long, value_name = "DIR")]
    pub model: Vec<PathBuf>,
    /// Walks per constraint [default 40, 4 with --quick].
    #[arg(long)]
    pub walks: Option<usize>,
    #[command(flatten)]
    pub output: Output,
}

fn constraints() -> Vec<(&'static str, Constraint)> {
    vec![
        (
            "json_schema (object, 3 keys)",
            Constraint::JsonSchema(json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}
                },
                "required": ["name", "age", "tags"],
                "additionalProperties": false
            })),
        ),
        ("json_object (any)", Constraint::JsonObject),
        (
            "regex (a date)",
            Constraint::Regex("[0-9]{4}-[0-9]{2}-[0-9]{2}".into()),
        ),
        (
            "choice (3 strings)",
            Constraint::Choice(vec!["Romeo".into(), "Juliet".into(), "Mercutio".into()]),
        ),
    ]
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let dirs = if args.model.is_empty() {
        vec![::ch01::default_model_dir()]
    } else {
        args.model.clone()
    };
    let walks = args.walks.unwrap_or(if args.output.quick { 4 } else { 40 });
    let max_steps = 64;
    let mut table = Table::new([
        "tokenizer",
        "vocab",
        "constraint",
        "compile ms",
        "mask µs/token",
        "apply µs/token",
        "accept µs/token",
        "allowed tokens (median)",
    ])
    .align(0, Align::Left)
    .align(2, Align::Left);
    for dir in &dirs {
        let tokenizer = Arc::new(
            ::ch01::Tokenizer::from_dir(dir)
                .with_context(|| format!("loading the tokenizer of {}", dir.display()))?,
        );
        let config = ::ch01::LlamaConfig::from_dir(dir)?;
        let vocab = config.vocab_size;
        let mut eos = ::ch01::eos_token_ids(dir, &config)?;
        if let Some(e) = tokenizer.eos_token_id()
            && !eos.contains(&e)
        {
            eos.push(e);
        }
        let name = super::model_name(dir);
        let built = Instant::now();
        let grammars =
            Grammars::new(Arc::clone(&tokenizer), vocab, &eos).map_err(anyhow::Error::msg)?;
        eprintln!(
            "{name}: token trie and grammar engine built in {:.1} ms",
            built.elapsed().as_secs_f64() * 1e3
        );
        for (label, constraint) in constraints() {
            let start = Instant::now();
            let compiled = grammars
                .compile(&constraint, "bench")
                .map_err(|e| anyhow::anyhow!("{label}: {}", e.message))?;
            let compile_ms = start.elapsed().as_secs_f64() * 1e3;
            let (mut mask, mut apply, mut accept, mut allowed) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut logits = vec![0.0f32; vocab];
            for walk in 0..walks {
                let mut rng = ChaCha8Rng::seed_from_u64(walk as u64);
                let mut state = compiled.start(Default::default());
                for _ in 0..max_steps {
                    let t = Instant::now();
                    state.prepare();
                    mask.push(secs_us(t.elapsed()));
                    logits.fill(0.0);
                    let t = Instant::now();
                    state.apply(&mut logits);
                    apply.push(secs_us(t.elapsed()));
                    let ok: Vec<u32> = (0..vocab as u32)
                        .filter(|&i| logits[i as usize].is_finite())
                        .collect();
                    allowed.push(ok.len() as f64);
                    let token = ok[rng.random_range(0..ok.len())];
                    let t = Instant::now();
                    let done = state.accept(token);
                    accept.push(secs_us(t.elapsed()));
                    if done {
                        break;
                    }
                }
            }
            table.row([
                name.clone(),
                vocab.to_string(),
                label.to_string(),
                format!("{compile_ms:.2}"),
                format!("{:.1}", median(mask)),
                format!("{:.1}", median(apply)),
                format!("{:.1}", median(accept)),
                format!("{:.0}", median(allowed)),
            ]);
        }
    }
    let facts = RunFacts::collect();
    let markdown = format!(
        "{}\n\nMedian over {walks} random walks of up to {max_steps} tokens per constraint \
         (an allowed token picked uniformly at each step). `{}`, {} build, {} CPUs{}, {}.\n",
        table.to_markdown(),
        facts.command,
        if cfg!(debug_assertions) {
            "debug (kiln's crates at opt-level 1, dependencies at 3)"
        } else {
            "release"
        },
        facts.nproc,
        facts.cpu.map(|c| format!(" ({c})")).unwrap_or_default(),
        facts.date
    );
    let out = args.output.dir("ch08");
    std::fs::create_dir_all(&out)?;
    let path = out.join("structured-mask.md");
    std::fs::write(&path, &markdown).with_context(|| format!("writing {}", path.display()))?;
    println!("{markdown}");
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn secs_us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
