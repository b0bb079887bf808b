//! The CUDA attention kernels on CPU threads, no GPU needed: `kernels/emulation/` compiles a
//! kernel's source as C++ with one `std::thread` per CUDA thread and checks it against attention
//! computed in f64 (see its README lines in `kernels/README.md`). These tests build and run its
//! two programs with g++; `fixtures/scripts/emulate_kernels.sh` (CI) runs the same programs
//! under ThreadSanitizer. Without g++ they skip, saying so, unless `KILN_REQUIRE_GXX` is set.

use std::path::{Path, PathBuf};
use std::process::Command;

fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels")
}

fn gxx_present() -> bool {
    Command::new("g++").arg("--version").output().is_ok()
}

/// Builds `kernels/emulation/{program}.cpp` and runs it; panics with its output if it fails.
fn build_and_run(program: &str) {
    if !gxx_present() {
        assert!(
            std::env::var_os("KILN_REQUIRE_GXX").is_none(),
            "KILN_REQUIRE_GXX is set but g++ cannot be run"
        );
        eprintln!("skipped: no g++ on this machine (set KILN_REQUIRE_GXX=1 to fail)");
        return;
    }
    let kernels = kernels_dir();
    let binary = Path::new(env!("CARGO_TARGET_TMPDIR")).join(program);
    let build = Command::new("g++")
        .args(["-std=c++20", "-O1", "-w"])
        .arg("-I")
        .arg(&kernels)
        .arg("-I")
        .arg(kernels.join("emulation"))
        .arg(kernels.join("emulation").join(format!("{program}.cpp")))
        .arg("-o")
        .arg(&binary)
        .arg("-lpthread")
        .output()
        .expect("running g++");
    assert!(
        build.status.success(),
        "{program}.cpp does not compile:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&binary).output().expect("running the check");
    let output = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{program} failed:\n{output}");
    assert!(output.contains("0 failures"), "{output}");
}

#[test]
fn decode_kernels_on_cpu_threads_equal_attention() {
    build_and_run("decode_check");
}

#[test]
fn prefill_kernels_on_cpu_threads_equal_attention() {
    build_and_run("prefill_check");
}
