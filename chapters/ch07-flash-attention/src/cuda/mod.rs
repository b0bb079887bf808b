//! # Chapter 7, part 2: CUDA
//!
//! The kernels of `kernels/*.cu` (each one the twin of a CPU function of chapters 1–7), their
//! compilation by NVRTC for the device's architecture, and the device they run on. cudarc loads
//! the CUDA libraries when first asked (dynamic loading), so a build with this module runs on a
//! machine with no CUDA at all: asking for a GPU there is a [`CudaError`] that says which library
//! or device is missing, never a panic and never a silent fall-back to the CPU.
//!
//! | module      | what it does                                                              |
//! |-------------|---------------------------------------------------------------------------|
//! | [`kernels`] | the sources, embedded in the binary, and the kernel names each one defines |
//! | [`kernel_choice`] | which of two kernels that compute the same thing runs            |
//! | [`compile`] | NVRTC: source → PTX for `sm_80`, `sm_90`, ...                              |
//! | [`device`]  | one GPU: its context, stream, architecture, and every kernel loaded on it  |
//! | [`weights`] | a Llama's weights in device memory, from any weight source                |
//! | [`executor`]| [`CudaExecutor`]: chapter 4's `Executor` on a GPU                          |
//! | [`batch`]   | a step's index arrays, checked on the host and uploaded in one copy         |
//! | [`ops`]     | safe launches: every length and index a kernel relies on, checked on the host |

pub mod batch;
pub mod compile;
pub mod device;
pub mod executor;
pub mod kernel_choice;
pub mod kernels;
pub mod ops;
mod step_buffers;
pub mod weights;

pub use batch::{BatchIndex, BatchShape, DeviceTokens, PagedBatch, SeqRows, UploadedTokens};
pub use compile::{Arch, compile_kernel, compile_kernel_cached, compile_kernel_once};
pub use device::{DeviceSpec, GpuDevice};
pub use executor::{CudaExecutor, KvBudget, kv_bytes_for_share};
pub use kernel_choice::{DecodeKernel, PrefillKernel};
pub use kernels::{KERNELS, KernelSource};
pub use ops::{DeviceScalar, HeadShape, prefill_on_tensor_cores};

/// Why the GPU path could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "the CUDA driver library (libcuda.so) was not found: this machine has no NVIDIA driver, \
         or it is not on the library path"
    )]
    DriverMissing,
    #[error(
        "the NVRTC library (libnvrtc.so.13) was not found: install the CUDA 13 toolkit or the \
         `nvidia-cuda-nvrtc` wheel and put its lib folder on LD_LIBRARY_PATH"
    )]
    NvrtcMissing,
    #[error("the cuBLAS library (libcublas.so.13) was not found")]
    CublasMissing,
    #[error("no CUDA device {ordinal}: this machine has {count}")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("`{0}` is not a device: expected `cpu`, `cuda` or `cuda:N`")]
    BadDeviceName(String),
    #[error(
        "compute capability {major}.{minor} is older than 8.0 (Ampere), the oldest kiln's kernels target"
    )]
    UnsupportedArch { major: i32, minor: i32 },
    #[error("kernel {file} did not compile for {arch}:\n{log}")]
    Compile {
        file: &'static str,
        arch: String,
        log: String,
    },
    #[error("loading the weights for the GPU: {0}")]
    Weights(String),
    #[error("cuBLAS: {0:?}")]
    Cublas(cudarc::cublas::result::CublasError),
    #[error("GPU operation: {0}")]
    Shape(String),
    #[error("GPU configuration: {0}")]
    Config(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}
