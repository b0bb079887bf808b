//! The whole model on the GPU against the CPU, step by step inside chapter 4's engine, for every
//! fixture model and a random one with head size 64: every step the scheduler plans (chunked
//! prefills, decodes, copy-on-write, swaps under memory pressure) runs on both executors, and
//! the GPU's logit rows must equal the CPU's within 1e-4 (or, on every other greedy step, the
//! GPU's argmax ids the CPU rows' argmaxes); the engine samples greedily from the CPU's, so both
//! see the same steps. Then bf16 weights and K/V against the f32 CPU model.
//!
//! Needs a GPU: without a CUDA driver the test prints that it skipped, unless
//! `KILN_REQUIRE_GPU=1` (set by `just gpu-check`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ch01::{LlamaConfig, Weights};
use ch03::KvPool;
use ch04::CpuExecutor;
use ch04::engine::{Engine, EngineConfig, Preemption};
use ch04::executor::{Executor, ExecutorError, KvLayout, ModelSpec, argmax_rows};
use ch04::request::Request;
use ch04::scheduler::SchedulerOutput;
use ch07_flash_attention::cuda::device::driver_present;
use ch07_flash_attention::cuda::{CudaExecutor, GpuDevice};
use ndarray::{Array2, ArrayView2};

/// The random-weight fixtures, each exercising one loader feature (fixtures/README.md).
const RANDOM_FIXTURES: [&str; 8] = [
    "random/bf16",
    "random/gqa",
    "random/head-dim",
    "random/llama3-rope",
    "random/mha",
    "random/qwen2",
    "random/sharded",
    "random/untied",
];

/// A fixture model (`$KILN_FIXTURES` when set: a binary built here runs on a GPU box).
fn fixture(name: &str) -> PathBuf {
    ch01::fixtures_dir().join(name)
}

/// Whether a CUDA driver is there; without one the test says it skipped, unless
/// `KILN_REQUIRE_GPU` is set, which makes that a failure.
fn gpu_present() -> bool {
    if !driver_present() {
        assert!(
            std::env::var_os("KILN_REQUIRE_GPU").is_none(),
            "KILN_REQUIRE_GPU is set but no CUDA driver can be loaded"
        );
        eprintln!("skipped: no CUDA driver on this machine");
        return false;
    }
    true
}

/// Runs each step on both executors and keeps the largest difference of their logits.
struct Twin<'m> {
    cpu: CpuExecutor<'m, f32>,
    gpu: CudaExecutor<f32>,
    worst: f32,
    steps: usize,
    /// Steps that took the GPU's argmax path (`execute_argmax`).
    argmax_steps: Arc<AtomicUsize>,
}

impl Executor for Twin<'_> {
    fn kv_layout(&self) -> KvLayout {
        assert_eq!(self.cpu.kv_layout(), self.gpu.kv_layout());
        self.cpu.kv_layout()
    }

    fn model_spec(&self) -> ModelSpec {
        self.cpu.model_spec()
    }

    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        let gpu: Array2<f32> = self.gpu.execute(step)?.to_owned();
        let cpu = self.cpu.execute(step)?;
        assert_eq!(gpu.dim(), cpu.dim(), "logit rows of step {}", self.steps);
        for ((r, c), g) in gpu.indexed_iter() {
            let diff = (g - cpu[[r, c]]).abs() / cpu[[r, c]].abs().max(1.0);
            assert!(
                diff <= 1e-4,
                "step {}: logit [{r}, {c}] GPU {g}, CPU {}",
                self.steps,
                cpu[[r, c]]
            );
            self.worst = self.worst.max(diff);
        }
        self.steps += 1;
        Ok(cpu)
    }

    /// Every other step the engine samples greedily takes the GPU's argmax path (ids copied
    /// back, not rows): its ids must be the CPU rows' argmaxes, except where the CPU's logit at
    /// the GPU's id is within 1e-4 of the row's maximum (a near tie either may break). The
    /// other steps compare whole rows through `execute`. The engine goes on with the CPU's.
    fn execute_argmax(
        &mut self,
        step: &SchedulerOutput,
    ) -> Result<Vec<Option<u32>>, ExecutorError> {
        if self.steps.is_multiple_of(2) {
            return Ok(argmax_rows(self.execute(step)?));
        }
        let at_step = self.steps;
        let gpu = self.gpu.execute_argmax(step)?;
        let cpu = self.cpu.execute(step)?;
        let want = argmax_rows(cpu.view());
        assert_eq!(gpu.len(), want.len(), "argmax rows of step {at_step}");
        for (r, (g, w)) in gpu.iter().zip(&want).enumerate() {
            if g != w {
                let row = cpu.row(r);
                let max = row[w.expect("a finite row") as usize];
                let near =
                    g.is_some_and(|g| (max - row[g as usize]).abs() <= 1e-4 * max.abs().max(1.0));
                assert!(near, "step {at_step}, row {r}: GPU argmax {g:?}, CPU {w:?}");
            }
        }
        self.argmax_steps.fetch_add(1, Ordering::Relaxed);
        self.steps += 1;
        Ok(want)
    }
}

#[test]
fn the_engine_on_the_gpu_equals_the_cpu_step_by_step() {
    if !gpu_present() {
        return;
    }
    // Every fixture model (biases, llama3 RoPE scaling, head sizes 8 to 32, MHA and GQA, tied and
    // untied heads, bf16 and sharded files), and a random one with head size 64.
    let d64 = std::env::temp_dir().join(format!("kiln-gpu-twin-d64-{}", std::process::id()));
    let spec = ch01::random_model::RandomModelSpec::tiny_d64();
    ch01::random_model::write_random_model(&spec, &d64).unwrap();
    let mut dirs: Vec<PathBuf> = ["shakespeare-tiny", "shakespeare-small"]
        .iter()
        .chain(&RANDOM_FIXTURES)
        .map(|name| fixture(name))
        .collect();
    dirs.push(d64.clone());
    for dir in dirs {
        let name = dir.display();
        let model = ch01::Llama::load(&dir).unwrap();
        let config = LlamaConfig::from_dir(&dir).unwrap();
        let weights = Weights::open(&dir).unwrap();
        let block_size = 16;
        // Few blocks: prompts and generations of 8 requests do not all fit, so the scheduler
        // preempts (by swapping) and the executors move blocks.
        let num_blocks = 12;
        let pool = KvPool::<f32>::new(&model.config, block_size, num_blocks).unwrap();
        let memory = num_blocks as u64 * KvPool::<f32>::bytes_per_block(&model.config, block_size);
        let gpu = CudaExecutor::<f32>::new(
            GpuDevice::open(0).unwrap(),
            config,
            &weights,
            ch02::WeightDtype::F32,
            block_size,
            ch07_flash_attention::cuda::KvBudget::Bytes(memory),
        )
        .unwrap();
        let argmax_steps = Arc::new(AtomicUsize::new(0));
        let twin = Twin {
            cpu: CpuExecutor::new(&model, pool),
            gpu,
            worst: 0.0,
            steps: 0,
            argmax_steps: argmax_steps.clone(),
        };
        let engine_config = EngineConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 48,
            enable_chunked_prefill: true,
            watermark: 0.0,
            preemption: Preemption::Swap,
            enable_prefix_caching: true,
        };
        let mut engine = Engine::new(twin, engine_config).unwrap();
        let vocab = model.config.vocab_size as u32;
        for i in 0..8u32 {
            let prompt: Vec<u32> = (0..(5 + 7 * i))
                .map(|t| (t * 31 + i * 17) % vocab)
                .collect();
            engine.add_request(Request::greedy(prompt, 24)).unwrap();
        }
        while engine.has_unfinished() {
            engine.step().unwrap();
        }
        let argmax_steps = argmax_steps.load(Ordering::Relaxed);
        assert!(argmax_steps > 0, "{name}: no step took the argmax path");
        println!("{name}: GPU equals CPU on every step ({argmax_steps} by their argmax ids)");
    }
    std::fs::remove_dir_all(&d64).unwrap();
}

/// Relative L2 distance `‖a − b‖ / ‖b‖` of two logit rows.
fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// bf16 weights (cuBLAS GemmEx, bf16 × bf16 → f32) and a bf16 KV cache on the GPU, against
/// chapter 1's f32 forward on the CPU: a 90-token prefill, then 6 decode steps, every logit row
/// within 1e-2 relative L2. The random head-size-64 model (written by `ch01::random_model`) puts
/// the prefill on the tensor-core kernel (`prefill_on_tensor_cores`) inside the executor; the
/// Shakespeare model (head size 32) on the CUDA-core kernel.
#[test]
fn bf16_weights_and_kv_on_the_gpu_stay_within_1e_2_of_the_cpu() {
    if !gpu_present() {
        return;
    }
    let random = std::env::temp_dir().join(format!("kiln-gpu-d64-{}", std::process::id()));
    ch01::random_model::write_random_model(
        &ch01::random_model::RandomModelSpec::tiny_d64(),
        &random,
    )
    .unwrap();
    for dir in [fixture("shakespeare-small"), random.clone()] {
        let model = ch01::Llama::load(&dir).unwrap();
        let config = LlamaConfig::from_dir(&dir).unwrap();
        let weights = Weights::open(&dir).unwrap();
        let vocab = config.vocab_size as u32;
        let tokens: Vec<u32> = (0..96u32).map(|t| (t * 131 + 7) % vocab).collect();
        let want = model.forward(&tokens).unwrap(); // [96, vocab]
        let block_size = 16;
        let mut gpu = CudaExecutor::<half::bf16>::new(
            GpuDevice::open(0).unwrap(),
            config.clone(),
            &weights,
            ch02::WeightDtype::Bf16,
            block_size,
            ch07_flash_attention::cuda::KvBudget::Bytes(kv_bytes(&config, block_size, 2)),
        )
        .unwrap();
        let mut worst = 0.0f64;
        prefill_then_decode(&mut gpu, &tokens, 90, |got, first_row| {
            for (i, row) in got.rows().into_iter().enumerate() {
                let expected = want.row(first_row + i);
                let d = relative_l2(row.as_slice().unwrap(), expected.as_slice().unwrap());
                assert!(
                    d <= 1e-2,
                    "{}: row {}: relative L2 {d}",
                    dir.display(),
                    first_row + i
                );
                worst = worst.max(d);
            }
        });
        println!(
            "{}: bf16 on the GPU within {worst:.2e} relative L2 of the CPU",
            dir.display()
        );
    }
    std::fs::remove_dir_all(&random).unwrap();
}

/// Bytes of 8 KV blocks of `block_size` positions for `config`, K/V elements of `elem_bytes`:
/// room for one sequence of up to 128 tokens.
fn kv_bytes(config: &LlamaConfig, block_size: usize, elem_bytes: usize) -> u64 {
    let per_layer = block_size * config.num_key_value_heads * config.head_dim;
    (8 * 2 * config.num_hidden_layers * per_layer * elem_bytes) as u64
}

/// Runs `tokens` (at most 128) through `gpu` as one sequence: a prefill of the first `prefill`,
/// then a decode step a token, every row's logits asked for; hands each step's rows to `check`
/// with the position of its first row.
fn prefill_then_decode(
    gpu: &mut dyn Executor,
    tokens: &[u32],
    prefill: usize,
    mut check: impl FnMut(ArrayView2<f32>, usize),
) {
    let table: Vec<u32> = (0..8).collect();
    let step = |start: usize, end: usize| SchedulerOutput {
        seqs: vec![ch04::ScheduledSeq {
            id: 0,
            tokens: tokens[start..end].to_vec(),
            start_pos: start,
            block_table: table.clone(),
            logit_rows: end - start,
        }],
        ..SchedulerOutput::default()
    };
    check(gpu.execute(&step(0, prefill)).unwrap(), 0);
    for p in prefill..tokens.len() {
        check(gpu.execute(&step(p, p + 1)).unwrap(), p);
    }
}

/// A GGUF file on the GPU: its Q8_0 blocks decoded to f32 as the executor reads them
/// (`GgufSource`, which also puts q and k rows back in Hugging Face's order), so the logits of
/// a prefill and of decode steps equal, within 1e-4, chapter 1's forward over the same decoded
/// weights (`load_gguf` with `DenseLoader`).
#[test]
fn a_gguf_file_on_the_gpu_equals_its_decoded_weights_on_the_cpu() {
    if !gpu_present() {
        return;
    }
    let path = std::env::temp_dir().join(format!("kiln-gpu-gguf-{}.gguf", std::process::id()));
    let converted =
        ch05::gguf::convert_hf_dir(&fixture("random/gqa"), ch05::GgmlType::Q8_0).unwrap();
    converted.writer.write(&path).unwrap();
    let cpu = ch05::load_gguf(&path, &ch01::linear::DenseLoader).unwrap();
    let config = cpu.model.config.clone();
    let vocab = config.vocab_size as u32;
    let tokens: Vec<u32> = (0..40u32).map(|t| (t * 97 + 5) % vocab).collect();
    let want = cpu.model.forward(&tokens).unwrap(); // [40, vocab]
    let source = ch05::GgufSource::open(&path).unwrap();
    let block_size = 16;
    let mut gpu = CudaExecutor::<f32>::new(
        GpuDevice::open(0).unwrap(),
        config.clone(),
        &source,
        ch02::WeightDtype::F32,
        block_size,
        ch07_flash_attention::cuda::KvBudget::Bytes(kv_bytes(&config, block_size, 4)),
    )
    .unwrap();
    let mut worst = 0.0f32;
    prefill_then_decode(&mut gpu, &tokens, 33, |got, first_row| {
        for ((r, c), g) in got.indexed_iter() {
            let expected = want[[first_row + r, c]];
            let diff = (g - expected).abs() / expected.abs().max(1.0);
            assert!(
                diff <= 1e-4,
                "logit [{}, {c}]: GPU {g}, CPU {expected}",
                first_row + r
            );
            worst = worst.max(diff);
        }
    });
    println!("a Q8_0 GGUF file on the GPU within {worst:.2e} of its decoded weights on the CPU");
    std::fs::remove_file(&path).unwrap();
}
