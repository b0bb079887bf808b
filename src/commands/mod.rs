//! One module per subcommand, plus what they share: loading a model directory.

pub mod engine_args;
pub mod forward;
pub mod generate;
pub mod perplexity;
pub mod prompt_step;
pub mod quantize;
pub mod quantize_hf;
pub mod random_model;
pub mod serve;
pub mod speculative_args;
pub mod tensor_parallel;

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use ch01::linear::LinearLoader;
use ch01::{Llama, LlamaConfig, Tokenizer};
use ch07::cuda::DeviceSpec;

/// `--model DIR|FILE.gguf`, shared by every command that loads a model.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json), or a GGUF
    /// file (llama.cpp's format: config, weights, tokenizer and chat template in one file).
    /// Defaults to the embedded shakespeare-small.
    #[arg(long, value_name = "DIR|FILE", default_value_os_t = ch01::default_model_dir())]
    pub model: PathBuf,
    /// Storage of the dense projection weights: f32, or bf16 (half the bytes read per token;
    /// arithmetic stays f32).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub dtype: String,
    /// Quantize dense projection weights on load to one of llama.cpp's block formats (chapter
    /// 5). A K-quant falls back as llama.cpp's quantizer does (q4_k to q5_0, q5_k to q5_1, q6_k
    /// to q8_0) for layers whose input size is not a multiple of 256.
    /// A GGUF file's quantized tensors are always used as stored.
    #[arg(long, value_name = "TYPE", value_parser = ["q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "q6_k", "q5_k", "q4_k"])]
    pub quantization: Option<String>,
    /// Decode every weight of a GGUF file to dense projections (stored as `--dtype` says) and
    /// multiply in floating point: the file's exact values, without the integer kernels'
    /// rounding of the activations (chapter 5 measures what that rounding costs).
    #[arg(long)]
    pub dequantize: bool,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N (chapter 7, part 2). A GPU that is
    /// not there is an error, never a silent fall-back to the CPU.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceSpec,
    /// On a GPU, size the K/V pool as vLLM does: what the weights leave of this share (0 to 1)
    /// of the device's memory, instead of --kv-cache-memory.
    #[arg(long, value_name = "SHARE", value_parser = parse_share)]
    pub gpu_memory_utilization: Option<f64>,
}

/// A share of a device's memory: more than 0, at most 1.
fn parse_share(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(share) if share > 0.0 && share <= 1.0 => Ok(share),
        _ => Err(format!(
            "{text:?} is not a share of memory: expected more than 0 and at most 1, such as 0.9"
        )),
    }
}

/// `--device`: `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(text: &str) -> Result<DeviceSpec, String> {
    text.parse()
        .map_err(|e: ch07::cuda::CudaError| e.to_string())
}

/// A model ready to run: weights, tokenizer and the ids that end generation.
pub struct LoadedModel {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    pub eos_token_ids: Vec<u32>,
    /// Where the model came from.
    pub format: ModelFormat,
}

/// What the host needs of a model whose weights run elsewhere (a GPU): no weights.
pub struct HostSide {
    pub config: LlamaConfig,
    pub tokenizer: Tokenizer,
    pub eos_token_ids: Vec<u32>,
    pub format: ModelFormat,
}

impl LoadedModel {
    /// The weights, and the rest.
    pub fn into_parts(self) -> (Llama, HostSide) {
        let host = HostSide {
            config: self.model.config.clone(),
            tokenizer: self.tokenizer,
            eos_token_ids: self.eos_token_ids,
            format: self.format,
        };
        (self.model, host)
    }
}

/// How a model is stored on disk.
pub enum ModelFormat {
    /// A Hugging Face directory; its chat template is in its files.
    HfDir,
    /// A GGUF file, with the chat template its metadata holds.
    Gguf { chat_template: Option<String> },
}

impl ModelArgs {
    /// `--model PATH` with every other flag at its default (f32, no quantization, the CPU).
    pub fn cpu(model: PathBuf) -> ModelArgs {
        ModelArgs {
            model,
            dtype: "f32".into(),
            quantization: None,
            dequantize: false,
            device: DeviceSpec::Cpu,
            gpu_memory_utilization: None,
        }
    }

    /// Loads with the fast projections: a GGUF file's quantized tensors on chapter 5's integer
    /// kernels, dense weights on chapter 2's (stored as `--dtype` says) or quantized on load
    /// (`--quantization`).
    ///
    /// Refuses `--device cuda`: the commands that run on a GPU (generate, forward, perplexity,
    /// serve) call [`ModelArgs::load_for_device`] and build their executor with
    /// [`ModelArgs::gpu_executor`].
    pub fn load(&self) -> anyhow::Result<LoadedModel> {
        self.load_with(&*self.loader()?)
    }

    /// Refuses `--device cuda` and `--gpu-memory-utilization` on the paths that build a model
    /// on the host ([`ModelArgs::load_with`], [`ModelArgs::loader`]): every command that does
    /// not build a GPU executor runs on the CPU, and must say so rather than run there.
    pub fn check_runs_on_cpu(&self) -> anyhow::Result<()> {
        if let DeviceSpec::Cuda(_) = self.device {
            anyhow::bail!(
                "--device {}: this command runs on the CPU only so far; generate, forward, \
                 perplexity, serve and bench ch07 run on the GPU (chapter 7, part 2)",
                self.device
            );
        }
        if self.gpu_memory_utilization.is_some() {
            bail!("--gpu-memory-utilization sizes a GPU's K/V pool: it needs --device cuda");
        }
        Ok(())
    }

    /// What `--device` needs on the host: the configuration and tokenizer, and the weights
    /// (`Some`) unless a GPU runs the model, whose executor ([`ModelArgs::gpu_executor`]) reads
    /// them onto the device itself.
    pub fn load_for_device(&self) -> anyhow::Result<(HostSide, Option<Llama>)> {
        Ok(match self.device {
            DeviceSpec::Cpu => {
                let (model, host) = self.load()?.into_parts();
                (host, Some(model))
            }
            DeviceSpec::Cuda(_) => (self.load_host_side()?, None),
        })
    }

    /// The configuration and tokenizer of a Hugging Face directory or a GGUF file (with its chat
    /// template), decoding none of its weights: what the host keeps when an executor loads the
    /// weights onto a GPU.
    pub fn load_host_side(&self) -> anyhow::Result<HostSide> {
        self.check_model_path()?;
        let path = &self.model;
        let context = || format!("loading model from {}", path.display());
        if self.is_gguf() {
            let file = ch05::GgufFile::open(path).with_context(context)?;
            let host = ch05::GgufHostSide::read(&file).with_context(context)?;
            return Ok(HostSide {
                config: host.config,
                tokenizer: host.tokenizer,
                eos_token_ids: host.eos_token_ids,
                format: ModelFormat::Gguf {
                    chat_template: host.chat_template,
                },
            });
        }
        let config = LlamaConfig::from_dir(path).with_context(context)?;
        let (tokenizer, eos_token_ids) = hf_tokenizer(path, &config).with_context(context)?;
        Ok(HostSide {
            config,
            tokenizer,
            eos_token_ids,
            format: ModelFormat::HfDir,
        })
    }

    /// `--dequantize` names a GGUF file and no `--quantization`.
    fn check_dequantize(&self) -> anyhow::Result<()> {
        if !self.is_gguf() || self.quantization.is_some() {
            bail!("--dequantize applies to a GGUF file, without --quantization");
        }
        Ok(())
    }

    /// The kind of projection `--dtype` and `--quantization` ask for.
    pub fn loader(&self) -> anyhow::Result<Box<dyn LinearLoader + Send + Sync>> {
        self.check_runs_on_cpu()?;
        let dtype: ch02::WeightDtype = self.dtype.parse().map_err(anyhow::Error::msg)?;
        if self.dequantize {
            self.check_dequantize()?;
            return Ok(Box::new(ch02::FastLoader { dtype }));
        }
        if let Some(config) = self.hf_quant()? {
            // A GPTQ / AWQ directory (chapter 5 part 2): its projections as stored; dense
            // weights (the head) as `--quantization` / `--dtype` say.
            let dense = match &self.quantization {
                Some(name) => ch05::QuantLoader::to(
                    ch05::GgmlType::from_name(name)
                        .with_context(|| format!("unknown --quantization {name}"))?,
                )?,
                None => ch05::QuantLoader::native().dense(dtype),
            };
            return Ok(Box::new(ch05::HfQuantLoader { config, dense }));
        }
        // A Hugging Face FP8 checkpoint (`quant_method: "fp8"`): its projections as stored.
        if let Some(fp8) = self.fp8()? {
            if self.quantization.is_some() {
                bail!(
                    "{} is an FP8 checkpoint: --quantization does not apply",
                    self.model.display()
                );
            }
            return Ok(Box::new(ch05::Fp8Loader {
                static_activations: fp8.static_activations,
            }));
        }
        Ok(match &self.quantization {
            Some(name) => {
                let ty = ch05::GgmlType::from_name(name)
                    .with_context(|| format!("unknown --quantization {name}"))?;
                Box::new(ch05::QuantLoader::to(ty)?)
            }
            None if self.is_gguf() => Box::new(ch05::QuantLoader::native().dense(dtype)),
            None => Box::new(ch02::FastLoader { dtype }),
        })
    }

    /// The executor of `--device cuda:N`: the weights read from `--model` straight to the GPU
    /// (stored as `--dtype` says), K/V memory as `cache` says, or as `--gpu-memory-utilization`
    /// does when given.
    pub fn gpu_executor(
        &self,
        config: &ch01::LlamaConfig,
        cache: &ch04::CacheConfig,
    ) -> anyhow::Result<Box<dyn ch04::Executor + Send>> {
        use ch07::cuda::{CudaExecutor, GpuDevice};
        let DeviceSpec::Cuda(ordinal) = self.device else {
            anyhow::bail!("gpu_executor needs --device cuda");
        };
        if self.quantization.is_some() || self.hf_quant()?.is_some() || self.fp8()?.is_some() {
            anyhow::bail!(
                "--device {}: the GPU path runs f32 or bf16 weights so far (no --quantization, \
                 no GPTQ, AWQ or FP8 directory; a GGUF file's blocks are decoded to --dtype as \
                 they load)",
                self.device
            );
        }
        if self.dequantize {
            self.check_dequantize()?;
        }
        let dtype: ch02::WeightDtype = self.dtype.parse().map_err(anyhow::Error::msg)?;
        let device =
            GpuDevice::open(ordinal).with_context(|| format!("--device {}", self.device))?;
        eprintln!(
            "kiln: {} ({}, kernels for {})",
            self.device,
            device.name,
            device.arch.name()
        );
        // A GGUF file's tensors decode to f32 as the executor reads them (`GgufSource`: Hugging
        // Face names, q/k rows in Hugging Face's order) and go to the device as --dtype says.
        let weights: Box<dyn ch01::WeightSource> = if self.is_gguf() {
            Box::new(ch05::GgufSource::open(&self.model)?)
        } else {
            Box::new(ch01::Weights::open(&self.model)?)
        };
        let kv = match self.gpu_memory_utilization {
            Some(share) => ch07::cuda::KvBudget::DeviceShare(share),
            None => ch07::cuda::KvBudget::Bytes(cache.memory),
        };
        fn boxed<K: ch07::cuda::executor::DeviceKv>(
            device: GpuDevice,
            config: &ch01::LlamaConfig,
            weights: &dyn ch01::WeightSource,
            dtype: ch02::WeightDtype,
            cache: &ch04::CacheConfig,
            kv: ch07::cuda::KvBudget,
        ) -> anyhow::Result<Box<dyn ch04::Executor + Send>> {
            let executor = CudaExecutor::<K>::new(
                device,
                config.clone(),
                weights,
                dtype,
                cache.block_size,
                kv,
            )?;
            let (weights, kv) = executor.device_bytes();
            let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
            eprintln!(
                "kiln: on the GPU: weights {:.2} GiB ({dtype:?}), K/V {:.2} GiB ({} blocks); \
                 attention: {}",
                gib(weights),
                gib(kv),
                ch04::Executor::kv_layout(&executor).num_blocks,
                executor.attention_kernels()
            );
            Ok(Box::new(executor))
        }
        match cache.dtype {
            ch03::KvDtype::F32 => boxed::<f32>(device, config, &*weights, dtype, cache, kv),
            ch03::KvDtype::Bf16 => boxed::<half::bf16>(device, config, &*weights, dtype, cache, kv),
            dtype => anyhow::bail!(
                "--device {}: a {dtype} KV cache does not run on the GPU yet",
                self.device
            ),
        }
    }

    /// The `quantization_config` of a GPTQ or AWQ directory (`None`: not one; an FP8
    /// directory is [`fp8`](Self::fp8)'s).
    pub fn hf_quant(&self) -> anyhow::Result<Option<ch05::HfQuantConfig>> {
        let path = self.model.join("config.json");
        if self.is_gguf() || !path.exists() || self.fp8()?.is_some() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        ch05::HfQuantConfig::from_config_json(&json)
            .with_context(|| format!("in {}", path.display()))
    }

    /// The `quantization_config` of a Hugging Face FP8 directory (`None`: not one).
    pub fn fp8(&self) -> anyhow::Result<Option<ch05::fp8_linear::Fp8Config>> {
        if self.is_gguf() || !self.model.join("config.json").exists() {
            return Ok(None);
        }
        Ok(ch05::fp8_config(&self.model)?)
    }

    /// Whether `--model` names a GGUF file rather than a directory.
    pub fn is_gguf(&self) -> bool {
        self.model.is_file()
    }

    /// `--model` is there, and is a regular file (GGUF) or a directory (Hugging Face): anything
    /// else would be read as a directory, and the error would name a `config.json` inside it.
    fn check_model_path(&self) -> anyhow::Result<()> {
        let path = &self.model;
        match std::fs::metadata(path) {
            Ok(meta) if meta.is_file() || meta.is_dir() => Ok(()),
            Ok(_) => bail!(
                "model {} is neither a regular file (a GGUF model) nor a directory (a Hugging \
                 Face model)",
                path.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("model {} does not exist", path.display())
            }
            Err(e) => bail!("model {}: {e}", path.display()),
        }
    }

    /// The model's name for tables and the API: the directory's name, or the file's without
    /// its extension.
    pub fn name(&self) -> String {
        let name = if self.is_gguf() {
            self.model.file_stem()
        } else {
            self.model.file_name()
        };
        name.map_or_else(|| "kiln".into(), |n| n.to_string_lossy().into_owned())
    }

    /// Loads with the given kind of projection (chapter 1's benchmark measures `DenseLoader`).
    pub fn load_with(&self, loader: &dyn LinearLoader) -> anyhow::Result<LoadedModel> {
        self.check_runs_on_cpu()?;
        self.check_model_path()?;
        let path = &self.model;
        let context = || format!("loading model from {}", path.display());
        if self.is_gguf() {
            let gguf = ch05::load_gguf(path, loader).with_context(context)?;
            return Ok(LoadedModel {
                model: gguf.model,
                tokenizer: gguf.tokenizer,
                eos_token_ids: gguf.eos_token_ids,
                format: ModelFormat::Gguf {
                    chat_template: gguf.chat_template,
                },
            });
        }
        let model = Llama::load_with(path, loader).with_context(context)?;
        let (tokenizer, eos_token_ids) = hf_tokenizer(path, &model.config).with_context(context)?;
        Ok(LoadedModel {
            model,
            tokenizer,
            eos_token_ids,
            format: ModelFormat::HfDir,
        })
    }
}

/// A Hugging Face directory's tokenizer, and the ids that end generation: the config's and
/// generation config's, and the tokenizer's own EOS. Every one of them, and the tokenizer's BOS,
/// is below the model's `vocab_size` (`config.json` and `generation_config.json` are checked as
/// they are read): an id the model has no row for is refused, naming the file.
fn hf_tokenizer(
    path: &std::path::Path,
    config: &LlamaConfig,
) -> anyhow::Result<(Tokenizer, Vec<u32>)> {
    let tokenizer = Tokenizer::from_dir(path)?;
    for (key, id) in [
        ("bos_token", tokenizer.bos_token_id()),
        ("eos_token", tokenizer.eos_token_id()),
    ] {
        if let Some(id) = id {
            ch01::config::check_token_id(key, id, config.vocab_size).map_err(|message| {
                anyhow::anyhow!(
                    "invalid tokenizer {}: {message}",
                    path.join("tokenizer_config.json").display()
                )
            })?;
        }
    }
    let mut eos_token_ids = ch01::eos_token_ids(path, config)?;
    if let Some(eos) = tokenizer.eos_token_id()
        && !eos_token_ids.contains(&eos)
    {
        eos_token_ids.push(eos);
    }
    Ok((tokenizer, eos_token_ids))
}

/// Bytes of memory available to a new allocation (Linux's `MemAvailable`); `None` elsewhere.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Parses a memory size: a number of bytes, or a number with a unit: KB, MB, GB (powers of
/// 1000) or KiB, MiB, GiB (powers of 1024), e.g. `512MiB`, `1.5GB`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 512MiB, 2GB or 1000000"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "unknown size unit {other:?}: use KB, MB, GB, KiB, MiB or GiB"
            ));
        }
    };
    let bytes = number * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("{text:?} is not a usable size"));
    }
    Ok(bytes as u64)
}

/// `--out` must be missing or an empty directory: a command that writes a model directory
/// (`random-model`, `quantize --method`) never overwrites anything.
pub fn refuse_non_empty(out: &std::path::Path) -> anyhow::Result<()> {
    if !out.exists() {
        return Ok(());
    }
    if !out.is_dir() {
        bail!("--out {} exists and is not a directory", out.display());
    }
    let mut entries =
        std::fs::read_dir(out).with_context(|| format!("reading {}", out.display()))?;
    if entries.next().is_some() {
        bail!(
            "--out {} is not empty: give a new or empty directory",
            out.display()
        );
    }
    Ok(())
}

/// The most bytes a text file given on the command line may hold (prompts, a text to score, a
/// calibration text): 256 MiB, far more than any of them needs, so that `/dev/zero` or a
/// runaway pipe is an error instead of all the memory there is.
pub const MAX_TEXT_FILE_BYTES: u64 = 256 << 20;

/// The UTF-8 text of `path` (a file, or a pipe such as `<(command)`), read up to
/// [`MAX_TEXT_FILE_BYTES`]: a longer one is an error that says so.
pub fn read_text_file(path: &Path) -> anyhow::Result<String> {
    read_text_up_to(path, MAX_TEXT_FILE_BYTES)
}

/// [`read_text_file`] with a limit of `most` bytes.
fn read_text_up_to(path: &Path, most: u64) -> anyhow::Result<String> {
    Ok(ch01::text_file::read_text_up_to(path, most)?)
}

#[cfg(test)]
mod tests {
    use super::{ModelArgs, ModelFormat, parse_bytes, read_text_up_to};
    use std::path::Path;

    /// What a GPU's host keeps (`load_host_side`, no weight decoded) is what loading the whole
    /// model gives, for a Hugging Face directory and for the GGUF file written from it.
    #[test]
    fn the_host_side_alone_equals_the_loaded_models() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = ch01::fixtures_dir().join("shakespeare-small");
        let gguf = tmp.path().join("small.gguf");
        let converted = ch05::gguf::convert_hf_dir(&dir, ch05::GgmlType::Q8_0).unwrap();
        converted.writer.write(&gguf).unwrap();
        let text = "HAMLET. To be, or not to be: that is the question.";
        for path in [dir, gguf] {
            let args = ModelArgs::cpu(path.clone());
            let alone = args.load_host_side().unwrap();
            let (_, loaded) = args.load().unwrap().into_parts();
            assert_eq!(alone.config, loaded.config, "{}", path.display());
            assert_eq!(alone.eos_token_ids, loaded.eos_token_ids);
            assert_eq!(
                alone.tokenizer.encode(text, true).unwrap(),
                loaded.tokenizer.encode(text, true).unwrap()
            );
            match (&alone.format, &loaded.format, args.is_gguf()) {
                (ModelFormat::HfDir, ModelFormat::HfDir, false) => {}
                (
                    ModelFormat::Gguf { chat_template: a },
                    ModelFormat::Gguf { chat_template: b },
                    true,
                ) => assert_eq!(a, b),
                _ => panic!("{}: the formats differ", path.display()),
            }
        }
    }

    #[test]
    fn sizes_parse_with_and_without_units() {
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes(" 64 kib "), Ok(64 * 1024));
        for bad in ["", "MiB", "12XB", "-3MiB", "0", "1e400GB", "nan"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    /// A file of at most the limit is read whole; one byte more, or an endless device, is an
    /// error after reading no more than the limit and one byte.
    #[test]
    fn a_text_file_is_read_up_to_its_limit() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), "héllo\nworld\n").unwrap();
        let len = std::fs::metadata(file.path()).unwrap().len();
        assert_eq!(read_text_up_to(file.path(), len).unwrap(), "héllo\nworld\n");
        let err = read_text_up_to(file.path(), len - 1).unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
        let err = read_text_up_to(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(err.to_string().contains("more than 1048576 bytes"), "{err}");
        std::fs::write(file.path(), [0xff, 0xfe]).unwrap();
        let err = read_text_up_to(file.path(), 10).unwrap_err();
        assert!(err.to_string().contains("not UTF-8"), "{err}");
    }
}
