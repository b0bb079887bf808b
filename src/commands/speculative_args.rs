//! Speculative decoding's flags (chapter 6), named as vLLM's: `kiln generate`, `kiln serve`
//! and `kiln bench ch06` share them.

use std::path::PathBuf;

use anyhow::{Context, bail};
use ch01::Llama;
use ch04::Speculator;
use ch06::{
    DEFAULT_CATCH_UP_BUDGET, Drafter, ModelDrafter, NgramDrafter, SpecConfig, SpeculativeDecoding,
    draft_executor, layer_skip_config, layer_skip_executor,
};

use super::ModelArgs;

/// Where the target's weights are, which says where a drafter that runs a model runs.
#[derive(Clone, Copy)]
pub enum TargetWeights<'m, 'a> {
    /// In host memory: the draft model, or the target's first layers, on chapter 4's CPU
    /// executor.
    Host(&'m Llama),
    /// On a GPU, read from the files these flags name (its configuration as the host read
    /// it): the draft model, or the target's first layers read again from its files, get an
    /// executor of their own on the same GPU.
    Gpu(&'a ModelArgs, &'a ch01::LlamaConfig),
    /// Split across tensor-parallel ranks (chapter 8), each holding its shard only (the
    /// target's configuration): the draft model runs beside them on chapter 4's CPU executor.
    /// The layer-skip drafter cannot: it runs the target's first layers whole, from host
    /// memory ([`SpeculativeArgs::needs_target_weights`]).
    Ranks(&'a ch01::LlamaConfig),
}

impl TargetWeights<'_, '_> {
    /// The target's configuration.
    fn config(&self) -> &ch01::LlamaConfig {
        match self {
            TargetWeights::Host(model) => &model.config,
            TargetWeights::Gpu(_, config) | TargetWeights::Ranks(config) => config,
        }
    }
}

/// A GPU executor over the model `args` names, cut to `config` (its own, or its first layers),
/// with a K/V pool of `memory` bytes in `cache`'s element type and block size: never a share of
/// the device (--gpu-memory-utilization sizes the target's pool only).
fn gpu_draft_executor(
    args: &ModelArgs,
    config: &ch01::LlamaConfig,
    cache: &ch04::CacheConfig,
    memory: u64,
) -> anyhow::Result<Box<dyn ch04::Executor + Send>> {
    let args = ModelArgs {
        gpu_memory_utilization: None,
        ..args.clone()
    };
    let cache = ch04::CacheConfig { memory, ..*cache };
    args.gpu_executor(config, &cache).context(
        "the drafter's executor on the GPU (with --gpu-memory-utilization, leave it room: the \
         target's K/V pool takes its share first)",
    )
}

/// `--speculative-method`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    /// A smaller model with the same tokenizer (`--speculative-model`).
    Draft,
    /// Prompt lookup: what followed the last earlier occurrence of the sequence's final n-gram.
    Ngram,
    /// The target's first `--speculative-layers` layers, its final norm and head.
    LayerSkip,
}

/// A count of at least 1.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{text:?}: expected a whole number of at least 1")),
    }
}

/// `--speculative-catch-up-budget`: a whole number of tokens, at least 1 (a budget of 0 would
/// let no token of a prompt through to the draft model; the drafter itself raises it to 1).
fn catch_up_budget(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err(String::from(
            "0 is no budget: the draft model reads at least 1 token a step to catch up",
        )),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "{text:?}: expected a whole number of tokens, at least 1 (and at most \
             --max-num-batched-tokens)"
        )),
    }
}

// The tuning flags need a method: given alone they would change nothing, silently.
#[derive(clap::Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("speculation")
    .args(["speculative_model", "speculative_method"])
    .multiple(true)))]
pub struct SpeculativeArgs {
    /// Draft model directory (same tokenizer as --model); implies --speculative-method draft.
    #[arg(long, value_name = "DIR")]
    pub speculative_model: Option<PathBuf>,
    /// How drafts are proposed; speculation is off unless this or --speculative-model is given.
    #[arg(long, value_enum)]
    pub speculative_method: Option<SpecMethod>,
    /// Most draft tokens per sequence and step (k).
    #[arg(long, default_value_t = 4, value_name = "K", requires = "speculation")]
    pub num_speculative_tokens: usize,
    /// No drafts in steps where more than N sequences run.
    #[arg(long, value_name = "N", requires = "speculation")]
    pub speculative_disable_by_batch_size: Option<usize>,
    /// Shortest n-gram the n-gram method looks up.
    #[arg(long, default_value_t = 1, value_name = "N", requires = "speculation")]
    pub prompt_lookup_min: usize,
    /// Longest n-gram the n-gram method looks up (tried first).
    #[arg(long, default_value_t = 4, value_name = "N", requires = "speculation")]
    pub prompt_lookup_max: usize,
    /// Layers the layer-skip drafter keeps [default: half the model's].
    #[arg(long, value_name = "L", requires = "speculation", value_parser = at_least_one)]
    pub speculative_layers: Option<usize>,
    /// KV memory of the draft model's own paged cache (draft and layer-skip).
    #[arg(long, default_value = "64MiB", value_parser = super::parse_bytes, requires = "speculation")]
    pub speculative_kv_cache_memory: u64,
    /// Most tokens the draft model reads in one step to catch up with a sequence (a new
    /// prompt, a dropped state; draft and layer-skip), at most --max-num-batched-tokens; a
    /// sequence with more catches up over several steps, without drafts meanwhile [default:
    /// 512, or --max-num-batched-tokens if fewer].
    #[arg(long, value_name = "N", requires = "speculation", value_parser = catch_up_budget)]
    pub speculative_catch_up_budget: Option<usize>,
}

impl SpeculativeArgs {
    /// The method asked for, if any.
    pub fn method(&self) -> anyhow::Result<Option<SpecMethod>> {
        match (self.speculative_method, &self.speculative_model) {
            (None, Some(_)) | (Some(SpecMethod::Draft), Some(_)) => Ok(Some(SpecMethod::Draft)),
            (Some(SpecMethod::Draft), None) => {
                bail!("--speculative-method draft needs --speculative-model DIR")
            }
            (Some(method), Some(_)) => {
                bail!("--speculative-model is for --speculative-method draft, not {method:?}")
            }
            (method, None) => Ok(method),
        }
    }

    pub fn config(&self) -> SpecConfig {
        SpecConfig {
            num_speculative_tokens: self.num_speculative_tokens,
            disable_by_batch_size: self.speculative_disable_by_batch_size,
        }
    }

    /// The draft model's catch-up budget in an engine whose steps run at most
    /// `max_num_batched_tokens` tokens: --speculative-catch-up-budget, or
    /// [`DEFAULT_CATCH_UP_BUDGET`] cut to that. A draft forward never reads more tokens than
    /// the engine lets the target's step run, so a larger budget is refused, as is 0 (no
    /// sequence would ever catch up) and the flag with n-gram lookup (no model to catch up).
    pub fn catch_up_budget(&self, max_num_batched_tokens: usize) -> anyhow::Result<usize> {
        let Some(budget) = self.speculative_catch_up_budget else {
            return Ok(DEFAULT_CATCH_UP_BUDGET.min(max_num_batched_tokens));
        };
        if self.method()? == Some(SpecMethod::Ngram) {
            bail!(
                "--speculative-catch-up-budget is for the draft and layer-skip methods: n-gram \
                 lookup runs no model that could fall behind"
            );
        }
        if budget == 0 {
            bail!("--speculative-catch-up-budget must be at least 1");
        }
        if budget > max_num_batched_tokens {
            bail!(
                "--speculative-catch-up-budget {budget} is more than --max-num-batched-tokens \
                 {max_num_batched_tokens}: the draft model catches up within what one engine \
                 step may run"
            );
        }
        Ok(budget)
    }

    /// Whether the drafter needs the target's weights whole in host memory: the layer-skip
    /// drafter runs its first layers there. (The others need at most its configuration.)
    pub fn needs_target_weights(&self) -> anyhow::Result<bool> {
        Ok(self.method()? == Some(SpecMethod::LayerSkip))
    }

    /// The draft model, loaded as the target was (`dtype`), if the method is `draft`; `target`:
    /// the target's configuration, whose vocabulary the draft's must equal.
    pub fn load_draft(
        &self,
        dtype: &str,
        target: &ch01::LlamaConfig,
    ) -> anyhow::Result<Option<Llama>> {
        let (Some(SpecMethod::Draft), Some(dir)) = (self.method()?, &self.speculative_model) else {
            return Ok(None);
        };
        let dtype: ch02::WeightDtype = dtype.parse().map_err(anyhow::Error::msg)?;
        let draft = ch02::load_fast(dir, dtype)
            .with_context(|| format!("loading the draft model from {}", dir.display()))?;
        if draft.config.vocab_size != target.vocab_size {
            bail!(
                "the draft model {} has {} tokens, the target {}: they must share a tokenizer",
                dir.display(),
                draft.config.vocab_size,
                target.vocab_size
            );
        }
        Ok(Some(draft))
    }

    /// The engine's speculator for a target whose weights are where `target` says (and the
    /// draft model `load_draft` returned, for a target in host memory), or `None` when
    /// speculation is off. `cache`: the target's K/V configuration, whose block size (and,
    /// on a GPU, element type) the draft's own cache of --speculative-kv-cache-memory takes;
    /// `engine`: the engine's, whose `max_num_batched_tokens` bounds the catch-up budget
    /// ([`Self::catch_up_budget`]).
    pub fn speculator<'m>(
        &self,
        target: TargetWeights<'m, '_>,
        draft: Option<&'m Llama>,
        cache: &ch04::CacheConfig,
        engine: &ch04::EngineConfig,
    ) -> anyhow::Result<Option<Box<dyn Speculator + 'm>>> {
        let Some(method) = self.method()? else {
            return Ok(None);
        };
        if self.num_speculative_tokens == 0 {
            bail!("--num-speculative-tokens must be at least 1");
        }
        let catch_up_budget = self.catch_up_budget(engine.max_num_batched_tokens)?;
        let (memory, block_size) = (self.speculative_kv_cache_memory, cache.block_size);
        let vocab = target.config().vocab_size;
        let executor = match (method, target) {
            (SpecMethod::Ngram, _) => None,
            (SpecMethod::Draft, TargetWeights::Host(_) | TargetWeights::Ranks(_)) => {
                let draft = draft.context("the draft model was not loaded")?;
                Some(draft_executor(draft, block_size, memory)?)
            }
            (SpecMethod::LayerSkip, TargetWeights::Host(target)) => {
                let layers = self.layer_skip_layers(&target.config);
                Some(layer_skip_executor(target, layers, block_size, memory)?)
            }
            (SpecMethod::LayerSkip, TargetWeights::Ranks(_)) => bail!(
                "the layer-skip drafter runs the target's first layers from host memory, and \
                 the ranks hold shards only: load the whole target on the host too"
            ),
            (SpecMethod::Draft, TargetWeights::Gpu(args, _)) => {
                let dir = self
                    .speculative_model
                    .as_ref()
                    .context("--speculative-method draft needs --speculative-model DIR")?;
                let draft = ModelArgs {
                    model: dir.clone(),
                    ..args.clone()
                };
                let config = draft
                    .load_host_side()
                    .with_context(|| format!("--speculative-model {}", dir.display()))?
                    .config;
                Some(gpu_draft_executor(&draft, &config, cache, memory)?)
            }
            (SpecMethod::LayerSkip, TargetWeights::Gpu(args, target)) => {
                let config = layer_skip_config(target, self.layer_skip_layers(target))?;
                Some(gpu_draft_executor(args, &config, cache, memory)?)
            }
        };
        let drafter: Box<dyn Drafter + 'm> = match executor {
            None => Box::new(NgramDrafter::new(
                self.prompt_lookup_min,
                self.prompt_lookup_max,
            )?),
            Some(executor) => {
                Box::new(ModelDrafter::new(executor, vocab)?.with_catch_up_budget(catch_up_budget))
            }
        };
        Ok(Some(Box::new(SpeculativeDecoding::new(
            drafter,
            self.config(),
        ))))
    }

    /// The layers the layer-skip drafter keeps of a model of `config`: --speculative-layers, or
    /// half of them.
    fn layer_skip_layers(&self, config: &ch01::LlamaConfig) -> usize {
        self.speculative_layers
            .unwrap_or(config.num_hidden_layers / 2)
            .max(1)
    }

    /// One line for the log.
    pub fn describe(&self) -> anyhow::Result<Option<String>> {
        Ok(self.method()?.map(|method| {
            let what = match method {
                SpecMethod::Ngram => format!(
                    "n-gram lookup (n = {}..={})",
                    self.prompt_lookup_min, self.prompt_lookup_max
                ),
                SpecMethod::Draft => format!(
                    "draft model {}",
                    self.speculative_model
                        .as_deref()
                        .map_or(String::new(), |d| d.display().to_string())
                ),
                SpecMethod::LayerSkip => match self.speculative_layers {
                    Some(l) => format!("layer skip (first {l} layers)"),
                    None => "layer skip (first half of the layers)".into(),
                },
            };
            let pause = self
                .speculative_disable_by_batch_size
                .map_or(String::new(), |n| format!(", off above {n} sequences"));
            let catch_up = self
                .speculative_catch_up_budget
                .map_or(String::new(), |n| format!(", catch-up budget {n} tokens"));
            format!(
                "speculative decoding: {what}, k = {}{pause}{catch_up}",
                self.num_speculative_tokens
            )
        }))
    }
}

/// The speculation counters of an engine run, for the log.
pub fn summary(c: &ch04::Counters) -> Option<String> {
    if c.spec_decode_num_drafts == 0 {
        return None;
    }
    let rate = c.spec_decode_num_accepted_tokens as f64 / c.spec_decode_num_draft_tokens as f64;
    let per_step = (c.spec_decode_num_accepted_tokens + c.spec_decode_num_drafts) as f64
        / c.spec_decode_num_drafts as f64;
    Some(format!(
        "speculation: {} verifications | {} draft tokens, {} accepted ({:.1}%) | {:.2} tokens per \
         verification",
        c.spec_decode_num_drafts,
        c.spec_decode_num_draft_tokens,
        c.spec_decode_num_accepted_tokens,
        rate * 100.0,
        per_step
    ))
}

#[cfg(test)]
mod tests {
    use super::{SpecMethod, SpeculativeArgs, TargetWeights};
    use crate::commands::ModelArgs;
    use ch07::cuda::DeviceSpec;

    fn args(method: SpecMethod) -> SpeculativeArgs {
        SpeculativeArgs {
            speculative_model: (method == SpecMethod::Draft)
                .then(|| ch01::fixtures_dir().join("shakespeare-tiny")),
            speculative_method: Some(method),
            num_speculative_tokens: 4,
            speculative_disable_by_batch_size: None,
            prompt_lookup_min: 1,
            prompt_lookup_max: 4,
            speculative_layers: None,
            speculative_kv_cache_memory: 1 << 20,
            speculative_catch_up_budget: None,
        }
    }

    /// The speculative flags alone, as `kiln generate` and `kiln serve` parse them.
    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        spec: SpeculativeArgs,
    }

    fn parse(flags: &[&str]) -> Result<SpeculativeArgs, String> {
        use clap::Parser;
        let words = std::iter::once("kiln").chain(flags.iter().copied());
        Flags::try_parse_from(words)
            .map(|f| f.spec)
            .map_err(|e| e.to_string())
    }

    /// --speculative-catch-up-budget: at least 1 (0 says why not), only with a method, at most
    /// the engine's --max-num-batched-tokens (a number as large as `usize` allows included),
    /// never with n-gram lookup; left out, 512 cut to the engine's step.
    #[test]
    fn the_catch_up_budget_is_at_least_1_and_at_most_an_engine_step() {
        let draft = ["--speculative-model", "draft"];
        let with = |n: &str| parse(&[&draft[..], &["--speculative-catch-up-budget", n]].concat());
        let zero = with("0").expect_err("0 is refused");
        assert!(zero.contains("0 is no budget"), "{zero}");
        let word = with("lots").expect_err("not a number");
        assert!(
            word.contains("a whole number of tokens, at least 1"),
            "{word}"
        );
        let alone = parse(&["--speculative-catch-up-budget", "8"]).err();
        let alone = alone.expect("needs a method");
        assert!(
            alone.contains("required arguments were not provided"),
            "{alone}"
        );

        assert_eq!(with("64").unwrap().catch_up_budget(512).unwrap(), 64);
        assert_eq!(with("512").unwrap().catch_up_budget(512).unwrap(), 512);
        for n in ["513", &usize::MAX.to_string()] {
            let error = with(n).unwrap().catch_up_budget(512).expect_err(n);
            assert!(
                format!("{error}").contains("more than --max-num-batched-tokens 512"),
                "{error}"
            );
        }
        let default = parse(&draft).unwrap();
        assert_eq!(default.speculative_catch_up_budget, None);
        assert_eq!(default.catch_up_budget(2048).unwrap(), 512);
        assert_eq!(default.catch_up_budget(100).unwrap(), 100);
        let layers = [
            "--speculative-method",
            "layer-skip",
            "--speculative-catch-up-budget",
            "9",
        ];
        assert_eq!(parse(&layers).unwrap().catch_up_budget(512).unwrap(), 9);
        let ngram = [
            "--speculative-method",
            "ngram",
            "--speculative-catch-up-budget",
            "9",
        ];
        let error = parse(&ngram).unwrap().catch_up_budget(512).err();
        assert!(format!("{error:?}").contains("n-gram lookup"), "{error:?}");
        // A struct built in code cannot get 0 past the engine either.
        let mut spec = args(SpecMethod::Draft);
        spec.speculative_catch_up_budget = Some(0);
        assert!(spec.catch_up_budget(512).is_err());
    }

    /// Draft verifications in one greedy request of a 40-token prompt and 8 tokens out, with
    /// `budget` as --speculative-catch-up-budget.
    fn verifications(target: &ch01::Llama, draft: &ch01::Llama, budget: Option<usize>) -> u64 {
        let mut spec = args(SpecMethod::Draft);
        spec.speculative_catch_up_budget = budget;
        let cache = ch04::CacheConfig {
            memory: 8 << 20,
            block_size: 16,
            dtype: ch03::KvDtype::F32,
        };
        let config = ch04::EngineConfig::default();
        let speculator = spec
            .speculator(TargetWeights::Host(target), Some(draft), &cache, &config)
            .unwrap()
            .expect("speculation is on");
        let executor = ch04::cpu_executor(target, &cache).unwrap();
        let mut engine = ch04::Engine::boxed(executor, config)
            .unwrap()
            .with_speculator(speculator);
        let vocab = target.config.vocab_size as u32;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % vocab).collect();
        let done = engine
            .generate(vec![ch04::Request::greedy(prompt, 8)])
            .unwrap();
        assert_eq!(done[0].tokens.len(), 8);
        engine.scheduler().counters().spec_decode_num_drafts
    }

    /// The flag reaches the draft model: with a budget of 1 token a step, a 40-token prompt
    /// is still being caught up when its 8 tokens are out, so nothing is ever drafted; with
    /// the default, or a budget that holds the prompt, every decode step drafts.
    #[test]
    fn the_catch_up_budget_reaches_the_draft_model() {
        let target = ch01::Llama::load(&ch01::default_model_dir()).unwrap();
        let draft = args(SpecMethod::Draft)
            .load_draft("f32", &target.config)
            .unwrap()
            .expect("a draft model");
        assert_eq!(verifications(&target, &draft, Some(1)), 0);
        assert!(verifications(&target, &draft, None) > 0);
        assert!(verifications(&target, &draft, Some(48)) > 0);
    }

    /// Every method builds a speculator beside a target in host memory, and all but layer skip
    /// beside tensor-parallel ranks; with the target on a GPU, n-gram lookup needs nothing
    /// more, and the two model drafters ask the GPU for an executor of their own (on a machine
    /// without one, that fails saying so).
    #[test]
    fn each_drafter_runs_where_the_target_runs() {
        let target = ch01::Llama::load(&ch01::default_model_dir()).unwrap();
        let cache = ch04::CacheConfig {
            memory: 1 << 20,
            block_size: 16,
            dtype: ch03::KvDtype::F32,
        };
        let engine = ch04::EngineConfig::default();
        for method in [SpecMethod::Ngram, SpecMethod::Draft, SpecMethod::LayerSkip] {
            let spec = args(method);
            let draft = spec.load_draft("f32", &target.config).unwrap();
            let host = spec.speculator(
                TargetWeights::Host(&target),
                draft.as_ref(),
                &cache,
                &engine,
            );
            assert!(host.unwrap().is_some(), "{method:?}");
        }
        // Beside tensor-parallel ranks, which hold shards only, the draft model runs on the
        // CPU as it does beside host weights; the layer-skip drafter needs the whole target
        // in host memory, and says so.
        let ranks = TargetWeights::Ranks(&target.config);
        for method in [SpecMethod::Ngram, SpecMethod::Draft] {
            let spec = args(method);
            let draft = spec.load_draft("f32", &target.config).unwrap();
            let built = spec.speculator(ranks, draft.as_ref(), &cache, &engine);
            assert!(built.unwrap().is_some(), "{method:?}");
        }
        assert!(args(SpecMethod::LayerSkip).needs_target_weights().unwrap());
        assert!(!args(SpecMethod::Draft).needs_target_weights().unwrap());
        let error = args(SpecMethod::LayerSkip)
            .speculator(ranks, None, &cache, &engine)
            .err()
            .expect("layer skip beside shards");
        assert!(format!("{error}").contains("from host memory"), "{error}");
        let mut on_gpu = ModelArgs::cpu(ch01::default_model_dir());
        on_gpu.device = DeviceSpec::Cuda(0);
        let gpu = TargetWeights::Gpu(&on_gpu, &target.config);
        let ngram = args(SpecMethod::Ngram).speculator(gpu, None, &cache, &engine);
        assert!(ngram.unwrap().is_some());
        if !ch07::cuda::device::driver_present() {
            for method in [SpecMethod::Draft, SpecMethod::LayerSkip] {
                let error = args(method)
                    .speculator(gpu, None, &cache, &engine)
                    .err()
                    .expect("no GPU here");
                let error = format!("{error:#}");
                assert!(
                    error.contains("the drafter's executor on the GPU")
                        && error.contains("libcuda.so"),
                    "{method:?}: {error}"
                );
            }
        }
    }
}
