//! The `kiln` binary end to end: its commands agree with the golden outputs and fail cleanly.

use std::process::{Command, Output};

use ch01::fixtures_dir;
use safetensors::SafeTensors;

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn forward_writes_the_golden_logits() {
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures_dir().join("golden/random-qwen2.json")).unwrap(),
    )
    .unwrap();
    let prompt = golden["cases"][0]["prompt"].as_str().unwrap();
    let out = tempfile::NamedTempFile::new().unwrap();
    let model = fixtures_dir().join("random/qwen2");
    let output = kiln(&[
        "forward",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--out",
        out.path().to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));

    let written = std::fs::read(out.path()).unwrap();
    let written = SafeTensors::deserialize(&written).unwrap();
    let expected = std::fs::read(fixtures_dir().join("golden/random-qwen2.safetensors")).unwrap();
    let expected = SafeTensors::deserialize(&expected).unwrap();
    let (logits, reference) = (
        written.tensor("logits").unwrap(),
        expected.tensor("logits.0").unwrap(),
    );
    assert_eq!(logits.shape(), reference.shape());
    let floats = |b: &[u8]| {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect::<Vec<f32>>()
    };
    ch01::testing::assert_rel_close(
        "kiln forward logits",
        &floats(logits.data()),
        &floats(reference.data()),
        1e-4,
    );
}

#[test]
fn generate_streams_text_and_reports_speed() {
    let model = fixtures_dir().join("random/gqa");
    let args = &[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "ROMEO.",
        "--max-tokens",
        "12",
        "--seed",
        "3",
        "--ignore-eos",
    ];
    let output = kiln(args);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("ROMEO."));
    let err = stderr(&output);
    assert!(
        err.contains("prompt eval:") && err.contains("tokens/s"),
        "{err}"
    );
    assert!(err.contains("generation:  12 tokens"), "{err}");

    let again = kiln(args);
    assert_eq!(output.stdout, again.stdout, "same seed, same text");
}

/// One prompt runs on chapter 3's f32 cache: `--dtype bf16` weights with the default
/// `--kv-cache-dtype auto` keep it (auto means f32 there), while asking for a bf16 cache on that
/// path is refused with the way to get one.
/// `kiln generate` of four tokens after "ROMEO." from `model`, with `extra` flags.
fn four_tokens<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--prompt",
        "ROMEO.",
        "--max-tokens",
        "4",
    ];
    args.extend_from_slice(extra);
    args
}

#[test]
fn one_prompt_with_bf16_weights_uses_the_f32_cache() {
    let model = fixtures_dir().join("random/gqa");
    let model = model.to_str().unwrap();
    let base = four_tokens(model, &["--dtype", "bf16"]);
    let output = kiln(&base);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("MiB of f32"),
        "{}",
        stderr(&output)
    );

    let mut args = base;
    args.extend(["--kv-cache-dtype", "bf16"]);
    assert_fails_with(&args, "--prompts-file");
}

/// Runs kiln with `args`; it must fail, say `needle` on stderr, and not panic.
#[track_caller]
fn assert_fails_with(args: &[&str], needle: &str) {
    let output = kiln(args);
    let err = stderr(&output);
    assert!(!output.status.success(), "kiln {args:?} should fail");
    assert!(err.contains(needle), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_inputs_exit_nonzero_with_a_clear_message() {
    // A `--model` that is not there, or is neither a file (GGUF) nor a directory (Hugging
    // Face), is named as such: it used to be read as a directory, and the error was about
    // `/nonexistent/model.gguf/config.json`.
    assert_fails_with(
        &[
            "generate",
            "--model",
            "/nonexistent/model.gguf",
            "--prompt",
            "x",
        ],
        "model /nonexistent/model.gguf does not exist",
    );
    assert_fails_with(
        &["generate", "--model", "/dev/null", "--prompt", "x"],
        "model /dev/null is neither a regular file (a GGUF model) nor a directory (a Hugging \
         Face model)",
    );
    // Zero ranks is no way to run a model (it used to run one, silently).
    assert_fails_with(
        &["generate", "--prompt", "x", "--tensor-parallel-size", "0"],
        "invalid value '0' for '--tensor-parallel-size <N>'",
    );

    let model = fixtures_dir().join("random/gqa");
    let model = model.to_str().unwrap();
    assert_fails_with(
        &[
            "generate", "--model", model, "--prompt", "x", "--top-p", "1.5",
        ],
        "top_p",
    );
    let too_long = "word ".repeat(2000);
    assert_fails_with(
        &["generate", "--model", model, "--prompt", &too_long],
        "more than the model's context of 512 positions",
    );
    // The refusals of flags that would change nothing, or run forever.
    let prompt = ["generate", "--model", model, "--prompt", "x"];
    for (extra, needle) in [
        (
            &["--recompute", "--speculative-method", "ngram"][..],
            "cannot be used with",
        ),
        (
            &["--contiguous", "--block-size", "0"][..],
            "cannot be used with",
        ),
        (&["--num-speculative-tokens", "2"][..], "--speculative-"),
        (
            &[
                "--speculative-method",
                "layer-skip",
                "--speculative-layers",
                "0",
            ][..],
            "at least 1",
        ),
        (
            &[
                "--speculative-method",
                "layer-skip",
                "--speculative-catch-up-budget",
                "0",
            ][..],
            "0 is no budget",
        ),
        // More than one engine step may run: the draft model's catch-up stays within it.
        (
            &[
                "--speculative-method",
                "layer-skip",
                "--speculative-catch-up-budget",
                "18446744073709551615",
            ][..],
            "is more than --max-num-batched-tokens 512",
        ),
    ] {
        assert_fails_with(&[&prompt[..], extra].concat(), needle);
    }
    assert_fails_with(&["-t", "100000", "generate", "--prompt", "x"], "at most");
    let hamlet_path = fixtures_dir().join("corpus/hamlet.txt");
    let hamlet_str = hamlet_path.to_str().unwrap();
    assert_fails_with(
        &[
            "perplexity",
            "--model",
            model,
            "--file",
            hamlet_str,
            "--chunks",
            "0",
        ],
        "--chunks must be at least 1",
    );
    assert_fails_with(
        &["perplexity", "--model", model, "--file", "/nonexistent.txt"],
        "/nonexistent.txt",
    );
    let hamlet = fixtures_dir().join("corpus/hamlet.txt");
    assert_fails_with(
        &[
            "perplexity",
            "--model",
            model,
            "--file",
            hamlet.to_str().unwrap(),
            "--ctx",
            "1152921504606846976",
            "--kv-cache-dtype",
            "bf16",
        ],
        "is longer than the model's context of 512 positions",
    );
    // A deadline past the clock's range would panic in the connection tasks.
    assert_fails_with(
        &[
            "serve",
            "--model",
            model,
            "--port",
            "0",
            "--shutdown-grace",
            "1e20",
        ],
        "must be a number of seconds from 0 to 86400",
    );
    for (kv_args, needle) in [
        (&["--kv-cache-memory", "12XB"][..], "unknown size unit"),
        (&["--kv-cache-memory", "1KiB"], "holds no block"),
        (
            &["--kv-cache-memory", "64KiB", "--max-tokens", "500"],
            "raise --kv-cache-memory",
        ),
        // More than the address space, or than block ids can name: an error, not an abort.
        (&["--kv-cache-memory", "1000000GiB"], "KV"),
        // A block size whose bytes would wrap around u64.
        (
            &["--block-size", "2305843009213693952"],
            "--block-size must be from 1 to 4096",
        ),
    ] {
        let mut args = vec!["generate", "--model", model, "--prompt", "x"];
        args.extend_from_slice(kv_args);
        assert_fails_with(&args, needle);
    }
}

/// `kiln generate --prompt LINE` with `args`: the completion, without the echoed prompt.
fn single_completion(line: &str, args: &[&str]) -> String {
    let output = kiln(&[&["generate", "--prompt", line], args].concat());
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let text = stdout
        .strip_prefix(line)
        .expect("the prompt is echoed first");
    text.strip_suffix('\n')
        .expect("a final newline")
        .to_string()
}

/// The number after `label: ` on stderr, e.g. `preemptions` in "| preemptions: 2 |".
fn count_after(err: &str, label: &str) -> u64 {
    err.split(&format!("{label}: "))
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {label} count in {err}"))
}

/// `--prompts-file` runs every line at once through chapter 4's engine. Greedy, each completion
/// is the single-prompt one, whatever the scheduler does: chunked prefill under a small token
/// budget, preemption (recompute or swap) in a small cache, whole prompts, the prefix cache.
#[test]
fn prompts_file_completions_equal_single_prompt_generate() {
    let model = fixtures_dir().join("random/gqa");
    let model = model.to_str().unwrap();
    let lines = [
        "ROMEO.",
        "To be, or not to be, that is the question:",
        "JULIET. O Romeo, Romeo! wherefore art thou Romeo?",
    ];
    let file = tempfile::NamedTempFile::new().unwrap();
    // Empty and blank lines are skipped.
    let text = format!("{}\n\n{}\n   \n{}\n", lines[0], lines[1], lines[2]);
    std::fs::write(file.path(), text).unwrap();
    let file = file.path().to_str().unwrap();

    let common = ["--model", model, "--temperature", "0", "--max-tokens", "16"];
    let expected: String = lines
        .iter()
        .enumerate()
        .map(|(i, line)| format!("=== [{i}] {line}\n{}\n", single_completion(line, &common)))
        .collect();
    // 16KiB = 4 blocks of 16 positions on this model (256 bytes per token): too few for all three.
    let small = [
        "--kv-cache-memory",
        "16KiB",
        "--max-num-batched-tokens",
        "8",
    ];
    let runs: [(&[&str], bool); 5] = [
        (&[], false),
        (&small, true),
        (&[&small[..], &["--preemption-mode", "swap"]].concat(), true),
        (
            &["--no-enable-chunked-prefill", "--max-num-seqs", "2"],
            false,
        ),
        (&[&small[..], &["--enable-prefix-caching"]].concat(), true),
    ];
    for (engine_args, preempts) in runs {
        let args = [
            &["generate", "--prompts-file", file],
            &common[..],
            engine_args,
        ]
        .concat();
        let output = kiln(&args);
        let err = stderr(&output);
        assert!(output.status.success(), "{engine_args:?}: {err}");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            expected,
            "{engine_args:?}"
        );
        assert_eq!(count_after(&err, "requests"), 3, "{err}");
        assert_eq!(
            count_after(&err, "preemptions") > 0,
            preempts,
            "{engine_args:?}: {err}"
        );
    }

    // Stop strings end a request early (the engine aborts it), as they end a single generation.
    let stops = [&common[..], &["--stop", "BAPT", "--stop", "MIAN"]].concat();
    let expected: String = lines
        .iter()
        .enumerate()
        .map(|(i, line)| format!("=== [{i}] {line}\n{}\n", single_completion(line, &stops)))
        .collect();
    let output = kiln(
        &[
            &["generate", "--prompts-file", file],
            &stops[..],
            &small[..],
        ]
        .concat(),
    );
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), expected);
    assert!(count_after(&err, "generated tokens") < 3 * 16, "{err}");
}

/// Sampling: prompt i of the file samples with seed + i, so it equals `--prompt` with that seed.
#[test]
fn prompts_file_seeds_prompt_i_with_seed_plus_i() {
    let model = fixtures_dir().join("random/gqa");
    let model = model.to_str().unwrap();
    let lines = ["ROMEO.", "ROMEO."];
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), lines.join("\n")).unwrap();
    let common = ["--model", model, "--max-tokens", "12", "--ignore-eos"];
    let output = kiln(
        &[
            &["generate", "--prompts-file", file.path().to_str().unwrap()],
            &common[..],
            &["--seed", "40", "--trace"],
        ]
        .concat(),
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let expected: String = lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let seed = (40 + i).to_string();
            let args = [&common[..], &["--seed", &seed]].concat();
            format!("=== [{i}] {line}\n{}\n", single_completion(line, &args))
        })
        .collect();
    assert_eq!(String::from_utf8_lossy(&output.stdout), expected);
    // --trace: one line per step; both prompts (6 tokens each) run in the first.
    let err = stderr(&output);
    assert!(
        err.contains("step 1: run [0] prefill 6, [1] prefill 6 | admitted [0] [1]"),
        "{err}"
    );
}

#[test]
fn prompts_file_errors_are_clear() {
    let model = fixtures_dir().join("random/gqa");
    let model = model.to_str().unwrap();
    assert_fails_with(
        &[
            "generate",
            "--model",
            model,
            "--prompts-file",
            "/nonexistent/prompts.txt",
        ],
        "reading prompts from /nonexistent/prompts.txt",
    );
    let empty = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(empty.path(), "\n  \n\n").unwrap();
    let empty = empty.path().to_str().unwrap();
    assert_fails_with(
        &["generate", "--model", model, "--prompts-file", empty],
        "holds no prompt",
    );
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "ROMEO.\n").unwrap();
    let file = file.path().to_str().unwrap();
    for (args, needle) in [
        (&["--prompt", "x"][..], "cannot be used with"),
        (&["--contiguous"], "cannot be used with"),
        (
            &["--kv-cache-memory", "4KiB", "--max-tokens", "100"],
            "raise --kv-cache-memory",
        ),
        (
            &[
                "--no-enable-chunked-prefill",
                "--max-num-batched-tokens",
                "8",
            ],
            "raise --max-num-batched-tokens, or drop --no-enable-chunked-prefill",
        ),
        (&["--max-num-seqs", "0"], "max_num_seqs"),
    ] {
        let args = [
            &["generate", "--model", model, "--prompts-file", file],
            args,
        ]
        .concat();
        assert_fails_with(&args, needle);
    }
    // A prompt past the model's context: no flag admits it, and none is suggested.
    let long = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(long.path(), "ROMEO. ".repeat(2000)).unwrap();
    let long = long.path().to_str().unwrap();
    let output = kiln(&["generate", "--model", model, "--prompts-file", long]);
    let err = stderr(&output);
    assert!(!output.status.success());
    assert!(err.contains("exceeds the model's context"), "{err}");
    assert!(!err.contains("raise --"), "{err}");
    // Engine flags and --trace need --prompts-file.
    assert_fails_with(
        &[
            "generate",
            "--model",
            model,
            "--prompt",
            "x",
            "--max-num-seqs",
            "4",
        ],
        "cannot be used with",
    );
    assert_fails_with(
        &["generate", "--model", model, "--prompt", "x", "--trace"],
        "cannot be used with",
    );
    assert_fails_with(&["generate", "--model", model], "--prompts-file");

    // A prompt past the context is named by its first characters, not echoed whole (a
    // megabyte of prompt made a megabyte of error).
    let long = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(long.path(), "x ".repeat(100_000)).unwrap();
    let long = long.path().to_str().unwrap();
    let args = ["generate", "--model", model, "--prompts-file", long];
    assert_fails_with(&args, "(200000 characters)");
    let err = stderr(&kiln(&args));
    assert!(
        !err.contains(&"x ".repeat(100)),
        "the prompt echoed whole: {err:.2000}"
    );
}

/// `kiln perplexity` equals the PyTorch computation of the same llama.cpp-style score.
/// The final perplexity `kiln perplexity` printed.
fn ppl_of(output: &Output) -> f64 {
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .split("PPL = ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no PPL in {stdout}"))
}

#[test]
fn perplexity_matches_pytorch_on_held_out_hamlet() {
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures_dir().join("golden/perplexity.json")).unwrap(),
    )
    .unwrap();
    for name in ["shakespeare-small", "shakespeare-tiny"] {
        let model = fixtures_dir().join(name);
        let hamlet = fixtures_dir().join("corpus/hamlet.txt");
        let output = kiln(&[
            "perplexity",
            "--model",
            model.to_str().unwrap(),
            "--file",
            hamlet.to_str().unwrap(),
            "--chunks",
            "4",
        ]);
        assert!(output.status.success(), "{}", stderr(&output));
        let ppl = ppl_of(&output);
        let reference = expected[name]["chunks_4"].as_f64().unwrap();
        assert!(
            (ppl - reference).abs() / reference < 1e-4,
            "{name}: kiln {ppl} vs PyTorch {reference}"
        );
    }
}

/// `kiln quantize` writes a GGUF file that `kiln forward` runs, and reports its sizes; bad
/// inputs fail with the file or value at fault, without a panic.
#[test]
fn quantize_writes_a_gguf_file_that_kiln_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("gqa-q8_0.gguf");
    let model = fixtures_dir().join("random/gqa");
    let (model, out_path) = (model.to_str().unwrap(), out.to_str().unwrap());
    let output = kiln(&[
        "quantize", "--model", model, "--type", "q8_0", "--out", out_path,
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("bits per weight") && stdout.contains("Q8_0") && stdout.contains(" s"),
        "{stdout}"
    );
    let logits = tmp.path().join("logits.safetensors");
    let output = kiln(&[
        "forward",
        "--model",
        out_path,
        "--prompt",
        "ROMEO.",
        "--out",
        logits.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    // On a GPU the file's blocks decode to --dtype as they load: without one, the error is the
    // missing GPU's, not the file's.
    if !ch07::cuda::device::driver_present() {
        assert_fails_with(
            &[
                "forward", "--model", out_path, "--prompt", "ROMEO.", "--out", "unused",
                "--device", "cuda",
            ],
            "the CUDA driver library (libcuda.so) was not found",
        );
    }

    // `--dequantize`: the same file's weights decoded, multiplied in f32: not the integer
    // kernels' bits (their activations are rounded to 8 bits), but close to them.
    let dequantized = tmp.path().join("dequantized.safetensors");
    let output = kiln(&[
        "forward",
        "--model",
        out_path,
        "--dequantize",
        "--prompt",
        "ROMEO.",
        "--out",
        dequantized.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let read = |path: &std::path::Path| -> Vec<f32> {
        let bytes = std::fs::read(path).unwrap();
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        let logits = tensors.tensor("logits").unwrap();
        logits
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let (integer, exact) = (read(&logits), read(&dequantized));
    assert_eq!(integer.len(), exact.len());
    assert!(
        integer.iter().zip(&exact).any(|(a, b)| a != b),
        "the same path"
    );
    let norm = |v: &mut dyn Iterator<Item = f32>| v.map(|x| x * x).sum::<f32>().sqrt();
    let distance = norm(&mut integer.iter().zip(&exact).map(|(a, b)| a - b));
    let relative = distance / norm(&mut exact.iter().copied());
    assert!(relative < 0.05, "relative L2 {relative}");
    let unused = dequantized.to_str().unwrap();
    assert_fails_with(
        &[
            "forward",
            "--model",
            model,
            "--dequantize",
            "--prompt",
            "a",
            "--out",
            unused,
        ],
        "--dequantize applies to a GGUF file",
    );

    assert_fails_with(
        &[
            "quantize", "--model", model, "--type", "q2_k", "--out", out_path,
        ],
        "invalid value 'q2_k'",
    );
    // A new --out, or the existing one would be refused before the model is read.
    let fresh = tmp.path().join("never-written.gguf");
    let fresh = fresh.to_str().unwrap();
    assert_fails_with(
        &[
            "quantize",
            "--model",
            "/nonexistent/model",
            "--type",
            "q4_0",
            "--out",
            fresh,
        ],
        "/nonexistent/model/config.json",
    );
    let llama3 = fixtures_dir().join("random/llama3-rope");
    assert_fails_with(
        &[
            "quantize",
            "--model",
            llama3.to_str().unwrap(),
            "--type",
            "q4_0",
            "--out",
            fresh,
        ],
        "rope_scaling llama3 is not supported",
    );
    assert_fails_with(
        &[
            "quantize", "--model", out_path, "--type", "q4_0", "--out", out_path,
        ],
        "is a file",
    );
}

#[test]
fn a_gpu_that_is_not_there_is_an_error_never_a_cpu_fallback() {
    assert_fails_with(
        &["generate", "--prompt", "HAMLET.", "--device", "gpu"],
        "expected `cpu`, `cuda` or `cuda:N`",
    );
    // Every benchmark but chapter 7's runs on the CPU, and says so (chapters 1, 2 and 8's
    // tensor parallelism once loaded their models around the check).
    for chapter in ["ch01", "ch02", "ch03", "ch08-tp"] {
        assert_fails_with(
            &["bench", chapter, "--quick", "--device", "cuda:0"],
            "runs on the CPU only so far",
        );
    }
    // vLLM's --gpu-memory-utilization: a share of a GPU, never of the CPU.
    assert_fails_with(
        &[
            "generate",
            "--prompt",
            "HAMLET.",
            "--gpu-memory-utilization",
            "0.9",
        ],
        "it needs --device cuda",
    );
    assert_fails_with(
        &[
            "serve",
            "--device",
            "cuda",
            "--gpu-memory-utilization",
            "1.5",
        ],
        "is not a share of memory",
    );
    // What the GPU path does not take is refused before any device is opened, never ignored.
    fn on_gpu<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["generate", "--prompt", "HAMLET.", "--device", "cuda"];
        args.extend_from_slice(extra);
        args
    }
    assert_fails_with(&on_gpu(&["--recompute"]), "drop --recompute/--contiguous");
    assert_fails_with(&on_gpu(&["--contiguous"]), "drop --recompute/--contiguous");
    let demo = fixtures_dir().join("prompts/demo.txt");
    let demo = demo.to_str().unwrap();
    for command in [
        &["generate", "--prompts-file", demo][..],
        &["serve", "--port", "0"],
    ] {
        let mut args = command.to_vec();
        args.extend(["--device", "cuda", "--attention-backend", "flash"]);
        assert_fails_with(
            &args,
            "--attention-backend picks the CPU executor's attention",
        );
    }
    assert_fails_with(
        &on_gpu(&["--dequantize"]),
        "--dequantize applies to a GGUF file",
    );
    if !ch07::cuda::device::driver_present() {
        let hamlet = fixtures_dir().join("corpus/hamlet.txt");
        let hamlet = hamlet.to_str().unwrap();
        for command in [
            &[
                "perplexity",
                "--file",
                hamlet,
                "--chunks",
                "1",
                "--device",
                "cuda",
            ][..],
            &[
                "forward",
                "--prompt",
                "HAMLET.",
                "--out",
                "unused.safetensors",
                "--device",
                "cuda",
            ],
        ] {
            assert_fails_with(
                command,
                "the CUDA driver library (libcuda.so) was not found",
            );
        }
        assert_fails_with(
            &[
                "generate",
                "--prompt",
                "HAMLET.",
                "--max-tokens",
                "2",
                "--device",
                "cuda",
            ],
            "the CUDA driver library (libcuda.so) was not found",
        );
        // Tensor-parallel ranks over NCCL need GPUs too.
        assert_fails_with(
            &[
                "generate",
                "--prompt",
                "HAMLET.",
                "--tensor-parallel-size",
                "2",
                "--tensor-parallel-backend",
                "nccl",
            ],
            "no CUDA driver (libcuda.so): NCCL ranks need NVIDIA GPUs",
        );
        // One rank over NCCL is still NCCL (not the CPU executor, silently).
        assert_fails_with(
            &[
                "generate",
                "--prompt",
                "HAMLET.",
                "--tensor-parallel-backend",
                "nccl",
            ],
            "no CUDA driver (libcuda.so): NCCL ranks need NVIDIA GPUs",
        );
        // The server too: it fails as it starts, saying why, rather than serving on the CPU.
        assert_fails_with(
            &["serve", "--port", "0", "--device", "cuda"],
            "the CUDA driver library (libcuda.so) was not found",
        );
    }
    assert_fails_with(
        &["serve", "--device", "cuda", "--tensor-parallel-size", "2"],
        "tensor parallelism runs on the CPU only so far",
    );
}

/// `--tensor-parallel-size` (chapter 8): greedy completions of the demo prompts on 2 and 4
/// ranks print exactly what one rank prints; perplexity on 2 ranks matches PyTorch's golden
/// value as one rank's does; a size that does not split the heads is a clear error.
#[test]
fn tensor_parallel_generate_and_perplexity_equal_one_rank() {
    let prompts = fixtures_dir().join("prompts/demo.txt");
    let completions = |tp: &str| {
        let output = kiln(&[
            "generate",
            "--prompts-file",
            prompts.to_str().unwrap(),
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--tensor-parallel-size",
            tp,
        ]);
        assert!(output.status.success(), "{}", stderr(&output));
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let one = completions("1");
    assert!(one.contains("=== [5]"), "{one}");
    assert_eq!(completions("2"), one);
    assert_eq!(completions("4"), one); // 4 ranks on 2 KV heads: replicated

    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures_dir().join("golden/perplexity.json")).unwrap(),
    )
    .unwrap();
    let hamlet = fixtures_dir().join("corpus/hamlet.txt");
    let args = [
        "perplexity",
        "--file",
        hamlet.to_str().unwrap(),
        "--chunks",
        "4",
    ];
    let output = kiln(&[&args[..], &["--tensor-parallel-size", "2"]].concat());
    assert!(output.status.success(), "{}", stderr(&output));
    let ppl = ppl_of(&output);
    let reference = expected["shakespeare-small"]["chunks_4"].as_f64().unwrap();
    assert!(
        (ppl - reference).abs() / reference < 1e-4,
        "TP=2 {ppl} vs PyTorch {reference}"
    );

    assert_fails_with(
        &[
            "generate",
            "--prompt",
            "HAMLET.",
            "--tensor-parallel-size",
            "3",
        ],
        "num_attention_heads = 8 does not divide by the tensor-parallel world size 3",
    );
    assert_fails_with(
        &[
            "generate",
            "--prompt",
            "HAMLET.",
            "--tensor-parallel-size",
            "2",
            "--recompute",
        ],
        "--tensor-parallel-size 2 runs on the engine's paged cache",
    );
}

/// Without `--features mpi`, the MPI backend and the worker say how to get them.
#[cfg(not(feature = "mpi"))]
#[test]
fn the_mpi_backend_needs_a_kiln_built_with_it() {
    assert_fails_with(
        &[
            "generate",
            "--prompt",
            "HAMLET.",
            "--tensor-parallel-size",
            "2",
            "--tensor-parallel-backend",
            "mpi",
        ],
        "this kiln was built without MPI (cargo build --release --features mpi)",
    );
    assert_fails_with(
        &["tp-worker"],
        "kiln tp-worker: this kiln was built without MPI",
    );
}

/// `kiln random-model` writes a checkpoint that `kiln generate` runs, and never writes into a
/// directory that holds something.
#[test]
fn random_model_writes_a_checkpoint_that_kiln_generates_from() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny-d64");
    let out = out.to_str().unwrap();
    let output = kiln(&["random-model", "--preset", "tiny-d64", "--out", out]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("parameters"),
        "{}",
        stderr(&output)
    );

    let output = kiln(&[
        "generate",
        "--model",
        out,
        "--prompt",
        "ROMEO:",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("ROMEO:"));

    assert_fails_with(
        &["random-model", "--preset", "tiny-d64", "--out", out],
        "is not empty",
    );
    let fresh = tmp.path().join("never-written");
    let fresh = fresh.to_str().unwrap();
    assert_fails_with(
        &[
            "random-model",
            "--preset",
            "llama-1b",
            "--layers",
            "4294967295",
            "--out",
            fresh,
        ],
        "--layers must be from 1 to 1024",
    );
    assert!(!std::path::Path::new(fresh).exists());
}

/// `--contiguous` reserves the model's whole context at once: where that is more memory than
/// the machine has available, it is refused with the reason instead of aborting.
#[test]
fn a_contiguous_cache_larger_than_memory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let source = fixtures_dir().join("shakespeare-small");
    for entry in std::fs::read_dir(&source).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    let config_path = tmp.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["max_position_embeddings"] = (1u64 << 24).into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    // 2 × 6 layers × 2^24 positions × 2 KV heads × 32 × 4 bytes.
    let reserve: u64 = 2 * 6 * (1 << 24) * 64 * 4;
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok()
    });
    match available {
        Some(kib) if kib * 1024 < reserve => {
            let model = tmp.path().to_str().unwrap();
            assert_fails_with(
                &[
                    "generate",
                    "--model",
                    model,
                    "--prompt",
                    "HAMLET.",
                    "--max-tokens",
                    "2",
                    "--contiguous",
                ],
                "--contiguous reserves the whole context of 16777216 positions",
            );
        }
        _ => eprintln!("skipped: this machine has the memory for the reservation"),
    }
}

#[test]
fn an_fp8_checkpoint_runs_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures_dir().join("shakespeare-tiny");
    ch05::testing::write_fp8_checkpoint(&src, dir.path(), "dynamic").unwrap();
    let model = dir.path().to_str().unwrap();
    let output = kiln(&four_tokens(model, &[]));
    assert!(output.status.success(), "{}", stderr(&output));
    assert_fails_with(
        &four_tokens(model, &["--quantization", "q8_0"]),
        "is an FP8 checkpoint",
    );
    assert_fails_with(
        &four_tokens(model, &["--device", "cuda"]),
        "no GPTQ, AWQ or FP8 directory",
    );
}

/// A copy of the `random/gqa` fixture's files in `dir` (made if missing), for tests that edit
/// or overwrite a model's files.
fn copy_gqa_fixture(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(ch01::fixtures_dir().join("random/gqa")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
}

/// `quantize --type` writes a new file or nothing: never over its own input's files, the input
/// directory itself, or any other file (it once renamed its output over whatever was there).
#[test]
fn quantize_type_never_writes_over_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_gqa_fixture(&model);
    let weights = model.join("model.safetensors");
    let before = std::fs::read(&weights).unwrap();
    let quantize = |out: &std::path::Path| {
        kiln(&[
            "quantize",
            "--model",
            model.to_str().unwrap(),
            "--type",
            "q8_0",
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let other = tmp.path().join("other.gguf");
    std::fs::write(&other, "keep me").unwrap();
    for out in [weights.as_path(), model.as_path(), other.as_path()] {
        let refused = quantize(out);
        assert!(
            !refused.status.success() && stderr(&refused).contains("already exists"),
            "{}: {}",
            out.display(),
            stderr(&refused)
        );
    }
    assert_eq!(std::fs::read(&weights).unwrap(), before);
    assert_eq!(std::fs::read(&other).unwrap(), b"keep me");
    // A new file is written, and no temporary file is left beside it; then it too is kept.
    let out = tmp.path().join("q.gguf");
    let done = quantize(&out);
    assert!(done.status.success(), "{}", stderr(&done));
    let written = std::fs::read(&out).unwrap();
    let again = quantize(&out);
    assert!(!again.status.success() && stderr(&again).contains("already exists"));
    assert_eq!(std::fs::read(&out).unwrap(), written);
    let mut names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["model", "other.gguf", "q.gguf"]);
}

/// The tokenizer's EOS (merged into the stop tokens) and BOS must be rows of the model's
/// embedding: a tokenizer whose added token lies past `vocab_size` is refused at load, naming
/// tokenizer_config.json and the id (the server's grammar engine once panicked on such a stop
/// id).
#[test]
fn a_tokenizer_special_token_past_the_vocabulary_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    copy_gqa_fixture(tmp.path());
    let edit = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let path = tmp.path().join(name);
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut json);
        std::fs::write(&path, json.to_string()).unwrap();
    };
    let vocab_size = 4096; // the fixture's config.json
    edit("tokenizer.json", &|t| {
        t["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "id": vocab_size, "content": "<|extra|>", "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
    });
    let model = tmp.path().to_str().unwrap();
    let args = [
        "generate",
        "--model",
        model,
        "--prompt",
        "a",
        "--max-tokens",
        "1",
    ];
    let output = kiln(&args);
    assert!(output.status.success(), "{}", stderr(&output));
    for key in ["eos_token", "bos_token"] {
        edit("tokenizer_config.json", &|c| c[key] = "<|extra|>".into());
        assert_fails_with(
            &args,
            &format!("tokenizer_config.json: {key} {vocab_size} is outside the model's vocabulary"),
        );
        let original = if key == "eos_token" { "</s>" } else { "<s>" };
        edit("tokenizer_config.json", &|c| c[key] = original.into());
    }
}

/// `quantize --method` writes a new directory or nothing: never over its own model (which it
/// once emptied, file by file), never beside another checkpoint's files.
#[test]
fn quantize_method_never_writes_over_a_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_gqa_fixture(&model);
    let before = std::fs::read(model.join("tokenizer.json")).unwrap();
    let model_str = model.to_str().unwrap();
    let rtn = |out: &str| {
        kiln(&[
            "quantize", "--method", "rtn", "--model", model_str, "--out", out,
        ])
    };
    let same = rtn(model_str);
    assert!(
        !same.status.success() && stderr(&same).contains("is not empty"),
        "{}",
        stderr(&same)
    );
    assert_eq!(std::fs::read(model.join("tokenizer.json")).unwrap(), before);
    // Into a new directory: the whole checkpoint, and no staging directory left beside it.
    let out = tmp.path().join("q");
    let done = rtn(out.to_str().unwrap());
    assert!(done.status.success(), "{}", stderr(&done));
    assert!(out.join("model.safetensors").exists() && out.join("tokenizer.json").exists());
    let names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains("partial")), "{names:?}");
    // Again into it, now not empty.
    let again = rtn(out.to_str().unwrap());
    assert!(!again.status.success() && stderr(&again).contains("is not empty"));
    // The quantized checkpoint is not quantized again, by either quantizer: it has no dense
    // projection weights (the error once said `q_proj.weight` was not found).
    let out_str = out.to_str().unwrap();
    let fresh = tmp.path().join("again");
    for args in [&["--method", "rtn"][..], &["--type", "q8_0"][..]] {
        let target = fresh.with_extension(if args[0] == "--type" { "gguf" } else { "" });
        let mut all = vec![
            "quantize",
            "--model",
            out_str,
            "--out",
            target.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        let twice = kiln(&all);
        assert!(
            !twice.status.success() && stderr(&twice).contains("is already quantized (gptq)"),
            "{args:?}: {}",
            stderr(&twice)
        );
        assert!(!target.exists(), "nothing is written");
    }
}

/// `quantize --method awq` with a group size that does not divide every projection's input
/// size (random/gqa: hidden 64, intermediate 96) is refused before calibrating, and nothing is
/// written. It once wrote the directory (a layer narrower than the group was packed with whole
/// rows) under a config.json whose group size kiln's own loader then refused.
#[test]
fn quantize_awq_refuses_a_group_size_its_layout_cannot_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("train.txt");
    std::fs::write(
        &text,
        "To be, or not to be, that is the question. ".repeat(40),
    )
    .unwrap();
    let model = ch01::fixtures_dir().join("random/gqa");
    let out = tmp.path().join("q");
    let run = |group: &str| {
        kiln(&[
            "quantize",
            "--method",
            "awq",
            "--group-size",
            group,
            "--samples",
            "1",
            "--seq-len",
            "8",
            "--calibration",
            text.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let refused = run("128");
    assert!(
        !refused.status.success()
            && stderr(&refused).contains("group size 128 must divide in_features (64)"),
        "{}",
        stderr(&refused)
    );
    assert!(!out.exists(), "nothing is written");
    // A group size that divides 64 and 96 writes a directory kiln loads.
    let done = run("32");
    assert!(done.status.success(), "{}", stderr(&done));
    let logits = tmp.path().join("logits.safetensors");
    let loaded = kiln(&[
        "forward",
        "--model",
        out.to_str().unwrap(),
        "--prompt",
        "To be",
        "--out",
        logits.to_str().unwrap(),
    ]);
    assert!(loaded.status.success(), "{}", stderr(&loaded));
}
