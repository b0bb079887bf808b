//! Every kernel compiles through NVRTC for every architecture kiln targets, with no GPU: CI runs
//! this with the NVRTC library of the `nvidia-cuda-nvrtc` wheel on LD_LIBRARY_PATH and
//! `KILN_REQUIRE_NVRTC=1`, so that a missing library fails the check instead of skipping it.

use ch07_flash_attention::cuda::compile::nvrtc_present;
use ch07_flash_attention::cuda::{
    Arch, KERNELS, compile_kernel, compile_kernel_cached, compile_kernel_once,
};

/// Whether NVRTC can be loaded; without it the test says it skipped, unless
/// `KILN_REQUIRE_NVRTC` is set, which makes that a failure.
fn nvrtc_or_skip() -> bool {
    if !nvrtc_present() {
        assert!(
            std::env::var_os("KILN_REQUIRE_NVRTC").is_none(),
            "KILN_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("skipped: no NVRTC library on this machine (set KILN_REQUIRE_NVRTC=1 to fail)");
        return false;
    }
    true
}

/// Assembles `ptx` for `arch` with the ptxas at `ptxas`, failing with its log if it refuses; the
/// lines of its report that give each entry's registers and spills.
fn assemble(ptxas: &std::path::Path, file: &str, arch: Arch, ptx: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join(format!("{file}.ptx"));
    std::fs::write(&source, ptx).unwrap();
    let out = std::process::Command::new(ptxas)
        .arg(format!("-arch={}", arch.name()))
        .arg("-v")
        .arg(&source)
        .arg("-o")
        .arg(dir.path().join("out.cubin"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", ptxas.display()));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ptxas refused {file}'s PTX for {}:\n{log}",
        arch.name()
    );
    log.lines()
        .filter(|l| l.contains("Compiling entry") || l.contains("registers") || l.contains("spill"))
        .map(|l| l.trim().trim_start_matches("ptxas info    : ").to_string())
        .collect()
}

/// With `KILN_PTXAS` naming a ptxas (`fixtures/scripts/fetch_nvrtc.sh --ptxas`, as CI does), each PTX
/// is also assembled for its architecture: NVRTC passes a kernel's inline `asm` (the
/// tensor-core prefill's `mma.sync`, `ldmatrix`, `cp.async`, `cvt`, `ex2`) through unread, so a
/// mistyped instruction or operand would otherwise show only when a GPU loads the module.
#[test]
fn every_kernel_compiles_for_every_architecture() {
    if !nvrtc_or_skip() {
        return;
    }
    let ptxas = (std::env::var_os("KILN_PTXAS"))
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from);
    for kernel in KERNELS {
        for arch in Arch::ALL {
            let ptx = compile_kernel(kernel, arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            if let Some(ptxas) = &ptxas {
                for line in assemble(ptxas, kernel.file, arch, &text) {
                    println!("  {line}");
                }
            }
            for function in kernel.functions {
                assert!(
                    text.contains(&format!(".entry {function}(")),
                    "{} for {}: no entry {function} in the PTX",
                    kernel.file,
                    arch.name()
                );
            }
            println!(
                "{} for {}: {} bytes of PTX",
                kernel.file,
                arch.name(),
                text.len()
            );
        }
    }
}

#[test]
fn a_kernel_with_an_error_reports_the_compiler_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let broken = ch07_flash_attention::cuda::KernelSource {
        file: "broken.cu",
        source: "extern \"C\" __global__ void broken() { undefined_name = 1; }",
        functions: &["broken"],
    };
    let error = compile_kernel(&broken, Arch::Sm90).unwrap_err().to_string();
    assert!(
        error.contains("broken.cu") && error.contains("undefined_name"),
        "{error}"
    );
}

/// The PTX a device gets (compiled once per process) is NVRTC's for that source: the same on a
/// second call, and a different source of the same file name is compiled, not confused with it.
#[test]
fn a_kernel_compiled_once_is_the_compilers_ptx() {
    if !nvrtc_or_skip() {
        return;
    }
    let kernel = &KERNELS[0];
    let fresh = compile_kernel(kernel, Arch::Sm90).unwrap().to_src();
    for _ in 0..2 {
        assert_eq!(
            compile_kernel_once(kernel, Arch::Sm90).unwrap().to_src(),
            fresh
        );
    }
    let other = ch07_flash_attention::cuda::KernelSource {
        file: kernel.file,
        source: "extern \"C\" __global__ void other_entry() {}",
        functions: &["other_entry"],
    };
    let text = compile_kernel_once(&other, Arch::Sm90).unwrap().to_src();
    assert!(text.contains(".entry other_entry("), "{text}");
}

/// `KILN_KERNEL_CACHE`'s folder: the first compilation stores NVRTC's PTX there, one file per
/// source and architecture, and a later one reads the file instead of compiling.
#[test]
fn a_kernel_cache_folder_keeps_the_ptx_for_later_processes() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = &KERNELS[0];
    let fresh = compile_kernel(kernel, Arch::Sm90).unwrap().to_src();
    assert_eq!(
        compile_kernel_cached(kernel, Arch::Sm90, dir.path())
            .unwrap()
            .to_src(),
        fresh
    );
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(std::fs::read_to_string(&files[0]).unwrap(), fresh);
    // What a later call returns is the file's text (here replaced, to tell the two apart).
    std::fs::write(&files[0], "// from the cache\n").unwrap();
    let cached = compile_kernel_cached(kernel, Arch::Sm90, dir.path()).unwrap();
    assert_eq!(cached.to_src(), "// from the cache\n");
    // Another architecture is another file.
    compile_kernel_cached(kernel, Arch::Sm80, dir.path()).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}
