//! NVRTC: a kernel's source → PTX for one GPU architecture, at start-up.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex, PoisonError};

use ch03::block_manager::{FNV_OFFSET, fnv1a_extend};

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};

use super::CudaError;
use super::kernels::KernelSource;

/// A GPU architecture the kernels are compiled for (`--gpu-architecture=sm_XY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Ampere (A100): compute capability 8.0.
    Sm80,
    /// Ada (L4, L40): 8.9.
    Sm89,
    /// Hopper (H100, H200): 9.0.
    Sm90,
    /// Blackwell (10.0) and later: `sm_100` PTX, which the driver JIT-compiles for the device.
    Sm100,
}

impl Arch {
    /// The architecture for a compute capability: the newest kiln knows that is not newer than
    /// the device.
    pub fn from_capability(major: i32, minor: i32) -> Result<Arch, CudaError> {
        match (major, minor) {
            (m, _) if m >= 10 => Ok(Arch::Sm100),
            (9, _) => Ok(Arch::Sm90),
            (8, n) if n >= 9 => Ok(Arch::Sm89),
            (8, _) => Ok(Arch::Sm80),
            _ => Err(CudaError::UnsupportedArch { major, minor }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm89 => "sm_89",
            Arch::Sm90 => "sm_90",
            Arch::Sm100 => "sm_100",
        }
    }

    /// Every architecture, for the compile check.
    pub const ALL: [Arch; 4] = [Arch::Sm80, Arch::Sm89, Arch::Sm90, Arch::Sm100];
}

/// Whether the NVRTC library can be loaded (cudarc would panic on first use otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's options beside the architecture (part of what names a cached PTX file).
const OPTIONS: &[&str] = &["--std=c++17"];

/// Compiles one kernel file for `arch`. Precise division and square roots, no flush-to-zero:
/// the kernels are held to the CPU reference within 1e-5.
pub fn compile_kernel(kernel: &KernelSource, arch: Arch) -> Result<Ptx, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::NvrtcMissing);
    }
    let options = CompileOptions {
        arch: Some(arch.name()),
        name: Some(kernel.file.to_string()),
        options: OPTIONS.iter().map(|o| o.to_string()).collect(),
        ..Default::default()
    };
    compile_ptx_with_opts(kernel.resolved(), options).map_err(|e| CudaError::Compile {
        file: kernel.file,
        arch: arch.name().to_string(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => other.to_string(),
        },
    })
}

/// [`compile_kernel`], once per process for each source and architecture: the sources are
/// `'static` text that never changes, so a second device opened by the same process (a draft
/// model's executor, each GPU test) reuses the PTX instead of running NVRTC again.
pub fn compile_kernel_once(kernel: &KernelSource, arch: Arch) -> Result<Ptx, CudaError> {
    type Key = (&'static str, &'static str, Arch); // file, source, architecture
    static COMPILED: LazyLock<Mutex<HashMap<Key, Ptx>>> = LazyLock::new(Default::default);
    let compiled = || COMPILED.lock().unwrap_or_else(PoisonError::into_inner);
    let key = (kernel.file, kernel.source, arch);
    if let Some(ptx) = compiled().get(&key).cloned() {
        return Ok(ptx);
    }
    // Compiled outside the lock: two threads may both compile a file once; either result is
    // the same PTX.
    let ptx = match std::env::var_os(KERNEL_CACHE_VAR) {
        Some(dir) => compile_kernel_cached(kernel, arch, Path::new(&dir))?,
        None => compile_kernel(kernel, arch)?,
    };
    compiled().insert(key, ptx.clone());
    Ok(ptx)
}

/// A folder where [`compile_kernel_once`] keeps the PTX it compiles, for later processes:
/// each kiln process otherwise runs NVRTC over every kernel as it opens a device.
pub const KERNEL_CACHE_VAR: &str = "KILN_KERNEL_CACHE";

/// [`compile_kernel`] through the folder `dir`: the PTX of this source, architecture, options
/// and NVRTC version if a process has compiled it before, else compiled and stored there. A
/// folder that cannot be read or written only costs the compilation.
pub fn compile_kernel_cached(
    kernel: &KernelSource,
    arch: Arch,
    dir: &Path,
) -> Result<Ptx, CudaError> {
    let Some(path) = cached_ptx_path(kernel, arch, dir) else {
        return compile_kernel(kernel, arch);
    };
    if let Ok(text) = std::fs::read_to_string(&path) {
        return Ok(Ptx::from_src(text));
    }
    let ptx = compile_kernel(kernel, arch)?;
    // Written whole under another name, then renamed: a reader never sees half a file. (A
    // cache that cannot be written only costs the next process a compile.)
    let _ = std::fs::create_dir_all(dir)
        .and_then(|()| ch01::new_dir::write_new_file(&path, ptx.to_src().as_bytes()));
    Ok(ptx)
}

/// `dir/<file>-<arch>-<hash>.ptx`, the hash (FNV-1a, 64 bits) over everything that makes the
/// PTX: the resolved source, the architecture, the options and NVRTC's version. `None` when
/// NVRTC's version cannot be read.
fn cached_ptx_path(kernel: &KernelSource, arch: Arch, dir: &Path) -> Option<PathBuf> {
    let (major, minor) = nvrtc_version()?;
    let parts = [
        kernel.resolved(),
        arch.name().to_string(),
        OPTIONS.join(" "),
        format!("nvrtc {major}.{minor}"),
    ];
    // Each part and a 0 byte after it, so that no two lists of parts hash the same bytes.
    let hash = parts.iter().fold(FNV_OFFSET, |hash, part| {
        fnv1a_extend(fnv1a_extend(hash, part.as_bytes()), &[0])
    });
    let stem = kernel.file.trim_end_matches(".cu");
    Some(dir.join(format!("{stem}-{}-{hash:016x}.ptx", arch.name())))
}

/// NVRTC's (major, minor) version, `None` if the library cannot say.
fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); nvrtcVersion writes two ints through
    // the pointers, which point to live locals.
    let result = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (result == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_follow_the_compute_capability() {
        assert_eq!(Arch::from_capability(8, 0).unwrap(), Arch::Sm80);
        assert_eq!(Arch::from_capability(8, 6).unwrap(), Arch::Sm80);
        assert_eq!(Arch::from_capability(8, 9).unwrap(), Arch::Sm89);
        assert_eq!(Arch::from_capability(9, 0).unwrap(), Arch::Sm90);
        assert_eq!(Arch::from_capability(12, 0).unwrap(), Arch::Sm100);
        assert!(matches!(
            Arch::from_capability(7, 5),
            Err(CudaError::UnsupportedArch { major: 7, minor: 5 })
        ));
    }
}
