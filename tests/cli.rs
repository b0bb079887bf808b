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

#[test]
fn bad_inputs_exit_nonzero_with_a_clear_message() {
    let missing = kiln(&["generate", "--model", "/nonexistent/model", "--prompt", "x"]);
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("/nonexistent/model/config.json"),
        "{}",
        stderr(&missing)
    );

    let model = fixtures_dir().join("random/gqa");
    let bad_param = kiln(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "x",
        "--top-p",
        "1.5",
    ]);
    assert!(!bad_param.status.success());
    assert!(
        stderr(&bad_param).contains("top_p"),
        "{}",
        stderr(&bad_param)
    );

    let too_long = "word ".repeat(2000);
    let overflow = kiln(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        &too_long,
    ]);
    assert!(!overflow.status.success());
    assert!(
        stderr(&overflow).contains("exceeds the model's context of 512 tokens"),
        "{}",
        stderr(&overflow)
    );

    let no_file = kiln(&[
        "perplexity",
        "--model",
        model.to_str().unwrap(),
        "--file",
        "/nonexistent.txt",
    ]);
    assert!(!no_file.status.success());
    assert!(
        stderr(&no_file).contains("/nonexistent.txt"),
        "{}",
        stderr(&no_file)
    );
    for output in [missing, bad_param, overflow, no_file] {
        assert!(!stderr(&output).contains("panicked"), "{}", stderr(&output));
    }
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
