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
    let output = kiln(&[
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
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("ROMEO."));
    let err = stderr(&output);
    assert!(
        err.contains("prompt eval:") && err.contains("tokens/s"),
        "{err}"
    );
    assert!(err.contains("generation:  12 tokens"), "{err}");

    let again = kiln(&[
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
    ]);
    assert_eq!(output.stdout, again.stdout, "same seed, same text");
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
    assert_fails_with(
        &["generate", "--model", "/nonexistent/model", "--prompt", "x"],
        "/nonexistent/model/config.json",
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
        "exceeds the model's context of 512 tokens",
    );
    assert_fails_with(
        &["perplexity", "--model", model, "--file", "/nonexistent.txt"],
        "/nonexistent.txt",
    );
    assert_fails_with(
        &[
            "generate",
            "--model",
            model,
            "--prompt",
            "x",
            "--kv-cache-memory",
            "12XB",
        ],
        "unknown size unit",
    );
    assert_fails_with(
        &[
            "generate",
            "--model",
            model,
            "--prompt",
            "x",
            "--kv-cache-memory",
            "1KiB",
        ],
        "holds no block",
    );
    assert_fails_with(
        &[
            "generate",
            "--model",
            model,
            "--prompt",
            "x",
            "--kv-cache-memory",
            "64KiB",
            "--max-tokens",
            "500",
        ],
        "raise --kv-cache-memory",
    );
}

/// `kiln perplexity` equals the PyTorch computation of the same llama.cpp-style score.
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
        let stdout = String::from_utf8_lossy(&output.stdout);
        let ppl: f64 = stdout
            .split("PPL = ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no PPL in {stdout}"));
        let reference = expected[name]["chunks_4"].as_f64().unwrap();
        assert!(
            (ppl - reference).abs() / reference < 1e-4,
            "{name}: kiln {ppl} vs PyTorch {reference}"
        );
    }
}
