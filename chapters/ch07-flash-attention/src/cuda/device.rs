//! One GPU: its context and stream, the architecture the kernels were compiled for, and every
//! kernel function loaded on it.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};

use super::CudaError;
use super::compile::{Arch, compile_kernel_once};
use super::kernel_choice::{DecodeKernel, PrefillKernel};
use super::kernels::KERNELS;
use super::step_buffers::DecodePartials;

/// Where the model runs: `cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = CudaError;

    fn from_str(s: &str) -> Result<Self, CudaError> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| CudaError::BadDeviceName(s.to_string())),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Whether the CUDA driver library can be loaded (cudarc would panic on first use otherwise).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// A GPU with every kernel of [`KERNELS`] compiled for it and loaded.
///
/// Invariant: `functions` holds every function that [`KERNELS`] lists.
pub struct GpuDevice {
    pub context: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub arch: Arch,
    /// The split-K decode kernel [`paged_decode`](GpuDevice::paged_decode) prefers
    /// ([`DecodeKernel::from_env`]).
    pub decode_kernel: DecodeKernel,
    /// The tensor-core prefill kernel [`flash_prefill`](GpuDevice::flash_prefill) prefers
    /// ([`PrefillKernel::from_env`]).
    pub prefill_kernel: PrefillKernel,
    /// The most dynamic shared memory a thread block may ask for on this GPU, in bytes.
    pub max_shared_per_block: u32,
    /// Split-K decode's partial results, kept between launches.
    pub(super) decode_partials: Mutex<DecodePartials>,
    functions: HashMap<&'static str, CudaFunction>,
}

impl GpuDevice {
    /// Opens device `ordinal`, compiles every kernel for its architecture and loads them.
    pub fn open(ordinal: usize) -> Result<GpuDevice, CudaError> {
        if !driver_present() {
            return Err(CudaError::DriverMissing);
        }
        let count = CudaContext::device_count()? as usize;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let context = CudaContext::new(ordinal)?;
        let (major, minor) = context.compute_capability()?;
        let arch = Arch::from_capability(major, minor)?;
        let mut functions = HashMap::new();
        for kernel in KERNELS {
            let module = context.load_module(compile_kernel_once(kernel, arch)?)?;
            for &function in kernel.functions {
                functions.insert(function, module.load_function(function)?);
            }
        }
        let max_shared_per_block = context
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let device = GpuDevice {
            stream: context.default_stream(),
            name: context.name()?,
            context,
            arch,
            decode_kernel: DecodeKernel::from_env()?,
            prefill_kernel: PrefillKernel::from_env()?,
            max_shared_per_block: u32::try_from(max_shared_per_block).unwrap_or(0),
            decode_partials: Mutex::new(DecodePartials::default()),
            functions,
        };
        device.allow_tensor_core_prefill()?;
        Ok(device)
    }

    /// A loaded kernel function.
    ///
    /// # Panics
    /// If `name` is not listed in [`KERNELS`]: a programming error, caught by the GPU tests.
    pub fn function(&self, name: &str) -> &CudaFunction {
        self.functions
            .get(name)
            .unwrap_or_else(|| panic!("kernel function `{name}` is not listed in KERNELS"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA"] {
            assert!(
                matches!(bad.parse::<DeviceSpec>(), Err(CudaError::BadDeviceName(_))),
                "{bad}"
            );
        }
        assert_eq!(DeviceSpec::Cuda(2).to_string(), "cuda:2");
    }

    #[test]
    fn a_machine_without_a_driver_gets_an_error_not_a_panic() {
        if driver_present() {
            return; // a GPU box: the GPU suite covers opening the device
        }
        assert!(matches!(GpuDevice::open(0), Err(CudaError::DriverMissing)));
    }
}
